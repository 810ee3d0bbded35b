#!/usr/bin/env python3
"""Draws bench_zero --memory's JSON (--json) as one PNG: per configuration, rank 0's model-state
memory and the process's OS peak RSS, each over its ZeRO formula (bars), with the 1.05 and 1.25
goals as lines.

    build/bench/bench_zero --memory --json zero_memory.json && bench/plot_zero_memory.py zero_memory.json -o bench/results/zero_memory.png"""
import json

from plot_common import json_to_png


def main():
    a, plt = json_to_png(__doc__, "plot_zero_memory")
    points = json.load(open(a.json))
    labels = [f"w{p['world']} s{p['stage']}" + (f"\n{p['partition']}" if p["partition"] != "-" else "") for p in points]
    x = range(len(points))
    fig, ax = plt.subplots(figsize=(max(8, 0.75 * len(points)), 4.5))
    w = 0.38
    state = [p["state_over_formula"] for p in points]
    rss = [p["rss_over_formula"] for p in points]
    ax.bar([i - w / 2 for i in x], state, w, label="rank 0 model state / formula", color="tab:blue")
    ax.bar([i + w / 2 for i in x], rss, w, label="process peak RSS / (N x formula + data + activations)", color="tab:orange")
    ax.axhline(1.05, color="tab:blue", ls="--", lw=0.8, label="1.05 (model state goal)")
    ax.axhline(1.25, color="tab:orange", ls="--", lw=0.8, label="1.25 (peak RSS goal)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("measured / formula")
    ax.set_ylim(0, max(max(state), max(rss)) * 1.15)
    ax.set_title("8 x Linear(1024,1024), AdamW: memory against the ZeRO formula (w: world, s: stage)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(a.output, dpi=110)


if __name__ == "__main__":
    main()
