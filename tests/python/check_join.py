"""shardflow.torch taking a node in live (Note [A node joins live]), as a Python trainer writes it:
the loop of check_recovery.py (recovering_loop.py: resumed_step(), then each step in a try whose
except (CommError, TimeoutError) calls model.recover()), nothing more.

Driver: python3 check_join.py SHARDFLOW_CLI WORKDIR. Two launchers on this host, 2 nodes x 2 ranks,
`--nnodes 1:2 --max-restarts 1 --recovery shrink`, ZeRO-2 with snapshots every 2 steps. Node 1's
host is lost (its launcher and both ranks killed at once) in the middle of a step: node 0's ranks go
on alone at world 2 in their own processes. They hold before step HOLD until the driver has started
node 1's launcher again and node 0 says it takes it in; then, at their next snapshot in memory, the
join reaches the Python trainer as the CommError it already answers with model.recover(), and the
newcomer's ranks start with resumed_step() from the running ranks' memory (no file read, no step
done again). Every rank then goes on at world 4: node 0's ranks in their first processes, and the
job ends within float rounding of the same job run uninterrupted on one node of 4 ranks (world 4,
then 2, then 4: the same global batch's mean, summed in other orders). The LR scheduler, which
changes the rate every step, comes back with the step on every rank, the newcomer's included.
Exit 77 (skipped) without python3-torch."""
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import recovering_loop  # beside this file

try:
    import torch
except ImportError:
    sys.exit(77)

STEPS, ROWS, HOLD = 16, 12, 10


def batch(step, rank, world):
    """The global batch of `step`, the same on every rank and in every run; rank r's share of it."""
    g = torch.Generator().manual_seed(2000 + step)
    x, y = torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)
    per = ROWS // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def hold(step):
    """Before step HOLD, until the driver's file exists (SHARDFLOW_CHECK_JOIN_GO; unset: no hold)."""
    go = os.environ.get("SHARDFLOW_CHECK_JOIN_GO")
    if go and step == HOLD:
        while not os.path.exists(go):
            time.sleep(0.02)


def rank_main(out, snapshots):
    import shardflow.torch as sft
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model = sft.DistributedDataParallel(net, zero_stage=2, optimizer=opt, bucket_cap_mb=0.0005, snapshot_dir=snapshots,
                                        snapshot_every=2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.25 * s))
    model.snapshot_with(scheduler=scheduler)
    recovering_loop.train(model, scheduler, batch, STEPS, before_step=hold)
    if model.rank == 0 and out != "-":
        torch.save({"params": {k: v.detach().clone() for k, v in net.named_parameters()}}, out)
    print("rank %d (pid %d): done" % (model.rank, os.getpid()), flush=True)


