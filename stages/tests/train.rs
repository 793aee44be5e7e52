//! Training-loop properties of a run with no pipeline flag (one worker over the whole model,
//! through the executor's segment loop): it learns, it is reproducible bit for bit, and its
//! result does not depend on the thread count. Optimizer updates match hand-computed values.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_kernels::{Backend, CpuBackend, Tensor};
use pipe_stages::config::{DatasetKind, ModelChoice, RunConfig, TrainSettings};
use pipe_stages::data::{Splits, SyntheticConfig};
use pipe_stages::model::{Model, Params};
use pipe_stages::optim::{LrScheduleKind, Optimizer, OptimizerConfig, OptimizerKind};
use pipe_stages::pipeline::{PipelineTrainOptions, train_pipelined};
use pipe_stages::train::{Quiet, TrainReport, load_data};

fn train(cfg: &RunConfig, data: &Splits) -> TrainReport {
    train_pipelined(cfg, data, &mut Quiet, &PipelineTrainOptions::default())
        .unwrap()
        .report
}

fn settings() -> TrainSettings {
    TrainSettings {
        model: Some(ModelChoice::Preset("mlp-32-64-64-4".into())),
        dataset: Some(DatasetKind::Synthetic),
        synthetic: Some(SyntheticConfig {
            inputs: 32,
            classes: 4,
            hidden: 16,
            train: 2048,
            test: 512,
        }),
        epochs: Some(8),
        microbatch_size: Some(32),
        microbatches: Some(2),
        lr: Some(0.05),
        seed: Some(7),
        ..TrainSettings::default()
    }
}

fn bits(p: &Params) -> Vec<u32> {
    p.iter()
        .flatten()
        .flat_map(|t| t.host().unwrap().iter().map(|v| v.to_bits()))
        .collect()
}

#[test]
fn learns_the_synthetic_teacher() {
    let cfg = settings().resolve().unwrap();
    assert!(!cfg.pipelined);
    let model = Model::new(&cfg.model).unwrap();
    let data = load_data(&cfg, &model).unwrap();
    let r = train(&cfg, &data);
    let last = r.epochs.last().unwrap();
    assert!(last.test_accuracy > 0.8, "accuracy {}", last.test_accuracy);
    assert!(r.epochs[0].train_loss > last.train_loss);
}

#[test]
fn reproducible_and_thread_count_independent() {
    let mut s = settings();
    s.epochs = Some(1);
    s.model = Some(ModelChoice::Preset("mlp-32-512-300-4".into()));
    s.synthetic = Some(SyntheticConfig {
        inputs: 32,
        classes: 4,
        hidden: 16,
        train: 1024,
        test: 64,
    });
    s.microbatch_size = Some(256);
    let cfg = s.resolve().unwrap();
    let model = Model::new(&cfg.model).unwrap();
    let data = load_data(&cfg, &model).unwrap();
    let runs: Vec<Vec<u32>> = [1usize, 2, 2, 3]
        .iter()
        .map(|&threads| {
            bits(
                &train(
                    &RunConfig {
                        threads,
                        ..cfg.clone()
                    },
                    &data,
                )
                .params,
            )
        })
        .collect();
    for r in &runs[1..] {
        assert!(
            r == &runs[0],
            "parameters differ between runs or thread counts"
        );
    }
}

