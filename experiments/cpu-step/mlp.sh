#!/usr/bin/env bash
# The single-worker MLP step beside PyTorch on the CPU: `pipe bench mfu` (mlp-784-1024x16-10,
# batch 256, plain SGD, 2 threads: median of 20 timed steps after 3) and the same model, batch,
# loss and optimizer through experiments/gpu/peer.py on the CPU with 2 threads (median of 20
# after 3), in alternating rounds. Needs python with torch (PYTHON, default python3).
#
#   experiments/cpu-step/mlp.sh [ROUNDS]       # default 3
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
python=${PYTHON:-python3}
cargo build --release --locked --quiet --bin pipe
pipe=$PWD/target/release/pipe
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "## $(lscpu | sed -n 's/^Model name: *//p')"
echo
echo "| round | pipe samples/s | PyTorch samples/s | pipe / PyTorch |"
echo "|---|---|---|---|"
for r in $(seq 1 "$rounds"); do
  "$pipe" bench mfu --threads 2 --json "$work/pipe.json" > /dev/null
  "$python" experiments/gpu/peer.py --device cpu --threads 2 \
    --case mlp-784-1024x16-10:256:f32 > "$work/torch.json"
  python3 - "$work/pipe.json" "$work/torch.json" "$r" <<'PY' | tee -a "$work/rows"
import json, sys
p = json.load(open(sys.argv[1]))["samples_per_s"]
t = json.loads(open(sys.argv[2]).read().splitlines()[-1])["samples_per_s"]
print(f"| {sys.argv[3]} | {p:.0f} | {t:.0f} | {p / t:.2f} |")
PY
done
python3 - "$work/rows" <<'PY'
import statistics, sys
ratios = [float(l.split("|")[4]) for l in open(sys.argv[1])]
print(f"\nmedian pipe / PyTorch: {statistics.median(ratios):.2f}")
PY
