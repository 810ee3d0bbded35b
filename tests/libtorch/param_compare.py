"""The libtorch examples' checks compare two safetensors files of parameters, tensor by tensor:
||a - b|| / ||b|| within a bound, after an optional per-tensor view (what of a tensor carries a
signal). Shared by torch_digits_ddp.py and gpt_checks.py; numpy and tools/safetensors_np.py only."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from safetensors_np import load as read_safetensors  # noqa: E402


def compare(got_path, want_path, what, tol, view=lambda name, arr: arr):
    got, want = read_safetensors(got_path), read_safetensors(want_path)
    if sorted(got) != sorted(want):
        print(f"FAIL {what}: different parameter names {sorted(set(got) ^ set(want))}")
        return False
    worst = 0.0
    for name in want:
        a, b = view(name, got[name].astype(np.float64)), view(name, want[name].astype(np.float64))
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        worst = max(worst, err)
        if err > tol:
            print(f"FAIL {what}: {name} differs by {err:.3g} (relative, bound {tol})")
            return False
    print(f"ok   {what}: worst relative difference {worst:.3g} over {len(want)} parameters (bound {tol})")
    return True
