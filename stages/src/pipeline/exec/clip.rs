//! Gradient clipping by the global norm, in the worker core: each stage's squared norm of an
//! update, the small messages that carry it to the stages whose updates add it, and the scaling
//! before the step. Which norms an update adds is the norm plan's
//! ([`pipe_scheduler::NormPlan`]); the reference trainer adds the same ones in the same order.
//!
//! A stage's norm is taken once its gradients are what the step applies (all-reduced, scaled
//! to the mean, compensated, tied uses summed), at its `Update` action. Under a flush policy
//! every update adds every stage's norm of the same update, so a worker holding several stages
//! (interleaved, V-shaped) readies all of them at its first `Update` of that update, where the
//! flush has completed their gradients.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use pipe_kernels::Backend;
use pipe_scheduler::Action;
use pipe_transport::{Key, Kind, Message};

use super::{WorkerCore, WorkerState, exec_err};
use crate::error::Result;
use crate::optim::{UpdateMean, clip_coefficient, scale_gradients};
use crate::pipeline::setup::Setup;

/// The [`Key::step`] of a gradient-norm message (below [`super::TIED_GRADIENT_STEP`], far above
/// any ring step).
pub const GRADIENT_NORM_STEP: u32 = u32::MAX - 1;

/// A worker's clipping state for one run.
pub(super) struct ClipState {
    /// The norm to clip to; `None`: no clipping.
    max_norm: Option<f32>,
    /// Squared norms held, by (stage, update): its own stages' and those received.
    norms: BTreeMap<(u32, u32), f64>,
    /// Under a flush policy on a worker with several stages: per (stage, update), the program
    /// counter of the last action that adds to those gradients.
    complete_at: HashMap<(u32, u32), usize>,
}

impl ClipState {
    pub(super) fn new(setup: &Setup<'_>, state: &WorkerState) -> Self {
        let max_norm = state
            .stages
            .first()
            .and_then(|st| st.opt.config().grad_clip);
        let plan = setup.plan;
        let mut complete_at = HashMap::new();
        if max_norm.is_some() && plan.norms.is_exact() && state.stages.len() > 1 {
            let resolved = &plan.schedule.resolved;
            let program = &plan.schedule.programs[state.worker as usize];
            for (pc, a) in program.iter().enumerate() {
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
            norms: BTreeMap::new(),
            complete_at,
        }
    }
}

impl WorkerCore<'_, '_> {
    /// The stages to ready at `Update` of `stage` and `update`, in chunk order, before the norms
    /// are exchanged: that stage, and under a flush policy with clipping every other stage of
    /// this worker not readied yet.
    pub fn stages_to_prepare(&self, stage: u32, update: u32) -> Vec<u32> {
        if self.clip.max_norm.is_none() || !self.setup.plan.norms.is_exact() {
            return vec![stage];
        }
        self.stages
            .iter()
            .filter(|run| run.current_version == update && !run.prepared)
            .map(|run| run.stage)
            .collect()
    }

    /// Readies `stage`'s gradients of `update` for the step (after its tied gradients were
    /// delivered), and returns the messages carrying its squared norm to the workers whose
    /// updates add it (none without clipping).
    ///
    /// # Errors
    /// A stage this worker does not hold or that is at another version; gradients the program
    /// has not completed by `pc`; kernel errors.
    pub fn prepare_stage(
        &mut self,
        be: &dyn Backend,
        pc: usize,
        stage: u32,
        update: u32,
    ) -> Result<Vec<Message>> {
        let c = self.chunk(stage)?;
        if self.stages[c].current_version != update {
            return Err(exec_err(format!(
                "stage {stage} readied for update {update} at version {}",
                self.stages[c].current_version
            )));
        }
        if self
            .clip
            .complete_at
            .get(&(stage, update))
            .is_some_and(|&at| at > pc)
        {
            return Err(exec_err(format!(
                "gradient clipping needs stage {stage}'s gradients of update {update} complete \
                 at this worker's first update of it, and this schedule completes them later"
            )));
        }
        self.prepare(be, c, update)?;
        let Some(&squared) = self.clip.norms.get(&(stage, update)) else {
            return Ok(Vec::new());
        };
        let layout = self.layout;
        let replicas = layout.replicas_of(stage);
        let mine = layout.placement(self.worker).1;
        let own_group: Vec<u32> = layout.group(stage).collect();
        let mut to = BTreeSet::new();
        for &reader in self.setup.plan.norms.readers(stage, update) {
            to.extend(
                layout.group(reader).filter(|w| {
                    !own_group.contains(w) && layout.placement(*w).1 % replicas == mine
                }),
            );
        }
        Ok(to
            .into_iter()
            .map(|w| {
                let key = norm_key(self.worker, w, stage, update);
                Message::from_bytes(key, &squared.to_le_bytes())
            })
            .collect())
    }

