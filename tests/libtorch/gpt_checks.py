#!/usr/bin/env python3
"""gpt_train's checks (ctest runs them; exit 77 = skipped).

  gpt_checks.py worlds GPT_TRAIN LAUNCHER DATA WORKDIR
      A small GPT (2 blocks, d_model 64) for 20 steps: world 2 as threads (ZeRO-1 interleaved) and
      world 2 under `shardflow run` (ZeRO-2 with forward prefetch; DDP with overlap none) end where
      world 1 ends on the same global batches; so does a run checkpointed at world 2 halfway and
      resumed at world 1. Every parameter within ||a - b|| / ||b|| <= 1e-5 (the two worlds sum the
      gradient in a different order), the held-out loss within 0.1%.
  gpt_checks.py python-ddp GPT_TRAIN LAUNCHER DATA WORKDIR
      ... and where PyTorch DDP + AdamW (bench/peers/torch_gpt.py: the same module, windows, schedule and
      AdamW groups; Debian's python3-torch, two processes over Gloo) ends from gpt_train's initial
      weights after 20 steps, within 1e-5 (the same libtorch kernels run the model in both; AdamW
      is torch's in one and shardflow's in the other; measured 2e-7); and where examples/python/gpt.py
      (shardflow.torch) ends under `shardflow run` and under torchrun (measured: bit for bit).
"""
import os
import shutil
import re
import subprocess
import sys

import numpy as np

import param_compare

HERE = os.path.dirname(os.path.abspath(__file__))

STEPS = 20
MODEL = ["--layers", "2", "--d-model", "64", "--heads", "4", "--context", "32", "--batch", "8", "--warmup", "5", "--lr", "3e-3"]
COMMON = MODEL + ["--log-every", "10", "--sample-chars", "0", "--eval-windows", "64", "--threads", "1"]


def run(cmd):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    print(res.stdout[-700:], res.stderr[-700:], sep="")
    if res.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {res.returncode}")
    m = re.search(r"held-out loss ([0-9.]+)", res.stdout)
    return float(m.group(1)) if m else None


def gpt(exe, data, out, extra, steps=STEPS):
    return run([exe, "--data", data, "--save", out] + COMMON + ["--steps", str(steps)] + extra)


def launched(exe, launcher, world, data, out, extra, steps=STEPS):
    return run([launcher, "run", "--nproc_per_node", str(world), "--", exe, "--data", data, "--save", out] + COMMON + ["--steps", str(steps)] + extra)


def signal(name, arr):
    """What of a parameter the checks compare. The keys' bias (the middle third of each
    attn.c_attn.bias) has a gradient of exactly zero in exact arithmetic (softmax does not change
    when every score of a row moves by q.b_k), so what reaches it is rounding noise, which AdamW
    normalises into lr-sized steps of either sign: it differs between any two summation orders and
    carries no signal. Compared there: q and v."""
    if not name.endswith("attn.c_attn.bias"):
        return arr
    d = arr.shape[0] // 3
    return np.concatenate([arr[:d], arr[2 * d:]])


def compare(got_path, want_path, what, tol):
    return param_compare.compare(got_path, want_path, what, tol, view=signal)


def close_loss(got, want, what, rel=1e-3):
    ok = got is not None and want is not None and abs(got - want) <= rel * abs(want)
    print(f"{'ok  ' if ok else 'FAIL'} {what}: held-out loss {got} vs {want} (bound {rel:.1%})")
    return ok


def python_example(launcher, data, p, env):
    """examples/python/gpt.py (shardflow.torch) from the same weights: under `shardflow run` with
    ZeRO-2 and forward prefetch, and under torchrun (tools/torchrun_py311.py: Debian 12's own
    torchrun fails on Python 3.11) with ZeRO-1, it ends where gpt_train ends."""
    if subprocess.run(["/usr/bin/python3", "-c", "import shardflow.torch"], env=env, capture_output=True).returncode != 0:
        print("skipped: examples/python/gpt.py (no shardflow.torch module in this build)")
        return True
    example = os.path.join(HERE, "..", "..", "examples", "python", "gpt.py")
    args = ["--data", data, "--init", p("init.safetensors"), "--seed", "7", "--threads", "1"] + MODEL + ["--steps", str(STEPS)]
    ok = True
    for how, cmd in [("shardflow run, ZeRO-2 + prefetch", [launcher, "run", "--nproc_per_node", "2", "--", "/usr/bin/python3", example,
                                                           "--zero-stage", "2", "--forward-prefetch", "--save", p("py_run.safetensors")]),
                     ("torchrun, ZeRO-1", ["/usr/bin/python3", os.path.join(HERE, "..", "..", "tools", "torchrun_py311.py"), "--standalone",
                                          "--nproc_per_node", "2", example, "--zero-stage", "1", "--save", p("py_torchrun.safetensors")])]:
        res = subprocess.run(cmd + args, capture_output=True, text=True, timeout=280, env=env)
        print(res.stdout[-500:], res.stderr[-1500:], sep="")
        if res.returncode != 0:
            print(f"FAIL: {' '.join(cmd + args)} exited {res.returncode}")
            ok = False
            continue
        out = cmd[cmd.index("--save") + 1]
        ok &= compare(out, p("w2.safetensors"), f"examples/python/gpt.py under {how} vs gpt_train at world 2", 1e-5)
    return ok


