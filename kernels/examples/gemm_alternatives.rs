//! The training step's three products through the CPU backend (the `gemm` crate, with the
//! backend's per-shape layouts) and through `matrixmultiply`, timed side by side: the
//! measurement behind keeping `gemm` for every shape.
//!
//! ```sh
//! MATMUL_NUM_THREADS=2 cargo run --release -p pipe-kernels --example gemm_alternatives
//! ```
//!
//! Both libraries use `MATMUL_NUM_THREADS` threads (default 1). Each row is the median of 31
//! timed calls after 5 untimed ones; the two columns of a row are timed one after the other.
#![allow(clippy::expect_used)]

mod common;

use common::{layer_products, matrix, median_seconds};

use pipe_kernels::{Backend, CpuBackend, Tensor, Trans};

/// Row and column strides of `op(t)` for a row-major `t`.
fn strides(t: &Tensor, tr: Trans) -> (isize, isize) {
    let cols = t.cols() as isize;
    match tr {
        Trans::No => (cols, 1),
        Trans::Yes => (1, cols),
    }
}

fn main() {
    let threads: usize = std::env::var("MATMUL_NUM_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let be = CpuBackend::new(threads).expect("backend");
    println!("{threads} thread(s); GFLOP/s, median of 31 calls");
    println!("| product | m x k x n | gemm (backend) | matrixmultiply | ratio |");
    println!("|---|---|---|---|---|");
    for (batch, width) in [(32, 1024), (64, 1024), (256, 1024), (256, 256)] {
        let x = matrix(batch, width, 1);
        let w = matrix(width, width, 2);
        let dy = matrix(batch, width, 3);
        for (name, a, ta, b, tb) in layer_products(&x, &w, &dy) {
            let ((m, k), n) = (ta.dims(a), tb.dims(b).1);
            let flops = 2.0 * (m * k * n) as f64;
            let mut c = Tensor::default();
            let ours = median_seconds(&mut || {
                be.matmul(a, ta, b, tb, &mut c, false).expect("matmul");
            });
            let (a_rs, a_cs) = strides(a, ta);
            let (b_rs, b_cs) = strides(b, tb);
            let mut out = vec![0.0f32; m * n];
            let (ap, bp) = (
                a.host().expect("host").as_ptr(),
                b.host().expect("host").as_ptr(),
            );
            let theirs = median_seconds(&mut || {
                // SAFETY: the pointers and strides describe the live matrices above, and `out`
                // holds m x n values.
                unsafe {
                    matrixmultiply::sgemm(
                        m,
                        k,
                        n,
                        1.0,
                        ap,
                        a_rs,
                        a_cs,
                        bp,
                        b_rs,
                        b_cs,
                        0.0,
                        out.as_mut_ptr(),
                        n as isize,
                        1,
                    );
                }
            });
            println!(
                "| {name} | {m}x{k}x{n} | {:.1} | {:.1} | {:.2} |",
                flops / ours / 1e9,
                flops / theirs / 1e9,
                ours.recip() / theirs.recip()
            );
        }
    }
}
