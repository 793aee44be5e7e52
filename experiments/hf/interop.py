"""Interoperability with Hugging Face transformers, both ways, checked on logits.

1. A tiny random GPT-2 made by transformers, saved with save_pretrained, is read by pipe
   (`pipe logits --hf DIR`): pipe's logits must agree with transformers' within 1e-4.
2. A tiny GPT-2 trained by pipe on token shards (the committed BPE over Tiny Shakespeare,
   4 stages x 2 replicas) and exported (`pipe export --format hf`) is loaded by
   GPT2LMHeadModel.from_pretrained: same logits within 1e-4, and `generate` runs.
3. The exported directory trains on in pipe (`--init-from`).
4. Sharded saves both ways: transformers' `save_pretrained(max_shard_size=...)` read by pipe,
   and `pipe export --max-shard-size` loaded by transformers, within 1e-4.
5. A random GPT-2 of gpt2-small's shape (124 M parameters, GPT-2's vocabulary, 1,024
   positions) made by transformers and read by pipe, compared at 256 tokens within 1e-4.

Needs torch and transformers (pip install torch transformers) and a built `pipe`:

    cargo build --release
    python3 experiments/hf/interop.py [--pipe target/release/pipe] > experiments/hf/interop.log
"""

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4


def pipe(binary, *args):
    out = subprocess.run([binary, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"pipe {' '.join(args)} failed ({out.returncode}): {out.stderr}")
    return out.stdout


def pipe_logits(binary, flag, path, ids):
    text = pipe(binary, "logits", flag, str(path), "--ids", ",".join(map(str, ids)))
    return torch.tensor(json.loads(text))


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def compare(what, a, b):
    diff = (a - b).abs().max().item()
    ok = diff <= TOLERANCE
    print(f"{what}: max |logit difference| {diff:.2e} ({'ok' if ok else 'FAIL'}, tolerance {TOLERANCE:g})")
    return ok


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipe", default=str(ROOT / "target/release/pipe"))
    binary = parser.parse_args().pipe
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.manual_seed(0)
    ids = [5, 17, 300, 2, 999, 64, 1000, 7, 7, 12, 511, 0]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)

        # 1. transformers -> pipe.
        config = GPT2Config(
            vocab_size=1024, n_positions=16, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )
        made = GPT2LMHeadModel(config).eval()
        made.save_pretrained(tmp / "made")
        ok &= compare(
            "a random transformers GPT-2 read by pipe",
            pipe_logits(binary, "--hf", tmp / "made", ids),
            hf_logits(made, ids),
        )

        # 2. pipe -> transformers.
        shards = tmp / "shards"
        pipe(binary, "tokenize", "--tokenizer", str(ROOT / "data/tokenizers/shakespeare-bpe-1024.json"),
             "--input", str(ROOT / "data/tinyshakespeare.txt"), "--out", str(shards))
        trained = tmp / "ckpt"
        pipe(binary, "train", "--model", "gpt2-tiny", "--dataset", f"tokens:{shards}",
             "--stages", "4", "--replicas", "2", "--steps", "40", "--checkpoint-dir", str(trained))
        exported = tmp / "exported"
        print(pipe(binary, "export", "--checkpoint", str(trained), "--format", "hf", "--out", str(exported),
                   "--tokenizer", str(shards / "tokenizer.json")).strip())
        loaded = GPT2LMHeadModel.from_pretrained(exported).eval()
        ok &= compare(
            "a pipe-trained GPT-2 loaded by transformers",
            pipe_logits(binary, "--checkpoint", trained, ids),
            hf_logits(loaded, ids),
        )
        generated = loaded.generate(torch.tensor([ids[:4]]), max_new_tokens=16, do_sample=False,
                                    pad_token_id=0)
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(exported / "tokenizer.json"))
        print(f"transformers generate from the exported model: {generated[0].tolist()} "
              f"= {tokenizer.decode(generated[0].tolist())!r}")
        ok &= generated.shape[1] == 20

        # 3. The exported weights train on in pipe.
        out = pipe(binary, "train", "--model", "gpt2-tiny", "--dataset", f"tokens:{shards}",
                   "--init-from", str(exported), "--steps", "4")
        print(out.strip().splitlines()[-1])

        # 4. Sharded saves, both ways.
        made.save_pretrained(tmp / "made-sharded", max_shard_size="40KB")
        shard_files = sorted(p.name for p in (tmp / "made-sharded").glob("*.safetensors"))
        print(f"transformers saved {len(shard_files)} shards")
        ok &= len(shard_files) > 1
        ok &= compare(
            "a sharded transformers save read by pipe",
            pipe_logits(binary, "--hf", tmp / "made-sharded", ids),
            hf_logits(made, ids),
        )
        exported_sharded = tmp / "exported-sharded"
        print(pipe(binary, "export", "--checkpoint", str(trained), "--format", "hf",
                   "--out", str(exported_sharded), "--max-shard-size", "100KB").strip())
        loaded = GPT2LMHeadModel.from_pretrained(exported_sharded).eval()
        ok &= compare(
            "a sharded pipe export loaded by transformers",
            pipe_logits(binary, "--checkpoint", trained, ids),
            hf_logits(loaded, ids),
        )

        # 5. GPT-2 124M's shape at 256 tokens.
        small = GPT2Config(
            vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        big = GPT2LMHeadModel(small).eval()
        count = sum(p.numel() for p in big.parameters())
        big.save_pretrained(tmp / "small")
        long_ids = torch.randint(0, 50257, (256,), generator=torch.Generator().manual_seed(1)).tolist()
        ok &= compare(
            f"a random transformers GPT-2 of gpt2-small's shape ({count:,} parameters) read by pipe, 256 tokens",
            pipe_logits(binary, "--hf", tmp / "small", long_ids),
            hf_logits(big, long_ids),
        )
    print("interop: all checks passed" if ok else "interop: FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
