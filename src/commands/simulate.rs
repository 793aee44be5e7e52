//! `pipe simulate`: run a schedule on the simulator under a cost model (inline flags or a cost
//! file) and print makespan, bubble and per-worker time and memory; optionally write the
//! simulated timeline. Simulating is `pipe-scheduler`'s.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use pipe_experiments::flags::CostFlags;
use pipe_scheduler::{SimOptions, VersionPlan, simulate, simulate_spec};

use crate::args::ScheduleOpts;
use crate::output::{experiment_error, schedule_error};

/// `pipe simulate`.
#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct SimulateArgs {
    #[command(flatten)]
    opts: ScheduleOpts,
    #[command(flatten)]
    costs: CostFlags,
    /// Write the simulated timeline as Chrome trace JSON to FILE.
    #[arg(long, value_name = "FILE", value_parser = pipe_stages::outputs::output_file)]
    trace: Option<PathBuf>,
    /// Write the simulated timeline as CSV to FILE.
    #[arg(long, value_name = "FILE", value_parser = pipe_stages::outputs::output_file)]
    csv: Option<PathBuf>,
}

/// Runs `pipe simulate`.
///
/// # Errors
/// Bad input for unreadable cost files and costs or flags that do not fit the schedule;
/// failures of the simulator or of writing.
pub fn run(args: &SimulateArgs) -> Result<()> {
    use pipe_stages::outputs::{Input, check_not_input, check_outputs_distinct};
    let named = [
        ("--costs", args.costs.costs.as_deref()),
        (
            "--transport-costs",
            args.costs.link.transport_costs.as_deref(),
        ),
    ];
    let inputs = Input::named(&named);
    let outputs = [
        ("--trace", args.trace.as_deref()),
        ("--csv", args.csv.as_deref()),
    ];
    for (flag, path) in outputs {
        if let Some(path) = path {
            check_not_input(path, flag, &inputs)?;
        }
    }
    check_outputs_distinct(&outputs)?;
    let costs = args
        .costs
        .load(|line| outln!("{line}"))
        .map_err(experiment_error)?;
    let spec = args.opts.spec();
    let resolved = spec.resolve().map_err(schedule_error)?;
    costs
        .check_input(resolved.layout.stages())
        .map_err(schedule_error)?;
    let want_timeline = args.trace.is_some() || args.csv.is_some();
    if !want_timeline && !args.opts.expands_all_reduce() {
        // Nothing needs the whole schedule: stream it (thousands of workers in little memory).
        let report = simulate_spec(&spec, &costs, SimOptions::default()).map_err(schedule_error)?;
        out!("{}", report.render(&resolved, costs.cores));
        return Ok(());
    }
    let schedule = args.opts.build().map_err(schedule_error)?;
    let report = simulate(
        &schedule,
        &costs,
        SimOptions {
            timeline: want_timeline,
        },
    )
    .map_err(schedule_error)?;
    out!("{}", report.render(&resolved, costs.cores));
    if let Some(timeline) = &report.timeline {
        if let Some(path) = &args.trace {
            let plan = VersionPlan::derive(&schedule)?;
            pipe_stages::outputs::write_file(
                path,
                timeline.to_chrome_trace(Some(&plan)).as_bytes(),
            )?;
            outln!("trace written to {}", path.display());
        }
        if let Some(path) = &args.csv {
            pipe_stages::outputs::write_file(path, timeline.to_csv().as_bytes())?;
            outln!("timeline CSV written to {}", path.display());
        }
    }
    Ok(())
}
