//! The sweep file (`experiments/bench/default.toml`): what to measure, typed once here. Every
//! table refuses unknown keys, and [`BenchConfig::check`] refuses sizes that cannot run, so a
//! typo is a one-line error before anything is measured.

use pipe_scheduler::Policy;
use serde::{Deserialize, Serialize};

use crate::ExperimentError;

/// A whole sweep file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BenchConfig {
    /// Timed repeats per configuration (at least 5: the mean leaves out the fastest and the
    /// slowest, MLPerf's rule).
    pub repeats: u32,
    /// Untimed runs of each configuration before its repeats.
    pub warmup: u32,
    /// Minibatches per run.
    pub minibatches: u32,
    /// Stop starting configurations after this many minutes (the rest are listed as not run).
    pub budget_minutes: f64,
    /// Models and their microbatch sizes.
    pub models: Vec<ModelEntry>,
    /// Cartesian sweeps.
    pub sweeps: Vec<Sweep>,
    /// Configuration ids whose measured and simulated Chrome traces are kept.
    #[serde(default)]
    pub traces: Vec<String>,
    /// How the simulator's per-layer costs are profiled.
    pub profile: ProfileSettings,
    /// The time-to-target-loss runs.
    pub target: TargetRun,
    /// What `--quick` replaces.
    pub quick: Quick,
}

/// A model of the sweep.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    /// Preset name (`pipe train --model`).
    pub name: String,
    /// Samples (sequences for language models) per microbatch.
    pub microbatch: usize,
    /// Minibatches per run for this model (default: the sweep's `minibatches`): more for a
    /// fast model, so that a run lasts long enough to time well.
    #[serde(default)]
    pub minibatches: Option<u32>,
}

/// Every combination of its lists.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sweep {
    /// Name (the report groups rows by it).
    pub name: String,
    /// Model names (from `models`).
    pub models: Vec<String>,
    /// Pipeline stages (positions; the V-shaped policies run twice as many model stages).
    pub stages: Vec<u32>,
    /// Replicas of every stage.
    pub replicas: Vec<u32>,
    /// Microbatches per update per replica (`M`), raised where a policy needs more: to a
    /// multiple of the stages for `interleaved`, to `2 x stages` for `zb-v` and `dualpipev`.
    pub microbatches: Vec<u32>,
    /// Policies (`--schedule` names), or `["all"]`.
    pub policies: Vec<String>,
    /// `inproc` and/or `quic` (threads in one process either way; QUIC on loopback with TLS).
    pub transports: Vec<TransportName>,
    /// Chunks per worker for `interleaved`.
    #[serde(default = "two")]
    pub chunks: u32,
}

fn two() -> u32 {
    2
}

/// A transport the sweep can run over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TransportName {
    /// In-process channels.
    #[serde(rename = "inproc")]
    InProc,
    /// QUIC on loopback (mutual TLS, f32 on the wire).
    #[serde(rename = "quic")]
    Quic,
}

impl TransportName {
    /// The name in files and ids.
    pub fn name(self) -> &'static str {
        match self {
            TransportName::InProc => "inproc",
            TransportName::Quic => "quic",
        }
    }
}

/// Profiling of the simulator's per-layer costs ([`pipe_stages::profile`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileSettings {
    /// Timed runs of every layer operation (medians).
    pub repeats: usize,
    /// Calibration copies run at once (the machine's cores).
    pub concurrent: usize,
    /// Microbatches per update of the calibration run.
    pub calibrate_microbatches: u32,
    /// Minibatches the calibration run times.
    pub calibration_minibatches: u32,
}

/// Time to a target training loss on real data, one run per policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetRun {
    /// Model preset.
    pub model: String,
    /// Dataset (`mnist`).
    pub dataset: String,
    /// Training samples used (the first ones; 0: all).
    pub train_samples: usize,
    /// Test samples used.
    pub test_samples: usize,
    /// Pipeline stages of the pipelined runs.
    pub stages: u32,
    /// Policies (`sequential` runs on one worker).
    pub policies: Vec<String>,
    /// Samples per microbatch.
    pub microbatch: usize,
    /// Microbatches per update.
    pub microbatches: usize,
    /// SGD learning rate.
    pub lr: f32,
    /// Target of the training loss, averaged over `window` updates.
    pub target_loss: f64,
    /// Updates averaged.
    pub window: usize,
    /// Epochs at most.
    pub epochs: u64,
}

/// What `--quick` replaces (about a minute in all).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quick {
    /// Timed repeats.
    pub repeats: u32,
    /// Minibatches per run.
    pub minibatches: u32,
    /// Models.
    pub models: Vec<ModelEntry>,
    /// Sweeps.
    pub sweeps: Vec<Sweep>,
    /// Traces kept.
    #[serde(default)]
    pub traces: Vec<String>,
    /// Profile repeats.
    pub profile_repeats: usize,
    /// Training samples of the target runs.
    pub target_train_samples: usize,
    /// Policies of the target runs.
    pub target_policies: Vec<String>,
}

