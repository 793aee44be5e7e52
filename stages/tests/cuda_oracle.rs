//! The reference-trainer oracle on the CUDA backend: pipelined runs with every worker on a GPU
//! (several layouts: replicas all-reducing, a flush, vertical sync, 2BW, interleaved chunks)
//! must end near the CPU reference trainer's weights. Not bit for bit: cuBLAS and the CUDA
//! kernels sum in other orders than the CPU backend, so the bound is a stated tolerance
//! ([`TOLERANCE`], relative, on every weight after two epochs).
//!
//! Where no GPU can be opened (no `cuda` feature, no driver, no device) the test says so and
//! passes; `PIPE_REQUIRE_GPU=1` makes that a failure, for runs on a GPU machine.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_stages::config::{DatasetKind, ModelChoice, TrainSettings};
use pipe_stages::data::SyntheticConfig;
use pipe_stages::model::{Model, Params};
use pipe_stages::pipeline::{PipelineTrainOptions, train_pipelined, train_reference};
use pipe_stages::train::{Quiet, load_data};

/// Largest accepted `|gpu - cpu| / (1 + |cpu|)` over every weight.
const TOLERANCE: f32 = 1e-4;

fn gpu_or_skip() -> bool {
    match pipe_kernels::cuda::device_count() {
        Ok(_) => true,
        Err(e) => {
            assert!(
                std::env::var_os("PIPE_REQUIRE_GPU").is_none_or(|v| v != "1"),
                "PIPE_REQUIRE_GPU=1 but no GPU opened: {e}"
            );
            eprintln!("skipped: {e}");
            false
        }
    }
}

fn values(p: &Params) -> Vec<f32> {
    p.iter()
        .flatten()
        .flat_map(|t| t.host().unwrap().to_vec())
        .collect()
}

#[test]
fn pipelined_runs_on_gpus_end_near_the_cpu_reference_trainer() {
    if !gpu_or_skip() {
        return;
    }
    // (policy, stages, replicas, chunks, microbatches per update)
    let cases: [(&str, usize, Vec<u32>, u32, usize); 5] = [
        ("pipedream", 2, vec![2], 1, 1),
        ("1f1b-flush", 3, vec![2, 1, 1], 1, 2),
        ("vsync", 3, vec![1], 1, 1),
        ("2bw", 2, vec![1, 2], 1, 2),
        ("interleaved", 2, vec![1], 2, 2),
    ];
    for (policy, stages, replicas, chunks, m) in cases {
        let settings = TrainSettings {
            model: Some(ModelChoice::Preset("mlp-16-24x3-4".into())),
            dataset: Some(DatasetKind::Synthetic),
            synthetic: Some(SyntheticConfig {
                inputs: 16,
                classes: 4,
                hidden: 8,
                train: 576,
                test: 64,
            }),
            epochs: Some(2),
            microbatch_size: Some(8),
            microbatches: Some(m),
            lr: Some(0.1),
            momentum: Some(0.9),
            seed: Some(11),
            threads: Some(1),
            stages: Some(stages),
            replicas: Some(replicas.clone()),
            chunks: Some(chunks),
            schedule: Some(policy.into()),
            partition: Some("flops".into()),
            ..TrainSettings::default()
        };
        let cpu = settings.clone().resolve().unwrap();
        let gpu = TrainSettings {
            backend: Some("cuda".into()),
            ..settings
        }
        .resolve()
        .unwrap();
        let data = load_data(&cpu, &Model::new(&cpu.model).unwrap()).unwrap();
        let got = train_pipelined(&gpu, &data, &mut Quiet, &PipelineTrainOptions::default())
            .unwrap_or_else(|e| panic!("{policy} {replicas:?}: {e}"));
        let (want, _) = train_reference(&cpu, &data).unwrap();
        let (got, want) = (values(&got.report.params), values(&want));
        assert_eq!(got.len(), want.len());
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
            .fold(0.0f32, f32::max);
        eprintln!("{policy} {stages} stages {replicas:?} x{chunks}: worst relative gap {worst:e}");
        assert!(
            worst <= TOLERANCE,
            "{policy} {replicas:?}: worst relative gap {worst:e} exceeds {TOLERANCE:e}"
        );
    }
}
