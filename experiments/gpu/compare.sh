#!/usr/bin/env bash
# pipe against PyTorch on one GPU, in one call: `pipe bench mfu` and experiments/gpu/peer.py
# over the same cases, then the table of docs/gpu.md (table.py). Run from the staged folder
# (`bash .gpu/compare.sh`, after experiments/gpu/stage.sh) or the repository root with a `pipe`
# built with --features cuda on PATH. Writes $OUT/compare/ (or ./compare/): pipe-*.json,
# peer.jsonl, device.txt, table.md. Each step has its own time limit.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pipe="${PIPE:-$here/pipe}"
dir="${OUT:-.}/compare"
mkdir -p "$dir"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%Y-%m-%dT%H:%MZ; } \
  > "$dir/device.txt" 2>&1
cases=(
  "mlp-784-1024x16-10:256:f32" "mlp-784-1024x16-10:4096:f32" "mlp-784-1024x16-10:4096:tf32"
  "mlp-784-1024x16-10:4096:bf16" "gpt-mini:8:f32" "gpt-mini:64:f32" "gpt-mini:64:bf16"
)
for c in "${cases[@]}"; do
  IFS=: read -r model batch precision <<< "$c"
  echo "== pipe bench mfu $model batch $batch $precision"
  timeout 120 "$pipe" bench mfu --backend cuda --model "$model" --batch "$batch" \
    --precision "$precision" --steps 50 --json "$dir/pipe-$model-$batch-$precision.json"
  echo "-- exit $?"
done
echo "== experiments/gpu/peer.py"
args=()
for c in "${cases[@]}"; do args+=(--case "$c"); done
timeout 240 python3 "$here/peer.py" --steps 50 --warmup 10 "${args[@]}" | tee "$dir/peer.jsonl"
echo "-- exit ${PIPESTATUS[0]}"
python3 "$here/table.py" "$dir" | tee "$dir/table.md"
