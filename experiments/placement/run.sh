#!/usr/bin/env bash
# Worker processes on one host against threads, in alternating rounds on one machine:
#
#   pipe train --stages 4 --replicas 2 --epochs 1 --partition 0-2,3-4,5-6,7-9 [PLACEMENT]
#
# as threads (the default), as worker processes over shared memory (--placement processes,
# whose default transport is auto), as worker processes over QUIC (--transport quic), and as
# worker processes over QUIC with the release before shared memory (BASELINE, default
# f3d3aaa, built in its own worktree under target/compare/ unless PIPE_BASELINE names a
# binary). Prints each run's samples/s (the epoch line), its weights digest and wall time,
# then the medians and the ratios the placement issue asks for.
#
#   experiments/placement/run.sh [ROUNDS [BASELINE]]        # defaults: 2 f3d3aaa
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/lib.sh
rounds=${1:-2}
baseline=${2:-f3d3aaa}
cargo build --release --locked --bin pipe >&2
pipe=$PWD/target/release/pipe
if [ -n "${PIPE_BASELINE:-}" ]; then
  base=$PIPE_BASELINE
else
  root=$PWD/target/compare
  sha=$(git rev-parse --short "$baseline")
  dir=$root/src-$sha
  [ -d "$dir" ] || git worktree add --detach "$dir" "$sha" >/dev/null 2>&1
  (cd "$dir" && CARGO_TARGET_DIR=$root/target-$sha cargo build --release --locked --bin pipe >&2)
  base=$root/target-$sha/release/pipe
fi
args=(train --stages 4 --replicas 2 --epochs 1 --partition 0-2,3-4,5-6,7-9)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "| round | run | samples/s | weights | wall s |"
echo "|---|---|---|---|---|"
for r in $(seq 1 "$rounds"); do
  for run in threads shm quic quic-baseline; do
    case $run in
      threads) cmd=("$pipe" "${args[@]}") ;;
      shm) cmd=("$pipe" "${args[@]}" --placement processes) ;;
      quic) cmd=("$pipe" "${args[@]}" --transport quic) ;;
      quic-baseline) cmd=("$base" "${args[@]}" --transport quic) ;;
    esac
    start=$(date +%s.%N)
    "${cmd[@]}" > "$out/$run-$r.txt" 2>&1
    end=$(date +%s.%N)
    rate=$(epoch_rate "$out/$run-$r.txt" samples/s)
    digest=$(final_digest "$out/$run-$r.txt")
    echo "$run $rate" >> "$out/rates"
    printf '| %s | %s | %s | %s | %.1f |\n' "$r" "$run" "$rate" "$digest" "$(echo "$end - $start" | bc)"
  done
done
medians "$out/rates" | awk '{ med[$1] = $2; printf "median %s: %.0f samples/s\n", $1, $2 }
  END {
    printf "shared memory / threads: %.2f\n", med["shm"] / med["threads"]
    printf "QUIC / threads: %.2f\n", med["quic"] / med["threads"]
    printf "QUIC now / QUIC at the baseline: %.2f\n", med["quic"] / med["quic-baseline"]
  }'
