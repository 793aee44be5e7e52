#!/usr/bin/env python3
"""The table of experiments/survival/update.sh: per build (segment recovery, the build before;
update recovery, this one) and kill point, the wall time, the time lost against the same
build's undisturbed run, the updates computed twice (step records in the log past the number of
distinct steps), the time from the last step record before the run went back to the first
record of a step not reported before, against the run's median interval between records
(noticing the loss, going on, and the updates done again; "-" where the workers started again
and their clock with them); taken over, where no step is reported twice, the interval around
the update the run names as taken over at, the kill falling inside it; the longest interval between
two step records of the second epoch (where the loss falls: it holds the loss whether or not
a step is reported twice), the update the run went on from, and the final test accuracy.
Where the log dates the loss (its "lost" record: when the launcher reaped the worker, on the
chief's clock), the time from then to the next step record, against two of the undisturbed
run's median intervals: the time lost past the detection, which the bound allows two update
times. OLD_LABEL and NEW_LABEL name the two builds.

    python3 experiments/survival/table.py OUTDIR UPDATES_PER_EPOCH
"""

import json
import os
import re
import sys
from pathlib import Path


def read(out: Path, name: str, per_epoch: int) -> dict:
    text = (out / f"{name}.txt").read_text()
    every = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
    records = [r for r in every if r.get("kind") == "step"]
    # From the loss seen (the launcher's reap) to the next step record.
    seen = next((r.get("elapsed_s") for r in every if r.get("kind") == "lost"), None)
    to_next = None
    if seen is not None:
        after = [r["elapsed_s"] for r in records if r["elapsed_s"] > seen]
        to_next = min(after) - seen if after else None
    steps = [r["step"] for r in records]
    gaps = sorted(
        b["elapsed_s"] - a["elapsed_s"]
        for a, b in zip(records, records[1:])
        if b["elapsed_s"] >= a["elapsed_s"]
    )
    # From the last step record before the run went back to the first record of a step not
    # reported before: noticing the loss, going on, and the updates done again (None where
    # nothing was done again, or the clock restarted with the workers).
    pause = None
    for i in range(1, len(records)):
        if steps[i] <= steps[i - 1]:
            high = steps[i - 1]
            new = next((r for r in records[i:] if r["step"] > high), None)
            if new and new["elapsed_s"] >= records[i - 1]["elapsed_s"]:
                pause = new["elapsed_s"] - records[i - 1]["elapsed_s"]
            break
    second = [r for r in records if per_epoch < r["step"] <= 2 * per_epoch]
    longest = max(
        (b["elapsed_s"] - a["elapsed_s"] for a, b in zip(second, second[1:])),
        default=None,
    )
    # Taken over, no step is reported twice: the loss falls between the record before the
    # update it was taken over at and the first record after the survivors went on, the
    # largest interval among those ending at that update or one of the two after it (a
    # record may leave in the moment after the loss, computed before it).
    taken_at = re.search(r"taken over at update (\d+):", text)
    if pause is None and taken_at:
        at = int(taken_at.group(1))
        around = [
            b["elapsed_s"] - a["elapsed_s"]
            for a, b in zip(records, records[1:])
            if at <= b["step"] <= at + 2
        ]
        pause = max(around, default=None)
    done = re.search(r"^done: (\d+) steps, test accuracy ([\d.]+)%", text, re.M)
    lost = re.search(r"from update (\d+) \(([^)]*)\)", text)
    taken = re.search(r"taken over at update (\d+):", text)
    return {
        "wall": float((out / f"{name}.wall").read_text()),
        "records": len(steps),
        "redone": len(steps) - len(set(steps)),
        "pause": pause,
        "to_next": to_next,
        "longest": longest,
        "interval": gaps[len(gaps) // 2] if gaps else 0.0,
        "steps": int(done.group(1)) if done else None,
        "accuracy": float(done.group(2)) if done else None,
        "from": int(lost.group(1)) if lost else None,
        "taken_over_at": int(taken.group(1)) if taken else None,
        "unit": lost.group(2) if lost else "",
    }


def main() -> None:
    out, per_epoch = Path(sys.argv[1]), int(sys.argv[2])
    print(f"updates per epoch: {per_epoch}; the failure falls in the second epoch")
    print()
    print(
        "| build | failure at | worker 3's message | wall s | lost s | updates redone "
        "| to a new update or around the loss s (median interval) | longest interval s "
        "| recovered at (layout from) "
        "| test accuracy | loss seen to the next update s (bound) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    labels = (
        ("old", os.environ.get("OLD_LABEL", "segment recovery")),
        ("new", os.environ.get("NEW_LABEL", "update recovery")),
    )
    fmt = lambda x: f"{x:.3f}" if x is not None else "-"  # noqa: E731
    for build, label in labels:
        calm = read(out, f"{build}-calm", per_epoch)
        print(
            f"| {label} | undisturbed | | {calm['wall']:.2f} | | {calm['redone']} | "
            f"({calm['interval']:.3f}) | {fmt(calm['longest'])} | | {calm['accuracy']:.2f}% | |"
        )
        for pct in (25, 50, 75):
            r = read(out, f"{build}-{pct}", per_epoch)
            nth = (out / f"kill-{pct}.nth").read_text().strip()
            acc = f"{r['accuracy']:.2f}%" if r["accuracy"] is not None else "failed"
            pause = f"{r['pause']:.3f}" if r["pause"] is not None else "-"
            at = r["from"]
            if r["taken_over_at"] is not None:
                at = f"{r['taken_over_at']} ({r['from']})"
            bound = 2 * calm["interval"]
            seen = "-"
            if r["to_next"] is not None:
                verdict = "met" if r["to_next"] <= bound else "not met"
                seen = f"{r['to_next']:.3f} ({bound:.3f}: {verdict})"
            print(
                f"| {label} | {pct}% | {nth} | {r['wall']:.2f} | "
                f"{r['wall'] - calm['wall']:+.2f} | {r['redone']} | "
                f"{pause} ({r['interval']:.3f}) | {fmt(r['longest'])} | {at} | {acc} | {seen} |"
            )


if __name__ == "__main__":
    main()
