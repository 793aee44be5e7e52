#!/bin/bash
# seen.sh's runs on one binary, plain ("old") against the same binary with its worker
# processes' threads reniced by stage, later stages first ("new": stage s at nice STEP*(3-s),
# set from outside with renice once the launcher has started its 8 workers; threads started
# later inherit it). A probe of whether a downstream-first CPU priority shortens the refill
# after a lost replica on a 2-core host; not a feature of pipe.
#   PIPE (default target/release/pipe), PLACEMENT (default shm), REPS (default 3), STEP
#   (default 1), KILLS as in seen.sh.
#   STEP=3 bash experiments/survival/niced.sh OUTDIR
# Writes seen.sh's files and prints seen.py's table; spanning.py OUTDIR reads the same files.
set -euo pipefail
OUT=${1:?usage: [STEP=N] niced.sh OUTDIR}
PIPE=${PIPE:-target/release/pipe}
PLACEMENT=${PLACEMENT:-shm}
REPS=${REPS:-3}
STEP=${STEP:-1}
read -r -a KILL <<< "${KILLS:-11653 13984 16315}"
mkdir -p "$OUT"
F=(--stages 4 --replicas 2 --epochs 2 --momentum 0.6 --partition 0-2,3-4,5-6,7-9
   --schedule pipedream --placement processes --transport "$PLACEMENT")
renice_stages() { # LAUNCHER_PID
  local launcher=$1 p r s n
  for _ in $(seq 1 200); do
    n=$(pgrep -P "$launcher" -f "pipe worker" | wc -l || true)
    [ "$n" -ge 8 ] && break
    sleep 0.02
  done
  for p in $(pgrep -P "$launcher" -f "pipe worker"); do
    r=$(tr '\0' ' ' < "/proc/$p/cmdline" | sed -E 's/.*--rank ([0-9]+).*/\1/')
    s=$((r / 2))
    for t in /proc/"$p"/task/*; do
      renice -n $((STEP * (3 - s))) -p "${t##*/}" > /dev/null 2>&1 || true
    done
  done
}
run() { # NAME old|new [FLAGS...]
  local name=$1 mode=$2 pid
  shift 2
  "$PIPE" train "${F[@]}" --log-jsonl "$OUT/$name.jsonl" "$@" > "$OUT/$name.txt" 2>&1 &
  pid=$!
  if [ "$mode" = new ]; then renice_stages "$pid"; fi
  wait "$pid"
}
for rep in $(seq 1 "$REPS"); do
  for mode in old new; do run "$mode-calm-$rep" "$mode"; done
  for i in 0 1 2; do
    for mode in old new; do
      run "$mode-$((25 * (i + 1)))-$rep" "$mode" --fault-schedule "3:exit@${KILL[$i]}"
    done
  done
done
python3 "$(dirname "$0")/seen.py" "$OUT" "$REPS"
