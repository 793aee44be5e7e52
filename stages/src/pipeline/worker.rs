//! One worker of a run in this process, the others in other processes or on other hosts,
//! reached through one transport endpoint for the whole run (`pipe worker`). Rank 0 is the
//! *chief*: it settles what every worker must agree on, and at the end of every segment (an
//! epoch, or the stretch up to the next checkpoint) gathers what the in-process trainer reads
//! from shared memory: each worker's summary, and when it evaluates or checkpoints, the
//! weights and optimizer state of replica 0 of every stage. It evaluates, reports and writes
//! the checkpoints.
//!
//! Everything between workers travels as [`Kind::Control`] messages, so it needs nothing a
//! transport does not already offer:
//!
//! | topic | from -> to | index | carries |
//! |---|---|---|---|
//! | [`TOPIC_START`] | chief -> each | 0 | the run's numerics, partition, checkpoint interval, start (JSON) |
//! | [`TOPIC_RESUME`] | chief -> each | layer | a resumed run's weights and optimizer state (step 0-3) |
//! | [`TOPIC_LOSS`] | last stage -> chief | segment | one microbatch's loss, as computed (step: its number) |
//! | [`TOPIC_SUMMARY`] | each -> chief | segment | losses, compute time, staleness |
//! | [`TOPIC_GO`] | chief -> each | segment | the request: weights? optimizer? stop? a replacement rejoins? (step 0); go on to the next segment (step 1) |
//! | [`TOPIC_WEIGHTS`] | replica 0 of a stage -> chief | segment | one layer's weights (step: layer) |
//! | [`TOPIC_OPTIMIZER`] | replica 0 of a stage -> chief | segment | one layer's optimizer state, part k of 3 (step: 3 layer + k) |
//! | [`TOPIC_JOIN`] | chief, a surviving replica -> a replacement | 0, layer | the run's terms (step 0); one layer's weights and optimizer state (step 1-4, version: the update count) |
//!
//! The start exchange refuses a worker whose resolved run differs from the chief's (flags and
//! config must be the same everywhere, or the workers would run different programs), and
//! hands every worker the chief's cut when the partition is measured, so one machine's
//! profile decides it, and the chief's checkpoint interval, which decides where the pipeline
//! drains. The end-of-segment exchange is also a barrier: no worker starts a segment before
//! every worker has finished the previous one, so message keys, which restart with each
//! segment's schedule, never meet their predecessors. Only the chief reads the checkpoint a
//! run resumes from, and only the chief watches for a stop (Ctrl-C): it tells the others.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use pipe_kernels::Tensor;
use pipe_scheduler::Length;
use pipe_scheduler::planner::buckets::StageBuckets;
use pipe_transport::registration::Endpoint;
use pipe_transport::renumbered::Renumbered;
use pipe_transport::{Key, Kind, Message, Transport, TransportError};
use serde::{Deserialize, Serialize};

use super::adopt::{
    Logging, Serving, SharedTraffic, Traffic, end_at_step, resume_from, resume_taking,
};
use super::between::Between;
use super::doctor::StopReport;
use super::driver::{resume_worker_with, run_worker_with};
use super::exec::{WorkerOutcome, WorkerState};
use super::fields::Fields;
use super::in_place::{AdoptJob, InPlace, Outcome, Pending, Recovering};
use super::rollback::Points;
use super::run_plan::RunPlan;
use super::setup::Report;
use super::survive::LayoutChange;
use super::train::{
    Coordinator, Drain, Drained, LiveSteps, LoopStart, Run, Segment, SegmentEnd, Start,
    run_partition, run_segments,
};
use crate::checkpoint::{Checkpoint, CheckpointPolicy};
use crate::config::{PartitionChoice, RunConfig};
use crate::data::Splits;
use crate::error::{Result, StageError};
use crate::model::Params;
use crate::optim::{Corrected, OptimizerState};
use crate::partition::Partition;
use crate::pipeline::Observer;
use crate::train::{RecoveryPhase, TrainReport};

/// Control topic: the chief's settings and partition, before the first epoch.
pub const TOPIC_START: u32 = 0;
/// Control topic: a worker's epoch summary.
pub const TOPIC_SUMMARY: u32 = 1;
/// Control topic: one layer's weights for the chief's evaluation.
pub const TOPIC_WEIGHTS: u32 = 2;
/// Control topic: the chief's request at the end of a segment (weights, optimizer state,
/// stop), which also releases the worker into the next segment.
pub const TOPIC_GO: u32 = 3;
/// Control topic: a replica 0's optimizer state for a checkpoint.
pub const TOPIC_OPTIMIZER: u32 = 4;

/// Tensors of an optimizer's state per parameter ([`crate::optim::ParamState::parts`]), each sent as one
/// message per layer.
const STATE_PARTS: usize = 3;
/// Control topic: a resumed run's weights and optimizer state, from the chief.
pub const TOPIC_RESUME: u32 = 5;
/// Control topic: one microbatch's loss, from the worker that computed it.
pub const TOPIC_LOSS: u32 = 6;

/// The chief's rank.
pub const CHIEF: u32 = 0;

/// Checkpoints, resume and stopping for [`train_worker`]. Only the chief's are read: it
/// writes the checkpoints, reads the one to resume from and decides when to stop; the other
/// workers follow it.
#[derive(Clone, Debug, Default)]
pub struct WorkerOptions {
    /// Write checkpoints (the chief, into its directory).
    pub checkpoints: Option<CheckpointPolicy>,
    /// Start from this checkpoint (the chief sends every worker its part).
    pub resume: Option<Checkpoint>,
    /// Set to stop at the next drain point, after a checkpoint.
    pub stop: Option<Arc<AtomicBool>>,
    /// How to go on in place after a lost replica (a launched worker: its launcher);
    /// `None`: a lost peer fails this worker's part of the run ([`super::recover`]).
    pub remesh: Option<super::recover::RemeshHandle>,
    /// Take a lost replica back at the first update boundary its replacement is ready for
    /// (`--rejoin`): the survivors run one update at a time while short.
    pub rejoin: bool,
    /// This worker replaces a lost replica in a run under way: it takes the run's terms
    /// from the chief and its stages' state from a surviving replica, not from a start.
    pub replacing: bool,
}

/// What the chief's run ends with.
#[derive(Debug)]
pub struct WorkerReport {
    /// The run's report.
    pub report: TrainReport,
    /// Checkpoints written, oldest first.
    pub checkpoints: Vec<PathBuf>,
    /// The run stopped early, asked to, after this many updates.
    pub stopped: Option<u64>,
}

/// Runs this process's worker (`ep.rank()`) of `cfg` over `ep`, whose peers run the same call
/// in their processes. The chief reports steps and epochs to `obs` and returns the run's
/// report; every other worker returns `None`. On failure this worker's peers are told
/// ([`Transport::abort`]); the caller closes `ep` either way.
///
/// # Errors
/// Settings that differ from the chief's, a mesh of the wrong size, worker failures naming
/// the worker and action, lost peers naming the rank, a non-finite loss or gradient, a
/// checkpoint that does not fit.
pub fn train_worker<T: Transport>(
    cfg: &RunConfig,
    data: &Splits,
    ep: &mut T,
    obs: &mut dyn Observer,
    opts: &WorkerOptions,
) -> Result<Option<WorkerReport>> {
    let mut stop = None;
    let result = run_process(cfg, data, ep, obs, opts, &mut stop);
    if let Err(e) = &result {
        if !e.is_abort_echo() {
            ep.abort();
        }
        // Where this worker's program stood, for a launcher's hang doctor: in the segment
        // that failed, or finished with it (waiting for the chief's word) when the failure
        // came after. The run has failed already; a report that cannot be written is lost.
        if let Some(report) = &stop {
            let _ = obs.on_stop(report);
        }
    }
    result
}

/// The chief's word to every follower at the end of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ChiefWord {
    /// What it wants from every worker, and whether the run stops or a lost replica rejoins.
    drain: Drain,
    /// The replacement that rejoins (with `drain.rejoin`).
    joining: Option<u32>,
    /// No replacement comes for the replica the run is short of after all: from the next
    /// segment on, segments take their usual length instead of one update.
    unreplaced: bool,
}

/// [`ChiefWord`] as it travels: what the chief wants from every worker (weights, optimizer
/// state), whether the run stops, whether a lost replica rejoins and whether none comes, one
/// byte each, then the rank of the replacement that rejoins (little-endian).
fn drain_bytes(word: ChiefWord) -> [u8; 9] {
    let d = word.drain;
    let flags = [d.weights, d.optimizer, d.stop, d.rejoin, word.unreplaced].map(u8::from);
    let rank = word.joining.filter(|_| d.rejoin).unwrap_or(0).to_le_bytes();
    let mut b = [0u8; 9];
    b[..5].copy_from_slice(&flags);
    b[5..].copy_from_slice(&rank);
    b
}

/// [`drain_bytes`] read back.
fn parse_drain(b: &[u8]) -> Result<ChiefWord> {
    match b {
        [w, o, s, r, u, rank @ ..]
            if rank.len() == 4 && [w, o, s, r, u].iter().all(|&&x| x <= 1) =>
        {
            let mut word = [0u8; 4];
            word.copy_from_slice(rank);
            let drain = Drain {
                weights: *w == 1,
                optimizer: *o == 1,
                stop: *s == 1,
                rejoin: *r == 1,
            };
            Ok(ChiefWord {
                drain,
                joining: drain.rejoin.then_some(u32::from_le_bytes(word)),
                unreplaced: *u == 1,
            })
        }
        _ => Err(protocol(format!(
            "a malformed request from the chief: {b:?}"
        ))),
    }
}

/// The run's layout, which must have one worker per rank of the cluster: checked by every
/// worker before it connects (`pipe worker`), and again on the endpoint it connected.
///
/// # Errors
/// [`StageError::Config`] naming both counts; a layout the schedule refuses.
pub fn check_cluster_size(cfg: &RunConfig, size: u32) -> Result<pipe_scheduler::Layout> {
    let layout = cfg.resolved()?.layout.clone();
    if layout.workers() != size {
        return Err(StageError::Config(format!(
            "this run needs {} workers ({} stages x replicas {:?}) but the cluster has {size}",
            layout.workers(),
            layout.stages(),
            layout.replica_counts(),
        )));
    }
    Ok(layout)
}

/// A worker other than the chief at the end of segment `index`: sends its summary, waits for
/// the chief's request and sends the weights and optimizer state it asks for. Returns the
/// chief's word.
fn report_to_chief<T: Transport + ?Sized>(
    ep: &mut T,
    outcome: &WorkerOutcome,
    (plan, mine): (&RunPlan, &WorkerState),
    index: u32,
) -> Result<ChiefWord> {
    let rank = ep.rank();
    ep.send(Message::from_bytes(
        control(rank, CHIEF, TOPIC_SUMMARY, index, 0),
        &encode_summary(outcome),
    ))?;
    let req = ep.recv(&control(CHIEF, rank, TOPIC_GO, index, GO_REQUEST))?;
    let word = parse_drain(&req.into_bytes()?)?;
    send_state(ep, (plan, mine), index, &word.drain)?;
    ep.recv(&control(CHIEF, rank, TOPIC_GO, index, GO_ON))?;
    Ok(word)
}

/// Steps of [`TOPIC_GO`]: the chief's request at the end of a segment, and its word, once
/// every follower has answered it, that they may start the next.
const GO_REQUEST: u32 = 0;
/// See [`GO_REQUEST`].
const GO_ON: u32 = 1;

