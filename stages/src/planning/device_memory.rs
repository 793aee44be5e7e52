//! pipe's memory model of a device: what each worker's device backend (`--backend cuda`) holds
//! at its peak, term by term, before the run starts, in the count the backend itself reports
//! (`Backend::peak_memory`: the CUDA pool's blocks in use, each rounded up to its size class,
//! [`pipe_kernels::cuda::block_bytes`]).
//!
//! The host model ([`super::memory`]) counts what a worker process holds; on a device most of
//! that moves to the GPU and the rest stays behind. The device holds:
//! - **core**: its stages' weights, gradients and optimizer moments (the drained state that
//!   checkpoints read stays on the host between segments);
//! - **versions**: the older weight versions weight stashing keeps;
//! - **activations**: what each microbatch in flight keeps from its forward to its backward;
//! - **working**: what a backward rebuilds under recomputation, and the gradients it passes
//!   back ([`DEVICE_GRADIENT_FACTOR`] of the largest layer's one pass);
//! - **loss**: at the last stage, the logits and their gradient;
//! - **messages**: an activation from the stage before and a gradient from the stage after,
//!   received and placed on the device ahead of the action that takes them;
//! - **scratch**: under `--precision bf16`, the bf16 copies of a product's two operands that
//!   the backend rounds them into (`to_bf16`), at the largest product.
//!
//! Every term is counted tensor by tensor and each tensor rounded to the block the pool serves
//! it from, since a tensor just over a power of two takes twice its size below 64 MiB. What a
//! layer keeps is found by running it on an emulated device ([`pipe_kernels::EmulatedDevice`])
//! on a one-sample probe: a device tensor's clone shares its buffer, so a buffer two layers
//! keep (or a layer keeps twice) is counted once, as on the GPU, where the host model counts a
//! clone as the copy it is on the host.
//!
//! The one fitted constant, the gradients' share of a pass, was fitted to the emulated
//! device's own peaks, which count the buffers the code above the backend holds exactly as the
//! pool does (`stages/tests/device_memory.rs` holds the estimate within a tenth of them); what
//! the CUDA backend allocates inside an operation besides the bf16 copies (a reduction's
//! partial sums, a few flags) is a small fraction of these. Not counted: the CUDA context and
//! the workspaces of cuBLAS and cuBLASLt, which are held outside the pool, and the chief's
//! evaluation at an epoch's end.

use std::collections::HashMap;

use pipe_kernels::{Backend, EmulatedDevice, Storage, Tensor, cuda::block_bytes};
use pipe_scheduler::planner::memory::extra_versions;

use super::memory::{
    MemoryTerm, ProbeShape, WorkerMemory, elements, layer_recompute, peak_in_flight,
};
use crate::config::RunConfig;
use crate::error::{Result, StageError};
use crate::layer::{Keep, Recompute, Saved};
use crate::model::Model;
use crate::pipeline::RunPlan;

/// The gradients one pass's backward holds on a device, as a share of the largest layer's
/// full activations, input and output (each in its block): the output's and input's gradients
/// and the layer's inner ones while they are passed back. Fitted to the emulated device's peaks
/// (0.15 to 0.53 of the pass where nothing is recomputed) and cross-checked against the one
/// GPU measurement, GPT-2 124M's step on an H200 (`docs/gpu.md`). Far under the host's
/// [`pipe_scheduler::planner::memory::WORKING_FACTOR`]: the pool hands a freed block out again
/// at once, where the host allocator keeps freed pages resident, and what the forward kept is
/// counted once, in the activations.
pub const DEVICE_GRADIENT_FACTOR: f64 = 0.25;

/// Copies of the logits the last stage holds on a device while it computes the loss: the
/// logits and their gradient.
pub const DEVICE_LOSS_COPIES: f64 = 2.0;

/// What a run's device workers hold, besides the facts in its plan.
#[derive(Clone, Copy, Debug)]
pub struct DeviceInputs {
    /// Samples per microbatch.
    pub microbatch_size: usize,
    /// Copies of the parameters the optimizer keeps beyond the weights (the gradient and its
    /// moments, [`crate::optim::OptimizerKind::state_copies`]).
    pub state_copies: f64,
    /// Products round their operands to bf16 copies first (`--precision bf16`).
    pub bf16_operands: bool,
}

