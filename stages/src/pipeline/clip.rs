//! Gradient clipping by the global norm, a worker's side: the squared norms it holds (its own
//! stages' and those received), the small messages that carry a norm to the workers whose
//! updates add it, and the sum an update clips by. Which norms an update adds is the norm
//! plan's ([`pipe_scheduler::NormPlan`]); the reference trainer adds the same ones in the same
//! order. The worker core ([`super::exec::WorkerCore`]) readies each stage's gradients and
//! calls in here; this module knows the plan and the layout, not the core.
//!
//! A stage's norm is taken once its gradients are what the step applies (all-reduced, scaled
//! to the mean, compensated, tied uses summed), at its `Update` action. Under a flush policy
//! every update adds every stage's norm of the same update, so a worker holding several stages
//! (interleaved, V-shaped) readies all of them at its first `Update` of that update, where the
//! flush has completed their gradients.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use pipe_scheduler::{Action, Layout, Schedule, WorkerId};
use pipe_transport::{Key, Kind, Message};

use pipe_kernels::Backend;

use super::setup::Setup;
use crate::error::{Result, StageError};
use crate::model::{Model, Params};
use crate::optim::{Corrected, UpdateMean};

/// The squared norm a stage's gradients add to an update's global norm: `grads` (the layers
/// from `first` on, readied for the step) scaled to the update's mean unless a compensation
/// did ([`Corrected::to_mean`]), then summed by [`Model::gradient_square_norm`]. Every trainer
/// takes a stage's norm through here.
///
/// # Errors
/// As [`Corrected::to_mean`]; kernel errors.
pub fn squared_norm_at_mean(
    be: &dyn Backend,
    (model, first): (&Model, usize),
    opt: &mut Corrected,
    grads: &mut Params,
    mean: (UpdateMean, u32),
) -> Result<f64> {
    opt.to_mean(be, grads, mean)?;
    model.gradient_square_norm(be, first, grads)
}

/// The [`Key::step`] of a gradient-norm message (below the tied gradients' step, far above
/// any ring step).
pub const GRADIENT_NORM_STEP: u32 = u32::MAX - 1;

fn clip_err(msg: String) -> StageError {
    StageError::Executor(msg)
}

/// One worker's clipping state for one run.
#[derive(Debug)]
pub struct ClipState {
    /// The norm to clip to; `None`: no clipping.
    max_norm: Option<f32>,
    worker: WorkerId,
    /// Squared norms held, by (stage, update): its own stages' and those received.
    norms: BTreeMap<(u32, u32), f64>,
    /// Under a flush policy on a worker with several stages: per (stage, update), the program
    /// counter of the last action that adds to those gradients.
    complete_at: HashMap<(u32, u32), usize>,
}

impl ClipState {
    /// The state of `worker`, which holds `stages` stages, clipping to `max_norm`.
    pub fn new(schedule: &Schedule, exact: bool, worker: WorkerId, max_norm: Option<f32>) -> Self {
        let mut complete_at = HashMap::new();
        let several = schedule.layout().stages_of(worker).nth(1).is_some();
        if max_norm.is_some() && exact && several {
            let resolved = &schedule.resolved;
            for (pc, a) in schedule.programs[worker as usize].iter().enumerate() {
                let key = match *a {
                    Action::Backward { stage, mb } | Action::BackwardWeight { stage, mb } => {
                        (stage, resolved.update_of(stage, mb))
                    }
                    Action::AllReduce { stage, update } => (stage, update),
                    _ => continue,
                };
                complete_at.insert(key, pc);
            }
        }
        ClipState {
            max_norm,
            worker,
            norms: BTreeMap::new(),
            complete_at,
        }
    }

    /// The norm it clips to, if it clips.
    pub fn max_norm(&self) -> Option<f32> {
        self.max_norm
    }

    /// Refuses to ready `stage`'s gradients of `update` at program counter `pc` before the
    /// program has completed them.
    ///
    /// # Errors
    /// [`StageError::Executor`] for a schedule that completes them later.
    pub fn check_complete(&self, pc: usize, stage: u32, update: u32) -> Result<()> {
        if self
            .complete_at
            .get(&(stage, update))
            .is_some_and(|&at| at > pc)
        {
            return Err(clip_err(format!(
                "gradient clipping needs stage {stage}'s gradients of update {update} complete \
                 at this worker's first update of it, and this schedule completes them later"
            )));
        }
        Ok(())
    }

    /// Notes this worker's squared norm of `stage`'s `update`, and returns the messages that
    /// carry it to the workers whose updates add it.
    pub fn publish(
        &mut self,
        setup: &Setup<'_>,
        (stage, update): (u32, u32),
        squared: f64,
    ) -> Vec<Message> {
        self.norms.insert((stage, update), squared);
        let layout = setup.plan.schedule.layout();
        let replicas = layout.replicas_of(stage);
        let mine = layout.placement(self.worker).1;
        let own_group: Vec<u32> = layout.group(stage).collect();
        let mut to = BTreeSet::new();
        for &reader in setup.plan.norms.readers(stage, update) {
            to.extend(
                layout.group(reader).filter(|w| {
                    !own_group.contains(w) && layout.placement(*w).1 % replicas == mine
                }),
            );
        }
        to.into_iter()
            .map(|w| {
                let key = norm_key(self.worker, w, stage, update);
                Message::from_bytes(key, &squared.to_le_bytes())
            })
            .collect()
    }

