//! Your own data from the command line: `pipe tokenize` turns text into shards with the ids
//! the Python `tokenizers` package gives (the committed GPT-2-style BPE, checked against the
//! digest its maker printed), a model trains on them streamed from disk, a checkpoint taken
//! mid-epoch resumes to the bit-identical end of the run it interrupted and resumes under
//! another layout at the same data cursor, its checkpoint samples text through the corpus's
//! tokenizer, and bad input and bad shards exit 2 with one line
//! naming the file and byte.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Output;

use sha2::{Digest, Sha256};

mod common;
use common::{fresh_path, ok, pipe, refused, s, weights};

const BPE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/data/tokenizers/shakespeare-bpe-1024.json"
);
const SHAKESPEARE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/data/tinyshakespeare.txt");

/// What `data/tokenizers/make_shakespeare_bpe.py` printed for the whole of Tiny Shakespeare,
/// encoded by Python's `tokenizers` in one call.
const PYTHON_IDS: usize = 459_913;
const PYTHON_SHA256: &str = "2d79b3bd7ad312ec55b8e5e64e994a607d7d7db8000bd0216b0e89e967a0aa09";

/// Tiny Shakespeare through the BPE into shards of `shard_tokens` ids.
fn bpe_corpus(name: &str, shard_tokens: &str) -> PathBuf {
    tokenized(Path::new(SHAKESPEARE), name, shard_tokens)
}

/// `input` (a file, or a directory of documents) through the BPE into shards of
/// `shard_tokens` ids, in a corpus named `name`.
fn tokenized(input: &Path, name: &str, shard_tokens: &str) -> PathBuf {
    let out = fresh_path(name);
    ok(&tokenize(
        BPE,
        s(input),
        &out,
        &["--shard-tokens", shard_tokens],
    ));
    out
}

/// `pipe tokenize` of `input` through `tokenizer` into `out`, with `more` arguments.
fn tokenize(tokenizer: &str, input: &str, out: &Path, more: &[&str]) -> Output {
    let args = ["tokenize", "--tokenizer", tokenizer, "--input", input];
    pipe(&[&args[..], &["--out", s(out)], more].concat())
}

/// Every id of a corpus, shard after shard.
fn all_ids(dir: &Path) -> Vec<u32> {
    let corpus = pipe_stages::shards::TokenCorpus::open(dir).unwrap();
    let mut ids = Vec::new();
    let counts: Vec<u64> = corpus.shard_tokens().collect();
    for (i, n) in counts.into_iter().enumerate() {
        corpus.read(i, 0, n as usize, &mut ids).unwrap();
    }
    ids
}

#[test]
fn tokenize_gives_the_python_tokenizers_ids_in_shards() {
    let dir = bpe_corpus("python", "50000");
    let manifest = pipe_stages::shards::read_manifest(&dir).unwrap();
    assert_eq!(manifest.shards.len(), 10, "{manifest:?}");
    assert_eq!(manifest.tokenizer.vocab_size, 1024);
    let mut ids = all_ids(&dir);
    // The document ends with <|endoftext|>, id 0.
    assert_eq!(ids.pop(), Some(0));
    assert_eq!(ids.len(), PYTHON_IDS);
    let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    let digest: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(digest, PYTHON_SHA256);
    let check = ok(&pipe(&["tokenize", "--check", s(&dir)]));
    assert!(check.contains("every id below 1024"), "{check}");
}

/// A two-block GPT over the BPE's 1,024 ids, context 32.
fn token_gpt() -> String {
    let settings = "optimizer = \"adamw\"\nlr = 3e-3\nmicrobatch_size = 4\nmicrobatches = 2\n\
                    epochs = 1\nsteps = 12\nthreads = 1\neval_windows = 32\n";
    format!("{settings}{}", common::small_gpt(1024))
}

fn train(corpus: &Path, extra: &[&str]) -> Output {
    let cfg = common::fresh_file("token-gpt.toml", &token_gpt());
    let dataset = format!("tokens:{}", s(corpus));
    let mut args = vec!["train", "--config", s(&cfg), "--dataset", &dataset];
    args.extend_from_slice(extra);
    pipe(&args)
}

