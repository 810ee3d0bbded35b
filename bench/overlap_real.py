#!/usr/bin/env python3
"""Overlap on real compute: mlp_train (16 x Linear(512, 512), world 2 as threads, AdamW, 1 MiB
buckets, its default loss logging) on the simulated link, with the link's time per iteration set to
--ratios x the iteration's compute (the same run over the in-process backend, no link).

efficiency = (T_comp + T_comm - T_iter) / min(T_comp, T_comm): 1 when the shorter of compute and
link hides entirely behind the longer, 0 when they add up. T_comm is the link model's own time for
the iteration's collectives (Note [Simulated link]: rs/ag (N-1)(alpha + B/(N beta)) per bucket),
T_iter the run's median iteration. Every configuration once per round, --reps rounds (A B A B).
Beside each, the run's own bound (median of stats' bound_ms, Note [The iteration's bound]: the
shortest iteration any schedule could reach with that run's measured times), T_iter / bound (the
median over the runs of each run's median of its iterations' own ratios, stats' over_bound; and
the ratio of the two medians), and the efficiency an iteration at that bound would have: the most
the efficiency can be.

    python3 bench/overlap_real.py --build build [--stage 2] [--ratios 1,2] [--reps 3] [--modes a,b] [--baseline OLD_BUILD]
                                  [--optimizer adamw|sgd] [--skew]

--skew traces each run and prints how long the link stood idle while one rank's collective waited
for the other rank's (bench/trace_skew.py): a wait each rank's own bound cannot see.

--baseline runs every mode on a second build too, in the same rounds (A B A B), on the link solved
from --build's compute time, and prints both with their ratio new/old.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from trace_skew import waits_for_other_ranks

LAYERS, WIDTH, WORLD, BATCH = 16, 512, 2, 64
LATENCY_US = 10.0
MODES = {"none": ["--overlap", "none"], "after_backward": ["--overlap", "after_backward"],
         "interleaved": ["--overlap", "interleaved"], "interleaved + prefetch": ["--overlap", "interleaved", "--forward-prefetch"]}


def run(build, stage, flags, tmp, steps, optimizer, skew=False):
    stats = os.path.join(tmp, "stats.json")
    trace = os.path.join(tmp, "trace.json")
    cmd = [os.path.join(build, "examples/mlp_train"), "--sizes", ",".join([str(WIDTH)] * (LAYERS + 1)), "--steps", str(steps),
           "--global-batch", str(BATCH), "--world-size", str(WORLD), "--optimizer", optimizer, "--lr", "1e-3",
           "--zero-stage", str(stage), "--first-bucket-mb", "1", "--bucket-mb", "1", "--stats-json", stats, *flags]
    if skew:
        cmd += ["--trace", trace]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    if out.returncode != 0:
        sys.exit("overlap_real: mlp_train failed:\n" + out.stdout)
    with open(stats) as f:
        median = json.load(f)["median"]
    # The link's idle time while one rank waited for the other, median over the iterations
    # (bench/trace_skew.py): what a rank's own bound cannot see.
    waited = statistics.median(idle for _, idle in waits_for_other_ranks(trace)) if skew else None
    return median["iteration_ms"], median.get("bound_ms", 0.0), median.get("over_bound", 0.0), waited


def link_ms(stage, gbytes_per_s):
    """The sim link's time for one iteration: per layer-sized bucket a reduction and (stage >= 1) a sync."""
    bucket = (WIDTH * WIDTH + WIDTH) * 4
    per_op = (WORLD - 1) * (LATENCY_US * 1e3 + bucket / WORLD / gbytes_per_s) / 1e6  # ms; 1 GB/s = 1 byte/ns
    ops = 2 if stage >= 1 else 0
    if stage == 0:
        per_op *= 2  # an all-reduce: twice a reduce-scatter's steps
        ops = 1
    return LAYERS * ops * per_op


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--ratios", default="1,2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    ap.add_argument("--baseline", help="a second build (the tree before a change) run in the same rounds")
    ap.add_argument("--optimizer", default="adamw", help="mlp_train's --optimizer (sgd: a step that costs almost nothing)")
    ap.add_argument("--skew", action="store_true",
                    help="trace each run and report the link's idle time while one rank waited for the other (bench/trace_skew.py)")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    modes = {m: MODES[m] for m in args.modes.split(",")}
    builds = {"": build} if not args.baseline else {"old ": os.path.abspath(args.baseline), "new ": build}
    ratios = [float(r) for r in args.ratios.split(",")]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        comp = [run(build, args.stage, ["--overlap", "interleaved"], tmp, args.steps, args.optimizer)[0] for _ in range(args.reps)]
        t_comp = statistics.median(comp)
        print("compute alone (in-process backend, no link): %.2f ms (%s)" % (t_comp, ", ".join("%.2f" % c for c in comp)), flush=True)
        for ratio in ratios:
            # Solve the link's bandwidth for T_comm = ratio x T_comp.
            target = ratio * t_comp
            fixed = link_ms(args.stage, 1e30)
            gbps = (link_ms(args.stage, 1.0) - fixed) / (target - fixed)
            t_comm = link_ms(args.stage, gbps)
            sim = ["--backend", "sim", "--sim-latency-us", str(LATENCY_US), "--sim-gbytes-per-s", "%.6f" % gbps]
            runs = {b + m: [] for m in modes for b in builds}
            for _ in range(args.reps):
                for m, flags in modes.items():
                    for b, path in builds.items():
                        runs[b + m].append(run(path, args.stage, sim + flags, tmp, args.steps, args.optimizer, args.skew))
            print("\nlink/compute %.1f: link %.2f GB/s, T_comm %.2f ms" % (ratio, gbps, t_comm), flush=True)
            res = {}
            for m, v in runs.items():
                t_iter = statistics.median(x for x, _, _, _ in v)
                bound = statistics.median(b for _, b, _, _ in v)
                # Each run's median of its iterations' own T_iter / bound (stats' over_bound).
                over = statistics.median(o for _, _, o, _ in v)
                waited = statistics.median(w for _, _, _, w in v) if args.skew else None
                eff = (t_comp + t_comm - t_iter) / min(t_comp, t_comm)
                # The most the efficiency could be: an iteration at its own bound.
                ceiling = (t_comp + t_comm - bound) / min(t_comp, t_comm) if bound > 0 else None
                res[m] = {"runs_ms": [x for x, _, _, _ in v], "median_ms": t_iter, "efficiency": eff, "bound_ms": bound,
                          "over_bound": over or None, "medians_over_bound": t_iter / bound if bound > 0 else None,
                          "efficiency_at_bound": ceiling}
                if args.skew:
                    res[m]["link_idle_for_other_rank_ms"] = waited
                print("  %-28s %7.2f ms  efficiency %.2f (%.2f at the bound)  bound %6.2f ms  T_iter/bound %.3f (of the medians %.3f)  (%s)" %
                      (m, t_iter, eff, ceiling if ceiling is not None else float("nan"), bound, over,
                       t_iter / bound if bound > 0 else float("nan"), ", ".join("%.2f" % x for x, _, _, _ in v)),
                      flush=True)
                if args.skew:
                    print("  %-28s link idle while one rank waited for the other: %.2f ms an iteration (medians; %s); T_iter - bound %.2f ms" %
                          ("", waited, ", ".join("%.2f" % w for _, _, _, w in v), t_iter - bound), flush=True)
            if args.baseline:
                for m in modes:
                    print("  new/old %-20s %.3f" % (m, res["new " + m]["median_ms"] / res["old " + m]["median_ms"]), flush=True)
            out["ratio %.1f" % ratio] = {"t_comp_ms": t_comp, "t_comm_ms": t_comm, "gbytes_per_s": gbps, "modes": res}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