#[test]
fn steps_cap_and_config_errors() {
    let mut s = settings();
    s.steps = Some(5);
    let cfg = s.resolve().unwrap();
    let model = Model::new(&cfg.model).unwrap();
    let data = load_data(&cfg, &model).unwrap();
    let r = train(&cfg, &data);
    assert_eq!(r.steps, 5);
    for bad in [
        TrainSettings {
            epochs: Some(0),
            ..settings()
        },
        TrainSettings {
            microbatch_size: Some(0),
            ..settings()
        },
        TrainSettings {
            lr: Some(-1.0),
            ..settings()
        },
        TrainSettings {
            model: Some(ModelChoice::Preset("resnet".into())),
            ..settings()
        },
        TrainSettings {
            momentum: Some(1.5),
            ..settings()
        },
    ] {
        assert!(bad.resolve().is_err());
    }
    // A model whose input width does not fit the data.
    let mut s = settings();
    s.model = Some(ModelChoice::Preset("mlp-30-8-4".into()));
    let cfg = s.resolve().unwrap();
    let e = load_data(&cfg, &Model::new(&cfg.model).unwrap()).unwrap_err();
    assert!(e.to_string().contains("takes 30 input features"), "{e}");
    let parsed =
        TrainSettings::from_toml("epochs = 3\nlr_schedule = \"warmup\"\n", "t.toml").unwrap();
    assert_eq!(parsed.lr_schedule, Some(LrScheduleKind::Warmup));
    assert!(TrainSettings::from_toml("epochs = \"x\"", "t.toml").is_err());
    assert!(TrainSettings::from_toml("bogus = 1", "t.toml").is_err());
}

fn one_param(v: &[f32]) -> Params {
    vec![vec![Tensor::from_vec(&[v.len()], v.to_vec()).unwrap()]]
}

#[test]
fn optimizers_match_hand_computation() {
    let be = CpuBackend::new(1).unwrap();
    let g = one_param(&[0.5, -1.0]);
    // SGD, momentum 0.9, weight decay 0.1, two steps.
    let cfg = OptimizerConfig {
        kind: OptimizerKind::Sgd,
        momentum: 0.9,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut p = one_param(&[1.0, 2.0]);
    let mut o = Optimizer::new(cfg, &p);
    o.step(&be, &mut p, &g, 0.1).unwrap();
    o.step(&be, &mut p, &g, 0.1).unwrap();
    let (mut w, mut b) = ([1.0f32, 2.0], [0.0f32; 2]);
    for _ in 0..2 {
        for i in 0..2 {
            let d = g[0][0].host().unwrap()[i] + 0.1 * w[i];
            b[i] = 0.9 * b[i] + d;
            w[i] -= 0.1 * b[i];
        }
    }
    assert_eq!(p[0][0].host().unwrap(), &w);
    // Nesterov.
    let cfg = OptimizerConfig {
        kind: OptimizerKind::Sgd,
        momentum: 0.5,
        nesterov: true,
        ..Default::default()
    };
    let mut p = one_param(&[1.0]);
    let mut o = Optimizer::new(cfg, &p);
    o.step(&be, &mut p, &one_param(&[2.0]), 0.1).unwrap();
    assert!((p[0][0].host().unwrap()[0] - (1.0 - 0.1 * (2.0 + 0.5 * 2.0))).abs() < 1e-7);
    // Adam's first step moves each weight by lr (sign of the gradient).
    for kind in [OptimizerKind::Adam, OptimizerKind::Adamw] {
        let cfg = OptimizerConfig {
            kind,
            momentum: 0.0,
            ..Default::default()
        };
        let mut p = one_param(&[1.0, 2.0]);
        let mut o = Optimizer::new(cfg, &p);
        o.step(&be, &mut p, &g, 0.01).unwrap();
        assert!((p[0][0].host().unwrap()[0] - 0.99).abs() < 1e-6);
        assert!((p[0][0].host().unwrap()[1] - 2.01).abs() < 1e-6);
    }
    // AdamW decays the weights directly, Adam through the gradient.
    let mut p = one_param(&[1.0]);
    let cfg = OptimizerConfig {
        kind: OptimizerKind::Adamw,
        momentum: 0.0,
        weight_decay: 0.5,
        ..Default::default()
    };
    Optimizer::new(cfg, &p)
        .step(&be, &mut p, &one_param(&[0.0]), 0.1)
        .unwrap();
    assert!((p[0][0].host().unwrap()[0] - 0.95).abs() < 1e-6);
    assert_eq!(be.name(), "cpu");
}
