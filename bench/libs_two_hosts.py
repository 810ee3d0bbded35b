#!/usr/bin/env python3
"""One trainer's steady iteration on two network-namespace hosts, under several builds of
libshardflow alternated (A B A B): `mlp_train` over the launchers of bench/two_hosts.py, the same
binary each time, the library picked by LD_LIBRARY_PATH (a build's library copied aside before a
change, against the build after it). Prints each run's median iteration (the runtime's own,
--stats-json) and each library's median.

Root only. Usage:
    sudo /usr/bin/python3 bench/libs_two_hosts.py --build build --libs /tmp/oldlib,build --rounds 3 \\
        [--ranks-per-host 2] [--backend hierarchical] [--sizes 4096,4096] [--rate 1gbit] [-- extra mlp_train flags]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import two_hosts as th  # noqa: E402  (the netns pair and its launchers)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--libs", required=True, help="comma-separated directories holding a libshardflow.so, alternated in this order")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks-per-host", type=int, default=2)
    ap.add_argument("--backend", default="hierarchical")
    ap.add_argument("--sizes", default="4096,4096")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rate", default="1gbit", help="the link's rate (tc tbf), or off")
    ap.add_argument("extra", nargs="*", help="more mlp_train flags (after --)")
    a = ap.parse_args()
    libs = [os.path.abspath(l) for l in a.libs.split(",")]
    build = os.path.abspath(a.build)
    sizes = [int(s) for s in a.sizes.split(",")]
    flags = ["--backend", a.backend, "--zero-stage", "1", "--overlap", "interleaved", *a.extra]
    th.sh("up", th.NAME)
    th.sh("rate", th.NAME, a.rate)
    runs = {lib: [] for lib in libs}
    try:
        for _ in range(a.rounds):
            for lib in libs:
                with tempfile.TemporaryDirectory() as tmp:
                    stats = os.path.join(tmp, "stats.json")
                    prog = th.mlp_cmd(build, sizes, a.steps, 2 * a.ranks_per_host, flags, stats)
                    th.run_both([th.launcher(build, h, n, 2, a.ranks_per_host, prog) for h, n in (("a", 0), ("b", 1))],
                                "the run with " + lib, env=dict(th.ENV, LD_LIBRARY_PATH=lib))
                    with open(stats) as f:
                        ms = json.load(f)["median"]["iteration_ms"]
                    runs[lib].append(ms)
                    print("%s: iteration %.1f ms" % (lib, ms), flush=True)
    finally:
        th.sh("down", th.NAME)
    for lib, v in runs.items():
        print("%s: median %.1f ms (runs %s)" % (lib, statistics.median(v), ", ".join("%.1f" % x for x in v)))


if __name__ == "__main__":
    main()
