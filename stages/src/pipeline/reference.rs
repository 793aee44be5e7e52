//! The sequential reference trainer: one thread, every weight version of every stage kept,
//! following a version plan literally.
//!
//! It never looks at a schedule's order. A microbatch is computed as soon as every version its
//! plan names exists: forward through every stage with its forward versions, then the
//! input-gradient backward with its backward versions. An update of a stage is applied as soon
//! as every microbatch it sums has been computed: each replica's gradients are accumulated in
//! the plan's order with the same kernel calls the executor makes, replicas are combined in
//! ring order bucket by bucket
//! ([`ring_sum`](pipe_transport::collective::ring_sum), [`super::gradient_buckets`]), the uses of each tied parameter are summed
//! ([`Model::sum_tied`](crate::model::Model::sum_tied)), the sum is scaled by one over the
//! update's size and the optimizer steps from the newest version. Whatever order a pipelined
//! run executes, its weights must equal these bit for bit.
//!
//! Stages that share a tied parameter update together: update `k` of each of them waits until
//! all of them have every gradient of their update `k`, and every copy of the tied parameter
//! then applies the same summed gradient, so the copies stay equal and version `v` of the tied
//! parameter is the same tensor on every stage that uses it.

use std::borrow::Cow;
use std::collections::HashMap;

use pipe_kernels::{Backend, Tensor};

use super::setup::Setup;
use crate::error::{Result, StageError};
use crate::layers::Saved;
use crate::model::{Params, place_params};
use crate::optim::{Corrected, OptimizerConfig, UpdateMean};
use crate::remedy::{Prediction, Velocity, corrected_weights, stage_delays};

/// Per computed microbatch of a stage: saved activations and each layer's output gradient.
type Pending = HashMap<u32, (Vec<Saved>, Vec<Tensor>)>;

/// Every stage's state in the reference run.
struct Reference<'s, 'a> {
    setup: &'s Setup<'a>,
    /// Per stage, every version so far.
    versions: Vec<Vec<Params>>,
    opts: Vec<Corrected>,
    pending: Vec<Pending>,
    next_update: Vec<u32>,
    /// Per stage, the stages it updates together with (itself included, ascending).
    tie_group: Vec<Vec<usize>>,
    /// Per microbatch, its summed loss.
    losses: Vec<f64>,
    /// Per stage, the gradients of its next update once readied (summed, compensated, tied
    /// uses summed; at the mean when clipping), waiting for the norms it adds.
    ready: Vec<Option<Params>>,
    /// Gradient clipping: every squared norm, by (stage, update).
    norms: HashMap<(usize, u32), f64>,
    /// The loss stage's global norm of each update before clipping.
    grad_norms: Vec<f64>,
    /// Weight prediction: per stage, the velocity estimate of every version (empty without
    /// prediction), and the look-ahead distance (each stage's delay; empty unless look-ahead).
    velocities: Vec<Vec<Velocity>>,
    lookahead: Vec<f32>,
}

/// Runs the reference trainer from `init` (the whole model's parameters) and returns each
/// stage's final weights (its newest version).
///
/// # Errors
/// Kernel and data errors; [`StageError::Config`] when stages that share a tied parameter
/// update at different rates; [`StageError::Executor`] if the plan can never complete.
pub fn reference_train(
    be: &dyn Backend,
    setup: &Setup<'_>,
    init: &Params,
    opt: OptimizerConfig,
) -> Result<Vec<Params>> {
    let plan = setup.plan;
    let matrices = setup.model.optimizer_roles();
    let opts = (0..plan.schedule.stages() as usize)
        .map(|s| {
            let range = plan.partition.range(s);
            Corrected::new(opt, &init[range.clone()].to_vec(), &matrices[range]).placed(be)
        })
        .collect::<Result<_>>()?;
    reference_train_from(be, setup, init, opts).map(|(params, _)| params)
}

