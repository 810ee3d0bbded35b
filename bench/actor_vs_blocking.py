#!/usr/bin/env python3
"""The actor trainer's step against the blocking trainer's (issue: an actor-native API within 5 %).

examples/actor_trainer (a data loader, one actor per layer, a loss actor, each rank driven through
its rank actor) and examples/mlp_train (a thread per rank calling Runtime's blocking API) train the
same model on the same data with the same arithmetic (test_actor_api checks they end bit for bit).
They run in turn, A B A B, --rounds times; each run reports rank 0's median iteration time after
its first five steps (Runtime::stats(), --stats-json: from one wait's end to the next, the same
figure for both); the table gives each side's median over the rounds and the ratio of the medians,
and the ratio round by round.

  bench/actor_vs_blocking.py --build build [--rounds 5] [--steps 200] [--world 2] \\
      [--sizes 784,1024,1024,10] [--stage 1] [--overlap interleaved] [--batch 64] [--prefetch]

--pair A B compares two other trainer programs that take mlp_train's flags (say mlp_train of an
older build against this one's: B / A is reported as the second over the first).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run(a, program, stats):
    argv = [program if os.sep in program else os.path.join(a.build, "examples", program), "--sizes", a.sizes, "--steps", str(a.steps), "--global-batch", str(a.batch),
            "--world-size", str(a.world), "--optimizer", "adamw", "--zero-stage", str(a.stage), "--overlap", a.overlap,
            "--quiet", "--stats-json", stats]
    if a.prefetch:
        argv.append("--forward-prefetch")
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.exit("actor_vs_blocking: %s failed:\n%s" % (program, p.stdout[-3000:]))
    with open(stats) as f:
        return json.load(f)["median"]["iteration_ms"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", default="784,1024,1024,10")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--overlap", default="interleaved")
    ap.add_argument("--prefetch", action="store_true")
    ap.add_argument("--pair", nargs=2, metavar=("A", "B"), default=["mlp_train", "actor_trainer"])
    a = ap.parse_args()
    blocking, actors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        stats = os.path.join(tmp, "stats.json")
        for _ in range(a.rounds):
            blocking.append(run(a, a.pair[0], stats))
            actors.append(run(a, a.pair[1], stats))
    pairs = [x / b for x, b in zip(actors, blocking)]
    print("sizes %s, world %d, batch %d, ZeRO-%d %s%s, %d steps, %d rounds A B A B" %
          (a.sizes, a.world, a.batch, a.stage, a.overlap, " + forward prefetch" if a.prefetch else "", a.steps, a.rounds))
    print("  A %-22s median iteration %.3f ms  (rounds: %s)" % (a.pair[0], statistics.median(blocking), " ".join("%.3f" % x for x in blocking)))
    print("  B %-22s median iteration %.3f ms  (rounds: %s)" % (a.pair[1], statistics.median(actors), " ".join("%.3f" % x for x in actors)))
    print("  B / A                    %.3f  (round by round: median %.3f, min %.3f, max %.3f)" %
          (statistics.median(actors) / statistics.median(blocking), statistics.median(pairs), min(pairs), max(pairs)))


if __name__ == "__main__":
    main()
