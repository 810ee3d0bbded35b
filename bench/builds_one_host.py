#!/usr/bin/env python3
"""Two builds of the tree side by side on one host, A B A B: bench_ddp, bench_zero, bench_overlap
and mlp_train over shm (2 processes), each round running every bench of the first build, then the
second's. Prints the medians of the rounds and the ratio second / first for every row (for bench_overlap's
efficiency rows higher is better; its link is solved from each build's own instant-link
iteration, T_compute, so its T_iter rows carry that difference times the ratio plus one).

  python3 bench/builds_one_host.py --builds /tmp/old/build,build [--rounds 3] [--json out.json]

Each build runs its own binaries (the benches' options must be the same in both). bench_overlap runs
at stage 2 and both ratios given; the stage-1 ratio of the older build can be rescaled with
--stage1-ratio-scale (before 2026-11-27 a stage-1 ratio counted one all-reduce of link time, since
then a reduce-scatter and an all-gather: the old build's ratio 1.5 is the new one's 1).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import shardflow_mlp_runs as runs  # noqa: E402  the rows of torch_ddp_reference.py's shardflow side

ROW = re.compile(r"^\|\s*(.+?)\s*\|$")


def table_rows(text, key_cols, value_cols):
    """[(row key, [ms of each value column])] from a markdown table printed by bench_ddp / bench_zero
    (cells "median / p90": the median)."""
    out = []
    for line in text.splitlines():
        m = ROW.match(line.strip())
        if not m:
            continue
        cells = [c.strip() for c in m.group(1).split("|")]
        if len(cells) <= max(value_cols) or not all(re.match(r"^[0-9.]+ /", cells[v]) for v in value_cols):
            continue
        out.append((" ".join(cells[k] for k in key_cols), [float(cells[v].split("/")[0]) for v in value_cols]))
    return out


def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"builds_one_host: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r.stdout


def bench_ddp(build):
    text = run([os.path.join(build, "bench/bench_ddp"), "--steps", "80"])
    out = {}
    for key, (world1, world2) in table_rows(text, [0, 1], [3, 4]):
        out[f"bench_ddp {key} world 1"] = world1
        out[f"bench_ddp {key} world 2"] = world2
    return out


def bench_zero(build):
    text = run([os.path.join(build, "bench/bench_zero"), "--bucket-mb", "2", "--steps", "60"])
    return {"bench_zero " + k: v[0] for k, v in table_rows(text, [0, 1, 2, 3], [5])}


def bench_overlap(build, stage, ratios, label_ratios):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "o.json")
        run([os.path.join(build, "bench/bench_overlap"), "--reps", "1", "--stages", str(stage), "--ratios",
             ",".join(map(str, ratios)), "--json", path])
        points = json.load(open(path))["points"]
    label = dict(zip(ratios, label_ratios))
    out = {}
    for p in points:
        if p["mode"] == "bound":
            continue
        r = min(ratios, key=lambda x: abs(x - p["ratio"]))
        name = f"bench_overlap stage {stage} {p['mode']} ratio {label[r]}"
        out[name + " (T_iter ms)"] = p["t_iteration_ms"]
        out[name + " (efficiency)"] = p["efficiency"]
        out[name + " (T_compute ms)"] = p["t_compute_ms"]
        out[name + " (link GB/s)"] = p["gbytes_per_s"]
    return out


def one_round(build, first, a):
    out = {}
    if "ddp" in a.only:
        out.update(bench_ddp(build))
    if "zero" in a.only:
        out.update(bench_zero(build))
    if "overlap" in a.only:
        scale = a.stage1_ratio_scale if first else 1.0
        for stage in a.overlap_stages:
            out.update(bench_overlap(build, stage, [r * (scale if stage == 1 else 1.0) for r in a.ratios], a.ratios))
    if "shm" in a.only:
        for name, sizes in runs.MODELS.items():
            for stage in (0, 1, 2):
                out[f"mlp_train shm world 2 {name} ZeRO-{stage}"] = runs.shardflow_world2(build, sizes, runs.steps_for(sizes), stage)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--builds", required=True, help="FIRST,SECOND: build folders (the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ratios", default="1,2", help="bench_overlap's link / compute ratios")
    ap.add_argument("--stage1-ratio-scale", type=float, default=1.0, help="the first build's stage-1 ratios are these x scale")
    ap.add_argument("--only", default="ddp,zero,overlap,shm", help="which benches: ddp, zero, overlap, shm (comma separated)")
    ap.add_argument("--overlap-stages", default="1,2", help="bench_overlap's ZeRO stages")
    ap.add_argument("--json")
    a = ap.parse_args()
    a.only = set(a.only.split(","))
    unknown = a.only - {"ddp", "zero", "overlap", "shm"}
    if unknown:
        sys.exit(f"builds_one_host: --only: unknown bench(es) {', '.join(sorted(unknown))}; expected ddp, zero, overlap, shm")
    a.overlap_stages = [int(x) for x in a.overlap_stages.split(",")]
    if a.stage1_ratio_scale != 1.0 and ("overlap" not in a.only or 1 not in a.overlap_stages):
        sys.exit("builds_one_host: --stage1-ratio-scale rescales bench_overlap's stage 1, which this run does not measure "
                 "(--only / --overlap-stages)")
    a.ratios = [float(x) for x in a.ratios.split(",")]
    builds = a.builds.split(",")
    if len(builds) != 2:
        sys.exit("builds_one_host: --builds takes two folders")
    rounds = [[], []]  # by position: the same folder twice measures the noise
    for i in range(a.rounds):
        for k, b in enumerate(builds):
            rounds[k].append(one_round(b, k == 0, a))
            print(f"round {i + 1}: {b} done", file=sys.stderr, flush=True)
    keys = list(rounds[0][0].keys())
    print(f"| row | {builds[0]} (rounds) | median | {builds[1]} (rounds) | median | second / first |")
    print("|---|---|---|---|---|---|")
    result = []
    for k in keys:
        va = [r[k] for r in rounds[0] if k in r]
        vb = [r[k] for r in rounds[1] if k in r]
        if not va or not vb:
            continue
        ma, mb = statistics.median(va), statistics.median(vb)
        fa = ", ".join(f"{v:.2f}" for v in va)
        fb = ", ".join(f"{v:.2f}" for v in vb)
        print(f"| {k} | {fa} | {ma:.3f} | {fb} | {mb:.3f} | {mb / ma:.3f} |")
        result.append({"row": k, "first": va, "second": vb, "ratio": mb / ma})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"builds": builds, "rounds": a.rounds, "rows": result}, f, indent=1)


if __name__ == "__main__":
    main()
