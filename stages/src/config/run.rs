//! The checked run ([`RunConfig`]): its fields, what it answers (its resolved layout, its
//! numerics, its schedule), how it travels to worker processes (JSON), and the checks that
//! need the machine it runs on.

use std::path::PathBuf;

use pipe_kernels::BackendKind;
use pipe_scheduler::planner::buckets::{BucketSize, StageBuckets};
use pipe_scheduler::{Length, Policy, Resolved, ScheduleError, ScheduleSpec};
use pipe_transport::TransportKind;
use pipe_transport::frame::WireDType;
use serde::{Deserialize, Serialize};

use crate::data::{SyntheticConfig, Vocab};
use crate::error::{Result, StageError};
use crate::model::{Model, ModelSpec};
use crate::optim::{LrSchedule, LrScheduleKind, OptimizerConfig};
use crate::partition::Partition;
use crate::remedy::Remedies;

use super::*;

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
    /// The all-reduce bucket size (every stage's, unless `stage_buckets` gives each its
    /// own). Serialized as `bucket_values`, the count of values it always was.
    #[serde(rename = "bucket_values")]
    pub bucket_size: BucketSize,
    /// The all-reduce bucket size of each stage, where given per stage or chosen
    /// ([`crate::planning::buckets`]); empty otherwise. Serialized as
    /// `stage_bucket_values`.
    #[serde(
        rename = "stage_bucket_values",
        default,
        skip_serializing_if = "StageBuckets::is_empty"
    )]
    pub stage_buckets: StageBuckets,
    /// Where the bucket sizes came from.
    #[serde(default)]
    pub bucket_origin: BucketOrigin,
    /// The precision the all-reduce sends in.
    #[serde(with = "by_name")]
    pub allreduce_wire: WireDType,
    /// The layout resolved under the run's policy, or the scheduler's refusal: derived once,
    /// where the run is built ([`TrainSettings::resolve`]) or checked
    /// ([`RunConfig::checked`]), and carried ([`RunConfig::resolved`]). Not serialized: a run
    /// read back is checked again.
    #[serde(skip)]
    pub(super) resolved: Derived,
}

/// A run's layout as derived from its other fields, carried with it: equal whenever they are,
/// so it takes no part in comparing runs (a peer's run read for comparison is not checked).
#[derive(Clone, Debug)]
pub(super) struct Derived(pub(super) std::result::Result<Resolved, ScheduleError>);

impl PartialEq for Derived {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// What a run deserialized and not yet checked carries in place of its layout.
impl Default for Derived {
    fn default() -> Self {
        Derived(Err(ScheduleError::Spec(
            "the run was read but not checked (RunConfig::checked)".into(),
        )))
    }
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
        cfg.checked()
            .map_err(|e| StageError::Config(format!("{source}: {e}")))
    }

    /// This run checked ([`RunConfig::check`]), carrying the layout it resolves to: what a run
    /// read back or laid out anew goes through.
    ///
    /// # Errors
    /// As [`RunConfig::check`].
    pub fn checked(self) -> Result<Self> {
        let resolved = self.check()?;
        Ok(RunConfig {
            resolved: Derived(Ok(resolved)),
            ..self
        })
    }