#[test]
fn a_checkpoint_taken_mid_epoch_on_shards_resumes_to_the_same_weights_under_any_layout() {
    let corpus = bpe_corpus("resume", "50000");
    let ckpt = fresh_path("ckpt");
    let whole = ok(&train(
        &corpus,
        &[
            "--checkpoint-dir",
            s(&ckpt),
            "--checkpoint-every",
            "4",
            "--keep-checkpoints",
            "5",
        ],
    ));
    assert!(whole.contains("nats/token"), "{whole}");
    // Resume from update 4 of the 12 (48 windows into an epoch of thousands).
    let from = ckpt.join("ckpt-00000004");
    assert!(from.exists(), "{whole}");
    let resumed = ok(&train(&corpus, &["--resume", s(&from)]));
    assert!(
        resumed.contains("resuming from") && resumed.contains("32 samples into it"),
        "{resumed}"
    );
    assert_eq!(weights(&resumed), weights(&whole));

    // Another layout reads the data from the same cursor.
    let piped = ok(&train(
        &corpus,
        &[
            "--resume",
            s(&from),
            "--stages",
            "2",
            "--schedule",
            "1f1b-flush",
        ],
    ));
    assert!(piped.contains("32 samples into it"), "{piped}");

    // A checkpoint of one corpus does not resume on another.
    let other = bpe_corpus("other-corpus", "60000");
    refused(&train(&other, &["--resume", s(&from)]), &["another corpus"]);
}

#[test]
fn a_checkpoint_of_a_token_corpus_samples_text_through_the_corpus_tokenizer() {
    let corpus = bpe_corpus("sample", "50000");
    let ckpt = fresh_path("sample-ckpt");
    ok(&train(
        &corpus,
        &["--steps", "2", "--checkpoint-dir", s(&ckpt)],
    ));
    let sample = |tokenizer: &Path| {
        pipe(&[
            "sample",
            "--checkpoint",
            s(&ckpt),
            "--tokenizer",
            s(tokenizer),
            "--prompt",
            "ROMEO:",
            "--tokens",
            "12",
            "--seed",
            "3",
        ])
    };
    let text = ok(&sample(&corpus));
    assert!(
        text.starts_with("ROMEO:") && text.len() > "ROMEO:\n".len(),
        "{text}"
    );
    // The same tokenizer as a file gives the same draws and the same text.
    assert_eq!(ok(&sample(Path::new(BPE))), text);

    refused(
        &pipe(&["sample", "--checkpoint", s(&ckpt)]),
        &["tokenized corpus", "--tokenizer"],
    );
    let other = bpe_corpus("sample-other", "60000");
    refused(
        &sample(&other),
        &["not the corpus the checkpoint trained on"],
    );
}

/// The bytes of a corpus's first shard, to damage.
fn first_shard(dir: &Path) -> PathBuf {
    dir.join("shard-00000.tok")
}

