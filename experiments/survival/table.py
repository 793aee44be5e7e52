#!/usr/bin/env python3
"""The table of experiments/survival/update.sh: per build (segment recovery, the build before;
update recovery, this one) and kill point, the wall time, the time lost against the same
build's undisturbed run, the updates computed twice (step records in the log past the number of
distinct steps), the update the run went on from, and the final test accuracy.

    python3 experiments/survival/table.py OUTDIR UPDATES_PER_EPOCH
"""

import json
import re
import sys
from pathlib import Path


def read(out: Path, name: str) -> dict:
    text = (out / f"{name}.txt").read_text()
    steps = [
        json.loads(line)["step"]
        for line in (out / f"{name}.jsonl").read_text().splitlines()
        if '"kind":"step"' in line
    ]
    done = re.search(r"^done: (\d+) steps, test accuracy ([\d.]+)%", text, re.M)
    lost = re.search(r"from update (\d+) \(([^)]*)\)", text)
    return {
        "wall": float((out / f"{name}.wall").read_text()),
        "records": len(steps),
        "redone": len(steps) - len(set(steps)),
        "steps": int(done.group(1)) if done else None,
        "accuracy": float(done.group(2)) if done else None,
        "from": int(lost.group(1)) if lost else None,
        "unit": lost.group(2) if lost else "",
    }


def main() -> None:
    out, per_epoch = Path(sys.argv[1]), int(sys.argv[2])
    print(f"updates per epoch: {per_epoch}; the failure falls in the second epoch")
    print()
    print(
        "| build | failure at | worker 3's message | wall s | lost s | updates redone "
        "| went on from | test accuracy |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for build, label in (("old", "segment recovery"), ("new", "update recovery")):
        calm = read(out, f"{build}-calm")
        print(
            f"| {label} | undisturbed | | {calm['wall']:.2f} | | {calm['redone']} | "
            f"| {calm['accuracy']:.2f}% |"
        )
        for pct in (25, 50, 75):
            r = read(out, f"{build}-{pct}")
            nth = (out / f"kill-{pct}.nth").read_text().strip()
            acc = f"{r['accuracy']:.2f}%" if r["accuracy"] is not None else "failed"
            print(
                f"| {label} | {pct}% | {nth} | {r['wall']:.2f} | "
                f"{r['wall'] - calm['wall']:+.2f} | {r['redone']} | {r['from']} | {acc} |"
            )


if __name__ == "__main__":
    main()
