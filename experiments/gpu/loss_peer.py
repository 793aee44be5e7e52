#!/usr/bin/env python3
"""Loss agreement with PyTorch: trains pipe's GPT-2 from pipe's own update-0 weights on the
windows a `pipe train --dataset tokens:DIR --data-order sequential` run read, in the same
order, with the same update, and compares the training loss of every update with the one pipe
logged (`--log-jsonl`). Needs torch only (no transformers, no safetensors package).

What it follows, read from pipe (`docs/training.md`, `docs/data.md`, `stages/src/model/shards.rs`,
`stages/src/model/optim.rs`):
- weights: the directory `pipe export --format hf` writes from a `--seed-checkpoint`:
  `config.json` and `model.safetensors` (or its shards and index) with transformers' GPT-2
  names; matrices stored `[in, out]` as GPT-2's Conv1D, transposed here for nn.Linear; the head
  tied to `transformer.wte.weight`;
- windows: window `w` of a shard reads ids `wT .. wT+T` and predicts `wT+1 .. wT+T+1`; a shard
  of `n` ids has `(n - 1) // T` windows; windows are numbered across shards in corpus order; the
  last `ceil(total * F)` are held out (`--holdout tail:F`, default 0.1). `--data-order
  sequential` visits training windows 0, 1, 2, ... every epoch; an update takes the next
  `microbatch * microbatches` of them, microbatch `j` the `j`-th run of `microbatch`; an
  epoch's last partial update is dropped;
- the update: each microbatch's loss is the mean cross-entropy over its tokens, the update's
  gradient the mean over its microbatches (the loss logged is that mean); the global gradient
  norm is clipped as clip_grad_norm_ does; AdamW with decoupled weight decay, on the matrices
  only (`--weight-decay-groups matrices`: the attention and MLP matrices and the token table,
  which is the tied head; not positions, biases or LayerNorms) or on everything (`all`);
  the learning rate of each update is the one pipe logged (its schedule, warm-up included).

Precision: f32 (TF32 off), or bf16 (autocast to bfloat16, f32 master weights and optimizer
state; pipe rounds the operands of its products to bf16 and keeps the rest in f32, so bf16 is
compared more loosely). Prints a per-update table and PASS or FAIL; exits 1 on FAIL.
"""
import argparse
import json
import math
import os
import struct
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer import Gpt  # noqa: E402  (the peer's GPT-2 block is pipe's)

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def read_safetensors(path):
    """Every tensor of a safetensors file, as f32: an 8-byte little-endian header length, the
    JSON header, then the raw little-endian data."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = bytearray(data[8 + n:])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t["dtype"] not in DTYPES:
            raise SystemExit(f"{path}: tensor {name} has dtype {t['dtype']}, not F32/BF16/F16")
        dtype = DTYPES[t["dtype"]]
        start, end = t["data_offsets"]
        count = (end - start) // torch.empty((), dtype=dtype).element_size()
        flat = torch.frombuffer(body, dtype=dtype, count=count, offset=start) if count else \
            torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(t["shape"]).to(torch.float32).clone()
    return out


def read_hf(directory):
    """config.json and the weights of a `pipe export --format hf` directory."""
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for name in files:
        weights.update(read_safetensors(os.path.join(directory, name)))
    return config, weights


def build(config, weights):
    """The peer's GPT-2 with the exported weights in it."""
    if config.get("tie_word_embeddings", True) is False:
        raise SystemExit("an untied head: pipe's GPT-2 presets tie it")
    model = Gpt(vocab=config["vocab_size"], width=config["n_embd"], heads=config["n_head"],
                blocks=config["n_layer"], context=config["n_positions"], tied=True)
    own = {"token.weight": "transformer.wte.weight", "position.weight": "transformer.wpe.weight",
           "ln.weight": "transformer.ln_f.weight", "ln.bias": "transformer.ln_f.bias"}
    parts = {"ln1": "ln_1", "ln2": "ln_2", "qkv": "attn.c_attn", "proj": "attn.c_proj",
             "fc": "mlp.c_fc", "out": "mlp.c_proj"}
    used = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in own:
                hf = own[name]
            else:
                _, i, layer, kind = name.split(".")
                hf = f"transformer.h.{i}.{parts[layer]}.{kind}"
            w = weights[hf]
            if kind_is_matrix(name):
                w = w.t()  # Conv1D's [in, out] to nn.Linear's [out, in]
            if tuple(w.shape) != tuple(p.shape):
                raise SystemExit(f"{hf}: shape {tuple(w.shape)}, the model wants {tuple(p.shape)}")
            p.copy_(w)
            used.add(hf)
    extra = [n for n in weights if n not in used and not n.endswith((".attn.bias", ".attn.masked_bias"))]
    if extra:
        raise SystemExit(f"weights the model does not take: {extra[:5]}")
    return model


def kind_is_matrix(name):
    return name.startswith("blocks.") and name.endswith(
        ("qkv.weight", "proj.weight", "fc.weight", "out.weight"))


def decays(name, groups):
    """pipe's weight-decay groups: `all`, or `matrices` (the linear maps' matrices and the
    token table, which is the tied head)."""
    return groups == "all" or name == "token.weight" or kind_is_matrix(name)


