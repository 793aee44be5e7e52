//! The run configuration: what a `pipe train` invocation means once its flags and config file
//! have been merged and checked. Everything downstream takes a [`RunConfig`] and never re-checks.

use std::path::PathBuf;

use pipe_kernels::BackendKind;
use pipe_scheduler::{Length, Policy, Resolved, ScheduleSpec};
use pipe_transport::TransportKind;
use pipe_transport::frame::WireDType;
use serde::{Deserialize, Serialize};

use crate::data::{SyntheticConfig, Vocab};
use crate::error::{Result, StageError};
use crate::model::{Model, ModelSpec};
use crate::optim::{DecayGroups, LrSchedule, LrScheduleKind, OptimizerConfig, OptimizerKind};
use crate::partition::Partition;
use crate::remedy::{LrScaling, Prediction, Remedies};
use crate::transformer::gpt_shape;

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
pub const DEFAULT_BUCKET_VALUES: usize = 1 << 20;

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

/// How a pipelined run's layers are cut into stages.
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PartitionChoice {
    /// Profile the model briefly on this machine and balance measured time (the default).
    #[default]
    Measured,
    /// Balance forward FLOPs per sample (no measurement: the same cut on every machine).
    Flops,
    /// Explicit ranges (checked against the model).
    Given(Partition),
}

/// As `--partition` takes it: `measured`, `flops`, or the ranges.
impl std::fmt::Display for PartitionChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PartitionChoice::Measured => f.write_str("measured"),
            PartitionChoice::Flops => f.write_str("flops"),
            PartitionChoice::Given(p) => p.fmt(f),
        }
    }
}

impl PartitionChoice {
    /// Parses `--partition`: `measured`, `flops`, or inclusive ranges such as `0-2,3-5`.
    ///
    /// # Errors
    /// Ranges that do not tile a model of `layers` layers.
    pub fn parse(text: &str, layers: usize) -> Result<Self> {
        Ok(match text.trim() {
            "measured" => PartitionChoice::Measured,
            "flops" => PartitionChoice::Flops,
            ranges => PartitionChoice::Given(Partition::parse(ranges, layers)?),
        })
    }
}

/// A layout a plan settled (`pipe train --workers`), typed: it takes the place of the
/// settings' stages, replicas, schedule and partition ([`TrainSettings::resolve_planned`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedLayout {
    /// The policy the plan was made for.
    pub policy: Policy,
    /// Replicas per stage.
    pub replicas: Vec<u32>,
    /// The stages' layer ranges.
    pub partition: Partition,
}

/// A model given by preset name or by layer list. Read by its form (a string is a preset, a
/// table a layer list) rather than by trying each variant, so that a bad layer list reports
/// its own error instead of "no variant matched".
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum ModelChoice {
    /// A preset name such as `mlp-784-512-512-10`.
    Preset(String),
    /// An explicit layer list.
    Layers(ModelSpec),
}

impl<'de> Deserialize<'de> for ModelChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct ChoiceVisitor;
        impl<'de> serde::de::Visitor<'de> for ChoiceVisitor {
            type Value = ModelChoice;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(
                    "a preset name (\"mlp-784-512-512-10\") or a table with input and layers",
                )
            }
            fn visit_str<E: serde::de::Error>(
                self,
                v: &str,
            ) -> std::result::Result<ModelChoice, E> {
                Ok(ModelChoice::Preset(v.to_string()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> std::result::Result<ModelChoice, A::Error> {
                ModelSpec::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(ModelChoice::Layers)
            }
        }
        d.deserialize_any(ChoiceVisitor)
    }
}

/// A wire element type by name (`f32` when not given).
///
/// # Errors
/// [`StageError::Config`] for an unknown name.
fn wire_dtype(name: Option<&str>) -> Result<WireDType> {
    name.map_or(Ok(WireDType::F32), |w| {
        w.parse().map_err(StageError::Config)
    })
}

/// Reads an optional `f32` setting through `f64`, refusing values an `f32` cannot hold
/// (`1e300` would otherwise become infinity and be reported as such).
fn finite_f32<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<f32>, D::Error> {
    let v = Option::<f64>::deserialize(d)?;
    v.map(|v| to_f32(v).map_err(serde::de::Error::custom))
        .transpose()
}

/// `v` as an `f32`, or why it is not one: not finite, or beyond `f32`'s range.
///
/// # Errors
/// A message naming the value.
pub fn to_f32(v: f64) -> std::result::Result<f32, String> {
    if !v.is_finite() {
        return Err(format!("{v} is not a finite number"));
    }
    if v.abs() > f64::from(f32::MAX) {
        return Err(format!("{v:e} is too large (at most {:e})", f32::MAX));
    }
    Ok(v as f32)
}

/// Which dataset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetKind {
    /// MNIST digits (embedded, or from `data_dir`).
    Mnist,
    /// The seeded teacher-network dataset.
    Synthetic,
    /// Tiny Shakespeare as characters, for next-token prediction (embedded, or
    /// `data_dir/tinyshakespeare.txt`).
    #[serde(rename = "tinyshakespeare")]
    TinyShakespeare,
    /// A tokenized corpus in `data_dir` (`pipe tokenize`'s shards), streamed from disk.
    Tokens,
}

impl std::str::FromStr for DatasetKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "mnist" => Ok(Self::Mnist),
            "synthetic" => Ok(Self::Synthetic),
            "tinyshakespeare" => Ok(Self::TinyShakespeare),
            "tokens" => Ok(Self::Tokens),
            _ => Err(format!(
                "unknown dataset '{s}' (mnist, synthetic, tinyshakespeare, tokens:DIR)"
            )),
        }
    }
}

