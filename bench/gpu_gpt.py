#!/usr/bin/env python3
"""A GPT on one GPU, side by side: PyTorch + torch.optim.AdamW(fused=True) against shardflow.torch
stepping AdamW inside backward at ZeRO-1 and ZeRO-2 (world 1). Same model (examples/python/
models.py's GPT), same initial weights, same batches of the fortunes corpus, same AdamW groups.

Configurations are taken in turn inside one process (A B C A B C ...), each from fresh weights:
warm-up steps, then timed steps with the device synchronised at each step's end. Per
configuration: the median step, tokens/s, the device memory in use at the steps' ends above the
process's own before the model (cudaMemGetInfo: counts torch's cache and shardflow's own device
buffers alike), torch's peak of allocated tensors, and every step's loss (the first round's,
compared across configurations). --profile DIR writes a torch.profiler Chrome trace (Perfetto
opens it) of a few shardflow steps: the optimizer's kernels on their own stream beside backward.

  python3 bench/gpu_gpt.py --data build/data/fortunes.safetensors --out gpu_gpt.json
  # GPT-2 small's shape (124 M parameters with the padded GPT-2 vocabulary) at context 256
"""
import argparse
import gc
import gzip
import json
import os
import shutil
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tools"), os.path.join(HERE, "..", "examples", "python")]
from models import batch, make_gpt  # noqa: E402
from safetensors_np import load as read_safetensors  # noqa: E402

import shardflow.torch as sft  # noqa: E402


def device_used():
    free, total = torch.cuda.mem_get_info()
    return total - free


def build(a):
    torch.manual_seed(a.seed)
    model = make_gpt(a.vocab, a.context, a.layers, a.d_model, a.heads).cuda()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    flat = [p for p in model.parameters() if p.dim() < 2]
    return model, [{"params": decay, "weight_decay": 0.1}, {"params": flat, "weight_decay": 0.0}]


def run(config, a, train, steps, trace=None, profile=None):
    """One configuration from fresh weights: (per-step ms, losses, memory figures)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = device_used()
    torch.cuda.reset_peak_memory_stats()
    model, groups = build(a)
    if config == "torch":
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), fused=True)
        net = model
    else:
        net = sft.DistributedDataParallel(model, zero_stage=int(config[-1]), optimizer=("adamw", {"lr": a.lr, "betas": (0.9, 0.95)}, groups),
                                          trace=trace, device_ids=[0])
    times, losses, used = [], [], 0
    prof = None
    for step in range(steps):
        if profile and step == a.warmup:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        x, y = batch(train, a.seed, step, 0, a.batch, a.context)
        x, y = torch.from_numpy(x).cuda(non_blocking=True), torch.from_numpy(y).cuda(non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if config == "torch":
            opt.zero_grad(set_to_none=True)
        else:
            net.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.bf16):
            logits = net(x)
        loss = F.cross_entropy(logits.float().view(-1, a.vocab), y.view(-1))
        loss.backward()
        if config == "torch":
            opt.step()
        else:
            net.step()
        torch.cuda.synchronize()
        if step >= a.warmup:
            times.append((time.perf_counter() - t0) * 1000.0)
        losses.append(loss.item())
        used = max(used, device_used() - base)
        if prof and step == a.warmup + a.profile_steps - 1:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(profile)
            prof = None
    memory = {"device_in_use_mib": used / 2**20, "torch_peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20}
    if config != "torch":
        net.wait_all_params()
        memory["shardflow"] = net._ddp.memory_report()
        memory["shardflow_median"] = net.stats()["median"]
    del net, model, groups
    if config == "torch":
        del opt
    return times, losses, memory


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if v else 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="scripts/text_to_safetensors.py's corpus")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--vocab", type=int, default=50304, help="GPT-2's vocabulary padded to 64; the corpus's characters are its first ids")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=15, help="per configuration and round, warm-up included")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--bf16", action="store_true", help="torch.autocast(cuda, bfloat16) forward; fp32 parameters (the masters)")
    p.add_argument("--configs", default="torch,zero1,zero2")
    p.add_argument("--profile", help="directory: a torch.profiler trace of --profile-steps steps of each shardflow configuration")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--trace", help="directory: shardflow's own trace (Config::trace) of the last round of each shardflow configuration")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    corpus = read_safetensors(a.data)
    train = corpus["train"]
    if len(corpus["vocab"]) > a.vocab:
        sys.exit("gpu_gpt.py: --vocab %d is below the corpus's %d characters" % (a.vocab, len(corpus["vocab"])))
    sft.init(timeout=300)
    configs = a.configs.split(",")
    results = {c: {"step_ms": [], "losses": None, "memory": []} for c in configs}
    if a.trace:
        os.makedirs(a.trace, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False  # both sides alike: plain fp32 matrix products unless --bf16
    for r in range(a.rounds):
        for c in configs:
            last = r == a.rounds - 1
            trace = os.path.join(a.trace, "%s.json" % c) if (a.trace and last and c != "torch") else None
            times, losses, memory = run(c, a, train, a.steps, trace=trace)
            results[c]["step_ms"] += times
            results[c]["memory"].append(memory)
            if results[c]["losses"] is None:
                results[c]["losses"] = losses
            print("round %d %-6s median %.2f ms  loss %.4f -> %.4f  device memory %.0f MiB" %
                  (r + 1, c, median(times), losses[0], losses[-1], memory["device_in_use_mib"]), flush=True)
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
        for c in configs:
            path = os.path.join(a.profile, "%s.json" % c)
            run(c, a, train, a.warmup + a.profile_steps, profile=path)
            with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(path)
    params = sum(p.numel() for p in build(a)[0].parameters())
    tokens = a.batch * a.context
    summary = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "params": params, "tokens_per_step": tokens,
               "bf16_autocast": a.bf16, "args": vars(a), "configs": {}}
    ref = results[configs[0]]
    for c in configs:
        m = median(results[c]["step_ms"])
        summary["configs"][c] = {
            "median_step_ms": m, "tokens_per_s": tokens * 1000.0 / m, "vs_" + configs[0]: m / median(ref["step_ms"]),
            "max_loss_diff_vs_" + configs[0]: max(abs(x - y) for x, y in zip(results[c]["losses"], ref["losses"])),
            "device_in_use_mib": max(x["device_in_use_mib"] for x in results[c]["memory"]),
            "torch_peak_allocated_mib": max(x["torch_peak_allocated_mib"] for x in results[c]["memory"]),
            "step_ms": results[c]["step_ms"], "losses": results[c]["losses"],
            "shardflow": results[c]["memory"][-1].get("shardflow"), "shardflow_median": results[c]["memory"][-1].get("shardflow_median")}
        print("%-6s median %.2f ms (%.3fx %s), %.0f tokens/s, device memory %.0f MiB, max |loss diff| %.2e" %
              (c, m, m / median(ref["step_ms"]), configs[0], tokens * 1000.0 / m, summary["configs"][c]["device_in_use_mib"],
               summary["configs"][c]["max_loss_diff_vs_" + configs[0]]), flush=True)
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
