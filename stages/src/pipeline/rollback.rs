//! Rollback points: what lets a lost replica cost the updates in flight instead of its whole
//! segment ([`super::survive`]).
//!
//! While a segment of a run that could survive a lost replica runs, each worker keeps, for its
//! stage, a copy of the stage's weights and optimizer state at each of the last few *step
//! boundaries* it passed (the stage has applied every update of the first `k` minibatches of
//! the segment), with what the worker had measured by then. When a replica is lost, the run
//! goes back to the latest step `u` that every stage has passed: each stage's state there is
//! taken from a surviving worker of the stage (replicas agree at every update of their stage),
//! the first `u` minibatches of the segment stand (their figures and version records are
//! kept), and the rest of the segment runs under the new layout from step `u`.
//!
//! What the weights are: those of a run whose pipeline drained at step `u` and whose layout
//! changes there, which is what the reference trainer computes for a layout change at `u`
//! ([`super::train::train_reference_with`]). A drain at `u` does not change the first `u`
//! minibatches' arithmetic under any policy: every forward of those minibatches happened in
//! the segment's program before the point where the shorter program's cool-down begins (a
//! schedule's programs are causal, and a drain only removes the later forwards), so the state
//! a stage held after step `u` in the longer segment is the state it holds at the end of a
//! segment of `u` steps.
//!
//! Which updates run again: those the stages had applied past `u`, and the work of every
//! microbatch after `u` in flight. Under a flush policy the stages are never more than one step
//! apart, so at most the update in flight runs again; an asynchronous pipeline's later stages
//! run ahead of its first by up to its depth in steps, and those steps run again.
//!
//! Each worker keeps at most [`points_kept`] points; a stage whose lead over the slowest is
//! larger no longer holds the step, and the run goes back to the segment's start as before.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use pipe_kernels::Backend;

use super::exec::{StageState, StepKeeper, VersionRecord, WorkerOutcome, WorkerState};
use super::run_plan::RunPlan;
use crate::error::{Result, StageError};
use crate::model::Params;
use crate::optim::{Corrected, copy_tensor};

/// One stage's state at a step boundary of its segment.
#[derive(Clone, Debug)]
struct Point {
    /// Minibatches of the segment the stage had applied in full.
    step: u64,
    /// The stage's weights and optimizer state then (host copies); `None` once moved out to
    /// resume from ([`Points::take_params_at`], [`Points::take_state_at`]), when the point
    /// holds only the worker's figures then.
    state: Option<StageState>,
    /// The worker's counters then (its records and losses are kept apart, in [`Points`]).
    counters: WorkerOutcome,
    /// How many of [`Points::records`] and [`Points::losses`] it had made then.
    made: (usize, usize),
}

/// One worker's rollback points over a segment, and every version record it made so far.
#[derive(Debug, Default)]
pub struct Points {
    capacity: usize,
    points: VecDeque<Point>,
    /// The worker's version records, in program order, up to its latest point.
    records: Vec<VersionRecord>,
    /// The losses it computed (microbatch, loss sum, rows), up to its latest point.
    losses: Vec<(u32, f64, usize)>,
    /// States of the last segment's points, written over by this segment's first points
    /// instead of allocating theirs ([`Points::reusing`]).
    spare: Vec<StageState>,
}

/// Step boundaries each worker keeps: the stages and two more, past the furthest a stage
/// runs ahead of the slowest in the pipelines this runs (measured: 3 on 4 stages of
/// PipeDream, a 1F1B pipeline's depth less one).
pub fn points_kept(stages: u32) -> usize {
    stages as usize + 2
}

/// Copies `src`'s values into `dst`, a host copy of the same shapes, reusing its buffers;
/// false where the shapes differ or a tensor is not in host memory.
fn copy_params(src: &Params, dst: &mut Params) -> bool {
    src.len() == dst.len()
        && src.iter().zip(dst.iter_mut()).all(|(a, b)| {
            a.len() == b.len() && a.iter().zip(b.iter_mut()).all(|(x, y)| copy_tensor(x, y))
        })
}

impl Points {
    /// Empty, keeping at most `capacity` points.
    pub fn new(capacity: usize) -> Self {
        Points {
            capacity: capacity.max(1),
            ..Points::default()
        }
    }

    /// Empty like [`Points::new`], its first points written over the states `old` (the last
    /// segment's points of the same worker) held, where their stage and shapes match. Built
    /// anew, each segment freed its predecessor's copies of the stage's state and allocated
    /// their like again over its first steps.
    pub fn reusing(capacity: usize, old: Points) -> Self {
        let mut spare = old.spare;
        spare.extend(old.points.into_iter().filter_map(|p| p.state));
        Points {
            spare,
            ..Points::new(capacity)
        }
    }

