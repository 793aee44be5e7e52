//! pipe's memory model: the bytes one worker holds at its peak, term by term. The partitioner
//! charges each candidate stage with it (`pipe plan --memory`), and `pipe_stages`' estimate of
//! a run's workers (`pipe_stages::planning::memory`) adds it up from the same formulas. The
//! two differ only in their inputs: the partitioner reads a layer profile and counts the
//! microbatches in flight by the schedule's steady state ([`planned_in_flight`]); the run's
//! estimate probes the layers it will run and reads the count from each worker's program.
//!
//! Per stage of a worker, with `P` its parameter bytes, `c` the optimizer's parameter-sized
//! buffers (`state_copies`: the gradient and its moments) and `n` microbatches in flight:
//!
//! | term | bytes |
//! |---|---|
//! | state | `c P`: the weights and moments kept drained between segments (checkpoints, survival) |
//! | core | `(1 + c) P`: the same placed for the run, with the gradient |
//! | versions | `(n - 1) P` under weight stashing, `P` under 2BW, none under a flush |
//! | activations | `n` times what the stage keeps per microbatch from forward to backward |
//! | working | [`WORKING_FACTOR`] times the largest layer's one pass (activations, input, output) |
//! | loss | at the last stage, [`LOSS_COPIES`] copies of the logits |
//!
//! What a process holds besides (the program, its runtime, the starting weights it slices
//! its stages from, the chief's evaluation) is the caller's `base`.

use crate::spec::Policy;

/// One pass's working set over the largest layer's full activations, input and output: their
/// gradients, and the freed blocks the allocator keeps between them (measured on pipe's CPU
/// backend: `docs/training.md`, "The memory model").
pub const WORKING_FACTOR: f64 = 2.7;

/// Copies of the logits the last stage holds while it computes the loss: the logits, their
/// gradient and the head's product.
pub const LOSS_COPIES: f64 = 3.0;

/// What one stage of a worker holds, per microbatch where it says so.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StageHeld {
    /// Parameter bytes.
    pub params: f64,
    /// Bytes kept per microbatch from its forward to its backward (after recomputation's
    /// stand-ins).
    pub kept: f64,
    /// Microbatches between forward and backward at once.
    pub in_flight: f64,
    /// One pass through the stage's largest layer per microbatch: its full activations
    /// (rebuilt in the backward under recomputation), input and output.
    pub pass: f64,
    /// Logit bytes per microbatch at the last stage (0 elsewhere).
    pub logits: f64,
}

/// The terms of one worker (module docs), in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WorkerBytes {
    /// Drained weights and moments.
    pub state: f64,
    /// Placed weights, gradient and moments.
    pub core: f64,
    /// Older weight versions.
    pub versions: f64,
    /// Activations of the microbatches in flight.
    pub activations: f64,
    /// One pass's working set.
    pub working: f64,
    /// The loss's logits.
    pub loss: f64,
}

impl WorkerBytes {
    /// The terms by name, in the order the module docs give them.
    pub fn terms(&self) -> [(&'static str, f64); 6] {
        [
            ("state", self.state),
            ("core", self.core),
            ("versions", self.versions),
            ("activations", self.activations),
            ("working", self.working),
            ("loss", self.loss),
        ]
    }

    /// Their sum.
    pub fn total(&self) -> f64 {
        self.terms().iter().map(|(_, b)| b).sum()
    }
}

/// The terms of a worker holding `stages` under `policy`, with `microbatch_size` samples per
/// microbatch and `state_copies` parameter-sized optimizer buffers.
pub fn worker_bytes(
    policy: Policy,
    stages: &[StageHeld],
    microbatch_size: f64,
    state_copies: f64,
) -> WorkerBytes {
    let mut out = WorkerBytes::default();
    let b = microbatch_size;
    let mut pass = 0.0f64;
    for s in stages {
        out.state += state_copies * s.params;
        out.core += (1.0 + state_copies) * s.params;
        out.versions += extra_versions(policy, s.in_flight) * s.params;
        out.activations += s.in_flight * s.kept * b;
        out.loss += LOSS_COPIES * s.logits * b;
        pass = pass.max(s.pass);
    }
    out.working = WORKING_FACTOR * pass * b;
    out
}

/// Weight versions beyond the newest a stage keeps with `in_flight` microbatches between their
/// forward and backward.
pub fn extra_versions(policy: Policy, in_flight: f64) -> f64 {
    match policy {
        Policy::PipeDream | Policy::VerticalSync => (in_flight - 1.0).max(0.0),
        Policy::TwoBw => 1.0,
        _ => 0.0,
    }
}

/// The partitioner's count of microbatches in flight at a stage with `after` workers at or
/// after it on `replicas` replicas: `ceil(after / replicas)` in 1F1B's steady state, all `M`
/// under GPipe, at most `M` under the other flushes.
pub fn planned_in_flight(policy: Policy, microbatches: u32, after: u64, replicas: u64) -> f64 {
    let m = f64::from(microbatches);
    let depth = after.div_ceil(replicas.max(1)) as f64;
    match policy {
        Policy::Gpipe => m,
        Policy::OneFOneBFlush | Policy::ZbH1 => depth.min(m),
        _ => depth,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// PipeDream's first of four stages: four microbatches in flight, three older versions.
    #[test]
    fn the_terms_follow_the_module_docs() {
        let stage = StageHeld {
            params: 100.0,
            kept: 10.0,
            in_flight: planned_in_flight(Policy::PipeDream, 8, 4, 1),
            pass: 5.0,
            logits: 0.0,
        };
        let w = worker_bytes(Policy::PipeDream, &[stage], 2.0, 2.0);
        assert_eq!(
            (w.state, w.core, w.versions, w.activations, w.loss),
            (200.0, 300.0, 300.0, 80.0, 0.0)
        );
        assert_eq!(w.working, WORKING_FACTOR * 10.0);
        let flush = worker_bytes(Policy::OneFOneBFlush, &[stage], 2.0, 2.0);
        assert_eq!(flush.versions, 0.0);
        assert_eq!(planned_in_flight(Policy::Gpipe, 8, 1, 1), 8.0);
        assert_eq!(planned_in_flight(Policy::ZbH1, 2, 4, 1), 2.0);
    }
}
