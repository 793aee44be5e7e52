//! Pipelined training: one schedule per epoch, or per segment of an epoch when checkpoints are
//! asked for more often (the pipeline drains at the end of each, so a checkpoint needs no
//! stashed weights; the model is evaluated at each epoch's end), workers launched as threads
//! of this process that exchange tensors in process or over QUIC on loopback, worker state
//! (weights, optimizer) carried from segment to segment, or from a checkpoint. This file also
//! holds what the worker-process trainer shares with it: the segment loop (`run_segments`,
//! over a `Coordinator`), the run's sizes, segment plans, learning rates, epoch reports and
//! checkpoints.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use pipe_kernels::{Backend, BackendKind, CpuBackend};
use pipe_scheduler::planner::buckets::StageBuckets;
use pipe_scheduler::{Layout, Length, Policy, Schedule, Timeline};
use pipe_transport::fault::{FaultSchedule, Faulty};
use pipe_transport::kinds::{MeshSettings, thread_mesh};
use pipe_transport::registration::Endpoint;

use super::adopt::{Logging, SegmentLogs, Serving, take_over};
use super::exec::{StageState, WorkerOutcome, WorkerState};
use super::launch::{run_threads_reporting, run_threads_resumed};
use super::ledger::{LedgerEntry, segment_ledger};
use super::run_plan::RunPlan;
use super::setup::{OrderedSource, Report, Setup};
use super::survive::{self, LayoutChange};
use super::trace_parts::{MAX_TRACE_SPANS, SpanBuffer};
pub use crate::checkpoint::CheckpointPolicy;
use crate::checkpoint::{Checkpoint, RunState};
use crate::config::{PartitionChoice, RunConfig};
use crate::data::Splits;
use crate::error::{Result, StageError};
use crate::model::{Model, Params};
use crate::optim::{Corrected, LrSchedule, OptimizerKind, OptimizerState};
use crate::partition::Partition;
use crate::pipeline::Observer;
use crate::remedy::{LrScaling, stage_delays};
use crate::train::{EpochStats, EvalStats, StageEpochStats, StepStats, TrainReport, evaluate};

/// Extra outputs of a pipelined run.
#[derive(Debug)]
pub struct PipelineReport {
    /// The usual training report (final weights assembled from replica 0 of each stage).
    pub report: TrainReport,
    /// The partition used.
    pub partition: Partition,
    /// The schedule of one epoch (lowered).
    pub schedule: Schedule,
    /// Every action's measured interval over the whole run, when asked for: the first
    /// [`MAX_TRACE_SPANS`] of them.
    pub timeline: Option<Timeline>,
    /// The actions past [`MAX_TRACE_SPANS`], not in `timeline`.
    pub trace_dropped: u64,
    /// The measured version ledger of the whole run, when asked for (empty otherwise).
    pub ledger: Vec<LedgerEntry>,
    /// Checkpoints written, oldest first.
    pub checkpoints: Vec<PathBuf>,
    /// The run stopped early (asked to, at a drain point) after this many updates.
    pub stopped: Option<u64>,
}

/// Options of [`train_pipelined`].
#[derive(Clone, Debug, Default)]
pub struct PipelineTrainOptions {
    /// Record the measured timeline (for `--trace`).
    pub timeline: bool,
    /// Record the version ledger ([`LedgerEntry`]).
    pub ledger: bool,
    /// Write checkpoints.
    pub checkpoints: Option<CheckpointPolicy>,
    /// Start from this checkpoint instead of fresh weights.
    pub resume: Option<Checkpoint>,
    /// Set (by a Ctrl-C handler) to stop at the next drain point, after a checkpoint.
    pub stop: Option<Arc<AtomicBool>>,
    /// Faults to inject into the workers' endpoints, for drills and tests. In process, an
    /// entry's attempt is the segment it applies to, counting from 0 over every segment run
    /// (one run again after a lost replica included); a fault that ends the process
    /// ([`pipe_transport::fault::Fault::Exit`]) is not for threads.
    pub faults: FaultSchedule,
    /// Segments run so far, for [`PipelineTrainOptions::faults`]: shared by every call given
    /// these options, so a run restarted by its caller goes on counting where the failed
    /// one stopped (a fault fires once, not once per restart).
    pub segments_run: Arc<std::sync::atomic::AtomicU32>,
    /// After a lost replica, take it back at the next update boundary: a replacement worker
    /// thread joins and the run is on its own layout again ([`super::survive`]).
    pub rejoin: bool,
    /// Keep the takeover's logs of every message even where a link moves tensors between
    /// threads without copying them (an f32 wire on the CPU), which logs nothing otherwise:
    /// a copy of every message, 1.5x the wall time of a 4 x 2 MLP run on 2 cores, so that a
    /// lost replica is always taken over where every worker stood. For tests of that takeover.
    pub log_moved_messages: bool,
}

/// An epoch that has ended, as the chief sees it.
pub(super) struct EpochEnd<'p> {
    /// Its last schedule.
    pub plan: &'p RunPlan,
    /// Every worker's outcome, in worker order.
    pub outcomes: &'p [WorkerOutcome],
    /// The epoch, from 1.
    pub epoch: u64,
    /// Minibatches done by its end, over the run.
    pub done: u64,
    /// Its wall time.
    pub secs: f64,
    /// The test loss and accuracy of the weights at its end (evaluated before its
    /// checkpoint).
    pub test: (f64, f64),
}

/// What every epoch of a run shares.
pub(crate) struct Run<'c> {
    pub(crate) cfg: &'c RunConfig,
    pub(crate) model: Model,
    /// Targets (loss rows) per sample: 1, or a language model's window.
    pub(crate) targets: usize,
    /// Microbatches per minibatch.
    pub(crate) minibatch: u64,
    /// Minibatches per epoch.
    pub(crate) per_epoch: u64,
    /// Minibatches over the whole run.
    pub(crate) total: u64,
    /// The all-reduce bucket size of each stage, where not every stage's is
    /// `cfg.bucket_size`: the run's own, or (a worker process's) the chief's choice.
    pub(crate) stage_buckets: StageBuckets,
    lr: LrSchedule,
    start: Instant,
    /// `start` by the system clock, for a launcher to date what it sees on the records' clock.
    pub(crate) began: std::time::SystemTime,
    /// The sample order of the latest epoch asked for: computed once per epoch, not once per
    /// segment (a token corpus's order is tens of millions of windows).
    order: std::sync::Mutex<Option<(u64, Arc<Vec<u32>>)>>,
}

/// Trains `cfg`'s model with the pipelined executor.
///
/// # Errors
/// Configuration errors (impossible schedules, partitions, a backend or transport this build
/// cannot run), worker failures naming the worker and action, a diverged loss, or an
/// observer's error.
pub fn train_pipelined(
    cfg: &RunConfig,
    data: &Splits,
    obs: &mut dyn Observer,
    opts: &PipelineTrainOptions,
) -> Result<PipelineReport> {
    // A backend that cannot run here fails before any worker starts (the CPU always can).
    if matches!(cfg.backend, BackendKind::Cuda(_)) {
        pipe_kernels::cuda::device_count()?;
    }
    let run = Run::new(cfg, data)?;
    let partition = run_partition(cfg)?;
    obs.on_start_phase(super::StartPhase::Weights)?;
    let start = Start::new(&run, opts.resume.as_ref())?;
    obs.on_start_phase(super::StartPhase::Workers)?;
    let mut threads = Threads {
        run: &run,
        data,
        start: start.clone(),
        states: Vec::new(),
        faults: opts.faults.clone(),
        segments: opts.segments_run.clone(),
        spans: opts.timeline.then(|| SpanBuffer::new(MAX_TRACE_SPANS)),
        ledger: opts.ledger.then(Vec::new),
        taken_over: None,
        rejoin: opts.rejoin,
        log_moved: opts.log_moved_messages && matches!(cfg.backend, BackendKind::Cpu(_)),
        logs: Default::default(),
    };
    let from = LoopStart {
        done: start.done,
        params: start.params.clone(),
        partition: &partition,
        every: opts.checkpoints.as_ref().and_then(|c| c.every),
        pace: (!cfg.pipelined).then(Pace::default),
        checkpoints: opts.checkpoints.as_ref(),
        stop: opts.stop.as_ref(),
        rejoin: opts.rejoin,
    };
    let end = run_segments(&run, &mut threads, data, from, obs)?;
    let plan = end.last.ok_or_else(|| {
        StageError::Config(format!(
            "nothing to train: the run has {} updates and starts at update {}",
            run.total, start.done
        ))
    })?;
    let workers = plan.schedule.workers();
    let (spans, trace_dropped) = match threads.spans.map(SpanBuffer::into_parts) {
        Some((spans, dropped)) => (Some(spans), dropped),
        None => (None, 0),
    };
    Ok(PipelineReport {
        report: TrainReport {
            epochs: end.epochs,
            params: end.params,
            steps: end.done,
        },
        partition: plan.partition,
        schedule: plan.schedule,
        timeline: spans.map(|spans| Timeline::new(workers, spans)),
        trace_dropped,
        ledger: threads.ledger.unwrap_or_default(),
        checkpoints: end.written,
        stopped: end.stopped,
    })
}

