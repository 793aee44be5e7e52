//! The one driver that starts a run's workers and starts them again, whatever their placement:
//! restarts under `--max-restarts` ([`super::restart::with_restarts`]), planning again for the
//! workers that remain (`--replan-on-restart`), and, where a lost replica is survived by
//! starting the workers again (worker processes), the run going on with one replica fewer and,
//! with `--rejoin`, back on its own layout at the next drain point. Threads survive a lost
//! replica inside the run ([`super::survive`]), so for them the driver only restarts.
//!
//! A placement is a [`Launcher`]: it starts the workers on a layout from a checkpoint and says
//! how they ended. The binary chooses the launcher, prints what the driver reports, and
//! nothing else.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::restart::{Restart, RestartPolicy, with_restarts};
use super::survive::LayoutChange;
use crate::checkpoint;
use crate::config::RunConfig;
use crate::error::{Result, StageError};
use crate::pipeline::Observer;
use pipe_transport::fault::{FaultSchedule, ScheduledFault};

/// Where a run's workers run: what starts them.
pub trait Launcher {
    /// How a start ended.
    type End;

    /// Starts the workers of `cfg` from checkpoint `from` (none: from the start, or from the
    /// checkpoint the first start was given), and runs them to the end. With
    /// `stop_at_first_drain`, the chief stops at its first drain point after a checkpoint.
    /// `start` counts the starts, from 0.
    ///
    /// # Errors
    /// The run's failure.
    fn start(
        &mut self,
        cfg: &RunConfig,
        from: Option<&Path>,
        start: u32,
        stop_at_first_drain: bool,
        obs: &mut dyn Observer,
    ) -> Result<Self::End>;

    /// Where a start that stopped early stopped (updates done), if it did.
    fn stopped(end: &Self::End) -> Option<u64>;

    /// Whether a lost replica is survived by starting the workers again on one replica
    /// fewer (worker processes) rather than inside the run (threads).
    fn survives_by_starting_again(&self) -> bool;

    /// Where this launcher keeps the state of the run's last drain point when the run names
    /// no checkpoint directory, so that a start after a lost replica or a failure goes on
    /// from there. Threads keep it in memory inside the run, so have none.
    fn kept_states(&self) -> Option<&Path> {
        None
    }

    /// The faults this launcher injects, by worker and attempt.
    fn fault_schedule(&self) -> &FaultSchedule;

    /// How many attempts a fault schedule's ATTEMPT has counted once the driver made `starts`
    /// starts: the starts themselves for worker processes; threads count every segment run
    /// (one more after each lost replica inside a start).
    fn fault_attempts(&self, starts: u32) -> u32 {
        starts
    }
}

/// What the driver is asked to do beyond starting the workers once.
#[derive(Clone, Debug, Default)]
pub struct Relaunch {
    /// Restarts after failures, and where checkpoints are.
    pub restarts: RestartPolicy,
    /// The checkpoint the first start resumes from.
    pub first: Option<PathBuf>,
    /// Take a lost replica back (`--rejoin`): worker processes at the next drain point.
    pub rejoin: bool,
    /// Plan again for the workers that remain after a start that lost one.
    pub replan_on_restart: bool,
    /// Set by Ctrl-C: the run is stopping, not shrinking.
    pub stop: Option<Arc<AtomicBool>>,
}

/// Plans a run again for fewer workers: the new run and its predicted samples/s (the binary
/// passes `planning::replan`, which sits above this module).
pub type Replan = dyn Fn(&RunConfig, u32) -> Result<(RunConfig, f64)>;

/// A new layout planned for the workers that remain, or why none was.
#[derive(Debug)]
pub enum Replanned {
    /// The run goes on with `cfg`, which the planner predicted to train `samples_per_s`.
    Planned {
        /// The new run.
        cfg: Box<RunConfig>,
        /// Workers it has.
        workers: u32,
        /// Predicted samples per second.
        samples_per_s: f64,
    },
    /// The run goes on with its layout as it was.
    Kept {
        /// Workers it would have had.
        workers: u32,
        /// Why no new layout.
        why: String,
    },
}