    /// States of the last segment's points waiting to be written over.
    #[cfg(test)]
    pub(crate) fn spare_states(&self) -> usize {
        self.spare.len()
    }

    /// The latest step this worker's stage passed (0: none).
    pub fn latest(&self) -> u64 {
        self.points.back().map_or(0, |p| p.step)
    }

    /// The earliest step still kept (0: none kept, only the segment's start).
    pub fn earliest(&self) -> u64 {
        self.points.front().map_or(0, |p| p.step)
    }

    /// Whether the point at `step` is still kept, with the stage's state.
    pub fn holds(&self, step: u64) -> bool {
        self.held_at(step).is_some()
    }

    /// The point at `step`, if still kept.
    fn at(&self, step: u64) -> Option<&Point> {
        self.points.iter().find(|p| p.step == step)
    }

    /// The stage's state at `step`, if the point there is still kept and holds it.
    fn held_at(&self, step: u64) -> Option<&StageState> {
        self.at(step)?.state.as_ref()
    }

    /// The stage's state at `step`, if still kept.
    pub fn state_at(&self, step: u64) -> Option<StageState> {
        self.held_at(step).cloned()
    }

    /// The stage's weights at `step` (not its optimizer state), if still kept.
    pub fn params_at(&self, step: u64) -> Option<Params> {
        self.held_at(step).map(|s| s.params.clone())
    }

    /// The stage's weights at `step`, moved out rather than copied, if still kept: a program
    /// resumed after a loss reads them and every survivor resumes at once. The point then
    /// holds the worker's figures only ([`Points::measured_at`]); [`Points::holds`] no longer
    /// counts it, and a later point in its place copies the state anew.
    pub fn take_params_at(&mut self, step: u64) -> Option<Params> {
        self.take_state_at(step).map(|s| s.params)
    }

    /// The stage's state at `step`, weights and optimizer state moved out rather than copied,
    /// if still kept: the adopter of a lost replica's program hands it the state it resumes
    /// from while the stage's other replica waits for it, and a copy of the optimizer state
    /// (as large as the weights under momentum, twice under Adam) would stand in its way. The
    /// point is then as [`Points::take_params_at`] leaves it.
    pub fn take_state_at(&mut self, step: u64) -> Option<StageState> {
        self.points
            .iter_mut()
            .find(|p| p.step == step)?
            .state
            .take()
    }

    /// Everything the worker had measured when it passed `step` (its counters, and its
    /// version records and losses then, in program order), if still kept: its figures
    /// before it resumes there ([`super::adopt`]).
    pub fn measured_at(&self, step: u64) -> Option<WorkerOutcome> {
        let p = self.at(step)?;
        let mut out = p.counters.clone();
        out.versions = self.records.get(..p.made.0)?.to_vec();
        out.losses = self.losses.get(..p.made.1)?.to_vec();
        Some(out)
    }
}

impl StepKeeper for Points {
    /// Keeps the stage's `params` and optimizer state `opt` (on `be`) as its state after `step`
    /// minibatches of the segment, with the worker's `outcome` so far (its lists are copied
    /// from where the last point left them, so a segment's points cost its records once). The
    /// oldest point's buffers are written over once the points are all kept, so that a step
    /// costs a copy of the stage's state and no allocation.
    ///
    /// # Errors
    /// A device that fails the copy to host memory.
    fn keep(
        &mut self,
        step: u64,
        (stage, params, opt): (u32, &Params, &Corrected),
        be: &dyn Backend,
        outcome: &mut WorkerOutcome,
    ) -> Result<()> {
        let versions = std::mem::take(&mut outcome.versions);
        let spans = std::mem::take(&mut outcome.spans);
        let losses = std::mem::take(&mut outcome.losses);
        self.records
            .extend_from_slice(versions.get(self.records.len()..).unwrap_or(&[]));
        self.losses
            .extend_from_slice(losses.get(self.losses.len()..).unwrap_or(&[]));
        let counters = outcome.clone();
        (outcome.versions, outcome.spans, outcome.losses) = (versions, spans, losses);
        let oldest = if self.points.len() >= self.capacity {
            self.points.pop_front()
        } else {
            None
        };
        let reused = oldest
            .and_then(|old| old.state)
            .or_else(|| self.spare.pop())
            .filter(|old| old.stage == stage)
            .and_then(|mut old| {
                let copied = copy_params(params, &mut old.params) && opt.copy_into(&mut old.opt);
                copied.then_some(old)
            });
        let state = match reused {
            Some(state) => state,
            None => StageState {
                stage,
                params: crate::model::host_params(be, params.clone())?,
                opt: opt.clone().on_host(be)?,
            },
        };
        let made = (self.records.len(), self.losses.len());
        self.points.push_back(Point {
            step,
            state: Some(state),
            counters,
            made,
        });
        Ok(())
    }
}

