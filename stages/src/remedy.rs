//! Remedies for stale weights that an asynchronous pipeline can use: a synchronous warm-up
//! and per-stage learning-rate scaling. Each is a change to *what* the run computes (which
//! schedule a stretch of updates follows, the learning rate of a stage's update), never to how
//! the executor computes it, so the executor and the sequential reference trainer apply it
//! through the same [`Setup`](crate::pipeline::Setup) and agree bit for bit
//! (`stages/tests/remedies.rs`).
//!
//! A stage's *delay* `tau` is read from the version plan: the most updates by which the
//! weights a microbatch's forward used are older than the update its gradient goes into
//! (`update_of(stage, mb) - forward_version(stage, mb)`). PipeDream at `S` straight stages
//! and one microbatch per update gives stage `s` a delay of `S - 1 - s`; 2BW gives 1 to
//! every stage; flush schedules give 0.

use pipe_kernels::{Backend, Tensor};
use pipe_scheduler::{Resolved, VersionPlan, VersionRule};
use serde::{Deserialize, Serialize};

use crate::error::{Result, StageError};
use crate::model::{Params, place_params};

/// How a stage's learning rate is scaled by its delay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum LrScaling {
    /// The run's learning rate everywhere.
    #[default]
    None,
    /// Stage `s` steps with `lr / (1 + tau_s)`, for the whole run (the classic
    /// staleness-aware rule of asynchronous SGD: Zhang, Gupta, Lian and Liu, 2016).
    Staleness,
    /// PipeMare's learning-rate rescheduling (Yang, Zhang, Li, Re, De Sa and Aberger, 2021):
    /// stage `s` steps with `lr * tau_s^-(1 - min(1, k / anneal))` at update `k`, so a stage
    /// starts at `lr / tau_s` and reaches the full rate after `anneal` updates.
    PipeMare {
        /// Updates over which the scaling fades out.
        anneal: u64,
    },
}

impl std::str::FromStr for LrScaling {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || format!("unknown lr scaling '{s}' (none, staleness, pipemare:UPDATES)");
        match s.trim() {
            "none" => Ok(Self::None),
            "staleness" => Ok(Self::Staleness),
            other => {
                let n = other.strip_prefix("pipemare:").ok_or_else(bad)?;
                let anneal = n.parse::<u64>().ok().filter(|&a| a > 0).ok_or_else(bad)?;
                Ok(Self::PipeMare { anneal })
            }
        }
    }
}

impl std::fmt::Display for LrScaling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::None => f.write_str("none"),
            Self::Staleness => f.write_str("staleness"),
            Self::PipeMare { anneal } => write!(f, "pipemare:{anneal}"),
        }
    }
}

impl LrScaling {
    /// The factor on the learning rate of an update of a stage with delay `tau`, `step`
    /// updates into the run.
    pub fn factor(self, tau: u32, step: u64) -> f32 {
        match self {
            Self::None => 1.0,
            Self::Staleness => 1.0 / (1.0 + tau as f32),
            Self::PipeMare { anneal } => {
                if tau <= 1 {
                    return 1.0;
                }
                let p = 1.0 - (step as f64 / anneal as f64).min(1.0);
                (f64::from(tau).powf(-p)) as f32
            }
        }
    }
}

/// The remedies a run uses (none by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Remedies {
    /// The first `sync_warmup` updates follow the synchronous `1f1b-flush` schedule (same
    /// layout, same microbatches per update); the run's own policy takes over after them.
    pub sync_warmup: u64,
    /// Per-stage learning-rate scaling by delay.
    pub lr_scaling: LrScaling,
    /// Weight prediction from a velocity estimate.
    #[serde(default)]
    pub prediction: Prediction,
}

impl Remedies {
    /// True when nothing is changed.
    pub fn is_none(&self) -> bool {
        self.sync_warmup == 0
            && self.lr_scaling == LrScaling::None
            && self.prediction == Prediction::None
    }

    /// A short name for reports: `none`, or the remedies joined by `+`.
    pub fn label(&self) -> String {
        let mut parts = Vec::new();
        if self.sync_warmup > 0 {
            parts.push(format!("sync-warmup:{}", self.sync_warmup));
        }
        if self.lr_scaling != LrScaling::None {
            parts.push(format!("lr:{}", self.lr_scaling));
        }
        if self.prediction != Prediction::None {
            parts.push(format!("predict:{}", self.prediction));
        }
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join("+")
        }
    }

    /// Checks the remedies against the run's policy: they are for asynchronous policies.
    ///
    /// # Errors
    /// [`StageError::Config`] when a remedy is asked of a synchronous schedule.
    pub fn check(&self, run: &Resolved) -> Result<()> {
        if !self.is_none() && run.policy.is_flush() {
            return Err(StageError::Config(format!(
                "remedies for stale weights ({}) apply to asynchronous policies (pipedream, \
                 pipedream-nostash, vsync, 2bw), not {}",
                self.label(),
                run.policy
            )));
        }
        let rule = run.policy.version_rule();
        // One stage runs each microbatch's backward right after its forward: no gradient is
        // stale there but under 2bw, whose updates lag one minibatch by design.
        if run.layout.stages() == 1 && rule != VersionRule::DelayedByOne {
            return Err(StageError::Config(format!(
                "remedies for stale weights ({}) do nothing on one stage under {}: every \
                 gradient meets the weights it was computed at; give --stages 2 or more",
                self.label(),
                run.policy
            )));
        }
        match self.prediction {
            Prediction::Discrepancy { .. } if rule != VersionRule::Latest => {
                Err(StageError::Config(format!(
                    "the discrepancy correction estimates the weights a stash would have kept; \
                     it applies to pipedream-nostash, not {}",
                    run.policy
                )))
            }
            Prediction::LookAhead { .. } if rule == VersionRule::Latest => Err(StageError::Config(
                "the look-ahead predicts the weights of a stashed version; it applies to \
                     pipedream, vsync and 2bw, not pipedream-nostash"
                    .into(),
            )),
            _ => Ok(()),
        }
    }
}

