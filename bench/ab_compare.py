#!/usr/bin/env python3
"""A change that should not move performance, checked: bench_overhead and bench_overlap of two
builds, run alternately (A B A B ...) on the same machine, medians per row and the ratio B / A.

A shared, noisy machine makes one run of each meaningless; alternating rounds spreads the noise
over both sides, and the medians ignore the odd slow round. Build the tree before the change
beside the current one, for example:

  git worktree add /tmp/before <rev>
  cmake -S /tmp/before -B /tmp/before/build -G Ninja && cmake --build /tmp/before/build -j2 --target bench_overhead bench_overlap
  bench/ab_compare.py --before /tmp/before/build --after build --rounds 5

Each build directory's own libshardflow is used (LD_LIBRARY_PATH is set to it, for copied
binaries whose RUNPATH points elsewhere).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

OVERLAP_ARGS = ["--reps", "1", "--ratios", "0.5,1,2", "--modes", "none,interleaved,interleaved + prefetch"]


def binary(build, name):
    for path in (os.path.join(build, "bench", name), os.path.join(build, name)):
        if os.access(path, os.X_OK):
            return path
    sys.exit(f"ab_compare: no {name} under {build} (or {build}/bench): build it first")


def run(build, name, args):
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.abspath(build))
    out = subprocess.run([binary(build, name)] + args, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"ab_compare: {name} in {build} exited {out.returncode}:\n{out.stderr[-2000:]}")
    return out.stdout


def overhead_rows(build):
    rows = {}
    for line in run(build, "bench_overhead", ["--reps", "1"]).splitlines():
        m = re.match(r"\s{2}(\S.*?)\s{2,}([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", line)
        if m:
            rows[m.group(1)] = float(m.group(2))
    return rows


def overlap_rows(build):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        run(build, "bench_overlap", OVERLAP_ARGS + ["--json", f.name])
        points = json.load(open(f.name))["points"]
    return {f"stage {p['stage']} {p['mode']} at ratio {p['ratio']:g}": p["t_iteration_ms"] for p in points if p["mode"] != "bound"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="build directory of the tree before the change (A)")
    ap.add_argument("--after", required=True, help="build directory of the tree after it (B)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", choices=["overhead", "overlap"], help="one benchmark (default: both)")
    a = ap.parse_args()
    benches = [("overhead", overhead_rows, "ms / iteration"), ("overlap", overlap_rows, "T_iteration ms")]
    for name, rows_of, unit in benches:
        if a.only and a.only != name:
            continue
        seen = {"A": {}, "B": {}}
        for _ in range(a.rounds):
            for side, build in (("A", a.before), ("B", a.after)):
                for row, v in rows_of(build).items():
                    seen[side].setdefault(row, []).append(v)
        print(f"\nbench_{name}: {a.rounds} rounds A B A B, medians of {unit} (A = {a.before}, B = {a.after})")
        print(f"  {'row':52s} {'A':>9s} {'B':>9s} {'B / A':>7s}  {'A range':>17s} {'B range':>17s}")
        ratios = []
        for row, av in seen["A"].items():
            bv = seen["B"].get(row)
            if not bv:
                continue
            ma, mb = statistics.median(av), statistics.median(bv)
            ratios.append(mb / ma)
            print(f"  {row:52s} {ma:9.3f} {mb:9.3f} {mb / ma:7.3f}  {min(av):8.3f}-{max(av):<8.3f} {min(bv):8.3f}-{max(bv):<8.3f}")
        print(f"  geometric mean of B / A over {len(ratios)} rows: {statistics.geometric_mean(ratios):.3f}")


if __name__ == "__main__":
    main()
