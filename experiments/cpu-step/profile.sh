#!/usr/bin/env bash
# Where one GPT-2 training step's time goes, pipe beside PyTorch, by kernel class: pipe's
# `bench mfu --breakdown` (every backend operation timed, the threads waited for after each)
# and torch.profiler's self CPU time over the same step in eager mode (transformers'
# GPT2LMHeadModel, experiments/cpu-step/peer.py --profile; compiled code fuses the classes
# away). Same shape as run.sh: 8 blocks, 128 positions, vocabulary 1,024, 16 windows, AdamW,
# f32, 2 threads. Needs python with torch and transformers (PYTHON, default python3).
#
#   experiments/cpu-step/profile.sh [WIDTH]      # default 512
set -euo pipefail
cd "$(dirname "$0")/../.."
width=${1:-512}
heads=$((width / 32))
python=${PYTHON:-python3}
. experiments/corpus.sh
"$python" - "$work" <<'PY'
import sys
import numpy as np
from tokenizers import Tokenizer
tok = Tokenizer.from_file(f"{sys.argv[1]}/corpus/tokenizer.json")
ids = tok.encode(open("data/tinyshakespeare.txt", encoding="utf-8").read()).ids
np.array(ids, dtype=np.uint16).tofile(f"{sys.argv[1]}/tokens.u16")
PY
echo "## $(lscpu | sed -n 's/^Model name: *//p'), width $width"
echo
echo '### pipe (`pipe bench mfu --breakdown 4`)'
echo
"$pipe" bench mfu --model gpt2 --n-layer 8 --n-embd "$width" --n-head "$heads" \
  --n-positions 128 --vocab-size 1024 --batch 16 --optimizer adamw --steps 4 --breakdown 4 \
  > "$work/pipe.txt"
python3 - "$work/pipe.txt" <<'PY'
import re, sys
classes = [
    ("matrix products", ("matmul", "linear")),
    ("attention", ("attention",)),
    ("LayerNorm", ("layer_norm",)),
    ("GELU", ("activation",)),
    ("softmax and cross-entropy", ("softmax",)),
    ("optimizer and clipping", ("adam", "sum_squares", "scale", "first_non_finite")),
    ("copies and allocation", ("copy", "place", "embedding", "transpose", "fill")),
]
by, wall = {}, ""
for line in open(sys.argv[1]):
    if line.startswith("step (median)"):
        wall = line.split()[2]
    m = re.match(r"\s+(\S+).*?([\d.]+) calls\s+([\d.]+) ms", line)
    if not m:
        continue
    op, ms = m.group(1), float(m.group(3))
    cls = next((c for c, keys in classes if any(k in op for k in keys)),
               "other (bias, residual, bias gradients)")
    by[cls] = by.get(cls, 0.0) + ms
total = sum(by.values())
print(f"by kernel class (ms per step, each operation waited for; step median {wall} ms):")
for cls, ms in sorted(by.items(), key=lambda kv: -kv[1]):
    print(f"  {cls:<48} {ms:9.1f} ms {100 * ms / total:5.1f}%")
PY
echo
echo '### PyTorch eager (`peer.py --profile`)'
echo
"$python" experiments/cpu-step/peer.py --tokens "$work/tokens.u16" --width "$width" \
  --heads "$heads" --steps 4 --profile
