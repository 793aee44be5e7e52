//! Helpers the stage crate's integration tests share: the MNIST splits and their shuffled
//! microbatches, a run's setup and even partition, the optimizer the oracles train with, runs on
//! in-process workers checked against the reference trainer bit for bit, small runs on the
//! synthetic teacher, and scratch paths that belong to one test alone.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::sync::OnceLock;

use pipe_kernels::{CpuBackend, Tensor};
use pipe_scheduler::Policy;
use pipe_stages::config::{DatasetKind, ModelChoice, RunConfig, TrainSettings};
use pipe_stages::data::{DataOrder, Dataset, Splits, SyntheticConfig, mnist};
use pipe_stages::model::{Model, Params};
use pipe_stages::optim::{OptimizerConfig, OptimizerKind};
use pipe_stages::pipeline::{
    LrFn, MicrobatchSource, OrderedSource, Partition, RunPlan, Setup, WorkerOutcome, WorkerState,
    reference_train, run_threads,
};
use pipe_transport::inproc::{InProcOptions, mesh};

#[path = "../../../tests/common/scratch.rs"]
mod scratch;
#[allow(unused_imports)] // Not every suite writes files.
pub use scratch::{fresh_dir, fresh_path};

/// The embedded MNIST splits, read once per test binary.
pub fn data() -> &'static Splits {
    static DATA: OnceLock<Splits> = OnceLock::new();
    DATA.get_or_init(|| mnist(None).unwrap())
}

/// Microbatches of `size` samples of `data` in its shuffled order of `epoch` under `seed`.
pub fn shuffled(
    data: &'static Dataset,
    seed: u64,
    epoch: u64,
    size: usize,
) -> OrderedSource<'static> {
    OrderedSource::new(
        data,
        data.epoch_order(seed, epoch, DataOrder::Shuffled),
        size,
    )
}

/// Microbatches of `size` MNIST training samples, shuffled by `seed` as the first epoch is.
pub fn source(seed: u64, size: usize) -> OrderedSource<'static> {
    shuffled(&data().train, seed, 1, size)
}

/// The setup of a run of `plan` over `model` fed by `data`, with run seed `seed` (dropout) and
/// learning rates `lr`: softmax cross-entropy, microbatches numbered from 0, nothing reported.
pub fn setup<'a>(
    model: &'a Model,
    plan: &'a RunPlan,
    data: &'a dyn MicrobatchSource,
    seed: u64,
    lr: &'a LrFn<'a>,
) -> Setup<'a> {
    Setup::new(model, plan, data, lr).with_seed(seed)
}

/// Layers `0..n` split into `k` stages by count (stage `i` takes `i n / k .. (i + 1) n / k`).
pub fn even(n: usize, k: usize) -> Partition {
    Partition::new((0..k).map(|i| i * n / k..(i + 1) * n / k).collect(), n).unwrap()
}

/// SGD with `momentum`, everything else the default.
pub fn sgd(momentum: f32) -> OptimizerConfig {
    OptimizerConfig {
        kind: OptimizerKind::Sgd,
        momentum,
        ..OptimizerConfig::default()
    }
}

/// The optimizer the oracles train with: SGD with momentum 0.9.
pub fn opt() -> OptimizerConfig {
    sgd(0.9)
}

/// Every weight of `p`, in order.
pub fn flat(p: &[Vec<Tensor>]) -> Vec<f32> {
    p.iter()
        .flatten()
        .flat_map(|t| t.host().unwrap().iter().copied())
        .collect()
}

/// Every weight of `p` as its bits, so that equal means equal to the bit (and NaN equals
/// itself).
pub fn bits(p: &[Vec<Tensor>]) -> Vec<u32> {
    flat(p).iter().map(|x| x.to_bits()).collect()
}

/// The largest gap between `got` and `want` relative to the wanted magnitude plus one:
/// `max |got - want| / (1 + |want|)`.
pub fn worst_gap(got: &[f32], want: &[f32]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
        .fold(0.0f32, f32::max)
}

