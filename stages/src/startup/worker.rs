//! The start of one worker process of a pipelined run (`pipe worker`), in the library as a
//! whole run's start is: [`prepare_worker`] takes the run (handed over by a launcher, or the
//! worker's own flags), its cluster file and rank, and returns a [`PreparedWorker`], checked
//! against the cluster before it connects to anyone, with its model, its data, its partition
//! settled (by the chief) and what this rank takes beside the run. The command line joins the
//! cluster, runs it and prints; nothing here prints.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use pipe_scheduler::Layout;
use pipe_transport::TransportKind;
use pipe_transport::cluster::{ClusterFile, resolve_rank};
use pipe_transport::fault::Fault;
use pipe_transport::kinds::MeshSettings;
use pipe_transport::shm::rendezvous_dir;

use super::{RunSources, StartupWatcher, Unwatched};
use crate::checkpoint::{Checkpoint, CheckpointPolicy};
use crate::config::{LaunchSettings, RunConfig};
use crate::data::Splits;
use crate::error::{Result, StageError};
use crate::model::Model;
use crate::pipeline::processes::{JoinOptions, WorkerRun};
use crate::pipeline::trace_parts::part_path;
use crate::pipeline::worker::check_cluster_size;

/// Where a worker's run comes from, and who it is in its cluster.
pub struct WorkerSources<'a> {
    /// The run a launcher handed over (`pipe worker --run FILE`), taken as it is.
    pub handed: Option<&'a Path>,
    /// The worker's own settings, when no run was handed over.
    pub settings: &'a RunSources,
    /// The cluster file: every rank's address and credentials.
    pub cluster: &'a Path,
    /// The rank given (`--rank`); none: from the environment of the engine that started it.
    pub rank: Option<u32>,
    /// Read one environment variable (for the rank).
    pub env: &'a dyn Fn(&str) -> Option<String>,
    /// The fault to inject (`--fault`), when no run was handed over.
    pub fault: Fault,
}

/// What a worker takes beside the run: from the launcher's run file when it was launched,
/// from its own settings when started by hand.
pub struct OwnSettings {
    /// Where it serves its metrics.
    pub metrics: Option<SocketAddr>,
    /// The checkpoint it resumes from (the chief only: it sends the others their part).
    pub resume: Option<(PathBuf, Checkpoint)>,
    /// The fault it injects.
    pub fault: Fault,
    /// The checkpoints it writes (the chief's are used).
    pub checkpoints: Option<CheckpointPolicy>,
    /// Where it writes its part of a trace.
    pub trace_part: Option<PathBuf>,
    /// Its launcher replaces a replica lost in place (`--rejoin`).
    pub rejoin: bool,
}

/// One worker process, ready to join its cluster.
pub struct PreparedWorker {
    /// The run as this worker runs it ([`RunConfig::as_worker_process`]), its partition settled
    /// where this worker is the chief.
    pub cfg: RunConfig,
    /// Its layout, one worker per rank of the cluster.
    pub layout: Layout,
    /// The cluster.
    pub cluster: ClusterFile,
    /// This worker's rank.
    pub rank: u32,
    /// The model.
    pub model: Model,
    /// The data.
    pub data: Splits,
    /// What this rank takes beside the run.
    pub own: OwnSettings,
    /// Whether a launcher handed the run over.
    pub launched: bool,
    /// The checkpoint directory of a chief started by hand, held until the worker ends
    /// ([`crate::checkpoint::hold_dir`]), so that a second run given it meanwhile is refused
    /// (a launcher holds its workers' directory itself).
    pub held: Option<crate::checkpoint::HeldDir>,
}

/// Prepares worker `sources.rank` of its cluster: the run (handed over, or resolved from its
/// settings and refused where it is not one a worker process runs), checked against the
/// cluster's size before anything is read; the model and the memory gate's first look; the
/// data; the partition, settled by the chief; and what this rank takes beside the run.
///
/// # Errors
/// Bad input for run files, settings, cluster files and ranks that describe no worker here;
/// profiling failures.
pub fn prepare_worker(
    sources: &WorkerSources<'_>,
    watcher: &dyn StartupWatcher,
) -> Result<PreparedWorker> {
    let handed = match sources.handed {
        Some(path) => {
            let text = crate::limits::read_text_file(path, "run")?;
            Some(WorkerRun::from_json(&text, &path.display().to_string())?)
        }
        None => None,
    };
    let (cfg, launch) = match &handed {
        Some(h) => (h.run.clone(), LaunchSettings::default()),
        None => super::resolve(sources.settings, watcher)?,
    };
    check_worker_run(&cfg, &launch)?;
    let cfg = cfg.as_worker_process();
    cfg.check_resources(Some(1), &crate::limits::Machine::detect())?;
    let cluster = ClusterFile::load(sources.cluster).map_err(|e| refused(e.to_string()))?;
    // Refused before connecting, so that no peer waits for a worker that cannot run.
    let layout = check_cluster_size(&cfg, cluster.size())
        .map_err(|e| refused(format!("{}: {e}", sources.cluster.display())))?;
    let rank = resolve_rank(sources.rank, sources.env, cluster.size()).map_err(refused)?;
    let model = Model::new(&cfg.model)?;
    super::check_memory_floor(&cfg, &model, Some(1), launch.force, watcher)?;
    let data = crate::train::load_data(&cfg, &model)?;
    // The chief settles a measured partition and sends the cut to the others with the run's
    // terms (a launcher's workers find it settled in the run file already).
    let cfg = match (rank, handed.is_some()) {
        (0, true) => super::settle_partition(cfg, &model, launch.reprofile, &Unwatched)?,
        (0, false) => super::settle_partition(cfg, &model, launch.reprofile, watcher)?,
        _ => cfg,
    };
    let own = own_settings(handed.as_ref(), sources.fault, &launch, &cfg, rank, &model)?;
    // Held once the worker is prepared, so that one refused before leaves the directory as
    // it was.
    let held = match (rank, &handed, &launch.checkpoint_dir) {
        (0, None, Some(dir)) => Some(crate::checkpoint::hold_dir(dir)?),
        _ => None,
    };
    Ok(PreparedWorker {
        cfg,
        layout,
        cluster,
        rank,
        model,
        data,
        own,
        launched: handed.is_some(),
        held,
    })
}

