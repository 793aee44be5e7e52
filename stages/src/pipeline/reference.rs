//! The sequential reference trainer: one thread, every weight version of every stage kept,
//! following a version plan literally.
//!
//! It never looks at a schedule's order. A microbatch is computed as soon as every version its
//! plan names exists: forward through every stage with its forward versions, then the
//! input-gradient backward with its backward versions. An update of a stage is applied as soon
//! as every microbatch it sums has been computed: each replica's gradients are accumulated in
//! the plan's order with the same kernel calls the executor makes, replicas are combined in
//! ring order ([`ring_sum`]), the sum is scaled by one over the update's size and the optimizer
//! steps from the newest version. Whatever order a pipelined run executes, its weights must
//! equal these bit for bit.

use std::collections::HashMap;

use pipe_kernels::{Backend, Tensor};
use pipe_transport::collective::ring_sum;

use super::{Setup, flatten, mean_step, unflatten};
use crate::error::{Result, StageError};
use crate::layers::Saved;
use crate::model::Params;
use crate::optim::{Optimizer, OptimizerConfig};

/// Per computed microbatch of a stage: saved activations and each layer's output gradient.
type Pending = HashMap<u32, (Vec<Saved>, Vec<Tensor>)>;

/// Runs the reference trainer from `init` (the whole model's parameters) and returns each
/// stage's final weights (its newest version).
///
/// # Errors
/// Kernel and data errors, or [`StageError::Executor`] if the plan can never complete.
pub fn reference_train(
    be: &dyn Backend,
    setup: &Setup<'_>,
    init: &Params,
    opt: OptimizerConfig,
) -> Result<Vec<Params>> {
    let schedule = setup.schedule;
    let plan = setup.plan;
    let model = setup.model;
    let stages = schedule.stages() as usize;
    let n = schedule.total_microbatches();
    let mut versions: Vec<Vec<Params>> = (0..stages)
        .map(|s| vec![init[setup.partition.range(s)].to_vec()])
        .collect();
    let mut opts: Vec<Optimizer> = versions
        .iter()
        .map(|v| Optimizer::new(opt, &v[0]))
        .collect();
    // Per stage, per computed microbatch: saved activations and the output gradient of each
    // layer, waiting for the weight-gradient half.
    let mut pending: Vec<Pending> = vec![HashMap::new(); stages];
    let mut done = vec![false; n as usize];
    let mut next_update = vec![0u32; stages];
    let updates: Vec<u32> = (0..stages as u32).map(|s| plan.updates_at(s)).collect();
    loop {
        let mut progress = false;
        for mb in 0..n {
            if done[mb as usize] {
                continue;
            }
            let ready = (0..stages as u32).all(|s| {
                let have = versions[s as usize].len() as u32;
                plan.forward_version(s, mb) < have && plan.backward_version(s, mb) < have
            });
            if !ready {
                continue;
            }
            let mut h = setup.data.inputs(mb)?;
            let mut saved_all = Vec::with_capacity(stages);
            for (s, vs) in versions.iter().enumerate() {
                let v = plan.forward_version(s as u32, mb) as usize;
                let (y, saved) = model.forward_range(
                    be,
                    setup.partition.range(s),
                    &vs[v],
                    h,
                    true,
                    setup.seed,
                    setup.microbatch_offset + u64::from(mb),
                )?;
                saved_all.push(saved);
                h = y;
            }
            let labels = setup.data.labels(mb)?;
            let mut g = Tensor::default();
            be.softmax_cross_entropy(&h, &labels, 1.0 / labels.len().max(1) as f32, Some(&mut g))?;
            for s in (0..stages).rev() {
                let v = plan.backward_version(s as u32, mb) as usize;
                let saved = saved_all.pop().unwrap_or_default();
                let (dx, dys) = model.backward_input_range(
                    be,
                    setup.partition.range(s),
                    &versions[s][v],
                    &saved,
                    g,
                    s > 0,
                )?;
                pending[s].insert(mb, (saved, dys));
                g = dx.unwrap_or_default();
            }
            done[mb as usize] = true;
            progress = true;
        }
        for s in 0..stages {
            while next_update[s] < updates[s] {
                let k = next_update[s];
                let sums = plan.update(s as u32, k);
                if !sums.microbatches().all(|mb| pending[s].contains_key(&mb)) {
                    break;
                }
                let range = setup.partition.range(s);
                let mut partials: Vec<Params> = Vec::with_capacity(sums.per_replica.len());
                for mbs in &sums.per_replica {
                    let mut acc = model.zero_grads(range.clone());
                    for (i, mb) in mbs.iter().enumerate() {
                        let (saved, dys) = pending[s].remove(mb).ok_or_else(|| {
                            StageError::Executor(format!("microbatch {mb} summed twice"))
                        })?;
                        let v = plan.backward_version(s as u32, *mb) as usize;
                        model.backward_params_range(
                            be,
                            range.clone(),
                            &versions[s][v],
                            &saved,
                            &dys,
                            &mut acc,
                            i > 0,
                        )?;
                    }
                    partials.push(acc);
                }
                let mut grads = if partials.len() == 1 {
                    partials.pop().unwrap_or_default()
                } else {
                    let flats: Vec<Vec<f32>> = partials.iter().map(flatten).collect();
                    let sum = ring_sum(&flats.iter().map(Vec::as_slice).collect::<Vec<_>>());
                    let mut out = partials.swap_remove(0);
                    unflatten(&mut out, &sum);
                    out
                };
                let mut p = versions[s][versions[s].len() - 1].clone();
                let size = schedule.resolved.update_size(s as u32);
                mean_step(
                    be,
                    &mut opts[s],
                    &mut p,
                    &mut grads,
                    size,
                    (setup.lr)(s as u32, k),
                )?;
                versions[s].push(p);
                next_update[s] += 1;
                progress = true;
            }
        }
        let finished = done.iter().all(|&d| d) && (0..stages).all(|s| next_update[s] == updates[s]);
        if finished {
            break;
        }
        if !progress {
            return Err(StageError::Executor(
                "the version plan can never complete (a version waits on itself)".into(),
            ));
        }
    }
    Ok(versions
        .into_iter()
        .map(|mut v| v.pop().unwrap_or_default())
        .collect())
}
