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

  scripts/soak.py BUILD_DIR [--reps 20] [--backends shm,gloo] [--phases ...] [--timeout 3]
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
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, fault_at = [], [None]

    def reader():
        for line in proc.stdout:
            lines.append(line)
            if fault_at[0] is None and "shardflow test fault:" in line:
                fault_at[0] = time.monotonic()

    t = threading.Thread(target=reader)
    t.start()
    try:
        rc = proc.wait(timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = None
    t.join(5)
    end = time.monotonic()
    out = "".join(lines)
    problems = []
    if rc is None:
        problems.append("the job hung past timeout + 60 s")
    elif rc == 0:
        problems.append("the job exited 0")
    if fault_at[0] is None:
        problems.append("the fault was not reached")
        exit_s = end - start
    else:
        exit_s = end - fault_at[0]
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
    time.sleep(0.3)
    stray = job_processes(soak_id)
    if stray:
        problems.append(f"stray processes {stray}")
        for pid in stray:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
    # This job's segments carry its rank 0's pid (runtime/comm/shm_names.hpp); other jobs on the
    # machine may come and go meanwhile.
    m = re.search(r"started rank 0 \(pid (\d+)\)", out)
    mine = f"shardflow-{m.group(1)}-" if m else None
    left = {n for n in shm_segments() - shm_before if mine and n.startswith(mine)}
    if left:
        problems.append(f"shared-memory segments left: {sorted(left)}")
        for name in left:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
    if os.path.exists(os.path.join(ckpt, "checkpoint.safetensors")):
        load = subprocess.run([trainer, "--sizes", SIZES, "--steps", "1", "--global-batch", "16", "--optimizer", "adamw",
                               "--resume", ckpt, "--quiet"], capture_output=True, text=True, timeout=60)
        if load.returncode != 0:
            problems.append("the previous checkpoint does not load: " + load.stderr.strip()[-200:])
    elif phase == "checkpoint":
        problems.append("no checkpoint before the fault")
    shutil.rmtree(ckpt, ignore_errors=True)
    return problems, exit_s, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--backends", default="shm,gloo")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--actions", default="kill,stop")
    ap.add_argument("--timeout", type=float, default=3.0, help="the trainer's --timeout (every wait on a peer)")
    ap.add_argument("--minutes", type=float, default=0, help="start no repetition after this long (0: no limit); the table counts what ran")
    a = ap.parse_args()
    started = time.monotonic()
    work = tempfile.mkdtemp(prefix="shardflow_soak_")
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
