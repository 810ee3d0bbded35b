#!/usr/bin/env python3
"""How long a lost rank costs under `shardflow run --max-restarts` with the runtime's snapshots
(Note [Restarting the worker group], Note [Snapshots]): from rank 1's kill -9 (the fault hook, at
its N-th collective) to rank 0's first step after the restart, and how many steps were lost.

  bench/restart_time.py --build build [--sizes 4096,4096] [--every 10] [--kill-at 61] [--reps 3] [--data-file]
  bench/restart_time.py --build build --data-file --recovery all [--reps 5]
      recovering in place (Note [Recovering in place]: only rank 1's process starts again, rank 0 goes
      on in its own), and shrinking (no process starts: rank 0 goes on alone), against restarting every
      rank; runs alternated A B C A B C, medians
  bench/restart_time.py --build build --data-file --recovery in-place --redundancy both [--reps 5]
      the same with and without mlp_train's --redundancy 2 (Note [Going on from the twins]: the lost
      rank's shard from its twin, no step lost), alternated
  bench/restart_time.py --build build --data-file --recovery in-place --actor-trainer [--reps 5]
      the same recovery in mlp_train (Runtime::recover) and in actor_trainer (its rank trainer stops its
      layer actors and asks the rank actor to recover: Note [The actor trainer heals in place]), alternated
  sudo bench/restart_time.py --build build --two-hosts [--rate 1gbit] [--heartbeat-timeout 10]
      rank 1 on another network-namespace host (scripts/netns_pair.sh), Gloo over a tc-tbf link;
      restarts across nodes: both launchers stop their ranks and agree through the store
  sudo bench/restart_time.py --build build --two-hosts --data-file --recovery all [--reps 3]
      the same, alternated with recovering in place across the hosts (Note [Rounds across nodes]:
      host b's launcher starts rank 1 again, rank 0 on host a keeps its process) and shrinking (rank 0
      goes on alone at world 1, in its own process)
  sudo bench/restart_time.py --build build --two-hosts --lose host --data-file --recovery all [--reps 3]
      host b lost instead (rank 1 kills its launcher, and so its host's ranks, with itself), the
      launchers elastic (--nnodes 1:2): restarting, host a's ranks start again at the smaller world;
      in place and shrinking, they go on in their own processes (Note [A lost host healed in place]).
      Host b's launcher cannot relay the kill's line, so the time counts from rank 0's last step before
      the loss (an upper bound, by at most one step)

The default model is one 4096 x 4096 layer: 64 MiB of fp32 parameters, AdamW at ZeRO-1 over shm,
world 2. Each rep runs the job once and reads the launcher's output as it comes.

--data-file: the trainer reads its data from a safetensors file written once beforehand, as a real
trainer reads its dataset, instead of synthesising it (mlp_train's synthetic set draws 4096 x 4096
normals and multiplies them by a 4096 x 4096 teacher at every start: seconds of the trainer's own
start-up that say nothing about the restart).
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
import two_hosts  # noqa: E402  (the netns pair and its launchers)


def write_data(a, path):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    import numpy as np
    import safetensors_np
    sizes = [int(s) for s in a.sizes.split(",")]
    rng = np.random.default_rng(1)
    rows = 256
    x = rng.standard_normal((rows, sizes[0]), dtype=np.float32)
    y = np.tanh(x @ (rng.standard_normal((sizes[0], sizes[-1]), dtype=np.float32) / np.sqrt(sizes[0])))
    safetensors_np.save(path, {"x": x, "y": y})


def read_all(procs):
    """Every launcher's output lines with the moment each arrived, in time order."""
    events, lock = [], threading.Lock()

    def reader(p):
        for line in p.stdout:
            now = time.monotonic()
            with lock:
                events.append((now, line))

    threads = [threading.Thread(target=reader, args=(p,)) for p in procs]
    for t in threads:
        t.start()
    codes = [p.wait() for p in procs]
    for t in threads:
        t.join()
    return codes, sorted(events, key=lambda e: e[0])


