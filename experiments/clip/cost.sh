#!/usr/bin/env bash
# What gradient clipping across stages costs in time: gpt-mini under pipedream at 4 stages,
# one thread per worker, 60 updates, clipped at norm 1 and not, in alternating rounds on one
# machine (the norms travel between the worker threads; TRANSPORT=quic or PLACEMENT=processes
# sends them over the wire):
#
#   pipe train --model gpt-mini --stages 4 --schedule pipedream --microbatches 4 --steps 60 \
#        --partition flops \
#        --threads 1 --weight-decay-groups all --grad-clip NORM
#
# Prints each run's tokens/s (the epoch line), the last logged gradient norm and the weights
# digest, then the medians and their ratio.
#
#   experiments/clip/cost.sh [ROUNDS]        # default 3
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/lib.sh
rounds=${1:-3}
build_pipe
scratch_dir
args=(train --model gpt-mini --stages 4 --schedule pipedream --microbatches 4 --steps 60 --partition flops
      --threads 1 --weight-decay-groups all)
[ -n "${TRANSPORT:-}" ] && args+=(--transport "$TRANSPORT")
[ -n "${PLACEMENT:-}" ] && args+=(--placement "$PLACEMENT")
echo "| round | clip | tokens/s | last grad norm | weights |"
echo "|---|---|---|---|---|"
for r in $(seq 1 "$rounds"); do
  for clip in 0 1; do
    log="$out/$clip-$r.jsonl"
    "$pipe" "${args[@]}" --grad-clip "$clip" --log-jsonl "$log" > "$out/$clip-$r.txt" 2>&1
    rate=$(epoch_rate "$out/$clip-$r.txt" tokens/s)
    digest=$(final_digest "$out/$clip-$r.txt")
    norm=$(python3 -c 'import json,sys
steps=[json.loads(l) for l in open(sys.argv[1]) if "\"step\"" in l]
n=steps[-1].get("grad_norm") if steps else None
print("-" if n is None else f"{n:.3f}")' "$log")
    echo "$clip $rate" >> "$out/rates"
    echo "| $r | $clip | $rate | $norm | $digest |"
  done
done
median_table "$out/rates" 0 "clip (0: off), tokens/s"
