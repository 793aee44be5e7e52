//! `pipe profile` and `pipe plan`: measure a model's layers, partition a profile into stages
//! and replicas, and write the plan file `pipe train --plan` runs. Only argument and file
//! handling lives here: measuring is `pipe-stages`', planning `pipe-scheduler`'s.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use pipe_kernels::CpuBackend;
use pipe_scheduler::{
    PartitionPlan, PipeDreamOptions, PlanOptions, Policy, Profile, ScheduleError, WireDtype,
};
use pipe_stages::config::DEFAULT_MODEL;
use pipe_stages::model::{Model, ModelSpec};
use pipe_stages::pipeline::Partition;
use pipe_stages::profile::{ProfileOptions, profile_model};
use serde::{Deserialize, Serialize};

use crate::cli::bad_input;
use crate::plan_cli::{
    bad, bytes, parse_bandwidth, parse_bytes, parse_policy, parse_seconds, secs,
};

/// `pipe profile`: time every layer of a model.
#[derive(Args, Debug)]
pub struct ProfileArgs {
    /// Model preset.
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// Samples per microbatch.
    #[arg(long, default_value_t = 64)]
    microbatch_size: usize,
    /// Compute threads (a pipeline worker has one).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Untimed runs of each operation.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Timed runs of each operation (figures are medians).
    #[arg(long, default_value_t = 11)]
    repeats: usize,
    /// Microbatches per update of the executor run the times are calibrated on.
    #[arg(long, default_value_t = 4)]
    microbatches: u32,
    /// Keep the layers' isolated timings (no executor calibration).
    #[arg(long)]
    isolated: bool,
    /// Calibration copies run at once: the pipeline's busy workers (at most one per core).
    #[arg(long, default_value_t = 1)]
    concurrent: usize,
    /// Compute backend: cpu or cuda.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Write the profile as JSON to FILE.
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
}

fn profile_preset(name: &str, opts: &ProfileOptions, threads: usize) -> Result<Profile> {
    profile_on(name, opts, &CpuBackend::new(threads)?)
}

fn profile_on(
    name: &str,
    opts: &ProfileOptions,
    be: &dyn pipe_kernels::Backend,
) -> Result<Profile> {
    let model = Model::new(&ModelSpec::preset(name)?)?;
    Ok(profile_model(&model, name, be, opts)?)
}

/// Runs `pipe profile`.
pub fn cmd_profile(args: &ProfileArgs) -> Result<()> {
    if args.microbatch_size == 0 || args.repeats == 0 || args.threads == 0 || args.microbatches == 0
    {
        return Err(bad_input(
            "--microbatch-size, --repeats, --threads and --microbatches must be at least 1".into(),
        ));
    }
    if args.concurrent == 0 || args.concurrent > 256 {
        return Err(bad_input(format!(
            "--concurrent must be between 1 and 256, got {}",
            args.concurrent
        )));
    }
    let opts = ProfileOptions {
        warmup: args.warmup,
        repeats: args.repeats,
        calibrate: (!args.isolated).then_some(args.microbatches),
        concurrent: args.concurrent,
        ..ProfileOptions::new(args.microbatch_size)
    };
    let be = crate::cli::backend(&args.backend, args.threads)?;
    let profile = profile_on(&args.model, &opts, be.as_ref())?;
    out!("{}", render_profile(&profile));
    if let Some(path) = &args.output {
        let text = serde_json::to_string_pretty(&profile)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
        outln!("profile written to {}", path.display());
    }
    Ok(())
}

fn render_profile(p: &Profile) -> String {
    let how = match p.calibrated_microbatches {
        Some(m) => format!("calibrated on the executor at {m} microbatches per update"),
        None => "medians, one layer at a time".into(),
    };
    let mut out = format!(
        "profile of {} at microbatch {} ({how})\n{:<5} {:<12} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
        p.model,
        p.microbatch_size,
        "layer",
        "kind",
        "forward",
        "bwd-input",
        "bwd-weight",
        "update",
        "activation",
        "params"
    );
    for (i, l) in p.layers.iter().enumerate() {
        let kind = l.name.split_once(':').map_or(l.name.as_str(), |(_, k)| k);
        out.push_str(&format!(
            "{:<5} {:<12} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
            i,
            kind,
            secs(l.forward),
            secs(l.backward_input),
            secs(l.backward_weight),
            secs(l.update),
            bytes(l.activation_bytes),
            bytes(l.param_bytes)
        ));
    }
    let total: f64 = p.layers.iter().map(|l| l.compute() + l.update).sum();
    out.push_str(&format!("total per microbatch: {}\n", secs(total)));
    out
}

