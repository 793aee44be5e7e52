#!/usr/bin/env bash
# A transport suite's large-message cases, two builds taking turns, each run beside BUSY busy
# loops (default 4: this machine's two cores taken twice over): how often a close cut off a
# message still on its way.
#
#   [BUSY=4] experiments/transport-close/under_load.sh OLD_SUITE NEW_SUITE [ROUNDS]
#
# OLD_SUITE and NEW_SUITE are test binaries of `transport/tests/suite.rs`
# (`cargo test --release -p pipe-transport --test suite --no-run` prints the path); copy the
# binary aside before rebuilding the other build. Prints one line per run and a count per build.
set -euo pipefail
old=${1:?old suite binary}
new=${2:?new suite binary}
rounds=${3:-15}
busy=${BUSY:-4}
cases=(mixed::moves_a_256_mib_tensor_intact quic::moves_a_256_mib_tensor_intact)
declare -A failed=([old]=0 [new]=0)
for round in $(seq 1 "$rounds"); do
  for build in old new; do
    bin=$old; [[ $build == new ]] && bin=$new
    loops=()
    for _ in $(seq 1 "$busy"); do
      timeout 300 sh -c 'while :; do :; done' &
      loops+=($!)
    done
    if timeout 300 "$bin" "${cases[@]}" >/dev/null 2>&1; then rc=0; else rc=$?; fi
    kill "${loops[@]}" 2>/dev/null || true
    wait "${loops[@]}" 2>/dev/null || true
    echo "round $round $build rc=$rc"
    [[ $rc == 0 ]] || failed[$build]=$((failed[$build] + 1))
    sleep 1
  done
done
echo "failed runs: old ${failed[old]} of $rounds, new ${failed[new]} of $rounds"
