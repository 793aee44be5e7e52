//! CPU kernels for sequence models: the token-embedding lookup and its scatter-add, and causal
//! multi-head self-attention with its backward.
//!
//! Attention is computed one (sequence, head) at a time: the `T x T` scores of that one head
//! live in a scratch buffer while its softmax and `P V` are formed, and are never kept. The
//! forward saves only each row's log-sum-exp; the backward recomputes the probabilities from it
//! (the memory trade of fused attention kernels: `O(B H T)` saved instead of `O(B H T^2)`, for
//! one extra `Q K^T` product). Products go to `gemm` with strides that read the heads in place
//! from the packed `[rows, 3C]` query-key-value tensor, so no head is copied out. Each
//! sequence is one task and writes only its own rows, so the bits never depend on the thread
//! count.

use crate::backend::AttentionShape;
use crate::error::shape_err;
use crate::{KernelError, Result};

/// Checks that `value` is a token id below `vocab` and returns it.
fn token(index: usize, value: f32, vocab: usize) -> Result<usize> {
    if value >= 0.0 && value.fract() == 0.0 && (value as usize) < vocab {
        Ok(value as usize)
    } else {
        Err(KernelError::Token {
            index,
            value,
            vocab,
        })
    }
}

/// `out[i] = table[ids[i]]`, rows of `width`; every id is checked first.
pub(crate) fn embedding(ids: &[f32], table: &[f32], width: usize, out: &mut [f32]) -> Result<()> {
    let vocab = table.len() / width.max(1);
    for (i, (&id, row)) in ids.iter().zip(out.chunks_exact_mut(width)).enumerate() {
        let t = token(i, id, vocab)?;
        row.copy_from_slice(&table[t * width..(t + 1) * width]);
    }
    Ok(())
}

/// `dtable[ids[i]] += dy[i]`, rows in order (so repeated ids sum in a fixed order).
pub(crate) fn embedding_backward(
    ids: &[f32],
    dy: &[f32],
    width: usize,
    dtable: &mut [f32],
) -> Result<()> {
    let vocab = dtable.len() / width.max(1);
    for (i, (&id, g)) in ids.iter().zip(dy.chunks_exact(width)).enumerate() {
        let t = token(i, id, vocab)?;
        dtable[t * width..(t + 1) * width]
            .iter_mut()
            .zip(g)
            .for_each(|(d, &g)| *d += g);
    }
    Ok(())
}

/// Checks the operand sizes of an attention call: `qkv` holds `rows x 3C`, the rest follow.
pub(crate) fn check(op: &'static str, s: AttentionShape, qkv: usize) -> Result<()> {
    let width = s.width();
    if s.heads == 0 || width == 0 || width % s.heads != 0 {
        return Err(shape_err(
            op,
            format!("width {width} does not split into {} heads", s.heads),
        ));
    }
    if qkv != s.batch * s.seq * 3 * width {
        return Err(shape_err(
            op,
            format!(
                "query-key-value tensor has {qkv} elements, {} sequences of {} tokens at width \
                 {width} need {}",
                s.batch,
                s.seq,
                s.batch * s.seq * 3 * width
            ),
        ));
    }
    Ok(())
}

/// A strided view of a matrix for `gemm`: base pointer, column stride, row stride.
#[derive(Clone, Copy)]
struct View {
    ptr: *const f32,
    cs: isize,
    rs: isize,
}

impl View {
    /// A row-major matrix with rows `rs` elements apart (the `T x T` scratch).
    fn row_major(ptr: *const f32, rs: usize) -> Self {
        View {
            ptr,
            cs: 1,
            rs: rs as isize,
        }
    }

    /// The transpose of this view (no data moves).
    fn t(self) -> Self {
        View {
            ptr: self.ptr,
            cs: self.rs,
            rs: self.cs,
        }
    }
}

