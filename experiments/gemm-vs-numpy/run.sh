#!/usr/bin/env bash
# GEMM throughput of pipe's CPU backend beside numpy's matmul: same shapes, same machine, one run,
# the two measured back to back for each shape.
#
#   experiments/gemm-vs-numpy/run.sh     # per shape: criterion bench, then numpy; then the table
#
# numpy comes from pip into a private virtual environment under target/ (used for nothing else).
# The machine may set OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE to work around old OpenBLAS builds;
# they make a current numpy pick slower kernels, so they are unset for the numpy run only, and the
# table header prints which kernel OpenBLAS then chose.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=target/numpy-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet numpy threadpoolctl
fi
cargo bench -p pipe-kernels --bench gemm --no-run
env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$venv/bin/python" experiments/gemm-vs-numpy/numpy_gemm.py target/criterion "$@"
