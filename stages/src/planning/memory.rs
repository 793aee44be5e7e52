//! pipe's memory model applied to a run: what each worker process holds at its peak, term by
//! term, from the run's model, layout, schedule, optimizer and recomputation, before the run
//! starts. The terms of a worker's stages are the partitioner's formulas
//! ([`pipe_scheduler::planner::memory`], one model for `pipe plan --memory` and for this), fed
//! with what the run will hold: each layer probed, the count in flight read from each worker's
//! program. This module adds what a process holds besides.
//!
//! The terms follow where a worker's resident memory goes, traced action by action on the
//! recomputation experiment (`docs/training.md`, "The memory model"):
//! - **process**: the `pipe` process before it builds its run (code, libraries, data maps),
//!   measured, not modelled: the process that estimates reads its own;
//! - **runtime**: what every worker adds besides its tensors (message buffers, the kernels'
//!   scratch, thread stacks, the allocator's own pages): a constant of this build, measured;
//! - **start**: at the chief, the whole model's starting weights and a second copy, the latest
//!   weights it evaluates and checkpoints (a follower builds only its own stages' starting
//!   weights and lets them go once its state holds them);
//! - **state**: its stages' weights and optimizer moments kept across segments (the drained
//!   state a checkpoint and survival read);
//! - **core**: the same placed for the run, with the gradient buffers;
//! - **versions**: the older weight versions weight stashing keeps (one per microbatch in
//!   flight beyond the first under PipeDream, one under 2BW);
//! - **activations**: what each microbatch in flight keeps from its forward to its backward,
//!   at the peak count its program reaches, measured per layer by running the layer on a
//!   probe (so recomputation's stand-ins count as what they are);
//! - **working**: one pass's working set: the largest layer's full activations (rebuilt in
//!   the backward under recomputation), their gradients, its input and output, and the
//!   allocator's blocks between them ([`WORKING_FACTOR`] times the layer's activations);
//! - **loss**: at the last stage, the logits, their gradient and the softmax;
//! - **evaluation**: at the chief, what the end of an epoch needs beyond training's peak: the
//!   gathered weights and a validation batch's working set (the allocator reuses the training
//!   activations' freed blocks for it only in part).
//!
//! Other features add their terms here (a delay correction's stale weights, the GPU's
//! activation precision). The model's constants were measured with mimalloc holding freed
//! memory for reuse (`pipe`'s setting), on the CPU backend; `experiments/memory/model.sh`
//! measures it again.

use pipe_kernels::{CpuBackend, Tensor};
use pipe_scheduler::planner::memory::{LOSS_COPIES, StageHeld, WORKING_FACTOR, worker_bytes};
use pipe_scheduler::{Action, WorkerId};

use crate::config::RunConfig;
use crate::error::Result;
use crate::layer::{Keep, Recompute};
use crate::layers::ForwardCtx;
use crate::model::Model;
use crate::pipeline::RunPlan;

/// Bytes of an `f32` element.
const F32: u64 = 4;

/// What a worker adds besides its tensors: message buffers, the kernels' per-thread scratch,
/// thread stacks and the allocator's own pages (30 MiB, measured on the recomputation
/// experiment's followers with one compute thread each).
pub const RUNTIME_BYTES: u64 = 30 << 20;

/// What a worker that is a thread of a process shared with other workers adds besides its
/// tensors: its stack, the kernels' scratch and its allocator heap, without a process's own
/// pages and with in-process links that hand buffers over instead of copying them (20 MiB,
/// measured with `experiments/memory/threads.sh`).
pub const THREAD_RUNTIME_BYTES: u64 = 20 << 20;

/// The most tokens of a sequence the layer probe runs: activations grow with the token count
/// and are scaled from it.
const PROBE_TOKENS: usize = 16;

/// One term of a worker's estimate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryTerm {
    /// What it counts (the names in the module's documentation).
    pub name: &'static str,
    /// Bytes.
    pub bytes: u64,
}

/// One worker's estimated peak resident memory, by term.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerMemory {
    /// The worker.
    pub worker: WorkerId,
    /// Its terms, in the module documentation's order; zero terms are kept.
    pub terms: Vec<MemoryTerm>,
}

impl WorkerMemory {
    /// The estimate: every term added.
    pub fn total(&self) -> u64 {
        self.terms.iter().map(|t| t.bytes).sum()
    }
}

impl WorkerMemory {
    /// The bytes of the terms named `names`.
    fn of(&self, names: &[&str]) -> u64 {
        self.terms
            .iter()
            .filter(|t| names.contains(&t.name))
            .map(|t| t.bytes)
            .sum()
    }
}

