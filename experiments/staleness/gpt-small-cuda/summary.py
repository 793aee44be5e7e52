"""The table of run.sh's runs: for each optimizer, the validation loss of sequential training
after 2 epochs and the gap of every other schedule the lanes ran (2bw and pipedream by
default; POLICY+CORRECTION for a delay correction) to it, seed by seed and on average, and
for each correction the share of its policy's gap it recovered.

    python3 summary.py RUNS_DIR [RUNS_DIR ...] > results.md

Reads every OPTIMIZER-sSEED.log in the directories (run.sh's lanes) and their device.txt.
A run that failed (a loss or gradient that stopped being finite, a time limit) is named with
its last line instead of a number.
"""

import pathlib
import re
import statistics
import sys

# Student's t at 97.5% for 1 to 9 degrees of freedom: the half-width of a 95% interval.
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262]
DONE = re.compile(r"^done: (\d+) steps, test accuracy [\d.]+%, test loss (\S+), "
                  r"weights (\w+), ([\d.]+) s", re.M)
LOG = re.compile(r"^(.+)-s(\d+)\.log$")


def parse(path):
    """Each schedule's result in one lane's log: its loss, or the line that says why not."""
    runs = {}
    for part in path.read_text().split("=== ")[1:]:
        schedule, text = part.split("\n", 1)
        m = DONE.search(text)
        if m:
            runs[schedule] = float(m[2])
        else:
            lines = [l for l in text.strip().splitlines() if not l.startswith("exit")]
            runs[schedule] = lines[-1] if lines else "no output"
    return runs


def main():
    dirs = [pathlib.Path(d) for d in sys.argv[1:]]
    lanes = {}
    for d in dirs:
        for path in sorted(d.glob("*.log")):
            m = LOG.match(path.name)
            if m:
                lanes.setdefault(m[1], {})[int(m[2])] = parse(path)
    # Every schedule the lanes ran, sequential first, the rest in the order first met.
    schedules = ["sequential"]
    for seeds in lanes.values():
        for runs in seeds.values():
            schedules += [s for s in runs if s not in schedules]
    late = schedules[1:]
    print("| optimizer | seed | sequential | " + " | ".join(f"{s} | {s} gap" for s in late) + " |")
    print("|---|---|---|" + "---|---|" * len(late))
    failures = []
    means = []
    recovered = []
    for opt, seeds in lanes.items():
        gaps = {s: [] for s in late}
        shares = {s: [] for s in late if "+" in s}
        for seed, runs in sorted(seeds.items()):
            cells = []
            base = runs.get("sequential")
            for s in schedules:
                r = runs.get(s)
                if isinstance(r, float):
                    cells.append(f"{r:.4f}")
                    if s != "sequential" and isinstance(base, float):
                        gaps[s].append(r - base)
                        cells.append(f"{r - base:+.4f}")
                    elif s != "sequential":
                        cells.append("")
                else:
                    cells.append("failed" if r else "not run")
                    if s != "sequential":
                        cells.append("")
                    if r:
                        failures.append(f"{opt}, seed {seed}, {s}: {r}")
            print(f"| {opt} | {seed} | " + " | ".join(cells) + " |")
            for s in shares:
                plain, fixed = runs.get(s.split("+")[0]), runs.get(s)
                if all(isinstance(r, float) for r in (base, plain, fixed)) and plain != base:
                    shares[s].append(((plain - base) - (fixed - base)) / (plain - base))
        means.append((opt, len(seeds), gaps))
        recovered.append((opt, shares))
    print()
    print("Mean gap over the seeds where both runs finished (nats/char), with the half-width of")
    print("its 95% interval (Student's t) where there are two seeds or more:")
    print()

    def mean(g):
        text = f"{statistics.fmean(g):+.3f}"
        if 2 <= len(g) <= len(T975) + 1:
            text += f" ± {T975[len(g) - 2] * statistics.stdev(g) / len(g) ** 0.5:.3f}"
        return text

    for opt, n, gaps in means:
        parts = [f"{s} {mean(g)} ({len(g)} of {n})" if g else f"{s}: none"
                 for s, g in gaps.items()]
        print(f"- {opt}: " + ", ".join(parts))
    if any(shares for _, shares in recovered):
        print()
        print("Share of the policy's gap each correction recovered, (gap_plain - gap_corrected) /")
        print("gap_plain, over the seeds where all three runs finished:")
        print()
        for opt, shares in recovered:
            parts = [f"{s} {mean(g)} ({len(g)})" if g else f"{s}: none" for s, g in shares.items()]
            print(f"- {opt}: " + ", ".join(parts))
    if failures:
        print()
        print("Runs that did not finish:")
        print()
        for f in failures:
            print(f"- {f}")
    print()
    print("Devices:")
    print()
    for d in dirs:
        text = (d / "device.txt").read_text().split("\n")
        print(f"- {d.name}: " + "; ".join(l for l in text if l and not l.startswith("name,")))


if __name__ == "__main__":
    main()
