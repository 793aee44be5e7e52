//! What the kernel examples share: the timing rule, their operands and the products of a
//! training step. Each example uses part of it.
#![allow(dead_code)]

use std::time::Instant;

use pipe_kernels::{Tensor, Trans};

/// A raw output pointer handed to pool tasks that each write their own part of one live
/// buffer.
#[derive(Clone, Copy)]
pub struct SendPtr(pub *mut f32);
// SAFETY: the examples hand each task a disjoint part of a buffer that outlives the tasks.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so that closures capture the whole `SendPtr`).
    pub fn get(self) -> *mut f32 {
        self.0
    }
}

/// `D = A B` by `gemm` on the calling thread, overwriting `D`: `m x n` at `d` (rows `drs`
/// apart, columns adjacent), `A` `m x k` and `B` `k x n` at the given row and column strides.
///
/// # Safety
/// The three pointers must address the strided matrices described, `D` writable and not
/// overlapping the others.
#[allow(clippy::too_many_arguments)]
pub unsafe fn product_on_one_thread(
    m: usize,
    n: usize,
    k: usize,
    d: *mut f32,
    drs: isize,
    a: *const f32,
    ars: isize,
    acs: isize,
    b: *const f32,
    brs: isize,
    bcs: isize,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            d,
            1,
            drs,
            false,
            a,
            acs,
            ars,
            b,
            bcs,
            brs,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Seconds one call of `f` takes.
pub fn seconds(f: &mut dyn FnMut()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// Median seconds of `f` over 31 calls after 5 warm-up calls.
pub fn median_seconds(f: &mut dyn FnMut()) -> f64 {
    median_seconds_of(f, 5, 31)
}

/// Median seconds of `f` over `timed` calls after `warm_up` untimed ones.
pub fn median_seconds_of(f: &mut dyn FnMut(), warm_up: usize, timed: usize) -> f64 {
    for _ in 0..warm_up {
        f();
    }
    let mut times: Vec<f64> = (0..timed).map(|_| seconds(f)).collect();
    median(&mut times)
}

/// The median of `values` (the upper one of an even count), sorting them.
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The widths in `WIDTHS` (space-separated), or `default`'s.
pub fn widths(default: &str) -> Vec<usize> {
    std::env::var("WIDTHS")
        .unwrap_or_else(|_| default.into())
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect()
}

/// A row-major `rows x cols` matrix of small deterministic values.
pub fn matrix(rows: usize, cols: usize, salt: usize) -> Tensor {
    let data = (0..rows * cols)
        .map(|i| ((i * 7 + salt) % 13) as f32 * 0.01)
        .collect();
    Tensor::from_vec(&[rows, cols], data).expect("shape matches data")
}

/// One product `op(a) op(b)` of a layer's step, named.
pub type Product<'t> = (&'static str, &'t Tensor, Trans, &'t Tensor, Trans);

/// The three products of a linear layer's step with input `x`, weight `w` (stored in x out)
/// and output gradient `dy`, as the layers call them: the forward reads the weight as stored,
/// the input gradient reads it transposed, the weight gradient reads the input transposed.
pub fn layer_products<'t>(x: &'t Tensor, w: &'t Tensor, dy: &'t Tensor) -> [Product<'t>; 3] {
    [
        ("Y = X W", x, Trans::No, w, Trans::No),
        ("dX = dY W^T", dy, Trans::No, w, Trans::Yes),
        ("dW = X^T dY", x, Trans::Yes, dy, Trans::No),
    ]
}

/// Rows of every activation of the GPT-2 step the examples time: 16 windows of 128 positions.
pub const TOKENS: usize = 2048;
/// The vocabulary of the experiments' tokenizer.
pub const VOCAB: usize = 1024;

/// Calls `f` with every product of the GPT-2 step at each of `widths`, in order: the width,
/// the layer, and the product with its operands made here. With `MLP` set in the
/// environment, the products of the single-worker MLP's hidden layer instead (256 rows, 1,024
/// wide, as `pipe bench mfu` runs it), once.
pub fn each_step_product(widths: &[usize], mut f: impl FnMut(usize, &str, Product<'_>)) {
    let mlp = std::env::var_os("MLP").is_some();
    let (rows, shapes): (usize, Vec<(usize, Vec<Layer>)>) = if mlp {
        (256, vec![(1024, vec![("mlp hidden", 1024, 1024)])])
    } else {
        let each = widths.iter().map(|&w| (w, gpt2_layers(w).to_vec()));
        (TOKENS, each.collect())
    };
    for (width, layers) in shapes {
        for (layer, fan_in, fan_out) in layers {
            let x = matrix(rows, fan_in, 1);
            let w = matrix(fan_in, fan_out, 2);
            let dy = matrix(rows, fan_out, 3);
            for product in layer_products(&x, &w, &dy) {
                f(width, layer, product);
            }
        }
    }
}

/// A linear layer: its name, input width and output width.
pub type Layer = (&'static str, usize, usize);

/// The linear layers of a GPT-2 block and its head at `width`: (name, input width, output
/// width).
pub fn gpt2_layers(width: usize) -> [Layer; 5] {
    [
        ("qkv", width, 3 * width),
        ("attn proj", width, width),
        ("fc", width, 4 * width),
        ("fc proj", 4 * width, width),
        ("head", width, VOCAB),
    ]
}
