"""The PyTorch side of the training-step parity check (experiments/parity/run.sh).

Trains the GPT-2 that `pipe export --format hf` wrote at update 0 with transformers'
GPT2LMHeadModel, on the same Tiny Shakespeare windows in the same (sequential) order, with the
same update (microbatches averaged), the same AdamW and weight-decay groups, the same global-norm
clipping and the same learning-rate schedule as pipe, in f32, and compares the loss of every
update with the one pipe logged (`--log-jsonl`). Exits 1 when any update differs by more than
the tolerance (relative).
"""

import argparse
import json
import math
import sys

import torch
from transformers import GPT2LMHeadModel


def lr_at(step, base, warmup, total):
    """pipe's cosine schedule with linear warm-up (LrSchedule::at), in f64 then f32."""
    if warmup > 0 and step < warmup:
        return float(torch.tensor(base * (step + 1) / warmup, dtype=torch.float32))
    span = max(total - warmup, 1)
    done = min(max(step - warmup, 0) / span, 1.0)
    cos = 0.5 * (1.0 + math.cos(math.pi * done))
    return float(torch.tensor(base * cos, dtype=torch.float32))


def decays(name):
    """pipe's `--weight-decay-groups matrices`: the linear maps' matrices (attention and MLP
    projections, and the head, tied to the token table); not biases, norms or positions."""
    if name.endswith(".bias") or ".ln_" in name or name.startswith("transformer.ln_f"):
        return False
    if name == "transformer.wpe.weight":
        return False
    return True


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--log", required=True, help="pipe's --log-jsonl")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--microbatch", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--weight-decay", type=float, required=True)
    p.add_argument("--clip", type=float, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=1e-3)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    text = open(a.text, encoding="utf-8").read()
    cut = len(text) * 9 // 10
    train = text[:cut]
    vocab = sorted(set(train))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in train], dtype=torch.long)
    windows = (len(ids) - 1) // a.context

    model = GPT2LMHeadModel.from_pretrained(a.hf, torch_dtype=torch.float32,
                                            attn_implementation="eager")
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    named = list(model.named_parameters())  # the tied head shares the token table
    groups = [
        {"params": [q for n, q in named if decays(n)], "weight_decay": a.weight_decay},
        {"params": [q for n, q in named if not decays(n)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, foreach=False)

    records = [json.loads(line) for line in open(a.log) if '"kind":"step"' in line]
    pipe_losses = [r["loss"] for r in records]
    pipe_norms = [r.get("grad_norm") for r in records]
    per_update = a.microbatch * a.microbatches
    worst, worst_norm = 0.0, 0.0
    print("| update | pipe loss | PyTorch loss | relative difference | pipe grad norm | PyTorch grad norm |")
    print("|---|---|---|---|---|---|")
    for step in range(a.steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(a.microbatches):
            first = (step * per_update + j * a.microbatch) % windows
            rows = [(first + r) % windows for r in range(a.microbatch)]
            x = torch.stack([ids[w * a.context: w * a.context + a.context] for w in rows])
            y = torch.stack([ids[w * a.context + 1: w * a.context + a.context + 1] for w in rows])
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     y.reshape(-1))
            (loss / a.microbatches).backward()
            total += loss.item() / a.microbatches
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip).item()
        lr = lr_at(step, a.lr, a.warmup, a.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        theirs, their_norm = pipe_losses[step], pipe_norms[step]
        rel = abs(total - theirs) / abs(theirs)
        worst = max(worst, rel)
        worst_norm = max(worst_norm, abs(norm - their_norm) / their_norm)
        if step < 5 or step % 20 == 19 or step == a.steps - 1:
            print(f"| {step + 1} | {theirs:.6f} | {total:.6f} | {rel:.2e} | {their_norm:.5f} "
                  f"| {norm:.5f} |")
    print()
    print(f"largest relative difference over {a.steps} updates: loss {worst:.2e} "
          f"(tolerance {a.tolerance:.0e}), gradient norm before clipping {worst_norm:.2e}")
    sys.exit(0 if worst <= a.tolerance else 1)


if __name__ == "__main__":
    main()
