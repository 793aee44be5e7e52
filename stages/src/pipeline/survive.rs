//! Surviving the loss of a replica: when one replica of a stage that has two or more fails
//! (its thread panics, its action or its transport fails; its process ends), the run goes on
//! with the stage's other replicas, without a restart and without losing or repeating an
//! update.
//!
//! In process and as worker processes, the unit of recovery is the update. Where it can, the
//! segment is taken over where every worker stands ([`super::adopt`]; worker processes,
//! [`super::takeover`]): each stage runs again only the
//! update it was in, the segment ends as if nothing was lost, and the layout changes at its
//! end ([`Redone::Update`]). Otherwise, while a segment runs, each worker
//! keeps its stage's state at its last few step boundaries ([`super::rollback`]); when a
//! replica fails, the run goes back to the latest step every stage had passed, the segment's
//! steps before it stand, and the rest runs under a new layout: the failed worker's stage has
//! one replica fewer, and the stage's other replicas take its microbatches. Where a stage no
//! longer holds that step (it ran further ahead than the points it keeps), the run goes back
//! to the segment's start, whose state the launcher keeps before each segment of a run that
//! could survive a loss. The minibatch stays the same (M per replica of the widest stage is
//! raised when the widest stage shrank), so the data order, the update count and the
//! learning-rate schedule are unchanged. The weights are those of a run whose pipeline drained
//! at that step and went on under the new layout, which the reference trainer computes
//! ([`super::train::train_reference_with`]) and which resuming a checkpoint of that step under
//! the new replica counts also gives.
//!
//! Worker processes do the same in place, their survivors keeping their processes
//! ([`super::recover`]); where that fails (a second loss, the chief's), their launcher starts
//! them again, one fewer, from the state of the segment's start ([`super::relaunch`]).
//!
//! With `--rejoin` the lost replica is taken back at the next update boundary in process (the
//! short layout runs one update, [`LayoutEvent::Rejoined`]); worker processes take it back
//! live at the first update boundary after its replacement is ready, its stage's state handed
//! over by a surviving replica ([`super::worker`]).
//!
//! What cannot shrink this way ends the run as before: the last replica of a stage, a layout
//! with several chunks per worker, a minibatch the new widest stage cannot divide, and the
//! weight-prediction remedy (whose running averages a drained state does not hold).

use pipe_scheduler::{Layout, Policy, ScheduleSpec};

use super::run_plan::RunPlan;
use crate::config::RunConfig;
use crate::error::{Result, StageError};
use crate::remedy::Prediction;

/// Why the layout changed.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayoutEvent {
    /// A replica was lost.
    Lost {
        /// The worker that failed (in the old layout's numbering).
        worker: u32,
        /// Its stage.
        stage: u32,
        /// Why it failed.
        cause: String,
    },
    /// Replacement workers took back the places of the replicas lost before (`--rejoin`):
    /// the run is on its own layout again.
    Rejoined,
    /// No replacement comes for the replicas the run is short of after all (under `--rejoin`,
    /// the launcher's replacements kept failing before they joined): the layout stays, and
    /// the run no longer drains at every update waiting for one.
    Unreplaced,
}

/// What a lost replica cost: the work the run does again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Redone {
    /// The segment runs again from its start (worker processes, or a stage that no longer
    /// held the step every stage had passed).
    Segment,
    /// The run goes back to the latest step every stage had passed
    /// ([`super::rollback`]): only the updates in flight run again.
    InFlight,
    /// The segment was taken over where every worker stood ([`super::adopt`]): each stage ran
    /// its update in flight again, and the layout changes at the segment's end.
    Update,
    /// The segment was taken over with the survivors where they stood
    /// ([`super::in_place`]): only the lost worker's program ran again, from its stage's
    /// latest update, and the layout changes at the segment's end.
    WhereTheyStood,
}

/// A new layout: why it changed, and the replica counts and microbatches per update the run
/// goes on with from update `from`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LayoutChange {
    /// Why.
    pub event: LayoutEvent,
    /// Replicas per stage from now on.
    pub replicas: Vec<u32>,
    /// Microbatches per update per replica of the widest stage from now on.
    pub microbatches: u32,
    /// The update the new layout starts at.
    pub from: u64,
    /// What the run does again (a lost replica's change; [`Redone::Segment`] for a rejoin).
    pub redone: Redone,
    /// The update the run recovered at, counted over the run from 1, where it is not
    /// `from`: a segment taken over ([`Redone::Update`]) went on at the update its last stage
    /// was in when the replica was lost, and changes its layout only at the segment's end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovered_at: Option<u64>,
}

