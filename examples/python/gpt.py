#!/usr/bin/env python3
"""examples/gpt_train in Python: the same small GPT, text, batches, schedule and AdamW groups,
data-parallel through shardflow.torch instead of the C++ trainer. A PyTorch training loop with
DistributedDataParallel swapped for shardflow's; one process per rank.

  shardflow run --nproc-per-node 2 -- python3 examples/python/gpt.py --zero-stage 2 --forward-prefetch
  torchrun --nproc-per-node 2 examples/python/gpt.py            # torchrun's environment works too
  python3 examples/python/gpt.py                               # alone: a world of 1

From gpt_train's initial weights (`gpt_train --save-init I`, then --init I here) it ends where
gpt_train ends after the same steps (tests/libtorch/gpt_checks.py). --timing writes the median
step, the figure bench/python_overhead.py sets against gpt_train's.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "tools")]
from models import batch, load_weights, lr_at, make_gpt  # noqa: E402
from safetensors_np import load as read_safetensors, save as write_safetensors  # noqa: E402

import shardflow.torch as sft  # noqa: E402


def heldout_loss(model, val, context, windows):
    """The mean loss over `windows` evenly spaced windows of the held-out text."""
    starts = [int(i * (len(val) - context - 1) / max(1, windows - 1)) for i in range(windows)]
    with torch.no_grad():
        x = torch.stack([torch.from_numpy(val[s:s + context].astype("int64")) for s in starts])
        y = torch.stack([torch.from_numpy(val[s + 1:s + context + 1].astype("int64")) for s in starts])
        logits = model(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(HERE, "..", "..", "build", "data", "fortunes.safetensors"),
                   help="scripts/text_to_safetensors.py's corpus (train, val, vocab)")
    p.add_argument("--init", help="initial weights (safetensors, gpt_train's names) instead of --seed's")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="sequences per step over all ranks")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1, help="the batches' windows (and the weights without --init)")
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--overlap", default="interleaved")
    p.add_argument("--forward-prefetch", action="store_true")
    p.add_argument("--bucket-mb", type=float, default=None, help="bucket cap, MiB (default: 25, shrunk for a small model)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: OMP_NUM_THREADS, else the cores / the ranks here)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--backend", default="auto", help="under a launcher: auto | shm | gloo | hierarchical (as gpt_train's --backend)")
    p.add_argument("--trace", help="Chrome trace of each rank's forward, backward, reductions and steps")
    p.add_argument("--save", help="rank 0's final parameters (safetensors, gpt_train's names)")
    p.add_argument("--save-checkpoint", help="a sharded checkpoint (every rank writes its shard) into this directory at the end")
    p.add_argument("--resume", help="go on from a checkpoint (--save-checkpoint's directory, or gpt_train's file)")
    p.add_argument("--timing", help="rank 0's step times and their median (JSON)")
    p.add_argument("--log-every", type=int, default=0)
    a = p.parse_args()

    rank, world = sft.init(timeout=a.timeout, backend=a.backend)
    if a.batch % world:
        sys.exit("gpt.py: --batch %d is not a multiple of the world size %d" % (a.batch, world))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(a.threads or int(os.environ.get("OMP_NUM_THREADS", "0")) or max(1, (os.cpu_count() or 1) // local_ranks))

    corpus = read_safetensors(a.data)
    train, val, vocab = corpus["train"], corpus["val"], len(corpus["vocab"])
    torch.manual_seed(a.seed)
    model = make_gpt(vocab, a.context, a.layers, a.d_model, a.heads)
    if a.init:
        load_weights(model, read_safetensors(a.init))
    # AdamW with decay on matrices and embeddings, none on biases and LayerNorm gains (nanoGPT's).
    decay = [p_ for p_ in model.parameters() if p_.dim() >= 2]
    flat = [p_ for p_ in model.parameters() if p_.dim() < 2]
    ddp = sft.DistributedDataParallel(
        model, zero_stage=a.zero_stage, overlap=a.overlap, forward_prefetch=a.forward_prefetch, bucket_cap_mb=a.bucket_mb, trace=a.trace,
        optimizer=("adamw", {"lr": a.lr, "betas": (0.9, 0.95)},
                   [{"params": decay, "weight_decay": a.weight_decay}, {"params": flat, "weight_decay": 0.0}]))
    first = 0
    if a.resume:
        ddp.load_checkpoint(a.resume)
        first = ddp.optimizer_steps
    if rank == 0:
        print("gpt.py: %d parameters, world %d, global batch %d x %d tokens, zero stage %d, overlap %s%s"
              % (sum(p_.numel() for p_ in model.parameters()), world, a.batch, a.context, a.zero_stage, a.overlap,
                 ", forward prefetch" if a.forward_prefetch else ""), flush=True)

    local = a.batch // world
    every = a.log_every or max(1, a.steps // 20)
    times = []
    for step in range(first, a.steps):
        t0 = time.perf_counter()
        for group in ddp.param_groups:
            group["lr"] = lr_at(a.lr, step, a.warmup, a.steps)
        x, y = batch(train, a.seed, step, rank * local, local, a.context)
        ddp.zero_grad()
        logits = ddp(torch.from_numpy(x))
        loss = F.cross_entropy(logits.view(-1, vocab), torch.from_numpy(y).view(-1))
        loss.backward()
        ddp.step()
        times.append((time.perf_counter() - t0) * 1000.0)
        if rank == 0 and ((step + 1) % every == 0 or step + 1 == a.steps):
            print("step %d/%d  loss %.4f (rank 0's rows)  %.1f ms" % (step + 1, a.steps, loss.item(), times[-1]), flush=True)
    ddp.wait_all_params()
    if a.save_checkpoint:
        ddp.save_sharded_checkpoint(a.save_checkpoint)
    if rank == 0:
        median = sorted(times)[len(times) // 2] if times else 0.0  # over every step, as gpt_train's
        print("median step %.1f ms; held-out loss %.4f" % (median, heldout_loss(model, val, a.context, 64)), flush=True)
        figures = ddp.stats()["median"]
        print("runtime (rank 0, median): " + ", ".join("%s %.1f" % (k, v) for k, v in figures.items() if k.endswith("_ms")), flush=True)
        if a.save:
            write_safetensors(a.save, {n: p_.detach().numpy() for n, p_ in model.named_parameters()})
        if a.timing:
            with open(a.timing, "w") as f:
                json.dump({"median_step_ms": median, "steps_ms": times}, f)


if __name__ == "__main__":
    main()
