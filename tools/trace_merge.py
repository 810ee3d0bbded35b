#!/usr/bin/env python3
"""Merges the Chrome traces of one run (one file per rank under a launcher: t.rank0.json,
t.rank1.json, ...) into one file that ui.perfetto.dev or chrome://tracing shows with every rank.

    tools/trace_merge.py t.rank*.json -o t.json

Ranks are the trace's process ids, so files of different ranks never collide; all ranks of a host
share the wall clock, so their spans line up. A rank that appears in two inputs is an error (two
runs mixed up)."""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", help="trace files of one run")
    ap.add_argument("-o", "--output", required=True, help="merged trace to write")
    a = ap.parse_args()
    events, owner = [], {}
    for path in a.traces:
        try:
            with open(path) as f:
                t = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"trace_merge: cannot read '{path}': {e}")
        evs = t["traceEvents"] if isinstance(t, dict) else t
        for pid in {e.get("pid") for e in evs}:
            if pid in owner:
                sys.exit(f"trace_merge: rank {pid} is in both '{owner[pid]}' and '{path}' (traces of two runs?)")
            owner[pid] = path
        events.extend(evs)
    with open(a.output, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    print(f"trace_merge: {len(a.traces)} file(s), ranks {sorted(owner)} -> {a.output}")


if __name__ == "__main__":
    main()
