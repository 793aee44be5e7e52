#!/usr/bin/env bash
# Time to the first update of a large model, and how silent its start is: the gpt2-small run
# below (86.6 M parameters with the 1,024-token BPE of Tiny Shakespeare, 4 stages, 2 x 1,024
# tokens per microbatch), started twice under a pseudo-terminal with a fresh profile cache:
# the first start measures the layer profile and keeps it, the second reuses it. Each start is
# stopped once its first update has ended (experiments/startup/silence.py).
#
#   pipe train --model gpt2-small --dataset tokens:CORPUS --stages 4 --microbatch-size 2 \
#     --steps 3 --eval-windows 8
#
#   [BASELINE=OTHER/pipe] experiments/startup/run.sh > experiments/startup/results.md
#
# BASELINE names another build of pipe (an earlier release) that is run the same way until it
# prints its measured partition, for the time it took and the cut it chose.
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/corpus.sh
export PIPE_CACHE_DIR=$work/cache
run=(train --model gpt2-small --dataset "tokens:$work/corpus" --stages 4 --microbatch-size 2
     --steps 3 --eval-windows 8)
echo "# Time to the first update: gpt2-small, 4 stages"
echo
echo "\`experiments/startup/run.sh\`, $(date -u '+%Y-%m-%d %H:%M') UTC, commit $(git rev-parse --short HEAD),"
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores. Each start runs under a"
echo "pseudo-terminal and is stopped once its first update has ended; times are seconds from the"
echo "command's start, as its phase lines appeared."
for start in first second; do
  echo
  echo "## The $start start"
  echo
  echo '```'
  python3 experiments/startup/silence.py --label "$start start" --json "$work/figures.jsonl" \
    -- "$pipe" "${run[@]}"
  echo '```'
done
if [ -n "${BASELINE:-}" ]; then
  echo
  echo "## The baseline: $BASELINE ($("$BASELINE" --version 2>/dev/null || echo pipe))"
  echo
  echo '```'
  python3 experiments/startup/silence.py --label baseline --until '^partition .* by measured time' \
    -- "$BASELINE" "${run[@]}"
  echo '```'
fi
echo
python3 - "$work/figures.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| start | first update began | first update ended | longest silence before it ended |")
print("|---|---|---|---|")
for r in rows:
    if r.get("until_s") is not None:
        continue
    fmt = lambda v: "never" if v is None else f"{v:.1f} s"
    print(f"| {r['label']} | {fmt(r['first_update_began_s'])} | {fmt(r['first_update_ended_s'])} | {r['longest_silence_s']:.2f} s |")
PY
