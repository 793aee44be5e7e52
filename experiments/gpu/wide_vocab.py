#!/usr/bin/env python3
"""Writes a copy of a byte-level BPE tokenizer.json whose vocabulary is padded with unused
tokens to a given size (GPT-2's 50,257 by default), on standard output.

The ids it produces are the original tokenizer's (the padding tokens are never produced: no
merge makes them), but a corpus made with it records the padded vocabulary, so `pipe train
--model gpt2-small --dataset tokens:DIR` builds GPT-2 124M's embedding and tied head
(124,439,808 parameters) from a corpus this repository holds, without GPT-2's own tokenizer.

    python3 experiments/gpu/wide_vocab.py data/tokenizers/shakespeare-bpe-1024.json > wide.json
    pipe tokenize --tokenizer wide.json --input data/tinyshakespeare.txt --out CORPUS
"""
import argparse
import json
import sys


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tokenizer", help="a tokenizer.json with a BPE model")
    p.add_argument("--size", type=int, default=50257)
    a = p.parse_args()
    with open(a.tokenizer) as f:
        t = json.load(f)
    vocab = t["model"]["vocab"]
    taken = set(vocab.values()) | {x["id"] for x in t.get("added_tokens", [])}
    if t["model"].get("type") != "BPE" or len(taken) > a.size:
        sys.exit(f"{a.tokenizer}: not a BPE tokenizer of at most {a.size} tokens")
    for i in range(a.size):
        if i not in taken:
            vocab[f"<|unused{i}|>"] = i
    json.dump(t, sys.stdout, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
