#!/usr/bin/env python3
"""What the runtime's snapshots cost a training step (Note [Snapshots], Note [Snapshots in memory]).

mlp_train with snapshots off, in the launcher's memory, and on disk, alternated A B C A B C, each
run's mean trainer step after the first --warmup steps (a snapshot's cost lands on one or two
steps in every K, so a median would hide it; the first steps fault their buffers in), medians
over the rounds, and each mode's ratio to off.

  bench/snapshot_cost.py --build build [--rounds 3] [--every 10]
      one host, world 2 over shm, a 64 MiB model (one 4096 x 4096 layer), ZeRO-1 AdamW
  sudo bench/snapshot_cost.py --build build --two-hosts [--rate 1gbit]
      two network-namespace hosts x 1 rank over Gloo on a tc-tbf-limited link
      (scripts/netns_pair.sh); "memory" there is each host's memory plus the copy of its files
      in the other's (Note [Snapshots on the other host]), sharing the link with training
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import two_hosts  # noqa: E402  (the netns pair and its launchers)

STEP = re.compile(r"\[rank 0\] step +(\d+)/\d+ +loss \S+ +([0-9.]+) ms")


def trainer(a, backend, snaps, mode):
    argv = [os.path.join(a.build, "examples", "mlp_train"), "--sizes", a.sizes, "--steps", str(a.steps), "--global-batch", "8",
            "--optimizer", "adamw", "--zero-stage", "1", "--overlap", "interleaved", "--backend", backend, "--log-every", "1",
            "--timeout", "300"]
    if mode != "off":
        argv += ["--snapshot-dir", snaps, "--snapshot-every", str(a.every)]
    if mode == "disk":
        argv += ["--no-snapshot-memory"]
    return argv


def mean_step(out, warmup):
    steps = [float(m.group(2)) for m in STEP.finditer(out) if int(m.group(1)) > warmup]
    if not steps:
        sys.exit("snapshot_cost: no step lines in:\n" + out[-3000:])
    return statistics.mean(steps)


def one_host(a, mode, snaps):
    argv = [os.path.join(a.build, "bin", "shardflow"), "run", "--nproc-per-node", "2", "--"] + trainer(a, "shm", snaps, mode)
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.exit("snapshot_cost: %s failed:\n%s" % (mode, p.stdout[-3000:]))
    return mean_step(p.stdout, a.warmup)


def on_two_hosts(a, mode, snaps):
    prog = trainer(a, "gloo", snaps, mode)
    outs = two_hosts.run_both([two_hosts.launcher(a.build, h, n, 2, 1, prog) for h, n in (("a", 0), ("b", 1))], mode)
    return mean_step(outs[0], a.warmup)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--sizes", default="4096,4096")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--two-hosts", action="store_true")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--modes", default="off,memory,disk", help="which of off, memory, disk (off is the ratios' base)")
    a = ap.parse_args()
    modes = a.modes.split(",")
    if "off" not in modes or not set(modes) <= {"off", "memory", "disk"}:
        sys.exit("snapshot_cost: --modes takes off, memory and disk, off among them (the ratios' base), not '%s'" % a.modes)
    run = on_two_hosts if a.two_hosts else one_host
    got = {m: [] for m in modes}
    if a.two_hosts:
        two_hosts.sh("up", two_hosts.NAME)
        two_hosts.sh("rate", two_hosts.NAME, a.rate)
    try:
        with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:  # on disk: /tmp may be a tmpfs elsewhere
            for _ in range(a.rounds):
                for m in modes:
                    snaps = os.path.join(tmp, "snapshots")
                    shutil.rmtree(snaps, ignore_errors=True)
                    got[m].append(run(a, m, snaps))
    finally:
        if a.two_hosts:
            two_hosts.sh("down", two_hosts.NAME)
    where = ("2 hosts x 1 rank over Gloo, link %s" % a.rate) if a.two_hosts else "1 host, world 2 over shm"
    print("snapshot_cost: --sizes %s, %s, ZeRO-1 AdamW, a snapshot every %d steps; mean step after step %d of %d, "
          "%d rounds alternated" % (a.sizes, where, a.every, a.warmup, a.steps, a.rounds))
    base = statistics.median(got["off"])
    for m in modes:
        med = statistics.median(got[m])
        print("  %-7s median %8.1f ms  (rounds: %s)  x%.3f of off" % (m, med, ", ".join("%.1f" % v for v in got[m]), med / base))


if __name__ == "__main__":
    main()
