//! Helpers the binary's integration tests share: scratch paths of a test's own, running `pipe`
//! (to the end or in the background), a run's output checked for success, for a one-line
//! refusal or for a failure, and the parts of its lines (`done:`, a lost replica's).

#![allow(dead_code, clippy::unwrap_used)]

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod scratch;
#[allow(unused_imports)] // Not every suite writes files.
pub use scratch::{fresh_dir, fresh_file, fresh_path, suite_dir};

/// The words of `line`, split at whitespace, as a command line's arguments (no quoting: a
/// path goes on as an argument of its own).
pub fn words(line: &str) -> Vec<&str> {
    line.split_whitespace().collect()
}

/// Writes the config file of a small synthetic run into `d` (`mlp-64-32x8-10` on 2,048
/// samples of 64 features and 10 classes, one thread a worker, a flops partition) with the
/// settings `more` (TOML lines) first; returns its path.
pub fn small_config(d: &Path, more: &str) -> String {
    let path = d.join("small.toml");
    std::fs::write(
        &path,
        format!(
            "{more}dataset = \"synthetic\"\nmodel = \"mlp-64-32x8-10\"\nthreads = 1\n\
             partition = \"flops\"\n\n[synthetic]\ninputs = 64\nclasses = 10\nhidden = 32\n\
             train = 2048\ntest = 256\n"
        ),
    )
    .unwrap();
    path.to_str().unwrap().to_string()
}

/// The `[model]` table of a small GPT over `vocab` token ids, context 32: an embedding of
/// width 16, two blocks of two heads, a layer norm and the head.
pub fn small_gpt(vocab: usize) -> String {
    format!(
        r#"[model]
input = [32]
layers = [
  {{ type = "embedding", vocab = {vocab}, width = 16, context = 32 }},
  {{ type = "transformer_block", width = 16, heads = 2 }},
  {{ type = "transformer_block", width = 16, heads = 2 }},
  {{ type = "layer_norm", features = 16 }},
  {{ type = "lm_head", width = 16, vocab = {vocab} }},
]
"#
    )
}

/// A path as the `&str` a command-line argument takes.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The `pipe` binary as a command with `args`, not yet run: no backtraces (so an error is its
/// one line), this test binary's cache directory ([`cache_dir`]) and its temporary folder
/// ([`temp_dir`]).
pub fn pipe_command(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pipe"));
    cmd.args(args)
        .env_remove("RUST_BACKTRACE")
        .env("PIPE_CACHE_DIR", cache_dir())
        .env("TMPDIR", temp_dir());
    cmd
}

/// The temporary folder (`TMPDIR`) of the runs the tests start, in this test binary's scratch
/// folder: what a run that a test kills cannot remove (its launch and drained-state folders)
/// goes when the next run of the suite sweeps the scratch folders of ended binaries.
pub fn temp_dir() -> std::path::PathBuf {
    let d = suite_dir().join("tmp");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs the `pipe` binary with `args` ([`pipe_command`]) to its end.
pub fn pipe(args: &[&str]) -> Output {
    pipe_command(args).output().expect("run pipe")
}

/// Runs the `pipe` binary with `args` and its cache in `cache`, a directory of the caller's
/// own.
pub fn pipe_cached(cache: &Path, args: &[&str]) -> Output {
    pipe_command(args)
        .env("PIPE_CACHE_DIR", cache)
        .output()
        .expect("run pipe")
}

/// Starts `cmd` in the background with its standard output and error piped.
pub fn spawn_piped(cmd: &mut Command) -> Child {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start pipe")
}

/// Waits until `path` exists (a checkpoint a running run writes), failing after 60 s.
#[track_caller]
pub fn wait_for(path: &Path) {
    let started = Instant::now();
    while !path.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no checkpoint: {} did not appear",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The cache directory the tests' runs use (`PIPE_CACHE_DIR`): one per test binary, in its
/// scratch folder, so that measured transport costs land there, not in the user's cache.
pub fn cache_dir() -> std::path::PathBuf {
    suite_dir().join("cache")
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

/// Asserts that a run was refused as bad input ([`refused`] with `needle`), on a line that
/// starts `error: `, with no panic or backtrace.
#[track_caller]
pub fn assert_bad_input(args: &[&str], needle: &str) {
    let out = pipe(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "args {args:?}: stderr {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line expected, got {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    assert!(lines[0].contains(needle), "expected '{needle}' in '{err}'");
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{err}"
    );
}

/// [`assert_bad_input`] for each of `cases`: the arguments as one line ([`words`]) and what
/// the error line says.
#[track_caller]
pub fn assert_bad_inputs(cases: &[(&str, &str)]) {
    for (args, needle) in cases {
        assert_bad_input(&words(args), needle);
    }
}

/// Asserts that a run failed (exit 1) with the last line of its standard error holding
/// `needle`; returns its standard error.
#[track_caller]
pub fn failed(out: &Output, needle: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.lines().last().is_some_and(|l| l.contains(needle)),
        "{err}"
    );
    err
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

/// The update a lost replica's line says its segment was taken over at ("taken over at
/// update N:"), if it says so.
pub fn taken_over_at(line: &str) -> Option<u64> {
    line.split("(taken over at update ")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.parse().ok())
}

/// The first line of `text` (a run's output) that starts with `prefix`.
#[track_caller]
pub fn line_starting<'t>(text: &'t str, prefix: &str) -> &'t str {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting '{prefix}': {text}"))
}

/// From a run's output: the line that reports a lost replica (starting with `lost`), checked
/// to go on with replicas [2, 1], and the update the run went on from.
#[track_caller]
pub fn lost_replica<'t>(text: &'t str, lost: &str) -> (&'t str, u64) {
    let line = line_starting(text, lost);
    assert!(line.contains("replicas [2, 1]"), "{line}");
    (line, resumed_from(line))
}

/// From a run's output: the update a lost replica's run went on from (the line starting with
/// `lost`) and the update the replica rejoined at, checking that it rejoined later and on
/// two replicas per stage.
#[track_caller]
pub fn lost_then_rejoined(text: &str, lost: &str) -> (u64, u64) {
    let (lost, back) = (
        line_starting(text, lost),
        line_starting(text, "the lost replicas rejoin:"),
    );
    assert!(back.contains("replicas [2, 2]"), "{back}");
    let (from, to) = (resumed_from(lost), resumed_from(back));
    assert!(from < to, "{lost}\n{back}");
    (from, to)
}