/// What a training pass holds and frees by the epoch's end: the terms an evaluation reuses.
const TRAINING_PASS: [&str; 3] = ["activations", "working", "loss"];

/// The peak of workers that are threads of one process (`pipe train` without
/// `--placement processes`): every worker's terms, with three changes. The process term is
/// counted once, and the process's runtime once: every other worker thread adds
/// [`THREAD_RUNTIME_BYTES`]. The chief's evaluation needs only what exceeds every worker's freed
/// training activations, not its own alone: the worker threads have ended by then, and the
/// allocator hands their freed blocks to the evaluating thread. Checked against VmHWM on
/// `gpt2-small` and the recomputation experiment's GPT-2 (`docs/training.md`).
pub fn in_one_process(workers: &[WorkerMemory]) -> u64 {
    let Some(chief) = workers.first() else {
        return 0;
    };
    let process = chief.of(&["process"]);
    let evaluation = chief.of(&["evaluation"]);
    let others_freed: u64 = workers[1..].iter().map(|w| w.of(&TRAINING_PASS)).sum();
    let all: u64 = workers.iter().map(WorkerMemory::total).sum();
    let others = workers.len() as u64 - 1;
    all.saturating_sub((process + RUNTIME_BYTES - THREAD_RUNTIME_BYTES) * others)
        .saturating_sub(evaluation.min(others_freed))
}

/// What a layer keeps and works on per sample, in bytes, measured by a probe.
#[derive(Clone, Copy, Debug, Default)]
struct LayerBytes {
    /// What its forward keeps for the backward under the model's recomputation.
    kept: f64,
    /// What its forward computes and would keep without recomputation.
    full: f64,
    /// Its output.
    output: f64,
    /// Its input.
    input: f64,
}

impl LayerBytes {
    /// One pass through the layer: its full activations, input and output.
    fn working(&self) -> f64 {
        self.full + self.input + self.output
    }
}

/// What the run's workers hold, besides the facts in its plan.
#[derive(Clone, Copy, Debug)]
pub struct MemoryInputs {
    /// Samples per microbatch.
    pub microbatch_size: usize,
    /// Copies of the parameters the optimizer keeps beyond the weights
    /// ([`crate::optim::OptimizerKind::state_copies`]: the gradient and its moments).
    pub state_copies: f64,
    /// The process's own resident bytes before the run
    /// ([`crate::limits::process_resident_bytes`]).
    pub process: u64,
    /// Samples of one validation batch at the chief (0: no evaluation).
    pub eval_samples: usize,
}

/// The estimate for every worker of the pipelined run `cfg`, whose partition is settled
/// (given, or by FLOPs), with `process` the resident bytes of a `pipe` process before it
/// builds its run ([`crate::limits::process_resident_bytes`] where the caller has built
/// nothing yet).
///
/// # Errors
/// A partition still to be measured; an impossible layout; a layer the probe cannot run.
pub fn estimate_run(cfg: &RunConfig, process: u64) -> Result<Vec<WorkerMemory>> {
    let model = Model::new(&cfg.model)?.with_stage_recompute(cfg.recompute.clone());
    let partition = crate::pipeline::run_partition(cfg)?;
    // Enough updates for every stage to reach its steady count in flight.
    let updates = cfg.stages as u32 + 2;
    let spec = cfg.schedule_spec(pipe_scheduler::Length::Updates(updates));
    let plan = RunPlan::new(&model, &spec, partition)?;
    let targets = model.output_shape().first().copied().unwrap_or(1).max(1);
    let sequence = reads_tokens(&model);
    let inputs = MemoryInputs {
        microbatch_size: cfg.microbatch_size,
        state_copies: cfg.optimizer.kind.state_copies(),
        process,
        eval_samples: crate::train::eval_samples(if sequence { targets } else { 1 }),
    };
    estimate(&model, &plan, inputs)
}

/// What every worker process holds besides its stages, for the partitioner
/// ([`pipe_scheduler::PlanOptions::worker_base`]): `process` (a `pipe` process's resident
/// bytes before it builds anything, [`crate::limits::process_resident_bytes`]) and the
/// runtime constant. The chief's copies of the whole model's weights and its evaluation are
/// not charged.
pub fn worker_base(process: u64) -> f64 {
    process as f64 + RUNTIME_BYTES as f64
}

