#!/usr/bin/env bash
# Do the defaults train? Every MNIST preset the project names, at 1 and 4 stages, with nothing
# but --model and --stages given: default learning rate, schedule (pipedream when pipelined),
# momentum, init, warm-up and epochs. One line per run: final test accuracy and loss, and the
# run header's optimizer settings. Runs are deterministic (seed 0), so accuracies repeat
# exactly on any machine with the same kernels; times do not.
#
#   experiments/defaults/run.sh [OUT]    # default OUT: experiments/defaults/results.md
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-experiments/defaults/results.md}
cargo build --release --quiet
{
  echo "| model | stages | optimizer | test accuracy | test loss | wall time |"
  echo "|---|---|---|---|---|---|"
  for model in mlp-784-512-512-10 mlp-784-1024x4-10 mlp-784-1024x16-10; do
    for stages in 1 4; do
      log=$(mktemp)
      if target/release/pipe train --model "$model" --stages "$stages" > "$log" 2>&1; then
        opt=$(sed -n 's/.*microbatch [0-9]* x [0-9]*, \(.*\), seed.*/\1/p' "$log" | head -1)
        sed -n 's/^done: .*test accuracy \([0-9.]*%\), test loss \([0-9.]*\), \(.*\)$/\1 \2 \3/p' "$log" |
          while read -r acc loss time; do
            echo "| $model | $stages | $opt | $acc | $loss | $time |"
          done
      else
        echo "| $model | $stages | refused: $(grep -m1 '^error' "$log" | cut -c8-) | | | |"
      fi
      rm -f "$log"
    done
  done
} | tee "$out"
