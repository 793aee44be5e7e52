//! The matrix products of one GPT-2 training step (16 windows of 128 tokens: 2,048 rows) at
//! widths 128, 512 and 768, through the CPU backend, with their rate in GFLOP/s: the figures
//! `experiments/cpu-step/products.py` puts beside PyTorch's for the same shapes.
//!
//! ```sh
//! cargo run --release -p pipe-kernels --example step_products -- 2   # threads
//! ```
//!
//! Each row is the median of 31 timed calls after 5 untimed ones ([`common::median_seconds`]).
//! The forward products read the weight as stored (`X W`), the input gradients read it
//! transposed (`dY W^T`) and the weight gradients read the input transposed (`X^T dY`), as the
//! layers call them.
#![allow(clippy::expect_used)]

mod common;

use common::median_seconds;

use pipe_kernels::{Backend, CpuBackend, Tensor, Trans};

/// Rows of every activation: 16 windows of 128 positions.
const TOKENS: usize = 2048;
/// The vocabulary of the experiment's tokenizer.
const VOCAB: usize = 1024;

/// A row-major `rows x cols` matrix of small deterministic values.
fn matrix(rows: usize, cols: usize, salt: usize) -> Tensor {
    let data = (0..rows * cols)
        .map(|i| ((i * 7 + salt) % 13) as f32 * 0.01)
        .collect();
    Tensor::from_vec(&[rows, cols], data).expect("shape matches data")
}

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let widths: Vec<usize> = std::env::var("WIDTHS")
        .unwrap_or_else(|_| "128 512 768".into())
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    let be = CpuBackend::new(threads).expect("backend");
    println!("{threads} thread(s); GFLOP/s, median of 31 calls");
    println!("| width | product | m x k x n | GFLOP/s |");
    println!("|---|---|---|---|");
    for width in widths {
        // (name, input width, output width) of the step's linear layers.
        let layers = [
            ("qkv", width, 3 * width),
            ("attn proj", width, width),
            ("fc", width, 4 * width),
            ("fc proj", 4 * width, width),
            ("head", width, VOCAB),
        ];
        for (layer, fan_in, fan_out) in layers {
            let x = matrix(TOKENS, fan_in, 1);
            let w = matrix(fan_in, fan_out, 2);
            let dy = matrix(TOKENS, fan_out, 3);
            let cases = [
                ("Y = X W", &x, Trans::No, &w, Trans::No),
                ("dX = dY W^T", &dy, Trans::No, &w, Trans::Yes),
                ("dW = X^T dY", &x, Trans::Yes, &dy, Trans::No),
            ];
            for (name, a, ta, b, tb) in cases {
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
            }
        }
    }
}
