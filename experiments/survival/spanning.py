#!/usr/bin/env python3
"""What a recovery costs, wherever in its update the loss fell: for each killed run of a
seen.sh (or niced.sh) folder, the interval between the update records either side of the
loss seen, less the same build's undisturbed median interval in that repetition (the
"excess"). seen.py's "loss seen to the next update" is that interval less the time from the
last record to the loss, so a loss just after a record needs an excess under one update
time to meet the bound of two.

    python3 experiments/survival/spanning.py OUTDIR
"""

import glob
import json
import statistics
import sys


def records(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f]


def median_interval(path: str) -> float:
    t = [r["elapsed_s"] for r in records(path) if r.get("kind") == "step"]
    return statistics.median(b - a for a, b in zip(t, t[1:]))


def main() -> None:
    out = sys.argv[1]
    print("| build | loss into its update ms | loss seen to the next update ms | undisturbed"
          " interval ms | excess ms |")
    print("|---|---|---|---|---|")
    summary = []
    for build in ("old", "new"):
        rows = []
        for path in sorted(glob.glob(f"{out}/{build}-[257]*-*.jsonl")):
            rep = path.rsplit("-", 1)[1].split(".")[0]
            calm = median_interval(f"{out}/{build}-calm-{rep}.jsonl")
            every = records(path)
            seen = next(r["elapsed_s"] for r in every if r.get("kind") == "lost")
            steps = [r["elapsed_s"] for r in every if r.get("kind") == "step"]
            last = max(t for t in steps if t <= seen)
            following = min(t for t in steps if t > seen)
            rows.append(((seen - last) * 1e3, (following - seen) * 1e3, calm * 1e3))
        for into, to_next, calm in sorted(rows):
            print(f"| {build} | {into:.0f} | {to_next:.0f} | {calm:.1f} | {into + to_next - calm:.1f} |")
        excess = [into + to_next - calm for into, to_next, calm in rows]
        summary.append((build, statistics.median(excess), min(excess), max(excess)))
    print()
    for build, med, lo, hi in summary:
        print(f"{build}: excess median {med:.1f} ms ({lo:.1f} to {hi:.1f})")


if __name__ == "__main__":
    main()
