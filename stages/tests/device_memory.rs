//! pipe's model of a device's memory (`pipe_stages::planning::device_memory`) against what the
//! workers' devices report: a GPT pipelined on emulated devices, which count their buffers as
//! the CUDA pool counts its blocks, under each schedule family, with and without
//! recomputation. Every worker's estimate must lie within 10% of its device's peak.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::OnceLock;

mod common;

use pipe_scheduler::{Length, Policy, ScheduleSpec};
use pipe_stages::data::{Splits, char_corpus};
use pipe_stages::layer::Recompute;
use pipe_stages::model::{Model, ModelSpec};
use pipe_stages::optim::{OptimizerConfig, OptimizerKind};
use pipe_stages::pipeline::{Partition, RunPlan, run_threads};
use pipe_stages::planning::device_memory::{DeviceInputs, estimate_device};
use pipe_stages::transformer::GptShape;
use pipe_transport::inproc::{InProcOptions, mesh};

const SEED: u64 = 3;
const CONTEXT: usize = 32;
const MICROBATCH: usize = 8;

fn data() -> &'static Splits {
    static DATA: OnceLock<Splits> = OnceLock::new();
    DATA.get_or_init(|| {
        let text = "the quality of mercy is not strained; it droppeth as the gentle rain from \
                    heaven upon the place beneath. "
            .repeat(150);
        char_corpus(&text, CONTEXT, "mercy").unwrap()
    })
}

/// A GPT of four blocks of width 64 and four heads over 32 characters.
fn model(recompute: Recompute) -> Model {
    let shape = GptShape {
        blocks: 4,
        width: 64,
        heads: 4,
        context: CONTEXT,
    };
    let vocab = data().vocab.as_ref().unwrap().len();
    Model::new(&ModelSpec::gpt(shape, vocab, true))
        .unwrap()
        .with_recompute(recompute)
}

fn lr(_stage: u32, _k: u32) -> f32 {
    1e-3
}

/// Each worker's device peak and its estimate, for `spec` over `partition`.
fn peaks_and_estimates(
    model: &Model,
    spec: &ScheduleSpec,
    partition: Option<Partition>,
) -> Vec<(u64, u64)> {
    let run = RunPlan::new(model, spec, partition).unwrap();
    let source = common::shuffled(&data().train, SEED, 1, MICROBATCH);
    let setup = common::setup(model, &run, &source, SEED, &lr);
    let opt = OptimizerConfig {
        kind: OptimizerKind::Adamw,
        ..OptimizerConfig::default()
    };
    let mut states = common::worker_states(&setup, &model.init_params(SEED), opt);
    let eps = mesh(run.schedule.workers(), &InProcOptions::default());
    let outcomes = run_threads(&setup, &mut states, eps, |w| {
        pipe_kernels::EmulatedDevice::new(w as usize)
    })
    .unwrap();
    let inputs = DeviceInputs {
        microbatch_size: MICROBATCH,
        state_copies: opt.kind.state_copies(),
        bf16_operands: false,
    };
    let estimates = estimate_device(model, &run, inputs).unwrap();
    outcomes
        .iter()
        .map(|o| {
            let estimate = estimates[o.worker as usize].total();
            (o.peak_device_bytes, estimate)
        })
        .collect()
}

#[test]
fn the_device_estimate_is_within_a_tenth_of_the_devices_peaks() {
    let layers = model(Recompute::None).len();
    let four = Partition::new(vec![0..2, 2..3, 3..4, 4..layers], layers).unwrap();
    let cases = [
        (Policy::PipeDream, 4, 4, Recompute::None),
        (Policy::PipeDream, 4, 4, Recompute::Full),
        (Policy::OneFOneBFlush, 4, 4, Recompute::None),
        (Policy::Gpipe, 4, 4, Recompute::Selective),
        (Policy::TwoBw, 4, 4, Recompute::None),
        (Policy::PipeDream, 1, 2, Recompute::None),
    ];
    let mut worst: f64 = 0.0;
    for (policy, stages, microbatches, recompute) in cases {
        let model = model(recompute);
        let spec = ScheduleSpec::new(policy, stages, microbatches).with_length(Length::Updates(5));
        let partition = (stages == 4).then(|| four.clone());
        for (w, (peak, estimate)) in peaks_and_estimates(&model, &spec, partition)
            .into_iter()
            .enumerate()
        {
            let ratio = estimate as f64 / peak as f64;
            println!(
                "{policy:?} {stages} stages {recompute:?} worker {w}: peak {peak} estimate {estimate} ({ratio:.3})"
            );
            worst = worst.max((ratio - 1.0).abs());
        }
    }
    assert!(worst <= 0.10, "worst relative error {worst:.3}");
}

