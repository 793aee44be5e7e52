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
rounds=${1:-3}
cargo build --release --locked --bin pipe >&2
pipe=$PWD/target/release/pipe
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
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
    rate=$(awk '/^epoch +1 /{for(i=1;i<=NF;i++) if($i=="tokens/s") print $(i-1)}' "$out/$clip-$r.txt")
    digest=$(sed -n 's/.*weights \([0-9a-f]*\).*/\1/p' "$out/$clip-$r.txt" | tail -1)
    norm=$(python3 -c 'import json,sys
steps=[json.loads(l) for l in open(sys.argv[1]) if "\"step\"" in l]
n=steps[-1].get("grad_norm") if steps else None
print("-" if n is None else f"{n:.3f}")' "$log")
    echo "$clip $rate" >> "$out/rates"
    echo "| $r | $clip | $rate | $norm | $digest |"
  done
done
python3 - "$out/rates" <<'PY'
import statistics, sys
rates = {}
for line in open(sys.argv[1]):
    clip, rate = line.split()
    rates.setdefault(clip, []).append(float(rate))
med = {k: statistics.median(v) for k, v in rates.items()}
print()
print("| clip | median tokens/s | against no clipping |")
print("|---|---|---|")
for k, v in med.items():
    print(f"| {'off' if k == '0' else 'at ' + k} | {v:.0f} | {v / med['0']:.3f} |")
PY
