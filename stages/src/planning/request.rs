//! `pipe plan`'s request, in the library: the flags that ask for a plan, checked before
//! anything is profiled or planned, the profile they name (a file, PipeDream's graph format, or
//! a preset profiled as `pipe train --workers` profiles it), the links and hosts they charge,
//! and the plan under the default or PipeDream's cost model, with its text and its plan file.
//! The command line parses the request and prints what comes back.

use std::path::{Path, PathBuf};

use pipe_kernels::CpuBackend;
use pipe_scheduler::planner::placement::Hosts;
use pipe_scheduler::planner::transport::TransportCost;
use pipe_scheduler::sim::Link;
use pipe_scheduler::units::{bytes, parse_bandwidth, parse_bytes, parse_seconds, secs};
use pipe_scheduler::{
    PartitionPlan, PipeDreamOptions, PlanOptions, Policy, Profile, ScheduleError, WireDtype,
};
use pipe_transport::TransportKind;

use super::ProfileReport;
use crate::config::PlanFile;
use crate::error::{Result, StageError};

/// Cost models `pipe plan` knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PlanCostModel {
    /// Transfers on the link, overlap, memory under the schedule, flush bubbles simulated.
    Default,
    /// PipeDream's optimizer, formula for formula.
    Pipedream,
}

/// `pipe plan`: partition a profiled model into stages and per-stage replicas.
#[derive(clap::Args, Debug)]
pub struct PlanRequest {
    /// Layer profile: pipe's JSON, or a PipeDream graph file (`nodeK -- ...` lines).
    #[arg(long, value_name = "FILE", required_unless_present = "model")]
    pub profile: Option<PathBuf>,
    /// Profile this model preset first (instead of --profile).
    #[arg(long, conflicts_with = "profile")]
    pub model: Option<String>,
    /// Samples per microbatch when profiling --model.
    #[arg(long, default_value_t = 64)]
    pub microbatch_size: usize,
    /// Workers to plan for (all are used).
    #[arg(long, required_unless_present = "stages")]
    pub workers: Option<u32>,
    /// Exactly S stages, one worker each: the exact min-max split by time.
    #[arg(long, conflicts_with_all = ["workers", "straight"])]
    pub stages: Option<u32>,
    /// Link bandwidth (GB means 10^9 bytes) [default: the measured rate of `--transport`'s
    /// links, else 10GB/s]. With `--hosts` or `--cluster`: the network's between hosts.
    #[arg(long, value_parser = parse_bandwidth)]
    pub bandwidth: Option<f64>,
    /// Link latency per message [default: `--transport`'s measured one-way time, else 0].
    /// With `--hosts` or `--cluster`: the network's between hosts [default: QUIC's measured
    /// one-way time].
    #[arg(long, value_parser = parse_seconds)]
    pub latency: Option<f64>,
    /// Per-worker memory bound.
    #[arg(long, value_parser = parse_memory_bound)]
    pub memory: Option<f64>,
    /// The schedule the plan is for: pipedream, pipedream-nostash, vsync, 2bw, gpipe,
    /// 1f1b-flush or zb-h1.
    #[arg(long, default_value = "pipedream", value_parser = Policy::parse_flag)]
    pub schedule: Policy,
    /// Microbatches per update per replica.
    #[arg(long, default_value_t = 8)]
    pub microbatches: u32,
    /// Measure --model's profile again even where pipe's cache holds it (the new one
    /// replaces it).
    #[arg(long)]
    pub reprofile: bool,
    /// Cost model.
    #[arg(long, value_enum, default_value = "default")]
    pub cost_model: PlanCostModel,
    /// Element type of activations and gradients on the wire: f32 or bf16.
    #[arg(long, default_value = "f32")]
    pub wire_dtype: WireDtype,
    /// Sends do not overlap compute (a sender waits until its message lands).
    #[arg(long)]
    pub no_overlap: bool,
    /// No replication: one worker per stage.
    #[arg(long)]
    pub straight: bool,
    /// PipeDream model: activation compression ratio (activation transfers count only when
    /// given).
    #[arg(long)]
    pub activation_compression: Option<f64>,
    /// Write the plan as TOML to FILE (for `pipe train --plan`).
    #[arg(short, long, value_name = "FILE", value_parser = crate::outputs::output_file)]
    pub output: Option<PathBuf>,
    /// The transport whose costs the links are charged.
    #[command(flatten)]
    pub link: super::link_costs::LinkChoice,
    /// The hosts the workers are placed on.
    #[command(flatten)]
    pub placement: super::hosts::HostChoice,
}