/// The estimate for every worker of `plan`.
///
/// # Errors
/// A layer the probe cannot run.
pub fn estimate(model: &Model, plan: &RunPlan, inputs: MemoryInputs) -> Result<Vec<WorkerMemory>> {
    let layers = probe_layers(model, &layer_recompute(model, plan))?;
    let param_bytes: Vec<u64> = (0..model.len())
        .map(|i| {
            let shapes = model.layer(i).param_shapes();
            shapes.iter().map(|(_, s)| elements(s)).sum::<u64>() * F32
        })
        .collect();
    let total_params: u64 = param_bytes.iter().sum();
    let schedule = &plan.schedule;
    let stages = schedule.stages();
    let mut out = Vec::new();
    for w in 0..schedule.workers() {
        let own: Vec<u32> = schedule.layout().stages_of(w).collect();
        let held = peak_in_flight(&schedule.programs[w as usize], &own);
        let logits = layers.last().map_or(0.0, |l| l.output);
        let stage_held: Vec<StageHeld> = own
            .iter()
            .zip(&held.per_stage)
            .map(|(&s, &n)| {
                let range = plan.partition.range(s as usize);
                StageHeld {
                    params: range.clone().map(|l| param_bytes[l] as f64).sum(),
                    kept: stage_sum(&layers, plan, s, |l| l.kept),
                    in_flight: f64::from(n),
                    pass: range.map(|l| layers[l].working()).fold(0.0, f64::max),
                    logits: if s == stages - 1 { logits } else { 0.0 },
                }
            })
            .collect();
        let b = inputs.microbatch_size as f64;
        let bytes = worker_bytes(
            schedule.resolved.policy,
            &stage_held,
            b,
            inputs.state_copies,
        );
        let chief = w == 0;
        // The chief's end of an epoch: the gathered weights and one validation batch through
        // the whole model, beyond what training's activations left free.
        let evaluation = if chief && inputs.eval_samples > 0 {
            let n = inputs.eval_samples as f64;
            let widest = layers.iter().map(LayerBytes::working).fold(0.0, f64::max);
            let end = total_params as f64 + WORKING_FACTOR * widest * n + LOSS_COPIES * logits * n;
            (end - (bytes.activations + bytes.working + bytes.loss)).max(0.0)
        } else {
            0.0
        };
        // Only the chief keeps the whole model's starting weights (and a second copy, the
        // latest weights it evaluates and checkpoints); a follower builds its own stages'
        // and lets them go once its state holds them.
        let start = if chief { 2 * total_params } else { 0 };
        let terms = [
            ("process", inputs.process as f64),
            ("runtime", RUNTIME_BYTES as f64),
            ("start", start as f64),
        ]
        .into_iter()
        .chain(bytes.terms())
        .chain([("evaluation", evaluation)]);
        out.push(WorkerMemory {
            worker: w,
            terms: terms
                .into_iter()
                .map(|(name, bytes)| MemoryTerm {
                    name,
                    bytes: bytes.round() as u64,
                })
                .collect(),
        });
    }
    Ok(out)
}

/// Per layer, the recomputation its stage runs with ([`Model::recompute`]).
pub(super) fn layer_recompute(model: &Model, plan: &RunPlan) -> Vec<Recompute> {
    let mut kinds = vec![Recompute::None; model.len()];
    for s in 0..plan.partition.stages() {
        for l in plan.partition.range(s) {
            kinds[l] = model.recompute().at(s);
        }
    }
    kinds
}

/// A model whose samples are token sequences (its first layer embeds them): its activations
/// grow with the token count, and a sample's targets are its tokens.
fn reads_tokens(model: &Model) -> bool {
    !model.is_empty() && model.layer(0).kind() == "embedding"
}

/// `f` summed over the layers of stage `s`.
fn stage_sum(layers: &[LayerBytes], plan: &RunPlan, s: u32, f: impl Fn(&LayerBytes) -> f64) -> f64 {
    plan.partition
        .range(s as usize)
        .map(|l| f(&layers[l]))
        .sum()
}

pub(super) fn elements(shape: &[usize]) -> u64 {
    shape.iter().map(|&d| d as u64).product()
}

/// The most microbatches a worker's program holds between forward and backward.
pub(super) struct InFlight {
    /// Per own stage (in the order given), the most at once.
    pub(super) per_stage: Vec<u32>,
}