def one_run(a, snaps, data, recovery="restart", program="mlp_train", redundancy=1):
    shutil.rmtree(snaps, ignore_errors=True)
    trainer = [os.path.join(a.build, "examples", program), "--sizes", a.sizes, "--steps", str(a.steps), "--global-batch",
               "8" if a.per_host == 1 else "24",  # 24: divisible at world 4 and, shrunk, at 3
               "--optimizer", "adamw", "--zero-stage", "1", "--overlap", "interleaved", "--backend", a.backend,
               "--snapshot-dir", snaps, "--snapshot-every", str(a.every), "--log-every", "1", "--timeout", "30"]
    if data:
        trainer += ["--data", data]
    if a.trace_dir:  # each rank's Chrome trace (a replaced rank's is the replacement's)
        trainer += ["--trace", os.path.join(a.trace_dir, "trace.json")]
    if redundancy == 2:
        trainer += ["--redundancy", "2"]
    victim = 2 * a.per_host - 1 if a.lose == "host" else 1  # host b's last rank, or rank 1
    script = ('if [ "$SHARDFLOW_RESTART_COUNT" = 0 ] && [ "${SHARDFLOW_RECOVERY_ROUND:-0}" = 0 ]; then export SHARDFLOW_TEST_FAULT=collective:%d:%s:%d; fi; exec %s'
              % (victim, "host" if a.lose == "host" else "kill", a.kill_at, " ".join("'%s'" % t for t in trainer)))
    prog = ["/bin/sh", "-c", script]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    if a.two_hosts:  # rank 0 on host a, rank 1 on host b
        cmds = [two_hosts.launcher(a.build, h, n, 2, a.per_host, prog, a.heartbeat_timeout)[:-len(prog) - 1] +
                ["--max-restarts", "1", "--recovery", recovery, "--"] + prog for h, n in (("a", 0), ("b", 1))]
        if a.lose == "host":  # elastic: node 0 goes on without node 1
            for c in cmds:
                c[c.index("--nnodes") + 1] = "1:2"
                c[c.index("--max-restarts"):c.index("--max-restarts")] = ["--rejoin-timeout", "1"]
    else:
        cmds = [[os.path.join(a.build, "bin", "shardflow"), "run", "--nproc-per-node", "2", "--max-restarts", "1", "--kill-grace", "2",
                 "--recovery", recovery, "--"] + prog]
    if a.log:
        env["SHARDFLOW_LOG_LEVEL"] = "info"  # the runtime's own lines: where the time between the kill and the next step goes
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for c in cmds]
    codes, events = read_all(procs)
    if a.log:
        with open(a.log, "a") as f:
            f.write(f"--- recovery {recovery}, redundancy {redundancy}\n")
            f.writelines(f"{t - events[0][0]:9.3f} {line}" for t, line in events)
    started = first_step = killed_at = restarted = first_after = last_step_at = None
    last_step_before = resumed_first = caught_up = caught_step = None
    before = []  # (step, time) of rank 0's lines before the loss: the steady pace
    for now, line in events:
        m = re.match(r"\[rank 0\] step +(\d+)/", line)
        if started is None and line.startswith("shardflow run: started"):
            started = now
        if m and first_step is None:
            first_step = now
        if "dies at collective" in line and killed_at is None:
            killed_at = now
        elif a.lose == "host" and killed_at is None and line.startswith("shardflow run: ") and (
                "lost" in line or "exited" in line or "restart" in line or "killed" in line):
            killed_at = last_step_at  # the kill's own line went with host b's launcher: rank 0's last step before
        if restarted is None and killed_at is not None and (("restart 1 of 1" in line and line.startswith("shardflow run: started")) or
                                                            "again in round 1" in line or "from now on" in line):
            restarted = now
        elif m and killed_at is None:
            last_step_before, last_step_at = int(m.group(1)), now
            before.append((last_step_before, now))
        elif m and restarted is not None and first_after is None:
            first_after, resumed_first = now, int(m.group(1))
        if m and first_after is not None and caught_up is None and int(m.group(1)) > last_step_before:
            caught_up, caught_step = now, int(m.group(1))  # past the last step done before the loss: the progress is back
    if any(codes[:1] if a.lose == "host" else codes) or None in (killed_at, first_after):  # host b's launcher was killed
        sys.exit("restart_time: the job failed or did not restart:\n" + "".join(l for _, l in events[-40:]) + "\nexit codes: " + str(codes))
    # The wall time the loss cost: when rank 0's line past the last step before came, against when
    # the steady pace before the loss would have brought it (the lines are rank 0's reports, which
    # may trail their step by one; both ends trail alike).
    pace = statistics.median((t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(before[2:], before[3:])) if len(before) > 4 else 0.0
    lost_wall = (caught_up - (last_step_at + (caught_step - last_step_before) * pace)) if caught_up and pace else float("nan")
    return (first_after - killed_at, restarted - killed_at, max(0, last_step_before - (resumed_first - 1)), first_step - started,
            (caught_up or first_after) - killed_at, lost_wall, pace)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--sizes", default="4096,4096")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--kill-at", type=int, default=61, help="rank 1's collective that kills it (2 a step at ZeRO-1)")
    ap.add_argument("--backend", help="mlp_train's --backend: shm on one host, gloo across two (default); auto at 2 ranks a host "
                    "gives the two levels (shm inside a host, Gloo between)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--data-file", action="store_true", help="the trainer reads 256 rows of data from a file (see above)")
    ap.add_argument("--two-hosts", action="store_true", help="rank 0 and rank 1 on two network-namespace hosts (root), over Gloo")
    ap.add_argument("--rate", default="1gbit", help="with --two-hosts: the link's rate (tc tbf), or off")
    ap.add_argument("--per-host", type=int, default=1, choices=[1, 2],
                    help="with --two-hosts: ranks a host (2: world 4, rank 1 on host a lost; a shrink goes on at world 3)")
    ap.add_argument("--heartbeat-timeout", type=int, default=10, help="with --two-hosts: the launchers' --heartbeat-timeout")
    ap.add_argument("--lose", choices=["rank", "host"], default="rank", help="with --two-hosts: rank 1 killed, or host b lost (see above)")
    ap.add_argument("--recovery", choices=["restart", "in-place", "shrink", "all"], default="restart",
                    help="shardflow run --recovery; all: the three alternated run by run")
    ap.add_argument("--redundancy", choices=["1", "2", "both"], default="1",
                    help="mlp_train's --redundancy (Note [Going on from the twins]); both: 1 and 2 alternated run by run in one --recovery mode")
    ap.add_argument("--trace-dir", help="mlp_train --trace into this folder (world-writable; one file a rank)")
    ap.add_argument("--log", help="append every run's output to this file, each line with its time (s) from the run's first")
    ap.add_argument("--actor-trainer", action="store_true",
                    help="with one --recovery mode: mlp_train and actor_trainer (its rank trainer recovering through the rank actor, "
                         "Note [The actor trainer heals in place]) alternated run by run")
    a = ap.parse_args()
    if not a.two_hosts and a.per_host != 1:
        ap.error("--per-host is for --two-hosts (one host runs world 2)")
    if not a.two_hosts and a.lose != "rank":
        ap.error("--lose host is for --two-hosts (one host cannot lose a host and go on)")
    if a.redundancy == "both" and (a.recovery == "all" or a.actor_trainer):
        ap.error("--redundancy both compares the two in one --recovery mode, with mlp_train")
    if a.actor_trainer and a.recovery == "all":
        ap.error("--actor-trainer compares the two trainers in one --recovery mode")
    if a.backend is None:
        a.backend = "gloo" if a.two_hosts else "shm"
    if a.two_hosts and a.backend == "shm":
        ap.error("--two-hosts: the hosts share no memory; --backend gloo, or auto for two levels at --per-host 2")
    if a.two_hosts:
        two_hosts.sh("up", two_hosts.NAME)
        if a.rate != "off":
            two_hosts.sh("rate", two_hosts.NAME, a.rate)
    try:
        measure(a)
    finally:
        if a.two_hosts:
            two_hosts.sh("down", two_hosts.NAME)


