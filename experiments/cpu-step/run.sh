#!/usr/bin/env bash
# The CPU training step side by side: pipe's GPT-2 and transformers' GPT2LMHeadModel, eager and
# under torch.compile, at the same shape (8 blocks, 128 positions, the 1,024-token BPE of Tiny
# Shakespeare; width W with W/32 heads), batch 16 windows per update, AdamW, clipping at 1.0,
# f32, 2 threads, in alternating rounds: one call, one machine.
#
#   pipe train --model gpt2 --n-layer 8 --n-embd W --n-head W/32 --n-positions 128 \
#     --dataset tokens:CORPUS --microbatch-size 16 --microbatches 1 --threads 2 \
#     --weight-decay-groups all --steps S+5 --log-jsonl LOG
#
# with S = 40 x 128 / W steps (at least 6). Both sides exclude their first 5 updates: pipe's
# figure is its last S updates in the step records of LOG, PyTorch's times S steps after 5 of
# warm-up (and compilation). MFU is tokens/s x (6 x parameters + 12 x layers x 128 x W) FLOPs
# per token (attention's scores and weighted sums over the whole square) over the GEMM rate
# `pipe bench mfu` measures on this machine in the same round (256x1024x1024, 2 threads).
# Needs python with torch, transformers and numpy (PYTHON, default python3); not part of CI.
#
#   experiments/cpu-step/run.sh [ROUNDS]        # default 3; WIDTHS="128 512 768"
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
python=${PYTHON:-python3}
widths=${WIDTHS:-128 512 768}
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
echo "| width | round | pipe tokens/s | eager tokens/s | compiled tokens/s | GEMM GFLOP/s | pipe MFU | eager MFU | compiled MFU |"
echo "|---|---|---|---|---|---|---|---|---|"
for w in $widths; do
  heads=$((w / 32))
  steps=$((40 * 128 / w))
  steps=$((steps < 6 ? 6 : steps))
  for r in $(seq 1 "$rounds"); do
    "$pipe" train --model gpt2 --n-layer 8 --n-embd "$w" --n-head "$heads" --n-positions 128 \
      --dataset "tokens:$work/corpus" --microbatch-size 16 --microbatches 1 --threads 2 \
      --weight-decay-groups all --steps $((steps + 5)) --log-jsonl "$work/pipe.jsonl" \
      > "$work/pipe.txt" 2>&1
    params=$(sed -n 's/.*model gpt2 (\([0-9]*\) parameters).*/\1/p' "$work/pipe.txt")
    p=$(python3 - "$work/pipe.jsonl" 5 $((16 * 128)) <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1])]
t = [r["elapsed_s"] for r in steps if r.get("kind") == "step"]
skip, tokens = int(sys.argv[2]), int(sys.argv[3])
print(f"{(len(t) - skip) * tokens / (t[-1] - t[skip - 1]):.0f}")
PY
)
    peer=("$python" experiments/cpu-step/peer.py --tokens "$work/tokens.u16" --width "$w"
          --heads "$heads" --steps "$steps")
    e=$("${peer[@]}" | awk '{print $1}')
    c=$("${peer[@]}" --compile 2>/dev/null | awk '{print $1}')
    "$pipe" bench mfu --model mlp-64-64-10 --batch 16 --steps 1 --json "$work/gemm.json" > /dev/null
    g=$(python3 -c 'import json, sys; print(round(json.load(open(sys.argv[1]))["gemm_gflops"]))' "$work/gemm.json")
    echo "$w $p $e $c $g $params" >> "$work/rates"
    python3 - "$w" "$p" "$e" "$c" "$g" "$params" "$r" <<'PY'
import sys
w, p, e, c, g, params, r = sys.argv[1:]
per_token = 6 * int(params) + 12 * 8 * 128 * int(w)
mfu = [float(x) * per_token / (float(g) * 1e9) for x in (p, e, c)]
print(f"| {w} | {r} | {p} | {e} | {c} | {g} | " + " | ".join(f"{m:.2f}" for m in mfu) + " |")
PY
  done
done
"$python" - "$work/rates" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    w, p, e, c = line.split()[:4]
    rows.setdefault(int(w), []).append((float(p), float(e), float(c)))
print()
print("| width | pipe / eager (median of pairs) | pipe / compiled (median of pairs) |")
print("|---|---|---|")
for w, rs in sorted(rows.items()):
    pe = statistics.median(p / e for p, e, _ in rs)
    pc = statistics.median(p / c for p, _, c in rs)
    print(f"| {w} | {pe:.2f} | {pc:.2f} |")
PY
