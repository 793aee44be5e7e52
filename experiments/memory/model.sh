#!/usr/bin/env bash
# pipe's memory model against measurement: each worker process's estimated peak resident
# memory (the run header's "memory estimate per worker") beside its measured VmHWM, for the
# recomputation experiment's run (a GPT-2 of 8 blocks, width 128, 4 heads, 128 positions on
# the 1,024-token BPE of Tiny Shakespeare, 4 stages under pipedream, worker processes with one
# thread each, 40 updates) at 4 and 16 sequences per microbatch, with and without full
# recomputation, and under 2bw and 1f1b-flush at 4 sequences:
#
#   pipe train --model gpt2 --n-layer 8 --n-embd 128 --n-head 4 --n-positions 128 \
#     --dataset tokens:CORPUS --stages 4 --schedule POLICY --placement processes \
#     --threads 1 --partition flops --steps 40 --microbatch-size B --recompute KIND
#
#   experiments/memory/model.sh [ROUNDS] > experiments/memory/model.md
#
# ROUNDS (default 1): per worker, the median VmHWM over rounds (the estimate does not vary).
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-1}
. experiments/corpus.sh
. experiments/memory/lib.sh
base=(train --model gpt2 --n-layer 8 --n-embd 128 --n-head 4 --n-positions 128
      --dataset "tokens:$work/corpus" --stages 4 --placement processes
      --threads 1 --partition flops --steps 40)
cases=("pipedream 4 none" "pipedream 4 full" "pipedream 16 none" "pipedream 16 full"
       "2bw 4 none" "1f1b-flush 4 none")
for r in $(seq 1 "$rounds"); do
  for c in "${cases[@]}"; do
    read -r policy mb kind <<< "$c"
    label="$policy/$mb/$kind"
    out="$work/${label//\//-}-$r.txt"
    run_and_poll "$out" "$work/peaks" "$label" "${base[@]}" --schedule "$policy" \
      --microbatch-size "$mb" --recompute "$kind"
    sed -n 's/^memory estimate per worker (MiB, peak resident): //p' "$out" | tr ',' '\n' |
      awk -v l="$label" '{print l, substr($1, 2), $2}' >> "$work/estimates"
  done
done
echo "# pipe's memory model against measured peaks"
echo
echo "\`experiments/memory/model.sh $rounds\`: per worker process, the run header's estimate beside"
echo "its measured VmHWM (median of $rounds rounds), $(date -u +%Y-%m-%d), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores."
echo "Worker 0 is the chief (it evaluates at each epoch's end); worker 3 holds the head."
echo
python3 - "$work/peaks" "$work/estimates" <<'PY'
import statistics, sys
peaks, est = {}, {}
for line in open(sys.argv[1]):
    label, w, kb = line.split()
    peaks.setdefault((label, int(w)), []).append(int(kb) / 1024)
for line in open(sys.argv[2]):
    label, w, mib = line.split()
    est[(label, int(w))] = float(mib)
print("| schedule / sequences / recompute | worker | estimate MiB | VmHWM MiB | estimate / measured |")
print("|---|---|---|---|---|")
ratios = []
for key in sorted(peaks, key=lambda k: (k[0].split("/")[0], int(k[0].split("/")[1]), k[0], k[1])):
    m = statistics.median(peaks[key])
    e = est.get(key)
    if e is None:
        continue
    ratios.append(e / m)
    print(f"| {key[0]} | {key[1]} | {e:.1f} | {m:.1f} | {e / m:.2f} |")
inside = sum(1 for r in ratios if 0.9 <= r <= 1.1)
print()
print(f"{inside} of {len(ratios)} workers within 10% (ratios {min(ratios):.2f} to {max(ratios):.2f})")
PY
