//! Optimizers (SGD with momentum, Nesterov and weight decay; Adam; AdamW; Muon, which
//! orthogonalises the momentum of each hidden weight matrix and steps the other parameters
//! with AdamW; Lion, the sign of an interpolated momentum) and learning-rate schedules. The
//! arithmetic runs as backend kernels and products (Muon's Newton-Schulz iteration is five
//! rounds of matrix products through [`Backend::matmul`], so it runs wherever the model
//! does); this module keeps the state and the step count and picks the hyperparameters of
//! each step. Which parameters are hidden weight matrices, and which are matrices of linear
//! maps (the decay groups), is the model's to say ([`crate::model::Model::optimizer_roles`]);
//! every optimizer is built with those roles.
//!
//! A delay correction is added by wrapping, not by a flag: [`Optimizer`] is the plain step and
//! knows nothing of delays, and [`Corrected`] wraps it with the correction a run asks for
//! ([`DelayCorrection`], whose names and rules live beside it), its strength and its memory.
//! Every trainer (the executor, the reference trainer, delayed SGD) steps through the wrapper,
//! so they apply a correction with the same operations: error feedback keeps the last update
//! and moves the weights by `u_t + c (u_t - u_{t-1})`; DC-ASGD compensates the gradient for
//! the distance between the weights it is applied to and the stale ones it was computed at,
//! before the optimizer sees it ([`Corrected::compensate`]).

use std::borrow::Cow;

use pipe_kernels::{
    AdamStep, AdamTensors, Backend, DelayCompensation, LionStep, SgdStep, Tensor, Trans, UpdateSeen,
};
use serde::{Deserialize, Serialize};

use crate::error::{Result, StageError};
pub use crate::model::ParamRole;
use crate::model::Params;
use crate::model::names::from_str_by_name;

/// A [`Corrected`] optimizer's state per layer and parameter ([`ParamState`]).
pub type OptimizerState = Vec<Vec<ParamState>>;

/// What the plain [`Optimizer`] keeps for one parameter; an empty tensor where it keeps
/// nothing.
#[derive(Clone, Debug, Default)]
pub struct Moments {
    /// Momentum, or Adam's first moment.
    pub first: Tensor,
    /// Adam's second moment.
    pub second: Tensor,
}

/// What a [`Corrected`] optimizer keeps for one parameter, as transfers and checkpoints carry
/// it: the optimizer's [`Moments`] and the delay correction's memory; an empty tensor where it
/// keeps nothing.
#[derive(Clone, Debug, Default)]
pub struct ParamState {
    /// Momentum, or Adam's first moment.
    pub first: Tensor,
    /// Adam's second moment.
    pub second: Tensor,
    /// The delay correction's memory: error feedback's last update `u_{t-1}`, or the
    /// adaptive DC-ASGD's mean square of the gradient `MS_t`.
    pub correction: Tensor,
}

impl ParamState {
    /// The names checkpoints give the state's tensors, in [`ParamState::parts`]' order.
    pub const PART_NAMES: [&'static str; 3] = ["first", "second", "correction"];

    /// The state's tensors in a fixed order (first, second, correction), for transfers and
    /// checkpoints, with the names checkpoints give them ([`ParamState::PART_NAMES`]).
    pub fn parts(&self) -> [(&'static str, &Tensor); 3] {
        let [first, second, correction] = Self::PART_NAMES;
        [
            (first, &self.first),
            (second, &self.second),
            (correction, &self.correction),
        ]
    }

    /// The state from [`ParamState::parts`]' order.
    pub fn from_parts([first, second, correction]: [Tensor; 3]) -> Self {
        Self {
            first,
            second,
            correction,
        }
    }

    /// Part `k` of [`ParamState::parts`] (0, 1 or 2; any other is the correction's), to fill.
    pub fn part_mut(&mut self, k: usize) -> &mut Tensor {
        match k {
            0 => &mut self.first,
            1 => &mut self.second,
            _ => &mut self.correction,
        }
    }

    /// The state's tensors in [`ParamState::parts`]' order, to fill.
    pub fn parts_mut(&mut self) -> [&mut Tensor; 3] {
        [&mut self.first, &mut self.second, &mut self.correction]
    }
}

/// A correction of each update for the delay between the weights a gradient was computed at
/// and the weights it is applied to (an asynchronous pipeline's staleness): each correction's
/// name, default strength and rules (where it may run, what it needs kept, what a resume may
/// read) are written here, once; [`Corrected`] applies it around an optimizer's step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DelayCorrection {
    /// The optimizer's own step.
    #[default]
    None,
    /// Error feedback on the update: with `u_t` the optimizer's whole update at step `t`
    /// (learning rate and decoupled weight decay included), the weights move by
    /// `u_t + c (u_t - u_{t-1})` (the first step by `u_1` alone). One parameter-sized buffer.
    ErrorFeedback,
    /// DC-ASGD (Zheng et al., 2017): the gradient `g`, computed at stale weights `w_s`, is
    /// replaced by `g + lambda g (.) g (.) (w - w_s)` before the optimizer's step. No buffer;
    /// it needs the stale weights, which weight stashing keeps.
    DcAsgd,
    /// DC-ASGD with `lambda` per element `lambda_0 / sqrt(MS_t + 1e-7)`,
    /// `MS_t = 0.95 MS_{t-1} + 0.05 g^2`. One parameter-sized buffer.
    DcAsgdAdaptive,
}

impl DelayCorrection {
    /// The name flags and configs use.
    pub fn name(self) -> &'static str {
        match self {
            DelayCorrection::None => "none",
            DelayCorrection::ErrorFeedback => "error-feedback",
            DelayCorrection::DcAsgd => "dc-asgd",
            DelayCorrection::DcAsgdAdaptive => "dc-asgd-adaptive",
        }
    }

    /// The strength `--delay-correction-strength` defaults to: error feedback's `c = 1`,
    /// DC-ASGD's `lambda = 0.04` (MXNet's `dcasgd`), the adaptive form's `lambda_0 = 2`.
    pub fn default_strength(self) -> f32 {
        match self {
            DelayCorrection::None | DelayCorrection::ErrorFeedback => 1.0,
            DelayCorrection::DcAsgd => 0.04,
            DelayCorrection::DcAsgdAdaptive => 2.0,
        }
    }

    /// True when the correction reads the weights a gradient was computed at (DC-ASGD), which
    /// a policy without weight stashing does not keep.
    pub fn needs_stale_weights(self) -> bool {
        matches!(
            self,
            DelayCorrection::DcAsgd | DelayCorrection::DcAsgdAdaptive
        )
    }