/// Sends every follower `bytes` under [`TOPIC_GO`] and `step`, to each one even after a send
/// failed; returns the first failure.
fn tell_followers<T: Transport + ?Sized>(
    ep: &mut T,
    index: u32,
    step: u32,
    bytes: &[u8],
) -> Option<StageError> {
    let mut first = None;
    for w in (0..ep.size()).filter(|&w| w != CHIEF) {
        let sent = ep.send(Message::from_bytes(
            control(CHIEF, w, TOPIC_GO, index, step),
            bytes,
        ));
        if let Err(e) = sent {
            first.get_or_insert(StageError::from(e));
        }
    }
    first
}

fn run_process<T: Transport>(
    cfg: &RunConfig,
    data: &Splits,
    ep: &mut T,
    obs: &mut dyn Observer,
    opts: &WorkerOptions,
    stop: &mut Option<StopReport>,
) -> Result<Option<WorkerReport>> {
    let rank = ep.rank();
    let chief = rank == CHIEF;
    // The worker's start, by the system clock and by the monotonic one, for its spans.
    let origin = (std::time::SystemTime::now(), Instant::now());
    let mut run = Run::new(cfg, data)?;
    check_cluster_size(cfg, ep.size())?;
    if chief {
        obs.on_training_began(run.began)?;
    }
    let (settled, start, index) = if opts.replacing {
        receive_join(cfg, &mut run, ep)?
    } else {
        let agreed = agree(cfg, &run, ep, opts)?;
        run.stage_buckets.clone_from(&agreed.buckets);
        let settled = Settled {
            partition: agreed.partition.clone(),
            every: agreed.every,
        };
        (settled, receive_start(&run, ep, agreed, cfg)?, 0)
    };
    let (partition, every) = (settled.partition.clone(), settled.every);
    let be = super::train::open_backend(cfg.backend, cfg.threads.max(1), ep.rank())?;
    let from = LoopStart {
        done: start.done,
        // The latest weights are the chief's to keep (it evaluates and checkpoints them); a
        // follower holds its own stages' only, in its state.
        params: if chief {
            start.params.clone()
        } else {
            Params::new()
        },
        partition: &partition,
        every,
        // Worker processes run a pipeline, whose cuts are drains that change its numerics.
        pace: None,
        checkpoints: opts.checkpoints.as_ref(),
        stop: opts.stop.as_ref(),
        rejoin: opts.rejoin,
    };
    let mut me = Process {
        run: &run,
        data,
        ep,
        renewed: None,
        remesh: opts.remesh.clone(),
        hosted: None,
        taken_over: None,
        be,
        start: Some(start),
        state: None,
        index,
        settled,
        joining: None,
        replacement_coming: true,
        pending: None,
        drained_from: None,
        last_logs: (None, None),
        origin,
        stop,
    };
    let end = run_segments(&run, &mut me, data, from, obs);
    // The survivors' mesh of a replica lost in place ends here; the caller closes its own.
    let hosted = me.hosted.take().map(|h| h.close(end.is_ok()));
    if let Some(ep) = me.renewed.as_mut() {
        match &end {
            Ok(_) => ep.close()?,
            Err(e) if !e.is_abort_echo() => ep.abort(),
            Err(_) => {}
        }
    }
    if let Some(closing) = hosted {
        let _ = closing.join();
    }
    let end = end?;
    Ok(chief.then_some(WorkerReport {
        report: TrainReport {
            epochs: end.epochs,
            params: end.params,
            steps: end.done,
        },
        checkpoints: end.written,
        stopped: end.stopped,
    }))
}

/// A worker process's side of the segment loop: it runs its own worker; the chief gathers
/// the others' summaries, weights and optimizer state as messages.
struct Process<'a, T: Transport> {
    run: &'a Run<'a>,
    data: &'a Splits,
    ep: &'a mut T,
    /// The survivors' mesh once a replica was lost in place, used instead of `ep` from then
    /// on ([`super::recover`]).
    renewed: Option<Box<dyn Transport>>,
    /// How to go on in place after a lost replica.
    remesh: Option<super::recover::RemeshHandle>,
    /// A lost rank's endpoint this worker hosts in the survivors' mesh ([`super::takeover`]),
    /// kept open while that mesh is in use.
    hosted: Option<Hosted>,
    /// The layout change of a replica lost in the last segment and taken over, to make at the
    /// segment's end ([`Coordinator::taken_over`]).
    taken_over: Option<LayoutChange>,
    be: Box<dyn pipe_kernels::Backend>,
    /// Where the run starts; its weights also shape what the chief gathers. A follower lets
    /// it go once its state holds its stages (the weights live on there).
    start: Option<Start>,
    state: Option<WorkerState>,
    /// Segments run so far (the end-of-segment messages' key).
    index: u32,
    /// What the chief settled at the start, which a replacement is handed.
    settled: Settled,
    /// The replacement of a lost replica that rejoins at this segment's end (its rank).
    joining: Option<u32>,
    /// The launcher starts a replacement for the replica last lost in place.
    replacement_coming: bool,
    /// How far a recovery where this worker stood got before its program failed after all
    /// ([`super::in_place`]): where [`Process::after_failure`] goes on from.
    pending: Option<Pending>,
    /// On the chief, between a segment's end and the drain after it: the segment's rollback
    /// points and place, which a loss in the drain's exchange goes on from
    /// ([`Coordinator::drain`]).
    drained_from: Option<(super::rollback::Kept, Segment)>,
    /// This worker's rollback points and traffic log of its last segment, whose buffers its
    /// next segment's take once nothing else holds them ([`Process::reusable_logs`]).
    last_logs: LastLogs,
    origin: (std::time::SystemTime, Instant),
    /// Where this worker's program stood at the end of its last segment, for the hang doctor.
    stop: &'a mut Option<StopReport>,
}

/// This worker's state, once its first segment has made it.
fn mine(state: &Option<WorkerState>) -> Result<&WorkerState> {
    state
        .as_ref()
        .ok_or_else(|| StageError::Executor("a worker without state".into()))
}

/// The mesh a worker process runs on: its own, or the survivors' once a replica was lost in
/// place.
fn current<'e, T: Transport>(
    ep: &'e mut T,
    renewed: &'e mut Option<Box<dyn Transport>>,
) -> &'e mut (dyn Transport + 'e) {
    match renewed {
        Some(ep) => ep.as_mut(),
        None => ep,
    }
}

/// A lost rank's endpoint that this worker hosts after taking its segment over
/// ([`super::takeover`]).
enum Hosted {
    /// The lost program's end-of-segment exchange with the chief, on a thread of its own;
    /// the endpoint comes back when it ends.
    Ending(std::thread::JoinHandle<Result<Endpoint>>),
    /// Idle, kept open while the survivors' mesh is in use: its peers would take its close
    /// for a loss.
    Idle(Endpoint),
}

impl Hosted {
    /// The adopted program of segment `index` of `plan`, `ended` (its endpoint, state and
    /// figures): its end-of-segment exchange with the chief, on a thread of its own. Its
    /// figures before its boundary went with the lost worker; the chief has its losses from
    /// its reports.
    fn ending(plan: &RunPlan, index: u32, ended: (Endpoint, WorkerState, WorkerOutcome)) -> Self {
        let (mut hosted, st, out) = ended;
        let plan = plan.clone();
        Hosted::Ending(std::thread::spawn(move || {
            report_to_chief(&mut hosted, &out, (&plan, &st), index)?;
            Ok(hosted)
        }))
    }

    /// The endpoint, once the exchange has ended.
    ///
    /// # Errors
    /// The lost program's end-of-segment exchange failed.
    fn idle(self) -> Result<Endpoint> {
        match self {
            Hosted::Idle(ep) => Ok(ep),
            Hosted::Ending(h) => h.join().map_err(|_| {
                StageError::Executor("the lost program's end-of-segment exchange panicked".into())
            })?,
        }
    }

    /// Closes it (or aborts it, unless `cleanly`) on a thread of its own, beside this
    /// worker's own endpoint's close, which waits for every peer's.
    fn close(self, cleanly: bool) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            if let Ok(mut ep) = self.idle() {
                if cleanly {
                    let _ = ep.close();
                } else {
                    ep.abort();
                }
            }
        })
    }
}

/// What a worker process holds of a segment whose part failed.
struct Failure<'f, 'r> {
    /// Every worker's rollback points (this worker's filled).
    points: &'f super::rollback::Kept,
    /// This worker's state is still the segment's start (its program failed), not its end
    /// (the exchange after it did).
    at_start: bool,
    /// This worker's traffic log, where one was kept.
    traffic: Option<&'f SharedTraffic>,
    /// Its loss relay, the reports its program sent it, and where they are sent (none once
    /// the segment's own exchanges are over: the drain after it failed).
    relay: Option<(
        &'f mut LossRelay<'r>,
        &'f crossbeam_channel::Receiver<Report>,
        &'f crossbeam_channel::Sender<Report>,
    )>,
}

