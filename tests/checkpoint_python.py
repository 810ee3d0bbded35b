#!/usr/bin/env python3
"""A shardflow checkpoint read with the safetensors layout and numpy alone, as a Python user would:
trains with mlp_train at world 2, ZeRO-2, AdamW, saves a checkpoint and the final parameters, then
checks that every parameter in the checkpoint equals the saved parameters bit for bit, that each
has its optim.<name>.exp_avg / exp_avg_sq of the same shape (exp_avg_sq >= 0, not all zero), and
that the metadata gives the step count and each tensor's zlib CRC-32; then that a parameters-only
state dict in the layout torch's safetensors writes loads bit for bit. Exit 77 (skipped) without
numpy.

    checkpoint_python.py MLP_TRAIN WORKDIR"""
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib

try:
    import numpy as np
except ImportError:
    print("SKIP: no numpy (apt-get install python3-numpy); the Python read-back is optional")
    sys.exit(77)

DTYPES = {"F32": np.float32, "F16": np.float16}


def read(path):
    """{name: array}, metadata: the safetensors layout, nothing else."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    out = {}
    for name, t in header.items():
        lo, hi = t["data_offsets"]
        out[name] = np.frombuffer(data[lo:hi], dtype=DTYPES[t["dtype"]]).reshape(t["shape"])
    return out, meta


def main():
    mlp_train, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    final = os.path.join(work, "final.safetensors")
    subprocess.run([mlp_train, "--sizes", "24,40,40,6", "--optimizer", "adamw", "--world-size", "2", "--zero-stage", "2",
                    "--steps", "7", "--global-batch", "48", "--quiet", "--save-checkpoint", os.path.join(work, "c"),
                    "--save", final], check=True, stdout=subprocess.DEVNULL)
    ckpt, meta = read(os.path.join(work, "c", "checkpoint.safetensors"))
    params, _ = read(final)
    assert meta.get("shardflow.steps") == "7", meta
    assert json.loads(meta["shardflow.param_groups"])[0]["kind"] == "adamw", meta
    for name, p in params.items():
        assert np.array_equal(ckpt[name], p), name
        m, v = ckpt["optim." + name + ".exp_avg"], ckpt["optim." + name + ".exp_avg_sq"]
        assert m.shape == p.shape and v.shape == p.shape, name
        assert (v >= 0).all() and v.any(), name
    extra = set(ckpt) - set(params) - {"optim." + n + "." + s for n in params for s in ("exp_avg", "exp_avg_sq")}
    assert not extra, extra
    # The checksums are zlib's CRC-32 of each tensor's bytes, as any Python user can check them.
    crcs = json.loads(meta["shardflow.crc32"])
    for name, t in ckpt.items():
        assert int(crcs[name], 16) == zlib.crc32(t.tobytes()), name
    print(f"checkpoint read with numpy: {len(params)} parameters, {len(ckpt) - len(params)} state tensors, step {meta['shardflow.steps']}")

    # A state dict as torch's safetensors writes one (format "pt", tensors by name, the header
    # padded to 8 bytes, no shardflow metadata, no checksums) loads as a parameters-only
    # checkpoint: with lr 0 one step leaves the parameters exactly as written.
    written = {name: (p * np.float32(0.5)).astype(np.float32) for name, p in params.items()}
    torch_dir = os.path.join(work, "torch")
    os.makedirs(torch_dir)
    write_like_torch(os.path.join(torch_dir, "checkpoint.safetensors"), written)
    after = os.path.join(work, "after.safetensors")
    subprocess.run([mlp_train, "--sizes", "24,40,40,6", "--optimizer", "adamw", "--lr", "0", "--world-size", "3", "--zero-stage", "1",
                    "--steps", "1", "--global-batch", "48", "--quiet", "--resume", torch_dir, "--save", after], check=True,
                   stdout=subprocess.DEVNULL)
    loaded, _ = read(after)
    for name, p in written.items():
        assert np.array_equal(loaded[name], p), name
    print(f"a torch-layout state dict of {len(written)} parameters loads bit for bit")


def write_like_torch(path, tensors):
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name in sorted(tensors):
        b = np.ascontiguousarray(tensors[name]).tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


if __name__ == "__main__":
    main()
