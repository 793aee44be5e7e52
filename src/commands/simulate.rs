//! `pipe simulate`: run a schedule on the simulator under a cost model (inline flags or a cost
//! file) and print makespan, bubble and per-worker time and memory; optionally write the
//! simulated timeline. Simulating is `pipe-scheduler`'s.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use pipe_scheduler::{
    CostModel, Resolved, SimOptions, SimReport, StageCost, VersionPlan, simulate, simulate_spec,
};

use crate::args::{ScheduleOpts, bytes, parse_bandwidth, parse_bytes, parse_seconds, secs};
use crate::output::{bad_input, schedule_error};

/// `pipe simulate`.
#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct SimulateArgs {
    #[command(flatten)]
    opts: ScheduleOpts,
    /// Cost model file (TOML, or JSON if it ends in .json): `bandwidth`, `latency`, `overlap`,
    /// `cores`, `message_cpu` and `[[stage]]` tables with forward, backward_input, backward_weight, update,
    /// activation_bytes, param_bytes, stash_bytes. Overrides the inline cost flags.
    #[arg(long, value_name = "FILE")]
    costs: Option<PathBuf>,
    /// Forward time per microbatch and stage (seconds, or with a unit: 2ms, 150us).
    #[arg(long, default_value = "1", value_parser = parse_seconds)]
    forward: f64,
    /// Fused backward time (split evenly into input and weight halves).
    #[arg(long, default_value = "2", value_parser = parse_seconds)]
    backward: f64,
    /// Optimizer step time.
    #[arg(long, default_value = "0", value_parser = parse_seconds)]
    update: f64,
    /// Bytes of each stage's output activation per microbatch (also its gradient).
    #[arg(long, default_value = "0", value_parser = parse_bytes)]
    activation_bytes: f64,
    /// Bytes of each stage's parameters (one weight version; what an all-reduce moves).
    #[arg(long, default_value = "0", value_parser = parse_bytes)]
    param_bytes: f64,
    /// Link bandwidth, e.g. 10GB/s (GB = 1e9 bytes, GiB = 2^30) [default: `--transport`'s
    /// measured rate, else infinite].
    #[arg(long, value_parser = parse_bandwidth)]
    bandwidth: Option<f64>,
    /// Link latency per message [default: `--transport`'s measured one-way time, else 0].
    #[arg(long, value_parser = parse_seconds)]
    latency: Option<f64>,
    /// Senders wait until their messages land (no compute/communication overlap).
    #[arg(long)]
    no_overlap: bool,
    /// Processor time each message costs its sender and its receiver (waking a peer, being
    /// woken), added to the action that sends or receives it.
    #[arg(long, default_value = "0", value_parser = parse_seconds)]
    message_cpu: f64,
    /// Processor time each byte costs its sender and its receiver (encryption, packets,
    /// copies), added as `--message-cpu` is, in seconds per byte.
    #[arg(long, default_value = "0", value_parser = parse_seconds)]
    byte_cpu: f64,
    /// Cores the workers share (default: one each); fewer cores than workers share them fairly.
    /// Overrides `cores` in a cost file.
    #[arg(long)]
    cores: Option<u32>,
    /// Write the simulated timeline as Chrome trace JSON to FILE.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Write the simulated timeline as CSV to FILE.
    #[arg(long, value_name = "FILE")]
    csv: Option<PathBuf>,
    /// With `--transport`: the measured costs of that transport's messages replace
    /// `--message-cpu` and `--byte-cpu` (and a cost file's), and its rate and one-way time
    /// stand for `--bandwidth` and `--latency` where those are not given.
    #[command(flatten)]
    link: pipe_stages::planning::link_costs::LinkChoice,
}

/// The cost model ([`flag_or_file_costs`]), its message costs those of `--transport` where it
/// is given.
fn load_costs(args: &SimulateArgs) -> Result<CostModel> {
    let mut costs = flag_or_file_costs(args)?;
    if let Some((cost, source)) = args.link.load()? {
        outln!(
            "{}",
            pipe_stages::planning::link_costs::describe(&cost, &source)
        );
        costs.message_cpu = cost.message_cpu_s.median;
        costs.byte_cpu = cost.byte_cpu_s.median;
        if args.costs.is_none() {
            if args.bandwidth.is_none() {
                costs.bandwidth = cost.bandwidth.map_or(f64::INFINITY, |b| b.median);
            }
            if args.latency.is_none() {
                costs.latency = cost.latency_s.median;
            }
        }
    }
    Ok(costs)
}