impl<T: Transport> Process<'_, T> {
    /// After this worker's part of segment `at` of `plan` failed with `err`: goes on in place
    /// where its launcher names a lost replica the run can do without, else returns `err`.
    /// The segment is taken over where every worker stands where it can be
    /// ([`super::takeover`]); else the run goes back to the latest step every stage passed
    /// ([`super::recover`]).
    fn after_failure(
        &mut self,
        plan: &RunPlan,
        at: &Segment,
        err: StageError,
        failed: Failure<'_, '_>,
        obs: &mut dyn Observer,
    ) -> Result<SegmentEnd> {
        let (Some(handle), Some(start)) = (self.remesh.clone(), &self.state) else {
            return Err(err);
        };
        // Nothing to go on without: no stage has a second replica.
        if err.diverged_at().is_some() || err.is_bad_input() || !super::survive::could_survive(plan)
        {
            return Err(err);
        }
        let ep = current(&mut *self.ep, &mut self.renewed);
        let rank = ep.rank();
        // Where the recovery where this worker stood got to: its endpoint was aborted, the
        // launcher asked, and perhaps the mesh connected and the takeover found unplanned.
        let pending = self.pending.take();
        if pending.is_none() && !err.is_abort_echo() {
            ep.abort();
        }
        let mut remesh = handle.0.lock().map_err(|_| {
            StageError::Executor("the way to the launcher was left poisoned".into())
        })?;
        let (word, meshed, unplanned) = match pending {
            Some(p) => (p.word, p.meshed, p.unplanned),
            // A launcher gone cannot be told: the failure is then the program's own.
            None if super::processes::RecordWriter::recovery(RecoveryPhase::Stopped).is_err() => {
                return Err(err);
            }
            None => (remesh.lost(super::recover::LAUNCHER_WORD_WAIT), None, false),
        };
        let Some(word) = word else {
            return Err(err);
        };
        let (lost, how, replaced) = (word.rank, word.how, word.replaced);
        self.replacement_coming = replaced;
        let Some(change) = LayoutChange::without(self.run.cfg, lost, how, at.done) else {
            return Err(err);
        };
        let own = failed
            .points
            .get(rank as usize)
            .ok_or_else(|| StageError::Executor("a worker without rollback points".into()))?;
        let clips = start
            .stages
            .iter()
            .any(|st| st.opt.optimizer().config().grad_clip.is_some());
        let adopter = super::adopt::adopter_of(plan, lost).ok();
        // This worker can resume where it stands: its program failed (its state is the
        // segment's start), its traffic was logged, and the run's exchanges are all logged.
        let traffic = failed
            .traffic
            .filter(|_| failed.at_start)
            .filter(|_| super::adopt::refused(plan, &self.run.model, clips).is_none());
        let host = traffic.is_some() && adopter == Some(rank);
        let regrouping = current(&mut *self.ep, &mut self.renewed);
        let points = own.lock().map_err(|_| super::rollback::poisoned())?;
        let meshes = match meshed {
            Some(m) => m,
            None => {
                let m = remesh.connect_without(regrouping, lost, (adopter, host))?;
                super::processes::RecordWriter::recovery(RecoveryPhase::Meshed)?;
                m
            }
        };
        drop(remesh);
        self.hosted = meshes.hosted.map(Hosted::Idle);
        let mut ep = meshes.ep;
        // The adopter hosts the lost rank where it can take the segment over; then every
        // survivor settles with it whether they do (unless they did).
        if meshes.lost_hosted && !unplanned {
            let held = match traffic {
                Some(log) => Some(
                    log.lock()
                        .map_err(|_| super::rollback::poisoned())?
                        .held(points.latest()),
                ),
                None => None,
            };
            let adopting = host.then_some((&*points, start));
            let planned =
                super::takeover::settle(ep.as_mut(), (plan, self.index), lost, held, adopting)?;
            drop(points);
            if let Some(planned) = planned {
                super::processes::RecordWriter::recovery(RecoveryPhase::Planned)?;
                // A replacement comes: the segment ends at its update in flight, where the
                // replacement can join, and not at its end.
                let ends_at = super::adopt::takeover_ends_at(plan, &planned.versions, replaced);
                let in_flight = super::adopt::update_in_flight(plan, &planned.versions);
                let adopted = Adopted {
                    lost,
                    change: change.taken_over(ends_at, in_flight),
                    planned,
                    ends_at,
                };
                return self.run_taken_over(plan, at, (ep, adopted), failed, obs);
            }
        } else {
            drop(points);
        }
        let gone_on = super::recover::Failed {
            plan,
            len: at.len,
            index: self.index,
            worker: rank,
            start: failed.at_start.then_some(start),
            points: own,
        };
        let gone = super::recover::go_on(ep, lost, change, gone_on)?;
        self.gone_on(plan, gone)
    }

    /// Once the survivors settled where they go on ([`super::recover::go_on`]): the figures
    /// over the steps that stand gathered, the new mesh and this worker's state there taken
    /// on, and the segment's end that says so.
    ///
    /// # Errors
    /// A survivor that fails the gathering.
    fn gone_on(&mut self, plan: &RunPlan, mut gone: super::recover::GoneOn) -> Result<SegmentEnd> {
        let standing = if gone.behind {
            // It goes on as though it had begun the chief's segment, which runs again.
            self.index += 1;
            Some(Vec::new())
        } else {
            standing_after(&mut gone, plan.schedule.workers(), self.index)?
        };
        self.renewed = Some(gone.ep);
        self.state = Some(gone.state);
        Ok(SegmentEnd::Relayout((gone.change, standing)))
    }
}

impl<T: Transport> Process<'_, T> {
    /// After a segment run where this worker could go on where it stood after a loss
    /// ([`run_standing`]): where it did, the mesh it went on over, the layout change to make
    /// at the segment's end, and on the adopter, the lost program's end-of-segment exchange,
    /// are this worker's from now on, and `true` is returned; where its recovery stopped part
    /// way, the failure's recovery goes on from there ([`Process::after_failure`]).
    ///
    /// # Errors
    /// The recovery's own failure, or the adopted program's.
    fn after_standing(&mut self, plan: &RunPlan, stood: StoodEnd) -> Result<bool> {
        let recovered = match stood.outcome {
            Outcome::Untouched => return Ok(false),
            Outcome::Failed(e) => return Err(e),
            Outcome::Pending(p) => {
                self.pending = Some(p);
                return Ok(false);
            }
            Outcome::Recovered(r) => r,
        };
        let renewed = stood
            .renewed
            .ok_or_else(|| StageError::Executor("a recovery without its mesh".into()))?;
        self.renewed = Some(renewed);
        self.replacement_coming = false;
        self.taken_over = Some(recovered.change);
        // The lost rank's endpoint of an earlier loss served the mesh just left.
        self.hosted = None;
        if let Some(adopted) = stood.adopted {
            self.hosted = Some(Hosted::ending(plan, self.index, adopted?));
        }
        Ok(true)
    }
}

/// XORed into the stage of every data key on the survivors' mesh after a takeover
/// ([`Renumbered::tagging_data`]).
const TAKEN_OVER_TAG: u32 = 1 << 31;

/// A segment taken over after a loss ([`super::takeover`]).
struct Adopted {
    /// The lost worker.
    lost: u32,
    /// The layout change, made at the segment's end.
    change: LayoutChange,
    /// The version each worker resumes at, and what this worker need not hand over.
    planned: super::takeover::Planned,
    /// The steps of the segment it runs to ([`super::adopt::takeover_ends_at`]).
    ends_at: u64,
}

/// A worker's figures when it passed the step boundary where its stage was at `version`,
/// from its rollback `points` (none measured at the segment's start).
fn measured_at_version(
    plan: &RunPlan,
    worker: u32,
    version: u32,
    points: &Points,
) -> Result<WorkerOutcome> {
    match super::adopt::steps_at_version(plan, worker, version) {
        0 => Ok(WorkerOutcome::default()),
        step => points.measured_at(step).ok_or_else(|| {
            StageError::Executor(format!(
                "worker {worker}'s figures at step {step} are no longer kept"
            ))
        }),
    }
}

impl<T: Transport> Process<'_, T> {
    /// Runs the rest of segment `at` of `plan` taken over (`adopted`) over `ep`, the mesh of
    /// every rank: this worker's own program from its boundary, and on the adopter the lost
    /// worker's too, on a thread of its own; then ends the segment as any segment ends. The
    /// layout changes after the drain ([`Coordinator::taken_over`]).
    fn run_taken_over(
        &mut self,
        plan: &RunPlan,
        at: &Segment,
        (mut ep, adopted): (Box<dyn Transport>, Adopted),
        failed: Failure<'_, '_>,
        obs: &mut dyn Observer,
    ) -> Result<SegmentEnd> {
        let (run, index) = (self.run, self.index);
        let me = ep.rank();
        let lost = adopted.lost;
        let (losses, rx, tx) = failed
            .relay
            .ok_or_else(|| StageError::Executor("a takeover without its loss relay".into()))?;
        let start = mine(&self.state)?;
        let mut points = failed
            .points
            .get(me as usize)
            .ok_or_else(|| StageError::Executor("a worker without rollback points".into()))?
            .lock()
            .map_err(|_| super::rollback::poisoned())?;
        let version = |w: u32| {
            let versions = &adopted.planned.versions;
            versions.get(w as usize).copied().unwrap_or(0)
        };
        // The adopter's lost program copies its stage's state from the points; its own
        // program then moves it out (replicas agree at every step boundary).
        let mut lost_part = match self.hosted.take() {
            Some(h) => {
                let (mut r, s) = resume_from(plan, lost, version(lost), (&*points, start))?;
                end_at_step(plan, lost, &mut r, adopted.ends_at)?;
                Some((h.idle()?, r, s))
            }
            None => None,
        };
        let (mut resume, mut state) = resume_taking(plan, me, version(me), (&mut *points, start))?;
        end_at_step(plan, me, &mut resume, adopted.ends_at)?;
        let before = measured_at_version(plan, me, version(me), &points)?;
        let latest = points.latest();
        drop(points);
        let minibatch = u64::from(plan.schedule.resolved.minibatch);
        losses.runs_below = u32::try_from(adopted.ends_at * minibatch).unwrap_or(u32::MAX);
        let log = failed
            .traffic
            .ok_or_else(|| StageError::Executor("a takeover without a traffic log".into()))?;
        let (kept, kept_for_lost) = {
            let mut log = log.lock().map_err(|_| super::rollback::poisoned())?;
            let goes_on = (plan, super::adopt::GoesOn::AtBoundary);
            let traffic = (&mut *log, latest);
            let beside = lost_part.is_some().then_some((lost, run.cfg.wire));
            let hand =
                super::takeover::to_hand_over(me, goes_on, &adopted.planned, traffic, beside)?;
            super::takeover::send_all(ep.as_mut(), hand.send)?;
            (log.take_received(), hand.hosted)
        };
        losses.restart(
            ep.as_mut(),
            rx,
            before.losses.len() + before.grad_norms.len(),
            obs,
        )?;
        super::processes::RecordWriter::recovery(RecoveryPhase::Restarted)?;
        let t = Instant::now();
        let be = &self.be;
        let ran = run.with_setup(plan, self.data, (at.epoch, at.done), Some(tx), |setup| {
            std::thread::scope(|s| {
                let adoption = lost_part.take().map(|(hosted, resume, state)| {
                    let job = AdoptJob {
                        hosted,
                        resume,
                        state,
                        kept: kept_for_lost,
                    };
                    s.spawn(move || run_adopted((run, plan, at, index), setup, job, t))
                });
                let mut served = Serving::new(&mut ep, kept);
                let own = resume_worker_with(be, &mut served, setup, &mut state, resume, t, &mut {
                    Polling::of(losses, rx, obs)
                });
                let other = adoption.map(|h| {
                    h.join()
                        .map_err(|_| StageError::Executor("the adopted program panicked".into()))?
                });
                Ok::<_, StageError>((own?, other.transpose()?))
            })
        });
        let (own, other) = ran?;
        self.renewed = Some(ep);
        self.state = Some(state);
        self.taken_over = Some(adopted.change);
        if let Some(ended) = other {
            self.hosted = Some(Hosted::ending(plan, index, ended));
        }
        self.end_segment(plan, before.followed_by(own), (losses, rx), obs)
    }
}

/// This worker's state for a segment of `setup`'s plan: made from its start for its first
/// segment (a follower then lets the start go; the chief reports its first update's phase).
///
/// # Errors
/// A worker without its start, or whose start does not fit the plan.
fn ready_state<'s>(
    (state, start): (&'s mut Option<WorkerState>, &mut Option<Start>),
    setup: &super::setup::Setup<'_>,
    cfg: &RunConfig,
    rank: u32,
    obs: &mut dyn Observer,
) -> Result<&'s mut WorkerState> {
    if state.is_none() {
        let from = start
            .as_ref()
            .ok_or_else(|| StageError::Executor("a worker without its start".into()))?;
        *state = Some(from.state_of(setup, cfg, rank)?);
        if rank != CHIEF {
            *start = None;
        } else {
            obs.on_start_phase(super::StartPhase::FirstUpdate)?;
        }
    }
    state
        .as_mut()
        .ok_or_else(|| StageError::Executor("a worker without state".into()))
}

/// A segment's context: the run, its plan, the segment and its number.
type SegmentOf<'r> = (&'r Run<'r>, &'r RunPlan, &'r Segment, u32);

/// The recovery where it stands of `st`'s worker in segment `ctx`, where a takeover can go
/// on that way: its rollback points and traffic log (`logs`), and where its stage has another
/// replica, a copy of its state at the segment's start for the lost program it may adopt.
/// `None` where a takeover is refused (gradient clipping, tied parameters, several updates a
/// step).
fn in_place_for<'r>(
    (run, plan, at, index): SegmentOf<'r>,
    st: &WorkerState,
    remesh: super::recover::RemeshHandle,
    (points, traffic): (Arc<std::sync::Mutex<Points>>, SharedTraffic),
    moved: super::in_place::MovedOn,
) -> Option<InPlace<'r>> {
    let clips = st
        .stages
        .iter()
        .any(|s| s.opt.optimizer().config().grad_clip.is_some());
    if super::adopt::refused(plan, &run.model, clips).is_some() {
        return None;
    }
    let layout = plan.schedule.layout();
    let replicated = st.stages.iter().any(|s| layout.group(s.stage).count() > 1);
    Some(InPlace {
        plan,
        cfg: run.cfg,
        at: (at.done, index),
        remesh,
        points,
        traffic,
        start: replicated.then(|| st.clone()),
        adopt: None,
        moved,
        outcome: Outcome::Untouched,
    })
}

