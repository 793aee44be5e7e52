"""Writes a synthetic token corpus in pipe's shard format (docs/data.md): SHARDS shards of
TOKENS random byte ids each (u16, vocabulary 256, the `bytes` tokenizer's fingerprint), for
the resident-memory experiment of run.sh. The ids are seeded (numpy's PCG64, seed 0).

    python3 experiments/memory/synthetic_shards.py OUT [SHARDS [TOKENS]]
"""

import hashlib
import json
import pathlib
import struct
import sys

import numpy as np

out = pathlib.Path(sys.argv[1])
shards = int(sys.argv[2]) if len(sys.argv) > 2 else 8
tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 256 << 20
out.mkdir(parents=True, exist_ok=False)
fingerprint = hashlib.sha256(b"bytes").hexdigest()
rng = np.random.default_rng(0)
entries = []
for i in range(shards):
    name = f"shard-{i:05d}.tok"
    header = json.dumps({"format": 1, "tokens": tokens, "dtype": "u16", "vocab_size": 256,
                         "tokenizer": fingerprint}).encode()
    header += b" " * (-(12 + len(header)) % 8)
    with open(out / name, "wb") as f:
        f.write(b"PIPETOK1" + struct.pack("<I", len(header)) + header)
        left = tokens
        while left:
            n = min(left, 1 << 24)
            f.write(rng.integers(0, 256, n, dtype=np.uint16).astype("<u2").tobytes())
            left -= n
    entries.append({"file": name, "tokens": tokens})
manifest = {
    "format": 1,
    "tokenizer": {"kind": "bytes", "fingerprint": fingerprint, "vocab_size": 256, "file": None,
                  "document_end": None},
    "dtype": "u16",
    "documents": shards,
    "tokens": shards * tokens,
    "shards": entries,
}
(out / "tokens.json").write_text(json.dumps(manifest, indent=2))
print(f"{out}: {shards} shards of {tokens} ids, {shards * tokens * 2 / 2**30:.2f} GiB of ids")
