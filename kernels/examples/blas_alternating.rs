//! The matrix products of one GPT-2 training step through the CPU backend (`gemm`), through
//! the MKL that PyTorch ships (its `sgemm_`) and, when `OPENBLAS_LIB` names it, through numpy's
//! OpenBLAS, and with the `faer` feature through `faer`'s products (its x86 kernels,
//! `private-gemm-x86`), **taking turns within one process**: on a machine whose cores a neighbour takes in
//! bursts, libraries timed in separate runs differ by whatever the neighbour did meanwhile;
//! here every burst falls on all of them alike.
//!
//! ```sh
//! TL=.../site-packages/torch/lib
//! MKL_LIB=$TL/libtorch_cpu.so LD_LIBRARY_PATH=$TL OMP_NUM_THREADS=2 \
//!   OPENBLAS_LIB=$(ls .../site-packages/numpy.libs/libscipy_openblas64_*.so) OPENBLAS_NUM_THREADS=2 \
//!   cargo run --release -p pipe-kernels --example blas_alternating -- 2   # the backend's threads
//! ```
//!
//! (`--features faer` adds `faer`'s column; its first build takes about two and a half minutes.)
//!
//! Shapes as `step_products` (2,048 token rows; widths from `WIDTHS`, default 768; with `MLP=1`
//! the single-worker MLP's hidden layer, 256 rows at width 1,024). In each of
//! [`ROUNDS`] rounds every library makes one untimed call, [`TIMED`] timed ones back to back, and
//! then pauses: BLAS worker threads spin after a call (OpenBLAS's for about 0.1 s), and without
//! the pause they take the cores from the next library's calls (which made OpenBLAS look 1.45x
//! faster than `gemm` on two threads). Each row gives the median of each library's per-call
//! time and the median of the per-round ratios. Every library's result is checked against the
//! backend's within 1e-4 relative.
#![allow(clippy::expect_used, unsafe_code)]

mod common;

use std::time::Instant;

use common::{each_step_product, median, widths};
use pipe_kernels::{Backend, CpuBackend, Tensor, Trans};

/// Rounds per shape; in each, every library in turn makes one untimed call and `TIMED` timed
/// ones, then pauses for `PAUSE`.
const ROUNDS: usize = 15;
const TIMED: usize = 3;
const PAUSE: std::time::Duration = std::time::Duration::from_millis(200);

/// Fortran `sgemm_`, column-major, with integers of type `I` (LP64 `i32`, ILP64 `i64`).
type Sgemm<I> = unsafe extern "C" fn(
    *const u8,
    *const u8,
    *const I,
    *const I,
    *const I,
    *const f32,
    *const f32,
    *const I,
    *const f32,
    *const I,
    *const f32,
    *mut f32,
    *const I,
);

/// Row-major `C (m x n) = op(a) op(b)` through column-major `sgemm_` as `C^T = op(b)^T op(a)^T`.
fn blas<I: TryFrom<usize>>(
    sgemm: Sgemm<I>,
    (a, ta): (&Tensor, Trans),
    (b, tb): (&Tensor, Trans),
    c: &mut [f32],
) {
    let ((m, k), n) = (ta.dims(a), tb.dims(b).1);
    let flag = |t: Trans| match t {
        Trans::No => b'N',
        Trans::Yes => b'T',
    };
    let (fa, fb) = (flag(tb), flag(ta));
    let int = |v: usize| {
        I::try_from(v)
            .ok()
            .expect("dimension fits the BLAS integer")
    };
    let (mm, nn, kk) = (int(n), int(m), int(k));
    let (lda, ldb, ldc) = (int(b.cols()), int(a.cols()), int(n));
    let (one, zero) = (1.0f32, 0.0f32);
    let (ap, bp) = (b.host().expect("host"), a.host().expect("host"));
    // SAFETY: the dimensions and leading dimensions describe the tensors' own buffers and the
    // m x n output slice.
    unsafe {
        sgemm(
            &fa,
            &fb,
            &mm,
            &nn,
            &kk,
            &one,
            ap.as_ptr(),
            &lda,
            bp.as_ptr(),
            &ldb,
            &zero,
            c.as_mut_ptr(),
            &ldc,
        );
    }
}