/// What the driver and its launcher tell their caller as the run goes.
pub trait RelaunchEvents {
    /// A restart about to happen, and what planning again gave (when asked for).
    fn on_restart(&mut self, restart: &Restart<'_>, replanned: Option<&Replanned>);
    /// The run's trace, written (or why not) once its workers ended.
    fn on_trace(&mut self, _written: &super::trace_parts::TraceWritten) {}
    /// Fault schedule entries for an attempt the run never made (it made `attempts`, from 0),
    /// told once the run has ended, so that a drill that tested nothing does not pass for one
    /// that did.
    fn on_faults_never_applied(&mut self, _entries: &[ScheduledFault], _attempts: u32) {}
}

/// Plans `cfg` again for the workers a start that failed with `cause` leaves (one fewer), with
/// `replan` (`planning::replan`). `None` when the cause lost no worker or one worker is left.
fn replan_after(cfg: &RunConfig, cause: &StageError, replan: &Replan) -> Option<Replanned> {
    if !matches!(cause, StageError::Exited { .. } | StageError::Worker { .. }) {
        return None;
    }
    let workers = cfg.resolved().ok()?.layout.workers();
    if workers < 2 {
        return None;
    }
    Some(match replan(cfg, workers - 1) {
        Ok((next, samples_per_s)) => Replanned::Planned {
            cfg: Box::new(next),
            workers: workers - 1,
            samples_per_s,
        },
        Err(e) => Replanned::Kept {
            workers: workers - 1,
            why: e.to_string(),
        },
    })
}

/// Runs `cfg` on `launcher` until it ends, as `how` asks: restarting it, planning it again
/// (`replan`: the layout for fewer workers and its predicted samples/s), and going on after a
/// lost replica. Returns how the last start ended and the layout the run ended on.
///
/// # Errors
/// As [`with_restarts`]: the first failure caused by bad input, or every cause once no
/// restart is left.
pub fn drive<L: Launcher>(
    launcher: &mut L,
    cfg: &RunConfig,
    how: &Relaunch,
    obs: &mut dyn Observer,
    events: &mut dyn RelaunchEvents,
    replan: &Replan,
) -> (Result<L::End>, RunConfig) {
    // The run's own layout (planned again after a lost worker, with --replan-on-restart), and
    // the one it is on (short of lost replicas until they rejoin).
    // Restarts and survival go on from the newest drained state: the run's checkpoints, or
    // where the launcher keeps them when the run has none.
    let mut how = how.clone();
    if how.restarts.checkpoint_dir.is_none() {
        how.restarts.checkpoint_dir = launcher.kept_states().map(Path::to_path_buf);
    }
    let how = &how;
    // What a restart loses is counted from the last update reported.
    let last_step = std::sync::atomic::AtomicU64::new(NO_STEP);
    let obs = &mut LastStep {
        inner: obs,
        last: &last_step,
    };
    let own = std::cell::RefCell::new(cfg.clone());
    let current = std::cell::RefCell::new(cfg.clone());
    let pending: std::cell::RefCell<Option<LayoutChange>> = std::cell::RefCell::new(None);
    let survives = launcher.survives_by_starting_again();
    let asked_to_stop = || how.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst));
    let mut starts = 0;
    let events = std::cell::RefCell::new(events);
    let end = with_restarts(
        &how.restarts,
        how.first.as_deref(),
        |_, from| {
            let mut from = from.map(Path::to_path_buf);
            loop {
                if let Some(change) = pending.borrow_mut().take() {
                    obs.on_layout_change(&change)?;
                }
                let run = current.borrow().clone();
                // A run short of a lost replica stops at its next drain point to take it back.
                let short = run.resolved()?.layout.replica_counts()
                    != own.borrow().resolved()?.layout.replica_counts();
                let stop_at_first_drain = survives && how.rejoin && short;
                // Counted whether the start succeeds or not: it picks the start's faults.
                let this = starts;
                starts += 1;
                let end = launcher.start(&run, from.as_deref(), this, stop_at_first_drain, obs)?;
                match L::stopped(&end) {
                    Some(at) if stop_at_first_drain && !asked_to_stop() => {
                        *current.borrow_mut() = own.borrow().clone();
                        *pending.borrow_mut() = Some(LayoutChange::restored(&own.borrow(), at)?);
                        from = how
                            .restarts
                            .checkpoint_dir
                            .as_deref()
                            .and_then(|d| checkpoint::list(d).pop())
                            .map(|(_, dir)| dir);
                    }
                    _ => return Ok(end),
                }
            }
        },
        || Some(last_step.load(Ordering::Relaxed)).filter(|&s| s != NO_STEP),
        |r| {
            let replanned = how
                .replan_on_restart
                .then(|| replan_after(&current.borrow(), r.cause, replan))
                .flatten();
            if let Some(Replanned::Planned { cfg, .. }) = &replanned {
                *current.borrow_mut() = (**cfg).clone();
                *own.borrow_mut() = (**cfg).clone();
            }
            events.borrow_mut().on_restart(r, replanned.as_ref());
        },
        |err, from| {
            if !survives || how.restarts.checkpoint_dir.is_none() {
                return false;
            }
            let Some(change) = LayoutChange::after_exit(&current.borrow(), err, from) else {
                return false;
            };
            // A layout that does not check is not one to go on in: the loss stands.
            let Ok(next) = change.apply(&current.borrow()) else {
                return false;
            };
            *current.borrow_mut() = next;
            *pending.borrow_mut() = Some(change);
            true
        },
    );
    let attempts = launcher.fault_attempts(starts);
    let never: Vec<ScheduledFault> = (launcher.fault_schedule().0.iter())
        .filter(|entry| entry.attempt >= attempts)
        .copied()
        .collect();
    if !never.is_empty() {
        events
            .into_inner()
            .on_faults_never_applied(&never, attempts);
    }
    (end.map_err(|e| with_way_out(e, how)), current.into_inner())
}

