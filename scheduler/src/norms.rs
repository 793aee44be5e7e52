//! Norm plans: which updates' gradient norms each update's global norm adds up, for clipping by
//! the whole model's gradient norm across stages.
//!
//! One update of one stage sees the gradient of its own stage only; its global norm needs the
//! squared norms of the other stages' gradients, which other workers compute. Which of their
//! updates it takes is a property of the schedule, derived here once and read alike by the
//! executor (which exchanges the norms) and the reference trainer (which holds every norm):
//!
//! - **Flush policies and `sequential`** ([`crate::Policy::is_flush`]): update `k` of every stage
//!   takes update `k` of every other stage. Every stage steps after the flush, so the norm is
//!   exact: that of the minibatch's whole gradient, as a data-parallel or sequential run has it.
//! - **Asynchronous policies**: update `k` of stage `s` takes its own norm of update `k`, and
//!   from each other stage the newest update whose norm was published (at that stage's update,
//!   by every replica) *before* this update in the schedule's causal order: a chain of the
//!   program order of workers, the messages between them, and the replicas' all-reduce. Such a
//!   norm has always been sent by the time it is needed, so reading it never waits on another
//!   stage's progress. A stage that has published nothing yet adds nothing (the first updates
//!   of a run or segment clip by the norm of the stages known so far). Every replica of a stage
//!   takes the same updates (the oldest any replica knows), so replicas stay equal.
//!
//! Replica `q` of a stage reads a norm from replica `q mod R` of the stage that computed it
//! (every replica of a stage holds the same all-reduced gradient, so any one has the norm).

use std::collections::HashMap;

use crate::action::{Action, StageId, WorkerId};
use crate::error::{Result, ScheduleError};
use crate::grid::invalid;
use crate::spec::Schedule;

/// The norm plan of a schedule (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NormPlan {
    exact: bool,
    /// `sources[s][k][t]`: the update of stage `t` whose norm update `k` of stage `s` adds
    /// (`Some(k)` for `t == s`; `None`: stage `t` has published none it can know of).
    sources: Vec<Vec<Vec<Option<u32>>>>,
    /// `readers[t][j]`: the other stages whose updates add update `j` of stage `t`, ascending.
    readers: Vec<Vec<Vec<StageId>>>,
}

impl NormPlan {
    /// Derives the plan from a lowered schedule.
    ///
    /// # Errors
    /// [`ScheduleError::Invalid`] for a schedule that is not lowered, or whose programs cannot
    /// all run to their end (run [`crate::validate::check`] first for the full check).
    pub fn derive(schedule: &Schedule) -> Result<Self> {
        let stages = schedule.stages() as usize;
        let updates: Vec<u32> = (0..stages as u32)
            .map(|s| schedule.resolved.updates_at(s))
            .collect();
        let sources = if schedule.resolved.policy.is_flush() {
            (0..stages)
                .map(|s| {
                    (0..updates[s])
                        .map(|k| vec![Some(k); stages])
                        .collect::<Vec<_>>()
                })
                .collect()
        } else {
            causal_sources(schedule, &updates)?
        };
        let mut readers: Vec<Vec<Vec<StageId>>> = updates
            .iter()
            .map(|&n| vec![Vec::new(); n as usize])
            .collect();
        for (s, per_update) in sources.iter().enumerate() {
            for row in per_update {
                for (t, k) in row.iter().enumerate() {
                    let Some(k) = *k else { continue };
                    let slot = &mut readers[t][k as usize];
                    if t != s && slot.last() != Some(&(s as StageId)) {
                        slot.push(s as StageId);
                    }
                }
            }
        }
        Ok(NormPlan {
            exact: schedule.resolved.policy.is_flush(),
            sources,
            readers,
        })
    }

    /// True when every update adds the same update of every stage (flush policies).
    pub fn is_exact(&self) -> bool {
        self.exact
    }

    /// Per stage, the update whose norm update `k` of `stage` adds (`None`: no norm of that
    /// stage yet). Empty for an update the schedule does not have.
    pub fn sources(&self, stage: StageId, k: u32) -> &[Option<u32>] {
        self.sources
            .get(stage as usize)
            .and_then(|u| u.get(k as usize))
            .map_or(&[], Vec::as_slice)
    }

    /// The other stages whose updates add the norm of update `k` of `stage`, ascending: where
    /// that norm must be sent.
    pub fn readers(&self, stage: StageId, k: u32) -> &[StageId] {
        self.readers
            .get(stage as usize)
            .and_then(|u| u.get(k as usize))
            .map_or(&[], Vec::as_slice)
    }
}

/// What one worker knows: per (stage, replica), the newest update whose norm it has seen.
type Clock = Vec<Option<u32>>;

fn merge(into: &mut Clock, from: &Clock) {
    for (a, b) in into.iter_mut().zip(from) {
        *a = (*a).max(*b);
    }
}

/// A point-to-point message between workers, as the simulation matches them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Link {
    Activation(StageId, u32, WorkerId, WorkerId),
    Gradient(StageId, u32, WorkerId, WorkerId),
    Chunk(StageId, u32, u32, WorkerId, WorkerId),
}