/// Row-major `C (m x n) = op(a) op(b)` through `faer`'s product (its x86 kernels,
/// `private-gemm-x86`), on `pool`'s threads.
#[cfg(feature = "faer")]
fn faer_product(
    pool: &rayon::ThreadPool,
    (a, ta): (&Tensor, Trans),
    (b, tb): (&Tensor, Trans),
    c: &mut [f32],
) {
    let ((m, k), n) = (ta.dims(a), tb.dims(b).1);
    let strides = |x: &Tensor, t: Trans| match t {
        Trans::No => (x.cols() as isize, 1),
        Trans::Yes => (1, x.cols() as isize),
    };
    let ((a_rs, a_cs), (b_rs, b_cs)) = (strides(a, ta), strides(b, tb));
    let (ap, bp) = (a.host().expect("host"), b.host().expect("host"));
    let threads = pool.current_num_threads();
    // SAFETY: the views describe the tensors' own buffers and the m x n output slice.
    let (lhs, rhs, dst) = unsafe {
        (
            faer::MatRef::from_raw_parts(ap.as_ptr(), m, k, a_rs, a_cs),
            faer::MatRef::from_raw_parts(bp.as_ptr(), k, n, b_rs, b_cs),
            faer::MatMut::from_raw_parts_mut(c.as_mut_ptr(), m, n, n as isize, 1),
        )
    };
    let par = if threads > 1 {
        faer::Par::rayon(threads)
    } else {
        faer::Par::Seq
    };
    pool.install(|| {
        faer::linalg::matmul::matmul(dst, faer::Accum::Replace, lhs, rhs, 1.0f32, par);
    });
}

/// Each library's median seconds per call over the rounds, and for every library after the
/// backend the median of the per-round ratios `its time / gemm's` (the rate ratio gemm / it).
struct Timed {
    medians: Vec<f64>,
    ratios: Vec<f64>,
}

