//! The segment loop of a pipelined run, written once for both places its workers run: every
//! worker a thread of this process ([`super::train::train_pipelined`]) or a process of its own
//! ([`super::worker::train_worker`]).
//!
//! A run is cut into segments (an epoch, or the stretch up to the next checkpoint); each
//! segment's schedule starts and ends with the pipeline drained. The loop decides, after each
//! segment, what the drained pipeline must give up (the whole model's weights at an epoch's end,
//! at a checkpoint or at a stop, and its optimizer state at a checkpoint), writes the
//! checkpoints, evaluates and reports each epoch, and stops when asked. What differs between
//! the launchers sits behind [`Coordinator`]: how a segment runs and how the weights and
//! optimizer state reach the chief (shared memory, or messages). Another worker process than
//! the chief runs the same loop and only follows the chief's requests.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use pipe_kernels::CpuBackend;

use super::exec::WorkerOutcome;
use super::run_plan::RunPlan;
use super::train::{EpochEnd, Run, Segment, merge_outcomes};
use crate::checkpoint::CheckpointPolicy;
use crate::data::Splits;
use crate::error::Result;
use crate::model::Params;
use crate::optim::OptimizerState;
use crate::partition::Partition;
use crate::train::{EpochStats, Observer};

/// What the chief asks of the drained pipeline after a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Drain {
    /// The whole model's weights (an epoch's end, a checkpoint or a stop).
    pub weights: bool,
    /// The whole model's optimizer state (a checkpoint).
    pub optimizer: bool,
    /// The run stops here.
    pub stop: bool,
}

/// The whole model's optimizer state with each layer's update count.
pub(super) type OptimizerOf = (OptimizerState, Vec<u64>);

/// How a segment ended on this side.
pub(super) enum SegmentEnd {
    /// The chief (or the in-process launcher): every worker's outcome, in worker order.
    Chief(Vec<WorkerOutcome>),
    /// A worker process that is not the chief: it has reported and answered the chief, who
    /// said whether the run stops.
    Follower {
        /// The run stops after this segment.
        stop: bool,
    },
}

/// One launcher's side of the loop.
pub(super) trait Coordinator {
    /// Runs segment `at` of `plan`, `this` updates long.
    ///
    /// # Errors
    /// A worker's failure, naming it.
    fn run_segment(
        &mut self,
        plan: &RunPlan,
        at: &Segment,
        this: u64,
        obs: &mut dyn Observer,
    ) -> Result<SegmentEnd>;

    /// On the chief, after a segment: tells the other workers what `drain` asks, and returns
    /// the whole model's weights if it asks for them and its optimizer state if it asks for
    /// that.
    ///
    /// # Errors
    /// A worker that does not answer.
    fn drain(
        &mut self,
        plan: &RunPlan,
        drain: Drain,
    ) -> Result<(Option<Params>, Option<OptimizerOf>)>;
}

/// Where the loop starts and what it may do.
pub(super) struct LoopStart<'a> {
    /// Updates done before this run (a resumed checkpoint's).
    pub done: u64,
    /// The weights at the start.
    pub params: Params,
    /// The stages' layers (none: the plan's own cut).
    pub partition: &'a Option<Partition>,
    /// Updates per segment at most (the checkpoint interval).
    pub every: Option<u64>,
    /// Checkpoints to write (the chief's).
    pub checkpoints: Option<&'a CheckpointPolicy>,
    /// Set (Ctrl-C) to stop at the next drain point (watched by the chief).
    pub stop: Option<&'a Arc<AtomicBool>>,
}

/// How the loop ended: on the chief, everything its report needs.
pub(super) struct LoopEnd {
    /// Every finished epoch's figures.
    pub epochs: Vec<EpochStats>,
    /// The weights at the end (the last drained ones).
    pub params: Params,
    /// Updates done, over the run.
    pub done: u64,
    /// Checkpoints written, oldest first.
    pub written: Vec<PathBuf>,
    /// Stopped early after this many updates.
    pub stopped: Option<u64>,
    /// The last segment's plan (none on a follower, or when nothing ran).
    pub last: Option<RunPlan>,
}

/// Runs the segments of `run` from `start` through `coord`, reporting to `obs`.
///
/// # Errors
/// As the coordinator's; a checkpoint that cannot be written; an observer's error.
pub(super) fn run_segments(
    run: &Run<'_>,
    coord: &mut dyn Coordinator,
    data: &Splits,
    start: LoopStart<'_>,
    obs: &mut dyn Observer,
) -> Result<LoopEnd> {
    let eval_be = CpuBackend::new(0)?;
    let mut end = LoopEnd {
        epochs: Vec::new(),
        params: start.params,
        done: start.done,
        written: Vec::new(),
        stopped: None,
        last: None,
    };
    for epoch in end.done / run.per_epoch + 1..=run.cfg.epochs {
        let first = (epoch - 1) * run.per_epoch;
        let epoch_len = run.total.saturating_sub(first).min(run.per_epoch);
        if epoch_len == 0 || end.stopped.is_some() {
            break;
        }
        let mut acc: Vec<WorkerOutcome> = Vec::new();
        let mut secs = 0.0;
        let mut last = None;
        while end.done < first + epoch_len && end.stopped.is_none() {
            let done = end.done;
            let before = done - first;
            let (plan, this) =
                run.segment_plan(start.every, done, epoch_len - before, start.partition)?;
            let at = Segment {
                epoch,
                done,
                before,
                epoch_len,
            };
            let t = Instant::now();
            let outcomes = match coord.run_segment(&plan, &at, this, obs)? {
                SegmentEnd::Chief(outcomes) => outcomes,
                SegmentEnd::Follower { stop } => {
                    end.done += this;
                    if stop {
                        end.stopped = Some(end.done);
                    }
                    continue;
                }
            };
            secs += t.elapsed().as_secs_f64();
            end.done += this;
            merge_outcomes(&mut acc, outcomes);
            let epoch_end = end.done == first + epoch_len;
            let stop = start.stop.is_some_and(|f| f.load(Ordering::SeqCst));
            let save = start
                .checkpoints
                .filter(|p| p.due(end.done, epoch_end, stop));
            let drain = Drain {
                weights: epoch_end || save.is_some() || stop,
                optimizer: save.is_some(),
                stop,
            };
            let (weights, optimizer) = coord.drain(&plan, drain)?;
            if let Some(weights) = weights {
                end.params = weights;
            }
            if let (Some(policy), Some(optimizer)) = (save, optimizer) {
                let saved = run.save(&plan, end.done, end.params.clone(), optimizer, policy)?;
                end.written.push(saved);
            }
            if stop {
                end.stopped = Some(end.done);
            }
            last = Some(plan);
        }
        let Some(plan) = last else { continue };
        if end.done < first + epoch_len {
            end.last = Some(plan);
            break;
        }
        let ended = EpochEnd {
            plan: &plan,
            outcomes: &acc,
            epoch,
            done: end.done,
            secs,
        };
        end.epochs
            .push(run.finish_epoch(&ended, &end.params, data, &eval_be, obs)?);
        end.last = Some(plan);
    }
    Ok(end)
}
