//! Running a whole schedule: one thread per worker on a transport mesh, one backend per
//! thread. The first worker to fail sets the shared abort flag; every other worker's blocked
//! send or receive returns within milliseconds, and the run's error is the first real failure
//! (naming its worker and action), never the "aborted" echoes.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::time::Instant;

use pipe_kernels::Backend;
use pipe_transport::{Abort, Transport};

use super::Setup;
use super::exec::{WorkerOutcome, WorkerState, run_worker};
use crate::error::{Result, StageError};

/// Options of [`run_threads`].
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Name of the threads (for debuggers), `pipe-w{N}` by default.
    pub thread_prefix: Option<String>,
}

/// Runs every worker's program on its own thread over `endpoints` (one per worker, in worker
/// order), with a backend made by `make_backend` on each thread. `states` are updated in place.
///
/// # Errors
/// The first worker failure ([`StageError::Worker`]), after every worker has stopped.
pub fn run_threads<T, B, F>(
    setup: &Setup<'_>,
    states: &mut [WorkerState],
    endpoints: Vec<T>,
    abort: &Abort,
    make_backend: F,
    opts: &RunOptions,
) -> Result<Vec<WorkerOutcome>>
where
    T: Transport,
    B: Backend,
    F: Fn() -> std::result::Result<B, pipe_kernels::KernelError> + Sync,
{
    if endpoints.len() != states.len() {
        return Err(StageError::Executor(format!(
            "{} endpoints for {} workers",
            endpoints.len(),
            states.len()
        )));
    }
    let first: Mutex<Option<StageError>> = Mutex::new(None);
    let t0 = Instant::now();
    let prefix = opts
        .thread_prefix
        .clone()
        .unwrap_or_else(|| "pipe-w".into());
    let fail = |e: StageError| {
        let aborted = matches!(&e, StageError::Worker { source, .. }
            if matches!(source.as_ref(), StageError::Transport(m) if m.contains("another worker failed")));
        if let Ok(mut slot) = first.lock() {
            if slot.is_none() && !aborted {
                *slot = Some(e);
            }
        }
        abort.trigger();
    };
    let outcomes: Vec<Option<WorkerOutcome>> = std::thread::scope(|scope| {
        let handles: Vec<_> = states
            .iter_mut()
            .zip(endpoints)
            .map(|(state, mut ep)| {
                let worker = state.worker;
                let make = &make_backend;
                let fail = &fail;
                std::thread::Builder::new()
                    .name(format!("{prefix}{worker}"))
                    .spawn_scoped(scope, move || {
                        let result = catch_unwind(AssertUnwindSafe(|| {
                            let be = make()?;
                            run_worker(&be, &mut ep, setup, state, t0)
                        }));
                        match result {
                            Ok(Ok(out)) => Some(out),
                            Ok(Err(e)) => {
                                fail(e);
                                None
                            }
                            Err(panic) => {
                                let msg = panic
                                    .downcast_ref::<&str>()
                                    .map(|s| s.to_string())
                                    .or_else(|| panic.downcast_ref::<String>().cloned())
                                    .unwrap_or_else(|| "panic".into());
                                let layout = setup.schedule.layout();
                                let (stage, replica) = layout.placement(worker);
                                fail(StageError::Worker {
                                    worker,
                                    stage,
                                    replica,
                                    action: "an action".into(),
                                    source: Box::new(StageError::Executor(format!(
                                        "panicked: {msg}"
                                    ))),
                                });
                                None
                            }
                        }
                    })
            })
            .collect();
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
        return Err(e);
    }
    outcomes
        .into_iter()
        .map(|o| o.ok_or_else(|| StageError::Executor("a worker stopped without an error".into())))
        .collect()
}
