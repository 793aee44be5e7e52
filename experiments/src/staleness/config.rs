//! The staleness experiment's configuration: a TOML file read once here and expanded into the
//! list of runs ([`Matrix`]). Everything the runs share (model, data, epochs, samples per
//! update) is written once; the matrix is policies x stages x optimizers x seeds, then the
//! remedies on chosen asynchronous policies, then the delayed data-parallel baseline.

use pipe_scheduler::Policy;
use pipe_stages::delayed::{Delay, DelayedOptions};
use pipe_stages::optim::{DecayGroups, OptimizerKind};
use pipe_stages::remedy::{LrScaling, Prediction, Remedies};
use serde::{Deserialize, Serialize};

use crate::ExperimentError;

/// The experiment file (see `experiments/staleness/mnist.toml`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StalenessConfig {
    /// Model preset (`mlp-784-128x8-10`, `gpt-mini`).
    pub model: String,
    /// Dataset (`mnist`, `tinyshakespeare`).
    pub dataset: String,
    /// Training samples used (the first ones of the training set; 0: all).
    #[serde(default)]
    pub train_samples: usize,
    /// Test samples used (0: all).
    #[serde(default)]
    pub test_samples: usize,
    /// Passes over the training samples.
    pub epochs: u64,
    /// Samples per update, the same in every run.
    pub minibatch: usize,
    /// Seeds (weights and data order).
    pub seeds: Vec<u64>,
    /// Stage counts (1 runs `sequential` only).
    pub stages: Vec<u32>,
    /// Policies.
    pub policies: Vec<String>,
    /// Target of the training loss (mean of the last [`StalenessConfig::target_window`]
    /// updates) for updates and time to target.
    pub target_loss: f64,
    /// Updates the training loss is averaged over for the target.
    #[serde(default = "default_window")]
    pub target_window: usize,
    /// Compute threads per worker.
    #[serde(default = "one")]
    pub threads: usize,
    /// Optimizers.
    pub optimizers: Vec<OptimizerChoice>,
    /// Remedies for the pipelines.
    pub remedies: RemedyMatrix,
    /// The delayed data-parallel baseline.
    pub delayed: DelayedMatrix,
    /// What `--quick` changes.
    pub quick: Quick,
}

fn default_window() -> usize {
    50
}

fn one() -> usize {
    1
}

/// One optimizer of the matrix.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerChoice {
    /// Name in reports.
    pub name: String,
    /// `sgd`, `adam`, `adamw`, `muon` or `lion`.
    pub kind: OptimizerKind,
    /// Base learning rate (cosine schedule with a 5% warm-up).
    pub lr: f32,
    /// SGD's or Muon's momentum (0 when not given: give Muon its 0.95).
    #[serde(default)]
    pub momentum: f32,
    /// Weight decay.
    #[serde(default)]
    pub weight_decay: f32,
    /// The parameters it applies to: `all` when not given (every committed study was run
    /// that way, before `pipe train`'s language models defaulted to `matrices`).
    #[serde(default)]
    pub weight_decay_groups: DecayGroups,
}

/// The remedies part of the matrix: each variant on each of `policies` at `stages`, for every
/// optimizer and seed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemedyMatrix {
    /// Stage count.
    pub stages: u32,
    /// Asynchronous policies.
    pub policies: Vec<String>,
    /// Remedies.
    pub variants: Vec<RemedyVariant>,
}

/// One remedy (or combination) of a pipeline run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemedyVariant {
    /// Updates of synchronous warm-up.
    #[serde(default)]
    pub sync_warmup: u64,
    /// Learning-rate scaling (`staleness`, `pipemare:K`).
    #[serde(default)]
    pub lr_scaling: Option<String>,
    /// Weight prediction (`discrepancy[:DECAY]` for pipedream-nostash, `lookahead[:DECAY]`
    /// for the stashing policies); a variant whose prediction does not apply to a policy is
    /// skipped for it.
    #[serde(default)]
    pub weight_prediction: Option<String>,
    /// SGD momentum lowered by the delay (`pipe train`'s default for asynchronous policies).
    #[serde(default)]
    pub compensate_momentum: bool,
    /// Replicas of every stage (the same samples per update, cut into as many more
    /// microbatches): not a remedy but the layout that data-parallel options need.
    #[serde(default = "one_replica")]
    pub replicas: u32,
    /// The precision the replicas' all-reduce sends in (`bf16`; default f32).
    #[serde(default)]
    pub allreduce_dtype: Option<String>,
    /// A delay correction around the optimizer's step (`error-feedback`), with its strength
    /// (`pipe train --delay-correction`, `--delay-correction-strength`).
    #[serde(default)]
    pub delay_correction: Option<pipe_stages::optim::DelayCorrection>,
    /// The correction's strength (its default when absent).
    #[serde(default)]
    pub delay_correction_strength: Option<f32>,
}

