//! The kernels of one `gpt-mini` block (width 128, 4 heads, 128 tokens) timed alone at a batch
//! of sequences, each as a fraction of the 256x1024x1024 reference GEMM timed in the same run:
//! the four linear products in each pass, GELU, and causal attention. It shows where the
//! block's step loses to the GEMM rate (`pipe bench mfu --model gpt-mini` times the whole step).
//!
//! ```sh
//! cargo run --release -p pipe-kernels --example block_shapes [BATCH]   # default 64 sequences
//! ```
//!
//! Attention is counted in model FLOPs: the forward's `Q K^T` and `P V` over the full `T x T`
//! tile (2 T^2 C each per sequence), and twice that for the backward (its recomputation of the
//! scores is not counted). Medians of 31 calls after 5 untimed ones, 2 threads.
#![allow(clippy::expect_used)]

mod common;

use common::median_seconds;
use pipe_kernels::{Activation, AttentionShape, Backend, CpuBackend, Tensor, Trans};

const WIDTH: usize = 128;
const SEQ: usize = 128;

/// A deterministic tensor of small values.
fn filled(shape: &[usize], seed: usize) -> Tensor {
    let n: usize = shape.iter().product();
    let values = (0..n)
        .map(|i| ((i * 7 + seed) % 13) as f32 * 0.01 - 0.06)
        .collect();
    Tensor::from_vec(shape, values).expect("tensor")
}

/// Seconds of `op(a) op(b)` into a fresh output.
fn product_seconds(be: &dyn Backend, a: &Tensor, ta: Trans, b: &Tensor, tb: Trans) -> f64 {
    let mut out = Tensor::default();
    median_seconds(&mut || be.matmul(a, ta, b, tb, &mut out, false).expect("matmul"))
}

fn main() {
    let batch: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(64);
    let be = CpuBackend::new(2).expect("backend");
    let rows = batch * SEQ;
    let reference = product_seconds(
        &be,
        &filled(&[256, 1024], 1),
        Trans::No,
        &filled(&[1024, 1024], 2),
        Trans::No,
    );
    let gemm = 2.0 * 256.0 * 1024.0 * 1024.0 / reference;
    println!(
        "batch {batch} sequences ({rows} rows); reference GEMM {:.1} GFLOP/s",
        gemm / 1e9
    );
    let c = WIDTH;
    let mut products = 0.0;
    for (name, k, n) in [
        ("qkv", c, 3 * c),
        ("proj", c, c),
        ("fc1", c, 4 * c),
        ("fc2", 4 * c, c),
    ] {
        let (x, w, dy) = (
            filled(&[rows, k], 3),
            filled(&[k, n], 4),
            filled(&[rows, n], 5),
        );
        let flops = 2.0 * (rows * k * n) as f64;
        let fwd = product_seconds(&be, &x, Trans::No, &w, Trans::No);
        let dx = product_seconds(&be, &dy, Trans::No, &w, Trans::Yes);
        let dw = product_seconds(&be, &x, Trans::Yes, &dy, Trans::No);
        products += fwd + dx + dw;
        println!(
            "{name:5} forward {:6.2} ms ({:.2})  dX {:6.2} ms ({:.2})  dW {:6.2} ms ({:.2})",
            fwd * 1e3,
            flops / fwd / gemm,
            dx * 1e3,
            flops / dx / gemm,
            dw * 1e3,
            flops / dw / gemm
        );
    }
    println!("products together {:.2} ms", products * 1e3);
    let hidden = filled(&[rows, 4 * c], 6);
    let (mut y, mut dx) = (Tensor::default(), Tensor::default());
    let gelu = median_seconds(&mut || {
        be.activation(Activation::Gelu, &hidden, &mut y)
            .expect("gelu")
    });
    let gelu_back = median_seconds(&mut || {
        be.activation_backward(Activation::Gelu, &hidden, &hidden, &mut dx)
            .expect("gelu backward")
    });
    println!(
        "gelu  forward {:6.2} ms  backward {:6.2} ms",
        gelu * 1e3,
        gelu_back * 1e3
    );
    let shape = AttentionShape {
        batch,
        seq: SEQ,
        heads: 4,
        width: c,
    };
    let qkv = filled(&[rows, 3 * c], 7);
    let (mut o, mut lse, mut d) = (Tensor::default(), Tensor::default(), Tensor::default());
    let fwd = median_seconds(&mut || {
        be.attention(&qkv, None, shape, &mut o, &mut lse)
            .expect("attention")
    });
    let back = median_seconds(&mut || {
        be.attention_backward(&qkv, None, &o, &lse, &o, shape, &mut d)
            .expect("attention backward")
    });
    let tile = 2.0 * (batch * SEQ * SEQ * c) as f64;
    println!(
        "attention forward {:6.2} ms ({:.2})  backward {:6.2} ms ({:.2})  together ({:.2})",
        fwd * 1e3,
        2.0 * tile / fwd / gemm,
        back * 1e3,
        4.0 * tile / back / gemm,
        6.0 * tile / (fwd + back) / gemm
    );
}
