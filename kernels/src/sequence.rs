//! CPU kernels for sequence models: the token-embedding lookup and its scatter-add, and causal
//! multi-head self-attention with its backward.
//!
//! Attention is computed one (sequence, head, block of query rows) at a time, forward and
//! backward: a block's scores, probabilities and score gradients (`BLOCK x T`) live in a
//! per-thread scratch buffer while they are used, and are never kept, so what attention holds
//! grows with `T`, not `T^2`. The forward saves only each row's log-sum-exp; the backward
//! recomputes the probabilities from it (the memory trade of fused attention kernels: `O(B H T)`
//! saved instead of `O(B H T^2)`, for one extra `Q K^T` product). The products are register
//! tiles ([`crate::tile`]) whose strides read the heads in place from the packed `[rows, 3C]`
//! query-key-value tensor, so no head is copied out. A task is some heads of one sequence (all
//! of them while there are as many sequences as threads) and writes only those heads' columns
//! of its own rows, so the bits never depend on the thread count.

use std::ops::Range;

use crate::backend::AttentionShape;
use crate::error::shape_err;
use crate::tile::Product;
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

/// Checks the document starts of an attention call ([`Backend::attention`]): one per token,
/// each a whole number no later than its own token's index in its sequence, and documents
/// contiguous: a token's document starts where its predecessor's does, or at the token itself.
///
/// [`Backend::attention`]: crate::Backend::attention
pub(crate) fn check_documents(op: &'static str, s: AttentionShape, starts: &[f32]) -> Result<()> {
    check_document_count(op, s, starts.len())?;
    let seq = s.seq.max(1);
    let previous = |k: usize| (k % seq > 0).then(|| starts[k - 1]);
    starts
        .iter()
        .enumerate()
        .find_map(|(k, &v)| document_start_fault(op, s, k, v, previous(k)))
        .map_or(Ok(()), Err)
}

/// Checks that an attention call has one document start per token.
pub(crate) fn check_document_count(
    op: &'static str,
    s: AttentionShape,
    count: usize,
) -> Result<()> {
    if count != s.batch * s.seq {
        return Err(shape_err(
            op,
            format!(
                "{count} document starts for {} sequences of {} tokens",
                s.batch, s.seq
            ),
        ));
    }
    Ok(())
}

/// Why [`check_documents`] refuses the document start `v` of token `k` (counted over the
/// batch) whose predecessor in its sequence starts its document at `previous` (`None` for a
/// sequence's first token); `None` when it does not. The CUDA backend finds the token on the
/// device and says the same.
pub(crate) fn document_start_fault(
    op: &'static str,
    s: AttentionShape,
    k: usize,
    v: f32,
    previous: Option<f32>,
) -> Option<KernelError> {
    let seq = s.seq.max(1);
    let (t, b) = (k % seq, k / seq);
    if !(v >= 0.0 && v.fract() == 0.0 && v as usize <= t) {
        return Some(shape_err(
            op,
            format!("token {t} of sequence {b} starts its document at {v}"),
        ));
    }
    match previous {
        Some(p) if v != p && v as usize != t => Some(shape_err(
            op,
            format!(
                "token {t} of sequence {b} starts its document at {v}, neither where token {} \
                 starts its ({p}) nor at itself: documents are contiguous",
                t - 1
            ),
        )),
        _ => None,
    }
}

/// Where row `i`'s document starts in its sequence: 0 without documents.
#[inline(always)]
fn document_start(starts: Option<&[f32]>, i: usize) -> usize {
    starts.map_or(0, |s| s[i] as usize)
}

