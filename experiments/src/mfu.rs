//! Single-worker training throughput and model FLOP utilisation (MFU).
//!
//! Method: in one process, (1) time the GEMM `256x1024 * 1024x1024` on the same backend and
//! thread count (median of repeated runs: the machine's attainable matrix rate), then (2) train
//! the given model with the ordinary training step (forward, loss, two-part backward, optimizer
//! update) on random data and time each step after warm-up. MFU is
//! `6 * parameters * samples/s / gemm_rate`: the FLOPs a dense model needs per sample
//! (2 forward + 4 backward per parameter) over what the GEMM reaches. The two are interleaved
//! (GEMM, train, GEMM) so a noisy neighbour hurts both alike.
//!
//! The optimizer is plain SGD (with optional momentum) or AdamW at the settings of GPT-2
//! training runs ([`MfuOptimizer::Adamw`]); the PyTorch peer (`experiments/gpu/peer.py`) uses
//! the same. GPT-2 presets are measured at GPT-2's 50,257-token vocabulary.

use std::time::Instant;

use pipe_kernels::{AttentionShape, Backend, BackendKind, Tensor, Trans};
use pipe_stages::layers::{ForwardCtx, LayerSpec};
use pipe_stages::model::{Model, ModelSpec, Params, place_params};
use pipe_stages::optim::{Optimizer, OptimizerConfig, OptimizerKind};
use pipe_stages::profile::random_input;
use pipe_stages::train::{StepState, train_step};
use pipe_stages::transformer::Gpt2Shape;
use serde::Serialize;

use crate::{ExperimentError, median};

/// The optimizer a measured step runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MfuOptimizer {
    /// SGD at learning rate 1e-3, with [`MfuConfig::momentum`].
    #[default]
    Sgd,
    /// AdamW as GPT-2 runs train it: learning rate 6e-4, betas (0.9, 0.95), epsilon 1e-8,
    /// decoupled weight decay 0.1 on every parameter.
    Adamw,
}

impl MfuOptimizer {
    /// The optimizer's configuration and learning rate.
    pub(crate) fn config(self, momentum: f32) -> (OptimizerConfig, f32) {
        match self {
            MfuOptimizer::Sgd => (
                OptimizerConfig {
                    kind: OptimizerKind::Sgd,
                    momentum,
                    ..OptimizerConfig::default()
                },
                1e-3,
            ),
            MfuOptimizer::Adamw => (
                OptimizerConfig {
                    kind: OptimizerKind::Adamw,
                    momentum: 0.0,
                    beta1: 0.9,
                    beta2: 0.95,
                    eps: 1e-8,
                    weight_decay: 0.1,
                    ..OptimizerConfig::default()
                },
                6e-4,
            ),
        }
    }

    /// `sgd` or `adamw`.
    pub fn name(self) -> &'static str {
        match self {
            MfuOptimizer::Sgd => "sgd",
            MfuOptimizer::Adamw => "adamw",
        }
    }
}

impl std::str::FromStr for MfuOptimizer {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sgd" => Ok(MfuOptimizer::Sgd),
            "adamw" => Ok(MfuOptimizer::Adamw),
            other => Err(format!("unknown optimizer '{other}' (sgd or adamw)")),
        }
    }
}

/// GPT-2's BPE vocabulary, at which the `gpt2*` presets are measured.
pub const GPT2_VOCAB: usize = 50_257;