/// Reads a worker's program: a microbatch is held from its forward to its last backward
/// action (the weight half of a split backward, where there is one).
pub(super) fn peak_in_flight(program: &[Action], own: &[u32]) -> InFlight {
    use std::collections::HashMap;
    let mut last_backward: HashMap<(u32, u32), usize> = HashMap::new();
    for (pc, a) in program.iter().enumerate() {
        if let Action::Backward { stage, mb }
        | Action::BackwardInput { stage, mb }
        | Action::BackwardWeight { stage, mb } = *a
        {
            last_backward.insert((stage, mb), pc);
        }
    }
    let mut held = vec![0u32; own.len()];
    let mut per_stage = vec![0u32; own.len()];
    let index = |stage: u32| own.iter().position(|&s| s == stage);
    for (pc, a) in program.iter().enumerate() {
        match *a {
            Action::Forward { stage, .. } => {
                if let Some(i) = index(stage) {
                    held[i] += 1;
                }
            }
            Action::Backward { stage, mb }
            | Action::BackwardInput { stage, mb }
            | Action::BackwardWeight { stage, mb }
                if last_backward.get(&(stage, mb)) == Some(&pc) =>
            {
                if let Some(i) = index(stage) {
                    held[i] = held[i].saturating_sub(1);
                }
            }
            _ => {}
        }
        for (p, &h) in per_stage.iter_mut().zip(&held) {
            *p = (*p).max(h);
        }
    }
    InFlight { per_stage }
}

/// The one-sample probe both memory models run each layer on: a sequence model's probe is
/// [`PROBE_TOKENS`] long and its bytes are scaled to the full length (every activation of a
/// token model grows with its token count: attention keeps no `T x T` tensor).
pub(super) struct ProbeShape {
    /// Tokens of the probe, for a sequence model.
    tokens: Option<usize>,
    /// The full length over the probe's (1 for other models).
    pub(super) scale: f64,
}

impl ProbeShape {
    /// The probe of `model`.
    pub(super) fn of(model: &Model) -> Self {
        let full_tokens = model.input_shape().first().copied().unwrap_or(1).max(1);
        if reads_tokens(model) {
            let tokens = full_tokens.min(PROBE_TOKENS);
            ProbeShape {
                tokens: Some(tokens),
                scale: full_tokens as f64 / tokens as f64,
            }
        } else {
            ProbeShape {
                tokens: None,
                scale: 1.0,
            }
        }
    }

    /// The shape of layer `i`'s probe input: one sample.
    pub(super) fn input(&self, model: &Model, i: usize) -> Vec<usize> {
        let mut s = vec![1];
        s.extend_from_slice(model.shape_before(i));
        if let Some(tokens) = self.tokens {
            s[1] = tokens;
        }
        s
    }

    /// The context a probe's forward runs in: training, nothing recomputed, no documents.
    pub(super) fn ctx() -> ForwardCtx {
        ForwardCtx {
            train: true,
            seed: 0,
            recompute_attention: false,
            documents: None,
        }
    }
}

