"""The shardflow side of the one-host MLP tables: mlp_train at world 1, and at world 2 as two
processes over shm under `shardflow run`, with the model, batch and optimizer that
torch_ddp_reference.py gives PyTorch. Needs no torch: bench/builds_one_host.py runs the same rows
for two builds."""
import json
import os
import statistics
import subprocess
import sys
import tempfile

MODELS = {"4 x Linear(256,256)": [256] * 5, "8 x Linear(1024,1024)": [1024] * 9}
BATCH = 32  # rows per rank


def steps_for(sizes):
    return 200 if sizes[0] < 1024 else 40


def mlp_args(build, sizes, steps, world, stage, stats):
    return [os.path.join(build, "examples/mlp_train"), "--sizes", ",".join(map(str, sizes)), "--steps", str(steps),
            "--global-batch", str(BATCH * world), "--optimizer", "adam", "--lr", "1e-3", "--quiet", "--stats-json", stats,
            "--zero-stage", str(stage), "--overlap", "interleaved" if stage else "none"]


def iteration_ms(stats):
    with open(stats) as f:
        return json.load(f)["median"]["iteration_ms"]


def shardflow_world1(build, sizes, steps, copies=1):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as d:
        procs = []
        for c in range(copies):  # copies > 1: independent processes at once (the floor)
            stats = os.path.join(d, f"s{c}.json")
            procs.append((subprocess.Popen(mlp_args(build, sizes, steps, 1, 0, stats), env=env, stdout=subprocess.DEVNULL), stats))
        for p, _ in procs:
            if p.wait() != 0:
                sys.exit(f"{build}/examples/mlp_train failed")
        return statistics.mean(iteration_ms(s) for _, s in procs)


def shardflow_world2(build, sizes, steps, stage):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as d:
        stats = os.path.join(d, "s.json")
        cmd = [os.path.join(build, "bin/shardflow"), "run", "--nproc-per-node", "2", "--no-prefix", "--"] + \
            mlp_args(build, sizes, steps, 2, stage, stats) + ["--backend", "shm"]
        if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:
            sys.exit(f"{build}/bin/shardflow run failed: {' '.join(cmd)}")
        return iteration_ms(stats)
