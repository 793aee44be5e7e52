//! Helpers the binary's integration tests share: running `pipe`, a run's output checked for
//! success or for a one-line refusal, and the `done:` line's parts.

#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A path `name` that no other call has returned: under this test binary's scratch folder
/// (`TMP/pipe-SUITE-PID`), in a numbered folder of its own, so that tests running side by
/// side never write or delete each other's files, and a file one run reads is never rewritten
/// under it by another test. Nothing is at the path yet; its parent exists.
pub fn fresh_path(suite: &str, name: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir()
        .join(format!("pipe-{suite}-{}", std::process::id()))
        .join(n.to_string());
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// A new empty folder `name` of this test's own ([`fresh_path`]).
pub fn fresh_dir(suite: &str, name: &str) -> PathBuf {
    let d = fresh_path(suite, name);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes `text` to a file `name` of this call's own ([`fresh_path`]) and returns its path.
pub fn fresh_file(suite: &str, name: &str, text: &str) -> PathBuf {
    let p = fresh_path(suite, name);
    std::fs::write(&p, text).unwrap();
    p
}

/// A path as the `&str` a command-line argument takes.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs the `pipe` binary with `args` (no backtraces, so an error is its one line).
pub fn pipe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pipe"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .env("PIPE_CACHE_DIR", cache_dir())
        .output()
        .expect("run pipe")
}

/// The cache directory the tests' runs use (`PIPE_CACHE_DIR`): one per test binary, so that
/// measured transport costs land in a scratch directory, not the user's cache.
pub fn cache_dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("pipe-test-cache-{}", std::process::id()))
}

/// Asserts that a run was refused as bad input: exit 2 and one line on standard error that
/// holds every one of `needles`.
#[track_caller]
pub fn refused(out: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    for n in needles {
        assert!(lines[0].contains(n), "expected '{n}' in {err}");
    }
}

/// Asserts that a run succeeded and returns its standard output (both streams in the
/// failure message).
#[track_caller]
pub fn ok(out: &Output) -> String {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The `done:` line of a run's output.
#[track_caller]
pub fn done_line(text: &str) -> &str {
    let line = text
        .lines()
        .find(|l| l.starts_with("done:"))
        .unwrap_or_else(|| panic!("no done line in {text}"));
    assert!(line.contains("weights "), "{line}");
    line
}

/// The `done:` line without its wall time: steps, accuracy, loss and the weights' digest.
#[track_caller]
pub fn done(text: &str) -> String {
    done_line(text).rsplit_once(',').unwrap().0.to_string()
}

/// The final weights' digest from the `done:` line.
#[track_caller]
pub fn weights(text: &str) -> String {
    done_line(text)
        .split("weights ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .unwrap()
        .to_string()
}

/// The update a run went on from, in a line that reports a lost replica (`... from update N
/// (the segment runs again)`).
#[track_caller]
pub fn resumed_from(line: &str) -> u64 {
    line.split("from update ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no update in {line}"))
}

/// From a run's output: the update a lost replica's run went on from (the line starting with
/// `lost`) and the update the replica rejoined at, checking that it rejoined later and on
/// two replicas per stage.
#[track_caller]
pub fn lost_then_rejoined(text: &str, lost: &str) -> (u64, u64) {
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no line starting '{prefix}': {text}"))
    };
    let (lost, back) = (line(lost), line("the lost replicas rejoin:"));
    assert!(back.contains("replicas [2, 2]"), "{back}");
    let (from, to) = (resumed_from(lost), resumed_from(back));
    assert!(from < to, "{lost}\n{back}");
    (from, to)
}