    /// The rules of where a correction runs, the one place they are written (`pipe train`
    /// and the experiments ask here): a correction needs a delay, so no sequential run or
    /// flush schedule; DC-ASGD needs the weights each gradient was computed at, which
    /// pipedream-nostash does not stash; and it corrects the same delay a weight prediction
    /// does (`predicts`), so not both.
    ///
    /// # Errors
    /// [`StageError::Config`] naming the correction, the policy and what would fit.
    pub fn check_fits(self, policy: pipe_scheduler::Policy, predicts: bool) -> Result<()> {
        use pipe_scheduler::Policy;
        let name = self.name();
        let refuse = |m: String| Err(StageError::Config(m));
        if self == DelayCorrection::None {
            return Ok(());
        }
        if policy == Policy::Sequential || policy.is_flush() {
            return refuse(format!(
                "--delay-correction {name} corrects the delay of an asynchronous pipeline, and \
                 {policy} has none (every gradient meets the weights it was computed at): use it \
                 with pipedream, pipedream-nostash, vertical-sync or 2bw"
            ));
        }
        if !self.needs_stale_weights() {
            return Ok(());
        }
        if policy == Policy::PipeDreamNoStash {
            return refuse(format!(
                "--delay-correction {name} needs the weights each gradient was computed at, and \
                 pipedream-nostash stashes none: use pipedream, vertical-sync or 2bw, or \
                 error-feedback"
            ));
        }
        if predicts {
            return refuse(format!(
                "--delay-correction {name} and --weight-prediction both correct the same delay \
                 (the prediction changes the weights a gradient is computed at): pick one"
            ));
        }
        Ok(())
    }

    /// True when the correction keeps a parameter-sized buffer ([`ParamState::correction`]).
    pub fn keeps_buffer(self) -> bool {
        matches!(
            self,
            DelayCorrection::ErrorFeedback | DelayCorrection::DcAsgdAdaptive
        )
    }

    /// The rule of resuming with this correction from a checkpoint whose optimizer state
    /// `saved`'s kept: its memory must read as this correction's (error feedback's last
    /// update is not the adaptive DC-ASGD's mean square), and be there where this one keeps
    /// one and absent where it keeps none. None and plain DC-ASGD, which keep nothing, resume
    /// into each other.
    ///
    /// # Errors
    /// [`StageError::Checkpoint`] naming both corrections and the one to resume with.
    pub fn check_resumes_from(self, saved: DelayCorrection) -> Result<()> {
        let carries =
            saved.keeps_buffer() == self.keeps_buffer() && (!self.keeps_buffer() || saved == self);
        if carries {
            return Ok(());
        }
        Err(StageError::Checkpoint(format!(
            "holds the optimizer state of --delay-correction {}, whose memory does not carry \
             over to --delay-correction {}: resume with {}",
            saved.name(),
            self.name(),
            saved.name()
        )))
    }
}

/// The adaptive DC-ASGD's decay of the gradient's mean square.
pub const DC_ASGD_MEAN_SQUARE_DECAY: f32 = 0.95;

/// The adaptive DC-ASGD's `eps` under the square root.
pub const DC_ASGD_EPS: f32 = 1e-7;

from_str_by_name!(DelayCorrection, "delay correction", {
    "none" => None,
    "error-feedback" => ErrorFeedback,
    "dc-asgd" => DcAsgd,
    "dc-asgd-adaptive" => DcAsgdAdaptive,
});

/// No roles: every parameter is neither kind of matrix ([`Optimizer::new`] for parameters
/// without a model, as in a bare optimizer test).
pub const NO_ROLES: &[Vec<ParamRole>] = &[];

/// Which parameters weight decay applies to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DecayGroups {
    /// Every parameter.
    #[default]
    All,
    /// Only the matrices of linear maps ([`ParamRole::linear_matrix`]): not biases, layer-norm
    /// gains or embeddings, as nanoGPT and Megatron group a GPT's parameters.
    Matrices,
}

impl DecayGroups {
    /// The name flags and configs use.
    pub fn name(self) -> &'static str {
        match self {
            DecayGroups::All => "all",
            DecayGroups::Matrices => "matrices",
        }
    }

    /// Whether a parameter of `role` decays.
    pub fn decays(self, role: ParamRole) -> bool {
        match self {
            DecayGroups::All => true,
            DecayGroups::Matrices => role.linear_matrix,
        }
    }
}

from_str_by_name!(DecayGroups, "weight-decay groups", {
    "all" => All,
    "matrices" => Matrices,
});

/// Which optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// Stochastic gradient descent.
    Sgd,
    /// Adam (L2 weight decay added to the gradient).
    Adam,
    /// AdamW (decoupled weight decay).
    Adamw,
    /// Muon: SGD momentum whose update, for each hidden weight matrix, is orthogonalised by
    /// five Newton-Schulz rounds; AdamW for every other parameter.
    Muon,
    /// Lion: the sign of an interpolation of momentum and gradient, one momentum buffer.
    Lion,
}

impl OptimizerKind {
    /// Copies of the parameters this optimizer keeps besides the weights, for memory
    /// estimates: the gradient, plus momentum (SGD, Lion; Muon's matrices) or both moments
    /// (Adam, AdamW; Muon's other parameters, counted for all as the bound).
    pub fn state_copies(self) -> f64 {
        match self {
            OptimizerKind::Sgd | OptimizerKind::Lion => 2.0,
            _ => 3.0,
        }
    }

    /// The name flags and configs use.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adam => "adam",
            OptimizerKind::Adamw => "adamw",
            OptimizerKind::Muon => "muon",
            OptimizerKind::Lion => "lion",
        }
    }

    /// Whether it keeps a momentum buffer for a parameter (its first state tensor) given the
    /// momentum setting and whether the parameter is a hidden matrix, and a second one.
    fn buffers(self, momentum: f32, matrix: bool) -> (bool, bool) {
        match self {
            OptimizerKind::Sgd => (momentum != 0.0, false),
            OptimizerKind::Adam | OptimizerKind::Adamw => (true, true),
            OptimizerKind::Muon => (true, !matrix),
            OptimizerKind::Lion => (true, false),
        }
    }
}

from_str_by_name!(OptimizerKind, "optimizer", {
    "sgd" => Sgd,
    "adam" => Adam,
    "adamw" => Adamw,
    "muon" => Muon,
    "lion" => Lion,
});

