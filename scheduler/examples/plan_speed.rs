//! Times `plan_checked` on the seeded 1,000-layer profile for 64 workers, every policy the
//! planner plans and three bandwidths: `cargo run --release -p pipe-scheduler --example
//! plan_speed`. One run each (criterion medians for some cases: `--bench partition`).
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use pipe_scheduler::{PlanOptions, Policy, plan_checked};

#[path = "../benches/common/mod.rs"]
mod common;
use common::profile;

fn main() {
    let p = profile(1000);
    for policy in std::env::args()
        .nth(1)
        .map(|p| vec![p.parse::<Policy>().unwrap()])
        .unwrap_or(vec![
            Policy::PipeDream,
            Policy::OneFOneBFlush,
            Policy::Gpipe,
            Policy::TwoBw,
        ])
    {
        for bw in std::env::args()
            .nth(2)
            .map(|b| vec![b.parse::<f64>().unwrap()])
            .unwrap_or(vec![10e9, 1e9, 0.1e9])
        {
            let opts = PlanOptions {
                policy,
                ..PlanOptions::new(64, bw)
            };
            let start = Instant::now();
            let plan = plan_checked(&p, &opts).unwrap();
            println!(
                "{policy:<12} {:>5} GB/s  {:>8.1} ms  {} stages  {:.3} ms per microbatch",
                bw / 1e9,
                start.elapsed().as_secs_f64() * 1e3,
                plan.stages.len(),
                plan.time_per_microbatch * 1e3
            );
        }
    }
}
