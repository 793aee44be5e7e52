//! The single-worker training loop: microbatches of a seeded epoch order, gradients summed over
//! `microbatches` per update, one optimizer step per update, evaluation after each epoch.
//! The pipeline executor (one per worker) replaces this loop when a run has several stages.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use pipe_kernels::{Backend, Tensor};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{Checkpoint, CheckpointPolicy, RunState};
use crate::config::{DatasetKind, RunConfig};
use crate::data::{Dataset, Splits, mnist, synthetic};
use crate::error::{Result, StageError};
use crate::loss::{Loss, SoftmaxCrossEntropy};
use crate::model::{Model, Params, host_params, place_params};
use crate::optim::Optimizer;

/// One optimizer step, as reported to observers and logs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StepStats {
    /// Update number, from 1.
    pub step: u64,
    /// Epoch, from 1.
    pub epoch: u64,
    /// Mean training loss over the update's targets (samples; tokens of a language model,
    /// in nats per token).
    pub loss: f64,
    /// Learning rate used.
    pub lr: f32,
    /// Samples processed in this update.
    pub samples: usize,
    /// Training throughput since the epoch began.
    pub samples_per_sec: f64,
    /// The same in tokens (language models: a sample is a window of tokens).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_sec: Option<f64>,
    /// Seconds since training began.
    pub elapsed_s: f64,
    /// Steps in this epoch.
    pub steps_in_epoch: u64,
    /// Step within this epoch, from 1.
    pub step_in_epoch: u64,
}

/// One epoch's summary.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EpochStats {
    /// Epoch, from 1.
    pub epoch: u64,
    /// Mean training loss over the epoch (per target, as [`StepStats::loss`]).
    pub train_loss: f64,
    /// Mean test loss per target (a language model's validation loss, nats per token).
    pub test_loss: f64,
    /// Test accuracy in `[0, 1]`.
    pub test_accuracy: f64,
    /// Training samples per second over the epoch (evaluation excluded).
    pub samples_per_sec: f64,
    /// The same in tokens, for language models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_sec: Option<f64>,
    /// Seconds since training began.
    pub elapsed_s: f64,
    /// Optimizer steps so far.
    pub steps: u64,
    /// Per pipeline stage (empty for single-worker runs).
    pub stages: Vec<StageEpochStats>,
}

/// One pipeline stage's figures over an epoch.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StageEpochStats {
    /// The stage.
    pub stage: u32,
    /// Share of the epoch's wall time its workers spent computing (mean over replicas).
    pub utilisation: f64,
    /// Mean number of updates between the weights a gradient was computed on and the weights
    /// it was applied to.
    pub staleness: f64,
}

/// Receives progress while training runs.
pub trait Observer {
    /// After every optimizer step.
    ///
    /// # Errors
    /// An observer may fail (a log that cannot be written), which stops training.
    fn on_step(&mut self, s: &StepStats) -> Result<()> {
        let _ = s;
        Ok(())
    }
    /// After every epoch's evaluation.
    ///
    /// # Errors
    /// As for `on_step`.
    fn on_epoch(&mut self, e: &EpochStats) -> Result<()> {
        let _ = e;
        Ok(())
    }
    /// When a worker's part of a run failed: where its program stopped, for the hang doctor of
    /// a launcher that cannot see into the worker's process.
    ///
    /// # Errors
    /// As for `on_step` (the run has failed already; the error is dropped).
    fn on_stop(&mut self, report: &crate::pipeline::doctor::StopReport) -> Result<()> {
        let _ = report;
        Ok(())
    }
    /// After each segment of a worker that runs in a process of its own
    /// ([`crate::pipeline::train_worker`]): the actions it ran, with times in seconds since
    /// `origin`, the worker's start by the system clock (so that the parts of several
    /// processes can be put on one time axis for a trace).
    ///
    /// # Errors
    /// As for `on_step`.
    fn on_spans(
        &mut self,
        origin: std::time::SystemTime,
        spans: &[pipe_scheduler::Span],
    ) -> Result<()> {
        let _ = (origin, spans);
        Ok(())
    }
}

/// An observer that ignores everything.
#[derive(Debug, Default)]
pub struct Quiet;
impl Observer for Quiet {}

