//! The simulator on schedules the size users run: 4 stages of 2 replicas, 8 minibatches of
//! 8 microbatches per replica, per policy (what `pipe simulate` and the sweep's predictions
//! cost), and the generator and lowering alone.
//!
//! `cargo bench -p pipe-scheduler --bench simulate`. Costs are the shape of a 4-stage MLP:
//! forward 1 ms, each backward half 1 ms, 256 KiB activations, 16 MiB of weights per stage,
//! 10 GB/s links with 5 us latency, two shared cores.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use pipe_scheduler::{
    CostModel, Length, LowerOptions, Policy, ScheduleSpec, SimOptions, StageCost, generate, lower,
    simulate,
};

fn costs() -> CostModel {
    CostModel {
        bandwidth: 10e9,
        latency: 5e-6,
        cores: Some(2),
        ..CostModel::uniform(StageCost {
            backward_input: 1e-3,
            backward_weight: 1e-3,
            activation_bytes: f64::from(256u32 << 10),
            param_bytes: f64::from(16u32 << 20),
            update: 1e-4,
            ..StageCost::compute(1e-3, 0.0)
        })
    }
}

fn bench(c: &mut Criterion) {
    let costs = costs();
    let mut g = c.benchmark_group("simulate_4x2_8x8");
    for policy in [
        Policy::OneFOneBFlush,
        Policy::ZbH1,
        Policy::ZbV,
        Policy::DualPipeV,
        Policy::PipeDream,
        Policy::TwoBw,
    ] {
        let spec = ScheduleSpec::new(policy, 4, 8)
            .with_replicas(vec![2])
            .with_length(Length::Updates(8));
        let schedule = lower(&generate(&spec).unwrap(), LowerOptions::default());
        g.bench_with_input(
            BenchmarkId::new("simulate", policy.name()),
            &schedule,
            |b, s| {
                b.iter(|| {
                    simulate(black_box(s), &costs, SimOptions::default())
                        .unwrap()
                        .makespan
                })
            },
        );
        g.bench_with_input(
            BenchmarkId::new("generate_lower", policy.name()),
            &spec,
            |b, s| {
                b.iter(|| lower(&generate(black_box(s)).unwrap(), LowerOptions::default()).len())
            },
        );
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
