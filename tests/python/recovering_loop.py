"""The loop a Python trainer writes to go on in place after a lost peer or a node taken in
(Note [Recovering in place], Note [A node joins live]), shared by check_recovery.py and
check_join.py:

    step = model.resumed_step()
    while step < steps:
        try:
            ...forward, loss.backward(), model.step(), scheduler.step()...; step += 1
        except (sft.CommError, sft.TimeoutError):
            step = model.recover()

Each recovery is printed as 'rank R (pid P): a peer was lost in step S (...); recovering' and
'rank R (pid P): recovered, going on from step S at world W, the scheduler at E', which the
drivers read."""
import os


def train(model, scheduler, batch, steps, before_step=None):
    """Trains `model` from resumed_step() to `steps` on batch(step, rank, world); returns how many
    times it recovered. before_step(step) runs before each step (a test's hold)."""
    import torch  # imported by the caller, which skips (77) without it
    import shardflow.torch as sft
    step = model.resumed_step()
    print("rank %d (pid %d): starting at step %d, world %d, the scheduler at %d" %
          (model.rank, os.getpid(), step, model.world_size, scheduler.last_epoch), flush=True)
    recovered = 0
    while step < steps:
        if before_step:
            before_step(step)
        try:
            model.zero_grad()
            x, y = batch(step, model.rank, model.world_size)
            torch.nn.functional.mse_loss(model(x), y).backward()
            model.step()
            scheduler.step()
            step += 1
        except (sft.CommError, sft.TimeoutError) as e:
            print("rank %d (pid %d): a peer was lost in step %d (%s); recovering" % (model.rank, os.getpid(), step, str(e).splitlines()[0]),
                  flush=True)
            step = model.recover()
            recovered += 1
            print("rank %d (pid %d): recovered, going on from step %d at world %d, the scheduler at %d" %
                  (model.rank, os.getpid(), step, model.world_size, scheduler.last_epoch), flush=True)
    model.wait_all_params()
    if scheduler.last_epoch != steps:
        raise SystemExit("rank %d: the scheduler ended at step %d, the model at %d" % (model.rank, scheduler.last_epoch, steps))
    return recovered