impl std::fmt::Display for LayoutChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.event {
            LayoutEvent::Lost {
                worker,
                stage,
                cause,
            } => write!(
                f,
                "worker {worker} (stage {stage}) lost: {cause}; the run goes on with replicas {:?} and {} per update, from update {} ({})",
                self.replicas,
                microbatches(u64::from(self.microbatches)),
                self.from,
                match self.redone {
                    Redone::Segment => "the segment runs again".to_string(),
                    Redone::InFlight =>
                        "recovered at the update: the updates in flight run again".to_string(),
                    Redone::Update if self.recovered_at == Some(self.from) => format!(
                        "taken over at update {}: each stage ran its update in flight again, and the segment ended there for the replacement to join",
                        self.from
                    ),
                    Redone::Update => format!(
                        "taken over at update {}: each stage ran its update in flight again and the segment ended without it",
                        self.recovered_at.unwrap_or(self.from)
                    ),
                    Redone::WhereTheyStood => format!(
                        "taken over at update {}: the survivors went on where they stood, the lost worker's program ran again from its stage's latest update, and the segment ended without it",
                        self.recovered_at.unwrap_or(self.from)
                    ),
                }
            ),
            LayoutEvent::Rejoined => write!(
                f,
                "the lost replicas rejoin: the run goes on with replicas {:?} and {} per update, from update {}",
                self.replicas,
                microbatches(u64::from(self.microbatches)),
                self.from
            ),
            LayoutEvent::Unreplaced => write!(
                f,
                "no replacement comes for the lost replicas: the run goes on with replicas {:?} to its end, from update {} without draining at every update",
                self.replicas, self.from
            ),
        }
    }
}

/// `n` microbatches, in words ("1 microbatch", "4 microbatches").
pub fn microbatches(n: u64) -> String {
    if n == 1 {
        "1 microbatch".into()
    } else {
        format!("{n} microbatches")
    }
}

impl LayoutChange {
    /// The layout after losing `worker` from `layout` (whose minibatch is `minibatch` under
    /// `policy`), or `None` when the run cannot go on without it: the stage's last replica,
    /// several chunks per worker, the weight-prediction remedy, or a minibatch the new widest
    /// stage cannot divide.
    fn shrink(
        cfg: &RunConfig,
        layout: &Layout,
        policy: Policy,
        minibatch: u64,
        lost: (u32, String),
        from: u64,
    ) -> Option<Self> {
        if layout.chunks() != 1 || cfg.remedies.prediction != Prediction::None {
            return None;
        }
        let (worker, cause) = lost;
        let (stage, _) = layout.placement(worker);
        let mut replicas = layout.replica_counts().to_vec();
        if replicas[stage as usize] < 2 {
            return None;
        }
        replicas[stage as usize] -= 1;
        let widest = u64::from(replicas.iter().copied().max().unwrap_or(1));
        if minibatch % widest != 0 {
            return None;
        }
        let change = LayoutChange {
            event: LayoutEvent::Lost {
                worker,
                stage,
                cause,
            },
            replicas,
            microbatches: u32::try_from(minibatch / widest).ok()?,
            from,
            redone: Redone::Segment,
            recovered_at: None,
        };
        // The new layout must schedule, with the same minibatch. Its in-flight depths are
        // worked out where its plan is made, at the segment's end: here every survivor, and
        // the launcher before it tells them, waits on this check.
        let scheduled = change.spec(cfg.chunks, policy, 1).minibatch().ok()?;
        (u64::from(scheduled) == minibatch).then_some(change)
    }

    /// In process: the layout after losing the worker that `err` names from `plan`'s layout,
    /// whose minibatch is `minibatch` (`None` as [`LayoutChange::shrink`], for an error
    /// that names no worker, or for a divergence, which the stage's other replicas would
    /// meet too).
    pub(super) fn after(
        cfg: &RunConfig,
        plan: &RunPlan,
        minibatch: u64,
        err: &StageError,
        from: u64,
    ) -> Option<Self> {
        let StageError::Worker { worker, source, .. } = err else {
            return None;
        };
        if err.diverged_at().is_some() {
            return None;
        }
        let lost = (*worker, source.to_string());
        let policy = plan.schedule.resolved.policy;
        Self::shrink(cfg, plan.schedule.layout(), policy, minibatch, lost, from)
    }

    /// Worker processes: the layout of `cfg` after losing the worker process that `err` names
    /// (a process that ended unsuccessfully), the run going on from update `from`.
    pub fn after_exit(cfg: &RunConfig, err: &StageError, from: u64) -> Option<Self> {
        let StageError::Exited { worker, status } = err else {
            return None;
        };
        Self::without(cfg, *worker, status.clone(), from)
    }

