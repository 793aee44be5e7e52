//! An AVX-512 product of pipe's own (`products.rs` beside this file) against the CPU backend
//! and the `gemm` crate at the GPT-2 step's shapes (or the MLP's, with `MLP` set): the same
//! bits checked on every shape (against both), then the three timed taking turns.
//!
//! ```sh
//! WIDTHS=768 cargo run --release -p pipe-kernels --features own-products \
//!     --example own_products -- 2        # threads
//! ```
//!
//! Each of 15 rounds per shape makes one untimed and three timed calls of each (`CALLS=N`:
//! N), then pauses 0.1 s (`PAUSE_MS=N`: N ms); a row gives the medians over the rounds' timed
//! calls, in GFLOP/s. The backend and
//! `gemm` split a product over the threads as the backend does; the own product packs both
//! operands with every thread's help per depth block and then gives each thread its share of
//! the output's columns (`PARTS=N`: N shares instead of one per thread; `PRIVATE=1`: each
//! thread instead computes half of the columns alone, packing its own copy of `A`).
#![allow(clippy::expect_used, clippy::unwrap_used, dead_code)]

#[path = "../common/mod.rs"]
mod common;
mod products;

use std::time::{Duration, Instant};

use common::{each_step_product, median, widths};
use pipe_kernels::{Backend, CpuBackend, Tensor, Trans};
use rayon::prelude::*;

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    assert!(products::available(), "this machine has no AVX-512");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    let widths = widths("768");
    let be = CpuBackend::new(threads).expect("backend");
    println!("{threads} thread(s); GFLOP/s, medians of 15 alternating rounds");
    println!("| width | product | m x k x n | backend | gemm | own | own / gemm | own / backend |");
    println!("|---|---|---|---|---|---|---|---|");
    let (mut sum_gemm, mut sum_own, mut sum_be) = (0.0, 0.0, 0.0);
    let scratch = std::cell::Cell::new(Vec::new());
    each_step_product(&widths, |width, layer, (name, a, ta, b, tb)| {
        let ((m, k), n) = (ta.dims(a), tb.dims(b).1);
        let strides = |t: Trans, cols: usize| match t {
            Trans::No => (cols as isize, 1),
            Trans::Yes => (1, cols as isize),
        };
        let (a_rs, a_cs) = strides(ta, a.cols());
        let (b_rs, b_cs) = strides(tb, b.cols());
        let (ah, bh) = (a.host().unwrap(), b.host().unwrap());
        let mut c_gemm = vec![0.0f32; m * n];
        let mut c_own = vec![0.0f32; m * n];
        let run_gemm = |c: &mut [f32]| unsafe {
            pool.install(|| {
                gemm::gemm(
                    m,
                    n,
                    k,
                    c.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    ah.as_ptr(),
                    a_cs,
                    a_rs,
                    bh.as_ptr(),
                    b_cs,
                    b_rs,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::Rayon(threads),
                )
            })
        };
        let run_own = |c: &mut [f32]| {
            let p = products::Product {
                m,
                n,
                k,
                a: ah.as_ptr(),
                a_rs,
                a_cs,
                b: bh.as_ptr(),
                b_rs,
                b_cs,
                c: c.as_mut_ptr(),
                ldc: n,
                accumulate: false,
            };
            assert!(products::eligible(&p));
            let for_each = |count: usize, f: &(dyn Fn(usize) + Sync + Send)| {
                pool.install(|| (0..count).into_par_iter().for_each(f))
            };
            if std::env::var_os("PRIVATE").is_some() {
                // Each thread the whole product for its half of the columns, packing its own A.
                let half = (n.div_ceil(32) / 2) * 32;
                let ranges = [(0, half), (half, n)];
                pool.install(|| {
                    ranges.par_iter().for_each(|&(c0, c1)| {
                        let mut q = p;
                        q.n = c1 - c0;
                        q.b = unsafe { bh.as_ptr().offset(c0 as isize * b_cs) };
                        q.c = unsafe { p.c.add(c0) };
                        let mut own = Vec::new();
                        let seq = |count: usize, f: &(dyn Fn(usize) + Sync + Send)| {
                            (0..count).for_each(f)
                        };
                        unsafe { products::multiply(&q, 1, seq, &mut own) };
                    })
                });
                return;
            }
            let mut held = scratch.take();
            let parts = env_or("PARTS", threads);
            unsafe { products::multiply(&p, parts, for_each, &mut held) };
            scratch.set(held);
        };
        let mut c_be = Tensor::default();
        let run_be = |c: &mut Tensor| be.matmul(a, ta, b, tb, c, false).expect("matmul");
        run_be(&mut c_be);
        run_gemm(&mut c_gemm);
        run_own(&mut c_own);
        let host = c_be.host().unwrap();
        assert!(
            same_bits(host, &c_own),
            "{layer} {name}: own product differs from the backend's"
        );
        assert!(
            same_bits(&c_gemm, &c_own),
            "{layer} {name}: own product differs from gemm's"
        );
        let medians = take_turns(&mut [
            &mut || run_be(&mut c_be),
            &mut || run_gemm(&mut c_gemm),
            &mut || run_own(&mut c_own),
        ]);
        let (bk, g, o) = (medians[0], medians[1], medians[2]);
        let flops = 2.0 * (m * k * n) as f64;
        sum_gemm += g;
        sum_own += o;
        sum_be += bk;
        println!(
            "| {width} | {layer}: {name} | {m}x{k}x{n} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} |",
            flops / bk / 1e9,
            flops / g / 1e9,
            flops / o / 1e9,
            g / o,
            bk / o
        );
    });
    println!(
        "\nsum of the medians: backend {:.1} ms, gemm {:.1} ms, own {:.1} ms (own / gemm rate {:.2}, own / backend {:.2})",
        sum_be * 1e3,
        sum_gemm * 1e3,
        sum_own * 1e3,
        sum_gemm / sum_own,
        sum_be / sum_own
    );
}

/// Whether two results hold the same bits.
fn same_bits(x: &[f32], y: &[f32]) -> bool {
    x.len() == y.len() && x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits())
}

/// The median seconds of each of `runs`, taking turns: 15 rounds, each run making one untimed
/// and `CALLS` (3) timed calls, then pausing `PAUSE_MS` (100) ms.
fn take_turns(runs: &mut [&mut dyn FnMut()]) -> Vec<f64> {
    let calls = env_or("CALLS", 3);
    let pause = Duration::from_millis(env_or("PAUSE_MS", 100) as u64);
    let mut times = vec![Vec::new(); runs.len()];
    for _ in 0..15 {
        for (run, times) in runs.iter_mut().zip(&mut times) {
            run();
            for _ in 0..calls {
                let t = Instant::now();
                run();
                times.push(t.elapsed().as_secs_f64());
            }
            std::thread::sleep(pause);
        }
    }
    times.iter_mut().map(|t| median(t)).collect()
}

/// The number in the environment variable `name`, else `default`.
fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}
