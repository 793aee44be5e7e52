#!/usr/bin/env python3
"""Renders the pipe / PyTorch table of docs/gpu.md from what compare.sh measured: the
`pipe bench mfu --json` files (pipe-*.json), the peer's JSON lines (peer*.jsonl) and the device
line (device.txt), all in one directory. With --update FILE, replaces the text between
`<!-- gpu-table:begin -->` and `<!-- gpu-table:end -->` in FILE (and the GPT-2 table between
`<!-- gpu-gpt2-table:begin -->` and `<!-- gpu-gpt2-table:end -->`), for each table the
directory has figures for; otherwise prints the tables.

GPT-2 124M (`gpt2-small`, AdamW) gets a table of its own: pipe against PyTorch eager and
PyTorch under torch.compile, tokens/s, pipe's tokens/s as a fraction of llm.c's 468,000
tokens/s on one H100, and model FLOP utilisation against the card's dense bf16 peak. FLOPs per
token follow PaLM's appendix B and llm.c: 6 N + 12 L C T, N = 124,439,808 parameters, L = 12
blocks, C = 768, T = 1,024 (the attention's Q K^T and P V over the full T x T square). A pipe
run with a padded vocabulary (`vocab_padding` rows, from `--padded-vocab-size`; peer.py's
`--padded-vocab-size` the same) has a row of its own, beside the peer's padded runs: it computes
the same model, and its padding counts in neither N nor the FLOPs."""
import argparse
import glob
import json
import os
import sys

BEGIN, END = "<!-- gpu-table:begin -->", "<!-- gpu-table:end -->"
GPT2_BEGIN, GPT2_END = "<!-- gpu-gpt2-table:begin -->", "<!-- gpu-gpt2-table:end -->"

GPT2 = "gpt2-small"
GPT2_PARAMETERS = 124_439_808
GPT2_L, GPT2_C, GPT2_T = 12, 768, 1024
GPT2_FLOPS_PER_TOKEN = 6 * GPT2_PARAMETERS + 12 * GPT2_L * GPT2_C * GPT2_T  # 859,885,056
# llm.c's GPT-2 124M training throughput on one H100 (bf16), tokens/s.
LLMC_TOKENS_PER_S = 468_000
# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, by a part of the name nvidia-smi prints.
BF16_PEAKS = [("H200", 989.4e12), ("H100 80GB HBM3", 989.4e12), ("H100 SXM", 989.4e12)]


def bf16_peak(name):
    return next((peak for part, peak in BF16_PEAKS if part in name), None)


def load(directory):
    pipe = {}
    for path in sorted(glob.glob(os.path.join(directory, "pipe-*.json"))):
        with open(path) as f:
            r = json.load(f)
        # A padded vocabulary (`--padded-vocab-size`) is a run of its own: its own row.
        pipe[(r["model"], r["batch"], r.get("precision", "f32"), r.get("vocab_padding", 0))] = r
    peer = {}  # (model, batch, precision, compiled, vocabulary padding)
    for path in sorted(glob.glob(os.path.join(directory, "peer*.jsonl"))):
        with open(path) as f:
            for line in f:
                if line.startswith("{"):
                    r = json.loads(line)
                    peer[(r["model"], r["batch"], r["precision"], bool(r.get("compile")),
                          r.get("vocab_padding", 0))] = r
    with open(os.path.join(directory, "device.txt")) as f:
        lines = [l.strip() for l in f if l.strip()]
    name, _, driver = lines[0].partition(", ") if lines else ("?", "", "?")
    when = lines[1] if len(lines) > 1 else "?"
    device = f"on one {name} (driver {driver}), {when}"
    return pipe, peer, device, name


def rate(model, samples_per_s):
    # gpt-mini's samples are 128-token sequences: quote tokens/s.
    if model.startswith("gpt"):
        return samples_per_s * 128, "tokens/s"
    return samples_per_s, "samples/s"


def render(directory):
    pipe, every_peer, device, card = load(directory)
    peer = {k[:3]: r for k, r in every_peer.items() if not k[3] and not k[4]}
    gpt2 = {k: r for k, r in pipe.items() if k[0] == GPT2}
    pipe = {k[:3]: r for k, r in pipe.items() if k[0] != GPT2}
    peer_gpt2 = {k: r for k, r in every_peer.items() if k[0] == GPT2}
    peer = {k: r for k, r in peer.items() if k[0] != GPT2}
    torch = next((r["torch"] for r in every_peer.values()), "?")
    tables = {}
    if pipe or peer:
        tables[(BEGIN, END)] = render_plain(pipe, peer, device, torch)
    if gpt2 or peer_gpt2:
        tables[(GPT2_BEGIN, GPT2_END)] = render_gpt2(gpt2, peer_gpt2, device, torch, card)
    return tables