/// `--memory`: a size ([`parse_bytes`]) above 0 (a bound of 0 holds no stage, and its share
/// printed as `NaN%`).
fn parse_memory_bound(text: &str) -> std::result::Result<f64, String> {
    match parse_bytes(text)? {
        b if b > 0.0 => Ok(b),
        _ => Err(format!("{text}: a memory bound must be above 0")),
    }
}

/// Reads a profile: pipe's JSON, or PipeDream's graph format. Text that opens as JSON does
/// (an object, or an array, which is not a profile) gets the JSON reader's error, not the
/// graph format's.
fn load_profile(path: &Path) -> Result<Profile> {
    let text = crate::limits::read_text_file(path, "profile")?;
    if text.trim_start().starts_with(['{', '[']) {
        Profile::from_json(&text)
    } else {
        Profile::from_pipedream(&text)
    }
    .map_err(|e| StageError::Config(format!("{}: {e}", path.display())))
}

/// The link bandwidth when `--bandwidth` is not given and no transport's rate is charged.
const DEFAULT_BANDWIDTH: f64 = 10e9;

/// Default-model options from the flags; each worker's base memory is `process` (this
/// process's resident bytes before it profiled) and the runtime. With `link`, the
/// measured costs of the links' transport: its processor time per message and per byte, and
/// its rate and latency where the flags give none.
fn plan_options(
    args: &PlanRequest,
    workers: u32,
    process: u64,
    link: Option<&TransportCost>,
    hosts: Option<Hosts>,
) -> PlanOptions {
    // Large messages cost a transport without a measured rate no more than small ones: no
    // link time.
    let rate = |c: &TransportCost| c.bandwidth.map_or(f64::INFINITY, |b| b.median);
    // With hosts, the flags describe the network between them; the links inside a host are
    // the transport's own.
    let (bandwidth, latency) = match (&hosts, link) {
        (Some(_), Some(cost)) => (rate(cost), cost.latency_s.median),
        _ => (
            args.bandwidth
                .unwrap_or_else(|| link.map_or(DEFAULT_BANDWIDTH, rate)),
            args.latency
                .unwrap_or_else(|| link.map_or(0.0, |c| c.latency_s.median)),
        ),
    };
    let opts = PlanOptions {
        worker_base: super::memory::worker_base(process),
        latency,
        memory: args.memory,
        wire: args.wire_dtype,
        overlap: !args.no_overlap,
        policy: args.schedule,
        microbatches: args.microbatches,
        straight: args.straight || args.stages.is_some(),
        hosts,
        // `pipe train --plan` sums the replicas' gradients in buckets of the default size.
        bucket_size: crate::pipeline::DEFAULT_BUCKET_SIZE,
        ..PlanOptions::new(workers, bandwidth)
    };
    match link {
        Some(cost) => opts.with_transport(cost),
        None => opts,
    }
}

/// A transport's measured costs and where they came from.
type ChargedLink = (TransportCost, String);

/// The links' measured costs (`--transport`, or shared memory inside hosts where a placement
/// is asked for) and the hosts with the network between them: `--bandwidth` and `--latency`
/// (default 10 GB/s and QUIC's one-way time), charged QUIC's processor time.
fn links_and_hosts(
    args: &PlanRequest,
    workers: u32,
    charged: &mut Vec<String>,
) -> Result<(Option<ChargedLink>, Option<Hosts>)> {
    let Some(list) = args.placement.parse()? else {
        return Ok((args.link.load()?, None));
    };
    // A cluster runs one worker per rank: a plan for fewer would be refused by the run.
    if let super::hosts::HostList::Ranks(ranks) = &list {
        if ranks.len() != workers as usize {
            return Err(StageError::Config(format!(
                "the cluster file has {} ranks and the plan {workers} workers: a run takes \
                 one worker per rank",
                ranks.len()
            )));
        }
    }
    let within = args.link.load_or(TransportKind::SHM)?;
    let (quic, source) = args.link.load_kind(TransportKind::QUIC)?;
    let between = Link {
        bandwidth: args.bandwidth.unwrap_or(DEFAULT_BANDWIDTH),
        latency: args.latency.unwrap_or(quic.latency_s.median),
        message_cpu: quic.message_cpu_s.median,
        byte_cpu: quic.byte_cpu_s.median,
    };
    charged.push(format!(
        "between hosts: {}/s, one way {}, QUIC's processor time {} us per message end and {} \
         ns per byte ({source})",
        bytes(between.bandwidth),
        secs(between.latency),
        quic.message_cpu_s.describe(1e6, ""),
        quic.byte_cpu_s.describe(1e9, ""),
    ));
    Ok((Some(within), Some(list.joined_by(between))))
}

