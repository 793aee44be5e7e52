#!/usr/bin/env bash
# GPT-2 124M on one GPU: the checks of docs/gpu.md ("GPT-2 124M") in one prepared call, from the
# binaries and corpus that experiments/gpu/stage.sh put in .gpu/ (nothing is built here). Run
# from the repository root: `bash .gpu/gpt2.sh`. Each step has its own time limit; the log goes
# to $OUT/gpt2.log (or ./gpt2.log), the comparison to $OUT/compare/, the loss check to
# $OUT/loss-check/. CHECKS picks steps by name (default: all, in this order):
#   attention  the bf16 tensor-core attention against the f64 definition
#   bench      pipe bench mfu, gpt2-small, batch 16 x 1,024, bf16, AdamW, with a breakdown;
#              then with the vocabulary padded to 50,304 rows (--padded-vocab-size), and
#              padded with the linear layers' bias outside their products (PIPE_CUBLASLT=0)
#   peer       the same step in PyTorch, eager and under torch.compile, each unpadded and
#              padded (compare.sh, CASES=gpt2)
#   loss       20 updates of pipe and PyTorch from the same weights on the same windows
#   train      200 updates of gpt2-small on the token corpus: the loss falls
#   stages     one worker against --stages 4 on the one GPU (timed by CUDA events, then with
#              a wait after every action: PIPE_CUDA_MARKS=0), and --stages 2 as two worker
#              processes against two stages in one process
#   processes  --stages 2 in one process and as two worker processes lending their device
#              buffers (CUDA IPC): the same weights, and the tokens/s of each
#   memory     PipeDream at four stages on the one GPU with microbatches of 16 x 1,024: the
#              device memory estimate printed at the start beside each stage's pool peak
#   documents  packed documents in training (documents_check.sh): gpt-mini in f32 on the CPU
#              and the GPU, every update's loss within 1e-3; gpt2-small packed in bf16, the
#              loss falls
#   suite      the whole backend suite; oracle  the reference-trainer oracle (f32, tf32, bf16)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-.}"
log="$out/gpt2.log"
pipe="$here/pipe"
corpus="$here/corpus"
export PIPE_REQUIRE_GPU=1
checks="${CHECKS:-attention bench peer loss train stages processes memory documents suite oracle}"
# shellcheck source=step.sh
source "$here/step.sh"
wants() { [[ " $checks " == *" $1 "* ]]; }
log_header
LD_LIBRARY_PATH="$("$pipe" doctor gpu --library-path)" && export LD_LIBRARY_PATH
# Throughput of a training run: the mean tokens/s of its epoch lines.
train_run() {
  local name=$1
  shift
  step "$limit" "$pipe" train --backend cuda --precision bf16 --model gpt2-small \
    --dataset "tokens:$corpus" --seed 0 --optimizer adamw --lr 6e-4 --eval-windows 8 \
    --log-jsonl "$out/$name.jsonl" "$@"
}
if wants attention; then
  step 90 "$here/backend-tests" --test-threads 1 --nocapture cuda_bf16_attention
fi
if wants bench; then
  step 150 "$pipe" bench mfu --backend cuda --model gpt2-small --batch 16 --precision bf16 \
    --optimizer adamw --steps 10 --breakdown 2 --json "$out/bench-gpt2.json"
  step 150 "$pipe" bench mfu --backend cuda --model gpt2-small --batch 16 --precision bf16 \
    --optimizer adamw --steps 10 --breakdown 2 --padded-vocab-size 50304 \
    --json "$out/bench-gpt2-padded.json"
  # The linear layers' bias added by add_bias after the product, as before cuBLASLt's epilogue.
  PIPE_CUBLASLT=0 step 90 "$pipe" bench mfu --backend cuda --model gpt2-small --batch 16 \
    --precision bf16 --optimizer adamw --steps 10 --padded-vocab-size 50304 \
    --json "$out/bench-gpt2-padded-unfused.json"
fi
if wants peer; then
  CASES=gpt2 step 420 bash "$here/compare.sh"
