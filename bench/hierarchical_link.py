#!/usr/bin/env python3
"""Several ranks per host (issue 34): 2 network-namespace hosts x 2 ranks over a tc-tbf-limited
link (scripts/netns_pair.sh), mlp_train with the flat Gloo ring (--backend gloo) against the two
levels (--backend hierarchical: shm inside a host, Gloo between hosts), alternated A B A B. Per
run: rank 0's median iteration (--stats-json) and the bytes that crossed the link, read from host
a's veth counters (tx + rx) and divided by the steps. Medians over the rounds.

  sudo /usr/bin/python3 bench/hierarchical_link.py --build build [--rate 1gbit] [--rounds 3] [--steps 30] \\
      [--sizes 1024x8] [--stage 1]
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
    return read("tx") + read("rx")


def one_run(a, backend, tmp):
    stats = os.path.join(tmp, "stats.json")
    prog = two_hosts.mlp_cmd(a.build, two_hosts.MODELS[a.sizes], a.steps, 4,
                             ["--backend", backend, "--zero-stage", str(a.stage), "--overlap", "interleaved"], stats)
    before = counters()
    two_hosts.run_both([two_hosts.launcher(a.build, h, n, 2, 2, prog) for h, n in (("a", 0), ("b", 1))], backend)
    crossed = counters() - before
    with open(stats) as f:
        return json.load(f)["median"]["iteration_ms"], crossed / a.steps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sizes", default="1024x8", choices=sorted(two_hosts.MODELS))
    ap.add_argument("--stage", type=int, default=1)
    a = ap.parse_args()
    a.build = os.path.abspath(a.build)
    if os.geteuid() != 0:
        sys.exit("hierarchical_link: root only (network namespaces)")
    two_hosts.sh("up", two_hosts.NAME)
    res = {"gloo": [], "hierarchical": []}
    try:
        two_hosts.sh("rate", two_hosts.NAME, a.rate)
        with tempfile.TemporaryDirectory() as tmp:
            os.chmod(tmp, 0o777)
            for _ in range(a.rounds):
                for b in ("gloo", "hierarchical"):
                    res[b].append(one_run(a, b, tmp))
    finally:
        two_hosts.sh("down", two_hosts.NAME)
    print("2 hosts x 2 ranks, link %s, model %s, ZeRO-%d interleaved, %d steps, %d rounds A B A B" %
          (a.rate, a.sizes, a.stage, a.steps, a.rounds))
    med = {}
    for b, runs in res.items():
        ms = statistics.median(r[0] for r in runs)
        mb = statistics.median(r[1] for r in runs) / 1e6
        med[b] = (ms, mb)
        print("  %-13s median iteration %8.1f ms   %7.1f MB across the link per step   (rounds: %s)" %
              (b, ms, mb, ", ".join("%.1f ms / %.1f MB" % (r[0], r[1] / 1e6) for r in runs)))
    print("  hierarchical / gloo: step %.3f, bytes %.3f" % (med["hierarchical"][0] / med["gloo"][0], med["hierarchical"][1] / med["gloo"][1]))


if __name__ == "__main__":
    main()
