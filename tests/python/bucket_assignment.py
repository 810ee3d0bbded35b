"""`shardflow plan --bucket-cap-mb C --first-bucket-cap-mb F --last-bucket-cap-mb 0` makes the buckets PyTorch's DDP makes.

(PyTorch has no small last bucket: Note [A small last bucket]; --last-bucket-cap-mb 0 turns it off.)

PyTorch's DDP assigns buckets with torch.distributed._compute_bucket_assignment_by_size, walking
the parameters in the order their gradients are expected (reverse registration before the first
rebuild) with the limits [first, cap]. This runs `shardflow plan --json` and that function on the
same parameter lists (the MLP of the issue, GPT-2 small's shapes, and random models of mixed
dtypes under random caps) and compares the buckets parameter by parameter. Without a cap the
small-model default must stay (more buckets than PyTorch's on a model under 4 x 25 MiB).

usage: bucket_assignment.py SHARDFLOW_CLI WORKDIR   (exit 77 without python3-torch)
"""
import json
import os
import random
import subprocess
import sys

try:
    import torch
    import torch.distributed as dist
except ImportError:
    sys.exit(77)

MIB = 1 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mlp(width, layers):
    ps = []
    for i in range(layers):
        ps += [("%d.weight" % i, [width, width], "float32"), ("%d.bias" % i, [width], "float32")]
    return ps


def gpt2_small(vocab=50257, context=1024, d=768, layers=12):
    ps = [("wte", [vocab, d], "float32"), ("wpe", [context, d], "float32")]
    for l in range(layers):
        b = "h.%d." % l
        ps += [(b + "ln_1.weight", [d], "float32"), (b + "ln_1.bias", [d], "float32"),
               (b + "attn.c_attn.weight", [3 * d, d], "float32"), (b + "attn.c_attn.bias", [3 * d], "float32"),
               (b + "attn.c_proj.weight", [d, d], "float32"), (b + "attn.c_proj.bias", [d], "float32"),
               (b + "ln_2.weight", [d], "float32"), (b + "ln_2.bias", [d], "float32"),
               (b + "mlp.c_fc.weight", [4 * d, d], "float32"), (b + "mlp.c_fc.bias", [4 * d], "float32"),
               (b + "mlp.c_proj.weight", [d, 4 * d], "float32"), (b + "mlp.c_proj.bias", [d], "float32")]
    return ps + [("ln_f.weight", [d], "float32"), ("ln_f.bias", [d], "float32")]


def random_model(rng):
    ps = []
    for i in range(rng.randint(1, 40)):
        shape = [rng.choice([1, 3, 64, 100, 257, 1024]) for _ in range(rng.randint(1, 2))]
        ps.append(("p%d" % i, shape, rng.choice(list(DTYPES))))
    return ps


def shardflow_buckets(cli, workdir, params, first_mb, cap_mb):
    path = os.path.join(workdir, "model.json")
    with open(path, "w") as f:
        json.dump([{"name": n, "shape": s, "dtype": d} for n, s, d in params], f)
    cmd = [cli, "plan", "--params", path, "--world-size", "1", "--json", "--last-bucket-cap-mb", "0"]
    if first_mb is not None:
        cmd += ["--first-bucket-cap-mb", repr(first_mb)]
    if cap_mb is not None:
        cmd += ["--bucket-cap-mb", repr(cap_mb)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    index = {n: i for i, (n, _, _) in enumerate(params)}
    return [[index[n] for n in b["params"]] for b in json.loads(out)["buckets"]]


def torch_buckets(params, first_bytes, cap_bytes):
    # Meta tensors: shapes and dtypes without the memory.
    tensors = [torch.empty(s, dtype=DTYPES[d], device="meta") for _, s, d in params]
    order = list(reversed(range(len(params))))
    buckets, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], [first_bytes, cap_bytes], [False] * len(order), order)
    return [list(b) for b in buckets]


def main():
    cli, workdir = sys.argv[1], sys.argv[2]
    os.makedirs(workdir, exist_ok=True)
    rng = random.Random(43)
    cases = [("8 x Linear(1024, 1024)", mlp(1024, 8), 1.0, 25.0), ("GPT-2 small", gpt2_small(), 1.0, 25.0),
             ("8 x Linear(512, 512), small caps", mlp(512, 8), 0.25, 2.0)]
    for k in range(60):
        cases.append(("random model %d" % k, random_model(rng), rng.choice([0.001, 0.01, 0.1, 1.0]), rng.choice([0.004, 0.05, 0.5, 25.0])))
    failures = 0
    for name, params, first_mb, cap_mb in cases:
        ours = shardflow_buckets(cli, workdir, params, first_mb, cap_mb)
        theirs = torch_buckets(params, int(round(first_mb * MIB)), int(round(cap_mb * MIB)))
        # PyTorch appends the buckets still open at the end per dtype in its own key order;
        # shardflow numbers every bucket by its first gradient. The same buckets either way; with
        # one dtype, in the same order too.
        one_dtype = len({d for _, _, d in params}) == 1
        same = ours == theirs if one_dtype else sorted(ours) == sorted(theirs)
        if not same:
            failures += 1
            print("DIFFERENT: %s (first %s MiB, cap %s MiB)\n  shardflow: %s\n  PyTorch:   %s" % (name, first_mb, cap_mb, ours, theirs))
    # No cap given: the small-model default stays (8 x Linear(1024, 1024): 5 buckets, not DDP's 2).
    default = shardflow_buckets(cli, workdir, mlp(1024, 8), None, None)
    given = shardflow_buckets(cli, workdir, mlp(1024, 8), 1.0, 25.0)
    print("8 x Linear(1024, 1024): %d buckets with the caps given (PyTorch %d), %d with the default" %
          (len(given), len(torch_buckets(mlp(1024, 8), MIB, 25 * MIB)), len(default)))
    if not (len(given) == 2 and len(default) == 5):
        failures += 1
        print("expected 2 buckets with --bucket-cap-mb 25 and 5 without a cap")
    print("%d of %d models assigned as PyTorch assigns them" % (len(cases) - failures, len(cases)))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
