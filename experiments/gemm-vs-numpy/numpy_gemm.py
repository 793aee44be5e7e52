"""Times pipe's GEMM (the criterion bench `cargo bench -p pipe-kernels --bench gemm`) and numpy's
matmul shape by shape, alternating, and prints the ratio table pipe/numpy. Alternating keeps both
sides of a row within seconds of each other on a shared machine. Run through run.sh, which builds
the environment."""
import json
import os
import subprocess
import sys
import time

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits


def shapes():
    out = []
    for batch in (64, 256):
        for width in (256, 1024, 4096):
            out.append((f"fwd_b{batch}_w{width}", batch, width, width, False, False))
            out.append((f"dx_b{batch}_w{width}", batch, width, width, False, True))
            out.append((f"dw_b{batch}_w{width}", width, batch, width, True, False))
    for s in (256, 512, 1024, 2048):
        out.append((f"square_{s}", s, s, s, False, False))
    return out


def time_numpy(m, k, n, ta, tb):
    rng = np.random.default_rng(0)
    a = rng.random((k, m) if ta else (m, k), dtype=np.float32) - 0.5
    b = rng.random((n, k) if tb else (k, n), dtype=np.float32) - 0.5
    A = a.T if ta else a
    B = b.T if tb else b
    out = np.empty((m, n), dtype=np.float32)
    flops = 2.0 * m * n * k
    iters = max(1, int(0.05e9 * 4 / flops))
    for _ in range(3):
        np.matmul(A, B, out=out)
    rates = []
    for _ in range(11):
        t = time.perf_counter()
        for _ in range(iters):
            np.matmul(A, B, out=out)
        rates.append(flops * iters / (time.perf_counter() - t) / 1e9)
    rates.sort()
    return rates[len(rates) // 2]


def pipe_rate(criterion_dir, threads, name, m, k, n):
    path = os.path.join(criterion_dir, f"gemm_t{threads}", name, "new", "estimates.json")
    with open(path) as f:
        est = json.load(f)
    return 2.0 * m * n * k / est["median"]["point_estimate"]


def run_pipe(threads, name):
    env = dict(os.environ, PIPE_GEMM_THREADS=str(threads))
    subprocess.run(
        ["cargo", "bench", "--quiet", "-p", "pipe-kernels", "--bench", "gemm", "--",
         "--exact", f"gemm_t{threads}/{name}"],
        env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("criterion_dir")
    ap.add_argument("--json", help="also write the rows as JSON (what `pipe bench --numpy` reads)")
    ap.add_argument("--shapes", help="comma-separated shape names (default: all)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    args = ap.parse_args()
    wanted = set(args.shapes.split(",")) if args.shapes else None
    thread_counts = [int(t) for t in args.threads.split(",")]
    info = [(i["internal_api"], i.get("architecture"), i["version"]) for i in threadpool_info()]
    blas = ", ".join(f"{a} {b or ''} {c}".replace("  ", " ") for a, b, c in info)
    print(f"numpy {np.__version__}, BLAS {info}")
    print()
    print("| shape | m x k x n | op | threads | pipe GFLOP/s | numpy GFLOP/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    worst = None
    rows = []
    for threads in thread_counts:
        with threadpool_limits(threads):
            for name, m, k, n, ta, tb in shapes():
                if wanted is not None and name not in wanted:
                    continue
                op = ("A^T" if ta else "A") + " " + ("B^T" if tb else "B")
                run_pipe(threads, name)
                pr = pipe_rate(args.criterion_dir, threads, name, m, k, n)
                npr = time_numpy(m, k, n, ta, tb)
                ratio = pr / npr
                worst = ratio if worst is None else min(worst, ratio)
                rows.append({"shape": name, "threads": threads, "pipe_gflops": pr,
                             "numpy_gflops": npr, "ratio": ratio})
                mark = "" if ratio >= 0.9 else " (below 0.9)"
                print(f"| {name} | {m}x{k}x{n} | {op} | {threads} | {pr:.1f} | {npr:.1f} | {ratio:.2f}{mark} |")
    print()
    print(f"lowest ratio: {worst:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numpy": f"numpy {np.__version__}, {blas}", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
