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

use crate::output::{bad_input, experiment_error};
pub use pipe_experiments::flags::{
    AllreduceWorkerArgs, HostsBenchArgs, PartitionBenchArgs, PipelineBenchArgs, TransportBenchArgs,
};
use pipe_stages::pipeline::processes::{JoinOptions, RECORD, join};

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
    let cfg = args.config();
    let mut report = pipe_experiments::transport::run(&cfg)?;
    for registration in pipe_transport::kinds::TRANSPORTS {
        if registration.crosses_processes {
            let transport = TransportKind::Registered(registration);
            let ring = pipe_experiments::transport::allreduce_in_processes(&cfg, transport)
                .map_err(experiment_error)?;
            report.allreduce.push(ring);
        }
    }
    out!("{}", pipe_experiments::transport::render(&report));
    write_json(args.json.as_ref(), &report)
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

/// Checks `pipe bench mfu`'s step count against
/// [`pipe_stages::limits::MAX_BENCH_ITERATIONS`] and its threads against the machine.
fn check_mfu_counts(steps: u64, threads: usize) -> Result<()> {
    use pipe_stages::limits::{MAX_BENCH_ITERATIONS, Machine, check_count, check_threads};
    check_count(
        "--steps",
        steps,
        MAX_BENCH_ITERATIONS,
        "far past what a median needs",
    )?;
    check_threads(threads as u64, &Machine::detect())?;
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
    check_mfu_counts(args.steps as u64, args.threads)?;
    pipe_experiments::flags::check_model_batch(&args.model, args.batch)
        .map_err(experiment_error)?;
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

/// Runs `pipe bench hosts`.
///
/// # Errors
/// Bad input for sizes, counts and namespaces; run-time failures of a worker.
pub fn run_hosts(args: &HostsBenchArgs) -> Result<()> {
    let pipe = std::env::current_exe().context("finding this pipe binary")?;
    let cfg = args.config(pipe).map_err(experiment_error)?;
    let report = pipe_experiments::hosts::run(&cfg).map_err(experiment_error)?;
    out!("{}", pipe_experiments::hosts::render(&report));
    write_json(args.json.as_ref(), &report)
}

/// Runs `pipe bench pipeline`.
///
/// # Errors
/// Bad input for zero updates; run-time failures of the benchmark.
pub fn run_pipeline(args: &PipelineBenchArgs) -> Result<()> {
    let pipe = std::env::current_exe().map_err(|e| anyhow::anyhow!("finding pipe: {e}"))?;
    let cfg = args.config(Some(pipe)).map_err(experiment_error)?;
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
    let cfg = args.config().map_err(experiment_error)?;
    let report = pipe_experiments::partition::run(&cfg).map_err(experiment_error)?;
    out!("{}", pipe_experiments::partition::render(&report));
    write_json(args.json.as_ref(), &report)
}