fn one_replica() -> u32 {
    1
}

/// The delayed data-parallel baseline: each delay for every optimizer and seed, then each
/// remedy at `remedy_delay`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelayedMatrix {
    /// Delays: `N` (fixed) or `uniform:N`.
    pub delays: Vec<String>,
    /// The delay the remedies are tried at.
    pub remedy_delay: String,
    /// Remedies.
    pub remedies: Vec<DelayedRemedy>,
}

/// One classic remedy of asynchronous data parallelism.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelayedRemedy {
    /// Multiplies the learning rate.
    #[serde(default)]
    pub lr_factor: Option<f32>,
    /// Drop gradients older than this.
    #[serde(default)]
    pub drop_older_than: Option<u32>,
    /// Scale the learning rate by `1 / (1 + age)`.
    #[serde(default)]
    pub age_scaling: bool,
    /// Samples per update instead of the experiment's.
    #[serde(default)]
    pub minibatch: Option<usize>,
    /// Updates without delay at the start.
    #[serde(default)]
    pub warmup: u64,
}

/// What `--quick` changes: a reduced matrix that checks the pipeline end to end.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quick {
    /// Training samples.
    pub train_samples: usize,
    /// Test samples.
    pub test_samples: usize,
    /// Epochs.
    pub epochs: u64,
    /// Seeds.
    pub seeds: Vec<u64>,
    /// Stage counts.
    pub stages: Vec<u32>,
}

/// Which family a run belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// A pipeline policy (remedies included).
    Pipeline,
    /// Delayed data-parallel SGD.
    Delayed,
}

/// One run of the matrix, fully specified.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunSpec {
    /// Unique name (file names, CSV rows).
    pub id: String,
    /// Family.
    pub family: Family,
    /// Policy (pipelines) or `delayed` with its delay (`delay:4`, `delay:uniform:7`).
    pub policy: String,
    /// Stages (1 for the delayed baseline).
    pub stages: u32,
    /// Optimizer's name.
    pub optimizer: String,
    /// Seed.
    pub seed: u64,
    /// Remedy label (`none` when none).
    pub remedy: String,
    /// Samples per microbatch.
    pub microbatch_size: usize,
    /// Microbatches per update.
    pub microbatches: usize,
    /// Pipeline remedies.
    pub remedies: Remedies,
    /// Lowered SGD momentum.
    #[serde(default)]
    pub compensate_momentum: bool,
    /// Delayed-baseline options.
    pub delayed: Option<DelayedOptions>,
    /// Replicas of every stage (pipelines).
    #[serde(default = "one_replica")]
    pub replicas: u32,
    /// The precision of the replicas' all-reduce (`bf16`), when not f32.
    #[serde(default)]
    pub allreduce_dtype: Option<String>,
    /// The delay correction (`error-feedback`), when there is one.
    #[serde(default)]
    pub delay_correction: Option<pipe_stages::optim::DelayCorrection>,
    /// Its strength, when not the default.
    #[serde(default)]
    pub delay_correction_strength: Option<f32>,
    /// Learning-rate factor (delayed baseline's lower-rate remedy).
    #[serde(default = "unit")]
    pub lr_factor: f32,
}

fn unit() -> f32 {
    1.0
}

impl StalenessConfig {
    /// Parses the file's text; `name` names it in errors.
    ///
    /// # Errors
    /// [`ExperimentError::Config`] with the parser's message.
    pub fn parse(text: &str, name: &str) -> Result<Self, ExperimentError> {
        let cfg: Self = toml::from_str(text).map_err(|e| {
            let msg = e.to_string();
            ExperimentError::Config(format!(
                "{name}: {}",
                msg.split_whitespace().collect::<Vec<_>>().join(" ")
            ))
        })?;
        cfg.matrix().map_err(|e| match e {
            ExperimentError::Config(m) => ExperimentError::Config(format!("{name}: {m}")),
            other => other,
        })?;
        Ok(cfg)
    }

    /// The reduced configuration of `--quick`.
    pub fn quick(&self) -> Self {
        let q = &self.quick;
        StalenessConfig {
            train_samples: q.train_samples,
            test_samples: q.test_samples,
            epochs: q.epochs,
            seeds: q.seeds.clone(),
            stages: q.stages.clone(),
            remedies: RemedyMatrix {
                stages: q.stages.iter().copied().max().unwrap_or(1),
                ..self.remedies.clone()
            },
            ..self.clone()
        }
    }

