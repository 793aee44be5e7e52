//! Planning a 1,000-layer profile for 64 workers with replication.
//!
//! `cargo bench -p pipe-scheduler --bench partition`. The profile is seeded and fixed: a
//! transformer-like repeat of wide and narrow layers (attention-sized, MLP-sized and cheap
//! element-wise ones) with ±30% noise on every cost, so no two layers tie. Cases: the default
//! cost model under PipeDream's asynchronous schedule (one table, any number of stages; and
//! the same checked by the simulator against a straight pipeline and data parallelism), under
//! 1F1B with flushes at 10 GB/s and at 1 GB/s (one table per stage count until no more
//! stages can score better, then the simulator times the most promising plans; at 10 GB/s data
//! parallelism is near the floor and the search ends after one stage count, at 1 GB/s and
//! 0.1 GB/s it goes deeper), the same at 0.1 GB/s for both schedules, and PipeDream's own
//! optimizer for comparison. `cargo run --release -p pipe-scheduler --example plan_speed`
//! times what `pipe plan` runs (`plan_checked`) for four policies at 10, 1 and 0.1 GB/s.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use pipe_scheduler::{PipeDreamOptions, PlanOptions, Policy, pipedream, plan_partition};

mod common;
use common::profile;

fn bench(c: &mut Criterion) {
    let p = profile(1000);
    let mut g = c.benchmark_group("partition_1000_layers_64_workers");
    g.sample_size(10).measurement_time(Duration::from_secs(10));
    let async_opts = PlanOptions::new(64, 10e9);
    g.bench_function("default_pipedream", |b| {
        b.iter(|| black_box(plan_partition(&p, &async_opts).unwrap().time_per_microbatch))
    });
    g.bench_function("default_pipedream_checked", |b| {
        b.iter(|| {
            black_box(
                pipe_scheduler::plan_checked(&p, &async_opts)
                    .unwrap()
                    .time_per_microbatch,
            )
        })
    });
    let flush = PlanOptions {
        policy: Policy::OneFOneBFlush,
        ..PlanOptions::new(64, 10e9)
    };
    g.bench_function("default_1f1b-flush", |b| {
        b.iter(|| black_box(plan_partition(&p, &flush).unwrap().time_per_microbatch))
    });
    // At 1 GB/s data parallelism is far from the floor, so many stage counts are searched.
    let slow_flush = PlanOptions {
        policy: Policy::OneFOneBFlush,
        ..PlanOptions::new(64, 1e9)
    };
    g.bench_function("default_1f1b-flush_1GBps", |b| {
        b.iter(|| black_box(plan_partition(&p, &slow_flush).unwrap().time_per_microbatch))
    });
    // At 0.1 GB/s the all-reduce dominates: the pruning that counts it keeps both fast.
    let slowest_flush = PlanOptions {
        policy: Policy::OneFOneBFlush,
        ..PlanOptions::new(64, 0.1e9)
    };
    g.bench_function("default_1f1b-flush_0.1GBps", |b| {
        b.iter(|| {
            black_box(
                plan_partition(&p, &slowest_flush)
                    .unwrap()
                    .time_per_microbatch,
            )
        })
    });
    let slowest_async = PlanOptions::new(64, 0.1e9);
    g.bench_function("default_pipedream_0.1GBps_checked", |b| {
        b.iter(|| {
            black_box(
                pipe_scheduler::plan_checked(&p, &slowest_async)
                    .unwrap()
                    .time_per_microbatch,
            )
        })
    });
    let pd = PipeDreamOptions::new(64, 10e9);
    g.bench_function("pipedream_model", |b| {
        b.iter(|| black_box(pipedream(&p, &pd).unwrap().time_per_microbatch))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
