#!/usr/bin/env bash
# The GPU checks of docs/gpu.md, on a machine with an NVIDIA GPU, from the binaries that
# experiments/gpu/stage.sh put in .gpu/ (run from the repository root: `bash .gpu/run.sh`).
# Everything goes to $OUT/gpu-checks.log (or ./gpu-checks.log), the comparison with PyTorch to
# $OUT/compare/; PIPE_REQUIRE_GPU=1 makes every stamped CUDA test fail rather than skip if the
# GPU cannot be opened. Every step has its own time limit.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
log="${OUT:-.}/gpu-checks.log"
export PIPE_REQUIRE_GPU=1
# shellcheck source=step.sh
source "$here/step.sh"
log_header
# pipe finds CUDA's libraries itself (docs/gpu.md, "Finding the libraries"): in the plain
# environment, and with a toolkit's stubs first on the loader's path, it must name the real
# driver and open the GPU.
step 60 "$here/pipe" doctor gpu
if [ -d /usr/local/cuda/lib64/stubs ]; then
  step 60 env LD_LIBRARY_PATH=/usr/local/cuda/lib64/stubs "$here/pipe" doctor gpu
fi
# The test binaries open the libraries pipe chose, through the same links.
LD_LIBRARY_PATH="$("$here/pipe" doctor gpu --library-path)" && export LD_LIBRARY_PATH
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" | tee -a "$log"
step 120 "$here/backend-tests" --test-threads 1
step 150 "$here/layout-tests" --nocapture layouts_on_gpus
step 420 bash "$here/compare.sh"
# Precision against f32 on whole runs: MNIST (default MLP, 6 epochs) and gpt-mini (4 epochs,
# past 1.7 nats/char).
for p in f32 bf16; do
  step 60 "$here/pipe" train --backend cuda --precision "$p"
done
for p in f32 bf16; do
  step 100 "$here/pipe" train --backend cuda --precision "$p" --model gpt-mini --epochs 4 \
    --weight-decay-groups all
done
# One GPU shared by the workers of a pipeline, against one worker on the same model.
m=mlp-784-1024x4-10
step 60 "$here/pipe" train --backend cuda --model "$m" --epochs 1
step 60 "$here/pipe" train --backend cuda --model "$m" --stages 2 --epochs 1
step 60 "$here/pipe" train --backend cuda --model "$m" --stages 2 --replicas 2 --epochs 1
step 90 "$here/pipe" train --backend cuda --model "$m" --stages 4 --replicas 2 --epochs 1