/// One configuration to measure.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ConfigSpec {
    /// `model/sSrRmM/policy/transport`.
    pub id: String,
    /// The sweep it came from.
    pub sweep: String,
    /// Model preset.
    pub model: String,
    /// Samples per microbatch.
    pub microbatch: usize,
    /// Policy (written by name).
    pub policy: Policy,
    /// Pipeline stages (positions).
    pub stages: u32,
    /// Replicas per stage.
    pub replicas: u32,
    /// Microbatches per update per replica, as run.
    pub m: u32,
    /// Chunks per worker (`interleaved`; 1 otherwise, 2 for the V-shaped policies).
    pub chunks: u32,
    /// Transport.
    pub transport: TransportName,
    /// Minibatches per run.
    pub minibatches: u32,
}

/// The bounds of one configuration a child measures, a sweep file's: microbatch,
/// minibatches, stages, replicas, chunks; microbatches per update up to the scheduler's bound
/// (a policy raises a sweep's `M`, [`config_spec`]).
const SPEC_BOUNDS: [(&str, u64); 6] = [
    ("microbatch", 65_536),
    ("minibatches", 1000),
    ("stages", 64),
    ("replicas", 16),
    ("microbatches", pipe_scheduler::limits::MAX_MICROBATCHES),
    ("chunks", 16),
];

impl ConfigSpec {
    /// Checks one configuration against the sweep file's bounds, for `pipe bench
    /// measure-config`, which takes it as JSON rather than from a checked file.
    ///
    /// # Errors
    /// A message naming the field.
    pub fn check(&self) -> Result<(), String> {
        let values = [
            self.microbatch as u64,
            u64::from(self.minibatches),
            u64::from(self.stages),
            u64::from(self.replicas),
            u64::from(self.m),
            u64::from(self.chunks),
        ];
        for ((field, max), v) in SPEC_BOUNDS.iter().zip(values) {
            if v == 0 || v > *max {
                return Err(format!("{field} = {v}: between 1 and {max}"));
            }
        }
        Ok(())
    }

    /// The schedule request of one run.
    ///
    /// # Errors
    /// An unknown policy name.
    pub fn schedule(&self) -> Result<pipe_scheduler::ScheduleSpec, ExperimentError> {
        let minibatches = self.minibatches;
        let policy = self.policy;
        let chunks = if policy == Policy::Interleaved {
            self.chunks
        } else {
            1
        };
        Ok(
            pipe_scheduler::ScheduleSpec::new(policy, self.stages, self.m)
                .with_replicas(vec![self.replicas])
                .with_chunks(chunks)
                .with_length(pipe_scheduler::Length::Updates(minibatches)),
        )
    }
}

impl BenchConfig {
    /// Parses and checks a sweep file (`name` is for messages).
    ///
    /// # Errors
    /// [`ExperimentError::Config`] naming the file and the problem.
    pub fn parse(text: &str, name: &str) -> Result<Self, ExperimentError> {
        let cfg: BenchConfig = toml::from_str(text)
            .map_err(|e| ExperimentError::Config(format!("{name}: {}", e.message())))?;
        cfg.check()
            .map_err(|e| ExperimentError::Config(format!("{name}: {e}")))?;
        Ok(cfg)
    }

    /// The configuration `--quick` runs.
    pub fn quick(&self) -> Self {
        let q = &self.quick;
        BenchConfig {
            repeats: q.repeats,
            warmup: 1,
            minibatches: q.minibatches,
            models: q.models.clone(),
            sweeps: q.sweeps.clone(),
            traces: q.traces.clone(),
            profile: ProfileSettings {
                repeats: q.profile_repeats,
                ..self.profile.clone()
            },
            target: TargetRun {
                train_samples: q.target_train_samples,
                policies: q.target_policies.clone(),
                ..self.target.clone()
            },
            ..self.clone()
        }
    }

    /// Refuses what cannot run.
    ///
    /// # Errors
    /// A message naming the field.
    pub fn check(&self) -> Result<(), String> {
        if self.repeats < 5 || self.repeats > 1000 {
            return Err(format!(
                "repeats = {}: between 5 (the mean leaves out the fastest and slowest) and 1000",
                self.repeats
            ));
        }
        if self.quick.repeats < 5 || self.quick.repeats > 1000 {
            return Err(format!(
                "quick.repeats = {}: between 5 and 1000",
                self.quick.repeats
            ));
        }
        for (what, v) in [
            ("minibatches", self.minibatches),
            ("quick.minibatches", self.quick.minibatches),
        ] {
            if v == 0 || v > 1000 {
                return Err(format!("{what} = {v}: between 1 and 1000"));
            }
        }
        if self.warmup > 100 {
            return Err(format!("warmup = {}: at most 100", self.warmup));
        }
        if !(self.budget_minutes > 0.0 && self.budget_minutes <= 24.0 * 60.0) {
            return Err(format!(
                "budget_minutes = {}: above 0 and at most 1440",
                self.budget_minutes
            ));
        }
        let p = &self.profile;
        if p.repeats == 0 || p.concurrent == 0 || p.calibrate_microbatches == 0 {
            return Err(
                "profile: repeats, concurrent and calibrate_microbatches must be at least 1".into(),
            );
        }
        // Each count up to it is profiled as that many copies at once, each a worker: the
        // bound `pipe profile --concurrent` keeps, checked before the first is profiled.
        let machine = pipe_stages::limits::Machine::detect();
        pipe_stages::limits::check_local_workers(p.concurrent as u64, &machine)
            .map_err(|e| format!("profile: concurrent: {e}"))?;
        if p.calibration_minibatches == 0 || p.calibration_minibatches > 1000 {
            return Err("profile: calibration_minibatches between 1 and 1000".into());
        }
        for (models, sweeps) in [
            (&self.models, &self.sweeps),
            (&self.quick.models, &self.quick.sweeps),
        ] {
            check_sweeps(models, sweeps)?;
        }
        let t = &self.target;
        if t.microbatch == 0 || t.microbatches == 0 || t.stages == 0 || t.epochs == 0 {
            return Err(
                "target: microbatch, microbatches, stages and epochs must be positive".into(),
            );
        }
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(f64::from(t.lr)) || !positive(t.target_loss) {
            return Err("target: lr and target_loss must be positive and finite".into());
        }
        for p in t.policies.iter().chain(&self.quick.target_policies) {
            p.parse::<Policy>().map_err(|e| format!("target: {e}"))?;
        }
        Ok(())
    }