/// Cost models `pipe plan` knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PlanCostModel {
    /// Transfers on the link, overlap, memory under the schedule, flush bubbles simulated.
    Default,
    /// PipeDream's optimizer, formula for formula.
    Pipedream,
}

/// `pipe plan`: partition a profiled model into stages and per-stage replicas.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Layer profile: pipe's JSON, or a PipeDream graph file (`nodeK -- ...` lines).
    #[arg(long, value_name = "FILE", required_unless_present = "model")]
    profile: Option<PathBuf>,
    /// Profile this model preset first (instead of --profile).
    #[arg(long, conflicts_with = "profile")]
    model: Option<String>,
    /// Samples per microbatch when profiling --model.
    #[arg(long, default_value_t = 64)]
    microbatch_size: usize,
    /// Workers to plan for (all are used).
    #[arg(long, required_unless_present = "stages")]
    workers: Option<u32>,
    /// Exactly S stages, one worker each: the exact min-max split by time.
    #[arg(long, conflicts_with_all = ["workers", "straight"])]
    stages: Option<u32>,
    /// Link bandwidth (GB means 10^9 bytes).
    #[arg(long, default_value = "10GB/s", value_parser = parse_bandwidth)]
    bandwidth: f64,
    /// Link latency per message.
    #[arg(long, default_value = "0", value_parser = parse_seconds)]
    latency: f64,
    /// Per-worker memory bound.
    #[arg(long, value_parser = parse_bytes)]
    memory: Option<f64>,
    /// The schedule the plan is for: pipedream, pipedream-nostash, vsync, 2bw, gpipe,
    /// 1f1b-flush or zb-h1.
    #[arg(long, default_value = "pipedream", value_parser = parse_policy)]
    schedule: Policy,
    /// Microbatches per update per replica.
    #[arg(long, default_value_t = 8)]
    microbatches: u32,
    /// Cost model.
    #[arg(long, value_enum, default_value = "default")]
    cost_model: PlanCostModel,
    /// Element type of activations and gradients on the wire: f32 or bf16.
    #[arg(long, default_value = "f32")]
    wire_dtype: WireDtype,
    /// Sends do not overlap compute (a sender waits until its message lands).
    #[arg(long)]
    no_overlap: bool,
    /// No replication: one worker per stage.
    #[arg(long)]
    straight: bool,
    /// PipeDream model: activation compression ratio (activation transfers count only when
    /// given).
    #[arg(long)]
    activation_compression: Option<f64>,
    /// Write the plan as TOML to FILE (for `pipe train --plan`).
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
}

/// A plan as `pipe plan -o` writes it and `pipe train --plan` reads it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    /// Model preset the profile was taken from (empty when unknown).
    #[serde(default)]
    pub model: String,
    /// Samples per microbatch the profile was taken at (0 when unknown).
    #[serde(default)]
    pub microbatch_size: usize,
    /// Schedule.
    pub schedule: String,
    /// Microbatches per update per replica.
    pub microbatches: u32,
    /// Inclusive layer ranges per stage, as `--partition` takes them.
    pub partition: String,
    /// Replicas per stage.
    pub replicas: Vec<u32>,
    /// Cost model that made the plan.
    #[serde(default)]
    pub cost_model: String,
    /// Predicted seconds per microbatch (slowest stage).
    #[serde(default)]
    pub time_per_microbatch: f64,
    /// The simulator's seconds per microbatch, when simulated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub simulated_time_per_microbatch: Option<f64>,
}

impl PlanFile {
    fn from_plan(profile: &Profile, plan: &PartitionPlan) -> Result<Self> {
        let (partition, replicas) = layout_of(plan)?;
        Ok(PlanFile {
            model: profile.model.clone(),
            microbatch_size: profile.microbatch_size,
            schedule: plan.policy.name().into(),
            microbatches: plan.microbatches,
            partition: partition.to_string(),
            replicas,
            cost_model: plan.cost_model.into(),
            time_per_microbatch: plan.time_per_microbatch,
            simulated_time_per_microbatch: plan.simulated,
        })
    }

