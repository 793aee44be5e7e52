//! The single-worker training loop: microbatches of a seeded epoch order, gradients summed over
//! `microbatches` per update, one optimizer step per update, evaluation after each epoch.
//! The pipeline executor (one per worker) replaces this loop when a run has several stages.

use std::time::Instant;

use pipe_kernels::{Backend, Tensor};
use serde::{Deserialize, Serialize};

use crate::config::{DatasetKind, RunConfig};
use crate::data::{Dataset, Splits, mnist, synthetic};
use crate::error::{Result, StageError};
use crate::loss::{Loss, SoftmaxCrossEntropy};
use crate::model::{Model, Params, place_params};
use crate::optim::Optimizer;

/// One optimizer step, as reported to observers and logs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StepStats {
    /// Update number, from 1.
    pub step: u64,
    /// Epoch, from 1.
    pub epoch: u64,
    /// Mean training loss over the update's samples.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f32,
    /// Samples processed in this update.
    pub samples: usize,
    /// Training throughput since the epoch began.
    pub samples_per_sec: f64,
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
    /// Mean training loss over the epoch.
    pub train_loss: f64,
    /// Mean test loss.
    pub test_loss: f64,
    /// Test accuracy in `[0, 1]`.
    pub test_accuracy: f64,
    /// Training samples per second over the epoch (evaluation excluded).
    pub samples_per_sec: f64,
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
    };
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
    let out: usize = model.output_shape().iter().product();
    if out != data.train.classes {
        return Err(StageError::Model(format!(
            "model '{}' has {out} outputs but {} has {} classes",
            cfg.model_name, data.train.name, data.train.classes
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

/// Mean loss and accuracy of `params` on `data`, in batches of `batch`, evaluation mode.
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
    let (mut loss, mut correct) = (0.0f64, 0usize);
    for chunk in order.chunks(batch.max(1)) {
        let (x, y) = data.gather(chunk);
        let (x, y) = (be.place(x)?, be.place_ids(y)?);
        let (logits, _) = model.forward_range(be, 0..model.len(), params, x, false, 0, 0)?;
        let s = SoftmaxCrossEntropy.evaluate(be, &logits, &y, 0.0, None)?;
        loss += s.loss_sum;
        correct += s.correct;
    }
    let n = data.len().max(1) as f64;
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
    for (i, (x, y)) in batches.into_iter().enumerate() {
        let (x, y) = (be.place(x)?, be.place_ids(y)?);
        let (logits, saved) =
            model.forward_range(be, 0..n, st.params, x, true, seed, *microbatch_id)?;
        *microbatch_id += 1;
        let mut dlogits = Tensor::default();
        let s = SoftmaxCrossEntropy.evaluate(be, &logits, &y, grad_scale, Some(&mut dlogits))?;
        loss += s.loss_sum;
        model.backward_range(be, 0..n, st.params, &saved, dlogits, st.grads, i > 0, false)?;
    }
    model.sum_tied(be, &mut [(0, &mut *st.grads)])?;
    st.opt.step(be, st.params, st.grads, lr)?;
    Ok(loss)
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
    let model = Model::new(&cfg.model)?;
    let mut params = place_params(be, model.init_params(cfg.seed))?;
    let mut grads = place_params(be, model.zero_grads(0..model.len()))?;
    let mut opt = Optimizer::new(cfg.optimizer, &params).placed(be)?;
    let b = cfg.microbatch_size;
    let m = cfg.microbatches;
    let steps_per_epoch = (data.train.len() / (b * m)) as u64;
    let total = cfg.steps.map_or(steps_per_epoch * cfg.epochs, |s| {
        s.min(steps_per_epoch * cfg.epochs)
    });
    let sched = cfg.lr_schedule(total);
    let grad_scale = 1.0 / (b * m) as f32;
    let start = Instant::now();
    let mut report = Vec::new();
    let mut step = 0u64;
    let mut microbatch_id = 0u64;
    for epoch in 1..=cfg.epochs {
        if step >= total {
            break;
        }
        let order = data.train.epoch_order(cfg.seed, epoch);
        let epoch_start = Instant::now();
        let (mut epoch_loss, mut epoch_samples) = (0.0f64, 0usize);
        for (k, update) in order.chunks_exact(b * m).enumerate() {
            if step >= total {
                // Stopped by --steps inside this epoch: it still gets its summary below.
                break;
            }
            let lr = sched.at(step);
            let batches: Vec<(Tensor, Tensor<u32>)> = update
                .chunks_exact(b)
                .map(|mb| data.train.gather(mb))
                .collect();
            let loss = train_step(
                be,
                &model,
                &mut StepState {
                    params: &mut params,
                    grads: &mut grads,
                    opt: &mut opt,
                },
                batches,
                grad_scale,
                lr,
                cfg.seed,
                &mut microbatch_id,
            )?;
            step += 1;
            let mean = loss / (b * m) as f64;
            if !mean.is_finite() {
                return Err(StageError::Diverged { step, loss: mean });
            }
            epoch_loss += loss;
            epoch_samples += b * m;
            obs.on_step(&StepStats {
                step,
                epoch,
                loss: mean,
                lr,
                samples: b * m,
                samples_per_sec: epoch_samples as f64
                    / epoch_start.elapsed().as_secs_f64().max(1e-9),
                elapsed_s: start.elapsed().as_secs_f64(),
                steps_in_epoch: steps_per_epoch.min(total),
                step_in_epoch: k as u64 + 1,
            })?;
        }
        let secs = epoch_start.elapsed().as_secs_f64();
        let (test_loss, test_accuracy) = evaluate(be, &model, &params, &data.test, 1000)?;
        let e = EpochStats {
            epoch,
            train_loss: epoch_loss / epoch_samples.max(1) as f64,
            test_loss,
            test_accuracy,
            samples_per_sec: epoch_samples as f64 / secs.max(1e-9),
            elapsed_s: start.elapsed().as_secs_f64(),
            steps: step,
            stages: Vec::new(),
        };
        obs.on_epoch(&e)?;
        report.push(e);
    }
    Ok(TrainReport {
        epochs: report,
        params,
        steps: step,
    })
}
