# The ZeRO-1 two-level row with twins at 2 x 2 over 1 Gbit/s, with extra mlp_train flags per variant; rank 0's medians.
import json, os, sys, tempfile
sys.path.insert(0, "/work/main/bench")
import two_hosts as th
build = "/work/main/build"
base = th.SHARDFLOW_ROWS["shardflow ZeRO-1 interleaved + prefetch, two levels, redundancy 2"]
plain = th.SHARDFLOW_ROWS["shardflow ZeRO-1 interleaved + prefetch, two levels"]
variants = [("no twins", plain, []), ("twins", base, []), ("twins, lag 5", base, ["--interleave-lag", "5"]),
            ("twins, syncs after backward", base, ["--prefetch-syncs-in-backward", "0"]), ("no twins, lag 5", plain, ["--interleave-lag", "5"])]
th.sh("up", th.NAME)
try:
    th.sh("rate", th.NAME, "1gbit")
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o777)
        for rnd in range(2):
            for name, flags, extra in variants:
                stats = os.path.join(tmp, "stats.json")
                prog = th.mlp_cmd(build, th.MODELS["1024x8"], th.TABLE_STEPS, 4, flags + extra, stats)
                th.run_both([th.launcher(build, h, n, 2, 2, prog) for h, n in (("a", 0), ("b", 1))], name)
                m = json.load(open(stats))["median"]
                print("round %d %-30s iteration %.1f ms, exposed %.1f, optimizer %.1f, compute %.1f" %
                      (rnd + 1, name, m["iteration_ms"], m["exposed_ms"], m["optimizer_ms"], m["compute_ms"]), flush=True)
finally:
    th.sh("down", th.NAME)
