//! The matrix products of one GPT-2 training step (16 windows of 128 tokens: 2,048 rows) at
//! widths 128, 512 and 768, through the CPU backend, with their rate in GFLOP/s: the figures
//! `experiments/cpu-step/products.py` puts beside PyTorch's for the same shapes.
//!
//! ```sh
//! cargo run --release -p pipe-kernels --example step_products -- 2   # threads
//! PRECISION=bf16x6 cargo run --release -p pipe-kernels --example step_products -- 2
//! ```
//!
//! Each row is the median of 31 timed calls after 5 untimed ones ([`common::median_seconds`]);
//! the last lines sum each width's medians, one of each product (the step makes each shape
//! once per block, and the head's once).
//! The forward products read the weight as stored (`X W`), the input gradients read it
//! transposed (`dY W^T`) and the weight gradients read the input transposed (`X^T dY`), as the
//! layers call them.
#![allow(clippy::expect_used)]

mod common;

use common::{each_step_product, median_seconds, widths};

use pipe_kernels::{Backend, CpuBackend, Precision, Tensor};

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let widths = widths("128 512 768");
    let precision: Precision = std::env::var("PRECISION")
        .unwrap_or_else(|_| "f32".into())
        .parse()
        .expect("PRECISION: f32, bf16x6 or bf16x3");
    let be = CpuBackend::with_precision(threads, precision).expect("backend");
    println!("{threads} thread(s), {precision} products; GFLOP/s, median of 31 calls");
    println!("| width | product | m x k x n | GFLOP/s |");
    println!("|---|---|---|---|");
    let mut totals: Vec<(usize, f64)> = Vec::new();
    each_step_product(&widths, |width, layer, (name, a, ta, b, tb)| {
        let ((m, k), n) = (ta.dims(a), tb.dims(b).1);
        let flops = 2.0 * (m * k * n) as f64;
        let mut c = Tensor::default();
        let seconds = median_seconds(&mut || {
            be.matmul(a, ta, b, tb, &mut c, false).expect("matmul");
        });
        println!(
            "| {width} | {layer}: {name} | {m}x{k}x{n} | {:.1} |",
            flops / seconds / 1e9
        );
        match totals.last_mut() {
            Some((w, total)) if *w == width => *total += seconds,
            _ => totals.push((width, seconds)),
        }
    });
    for (width, total) in totals {
        println!(
            "width {width}: {:.1} ms for one of each product (the sum of their medians)",
            total * 1e3
        );
    }
}
