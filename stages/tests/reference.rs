//! The reference trainer checked against references that owe nothing to version plans: the
//! plain single-worker loop (`train_step`, what `pipe train` runs on one stage) and an update
//! written out by hand in f64. The pipeline oracle proves that pipelined runs equal the
//! reference trainer; these prove that the reference trainer trains as plain SGD, momentum,
//! Nesterov, Adam and AdamW do, with the gradient mean taken over the update's microbatches,
//! and that optimizer state carried across drain points is the state a single loop keeps.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{bits, data, flat, opt, reference, sgd};
use pipe_kernels::{CpuBackend, Tensor};
use pipe_scheduler::{Length, Policy, ScheduleSpec};
use pipe_stages::model::{Model, ModelSpec, Params};
use pipe_stages::optim::{Corrected, NO_ROLES, Optimizer, OptimizerConfig, OptimizerKind};
use pipe_stages::pipeline::{OrderedSource, RunPlan, Setup, reference_train_from};
use pipe_stages::train::{StepState, train_step};

const SEED: u64 = 5;
/// Samples per microbatch.
const MB: usize = 8;
/// Microbatches per update.
const M: u32 = 3;

fn lr(_stage: u32, k: u32) -> f32 {
    0.05 / (1.0 + 0.1 * k as f32)
}

fn source(epoch: u64) -> OrderedSource<'static> {
    common::shuffled(&data().train, SEED, epoch, MB)
}

/// One stage, `sequential`, `updates` updates of `M` microbatches.
fn plan(model: &Model, updates: u32) -> RunPlan {
    let spec =
        ScheduleSpec::new(Policy::Sequential, 1, M).with_length(Length::Microbatches(updates * M));
    // One stage: the whole model, whatever partition is asked for.
    RunPlan::new(model, &spec, None).unwrap()
}

fn setup<'a>(run: &'a RunPlan, model: &'a Model, source: &'a OrderedSource<'static>) -> Setup<'a> {
    common::setup(model, run, source, SEED, &lr)
}

