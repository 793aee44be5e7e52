//! What every trainer shares around its loop: the statistics of an update and of an epoch
//! (which [`crate::pipeline::Observer`] receives), the run's data ([`load_data`]) and
//! evaluation ([`evaluate`]). The loop itself is the pipelined executor's segment loop
//! ([`crate::pipeline::train_pipelined`]), which also runs one worker over the whole model
//! (`sequential` on one stage); delayed SGD ([`crate::delayed`]) has its own.

use std::time::Instant;

use pipe_kernels::{Backend, Tensor};
use serde::{Deserialize, Serialize};

use crate::config::{DatasetKind, RunConfig};
use crate::data::{Dataset, Splits, mnist, synthetic};
use crate::error::{Result, StageError};
use crate::layer::Keep;
use crate::model::{Model, Params, no_notice};
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
    /// The global gradient norm before clipping (when clipping; the loss stage's, see
    /// `docs/training.md` for which norm an asynchronous pipeline's stages add).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
}

/// A worker the run lost, when its loss was seen: a launched worker process's end as its
/// launcher reaps it, in the log beside the updates around it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LostStats {
    /// The worker (its rank).
    pub worker: u32,
    /// How it ended (`killed by signal 9`, an exit status).
    pub cause: String,
    /// Seconds since training began on the clock of the chief's update records, from the
    /// system clock of the launcher's host and the chief's (hosts apart: as far apart as
    /// their clocks); absent where the chief had not yet said when its training began.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elapsed_s: Option<f64>,
}

/// A step of a surviving worker process's recovery from a lost replica
/// (docs/reliability.md, "Surviving faults"), in the order a survivor passes them.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum RecoveryPhase {
    /// Its program stopped on the loss (its link to the lost worker closed, or a peer or its
    /// launcher stopped it); where it goes on where it stood, a call of its endpoint failed
    /// on the loss.
    Stopped,
    /// Its launcher's word of the loss (which worker, and whether a replacement comes) has
    /// reached it.
    Told,
    /// Its launcher has named where every worker of the mesh without the lost one listens
    /// (the lost rank's new endpoint, where its stage's other replica hosts it, among them):
    /// every survivor has had the word and said where it listens.
    Named,
    /// Its mesh without the lost worker is connected (over QUIC, regrouped; with the lost
    /// rank hosted by its stage's other replica where the segment is taken over).
    Meshed,
    /// The takeover is settled: the version each worker resumes at.
    Planned,
    /// Its programs run again, or its program goes on where it stood (on the adopter, the
    /// lost worker's runs too).
    Restarted,
}

/// A [`RecoveryPhase`] a worker reached, dated as [`LostStats`] is: where a recovery's time
/// goes, worker by worker, in the run log.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RecoveryStats {
    /// The worker (its rank before the layout changes).
    pub worker: u32,
    /// The phase it reached.
    pub phase: RecoveryPhase,
    /// As [`LostStats::elapsed_s`], by the worker's system clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elapsed_s: Option<f64>,
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