def measure(a):
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:  # one directory both hosts see
        data = None
        if a.data_file:
            data = os.path.join(tmp, "data.safetensors")
            write_data(a, data)
        if a.redundancy == "both":
            runs = {r: [] for r in (1, 2)}
            for _ in range(a.reps):
                for r in runs:  # A B A B
                    runs[r].append(one_run(a, os.path.join(tmp, "snapshots"), data, a.recovery, redundancy=r))
            for r in runs:
                print(f"--redundancy {r}:")
                report(a, a.recovery, runs[r])
            ratio = statistics.median(r[0] for r in runs[2]) / statistics.median(r[0] for r in runs[1])
            print(f"redundancy 2 / 1, kill -> rank 0's first step after: {ratio:.2f}")
            ratio = statistics.median(r[4] for r in runs[2]) / statistics.median(r[4] for r in runs[1])
            print(f"redundancy 2 / 1, kill -> rank 0 past its last step before: {ratio:.2f}")
            return
        if a.actor_trainer:
            runs = {p: [] for p in ("mlp_train", "actor_trainer")}
            for _ in range(a.reps):
                for p in runs:  # A B A B
                    runs[p].append(one_run(a, os.path.join(tmp, "snapshots"), data, a.recovery, p))
            for p in runs:
                print(f"{p}:")
                report(a, a.recovery, runs[p])
            ratio = statistics.median(r[0] for r in runs["actor_trainer"]) / statistics.median(r[0] for r in runs["mlp_train"])
            print(f"actor_trainer / mlp_train, kill -> rank 0's first step after: {ratio:.2f}")
            return
        modes = ["restart", "in-place", "shrink"] if a.recovery == "all" else [a.recovery]
        runs = {m: [] for m in modes}
        for _ in range(a.reps):
            for m in modes:  # A B A B: the machine's drift spread over both
                runs[m].append(one_run(a, os.path.join(tmp, "snapshots"), data, m, redundancy=int(a.redundancy)))
    for m in modes:
        report(a, m, runs[m])
    for m in modes[1:]:
        ratio = statistics.median(r[0] for r in runs[m]) / statistics.median(r[0] for r in runs["restart"])
        print(f"{m} / restart, kill -> rank 0's first step after: {ratio:.2f}")