/// The largest difference between `a` and `b` over the largest magnitude in `b`.
fn relative_gap(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// `updates` updates of the plain loop from `params` and `opt`, over `source`'s microbatches
/// in order, numbered from `first_update` for the learning rate.
fn plain_loop(
    model: &Model,
    params: &mut Params,
    opt: &mut Optimizer,
    source: &OrderedSource<'_>,
    first_update: u32,
    updates: u32,
) {
    let be = CpuBackend::new(1).unwrap();
    let mut grads = model.zero_grads(0..model.len());
    let mut microbatch = 0u64;
    for k in 0..updates {
        let batches = (0..M as usize)
            .map(|i| {
                let at = (k as usize * M as usize + i) * MB;
                source.data.gather(&source.order[at..at + MB]).unwrap()
            })
            .collect();
        let mut st = StepState {
            params,
            grads: &mut grads,
            opt,
        };
        let scale = 1.0 / (M as usize * MB) as f32;
        train_step(
            &be,
            model,
            &mut st,
            batches,
            scale,
            lr(0, first_update + k),
            SEED,
            &mut microbatch,
        )
        .unwrap();
    }
}

fn optimizers() -> Vec<(&'static str, OptimizerConfig)> {
    let base = OptimizerConfig::default();
    vec![
        ("sgd", sgd(0.0)),
        ("momentum", opt()),
        (
            "nesterov",
            OptimizerConfig {
                nesterov: true,
                weight_decay: 1e-3,
                ..opt()
            },
        ),
        (
            "adam",
            OptimizerConfig {
                kind: OptimizerKind::Adam,
                ..base
            },
        ),
        (
            "adamw",
            OptimizerConfig {
                kind: OptimizerKind::Adamw,
                weight_decay: 0.1,
                ..base
            },
        ),
    ]
}

/// The gradient of an update is the mean over its microbatches, each the mean over its
/// samples: both the reference trainer and the plain loop scale every sample's loss by
/// `1/(M * MB)` (`UpdateMean`), so at `M = 3`, where scaling the sum by `1/M` afterwards would
/// round differently, they agree bit for bit; a divisor of `M + 1` instead of `M` moves the
/// weights by a quarter of a step.
#[test]
fn the_reference_trainer_equals_the_plain_loop_for_every_optimizer() {
    let model = Model::new(&ModelSpec::preset("mlp-784-32-10").unwrap()).unwrap();
    let updates = 6;
    let run = plan(&model, updates);
    let src = source(1);
    let init = model.init_params(SEED);
    for (name, cfg) in optimizers() {
        let want = reference(&setup(&run, &model, &src), &init, cfg);
        let mut params = init.clone();
        let mut opt = Optimizer::new(cfg, &params, NO_ROLES);
        plain_loop(&model, &mut params, &mut opt, &src, 0, updates);
        let gap = relative_gap(&flat(&params), &flat(&want[0]));
        assert!(
            bits(&params) == bits(&want[0]),
            "{name}: reference and plain loop differ by {gap}"
        );
        let moved = relative_gap(&flat(&init), &flat(&want[0]));
        assert!(moved > 1e-3, "{name}: the weights barely moved ({moved})");
    }
}

/// Two schedules in a row (two epochs, a drain between them) with the optimizers carried:
/// the reference's weights equal one plain loop over both epochs. Momentum and Adam's moments
/// and step count must survive the drain.
#[test]
fn optimizer_state_carried_across_a_drain_is_the_single_loops_state() {
    let model = Model::new(&ModelSpec::preset("mlp-784-32-10").unwrap()).unwrap();
    let updates = 4;
    let run = plan(&model, updates);
    let init = model.init_params(SEED);
    let be = CpuBackend::new(1).unwrap();
    for (name, cfg) in optimizers().into_iter().skip(1) {
        let mut params = init.clone();
        let mut opts = vec![Corrected::new(cfg, &params, NO_ROLES).placed(&be).unwrap()];
        let mut plain = init.clone();
        let mut plain_opt = Optimizer::new(cfg, &plain, NO_ROLES);
        for epoch in 1..=2u64 {
            let src = source(epoch);
            let lr_from = move |s: u32, k: u32| lr(s, (epoch as u32 - 1) * updates + k);
            let mut s = setup(&run, &model, &src);
            s.lr = &lr_from;
            let (stages, carried) = reference_train_from(&be, &s, &params, opts).unwrap();
            // One stage holds the whole model.
            params = stages.into_iter().next().unwrap();
            opts = carried;
            plain_loop(
                &model,
                &mut plain,
                &mut plain_opt,
                &src,
                (epoch as u32 - 1) * updates,
                updates,
            );
        }
        let gap = relative_gap(&flat(&plain), &flat(&params));
        assert!(gap < 2e-5, "{name}: carried state differs by {gap}");
        // Restarting the optimizer at the drain is visibly different.
        let mut fresh = init.clone();
        let mut fresh_opt = Optimizer::new(cfg, &fresh, NO_ROLES);
        plain_loop(&model, &mut fresh, &mut fresh_opt, &source(1), 0, updates);
        let mut restarted = Optimizer::new(cfg, &fresh, NO_ROLES);
        plain_loop(
            &model,
            &mut fresh,
            &mut restarted,
            &source(2),
            updates,
            updates,
        );
        let lost = relative_gap(&flat(&fresh), &flat(&params));
        assert!(
            lost > 100.0 * gap.max(1e-7),
            "{name}: a restart is not told apart ({lost})"
        );
    }
}

/// Softmax cross-entropy of a linear classifier, one SGD step written out in f64:
/// `W -= lr * mean_i x_i (p_i - e_{y_i})^T`, `b -= lr * mean_i (p_i - e_{y_i})` over the update's
/// `M x MB` samples.
#[test]
fn one_sgd_step_of_the_reference_trainer_is_the_handwritten_update() {
    let model = Model::new(&ModelSpec::preset("mlp-784-10").unwrap()).unwrap();
    let run = plan(&model, 1);
    let src = source(3);
    let mut init = model.init_params(SEED);
    // The one layer with parameters (after the input's flatten).
    let layer = init.iter().position(|p| p.len() == 2).unwrap();
    assert_eq!(
        init.iter().map(Vec::len).sum::<usize>(),
        2,
        "one linear layer"
    );
    // A bias that is not zero, so its gradient and update show.
    init[layer][1] = Tensor::from_vec(&[10], (0..10).map(|j| 0.01 * j as f32).collect()).unwrap();
    let got = reference(&setup(&run, &model, &src), &init, sgd(0.0));
    let wide = |t: &Tensor| -> Vec<f64> { t.host().unwrap().iter().map(|&v| v.into()).collect() };
    let (w, b) = (wide(&init[layer][0]), wide(&init[layer][1]));
    let (inputs, classes) = (784, 10);
    let samples = M as usize * MB;
    let (x, y) = src.data.gather(&src.order[..samples]).unwrap();
    let (x, y) = (x.host().unwrap(), y.host().unwrap());
    let (mut gw, mut gb) = (vec![0.0f64; inputs * classes], vec![0.0f64; classes]);
    for i in 0..samples {
        let xi = &x[i * inputs..(i + 1) * inputs];
        let logits: Vec<f64> = (0..classes)
            .map(|j| {
                b[j] + (0..inputs)
                    .map(|k| f64::from(xi[k]) * w[k * classes + j])
                    .sum::<f64>()
            })
            .collect();
        let max = logits.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
        let z: f64 = logits.iter().map(|v| (v - max).exp()).sum();
        for j in 0..classes {
            let d = (logits[j] - max).exp() / z - f64::from(u8::from(y[i] as usize == j));
            gb[j] += d / samples as f64;
            for k in 0..inputs {
                gw[k * classes + j] += f64::from(xi[k]) * d / samples as f64;
            }
        }
    }
    let step = f64::from(lr(0, 0));
    let want: Vec<f64> = w
        .iter()
        .zip(&gw)
        .map(|(w, g)| w - step * g)
        .chain(b.iter().zip(&gb).map(|(b, g)| b - step * g))
        .collect();
    let got = flat(&got[0]);
    // Only the linear layer has parameters, so the flat list is its weight, then its bias.
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (f64::from(*g) - w).abs() < 1e-6,
            "parameter {i}: reference {g}, by hand {w}"
        );
    }
    // The step is large enough that a wrong divisor shows: the bias moved by more than 1e-4.
    let moved = b
        .iter()
        .zip(&want[inputs * classes..])
        .fold(0.0f64, |m, (b, w)| m.max((b - w).abs()));
    assert!(moved > 1e-4, "the bias moved by {moved} only");
}