/// A validation pass at a drain point inside an epoch (`--eval-every`), on the same windows
/// as each epoch's end evaluates.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct EvalStats {
    /// The epoch it falls in, from 1.
    pub epoch: u64,
    /// Optimizer steps so far (the weights evaluated are these steps' result).
    pub steps: u64,
    /// Mean test loss per target (a language model's validation loss, nats per token).
    pub test_loss: f64,
    /// Test accuracy in `[0, 1]`.
    pub test_accuracy: f64,
    /// Seconds since training began.
    pub elapsed_s: f64,
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
    /// The most resident memory a worker of the stage's held at once (`VmHWM`), where each
    /// worker is its own process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_resident_bytes: Option<u64>,
    /// The most device memory a worker of the stage's backend held for tensors at once (its
    /// pool's peak; GPU workers only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_device_bytes: Option<u64>,
    /// Activations and gradients the stage's workers lent as device buffers to worker
    /// processes of their host in the epoch (`pipe_stages::pipeline::loans`), where any were.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffers_lent: Option<u64>,
}

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
        DatasetKind::Tokens => {
            let (Some(dir), Some(corpus)) = (cfg.data_dir.as_deref(), &cfg.corpus) else {
                return Err(StageError::Config(
                    "a tokenized corpus needs its directory: --dataset tokens:DIR".into(),
                ));
            };
            let context = model.input_shape().first().copied().unwrap_or(1);
            let data = crate::data::token_corpus(
                dir,
                context,
                corpus.holdout,
                corpus.eval_windows,
                corpus.pack_documents,
            )?;
            let found = data.train.corpus_fingerprint();
            if found.as_deref() != Some(corpus.fingerprint.as_str()) {
                return Err(StageError::Data {
                    source_name: dir.display().to_string(),
                    reason: "the corpus changed since the run was configured (its manifest's \
                             fingerprint differs)"
                        .into(),
                });
            }
            data
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
    let (_, rows) = model.output_shape().split_last().unwrap_or((&0, &[]));
    let out = model.output_classes();
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

/// Targets an evaluation batch holds (a classifier's samples; a language model's tokens).
pub const EVAL_BATCH: usize = 1000;

/// Samples of one evaluation batch of `EVAL_BATCH` targets, for a dataset with `targets`
/// targets per sample (what the chief's end of an epoch holds at once).
pub fn eval_samples(targets: usize) -> usize {
    samples_per_batch(EVAL_BATCH, targets)
}

/// Samples in a batch of `batch` targets, `targets` per sample: at least
/// `MIN_EVAL_SAMPLES` windows of a language model, at most `batch` samples.
fn samples_per_batch(batch: usize, targets: usize) -> usize {
    (batch / targets.max(1))
        .max(MIN_EVAL_SAMPLES)
        .min(batch.max(1))
}

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
    let samples = samples_per_batch(batch, data.targets);
    for chunk in order.chunks(samples) {
        let (x, y) = data.gather(chunk)?;
        let documents = model.documents(be, &x)?;
        let (x, y) = (be.place(x)?, be.place_ids(y)?);
        let (logits, _) = model.forward_range(
            be,
            0..model.len(),
            params,
            x,
            Keep::Nothing,
            0,
            0,
            documents.as_ref(),
        )?;
        let s = model.loss().evaluate(be, &logits, &y, 0.0, None)?;
        loss += s.loss_sum;
        correct += s.correct;
        rows += s.rows;
    }
    let n = rows.max(1) as f64;
    Ok((loss / n, correct as f64 / n))
}

/// Where a forward pass of `params` over `data` first stops being finite, when one does: the
/// first layer whose output holds a value that is not, on the first batch where one does, and
/// the parameter of largest magnitude among that layer and those before it. This names what
/// diverged when the weights are still finite but a step made them so large that the next
/// forward pass overflows (`--lr 1e30`). Read in batches of `batch` targets.
///
/// # Errors
/// Kernel errors.
pub fn first_overflow(
    be: &dyn Backend,
    model: &Model,
    params: &Params,
    data: &Dataset,
    batch: usize,
) -> Result<Option<String>> {
    let order: Vec<u32> = (0..data.len() as u32).collect();
    for chunk in order.chunks(samples_per_batch(batch, data.targets)) {
        let (x, _) = data.gather(chunk)?;
        let documents = model.documents(be, &x)?;
        let mut h = be.place(x)?;
        for i in 0..model.len() {
            let layer = i..i + 1;
            let (out, _) = model.forward_range(
                be,
                layer.clone(),
                &params[layer],
                h,
                Keep::Nothing,
                0,
                0,
                documents.as_ref(),
            )?;
            if be.first_non_finite(&[&out])?.is_some() {
                return Ok(Some(overflow_at(be, model, params, i)?));
            }
            h = out;
        }
    }
    Ok(None)
}

/// [`first_overflow`]'s words for layer `i`'s output: the layer, and the largest parameter
/// of layers `..=i` with its magnitude.
fn overflow_at(be: &dyn Backend, model: &Model, params: &Params, i: usize) -> Result<String> {
    let mut largest: Option<(f32, usize, usize)> = None;
    for (l, layer) in params.iter().enumerate().take(i + 1) {
        for (slot, t) in layer.iter().enumerate() {
            let host = crate::model::host_tensor(be, t.clone())?;
            let max = host.host()?.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            if largest.is_none_or(|(m, _, _)| max > m) {
                largest = Some((max, l, slot));
            }
        }
    }
    let kind = model.layer(i).kind();
    Ok(match largest {
        Some((max, l, slot)) => {
            let id = model.param_id(l, slot);
            let name = model
                .param_table()
                .get(id)
                .map_or_else(|| format!("layers.{l}"), |e| e.name.clone());
            format!(
                "the output of layer {i} ({kind}) overflows, the largest parameter up to it \
                 being {name} at magnitude {max:e}"
            )
        }
        None => format!("the output of layer {i} ({kind}) overflows"),
    })
}

