#!/usr/bin/env bash
# gpt-mini on Tiny Shakespeare at 4 stages x 2 replicas, with the default settings (nothing but
# the model, dataset and layout given), then 500 sampled characters from its last checkpoint.
# Writes into OUT (default: this folder):
#   train.txt           what `pipe train` printed (header, partition, one line per epoch)
#   train-epochs.jsonl  the epoch records of its --log-jsonl log
#   sample.txt          `pipe sample --prompt "ROMEO:" --seed 0` from the last checkpoint
#   results.md          the curve: validation loss and time per epoch, and the wall time
# The run is deterministic (seed 0) given the kernels; its times depend on the machine.
#
#   experiments/gpt-mini/run.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-experiments/gpt-mini}
mkdir -p "$out"
cargo build --release --quiet
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
# The committed figures decay every parameter, as the default was before language models
# decayed only their matrices: `--weight-decay-groups all` keeps them reproducible.
target/release/pipe train --model gpt-mini --dataset tinyshakespeare --stages 4 --replicas 2 \
  --weight-decay-groups all --log-jsonl "$work/train.jsonl" --checkpoint-dir "$work/ckpt" | tee "$out/train.txt"
end=$(date +%s)
grep '"kind":"epoch"' "$work/train.jsonl" > "$out/train-epochs.jsonl"
target/release/pipe sample --checkpoint "$work/ckpt" --prompt "ROMEO:" --tokens 500 --seed 0 \
  > "$out/sample.txt"
{
  echo "Command: \`pipe train --model gpt-mini --dataset tinyshakespeare --stages 4 --replicas 2 --weight-decay-groups all\`"
  echo "($(date -u +%Y-%m-%d), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'),"
  echo "$(nproc) cores). Wall time of the whole command: $((end - start)) s."
  echo
  echo "| epoch | train loss | val loss (nats/char) | val accuracy | tokens/s | elapsed |"
  echo "|---|---|---|---|---|---|"
  awk '/^epoch/ { printf "| %s | %s | %s | %s | %s | %s s |\n", $2, $5, $8, $12, $13, $15 }' \
    "$out/train.txt"
} > "$out/results.md"
cat "$out/results.md"
