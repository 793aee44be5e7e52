//! A run's start-up, in the library: everything between the settings a user gave and the
//! first update. [`prepare`] takes where the settings come from and a [`StartupWatcher`] and
//! returns a [`PreparedRun`], in this order, each step producing the value the next takes:
//!
//! 1. merge: config file, then flags, then a plan file ([`TrainSettings`]);
//! 2. resolve, or plan for `--workers` ([`RunConfig`], checked once);
//! 3. the model ([`Model`]), the memory gate's first look (the closed-form estimate, before
//!    anything is read or allocated), and, for the chief, the data ([`Splits`]);
//! 4. the checkpoint a run resumes from, and the bucket sizes it recorded;
//! 5. the partition: given, by FLOPs, or measured (a cached profile where one fits);
//! 6. link costs ([`crate::planning::link_costs`]) and each replicated stage's all-reduce
//!    buckets;
//! 7. the measured memory estimate and the gate's refusal ([`crate::limits::admit_memory`],
//!    the one rule; `--force` runs anyway);
//! 8. the checks of `--rejoin`.
//!
//! The watcher is told what each step found as typed [`StartupEvent`]s: the command line
//! formats them; nothing here prints.

mod launch;
mod steps;
mod worker;

use std::path::PathBuf;

use pipe_scheduler::Resolved;
use pipe_scheduler::planner::buckets::{BucketChoice, StageBuckets};
use pipe_scheduler::planner::transport::TransportCost;

use crate::checkpoint::Checkpoint;
use crate::config::{LaunchSettings, RunConfig, TrainSettings};
use crate::data::Splits;
use crate::error::Result;
use crate::model::Model;
use crate::partition::Partition;
use crate::planning::ProfileReport;
use crate::planning::memory::WorkerMemory;

pub use launch::{LaunchControls, RunEnd, launch};
pub use steps::{
    adopt_checkpoint_buckets, check_checkpoint_dir, check_device_memory, check_memory,
    check_memory_floor, check_rejoin, read_data, replan, resolve, resume_from, settle_partition,
};
pub use worker::{OwnSettings, PreparedWorker, WorkerSources, prepare_worker};

/// Where a run's settings come from, as the command line names them: each later source
/// overrides the earlier ones field by field.
#[derive(Clone, Debug, Default)]
pub struct RunSources {
    /// A TOML config file.
    pub config_file: Option<PathBuf>,
    /// The command line's settings.
    pub flags: TrainSettings,
    /// A plan `pipe plan -o` wrote: its layout and model.
    pub plan_file: Option<PathBuf>,
    /// Plan the layout for this many workers (`--workers`) instead.
    pub workers: Option<u32>,
}

/// What start-up found, step by step, for a command to show. Every value a line needs is
/// here; the wording is the command's.
#[derive(Debug)]
pub enum StartupEvent<'a> {
    /// A phase of the start began (`detail` says over what); it ends when the next begins
    /// or at [`StartupEvent::PhaseEnded`].
    PhaseBegan {
        /// What the phase does.
        name: &'a str,
        /// Over what.
        detail: String,
    },
    /// The running phase ended.
    PhaseEnded,
    /// The run's data was read and checked: what a run's header names.
    DataRead {
        /// The run.
        run: &'a RunConfig,
        /// Its model.
        model: &'a Model,
        /// Its data.
        data: &'a Splits,
    },
    /// The run resumes from this checkpoint.
    Resuming {
        /// Its directory.
        dir: &'a std::path::Path,
        /// The checkpoint.
        checkpoint: &'a Checkpoint,
    },
    /// The links of a plan are charged these measured costs, from `source`.
    LinksCharged {
        /// The transport's costs.
        cost: &'a TransportCost,
        /// Where they came from.
        source: &'a str,
    },
    /// `--workers` planned this run.
    AutoPlan {
        /// The workers planned for.
        workers: u32,
        /// The run as planned.
        run: &'a RunConfig,
        /// The planner's predicted samples per second.
        samples_per_s: f64,
        /// The simulator's, where it ran (else NaN).
        simulated_samples_per_s: f64,
    },
    /// The partition was cut by measured time.
    MeasuredCut {
        /// The cut.
        partition: &'a Partition,
        /// Seconds per microbatch of each stage.
        stage_seconds: &'a [f64],
    },
    /// Each replicated stage's all-reduce bucket size was chosen on the run's measured link.
    BucketsChosen {
        /// The link's transport costs.
        link: &'a TransportCost,
        /// Where they came from.
        source: &'a str,
        /// Each stage's choice (`None`: one replica, the default size).
        choices: &'a [Option<BucketChoice>],
        /// The sizes, as the flag value that repeats them (`--allreduce-bucket-mb`).
        flag: StageBuckets,
    },
    /// The bucket sizes the run a checkpoint continues chose were taken.
    BucketsAdopted {
        /// The sizes, as the flag value that repeats them (`--allreduce-bucket-mb`).
        flag: StageBuckets,
    },
    /// The memory estimate of the run's workers on this host.
    MemoryEstimate {
        /// Each worker's estimate.
        workers: &'a [WorkerMemory],
        /// This process's resident bytes before it built the run.
        process: u64,
        /// The workers are processes (else threads of this process).
        processes: bool,
        /// What the host must have for all of them.
        need: u64,
    },
    /// The run is over the memory available and runs anyway (`--force`): why.
    MemoryForced(String),
    /// What each worker's device is expected to hold at its peak (a device backend's run:
    /// [`crate::planning::device_memory`]).
    DeviceMemoryEstimate {
        /// Each worker's estimate.
        workers: &'a [WorkerMemory],
    },
}

