#!/usr/bin/env python3
"""scikit-learn's handwritten digits with a small CNN, data-parallel through shardflow.torch: the
PyTorch loop a DDP user already has, with DistributedDataParallel swapped for shardflow's (ZeRO-1
AdamW by default), a sharded checkpoint to resume from, and the held-out accuracy at the end.
examples/torch_digits.cpp is the same job in C++; from the same weights both end alike.

  shardflow run --nproc-per-node 2 -- python3 examples/python/digits.py
  shardflow run --nproc-per-node 2 -- python3 examples/python/digits.py --zero-stage 2 --forward-prefetch
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "tools")]
from models import load_weights, make_digits_net  # noqa: E402
from safetensors_np import load as read_safetensors, save as write_safetensors  # noqa: E402

import shardflow.torch as sft  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(HERE, "..", "..", "build", "data", "digits.safetensors"),
                   help="the digits as safetensors (x, y, x_test, y_test; the build writes it with python3-sklearn)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--overlap", default="interleaved")
    p.add_argument("--forward-prefetch", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", help="initial weights (safetensors with the module's names) instead of --seed's")
    p.add_argument("--save", help="rank 0's final parameters (safetensors)")
    p.add_argument("--checkpoint", help="a sharded checkpoint into this directory at the end")
    p.add_argument("--resume", help="go on from a checkpoint directory (any world size or stage)")
    a = p.parse_args()

    rank, world = sft.init(timeout=120)
    if a.global_batch % world:
        sys.exit("digits.py: --global-batch %d is not a multiple of the world size %d" % (a.global_batch, world))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    d = read_safetensors(a.data)
    x = torch.from_numpy(d["x"].copy()).view(-1, 1, 8, 8)
    labels = torch.from_numpy(d["y"].copy()).argmax(1)
    torch.manual_seed(a.seed)
    net = make_digits_net()
    if a.init:
        load_weights(net, read_safetensors(a.init))
    model = sft.DistributedDataParallel(net, zero_stage=a.zero_stage, overlap=a.overlap, forward_prefetch=a.forward_prefetch,
                                        optimizer=("adamw", {"lr": a.lr}))
    first = 0
    if a.resume:
        model.load_checkpoint(a.resume)
        first = model.optimizer_steps
    local = a.global_batch // world
    for step in range(first, a.steps):
        # The same rows as torch_digits: step * B + rank * local + k, modulo the rows.
        idx = (torch.arange(local) + step * a.global_batch + rank * local) % x.shape[0]
        model.zero_grad()
        loss = F.cross_entropy(model(x[idx]), labels[idx])
        loss.backward()
        model.step()
        if rank == 0 and (step + 1) % max(1, a.steps // 10) == 0:
            print("step %d/%d  loss %.4f (rank 0's rows)" % (step + 1, a.steps, loss.item()), flush=True)
    model.wait_all_params()
    if a.checkpoint:
        model.save_sharded_checkpoint(a.checkpoint)
    if rank == 0:
        with torch.no_grad():
            x_test = torch.from_numpy(d["x_test"].copy()).view(-1, 1, 8, 8)
            accuracy = (net(x_test).argmax(1) == torch.from_numpy(d["y_test"].copy()).argmax(1)).double().mean().item()
        print("held-out accuracy %.1f%% (%d images never trained on)" % (100 * accuracy, x_test.shape[0]), flush=True)
        if a.save:
            write_safetensors(a.save, {n: t.detach().numpy() for n, t in net.named_parameters()})


if __name__ == "__main__":
    main()