/// Runs the lowered programs with vector clocks over (stage, replica) and records, at every
/// update, the newest update of each other stage that its reading replica has seen.
fn causal_sources(schedule: &Schedule, updates: &[u32]) -> Result<Vec<Vec<Vec<Option<u32>>>>> {
    if !schedule.lowered {
        return Err(ScheduleError::Spec(
            "a norm plan needs a lowered schedule (sends and receives placed)".into(),
        ));
    }
    let layout = schedule.layout();
    let stages = updates.len();
    let mut offsets = Vec::with_capacity(stages + 1);
    offsets.push(0usize);
    for s in 0..stages as u32 {
        offsets.push(offsets[s as usize] + layout.replicas_of(s) as usize);
    }
    let source = |t: usize, q: u32| offsets[t] + (q % layout.replicas_of(t as StageId)) as usize;
    let workers = schedule.programs.len();
    let mut clocks: Vec<Clock> = vec![vec![None; offsets[stages]]; workers];
    let mut pcs = vec![0usize; workers];
    let mut sent: HashMap<Link, Clock> = HashMap::new();
    // Per (stage, update) all-reduce: the replicas arrived so far and their merged clock.
    let mut reduce: HashMap<(StageId, u32), (Vec<WorkerId>, Clock)> = HashMap::new();
    let mut sources: Vec<Vec<Vec<Option<u32>>>> = updates
        .iter()
        .map(|&n| vec![Vec::new(); n as usize])
        .collect();
    loop {
        let mut progress = false;
        for w in 0..workers {
            while let Some(&a) = schedule.programs[w].get(pcs[w]) {
                let me = w as WorkerId;
                let replica = layout.placement(me).1;
                match a {
                    Action::SendActivation { stage, mb, to } => {
                        sent.insert(Link::Activation(stage, mb, me, to), clocks[w].clone());
                    }
                    Action::SendGradient { stage, mb, to } => {
                        sent.insert(Link::Gradient(stage, mb, me, to), clocks[w].clone());
                    }
                    Action::SendChunk {
                        stage,
                        update,
                        step,
                        to,
                    } => {
                        let link = Link::Chunk(stage, update, step, me, to);
                        sent.insert(link, clocks[w].clone());
                    }
                    Action::RecvActivation { stage, mb, from } => {
                        let link = Link::Activation(stage.wrapping_sub(1), mb, from, me);
                        let Some(c) = sent.remove(&link) else { break };
                        merge(&mut clocks[w], &c);
                    }
                    Action::RecvGradient { stage, mb, from } => {
                        let Some(c) = sent.remove(&Link::Gradient(stage + 1, mb, from, me)) else {
                            break;
                        };
                        merge(&mut clocks[w], &c);
                    }
                    Action::RecvChunk {
                        stage,
                        update,
                        step,
                        from,
                    } => {
                        let link = Link::Chunk(stage, update, step, from, me);
                        let Some(c) = sent.remove(&link) else { break };
                        merge(&mut clocks[w], &c);
                    }
                    Action::AllReduce { stage, update } => {
                        let group = layout.replicas_of(stage) as usize;
                        let entry = reduce
                            .entry((stage, update))
                            .or_insert_with(|| (Vec::new(), vec![None; offsets[stages]]));
                        if !entry.0.contains(&me) {
                            entry.0.push(me);
                            merge(&mut entry.1, &clocks[w]);
                        }
                        if entry.0.len() < group {
                            break;
                        }
                        let merged = entry.1.clone();
                        merge(&mut clocks[w], &merged);
                    }
                    Action::Update { stage, update } => {
                        let s = stage as usize;
                        let seen: Vec<Option<u32>> = (0..stages)
                            .map(|t| {
                                if t == s {
                                    Some(update)
                                } else {
                                    clocks[w][source(t, replica)]
                                }
                            })
                            .collect();
                        let Some(row) = sources[s].get_mut(update as usize) else {
                            let why = format!("stage {stage} has {} updates", updates[s]);
                            return Err(invalid(schedule, me, pcs[w], why));
                        };
                        if row.is_empty() {
                            *row = seen;
                        } else {
                            // The oldest any replica has seen, so all replicas add the same.
                            for (have, new) in row.iter_mut().zip(seen) {
                                *have = (*have).zip(new).map(|(a, b)| a.min(b));
                            }
                        }
                        clocks[w][source(s, replica)] = Some(update);
                    }
                    _ => {}
                }
                pcs[w] += 1;
                progress = true;
            }
        }
        if (0..workers).all(|w| pcs[w] == schedule.programs[w].len()) {
            break;
        }
        if !progress {
            let w = (0..workers)
                .find(|&w| pcs[w] < schedule.programs[w].len())
                .unwrap_or(0);
            let why = "waits forever: the programs cannot run to their end".to_string();
            return Err(invalid(schedule, w as WorkerId, pcs[w], why));
        }
    }
    Ok(sources)
}
