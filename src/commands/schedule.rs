//! `pipe schedule`: print a policy's schedule as a grid, text, CSV or a Chrome trace of a
//! unit-cost run. Generating and checking the schedule is `pipe-scheduler`'s.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::{Args, ValueEnum};
use pipe_scheduler::{
    CostModel, Schedule, SimOptions, StageCost, VersionPlan, generate, grid, simulate,
};

use crate::args::ScheduleOpts;
use crate::output::schedule_error;

/// Output formats of `pipe schedule`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ScheduleFormat {
    /// Worker-by-step grid.
    Grid,
    /// One line per worker: `wN: action action ...` (the golden-test format).
    Text,
    /// One row per action with its step, microbatch, update and weight versions.
    Csv,
    /// Chrome trace JSON of a unit-cost run (forward 1, backward 2 time units).
    Trace,
}

/// `pipe schedule`.
#[derive(Args, Debug)]
pub struct ScheduleArgs {
    #[command(flatten)]
    opts: ScheduleOpts,
    /// Output format.
    #[arg(long, value_enum, default_value = "grid")]
    format: ScheduleFormat,
    /// Show the programs before lowering (no sends and receives).
    #[arg(long)]
    unlowered: bool,
    /// Write to FILE instead of standard output.
    #[arg(short, long, value_name = "FILE", value_parser = pipe_stages::outputs::output_file)]
    output: Option<PathBuf>,
}

/// Writes `text` to `path`, or to standard output when there is none.
fn write_text(path: Option<&Path>, text: &str) -> Result<()> {
    match path {
        Some(p) => Ok(pipe_stages::outputs::write_file(p, text.as_bytes())?),
        None => {
            out!("{text}");
            Ok(())
        }
    }
}

/// Refuses `actions` actions past what `format` may print: a Chrome trace's events, or the
/// lines of text, a grid or CSV.
///
/// # Errors
/// Bad input naming the bound.
fn check_printable(format: ScheduleFormat, actions: u64) -> Result<()> {
    let checked = match format {
        ScheduleFormat::Trace => pipe_scheduler::limits::check_trace(actions),
        ScheduleFormat::Grid | ScheduleFormat::Text | ScheduleFormat::Csv => {
            pipe_scheduler::limits::check_printed(actions)
        }
    };
    checked.map_err(schedule_error)
}

/// Runs `pipe schedule`.
///
/// # Errors
/// Bad input when the flags describe no schedule; failures of the checks or of writing.
pub fn run(args: &ScheduleArgs) -> Result<()> {
    // Every format writes a line or more per action, and every microbatch pass is at least a
    // forward and a backward: a schedule certain to be past what may be printed is refused
    // before it is built (which took seconds and gigabytes).
    let floor = args.opts.spec().passes().map_err(schedule_error)?;
    check_printable(args.format, floor.saturating_mul(2))?;
    let lowered = args.opts.build().map_err(schedule_error)?;
    let shown = if args.unlowered {
        generate(&args.opts.spec()).map_err(schedule_error)?
    } else {
        lowered.clone()
    };
    let plan = VersionPlan::derive(&lowered)?;
    check_printable(args.format, shown.len() as u64)?;
    let text = match args.format {
        ScheduleFormat::Grid => {
            let mut out = grid::full(&shown);
            out.push_str(&format!(
                "{} workers, {} actions; peak weight versions per worker {:?}, peak stashed \
                 activations per worker {:?}\n",
                shown.workers(),
                shown.len(),
                plan.peak_versions,
                plan.peak_activations
            ));
            out
        }
        ScheduleFormat::Text => shown.to_text(),
        ScheduleFormat::Csv => schedule_csv(&shown, &plan),
        ScheduleFormat::Trace => {
            let unit = CostModel::uniform(StageCost::compute(1.0, 2.0));
            let report = simulate(&lowered, &unit, SimOptions { timeline: true })?;
            let timeline = report.timeline.unwrap_or_default();
            timeline.to_chrome_trace(Some(&plan)) + "\n"
        }
    };
    write_text(args.output.as_deref(), &text)
}

/// The schedule as CSV, one row per action with the weight versions its pass reads, written
/// into one buffer sized for it (a row is under 64 bytes).
fn schedule_csv(shown: &Schedule, plan: &VersionPlan) -> String {
    use std::fmt::Write as _;
    const HEADER: &str =
        "worker,step,action,kind,stage,microbatch,update,forward_version,backward_version\n";
    let mut out = String::with_capacity(HEADER.len() + shown.len().saturating_mul(64));
    out.push_str(HEADER);
    for (w, prog) in shown.programs.iter().enumerate() {
        for (i, a) in prog.iter().enumerate() {
            // Writing to a `String` cannot fail.
            let _ = write!(out, "{w},{i},{a},{},{},", a.kind().name(), a.stage());
            if let Some(m) = a.microbatch() {
                let _ = write!(out, "{m}");
            }
            out.push(',');
            if let Some(u) = a.update_index() {
                let _ = write!(out, "{u}");
            }
            out.push(',');
            if let (true, Some(mb)) = (a.kind().is_compute(), a.microbatch()) {
                let (fv, bv) = (
                    plan.forward_version(a.stage(), mb),
                    plan.backward_version(a.stage(), mb),
                );
                let _ = write!(out, "{fv},{bv}");
            } else {
                out.push(',');
            }
            out.push('\n');
        }
    }
    out
}