/// A run that lost a worker it could not go on without, with the flags that would have
/// saved it: restarts, and checkpoints that outlive the launcher.
fn with_way_out(err: StageError, how: &Relaunch) -> StageError {
    if !matches!(err, StageError::Exited { .. }) || how.restarts.max_restarts > 0 {
        return err;
    }
    StageError::Launch {
        why: format!(
            "{err} (no replica of its stage was left to go on without it: --max-restarts N \
             starts the run again from its last drain point, and --checkpoint-dir DIR keeps \
             those states on disk, so that a run can also be resumed by hand)"
        ),
        bad_input: false,
    }
}

/// Every worker a thread of this process ([`super::train_pipelined`]).
pub struct Threads<'a> {
    /// The run's data.
    pub data: &'a crate::data::Splits,
    /// The model, to read checkpoints with.
    pub model: &'a crate::model::Model,
    /// The pipelined trainer's options (checkpoints, stop, faults, rejoin, timeline).
    pub opts: super::PipelineTrainOptions,
    /// The checkpoint the first start resumes from, already read.
    pub first: Option<checkpoint::Checkpoint>,
}

impl Launcher for Threads<'_> {
    type End = super::PipelineReport;

    fn start(
        &mut self,
        cfg: &RunConfig,
        from: Option<&Path>,
        start: u32,
        _stop_at_first_drain: bool,
        obs: &mut dyn Observer,
    ) -> Result<Self::End> {
        self.opts.resume = match (start, from) {
            (0, _) => self.first.take(),
            (_, Some(dir)) => Some(checkpoint::read(dir, self.model)?.1),
            (_, None) => None,
        };
        super::train_pipelined(cfg, self.data, obs, &self.opts)
    }

    fn stopped(_: &Self::End) -> Option<u64> {
        // A replica rejoins inside the run: no start stops early for it.
        None
    }

    fn survives_by_starting_again(&self) -> bool {
        false
    }

    fn fault_schedule(&self) -> &FaultSchedule {
        &self.opts.faults
    }

    fn fault_attempts(&self, _starts: u32) -> u32 {
        self.opts.segments_run.load(Ordering::SeqCst)
    }
}

/// One worker process each on this host ([`super::processes::run_processes`]). Without a
/// checkpoint policy, the chief still writes the whole model's state at each drain point (an
/// epoch's end), gathered from one replica of each stage, into a private directory of this
/// launcher ([`Processes::keep_drained_states`]): a start after a lost replica or a failure
/// goes on from it as from a checkpoint, and it is removed with the launcher.
pub struct Processes {
    /// How the workers are launched (time limits, the stop flag).
    pub launch: super::processes::LaunchOptions,
    /// Checkpoints the chief writes (`dir`, `every`, `keep`; each start records its own
    /// run's numerics in them).
    pub checkpoints: Option<crate::checkpoint::CheckpointPolicy>,
    /// Metrics for Prometheus: worker K at this address's port + K.
    pub metrics: Option<std::net::SocketAddr>,
    /// Faults to inject, by worker and start (drills and tests).
    pub faults: FaultSchedule,
    /// Where each worker writes its part of a trace (`--trace`), merged by the caller.
    pub trace_parts: Option<PathBuf>,
    /// The private directory of drained states, when there is no checkpoint policy.
    pub kept: Option<KeptStates>,
    /// A lost replica's survivors go on in place, as one run, instead of every worker
    /// starting again ([`super::recover`]); under `--rejoin` (`launch.rejoin`) a replacement
    /// then joins them at an update boundary.
    pub in_place: bool,
}

/// A launcher's private directory of drained states ([`Processes`]).
pub struct KeptStates(super::processes::LaunchDir);

impl Processes {
    /// Keeps the drained state of each drain point in a private directory when the run has
    /// no checkpoint policy of its own (with one, its checkpoints serve).
    ///
    /// # Errors
    /// The directory cannot be created.
    pub fn keep_drained_states(&mut self) -> Result<()> {
        if self.checkpoints.is_none() && self.kept.is_none() {
            self.kept = Some(KeptStates(super::processes::LaunchDir::create("drained")?));
        }
        Ok(())
    }
}

