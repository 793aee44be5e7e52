//! The worker driver: runs one worker given its rank, its backend, its transport endpoint and
//! the checked plan, and nothing else. Every launcher calls it: the in-process launcher (one
//! thread per worker, [`super::launch`]) today, a process or host launcher later.
//!
//! The driver is the only place where the worker core meets I/O: it times each action, hands
//! the core's outgoing messages to the transport, gives it the messages the transport
//! receives, and runs the ring all-reduce over the transport on the core's gradient tensors.
//! When the worker fails it tells every peer ([`Transport::abort`]) before returning the
//! error, so no peer waits forever.

use std::time::Instant;

use pipe_kernels::Backend;
use pipe_scheduler::Action;
use pipe_scheduler::planner::buckets::{BucketSize, StageBuckets};
use pipe_transport::Transport;
use pipe_transport::nccl::NcclComms;

use std::collections::BTreeMap;

use super::exec::{WorkerCore, WorkerOutcome, WorkerState};
use super::resume::{Planned, Resume, whole};

use super::allreduce::{BucketedAllReduce, all_reduce_gradients, last_backwards};
use super::between::{Between, Noticing};
use super::clock::{ActionClock, Timed};
use super::setup::Setup;
use crate::error::{Result, StageError};

/// Runs `state.worker`'s program of `setup.plan` over transport `t` with backend `be`,
/// updating `state`. `t0` is the run's start (span times are relative to it).
///
/// # Errors
/// [`StageError::Worker`] naming the worker, its stage position and replica, and the action
/// that failed (`start` or `end` outside the program). Every peer has been told.
pub fn run_worker<B: Backend, T: Transport + ?Sized>(
    be: &B,
    t: &mut T,
    setup: &Setup<'_>,
    state: &mut WorkerState,
    t0: Instant,
) -> Result<WorkerOutcome> {
    run_worker_with(be, t, setup, state, t0, &mut |_: &mut T| Ok(()))
}

/// [`run_worker`], running `between` with the transport after every action, and while a
/// receive waits for each message it notices ([`Between`]): how a worker in a process of its
/// own forwards the losses it computes to the chief, and how the chief collects them while
/// its own program runs.
///
/// # Errors
/// As [`run_worker`]; an error of `between` is the failure of the action before it.
pub fn run_worker_with<B: Backend, T: Transport + ?Sized>(
    be: &B,
    t: &mut T,
    setup: &Setup<'_>,
    state: &mut WorkerState,
    t0: Instant,
    between: &mut (dyn Between<T> + Send),
) -> Result<WorkerOutcome> {
    let program = &setup.plan.schedule.programs[state.worker as usize];
    drive(be, t, setup, state, (t0, &whole(program)), None, between)
}

/// Runs `state.worker`'s program resumed at a step boundary of its segment
/// ([`super::resume`]): `state` holds its stage's weights and optimizer state there, at
/// `resume.point.version`, and `resume.stash` the older versions it reads. It ends the segment
/// as the worker that ran the whole program would, with its weights and messages.
///
/// # Errors
/// As [`run_worker`].
pub fn resume_worker<B: Backend, T: Transport + ?Sized>(
    be: &B,
    t: &mut T,
    setup: &Setup<'_>,
    state: &mut WorkerState,
    resume: Resume,
    t0: Instant,
) -> Result<WorkerOutcome> {
    resume_worker_with(be, t, setup, state, resume, t0, &mut |_: &mut T| Ok(()))
}

/// [`resume_worker`], calling `between` between actions as [`run_worker_with`] does.
///
/// # Errors
/// As [`run_worker`], and `between`'s.
pub fn resume_worker_with<B: Backend, T: Transport + ?Sized>(
    be: &B,
    t: &mut T,
    setup: &Setup<'_>,
    state: &mut WorkerState,
    resume: Resume,
    t0: Instant,
    between: &mut (dyn Between<T> + Send),
) -> Result<WorkerOutcome> {
    let Resume { point, stash } = resume;
    let at = Some((stash, point.version, point.holds.clone()));
    drive(be, t, setup, state, (t0, &point.actions), at, between)
}

/// The older weight versions a resumed worker reads (moved into its core), its stage's
/// version, and the versions held past their last use ([`super::resume::ResumePoint::holds`]).
type ResumedAt = (
    BTreeMap<u32, crate::model::Params>,
    u32,
    BTreeMap<u32, usize>,
);

