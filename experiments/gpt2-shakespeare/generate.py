"""Generate text with Hugging Face transformers from a GPT-2 that `pipe export --format hf` wrote.

    python3 generate.py EXPORTED_DIR [--prompt TEXT] [--tokens N] [--seed S]

Loads the directory with GPT2LMHeadModel.from_pretrained and its tokenizer.json with
PreTrainedTokenizerFast, then samples N tokens after the prompt (temperature 0.8, top-k 40,
seeded), and prints the prompt and what followed.
"""

import argparse
import pathlib

import torch
import transformers
from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("exported", type=pathlib.Path)
    parser.add_argument("--prompt", default="ROMEO:")
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    transformers.logging.disable_progress_bar()

    model = GPT2LMHeadModel.from_pretrained(args.exported).eval()
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(args.exported / "tokenizer.json"))
    prompt = tokenizer.encode(args.prompt)
    # The window is the model's: keep the prompt and the continuation inside it.
    room = model.config.n_positions - len(prompt)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=min(args.tokens, room),
            do_sample=True,
            temperature=0.8,
            top_k=40,
            pad_token_id=0,
        )
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; "
          f"{sum(p.numel() for p in model.parameters())} parameters; "
          f"prompt {args.prompt!r} ({len(prompt)} tokens), {out.shape[1] - len(prompt)} tokens sampled "
          f"(temperature 0.8, top-k 40, seed {args.seed})")
    print()
    print(tokenizer.decode(out[0].tolist()))


if __name__ == "__main__":
    main()
