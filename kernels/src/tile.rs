//! Register-tiled products for attention's small matrices.
//!
//! Attention's products are many and small: per sequence and head, `32 x T x D` score blocks
//! and `32 x D x T` weighted sums, with `D` the head width (32 in `gpt-mini`). A general GEMM
//! packs both operands and sets up its blocking on every call, which at these sizes costs as
//! much as the arithmetic: through the `gemm` crate they ran at about half its large-matrix
//! rate. [`product`] instead keeps an `MR x 2` vector tile of the output in registers while it
//! walks the inner dimension, loading one row of `B` and broadcasting one element of `A` per
//! step. `A` may have any strides (its elements are broadcast one at a time), so transposed
//! operands such as `P^T` need no copy; `B`'s rows must be contiguous across the output's
//! columns. It runs inside a `pulp` dispatch ([`crate::vector`]), with 16 lanes on AVX-512
//! (tiles of 8 x 32), 8 on AVX2 (4 x 16) and 1 in the portable fallback.
//!
//! The tiling depends only on the shape and the vector width, so a product gives the same bits
//! on every call and every thread of one machine. Its sums use fused multiply-adds where the
//! CPU has them, so the last bits differ between machines, as the `gemm` crate's do.

use pulp::Simd;

/// `c (m x n) = a (m x k) b (k x n)`, or `c += a b` with `accumulate`: then each element's sum
/// starts from `c`'s value and continues along the inner dimension, so a product split into
/// consecutive ranges of the inner dimension, the first without `accumulate` and the rest
/// with it, gives the bits of the whole product. Element `(i, p)` of `a` is
/// `a[i * a_rs + p * a_cs]`; row `p` of `b` starts at `b[p * ldb]` and row `i` of `c` at
/// `c[i * ldc]`, both contiguous across the `n` columns.
#[derive(Clone, Copy)]
pub(crate) struct Product {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: *const f32,
    pub a_rs: usize,
    pub a_cs: usize,
    pub b: *const f32,
    pub ldb: usize,
    pub c: *mut f32,
    pub ldc: usize,
    pub accumulate: bool,
}

/// Computes `p` (see [`Product`]).
///
/// # Safety
/// Every element the strides address for `i < m`, `j < n`, `p < k` must be valid, `c`'s
/// writable, and `c` must not overlap `a` or `b`.
#[inline(always)]
pub(crate) unsafe fn product<S: Simd>(simd: S, p: &Product) {
    let lanes = S::F32_LANES;
    let mut j0 = 0;
    // SAFETY (all `tile_rows` calls): the tiles cover columns j0..j0+NV*lanes <= n, inside
    // what the caller guarantees.
    while j0 + 2 * lanes <= p.n {
        let mut i0 = 0;
        if lanes >= 16 {
            i0 = unsafe { tile_rows::<S, 8, 2>(simd, p, i0, j0) };
        }
        i0 = unsafe { tile_rows::<S, 4, 2>(simd, p, i0, j0) };
        unsafe { tile_rows::<S, 1, 2>(simd, p, i0, j0) };
        j0 += 2 * lanes;
    }
    if j0 + lanes <= p.n {
        let i0 = unsafe { tile_rows::<S, 4, 1>(simd, p, 0, j0) };
        unsafe { tile_rows::<S, 1, 1>(simd, p, i0, j0) };
        j0 += lanes;
    }
    if j0 < p.n {
        // SAFETY: columns j0..n of the same product.
        unsafe { columns_left(p, j0) };
    }
}

/// The `MR x NV`-vector tiles at column `j0` from row `i0` down, while `MR` rows are left;
/// returns the first row they leave.
///
/// # Safety
/// As [`product`], with `j0 + NV * lanes <= n`.
#[inline(always)]
unsafe fn tile_rows<S: Simd, const MR: usize, const NV: usize>(
    simd: S,
    p: &Product,
    mut i0: usize,
    j0: usize,
) -> usize {
    while i0 + MR <= p.m {
        // SAFETY: rows i0..i0+MR <= m; the columns as the caller guarantees.
        unsafe { tile::<S, MR, NV>(simd, p, i0, j0) };
        i0 += MR;
    }
    i0
}

