#!/usr/bin/env python3
"""The PyTorch peer of `pipe bench mfu`: the same models, batches, loss and optimizer, timed the
same way (warm-up steps, then the median of timed steps, the device synchronised around each).

Models:
- `mlp-784-1024x16-10`: flatten, 17 linear layers with ReLU between;
- `gpt-mini`: token and learned position embeddings, 8 pre-LayerNorm blocks of causal attention
  through SDPA and a tanh-GELU MLP of 4x width, final LayerNorm, a bias-free head over the
  65-character vocabulary;
- `gpt2-small`: GPT-2 124M as pipe's preset builds it: 12 of the same blocks (LayerNorm epsilon
  1e-5, biases on every linear map), width 768, 12 heads, 1,024 learned positions, vocabulary
  50,257 (`--vocab`), final LayerNorm, a bias-free head tied to the token embedding; 124,439,808
  parameters. Initialised as pipe does (`stages/src/model/transformer.rs`, `layers.rs`):
  embeddings, the attention's input projection and the MLP's first matrix from N(0, 0.02),
  biases zero, LayerNorms one and zero, and the last matrix of each residual branch (the
  attention's output projection, the MLP's second matrix) zero.

Loss: mean cross-entropy over every target, on random token ids or inputs. Optimizer: plain SGD
(lr 1e-3) for the MLP and gpt-mini, as `pipe bench mfu`; AdamW for gpt2-small
(`torch.optim.AdamW(fused=True)`, lr 6e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on
every parameter, decoupled), as `pipe bench mfu --optimizer adamw`.

Cases are MODEL:BATCH:PRECISION[:compile]. Precisions: f32 (TF32 off), tf32 (TF32 matmuls
allowed), bf16 (autocast to bfloat16, f32 master weights). `:compile` runs the model and its
loss through `torch.compile`; compilation happens in the warm-up steps (at least 3), never in
the timed ones.
Prints one JSON object per case on stdout: step_s_median, samples_per_s, tokens_per_s,
peak_memory_bytes (torch.cuda.max_memory_allocated over the case), parameters. `--dry-run`
builds every case on the CPU with tiny sizes (gpt2-small: 2 blocks of width 64, 16 positions),
so the script can be checked on a machine without a GPU. `--device cpu --threads N` runs the
full sizes on the CPU (experiments/cpu-step/mlp.sh).
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
    def __init__(self, vocab=65, width=128, heads=4, blocks=8, context=128, tied=False):
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(blocks)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.token.weight

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.token(ids) + self.position(pos)
        return self.head(self.ln(self.blocks(x)))

    @torch.no_grad()
    def init_as_pipe(self):
        """pipe's GPT initialisation: N(0, 0.02) for the embeddings, the head and the first
        matrix of each residual branch; zeros for the branches' last matrices and every bias;
        LayerNorms at one and zero."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for b in self.blocks:
            nn.init.zeros_(b.proj.weight)
            nn.init.zeros_(b.out.weight)
        return self


GPT2_SMALL = dict(blocks=12, width=768, heads=12, context=1024)
GPT2_DRY = dict(blocks=2, width=64, heads=2, context=16)
GPT2_VOCAB = 50257


def gpt2(vocab=GPT2_VOCAB, dry=False, rows=None):
    """GPT-2 124M (or its dry-run miniature), tied and initialised as pipe's gpt2-small; with
    `rows`, its token table and head padded to that many rows, the extra ones zero (pipe's
    --padded-vocab-size)."""
    shape = GPT2_DRY if dry else GPT2_SMALL
    model = Gpt(vocab=rows or vocab, tied=True, **shape).init_as_pipe()
    with torch.no_grad():
        model.token.weight[vocab:].zero_()
    return model


