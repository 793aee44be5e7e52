//! The training step's three products (`Y = X W`, `dX = dY W^T`, `dW = X^T dY`, `W` stored
//! in x out) through BLIS's CBLAS interface, on the shapes that
//! `pipe-kernels`' `gemm_alternatives` example times. Threads: `T` (default 1).

use std::time::Instant;

use cblas_sys::{CBLAS_LAYOUT, CBLAS_TRANSPOSE, cblas_sgemm};

// Links the static BLIS library the crate builds.
use blis_src as _;

unsafe extern "C" {
    fn bli_thread_set_num_threads(n: i64);
}

/// Median seconds of `f` over 31 calls after 5 warm-up calls.
fn median_seconds(f: &mut dyn FnMut()) -> f64 {
    for _ in 0..5 {
        f();
    }
    let mut times: Vec<f64> = (0..31)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
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
        let row = CBLAS_LAYOUT::CblasRowMajor;
        // SAFETY (each call): row-major buffers of the sizes the dimensions and leading
        // dimensions describe.
        let s = median_seconds(&mut || unsafe {
            cblas_sgemm(
                row,
                N,
                N,
                mi,
                ni,
                ki,
                1.0,
                x.as_ptr(),
                ki,
                w.as_ptr(),
                ni,
                0.0,
                y.as_mut_ptr(),
                ni,
            )
        });
        println!("| Y = X W | {m}x{k}x{n} | {:.1} |", flops / s / 1e9);
        let s = median_seconds(&mut || unsafe {
            cblas_sgemm(
                row,
                N,
                T,
                mi,
                ni,
                ki,
                1.0,
                x.as_ptr(),
                ki,
                w.as_ptr(),
                ki,
                0.0,
                y.as_mut_ptr(),
                ni,
            )
        });
        println!("| dX = dY W^T | {m}x{k}x{n} | {:.1} |", flops / s / 1e9);
        let s = median_seconds(&mut || unsafe {
            cblas_sgemm(
                row,
                T,
                N,
                ki,
                ni,
                mi,
                1.0,
                x.as_ptr(),
                ki,
                y.as_ptr(),
                ni,
                0.0,
                dw.as_mut_ptr(),
                ni,
            )
        });
        println!("| dW = X^T dY | {k}x{m}x{n} | {:.1} |", flops / s / 1e9);
    }
}
