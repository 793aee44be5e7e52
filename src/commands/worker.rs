//! `pipe worker`: one worker of a pipelined run, in this process, reaching the others over
//! QUIC with the credentials of a cluster file (`pipe cluster init`). Every host runs it with
//! the same training flags; the rank comes from `--rank` or the environment of the engine
//! that started it (Slurm, torchrun, a Kubernetes indexed Job). Rank 0, the chief, prints the
//! run's progress and results. `pipe train --transport quic` starts one per worker on
//! loopback ([`pipe_stages::pipeline::processes`]), with the hidden `--launched` handshake.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use pipe_stages::model::params_digest;
use pipe_stages::pipeline::processes::{Record, RecordWriter, StopWriter, join, join_launched};
use pipe_stages::pipeline::recover::{Remesh, RemeshHandle};
use pipe_stages::pipeline::trace_parts::{PartRecorder, Traced, worker_names};
use pipe_stages::pipeline::worker::WorkerOptions;
use pipe_stages::pipeline::{Observer, Quiet, train_worker};
use pipe_stages::startup::{PreparedWorker, WorkerSources, prepare_worker};
use pipe_transport::fault::{Fault, Faulty};

use crate::output::bad_input;
use crate::startup_view::{print_header, print_resuming};
use crate::training::{
    Fan, TrainArgs, finish_checkpoints, leave_signals_to_launcher, print_done, serve_metrics,
    serve_metrics_quietly, stop_on_signal,
};

/// `pipe worker`.
#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// The cluster file (`pipe cluster init`): every rank's address and credentials.
    #[arg(long, value_name = "FILE")]
    cluster: PathBuf,
    /// This worker's rank (default: PIPE_RANK, RANK, SLURM_PROCID or JOB_COMPLETION_INDEX).
    #[arg(long)]
    rank: Option<u32>,
    /// Address to bind (default: this rank's address in the cluster file), e.g. 0.0.0.0:29400
    /// where the listed name is not an address of this host.
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// Seconds to wait for the other workers to start and connect.
    #[arg(long, default_value_t = 60.0, value_name = "SECONDS")]
    connect_timeout: f64,
    /// Started by `pipe train --transport quic`: report the bound address, read the others'
    /// from standard input, report progress as records, exit when standard input closes.
    #[arg(long, hide = true)]
    launched: bool,
    /// The resolved run, as `pipe train --transport quic` writes it for its workers (JSON):
    /// taken instead of resolving the training flags again.
    #[arg(long, hide = true, value_name = "FILE", requires = "launched")]
    run: Option<PathBuf>,
    /// A fault to inject into this worker (one entry of `pipe train --fault-schedule`, which
    /// the launcher hands each worker it names).
    #[arg(long, hide = true, value_name = "FAULT")]
    fault: Option<Fault>,
    /// Started by `pipe train --rejoin` in place of a lost replica: join the run under way,
    /// taking its state from a surviving replica of its stage.
    #[arg(long, hide = true, requires = "launched")]
    replacing: bool,
    #[command(flatten)]
    train: TrainArgs,
}

/// Prints which links the run's transport choice gave this worker: shared memory to
/// `local` (the peers on its host), QUIC to the rest of `size` workers.
fn print_links(local: &[u32], size: u32) {
    if local.is_empty() {
        outln!("links: QUIC to every worker");
    } else if local.len() + 1 == size as usize {
        outln!("links: shared memory to every worker (all on this host)");
    } else {
        outln!("links: shared memory to workers {local:?} (this host), QUIC to the others");
    }
}