/// The reference trainer's weights per stage for `setup` from `init` under `cfg`, on one CPU
/// thread.
pub fn reference(setup: &Setup<'_>, init: &Params, cfg: OptimizerConfig) -> Vec<Params> {
    reference_train(&CpuBackend::new(1).unwrap(), setup, init, cfg).unwrap()
}

/// A fresh state for every worker of `setup`'s plan, from `init` with optimizer `cfg`.
pub fn worker_states(setup: &Setup<'_>, init: &Params, cfg: OptimizerConfig) -> Vec<WorkerState> {
    (0..setup.plan.schedule.workers())
        .map(|w| WorkerState::new(setup, w, init, cfg))
        .collect()
}

/// Runs `setup` from `states` on CPU workers (one thread each) talking over in-process
/// channels.
///
/// # Errors
/// The run's error: the first worker that failed, named.
pub fn run_in_process(
    setup: &Setup<'_>,
    states: &mut [WorkerState],
) -> pipe_stages::Result<Vec<WorkerOutcome>> {
    let eps = mesh(setup.plan.schedule.workers(), &InProcOptions::default());
    run_threads(setup, states, eps, |_| CpuBackend::new(1))
}

/// Asserts that every stage every worker holds equals `want` (weights per stage) bit for bit;
/// `what` names the case.
#[track_caller]
pub fn assert_reference_weights(states: &[WorkerState], want: &[Params], what: &str) {
    for state in states {
        for st in &state.stages {
            assert!(
                bits(&st.params) == bits(&want[st.stage as usize]),
                "{what}: worker {} stage {} differs from the reference",
                state.worker,
                st.stage
            );
        }
    }
}

/// The weights of each stage as its first replica holds them, in stage order.
pub fn first_replicas<'s>(run: &RunPlan, states: &'s [WorkerState]) -> Vec<&'s Params> {
    let layout = run.schedule.layout();
    (0..run.schedule.stages())
        .map(|s| {
            let w = layout.worker_for(s, 0);
            let st = states[w as usize].stages.iter().find(|x| x.stage == s);
            &st.unwrap().params
        })
        .collect()
}

/// Settings of a run of preset `model` on the synthetic teacher's data, `[inputs, classes,
/// hidden, train, test]` (features, classes, the teacher's width, training and test samples);
/// everything else as `TrainSettings::default()` leaves it.
pub fn on_teacher(
    model: &str,
    [inputs, classes, hidden, train, test]: [usize; 5],
) -> TrainSettings {
    TrainSettings {
        model: Some(ModelChoice::Preset(model.into())),
        dataset: Some(DatasetKind::Synthetic),
        synthetic: Some(SyntheticConfig {
            inputs,
            classes,
            hidden,
            train,
            test,
        }),
        ..TrainSettings::default()
    }
}

/// The data `cfg` trains on, as a run loads it.
pub fn load(cfg: &RunConfig) -> Splits {
    pipe_stages::train::load_data(cfg, &Model::new(&cfg.model).unwrap()).unwrap()
}

/// Two epochs of `policy` over `stages` stages (a flops partition, one thread) with
/// `microbatches` microbatches of 16 per update: preset `mlp-32-48x3-4` on 768 samples of the
/// synthetic teacher (32 inputs, 4 classes), learning rate 0.1 with momentum 0.9, seed 3.
pub fn small_pipeline(policy: Policy, stages: usize, microbatches: usize) -> TrainSettings {
    TrainSettings {
        epochs: Some(2),
        microbatch_size: Some(16),
        microbatches: Some(microbatches),
        lr: Some(0.1),
        momentum: Some(0.9),
        seed: Some(3),
        threads: Some(1),
        stages: Some(stages),
        schedule: Some(policy.name().into()),
        partition: Some("flops".into()),
        ..on_teacher("mlp-32-48x3-4", [32, 4, 16, 768, 128])
    }
}