ADAMW = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def case(model_name, batch, precision, steps, warmup, device, dry, compile_=False,
         vocab=GPT2_VOCAB, rows=None):
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    classes = None  # every output column is a class
    if model_name == "gpt2-small":
        model = gpt2(vocab, dry, rows).to(device)
        classes = vocab
        context = model.position.num_embeddings
        x = torch.randint(0, vocab, (batch, context), device=device)
        y = torch.randint(0, vocab, (batch * context,), device=device)
        per_sample = context
    elif model_name == "gpt-mini":
        context = 8 if dry else 128
        model = Gpt(context=context).to(device)
        x = torch.randint(0, 65, (batch, context), device=device)
        y = torch.randint(0, 65, (batch * context,), device=device)
        per_sample = context
    elif model_name == "mlp-784-1024x16-10":
        model = mlp([784] + [1024] * 16 + [10]).to(device)
        x = torch.randn(batch, 1, 28, 28, device=device)
        y = torch.randint(0, 10, (batch,), device=device)
        per_sample = 1
    else:
        raise SystemExit(f"unknown model {model_name!r}")
    parameters = sum(p.numel() for p in model.parameters())  # a tied tensor counts once
    padding = (rows - vocab) if model_name == "gpt2-small" and rows else 0
    parameters -= padding * model.token.weight.shape[1] if padding else 0
    if model_name == "gpt2-small":
        optimizer = "adamw"
        opt = torch.optim.AdamW(model.parameters(), fused=cuda or None, **ADAMW)
    else:
        optimizer = "sgd"
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def loss_of(x, y):
        logits = model(x)
        # A padded vocabulary's extra columns are not classes, as in pipe's loss.
        logits = logits[..., :classes] if padding else logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y)

    # Compiled, the loss is part of the graph, as in nanoGPT (whose model returns it).
    step_loss = torch.compile(loss_of) if compile_ else loss_of
    if compile_:
        warmup = max(warmup, 3)
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                              enabled=precision == "bf16")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        with autocast:
            loss = step_loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step = statistics.median(times)
    final = float(loss.detach())
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    del step_loss, model, opt, loss
    if compile_:
        torch._dynamo.reset()
    return {
        "system": "pytorch",
        "torch": torch.__version__,
        "model": model_name,
        "batch": batch,
        "precision": precision,
        "compile": compile_,
        "optimizer": optimizer,
        "parameters": parameters,
        "vocab_padding": padding,
        "steps": steps,
        "warmup": warmup,
        "step_s_median": step,
        "samples_per_s": batch / step,
        "tokens_per_s": batch * per_sample / step,
        "peak_memory_bytes": peak,
        "loss": final,
        "finite": math.isfinite(final),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--case", action="append",
                   help="MODEL:BATCH:PRECISION[:compile] (repeatable); default: the table of "
                        "docs/gpu.md")
    p.add_argument("--device", choices=["cuda", "cpu"],
                   help="where to run (default cuda; cpu with --dry-run)")
    p.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--vocab", type=int, default=GPT2_VOCAB,
                   help="gpt2-small's vocabulary (default GPT-2's 50,257)")
    p.add_argument("--padded-vocab-size", type=int, metavar="N",
                   help="gpt2-small's token table and head padded to N rows, the loss over "
                        "the vocabulary's columns (pipe's --padded-vocab-size)")
    a = p.parse_args()
    cases = a.case or [
        "mlp-784-1024x16-10:256:f32", "mlp-784-1024x16-10:4096:f32",
        "mlp-784-1024x16-10:4096:tf32", "mlp-784-1024x16-10:4096:bf16",
        "gpt-mini:8:f32", "gpt-mini:64:f32", "gpt-mini:64:bf16",
    ]
    device = torch.device(a.device or ("cpu" if a.dry_run else "cuda"))
    if a.threads:
        torch.set_num_threads(a.threads)
    steps, warmup = (1, 0) if a.dry_run else (a.steps, a.warmup)
    for c in cases:
        fields = c.split(":")
        if len(fields) not in (3, 4) or (len(fields) == 4 and fields[3] != "compile"):
            p.error(f"case {c!r} is not MODEL:BATCH:PRECISION[:compile]")
        model, batch, precision = fields[:3]
        batch = 2 if a.dry_run else int(batch)
        r = case(model, batch, precision, steps, warmup, device, a.dry_run,
                 compile_=len(fields) == 4, vocab=a.vocab, rows=a.padded_vocab_size)
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