/// Which workers each host runs, and which links cross hosts: each boundary between stages
/// whose workers are not all on one host, with the bytes it carries per microbatch, and each
/// replicated stage whose ring spans hosts.
pub fn render_placement(profile: &Profile, plan: &PartitionPlan, hosts: &Hosts) -> String {
    let mut out = String::from("placement:\n");
    let mut worker = 0usize;
    let mut per_host: Vec<Vec<String>> = vec![Vec::new(); hosts.names.len()];
    for (i, s) in plan.stages.iter().enumerate() {
        for &h in &s.hosts {
            if let Some(list) = per_host.get_mut(h as usize) {
                list.push(format!("worker {worker} (stage {i})"));
            }
            worker += 1;
        }
    }
    for (h, list) in per_host.iter().enumerate() {
        if !list.is_empty() {
            out.push_str(&format!(
                "  host {}: {}\n",
                hosts.name(h as u32),
                list.join(", ")
            ));
        }
    }
    let crossing = profile.crossing_bytes();
    let mut crossings = Vec::new();
    for (i, pair) in plan.stages.windows(2).enumerate() {
        let first = pair[0].hosts.first();
        if pair[0]
            .hosts
            .iter()
            .chain(&pair[1].hosts)
            .any(|h| Some(h) != first)
        {
            let at = plan.order.get(pair[0].layers.end - 1).copied();
            let moved = at.and_then(|l| crossing.get(l)).copied().unwrap_or(0.0);
            crossings.push(format!(
                "stage {i} -> {} ({} per microbatch each way)",
                i + 1,
                bytes(moved)
            ));
        }
    }
    for (i, s) in plan.stages.iter().enumerate() {
        if s.hosts.iter().any(|h| Some(h) != s.hosts.first()) {
            crossings.push(format!(
                "stage {i}'s all-reduce ({} of gradients per update)",
                bytes(s.param_bytes)
            ));
        }
    }
    if crossings.is_empty() {
        out.push_str("links crossing hosts: none\n");
    } else {
        out.push_str(&format!("links crossing hosts: {}\n", crossings.join("; ")));
    }
    out
}

/// Refuses zero or over-limit stage, worker and microbatch counts before anything is profiled
/// or planned, with the flag's own name.
fn check_counts(args: &PlanRequest) -> Result<()> {
    use pipe_scheduler::limits;
    for (flag, v) in [("--stages", args.stages), ("--workers", args.workers)] {
        match v {
            Some(0) => return Err(StageError::Config(format!("{flag} must be at least 1"))),
            // S stages hold one worker each; W workers may form as few as one stage.
            Some(n) => {
                let stages = if flag == "--stages" { n } else { 1 };
                limits::check_layout(u64::from(stages), u64::from(n), 1)
                    .map_err(StageError::from)?;
            }
            None => {}
        }
    }
    if args.microbatches == 0 {
        return Err(StageError::Config(
            "--microbatches must be at least 1".into(),
        ));
    }
    limits::check_microbatches(u64::from(args.microbatches)).map_err(StageError::from)?;
    Ok(())
}