/// The in-process launcher's side of the segment loop: every worker a thread, their states
/// in this process's memory.
struct Threads<'a> {
    run: &'a Run<'a>,
    data: &'a Splits,
    /// Where the workers' states come from when there are none: the run's start, or the
    /// state kept before a segment in which a replica was lost.
    start: Start,
    states: Vec<WorkerState>,
    /// Faults injected into the workers' endpoints, by segment run ([`PipelineTrainOptions::faults`]).
    faults: FaultSchedule,
    /// Segments run so far, runs again and earlier starts of the run included.
    segments: Arc<std::sync::atomic::AtomicU32>,
    /// Every action's interval on the run's time axis, when asked for (`--trace`), up to
    /// [`MAX_TRACE_SPANS`].
    spans: Option<SpanBuffer>,
    /// The measured version ledger, when asked for.
    ledger: Option<Vec<LedgerEntry>>,
    /// The layout change of a replica lost in the last segment and taken over, to make at
    /// the segment's end ([`Coordinator::taken_over`]).
    taken_over: Option<LayoutChange>,
    /// A lost replica is taken back (`--rejoin`): a segment taken over ends at its update
    /// in flight, where the replacement can join.
    rejoin: bool,
    /// Logs kept on links that move tensors too ([`PipelineTrainOptions::log_moved_messages`]).
    log_moved: bool,
    /// The last segment's rollback points and traffic logs, whose buffers the next segment's
    /// take once its workers have let them go, as a worker process's do
    /// ([`super::adopt::segment_logs`]).
    logs: SegmentLogs,
}

impl Threads<'_> {
    /// After a lost replica in segment `at` of `plan`: the workers' states for `change`'s
    /// layout, from the latest step every stage passed ([`super::rollback`]) where the
    /// surviving workers hold it, else from the segment's start (`kept`).
    fn relayout(
        &mut self,
        plan: &RunPlan,
        at: &Segment,
        change: LayoutChange,
        kept: Start,
        points: &super::rollback::Kept,
    ) -> Result<SegmentEnd> {
        self.states.clear();
        let lost = match &change.event {
            survive::LayoutEvent::Lost { worker, .. } => Some(*worker),
            survive::LayoutEvent::Rejoined | survive::LayoutEvent::Unreplaced => None,
        };
        let back = lost.and_then(|w| super::rollback::roll_back(plan, points, w, at.len));
        let Some(back) = back.filter(|b| b.steps < at.len) else {
            self.start = kept;
            return Ok(SegmentEnd::Relayout((change, None)));
        };
        self.start = Start {
            params: assemble(plan, &back.states)?,
            optimizer: Some(Run::optimizer_of(plan, &back.states)?),
            done: at.done + back.steps,
        };
        if let Some(ledger) = &mut self.ledger {
            ledger.extend(segment_ledger(
                plan,
                &back.outcomes,
                at.done,
                self.run.minibatch,
            ));
        }
        let change = change.rolled_back(back.steps);
        Ok(SegmentEnd::Relayout((change, Some(back.outcomes))))
    }
}

impl Coordinator for Threads<'_> {
    fn run_segment(
        &mut self,
        plan: &RunPlan,
        at: &Segment,
        obs: &mut dyn Observer,
    ) -> Result<SegmentEnd> {
        let t = Instant::now();
        // What the segment runs again from if a replica is lost in it: its start, or the
        // latest step every stage passed.
        let logs = super::adopt::segment_logs(plan, std::mem::take(&mut self.logs));
        let kept = match (survive::could_survive(plan), self.states.is_empty()) {
            (false, _) => None,
            (true, true) => Some(self.start.clone()),
            (true, false) => Some(Start {
                params: assemble(plan, &self.states)?,
                optimizer: Some(Run::optimizer_of(plan, &self.states)?),
                done: at.done,
            }),
        };
        let segment = self.segments.fetch_add(1, Ordering::SeqCst);
        let faults = (!self.faults.0.is_empty()).then_some((&self.faults, segment));
        let run = self.run.segment(
            plan,
            self.data,
            at,
            (&self.start, &mut self.states),
            obs,
            SegmentSurvival {
                faults,
                logs: &logs,
                rejoin: self.rejoin,
                log_moved: self.log_moved,
            },
        );
        let points = logs.0.clone();
        self.logs = logs;
        let outcomes = match (run, kept) {
            (Ok((outcomes, None)), _) => outcomes,
            (Ok((outcomes, Some(t))), _) => {
                // Taken over where every worker stood: the segment ended as if nothing was
                // lost, and the layout changes at its end.
                let change = LayoutChange::after(
                    self.run.cfg,
                    plan,
                    self.run.minibatch,
                    &t.failure,
                    at.done,
                )
                .ok_or(t.failure)?;
                self.taken_over = Some(change.taken_over(t.ran, t.in_flight));
                outcomes
            }
            (Err(e), Some(kept)) => {
                match LayoutChange::after(self.run.cfg, plan, self.run.minibatch, &e, at.done) {
                    Some(change) => return self.relayout(plan, at, change, kept, &points),
                    None => return Err(e),
                }
            }
            (Err(e), None) => return Err(e),
        };
        if let Some(spans) = &mut self.spans {
            let base = self.run.start.elapsed().as_secs_f64() - t.elapsed().as_secs_f64();
            for o in &outcomes {
                spans.extend(o.spans.iter().map(|sp| sp.shifted(base)));
            }
        }
        if let Some(ledger) = &mut self.ledger {
            ledger.extend(segment_ledger(plan, &outcomes, at.done, self.run.minibatch));
        }
        Ok(SegmentEnd::Chief(outcomes))
    }

    fn taken_over(&mut self, plan: &RunPlan, done: u64) -> Result<Option<LayoutChange>> {
        let Some(change) = self.taken_over.take() else {
            return Ok(None);
        };
        // The next segment's workers start from the drained state, under the new layout.
        self.rejoin(plan, done)?;
        Ok(Some(change))
    }

    fn ended_at(&self) -> Option<u64> {
        self.taken_over.as_ref().map(|c| c.from)
    }

    fn drain(&mut self, plan: &RunPlan, drain: Drain) -> Result<Drained> {
        let weights = drain.weights.then(|| assemble(plan, &self.states));
        let optimizer = drain
            .optimizer
            .then(|| Run::optimizer_of(plan, &self.states));
        Ok(Drained::Gave(weights.transpose()?, optimizer.transpose()?))
    }

    fn rejoin(&mut self, plan: &RunPlan, done: u64) -> Result<()> {
        self.start = Start {
            params: assemble(plan, &self.states)?,
            optimizer: Some(Run::optimizer_of(plan, &self.states)?),
            done,
        };
        self.states.clear();
        Ok(())
    }
}

// The segment loop, written once for every trainer: workers that are threads of this process
// ([`train_pipelined`], one of them for a run with no pipeline flag), processes of their own
// ([`super::worker::train_worker`]), or delayed SGD's one worker
// ([`crate::delayed::train_delayed`]). After each segment the loop decides what the drained
// pipeline must give up (the whole model's weights at an epoch's end, a checkpoint or a stop;
// its optimizer state at a checkpoint), writes the checkpoints, evaluates and reports each
// epoch, and stops when asked. What differs between the launchers sits behind
// [`Coordinator`]: how a segment runs and how weights and optimizer state reach the chief
// (shared memory, or messages). A worker process other than the chief runs the same loop and
// only follows the chief's requests. It lives here, beside `Run`, which it drives, so that
// `worker.rs` imports one module and no file imports back.

/// What the chief asks of the drained pipeline after a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Drain {
    /// The whole model's weights (an epoch's end, a checkpoint or a stop).
    pub weights: bool,
    /// The whole model's optimizer state (a checkpoint).
    pub optimizer: bool,
    /// The run stops here.
    pub stop: bool,
    /// The run, short of a lost replica, takes it back here: its own layout from the next
    /// segment on ([`Coordinator::rejoin`]).
    pub rejoin: bool,
}

/// The whole model's optimizer state with each layer's update count.
pub(crate) type OptimizerOf = (OptimizerState, Vec<u64>);

/// What a drain gave up.
pub(crate) enum Drained {
    /// The whole model's weights and its optimizer state, each when asked.
    Gave(Option<Params>, Option<OptimizerOf>),
    /// Nothing: a replica was lost in the drain's exchange and the run went on without it in
    /// place, as [`SegmentEnd::Relayout`] says, from a step of the segment just drained (its
    /// last update runs again, and the drain after it).
    Relayout(WentOn),
}

/// A replica lost and gone on without in place: the layout from the change's update on, and
/// the workers' figures over the steps of the segment that stand (none: it runs again from
/// its start; an empty list on a follower, whose figures are the chief's).
pub(crate) type WentOn = (LayoutChange, Option<Vec<WorkerOutcome>>);

/// How a segment ended on this side.
pub(crate) enum SegmentEnd {
    /// The chief (or the in-process launcher): every worker's outcome, in worker order.
    Chief(Vec<WorkerOutcome>),
    /// A worker process that is not the chief: it has reported and answered the chief, who
    /// said whether the run stops.
    Follower {
        /// The run stops after this segment.
        stop: bool,
        /// The run takes its lost replica back after this segment.
        rejoin: bool,
    },
    /// A replica was lost and the run goes on without it under this layout
    /// ([`super::survive`]), from the change's update: the segment's start, or a later step
    /// every stage had passed, with the workers' figures over the steps before it.
    Relayout(WentOn),
}

/// One launcher's side of the loop.
pub(crate) trait Coordinator {
    /// Runs segment `at` of `plan`.
    ///
    /// # Errors
    /// A worker's failure, naming it.
    fn run_segment(
        &mut self,
        plan: &RunPlan,
        at: &Segment,
        obs: &mut dyn Observer,
    ) -> Result<SegmentEnd>;

    /// On the chief, after a segment: tells the other workers what `drain` asks, and returns
    /// the whole model's weights if it asks for them and its optimizer state if it asks for
    /// that; or, where a replica is lost in the drain's exchange and the run goes on without
    /// it in place, the layout it goes on under.
    ///
    /// # Errors
    /// A worker that does not answer.
    fn drain(&mut self, plan: &RunPlan, drain: Drain) -> Result<Drained>;

    /// After a drained segment of `plan` that ended `done` updates in: the workers' states
    /// are to be built again for the run's own layout, which the next segment is on again
    /// (`--rejoin`, [`super::survive`]): threads rebuild their states; worker processes
    /// connect a mesh with the replacement and hand it its stage's state. Only a launcher
    /// that can change its layout in the middle of a run is asked.
    ///
    /// # Errors
    /// A launcher that cannot; states that do not assemble.
    fn rejoin(&mut self, plan: &RunPlan, done: u64) -> Result<()> {
        let _ = (plan, done);
        Err(StageError::Executor(
            "this launcher cannot change its layout in the middle of a run".into(),
        ))
    }