    /// Every configuration of the sweeps, in order, without repeats (a configuration two
    /// sweeps share runs once, under the first).
    ///
    /// # Errors
    /// An unknown policy name.
    pub fn expand(&self) -> Result<Vec<ConfigSpec>, ExperimentError> {
        let mut out: Vec<ConfigSpec> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for sweep in &self.sweeps {
            let policies: Vec<Policy> = if sweep.policies.iter().any(|p| p == "all") {
                Policy::ALL.to_vec()
            } else {
                sweep
                    .policies
                    .iter()
                    .map(|p| p.parse())
                    .collect::<Result<_, _>>()?
            };
            for model in &sweep.models {
                let Some(entry) = self.models.iter().find(|m| &m.name == model) else {
                    continue;
                };
                for &stages in &sweep.stages {
                    for &replicas in &sweep.replicas {
                        for &m in &sweep.microbatches {
                            for &policy in &policies {
                                for &transport in &sweep.transports {
                                    let mut spec = config_spec(
                                        sweep, entry, policy, stages, replicas, m, transport,
                                    );
                                    spec.minibatches =
                                        entry.minibatches.unwrap_or(self.minibatches);
                                    if seen.insert(spec.id.clone()) {
                                        out.push(spec);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}

/// One point of a sweep, with `M` raised where the policy needs more.
fn config_spec(
    sweep: &Sweep,
    entry: &ModelEntry,
    policy: Policy,
    stages: u32,
    replicas: u32,
    m: u32,
    transport: TransportName,
) -> ConfigSpec {
    let (m, chunks) = match policy {
        Policy::Interleaved => (m.div_ceil(stages) * stages, sweep.chunks),
        Policy::ZbV | Policy::DualPipeV => (m.max(2 * stages), 2),
        _ => (m, 1),
    };
    ConfigSpec {
        id: format!(
            "{}/s{stages}r{replicas}m{m}/{policy}/{}",
            entry.name,
            transport.name()
        ),
        sweep: sweep.name.clone(),
        model: entry.name.clone(),
        microbatch: entry.microbatch,
        policy,
        stages,
        replicas,
        m,
        chunks,
        transport,
        minibatches: 1,
    }
}

fn check_sweeps(models: &[ModelEntry], sweeps: &[Sweep]) -> Result<(), String> {
    for m in models {
        if m.microbatch == 0 || m.microbatch > 65_536 {
            return Err(format!(
                "model {}: microbatch = {}: between 1 and 65536",
                m.name, m.microbatch
            ));
        }
        if m.minibatches.is_some_and(|v| v == 0 || v > 1000) {
            return Err(format!("model {}: minibatches: between 1 and 1000", m.name));
        }
    }
    for s in sweeps {
        let what = |field: &str| format!("sweep {:?}: {field}", s.name);
        for name in &s.models {
            if !models.iter().any(|m| &m.name == name) {
                return Err(format!("{} {name:?} is not in [[models]]", what("model")));
            }
        }
        for (field, list, max) in [
            ("stages", &s.stages, 64),
            ("replicas", &s.replicas, 16),
            ("microbatches", &s.microbatches, 4096),
        ] {
            if list.is_empty() || list.iter().any(|&v| v == 0 || v > max) {
                return Err(format!("{}: every value between 1 and {max}", what(field)));
            }
        }
        if s.chunks == 0 || s.chunks > 16 {
            return Err(format!("{}: between 1 and 16", what("chunks")));
        }
        if s.transports.is_empty() || s.policies.is_empty() {
            return Err(format!(
                "{}: give at least one",
                what("policies and transports")
            ));
        }
        for p in s.policies.iter().filter(|p| *p != "all") {
            p.parse::<Policy>()
                .map_err(|e| format!("{}: {e}", what("policies")))?;
        }
    }
    Ok(())
}
