#!/usr/bin/env python3
"""examples/gpt_train's model, data and schedule in PyTorch: the reference the GPT is checked and
timed against (Debian's python3-torch 1.13, CPU, Gloo).

The module has gpt_train's parameter names (wte, wpe, h.N.attn.c_attn, ..., ln_f; the head is wte's
weight), starts from the safetensors file `gpt_train --save-init` writes, draws the same windows
(Note [GPT batches] in examples/gpt/text.hpp: splitmix64 of the seed, step and global row) and
follows the same warm-up + cosine schedule with the same two AdamW groups. So after N steps
PyTorch DDP + AdamW ends where shardflow ends, and their step times compare like for like.

  # ranks as processes on loopback (the tests):
  torch_gpt.py --spawn 2 --data D --init I --steps 20 --save OUT.safetensors [model flags]
  # one rank of a job whose ranks meet through a FileStore (bench/two_hosts.py, in namespaces):
  torch_gpt.py --rank R --world W --store FILE --data D --init I --steps 20 --timing OUT.json
  # --zero: DDP + ZeroRedundancyOptimizer instead of DDP + AdamW

numpy and torch only; tools/safetensors_np.py reads and writes the files (Debian has no python3-safetensors).
"""
import argparse
import json
import os
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "..", "tools"), os.path.join(HERE, "..", "..", "examples", "python")]
from models import batch, load_weights, lr_at, make_gpt  # noqa: E402
from safetensors_np import load as read_safetensors, save as write_safetensors  # noqa: E402


def run_rank(rank, world, init_method, a):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    corpus = read_safetensors(a.data)
    train = corpus["train"]
    model = make_gpt(len(corpus["vocab"]), a.context, a.layers, a.d_model, a.heads)
    load_weights(model, read_safetensors(a.init))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    flat = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": a.weight_decay}, {"params": flat, "weight_decay": 0.0}]
    if a.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(decay, optimizer_class=torch.optim.AdamW, lr=a.lr, betas=(0.9, 0.95), weight_decay=a.weight_decay)
        opt.add_param_group({"params": flat, "weight_decay": 0.0})
    else:
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95))
    local = a.batch // world
    times = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        lr = lr_at(a.lr, step, a.warmup, a.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(train, a.seed, step, rank * local, local, a.context)
        opt.zero_grad()
        logits = ddp(torch.from_numpy(x))
        F.cross_entropy(logits.view(-1, logits.shape[-1]), torch.from_numpy(y).view(-1)).backward()
        opt.step()
        times.append((time.perf_counter() - t0) * 1000.0)
    if rank == 0:
        if a.save:
            write_safetensors(a.save, {n: p.detach().numpy() for n, p in model.named_parameters()})
        if a.timing:
            steady = sorted(times[2:] if len(times) > 4 else times)
            with open(a.timing, "w") as f:
                json.dump({"median_step_ms": steady[len(steady) // 2], "steps_ms": times}, f)
    dist.destroy_process_group()


def spawned(rank, world, port, a):
    run_rank(rank, world, f"tcp://127.0.0.1:{port}", a)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spawn", type=int, help="start this many ranks on loopback")
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--store", help="FileStore path the ranks meet at")
    p.add_argument("--data", required=True)
    p.add_argument("--init", required=True, help="gpt_train --save-init's file")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=25)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    p.add_argument("--zero", action="store_true", help="DDP + ZeroRedundancyOptimizer(AdamW)")
    p.add_argument("--save", help="rank 0's final parameters (safetensors)")
    p.add_argument("--timing", help="rank 0's median step (JSON)")
    a = p.parse_args()
    if a.spawn:
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(spawned, args=(a.spawn, port, a), nprocs=a.spawn, join=True)
    elif a.rank is not None and a.world and a.store:
        run_rank(a.rank, a.world, "file://" + a.store, a)
    else:
        sys.exit("torch_gpt.py: give --spawn N, or --rank, --world and --store")


if __name__ == "__main__":
    main()