/// How a segment run where its worker may go on in place ended ([`run_standing`]).
struct StoodEnd {
    /// The mesh it went on over.
    renewed: Option<Box<dyn Transport>>,
    /// What became of the recovery.
    outcome: Outcome,
    /// The lost program this worker adopted, once it ended.
    adopted: Option<Result<(Endpoint, WorkerState, WorkerOutcome)>>,
}

/// Runs `st`'s program of `setup`'s plan over `logging`, going on where it stands after a
/// loss (`in_place`); on the lost worker's adopter, the lost program runs on a thread of its
/// own beside it ([`run_adopted`]).
fn run_standing<B: pipe_kernels::Backend, E: Transport>(
    be: &B,
    logging: Logging<E>,
    mut in_place: InPlace<'_>,
    (setup, st, t): (&super::setup::Setup<'_>, &mut WorkerState, Instant),
    between: &mut Polling<'_, '_>,
    ctx: SegmentOf<'_>,
) -> (Result<WorkerOutcome>, StoodEnd) {
    let (tx, rx) = crossbeam_channel::bounded::<AdoptJob>(1);
    in_place.adopt = Some(tx);
    std::thread::scope(|s| {
        let adoption = s.spawn(move || {
            let job = rx.recv().ok()?;
            let began = Instant::now();
            let adopted = run_adopted(ctx, setup, job, began);
            // Its actions on the time axis of this worker's own (since `t`), for the trace.
            let after = began.duration_since(t).as_secs_f64();
            Some(adopted.map(|(ep, st, mut out)| {
                out.spans = out.spans.iter().map(|sp| sp.shifted(after)).collect();
                (ep, st, out)
            }))
        });
        let mut ep = Recovering::new(logging, in_place);
        let own = run_worker_with(be, &mut ep, setup, st, t, between);
        let (renewed, in_place) = ep.into_parts();
        // The lost program's thread waits for a job no more.
        let InPlace { outcome, adopt, .. } = in_place;
        drop(adopt);
        let adopted = adoption.join().unwrap_or_else(|_| {
            Some(Err(StageError::Executor(
                "the adopted program panicked".into(),
            )))
        });
        let end = StoodEnd {
            renewed,
            outcome,
            adopted,
        };
        (own, end)
    })
}

/// The lost worker's program of segment `at` (number `index`) of `plan`, resumed on the
/// adopter over the lost rank's endpoint it hosts (`job`), on a thread of its own beside its
/// own program: its endpoint, state and figures when it ends.
///
/// # Errors
/// As [`resume_worker_with`]; its loss reports that cannot be sent.
fn run_adopted<'r>(
    (run, plan, at, index): (&'r Run<'r>, &RunPlan, &'r Segment, u32),
    setup: &super::setup::Setup<'_>,
    job: AdoptJob,
    t: Instant,
) -> Result<(Endpoint, WorkerState, WorkerOutcome)> {
    let AdoptJob {
        hosted,
        resume,
        mut state,
        kept,
    } = job;
    let (lost, cfg) = (state.worker, run.cfg);
    let (tx, rx) = crossbeam_channel::unbounded();
    let setup = super::setup::Setup {
        progress: Some(&tx),
        ..*setup
    };
    let be = super::train::open_backend(cfg.backend, cfg.threads.max(1), lost)?;
    let mut relay = LossRelay::new(run, plan, at, index, lost);
    let mut quiet = super::observe::Quiet;
    let mut ep = Serving::new(hosted, kept);
    let between = &mut Polling::of(&mut relay, &rx, &mut quiet);
    let out = resume_worker_with(&be, &mut ep, &setup, &mut state, resume, t, between)?;
    let mut ep = ep.into_inner();
    relay.poll(&mut ep, &rx, &mut quiet)?;
    Ok((ep, state, out))
}

/// The figures over the steps of a failed segment that stand, once its survivors have gone
/// on in place ([`super::recover`]): the chief gathers every survivor's, in the old layout's
/// numbering of `old_workers` (the lost one counting none); the others send theirs and get an
/// empty list. `None` when the segment runs again from its start.
///
/// # Errors
/// A survivor that does not answer, or answers malformed.
fn standing_after(
    gone: &mut super::recover::GoneOn,
    old_workers: u32,
    index: u32,
) -> Result<Option<Vec<WorkerOutcome>>> {
    let Some(own) = gone.own.take() else {
        return Ok(None);
    };
    let ep = gone.ep.as_mut();
    let id = ep.rank();
    let key = |from: u32| control(from, CHIEF, super::recover::TOPIC_RECOVER, index, 2);
    if id != CHIEF {
        ep.send(Message::from_bytes(key(id), &encode_summary(&own)))?;
        return Ok(Some(Vec::new()));
    }
    let ranks = &gone.ranks;
    let was = |w: u32| ranks.get(w as usize).copied().unwrap_or(w);
    let mut all = vec![WorkerOutcome::default(); old_workers as usize];
    let mut place = |w: u32, o: WorkerOutcome| {
        if let Some(slot) = all.get_mut(was(w) as usize) {
            *slot = WorkerOutcome {
                worker: was(w),
                ..o
            };
        }
    };
    place(CHIEF, own);
    for w in 1..ep.size() {
        let m = ep.recv(&key(w))?;
        place(w, decode_summary(&m.into_bytes()?, w)?);
    }
    Ok(Some(all))
}

impl<T: Transport> Process<'_, T> {
    /// The exchange that ends a segment this worker's program finished with `outcome`: a
    /// follower forwards its last losses, reports to the chief and takes its word; the chief
    /// gathers every worker's summary and the losses still out.
    fn end_segment(
        &mut self,
        plan: &RunPlan,
        outcome: WorkerOutcome,
        (losses, rx): (&mut LossRelay<'_>, &crossbeam_channel::Receiver<Report>),
        obs: &mut dyn Observer,
    ) -> Result<SegmentEnd> {
        let index = self.index;
        let ep = current(&mut *self.ep, &mut self.renewed);
        if ep.rank() != CHIEF {
            losses.poll(ep, rx, obs)?;
            let word = report_to_chief(ep, &outcome, (plan, mine(&self.state)?), index)?;
            self.joining = word.joining;
            if word.unreplaced {
                self.replacement_coming = false;
            }
            let (stop, rejoin) = (word.drain.stop, word.joining.is_some());
            return Ok(SegmentEnd::Follower { stop, rejoin });
        }
        let mut outcomes = gather_summaries(ep, outcome, index)?;
        losses.finish(ep, rx, &outcomes, obs)?;
        if let Some(super::survive::LayoutEvent::Lost { worker, .. }) =
            self.taken_over.as_ref().map(|c| &c.event)
        {
            if let Some(o) = outcomes.get_mut(*worker as usize) {
                losses.complete_lost(*worker, o);
            }
        }
        Ok(SegmentEnd::Chief(outcomes))
    }
}

impl<T: Transport> Process<'_, T> {
    /// The chief's side of the drain after a segment: tells every follower what `drain`
    /// asks, gathers the weights and optimizer state it asks for, and lets them go on.
    ///
    /// # Errors
    /// A follower that does not answer.
    fn drain_exchange(
        &mut self,
        plan: &RunPlan,
        drain: Drain,
    ) -> Result<(Option<Params>, Option<super::train::OptimizerOf>)> {
        let index = self.index;
        let ep = current(&mut *self.ep, &mut self.renewed);
        // The launcher gave up replacing the replica the run is short of: every worker's next
        // segment takes its usual length, this one's word saying so.
        let unreplaced = self.joining.is_none()
            && self
                .remesh
                .as_ref()
                .is_some_and(|h| h.0.lock().is_ok_and(|mut r| r.unreplaced()));
        if unreplaced {
            self.replacement_coming = false;
        }
        let word = ChiefWord {
            drain,
            joining: self.joining,
            unreplaced,
        };
        let missed = tell_followers(ep, index, GO_REQUEST, &drain_bytes(word));
        let init = &self
            .start
            .as_ref()
            .ok_or_else(|| StageError::Executor("the chief without its start".into()))?
            .params;
        let (mine, cfg) = (mine(&self.state)?, self.run.cfg);
        let weights = if drain.weights {
            Some(gather_weights(ep, plan, mine, init, index)?)
        } else {
            None
        };
        let optimizer = if drain.optimizer {
            let like = (init, self.run.model.optimizer_roles());
            Some(gather_optimizer(
                ep,
                plan,
                mine,
                (like.0, &like.1),
                cfg,
                index,
            )?)
        } else {
            None
        };
        // Every follower has answered: they may start the next segment, whose failure (a
        // follower lost meanwhile) can no longer cut this gather short.
        let missed = missed.or(tell_followers(ep, index, GO_ON, &[1]));
        match missed {
            // A worker lost after it answered (or that had nothing to answer) is found by
            // the next segment, which goes on without it in place.
            Some(e) if self.remesh.is_none() => Err(e),
            _ => Ok((weights, optimizer)),
        }
    }
}

/// A worker's rollback points and traffic log of one segment, as [`Process`] keeps them for
/// the next.
type LastLogs = (
    Option<Arc<std::sync::Mutex<Points>>>,
    Option<super::adopt::SharedTraffic>,
);

impl<T: Transport> Process<'_, T> {
    /// The last segment's rollback points and traffic log of this worker, where nothing else
    /// holds them any longer (its state's keeper, the last that did, is let go: the next
    /// segment hands it its own points). Built anew, each segment freed its predecessor's
    /// copies (95-145 MB a worker, `docs/reliability.md`, "Memory over rejoin cycles") at its
    /// start and allocated their like again over its first steps.
    fn reusable_logs(&mut self) -> (Option<Points>, Option<Traffic>) {
        let (points, traffic) = std::mem::take(&mut self.last_logs);
        if let Some(st) = self.state.as_mut() {
            st.keeper = None;
        }
        use super::rollback::unshared;
        (points.and_then(unshared), traffic.and_then(unshared))
    }
}

