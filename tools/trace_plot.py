#!/usr/bin/env python3
"""Draws shardflow traces (Config::trace.path, mlp_train --trace) as a PNG Gantt chart: per rank a
lane for compute (forward, backward, the trainer's waits), one for the comm stream (reductions,
parameter syncs) and one for the optimizer shard (steps, unpacks). Time the trainer was held up by
the runtime (exposed communication) is shaded red across the rank's lanes. The title gives the
figures of the iterations shown.

    tools/trace_plot.py t.json [more traces of the same run] -o t.png [--iteration N] [--count K]

By default it shows two iterations starting at the one whose length is the median of those after
the first five (warm-up, the bucket rebuild)."""
import argparse
import json
import sys

COLORS = {"forward": "#4C72B0", "backward": "#55A868", "reduce": "#C44E52", "sync": "#8172B2", "step": "#CCB974",
          "cast": "#64B5CD", "wait": "#E8A0A0", "rebuild": "#999999"}
LANES = [(1, "compute"), (2, "comm"), (3, "optimizer"), (4, "cast"), (5, "cast")]  # trace tid -> row


def load(paths):
    events = []
    for p in paths:
        try:
            with open(p) as f:
                t = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"trace_plot: cannot read '{p}': {e}")
        events.extend(t["traceEvents"] if isinstance(t, dict) else t)
    return events


def union(intervals):
    total, cur = 0, None
    for b, e in sorted(intervals):
        if cur and b <= cur[1]:
            cur[1] = max(cur[1], e)
        else:
            if cur:
                total += cur[1] - cur[0]
            cur = [b, e]
    return total + (cur[1] - cur[0] if cur else 0)


def clip(spans, lo, hi):
    return [(max(s["ts"], lo), min(s["ts"] + s["dur"], hi)) for s in spans if s["ts"] + s["dur"] > lo and s["ts"] < hi]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("-o", "--output", required=True, help="PNG to write")
    ap.add_argument("--iteration", type=int, default=None, help="first iteration to show (default: the median one)")
    ap.add_argument("--count", type=int, default=2, help="iterations to show")
    a = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        sys.exit("trace_plot: needs matplotlib: apt-get install python3-matplotlib (`make deps` installs it)")

    events = [e for e in load(a.traces) if e.get("ph") in ("X", "i")]
    ranks = sorted({e["pid"] for e in events})
    iters = sorted((e for e in events if e.get("cat") == "iteration" and e["pid"] == ranks[0]), key=lambda e: e["ts"])
    if not iters:
        sys.exit("trace_plot: no iteration spans in the trace (did the run finish an iteration?)")
    if a.iteration is None:
        pool = iters[5:] if len(iters) > 6 else iters
        pool = pool[: max(1, len(pool) - a.count + 1)]
        first = sorted(pool, key=lambda e: e["dur"])[len(pool) // 2]
    else:
        match = [e for e in iters if e["args"].get("iteration") == a.iteration]
        if not match:
            sys.exit(f"trace_plot: no iteration {a.iteration} (the trace has {iters[0]['args']['iteration']}.."
                     f"{iters[-1]['args']['iteration']})")
        first = match[0]
    k = iters.index(first)
    shown = iters[k:k + a.count]
    lo, hi = shown[0]["ts"], shown[-1]["ts"] + shown[-1]["dur"]

    # Figures of the window, rank 0 (the same definitions as Runtime::stats()).
    r0 = [e for e in events if e["pid"] == ranks[0] and e["ph"] == "X"]
    waits = clip([e for e in r0 if e.get("cat") == "wait" and e["tid"] == 1], lo, hi)
    link = clip([e for e in r0 if e["tid"] == 2], lo, hi)
    steps = clip([e for e in r0 if e.get("cat") == "step" and e["tid"] == 3], lo, hi)
    n = len(shown)
    it_ms = (hi - lo) / 1e3 / n
    exposed = union(waits) / 1e3 / n
    link_ms = union(link) / 1e3 / n
    hidden = (union(link + waits) - union(waits)) / 1e3 / n
    opt_ms = union(steps) / 1e3 / n

    fig_h = 1.0 + 1.3 * len(ranks)
    fig, ax = plt.subplots(figsize=(13, fig_h))
    yticks, ylabels = [], []
    row = 0
    for r in ranks:
        rows = {}
        for tid, label in LANES:
            if label in rows.values() and tid in (4, 5):
                rows[tid] = rows[4]
                continue
            if any(e["pid"] == r and e["tid"] == tid for e in events) or tid <= 3:
                rows[tid] = row
                yticks.append(row)
                ylabels.append(f"rank {r} {label}")
                row += 1
        top, bottom = min(rows.values()), max(rows.values())
        for e in events:
            if e["pid"] != r or e["tid"] not in rows or e["ph"] != "X" or e.get("cat") == "iteration":
                continue
            b, d = e["ts"], e["dur"]
            if b + d < lo or b > hi:
                continue
            y = rows[e["tid"]]
            cat = e.get("cat", "")
            if cat == "wait":  # exposed: shaded across the rank's lanes
                x0, x1 = (max(b, lo) - lo) / 1e3, (min(b + d, hi) - lo) / 1e3
                ax.add_patch(Rectangle((x0, top - 0.5), x1 - x0, bottom - top + 1, color="#F4CCCC", alpha=0.45, lw=0, zorder=0))
                ax.barh(y, d / 1e3, left=(b - lo) / 1e3, height=0.5, color=COLORS["wait"], hatch="//", edgecolor="#C44E52", lw=0.3, zorder=3)
                continue
            # Nested spans (the trainer's waits inside backward) are drawn thinner on top.
            ax.barh(y, d / 1e3, left=(b - lo) / 1e3, height=0.8, color=COLORS.get(cat, "#BBBBBB"), edgecolor="white", lw=0.3)
        for e in events:  # gradients as ticks
            if e["pid"] == r and e["ph"] == "i" and lo <= e["ts"] <= hi:
                ax.plot([(e["ts"] - lo) / 1e3] * 2, [rows[1] - 0.45, rows[1] - 0.3], color="black", lw=0.6)
        ax.axhline(bottom + 0.5, color="#DDDDDD", lw=0.8)
    for it in shown[1:]:
        ax.axvline((it["ts"] - lo) / 1e3, color="black", ls="--", lw=0.8)
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, (hi - lo) / 1e3)
    ax.set_xlabel("ms")
    first_it = shown[0]["args"].get("iteration")
    ax.set_title(f"iteration{'s' if n > 1 else ''} {first_it}{'-' + str(first_it + n - 1) if n > 1 else ''} (rank {ranks[0]}, per "
                 f"iteration): {it_ms:.2f} ms, compute {it_ms - exposed:.2f} ms, link {link_ms:.2f} ms, hidden {hidden:.2f} ms, "
                 f"exposed {exposed:.2f} ms, optimizer {opt_ms:.2f} ms", fontsize=9)
    handles = [Patch(color=c, label=k) for k, c in COLORS.items() if any(e.get("cat") == k for e in events)]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.1 / len(ranks)), ncol=len(handles), fontsize=8,
              frameon=False)
    fig.tight_layout()
    fig.savefig(a.output, dpi=110)
    print(f"trace_plot: {a.output} (iterations {first_it}..{first_it + n - 1}, {len(ranks)} rank(s))")


if __name__ == "__main__":
    main()