/// The device estimate for every worker of the pipelined run `cfg` (its partition settled,
/// given or by FLOPs).
///
/// # Errors
/// A partition still to be measured; an impossible layout; a layer the probe cannot run.
pub fn estimate_run_device(cfg: &RunConfig) -> Result<Vec<WorkerMemory>> {
    let model = Model::new(&cfg.model)?.with_stage_recompute(cfg.recompute.clone());
    let partition = crate::pipeline::run_partition(cfg)?;
    let updates = cfg.stages as u32 + 2;
    let spec = cfg.schedule_spec(pipe_scheduler::Length::Updates(updates));
    let plan = RunPlan::new(&model, &spec, partition)?;
    let inputs = DeviceInputs {
        microbatch_size: cfg.microbatch_size,
        state_copies: cfg.optimizer.kind.state_copies(),
        bf16_operands: cfg.backend.precision() == pipe_kernels::Precision::Bf16,
    };
    estimate_device(&model, &plan, inputs)
}

/// The device estimate for every worker of `plan` (see the module documentation).
///
/// # Errors
/// A layer the probe cannot run.
pub fn estimate_device(
    model: &Model,
    plan: &RunPlan,
    inputs: DeviceInputs,
) -> Result<Vec<WorkerMemory>> {
    let probe = Probe::new(model)?;
    let layers = (0..model.len())
        .map(|i| probe.layer(i))
        .collect::<Result<Vec<_>>>()?;
    let recompute = layer_recompute(model, plan);
    let stages = (0..plan.partition.stages())
        .map(|s| StageBytes::of(&probe, &layers, plan, &recompute, s, inputs))
        .collect::<Result<Vec<_>>>()?;
    let schedule = &plan.schedule;
    let mut out = Vec::new();
    for w in 0..schedule.workers() {
        let own: Vec<u32> = schedule.layout().stages_of(w).collect();
        let held = peak_in_flight(&schedule.programs[w as usize], &own);
        let mut terms = Terms::default();
        for (&s, &n) in own.iter().zip(&held.per_stage) {
            let stage = &stages[s as usize];
            let n = f64::from(n);
            terms.core += (1.0 + inputs.state_copies) * stage.params;
            terms.versions += extra_versions(schedule.resolved.policy, n) * stage.params;
            terms.activations += n * stage.kept;
            terms.working = terms.working.max(stage.working);
            terms.loss += stage.loss;
            terms.messages += stage.messages;
            terms.scratch = terms.scratch.max(stage.scratch);
        }
        out.push(WorkerMemory {
            worker: w,
            terms: terms.named(),
        });
    }
    Ok(out)
}

/// One stage's bytes on a device at the run's microbatch size, each tensor in its block,
/// whichever worker holds it.
struct StageBytes {
    /// Its parameters.
    params: f64,
    /// What a microbatch keeps from its forward to its backward.
    kept: f64,
    /// Its largest layer's backward: what it rebuilds under recomputation, and the gradients.
    working: f64,
    /// At the last stage, the logits and their gradient.
    loss: f64,
    /// An activation and a gradient received ahead of their actions.
    messages: f64,
    /// The bf16 copies of its largest product's operands (bf16 only).
    scratch: f64,
}

impl StageBytes {
    /// Stage `s` of `plan`, its layers `layers` as probed, under the run's `recompute`.
    fn of(
        probe: &Probe<'_>,
        layers: &[LayerBuffers],
        plan: &RunPlan,
        recompute: &[Recompute],
        s: usize,
        inputs: DeviceInputs,
    ) -> Result<Self> {
        let b = inputs.microbatch_size as f64;
        let blocks = |sizes: Vec<f64>| -> f64 { sizes.iter().map(|&k| block(k * b)).sum() };
        let range = plan.partition.range(s);
        let kind = recompute.get(range.start).copied().unwrap_or_default();
        let mut working = 0.0f64;
        let mut scratch = 0.0f64;
        for l in range.clone() {
            let layer = &layers[l];
            // What the backward rebuilds: its full activations beyond what the forward kept.
            let rebuilt = match kind {
                Recompute::None => 0.0,
                _ => (layer.full_blocks(b) - blocks(probe.kept(l..l + 1, kind)?)).max(0.0),
            };
            working = working.max(rebuilt + DEVICE_GRADIENT_FACTOR * layer.pass(b));
            if inputs.bf16_operands {
                scratch = scratch.max(layer.bf16_copies(b));
            }
        }
        let last = s + 1 == plan.partition.stages();
        let logits = layers.last().map_or(0.0, |l| l.output);
        let gradient_in = if last {
            0.0
        } else {
            block(layers[range.end - 1].output * b)
        };
        let activation_in = if s > 0 {
            block(layers[range.start].input * b)
        } else {
            0.0
        };
        Ok(StageBytes {
            params: range.clone().map(|l| layers[l].params).sum(),
            kept: blocks(probe.kept(range, kind)?),
            working,
            loss: if last {
                DEVICE_LOSS_COPIES * block(logits * b)
            } else {
                0.0
            },
            messages: gradient_in + activation_in,
            scratch,
        })
    }
}

