#!/usr/bin/env python3
"""What the non-finite guard on weights costs: two builds of pipe, BEFORE (without it) and
AFTER, side by side in one sitting, ROUNDS alternating rounds of
  - `pipe bench mfu` (the MLP, mlp-784-1024x16-10, batch 256: samples/s),
  - `pipe bench mfu --model gpt-small --batch 8` (a GPT of 8 blocks, width 256, 8 windows of
    128 tokens: samples/s),
  - `pipe train` of the GPT-2 of 8 blocks, width 128, 4 heads, 128 positions ("gpt2 8x128",
    as experiments/memory/threads.sh names it), 8 windows a step, 30 steps on 2 threads: the
    run's samples/s from its log.
Prints each figure's median per build and the median of the rounds' after/before ratios.

  experiments/finite-guard/run.py BEFORE_BIN AFTER_BIN [ROUNDS]    # default 5 rounds
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

before, after = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
scratch = tempfile.mkdtemp(prefix="pipe-finite-guard-")

GPT2 = ["--model", "gpt2", "--n-layer", "8", "--n-embd", "128", "--n-head", "4",
        "--n-positions", "128"]


def mfu(binary, extra):
    out = os.path.join(scratch, "mfu.json")
    subprocess.run([binary, "bench", "mfu", *extra, "--json", out], check=True,
                   stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["samples_per_s"]


def train(binary):
    log = os.path.join(scratch, "log.jsonl")
    if os.path.exists(log):
        os.remove(log)
    subprocess.run([binary, "train", *GPT2, "--microbatch-size", "8", "--steps", "30",
                    "--threads", "2", "--log-jsonl", log], check=True,
                   stdout=subprocess.DEVNULL)
    steps = [json.loads(line) for line in open(log)]
    rates = [s["samples_per_sec"] for s in steps if "samples_per_sec" in s]
    return rates[-1]


figures = {
    "bench mfu, MLP samples/s": lambda b: mfu(b, []),
    "bench mfu, gpt-small batch 8 samples/s": lambda b: mfu(b, ["--model", "gpt-small", "--batch", "8"]),
    "train, gpt2 8x128 samples/s": train,
}
got = {name: {"before": [], "after": []} for name in figures}
for r in range(rounds):
    for name, measure in figures.items():
        for side, binary in (("before", before), ("after", after)):
            got[name][side].append(measure(binary))
            print(f"round {r + 1}: {name}, {side}: {got[name][side][-1]:.4g}", file=sys.stderr)

print(f"{rounds} alternating rounds; before = {before}, after = {after}\n")
print("| figure | before (median) | after (median) | after / before (median of rounds) | rounds' ratios |")
print("|---|---|---|---|---|")
for name, sides in got.items():
    ratios = [a / b for a, b in zip(sides["after"], sides["before"])]
    print(f"| {name} | {statistics.median(sides['before']):.4g} | "
          f"{statistics.median(sides['after']):.4g} | {statistics.median(ratios):.3f} | "
          f"{', '.join(f'{x:.3f}' for x in ratios)} |")
