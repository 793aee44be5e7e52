//! Running the matrix: each [`RunSpec`] becomes a `pipe train` configuration, runs through the
//! pipelined executor (or the delayed data-parallel trainer), and leaves a [`RunRecord`]: the
//! loss of every update, the test figures of every epoch, updates and seconds to the target,
//! the measured delay per stage from the version ledger, and the ledger itself (written as
//! gzipped CSV beside the results). A run that diverges is a result, not an error: it is
//! recorded with the update where it stopped.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use pipe_kernels::CpuBackend;
use pipe_stages::config::{DatasetKind, ModelChoice, RunConfig, TrainSettings};
use pipe_stages::data::Splits;
use pipe_stages::delayed::train_delayed;
use pipe_stages::optim::OptimizerKind;
use pipe_stages::pipeline::Observer;
use pipe_stages::pipeline::{LedgerEntry, PipelineTrainOptions, train_pipelined};
use pipe_stages::train::{EpochStats, StepStats};
use serde::{Deserialize, Serialize};

use super::config::{Family, RunSpec, StalenessConfig};
use crate::ExperimentError;

/// One epoch's evaluation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochRecord {
    /// Epoch, from 1.
    pub epoch: u64,
    /// Mean training loss over the epoch.
    pub train_loss: f64,
    /// Test loss.
    pub test_loss: f64,
    /// Test accuracy in `[0, 1]`.
    pub test_accuracy: f64,
    /// Seconds since the run began.
    pub elapsed_s: f64,
}

/// One stage's measured delays over a run, from the version ledger.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageDelay {
    /// Stage.
    pub stage: u32,
    /// Mean updates between the forward's weights and the update its gradient went into.
    pub forward_mean: f64,
    /// The most.
    pub forward_max: u64,
    /// The same for the backward's weights.
    pub backward_mean: f64,
    /// The most.
    pub backward_max: u64,
}

/// What one run leaves.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// The run.
    pub spec: RunSpec,
    /// Mean training loss of every update, in order.
    pub losses: Vec<f32>,
    /// Every epoch's evaluation.
    pub epochs: Vec<EpochRecord>,
    /// The update at which the loss or a gradient stopped being finite.
    pub diverged_at: Option<u64>,
    /// Updates until the training loss, averaged over the target window, reached the target.
    pub updates_to_target: Option<u64>,
    /// Seconds of training until then, on this machine.
    pub seconds_to_target: Option<f64>,
    /// Per stage, the measured delays (pipelines; the delayed baseline has one stage).
    pub stage_delays: Vec<StageDelay>,
    /// Gradients dropped (delayed baseline).
    pub dropped: u64,
    /// Wall seconds of the run, evaluation included.
    pub wall_s: f64,
}

impl RunRecord {
    /// Final test accuracy (0 for a run that diverged before its first evaluation... or at
    /// all: a diverged run's weights are not usable).
    pub fn final_accuracy(&self) -> f64 {
        if self.diverged_at.is_some() {
            return f64::NAN;
        }
        self.epochs.last().map_or(f64::NAN, |e| e.test_accuracy)
    }

    /// Final test loss (NaN when diverged).
    pub fn final_test_loss(&self) -> f64 {
        if self.diverged_at.is_some() {
            return f64::NAN;
        }
        self.epochs.last().map_or(f64::NAN, |e| e.test_loss)
    }
}

/// Collects a run's updates and epochs, and finds when the loss reaches the target.
pub(crate) struct Recorder {
    target: f64,
    window: usize,
    pub(crate) losses: Vec<f32>,
    pub(crate) epochs: Vec<EpochRecord>,
    window_sum: f64,
    /// (update, seconds) when the mean loss over the window first reached the target.
    pub(crate) reached: Option<(u64, f64)>,
}

impl Recorder {
    /// Watches for the training loss, averaged over `window` updates, at or below `target`.
    pub(crate) fn new(target: f64, window: usize) -> Self {
        Recorder {
            target,
            window,
            losses: Vec::new(),
            epochs: Vec::new(),
            window_sum: 0.0,
            reached: None,
        }
    }
}