/// GPT-2 124M (`gpt2-small`): what the model expects of one worker's step at 16 x 1,024
/// tokens in bf16 with AdamW (the H200's pool held 21.1 GiB: `docs/gpu.md`), and of PipeDream
/// at four stages on one GPU with microbatches of 16 (`experiments/gpu/gpt2.sh`, check
/// `memory`). Printed, for the GPU's checks to compare with: `--ignored --nocapture`.
#[test]
#[ignore = "probes GPT-2 124M (about 2 GB of host memory); prints figures"]
fn gpt2_small_estimates() {
    use pipe_stages::planning::device_memory::estimate_step;
    let shape = GptShape {
        blocks: 12,
        width: 768,
        heads: 12,
        context: 1024,
    };
    let model = Model::new(&ModelSpec::gpt(shape, 50257, true)).unwrap();
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let inputs = DeviceInputs {
        microbatch_size: 16,
        state_copies: 3.0,
        bf16_operands: true,
    };
    let step = estimate_step(&model, inputs).unwrap();
    println!("one worker: {:.2} GiB {:?}", gib(step.total()), step.terms);
    let partition = Partition::new(vec![0..5, 5..9, 9..13, 13..model.len()], model.len()).unwrap();
    let spec = ScheduleSpec::new(Policy::PipeDream, 4, 4).with_length(Length::Updates(6));
    let run = RunPlan::new(&model, &spec, Some(partition)).unwrap();
    let workers = estimate_device(&model, &run, inputs).unwrap();
    for w in &workers {
        println!("pipedream w{}: {:.2} GiB", w.worker, gib(w.total()));
    }
    let all: u64 = workers.iter().map(|w| w.total()).sum();
    println!("pipedream, four stages on one GPU: {:.2} GiB", gib(all));
}

/// `pipe train --backend cuda` prints the estimate at its start for every run it takes (once
/// a measured partition is settled): one worker (no pipeline flag), a given partition with
/// replicas, a partition by FLOPs with recomputation, a language model in bf16.
#[test]
fn every_kind_of_device_run_has_an_estimate() {
    use pipe_stages::config::TrainSettings;
    use pipe_stages::planning::device_memory::estimate_run_device;
    for (toml, workers) in [
        ("backend = \"cuda\"", 1),
        (
            "backend = \"cuda\"\nstages = 4\nreplicas = [2]\npartition = \"0-2,3-4,5-6,7-9\"",
            8,
        ),
        (
            "backend = \"cuda\"\nstages = 2\npartition = \"flops\"\nrecompute = \"full\"",
            2,
        ),
        (
            "backend = \"cuda\"\nprecision = \"bf16\"\nmodel = \"gpt-mini\"\nstages = 2\npartition = \"flops\"",
            2,
        ),
    ] {
        let cfg = TrainSettings::from_toml(toml, "test")
            .and_then(TrainSettings::resolve)
            .unwrap();
        let estimate = estimate_run_device(&cfg).unwrap_or_else(|e| panic!("{toml}: {e}"));
        assert_eq!(estimate.len(), workers, "{toml}");
        for w in &estimate {
            let core = w.terms.iter().find(|t| t.name == "core").unwrap().bytes;
            assert!(core > 0 && w.total() > core, "{toml}: {:?}", w.terms);
        }
        let scratch = estimate[0]
            .terms
            .iter()
            .find(|t| t.name == "scratch")
            .unwrap();
        assert_eq!(scratch.bytes > 0, toml.contains("bf16"), "{toml}");
    }
}