    /// After the drain at the end of segment `plan` (`done` updates in): the layout change of a
    /// replica lost in that segment and taken over where every worker stood
    /// ([`super::adopt`]), from which the next segment runs; the launcher has readied its
    /// workers for it.
    ///
    /// # Errors
    /// States that do not assemble.
    fn taken_over(&mut self, plan: &RunPlan, done: u64) -> Result<Option<LayoutChange>> {
        let _ = (plan, done);
        Ok(None)
    }

    /// After a segment in which a replica was lost and taken over: the update (over the
    /// run) at which it ended, its own end or, cut short for a replacement that comes, the
    /// update it was in ([`super::adopt::Takeover::cut_short`]).
    fn ended_at(&self) -> Option<u64> {
        None
    }

    /// Whether a replacement comes for the replica this run is short of: a worker process's
    /// launcher says so at the loss (`--max-restarts` replaces only as many as it allows);
    /// threads take every one back under `--rejoin`. Without one, the run need not stop at
    /// every update for it.
    fn replacement_coming(&self) -> bool {
        true
    }

    /// On the chief of a run short of a lost replica (`--rejoin`), at the end of a segment:
    /// whether the replacement can join now. Threads can at once; a worker process's
    /// replacement once it has started and said where it listens.
    fn rejoin_ready(&mut self) -> bool {
        true
    }
}

/// Where the loop starts and what it may do.
pub(crate) struct LoopStart<'a> {
    /// Updates done before this run (a resumed checkpoint's).
    pub done: u64,
    /// The weights at the start.
    pub params: Params,
    /// The stages' layers (none: the plan's own cut).
    pub partition: &'a Option<Partition>,
    /// Updates per segment at most (the checkpoint interval).
    pub every: Option<u64>,
    /// Segments sized by time, for a run whose cuts change no result ([`Pace`]); `None`:
    /// whole epochs, cut only at checkpoints.
    pub pace: Option<Pace>,
    /// Checkpoints to write (the chief's).
    pub checkpoints: Option<&'a CheckpointPolicy>,
    /// Set (Ctrl-C) to stop at the next drain point (watched by the chief).
    pub stop: Option<&'a Arc<AtomicBool>>,
    /// Take lost replicas back at the next update boundary after their loss (the short
    /// layout runs one update, whose end is a drain point).
    pub rejoin: bool,
}

/// How the loop ended: on the chief, everything its report needs.
pub(crate) struct LoopEnd {
    /// Every finished epoch's figures.
    pub epochs: Vec<EpochStats>,
    /// The weights at the end (the last drained ones).
    pub params: Params,
    /// Updates done, over the run.
    pub done: u64,
    /// Checkpoints written, oldest first.
    pub written: Vec<PathBuf>,
    /// Stopped early after this many updates.
    pub stopped: Option<u64>,
    /// The last segment's plan (none on a follower, or when nothing ran).
    pub last: Option<RunPlan>,
    /// The test loss and accuracy of the epoch that just ended, evaluated at its drain point.
    pub epoch_test: Option<(f64, f64)>,
}

impl LoopEnd {
    /// Where a loop starts from: `params` after `done` updates, nothing written yet.
    fn starting(params: Params, done: u64) -> Self {
        LoopEnd {
            epochs: Vec::new(),
            params,
            done,
            written: Vec::new(),
            stopped: None,
            last: None,
            epoch_test: None,
        }
    }
}

/// The compute seconds of a segment's busiest worker.
fn slowest_compute(outcomes: &[WorkerOutcome]) -> f64 {
    outcomes.iter().map(|o| o.compute_s).fold(0.0, f64::max)
}

/// Where a segment ended, as the drain after it needs to know.
struct DrainPoint<'p> {
    /// The segment's plan.
    plan: &'p RunPlan,
    /// The run's checkpoints.
    checkpoints: Option<&'p CheckpointPolicy>,
    /// Set (Ctrl-C) to stop here.
    stop: Option<&'p Arc<AtomicBool>>,
    /// Its epoch.
    epoch: u64,
    /// Whether the epoch ends with it.
    epoch_end: bool,
    /// Whether the run takes its lost replica back here.
    rejoin: bool,
}

/// How the drain after a segment ended.
enum AfterDrain {
    /// It gave up what it was asked; whether the run stops here.
    Drained { stop: bool },
    /// A replica was lost in its exchange, and the run went on without it in place, as
    /// [`SegmentEnd::Relayout`] says.
    Relayout(WentOn),
}

/// The drain after a segment: the weights gathered where the epoch ends, a checkpoint is due,
/// the run stops (Ctrl-C) or evaluates; the evaluation reported and the checkpoint written.
///
/// # Errors
/// As the coordinator's drain; evaluation, observer and checkpoint failures.
fn drain_after_segment(
    run: &Run<'_>,
    coord: &mut dyn Coordinator,
    data: &Splits,
    eval_be: &CpuBackend,
    at: &DrainPoint<'_>,
    end: &mut LoopEnd,
    obs: &mut dyn Observer,
) -> Result<AfterDrain> {
    // A stop asked for in the run's last segment changes nothing: the run has ended.
    let stop = end.done < run.total && at.stop.is_some_and(|f| f.load(Ordering::SeqCst));
    let save = at
        .checkpoints
        .filter(|p| p.due(end.done, at.epoch_end, stop));
    // The epoch's end evaluates anyway.
    let eval = !at.epoch_end && run.cfg.eval_every.is_some_and(|n| end.done % n == 0);
    let drain = Drain {
        weights: at.epoch_end || save.is_some() || stop || eval,
        optimizer: save.is_some(),
        stop,
        rejoin: at.rejoin && !stop,
    };
    let (weights, optimizer) = match coord.drain(at.plan, drain)? {
        Drained::Gave(weights, optimizer) => (weights, optimizer),
        Drained::Relayout(went) => return Ok(AfterDrain::Relayout(went)),
    };
    if let Some(weights) = weights {
        end.params = weights;
    }
    if at.epoch_end {
        // Before the epoch's checkpoint: weights whose test loss is not finite are never kept.
        end.epoch_test = Some(run.evaluate(&end.params, data, eval_be, end.done)?);
    }
    if eval {
        obs.on_eval(&run.evaluate_between(&end.params, data, eval_be, (at.epoch, end.done))?)?;
    }
    if let (Some(policy), Some(optimizer)) = (save, optimizer) {
        let saved = run.save(at.plan, end.done, &mut end.params, optimizer, policy)?;
        end.written.push(saved);
    }
    Ok(AfterDrain::Drained { stop })
}

/// How many of the `left` updates of its epoch the next segment takes: no more than `pace`
/// allows, and one while the run is short of a replica that rejoins (`short_rejoining`), so
/// that the replacement can join at the boundary of any update.
fn segment_cap(left: u64, pace: Option<Pace>, short_rejoining: bool) -> u64 {
    let cap = left.min(pace.map_or(u64::MAX, |p| p.cap()));
    if short_rejoining { cap.min(1) } else { cap }
}

/// Whether the segment starting at update `done` waits for a replacement (and so runs one
/// update): the run is short of a replica (`layout`) under `--rejoin`, and one is `coming`.
/// When none comes after all, says so once and keeps the layout as
/// [`survive::LayoutEvent::Unreplaced`], from which segments take their usual length again.
///
/// # Errors
/// The observer's.
fn waits_for_replacement(
    layout: &mut Option<LayoutChange>,
    (rejoin, coming): (bool, bool),
    done: u64,
    obs: &mut dyn Observer,
) -> Result<bool> {
    let Some(change) = layout.as_ref().filter(|_| rejoin) else {
        return Ok(false);
    };
    if coming {
        return Ok(true);
    }
    if matches!(change.event, survive::LayoutEvent::Lost { .. }) {
        let kept = change.unreplaced(done);
        obs.on_layout_change(&kept)?;
        *layout = Some(kept);
    }
    Ok(false)
}

/// What a segment does about failures ([`Run::segment`]): the faults it injects (the schedule
/// and the segment's number, counted over the whole command), the logs a takeover of a lost
/// replica reads, whether a replacement rejoins at the next update boundary, and whether
/// messages moved between threads without a copy are logged too.
struct SegmentSurvival<'a> {
    faults: Option<(&'a FaultSchedule, u32)>,
    logs: &'a SegmentLogs,
    rejoin: bool,
    log_moved: bool,
}

