#!/usr/bin/env bash
# Loss agreement of pipe with PyTorch on GPT-2: pipe trains 20 updates on a token corpus, and
# experiments/gpu/loss_peer.py trains the same model in PyTorch from the same update-0 weights
# on the same windows in the same order; every update's training loss must agree (2% relative
# in bf16, 1e-3 in f32). Needs python3 with torch; no transformers.
#
#   bash experiments/gpu/loss_check.sh PIPE CORPUS [OUT]
#
# PIPE is a pipe binary, CORPUS a `pipe tokenize` directory; the model's vocabulary is the
# corpus's. A CORPUS that does not exist yet is made, from the repository root's
# data/tinyshakespeare.txt (run from there), with the repository's 1,024-token BPE padded to
# GPT-2's 50,257 tokens (wide_vocab.py), so gpt2-small is GPT-2 124M: 459,914 ids, 404
# training windows of 1,024 tokens, enough for 33 updates of 12. OUT (default ./loss-check)
# receives pipe's output and log, the export and table.md.
#
# Settings, from the environment: BACKEND (cuda), PRECISION (bf16), MODEL (gpt2-small),
# STEPS (20), MICROBATCH (4), MICROBATCHES (3), LR (6e-4), THREADS (pipe's CPU threads, 0:
# all). pipe's optimizer settings are given on its command line and passed to loss_peer.py
# alike: AdamW, weight decay 0.1 on the matrices, clipping to norm 1.0, cosine schedule with a
# warm-up of 2 updates (the peer reads each update's rate from pipe's log), sequential window
# order, holdout tail:0.1; betas 0.9 and 0.999 and eps 1e-8 are pipe's defaults (it has no
# flags for them, only config-file keys). pipe evaluates 4 validation windows at the end
# (--eval-windows 4), which keeps the CPU check short and changes no training window.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pipe="$(realpath "${1:?usage: loss_check.sh PIPE CORPUS [OUT]}")"
corpus="$(realpath -m "${2:?usage: loss_check.sh PIPE CORPUS [OUT]}")"
out="${3:-./loss-check}"
backend="${BACKEND:-cuda}"
precision="${PRECISION:-bf16}"
steps="${STEPS:-20}"
mb="${MICROBATCH:-4}"
mbs="${MICROBATCHES:-3}"
device=cuda
[[ $backend == cpu ]] && device=cpu
mkdir -p "$out"
rm -rf "$out/seed" "$out/hf0"
if [[ ! -e $corpus ]]; then
  echo "== making $corpus: data/tinyshakespeare.txt, BPE of 1,024 tokens padded to 50,257"
  python3 "$here/wide_vocab.py" data/tokenizers/shakespeare-bpe-1024.json > "$out/wide.json"
  "$pipe" tokenize --tokenizer "$out/wide.json" --input data/tinyshakespeare.txt --out "$corpus"
fi
model=(--model "${MODEL:-gpt2-small}" --dataset "tokens:$corpus" --seed 0)
train=(--steps "$steps" --microbatch-size "$mb" --microbatches "$mbs" --optimizer adamw
       --lr "${LR:-6e-4}" --lr-schedule cosine --warmup-steps 2 --weight-decay 0.1
       --weight-decay-groups matrices --grad-clip 1.0
       --data-order sequential --holdout tail:0.1 --eval-windows 4)
[[ ${THREADS:-0} != 0 ]] && train+=(--threads "$THREADS")

echo "== pipe: update-0 weights (--seed-checkpoint), exported for PyTorch"
"$pipe" train "${model[@]}" "${train[@]}" --checkpoint-dir "$out/seed" --seed-checkpoint \
  > "$out/seed.txt"
"$pipe" export --checkpoint "$out/seed" --format hf --out "$out/hf0" | tee "$out/export.txt"

echo "== pipe: $steps updates, --backend $backend --precision $precision"
rm -f "$out/pipe.jsonl"
timeout 600 "$pipe" train "${model[@]}" "${train[@]}" --init-from "$out/hf0" \
  --backend "$backend" --precision "$precision" --log-jsonl "$out/pipe.jsonl" \
  > "$out/train.txt" 2>&1 || { tail -20 "$out/train.txt"; exit 1; }
head -3 "$out/train.txt"

echo "== PyTorch: experiments/gpu/loss_peer.py"
set +e
timeout 600 python3 "$here/loss_peer.py" --hf "$out/hf0" --corpus "$corpus" \
  --log "$out/pipe.jsonl" --steps "$steps" --microbatch "$mb" --microbatches "$mbs" \
  --holdout 0.1 --beta1 0.9 --beta2 0.999 --eps 1e-8 --weight-decay 0.1 \
  --weight-decay-groups matrices --clip 1.0 --precision "$precision" --device "$device" \
  ${THREADS:+--threads "$THREADS"} | tee "$out/table.md"
status=${PIPESTATUS[0]}
exit "$status"