    /// Refuses values no run can use, before any run: an empty list of seeds, stage counts,
    /// policies or optimizers; a count of 0; a target loss that is not finite and above 0; a
    /// learning rate that is not; and a list entry given twice (two runs of one id would write
    /// over each other's records and ledgers).
    ///
    /// # Errors
    /// A message naming the field.
    pub fn check(&self) -> Result<(), String> {
        for (field, empty) in [
            ("seeds", self.seeds.is_empty()),
            ("stages", self.stages.is_empty()),
            ("policies", self.policies.is_empty()),
            ("optimizers", self.optimizers.is_empty()),
        ] {
            if empty {
                return Err(format!("{field} is empty: list at least one"));
            }
        }
        if self.minibatch == 0 || self.epochs == 0 || self.target_window == 0 {
            return Err("minibatch, epochs and target_window must be at least 1".into());
        }
        // A window is updates of one run, which are bounded as a run's steps are.
        if self.target_window as u64 > pipe_stages::limits::MAX_STEPS {
            return Err(format!(
                "target_window = {}: at most {} updates",
                self.target_window,
                pipe_stages::limits::MAX_STEPS
            ));
        }
        if self.stages.contains(&0) {
            return Err("stages must each be at least 1".into());
        }
        if !(self.target_loss.is_finite() && self.target_loss > 0.0) {
            return Err(format!(
                "target_loss = {}: must be finite and above 0",
                self.target_loss
            ));
        }
        for o in &self.optimizers {
            let lr = f64::from(o.lr);
            if !(lr.is_finite() && lr > 0.0) {
                return Err(format!(
                    "optimizer {}: lr = {lr}: must be finite and above 0",
                    o.name
                ));
            }
        }
        for o in &self.optimizers {
            optimizer_name(&o.name)?;
        }
        let names: Vec<&String> = self.optimizers.iter().map(|o| &o.name).collect();
        once("seeds", &self.seeds)?;
        once("stages", &self.stages)?;
        once("policies", &self.policies)?;
        once("optimizers' names", &names)?;
        once("remedies.policies", &self.remedies.policies)?;
        once("delayed.delays", &self.delayed.delays)?;
        once("quick.seeds", &self.quick.seeds)?;
        once("quick.stages", &self.quick.stages)
    }

    /// Runs in one experiment: a thousand is days of training at this machine's scale.
    pub const MAX_RUNS: usize = 1000;

    /// Every run, in the order they run: pipelines, remedies, the delayed baseline.
    ///
    /// # Errors
    /// [`ExperimentError::Config`] for unknown policies, a minibatch that the stage count
    /// does not divide, a malformed delay or remedy, or an empty list.
    pub fn matrix(&self) -> Result<Vec<RunSpec>, ExperimentError> {
        let bad = |m: String| Err(ExperimentError::Config(m));
        self.check().map_err(ExperimentError::Config)?;
        if self.remedies.stages < 2 && !self.remedies.policies.is_empty() {
            return bad(format!(
                "remedies.stages is {}: the remedies apply to asynchronous pipelines, of 2 \
                 stages or more",
                self.remedies.stages
            ));
        }
        // The compute threads every run starts, checked as `pipe train` checks its own.
        let machine = pipe_stages::limits::Machine::detect();
        pipe_stages::limits::check_threads(self.threads as u64, &machine)?;
        let mut runs = Vec::new();
        for o in &self.optimizers {
            let opt = o.name.as_str();
            for &seed in &self.seeds {
                for &stages in &self.stages {
                    for name in &self.policies {
                        let policy = parse_policy(name)?;
                        if (stages == 1) != (policy == Policy::Sequential) {
                            continue;
                        }
                        runs.push(self.pipeline_run(policy, stages, opt, seed, None)?);
                    }
                }
                for name in &self.remedies.policies {
                    let policy = parse_policy(name)?;
                    if policy.is_flush() {
                        return bad(format!(
                            "remedies apply to asynchronous policies, not {name}"
                        ));
                    }
                    for v in &self.remedies.variants {
                        // Only SGD has a momentum to lower; each prediction fits one kind
                        // of policy; a delay correction runs where its own rules let it
                        // (`pipe train` refuses the rest).
                        let prediction = prediction_of(v)?;
                        let correction = v.delay_correction.unwrap_or_default();
                        let predicts = prediction != Prediction::None;
                        if v.compensate_momentum && o.kind != OptimizerKind::Sgd
                            || !prediction_fits(prediction, policy)
                            || correction.check_fits(policy, predicts).is_err()
                        {
                            continue;
                        }
                        let run =
                            self.pipeline_run(policy, self.remedies.stages, opt, seed, Some(v))?;
                        runs.push(run);
                    }
                }
                self.delayed_runs(opt, seed, &mut runs)?;
            }
        }
        if runs.is_empty() {
            return bad("the matrix has no runs (stage count 1 runs only `sequential`)".into());
        }
        // Each run keeps its record and ledger under its id: two runs of one id would write
        // over each other's files.
        let mut ids = std::collections::HashSet::new();
        if let Some(twice) = runs.iter().find(|r| !ids.insert(r.id.as_str())) {
            return bad(format!(
                "run {} comes twice in the matrix: a seed, stage count, policy, optimizer, \
                 remedy or delay is listed twice",
                twice.id
            ));
        }
        let max = Self::MAX_RUNS;
        if runs.len() > max {
            return bad(format!(
                "the experiment has {} runs, over the limit of {max} (each is a training \
                 run; split it into several experiments)",
                runs.len()
            ));
        }
        Ok(runs)
    }

