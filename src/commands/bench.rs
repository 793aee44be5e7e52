//! `pipe bench mfu`, `pipe bench pipeline`, `pipe bench partition`, `pipe bench transport` and
//! `pipe bench hosts`: check the arguments,
//! run the benchmark in `pipe-experiments`, print its report and write it as JSON on request.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, Result};
use clap::Args;
use pipe_experiments::ExperimentError;
use pipe_kernels::{BackendKind, Precision};

use pipe_transport::TransportKind;
use pipe_transport::cluster::ClusterFile;
use pipe_transport::kinds::MeshSettings;

use crate::args::parse_policy;
use crate::output::{bad_input, schedule_error};
use pipe_stages::pipeline::processes::{JoinOptions, LaunchOptions, RECORD, join, launch};

/// `pipe bench partition`: the profiled plan against the uniform split.
#[derive(Args, Debug)]
pub struct PartitionBenchArgs {
    /// Model preset.
    #[arg(long, default_value = "mlp-256-1536x3-256x6-10")]
    model: String,
    /// Samples per microbatch.
    #[arg(long, default_value_t = 32)]
    microbatch_size: usize,
    /// Microbatches per update per replica.
    #[arg(long, default_value_t = 4)]
    microbatches: u32,
    /// Workers.
    #[arg(long, default_value_t = 2)]
    workers: u32,
    /// Schedule.
    #[arg(long, default_value = "pipedream", value_parser = parse_policy)]
    schedule: pipe_scheduler::Policy,
    /// Timed minibatches per measurement.
    #[arg(long, default_value_t = 24)]
    updates: u32,
    /// Rounds (figures are medians over rounds).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// `pipe bench hosts`: the planner's pick against a pipeline and data parallelism, measured as
/// worker processes over hosts.
#[derive(Args, Debug)]
pub struct HostsBenchArgs {
    /// Model preset.
    #[arg(long, default_value = "mlp-784-1024x16-10")]
    model: String,
    /// Samples per microbatch.
    #[arg(long, default_value_t = 32)]
    microbatch_size: usize,
    /// Microbatches per update per replica.
    #[arg(long, default_value_t = 4)]
    microbatches: u32,
    /// Workers (processes).
    #[arg(long, default_value_t = 4)]
    workers: u32,
    /// The link's bandwidth, as the planner and the simulator are told (GB means 10^9 bytes).
    #[arg(long, value_parser = crate::args::parse_bandwidth)]
    bandwidth: f64,
    /// Host addresses, comma-separated; ranks fill them in order, as the plan places them.
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1")]
    hosts: Vec<String>,
    /// The network namespace of each host, comma-separated (workers start with `ip netns
    /// exec`); none: on this host.
    #[arg(long, value_delimiter = ',')]
    netns: Vec<String>,
    /// Timed minibatches per measurement.
    #[arg(long, default_value_t = 30)]
    updates: u64,
    /// Cores the workers share, for the simulator (default: this machine's).
    #[arg(long)]
    cores: Option<u32>,
    /// The link's MTU in bytes (1,280 to 32,028): QUIC's processor time per message and per
    /// byte, which the simulator charges, is measured on loopback with datagrams that fit it.
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u16).range(1280..=32028))]
    mtu: u16,
    /// Where cluster files go (default: a folder in the temporary directory).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// Runs `pipe bench hosts`.
