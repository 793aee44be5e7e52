//! Argument parsing and formatting that several commands share: schedule policies, times,
//! sizes and bandwidths with units, the compute backend, the flags that describe a schedule
//! (`pipe schedule` and `pipe simulate`), and the time and size formats reports print.

use std::ffi::OsStr;

use anyhow::{Context, Result};
use clap::Args;
use clap::builder::TypedValueParser;
use clap::error::ErrorKind;
use pipe_kernels::{Backend, BackendKind, KernelError, Precision};
use pipe_scheduler::{
    Length, LowerOptions, Policy, Schedule, ScheduleSpec, generate, lower, validate,
};

use crate::output::{bad_input, schedule_error};

/// A schedule policy by name, for `value_parser`.
pub fn parse_policy(s: &str) -> Result<Policy, String> {
    Policy::parse_flag(s)
}

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
/// or no driver, GPU or NVRTC.
pub fn open_backend(kind: BackendKind, threads: usize) -> Result<Box<dyn Backend>> {
    pipe_stages::pipeline::open_backend(kind, threads, 0).map_err(|e| match e {
        KernelError::NotCompiledWithCuda | KernelError::NoCuda { .. } => bad_input(e.to_string()),
        other => other.into(),
    })
}

/// Parses `--backend`. An unknown name is reported as `unknown backend 'NAME' (cpu, cuda)`, on
/// its own rather than inside clap's "invalid value" sentence.
#[derive(Clone, Copy, Debug)]
pub struct BackendParser;

impl TypedValueParser for BackendParser {
    type Value = BackendKind;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<BackendKind, clap::Error> {
        let name = value.to_string_lossy();
        name.parse::<BackendKind>().map_err(|_| {
            clap::Error::raw(
                ErrorKind::InvalidValue,
                format!("unknown backend '{name}' (cpu, cuda)\n"),
            )
            .with_cmd(cmd)
        })
    }
}

/// Parses `--precision` (`f32`, `tf32`, `bf16`).
///
/// # Errors
/// The one-line message naming the choices.
pub fn parse_precision(s: &str) -> Result<Precision, String> {
    s.parse()
}

/// What describes a schedule on the command line (shared by `pipe schedule` and `pipe
/// simulate`).
#[derive(Args, Debug)]
pub struct ScheduleOpts {
    /// Policy: sequential, gpipe, 1f1b-flush, interleaved, zb-h1, zb-v, dualpipev, pipedream,
    /// pipedream-nostash, vsync or 2bw.
    #[arg(long, default_value = "1f1b-flush", value_parser = parse_policy)]
    schedule: Policy,
    /// Pipeline stages.
    #[arg(long, default_value_t = 4)]
    stages: u32,
    /// Microbatches per update, per replica (M).
    #[arg(long, default_value_t = 8)]
    microbatches: u32,
    /// Replicas per stage: one value for all, or a comma-separated list (2,1,1,1).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    replicas: Vec<u32>,
    /// Model chunks per worker (interleaved; zb-v and dualpipev always hold 2).
    #[arg(long, default_value_t = 1)]
    chunks: u32,
    /// Minibatches to run (default: 1 for flush policies, 2 x stages for asynchronous ones, so
    /// the steady state shows).
    #[arg(long, conflicts_with = "total_microbatches")]
    updates: Option<u32>,
    /// Microbatches to run in total (a whole number of minibatches).
    #[arg(long)]
    total_microbatches: Option<u32>,
    /// Expand each all-reduce into its ring send and receive steps.
    #[arg(long)]
    expand_all_reduce: bool,
}

impl ScheduleOpts {
    /// The schedule the flags describe, before generation.
    pub fn spec(&self) -> ScheduleSpec {
        let length = match (self.updates, self.total_microbatches) {
            (_, Some(n)) => Length::Microbatches(n),
            (Some(k), None) => Length::Updates(k),
            (None, None) if self.schedule.is_flush() => Length::Updates(1),
            (None, None) => Length::Updates(2 * self.stages.max(1)),
        };
        ScheduleSpec::new(self.schedule, self.stages, self.microbatches)
            .with_replicas(self.replicas.clone())
            .with_chunks(self.chunks)
            .with_length(length)
    }

    /// True when each all-reduce is to be expanded into its ring steps.
    pub fn expands_all_reduce(&self) -> bool {
        self.expand_all_reduce
    }

    /// Generates, lowers and checks the schedule.
    ///
    /// # Errors
    /// Bad input when the flags describe no schedule; a run-time failure when the generated
    /// schedule fails its checks.
    pub fn build(&self) -> Result<Schedule> {
        let generated = generate(&self.spec()).map_err(schedule_error)?;
        let lowered = lower(
            &generated,
            LowerOptions {
                expand_all_reduce: self.expand_all_reduce,
            },
        );
        validate::check(&lowered).context("generated schedule failed its checks")?;
        Ok(lowered)
    }
}

pub use pipe_scheduler::units::{bytes, parse_bandwidth, parse_bytes, parse_seconds, secs};

/// An experiment file's text and the name messages give it: the file at `path`, or the
/// built-in `default` (committed as `default_name`) when none is given. The command line
/// (`pipe experiment staleness --config`, `pipe bench --config`) and the command run after.
///
/// # Errors
/// Bad input for an unreadable file.
pub fn config_text(
    path: Option<&std::path::Path>,
    default: &str,
    default_name: &str,
) -> Result<(String, String)> {
    match path {
        Some(p) => Ok((
            pipe_stages::limits::read_text_file(p, "experiment file")?,
            p.display().to_string(),
        )),
        None => Ok((default.to_string(), default_name.to_string())),
    }
}

/// The command line as run, for a report to name the command that made it.
pub fn command_line() -> String {
    std::iter::once("pipe".to_string())
        .chain(std::env::args().skip(1))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_parse_by_name() {
        let cmd = clap::Command::new("t");
        let parse = |s: &str| BackendParser.parse_ref(&cmd, None, OsStr::new(s));
        assert_eq!(parse("cpu").ok(), Some(BackendKind::Cpu));
        assert_eq!(
            parse("cuda").ok(),
            Some(BackendKind::Cuda(pipe_kernels::Precision::F32))
        );
        let err = parse("tpu")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.starts_with("error: unknown backend 'tpu' (cpu, cuda)"),
            "{err}"
        );
    }
}