/// Raw settings, every one optional: the shape of a TOML config file and of the command line.
/// Later sources override earlier ones field by field ([`TrainSettings::merge`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSettings {
    /// Model preset or layer list.
    pub model: Option<ModelChoice>,
    /// Tie a `gpt-*` preset's LM head to its token embedding.
    pub tie_embeddings: Option<bool>,
    /// A Hugging Face GPT-2 `config.json` giving a `gpt2` model's shape.
    pub model_config: Option<PathBuf>,
    /// A `gpt2` model's shape, field by field (over `model_config` and the preset's).
    pub gpt2: Option<crate::transformer::Gpt2Shape>,
    /// Start from the weights of a Hugging Face GPT-2 directory (`model.safetensors`).
    pub init_from: Option<PathBuf>,
    /// Dataset.
    pub dataset: Option<DatasetKind>,
    /// Directory with MNIST IDX files or `tinyshakespeare.txt` instead of the embedded copy,
    /// or a tokenized corpus's directory.
    pub data_dir: Option<PathBuf>,
    /// The validation part of a tokenized corpus: `tail:FRACTION` or `shards:COUNT`.
    pub holdout: Option<String>,
    /// Most validation windows of a tokenized corpus evaluated (thinned evenly).
    pub eval_windows: Option<u64>,
    /// Synthetic dataset shape.
    pub synthetic: Option<SyntheticConfig>,
    /// Passes over the training set.
    pub epochs: Option<u64>,
    /// Stop after this many optimizer steps (overrides the epoch count when smaller).
    pub steps: Option<u64>,
    /// Evaluate on the validation windows every this many updates (besides each epoch's end),
    /// at a drain point.
    pub eval_every: Option<u64>,
    /// The order each epoch visits the training samples in (shuffled by default).
    pub data_order: Option<crate::data::DataOrder>,
    /// What the backward recomputes instead of keeping, on every stage or per stage (none by
    /// default).
    pub recompute: Option<crate::layer::StageRecompute>,
    /// The host of each worker in rank order, as a plan placed them (`pipe plan --hosts`).
    pub hosts: Option<Vec<String>>,
    /// Read a tokenized corpus's windows as packed documents ([`crate::documents`]): attention
    /// stops at each document's start, positions restart there, and a document's first token
    /// is not predicted from the document before it.
    pub pack_documents: Option<bool>,
    /// Samples per microbatch.
    pub microbatch_size: Option<usize>,
    /// Microbatches whose gradients one update sums.
    pub microbatches: Option<usize>,
    /// Optimizer.
    pub optimizer: Option<OptimizerKind>,
    /// Base learning rate.
    #[serde(default, deserialize_with = "finite_f32")]
    pub lr: Option<f32>,
    /// Learning-rate schedule.
    pub lr_schedule: Option<LrScheduleKind>,
    /// Warmup steps.
    pub warmup_steps: Option<u64>,
    /// SGD momentum.
    #[serde(default, deserialize_with = "finite_f32")]
    pub momentum: Option<f32>,
    /// SGD Nesterov momentum.
    pub nesterov: Option<bool>,
    /// Weight decay.
    #[serde(default, deserialize_with = "finite_f32")]
    pub weight_decay: Option<f32>,
    /// The parameters weight decay applies to (`all`, `matrices`).
    pub weight_decay_groups: Option<crate::optim::DecayGroups>,
    /// Adam betas.
    #[serde(default, deserialize_with = "finite_f32")]
    pub beta1: Option<f32>,
    /// Adam betas.
    #[serde(default, deserialize_with = "finite_f32")]
    pub beta2: Option<f32>,
    /// Adam epsilon.
    #[serde(default, deserialize_with = "finite_f32")]
    pub eps: Option<f32>,
    /// The delay correction around every optimizer step (none by default).
    pub delay_correction: Option<crate::optim::DelayCorrection>,
    /// Clip every update's gradient to this global norm; 0 turns clipping off. Default: 1.0
    /// for the `gpt2` models, off otherwise.
    #[serde(default, deserialize_with = "finite_f32")]
    pub grad_clip: Option<f32>,
    /// Its strength (error feedback's `c`; 1 by default).
    #[serde(default, deserialize_with = "finite_f32")]
    pub delay_correction_strength: Option<f32>,
    /// Run seed.
    pub seed: Option<u64>,
    /// Compute threads (0: one per core).
    pub threads: Option<usize>,
    /// JSON-lines log path.
    pub log_jsonl: Option<PathBuf>,
    /// Pipeline stages.
    pub stages: Option<usize>,
    /// Replicas per stage: one value for all stages, or one per stage.
    pub replicas: Option<Vec<u32>>,
    /// Pipeline schedule policy (`pipedream`, `1f1b-flush`, ...).
    pub schedule: Option<String>,
    /// Model chunks per worker (`interleaved`).
    pub chunks: Option<u32>,
    /// Explicit stage boundaries, `0-5,6-11,...` (default: balanced by FLOPs).
    pub partition: Option<String>,
    /// Compute backend (`cpu`, `cuda`).
    pub backend: Option<String>,
    /// Precision of the matrix products (`f32`, `tf32`, `bf16`; the last two need `cuda`).
    pub precision: Option<String>,
    /// How workers exchange tensors (`auto`, `inproc`, `shm`, `quic`).
    pub transport: Option<String>,
    /// Where the workers run (`threads`, `processes`).
    pub placement: Option<String>,
    /// Element type of activations and gradients between stages (`f32`, `bf16`).
    pub wire_dtype: Option<String>,
    /// Updates run synchronously (`1f1b-flush`) before an asynchronous policy takes over.
    pub sync_warmup: Option<u64>,
    /// Per-stage learning-rate scaling by delay (`none`, `staleness`, `pipemare:UPDATES`).
    pub lr_scaling: Option<String>,
    /// Weight prediction from a velocity estimate (`none`, `discrepancy[:DECAY]`,
    /// `lookahead[:DECAY]`).
    pub weight_prediction: Option<String>,
    /// Seconds a worker may wait for an activation, gradient or all-reduce chunk before the
    /// run is stopped and the hang doctor reports (default [`DEFAULT_STALL_TIMEOUT`]).
    pub stall_timeout: Option<f64>,
    /// MiB of f32 gradients per all-reduce bucket, for every stage or per stage (default:
    /// chosen per stage where the run is profiled, else 4): replicas start summing a bucket as
    /// soon as the backward pass has finished its layers.
    pub allreduce_bucket_mb: Option<BucketSizes>,
    /// Precision of the values the replicas' all-reduce sends (`f32`, `bf16`; the sums stay
    /// f32).
    pub allreduce_dtype: Option<String>,
}

/// Seconds a worker waits for data before the run counts as stalled: far past any wait of a
/// healthy run on this system (the slowest microbatch measured, gpt-small on one core, takes
/// under 10 s), short enough that a hang ends the run the same hour.
pub const DEFAULT_STALL_TIMEOUT: f64 = 300.0;

/// The longest stall timeout a run takes: a week, in seconds.
pub const MAX_STALL_TIMEOUT: f64 = 86_400.0 * 7.0;