impl Observer for Recorder {
    fn on_step(&mut self, s: &StepStats) -> pipe_stages::Result<()> {
        // JSON has no NaN or infinity; a run whose loss stops being finite is recorded as
        // diverged by its error instead.
        if !s.loss.is_finite() {
            return Ok(());
        }
        self.losses.push(s.loss as f32);
        self.window_sum += s.loss;
        let n = self.losses.len();
        if n > self.window {
            self.window_sum -= f64::from(self.losses[n - 1 - self.window]);
        }
        if self.reached.is_none()
            && n >= self.window
            && self.window_sum / self.window as f64 <= self.target
        {
            self.reached = Some((s.step, s.elapsed_s));
        }
        Ok(())
    }

    fn on_epoch(&mut self, e: &EpochStats) -> pipe_stages::Result<()> {
        self.epochs.push(EpochRecord {
            epoch: e.epoch,
            train_loss: e.train_loss,
            test_loss: e.test_loss,
            test_accuracy: e.test_accuracy,
            elapsed_s: e.elapsed_s,
        });
        Ok(())
    }
}

/// The experiment's data: the dataset, cut to the configured sample counts.
///
/// # Errors
/// Unknown dataset or unreadable data.
pub fn load(cfg: &StalenessConfig) -> Result<Splits, ExperimentError> {
    let runs = cfg.matrix()?;
    let first = runs
        .first()
        .ok_or_else(|| ExperimentError::Config("the experiment has no runs".into()))?;
    let probe = run_config(cfg, first)?;
    let model = pipe_stages::model::Model::new(&probe.model)?;
    if probe.dataset == pipe_stages::config::DatasetKind::Synthetic {
        pipe_stages::data::admit_synthetic_memory(&probe.synthetic)?;
    }
    let mut data = pipe_stages::train::load_data(&probe, &model)?;
    // More than the dataset holds would be run on all of it, and the report would state the
    // figure asked for.
    for (what, asked, split) in [
        ("train_samples", cfg.train_samples, &data.train),
        ("test_samples", cfg.test_samples, &data.test),
    ] {
        if asked > split.len() {
            return Err(ExperimentError::Config(format!(
                "{what} = {asked}: the dataset has {} (0 takes them all)",
                split.len()
            )));
        }
    }
    truncate(&mut data.train, cfg.train_samples);
    truncate(&mut data.test, cfg.test_samples);
    Ok(data)
}

pub(crate) fn truncate(ds: &mut pipe_stages::data::Dataset, n: usize) {
    if n == 0 || n >= ds.len() {
        return;
    }
    ds.truncate(n);
}

/// The `pipe train` configuration of one run.
///
/// # Errors
/// Settings `pipe train` refuses.
pub fn run_config(cfg: &StalenessConfig, spec: &RunSpec) -> Result<RunConfig, ExperimentError> {
    let opt = cfg
        .optimizers
        .iter()
        .find(|o| o.name == spec.optimizer)
        .ok_or_else(|| ExperimentError::Config(format!("no optimizer {}", spec.optimizer)))?;
    let dataset: DatasetKind = cfg.dataset.parse().map_err(ExperimentError::Config)?;
    let pipeline = spec.family == Family::Pipeline;
    let settings = TrainSettings {
        model: Some(ModelChoice::Preset(cfg.model.clone())),
        dataset: Some(dataset),
        epochs: Some(cfg.epochs),
        microbatch_size: Some(spec.microbatch_size),
        microbatches: Some(spec.microbatches),
        optimizer: Some(opt.kind),
        lr: Some(opt.lr * spec.lr_factor),
        // Momentum is SGD's and Muon's setting (the others refuse it).
        momentum: (!spec.compensate_momentum
            && matches!(opt.kind, OptimizerKind::Sgd | OptimizerKind::Muon))
        .then_some(opt.momentum),
        weight_decay: Some(opt.weight_decay),
        weight_decay_groups: Some(opt.weight_decay_groups),
        seed: Some(spec.seed),
        threads: Some(cfg.threads),
        stages: pipeline.then_some(spec.stages as usize),
        replicas: (pipeline && spec.replicas > 1).then(|| vec![spec.replicas]),
        allreduce_dtype: spec.allreduce_dtype.clone(),
        delay_correction: spec.delay_correction,
        delay_correction_strength: spec.delay_correction_strength,
        schedule: pipeline.then(|| spec.policy.clone()),
        partition: pipeline.then(|| "flops".to_string()),
        sync_warmup: (spec.remedies.sync_warmup > 0).then_some(spec.remedies.sync_warmup),
        lr_scaling: (spec.remedies.lr_scaling != Default::default())
            .then(|| spec.remedies.lr_scaling.to_string()),
        weight_prediction: (spec.remedies.prediction != Default::default())
            .then(|| spec.remedies.prediction.to_string()),
        ..TrainSettings::default()
    };
    Ok(settings.resolve()?)
}