/// Bytes of the block a tensor of `bytes` takes.
fn block(bytes: f64) -> f64 {
    block_bytes(bytes.ceil() as usize) as f64
}

/// A worker's device terms while they are added up.
#[derive(Default)]
struct Terms {
    core: f64,
    versions: f64,
    activations: f64,
    working: f64,
    loss: f64,
    messages: f64,
    scratch: f64,
}

impl Terms {
    /// The terms in the module documentation's order, in whole bytes.
    fn named(&self) -> Vec<MemoryTerm> {
        [
            ("core", self.core),
            ("versions", self.versions),
            ("activations", self.activations),
            ("working", self.working),
            ("loss", self.loss),
            ("messages", self.messages),
            ("scratch", self.scratch),
        ]
        .into_iter()
        .map(|(name, bytes)| MemoryTerm {
            name,
            bytes: bytes.round() as u64,
        })
        .collect()
    }
}

/// One layer on a device: its parameters' blocks, and per sample at the model's full length
/// (before rounding) its full activations buffer by buffer, its input and its output.
struct LayerBuffers {
    /// Its parameter tensors' blocks added up (a use of a tied parameter holds its own).
    params: f64,
    /// Its largest parameter tensor.
    largest_param: f64,
    /// What its forward keeps without recomputation, buffer by buffer, per sample.
    full: Vec<f64>,
    /// Its input per sample.
    input: f64,
    /// Its output per sample.
    output: f64,
}

impl LayerBuffers {
    /// Its full activations at `b` samples, each in its block.
    fn full_blocks(&self, b: f64) -> f64 {
        self.full.iter().map(|&f| block(f * b)).sum()
    }

    /// One pass through the layer at `b` samples: its full activations, input and output.
    fn pass(&self, b: f64) -> f64 {
        self.full_blocks(b) + block(self.input * b) + block(self.output * b)
    }

    /// The bf16 copies of a product's operands at `b` samples (two bytes a value): the layer's
    /// input and its largest parameter.
    fn bf16_copies(&self, b: f64) -> f64 {
        if self.largest_param == 0.0 {
            return 0.0;
        }
        block(self.input * b / 2.0) + block(self.largest_param / 2.0)
    }
}

/// The one-sample probe ([`ProbeShape`]) on an emulated device.
struct Probe<'m> {
    model: &'m Model,
    device: EmulatedDevice,
    shape: ProbeShape,
}

impl<'m> Probe<'m> {
    fn new(model: &'m Model) -> Result<Self> {
        Ok(Probe {
            model,
            device: EmulatedDevice::new(0).map_err(StageError::from)?,
            shape: ProbeShape::of(model),
        })
    }

    /// The probe's input of layer `i`: one sample of zeros, on the device.
    fn input(&self, i: usize) -> Result<Tensor> {
        let shape = self.shape.input(self.model, i);
        Ok(self.device.place(Tensor::zeros(&shape))?)
    }

    /// Zero parameters of `range`, on the device.
    fn params(&self, range: std::ops::Range<usize>) -> Result<Vec<Vec<Tensor>>> {
        self.model
            .zero_grads(range)
            .into_iter()
            .map(|layer| {
                layer
                    .into_iter()
                    .map(|t| Ok(self.device.place(t)?))
                    .collect()
            })
            .collect()
    }

    /// Layer `i`'s buffers.
    fn layer(&self, i: usize) -> Result<LayerBuffers> {
        let shapes = self.model.layer(i).param_shapes();
        let sizes: Vec<f64> = shapes
            .iter()
            .map(|(_, s)| (elements(s) * 4) as f64)
            .collect();
        let x = self.input(i)?;
        let params = self.params(i..i + 1)?;
        let ctx = ProbeShape::ctx();
        let (y, full) = self
            .model
            .layer(i)
            .forward(&self.device, &params[0], x.clone(), ctx)
            .map_err(|source| StageError::Kernel {
                layer: i,
                kind: self.model.layer(i).kind(),
                op: "device memory probe",
                source,
            })?;
        Ok(LayerBuffers {
            params: sizes.iter().map(|&p| block(p)).sum(),
            largest_param: sizes.iter().copied().fold(0.0, f64::max),
            full: self.distinct(std::slice::from_ref(&full), &params),
            input: x.bytes() as f64 * self.shape.scale,
            output: y.bytes() as f64 * self.shape.scale,
        })
    }