class Windows:
    """The training windows of a `pipe tokenize` corpus, as `--dataset tokens:DIR` cuts them."""

    def __init__(self, directory, context, holdout):
        with open(os.path.join(directory, "tokens.json")) as f:
            manifest = json.load(f)
        self.context = context
        self.shards, self.starts = [], [0]
        for entry in manifest["shards"]:
            ids = read_shard(os.path.join(directory, entry["file"]))
            if len(ids) != entry["tokens"]:
                raise SystemExit(f"{entry['file']}: {len(ids)} ids, the manifest says {entry['tokens']}")
            self.shards.append(ids)
            self.starts.append(self.starts[-1] + max(len(ids) - 1, 0) // context)
        total = self.starts[-1]
        self.train = total - min(math.ceil(total * holdout), total)

    def window(self, g):
        shard = max(i for i in range(len(self.shards)) if self.starts[i] <= g)
        w = g - self.starts[shard]
        ids = self.shards[shard][w * self.context: w * self.context + self.context + 1]
        return ids[:-1], ids[1:]


def read_shard(path):
    """A shard's ids: `PIPETOK1`, a little-endian u32 header length, the JSON header (its
    `dtype`, u16 or u32), then the ids, little-endian."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"PIPETOK1":
        raise SystemExit(f"{path}: not a pipe token shard")
    (n,) = struct.unpack("<I", data[8:12])
    header = json.loads(data[12:12 + n])
    body = bytearray(data[12 + n:])
    # Read as signed integers of the same width and masked: torch's unsigned types convert
    # only in recent versions.
    signed, mask = {"u16": (torch.int16, 0xFFFF), "u32": (torch.int32, 0xFFFFFFFF)}[header["dtype"]]
    if not body:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(body, dtype=signed).to(torch.int64) & mask


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", required=True, help="pipe export --format hf of the update-0 weights")
    p.add_argument("--corpus", required=True, help="the token corpus directory pipe trained on")
    p.add_argument("--log", required=True, help="pipe's --log-jsonl")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatch", type=int, required=True, help="pipe's --microbatch-size")
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--holdout", type=float, default=0.1, help="pipe's --holdout tail:F")
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--weight-decay-groups", choices=["matrices", "all"], default="matrices")
    p.add_argument("--clip", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's choice)")
    p.add_argument("--tolerance", type=float,
                   help="largest relative loss difference (default 1e-3 f32, 2e-2 bf16)")
    a = p.parse_args()
    tolerance = a.tolerance or (1e-3 if a.precision == "f32" else 2e-2)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(a.device)

    config, weights = read_hf(a.hf)
    model = build(config, weights).to(device).train()
    named = list(model.named_parameters())  # the tied head is token.weight, once
    groups = [
        {"params": [q for n, q in named if decays(n, a.weight_decay_groups)],
         "weight_decay": a.weight_decay},
        {"params": [q for n, q in named if not decays(n, a.weight_decay_groups)],
         "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=0.0, betas=(a.beta1, a.beta2), eps=a.eps, foreach=False)
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                              enabled=a.precision == "bf16")

    records = []
    with open(a.log) as f:
        for line in f:
            r = json.loads(line) if line.strip() else {}
            if r.get("kind") == "step":
                records.append(r)
    if len(records) < a.steps:
        raise SystemExit(f"{a.log} has {len(records)} step records, fewer than --steps {a.steps}")

    data = Windows(a.corpus, config["n_positions"], a.holdout)
    per_update = a.microbatch * a.microbatches
    per_epoch = data.train // per_update
    if per_epoch == 0:
        raise SystemExit(f"{data.train} training windows, fewer than one update of {per_update}")

    print(f"model: GPT-2 of {config['n_layer']} blocks, width {config['n_embd']}, "
          f"{config['n_head']} heads, {config['n_positions']} positions, vocabulary "
          f"{config['vocab_size']}; {sum(q.numel() for q in model.parameters()):,} parameters")
    print(f"data: {data.train} training windows, {per_update} per update "
          f"({a.microbatches} x {a.microbatch}), sequential; {a.precision} on {device}")
    print()
    print("| update | lr | pipe loss | PyTorch loss | relative difference | pipe grad norm | PyTorch grad norm |")
    print("|---|---|---|---|---|---|---|")
    worst, worst_at = 0.0, 0
    for step in range(a.steps):
        rec = records[step]
        first = (step % per_epoch) * per_update
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(a.microbatches):
            rows = [data.window(first + j * a.microbatch + r) for r in range(a.microbatch)]
            x = torch.stack([r[0] for r in rows]).to(device)
            y = torch.stack([r[1] for r in rows]).to(device)
            with autocast:
                logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            (loss / a.microbatches).backward()
            total += loss.item() / a.microbatches
        if a.clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip).item()
        else:
            norm = torch.linalg.vector_norm(
                torch.stack([q.grad.norm() for q in model.parameters()])).item()
        for g in opt.param_groups:
            g["lr"] = rec["lr"]
        opt.step()
        theirs = rec["loss"]
        rel = abs(total - theirs) / abs(theirs)
        if rel > worst:
            worst, worst_at = rel, step + 1
        their_norm = rec.get("grad_norm")
        print(f"| {step + 1} | {rec['lr']:.3e} | {theirs:.6f} | {total:.6f} | {rel:.2e} | "
              + (f"{their_norm:.5f}" if their_norm is not None else "-") + f" | {norm:.5f} |")
    print()
    verdict = "PASS" if worst <= tolerance else "FAIL"
    print(f"{verdict}: largest relative loss difference over {a.steps} updates {worst:.2e} "
          f"(update {worst_at}), tolerance {tolerance:.0e}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