/// Optimizer hyperparameters.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    /// Which optimizer.
    pub kind: OptimizerKind,
    /// SGD's and Muon's momentum.
    pub momentum: f32,
    /// Nesterov momentum (SGD, Muon).
    pub nesterov: bool,
    /// Weight decay (L2 for SGD and Adam, decoupled for AdamW).
    pub weight_decay: f32,
    /// The parameters it applies to.
    pub decay_groups: DecayGroups,
    /// Adam first-moment decay; Lion's interpolation of the update direction.
    pub beta1: f32,
    /// Adam second-moment decay; Lion's momentum decay.
    pub beta2: f32,
    /// Adam epsilon.
    pub eps: f32,
    /// The delay correction around every step ([`Corrected`] applies it; the plain
    /// [`Optimizer`] does not read it).
    pub delay_correction: DelayCorrection,
    /// Its strength: error feedback's `c`, DC-ASGD's `lambda` (`lambda_0` of the adaptive
    /// form); see [`DelayCorrection::default_strength`].
    pub correction_strength: f32,
    /// Clip every update's gradient to this global norm (the whole model's, over every stage:
    /// [`pipe_scheduler::NormPlan`] says which stages' norms an update adds); `None`: no
    /// clipping.
    pub grad_clip: Option<f32>,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            kind: OptimizerKind::Sgd,
            momentum: 0.9,
            nesterov: false,
            weight_decay: 0.0,
            decay_groups: DecayGroups::All,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            delay_correction: DelayCorrection::None,
            correction_strength: 1.0,
            grad_clip: None,
        }
    }
}

impl OptimizerConfig {
    /// Checks ranges.
    ///
    /// # Errors
    /// [`StageError::Config`] naming the bad value.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(StageError::Config(m));
        if !(0.0..1.0).contains(&self.momentum) {
            return bad(format!("momentum must be in [0, 1), got {}", self.momentum));
        }
        if self.nesterov && self.momentum == 0.0 {
            return bad("nesterov needs a non-zero momentum".into());
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return bad(format!(
                "weight decay must be >= 0, got {}",
                self.weight_decay
            ));
        }
        if !(0.0..1.0).contains(&self.beta1) || !(0.0..1.0).contains(&self.beta2) {
            return bad(format!(
                "betas must be in [0, 1), got {} and {}",
                self.beta1, self.beta2
            ));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad(format!("eps must be positive, got {}", self.eps));
        }
        if !(self.correction_strength.is_finite() && self.correction_strength >= 0.0) {
            return bad(format!(
                "the delay correction's strength must be finite and >= 0, got {}",
                self.correction_strength
            ));
        }
        if let Some(c) = self.grad_clip
            && !(c.is_finite() && c > 0.0)
        {
            return bad(format!(
                "the gradient clipping norm must be finite and > 0 (0 turns clipping off), got {c}"
            ));
        }
        Ok(())
    }
}

/// Added to the global norm before clipping divides by it, as PyTorch's `clip_grad_norm_` does
/// (so a zero gradient stays finite).
pub const CLIP_EPS: f64 = 1e-6;

/// The factor an update's gradients are multiplied by when clipping to `max_norm` a gradient
/// whose global norm is `norm`: `max_norm / (norm + 1e-6)`, or `None` when that is at least 1
/// (the gradients stay as they are).
pub fn clip_coefficient(max_norm: f32, norm: f64) -> Option<f32> {
    let c = f64::from(max_norm) / (norm + CLIP_EPS);
    (c < 1.0).then_some(c as f32)
}

/// Clips `grads`, part of a gradient whose global norm is `norm`, to `max_norm`: multiplies
/// them by [`clip_coefficient`] where it applies. Every trainer clips through here.
///
/// # Errors
/// Kernel errors.
pub fn clip_gradients(
    be: &dyn Backend,
    grads: &mut Params,
    max_norm: f32,
    norm: f64,
) -> Result<()> {
    if let Some(factor) = clip_coefficient(max_norm, norm) {
        for g in grads.iter_mut().flatten() {
            be.scale(factor, g)?;
        }
    }
    Ok(())
}

/// How an update's summed gradient becomes a mean, written once for every trainer: each
/// microbatch's loss gradient is scaled by `1 / (targets x U)`, where `targets` counts the
/// microbatch's loss terms and `U` the microbatches the loss stage's update sums, so that the
/// sum over an update is already the mean; a stage whose update sums another number of
/// microbatches (an asynchronous schedule with unequal replica counts) rescales its sum by
/// `U / own` before its step.
///
/// Scaling at the loss once, rather than by `1 / targets` there and `1 / U` after summing,
/// makes one worker and `--schedule sequential` the same arithmetic for every `U` (the two
/// orders round differently unless `U` is a power of two, where they agree bit for bit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UpdateMean {
    loss_update: u32,
}

impl UpdateMean {
    /// The mean over updates of `loss_update` microbatches at the loss stage (at least 1).
    pub fn new(loss_update: u32) -> Self {
        UpdateMean {
            loss_update: loss_update.max(1),
        }
    }

    /// The mean of a schedule's updates: the loss stage's update size.
    pub fn of(resolved: &pipe_scheduler::Resolved) -> Self {
        let last = resolved.layout.stages().saturating_sub(1);
        Self::new(resolved.update_size(last))
    }

    /// The factor a microbatch's loss gradient is scaled by, for `targets` loss terms.
    pub fn loss_scale(self, targets: usize) -> f32 {
        1.0 / (targets.max(1) as u64 * u64::from(self.loss_update)) as f32
    }

    /// What a stage whose updates sum `own` microbatches multiplies its summed gradient by:
    /// `None` when `own` is the loss stage's (the sum is already the mean).
    pub fn rescale(self, own: u32) -> Option<f32> {
        (own.max(1) != self.loss_update).then(|| self.loss_update as f32 / own.max(1) as f32)
    }
}

/// An optimizer over one set of parameters (a model, or one stage's layers): the plain step
/// of [`OptimizerConfig::kind`]. It knows nothing of delay corrections (their fields of the
/// config are [`Corrected`]'s to read); a trainer steps through [`Corrected`].
#[derive(Debug, Clone)]
pub struct Optimizer {
    cfg: OptimizerConfig,
    /// Per layer, per parameter: momentum or first moment, and second moment.
    state: Vec<Vec<Moments>>,
    /// Per layer, per parameter: its role (Muon orthogonalises a hidden matrix's update; the
    /// decay groups pick by it).
    roles: Vec<Vec<ParamRole>>,
    steps: u64,
}

