//! A fast oracle over the layouts the executor handles specially: several model chunks per
//! worker (interleaved), every stage on one worker (sequential), replicas summed in ring
//! order, the split backward of zero-bubble H1 and unequal replica counts. Each pipelined run
//! of two epochs on a small synthetic problem ends with the whole-run reference trainer's
//! weights, bit for bit. (`stages/tests/pipeline.rs` is the full oracle on MNIST; this one
//! runs in seconds, so a mutation run can afford it.) The same layouts on GPUs are compared with
//! the reference within a stated tolerance.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{bits, flat, load};
use pipe_stages::config::TrainSettings;
use pipe_stages::pipeline::Quiet;
use pipe_stages::pipeline::{PipelineTrainOptions, train_pipelined, train_reference};

/// A two-epoch run of `policy` on a small synthetic problem.
fn settings(
    policy: &str,
    stages: usize,
    replicas: &[u32],
    chunks: u32,
    microbatches: usize,
) -> TrainSettings {
    TrainSettings {
        epochs: Some(2),
        microbatch_size: Some(8),
        microbatches: Some(microbatches),
        lr: Some(0.1),
        momentum: Some(0.9),
        seed: Some(11),
        threads: Some(1),
        stages: Some(stages),
        replicas: Some(replicas.to_vec()),
        chunks: Some(chunks),
        schedule: Some(policy.into()),
        partition: Some("flops".into()),
        ..common::on_teacher("mlp-16-24x3-4", [16, 4, 8, 576, 64])
    }
}

#[test]
fn special_layouts_equal_the_reference_trainer() {
    // (policy, stages, replicas, chunks, microbatches per update)
    let cases: [(&str, usize, Vec<u32>, u32, usize); 8] = [
        ("interleaved", 2, vec![1], 2, 2),
        ("sequential", 4, vec![1], 1, 2),
        ("zb-h1", 4, vec![1], 1, 4),
        ("pipedream", 2, vec![2], 1, 1),
        ("1f1b-flush", 3, vec![2, 1, 3], 1, 2),
        ("pipedream", 3, vec![1, 3, 1], 1, 1),
        ("vsync", 3, vec![2, 1, 1], 1, 1),
        ("2bw", 2, vec![1, 2], 1, 2),
    ];
    for (policy, stages, replicas, chunks, m) in cases {
        let cfg = settings(policy, stages, &replicas, chunks, m)
            .resolve()
            .unwrap_or_else(|e| panic!("{policy} {replicas:?}: {e}"));
        let data = load(&cfg);
        let got = train_pipelined(&cfg, &data, &mut Quiet, &PipelineTrainOptions::default())
            .unwrap_or_else(|e| panic!("{policy} {replicas:?}: {e}"));
        let (want, _) = train_reference(&cfg, &data).unwrap();
        assert!(
            bits(&got.report.params) == bits(&want),
            "{policy} {stages} stages {replicas:?} x{chunks}: differs from the reference"
        );
    }
}

/// Largest accepted `|gpu - cpu| / (1 + |cpu|)` over every weight of a run on GPUs, by the
/// precision of the GPU's products. In f32 (the two-epoch runs below, about 70 to 140 updates),
/// cuBLAS and the CUDA kernels sum in other orders than the CPU backend, so not bit for bit.
/// TF32 rounds every product's inputs to 10 mantissa bits and bf16 to 7, while the reference
/// stays f32: a drift that these runs (learning rate 0.1, momentum 0.9) amplify, to 0.2 and
/// beyond over two epochs. So the reduced precisions are held to a short run, one epoch of 96
/// samples (6 to 12 updates), where a correct rounding drifts by a few 1e-3 and a wrong
/// product (a transposed or misread operand) by far more than the tolerance.
const GPU_TOLERANCES: [(&str, f32); 3] = [("f32", 1e-4), ("tf32", 1.5e-2), ("bf16", 1.5e-2)];

/// The short run of the reduced precisions (see [`GPU_TOLERANCES`]).
fn short(mut s: TrainSettings) -> TrainSettings {
    s.epochs = Some(1);
    if let Some(synthetic) = s.synthetic.as_mut() {
        synthetic.train = 96;
    }
    s
}

/// The oracle on the CUDA backend: runs with every worker on a GPU end near the CPU reference
/// trainer's weights. Where no GPU opens (no `cuda` feature, no driver, no device) it says so and
/// passes; `PIPE_REQUIRE_GPU=1` makes that a failure, for runs on a GPU machine.
#[test]
fn layouts_on_gpus_end_near_the_cpu_reference_trainer() {
    if let Err(e) = pipe_kernels::cuda::device_count() {
        assert!(
            std::env::var_os("PIPE_REQUIRE_GPU").is_none_or(|v| v != "1"),
            "PIPE_REQUIRE_GPU=1 but no GPU opened: {e}"
        );
        eprintln!("skipped: {e}");
        return;
    }
    let cases: [(&str, usize, Vec<u32>, u32, usize); 5] = [
        ("pipedream", 2, vec![2], 1, 1),
        ("1f1b-flush", 3, vec![2, 1, 1], 1, 2),
        ("vsync", 3, vec![1], 1, 1),
        ("2bw", 2, vec![1, 2], 1, 2),
        ("interleaved", 2, vec![1], 2, 2),
    ];
    for (precision, tolerance) in GPU_TOLERANCES {
        for (policy, stages, replicas, chunks, m) in &cases {
            let base = settings(policy, *stages, replicas, *chunks, *m);
            let base = if precision == "f32" {
                base
            } else {
                short(base)
            };
            let cpu = base.clone().resolve().unwrap();
            let gpu = TrainSettings {
                backend: Some("cuda".into()),
                precision: Some(precision.into()),
                ..base
            }
            .resolve()
            .unwrap();
            let data = load(&cpu);
            let got = train_pipelined(&gpu, &data, &mut Quiet, &PipelineTrainOptions::default())
                .unwrap_or_else(|e| panic!("{policy} {replicas:?} {precision}: {e}"));
            let (want, _) = train_reference(&cpu, &data).unwrap();
            let (got, want) = (flat(&got.report.params), flat(&want));
            assert_eq!(got.len(), want.len());
            let worst = common::worst_gap(&got, &want);
            eprintln!(
                "{precision} {policy} {stages} stages {replicas:?} x{chunks}: worst relative gap \
                 {worst:e} (tolerance {tolerance:e})"
            );
            assert!(
                worst <= tolerance,
                "{precision} {policy} {replicas:?}: worst relative gap {worst:e} exceeds \
                 {tolerance:e}"
            );
        }
    }
}
