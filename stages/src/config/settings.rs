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

/// A preset by name, as `--model` takes it (a layer list is a config file's).
impl std::str::FromStr for ModelChoice {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Ok(ModelChoice::Preset(s.to_string()))
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

crate::model::names::from_str_by_name!(DatasetKind, "dataset", {
    "mnist" => Mnist,
    "synthetic" => Synthetic,
    "tinyshakespeare" => TinyShakespeare,
    "tokens" => Tokens,
}, expected "mnist, synthetic, tinyshakespeare, tokens:DIR");

/// Raw settings, every one optional: the shape of a TOML config file and of the command line
/// (`pipe train` and `pipe worker` flatten it into their flags, so a setting's flag, its
/// config key and its documentation are this one field). Later sources override earlier
/// ones field by field ([`TrainSettings::merge`]).
///
/// The run's numerics resolve into a [`RunConfig`] ([`TrainSettings::resolve`]); the
/// settings of the launch around it (checkpoints, resuming, restarts, metrics, traces,
/// faults) into [`LaunchSettings`] ([`TrainSettings::launch`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(deny_unknown_fields)]
pub struct TrainSettings {
    /// Model preset: mlp-784-512-512-10, mlp-784-1024x16-10, ... or gpt-mini, gpt-small (a
    /// layer list goes in --config).
    #[arg(long, value_name = "PRESET")]
    pub model: Option<ModelChoice>,
    /// Share a gpt-* model's token embedding (first stage) with its LM head (last stage);
    /// gpt2 models always do.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub tie_embeddings: Option<bool>,
    /// A Hugging Face GPT-2 config.json giving --model gpt2 its shape and vocabulary size.
    #[arg(long, value_name = "FILE")]
    pub model_config: Option<PathBuf>,
    /// A `gpt2` model's shape, field by field (over `model_config` and the preset's).
    #[command(flatten)]
    pub gpt2: Option<crate::transformer::Gpt2Shape>,
    /// Start from the weights of a Hugging Face GPT-2 directory (its model.safetensors, as
    /// `pipe export --format hf` or transformers' save_pretrained writes it).
    #[arg(long, value_name = "DIR")]
    pub init_from: Option<PathBuf>,
    /// Dataset (the command line's `--dataset`, which also takes `tokens:DIR`).
    #[arg(skip)]
    pub dataset: Option<DatasetKind>,
    /// Directory with MNIST IDX files or `tinyshakespeare.txt` instead of the embedded copy,
    /// or a tokenized corpus's directory (the command line's `--data-dir`).
    #[arg(skip)]
    pub data_dir: Option<PathBuf>,
    /// The validation part of a tokenized corpus: tail:FRACTION (the default, tail:0.1) or
    /// shards:COUNT (its last shards).
    #[arg(long, value_name = "HOLDOUT")]
    pub holdout: Option<String>,
    /// Most validation windows of a tokenized corpus evaluated after each epoch, chosen evenly
    /// over its held-out part (default 2048).
    #[arg(long, value_name = "N")]
    pub eval_windows: Option<u64>,
    /// Synthetic dataset shape (config file only).
    #[arg(skip)]
    pub synthetic: Option<SyntheticConfig>,
    /// Passes over the training data.
    #[arg(long)]
    pub epochs: Option<u64>,
    /// Stop after this many optimizer steps.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Evaluate on the validation set every N updates as well as at each epoch's end (a drain
    /// point, like a checkpoint: under an asynchronous schedule it changes the run's numerics,
    /// as --checkpoint-every does). Records go to the progress output and the JSON-lines log.
    #[arg(long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// The order each epoch visits the training samples in: shuffled (a seeded permutation
    /// per epoch, the default) or sequential (sample 0, 1, 2, ...: for a run another trainer
    /// must follow window by window).
    #[arg(long, value_name = "shuffled|sequential")]
    pub data_order: Option<crate::data::DataOrder>,
    /// Recompute activations in the backward pass instead of keeping them: none; full (each
    /// layer keeps its input, a transformer block instead of its attention and MLP
    /// activations, and runs its forward again in the backward); selective (only the
    /// attention layers' activations are recomputed). Same bits, less memory, more compute.
    /// One kind for every stage, or one per stage (`full,full,none,none`).
    #[arg(long, value_name = "none|full|selective[,...]")]
    pub recompute: Option<crate::layer::StageRecompute>,
    /// The host of each worker in rank order, as a plan placed them (`pipe plan --hosts`).
    #[arg(skip)]
    pub hosts: Option<Vec<String>>,
    /// Read a tokenized corpus's windows as packed documents: attention stops at each
    /// document's start (after an end-of-text id), positions restart there, and a document's
    /// first token is not a loss term.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub pack_documents: Option<bool>,
    /// Samples per microbatch.
    #[arg(long)]
    pub microbatch_size: Option<usize>,
    /// Microbatches whose gradients one update sums.
    #[arg(long)]
    pub microbatches: Option<usize>,
    /// Optimizer: sgd, adam, adamw, muon (orthogonalised momentum for hidden weight matrices,
    /// AdamW for the rest) or lion.
    #[arg(long)]
    pub optimizer: Option<OptimizerKind>,
    /// Base learning rate.
    #[serde(default, deserialize_with = "finite_f32")]
    #[arg(long, value_parser = parse_f32)]
    pub lr: Option<f32>,
    /// Learning-rate schedule: constant, warmup or cosine.
    #[arg(long)]
    pub lr_schedule: Option<LrScheduleKind>,
    /// Linear warmup steps.
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// SGD momentum.
    #[serde(default, deserialize_with = "finite_f32")]
    #[arg(long, value_parser = parse_f32)]
    pub momentum: Option<f32>,
    /// Use Nesterov momentum.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub nesterov: Option<bool>,
    /// Weight decay.
    #[serde(default, deserialize_with = "finite_f32")]
    #[arg(long, value_parser = parse_f32)]
    pub weight_decay: Option<f32>,
    /// The parameters weight decay applies to: all, or matrices (the weights of linear maps:
    /// not biases, layer-norm gains or embeddings, as nanoGPT and Megatron group a GPT's
    /// parameters). Default: matrices for AdamW on a language model, else all.
    #[arg(long, value_name = "all|matrices")]
    pub weight_decay_groups: Option<crate::optim::DecayGroups>,
    /// Adam's first-moment decay (default 0.9).
    #[serde(default, deserialize_with = "finite_f32")]
    #[arg(long, value_parser = parse_f32)]
    pub beta1: Option<f32>,
    /// Adam's second-moment decay (default 0.999).
    #[serde(default, deserialize_with = "finite_f32")]
    #[arg(long, value_parser = parse_f32)]
    pub beta2: Option<f32>,
    /// Adam's epsilon (default 1e-8).
    #[serde(default, deserialize_with = "finite_f32")]
    #[arg(long, value_parser = parse_f32)]
    pub eps: Option<f32>,
    /// Correct each update for the pipeline's delay: none; error-feedback (the weights move
    /// by u_t + c (u_t - u_{t-1}), u the optimizer's update); dc-asgd (the gradient g, computed
    /// at stale weights w_s, becomes g + lambda g*g*(w - w_s)); dc-asgd-adaptive (lambda per
    /// element lambda_0 / sqrt(MS + 1e-7), MS a running mean of g^2). Asynchronous policies
    /// only; dc-asgd needs stashed weights (not pipedream-nostash).
    #[arg(long, value_name = "KIND")]
    pub delay_correction: Option<crate::optim::DelayCorrection>,
    /// Clip every update's gradient to this global L2 norm (over every stage and replica;
    /// docs/training.md says which stages' norms an asynchronous pipeline adds). 0 turns it
    /// off [default: 1.0 for the gpt2 models, off otherwise].
    #[serde(default, deserialize_with = "finite_f32")]
    #[arg(long, value_name = "NORM", value_parser = parse_f32)]
    pub grad_clip: Option<f32>,
    /// The delay correction's strength: error feedback's c [default: 1], DC-ASGD's lambda
    /// [default: 0.04], the adaptive form's lambda_0 [default: 2].
    #[serde(default, deserialize_with = "finite_f32")]
    #[arg(long, value_name = "C", value_parser = parse_f32)]
    pub delay_correction_strength: Option<f32>,
    /// Run seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Compute threads (0: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Write one JSON object per step and per epoch to FILE.
    #[arg(long, value_name = "FILE", value_parser = crate::outputs::output_file)]
    pub log_jsonl: Option<PathBuf>,
    /// Pipeline stages.
    #[arg(long)]
    pub stages: Option<usize>,
    /// Replicas per stage: one value for all, or a comma-separated list (2,1,1,1).
    #[arg(long, value_delimiter = ',')]
    pub replicas: Option<Vec<u32>>,
    /// Pipeline schedule: pipedream (default), pipedream-nostash, vsync, 2bw, gpipe,
    /// 1f1b-flush, interleaved, zb-h1, zb-v, dualpipev or sequential.
    #[arg(long)]
    pub schedule: Option<String>,
    /// Model chunks per worker (interleaved; zb-v and dualpipev always hold 2).
    #[arg(long)]
    pub chunks: Option<u32>,
    /// How to cut the model into stages: `measured` (profile briefly, balance time; the
    /// default), `flops` (balance FLOPs; the same cut on every machine) or inclusive layer
    /// ranges such as 0-2,3-5.
    #[arg(long)]
    pub partition: Option<String>,
    /// Compute backend, `cpu` or `cuda` (the command line's `--backend`, which says what
    /// this build can open).
    #[arg(skip)]
    pub backend: Option<String>,
    /// Precision of the matrix products: f32; tf32 or bf16 (tensor cores with f32
    /// accumulation and f32 master weights; cuda only); bf16x6 (f32's accuracy from six
    /// bf16 products per term on AMX tiles, other bits than f32's; cpu only, Intel Xeon 4th
    /// generation or later); or bf16x3 (about 16 bits from three such products, faster).
    #[arg(long, value_parser = ["f32", "tf32", "bf16", "bf16x6", "bf16x3"])]
    pub precision: Option<String>,
    /// What carries each link between workers: auto (channels between threads, shared
    /// memory between processes of one host, QUIC between hosts), or one transport for every
    /// link: inproc, shm, quic (QUIC with mutual TLS on every link) or tcp (plain TCP, for
    /// trusted networks). A transport that crosses processes runs worker processes unless
    /// --placement says otherwise.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(pipe_transport::kinds::names()))]
    pub transport: Option<String>,
    /// Where the workers run: threads of this process, or one `pipe worker` process each on
    /// this host.
    #[arg(long, value_parser = ["threads", "processes"])]
    pub placement: Option<String>,
    /// Element type of activations and gradients between stages: f32 or bf16 (half the
    /// bytes; all-reduces stay f32).
    #[arg(long, value_parser = ["f32", "bf16"])]
    pub wire_dtype: Option<String>,
    /// Remedy for stale weights: run the first N updates with the synchronous 1f1b-flush
    /// schedule, then the asynchronous policy (pipedream, pipedream-nostash, vsync, 2bw).
    #[arg(long, value_name = "N")]
    pub sync_warmup: Option<u64>,
    /// Remedy for stale weights: scale each stage's learning rate by its delay tau:
    /// `staleness` (lr / (1 + tau)) or `pipemare:K` (lr * tau^-(1 - k/K), PipeMare's
    /// rescheduling over the first K updates).
    #[arg(long, value_name = "none|staleness|pipemare:K")]
    pub lr_scaling: Option<String>,
    /// Remedy for stale weights: predict weights from a running average of each stage's
    /// weight changes. `discrepancy[:DECAY]` (pipedream-nostash): the backward estimates the
    /// forward's weights (PipeMare); `lookahead[:DECAY]` (pipedream, vsync, 2bw): passes use
    /// the weights predicted for when the gradient is applied.
    #[arg(long, value_name = "none|discrepancy[:D]|lookahead[:D]")]
    pub weight_prediction: Option<String>,
    /// Seconds a worker may wait for data before the run stops as stalled and the hang doctor
    /// prints every worker's state and the wait-for graph (default 300).
    #[arg(long, value_name = "SECONDS")]
    pub stall_timeout: Option<f64>,
    /// MiB of f32 gradients per all-reduce bucket, one size or one per stage (`4,1,one`; `one`:
    /// a stage's gradients in one bucket). Each bucket of a stage's last layers starts its
    /// ring all-reduce while the backward pass computes the earlier ones. Default: chosen per
    /// stage by the simulator on the run's link where the partition is measured, else 4.
    #[arg(long, value_name = "MIB[,MIB...]")]
    pub allreduce_bucket_mb: Option<BucketSizes>,
    /// Precision of the gradients the replicas' all-reduce sends: f32, or bf16 (half the
    /// bytes; sums stay f32, every replica ends with the same bits).
    #[arg(long, value_parser = ["f32", "bf16"])]
    pub allreduce_dtype: Option<String>,
    /// Write the measured timeline as Chrome trace JSON to FILE (pipelined runs).
    #[arg(long, value_name = "FILE", value_parser = crate::outputs::output_file)]
    pub trace: Option<PathBuf>,
    /// Write checkpoints to DIR: at every epoch's end, every --checkpoint-every updates, and
    /// on Ctrl-C (pipelined runs).
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Also drain the pipeline and write a checkpoint every N updates (needs
    /// --checkpoint-dir).
    #[arg(long, value_name = "N")]
    pub checkpoint_every: Option<u64>,
    /// Write the run's starting point (update 0: the seed's weights, or --init-from's, and a
    /// fresh optimizer) as a checkpoint in --checkpoint-dir and stop without training: a seed
    /// checkpoint that runs of any layout, and exports, start from.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub seed_checkpoint: Option<bool>,
    /// Checkpoints kept, newest first [default: 3].
    #[arg(long, value_name = "K")]
    pub keep_checkpoints: Option<u64>,
    /// Serve metrics for Prometheus at ADDR (e.g. 127.0.0.1:9464) while the run lasts.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Resume from a checkpoint: a checkpoint's directory, a checkpoint directory (its
    /// newest), `latest` (the newest in --checkpoint-dir), or `auto` (the newest in
    /// --checkpoint-dir if there is one, else a fresh start: what a scheduler that restarts
    /// failed workers passes on every start).
    #[arg(long, value_name = "DIR|latest|auto")]
    pub resume: Option<String>,
    /// After a failure (a worker process killed or lost, a stall), start every worker again
    /// from the newest checkpoint in --checkpoint-dir (from the start if there is none yet),
    /// up to N times; the run then fails naming every cause. A lost replica of a replicated
    /// stage run as worker processes is restarted alone and live instead: a replacement takes
    /// its stage's state from a surviving replica, as one of the N [default: 0].
    #[arg(long, value_name = "N")]
    pub max_restarts: Option<u32>,
    /// After a lost replica of a replicated stage (which the run survives on the stage's other
    /// replicas), take it back, every time: in process a replacement worker joins at the next
    /// update boundary; with worker processes the launcher starts a replacement of the lost
    /// rank, which joins at the first update boundary after it is ready, its stage's state
    /// handed over by a surviving replica.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub rejoin: Option<bool>,
    /// Measure the layer profile of a measured partition or --workers' plan again, even
    /// where pipe's cache holds it for this model, machine and run shape (the new one
    /// replaces it). The cache is PIPE_CACHE_DIR, else the platform's (~/.cache/pipe).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub reprofile: Option<bool>,
    /// Run even where the memory estimate of this host's workers is over the memory this
    /// host has available (MemAvailable, or the cgroup's memory.max where lower).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub force: Option<bool>,
    /// On each restart after a worker was lost (--max-restarts), profile and plan the run
    /// again for the workers that remain (one fewer), as --workers plans: stages, replicas and
    /// partition change; the optimizer, the schedule and the minibatch stay the run's.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub replan_on_restart: Option<bool>,
    /// Inject faults into worker processes, for drills and tests: `RANK:FAULT[/ATTEMPT]`,
    /// comma-separated, where FAULT is exit@N (the process ends at its Nth data message, as
    /// kill -9 would end it), panic@N, fail@N, reset@N, drop@N, duplicate@N, stall@N:SECONDS,
    /// freeze@N:SECONDS (the whole process stops, as SIGSTOP stops it) or
    /// partition@N:PEER:SECONDS (no datagram passes between the worker and PEER),
    /// and ATTEMPT the start of the workers it applies to (0, the default, then one more per
    /// restart, lost replica or rejoin);
    /// or `random:SEED:COUNT`, COUNT faults of those kinds drawn from SEED, one per start.
    #[arg(long, value_name = "SCHEDULE")]
    pub fault_schedule: Option<String>,
}

/// Parses a floating-point flag, refusing what an `f32` cannot hold (`1e300`, `inf`, `nan`)
/// with the value as given.
///
/// # Errors
/// A message naming the value.
pub fn parse_f32(text: &str) -> std::result::Result<f32, String> {
    let v: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("'{text}' is not a number"))?;
    to_f32(v)
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
            None => BackendKind::default(),
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
            weight_prediction, stall_timeout, allreduce_bucket_mb, allreduce_dtype, trace,
            checkpoint_dir, checkpoint_every, seed_checkpoint, keep_checkpoints, metrics_addr,
            resume, max_restarts, rejoin, reprofile, force, replan_on_restart, fault_schedule);
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
