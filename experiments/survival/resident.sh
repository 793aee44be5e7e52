#!/bin/bash
# Resident memory over an undisturbed run, sampled often: `pipe train --stages 4 --replicas 2
# --epochs EPOCHS` (MNIST, default 5) as worker processes over TRANSPORT (default shm), each
# worker's VmRSS read every 0.2 s. Run with the build under test and, where BASE names
# another binary, with it after. The summary gives, per worker, the least, median and most
# resident memory from the first epoch's end on, and the spread (most less least, over the
# median): what a reading taken at one moment of the run can land anywhere within.
#   BASE=target/compare/pipe-58da739 bash experiments/survival/resident.sh OUTDIR
# Writes OUTDIR/{new,base}.{txt,rss} and the summary on standard output.
set -uo pipefail
OUT=${1:?usage: resident.sh OUTDIR}
PIPE=${PIPE:-target/release/pipe}
mkdir -p "$OUT"
F=(--stages 4 --replicas 2 --epochs "${EPOCHS:-5}" --partition 0-2,3-4,5-6,7-9 --momentum 0.6
   --placement processes --transport "${TRANSPORT:-shm}")

sample() { # NAME BINARY
  local name=$1 bin=$2 t0 launcher
  t0=$(date +%s.%N)
  "$bin" train "${F[@]}" > "$OUT/$name.txt" 2>&1 &
  launcher=$!
  while kill -0 "$launcher" 2> /dev/null; do
    local line ranks=0
    line=$(echo "$(date +%s.%N) $t0" | awk '{printf "%.2f", $1 - $2}')
    for rank in 0 1 2 3 4 5 6 7; do
      pid=$(pgrep -P "$launcher" -f -- "--rank $rank " | head -1)
      rss=$([ -n "$pid" ] && awk '/VmRSS/ {print $2}' "/proc/$pid/status" 2> /dev/null)
      [ -n "$rss" ] && ranks=$((ranks + 1))
      line="$line ${rss:-0}"
    done
    [ "$ranks" = 8 ] && echo "$line"
    sleep 0.2
  done > "$OUT/$name.rss"
  wait "$launcher"
}

summary() { # NAME
  local name=$1 first
  # The first epoch's end, in seconds of the launcher's clock: the run's own elapsed time
  # plus the start-up before its first update.
  first=$(awk '/^epoch +1 / {print $(NF - 1) + 0}' "$OUT/$name.txt")
  echo "$(grep '^done' "$OUT/$name.txt")"
  python3 - "$OUT/$name.rss" "$first" <<'PY'
import statistics, sys
rows = [list(map(float, l.split())) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if r[0] >= float(sys.argv[2]) + 2]
for w in range(8):
    v = sorted(r[w + 1] / 1024 for r in rows)
    lo, hi, med = v[0], v[-1], statistics.median(v)
    print(f"  w{w} resident MiB: least {lo:.0f}, median {med:.0f}, most {hi:.0f}, "
          f"spread {100 * (hi - lo) / med:.1f}%")
PY
}

sample new "$PIPE"
[ -n "${BASE:-}" ] && sample base "$BASE"
echo "== this build ($PIPE)"
summary new
if [ -n "${BASE:-}" ]; then
  echo "== $BASE"
  summary base
fi
