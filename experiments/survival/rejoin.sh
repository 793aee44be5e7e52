#!/bin/bash
# A replica killed with SIGKILL mid-epoch under --rejoin: the run goes on without it from the
# newest checkpoint, takes it back at the next drain point (a replacement `pipe worker` with
# the lost rank), and ends on its own layout. Compared with the undisturbed run, and with the
# layout sequence resumed by hand: the undisturbed run's checkpoint at the loss on the shrunk
# layout up to the rejoin, then on the full layout (docs/reliability.md).
#   bash experiments/survival/rejoin.sh OUTDIR
set -euo pipefail
OUT=${1:?usage: rejoin.sh OUTDIR}
. "$(dirname "$0")/common.sh"
/usr/bin/time -f "%e s wall" "$PIPE" train "${F[@]}" --replicas 2 --transport quic \
  --checkpoint-dir "$OUT/calm" > "$OUT/calm.txt" 2>&1
# Worker 3 (stage 1, replica 1) killed once the update-200 checkpoint exists.
/usr/bin/time -f "%e s wall" "$PIPE" train "${F[@]}" --replicas 2 --transport quic --rejoin \
  --checkpoint-dir "$OUT/killed" > "$OUT/killed.txt" 2>&1 &
launcher=$!
until [ -e "$OUT/killed/ckpt-00000200" ]; do sleep 0.01; done
victim=$(pgrep -P "$(pgrep -P "$launcher")" -f -- "--rank 3 ")
kill -9 "$victim"
wait "$launcher"
from=$(grep ' lost: ' "$OUT/killed.txt" | grep -o 'from update [0-9]*' | grep -o '[0-9]*$')
to=$(grep 'rejoin:' "$OUT/killed.txt" | grep -o 'from update [0-9]*' | grep -o '[0-9]*$')
shrunk=$(sed -n 's/.* lost: .*replicas \[\([0-9, ]*\)\].*/\1/p' "$OUT/killed.txt" | head -1 | tr -d ' ')
# By hand: the undisturbed checkpoint at the loss on the shrunk layout, its checkpoint at
# the rejoin on the full layout.
"$PIPE" train "${F[@]}" --replicas "$shrunk" --checkpoint-dir "$OUT/shrunk" \
  --resume "$OUT/calm/ckpt-$(printf %08d "$from")" > "$OUT/shrunk.txt" 2>&1
"$PIPE" train "${F[@]}" --replicas 2 --checkpoint-dir "$OUT/resumed" \
  --resume "$OUT/shrunk/ckpt-$(printf %08d "$to")" > "$OUT/resumed.txt" 2>&1
grep -h '^done\|lost:\|rejoin:\|s wall' "$OUT/calm.txt" "$OUT/killed.txt" "$OUT/resumed.txt"
rm -rf "$OUT/calm" "$OUT/killed" "$OUT/shrunk" "$OUT/resumed"
