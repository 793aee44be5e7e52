//! Resource limits on models and runs: sizes refused before anything is allocated, and the
//! memory estimate that the planner's memory model gives, checked against its closed form.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_scheduler::{Policy, ScheduleSpec};
use pipe_stages::limits::{Machine, MemoryNeed, admit_memory, check_local_workers};
use pipe_stages::model::{Model, ModelSpec};
use pipe_stages::optim::OptimizerKind;

fn machine(gib: u64) -> Machine {
    Machine {
        memory_bytes: gib << 30,
        cores: 2,
    }
}

#[test]
fn huge_widths_are_refused_before_any_parameter_exists() {
    let e = Model::new(&ModelSpec::preset("mlp-784-1000000000-10").unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layers.1.weight [784, 1000000000]") && e.contains("2147483648"),
        "{e}"
    );
    let wide = Model::new(&ModelSpec::preset("mlp-784-100000-10").unwrap()).unwrap();
    let e = wide.check_microbatch(100_000).unwrap_err().to_string();
    assert!(
        e.contains("the input of layer 2 at microbatch size 100000"),
        "{e}"
    );
    assert!(wide.check_microbatch(64).is_ok());
}

#[test]
fn the_memory_estimate_is_the_planners_formula_on_exact_sizes() {
    let model = Model::new(&ModelSpec::preset("mlp-784-1024x4-10").unwrap()).unwrap();
    let acts = |mb: usize| -> f64 {
        (0..model.len())
            .map(|l| {
                let a: usize = model.shape_before(l).iter().product();
                let b: usize = model.shape_before(l + 1).iter().product();
                ((a + b) * mb * 4) as f64
            })
            .sum()
    };
    let params = model.param_count() as f64 * 4.0;
    // One worker, one version: weights + gradient + momentum placed for the run, weights and
    // momentum kept drained, one microbatch in flight (pipe's memory model, with no working
    // set or base: the start-up check's coarse share).
    let one = ScheduleSpec::new(Policy::Sequential, 1, 1)
        .resolve()
        .unwrap();
    let sgd = OptimizerKind::Sgd.state_copies();
    assert_eq!(
        model.worker_memory_bytes(&one, 64, sgd),
        5.0 * params + acts(64)
    );
    // GPipe on one stage holds all M microbatches' activations.
    let gpipe = ScheduleSpec::new(Policy::Gpipe, 1, 8).resolve().unwrap();
    assert_eq!(
        model.worker_memory_bytes(&gpipe, 64, sgd),
        5.0 * params + 8.0 * acts(64)
    );
    // Adam keeps two moments.
    let adam = OptimizerKind::Adam.state_copies();
    assert_eq!(
        model.worker_memory_bytes(&one, 64, adam),
        7.0 * params + acts(64)
    );
    // On four stages, weight stashing keeps a version per microbatch in flight, where
    // 1F1B-flush keeps one: the same layout costs PipeDream more.
    let pd = ScheduleSpec::new(Policy::PipeDream, 4, 4)
        .resolve()
        .unwrap();
    let flush = ScheduleSpec::new(Policy::OneFOneBFlush, 4, 4)
        .resolve()
        .unwrap();
    let per_worker = model.worker_memory_bytes(&pd, 64, sgd);
    assert!(per_worker > model.worker_memory_bytes(&flush, 64, sgd));
    let eight = MemoryNeed {
        bytes: per_worker * 8.0,
        workers: 8,
        holding: "w",
        lower: "fewer",
    };
    assert!(admit_memory(&eight, &machine(24)).is_ok());
    let e = check_local_workers(3000, &machine(24))
        .unwrap_err()
        .to_string();
    assert!(e.contains("workers on this host is 3000"), "{e}");
}
