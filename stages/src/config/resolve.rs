//! Resolution: the settings a user gave, with defaults applied and every value checked, as
//! one [`RunConfig`]. Each check names the setting it refuses.

use pipe_scheduler::planner::buckets::{BucketSize, StageBuckets};
use pipe_scheduler::{Policy, Resolved, ScheduleSpec};

use crate::data::Vocab;
use crate::error::{Result, StageError};
use crate::model::{Model, ModelSpec};
use crate::optim::{LrScheduleKind, OptimizerConfig, OptimizerKind};
use crate::partition::Partition;
use crate::remedy::{LrScaling, Prediction, Remedies};
use crate::transformer::gpt_shape;

use super::run::{Derived, check_delay_correction};
use super::settings::wire_dtype;
use super::*;

/// The model a run's settings choose, as [`TrainSettings::resolve`] goes on with it.
struct ChosenModel {
    name: String,
    spec: ModelSpec,
    vocab: Option<Vocab>,
    dataset: DatasetKind,
    corpus: Option<CorpusSettings>,
    language: Option<crate::transformer::GptShape>,
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
        if self.delay_correction_strength.is_some()
            && optimizer.delay_correction == crate::optim::DelayCorrection::None
        {
            return Err(StageError::Config(
                "--delay-correction-strength sets a delay correction's strength, and this run \
                 has none: give one with --delay-correction"
                    .into(),
            ));
        }
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
        let (language, given) = match &choice {
            ModelChoice::Preset(name) => self.language_shape(name)?,
            ModelChoice::Layers(_) => (None, Default::default()),
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
                let vocab_size = match (given.vocab_size, &corpus, dataset) {
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
                let rows = given.padded_rows(vocab_size).map_err(StageError::Config)?;
                let spec = ModelSpec::gpt(shape, vocab_size, tie).with_padded_vocab(rows);
                (name, spec)
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
    /// `model_config` and the `[gpt2]` settings), with the GPT-2 settings given (the
    /// vocabulary and its padding among them); `None` and no settings for other presets.
    ///
    /// # Errors
    /// [`StageError::Config`] for GPT-2 settings on another model, an incomplete `gpt2`
    /// shape, or an unreadable or unsuitable `config.json`.
    fn language_shape(
        &self,
        name: &str,
    ) -> Result<(
        Option<crate::transformer::GptShape>,
        crate::transformer::Gpt2Shape,
    )> {
        use crate::transformer::{Gpt2Shape, gpt2_from_hf_config, is_gpt2};
        let shaped = self.gpt2.is_some() || self.model_config.is_some();
        if !is_gpt2(name) {
            if shaped {
                return Err(StageError::Config(format!(
                    "--model-config and the GPT-2 shape settings (--n-layer, ...) apply to gpt2 \
                     models, not {name}"
                )));
            }
            return Ok((gpt_shape(name), Gpt2Shape::default()));
        }
        if name != "gpt2" && gpt_shape(name).is_none() {
            return Err(StageError::Model(format!(
                "unknown model preset '{name}' (the GPT-2 presets are gpt2-small and gpt2-tiny, \
                 or gpt2 in the shape --n-layer, --n-head, --n-embd and --n-positions or \
                 --model-config give)"
            )));
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
        Ok((Some(shape), given))
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
        let epochs = self.epochs.unwrap_or(match (dataset, lm) {
            (DatasetKind::Tokens, _) => 1,
            (_, Some(d)) => d.epochs,
            (DatasetKind::Mnist, None) => 6,
            _ => 10,
        });
        crate::limits::check_run_length(epochs, self.steps, self.eval_every)?;
        Ok(epochs)
    }

    /// Applies defaults and checks every value.
    ///
    /// # Errors
    /// [`StageError::Config`] or [`StageError::Model`] naming the first bad value.
    pub fn resolve(self) -> Result<RunConfig> {
        self.resolve_planned(None)
    }

    /// The samples per microbatch and microbatches per update (a language model's defaults
    /// where not given), each at least 1 and within the limits.
    ///
    /// # Errors
    /// [`StageError::Config`] or a limit naming the value.
    fn batch_shape(&self, lm: Option<LanguageDefaults>) -> Result<(usize, usize)> {
        let at_least_one = |given: Option<usize>, default: usize, what: &str| match given {
            Some(0) => Err(StageError::Config(format!("{what} must be at least 1"))),
            given => Ok(given.unwrap_or(default)),
        };
        let microbatch_size = at_least_one(
            self.microbatch_size,
            lm.map_or(64, |d| d.microbatch_size),
            "microbatch size",
        )?;
        crate::limits::check_count(
            "--microbatch-size",
            microbatch_size as u64,
            crate::limits::MAX_TENSOR_ELEMENTS,
            "a microbatch is one tensor",
        )?;
        let microbatches = at_least_one(
            self.microbatches,
            lm.map_or(1, |d| d.microbatches),
            "microbatches per update",
        )?;
        pipe_scheduler::limits::check_microbatches(microbatches as u64)?;
        Ok((microbatch_size, microbatches))
    }

    /// The base learning rate: given, or the optimizer's default (a language model's, Lion's
    /// a tenth of it); positive and finite.
    ///
    /// # Errors
    /// [`StageError::Config`] for a rate that is not.
    fn learning_rate(&self, kind: OptimizerKind, lm: Option<LanguageDefaults>) -> Result<f32> {
        let lr = self.lr.unwrap_or(match (kind, lm) {
            (OptimizerKind::Sgd, _) => 0.05,
            (OptimizerKind::Lion, Some(d)) => d.lr / LION_LR_DIVISOR,
            (OptimizerKind::Lion, None) => 1e-3 / LION_LR_DIVISOR,
            (_, Some(d)) => d.lr,
            _ => 1e-3,
        });
        if !(lr > 0.0 && lr.is_finite()) {
            return Err(StageError::Config(format!(
                "learning rate must be positive, got {lr}"
            )));
        }
        Ok(lr)
    }

    /// Whether these settings ask for a pipeline: more than one stage, replica or chunk, or
    /// any setting only a pipeline has (a schedule, a partition, a staleness remedy).
    fn asks_for_pipeline(&self, stages: usize, replicas: &[u32], chunks: u32) -> bool {
        stages > 1
            || replicas.iter().any(|&r| r > 1)
            || chunks > 1
            || self.schedule.is_some()
            || self.partition.is_some()
            || self.sync_warmup.is_some()
            || self.lr_scaling.is_some()
            || self.weight_prediction.is_some()
    }

    /// Refuses a setting given to a run in which it would do nothing, naming what it applies
    /// to: the one list of such settings (others needing a flag beside them are refused where
    /// they are read: `--checkpoint-every`, `--delay-correction-strength`, `--rejoin`).
    ///
    /// # Errors
    /// [`StageError::Config`] naming the first such setting.
    fn check_given_settings_apply(
        &self,
        kind: OptimizerKind,
        pipelined: bool,
        (stages, replicated): &(usize, bool),
    ) -> Result<()> {
        use OptimizerKind::{Adam, Adamw, Lion, Muon, Sgd};
        let takes = |kinds: &[OptimizerKind]| kinds.contains(&kind);
        let names = |kinds: &[OptimizerKind]| {
            kinds
                .iter()
                .map(|k| k.name())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let optimizer_settings: [(&str, bool, &[OptimizerKind]); 5] = [
            ("--momentum", self.momentum.is_some(), &[Sgd, Muon]),
            ("--nesterov", self.nesterov.is_some(), &[Sgd, Muon]),
            ("--beta1", self.beta1.is_some(), &[Adam, Adamw, Muon, Lion]),
            ("--beta2", self.beta2.is_some(), &[Adam, Adamw, Muon, Lion]),
            ("--eps", self.eps.is_some(), &[Adam, Adamw, Muon]),
        ];
        for (flag, given, kinds) in optimizer_settings {
            if given && !takes(kinds) {
                return Err(StageError::Config(format!(
                    "{flag} applies to the optimizers {}; this run's is {}",
                    names(kinds),
                    kind.name()
                )));
            }
        }
        let layout_settings = [
            (
                "--allreduce-bucket-mb",
                self.allreduce_bucket_mb.is_some(),
                *replicated,
                "a stage with two or more replicas (--replicas)",
            ),
            (
                "--allreduce-dtype",
                self.allreduce_dtype.is_some(),
                *replicated,
                "a stage with two or more replicas (--replicas)",
            ),
            (
                "--wire-dtype",
                self.wire_dtype.is_some(),
                pipelined && *stages > 1,
                "activations sent between stages (--stages 2 or more)",
            ),
            (
                "--transport",
                self.transport.is_some(),
                pipelined,
                "a pipeline's workers (--stages, --replicas or --schedule)",
            ),
            (
                "--placement",
                self.placement.is_some(),
                pipelined,
                "a pipeline's workers (--stages, --replicas or --schedule)",
            ),
            (
                "--stall-timeout",
                self.stall_timeout.is_some(),
                pipelined,
                "a pipeline's workers (--stages, --replicas or --schedule)",
            ),
            (
                "--warmup-steps",
                self.warmup_steps.is_some(),
                self.lr_schedule != Some(LrScheduleKind::Constant),
                "a learning-rate schedule with a warm-up (--lr-schedule warmup or cosine)",
            ),
        ];
        for (flag, given, applies, what) in layout_settings {
            if given && !applies {
                return Err(StageError::Config(format!(
                    "{flag} applies to {what}, and this run has none"
                )));
            }
        }
        Ok(())
    }

    /// The stall timeout: given or [`DEFAULT_STALL_TIMEOUT`], above 0 and at most a week.
    ///
    /// # Errors
    /// [`StageError::Config`] naming the value.
    fn checked_stall_timeout(&self) -> Result<std::time::Duration> {
        let stall = self.stall_timeout.unwrap_or(DEFAULT_STALL_TIMEOUT);
        if !(stall.is_finite() && stall > 0.0 && stall <= MAX_STALL_TIMEOUT) {
            return Err(StageError::Config(format!(
                "stall timeout must be above 0 and at most {MAX_STALL_TIMEOUT} seconds (a week), got {stall}"
            )));
        }
        Ok(std::time::Duration::from_secs_f64(stall))
    }

    /// [`TrainSettings::resolve`] with the layout a plan settled (`--workers`) in place of the
    /// settings' stages, replicas, schedule and partition. The model is chosen before the
    /// layout is (a plan made for the default model keeps it, whatever stage count it picked);
    /// the layout's own defaults (an asynchronous layout's SGD momentum) follow the plan.
    ///
    /// # Errors
    /// As [`TrainSettings::resolve`].
    pub fn resolve_planned(self, planned: Option<PlannedLayout>) -> Result<RunConfig> {
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
        let (microbatch_size, microbatches) = self.batch_shape(lm)?;
        let kind = self
            .optimizer
            .unwrap_or(lm.map_or(OptimizerKind::Sgd, |d| d.optimizer));
        let lr = self.learning_rate(kind, lm)?;
        let (stages, replicas) = match &planned {
            Some(p) => (p.replicas.len(), p.replicas.clone()),
            None => self.layout()?,
        };
        let chunks = self.chunks.unwrap_or(1);
        let pipelined = planned.is_some() || self.asks_for_pipeline(stages, &replicas, chunks);
        let schedule = match &planned {
            Some(p) => p.policy,
            None => self.policy(pipelined, lm)?,
        };
        let layout_spec = ScheduleSpec::new(schedule, stages as u32, microbatches as u32)
            .with_replicas(replicas.clone())
            .with_chunks(chunks);
        let resolved = layout_spec.resolve();
        let layout = resolved.as_ref().map_err(ToString::to_string);
        self.check_given_settings_apply(kind, pipelined, &stages_and_replicas(stages, &replicas))?;
        // GPT-2 trainers clip the global gradient norm to 1.0.
        let clip_default = crate::transformer::is_gpt2(&model_name).then_some(GPT2_GRAD_CLIP);
        let optimizer = self.optimizer_config(kind, lm, resolved.as_ref().ok(), clip_default)?;
        let partition = match (planned, &self.partition) {
            (Some(p), _) => {
                PartitionChoice::Given(Partition::new(p.partition.ranges().to_vec(), model.len())?)
            }
            (None, Some(text)) => PartitionChoice::parse(text, model.len())?,
            (None, None) => PartitionChoice::Measured,
        };
        let recompute = self.recompute.clone().unwrap_or_default();
        if let Ok(layout) = &resolved {
            recompute
                .check_stages(layout.layout.stages())
                .map_err(StageError::Config)?;
        }
        let backend = self.backend_kind()?;
        let (placement, transport) =
            Placement::resolve(self.placement.as_deref(), self.transport.as_deref())?;
        let wire = wire_dtype(self.wire_dtype.as_deref())?;
        let remedies = Self::remedies(
            self.sync_warmup,
            self.lr_scaling.as_deref(),
            self.weight_prediction.as_deref(),
            layout.as_ref().copied().map_err(String::as_str),
        )?;
        check_delay_correction(&optimizer, schedule, Some(remedies.prediction))?;
        let synthetic = self.synthetic.clone().unwrap_or_default();
        synthetic.check()?;
        let stall_timeout = self.checked_stall_timeout()?;
        let (bucket_size, stage_buckets, bucket_origin) = bucket_settings(
            self.allreduce_bucket_mb.as_ref(),
            resolved.as_ref().ok().map(|l| l.layout.stages() as usize),
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
            stall_timeout,
            bucket_size,
            stage_buckets,
            bucket_origin,
            allreduce_wire,
            resolved: Derived(resolved),
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
) -> Result<(BucketSize, StageBuckets, BucketOrigin)> {
    let Some(sizes) = given else {
        return Ok((
            DEFAULT_BUCKET_SIZE,
            StageBuckets::default(),
            BucketOrigin::Default,
        ));
    };
    if let [size] = sizes.sizes() {
        return Ok((*size, StageBuckets::default(), BucketOrigin::Given));
    }
    let sizes = sizes.sizes();
    if let Some(stages) = stages.filter(|&s| s != sizes.len()) {
        return Err(StageError::Config(format!(
            "--allreduce-bucket-mb gives {} sizes for {stages} stages (give one, or one per stage)",
            sizes.len()
        )));
    }
    Ok((
        DEFAULT_BUCKET_SIZE,
        StageBuckets::new(sizes.to_vec()),
        BucketOrigin::Given,
    ))
}

/// The stage count, and whether some stage has two or more replicas.
fn stages_and_replicas(stages: usize, replicas: &[u32]) -> (usize, bool) {
    (stages, replicas.iter().any(|&r| r >= 2))
}
