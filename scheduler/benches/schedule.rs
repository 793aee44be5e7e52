//! Generating, lowering and simulating big schedules: 1,024 workers and 10,000 microbatches.
//!
//! `cargo bench -p pipe-scheduler --bench schedule`. Each iteration runs the whole planning path
//! a user pays before a run starts: generate the programs, lower them (sends and receives),
//! derive the version plan and simulate with a cost model (the simulator's engine is also the
//! dry run). Layouts: a straight 1,024-stage pipeline (every microbatch visits every worker:
//! about 20 million compute actions and 40 million sends and receives) and 128 stages of 8
//! replicas (1,024 workers, 1.3 million compute actions plus the all-reduces). The `streamed/`
//! cases time `simulate_spec`, which generates and lowers each worker's program as the engine
//! consumes it and never holds the schedule (what `pipe simulate` runs when no trace is asked
//! for); the `materialised/` cases build the whole schedule first.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use pipe_scheduler::{
    CostModel, Length, LowerOptions, Policy, ScheduleSpec, SimOptions, StageCost, generate, lower,
    simulate, simulate_spec,
};

fn costs() -> CostModel {
    CostModel {
        bandwidth: 10e9,
        latency: 5e-6,
        ..CostModel::uniform(StageCost {
            activation_bytes: f64::from(1u32 << 20),
            param_bytes: 16.0 * f64::from(1u32 << 20),
            update: 1e-4,
            ..StageCost::compute(1e-3, 2e-3)
        })
    }
}

fn plan_and_simulate(spec: &ScheduleSpec, c: &CostModel) -> f64 {
    let schedule = lower(&generate(spec).unwrap(), LowerOptions::default());
    simulate(&schedule, c, SimOptions::default())
        .unwrap()
        .makespan
}

fn bench(c: &mut Criterion) {
    let costs = costs();
    let mut g = c.benchmark_group("plan_1024_workers_10000_microbatches");
    g.sample_size(10).measurement_time(Duration::from_secs(20));
    let cases = [
        (
            "pipedream_1024x1",
            ScheduleSpec::new(Policy::PipeDream, 1024, 1),
        ),
        (
            "1f1b-flush_1024x1",
            ScheduleSpec::new(Policy::OneFOneBFlush, 1024, 1000),
        ),
        (
            "pipedream_128x8",
            ScheduleSpec::new(Policy::PipeDream, 128, 1).with_replicas(vec![8]),
        ),
        (
            "1f1b-flush_128x8",
            ScheduleSpec::new(Policy::OneFOneBFlush, 128, 125).with_replicas(vec![8]),
        ),
    ];
    for (name, spec) in cases {
        let spec = spec.with_length(Length::Microbatches(10_000));
        g.bench_function(format!("materialised/{name}"), |b| {
            b.iter(|| black_box(plan_and_simulate(&spec, &costs)))
        });
        g.bench_function(format!("streamed/{name}"), |b| {
            b.iter(|| {
                black_box(
                    simulate_spec(&spec, &costs, SimOptions::default())
                        .unwrap()
                        .makespan,
                )
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
