"""Medians of the figures written by run.sh, before and after, with the after/before ratio of
each round's pair (the two runs of a round are back to back), the median of those ratios, and
the machine's spread: the largest ratio between two rounds of one build (either build). A
figure is within the spread when its median ratio differs from 1 by no more than that."""
import json
import statistics
import sys

out, rounds, before, after = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


def load(kind, side, r):
    with open(f"{out}/{kind}-{side}-{r}.json") as f:
        return json.load(f)


def figures(kind, doc):
    """Flat {name: value} of the throughput figures of one report."""
    if kind == "small96":
        return {f"{k} (96 updates)": v for k, v in figures("pipeline", doc).items()}
    if kind == "mfu":
        return {"bench mfu samples/s": doc["samples_per_s"], "bench mfu MFU": doc["mfu"]}
    got = {}
    for m in doc["models"]:
        got[f"{m['model']} single worker samples/s"] = m["single_samples_per_s"]
        for c in m["cases"]:
            got[f"{c['case']['name']} samples/s"] = c["samples_per_s"]
    got["executor overhead us/action (lower is better)"] = doc["overhead_us_per_action"]
    return got


print(f"before = {before}, after = {after}, {rounds} alternating rounds\n")
print("| figure | before (median) | after (median) | after / before (median of rounds) "
      "| spread of rounds (max / min, either build) | within spread |")
print("|---|---|---|---|---|---|")
for kind in ("mfu", "pipeline", "small96"):
    per_round = [
        (figures(kind, load(kind, "before", r)), figures(kind, load(kind, "after", r)))
        for r in range(1, rounds + 1)
    ]
    for name in per_round[0][0]:
        b = [p[0][name] for p in per_round]
        a = [p[1][name] for p in per_round]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        spread = max(max(b) / min(b), max(a) / min(a))
        within = "yes" if max(ratio, 1 / ratio) <= spread else "no"
        print(f"| {name} | {statistics.median(b):.4g} | {statistics.median(a):.4g} | {ratio:.3f} "
              f"| {spread:.3f} | {within} |")
