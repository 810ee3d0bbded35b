"""gpt_train's default GPT at world 1 under each OpenBLAS kernel, side by side (Note [OpenBLAS on
CPUs it does not know]): a bare environment (shardflow picks the kernel), OpenBLAS's own choice
(SHARDFLOW_BLAS_KERNEL=keep) and each kernel forced with OPENBLAS_CORETYPE, taken in turn
round after round (A B C ... A B C ...), each run's median step, then the median over rounds.

usage: python3 bench/blas_kernel.py BUILD [--rounds 3] [--steps 8] [--kernels Cooperlake,SkylakeX,Haswell]
"""
import argparse
import os
import re
import statistics
import subprocess


def main():
    p = argparse.ArgumentParser()
    p.add_argument("build")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kernels", default="Cooperlake,SkylakeX,Haswell")
    a = p.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "SHARDFLOW_BLAS_REPLACED", "SHARDFLOW_BLAS_KERNEL")}
    configs = [("bare environment", {}), ("OpenBLAS's own choice (SHARDFLOW_BLAS_KERNEL=keep)", {"SHARDFLOW_BLAS_KERNEL": "keep"})]
    configs += [("OPENBLAS_CORETYPE=" + k, {"OPENBLAS_CORETYPE": k}) for k in a.kernels.split(",")]
    cmd = [os.path.join(a.build, "examples", "gpt_train"), "--steps", str(a.steps), "--sample-chars", "0", "--eval-windows", "1"]
    times = {name: [] for name, _ in configs}
    for r in range(a.rounds):
        for name, env in configs:
            out = subprocess.run(cmd, env=dict(base, **env), capture_output=True, text=True, check=True).stdout
            times[name].append(float(re.search(r"median step ([0-9.]+) ms", out).group(1)))
            print("round %d  %-52s %8.1f ms" % (r + 1, name, times[name][-1]), flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    best = min(med.values())
    print("\nmedian step over %d rounds (gpt_train --steps %d, world 1):" % (a.rounds, a.steps))
    for name, _ in configs:
        print("  %-52s %8.1f ms  %.2fx the fastest" % (name, med[name], med[name] / best))


if __name__ == "__main__":
    main()
