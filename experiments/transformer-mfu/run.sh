#!/usr/bin/env bash
# `pipe bench mfu --model gpt-mini` five times in a row (batch 256 sequences of 128 tokens, 2
# threads), each run's report kept, then a table of the transformer parts' ratios to the GEMM
# rate timed in alternation with them, per run and their medians. Writes into OUT (default:
# this folder): run-1.txt .. run-5.txt and results.md.
#
#   experiments/transformer-mfu/run.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-experiments/transformer-mfu}
mkdir -p "$out"
cargo build --release --quiet
for i in 1 2 3 4 5; do
  target/release/pipe bench mfu --model gpt-mini > "$out/run-$i.txt"
done
median() { sort -n | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
field() { # field PART: the "of GEMM" ratio of PART in every run, one per line
  for i in 1 2 3 4 5; do grep -E "^  $1 " "$out/run-$i.txt" | sed -E 's/.* ([0-9.]+) of GEMM.*/\1/'; done
}
mfu() { for i in 1 2 3 4 5; do awk '/^MFU/ {print $2}' "$out/run-$i.txt"; done; }
{
  echo "Command: \`pipe bench mfu --model gpt-mini\`, five runs in a row"
  echo "($(date -u +%Y-%m-%d), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'),"
  echo "$(nproc) cores). Each part's ratio is against the reference GEMM timed in alternation with it."
  echo
  echo "| part | run 1 | run 2 | run 3 | run 4 | run 5 | median |"
  echo "|---|---|---|---|---|---|---|"
  for part in "attention" "block step"; do
    vals=$(field "$part" | tr '\n' ' ')
    echo "| $part | $(echo $vals | sed 's/ / | /g') | $(field "$part" | median) |"
  done
  echo "| whole step (MFU) | $(mfu | tr '\n' ' ' | sed 's/ $//; s/ / | /g') | $(mfu | median) |"
} > "$out/results.md"
cat "$out/results.md"
