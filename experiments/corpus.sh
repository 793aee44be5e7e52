# Sourced (from the repository root) by the experiments that train on the 1,024-token BPE of
# Tiny Shakespeare: builds pipe and sets $pipe to it, makes a scratch folder $work (removed when
# the script exits) and tokenizes the corpus into $work/corpus.
cargo build --release --locked --quiet --bin pipe
pipe=$PWD/target/release/pipe
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$pipe" tokenize --tokenizer data/tokenizers/shakespeare-bpe-1024.json \
  --input data/tinyshakespeare.txt --out "$work/corpus" > /dev/null