/// A message on one line.
fn one_line(msg: &str) -> String {
    msg.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The model a run's settings choose, as [`TrainSettings::resolve`] goes on with it.
struct ChosenModel {
    name: String,
    spec: ModelSpec,
    vocab: Option<Vocab>,
    dataset: DatasetKind,
    corpus: Option<CorpusSettings>,
    language: Option<crate::transformer::GptShape>,
}

macro_rules! merge_fields {
    ($dst:ident, $src:ident; $($f:ident),*) => { $( if $src.$f.is_some() { $dst.$f = $src.$f; } )* };
}

impl TrainSettings {
    /// The remedies the settings `sync_warmup`, `lr_scaling` and `weight_prediction` ask for,
    /// checked against the run's resolved layout (`layout`: the schedule's message when it
    /// does not resolve).
    ///
    /// # Errors
    /// [`StageError::Config`] for unknown values, or remedies the schedule cannot use.
    fn remedies(
        sync_warmup: Option<u64>,
        lr_scaling: Option<&str>,
        weight_prediction: Option<&str>,
        layout: std::result::Result<&Resolved, &str>,
    ) -> Result<Remedies> {
        let remedies = Remedies {
            sync_warmup: sync_warmup.unwrap_or(0),
            lr_scaling: match lr_scaling {
                Some(text) => text.parse().map_err(StageError::Config)?,
                None => LrScaling::None,
            },
            prediction: match weight_prediction {
                Some(text) => text.parse().map_err(StageError::Config)?,
                None => Prediction::None,
            },
        };
        if !remedies.is_none() {
            remedies.check(layout.map_err(|e| StageError::Config(e.to_string()))?)?;
        }
        Ok(remedies)
    }
    /// Parses a TOML config file's text.
    ///
    /// # Errors
    /// [`StageError::Config`] with the parser's message (line and key).
    pub fn from_toml(text: &str, name: &str) -> Result<Self> {
        let parsed: std::result::Result<Self, _> =
            serde_path_to_error::deserialize(toml::Deserializer::parse(text).map_err(|e| {
                StageError::Config(format!("{name}: {}", one_line(&e.to_string())))
            })?);
        parsed.map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            let at = inner
                .span()
                .map(|s| {
                    format!(
                        " (line {})",
                        text[..s.start.min(text.len())].matches('\n').count() + 1
                    )
                })
                .unwrap_or_default();
            StageError::Config(format!("{name}: {path}{at}: {}", one_line(inner.message())))
        })
    }

    /// The backend `backend` and `precision` name (the CPU in f32 when neither is set).
    ///
    /// # Errors
    /// [`StageError::Config`] for an unknown name, or a precision the backend cannot compute in.
    fn backend_kind(&self) -> Result<BackendKind> {
        let backend = match &self.backend {
            Some(b) => b.parse().map_err(StageError::Config)?,
            None => BackendKind::Cpu,
        };
        match &self.precision {
            Some(p) => backend
                .with_precision(p.parse().map_err(StageError::Config)?)
                .map_err(StageError::Config),
            None => Ok(backend),
        }
    }

    /// Overrides every field that `other` sets.
    pub fn merge(&mut self, other: TrainSettings) {
        let dst = self;
        let src = other;
        if let Some(g) = &src.gpt2 {
            dst.gpt2 = Some(dst.gpt2.take().unwrap_or_default().merged(g));
        }
        if src.model_config.is_some() {
            dst.model_config = src.model_config;
        }
        merge_fields!(dst, src; model, tie_embeddings, init_from, dataset, data_dir, holdout, eval_windows,
            synthetic, epochs, steps, eval_every, data_order, recompute, hosts, pack_documents,
            microbatch_size, microbatches, optimizer, lr, lr_schedule, warmup_steps, momentum,
            nesterov, weight_decay, weight_decay_groups, beta1, beta2, eps, delay_correction, delay_correction_strength, grad_clip, seed, threads, log_jsonl, stages, replicas,
            schedule, chunks, partition, backend, precision, transport, placement, wire_dtype, sync_warmup, lr_scaling,
            weight_prediction, stall_timeout, allreduce_bucket_mb, allreduce_dtype);
    }

    /// Takes the layout a plan file describes (schedule, stages, replicas, partition), and its
    /// model, microbatch size and microbatch count where these settings give none.
    ///
    /// # Errors
    /// [`StageError::Config`] naming `source` when the plan names no model or another model
    /// than these settings.
    pub fn apply_plan(&mut self, plan: &PlanFile, source: &str) -> Result<()> {
        if plan.model.is_empty() {
            return Err(StageError::Config(format!(
                "plan {source} names no model (plans of imported profiles describe another \
                 system's layers)"
            )));
        }
        match &self.model {
            None => self.model = Some(ModelChoice::Preset(plan.model.clone())),
            Some(ModelChoice::Preset(m)) if *m == plan.model => {}
            Some(_) => {
                return Err(StageError::Config(format!(
                    "plan {source} was made for model {}, not this run's",
                    plan.model
                )));
            }
        }
        if plan.microbatch_size > 0 && self.microbatch_size.is_none() {
            self.microbatch_size = Some(plan.microbatch_size);
        }
        self.stages = Some(plan.replicas.len());
        self.replicas = Some(plan.replicas.clone());
        self.partition = Some(plan.partition.clone());
        self.schedule = Some(plan.schedule.clone());
        if self.microbatches.is_none() {
            self.microbatches = Some(plan.microbatches as usize);
        }
        // The plan's recomputation is what made its stages fit; a flag still overrides it.
        if self.recompute.is_none() {
            self.recompute = plan.recompute.clone();
        }
        self.hosts.clone_from(&plan.hosts);
        Ok(())
    }

    /// The optimizer's settings: those given, else the defaults (a language model's, and an
    /// SGD momentum lowered for an asynchronous layout, [`default_momentum`]), checked.
    ///
    /// # Errors
    /// [`StageError::Config`] for values out of range.
    fn optimizer_config(
        &self,
        kind: OptimizerKind,
        lm: Option<LanguageDefaults>,
        layout: Option<&Resolved>,
        clip_default: Option<f32>,
    ) -> Result<OptimizerConfig> {
        let defaults = OptimizerConfig::default();
        let momentum = match (self.momentum, kind) {
            (Some(m), _) => m,
            (None, OptimizerKind::Sgd) => {
                // An impossible layout is refused later, with the schedule's own message.
                layout.map_or(BASE_MOMENTUM, default_momentum)
            }
            (None, OptimizerKind::Muon) => MUON_MOMENTUM,
            (None, _) => 0.0,
        };
        let optimizer = OptimizerConfig {
            kind,
            momentum,
            // Muon's reference implementation takes Nesterov momentum.
            nesterov: self
                .nesterov
                .unwrap_or(kind == OptimizerKind::Muon && momentum != 0.0),
            weight_decay: self
                .weight_decay
                .unwrap_or(lm.map_or(defaults.weight_decay, |d| d.weight_decay)),
            decay_groups: self
                .weight_decay_groups
                .unwrap_or(default_decay_groups(kind, lm)),
            beta1: self.beta1.unwrap_or(defaults.beta1),
            beta2: self.beta2.unwrap_or(match kind {
                OptimizerKind::Lion => LION_BETA2,
                _ => defaults.beta2,
            }),
            eps: self.eps.unwrap_or(defaults.eps),
            delay_correction: self.delay_correction.unwrap_or_default(),
            correction_strength: self
                .delay_correction_strength
                .unwrap_or(self.delay_correction.unwrap_or_default().default_strength()),
            // 0 turns clipping off.
            grad_clip: match self.grad_clip {
                Some(c) => (c != 0.0).then_some(c),
                None => clip_default,
            },
        };
        optimizer.validate()?;
        Ok(optimizer)
    }

    /// The stage count and one replica count per stage, checked against the schedule's limits
    /// before the per-stage list is built.
    ///
    /// # Errors
    /// [`StageError::Config`] for zero or mismatched counts; [`StageError::Schedule`] past a
    /// limit.
    fn layout(&self) -> Result<(usize, Vec<u32>)> {
        let bad = |m: String| Err(StageError::Config(m));
        let stages = self.stages.unwrap_or(1);
        if stages == 0 {
            return bad("stages must be at least 1".into());
        }
        let replicas = self.replicas.clone().unwrap_or_else(|| vec![1]);
        if replicas.is_empty() || replicas.contains(&0) {
            return bad("replicas must be at least 1 per stage".into());
        }
        if replicas.len() != 1 && replicas.len() != stages {
            return bad(format!(
                "--replicas lists {} values for {stages} stages (give one value, or one per stage)",
                replicas.len()
            ));
        }
        let workers: u64 = match replicas.as_slice() {
            [r] => u64::from(*r).saturating_mul(stages as u64),
            many => many.iter().map(|&r| u64::from(r)).sum(),
        };
        let chunks = u64::from(self.chunks.unwrap_or(1));
        pipe_scheduler::limits::check_layout(stages as u64, workers, chunks)?;
        if replicas.len() == 1 {
            return Ok((stages, vec![replicas[0]; stages]));
        }
        Ok((stages, replicas))
    }

    /// The model these settings name, its dataset (a language model's text by default) and,
    /// on text, the vocabulary from the corpus.
    ///
    /// # Errors
    /// [`StageError::Config`] for a language model on another dataset or ties on a layer
    /// list; [`StageError::Model`] for an unknown preset; data errors reading the corpus.
    fn choose_model(&self) -> Result<ChosenModel> {
        let bad = |m: String| Err(StageError::Config(m));
        let default_model = if self.stages.unwrap_or(1) > 1 {
            DEFAULT_PIPELINE_MODEL
        } else {
            DEFAULT_MODEL
        };
        let choice = self
            .model
            .clone()
            .unwrap_or(ModelChoice::Preset(default_model.into()));
        let (language, vocab_override) = match &choice {
            ModelChoice::Preset(name) => self.language_shape(name)?,
            ModelChoice::Layers(_) => (None, None),
        };
        let dataset = self.dataset.unwrap_or(if language.is_some() {
            DatasetKind::TinyShakespeare
        } else {
            DatasetKind::Mnist
        });
        let tie = self.tie_embeddings.unwrap_or(match &choice {
            ModelChoice::Preset(name) => crate::transformer::is_gpt2(name),
            ModelChoice::Layers(_) => false,
        });
        let corpus = self.corpus_settings(dataset)?;
        let mut vocab = None;
        let (name, spec) = match (choice, language) {
            (ModelChoice::Preset(name), Some(shape)) => {
                let vocab_size = match (vocab_override, &corpus, dataset) {
                    (Some(v), _, _) => v,
                    (None, Some(c), _) => usize::try_from(c.vocab_size).unwrap_or(usize::MAX),
                    (None, None, DatasetKind::TinyShakespeare) => {
                        let text = crate::data::tinyshakespeare_text(self.data_dir.as_deref())?;
                        let v = crate::data::corpus_vocab(&text);
                        let n = v.len();
                        vocab = Some(v);
                        n
                    }
                    _ => {
                        return bad(format!(
                            "model {name} is a language model; it trains on text \
                             (tinyshakespeare, or a tokenized corpus: tokens:DIR), not {dataset:?}"
                        ));
                    }
                };
                (name, ModelSpec::gpt(shape, vocab_size, tie))
            }
            (ModelChoice::Preset(name), None) => {
                let spec = ModelSpec::preset(&name)?;
                (name, spec)
            }
            (ModelChoice::Layers(spec), _) => ("custom".to_string(), spec),
        };
        if vocab.is_none() && dataset == DatasetKind::TinyShakespeare {
            // A layer list on text: its checkpoints carry the vocabulary like a preset's.
            let text = crate::data::tinyshakespeare_text(self.data_dir.as_deref())?;
            vocab = Some(crate::data::corpus_vocab(&text));
        }
        if tie && language.is_none() {
            return bad(
                "--tie-embeddings applies to the gpt-* presets (a layer list states its ties \
                 in its own `tied` table)"
                    .into(),
            );
        }
        Ok(ChosenModel {
            name,
            spec,
            vocab,
            dataset,
            corpus,
            language,
        })
    }

    /// The shape of a language-model preset (`gpt-*`, `gpt2-*`, or `gpt2` shaped by
    /// `model_config` and the `[gpt2]` settings), with the vocabulary size they set; `None`
    /// for other presets.
    ///
    /// # Errors
    /// [`StageError::Config`] for GPT-2 settings on another model, an incomplete `gpt2`
    /// shape, or an unreadable or unsuitable `config.json`.
    fn language_shape(
        &self,
        name: &str,
    ) -> Result<(Option<crate::transformer::GptShape>, Option<usize>)> {
        use crate::transformer::{Gpt2Shape, gpt2_from_hf_config, is_gpt2};
        let shaped = self.gpt2.is_some() || self.model_config.is_some();
        if !is_gpt2(name) {
            if shaped {
                return Err(StageError::Config(format!(
                    "--model-config and the GPT-2 shape settings (--n-layer, ...) apply to gpt2 \
                     models, not {name}"
                )));
            }
            return Ok((gpt_shape(name), None));
        }
        let mut given = Gpt2Shape::default();
        if let Some(path) = &self.model_config {
            let bytes = crate::limits::read_file(path, 1 << 20)?;
            let text = String::from_utf8_lossy(&bytes);
            given = gpt2_from_hf_config(&text, &path.display().to_string())
                .map_err(StageError::Config)?;
        }
        if let Some(g) = &self.gpt2 {
            given = given.merged(g);
        }
        let shape = given.resolve(gpt_shape(name)).map_err(StageError::Config)?;
        Ok((Some(shape), given.vocab_size))
    }

    /// The corpus settings of a run on a tokenized corpus (`None` for other data): its
    /// manifest read for the vocabulary size and fingerprint, the holdout and evaluation
    /// budget checked.
    ///
    /// # Errors
    /// [`StageError::Config`] for a corpus without its directory, or corpus settings given to
    /// other data; the corpus's errors reading its manifest.
    fn corpus_settings(&self, dataset: DatasetKind) -> Result<Option<CorpusSettings>> {
        if dataset != DatasetKind::Tokens {
            if self.holdout.is_some()
                || self.eval_windows.is_some()
                || self.pack_documents == Some(true)
            {
                return Err(StageError::Config(
                    "--holdout, --eval-windows and --pack-documents apply to a tokenized corpus \
                     (--dataset tokens:DIR)"
                        .into(),
                ));
            }
            return Ok(None);
        }
        let dir = self.data_dir.as_deref().ok_or_else(|| {
            StageError::Config(
                "a tokenized corpus needs its directory: --dataset tokens:DIR (or data_dir)".into(),
            )
        })?;
        let manifest = crate::shards::read_manifest(dir)?;
        let holdout = match &self.holdout {
            Some(h) => h.parse().map_err(StageError::Config)?,
            None => crate::shards::Holdout::default(),
        };
        let eval_windows = self.eval_windows.unwrap_or(DEFAULT_EVAL_WINDOWS);
        if eval_windows == 0 {
            return Err(StageError::Config(
                "--eval-windows must be at least 1".into(),
            ));
        }
        let pack_documents = match (self.pack_documents, manifest.tokenizer.document_end) {
            (Some(true), Some(end)) => Some(end),
            (Some(true), None) => {
                return Err(StageError::Config(format!(
                    "--pack-documents needs documents that end with an end-of-text id, and the \
                     tokenizer of {} has none",
                    dir.display()
                )));
            }
            _ => None,
        };
        Ok(Some(CorpusSettings {
            fingerprint: manifest.fingerprint(),
            vocab_size: manifest.tokenizer.vocab_size,
            holdout,
            eval_windows,
            pack_documents,
        }))
    }

    /// The policy the run executes: `--schedule`, else for a run with no pipeline setting
    /// `sequential` on one stage (one worker running the whole model, through the same
    /// executor and segment loop as every other run), else a language model's default or
    /// pipedream.
    fn policy(&self, pipelined: bool, lm: Option<LanguageDefaults>) -> Result<Policy> {
        Ok(match &self.schedule {
            Some(name) => name
                .parse()
                .map_err(|e: pipe_scheduler::ScheduleError| StageError::Config(e.to_string()))?,
            None if !pipelined => Policy::Sequential,
            None => default_pipeline_policy(lm),
        })
    }

    /// The passes over the training set (the dataset's or a language model's default), with
    /// `steps` checked beside them.
    ///
    /// # Errors
    /// [`StageError::Config`] for zero; [`StageError::Limit`] past a run that would end.
    fn epochs(&self, dataset: DatasetKind, lm: Option<LanguageDefaults>) -> Result<u64> {
        use crate::limits::{MAX_EPOCHS, MAX_STEPS, check_count};
        let epochs = self.epochs.unwrap_or(match (dataset, lm) {
            (DatasetKind::Tokens, _) => 1,
            (_, Some(d)) => d.epochs,
            (DatasetKind::Mnist, None) => 6,
            _ => 10,
        });
        if epochs == 0 {
            return Err(StageError::Config("epochs must be at least 1".into()));
        }
        if self.steps == Some(0) {
            return Err(StageError::Config("steps must be at least 1".into()));
        }
        let never = "a run that would not end this year";
        check_count("--epochs", epochs, MAX_EPOCHS, never)?;
        if let Some(steps) = self.steps {
            check_count("--steps", steps, MAX_STEPS, never)?;
        }
        if self.eval_every == Some(0) {
            return Err(StageError::Config("--eval-every must be at least 1".into()));
        }
        if let Some(every) = self.eval_every {
            check_count("--eval-every", every, MAX_STEPS, never)?;
        }
        Ok(epochs)
    }

    /// Applies defaults and checks every value.
    ///
    /// # Errors
    /// [`StageError::Config`] or [`StageError::Model`] naming the first bad value.
    pub fn resolve(self) -> Result<RunConfig> {
        self.resolve_planned(None)
    }

    /// [`TrainSettings::resolve`] with the layout a plan settled (`--workers`) in place of the
    /// settings' stages, replicas, schedule and partition. The model is chosen before the
    /// layout is (a plan made for the default model keeps it, whatever stage count it picked);
    /// the layout's own defaults (an asynchronous layout's SGD momentum) follow the plan.
    ///
    /// # Errors
    /// As [`TrainSettings::resolve`].
    pub fn resolve_planned(self, planned: Option<PlannedLayout>) -> Result<RunConfig> {
        let bad = |m: String| Err(StageError::Config(m));
        let ChosenModel {
            name: model_name,
            spec: model_spec,
            vocab,
            dataset,
            corpus,
            language,
        } = self.choose_model()?;
        let model = Model::new(&model_spec)?;
        if let Some(size) = self.microbatch_size {
            model.check_microbatch(size)?;
        }
        let lm = language.map(|_| LanguageDefaults::default());
        let epochs = self.epochs(dataset, lm)?;
        let microbatch_size = self
            .microbatch_size
            .unwrap_or(lm.map_or(64, |d| d.microbatch_size));
        if microbatch_size == 0 {
            return bad("microbatch size must be at least 1".into());
        }
        crate::limits::check_count(
            "--microbatch-size",
            microbatch_size as u64,
            crate::limits::MAX_TENSOR_ELEMENTS,
            "a microbatch is one tensor",
        )?;
        let microbatches = self
            .microbatches
            .unwrap_or(lm.map_or(1, |d| d.microbatches));
        if microbatches == 0 {
            return bad("microbatches per update must be at least 1".into());
        }
        pipe_scheduler::limits::check_microbatches(microbatches as u64)?;
        let kind = self
            .optimizer
            .unwrap_or(lm.map_or(OptimizerKind::Sgd, |d| d.optimizer));
        let lr = self.lr.unwrap_or(match (kind, lm) {
            (OptimizerKind::Sgd, _) => 0.05,
            (OptimizerKind::Lion, Some(d)) => d.lr / LION_LR_DIVISOR,
            (OptimizerKind::Lion, None) => 1e-3 / LION_LR_DIVISOR,
            (_, Some(d)) => d.lr,
            _ => 1e-3,
        });
        if !(lr > 0.0 && lr.is_finite()) {
            return bad(format!("learning rate must be positive, got {lr}"));
        }
        let (stages, replicas) = match &planned {
            Some(p) => (p.replicas.len(), p.replicas.clone()),
            None => self.layout()?,
        };
        let chunks = self.chunks.unwrap_or(1);
        let pipelined = planned.is_some()
            || stages > 1
            || replicas.iter().any(|&r| r > 1)
            || chunks > 1
            || self.schedule.is_some()
            || self.partition.is_some()
            || self.sync_warmup.is_some()
            || self.lr_scaling.is_some()
            || self.weight_prediction.is_some();
        let schedule = match &planned {
            Some(p) => p.policy,
            None => self.policy(pipelined, lm)?,
        };
        let layout_spec = ScheduleSpec::new(schedule, stages as u32, microbatches as u32)
            .with_replicas(replicas.clone())
            .with_chunks(chunks);
        let layout = layout_spec.resolve().map_err(|e| e.to_string());
        // GPT-2 trainers clip the global gradient norm to 1.0.
        let clip_default = crate::transformer::is_gpt2(&model_name).then_some(GPT2_GRAD_CLIP);
        let optimizer = self.optimizer_config(kind, lm, layout.as_ref().ok(), clip_default)?;
        let partition = match (planned, &self.partition) {
            (Some(p), _) => {
                PartitionChoice::Given(Partition::new(p.partition.ranges().to_vec(), model.len())?)
            }
            (None, Some(text)) => PartitionChoice::parse(text, model.len())?,
            (None, None) => PartitionChoice::Measured,
        };
        let recompute = self.recompute.clone().unwrap_or_default();
        if let Ok(layout) = &layout {
            recompute
                .check_stages(layout.layout.stages())
                .map_err(StageError::Config)?;
        }
        let backend = self.backend_kind()?;
        check_backend_takes(backend, corpus.as_ref())?;
        let (placement, transport) =
            Placement::resolve(self.placement.as_deref(), self.transport.as_deref())?;
        let wire = wire_dtype(self.wire_dtype.as_deref())?;
        let remedies = Self::remedies(
            self.sync_warmup,
            self.lr_scaling.as_deref(),
            self.weight_prediction.as_deref(),
            layout.as_ref().map_err(String::as_str),
        )?;
        check_delay_correction(&optimizer, schedule, Some(remedies.prediction))?;
        let synthetic = self.synthetic.unwrap_or_default();
        synthetic.check()?;
        let stall = self.stall_timeout.unwrap_or(DEFAULT_STALL_TIMEOUT);
        if !(stall.is_finite() && stall > 0.0 && stall <= MAX_STALL_TIMEOUT) {
            return bad(format!(
                "stall timeout must be between 0 and {MAX_STALL_TIMEOUT} seconds (a week), got {stall}"
            ));
        }
        let (bucket_values, stage_bucket_values, bucket_origin) = bucket_settings(
            self.allreduce_bucket_mb.as_ref(),
            layout.as_ref().ok().map(|l| l.layout.stages() as usize),
        )?;
        let allreduce_wire = wire_dtype(self.allreduce_dtype.as_deref())?;
        Ok(RunConfig {
            model_name,
            model: model_spec,
            vocab,
            dataset,
            data_dir: self.data_dir,
            init_from: self.init_from,
            corpus,
            synthetic,
            epochs,
            steps: self.steps,
            eval_every: self.eval_every,
            data_order: self.data_order.unwrap_or_default(),
            recompute,
            hosts: self.hosts.unwrap_or_default(),
            microbatch_size,
            microbatches,
            optimizer,
            lr,
            lr_schedule: self.lr_schedule.unwrap_or(LrScheduleKind::Cosine),
            warmup_steps: self.warmup_steps,
            seed: self.seed.unwrap_or(0),
            threads: self.threads.unwrap_or(0),
            log_jsonl: self.log_jsonl,
            stages,
            replicas,
            schedule,
            chunks,
            partition,
            pipelined,
            backend,
            placement,
            transport,
            wire,
            remedies,
            stall_timeout: std::time::Duration::from_secs_f64(stall),
            bucket_values,
            stage_bucket_values,
            bucket_origin,
            allreduce_wire,
        })
    }
}