/// Watches a run's start: takes its [`StartupEvent`]s and may give the profiler a report of
/// its own progress.
pub trait StartupWatcher {
    /// One event of the start.
    fn on_event(&self, event: &StartupEvent<'_>);
    /// The profiler's progress report, where the watcher shows it.
    fn profile_report(&self) -> Option<ProfileReport> {
        None
    }
}

/// A watcher that shows nothing (a launched worker, whose launcher shows the start).
#[derive(Clone, Copy, Debug, Default)]
pub struct Unwatched;

impl StartupWatcher for Unwatched {
    fn on_event(&self, _: &StartupEvent<'_>) {}
}

/// A run ready to launch: its settings checked and settled, its model and data built.
pub struct PreparedRun {
    /// The run, its partition and bucket sizes settled.
    pub cfg: RunConfig,
    /// Its pipeline's layout, resolved once (`None` for one worker over the whole model).
    pub resolved: Option<Resolved>,
    /// The model.
    pub model: Model,
    /// The data.
    pub data: Splits,
    /// The checkpoint it resumes from, with its directory.
    pub resume: Option<(PathBuf, Checkpoint)>,
    /// Its checkpoint directory, held until the run ends ([`crate::checkpoint::hold_dir`]):
    /// a second run given the directory meanwhile is refused.
    pub held: Option<crate::checkpoint::HeldDir>,
}

/// Prepares the run `cfg` (resolved by [`resolve`], with the launch `options` around it) to
/// launch from this process, which runs
/// every worker (as threads, or as the launcher of worker processes): rejoin checks, the
/// model, the data, the checkpoint it resumes from and the bucket sizes it recorded, the
/// partition with its buckets, and the memory gate. `process` is this process's resident
/// bytes before it built anything.
///
/// # Errors
/// Bad input ([`crate::StageError::Config`] and kin) for anything that describes no run here;
/// profiling and measurement failures.
pub fn prepare(
    cfg: RunConfig,
    options: &LaunchSettings,
    process: u64,
    watcher: &dyn StartupWatcher,
) -> Result<PreparedRun> {
    let processes = cfg.pipelined && cfg.placement == crate::config::Placement::Processes;
    let resolved = cfg.pipelined.then(|| cfg.resolved()).transpose()?.cloned();
    if options.rejoin {
        check_rejoin(resolved.as_ref())?;
    }
    let model = Model::new(&cfg.model)?;
    check_memory_floor(&cfg, &model, None, options.force, watcher)?;
    let data = read_data(&cfg, &model, watcher)?;
    watcher.on_event(&StartupEvent::DataRead {
        run: &cfg,
        model: &model,
        data: &data,
    });
    let resume = resume_from(
        options.resume.as_deref(),
        options.checkpoint_dir.as_deref(),
        &model,
    )?;
    if let Some((dir, ckpt)) = &resume {
        watcher.on_event(&StartupEvent::Resuming {
            dir,
            checkpoint: ckpt,
        });
    }
    let resumed = resume.as_ref().map(|(dir, _)| dir.as_path());
    check_checkpoint_dir(options.checkpoint_dir.as_deref(), resumed)?;
    // Held once the run is prepared, so that a run refused before leaves the directory as
    // it was.
    let hold = || {
        options
            .checkpoint_dir
            .as_deref()
            .map(crate::checkpoint::hold_dir)
            .transpose()
    };
    if options.seed_checkpoint {
        return Ok(PreparedRun {
            cfg,
            resolved,
            model,
            data,
            resume,
            held: hold()?,
        });
    }
    let cfg = match &resume {
        Some((_, ckpt)) => adopt_checkpoint_buckets(cfg, ckpt, watcher),
        None => cfg,
    };
    let cfg = settle_partition(cfg, &model, options.reprofile, watcher)?;
    check_memory(&cfg, process, processes, options.force, watcher)?;
    check_device_memory(&cfg, options.force, watcher)?;
    Ok(PreparedRun {
        cfg,
        resolved,
        model,
        data,
        resume,
        held: hold()?,
    })
}