/// Runs one spec on `data`; writes its ledger to `ledgers/` under `out` (pipelines).
///
/// # Errors
/// Failures other than divergence; unwritable ledger files.
pub fn run_one(
    cfg: &StalenessConfig,
    spec: &RunSpec,
    data: &Splits,
    out: &Path,
) -> Result<RunRecord, ExperimentError> {
    let rc = run_config(cfg, spec)?;
    let mut rec = Recorder::new(cfg.target_loss, cfg.target_window);
    let start = Instant::now();
    let mut ledger = Vec::new();
    let mut dropped = 0;
    let outcome = match &spec.delayed {
        None => {
            let opts = PipelineTrainOptions {
                ledger: true,
                ..PipelineTrainOptions::default()
            };
            train_pipelined(&rc, data, &mut rec, &opts).map(|r| ledger = r.ledger)
        }
        Some(d) => {
            let be = CpuBackend::new(cfg.threads)?;
            train_delayed(&rc, data, &be, d, &mut rec).map(|r| {
                dropped = r.dropped;
                ledger = delayed_ledger(&r.delays);
            })
        }
    };
    let diverged_at = match outcome {
        Ok(()) => None,
        Err(e) => match e.diverged_at() {
            Some(update) => Some(update),
            None => return Err(e.into()),
        },
    };
    if !ledger.is_empty() {
        write_ledger(
            &out.join("ledgers").join(format!("{}.csv.gz", spec.id)),
            &ledger,
        )?;
    }
    Ok(RunRecord {
        spec: spec.clone(),
        stage_delays: stage_delays(&ledger),
        losses: rec.losses,
        epochs: rec.epochs,
        diverged_at,
        updates_to_target: rec.reached.map(|r| r.0),
        seconds_to_target: rec.reached.map(|r| r.1),
        dropped,
        wall_s: start.elapsed().as_secs_f64(),
    })
}

/// The delayed baseline's ledger: update `t` computed on the weights of `t - d_t`.
fn delayed_ledger(delays: &[u32]) -> Vec<LedgerEntry> {
    delays
        .iter()
        .enumerate()
        .map(|(t, &d)| {
            let t = t as u64;
            LedgerEntry {
                stage: 0,
                mb: t,
                forward: t - u64::from(d),
                backward: t - u64::from(d),
                update: t,
            }
        })
        .collect()
}

/// Per stage, mean and most delay of forwards and backwards.
fn stage_delays(ledger: &[LedgerEntry]) -> Vec<StageDelay> {
    let stages = ledger.iter().map(|e| e.stage + 1).max().unwrap_or(0);
    (0..stages)
        .map(|s| {
            let mine = || ledger.iter().filter(move |e| e.stage == s);
            let n = mine().count().max(1) as f64;
            StageDelay {
                stage: s,
                forward_mean: mine().map(|e| e.forward_delay() as f64).sum::<f64>() / n,
                forward_max: mine().map(LedgerEntry::forward_delay).max().unwrap_or(0),
                backward_mean: mine().map(|e| e.backward_delay() as f64).sum::<f64>() / n,
                backward_max: mine().map(LedgerEntry::backward_delay).max().unwrap_or(0),
            }
        })
        .collect()
}

/// Writes a ledger as gzipped CSV: `stage,microbatch,forward_version,backward_version,update`.
fn write_ledger(path: &Path, ledger: &[LedgerEntry]) -> Result<(), ExperimentError> {
    let io = |e: std::io::Error| ExperimentError::Config(format!("{}: {e}", path.display()));
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let file = std::fs::File::create(path).map_err(io)?;
    let mut gz = flate2::write::GzEncoder::new(
        std::io::BufWriter::new(file),
        flate2::Compression::default(),
    );
    writeln!(
        gz,
        "stage,microbatch,forward_version,backward_version,update"
    )
    .map_err(io)?;
    for e in ledger {
        writeln!(
            gz,
            "{},{},{},{},{}",
            e.stage, e.mb, e.forward, e.backward, e.update
        )
        .map_err(io)?;
    }
    gz.finish().map_err(io)?.flush().map_err(io)?;
    Ok(())
}