/// The geometry of one sequence's slice of the packed tensors.
#[derive(Clone, Copy)]
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

    /// Offset of query (0), key (1) or value (2) of head `h` in row 0 of the `[T, 3C]` rows.
    fn qkv(&self, part: usize, h: usize) -> usize {
        part * self.width + h * self.head
    }

    /// Offset of head `h`'s rows in a part transposed by [`transpose_part`].
    fn head_rows(&self, h: usize) -> usize {
        h * self.head * self.seq
    }

    /// The product `S = Q K^T` of head `h` for query rows `r0..r1` and key columns `0..r1`
    /// (the columns past a block's last row are masked for all of its rows, so they are never
    /// formed), from the sequence's `qkv` rows and its transposed keys `k_t`
    /// ([`transpose_part`]), into `dst` (the block's first row, rows `T` apart).
    fn scores(
        &self,
        qkv: &[f32],
        k_t: &[f32],
        h: usize,
        (r0, r1): (usize, usize),
        dst: *mut f32,
    ) -> Product {
        let c3 = 3 * self.width;
        Product {
            m: r1 - r0,
            n: r1,
            k: self.head,
            a: qkv[r0 * c3 + self.qkv(0, h)..].as_ptr(),
            a_rs: c3,
            a_cs: 1,
            b: k_t[self.head_rows(h)..].as_ptr(),
            ldb: self.seq,
            c: dst,
            ldc: self.seq,
            accumulate: false,
        }
    }
}

/// Heads `heads` of part `part` (key 1, value 2) of one sequence's `T x 3C` query-key-value
/// rows, transposed into their rows of `dst` (`C x T`): the rows of head `h` are
/// `h * D..(h + 1) * D`, each running across key positions as the score products read them.
/// Each output row gathers one column of the `T` input rows (AVX-512 and AVX2 gather loads);
/// the lines it reads serve the next 15 columns from L1.
#[inline(always)]
fn transpose_part(g: &Heads, qkv: &[f32], part: usize, heads: &Range<usize>, dst: &mut [f32]) {
    let (t, c3) = (g.seq, 3 * g.width);
    let src = &qkv[..t * c3];
    let rows = heads.start * g.head..heads.end * g.head;
    let dst = &mut dst[rows.start * t..rows.end * t];
    for (d, out) in rows.zip(dst.chunks_exact_mut(t)) {
        // `at < c3` always (`part <= 2`, `d < width`); saying so once, on rows of exactly `c3`
        // values, leaves no bounds check in the loop, so it compiles to gather loads.
        let at = part * g.width + d;
        if at >= c3 {
            return;
        }
        for (o, row) in out.iter_mut().zip(src.chunks_exact(c3)) {
            *o = row[at];
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

/// Where one sequence's attention forward writes: raw, because tasks over different heads of
/// one sequence write disjoint columns of the same rows.
#[derive(Clone, Copy)]
pub(crate) struct Outputs {
    /// The sequence's first output row (`T x C`).
    pub rows: *mut f32,
    /// The sequence's log-sum-exp (`heads x T`).
    pub lse: *mut f32,
}

/// Causal attention of heads `heads` of one sequence: their columns of `out` (`T x C`) and
/// their rows of `lse` (`heads x T`) from `qkv` (`T x 3C`); with `starts` (`T`, checked by
/// [`check_documents`]), row `i` attends over `starts[i]..=i` only.
///
/// # Safety
/// `to.rows` must address the sequence's `T x C` outputs and `to.lse` its `heads x T`
/// log-sum-exps, valid for writes, and while this runs nothing else may read or write the
/// columns of heads `heads` in the one or their rows in the other.
pub(crate) unsafe fn attention_heads(
    s: AttentionShape,
    qkv: &[f32],
    starts: Option<&[f32]>,
    heads: Range<usize>,
    to: Outputs,
) {
    let (t, c) = (s.seq, s.width());
    crate::scratch::with_scratch(c * t + BLOCK * t, |scratch| {
        crate::vector::arch().dispatch(Forward {
            s,
            qkv,
            starts,
            heads,
            to,
            scratch,
        });
    });
}

/// The forward of some heads of one sequence, as a `pulp` operation (compiled per
/// instruction set).
struct Forward<'a> {
    s: AttentionShape,
    qkv: &'a [f32],
    /// Where each row's document starts (`None`: at 0).
    starts: Option<&'a [f32]>,
    /// The heads this task computes.
    heads: Range<usize>,
    /// Their columns of every output row and their log-sum-exp rows: written whole, never read
    /// ([`attention_heads`]'s contract).
    to: Outputs,
    /// `C x T` for K^T (the rows of `heads`), then `BLOCK x T` for a block's scores.
    scratch: &'a mut [f32],
}

impl pulp::WithSimd for Forward<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, simd: S) {
        let Forward {
            s,
            qkv,
            starts,
            heads,
            to,
            scratch,
        } = self;
        let g = Heads::new(s);
        let (t, c3) = (g.seq, 3 * g.width);
        let (k_t, scores) = scratch.split_at_mut(g.width * t);
        transpose_part(&g, qkv, 1, &heads, k_t);
        // One product of this sequence; every call below addresses rows of the sequence's
        // tensors and of the scratch only.
        let run = |p: Product| {
            // SAFETY: see each call's operands; all lie inside the buffers above.
            unsafe { crate::tile::product(simd, &p) }
        };
        let out = to.rows;
        for h in heads {
            for (r0, r1) in blocks(t) {
                run(g.scores(qkv, k_t, h, (r0, r1), scores.as_mut_ptr()));
                for i in r0..r1 {
                    let row = &mut scores[(i - r0) * t..(i - r0) * t + r1];
                    let first = document_start(starts, i);
                    row[..first].fill(0.0);
                    let live = &mut row[first..=i];
                    // The scale is positive, so it commutes with the maximum.
                    let max = crate::fastmath::max(live) * g.scale;
                    for v in live.iter_mut() {
                        *v = crate::fastmath::exp(*v * g.scale - max);
                    }
                    let sum = crate::fastmath::sum(live);
                    let inv = 1.0 / sum;
                    live.iter_mut().for_each(|v| *v *= inv);
                    row[i + 1..].fill(0.0);
                    // SAFETY: row h of the log-sum-exps is this task's ([`attention_heads`]).
                    unsafe { to.lse.add(h * t + i).write(max + sum.ln()) };
                }
                // O = P V: the block's probabilities (columns 0..r1) and value rows 0..r1 of
                // head h into head h's columns of output rows r0..r1, written whole.
                run(Product {
                    m: r1 - r0,
                    n: g.head,
                    k: r1,
                    a: scores.as_ptr(),
                    a_rs: t,
                    a_cs: 1,
                    b: qkv[g.qkv(2, h)..].as_ptr(),
                    ldb: c3,
                    c: out.wrapping_add(r0 * g.width + h * g.head),
                    ldc: g.width,
                    accumulate: false,
                });
            }
        }
    }
}

