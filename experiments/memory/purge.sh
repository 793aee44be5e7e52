#!/usr/bin/env bash
# When the binary's allocator hands freed memory back (mimalloc's `purge_delay`, which
# `MIMALLOC_PURGE_DELAY` in the environment sets over the binary's 10 s): `pipe bench mfu` on
# the MLP preset and on a GPT-2 of 4 blocks, width 256, under never (-1), mimalloc's own
# 1 s, and the binary's 10 s, the three in turn each round: MFU, the run's page faults and
# its system seconds (GNU time). Resident memory over repeated losses, the other side of the
# choice, is `experiments/survival/rejoin.sh` and the test
# `twenty_kill_and_rejoin_cycles_in_one_run`.
#
#   experiments/memory/purge.sh [ROUNDS] > OUT
set -euo pipefail
cd "$(dirname "$0")/../.."
PIPE=${PIPE:-target/release/pipe}
ROUNDS=${1:-3}
GPT=(--model gpt2 --n-layer 4 --n-embd 256 --n-head 4 --n-positions 128 --vocab-size 1024
     --batch 16 --steps 10)
echo "# $(date -u +%F), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
echo "model delay_ms mfu page_faults sys_s"
for round in $(seq 1 "$ROUNDS"); do
  for model in mlp gpt; do
    for delay in -1 1000 10000; do
      if [ "$model" = mlp ]; then args=(); else args=("${GPT[@]}"); fi
      out=$(MIMALLOC_PURGE_DELAY=$delay /usr/bin/time -f "time %R %S" "$PIPE" bench mfu "${args[@]}" 2>&1)
      mfu=$(echo "$out" | awk '/^MFU /{print $2; exit}')
      faults=$(echo "$out" | awk '/^time /{print $2}')
      sys=$(echo "$out" | awk '/^time /{print $3}')
      echo "$model $delay $mfu $faults $sys"
    done
  done
done
