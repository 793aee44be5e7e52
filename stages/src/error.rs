use pipe_kernels::KernelError;
use thiserror::Error;

/// Errors raised while building models, reading data or training.
#[derive(Debug, Error)]
pub enum StageError {
    /// A kernel rejected its operands.
    #[error("layer {layer} ({kind}), {op}: {source}")]
    Kernel {
        /// Index of the layer in the model.
        layer: usize,
        /// Layer kind (`linear`, `relu`, ...).
        kind: &'static str,
        /// Which pass (`forward`, `backward_input`, `backward_params`).
        op: &'static str,
        /// The kernel's error.
        source: KernelError,
    },
    /// A kernel failure outside any layer (loss, optimizer).
    #[error(transparent)]
    Backend(#[from] KernelError),
    /// The model description is invalid.
    #[error("model: {0}")]
    Model(String),
    /// A data file is missing, truncated or malformed.
    #[error("data {source_name}: {reason}")]
    Data {
        /// File or dataset name.
        source_name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A run stalled past its bound: the hang doctor's report (every worker's state, the
    /// wait-for graph and the cause).
    #[error("the run stalled: {0}")]
    Stalled(String),
    /// A configuration value is invalid.
    #[error("config: {0}")]
    Config(String),
    /// Bad input that names itself (the flag, file or value, and what is wrong with it).
    #[error("{0}")]
    Input(String),
    /// Launching worker processes, or a worker process's exit: `bad_input` when the cause
    /// is what the user gave (a worker that exited with status 2, a port past the range).
    #[error("{why}")]
    Launch {
        /// What failed.
        why: String,
        /// Whether the user's input caused it.
        bad_input: bool,
    },
    /// A worker process ended unsuccessfully (not with status 2): killed, crashed or failed.
    #[error("worker {worker} {status}")]
    Exited {
        /// Its rank.
        worker: u32,
        /// How it ended (`was killed by signal 9`, `exited with status 1`).
        status: String,
    },
    /// A request past a resource limit ([`crate::limits`]): what was asked, the limit, why.
    #[error("limit: {0}")]
    Limit(String),
    /// A checkpoint that is missing, corrupted, truncated or made for another model (bad
    /// input: exit 2).
    #[error("checkpoint {0}")]
    Checkpoint(String),
    /// A checkpoint that could not be written (a failure at run time).
    #[error("writing checkpoint {0}")]
    CheckpointWrite(String),
    /// Writing a log failed.
    #[error("writing {path}: {source}")]
    Io {
        /// File being written.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Moving a message between workers failed.
    #[error("transport: {0}")]
    Transport(#[from] pipe_transport::TransportError),
    /// A schedule request was impossible, or a schedule failed its checks or its version plan.
    #[error("schedule: {0}")]
    Schedule(#[from] pipe_scheduler::ScheduleError),
    /// The executor met a state its program should not allow (missing input, freed version).
    #[error("executor: {0}")]
    Executor(String),
    /// A worker of a pipelined run failed; every other worker was stopped.
    #[error("worker {worker} (stage {position}, replica {replica}) failed at {action}: {source}")]
    Worker {
        /// The worker.
        worker: u32,
        /// Its pipeline position (the stage it holds; with several chunks per worker, the
        /// first of them).
        position: u32,
        /// Its replica index.
        replica: u32,
        /// The action it was running (text form), or `start`/`end`.
        action: String,
        /// What went wrong.
        source: Box<StageError>,
    },
    /// A loss, gradient or weight that is not finite (the guard stops training there;
    /// checkpoints already written are kept).
    #[error(
        "{what} is not finite at update {update}{detail}: lower the learning rate (checkpoints written before it are kept)"
    )]
    NonFinite {
        /// What: the loss of a microbatch, the gradient of a parameter, a parameter after the
        /// optimizer's step, or the test loss.
        what: String,
        /// The update (over the whole run, from 1).
        update: u64,
        /// Where it came from, when known (`; ...`), or empty.
        detail: String,
    },
    /// A worker process's run diverged (a loss, gradient or weight not finite): its own
    /// message, which its launcher reports instead of its exit status.
    #[error("{message}")]
    WorkerDiverged {
        /// The worker process's rank.
        worker: u32,
        /// The update (over the whole run, from 1).
        update: u64,
        /// The worker's error, as it wrote it.
        message: String,
    },
    /// Training produced a non-finite loss.
    #[error("loss became {loss} at step {step}: lower the learning rate")]
    Diverged {
        /// Optimizer step at which it happened.
        step: u64,
        /// The loss value.
        loss: f64,
    },
}

impl StageError {
    /// True when the error was caused by user input (configuration, model, data files), so a
    /// command-line front end should exit with status 2.
    pub fn is_bad_input(&self) -> bool {
        match self {
            StageError::Model(_)
            | StageError::Data { .. }
            | StageError::Config(_)
            | StageError::Input(_)
            | StageError::Limit(_)
            | StageError::Checkpoint(_) => true,
            StageError::Schedule(e) => e.is_bad_input(),
            StageError::Transport(e) => e.is_bad_input(),
            StageError::Launch { bad_input, .. } => *bad_input,
            StageError::Worker { source, .. } => source.is_bad_input(),
            _ => false,
        }
    }

    /// The worker whose receive of data timed out, what it waited for and how long, seen
    /// through a worker's report; `None` for every other error.
    pub fn stall(&self) -> Option<(u32, pipe_transport::Key, std::time::Duration)> {
        match self {
            StageError::Worker { worker, .. } => self
                .stall_key()
                .map(|(key, waited)| (*worker, *key, waited)),
            _ => None,
        }
    }

    /// [`StageError::stall`]'s awaited key and wait, for a [`crate::pipeline::doctor::StopReport`].
    pub fn stall_key(&self) -> Option<(&pipe_transport::Key, std::time::Duration)> {
        match self {
            StageError::Worker { source, .. } => match source.as_ref() {
                StageError::Transport(pipe_transport::TransportError::Timeout { key, waited }) => {
                    Some((key, *waited))
                }
                other => other.stall_key(),
            },
            _ => None,
        }
    }

    /// The update at which training diverged (a loss, gradient or weight not finite, or a
    /// diverged mean loss), seen through a worker's report; `None` for every other error.
    /// A divergence is the run's arithmetic, not a fault of the worker that met it: any
    /// replica, and any restart, would meet it again, so it is neither survived nor
    /// restarted.
    pub fn diverged_at(&self) -> Option<u64> {
        match self {
            StageError::NonFinite { update, .. } => Some(*update),
            StageError::Diverged { step, .. } => Some(*step),
            StageError::WorkerDiverged { update, .. } => Some(*update),
            StageError::Worker { source, .. } => source.diverged_at(),
            _ => None,
        }
    }

    /// True when this worker failed on a peer that had gone (its endpoint closed, its
    /// connection lost, a send that could not reach it): a failure that may follow another
    /// worker's, which a launcher that sees both reports instead.
    pub fn blames_a_peer(&self) -> bool {
        use pipe_transport::TransportError as T;
        match self {
            StageError::Transport(T::Closed { .. } | T::Lost { .. } | T::Send { .. }) => true,
            StageError::Worker { source, .. } => source.blames_a_peer(),
            _ => false,
        }
    }

    /// True when this worker stopped only because another worker failed and said so: not the
    /// run's cause, which a launcher reports instead.
    pub fn is_abort_echo(&self) -> bool {
        match self {
            StageError::Transport(pipe_transport::TransportError::Aborted { .. }) => true,
            StageError::Worker { source, .. } => source.is_abort_echo(),
            _ => false,
        }
    }
}

/// Result type of this crate.
pub type Result<T, E = StageError> = std::result::Result<T, E>;
