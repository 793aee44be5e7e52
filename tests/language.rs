//! The language model from the command line: a small GPT (a layer list on Tiny Shakespeare)
//! trains single-worker and pipelined with the embedding tied to the head across stages, the
//! same run is reproducible, its checkpoint evaluates and samples text, and bad sampling input
//! exits 2 with one line.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

fn pipe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pipe"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("run pipe")
}

fn tmp(name: &str) -> PathBuf {
    common::fresh_path("language", name)
}

/// Two blocks of width 16 over the 65 characters, context 32, the head tied to the embedding.
const TINY_GPT: &str = r#"
dataset = "tinyshakespeare"
optimizer = "adamw"
lr = 3e-3
microbatch_size = 8
epochs = 1
steps = 12
threads = 1
[model]
input = [32]
layers = [
  { type = "embedding", vocab = 65, width = 16, context = 32 },
  { type = "transformer_block", width = 16, heads = 2 },
  { type = "transformer_block", width = 16, heads = 2 },
  { type = "layer_norm", features = 16 },
  { type = "lm_head", width = 16, vocab = 65 },
]
tied = [{ param = "layers.4.weight", to = "layers.0.token" }]
"#;

fn config() -> PathBuf {
    let path = tmp("tiny-gpt.toml");
    std::fs::write(&path, TINY_GPT).unwrap();
    path
}

fn train(extra: &[&str], checkpoints: Option<&Path>) -> String {
    let cfg = config();
    let mut args = vec!["train", "--config", cfg.to_str().unwrap()];
    args.extend_from_slice(extra);
    let dir;
    if let Some(d) = checkpoints {
        dir = d.display().to_string();
        args.extend_from_slice(&["--checkpoint-dir", &dir]);
    }
    common::ok(&pipe(&args))
}

#[test]
fn a_tied_gpt_trains_pipelined_reproducibly_and_samples_from_its_checkpoint() {
    let ckpt = tmp("ckpt");
    let pipelined = [
        "--stages",
        "2",
        "--schedule",
        "1f1b-flush",
        "--microbatches",
        "2",
        "--partition",
        "0-1,2-4",
    ];
    let a = train(&pipelined, Some(&ckpt));
    assert!(a.contains("nats/char") && a.contains("tokens/s"), "{a}");
    let loss = |text: &str| -> f64 {
        common::done_line(text)
            .split("test loss ")
            .nth(1)
            .and_then(|r| r.split(',').next())
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!(
        loss(&a) < 4.0,
        "validation loss {} after 12 updates",
        loss(&a)
    );
    // The same run again gives the same weights.
    let b = train(&pipelined, None);
    assert_eq!(common::weights(&a), common::weights(&b));
    // One worker with the same batch computes the same updates (summed in another order).
    let one = train(&["--microbatches", "2"], None);
    assert!(
        (loss(&a) - loss(&one)).abs() < 1e-3,
        "pipelined {} against one worker {}",
        loss(&a),
        loss(&one)
    );

    let eval = common::ok(&pipe(&["eval", "--checkpoint", ckpt.to_str().unwrap()]));
    assert!(eval.contains(&common::weights(&a)), "{eval}");
    let sample = |seed: &str| {
        common::ok(&pipe(&[
            "sample",
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--prompt",
            "ROMEO:",
            "--tokens",
            "40",
            "--seed",
            seed,
        ]))
    };
    let s1 = sample("1");
    assert!(s1.starts_with("ROMEO:"), "{s1}");
    assert_eq!(
        s1.trim_end_matches('\n').chars().count(),
        "ROMEO:".len() + 40
    );
    assert_eq!(s1, sample("1"), "the same seed gives the same text");
    let greedy = common::ok(&pipe(&[
        "sample",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--temperature",
        "0",
        "--tokens",
        "10",
    ]));
    assert_eq!(
        greedy.trim_end_matches('\n').chars().count(),
        1 + 10,
        "{greedy:?}"
    );
}

#[track_caller]
fn assert_bad_input(args: &[&str], needle: &str) {
    let out = pipe(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "args {args:?}: stderr {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line expected, got {err}");
    assert!(lines[0].contains(needle), "expected '{needle}' in '{err}'");
}

#[test]
fn bad_language_model_input_exits_2() {
    let ckpt = tmp("bad-ckpt");
    train(&[], Some(&ckpt));
    let c = ckpt.to_str().unwrap();
    assert_bad_input(
        &["sample", "--checkpoint", c, "--prompt", "caf\u{e9}"],
        "not in the vocabulary",
    );
    assert_bad_input(
        &["sample", "--checkpoint", c, "--prompt", ""],
        "prompt is empty",
    );
    assert_bad_input(
        &["sample", "--checkpoint", c, "--temperature=-1"],
        "temperature",
    );
    assert_bad_input(&["sample", "--checkpoint", c, "--top-k", "0"], "top-k");
    assert_bad_input(
        &["sample", "--checkpoint", tmp("nothing").to_str().unwrap()],
        "nothing",
    );
    // A classifier's checkpoint has no vocabulary.
    let mlp = tmp("mlp-ckpt");
    common::ok(&pipe(&[
        "train",
        "--dataset",
        "synthetic",
        "--model",
        "mlp-784-16-10",
        "--steps",
        "2",
        "--epochs",
        "1",
        "--checkpoint-dir",
        mlp.to_str().unwrap(),
    ]));
    assert_bad_input(
        &["sample", "--checkpoint", mlp.to_str().unwrap()],
        "not a language model",
    );
    // Language presets need a text dataset; ties are for gpt presets.
    assert_bad_input(
        &["train", "--model", "gpt-mini", "--dataset", "mnist"],
        "language model",
    );
    assert_bad_input(
        &["train", "--model", "mlp-784-16-10", "--tie-embeddings"],
        "tie-embeddings",
    );
}
