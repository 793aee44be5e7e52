//! How deep each position's 1F1B pipeline runs: how many of its microbatches a replica keeps
//! between forward and backward.
//!
//! The default is PipeDream's "NOAM", `ceil(sum of replicas at positions >= p / r_p)`
//! ([`Layout::in_flight_limit`](crate::Layout::in_flight_limit)): the microbatches needed to
//! cover one microbatch's trip from the position to the end of the pipeline and back, when
//! every worker runs at the same pace. On a straight or uniformly replicated pipeline that is
//! exactly enough. With unequal replica counts it is not: the replicas of a stage take
//! microbatches round-robin and synchronise at every update (the all-reduce), so they run in
//! lockstep while their neighbours serve microbatches one at a time, and each transition
//! between replica counts adds waiting that NOAM does not cover. Balanced stages under
//! `[1, 3, 1]` then ran at half the bound (0.5 of it for `M = 4`, 0.43 for `M = 1`).
//!
//! No closed form fitted the layouts tried (deepening the replicated stage itself can make it
//! slower), so for the asynchronous policies (pipedream, pipedream-nostash, vsync) on unequal
//! replica counts the depths are chosen by simulation: the schedule is generated and simulated
//! on the balanced cost model of its layout (each stage's forward, backward-input and
//! backward-weight cost its replica count, so every worker has the same work and the bound is
//! one microbatch per `3` time units), and the position whose deepening raises throughput most
//! is deepened (across plateaus: one position may help only once another is deeper), for at
//! most 16 steps or until the throughput is within 2% of the bound; the best depths seen win,
//! the shallowest among those within 0.5% of each other. It is a
//! pure function of the request, so every run of it gets the same schedule. Layouts above 16
//! workers or 8 positions keep NOAM (the search simulates up to 112 candidates, and the
//! planner resolves every plan it simulates: at 64 workers planning took minutes), as do
//! flush policies (they drain every minibatch) and 2BW (its version rule fixes the in-flight
//! depth).

use crate::error::Result;
use crate::generate::generate_resolved;
use crate::sim::{CostModel, SimOptions, StageCost, simulate};
use crate::spec::{Policy, Resolved, ScheduleSpec};

impl ScheduleSpec {
    /// Checks the request and works out the layout, the sizes it implies and each position's
    /// in-flight depth ([`in_flight_depths`]).
    ///
    /// # Errors
    /// [`crate::ScheduleError::Spec`] naming the problem: zero stages or microbatches, a
    /// replica list whose length is neither 1 nor the stage count, chunks on a policy without
    /// chunks, a microbatch count the policy cannot use, or a run length that is not a whole
    /// number of minibatches.
    pub fn resolve(&self) -> Result<Resolved> {
        let mut resolved = self.resolve_shape()?;
        resolved.depths = in_flight_depths(&resolved);
        Ok(resolved)
    }

    /// The minibatch [`ScheduleSpec::resolve`] gives, after the same checks, without the
    /// in-flight depths: their search simulates candidate schedules, milliseconds that a
    /// caller asking only whether a layout schedules and at what minibatch (a recovery, as
    /// its survivors wait) need not spend.
    ///
    /// # Errors
    /// As [`ScheduleSpec::resolve`].
    pub fn minibatch(&self) -> Result<u32> {
        Ok(self.resolve_shape()?.minibatch)
    }
}

/// Largest layout whose depths are searched: the search simulates up to `MAX_STEPS x
/// (positions - 1)` candidate schedules, and the planner resolves every plan it simulates.
const MAX_WORKERS: u32 = 16;
const MAX_POSITIONS: u32 = 8;
/// Minibatches the search simulates (fill and drain amortised, still small): 12, fewer for
/// big minibatches, so that a candidate stays near `SEARCH_MICROBATCHES` microbatches.
const SEARCH_MINIBATCHES: u32 = 12;
const SEARCH_MICROBATCHES: u32 = 2_000;
/// At most this many deepening steps.
const MAX_STEPS: usize = 16;

/// The in-flight depth per position for `r` (see the module docs). `r.depths` holds NOAM.
pub fn in_flight_depths(r: &Resolved) -> Vec<u32> {
    let layout = &r.layout;
    let counts = layout.replica_counts();
    let uniform = counts.iter().all(|&c| c == counts[0]);
    let asynchronous = matches!(
        r.policy,
        Policy::PipeDream | Policy::PipeDreamNoStash | Policy::VerticalSync
    );
    if uniform
        || !asynchronous
        || layout.workers() > MAX_WORKERS
        || layout.positions() > MAX_POSITIONS
        || layout.chunks() != 1
    {
        return r.depths.clone();
    }
    search(r)
}

/// The balanced cost model of a layout: each stage's forward, backward-input and
/// backward-weight cost its replica count (in seconds), so every worker has the same work and
/// the bound is one microbatch per 3 s.
pub fn balanced_costs(layout: &crate::Layout) -> CostModel {
    CostModel {
        stages: (0..layout.stages())
            .map(|s| {
                let w = f64::from(layout.replicas_of(s));
                StageCost {
                    backward_input: w,
                    backward_weight: w,
                    ..StageCost::compute(w, 0.0)
                }
            })
            .collect(),
        ..CostModel::uniform(StageCost::compute(0.0, 0.0))
    }
}

/// Greedy deepening on the balanced cost model.
fn search(r: &Resolved) -> Vec<u32> {
    let costs = balanced_costs(&r.layout);
    let minibatches = (SEARCH_MICROBATCHES / r.minibatch.max(1)).clamp(2, SEARCH_MINIBATCHES);
    let trial = Resolved {
        total: r.minibatch * minibatches,
        ..r.clone()
    };
    let bound = 1.0 / 3.0;
    // A deeper position can ask for more forwards than its upstream will keep in flight
    // (a replica of depth `d` needs `d r` microbatches sent to its stage before its first
    // backward): such a schedule deadlocks and scores 0.
    let throughput = |depths: &[u32]| -> f64 {
        let candidate = Resolved {
            depths: depths.to_vec(),
            ..trial.clone()
        };
        generate_resolved(candidate)
            .and_then(|schedule| simulate(&schedule, &costs, SimOptions::default()))
            .map_or(0.0, |report| report.throughput)
    };
    // Walk: deepen the most helpful position each step, even across a plateau (one deeper
    // position may help only once another is deeper too); keep the best depths seen, the
    // shallowest on ties within 0.5%.
    let mut depths = r.depths.clone();
    let mut best = (throughput(&depths), depths.clone());
    let last = depths.len().saturating_sub(1);
    for _ in 0..MAX_STEPS {
        if best.0 >= 0.98 * bound {
            break;
        }
        let mut step: Option<(f64, usize)> = None;
        // The last position's backward needs nothing downstream: deepening it only delays it.
        for p in 0..last {
            let mut deeper = depths.clone();
            deeper[p] += 1;
            let t = throughput(&deeper);
            if step.is_none_or(|(b, _)| t > b) {
                step = Some((t, p));
            }
        }
        let Some((t, p)) = step else { break };
        depths[p] += 1;
        if t > best.0 * 1.005 {
            best = (t, depths.clone());
        }
    }
    best.1
}
