//! Tied parameters: a weight used by layers on two stages is one parameter of the model's
//! table. The reference trainer sums the gradients of both uses before the update and keeps
//! the copies equal; checked against a gradient computed by hand.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::single_range_in_vec_init
)]

mod common;

use common::{reference, run_in_process, worker_states};
use pipe_kernels::Tensor;
use pipe_scheduler::{Length, Policy, ScheduleSpec};
use pipe_stages::layers::LayerSpec;
use pipe_stages::model::{Model, ModelSpec, Tie};
use pipe_stages::optim::OptimizerConfig;
use pipe_stages::pipeline::{MicrobatchSource, Partition, RunPlan, Setup};

const LR: f32 = 0.1;

/// `y = (x W) W` with one 2x2 weight used twice.
fn tied_model() -> Model {
    let linear = LayerSpec::Linear {
        inputs: 2,
        outputs: 2,
        bias: false,
        init: None,
    };
    Model::new(&ModelSpec {
        input: vec![2],
        layers: vec![linear.clone(), linear],
        tied: vec![Tie {
            param: "layers.1.weight".into(),
            to: "layers.0.weight".into(),
        }],
    })
    .unwrap()
}

/// Two samples per microbatch, the same for every microbatch.
struct Fixed;

const X: [[f32; 2]; 2] = [[0.5, -1.0], [1.5, 0.25]];
const Y: [u32; 2] = [1, 0];

impl MicrobatchSource for Fixed {
    fn microbatch_size(&self) -> usize {
        2
    }
    fn inputs(&self, _mb: u32) -> pipe_stages::Result<Tensor> {
        Ok(Tensor::from_vec(&[2, 2], X.concat()).unwrap())
    }
    fn labels(&self, _mb: u32) -> pipe_stages::Result<Tensor<u32>> {
        Ok(Tensor::from_vec(&[2], Y.to_vec()).unwrap())
    }
}

fn plain_sgd() -> OptimizerConfig {
    common::sgd(0.0)
}

fn lr(_: u32, _: u32) -> f32 {
    LR
}

fn plan(model: &Model, policy: Policy, stages: u32, updates: u32) -> RunPlan {
    let spec = ScheduleSpec::new(policy, stages, 1).with_length(Length::Updates(updates));
    let ranges = if stages == 2 {
        vec![0..1, 1..2]
    } else {
        vec![0..2]
    };
    RunPlan::new(model, &spec, Some(Partition::new(ranges, 2).unwrap())).unwrap()
}

fn setup<'a>(model: &'a Model, plan: &'a RunPlan) -> Setup<'a> {
    common::setup(model, plan, &Fixed, 3, &lr)
}

/// `W - lr * dL/dW` for `y = (x W) W`, mean cross-entropy, computed in f64 by hand.
fn hand_update(w: &[f32]) -> Vec<f64> {
    let w = |i: usize, j: usize| f64::from(w[i * 2 + j]);
    let mut grad = [[0.0f64; 2]; 2];
    for (x, &label) in X.iter().zip(&Y) {
        let x = [f64::from(x[0]), f64::from(x[1])];
        let h = [
            x[0] * w(0, 0) + x[1] * w(1, 0),
            x[0] * w(0, 1) + x[1] * w(1, 1),
        ];
        let y = [
            h[0] * w(0, 0) + h[1] * w(1, 0),
            h[0] * w(0, 1) + h[1] * w(1, 1),
        ];
        let m = y[0].max(y[1]);
        let z = (y[0] - m).exp() + (y[1] - m).exp();
        // dL/dy of the mean over two rows.
        let g: Vec<f64> = (0..2)
            .map(|j| (((y[j] - m).exp() / z) - f64::from(u8::from(label as usize == j))) / 2.0)
            .collect();
        // Second use: dW += h^T g. First use: dh = g W^T, dW += x^T dh.
        let dh = [
            g[0] * w(0, 0) + g[1] * w(0, 1),
            g[0] * w(1, 0) + g[1] * w(1, 1),
        ];
        for i in 0..2 {
            for j in 0..2 {
                grad[i][j] += h[i] * g[j] + x[i] * dh[j];
            }
        }
    }
    (0..4)
        .map(|k| w(k / 2, k % 2) - f64::from(LR) * grad[k / 2][k % 2])
        .collect()
}

