#!/usr/bin/env python3
"""The update records around each lost worker process in update.sh's runs.

Usage: python3 experiments/survival/around.py OUTDIR [TRANSPORT]

For each killed run of this build (OUTDIR/new-25, -50, -75), the last update record before the
run log's `lost` record and the three after it, in milliseconds from the loss seen: a Markdown
table on standard output. Where the loss falls just after an update record, the next one needs
an update of its own on top of the recovery.
"""
import json
import os
import sys


def around(path):
    records = [json.loads(line) for line in open(path)]
    lost = next((r for r in records if r.get("kind") == "lost"), None)
    if lost is None:
        return None
    seen = lost["elapsed_s"]
    steps = [r for r in records if r.get("kind") == "step"]
    before = [r for r in steps if r["elapsed_s"] <= seen]
    after = [r for r in steps if r["elapsed_s"] > seen][:3]
    ms = lambda r: f"{r['step']} ({(r['elapsed_s'] - seen) * 1000:+.0f} ms)"
    return (ms(before[-1]) if before else "-", ", ".join(ms(r) for r in after))


def main():
    out = sys.argv[1]
    transport = sys.argv[2] if len(sys.argv) > 2 else ""
    print("| transport | failure at | last before | next three |")
    print("|---|---|---|---|")
    for pct in (25, 50, 75):
        path = os.path.join(out, f"new-{pct}.jsonl")
        if not os.path.exists(path):
            continue
        row = around(path)
        if row:
            print(f"| {transport} | {pct}% | {row[0]} | {row[1]} |")


if __name__ == "__main__":
    main()