/// The model measured: a GPT-2 model (`gpt2`, or a `gpt2-*` preset) in the shape its preset
/// and `shape` give (`shape` over the preset, field by field), at `shape`'s vocabulary or else
/// GPT-2's; any other preset as named, which takes no shape.
///
/// # Errors
/// [`ExperimentError::Config`] for a shape that does not resolve or one given to another
/// model; the preset's errors.
pub(crate) fn measured_spec(name: &str, shape: &Gpt2Shape) -> Result<ModelSpec, ExperimentError> {
    use pipe_stages::transformer::{gpt_shape, is_gpt2};
    if is_gpt2(name) {
        let resolved = shape
            .resolve(gpt_shape(name))
            .map_err(ExperimentError::Config)?;
        let vocab = shape.vocab_size.unwrap_or(GPT2_VOCAB);
        let rows = shape.padded_rows(vocab).map_err(ExperimentError::Config)?;
        return Ok(ModelSpec::gpt(resolved, vocab, true).with_padded_vocab(rows));
    }
    if *shape != Gpt2Shape::default() {
        return Err(ExperimentError::Config(format!(
            "the GPT-2 shape flags (--n-layer, ...) apply to gpt2 models, not {name}"
        )));
    }
    Ok(ModelSpec::preset(name)?)
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct MfuConfig {
    /// Model preset.
    pub model: String,
    /// A gpt2 model's shape over its preset's (empty for other models).
    pub gpt2: Gpt2Shape,
    /// Samples per step.
    pub batch: usize,
    /// Compute threads.
    pub threads: usize,
    /// Timed training steps.
    pub steps: usize,
    /// Untimed warm-up steps.
    pub warmup: usize,
    /// SGD momentum (0 for plain SGD).
    pub momentum: f32,
    /// The optimizer.
    pub optimizer: MfuOptimizer,
    /// The backend measured (CUDA: device 0).
    pub backend: BackendKind,
}

impl Default for MfuConfig {
    fn default() -> Self {
        Self {
            model: "mlp-784-1024x16-10".into(),
            gpt2: Gpt2Shape::default(),
            batch: 256,
            threads: 2,
            steps: 20,
            warmup: 3,
            momentum: 0.0,
            optimizer: MfuOptimizer::Sgd,
            backend: BackendKind::default(),
        }
    }
}

/// The measurement.
#[derive(Clone, Debug, Serialize)]
pub struct MfuReport {
    /// Model preset.
    pub model: String,
    /// Parameters (a padded vocabulary's rows not counted).
    pub parameters: usize,
    /// Rows a padded vocabulary adds to the token table and the head
    /// (`--padded-vocab-size` less the vocabulary; 0 unpadded).
    pub vocab_padding: usize,
    /// Samples per step.
    pub batch: usize,
    /// Threads.
    pub threads: usize,
    /// The backend measured (`cpu`, `cuda`).
    pub backend: String,
    /// The precision of its matrix products (`f32`, `tf32`, `bf16`).
    pub precision: String,
    /// The CBLAS library computing the CPU's f32 products (`PIPE_CBLAS`: its path and
    /// version), or `None` for the `gemm` crate.
    pub products_library: Option<String>,
    /// The optimizer (`sgd`, `adamw`).
    pub optimizer: String,
    /// Tokens per sample (a language model's context; 1 otherwise).
    pub tokens_per_sample: usize,
    /// Tokens per second from the median step (samples per second for other models).
    pub tokens_per_s: f64,
    /// The device's peak memory held by the backend's pool over the run, in bytes, where
    /// the backend keeps one (CUDA).
    pub peak_device_bytes: Option<u64>,
    /// What pipe's memory model of a device expects that peak to be
    /// ([`pipe_stages::planning::device_memory::estimate_step`]), where the backend keeps a
    /// pool.
    pub peak_device_estimate_bytes: Option<u64>,
    /// Median seconds per training step.
    pub step_s_median: f64,
    /// Samples per second from the median step.
    pub samples_per_s: f64,
    /// Model FLOPs per sample, `6 * parameters`.
    pub flops_per_sample: f64,
    /// Achieved model GFLOP/s.
    pub model_gflops: f64,
    /// Median GFLOP/s of the 256x1024x1024 GEMM in the same run.
    pub gemm_gflops: f64,
    /// `model_gflops / gemm_gflops`.
    pub mfu: f64,
    /// The CPU's nominal f32 peak for the threads used, GFLOP/s ([`nominal_cpu_gflops`];
    /// `None` on a device backend or where the clock or vector width is not known).
    pub nominal_gflops: Option<f64>,
    /// The step's matrix products timed alone, per pass over every linear layer: where the
    /// step's time goes.
    pub passes: Vec<PassTime>,
    /// Seconds per step the matrix products take alone (sum of `passes`).
    pub gemm_s_per_step: f64,
    /// A transformer's attention and block step timed alone (empty for other models).
    pub components: Vec<ComponentTime>,
}

/// One part of a transformer's step timed alone.
#[derive(Clone, Debug, Serialize)]
pub struct ComponentTime {
    /// `attention` (the kernel's forward and backward) or `block step` (one transformer
    /// block's forward and backward).
    pub part: String,
    /// Median seconds.
    pub seconds: f64,
    /// GFLOP/s: attention counts `12 B T^2 C` (three times the forward's `Q K^T` and `P V`
    /// over the whole `T x T` tile, the masked half included); the block three times its
    /// forward FLOPs.
    pub gflops: f64,
    /// The reference GEMM's GFLOP/s, timed in alternation with this part.
    pub gemm_gflops: f64,
    /// `gflops` over `gemm_gflops`.
    pub of_gemm: f64,
}

/// One pass's matrix products (forward `X W`, input gradient `dY W^T`, weight gradient
/// `X^T dY`) over every linear layer of the model at the step's batch, timed alone.
#[derive(Clone, Debug, Serialize)]
pub struct PassTime {
    /// `forward`, `backward_input` or `backward_weight`.
    pub pass: String,
    /// Median seconds per step.
    pub seconds: f64,
    /// GFLOP/s over those products.
    pub gflops: f64,
}

/// GFLOP/s of the reference GEMM on `be`: the median of `reps` timings of eight products.
pub(crate) fn gemm_rate(be: &dyn Backend, reps: usize) -> Result<f64, ExperimentError> {
    let mut probe = GemmProbe::new(be)?;
    let rates = (0..reps)
        .map(|_| probe.rate(be))
        .collect::<Result<Vec<f64>, _>>()?;
    Ok(median(&rates))
}

/// The reference GEMM `256x1024 * 1024x1024`, warmed up, ready to time.
struct GemmProbe {
    a: Tensor,
    b: Tensor,
    c: Tensor,
}

impl GemmProbe {
    const SHAPE: (usize, usize, usize) = (256, 1024, 1024);

    fn new(be: &dyn Backend) -> Result<Self, ExperimentError> {
        let (m, k, n) = Self::SHAPE;
        let mut probe = Self {
            a: be.place(Tensor::full(&[m, k], 0.5))?,
            b: be.place(Tensor::full(&[k, n], 0.25))?,
            c: Tensor::default(),
        };
        for _ in 0..3 {
            probe.product(be)?;
        }
        Ok(probe)
    }

    fn product(&mut self, be: &dyn Backend) -> Result<(), ExperimentError> {
        be.matmul(&self.a, Trans::No, &self.b, Trans::No, &mut self.c, false)?;
        Ok(())
    }

    /// GFLOP/s of eight products in a row.
    fn rate(&mut self, be: &dyn Backend) -> Result<f64, ExperimentError> {
        let (m, k, n) = Self::SHAPE;
        be.synchronize()?;
        let t = Instant::now();
        for _ in 0..8 {
            self.product(be)?;
        }
        be.synchronize()?;
        Ok(8.0 * 2.0 * (m * n * k) as f64 / t.elapsed().as_secs_f64() / 1e9)
    }
}

/// Times the step's products alone: for every 2-D parameter `k x n` (a linear layer's
/// weight), the three products at `batch` rows (medians over `reps` rounds).
fn pass_times(
    be: &dyn Backend,
    weights: &[Vec<usize>],
    batch: usize,
    reps: usize,
) -> Result<Vec<PassTime>, ExperimentError> {
    let mut out = Vec::new();
    for pass in ["forward", "backward_input", "backward_weight"] {
        let operands: Vec<(Tensor, Tensor, Trans, Trans)> = weights
            .iter()
            .map(|w| {
                let (k, n) = (w[0], w[1]);
                let (a, b, ta, tb) = match pass {
                    "forward" => (
                        Tensor::full(&[batch, k], 0.5),
                        Tensor::full(&[k, n], 0.25),
                        Trans::No,
                        Trans::No,
                    ),
                    "backward_input" => (
                        Tensor::full(&[batch, n], 0.5),
                        Tensor::full(&[k, n], 0.25),
                        Trans::No,
                        Trans::Yes,
                    ),
                    _ => (
                        Tensor::full(&[batch, k], 0.5),
                        Tensor::full(&[batch, n], 0.25),
                        Trans::Yes,
                        Trans::No,
                    ),
                };
                Ok((be.place(a)?, be.place(b)?, ta, tb))
            })
            .collect::<Result<_, ExperimentError>>()?;
        let flops: f64 = weights
            .iter()
            .map(|w| 2.0 * (batch * w[0] * w[1]) as f64)
            .sum();
        let mut outs = vec![Tensor::default(); operands.len()];
        let mut times = Vec::with_capacity(reps);
        for round in 0..reps + 2 {
            be.synchronize()?;
            let t = Instant::now();
            for ((a, b, ta, tb), c) in operands.iter().zip(outs.iter_mut()) {
                be.matmul(a, *ta, b, *tb, c, false)?;
            }
            be.synchronize()?;
            if round >= 2 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        let seconds = median(&times);
        out.push(PassTime {
            pass: pass.into(),
            seconds,
            gflops: flops / seconds / 1e9,
        });
    }
    Ok(out)
}

/// True for models with transformer blocks (their figures count tokens).
pub(crate) fn is_language_model(model: &Model) -> bool {
    model
        .specs()
        .iter()
        .any(|l| matches!(l, LayerSpec::TransformerBlock { .. }))
}

/// FLOPs of one training step per sample. A dense model: 6 per parameter. A transformer also
/// spends FLOPs that no parameter counts (attention scores and their weighted sums): three
/// times its forward.
pub(crate) fn training_flops_per_sample(model: &Model) -> f64 {
    if is_language_model(model) {
        3.0 * model.flops_per_sample() as f64
    } else {
        6.0 * model.param_count() as f64
    }
}

/// A model, its state and one batch resident on a backend, ready to train step by step: the
/// step `pipe bench mfu` times, whose allocations `examples/step_allocations.rs` counts.
pub struct StepBench {
    model: Model,
    params: Params,
    grads: Params,
    opt: Optimizer,
    x: Tensor,
    y: Tensor<u32>,
    lr: f32,
    targets: usize,
    microbatches: u64,
}

/// The memory gate every run passes ([`pipe_stages::limits::admit_memory`]), for one worker's
/// step over `batch` samples on the host: the planner's estimate of its weights, gradients,
/// optimizer state and activations. A batch past this host's memory is refused before
/// anything is allocated, where it aborted the process.
///
/// # Errors
/// [`ExperimentError::Stage`] with the gate's refusal.
fn admit_step(
    model: &Model,
    batch: usize,
    optimizer: OptimizerKind,
) -> Result<(), ExperimentError> {
    let run =
        pipe_scheduler::ScheduleSpec::new(pipe_scheduler::Policy::Sequential, 1, 1).resolve()?;
    let holding = format!(
        "{} parameters' weights, gradients and optimizer state, and a batch's activations",
        model.param_count()
    );
    let need = pipe_stages::limits::MemoryNeed {
        bytes: model.worker_memory_bytes(&run, batch, optimizer.state_copies()),
        workers: 1,
        holding: &holding,
        lower: "give a smaller --batch",
    };
    pipe_stages::limits::admit_memory(&need, &pipe_stages::limits::Machine::detect())?;
    Ok(())
}

impl StepBench {
    /// `cfg`'s model, initialised, with its optimizer and one random batch, on `be`.
    ///
    /// # Errors
    /// An unknown model or shape, a batch past this host's memory, backend errors.
    pub fn new(be: &dyn Backend, cfg: &MfuConfig) -> Result<Self, ExperimentError> {
        let spec = measured_spec(&cfg.model, &cfg.gpt2)?;
        let model = Model::new(&spec)?;
        let (ocfg, lr) = cfg.optimizer.config(cfg.momentum);
        if be.device() == pipe_kernels::Device::Host {
            admit_step(&model, cfg.batch, ocfg.kind)?;
        }
        let params = place_params(be, model.init_params(0))?;
        let grads = place_params(be, model.zero_grads(0..model.len()))?;
        let opt = Optimizer::new(ocfg, &params, &model.optimizer_roles()).placed(be)?;
        let (_, rows) = model.output_shape().split_last().unwrap_or((&1, &[]));
        let classes = model.output_classes();
        let targets = cfg.batch * rows.iter().product::<usize>();
        let mut x_shape = vec![cfg.batch];
        x_shape.extend_from_slice(model.input_shape());
        // The batch lives on the device for the whole measurement, as in the PyTorch peer
        // (experiments/gpu/peer.py): the step is timed, not a data loader's copy.
        let x = be.place(random_input(&model, 0, &x_shape, 0, "mfu-x")?)?;
        let y = be.place_ids(Tensor::from_vec(
            &[targets],
            (0..targets).map(|i| (i % classes.max(1)) as u32).collect(),
        )?)?;
        Ok(Self {
            model,
            params,
            grads,
            opt,
            x,
            y,
            lr,
            targets,
            microbatches: 0,
        })
    }

    /// One training step: forward, loss, backward, update (queued; the caller waits).
    ///
    /// # Errors
    /// Kernel errors, a non-finite loss.
    pub fn step(&mut self, be: &dyn Backend) -> Result<(), ExperimentError> {
        let mut st = StepState {
            params: &mut self.params,
            grads: &mut self.grads,
            opt: &mut self.opt,
        };
        train_step(
            be,
            &self.model,
            &mut st,
            vec![(self.x.clone(), self.y.clone())],
            1.0 / self.targets as f32,
            self.lr,
            0,
            &mut self.microbatches,
        )?;
        Ok(())
    }
}

/// Where a step's time goes, operation by operation: `steps` steps (after one untimed) on a
/// fresh backend of the same kind, the device waited for after every operation, so each
/// figure is that operation's own time plus one wait (a lower bound on the launch gaps a
/// whole step hides). Seconds per step, largest first.
///
/// # Errors
/// As [`run`].
pub fn operation_breakdown(
    cfg: &MfuConfig,
    steps: usize,
) -> Result<Vec<OperationShare>, ExperimentError> {
    let be = pipe_kernels::Timed::by_operation(cfg.backend.open(cfg.threads, 0)?);
    let mut bench = StepBench::new(&be, cfg)?;
    bench.step(&be)?;
    be.synchronize()?;
    let before = be.operations();
    for _ in 0..steps {
        bench.step(&be)?;
    }
    be.synchronize()?;
    let per_step = steps.max(1) as f64;
    let mut out: Vec<OperationShare> = be
        .operations()
        .into_iter()
        .map(|(name, after)| {
            let earlier = before
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, t)| *t)
                .unwrap_or_default();
            OperationShare {
                operation: name.into(),
                calls_per_step: (after.calls - earlier.calls) as f64 / per_step,
                seconds_per_step: (after.seconds - earlier.seconds) / per_step,
            }
        })
        .filter(|o| o.calls_per_step > 0.0)
        .collect();
    out.sort_by(|a, b| b.seconds_per_step.total_cmp(&a.seconds_per_step));
    Ok(out)
}

