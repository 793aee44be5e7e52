#!/usr/bin/env bash
# Optimizers under delay on a GPU: gpt-small (6.4 M parameters) on Tiny Shakespeare with
# --backend cuda, for AdamW, Muon, Lion and SGD with momentum, sequential against 2bw and
# pipedream at 4 stages (one GPU shared by the stages), for each seed of SEEDS (default 1).
# Every run: 2 epochs of the
# 7,842 training windows at 12 sequences per update (microbatch 4 x 3), 1,307 updates, the
# default cosine schedule, and the learning rates the gpt-mini matrix tuned
# (../optimizers-lm.toml; not re-tuned for gpt-small), plus SGD at 0.1 (`sgd-momentum-0.1`),
# as 0.3 diverged on gpt-small even without delay. OPTIMIZERS picks the lanes (default: all).
#
# On the GPU machine, from the binaries experiments/gpu/stage.sh put in .gpu/:
#   bash experiments/staleness/gpt-small-cuda/run.sh [PIPE]
# One lane per optimizer and seed, all at once on the GPU, each its three schedules in turn; a
# lane's runs go to $OUT/runs/OPTIMIZER-sSEED.log, each after a line `=== SCHEDULE`, and
# summary.py turns them into the table.
set -uo pipefail
pipe=${1:-.gpu/pipe}
out=${OUT:-.}/runs
mkdir -p "$out"
LD_LIBRARY_PATH="$("$pipe" doctor gpu --library-path)" && export LD_LIBRARY_PATH
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } >> "$out/device.txt" 2>&1
common=(--backend cuda --model gpt-small --dataset tinyshakespeare --epochs 2
  --microbatch-size 4 --microbatches 3)
declare -A flags=(
  [adamw]="--optimizer adamw --lr 0.004 --weight-decay 0.1"
  [muon]="--optimizer muon --lr 0.016 --momentum 0.95 --weight-decay 0.1"
  [lion]="--optimizer lion --lr 0.0007 --weight-decay 0.3"
  [sgd-momentum]="--optimizer sgd --lr 0.3 --momentum 0.9"
  [sgd-momentum-0.1]="--optimizer sgd --lr 0.1 --momentum 0.9"
)
# SCHEDULES picks each lane's runs (default: sequential 2bw pipedream); POLICY+CORRECTION
# runs POLICY with --delay-correction CORRECTION at its default strength, e.g.
#   SCHEDULES="sequential 2bw 2bw+error-feedback 2bw+dc-asgd 2bw+dc-asgd-adaptive"
lane() {
  local opt=$1 seed=$2 log="$out/$1-s$2.log"
  for schedule in ${SCHEDULES:-sequential 2bw pipedream}; do
    local policy=${schedule%%+*} correction=()
    [ "$policy" != "$schedule" ] && correction=(--delay-correction "${schedule#*+}")
    local layout=(--stages 4 --schedule "$policy" --partition flops "${correction[@]}")
    [ "$schedule" = sequential ] && layout=(--schedule sequential)
    echo "=== $schedule" >> "$log"
    # shellcheck disable=SC2086
    timeout 150 "$pipe" train "${common[@]}" --seed "$seed" ${flags[$opt]} "${layout[@]}" \
      >> "$log" 2>&1
    echo "exit $?" >> "$log"
  done
}
for opt in ${OPTIMIZERS:-adamw muon lion sgd-momentum sgd-momentum-0.1}; do
  for seed in ${SEEDS:-1}; do
    lane "$opt" "$seed" &
  done
done
wait
date -u >> "$out/device.txt"
