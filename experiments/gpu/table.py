#!/usr/bin/env python3
"""Renders the pipe / PyTorch table of docs/gpu.md from what compare.sh measured: the
`pipe bench mfu --json` files (pipe-*.json), the peer's JSON lines (peer.jsonl) and the device
line (device.txt), all in one directory. With --update FILE, replaces the text between
`<!-- gpu-table:begin -->` and `<!-- gpu-table:end -->` in FILE; otherwise prints the table."""
import argparse
import glob
import json
import os
import sys

BEGIN, END = "<!-- gpu-table:begin -->", "<!-- gpu-table:end -->"


def load(directory):
    pipe = {}
    for path in sorted(glob.glob(os.path.join(directory, "pipe-*.json"))):
        with open(path) as f:
            r = json.load(f)
        pipe[(r["model"], r["batch"], r.get("precision", "f32"))] = r
    peer = {}
    with open(os.path.join(directory, "peer.jsonl")) as f:
        for line in f:
            if line.startswith("{"):
                r = json.loads(line)
                peer[(r["model"], r["batch"], r["precision"])] = r
    with open(os.path.join(directory, "device.txt")) as f:
        lines = [l.strip() for l in f if l.strip()]
    name, _, driver = lines[0].partition(", ") if lines else ("?", "", "?")
    when = lines[1] if len(lines) > 1 else "?"
    device = f"on one {name} (driver {driver}), {when}"
    return pipe, peer, device


def rate(model, samples_per_s):
    # gpt-mini's samples are 128-token sequences: quote tokens/s.
    if model.startswith("gpt"):
        return samples_per_s * 128, "tokens/s"
    return samples_per_s, "samples/s"


def render(directory):
    pipe, peer, device = load(directory)
    rows = [
        "| model | batch | precision | pipe | PyTorch | pipe / PyTorch | pipe step (ms) | PyTorch step (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(set(pipe) | set(peer), key=lambda k: (k[0], k[1], k[2])):
        model, batch, precision = key
        p, q = pipe.get(key), peer.get(key)
        unit = rate(model, 1.0)[1]
        cell = lambda r: f"{rate(model, r['samples_per_s'])[0] / 1e3:,.1f} k {unit}" if r else "not run"
        ratio = f"{p['samples_per_s'] / q['samples_per_s']:.2f}" if p and q else "-"
        ms = lambda r: f"{r['step_s_median'] * 1e3:.2f}" if r else "-"
        rows.append(f"| {model} | {batch} | {precision} | {cell(p)} | {cell(q)} | {ratio} | {ms(p)} | {ms(q)} |")
    torch = next((r["torch"] for r in peer.values()), "?")
    head = (f"Measured {device}; PyTorch {torch}. Step medians of `pipe bench mfu` and "
            f"`experiments/gpu/peer.py` (same models, batches, loss and plain SGD) in one device call.")
    return head + "\n\n" + "\n".join(rows) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory")
    p.add_argument("--update", metavar="FILE")
    a = p.parse_args()
    table = render(a.directory)
    if not a.update:
        sys.stdout.write(table)
        return 0
    with open(a.update) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        sys.exit(f"{a.update} has no {BEGIN} ... {END} block")
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    with open(a.update, "w") as f:
        f.write(before + BEGIN + "\n" + table + END + after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