/// The outcome of a training run.
#[derive(Debug)]
pub struct TrainReport {
    /// Per-epoch summaries.
    pub epochs: Vec<EpochStats>,
    /// Final parameters.
    pub params: Params,
    /// Optimizer steps taken.
    pub steps: u64,
}

/// Loads the dataset a run asks for and checks that it fits the model.
///
/// # Errors
/// [`StageError::Data`] for unreadable files; [`StageError::Model`] when the model's input or
/// output width does not fit the data.
pub fn load_data(cfg: &RunConfig, model: &Model) -> Result<Splits> {
    let data = match cfg.dataset {
        DatasetKind::Mnist => mnist(cfg.data_dir.as_deref())?,
        DatasetKind::Synthetic => synthetic(&cfg.synthetic, cfg.seed)?,
        DatasetKind::TinyShakespeare => {
            let context = model.input_shape().first().copied().unwrap_or(1);
            crate::data::tinyshakespeare(cfg.data_dir.as_deref(), context)?
        }
    };
    if data.vocab != cfg.vocab && cfg.vocab.is_some() {
        return Err(StageError::Data {
            source_name: data.train.name.clone(),
            reason: "its vocabulary differs from the one the model was sized for".into(),
        });
    }
    let want: usize = model.input_shape().iter().product();
    if want != data.train.sample_size() {
        return Err(StageError::Model(format!(
            "model '{}' takes {} input features but {} samples have {} ({:?})",
            cfg.model_name,
            want,
            data.train.name,
            data.train.sample_size(),
            data.train.feature_shape
        )));
    }
    if model.input_shape() != data.train.feature_shape.as_slice() {
        // Samples arrive in the dataset's shape: every layer must take them in that shape, not
        // only in the one the model declares.
        let as_fed = crate::model::ModelSpec {
            input: data.train.feature_shape.clone(),
            ..cfg.model.clone()
        };
        Model::new(&as_fed).map_err(|e| {
            StageError::Model(format!(
                "model '{}' declares input {:?} but {} samples are {:?}, which its layers do \
                 not take ({e}); start with a flatten layer or declare input = {:?}",
                cfg.model_name,
                model.input_shape(),
                data.train.name,
                data.train.feature_shape,
                data.train.feature_shape
            ))
        })?;
    }
    let (&out, rows) = model.output_shape().split_last().unwrap_or((&0, &[]));
    if out != data.train.classes {
        return Err(StageError::Model(format!(
            "model '{}' has {out} outputs but {} has {} classes",
            cfg.model_name, data.train.name, data.train.classes
        )));
    }
    let rows: usize = rows.iter().product();
    if rows != data.train.targets {
        return Err(StageError::Model(format!(
            "model '{}' predicts {rows} targets per sample but {} has {}",
            cfg.model_name, data.train.name, data.train.targets
        )));
    }
    let per_update = cfg.microbatch_size * cfg.microbatches;
    if per_update > data.train.len() {
        return Err(StageError::Config(format!(
            "one update needs {per_update} samples ({} x {}) but {} has {}",
            cfg.microbatches,
            cfg.microbatch_size,
            data.train.name,
            data.train.len()
        )));
    }
    Ok(data)
}

/// Tokens per second for data whose samples hold `targets` tokens (None for classification).
pub fn tokens_per_sec(samples_per_sec: f64, targets: usize) -> Option<f64> {
    (targets > 1).then_some(samples_per_sec * targets as f64)
}

/// Fewest samples per evaluation batch.
const MIN_EVAL_SAMPLES: usize = 16;

/// Mean loss and accuracy per target (per sample for classification, per token for a
/// language model) of `params` on `data`, in batches of about `batch` targets, evaluation
/// mode.
///
/// # Errors
/// Kernel errors.
pub fn evaluate(
    be: &dyn Backend,
    model: &Model,
    params: &Params,
    data: &Dataset,
    batch: usize,
) -> Result<(f64, f64)> {
    let order: Vec<u32> = (0..data.len() as u32).collect();
    let (mut loss, mut correct, mut rows) = (0.0f64, 0usize, 0usize);
    // `batch` counts targets: a language model's sample holds a window of them.
    let samples = (batch / data.targets.max(1))
        .max(MIN_EVAL_SAMPLES)
        .min(batch.max(1));
    for chunk in order.chunks(samples) {
        let (x, y) = data.gather(chunk);
        let (x, y) = (be.place(x)?, be.place_ids(y)?);
        let (logits, _) = model.forward_range(be, 0..model.len(), params, x, false, 0, 0)?;
        let s = SoftmaxCrossEntropy.evaluate(be, &logits, &y, 0.0, None)?;
        loss += s.loss_sum;
        correct += s.correct;
        rows += s.rows;
    }
    let n = rows.max(1) as f64;
    Ok((loss / n, correct as f64 / n))
}

