#!/usr/bin/env bash
# Whether `pipe train` costs more per update than the bare step: the GPT-2 of run.sh at width W
# through `pipe train` (run.sh's flags; the median interval between its step records after the
# first 5) and through `pipe bench mfu` (profile.sh's flags, without the breakdown; its step
# median), alternating, ROUNDS rounds.
#
#   experiments/cpu-step/train_vs_bench.sh [ROUNDS]     # default 4; W=768
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-4}
w=${W:-768}
heads=$((w / 32))
. experiments/corpus.sh
echo "| round | pipe train step ms | pipe bench mfu step ms | train / bench |"
echo "|---|---|---|---|"
for r in $(seq 1 "$rounds"); do
  "$pipe" train --model gpt2 --n-layer 8 --n-embd "$w" --n-head "$heads" --n-positions 128 \
    --dataset "tokens:$work/corpus" --microbatch-size 16 --microbatches 1 --threads 2 \
    --weight-decay-groups all --steps 11 --log-jsonl "$work/pipe.jsonl" > "$work/pipe.txt" 2>&1
  train=$(python3 - "$work/pipe.jsonl" <<'PY'
import json, sys
t = [r["elapsed_s"] for r in map(json.loads, open(sys.argv[1])) if r.get("kind") == "step"]
d = sorted(b - a for a, b in zip(t[4:], t[5:]))
print(f"{1000 * d[len(d) // 2]:.0f}")
PY
)
  "$pipe" bench mfu --model gpt2 --n-layer 8 --n-embd "$w" --n-head "$heads" --n-positions 128 \
    --vocab-size 1024 --batch 16 --optimizer adamw --steps 6 > "$work/bench.txt"
  bench=$(awk '/^step \(median\)/{printf "%.0f", $3}' "$work/bench.txt")
  echo "| $r | $train | $bench | $(python3 -c "print(f'{$train / $bench:.2f}')") |"
done