/// Starts a worker's core (from the segment's start, or `resumed` at a step boundary), runs
/// `actions` on it and ends it, naming the worker in any error and telling every peer of a
/// failure.
fn drive<B: Backend, T: Transport + ?Sized>(
    be: &B,
    t: &mut T,
    setup: &Setup<'_>,
    state: &mut WorkerState,
    (t0, actions): (Instant, &[Planned]),
    resumed: Option<ResumedAt>,
    between: &mut (dyn Between<T> + Send),
) -> Result<WorkerOutcome> {
    let w = state.worker;
    let (position, replica) = setup.plan.schedule.layout().placement(w);
    let wrap = |action: String, e: StageError| StageError::Worker {
        worker: w,
        position,
        replica,
        action,
        source: Box::new(e),
    };
    let mut progress = super::doctor::StopPoint::default();
    let core = match resumed {
        None => WorkerCore::new(be, setup, state),
        Some((stash, version, holds)) => {
            WorkerCore::resumed(be, setup, state, stash, (version, &holds))
        }
    };
    let result = match core {
        Ok(core) => run_program(be, t, (core, actions), state, t0, between, &mut progress),
        Err(e) => Err((None, e)),
    };
    progress.finished = result.is_ok();
    state.progress = progress;
    let result =
        result.map_err(|(a, e)| wrap(a.map_or_else(|| "start".to_string(), |a| a.to_string()), e));
    match result {
        Ok(core) => core.finish(be, state).map_err(|e| wrap("end".into(), e)),
        Err(e) => {
            if !e.is_abort_echo() {
                t.abort();
            }
            Err(e)
        }
    }
}

/// The program loop over `actions`; an error comes with the action it happened in (`None`:
/// at start).
fn run_program<'s, 'a, B: Backend, T: Transport + ?Sized>(
    be: &B,
    t: &mut T,
    (mut core, actions): (WorkerCore<'s, 'a>, &[Planned]),
    state: &WorkerState,
    t0: Instant,
    between: &mut (dyn Between<T> + Send),
    progress: &mut super::doctor::StopPoint,
) -> std::result::Result<WorkerCore<'s, 'a>, (Option<Action>, StageError)> {
    let setup = core.setup();
    let program = &setup.plan.schedule.programs[state.worker as usize];
    let m = WorkerMetrics::new(state.worker);
    let mut comms = Comms {
        nccl: NcclComms::default(),
        overlap: Overlap::new(program, setup.plan, be.device()),
        loans: super::loans::Loans::default(),
    };
    comms.loans.agree(be, t, program).map_err(|e| (None, e))?;
    let mut clock = ActionClock::new(be, t0, state.worker).map_err(|e| (None, e))?;
    for &Planned {
        pc,
        action: a,
        replayed_at,
        moved_at,
    } in actions
    {
        core.replaying(replayed_at, pc);
        core.moved(moved_at);
        let opened = clock.open(be).map_err(|e| (Some(a), e))?;
        progress.at = Some(a);
        let bytes = if between.notices_any() {
            let mut noticing = Noticing::new(t, between);
            let stepped = step(be, &mut noticing, &mut core, &mut comms, (pc, a));
            let failure = noticing.failure();
            stepped.map_err(|e| failure.unwrap_or(e))
        } else {
            step(be, t, &mut core, &mut comms, (pc, a))
        };
        let bytes = bytes.map_err(|e| (Some(a), e))?;
        let compute = a.kind().is_compute() || matches!(a, Action::Update { .. });
        // A device backend only queued the action's kernels: the clock waits for them or
        // marks them (`clock`), and gives the spans it has read.
        let timed = clock.close(be, opened, a, compute);
        record_spans(&m, &mut core.outcome, timed.map_err(|e| (Some(a), e))?);
        between.run(t).map_err(|e| (Some(a), e))?;
        *progress = super::doctor::StopPoint {
            at: None,
            completed: pc + 1,
            last_completed: Some(a),
            finished: false,
        };
        let held = core.versions_held() as u32;
        m.moved(bytes);
        m.queue.set(t.buffered() as f64);
        m.stash_versions.set(f64::from(held));
        let stash = core.stash_bytes() as u64;
        m.stash_bytes.set(stash as f64);
        let out = &mut core.outcome;
        out.peak_versions = out.peak_versions.max(held);
        out.peak_stash_bytes = out.peak_stash_bytes.max(stash);
        out.bytes_sent += bytes.0;
    }
    let last = progress.last_completed;
    record_spans(
        &m,
        &mut core.outcome,
        clock.finish().map_err(|e| (last, e))?,
    );
    core.replaying(None, program.len());
    // The borrowers have copied every lent buffer before the core's tensors may go.
    comms
        .loans
        .settle(t)
        .map_err(|e| (progress.last_completed, e))?;
    // Read once the program has run: its activations and transients have come and gone.
    core.outcome.peak_resident_bytes = crate::limits::process_peak_bytes().unwrap_or(0);
    core.outcome.peak_device_bytes = be.peak_memory().unwrap_or(0);
    core.outcome.buffers_lent = comms.loans.lent();
    Ok(core)
}