/// Runs the segments of `run` from `start` through `coord`, reporting to `obs`.
///
/// # Errors
/// As the coordinator's; a checkpoint that cannot be written; an observer's error.
pub(crate) fn run_segments(
    run: &Run<'_>,
    coord: &mut dyn Coordinator,
    data: &Splits,
    start: LoopStart<'_>,
    obs: &mut dyn Observer,
) -> Result<LoopEnd> {
    let eval_be = CpuBackend::new(0)?;
    let mut pace = start.pace;
    // The layout after a lost replica (none: the run's own).
    let mut layout: Option<LayoutChange> = None;
    let mut end = LoopEnd::starting(start.params, start.done);
    let mut last_epoch: Option<Instant> = None;
    for epoch in end.done / run.per_epoch + 1..=run.cfg.epochs {
        let first = (epoch - 1) * run.per_epoch;
        let epoch_len = run.total.saturating_sub(first).min(run.per_epoch);
        if epoch_len == 0 || end.stopped.is_some() {
            break;
        }
        // What the last epoch's end let go of goes back to the system before this epoch
        // allocates its own, unless this epoch's end comes soon enough to reuse it.
        if let Some(began) = last_epoch.replace(Instant::now()) {
            crate::release::after(began.elapsed());
        }
        let mut so_far = EpochSoFar::default();
        while end.done < first + epoch_len && end.stopped.is_none() {
            let done = end.done;
            let before = done - first;
            let waits = (start.rejoin, coord.replacement_coming());
            let rejoining = waits_for_replacement(&mut layout, waits, done, obs)?;
            let left = segment_cap(epoch_len - before, pace, rejoining);
            let (plan, this) =
                run.segment_plan(start.every, done, left, start.partition, layout.as_ref())?;
            let at = Segment {
                epoch,
                done,
                before,
                epoch_len,
                len: this,
            };
            let t = Instant::now();
            let ended = coord.run_segment(&plan, &at, obs)?;
            // A segment taken over for a replacement that comes ends at its update in flight.
            let this = coord.ended_at().map_or(this, |to| to - done);
            let outcomes = match ended {
                SegmentEnd::Chief(outcomes) => outcomes,
                SegmentEnd::Relayout(went) => {
                    so_far.went_on_without(went, (plan, t), (&mut end, &mut layout), obs)?;
                    continue;
                }
                SegmentEnd::Follower { stop, rejoin } => {
                    end.done += this;
                    follower_after_segment(coord, &plan, (stop, rejoin), (&mut end, &mut layout))?;
                    continue;
                }
            };
            let took = t.elapsed().as_secs_f64();
            end.done += this;
            let epoch_end = end.done == first + epoch_len;
            let rejoin =
                layout.is_some() && start.rejoin && end.done < run.total && coord.rejoin_ready();
            let point = DrainPoint {
                plan: &plan,
                checkpoints: start.checkpoints,
                stop: start.stop,
                epoch,
                epoch_end,
                rejoin,
            };
            let stop = match drain_after_segment(run, coord, data, &eval_be, &point, &mut end, obs)?
            {
                AfterDrain::Drained { stop } => stop,
                // A replica lost in the drain's own exchange: the run goes on without it as
                // after a loss in the segment's last exchange, running its last update again.
                AfterDrain::Relayout(went) => {
                    end.done = done;
                    so_far.went_on_without(went, (plan, t), (&mut end, &mut layout), obs)?;
                    continue;
                }
            };
            if let Some(p) = pace.as_mut() {
                p.record(this, took, slowest_compute(&outcomes));
            }
            so_far.secs += took;
            so_far.merge(outcomes, &plan);
            if stop {
                end.stopped = Some(end.done);
            }
            relayout_after_drain(run, coord, (&point, stop), (&end, &mut layout), obs)?;
            so_far.last = Some(plan);
        }
        let EpochSoFar { acc, secs, last } = so_far;
        let Some(plan) = last else { continue };
        if end.done < first + epoch_len {
            end.last = Some(plan);
            break;
        }
        let test = match end.epoch_test.take() {
            Some(test) => test,
            None => run.evaluate(&end.params, data, &eval_be, end.done)?,
        };
        let ended = EpochEnd {
            plan: &plan,
            outcomes: &acc,
            epoch,
            done: end.done,
            secs,
            test,
        };
        let stats = run.finish_epoch(&ended, obs)?;
        end.epochs.push(stats);
        end.last = Some(plan);
    }
    Ok(end)
}

/// An epoch's figures so far: every worker's outcomes over its segments, merged, the seconds
/// they took, and the plan of the last one (whose layout the merged outcomes are in).
#[derive(Default)]
struct EpochSoFar {
    acc: Vec<WorkerOutcome>,
    secs: f64,
    last: Option<RunPlan>,
}

impl EpochSoFar {
    /// Merges a segment's `outcomes`, in `plan`'s layout, into the epoch's.
    fn merge(&mut self, outcomes: Vec<WorkerOutcome>, plan: &RunPlan) {
        let acc_layout = self.last.as_ref().map(|p| p.schedule.layout());
        merge_outcomes(&mut self.acc, acc_layout, outcomes, plan.schedule.layout());
    }

    /// After a replica was lost in the segment of `plan` begun at `t`, or in the drain after
    /// it, and the run went on without it in place under `change`: the change reported and
    /// made, and where updates of the segment stand (`standing`, the workers' figures over
    /// them), the run moved on to the change's update. The segment goes on from there under
    /// the new layout: its start, or a later step whose updates stand.
    ///
    /// # Errors
    /// The observer's.
    fn went_on_without(
        &mut self,
        (change, standing): WentOn,
        (plan, t): (RunPlan, Instant),
        (end, layout): (&mut LoopEnd, &mut Option<LayoutChange>),
        obs: &mut dyn Observer,
    ) -> Result<()> {
        obs.on_layout_change(&change)?;
        if let Some(outcomes) = standing {
            self.secs += t.elapsed().as_secs_f64();
            end.done = change.from;
            // The chief's figures (a follower's are the chief's to keep).
            if !outcomes.is_empty() {
                self.merge(outcomes, &plan);
                self.last = Some(plan);
            }
        }
        *layout = Some(change);
        Ok(())
    }
}

/// On a follower, after a segment of `plan` the chief has drained (`stop`: the run stops
/// there; `rejoin`: the lost replica's replacement joins there): the layout change of a
/// replica lost in the segment and taken over, or the run's own layout again.
///
/// # Errors
/// As [`Coordinator::taken_over`] and [`Coordinator::rejoin`].
fn follower_after_segment(
    coord: &mut dyn Coordinator,
    plan: &RunPlan,
    (stop, rejoin): (bool, bool),
    (end, layout): (&mut LoopEnd, &mut Option<LayoutChange>),
) -> Result<()> {
    if let Some(change) = coord.taken_over(plan, end.done)? {
        *layout = Some(change);
    }
    if stop {
        end.stopped = Some(end.done);
    } else if rejoin {
        coord.rejoin(plan, end.done)?;
        crate::release::now();
        *layout = None;
    }
    Ok(())
}

