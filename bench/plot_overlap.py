#!/usr/bin/env python3
"""Draws bench_overlap's JSON (--json) as one PNG: overlap efficiency per mode over link time /
compute time, one panel per ZeRO stage, the 0.90 goal as a line.

    build/bench/bench_overlap --json overlap.json && bench/plot_overlap.py overlap.json -o bench/results/overlap.png"""
import json

from plot_common import json_to_png


def main():
    a, plt = json_to_png(__doc__, "plot_overlap")
    d = json.load(open(a.json))
    stages = sorted({p["stage"] for p in d["points"]})
    fig, axes = plt.subplots(1, len(stages), figsize=(6 * len(stages), 4), sharey=True, squeeze=False)
    for ax, st in zip(axes[0], stages):
        modes = []
        for p in d["points"]:
            if p["stage"] == st and p["mode"] not in modes:
                modes.append(p["mode"])
        for m in modes:
            pts = sorted((p["ratio"], p["efficiency"]) for p in d["points"] if p["stage"] == st and p["mode"] == m)
            if m == "bound":  # bench/overlap_bound.hpp: the best any runtime reaches on this model
                ax.plot([x for x, _ in pts], [y for _, y in pts], color="grey", ls=":", lw=2, label="bound (free hops, best K)")
            else:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=m)
        ax.axhline(0.9, color="black", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("link time / compute time")
        ax.set_title(f"ZeRO-{st}, world {d['world']}, {d['layers']} buckets of {d['bytes_per_layer'] / 1048576:.2f} MiB")
        ax.set_ylim(0, 1.1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("overlap efficiency")
    axes[0][-1].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(a.output, dpi=100)
    print(f"plot_overlap: {a.output}")


if __name__ == "__main__":
    main()
