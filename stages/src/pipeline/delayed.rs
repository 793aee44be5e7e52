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
//! accumulated, tied uses summed, one [`Corrected::step`](crate::optim::Corrected::step) over
//! the update. With no delay it is the reference trainer's sequential run, and with a fixed
//! delay of one it is its one-stage 2BW run, bit for bit (`stages/tests/delayed.rs`).

use std::collections::VecDeque;
use std::time::Instant;

use pipe_kernels::Backend;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::config::RunConfig;
use crate::data::Splits;
use crate::error::{Result, StageError};
use crate::model::{Model, Params, host_params, place_params};
use crate::optim::{Corrected, LrSchedule, UpdateMean, clip_gradients};
use crate::pipeline::Observer;
use crate::pipeline::train::{
    Coordinator, Drain, Drained, LoopStart, Run, Segment, SegmentEnd, run_segments,
};
use crate::pipeline::{RunPlan, WorkerOutcome};
use crate::train::{StepStats, TrainReport, WholeMicrobatch, whole_model_pass};

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
/// seeds and evaluation are those of every other run of `cfg`, and so is the loop: the
/// segment loop of every `pipe train` run ([`crate::pipeline::train`]), with this trainer as
/// its coordinator.
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
    let layout = cfg.resolved()?.layout.clone();
    if layout.workers() != 1 {
        return Err(StageError::Config(format!(
            "delayed SGD trains one worker over the whole model, not {} stages on {} workers",
            layout.stages(),
            layout.workers()
        )));
    }
    let run = Run::new(cfg, data)?;
    let init = run.model.init_params(cfg.seed);
    let params = place_params(be, init.clone())?;
    let mut worker = DelayedWorker {
        cfg,
        data,
        be,
        opts,
        lr: cfg.lr_schedule(run.total),
        opt: Corrected::new(cfg.optimizer, &params, &run.model.optimizer_roles()).placed(be)?,
        grads: place_params(be, run.model.zero_grads(0..run.model.len()))?,
        model: &run.model,
        params,
        history: VecDeque::new(),
        rng: ChaCha8Rng::seed_from_u64(cfg.seed ^ 0xde1a_7ed5_9d00_0001),
        delays: Vec::new(),
        dropped: 0,
        started: Instant::now(),
        epoch: None,
    };
    let start = LoopStart {
        done: 0,
        params: init,
        partition: &None,
        every: None,
        pace: None,
        checkpoints: None,
        stop: None,
        rejoin: false,
    };
    let end = run_segments(&run, &mut worker, data, start, obs)?;
    Ok(DelayedReport {
        report: TrainReport {
            epochs: end.epochs,
            params: end.params,
            steps: end.done,
        },
        delays: worker.delays,
        dropped: worker.dropped,
    })
}

/// Delayed SGD's side of the segment loop: one worker, its weights, optimizer and the
/// weights of the last updates (the stale versions gradients are computed on).
struct DelayedWorker<'a> {
    cfg: &'a RunConfig,
    data: &'a Splits,
    be: &'a dyn Backend,
    opts: &'a DelayedOptions,
    model: &'a Model,
    lr: LrSchedule,
    params: Params,
    opt: Corrected,
    grads: Params,
    /// The weights of the last `max` updates, newest last: `history[len - 1 - d]` is `d` old.
    history: VecDeque<Params>,
    rng: ChaCha8Rng,
    delays: Vec<u32>,
    dropped: u64,
    started: Instant,
    /// The epoch in progress and when it began (for the steps' throughput).
    epoch: Option<(u64, Instant)>,
}

impl Coordinator for DelayedWorker<'_> {
    fn run_segment(
        &mut self,
        _plan: &RunPlan,
        at: &Segment,
        obs: &mut dyn Observer,
    ) -> Result<SegmentEnd> {
        let (b, m) = (self.cfg.microbatch_size, self.cfg.microbatches);
        let began = match self.epoch {
            Some((e, t)) if e == at.epoch => t,
            _ => {
                let now = Instant::now();
                self.epoch = Some((at.epoch, now));
                now
            }
        };
        let order = self
            .data
            .train
            .epoch_order(self.cfg.seed, at.epoch, self.cfg.data_order);
        let mut outcome = WorkerOutcome::default();
        let updates = order.chunks_exact(b * m).enumerate();
        for (k, update) in updates.skip(at.before as usize).take(at.len as usize) {
            let step = at.done + (k as u64 - at.before);
            let (loss, rows, grad_norm) = self.update(step, update)?;
            outcome.loss_sum += loss;
            outcome.samples += rows;
            obs.on_step(&StepStats {
                step: step + 1,
                epoch: at.epoch,
                loss: loss / rows.max(1) as f64,
                lr: self.lr.at(step),
                samples: b * m,
                samples_per_sec: ((k + 1) * b * m) as f64 / began.elapsed().as_secs_f64().max(1e-9),
                tokens_per_sec: None,
                elapsed_s: self.started.elapsed().as_secs_f64(),
                steps_in_epoch: at.epoch_len,
                step_in_epoch: k as u64 + 1,
                grad_norm,
            })?;
        }
        Ok(SegmentEnd::Chief(vec![outcome]))
    }

    fn drain(&mut self, _plan: &RunPlan, drain: Drain) -> Result<Drained> {
        let weights = drain
            .weights
            .then(|| host_params(self.be, self.params.clone()))
            .transpose()?;
        Ok(Drained::Gave(weights, None))
    }
}

