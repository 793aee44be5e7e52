//! `pipe bench` (no subcommand): the throughput sweep of `experiments/bench/default.toml` and its
//! report; `pipe bench measure-config`, the child process that measures one configuration;
//! `pipe report bench --from DIR`, the report again from saved results.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use pipe_experiments::bench::config::ConfigSpec;
use pipe_experiments::bench::measure::MeasureOptions;
use pipe_experiments::bench::{BenchConfig, SweepOptions, attempt, load, report, run_sweep, save};

use crate::args::{BuiltInConfig, command_line, config_text};
use crate::output::{bad_input, experiment_error};

/// The default sweep and the path it is committed at.
const DEFAULT_CONFIG: BuiltInConfig = (
    include_str!("../../experiments/bench/default.toml"),
    "experiments/bench/default.toml",
);

/// `pipe bench` without a subcommand.
#[derive(Args, Debug)]
pub struct SweepArgs {
    /// Sweep file (default: experiments/bench/default.toml, built in).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Where results.json, plots/, traces/ and REPORT.md go (default: experiments/bench, or
    /// target/bench-quick with --quick, so a smoke run never replaces the committed report).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Run the file's [quick] sweep (under a minute).
    #[arg(long)]
    quick: bool,
    /// Summarise the criterion results under DIR (`cargo bench` writes target/criterion).
    #[arg(long, value_name = "DIR")]
    criterion: Option<PathBuf>,
    /// Summarise numpy's GEMM figures (`experiments/gemm-vs-numpy/numpy_gemm.py --json FILE`).
    #[arg(long, value_name = "FILE")]
    numpy: Option<PathBuf>,
    /// Measure every configuration in this process instead of a child process each (peak
    /// memory is then the sweep's, not the configuration's).
    #[arg(long)]
    in_process: bool,
}

/// `pipe bench measure-config`: one configuration, as JSON in and out.
#[derive(Args, Debug)]
pub struct MeasureConfigArgs {
    /// The configuration (JSON).
    #[arg(long)]
    spec: String,
    /// How to measure it (JSON).
    #[arg(long)]
    options: String,
}

/// `pipe report bench`.
#[derive(Args, Debug)]
pub struct ReportBenchArgs {
    /// The directory holding results.json (REPORT.md and plots/ are written there).
    #[arg(long, value_name = "DIR")]
    from: PathBuf,
}

/// Runs the sweep.
///
/// # Errors
/// Bad input for an unreadable or malformed sweep file; failures outside a configuration.
pub fn run(args: &SweepArgs) -> Result<()> {
    let (text, name) = config_text(args.config.as_deref(), DEFAULT_CONFIG)?;
    let cfg = BenchConfig::parse(&text, &name).map_err(experiment_error)?;
    let cfg = if args.quick { cfg.quick() } else { cfg };
    let out = args.out.clone().unwrap_or_else(|| {
        PathBuf::from(if args.quick {
            "target/bench-quick"
        } else {
            "experiments/bench"
        })
    });
    let command = command_line();
    let opts = SweepOptions {
        runner: if args.in_process {
            None
        } else {
            Some(std::env::current_exe()?)
        },
        criterion_dir: args.criterion.clone(),
        numpy_json: args.numpy.clone(),
        out: out.clone(),
        verbose: true,
    };
    let results = run_sweep(&cfg, args.quick, command, &opts).map_err(experiment_error)?;
    save(&results, &out).map_err(experiment_error)?;
    let path = report::write_report(&results, &out).map_err(experiment_error)?;
    outln!(
        "{} configurations in {:.1} min; report: {}",
        results.configs.len(),
        results.wall_s / 60.0,
        path.display()
    );
    Ok(())
}

/// Measures one configuration and prints the attempt as one line of JSON.
///
/// # Errors
/// Bad input for malformed JSON.
pub fn run_measure_config(args: &MeasureConfigArgs) -> Result<()> {
    let spec: ConfigSpec =
        serde_json::from_str(&args.spec).map_err(|e| bad_input(format!("--spec: {e}")))?;
    let opts: MeasureOptions =
        serde_json::from_str(&args.options).map_err(|e| bad_input(format!("--options: {e}")))?;
    spec.check()
        .map_err(|e| bad_input(format!("--spec: {e}")))?;
    opts.check()
        .map_err(|e| bad_input(format!("--options: {e}")))?;
    outln!("{}", serde_json::to_string(&attempt(&spec, &opts))?);
    Ok(())
}

/// Regenerates the report from DIR/results.json.
///
/// # Errors
/// Bad input for a missing or malformed results file.
pub fn run_report(args: &ReportBenchArgs) -> Result<()> {
    crate::output::regenerate_report(&args.from, (load, report::write_report))
}