/// A worker's metrics (the `metrics` crate: no cost without a recorder), labelled with its
/// rank. `docs/pipeline.md` lists them.
struct WorkerMetrics {
    busy: metrics::Gauge,
    idle: metrics::Gauge,
    sent: metrics::Counter,
    received: metrics::Counter,
    queue: metrics::Gauge,
    stash_versions: metrics::Gauge,
    stash_bytes: metrics::Gauge,
}

impl WorkerMetrics {
    fn new(worker: u32) -> Self {
        let w = worker.to_string();
        WorkerMetrics {
            busy: metrics::gauge!("pipe_worker_busy_seconds", "worker" => w.clone()),
            idle: metrics::gauge!("pipe_worker_idle_seconds", "worker" => w.clone()),
            sent: metrics::counter!("pipe_bytes_sent_total", "worker" => w.clone()),
            received: metrics::counter!("pipe_bytes_received_total", "worker" => w.clone()),
            queue: metrics::gauge!("pipe_queue_depth", "worker" => w.clone()),
            stash_versions: metrics::gauge!("pipe_stash_versions", "worker" => w.clone()),
            stash_bytes: metrics::gauge!("pipe_stash_bytes", "worker" => w),
        }
    }

    /// One action of `secs`, computing or not.
    fn timed(&self, compute: bool, secs: f64) {
        if compute {
            self.busy.increment(secs);
        } else {
            self.idle.increment(secs);
        }
    }

    /// One action that moved `bytes` (sent, received).
    fn moved(&self, (sent, received): (u64, u64)) {
        self.sent.increment(sent);
        self.received.increment(received);
    }
}

/// Adds the spans the clock has read to the worker's metrics and outcome: each action's time,
/// computing or not, and its span on the timeline.
fn record_spans(m: &WorkerMetrics, out: &mut WorkerOutcome, timed: Vec<Timed>) {
    for Timed { span, compute } in timed {
        let secs = span.end - span.start;
        m.timed(compute, secs);
        if compute {
            out.compute_s += secs;
        }
        out.spans.push(span);
    }
}

/// A worker's collective state between actions: its NCCL communicators and the all-reduces
/// in flight.
struct Comms {
    nccl: NcclComms,
    overlap: Overlap,
    /// The device buffers this worker has lent to processes of its host and not had back.
    loans: super::loans::Loans,
}

/// The all-reduces a worker starts during backward passes ([`BucketedAllReduce`]): which
/// passes start one, and those in flight until their `AllReduce` action. Only for gradients
/// in host memory (device gradients are summed by NCCL or on the devices, at the action).
struct Overlap {
    /// Program counter of a stage's last backward pass before an all-reduce: that update.
    starts: std::collections::HashMap<usize, u32>,
    /// Bucket size of each stage and the wire precision ([`super::RunPlan::buckets`] and
    /// [`super::RunPlan::allreduce_wire`]).
    buckets: StageBuckets,
    wire: pipe_transport::frame::WireDType,
    in_flight: Vec<BucketedAllReduce>,
}

impl Overlap {
    fn new(program: &[Action], plan: &super::RunPlan, device: pipe_kernels::Device) -> Self {
        let starts = if device == pipe_kernels::Device::Host {
            last_backwards(program)
        } else {
            Default::default()
        };
        Overlap {
            starts,
            buckets: (0..plan.schedule.stages())
                .map(|s| plan.bucket_size_of(s))
                .collect(),
            wire: plan.allreduce_wire,
            in_flight: Vec::new(),
        }
    }

    /// The ring settings of `stage`'s all-reduce: its bucket size and the wire precision.
    fn ring(&self, stage: u32) -> (BucketSize, pipe_transport::frame::WireDType) {
        let size = self
            .buckets
            .get(stage as usize)
            .unwrap_or(super::DEFAULT_BUCKET_SIZE);
        (size, self.wire)
    }

    /// Runs backward pass `a` at `pc`, starting its stage's all-reduce of `update` bucket by
    /// bucket as the pass completes layers.
    fn backward<T: Transport + ?Sized>(
        &mut self,
        be: &dyn Backend,
        t: &mut T,
        core: &mut WorkerCore<'_, '_>,
        (pc, a): (usize, Action),
        (stage, update): (u32, u32),
    ) -> Result<()> {
        let group = core.replica_group(stage)?;
        let mut started: Option<BucketedAllReduce> = None;
        let ring = self.ring(stage);
        core.compute_notify(be, pc, a, &mut |j, grads| {
            let ar = started.get_or_insert_with(|| {
                BucketedAllReduce::new(&group, (stage, update), grads, ring)
            });
            ar.layers_ready(t, j, grads)
        })?;
        self.in_flight.extend(started);
        Ok(())
    }

