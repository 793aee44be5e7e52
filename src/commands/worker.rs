//! `pipe worker`: one worker of a pipelined run, in this process, reaching the others over
//! QUIC with the credentials of a cluster file (`pipe cluster init`). Every host runs it with
//! the same training flags; the rank comes from `--rank` or the environment of the engine
//! that started it (Slurm, torchrun, a Kubernetes indexed Job). Rank 0, the chief, prints the
//! run's progress and results. `pipe train --transport quic` starts one per worker on
//! loopback ([`pipe_stages::pipeline::processes`]), with the hidden `--launched` handshake.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use pipe_stages::checkpoint::{Checkpoint, CheckpointPolicy};
use pipe_stages::config::{LaunchSettings, RunConfig};
use pipe_stages::model::{Model, params_digest};
use pipe_stages::pipeline::train_worker;
use pipe_stages::pipeline::worker::{WorkerOptions, check_cluster_size};
use pipe_stages::pipeline::{Observer, Quiet};
use pipe_stages::train::{self};
use pipe_transport::TransportKind;
use pipe_transport::cluster::{ClusterFile, resolve_rank};
use pipe_transport::fault::{Fault, Faulty};
use pipe_transport::kinds::MeshSettings;
use pipe_transport::shm::rendezvous_dir;

use crate::output::bad_input;
use crate::startup_view::{print_header, print_resuming};
use crate::training::{
    Fan, TrainArgs, finish_checkpoints, print_done, run_config, serve_metrics,
    serve_metrics_quietly, stop_on_ctrl_c,
};
use pipe_stages::pipeline::processes::{
    JoinOptions, Record, RecordWriter, StopWriter, WorkerRun, join,
};
use pipe_stages::pipeline::trace_parts::{PartRecorder, Traced, part_path, worker_names};
use pipe_stages::startup::{self, Unwatched};

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

/// Warns where shared memory (`--transport auto`) finds other peers on this worker's host
/// than the plan placed there ([`placement_differs`]).
fn warn_if_placed_otherwise(cfg: &RunConfig, rank: u32, local: &[u32]) {
    if cfg.transport == TransportKind::Auto {
        if let Some(why) = placement_differs(&cfg.hosts, rank, local) {
            eprintln!("warning: {why}");
        }
    }
}

/// Where the plan's placement (`hosts`, one per rank) and the run's differ for `rank`: the
/// peers the plan put on its host against those shared memory reaches (`local`). The plan's
/// predictions assumed its placement; a run placed otherwise still trains, with other links.
fn placement_differs(hosts: &[String], rank: u32, local: &[u32]) -> Option<String> {
    let mine = hosts.get(rank as usize)?;
    let planned: Vec<u32> = (0..hosts.len() as u32)
        .filter(|&p| p != rank && hosts.get(p as usize) == Some(mine))
        .collect();
    let mut found = local.to_vec();
    found.sort_unstable();
    (planned != found).then(|| {
        format!(
            "the plan placed workers {planned:?} on worker {rank}'s host ({mine}), but it shares \
             its host with {found:?}: links are not where the plan put them, and its predicted \
             speed does not hold"
        )
    })
}

/// What this worker takes beside the run: from the launcher's `run.json` when it was
/// launched, from its own flags when started by hand.
struct OwnSettings {
    /// Where it serves its metrics.
    metrics: Option<SocketAddr>,
    /// The checkpoint it resumes from (the chief only: it sends the others their part).
    resume: Option<(PathBuf, Checkpoint)>,
    /// The fault it injects.
    fault: Fault,
    /// The checkpoints it writes (the chief's are used).
    checkpoints: Option<CheckpointPolicy>,
    /// Where it writes its part of a trace.
    trace_part: Option<PathBuf>,
}

