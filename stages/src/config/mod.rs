//! The run configuration: what a `pipe train` invocation means once its flags and config file
//! have been merged and checked. Everything downstream takes a [`RunConfig`] and never re-checks.
//!
//! Split by concern: [`settings`] holds what a user gives (every setting optional, the shape
//! of a config file and of the command line, merged field by field); [`resolve`] turns them
//! into a run, applying defaults and checking every value once; [`run`] is the checked run
//! itself and what it answers; [`buckets`] the all-reduce bucket sizes as given and the rule
//! by which a run adopts sizes settled elsewhere; [`plan_file`] the layout `pipe plan -o`
//! writes; [`launch`] the settings of a run's launch around it. This file keeps the defaults
//! every part shares.

use pipe_scheduler::planner::buckets::BucketSize;
use pipe_scheduler::{Policy, Resolved};

use crate::optim::{DecayGroups, OptimizerKind};

mod buckets;
mod launch;
mod plan_file;
mod resolve;
mod run;
mod settings;

pub use buckets::{BucketOrigin, BucketSizes};
pub use launch::{DEFAULT_KEEP_CHECKPOINTS, LaunchSettings, MAX_KEEP_CHECKPOINTS, MAX_RESTARTS};
pub use plan_file::{PlanFile, layout_of};
pub use run::{CorpusSettings, DEFAULT_EVAL_WINDOWS, PartitionChoice, Placement, RunConfig};
pub use settings::{
    DEFAULT_STALL_TIMEOUT, DatasetKind, MAX_STALL_TIMEOUT, ModelChoice, PlannedLayout,
    TrainSettings, parse_f32, to_f32,
};

/// The model preset used when none is given.
pub const DEFAULT_MODEL: &str = "mlp-784-512-512-10";

/// The model preset used when none is given and the run has more than one stage: five linear
/// layers, four of them about equally costly (784 x 1024, then 1024 x 1024 three times; the
/// last, 1024 x 10, rides with the fourth), so four stages are within 25% of each other, where
/// the three linear layers of [`DEFAULT_MODEL`] leave any four-stage cut unbalanced.
pub const DEFAULT_PIPELINE_MODEL: &str = "mlp-784-1024x4-10";

/// Without `--warmup-steps`, the learning rate warms up linearly over the first
/// `1 / DEFAULT_WARMUP_FRACTION` of the run's steps (5%): asynchronous pipelines apply
/// gradients computed on weights several updates old, and a full learning rate on the first,
/// largest gradients is where they go wrong.
pub const DEFAULT_WARMUP_FRACTION: u64 = 20;

/// The default all-reduce bucket: 4 MiB of f32 gradients (`--allreduce-bucket-mb 4`). Small
/// enough that a stage of a few large layers has several buckets to overlap with its backward
/// pass, large enough that a bucket's ring is not dominated by per-message costs (each piece
/// is at most 256 KiB anyway).
pub const DEFAULT_BUCKET_SIZE: BucketSize = BucketSize::Values(
    std::num::NonZeroUsize::new(1 << 20).expect("the default bucket holds values"),
);

/// SGD momentum when none is given: [`BASE_MOMENTUM`] for synchronous training, less for an
/// asynchronous pipeline. A gradient applied `tau` updates after the weights it was computed
/// on acts like momentum of its own (asynchrony "begets momentum": Mitliagkas, Zhang, Hadjis
/// and Re, 2016), so on top of an explicit 0.9 the effective momentum passes 0.9 and deep
/// models stall or diverge: `mlp-784-1024x16-10` at `--stages 4` reached 73% after one epoch
/// with 0.9 and 93% with 0.5 (93.7% on one worker with 0.9). The explicit momentum is
/// lowered so that `1 - momentum` grows with the staleness: `max(0, 1 - (1 - 0.9) (1 + tau))`,
/// with `tau` the most updates a gradient can be late, `ceil((d - 1) / M)` for the input
/// stage's in-flight depth `d` ([`Resolved::depths`]) under pipedream, pipedream-nostash and
/// vsync, and 1 under 2bw (0.6 for four straight stages at `M = 1`). Flush schedules keep 0.9.
pub fn default_momentum(run: &Resolved) -> f32 {
    let depth = run.depths.first().copied().unwrap_or(1);
    let tau = match run.policy {
        Policy::TwoBw if depth > 1 => 1,
        Policy::PipeDream | Policy::PipeDreamNoStash | Policy::VerticalSync => {
            (depth - 1).div_ceil(run.microbatches_per_update.max(1))
        }
        _ => 0,
    };
    (1.0 - (1.0 - BASE_MOMENTUM) * (1 + tau) as f32).max(0.0)
}

/// Muon's momentum when none is given (its authors' default).
pub const MUON_MOMENTUM: f32 = 0.95;

/// Lion's momentum decay when none is given (its authors' default; its `beta1`, 0.9, is
/// Adam's).
pub const LION_BETA2: f32 = 0.99;

/// Lion's default learning rate is AdamW's divided by this: a sign update has a larger norm
/// than Adam's, and its authors advise a rate 3 to 10 times smaller.
pub const LION_LR_DIVISOR: f32 = 3.0;

/// SGD momentum of synchronous training when none is given.
pub const BASE_MOMENTUM: f32 = 0.9;

/// What a `gpt-*` preset trains with when the run does not say: the settings under which
/// `gpt-mini` on Tiny Shakespeare reaches its target (see `docs/benchmarks.md`, the transformer section).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LanguageDefaults {
    /// Optimizer.
    pub optimizer: OptimizerKind,
    /// Base learning rate.
    pub lr: f32,
    /// Weight decay (decoupled, AdamW).
    pub weight_decay: f32,
    /// Sequences per microbatch.
    pub microbatch_size: usize,
    /// Microbatches per update (per replica of the widest stage).
    pub microbatches: usize,
    /// Pipeline policy: PipeDream-2BW, whose gradients are one update old (PipeDream's are
    /// up to the pipeline depth old, and on gpt-mini learned markedly slower; see
    /// `docs/training.md`).
    pub schedule: Policy,
    /// Passes over the training text.
    pub epochs: u64,
}

impl Default for LanguageDefaults {
    fn default() -> Self {
        Self {
            optimizer: OptimizerKind::Adamw,
            lr: 2e-3,
            weight_decay: 0.1,
            microbatch_size: 4,
            microbatches: 3,
            schedule: Policy::TwoBw,
            epochs: 14,
        }
    }
}

/// The global gradient norm the `gpt2` models clip to unless told otherwise (GPT-2's, nanoGPT's
/// and Megatron's default).
pub const GPT2_GRAD_CLIP: f32 = 1.0;

/// Which parameters weight decay applies to when not given: for AdamW on a language model,
/// only the linear maps' matrices, as nanoGPT and Megatron group a GPT; every parameter
/// otherwise (an MLP's biases are few, and SGD's L2 decay is the textbook one).
fn default_decay_groups(kind: OptimizerKind, lm: Option<LanguageDefaults>) -> DecayGroups {
    match (kind, lm) {
        (OptimizerKind::Adamw, Some(_)) => DecayGroups::Matrices,
        _ => DecayGroups::All,
    }
}

/// The policy of a pipeline whose run names none: a language model's
/// [`LanguageDefaults::schedule`], else pipedream.
fn default_pipeline_policy(lm: Option<LanguageDefaults>) -> Policy {
    lm.map_or(Policy::PipeDream, |d| d.schedule)
}
