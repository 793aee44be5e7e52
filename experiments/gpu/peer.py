#!/usr/bin/env python3
"""The PyTorch peer of `pipe bench mfu`: the same models, batches, loss and optimizer, timed the
same way (warm-up steps, then the median of timed steps, the device synchronised around each).

Models: `mlp-784-1024x16-10` (flatten, 17 linear layers with ReLU between) and `gpt-mini` (token
and learned position embeddings, 8 pre-LayerNorm blocks of causal attention through SDPA and a
tanh-GELU MLP of 4x width, final LayerNorm, a bias-free head over the 65-character vocabulary).
Loss: mean cross-entropy over every target. Optimizer: plain SGD (lr 1e-3), as pipe bench mfu.

Precisions: f32 (TF32 off), tf32 (TF32 matmuls allowed), bf16 (autocast to bfloat16, f32 master
weights). Prints one JSON object per case on stdout. `--dry-run` builds every case on the CPU
with tiny sizes, so the script can be checked on a machine without a GPU.
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp(widths):
    layers = [nn.Flatten()]
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, vocab=65, width=128, heads=4, blocks=8, context=128):
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(blocks)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.token(ids) + self.position(pos)
        return self.head(self.ln(self.blocks(x)))


def case(model_name, batch, precision, steps, warmup, device, dry):
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.manual_seed(0)
    if model_name == "gpt-mini":
        context = 8 if dry else 128
        model = Gpt(context=context).to(device)
        x = torch.randint(0, 65, (batch, context), device=device)
        y = torch.randint(0, 65, (batch * context,), device=device)
        per_sample = context
    else:
        model = mlp([784] + [1024] * 16 + [10]).to(device)
        x = torch.randn(batch, 1, 28, 28, device=device)
        y = torch.randint(0, 10, (batch,), device=device)
        per_sample = 1
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                              enabled=precision == "bf16")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        with autocast:
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step = statistics.median(times)
    final = float(loss.detach())
    return {
        "system": "pytorch",
        "torch": torch.__version__,
        "model": model_name,
        "batch": batch,
        "precision": precision,
        "step_s_median": step,
        "samples_per_s": batch / step,
        "tokens_per_s": batch * per_sample / step,
        "loss": final,
        "finite": math.isfinite(final),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--case", action="append",
                   help="MODEL:BATCH:PRECISION (repeatable); default: the table of docs/gpu.md")
    a = p.parse_args()
    cases = a.case or [
        "mlp-784-1024x16-10:256:f32", "mlp-784-1024x16-10:4096:f32",
        "mlp-784-1024x16-10:4096:tf32", "mlp-784-1024x16-10:4096:bf16",
        "gpt-mini:8:f32", "gpt-mini:64:f32", "gpt-mini:64:bf16",
    ]
    device = torch.device("cpu" if a.dry_run else "cuda")
    steps, warmup = (1, 0) if a.dry_run else (a.steps, a.warmup)
    for c in cases:
        model, batch, precision = c.split(":")
        batch = 2 if a.dry_run else int(batch)
        print(json.dumps(case(model, batch, precision, steps, warmup, device, a.dry_run)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
