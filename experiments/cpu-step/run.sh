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
# PRECISIONS lists the precisions pipe runs in, each round, one column each: f32 (the default),
# and bf16x6 or bf16x3 on a CPU with AMX tiles (f32's accuracy, or about 16 bits, from bf16
# tile products; `--precision`). PyTorch computes in f32 in every case (on the CPU its
# float32_matmul_precision "high" is f32 too: experiments/cpu-step/torch_precision.py).
#
# An entry P+cblas runs P with the f32 products by the CBLAS library CBLAS names (PIPE_CBLAS:
# oneMKL's libmkl_rt, OpenBLAS; `docs/training.md`, "An external BLAS").
#
#   experiments/cpu-step/run.sh [ROUNDS]        # default 3; WIDTHS="128 512 768"
#   PRECISIONS="f32 bf16x6" experiments/cpu-step/run.sh 2
#   CBLAS=.../libmkl_rt.so.3 PRECISIONS="f32 f32+cblas" experiments/cpu-step/run.sh 2
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
python=${PYTHON:-python3}
widths=${WIDTHS:-128 512 768}
precisions=${PRECISIONS:-f32}
. experiments/corpus.sh
. experiments/lib.sh
for p in $precisions; do pipe_cblas "$p" > /dev/null; done
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
pipe_heads=$(for p in $precisions; do printf ' pipe %s tokens/s |' "$p"; done)
pipe_mfus=$(for p in $precisions; do printf ' pipe %s MFU |' "$p"; done)
n=$(echo $precisions | wc -w)
echo "| width | round |$pipe_heads eager tokens/s | compiled tokens/s | GEMM GFLOP/s |$pipe_mfus eager MFU | compiled MFU |"
echo "|---|---|$(printf '%.0s---|' $(seq $((2 * n + 5))))"
for w in $widths; do
  heads=$((w / 32))
  steps=$((40 * 128 / w))
  steps=$((steps < 6 ? 6 : steps))
  for r in $(seq 1 "$rounds"); do
    rates=()
    for precision in $precisions; do
      PIPE_CBLAS=$(pipe_cblas "$precision") \
      "$pipe" train --model gpt2 --n-layer 8 --n-embd "$w" --n-head "$heads" --n-positions 128 \
        --dataset "tokens:$work/corpus" --microbatch-size 16 --microbatches 1 --threads 2 \
        --weight-decay-groups all --steps $((steps + 5)) \
        --precision "$(pipe_precision "$precision")" \
        --log-jsonl "$work/pipe.jsonl" > "$work/pipe.txt" 2>&1
      params=$(sed -n 's/.*model gpt2 (\([0-9]*\) parameters).*/\1/p' "$work/pipe.txt")
      rates+=("$(python3 - "$work/pipe.jsonl" 5 $((16 * 128)) <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1])]
t = [r["elapsed_s"] for r in steps if r.get("kind") == "step"]
skip, tokens = int(sys.argv[2]), int(sys.argv[3])
print(f"{(len(t) - skip) * tokens / (t[-1] - t[skip - 1]):.0f}")
PY
)")
    done
    peer=("$python" experiments/cpu-step/peer.py --tokens "$work/tokens.u16" --width "$w"
          --heads "$heads" --steps "$steps")
    e=$("${peer[@]}" | awk '{print $1}')
    c=$("${peer[@]}" --compile 2>/dev/null | awk '{print $1}')
    "$pipe" bench mfu --model mlp-64-64-10 --batch 16 --steps 1 --json "$work/gemm.json" > /dev/null
    g=$(python3 -c 'import json, sys; print(round(json.load(open(sys.argv[1]))["gemm_gflops"]))' "$work/gemm.json")
    echo "$w $e $c $g $params ${rates[*]}" >> "$work/rates"
    python3 - "$w" "$e" "$c" "$g" "$params" "$r" "${rates[@]}" <<'PY'
import sys
w, e, c, g, params, r, *pipe = sys.argv[1:]
per_token = 6 * int(params) + 12 * 8 * 128 * int(w)
mfu = lambda x: f"{float(x) * per_token / (float(g) * 1e9):.2f}"
print(f"| {w} | {r} | " + " | ".join(pipe) + f" | {e} | {c} | {g} | "
      + " | ".join(mfu(x) for x in pipe + [e, c]) + " |")
PY
  done
done
"$python" - "$work/rates" $precisions <<'PY'
import statistics, sys
precisions = sys.argv[2:]
rows = {}
for line in open(sys.argv[1]):
    w, e, c, _, _, *pipe = line.split()
    rows.setdefault(int(w), []).append((float(e), float(c), [float(p) for p in pipe]))
print()
print("| width | precision | pipe / eager (median of pairs) | pipe / compiled (median of pairs) |")
print("|---|---|---|---|")
for w, rs in sorted(rows.items()):
    for i, precision in enumerate(precisions):
        pe = statistics.median(p[i] / e for e, _, p in rs)
        pc = statistics.median(p[i] / c for _, c, p in rs)
        print(f"| {w} | {precision} | {pe:.2f} | {pc:.2f} |")
PY