/// After the drain at the end of `point.plan` (`stop`: the run stops there): the layout
/// change of a replica lost in the segment and taken over, or, short of one and taking it
/// back (`point.rejoin`), the run's own layout again.
fn relayout_after_drain(
    run: &Run<'_>,
    coord: &mut dyn Coordinator,
    (point, stop): (&DrainPoint<'_>, bool),
    (end, layout): (&LoopEnd, &mut Option<LayoutChange>),
    obs: &mut dyn Observer,
) -> Result<()> {
    if let Some(change) = coord.taken_over(point.plan, end.done)? {
        obs.on_layout_change(&change)?;
        *layout = Some(change);
    }
    if !stop && point.rejoin {
        coord.rejoin(point.plan, end.done)?;
        crate::release::now();
        obs.on_layout_change(&LayoutChange::restored(run.cfg, end.done)?)?;
        *layout = None;
    }
    Ok(())
}

/// The sequential reference trainer over a whole run of `cfg`, from fresh weights: the same
/// segments (epochs, a synchronous warm-up), data order, learning rates and remedies as
/// [`train_pipelined`], each segment run by [`reference_run`](super::reference_run) with the
/// optimizers carried from one to the next. A pipelined run of `cfg` must end with these
/// weights bit for bit. Returns the whole model's final weights and every update's mean loss.
///
/// # Errors
/// As [`train_pipelined`].
pub fn train_reference(cfg: &RunConfig, data: &Splits) -> Result<(Params, Vec<f64>)> {
    train_reference_with(cfg, data, &[])
}

/// [`train_reference`] through the layout changes a run met (a lost replica, one taken back;
/// [`super::survive`]), in order: each change cuts a segment at its update (where the
/// pipeline drains) and the run goes on under its replica counts and microbatches from there.
/// Between a loss and the rejoin after it, the run drains at every update (`--rejoin`: the
/// replacement may join at any update boundary).
/// A run that survived those changes must end with these weights bit for bit.
///
/// # Errors
/// As [`train_pipelined`].
pub fn train_reference_with(
    cfg: &RunConfig,
    data: &Splits,
    changes: &[LayoutChange],
) -> Result<(Params, Vec<f64>)> {
    let run = Run::new(cfg, data)?;
    let partition = run_partition(cfg)?;
    let be = CpuBackend::new(1)?;
    let mut params = run.model.init_params(cfg.seed);
    let mut opts: Option<Vec<Corrected>> = None;
    let mut losses = Vec::new();
    let mut done = 0;
    while done < run.total {
        let epoch = done / run.per_epoch + 1;
        let layout = changes.iter().rev().find(|c| c.from <= done);
        let next_change = changes.iter().find(|c| c.from > done);
        let mut left = ((epoch * run.per_epoch).min(run.total))
            .min(next_change.map_or(u64::MAX, |c| c.from))
            - done;
        // Short of a replica that rejoins later (or that it waits for until none comes), the
        // run drains at every update.
        let waited = |c: &LayoutChange| {
            matches!(
                c.event,
                survive::LayoutEvent::Rejoined | survive::LayoutEvent::Unreplaced
            )
        };
        if layout.is_some() && next_change.is_some_and(waited) {
            left = left.min(1);
        }
        let (plan, this) = run.segment_plan(None, done, left, &partition, layout)?;
        let carried = match opts.take() {
            Some(o) => o,
            None => (0..plan.schedule.stages() as usize)
                .map(|s| {
                    let range = plan.partition.range(s);
                    let matrices = &run.model.optimizer_roles()[range.clone()];
                    Corrected::new(cfg.optimizer, &params[range].to_vec(), matrices)
                })
                .collect(),
        };
        let r = run.with_setup(&plan, data, (epoch, done), None, |setup| {
            super::reference_run(&be, setup, &params, carried)
        })?;
        params = r.params.into_iter().flatten().collect();
        opts = Some(r.opts);
        let rows = (run.minibatch as usize * cfg.microbatch_size * run.targets) as f64;
        losses.extend(
            r.losses
                .chunks(run.minibatch as usize)
                .map(|u| u.iter().sum::<f64>() / rows),
        );
        done += this;
    }
    Ok((params, losses))
}

/// Where a run starts: fresh weights, or a checkpoint's weights, optimizer state (with each
/// layer's update count) and the updates done.
#[derive(Clone)]
pub(super) struct Start {
    pub(super) params: Params,
    pub(super) optimizer: Option<(OptimizerState, Vec<u64>)>,
    pub(super) done: u64,
}

/// A fresh run's weights: `--init-from`'s, or the model's initialisation from the run's seed.
///
/// # Errors
/// A Hugging Face directory that does not hold this model ([`crate::hf::import`]).
pub fn initial_params(cfg: &RunConfig, model: &Model) -> Result<Params> {
    initial_params_of(cfg, model, &vec![true; model.len()])
}

/// [`initial_params`] of the layers `keep` marks only; the others hold no tensors (a worker
/// process keeps its own stages' weights, not the whole model's). `--init-from` reads the
/// whole directory and keeps those layers.
///
/// # Errors
/// As [`initial_params`].
pub fn initial_params_of(cfg: &RunConfig, model: &Model, keep: &[bool]) -> Result<Params> {
    match &cfg.init_from {
        Some(dir) => {
            let mut params = crate::hf::import(model, &cfg.model, dir)?;
            for (p, &k) in params.iter_mut().zip(keep) {
                if !k {
                    *p = Vec::new();
                }
            }
            Ok(params)
        }
        None => Ok(model.init_params_of(cfg.seed, keep)),
    }
}

/// Writes the seed checkpoint of `cfg` into `policy`'s directory: its starting point before
/// any update (the initial weights and a fresh optimizer state, updates 0), which runs of any
/// layout resume from alike and `pipe export` writes as they are. Returns its directory.
///
/// # Errors
/// As [`initial_params`] and [`crate::checkpoint::write`].
pub fn write_seed_checkpoint(
    cfg: &RunConfig,
    model: &Model,
    policy: &CheckpointPolicy,
) -> Result<PathBuf> {
    let params = initial_params(cfg, model)?;
    let optimizer = Corrected::new(cfg.optimizer, &params, &model.optimizer_roles());
    let mut state = RunState::identity(cfg, policy.settings.clone());
    state.optimizer_steps = vec![0; params.len()];
    let whole = std::iter::once(0..model.len()).collect();
    state.partition = Partition::new(whole, model.len())?.to_string();
    let ckpt = Checkpoint {
        optimizer: optimizer.into_state(),
        params,
        state,
    };
    crate::checkpoint::write(&policy.dir, model, &ckpt, policy.keep)
}

impl Start {
    pub(super) fn new(run: &Run<'_>, resume: Option<&Checkpoint>) -> Result<Self> {
        let Some(c) = resume else {
            let params = initial_params(run.cfg, &run.model)?;
            return Ok(Start {
                params,
                optimizer: None,
                done: 0,
            });
        };
        let corpus = run.cfg.corpus.as_ref().map(|c| &c.fingerprint);
        if c.state.corpus.as_ref() != corpus {
            return Err(StageError::Checkpoint(
                "was written by a run on another corpus: its data cursor does not apply here"
                    .into(),
            ));
        }
        // Another dataset's cursor would be carried into this one's order without a word.
        if c.state.dataset != run.cfg.dataset {
            return Err(StageError::Checkpoint(format!(
                "was written by a run on {}, and this run reads {}: its data cursor does not \
                 apply here (give the checkpoint's dataset, or start afresh)",
                format!("{:?}", c.state.dataset).to_lowercase(),
                format!("{:?}", run.cfg.dataset).to_lowercase()
            )));
        }
        // The checkpoint's data position in this run's updates (its layout may differ).
        let per_update = run.minibatch * run.cfg.microbatch_size as u64;
        let at = c.state.samples_in_epoch;
        if at % per_update != 0 || c.state.epoch == 0 {
            return Err(StageError::Checkpoint(format!(
                "stopped {at} samples into epoch {}, not a whole number of this run's minibatches of {per_update} samples",
                c.state.epoch
            )));
        }
        if at / per_update > run.per_epoch {
            return Err(StageError::Checkpoint(format!(
                "stopped {at} samples into epoch {}, past the end of this run's epochs of {} \
                 minibatches of {per_update} samples",
                c.state.epoch, run.per_epoch
            )));
        }
        let done = (c.state.epoch - 1)
            .saturating_mul(run.per_epoch)
            .saturating_add(at / per_update);
        if done >= run.total {
            return Err(StageError::Checkpoint(format!(
                "is at update {done} of this run, which has {} in all: nothing left to train",
                run.total
            )));
        }
        // Checkpoints that do not record their correction are not checked.
        if let Some(saved) = c.state.delay_correction {
            run.cfg
                .optimizer
                .delay_correction
                .check_resumes_from(saved)?;
        }
        if c.state.optimizer_steps.len() != c.params.len() {
            return Err(StageError::Checkpoint(format!(
                "state.json has optimizer steps for {} layers, the model has {}",
                c.state.optimizer_steps.len(),
                c.params.len()
            )));
        }
        Ok(Start {
            params: c.params.clone(),
            optimizer: Some((c.optimizer.clone(), c.state.optimizer_steps.clone())),
            done,
        })
    }

    /// Every worker's state at the start.
    fn states(&self, setup: &Setup<'_>, cfg: &RunConfig) -> Result<Vec<WorkerState>> {
        (0..setup.plan.schedule.workers())
            .map(|w| self.state_of(setup, cfg, w))
            .collect()
    }

    /// Worker `w`'s state at the start: its stages' slices of the weights and, when
    /// resuming, of the optimizer state.
    pub(super) fn state_of(
        &self,
        setup: &Setup<'_>,
        cfg: &RunConfig,
        w: u32,
    ) -> Result<WorkerState> {
        let plan = setup.plan;
        let mut st = WorkerState::new(setup, w, &self.params, cfg.optimizer);
        if let Some((opt, steps)) = &self.optimizer {
            for stage in &mut st.stages {
                let range = plan.partition.range(stage.stage as usize);
                let counts = &steps[range.clone()];
                let first = counts.first().copied().unwrap_or(0);
                // Only Adam's bias correction reads the count.
                if cfg.optimizer.kind != OptimizerKind::Sgd && counts.iter().any(|&c| c != first) {
                    return Err(StageError::Checkpoint(format!(
                        "layers {}-{} were saved after different numbers of optimizer updates ({counts:?}): they cannot share a stage; resume with the replicas that wrote it",
                        range.start,
                        range.end - 1
                    )));
                }
                stage.opt = Corrected::with_state(
                    cfg.optimizer,
                    &stage.params,
                    &setup.model.optimizer_roles()[range.clone()],
                    opt[range].to_vec(),
                    first,
                )?;
            }
        }
        Ok(st)
    }
}

/// The length of the next segment: up to the next multiple of `every` (counted over the
/// run), and no further than the `left` updates of the epoch.
pub(super) fn segment_length(every: Option<u64>, done: u64, left: u64) -> u64 {
    every.map_or(left, |n| (n.max(1) - done % n.max(1)).min(left))
}

/// Where a segment sits: its epoch, the updates done before it over the run and within
/// its epoch, its epoch's length, and its own length in updates.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Segment {
    pub(crate) epoch: u64,
    pub(crate) done: u64,
    pub(crate) before: u64,
    pub(crate) epoch_len: u64,
    pub(crate) len: u64,
}

/// A segment's outcomes, and where it was taken over after a loss.
type SegmentRun = (Vec<WorkerOutcome>, Option<TakenOver>);

/// A segment taken over after a lost replica ([`super::adopt`]).
struct TakenOver {
    /// The lost worker's failure.
    failure: StageError,
    /// The update the segment was in ([`super::adopt::update_in_flight`]).
    in_flight: u64,
    /// The steps of the segment it ran: all of them, or up to the update in flight where a
    /// replacement comes ([`super::adopt::Takeover::cut_short`]).
    ran: u64,
}

/// Every worker's figures over a segment of `plan` taken over after `lost` failed: what it
/// had measured at the boundary it resumed at (its stage's version there, in `versions`; the
/// lost worker's from its own points, which an in-process run still holds), followed by what
/// its resumed program measured (`after`).
fn measured_through(
    plan: &RunPlan,
    (lost, versions): (u32, &[u32]),
    points: &super::rollback::Kept,
    after: Vec<WorkerOutcome>,
) -> Result<Vec<WorkerOutcome>> {
    let resolved = &plan.schedule.resolved;
    let minibatch = u64::from(resolved.minibatch.max(1));
    let layout = plan.schedule.layout();
    after
        .into_iter()
        .zip(versions)
        .enumerate()
        .map(|(w, (after, &version))| {
            let (stage, _) = layout.placement(w as u32);
            let applied = u64::from(version) * u64::from(resolved.update_size(stage));
            let step = applied / minibatch;
            let before = match step {
                0 => Some(WorkerOutcome::default()),
                _ => points
                    .get(w)
                    .and_then(|p| p.lock().ok())
                    .and_then(|p| p.measured_at(step)),
            };
            let before = before.ok_or_else(|| {
                StageError::Executor(format!(
                    "worker {w}'s figures at step {step} are no longer kept (worker {lost} was lost)"
                ))
            })?;
            Ok(before.followed_by(after))
        })
        .collect()
}

/// Per-update loss sums of a running segment, reported in update order as each completes.
pub(super) struct LiveSteps<'r> {
    run: &'r Run<'r>,
    seg: &'r Segment,
    minibatch: u64,
    /// Per update of the segment: each microbatch's (number, loss sum, loss rows) as they
    /// arrived, summed in microbatch order once all are in, so that the logged loss is the
    /// same whatever order the workers' reports took (threads, shared memory or QUIC).
    steps: Vec<Vec<(u32, f64, usize)>>,
    /// When clipping: per update of the segment, the global gradient norm before clipping of
    /// its last update of the loss stage (a step waits for it).
    norms: Option<Vec<Option<f64>>>,
    /// Updates of the loss stage per step (more than one when the loss stage has fewer
    /// replicas than the widest stage of an asynchronous layout).
    loss_updates_per_step: u32,
    next: usize,
    samples: usize,
    start: Instant,
    last_update: Instant,
}