/// Profiles the preset `model` as `pipe train --workers` does (either finds the other's
/// profile in the cache), reporting its progress to `report`.
///
/// # Errors
/// Bad input for a zero microbatch size or an unknown preset; profiling failures.
fn profile_preset(
    args: &PlanRequest,
    model: &str,
    report: Option<ProfileReport>,
) -> Result<Profile> {
    if args.microbatch_size == 0 {
        return Err(StageError::Config(
            "--microbatch-size must be at least 1".into(),
        ));
    }
    // As `pipe train --workers` profiles: either finds the other's in the cache.
    let opts = super::planning_profile(
        args.microbatch_size,
        Some(args.microbatches),
        super::busy_workers(args.stages.or(args.workers).unwrap_or(1)),
    );
    let profiling = super::Profiling::cached(args.reprofile);
    let profiling = match report {
        Some(report) => profiling.reporting(report),
        None => profiling,
    };
    let spec = crate::model::ModelSpec::preset(model)?;
    let built = crate::model::Model::new(&spec)?;
    let be = CpuBackend::new(1)?;
    profiling.profile(&built, model, &be, &opts, args.microbatches)
}

/// The plan under PipeDream's cost model, which charges every link alike and no processor
/// time for messages.
///
/// # Errors
/// Bad input for the default model's flags or a compression ratio that is not positive;
/// the planner's refusals.
fn pipedream_plan(args: &PlanRequest, profile: &Profile, workers: u32) -> Result<PartitionPlan> {
    if args.link.transport.is_some() || args.placement.given() {
        return Err(StageError::Config(
            "--transport, --hosts and --cluster belong to --cost-model default \
             (PipeDream's model charges every link alike and no processor time for \
             messages)"
                .into(),
        ));
    }
    if let Some(r) = args.activation_compression {
        if !r.is_finite() || r <= 0.0 {
            return Err(StageError::from(ScheduleError::Plan(format!(
                "activation compression ratio must be > 0, got {r}"
            ))));
        }
    }
    let opts = PipeDreamOptions {
        workers,
        bandwidth: args.bandwidth.unwrap_or(DEFAULT_BANDWIDTH),
        memory: args.memory,
        straight: args.straight || args.stages.is_some(),
        activation_compression: args.activation_compression,
    };
    pipe_scheduler::pipedream(profile, &opts).map_err(StageError::from)
}

/// A plan as the request asked for it, with what the command shows beside it.
#[derive(Clone, Debug)]
pub struct Planned {
    /// The plan.
    pub plan: PartitionPlan,
    /// The hosts it placed the workers on, where a placement was asked for.
    pub hosts: Option<Hosts>,
    /// What the links were charged, one line each (empty under PipeDream's cost model).
    pub charged: Vec<String>,
}

impl PlanRequest {
    /// Refuses zero or over-limit counts, and an output that would overwrite one of the
    /// request's inputs, before anything is profiled or planned.
    ///
    /// # Errors
    /// [`StageError::Config`] or the scheduler's limit, naming the flag.
    pub fn check(&self) -> Result<()> {
        check_counts(self)?;
        if let Some(output) = &self.output {
            use crate::outputs::{Input, check_not_input};
            let named = [
                ("--profile", self.profile.as_deref()),
                ("--transport-costs", self.link.transport_costs.as_deref()),
                ("--cluster", self.placement.cluster.as_deref()),
            ];
            check_not_input(output, "--output", &Input::named(&named))?;
        }
        Ok(())
    }

    /// The preset this request profiles first, if it names one instead of a profile file.
    pub fn preset(&self) -> Option<&str> {
        self.profile
            .is_none()
            .then_some(self.model.as_deref())
            .flatten()
    }

    /// The profile the request names: read from `--profile`, or `--model` profiled (its
    /// progress to `report`) or found in the cache.
    ///
    /// # Errors
    /// Bad input for an unreadable or malformed profile, an unknown preset or neither given;
    /// profiling failures.
    pub fn load_profile(&self, report: Option<ProfileReport>) -> Result<Profile> {
        match (&self.profile, &self.model) {
            (Some(path), _) => load_profile(path),
            (None, Some(model)) => profile_preset(self, model, report),
            (None, None) => Err(StageError::Config(
                "give --profile FILE or --model M".into(),
            )),
        }
    }