def render_plain(pipe, peer, device, torch):
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
    head = (f"Measured {device}; PyTorch {torch}. Step medians of `pipe bench mfu` and "
            f"`experiments/gpu/peer.py` (same models, batches, loss and plain SGD) in one device call.")
    return head + "\n\n" + "\n".join(rows) + "\n"


def render_gpt2(pipe, peer, device, torch, card):
    peak = bf16_peak(card)
    rows = [
        "| batch | precision | vocabulary rows | pipe | PyTorch eager | PyTorch compiled | pipe / eager "
        "| pipe / compiled | pipe / llm.c (H100) | pipe MFU | eager MFU | compiled MFU "
        "| pipe step (ms) | eager step (ms) | compiled step (ms) "
        "| peak memory pipe / eager / compiled (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({k[1:4] for k in pipe} | {k[1:3] + k[4:5] for k in peer})
    notes = []
    for batch, precision, padding in keys:
        p = pipe.get((GPT2, batch, precision, padding))
        e = peer.get((GPT2, batch, precision, False, padding))
        c = peer.get((GPT2, batch, precision, True, padding))
        # pipe counts samples, sequences of T tokens; the peer reports tokens itself.
        tok = lambda r: (r["tokens_per_s"] if "tokens_per_s" in r
                         else r["samples_per_s"] * GPT2_T) if r else None
        tp, te, tc = tok(p), tok(e), tok(c)
        cell = lambda t: f"{t / 1e3:,.1f} k tokens/s" if t else "not run"
        ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"
        mfu = lambda t: f"{t * GPT2_FLOPS_PER_TOKEN / peak:.1%}" if t and peak else "-"
        ms = lambda r: f"{r['step_s_median'] * 1e3:.1f}" if r else "-"
        # pipe: its pool's peak (`peak_device_bytes`); PyTorch: max_memory_allocated.
        gib = lambda r: next((f"{r[k] / 2**30:.1f}" for k in ("peak_device_bytes",
                                                                "peak_memory_bytes")
                              if r and r.get(k)), "-")
        llmc = f"{tp / LLMC_TOKENS_PER_S:.2f}" if tp else "-"
        vocab = f"{50_257 + padding:,}" + (" (padded)" if padding else "")
        rows.append(f"| {batch} | {precision} | {vocab} | {cell(tp)} | {cell(te)} | {cell(tc)} "
                    f"| {ratio(tp, te)} | {ratio(tp, tc)} | {llmc} | {mfu(tp)} | {mfu(te)} "
                    f"| {mfu(tc)} | {ms(p)} | {ms(e)} | {ms(c)} | {gib(p)} / {gib(e)} / {gib(c)} |")
        for who, r in (("pipe", p), ("PyTorch", e or c)):
            n = r.get("parameters") if r else None
            if n and n != GPT2_PARAMETERS:
                notes.append(f"{who} measured a model of {n:,} parameters at batch {batch}, not "
                             f"GPT-2 124M's {GPT2_PARAMETERS:,} (another vocabulary?): the "
                             f"ratios compare different models.")
    head = (f"GPT-2 124M (`gpt2-small`: 12 blocks, width 768, 1,024 positions, vocabulary "
            f"50,257, tied head), measured {device}; PyTorch {torch}. Step medians of `pipe "
            f"bench mfu --optimizer adamw` and `experiments/gpu/peer.py` (eager, and under "
            f"torch.compile, whose compilation falls in the warm-up) with AdamW (lr 6e-4, "
            f"betas 0.9 and 0.95, weight decay 0.1 on every parameter), random token ids. "
            f"llm.c's figure is 468,000 tokens/s on one H100; the pipe column was measured on "
            f"the card named here. MFU: tokens/s x {GPT2_FLOPS_PER_TOKEN:,} FLOPs per token "
            f"(6 N + 12 L C T, PaLM's and llm.c's count) over the card's dense bf16 peak "
            + (f"({peak / 1e12:.1f} TFLOP/s)." if peak else f"(not known for {card}: no MFU)."))
    return head + "\n\n" + "\n".join(rows) + "\n" + "".join(f"\n{n}\n" for n in notes)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory")
    p.add_argument("--update", metavar="FILE")
    a = p.parse_args()
    tables = render(a.directory)
    if not a.update:
        sys.stdout.write("\n".join(tables.values()))
        return 0
    with open(a.update) as f:
        text = f.read()
    # Each table has its own block, so a directory that measured only one section leaves the
    # other's table as it was.
    for (begin, end), table in tables.items():
        if begin not in text or end not in text:
            sys.exit(f"{a.update} has no {begin} ... {end} block")
        before, rest = text.split(begin, 1)
        _, after = rest.split(end, 1)
        text = before + begin + "\n" + table + end + after
    with open(a.update, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
