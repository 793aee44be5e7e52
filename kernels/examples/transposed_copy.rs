//! What the row-major copy of `W^T` costs a tall `dX = dY W^T` when every call brings a new
//! weight version, as in a single-worker step (the CPU backend caches the copy per version,
//! so only pipelined stages with stashed versions reuse it).
//!
//! ```sh
//! cargo run --release -p pipe-kernels --example transposed_copy -- 2   # threads
//! ```
//!
//! Per shape of the GPT-2 step at width 768 (2,048 token rows), 25 rounds (the first 3
//! untimed), each one call with the cached copy and one after the weight changed, back to
//! back, then the backend's plain transpose of the weight; medians, and the median of the
//! pairs' differences.
#![allow(clippy::expect_used)]

mod common;

use common::{TOKENS, gpt2_layers, matrix, median, seconds};
use pipe_kernels::{Backend, CpuBackend, Tensor, Trans};

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let be = CpuBackend::new(threads).expect("backend");
    println!("{threads} thread(s); ms, medians of 22 rounds");
    println!(
        "| product | m x k x n | cached copy | new version | new - cached | transpose alone |"
    );
    println!("|---|---|---|---|---|---|");
    // qkv, fc and fc proj at width 768: `dY W^T` makes the layer's input width (`out`) from
    // its output width (`inner`).
    let layers = gpt2_layers(768).into_iter();
    let large = layers.filter(|(name, ..)| matches!(*name, "qkv" | "fc" | "fc proj"));
    for (_, out, inner) in large {
        let dy = matrix(TOKENS, inner, 1);
        let mut w = matrix(out, inner, 2);
        let (mut c, mut wt) = (Tensor::default(), Tensor::default());
        let mut times: [Vec<f64>; 4] = Default::default();
        let product = |w: &Tensor, c: &mut Tensor| {
            be.matmul(&dy, Trans::No, w, Trans::Yes, c, false)
                .expect("matmul");
        };
        for round in 0..25 {
            let cached = seconds(&mut || product(&w, &mut c));
            // A mutable borrow stamps the weight as a new version.
            w.host_mut().expect("host weight");
            let fresh = seconds(&mut || product(&w, &mut c));
            w.host_mut().expect("host weight");
            let alone = seconds(&mut || be.transpose(&w, &mut wt).expect("transpose"));
            if round >= 3 {
                for (list, v) in times.iter_mut().zip([cached, fresh, fresh - cached, alone]) {
                    list.push(v * 1e3);
                }
            }
        }
        let [cached, fresh, extra, alone] = times.map(|mut v| median(&mut v));
        println!(
            "| dX = dY W^T | {TOKENS}x{inner}x{out} | {cached:.2} | {fresh:.2} | {extra:.2} | {alone:.2} |"
        );
    }
}