/// The run's bucket sizes from `--allreduce-bucket-mb`: one size for every stage, one per
/// stage (checked against the run's `stages` where its layout resolved), or the default.
///
/// # Errors
/// [`StageError::Config`] for a list of another length than the stages.
fn bucket_settings(
    given: Option<&BucketSizes>,
    stages: Option<usize>,
) -> Result<(usize, Vec<usize>, BucketOrigin)> {
    let Some(sizes) = given else {
        return Ok((DEFAULT_BUCKET_VALUES, Vec::new(), BucketOrigin::Default));
    };
    let values = sizes.values();
    if values.len() == 1 {
        return Ok((values[0], Vec::new(), BucketOrigin::Given));
    }
    if let Some(stages) = stages.filter(|&s| s != values.len()) {
        return Err(StageError::Config(format!(
            "--allreduce-bucket-mb gives {} sizes for {stages} stages (give one, or one per stage)",
            values.len()
        )));
    }
    Ok((DEFAULT_BUCKET_VALUES, values, BucketOrigin::Given))
}

/// Refuses what a backend cannot run yet: packed documents on CUDA, whose attention kernels
/// take no document mask.
fn check_backend_takes(backend: BackendKind, corpus: Option<&CorpusSettings>) -> Result<()> {
    if matches!(backend, BackendKind::Cuda(_)) && corpus.is_some_and(|c| c.pack_documents.is_some())
    {
        return Err(StageError::Config(
            "--pack-documents is not built on the cuda backend yet (its attention kernels take \
             no document mask); use --backend cpu"
                .into(),
        ));
    }
    Ok(())
}

