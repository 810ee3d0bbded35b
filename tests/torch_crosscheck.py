"""Cross-check against PyTorch: mlp_train at world N (ranks as threads, shardflow's buckets and
all-reduce) must end where plain single-process torch training with the full batch ends.

    torch_crosscheck.py MLP_TRAIN WORKDIR

Exits 77 (ctest: skipped) when torch is not installed: this check is optional by design.
"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
try:
    import numpy as np
    import torch
except ImportError:
    print("SKIP: PyTorch is not installed (apt-get install python3-torch)")
    sys.exit(77)
import safetensors_np as st

SIZES = [20, 32, 24, 5]
ROWS, BATCH, STEPS = 96, 24, 12


def torch_reference(init, data, optimizer, **hp):
    layers = []
    for i in range(len(SIZES) - 1):
        lin = torch.nn.Linear(SIZES[i], SIZES[i + 1])
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(init[f"layers.{i}.weight"]))
            lin.bias.copy_(torch.from_numpy(init[f"layers.{i}.bias"]))
        layers.append(lin)
    mods = []
    for i, lin in enumerate(layers):
        mods.append(lin)
        if i + 1 < len(layers):
            mods.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*mods)
    params = [p for lin in layers for p in (lin.weight, lin.bias)]
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=hp["lr"], momentum=hp["momentum"], nesterov=hp.get("nesterov", False),
                              weight_decay=hp.get("weight_decay", 0.0))
    elif optimizer == "adam":
        opt = torch.optim.Adam(params, lr=hp["lr"], weight_decay=hp.get("weight_decay", 0.0))
    else:
        opt = torch.optim.AdamW(params, lr=hp["lr"], weight_decay=hp.get("weight_decay", 0.01))
    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    for s in range(STEPS):
        idx = [(s * BATCH + k) % ROWS for k in range(BATCH)]
        opt.zero_grad()
        loss = ((model(x[idx]) - y[idx]) ** 2).mean()
        loss.backward()
        opt.step()
    return {f"layers.{i}.{kind}": getattr(lin, kind).detach().numpy() for i, lin in enumerate(layers)
            for kind in ("weight", "bias")}


def main():
    mlp_train, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    torch.manual_seed(0)
    init = {}
    for i in range(len(SIZES) - 1):
        lin = torch.nn.Linear(SIZES[i], SIZES[i + 1])
        init[f"layers.{i}.weight"] = lin.weight.detach().numpy()
        init[f"layers.{i}.bias"] = lin.bias.detach().numpy()
    data = {"x": torch.randn(ROWS, SIZES[0]).numpy(), "y": torch.randn(ROWS, SIZES[-1]).numpy()}
    init_path, data_path = os.path.join(work, "init.safetensors"), os.path.join(work, "data.safetensors")
    st.save(init_path, init)
    st.save(data_path, data)

    cases = [
        ("sgd", ["--lr", "0.05", "--momentum", "0.9"], dict(lr=0.05, momentum=0.9)),
        ("sgd", ["--lr", "0.05", "--momentum", "0.9", "--nesterov", "--weight-decay", "0.01"],
         dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
        ("adam", ["--lr", "0.01"], dict(lr=0.01)),
        ("adamw", ["--lr", "0.01", "--weight-decay", "0.05"], dict(lr=0.01, weight_decay=0.05)),
    ]
    failures = 0
    for optimizer, flags, hp in cases:
        ref = torch_reference(init, data, optimizer, **hp)
        for world in (1, 2, 3):
            out = os.path.join(work, f"out_{optimizer}_{world}.safetensors")
            cmd = [mlp_train, "--sizes", ",".join(map(str, SIZES)), "--steps", str(STEPS), "--global-batch",
                   str(BATCH), "--world-size", str(world), "--optimizer", optimizer, "--init", init_path,
                   "--data", data_path, "--save", out, "--quiet", "--first-bucket-mb", "0.001", "--bucket-mb",
                   "0.002"] + flags
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            got = st.load(out)
            worst = 0.0
            for name, want in ref.items():
                err = float(np.linalg.norm(got[name] - want) / max(np.linalg.norm(want), 1e-30))
                worst = max(worst, err)
            ok = worst <= 1e-5
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {optimizer:5s} {' '.join(flags):50s} world {world}: "
                  f"max relative error vs torch {worst:.2e}")
    print(f"{len(cases) * 3 - failures} passed, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
