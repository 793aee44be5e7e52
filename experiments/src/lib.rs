//! `pipe-experiments` owns experiments and benchmarks that span crates: what a user runs to get a
//! number they can trust, with the method written next to it. Each experiment is a function that
//! returns a typed report (so tests can run it small) plus a renderer; the `pipe bench`
//! subcommands only parse flags and print. The staleness study (`pipe experiment staleness`) and
//! the throughput sweep (`pipe bench`) write Markdown reports with SVG plots (plotters) and the
//! CSV behind each plot; [`plot`] and [`machine`] are shared by both. The single benchmarks
//! behind `pipe bench mfu`, `pipeline`, `partition`, `transport` and `hosts` are [`mfu`],
//! [`pipeline`], [`partition`], [`transport`] and [`hosts`]; [`link`] measures what a message
//! costs on a transport, for the simulator's cost model.

#![warn(missing_docs)]

pub mod bench;
pub mod flags;
pub mod hosts;
pub mod machine;
pub mod mfu;
pub mod partition;
pub mod pipeline;
pub mod plot;
pub mod staleness;
pub mod transport;

/// Errors of experiments.
#[derive(Debug, thiserror::Error)]
pub enum ExperimentError {
    /// Training or model construction failed.
    #[error(transparent)]
    Stage(#[from] pipe_stages::StageError),
    /// A kernel failed.
    #[error(transparent)]
    Kernel(#[from] pipe_kernels::KernelError),
    /// A transport failed while a link or an all-reduce was measured.
    #[error("transport: {0}")]
    Transport(#[from] pipe_transport::TransportError),
    /// A schedule could not be built or simulated.
    #[error(transparent)]
    Schedule(#[from] pipe_scheduler::ScheduleError),
    /// The experiment's parameters are invalid.
    #[error("{0}")]
    Config(String),
}

pub use pipe_transport::measure::median;

/// The most bytes a saved results file (`results.json`, a criterion or numpy figures file)
/// may hold: far past what any sweep writes (the staleness matrix's is about 8 MB).
pub const MAX_RESULTS_BYTES: u64 = 256 << 20;

/// Reads a results file as UTF-8 text, at most [`MAX_RESULTS_BYTES`].
///
/// # Errors
/// [`ExperimentError::Config`] naming the file: missing, unreadable, not UTF-8; the limit's
/// error for a longer file.
pub fn read_results_file(path: &std::path::Path) -> Result<String, ExperimentError> {
    let bytes = pipe_stages::limits::read_file(path, MAX_RESULTS_BYTES)?;
    String::from_utf8(bytes)
        .map_err(|e| ExperimentError::Config(format!("{}: not UTF-8 text: {e}", path.display())))
}

/// The discussion a person wrote beside a command's results (`DIR/discussion.md`), which its
/// report includes verbatim: `None` where there is none. Read as any text file a command is
/// given is (`pipe_stages::limits::read_text_file`): a FIFO there would block the report
/// forever, a link to `/dev/zero` fill memory, and text that is not UTF-8 would vanish from the
/// report without a word.
///
/// # Errors
/// Bad input naming the file when it is not a regular file, is past the text-file bound or is
/// not UTF-8.
pub fn read_discussion(dir: &std::path::Path) -> Result<Option<String>, ExperimentError> {
    let path = dir.join("discussion.md");
    if std::fs::symlink_metadata(&path).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
        return Ok(None);
    }
    Ok(Some(pipe_stages::limits::read_text_file(
        &path,
        "the discussion",
    )?))
}

/// Claims `out` for a command (`what`) that writes its `results.json` and `REPORT.md` there,
/// before the work that fills it, so that no hour of measurement ends in a refusal: `out` must
/// be a directory or one that can be made ([`pipe_stages::outputs::check_output_dir`]), and
/// results already there must be this command's own (`own` reads them), which a new run
/// replaces. Results another command wrote, or a `REPORT.md` without results beside it, are
/// refused rather than overwritten.
///
/// # Errors
/// Bad input naming `out` and the file in the way.
pub fn claim_results_dir(
    out: &std::path::Path,
    what: &str,
    own: impl Fn(&std::path::Path) -> Result<(), ExperimentError>,
) -> Result<(), ExperimentError> {
    pipe_stages::outputs::check_output_dir(out, "--out")?;
    let refused = |why: String| {
        ExperimentError::Config(format!(
            "--out {}: {why}: give {what} a directory of its own, or move that file",
            out.display()
        ))
    };
    let results = out.join("results.json");
    if std::fs::symlink_metadata(&results).is_ok() {
        return own(out).map_err(|e| {
            refused(format!(
                "holds a results.json that is not {what}'s, which this run would replace ({e})"
            ))
        });
    }
    if std::fs::symlink_metadata(out.join("REPORT.md")).is_ok() {
        return Err(refused(
            "holds a REPORT.md with no results.json beside it, which this run would replace".into(),
        ));
    }
    Ok(())
}

/// The samples/s of a `pipe train` or `pipe worker` chief's last epoch line, from its output
/// (its tokens/s over `tokens` per sample for a language model).
pub fn chief_samples_per_s(out: &str, tokens: Option<usize>) -> Option<f64> {
    let (unit, per) = match tokens {
        Some(t) => ("tokens/s", t.max(1) as f64),
        None => ("samples/s", 1.0),
    };
    out.lines()
        .filter(|l| l.starts_with("epoch"))
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let at = words.iter().position(|w| *w == unit)?;
            let v: f64 = words.get(at.checked_sub(1)?)?.parse().ok()?;
            Some(v / per)
        })
        .next_back()
}