/// Every worker's rollback points over a segment, shared with the workers' cores.
pub type Kept = Vec<Arc<Mutex<Points>>>;

/// Where a segment in which a replica was lost goes on from.
pub struct RolledBack {
    /// Minibatches of the segment that stand.
    pub steps: u64,
    /// Every worker's state there in the old layout's numbering (each stage's from a surviving
    /// worker of it), for the whole model's weights and optimizer state.
    pub states: Vec<WorkerState>,
    /// Every worker's figures and version records over the steps that stand.
    pub outcomes: Vec<WorkerOutcome>,
}

/// The latest step of `plan`'s segment of `len` steps that every stage passed on a worker
/// other than `lost`, before the segment's end (a replica lost after every stage finished
/// costs the last update, as [`super::recover::settle`] settles it between processes), with
/// the states and figures there; `None` when it is the segment's start or some stage no
/// longer holds it (the segment then runs again from its start).
pub fn roll_back(
    plan: &RunPlan,
    points: &[Arc<Mutex<Points>>],
    lost: u32,
    len: u64,
) -> Option<RolledBack> {
    let points: Vec<_> = points
        .iter()
        .map(|p| p.lock().ok())
        .collect::<Option<_>>()?;
    let layout = plan.schedule.layout();
    let stages = plan.schedule.stages();
    let survivor = |s: u32| {
        layout
            .group(s)
            .find(|&w| w != lost && points.get(w as usize).is_some())
    };
    let survivors: Vec<u32> = (0..stages).map(survivor).collect::<Option<_>>()?;
    let steps = survivors
        .iter()
        .map(|&w| points[w as usize].latest())
        .min()?
        .min(len.saturating_sub(1));
    if steps == 0 {
        return None;
    }
    let minibatch = u64::from(plan.schedule.resolved.minibatch.max(1));
    let mut states = Vec::with_capacity(points.len());
    let mut outcomes = Vec::with_capacity(points.len());
    for (w, mine) in points.iter().enumerate() {
        let (stage, _) = layout.placement(w as u32);
        let from = &points[survivors[stage as usize] as usize];
        states.push(WorkerState {
            worker: w as u32,
            stages: vec![from.state_at(steps)?],
            progress: super::doctor::StopPoint::default(),
            keeper: None,
        });
        outcomes.push(standing(mine, steps, minibatch, w as u32));
    }
    Some(RolledBack {
        steps,
        states,
        outcomes,
    })
}

/// A worker's figures over the first `steps` minibatches of its segment: its counters at its
/// latest point not past them, and its records of their microbatches.
pub fn standing(points: &Points, steps: u64, minibatch: u64, worker: u32) -> WorkerOutcome {
    let before = points.points.iter().rev().find(|p| p.step <= steps);
    let mut out = before.map_or_else(WorkerOutcome::default, |p| p.counters.clone());
    let within = |mb: u32| u64::from(mb) < steps * minibatch;
    out.worker = worker;
    out.versions = points
        .records
        .iter()
        .filter(|r| within(r.mb))
        .copied()
        .collect();
    out.losses = points
        .losses
        .iter()
        .filter(|l| within(l.0))
        .copied()
        .collect();
    out
}

/// The rollback points of a segment of `plan`: one per worker, or none where no stage has a
/// second replica or a worker holds several stages (nothing could be survived at the update).
/// `last`: a worker's points of the last segment, if any, whose buffers its new points take.
pub fn points_for(plan: &RunPlan, mut last: impl FnMut(u32) -> Option<Points>) -> Kept {
    let layout = plan.schedule.layout();
    if layout.replica_counts().iter().all(|&r| r < 2) || layout.chunks() != 1 {
        return Vec::new();
    }
    let kept = points_kept(plan.schedule.stages());
    (0..plan.schedule.workers())
        .map(|w| {
            let points = match last(w) {
                Some(old) => Points::reusing(kept, old),
                None => Points::new(kept),
            };
            Arc::new(Mutex::new(points))
        })
        .collect()
}

/// The value behind `shared` once nothing else holds it (`None` while something does, or
/// where a holder panicked): a segment's logs, taken over by the next segment only after
/// every worker of the last has let them go.
pub fn unshared<V>(shared: Arc<Mutex<V>>) -> Option<V> {
    Arc::try_unwrap(shared).ok()?.into_inner().ok()
}