    /// The keys of the norms `Update` of `stage` and `update` adds that this worker has not
    /// received yet.
    ///
    /// # Errors
    /// A norm of a stage this worker holds that it has not readied (a schedule the norm plan
    /// does not fit).
    pub fn norm_keys(&self, stage: u32, update: u32) -> Result<Vec<Key>> {
        if self.clip.max_norm.is_none() {
            return Ok(Vec::new());
        }
        let layout = self.layout;
        let mine = layout.placement(self.worker).1;
        let mut keys = Vec::new();
        for (t, j) in self
            .setup
            .plan
            .norms
            .sources(stage, update)
            .iter()
            .enumerate()
        {
            let (t, Some(j)) = (t as u32, *j) else {
                continue;
            };
            if t == stage || self.clip.norms.contains_key(&(t, j)) {
                continue;
            }
            let group: Vec<u32> = layout.group(t).collect();
            if group.contains(&self.worker) || group.is_empty() {
                return Err(exec_err(format!(
                    "update {update} of stage {stage} adds stage {t}'s norm of update {j}, which \
                     this worker has not readied"
                )));
            }
            let from = group[mine as usize % group.len()];
            keys.push(norm_key(from, self.worker, t, j));
        }
        Ok(keys)
    }

    /// Takes a squared norm another worker sent ([`WorkerCore::norm_keys`]).
    ///
    /// # Errors
    /// A payload that is not one finite, non-negative `f64`.
    pub fn deliver_norm(&mut self, m: Message) -> Result<()> {
        let (stage, update, from) = (m.key.stage, m.key.index, m.key.from);
        let bytes = m.into_bytes()?;
        let value = <[u8; 8]>::try_from(bytes.as_slice())
            .ok()
            .map(f64::from_le_bytes)
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| {
                exec_err(format!(
                    "worker {from}'s gradient norm of stage {stage}, update {update} is not one \
                     finite non-negative number ({} bytes)",
                    bytes.len()
                ))
            })?;
        self.clip.norms.insert((stage, update), value);
        Ok(())
    }

    /// When clipping: scales chunk `c`'s readied gradients to the mean (unless a compensation
    /// did) and notes their squared norm.
    pub(super) fn note_norm(&mut self, be: &dyn Backend, c: usize, update: u32) -> Result<()> {
        if self.clip.max_norm.is_none() {
            return Ok(());
        }
        let setup = self.setup;
        let run = &mut self.stages[c];
        let mean = UpdateMean::of(&setup.plan.schedule.resolved);
        run.optimizer
            .to_mean(be, &mut run.grads, (mean, run.update_size))?;
        let squared = setup
            .model
            .gradient_square_norm(be, run.layers.start, &run.grads)?;
        self.clip.norms.insert((run.stage, update), squared);
        Ok(())
    }

    /// When clipping: the global norm update `update` of chunk `c` adds up (stages in
    /// ascending order), and the gradients scaled down to the clipping norm where it is
    /// larger. The loss stage's first replica records the norm.
    pub(super) fn clip(&mut self, be: &dyn Backend, c: usize, update: u32) -> Result<()> {
        let Some(max_norm) = self.clip.max_norm else {
            return Ok(());
        };
        let stage = self.stages[c].stage;
        let sources = self.setup.plan.norms.sources(stage, update);
        if sources.is_empty() {
            return Err(exec_err(format!(
                "stage {stage} has no update {update} in the norm plan"
            )));
        }
        let mut squared = 0.0;
        for (t, j) in sources.iter().enumerate() {
            let Some(j) = *j else { continue };
            squared += self.clip.norms.get(&(t as u32, j)).ok_or_else(|| {
                exec_err(format!(
                    "update {update} of stage {stage} lacks stage {t}'s norm of update {j}"
                ))
            })?;
        }
        let norm = squared.sqrt();
        if let Some(factor) = clip_coefficient(max_norm, norm) {
            scale_gradients(be, &mut self.stages[c].grads, factor)?;
        }
        if stage == self.last_stage && self.layout.placement(self.worker).1 == 0 {
            self.outcome.grad_norms.push((update, norm));
            if let Some(tx) = self.setup.progress {
                // As for losses: the outcome keeps the norm if the trainer's thread has gone.
                let _ = tx.send(crate::pipeline::setup::Report::GradNorm(update, norm));
            }
        }
        Ok(())
    }

    /// Drops the norms no coming update of this worker's stages adds (an update adds, from
    /// each stage, an update no older than its previous update of the same stage did).
    pub(super) fn forget_norms(&mut self) {
        if self.clip.norms.is_empty() {
            return;
        }
        let plan = &self.setup.plan.norms;
        let needs: Vec<&[Option<u32>]> = self
            .stages
            .iter()
            .map(|run| plan.sources(run.stage, run.current_version))
            .collect();
        self.clip.norms.retain(|&(t, j), _| {
            needs.iter().any(|row| {
                row.get(t as usize)
                    .copied()
                    .flatten()
                    .is_some_and(|oldest| oldest <= j)
            })
        });
    }
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
