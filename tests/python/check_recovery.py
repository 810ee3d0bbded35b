"""shardflow.torch recovering in place (Note [Recovering in place]), as a Python trainer writes it:
model.snapshot_with(scheduler=scheduler), then recovering_loop.py's loop (resumed_step(), each step
in a try whose except (CommError, TimeoutError) calls model.recover()).

Driver: python3 check_recovery.py SHARDFLOW_CLI WORKDIR. Under `shardflow run --nproc-per-node 3
--max-restarts 1 --recovery in-place`, rank 1's first process is killed (kill -9) at its 13th
collective, in the middle of a step: ranks 0 and 2 keep their processes, only rank 1's starts again,
and the job ends bit for bit where the same job ends uninterrupted (ZeRO-1 and ZeRO-2 at 3 ranks on
shared memory). With --recovery shrink no process starts: ranks 0 and 2 go on at world 2, each
taking half of every global batch instead of a third, so the gradient is the same mean and the job
ends within float rounding of the uninterrupted one. An LR scheduler that changes the rate every step
goes back to the snapshot's step with the model (Note [The trainer's state in a snapshot]): a
counter left where the survivors were would end elsewhere. And a scheduler the snapshots do not
carry is refused by name when a run goes on from one. With redundancy=2 (mirrored shards, Note
[Mirrored shards]) and a snapshot only every 5 steps, the survivors go on from the very step they
were in (nothing rolled back: rank 1's shard comes from its twin, the scheduler's state from a
survivor's memory) and the job still ends bit for bit. Exit 77 (skipped) without python3-torch."""
import os
import shutil
import subprocess
import sys

import recovering_loop  # beside this file

try:
    import torch
except ImportError:
    sys.exit(77)

STEPS, ROWS = 12, 12
F = torch.nn.functional


def batch(step, rank, world):
    """The global batch of `step`, the same on every rank and in every run; rank r's share of it."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)
    per = ROWS // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def make_model(snapshots, stage, redundancy=1):
    import shardflow.torch as sft
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    # With twins the snapshots are only the fallback: seldom, so that one taken would show.
    model = sft.DistributedDataParallel(net, zero_stage=stage, optimizer=opt, bucket_cap_mb=0.0005, snapshot_dir=snapshots,
                                        snapshot_every=1 if redundancy == 1 else 5, redundancy=redundancy)
    # A rate that changes every step: a counter off by any number of steps ends elsewhere.
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.25 * s))
    return net, model, scheduler


def rank_main(out, snapshots, stage, redundancy):
    import shardflow.torch as sft
    net, model, scheduler = make_model(snapshots, stage, redundancy)
    model.snapshot_with(scheduler=scheduler)
    if not os.environ.get("SHARDFLOW_RECOVERY"):
        # Outside --recovery in-place there is no next round to go on in: refused, naming the flag.
        try:
            model.recover()
            raise SystemExit("rank %d: recover() without --recovery in-place was accepted" % model.rank)
        except ValueError as e:
            if "--recovery in-place" not in str(e):
                raise SystemExit("rank %d: recover() without --recovery in-place: %r does not name the flag" % (model.rank, str(e)))
    recovered = recovering_loop.train(model, scheduler, batch, STEPS)
    if model.rank == 0:
        torch.save({"params": {k: v.detach().clone() for k, v in net.named_parameters()}}, out)
    print("rank %d (pid %d): done, %d recovery(ies)" % (model.rank, os.getpid(), recovered), flush=True)


def run(cli, workdir, name, stage, recovery=None, redundancy=1):
    out, snaps = os.path.join(workdir, name + ".pt"), os.path.join(workdir, name + "_snapshots")
    # A snapshot left by an earlier run would be resumed from, past the fault.
    shutil.rmtree(snaps, ignore_errors=True)
    if os.path.exists(out):
        os.remove(out)
    script = os.path.abspath(__file__)
    inner = "exec /usr/bin/python3 '%s' rank '%s' '%s' %d %d" % (script, out, snaps, stage, redundancy)
    if recovery:
        # The fault only in round 0's processes: rank 1's replacement starts in round 1.
        inner = 'if [ "$SHARDFLOW_RECOVERY_ROUND" = 0 ]; then export SHARDFLOW_TEST_FAULT=collective:1:kill:13; fi; ' + inner
    argv = [cli, "run", "--nproc-per-node", "3"]
    if recovery:
        argv += ["--max-restarts", "1", "--recovery", recovery, "--heartbeat-timeout", "2"]
    argv += ["--", "/bin/sh", "-c", inner]
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    if p.returncode != 0:
        print(p.stdout)
        raise SystemExit("check_recovery: %s (stage %d) failed with exit code %d" % (name, stage, p.returncode))
    return torch.load(out), p.stdout


def unnamed_scheduler(snapshots):
    """One process, world 1: 3 steps with snapshots carrying a scheduler; then the same script from
    the snapshots with the scheduler not named in snapshot_with(): refused by name; named, the
    scheduler goes on at the snapshot's step."""
    import shardflow.torch as sft
    shutil.rmtree(snapshots, ignore_errors=True)
    _, model, scheduler = make_model(snapshots, 1)
    model.snapshot_with(scheduler=scheduler)
    model.resumed_step()
    for step in range(3):
        model.zero_grad()
        x, y = batch(step, 0, 1)
        F.mse_loss(model(x), y).backward()
        model.step()
        scheduler.step()
    # The runtime goes without wait_checkpoint(): the snapshot of step 3 stays incomplete, and the
    # one of step 2 (its state handed over at step 3's forward) is the newest.
    del model, scheduler
    _, model, scheduler = make_model(snapshots, 1)
    try:
        model.resumed_step()
        raise SystemExit("unnamed scheduler: resumed_step() went on with a scheduler the snapshots do not carry")
    except ValueError as e:
        if "model.snapshot_with(scheduler=...)" not in str(e):
            raise SystemExit("unnamed scheduler: %r does not say how to carry it" % str(e))
    del model, scheduler
    _, model, scheduler = make_model(snapshots, 1)
    model.snapshot_with(scheduler=scheduler)
    step = model.resumed_step()
    if step != 2 or scheduler.last_epoch != step:
        raise SystemExit("named scheduler: resumed at step %d, the scheduler at %d" % (step, scheduler.last_epoch))
    print("a scheduler the snapshots do not carry: refused by name; carried: back at step %d: ok" % step)