    /// What a stage of `range` keeps per sample from its forward to its backward under
    /// `recompute`, buffer by buffer.
    fn kept(&self, range: std::ops::Range<usize>, recompute: Recompute) -> Result<Vec<f64>> {
        let x = self.input(range.start)?;
        let params = self.params(range.clone())?;
        let keep = Keep::Train(recompute);
        let (_, saved) =
            self.model
                .forward_range(&self.device, range, &params, x, keep, 0, 0, None)?;
        Ok(self.distinct(&saved, &params))
    }

    /// The distinct device buffers `saved` holds that are not `params`, per sample at the full
    /// length.
    fn distinct(&self, saved: &[Saved], params: &[Vec<Tensor>]) -> Vec<f64> {
        let mut seen: HashMap<usize, usize> = HashMap::new();
        for s in saved {
            buffers(s, &mut seen);
        }
        for t in params.iter().flatten() {
            if let Some(key) = buffer_key(t) {
                seen.remove(&key);
            }
        }
        let mut sizes: Vec<f64> = seen
            .into_values()
            .map(|bytes| bytes as f64 * self.shape.scale)
            .collect();
        sizes.sort_by(f64::total_cmp);
        sizes
    }
}

/// The buffer a device tensor lives in, as an identity: clones share it.
fn buffer_key(t: &Tensor) -> Option<usize> {
    match t.storage() {
        Storage::Device(m) => Some(std::sync::Arc::as_ptr(m).cast::<()>() as usize),
        Storage::Host(_) => None,
    }
}

/// Every device buffer `saved` holds (its inner layers' included), by identity, with its bytes.
fn buffers(saved: &Saved, seen: &mut HashMap<usize, usize>) {
    for t in &saved.tensors {
        if let Some(key) = buffer_key(t) {
            seen.insert(key, t.bytes());
        }
    }
    for inner in &saved.inner {
        buffers(inner, seen);
    }
}

/// What the GPUs of this host hold at once for `workers` (their estimates), GPU by GPU: worker
/// `w` runs on GPU `w mod devices`, as `pipe train` places them
/// ([`crate::pipeline::open_backend`]), and the workers sharing a GPU are counted as if their
/// peaks came together.
pub fn per_device(workers: &[WorkerMemory], devices: usize) -> Vec<u64> {
    let mut held = vec![0u64; devices.max(1)];
    for w in workers {
        let gpu = w.worker as usize % held.len();
        held[gpu] = held[gpu].saturating_add(w.total());
    }
    held
}

/// The device estimate of one worker's training step over the whole of `model` at `batch`
/// samples, one microbatch (what `pipe bench mfu` runs).
///
/// # Errors
/// A layer the probe cannot run.
pub fn estimate_step(model: &Model, inputs: DeviceInputs) -> Result<WorkerMemory> {
    let spec = pipe_scheduler::ScheduleSpec::new(pipe_scheduler::Policy::Gpipe, 1, 1)
        .with_length(pipe_scheduler::Length::Updates(1));
    let plan = RunPlan::new(model, &spec, None)?;
    let mut workers = estimate_device(model, &plan, inputs)?;
    workers
        .pop()
        .ok_or_else(|| StageError::Config("a one-worker plan with no worker".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(w: u32, bytes: u64) -> WorkerMemory {
        WorkerMemory {
            worker: w,
            terms: vec![MemoryTerm {
                name: "core",
                bytes,
            }],
        }
    }

    /// Workers go round the GPUs: five on two put 0, 2 and 4 on the first.
    #[test]
    fn workers_share_the_gpus_round_robin() {
        let workers: Vec<WorkerMemory> = (0..5).map(|w| worker(w, 1 << w)).collect();
        assert_eq!(per_device(&workers, 2), vec![1 + 4 + 16, 2 + 8]);
        assert_eq!(per_device(&workers, 1), vec![31]);
        assert_eq!(per_device(&workers, 0), vec![31]);
        assert_eq!(per_device(&workers, 8), vec![1, 2, 4, 8, 16, 0, 0, 0]);
    }
}
