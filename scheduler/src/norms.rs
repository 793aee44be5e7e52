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
    let mut run = CausalRun::new(schedule, updates);
    let workers = schedule.programs.len();
    let mut pcs = vec![0usize; workers];
    loop {
        let mut progress = false;
        for (w, (program, pc)) in schedule.programs.iter().zip(&mut pcs).enumerate() {
            while let Some(&a) = program.get(*pc) {
                if !run.step(w, *pc, a)? {
                    break;
                }
                *pc += 1;
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
    Ok(run.sources)
}

/// The state of [`causal_sources`]' run: every worker's clock, the messages in flight, the
/// all-reduces under way and the sources recorded so far.
struct CausalRun<'a> {
    schedule: &'a Schedule,
    updates: &'a [u32],
    /// `offsets[t]`: the clock entry of replica 0 of stage `t`; `offsets[stages]`: the length
    /// of a clock.
    offsets: Vec<usize>,
    clocks: Vec<Clock>,
    sent: HashMap<Link, Clock>,
    /// Per (stage, update) all-reduce: the replicas arrived so far and their merged clock.
    reduce: HashMap<(StageId, u32), (Vec<WorkerId>, Clock)>,
    sources: Vec<Vec<Vec<Option<u32>>>>,
}

impl<'a> CausalRun<'a> {
    /// The run before any action, with `updates[s]` updates of stage `s`.
    fn new(schedule: &'a Schedule, updates: &'a [u32]) -> Self {
        let layout = schedule.layout();
        let stages = updates.len();
        let mut offsets = Vec::with_capacity(stages + 1);
        offsets.push(0usize);
        for s in 0..stages as u32 {
            offsets.push(offsets[s as usize] + layout.replicas_of(s) as usize);
        }
        let clocks = vec![vec![None; offsets[stages]]; schedule.programs.len()];
        let sources = updates
            .iter()
            .map(|&n| vec![Vec::new(); n as usize])
            .collect();
        CausalRun {
            schedule,
            updates,
            offsets,
            clocks,
            sent: HashMap::new(),
            reduce: HashMap::new(),
            sources,
        }
    }

    /// The clock entry replica `q` of any stage reads stage `t`'s norms from: that of replica
    /// `q mod R` of `t`.
    fn source(&self, t: usize, q: u32) -> usize {
        self.offsets[t] + (q % self.schedule.layout().replicas_of(t as StageId)) as usize
    }

    /// Runs action `a`, step `pc` of worker `w`: true when it ran, false when it waits (for a
    /// message not yet sent or replicas not yet at the all-reduce).
    ///
    /// # Errors
    /// [`ScheduleError::Invalid`] for an update the schedule does not have.
    fn step(&mut self, w: usize, pc: usize, a: Action) -> Result<bool> {
        let me = w as WorkerId;
        let replica = self.schedule.layout().placement(me).1;
        let ran = match a {
            Action::SendActivation { stage, mb, to } => {
                self.send(w, Link::Activation(stage, mb, me, to));
                true
            }
            Action::SendGradient { stage, mb, to } => {
                self.send(w, Link::Gradient(stage, mb, me, to));
                true
            }
            Action::SendChunk {
                stage,
                update,
                step,
                to,
            } => {
                self.send(w, Link::Chunk(stage, update, step, me, to));
                true
            }
            Action::RecvActivation { stage, mb, from } => {
                self.receive(w, Link::Activation(stage.wrapping_sub(1), mb, from, me))
            }
            Action::RecvGradient { stage, mb, from } => {
                self.receive(w, Link::Gradient(stage + 1, mb, from, me))
            }
            Action::RecvChunk {
                stage,
                update,
                step,
                from,
            } => self.receive(w, Link::Chunk(stage, update, step, from, me)),
            Action::AllReduce { stage, update } => self.all_reduce(w, stage, update),
            Action::Update { stage, update } => {
                self.update(w, pc, stage, update, replica)?;
                true
            }
            _ => true,
        };
        Ok(ran)
    }

    /// Worker `w` sends `link`'s message, carrying its clock.
    fn send(&mut self, w: usize, link: Link) {
        self.sent.insert(link, self.clocks[w].clone());
    }

    /// Worker `w` receives `link`'s message and merges its clock: false while it is not sent.
    fn receive(&mut self, w: usize, link: Link) -> bool {
        let Some(c) = self.sent.remove(&link) else {
            return false;
        };
        merge(&mut self.clocks[w], &c);
        true
    }

    /// Worker `w` reaches the all-reduce of `stage`'s update `update`: false until every
    /// replica has, then it merges all their clocks.
    fn all_reduce(&mut self, w: usize, stage: StageId, update: u32) -> bool {
        let me = w as WorkerId;
        let group = self.schedule.layout().replicas_of(stage) as usize;
        let len = self.offsets[self.updates.len()];
        let entry = self
            .reduce
            .entry((stage, update))
            .or_insert_with(|| (Vec::new(), vec![None; len]));
        if !entry.0.contains(&me) {
            entry.0.push(me);
            merge(&mut entry.1, &self.clocks[w]);
        }
        if entry.0.len() < group {
            return false;
        }
        merge(&mut self.clocks[w], &entry.1);
        true
    }

    /// Worker `w`, replica `replica` of `stage`, runs its update `update` at step `pc`: records
    /// the update of every stage its norm adds and publishes its own.
    ///
    /// # Errors
    /// [`ScheduleError::Invalid`] for an update the schedule does not have.
    fn update(
        &mut self,
        w: usize,
        pc: usize,
        stage: StageId,
        update: u32,
        replica: u32,
    ) -> Result<()> {
        let s = stage as usize;
        let seen: Vec<Option<u32>> = (0..self.updates.len())
            .map(|t| {
                if t == s {
                    Some(update)
                } else {
                    self.clocks[w][self.source(t, replica)]
                }
            })
            .collect();
        let Some(row) = self.sources[s].get_mut(update as usize) else {
            let why = format!("stage {stage} has {} updates", self.updates[s]);
            return Err(invalid(self.schedule, w as WorkerId, pc, why));
        };
        if row.is_empty() {
            *row = seen;
        } else {
            // The oldest any replica has seen, so all replicas add the same.
            for (have, new) in row.iter_mut().zip(seen) {
                *have = (*have).zip(new).map(|(a, b)| a.min(b));
            }
        }
        let own = self.source(s, replica);
        self.clocks[w][own] = Some(update);
        Ok(())
    }
}
