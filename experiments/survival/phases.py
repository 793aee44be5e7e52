#!/usr/bin/env python3
"""Where a recovery's time goes, from the run logs of killed runs (seen.sh's, update.sh's, or
any `pipe train --log-jsonl` run of worker processes that lost a replica).

Each surviving worker process logs a `recovery` record as it passes each phase (stopped:
its program stopped on the loss; told: the launcher's word of the loss reached it; named:
the launcher named where every survivor listens; meshed: its mesh without the lost worker
is connected;
planned: the takeover is settled; restarted: its programs run again), dated by its own
clock on the clock of the update records. For every log given (or every *.jsonl of a
directory) with a `lost` record, one row: per phase, the first and the last survivor to pass
it, in milliseconds from the loss seen (the `lost` record), and the next update record after
the loss and after the last restart.

    python3 experiments/survival/phases.py OUTDIR_OR_LOGS...
"""

import json
import sys
from pathlib import Path

PHASES = ("stopped", "told", "named", "meshed", "planned", "restarted")


def row(path: Path):
    every = [json.loads(line) for line in path.read_text().splitlines()]
    lost = next((r for r in every if r.get("kind") == "lost" and "elapsed_s" in r), None)
    if lost is None:
        return None
    seen = lost["elapsed_s"]
    ms = lambda t: (t - seen) * 1e3
    cells = []
    last_restart = None
    for phase in PHASES:
        times = [r["elapsed_s"] for r in every
                 if r.get("kind") == "recovery" and r.get("phase") == phase
                 and "elapsed_s" in r and r["elapsed_s"] >= seen - 1.0]
        if not times:
            cells.append("-")
            continue
        cells.append(f"{ms(min(times)):.0f} to {ms(max(times)):.0f}")
        if phase == "restarted":
            last_restart = max(times)
    steps = [r["elapsed_s"] for r in every if r.get("kind") == "step" and r["elapsed_s"] > seen]
    following = min(steps) if steps else None
    cells.append(f"{ms(following):.0f}" if following is not None else "-")
    after = [t for t in steps if last_restart is not None and t > last_restart]
    cells.append(f"{(min(after) - last_restart) * 1e3:.0f}" if after else "-")
    return cells


def main() -> None:
    paths = []
    for arg in sys.argv[1:]:
        p = Path(arg)
        paths.extend(sorted(p.glob("*.jsonl")) if p.is_dir() else [p])
    print("| run | stopped ms | told ms | named ms | meshed ms | planned ms | restarted ms |"
          " next update ms | last restart to the next update after it ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        cells = row(path)
        if cells:
            print(f"| {path.stem} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