/// What one optimizer step changes: parameters, gradient buffers and optimizer state.
#[derive(Debug)]
pub struct StepState<'a> {
    /// Parameters, updated in place.
    pub params: &'a mut Params,
    /// Gradient buffers (overwritten).
    pub grads: &'a mut Params,
    /// Optimizer.
    pub opt: &'a mut Optimizer,
}

/// One update on one worker: forward and backward over each microbatch in `batches` (inputs
/// and labels, moved to the backend here), summing gradients (each scaled by `grad_scale` at
/// the loss), then one optimizer step at `lr`.
/// Returns the summed loss. `microbatch_id` numbers microbatches for dropout seeds.
///
/// # Errors
/// Kernel errors.
#[allow(clippy::too_many_arguments)]
pub fn train_step(
    be: &dyn Backend,
    model: &Model,
    st: &mut StepState<'_>,
    batches: Vec<(Tensor, Tensor<u32>)>,
    grad_scale: f32,
    lr: f32,
    seed: u64,
    microbatch_id: &mut u64,
) -> Result<f64> {
    let mut loss = 0.0;
    let n = model.len();
    let batches_len = batches.len().max(1);
    for (i, (x, y)) in batches.into_iter().enumerate() {
        let (x, y) = (be.place(x)?, be.place_ids(y)?);
        let (logits, saved) =
            model.forward_range(be, 0..n, st.params, x, true, seed, *microbatch_id)?;
        *microbatch_id += 1;
        let mut dlogits = Tensor::default();
        let s = SoftmaxCrossEntropy.evaluate(be, &logits, &y, grad_scale, Some(&mut dlogits))?;
        if !s.loss_sum.is_finite() {
            return Err(StageError::NonFinite {
                what: format!("the loss of microbatch {}", *microbatch_id - 1),
                update: (*microbatch_id - 1) / batches_len as u64 + 1,
            });
        }
        loss += s.loss_sum;
        model.backward_range(be, 0..n, st.params, &saved, dlogits, st.grads, i > 0, false)?;
    }
    model.sum_tied(be, &mut [(0, &mut *st.grads)])?;
    model.check_gradients(be, 0, st.grads, *microbatch_id / batches_len as u64)?;
    st.opt.step(be, st.params, st.grads, lr)?;
    Ok(loss)
}

/// Records one update of `samples` in the metrics: the samples and updates counters, and,
/// when the update is reported as it completes, the time since the previous one (`last`,
/// reset here) in the update-time histogram.
pub(crate) fn record_update(samples: usize, last: Option<&mut Instant>) {
    metrics::counter!("pipe_samples_total").increment(samples as u64);
    metrics::counter!("pipe_updates_total").increment(1);
    if let Some(last) = last {
        metrics::histogram!("pipe_update_seconds").record(last.elapsed().as_secs_f64());
        *last = Instant::now();
    }
}

/// Trains `cfg`'s model on `data` with one worker.
///
/// # Errors
/// Kernel errors, a diverged loss, or an observer's error.
pub fn train(
    cfg: &RunConfig,
    data: &Splits,
    be: &dyn Backend,
    obs: &mut dyn Observer,
) -> Result<TrainReport> {
    train_with(cfg, data, be, obs, &TrainOptions::default()).map(|o| o.report)
}

/// Checkpoints, resume and stopping for [`train_with`].
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    /// Write checkpoints (every update is a drain point here).
    pub checkpoints: Option<CheckpointPolicy>,
    /// Start from this checkpoint.
    pub resume: Option<Checkpoint>,
    /// Set (by a Ctrl-C handler) to stop after the current update, with a checkpoint.
    pub stop: Option<Arc<AtomicBool>>,
}