/// [`reference_train`] from given optimizers (one per stage, in stage order), as a run
/// resumes after a drain point: the pipeline drains at the end of every schedule, and a run
/// cut into several schedules (epochs, or segments between checkpoints) carries the weights
/// and the optimizers' state from one to the next. Returns each stage's final weights and
/// optimizer.
///
/// # Errors
/// As [`reference_train`]; [`StageError::Config`] for a number of optimizers other than
/// the stage count.
pub fn reference_train_from(
    be: &dyn Backend,
    setup: &Setup<'_>,
    init: &Params,
    opts: Vec<Corrected>,
) -> Result<(Vec<Params>, Vec<Corrected>)> {
    reference_run(be, setup, init, opts).map(|r| (r.params, r.opts))
}

/// What a reference run ends with.
#[derive(Debug)]
pub struct ReferenceRun {
    /// Each stage's final weights.
    pub params: Vec<Params>,
    /// Each stage's optimizer, to carry into a next run.
    pub opts: Vec<Corrected>,
    /// Per microbatch of the run, in order: the sum of its samples' losses, as the last stage
    /// of a pipelined run reports it (`WorkerOutcome::losses`).
    pub losses: Vec<f64>,
    /// When clipping: per update of the loss stage, the global gradient norm before clipping
    /// (`WorkerOutcome::grad_norms`).
    pub grad_norms: Vec<f64>,
}

/// [`reference_train_from`], also returning every microbatch's loss.
///
/// # Errors
/// As [`reference_train_from`].
pub fn reference_run(
    be: &dyn Backend,
    setup: &Setup<'_>,
    init: &Params,
    opts: Vec<Corrected>,
) -> Result<ReferenceRun> {
    let plan = setup.plan;
    let stages = plan.schedule.stages() as usize;
    if opts.len() != stages {
        return Err(StageError::Config(format!(
            "{} optimizers for {stages} stages",
            opts.len()
        )));
    }
    let n = plan.schedule.total_microbatches();
    let versions: Vec<Vec<Params>> = (0..stages)
        .map(|s| {
            Ok(vec![place_params(
                be,
                init[plan.partition.range(s)].to_vec(),
            )?])
        })
        .collect::<Result<_>>()?;
    let velocities = match setup.prediction.decay() {
        Some(decay) => versions
            .iter()
            .map(|v| Ok(vec![Velocity::new(be, &v[0], decay)?]))
            .collect::<Result<_>>()?,
        None => Vec::new(),
    };
    let lookahead = match setup.prediction {
        Prediction::LookAhead { .. } => stage_delays(&plan.schedule.resolved, &plan.versions)
            .into_iter()
            .map(|d| d as f32)
            .collect(),
        _ => Vec::new(),
    };
    let mut r = Reference {
        setup,
        velocities,
        lookahead,
        versions,
        opts,
        pending: vec![HashMap::new(); stages],
        next_update: vec![0; stages],
        tie_group: tie_groups(setup)?,
        losses: vec![0.0; n as usize],
        ready: vec![None; stages],
        norms: HashMap::new(),
        grad_norms: Vec::new(),
    };
    let mut done = vec![false; n as usize];
    loop {
        let mut progress = false;
        for mb in 0..n {
            if !done[mb as usize] && r.ready(mb) {
                r.microbatch(be, mb)?;
                done[mb as usize] = true;
                progress = true;
            }
        }
        for s in 0..stages {
            loop {
                if r.update_ready(s) {
                    r.prepare(be, s)?;
                } else if r.step_ready(s) {
                    r.step(be, s)?;
                } else {
                    break;
                }
                progress = true;
            }
        }
        let updates_done =
            (0..stages).all(|s| r.next_update[s] == plan.versions.updates_at(s as u32));
        if done.iter().all(|&d| d) && updates_done {
            break;
        }
        if !progress {
            return Err(StageError::Executor(
                "the version plan can never complete (a version waits on itself)".into(),
            ));
        }
    }
    let params = r
        .versions
        .into_iter()
        .map(|mut v| v.pop().unwrap_or_default())
        .collect();
    Ok(ReferenceRun {
        params,
        opts: r.opts,
        losses: r.losses,
        grad_norms: r.grad_norms,
    })
}