impl<T: Transport> Coordinator for Process<'_, T> {
    fn run_segment(
        &mut self,
        plan: &RunPlan,
        at: &Segment,
        obs: &mut dyn Observer,
    ) -> Result<SegmentEnd> {
        let (run, cfg) = (self.run, self.run.cfg);
        // This worker's number in the segment's layout (a new one after a replica was lost
        // in place).
        let rank = current(&mut *self.ep, &mut self.renewed).rank();
        let t = Instant::now();
        self.index += 1;
        let index = self.index;
        let mut losses = LossRelay::new(run, plan, at, index, rank);
        let (tx, rx) = crossbeam_channel::unbounded();
        let (mut old_points, old_traffic) = self.reusable_logs();
        let points = super::rollback::points_for(plan, |w| old_points.take_if(|_| w == rank));
        // Copies of the data messages over the boundaries the points keep, for a takeover;
        // none where a lost replica is not gone on without in place.
        let traffic = match (&self.remesh, points.get(rank as usize)) {
            (Some(_), Some(_)) => {
                let window = super::rollback::points_kept(plan.schedule.stages()) as u64;
                let log = Traffic::after(window, old_traffic);
                Some(Arc::new(std::sync::Mutex::new(log)))
            }
            _ => None,
        };
        self.last_logs = (points.get(rank as usize).cloned(), traffic.clone());
        let moved = super::in_place::MovedOn::default();
        losses.moved = Some(moved.clone());
        let ep = current(&mut *self.ep, &mut self.renewed);
        let (be, state, start) = (&self.be, &mut self.state, &mut self.start);
        let remesh = self.remesh.clone();
        let ctx = (run, plan, at, index);
        let (outcome, stood) =
            run.with_setup(plan, self.data, (at.epoch, at.done), Some(&tx), |setup| {
                let st = match ready_state((state, start), setup, cfg, rank, obs) {
                    Ok(st) => st,
                    Err(e) => return (Err(e), None),
                };
                st.keeper = points
                    .get(rank as usize)
                    .map(|p| p.clone() as super::exec::SharedKeeper);
                let between = &mut Polling::of(&mut losses, &rx, obs);
                let (Some(log), Some(p), Some(remesh)) =
                    (&traffic, points.get(rank as usize), remesh)
                else {
                    return (run_worker_with(be, ep, setup, st, t, between), None);
                };
                let logging = Logging::new(&mut *ep, log.clone(), p.clone());
                let logs = (p.clone(), log.clone());
                match in_place_for(ctx, st, remesh, logs, moved) {
                    Some(in_place) => {
                        let (own, stood) =
                            run_standing(be, logging, in_place, (setup, st, t), between, ctx);
                        (own, Some(stood))
                    }
                    None => {
                        let mut ep = logging;
                        (run_worker_with(be, &mut ep, setup, st, t, between), None)
                    }
                }
            });
        if let Some(st) = &self.state {
            let segment = (plan.schedule.resolved.policy, at.len as u32);
            let stall = outcome.as_ref().err().and_then(StageError::stall_key);
            *self.stop = Some(StopReport::new(rank, segment, &st.progress, stall));
        }
        // The actions of a lost program this worker adopted are the trace's, on its track.
        let mut stood = stood;
        let adopted_spans = stood
            .as_mut()
            .and_then(|s| s.adopted.as_mut())
            .and_then(|a| a.as_mut().ok())
            .map(|(_, _, out)| std::mem::take(&mut out.spans))
            .unwrap_or_default();
        let went_on = match stood {
            Some(stood) => self.after_standing(plan, stood)?,
            None => false,
        };
        let outcome = match outcome {
            Ok(outcome) => outcome,
            // A failure after the program went on in place is the run's, as after a takeover.
            Err(e) if went_on => return Err(e),
            Err(e) => {
                let failed = Failure {
                    points: &points,
                    at_start: true,
                    traffic: traffic.as_ref(),
                    relay: Some((&mut losses, &rx, &tx)),
                };
                return self.after_failure(plan, at, e, failed, obs);
            }
        };
        let base = t.duration_since(self.origin.1).as_secs_f64();
        let spans: Vec<_> = (outcome.spans.iter().chain(&adopted_spans))
            .map(|sp| sp.shifted(base))
            .collect();
        obs.on_spans(self.origin.0, &spans)?;
        // A peer lost in the exchange that ends the segment is gone on without in place too,
        // from the rollback points (this worker's state is the segment's end by now).
        match self.end_segment(plan, outcome, (&mut losses, &rx), obs) {
            Ok(end) => {
                // On the chief, the drain comes next; a replica lost in its exchange is gone
                // on without from this segment's points too.
                if !went_on && matches!(end, SegmentEnd::Chief(_)) {
                    self.drained_from = Some((points, *at));
                }
                Ok(end)
            }
            Err(e) if went_on => Err(e),
            Err(e) => {
                // Finished with its program: its state is the segment's end, no start to
                // resume from, so no takeover.
                let failed = Failure {
                    points: &points,
                    at_start: false,
                    traffic: None,
                    relay: Some((&mut losses, &rx, &tx)),
                };
                self.after_failure(plan, at, e, failed, obs)
            }
        }
    }

    fn drain(&mut self, plan: &RunPlan, drain: Drain) -> Result<Drained> {
        let ended = self.drained_from.take();
        let err = match self.drain_exchange(plan, drain) {
            Ok((weights, optimizer)) => return Ok(Drained::Gave(weights, optimizer)),
            Err(e) => e,
        };
        // A replica lost before every follower answered: the followers' end-of-segment
        // exchange failed too, so every survivor goes on from the segment's points, as where
        // the loss cut that exchange short.
        let Some((points, at)) = ended else {
            return Err(err);
        };
        let failed = Failure {
            points: &points,
            at_start: false,
            traffic: None,
            relay: None,
        };
        match self.after_failure(plan, &at, err, failed, &mut super::observe::Quiet)? {
            SegmentEnd::Relayout(went) => Ok(Drained::Relayout(went)),
            _ => Err(StageError::Executor(
                "a drain's recovery that did not go on in place".into(),
            )),
        }
    }

    fn replacement_coming(&self) -> bool {
        self.replacement_coming
    }

    fn taken_over(&mut self, plan: &RunPlan, _: u64) -> Result<Option<LayoutChange>> {
        let Some(change) = self.taken_over.take() else {
            return Ok(None);
        };
        let lost = match &change.event {
            super::survive::LayoutEvent::Lost { worker, .. } => *worker,
            _ => {
                return Err(StageError::Executor(
                    "a takeover without a lost worker".into(),
                ));
            }
        };
        // The lost program's end exchange is over (the drain answered); its endpoint stays
        // open, idle, while the mesh is in use.
        if let Some(h) = self.hosted.take() {
            self.hosted = Some(Hosted::Idle(h.idle()?));
        }
        // The survivors go on over the same mesh, numbered for the new layout; the taken
        // over segment's unread copies can never meet the next segments' messages.
        let ranks = super::recover::survivor_ranks(plan, lost, &change)?;
        let mesh = self
            .renewed
            .take()
            .ok_or_else(|| StageError::Executor("a takeover without its mesh".into()))?;
        let ep = Renumbered::new(mesh, ranks)?.tagging_data(TAKEN_OVER_TAG);
        if let Some(st) = self.state.as_mut() {
            st.worker = ep.rank();
        }
        self.renewed = Some(Box::new(ep));
        Ok(Some(change))
    }

    fn ended_at(&self) -> Option<u64> {
        self.taken_over.as_ref().map(|c| c.from)
    }

    fn rejoin_ready(&mut self) -> bool {
        if self.joining.is_none() {
            let handle = self.remesh.as_ref();
            let mut remesh = handle.and_then(|h| h.0.lock().ok());
            self.joining = remesh.as_mut().and_then(|r| r.joining());
        }
        self.joining.is_some()
    }

    fn rejoin(&mut self, _: &RunPlan, done: u64) -> Result<()> {
        let no = |what: &str| StageError::Executor(format!("a rejoin without {what}"));
        let joining = self.joining.take().ok_or_else(|| no("a replacement"))?;
        let handle = self.remesh.clone().ok_or_else(|| no("a launcher"))?;
        let mut remesh = handle.0.lock().map_err(|_| no("a usable launcher"))?;
        // The survivors' mesh ends at this drain point, which left nothing in flight on it.
        let hosted = self.hosted.take().map(|h| h.close(true));
        if let Some(mut old) = self.renewed.take() {
            old.close()?;
        }
        if let Some(closing) = hosted {
            let _ = closing.join();
        }
        let mut ep = remesh.connect_all(joining)?;
        drop(remesh);
        let rank = ep.rank();
        let state = self.state.as_mut().ok_or_else(|| no("state"))?;
        // Back on the run's own layout, whose workers are the processes' ranks.
        state.worker = rank;
        let cfg = self.run.cfg;
        let plan = own_plan(self.run, cfg, &self.settled.partition)?;
        let terms = (rank == CHIEF).then(|| StartTerms {
            run: cfg.numerics(),
            partition: self.settled.partition.clone(),
            every: self.settled.every,
            done,
            steps: None,
            segments: self.index,
        });
        hand_over(ep.as_mut(), &plan, state, joining, terms)?;
        self.renewed = Some(ep);
        Ok(())
    }
}

/// Losses as a segment computes them: a worker sends each of its own to the chief as it
/// computes it ([`TOPIC_LOSS`], numbered per sender); the chief takes its own and polls the
/// last stage's workers for theirs between its actions, and reports each update as soon as
/// all its losses are in, as the in-process trainer does.
struct LossRelay<'r> {
    rank: u32,
    index: u32,
    /// The workers that compute losses (the last stage's), and the next number of each.
    reporters: Vec<(u32, u32)>,
    sent: u32,
    /// Every report this worker sent the chief in the segment, in order (another worker).
    produced: Vec<Report>,
    /// The chief: every loss taken, with its sender; and those taken before a takeover's
    /// restart ([`LossRelay::restart`]).
    taken: Vec<(u32, (u32, f64, usize))>,
    before_restart: Vec<(u32, (u32, f64, usize))>,
    /// The microbatches of a segment taken over that its programs run (all, unless it was
    /// cut short for a replacement that comes).
    runs_below: u32,
    live: LiveSteps<'r>,
    /// Set to the lost worker's rank when this worker's program went on where it stood after
    /// a loss ([`super::in_place`]): the relay numbers its reports on the new mesh.
    moved: Option<super::in_place::MovedOn>,
}

impl<'r> LossRelay<'r> {
    fn new(run: &'r Run<'r>, plan: &RunPlan, seg: &'r Segment, index: u32, rank: u32) -> Self {
        let last = plan.schedule.stages().saturating_sub(1);
        let reporters = plan
            .schedule
            .layout()
            .group(last)
            .filter(|&w| w != CHIEF)
            .map(|w| (w, 0))
            .collect();
        LossRelay {
            rank,
            index,
            reporters,
            sent: 0,
            produced: Vec::new(),
            taken: Vec::new(),
            before_restart: Vec::new(),
            runs_below: u32::MAX,
            live: LiveSteps::new(run, plan, seg),
            moved: None,
        }
    }

    /// After this worker's program went on where it stood on a new mesh (the signal says
    /// so): another worker sends the chief every report it produced again, under the same
    /// numbers (one the chief already read stays unread); the chief takes the lost worker's
    /// reports from 0, as its program resumed at a boundary numbers them, keeping those it
    /// had for [`LossRelay::complete_lost`].
    fn moved_on<T: Transport + ?Sized>(
        &mut self,
        ep: &mut T,
        rx: &crossbeam_channel::Receiver<Report>,
    ) -> Result<()> {
        let Some(lost) = self.moved.as_ref().and_then(super::in_place::MovedOn::take) else {
            return Ok(());
        };
        if self.rank == CHIEF {
            for r in self.reporters.iter_mut().filter(|r| r.0 == lost) {
                r.1 = 0;
            }
            let (theirs, rest) = std::mem::take(&mut self.taken)
                .into_iter()
                .partition(|&(from, _)| from == lost);
            self.taken = rest;
            self.before_restart = theirs;
            return Ok(());
        }
        self.produced.extend(rx.try_iter());
        self.sent = 0;
        for report in self.produced.clone() {
            self.send(ep, report)?;
        }
        Ok(())
    }

