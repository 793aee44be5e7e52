//! `pipe bench mfu`, `pipe bench pipeline`, `pipe bench partition`, `pipe bench transport` and
//! `pipe bench hosts`: check the arguments,
//! run the benchmark in `pipe-experiments`, print its report and write it as JSON on request.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, Result};
use pipe_experiments::ExperimentError;

use pipe_transport::TransportKind;
use pipe_transport::cluster::ClusterFile;
use pipe_transport::kinds::MeshSettings;

use crate::output::{bad_input, experiment_error};
pub use pipe_experiments::flags::{
    AllreduceWorkerArgs, HostsBenchArgs, MfuArgs, PartitionBenchArgs, PipelineBenchArgs,
    TransportBenchArgs,
};
use pipe_stages::pipeline::processes::{JoinOptions, RECORD, join};

/// Measures the link costs, caches them (pipe's cache, where the planner reads them) and
/// prints them; writes them to `out` too when given.
fn measure_link_costs(out: Option<&PathBuf>) -> Result<()> {
    use pipe_stages::planning::link_costs as costs;
    let (measured, kept) = costs::measure_and_keep()?;
    outln!(
        "link costs (median over {} rounds, least-most):",
        costs::ROUNDS
    );
    out!("{}", costs::render(&measured));
    match kept {
        Ok(path) => outln!("kept in {}", path.display()),
        Err(why) => outln!("not kept: {why}"),
    }
    write_json(out, &measured)?;
    if let Some(path) = out {
        outln!("written to {}", path.display());
    }
    Ok(())
}

/// Runs `pipe bench transport`.
///
/// # Errors
/// Run-time failures of the benchmark (the flags are range-checked by the parser).
pub fn run_transport(args: &TransportBenchArgs) -> Result<()> {
    let cfg = args.config();
    if !args.costs_only {
        // Refused before the link costs are measured, not after.
        pipe_experiments::transport::admit_buffers(&cfg).map_err(experiment_error)?;
    }
    measure_link_costs(args.costs_out.as_ref())?;
    if args.costs_only {
        return Ok(());
    }
    let mut report = pipe_experiments::transport::run(&cfg).map_err(experiment_error)?;
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

/// Writes a report as pretty JSON, with a final newline, when `path` is given.
fn write_json<T: serde::Serialize>(path: Option<&PathBuf>, report: &T) -> Result<()> {
    if let Some(path) = path {
        let text = serde_json::to_string_pretty(report)?;
        pipe_stages::outputs::write_file(path, (text + "\n").as_bytes())?;
    }
    Ok(())
}

/// Runs `pipe bench mfu`.
///
/// # Errors
/// Bad input for non-positive sizes or an unusable model; run-time failures of the benchmark.
pub fn run_mfu(args: &MfuArgs) -> Result<()> {
    let cfg = args.config().map_err(experiment_error)?;
    // A backend that cannot run here is bad input, said before any measuring.
    drop(crate::args::open_backend(cfg.backend, 1)?);
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
