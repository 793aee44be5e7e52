#!/bin/bash
# A replica killed with SIGKILL mid-epoch, against the undisturbed run and against the
# undisturbed run's checkpoint resumed by hand on the new layout (docs/reliability.md).
#   bash experiments/survival/run.sh OUTDIR
set -euo pipefail
OUT=${1:?usage: run.sh OUTDIR}
. "$(dirname "$0")/common.sh"
# The undisturbed run.
"$PIPE" train "${F[@]}" --replicas 2 --transport quic --checkpoint-dir "$OUT/calm" > "$OUT/calm.txt" 2>&1
# The same, with worker 3 (stage 1, replica 1) killed once the update-200 checkpoint exists.
"$PIPE" train "${F[@]}" --replicas 2 --transport quic --checkpoint-dir "$OUT/killed" > "$OUT/killed.txt" 2>&1 &
launcher=$!
until [ -e "$OUT/killed/ckpt-00000200" ]; do sleep 0.01; done
victim=$(pgrep -P "$launcher" -f -- "--rank 3 ")
kill -9 "$victim"
wait "$launcher"
from=$(grep -o 'from update [0-9]*' "$OUT/killed.txt" | grep -o '[0-9]*$')
replicas=$(sed -n 's/.* lost: .*replicas \[\([0-9, ]*\)\].*/\1/p' "$OUT/killed.txt" | head -1 | tr -d ' ')
# The undisturbed run's checkpoint at that update, resumed by hand on the new layout.
"$PIPE" train "${F[@]}" --replicas "$replicas" --checkpoint-dir "$OUT/resumed" \
  --resume "$OUT/calm/ckpt-$(printf %08d "$from")" > "$OUT/resumed.txt" 2>&1
grep -h '^done\|lost:' "$OUT/calm.txt" "$OUT/killed.txt" "$OUT/resumed.txt"
rm -rf "$OUT/calm" "$OUT/killed" "$OUT/resumed"
