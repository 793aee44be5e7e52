//! `pipe experiment staleness` runs the staleness matrix and writes its results and report;
//! `pipe report staleness --from DIR` renders the report again from saved results.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Subcommand};
use pipe_experiments::staleness::{StalenessConfig, load, report, run_experiment, save};

use crate::args::{BuiltInConfig, command_line, config_text};
use crate::output::experiment_error;

/// The default configuration and the path it is committed at.
const DEFAULT_CONFIG: BuiltInConfig = (
    include_str!("../../experiments/staleness/mnist.toml"),
    "experiments/staleness/mnist.toml",
);

/// `pipe experiment`.
#[derive(Subcommand, Debug)]
pub enum ExperimentCommand {
    /// Policies x stages x seeds x optimizers, remedies and a delayed data-parallel baseline:
    /// what stale weights cost and what fixes it.
    Staleness(StalenessArgs),
}

/// `pipe experiment staleness`.
#[derive(Args, Debug)]
pub struct StalenessArgs {
    /// Experiment file (default: experiments/staleness/mnist.toml, built in).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Where results.json, ledgers/, plots/ and REPORT.md go.
    #[arg(long, value_name = "DIR", default_value = "experiments/staleness")]
    out: PathBuf,
    /// Run the reduced matrix of the file's [quick] table (about a minute).
    #[arg(long)]
    quick: bool,
}

/// `pipe report staleness`.
#[derive(Args, Debug)]
pub struct ReportArgs {
    /// The directory holding results.json (REPORT.md and plots/ are written there).
    #[arg(long, value_name = "DIR")]
    from: PathBuf,
}

/// Runs `pipe experiment`.
///
/// # Errors
/// Bad input for an unreadable or malformed file; run-time failures of a run.
pub fn run(cmd: &ExperimentCommand) -> Result<()> {
    let ExperimentCommand::Staleness(args) = cmd;
    let (text, name) = config_text(args.config.as_deref(), DEFAULT_CONFIG)?;
    let cfg = StalenessConfig::parse(&text, &name).map_err(experiment_error)?;
    let command = command_line();
    let mut progress = |i: usize, n: usize, r: &pipe_experiments::staleness::RunRecord| {
        let acc = r.final_accuracy();
        let quality = if r.diverged_at.is_some() {
            format!("diverged at update {}", r.diverged_at.unwrap_or(0))
        } else {
            format!("test acc {:6.2}%", 100.0 * acc)
        };
        let target = r
            .updates_to_target
            .map_or("target not reached".to_string(), |u| {
                format!("target at update {u}")
            });
        outln!(
            "[{i:3}/{n}] {:55} {quality}  {target}  {:.1} s",
            r.spec.id,
            r.wall_s
        );
    };
    let results = run_experiment(&cfg, args.quick, &args.out, &command, &mut progress)
        .map_err(experiment_error)?;
    save(&results, &args.out).map_err(experiment_error)?;
    let path = report::write_report(&results, &args.out).map_err(experiment_error)?;
    outln!(
        "{} runs in {:.1} min; report: {}",
        results.runs.len(),
        results.wall_s / 60.0,
        path.display()
    );
    Ok(())
}

/// Runs `pipe report staleness`.
///
/// # Errors
/// Bad input for a missing or malformed results file.
pub fn run_report(args: &ReportArgs) -> Result<()> {
    crate::output::regenerate_report(&args.from, (load, report::write_report))
}