/// Runs `pipe worker`.
///
/// # Errors
/// Bad input for flags, cluster files and ranks; run-time failures of the run (a lost peer is
/// named).
pub fn run(args: &WorkerArgs) -> Result<()> {
    check_flags(args)?;
    // A launched worker's lines go to its launcher's log: no bars there.
    let phases = crate::phases::Phases::with_terminal(args.run.is_none() && stderr_is_terminal());
    let sources = WorkerSources {
        handed: args.run.as_deref(),
        settings: &args.train.sources()?,
        cluster: &args.cluster,
        rank: args.rank,
        env: &|v| std::env::var_os(v).map(|s| s.to_string_lossy().into_owned()),
        fault: args.fault.unwrap_or(Fault::None),
    };
    let worker = prepare_worker(&sources, &phases)?;
    let (chief, launched) = (worker.rank == 0, worker.launched);
    if !launched {
        serve_metrics(worker.own.metrics)?;
    } else if let Some(addr) = worker.own.metrics {
        // The launcher gave this worker its own port; its banner would break the records.
        serve_metrics_quietly(addr)?;
    }
    // A launched worker's stop comes from its launcher (`join_launched` reads it).
    let stop = if launched {
        leave_signals_to_launcher();
        Arc::new(std::sync::atomic::AtomicBool::new(false))
    } else {
        stop_on_signal(chief, worker.own.checkpoints.is_some())
    };
    let connect_timeout = Duration::from_secs_f64(args.connect_timeout);
    let join_options = worker.join_options(&args.cluster, connect_timeout);
    // A launched worker goes on in place when a peer is lost, as its launcher says.
    let (joined, remesh) = if launched {
        let (joined, remesh) =
            join_launched(&worker.cluster, worker.rank, join_options, stop.clone())?;
        let remesh: Box<dyn Remesh> = Box::new(remesh);
        (joined, Some(RemeshHandle(Arc::new(Mutex::new(remesh)))))
    } else {
        let joined = join(
            &worker.cluster,
            worker.rank,
            args.listen,
            join_options,
            None,
        )?;
        (joined, None)
    };
    if chief && !launched {
        print_links(&joined.shared_memory, worker.cluster.size());
    }
    if let Some(why) = worker.placed_otherwise(&joined.shared_memory) {
        eprintln!("warning: {why}");
    }
    let PreparedWorker {
        cfg,
        layout,
        rank,
        model,
        data,
        own,
        // Kept to the end of the run: the checkpoint directory stays this worker's.
        held: _held,
        ..
    } = worker;
    // A replacement injects none of the fault its rank's first worker was handed.
    let fault = if args.replacing {
        Fault::None
    } else {
        own.fault
    };
    let mut ep = Faulty::new(joined.endpoint, fault);
    let mut obs: Box<dyn Observer> = match (chief, launched) {
        (true, true) => Box::new(RecordWriter),
        (true, false) => {
            print_header(&cfg, &model, &data, cfg.threads.max(1));
            if let Some((dir, ckpt)) = &own.resume {
                print_resuming(dir, ckpt);
            }
            Box::new(Fan::new(&cfg, phases.clone())?)
        }
        (false, true) => Box::new(StopWriter),
        (false, false) => Box::new(Quiet),
    };
    let opts = WorkerOptions {
        checkpoints: own.checkpoints.filter(|_| chief),
        resume: own.resume.map(|(_, ckpt)| ckpt),
        stop: chief.then_some(stop),
        remesh,
        rejoin: own.rejoin,
        replacing: args.replacing,
    };
    // Each worker keeps its share of the run's trace limit.
    let workers = cfg.resolved().map_or(1, |r| r.layout.workers());
    let mut recorder = own.trace_part.as_ref().map(|_| PartRecorder::new(workers));
    let result = match recorder.as_mut() {
        Some(part) => {
            let mut traced = Traced {
                run: obs.as_mut(),
                part,
            };
            train_worker(&cfg, &data, &mut ep, &mut traced, &opts)
        }
        None => train_worker(&cfg, &data, &mut ep, obs.as_mut(), &opts),
    };
    let closed = pipe_transport::Transport::close(&mut ep);
    if let (Some(rec), Some(path)) = (&recorder, &own.trace_part) {
        // Written whether the run succeeded or not: a failed run's trace shows where it stood.
        rec.write(path, rank, worker_names(&layout))?;
    }
    if launched {
        tell_divergence(result.as_ref().err())?;
    }
    // The error names this worker, its stage and the action that failed.
    let report = result?;
    closed.with_context(|| format!("worker {rank}: closing"))?;
    match (report, launched) {
        (Some(end), true) => RecordWriter::write(&Record::Done {
            steps: end.report.steps,
            weights: params_digest(&end.report.params),
            checkpoints: end.checkpoints,
            stopped: end.stopped,
        })?,
        (Some(end), false) => {
            finish_checkpoints(&end.checkpoints, end.stopped)?;
            print_done(&end.report);
        }
        (None, _) => {}
    }
    Ok(())
}

/// A launched worker whose part of the run diverged tells its launcher so (a
/// [`Record::Diverged`]), which then reports it as the run's failure instead of a lost
/// replica to go on without.
///
/// # Errors
/// Standard output gone.
fn tell_divergence(failed: Option<&pipe_stages::StageError>) -> Result<()> {
    if let Some((e, update)) = failed.and_then(|e| Some((e, e.diverged_at()?))) {
        let message = e.to_string();
        RecordWriter::write(&Record::Diverged { update, message })?;
    }
    Ok(())
}

/// Refuses what `pipe worker` does not take: `pipe train`'s planning flag, and a connect
/// timeout out of range (its restart flags are refused once the settings merge).
///
/// # Errors
/// Bad input naming the flag.
fn check_flags(args: &WorkerArgs) -> Result<()> {
    if args.train.workers.is_some() {
        return Err(bad_input(
            "--workers plans on one machine: run `pipe plan -o plan.toml` once and give every worker --plan plan.toml".into(),
        ));
    }
    // 0 would give up before the first attempt to connect.
    if !(args.connect_timeout > 0.0 && args.connect_timeout <= 86_400.0) {
        return Err(bad_input(format!(
            "--connect-timeout {}: give above 0 and at most 86400 seconds",
            args.connect_timeout
        )));
    }
    Ok(())
}

/// Whether standard error is a terminal (bars are drawn there).
fn stderr_is_terminal() -> bool {
    use std::io::IsTerminal as _;
    std::io::stderr().is_terminal()
}