    /// The keys of the norms `Update` of `stage` and `update` adds that this worker has not
    /// received yet.
    ///
    /// # Errors
    /// A norm of a stage this worker holds that it has not readied (a schedule the norm plan
    /// does not fit).
    pub fn keys(&self, setup: &Setup<'_>, stage: u32, update: u32) -> Result<Vec<Key>> {
        if self.max_norm.is_none() {
            return Ok(Vec::new());
        }
        let layout: &Layout = setup.plan.schedule.layout();
        let mine = layout.placement(self.worker).1;
        let mut keys = Vec::new();
        for (t, j) in setup.plan.norms.sources(stage, update).iter().enumerate() {
            let (t, Some(j)) = (t as u32, *j) else {
                continue;
            };
            if t == stage || self.norms.contains_key(&(t, j)) {
                continue;
            }
            let group: Vec<u32> = layout.group(t).collect();
            if group.contains(&self.worker) || group.is_empty() {
                return Err(clip_err(format!(
                    "update {update} of stage {stage} adds stage {t}'s norm of update {j}, which \
                     this worker has not readied"
                )));
            }
            let from = group[mine as usize % group.len()];
            keys.push(norm_key(from, self.worker, t, j));
        }
        Ok(keys)
    }

    /// Takes a squared norm another worker sent ([`ClipState::keys`]).
    ///
    /// # Errors
    /// A payload that is not one finite, non-negative `f64`.
    pub fn deliver(&mut self, m: Message) -> Result<()> {
        let (stage, update, from) = (m.key.stage, m.key.index, m.key.from);
        let bytes = m.into_bytes()?;
        let value = <[u8; 8]>::try_from(bytes.as_slice())
            .ok()
            .map(f64::from_le_bytes)
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| {
                clip_err(format!(
                    "worker {from}'s gradient norm of stage {stage}, update {update} is not one \
                     finite non-negative number ({} bytes)",
                    bytes.len()
                ))
            })?;
        self.norms.insert((stage, update), value);
        Ok(())
    }

    /// The global norm update `update` of `stage` clips by: the square root of the squared
    /// norms its sources name, added in ascending stage order.
    ///
    /// # Errors
    /// An update the plan lacks, or a norm not held.
    pub fn global_norm(&self, setup: &Setup<'_>, stage: u32, update: u32) -> Result<f64> {
        global_norm(setup, (stage, update), |t, j| {
            self.norms.get(&(t, j)).copied()
        })
    }

    /// Drops the norms no coming update adds, given each of this worker's stages and its next
    /// update (an update adds, from each stage, an update no older than its previous update
    /// of the same stage did).
    pub fn forget(&mut self, setup: &Setup<'_>, next: impl Iterator<Item = (u32, u32)>) {
        if self.norms.is_empty() {
            return;
        }
        let plan = &setup.plan.norms;
        let needs: Vec<&[Option<u32>]> = next.map(|(s, k)| plan.sources(s, k)).collect();
        self.norms.retain(|&(t, j), _| {
            needs.iter().any(|row| {
                row.get(t as usize)
                    .copied()
                    .flatten()
                    .is_some_and(|oldest| oldest <= j)
            })
        });
    }
}

/// The global norm update `update` of `stage` clips by: the square root of the squared norms
/// the norm plan names (`squared(t, j)`: stage `t`'s of update `j`), added in ascending stage
/// order. The executor and the reference trainer both add them here.
///
/// # Errors
/// An update the plan lacks, or a norm `squared` does not have.
pub fn global_norm(
    setup: &Setup<'_>,
    (stage, update): (u32, u32),
    squared: impl Fn(u32, u32) -> Option<f64>,
) -> Result<f64> {
    let sources = setup.plan.norms.sources(stage, update);
    if sources.is_empty() {
        return Err(clip_err(format!(
            "stage {stage} has no update {update} in the norm plan"
        )));
    }
    let mut sum = 0.0;
    for (t, j) in sources.iter().enumerate() {
        let Some(j) = *j else { continue };
        sum += squared(t as u32, j).ok_or_else(|| {
            clip_err(format!(
                "update {update} of stage {stage} lacks stage {t}'s norm of update {j}"
            ))
        })?;
    }
    Ok(sum.sqrt())
}

fn norm_key(from: u32, to: u32, stage: u32, update: u32) -> Key {
    Key {
        from,
        to,
        kind: Kind::Chunk,
        stage,
        index: update,
        step: GRADIENT_NORM_STEP,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(bytes: &[u8]) -> Message {
        Message::from_bytes(norm_key(1, 0, 2, 5), bytes)
    }

    /// A peer's norm is one finite, non-negative `f64`: anything else is refused, and a good
    /// one is held under its stage and update.
    #[test]
    fn a_peers_norm_is_checked_before_it_is_held() {
        let mut state = ClipState {
            max_norm: Some(1.0),
            worker: 0,
            norms: BTreeMap::new(),
            complete_at: HashMap::new(),
        };
        for bad in [
            &[][..],
            &2.0f64.to_le_bytes()[..7],
            &[0; 9][..],
            &f64::NAN.to_le_bytes()[..],
            &f64::INFINITY.to_le_bytes()[..],
            &(-1.0f64).to_le_bytes()[..],
        ] {
            assert!(state.deliver(message(bad)).is_err(), "{bad:?}");
        }
        assert!(state.norms.is_empty());
        state.deliver(message(&2.5f64.to_le_bytes())).unwrap();
        assert_eq!(state.norms.get(&(2, 5)), Some(&2.5));
    }
}
