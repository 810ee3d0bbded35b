"""PyTorch DDP reference on this machine, for bench/RESULTS.md: the same MLPs and batch as
bench_ddp, world 1 (plain) and world 2 (DDP over Gloo, two processes, loopback).

    /usr/bin/python3 bench/torch_ddp_reference.py [--steps 80]

Needs Debian's python3-torch (optional; nothing in the build or tests depends on it).
"""
import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODELS = {
    "784,256,256,10": [784, 256, 256, 10],
    "4 x Linear(256,256)": [256] * 5,
    "8 x Linear(1024,1024)": [1024] * 9,
}


def make(sizes):
    mods = []
    for i in range(len(sizes) - 1):
        mods.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes):
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def steps_ms(model, opt, sizes, batch, steps):
    x, y = torch.randn(batch, sizes[0]), torch.randn(batch, sizes[-1])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    times = sorted(times[5:])
    return statistics.median(times)


def worker(rank, world, store_path, sizes, batch, steps, optname, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(make(sizes))
    opt = (torch.optim.SGD(model.parameters(), lr=1e-3) if optname == "sgd"
           else torch.optim.Adam(model.parameters(), lr=1e-3))
    ms = steps_ms(model, opt, sizes, batch // world, steps)
    if rank == 0:
        out.put(ms)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--global-batch", type=int, default=64)
    args = ap.parse_args()
    print("| model | optimizer | global batch | torch world 1 (ms, median) | torch DDP world 2 (ms, median) |")
    print("|---|---|---|---|---|")
    for name, sizes in MODELS.items():
        steps = args.steps if sizes[0] < 1024 else max(10, args.steps // 3)
        for optname in ("sgd", "adam"):
            torch.set_num_threads(os.cpu_count())
            model = make(sizes)
            opt = (torch.optim.SGD(model.parameters(), lr=1e-3) if optname == "sgd"
                   else torch.optim.Adam(model.parameters(), lr=1e-3))
            w1 = steps_ms(model, opt, sizes, args.global_batch, steps)
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            with tempfile.TemporaryDirectory() as d:
                procs = [ctx.Process(target=worker, args=(r, 2, os.path.join(d, "store"), sizes, args.global_batch,
                                                          steps, optname, q)) for r in range(2)]
                for p in procs:
                    p.start()
                w2 = q.get()
                for p in procs:
                    p.join()
            print(f"| {name} | {optname} | {args.global_batch} | {w1:.3f} | {w2:.3f} |", flush=True)


if __name__ == "__main__":
    main()
