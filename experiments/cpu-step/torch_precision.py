"""What PyTorch's float32_matmul_precision does to an f32 product on this CPU.

For "highest", "high" and "medium", one 2048 x 768 x 3072 product (GPT-2's fc layer at width
768, 16 x 128 tokens) on 2 threads: its largest error against an f64 product, relative to the
largest |element|, and the median time of 15 calls. "high" names the split into two bf16 parts
that pipe's --precision bf16x3 makes; "medium" rounds each operand to one bf16.

    python experiments/cpu-step/torch_precision.py
"""
import time

import torch

torch.set_num_threads(2)
torch.manual_seed(0)
a = torch.randn(2048, 768)
b = torch.randn(768, 3072)
exact = a.double() @ b.double()
print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}")
print("| float32_matmul_precision | largest error / largest value | median ms | GFLOP/s |")
print("|---|---|---|---|")
for precision in ["highest", "high", "medium"]:
    torch.set_float32_matmul_precision(precision)
    c = a @ b
    error = ((c.double() - exact).abs().max() / exact.abs().max()).item()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    median = sorted(times)[len(times) // 2]
    rate = 2 * 2048 * 768 * 3072 / median / 1e9
    print(f"| {precision} | {error:.2e} | {median * 1e3:.1f} | {rate:.0f} |")
