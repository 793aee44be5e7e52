#!/usr/bin/env python3
"""Every worker's actions around a lost replica, from a killed run's trace and log.

For a run of `pipe train ... --placement processes --log-jsonl RUN.jsonl --trace
RUN.trace.json --fault-schedule ...`, prints the update records and, per worker, each
traced action (name@start+duration, in ms from the loss seen, the log's `lost` record) from
BEFORE ms before the loss to AFTER ms after it. The lost worker's track after the loss is
its program run again on its adopter. Both files share the run's clock.

    python3 experiments/survival/window.py RUN [AFTER_MS] [BEFORE_MS]

RUN is the path without its extension (RUN.jsonl and RUN.trace.json).
"""
import json
import sys


def main():
    run = sys.argv[1]
    after = float(sys.argv[2]) if len(sys.argv) > 2 else 150.0
    before = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
    events = json.load(open(f"{run}.trace.json"))["traceEvents"]
    records = [json.loads(line) for line in open(f"{run}.jsonl")]
    lost = next(r for r in records if r.get("kind") == "lost")["elapsed_s"] * 1e6
    steps = [r["elapsed_s"] * 1e6 for r in records if r.get("kind") == "step"]
    lo, hi = lost - before * 1e3, lost + after * 1e3
    print("update records (ms):", [round((s - lost) / 1e3, 1) for s in steps if lo < s < hi])
    actions = [e for e in events if e.get("ph") == "X"]
    for worker in sorted({e["tid"] for e in actions}):
        mine = sorted((e for e in actions if e["tid"] == worker
                       and e["ts"] + e["dur"] > lo and e["ts"] < hi), key=lambda e: e["ts"])
        print(f"worker {worker}:")
        print("  " + " ".join(f"{e['name']}@{(e['ts'] - lost) / 1e3:.1f}+{e['dur'] / 1e3:.1f}"
                              for e in mine))


if __name__ == "__main__":
    main()
