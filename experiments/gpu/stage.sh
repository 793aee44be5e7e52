#!/usr/bin/env bash
# Builds what the GPU checks of docs/gpu.md run, on this (GPU-less) machine, into .gpu/: the
# `pipe` binary and the two test binaries with the `cuda` feature, stripped, the scripts and a
# token corpus. A GPU machine with no Rust toolchain runs them from there: `bash .gpu/run.sh`,
# `bash .gpu/gpt2.sh`. For a device call whose working tree may not pass 64 MiB, it also packs
# them: .gpu-pack/gpu.tar.xz (everything but the layout tests) and .gpu-oracle/layouts.tar.xz
# (the layout tests), each for its own call (`tar -xJf .gpu-pack/gpu.tar.xz`, carrying
# .gpu-pack).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.gpu
rm -rf "$out" && mkdir -p "$out"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
cargo build --release --locked --features cuda --bin pipe
cp target/release/pipe "$out/pipe"
# The test binaries' paths, from cargo's own record of what it built.
test_binary() {
  cargo test --release --locked --features cuda "$@" --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' | tail -n 1
}
cp "$(test_binary -p pipe-kernels --test backend)" "$out/backend-tests"
cp "$(test_binary -p pipe-stages --test layouts)" "$out/layout-tests"
strip "$out"/pipe "$out"/backend-tests "$out"/layout-tests
cp experiments/gpu/run.sh experiments/gpu/step.sh experiments/gpu/gpt2.sh experiments/gpu/compare.sh experiments/gpu/peer.py \
  experiments/gpu/table.py experiments/gpu/loss_check.sh experiments/gpu/loss_peer.py \
  experiments/gpu/wide_vocab.py experiments/gpu/documents_check.sh "$out/"
# The token corpus gpt2.sh trains on, made here: Tiny Shakespeare in the repository's BPE of
# 1,024 tokens padded to GPT-2's 50,257 (wide_vocab.py), so gpt2-small is GPT-2 124M.
python3 experiments/gpu/wide_vocab.py data/tokenizers/shakespeare-bpe-1024.json > "$out/wide.json"
"$out/pipe" tokenize --tokenizer "$out/wide.json" --input data/tinyshakespeare.txt --out "$out/corpus"
du -sh "$out"/*
for d in .gpu-pack .gpu-oracle; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
  rm -rf "$d" && mkdir -p "$d"
done
tar -cf - --exclude="$out/layout-tests" "$out" | xz -T0 -6 > .gpu-pack/gpu.tar.xz
tar -cf - "$out/layout-tests" | xz -T0 -6 > .gpu-oracle/layouts.tar.xz
du -sh .gpu-pack/* .gpu-oracle/*
