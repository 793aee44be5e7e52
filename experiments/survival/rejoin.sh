#!/bin/bash
# Twenty kill-and-rejoin cycles in one run, live (`--rejoin`): `pipe train --stages 4
# --replicas 2 --epochs 4` (MNIST) as worker processes over shared memory and over QUIC, with
# no checkpoint directory. A lost replica's segment is taken over up to the update it was in,
# where the layout changes; the survivors then run one update at a time until the
# replacement joins. EPOCHS (default 4) leaves room for twenty cycles after the first
# epoch. Worker 3 (stage 1, replica 1) is killed with SIGKILL; once the run
# prints that the lost replica rejoined, the replacement is killed in turn, twenty times,
# from the first epoch's end on. After each cycle (and SETTLE seconds, default 0.5) the resident memory (VmRSS, KiB) of the launcher and of every survivor is
# sampled, and every regular file written under the launcher's temporary directory since the
# kill is listed. Each transport also runs undisturbed.
#   bash experiments/survival/rejoin.sh OUTDIR
#   TRANSPORTS="quic" SETTLE=3 CALM=0 bash experiments/survival/rejoin.sh OUTDIR: one transport,
#   memory sampled 3 s after each rejoin, no undisturbed run.
# Writes OUTDIR/{calm,cycles}-{shm,quic}.{txt,err,rss,files} and the summary on standard
# output.
set -euo pipefail
OUT=${1:?usage: rejoin.sh OUTDIR}
PIPE=${PIPE:-target/release/pipe}
mkdir -p "$OUT"
F=(--stages 4 --replicas 2 --epochs "${EPOCHS:-4}" --partition 0-2,3-4,5-6,7-9 --momentum 0.6
   --placement processes)
CYCLES=${CYCLES:-20}
SETTLE=${SETTLE:-0.5}
TRANSPORTS=${TRANSPORTS:-shm quic}
CALM=${CALM:-1}

wall() { # START END
  echo "$1 $2" | awk '{printf "%.1f", $2 - $1}'
}

cycles() { # TRANSPORT
  local t=$1 tmp="$OUT/tmp-$t" name="$OUT/cycles-$t"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  local t0 t1
  t0=$(date +%s.%N)
  TMPDIR=$tmp "$PIPE" train "${F[@]}" --transport "$t" --rejoin > "$name.txt" 2> "$name.err" &
  local launcher=$!
  # After the first epoch's end, whose drain (the whole model gathered by the chief, its
  # evaluation, the launcher's kept state) allocates once what every later drain reuses.
  until grep -q '^epoch   1 ' "$name.txt" 2> /dev/null; do sleep 0.1; done
  sleep 1
  : > "$name.rss"
  : > "$name.files"
  local i victim start back
  for i in $(seq 1 "$CYCLES"); do
    victim=$(pgrep -P "$launcher" -f -- "--rank 3 " | head -1)
    touch "$tmp/.kill"
    start=$(date +%s.%N)
    kill -9 "$victim"
    # A cycle that has not rejoined within a minute is a hang.
    for _ in $(seq 1 600); do
      [ "$(grep -c '^the lost replicas rejoin:' "$name.txt")" -ge "$i" ] && break
      sleep 0.1
    done
    back=$(date +%s.%N)
    if [ "$(grep -c '^the lost replicas rejoin:' "$name.txt")" -lt "$i" ]; then
      echo "cycle $i: no rejoin within 60 s" >> "$name.rss"
      break
    fi
    sleep "$SETTLE"
    {
      printf '%s %s launcher %s' "$i" "$(wall "$start" "$back")" \
        "$(awk '/VmRSS/ {print $2}' "/proc/$launcher/status")"
      for rank in 0 1 2 4 5 6 7; do
        pid=$(pgrep -P "$launcher" -f -- "--rank $rank " | head -1)
        printf ' w%s %s' "$rank" "$(awk '/VmRSS/ {print $2}' "/proc/$pid/status")"
      done
      echo
    } >> "$name.rss"
    find "$tmp" -type f -newer "$tmp/.kill" ! -name .kill | sed "s|^$tmp/|$i |" >> "$name.files"
  done
  local rc=0
  wait "$launcher" || rc=$?
  t1=$(date +%s.%N)
  echo "exit $rc, $(wall "$t0" "$t1") s wall" >> "$name.rss"
  rm -rf "$tmp"
}

for t in $TRANSPORTS; do
  if [ "$CALM" = 1 ]; then
    t0=$(date +%s.%N)
    "$PIPE" train "${F[@]}" --transport "$t" > "$OUT/calm-$t.txt" 2>&1
    echo "$(wall "$t0" "$(date +%s.%N)") s wall" > "$OUT/calm-$t.wall"
  fi
  cycles "$t"
done

for t in $TRANSPORTS; do
  echo "== $t"
  [ "$CALM" = 1 ] &&
    echo "undisturbed: $(grep '^done' "$OUT/calm-$t.txt"), $(cat "$OUT/calm-$t.wall")"
  echo "cycles:      $(grep '^done' "$OUT/cycles-$t.txt"), $(tail -1 "$OUT/cycles-$t.rss")"
  echo "starts: $(grep -c '^the first update:' "$OUT/cycles-$t.txt")," \
    "losses: $(grep -c ' lost: ' "$OUT/cycles-$t.txt")," \
    "rejoins: $(grep -c '^the lost replicas rejoin:' "$OUT/cycles-$t.txt")," \
    "restored to [2, 2, 2, 2]: $(grep '^the lost replicas rejoin:' "$OUT/cycles-$t.txt" |
      grep -c 'replicas \[2, 2, 2, 2\]')"
  echo "kill to rejoin line (s), per cycle: $(awk '$1 ~ /^[0-9]+$/ && NF > 3 {printf "%s ", $2}' "$OUT/cycles-$t.rss")"
  # Resident memory at cycle 5 and cycle 20, and the change, per process.
  awk -v last="$CYCLES" '
    $1 == 5 { for (k = 3; k < NF; k += 2) five[$k] = $(k + 1) }
    $1 == last { for (k = 3; k < NF; k += 2) { name[k] = $k; end[$k] = $(k + 1) } }
    END {
      printf "resident KiB, cycle 5 -> %d:", last
      for (k = 3; k in name; k += 2) {
        n = name[k]
        printf " %s %d->%d (%+.1f%%)", n, five[n], end[n], 100 * (end[n] - five[n]) / five[n]
      }
      print ""
    }' "$OUT/cycles-$t.rss"
  echo "files written under the launcher's directory during a cycle: $(wc -l < "$OUT/cycles-$t.files")"
  sed 's/^/  /' "$OUT/cycles-$t.files" | head -5
done