/// What [`train_with`] ends with.
#[derive(Debug)]
pub struct TrainOutcome {
    /// The report.
    pub report: TrainReport,
    /// Checkpoints written, oldest first.
    pub checkpoints: Vec<PathBuf>,
    /// The run stopped early, asked to, after this many updates.
    pub stopped: Option<u64>,
}

/// [`train`] with checkpoints, resume and a stop flag.
///
/// # Errors
/// As [`train`]; a checkpoint that does not fit this run; a checkpoint that cannot be
/// written.
pub fn train_with(
    cfg: &RunConfig,
    data: &Splits,
    be: &dyn Backend,
    obs: &mut dyn Observer,
    opts: &TrainOptions,
) -> Result<TrainOutcome> {
    let model = Model::new(&cfg.model)?;
    let b = cfg.microbatch_size;
    let m = cfg.microbatches;
    let steps_per_epoch = (data.train.len() / (b * m)) as u64;
    let total = cfg.steps.map_or(steps_per_epoch * cfg.epochs, |s| {
        s.min(steps_per_epoch * cfg.epochs)
    });
    let (mut params, mut opt, mut step) = start(
        cfg,
        &model,
        be,
        opts.resume.as_ref(),
        (b * m) as u64,
        steps_per_epoch,
    )?;
    let first_epoch = (step / steps_per_epoch.max(1)) + 1;
    let skip = step % steps_per_epoch.max(1);
    if step >= total {
        return Err(StageError::Checkpoint(format!(
            "is at update {step} of this run, which has {total} in all: nothing left to train"
        )));
    }
    let mut grads = place_params(be, model.zero_grads(0..model.len()))?;
    let sched = cfg.lr_schedule(total);
    let targets = data.train.targets.max(1);
    let grad_scale = 1.0 / (b * m * targets) as f32;
    let start = Instant::now();
    let mut report = Vec::new();
    let mut microbatch_id = step * m as u64;
    let mut written = Vec::new();
    let mut stopped = None;
    let mut last_update = Instant::now();
    for epoch in first_epoch..=cfg.epochs {
        if step >= total || stopped.is_some() {
            break;
        }
        let order = data.train.epoch_order(cfg.seed, epoch);
        let epoch_start = Instant::now();
        let (mut epoch_loss, mut epoch_samples) = (0.0f64, 0usize);
        let mut epoch_finished = false;
        let skip = if epoch == first_epoch { skip } else { 0 };
        for (k, update) in order.chunks_exact(b * m).enumerate().skip(skip as usize) {
            if step >= total || stopped.is_some() {
                // Stopped by --steps inside this epoch: it still gets its summary below.
                break;
            }
            let lr = sched.at(step);
            let batches: Vec<(Tensor, Tensor<u32>)> = update
                .chunks_exact(b)
                .map(|mb| data.train.gather(mb))
                .collect();
            let mut st = StepState {
                params: &mut params,
                grads: &mut grads,
                opt: &mut opt,
            };
            let loss = train_step(
                be,
                &model,
                &mut st,
                batches,
                grad_scale,
                lr,
                cfg.seed,
                &mut microbatch_id,
            )?;
            step += 1;
            let mean = loss / (b * m * targets) as f64;
            if !mean.is_finite() {
                return Err(StageError::Diverged { step, loss: mean });
            }
            epoch_loss += loss;
            epoch_samples += b * m;
            record_update(b * m, Some(&mut last_update));
            obs.on_step(&StepStats {
                step,
                epoch,
                loss: mean,
                lr,
                samples: b * m,
                samples_per_sec: epoch_samples as f64
                    / epoch_start.elapsed().as_secs_f64().max(1e-9),
                tokens_per_sec: tokens_per_sec(
                    epoch_samples as f64 / epoch_start.elapsed().as_secs_f64().max(1e-9),
                    targets,
                ),
                elapsed_s: start.elapsed().as_secs_f64(),
                steps_in_epoch: steps_per_epoch.min(total),
                step_in_epoch: k as u64 + 1,
            })?;
            let stop = opts.stop.as_ref().is_some_and(|f| f.load(Ordering::SeqCst));
            let epoch_end = k as u64 + 1 == steps_per_epoch || step == total;
            epoch_finished = epoch_end;
            if let Some(policy) = opts
                .checkpoints
                .as_ref()
                .filter(|p| p.due(step, epoch_end, stop))
            {
                let at = (step, steps_per_epoch, (b * m) as u64);
                written.push(write_checkpoint(
                    cfg,
                    (be, &model),
                    policy,
                    (&params, &opt),
                    at,
                )?);
            }
            if stop {
                stopped = Some(step);
            }
        }
        if stopped.is_some() && !epoch_finished {
            break;
        }
        let secs = epoch_start.elapsed().as_secs_f64();
        let (test_loss, test_accuracy) = evaluate(be, &model, &params, &data.test, 1000)?;
        let e = EpochStats {
            epoch,
            train_loss: epoch_loss / (epoch_samples * targets).max(1) as f64,
            test_loss,
            test_accuracy,
            samples_per_sec: epoch_samples as f64 / secs.max(1e-9),
            tokens_per_sec: tokens_per_sec(epoch_samples as f64 / secs.max(1e-9), targets),
            elapsed_s: start.elapsed().as_secs_f64(),
            steps: step,
            stages: Vec::new(),
        };
        obs.on_epoch(&e)?;
        report.push(e);
    }
    Ok(TrainOutcome {
        report: TrainReport {
            epochs: report,
            params: host_params(be, params)?,
            steps: step,
        },
        checkpoints: written,
        stopped,
    })
}