/// Each stage's delay in `plan`: the most updates between the weights a forward used and the
/// update its gradient goes into.
pub fn stage_delays(run: &Resolved, plan: &VersionPlan) -> Vec<u32> {
    (0..plan.stages())
        .map(|s| {
            (0..plan.microbatches())
                .map(|mb| {
                    run.update_of(s, mb)
                        .saturating_sub(plan.forward_version(s, mb))
                })
                .max()
                .unwrap_or(0)
        })
        .collect()
}

/// Weight prediction from a velocity estimate: `delta`, an exponential average of the
/// stage's last weight changes (`delta <- decay * delta + (1 - decay) * (w_new - w_old)` at
/// every update, zero at the start of each schedule, where the pipeline has drained).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Prediction {
    /// Passes use the weights their version rule picks.
    #[default]
    None,
    /// PipeMare's discrepancy correction, for a pipeline without stashing: a backward at
    /// version `c` of a microbatch whose forward used version `v` uses `w_c - (c - v) delta_c`,
    /// an estimate of the forward's weights, without keeping them.
    Discrepancy {
        /// The average's decay.
        decay: f32,
    },
    /// A look-ahead for delayed gradients (in the spirit of Nesterov momentum and SpecTrain):
    /// forward and backward of version `v` use `w_v + tau_s delta_v`, the weights predicted
    /// for when the gradient will be applied `tau_s` updates later.
    LookAhead {
        /// The average's decay.
        decay: f32,
    },
}

impl std::str::FromStr for Prediction {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || {
            format!(
                "unknown weight prediction '{s}' (none, discrepancy[:DECAY], lookahead[:DECAY])"
            )
        };
        let (kind, decay) = match s.trim().split_once(':') {
            Some((k, d)) => (k, d.parse::<f32>().map_err(|_| bad())?),
            None => (s.trim(), DEFAULT_DECAY),
        };
        if !(0.0..1.0).contains(&decay) {
            return Err(format!(
                "weight prediction decay must be in [0, 1), got {decay}"
            ));
        }
        match kind {
            "none" => Ok(Self::None),
            "discrepancy" => Ok(Self::Discrepancy { decay }),
            "lookahead" => Ok(Self::LookAhead { decay }),
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for Prediction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::None => f.write_str("none"),
            Self::Discrepancy { decay } => write!(f, "discrepancy:{decay}"),
            Self::LookAhead { decay } => write!(f, "lookahead:{decay}"),
        }
    }
}

/// The velocity average's decay when none is given.
pub const DEFAULT_DECAY: f32 = 0.9;

impl Prediction {
    /// The average's decay (`None` when there is no prediction).
    pub fn decay(self) -> Option<f32> {
        match self {
            Self::None => None,
            Self::Discrepancy { decay } | Self::LookAhead { decay } => Some(decay),
        }
    }
}

/// A stage's velocity estimate (see [`Prediction`]). The executor and the reference trainer
/// both keep it with these methods, so their predicted weights agree bit for bit.
#[derive(Debug, Clone)]
pub struct Velocity {
    decay: f32,
    delta: Params,
}

impl Velocity {
    /// Zero velocity shaped like `params`, on `be`.
    ///
    /// # Errors
    /// Kernel errors.
    pub fn new(be: &dyn Backend, params: &Params, decay: f32) -> Result<Self> {
        let zeros: Params = params
            .iter()
            .map(|layer| layer.iter().map(|t| Tensor::zeros(t.shape())).collect())
            .collect();
        Ok(Velocity {
            decay,
            delta: place_params(be, zeros)?,
        })
    }

    /// Takes one update from `old` to `new` into the average.
    ///
    /// # Errors
    /// Kernel errors.
    pub fn advance(&mut self, be: &dyn Backend, old: &Params, new: &Params) -> Result<()> {
        let rest = 1.0 - self.decay;
        for ((d, o), n) in self
            .delta
            .iter_mut()
            .flatten()
            .zip(old.iter().flatten())
            .zip(new.iter().flatten())
        {
            be.scale(self.decay, d)?;
            be.axpy(rest, n, d)?;
            be.axpy(-rest, o, d)?;
        }
        Ok(())
    }

    /// `w + coef * delta`.
    ///
    /// # Errors
    /// Kernel errors.
    pub fn extrapolate(&self, be: &dyn Backend, w: &Params, coef: f32) -> Result<Params> {
        let mut out = w.clone();
        for (o, d) in out.iter_mut().flatten().zip(self.delta.iter().flatten()) {
            be.axpy(coef, d, o)?;
        }
        Ok(out)
    }
}

/// The discrepancy correction's backward weights: `w_c - (c - v) delta_c` for a backward at
/// version `c` whose forward used version `v`; `None` when the two are the same version (the
/// backward uses `w_c` itself).
///
/// # Errors
/// Kernel errors.
pub fn corrected_weights(
    be: &dyn Backend,
    velocity: &Velocity,
    w: &Params,
    current: u32,
    forward: u32,
) -> Result<Option<Params>> {
    let behind = current.saturating_sub(forward);
    if behind == 0 {
        return Ok(None);
    }
    velocity.extrapolate(be, w, -(behind as f32)).map(Some)
}
