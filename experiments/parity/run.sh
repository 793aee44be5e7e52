#!/usr/bin/env bash
# Parity of the whole training step with PyTorch: pipe's GPT-2 and transformers' GPT2LMHeadModel
# trained side by side from the same weights, on the same windows in the same order, with the
# same AdamW, weight-decay groups, clipping and schedule, sequential and in f32; the loss of
# every one of the first 200 updates compared (within 1e-3 relative).
#
#   1. pipe train --seed-checkpoint: pipe's weights at update 0, exported with
#      `pipe export --format hf`;
#   2. pipe train --init-from those weights, --data-order sequential, --log-jsonl;
#   3. parity.py trains the same in PyTorch and compares update by update.
#
# Needs python with torch and transformers (PYTHON, default python3); not part of CI.
# PIPELINE adds layout flags to pipe's run (a flush schedule computes the same update as one
# worker: PIPELINE="--stages 4 --schedule 1f1b-flush --partition flops" clips by the global norm
# its stages exchange; PIPELINE="--precision bf16x6" computes the products on AMX tiles), EMBD
# and HEADS set the width and heads (default 128 and 4; bf16x6 takes the tiles only for
# products whose sides are all 256 or more, so EMBD=256 HEADS=8 puts every block's products
# there), and NAME names the results file (default results.md).
#
#   experiments/parity/run.sh [OUT]        # writes OUT/results.md (default experiments/parity)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-experiments/parity}
python=${PYTHON:-python3}
steps=${STEPS:-200}
mkdir -p "$out"
cargo build --release --locked --quiet --bin pipe
pipe=$PWD/target/release/pipe
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
model=(--model gpt2 --n-layer 4 --n-embd "${EMBD:-128}" --n-head "${HEADS:-4}" --n-positions 128
       --dataset tinyshakespeare --seed 3)
train=(--steps "$steps" --microbatch-size 4 --microbatches 3 --optimizer adamw --lr 2e-3
       --lr-schedule cosine --warmup-steps 10 --weight-decay 0.1 --weight-decay-groups matrices
       --grad-clip 1.0 --data-order sequential --threads 2)
# shellcheck disable=SC2206 # the layout flags split on spaces
layout=(${PIPELINE:-})
name=${NAME:-results.md}
"$pipe" train "${model[@]}" "${train[@]}" --checkpoint-dir "$work/seed" --seed-checkpoint \
  > "$work/seed.txt"
"$pipe" export --checkpoint "$work/seed" --format hf --out "$work/hf0" > "$work/export.txt"
"$pipe" train "${model[@]}" "${train[@]}" ${layout[@]+"${layout[@]}"} --init-from "$work/hf0" \
  --log-jsonl "$work/pipe.jsonl" > "$work/train.txt"
{
  echo "# Training-step parity with PyTorch"
  echo
  echo "Run $(date -u +%Y-%m-%d) on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
  echo "with torch $("$python" -c 'import torch; print(torch.__version__)') and transformers"
  echo "$("$python" -c 'import transformers; print(transformers.__version__)'), by"
  echo "\`experiments/parity/run.sh\`:"
  echo
  echo "- \`pipe train ${model[*]} ${train[*]}${layout[*]:+ ${layout[*]}}\`"
  echo "  from \`--init-from\` the update-0 weights of \`--seed-checkpoint\`, exported by \`pipe export --format hf\`"
  echo "  ($(sed 's|'"$work"'/||g' "$work/export.txt"));"
  echo "- \`experiments/parity/parity.py\`: GPT2LMHeadModel from the same directory, the same windows,"
  echo "  torch.optim.AdamW with the same two groups, clip_grad_norm_(1.0), the same schedule."
  echo
  echo "pipe's header: \`$(head -1 "$work/train.txt" | sed 's|'"$work"'/||g')\`"
  if grep -q '^pipeline:' "$work/train.txt"; then
    echo
    echo "pipe's layout: \`$(grep -m1 '^pipeline:' "$work/train.txt")\`"
  fi
  echo
  "$python" experiments/parity/parity.py --hf "$work/hf0" --text data/tinyshakespeare.txt \
    --log "$work/pipe.jsonl" --steps "$steps" --context 128 --microbatch 4 --microbatches 3 \
    --lr 2e-3 --warmup 10 --weight-decay 0.1 --clip 1.0 --threads 2
} | tee "$work/results.md"
cp "$work/results.md" "$out/$name"