impl Launcher for Processes {
    type End = super::processes::RunEnd;

    fn start(
        &mut self,
        cfg: &RunConfig,
        from: Option<&Path>,
        start: u32,
        stop_at_first_drain: bool,
        obs: &mut dyn Observer,
    ) -> Result<Self::End> {
        // The launcher logs what the chief reports; the workers write no log of their own.
        let run = cfg.without_log();
        let workers = run.resolved()?.layout.workers();
        self.launch.workers = workers;
        self.launch.stop_at_first_drain = stop_at_first_drain;
        self.launch.in_place = self.in_place.then(|| {
            let run = run.clone();
            let survivable = move |rank: u32| {
                rank != super::worker::CHIEF
                    && LayoutChange::without(&run, rank, String::new(), 0)
                        .is_some_and(|change| change.keeps_partition(&run))
            };
            super::processes::InPlace(Arc::new(survivable))
        });
        let kept = self
            .kept
            .as_ref()
            .map(|k| crate::checkpoint::CheckpointPolicy {
                dir: k.0.0.clone(),
                every: None,
                keep: 1,
                settings: String::new(),
            });
        let checkpoints = match self.checkpoints.as_ref().or(kept.as_ref()) {
            Some(policy) => Some(crate::checkpoint::CheckpointPolicy {
                settings: run.numerics().to_json()?,
                ..policy.clone()
            }),
            None => None,
        };
        let faults = (0..workers).map(|rank| self.faults.of(rank, start));
        let handed = super::processes::WorkerRun {
            checkpoints,
            rejoin: self.launch.rejoin && self.in_place,
            resume: from.map(Path::to_path_buf),
            metrics: self.metrics,
            faults: faults.collect(),
            trace_parts: self.trace_parts.clone(),
            ..super::processes::WorkerRun::of(run)
        };
        let mut end = super::processes::run_processes(&handed, &self.launch, obs)?;
        if self.checkpoints.is_none() {
            // Drained states are the launcher's own, not the user's checkpoints.
            end.checkpoints.clear();
        }
        Ok(end)
    }

    fn stopped(end: &Self::End) -> Option<u64> {
        end.stopped
    }

    fn survives_by_starting_again(&self) -> bool {
        true
    }

    fn kept_states(&self) -> Option<&Path> {
        self.kept.as_ref().map(|k| k.0.0.as_path())
    }

    fn fault_schedule(&self) -> &FaultSchedule {
        &self.faults
    }
}

/// An observer that remembers the last update reported (what a restart loses is counted
/// from it) and passes everything on.
struct LastStep<'a> {
    inner: &'a mut dyn Observer,
    last: &'a std::sync::atomic::AtomicU64,
}

/// [`LastStep::last`] before any update is reported.
const NO_STEP: u64 = u64::MAX;

impl Observer for LastStep<'_> {
    fn on_step(&mut self, s: &crate::train::StepStats) -> Result<()> {
        self.last.store(s.step, Ordering::Relaxed);
        self.inner.on_step(s)
    }
    fn on_epoch(&mut self, e: &crate::train::EpochStats) -> Result<()> {
        self.inner.on_epoch(e)
    }
    fn on_eval(&mut self, e: &crate::train::EvalStats) -> Result<()> {
        self.inner.on_eval(e)
    }
    fn on_stop(&mut self, report: &super::doctor::StopReport) -> Result<()> {
        self.inner.on_stop(report)
    }
    fn on_layout_change(&mut self, change: &LayoutChange) -> Result<()> {
        self.inner.on_layout_change(change)
    }
    fn on_lost(&mut self, lost: &crate::train::LostStats) -> Result<()> {
        self.inner.on_lost(lost)
    }
    fn on_recovery(&mut self, phase: &crate::train::RecoveryStats) -> Result<()> {
        self.inner.on_recovery(phase)
    }
    fn on_training_began(&mut self, at: std::time::SystemTime) -> Result<()> {
        self.inner.on_training_began(at)
    }
    fn on_start_phase(&mut self, phase: super::StartPhase) -> Result<()> {
        self.inner.on_start_phase(phase)
    }
    fn on_phase(&mut self, record: &super::PhaseRecord) -> Result<()> {
        self.inner.on_phase(record)
    }
    fn on_spans(
        &mut self,
        origin: std::time::SystemTime,
        spans: &[pipe_scheduler::Span],
    ) -> Result<()> {
        self.inner.on_spans(origin, spans)
    }
}
