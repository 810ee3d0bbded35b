"""shardflow side by side with PyTorch on this machine, in one run: the same MLPs (4 x Linear(256,256)
and 8 x Linear(1024,1024), ReLU between), 32 rows per rank, Adam, the same OpenBLAS, one BLAS thread
per rank, configurations alternated A B A B ... over --reps rounds, medians of per-run medians.

    /usr/bin/python3 bench/peers/torch_ddp_reference.py [--build build] [--reps 3]

Rows: torch world 1; torch DDP world 2 (Gloo); torch DDP + ZeroRedundancyOptimizer world 2 (Gloo);
shardflow world 1; shardflow world 2 (one process per rank under `shardflow run`, shm backend) per
ZeRO stage; and the machine's floor: two independent shardflow world-1 processes running at once
(on 2 cores two busy processes each run slower than one alone: world 2 is judged against that).
Step time: torch, wall time of zero_grad + forward + backward + step; shardflow, its own iteration
time (Runtime::stats(): end of one wait() to the end of the next, which includes the loss
all-reduce the trainer adds). Needs Debian's python3-torch (optional; nothing in the build or the
tests depends on it).
"""
import argparse
import os
import statistics
import tempfile
import time

from shardflow_mlp_runs import BATCH, MODELS, shardflow_world1, shardflow_world2, steps_for
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def make(sizes):
    torch.manual_seed(0)
    mods = []
    for i in range(len(sizes) - 1):
        mods.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes):
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def steps_ms(model, opt, sizes, steps):
    x, y = torch.randn(BATCH, sizes[0]), torch.randn(BATCH, sizes[-1])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[5:])


def torch_worker(rank, world, store, sizes, steps, zero, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(make(sizes))
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ms = steps_ms(model, opt, sizes, steps)
    if rank == 0:
        out.put(ms)
    dist.destroy_process_group()


def torch_world1(sizes, steps):
    torch.set_num_threads(1)
    model = make(sizes)
    return steps_ms(model, torch.optim.Adam(model.parameters(), lr=1e-3), sizes, steps)


def torch_world2(sizes, steps, zero):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=torch_worker, args=(r, 2, os.path.join(d, "store"), sizes, steps, zero, q)) for r in range(2)]
        for p in procs:
            p.start()
        ms = q.get()
        for p in procs:
            p.join()
    return ms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {a.reps} rounds A B A B, medians; ms per step")
    for name, sizes in MODELS.items():
        steps = steps_for(sizes)
        configs = [
            ("torch world 1", lambda: torch_world1(sizes, steps)),
            ("torch DDP world 2", lambda: torch_world2(sizes, steps, False)),
            ("torch DDP + ZeroRedundancyOptimizer world 2", lambda: torch_world2(sizes, steps, True)),
            ("shardflow world 1", lambda: shardflow_world1(a.build, sizes, steps)),
            ("floor: 2 x shardflow world 1 at once", lambda: shardflow_world1(a.build, sizes, steps, copies=2)),
        ] + [(f"shardflow world 2 shm, ZeRO-{st}", (lambda st=st: shardflow_world2(a.build, sizes, steps, st))) for st in (0, 1, 2)]
        runs = {c: [] for c, _ in configs}
        for _ in range(a.reps):
            for c, f in configs:
                runs[c].append(f())
        med = {c: statistics.median(v) for c, v in runs.items()}
        floor, zero = med["floor: 2 x shardflow world 1 at once"], med["torch DDP + ZeroRedundancyOptimizer world 2"]
        print(f"\n{name} (Adam, {BATCH} rows per rank, {steps} steps)")
        print("| configuration | ms / step (median) | runs | / floor | / torch ZeRO |")
        print("|---|---|---|---|---|")
        for c, _ in configs:
            print(f"| {c} | {med[c]:.3f} | {' '.join(f'{x:.2f}' for x in runs[c])} | {med[c] / floor:.2f} | {med[c] / zero:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