/// Per layer, per sample: what it keeps, computes, takes and gives, from one forward of each
/// layer on the one-sample probe ([`ProbeShape`]) of zeros with zero parameters.
fn probe_layers(model: &Model, recompute: &[Recompute]) -> Result<Vec<LayerBytes>> {
    let be = CpuBackend::new(1)?;
    let probe = ProbeShape::of(model);
    let scale = probe.scale;
    (0..model.len())
        .map(|i| {
            let x = Tensor::zeros(&probe.input(model, i));
            let params = model.zero_grads(i..i + 1);
            let input = x.len() as f64 * 4.0;
            let ctx = ProbeShape::ctx();
            let kernel = |source| crate::StageError::Kernel {
                layer: i,
                kind: model.layer(i).kind(),
                op: "memory probe",
                source,
            };
            let (y, full) = model
                .layer(i)
                .forward(&be, &params[0], x.clone(), ctx)
                .map_err(kernel)?;
            let keep = Keep::Train(recompute.get(i).copied().unwrap_or_default());
            let (_, kept) = model.forward_range(&be, i..i + 1, &params, x, keep, 0, 0, None)?;
            let kept: usize = kept.iter().map(|s| s.bytes()).sum();
            Ok(LayerBytes {
                kept: kept as f64 * scale,
                full: full.bytes() as f64 * scale,
                output: y.len() as f64 * 4.0 * scale,
                input: input * scale,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipe_scheduler::Action as A;

    #[test]
    fn a_microbatch_is_held_from_its_forward_to_its_last_backward() {
        let program = [
            A::Forward { stage: 0, mb: 0 },
            A::Forward { stage: 0, mb: 1 },
            A::BackwardInput { stage: 0, mb: 0 },
            A::Forward { stage: 0, mb: 2 },
            A::BackwardWeight { stage: 0, mb: 0 },
            A::Backward { stage: 0, mb: 1 },
            A::Backward { stage: 0, mb: 2 },
        ];
        let held = peak_in_flight(&program, &[0]);
        assert_eq!(held.per_stage, vec![3]);
    }
}

#[cfg(test)]
mod model_tests {
    use super::*;
    use crate::model::ModelSpec;
    use crate::transformer::GptShape;
    use pipe_scheduler::{Length, Policy, ScheduleSpec};

    fn gpt(recompute: Recompute) -> Model {
        let shape = GptShape {
            blocks: 4,
            width: 32,
            heads: 2,
            context: 64,
        };
        Model::new(&ModelSpec::gpt(shape, 50, true))
            .unwrap()
            .with_recompute(recompute)
    }

    /// The probe runs 16 tokens and scales: what it gives is what a forward of the whole
    /// length keeps, layer by layer.
    #[test]
    fn the_scaled_probe_is_what_a_full_length_forward_keeps() {
        let be = CpuBackend::new(1).unwrap();
        for recompute in [Recompute::None, Recompute::Full, Recompute::Selective] {
            let model = gpt(recompute);
            let probed = probe_layers(&model, &vec![recompute; model.len()]).unwrap();
            let params = model.init_params(1);
            let x = Tensor::zeros(&[1, 64]);
            let (_, saved) = model
                .forward_range(
                    &be,
                    0..model.len(),
                    &params,
                    x,
                    model.training(0),
                    0,
                    0,
                    None,
                )
                .unwrap();
            for (i, (p, s)) in probed.iter().zip(&saved).enumerate() {
                assert_eq!(p.kept, s.bytes() as f64, "{recompute:?} layer {i}");
            }
        }
    }

    fn workers(model: &Model, policy: Policy) -> Vec<WorkerMemory> {
        let spec = ScheduleSpec::new(policy, 4, 4).with_length(Length::Updates(6));
        let plan = RunPlan::new(model, &spec, None).unwrap();
        let inputs = MemoryInputs {
            microbatch_size: 8,
            state_copies: 3.0,
            process: 0,
            eval_samples: 16,
        };
        estimate(model, &plan, inputs).unwrap()
    }

    fn term(w: &WorkerMemory, name: &str) -> u64 {
        w.terms.iter().find(|t| t.name == name).unwrap().bytes
    }

    /// PipeDream keeps 4, 3, 2 and 1 microbatches in flight and as many weight versions at
    /// its four stages; recomputation lowers what they keep, and a flush keeps one version.
    #[test]
    fn in_flight_counts_versions_and_recomputation_shape_the_terms() {
        let (none, full) = (gpt(Recompute::None), gpt(Recompute::Full));
        let kept = workers(&none, Policy::PipeDream);
        let probed = probe_layers(&none, &vec![Recompute::None; none.len()]).unwrap();
        let spec = ScheduleSpec::new(Policy::PipeDream, 4, 4).with_length(Length::Updates(6));
        let plan = RunPlan::new(&none, &spec, None).unwrap();
        for (s, w) in kept.iter().enumerate() {
            let per_mb: f64 = plan.partition.range(s).map(|l| probed[l].kept).sum::<f64>() * 8.0;
            let in_flight = 4 - s as u64;
            assert_eq!(
                term(w, "activations"),
                (in_flight as f64 * per_mb).round() as u64
            );
            let params = term(w, "core") / 4;
            assert_eq!(term(w, "versions"), (in_flight - 1) * params, "stage {s}");
        }
        let recomputing = workers(&full, Policy::PipeDream);
        for (a, b) in kept.iter().zip(&recomputing) {
            assert!(term(b, "activations") < term(a, "activations") / 2);
            assert_eq!(term(b, "working"), term(a, "working"));
        }
        for w in workers(&none, Policy::OneFOneBFlush) {
            assert_eq!(term(&w, "versions"), 0);
        }
        // Only the chief evaluates (where its end of an epoch needs more than training left),
        // only the chief keeps the whole model's weights (twice: the start and the latest),
        // and only the last stage computes the loss.
        assert!(kept[1..].iter().all(|w| term(w, "evaluation") == 0));
        assert!(kept[1..].iter().all(|w| term(w, "start") == 0));
        // Every use of a tied parameter holds its own copy.
        let per_use: u64 = (0..none.len())
            .flat_map(|i| none.layer(i).param_shapes())
            .map(|(_, s)| elements(&s) * 4)
            .sum();
        assert_eq!(term(&kept[0], "start"), 2 * per_use);
        assert!(term(&kept[3], "loss") > 0 && term(&kept[2], "loss") == 0);
    }
}
