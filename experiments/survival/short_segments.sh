#!/bin/bash
# A replica lost in segments of one update: `pipe train --stages 2 --replicas 2 --steps 200
# --checkpoint-every 1` (a small synthetic MLP, worker processes over shared memory), rank 3
# killed with SIGKILL as soon as checkpoint 50 exists, RUNS times. Per run: the exit status
# (124: no end within 40 s, a hang), the starts of the workers (1: gone on in place; 2: every
# worker started again from the last drain point), the update the run went on from and the
# final line.
#   RUNS=12 bash experiments/survival/short_segments.sh OUTDIR
set -euo pipefail
OUT=${1:?usage: short_segments.sh OUTDIR}
PIPE=${PIPE:-$PWD/target/release/pipe}
RUNS=${RUNS:-12}
mkdir -p "$OUT"
cd "$OUT"
printf 'epochs = 10000\ndataset = "synthetic"\nmodel = "mlp-64-32x8-10"\nthreads = 1\n\n[synthetic]\ninputs = 64\nclasses = 10\nhidden = 32\ntrain = 2048\ntest = 256\n' > small.toml
for i in $(seq 1 "$RUNS"); do
  rm -rf ck
  (timeout 40 "$PIPE" train --config small.toml --checkpoint-dir ck --steps 200 --stages 2 \
     --replicas 2 --checkpoint-every 1 --keep-checkpoints 300 --transport shm --momentum 0.5 \
     --lr-schedule constant --partition 0-8,9-17 --placement processes > "run-$i.txt" 2>&1
   echo "exit $?" >> "run-$i.txt") &
  run=$!
  until [ -e ck/ckpt-00000050 ]; do sleep 0.005; done
  pkill -9 -f -- '--rank 3 ' || true
  wait "$run"
  echo "$i: $(tail -1 "run-$i.txt"), starts $(grep -c 'the first update (every' "run-$i.txt"), $(grep -o 'from update [0-9]* ([^)]*)' "run-$i.txt" | head -1), $(grep -o 'done: [0-9]* steps' "run-$i.txt" || echo 'no end')"
done
