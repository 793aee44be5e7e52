//! A BLIS-style `f32` matrix product for x86-64 with AVX-512, written to learn whether a kernel
//! of pipe's own would run the training step's products faster than the `gemm` crate: a
//! measurement, not part of the backend (`experiments/cpu-step/results.md`, "A product of
//! pipe's own").
//!
//! It gives `gemm`'s bits. `gemm` sums each output element in blocks of the inner dimension
//! (`kc` long, a function of `k` and the L1 cache alone): every block starts from zero,
//! multiply-adds its terms in order with fused multiply-adds, and is then added to the output
//! (or stored, for the first block of a product that does not accumulate). This sums in exactly
//! that order with the same `kc` ([`depth_block`]), so any difference in speed is the kernel's
//! and the blocking's, never the arithmetic's. How the work is laid out:
//! - per depth block, the tasks first pack both operands together (each its share): `A` in
//!   panels of [`MR`] rows, `kc` steps of `MR` adjacent values (a row-major `A` through 16 x 16
//!   register transposes), `B` in panels of [`NR`] columns, `kc` rows of `NR` values;
//! - then each task computes its share of the output's columns, in blocks of [`NB`] columns
//!   (in its core's L2), each swept by every `A` panel (in L1) in turn;
//! - the micro-kernel keeps a 14 x 32 tile of the output in 28 vector registers, each depth
//!   step multiplying 14 broadcast values of `A` with two vectors of `B`, prefetching `B`
//!   [`kernel::AHEAD`] steps ahead.
//!
//! Its AVX-512 intrinsics are stable since Rust 1.89, so the example sits behind the
//! `own-products` feature and the rest of the workspace keeps its older minimum.
#![allow(clippy::incompatible_msrv)]

/// Rows of `A` (broadcast) and of the output per micro-kernel call.
const MR: usize = 14;
/// Columns of packed `B` (two 16-lane vectors) and of the output per micro-kernel call.
const NR: usize = 32;
/// Columns of `B` packed at a time: at most `kc = 512` deep that is 1 MiB, within one core's L2.
const NB: usize = 512;
/// The micro-kernel size `gemm`'s AVX-512 `f32` path passes to its blocking rule (4 vectors of
/// 16 rows by 6 columns); its inner-dimension block depends on these and the L1 cache.
const GEMM_MR: usize = 64;
const GEMM_NR: usize = 6;

/// One product `C (m x n, row stride ldc) [+]= A (m x k) B (k x n)`, operands given by pointer
/// and (row, column) strides in elements.
#[derive(Clone, Copy)]
pub struct Product {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: *const f32,
    pub a_rs: isize,
    pub a_cs: isize,
    pub b: *const f32,
    pub b_rs: isize,
    pub b_cs: isize,
    pub c: *mut f32,
    pub ldc: usize,
    pub accumulate: bool,
}

// SAFETY: a `Product` is handed to pool tasks that read its operands and write disjoint column
// ranges of its output, all finishing before the caller's borrows of those buffers end.
unsafe impl Send for Product {}
unsafe impl Sync for Product {}

/// Whether this machine runs the kernel (AVX-512 Foundation, detected once).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether `p` can be computed here with `gemm`'s bits: AVX-512 present, a product `gemm`
/// blocks by [`depth_block`] (not one of its small-product or vector paths), and an `A` and a
/// `B` each with unit stride one way.
pub fn eligible(p: &Product) -> bool {
    available()
        && (p.m > 64 || p.n > 64)
        && p.m > 1
        && p.n > 1
        && p.k > 2
        && (p.a_cs == 1 || p.a_rs == 1)
        && (p.b_cs == 1 || p.b_rs == 1)
}

/// The inner-dimension block `gemm` sums in for a product `k` deep: its cache rule for its
/// AVX-512 `f32` micro-kernel, the `k` blocks then made equal.
pub fn depth_block(m: usize, n: usize, k: usize) -> usize {
    gemm_common::cache::kernel_params(n, m, k, GEMM_MR, GEMM_NR, std::mem::size_of::<f32>()).kc
}

/// Splits `0..count` items into `parts` contiguous ranges (some possibly empty).
fn share(count: usize, parts: usize, t: usize) -> (usize, usize) {
    (count * t / parts, count * (t + 1) / parts)
}

/// A raw pointer into the packed operands that pool tasks share: each task writes a disjoint
/// part while packing, and all of them only read it afterwards.
#[derive(Clone, Copy)]
struct Packed(*mut f32);
// SAFETY: see the type's description; the phases are separated by the pool's joins.
unsafe impl Send for Packed {}
unsafe impl Sync for Packed {}

