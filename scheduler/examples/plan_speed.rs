//! Times `plan_checked` on the seeded 1,000-layer profile for 64 workers, every policy the
//! planner plans and three bandwidths: `cargo run --release -p pipe-scheduler --example
//! plan_speed`. One run each (criterion medians for some cases: `--bench partition`).
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use pipe_scheduler::{LayerProfile, PlanOptions, Policy, Profile, plan_checked};

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