impl<'r> LiveSteps<'r> {
    pub(super) fn new(run: &'r Run<'r>, plan: &RunPlan, seg: &'r Segment) -> Self {
        let minibatch = u64::from(plan.schedule.resolved.minibatch.max(1));
        let updates = plan.steps();
        let resolved = &plan.schedule.resolved;
        let loss_update = resolved.update_size(resolved.layout.stages().saturating_sub(1));
        let clipping = run.cfg.optimizer.grad_clip.is_some();
        LiveSteps {
            run,
            seg,
            minibatch,
            steps: vec![Vec::new(); updates as usize],
            norms: clipping.then(|| vec![None; updates as usize]),
            loss_updates_per_step: (resolved.minibatch / loss_update.max(1)).max(1),
            next: 0,
            samples: 0,
            start: Instant::now(),
            last_update: Instant::now(),
        }
    }

    /// Adds a microbatch's loss or an update's gradient norm; reports every update that is now
    /// complete.
    pub(super) fn add(&mut self, report: Report, obs: &mut dyn Observer) -> Result<()> {
        match report {
            Report::Loss(mb, loss, n) => {
                let step = (u64::from(mb) / self.minibatch) as usize;
                // A segment taken over computes again the losses of its microbatches in
                // flight: each counts once, with the same bits.
                let slot = self
                    .steps
                    .get_mut(step)
                    .filter(|s| s.iter().all(|r| r.0 != mb));
                if let Some(slot) = slot {
                    slot.push((mb, loss, n));
                }
            }
            Report::GradNorm(update, norm) => {
                let per = self.loss_updates_per_step;
                let slot = self
                    .norms
                    .as_mut()
                    .and_then(|n| n.get_mut((update / per) as usize));
                if let Some(slot) = slot.filter(|_| update % per == per - 1) {
                    *slot = Some(norm);
                }
            }
        }
        while let Some(reports) = self.steps.get_mut(self.next) {
            if (reports.len() as u64) < self.minibatch {
                break;
            }
            let grad_norm = match &self.norms {
                Some(norms) => match norms.get(self.next).copied().flatten() {
                    Some(n) => Some(n),
                    None => break,
                },
                None => None,
            };
            let reports = &mut self.steps[self.next];
            reports.sort_by_key(|r| r.0);
            let (l, n) = reports
                .iter()
                .fold((0.0, 0), |(l, n), r| (l + r.1, n + r.2));
            // `n` counts loss rows: samples, or tokens of a language model.
            let targets = self.run.targets;
            self.samples += n / targets;
            crate::train::record_update(n / targets, Some(&mut self.last_update));
            let t = self.next as u64;
            let step = self.seg.done + t;
            let rate = self.samples as f64 / self.start.elapsed().as_secs_f64().max(1e-9);
            obs.on_step(&StepStats {
                step: step + 1,
                epoch: self.seg.epoch,
                loss: l / n.max(1) as f64,
                lr: self.run.lr.at(step),
                samples: n / targets,
                samples_per_sec: rate,
                tokens_per_sec: crate::train::tokens_per_sec(rate, targets),
                elapsed_s: self.run.start.elapsed().as_secs_f64(),
                steps_in_epoch: self.seg.epoch_len,
                step_in_epoch: self.seg.before + t + 1,
                grad_norm,
            })?;
            self.next += 1;
        }
        Ok(())
    }
}

/// Adds one segment's outcomes to an epoch's (per worker: sums, and the latest peak).
pub(super) fn merge_outcomes(
    acc: &mut Vec<WorkerOutcome>,
    acc_layout: Option<&Layout>,
    outcomes: Vec<WorkerOutcome>,
    layout: &Layout,
) {
    let same = acc_layout.is_none_or(|l| l.replica_counts() == layout.replica_counts());
    if acc.is_empty() || !same {
        // The layout changed (a lost replica, one taken back): the epoch's figures so far go
        // to the new layout's worker of the same stage and replica, or its last replica, so
        // that every sample stays counted once.
        let before = std::mem::replace(acc, outcomes);
        if let Some(old) = acc_layout {
            for (w, o) in before.iter().enumerate() {
                let (position, replica) = old.placement(w as u32);
                let Some(&r) = layout.replica_counts().get(position as usize) else {
                    continue;
                };
                let to = layout.worker(position, replica.min(r.saturating_sub(1)));
                if let Some(a) = acc.get_mut(to as usize) {
                    a.add_counts(o);
                }
            }
        }
        return;
    }
    for (a, o) in acc.iter_mut().zip(&outcomes) {
        a.add_counts(o);
    }
}

/// How long a paced segment runs, about ([`Pace`]), where starting one costs little.
const PACED_SEGMENT_SECONDS: f64 = 0.25;

/// A paced segment runs at least this many times what starting and ending it costs
/// ([`Pace`]): that cost stays under one percent of the run.
const SEGMENT_START_SHARE: f64 = 100.0;

/// Sizes the segments of a run whose cuts change no result: one worker over the whole model
/// (no pipeline flag), which runs `sequential` and so drains after every update. Cutting its
/// epochs into segments of about [`PACED_SEGMENT_SECONDS`] lets a Ctrl-C stop it, with its
/// checkpoint, a fraction of a second after the update in progress, as a pipeline can only at
/// its segments' ends. The first segment is one update; each next one is sized from the last:
/// its time per update (the worker's time in its actions) and what the segment cost besides
/// (starting the worker and its backend, placing its state and taking it back). On the CPU
/// that cost is about a millisecond and the segments stay near a quarter of a second. A GPU
/// backend's start (a stream, a cuBLAS handle, an empty memory pool, GPT-2's weights and
/// moments copied in and out) took about a second on an H200; sized by time alone, every
/// update was a segment and `pipe train` ran at a twentieth of the step's speed. So a segment
/// runs at least [`SEGMENT_START_SHARE`] times its start, and a Ctrl-C waits for that. The
/// lengths depend on timing, the weights do not.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Pace {
    seconds_per_update: Option<f64>,
    start_seconds: f64,
}

impl Pace {
    /// Updates the next segment may run.
    fn cap(&self) -> u64 {
        let target = PACED_SEGMENT_SECONDS.max(SEGMENT_START_SHARE * self.start_seconds);
        match self.seconds_per_update {
            None => 1,
            Some(s) if s > 0.0 => (target / s).clamp(1.0, 1e9) as u64,
            Some(_) => 1 << 20,
        }
    }

    /// A segment of `updates` took `secs`, `busy` of them in its worker's actions.
    fn record(&mut self, updates: u64, secs: f64, busy: f64) {
        if updates > 0 {
            let busy = if busy > 0.0 { busy.min(secs) } else { secs };
            self.seconds_per_update = Some(busy / updates as f64);
            self.start_seconds = secs - busy;
        }
    }
}

/// Compute threads of each of `workers` workers of this process for `--threads requested`:
/// what was asked, and for 0 ("one per core") every core when one worker has the machine to
/// itself, one each when several share it.
pub fn worker_threads(requested: usize, workers: u32) -> usize {
    match (requested, workers) {
        (0, 1) => 0,
        (0, _) => 1,
        (t, _) => t,
    }
}

/// The partition `cfg` asks for: given ranges, or the FLOP-balanced split (`None`, which
/// [`RunPlan::new`] fills in). A cut by measured time is made before the run, above the
/// pipeline ([`crate::planning::settle_measured_partition`], which runs the pipeline to
/// measure and writes the cut into the run): the pipeline runs cuts, it does not make them.
///
/// # Errors
/// [`StageError::Config`] for a partition still to be measured.
pub fn run_partition(cfg: &RunConfig) -> Result<Option<Partition>> {
    match &cfg.partition {
        PartitionChoice::Given(p) => Ok(Some(p.clone())),
        PartitionChoice::Flops => Ok(None),
        // One stage holds the whole model, however it would be measured.
        PartitionChoice::Measured if cfg.stages <= 1 => Ok(None),
        PartitionChoice::Measured => Err(StageError::Config(
            "the partition is to be measured, which is settled before the run starts \
             (planning::settle_measured_partition)"
                .into(),
        )),
    }
}

impl<'c> Run<'c> {
    pub(crate) fn new(cfg: &'c RunConfig, data: &Splits) -> Result<Self> {
        let model = Model::new(&cfg.model)?
            .with_stage_recompute(cfg.recompute.clone())
            .with_documents(cfg.corpus.as_ref().and_then(|c| c.pack_documents));
        let b = cfg.microbatch_size;
        // One minibatch: M per replica of the most replicated stage.
        let probe = cfg.resolved()?;
        let minibatch = u64::from(probe.minibatch);
        let per_epoch = data.train.len() as u64 / b as u64 / minibatch;
        if per_epoch == 0 {
            return Err(StageError::Config(format!(
                "one minibatch needs {} samples ({minibatch} microbatches of {b}) but {} has {}",
                minibatch * b as u64,
                data.train.name,
                data.train.len()
            )));
        }
        let total = cfg
            .steps
            .map_or(per_epoch * cfg.epochs, |s| s.min(per_epoch * cfg.epochs));
        Ok(Run {
            cfg,
            model,
            targets: data.train.targets.max(1),
            minibatch,
            per_epoch,
            total,
            stage_buckets: cfg.stage_buckets.clone(),
            lr: cfg.lr_schedule(total),
            start: Instant::now(),
            began: std::time::SystemTime::now(),
            order: std::sync::Mutex::new(None),
        })
    }