/// Per stage, the stages sharing a tied parameter with it (transitively), ascending.
fn tie_groups(setup: &Setup<'_>) -> Result<Vec<Vec<usize>>> {
    let plan = setup.plan;
    let stages = plan.schedule.stages() as usize;
    let stage_of = |layer: usize| {
        (0..stages)
            .find(|&s| plan.partition.range(s).contains(&layer))
            .unwrap_or(0)
    };
    let mut group: Vec<usize> = (0..stages).collect();
    let root = |g: &Vec<usize>, mut s: usize| {
        while g[s] != s {
            s = g[s];
        }
        s
    };
    for entry in setup.model.param_table() {
        let mut users = entry.uses.iter().map(|&(l, _)| stage_of(l));
        if let Some(first) = users.next() {
            for s in users {
                let (a, b) = (root(&group, first), root(&group, s));
                group[a.max(b)] = a.min(b);
            }
        }
    }
    let groups: Vec<Vec<usize>> = (0..stages)
        .map(|s| {
            (0..stages)
                .filter(|&t| root(&group, t) == root(&group, s))
                .collect()
        })
        .collect();
    for g in &groups {
        let rates: Vec<(u32, u32)> = g
            .iter()
            .map(|&s| {
                let s = s as u32;
                (
                    plan.versions.updates_at(s),
                    plan.schedule.resolved.update_size(s),
                )
            })
            .collect();
        if rates.windows(2).any(|w| w[0] != w[1]) {
            return Err(StageError::Config(format!(
                "stages {g:?} share a tied parameter but update at different rates \
                 (updates and microbatches per update: {rates:?})"
            )));
        }
    }
    Ok(groups)
}

