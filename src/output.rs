//! What every command shares on the way out: writing standard output (a reader that leaves
//! early ends the program quietly), the bad-input error type, and the exit status an error
//! maps to (2 for bad input, 130 or 143 for a run stopped by Ctrl-C or SIGTERM, 1 for failures
//! at run time).

use pipe_scheduler::ScheduleError;
use pipe_stages::StageError;

/// An error caused by what the user gave us (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct BadInput(String);

/// Writes to standard output. When the reader has gone away (a closed pipe) the program ends
/// at once with status 0, as a command killed by SIGPIPE would, with nothing on standard error:
/// the output was not wanted. Any other write failure is reported on standard error and ends
/// the program with status 1.
pub fn write_out(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    let result = stdout.write_fmt(args).and_then(|()| stdout.flush());
    if let Err(e) = result {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: writing standard output: {e}");
        std::process::exit(1);
    }
}

/// A run stopped on request (Ctrl-C, SIGTERM) after saving what it could.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Interrupted {
    /// What stopped it, and where to resume.
    pub message: String,
    /// Its exit code: 128 plus the signal's number (130 for SIGINT, 143 for SIGTERM), as a
    /// shell reports a process the signal ended.
    pub code: u8,
}

/// An error caused by user input: `msg` is what the user reads.
pub fn bad_input(msg: String) -> anyhow::Error {
    BadInput(msg).into()
}

/// What an experiment's results are read with and its report written with.
type ResultsIo<R> = (
    fn(&std::path::Path) -> Result<R, pipe_experiments::ExperimentError>,
    fn(&R, &std::path::Path) -> Result<std::path::PathBuf, pipe_experiments::ExperimentError>,
);

/// Regenerates an experiment's report from the results saved in `dir` (`pipe report`),
/// reading them and writing the report with `io`, and prints where the report went.
///
/// # Errors
/// Bad input for a missing or malformed results file.
pub fn regenerate_report<R>(
    dir: &std::path::Path,
    (load, write): ResultsIo<R>,
) -> anyhow::Result<()> {
    let results = load(dir).map_err(experiment_error)?;
    // Not while the sweep or experiment that fills it is running (or another report).
    let _held = pipe_stages::outputs::hold_output_dir(dir, "--from")?;
    let path = write(&results, dir).map_err(experiment_error)?;
    outln!("report: {}", path.display());
    Ok(())
}

/// An experiment's error as the command line reports it: bad input (exit 2) for a malformed
/// configuration or results file and for settings `pipe train` would refuse.
pub fn experiment_error(e: pipe_experiments::ExperimentError) -> anyhow::Error {
    use pipe_experiments::ExperimentError;
    match e {
        ExperimentError::Config(m) => bad_input(m),
        ExperimentError::Stage(s) if s.is_bad_input() => anyhow::Error::from(s),
        ExperimentError::Schedule(s) => schedule_error(s),
        other => anyhow::Error::from(other),
    }
}

/// A scheduler error as the command line reports it: bad input (exit 2) when the scheduler
/// blames its input, a run-time failure otherwise.
pub fn schedule_error(e: ScheduleError) -> anyhow::Error {
    if e.is_bad_input() {
        bad_input(e.to_string())
    } else {
        anyhow::Error::new(e)
    }
}

/// Exit status for an error: 2 for bad input, 1 otherwise.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    for cause in e.chain() {
        if cause.downcast_ref::<BadInput>().is_some() {
            return 2;
        }
        if let Some(stopped) = cause.downcast_ref::<Interrupted>() {
            return stopped.code;
        }
        if let Some(s) = cause.downcast_ref::<StageError>() {
            return if s.is_bad_input() { 2 } else { 1 };
        }
        if let Some(c) = cause.downcast_ref::<clap::Error>() {
            return if c.use_stderr() { 2 } else { 0 };
        }
    }
    1
}