    /// Checks what [`TrainSettings::resolve`] guarantees, for a run that was read rather than
    /// resolved: the model builds and takes the microbatch, the counts are positive and within
    /// [`crate::limits`], the layout resolves under its policy, the remedies suit it, the
    /// partition tiles the model, and the optimizer's values are in range.
    ///
    /// Returns the layout the run resolves to.
    ///
    /// # Errors
    /// [`StageError::Config`], [`StageError::Model`] or [`StageError::Schedule`] naming the
    /// first problem.
    pub fn check(&self) -> Result<Resolved> {
        let bad = |m: String| Err(StageError::Config(m));
        let model = Model::new(&self.model)?;
        crate::limits::check_run_length(self.epochs, self.steps, self.eval_every)?;
        if self.microbatch_size == 0 || self.microbatches == 0 {
            return bad("microbatch size and microbatches must be at least 1".into());
        }
        model.check_microbatch(self.microbatch_size)?;
        if self.chunks == 0 {
            return bad("chunks must be at least 1".into());
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
        let run = self.schedule_spec(Length::Updates(1)).resolve()?;
        if !self.stage_buckets.is_empty()
            && self.stage_buckets.len() != run.layout.stages() as usize
        {
            return bad(format!(
                "{} all-reduce bucket sizes for {} stages",
                self.stage_buckets.len(),
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
                "stall timeout must be above 0 and at most {MAX_STALL_TIMEOUT} seconds, got {stall}"
            ));
        }
        self.optimizer.validate()?;
        self.synthetic.check()?;
        Ok(run)
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

    /// This run with the partition start-up settled (the measured cut) in place of
    /// `measured`: what its workers and checkpoints name. The one place a settled partition
    /// enters a run.
    pub fn with_partition(self, partition: Partition) -> Self {
        RunConfig {
            partition: PartitionChoice::Given(partition),
            ..self
        }
    }

    /// This run on another layout (a plan for fewer workers after a restart): `replicas` per
    /// stage, `partition`, and `microbatches` per update, one chunk per worker; checked.
    ///
    /// # Errors
    /// A layout that does not hold together ([`RunConfig::check`]).
    pub fn with_layout(
        &self,
        replicas: Vec<u32>,
        partition: Partition,
        microbatches: usize,
    ) -> Result<Self> {
        RunConfig {
            stages: replicas.len(),
            replicas,
            partition: PartitionChoice::Given(partition),
            chunks: 1,
            microbatches,
            pipelined: true,
            ..self.clone()
        }
        .checked()
    }

    /// This run on the same stages with other replica counts and `microbatches` per update
    /// (a lost replica's stage one fewer, or restored); checked.
    ///
    /// # Errors
    /// A layout that does not hold together ([`RunConfig::check`]).
    pub fn with_replica_counts(&self, replicas: Vec<u32>, microbatches: usize) -> Result<Self> {
        RunConfig {
            replicas,
            microbatches,
            ..self.clone()
        }
        .checked()
    }

    /// This run with no JSON-lines log of its own (a launcher's workers, whose launcher logs
    /// what the chief reports).
    pub fn without_log(&self) -> Self {
        RunConfig {
            log_jsonl: None,
            ..self.clone()
        }
    }

    /// This run with each stage's all-reduce bucket size settled: chosen by the simulator on
    /// the measured link, or adopted from the run a checkpoint continues or the chief's
    /// terms. The one place settled bucket sizes enter a run.
    pub fn with_stage_buckets(self, sizes: StageBuckets) -> Self {
        RunConfig {
            stage_buckets: sizes,
            bucket_origin: BucketOrigin::Chosen,
            ..self
        }
    }

    /// This run as one `pipe worker` process of it runs it: placed as processes, and with
    /// `inproc` (or a launcher's run of threads) read as `auto`, which picks each link's
    /// transport from where its ends are.
    pub fn as_worker_process(self) -> Self {
        let transport = match self.transport {
            kind if kind == TransportKind::INPROC => TransportKind::Auto,
            other => other,
        };
        RunConfig {
            placement: Placement::Processes,
            transport,
            ..self
        }
    }

    /// Checks the run against this host ([`crate::limits`]): its compute threads, its
    /// microbatch's activations, and how many of its workers live here (`local_workers`:
    /// `None` for all of them, as `pipe train` runs them; `Some(1)` for `pipe worker`). Its
    /// memory is the start-up's memory gate's (`crate::startup::check_memory`).
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
        let workers = match local_workers {
            Some(n) => n,
            None if self.pipelined => u64::from(self.resolved()?.layout.workers()),
            None => 1,
        };
        crate::limits::check_local_workers(workers, machine)
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
            (TransportKind::Auto, Placement::Threads) => TransportKind::INPROC,
            (TransportKind::Auto, Placement::Processes) => TransportKind::SHM,
            (kind, _) => kind,
        }
    }

    /// The schedule request this run implies, running for `length`.
    pub fn schedule_spec(&self, length: Length) -> ScheduleSpec {
        self.schedule_spec_of(self.schedule, length)
    }

    /// The run's schedule resolved (its layout, minibatch and policy), as it was derived when
    /// the run was built or checked.
    ///
    /// # Errors
    /// [`StageError::Schedule`] for a layout the policy refuses.
    pub fn resolved(&self) -> Result<&Resolved> {
        self.resolved
            .0
            .as_ref()
            .map_err(|e| StageError::Schedule(e.clone()))
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

/// [`crate::optim::DelayCorrection::check_fits`] for a run's optimizer, policy and weight
/// prediction, a configuration error (exit 2).
///
/// # Errors
/// [`StageError::Config`] naming the correction and the policy.
pub(super) fn check_delay_correction(
    optimizer: &OptimizerConfig,
    policy: Policy,
    prediction: Option<crate::remedy::Prediction>,
) -> Result<()> {
    let predicts = prediction.is_some_and(|p| p != crate::remedy::Prediction::None);
    optimizer.delay_correction.check_fits(policy, predicts)
}

impl RunConfig {
    /// Whether this run's bucket sizes are open to being settled for it: it was given none
    /// (`--allreduce-bucket-mb`), so sizes chosen on its measured link
    /// ([`crate::planning::buckets`]) or by the run it continues or follows are its own. The
    /// guard of the choice and of [`RunConfig::adopt_buckets_of`] alike.
    pub fn takes_settled_buckets(&self) -> bool {
        self.bucket_origin == BucketOrigin::Default
    }

    /// The one adoption rule of bucket sizes, for checkpoints and the chief's terms alike:
    /// this run with the sizes `other` (the run a checkpoint continues, or the chief's)
    /// chose, where this run takes settled sizes ([`RunConfig::takes_settled_buckets`]),
    /// `other` chose its own, and they are one size per stage of this run. The replicas' sums
    /// then add in the buckets of the run they follow. `None`: this run keeps its own.
    pub fn adopt_buckets_of(&self, other: &RunConfig) -> Option<RunConfig> {
        if !self.takes_settled_buckets() || other.bucket_origin != BucketOrigin::Chosen {
            return None;
        }
        let stages = self.resolved().ok()?.layout.stages() as usize;
        (other.stage_buckets.len() == stages)
            .then(|| self.clone().with_stage_buckets(other.stage_buckets.clone()))
    }
}
