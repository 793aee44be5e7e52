//! Cutting models into stages: every stage holds parameters, the cut balances the costs it is
//! given, and a measured cut of a model built to split evenly is even.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_stages::StageError;
use pipe_stages::config::DEFAULT_PIPELINE_MODEL;
use pipe_stages::model::{Model, ModelSpec};
use pipe_stages::pipeline::Partition;
use pipe_stages::planning::measured_partition;

fn model(name: &str) -> Model {
    Model::new(&ModelSpec::preset(name).unwrap()).unwrap()
}

fn has_params(m: &Model, layers: std::ops::Range<usize>) -> bool {
    layers
        .into_iter()
        .any(|i| !m.layer(i).param_shapes().is_empty())
}

#[test]
fn parameter_free_layers_ride_with_the_layer_before_them() {
    // flatten, linear, relu, linear, relu, linear: the FLOP split used to cut 0-0,1-1,2-2,3-5,
    // two stages without parameters.
    let m = model("mlp-784-512-512-10");
    let p = Partition::balanced(&m, &[1; 3]).unwrap();
    assert_eq!(p.to_string(), "0-2,3-4,5-5");
    for r in p.ranges() {
        assert!(has_params(&m, r.clone()), "{p}");
    }
    let e = Partition::balanced(&m, &[1; 4]).unwrap_err();
    assert!(matches!(e, StageError::Config(_)));
    assert!(e.to_string().contains("3 layers with parameters"), "{e}");
}

#[test]
fn a_cut_by_cost_balances_the_costs_it_is_given() {
    let m = model("mlp-8-8x4-8"); // flatten, then linear + relu four times, then linear
    let n = m.len();
    assert_eq!(n, 10);
    // Expensive last layer: it gets a stage of its own.
    let mut costs = vec![1.0; n];
    costs[9] = 10.0;
    let p = Partition::by_cost(&m, &costs, &[1; 2]).unwrap();
    assert_eq!(p.to_string(), "0-8,9-9");
    // Uniform costs: the min-max split, every stage starting at a linear layer.
    let p = Partition::by_cost(&m, &vec![1.0; n], &[1; 3]).unwrap();
    for r in p.ranges() {
        assert!(has_params(&m, r.clone()), "{p}");
        assert!(
            r.start == 0 || !m.layer(r.start).param_shapes().is_empty(),
            "{p}"
        );
    }
    let worst = p.ranges().iter().map(|r| r.len()).max().unwrap();
    assert_eq!(worst, 4, "{p}");
    assert!(Partition::by_cost(&m, &[1.0; 3], &[1; 2]).is_err());
    assert!(Partition::by_cost(&m, &vec![1.0; n], &[1; 0]).is_err());
    assert!(Partition::by_cost(&m, &vec![1.0; n], &[1; 6]).is_err());
}

#[test]
fn the_default_pipeline_model_splits_evenly_into_four_stages() {
    let m = model(DEFAULT_PIPELINE_MODEL);
    // One linear layer of width 1024 per stage; the last, 1024 x 10, rides with the fourth.
    let even = "0-2,3-4,5-6,7-9";
    assert_eq!(Partition::balanced(&m, &[1; 4]).unwrap().to_string(), even);
    // The measured cut: same rules, times from this machine (how even they are is a benchmark
    // figure, not a test).
    let cut =
        measured_partition(&m, 64, 1, &[1; 4], Default::default(), &Default::default()).unwrap();
    assert_eq!(cut.partition.stages(), 4);
    assert_eq!(cut.stage_seconds.len(), 4);
    for (s, r) in cut.partition.ranges().iter().enumerate() {
        assert!(has_params(&m, r.clone()), "{}", cut.partition);
        let t = cut.stage_seconds[s];
        assert!(t.is_finite() && t > 0.0, "stage {s}: {t}");
    }
    let one =
        measured_partition(&m, 64, 1, &[1; 1], Default::default(), &Default::default()).unwrap();
    assert_eq!(one.partition.to_string(), format!("0-{}", m.len() - 1));
}

#[test]
fn a_replicated_stage_gets_layers_in_proportion_to_its_replicas() {
    // Ten equal units (a linear and its ReLU each): with replicas 1, 3, 1 the middle stage
    // takes about three times the layers of its neighbours, so every worker has 2 units.
    let m = model("mlp-8-8x10-8");
    let units = m.len().saturating_sub(1).div_ceil(2);
    assert_eq!(units, 11);
    let costs: Vec<f64> = (0..m.len())
        .map(|i| {
            if m.layer(i).param_shapes().is_empty() {
                0.0
            } else {
                1.0
            }
        })
        .collect();
    let p = Partition::by_cost(&m, &costs, &[1, 3, 1]).unwrap();
    let per_worker: Vec<f64> = p
        .ranges()
        .iter()
        .zip([1.0, 3.0, 1.0])
        .map(|(r, reps)| costs[r.clone()].iter().sum::<f64>() / reps)
        .collect();
    let worst = per_worker.iter().copied().fold(0.0, f64::max);
    assert!(worst <= 7.0 / 3.0 + 1e-12, "{p}: {per_worker:?}");
    let uniform = Partition::by_cost(&m, &costs, &[1; 3]).unwrap();
    assert!(
        p.range(1).len() > uniform.range(1).len(),
        "{p} vs {uniform}"
    );
}
