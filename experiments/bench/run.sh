#!/usr/bin/env bash
# The benchmark report, end to end (docs/bench.md): every crate's criterion benches, pipe's GEMM
# beside numpy on the 2-thread training shapes, then the sweep, whose report summarises both.
#
#   experiments/bench/run.sh        # writes experiments/bench/{REPORT.md,results.json,plots/,traces/}
#
# Run it on an otherwise idle machine: every figure is a rate.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TERM_COLOR=never
cargo build --release --locked
# 1. Criterion benches, one crate at a time, with short measurement times (the 2-thread GEMM
#    shapes only: step 2 times them again beside numpy).
short=(--warm-up-time 1 --measurement-time 3)
cargo bench --locked -p pipe-kernels --bench gemm -- "${short[@]}" gemm_t2/
cargo bench --locked -p pipe-transport --bench transport -- "${short[@]}"
cargo bench --locked -p pipe-scheduler --bench simulate -- "${short[@]}"
cargo bench --locked -p pipe-scheduler --bench partition -- "${short[@]}"
cargo bench --locked -p pipe-scheduler --bench schedule -- "${short[@]}"
cargo bench --locked -p pipe-experiments --bench executor -- "${short[@]}"
# 2. pipe's GEMM against numpy's matmul, shape by shape, alternating.
experiments/gemm-vs-numpy/run.sh --threads 2 \
  --shapes fwd_b64_w1024,dx_b64_w1024,dw_b64_w1024,fwd_b256_w1024,dx_b256_w1024,dw_b256_w1024,fwd_b256_w4096,square_1024 \
  --json target/bench-numpy.json
# 3. The sweep and its report.
./target/release/pipe bench --config experiments/bench/default.toml --out experiments/bench \
  --criterion target/criterion --numpy target/bench-numpy.json