/// The cost model: the cost file when given (with `--cores` over its own), else the flags.
fn flag_or_file_costs(args: &SimulateArgs) -> Result<CostModel> {
    if let Some(path) = &args.costs {
        let text = pipe_stages::limits::read_text_file(path, "cost file")?;
        let parsed: Result<CostModel, String> = if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"))
        {
            serde_json::from_str(&text).map_err(|e| e.to_string())
        } else {
            toml::from_str(&text).map_err(|e| e.message().to_string())
        };
        let mut costs =
            parsed.map_err(|e| bad_input(format!("cost file {}: {e}", path.display())))?;
        costs.cores = args.cores.or(costs.cores);
        return Ok(costs);
    }
    Ok(CostModel {
        stages: vec![StageCost {
            update: args.update,
            activation_bytes: args.activation_bytes,
            param_bytes: args.param_bytes,
            ..StageCost::compute(args.forward, args.backward)
        }],
        bandwidth: args.bandwidth.unwrap_or(f64::INFINITY),
        latency: args.latency.unwrap_or(0.0),
        overlap: !args.no_overlap,
        cores: args.cores,
        message_cpu: args.message_cpu,
        byte_cpu: args.byte_cpu,
        hosts: Vec::new(),
        between: None,
    })
}

/// Runs `pipe simulate`.
///
/// # Errors
/// Bad input for unreadable cost files and costs or flags that do not fit the schedule;
/// failures of the simulator or of writing.
pub fn run(args: &SimulateArgs) -> Result<()> {
    let costs = load_costs(args)?;
    let spec = args.opts.spec();
    let resolved = spec.resolve().map_err(schedule_error)?;
    costs
        .check_input(resolved.layout.stages())
        .map_err(schedule_error)?;
    let want_timeline = args.trace.is_some() || args.csv.is_some();
    if !want_timeline && !args.opts.expands_all_reduce() {
        // Nothing needs the whole schedule: stream it (thousands of workers in little memory).
        let report = simulate_spec(&spec, &costs, SimOptions::default()).map_err(schedule_error)?;
        out!("{}", render_report(&resolved, &report, costs.cores));
        return Ok(());
    }
    let schedule = args.opts.build()?;
    let report = simulate(
        &schedule,
        &costs,
        SimOptions {
            timeline: want_timeline,
        },
    )
    .map_err(schedule_error)?;
    out!("{}", render_report(&resolved, &report, costs.cores));
    if let Some(timeline) = &report.timeline {
        if let Some(path) = &args.trace {
            let plan = VersionPlan::derive(&schedule)?;
            std::fs::write(path, timeline.to_chrome_trace(Some(&plan)))
                .with_context(|| format!("writing {}", path.display()))?;
            outln!("trace written to {}", path.display());
        }
        if let Some(path) = &args.csv {
            std::fs::write(path, timeline.to_csv())
                .with_context(|| format!("writing {}", path.display()))?;
            outln!("timeline CSV written to {}", path.display());
        }
    }
    Ok(())
}

/// Replica counts as the flag takes them: one value when every stage has it, else the list.
fn replica_list(counts: &[u32]) -> String {
    match counts {
        [first, rest @ ..] if rest.iter().all(|r| r == first) => first.to_string(),
        _ => counts
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(","),
    }
}

/// The simulator's report as text: a headline and one row per worker.
fn render_report(res: &Resolved, r: &SimReport, cores: Option<u32>) -> String {
    let workers = res.layout.workers();
    let shared = match cores {
        Some(c) if c < workers => {
            format!(" on {c} shared core(s) (compute columns are wall time)")
        }
        _ => String::new(),
    };
    let mut out = format!(
        "{} | {} stages, replicas {}, {} chunk(s) | M = {} per replica, {} microbatches | {} \
         workers{shared}\n",
        res.policy,
        res.layout.positions(),
        replica_list(res.layout.replica_counts()),
        res.layout.chunks(),
        res.microbatches_per_update,
        res.total,
        workers
    );
    out.push_str(&format!(
        "makespan {}  throughput {:.6} microbatches/s  bubble {:.2}%\n",
        secs(r.makespan),
        r.throughput,
        100.0 * r.bubble_fraction
    ));
    out.push_str(&format!(
        "{:<6} {:>9} {:>12} {:>12} {:>12} {:>7} {:>8} {:>11} {:>12}\n",
        "worker",
        "stages",
        "compute",
        "comm",
        "idle",
        "busy",
        "versions",
        "activations",
        "peak memory"
    ));
    for (w, wr) in r.workers.iter().enumerate() {
        let stages: Vec<String> = res
            .layout
            .stages_of(w as u32)
            .map(|s| s.to_string())
            .collect();
        let busy = if r.makespan > 0.0 {
            100.0 * (wr.compute + wr.communication) / r.makespan
        } else {
            0.0
        };
        out.push_str(&format!(
            "w{:<5} {:>9} {:>12} {:>12} {:>12} {:>6.1}% {:>8} {:>11} {:>12}\n",
            w,
            stages.join(","),
            secs(wr.compute),
            secs(wr.communication),
            secs(wr.idle),
            busy,
            wr.peak_versions,
            wr.peak_activations,
            bytes(wr.memory.total)
        ));
    }
    out
}
