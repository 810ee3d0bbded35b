"""The examples' models and data in Python, one definition for the Python examples, the PyTorch
references the tests and benches check shardflow against (bench/peers/torch_gpt.py,
tests/libtorch/torch_digits_ddp.py) and nothing else:

- the GPT of examples/gpt_train (examples/gpt/model.hpp): gpt_train's parameter names (wte, wpe,
  h.N.attn.c_attn, ..., ln_f; the head is wte's weight), its batches (Note [GPT batches] in
  examples/gpt/text.hpp: splitmix64 of the seed, step and global row) and its warm-up + cosine
  schedule, so a run from the same initial weights ends where gpt_train ends;
- the CNN of examples/torch_digits.cpp;
- load_weights: initial weights from a safetensors file's arrays, so both sides of a comparison
  start alike.

torch and numpy only.
"""
import math

import numpy as np

MASK = (1 << 64) - 1


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def window_start(seed, step, row, tokens, context):
    """gpt::window_start, bit for bit."""
    return splitmix64(splitmix64(seed) ^ ((step << 20 | row) & MASK)) % (tokens - context)


def batch(train, seed, step, first_row, rows, context):
    starts = [window_start(seed, step, first_row + r, len(train), context) for r in range(rows)]
    x = np.stack([train[s:s + context] for s in starts]).astype(np.int64)
    y = np.stack([train[s + 1:s + context + 1] for s in starts]).astype(np.int64)
    return x, y


def lr_at(peak, step, warmup, steps):
    """gpt::lr_at (examples/gpt/schedule.hpp), in its float32 and double steps."""
    peak = np.float32(peak)
    if step < warmup:
        return float(peak * np.float32(step + 1) / np.float32(warmup))
    span = max(1, steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    top = float(peak)
    floor = 0.1 * top
    return float(np.float32(floor + (top - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))))


def make_gpt(vocab, context, layers, d_model, heads):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(d_model, 3 * d_model)
            self.c_proj = nn.Linear(d_model, d_model)

        def forward(self, x):
            B, T, C = x.shape
            hd = C // heads
            q, k, v = (t.view(B, T, heads, hd).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
            att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            att = torch.softmax(att.masked_fill(future, float("-inf")), -1)
            return self.c_proj(torch.matmul(att, v).transpose(1, 2).contiguous().view(B, T, C))

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(d_model, 4 * d_model)
            self.c_proj = nn.Linear(4 * d_model, d_model)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(d_model)
            self.attn = Attention()
            self.ln_2 = nn.LayerNorm(d_model)
            self.mlp = Mlp()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, d_model)
            self.wpe = nn.Embedding(context, d_model)
            self.h = nn.ModuleList([Block() for _ in range(layers)])
            self.ln_f = nn.LayerNorm(d_model)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.h:
                x = block(x)
            return F.linear(self.ln_f(x), self.wte.weight)  # tied head

    model = Gpt()
    # GPT-2's initialisation, as examples/gpt/model.hpp's init_weights: N(0, 0.02) weights, zero
    # biases, unit LayerNorm gains, the projections into the residual stream scaled by
    # 1/sqrt(2 * layers). torch.manual_seed beforehand makes it reproducible.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name:
                p.fill_(1.0 if name.endswith(".weight") else 0.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02 / math.sqrt(2.0 * layers) if name.endswith("c_proj.weight") else 0.02)
    return model


def make_digits_net():
    """examples/torch_digits.cpp's NetImpl in Python, attribute for attribute."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
            self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
            self.fc1 = nn.Linear(32 * 4 * 4, 64)
            self.fc2 = nn.Linear(64, 10)

        def forward(self, x):
            x = F.relu(self.conv1(x))
            x = F.max_pool2d(F.relu(self.conv2(x)), 2).flatten(1)
            return self.fc2(F.relu(self.fc1(x)))

    return Net()


def load_weights(model, arrays):
    """Copies each parameter's array (a safetensors file as read by tools/safetensors_np.py, the
    module's names) into `model`."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(arrays[name].copy()))