    /// The plan of the next segment of a run `done` updates in, with `left` updates left in
    /// its epoch, and its length: up to the next checkpoint (`every`), and, while a
    /// synchronous warm-up lasts ([`crate::remedy::Remedies::sync_warmup`]), up to its end
    /// under `1f1b-flush` on the same layout.
    ///
    /// # Errors
    /// An impossible schedule or partition; a warm-up whose minibatch differs from the run's.
    pub(super) fn segment_plan(
        &self,
        every: Option<u64>,
        done: u64,
        left: u64,
        partition: &Option<Partition>,
        layout: Option<&LayoutChange>,
    ) -> Result<(RunPlan, u64)> {
        let cfg = self.cfg;
        // Evaluations between epochs are drain points too, cut wherever the run runs.
        let mut this =
            segment_length(every, done, left).min(segment_length(cfg.eval_every, done, left));
        let warmup = cfg.remedies.sync_warmup;
        let policy = if done < warmup {
            this = this.min(warmup - done);
            Policy::OneFOneBFlush
        } else {
            cfg.schedule
        };
        let spec = match layout {
            Some(change) => change.spec(cfg.chunks, policy, this as u32),
            None => cfg.schedule_spec_of(policy, Length::Updates(this as u32)),
        };
        let plan = RunPlan::new(&self.model, &spec, partition.clone())?
            .with_bucket_size(cfg.bucket_size)
            .with_stage_buckets(&self.stage_buckets)
            .with_allreduce_wire(cfg.allreduce_wire);
        if u64::from(plan.schedule.resolved.minibatch) != self.minibatch {
            return Err(StageError::Config(format!(
                "a synchronous warm-up needs the same minibatch as {} ({} microbatches), but \
                 1f1b-flush on this layout takes {}: give every stage the same replica count",
                cfg.schedule, self.minibatch, plan.schedule.resolved.minibatch
            )));
        }
        Ok((plan, this))
    }

    /// Runs one segment's schedule (`plan`) of `seg.epoch` from minibatch `seg.done` on,
    /// creating the workers' state from `start` the first time, and reports each update to
    /// `obs` as soon as the last stage has computed all its losses. Where the segment keeps
    /// rollback points (`points`) and a replica is lost, it is taken over where every worker
    /// stands ([`super::adopt`]) when it can be: the failure taken over comes back with the
    /// outcomes.
    fn segment(
        &self,
        plan: &RunPlan,
        data: &Splits,
        seg: &Segment,
        (start, states): (&Start, &mut Vec<WorkerState>),
        obs: &mut dyn Observer,
        survival: SegmentSurvival<'_>,
    ) -> Result<SegmentRun> {
        let SegmentSurvival {
            faults,
            logs,
            rejoin,
            log_moved,
        } = survival;
        let (points, traffic) = (&logs.0, &logs.1);
        let cfg = self.cfg;
        let workers = plan.schedule.workers();
        let threads = worker_threads(cfg.threads, workers);
        let backend = |worker: u32| open_backend(cfg.backend, threads, worker);
        let (tx, rx) = crossbeam_channel::unbounded();
        self.with_setup(plan, data, (seg.epoch, seg.done), Some(&tx), |setup| {
            if states.is_empty() {
                *states = start.states(setup, cfg)?;
                obs.on_start_phase(super::StartPhase::FirstUpdate)?;
            }
            super::rollback::hand_to(points, states);
            let mut live = LiveSteps::new(self, plan, seg);
            let mut on_loss = |r: Report| live.add(r, obs);
            let progress = Some((
                rx.clone(),
                &mut on_loss as &mut dyn FnMut(Report) -> Result<()>,
            ));
            let settings = MeshSettings {
                wire: cfg.wire,
                timeout: Some(cfg.stall_timeout),
                ..MeshSettings::new(run_id(cfg.seed, seg.done))
            };
            let eps = thread_mesh(cfg.transport, workers, &settings)?
                .into_iter()
                .enumerate()
                .map(|(w, ep)| {
                    let ep: Endpoint = match faults {
                        Some((faults, at)) => Box::new(Faulty::new(ep, faults.of(w as u32, at))),
                        None => ep,
                    };
                    // An endpoint that passes tensors as they are (threads over an f32 wire:
                    // a move, no copy) is not logged. Its log would copy every message, which
                    // cost this run 1.5x its wall time (docs/reliability.md, "In process");
                    // nor can a device tensor passed so be kept. A loss is then taken over
                    // only where no message a log would hold is needed, and otherwise goes
                    // back to the latest step every stage passed.
                    match (points.get(w), traffic.get(w)) {
                        (Some(p), Some(t)) if log_moved || !ep.carries_device_tensors() => {
                            Box::new(Logging::new(ep, t.clone(), p.clone())) as Endpoint
                        }
                        _ => ep,
                    }
                })
                .collect();
            let failure = match run_threads_reporting(setup, states, eps, backend, progress) {
                Ok(outcomes) => return Ok((outcomes, None)),
                Err(e) => e,
            };
            let lost = match &failure {
                StageError::Worker { worker, .. } if !points.is_empty() => *worker,
                _ => return Err(failure),
            };
            // The states are the segment's start still: a failed worker keeps what it began with.
            let own = points
                .get(lost as usize)
                .and_then(|p| p.lock().ok().map(|p| p.latest()));
            let Ok(mut takeover) =
                take_over(setup, (lost, own), states, (points, traffic), cfg.wire)
            else {
                return Err(failure);
            };
            // A replacement comes: it joins at the next update boundary, not the segment's end.
            if rejoin {
                takeover.cut_short(plan)?;
            }
            let eps: Vec<Serving<Endpoint>> = thread_mesh(cfg.transport, workers, &settings)?
                .into_iter()
                .zip(std::mem::take(&mut takeover.kept))
                .map(|(ep, kept)| Serving::new(ep, kept))
                .collect();
            let progress = Some((rx, &mut on_loss as &mut dyn FnMut(Report) -> Result<()>));
            // Each resume (its stash) is moved into its worker; the figures read its version.
            let resumes = std::mem::take(&mut takeover.resumes);
            let versions: Vec<u32> = resumes.iter().map(|r| r.point.version).collect();
            let after = run_threads_resumed(
                setup,
                &mut takeover.states,
                (eps, backend),
                progress,
                resumes,
            )?;
            let outcomes = measured_through(plan, (lost, &versions), points, after)?;
            for (st, taken) in states.iter_mut().zip(takeover.states) {
                st.stages = taken.stages;
            }
            let taken_over = TakenOver {
                failure,
                in_flight: takeover.in_flight,
                ran: takeover.ends_at,
            };
            Ok((outcomes, Some(taken_over)))
        })
    }

    /// The whole model's optimizer state after a segment, from replica 0 of each stage, with
    /// each layer's update count.
    pub(super) fn optimizer_of(
        plan: &RunPlan,
        states: &[WorkerState],
    ) -> Result<(OptimizerState, Vec<u64>)> {
        let mut optimizer = Vec::new();
        let mut steps = Vec::new();
        for st in first_replicas(plan, states)? {
            steps.extend(st.params.iter().map(|_| st.opt.steps()));
            optimizer.extend(st.opt.state());
        }
        Ok((optimizer, steps))
    }

    /// Writes the checkpoint of the whole model's `params` and `optimizer` state after `done`
    /// updates of `plan`'s layout into `policy`'s directory (the one place both pipelined
    /// trainers save): returns its directory. `params` are lent to the checkpoint while it is
    /// written and handed back, so that no copy of the model is made for it.
    ///
    /// # Errors
    /// As [`crate::checkpoint::write`].
    pub(super) fn save(
        &self,
        plan: &RunPlan,
        done: u64,
        params: &mut Params,
        optimizer: (OptimizerState, Vec<u64>),
        policy: &CheckpointPolicy,
    ) -> Result<PathBuf> {
        let lent = std::mem::take(params);
        let ckpt = self.checkpoint_of(plan, done, lent, optimizer, policy);
        let written = crate::checkpoint::write(&policy.dir, &self.model, &ckpt, policy.keep);
        *params = ckpt.params;
        written
    }

    /// The checkpoint of the whole model's `params` and `optimizer` state (with each layer's
    /// update count) after `done` updates of `plan`'s layout.
    fn checkpoint_of(
        &self,
        plan: &RunPlan,
        done: u64,
        params: Params,
        (optimizer, steps): (OptimizerState, Vec<u64>),
        policy: &CheckpointPolicy,
    ) -> Checkpoint {
        let cfg = self.cfg;
        let mut state = RunState::identity(cfg, policy.settings.clone());
        state.updates = done;
        state.epoch = done / self.per_epoch + 1;
        state.samples_in_epoch =
            (done % self.per_epoch) * self.minibatch * cfg.microbatch_size as u64;
        state.optimizer_steps = steps;
        state.partition = plan.partition.to_string();
        state.replicas = plan.schedule.layout().replica_counts().to_vec();
        Checkpoint {
            params,
            optimizer,
            state,
        }
    }

    /// Epoch `epoch`'s sample order, computed once and shared by its segments.
    fn epoch_order(&self, data: &Splits, epoch: u64) -> Arc<Vec<u32>> {
        let mut memo = self
            .order
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match &*memo {
            Some((e, order)) if *e == epoch => order.clone(),
            _ => {
                let order = Arc::new(data.train.epoch_order(
                    self.cfg.seed,
                    epoch,
                    self.cfg.data_order,
                ));
                *memo = Some((epoch, order.clone()));
                order
            }
        }
    }