def main():
    mode, exe, launcher, data, work = sys.argv[1:6]
    if not os.path.exists(data):
        print(f"skipped: no corpus {data} (Debian's fortunes package missing)")
        sys.exit(77)
    os.makedirs(work, exist_ok=True)
    p = lambda name: os.path.join(work, name)
    ok = True
    if mode == "worlds":
        base = gpt(exe, data, p("w1.safetensors"), [])
        loss = gpt(exe, data, p("w2_threads.safetensors"), ["--world-size", "2"])
        ok &= compare(p("w2_threads.safetensors"), p("w1.safetensors"), "world 2 (threads, ZeRO-1 interleaved) vs world 1", 1e-5)
        ok &= close_loss(loss, base, "world 2 (threads)")
        # Mirrored shards (Note [Mirrored shards]) change nothing a step computes: the same bits.
        shutil.rmtree(p("twin_snaps"), ignore_errors=True)  # a snapshot left there would be resumed from
        gpt(exe, data, p("w2_twins.safetensors"), ["--world-size", "2", "--redundancy", "2", "--snapshot-dir", p("twin_snaps"),
                                                   "--snapshot-every", "5"])
        ok &= compare(p("w2_twins.safetensors"), p("w2_threads.safetensors"), "world 2 (threads) with twins (--redundancy 2) vs without", 0.0)
        # The simulated link (--sim-gbytes-per-s) moves the data in memory as the threads do: the same bits.
        gpt(exe, data, p("w2_sim.safetensors"), ["--world-size", "2", "--sim-gbytes-per-s", "0.5", "--sim-latency-us", "20"])
        ok &= compare(p("w2_sim.safetensors"), p("w2_threads.safetensors"), "world 2 (threads) over a simulated link vs without", 0.0)
        # What the simulated link cannot honour is refused, naming the flag, before any training.
        # ... and so is a setting the run would not follow: buckets in flight outside stage 2.
        for extra, named in [(["--world-size", "2", "--sim-latency-us", "5"], "add --sim-gbytes-per-s"),
                             (["--world-size", "2", "--sim-gbytes-per-s", "0"], "bandwidth must be > 0"),
                             (["--world-size", "2", "--zero-stage", "1", "--max-buckets-in-flight", "4"], "--max-buckets-in-flight")]:
            res = subprocess.run([exe, "--data", data] + COMMON + ["--steps", "1"] + extra, capture_output=True, text=True, timeout=60)
            said = res.stdout + res.stderr
            good = res.returncode != 0 and named in said and "held-out loss" not in said
            print(f"{'ok  ' if good else 'FAIL'} gpt_train {' '.join(extra)}: {said.strip().splitlines()[-1] if said.strip() else '(nothing)'}")
            ok &= good
        for tag, extra in [("zero2_prefetch", ["--zero-stage", "2", "--forward-prefetch"]),
                           ("ddp_none", ["--zero-stage", "0", "--overlap", "none"])]:
            out = p(f"w2_{tag}.safetensors")
            loss = launched(exe, launcher, 2, data, out, extra)
            ok &= compare(out, p("w1.safetensors"), f"world 2 under shardflow run ({tag}) vs world 1", 1e-5)
            ok &= close_loss(loss, base, f"world 2 ({tag})")
        # Stopped halfway (the schedule still spans STEPS), then resumed to the end.
        launched(exe, launcher, 2, data, p("half.safetensors"), ["--save-checkpoint", p("ckpt"), "--stop-at", str(STEPS // 2)])
        gpt(exe, data, p("resumed.safetensors"), ["--resume", p("ckpt"), "--zero-stage", "2"])
        ok &= compare(p("resumed.safetensors"), p("w1.safetensors"), "world 2 checkpoint resumed at world 1 vs world 1", 1e-5)
    elif mode == "python-ddp":
        try:
            import torch  # noqa: F401
        except ImportError:
            print("skipped: python3-torch is not installed")
            sys.exit(77)
        gpt(exe, data, p("init_probe.safetensors"), ["--save-init", p("init.safetensors"), "--seed", "7"], steps=0)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = ["/usr/bin/python3", os.path.join(HERE, "..", "..", "bench", "peers", "torch_gpt.py"), "--spawn", "2", "--data", data, "--init",
               p("init.safetensors"), "--save", p("python_ddp.safetensors"), "--seed", "7"] + MODEL + [
               "--steps", str(STEPS), "--threads", "1"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
        print(res.stdout[-700:], res.stderr[-1500:], sep="")
        if res.returncode != 0:
            sys.exit(f"FAIL: {' '.join(cmd)} exited {res.returncode}")
        launched(exe, launcher, 2, data, p("w2.safetensors"), ["--init", p("init.safetensors"), "--seed", "7", "--zero-stage", "1"])
        ok &= compare(p("w2.safetensors"), p("python_ddp.safetensors"), "world 2 shardflow ZeRO-1 vs PyTorch DDP + AdamW", 1e-5)
        ok &= python_example(launcher, data, p, env)
    else:
        sys.exit(f"unknown mode {mode}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