/// The backward of [`attention_heads`] for heads `heads` of one sequence: their columns of
/// `dqkv` (`T x 3C`: of dQ, dK and dV, every element written) from `dout` (`T x C`), with the
/// forward's `out` and `lse`.
///
/// Block by block of query rows, as the forward: a block of rows `r0..r1` forms its
/// probabilities and score gradients over key columns `0..r1` (zero past each row's diagonal)
/// in `BLOCK x T` of scratch, so the backward holds `O(T)` per thread where a whole `T x T`
/// matrix would grow with the square of the context. The block writes its rows of `dQ` whole
/// and adds its rows' terms to `dK` and `dV` of key rows `0..r1`, each sum continued from the
/// previous block's, so every key row's sum runs over query rows in order, as one product
/// over all of them would.
///
/// # Safety
/// `dqkv` must address the sequence's `T x 3C` input gradient, valid for writes, and while
/// this runs nothing else may read or write the columns of heads `heads` in its three parts.
pub(crate) unsafe fn attention_backward_heads(
    s: AttentionShape,
    (qkv, starts): (&[f32], Option<&[f32]>),
    (out, lse, dout): (&[f32], &[f32], &[f32]),
    heads: Range<usize>,
    dqkv: *mut f32,
) {
    let (t, c) = (s.seq, s.width());
    crate::scratch::with_scratch(2 * c * t + 2 * BLOCK * t, |scratch| {
        crate::vector::arch().dispatch(Backward {
            s,
            qkv,
            starts,
            out,
            lse,
            dout,
            heads,
            dqkv,
            scratch,
        });
    });
}

