#!/usr/bin/env bash
# Runs every fuzz target (or TARGET alone) for SECONDS each (default 60), or for FUZZ_RUNS
# inputs each when the environment sets it, and prints libFuzzer's closing figures (inputs
# run, coverage) and any crash. With a nightly toolchain it uses AddressSanitizer; with only
# stable, it builds without a sanitizer (RUSTC_BOOTSTRAP lets cargo-fuzz pass its flags).
# Needs `cargo install cargo-fuzz`.
#
#   fuzz/run.sh [SECONDS [TARGET]]
#   FUZZ_RUNS=1000000 fuzz/run.sh 0 shard_parse
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-60}
only=${2:-}
if [ -n "${FUZZ_RUNS:-}" ]; then
    budget=(-runs="$FUZZ_RUNS")
    said="$FUZZ_RUNS inputs"
else
    budget=(-max_total_time="$secs")
    said="$secs s"
fi
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    tc=(+nightly)
    san=()
else
    export RUSTC_BOOTSTRAP=1
    tc=()
    san=(--sanitizer none)
fi
status=0
for target in $(cargo "${tc[@]}" fuzz list); do
    if [ -n "$only" ] && [ "$target" != "$only" ]; then
        continue
    fi
    echo "== $target ($said)"
    log=$(mktemp)
    if cargo "${tc[@]}" fuzz run "${san[@]}" "$target" -- "${budget[@]}" \
        -max_len=4096 -rss_limit_mb=2048 -print_final_stats=1 > "$log" 2>&1; then
        grep -E '^Done|stat::number_of_executed_units|DONE' "$log" | tail -3
    else
        status=1
        grep -E 'panicked|ERROR|SUMMARY|crash-' "$log" | head -10
    fi
    rm -f "$log"
done
exit $status