/// One backend operation's share of a step ([`operation_breakdown`]).
#[derive(Clone, Debug, Serialize)]
pub struct OperationShare {
    /// The backend operation (`matmul`, `attention`, ...).
    pub operation: String,
    /// Calls per step.
    pub calls_per_step: f64,
    /// Seconds per step, the device waited for after each call.
    pub seconds_per_step: f64,
}

/// The nominal f32 peak of `threads` cores of this CPU, GFLOP/s: cores x clock x FLOPs per
/// cycle, where a cycle is taken to retire two fused multiply-adds of the widest vector the
/// CPU has (AVX-512: 64 FLOPs; AVX2 with FMA: 32), as Intel's server cores and AMD's Zen 5 do
/// (Zen 4 splits a 512-bit FMA in two: half this), at the clock `/proc/cpuinfo` reports.
/// `None` off x86-64 Linux or where the clock is not reported.
pub fn nominal_cpu_gflops(threads: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        let flops_per_cycle = if std::arch::is_x86_feature_detected!("avx512f") {
            64.0
        } else if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            32.0
        } else {
            8.0
        };
        let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
        let mhz: f64 = info
            .lines()
            .find(|l| l.starts_with("cpu MHz"))?
            .split(':')
            .nth(1)?
            .trim()
            .parse()
            .ok()?;
        Some(threads as f64 * mhz / 1e3 * flops_per_cycle)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = threads;
        None
    }
}

