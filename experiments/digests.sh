#!/bin/bash
# The final-weight digests a refactor must leave unchanged: the README quick start, a
# replicated pipeline in process and over QUIC, gpt-mini, and a checkpoint resume.
#   bash experiments/digests.sh [PIPE]      (default target/release/pipe)
set -uo pipefail
B=$(realpath "${1:-target/release/pipe}")
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
cd "$D"
P="--partition 0-2,3-4,5-6,7-9"
d() { grep -o "weights [0-9a-f]*" | tail -1; }
echo "quick start: $($B train 2>&1 | d)"
echo "quick start, --schedule sequential: $($B train --schedule sequential 2>&1 | d)"
echo "4x2: $($B train --stages 4 --replicas 2 --epochs 1 $P 2>&1 | d)"
echo "4x2 quic: $($B train --stages 4 --replicas 2 --epochs 1 --transport quic $P 2>&1 | d)"
echo "gpt-mini 50: $($B train --model gpt-mini --steps 50 2>&1 | d)"
echo "gpt-mini 50 sequential: $($B train --model gpt-mini --schedule sequential --steps 50 2>&1 | d)"
echo "gpt-mini 4 stages 50: $($B train --model gpt-mini --stages 4 --steps 50 2>&1 | d)"
$B train --stages 4 --replicas 2 --epochs 1 $P --checkpoint-dir ck --checkpoint-every 100 > /dev/null 2>&1
echo "resume: $($B train --stages 4 --replicas 2 --epochs 2 $P --checkpoint-dir ck --resume latest 2>&1 | d)"
$B train --stages 4 --replicas 2 --epochs 1 $P --transport quic --checkpoint-dir ckq --checkpoint-every 100 > /dev/null 2>&1
echo "resume quic: $($B train --stages 4 --replicas 2 --epochs 2 $P --transport quic --checkpoint-dir ckq --resume latest 2>&1 | d)"