    /// Calls `f` with the [`Setup`] of one epoch's schedule (`plan`) from minibatch `done` on:
    /// the epoch's sample order, the learning rate of each stage's updates, dropout offsets.
    pub(super) fn with_setup<R>(
        &self,
        plan: &RunPlan,
        data: &Splits,
        (epoch, done): (u64, u64),
        progress: Option<&crossbeam_channel::Sender<Report>>,
        f: impl FnOnce(&Setup<'_>) -> R,
    ) -> R {
        let cfg = self.cfg;
        // The data cursor: the updates of this epoch already done (by earlier segments, or
        // before the checkpoint this run resumed from).
        let in_epoch = done - (epoch - 1) * self.per_epoch;
        let order = self.epoch_order(data, epoch);
        let skip = (in_epoch * self.minibatch) as usize * cfg.microbatch_size;
        let source = OrderedSource {
            data: &data.train,
            first: skip.min(order.len()),
            order,
            size: cfg.microbatch_size,
        };
        let res = &plan.schedule.resolved;
        // Update k of a stage is global step `done + (k-th update's first microbatch) /
        // minibatch`: the schedule's LR at that step.
        let scaling = cfg.remedies.lr_scaling;
        let delays = match scaling {
            LrScaling::None => Vec::new(),
            _ => stage_delays(res, &plan.versions),
        };
        let lr = |stage: u32, k: u32| -> f32 {
            let mb = u64::from(k) * u64::from(res.update_size(stage));
            let step = done + mb / u64::from(res.minibatch);
            let base = self.lr.at(step);
            match delays.get(stage as usize) {
                Some(&tau) => base * scaling.factor(tau, step),
                None => base,
            }
        };
        let setup = Setup::new(&self.model, plan, &source, &lr)
            .with_seed(cfg.seed)
            .with_microbatch_offset(done * self.minibatch)
            .with_progress(progress)
            .with_prediction(cfg.remedies.prediction);
        f(&setup)
    }

    /// The validation pass of `--eval-every` after `steps` updates of `epoch`: the epoch end's
    /// evaluation of `params`, between epochs.
    fn evaluate_between(
        &self,
        params: &Params,
        data: &Splits,
        eval_be: &CpuBackend,
        (epoch, steps): (u64, u64),
    ) -> Result<EvalStats> {
        let (test_loss, test_accuracy) = self.evaluate(params, data, eval_be, steps)?;
        Ok(EvalStats {
            epoch,
            steps,
            test_loss,
            test_accuracy,
            elapsed_s: self.start.elapsed().as_secs_f64(),
        })
    }

    /// The test (validation) loss and accuracy of `params`, the weights after update `done`.
    ///
    /// # Errors
    /// [`StageError::NonFinite`] naming update `done` when the loss is not finite, and the
    /// layer whose output overflows with the largest parameter up to it
    /// ([`crate::train::first_overflow`]): weights that overflow the forward are a diverged
    /// run, which no run ends 0 with and no checkpoint holds (the epoch's evaluation comes
    /// before its checkpoint).
    fn evaluate(
        &self,
        params: &Params,
        data: &Splits,
        eval_be: &CpuBackend,
        done: u64,
    ) -> Result<(f64, f64)> {
        let (loss, accuracy) = evaluate(
            eval_be as &dyn Backend,
            &self.model,
            params,
            &data.test,
            crate::train::EVAL_BATCH,
        )?;
        if !loss.is_finite() {
            let batch = crate::train::EVAL_BATCH;
            let be = eval_be as &dyn Backend;
            let overflow =
                crate::train::first_overflow(be, &self.model, params, &data.test, batch)?
                    .map_or_else(String::new, |o| format!("; {o}"));
            return Err(StageError::NonFinite {
                what: format!("the test loss ({loss}) of the weights"),
                update: done,
                detail: overflow,
            });
        }
        Ok((loss, accuracy))
    }

    /// The end of an epoch on the chief: its figures (with the test loss and accuracy its
    /// drain point evaluated), reported to `obs`.
    pub(super) fn finish_epoch(
        &self,
        ended: &EpochEnd<'_>,
        obs: &mut dyn Observer,
    ) -> Result<EpochStats> {
        let (loss, samples) = ended.outcomes.iter().fold((0.0f64, 0usize), |(l, n), o| {
            (l + o.loss_sum, n + o.samples)
        });
        let train_loss = loss / samples.max(1) as f64;
        // Loss rows: samples, or tokens of a language model.
        let samples = samples / self.targets;
        let (test_loss, test_accuracy) = ended.test;
        let e = EpochStats {
            epoch: ended.epoch,
            train_loss,
            test_loss,
            test_accuracy,
            samples_per_sec: samples as f64 / ended.secs.max(1e-9),
            tokens_per_sec: crate::train::tokens_per_sec(
                samples as f64 / ended.secs.max(1e-9),
                self.targets,
            ),
            elapsed_s: self.start.elapsed().as_secs_f64(),
            steps: ended.done,
            // One worker over the whole model (no pipeline flag) reports no stages, as a
            // pipeline of one has no utilisation or staleness to speak of.
            stages: if self.cfg.pipelined {
                let per_process = self.cfg.placement == crate::config::Placement::Processes;
                stage_stats(
                    &ended.plan.schedule,
                    ended.outcomes,
                    ended.secs,
                    per_process,
                )
            } else {
                Vec::new()
            },
        };
        obs.on_epoch(&e)?;
        Ok(e)
    }
}

/// A run id for one epoch's QUIC mesh: unique to this process and moment, so that peers of
/// another run (or an earlier epoch) on the same ports are refused; never part of the
/// numerics.
fn run_id(seed: u64, epoch: u64) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    seed.rotate_left(17) ^ epoch.rotate_left(41) ^ u64::from(std::process::id()) ^ now
}

/// Each stage's utilisation and measured staleness over an epoch of `secs`, and where each
/// worker is its own process (`per_process`), its workers' peak resident memory.
fn stage_stats(
    schedule: &Schedule,
    outcomes: &[WorkerOutcome],
    secs: f64,
    per_process: bool,
) -> Vec<StageEpochStats> {
    let layout = schedule.layout();
    (0..schedule.stages())
        .map(|s| {
            let group: Vec<u32> = layout.group(s).collect();
            let busy: f64 = group.iter().map(|&w| outcomes[w as usize].compute_s).sum();
            let (st_sum, st_n) = group.iter().fold((0.0, 0u64), |(a, n), &w| {
                (
                    a + outcomes[w as usize].staleness_sum,
                    n + outcomes[w as usize].staleness_count,
                )
            });
            StageEpochStats {
                stage: s,
                // A worker holding several chunks counts its time once per chunk; divide by
                // chunks so the figure stays a share of the worker's time.
                utilisation: busy
                    / (group.len() as f64 * secs.max(1e-9))
                    / f64::from(layout.chunks()),
                staleness: st_sum / st_n.max(1) as f64,
                peak_resident_bytes: per_process
                    .then(|| {
                        let peaks = group
                            .iter()
                            .map(|&w| outcomes[w as usize].peak_resident_bytes);
                        peaks.max().unwrap_or(0)
                    })
                    .filter(|&b| b > 0),
                peak_device_bytes: group
                    .iter()
                    .map(|&w| outcomes[w as usize].peak_device_bytes)
                    .max()
                    .filter(|&b| b > 0),
                buffers_lent: Some(
                    group
                        .iter()
                        .map(|&w| outcomes[w as usize].buffers_lent)
                        .sum(),
                )
                .filter(|&n| n > 0),
            }
        })
        .collect()
}

/// Replica 0's state of every stage, in stage order.
fn first_replicas<'s>(plan: &RunPlan, states: &'s [WorkerState]) -> Result<Vec<&'s StageState>> {
    let layout = plan.schedule.layout();
    (0..plan.schedule.stages())
        .map(|s| {
            let w = layout.worker_for(s, 0);
            states[w as usize]
                .stages
                .iter()
                .find(|x| x.stage == s)
                .ok_or_else(|| StageError::Executor(format!("stage {s} missing on worker {w}")))
        })
        .collect()
}

/// The whole model's weights, from replica 0 of each stage.
pub fn assemble(plan: &RunPlan, states: &[WorkerState]) -> Result<Params> {
    let mut out: Params = Vec::new();
    for st in first_replicas(plan, states)? {
        out.extend(st.params.iter().cloned());
    }
    Ok(out)
}

/// Worker `worker`'s backend: the CPU with `threads` threads, or CUDA device
/// `worker mod visible devices`, so that workers spread over a host's GPUs in rank order.
///
/// # Errors
/// The backend's own: a build without CUDA, no driver or device, a CPU thread pool that does
/// not start.
pub fn open_backend(
    kind: BackendKind,
    threads: usize,
    worker: u32,
) -> std::result::Result<Box<dyn Backend>, pipe_kernels::KernelError> {
    let ordinal = match kind {
        BackendKind::Cpu(_) => 0,
        BackendKind::Cuda(_) => worker as usize % pipe_kernels::cuda::device_count()?,
    };
    kind.open(threads, ordinal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paced_segments_start_at_one_update_and_follow_the_last_pace() {
        let mut pace = Pace::default();
        assert_eq!(pace.cap(), 1);
        pace.record(0, 5.0, 5.0);
        assert_eq!(pace.cap(), 1, "an empty segment says nothing");
        pace.record(1, 0.001, 0.001);
        assert_eq!(pace.cap(), 250);
        pace.record(250, 2.5, 2.5);
        assert_eq!(pace.cap(), 25);
        pace.record(25, 50.0, 50.0);
        assert_eq!(pace.cap(), 1, "slow updates: one per segment");
        pace.record(10, 0.0, 0.0);
        assert!(pace.cap() > 1000);
        // Without the workers' figures, the whole segment counts as updates.
        pace.record(250, 2.5, 0.0);
        assert_eq!(pace.cap(), 25);
    }

    /// A start costing a second (GPT-2 on a GPU backend: 1.2 s a segment of one 30 ms
    /// update) grows the next segment to a hundred times that, not to a quarter of a second.
    #[test]
    fn a_costly_segment_start_lengthens_the_segments() {
        let mut pace = Pace::default();
        pace.record(1, 1.2, 0.03);
        let cap = pace.cap();
        assert!((3_000..=4_000).contains(&cap), "{cap}");
        // A start that costs a millisecond keeps the quarter-second segments.
        pace.record(1, 0.011, 0.010);
        assert_eq!(pace.cap(), 25);
    }

    #[test]
    fn one_worker_takes_every_core_and_shared_workers_one_each() {
        assert_eq!(worker_threads(0, 1), 0);
        assert_eq!(worker_threads(0, 8), 1);
        assert_eq!(worker_threads(3, 1), 3);
        assert_eq!(worker_threads(3, 8), 3);
    }
}