    /// A pipeline run: flush schedules and 2BW cut the minibatch into one microbatch per
    /// stage (2BW needs at least `stages - 1` per update; a flush schedule without several
    /// microbatches would not pipeline at all); PipeDream, its no-stash variant and vertical
    /// sync update after every microbatch, as PipeDream does.
    fn pipeline_run(
        &self,
        policy: Policy,
        stages: u32,
        opt: &str,
        seed: u64,
        remedy: Option<&RemedyVariant>,
    ) -> Result<RunSpec, ExperimentError> {
        let v = remedy.cloned().unwrap_or_default();
        let m = match policy {
            Policy::PipeDream | Policy::PipeDreamNoStash | Policy::VerticalSync => 1,
            _ => stages as usize,
        };
        let r = v.replicas.max(1) as usize;
        if self.minibatch % (m * r) != 0 {
            return Err(ExperimentError::Config(format!(
                "minibatch {} does not split into {m} microbatches for each of {r} replicas for \
                 {policy} at {stages} stages",
                self.minibatch
            )));
        }
        let remedies = Remedies {
            sync_warmup: v.sync_warmup,
            lr_scaling: match &v.lr_scaling {
                Some(t) => t.parse().map_err(ExperimentError::Config)?,
                None => LrScaling::None,
            },
            prediction: prediction_of(&v)?,
        };
        let mut label = remedies.label();
        let mut extra = Vec::new();
        if v.compensate_momentum {
            extra.push("momentum-compensated".to_string());
        }
        if r > 1 {
            extra.push(format!("replicas:{r}"));
        }
        if let Some(d) = &v.allreduce_dtype {
            extra.push(format!("allreduce:{d}"));
        }
        if let Some(c) = v.delay_correction {
            let c = c.name();
            extra.push(match v.delay_correction_strength {
                Some(k) => format!("{c}:{k}"),
                None => c.to_string(),
            });
        }
        if !extra.is_empty() {
            let extra = extra.join("+");
            label = if remedies.is_none() {
                extra
            } else {
                format!("{label}+{extra}")
            };
        }
        Ok(RunSpec {
            id: format!("{policy}-s{stages}-{opt}-seed{seed}-{label}").replace(':', "_"),
            family: Family::Pipeline,
            policy: policy.name().into(),
            stages,
            optimizer: opt.into(),
            seed,
            remedy: label,
            microbatch_size: self.minibatch / (m * r),
            microbatches: m,
            remedies,
            compensate_momentum: v.compensate_momentum,
            delayed: None,
            replicas: r as u32,
            allreduce_dtype: v.allreduce_dtype.clone(),
            delay_correction: v.delay_correction,
            delay_correction_strength: v.delay_correction_strength,
            lr_factor: 1.0,
        })
    }

