#!/usr/bin/env bash
# What a delay correction costs in time: gpt-mini under 2bw at 2 stages, one thread per
# worker, 40 updates, with each correction and without, in alternating rounds on one machine:
#
#   pipe train --model gpt-mini --stages 2 --schedule 2bw --microbatches 2 --steps 40 \
#        --threads 1 --delay-correction KIND
#
# Prints each run's tokens/s (the epoch line) and weights digest, then per correction the
# median and its ratio to the uncorrected median.
#
#   experiments/staleness/correction-cost.sh [ROUNDS]        # default 2
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/lib.sh
rounds=${1:-2}
build_pipe
scratch_dir
args=(train --model gpt-mini --stages 2 --schedule 2bw --microbatches 2 --steps 40 --threads 1)
echo "| round | correction | tokens/s | weights |"
echo "|---|---|---|---|"
for r in $(seq 1 "$rounds"); do
  for kind in none error-feedback dc-asgd dc-asgd-adaptive; do
    "$pipe" "${args[@]}" --delay-correction "$kind" > "$out/$kind-$r.txt" 2>&1
    rate=$(epoch_rate "$out/$kind-$r.txt" tokens/s)
    digest=$(final_digest "$out/$kind-$r.txt")
    echo "$kind $rate" >> "$out/rates"
    echo "| $r | $kind | $rate | $digest |"
  done
done
median_table "$out/rates" none "correction, tokens/s"
