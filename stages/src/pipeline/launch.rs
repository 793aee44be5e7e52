//! The in-process launcher: every worker of a run as a thread of this process, each with its
//! own backend, all calling the one worker driver ([`super::run_worker`]). A worker that fails
//! (or panics) tells its peers through the transport; their blocked calls return at once, and
//! the run's error is the first real failure (naming its worker and action), never the
//! "stopped because worker N failed" echoes of the others.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use pipe_kernels::Backend;
use pipe_transport::Transport;

use super::driver::{resume_worker, run_worker};
use super::exec::{WorkerOutcome, WorkerState};
use super::resume::Resume;
use super::setup::Setup;
use crate::error::{Result, StageError};

/// Runs every worker's program on its own thread (named `pipe-w{N}`) over `endpoints` (one per
/// worker, in worker order), with a backend made by `make_backend(worker)` on each thread. `states`
/// are updated in place.
///
/// # Errors
/// The first worker failure ([`StageError::Worker`]), after every worker has stopped.
pub fn run_threads<T, B, F>(
    setup: &Setup<'_>,
    states: &mut [WorkerState],
    endpoints: Vec<T>,
    make_backend: F,
) -> Result<Vec<WorkerOutcome>>
where
    T: Transport,
    B: Backend,
    F: Fn(u32) -> std::result::Result<B, pipe_kernels::KernelError> + Sync,
{
    run_threads_reporting(setup, states, endpoints, make_backend, None)
}

/// What the launching thread does while the workers run: receive what the loss stage reports
/// ([`Setup::progress`]) and hand each to the function.
pub type Progress<'p> = (
    crossbeam_channel::Receiver<super::Report>,
    &'p mut dyn FnMut(super::Report) -> Result<()>,
);

/// [`run_threads`], with this thread handling `progress` while the workers run. An error of
/// the progress function (an observer that cannot write its log) is the run's error once
/// the workers have finished.
///
/// # Errors
/// As [`run_threads`].
pub fn run_threads_reporting<T, B, F>(
    setup: &Setup<'_>,
    states: &mut [WorkerState],
    endpoints: Vec<T>,
    make_backend: F,
    progress: Option<Progress<'_>>,
) -> Result<Vec<WorkerOutcome>>
where
    T: Transport,
    B: Backend,
    F: Fn(u32) -> std::result::Result<B, pipe_kernels::KernelError> + Sync,
{
    run_all(setup, states, (endpoints, make_backend), progress, None)
}

/// [`run_threads_reporting`] with every worker resumed at a step boundary of its segment
/// ([`super::resume`]): `states` hold each worker's stage state there, and `resumes` (one per
/// worker, in worker order) what it runs, each moved into its worker's core.
///
/// # Errors
/// As [`run_threads`]; a resume for each worker missing.
pub fn run_threads_resumed<T, B, F>(
    setup: &Setup<'_>,
    states: &mut [WorkerState],
    (endpoints, make_backend): (Vec<T>, F),
    progress: Option<Progress<'_>>,
    resumes: Vec<Resume>,
) -> Result<Vec<WorkerOutcome>>
where
    T: Transport,
    B: Backend,
    F: Fn(u32) -> std::result::Result<B, pipe_kernels::KernelError> + Sync,
{
    if resumes.len() != states.len() {
        return Err(StageError::Executor(format!(
            "{} resumes for {} workers",
            resumes.len(),
            states.len()
        )));
    }
    run_all(
        setup,
        states,
        (endpoints, make_backend),
        progress,
        Some(resumes),
    )
}

/// Runs every worker on its own thread, each from its segment's start or `resumed`.
fn run_all<T, B, F>(
    setup: &Setup<'_>,
    states: &mut [WorkerState],
    (endpoints, make_backend): (Vec<T>, F),
    mut progress: Option<Progress<'_>>,
    resumed: Option<Vec<Resume>>,
) -> Result<Vec<WorkerOutcome>>
where
    T: Transport,
    B: Backend,
    F: Fn(u32) -> std::result::Result<B, pipe_kernels::KernelError> + Sync,
{
    if endpoints.len() != states.len() {
        return Err(StageError::Executor(format!(
            "{} endpoints for {} workers",
            endpoints.len(),
            states.len()
        )));
    }
    // The run's cause: the first failure, unless it blamed a peer and another worker's own
    // failure came after it. A worker that fails tells its peers before it is heard here,
    // so one of them may find it gone first.
    let first: Mutex<Option<StageError>> = Mutex::new(None);
    let t0 = Instant::now();
    let fail = |e: StageError| {
        if let Ok(mut slot) = first.lock() {
            let outranks = match &*slot {
                None => true,
                Some(held) => held.blames_a_peer() && !e.blames_a_peer(),
            };
            if outranks && !e.is_abort_echo() {
                *slot = Some(e);
            }
        }
    };
    // Every worker thread holds a sender of `done` and drops it when it ends, so the progress
    // loop below learns at once that the last has ended (the channel disconnects) rather than
    // by polling: a run cut into many short segments pays for every wait here.
    let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(0);
    // Resumed programs may send again what a peer no longer reads, after that peer has
    // finished: every endpoint stays open until every worker has finished, so such a copy is
    // dropped with the segment rather than failing its sender.
    let line = resumed.as_ref().map(|_| FinishLine::new(states.len()));
    let mut resumes: Vec<Option<Resume>> = resumed
        .map(|r| r.into_iter().map(Some).collect())
        .unwrap_or_default();
    let outcomes: Vec<Option<WorkerOutcome>> = std::thread::scope(|scope| {
        let handles: Vec<_> = states
            .iter_mut()
            .zip(endpoints)
            .map(|(state, mut ep)| {
                let worker = state.worker;
                let (make, fail, line) = (&make_backend, &fail, line.as_ref());
                let done = done_tx.clone();
                let resume = resumes.get_mut(worker as usize).and_then(Option::take);
                std::thread::Builder::new()
                    .name(format!("pipe-w{worker}"))
                    .spawn_scoped(scope, move || {
                        let _done = done;
                        let run = (&mut ep, resume);
                        let out = worker_thread(setup, state, run, || make(worker), t0, fail);
                        if let Some(line) = line {
                            line.reach();
                        }
                        // Everything this worker sent reaches its peers before it lets go.
                        if let Err(e) = ep.close() {
                            fail(StageError::Transport(e));
                        }
                        out
                    })
            })
            .collect();
        drop(done_tx);
        // A worker whose thread never started never reaches the line.
        if let Some(line) = &line {
            handles
                .iter()
                .filter(|h| h.is_err())
                .for_each(|_| line.leave());
        }
        if let Some((rx, on_loss)) = progress.as_mut() {
            relay_progress(rx, &mut **on_loss, &done_rx, &fail);
        }
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h.join().ok().flatten(),
                Err(e) => {
                    fail(StageError::Executor(format!(
                        "cannot start a worker thread: {e}"
                    )));
                    None
                }
            })
            .collect()
    });
    if let Some(e) = first.into_inner().ok().flatten() {
        return Err(diagnosed(setup, states, e));
    }
    outcomes
        .into_iter()
        .map(|o| o.ok_or_else(|| StageError::Executor("a worker stopped without an error".into())))
        .collect()
}