    fn delayed_runs(
        &self,
        opt: &str,
        seed: u64,
        runs: &mut Vec<RunSpec>,
    ) -> Result<(), ExperimentError> {
        let plain = DelayedRemedy::default();
        let mut cases: Vec<(&str, &DelayedRemedy)> = self
            .delayed
            .delays
            .iter()
            .map(|d| (d.as_str(), &plain))
            .collect();
        cases.extend(
            self.delayed
                .remedies
                .iter()
                .map(|r| (self.delayed.remedy_delay.as_str(), r)),
        );
        for (delay_text, r) in cases {
            let delay = parse_delay(delay_text)?;
            let minibatch = r.minibatch.unwrap_or(self.minibatch);
            if minibatch == 0 {
                return Err(ExperimentError::Config("a remedy's minibatch is 0".into()));
            }
            let opts = DelayedOptions {
                delay,
                drop_older_than: r.drop_older_than,
                age_scaling: r.age_scaling,
                warmup: r.warmup,
            };
            let label = delayed_label(r, minibatch != self.minibatch);
            runs.push(RunSpec {
                id: format!("delay{delay_text}-{opt}-seed{seed}-{label}").replace(':', "_"),
                family: Family::Delayed,
                policy: format!("delay:{delay_text}"),
                stages: 1,
                optimizer: opt.into(),
                seed,
                remedy: label,
                microbatch_size: minibatch,
                microbatches: 1,
                remedies: Remedies::default(),
                compensate_momentum: false,
                delayed: Some(opts),
                lr_factor: r.lr_factor.unwrap_or(1.0),
                replicas: 1,
                allreduce_dtype: None,
                delay_correction: None,
                delay_correction_strength: None,
            });
        }
        Ok(())
    }
}

/// `Err` unless `name` can stand in a file name as it is: run ids, ledgers and plots are
/// named after the optimizers, so a `/` or a leading `.` would write outside `--out`.
fn optimizer_name(name: &str) -> Result<(), String> {
    let fits = |c: char| c.is_ascii_alphanumeric() || "_.+-".contains(c);
    if name.is_empty() || name.len() > 64 || name.starts_with('.') || !name.chars().all(fits) {
        return Err(format!(
            "optimizer name {name:?}: use 1 to 64 letters, digits, '_', '.', '+' or '-', \
             not starting with '.' (the name goes into file names)"
        ));
    }
    Ok(())
}

/// `Err` unless the run id `id` is one file name ([`pipe_stages::outputs::is_plain_name`]),
/// not starting with `.`, at most 255 bytes (its ledger and record are written under
/// `--out` by that name).
pub(super) fn run_id_fits(id: &str) -> Result<(), String> {
    let plain = pipe_stages::outputs::is_plain_name(id);
    if !plain || id.len() > 255 || id.starts_with('.') {
        return Err(format!(
            "run id {id:?} is no file name: no '/', '\\' or NUL, not starting with '.', \
             1 to 255 bytes"
        ));
    }
    Ok(())
}

/// `Err` naming `field` when `list` holds an entry twice.
fn once<T: PartialEq + std::fmt::Debug>(field: &str, list: &[T]) -> Result<(), String> {
    for (i, v) in list.iter().enumerate() {
        if list[..i].contains(v) {
            return Err(format!("{field} lists {v:?} twice"));
        }
    }
    Ok(())
}

/// A delayed-baseline remedy's name.
fn delayed_label(r: &DelayedRemedy, minibatch: bool) -> String {
    let mut parts = Vec::new();
    if let Some(f) = r.lr_factor {
        parts.push(format!("lr-x{f}"));
    }
    if let Some(k) = r.drop_older_than {
        parts.push(format!("drop-older-than-{k}"));
    }
    if r.age_scaling {
        parts.push("age-scaling".into());
    }
    if minibatch {
        parts.push(format!("minibatch-{}", r.minibatch.unwrap_or(0)));
    }
    if r.warmup > 0 {
        parts.push(format!("warmup-{}", r.warmup));
    }
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join("+")
    }
}

/// `v`'s weight prediction, parsed (none when it names none).
fn prediction_of(v: &RemedyVariant) -> Result<Prediction, ExperimentError> {
    match &v.weight_prediction {
        Some(text) => text.parse().map_err(ExperimentError::Config),
        None => Ok(Prediction::None),
    }
}

/// True when the weight prediction `p` applies to `policy`.
fn prediction_fits(p: Prediction, policy: Policy) -> bool {
    let nostash = policy == Policy::PipeDreamNoStash;
    match p {
        Prediction::None => true,
        Prediction::Discrepancy { .. } => nostash,
        Prediction::LookAhead { .. } => !nostash,
    }
}

fn parse_policy(name: &str) -> Result<Policy, ExperimentError> {
    name.parse()
        .map_err(|e: pipe_scheduler::ScheduleError| ExperimentError::Config(e.to_string()))
}

/// `N` or `uniform:N`.
fn parse_delay(text: &str) -> Result<Delay, ExperimentError> {
    let bad = || ExperimentError::Config(format!("delay '{text}' is not N or uniform:N"));
    match text.strip_prefix("uniform:") {
        Some(n) => Ok(Delay::Uniform {
            max: n.parse().map_err(|_| bad())?,
        }),
        None => Ok(Delay::Fixed {
            updates: text.parse().map_err(|_| bad())?,
        }),
    }
}
