#!/usr/bin/env python3
"""What a node joining a running job costs the ranks already there (Note [A node joins live]): two
network-namespace hosts over a tc-tbf link, `shardflow run --recovery shrink --nnodes 1:2`; host b
is lost (its rank kills its launcher), host a goes on alone in place, then host b's launcher is
started again and the running rank takes it in at its next snapshot in memory.

  sudo /usr/bin/python3 bench/join_time.py --build build [--rate 1gbit] [--every 5] [--reps 3] [--per-host 2]

--per-host 2: two ranks a host (the world 2 -> 4 at the join, host b's first rank takes its host down).

Per run, from rank 0's step lines (--log-every 1): the step S it was at when the join's round ended
its iteration (the trainer says "going on after step S"), the time from its step S to its step
S + 1 (the gap: the snapshot completed at once, the round, the reload, the step), against its steady
step at the grown world (the median of the next steps), and the steps lost (the last step done
before the join minus S: 0 when nothing was done again). Also the joiner's launcher's start to the
launcher's "grew in place".

The model is one 4096 x 4096 layer (64 MiB of fp32 parameters), AdamW at ZeRO-1 over Gloo, data
read from a file (bench/restart_time.py --data-file).
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import restart_time  # noqa: E402  (the data file)
import two_hosts  # noqa: E402  (the netns pair and its launchers)

STEP_MS = re.compile(r"\[rank 0\] step +(\d+)/\d+ +loss \S+ +([0-9.]+) ms")


def launch(a, host, node, prog):
    cmd = two_hosts.launcher(a.build, host, node, 2, a.per_host, prog, a.heartbeat_timeout)
    at = cmd.index("--")
    cmd[cmd.index("--nnodes") + 1] = "1:2"
    cmd[at:at] = ["--max-restarts", "1", "--recovery", "shrink", "--rejoin-timeout", "1"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def one_run(a, snaps, data):
    shutil.rmtree(snaps, ignore_errors=True)
    trainer = [os.path.join(a.build, "examples", "mlp_train"), "--sizes", a.sizes, "--steps", str(a.steps), "--global-batch", "8",
               "--optimizer", "adamw", "--zero-stage", "1", "--overlap", "interleaved", "--backend", "gloo", "--data", data,
               "--snapshot-dir", snaps, "--snapshot-every", str(a.every), "--log-every", "1", "--timeout", "30"]
    script = ('if [ "$SHARDFLOW_RESTART_COUNT" = 0 ] && [ "${SHARDFLOW_RECOVERY_ROUND:-0}" = 0 ]; then '
              'export SHARDFLOW_TEST_FAULT=collective:%d:host:%d; fi; exec %s' % (a.per_host, a.lose_at, " ".join("'%s'" % t for t in trainer)))
    prog = ["/bin/sh", "-c", script]
    events, lock, healed = [], threading.Lock(), threading.Event()

    def reader(p, who):
        for line in p.stdout:
            with lock:
                events.append((time.monotonic(), who, line))
            if "recovered in place: every rank joined round 1" in line:
                healed.set()

    procs = [launch(a, "a", 0, prog), launch(a, "b", 1, prog)]
    threads = [threading.Thread(target=reader, args=(p, w)) for p, w in zip(procs, ("a", "b"))]
    for t in threads:
        t.start()
    if not healed.wait(120):
        for p in procs:
            p.kill()
        sys.exit("join_time: host a did not go on alone:\n" + "".join(l for _, _, l in events[-40:]))
    procs[1].wait()
    started_again = time.monotonic()
    procs.append(launch(a, "b", 1, prog))
    threads.append(threading.Thread(target=reader, args=(procs[2], "b2")))
    threads[-1].start()
    codes = [procs[0].wait(), procs[2].wait()]
    for t in threads:
        t.join()
    events.sort(key=lambda e: e[0])
    if any(codes):
        sys.exit("join_time: the job failed:\n" + "".join(l for _, _, l in events[-40:]) + "\nexit codes: " + str(codes))
    step_ms, regroup_at, resumed_at, after, grew = {}, None, None, None, None
    for now, who, line in events:
        m = STEP_MS.match(line)
        if m and who == "a":
            step_ms[int(m.group(1))] = float(m.group(2))  # a step done again after the loss: its second time
        if who == "a" and regroup_at is None and "[rank 0] [info] the launcher takes a node into the job" in line:
            regroup_at = now
        g = re.search(r"rank 0 \(pid \d+\): recovered in place as rank 0 of %d, going on after step (\d+)" % (2 * a.per_host), line)
        if g:
            after, resumed_at = int(g.group(1)), now
        if "grew in place" in line and grew is None:
            grew = now
    if a.log:
        with open(a.log, "a") as f:
            f.writelines(f"{now:.3f} {who} {line}" for now, who, line in events)
    if None in (after, grew, regroup_at) or after + 7 not in step_ms or after - 3 not in step_ms:
        sys.exit("join_time: no join seen (or too few steps around it):\n" + "".join(l for _, _, l in events[-60:]))
    before = statistics.median(step_ms[s] for s in range(after - 3, after))  # host a's ranks alone
    steady = statistics.median(step_ms[s] for s in range(after + 2, after + 8))  # the grown world
    first = step_ms[after + 1]
    return resumed_at - regroup_at, first, steady, before, grew - started_again


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--sizes", default="4096,4096")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--lose-at", type=int, default=21, help="rank 1's collective that takes host b down (2 a step at ZeRO-1)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rate", default="1gbit", help="the link's rate (tc tbf), or off")
    ap.add_argument("--heartbeat-timeout", type=int, default=3)
    ap.add_argument("--per-host", type=int, default=1, help="ranks a host (2: the world grows from 2 to 4 at the join)")
    ap.add_argument("--log", help="append every launcher's output, timed, to this file")
    a = ap.parse_args()
    two_hosts.sh("up", two_hosts.NAME)
    if a.rate != "off":
        two_hosts.sh("rate", two_hosts.NAME, a.rate)
    try:
        with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:  # one directory both hosts see
            data = os.path.join(tmp, "data.safetensors")
            restart_time.write_data(a, data)
            runs = [one_run(a, os.path.join(tmp, "snapshots"), data) for _ in range(a.reps)]
    finally:
        two_hosts.sh("down", two_hosts.NAME)
    pause, first, steady, before, grew = zip(*runs)
    med = statistics.median
    w, w0 = 2 * a.per_host, a.per_host  # the world grown by the join, and host a's alone
    print(f"join_time: --sizes {a.sizes}, 2 hosts x {a.per_host} rank(s), link {a.rate}, ZeRO-1 AdamW, snapshot every {a.every}, "
          f"host b lost at rank {a.per_host}'s collective {a.lose_at} and its launcher started again; {a.reps} runs, medians")
    print(f"  rank 0's pause at the join (its snapshot complete -> going on at world {w}): {med(pause):.3f} s "
          f"(runs: {', '.join(f'{p:.3f}' for p in pause)})")
    print(f"  its first step at world {w}: {med(first) / 1000:.3f} s against its steady step there {med(steady) / 1000:.3f} s "
          f"(at world {w0} before: {med(before) / 1000:.3f} s)")
    lost = [p + max(0.0, (f - s) / 1000) for p, f, s in zip(pause, first, steady)]
    print(f"  the others' time lost (the pause + the first step's excess): {med(lost):.3f} s = "
          f"{med(l / (s / 1000) for l, s in zip(lost, steady)):.2f} of a steady step at world {w}")
    print("  steps done again: 0 (every rank goes on after the step it was at; tests/test_nodes.cpp checks it)")
    print(f"  the joiner's launcher started -> \"grew in place\": {med(grew):.2f} s")


if __name__ == "__main__":
    main()