fn alternate(calls: &mut [&mut dyn FnMut()]) -> Timed {
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); calls.len()];
    for _ in 0..ROUNDS {
        for (j, call) in calls.iter_mut().enumerate() {
            // The first call wakes this library's threads; then its timed calls, back to back
            // as a training step makes them; then a pause that outlasts its threads' spinning
            // (OpenBLAS's workers spin for about 0.1 s after a call), so that the next
            // library's calls do not share the cores with them.
            call();
            let t = Instant::now();
            for _ in 0..TIMED {
                call();
            }
            times[j].push(t.elapsed().as_secs_f64() / TIMED as f64);
            std::thread::sleep(PAUSE);
        }
    }
    let ratios = (1..calls.len())
        .map(|j| {
            let mut r: Vec<f64> = times[0].iter().zip(&times[j]).map(|(g, o)| o / g).collect();
            median(&mut r)
        })
        .collect();
    Timed {
        medians: times.iter_mut().map(|t| median(t)).collect(),
        ratios,
    }
}

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let path = std::env::var("MKL_LIB").expect("MKL_LIB: the path of libtorch_cpu.so");
    // SAFETY: loading a library runs its initialisers; PyTorch's are meant to run in any
    // process that links it.
    let lib = unsafe { libloading::Library::new(&path) }.expect("MKL_LIB loads");
    // SAFETY: `sgemm_` has the Fortran BLAS signature above (LP64).
    let mkl: Sgemm<i32> =
        *unsafe { lib.get::<Sgemm<i32>>(b"sgemm_\0") }.expect("sgemm_ in MKL_LIB");
    let openblas_lib = std::env::var("OPENBLAS_LIB").ok().map(|p| {
        // SAFETY: as above; numpy's OpenBLAS has no initialiser beyond its own.
        unsafe { libloading::Library::new(p) }.expect("OPENBLAS_LIB loads")
    });
    // SAFETY: numpy's OpenBLAS exports the ILP64 `sgemm_` under this name.
    let openblas: Option<Sgemm<i64>> = openblas_lib.as_ref().map(|l| {
        *unsafe { l.get::<Sgemm<i64>>(b"scipy_sgemm_64_\0") }
            .expect("scipy_sgemm_64_ in OPENBLAS_LIB")
    });
    let widths = widths("768");
    let be = CpuBackend::new(threads).expect("backend");
    let var = |v: &str| std::env::var(v).unwrap_or_else(|_| "unset".into());
    println!(
        "backend {threads} thread(s), OMP_NUM_THREADS={} (MKL), OPENBLAS_NUM_THREADS={}; GFLOP/s, medians of {ROUNDS} alternating rounds",
        var("OMP_NUM_THREADS"),
        var("OPENBLAS_NUM_THREADS")
    );
    let mut names = vec!["MKL"];
    if cfg!(feature = "faer") {
        names.push("faer");
    }
    if openblas.is_some() {
        names.push("OpenBLAS");
    }
    #[cfg(feature = "faer")]
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("faer's pool");
    let head: Vec<String> = names.iter().map(|n| format!("{n} | gemm / {n}")).collect();
    println!(
        "| width | product | m x k x n | gemm | {} |",
        head.join(" | ")
    );
    println!("|---|---|---|---|{}", "---|---|".repeat(names.len()));
    let mut sums = vec![0.0; names.len() + 1];
    each_step_product(&widths, |width, layer, (name, a, ta, b, tb)| {
        let ((m, k), n) = (ta.dims(a), tb.dims(b).1);
        let flops = 2.0 * (m * k * n) as f64;
        let mut c = Tensor::default();
        let mut by_mkl = vec![0.0f32; m * n];
        let mut by_openblas = vec![0.0f32; m * n];
        #[cfg_attr(not(feature = "faer"), allow(unused_mut))]
        let mut by_faer = vec![0.0f32; m * n];
        let timed = {
            let mut ours = || be.matmul(a, ta, b, tb, &mut c, false).expect("matmul");
            let mut theirs = || blas(mkl, (a, ta), (b, tb), &mut by_mkl);
            let mut calls: Vec<&mut dyn FnMut()> = vec![&mut ours, &mut theirs];
            #[cfg(feature = "faer")]
            let mut crate_faer = || faer_product(&pool, (a, ta), (b, tb), &mut by_faer);
            #[cfg(feature = "faer")]
            calls.push(&mut crate_faer);
            let mut third = openblas.map(|ob| {
                let by_openblas = &mut by_openblas;
                move || blas(ob, (a, ta), (b, tb), by_openblas)
            });
            if let Some(third) = third.as_mut() {
                calls.push(third);
            }
            alternate(&mut calls)
        };
        let mut others = vec![&by_mkl];
        if cfg!(feature = "faer") {
            others.push(&by_faer);
        }
        if openblas.is_some() {
            others.push(&by_openblas);
        }
        let got = c.host().expect("host");
        for other in others {
            let worst = got
                .iter()
                .zip(other.iter())
                .map(|(p, q)| ((p - q).abs() / q.abs().max(1e-3)) as f64)
                .fold(0.0, f64::max);
            assert!(worst < 1e-4, "{layer} {name}: results differ by {worst:e}");
        }
        for (sum, t) in sums.iter_mut().zip(&timed.medians) {
            *sum += t;
        }
        let cols: Vec<String> = timed.medians[1..]
            .iter()
            .zip(&timed.ratios)
            .map(|(t, r)| format!("{:.1} | {r:.2}", flops / t / 1e9))
            .collect();
        println!(
            "| {width} | {layer}: {name} | {m}x{k}x{n} | {:.1} | {} |",
            flops / timed.medians[0] / 1e9,
            cols.join(" | ")
        );
    });
    let totals: Vec<String> = names
        .iter()
        .zip(&sums[1..])
        .map(|(n, s)| format!("{n} {:.1} ms (gemm / {n} {:.2})", s * 1e3, s / sums[0]))
        .collect();
    println!(
        "\nsum of the medians: gemm {:.1} ms, {}",
        sums[0] * 1e3,
        totals.join(", ")
    );
}
