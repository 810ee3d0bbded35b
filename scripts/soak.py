#!/usr/bin/env python3
"""The failure matrix, repeated (`make soak`; not in CI): a 2-rank mlp_train job under `shardflow run`
in which one rank is killed (SIGKILL) or hung (SIGSTOP) at one phase, for every backend, phase,
victim rank and action, REPS times each. The fault comes from the runtime's test hook
(SHARDFLOW_TEST_FAULT, runtime/process/fault_injection.hpp), so it lands in the phase named:

  registration  Runtime::finalize, before the initial broadcast
  backward      a grad_ready, some iterations in
  collective    a bucket's reduction starting on the comm stream
  sync          a parameter sync (ZeRO-1's all-gather) starting on the comm stream
  checkpoint    a window of the second consolidated save's state stream

A run passes when
  - the job exits non-zero within the collective timeout + 5 s of the fault;
  - its output names the faulty rank: the launcher's `FAILED: rank R` for a death, a peer's error
    naming `rank R` for a hang;
  - no process of the job is left, and no shared-memory segment it made;
  - the last checkpoint written before the fault still loads (mlp_train --resume at world 1).

In-process ranks are threads of one process: a kill takes them all, and a failing rank thread is
covered by tests/test_errors.cpp. Results: one line per run, and a table of counts to paste into
bench/RESULTS.md.

--heal: the same faults in generation 0 of a job that heals itself (`shardflow run --max-restarts
1`, the runtime's snapshots every 2 steps, in the launcher's memory and every 4th step on disk;
Note [Snapshots], Note [Snapshots in memory]), at worlds 2 and 3 (--worlds), every rank a victim
in turn. A run passes when the job exits 0 after one restart, its final parameters equal the same
job's uninterrupted run's bit for bit, and nothing of it is left (processes, shared memory, the
launcher's snapshot memory). --two-hosts (root): the same across two network-namespace hosts
(bench/two_hosts.py's pair, scripts/netns_pair.sh), Gloo and auto (at 2 ranks a host the two
levels, shm inside a host), worlds 2 and 4 (1 and 2 ranks a host);
each host's memory also holds the other's copies (Note [Snapshots on the other host]). There the
fault "host" is added: a rank of node 1 kills its launcher and itself (the host lost); with
--nnodes 1:2 node 0 must go on alone at half the world, from memory, and end within
SHRINK_TOLERANCE of the uninterrupted run (Note [Shrinking the world]). The table says where each
restart resumed from.

  scripts/soak.py BUILD_DIR [--reps 20] [--backends shm,gloo] [--phases ...] [--timeout 3]
  scripts/soak.py BUILD_DIR --heal [--reps 1] [--worlds 2,3] [--phases registration,backward,collective,sync]
  scripts/soak.py BUILD_DIR --heal --recovery in-place,shrink
      the same faults healed in place (Note [Recovering in place]): only the lost rank's process starts
      again, or none and the survivors go on at the smaller world (within SHRINK_TOLERANCE of the
      uninterrupted run); a loss in the set-up's collectives (registration) restarts every rank instead
  scripts/soak.py BUILD_DIR --heal --recovery in-place,shrink --redundancy 1,2 [--worlds 3,4,5,6]
      with mirrored shards too (mlp_train --redundancy 2, Note [Mirrored shards]): a lost rank's
      survivors go on from memory after the last step every survivor finished, its shard from its
      twin; a run passes when it went on from the twins (nothing rolled back) and ends as above
  sudo scripts/soak.py BUILD_DIR --heal --two-hosts [--worlds 2,4]
  sudo scripts/soak.py BUILD_DIR --heal --two-hosts --recovery in-place,shrink
      across the hosts healed in place (Note [Rounds across nodes]): the lost rank's process starts again
      on its host, or none and the survivors of both hosts go on at the smaller world; every other rank
      keeps its own process; a lost host still ends in node 0 going on alone
  sudo scripts/soak.py BUILD_DIR --heal --hosts 3 [--store etcd|tcp] --recovery in-place,shrink --redundancy 1,2
      across three hosts on a bridge (scripts/netns_pair.sh up NAME PREFIX 3), worlds 3 and 6 by default,
      the store on etcd with a member on each host (two_hosts.Etcd): no node is special, so every node's
      host in turn is lost ("host") or cut off ("cut": the rank says so and pauses, this driver takes its
      host's link down and leaves its processes, etcd member included, to find out). The cut node must
      exit non-zero by itself and the others go on without it; the cut member must answer again within
      60 s of its link coming back. With the TCP store node 0's host is left out (it serves the store).
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

PHASES = {"registration": 1, "backward": 60, "collective": 9, "sync": 9, "checkpoint": 3}
SIZES = "32,64,64,8"


def job_processes(soak_id):
    """Pids whose environment carries this run's SOAK_ID."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"SOAK_ID={soak_id}".encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def shm_segments():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def leftovers(soak_id, out, shm_before, killed_launchers=()):
    """What a finished job left behind (and removes it): its processes, its shared memory. A killed
    launcher's snapshot memory is expected (the next launcher on its host removes it) and is only removed."""
    problems = []
    time.sleep(0.3)
    stray = job_processes(soak_id)
    if stray:
        problems.append(f"stray processes {stray}")
        for pid in stray:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
    # This job's segments carry a rank's pid (runtime/comm/shm_names.hpp), its snapshot memory the
    # launcher's; other jobs on the machine may come and go meanwhile.
    mine = tuple(f"shardflow-{pid}-" for pid in re.findall(r"started rank \d+ \(pid (\d+)\)", out))
    mine += tuple(f"shardflow-snapshots-{pid}" for pid in re.findall(r"^LAUNCHER (\d+)$", out, re.M))
    left = {n for n in shm_segments() - shm_before if mine and n.startswith(mine)}
    for name in {f"shardflow-snapshots-{pid}" for pid in killed_launchers} & left:
        shutil.rmtree(os.path.join("/dev/shm", name), ignore_errors=True)
        left.discard(name)
    if left:
        problems.append(f"shared memory left: {sorted(left)}")
        for name in left:
            shutil.rmtree(os.path.join("/dev/shm", name), ignore_errors=True)
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
    return problems


