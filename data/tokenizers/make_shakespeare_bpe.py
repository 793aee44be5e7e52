"""Makes shakespeare-bpe-1024.json: a GPT-2-style byte-level BPE tokenizer (the ByteLevel
pre-tokenizer and decoder GPT-2 uses, no prefix space, <|endoftext|> as id 0) trained on
Tiny Shakespeare, small enough to commit, so tests and examples exercise the tokenizer.json
path without a download. Also prints what the Python tokenizer makes of the whole corpus,
which tests/tokenize.rs checks pipe's chunked, parallel tokenizing against.

    pip install tokenizers==0.23.3
    python3 data/tokenizers/make_shakespeare_bpe.py
"""

import hashlib
import pathlib
import struct

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

here = pathlib.Path(__file__).resolve().parent
corpus = here.parent / "tinyshakespeare.txt"

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=1024,
    special_tokens=["<|endoftext|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
)
tok.train([str(corpus)], trainer)
out = here / "shakespeare-bpe-1024.json"
tok.save(str(out))

ids = tok.encode(corpus.read_text(encoding="utf-8"), add_special_tokens=False).ids
packed = b"".join(struct.pack("<I", i) for i in ids)
print(f"{out.name}: vocabulary {tok.get_vocab_size()}")
print(f"tinyshakespeare.txt: {len(ids)} ids, sha256 of u32 LE {hashlib.sha256(packed).hexdigest()}")
print(f"first ids {ids[:12]}")
