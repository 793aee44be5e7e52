//! The stale weights of an update, as DC-ASGD reads them
//! ([`crate::optim::DelayCorrection::DcAsgd`]): one home for the executor and the reference
//! trainer, so both compensate against the same tensor, bit for bit.
//!
//! An update sums the gradients of several microbatches, and under pipedream with more than one
//! microbatch per update, or vertical sync, they were not all computed at one weight version.
//! Each microbatch's gradient, expanded to first order around the weights `w` it is applied to,
//! is `g_i(w) ~ g_i + H (w - w_{s_i})`; with one diagonal estimate of `H` for the whole update
//! the sum is `g + H (w - w_bar)`, where `w_bar` is the mean of the microbatches' stale weights.
//! So the update is compensated against `w_bar`: the version itself where every microbatch used
//! one (2bw always, pipedream with one microbatch per update), otherwise the versions'
//! microbatch-weighted mean, summed in ascending version order.

use std::borrow::Cow;

use pipe_kernels::Backend;
use pipe_scheduler::{StageId, VersionPlan};

use crate::error::{Result, StageError};
use crate::model::{Params, place_params};

/// The stale weights update `k` of `stage` is compensated against: the one version its
/// gradients were computed at, or the microbatch-weighted mean of several. `version` hands
/// out a version's weights (held until the update: see
/// [`VersionPlan::last_uses_through_updates`]).
///
/// # Errors
/// A version not held, or kernel errors.
pub fn stale_weights<'p>(
    be: &dyn Backend,
    plan: &VersionPlan,
    (stage, k): (StageId, u32),
    version: impl Fn(u32) -> Result<&'p Params>,
) -> Result<Cow<'p, Params>> {
    let used = plan.gradient_versions(stage, k);
    match used.as_slice() {
        [] => Err(StageError::Executor(format!(
            "update {k} of stage {stage} sums no gradients to compensate"
        ))),
        [(v, _)] => Ok(Cow::Borrowed(version(*v)?)),
        many => {
            let total: u32 = many.iter().map(|&(_, n)| n).sum();
            let first = version(many[0].0)?;
            let zeros: Params = first
                .iter()
                .map(|l| {
                    l.iter()
                        .map(|t| pipe_kernels::Tensor::zeros(t.shape()))
                        .collect()
                })
                .collect();
            let mut mean = place_params(be, zeros)?;
            for &(v, n) in many {
                let share = n as f32 / total as f32;
                for (m, w) in mean.iter_mut().flatten().zip(version(v)?.iter().flatten()) {
                    be.axpy(share, w, m)?;
                }
            }
            Ok(Cow::Owned(mean))
        }
    }
}
