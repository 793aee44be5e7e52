#!/usr/bin/env bash
# pipe's memory model for workers that are threads of one process (pipe train's default
# placement): the header's "memory estimate ... this process" beside the process's measured
# peak (VmHWM, from /usr/bin/time), for two GPT-2s at 4 stages on the 1,024-token BPE of Tiny
# Shakespeare:
#   - the recomputation experiment's (8 blocks of width 128, 128 positions, 4 sequences per
#     microbatch, --partition flops, 40 updates);
#   - gpt2-small's shape (86.6 M parameters with this vocabulary, 1,024 positions, 2 sequences
#     per microbatch, --partition 0-3,4-6,7-9,10-14, 3 updates, 8 evaluation windows).
#
#   experiments/memory/threads.sh [ROUNDS] > experiments/memory/threads.md
#
# ROUNDS (default 1): the median VmHWM over rounds (the estimate does not vary).
set -euo pipefail
rounds=${1:-1}
cd "$(dirname "$0")/../.."
. experiments/corpus.sh
cases=(
  "gpt2-8x128|--model gpt2 --n-layer 8 --n-embd 128 --n-head 4 --n-positions 128 --threads 1 --partition flops --steps 40 --microbatch-size 4"
  "gpt2-small|--model gpt2-small --partition 0-3,4-6,7-9,10-14 --steps 3 --microbatch-size 2 --eval-windows 8"
)
echo "# pipe's memory model for worker threads"
echo
echo "\`experiments/memory/threads.sh $rounds\`: the run header's estimate for the whole process beside its"
echo "measured VmHWM (median of $rounds rounds), $(date -u +%Y-%m-%d), commit $(git rev-parse --short HEAD), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores."
echo "Every run: --dataset tokens (the 1,024-token BPE of Tiny Shakespeare), --stages 4, threads."
echo
echo "| model | estimate MiB | VmHWM MiB (each round) | estimate / measured |"
echo "|---|---|---|---|"
for c in "${cases[@]}"; do
  label=${c%%|*}
  read -r -a flags <<< "${c#*|}"
  kbs=()
  for r in $(seq 1 "$rounds"); do
    /usr/bin/time -f "maxrss_kb %M" "$pipe" train --dataset "tokens:$work/corpus" --stages 4 \
      "${flags[@]}" > "$work/$label.txt" 2>&1
    kbs+=("$(sed -n 's/^maxrss_kb //p' "$work/$label.txt")")
  done
  est=$(sed -n 's/^memory estimate (MiB, peak resident): this process \([0-9.]*\).*/\1/p' "$work/$label.txt")
  python3 - "$label" "$est" "${kbs[@]}" <<'PY'
import statistics, sys
label, est, kbs = sys.argv[1], float(sys.argv[2]), [int(k) for k in sys.argv[3:]]
ms = [k / 1024 for k in kbs]
m = statistics.median(ms)
each = ", ".join(f"{x:.1f}" for x in ms)
print(f"| {label} | {est:.1f} | {m:.1f} ({each}) | {est / m:.2f} |")
PY
done
