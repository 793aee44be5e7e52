#!/bin/bash
# Segment recovery (the build before recovery at the update) against update recovery:
# `pipe train --stages 4 --replicas 2 --epochs 2`, worker 3 (stage 1, replica 1) failing at
# about 25%, 50% and 75% of the second epoch, each build also undisturbed.
#   SCHEDULE (default pipedream): the policy.
#   PLACEMENT=threads (default): in process; the failure is an injected panic at worker 3's
#     Nth data message of the run's second segment (the second epoch).
#   PLACEMENT=shm or PLACEMENT=quic: worker processes over that transport; the failure is
#     worker 3's process ending at its Nth data message of the run as kill -9 ends it
#     (`exit@N`, an abort).
# N is the same for both builds, calibrated from one probe run of PROBE (default this build),
# whose recovery line names the update it recovered at ("taken over at update N", else
# "from update N").
#   KEEP_OLD=1: the build before's runs and the probe already in OUTDIR (an earlier call of
#     this script with the same BASE and PROBE) are kept, and only this build runs again.
#   BASE=path/to/pipe-of-the-build-before PLACEMENT=shm bash experiments/survival/update.sh OUTDIR
# Writes OUTDIR/*.txt and *.jsonl, and the table on standard output
# (experiments/survival/table.py reads the logs).
set -euo pipefail
OUT=${1:?usage: BASE=OLD_PIPE update.sh OUTDIR}
PIPE=${PIPE:-target/release/pipe}
BASE=${BASE:?BASE: the pipe binary of the build before recovery at the update}
mkdir -p "$OUT"
PLACEMENT=${PLACEMENT:-threads}
F=(--stages 4 --replicas 2 --epochs 2 --momentum 0.6 --partition 0-2,3-4,5-6,7-9
   --schedule "${SCHEDULE:-pipedream}")
case "$PLACEMENT" in
  threads) fault() { echo "3:panic@$1/1"; }; first=1 ;;
  shm | quic) F+=(--placement processes --transport "$PLACEMENT"); fault() { echo "3:exit@$1"; }; first=0 ;;
  *) echo "PLACEMENT is threads, shm or quic" >&2; exit 2 ;;
esac

run() { # NAME BINARY [FLAGS...]: one run, its wall time in NAME.wall
  local name=$1 bin=$2
  shift 2
  case "$name" in
    old-* | probe) if [ "${KEEP_OLD:-0}" = 1 ] && [ -s "$OUT/$name.wall" ]; then return; fi ;;
  esac
  local t0 t1
  t0=$(date +%s.%N)
  "$bin" train "${F[@]}" --log-jsonl "$OUT/$name.jsonl" "$@" > "$OUT/$name.txt" 2>&1
  t1=$(date +%s.%N)
  echo "$t0 $t1" | awk '{printf "%.2f\n", $2 - $1}' > "$OUT/$name.wall"
}

# Updates per epoch, from the undisturbed run's log.
run new-calm "$PIPE"
run old-calm "$BASE"
per_epoch=$(python3 -c "
import json,sys
steps=[json.loads(l) for l in open('$OUT/new-calm.jsonl') if '\"step\"' in l]
print(max(r['steps_in_epoch'] for r in steps if r.get('kind')=='step'))")
# Calibration: where a failure at message 2000 of the second epoch (threads: counted from the
# segment's start; processes: from the run's) recovers.
skip=$((first == 1 ? 0 : per_epoch))
probe=$((2000 + (first == 1 ? 0 : 8000)))
run probe "${PROBE:-$PIPE}" --fault-schedule "$(fault $probe)"
from=$(grep -o 'taken over at update [0-9]*' "$OUT/probe.txt" | grep -o '[0-9]*$' || true)
[ -n "$from" ] || from=$(grep -o 'from update [0-9]*' "$OUT/probe.txt" | grep -o '[0-9]*$')
per_update=$(python3 -c "print(max(1.0, $probe / max(1, $from - $per_epoch + $skip)))")
for pct in 25 50 75; do
  nth=$(python3 -c "print(max(1, round($per_update * ($skip + $per_epoch * $pct / 100))))")
  run "new-$pct" "$PIPE" --fault-schedule "$(fault $nth)"
  run "old-$pct" "$BASE" --fault-schedule "$(fault $nth)"
  echo "$nth" > "$OUT/kill-$pct.nth"
done
python3 "$(dirname "$0")/table.py" "$OUT" "$per_epoch"
