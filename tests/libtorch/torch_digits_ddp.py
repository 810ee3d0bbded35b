#!/usr/bin/env python3
"""The libtorch example's checks (ctest runs them; exit 77 = skipped).

  torch_digits_ddp.py worlds TORCH_DIGITS LAUNCHER DATA WORKDIR
      examples/torch_digits under `shardflow run` at world 2 (ZeRO-1, ZeRO-2 with forward prefetch,
      and plain DDP with torch::optim) ends where world 1 ends on the same global batches; so does
      a run checkpointed at world 2 halfway and resumed at world 1, whose trace has its spans.
  torch_digits_ddp.py python-ddp TORCH_DIGITS LAUNCHER DATA WORKDIR
      ... and where Python's DistributedDataParallel (Debian's python3-torch, Gloo, two processes)
      ends from the same initial weights and data, after 20 steps of AdamW.

Both compare every parameter with ||a - b|| / ||b|| <= 1e-5. numpy alone reads the files.
"""
import json
import os
import socket
import struct
import subprocess
import sys

import numpy as np

import param_compare

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python"))
from models import load_weights, make_digits_net as make_net  # noqa: E402

STEPS, BATCH, LR = 20, 64, 1e-3
TOL = 1e-5


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        assert v["dtype"] == "F32", (path, name, v["dtype"])
        b, e = v["data_offsets"]
        out[name] = np.frombuffer(data[b:e], dtype="<f4").reshape(v["shape"])
    return out


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        blob = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def compare(got_path, want_path, what):
    return param_compare.compare(got_path, want_path, what, TOL)


def run_example(exe, launcher, world, data, out, extra, steps=STEPS):
    cmd = [launcher, "run", "--nproc_per_node", str(world), "--", exe, "--data", data, "--steps", str(steps),
           "--global-batch", str(BATCH), "--lr", str(LR), "--save", out, "--log-every", "10"] + extra
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    print(res.stdout[-600:], res.stderr[-600:], sep="")
    if res.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {res.returncode}")


def python_ddp_rank(rank, world, port, init_path, data_path, out_path):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    net = make_net()
    load_weights(net, read_safetensors(init_path))
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    d = read_safetensors(data_path)
    x = torch.from_numpy(d["x"].copy()).view(-1, 1, 8, 8)
    labels = torch.from_numpy(d["y"].copy()).argmax(1)
    local = BATCH // world
    for step in range(STEPS):  # torch_digits' rows: step * B + rank * local + k, modulo the rows
        idx = (torch.arange(local) + step * BATCH + rank * local) % x.shape[0]
        opt.zero_grad()
        F.cross_entropy(ddp(x[idx]), labels[idx]).backward()
        opt.step()
    if rank == 0:
        write_safetensors(out_path, {n: p.detach().numpy() for n, p in net.named_parameters()})
    dist.destroy_process_group()


def main():
    mode, exe, launcher, data, work = sys.argv[1:6]
    if not os.path.exists(data):
        print(f"skipped: no digits file {data} (python3-sklearn missing)")
        sys.exit(77)
    os.makedirs(work, exist_ok=True)
    p = lambda name: os.path.join(work, name)
    ok = True
    if mode == "worlds":
        run_example(exe, launcher, 1, data, p("w1.safetensors"), ["--seed", "3"])
        for tag, extra in [("zero1", ["--zero-stage", "1"]),
                           ("zero2_prefetch", ["--zero-stage", "2", "--forward-prefetch"]),
                           ("ddp_torch_optim", ["--zero-stage", "0", "--own-optimizer"])]:
            out = p(f"w2_{tag}.safetensors")
            run_example(exe, launcher, 2, data, out, ["--seed", "3"] + extra)
            ok &= compare(out, p("w1.safetensors"), f"world 2 {tag} vs world 1")
        # Half the steps at world 2 with a checkpoint, the rest resumed at world 1 (ZeRO-2 there).
        run_example(exe, launcher, 2, data, p("half.safetensors"), ["--seed", "3", "--checkpoint-dir", p("ckpt")], steps=STEPS // 2)
        run_example(exe, launcher, 1, data, p("resumed.safetensors"), ["--resume", p("ckpt"), "--zero-stage", "2", "--trace", p("trace.json")],
                    steps=STEPS - STEPS // 2)
        ok &= compare(p("resumed.safetensors"), p("w1.safetensors"), "world 2 checkpoint resumed at world 1 vs world 1")
        with open(p("trace.json")) as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        for want in ("forward", "backward"):
            if want not in names:
                print(f"FAIL: the trace has no '{want}' span")
                ok = False
    elif mode == "python-ddp":
        try:
            import torch  # noqa: F401
            import torch.multiprocessing as mp
        except ImportError:
            print("skipped: python3-torch is not installed")
            sys.exit(77)
        import torch
        torch.manual_seed(5)
        run_example(exe, launcher, 1, data, p("init_probe.safetensors"), [], steps=0)  # the module's names
        probe = read_safetensors(p("init_probe.safetensors"))
        # Initial weights unlike the example's own seed: both sides load them.
        write_safetensors(p("init.safetensors"), {n: torch.randn(a.shape).numpy() * 0.1 for n, a in probe.items()})
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(python_ddp_rank, args=(2, port, p("init.safetensors"), data, p("python_ddp.safetensors")), nprocs=2, join=True)
        run_example(exe, launcher, 2, data, p("w2.safetensors"), ["--init", p("init.safetensors"), "--zero-stage", "1"])
        ok &= compare(p("w2.safetensors"), p("python_ddp.safetensors"), "world 2 shardflow ZeRO-1 vs Python DDP + AdamW")
        # examples/python/digits.py: the same job through shardflow.torch, where the build has it.
        if subprocess.run(["/usr/bin/python3", "-c", "import shardflow.torch"], capture_output=True).returncode == 0:
            example = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python", "digits.py")
            for tag, extra in [("zero1", []), ("zero2_prefetch", ["--zero-stage", "2", "--forward-prefetch"])]:
                out = p(f"py_{tag}.safetensors")
                cmd = [launcher, "run", "--nproc_per_node", "2", "--", "/usr/bin/python3", example, "--data", data, "--init", p("init.safetensors"),
                       "--steps", str(STEPS), "--global-batch", str(BATCH), "--lr", str(LR), "--save", out] + extra
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
                print(res.stdout[-400:], res.stderr[-1500:], sep="")
                ok &= res.returncode == 0 and compare(out, p("python_ddp.safetensors"), f"examples/python/digits.py ({tag}) vs Python DDP + AdamW")
        else:
            print("skipped: examples/python/digits.py (no shardflow.torch module in this build)")
    else:
        sys.exit(f"unknown mode {mode}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
