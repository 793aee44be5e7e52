use thiserror::Error;

/// Everything that can go wrong while building, checking or simulating a schedule.
///
/// Variants that describe a broken schedule carry the rendered worker-by-step grid with the
/// failing cell marked, so the message alone shows where the program went wrong.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ScheduleError {
    /// The request itself is impossible: zero stages, a replica list of the wrong length, too few
    /// microbatches for the policy, and so on. Always caused by user input.
    #[error("{0}")]
    Spec(String),
    /// An action's text form could not be parsed.
    #[error("cannot parse action {text:?}: {reason}")]
    Parse {
        /// The offending text.
        text: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A program breaks a rule of the schedule language (see [`crate::validate`]).
    #[error("worker {worker}, step {step} ({action}): {reason}\n{grid}")]
    Invalid {
        /// Worker whose program is wrong.
        worker: u32,
        /// Index of the failing action in that worker's program.
        step: usize,
        /// The failing action in text form (or `end` when something is missing at the end).
        action: String,
        /// What rule it breaks.
        reason: String,
        /// The worker-by-step grid around the failing cell.
        grid: String,
    },
    /// The untimed dry run stopped with workers waiting on each other.
    #[error("deadlock: {reason}\n{grid}")]
    Deadlock {
        /// Which workers wait on what.
        reason: String,
        /// The grid with each blocked worker's current action marked.
        grid: String,
    },
    /// A cost model does not fit the schedule or holds impossible values.
    #[error("cost model: {0}")]
    Cost(String),
    /// A layer profile that cannot be used.
    #[error("profile: {0}")]
    Profile(String),
    /// A partitioning request that has no answer.
    #[error("plan: {0}")]
    Plan(String),
}

impl ScheduleError {
    /// True when the error was caused by user input (a request, a text schedule or a cost
    /// file), so a command-line front end should exit with status 2.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            ScheduleError::Spec(_)
                | ScheduleError::Parse { .. }
                | ScheduleError::Cost(_)
                | ScheduleError::Profile(_)
                | ScheduleError::Plan(_)
        )
    }
}

/// Shorthand for results in this crate.
pub type Result<T, E = ScheduleError> = std::result::Result<T, E>;
