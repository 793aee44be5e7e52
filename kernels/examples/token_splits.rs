//! The products of a GPT-2 step over 2,048 token rows, cut for two threads in each of the ways
//! the CPU backend can cut a product (`cpu.rs`'s `block_plan`), **taking turns** within each
//! round: `gemm` called whole with its own split over the pool (`Parallelism::Rayon`), and the
//! output cut into 2 or 4 column blocks or row blocks, one one-thread `gemm` call each. `gemm`
//! never splits the inner dimension, so every cut gives the same bits (checked before timing).
//! The input gradient reads a row-major copy of the transposed weight, as the backend does.
//!
//! ```sh
//! WIDTHS="512 768" cargo run --release -p pipe-kernels --example token_splits -- 15
//! ```
//!
//! Each row gives every cut's GFLOP/s (the median over the rounds of each round's mean of
//! [`TIMED`] calls) and the fastest; the last lines sum each cut's time over the step's
//! products, one of each, and the time of the fastest cut of each product.
#![allow(clippy::expect_used)]

mod common;

use common::{Product, SendPtr, each_step_product, median, product_on_one_thread, widths};
use pipe_kernels::{Backend, CpuBackend, Tensor, Trans};
use rayon::prelude::*;
use std::time::Instant;

/// Timed calls of each cut per round.
const TIMED: usize = 3;

/// A way to cut one product for the pool.
#[derive(Clone, Copy)]
enum Cut {
    /// The CPU backend's own `matmul`, as the layers call it.
    Backend,
    /// One `gemm` call splitting the work itself.
    Whole,
    /// This many column blocks, one task each.
    Cols(usize),
    /// This many row blocks, one task each.
    Rows(usize),
}

const CUTS: [(&str, Cut); 6] = [
    ("backend", Cut::Backend),
    ("whole", Cut::Whole),
    ("cols 2", Cut::Cols(2)),
    ("cols 4", Cut::Cols(4)),
    ("rows 2", Cut::Rows(2)),
    ("rows 4", Cut::Rows(4)),
];

/// A product's operands as raw row-major views: `A` (m x k) and `B` (k x n) with strides.
#[derive(Clone, Copy)]
struct View {
    m: usize,
    n: usize,
    k: usize,
    a: usize,
    a_rs: isize,
    a_cs: isize,
    b: usize,
    b_rs: isize,
    b_cs: isize,
}

/// The backend and the product as the layers hand it over.
type Call<'t> = (&'t CpuBackend, Product<'t>);

fn run(pool: &rayon::ThreadPool, cut: Cut, v: View, call: Call<'_>, out: &mut Tensor) {
    let (be, (_, a, ta, b, tb)) = call;
    if let Cut::Backend = cut {
        be.matmul(a, ta, b, tb, out, false).expect("matmul");
        return;
    }
    let out = out.host_mut().expect("host");
    let d = SendPtr(out.as_mut_ptr());
    let (m, n) = (v.m, v.n);
    // SAFETY: every block lies inside the m x n output and the operands the view describes;
    // blocks handed to different tasks write disjoint output elements.
    let block = |r0: usize, mr: usize, c0: usize, nc: usize| unsafe {
        product_on_one_thread(
            mr,
            nc,
            v.k,
            d.get().add(r0 * n + c0),
            n as isize,
            (v.a as *const f32).offset(r0 as isize * v.a_rs),
            v.a_rs,
            v.a_cs,
            (v.b as *const f32).offset(c0 as isize * v.b_cs),
            v.b_rs,
            v.b_cs,
        );
    };
    match cut {
        Cut::Backend => unreachable!("handled above"),
        Cut::Whole => pool.install(|| {
            // SAFETY: as above, one call over the whole output.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    v.k,
                    d.get(),
                    1,
                    n as isize,
                    false,
                    v.a as *const f32,
                    v.a_cs,
                    v.a_rs,
                    v.b as *const f32,
                    v.b_cs,
                    v.b_rs,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::Rayon(2),
                );
            }
        }),
        Cut::Cols(parts) => {
            let w = n.div_ceil(parts).next_multiple_of(16);
            pool.install(|| {
                (0..n.div_ceil(w))
                    .into_par_iter()
                    .for_each(|i| block(0, m, i * w, w.min(n - i * w)));
            });
        }
        Cut::Rows(parts) => {
            let h = m.div_ceil(parts).next_multiple_of(16);
            pool.install(|| {
                (0..m.div_ceil(h))
                    .into_par_iter()
                    .for_each(|i| block(i * h, h.min(m - i * h), 0, n));
            });
        }
    }
}

