//! `pipe schedule` and `pipe simulate`: print a policy's schedule, or simulate it under a cost
//! model. Both only parse arguments and files here; the work is `pipe-scheduler`'s.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use pipe_scheduler::{
    CostModel, Length, LowerOptions, Policy, Schedule, ScheduleError, ScheduleSpec, SimOptions,
    SimReport, StageCost, VersionPlan, generate, grid, lower, simulate, validate,
};

/// What describes a schedule on the command line (shared by both commands).
#[derive(Args, Debug)]
pub struct ScheduleOpts {
    /// Policy: sequential, gpipe, 1f1b-flush, interleaved, zb-h1, pipedream, pipedream-nostash,
    /// vsync or 2bw.
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
    /// Model chunks per worker (interleaved only).
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
    fn spec(&self) -> ScheduleSpec {
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

    /// Generates, lowers and checks the schedule.
    fn build(&self) -> Result<Schedule> {
        let generated = generate(&self.spec()).map_err(bad)?;
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

pub(crate) fn parse_policy(s: &str) -> Result<Policy, String> {
    s.parse::<Policy>().map_err(|e| e.to_string())
}

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
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
}

/// `pipe simulate`.
#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct SimulateArgs {
    #[command(flatten)]
    opts: ScheduleOpts,
    /// Cost model file (TOML, or JSON if it ends in .json): `bandwidth`, `latency`, `overlap`
    /// and `[[stage]]` tables with forward, backward_input, backward_weight, update,
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
    /// Link bandwidth, e.g. 10GB/s (GB = 1e9 bytes, GiB = 2^30); default infinite.
    #[arg(long, value_parser = parse_bandwidth)]
    bandwidth: Option<f64>,
    /// Link latency per message.
    #[arg(long, default_value = "0", value_parser = parse_seconds)]
    latency: f64,
    /// Senders wait until their messages land (no compute/communication overlap).
    #[arg(long)]
    no_overlap: bool,
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
}

pub(crate) fn bad(e: ScheduleError) -> anyhow::Error {
    if e.is_bad_input() {
        crate::cli::bad_input(e.to_string())
    } else {
        anyhow::Error::new(e)
    }
}

fn write_out(path: Option<&Path>, text: &str) -> Result<()> {
    match path {
        Some(p) => std::fs::write(p, text).with_context(|| format!("writing {}", p.display())),
        None => {
            out!("{text}");
            Ok(())
        }
    }
}

/// Runs `pipe schedule`.
pub fn cmd_schedule(args: &ScheduleArgs) -> Result<()> {
    let lowered = args.opts.build()?;
    let shown = if args.unlowered {
        generate(&args.opts.spec()).map_err(bad)?
    } else {
        lowered.clone()
    };
    let plan = VersionPlan::derive(&lowered)?;
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
        ScheduleFormat::Csv => {
            let mut out = String::from(
                "worker,step,action,kind,stage,microbatch,update,forward_version,backward_version\n",
            );
            for (w, prog) in shown.programs.iter().enumerate() {
                for (i, a) in prog.iter().enumerate() {
                    let (fv, bv) = match (a.kind().is_compute(), a.microbatch()) {
                        (true, Some(mb)) => (
                            plan.forward_version(a.stage(), mb).to_string(),
                            plan.backward_version(a.stage(), mb).to_string(),
                        ),
                        _ => (String::new(), String::new()),
                    };
                    out.push_str(&format!(
                        "{w},{i},{a},{},{},{},{},{fv},{bv}\n",
                        a.kind().name(),
                        a.stage(),
                        a.microbatch().map_or(String::new(), |m| m.to_string()),
                        a.update_index().map_or(String::new(), |u| u.to_string()),
                    ));
                }
            }
            out
        }
        ScheduleFormat::Trace => {
            let unit = CostModel::uniform(StageCost::compute(1.0, 2.0));
            let report = simulate(&lowered, &unit, SimOptions { timeline: true })?;
            let timeline = report.timeline.unwrap_or_default();
            timeline.to_chrome_trace(Some(&plan)) + "\n"
        }
    };
    write_out(args.output.as_deref(), &text)
}

fn load_costs(args: &SimulateArgs) -> Result<CostModel> {
    if let Some(path) = &args.costs {
        let text = std::fs::read_to_string(path)
            .map_err(|e| crate::cli::bad_input(format!("cost file {}: {e}", path.display())))?;
        let parsed: Result<CostModel, String> = if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"))
        {
            serde_json::from_str(&text).map_err(|e| e.to_string())
        } else {
            toml::from_str(&text).map_err(|e| e.message().to_string())
        };
        let mut costs = parsed
            .map_err(|e| crate::cli::bad_input(format!("cost file {}: {e}", path.display())))?;
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
        latency: args.latency,
        overlap: !args.no_overlap,
        cores: args.cores,
    })
}