/// The coefficients of Muon's quintic Newton-Schulz iteration, `X <- a X + (b A + c A^2) X`
/// with `A = X X^T` (Jordan et al., 2024): chosen so that five rounds take every singular
/// value of a matrix of norm at most 1 to roughly 1 (between about 0.7 and 1.2), which is
/// what the update needs, faster than the cubic iteration that converges exactly.
pub const NEWTON_SCHULZ: (f32, f32, f32) = (3.4445, -4.7750, 2.0315);

/// Newton-Schulz rounds per Muon step.
pub const NEWTON_SCHULZ_STEPS: usize = 5;

/// Added to the Frobenius norm before Muon normalises the momentum (a zero matrix stays 0).
const NEWTON_SCHULZ_EPS: f32 = 1e-7;

/// Muon's update of an `m x n` matrix is scaled by this times `sqrt(max(m, n))`, which gives
/// it about the root-mean-square size of an AdamW update (Liu et al., "Muon is Scalable for
/// LLM Training", 2025), so one learning rate and one weight decay serve the matrices and the
/// parameters AdamW steps.
pub const MUON_RMS_SCALE: f32 = 0.2;

impl Optimizer {
    /// An optimizer with zeroed state shaped like `params`; `roles` gives, per layer and
    /// parameter, its role ([`crate::model::Model::optimizer_roles`] for the same layers; a
    /// `bool` marks a hidden matrix alone; a missing entry is neither kind of matrix).
    pub fn new<R: Copy + Into<ParamRole>>(
        cfg: OptimizerConfig,
        params: &Params,
        roles: &[Vec<R>],
    ) -> Self {
        let roles: Vec<Vec<ParamRole>> = params
            .iter()
            .enumerate()
            .map(|(l, layer)| {
                (0..layer.len())
                    .map(|p| {
                        roles
                            .get(l)
                            .and_then(|m| m.get(p))
                            .map_or_else(ParamRole::default, |&r| r.into())
                    })
                    .collect()
            })
            .collect();
        let state = params
            .iter()
            .zip(&roles)
            .map(|(layer, marks)| {
                layer
                    .iter()
                    .zip(marks)
                    .map(|(p, role)| {
                        let (first, second) = cfg.kind.buffers(cfg.momentum, role.hidden_matrix);
                        Moments {
                            first: zeros_if(first, p),
                            second: zeros_if(second, p),
                        }
                    })
                    .collect()
            })
            .collect();
        Self {
            cfg,
            state,
            roles,
            steps: 0,
        }
    }

    /// This optimizer with its state made resident where `be` computes.
    ///
    /// # Errors
    /// Kernel errors (device allocation).
    pub fn placed(mut self, be: &dyn Backend) -> Result<Self> {
        self.move_state(|t| Ok(be.place(t)?))?;
        Ok(self)
    }

    /// This optimizer with its state in host memory (see [`crate::model::host_tensor`]).
    ///
    /// # Errors
    /// Device failures.
    pub fn on_host(mut self, be: &dyn Backend) -> Result<Self> {
        self.move_state(|t| crate::model::host_tensor(be, t))?;
        Ok(self)
    }

    /// Replaces every state tensor by `to` of it (the tensor moved elsewhere).
    fn move_state(&mut self, mut to: impl FnMut(Tensor) -> Result<Tensor>) -> Result<()> {
        for m in self.state.iter_mut().flatten() {
            for t in [&mut m.first, &mut m.second] {
                *t = to(std::mem::take(t))?;
            }
        }
        Ok(())
    }

    /// An optimizer resuming from saved `state` (per layer and parameter; host tensors shaped
    /// like `params`) after `steps` updates.
    ///
    /// # Errors
    /// [`StageError::Checkpoint`] when `state` lacks what this optimizer keeps (momentum for
    /// SGD with momentum, both moments for Adam) or does not match `params`' shapes.
    pub fn with_state(
        cfg: OptimizerConfig,
        params: &Params,
        roles: &[Vec<impl Copy + Into<ParamRole>>],
        state: Vec<Vec<Moments>>,
        steps: u64,
    ) -> Result<Self> {
        let fresh = Self::new(cfg, params, roles);
        let ok = state.len() == fresh.state.len()
            && state.iter().zip(&fresh.state).all(|(a, b)| {
                a.len() == b.len()
                    && a.iter()
                        .zip(b)
                        .all(|(a, b)| fits(&a.first, &b.first) && fits(&a.second, &b.second))
            });
        if !ok {
            return Err(state_misfit(&cfg));
        }
        Ok(Self {
            cfg,
            state,
            roles: fresh.roles,
            steps,
        })
    }

    /// The state per layer and parameter; empty tensors where this optimizer keeps none.
    pub fn state(&self) -> &[Vec<Moments>] {
        &self.state
    }

    /// Updates applied so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The hyperparameters.
    pub fn config(&self) -> &OptimizerConfig {
        &self.cfg
    }

    /// Applies one update with learning rate `lr`: the optimizer's own step, nothing around
    /// it. Returns what its kernels saw of the gradients' and the new weights' finiteness.
    ///
    /// # Errors
    /// Shape mismatches between parameters, gradients and state.
    pub fn step(
        &mut self,
        be: &dyn Backend,
        params: &mut Params,
        grads: &Params,
        lr: f32,
    ) -> Result<StepSeen> {
        self.steps += 1;
        let t = self.steps as i32;
        let mut seen: Vec<Vec<UpdateSeen>> = params
            .iter()
            .map(|layer| vec![UpdateSeen::default(); layer.len()])
            .collect();
        // The parameters Adam's kernel updates go to the backend as one list (a device
        // launches a few kernels for all of them); the others are stepped one by one.
        let mut adam = Vec::new();
        let mut adam_at = Vec::new();
        let layers = params.iter_mut().zip(grads).zip(&mut self.state);
        for (l, (((layer, lgrads), lstate), marks)) in layers.zip(&self.roles).enumerate() {
            let each = layer.iter_mut().zip(lgrads).zip(lstate.iter_mut());
            for (i, (((p, g), st), &role)) in each.zip(marks).enumerate() {
                let c = group_config(&self.cfg, role);
                match adam_kernel_step(&c, role, t, lr) {
                    Some(hp) => {
                        adam_at.push((l, i));
                        let (m, v) = (&mut st.first, &mut st.second);
                        adam.push(AdamTensors {
                            param: p,
                            grad: g,
                            m,
                            v,
                            hp,
                        });
                    }
                    None => seen[l][i] = param_step(be, &c, (role, t, lr), p, g, st)?,
                }
            }
        }
        if !adam.is_empty() {
            for ((l, i), s) in adam_at.into_iter().zip(be.adam_updates(&mut adam)?) {
                seen[l][i] = s;
            }
        }
        Ok(StepSeen(seen))
    }
}