/// Row-major `t` (rows x cols) transposed into a new row-major tensor's values.
fn transposed(t: &Tensor) -> Vec<f32> {
    let (r, c) = (t.rows(), t.cols());
    let src = t.host().expect("host");
    let mut out = vec![0.0; r * c];
    transpose::transpose(src, &mut out, c, r);
    out
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("pool");
    let be = CpuBackend::new(2).expect("backend");
    let names: Vec<&str> = CUTS.iter().map(|c| c.0).collect();
    println!("2 threads; GFLOP/s, medians of {rounds} alternating rounds of {TIMED} calls");
    println!(
        "| width | product | m x k x n | {} | fastest |",
        names.join(" | ")
    );
    println!("|---|---|---|{}---|", "---|".repeat(CUTS.len()));
    let mut totals: Vec<(usize, Vec<f64>, f64)> = Vec::new();
    each_step_product(&widths("512 768"), |width, layer, product| {
        let (name, a, ta, b, tb) = product;
        let call = (&be, product);
        let ((m, k), n) = (ta.dims(a), tb.dims(b).1);
        let copy;
        let (bp, b_rs, b_cs) = match tb {
            Trans::No => (b.host().expect("host").as_ptr() as usize, n as isize, 1),
            Trans::Yes => {
                copy = transposed(b);
                (copy.as_ptr() as usize, n as isize, 1)
            }
        };
        let (a_rs, a_cs) = match ta {
            Trans::No => (k as isize, 1),
            Trans::Yes => (1, m as isize),
        };
        let view = View {
            m,
            n,
            k,
            a: a.host().expect("host").as_ptr() as usize,
            a_rs,
            a_cs,
            b: bp,
            b_rs,
            b_cs,
        };
        let mut outs: Vec<Tensor> = CUTS
            .iter()
            .map(|_| Tensor::from_vec(&[m, n], vec![0.0; m * n]).expect("tensor"))
            .collect();
        for ((_, cut), out) in CUTS.iter().zip(&mut outs) {
            run(&pool, *cut, view, call, out);
        }
        let bits = |t: &Tensor| t.host().expect("host").to_vec();
        assert!(
            outs.iter().all(|o| bits(o) == bits(&outs[0])),
            "{layer} {name}: the cuts differ in bits"
        );
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); CUTS.len()];
        for _ in 0..rounds {
            for (i, (_, cut)) in CUTS.iter().enumerate() {
                let t = Instant::now();
                for _ in 0..TIMED {
                    run(&pool, *cut, view, call, &mut outs[i]);
                }
                times[i].push(t.elapsed().as_secs_f64() / TIMED as f64);
            }
        }
        let medians: Vec<f64> = times.iter_mut().map(|t| median(t)).collect();
        let flops = 2.0 * (m * n * k) as f64;
        let best = (0..CUTS.len())
            .min_by(|&i, &j| medians[i].total_cmp(&medians[j]))
            .expect("cuts");
        let rates: Vec<String> = medians
            .iter()
            .map(|s| format!("{:.1}", flops / s / 1e9))
            .collect();
        println!(
            "| {width} | {layer}: {name} | {m}x{k}x{n} | {} | {} |",
            rates.join(" | "),
            names[best]
        );
        match totals.last_mut() {
            Some((w, sums, fastest)) if *w == width => {
                sums.iter_mut().zip(&medians).for_each(|(s, t)| *s += t);
                *fastest += medians[best];
            }
            _ => totals.push((width, medians.clone(), medians[best])),
        }
    });
    for (width, sums, fastest) in totals {
        let each: Vec<String> = names
            .iter()
            .zip(&sums)
            .map(|(n, s)| format!("{n} {:.1} ms", s * 1e3))
            .collect();
        println!(
            "width {width}: {}; the fastest of each {:.1} ms",
            each.join(", "),
            fastest * 1e3
        );
    }
}