class Launcher:
    """A `shardflow run` whose output is read as it comes (read_until), and kept."""

    def __init__(self, argv, env):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines = []
        self.cv = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self.cv:
                self.lines.append(line)
                self.cv.notify_all()

    def output(self):
        with self.cv:
            return "".join(self.lines)

    def read_until(self, text, timeout):
        deadline = time.monotonic() + timeout
        with self.cv:
            while text not in "".join(self.lines):
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self.reader.is_alive()):
                    return False
                self.cv.wait(min(left, 0.2))
            return True

    def wait(self, timeout):
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.reader.join(5)
        return code


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(cli, workdir):
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    script = os.path.abspath(__file__)
    one, two, snaps, go = (os.path.join(workdir, n) for n in ("one_node.pt", "two_nodes.pt", "snapshots", "go"))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

    # The job uninterrupted on one node of 4 ranks: where the healed and grown job must end.
    ref = subprocess.run([cli, "run", "--nproc-per-node", "4", "--", sys.executable, script, "rank", one, "-"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240, env=env)
    if ref.returncode != 0:
        print(ref.stdout)
        return "the uninterrupted job on one node failed (exit %d)" % ref.returncode

    port = free_port()
    env["SHARDFLOW_CHECK_JOIN_GO"] = go
    env["SHARDFLOW_LOG_LEVEL"] = "info"  # the newcomer says where its state came from

    def node(k, save):
        inner = "exec '%s' '%s' rank '%s' '%s'" % (sys.executable, script, save, snaps)
        # Node 1's host goes (its launcher, then rank 3) at rank 3's 13th reduction, in its first process only.
        inner = ('if [ "$SHARDFLOW_RESTART_COUNT" = 0 ] && [ "$SHARDFLOW_RECOVERY_ROUND" = 0 ]; then '
                 'export SHARDFLOW_TEST_FAULT=collective:3:host:13; fi; ' + inner)
        argv = [cli, "run", "--nnodes", "1:2", "--max-restarts", "1", "--node-rank", str(k), "--nproc-per-node", "2",
                "--master-port", str(port), "--token", "check-join", "--kill-grace", "2", "--heartbeat-timeout", "3",
                "--recovery", "shrink", "--", "/bin/sh", "-c", inner]
        return Launcher(argv, env)

    n0 = node(0, two)
    n1 = node(1, "-")
    launchers = [n0, n1]
    try:
        if not n0.read_until("recovered in place: every rank joined round 1", 120):
            return "node 0 did not go on alone after node 1's host was lost"
        if n1.wait(60) == 0:
            return "node 1's launcher, lost with its host, exited 0"
        back = node(1, "-")
        launchers.append(back)
        if not n0.read_until("asks to join: taking it in (round 2)", 60):
            return "node 0 did not take the returning node 1 in live"
        open(go, "w").close()
        code_back, code0 = back.wait(180), n0.wait(180)
        if code0 != 0 or code_back != 0:
            return "the grown job failed: node 0 exited %d, the returning node 1 %d" % (code0, code_back)
        out0, out_back = n0.output(), back.output()
        problems = []
        if "grew in place: every rank joined round 2 at world 4" not in out0:
            problems.append("node 0 did not say the world grew in place to 4")
        if "before `optimizer.step()`" in out0 + out_back:
            problems.append("torch warned that the LR scheduler stepped before the optimizer (model.step() did not count as its step)")
        if "restarting every rank" in out0:
            problems.append("node 0 restarted every rank")
        # Node 0's ranks went on in their first processes, through both rounds, at world 4 at the end.
        for r in (0, 1):
            first = out0.split("[rank %d] rank %d (pid " % (r, r), 1)
            pid = first[1].split(")", 1)[0] if len(first) > 1 else "?"
            if "rank %d (pid %s): recovered, going on from step" % (r, pid) not in out0:
                problems.append("rank %d's first process (pid %s) did not recover in place" % (r, pid))
            grown = [l for l in out0.splitlines() if "rank %d (pid %s): recovered, going on from step" % (r, pid) in l]
            if not grown or "at world 4" not in grown[-1]:
                problems.append("rank %d's first process did not go on at world 4 after the join (%s)" % (r, grown[-1:] or "no line"))
            elif grown[-1].split("from step ", 1)[1].split(" ", 1)[0] != grown[-1].rsplit("the scheduler at ", 1)[1].strip():
                problems.append("rank %d: the scheduler did not come back with the step: %s" % (r, grown[-1]))
        # The newcomer's ranks: from the running ranks' memory, at the step the survivors went on from.
        for r in (2, 3):
            if "[rank %d] [info] a join: resumed after step " % r not in out_back or "from the ranks' memory" not in out_back:
                problems.append("the newcomer's rank %d did not resume from the ranks' memory" % r)
            started = [l for l in out_back.splitlines() if "rank %d (pid " % r in l and "starting at step" in l]
            if not started or "world 4" not in started[0]:
                problems.append("the newcomer's rank %d did not start at world 4 (%s)" % (r, started[:1] or "no line"))
            else:
                at = started[0].split("starting at step ", 1)[1].split(",", 1)[0]
                if at == "0" or not started[0].rstrip().endswith("the scheduler at " + at):
                    problems.append("the newcomer's rank %d: %s" % (r, started[0].strip()))
        if "resumed from the snapshot" in out_back:
            problems.append("the newcomer read a snapshot instead of the ranks' memory")
        want, got = torch.load(one), torch.load(two)
        for k, v in want["params"].items():
            err = ((got["params"][k] - v).norm() / v.norm()).item()
            if not err <= 1e-5:
                problems.append("parameter %s is %g (relative) from the uninterrupted run's" % (k, err))
        if problems:
            print("node 0:\n" + out0 + "\nthe returning node 1:\n" + out_back)
            return "; ".join(problems)
        print("2 nodes x 2 ranks, ZeRO-2, node 1's host lost then back: node 0's ranks went on alone and took it in live, "
              "in their first processes; the job ends within 1e-5 of one node of 4 ranks: ok")
        return None
    finally:
        for l in launchers:
            if l.proc.poll() is None:
                l.proc.kill()
                l.wait(10)


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        rank_main(sys.argv[2], sys.argv[3])
    else:
        failure = main(sys.argv[1], sys.argv[2])
        if failure:
            print("check_join: FAILED: " + failure)
        sys.exit(1 if failure else 0)