impl Reference<'_, '_> {
    /// The weights a forward of version `v` of stage `s` uses: the version, or its look-ahead.
    fn forward_weights(&self, be: &dyn Backend, s: usize, v: usize) -> Result<Cow<'_, Params>> {
        match self.lookahead.get(s) {
            Some(&tau) => Ok(Cow::Owned(self.velocities[s][v].extrapolate(
                be,
                &self.versions[s][v],
                tau,
            )?)),
            None => Ok(Cow::Borrowed(&self.versions[s][v])),
        }
    }

    /// The weights the backward of `mb` at stage `s` uses: its planned version, its
    /// look-ahead, or the discrepancy correction's estimate of its forward's weights.
    fn backward_weights(&self, be: &dyn Backend, s: usize, mb: u32) -> Result<Cow<'_, Params>> {
        let plan = &self.setup.plan.versions;
        let v = plan.backward_version(s as u32, mb);
        if !self.lookahead.is_empty() {
            return self.forward_weights(be, s, v as usize);
        }
        if let Some(vel) = self.velocities.get(s).and_then(|vs| vs.get(v as usize)) {
            let w = &self.versions[s][v as usize];
            let forward = plan.forward_version(s as u32, mb);
            if let Some(c) = corrected_weights(be, vel, w, v, forward)? {
                return Ok(Cow::Owned(c));
            }
        }
        Ok(Cow::Borrowed(&self.versions[s][v as usize]))
    }

    /// True when every version microbatch `mb`'s plan names exists.
    fn ready(&self, mb: u32) -> bool {
        let plan = &self.setup.plan.versions;
        self.versions.iter().enumerate().all(|(s, vs)| {
            let have = vs.len() as u32;
            let s = s as u32;
            plan.forward_version(s, mb) < have && plan.backward_version(s, mb) < have
        })
    }

    /// Forward through every stage, loss, then every stage's input-gradient half.
    fn microbatch(&mut self, be: &dyn Backend, mb: u32) -> Result<()> {
        let setup = self.setup;
        let plan = setup.plan;
        let model = setup.model;
        let mut h = be.place(setup.data.inputs(mb)?)?;
        let documents = setup.documents(be, mb)?;
        let mut saved_all = Vec::with_capacity(self.versions.len());
        for s in 0..self.versions.len() {
            let v = plan.versions.forward_version(s as u32, mb) as usize;
            let (y, saved) = model.forward_range(
                be,
                plan.partition.range(s),
                &self.forward_weights(be, s, v)?,
                h,
                model.training(s),
                setup.seed,
                setup.microbatch_offset + u64::from(mb),
                documents.as_ref(),
            )?;
            saved_all.push(saved);
            h = y;
        }
        let labels = setup.data.labels(mb)?;
        let mut g = Tensor::default();
        let scale = UpdateMean::of(&setup.plan.schedule.resolved)
            .loss_scale(pipe_kernels::counted_labels(labels.host()?));
        let targets = be.place_ids(labels)?;
        let stats = setup.loss.evaluate(be, &h, &targets, scale, Some(&mut g))?;
        if let Some(loss) = self.losses.get_mut(mb as usize) {
            *loss = stats.loss_sum;
        }
        for s in (0..self.versions.len()).rev() {
            let saved = saved_all.pop().unwrap_or_default();
            let (dx, dys) = model.backward_input_range(
                be,
                plan.partition.range(s),
                &self.backward_weights(be, s, mb)?,
                &saved,
                g,
                s > 0,
            )?;
            self.pending[s].insert(mb, (saved, dys));
            g = dx.unwrap_or_default();
        }
        Ok(())
    }

    /// True when the next update of `s`, and of every stage it updates together with, has
    /// all its gradients and none of them is readied yet.
    fn update_ready(&self, s: usize) -> bool {
        let plan = &self.setup.plan.versions;
        let k = self.next_update[s];
        k < plan.updates_at(s as u32)
            && self.tie_group[s].iter().all(|&t| {
                self.next_update[t] == k
                    && self.ready[t].is_none()
                    && plan
                        .update(t as u32, k)
                        .microbatches()
                        .all(|mb| self.pending[t].contains_key(&mb))
            })
    }

    /// Stage `s`'s gradients of its next update: each replica's partial sum, then the ring sum.
    fn gradients(&mut self, be: &dyn Backend, s: usize) -> Result<Params> {
        let plan = self.setup.plan;
        let model = self.setup.model;
        let k = self.next_update[s];
        let range = plan.partition.range(s);
        let sums = plan.versions.update(s as u32, k);
        let mut partials: Vec<Params> = Vec::with_capacity(sums.per_replica.len());
        for mbs in &sums.per_replica {
            let mut acc = place_params(be, model.zero_grads(range.clone()))?;
            for (i, mb) in mbs.iter().enumerate() {
                let (saved, dys) = self.pending[s]
                    .remove(mb)
                    .ok_or_else(|| StageError::Executor(format!("microbatch {mb} summed twice")))?;
                let v = plan.versions.backward_version(s as u32, *mb) as usize;
                model.backward_params_range(
                    be,
                    range.clone(),
                    &self.versions[s][v],
                    &saved,
                    &dys,
                    &mut acc,
                    i > 0,
                    &mut |_, _| Ok(()),
                )?;
            }
            partials.push(acc);
        }
        if partials.len() > 1 {
            // The executor's all-reduce: bucket by bucket, summed over the replicas in ring
            // order.
            let ring = (plan.bucket_size_of(s as u32), plan.allreduce_wire);
            return super::allreduce::bucketed_ring_sum(be, partials, ring);
        }
        Ok(partials.pop().unwrap_or_default())
    }

    /// True when the next update of `s` is readied and every norm it adds is known.
    fn step_ready(&self, s: usize) -> bool {
        let k = self.next_update[s];
        self.ready[s].is_some()
            && (self.opts[s].optimizer().config().grad_clip.is_none()
                || self
                    .setup
                    .plan
                    .norms
                    .sources(s as u32, k)
                    .iter()
                    .enumerate()
                    .all(|(t, j)| j.is_none_or(|j| self.norms.contains_key(&(t, j)))))
    }

    /// Readies the next update of `s` and of every stage it updates together with: each
    /// stage's gradients, compensated, the tied uses summed, and when clipping scaled to the
    /// mean with their squared norm noted.
    fn prepare(&mut self, be: &dyn Backend, s: usize) -> Result<()> {
        let setup = self.setup;
        let group = self.tie_group[s].clone();
        let k = self.next_update[s];
        let mean = UpdateMean::of(&setup.plan.schedule.resolved);
        let mut grads = Vec::with_capacity(group.len());
        for &t in &group {
            let mut g = self.gradients(be, t)?;
            let held = &self.versions[t];
            let size = setup.plan.schedule.resolved.update_size(t as u32);
            self.opts[t].compensate(be, &mut g, (mean, size), || {
                let stale =
                    super::stale::stale_weights(be, &setup.plan.versions, (t as u32, k), |v| {
                        held.get(v as usize).ok_or_else(|| {
                            StageError::Executor(format!(
                                "version {v} of stage {t} does not exist yet"
                            ))
                        })
                    })?;
                Ok((&held[held.len() - 1], stale))
            })?;
            grads.push(g);
        }
        let mut parts: Vec<(usize, &mut Params)> = group
            .iter()
            .zip(grads.iter_mut())
            .map(|(&t, g)| (setup.plan.partition.range(t).start, g))
            .collect();
        setup.model.sum_tied(be, &mut parts)?;
        for (&t, mut g) in group.iter().zip(grads) {
            if self.opts[t].optimizer().config().grad_clip.is_some() {
                let size = setup.plan.schedule.resolved.update_size(t as u32);
                let start = setup.plan.partition.range(t).start;
                let squared = super::clip::squared_norm_at_mean(
                    be,
                    (setup.model, start),
                    &mut self.opts[t],
                    &mut g,
                    (mean, size),
                )?;
                self.norms.insert((t, k), squared);
            }
            self.ready[t] = Some(g);
        }
        Ok(())
    }

    /// Applies the readied next update of `s`, clipped by the global norm of the norm plan
    /// (the stages' norms added in ascending order, as the executor adds them).
    fn step(&mut self, be: &dyn Backend, t: usize) -> Result<()> {
        let setup = self.setup;
        let k = self.next_update[t];
        let mean = UpdateMean::of(&setup.plan.schedule.resolved);
        let mut g = self.ready[t]
            .take()
            .ok_or_else(|| StageError::Executor(format!("stage {t} steps unreadied")))?;
        if let Some(max_norm) = self.opts[t].optimizer().config().grad_clip {
            let norms = &self.norms;
            let norm = super::clip::global_norm(setup, (t as u32, k), |u, j| {
                norms.get(&(u as usize, j)).copied()
            })?;
            crate::optim::clip_gradients(be, &mut g, max_norm, norm)?;
            if t + 1 == self.versions.len() {
                self.grad_norms.push(norm);
            }
        }
        let mut p = self.versions[t][self.versions[t].len() - 1].clone();
        let size = setup.plan.schedule.resolved.update_size(t as u32);
        let lr = (setup.lr)(t as u32, k);
        self.opts[t].step(be, &mut p, &mut g, (mean, size), lr)?;
        if let Some(vs) = self.velocities.get_mut(t) {
            let old = &self.versions[t][self.versions[t].len() - 1];
            let mut vel = vs[vs.len() - 1].clone();
            vel.advance(be, old, &p)?;
            vs.push(vel);
        }
        self.versions[t].push(p);
        self.next_update[t] += 1;
        Ok(())
    }
}
