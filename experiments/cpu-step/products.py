"""The matrix products of one GPT-2 training step through PyTorch (MKL on Intel), beside
`cargo run --release -p pipe-kernels --example step_products`: 2,048 rows (16 windows of 128
tokens), widths 128, 512 and 768, the layouts nn.Linear uses (Y = X W^T, dX = dY W,
dW = dY^T X), median of 31 calls after 5 untimed ones, GFLOP/s.

    python experiments/cpu-step/products.py [THREADS]     # WIDTHS="128 512 768"
"""
import os
import statistics
import sys
import time

import torch

TOKENS, VOCAB = 2048, 1024


def median_seconds(f):
    for _ in range(5):
        f()
    times = []
    for _ in range(31):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    torch.set_num_threads(threads)
    widths = [int(w) for w in os.environ.get("WIDTHS", "128 512 768").split()]
    print(f"{threads} thread(s); GFLOP/s, median of 31 calls")
    print("| width | product | m x k x n | GFLOP/s |")
    print("|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for width in widths:
        layers = [("qkv", width, 3 * width), ("attn proj", width, width),
                  ("fc", width, 4 * width), ("fc proj", 4 * width, width), ("head", width, VOCAB)]
        for layer, fan_in, fan_out in layers:
            x = torch.rand(TOKENS, fan_in, generator=g)
            w = torch.rand(fan_out, fan_in, generator=g)
            dy = torch.rand(TOKENS, fan_out, generator=g)
            cases = [("Y = X W", lambda: x @ w.t(), (TOKENS, fan_in, fan_out)),
                     ("dX = dY W^T", lambda: dy @ w, (TOKENS, fan_out, fan_in)),
                     ("dW = X^T dY", lambda: dy.t() @ x, (fan_in, TOKENS, fan_out))]
            for name, f, (m, k, n) in cases:
                s = median_seconds(f)
                print(f"| {width} | {layer}: {name} | {m}x{k}x{n} | {2 * m * k * n / s / 1e9:.1f} |")


if __name__ == "__main__":
    main()
