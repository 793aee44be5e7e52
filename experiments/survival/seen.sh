#!/bin/bash
# The time from a lost replica seen to the next update record, two builds side by side:
# `pipe train --stages 4 --replicas 2 --epochs 2` as worker processes (MNIST, the partition
# and momentum of update.sh), worker 3 (stage 1, replica 1) ending at its Nth data message
# (`exit@N`, an abort, as kill -9 ends it) at about 25%, 50% and 75% of the second epoch.
# Each repetition runs both builds undisturbed and at each kill, alternating the builds, so
# that the machine's load falls on both alike.
#   BASE: the build before; PIPE (default target/release/pipe): this build.
#   PLACEMENT: shm or quic. REPS (default 3): repetitions.
#   KILLS (default "11653 13984 16315"): worker 3's data message of each kill, as update.sh's
#     probe calibrated them (468 updates an epoch).
#   BASE=target/compare/pipe-OLD PLACEMENT=quic bash experiments/survival/seen.sh OUTDIR
# Writes OUTDIR/{old,new}-{calm,25,50,75}-REP.{txt,jsonl}, then the table of
# experiments/survival/seen.py on standard output.
set -euo pipefail
OUT=${1:?usage: BASE=OLD_PIPE PLACEMENT=shm|quic seen.sh OUTDIR}
PIPE=${PIPE:-target/release/pipe}
BASE=${BASE:?BASE: the pipe binary of the build before}
PLACEMENT=${PLACEMENT:?PLACEMENT: shm or quic}
REPS=${REPS:-3}
read -r -a KILL <<< "${KILLS:-11653 13984 16315}"
mkdir -p "$OUT"
F=(--stages 4 --replicas 2 --epochs 2 --momentum 0.6 --partition 0-2,3-4,5-6,7-9
   --schedule pipedream --placement processes --transport "$PLACEMENT")
run() { # NAME BINARY [FLAGS...]
  local name=$1 bin=$2
  shift 2
  "$bin" train "${F[@]}" --log-jsonl "$OUT/$name.jsonl" "$@" > "$OUT/$name.txt" 2>&1
}
for rep in $(seq 1 "$REPS"); do
  for build in old new; do
    bin=$PIPE
    [ "$build" = old ] && bin=$BASE
    run "$build-calm-$rep" "$bin"
  done
  for i in 0 1 2; do
    pct=$((25 * (i + 1)))
    for build in old new; do
      bin=$PIPE
      [ "$build" = old ] && bin=$BASE
      run "$build-$pct-$rep" "$bin" --fault-schedule "3:exit@${KILL[$i]}"
    done
  done
done
python3 "$(dirname "$0")/seen.py" "$OUT" "$REPS"