    /// Between two actions: forwards this worker's new losses (another worker), or takes them
    /// and every loss that has arrived and reports what is complete (the chief).
    fn poll<T: Transport + ?Sized>(
        &mut self,
        ep: &mut T,
        rx: &crossbeam_channel::Receiver<Report>,
        obs: &mut dyn Observer,
    ) -> Result<()> {
        self.moved_on(ep, rx)?;
        while let Ok(report) = rx.try_recv() {
            if self.rank == CHIEF {
                self.live.add(report, obs)?;
                continue;
            }
            // Kept before it is sent: one that fails on a loss is sent again.
            self.produced.push(report);
            self.send(ep, report)?;
            self.moved_on(ep, rx)?;
        }
        if self.rank != CHIEF {
            return Ok(());
        }
        // Every report that has arrived, not one per reporter: after a takeover each
        // reporter sends again all it had reported, which would otherwise take one of the
        // chief's actions each to read.
        for i in 0..self.reporters.len() {
            loop {
                self.moved_on(ep, rx)?;
                let (w, next) = self.reporters[i];
                let key = control(w, CHIEF, TOPIC_LOSS, self.index, next);
                let Some(m) = ep.try_recv(&key)? else { break };
                self.take(m, obs)?;
                self.reporters[i].1 += 1;
            }
        }
        Ok(())
    }

    fn send<T: Transport + ?Sized>(&mut self, ep: &mut T, report: Report) -> Result<()> {
        let b = encode_report(report);
        let key = control(self.rank, CHIEF, TOPIC_LOSS, self.index, self.sent);
        ep.send(Message::from_bytes(key, &b))?;
        self.sent += 1;
        Ok(())
    }

    /// On a new mesh, after a takeover ([`super::takeover`]): numbering starts again. The
    /// chief takes every reporter's from 0; another worker sends the chief again the first
    /// `kept` reports it produced (those its rollback point counted, the failed attempt's
    /// later ones dropped: its resumed program makes them again).
    fn restart<T: Transport + ?Sized>(
        &mut self,
        ep: &mut T,
        rx: &crossbeam_channel::Receiver<Report>,
        kept: usize,
        obs: &mut dyn Observer,
    ) -> Result<()> {
        if self.rank == CHIEF {
            for r in &mut self.reporters {
                r.1 = 0;
            }
            self.before_restart = std::mem::take(&mut self.taken);
            return self.poll(ep, rx, obs);
        }
        self.produced.extend(rx.try_iter());
        self.produced.truncate(kept);
        self.sent = 0;
        for report in self.produced.clone() {
            self.send(ep, report)?;
        }
        Ok(())
    }

    /// The chief, after the segment: takes every loss not yet taken (each worker's summary
    /// says how many it computed) and reports the remaining updates.
    fn finish<T: Transport + ?Sized>(
        &mut self,
        ep: &mut T,
        rx: &crossbeam_channel::Receiver<Report>,
        outcomes: &[WorkerOutcome],
        obs: &mut dyn Observer,
    ) -> Result<()> {
        self.poll(ep, rx, obs)?;
        for i in 0..self.reporters.len() {
            let (w, mut next) = self.reporters[i];
            let total = outcomes
                .get(w as usize)
                .map_or(0, |o| o.losses.len() + o.grad_norms.len());
            while (next as usize) < total {
                let m = ep.recv(&control(w, CHIEF, TOPIC_LOSS, self.index, next))?;
                self.take(m, obs)?;
                next += 1;
            }
            self.reporters[i].1 = next;
        }
        Ok(())
    }

    fn take(&mut self, m: Message, obs: &mut dyn Observer) -> Result<()> {
        let from = m.key.from;
        let report = decode_report(&m.into_bytes()?, from)?;
        if let Report::Loss(mb, loss, n) = report {
            self.taken.push((from, (mb, loss, n)));
        }
        self.live.add(report, obs)
    }

    /// The chief, after a segment taken over: adds to `lost`'s figures (`outcome`, measured
    /// from its program's resumed boundary on) the losses it reported before it was lost,
    /// which went with it, and sums them again in microbatch order as a worker does.
    fn complete_lost(&self, lost: u32, outcome: &mut WorkerOutcome) {
        let mut have: std::collections::HashSet<u32> = outcome.losses.iter().map(|l| l.0).collect();
        for &(from, l) in &self.before_restart {
            if from == lost && l.0 < self.runs_below && have.insert(l.0) {
                outcome.losses.push(l);
            }
        }
        outcome.losses.sort_by_key(|l| l.0);
        outcome.loss_sum = outcome.losses.iter().map(|l| l.1).sum();
        outcome.samples = outcome.losses.iter().map(|l| l.2).sum();
    }
}

/// A worker process's work between its actions ([`Between`]): its loss relay polled, and on
/// the chief also each time a loss report arrives while one of its receives waits.
struct Polling<'p, 'r> {
    relay: &'p mut LossRelay<'r>,
    rx: &'p crossbeam_channel::Receiver<Report>,
    obs: &'p mut dyn Observer,
}

impl<'p, 'r> Polling<'p, 'r> {
    fn of(
        relay: &'p mut LossRelay<'r>,
        rx: &'p crossbeam_channel::Receiver<Report>,
        obs: &'p mut dyn Observer,
    ) -> Self {
        Polling { relay, rx, obs }
    }
}

impl<T: Transport + ?Sized> Between<T> for Polling<'_, '_> {
    fn run(&mut self, t: &mut T) -> Result<()> {
        self.relay.poll(t, self.rx, self.obs)
    }

    fn notices(&self, key: &Key) -> bool {
        self.relay.rank == CHIEF
            && key.to == CHIEF
            && key.kind == Kind::Control
            && key.stage == TOPIC_LOSS
    }

    fn notices_any(&self) -> bool {
        self.relay.rank == CHIEF
    }
}

/// A control message's key.
fn control(from: u32, to: u32, topic: u32, index: u32, step: u32) -> Key {
    Key {
        from,
        to,
        kind: Kind::Control,
        stage: topic,
        index,
        step,
    }
}

/// What the start exchange settles: the partition, the checkpoint interval (which decides
/// where the pipeline drains, so it is the chief's for everyone), and where the run starts.
struct Agreed {
    partition: Option<Partition>,
    /// The all-reduce bucket size of each stage (empty: the run's one size): the chief's,
    /// which chose them where no worker was given any.
    buckets: StageBuckets,
    every: Option<u64>,
    done: u64,
    /// Per layer, the optimizer updates a resumed run starts after.
    steps: Option<Vec<u64>>,
    /// The chief's start (a resumed checkpoint's state, or fresh).
    start: Option<Start>,
}

/// The chief's start message, as JSON: its run's numerics ([`RunConfig::numerics`]) for
/// every worker to compare with its own, and what [`Agreed`] carries across.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StartTerms {
    run: RunConfig,
    partition: Option<Partition>,
    every: Option<u64>,
    done: u64,
    steps: Option<Vec<u64>>,
    /// Segments run so far (none at a start; a replacement's first segment is the next).
    #[serde(default)]
    segments: u32,
}

/// What the chief settled at the start that a replacement is handed too: the partition and
/// the checkpoint interval.
struct Settled {
    partition: Option<Partition>,
    every: Option<u64>,
}

/// Control topic: a replacement's terms from the chief (step 0), and one layer's weights and
/// optimizer state from a surviving replica of its stage (index: the layer; step: 1 for the
/// weights, 2 to 4 for the optimizer's parts, the version the stage's update count).
pub const TOPIC_JOIN: u32 = 8;

/// The start exchange: the chief settles the partition (measuring it if asked) and where the
/// run starts, and sends them with its run; every other worker checks the run against its own
/// and takes the rest.
fn agree<T: Transport + ?Sized>(
    cfg: &RunConfig,
    run: &Run<'_>,
    ep: &mut T,
    opts: &WorkerOptions,
) -> Result<Agreed> {
    let rank = ep.rank();
    if rank == CHIEF {
        let partition = run_partition(cfg)?;
        let start = Start::new(run, opts.resume.as_ref())?;
        let terms = StartTerms {
            run: cfg.numerics(),
            partition,
            every: opts.checkpoints.as_ref().and_then(|c| c.every),
            done: start.done,
            steps: start.optimizer.as_ref().map(|(_, s)| s.clone()),
            segments: 0,
        };
        let json = serde_json::to_vec(&terms)
            .map_err(|e| StageError::Executor(format!("writing the start message: {e}")))?;
        for w in 1..ep.size() {
            ep.send(Message::from_bytes(
                control(CHIEF, w, TOPIC_START, 0, 0),
                &json,
            ))?;
        }
        return Ok(Agreed {
            partition: terms.partition,
            buckets: cfg.stage_buckets.clone(),
            every: terms.every,
            done: terms.done,
            steps: terms.steps,
            start: Some(start),
        });
    }
    let bytes = ep
        .recv(&control(CHIEF, rank, TOPIC_START, 0, 0))?
        .into_bytes()?;
    let terms: StartTerms = serde_json::from_slice(&bytes)
        .map_err(|e| protocol(format!("the chief's start message: {e}")))?;
    accept_terms(cfg, run, rank, terms)
}

/// The chief's terms, checked against this worker's own run (`rank`'s): the same numerics,
/// and a partition that covers the model and agrees with one given.
fn accept_terms(cfg: &RunConfig, run: &Run<'_>, rank: u32, terms: StartTerms) -> Result<Agreed> {
    // Bucket sizes the chief chose (from its measured profile) are the run's, by the rule a
    // resumed run adopts a checkpoint's by.
    let mine = cfg
        .adopt_buckets_of(&terms.run)
        .unwrap_or_else(|| cfg.clone());
    if let Some(diff) = mine.numerics_difference(&terms.run) {
        return Err(StageError::Config(format!(
            "worker {rank}'s run settings differ from the chief's (worker 0): {diff}; give every worker the same flags and config"
        )));
    }
    let layers = run.model.len();
    let partition = match (&cfg.partition, terms.partition) {
        (_, Some(q)) if q.layers() != layers => {
            return Err(protocol(format!(
                "the chief's partition {q} does not cover the model's {layers} layers"
            )));
        }
        (PartitionChoice::Given(p), Some(q)) if *p != q => {
            return Err(StageError::Config(format!(
                "worker {rank} was given partition {p} but the chief runs {q}"
            )));
        }
        (_, q) => q,
    };
    Ok(Agreed {
        partition,
        buckets: mine.stage_buckets,
        every: terms.every,
        done: terms.done,
        steps: terms.steps,
        start: None,
    })
}

/// The run's own layout as a one-update plan of `cfg` on `partition`: which worker holds
/// which layers.
fn own_plan(run: &Run<'_>, cfg: &RunConfig, partition: &Option<Partition>) -> Result<RunPlan> {
    let spec = cfg.schedule_spec(Length::Updates(1));
    RunPlan::new(&run.model, &spec, partition.clone())
}

/// Sends one layer's four parts (its weights, then its optimizer's three) as control messages
/// keyed by `key(part)`, each with `version`.
fn send_layer<T: Transport + ?Sized>(
    ep: &mut T,
    key: impl Fn(u32) -> Key,
    version: u64,
    parts: [Vec<f32>; 1 + STATE_PARTS],
) -> Result<()> {
    for (k, flat) in parts.into_iter().enumerate() {
        send_flat(ep, key(k as u32), version, flat)?;
    }
    Ok(())
}

