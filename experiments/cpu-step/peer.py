"""PyTorch's side of the CPU training-step comparison (experiments/cpu-step/run.sh).

Trains transformers' GPT2LMHeadModel at pipe's GPT-2 shape with the step pipe takes: batch of
`--batch` windows, mean cross-entropy, global-norm clipping at 1.0 (the gpt2 models' default in
pipe), AdamW (lr 2e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.1 on every parameter, as pipe's
side is told with `--weight-decay-groups all`), f32, dropout off. `--compile` runs the model under torch.compile.
Windows are read in order from a token file written by run.sh (uint16 ids). Prints one line:
tokens/s over the timed steps. With `--profile`, the timed steps run under torch.profiler and a
table follows: self CPU time per step by kernel class, the classes `pipe bench mfu
--breakdown` uses (experiments/cpu-step/profile.sh puts the two side by side).
"""

import argparse
import time

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", required=True, help="uint16 token ids")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--positions", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--profile", action="store_true", help="print the kernel-class split")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    ids = torch.from_numpy(np.fromfile(a.tokens, dtype=np.uint16).astype(np.int64))
    t = a.positions
    windows = (len(ids) - 1) // t
    config = GPT2Config(vocab_size=a.vocab, n_positions=t, n_embd=a.width, n_layer=a.layers,
                        n_head=a.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config).float().train()
    step_model = torch.compile(model) if a.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.1)

    def step(k):
        rows = [(k * a.batch + r) % windows for r in range(a.batch)]
        x = torch.stack([ids[w * t: w * t + t] for w in rows])
        y = torch.stack([ids[w * t + 1: w * t + t + 1] for w in rows])
        logits = step_model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, a.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for k in range(a.warmup):
        step(k)
    prof = None
    if a.profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    start = time.perf_counter()
    for k in range(a.warmup, a.warmup + a.steps):
        step(k)
    took = time.perf_counter() - start
    if prof is not None:
        prof.__exit__(None, None, None)
    params = sum(q.numel() for q in model.parameters())
    print(f"{a.steps * a.batch * t / took:.0f} tokens/s ({params} parameters)")
    if prof is not None:
        print_split(prof, a.steps, took)


# Kernel classes by ATen operator name, first match wins (self time, so a composite operator
# counts only what it does itself).
CLASSES = [
    ("attention", ("attention", "sdpa", "bmm", "baddbmm", "masked_fill", "where")),
    ("matrix products", ("mm", "addmm", "matmul", "linear")),
    ("LayerNorm", ("layer_norm",)),
    ("GELU", ("gelu", "tanh", "pow")),
    ("softmax and cross-entropy", ("softmax", "nll_loss", "cross_entropy")),
    ("optimizer and clipping", ("adam", "_foreach", "norm", "clip", "lerp", "addcdiv", "sqrt")),
    ("copies and allocation", ("copy_", "clone", "contiguous", "empty", "zero", "fill_", "cat",
                               "stack", "to", "view", "reshape", "transpose", "permute",
                               "expand", "slice", "select", "index", "embedding", "_to_copy")),
]


def kernel_class(name):
    op = name.split("::")[-1].lower()
    for cls, keys in CLASSES:
        if any(op == k or op.startswith(k + "_") or op.startswith("_" + k) or k in op
               for k in keys):
            return cls
    return "other (elementwise, autograd, compiled kernels)"


def print_split(prof, steps, took):
    by_class, others = {}, []
    for e in prof.key_averages():
        if e.self_cpu_time_total <= 0:
            continue
        cls = kernel_class(e.key)
        ms = e.self_cpu_time_total / 1e3 / steps
        by_class[cls] = by_class.get(cls, 0.0) + ms
        if cls.startswith("other"):
            others.append((ms, e.key))
    total = sum(by_class.values())
    print(f"by kernel class (self CPU time, ms per step; wall {took / steps * 1e3:.0f} ms):")
    for cls, ms in sorted(by_class.items(), key=lambda kv: -kv[1]):
        print(f"  {cls:<48} {ms:9.1f} ms {100 * ms / total:5.1f}%")
    print("largest operators in other:")
    for ms, key in sorted(others, reverse=True)[:8]:
        print(f"  {key:<48} {ms:9.1f} ms")


if __name__ == "__main__":
    main()