    /// Plans `profile` under the request's cost model; `process` is this process's resident
    /// bytes before it profiled (each worker's base memory).
    ///
    /// # Errors
    /// Flags of the other cost model; link costs that cannot be read or measured; the
    /// planner's refusals.
    pub fn plan(&self, profile: &Profile, process: u64) -> Result<Planned> {
        let workers = self.stages.or(self.workers).unwrap_or(0);
        if self.cost_model == PlanCostModel::Pipedream {
            return Ok(Planned {
                plan: pipedream_plan(self, profile, workers)?,
                hosts: None,
                charged: Vec::new(),
            });
        }
        if self.activation_compression.is_some() {
            return Err(StageError::Config(
                "--activation-compression belongs to --cost-model pipedream (the default \
                 model counts transfers always; see --wire-dtype)"
                    .into(),
            ));
        }
        let mut charged = Vec::new();
        let (link, hosts) = links_and_hosts(self, workers, &mut charged)?;
        if let Some((cost, source)) = &link {
            charged.push(super::link_costs::describe(cost, source));
        }
        let opts = plan_options(self, workers, process, link.as_ref().map(|l| &l.0), hosts);
        let hosts = opts.hosts.clone();
        let plan = pipe_scheduler::plan_checked(profile, &opts)?;
        Ok(Planned {
            plan,
            hosts,
            charged,
        })
    }
}

/// The plan file `pipe train --plan` runs, as text: the plan, and the host of each worker
/// where it placed them.
///
/// # Errors
/// A plan the file cannot hold.
pub fn plan_file_text(profile: &Profile, planned: &Planned) -> Result<String> {
    let mut file = PlanFile::from_plan(profile, &planned.plan)?;
    if let Some(hosts) = &planned.hosts {
        file.hosts = Some(
            planned
                .plan
                .stages
                .iter()
                .flat_map(|s| s.hosts.iter().map(|&h| hosts.name(h).to_string()))
                .collect(),
        );
    }
    let text = toml::to_string(&file)
        .map_err(|e| StageError::Config(format!("writing the plan file: {e}")))?;
    let text = format!("# written by pipe plan; run it with pipe train --plan\n{text}");
    check_plan_runs(&text)?;
    Ok(text)
}

/// Reads `text` back as `pipe train --plan` does (the one reader of plan files and the one
/// check of the run it makes), so that a plan `pipe plan` writes is one `pipe train` runs. A
/// plan that names no model (of an imported profile, another system's layers) is only parsed.
///
/// # Errors
/// [`StageError::Config`] naming what `pipe train --plan` would refuse.
fn check_plan_runs(text: &str) -> Result<()> {
    let source = "the plan being written";
    let parsed = PlanFile::parse(text, source)?;
    if parsed.model.is_empty() {
        return Ok(());
    }
    let mut settings = crate::config::TrainSettings::default();
    settings.apply_plan(&parsed, source)?;
    settings.resolve().map(drop).map_err(|e| {
        StageError::Config(format!(
            "this plan would not run (pipe train --plan would refuse it: {e})"
        ))
    })
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
    let recomputing: Vec<String> = plan
        .stages
        .iter()
        .enumerate()
        .filter(|(_, s)| s.recompute)
        .map(|(i, _)| i.to_string())
        .collect();
    if !recomputing.is_empty() {
        out.push_str(&format!(
            "recompute full on stage(s) {}: keeping their activations does not fit the memory \
             bound (their backward runs the forward again)\n",
            recomputing.join(", ")
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What `pipe train --plan` refuses, the plan writer refuses too; what it runs passes.
    #[test]
    fn a_plan_is_checked_as_train_reads_it() {
        let plan = "model = \"gpt-mini\"\nmicrobatch_size = 64\nschedule = \"pipedream\"\n\
                    microbatches = 8\npartition = \"0-10\"\nreplicas = [4]\n\
                    cost_model = \"default\"\ntime_per_microbatch = 0.25\n";
        assert!(check_plan_runs(plan).is_ok());
        let huge = plan.replace("microbatch_size = 64", "microbatch_size = 100000000");
        let err = check_plan_runs(&huge).err().map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("this plan would not run")),
            "{err:?}"
        );
        // A plan of an imported profile names no model: parsed only.
        assert!(check_plan_runs(&plan.replace("gpt-mini", "")).is_ok());
    }
}
