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

use pipe_scheduler::Resolved;
use pipe_scheduler::VersionPlan;
use serde::{Deserialize, Serialize};

use crate::error::{Result, StageError};

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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remedies {
    /// The first `sync_warmup` updates follow the synchronous `1f1b-flush` schedule (same
    /// layout, same microbatches per update); the run's own policy takes over after them.
    pub sync_warmup: u64,
    /// Per-stage learning-rate scaling by delay.
    pub lr_scaling: LrScaling,
}

impl Remedies {
    /// True when nothing is changed.
    pub fn is_none(&self) -> bool {
        self.sync_warmup == 0 && self.lr_scaling == LrScaling::None
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
        Ok(())
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
