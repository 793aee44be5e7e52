#!/usr/bin/env bash
# Throughput of two revisions of pipe side by side, in one sitting: builds both, then alternates
# `pipe bench mfu`, `pipe bench pipeline --rounds 1` and the small model alone at four times the
# updates (its one-second worker-process cases are the noisiest figures) between them ROUNDS
# times, so both see the same machine load, and prints each figure's median with the
# after/before ratio and whether that ratio lies within the spread of the rounds themselves.
#
#   experiments/compare-builds/run.sh [BEFORE [AFTER [ROUNDS]]]    # defaults: 1fa4d95 HEAD 3
#
# Each revision is built in its own worktree and target directory under target/compare/;
# BIN_BEFORE and BIN_AFTER name binaries already built, to skip that.
set -euo pipefail
cd "$(dirname "$0")/../.."
before=${1:-1fa4d95}
after=${2:-HEAD}
rounds=${3:-3}
root=$PWD/target/compare
out=$root/out
mkdir -p "$out"
rm -f "$out"/*.json

build() { # rev -> path of its pipe binary
  local rev sha dir
  rev=$1
  sha=$(git rev-parse --short "$rev")
  dir=$root/src-$sha
  if [ ! -d "$dir" ]; then
    git worktree add --detach "$dir" "$sha" >/dev/null 2>&1
  fi
  (cd "$dir" && CARGO_TARGET_DIR=$root/target-$sha cargo build --release --locked --bin pipe >&2)
  echo "$root/target-$sha/release/pipe"
}

bin_before=${BIN_BEFORE:-$(build "$before")}
bin_after=${BIN_AFTER:-$(build "$after")}
for r in $(seq 1 "$rounds"); do
  for side in before after; do
    bin=bin_$side
    echo "round $r: $side mfu" >&2
    "${!bin}" bench mfu --json "$out/mfu-$side-$r.json" >/dev/null
    echo "round $r: $side pipeline" >&2
    "${!bin}" bench pipeline --rounds 1 --json "$out/pipeline-$side-$r.json" >/dev/null
    echo "round $r: $side small model, 96 updates" >&2
    "${!bin}" bench pipeline --rounds 1 --small-only --updates 96 \
      --json "$out/small96-$side-$r.json" >/dev/null
  done
done
python3 experiments/compare-builds/summarise.py "$out" "$rounds" \
  "$(git rev-parse --short "$before")" "$(git rev-parse --short "$after")"