/// Renders a breakdown as a table.
pub fn render_breakdown(ops: &[OperationShare]) -> String {
    let total: f64 = ops.iter().map(|o| o.seconds_per_step).sum();
    let mut out = format!(
        "by operation (each waited for; {:.2} ms per step in all):\n",
        total * 1e3
    );
    for o in ops {
        out.push_str(&format!(
            "  {:<28} {:>6.1} calls {:>9.3} ms {:>5.1}%\n",
            o.operation,
            o.calls_per_step,
            o.seconds_per_step * 1e3,
            100.0 * o.seconds_per_step / total.max(1e-30)
        ));
    }
    out
}

/// What pipe's memory model of a device expects one step of `cfg` on `model` to hold at its
/// peak ([`pipe_stages::planning::device_memory`]).
fn device_estimate(model: &Model, cfg: &MfuConfig) -> Result<u64, ExperimentError> {
    let (opt, _) = cfg.optimizer.config(cfg.momentum);
    let inputs = pipe_stages::planning::device_memory::DeviceInputs {
        microbatch_size: cfg.batch,
        state_copies: opt.kind.state_copies(),
        bf16_operands: cfg.backend.precision() == pipe_kernels::Precision::Bf16,
    };
    let step = pipe_stages::planning::device_memory::estimate_step(model, inputs)?;
    Ok(step.total())
}