impl Packed {
    /// The pointer. A method, not a field access, so closures capture the whole `Packed`.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Computes `p` with `parts` tasks run by `for_each(count, task)` (which runs `task(i)` for
/// every `i < count`, in any order or concurrently, and returns when all have finished).
/// For each depth block the tasks first pack `A` and `B` together, each its share of both,
/// then compute, each its share of the output's columns. `scratch` holds the packed operands
/// (grown when too small).
///
/// # Safety
/// `p`'s pointers and strides describe live `m x k`, `k x n` and `m x n` (row stride `ldc`)
/// matrices that nothing else writes meanwhile, and `p` is [`eligible`].
pub unsafe fn multiply(
    p: &Product,
    parts: usize,
    for_each: impl Fn(usize, &(dyn Fn(usize) + Sync + Send)),
    scratch: &mut Vec<f32>,
) {
    let kc_max = depth_block(p.m, p.n, p.k);
    let a_panels = p.m.div_ceil(MR);
    let b_panels = p.n.div_ceil(NR);
    // `B`'s panels start 64-byte aligned too: `A`'s take a whole number of 16-value lines.
    let a_len = (a_panels * MR * kc_max).next_multiple_of(16);
    let need = a_len + b_panels * NR * kc_max + 16;
    if scratch.len() < need {
        scratch.resize(need, 0.0);
    }
    // Packed panels start on a 64-byte boundary, so their vector loads are aligned.
    let skip = scratch.as_ptr().align_offset(64);
    let base = scratch.as_mut_ptr().wrapping_add(skip);
    let (pa, pb) = (Packed(base), Packed(base.wrapping_add(a_len)));
    let parts = parts.clamp(1, b_panels);
    let mut p0 = 0;
    while p0 < p.k {
        let kc = kc_max.min(p.k - p0);
        let add = p.accumulate || p0 > 0;
        let pack = |t: usize| {
            let (a0, a1) = share(a_panels, parts, t);
            let (b0, b1) = share(b_panels, parts, t);
            // SAFETY: each task packs its own panels of both operands, inside the scratch.
            unsafe { kernel::pack(p, p0, kc, (a0, a1), (b0, b1), pa.get(), pb.get()) }
        };
        for_each(parts, &pack);
        let compute = |t: usize| {
            let (b0, b1) = share(b_panels, parts, t);
            // SAFETY: the packing above has finished; each task writes its own columns.
            unsafe { kernel::compute(p, kc, add, (b0, b1), pa.get(), pb.get()) }
        };
        for_each(parts, &compute);
        p0 += kc;
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod kernel {
    use super::Product;
    pub(super) unsafe fn pack(
        _: &Product,
        _: usize,
        _: usize,
        _: (usize, usize),
        _: (usize, usize),
        _: *mut f32,
        _: *mut f32,
    ) {
        unreachable!("eligible() is false off x86-64")
    }
    pub(super) unsafe fn compute(
        _: &Product,
        _: usize,
        _: bool,
        _: (usize, usize),
        _: *const f32,
        _: *const f32,
    ) {
        unreachable!("eligible() is false off x86-64")
    }
}

#[cfg(target_arch = "x86_64")]
mod kernel {
    use super::{MR, NB, NR, Product};
    use std::arch::x86_64::*;

    /// Depth steps ahead that the micro-kernel prefetches packed `B` (two cache lines each).
    pub const AHEAD: usize = 8;

    /// The 14 x 32 output tile a micro-kernel call holds in registers.
    type Tile = [[__m512; 2]; MR];

    /// Packs `A`'s row panels `a_panels` and `B`'s column panels `b_panels` of the depth
    /// block `p0..p0+kc`: an `A` panel is `kc` steps of [`MR`] values (one per row, zero past
    /// the last row), a `B` panel `kc` rows of [`NR`] values (zero past the last column).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack(
        p: &Product,
        p0: usize,
        kc: usize,
        a_panels: (usize, usize),
        b_panels: (usize, usize),
        pa: *mut f32,
        pb: *mut f32,
    ) {
        // SAFETY: the caller's contract; every index stays inside the operands and the
        // panels this task owns.
        unsafe {
            for q in a_panels.0..a_panels.1 {
                pack_a_panel(p, p0, kc, q * MR, pa.add(q * kc * MR));
            }
            for q in b_panels.0..b_panels.1 {
                pack_b_panel(p, p0, kc, q * NR, pb.add(q * kc * NR));
            }
        }
    }

    /// One `A` panel: rows `i0..i0+MR` (fewer at the end), depth `p0..p0+kc`.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_a_panel(p: &Product, p0: usize, kc: usize, i0: usize, out: *mut f32) {
        let rows = MR.min(p.m - i0);
        // SAFETY: rows i0..i0+rows and depth p0..p0+kc lie inside A; `out` holds kc * MR.
        unsafe {
            if p.a_rs == 1 {
                // Transposed storage: a depth step's rows are adjacent.
                let mask = ((1u32 << rows) - 1) as __mmask16;
                for d in 0..kc {
                    let src = p.a.offset((p0 + d) as isize * p.a_cs + i0 as isize);
                    _mm512_mask_storeu_ps(
                        out.add(d * MR),
                        0x3fff,
                        _mm512_maskz_loadu_ps(mask, src),
                    );
                }
            } else {
                // Row-major: 16 depth steps of the panel's rows at a time, transposed in
                // registers, each step's MR values stored side by side.
                let mut d0 = 0;
                while d0 < kc {
                    let steps = 16.min(kc - d0);
                    let mask = ((1u32 << steps) - 1) as __mmask16;
                    let mut block = [_mm512_setzero_ps(); 16];
                    for (r, v) in block.iter_mut().enumerate().take(rows) {
                        let src = p.a.offset((i0 + r) as isize * p.a_rs + (p0 + d0) as isize);
                        *v = _mm512_maskz_loadu_ps(mask, src);
                    }
                    let columns = transpose16(block);
                    for (d, v) in columns.iter().enumerate().take(steps) {
                        _mm512_mask_storeu_ps(out.add((d0 + d) * MR), 0x3fff, *v);
                    }
                    d0 += 16;
                }
            }
        }
    }

    /// The 16 x 16 block whose rows are `r` transposed: lane `j` of result `i` is lane `i` of
    /// `r[j]`.
    #[target_feature(enable = "avx512f")]
    pub(super) fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm512_setzero_ps(); 16];
        for i in 0..4 {
            let (a, b, c, d) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
            u[4 * i] = _mm512_shuffle_ps::<0x44>(a, c);
            u[4 * i + 1] = _mm512_shuffle_ps::<0xee>(a, c);
            u[4 * i + 2] = _mm512_shuffle_ps::<0x44>(b, d);
            u[4 * i + 3] = _mm512_shuffle_ps::<0xee>(b, d);
        }
        // Each 128-bit lane of u[4g + c] now holds column 4L + c of rows 4g..4g+4.
        for i in 0..4 {
            t[i] = _mm512_shuffle_f32x4::<0x88>(u[i], u[4 + i]);
            t[4 + i] = _mm512_shuffle_f32x4::<0xdd>(u[i], u[4 + i]);
            t[8 + i] = _mm512_shuffle_f32x4::<0x88>(u[8 + i], u[12 + i]);
            t[12 + i] = _mm512_shuffle_f32x4::<0xdd>(u[8 + i], u[12 + i]);
        }
        let mut out = [_mm512_setzero_ps(); 16];
        for i in 0..4 {
            out[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[8 + i]);
            out[4 + i] = _mm512_shuffle_f32x4::<0x88>(t[4 + i], t[12 + i]);
            out[8 + i] = _mm512_shuffle_f32x4::<0xdd>(t[i], t[8 + i]);
            out[12 + i] = _mm512_shuffle_f32x4::<0xdd>(t[4 + i], t[12 + i]);
        }
        out
    }

    /// The lane masks of a panel's two vectors for its first `width` columns.
    fn panel_masks(width: usize) -> (__mmask16, __mmask16) {
        let lanes = |w: usize| -> __mmask16 {
            if w >= 16 {
                0xffff
            } else {
                ((1u32 << w) - 1) as __mmask16
            }
        };
        (lanes(width), lanes(width.saturating_sub(16)))
    }

    /// One `B` panel: columns `j0..j0+NR` (fewer at the end), depth `p0..p0+kc`.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_b_panel(p: &Product, p0: usize, kc: usize, j0: usize, out: *mut f32) {
        let width = NR.min(p.n - j0);
        let (m0, m1) = panel_masks(width);
        // SAFETY: rows p0..p0+kc and columns j0..j0+width lie inside B; `out` holds kc * NR.
        unsafe {
            if p.b_cs == 1 {
                for d in 0..kc {
                    let row = out.add(d * NR);
                    let src = p.b.offset((p0 + d) as isize * p.b_rs + j0 as isize);
                    _mm512_store_ps(row, _mm512_maskz_loadu_ps(m0, src));
                    _mm512_store_ps(row.add(16), _mm512_maskz_loadu_ps(m1, src.add(16)));
                }
                return;
            }
            // Transposed storage: the panel's columns are stored rows, 16 depth steps of each
            // of them at a time, transposed in registers in two groups of 16.
            let mut d0 = 0;
            while d0 < kc {
                let steps = 16.min(kc - d0);
                let mask = ((1u32 << steps) - 1) as __mmask16;
                for half in 0..2 {
                    let mut block = [_mm512_setzero_ps(); 16];
                    for (j, v) in block.iter_mut().enumerate() {
                        let col = half * 16 + j;
                        if col < width {
                            let src =
                                p.b.offset((j0 + col) as isize * p.b_cs + (p0 + d0) as isize);
                            *v = _mm512_maskz_loadu_ps(mask, src);
                        }
                    }
                    for (d, v) in transpose16(block).iter().enumerate().take(steps) {
                        _mm512_store_ps(out.add((d0 + d) * NR + half * 16), *v);
                    }
                }
                d0 += 16;
            }
        }
    }

    /// The output columns of `B` panels `b_panels`, for the depth block just packed: blocks
    /// of [`NB`] columns (in L2), each swept by every `A` panel (in L1) in turn.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn compute(
        p: &Product,
        kc: usize,
        add: bool,
        b_panels: (usize, usize),
        pa: *const f32,
        pb: *const f32,
    ) {
        let per_block = NB / NR;
        let mut q0 = b_panels.0;
        // SAFETY: the packed panels hold what `pack` wrote; output rows and columns stay
        // inside C, and these columns are this task's alone.
        unsafe {
            while q0 < b_panels.1 {
                let q1 = (q0 + per_block).min(b_panels.1);
                for (ai, i0) in (0..p.m).step_by(MR).enumerate() {
                    let rows = MR.min(p.m - i0);
                    let a = pa.add(ai * kc * MR);
                    for q in q0..q1 {
                        let j0 = q * NR;
                        let tile = tile(kc, a, pb.add(q * kc * NR));
                        store(
                            &tile,
                            p.c.add(i0 * p.ldc + j0),
                            p.ldc,
                            rows,
                            NR.min(p.n - j0),
                            add,
                        );
                    }
                }
                q0 = q1;
            }
        }
    }

    /// The tile `A[panel rows, depth] B[depth, panel columns]` over `kc` depth steps, each
    /// element summed from zero in order with fused multiply-adds.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tile(kc: usize, a: *const f32, b: *const f32) -> Tile {
        let mut acc: Tile = [[_mm512_setzero_ps(); 2]; MR];
        // SAFETY: `a` holds kc * MR values and `b` kc * NR, 64-byte aligned.
        unsafe {
            for d in 0..kc {
                let a = a.add(d * MR);
                _mm_prefetch::<_MM_HINT_T0>(b.add(d * NR + AHEAD * NR) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(b.add(d * NR + AHEAD * NR + 16) as *const i8);
                let b0 = _mm512_load_ps(b.add(d * NR));
                let b1 = _mm512_load_ps(b.add(d * NR + 16));
                for (r, row) in acc.iter_mut().enumerate() {
                    let v = _mm512_set1_ps(*a.add(r));
                    row[0] = _mm512_fmadd_ps(v, b0, row[0]);
                    row[1] = _mm512_fmadd_ps(v, b1, row[1]);
                }
            }
        }
        acc
    }

    /// Writes a tile's first `rows` rows and `width` columns to `c`, added to what is there
    /// when `add`.
    #[target_feature(enable = "avx512f")]
    unsafe fn store(tile: &Tile, c: *mut f32, ldc: usize, rows: usize, width: usize, add: bool) {
        let (m0, m1) = panel_masks(width);
        // SAFETY: rows..rows x width of `c` lie inside the output.
        unsafe {
            for (r, row) in tile.iter().enumerate().take(rows) {
                let out = c.add(r * ldc);
                let (mut v0, mut v1) = (row[0], row[1]);
                if add {
                    v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, out), v0);
                    v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, out.add(16)), v1);
                }
                _mm512_mask_storeu_ps(out, m0, v0);
                _mm512_mask_storeu_ps(out.add(16), m1, v1);
            }
        }
    }
}