def main(cli, workdir):
    os.makedirs(workdir, exist_ok=True)
    failed = 0
    # Its own process (a world of 1 of its own): the runtimes it makes one after the other.
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "unnamed", os.path.join(workdir, "unnamed_snapshots")],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    print(p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "(no output)")
    if p.returncode != 0:
        print(p.stdout)
        failed += 1
    for stage in (1, 2):
        want, _ = run(cli, workdir, "ref%d" % stage, stage)
        for recovery in ("in-place", "shrink"):
            got, log = run(cli, workdir, "%s%d" % (recovery, stage), stage, recovery)
            problems = []
            if "recovering in place (round 1" not in log:
                problems.append("the launcher did not recover in place")
            if "restarting every rank" in log:
                problems.append("the launcher restarted every rank")
            # Ranks 0 and 2 recovered in their first processes (pids the launcher started first).
            for r in (0, 2):
                started = log.split("rank %d (pid " % r, 1)
                pid = started[1].split(")", 1)[0] if len(started) > 1 else "?"
                if "(pid %s): recovered, going on from step" % pid not in log:
                    problems.append("rank %d's first process (pid %s) did not recover in place" % (r, pid))
            if recovery == "in-place":
                if "going on from step" not in log or "at world 3" not in log:
                    problems.append("the survivors did not go on at world 3")
                for k, v in want["params"].items():
                    if not torch.equal(got["params"][k], v):
                        problems.append("parameter %s differs from the uninterrupted run's (max %g)" % (k, (got["params"][k] - v).abs().max().item()))
            else:
                if "at world 2" not in log:
                    problems.append("the survivors did not go on at world 2")
                # The same global batch's mean over 2 ranks instead of 3: the sums round differently.
                for k, v in want["params"].items():
                    err = ((got["params"][k] - v).norm() / v.norm()).item()
                    if not err <= 1e-5:
                        problems.append("parameter %s is %g (relative) from the uninterrupted run's" % (k, err))
            status = "ok" if not problems else "FAILED: " + "; ".join(problems)
            print("stage %d, --recovery %s: %s" % (stage, recovery, status))
            if problems:
                print(log)
                failed += 1
    # Mirrored shards: rank 1 killed in the middle of a step, the survivors go on from that very step.
    want, _ = run(cli, workdir, "ref1", 1)
    got, log = run(cli, workdir, "twins1", 1, "in-place", redundancy=2)
    problems = []
    if "no step rolled back" not in log:
        problems.append("the survivors did not go on from the twins")
    for r in (0, 2):
        lost = log.split("rank %d (pid " % r, 1)[1].split("a peer was lost in step ", 1) if "rank %d (pid " % r in log else []
        lost_in = lost[1].split(" ", 1)[0] if len(lost) > 1 else "?"
        if "rank %d (pid" % r not in log or ("): recovered, going on from step %s at world 3" % lost_in) not in log:
            problems.append("rank %d did not go on from step %s, the one it lost a peer in" % (r, lost_in))
    for k, v in want["params"].items():
        if not torch.equal(got["params"][k], v):
            problems.append("parameter %s differs from the uninterrupted run's (max %g)" % (k, (got["params"][k] - v).abs().max().item()))
    print("stage 1, --recovery in-place, redundancy=2: %s" % ("ok" if not problems else "FAILED: " + "; ".join(problems)))
    if problems:
        print(log)
        failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        rank_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif sys.argv[1] == "unnamed":
        unnamed_scheduler(sys.argv[2])
    else:
        sys.exit(main(sys.argv[1], sys.argv[2]))
