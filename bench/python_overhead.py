#!/usr/bin/env python3
"""What the Python front end costs: examples/python/gpt.py (shardflow.torch) against
examples/gpt_train (C++, the same libtorch adapter underneath) on the same GPT, weights, batches and
settings, both under `shardflow run` on this host, alternated A B A B; each run's median step
(both print it over every step), then the median over the rounds and the ratio Python / C++.

  /usr/bin/python3 bench/python_overhead.py --build build [--rounds 4] [--steps 30] [--world 2]
      [--flags "--zero-stage 2 --forward-prefetch"] [--json bench/python_overhead.json]
  # the drop-in's goal: gpt.py against PyTorch's own DDP + AdamW (bench/peers/torch_gpt.py, the same
  # model, weights, batches and schedule), one host; medians of each run's steps after the first two
  /usr/bin/python3 bench/python_overhead.py --build build --against torch [--flags ...]

Defaults: gpt_train's model (6 layers, d_model 384, 10.7 M parameters), 8 sequences of 64
characters per rank, ZeRO-1 interleaved.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def median_step(cmd, env):
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    m = re.search(r"median step ([0-9.]+) ms", res.stdout + res.stderr)
    if res.returncode != 0 or not m:
        sys.exit("python_overhead: %s failed (%d):\n%s" % (" ".join(cmd), res.returncode, (res.stdout + res.stderr)[-2000:]))
    return float(m.group(1))


def median_after_warmup(cmd, env, timing):
    """A run's median step over its steps after the first two, from its --timing JSON."""
    res = subprocess.run(cmd + ["--timing", timing], capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode != 0:
        sys.exit("python_overhead: %s failed (%d):\n%s" % (" ".join(cmd), res.returncode, (res.stdout + res.stderr)[-2000:]))
    with open(timing) as f:
        steps = json.load(f)["steps_ms"]
    return statistics.median(steps[2:] if len(steps) > 4 else steps)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--flags", default="--zero-stage 1 --overlap interleaved", help="gpt.py's settings, and gpt_train's with --against cpp (PyTorch's DDP reference takes none: it is DDP + AdamW)")
    ap.add_argument("--against", choices=("cpp", "torch"), default="cpp",
                    help="cpp: gpt_train under shardflow run; torch: PyTorch DDP + AdamW (bench/peers/torch_gpt.py --spawn)")
    ap.add_argument("--json")
    a = ap.parse_args()
    build = os.path.abspath(a.build)
    launcher = [os.path.join(build, "bin", "shardflow"), "run", "--nproc-per-node", str(a.world), "--"]
    data = os.path.join(build, "data", "fortunes.safetensors")
    env = dict(os.environ, PYTHONPATH=os.path.join(build, "python"))
    flags = a.flags.split()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init.safetensors")
        subprocess.run([os.path.join(build, "examples", "gpt_train"), "--data", data, "--steps", "0", "--save-init", init, "--sample-chars", "0",
                        "--quiet"], check=True, capture_output=True)
        common = ["--data", data, "--init", init, "--batch", str(8 * a.world), "--steps", str(a.steps)] + flags
        cpp = launcher + [os.path.join(build, "examples", "gpt_train"), "--sample-chars", "0", "--eval-windows", "16", "--quiet"] + common
        py = launcher + ["/usr/bin/python3", os.path.join(HERE, "..", "examples", "python", "gpt.py"), "--log-every", str(a.steps)] + common
        if a.against == "torch":
            ref_name = "PyTorch DDP + AdamW"
            ref = lambda: median_after_warmup(["/usr/bin/python3", os.path.join(HERE, "peers", "torch_gpt.py"), "--spawn", str(a.world), "--data", data,
                                               "--init", init, "--batch", str(8 * a.world), "--steps", str(a.steps)], env,
                                              os.path.join(tmp, "torch.json"))
            mine = lambda: median_after_warmup(py, env, os.path.join(tmp, "py.json"))
        else:
            ref_name = "gpt_train (C++)"
            ref = lambda: median_step(cpp, env)
            mine = lambda: median_step(py, env)
        runs = {ref_name: [], "examples/python/gpt.py": []}
        for r in range(a.rounds):  # A B A B
            runs[ref_name].append(ref())
            runs["examples/python/gpt.py"].append(mine())
            print("round %d: %s %.1f ms, Python %.1f ms" % (r + 1, ref_name, runs[ref_name][-1], runs["examples/python/gpt.py"][-1]), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratio = med["examples/python/gpt.py"] / med[ref_name]
    # Each round's pair ran back to back: their ratio's median is the steadier figure on a noisy host.
    paired = statistics.median(p / c for p, c in zip(runs["examples/python/gpt.py"], runs[ref_name]))
    print("world %d, %s: median step %s %.1f ms, gpt.py %.1f ms: gpt.py / reference = %.3f (median of the rounds' ratios %.3f)" %
          (a.world, a.flags, ref_name, med[ref_name], med["examples/python/gpt.py"], ratio, paired))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"world": a.world, "flags": a.flags, "steps": a.steps, "against": ref_name, "runs_ms": runs, "median_ms": med, "python_over_reference": ratio,
                       "median_of_round_ratios": paired}, f, indent=1)


if __name__ == "__main__":
    main()