def run_job(cmds, env, limit_s, on_fault=None):
    """Runs a job's launchers (one command, or one per node), their output read as it comes; (the
    first non-zero exit code, 0, or None when it hung; the output; when the fault was reached).
    `on_fault` runs on the fault's line, as it comes (a host cut off there)."""
    if isinstance(cmds[0], str):
        cmds = [cmds]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    lines, fault_at, lock = [f"LAUNCHER {p.pid}\n" for p in procs], [None], threading.Lock()
    t0, stamped = time.monotonic(), []  # --logs: each line with its time since the start

    def reader(p):
        for line in p.stdout:
            with lock:
                lines.append(line)
                stamped.append(f"{time.monotonic() - t0:8.3f} {line}")
                if fault_at[0] is None and "shardflow test fault:" in line:
                    fault_at[0] = time.monotonic()
                    if on_fault:
                        on_fault()

    threads = [threading.Thread(target=reader, args=(p,)) for p in procs]
    for t in threads:
        t.start()
    end, codes = time.monotonic() + limit_s, []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for t in threads:
        t.join(5)
    rc = None if None in codes else next((c for c in codes if c != 0), 0)
    run_job.codes = codes  # each launcher's, for the cases that expect one to die
    run_job.stamped = "".join(stamped) + "".join(f"{time.monotonic() - t0:8.3f} launcher {n} exited {c}\n" for n, c in enumerate(codes))
    return rc, "".join(lines), fault_at[0]


