#!/usr/bin/env python3
"""What snapshots cost a step with forward prefetch (Note [The written word behind the syncs]).

mlp_train at world 2 (ranks as threads) on the simulated link, ZeRO-1 AdamW, four configurations
run in turn, round after round (A B C D A B C D ...): forward prefetch or not, a snapshot every K
steps or none. Each run prints its median iteration; this prints the median over the rounds and
the ratios that matter.

  /usr/bin/python3 bench/prefetch_snapshots.py --build build [--rounds 5] [--every 5]
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile


def run(mlp, prefetch, every, snaps):
    argv = [mlp, "--sizes", "1024,1024,1024,1024,10", "--steps", "40", "--world-size", "2", "--zero-stage", "1", "--optimizer",
            "adamw", "--backend", "sim", "--sim-gbytes-per-s", "0.5"]
    if prefetch:
        argv.append("--forward-prefetch")
    if every:
        shutil.rmtree(snaps, ignore_errors=True)
        argv += ["--snapshot-dir", snaps, "--snapshot-every", str(every)]
    out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True).stdout
    m = re.search(r"runtime \(rank 0, median\): iteration ([0-9.]+) ms", out)
    if not m:
        raise SystemExit("prefetch_snapshots: no median iteration in mlp_train's output:\n" + out)
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--every", type=int, default=5)
    a = ap.parse_args()
    mlp = os.path.join(a.build, "examples", "mlp_train")
    snaps = tempfile.mkdtemp(prefix="shardflow_prefetch_snapshots_")
    configs = [("prefetch, no snapshots", True, 0), ("prefetch, snapshot every %d" % a.every, True, a.every),
               ("no prefetch, no snapshots", False, 0), ("no prefetch, snapshot every %d" % a.every, False, a.every)]
    times = {c[0]: [] for c in configs}
    try:
        for _ in range(a.rounds):
            for name, prefetch, every in configs:
                times[name].append(run(mlp, prefetch, every, snaps))
    finally:
        shutil.rmtree(snaps, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print("| configuration | median iteration (ms) | min-max |")
    print("|---|---|---|")
    for name, _, _ in configs:
        print("| %s | %.1f | %.1f-%.1f |" % (name, med[name], min(times[name]), max(times[name])))
    n = configs
    print("snapshots' cost with prefetch: %.3f; without: %.3f; prefetch's gain with snapshots: %.3f, without: %.3f"
          % (med[n[1][0]] / med[n[0][0]], med[n[3][0]] / med[n[2][0]], med[n[1][0]] / med[n[3][0]], med[n[0][0]] / med[n[2][0]]))


if __name__ == "__main__":
    main()
