//! The version ledger of a run: for every microbatch at every stage, the weight version its
//! forward used, the version its backward used and the update its gradient went into, counted
//! over the whole run. It is built from what the workers *measured* (their
//! [`VersionRecord`](super::VersionRecord)s), not from the plan, so it shows the staleness a
//! run actually had; the oracle tests show that the two agree.

use serde::{Deserialize, Serialize};

use super::exec::{Pass, WorkerOutcome};
use super::run_plan::RunPlan;

/// One microbatch at one stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerEntry {
    /// The stage.
    pub stage: u32,
    /// The microbatch, counted over the run.
    pub mb: u64,
    /// The weight version its forward used (updates of this stage before it).
    pub forward: u64,
    /// The weight version its backward (input-gradient half) used.
    pub backward: u64,
    /// The update of this stage its gradient went into (version `update + 1` holds it).
    pub update: u64,
}

impl LedgerEntry {
    /// Updates between the forward's weights and the update: the delay of the gradient.
    pub fn forward_delay(&self) -> u64 {
        self.update.saturating_sub(self.forward)
    }

    /// Updates between the backward's weights and the update.
    pub fn backward_delay(&self) -> u64 {
        self.update.saturating_sub(self.backward)
    }
}

/// The ledger entries of one segment's `plan`, run from update `done` of the run (each
/// update `minibatch` microbatches), from the workers' measured version records. Replicas
/// record their own microbatches, so each (stage, microbatch) appears once.
pub fn segment_ledger(
    plan: &RunPlan,
    outcomes: &[WorkerOutcome],
    done: u64,
    minibatch: u64,
) -> Vec<LedgerEntry> {
    let res = &plan.schedule.resolved;
    let first_mb = done * minibatch;
    let mut forward = std::collections::HashMap::new();
    let mut out = Vec::new();
    for o in outcomes {
        for r in &o.versions {
            match r.pass {
                Pass::Forward => {
                    forward.insert((r.stage, r.mb), r.version);
                }
                Pass::Backward => {
                    // Version v of this segment is version `offset + v` of the run: the
                    // updates this stage made in earlier segments.
                    let offset = first_mb / u64::from(res.update_size(r.stage).max(1));
                    let fwd = forward.get(&(r.stage, r.mb)).copied().unwrap_or(r.version);
                    out.push(LedgerEntry {
                        stage: r.stage,
                        mb: first_mb + u64::from(r.mb),
                        forward: offset + u64::from(fwd),
                        backward: offset + u64::from(r.version),
                        update: offset + u64::from(res.update_of(r.stage, r.mb)),
                    });
                }
            }
        }
    }
    out.sort_by_key(|e| (e.stage, e.mb));
    out
}