/// A BPE over `a` and `b` alone, split at whitespace, with no unknown token or byte fallback.
const NARROW_BPE: &str = r#"{"version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [], "normalizer": null,
  "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
  "model": {"type": "BPE", "dropout": null, "unk_token": null,
    "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
    "byte_fallback": false, "ignore_merges": false,
    "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}}"#;

#[test]
fn bad_input_and_bad_shards_exit_2_with_one_line_naming_file_and_byte() {
    let out = fresh_path("bad-out");
    // No such input; not UTF-8; a tokenizer that is not one.
    refused(
        &tokenize("bytes", "/nonexistent/x", &out, &[]),
        &["/nonexistent/x", "cannot read"],
    );
    let binary = fresh_path("binary.txt");
    std::fs::write(&binary, b"good text\n\xff\xfe bad").unwrap();
    refused(
        &tokenize("bytes", s(&binary), &out, &[]),
        &["binary.txt", "not UTF-8", "byte 10"],
    );
    let not_json = fresh_path("not-a-tokenizer.json");
    std::fs::write(&not_json, b"{\"model\": 3}").unwrap();
    refused(
        &tokenize(s(&not_json), SHAKESPEARE, &out, &[]),
        &["not-a-tokenizer.json", "not a tokenizer.json"],
    );

    // A BPE with no unknown token or byte fallback gives 'c' no token: refused, not dropped.
    let narrow = fresh_path("narrow-bpe.json");
    std::fs::write(&narrow, NARROW_BPE).unwrap();
    let text = fresh_path("abc.txt");
    std::fs::write(&text, "ab ba\ncab\n").unwrap();
    let narrow_out = fresh_path("narrow-out");
    refused(
        &tokenize(s(&narrow), s(&text), &narrow_out, &[]),
        &["abc.txt", "'c' at byte 6 has no token", "would be lost"],
    );
    assert!(!narrow_out.exists(), "nothing written for a refused corpus");
    // Where every character has a token it tokenizes (spaces are the pre-tokenizer's).
    std::fs::write(&text, "ab ba\nbab\n").unwrap();
    ok(&tokenize(s(&narrow), s(&text), &narrow_out, &[]));

    // A directory that already holds a corpus.
    let dir = fresh_path("bad-shards");
    ok(&tokenize(
        "chars",
        SHAKESPEARE,
        &dir,
        &["--shard-tokens", "400000"],
    ));
    refused(
        &tokenize("chars", SHAKESPEARE, &dir, &[]),
        &["already holds a tokenized corpus"],
    );

    // An id outside the vocabulary: --check names the shard, the token and the byte.
    let shard = first_shard(&dir);
    let good = std::fs::read(&shard).unwrap();
    let mut bad = good.clone();
    let body = bad.len() - 400_000 * 2;
    bad[body + 2 * 1000..body + 2 * 1000 + 2].copy_from_slice(&500u16.to_le_bytes());
    std::fs::write(&shard, &bad).unwrap();
    refused(
        &pipe(&["tokenize", "--check", s(&dir)]),
        &[
            "shard-00000.tok",
            "token id 500 at token 1000",
            &format!("byte {}", body + 2000),
            "vocabulary of 65",
        ],
    );

    // Truncated, and a bad magic: named when the corpus opens, by check and by train.
    std::fs::write(&shard, &good[..good.len() - 7]).unwrap();
    refused(
        &pipe(&["tokenize", "--check", s(&dir)]),
        &["shard-00000.tok", "truncated at byte"],
    );
    refused(
        &pipe(&[
            "train",
            "--model",
            "gpt-mini",
            "--dataset",
            &format!("tokens:{}", s(&dir)),
            "--steps",
            "1",
        ]),
        &["shard-00000.tok", "truncated at byte"],
    );
    let mut magic = good.clone();
    magic[0] = b'X';
    std::fs::write(&shard, &magic).unwrap();
    refused(
        &pipe(&["tokenize", "--check", s(&dir)]),
        &["shard-00000.tok", "bad magic at byte 0"],
    );
    std::fs::write(&shard, &good).unwrap();

    // A manifest naming a file outside its directory.
    let manifest = dir.join("tokens.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(
        &manifest,
        text.replace("shard-00001.tok", "../../etc/passwd"),
    )
    .unwrap();
    refused(
        &pipe(&["tokenize", "--check", s(&dir)]),
        &["tokens.json", "not a file name in the corpus directory"],
    );
    // A manifest naming one shard twice: its tokens would be read twice.
    std::fs::write(
        &manifest,
        text.replace("shard-00001.tok", "shard-00000.tok"),
    )
    .unwrap();
    refused(
        &pipe(&["tokenize", "--check", s(&dir)]),
        &["tokens.json", "shard \"shard-00000.tok\" is listed twice"],
    );
    // A document-end id past the vocabulary.
    let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
    let past = m["tokenizer"]["vocab_size"].as_u64().unwrap() + 44;
    m["tokenizer"]["document_end"] = past.into();
    std::fs::write(&manifest, m.to_string()).unwrap();
    refused(
        &pipe(&["tokenize", "--check", s(&dir)]),
        &[
            "tokens.json",
            &format!("document-end id {past} is outside the vocabulary"),
        ],
    );
    std::fs::write(&manifest, &text).unwrap();
    ok(&pipe(&["tokenize", "--check", s(&dir)]));

    // Both ways of naming the directory at once; a corpus without one.
    refused(
        &pipe(&[
            "train",
            "--dataset",
            &format!("tokens:{}", s(&dir)),
            "--data-dir",
            s(&dir),
        ]),
        &["give one"],
    );
    refused(
        &pipe(&["train", "--dataset", "tokens"]),
        &["needs its directory"],
    );
}

/// The `(steps, test loss)` of each validation record between epochs in a JSON-lines log.
fn evaluations(log: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "eval")
        .map(|v| {
            (
                v["steps"].as_u64().unwrap(),
                v["test_loss"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// `--eval-every 4` on shards, 12 updates at 2 stages: validation records after updates 4 and
/// 8 in the log (the epoch's end evaluates on its own), a line for each in the output; and a
/// resume from the checkpoint at update 6, between the two, logs the same record at 8, bit for
/// bit, and ends with the uninterrupted run's weights.
#[test]
fn evaluations_on_a_cadence_are_logged_and_a_resume_between_two_is_exact() {
    let corpus = bpe_corpus("eval", "50000");
    let ckpt = fresh_path("eval-ckpt");
    let log = fresh_path("eval.jsonl");
    let cadence = ["--stages", "2", "--eval-every", "4"];
    let every = ["--checkpoint-dir", s(&ckpt), "--checkpoint-every", "6"];
    let whole = ok(&train(
        &corpus,
        &[&cadence[..], &every, &["--log-jsonl", s(&log)]].concat(),
    ));
    let logged = evaluations(&log);
    let steps: Vec<u64> = logged.iter().map(|e| e.0).collect();
    assert_eq!(steps, [4, 8], "{whole}");
    assert!(logged.iter().all(|e| e.1.is_finite() && e.1 > 0.0));
    assert!(whole.contains("eval at update      4  val loss"), "{whole}");
    let again = fresh_path("eval-resumed.jsonl");
    let from = ckpt.join("ckpt-00000006");
    let resumed = ok(&train(
        &corpus,
        &[
            &cadence[..],
            &["--resume", s(&from), "--log-jsonl", s(&again)],
        ]
        .concat(),
    ));
    assert!(resumed.contains("resuming from"), "{resumed}");
    assert_eq!(evaluations(&again), logged[1..]);
    assert_eq!(weights(&resumed), weights(&whole));
}

/// Tiny Shakespeare as a directory of documents (runs of 200 lines), through the BPE: each
/// document ends with `<|endoftext|>` (id 0), so windows hold several.
fn document_corpus(name: &str) -> PathBuf {
    let text = std::fs::read_to_string(SHAKESPEARE).unwrap();
    let docs = fresh_path(&format!("{name}-docs"));
    std::fs::create_dir_all(&docs).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    for (i, chunk) in lines.chunks(200).enumerate() {
        std::fs::write(docs.join(format!("doc-{i:04}.txt")), chunk.join("\n")).unwrap();
    }
    tokenized(&docs, name, "1000000")
}

/// `--pack-documents`: the header says so; the run differs from the same windows unpacked;
/// worker processes (which derive the documents from the corpus themselves) end with the
/// threads' weights; and a resume from a checkpoint in the middle is exact.
#[test]
fn packed_documents_train_alike_on_threads_and_processes_and_resume_exactly() {
    let corpus = document_corpus("packed");
    let ckpt = fresh_path("packed-ckpt");
    let packed = [
        "--pack-documents",
        "--stages",
        "2",
        "--schedule",
        "pipedream",
        "--partition",
        "0-1,2-4",
    ];
    let with = |extra: &[&str]| {
        let mut args = packed.to_vec();
        args.extend_from_slice(extra);
        ok(&train(&corpus, &args))
    };
    // A checkpoint is a drain point, which changes an asynchronous run: every run here takes
    // them at the same updates.
    let threads = with(&["--checkpoint-dir", s(&ckpt), "--checkpoint-every", "6"]);
    assert!(
        threads.contains("packed documents ending with id 0"),
        "{threads}"
    );
    let other = fresh_path("packed-ckpt-processes");
    let processes = with(&[
        "--placement",
        "processes",
        "--checkpoint-dir",
        s(&other),
        "--checkpoint-every",
        "6",
    ]);
    assert_eq!(weights(&processes), weights(&threads));
    let unpacked = ok(&train(
        &corpus,
        &[
            &packed[1..],
            &[
                "--checkpoint-every",
                "6",
                "--checkpoint-dir",
                s(&fresh_path("unpacked-ckpt")),
            ],
        ]
        .concat(),
    ));
    assert_ne!(weights(&unpacked), weights(&threads));
    let resumed = with(&["--resume", s(&ckpt.join("ckpt-00000006"))]);
    assert!(resumed.contains("resuming from"), "{resumed}");
    assert_eq!(weights(&resumed), weights(&threads));
}
