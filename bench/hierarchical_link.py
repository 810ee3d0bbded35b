#!/usr/bin/env python3
"""Several ranks per host (issue 34): 2 network-namespace hosts x 2 ranks over a tc-tbf-limited
link (scripts/netns_pair.sh), mlp_train with the flat Gloo ring (--backend gloo) against the two
levels (--backend hierarchical: shm inside a host, Gloo between hosts), and the host's compute: the
same 2 ranks of one host alone (shm, the same per-rank batch, nothing on the link), alternated
A B C A B C. Per run: rank 0's median iteration (--stats-json) and the bytes that crossed the link,
read from host a's veth counters and divided by the steps. The link time for a run's bytes is the
busier direction's bytes over the rate. Medians over the rounds.

  sudo /usr/bin/python3 bench/hierarchical_link.py --build build [--rate 1gbit] [--rounds 3] [--steps 30] \\
      [--sizes 1024x8] [--stage 1] [--prefetch] [--two-by-one] [--torch] [--trainer-flag=FLAG ...]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import two_hosts  # noqa: E402  (the netns pair and its launchers)


def counters():
    def read(what):
        p = subprocess.run(["ip", "netns", "exec", two_hosts.NAME + "-a", "cat",
                            "/sys/class/net/%sa/statistics/%s_bytes" % (two_hosts.NAME, what)],
                           stdout=subprocess.PIPE, text=True, check=True)
        return int(p.stdout)
    return read("tx"), read("rx")


def rate_bytes_per_s(rate):
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[:-len(u)]) * f / 8
    sys.exit("hierarchical_link: --rate %r is not NNkbit, NNmbit or NNgbit" % rate)


# (iteration ms, bytes across the link per step, link ms per step: the busier direction over the rate)
def one_run(a, what, tmp):
    stats = os.path.join(tmp, "stats.json")
    flags = ["--zero-stage", str(a.stage), "--overlap", "interleaved"] + (["--forward-prefetch"] if a.prefetch else []) + a.trainer_flag
    if what == "compute":  # one host's two ranks alone
        prog = two_hosts.mlp_cmd(a.build, two_hosts.MODELS[a.sizes], a.steps, 2, ["--backend", "shm"] + flags, stats)
        launchers = [two_hosts.launcher(a.build, "a", 0, 1, 2, prog)]
    elif what.startswith("PyTorch"):  # DDP (+ ZeroRedundancyOptimizer), Gloo's flat ring over the same link
        for f in ("torch_store", "torch.json"):
            if os.path.exists(os.path.join(tmp, f)):
                os.remove(os.path.join(tmp, f))
        worker = os.path.join(HERE, "peers", "torch_mlp_worker.py")
        mode = "zero" if "ZeRO" in what else "ddp"
        launchers = [["ip", "netns", "exec", "%s-%s" % (two_hosts.NAME, h), "env", "GLOO_SOCKET_IFNAME=%s%s" % (two_hosts.NAME, h),
                      "/usr/bin/python3", worker, str(r), "4", os.path.join(tmp, "torch_store"),
                      ",".join(map(str, two_hosts.MODELS[a.sizes])), str(a.steps), mode, os.path.join(tmp, "torch.json")]
                     for h, r in (("a", 0), ("a", 1), ("b", 2), ("b", 3))]
        tx0, rx0 = counters()
        two_hosts.run_both(launchers, what)
        tx1, rx1 = counters()
        with open(os.path.join(tmp, "torch.json")) as f:
            ms = json.load(f)["median_step_ms"]
        busier = max(tx1 - tx0, rx1 - rx0) / a.steps
        return ms, (tx1 - tx0 + rx1 - rx0) / a.steps, 1e3 * busier / rate_bytes_per_s(a.rate)
    elif what == "2x1 gloo":  # one rank per host: the two levels' bytes each way, on one flow each way
        prog = two_hosts.mlp_cmd(a.build, two_hosts.MODELS[a.sizes], a.steps, 2, ["--backend", "gloo"] + flags, stats)
        launchers = [two_hosts.launcher(a.build, h, n, 2, 1, prog) for h, n in (("a", 0), ("b", 1))]
    else:
        prog = two_hosts.mlp_cmd(a.build, two_hosts.MODELS[a.sizes], a.steps, 4, ["--backend", what] + flags, stats)
        launchers = [two_hosts.launcher(a.build, h, n, 2, 2, prog) for h, n in (("a", 0), ("b", 1))]
    tx0, rx0 = counters()
    two_hosts.run_both(launchers, what)
    tx1, rx1 = counters()
    with open(stats) as f:
        ms = json.load(f)["median"]["iteration_ms"]
    busier = max(tx1 - tx0, rx1 - rx0) / a.steps
    return ms, (tx1 - tx0 + rx1 - rx0) / a.steps, 1e3 * busier / rate_bytes_per_s(a.rate)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sizes", default="1024x8", choices=sorted(two_hosts.MODELS))
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--prefetch", action="store_true", help="--forward-prefetch")
    ap.add_argument("--trainer-flag", action="append", default=[], metavar="FLAG",
                    help="one more mlp_train argument for every run (repeat: --trainer-flag=--interleave-lag --trainer-flag=1)")
    ap.add_argument("--torch", action="store_true",
                    help="also PyTorch DDP (stage 0) or DDP + ZeroRedundancyOptimizer (stage 1, 2) at 2 x 2 over the same link (python3-torch)")
    ap.add_argument("--two-by-one", action="store_true",
                    help="also 2 hosts x 1 rank over the flat ring: the same bytes each way as the two levels' 2 x 2")
    a = ap.parse_args()
    a.build = os.path.abspath(a.build)
    if os.geteuid() != 0:
        sys.exit("hierarchical_link: root only (network namespaces)")
    two_hosts.sh("up", two_hosts.NAME)
    res = {"gloo": [], "hierarchical": [], "compute": []}
    if a.two_by_one:
        res["2x1 gloo"] = []
    if a.torch:
        res["PyTorch DDP" if a.stage == 0 else "PyTorch ZeRO"] = []
    try:
        two_hosts.sh("rate", two_hosts.NAME, a.rate)
        with tempfile.TemporaryDirectory() as tmp:
            os.chmod(tmp, 0o777)
            for _ in range(a.rounds):
                for b in res:
                    res[b].append(one_run(a, b, tmp))
    finally:
        two_hosts.sh("down", two_hosts.NAME)
    print("2 hosts x 2 ranks, link %s, model %s, ZeRO-%d interleaved%s, %d steps, %d rounds A B C A B C" %
          (a.rate, a.sizes, a.stage, " + forward prefetch" if a.prefetch else "", a.steps, a.rounds))
    med = {}
    for b, runs in res.items():
        med[b] = tuple(statistics.median(r[k] for r in runs) for k in range(3))
        print("  %-13s median iteration %8.1f ms   %7.1f MB across the link per step (link time %6.1f ms)   (rounds: %s)" %
              (b if b != "compute" else "1 host alone", med[b][0], med[b][1] / 1e6, med[b][2],
               ", ".join("%.1f ms / %.1f MB" % (r[0], r[1] / 1e6) for r in runs)))
        if b != "compute" and med[b][2] > 0:
            print("  %-13s   step / its link time = %.3f" % ("", med[b][0] / med[b][2]))
    h, g, c = med["hierarchical"], med["gloo"], med["compute"]
    floor = max(h[2], c[0])
    print("  hierarchical / gloo: step %.3f, bytes %.3f; hierarchical step / max(its link time %.1f ms, the host's compute %.1f ms) = %.3f" %
          (h[0] / g[0], h[1] / g[1], h[2], c[0], h[0] / floor))


if __name__ == "__main__":
    main()