    /// Reads and checks a plan file.
    ///
    /// # Errors
    /// A bad-input error naming the file and the problem.
    pub fn read(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad_input(format!("plan {}: {e}", path.display())))?;
        let f: PlanFile = toml::from_str(&text).map_err(|e| {
            bad_input(format!(
                "plan {}: {}",
                path.display(),
                e.to_string().replace('\n', " ")
            ))
        })?;
        if f.replicas.is_empty() || f.replicas.contains(&0) || f.microbatches == 0 {
            return Err(bad_input(format!(
                "plan {}: replicas and microbatches must be at least 1",
                path.display()
            )));
        }
        Ok(f)
    }
}

fn load_profile(path: &std::path::Path) -> Result<Profile> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| bad_input(format!("profile {}: {e}", path.display())))?;
    if text.trim_start().starts_with('{') {
        Profile::from_json(&text)
    } else {
        Profile::from_pipedream(&text)
    }
    .map_err(|e| bad_input(format!("{}: {e}", path.display())))
}

/// Default-model options from the flags.
fn plan_options(args: &PlanArgs, workers: u32) -> PlanOptions {
    PlanOptions {
        latency: args.latency,
        memory: args.memory,
        wire: args.wire_dtype,
        overlap: !args.no_overlap,
        policy: args.schedule,
        microbatches: args.microbatches,
        straight: args.straight || args.stages.is_some(),
        ..PlanOptions::new(workers, args.bandwidth)
    }
}

/// Runs `pipe plan`.
pub fn cmd_plan(args: &PlanArgs) -> Result<()> {
    let profile = match (&args.profile, &args.model) {
        (Some(path), _) => load_profile(path)?,
        (None, Some(model)) => {
            if args.microbatch_size == 0 {
                return Err(bad_input("--microbatch-size must be at least 1".into()));
            }
            let opts = ProfileOptions {
                calibrate: Some(args.microbatches),
                concurrent: pipe_experiments::partition::busy_workers(
                    args.stages.or(args.workers).unwrap_or(1),
                ),
                ..ProfileOptions::new(args.microbatch_size)
            };
            profile_preset(model, &opts, 1)?
        }
        (None, None) => return Err(bad_input("give --profile FILE or --model M".into())),
    };
    let workers = args.stages.or(args.workers).unwrap_or(0);
    let plan = match args.cost_model {
        PlanCostModel::Pipedream => {
            if let Some(r) = args.activation_compression {
                if !r.is_finite() || r <= 0.0 {
                    return Err(bad(ScheduleError::Plan(format!(
                        "activation compression ratio must be > 0, got {r}"
                    ))));
                }
            }
            let opts = PipeDreamOptions {
                workers,
                bandwidth: args.bandwidth,
                memory: args.memory,
                straight: args.straight || args.stages.is_some(),
                activation_compression: args.activation_compression,
            };
            pipe_scheduler::pipedream(&profile, &opts).map_err(bad)?
        }
        PlanCostModel::Default => {
            if args.activation_compression.is_some() {
                return Err(bad_input(
                    "--activation-compression belongs to --cost-model pipedream (the default \
                     model counts transfers always; see --wire-dtype)"
                        .into(),
                ));
            }
            let opts = plan_options(args, workers);
            pipe_scheduler::plan_checked(&profile, &opts).map_err(bad)?
        }
    };
    out!("{}", render_plan(&profile, &plan, args.memory));
    if let Some(path) = &args.output {
        let file = PlanFile::from_plan(&profile, &plan)?;
        let text = toml::to_string(&file)?;
        std::fs::write(
            path,
            format!("# written by pipe plan; run it with pipe train --plan\n{text}"),
        )
        .with_context(|| format!("writing {}", path.display()))?;
        outln!("plan written to {}", path.display());
    }
    Ok(())
}