/// Where this worker starts. A resumed run's chief sends every other worker the weights and
/// optimizer state of the layers its stages hold (one message each per layer); they fill
/// them into a fresh model.
fn receive_start<T: Transport + ?Sized>(
    run: &Run<'_>,
    ep: &mut T,
    agreed: Agreed,
    cfg: &RunConfig,
) -> Result<Start> {
    let rank = ep.rank();
    let plan = own_plan(run, cfg, &agreed.partition)?;
    let layout = plan.schedule.layout();
    if let Some(start) = agreed.start {
        if let Some((opt, _)) = &start.optimizer {
            for w in 1..ep.size() {
                for s in layout.stages_of(w) {
                    for layer in plan.partition.range(s as usize) {
                        let l = layer as u32;
                        let state = |k: usize| flatten(opt[layer].iter().map(|p| p.parts()[k].1));
                        let parts = [
                            flatten(start.params[layer].iter())?,
                            state(0)?,
                            state(1)?,
                            state(2)?,
                        ];
                        send_layer(ep, |k| control(CHIEF, w, TOPIC_RESUME, l, k), 0, parts)?;
                    }
                }
            }
        }
        return Ok(start);
    }
    let Some(steps) = agreed.steps else {
        // A fresh run's weights of this worker's stages: the seed's, or --init-from's.
        return Ok(Start {
            params: fresh_own_params(run, cfg, &plan, rank)?,
            optimizer: None,
            done: agreed.done,
        });
    };
    let (params, opt, _) = receive_layers(run, ep, cfg, &plan, &|_| Ok((CHIEF, TOPIC_RESUME, 0)))?;
    if steps.len() != params.len() {
        return Err(protocol(format!(
            "the chief sent optimizer steps for {} layers of {}",
            steps.len(),
            params.len()
        )));
    }
    Ok(Start {
        params,
        optimizer: Some((opt, steps)),
        done: agreed.done,
    })
}

/// The fresh weights of the layers `rank`'s stages hold in `plan` (the seed's, or
/// `--init-from`'s directory), the others empty.
fn fresh_own_params(run: &Run<'_>, cfg: &RunConfig, plan: &RunPlan, rank: u32) -> Result<Params> {
    let mut own = vec![false; run.model.len()];
    for s in plan.schedule.layout().stages_of(rank) {
        for layer in plan.partition.range(s as usize) {
            own[layer] = true;
        }
    }
    super::train::initial_params_of(cfg, &run.model, &own)
}

/// The weights and optimizer state of the layers this worker's stages hold in `plan`, each
/// layer's four parts ([`send_layer`]) received from the worker and topic `source(stage)`
/// names (index: the layer; step: the part after the first step it names), filled into a fresh model's: the whole model's
/// parameters and optimizer state, and each layer's update count (its messages' version).
fn receive_layers<T: Transport + ?Sized>(
    run: &Run<'_>,
    ep: &mut T,
    cfg: &RunConfig,
    plan: &RunPlan,
    source: &dyn Fn(u32) -> Result<(u32, u32, u32)>,
) -> Result<(Params, OptimizerState, Vec<u64>)> {
    let rank = ep.rank();
    let mut params = fresh_own_params(run, cfg, plan, rank)?;
    let matrices = run.model.optimizer_roles();
    let mut opt: OptimizerState = Corrected::new(cfg.optimizer, &params, &matrices).into_state();
    let mut steps = vec![0u64; params.len()];
    for s in plan.schedule.layout().stages_of(rank) {
        let (from, topic, first) = source(s)?;
        for layer in plan.partition.range(s as usize) {
            let l = layer as u32;
            let mut take = |k: u32| -> Result<(Vec<f32>, u64)> {
                let m = ep.recv(&control(from, rank, topic, l, first + k))?;
                Ok((m.tensor.host()?.to_vec(), m.version))
            };
            let (weights, version) = take(0)?;
            fill(params[layer].iter_mut(), &weights, layer)?;
            steps[layer] = version;
            for k in 0..STATE_PARTS {
                let (values, _) = take(1 + k as u32)?;
                fill(opt[layer].iter_mut().map(|x| x.part_mut(k)), &values, layer)?;
            }
        }
    }
    Ok((params, opt, steps))
}

/// The surviving replica that hands a replacement `joining` its stage `stage`'s state: the
/// stage's first worker other than it in `layout`.
fn donor(layout: &pipe_scheduler::Layout, stage: u32, joining: u32) -> Option<u32> {
    layout.group(stage).find(|&w| w != joining)
}

/// What the survivors hand a replacement `joining` at a drain point, over the mesh of the
/// run's own layout (`plan`): the chief its terms (`terms`, the chief's only), and the donor
/// of each of its stages ([`donor`]) that stage's weights and optimizer state from `mine`.
///
/// # Errors
/// The replacement gone.
fn hand_over<T: Transport + ?Sized>(
    ep: &mut T,
    plan: &RunPlan,
    mine: &WorkerState,
    joining: u32,
    terms: Option<StartTerms>,
) -> Result<()> {
    let rank = ep.rank();
    if let Some(terms) = terms {
        let json = serde_json::to_vec(&terms)
            .map_err(|e| StageError::Executor(format!("writing a replacement's terms: {e}")))?;
        ep.send(Message::from_bytes(
            control(CHIEF, joining, TOPIC_JOIN, 0, 0),
            &json,
        ))?;
    }
    let layout = plan.schedule.layout();
    let theirs: Vec<u32> = layout.stages_of(joining).collect();
    for st in mine.stages.iter().filter(|st| theirs.contains(&st.stage)) {
        if donor(layout, st.stage, joining) != Some(rank) {
            continue;
        }
        let first = plan.partition.range(st.stage as usize).start;
        for (i, (weights, state)) in st.params.iter().zip(st.opt.parts()).enumerate() {
            let l = (first + i) as u32;
            let part = |k: usize| flatten(state.iter().map(|p| p[k]));
            let parts = [flatten(weights.iter())?, part(0)?, part(1)?, part(2)?];
            let key = |k: u32| control(rank, joining, TOPIC_JOIN, l, 1 + k);
            send_layer(ep, key, st.opt.steps(), parts)?;
        }
    }
    Ok(())
}

/// A replacement's start in a run under way ([`hand_over`]): the chief's terms, checked as at
/// a start, with the updates done and the segments run; then each of its stages' weights and
/// optimizer state from that stage's donor. Returns what the chief settled, the start and the
/// segments run.
///
/// # Errors
/// Terms that differ from this worker's run; a donor gone or malformed state.
fn receive_join<T: Transport + ?Sized>(
    cfg: &RunConfig,
    run: &mut Run<'_>,
    ep: &mut T,
) -> Result<(Settled, Start, u32)> {
    let rank = ep.rank();
    let bytes = ep
        .recv(&control(CHIEF, rank, TOPIC_JOIN, 0, 0))?
        .into_bytes()?;
    let terms: StartTerms = serde_json::from_slice(&bytes)
        .map_err(|e| protocol(format!("the chief's terms for a replacement: {e}")))?;
    let segments = terms.segments;
    let agreed = accept_terms(cfg, run, rank, terms)?;
    run.stage_buckets.clone_from(&agreed.buckets);
    let plan = own_plan(run, cfg, &agreed.partition)?;
    let layout = plan.schedule.layout();
    let source = |stage: u32| {
        let from = donor(layout, stage, rank)
            .ok_or_else(|| protocol(format!("stage {stage} has no replica to hand it over")))?;
        Ok((from, TOPIC_JOIN, 1))
    };
    let (params, opt, steps) = receive_layers(run, ep, cfg, &plan, &source)?;
    let settled = Settled {
        partition: agreed.partition,
        every: agreed.every,
    };
    let start = Start {
        params,
        optimizer: Some((opt, steps)),
        done: agreed.done,
    };
    Ok((settled, start, segments))
}

/// Sends `flat` as one control message with `key` and `version`.
fn send_flat<T: Transport + ?Sized>(
    ep: &mut T,
    key: Key,
    version: u64,
    flat: Vec<f32>,
) -> Result<()> {
    let n = flat.len();
    ep.send(Message {
        key,
        version,
        tensor: Tensor::from_vec(&[n], flat)?,
    })?;
    Ok(())
}

/// A layer's tensors as one flat buffer.
fn flatten<'t>(tensors: impl Iterator<Item = &'t Tensor>) -> Result<Vec<f32>> {
    let mut flat = Vec::new();
    for t in tensors {
        flat.extend_from_slice(t.host()?);
    }
    Ok(flat)
}

/// Copies `flat` into `tensors` (their shapes decide the split); the lengths must match.
fn fill<'t>(
    tensors: impl Iterator<Item = &'t mut Tensor>,
    flat: &[f32],
    layer: usize,
) -> Result<()> {
    let mut at = 0;
    for t in tensors {
        let n = t.len();
        let part = flat.get(at..at + n).ok_or_else(|| {
            protocol(format!(
                "layer {layer}: {} values, fewer than its tensors hold",
                flat.len()
            ))
        })?;
        t.host_mut()?.copy_from_slice(part);
        at += n;
    }
    if at != flat.len() {
        return Err(protocol(format!(
            "layer {layer}: {} values for tensors of {at}",
            flat.len()
        )));
    }
    Ok(())
}

fn protocol(why: String) -> StageError {
    StageError::Transport(TransportError::Protocol(why))
}

/// A loss or gradient-norm report as a worker sends it to the chief: a kind byte, then the
/// fields little-endian.
fn encode_report(report: Report) -> Vec<u8> {
    let mut b = Vec::with_capacity(21);
    match report {
        Report::Loss(mb, loss, n) => {
            b.push(0);
            b.extend_from_slice(&mb.to_le_bytes());
            b.extend_from_slice(&loss.to_le_bytes());
            b.extend_from_slice(&(n as u64).to_le_bytes());
        }
        Report::GradNorm(update, norm) => {
            b.push(1);
            b.extend_from_slice(&update.to_le_bytes());
            b.extend_from_slice(&norm.to_le_bytes());
        }
    }
    b
}

/// The inverse of [`encode_report`], for a report from worker `from`.
fn decode_report(bytes: &[u8], from: u32) -> Result<Report> {
    let mut f = Fields::new(bytes, "loss report");
    let report = match f.u8()? {
        0 => Report::Loss(f.u32()?, f.f64()?, f.usize()?),
        1 => Report::GradNorm(f.u32()?, f.f64()?),
        _ => {
            return Err(protocol(format!(
                "worker {from}'s report has an unknown kind"
            )));
        }
    };
    f.end()?;
    Ok(report)
}

/// A worker's epoch summary as bytes: what the chief's reports need (not the per-action
/// records, which stay with the worker).
fn encode_summary(o: &WorkerOutcome) -> Vec<u8> {
    let mut b = Vec::with_capacity(64 + o.losses.len() * 20);
    b.extend_from_slice(&o.worker.to_le_bytes());
    b.extend_from_slice(&o.loss_sum.to_le_bytes());
    b.extend_from_slice(&(o.correct as u64).to_le_bytes());
    b.extend_from_slice(&(o.samples as u64).to_le_bytes());
    b.extend_from_slice(&o.compute_s.to_le_bytes());
    b.extend_from_slice(&o.staleness_sum.to_le_bytes());
    b.extend_from_slice(&o.staleness_count.to_le_bytes());
    b.extend_from_slice(&o.peak_versions.to_le_bytes());
    b.extend_from_slice(&o.peak_stash_bytes.to_le_bytes());
    b.extend_from_slice(&o.bytes_sent.to_le_bytes());
    b.extend_from_slice(&o.peak_resident_bytes.to_le_bytes());
    b.extend_from_slice(&o.peak_device_bytes.to_le_bytes());
    b.extend_from_slice(&o.buffers_lent.to_le_bytes());
    b.extend_from_slice(&(o.losses.len() as u64).to_le_bytes());
    for &(mb, loss, n) in &o.losses {
        b.extend_from_slice(&mb.to_le_bytes());
        b.extend_from_slice(&loss.to_le_bytes());
        b.extend_from_slice(&(n as u64).to_le_bytes());
    }
    b.extend_from_slice(&(o.grad_norms.len() as u64).to_le_bytes());
    for &(update, norm) in &o.grad_norms {
        b.extend_from_slice(&update.to_le_bytes());
        b.extend_from_slice(&norm.to_le_bytes());
    }
    b
}

