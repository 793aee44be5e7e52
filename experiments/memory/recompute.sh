#!/usr/bin/env bash
# What --recompute saves: each worker process's peak resident memory (VmHWM) and the run's
# throughput, for a GPT-2 of 8 blocks, width 128, 4 heads, 128 positions on the 1,024-token
# BPE of Tiny Shakespeare, at 4 stages under pipedream with worker processes (one thread each):
#
#   pipe train --model gpt2 --n-layer 8 --n-embd 128 --n-head 4 --n-positions 128 \
#     --dataset tokens:CORPUS --stages 4 --schedule pipedream --placement processes \
#     --threads 1 --partition flops --steps 40 --microbatch-size 4 --recompute KIND \
#     --weight-decay-groups all
#
# Each `pipe worker` process's VmHWM is read from /proc every 0.1 s while the run lasts (it
# only grows, so the last reading is its peak up to the last 0.1 s). Rounds alternate the
# kinds; the table gives per worker the median over rounds, and the median tokens/s.
#
# MICROBATCH sets the sequences per microbatch (default 4, the gpt2 models' default). The
# kinds are none, full, selective, and full on the first two stages only (full,full,none,none:
# per stage, where the first stages hold the most microbatches in flight).
#
#   experiments/memory/recompute.sh [ROUNDS]        # default 2
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-2}
. experiments/corpus.sh
. experiments/lib.sh
args=(train --model gpt2 --n-layer 8 --n-embd 128 --n-head 4 --n-positions 128
      --dataset "tokens:$work/corpus" --stages 4 --schedule pipedream --placement processes
      --threads 1 --partition flops --steps 40 --microbatch-size "${MICROBATCH:-4}"
      --weight-decay-groups all)
. experiments/memory/lib.sh
for r in $(seq 1 "$rounds"); do
  for kind in none full selective full,full,none,none; do
    run_and_poll "$work/$kind-$r.txt" "$work/peaks" "$kind" "${args[@]}" --recompute "$kind"
    rate=$(epoch_rate "$work/$kind-$r.txt" tokens/s)
    digest=$(final_digest "$work/$kind-$r.txt")
    echo "$kind $rate $digest" >> "$work/rates"
  done
done
python3 - "$work/peaks" "$work/rates" <<'PY'
import statistics, sys
peaks, rates, digests = {}, {}, {}
for line in open(sys.argv[1]):
    kind, w, kb = line.split()
    peaks.setdefault((kind, int(w)), []).append(int(kb) / 1024)
for line in open(sys.argv[2]):
    kind, rate, digest = line.split()
    rates.setdefault(kind, []).append(float(rate))
    digests.setdefault(kind, set()).add(digest)
kinds = ["none", "full", "selective", "full,full,none,none"]
workers = sorted({w for _, w in peaks})
print("| worker | " + " | ".join(f"VmHWM MiB, {k}" for k in kinds) + " | " + " | ".join(f"{k} against none" for k in kinds[1:]) + " |")
print("|---" * (2 * len(kinds)) + "|")
for w in workers:
    med = {k: statistics.median(peaks[(k, w)]) for k in kinds if (k, w) in peaks}
    cells = " | ".join(f"{med[k]:.1f}" for k in kinds)
    ratios = " | ".join(f"{med[k] / med['none']:.2f}" for k in kinds[1:])
    print(f"| {w} | {cells} | {ratios} |")
print()
print("| recompute | median tokens/s | time against none | weights |")
print("|---|---|---|---|")
base = statistics.median(rates["none"])
for k in kinds:
    m = statistics.median(rates[k])
    print(f"| {k} | {m:.0f} | {base / m:.2f}x | {', '.join(sorted(digests[k]))} |")
PY
