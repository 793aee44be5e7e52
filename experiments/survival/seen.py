#!/usr/bin/env python3
"""The table of experiments/survival/seen.sh: for each build, kill point and repetition, the
time from the loss seen (the run log's `lost` record, written as the launcher reaps the dead
worker, on the chief's clock) to the next update record, against two of the same build's
undisturbed median intervals between update records in the same repetition: the time lost past
the detection, which the bound allows two update times. Also the update the run was taken over
at, whether any update was reported twice, and the end weights' digest.

    python3 experiments/survival/seen.py OUTDIR REPS
"""

import json
import re
import statistics
import sys
from pathlib import Path


def records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def median_interval(every: list) -> float:
    t = [r["elapsed_s"] for r in every if r.get("kind") == "step"]
    return statistics.median(b - a for a, b in zip(t, t[1:]))


def killed(out: Path, name: str) -> dict:
    every = records(out / f"{name}.jsonl")
    text = (out / f"{name}.txt").read_text()
    steps = [r for r in every if r.get("kind") == "step"]
    seen = next(r["elapsed_s"] for r in every if r.get("kind") == "lost")
    after = [r["elapsed_s"] for r in steps if r["elapsed_s"] > seen]
    before = [r["elapsed_s"] for r in steps if r["elapsed_s"] <= seen]
    at = re.search(r"taken over at update (\d+)", text)
    digest = re.search(r"weights ([0-9a-f]+)", text)
    numbers = [r["step"] for r in steps]
    return {
        "to_next": min(after) - seen,
        "since_last": seen - max(before),
        "at": at.group(1) if at else "-",
        "twice": len(numbers) - len(set(numbers)),
        "digest": digest.group(1) if digest else "-",
    }


def main() -> None:
    out, reps = Path(sys.argv[1]), int(sys.argv[2])
    print("| build | failure at | rep | taken over at | last record before the loss ms |"
          " loss seen to the next update ms | bound ms | met | updates reported twice | weights |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    tally = {}
    for build in ("old", "new"):
        for pct in (25, 50, 75):
            for rep in range(1, reps + 1):
                calm = median_interval(records(out / f"{build}-calm-{rep}.jsonl"))
                k = killed(out, f"{build}-{pct}-{rep}")
                bound = 2 * calm
                met = k["to_next"] <= bound
                t = tally.setdefault(build, [])
                t.append((k["to_next"], bound, met))
                print(f"| {build} | {pct}% | {rep} | {k['at']} | -{k['since_last'] * 1e3:.0f} |"
                      f" {k['to_next'] * 1e3:.0f} | {bound * 1e3:.0f} | {'yes' if met else 'no'} |"
                      f" {k['twice']} | {k['digest']} |")
    print()
    print("| build | met | loss seen to the next update ms (median, range) | bound ms (range) |")
    print("|---|---|---|---|")
    for build, t in tally.items():
        ms = [x[0] * 1e3 for x in t]
        bounds = [x[1] * 1e3 for x in t]
        print(f"| {build} | {sum(x[2] for x in t)} of {len(t)} | {statistics.median(ms):.0f}"
              f" ({min(ms):.0f}-{max(ms):.0f}) | {min(bounds):.0f}-{max(bounds):.0f} |")


if __name__ == "__main__":
    main()
