//! The backward product `dX = dY W^T` (256 x 1024 x 1024) through `gemm` in several operand
//! layouts, timed side by side: why the CPU backend computes it as `C^T = W dY^T` with both
//! operands row-major.
//!
//! ```sh
//! cargo run --release -p pipe-kernels --example dx_layouts [THREADS]   # default 2
//! ```
//!
//! Prints the median of 31 timed calls per layout after 5 untimed ones.
#![allow(clippy::expect_used)]

mod common;

use common::median_seconds;

/// A matrix operand: where it starts, then its column and row strides (the crate's order).
type Operand<P> = (P, isize, isize);

/// `gemm::gemm` overwriting `dst`. The pointers must hold the strided matrices the operands
/// describe.
unsafe fn product(
    (m, n, k): (usize, usize, usize),
    (dst, dst_cs, dst_rs): Operand<*mut f32>,
    (lhs, lhs_cs, lhs_rs): Operand<*const f32>,
    (rhs, rhs_cs, rhs_rs): Operand<*const f32>,
    par: gemm::Parallelism,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        gemm::gemm(
            m, n, k, dst, dst_cs, dst_rs, false, lhs, lhs_cs, lhs_rs, rhs, rhs_cs, rhs_rs, 1.0,
            1.0, false, false, false, par,
        );
    }
}

fn main() {
    // dX is m x n, dY m x k, W n x k (stored in x out, so dX = dY W^T).
    let (m, k, n) = (256usize, 1024usize, 1024usize);
    let dy: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.01).collect();
    let w: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 * 0.01).collect();
    let mut w_t = vec![0.0f32; n * k];
    let mut dy_t = vec![0.0f32; m * k];
    let mut dx = vec![0.0f32; m * n];
    let mut dx_t = vec![0.0f32; m * n];
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    let flops = 2.0 * (m * n * k) as f64;
    let report = |name: &str, s: f64| {
        println!(
            "{name:48} {:7.3} ms {:6.1} GFLOP/s",
            s * 1e3,
            flops / s / 1e9
        );
    };
    let (ik, im, i1) = (k as isize, m as isize, 1isize);
    println!("dX = dY W^T, {m} x {k} x {n}, {threads} threads");
    // SAFETY (every call below): the buffers hold the matrices the operands name.
    let timed =
        |dims, dst, lhs, rhs| median_seconds(&mut || unsafe { product(dims, dst, lhs, rhs, par) });
    pool.install(|| {
        let s = timed(
            (m, n, k),
            (dx.as_mut_ptr(), 1, n as isize),
            (dy.as_ptr(), 1, ik),
            (w.as_ptr(), ik, 1),
        );
        report("dY W^T, right operand column-major", s);
        let s = median_seconds(&mut || {
            transpose::transpose(&dy, &mut dy_t, k, m);
            unsafe {
                product(
                    (n, m, k),
                    (dx_t.as_mut_ptr(), 1, im),
                    (w.as_ptr(), 1, ik),
                    (dy_t.as_ptr(), 1, im),
                    par,
                )
            }
            transpose::transpose(&dx_t, &mut dx, m, n);
        });
        report("W dY^T row-major, both transposes included", s);
        let s = timed(
            (n, m, k),
            (dx_t.as_mut_ptr(), 1, im),
            (w.as_ptr(), 1, ik),
            (dy.as_ptr(), ik, i1),
        );
        report("W dY^T, right operand column-major", s);
        let s = median_seconds(&mut || transpose::transpose(&w, &mut w_t, k, n));
        report("transposed copy of W alone", s);
        let s = timed(
            (m, n, k),
            (dx.as_mut_ptr(), 1, n as isize),
            (dy.as_ptr(), 1, ik),
            (w_t.as_ptr(), 1, n as isize),
        );
        report("dY (W^T copy), both row-major", s);
    });
}
