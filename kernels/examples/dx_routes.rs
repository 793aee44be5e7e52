//! The single-worker MLP's backward product `dX = dY W^T` (256 x 1024 x 1024, 2 threads)
//! through the CPU backend, beside its parts and the forward product `Y = X W` of the same
//! size, **taking turns within one process** round by round: where the backend's `dX` loses
//! time against the forward.
//!
//! ```sh
//! cargo run --release -p pipe-kernels --example dx_routes [ROUNDS]   # default 15
//! ```
//!
//! The backend computes `dX` as `C^T = W dY^T` in two row blocks of `C^T`, one per thread
//! (`matmul_transposed`). The rows printed:
//! - the backend's forward and its `dX`;
//! - the same steps with both transposes on the calling thread (the `transpose` crate) and the
//!   two products on the pool, as the backend made them before it moved the transposes to the
//!   pool;
//! - the two products alone, `dY^T` made beforehand;
//! - each transpose alone on one thread.
//!
//! (Also measured, and slower than the backend's route in the same runs: each thread
//! transposing its half of `W` and multiplying row-major; `gemm` reading `W` or `dY` in place
//! as a column-major operand.)
#![allow(clippy::expect_used, unsafe_code)]

mod common;

use common::{SendPtr as Ptr, matrix, median, product_on_one_thread, seconds};
use pipe_kernels::{Backend, CpuBackend, Tensor, Trans};

/// What each row times.
const ROUTES: [&str; 6] = [
    "Y = X W (backend)",
    "dX = dY W^T (backend)",
    "the same, both transposes on the calling thread",
    "the two C^T = W dY^T block products alone",
    "dY^T alone (transpose crate, one thread)",
    "C^T into dX alone (transpose crate, one thread)",
];

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    let (m, k, n) = (256usize, 1024usize, 1024usize);
    let be = CpuBackend::new(2).expect("backend");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("pool");
    let x = matrix(m, n, 1);
    let w_fwd = matrix(n, k, 2);
    let dy = matrix(m, k, 3);
    let w = matrix(n, k, 2); // n x k: dX = dY W^T
    let mut out = Tensor::zeros(&[m, n]);
    let mut reference = Tensor::zeros(&[m, n]);
    be.matmul(&dy, Trans::No, &w, Trans::Yes, &mut reference, false)
        .expect("product");
    let mut dy_t = vec![0.0f32; m * k];
    let mut ct = vec![0.0f32; n * m];
    let mut dx = vec![0.0f32; m * n];
    let w_at = w.host().expect("host").as_ptr() as usize;
    let half = n / 2;
    // The two block products of `C^T = W dY^T` (rows j0..j0 + half of C^T each), on the pool.
    let products = |dy_t: &[f32], ct: Ptr| {
        let dy_t_at = dy_t.as_ptr() as usize;
        pool.install(|| {
            rayon::scope(|s| {
                for j0 in [0, half] {
                    s.spawn(move |_| {
                        // SAFETY: W holds n x k values, dY^T k x m and C^T n x m; each task
                        // writes its own rows of C^T.
                        unsafe {
                            product_on_one_thread(
                                half,
                                m,
                                k,
                                ct.get().add(j0 * m),
                                m as isize,
                                (w_at as *const f32).add(j0 * k),
                                k as isize,
                                1,
                                dy_t_at as *const f32,
                                m as isize,
                                1,
                            );
                        }
                    });
                }
            });
        });
    };
    let dy_host = dy.host().expect("host");
    transpose::transpose(dy_host, &mut dy_t, k, m);
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); ROUTES.len()];
    for _ in 0..rounds {
        for (route, t) in times.iter_mut().enumerate() {
            let ct_ptr = Ptr(ct.as_mut_ptr());
            let mut call = || match route {
                0 => be
                    .matmul(&x, Trans::No, &w_fwd, Trans::No, &mut out, false)
                    .expect("product"),
                1 => be
                    .matmul(&dy, Trans::No, &w, Trans::Yes, &mut out, false)
                    .expect("product"),
                2 => {
                    transpose::transpose(dy_host, &mut dy_t, k, m);
                    products(&dy_t, ct_ptr);
                    // SAFETY: the products above have ended; `ct` holds n x m values.
                    let ct = unsafe { std::slice::from_raw_parts(ct_ptr.get(), n * m) };
                    transpose::transpose(ct, &mut dx, m, n);
                }
                3 => products(&dy_t, ct_ptr),
                4 => transpose::transpose(dy_host, &mut dy_t, k, m),
                _ => {
                    // SAFETY: as in route 2.
                    let ct = unsafe { std::slice::from_raw_parts(ct_ptr.get(), n * m) };
                    transpose::transpose(ct, &mut dx, m, n);
                }
            };
            call();
            let mut each: Vec<f64> = (0..3).map(|_| seconds(&mut call)).collect();
            t.push(median(&mut each));
            let check = match route {
                1 => Some(out.host().expect("host")),
                2 => Some(&dx[..]),
                _ => None,
            };
            if let Some(got) = check {
                let want = reference.host().expect("host");
                assert_eq!(got, want, "route {route} differs from the backend's bits");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    let flops = 2.0 * (m * n * k) as f64;
    let base = median(&mut times[0].clone());
    println!("{m} x {k} x {n}, 2 threads, medians of {rounds} alternating rounds");
    for (name, t) in ROUTES.iter().zip(&times) {
        let s = median(&mut t.clone());
        println!(
            "{name:<52} {:7.3} ms {:6.1} GFLOP/s  {:.2} of Y = X W's time",
            s * 1e3,
            flops / s / 1e9,
            s / base
        );
    }
}