def one_run(build, backend, phase, victim, action, timeout_s, work):
    soak_id = uuid.uuid4().hex[:12]
    ckpt = os.path.join(work, f"ckpt_{soak_id}")
    launcher = os.path.join(build, "bin", "shardflow")
    trainer = os.path.join(build, "examples", "mlp_train")
    cmd = [launcher, "run", "--nproc_per_node", "2", "--kill-grace", "1", "--", trainer, "--sizes", SIZES, "--steps", "60",
           "--global-batch", "16", "--optimizer", "adamw", "--lr", "1e-3", "--zero-stage", "1", "--overlap", "interleaved",
           "--backend", backend, "--timeout", str(timeout_s), "--save-checkpoint", ckpt, "--every", "5", "--log-every", "1"]
    env = dict(os.environ, SOAK_ID=soak_id, SHARDFLOW_TEST_FAULT=f"{phase}:{victim}:{action}:{PHASES[phase]}")
    shm_before = shm_segments()
    start = time.monotonic()
    rc, out, fault_at = run_job(cmd, env, timeout_s + 60)
    end = time.monotonic()
    lines = out.splitlines(keepends=True)
    problems = []
    if rc is None:
        problems.append("the job hung past timeout + 60 s")
    elif rc == 0:
        problems.append("the job exited 0")
    if fault_at is None:
        problems.append("the fault was not reached")
        exit_s = end - start
    else:
        exit_s = end - fault_at
        if exit_s > timeout_s + 5:
            problems.append(f"exit {exit_s:.1f} s after the fault (bound {timeout_s + 5} s)")
    if action == "kill":
        named = f"FAILED: rank {victim} " in out
    else:  # a peer times out naming it, and the launcher's verdict names it as the likely cause
        named = (any("mlp_train: error:" in l and (f"rank(s) {victim} did not arrive" in l or f"rank {victim} did not answer" in l)
                     for l in lines)
                 and any(l.startswith("shardflow run: FAILED") and f"rank {victim} (pid" in l and "had been stopped by SIGSTOP" in l
                         for l in lines))
    if not named:
        problems.append(f"no message names rank {victim}")
    problems += leftovers(soak_id, out, shm_before)
    if os.path.exists(os.path.join(ckpt, "checkpoint.safetensors")):
        load = subprocess.run([trainer, "--sizes", SIZES, "--steps", "1", "--global-batch", "16", "--optimizer", "adamw",
                               "--resume", ckpt, "--quiet"], capture_output=True, text=True, timeout=60)
        if load.returncode != 0:
            problems.append("the previous checkpoint does not load: " + load.stderr.strip()[-200:])
    elif phase == "checkpoint":
        problems.append("no checkpoint before the fault")
    shutil.rmtree(ckpt, ignore_errors=True)
    return problems, exit_s, out


HEAL_PHASES = "registration,backward,collective,sync"
# Where the faults land in a 24-step healing job (one bucket, six parameters): the 13th collective
# and sync in step 13, the 60th gradient in step 10; the newest complete snapshot is then step 12's
# or 10's (in memory) or 8's (on disk).
HEAL_AT = {"registration": 1, "backward": 60, "collective": 13, "sync": 13}


