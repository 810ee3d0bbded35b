#!/usr/bin/env python3
"""How long the link stood idle because one rank's collective waited for the other's, per iteration,
from the timeline traces of every rank on one machine: one file of a world run as threads in one
process (mlp_train --world-size N --trace t.json), or a file per rank (trace.rank0.json, ...: the
processes of bench/two_hosts.py's network-namespace hosts), whose times are the same monotonic
clock.

A collective moves nothing until every rank has issued it. Each rank's bound on its iteration (Note
[The iteration's bound]) is computed from its own times, so a reduction that waited for a later
rank's gradient counts there as a schedule's loss although no schedule could have started it
sooner. For each collective in rank order: the link's idle time while the earlier ranks waited for
the last one, max(0, last issue - max(first issue, the previous collective's end)), summed over the
iteration. (Checked on the 16 x Linear(512, 512) run of bench/overlap_real.py: from the last issue
on, with the link free, a collective took its simulated time, 0.65 ms median.)

    python3 bench/trace_skew.py t.json [--skip 5]
    python3 bench/trace_skew.py trace.rank0.json trace.rank1.json
"""
import argparse
import json
import statistics


def spans(events, pid, tid):
    return sorted((e for e in events if e.get("ph") == "X" and e.get("pid") == pid and e.get("tid") == tid), key=lambda e: e["ts"])


def waits_for_other_ranks(paths, skip=5):
    """[(iteration ms, link ms idle while a rank waited for another)] for the first rank's iterations
    after the first `skip`. `paths`: one trace file or several (one per rank)."""
    events = []
    for path in [paths] if isinstance(paths, str) else paths:
        with open(path) as f:
            trace = json.load(f)
        events += trace["traceEvents"] if isinstance(trace, dict) else trace
    ranks = sorted({e["pid"] for e in events if e.get("ph") == "X"})
    # The trace's lanes (Timeline's Lane): 2 the comm stream, 6 the iteration.
    iterations = spans(events, ranks[0], 6)
    links = [spans(events, r, 2) for r in ranks]
    if len({len(l) for l in links}) != 1:
        raise SystemExit("trace_skew: the ranks' comm streams hold different numbers of collectives: " + ", ".join(str(len(l)) for l in links))
    ops = list(zip(*links))
    for k, op in enumerate(ops):
        if len({e["name"] for e in op}) != 1:
            raise SystemExit("trace_skew: collective #%d differs between the ranks: %s" % (k, ", ".join(e["name"] for e in op)))
    out = []
    for it in iterations[skip:]:
        begin, end = it["ts"], it["ts"] + it["dur"]
        idle, previous_end = 0.0, None
        for op in ops:
            first, last = min(e["ts"] for e in op), max(e["ts"] for e in op)
            if begin <= op[0]["ts"] < end:
                free = first if previous_end is None else previous_end
                idle += max(0.0, last - max(first, free))
            if op[0]["ts"] < end:
                previous_end = max(e["ts"] + e["dur"] for e in op)
        out.append((it["dur"] / 1e3, idle / 1e3))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", help="one trace holding every rank, or one per rank")
    ap.add_argument("--skip", type=int, default=5, help="iterations left out at the start (warm-up, the lag's and prefetch's choices)")
    args = ap.parse_args()
    rows = waits_for_other_ranks(args.traces, args.skip)
    for ms, idle in rows:
        print("iteration %7.2f ms  link idle while a rank waited for another %6.2f ms" % (ms, idle))
    print("median: iteration %.2f ms, link idle while a rank waited for another %.2f ms (%d iterations)" %
          (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows), len(rows)))


if __name__ == "__main__":
    main()
