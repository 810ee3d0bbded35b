#!/usr/bin/env python3
"""What the Python front end costs: examples/python/gpt.py (shardflow.torch) against
examples/gpt_train (C++, the same libtorch adapter underneath) on the same GPT, weights, batches and
settings, both under `shardflow run` on this host, alternated A B A B; each run's median step
(both print it over every step), then the median over the rounds and the ratio Python / C++.

  /usr/bin/python3 bench/python_overhead.py --build build [--rounds 4] [--steps 30] [--world 2]
      [--flags "--zero-stage 2 --forward-prefetch"] [--json bench/python_overhead.json]

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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--flags", default="--zero-stage 1 --overlap interleaved", help="settings both programs take")
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
        runs = {"gpt_train (C++)": [], "examples/python/gpt.py": []}
        for r in range(a.rounds):  # A B A B
            runs["gpt_train (C++)"].append(median_step(cpp, env))
            runs["examples/python/gpt.py"].append(median_step(py, env))
            print("round %d: C++ %.1f ms, Python %.1f ms" % (r + 1, runs["gpt_train (C++)"][-1], runs["examples/python/gpt.py"][-1]), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratio = med["examples/python/gpt.py"] / med["gpt_train (C++)"]
    # Each round's pair ran back to back: their ratio's median is the steadier figure on a noisy host.
    paired = statistics.median(p / c for p, c in zip(runs["examples/python/gpt.py"], runs["gpt_train (C++)"]))
    print("world %d, %s: median step C++ %.1f ms, Python %.1f ms: Python / C++ = %.3f (median of the rounds' ratios %.3f)" %
          (a.world, a.flags, med["gpt_train (C++)"], med["examples/python/gpt.py"], ratio, paired))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"world": a.world, "flags": a.flags, "steps": a.steps, "runs_ms": runs, "median_ms": med, "python_over_cpp": ratio,
                       "median_of_round_ratios": paired}, f, indent=1)


if __name__ == "__main__":
    main()
