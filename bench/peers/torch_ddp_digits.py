#!/usr/bin/env python3
"""Python's DistributedDataParallel on examples/torch_digits' model, data and batches: the reference
side of bench/bench_libtorch.sh. Two processes over Gloo on this host, one torch thread each (as
`shardflow run` gives each rank of torch_digits on 2 cores), AdamW lr 1e-3, global batch 64.
Prints rank 0's median step time, the figure torch_digits prints as `median step`.

  bench/peers/torch_ddp_digits.py DIGITS.safetensors [--steps N] [--zero]
  --zero: ZeroRedundancyOptimizer(AdamW) instead of AdamW (PyTorch's ZeRO-1)
"""
import argparse
import os
import socket
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "libtorch"))
from torch_digits_ddp import make_net, read_safetensors  # noqa: E402


def rank_main(rank, world, port, data_path, steps, zero):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ddp = nn.parallel.DistributedDataParallel(make_net())
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    d = read_safetensors(data_path)
    x = torch.from_numpy(d["x"].copy()).view(-1, 1, 8, 8)
    labels = torch.from_numpy(d["y"].copy()).argmax(1)
    batch, local = 64, 64 // world
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        idx = (torch.arange(local) + step * batch + rank * local) % x.shape[0]
        opt.zero_grad()
        F.cross_entropy(ddp(x[idx]), labels[idx]).backward()
        opt.step()
        times.append((time.perf_counter() - t0) * 1000)
    if rank == 0:
        times.sort()
        print(f"python DDP{' + ZeroRedundancyOptimizer' if zero else ''}: {steps} steps, median step {times[len(times) // 2]:.3f} ms")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--zero", action="store_true")
    a = ap.parse_args()
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(2, port, a.data, a.steps, a.zero), nprocs=2, join=True)


if __name__ == "__main__":
    main()
