//! The language model from the command line: a small GPT (a layer list on Tiny Shakespeare)
//! trains single-worker and pipelined with the embedding tied to the head across stages, the
//! same run is reproducible, its checkpoint evaluates and samples text, and bad sampling input
//! exits 2 with one line.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

mod common;
use common::{fresh_path, pipe};

/// Two blocks of width 16 over the 65 characters, context 32, the head tied to the embedding.
fn config() -> PathBuf {
    let settings = "dataset = \"tinyshakespeare\"\noptimizer = \"adamw\"\nlr = 3e-3\n\
                    microbatch_size = 8\nepochs = 1\nsteps = 12\nthreads = 1\n";
    let tie = "tied = [{ param = \"layers.4.weight\", to = \"layers.0.token\" }]\n";
    let text = format!("{settings}{}{tie}", common::small_gpt(65));
    common::fresh_file("tiny-gpt.toml", &text)
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
    let ckpt = fresh_path("ckpt");
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

/// Asserts that `pipe` refuses `args` as bad input on one line that holds `needle`.
#[track_caller]
fn assert_bad_input(args: &[&str], needle: &str) {
    common::refused(&pipe(args), &[needle]);
}

#[test]
fn bad_language_model_input_exits_2() {
    let ckpt = fresh_path("bad-ckpt");
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
    assert_bad_input(
        &["sample", "--checkpoint", c, "--temperature", "1e39"],
        "1e39 is too large",
    );
    assert_bad_input(&["sample", "--checkpoint", c, "--top-k", "0"], "top-k");
    // A vocabulary edited in the run state and resealed: cut short (the model still predicts
    // the original's tokens), then with a character twice (no vocabulary is read so).
    type Edit = fn(&mut Vec<serde_json::Value>);
    let edits: [(Edit, &str); 2] = [
        (|chars| chars.truncate(10), "the checkpoint is damaged"),
        (
            |chars| chars[1] = chars[0].clone(),
            "must be sorted with each character once",
        ),
    ];
    for (edit, want) in edits {
        let forged = fresh_path("forged-vocab");
        let copied = std::process::Command::new("cp")
            .args(["-r", c, forged.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(copied.success());
        let latest = std::fs::read_to_string(forged.join("latest")).unwrap();
        let dir = forged.join(latest.trim());
        let state_path = dir.join("state.json");
        let mut state: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&state_path).unwrap()).unwrap();
        edit(state["vocab"]["chars"].as_array_mut().unwrap());
        let bytes = state.to_string();
        std::fs::write(&state_path, &bytes).unwrap();
        let hash = std::process::Command::new("sha256sum")
            .arg(&state_path)
            .output()
            .unwrap();
        let hash = String::from_utf8_lossy(&hash.stdout);
        let manifest_path = dir.join("manifest.json");
        let mut manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&manifest_path).unwrap()).unwrap();
        for f in manifest["files"].as_array_mut().unwrap() {
            if f["name"] == "state.json" {
                f["bytes"] = bytes.len().into();
                f["sha256"] = hash.split_whitespace().next().unwrap().into();
            }
        }
        std::fs::write(&manifest_path, manifest.to_string()).unwrap();
        assert_bad_input(
            &[
                "sample",
                "--checkpoint",
                forged.to_str().unwrap(),
                "--prompt",
                "a",
            ],
            want,
        );
    }
    assert_bad_input(
        &[
            "sample",
            "--checkpoint",
            fresh_path("nothing").to_str().unwrap(),
        ],
        "nothing",
    );
    // A classifier's checkpoint has no vocabulary.
    let mlp = fresh_path("mlp-ckpt");
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