/// One worker thread's life: its backend made, its worker run, a failure or panic told to
/// its peers and to `fail`.
fn worker_thread<T: Transport, B: Backend>(
    setup: &Setup<'_>,
    state: &mut WorkerState,
    (ep, resume): (&mut T, Option<Resume>),
    make: impl FnOnce() -> std::result::Result<B, pipe_kernels::KernelError>,
    t0: Instant,
    fail: &dyn Fn(StageError),
) -> Option<WorkerOutcome> {
    let worker = state.worker;
    let mut resume = resume;
    let result = catch_unwind(AssertUnwindSafe(|| {
        let be = make()?;
        let mut outcome = None;
        // On the backend's own pool: its kernels then start without a thread switch.
        be.run_within(&mut || {
            outcome = Some(match resume.take() {
                Some(r) => resume_worker(&be, ep, setup, state, r, t0),
                None => run_worker(&be, ep, setup, state, t0),
            })
        })?;
        outcome.unwrap_or_else(|| Err(StageError::Executor("the worker did not run".into())))
    }));
    match result {
        Ok(Ok(out)) => Some(out),
        Ok(Err(e)) => {
            // The driver has told its peers; a backend that failed to start never reached it.
            if !e.is_abort_echo() {
                ep.abort();
            }
            fail(e);
            None
        }
        Err(panic) => {
            ep.abort();
            fail(panicked(setup, worker, panic.as_ref()));
            None
        }
    }
}

/// Where the worker threads of a run wait for each other before they close their endpoints.
struct FinishLine {
    left: Mutex<usize>,
    reached: Condvar,
}

impl FinishLine {
    fn new(workers: usize) -> Self {
        FinishLine {
            left: Mutex::new(workers),
            reached: Condvar::new(),
        }
    }

    /// One worker will not come.
    fn leave(&self) {
        if let Ok(mut left) = self.left.lock() {
            *left = left.saturating_sub(1);
            self.reached.notify_all();
        }
    }

    /// One worker has finished; waits until every one has.
    fn reach(&self) {
        self.leave();
        let Ok(mut left) = self.left.lock() else {
            return;
        };
        while *left > 0 {
            left = match self.reached.wait(left) {
                Ok(l) => l,
                Err(_) => return,
            };
        }
    }
}

/// Hands each report of the loss stage to `on_loss` until the last worker ends (`done`
/// disconnects), then those still queued; an error of `on_loss` goes to `fail`.
fn relay_progress(
    rx: &crossbeam_channel::Receiver<super::Report>,
    on_loss: &mut dyn FnMut(super::Report) -> Result<()>,
    done_rx: &crossbeam_channel::Receiver<()>,
    fail: &dyn Fn(StageError),
) {
    let mut report = |r| {
        if let Err(e) = on_loss(r) {
            fail(e);
        }
    };
    loop {
        crossbeam_channel::select! {
            recv(rx) -> r => match r {
                Ok(r) => report(r),
                // No sender left: only the workers' end is still to come.
                Err(_) => {
                    let _ = done_rx.recv();
                    break;
                }
            },
            // Nothing is ever sent on `done`: this fires when the last worker ends.
            recv(done_rx) -> _ => break,
        }
    }
    while let Ok(r) = rx.try_recv() {
        report(r);
    }
}

/// The run's error: a stall diagnosed by the hang doctor from every worker's progress, any
/// other error as it is.
fn diagnosed(setup: &Setup<'_>, states: &[WorkerState], e: StageError) -> StageError {
    let Some((worker, key, waited)) = e.stall() else {
        return e;
    };
    let stops: Vec<_> = states.iter().map(|s| Some(s.progress)).collect();
    StageError::Stalled(super::doctor::diagnose(
        &setup.plan.schedule,
        &stops,
        worker,
        &key,
        waited,
    ))
}

/// The error for a worker thread that panicked.
fn panicked(setup: &Setup<'_>, worker: u32, panic: &(dyn std::any::Any + Send)) -> StageError {
    let msg = crate::contain::panic_message(panic);
    let (position, replica) = setup.plan.schedule.layout().placement(worker);
    StageError::Worker {
        worker,
        position,
        replica,
        action: "an action".into(),
        source: Box::new(StageError::Executor(format!("panicked: {msg}"))),
    }
}
