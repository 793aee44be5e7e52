#!/usr/bin/env bash
# Packed documents (`--pack-documents`) on the GPU: the attention kernels' document masks and
# the cross-entropy's ignored labels in training, not only in the backend suite.
#
#   bash experiments/gpu/documents_check.sh PIPE CORPUS [OUT]
#
# PIPE is a pipe binary; CORPUS a `pipe tokenize` directory of many documents, each ending with
# the tokenizer's end-of-text id. A CORPUS that does not exist yet is made, from the repository
# root's data/tinyshakespeare.txt (run from there) cut into documents of 200 lines, in the
# repository's 1,024-token BPE. OUT (default ./documents-check) receives the logs.
#
# 1. gpt-mini (head width 32: the SIMT tiled kernels) in f32, packed, from the same seed on the
#    CPU and on the GPU: every update's training loss must agree within 1e-3 relative (f32 on
#    two backends; the loss check's f32 bound).
# 2. gpt2-small at this vocabulary (head width 64: the tensor-core kernels) in bf16, packed,
#    for STEPS (30) updates: the last update's loss must be below the first's.
#
# GPU_BACKEND (cuda) names the backend of the GPU runs: `GPU_BACKEND=cpu` runs the script's
# logic on a machine without one (both sides then compute alike).
set -euo pipefail
pipe="$(realpath "${1:?usage: documents_check.sh PIPE CORPUS [OUT]}")"
corpus="$(realpath -m "${2:?usage: documents_check.sh PIPE CORPUS [OUT]}")"
out="${3:-./documents-check}"
gpu="${GPU_BACKEND:-cuda}"
steps="${STEPS:-30}"
mkdir -p "$out"
if [[ ! -e $corpus ]]; then
  echo "== making $corpus: data/tinyshakespeare.txt in documents of 200 lines, BPE of 1,024"
  docs="$(mktemp -d)"
  split -l 200 -d -a 4 --additional-suffix=.txt data/tinyshakespeare.txt "$docs/doc-"
  "$pipe" tokenize --tokenizer data/tokenizers/shakespeare-bpe-1024.json --input "$docs" \
    --out "$corpus"
  rm -rf "$docs"
fi
packed=(--dataset "tokens:$corpus" --pack-documents --seed 0 --eval-windows 4)

run() {
  local name=$1
  shift
  rm -f "$out/$name.jsonl"
  timeout 300 "$pipe" train "${packed[@]}" --log-jsonl "$out/$name.jsonl" "$@" \
    > "$out/$name.txt" 2>&1 || { tail -20 "$out/$name.txt"; return 1; }
  grep -m1 "packed documents" "$out/$name.txt" || { echo "$name: not packed"; return 1; }
}

mini=(--model gpt-mini --steps 20 --microbatch-size 8 --microbatches 2)
echo "== gpt-mini, f32, packed: the CPU against --backend $gpu"
run mini-cpu "${mini[@]}" --backend cpu
run mini-gpu "${mini[@]}" --backend "$gpu"
gpt2_precision=bf16
[[ $gpu == cpu ]] && gpt2_precision=f32
echo "== gpt2-small, $gpt2_precision, packed: $steps updates on --backend $gpu"
run gpt2 --model gpt2-small --steps "$steps" --microbatch-size 4 --microbatches 2 \
  --optimizer adamw --lr 6e-4 --backend "$gpu" --precision "$gpt2_precision"

python3 - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
def losses(name):
    with open(f"{out}/{name}.jsonl") as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]
cpu, gpu, gpt2 = losses("mini-cpu"), losses("mini-gpu"), losses("gpt2")
ok = len(cpu) == len(gpu) > 0 and len(gpt2) > 1
worst = max((abs(a - b) / abs(a) for a, b in zip(cpu, gpu)), default=float("inf"))
print("| update | loss on the CPU | loss on the GPU | relative |")
print("|---|---|---|---|")
for i, (a, b) in enumerate(zip(cpu, gpu)):
    print(f"| {i + 1} | {a:.6f} | {b:.6f} | {abs(a - b) / abs(a):.2e} |")
print(f"gpt2-small packed: loss {gpt2[0]:.4f} at update 1, {gpt2[-1]:.4f} at update {len(gpt2)}"
      if len(gpt2) > 1 else "gpt2-small packed: no losses logged")
ok = ok and worst <= 1e-3 and gpt2[-1] < gpt2[0]
print(f"{'PASS' if ok else 'FAIL'}: gpt-mini worst relative difference {worst:.2e} (bound 1e-3); "
      f"gpt2-small's loss {'falls' if len(gpt2) > 1 and gpt2[-1] < gpt2[0] else 'does not fall'}")
sys.exit(0 if ok else 1)
EOF