///
/// # Errors
/// Bad input for sizes, counts and namespaces; run-time failures of a worker.
pub fn run_hosts(args: &HostsBenchArgs) -> Result<()> {
    if args.workers < 2 || args.microbatch_size == 0 || args.microbatches == 0 {
        return Err(bad_input(
            "--workers must be at least 2, --microbatch-size and --microbatches positive".into(),
        ));
    }
    check_counts(&[("--updates", args.updates)], None)?;
    pipe_scheduler::limits::check_microbatches(u64::from(args.microbatches))
        .and_then(|()| pipe_scheduler::limits::check_layout(1, u64::from(args.workers), 1))
        .map_err(schedule_error)?;
    check_model_batch(&args.model, args.microbatch_size)?;
    let cores = args.cores.or_else(|| {
        std::thread::available_parallelism()
            .ok()
            .map(|n| n.get() as u32)
    });
    let dir = args.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("pipe-bench-hosts-{}", std::process::id()))
    });
    let cfg = pipe_experiments::hosts::HostsBenchConfig {
        model: args.model.clone(),
        microbatch: args.microbatch_size,
        microbatches: args.microbatches,
        workers: args.workers,
        bandwidth: args.bandwidth,
        hosts: args.hosts.clone(),
        netns: args.netns.clone(),
        updates: args.updates,
        cores,
        mtu: args.mtu,
        pipe: std::env::current_exe().context("finding this pipe binary")?,
        dir,
    };
    let report = pipe_experiments::hosts::run(&cfg).map_err(|e| match e {
        ExperimentError::Stage(s) if s.is_bad_input() => anyhow::Error::from(s),
        ExperimentError::Schedule(s) => schedule_error(s),
        other => anyhow::Error::from(other),
    })?;
    out!("{}", pipe_experiments::hosts::render(&report));
    write_json(args.json.as_ref(), &report)
}