/// One `MR x NV`-vector tile of the output at row `i0`, column `j0`.
///
/// # Safety
/// As [`product`], with `i0 + MR <= m` and `j0 + NV * lanes <= n`.
#[inline(always)]
unsafe fn tile<S: Simd, const MR: usize, const NV: usize>(
    simd: S,
    p: &Product,
    i0: usize,
    j0: usize,
) {
    let lanes = S::F32_LANES;
    let zero = simd.splat_f32s(0.0);
    let mut acc = [[zero; NV]; MR];
    // SAFETY: every offset addresses an element of a, b or c inside the tile, which the caller
    // guarantees valid; unaligned reads and writes of whole vectors.
    unsafe {
        if p.accumulate {
            for (r, acc_row) in acc.iter_mut().enumerate() {
                for (v, acc) in acc_row.iter_mut().enumerate() {
                    let src = p.c.add((i0 + r) * p.ldc + j0 + v * lanes).cast::<S::f32s>();
                    *acc = std::ptr::read_unaligned(src);
                }
            }
        }
        // Pointers walked along the inner dimension: no index products in the loop.
        let a_rows: [*const f32; MR] = std::array::from_fn(|r| p.a.add((i0 + r) * p.a_rs));
        let (mut a_at, mut row) = (0, p.b.add(j0));
        for _ in 0..p.k {
            let mut bv = [zero; NV];
            for (v, b) in bv.iter_mut().enumerate() {
                *b = std::ptr::read_unaligned(row.add(v * lanes).cast::<S::f32s>());
            }
            for (acc_row, a_row) in acc.iter_mut().zip(&a_rows) {
                let a = simd.splat_f32s(*a_row.add(a_at));
                for (acc, &b) in acc_row.iter_mut().zip(&bv) {
                    *acc = simd.mul_add_e_f32s(a, b, *acc);
                }
            }
            a_at += p.a_cs;
            // One row past the last may lie outside the operand: only ever read before this.
            row = row.wrapping_add(p.ldb);
        }
        for (r, acc_row) in acc.iter().enumerate() {
            for (v, &sum) in acc_row.iter().enumerate() {
                let dst = p.c.add((i0 + r) * p.ldc + j0 + v * lanes).cast::<S::f32s>();
                std::ptr::write_unaligned(dst, sum);
            }
        }
    }
}

/// Columns `j0..n` (fewer than one vector), one element at a time.
///
/// # Safety
/// As [`product`].
unsafe fn columns_left(p: &Product, j0: usize) {
    // SAFETY: every offset is inside the product's operands (the caller's guarantee).
    unsafe {
        for i in 0..p.m {
            for j in j0..p.n {
                let dst = p.c.add(i * p.ldc + j);
                let mut sum = if p.accumulate { *dst } else { 0.0f32 };
                for kk in 0..p.k {
                    sum += *p.a.add(i * p.a_rs + kk * p.a_cs) * *p.b.add(kk * p.ldb + j);
                }
                *dst = sum;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(m, k, n)` products split along the inner dimension: the first part without
    /// `accumulate`, the rest with it, in order, give the whole product's bits.
    #[test]
    fn a_product_continued_in_parts_gives_the_whole_products_bits() {
        for (m, k, n) in [(37, 70, 40), (9, 33, 16), (5, 64, 7), (20, 1, 33)] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919) % 113) as f32 / 57.0 - 1.0)
                .collect();
            let b: Vec<f32> = (0..k * n)
                .map(|i| ((i * 104_729) % 127) as f32 / 63.0 - 1.0)
                .collect();
            let product = |c: &mut [f32], (k0, k1): (usize, usize), accumulate: bool| {
                let p = Product {
                    m,
                    n,
                    k: k1 - k0,
                    a: a[k0..].as_ptr(),
                    a_rs: k,
                    a_cs: 1,
                    b: b[k0 * n..].as_ptr(),
                    ldb: n,
                    c: c.as_mut_ptr(),
                    ldc: n,
                    accumulate,
                };
                crate::vector::arch().dispatch(Run(&p));
            };
            let mut whole = vec![f32::NAN; m * n];
            product(&mut whole, (0, k), false);
            let mut parts = vec![f32::NAN; m * n];
            let cuts = [0, k / 3, k / 3 + 1, k];
            product(&mut parts, (cuts[0], cuts[1]), false);
            for w in cuts[1..].windows(2) {
                product(&mut parts, (w[0], w[1]), true);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&parts), bits(&whole), "{m} x {k} x {n}");
        }
    }

    /// One product inside the dispatch, as the kernels run them.
    struct Run<'a>(&'a Product);

    impl pulp::WithSimd for Run<'_> {
        type Output = ();

        #[inline(always)]
        fn with_simd<S: Simd>(self, simd: S) {
            // SAFETY: the test's operands hold every element the product addresses.
            unsafe { product(simd, self.0) }
        }
    }
}