/// What an update's kernels saw of each parameter's gradient and new weights
/// ([`UpdateSeen`]), per layer and parameter in the order of the parameters: the finiteness
/// guard scans only what they did not ([`crate::model::Model::check_update`], which takes
/// its `.0`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepSeen(pub Vec<Vec<UpdateSeen>>);

impl StepSeen {
    /// The same, with the new weights not seen: something changed them after the kernels
    /// looked (error feedback).
    fn weights_changed(mut self) -> Self {
        for seen in self.0.iter_mut().flatten() {
            seen.param = None;
        }
        self
    }
}

/// A zeroed tensor shaped like `p` when `keep`, else an empty one (state a step keeps none
/// of).
fn zeros_if(keep: bool, p: &Tensor) -> Tensor {
    if keep {
        Tensor::zeros(p.shape())
    } else {
        Tensor::default()
    }
}

/// Whether a saved state tensor `have` fits where a fresh optimizer holds `want`.
fn fits(have: &Tensor, want: &Tensor) -> bool {
    have.shape() == want.shape() || (want.is_empty() && have.is_empty())
}

/// The error of saved optimizer state that does not fit `cfg`'s optimizer on this model.
fn state_misfit(cfg: &OptimizerConfig) -> StageError {
    StageError::Checkpoint(format!(
        "optimizer state does not fit --optimizer {}{} on this model (saved by another optimizer?)",
        format!("{:?}", cfg.kind).to_lowercase(),
        if cfg.kind == OptimizerKind::Sgd && cfg.momentum != 0.0 {
            " with momentum"
        } else {
            ""
        }
    ))
}

/// The weights a delay compensation reads ([`Corrected::compensate`]): the current ones the
/// step applies to, and the stale ones the gradients were computed at.
pub type CompensationWeights<'w> = (&'w Params, Cow<'w, Params>);

/// An optimizer with a delay correction around its step: the one place a correction is
/// applied, for any [`OptimizerKind`], by every trainer (the executor, the reference trainer,
/// delayed SGD), so that their weights agree bit for bit. It owns the correction
/// ([`OptimizerConfig::delay_correction`]), its strength, its memory per parameter
/// ([`ParamState::correction`]) and whether the coming update's gradients are already at the
/// mean; the wrapped [`Optimizer`] steps as if there were no delay.
///
/// An update passes through it in up to three calls, each where the arithmetic needs it:
///
/// 1. [`Corrected::compensate`], on a stage's own gradients before the uses of a tied
///    parameter are summed (DC-ASGD compensates each use against its own stage's stale
///    weights, and every copy then steps with the same sum). It takes the mean first.
///    Nothing for a correction that compensates no gradient.
/// 2. [`Corrected::to_mean`], where gradient clipping needs the mean gradient's norm before
///    the step.
/// 3. [`Corrected::step`]: the mean where neither call took it, the optimizer's step, and
///    error feedback around it.
#[derive(Debug, Clone)]
pub struct Corrected {
    opt: Optimizer,
    correction: DelayCorrection,
    /// Error feedback's `c`, DC-ASGD's `lambda` (`lambda_0` of the adaptive form).
    strength: f32,
    /// Per layer, per parameter: error feedback's last update `u_{t-1}`, or the adaptive
    /// DC-ASGD's mean square `MS_t`; empty tensors where the correction keeps none.
    memory: Vec<Vec<Tensor>>,
    /// Error feedback's workspace: each parameter's weights before the step (filled on the
    /// first step, where the parameters live).
    before: Vec<Vec<Tensor>>,
    /// The coming update's gradients are at the mean (and compensated, under DC-ASGD).
    at_mean: bool,
}

/// Copies `src`'s values into `dst` where both are host tensors of one shape, reusing `dst`'s
/// buffer; false otherwise (nothing copied).
pub fn copy_tensor(src: &Tensor, dst: &mut Tensor) -> bool {
    if src.shape() != dst.shape() {
        return false;
    }
    match (src.host(), dst.host_mut()) {
        (Ok(from), Ok(to)) if from.len() == to.len() => {
            to.copy_from_slice(from);
            true
        }
        _ => false,
    }
}

impl Corrected {
    /// Copies this optimizer's state into `dst`, one of the same shapes in host memory,
    /// reusing its buffers (a rollback point kept at every step, [`crate::pipeline::rollback`]);
    /// false where a tensor's shape differs or is not in host memory, `dst` then being partly
    /// written and to be replaced.
    pub fn copy_into(&self, dst: &mut Corrected) -> bool {
        if self.opt.state.len() != dst.opt.state.len() || self.memory.len() != dst.memory.len() {
            return false;
        }
        let moments = self.opt.state.iter().flatten();
        for (m, d) in moments.zip(dst.opt.state.iter_mut().flatten()) {
            if !copy_tensor(&m.first, &mut d.first) || !copy_tensor(&m.second, &mut d.second) {
                return false;
            }
        }
        for (m, d) in self
            .memory
            .iter()
            .flatten()
            .zip(dst.memory.iter_mut().flatten())
        {
            if !copy_tensor(m, d) {
                return false;
            }
        }
        dst.opt.cfg = self.opt.cfg;
        dst.opt.steps = self.opt.steps;
        dst.opt.roles.clone_from(&self.opt.roles);
        dst.correction = self.correction;
        dst.strength = self.strength;
        dst.at_mean = self.at_mean;
        dst.before.clear();
        true
    }

    /// `cfg`'s optimizer with `cfg`'s delay correction around it, their state zeroed and
    /// shaped like `params` (`roles` as [`Optimizer::new`]).
    pub fn new<R: Copy + Into<ParamRole>>(
        cfg: OptimizerConfig,
        params: &Params,
        roles: &[Vec<R>],
    ) -> Self {
        let keep = cfg.delay_correction.keeps_buffer();
        let memory = params
            .iter()
            .map(|layer| layer.iter().map(|p| zeros_if(keep, p)).collect())
            .collect();
        Self::around(Optimizer::new(cfg, params, roles), memory)
    }

    /// `opt` with its config's correction around it and `memory` as that correction's.
    fn around(opt: Optimizer, memory: Vec<Vec<Tensor>>) -> Self {
        Self {
            correction: opt.cfg.delay_correction,
            strength: opt.cfg.correction_strength,
            opt,
            memory,
            before: Vec::new(),
            at_mean: false,
        }
    }

