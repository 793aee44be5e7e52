#!/usr/bin/env bash
# The GPU checks of docs/gpu.md, on a machine with an NVIDIA GPU, from the binaries that
# experiments/gpu/stage.sh put in .gpu/ (run from the repository root: `bash .gpu/run.sh`).
# Everything goes to $OUT/gpu-checks.log (or ./gpu-checks.log); PIPE_REQUIRE_GPU=1 makes every
# stamped CUDA test fail rather than skip if the GPU cannot be opened.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
log="${OUT:-.}/gpu-checks.log"
export PIPE_REQUIRE_GPU=1
# CUDA's libraries where a toolkit or the framework wheels keep them.
for d in /usr/local/cuda/lib64 /usr/local/nvidia/lib64; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
step() {
  echo "== $*" | tee -a "$log"
  "$@" 2>&1 | tee -a "$log"
  echo "-- exit ${PIPESTATUS[0]}" | tee -a "$log"
}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } 2>&1 | tee "$log"
step "$here/backend-tests" --test-threads 1
step "$here/layout-tests" --nocapture layouts_on_gpus
step "$here/pipe" bench mfu --backend cuda
step "$here/pipe" bench mfu --backend cuda --model gpt-mini --batch 8
step "$here/pipe" train --backend cuda --stages 2 --epochs 1
step "$here/pipe" train --backend cuda --stages 2 --replicas 2 --epochs 1
