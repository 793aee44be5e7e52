#!/bin/bash
# The launcher's resident memory over repeated faults: a two-stage run over QUIC meets COUNT
# faults drawn from a seed (one per start, each followed by a restart); the launcher's VmRSS
# is sampled every half second and printed after each restart line and at the end.
#   bash experiments/survival/memory.sh OUTDIR [COUNT]
set -euo pipefail
OUT=${1:?usage: memory.sh OUTDIR [COUNT]}
COUNT=${2:-30}
PIPE=${PIPE:-target/release/pipe}
mkdir -p "$OUT"
cat > "$OUT/small.toml" <<'TOML'
dataset = "synthetic"
model = "mlp-64-32x8-10"
epochs = 10000
threads = 1
partition = "flops"

[synthetic]
inputs = 64
classes = 10
hidden = 32
train = 2048
test = 256
TOML
"$PIPE" train --config "$OUT/small.toml" --steps $((COUNT * 200)) --stages 2 --transport quic \
  --checkpoint-every 20 --stall-timeout 2 --checkpoint-dir "$OUT/ck" \
  --max-restarts "$COUNT" --fault-schedule "random:7:$COUNT" > "$OUT/run.txt" 2> "$OUT/err.txt" &
launcher=$!
while kill -0 "$launcher" 2> /dev/null; do
  rss=$(awk '/VmRSS/ {print $2}' "/proc/$launcher/status" 2> /dev/null || true)
  restarts=$(grep -c '^restart ' "$OUT/err.txt" || true)
  [ -n "$rss" ] && echo "$restarts $rss"
  sleep 0.5
done > "$OUT/rss.txt"
wait "$launcher"
# Per number of restarts so far: the largest resident set seen, in KiB.
awk '{ if ($2 > m[$1]) m[$1] = $2 } END { for (k in m) print k, m[k] }' "$OUT/rss.txt" | sort -n
grep '^done' "$OUT/run.txt"
rm -rf "$OUT/ck"