def report(a, mode, runs):
    total, stop, lost, fresh, back, lost_wall, pace = zip(*runs)
    where = f"2 hosts x {a.per_host} rank(s), link {a.rate}, heartbeat timeout {a.heartbeat_timeout} s" if a.two_hosts else "1 host"
    loss = f"host b lost at rank {2 * a.per_host - 1}'s" if a.lose == "host" else "rank 1 killed at"
    world = 2 * a.per_host if a.two_hosts else 2
    print(f"restart_time [--recovery {mode}]: --sizes {a.sizes}, world {world} ({a.backend}, {where}), ZeRO-1 AdamW, snapshot every {a.every}, {loss} "
          f"collective {a.kill_at}; {a.reps} runs; data "
          f"{'from a file' if a.data_file else 'synthesised at start-up'}")
    since = "rank 0's last step before the loss" if a.lose == "host" else "kill"
    print(f"  {since} -> rank 0's first step after the restart: median {statistics.median(total):.2f} s "
          f"(runs: {', '.join(f'{t:.2f}' for t in total)})")
    print(f"  of which kill -> the launcher's decision (restart, in-place: the new process started): median {statistics.median(stop):.2f} s")
    print(f"  for comparison, the first start -> its first step: median {statistics.median(fresh):.2f} s")
    print(f"  steps lost (done before the kill, done again): {', '.join(str(n) for n in lost)}")
    print(f"  {since} -> rank 0 past the last step it had done before: median {statistics.median(back):.2f} s "
          f"(runs: {', '.join(f'{t:.2f}' for t in back)})")
    print(f"  wall time lost (that line against where the steady pace before the loss puts it): median "
          f"{statistics.median(lost_wall):.2f} s (runs: {', '.join(f'{t:.2f}' for t in lost_wall)}), a steady step {statistics.median(pace):.2f} s")


if __name__ == "__main__":
    main()
