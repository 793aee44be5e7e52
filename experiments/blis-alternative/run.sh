#!/usr/bin/env bash
# BLIS (built from the sources bundled in blis-src, about 3 minutes on 2 cores) against the CPU
# backend and matrixmultiply on the training step's products, at 1 and 2 threads.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/../.."
cargo build --release --manifest-path "$here/Cargo.toml"
cargo build --release -p pipe-kernels --example gemm_alternatives --manifest-path "$root/Cargo.toml"
for t in 1 2; do
  T=$t "$here/target/release/blis-alternative"
  MATMUL_NUM_THREADS=$t "$root/target/release/examples/gemm_alternatives"
done
