#!/usr/bin/env bash
# The single-worker MLP step beside PyTorch on the CPU: `pipe bench mfu` (mlp-784-1024x16-10,
# batch 256, plain SGD, 2 threads: median of 20 timed steps after 3) and the same model, batch,
# loss and optimizer through experiments/gpu/peer.py on the CPU with 2 threads (median of 20
# after 3), in alternating rounds. Needs python with torch (PYTHON, default python3).
# PRECISIONS lists pipe's precisions, one column each (default f32; bf16x6 and bf16x3 on a CPU
# with AMX; P+cblas for P with the f32 products by the CBLAS library CBLAS names, as in run.sh).
#
#   experiments/cpu-step/mlp.sh [ROUNDS]       # default 3
#   PRECISIONS="f32 bf16x3" experiments/cpu-step/mlp.sh 5
#   CBLAS=.../libmkl_rt.so.3 PRECISIONS="f32 f32+cblas" experiments/cpu-step/mlp.sh 5
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
python=${PYTHON:-python3}
. experiments/lib.sh
cargo build --release --locked --quiet --bin pipe
pipe=$PWD/target/release/pipe
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "## $(lscpu | sed -n 's/^Model name: *//p')"
echo
precisions=${PRECISIONS:-f32}
for p in $precisions; do pipe_cblas "$p" > /dev/null; done
heads=$(for p in $precisions; do printf ' pipe %s samples/s |' "$p"; done)
ratios=$(for p in $precisions; do printf ' pipe %s / PyTorch |' "$p"; done)
n=$(echo $precisions | wc -w)
echo "| round |$heads PyTorch samples/s |$ratios"
echo "|---|$(printf '%.0s---|' $(seq $((2 * n + 1))))"
for r in $(seq 1 "$rounds"); do
  for p in $precisions; do
    PIPE_CBLAS=$(pipe_cblas "$p") "$pipe" bench mfu --threads 2 \
      --precision "$(pipe_precision "$p")" --json "$work/pipe-$p.json" > /dev/null
  done
  "$python" experiments/gpu/peer.py --device cpu --threads 2 \
    --case mlp-784-1024x16-10:256:f32 > "$work/torch.json"
  python3 - "$work" "$r" $precisions <<'PY' | tee -a "$work/rows"
import json, sys
work, r, *precisions = sys.argv[1:]
p = [json.load(open(f"{work}/pipe-{x}.json"))["samples_per_s"] for x in precisions]
t = json.loads(open(f"{work}/torch.json").read().splitlines()[-1])["samples_per_s"]
print(f"| {r} | " + " | ".join(f"{x:.0f}" for x in p) + f" | {t:.0f} | "
      + " | ".join(f"{x / t:.2f}" for x in p) + " |")
PY
done
python3 - "$work/rows" $precisions <<'PY'
import statistics, sys
rows, precisions = sys.argv[1], sys.argv[2:]
cells = [[c.strip() for c in l.strip().strip("|").split("|")] for l in open(rows)]
print()
for i, p in enumerate(precisions):
    ratios = [float(c[-len(precisions) + i]) for c in cells]
    print(f"median pipe {p} / PyTorch: {statistics.median(ratios):.2f}")
PY
