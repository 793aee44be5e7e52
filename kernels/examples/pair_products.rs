//! A linear layer's two backward products on two threads: one after the other, each split
//! over both threads by the backend (as the step runs them), against the two side by side,
//! each whole on one thread (the input gradient `dX = dY W^T` on one, the weight gradient
//! `dW = X^T dY` on the other). The two are independent, so side by side no thread waits
//! inside a product and each packs its operands in its own cache.
//!
//! ```sh
//! cargo run --release -p pipe-kernels --example pair_products -- 15   # rounds
//! WIDTHS="512 768" cargo run --release -p pipe-kernels --example pair_products
//! MLP=1 cargo run --release -p pipe-kernels --example pair_products -- 61   # the MLP's layer
//! ```
//!
//! Each round times each way once per layer, taking turns, and the table gives the medians
//! over the rounds. Before timing, the side-by-side results are asserted equal bit for bit to
//! the backend's: each product's route and blocks depend on its shape alone, and `gemm` never
//! splits the inner dimension. The GPT-2 layers have 2,048 token rows (`WIDTHS`, default 512
//! and 768); with `MLP` set, the single-worker MLP's hidden layer at 256 rows instead.
#![allow(clippy::expect_used)]

mod common;

use common::{Layer, TOKENS, gpt2_layers, matrix, median, seconds, widths};

use pipe_kernels::{Backend, CpuBackend, Tensor, Trans};

/// A layer's operands: input `x`, weight `w` (stored in x out), output gradient `dy`.
type Operands<'t> = (&'t Tensor, &'t Tensor, &'t Tensor);

/// `dX` and `dW` side by side, each whole on one thread of `pool`, each by its own one-thread
/// backend (which computes on the calling thread).
fn side_by_side(
    pool: &rayon::ThreadPool,
    one: &(CpuBackend, CpuBackend),
    (x, w, dy): Operands<'_>,
    dx: &mut Tensor,
    dw: &mut Tensor,
) {
    pool.join(
        || {
            one.0
                .matmul(dy, Trans::No, w, Trans::Yes, dx, false)
                .expect("dX")
        },
        || {
            one.1
                .matmul(x, Trans::Yes, dy, Trans::No, dw, false)
                .expect("dW")
        },
    );
}

/// `dX`, then `dW`, each split over both threads by `be`.
fn one_after_the_other(
    be: &CpuBackend,
    (x, w, dy): Operands<'_>,
    dx: &mut Tensor,
    dw: &mut Tensor,
) {
    be.matmul(dy, Trans::No, w, Trans::Yes, dx, false)
        .expect("dX");
    be.matmul(x, Trans::Yes, dy, Trans::No, dw, false)
        .expect("dW");
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    let be = CpuBackend::new(2).expect("backend");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("pool");
    println!("2 threads, {rounds} rounds; ms, median over the rounds");
    println!("| width | layer | dX + dW on both threads | side by side | side by side / split |");
    println!("|---|---|---|---|---|");
    let (mut split_total, mut pair_total) = (0.0, 0.0);
    let one = (
        CpuBackend::new(1).expect("backend"),
        CpuBackend::new(1).expect("backend"),
    );
    let layers: Vec<(usize, Layer, usize)> = if std::env::var_os("MLP").is_some() {
        vec![(1024, ("mlp hidden", 1024, 1024), 256)]
    } else {
        let each = widths("512 768").into_iter();
        each.flat_map(|w| gpt2_layers(w).map(|l| (w, l, TOKENS)))
            .collect()
    };
    for (width, (layer, fan_in, fan_out), rows) in layers {
        let (x, w, dy) = (
            matrix(rows, fan_in, 1),
            matrix(fan_in, fan_out, 2),
            matrix(rows, fan_out, 3),
        );
        let operands = (&x, &w, &dy);
        let (mut dx, mut dw) = (Tensor::default(), Tensor::default());
        let (mut pdx, mut pdw) = (Tensor::default(), Tensor::default());
        one_after_the_other(&be, operands, &mut dx, &mut dw);
        side_by_side(&pool, &one, operands, &mut pdx, &mut pdw);
        assert!(
            dx.host().expect("dx") == pdx.host().expect("dx"),
            "{layer}: dX bits"
        );
        assert!(
            dw.host().expect("dw") == pdw.host().expect("dw"),
            "{layer}: dW bits"
        );
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            a.push(seconds(&mut || {
                one_after_the_other(&be, operands, &mut dx, &mut dw)
            }));
            b.push(seconds(&mut || {
                side_by_side(&pool, &one, operands, &mut pdx, &mut pdw)
            }));
        }
        let (a, b) = (median(&mut a) * 1e3, median(&mut b) * 1e3);
        split_total += a;
        pair_total += b;
        println!(
            "| {width} | {layer} ({rows}x{fan_in}x{fan_out}) | {a:.2} | {b:.2} | {:.3} |",
            b / a
        );
    }
    println!(
        "sum of the medians: split {split_total:.1} ms, side by side {pair_total:.1} ms \
         ({:.3})",
        pair_total / split_total
    );
}