#[test]
fn the_table_names_a_tied_parameter_once() {
    let model = tied_model();
    assert_eq!(model.param_names(), vec!["layers.0.weight".to_string()]);
    assert_eq!(model.param_count(), 4);
    assert_eq!(model.param_table()[0].uses, vec![(0, 0), (1, 0)]);
    let init = model.init_params(3);
    assert_eq!(init[0][0], init[1][0], "every use starts as a copy");
    assert_eq!(
        model.tie_across(&[0..1, 1..2]),
        Some(("layers.0.weight", 0, 1))
    );
    assert_eq!(model.tie_across(&[0..2]), None);
}

#[test]
fn bad_ties_are_refused() {
    let linear = LayerSpec::Linear {
        inputs: 2,
        outputs: 3,
        bias: false,
        init: None,
    };
    let spec = |to: &str| ModelSpec {
        input: vec![2],
        layers: vec![
            linear.clone(),
            LayerSpec::Relu,
            LayerSpec::Linear {
                inputs: 3,
                outputs: 2,
                bias: false,
                init: None,
            },
        ],
        tied: vec![Tie {
            param: "layers.2.weight".into(),
            to: to.into(),
        }],
    };
    let e = Model::new(&spec("layers.0.weight"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("shapes [3, 2] and [2, 3] differ"), "{e}");
    let e = Model::new(&spec("layers.9.weight"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a parameter of an earlier layer"), "{e}");
}

#[test]
fn reference_trainer_sums_both_uses_across_stages_as_computed_by_hand() {
    let model = tied_model();
    let init = model.init_params(3);
    let out = reference(
        &setup(&model, &plan(&model, Policy::Gpipe, 2, 1)),
        &init,
        plain_sgd(),
    );
    let want = hand_update(init[0][0].host().unwrap());
    for stage in &out {
        let got = stage[0][0].host().unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (f64::from(*g) - w).abs() <= 1e-6 * (1.0 + w.abs()),
                "{got:?} against {want:?}"
            );
        }
    }
    assert_eq!(out[0][0][0], out[1][0][0], "both stages hold the same copy");
}

#[test]
fn stashing_keeps_the_copies_equal_and_the_executor_matches_on_one_and_two_stages() {
    let model = tied_model();
    let init = model.init_params(3);
    // Two stages under PipeDream: each stage reads its own planned version; copies stay equal.
    let two = plan(&model, Policy::PipeDream, 2, 12);
    let out = reference(&setup(&model, &two), &init, plain_sgd());
    assert_eq!(out[0][0][0], out[1][0][0]);
    assert_ne!(out[0][0][0], init[0][0], "it trained");
    // The executor exchanges the tied gradients between the two stages: bit for bit the
    // reference, both copies equal.
    let s = setup(&model, &two);
    let mut states = worker_states(&s, &init, plain_sgd());
    run_in_process(&s, &mut states).unwrap();
    assert_eq!(states[0].stages[0].params, out[0]);
    assert_eq!(states[1].stages[0].params, out[1]);
    // On one stage the executor sums both uses itself, bit for bit like the reference.
    let one = plan(&model, Policy::Sequential, 1, 12);
    let s = setup(&model, &one);
    let want = reference(&s, &init, plain_sgd());
    let mut states = worker_states(&s, &init, plain_sgd());
    run_in_process(&s, &mut states).unwrap();
    assert_eq!(states[0].stages[0].params, want[0]);
    assert_eq!(want[0][0][0], want[0][1][0]);
}

/// Tied stages with replicas: each replica of a tied stage exchanges its share of the tied
/// gradients with the partner stage's replicas, and every copy still equals the reference's.
#[test]
fn tied_stages_with_replicas_match_the_reference() {
    let model = tied_model();
    let init = model.init_params(3);
    for (policy, replicas) in [
        (Policy::OneFOneBFlush, vec![2, 1]),
        (Policy::OneFOneBFlush, vec![1, 3]),
        (Policy::PipeDream, vec![2, 2]),
    ] {
        let spec = ScheduleSpec::new(policy, 2, 1)
            .with_replicas(replicas.clone())
            .with_length(Length::Updates(6));
        let run = RunPlan::new(
            &model,
            &spec,
            Some(Partition::new(vec![0..1, 1..2], 2).unwrap()),
        )
        .unwrap();
        let s = setup(&model, &run);
        let want = reference(&s, &init, plain_sgd());
        let mut states = worker_states(&s, &init, plain_sgd());
        run_in_process(&s, &mut states).unwrap_or_else(|e| panic!("{policy} {replicas:?}: {e}"));
        for st in &states {
            let stage = st.stages[0].stage as usize;
            assert_eq!(
                st.stages[0].params, want[stage],
                "{policy} {replicas:?}: worker {} (stage {stage})",
                st.worker
            );
        }
        assert_ne!(want[0][0][0], init[0][0], "it trained");
    }
}