/// Writes the one-worker trainer's checkpoint after `step` updates (`at`: the step, updates per
/// epoch, samples per update) under `policy`, in host memory whatever `be` computes on.
///
/// # Errors
/// Device failures copying out; checkpoint write failures.
fn write_checkpoint(
    cfg: &RunConfig,
    (be, model): (&dyn Backend, &Model),
    policy: &CheckpointPolicy,
    (params, opt): (&Params, &Optimizer),
    (step, steps_per_epoch, per_update): (u64, u64, u64),
) -> Result<PathBuf> {
    let mut state = RunState::identity(cfg, policy.settings.clone());
    state.updates = step;
    state.epoch = step / steps_per_epoch.max(1) + 1;
    state.samples_in_epoch = (step % steps_per_epoch.max(1)) * per_update;
    state.optimizer_steps = vec![opt.steps(); model.len()];
    state.partition = format!("0-{}", model.len().saturating_sub(1));
    let ckpt = Checkpoint {
        params: host_params(be, params.clone())?,
        optimizer: opt.clone().on_host(be)?.state().to_vec(),
        state,
    };
    crate::checkpoint::write(&policy.dir, model, &ckpt, policy.keep)
}

/// Fresh weights and optimizer, or a checkpoint's (whose data cursor must fall on a whole
/// update of `per_update` samples), with the updates done.
fn start(
    cfg: &RunConfig,
    model: &Model,
    be: &dyn Backend,
    resume: Option<&Checkpoint>,
    per_update: u64,
    per_epoch: u64,
) -> Result<(Params, Optimizer, u64)> {
    let Some(c) = resume else {
        let params = place_params(be, model.init_params(cfg.seed))?;
        let opt = Optimizer::new(cfg.optimizer, &params).placed(be)?;
        return Ok((params, opt, 0));
    };
    let at = c.state.samples_in_epoch;
    if at % per_update != 0 || at / per_update > per_epoch || c.state.epoch == 0 {
        return Err(StageError::Checkpoint(format!(
            "stopped {at} samples into epoch {}, not a whole number of this run's updates of {per_update} samples",
            c.state.epoch
        )));
    }
    let done = (c.state.epoch - 1) * per_epoch + at / per_update;
    let steps = c.state.optimizer_steps.first().copied().unwrap_or(0);
    if cfg.optimizer.kind != crate::optim::OptimizerKind::Sgd
        && c.state.optimizer_steps.iter().any(|&s| s != steps)
    {
        return Err(StageError::Checkpoint(
            "its layers were saved after different numbers of Adam updates; one worker cannot resume them"
                .into(),
        ));
    }
    let params = place_params(be, c.params.clone())?;
    let opt =
        Optimizer::with_state(cfg.optimizer, &params, c.optimizer.clone(), steps)?.placed(be)?;
    Ok((params, opt, done))
}
