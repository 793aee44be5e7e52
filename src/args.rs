//! Argument parsing and formatting that several commands share: schedule policies, times,
//! sizes and bandwidths with units, the compute backend, the flags that describe a schedule
//! (`pipe schedule` and `pipe simulate`), and the time and size formats reports print.

use anyhow::Result;
use pipe_kernels::{Backend, BackendKind};

use crate::output::bad_input;

/// A `--dataset` value: a dataset's name, and for a tokenized corpus (`tokens:DIR`) its
/// directory.
#[derive(Clone, Debug, PartialEq)]
pub struct DatasetArg {
    /// Which dataset.
    pub kind: pipe_stages::config::DatasetKind,
    /// The directory `tokens:DIR` names.
    pub dir: Option<std::path::PathBuf>,
}

/// Parses `--dataset`: `mnist`, `synthetic`, `tinyshakespeare` or `tokens:DIR`.
pub fn parse_dataset(s: &str) -> Result<DatasetArg, String> {
    match s.split_once(':') {
        Some((kind, dir)) if kind.eq_ignore_ascii_case("tokens") => {
            if dir.is_empty() {
                return Err("tokens:DIR needs the corpus directory after the colon".into());
            }
            Ok(DatasetArg {
                kind: pipe_stages::config::DatasetKind::Tokens,
                dir: Some(dir.into()),
            })
        }
        _ => Ok(DatasetArg {
            kind: s.parse()?,
            dir: None,
        }),
    }
}

/// The dataset and data directory a command's `--dataset` and `--data-dir` give together.
///
/// # Errors
/// Bad input when `tokens:DIR` and `--data-dir` both name a directory.
pub fn dataset_and_dir(
    dataset: Option<&DatasetArg>,
    data_dir: Option<&std::path::Path>,
) -> Result<(
    Option<pipe_stages::config::DatasetKind>,
    Option<std::path::PathBuf>,
)> {
    let dir_of_dataset = dataset.and_then(|d| d.dir.clone());
    if dir_of_dataset.is_some() && data_dir.is_some() {
        return Err(bad_input(
            "--dataset tokens:DIR and --data-dir both name the data's directory; give one".into(),
        ));
    }
    Ok((
        dataset.map(|d| d.kind),
        dir_of_dataset.or_else(|| data_dir.map(std::path::Path::to_path_buf)),
    ))
}

/// Opens the backend a run names for its first worker, with `threads` compute threads
/// (through [`pipe_stages::pipeline::open_backend`], which places every worker), turning a
/// device this machine lacks into bad input.
///
/// # Errors
/// Bad input (exit 2) when this build or machine has no such device: a build without CUDA,
/// no driver, GPU or NVRTC, or `--precision bf16x6` or `bf16x3` on a CPU without AMX.
pub fn open_backend(kind: BackendKind, threads: usize) -> Result<Box<dyn Backend>> {
    pipe_stages::pipeline::open_backend(kind, threads, 0).map_err(|e| {
        if e.is_bad_input() {
            bad_input(e.to_string())
        } else {
            e.into()
        }
    })
}

pub use pipe_experiments::flags::{BackendParser, ScheduleOpts};

/// A built-in experiment file: its text, and the path it is committed at.
pub type BuiltInConfig = (&'static str, &'static str);

/// An experiment file's text and the name messages give it: the file at `path`, or the
/// built-in `default` (named by its committed path) when none is given.
///
/// # Errors
/// Bad input for an unreadable file.
pub fn config_text(
    path: Option<&std::path::Path>,
    (default, default_name): BuiltInConfig,
) -> Result<(String, String)> {
    match path {
        Some(p) => Ok((
            pipe_stages::limits::read_text_file(p, "experiment file")?,
            p.display().to_string(),
        )),
        None => Ok((default.to_string(), default_name.to_string())),
    }
}

/// The command line as run, for a report to name the command that made it (an argument that
/// is not UTF-8, a path, say, with its other bytes as U+FFFD).
pub fn command_line() -> String {
    std::iter::once("pipe".to_string())
        .chain(
            std::env::args_os()
                .skip(1)
                .map(|a| a.to_string_lossy().into_owned()),
        )
        .collect::<Vec<_>>()
        .join(" ")
}