    /// A corrected optimizer resuming from saved `state` (per layer and parameter; host
    /// tensors shaped like `params`, as [`Corrected::state`] gives it) after `steps` updates.
    ///
    /// # Errors
    /// As [`Optimizer::with_state`], also when the correction's memory does not fit.
    pub fn with_state(
        cfg: OptimizerConfig,
        params: &Params,
        roles: &[Vec<impl Copy + Into<ParamRole>>],
        state: OptimizerState,
        steps: u64,
    ) -> Result<Self> {
        let (moments, memory): (Vec<Vec<Moments>>, Vec<Vec<Tensor>>) = state
            .into_iter()
            .map(|layer| {
                layer
                    .into_iter()
                    .map(|p| {
                        let m = Moments {
                            first: p.first,
                            second: p.second,
                        };
                        (m, p.correction)
                    })
                    .unzip()
            })
            .unzip();
        let opt = Optimizer::with_state(cfg, params, roles, moments, steps)?;
        let keep = cfg.delay_correction.keeps_buffer();
        let ok = memory.iter().zip(params).all(|(have, like)| {
            have.len() == like.len()
                && have
                    .iter()
                    .zip(like)
                    .all(|(h, p)| fits(h, &zeros_if(keep, p)))
        });
        if !ok {
            return Err(state_misfit(&cfg));
        }
        Ok(Self::around(opt, memory))
    }

    /// This optimizer with its state made resident where `be` computes.
    ///
    /// # Errors
    /// Kernel errors (device allocation).
    pub fn placed(mut self, be: &dyn Backend) -> Result<Self> {
        self.opt = self.opt.placed(be)?;
        for t in self.memory.iter_mut().flatten() {
            *t = be.place(std::mem::take(t))?;
        }
        Ok(self)
    }

    /// This optimizer with its state in host memory (see [`crate::model::host_tensor`]).
    ///
    /// # Errors
    /// Device failures.
    pub fn on_host(mut self, be: &dyn Backend) -> Result<Self> {
        self.opt = self.opt.on_host(be)?;
        for t in self.memory.iter_mut().flatten() {
            *t = crate::model::host_tensor(be, std::mem::take(t))?;
        }
        self.before.clear();
        Ok(self)
    }

    /// The wrapped optimizer (its hyperparameters, its step count).
    pub fn optimizer(&self) -> &Optimizer {
        &self.opt
    }

    /// Updates applied so far.
    pub fn steps(&self) -> u64 {
        self.opt.steps()
    }

    /// The correction around the step.
    pub fn correction(&self) -> DelayCorrection {
        self.correction
    }

    /// Whether its compensation reads the weights each update's gradients were computed at
    /// ([`DelayCorrection::needs_stale_weights`]): a trainer keeps them until the update.
    pub fn needs_stale_weights(&self) -> bool {
        self.correction.needs_stale_weights()
    }

    /// Per layer and parameter, the state's tensors in [`ParamState::parts`]' order (first,
    /// second, correction), borrowed: what transfers send.
    pub fn parts(&self) -> impl Iterator<Item = Vec<[&Tensor; 3]>> {
        self.opt
            .state
            .iter()
            .zip(&self.memory)
            .map(|(layer, memory)| {
                layer
                    .iter()
                    .zip(memory)
                    .map(|(m, c)| [&m.first, &m.second, c])
                    .collect()
            })
    }

    /// The state per layer and parameter, as checkpoints and transfers carry it; empty tensors
    /// where it keeps none.
    pub fn state(&self) -> OptimizerState {
        self.parts()
            .map(|layer| {
                layer
                    .into_iter()
                    .map(|[first, second, correction]| ParamState {
                        first: first.clone(),
                        second: second.clone(),
                        correction: correction.clone(),
                    })
                    .collect()
            })
            .collect()
    }

    /// [`Corrected::state`], taking it rather than copying it.
    pub fn into_state(self) -> OptimizerState {
        self.opt
            .state
            .into_iter()
            .zip(self.memory)
            .map(|(layer, memory)| {
                layer
                    .into_iter()
                    .zip(memory)
                    .map(|(m, correction)| ParamState {
                        first: m.first,
                        second: m.second,
                        correction,
                    })
                    .collect()
            })
            .collect()
    }

