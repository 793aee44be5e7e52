//! The training step's three products (`Y = X W`, `dX = dY W^T`, `dW = X^T dY`, `W` stored
//! in x out) through BLIS's CBLAS interface, on the shapes that
//! `pipe-kernels`' `gemm_alternatives` example times. Threads: `T` (default 1).

use cblas_sys::{CBLAS_LAYOUT, CBLAS_TRANSPOSE, cblas_sgemm};

// Links the static BLIS library the crate builds.
use blis_src as _;

unsafe extern "C" {
    fn bli_thread_set_num_threads(n: i64);
}

// The kernel examples' timing rule, so both sides of the comparison time alike.
#[path = "../../../kernels/examples/common/mod.rs"]
mod common;

use common::median_seconds;

/// `C = A B` (`m x k` by `k x n`, either operand transposed as `trans` says) in row-major
/// buffers with the leading dimensions `ld` (of A, B and C).
fn sgemm(
    trans: (CBLAS_TRANSPOSE, CBLAS_TRANSPOSE),
    (m, n, k): (i32, i32, i32),
    (a, b, c): (&[f32], &[f32], &mut [f32]),
    ld: (i32, i32, i32),
) {
    // SAFETY: row-major buffers of the sizes the dimensions and leading dimensions describe.
    unsafe {
        cblas_sgemm(
            CBLAS_LAYOUT::CblasRowMajor,
            trans.0,
            trans.1,
            m,
            n,
            k,
            1.0,
            a.as_ptr(),
            ld.0,
            b.as_ptr(),
            ld.1,
            0.0,
            c.as_mut_ptr(),
            ld.2,
        )
    }
}

fn main() {
    let threads: i64 = std::env::var("T")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    // SAFETY: a plain setter of BLIS's global thread count, called before any product.
    unsafe { bli_thread_set_num_threads(threads) };
    println!("BLIS, {threads} thread(s); GFLOP/s, median of 31 calls");
    println!("| product | m x k x n | BLIS |");
    println!("|---|---|---|");
    use CBLAS_TRANSPOSE::{CblasNoTrans as N, CblasTrans as T};
    for (m, k) in [(32usize, 1024usize), (64, 1024), (256, 1024), (256, 256)] {
        let n = k;
        let flops = 2.0 * (m * n * k) as f64;
        let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.01).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 * 0.01).collect();
        let mut y = vec![0.0f32; m * n];
        let mut dw = vec![0.0f32; k * n];
        let (mi, ki, ni) = (m as i32, k as i32, n as i32);
        let s = median_seconds(&mut || sgemm((N, N), (mi, ni, ki), (&x, &w, &mut y), (ki, ni, ni)));
        println!("| Y = X W | {m}x{k}x{n} | {:.1} |", flops / s / 1e9);
        let s = median_seconds(&mut || sgemm((N, T), (mi, ni, ki), (&x, &w, &mut y), (ki, ki, ni)));
        println!("| dX = dY W^T | {m}x{k}x{n} | {:.1} |", flops / s / 1e9);
        let s =
            median_seconds(&mut || sgemm((T, N), (ki, ni, mi), (&x, &y, &mut dw), (ki, ni, ni)));
        println!("| dW = X^T dY | {k}x{m}x{n} | {:.1} |", flops / s / 1e9);
    }
}