/// `dst (m x n, row stride dst_rs) = lhs (m x k) rhs (k x n)`, one thread.
///
/// # Safety
/// The views must address `m x k`, `k x n` and `m x n` valid elements, `dst` writable and not
/// overlapping the operands.
unsafe fn product(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: isize,
    lhs: View,
    rhs: View,
) {
    // SAFETY: forwarded from the caller. `gemm`'s alpha scales the old destination, which is
    // not read here, and beta the product.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs,
            false,
            lhs.ptr,
            lhs.cs,
            lhs.rs,
            rhs.ptr,
            rhs.cs,
            rhs.rs,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// The geometry of one sequence's slice of the packed tensors.
struct Heads {
    seq: usize,
    width: usize,
    head: usize,
    scale: f32,
}

impl Heads {
    fn new(s: AttentionShape) -> Self {
        let width = s.width();
        let head = width / s.heads;
        Self {
            seq: s.seq,
            width,
            head,
            scale: 1.0 / (head as f32).sqrt(),
        }
    }

    /// Query (0), key (1) or value (2) of head `h` in one sequence's `[T, 3C]` rows.
    fn qkv(&self, base: *const f32, part: usize, h: usize) -> View {
        View {
            // SAFETY (of the offset): below 3C, inside the first row.
            ptr: base.wrapping_add(part * self.width + h * self.head),
            cs: 1,
            rs: 3 * self.width as isize,
        }
    }

    /// The transpose of [`Heads::qkv`].
    fn qkv_t(&self, base: *const f32, part: usize, h: usize) -> View {
        self.qkv(base, part, h).t()
    }

    /// Head `h` of one sequence's `[T, C]` rows.
    fn out(&self, base: *const f32, h: usize) -> View {
        View {
            ptr: base.wrapping_add(h * self.head),
            cs: 1,
            rs: self.width as isize,
        }
    }

    /// Rows `r0..r1` of `scores = Q K^T` for head `h`, columns `0..r1` only: the columns past
    /// a block's last row are masked for every row of it, so they are never formed.
    ///
    /// # Safety
    /// `qkv` addresses one sequence's `T x 3C` values; `scores` holds `T * T`; `r0 < r1 <= T`.
    unsafe fn scores(
        &self,
        qkv: *const f32,
        h: usize,
        (r0, r1): (usize, usize),
        scores: &mut [f32],
    ) {
        let t = self.seq;
        let q = self.qkv(qkv, 0, h);
        // SAFETY: per the caller; the views stay inside the sequence's rows.
        unsafe {
            product(
                r1 - r0,
                r1,
                self.head,
                scores.as_mut_ptr().add(r0 * t),
                t as isize,
                View {
                    ptr: q.ptr.wrapping_offset(r0 as isize * q.rs),
                    ..q
                },
                self.qkv_t(qkv, 1, h),
            );
        }
    }
}

/// Rows per block of the causal mask: a block of query rows `r0..r1` attends to keys `0..r1`,
/// so the products skip every key column past its block (with `T = 128`, 10 of 16 tiles of
/// each `T x T` product are formed instead of 16).
const BLOCK: usize = 32;

/// The row blocks `(r0, r1)` of a `t`-row sequence.
fn blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t)
        .step_by(BLOCK)
        .map(move |r0| (r0, (r0 + BLOCK).min(t)))
}

/// `view` moved down by `rows` rows.
fn down(view: View, rows: usize) -> View {
    View {
        ptr: view.ptr.wrapping_offset(rows as isize * view.rs),
        ..view
    }
}

/// `view` moved right by `cols` columns.
fn right(view: View, cols: usize) -> View {
    View {
        ptr: view.ptr.wrapping_offset(cols as isize * view.cs),
        ..view
    }
}

/// Causal attention of one sequence: `out` (`T x C`) and `lse` (`heads x T`) from `qkv`
/// (`T x 3C`), with `scratch` of `T * T`.
pub(crate) fn attention_one(
    s: AttentionShape,
    qkv: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    scratch: &mut [f32],
) {
    let g = Heads::new(s);
    let t = g.seq;
    for h in 0..s.heads {
        for (r0, r1) in blocks(t) {
            // SAFETY: `qkv` is this sequence's T x 3C values, `scratch` T x T.
            unsafe { g.scores(qkv.as_ptr(), h, (r0, r1), scratch) };
            for i in r0..r1 {
                let row = &mut scratch[i * t..i * t + r1];
                let live = &mut row[..=i];
                let max = live
                    .iter()
                    .fold(f32::NEG_INFINITY, |m, &v| m.max(v * g.scale));
                let mut sum = 0.0f32;
                for v in live.iter_mut() {
                    *v = crate::fastmath::exp(*v * g.scale - max);
                }
                // Summed apart from the exponentials, in order, so their loop vectorises.
                for v in live.iter() {
                    sum += *v;
                }
                let inv = 1.0 / sum;
                live.iter_mut().for_each(|v| *v *= inv);
                row[i + 1..].fill(0.0);
                lse[h * t + i] = max + sum.ln();
            }
            let p = View::row_major(scratch.as_ptr(), t);
            // SAFETY: `out` is this sequence's T x C values; head h's columns of rows r0..r1
            // are written whole, from the block's probabilities (columns 0..r1) and values.
            unsafe {
                product(
                    r1 - r0,
                    g.head,
                    r1,
                    out.as_mut_ptr().add(r0 * g.width + h * g.head),
                    g.width as isize,
                    down(p, r0),
                    g.qkv(qkv.as_ptr(), 2, h),
                );
            }
        }
    }
}