    /// DC-ASGD's compensation of one stage's own gradients of the coming update, before the
    /// uses of a tied parameter are summed: the rescale to the mean over this stage's `own`
    /// microbatches ([`UpdateMean::rescale`]), then `g + lambda g (.) g (.) (current -
    /// stale)`, the adaptive form's `lambda` per element from the mean square it keeps.
    /// `weights` hands out the current and stale weights ([`CompensationWeights`]) and is
    /// called only when they are read: under DC-ASGD, once per update (a second call before
    /// the step does nothing: the executor compensates before a tie exchange or at the update,
    /// whichever comes first). Nothing for the other corrections.
    ///
    /// # Errors
    /// `weights`' errors; shape mismatches; kernel errors.
    pub fn compensate<'w>(
        &mut self,
        be: &dyn Backend,
        grads: &mut Params,
        (mean, own): (UpdateMean, u32),
        weights: impl FnOnce() -> Result<CompensationWeights<'w>>,
    ) -> Result<()> {
        let adaptive = match self.correction {
            DelayCorrection::DcAsgd => None,
            DelayCorrection::DcAsgdAdaptive => Some(DC_ASGD_MEAN_SQUARE_DECAY),
            DelayCorrection::None | DelayCorrection::ErrorFeedback => return Ok(()),
        };
        if self.at_mean {
            return Ok(());
        }
        let (current, stale) = weights()?;
        rescale(be, grads, mean, own)?;
        let hp = DelayCompensation {
            lambda: self.strength,
            adaptive,
            eps: DC_ASGD_EPS,
        };
        let each = grads
            .iter_mut()
            .flatten()
            .zip(current.iter().flatten())
            .zip(stale.iter().flatten());
        for (((g, w), ws), ms) in each.zip(self.memory.iter_mut().flatten()) {
            let mean_square = adaptive.map(|_| ms);
            be.delay_compensate(g, w, ws, mean_square, hp)?;
        }
        self.at_mean = true;
        Ok(())
    }

    /// Brings the coming update's gradients (tied uses summed) to the mean over this stage's
    /// `own` microbatches ([`UpdateMean::rescale`]) unless [`Corrected::compensate`] did
    /// already, where clipping must see the mean gradient before the step; a second call does
    /// nothing.
    ///
    /// # Errors
    /// [`StageError::Config`] under DC-ASGD when the gradients were not compensated (the
    /// trainer kept no stale weights); kernel errors.
    pub fn to_mean(
        &mut self,
        be: &dyn Backend,
        grads: &mut Params,
        (mean, own): (UpdateMean, u32),
    ) -> Result<()> {
        if self.at_mean {
            return Ok(());
        }
        if self.needs_stale_weights() {
            return Err(StageError::Config(format!(
                "--delay-correction {} compensates each update's gradients against the weights \
                 they were computed at before the step, and this update's were not",
                self.correction.name()
            )));
        }
        rescale(be, grads, mean, own)?;
        self.at_mean = true;
        Ok(())
    }

    /// The update the executor, the reference trainer and delayed SGD all apply, with the
    /// same operations so that their weights agree bit for bit: the summed gradients (tied
    /// parameters' uses already summed, [`Model::sum_tied`](crate::model::Model::sum_tied)),
    /// whose losses `mean` scaled, brought to the mean over this stage's `own` microbatches
    /// ([`Corrected::to_mean`], unless an earlier call did), then the optimizer's step on
    /// `params` with learning rate `lr`, and error feedback around it: with `u_t` the step's
    /// whole update, the weights move by `u_t + c (u_t - u_{t-1})` (the first step by `u_1`).
    ///
    /// Returns what the step's kernels saw of the gradients' and the final weights'
    /// finiteness ([`StepSeen`]).
    ///
    /// # Errors
    /// As [`Corrected::to_mean`]; shape mismatches between parameters, gradients and state.
    pub fn step(
        &mut self,
        be: &dyn Backend,
        params: &mut Params,
        grads: &mut Params,
        mean: (UpdateMean, u32),
        lr: f32,
    ) -> Result<StepSeen> {
        self.to_mean(be, grads, mean)?;
        self.at_mean = false;
        if self.correction != DelayCorrection::ErrorFeedback {
            return self.opt.step(be, params, grads, lr);
        }
        if self.before.len() != params.len() {
            self.before = params
                .iter()
                .map(|l| l.iter().map(|_| Tensor::default()).collect())
                .collect();
        }
        for (b, p) in self
            .before
            .iter_mut()
            .flatten()
            .zip(params.iter().flatten())
        {
            be.copy(p, b)?;
        }
        let seen = self.opt.step(be, params, grads, lr)?;
        let first = self.opt.steps() == 1;
        let each = params
            .iter_mut()
            .flatten()
            .zip(self.before.iter_mut().flatten());
        for ((p, before), last) in each.zip(self.memory.iter_mut().flatten()) {
            error_feedback(be, p, before, last, self.strength, first)?;
        }
        Ok(seen.weights_changed())
    }
}

/// `cfg` with the weight decay of the group of a parameter of `role`: the hyperparameters of
/// that parameter's update.
fn group_config(cfg: &OptimizerConfig, role: ParamRole) -> OptimizerConfig {
    OptimizerConfig {
        weight_decay: if cfg.decay_groups.decays(role) {
            cfg.weight_decay
        } else {
            0.0
        },
        ..*cfg
    }
}

/// The hyperparameters of Adam's kernel at step `t` with learning rate `lr`, for a parameter
/// of `role` under its group's `c` ([`group_config`]), when that kernel updates it: Adam and
/// AdamW always, Muon for what it does not orthogonalise; `None` otherwise.
fn adam_kernel_step(c: &OptimizerConfig, role: ParamRole, t: i32, lr: f32) -> Option<AdamStep> {
    let adam = match c.kind {
        OptimizerKind::Adam | OptimizerKind::Adamw => true,
        OptimizerKind::Muon => !role.hidden_matrix,
        OptimizerKind::Sgd | OptimizerKind::Lion => false,
    };
    adam.then(|| AdamStep {
        lr,
        beta1: c.beta1,
        beta2: c.beta2,
        eps: c.eps,
        weight_decay: c.weight_decay,
        decoupled: matches!(c.kind, OptimizerKind::Adamw | OptimizerKind::Muon),
        bias_correction1: 1.0 - c.beta1.powi(t),
        bias_correction2: 1.0 - c.beta2.powi(t),
    })
}

/// One parameter's update at step `t` with learning rate `lr`, under `c`, the hyperparameters
/// of its group ([`group_config`]); what its kernel saw of the gradient's and the new
/// weights' finiteness (nothing, for Muon's orthogonalised matrices).
///
/// # Errors
/// Shape mismatches between the parameter, its gradient and its state.
fn param_step(
    be: &dyn Backend,
    c: &OptimizerConfig,
    (role, t, lr): (ParamRole, i32, f32),
    p: &mut Tensor,
    g: &Tensor,
    st: &mut Moments,
) -> Result<UpdateSeen> {
    let (s1, s2) = (&mut st.first, &mut st.second);
    match (c.kind, adam_kernel_step(c, role, t, lr)) {
        (_, Some(hp)) => Ok(be.adam_update(p, g, s1, s2, hp)?),
        (OptimizerKind::Sgd, None) => {
            let hp = SgdStep {
                lr,
                momentum: c.momentum,
                nesterov: c.nesterov,
                weight_decay: c.weight_decay,
            };
            let buf = if c.momentum != 0.0 { Some(s1) } else { None };
            Ok(be.sgd_update(p, g, buf, hp)?)
        }
        (OptimizerKind::Lion, None) => {
            let hp = LionStep {
                lr,
                beta1: c.beta1,
                beta2: c.beta2,
                weight_decay: c.weight_decay,
            };
            Ok(be.lion_update(p, g, s1, hp)?)
        }
        // Muon's hidden matrices: Adam's kernel takes every other parameter of Adam, AdamW
        // and Muon.
        (_, None) => {
            muon_step(be, p, g, s1, c, lr)?;
            Ok(UpdateSeen::default())
        }
    }
}

/// Rescales an update's summed gradients to the mean over this stage's `own` microbatches
/// ([`UpdateMean::rescale`]).
fn rescale(be: &dyn Backend, grads: &mut Params, mean: UpdateMean, own: u32) -> Result<()> {
    if let Some(factor) = mean.rescale(own) {
        for g in grads.iter_mut().flatten() {
            be.scale(factor, g)?;
        }
    }
    Ok(())
}

