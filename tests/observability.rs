//! What a running `pipe train` shows while it runs: the JSON-lines log grows update by
//! update during a pipelined epoch, not only at its end.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const PIPE: &str = env!("CARGO_BIN_EXE_pipe");

#[test]
fn the_jsonl_log_grows_during_a_pipelined_epoch() {
    let d = std::env::temp_dir().join(format!("pipe-obs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let log = d.join("run.jsonl");
    let mut child = Command::new(PIPE)
        .args([
            "train",
            "--dataset",
            "synthetic",
            "--model",
            "mlp-784-256x4-10",
        ])
        .args([
            "--epochs",
            "1",
            "--stages",
            "2",
            "--replicas",
            "2",
            "--threads",
            "1",
        ])
        .args(["--partition", "flops", "--log-jsonl", log.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Line counts seen while the epoch runs (before its epoch record).
    let mut seen: Vec<usize> = Vec::new();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(120) {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("\"kind\":\"epoch\"") {
            break;
        }
        let lines = text.lines().count();
        // Only whole lines: every one parses.
        for l in text.lines() {
            serde_json::from_str::<serde_json::Value>(l).unwrap();
        }
        if lines > 0 && seen.last() != Some(&lines) {
            seen.push(lines);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(child.wait().unwrap().success());
    assert!(
        seen.len() >= 3,
        "the log grew only {seen:?} before the epoch ended"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let steps = text
        .lines()
        .filter(|l| l.contains("\"kind\":\"step\""))
        .count();
    assert_eq!(steps, 64, "one record per update");
}
