#!/usr/bin/env bash
# pipe against PyTorch on one GPU, in one call: `pipe bench mfu` and experiments/gpu/peer.py
# over the same cases, then the table of docs/gpu.md (table.py). Run from the staged folder
# (`bash .gpu/compare.sh`, after experiments/gpu/stage.sh) or the repository root with a `pipe`
# built with --features cuda on PATH. Writes $OUT/compare/ (or ./compare/): pipe-*.json,
# peer*.jsonl, device.txt, table.md. Each step has its own time limit.
#
# CASES picks the sections: `plain` (the default: the MLP and gpt-mini with plain SGD), `gpt2`
# (GPT-2 124M with AdamW at batch 16 in bf16: pipe, PyTorch eager and PyTorch under
# torch.compile; about 150 s on an H200, most of it compiling), or `all`.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pipe="${PIPE:-$here/pipe}"
dir="${OUT:-.}/compare"
sections="${CASES:-plain}"
case "$sections" in
  plain|gpt2|all) ;;
  *) echo "CASES must be plain, gpt2 or all, not '$sections'" >&2; exit 2 ;;
esac
mkdir -p "$dir"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%Y-%m-%dT%H:%MZ; } \
  > "$dir/device.txt" 2>&1

plain() {
  local cases=(
    "mlp-784-1024x16-10:256:f32" "mlp-784-1024x16-10:4096:f32" "mlp-784-1024x16-10:4096:tf32"
    "mlp-784-1024x16-10:4096:bf16" "gpt-mini:8:f32" "gpt-mini:64:f32" "gpt-mini:64:bf16"
  )
  local c model batch precision
  for c in "${cases[@]}"; do
    IFS=: read -r model batch precision <<< "$c"
    echo "== pipe bench mfu $model batch $batch $precision"
    timeout 120 "$pipe" bench mfu --backend cuda --model "$model" --batch "$batch" \
      --precision "$precision" --steps 50 --json "$dir/pipe-$model-$batch-$precision.json"
    echo "-- exit $?"
  done
  echo "== experiments/gpu/peer.py"
  local args=()
  for c in "${cases[@]}"; do args+=(--case "$c"); done
  timeout 240 python3 "$here/peer.py" --steps 50 --warmup 10 "${args[@]}" | tee "$dir/peer.jsonl"
  echo "-- exit ${PIPESTATUS[0]}"
}

# GPT-2 124M: 20 timed steps after 5 of warm-up (pipe bench mfu warms up 3), AdamW on both
# sides. Eager and compiled PyTorch run as separate processes, each under its own limit.
gpt2() {
  echo "== pipe bench mfu gpt2-small batch 16 bf16 adamw"
  timeout 60 "$pipe" bench mfu --backend cuda --model gpt2-small --batch 16 --precision bf16 \
    --optimizer adamw --steps 20 --json "$dir/pipe-gpt2-small-16-bf16.json"
  echo "-- exit $?"
  # The same model with its vocabulary padded to 50,304 rows (aligned head products).
  echo "== pipe bench mfu gpt2-small batch 16 bf16 adamw, vocabulary padded to 50304"
  timeout 60 "$pipe" bench mfu --backend cuda --model gpt2-small --batch 16 --precision bf16 \
    --optimizer adamw --steps 20 --padded-vocab-size 50304 \
    --json "$dir/pipe-gpt2-small-16-bf16-padded.json"
  echo "-- exit $?"
  : > "$dir/peer-gpt2.jsonl"
  local c limit
  # Each case unpadded and padded to 50,304 rows, as pipe runs it.
  local padded
  for padded in "" 50304; do
    for c in gpt2-small:16:bf16 gpt2-small:16:bf16:compile; do
      limit=40
      [[ $c == *:compile ]] && limit=110
      echo "== experiments/gpu/peer.py $c${padded:+ --padded-vocab-size $padded}"
      timeout "$limit" python3 "$here/peer.py" --steps 20 --warmup 5 --case "$c" \
        ${padded:+--padded-vocab-size "$padded"} | tee -a "$dir/peer-gpt2.jsonl"
      echo "-- exit ${PIPESTATUS[0]}"
    done
  done
}

[[ $sections == plain || $sections == all ]] && plain
[[ $sections == gpt2 || $sections == all ]] && gpt2
python3 "$here/table.py" "$dir" | tee "$dir/table.md"