/// The error of a rollback point that cannot be kept.
pub(super) fn poisoned() -> StageError {
    StageError::Executor("a worker's rollback points were left poisoned".into())
}

/// Hands each of `states` (one per worker, in worker order) its points in `kept`, or none
/// where the segment keeps none.
pub fn hand_to(kept: &Kept, states: &mut [WorkerState]) {
    for (w, st) in states.iter_mut().enumerate() {
        st.keeper = kept.get(w).map(|p| p.clone() as super::exec::SharedKeeper);
    }
}

#[cfg(test)]
mod tests {
    use pipe_kernels::{CpuBackend, Tensor};

    use super::*;
    use crate::optim::{NO_ROLES, OptimizerConfig};

    fn params(value: f32) -> Params {
        vec![vec![
            Tensor::from_vec(&[64, 32], vec![value; 64 * 32]).unwrap(),
            Tensor::from_vec(&[32], vec![-value; 32]).unwrap(),
        ]]
    }

    fn keep(points: &mut Points, step: u64, stage: u32, value: f32) {
        let (p, be) = (params(value), CpuBackend::new(1).unwrap());
        let opt = Corrected::new(OptimizerConfig::default(), &p, NO_ROLES);
        let mut outcome = WorkerOutcome::default();
        points
            .keep(step, (stage, &p, &opt), &be, &mut outcome)
            .unwrap();
    }

    /// Where each kept weight tensor's values live.
    fn addresses(points: &Points) -> Vec<*const f32> {
        let held = points.points.iter().filter_map(|p| p.state.as_ref());
        let spare = points.spare.iter();
        held.chain(spare)
            .flat_map(|s| s.params.iter().flatten())
            .map(|t| t.host().unwrap().as_ptr())
            .collect()
    }

    /// Where every kept tensor of `state`, its weights and its optimizer state, has its values.
    fn state_addresses(state: &StageState) -> Vec<*const f32> {
        let opt = state
            .opt
            .parts()
            .flatten()
            .flatten()
            .cloned()
            .collect::<Vec<_>>();
        state
            .params
            .iter()
            .flatten()
            .chain(opt.iter())
            .filter_map(|t| t.host().ok().filter(|v| !v.is_empty()).map(|v| v.as_ptr()))
            .collect()
    }

    #[test]
    fn a_state_taken_to_resume_from_is_moved_out_not_copied() {
        let mut points = Points::new(3);
        for step in 1..=2 {
            keep(&mut points, step, 1, step as f32);
        }
        let kept = points.held_at(2).map(state_addresses).unwrap();
        let weights_kept = params(2.0).iter().flatten().count();
        assert!(
            kept.len() > weights_kept,
            "the momentum's buffers are kept too"
        );
        let taken = points.take_state_at(2).unwrap();
        assert_eq!(taken.params, params(2.0));
        assert_eq!(state_addresses(&taken), kept);
        // The point now holds the figures only; the one before is untouched.
        assert!(!points.holds(2) && points.state_at(2).is_none());
        assert!(points.take_state_at(2).is_none() && points.take_params_at(2).is_none());
        assert!(points.measured_at(2).is_some());
        assert_eq!(points.params_at(1), Some(params(1.0)));
        let weights = points.held_at(1).map(|s| state_addresses(s)[0]);
        let moved = points.take_params_at(1).unwrap();
        assert_eq!(Some(moved[0][0].host().unwrap().as_ptr()), weights);
        assert!(!points.holds(1));
    }

    #[test]
    fn a_segment_reusing_the_last_ones_points_keeps_the_same_states_in_their_buffers() {
        let mut old = Points::new(2);
        for step in 1..=3 {
            keep(&mut old, step, 1, step as f32);
        }
        let before = addresses(&old);
        let mut new = Points::reusing(2, old);
        assert_eq!((new.latest(), new.spare.len()), (0, 2));
        keep(&mut new, 1, 1, 7.0);
        keep(&mut new, 2, 1, 8.0);
        // The states are the new segment's, in the old segment's buffers, with none allocated.
        assert_eq!(new.params_at(1), Some(params(7.0)));
        assert_eq!(new.params_at(2), Some(params(8.0)));
        assert!(new.spare.is_empty());
        let mut after = addresses(&new);
        let mut before = before;
        after.sort();
        before.sort();
        assert_eq!(after, before);
        // A state of another stage is not written over: the point gets its own.
        let mut other = Points::reusing(2, new);
        keep(&mut other, 1, 2, 9.0);
        assert_eq!(other.params_at(1), Some(params(9.0)));
        assert_eq!(other.points[0].state.as_ref().map(|s| s.stage), Some(2));
    }
}