/// Runs the measurement.
///
/// # Errors
/// Bad model names, zero sizes, kernel failures.
pub fn run(cfg: &MfuConfig) -> Result<MfuReport, ExperimentError> {
    if cfg.batch == 0 || cfg.steps == 0 {
        return Err(ExperimentError::Config(
            "batch and steps must be positive".into(),
        ));
    }
    let be = cfg.backend.open(cfg.threads, 0)?;
    let be = be.as_ref();
    let mut bench = StepBench::new(be, cfg)?;
    let language = is_language_model(&bench.model);

    let gemm_before = gemm_rate(be, 15)?;
    let mut timed_steps = || -> Result<Vec<f64>, ExperimentError> {
        let mut times = Vec::with_capacity(cfg.steps);
        for i in 0..cfg.warmup + cfg.steps {
            be.synchronize()?;
            let t = Instant::now();
            bench.step(be)?;
            be.synchronize()?;
            if i >= cfg.warmup {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        Ok(times)
    };
    // Where a training worker runs its steps (`Backend::run_within`).
    let mut times = Ok(Vec::new());
    be.run_within(&mut || times = timed_steps())?;
    let times = times?;
    let StepBench {
        model,
        params,
        grads,
        ..
    } = bench;
    let gemm_after = gemm_rate(be, 15)?;
    let weights: Vec<Vec<usize>> = grads
        .iter()
        .flatten()
        .filter(|t| t.shape().len() == 2)
        .map(|t| t.shape().to_vec())
        .collect();
    let passes = pass_times(be, &weights, cfg.batch, 9)?;
    let gemm_s_per_step = passes.iter().map(|p| p.seconds).sum();
    let gemm = median(&[gemm_before, gemm_after]);
    let step = median(&times);
    let peak_device_bytes = be.peak_memory();
    let peak_device_estimate_bytes = match peak_device_bytes {
        Some(_) => Some(device_estimate(&model, cfg)?),
        None => None,
    };
    // A padded vocabulary's rows hold no parameter of the model and do no work of it: the
    // parameters and FLOPs counted are the unpadded model's.
    let unpadded = Model::new(&measured_spec(&cfg.model, &cfg.gpt2)?.with_padded_vocab(None))?;
    let parameters = unpadded.param_count();
    let vocab_padding = model.vocab_padding();
    let tokens_per_sample = if language {
        model.input_shape().first().copied().unwrap_or(1)
    } else {
        1
    };
    let samples_per_s = cfg.batch as f64 / step;
    let flops_per_sample = training_flops_per_sample(&unpadded);
    let components = if language {
        transformer_components(be, &model, &params, cfg.batch)?
    } else {
        Vec::new()
    };
    let model_gflops = flops_per_sample * samples_per_s / 1e9;
    Ok(MfuReport {
        model: cfg.model.clone(),
        parameters,
        vocab_padding,
        batch: cfg.batch,
        threads: be.threads(),
        backend: be.name().into(),
        precision: cfg.backend.precision().to_string(),
        products_library: match cfg.backend {
            BackendKind::Cpu(_) => pipe_kernels::cblas_library()?,
            BackendKind::Cuda(_) => None,
        },
        optimizer: cfg.optimizer.name().into(),
        tokens_per_sample,
        tokens_per_s: samples_per_s * tokens_per_sample as f64,
        peak_device_bytes,
        peak_device_estimate_bytes,
        step_s_median: step,
        samples_per_s,
        flops_per_sample,
        model_gflops,
        gemm_gflops: gemm,
        mfu: model_gflops / gemm,
        nominal_gflops: matches!(cfg.backend, BackendKind::Cpu(_))
            .then(|| nominal_cpu_gflops(be.threads()))
            .flatten(),
        passes,
        gemm_s_per_step,
        components,
    })
}

/// A transformer's parts timed alone at the step's batch: attention (its kernel forward and
/// backward) and one block's whole step (forward and fused backward), each as GFLOP/s and as
/// a fraction of the GEMM rate measured in alternation with it (see [`time_beside_gemm`]).
fn transformer_components(
    be: &dyn Backend,
    model: &Model,
    params: &Params,
    batch: usize,
) -> Result<Vec<ComponentTime>, ExperimentError> {
    let Some(i) = model
        .specs()
        .iter()
        .position(|l| matches!(l, LayerSpec::TransformerBlock { .. }))
    else {
        return Ok(Vec::new());
    };
    let LayerSpec::TransformerBlock { width, heads, .. } = model.specs()[i] else {
        return Ok(Vec::new());
    };
    let seq = model.shape_before(i).first().copied().unwrap_or(1);
    let mut shape = vec![batch];
    shape.extend_from_slice(model.shape_before(i));
    let x = be.place(random_input(model, i, &shape, 1, "mfu-block")?)?;
    let attention = AttentionShape {
        batch,
        seq,
        heads,
        width,
    };
    let qkv = be.place(random_input(
        model,
        i,
        &[batch * seq, 3 * width],
        2,
        "mfu-qkv",
    )?)?;
    let (mut out, mut lse, mut dqkv) = (Tensor::default(), Tensor::default(), Tensor::default());
    // Model FLOPs, as for the whole model: three times the forward's Q K^T and P V (2 T^2 C
    // each per sequence, the full tile as Megatron-LM and PaLM count it). The backward's
    // recomputation of the scores is work the kernel chooses to do, not model FLOPs, so it is
    // not counted.
    let tile = (batch * seq * seq * width) as f64;
    let mut probe = GemmProbe::new(be)?;
    let attention_s = time_beside_gemm(be, &mut probe, || {
        be.attention(&qkv, None, attention, &mut out, &mut lse)?;
        be.attention_backward(&qkv, None, &out, &lse, &out, attention, &mut dqkv)?;
        Ok(())
    })?;
    let layer = model.layer(i);
    let mut grads: Vec<Tensor> = params[i]
        .iter()
        .map(|p| be.place(Tensor::zeros(p.shape())))
        .collect::<Result<_, _>>()?;
    let ctx = ForwardCtx {
        train: true,
        seed: 0,
        recompute_attention: false,
        documents: None,
    };
    // Each round's input is copied before the clock starts: the forward consumes it, and a
    // 16 MiB copy is no part of the block's step.
    let mut inputs: Vec<Tensor> = (0..TIMED_ROUNDS + 2).map(|_| x.clone()).collect();
    let block_s = time_beside_gemm(be, &mut probe, || {
        let input = inputs.pop().unwrap_or_else(|| x.clone());
        let (y, saved) = layer.forward(be, &params[i], input, ctx.clone())?;
        layer.backward(be, &params[i], &saved, &y, &mut grads, false, true)?;
        Ok(())
    })?;
    let block_flops = 3.0 * (layer.flops_per_sample(model.shape_before(i)) * batch as u64) as f64;
    let part = |name: &str, (seconds, gemm): (f64, f64), flops: f64| ComponentTime {
        part: name.into(),
        seconds,
        gflops: flops / seconds / 1e9,
        gemm_gflops: gemm,
        of_gemm: flops / seconds / 1e9 / gemm,
    };
    Ok(vec![
        part("attention", attention_s, 12.0 * tile),
        part("block step", block_s, block_flops),
    ])
}

/// Timed calls of each transformer part (after two untimed ones).
const TIMED_ROUNDS: usize = 9;

/// Median seconds of `f` over [`TIMED_ROUNDS`] calls after two untimed ones, and the median
/// GEMM rate of `probe` timed just before each of them. On a shared machine the rate changes
/// from minute to minute; measured in alternation, the part and its reference see the same
/// neighbours, so their ratio holds where either alone does not.
fn time_beside_gemm(
    be: &dyn Backend,
    probe: &mut GemmProbe,
    mut f: impl FnMut() -> Result<(), pipe_kernels::KernelError>,
) -> Result<(f64, f64), ExperimentError> {
    let (mut times, mut rates) = (Vec::new(), Vec::new());
    for round in 0..TIMED_ROUNDS + 2 {
        let rate = probe.rate(be)?;
        let t = Instant::now();
        f()?;
        be.synchronize()?;
        if round >= 2 {
            times.push(t.elapsed().as_secs_f64());
            rates.push(rate);
        }
    }
    Ok((median(&times), median(&rates)))
}

/// A short human-readable summary.
pub fn render(r: &MfuReport) -> String {
    let transformer = !r.components.is_empty();
    let flop_rule = if transformer {
        "3 x forward FLOPs x samples/s"
    } else {
        "6 x params x samples/s"
    };
    let mut out = format!(
        "model {} ({} parameters), batch {}, {} ({} products, {}) on {} threads\n\
         step (median)        {:.2} ms\n\
         throughput           {:.0} samples/s, {:.0} tokens/s\n\
         model FLOP rate      {:.1} GFLOP/s ({flop_rule})\n\
         GEMM 256x1024x1024   {:.1} GFLOP/s (same run)\n\
         MFU                  {:.3}\n",
        r.model,
        r.parameters,
        r.batch,
        r.backend,
        r.precision,
        r.optimizer,
        r.threads,
        r.step_s_median * 1e3,
        r.samples_per_s,
        r.tokens_per_s,
        r.model_gflops,
        r.gemm_gflops,
        r.mfu,
    );
    if let Some(library) = &r.products_library {
        out.push_str(&format!("f32 products by    {library} (PIPE_CBLAS)\n"));
    }
    if r.vocab_padding > 0 {
        out.push_str(&format!(
            "vocabulary padding   {} rows (computed; not counted in parameters or FLOPs)\n",
            r.vocab_padding
        ));
    }
    if let Some(nominal) = r.nominal_gflops {
        out.push_str(&format!(
            "CPU nominal peak     {nominal:.1} GFLOP/s (2 FMA/cycle); MFU against it {:.3}\n",
            r.model_gflops / nominal
        ));
    }
    if let Some(bytes) = r.peak_device_bytes {
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        let estimate = r.peak_device_estimate_bytes.map_or(String::new(), |e| {
            format!(
                "; pipe's memory model {:.2} GiB, {:.3} of it",
                gib(e),
                e as f64 / bytes.max(1) as f64
            )
        });
        out.push_str(&format!(
            "peak device memory   {:.2} GiB (the backend's pool{estimate})\n",
            gib(bytes)
        ));
    }
    // The pass timing covers the model's top-level linear layers; a transformer's live inside
    // its blocks, which the parts below time instead.
    if !transformer {
        out.push_str(&format!(
            "products alone       {:.2} ms per step ({:.0}% of the step), by pass:\n",
            r.gemm_s_per_step * 1e3,
            100.0 * r.gemm_s_per_step / r.step_s_median
        ));
        for p in &r.passes {
            out.push_str(&format!(
                "  {:<18} {:>7.2} ms  {:>6.1} GFLOP/s\n",
                p.pass,
                p.seconds * 1e3,
                p.gflops
            ));
        }
    }
    if !r.components.is_empty() {
        out.push_str("transformer parts alone, against the GEMM timed in alternation with each:\n");
    }
    for c in &r.components {
        out.push_str(&format!(
            "  {:<18} {:>7.2} ms  {:>6.1} GFLOP/s  {:.2} of GEMM ({:.1} GFLOP/s)\n",
            c.part,
            c.seconds * 1e3,
            c.gflops,
            c.of_gemm,
            c.gemm_gflops
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_run_reports_consistent_numbers() {
        let r = run(&MfuConfig {
            model: "mlp-64-128-10".into(),
            batch: 32,
            threads: 1,
            steps: 3,
            warmup: 1,
            momentum: 0.9,
            ..MfuConfig::default()
        })
        .unwrap();
        assert_eq!(r.parameters, 64 * 128 + 128 + 128 * 10 + 10);
        assert!(r.samples_per_s > 0.0 && r.gemm_gflops > 0.0);
        assert!((r.mfu - r.model_gflops / r.gemm_gflops).abs() < 1e-12);
        assert!(render(&r).contains("MFU"));
        assert_eq!(r.passes.len(), 3);
        let sum: f64 = r.passes.iter().map(|p| p.seconds).sum();
        assert!((r.gemm_s_per_step - sum).abs() < 1e-12 && sum > 0.0);
        assert!(r.components.is_empty(), "an MLP has no transformer parts");
    }

    #[test]
    fn transformer_reports_attention_and_block_against_gemm() {
        let r = run(&MfuConfig {
            model: "gpt-mini".into(),
            batch: 1,
            threads: 1,
            steps: 1,
            warmup: 0,
            momentum: 0.0,
            ..MfuConfig::default()
        })
        .unwrap();
        // Three times the forward FLOPs, which exceed 2 x parameters by attention's scores.
        assert!(r.flops_per_sample > 6.0 * r.parameters as f64 * 0.5);
        let parts: Vec<&str> = r.components.iter().map(|c| c.part.as_str()).collect();
        assert_eq!(parts, ["attention", "block step"]);
        for c in &r.components {
            assert!(c.gflops > 0.0 && (c.of_gemm - c.gflops / c.gemm_gflops).abs() < 1e-9);
        }
        assert!(render(&r).contains("of GEMM"));
    }
}