/// The backward of some heads of one sequence, as a `pulp` operation.
struct Backward<'a> {
    s: AttentionShape,
    qkv: &'a [f32],
    /// Where each row's document starts (`None`: at 0).
    starts: Option<&'a [f32]>,
    out: &'a [f32],
    lse: &'a [f32],
    dout: &'a [f32],
    /// The heads this task computes.
    heads: Range<usize>,
    /// Their columns of the `T x 3C` gradient: written whole, read only where written
    /// ([`attention_backward_heads`]'s contract).
    dqkv: *mut f32,
    /// `C x T` each for K^T and V^T, then `BLOCK x T` each for a block's P and dS.
    scratch: &'a mut [f32],
}

impl pulp::WithSimd for Backward<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, simd: S) {
        let Backward {
            s,
            qkv,
            starts,
            out,
            lse,
            dout,
            heads,
            dqkv,
            scratch,
        } = self;
        let g = Heads::new(s);
        let (t, c, c3) = (g.seq, g.width, 3 * g.width);
        let (k_t, rest) = scratch.split_at_mut(c * t);
        let (v_t, rest) = rest.split_at_mut(c * t);
        let (probs, dprobs) = rest.split_at_mut(BLOCK * t);
        transpose_part(&g, qkv, 1, &heads, k_t);
        transpose_part(&g, qkv, 2, &heads, v_t);
        let (q, d) = (qkv.as_ptr(), dqkv);
        // dK and dV of these heads start at zero: each block below continues their sums.
        let columns = heads.start * g.head..heads.end * g.head;
        for i in 0..t {
            for part in [1, 2] {
                let at = i * c3 + part * c;
                // SAFETY: these heads' columns of row i, this task's ([`attention_backward_heads`]).
                unsafe { std::ptr::write_bytes(d.add(at + columns.start), 0, columns.len()) };
            }
        }
        // One product of this sequence; every call below addresses rows of the sequence's
        // tensors and of the block scratch only.
        let run = |p: Product| {
            // SAFETY: see each call's operands; all lie inside the buffers above.
            unsafe { crate::tile::product(simd, &p) }
        };
        for h in heads {
            let v_t = &v_t[g.head_rows(h)..];
            let dout_h = dout[h * g.head..].as_ptr();
            for (r0, r1) in blocks(t) {
                let m = r1 - r0;
                // Probabilities again, from the saved log-sum-exp.
                run(g.scores(qkv, k_t, h, (r0, r1), probs.as_mut_ptr()));
                for i in r0..r1 {
                    let l = lse[h * t + i];
                    let row = &mut probs[(i - r0) * t..(i - r0) * t + r1];
                    let first = document_start(starts, i);
                    row[..first].fill(0.0);
                    row[first..=i]
                        .iter_mut()
                        .for_each(|v| *v = crate::fastmath::exp(*v * g.scale - l));
                    row[i + 1..].fill(0.0);
                }
                // dP = dO V^T.
                run(Product {
                    m,
                    n: r1,
                    k: g.head,
                    a: dout_h.wrapping_add(r0 * c),
                    a_rs: c,
                    a_cs: 1,
                    b: v_t.as_ptr(),
                    ldb: t,
                    c: dprobs.as_mut_ptr(),
                    ldc: t,
                    accumulate: false,
                });
                // dS = P * (dP - rowsum(dO * O)) * scale.
                for i in r0..r1 {
                    let at = i * c + h * g.head;
                    let (o, go) = (&out[at..at + g.head], &dout[at..at + g.head]);
                    let dot: f32 = o.iter().zip(go).map(|(o, go)| o * go).sum();
                    let b = (i - r0) * t;
                    let (p, dp) = (&probs[b..=b + i], &mut dprobs[b..b + r1]);
                    for (dp, &p) in dp.iter_mut().zip(p) {
                        *dp = p * (*dp - dot) * g.scale;
                    }
                    dp[..document_start(starts, i)].fill(0.0);
                    dp[i + 1..].fill(0.0);
                }
                // dQ = dS K, head h's columns of rows r0..r1 written whole.
                run(Product {
                    m,
                    n: g.head,
                    k: r1,
                    a: dprobs.as_ptr(),
                    a_rs: t,
                    a_cs: 1,
                    b: q.wrapping_add(g.qkv(1, h)),
                    ldb: c3,
                    c: d.wrapping_add(r0 * c3 + g.qkv(0, h)),
                    ldc: c3,
                    accumulate: false,
                });
                // Key rows 0..r1 receive from this block's query rows (zeros past each
                // diagonal). The left operands are the block's P^T and dS^T, read in place
                // through their strides.
                // dV += P^T dO.
                run(Product {
                    m: r1,
                    n: g.head,
                    k: m,
                    a: probs.as_ptr(),
                    a_rs: 1,
                    a_cs: t,
                    b: dout_h.wrapping_add(r0 * c),
                    ldb: c,
                    c: d.wrapping_add(g.qkv(2, h)),
                    ldc: c3,
                    accumulate: true,
                });
                // dK += dS^T Q.
                run(Product {
                    m: r1,
                    n: g.head,
                    k: m,
                    a: dprobs.as_ptr(),
                    a_rs: 1,
                    a_cs: t,
                    b: q.wrapping_add(r0 * c3 + g.qkv(0, h)),
                    ldb: c3,
                    c: d.wrapping_add(g.qkv(1, h)),
                    ldc: c3,
                    accumulate: true,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::mem::MaybeUninit;

    use super::*;

    /// A sequence long enough that a `T x T` matrix would dwarf every other buffer.
    #[test]
    fn the_backward_holds_scratch_linear_in_the_sequence() {
        let s = AttentionShape {
            batch: 1,
            seq: 1500,
            heads: 2,
            width: 16,
        };
        let (t, c) = (s.seq, s.width);
        let qkv: Vec<f32> = (0..t * 3 * c)
            .map(|i| ((i * 7919) % 101) as f32 / 101.0 - 0.5)
            .collect();
        let dout: Vec<f32> = (0..t * c)
            .map(|i| ((i * 104_729) % 97) as f32 / 97.0 - 0.5)
            .collect();
        let mut out = vec![0.0f32; t * c];
        let mut lse = vec![0.0f32; s.heads * t];
        let to = Outputs {
            rows: out.as_mut_ptr(),
            lse: lse.as_mut_ptr(),
        };
        // SAFETY: both buffers hold the whole sequence's outputs; this is the only task.
        unsafe { attention_heads(s, &qkv, None, 0..s.heads, to) };
        let mut dqkv = vec![MaybeUninit::new(f32::NAN); t * 3 * c];
        let d = dqkv.as_mut_ptr().cast::<f32>();
        let inputs = (&out[..], &lse[..], &dout[..]);
        // SAFETY: `dqkv` holds the whole sequence's gradient; this is the only task.
        unsafe { attention_backward_heads(s, (&qkv, None), inputs, 0..s.heads, d) };
        let held = crate::scratch::SCRATCH.with(|cell| {
            let buf = cell.take();
            let len = buf.len();
            cell.set(buf);
            len
        });
        assert_eq!(held, 2 * c * t + 2 * BLOCK * t);
        assert!(held < t * t / 10, "{held} elements of scratch for T = {t}");
        // SAFETY: the backward writes every element (checked finite, so none is the NaN fill).
        assert!(dqkv.iter().all(|v| unsafe { v.assume_init() }.is_finite()));
    }
}
