//! Data-parallel SGD with delayed gradients: the parameter-server picture of staleness, next
//! to the pipeline's. One worker trains the whole model; the gradient applied at update `t` was
//! computed on the weights of update `t - d_t`, as if it came from an asynchronous replica
//! that read the weights `d_t` updates ago. The delay is fixed or drawn per update (seeded).
//!
//! The classic remedies for stale gradients in asynchronous data parallelism are options:
//! dropping gradients older than `k` updates, scaling a gradient's learning rate down by its
//! age (`lr / (1 + d_t)`), and a synchronous warm-up (no delay for the first updates: one
//! replica trains alone before the others join). A lower learning rate and a larger or smaller
//! minibatch are settings of the run itself.
//!
//! An update computes what the reference trainer computes for one stage
//! ([`crate::pipeline::reference_run`]): each microbatch's loss scaled by its rows, gradients
//! accumulated, tied uses summed, one [`Optimizer::mean_step`](crate::optim::Optimizer::mean_step) over the update. With no
//! delay it is the reference trainer's sequential run, and with a fixed delay of one it is its
//! one-stage 2BW run, bit for bit (`stages/tests/delayed.rs`).

use std::collections::VecDeque;
use std::time::Instant;

use pipe_kernels::{Backend, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::config::RunConfig;
use crate::data::Splits;
use crate::error::{Result, StageError};
use crate::loss::{Loss, SoftmaxCrossEntropy};
use crate::model::{Model, Params, place_params};
use crate::optim::{Optimizer, UpdateMean};
use crate::train::{EpochStats, Observer, StepStats, TrainReport, evaluate};

/// How late gradients arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Delay {
    /// Every gradient is `updates` old.
    Fixed {
        /// The delay, in updates.
        updates: u32,
    },
    /// Each gradient's age is drawn uniformly from `0..=max` (seeded by the run).
    Uniform {
        /// The largest delay.
        max: u32,
    },
}

impl Delay {
    /// The largest delay this can give.
    pub fn max(self) -> u32 {
        match self {
            Self::Fixed { updates } => updates,
            Self::Uniform { max } => max,
        }
    }
}

/// The delayed run's options.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DelayedOptions {
    /// The gradients' delay.
    pub delay: Delay,
    /// Drop (skip the update of) a gradient older than this many updates.
    pub drop_older_than: Option<u32>,
    /// Scale a gradient's learning rate by `1 / (1 + age)`.
    pub age_scaling: bool,
    /// Updates at the start with no delay.
    pub warmup: u64,
}

impl DelayedOptions {
    /// Plain delayed SGD with `delay` and no remedy.
    pub fn new(delay: Delay) -> Self {
        DelayedOptions {
            delay,
            drop_older_than: None,
            age_scaling: false,
            warmup: 0,
        }
    }
}

/// What a delayed run reports beyond the usual training report.
#[derive(Debug)]
pub struct DelayedReport {
    /// Epochs, final weights and steps (dropped gradients count as steps).
    pub report: TrainReport,
    /// Each update's delay, in order.
    pub delays: Vec<u32>,
    /// Updates whose gradient was dropped.
    pub dropped: u64,
}

/// The delay of update `t`: none during the warm-up, never older than the run.
fn delay_at(opts: &DelayedOptions, t: u64, rng: &mut ChaCha8Rng) -> u32 {
    let d = match opts.delay {
        Delay::Fixed { updates } => updates,
        Delay::Uniform { max } => rng.random_range(0..=max),
    };
    if t < opts.warmup {
        return 0;
    }
    d.min(u32::try_from(t).unwrap_or(u32::MAX))
}

