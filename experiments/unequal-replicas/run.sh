#!/usr/bin/env bash
# Simulated throughput of unequal replica layouts against the bound, pipedream, M = 1 and 4.
# Each stage's forward, backward-input and backward-weight cost its replica count, so every
# worker has the same work and the bound is 1/3 microbatch per second.
#
#   experiments/unequal-replicas/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release --quiet
costs=$(mktemp)
trap 'rm -f "$costs"' EXIT
echo "| replicas | M | microbatches/s | of the bound |"
echo "|---|---|---|---|"
for layout in 1,3,1 2,1,1 1,2,1,1 1,4,2,1 1,3 2,2,2; do
  : > "$costs"
  for r in ${layout//,/ }; do
    printf '[[stage]]\nforward = %s\nbackward_input = %s\nbackward_weight = %s\n\n' "$r" "$r" "$r" >> "$costs"
  done
  stages=$(echo "$layout" | tr ',' '\n' | wc -l)
  for m in 1 4; do
    t=$(target/release/pipe simulate --schedule pipedream --stages "$stages" --replicas "$layout" \
          --microbatches "$m" --updates 30 --costs "$costs" | sed -n 's/.*throughput \([0-9.]*\).*/\1/p')
    echo "| $layout | $m | $t | $(python3 -c "print(f'{3 * $t:.2f}')") |"
  done
done
