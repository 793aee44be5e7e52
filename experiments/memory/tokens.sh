#!/usr/bin/env bash
# Resident memory of a run on a token corpus larger than it: a 4 GiB synthetic shard set
# (8 shards of 256 Mi u16 ids) trains gpt2-tiny for STEPS updates at 4 stages x 2 replicas,
# under /usr/bin/time -v, which reports the peak resident set. The corpus is memory-mapped, so
# only the pages of the windows read become resident; the window order of 33.5 million
# windows (4 bytes each) is the largest allocation the data makes.
#
#   cargo build --release && bash experiments/memory/tokens.sh [STEPS] > experiments/memory/tokens.log
set -euo pipefail
cd "$(dirname "$0")/../.."
steps=${1:-200}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
date -u
echo "machine: $(lscpu | grep 'Model name' | sed 's/ *Model name: *//'), $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB"
python3 experiments/memory/synthetic_shards.py "$dir/corpus"
du -sh "$dir/corpus"
/usr/bin/time -v ./target/release/pipe train --model gpt2-tiny --dataset "tokens:$dir/corpus" \
  --stages 4 --replicas 2 --steps "$steps" --eval-windows 256 2> "$dir/time" | tail -3
grep -E "Maximum resident set size|Elapsed \(wall clock\)" "$dir/time"
kb=$(awk '/Maximum resident set size/ {print $6}' "$dir/time")
echo "peak resident: $((kb / 1024)) MiB for a $(du -sm "$dir/corpus" | cut -f1) MiB corpus"