/// What one optimizer step changes: parameters, gradient buffers and optimizer state.
#[derive(Debug)]
pub struct StepState<'a> {
    /// Parameters, updated in place.
    pub params: &'a mut Params,
    /// Gradient buffers (overwritten).
    pub grads: &'a mut Params,
    /// Optimizer: its plain step (one worker over the whole model has no delay to correct).
    pub opt: &'a mut Optimizer,
}
/// One microbatch of [`whole_model_pass`]: its inputs and targets as the data gives them
/// (on the host), its number in the run and its update's, its loss gradient's scale, and the
/// run's seed (dropout).
pub(crate) struct WholeMicrobatch {
    pub(crate) x: Tensor,
    pub(crate) y: Tensor<u32>,
    pub(crate) id: u64,
    pub(crate) update: u64,
    pub(crate) grad_scale: f32,
    pub(crate) seed: u64,
}

/// One microbatch through the whole model on one worker: the forward, the loss (its gradient
/// scaled by `mb.grad_scale`), and the backward into `grads`, added into them when
/// `accumulate`. What the reference trainer and delayed SGD share.
///
/// # Errors
/// Kernel errors, or [`StageError::NonFinite`] naming the microbatch whose loss is not finite.
pub(crate) fn whole_model_pass(
    be: &dyn Backend,
    model: &Model,
    params: &Params,
    (grads, accumulate): (&mut Params, bool),
    mb: WholeMicrobatch,
) -> Result<pipe_kernels::LossStats> {
    let n = model.len();
    let documents = model.documents(be, &mb.x)?;
    let (x, y) = (be.place(mb.x)?, be.place_ids(mb.y)?);
    let keep = model.training(0);
    let (logits, saved) = model.forward_range(
        be,
        0..n,
        params,
        x,
        keep,
        mb.seed,
        mb.id,
        documents.as_ref(),
    )?;
    let mut dy = Tensor::default();
    let s = model
        .loss()
        .evaluate(be, &logits, &y, mb.grad_scale, Some(&mut dy))?;
    if !s.loss_sum.is_finite() {
        return Err(StageError::NonFinite {
            what: format!("the loss of microbatch {}", mb.id),
            update: mb.update,
            detail: String::new(),
        });
    }
    let dy = (dy, false);
    model.backward_range(
        be,
        0..n,
        params,
        &saved,
        dy,
        grads,
        accumulate,
        &mut no_notice,
    )?;
    Ok(s)
}

/// One update of the whole model outside the executor: forward and backward over each
/// microbatch in `batches` (inputs and labels, moved to the backend here), summing gradients
/// (each scaled by `grad_scale` at the loss), then one plain optimizer step at `lr` (no delay
/// correction: every gradient meets the weights it was computed at). Training runs
/// go through the executor; this is the bare step the benchmarks time as a worker's limit
/// (`pipe bench pipeline`'s one-thread worker, the MFU report).
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
    let batches_len = batches.len().max(1);
    for (i, (x, y)) in batches.into_iter().enumerate() {
        let mb = WholeMicrobatch {
            x,
            y,
            id: *microbatch_id,
            update: *microbatch_id / batches_len as u64 + 1,
            grad_scale,
            seed,
        };
        *microbatch_id += 1;
        let s = whole_model_pass(be, model, st.params, (&mut *st.grads, i > 0), mb)?;
        loss += s.loss_sum;
    }
    model.sum_tied(be, &mut [(0, &mut *st.grads)])?;
    let update = *microbatch_id / batches_len as u64;
    let seen = st.opt.step(be, st.params, st.grads, lr)?;
    model.check_update(be, (0, st.grads, st.params), &seen.0, update)?;
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
