//! What a run reports as it goes: the [`Observer`] every trainer calls as its start moves on
//! to the next phase, after each update and epoch, when a worker stops, when the layout
//! changes, and with a worker process's timeline.
//! It lives with the pipeline because two of its reports are the pipeline's own (a worker's
//! stop, a layout change); the statistics it carries are the trainers' ([`crate::train`]).

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::pipeline::doctor::StopReport;
use crate::pipeline::survive::LayoutChange;
use crate::train::{EpochStats, EvalStats, LostStats, StepStats};

/// A phase of a run's start that only the launcher sees begin; the first update follows the
/// last. (The phases before them, reading the data, profiling and planning, are the caller's.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StartPhase {
    /// The starting weights are built, or read from a checkpoint.
    Weights,
    /// The workers start (threads or processes) and connect to each other.
    Workers,
    /// Every worker is up: the first update runs.
    FirstUpdate,
}

impl StartPhase {
    /// What the phase does, for a line that announces it.
    pub fn describe(self) -> &'static str {
        match self {
            StartPhase::Weights => "building the model",
            StartPhase::Workers => "starting workers and connecting them",
            StartPhase::FirstUpdate => "the first update",
        }
    }
}

/// A phase of a run's start, once it has ended: what it was and how long it took, for a log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PhaseRecord {
    /// What it did (`reading and checking the corpus`, `profiling`, ...).
    pub phase: String,
    /// Seconds from the command's start to the phase's.
    pub began_s: f64,
    /// Seconds it took.
    pub seconds: f64,
    /// What it found or decided, where it says (`reused /path`), else empty.
    pub note: String,
}

/// Receives progress while training runs.
pub trait Observer: Send {
    /// When the launcher begins a phase of the run's start (each start of the run: a restart
    /// reports them again).
    ///
    /// # Errors
    /// As for `on_step`.
    fn on_start_phase(&mut self, phase: StartPhase) -> Result<()> {
        let _ = phase;
        Ok(())
    }
    /// After a phase of the run's start has ended, for a log.
    ///
    /// # Errors
    /// As for `on_step`.
    fn on_phase(&mut self, record: &PhaseRecord) -> Result<()> {
        let _ = record;
        Ok(())
    }
    /// After every optimizer step.
    ///
    /// # Errors
    /// An observer may fail (a log that cannot be written), which stops training.
    fn on_step(&mut self, s: &StepStats) -> Result<()> {
        let _ = s;
        Ok(())
    }
    /// After every epoch's evaluation.
    ///
    /// # Errors
    /// As for `on_step`.
    fn on_epoch(&mut self, e: &EpochStats) -> Result<()> {
        let _ = e;
        Ok(())
    }
    /// After a validation pass inside an epoch (`--eval-every`).
    ///
    /// # Errors
    /// As for `on_step`.
    fn on_eval(&mut self, e: &EvalStats) -> Result<()> {
        let _ = e;
        Ok(())
    }
    /// When a worker's part of a run failed: where its program stopped, for the hang doctor of
    /// a launcher that cannot see into the worker's process.
    ///
    /// # Errors
    /// As for `on_step` (the run has failed already; the error is dropped).
    fn on_stop(&mut self, report: &StopReport) -> Result<()> {
        let _ = report;
        Ok(())
    }
    /// When the layout changes: a replica was lost and the run goes on without it (before its
    /// segment runs again under the new layout), or lost replicas rejoin
    /// ([`super::survive`]).
    ///
    /// # Errors
    /// As for `on_step`.
    fn on_layout_change(&mut self, change: &LayoutChange) -> Result<()> {
        let _ = change;
        Ok(())
    }
    /// When a worker is seen lost (a launcher reaps a worker process that died), before the
    /// run goes on without it.
    ///
    /// # Errors
    /// As for `on_step`.
    fn on_lost(&mut self, lost: &LostStats) -> Result<()> {
        let _ = lost;
        Ok(())
    }
    /// When a surviving worker process has reached a phase of its recovery from a lost
    /// replica (dated by the worker's clock), as its launcher hears of it.
    ///
    /// # Errors
    /// As for `on_step`.
    fn on_recovery(&mut self, phase: &crate::train::RecoveryStats) -> Result<()> {
        let _ = phase;
        Ok(())
    }
    /// When training begins, by the system clock: the origin of every record's `elapsed_s`
    /// (a launched chief tells its launcher, which dates what it sees on the same clock).
    ///
    /// # Errors
    /// As for `on_step`.
    fn on_training_began(&mut self, at: std::time::SystemTime) -> Result<()> {
        let _ = at;
        Ok(())
    }
    /// After each segment of a worker that runs in a process of its own
    /// ([`super::train_worker`]): the actions it ran, with times in seconds since
    /// `origin`, the worker's start by the system clock (so that the parts of several
    /// processes can be put on one time axis for a trace).
    ///
    /// # Errors
    /// As for `on_step`.
    fn on_spans(
        &mut self,
        origin: std::time::SystemTime,
        spans: &[pipe_scheduler::Span],
    ) -> Result<()> {
        let _ = (origin, spans);
        Ok(())
    }
}

/// An observer that ignores everything.
#[derive(Debug, Default)]
pub struct Quiet;
impl Observer for Quiet {}