/// Where a run's workers run: the choice of launcher, apart from what carries their links
/// ([`TransportKind`], chosen per link from where its ends are).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Placement {
    /// Threads of this process.
    #[default]
    Threads,
    /// One worker process each, on this host (`pipe worker`, started by `pipe train`).
    Processes,
}

impl Placement {
    /// The name a run's settings use.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Threads => "threads",
            Placement::Processes => "processes",
        }
    }

    /// The placement and transport that `--placement` and `--transport` ask for. Without a
    /// placement, `--transport shm` or `quic` means worker processes (what `--transport quic`
    /// has always meant) and anything else threads; `auto` then picks channels between
    /// threads and shared memory between processes of one host.
    ///
    /// # Errors
    /// [`StageError::Config`] for unknown names, and for worker processes asked to talk over
    /// channels, which only threads of one process share.
    pub fn resolve(
        placement: Option<&str>,
        transport: Option<&str>,
    ) -> Result<(Placement, TransportKind)> {
        let transport: TransportKind = match transport {
            Some(t) => t.parse().map_err(StageError::Config)?,
            None => TransportKind::Auto,
        };
        let placement = match placement {
            Some(p) => p.parse().map_err(StageError::Config)?,
            None if transport != TransportKind::Auto && transport.crosses_processes() => {
                Placement::Processes
            }
            None => Placement::Threads,
        };
        if placement == Placement::Processes && !transport.crosses_processes() {
            return Err(StageError::Config(
                "--transport inproc carries tensors between threads of one process, not between worker processes: give --transport auto, shm or quic".into(),
            ));
        }
        Ok((placement, transport))
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "threads" => Ok(Placement::Threads),
            "processes" => Ok(Placement::Processes),
            other => Err(format!("unknown placement '{other}' (threads, processes)")),
        }
    }
}

/// Validation windows of a tokenized corpus evaluated unless `--eval-windows` says otherwise:
/// enough for a loss to three decimals, few enough that evaluating is not a second run.
pub const DEFAULT_EVAL_WINDOWS: u64 = 2048;

/// How a run reads a tokenized corpus.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CorpusSettings {
    /// The manifest's fingerprint ([`crate::shards::Manifest::fingerprint`]): a checkpoint
    /// resumes only on the corpus it was written from.
    pub fingerprint: String,
    /// Its tokenizer's vocabulary size.
    pub vocab_size: u64,
    /// Which part validates.
    pub holdout: crate::shards::Holdout,
    /// Most validation windows evaluated.
    pub eval_windows: u64,
    /// The end-of-text id the windows' documents end with, when they are read as packed
    /// documents (`--pack-documents`); `None` reads each window as one sequence.
    #[serde(default)]
    pub pack_documents: Option<u32>,
}