/// The backward of [`attention_one`] for one sequence: `dqkv` (`T x 3C`, every element
/// written) from `dout` (`T x C`), with `probs` and `dprobs` scratch of `T * T` each.
///
/// Only the causal blocks are formed: a block of query rows `r0..r1` reads and writes
/// probability columns `0..r1` (zero past each row's diagonal), and a block of key rows
/// `j0..j1` gathers from query rows `j0..T`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward_one(
    s: AttentionShape,
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    dqkv: &mut [f32],
    probs: &mut [f32],
    dprobs: &mut [f32],
) {
    let g = Heads::new(s);
    let t = g.seq;
    let (q, d) = (qkv.as_ptr(), dqkv.as_mut_ptr());
    let rs3 = 3 * g.width as isize;
    for h in 0..s.heads {
        let dout_h = g.out(dout.as_ptr(), h);
        for (r0, r1) in blocks(t) {
            // Probabilities again, from the saved log-sum-exp.
            // SAFETY: `qkv` is this sequence's T x 3C values, `probs` T x T.
            unsafe { g.scores(q, h, (r0, r1), probs) };
            for i in r0..r1 {
                let l = lse[h * t + i];
                let row = &mut probs[i * t..i * t + r1];
                row[..=i]
                    .iter_mut()
                    .for_each(|v| *v = crate::fastmath::exp(*v * g.scale - l));
                row[i + 1..].fill(0.0);
            }
            // SAFETY: rows r0..r1, columns 0..r1 of the T x T scratch; dO's and V's rows stay
            // inside the sequence.
            unsafe {
                // dP = dO V^T.
                product(
                    r1 - r0,
                    r1,
                    g.head,
                    dprobs.as_mut_ptr().add(r0 * t),
                    t as isize,
                    down(dout_h, r0),
                    g.qkv_t(q, 2, h),
                );
            }
            // dS = P * (dP - rowsum(dO * O)) * scale.
            for i in r0..r1 {
                let (o, go) = (
                    &out[i * g.width + h * g.head..],
                    &dout[i * g.width + h * g.head..],
                );
                let dot: f32 = (0..g.head).map(|j| o[j] * go[j]).sum();
                let (p, dp) = (&probs[i * t..i * t + r1], &mut dprobs[i * t..i * t + r1]);
                for j in 0..=i {
                    dp[j] = p[j] * (dp[j] - dot) * g.scale;
                }
                dp[i + 1..].fill(0.0);
            }
            let ds = View::row_major(dprobs.as_ptr(), t);
            // SAFETY: as above; dQ's rows r0..r1 of head h are written whole.
            unsafe {
                // dQ = dS K.
                product(
                    r1 - r0,
                    g.head,
                    r1,
                    d.add(r0 * 3 * g.width + h * g.head),
                    rs3,
                    down(ds, r0),
                    g.qkv(q, 1, h),
                );
            }
        }
        let p_t = View::row_major(probs.as_ptr(), t).t();
        let ds_t = View::row_major(dprobs.as_ptr(), t).t();
        for (j0, j1) in blocks(t) {
            // Key rows j0..j1 receive from query rows j0..T: every probability and score
            // gradient they read was formed above (or is a zero past a diagonal).
            // SAFETY: rows j0..j1 of dV and dK, head h's columns, written whole; the reads
            // stay inside the T x T scratch and the sequence's rows.
            unsafe {
                // dV = P^T dO.
                product(
                    j1 - j0,
                    g.head,
                    t - j0,
                    d.add(j0 * 3 * g.width + 2 * g.width + h * g.head),
                    rs3,
                    right(down(p_t, j0), j0),
                    down(dout_h, j0),
                );
                // dK = dS^T Q.
                product(
                    j1 - j0,
                    g.head,
                    t - j0,
                    d.add(j0 * 3 * g.width + g.width + h * g.head),
                    rs3,
                    right(down(ds_t, j0), j0),
                    down(g.qkv(q, 0, h), j0),
                );
            }
        }
    }
}