impl DelayedWorker<'_> {
    /// Update `step` on the samples `update`: the gradient on the weights its delay names,
    /// applied (or dropped) to the current weights. Returns the loss sum, its rows, and the
    /// gradient's norm before clipping (when clipping and not dropped).
    fn update(&mut self, step: u64, update: &[u32]) -> Result<(f64, usize, Option<f64>)> {
        let (b, m) = (self.cfg.microbatch_size, self.cfg.microbatches);
        let d = delay_at(self.opts, step, &mut self.rng);
        let stale = match d.checked_sub(1) {
            None => &self.params,
            Some(back) => self
                .history
                .get(self.history.len().wrapping_sub(1 + back as usize))
                .unwrap_or(&self.params),
        };
        let batch = Batch {
            samples: update,
            size: b,
            first_mb: step * m as u64,
            mean: UpdateMean::new(m as u32),
        };
        let (be, model) = (self.be, self.model);
        // DC-ASGD compensates against the weights the gradient is computed at; the history
        // moves on before the step, so it keeps its own copy.
        let anchor = self.opt.needs_stale_weights().then(|| stale.clone());
        let (loss, rows) = gradients(
            be,
            model,
            self.cfg.seed,
            stale,
            &batch,
            self.data,
            &mut self.grads,
        )?;
        if self.opts.max_history() > 0 {
            self.history.push_back(self.params.clone());
            if self.history.len() > self.opts.max_history() {
                self.history.pop_front();
            }
        }
        self.delays.push(d);
        if self.opts.drop_older_than.is_some_and(|k| d > k) {
            self.dropped += 1;
            return Ok((loss, rows, None));
        }
        let mean = (batch.mean, m as u32);
        if let Some(stale) = anchor {
            let current = &self.params;
            self.opt.compensate(be, &mut self.grads, mean, || {
                Ok((current, std::borrow::Cow::Owned(stale)))
            })?;
        }
        model.sum_tied(be, &mut [(0, &mut self.grads)])?;
        // Clipping by the whole model's norm, as the reference trainer's one stage does.
        let grad_norm = match self.opt.optimizer().config().grad_clip {
            Some(max_norm) => {
                let model_at = (model, 0);
                let squared = super::clip::squared_norm_at_mean(
                    be,
                    model_at,
                    &mut self.opt,
                    &mut self.grads,
                    mean,
                )?;
                let norm = squared.sqrt();
                clip_gradients(be, &mut self.grads, max_norm, norm)?;
                Some(norm)
            }
            None => None,
        };
        let scale = if self.opts.age_scaling {
            1.0 / (1.0 + d as f32)
        } else {
            1.0
        };
        let lr = self.lr.at(step) * scale;
        let seen = (self.opt).step(be, &mut self.params, &mut self.grads, mean, lr)?;
        model.check_update(be, (0, &self.grads, &self.params), &seen.0, step + 1)?;
        Ok((loss, rows, grad_norm))
    }
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
    /// How each microbatch's loss is scaled: a mean over the update's microbatches.
    mean: UpdateMean,
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
    let (mut loss, mut rows) = (0.0f64, 0usize);
    for (i, mb) in batch.samples.chunks_exact(batch.size).enumerate() {
        let (x, y) = data.train.gather(mb)?;
        let grad_scale = batch
            .mean
            .loss_scale(pipe_kernels::counted_labels(y.host()?));
        let id = batch.first_mb + i as u64;
        let update = id / batch.samples.len().div_ceil(batch.size).max(1) as u64 + 1;
        let mb = WholeMicrobatch {
            x,
            y,
            id,
            update,
            grad_scale,
            seed,
        };
        let s = whole_model_pass(be, model, params, (&mut *grads, i > 0), mb)?;
        loss += s.loss_sum;
        rows += s.rows;
    }
    Ok((loss, rows))
}