/// A validated run configuration: every choice typed (policy, partition, per-stage replica
/// counts, backend, transport), built once by [`TrainSettings::resolve`]. It serializes (JSON,
/// [`RunConfig::to_json`]) so that a launcher hands its worker processes the run it resolved
/// and the chief hands its peers the run they must agree with; what is read back is checked
/// again ([`RunConfig::from_json`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Preset name, or `custom`.
    pub model_name: String,
    /// The model.
    pub model: ModelSpec,
    /// The character vocabulary of a language model (from its corpus's training text).
    pub vocab: Option<Vocab>,
    /// Dataset.
    pub dataset: DatasetKind,
    /// MNIST directory (embedded copy when absent), or the tokenized corpus's.
    pub data_dir: Option<PathBuf>,
    /// A Hugging Face GPT-2 directory whose weights the run starts from (fresh runs only).
    pub init_from: Option<PathBuf>,
    /// A tokenized corpus's fingerprint, holdout and evaluation budget.
    pub corpus: Option<CorpusSettings>,
    /// Synthetic dataset shape.
    pub synthetic: SyntheticConfig,
    /// Passes over the training set.
    pub epochs: u64,
    /// Optional cap on optimizer steps.
    pub steps: Option<u64>,
    /// Evaluate every this many updates too, at a drain point (besides each epoch's end).
    pub eval_every: Option<u64>,
    /// The order each epoch visits the training samples in.
    #[serde(default)]
    pub data_order: crate::data::DataOrder,
    /// What the backward recomputes instead of keeping from the forward, per stage.
    #[serde(default)]
    pub recompute: crate::layer::StageRecompute,
    /// The host each worker was placed on, in rank order, where a plan placed them
    /// (`pipe plan --hosts` or `--cluster`); empty otherwise. Each worker compares it with
    /// the peers it finds on its own host.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    /// Samples per microbatch.
    pub microbatch_size: usize,
    /// Microbatches per update.
    pub microbatches: usize,
    /// Optimizer.
    pub optimizer: OptimizerConfig,
    /// Base learning rate.
    pub lr: f32,
    /// Learning-rate schedule.
    pub lr_schedule: LrScheduleKind,
    /// Warmup steps (`None`: 5% of the run, [`DEFAULT_WARMUP_FRACTION`]).
    pub warmup_steps: Option<u64>,
    /// Run seed.
    pub seed: u64,
    /// Compute threads (0: one per core).
    pub threads: usize,
    /// JSON-lines log path.
    pub log_jsonl: Option<PathBuf>,
    /// Pipeline stages.
    pub stages: usize,
    /// Replicas of each stage (one value per stage).
    pub replicas: Vec<u32>,
    /// Schedule policy.
    pub schedule: Policy,
    /// Model chunks per worker.
    pub chunks: u32,
    /// How the layers are cut into stages.
    pub partition: PartitionChoice,
    /// True when the run goes through the pipelined executor (any pipeline setting given).
    pub pipelined: bool,
    /// Compute backend.
    #[serde(with = "backend_by_name")]
    pub backend: BackendKind,
    /// Where the workers run: threads of this process, or one process each on this host.
    /// (A run.json written before placements existed reads as threads; its launcher set the
    /// transport.)
    #[serde(with = "by_name", default)]
    pub placement: Placement,
    /// What carries each link between workers (`auto`: chosen per link from where its ends
    /// run).
    #[serde(with = "by_name")]
    pub transport: TransportKind,
    /// Element type of activations and gradients between stages.
    #[serde(with = "by_name")]
    pub wire: WireDType,
    /// Remedies for stale weights (asynchronous policies only).
    pub remedies: Remedies,
    /// How long a worker waits for data before the run is stopped as stalled.
    pub stall_timeout: std::time::Duration,
    /// Gradient values per all-reduce bucket (every stage's, unless `stage_bucket_values`
    /// gives each its own).
    pub bucket_values: usize,
    /// Gradient values per all-reduce bucket of each stage, where given per stage or chosen
    /// ([`crate::planning::buckets`]); empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stage_bucket_values: Vec<usize>,
    /// Where the bucket sizes came from.
    #[serde(default)]
    pub bucket_origin: BucketOrigin,
    /// The precision the all-reduce sends in.
    #[serde(with = "by_name")]
    pub allreduce_wire: WireDType,
}

/// A type written by its name (`Display`) and read back through `FromStr`, for the run's
/// choices whose crates carry no serde of their own.
mod by_name {
    use serde::Deserialize;

    pub fn serialize<T: std::fmt::Display, S: serde::Serializer>(
        v: &T,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_str(v)
    }

    pub fn deserialize<'de, T, D>(d: D) -> Result<T, D::Error>
    where
        T: std::str::FromStr,
        T::Err: std::fmt::Display,
        D: serde::Deserializer<'de>,
    {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// A backend written as its name and the precision of its products (`["cuda", "bf16"]`), read
/// back through [`BackendKind::with_precision`].
mod backend_by_name {
    use pipe_kernels::{BackendKind, Precision};
    use serde::Deserialize;

    pub fn serialize<S: serde::Serializer>(b: &BackendKind, s: S) -> Result<S::Ok, S::Error> {
        serde::Serialize::serialize(&(b.name(), b.precision().name()), s)
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<BackendKind, D::Error> {
        let (name, precision) = <(String, String)>::deserialize(d)?;
        let backend: BackendKind = name.parse().map_err(serde::de::Error::custom)?;
        let precision: Precision = precision.parse().map_err(serde::de::Error::custom)?;
        backend
            .with_precision(precision)
            .map_err(serde::de::Error::custom)
    }
}

impl RunConfig {
    /// The run as JSON: what a launcher writes for its worker processes.
    ///
    /// # Errors
    /// [`StageError::Config`] for a value JSON cannot hold (never, for a resolved run).
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string(self)
            .map_err(|e| StageError::Config(format!("writing the resolved run: {e}")))
    }

    /// Reads a run [`RunConfig::to_json`] wrote and checks it ([`RunConfig::check`]);
    /// `source` names it in errors.
    ///
    /// # Errors
    /// [`StageError::Config`] naming `source` and the field, for malformed text or a run that
    /// does not hold together.
    pub fn from_json(text: &str, source: &str) -> Result<Self> {
        let mut de = serde_json::Deserializer::from_str(text);
        let cfg: RunConfig = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let at = match e.path().to_string() {
                top if top == "." => String::new(),
                path => format!("{path}: "),
            };
            StageError::Config(format!("{source}: {at}{}", e.inner()))
        })?;
        cfg.check()
            .map_err(|e| StageError::Config(format!("{source}: {e}")))?;
        Ok(cfg)
    }

