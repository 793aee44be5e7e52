//! The settings a user gives: every one optional, the shape of a TOML config file and of
//! the command line; later sources override earlier ones field by field, and a plan file
//! gives its layout. Nothing here applies a default or checks a value against the run:
//! that is [`super::resolve`]'s.

use std::path::PathBuf;

use pipe_kernels::BackendKind;
use pipe_scheduler::Policy;
use pipe_transport::frame::WireDType;
use serde::{Deserialize, Serialize};

use crate::data::SyntheticConfig;
use crate::error::{Result, StageError};
use crate::model::ModelSpec;
use crate::optim::{LrScheduleKind, OptimizerKind};
use crate::partition::Partition;

use super::*;

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
pub(super) fn wire_dtype(name: Option<&str>) -> Result<WireDType> {
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

macro_rules! merge_fields {
    ($dst:ident, $src:ident; $($f:ident),*) => { $( if $src.$f.is_some() { $dst.$f = $src.$f; } )* };
}

impl TrainSettings {
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
    pub(super) fn backend_kind(&self) -> Result<BackendKind> {
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
}
