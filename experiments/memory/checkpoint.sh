#!/bin/bash
# What writing a checkpoint costs in resident memory, for each binary given (built from
# different commits), side by side in one run:
#   1. one process, `pipe train --model mlp-784-4096x8-10 --optimizer adam --steps 2` (134 M
#      parameters: a 537 MB weights file and a 1.07 GB optimizer file), without a checkpoint
#      directory and with one written after update 2, and `pipe eval` of that checkpoint
#      (which reads all of it, optimizer state included): each process's peak resident
#      memory (GNU time's maximum RSS), ROUNDS times each;
#   2. worker processes, `pipe train --stages 4 --replicas 2 --epochs 2` (MNIST, 4 M
#      parameters) with no checkpoint directory, whose chief (worker 0) gathers the model and
#      writes the launcher's drained state at each epoch's end: every worker's peak resident
#      memory (VmHWM, read every 0.1 s).
#
#   bash experiments/memory/checkpoint.sh OUTDIR BINARY...
# Writes OUTDIR/{single,drain}.txt (and the runs' output) and prints both tables.
set -euo pipefail
OUT=${1:?usage: checkpoint.sh OUTDIR BINARY...}
shift
[ $# -ge 1 ] || { echo "usage: checkpoint.sh OUTDIR BINARY..." >&2; exit 2; }
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"

: > "$OUT/single.txt"
for round in $(seq 1 "$ROUNDS"); do
  for bin in "$@"; do
    for ckpt in none written; do
      rm -rf "$OUT/ckpt"
      args=(train --model mlp-784-4096x8-10 --optimizer adam --steps 2)
      [ "$ckpt" = written ] && args+=(--checkpoint-dir "$OUT/ckpt" --checkpoint-every 2)
      kb=$(/usr/bin/time -f '%M' "$bin" "${args[@]}" 2>&1 > "$OUT/single-run.txt" | tail -1)
      echo "$round $(basename "$bin") $ckpt $kb" >> "$OUT/single.txt"
      if [ "$ckpt" = written ]; then
        kb=$(/usr/bin/time -f '%M' "$bin" eval --checkpoint "$OUT/ckpt" 2>&1 \
          > "$OUT/eval-run.txt" | tail -1)
        echo "$round $(basename "$bin") read $kb" >> "$OUT/single.txt"
      fi
    done
  done
done
rm -rf "$OUT/ckpt"

: > "$OUT/drain.txt"
for bin in "$@"; do
  # lib.sh finds the workers by the name `pipe worker`: each binary runs as a copy so named.
  label=$(basename "$bin")
  mkdir -p "$OUT/bin/$label"
  cp "$bin" "$OUT/bin/$label/pipe"
  pipe=$OUT/bin/$label/pipe
  run_and_poll "$OUT/drain-$label.txt" "$OUT/drain.txt" "$label" \
    train --stages 4 --replicas 2 --epochs 2 --partition 0-2,3-4,5-6,7-9 --momentum 0.6 \
    --placement processes --transport shm
done
rm -rf "$OUT/bin"

python3 - "$OUT" <<'PY'
import collections, statistics, sys
out = sys.argv[1]
single = collections.defaultdict(list)
for line in open(f"{out}/single.txt"):
    _, b, c, kb = line.split()
    single[(b, c)].append(int(kb) / 1024)
print("| binary | peak resident MiB, no checkpoint (median of rounds) | with a checkpoint written | the checkpoint's cost MiB | `pipe eval` of the checkpoint |")
print("|---|---|---|---|---|")
for b in dict.fromkeys(k[0] for k in single):
    none, written = statistics.median(single[(b, "none")]), statistics.median(single[(b, "written")])
    read = statistics.median(single[(b, "read")])
    print(f"| {b} | {none:.0f} | {written:.0f} | {written - none:+.0f} | {read:.0f} |")
print()
drain = collections.defaultdict(dict)
for line in open(f"{out}/drain.txt"):
    b, w, kb = line.split()
    drain[b][int(w)] = int(kb) / 1024
print("| binary | " + " | ".join(f"w{w} peak MiB" for w in range(8)) + " |")
print("|---|" + "---|" * 8)
for b, peaks in drain.items():
    print(f"| {b} | " + " | ".join(f"{peaks.get(w, 0):.0f}" for w in range(8)) + " |")
PY