    /// Checks what [`TrainSettings::resolve`] guarantees, for a run that was read rather than
    /// resolved: the model builds and takes the microbatch, the counts are positive and within
    /// [`crate::limits`], the layout resolves under its policy, the remedies suit it, the
    /// partition tiles the model, and the optimizer's values are in range.
    ///
    /// # Errors
    /// [`StageError::Config`], [`StageError::Model`] or [`StageError::Schedule`] naming the
    /// first problem.
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(StageError::Config(m));
        let model = Model::new(&self.model)?;
        if self.microbatch_size == 0 || self.microbatches == 0 || self.epochs == 0 {
            return bad("epochs, microbatch size and microbatches must be at least 1".into());
        }
        model.check_microbatch(self.microbatch_size)?;
        if self.steps == Some(0)
            || self.bucket_values == 0
            || self.stage_bucket_values.contains(&0)
            || self.chunks == 0
        {
            return bad("steps, all-reduce bucket and chunks must be at least 1".into());
        }
        if self.replicas.len() != self.stages {
            return bad(format!(
                "{} replica counts for {} stages",
                self.replicas.len(),
                self.stages
            ));
        }
        let workers: u64 = self.replicas.iter().map(|&r| u64::from(r)).sum();
        pipe_scheduler::limits::check_layout(self.stages as u64, workers, u64::from(self.chunks))?;
        pipe_scheduler::limits::check_microbatches(self.microbatches as u64)?;
        if !self.hosts.is_empty() && self.hosts.len() as u64 != workers {
            return bad(format!(
                "the plan places {} workers on hosts, the run has {workers}",
                self.hosts.len()
            ));
        }
        let run = self.resolved()?;
        if !self.stage_bucket_values.is_empty()
            && self.stage_bucket_values.len() != run.layout.stages() as usize
        {
            return bad(format!(
                "{} all-reduce bucket sizes for {} stages",
                self.stage_bucket_values.len(),
                run.layout.stages()
            ));
        }
        self.recompute
            .check_stages(run.layout.stages())
            .map_err(StageError::Config)?;
        if !self.remedies.is_none() {
            self.remedies.check(&run)?;
        }
        check_delay_correction(&self.optimizer, run.policy, Some(self.remedies.prediction))?;
        if let PartitionChoice::Given(p) = &self.partition {
            Partition::new(p.ranges().to_vec(), model.len())?;
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad(format!("learning rate must be positive, got {}", self.lr));
        }
        let stall = self.stall_timeout.as_secs_f64();
        if !(stall > 0.0 && stall <= MAX_STALL_TIMEOUT) {
            return bad(format!(
                "stall timeout must be between 0 and {MAX_STALL_TIMEOUT} seconds, got {stall}"
            ));
        }
        self.optimizer.validate()?;
        self.synthetic.check()
    }

    /// Where the workers run and what carries their links, as the pipeline line says it.
    pub fn placement_description(&self) -> String {
        let (each, links) = match self.placement {
            Placement::Threads => ("one thread each", self.transport),
            // The launcher's workers are on its host.
            Placement::Processes => ("one process each", self.transport.for_processes(true)),
        };
        match links.link_description() {
            Some(links) => format!("{each}, {links}"),
            None => each.to_string(),
        }
    }

    /// The part of the run that decides its numerics, which every worker of a run must share:
    /// what may differ between hosts (data paths, compute threads, logs) and the partition
    /// (which the chief settles for all) are set to fixed values.
    pub fn numerics(&self) -> RunConfig {
        RunConfig {
            data_dir: None,
            init_from: None,
            threads: 0,
            log_jsonl: None,
            partition: PartitionChoice::Flops,
            // Where workers run and what carries their links never changes a number.
            placement: Placement::Threads,
            transport: TransportKind::Auto,
            hosts: Vec::new(),
            ..self.clone()
        }
    }

    /// Where `self`'s numerics differ from `other`'s: the first differing field, with both
    /// values. `None` when they agree.
    pub fn numerics_difference(&self, other: &RunConfig) -> Option<String> {
        let (mine, theirs) = (self.numerics(), other.numerics());
        if mine == theirs {
            return None;
        }
        let as_map = |c: &RunConfig| match serde_json::to_value(c) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => serde_json::Map::new(),
        };
        let (a, b) = (as_map(&mine), as_map(&theirs));
        Some(a.iter().find(|(k, v)| b.get(*k) != Some(*v)).map_or(
            "the run differs".to_string(),
            |(k, v)| {
                let there = b.get(k).map_or("nothing".to_string(), ToString::to_string);
                format!("{k}: {v} here, {there} there")
            },
        ))
    }

    /// Checks the run against this host ([`crate::limits`]): its compute threads, its
    /// microbatch's activations, and the planner's memory estimate of its workers that live
    /// here (`local_workers`: `None` for all of them, as `pipe train` runs them; `Some(1)` for
    /// `pipe worker`).
    ///
    /// # Errors
    /// [`StageError::Limit`] for the first bound exceeded; [`StageError::Schedule`] or
    /// [`StageError::Model`] when the run's layout or model cannot be built.
    pub fn check_resources(
        &self,
        local_workers: Option<u64>,
        machine: &crate::limits::Machine,
    ) -> Result<()> {
        crate::limits::check_threads(self.threads as u64, machine)?;
        let model = Model::new(&self.model)?;
        model.check_microbatch(self.microbatch_size)?;
        if self.optimizer.kind == crate::optim::OptimizerKind::Muon
            && !model.hidden_matrices().iter().flatten().any(|&h| h)
        {
            // Muon would step every parameter as AdamW does while the header said Muon.
            return Err(StageError::Config(
                "--optimizer muon orthogonalises the updates of hidden weight matrices, and \
                 this model has none (its only matrices are its first and last layers, \
                 embeddings or heads): it would train as AdamW; use --optimizer adamw, or a \
                 model with hidden layers"
                    .into(),
            ));
        }
        let run = if self.pipelined {
            self.resolved()?
        } else {
            ScheduleSpec::new(Policy::Sequential, 1, 1).resolve()?
        };
        let workers = local_workers.unwrap_or(u64::from(run.layout.workers()));
        let per_worker = model.worker_memory_bytes(
            &run,
            self.microbatch_size,
            self.optimizer.kind.state_copies(),
        );
        let holding = format!(
            "{} parameters' weights{}, optimizer state and stashed activations",
            model.param_count(),
            if matches!(run.policy, Policy::PipeDream | Policy::VerticalSync) {
                " in every version stashed"
            } else {
                ""
            }
        );
        crate::limits::check_memory(per_worker * workers as f64, workers, &holding, machine)
    }

    /// The policy a pipeline of this run uses: its own when it is pipelined; otherwise (one
    /// worker, `sequential`) the one a pipeline flag would give it, a language model's
    /// [`LanguageDefaults::schedule`] or pipedream. What `--workers` plans for.
    pub fn pipeline_policy(&self) -> Policy {
        if self.pipelined {
            self.schedule
        } else {
            default_pipeline_policy(self.vocab.as_ref().map(|_| LanguageDefaults::default()))
        }
    }

    /// The transport that carries this run's stage-to-stage links on one host: the one asked
    /// for, else what `auto` picks (channels between threads, shared memory between worker
    /// processes). The planner charges its measured costs.
    pub fn link_transport(&self) -> TransportKind {
        match (self.transport, self.placement) {
            (TransportKind::Auto, Placement::Threads) => TransportKind::InProcess,
            (TransportKind::Auto, Placement::Processes) => TransportKind::Shm,
            (kind, _) => kind,
        }
    }

    /// The schedule request this run implies, running for `length`.
    pub fn schedule_spec(&self, length: Length) -> ScheduleSpec {
        self.schedule_spec_of(self.schedule, length)
    }

    /// The run's schedule resolved (its layout, minibatch and policy), the one place a run's
    /// settings become a [`pipe_scheduler::Resolved`] outside a plan.
    ///
    /// # Errors
    /// [`StageError::Schedule`] for a layout the policy refuses.
    pub fn resolved(&self) -> Result<pipe_scheduler::Resolved> {
        Ok(self.schedule_spec(Length::Updates(1)).resolve()?)
    }

    /// [`RunConfig::schedule_spec`] with another policy on the same layout (a synchronous
    /// warm-up's).
    pub fn schedule_spec_of(&self, policy: Policy, length: Length) -> ScheduleSpec {
        ScheduleSpec::new(policy, self.stages as u32, self.microbatches as u32)
            .with_replicas(self.replicas.clone())
            .with_chunks(self.chunks)
            .with_length(length)
    }

    /// The learning-rate schedule of a run of `total` updates (the one place it is built).
    pub fn lr_schedule(&self, total: u64) -> LrSchedule {
        LrSchedule {
            kind: self.lr_schedule,
            base: self.lr,
            warmup: self.warmup_steps.unwrap_or(total / DEFAULT_WARMUP_FRACTION),
            total,
            min_ratio: 0.0,
        }
    }
}

/// A delay correction needs a delay: refused (exit 2) on a sequential run and on flush
/// schedules, where every gradient meets the weights it was computed at.
///
/// # Errors
/// [`StageError::Config`] naming the correction and the policy.
fn check_delay_correction(
    optimizer: &OptimizerConfig,
    policy: Policy,
    prediction: Option<crate::remedy::Prediction>,
) -> Result<()> {
    let correction = optimizer.delay_correction;
    let name = correction.name();
    if correction == crate::optim::DelayCorrection::None {
        return Ok(());
    }
    if policy == Policy::Sequential || policy.is_flush() {
        return Err(StageError::Config(format!(
            "--delay-correction {name} corrects the delay of an asynchronous pipeline, and \
             {policy} has none (every gradient meets the weights it was computed at): use it \
             with pipedream, pipedream-nostash, vertical-sync or 2bw"
        )));
    }
    if !correction.needs_stale_weights() {
        return Ok(());
    }
    if policy == Policy::PipeDreamNoStash {
        return Err(StageError::Config(format!(
            "--delay-correction {name} needs the weights each gradient was computed at, and \
             pipedream-nostash stashes none: use pipedream, vertical-sync or 2bw, or \
             error-feedback"
        )));
    }
    if prediction.is_some_and(|p| p != crate::remedy::Prediction::None) {
        return Err(StageError::Config(format!(
            "--delay-correction {name} and --weight-prediction both correct the same delay \
             (the prediction changes the weights a gradient is computed at): pick one"
        )));
    }
    Ok(())
}

/// `--allreduce-bucket-mb`: MiB of f32 gradients per all-reduce bucket, one size for every
/// stage (`4`) or one per stage (`4,1,one`); `one` puts a stage's gradients in one bucket,
/// summed once its backward pass is done. A config file gives a number or that text.
#[derive(Clone, Debug, PartialEq)]
pub struct BucketSizes(Vec<Option<f64>>);

