//! The run configuration: what a `pipe train` invocation means once its flags and config file
//! have been merged and checked. Everything downstream takes a [`RunConfig`] and never re-checks.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::data::SyntheticConfig;
use crate::error::{Result, StageError};
use crate::model::{Model, ModelSpec};
use crate::optim::{LrScheduleKind, OptimizerConfig, OptimizerKind};

/// The model preset used when none is given.
pub const DEFAULT_MODEL: &str = "mlp-784-512-512-10";

/// A model given by preset name or by layer list.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ModelChoice {
    /// A preset name such as `mlp-784-512-512-10`.
    Preset(String),
    /// An explicit layer list.
    Layers(ModelSpec),
}

/// Which dataset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetKind {
    /// MNIST digits (embedded, or from `data_dir`).
    Mnist,
    /// The seeded teacher-network dataset.
    Synthetic,
}

impl std::str::FromStr for DatasetKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "mnist" => Ok(Self::Mnist),
            "synthetic" => Ok(Self::Synthetic),
            _ => Err(format!("unknown dataset '{s}' (mnist, synthetic)")),
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
    /// Dataset.
    pub dataset: Option<DatasetKind>,
    /// Directory with MNIST IDX files instead of the embedded copy.
    pub data_dir: Option<PathBuf>,
    /// Synthetic dataset shape.
    pub synthetic: Option<SyntheticConfig>,
    /// Passes over the training set.
    pub epochs: Option<u64>,
    /// Stop after this many optimizer steps (overrides the epoch count when smaller).
    pub steps: Option<u64>,
    /// Samples per microbatch.
    pub microbatch_size: Option<usize>,
    /// Microbatches whose gradients one update sums.
    pub microbatches: Option<usize>,
    /// Optimizer.
    pub optimizer: Option<OptimizerKind>,
    /// Base learning rate.
    pub lr: Option<f32>,
    /// Learning-rate schedule.
    pub lr_schedule: Option<LrScheduleKind>,
    /// Warmup steps.
    pub warmup_steps: Option<u64>,
    /// SGD momentum.
    pub momentum: Option<f32>,
    /// SGD Nesterov momentum.
    pub nesterov: Option<bool>,
    /// Weight decay.
    pub weight_decay: Option<f32>,
    /// Adam betas.
    pub beta1: Option<f32>,
    /// Adam betas.
    pub beta2: Option<f32>,
    /// Adam epsilon.
    pub eps: Option<f32>,
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
        toml::from_str(text).map_err(|e| {
            let msg = e.to_string();
            let one_line = msg.split_whitespace().collect::<Vec<_>>().join(" ");
            StageError::Config(format!("{name}: {one_line}"))
        })
    }

    /// Overrides every field that `other` sets.
    pub fn merge(&mut self, other: TrainSettings) {
        let dst = self;
        let src = other;
        merge_fields!(dst, src; model, dataset, data_dir, synthetic, epochs, steps,
            microbatch_size, microbatches, optimizer, lr, lr_schedule, warmup_steps, momentum,
            nesterov, weight_decay, beta1, beta2, eps, seed, threads, log_jsonl, stages, replicas,
            schedule, chunks, partition);
    }

    /// Applies defaults and checks every value.
    ///
    /// # Errors
    /// [`StageError::Config`] or [`StageError::Model`] naming the first bad value.
    pub fn resolve(self) -> Result<RunConfig> {
        let bad = |m: String| Err(StageError::Config(m));
        let (model_name, model) = match self
            .model
            .unwrap_or(ModelChoice::Preset(DEFAULT_MODEL.into()))
        {
            ModelChoice::Preset(name) => {
                let spec = ModelSpec::preset(&name)?;
                (name, spec)
            }
            ModelChoice::Layers(spec) => ("custom".to_string(), spec),
        };
        Model::new(&model)?;
        let dataset = self.dataset.unwrap_or(DatasetKind::Mnist);
        let epochs = self
            .epochs
            .unwrap_or(if dataset == DatasetKind::Mnist { 6 } else { 10 });
        if epochs == 0 {
            return bad("epochs must be at least 1".into());
        }
        if self.steps == Some(0) {
            return bad("steps must be at least 1".into());
        }
        let microbatch_size = self.microbatch_size.unwrap_or(64);
        if microbatch_size == 0 {
            return bad("microbatch size must be at least 1".into());
        }
        let microbatches = self.microbatches.unwrap_or(1);
        if microbatches == 0 {
            return bad("microbatches per update must be at least 1".into());
        }
        let defaults = OptimizerConfig::default();
        let kind = self.optimizer.unwrap_or(OptimizerKind::Sgd);
        let optimizer = OptimizerConfig {
            kind,
            momentum: self
                .momentum
                .unwrap_or(if kind == OptimizerKind::Sgd { 0.9 } else { 0.0 }),
            nesterov: self.nesterov.unwrap_or(false),
            weight_decay: self.weight_decay.unwrap_or(defaults.weight_decay),
            beta1: self.beta1.unwrap_or(defaults.beta1),
            beta2: self.beta2.unwrap_or(defaults.beta2),
            eps: self.eps.unwrap_or(defaults.eps),
        };
        optimizer.validate()?;
        let lr = self.lr.unwrap_or(match kind {
            OptimizerKind::Sgd => 0.05,
            _ => 1e-3,
        });
        if !(lr > 0.0 && lr.is_finite()) {
            return bad(format!("learning rate must be positive, got {lr}"));
        }
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
        let chunks = self.chunks.unwrap_or(1);
        let pipelined = stages > 1
            || replicas.iter().any(|&r| r > 1)
            || chunks > 1
            || self.schedule.is_some()
            || self.partition.is_some();
        let schedule = self.schedule.clone().unwrap_or_else(|| "pipedream".into());
        schedule
            .parse::<pipe_scheduler::Policy>()
            .map_err(|e| StageError::Config(e.to_string()))?;
        let synthetic = self.synthetic.unwrap_or_default();
        Ok(RunConfig {
            model_name,
            model,
            dataset,
            data_dir: self.data_dir,
            synthetic,
            epochs,
            steps: self.steps,
            microbatch_size,
            microbatches,
            optimizer,
            lr,
            lr_schedule: self.lr_schedule.unwrap_or(LrScheduleKind::Cosine),
            warmup_steps: self.warmup_steps.unwrap_or(0),
            seed: self.seed.unwrap_or(0),
            threads: self.threads.unwrap_or(0),
            log_jsonl: self.log_jsonl,
            stages,
            replicas,
            schedule,
            chunks,
            partition: self.partition,
            pipelined,
        })
    }
}

/// A validated run configuration.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunConfig {
    /// Preset name, or `custom`.
    pub model_name: String,
    /// The model.
    pub model: ModelSpec,
    /// Dataset.
    pub dataset: DatasetKind,
    /// MNIST directory (embedded copy when absent).
    pub data_dir: Option<PathBuf>,
    /// Synthetic dataset shape.
    pub synthetic: SyntheticConfig,
    /// Passes over the training set.
    pub epochs: u64,
    /// Optional cap on optimizer steps.
    pub steps: Option<u64>,
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
    /// Warmup steps.
    pub warmup_steps: u64,
    /// Run seed.
    pub seed: u64,
    /// Compute threads (0: one per core).
    pub threads: usize,
    /// JSON-lines log path.
    pub log_jsonl: Option<PathBuf>,
    /// Pipeline stages.
    pub stages: usize,
    /// Replicas per stage (one value, or one per stage).
    pub replicas: Vec<u32>,
    /// Schedule policy name (checked).
    pub schedule: String,
    /// Model chunks per worker.
    pub chunks: u32,
    /// Explicit partition, if given.
    pub partition: Option<String>,
    /// True when the run goes through the pipelined executor (any pipeline setting given).
    pub pipelined: bool,
}