/// A plan as text: the headline prediction, one row per stage, and each stage's layers.
pub fn render_plan(profile: &Profile, plan: &PartitionPlan, memory: Option<f64>) -> String {
    let per_s = |t: f64| {
        if profile.microbatch_size > 0 {
            format!("{:.0} samples/s", profile.microbatch_size as f64 / t)
        } else {
            format!("{:.2} microbatches/s", 1.0 / t)
        }
    };
    let mut out = format!(
        "{} stage(s) on {} worker(s), cost model {}, schedule {} (M = {}): {} per microbatch \
         ({}), {:.2}x one worker ({}), {:.2}x data parallelism ({})\n",
        plan.stages.len(),
        plan.stages.iter().map(|s| s.replicas).sum::<u32>(),
        plan.cost_model,
        plan.policy.name(),
        plan.microbatches,
        secs(plan.time_per_microbatch),
        per_s(plan.time_per_microbatch),
        plan.speedup_over_single(),
        per_s(plan.single_worker),
        plan.speedup_over_data_parallel(),
        per_s(plan.data_parallel),
    );
    if let Some(sim) = plan.simulated {
        out.push_str(&format!(
            "simulated: {} per microbatch ({}) with fill, drain and the schedule's exact order\n",
            secs(sim),
            per_s(sim)
        ));
    }
    out.push_str(&format!(
        "{:<6} {:>10} {:>8} {:>12} {:>12} {:>12} {:>12} {:>12}  bound\n",
        "stage", "layers", "replicas", "compute", "allreduce", "transfer", "params", "memory"
    ));
    for (i, s) in plan.stages.iter().enumerate() {
        let slowest = (s.time - plan.time_per_microbatch).abs() <= 1e-12 * plan.time_per_microbatch;
        let mem = match memory {
            Some(limit) => format!("{} ({:.0}%)", bytes(s.memory), 100.0 * s.memory / limit),
            None => bytes(s.memory),
        };
        out.push_str(&format!(
            "{:<6} {:>10} {:>8} {:>12} {:>12} {:>12} {:>12} {:>12}  {}{}\n",
            i,
            format!("{}-{}", s.layers.start, s.layers.end - 1),
            s.replicas,
            secs(s.compute),
            secs(s.communication),
            secs(s.transfer),
            bytes(s.param_bytes),
            mem,
            s.bound.describe(),
            if slowest { " (slowest stage)" } else { "" }
        ));
    }
    let name = |at: usize| {
        let layer = plan.order.get(at).copied().unwrap_or(at);
        profile.layers.get(layer).map_or("?", |l| l.name.as_str())
    };
    for (i, s) in plan.stages.iter().enumerate() {
        out.push_str(&format!(
            "stage {i}: {} .. {}\n",
            name(s.layers.start),
            name(s.layers.end - 1)
        ));
    }
    out
}

/// What `pipe train --workers W` plans with: the model profiled at the run's microbatch size
/// with one thread, planned under the default model for the run's schedule. In-process
/// activations move for free; the all-reduce's measured cost sets the bandwidth.
///
/// # Errors
/// Profiling or planning failures (an unplannable schedule is bad input).
pub fn auto_plan(
    name: &str,
    spec: &ModelSpec,
    microbatch_size: usize,
    policy: &str,
    microbatches: u32,
    workers: u32,
) -> Result<(Profile, PartitionPlan)> {
    let model = Model::new(spec)?;
    let be = CpuBackend::new(1)?;
    let opts = ProfileOptions {
        warmup: 2,
        repeats: 5,
        calibrate: Some(microbatches),
        concurrent: pipe_experiments::partition::busy_workers(workers),
        ..ProfileOptions::new(microbatch_size)
    };
    let profile = profile_model(&model, name, &be, &opts)?;
    let policy: Policy = policy.parse().map_err(bad)?;
    let bandwidth = pipe_experiments::partition::in_process_bandwidth(&model, microbatch_size)?;
    let opts = PlanOptions {
        policy,
        microbatches,
        ..PlanOptions::new(workers, bandwidth)
    };
    let plan = pipe_scheduler::plan_checked(&profile, &opts).map_err(bad)?;
    Ok((profile, plan))
}

/// A plan's stages as the partition `--partition` takes (its text is what a plan file holds),
/// and its replica counts.
///
/// # Errors
/// When the stages do not tile the layers (never, for a plan the planner made).
pub fn layout_of(plan: &PartitionPlan) -> Result<(Partition, Vec<u32>)> {
    let ranges = plan.stages.iter().map(|s| s.layers.clone()).collect();
    let partition = Partition::new(ranges, plan.order.len())?;
    Ok((partition, plan.stages.iter().map(|s| s.replicas).collect()))
}