def heal_job(build, backend, world, timeout_s, work, soak_id, fault=None, hosts=1, recovery="restart", redundancy=1, etcd=None):
    """A self-healing job: its launcher command(s), its environment, where its final parameters go.
    hosts 2 or more: one launcher on each network-namespace host (bench/two_hosts.py's), world /
    hosts ranks each, Gloo between them; the store on `etcd` (a two_hosts.Etcd) or node 0's."""
    out_path = os.path.join(work, f"params_{soak_id}.safetensors")
    snaps = os.path.join(work, f"snaps_{soak_id}")
    # Every rank an equal share, at this world and at the world one rank or one node smaller.
    batch = 24 if all(24 % w == 0 for w in (world, world - 1, max(1, world - world // hosts))) else 60
    trainer = [os.path.join(build, "examples", "mlp_train"), "--sizes", SIZES, "--steps", "24", "--global-batch", str(batch),
               "--optimizer", "adamw", "--lr", "1e-3", "--zero-stage", "1", "--overlap", "interleaved", "--backend", backend,
               "--timeout", str(timeout_s), "--snapshot-dir", snaps, "--snapshot-every", "2", "--snapshot-disk-every", "4",
               "--save", out_path, "--log-every", "1"]
    if redundancy == 2:
        trainer += ["--redundancy", "2"]
    script = "exec " + " ".join(f"'{t}'" for t in trainer)
    if fault:  # generation 0's first processes only: the restarted job (or a replacement) must run clean
        script = (f'if [ "$SHARDFLOW_RESTART_COUNT" = 0 ] && [ "${{SHARDFLOW_RECOVERY_ROUND:-0}}" = 0 ]; then '
                  f'export SHARDFLOW_TEST_FAULT={fault}; fi; ' + script)
    cmd = [os.path.join(build, "bin", "shardflow"), "run", "--nproc-per-node", str(world), "--max-restarts", "1", "--kill-grace", "1",
           "--recovery", recovery, "--heartbeat-timeout", "2", "--", "/bin/sh", "-c", script]
    if hosts >= 2:
        import two_hosts
        cmd = []
        store = ["--rdzv-backend", "etcd", "--rdzv-endpoints", etcd.endpoints(), "--rdzv-id", "soak-" + soak_id] if etcd else []
        for n in range(hosts):
            c = two_hosts.launcher(build, "abcdef"[n], n, hosts, world // hosts, [], 3)[:-1]
            c[c.index("--nnodes") + 1] = f"1:{hosts}"  # elastic: the other nodes go on without a lost one
            cmd.append(c + store + ["--max-restarts", "1", "--rejoin-timeout", "1", "--recovery", recovery, "--", "/bin/sh", "-c", script])
    # info: the runtime's "resumed from the snapshot of step N in memory" line
    return cmd, dict(os.environ, SOAK_ID=soak_id, SHARDFLOW_LOG_LEVEL="info"), out_path, snaps


def same_params(a, b, tolerance=0.0):
    """Bit for bit, or each tensor within `tolerance` in relative norm."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    import numpy as np
    import safetensors_np
    x, y = safetensors_np.load(a), safetensors_np.load(b)
    if x.keys() != y.keys():
        return False
    if tolerance == 0.0:
        return all(np.array_equal(x[k], y[k]) for k in x)
    return all(np.linalg.norm(x[k] - y[k]) <= tolerance * max(np.linalg.norm(y[k]), 1e-30) for k in x)


SHRINK_TOLERANCE = 1e-5  # the same global batch at half the world: sums in another order


def heal_reference(build, backend, world, timeout_s, work, hosts, etcd=None):
    """The uninterrupted run's final parameters."""
    cmd, env, out_path, snaps = heal_job(build, backend, world, timeout_s, work, f"ref_{backend}_{world}_{hosts}", hosts=hosts, etcd=etcd)
    rc, out, _ = run_job(cmd, env, 300)
    shutil.rmtree(snaps, ignore_errors=True)
    if rc != 0:
        sys.exit(f"soak --heal: the uninterrupted run ({backend}, world {world}) failed:\n{out[-3000:]}")
    return out_path


def heal_run(build, backend, world, phase, victim, action, timeout_s, work, want, hosts, recovery="restart", redundancy=1, etcd=None):
    soak_id = uuid.uuid4().hex[:12]
    per_host = world // hosts
    lost = victim // per_host  # the node whose host is lost or cut off
    cmd, env, out_path, snaps = heal_job(build, backend, world, timeout_s, work, soak_id,
                                         f"{phase}:{victim}:{action}:{HEAL_AT[phase]}", hosts, recovery, redundancy, etcd)
    shm_before = shm_segments()
    start = time.monotonic()
    if action == "cut":
        import two_hosts
        cut = lambda state: two_hosts.sh("link", two_hosts.NAME, state, "abcdef"[lost])
        rc, out, fault_at = run_job(cmd, env, 4 * timeout_s + 120, on_fault=lambda: cut("down"))
        took = time.monotonic() - start
        cut("up")
        healed = time.monotonic()
        if etcd and not etcd.wait_healthy(60):
            sys.exit("soak: the cut host's etcd member did not catch up within 60 s")
        print(f"     (the cut host's etcd member answered {time.monotonic() - healed:.1f} s after its link came back)", flush=True)
    else:
        rc, out, fault_at = run_job(cmd, env, 4 * timeout_s + 120)
        took = time.monotonic() - start
    problems = []
    # A node lost (its launcher and ranks killed) or cut off (its link down, its processes left to
    # find out): the others go on without it (Note [Shrinking the world]).
    shrink = action in ("host", "cut")
    # Healed in place, except a loss in the set-up's collectives (that restarts every rank). A lost
    # host too: node 0's ranks go on without it in their processes (Note [A lost host healed in place]).
    in_place = recovery != "restart" and phase != "registration"
    smaller = shrink or (in_place and recovery == "shrink")  # another world's sums: within the tolerance
    if shrink and rc is not None:  # the lost node's launcher exits non-zero (or is killed); the others 0
        if action == "cut" and run_job.codes[lost] == 0:
            problems.append(f"node {lost}, cut off, exited 0")
        rc = next((c for n, c in enumerate(run_job.codes) if n != lost and c != 0), 0)
    if fault_at is None and action != "host":  # a lost host takes its launcher, which relays the line, with it
        problems.append("the fault was not reached")
    if rc is None:
        problems.append("the job hung")
    elif rc != 0:
        problems.append(f"the job exited {rc}")
    elif in_place and "recovered in place: every rank joined round 1" not in out:
        problems.append("not recovered in place")
    elif in_place and "restarting every rank" in out:
        problems.append("every rank restarted")
    elif not in_place and "restarting every rank (1 of 1 restarts)" not in out:
        problems.append("no restart")
    elif shrink and not in_place and f"going on without node {lost}" not in out:
        problems.append(f"the others did not go on without node {lost}")
    elif shrink and in_place and f"at world {world - per_host} from now on, without it" not in out:
        problems.append(f"the others' ranks did not go on in place without node {lost}")
    elif redundancy == 2 and in_place and not shrink and "no step rolled back" not in out:
        problems.append("the survivors did not go on from the twins")
    elif not same_params(out_path, want, SHRINK_TOLERANCE if smaller else 0.0):
        problems.append("its parameters differ from the uninterrupted run's" + (f" by more than {SHRINK_TOLERANCE}" if smaller else ""))
    problems += leftovers(soak_id, out, shm_before, re.findall(r"^LAUNCHER (\d+)$", out, re.M)[lost:lost + 1] if shrink else ())
    resumed = re.search(r"resumed from the snapshot of step (\d+) (in memory|on disk)", out)
    twins = re.search(r"twins: resumed after step (\d+) from memory", out)
    shutil.rmtree(snaps, ignore_errors=True)
    if os.path.exists(out_path):
        os.remove(out_path)
    if twins:
        return problems, took, out, f"step {twins.group(1)} from the twins"
    return problems, took, out, (f"step {resumed.group(1)} {resumed.group(2)}" if resumed else "the start")


def heal_matrix(a, work):
    stats = collections.OrderedDict()
    failures = 0
    hosts = a.hosts
    # auto with one rank a host is the flat ring again: run it once, as gloo
    wants = {(b, w): heal_reference(a.build, b, w, a.timeout, work, hosts, a.etcd)
             for b in a.backends.split(",") for w in map(int, a.worlds.split(",")) if not (b == "auto" and w // hosts < 2)}
    for rep in range(a.reps):
      for recovery, redundancy in [(r, int(d)) for r in a.recovery.split(",") for d in a.redundancy.split(",")]:
        if redundancy == 2 and recovery == "restart":
            continue  # every process starts again: nothing of the twins is left to go on from
        for (backend, world), want in wants.items():
            for phase in a.phases.split(","):
                for action in a.actions.split(","):
                    if action in ("host", "cut") and hosts == 1:
                        continue  # a lost host is a case across hosts
                    # With the TCP store node 0 serves it: a lost node 0 ends the job by design, so
                    # the lost hosts are the others. On etcd no node is special: every node in turn.
                    victims = range(0 if a.etcd else world // hosts, world) if action in ("host", "cut") else range(world)
                    for victim in victims:
                        problems, took, out, resumed = heal_run(a.build, backend, world, phase, victim, action, a.timeout, work, want,
                                                                hosts, recovery, redundancy, a.etcd)
                        s = stats.setdefault((recovery, redundancy, backend, world, phase, action),
                                             {"runs": 0, "passes": 0, "worst": 0.0, "memory": 0})
                        s["runs"] += 1
                        s["memory"] += resumed.endswith("in memory") or resumed.endswith("from the twins")
                        s["passes"] += not problems
                        s["worst"] = max(s["worst"], took)
                        print(f"{'ok  ' if not problems else 'FAIL'} rep {rep + 1} {recovery:8} r{redundancy} {backend:4} world {world} {phase:12} {action:4} rank {victim}: "
                              f"{took:5.2f} s, resumed from {resumed}" + ("" if not problems else " -- " + "; ".join(problems)), flush=True)
                        if problems:
                            failures += 1
                            print("     " + out[-1500:].replace("\n", "\n     "), flush=True)
                        if a.logs and (problems or a.logs_all):
                            os.makedirs(a.logs, exist_ok=True)
                            name = f"{recovery}_r{redundancy}_{backend}_w{world}_{phase}_{action}_rank{victim}_rep{rep + 1}.log"
                            with open(os.path.join(a.logs, name), "w") as f:
                                f.write(run_job.stamped)
    print(f"\n{f'{hosts} network-namespace hosts, world / {hosts} ranks each' if hosts > 1 else 'one host'}"
          f"{', the store on etcd (a member on each host)' if a.etcd else ''}:")
    print("\n| recovery | redundancy | backend | world | phase | fault | runs | passed (bit for bit; a shrink within its tolerance) "
          "| resumed from memory (a snapshot or the twins) | worst job time (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (recovery, redundancy, backend, world, phase, action), s in stats.items():
        fault = {"kill": "kill -9", "stop": "SIGSTOP", "host": "a node lost: its launcher and ranks killed (shrink, within %g)" % SHRINK_TOLERANCE,
                 "cut": "a host cut off: its link down (shrink, within %g)" % SHRINK_TOLERANCE}[action]
        print(f"| {recovery} | {redundancy} | {backend} | {world} | {phase} | {fault} | {s['runs']} | {s['passes']} | {s['memory']} | {s['worst']:.2f} |")
    print(f"\n{sum(s['runs'] for s in stats.values())} runs, {failures} failed (trainer --timeout {a.timeout} s)")
    return failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--backends", default=None, help="default shm,gloo (--heal --two-hosts: gloo,auto)")
    ap.add_argument("--phases", default=None, help="default: every phase (--heal: " + HEAL_PHASES + ")")
    ap.add_argument("--heal", action="store_true", help="the faults in a job that heals itself (see above)")
    ap.add_argument("--worlds", default=None, help="with --heal (default 2,3; with --two-hosts 2,4)")
    ap.add_argument("--two-hosts", action="store_true", help="with --heal: the jobs across two network-namespace hosts (root); --hosts 2")
    ap.add_argument("--hosts", type=int, default=1, help="with --heal: the jobs across this many network-namespace hosts, 2 to 6 (root)")
    ap.add_argument("--store", choices=("tcp", "etcd"), default=None,
                    help="with --hosts: node 0's TCP store, or etcd with a member on each host (default: tcp at 2 hosts, etcd at 3 or more)")
    ap.add_argument("--recovery", default="restart",
                    help="with --heal: shardflow run --recovery, one or several of restart,in-place,shrink")
    ap.add_argument("--redundancy", default="1", help="with --heal: mlp_train --redundancy, 1, 2 or 1,2 (2 only with in-place or shrink)")
    ap.add_argument("--actions", default=None, help="default kill,stop (--heal --hosts N: kill,stop,host,cut)")
    ap.add_argument("--timeout", type=float, default=3.0, help="the trainer's --timeout (every wait on a peer)")
    ap.add_argument("--logs", default=None, help="with --heal: write each failed run's whole output (every launcher's) into this folder")
    ap.add_argument("--logs-all", action="store_true", help="with --logs: every run's, not only the failed ones'")
    ap.add_argument("--minutes", type=float, default=0, help="start no repetition after this long (0: no limit); the table counts what ran")
    a = ap.parse_args()
    if a.two_hosts:
        a.hosts = max(a.hosts, 2)
    a.two_hosts = a.hosts > 1
    if not 1 <= a.hosts <= 6:
        ap.error(f"--hosts {a.hosts}: 1 to 6 (scripts/netns_pair.sh makes at most 6)")
    if a.store is not None and not (a.heal and a.two_hosts):
        ap.error("--store applies to --heal across hosts (--hosts 2 or more) only")
    if a.logs_all and not a.logs:
        ap.error("--logs-all needs --logs DIR")
    if a.logs and not a.heal:
        ap.error("--logs applies to --heal only")
    if a.store is None:
        a.store = "etcd" if a.hosts >= 3 else "tcp"
    a.etcd = None
    if a.phases is None:
        a.phases = HEAL_PHASES if a.heal else ",".join(PHASES)
    if a.backends is None and not (a.heal and a.two_hosts):
        a.backends = "shm,gloo"
    if a.actions is None:
        a.actions = "kill,stop,host,cut" if a.heal and a.two_hosts else "kill,stop"
    started = time.monotonic()
    work = tempfile.mkdtemp(prefix="shardflow_soak_")
    if a.heal:
        if a.worlds is None:
            a.worlds = f"{a.hosts},{2 * a.hosts}" if a.two_hosts else "2,3"
        if a.two_hosts:
            # shm does not cross hosts; auto is the two levels at 2 ranks a host (hierarchical)
            a.backends = a.backends or "gloo,auto"
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
            import two_hosts
            two_hosts.sh("up", two_hosts.NAME, two_hosts.PREFIX, str(a.hosts))
        try:
            if a.two_hosts and a.store == "etcd":
                a.etcd = two_hosts.Etcd("abcdef"[:a.hosts], work)
            sys.exit(1 if heal_matrix(a, work) else 0)
        finally:
            if a.etcd:
                a.etcd.stop()
            shutil.rmtree(work, ignore_errors=True)
            if a.two_hosts:
                two_hosts.sh("down", two_hosts.NAME)
    stats = collections.OrderedDict()
    failures = 0
    try:
        for rep in range(a.reps):
            if a.minutes and time.monotonic() - started > a.minutes * 60:
                print(f"stopping after {rep} repetitions: --minutes {a.minutes} reached", flush=True)
                break
            for backend in a.backends.split(","):
                for phase in a.phases.split(","):
                    for action in a.actions.split(","):
                        for victim in (0, 1):
                            problems, exit_s, out = one_run(a.build, backend, phase, victim, action, a.timeout, work)
                            key = (backend, phase, action)
                            s = stats.setdefault(key, {"runs": 0, "passes": 0, "worst": 0.0})
                            s["runs"] += 1
                            s["passes"] += not problems
                            s["worst"] = max(s["worst"], exit_s)
                            verdict = "ok  " if not problems else "FAIL"
                            print(f"{verdict} rep {rep + 1} {backend:4} {phase:12} {action:4} rank {victim}: exit {exit_s:5.2f} s after the fault"
                                  + ("" if not problems else " -- " + "; ".join(problems)), flush=True)
                            if problems:
                                failures += 1
                                print("     " + out[-1500:].replace("\n", "\n     "), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n| backend | phase | fault | runs | passes | worst time to exit after the fault (s) |")
    print("|---|---|---|---|---|---|")
    for (backend, phase, action), s in stats.items():
        print(f"| {backend} | {phase} | {'kill -9' if action == 'kill' else 'SIGSTOP'} | {s['runs']} | {s['passes']} | {s['worst']:.2f} |")
    print(f"\n{sum(s['runs'] for s in stats.values())} runs, {failures} failed (trainer --timeout {a.timeout} s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