/// Trains `cfg`'s model with delayed gradients (module docs). `cfg.microbatches` microbatches
/// of `cfg.microbatch_size` make an update; the epoch order, learning-rate schedule, dropout
/// seeds and evaluation are those of every other run of `cfg`.
///
/// # Errors
/// Kernel errors, a diverged loss or gradient, or an observer's error.
pub fn train_delayed(
    cfg: &RunConfig,
    data: &Splits,
    be: &dyn Backend,
    opts: &DelayedOptions,
    obs: &mut dyn Observer,
) -> Result<DelayedReport> {
    let model = Model::new(&cfg.model)?;
    let (b, m) = (cfg.microbatch_size, cfg.microbatches);
    let per_epoch = (data.train.len() / (b * m)) as u64;
    if per_epoch == 0 {
        return Err(StageError::Config(format!(
            "one update needs {} samples but {} has {}",
            b * m,
            data.train.name,
            data.train.len()
        )));
    }
    let total = cfg
        .steps
        .map_or(per_epoch * cfg.epochs, |s| s.min(per_epoch * cfg.epochs));
    let sched = cfg.lr_schedule(total);
    let mut params = place_params(be, model.init_params(cfg.seed))?;
    let mut opt = Optimizer::new(cfg.optimizer, &params).placed(be)?;
    let mut grads = place_params(be, model.zero_grads(0..model.len()))?;
    // The weights of the last `max` updates, newest last: `history[len - 1 - d]` is `d` old.
    let mut history: VecDeque<Params> = VecDeque::new();
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0xde1a_7ed5_9d00_0001);
    let (mut delays, mut dropped) = (Vec::new(), 0u64);
    let mut epochs = Vec::new();
    let start = Instant::now();
    let mut step = 0u64;
    for epoch in 1..=cfg.epochs {
        let order = data.train.epoch_order(cfg.seed, epoch);
        let epoch_start = Instant::now();
        let (mut loss_sum, mut rows_sum) = (0.0f64, 0usize);
        for (k, update) in order.chunks_exact(b * m).enumerate() {
            if step >= total {
                break;
            }
            let d = delay_at(opts, step, &mut rng);
            let stale = match d.checked_sub(1) {
                None => &params,
                Some(back) => history
                    .get(history.len().wrapping_sub(1 + back as usize))
                    .unwrap_or(&params),
            };
            let batch = Batch {
                samples: update,
                size: b,
                first_mb: step * m as u64,
            };
            let (loss, rows) = gradients(be, &model, cfg.seed, stale, &batch, data, &mut grads)?;
            let lr = sched.at(step);
            let stats = StepStats {
                step: step + 1,
                epoch,
                loss: loss / rows.max(1) as f64,
                lr,
                samples: b * m,
                samples_per_sec: ((k + 1) * b * m) as f64
                    / epoch_start.elapsed().as_secs_f64().max(1e-9),
                tokens_per_sec: None,
                elapsed_s: start.elapsed().as_secs_f64(),
                steps_in_epoch: per_epoch,
                step_in_epoch: k as u64 + 1,
            };
            if opts.max_history() > 0 {
                history.push_back(params.clone());
                if history.len() > opts.max_history() {
                    history.pop_front();
                }
            }
            delays.push(d);
            if opts.drop_older_than.is_some_and(|k| d > k) {
                dropped += 1;
            } else {
                model.sum_tied(be, &mut [(0, &mut grads)])?;
                model.check_gradients(be, 0, &grads, step + 1)?;
                let scale = if opts.age_scaling {
                    1.0 / (1.0 + d as f32)
                } else {
                    1.0
                };
                let lr = lr * scale;
                let mean = (UpdateMean::new(m as u32), m as u32);
                opt.mean_step(be, &mut params, &mut grads, mean, lr)?;
            }
            step += 1;
            loss_sum += loss;
            rows_sum += rows;
            obs.on_step(&stats)?;
        }
        let (test_loss, test_accuracy) = evaluate(be, &model, &params, &data.test, 1000)?;
        let secs = epoch_start.elapsed().as_secs_f64();
        let e = EpochStats {
            epoch,
            train_loss: loss_sum / rows_sum.max(1) as f64,
            test_loss,
            test_accuracy,
            samples_per_sec: (rows_sum / data.train.targets.max(1)) as f64 / secs.max(1e-9),
            tokens_per_sec: None,
            elapsed_s: start.elapsed().as_secs_f64(),
            steps: step,
            stages: Vec::new(),
        };
        obs.on_epoch(&e)?;
        epochs.push(e);
        if step >= total {
            break;
        }
    }
    Ok(DelayedReport {
        report: TrainReport {
            epochs,
            params,
            steps: step,
        },
        delays,
        dropped,
    })
}

impl DelayedOptions {
    /// Weight versions kept besides the current one.
    fn max_history(&self) -> usize {
        self.delay.max() as usize
    }
}

/// One update's samples: `samples` cut into microbatches of `size`, the first numbered
/// `first_mb` (dropout seeds).
struct Batch<'a> {
    samples: &'a [u32],
    size: usize,
    first_mb: u64,
}

/// The gradients of one update's microbatches on `params`, summed into `grads` (each
/// microbatch's loss scaled as the reference trainer scales it, [`UpdateMean`]). Returns the summed
/// loss and rows.
fn gradients(
    be: &dyn Backend,
    model: &Model,
    seed: u64,
    params: &Params,
    batch: &Batch<'_>,
    data: &Splits,
    grads: &mut Params,
) -> Result<(f64, usize)> {
    let n = model.len();
    let (mut loss, mut rows) = (0.0f64, 0usize);
    for (i, mb) in batch.samples.chunks_exact(batch.size).enumerate() {
        let (x, y) = data.train.gather(mb);
        let (x, y): (Tensor, Tensor<u32>) = (be.place(x)?, be.place_ids(y)?);
        let id = batch.first_mb + i as u64;
        let (logits, saved) = model.forward_range(be, 0..n, params, x, true, seed, id)?;
        let scale = UpdateMean::new(batch.samples.len().div_ceil(batch.size.max(1)) as u32)
            .loss_scale(y.len());
        let mut dy = Tensor::default();
        let s = SoftmaxCrossEntropy.evaluate(be, &logits, &y, scale, Some(&mut dy))?;
        if !s.loss_sum.is_finite() {
            return Err(StageError::NonFinite {
                what: format!("the loss of microbatch {id}"),
                update: id / batch.samples.len().div_ceil(batch.size).max(1) as u64 + 1,
            });
        }
        loss += s.loss_sum;
        rows += s.rows;
        model.backward_range(be, 0..n, params, &saved, dy, grads, i > 0, false)?;
    }
    Ok((loss, rows))
}