    /// The layout of `cfg` without `worker`, which was lost for `cause`, the run going on from
    /// update `from` (`None` as [`LayoutChange::shrink`]).
    pub fn without(cfg: &RunConfig, worker: u32, cause: String, from: u64) -> Option<Self> {
        let resolved = cfg.resolved().ok()?;
        let minibatch = u64::from(resolved.minibatch);
        let lost = (worker, cause);
        Self::shrink(cfg, &resolved.layout, cfg.schedule, minibatch, lost, from)
    }

    /// Whether `cfg`'s stages keep their layers under this layout: a partition given (or
    /// measured, which is settled into one before the run), or a balanced cut that the new
    /// replica counts do not move. Survivors that go on in place keep their own stages'
    /// state ([`super::recover`]), so they need it.
    pub fn keeps_partition(&self, cfg: &RunConfig) -> bool {
        match &cfg.partition {
            crate::config::PartitionChoice::Flops => {
                let Ok(model) = crate::model::Model::new(&cfg.model) else {
                    return false;
                };
                let Ok(resolved) = cfg.resolved() else {
                    return false;
                };
                let old =
                    crate::partition::Partition::balanced(&model, resolved.layout.replica_counts());
                let new = crate::partition::Partition::balanced(&model, &self.replicas);
                matches!((old, new), (Ok(a), Ok(b)) if a == b)
            }
            _ => true,
        }
    }

    /// The run's own layout again, from update `from`, once replacement workers have taken
    /// back the lost replicas' places (`--rejoin`).
    ///
    /// # Errors
    /// A run whose own layout does not resolve (it did when the run started).
    pub fn restored(cfg: &RunConfig, from: u64) -> Result<Self> {
        let resolved = cfg.resolved()?;
        Ok(LayoutChange {
            event: LayoutEvent::Rejoined,
            replicas: resolved.layout.replica_counts().to_vec(),
            microbatches: resolved.microbatches_per_update,
            from,
            redone: Redone::Segment,
            recovered_at: None,
        })
    }

    /// This layout kept from update `from` on with no replacement coming
    /// ([`LayoutEvent::Unreplaced`]).
    pub(super) fn unreplaced(&self, from: u64) -> Self {
        LayoutChange {
            event: LayoutEvent::Unreplaced,
            from,
            redone: Redone::Segment,
            ..self.clone()
        }
    }

    /// This change made at step `steps` of the segment it was met in, after a rollback
    /// ([`super::rollback`]): the run goes on from there, the updates in flight run again.
    pub(super) fn rolled_back(self, steps: u64) -> Self {
        LayoutChange {
            from: self.from + steps,
            redone: Redone::InFlight,
            ..self
        }
    }

    /// This change for a segment of `len` updates taken over where every worker stood
    /// ([`super::adopt`]), `in_flight` its update (counted from the segment's start, from 1)
    /// that its last stage was in: the lost worker's program finished the segment, and the
    /// new layout starts at its end.
    pub(super) fn taken_over(self, len: u64, in_flight: u64) -> Self {
        LayoutChange {
            recovered_at: Some(self.from + in_flight),
            from: self.from + len,
            redone: Redone::Update,
            ..self
        }
    }

    /// [`LayoutChange::taken_over`], with the survivors where they stood
    /// ([`Redone::WhereTheyStood`]).
    pub(super) fn taken_over_where_they_stood(self, len: u64, in_flight: u64) -> Self {
        LayoutChange {
            redone: Redone::WhereTheyStood,
            ..self.taken_over(len, in_flight)
        }
    }

    /// The schedule request of a segment of `updates` under this layout and `policy`.
    pub(super) fn spec(&self, chunks: u32, policy: Policy, updates: u32) -> ScheduleSpec {
        ScheduleSpec::new(policy, self.replicas.len() as u32, self.microbatches)
            .with_replicas(self.replicas.clone())
            .with_chunks(chunks)
            .with_length(pipe_scheduler::Length::Updates(updates))
    }

    /// `cfg` under this layout: the run a worker process is handed once the replica is lost.
    ///
    /// # Errors
    /// A layout the run's policy refuses (it resolved when the layout was chosen).
    pub fn apply(&self, cfg: &RunConfig) -> Result<RunConfig> {
        cfg.with_replica_counts(self.replicas.clone(), self.microbatches as usize)
    }
}

/// Whether a segment of `plan` could survive a lost replica: some stage has two or more.
pub(super) fn could_survive(plan: &RunPlan) -> bool {
    plan.schedule
        .layout()
        .replica_counts()
        .iter()
        .any(|&r| r >= 2)
}
