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
use pipe_scheduler::{
    LayerProfile, PipeDreamOptions, PlanOptions, Policy, Profile, pipedream, plan_partition,
};

/// A seeded 1,000-layer profile (xorshift noise; no dependencies).
pub fn profile(layers: usize) -> Profile {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut noise = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        0.7 + 0.6 * (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let kinds = [
        (4e-3, 8e6, 4e6),
        (8e-3, 32e6, 4e6),
        (2e-4, 0.0, 4e6),
        (1e-3, 1e5, 4e6),
    ];
    Profile::chain(
        (0..layers)
            .map(|i| {
                let (t, p, a) = kinds[i % kinds.len()];
                LayerProfile {
                    name: format!("layer{i}"),
                    forward: t * noise(),
                    backward_input: t * noise(),
                    backward_weight: t * noise(),
                    update: p / 1e11,
                    activation_bytes: a * noise(),
                    param_bytes: p,
                    stash_bytes: None,
                }
            })
            .collect(),
    )
}

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