/// The inverse of [`encode_summary`]; `from` must be the worker the summary names.
fn decode_summary(bytes: &[u8], from: u32) -> Result<WorkerOutcome> {
    let mut f = Fields::new(bytes, "epoch summary");
    let worker = f.u32()?;
    if worker != from {
        return Err(protocol(format!(
            "worker {from} sent the summary of worker {worker}"
        )));
    }
    let loss_sum = f.f64()?;
    let correct = f.usize()?;
    let samples = f.usize()?;
    let compute_s = f.f64()?;
    let staleness_sum = f.f64()?;
    let staleness_count = f.u64()?;
    let peak_versions = f.u32()?;
    let peak_stash_bytes = f.u64()?;
    let bytes_sent = f.u64()?;
    let peak_resident_bytes = f.u64()?;
    let peak_device_bytes = f.u64()?;
    let buffers_lent = f.u64()?;
    // A loss record is 20 bytes, a gradient norm 12.
    let losses = f.records((from, "losses"), (20, Fields::usize), |f| {
        Ok((f.u32()?, f.f64()?, f.usize()?))
    })?;
    let grad_norms = f.records((from, "gradient norms"), (12, Fields::usize), |f| {
        Ok((f.u32()?, f.f64()?))
    })?;
    Ok(WorkerOutcome {
        worker,
        versions: Vec::new(),
        spans: Vec::new(),
        loss_sum,
        correct,
        samples,
        compute_s,
        staleness_sum,
        staleness_count,
        peak_versions,
        peak_stash_bytes,
        bytes_sent,
        losses,
        grad_norms,
        peak_resident_bytes,
        peak_device_bytes,
        buffers_lent,
    })
}

/// Every worker's summary of epoch `index`, in worker order (the chief's own is `own`).
fn gather_summaries<T: Transport + ?Sized>(
    ep: &mut T,
    own: WorkerOutcome,
    index: u32,
) -> Result<Vec<WorkerOutcome>> {
    let mut out = vec![own];
    for w in 1..ep.size() {
        let bytes = ep
            .recv(&control(w, CHIEF, TOPIC_SUMMARY, index, 0))?
            .into_bytes()?;
        out.push(decode_summary(&bytes, w)?);
    }
    Ok(out)
}

/// The stages whose replica 0 `state`'s worker is, each with the model index of its first
/// layer.
fn first_replica_stages<'s>(
    plan: &'s RunPlan,
    state: &'s WorkerState,
) -> impl Iterator<Item = (usize, &'s super::StageState)> + 's {
    let layout = plan.schedule.layout();
    state
        .stages
        .iter()
        .filter(move |st| layout.worker_for(st.stage, 0) == state.worker)
        .map(|st| (plan.partition.range(st.stage as usize).start, st))
}

/// The layers the chief receives from other workers: each with the worker that is replica 0
/// of its stage, in stage and layer order.
fn layers_from_other_workers(plan: &RunPlan) -> impl Iterator<Item = (u32, usize)> + '_ {
    let layout = plan.schedule.layout();
    (0..plan.schedule.stages())
        .map(move |s| (layout.worker_for(s, 0), s))
        .filter(|&(w, _)| w != CHIEF)
        .flat_map(|(w, s)| {
            plan.partition
                .range(s as usize)
                .map(move |layer| (w, layer))
        })
}

/// Sends what the chief asked for of every stage this worker is replica 0 of: the weights,
/// one message per layer, then the optimizer state: per layer, the first and second moments
/// (steps 2l and 2l + 1), each carrying the stage's update count.
fn send_state<T: Transport + ?Sized>(
    ep: &mut T,
    (plan, state): (&RunPlan, &WorkerState),
    index: u32,
    asked: &Drain,
) -> Result<()> {
    let to_chief = |topic: u32, step: u32| control(state.worker, CHIEF, topic, index, step);
    if asked.weights {
        for (first, st) in first_replica_stages(plan, state) {
            for (i, layer) in st.params.iter().enumerate() {
                let key = to_chief(TOPIC_WEIGHTS, (first + i) as u32);
                send_flat(ep, key, 0, flatten(layer.iter())?)?;
            }
        }
    }
    if asked.optimizer {
        for (first, st) in first_replica_stages(plan, state) {
            for (i, layer) in st.opt.parts().enumerate() {
                let l = (first + i) as u32;
                for k in 0..STATE_PARTS {
                    let key = to_chief(TOPIC_OPTIMIZER, STATE_PARTS as u32 * l + k as u32);
                    let flat = flatten(layer.iter().map(|p| p[k]))?;
                    send_flat(ep, key, st.opt.steps(), flat)?;
                }
            }
        }
    }
    Ok(())
}

/// The whole model's weights after segment `index`: the chief's own stages from `own`, the
/// others' from their messages, each checked against the layer shapes of `like`.
fn gather_weights<T: Transport + ?Sized>(
    ep: &mut T,
    plan: &RunPlan,
    own: &WorkerState,
    like: &Params,
    index: u32,
) -> Result<Params> {
    let mut params: Params = like.clone();
    for (first, st) in first_replica_stages(plan, own) {
        for (i, layer) in st.params.iter().enumerate() {
            params[first + i] = layer.clone();
        }
    }
    for (w, layer) in layers_from_other_workers(plan) {
        let m = ep.recv(&control(w, CHIEF, TOPIC_WEIGHTS, index, layer as u32))?;
        fill(params[layer].iter_mut(), m.tensor.host()?, layer)?;
    }
    Ok(params)
}

/// The whole model's optimizer state and per-layer update counts after segment `index`,
/// gathered like [`gather_weights`]; `like` is the whole model's parameters and its hidden
/// matrices ([`crate::model::Model::hidden_matrices`]), which shape the state.
fn gather_optimizer<T: Transport + ?Sized>(
    ep: &mut T,
    plan: &RunPlan,
    own: &WorkerState,
    (like, matrices): (&Params, &[Vec<crate::optim::ParamRole>]),
    cfg: &RunConfig,
    index: u32,
) -> Result<(OptimizerState, Vec<u64>)> {
    let mut opt: OptimizerState = Corrected::new(cfg.optimizer, like, matrices).into_state();
    let mut steps = vec![0u64; like.len()];
    for (first, st) in first_replica_stages(plan, own) {
        for (i, layer) in st.opt.state().into_iter().enumerate() {
            opt[first + i] = layer;
            steps[first + i] = st.opt.steps();
        }
    }
    for (w, layer) in layers_from_other_workers(plan) {
        let l = layer as u32;
        for k in 0..STATE_PARTS {
            let step = STATE_PARTS as u32 * l + k as u32;
            let m = ep.recv(&control(w, CHIEF, TOPIC_OPTIMIZER, index, step))?;
            steps[layer] = m.version;
            fill(
                opt[layer].iter_mut().map(|x| x.part_mut(k)),
                m.tensor.host()?,
                layer,
            )?;
        }
    }
    Ok((opt, steps))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome() -> WorkerOutcome {
        WorkerOutcome {
            worker: 3,
            versions: Vec::new(),
            spans: Vec::new(),
            loss_sum: 1.25,
            correct: 7,
            samples: 64,
            compute_s: 0.5,
            staleness_sum: f64::from_bits(0x3ff0_0000_0000_0001),
            staleness_count: 9,
            peak_versions: 4,
            peak_stash_bytes: 1 << 33,
            bytes_sent: 12_345,
            losses: vec![(0, 0.75, 32), (5, 0.5, 32)],
            grad_norms: vec![(0, 1.5), (1, f64::from_bits(0x3ff0_0000_0000_0003))],
            peak_resident_bytes: 3 << 30,
            peak_device_bytes: 21 << 30,
            buffers_lent: 240,
        }
    }

    #[test]
    fn summaries_round_trip_bit_for_bit() {
        let o = outcome();
        let back = decode_summary(&encode_summary(&o), 3).unwrap();
        assert_eq!(back.losses, o.losses);
        let norm_bits = |o: &WorkerOutcome| -> Vec<(u32, u64)> {
            o.grad_norms
                .iter()
                .map(|&(k, n)| (k, n.to_bits()))
                .collect()
        };
        assert_eq!(norm_bits(&back), norm_bits(&o));
        assert_eq!(back.staleness_sum.to_bits(), o.staleness_sum.to_bits());
        assert_eq!((back.correct, back.samples, back.peak_versions), (7, 64, 4));
        assert_eq!((back.peak_stash_bytes, back.bytes_sent), (1 << 33, 12_345));
        assert_eq!(back.peak_resident_bytes, 3 << 30);
        assert_eq!(back.peak_device_bytes, 21 << 30);
        assert_eq!(back.buffers_lent, 240);
    }

    #[test]
    fn the_chiefs_request_reads_back_and_malformed_ones_are_refused() {
        let rejoin = Drain {
            weights: true,
            optimizer: false,
            stop: false,
            rejoin: true,
        };
        let word = ChiefWord {
            drain: rejoin,
            joining: Some(5),
            unreplaced: false,
        };
        assert_eq!(parse_drain(&drain_bytes(word)).unwrap(), word);
        let plain = Drain {
            rejoin: false,
            ..rejoin
        };
        // No rank travels without a rejoin.
        let word = ChiefWord {
            drain: plain,
            unreplaced: true,
            ..word
        };
        let back = parse_drain(&drain_bytes(word)).unwrap();
        assert_eq!(
            (back.drain, back.joining, back.unreplaced),
            (plain, None, true)
        );
        for bad in [
            &[][..],
            &[1, 0, 0],
            &[1, 0, 0, 0, 0, 0, 0, 0],
            &[0, 0, 0, 0, 2, 0, 0, 0, 0],
            &[2, 0, 0, 0, 0, 0, 0, 0, 0],
        ] {
            assert!(parse_drain(bad).is_err(), "{bad:?}");
        }
        assert!(parse_drain(&[0; 10]).is_err());
    }

    #[test]
    fn reports_round_trip_and_hostile_ones_are_refused() {
        for r in [Report::Loss(7, 1.25, 512), Report::GradNorm(3, 0.75)] {
            let bytes = encode_report(r);
            assert_eq!(decode_report(&bytes, 1).unwrap(), r);
            for cut in 0..bytes.len() {
                assert!(decode_report(&bytes[..cut], 1).is_err(), "{r:?} cut {cut}");
            }
            let mut long = bytes.clone();
            long.push(0);
            assert!(decode_report(&long, 1).is_err(), "{r:?} with a byte more");
        }
        let mut unknown = encode_report(Report::GradNorm(3, 0.75));
        unknown[0] = 9;
        assert!(decode_report(&unknown, 1).is_err());
    }

    #[test]
    fn hostile_summaries_are_refused() {
        let bytes = encode_summary(&outcome());
        for cut in 0..bytes.len() {
            assert!(decode_summary(&bytes[..cut], 3).is_err(), "cut {cut}");
        }
        assert!(decode_summary(&bytes, 2).is_err());
        let mut lie = bytes.clone();
        // The loss count says far more records than the bytes hold (after the worker, six
        // 8-byte fields, the version count, the stash and sent bytes, the peak resident and
        // the peak device memory, and the buffers lent).
        let at = 4 + 8 * 6 + 4 + 8 * 5;
        lie[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode_summary(&lie, 3).is_err());
        // So does the gradient-norm count, after the two loss records.
        let mut lie = bytes.clone();
        let at = at + 8 + 2 * 20;
        lie[at..at + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        assert!(decode_summary(&lie, 3).is_err());
    }
}