/// Largest bucket in MiB (64 GiB).
const MAX_BUCKET_MB: f64 = 65_536.0;

impl BucketSizes {
    /// Gradient values per bucket of each size given (`usize::MAX` for `one`).
    pub fn values(&self) -> Vec<usize> {
        self.0
            .iter()
            .map(|mb| match mb {
                // At least one value; whole values of 4 bytes.
                Some(mb) => ((mb * 1024.0 * 1024.0 / 4.0) as usize).max(1),
                None => usize::MAX,
            })
            .collect()
    }

    /// The sizes of `values` per stage, as `--allreduce-bucket-mb` takes them back.
    pub fn of_values(values: &[usize]) -> Self {
        BucketSizes(
            values
                .iter()
                .map(|&v| (v != usize::MAX).then(|| v as f64 * 4.0 / (1024.0 * 1024.0)))
                .collect(),
        )
    }
}

impl std::str::FromStr for BucketSizes {
    type Err = String;
    fn from_str(text: &str) -> std::result::Result<Self, String> {
        let parts: Vec<&str> = text.split(',').map(str::trim).collect();
        crate::limits::check_count(
            "all-reduce bucket sizes",
            parts.len() as u64,
            pipe_scheduler::limits::MAX_STAGES,
            "one per stage",
        )
        .map_err(|e| e.to_string())?;
        let sizes = parts
            .iter()
            .map(|p| match *p {
                "one" => Ok(None),
                _ => match p.parse::<f64>() {
                    Ok(mb) if mb.is_finite() && mb > 0.0 && mb <= MAX_BUCKET_MB => Ok(Some(mb)),
                    _ => Err(format!(
                        "all-reduce bucket must be between 0 and {MAX_BUCKET_MB} MiB, or one, got \
                         '{p}'"
                    )),
                },
            })
            .collect::<std::result::Result<_, _>>()?;
        Ok(BucketSizes(sizes))
    }
}

impl std::fmt::Display for BucketSizes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text: Vec<String> = self
            .0
            .iter()
            .map(|mb| mb.map_or_else(|| "one".to_string(), |mb| format!("{mb}")))
            .collect();
        f.write_str(&text.join(","))
    }
}

impl Serialize for BucketSizes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for BucketSizes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(f64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(mb) => mb.to_string().parse(),
            Raw::Text(text) => text.parse(),
        }
        .map_err(serde::de::Error::custom)
    }
}

/// Where a run's all-reduce bucket sizes came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BucketOrigin {
    /// The default size, for every stage.
    #[default]
    Default,
    /// `--allreduce-bucket-mb`.
    Given,
    /// Chosen per stage by the simulator's cost of the bucketed ring on the run's link.
    Chosen,
}

/// A plan as `pipe plan -o` writes it and `pipe train --plan` reads it (TOML).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    /// Model preset the profile was taken from (empty when unknown).
    #[serde(default)]
    pub model: String,
    /// Samples per microbatch the profile was taken at (0 when unknown).
    #[serde(default)]
    pub microbatch_size: usize,
    /// Schedule.
    pub schedule: String,
    /// Microbatches per update per replica.
    pub microbatches: u32,
    /// Inclusive layer ranges per stage, as `--partition` takes them.
    pub partition: String,
    /// Replicas per stage.
    pub replicas: Vec<u32>,
    /// Cost model that made the plan.
    #[serde(default)]
    pub cost_model: String,
    /// Predicted seconds per microbatch (slowest stage).
    #[serde(default)]
    pub time_per_microbatch: f64,
    /// The simulator's seconds per microbatch, when simulated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub simulated_time_per_microbatch: Option<f64>,
    /// Recomputation per stage, where the planner chose it to fit the memory bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute: Option<crate::layer::StageRecompute>,
    /// The host of each worker in rank order, where the plan placed its workers on hosts
    /// (`pipe plan --hosts` or `--cluster`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hosts: Option<Vec<String>>,
}

/// The recomputation `plan` chose per stage (`None` where no stage recomputes).
fn plan_recompute(plan: &pipe_scheduler::PartitionPlan) -> Option<crate::layer::StageRecompute> {
    use crate::layer::{Recompute, StageRecompute};
    plan.stages.iter().any(|s| s.recompute).then(|| {
        let kinds = plan
            .stages
            .iter()
            .map(|s| {
                if s.recompute {
                    Recompute::Full
                } else {
                    Recompute::None
                }
            })
            .collect();
        StageRecompute::per_stage(kinds).unwrap_or_default()
    })
}

impl PlanFile {
    /// A plan file for `plan`, made from `profile`.
    ///
    /// # Errors
    /// When the plan's stages do not tile the profile's layers.
    pub fn from_plan(
        profile: &pipe_scheduler::Profile,
        plan: &pipe_scheduler::PartitionPlan,
    ) -> Result<Self> {
        let (partition, replicas) = layout_of(plan)?;
        Ok(PlanFile {
            model: profile.model.clone(),
            microbatch_size: profile.microbatch_size,
            schedule: plan.policy.name().into(),
            microbatches: plan.microbatches,
            partition: partition.to_string(),
            replicas,
            cost_model: plan.cost_model.into(),
            time_per_microbatch: plan.time_per_microbatch,
            simulated_time_per_microbatch: plan.simulated,
            recompute: plan_recompute(plan),
            hosts: None,
        })
    }

    /// Parses and checks a plan file's text; `source` names it in errors.
    ///
    /// # Errors
    /// [`StageError::Config`] naming the file and the problem.
    pub fn parse(text: &str, source: &str) -> Result<Self> {
        let f: PlanFile = toml::from_str(text).map_err(|e| {
            StageError::Config(format!(
                "plan {source}: {}",
                e.to_string().replace('\n', " ")
            ))
        })?;
        f.check()
            .map_err(|e| StageError::Config(format!("plan {source}: {e}")))?;
        Ok(f)
    }

    /// Checks what a plan file says as its flags would be checked, before any of it is used:
    /// a schedule the planner plans, counts within [`crate::limits`], finite figures. The
    /// partition is checked against the model when the run resolves.
    fn check(&self) -> std::result::Result<(), String> {
        let policy: Policy = self
            .schedule
            .parse()
            .map_err(|e: pipe_scheduler::ScheduleError| e.to_string())?;
        pipe_scheduler::planner::check_plannable(policy).map_err(|e| e.to_string())?;
        if self.replicas.is_empty() || self.replicas.contains(&0) || self.microbatches == 0 {
            return Err("replicas and microbatches must be at least 1".into());
        }
        let workers: u64 = self.replicas.iter().map(|&r| u64::from(r)).sum();
        pipe_scheduler::limits::check_layout(self.replicas.len() as u64, workers, 1)
            .and_then(|()| pipe_scheduler::limits::check_microbatches(u64::from(self.microbatches)))
            .map_err(|e| e.to_string())?;
        if self.microbatch_size > 0 {
            crate::limits::check_count(
                "microbatch_size",
                self.microbatch_size as u64,
                crate::limits::MAX_TENSOR_ELEMENTS,
                "a microbatch is one tensor",
            )
            .map_err(|e| e.to_string())?;
        }
        let times = [
            Some(self.time_per_microbatch),
            self.simulated_time_per_microbatch,
        ];
        if let Some(t) = times
            .into_iter()
            .flatten()
            .find(|t| !(t.is_finite() && *t >= 0.0))
        {
            return Err(format!(
                "a predicted time must be a finite number >= 0, got {t}"
            ));
        }
        if let Some(r) = &self.recompute {
            r.check_stages(self.replicas.len() as u32)?;
        }
        if let Some(hosts) = &self.hosts {
            if hosts.len() as u64 != workers {
                return Err(format!(
                    "hosts names {} workers' hosts, the plan has {workers} workers",
                    hosts.len()
                ));
            }
            if hosts.iter().any(|h| h.is_empty() || h.len() > 255) {
                return Err("a host name must have 1 to 255 characters".into());
            }
        }
        Ok(())
    }
}

/// A plan's stages as the partition `--partition` takes, and its replica counts.
///
/// # Errors
/// When the stages do not tile the layers (never, for a plan the planner made).
pub fn layout_of(plan: &pipe_scheduler::PartitionPlan) -> Result<(Partition, Vec<u32>)> {
    let ranges = plan.stages.iter().map(|s| s.layers.clone()).collect();
    let partition = Partition::new(ranges, plan.order.len())?;
    Ok((partition, plan.stages.iter().map(|s| s.replicas).collect()))
}
