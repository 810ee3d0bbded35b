#!/usr/bin/env python3
"""shardflow.torch on CUDA tensors, against torch.optim on the same GPU.

World 1 (alone, or `shardflow run --nproc-per-node 1`, which gives NCCL): a small GPT on the GPU,
shardflow's step inside backward at ZeRO 0, 1, 2 with AdamW and SGD with momentum, and the same
steps with torch.optim (foreach=False: the plain per-parameter loop) -> parameters and losses
agree within float32 rounding of two optimizer kernels. Also: the clip inside the step, a
bf16-autocast forward, the state_dict round trip, and refusals by name (a module on two devices,
device_ids of another GPU). Exits 77 (ctest's skip) where torch sees no GPU: Debian's torch is a
CPU build, so CI skips this and the GPU machine runs it (scripts/gpu/run.sh).
"""
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "..", "examples", "python")]
from models import make_gpt  # noqa: E402

if not torch.cuda.is_available():
    print("check_cuda.py: skipped, torch %s sees no GPU" % torch.__version__)
    sys.exit(77)

import shardflow.torch as sft  # noqa: E402

DEV = torch.device("cuda", 0)
VOCAB, CONTEXT, LAYERS, D, HEADS, ROWS, STEPS = 96, 32, 2, 64, 4, 8, 6


def model_at(seed=1):
    torch.manual_seed(seed)
    return make_gpt(VOCAB, CONTEXT, LAYERS, D, HEADS).to(DEV)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (ROWS, CONTEXT + 1), generator=g)
    return x[:, :-1].to(DEV), x[:, 1:].to(DEV)


def loss_of(model, step, autocast=False):
    x, y = batch(step)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(x)
    return F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1))


def groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    flat = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": flat, "weight_decay": 0.0}]


def reference(kind, clip=None, autocast=False):
    """torch.optim on the GPU: the numbers shardflow's step must reproduce."""
    model = model_at()
    if kind == "adamw":
        opt = torch.optim.AdamW(groups(model), lr=3e-3, betas=(0.9, 0.95), foreach=False)
    else:
        opt = torch.optim.SGD(groups(model), lr=3e-2, momentum=0.9, foreach=False)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, step, autocast)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return model, losses


def shardflow_run(kind, stage, clip=None, autocast=False, **extra):
    model = model_at()
    if kind == "adamw":
        spec = ("adamw", {"lr": 3e-3, "betas": (0.9, 0.95)}, groups(model))
    else:
        spec = ("sgd", {"lr": 3e-2, "momentum": 0.9}, groups(model))
    ddp = sft.DistributedDataParallel(model, zero_stage=stage, optimizer=spec, clip_grad_norm=clip, device_ids=[DEV.index], **extra)
    losses = []
    for step in range(STEPS):
        ddp.zero_grad()
        loss = loss_of(ddp, step, autocast)
        loss.backward()
        ddp.step()
        losses.append(loss.item())
    ddp.wait_all_params()
    return ddp, model, losses


def max_diff(a, b):
    """The largest difference over the parameters, leaving out the key part of each attention's
    c_attn.bias: its gradient is zero in exact arithmetic (softmax does not change when every key
    of a query gains the same q.b_k), so what autograd returns there is rounding noise, and Adam
    divides that noise by its own square root into full-size steps. Two correct kernels then move
    those entries apart by up to ~lr per step while the loss stays bit for bit the same (measured:
    6e-6 there, 1.3e-7 everywhere else, on the GPU and on the CPU alike)."""
    worst = 0.0
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        d = (pa.detach().float() - pb.detach().float()).abs()
        if name.endswith("attn.c_attn.bias"):
            d = torch.cat([d[:D], d[2 * D:]])
        worst = max(worst, d.max().item())
    return worst


failed = 0


def check(what, ok, detail=""):
    global failed
    print("%s %s%s" % ("ok  " if ok else "FAIL", what, ("  (" + detail + ")") if detail else ""), flush=True)
    failed += 0 if ok else 1


def refused(what, fn, *needles):
    try:
        fn()
    except (ValueError, RuntimeError, TypeError) as e:
        text = str(e)
        check(what, all(n in text for n in needles), text[:160])
        return
    check(what, False, "no error")


# No init(): DistributedDataParallel joins the job itself, and picks NCCL under a launcher for a
# CUDA module (alone: a world of one on the module's GPU), as a torchrun script's init would.

# Tolerances: the same float32 arithmetic in another kernel order; six steps of AdamW at lr 3e-3
# move a weight by ~2e-2, so 2e-6 is ~1e-4 of the movement.
for kind in ("adamw", "sgd"):
    ref_model, ref_losses = reference(kind)
    for stage in (0, 1, 2):
        ddp, model, losses = shardflow_run(kind, stage)
        if kind == "adamw" and stage == 0:
            check("world of 1, on %s" % DEV, ddp._ddp.world_size() == 1 and ddp._ddp.rank() == 0)
        d = max_diff(model, ref_model)
        dl = max(abs(a - b) for a, b in zip(losses, ref_losses))
        check("%s ZeRO-%d on CUDA = torch.optim on CUDA" % (kind, stage), d < 2e-6 and dl < 1e-5,
              "max |param diff| %.2e, max |loss diff| %.2e, loss %.4f -> %.4f" % (d, dl, losses[0], losses[-1]))
        del ddp, model

ref_model, ref_losses = reference("adamw", clip=0.05)
ddp, model, losses = shardflow_run("adamw", 1, clip=0.05)
check("clip_grad_norm=0.05 inside the step = torch's clip_grad_norm_ + AdamW", max_diff(model, ref_model) < 2e-6,
      "max |param diff| %.2e, last norm %.4f" % (max_diff(model, ref_model), ddp.last_grad_norm))
del ddp, model

ref_model, ref_losses = reference("adamw", autocast=True)
ddp, model, losses = shardflow_run("adamw", 2, autocast=True)
dl = max(abs(a - b) for a, b in zip(losses, ref_losses))
# bf16: the same noise feeds back into the forward through bf16 rounding, so the weights that read
# the keys drift further (5e-4 measured); the loss stays within 1e-4.
check("bf16 autocast, fp32 parameters, ZeRO-2 = torch.optim under the same autocast", max_diff(model, ref_model) < 2e-3 and dl < 1e-3,
      "max |param diff| %.2e, max |loss diff| %.2e" % (max_diff(model, ref_model), dl))

# The training state of a GPU run: torch's own state_dict of the module works as ever; shardflow's
# gathered state (optimizer moments in the shards' device memory) is refused by name, not yet
# written for device shards.
weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
check("model.module.state_dict() of a CUDA model holds the trained weights", all(torch.equal(weights[n], p.detach()) for n, p in model.named_parameters()))
refused("ddp.state_dict() of device shards is refused, naming the parameter", lambda: ddp.state_dict(), "lives on a GPU", "wte.weight")
del ddp, model

two = model_at()
two.ln_f.to("cpu")
refused("a module on two devices is refused, naming them", lambda: sft.DistributedDataParallel(two), "cpu", "cuda:0", "one device")
refused("device_ids of another GPU is refused, naming the module's", lambda: sft.DistributedDataParallel(model_at(), device_ids=[DEV.index + 1]),
        "device_ids=[%d]" % (DEV.index + 1), "cuda:%d" % DEV.index)

print("check_cuda.py: %d failed" % failed)
sys.exit(1 if failed else 0)
