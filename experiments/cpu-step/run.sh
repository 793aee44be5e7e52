#!/usr/bin/env bash
# The CPU training step side by side: pipe's GPT-2 and transformers' GPT2LMHeadModel, eager and
# under torch.compile, at the same shape (8 blocks, 128 positions, the 1,024-token BPE of Tiny
# Shakespeare; width W with W/32 heads), batch 16 windows per update, AdamW, clipping at 1.0,
# f32, 2 threads, in alternating rounds: one call, one machine.
#
#   pipe train --model gpt2 --n-layer 8 --n-embd W --n-head W/32 --n-positions 128 \
#     --dataset tokens:CORPUS --microbatch-size 16 --microbatches 1 --threads 2 \
#     --weight-decay-groups all --steps S+5
#
# with S = 40 x 128 / W steps. pipe's figure is its epoch line's tokens/s (its first updates
# included); PyTorch's times S steps after 5 of warm-up (and compilation). Needs python with torch, transformers and numpy
# (PYTHON, default python3); not part of CI.
#
#   experiments/cpu-step/run.sh [ROUNDS]        # default 3; WIDTHS="128 256 512"
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
python=${PYTHON:-python3}
widths=${WIDTHS:-128 256 512}
. experiments/corpus.sh
. experiments/lib.sh
# The same ids for PyTorch, as uint16, in corpus order (one document: the whole text).
"$python" - "$work" <<'PY'
import json, sys
from tokenizers import Tokenizer
work = sys.argv[1]
tok = Tokenizer.from_file(f"{work}/corpus/tokenizer.json")
ids = tok.encode(open("data/tinyshakespeare.txt", encoding="utf-8").read()).ids
import numpy as np
np.array(ids, dtype=np.uint16).tofile(f"{work}/tokens.u16")
PY
echo "| width | round | pipe tokens/s | eager tokens/s | compiled tokens/s |"
echo "|---|---|---|---|---|"
for w in $widths; do
  heads=$((w / 32))
  steps=$((40 * 128 / w))
  for r in $(seq 1 "$rounds"); do
    "$pipe" train --model gpt2 --n-layer 8 --n-embd "$w" --n-head "$heads" --n-positions 128 \
      --dataset "tokens:$work/corpus" --microbatch-size 16 --microbatches 1 --threads 2 \
      --weight-decay-groups all --steps $((steps + 5)) > "$work/pipe.txt" 2>&1
    p=$(epoch_rate "$work/pipe.txt" tokens/s)
    peer=("$python" experiments/cpu-step/peer.py --tokens "$work/tokens.u16" --width "$w"
          --heads "$heads" --steps "$steps")
    e=$("${peer[@]}" | awk '{print $1}')
    c=$("${peer[@]}" --compile 2>/dev/null | awk '{print $1}')
    echo "$w $p $e $c" >> "$work/rates"
    echo "| $w | $r | $p | $e | $c |"
  done
done
"$python" - "$work/rates" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    w, p, e, c = line.split()
    rows.setdefault(int(w), []).append((float(p), float(e), float(c)))
print()
print("| width | pipe / eager (median of pairs) | pipe / compiled (median of pairs) |")
print("|---|---|---|")
for w, rs in sorted(rows.items()):
    pe = statistics.median(p / e for p, e, _ in rs)
    pc = statistics.median(p / c for p, _, c in rs)
    print(f"| {w} | {pe:.2f} | {pc:.2f} |")
PY
