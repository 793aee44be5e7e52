//! The weight gradient `dW = X^T dY` over few token rows (an MLP's batch, a pipeline's
//! microbatch), cut into column blocks or row blocks of its output, one `gemm` call each on a
//! two-thread pool, taking turns: why the CPU backend splits it by rows
//! (`cpu.rs`'s `block_plan`). Prints each split's rate (median of 20 rounds of 5 calls) and
//! whether the two give the same bits.
//!
//! ```sh
//! cargo run --release -p pipe-kernels --example tn_splits
//! ```
#![allow(clippy::expect_used, clippy::too_many_arguments)]

mod common;
use common::{SendPtr as P, median, product_on_one_thread as g};
use rayon::prelude::*;
use std::time::Instant;

fn main() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("pool");
    for (bt, fi, fo) in [
        (256usize, 1024usize, 1024usize),
        (256, 784, 1024),
        (128, 1024, 1024),
        (64, 1024, 1024),
        (256, 512, 512),
        (512, 1024, 1024),
    ] {
        let x: Vec<f32> = (0..bt * fi)
            .map(|i| ((i * 7) % 13) as f32 * 0.01 - 0.05)
            .collect();
        let dy: Vec<f32> = (0..bt * fo)
            .map(|i| ((i * 5) % 7) as f32 * 0.01 - 0.03)
            .collect();
        let (m, n, k) = (fi, fo, bt);
        let xp = x.as_ptr() as usize;
        let dyp = dy.as_ptr() as usize;
        let mut outs = vec![vec![0f32; m * n]; 2];
        let pieces = |len: usize| (len / 512).clamp(2, 8);
        let w = n.div_ceil(pieces(n)).next_multiple_of(16);
        let h = m.div_ceil(pieces(m)).next_multiple_of(16);
        let mut times = vec![Vec::new(); 2];
        for r in 0..23 {
            for v in 0..2 {
                let out = P(outs[v].as_mut_ptr());
                let f = || {
                    pool.install(|| {
                        if v == 0 {
                            (0..n.div_ceil(w)).into_par_iter().for_each(|i| {
                                let c0 = i * w;
                                unsafe {
                                    g(
                                        m,
                                        w.min(n - c0),
                                        k,
                                        out.get().add(c0),
                                        n as isize,
                                        xp as *const f32,
                                        1,
                                        fi as isize,
                                        (dyp as *const f32).add(c0),
                                        n as isize,
                                        1,
                                    )
                                }
                            })
                        } else {
                            (0..m.div_ceil(h)).into_par_iter().for_each(|i| {
                                let r0 = i * h;
                                unsafe {
                                    g(
                                        h.min(m - r0),
                                        n,
                                        k,
                                        out.get().add(r0 * n),
                                        n as isize,
                                        (xp as *const f32).add(r0),
                                        1,
                                        fi as isize,
                                        dyp as *const f32,
                                        n as isize,
                                        1,
                                    )
                                }
                            })
                        }
                    })
                };
                f();
                let t = Instant::now();
                for _ in 0..5 {
                    f();
                }
                if r > 2 {
                    times[v].push(t.elapsed().as_secs_f64() / 5.0);
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let same = outs[0]
            .iter()
            .zip(&outs[1])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        let fl = 2.0 * (m * n * k) as f64;
        let (c, rr) = (median(&mut times[0]), median(&mut times[1]));
        println!(
            "dW {m}x{k}x{n}: cols {w}: {:.1} GFLOP/s, rows {h}: {:.1} GFLOP/s, rows/cols time {:.3}, bits same {same}",
            fl / c / 1e9,
            fl / rr / 1e9,
            rr / c
        );
    }
}
