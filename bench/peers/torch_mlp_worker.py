"""One rank of PyTorch DDP (optionally + ZeroRedundancyOptimizer) on the MLP bench/two_hosts.py
times, started by that script inside a network namespace: the two hosts meet through a FileStore
on the shared file system and Gloo talks over the namespaces' link (GLOO_SOCKET_IFNAME).

    python3 bench/peers/torch_mlp_worker.py RANK WORLD STORE SIZES STEPS ddp|zero OUT.json
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ddp_reference import make, steps_ms  # noqa: E402  the same model and timing as the one-host table


def main():
    rank, world, store, sizes, steps, mode, out = sys.argv[1:8]
    rank, world, steps = int(rank), int(world), int(steps)
    sizes = [int(s) for s in sizes.split(",")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(make(sizes))
    if mode == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ms = steps_ms(model, opt, sizes, steps)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"median_step_ms": ms}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