    /// Moves every all-reduce in flight on with what has arrived.
    fn poll<T: Transport + ?Sized>(
        &mut self,
        t: &mut T,
        core: &mut WorkerCore<'_, '_>,
    ) -> Result<()> {
        for ar in &mut self.in_flight {
            ar.poll(t, core.gradients_mut(ar.names().0)?)?;
        }
        Ok(())
    }

    /// The all-reduce of `stage`'s `update` if one is in flight, taken out.
    fn take(&mut self, stage: u32, update: u32) -> Option<BucketedAllReduce> {
        let at = self
            .in_flight
            .iter()
            .position(|ar| ar.names() == (stage, update))?;
        Some(self.in_flight.swap_remove(at))
    }
}

/// One action: compute on the core, or move data between the core and the transport.
/// Returns the payload bytes it sent and received.
fn step<B: Backend, T: Transport + ?Sized>(
    be: &B,
    t: &mut T,
    core: &mut WorkerCore<'_, '_>,
    comms: &mut Comms,
    (pc, a): (usize, Action),
) -> Result<(u64, u64)> {
    if !comms.overlap.in_flight.is_empty() {
        comms.overlap.poll(t, core)?;
    }
    match a {
        Action::SendActivation { .. } | Action::SendGradient { .. } => {
            let m = core.outgoing(a)?;
            let bytes = m.tensor.bytes() as u64;
            comms.loans.send(be, t, m)?;
            return Ok((bytes, 0));
        }
        Action::RecvActivation { .. } | Action::RecvGradient { .. } => {
            let m = super::loans::receive(be, t, &core.incoming_key(a)?)?;
            let bytes = m.tensor.bytes() as u64;
            core.deliver(a, m)?;
            return Ok((0, bytes));
        }
        Action::Backward { stage, .. } | Action::BackwardWeight { stage, .. } => {
            match comms.overlap.starts.get(&pc) {
                Some(&update) => comms
                    .overlap
                    .backward(be, t, core, (pc, a), (stage, update))?,
                None => core.compute(be, pc, a)?,
            }
        }
        Action::AllReduce { stage, update } => {
            let in_flight = comms.overlap.take(stage, update);
            let (group, grads) = core.all_reduce_gradients(be, stage)?;
            let total: u64 = grads.iter().flatten().map(|g| g.bytes() as u64).sum();
            if let Some(ar) = in_flight {
                ar.finish(t, grads)?;
            } else {
                let ring = comms.overlap.ring(stage);
                // NCCL sums in f32 only.
                let on_gpus = ring.1 == pipe_transport::frame::WireDType::F32
                    && comms.nccl.all_reduce(
                        t,
                        be,
                        &group,
                        stage,
                        grads.iter_mut().flatten().collect(),
                    )?;
                if !on_gpus {
                    all_reduce_gradients(be, t, &group, (stage, update), grads, ring)?;
                }
            }
            // A ring sends and receives 2 (n - 1) chunks of 1/n of the buffer.
            let n = group.len().max(1) as u64;
            let moved = 2 * (n - 1) * total / n;
            return Ok((moved, moved));
        }
        Action::Update { stage, update } => {
            let (mut sent, mut received) = (0, 0);
            let mut norms = Vec::new();
            // The stage's gradients are readied for the step (with, under a flush policy
            // with clipping, every other stage of this worker): stages sharing a tied
            // parameter swap their raw gradients of it first.
            for ready in core.stages_to_prepare(stage, update) {
                let (sends, recvs) = core.tie_exchange(be, ready, update)?;
                for m in sends {
                    sent += m.tensor.bytes() as u64;
                    t.send(m)?;
                }
                for (key, from) in recvs {
                    let m = t.recv(&key)?;
                    received += m.tensor.bytes() as u64;
                    core.deliver_tied(ready, from, m.tensor)?;
                }
                norms.extend(core.prepare_stage(be, pc, ready, update)?);
            }
            // Gradient clipping: this worker's norms out, the other stages' in.
            for m in norms {
                sent += m.tensor.bytes() as u64;
                t.send(m)?;
            }
            for key in core.norm_keys(stage, update)? {
                let m = t.recv(&key)?;
                received += m.tensor.bytes() as u64;
                core.deliver_norm(m)?;
            }
            core.compute(be, pc, a)?;
            return Ok((sent, received));
        }
        Action::SendChunk { .. } | Action::RecvChunk { .. } => {
            return Err(StageError::Executor(
                "expanded ring all-reduce steps are for the simulator; lower the schedule \
                 with collective all-reduces"
                    .into(),
            ));
        }
        _ => core.compute(be, pc, a)?,
    }
    Ok((0, 0))
}
