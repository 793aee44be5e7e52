//! A gradient norm's sum of squares over GPT-2 width 768's 57.6 M parameters (the `run.sh`
//! model of `experiments/cpu-step/`), the CPU backend's against one running `f64` sum on the
//! calling thread (the backend's before it summed in blocks), taking turns: each one's time
//! and result, and their relative difference.
//!
//! ```sh
//! cargo run --release -p pipe-kernels --example square_sum -- 2   # threads; 7 rounds
//! ```
#![allow(clippy::expect_used)]

use pipe_kernels::{Backend, CpuBackend, Tensor};
use std::time::Instant;

/// The parameters of `run.sh`'s GPT-2 at width 768.
const VALUES: usize = 57_589_248;

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let values: Vec<f32> = (0..VALUES)
        .map(|i| ((i * 7919) % 1013) as f32 * 1e-3 - 0.5)
        .collect();
    let tensor = Tensor::from_vec(&[VALUES], values.clone()).expect("tensor");
    let be = CpuBackend::new(threads).expect("backend");
    println!("{VALUES} values, {threads} thread(s)");
    println!("| round | one running sum, ms | backend, ms | relative difference |");
    println!("|---|---|---|---|");
    for round in 1..=7 {
        let t = Instant::now();
        let one: f64 = values.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let one_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let blocks = be.sum_squares(&tensor).expect("sum of squares");
        let blocks_ms = t.elapsed().as_secs_f64() * 1e3;
        println!(
            "| {round} | {one_ms:.1} | {blocks_ms:.1} | {:.1e} |",
            (blocks - one).abs() / one
        );
    }
}