fi
if wants loss; then
  step 200 bash "$here/loss_check.sh" "$pipe" "$corpus" "$out/loss-check"
fi
if wants train; then
  limit=200 train_run train200 --steps 200 --epochs 100 --microbatch-size 4 --microbatches 4
fi
if wants stages; then
  # Partitions given, so no run profiles its layers first: the head (50,257 x 768) weighs
  # about five blocks. On one GPU the stages share it, so the balance matters less than on
  # several.
  limit=90
  run=(--steps 30 --epochs 100 --microbatch-size 4 --microbatches 8)
  train_run one-worker "${run[@]}"
  train_run four-stages "${run[@]}" --stages 4 --partition 0-4,5-8,9-12,13-14
  # The same with a wait for the GPU after every action, as before marks timed the actions.
  PIPE_CUDA_MARKS=0 train_run four-stages-waiting "${run[@]}" --stages 4 \
    --partition 0-4,5-8,9-12,13-14
  train_run two-stages "${run[@]}" --stages 2 --partition 0-8,9-14
  train_run two-processes "${run[@]}" --stages 2 --partition 0-8,9-14 --transport shm
fi
if wants processes; then
  # Activations and gradients between two worker processes on the one GPU are lent device to
  # device (docs/transport.md, "Device buffers lent between processes"): the weights must be
  # those of the same two stages in one process, at 0.9 or more of their tokens/s.
  limit=120
  run=(--steps 24 --epochs 100 --microbatch-size 4 --microbatches 8 --stages 2
    --partition 0-8,9-14)
  train_run lent-one-process "${run[@]}" > "$out/lent-one-process.out"
  train_run lent-processes "${run[@]}" --transport shm > "$out/lent-processes.out"
  digest() { grep -o 'weights [0-9a-f]*' "$1" | tail -1 | cut -d' ' -f2; }
  # The second epoch's figure: the first carries the start.
  speed() { grep -o '[0-9]* tokens/s' "$1" | sed -n 2p | cut -d' ' -f1; }
  one=$(digest "$out/lent-one-process.out") two=$(digest "$out/lent-processes.out")
  a=$(speed "$out/lent-one-process.out") b=$(speed "$out/lent-processes.out")
  verdict=FAIL
  [[ -n "$one" && "$one" == "$two" ]] && verdict=PASS
  ratio=$(awk -v a="${a:-0}" -v b="${b:-0}" 'BEGIN { if (a > 0) printf "%.2f", b / a; else print "none" }')
  lent=$(grep -o 'lent [0-9]*' "$out/lent-processes.out" | tail -2 | tr '\n' ' ')
  echo "processes: weights $one in one process, $two as processes ($verdict); epoch 2 $a against $b tokens/s, processes / one process $ratio (target 0.9); last epoch's stages: ${lent:-nothing lent}" | tee -a "$log"
fi
if wants memory; then
  # pipe's memory model of a device (docs/gpu.md, "Device memory"): the start's `device memory
  # estimate` line against the epoch lines' `device ... GiB` per stage (and the JSON-lines
  # log's peak_device_bytes). The model expects about 43 GiB for the four together.
  limit=150 train_run memory4 --steps 6 --epochs 100 --microbatch-size 16 --microbatches 4 \
    --stages 4 --schedule pipedream --partition 0-4,5-8,9-12,13-14
fi
if wants documents; then
  # Its corpus is made on first use, from the repository's data (a fraction of a second).
  step 240 bash "$here/documents_check.sh" "$pipe" "$here/corpus-documents" "$out/documents-check"
fi
if wants suite; then
  step 150 "$here/backend-tests" --test-threads 1
fi
if wants oracle; then
  # The layout tests travel in a pack of their own (stage.sh): absent, the step says so.
  if [ -x "$here/layout-tests" ]; then
    step 150 "$here/layout-tests" --nocapture layouts_on_gpus
  else
    echo "== oracle: skipped, no layout-tests here (unpack .gpu-oracle/layouts.tar.xz)" | tee -a "$log"
  fi
fi