/// Bad input, in the words given (a cluster file, a rank or a run the worker refuses).
fn refused(why: String) -> StageError {
    StageError::Input(why)
}

/// Refuses a run that is not one worker process runs: `pipe train`'s restart, rejoin and
/// fault flags (a scheduler restarts `pipe worker`), and a run that is not pipelined.
fn check_worker_run(cfg: &RunConfig, launch: &LaunchSettings) -> Result<()> {
    if launch.max_restarts > 0 || launch.rejoin || launch.faults.is_some() {
        return Err(refused(
            "--max-restarts, --rejoin and --fault-schedule are pipe train's, which starts and restarts its workers: a scheduler restarts pipe worker (deploy/)".into(),
        ));
    }
    if !cfg.pipelined {
        // `--stages 1` alone is one worker training the whole model, not a pipeline.
        return Err(refused(
            "pipe worker runs one worker of a pipeline, and this run is one worker training \
             the whole model (one stage, no replicas): give --stages 2 or more, --replicas 2 \
             or more, or a pipelined --schedule"
                .into(),
        ));
    }
    Ok(())
}

/// What worker `rank` takes beside the run: from the launcher's run file (`handed`), or from
/// its own settings.
fn own_settings(
    handed: Option<&WorkerRun>,
    fault: Fault,
    launch: &LaunchSettings,
    cfg: &RunConfig,
    rank: u32,
    model: &Model,
) -> Result<OwnSettings> {
    let chief = rank == 0;
    Ok(match handed {
        Some(h) => OwnSettings {
            metrics: h.metrics_of(rank)?,
            resume: match (&h.resume, chief) {
                (Some(dir), true) => Some(crate::checkpoint::read(dir, model)?),
                _ => None,
            },
            fault: h.fault_of(rank),
            checkpoints: h.checkpoints.clone(),
            trace_part: h.trace_part_of(rank),
            rejoin: h.rejoin,
        },
        None => OwnSettings {
            metrics: launch.metrics_addr,
            resume: if chief {
                let dir = launch.checkpoint_dir.as_deref();
                let resume = super::resume_from(launch.resume.as_deref(), dir, model)?;
                super::check_checkpoint_dir(dir, resume.as_ref().map(|(d, _)| d.as_path()))?;
                resume
            } else {
                None
            },
            fault,
            checkpoints: CheckpointPolicy::of_launch(launch, cfg)?,
            trace_part: launch.trace.as_ref().map(|t| part_path(t, rank)),
            // Without a launcher no one replaces a lost worker.
            rejoin: false,
        },
    })
}

impl PreparedWorker {
    /// How this worker joins its cluster: the run's wire and stall bound, `connect_timeout`,
    /// and where the workers of one host meet (a launcher's private directory, where the
    /// cluster file `cluster_path` is, or the run's rendezvous directory).
    pub fn join_options(&self, cluster_path: &Path, connect_timeout: Duration) -> JoinOptions {
        let settings = MeshSettings {
            wire: self.cfg.wire,
            timeout: Some(self.cfg.stall_timeout),
            connect_timeout,
            ..MeshSettings::new(self.cluster.run_id)
        };
        let meet = match (self.launched, cluster_path.parent()) {
            // The launcher's private directory, where the cluster file is.
            (true, Some(dir)) => dir.to_path_buf(),
            _ => rendezvous_dir(self.cluster.run_id),
        };
        JoinOptions {
            transport: self.cfg.transport,
            settings,
            meet,
        }
    }

    /// Where the plan's placement and the run's differ for this worker (`--transport auto`
    /// only): the peers the plan put on its host against those shared memory reaches
    /// (`local`). The plan's predictions assumed its placement; a run placed otherwise still
    /// trains, with other links.
    pub fn placed_otherwise(&self, local: &[u32]) -> Option<String> {
        if self.cfg.transport != TransportKind::Auto {
            return None;
        }
        placement_differs(&self.cfg.hosts, self.rank, local)
    }
}

/// Where the plan's placement (`hosts`, one per rank) and the run's differ for `rank`: the
/// peers the plan put on its host against those shared memory reaches (`local`).
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
