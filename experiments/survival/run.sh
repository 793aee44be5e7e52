#!/bin/bash
# A replica killed with SIGKILL mid-epoch, against the undisturbed run and against the
# undisturbed run's checkpoint at the update the survivors went on from, resumed by hand on
# the new layout (docs/reliability.md). The learning rate is constant here, so that the
# undisturbed run stopped at that update (`--steps`) is the undisturbed run up to there.
#   bash experiments/survival/run.sh OUTDIR
set -euo pipefail
OUT=${1:?usage: run.sh OUTDIR}
. "$(dirname "$0")/common.sh"
F+=(--lr-schedule constant)
# The undisturbed run.
/usr/bin/time -f "%e s wall" "$PIPE" train "${F[@]}" --replicas 2 --transport quic \
  --checkpoint-dir "$OUT/calm" > "$OUT/calm.txt" 2>&1
# The same, with worker 3 (stage 1, replica 1) killed once the update-200 checkpoint exists.
/usr/bin/time -f "%e s wall" "$PIPE" train "${F[@]}" --replicas 2 --transport quic \
  --checkpoint-dir "$OUT/killed" > "$OUT/killed.txt" 2>&1 &
launcher=$!
until [ -e "$OUT/killed/ckpt-00000200" ]; do sleep 0.01; done
victim=$(pgrep -P "$(pgrep -P "$launcher")" -f -- "--rank 3 ")
kill -9 "$victim"
wait "$launcher"
from=$(grep -o 'from update [0-9]*' "$OUT/killed.txt" | grep -o '[0-9]*$')
replicas=$(sed -n 's/.* lost: .*replicas \[\([0-9, ]*\)\].*/\1/p' "$OUT/killed.txt" | head -1 | tr -d ' ')
# The undisturbed run up to that update, and its checkpoint there resumed by hand on the new
# layout.
"$PIPE" train "${F[@]}" --replicas 2 --steps "$from" --checkpoint-dir "$OUT/upto" \
  > "$OUT/upto.txt" 2>&1
"$PIPE" train "${F[@]}" --replicas "$replicas" --checkpoint-dir "$OUT/resumed" \
  --resume "$OUT/upto/ckpt-$(printf %08d "$from")" > "$OUT/resumed.txt" 2>&1
grep -h '^done\|lost:\|s wall' "$OUT/calm.txt" "$OUT/killed.txt" "$OUT/resumed.txt"
rm -rf "$OUT/calm" "$OUT/killed" "$OUT/upto" "$OUT/resumed"
