//! Causal attention's forward and backward through the CPU backend at growing sequence
//! lengths, timed (the process's peak resident memory is what `/usr/bin/time -f %M` reports).
//!
//! ```sh
//! cargo run --release -p pipe-kernels --example attention_lengths -- 2        # threads
//! LENGTHS="128:16 1024:2 4096:2" cargo run --release -p pipe-kernels --example attention_lengths
//! ```
//!
//! `LENGTHS` lists `T:BATCH` pairs (default `128:16 1024:2 4096:2`); width 512 with 16 heads,
//! GPT-2's head width of 32. Each figure is the median of 11 timed calls after 2 untimed ones.
#![allow(clippy::expect_used)]

mod common;

use common::{matrix, median_seconds_of};

use pipe_kernels::{AttentionShape, Backend, CpuBackend, Tensor};

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let lengths: Vec<(usize, usize)> = std::env::var("LENGTHS")
        .unwrap_or_else(|_| "128:16 1024:2 4096:2".into())
        .split_whitespace()
        .filter_map(|pair| {
            let (t, b) = pair.split_once(':')?;
            Some((t.parse().ok()?, b.parse().ok()?))
        })
        .collect();
    let (width, heads) = (512, 16);
    let be = CpuBackend::new(threads).expect("backend");
    println!("{threads} thread(s), width {width}, {heads} heads; median of 11 calls");
    println!("| T | sequences | forward ms | backward ms | backward / forward |");
    println!("|---|---|---|---|---|");
    for (seq, batch) in lengths {
        let shape = AttentionShape {
            batch,
            seq,
            heads,
            width,
        };
        let rows = batch * seq;
        // Scaled down so the scores stay in exp's range.
        let mut qkv = matrix(rows, 3 * width, 1);
        be.scale(0.1, &mut qkv).expect("scale");
        let dout = matrix(rows, width, 2);
        let (mut out, mut lse) = (Tensor::zeros(&[rows, width]), Tensor::zeros(&[1]));
        let mut dqkv = Tensor::zeros(&[rows, 3 * width]);
        let mut forward_call = || {
            be.attention(&qkv, None, shape, &mut out, &mut lse)
                .expect("attention");
        };
        let forward = median_seconds_of(&mut forward_call, 2, 11);
        let mut backward_call = || {
            be.attention_backward(&qkv, None, &out, &lse, &dout, shape, &mut dqkv)
                .expect("attention backward");
        };
        let backward = median_seconds_of(&mut backward_call, 2, 11);
        println!(
            "| {seq} | {batch} | {:.2} | {:.2} | {:.2} |",
            1e3 * forward,
            1e3 * backward,
            backward / forward
        );
    }
}