/// `pipe bench mfu`: single-worker throughput and model FLOP utilisation.
#[derive(Args, Debug)]
pub struct MfuArgs {
    /// Model preset.
    #[arg(long, default_value = "mlp-784-1024x16-10")]
    model: String,
    /// Samples per step.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Compute threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// SGD momentum (0: plain SGD).
    #[arg(long, default_value_t = 0.0)]
    momentum: f32,
    /// Optimizer: sgd (learning rate 1e-3, --momentum), or adamw as GPT-2 trains (learning
    /// rate 6e-4, betas 0.9 and 0.95, weight decay 0.1).
    #[arg(long, default_value = "sgd")]
    optimizer: pipe_experiments::mfu::MfuOptimizer,
    /// Also time this many steps operation by operation (the device waited for after each),
    /// on a fresh backend after the measurement: where a step's time goes.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1000))]
    breakdown: u64,
    /// Compute backend: cpu, or cuda (device 0; builds with `--features cuda`).
    #[arg(long, default_value = "cpu", value_parser = crate::args::BackendParser)]
    backend: BackendKind,
    /// Precision of the matrix products: f32, tf32 or bf16 (the last two on cuda only).
    #[arg(long, default_value = "f32", value_parser = crate::args::parse_precision)]
    precision: Precision,
    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// `pipe bench pipeline`: pipelined throughput against one worker and the simulator.
#[derive(Args, Debug)]
pub struct PipelineBenchArgs {
    /// Timed minibatches per case.
    #[arg(long, default_value_t = 24)]
    updates: u32,
    /// Warm-up minibatches per case.
    #[arg(long, default_value_t = 6)]
    warmup: u32,
    /// Only the small model (256-256x8-10).
    #[arg(long)]
    small_only: bool,
    /// Rounds of every measurement (figures are medians over rounds).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Only the cases on threads of this process (no worker-process cases).
    #[arg(long)]
    threads_only: bool,
    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// `pipe bench transport`: tensor streaming per transport, TCP, the ring all-reduce.
#[derive(Args, Debug)]
pub struct TransportBenchArgs {
    /// MiB per streamed tensor.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=1024))]
    message_mib: u64,
    /// Tensors per streaming round.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    messages: u32,
    /// MB all-reduced.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=4096))]
    allreduce_mb: u64,
    /// Workers in the all-reduce.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..=64))]
    allreduce_workers: u32,
    /// Rounds per figure (medians).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Measure only the link costs the planner charges (each transport's latency and
    /// processor time per message and per byte, over 5 rounds), cache them, and skip the
    /// streaming and all-reduce figures.
    #[arg(long)]
    costs_only: bool,
    /// Also write the link costs as JSON to FILE (what `pipe plan --transport-costs` reads).
    #[arg(long, value_name = "FILE")]
    costs_out: Option<PathBuf>,
}

/// Measures the link costs, caches them (pipe's cache, where the planner reads them) and
/// prints them; writes them to `out` too when given.
fn measure_link_costs(out: Option<&PathBuf>) -> Result<()> {
    use pipe_stages::planning::link_costs as costs;
    let measured = costs::measure(costs::ROUNDS)?;
    outln!(
        "link costs (median over {} rounds, least-most):",
        costs::ROUNDS
    );
    out!("{}", costs::render(&measured));
    match pipe_stages::cache::Cache::open() {
        Some(cache) => {
            let path = cache.put(&costs::key(), &measured)?;
            outln!("kept in {}", path.display());
        }
        None => outln!("not kept: no cache directory (set PIPE_CACHE_DIR)"),
    }
    if let Some(path) = out {
        let text = serde_json::to_string_pretty(&measured)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        outln!("written to {}", path.display());
    }
    Ok(())
}

/// Runs `pipe bench transport`.
///
/// # Errors
/// Run-time failures of the benchmark (the flags are range-checked by the parser).
pub fn run_transport(args: &TransportBenchArgs) -> Result<()> {
    measure_link_costs(args.costs_out.as_ref())?;
    if args.costs_only {
        return Ok(());
    }
    // Sizes, workers and rounds are bounded by their flags' ranges.
    let cfg = pipe_experiments::transport::TransportBenchConfig {
        message_mib: args.message_mib as usize,
        messages: args.messages,
        allreduce_mb: args.allreduce_mb as usize,
        allreduce_workers: args.allreduce_workers,
        rounds: args.rounds,
    };
    let mut report = pipe_experiments::transport::run(&cfg)?;
    for registration in pipe_transport::kinds::TRANSPORTS {
        if registration.crosses_processes {
            let transport = TransportKind::Registered(registration);
            report
                .allreduce
                .push(allreduce_in_processes(args, transport)?);
        }
    }
    out!("{}", pipe_experiments::transport::render(&report));
    write_json(args.json.as_ref(), &report)
}

/// The ring all-reduce with every worker its own process, over a transport that crosses
/// processes (on loopback, or shared memory): each process's seconds per round come back as a record; a round takes its
/// slowest worker.
fn allreduce_in_processes(
    args: &TransportBenchArgs,
    transport: TransportKind,
) -> Result<pipe_experiments::transport::AllReduce> {
    let n = args.allreduce_workers;
    let mut per_rank: Vec<Option<Vec<f64>>> = vec![None; n as usize];
    let mut on_record = |rank: u32, json: &str| -> pipe_stages::Result<()> {
        let times: Vec<f64> = serde_json::from_str(json).map_err(|e| {
            pipe_stages::StageError::Executor(format!("a worker's all-reduce times: {e}"))
        })?;
        if let Some(slot) = per_rank.get_mut(rank as usize) {
            *slot = Some(times);
        }
        Ok(())
    };
    let (mb, rounds) = (args.allreduce_mb.to_string(), args.rounds.to_string());
    let command = |_: &std::path::Path| -> Vec<std::ffi::OsString> {
        vec![
            "bench".into(),
            "allreduce-worker".into(),
            "--mb".into(),
            mb.clone().into(),
            "--rounds".into(),
            rounds.clone().into(),
            "--transport".into(),
            transport.name().into(),
        ]
    };
    launch(&LaunchOptions::new(n), &[], &command, &mut on_record)?;
    let slowest: Vec<f64> = (0..args.rounds as usize)
        .map(|r| {
            per_rank
                .iter()
                .map(|t| t.as_ref().and_then(|t| t.get(r)).copied())
                .try_fold(0.0f64, |m, t| t.map(|t| m.max(t)))
                .ok_or_else(|| anyhow::anyhow!("a worker did not report its all-reduce times"))
        })
        .collect::<Result<_>>()?;
    Ok(pipe_experiments::transport::allreduce_from_times(
        &format!(
            "{}, one process per worker",
            transport.registration().map_or("auto", |r| r.about)
        ),
        n,
        args.allreduce_mb as usize * 1_000_000,
        &slowest,
    ))
}

/// `pipe bench allreduce-worker`: one process of `pipe bench transport`'s all-reduce among
/// processes (started by it, not by hand).
#[derive(Args, Debug)]
pub struct AllreduceWorkerArgs {
    /// MB all-reduced.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=4096))]
    mb: u64,
    /// Timed rounds.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// The cluster file.
    #[arg(long)]
    cluster: PathBuf,
    /// This worker's rank.
    #[arg(long)]
    rank: u32,
    /// Started by a launcher.
    #[arg(long)]
    launched: bool,
    /// What carries the ring: a registered transport that crosses processes.
    #[arg(long, default_value = "quic", value_parser = clap::builder::PossibleValuesParser::new(pipe_transport::kinds::names()))]
    transport: String,
}

/// Runs one all-reduce worker: joins the cluster, reports its seconds per round as a record.
///
/// # Errors
/// Bad cluster files; transport failures.
pub fn run_allreduce_worker(args: &AllreduceWorkerArgs) -> Result<()> {
    let cluster = ClusterFile::load(&args.cluster).map_err(|e| bad_input(e.to_string()))?;
    let transport: TransportKind = args.transport.parse().map_err(bad_input)?;
    let opts = JoinOptions {
        transport,
        settings: MeshSettings::new(cluster.run_id),
        meet: match (args.launched, args.cluster.parent()) {
            (true, Some(dir)) => dir.to_path_buf(),
            _ => pipe_transport::shm::rendezvous_dir(cluster.run_id),
        },
    };
    let launched = args.launched.then(|| Arc::new(AtomicBool::new(false)));
    let mut ep = join(&cluster, args.rank, None, opts, launched)?.endpoint;
    let times =
        pipe_experiments::transport::allreduce_rounds(&mut ep, args.mb as usize, args.rounds);
    pipe_transport::Transport::close(&mut ep)?;
    outln!("{RECORD}{}", serde_json::to_string(&times?)?);
    Ok(())
}

/// Checks a benchmark's counts (flag, value) against
/// [`pipe_stages::limits::MAX_BENCH_ITERATIONS`] and its threads against the machine.
fn check_counts(counts: &[(&str, u64)], threads: Option<usize>) -> Result<()> {
    use pipe_stages::limits::{MAX_BENCH_ITERATIONS, Machine, check_count, check_threads};
    for &(flag, v) in counts {
        check_count(
            flag,
            v,
            MAX_BENCH_ITERATIONS,
            "far past what a median needs",
        )?;
    }
    if let Some(t) = threads {
        check_threads(t as u64, &Machine::detect())?;
    }
    Ok(())
}

/// Checks `model`'s microbatch of `size` samples against the tensor limit.
fn check_model_batch(model: &str, size: usize) -> Result<()> {
    let spec = pipe_stages::model::ModelSpec::preset(model)?;
    pipe_stages::model::Model::new(&spec)?.check_microbatch(size)?;
    Ok(())
}

/// Writes a report as pretty JSON, with a final newline, when `path` is given.
fn write_json<T: serde::Serialize>(path: Option<&PathBuf>, report: &T) -> Result<()> {
    if let Some(path) = path {
        let text = serde_json::to_string_pretty(report)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Runs `pipe bench mfu`.
///
/// # Errors
/// Bad input for non-positive sizes or an unusable model; run-time failures of the benchmark.
pub fn run_mfu(args: &MfuArgs) -> Result<()> {
    if args.threads == 0 || args.batch == 0 || args.steps == 0 {
        return Err(bad_input(
            "--threads, --batch and --steps must be positive".into(),
        ));
    }
    check_counts(&[("--steps", args.steps as u64)], Some(args.threads))?;
    check_model_batch(&args.model, args.batch)?;
    let backend = args
        .backend
        .with_precision(args.precision)
        .map_err(bad_input)?;
    // A backend that cannot run here is bad input, said before any measuring.
    drop(crate::args::open_backend(backend, 1)?);
    let cfg = pipe_experiments::mfu::MfuConfig {
        model: args.model.clone(),
        batch: args.batch,
        threads: args.threads,
        steps: args.steps,
        warmup: 3,
        momentum: args.momentum,
        optimizer: args.optimizer,
        backend,
    };
    let report = pipe_experiments::mfu::run(&cfg).map_err(|e| match e {
        ExperimentError::Stage(s) if s.is_bad_input() => anyhow::Error::from(s),
        other => anyhow::Error::from(other),
    })?;
    out!("{}", pipe_experiments::mfu::render(&report));
    write_json(args.json.as_ref(), &report)?;
    if args.breakdown > 0 {
        let ops = pipe_experiments::mfu::operation_breakdown(&cfg, args.breakdown as usize)?;
        out!("{}", pipe_experiments::mfu::render_breakdown(&ops));
    }
    Ok(())
}

/// Runs `pipe bench pipeline`.
///
/// # Errors
/// Bad input for zero updates; run-time failures of the benchmark.
pub fn run_pipeline(args: &PipelineBenchArgs) -> Result<()> {
    if args.updates == 0 {
        return Err(bad_input("--updates must be positive".into()));
    }
    check_counts(
        &[
            ("--updates", u64::from(args.updates)),
            ("--warmup", u64::from(args.warmup)),
            ("--rounds", u64::from(args.rounds)),
        ],
        None,
    )?;
    let cfg = pipe_experiments::pipeline::PipelineBenchConfig {
        updates: args.updates,
        warmup: args.warmup,
        small_only: args.small_only,
        rounds: args.rounds,
        pipe: if args.threads_only {
            None
        } else {
            Some(std::env::current_exe().map_err(|e| anyhow::anyhow!("finding pipe: {e}"))?)
        },
    };
    let report = pipe_experiments::pipeline::run(&cfg)?;
    out!("{}", pipe_experiments::pipeline::render(&report));
    write_json(args.json.as_ref(), &report)
}

/// Runs `pipe bench partition`.
///
/// # Errors
/// Bad input for non-positive sizes, too few workers, an unusable model or an unplannable
/// schedule; run-time failures of the benchmark.
pub fn run_partition(args: &PartitionBenchArgs) -> Result<()> {
    if args.updates == 0 || args.microbatch_size == 0 || args.microbatches == 0 || args.workers < 2
    {
        return Err(bad_input(
            "--updates, --microbatch-size and --microbatches must be positive, --workers at least 2"
                .into(),
        ));
    }
    check_counts(
        &[
            ("--updates", u64::from(args.updates)),
            ("--rounds", u64::from(args.rounds)),
        ],
        None,
    )?;
    pipe_scheduler::limits::check_microbatches(u64::from(args.microbatches))
        .and_then(|()| pipe_scheduler::limits::check_layout(1, u64::from(args.workers), 1))
        .map_err(schedule_error)?;
    check_model_batch(&args.model, args.microbatch_size)?;
    let cfg = pipe_experiments::partition::PartitionBenchConfig {
        model: args.model.clone(),
        microbatch: args.microbatch_size,
        microbatches: args.microbatches,
        workers: args.workers,
        policy: args.schedule,
        updates: args.updates,
        rounds: args.rounds,
        ..Default::default()
    };
    let report = pipe_experiments::partition::run(&cfg).map_err(|e| match e {
        ExperimentError::Stage(s) if s.is_bad_input() => anyhow::Error::from(s),
        ExperimentError::Schedule(s) => schedule_error(s),
        other => anyhow::Error::from(other),
    })?;
    out!("{}", pipe_experiments::partition::render(&report));
    write_json(args.json.as_ref(), &report)
}