/// Error feedback on one parameter after the optimizer's step: `before` holds the weights
/// before it and `p` after, so the update is `u_t = before - p`; the weights become
/// `p - c u_t + c u_{t-1}` (the first step keeps the plain update), and `last` becomes
/// `u_t`. `before` is left holding the old `u_{t-1}` (it is only workspace).
///
/// # Errors
/// Shape mismatches; kernel errors.
fn error_feedback(
    be: &dyn Backend,
    p: &mut Tensor,
    before: &mut Tensor,
    last: &mut Tensor,
    c: f32,
    first: bool,
) -> Result<()> {
    be.axpy(-1.0, p, before)?;
    if !first {
        be.axpy(-c, before, p)?;
        be.axpy(c, last, p)?;
    }
    std::mem::swap(before, last);
    Ok(())
}

/// One Muon step of the hidden weight matrix `p` (gradient `g`, momentum `buf`): the momentum
/// `buf = mu buf + g`; the direction `u = g + mu buf` (Nesterov) or `buf`; its orthogonalised
/// form `O` ([`newton_schulz`]); decoupled weight decay; then `p -= lr s O` with `s`
/// [`MUON_RMS_SCALE`] times the square root of the larger side.
///
/// # Errors
/// Shape mismatches; kernel errors.
fn muon_step(
    be: &dyn Backend,
    p: &mut Tensor,
    g: &Tensor,
    buf: &mut Tensor,
    c: &OptimizerConfig,
    lr: f32,
) -> Result<()> {
    be.scale(c.momentum, buf)?;
    be.axpy(1.0, g, buf)?;
    let mut u = Tensor::default();
    if c.nesterov {
        be.copy(g, &mut u)?;
        be.axpy(c.momentum, buf, &mut u)?;
    } else {
        be.copy(buf, &mut u)?;
    }
    let o = newton_schulz(be, &u, NEWTON_SCHULZ_STEPS)?;
    let side = p.rows().max(p.cols()) as f32;
    if c.weight_decay != 0.0 {
        be.scale(1.0 - lr * c.weight_decay, p)?;
    }
    be.axpy(-lr * MUON_RMS_SCALE * side.sqrt(), &o, p)?;
    Ok(())
}

/// Muon's orthogonalisation of the matrix `g` (viewed as `rows x cols`): `g` divided by its
/// Frobenius norm, then `steps` rounds of `X <- a X + (b A + c A^2) X`, `A = X X^T`
/// ([`NEWTON_SCHULZ`]), on the wide orientation (a tall matrix is transposed first and back
/// after, so `A` is the smaller Gram matrix). Each singular value `s` of the normalised
/// matrix becomes `f(f(...f(s)))`, with `f(x) = a x + b x^3 + c x^5`, and the singular
/// vectors are kept: the result approximates the orthogonal factor `U V^T` of `g = U S V^T`.
///
/// # Errors
/// Kernel errors.
pub fn newton_schulz(be: &dyn Backend, g: &Tensor, steps: usize) -> Result<Tensor> {
    let (a, b, c) = NEWTON_SCHULZ;
    let norm = be.sum_squares(g)?.sqrt() as f32;
    let tall = g.rows() > g.cols();
    let mut x = Tensor::default();
    if tall {
        be.transpose(g, &mut x)?;
    } else {
        be.copy(g, &mut x)?;
    }
    be.scale(1.0 / (norm + NEWTON_SCHULZ_EPS), &mut x)?;
    let (mut gram, mut poly, mut y) = (Tensor::default(), Tensor::default(), Tensor::default());
    for _ in 0..steps {
        be.matmul(&x, Trans::No, &x, Trans::Yes, &mut gram, false)?;
        be.matmul(&gram, Trans::No, &gram, Trans::No, &mut poly, false)?;
        be.scale(c, &mut poly)?;
        be.axpy(b, &gram, &mut poly)?;
        be.matmul(&poly, Trans::No, &x, Trans::No, &mut y, false)?;
        be.scale(a, &mut x)?;
        be.axpy(1.0, &y, &mut x)?;
    }
    if !tall {
        return Ok(x);
    }
    let mut out = Tensor::default();
    be.transpose(&x, &mut out)?;
    Ok(out)
}

/// Learning-rate schedules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LrScheduleKind {
    /// The base rate throughout.
    #[default]
    Constant,
    /// Linear warmup from 0 to the base rate, then constant.
    Warmup,
    /// Linear warmup, then cosine decay to `min_lr_ratio` times the base rate at the last step.
    Cosine,
}

from_str_by_name!(LrScheduleKind, "lr schedule", {
    "constant" => Constant,
    "warmup" => Warmup,
    "cosine" => Cosine,
});

/// A learning-rate schedule over a known number of steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// Kind.
    pub kind: LrScheduleKind,
    /// Peak (base) learning rate.
    pub base: f32,
    /// Warmup steps (Warmup and Cosine).
    pub warmup: u64,
    /// Total steps of the run (Cosine).
    pub total: u64,
    /// Final rate as a fraction of the base (Cosine).
    pub min_ratio: f32,
}

impl LrSchedule {
    /// The rate for update number `step` (0-based).
    pub fn at(&self, step: u64) -> f32 {
        let warm = |s: u64| {
            if self.warmup > 0 && s < self.warmup {
                Some(self.base * (s + 1) as f32 / self.warmup as f32)
            } else {
                None
            }
        };
        match self.kind {
            LrScheduleKind::Constant => self.base,
            LrScheduleKind::Warmup => warm(step).unwrap_or(self.base),
            LrScheduleKind::Cosine => warm(step).unwrap_or_else(|| {
                let span = self.total.saturating_sub(self.warmup).max(1) as f64;
                let done = (step.saturating_sub(self.warmup) as f64 / span).min(1.0);
                let cos = 0.5 * (1.0 + (std::f64::consts::PI * done).cos());
                let min = self.min_ratio as f64;
                (self.base as f64 * (min + (1.0 - min) * cos)) as f32
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules() {
        let s = LrSchedule {
            kind: LrScheduleKind::Cosine,
            base: 1.0,
            warmup: 10,
            total: 110,
            min_ratio: 0.0,
        };
        assert!((s.at(0) - 0.1).abs() < 1e-6);
        assert!((s.at(9) - 1.0).abs() < 1e-6);
        assert!((s.at(10) - 1.0).abs() < 1e-6);
        assert!((s.at(60) - 0.5).abs() < 1e-6);
        assert!(s.at(110).abs() < 1e-6);
        let w = LrSchedule {
            kind: LrScheduleKind::Warmup,
            ..s
        };
        assert!((w.at(4) - 0.5).abs() < 1e-6);
        assert!((w.at(1000) - 1.0).abs() < 1e-6);
        let c = LrSchedule {
            kind: LrScheduleKind::Constant,
            ..s
        };
        assert_eq!(c.at(3), 1.0);
    }
}