/// Runs `pipe simulate`.
pub fn cmd_simulate(args: &SimulateArgs) -> Result<()> {
    let costs = load_costs(args)?;
    costs
        .check(args.opts.spec().resolve().map_err(bad)?.layout.stages())
        .map_err(bad)?;
    let schedule = args.opts.build()?;
    let want_timeline = args.trace.is_some() || args.csv.is_some();
    let report = simulate(
        &schedule,
        &costs,
        SimOptions {
            timeline: want_timeline,
        },
    )
    .map_err(bad)?;
    out!("{}", render_report(&schedule, &report, costs.cores));
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

fn render_report(schedule: &Schedule, r: &SimReport, cores: Option<u32>) -> String {
    let res = &schedule.resolved;
    let shared = match cores {
        Some(c) if c < schedule.workers() => {
            format!(" on {c} shared core(s) (compute columns are wall time)")
        }
        _ => String::new(),
    };
    let mut out = format!(
        "{} | {} stages, replicas {:?}, {} chunk(s) | M = {} per replica, {} microbatches | {} \
         workers{shared}\n",
        res.policy,
        res.layout.positions(),
        res.layout.replica_counts(),
        res.layout.chunks(),
        res.microbatches_per_update,
        res.total,
        schedule.workers()
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
        let stages: Vec<String> = schedule
            .layout()
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

pub(crate) fn secs(s: f64) -> String {
    if s == 0.0 {
        "0".into()
    } else if s >= 1.0 {
        format!("{s:.4} s")
    } else if s >= 1e-3 {
        format!("{:.4} ms", s * 1e3)
    } else {
        format!("{:.3} us", s * 1e6)
    }
}

pub(crate) fn bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.2} {}", UNITS[i])
    }
}

/// Splits `text` into a number and a unit suffix.
fn split_unit(text: &str) -> Result<(f64, String), String> {
    let t = text.trim();
    let end = t
        .find(|c: char| {
            !(c.is_ascii_digit() || c == '.' || c == 'e' || c == 'E' || c == '-' || c == '+')
        })
        .unwrap_or(t.len());
    // An exponent letter followed by a unit letter ("5e" + "ms") is not a number; back off.
    let (num, unit) = t.split_at(end);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a number with an optional unit"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(format!("{text:?} must be a finite number >= 0"));
    }
    Ok((value, unit.trim().to_string()))
}

/// Seconds, with an optional unit: s, ms, us, ns.
pub fn parse_seconds(text: &str) -> Result<f64, String> {
    let (v, unit) = split_unit(text)?;
    let scale = match unit.as_str() {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" => 1e-6,
        "ns" => 1e-9,
        other => return Err(format!("unknown time unit {other:?} (use s, ms, us or ns)")),
    };
    Ok(v * scale)
}

/// Bytes, with an optional unit: B, KB, MB, GB (powers of 10) or KiB, MiB, GiB (powers of 2).
pub fn parse_bytes(text: &str) -> Result<f64, String> {
    let (v, unit) = split_unit(text)?;
    let scale = match unit.as_str() {
        "" | "B" => 1.0,
        "KB" | "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024.0f64.powi(4),
        other => {
            return Err(format!(
                "unknown size unit {other:?} (use B, KB, MB, GB, KiB, MiB, GiB)"
            ));
        }
    };
    Ok(v * scale)
}

/// Bytes per second: a size with an optional `/s` (10GB/s, 1.25e9).
pub fn parse_bandwidth(text: &str) -> Result<f64, String> {
    let t = text.trim();
    let v = parse_bytes(t.strip_suffix("/s").unwrap_or(t))?;
    if v <= 0.0 {
        return Err(format!("bandwidth {text:?} must be > 0"));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_parse() {
        assert_eq!(parse_seconds("2ms"), Ok(2e-3));
        assert_eq!(parse_seconds("1.5"), Ok(1.5));
        assert_eq!(parse_seconds("150us"), Ok(150e-6));
        assert_eq!(parse_bandwidth("10GB/s"), Ok(1e10));
        assert_eq!(parse_bandwidth("1GiB/s"), Ok(1073741824.0));
        assert_eq!(parse_bytes("4MiB"), Ok(4194304.0));
        assert!(parse_seconds("-1").is_err());
        assert!(parse_seconds("3 fortnights").is_err());
        assert!(parse_bandwidth("0GB/s").is_err());
        assert!(parse_bytes("NaN").is_err());
    }
}