impl OwnSettings {
    fn of(
        handed: Option<&WorkerRun>,
        args: &WorkerArgs,
        launch: &LaunchSettings,
        cfg: &RunConfig,
        rank: u32,
        model: &Model,
    ) -> Result<Self> {
        let chief = rank == 0;
        Ok(match handed {
            Some(h) => OwnSettings {
                metrics: h.metrics_of(rank)?,
                resume: match (&h.resume, chief) {
                    (Some(dir), true) => Some(pipe_stages::checkpoint::read(dir, model)?),
                    _ => None,
                },
                fault: h.fault_of(rank),
                checkpoints: h.checkpoints.clone(),
                trace_part: h.trace_part_of(rank),
            },
            None => OwnSettings {
                metrics: launch.metrics_addr,
                resume: if chief {
                    startup::resume_from(
                        launch.resume.as_deref(),
                        launch.checkpoint_dir.as_deref(),
                        model,
                    )?
                } else {
                    None
                },
                fault: args.fault.unwrap_or(Fault::None),
                checkpoints: CheckpointPolicy::of_launch(launch, cfg)?,
                trace_part: launch.trace.as_ref().map(|t| part_path(t, rank)),
            },
        })
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
    // A launched worker is handed everything in the run's file; one started by hand takes
    // its flags.
    let handed = match &args.run {
        Some(path) => {
            let text = pipe_stages::limits::read_text_file(path, "run")?;
            Some(WorkerRun::from_json(&text, &path.display().to_string())?)
        }
        None => None,
    };
    let (cfg, launch) = match &handed {
        Some(h) => (h.run.clone(), LaunchSettings::default()),
        None => run_config(&args.train, &phases)?,
    };
    if launch.max_restarts > 0 || launch.rejoin || launch.faults.is_some() {
        return Err(bad_input(
            "--max-restarts, --rejoin and --fault-schedule are pipe train's, which starts and restarts its workers: a scheduler restarts pipe worker (deploy/)".into(),
        ));
    }
    if !cfg.pipelined {
        return Err(bad_input(
            "pipe worker runs a pipelined schedule: give --stages, --replicas or --schedule".into(),
        ));
    }
    let cfg = cfg.as_worker_process();
    cfg.check_resources(Some(1), &pipe_stages::limits::Machine::detect())?;
    let cluster = ClusterFile::load(&args.cluster).map_err(|e| bad_input(e.to_string()))?;
    // Refused before connecting, so that no peer waits for a worker that cannot run.
    let layout = check_cluster_size(&cfg, cluster.size())
        .map_err(|e| bad_input(format!("{}: {e}", args.cluster.display())))?;
    let rank =
        resolve_rank(args.rank, |v| std::env::var(v).ok(), cluster.size()).map_err(bad_input)?;
    let opts = join_options(args, &cfg, &cluster);
    let model = Model::new(&cfg.model)?;
    startup::check_memory_floor(&cfg, &model, Some(1), launch.force, &phases)?;
    let data = train::load_data(&cfg, &model)?;
    let chief = rank == 0;
    // The chief settles a measured partition and sends the cut to the others with the run's
    // terms (a launcher's workers find it settled in run.json already).
    let cfg = match (chief, args.launched) {
        (true, true) => startup::settle_partition(cfg, &model, launch.reprofile, &Unwatched)?,
        (true, false) => startup::settle_partition(cfg, &model, launch.reprofile, &phases)?,
        (false, _) => cfg,
    };
    let own = OwnSettings::of(handed.as_ref(), args, &launch, &cfg, rank, &model)?;
    if !args.launched {
        serve_metrics(own.metrics)?;
    } else if let Some(addr) = own.metrics {
        // The launcher gave this worker its own port; its banner would break the records.
        serve_metrics_quietly(addr)?;
    }
    let stop = stop_on_ctrl_c(chief && !args.launched);
    let joined = join(
        &cluster,
        rank,
        args.listen,
        opts,
        args.launched.then(|| stop.clone()),
    )?;
    if chief && !args.launched {
        print_links(&joined.shared_memory, cluster.size());
    }
    warn_if_placed_otherwise(&cfg, rank, &joined.shared_memory);
    let mut ep = Faulty::new(joined.endpoint, own.fault);
    let mut obs: Box<dyn Observer> = match (chief, args.launched) {
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
    };
    let mut recorder = own.trace_part.as_ref().map(|_| PartRecorder::default());
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
    // The error names this worker, its stage and the action that failed.
    let report = result?;
    closed.with_context(|| format!("worker {rank}: closing"))?;
    match (report, args.launched) {
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
    if !(args.connect_timeout.is_finite() && (0.0..=86_400.0).contains(&args.connect_timeout)) {
        return Err(bad_input(format!(
            "--connect-timeout {}: give 0 to 86400 seconds",
            args.connect_timeout
        )));
    }
    Ok(())
}

/// How this worker joins its cluster: the run's wire and stall bound, the connect timeout,
/// and where the workers of one host meet (a launcher's private directory, where the cluster
/// file is, or the run's rendezvous directory).
fn join_options(args: &WorkerArgs, cfg: &RunConfig, cluster: &ClusterFile) -> JoinOptions {
    let connect_timeout = Duration::from_secs_f64(args.connect_timeout);
    let settings = MeshSettings {
        wire: cfg.wire,
        timeout: Some(cfg.stall_timeout),
        connect_timeout,
        ..MeshSettings::new(cluster.run_id)
    };
    let meet = match (args.launched, args.cluster.parent()) {
        // The launcher's private directory, where the cluster file is.
        (true, Some(dir)) => dir.to_path_buf(),
        _ => rendezvous_dir(cluster.run_id),
    };
    JoinOptions {
        transport: cfg.transport,
        settings,
        meet,
    }
}

/// Whether standard error is a terminal (bars are drawn there).
fn stderr_is_terminal() -> bool {
    use std::io::IsTerminal as _;
    std::io::stderr().is_terminal()
}

#[cfg(test)]
mod tests {
    use super::placement_differs;

    #[test]
    fn a_placement_other_than_the_plans_is_named() {
        let hosts: Vec<String> = ["a", "a", "b", "b"].map(String::from).to_vec();
        // As planned: worker 1 shares its host with worker 0 only.
        assert_eq!(placement_differs(&hosts, 1, &[0]), None);
        // All four on one host.
        let why = placement_differs(&hosts, 1, &[2, 3, 0]).unwrap();
        assert!(
            why.contains("placed workers [0]") && why.contains("[0, 2, 3]"),
            "{why}"
        );
        // No plan, nothing to compare.
        assert_eq!(placement_differs(&[], 0, &[1]), None);
    }
}
