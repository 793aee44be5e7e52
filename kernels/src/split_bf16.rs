//! f32 matrix products as sums of bf16 products on the CPU's tile unit (Intel AMX): the CPU
//! backend's `--precision bf16x6`.
//!
//! Every element `x` of both operands is split into three bf16 parts, `x = x0 + x1 + x2 + r`,
//! each part the remainder of the ones before rounded to nearest even, so `|x1| <= 2^-8 |x|`,
//! `|x2| <= 2^-16 |x|` and `|r| <= 2^-24 |x|`. A product `a b` is summed as the six products of
//! parts whose order is at most `2^-16` of the leading one:
//!
//! ```text
//! a0 b0 + a0 b1 + a1 b0 + a0 b2 + a1 b1 + a2 b0
//! ```
//!
//! The terms dropped (`a1 b2`, `a2 b1`, `a2 b2` and the parts' remainders) are within a few
//! units of f32's own rounding of `a b`; every bf16 x bf16 product is exact in f32, and the tile
//! unit adds them into f32 accumulators. So the result's error is f32's class (measured against
//! an f64 product beside `gemm`'s f32 one: `docs/benchmarks.md`), while the tile unit multiplies
//! bf16 at many times the rate of f32 vector FMAs. The bits differ from the f32 products', so
//! this is a precision a run asks for, never the default.
//!
//! `--precision bf16x3` ([`Scheme::Three`]) keeps two parts and three products,
//! `a0 b1 + a0 b0 + a1 b0`: the dropped `a1 b1` and the remainders are at most `3 2^-18` of
//! `|a b|`, about 16 bits of each term (the split PyTorch's
//! `set_float32_matmul_precision("high")` describes), in half the tile products and two planes
//! of packing.
//!
//! The operands are packed once per product into the tile unit's layouts: the left one in
//! panels of 16 rows, each 32 parts of the inner dimension a tile; the right one in panels of
//! 16 columns, its inner dimension in pairs (the unit's "VNNI" layout). Each task computes a
//! block of 256 output columns, in 32 x 32 blocks held in four tiles, over the inner dimension
//! in blocks of 512. The order of every element's sum depends on the shape alone: threads only
//! decide who computes a column block, as everywhere in the CPU backend.
//!
//! [`Unit::Software`] runs the same blocks with the tile instruction written out in scalar
//! code, rounded as the hardware rounds it (checked bit for bit against the hardware where it
//! exists), so the packing and blocking are tested on every CPU, and a run in this precision
//! gives the same bits with or without AMX.

use std::sync::OnceLock;

use rayon::prelude::*;

/// Parts of the inner dimension in one tile row (16 pairs of bf16).
const K_STEP: usize = 32;
/// Inner-dimension steps per block: 768 parts, so a task's right-operand block (three planes
/// of 768 x 256 parts, 1.2 MiB) stays in a core's L2 (measured best of 4 to 64 steps).
const K_BLOCK_STEPS: usize = 24;
/// Output rows and columns of one task's block.
const BLOCK: usize = 256;
/// Elements in one tile (16 rows of 64 bytes, as bf16 parts).
const TILE: usize = 512;
/// Panels whose tiles one packing pass makes together from stored rows (24 KiB of tiles).
const GROUP: usize = 8;

/// Which unit runs the tile arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unit {
    /// The CPU's AMX tiles.
    Hardware,
    /// The same arithmetic in scalar code (tests, and CPUs without AMX when asked directly).
    Software,
}

/// Which products of parts make an f32 product: the sum the CPU backend's tile precisions
/// name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scheme {
    /// `--precision bf16x6`: the six products of three parts in [`SIX_PRODUCTS`], f32's
    /// accuracy.
    Six,
    /// `--precision bf16x3`: the three products of two parts in [`THREE_PRODUCTS`], `a0 b1 +
    /// a0 b0 + a1 b0`; the dropped `a1 b1` and the parts' remainders leave an error of at
    /// most `3 2^-18` of each term (about 16 bits, where f32 has 24), in half the tile
    /// products.
    Three,
}

impl Scheme {
    /// The scheme of a tile precision (`None` for f32 and CUDA's precisions).
    pub(crate) fn of(precision: crate::Precision) -> Option<Self> {
        match precision {
            crate::Precision::Bf16x6 => Some(Scheme::Six),
            crate::Precision::Bf16x3 => Some(Scheme::Three),
            crate::Precision::F32 | crate::Precision::Tf32 | crate::Precision::Bf16 => None,
        }
    }

    /// The precision this scheme computes.
    pub(crate) fn precision(self) -> crate::Precision {
        match self {
            Scheme::Six => crate::Precision::Bf16x6,
            Scheme::Three => crate::Precision::Bf16x3,
        }
    }

    /// The products of parts `(left part, right part)` in the order each accumulator adds
    /// them (the order is part of the bits).
    fn products(self) -> &'static [(usize, usize)] {
        match self {
            Scheme::Six => &SIX_PRODUCTS,
            Scheme::Three => &THREE_PRODUCTS,
        }
    }

    /// Parts of each element the products read (the packs' planes written).
    fn parts(self) -> usize {
        match self {
            Scheme::Six => 3,
            Scheme::Three => 2,
        }
    }
}

/// Whether this CPU and OS run AMX bf16 tile instructions for this process: the CPU reports
/// AMX-TILE and AMX-BF16 and the kernel grants the tile state (`arch_prctl`). Asked once.
pub(crate) fn hardware_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(request_tiles)
}

#[cfg(target_arch = "x86_64")]
fn request_tiles() -> bool {
    const AMX_BF16: u32 = 1 << 22;
    const AMX_TILE: u32 = 1 << 24;
    const ARCH_REQ_XCOMP_PERM: libc::c_ulong = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_ulong = 18;
    // SAFETY: `cpuid` leaf 0 and leaf 7 only read processor identification (an unsafe call
    // before Rust 1.87).
    #[allow(unused_unsafe)]
    let leaf7 = unsafe {
        if std::arch::x86_64::__cpuid(0).eax < 7 {
            return false;
        }
        std::arch::x86_64::__cpuid_count(7, 0)
    };
    if leaf7.edx & (AMX_BF16 | AMX_TILE) != AMX_BF16 | AMX_TILE {
        return false;
    }
    // SAFETY: asks the kernel to let this process use the tile data state; it changes nothing
    // else and fails cleanly where the kernel or hypervisor does not offer it.
    let granted = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    granted == 0
}

#[cfg(not(target_arch = "x86_64"))]
fn request_tiles() -> bool {
    false
}

/// One product `C (m x n) = op(A) (m x k) op(B) (k x n)`: base addresses and (row, column)
/// strides of the operands as the CPU backend holds them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operands {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: *const f32,
    pub a_rs: isize,
    pub a_cs: isize,
    pub b: *const f32,
    pub b_rs: isize,
    pub b_cs: isize,
}

// SAFETY: the pointers are read only, from live tensors the caller holds for the whole product.
unsafe impl Send for Operands {}
unsafe impl Sync for Operands {}

/// The bf16 nearest `bits`' f32 (ties to even), in the low 16 bits; a finite value that would
/// round past bf16's largest is truncated instead, so a finite operand never becomes infinite,
/// and a NaN stays a (quiet) NaN. Branch-free, so the packing loops vectorise.
#[inline(always)]
fn bf16_nearest(bits: u32) -> u32 {
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let finite = bits & 0x7f80_0000 != 0x7f80_0000;
    let nan = bits & 0x7fff_ffff > 0x7f80_0000;
    let overflowed = rounded & 0x7f80 == 0x7f80 && finite;
    let kept = if overflowed { bits >> 16 } else { rounded };
    if nan { 0x7fc0 } else { kept }
}

fn bf16_value(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// The three bf16 parts of `x` (the last two zero where `x` is not finite).
#[inline(always)]
pub(crate) fn split(x: f32) -> [u16; 3] {
    let bits = x.to_bits();
    let finite = bits & 0x7f80_0000 != 0x7f80_0000;
    let x0 = bf16_nearest(bits);
    let r1 = x - f32::from_bits(x0 << 16);
    let x1 = bf16_nearest(r1.to_bits());
    let r2 = r1 - f32::from_bits(x1 << 16);
    let x2 = bf16_nearest(r2.to_bits());
    if finite {
        [x0 as u16, x1 as u16, x2 as u16]
    } else {
        [x0 as u16, 0, 0]
    }
}

/// Packed sizes of one product: padded rows, columns and inner length, its steps, and the
/// parts written of each element. A pack always has room for three planes of parts (so one
/// buffer serves both schemes); only the first `parts` are written and read.
#[derive(Clone, Copy, Debug)]
struct Layout {
    rows: usize,
    cols: usize,
    steps: usize,
    parts: usize,
}

impl Layout {
    fn of(m: usize, n: usize, k: usize, parts: usize) -> Self {
        Self {
            rows: m.next_multiple_of(32),
            cols: n.next_multiple_of(32),
            steps: k.div_ceil(K_STEP),
            parts,
        }
    }

    /// Elements of the packed left operand (three planes).
    fn left_len(self) -> usize {
        3 * self.rows * self.steps * K_STEP
    }

    /// Elements of the packed right operand (three planes).
    fn right_len(self) -> usize {
        3 * self.cols * self.steps * K_STEP
    }

    /// Offset of the left tile (plane, 16-row panel, step).
    fn left_tile(self, plane: usize, panel: usize, step: usize) -> usize {
        ((plane * (self.rows / 16) + panel) * self.steps + step) * TILE
    }

    /// Offset of the right tile (plane, 16-column panel, step).
    fn right_tile(self, plane: usize, panel: usize, step: usize) -> usize {
        ((plane * (self.cols / 16) + panel) * self.steps + step) * TILE
    }
}

/// The three planes of a pack, each cut into per-panel chunks of `panel_len` parts.
fn planes(out: &mut [u16], panel_len: usize) -> impl IndexedParallelIterator<Item = Planes<'_>> {
    let plane_len = out.len() / 3;
    let (first, rest) = out.split_at_mut(plane_len);
    let (second, third) = rest.split_at_mut(plane_len);
    first
        .par_chunks_mut(panel_len)
        .zip(second.par_chunks_mut(panel_len))
        .zip(third.par_chunks_mut(panel_len))
        .map(|((a, b), c)| [a, b, c])
}

/// One panel's chunk of each of the three planes.
type Planes<'a> = [&'a mut [u16]; 3];

/// Packs `op(A)` into `out`, every element written (padding as zero parts): 16-row panels,
/// one task each, or, where `A` is stored transposed, one task per step of 32 stored rows, so
/// that every task reads whole stored rows (a panel's column of 16 values per row would touch
/// a new page at every row).
fn pack_left(p: &Operands, l: Layout, out: &mut [u16]) {
    if p.a_rs == 1 && p.a_cs != 1 {
        let rows = StoredRows {
            base: p.a,
            stride: p.a_cs,
            len: p.m,
            inner: p.k,
        };
        return pack_by_steps(rows, l, l.rows / 16, out, TileOrder::Transposed);
    }
    planes(out, l.steps * TILE)
        .enumerate()
        .for_each(|(panel, planes)| {
            crate::vector::vectorized(LeftPanel {
                p,
                panel,
                planes,
                parts: l.parts,
            });
        });
}

/// Packs `op(B)` into `out` with the inner dimension in pairs, every element written: 16-column
/// panels, one task each, where `B` is stored transposed (each column's run is contiguous),
/// else one task per step of 32 stored rows ([`pack_left`]'s reason).
fn pack_right(p: &Operands, l: Layout, out: &mut [u16]) {
    if p.b_rs == 1 && p.b_cs != 1 {
        planes(out, l.steps * TILE)
            .enumerate()
            .for_each(|(panel, planes)| {
                crate::vector::vectorized(RightPanel {
                    p,
                    panel,
                    planes,
                    parts: l.parts,
                });
            });
        return;
    }
    let rows = StoredRows {
        base: p.b,
        stride: p.b_rs,
        len: p.n,
        inner: p.k,
    };
    if p.b_cs == 1 {
        pack_by_steps(rows, l, l.cols / 16, out, TileOrder::Pairs);
    } else {
        // Neither layout contiguous (not a product the layers make): element by element.
        let at = |e: usize, c: usize| (e / 2) * 32 + c * 2 + e % 2;
        pack_elements(p, l, out, at);
    }
}

/// An operand read as stored rows along the inner dimension: row `kk` holds `len` values at
/// `base + kk stride`, for `kk < inner`.
#[derive(Clone, Copy)]
struct StoredRows {
    base: *const f32,
    stride: isize,
    len: usize,
    inner: usize,
}

// SAFETY: read only, from a live operand the caller holds for the whole product.
unsafe impl Send for StoredRows {}
unsafe impl Sync for StoredRows {}

/// A raw pack pointer handed to tasks that write disjoint tiles.
#[derive(Clone, Copy)]
struct PackPtr(*mut u16);
// SAFETY: each task writes its own tiles of one live pack that outlives the tasks.
unsafe impl Send for PackPtr {}
unsafe impl Sync for PackPtr {}

/// How a step's 32 stored rows become a panel's tile.
#[derive(Clone, Copy)]
enum TileOrder {
    /// Tile row `r` holds value `r` of each stored row in turn (a left operand stored
    /// transposed).
    Transposed,
    /// Tile row `q` holds stored rows `2 q` and `2 q + 1` interleaved (a right operand, in the
    /// unit's pairs).
    Pairs,
}

/// Packs stored rows one step (32 rows) per task, in `order`.
fn pack_by_steps(rows: StoredRows, l: Layout, panels: usize, out: &mut [u16], order: TileOrder) {
    let plane_len = out.len() / 3;
    let pack = PackPtr(out.as_mut_ptr());
    (0..l.steps).into_par_iter().for_each(|step| {
        crate::vector::vectorized(StepRows {
            rows,
            l,
            panels,
            plane_len,
            pack,
            step,
            order,
        });
    });
}

/// One step of [`pack_by_steps`].
struct StepRows {
    rows: StoredRows,
    l: Layout,
    panels: usize,
    plane_len: usize,
    pack: PackPtr,
    step: usize,
    order: TileOrder,
}

/// Values of a stored row split at once (a group of 8 panels).
const GROUP_WIDTH: usize = GROUP * 16;

impl crate::vector::Kernel for StepRows {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        let StepRows {
            rows,
            l,
            panels,
            plane_len,
            pack,
            step,
            order,
        } = self;
        let k0 = step * K_STEP;
        let step_rows = (rows.inner - k0).min(K_STEP);
        // The step's rows are split a group of panels wide at a time (contiguous runs, so the
        // split vectorises, and rows a multiple of 4 KiB apart, which share an L1 set, are each
        // read in one pass), then each tile is made from them in L1.
        let mut split_rows = [[[0u16; GROUP_WIDTH]; 3]; K_STEP];
        for first in (0..panels).step_by(GROUP) {
            let x0 = first * 16;
            let width = rows.len.saturating_sub(x0).min(GROUP_WIDTH);
            for (e, parts) in split_rows.iter_mut().enumerate() {
                if e < step_rows {
                    let offset = (k0 + e) as isize * rows.stride + x0 as isize;
                    // SAFETY: stored row k0 + e < inner holds `len` values, x0 + width <= len.
                    split_wide(unsafe { run_at(rows.base, offset, width) }, parts);
                } else {
                    parts.iter_mut().for_each(|p| p.fill(0));
                }
            }
            for g in 0..(panels - first).min(GROUP) {
                for plane in 0..l.parts {
                    // SAFETY: tile (plane, panel, step) lies inside the pack, and only this
                    // step's task writes it.
                    let tile = unsafe {
                        std::slice::from_raw_parts_mut(
                            pack.0
                                .add(plane * plane_len + ((first + g) * l.steps + step) * TILE),
                            TILE,
                        )
                    };
                    make_tile(&split_rows, plane, g * 16, order, tile);
                }
            }
        }
    }
}

/// The parts of up to [`GROUP_WIDTH`] `values` into `parts` (one row per plane), the rest of
/// each row zero.
#[inline(always)]
fn split_wide(values: &[f32], parts: &mut [[u16; GROUP_WIDTH]; 3]) {
    let [p0, p1, p2] = parts;
    for (((v, a), b), c) in values
        .iter()
        .zip(p0.iter_mut())
        .zip(p1.iter_mut())
        .zip(p2.iter_mut())
    {
        [*a, *b, *c] = split(*v);
    }
    for row in parts.iter_mut() {
        row[values.len()..].fill(0);
    }
}

/// One tile of `plane` from the split rows' 16 values at `x0`, in `order`. Both orders start
/// from the step's rows taken in pairs, `w(q, c) = v(2 q, c) | v(2 q + 1, c) << 16` (one
/// vectorised pass): that is the [`TileOrder::Pairs`] tile, and its 16 x 16 transpose is the
/// [`TileOrder::Transposed`] one (half the moves of transposing the parts one by one).
#[inline(always)]
fn make_tile(
    split_rows: &[[[u16; GROUP_WIDTH]; 3]; K_STEP],
    plane: usize,
    x0: usize,
    order: TileOrder,
    tile: &mut [u16],
) {
    let mut pairs = [[0u32; 16]; 16];
    for (q, row) in pairs.iter_mut().enumerate() {
        let even = &split_rows[2 * q][plane][x0..x0 + 16];
        let odd = &split_rows[2 * q + 1][plane][x0..x0 + 16];
        for ((w, &e), &o) in row.iter_mut().zip(even).zip(odd) {
            *w = u32::from(e) | (u32::from(o) << 16);
        }
    }
    let mut write = |r: usize, c: usize, w: u32| {
        tile[r * 32 + 2 * c] = w as u16;
        tile[r * 32 + 2 * c + 1] = (w >> 16) as u16;
    };
    match order {
        TileOrder::Pairs => {
            for (q, row) in pairs.iter().enumerate() {
                for (c, &w) in row.iter().enumerate() {
                    write(q, c, w);
                }
            }
        }
        TileOrder::Transposed => {
            for (q, row) in pairs.iter().enumerate() {
                for (c, &w) in row.iter().enumerate() {
                    write(c, q, w);
                }
            }
        }
    }
}

/// Packs `op(B)` element by element, for strides with no contiguous run.
fn pack_elements(
    p: &Operands,
    l: Layout,
    out: &mut [u16],
    at: impl Fn(usize, usize) -> usize + Sync,
) {
    out.fill(0);
    let plane_len = out.len() / 3;
    for kk in 0..p.k {
        for j in 0..p.n {
            // SAFETY: (kk, j) lies inside op(B).
            let parts = split(unsafe { *p.b.offset(kk as isize * p.b_rs + j as isize * p.b_cs) });
            let offset = ((j / 16) * l.steps + kk / K_STEP) * TILE + at(kk % K_STEP, j % 16);
            for (plane, part) in parts.into_iter().enumerate().take(l.parts) {
                out[plane * plane_len + offset] = part;
            }
        }
    }
}

/// The parts of up to 32 `values` into `parts` (one row per plane), the rest of each row zero.
#[inline(always)]
fn split_run(values: &[f32], parts: &mut [[u16; 32]; 3]) {
    let [p0, p1, p2] = parts;
    for (((v, a), b), c) in values
        .iter()
        .zip(p0.iter_mut())
        .zip(p1.iter_mut())
        .zip(p2.iter_mut())
    {
        [*a, *b, *c] = split(*v);
    }
    for row in parts.iter_mut() {
        row[values.len()..].fill(0);
    }
}

/// Reads `len` contiguous values at `base + offset` (elements).
///
/// # Safety
/// They must lie inside a live operand.
#[inline(always)]
unsafe fn run_at<'a>(base: *const f32, offset: isize, len: usize) -> &'a [f32] {
    // SAFETY: the caller's guarantee.
    unsafe { std::slice::from_raw_parts(base.offset(offset), len) }
}

/// One 16-row panel of a left operand not stored transposed ([`pack_left`]): tile row `r` of
/// step `s` holds `op(A)(16 panel + r, 32 s + e)` at `e`.
struct LeftPanel<'a, 'p> {
    p: &'a Operands,
    panel: usize,
    planes: Planes<'p>,
    /// Planes written ([`Layout`]'s `parts`).
    parts: usize,
}

impl crate::vector::Kernel for LeftPanel<'_, '_> {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        let LeftPanel {
            p,
            panel,
            mut planes,
            parts: used,
        } = self;
        let planes = &mut planes[..used];
        let rows = (p.m - (panel * 16).min(p.m)).min(16);
        if rows < 16 {
            // Only the rows below the operand's last are padding; every other part is written
            // (the packs are large, so writing them twice costs as much as the split).
            for plane in planes.iter_mut() {
                plane.fill(0);
            }
        }
        let mut parts = [[0u16; 32]; 3];
        let mut gathered = [0f32; 32];
        // Step by step, so each step's three tiles are written whole while they sit in L1
        // (row by row, every row's pass touched all of the panel's 3 x steps tiles, 288 KiB
        // at k = 3,072, and the next row's found them evicted).
        for step in 0..p.k.div_ceil(K_STEP) {
            let (k0, len) = (step * K_STEP, (p.k - step * K_STEP).min(K_STEP));
            for r in 0..rows {
                let i = (panel * 16 + r) as isize;
                let values = if p.a_cs == 1 {
                    // SAFETY: row i < m holds k contiguous values of op(A).
                    unsafe { run_at(p.a, i * p.a_rs + k0 as isize, len) }
                } else {
                    for (e, g) in gathered[..len].iter_mut().enumerate() {
                        // SAFETY: (i, k0 + e) lies inside op(A).
                        *g = unsafe { *p.a.offset(i * p.a_rs + (k0 + e) as isize * p.a_cs) };
                    }
                    &gathered[..len]
                };
                split_run(values, &mut parts);
                for (out, part) in planes.iter_mut().zip(&parts) {
                    out[step * TILE + r * K_STEP..][..K_STEP].copy_from_slice(part);
                }
            }
        }
    }
}

/// One 16-column panel of a right operand stored transposed ([`pack_right`]): tile row `q` of
/// step `s` holds `op(B)(32 s + 2 q + h, 16 panel + c)` at `2 c + h`.
struct RightPanel<'a, 'p> {
    p: &'a Operands,
    panel: usize,
    planes: Planes<'p>,
    /// Planes written ([`Layout`]'s `parts`).
    parts: usize,
}

impl crate::vector::Kernel for RightPanel<'_, '_> {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        let RightPanel {
            p,
            panel,
            mut planes,
            parts: used,
        } = self;
        let planes = &mut planes[..used];
        let cols = (p.n - (panel * 16).min(p.n)).min(16);
        if cols < 16 {
            // Only the columns past the operand's last are padding ([`LeftPanel`]'s reason).
            for plane in planes.iter_mut() {
                plane.fill(0);
            }
        }
        let mut parts = [[0u16; 32]; 3];
        // Step by step, as [`LeftPanel`] (its reason).
        for step in 0..p.k.div_ceil(K_STEP) {
            let (k0, len) = (step * K_STEP, (p.k - step * K_STEP).min(K_STEP));
            for c in 0..cols {
                let offset = (panel * 16 + c) as isize * p.b_cs + k0 as isize;
                // SAFETY: column 16 panel + c < n holds k contiguous values of op(B).
                split_run(unsafe { run_at(p.b, offset, len) }, &mut parts);
                for (out, part) in planes.iter_mut().zip(&parts) {
                    let tile = &mut out[step * TILE..(step + 1) * TILE];
                    for q in 0..K_STEP / 2 {
                        tile[q * 32 + c * 2] = part[2 * q];
                        tile[q * 32 + c * 2 + 1] = part[2 * q + 1];
                    }
                }
            }
        }
    }
}

/// The tile arithmetic of one 32 x 32 output block: four f32 accumulator tiles `C[r][c]`
/// (rows `16 r..`, columns `16 c..`), each group adding two held left tiles times two held
/// right tiles.
trait Tiles {
    /// Sets the accumulators to the 32 x 32 block at `c` (rows `stride` floats apart), or to
    /// zero where `c` is `None`.
    ///
    /// # Safety
    /// `c` must be valid for reading 32 rows of 32 floats at that stride.
    unsafe fn load(&mut self, c: Option<*const f32>, stride: usize);
    /// Holds left tiles `a` and right tiles `b` for the next [`Tiles::group`].
    ///
    /// # Safety
    /// Each pointer must be valid for one tile.
    unsafe fn prime(&mut self, a: [*const u16; 2], b: [*const u16; 2]);
    /// Adds `a[r] b[c]` of the held tiles to every `C[r][c]`, then holds `next_b` and
    /// `next_a` where given (the held ones stay otherwise). Each load comes right after the
    /// last product that reads the tile it replaces, so the next group's first product finds
    /// its tiles loaded, where loading all four before a group's products left the unit
    /// waiting for each load.
    ///
    /// # Safety
    /// Each pointer must be valid for one tile; tiles must be held.
    unsafe fn group(&mut self, next_b: Option<[*const u16; 2]>, next_a: Option<[*const u16; 2]>);
    /// Writes the accumulators to the 32 x 32 block at `c`.
    ///
    /// # Safety
    /// `c` must be valid for writing 32 rows of 32 floats at that stride.
    unsafe fn store(&mut self, c: *mut f32, stride: usize);
}

/// The AMX tiles: `tmm0`-`tmm3` accumulate, `tmm4`-`tmm7` hold the operands' tiles.
#[cfg(target_arch = "x86_64")]
struct Amx;

#[cfg(target_arch = "x86_64")]
impl Amx {
    /// Configures the calling thread's eight tiles as 16 rows of 64 bytes.
    ///
    /// # Safety
    /// The process must hold the tile permission ([`hardware_available`]).
    unsafe fn configure() -> Self {
        #[repr(C, align(64))]
        struct Config([u8; 64]);
        let mut config = Config([0; 64]);
        config.0[0] = 1; // palette 1
        for t in 0..8 {
            config.0[16 + 2 * t] = 64; // bytes per row
            config.0[48 + t] = 16; // rows
        }
        // SAFETY: loads a valid palette-1 configuration from a live, aligned 64-byte buffer.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly));
        }
        Amx
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for Amx {
    fn drop(&mut self) {
        // SAFETY: returns the tiles to their initial state; nothing reads them afterwards.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
    }
}

#[cfg(target_arch = "x86_64")]
impl Tiles for Amx {
    unsafe fn load(&mut self, c: Option<*const f32>, stride: usize) {
        let s = stride * 4;
        // SAFETY: the caller guarantees the block; the tiles are configured (`configure`).
        unsafe {
            match c {
                None => std::arch::asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem)
                ),
                Some(c) => std::arch::asm!(
                    "tileloadd tmm0, [{c} + {s}*1]",
                    "tileloadd tmm1, [{c1} + {s}*1]",
                    "tileloadd tmm2, [{c2} + {s}*1]",
                    "tileloadd tmm3, [{c3} + {s}*1]",
                    c = in(reg) c,
                    c1 = in(reg) c.add(16),
                    c2 = in(reg) c.add(16 * stride),
                    c3 = in(reg) c.add(16 * stride + 16),
                    s = in(reg) s,
                    options(nostack, readonly)
                ),
            }
        }
    }

    unsafe fn prime(&mut self, a: [*const u16; 2], b: [*const u16; 2]) {
        // SAFETY: the caller guarantees four whole tiles; the tiles are configured.
        unsafe {
            std::arch::asm!(
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm6, [{b0} + {s}*1]",
                "tileloadd tmm5, [{a1} + {s}*1]",
                "tileloadd tmm7, [{b1} + {s}*1]",
                a0 = in(reg) a[0],
                a1 = in(reg) a[1],
                b0 = in(reg) b[0],
                b1 = in(reg) b[1],
                s = in(reg) 64usize,
                options(nostack, readonly)
            );
        }
    }

    unsafe fn group(&mut self, next_b: Option<[*const u16; 2]>, next_a: Option<[*const u16; 2]>) {
        // SAFETY: the caller guarantees whole tiles, held ones included; the tiles are
        // configured. `tmm4`/`tmm5` hold the left tiles, `tmm6`/`tmm7` the right ones.
        unsafe {
            match (next_b, next_a) {
                (None, None) => std::arch::asm!(
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    options(nostack, nomem)
                ),
                (None, Some(a)) => std::arch::asm!(
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm4, [{a0} + {s}*1]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    "tileloadd tmm5, [{a1} + {s}*1]",
                    a0 = in(reg) a[0],
                    a1 = in(reg) a[1],
                    s = in(reg) 64usize,
                    options(nostack, readonly)
                ),
                (Some(next_b), None) => std::arch::asm!(
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tileloadd tmm6, [{b0} + {s}*1]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    "tileloadd tmm7, [{b1} + {s}*1]",
                    b0 = in(reg) next_b[0],
                    b1 = in(reg) next_b[1],
                    s = in(reg) 64usize,
                    options(nostack, readonly)
                ),
                (Some(next_b), Some(a)) => std::arch::asm!(
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tileloadd tmm6, [{b0} + {s}*1]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm4, [{a0} + {s}*1]",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    "tileloadd tmm7, [{b1} + {s}*1]",
                    "tileloadd tmm5, [{a1} + {s}*1]",
                    a0 = in(reg) a[0],
                    a1 = in(reg) a[1],
                    b0 = in(reg) next_b[0],
                    b1 = in(reg) next_b[1],
                    s = in(reg) 64usize,
                    options(nostack, readonly)
                ),
            }
        }
    }

    unsafe fn store(&mut self, c: *mut f32, stride: usize) {
        let s = stride * 4;
        // SAFETY: the caller guarantees the block; the tiles are configured.
        unsafe {
            std::arch::asm!(
                "tilestored [{c} + {s}*1], tmm0",
                "tilestored [{c1} + {s}*1], tmm1",
                "tilestored [{c2} + {s}*1], tmm2",
                "tilestored [{c3} + {s}*1], tmm3",
                c = in(reg) c,
                c1 = in(reg) c.add(16),
                c2 = in(reg) c.add(16 * stride),
                c3 = in(reg) c.add(16 * stride + 16),
                s = in(reg) s,
                options(nostack)
            );
        }
    }
}

/// The tile instruction in scalar code, rounded as the hardware's `tdpbf16ps` is (found by
/// comparing bits; Intel's manual writes it otherwise): for each output, the 16 products of even
/// parts summed in order in f32, the 16 of odd parts likewise, and `c += even + odd`, every
/// addition rounded to f32 (a product of two bf16s is exact) with the calling thread's
/// flushing of subnormals.
struct Emulated {
    c: Box<[f32; 1024]>,
    left: [*const u16; 2],
    right: [*const u16; 2],
}

impl Emulated {
    fn new() -> Self {
        Self {
            c: Box::new([0.0; 1024]),
            left: [std::ptr::null(); 2],
            right: [std::ptr::null(); 2],
        }
    }

    /// `C[r][c] += a[r] b[c]` for the held tiles.
    ///
    /// # Safety
    /// The held pointers must be whole tiles.
    unsafe fn multiply_held(&mut self) {
        for (tr, &at) in self.left.iter().enumerate() {
            for (tc, &bt) in self.right.iter().enumerate() {
                for r in 0..16 {
                    for col in 0..16 {
                        let mut halves = [0f32; 2];
                        for pair in 0..16 {
                            for (half, sum) in halves.iter_mut().enumerate() {
                                // SAFETY: both tiles are whole (the caller's guarantee).
                                let (x, y) = unsafe {
                                    (
                                        *at.add(r * 32 + pair * 2 + half),
                                        *bt.add(pair * 32 + col * 2 + half),
                                    )
                                };
                                *sum += bf16_value(x) * bf16_value(y);
                            }
                        }
                        self.c[(tr * 16 + r) * 32 + tc * 16 + col] += halves[0] + halves[1];
                    }
                }
            }
        }
    }
}

impl Tiles for Emulated {
    unsafe fn load(&mut self, c: Option<*const f32>, stride: usize) {
        for r in 0..32 {
            for col in 0..32 {
                self.c[r * 32 + col] = match c {
                    // SAFETY: inside the block the caller guarantees.
                    Some(c) => unsafe { *c.add(r * stride + col) },
                    None => 0.0,
                };
            }
        }
    }

    unsafe fn prime(&mut self, a: [*const u16; 2], b: [*const u16; 2]) {
        self.left = a;
        self.right = b;
    }

    unsafe fn group(&mut self, next_b: Option<[*const u16; 2]>, next_a: Option<[*const u16; 2]>) {
        // SAFETY: the held tiles are whole (the caller's guarantee).
        unsafe { self.multiply_held() };
        if let Some(b) = next_b {
            self.right = b;
        }
        if let Some(a) = next_a {
            self.left = a;
        }
    }

    unsafe fn store(&mut self, c: *mut f32, stride: usize) {
        for r in 0..32 {
            for col in 0..32 {
                // SAFETY: inside the block the caller guarantees.
                unsafe { *c.add(r * stride + col) = self.c[r * 32 + col] };
            }
        }
    }
}

/// A raw output pointer handed to the column-block tasks, each writing its own columns.
#[derive(Clone, Copy)]
struct Output(*mut f32);
// SAFETY: tasks write disjoint column blocks of one live output that outlives them.
unsafe impl Send for Output {}
unsafe impl Sync for Output {}

/// The block of `C` at rows `i0..i1` and columns `j0..j1`, every 32 x 32 block of it over
/// every inner block, on `tiles`.
///
/// # Safety
/// `c` must be the live `m x n` output; the packs must hold `l`'s layout of the operands.
#[allow(clippy::too_many_arguments)]
unsafe fn output_block<T: Tiles>(
    tiles: &mut T,
    l: Layout,
    p: &Operands,
    (left, right): (&[u16], &[u16]),
    c: Output,
    ((i0, i1), (j0, j1)): ((usize, usize), (usize, usize)),
    (scheme, accumulate): (Scheme, bool),
) {
    let (m, n) = (p.m, p.n);
    let mut edge = [0f32; 1024];
    for k0 in (0..l.steps).step_by(K_BLOCK_STEPS) {
        let k1 = (k0 + K_BLOCK_STEPS).min(l.steps);
        for i in (i0..i1).step_by(32) {
            for j in (j0..j1).step_by(32) {
                let fresh = k0 == 0 && !accumulate;
                let inside = i + 32 <= m && j + 32 <= n;
                // SAFETY: `i < m` and `j < n` (the padded loops start inside), and a block
                // crossing an edge goes through `edge` with only its inside copied.
                unsafe {
                    let at = c.0.add(i * n + j);
                    let (block, stride) = if inside {
                        (at, n)
                    } else {
                        if !fresh {
                            for r in 0..(m - i).min(32) {
                                for col in 0..(n - j).min(32) {
                                    edge[r * 32 + col] = *at.add(r * n + col);
                                }
                            }
                        }
                        (edge.as_mut_ptr(), 32)
                    };
                    tiles.load((!fresh).then_some(block.cast_const()), stride);
                    inner_block(tiles, l, (left, right), (i, j), (k0, k1), scheme.products());
                    tiles.store(block, stride);
                    if !inside {
                        for r in 0..(m - i).min(32) {
                            for col in 0..(n - j).min(32) {
                                *at.add(r * n + col) = edge[r * 32 + col];
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The order in which a step's six products of parts `(left part, right part)` are made
/// under [`Scheme::Six`]. Each accumulator adds them in this order, so the order is part of
/// the bits.
const SIX_PRODUCTS: [(usize, usize); 6] = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0)];
/// The same under [`Scheme::Three`]: ordered so that each group after the first replaces
/// only one operand's tiles (8 tile loads a step where `(0, 0)` first takes 10).
const THREE_PRODUCTS: [(usize, usize); 3] = [(0, 1), (0, 0), (1, 0)];

/// Adds the 32 x 32 block at rows `i` and columns `j` over the inner steps `k0..k1` to the
/// accumulators: `products` in turn at each step, each group's next tiles loaded while it
/// multiplies ([`Tiles::group`]).
///
/// # Safety
/// The packs must hold `l`'s layout, with rows `i..i + 32`, columns `j..j + 32` and steps
/// `k0..k1` (`k0 < k1`) inside it.
unsafe fn inner_block<T: Tiles>(
    tiles: &mut T,
    l: Layout,
    (left, right): (&[u16], &[u16]),
    (i, j): (usize, usize),
    (k0, k1): (usize, usize),
    products: &[(usize, usize)],
) {
    // SAFETY: inside the packs (the caller's guarantee).
    let left_tiles = |part: usize, s: usize| unsafe {
        [
            left.as_ptr().add(l.left_tile(part, i / 16, s)),
            left.as_ptr().add(l.left_tile(part, i / 16 + 1, s)),
        ]
    };
    // SAFETY: as `left_tiles`.
    let right_tiles = |part: usize, s: usize| unsafe {
        [
            right.as_ptr().add(l.right_tile(part, j / 16, s)),
            right.as_ptr().add(l.right_tile(part, j / 16 + 1, s)),
        ]
    };
    // SAFETY: every pointer is a whole tile of the packs.
    unsafe {
        let (first_a, first_b) = products[0];
        tiles.prime(left_tiles(first_a, k0), right_tiles(first_b, k0));
        for s in k0..k1 {
            for (g, &(a_part, b_part)) in products.iter().enumerate() {
                // The last group loads the next step's first tiles (the last step's own again,
                // which are never used, so no load leaves the packs).
                let ((next_a, next_b), next_s) = match products.get(g + 1) {
                    Some(&next) => (next, s),
                    None => (products[0], (s + 1).min(k1 - 1)),
                };
                let load_a = next_a != a_part || next_s != s;
                let load_b = next_b != b_part || next_s != s;
                tiles.group(
                    load_b.then(|| right_tiles(next_b, next_s)),
                    load_a.then(|| left_tiles(next_a, next_s)),
                );
            }
        }
    }
}

/// 32 bf16 parts on a cache line: one tile row. Packs are made of these so every tile row
/// the unit loads is one aligned line (unaligned rows span two, and cost about half the rate).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct Line([u16; 32]);

/// A growable buffer of parts aligned to cache lines.
#[derive(Debug, Default)]
struct Lines(Vec<Line>);

impl Lines {
    /// The first `len` parts (a multiple of 32), grown as needed.
    fn parts(&mut self, len: usize) -> &mut [u16] {
        let lines = len / 32;
        if self.0.len() < lines {
            self.0.resize(lines, Line([0; 32]));
        }
        // SAFETY: `Line` is 32 `u16`s with no padding (`repr(C)`, size 64), so `lines` of them
        // are `len` initialised `u16`s, borrowed mutably with the buffer.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<u16>(), len) }
    }
}

/// Scratch for the packed operands, kept between products so a step allocates nothing after
/// its first.
#[derive(Debug, Default)]
pub(crate) struct Packs {
    left: Lines,
    right: Lines,
}

/// `C = op(A) op(B)` (or `C += ...` when `accumulate`) as `scheme`'s bf16 products per term,
/// on the calling rayon pool's threads.
///
/// # Safety
/// The operands must be live and hold `op(A)` and `op(B)` at the given strides; `c` must be the
/// live row-major `m x n` output (read only when `accumulate`), not overlapping them. With
/// [`Unit::Hardware`], [`hardware_available`] must have returned `true`.
pub(crate) unsafe fn product(
    p: &Operands,
    c: *mut f32,
    (scheme, accumulate): (Scheme, bool),
    unit: Unit,
    packs: &mut Packs,
) {
    let l = Layout::of(p.m, p.n, p.k, scheme.parts());
    let left = packs.left.parts(l.left_len());
    pack_left(p, l, left);
    let right = packs.right.parts(l.right_len());
    pack_right(p, l, right);
    let (left, right) = (&*left, &*right);
    let out = Output(c);
    // Tasks are blocks of up to 256 x 256 outputs, so both threads have work at every shape
    // the layers make (a whole column block each left one thread with two of three at width
    // 768).
    let row_blocks = l.rows.div_ceil(BLOCK);
    let tasks = row_blocks * l.cols.div_ceil(BLOCK);
    (0..tasks).into_par_iter().for_each(|t| {
        let (bi, bj) = (t % row_blocks, t / row_blocks);
        let rows = (bi * BLOCK, ((bi + 1) * BLOCK).min(l.rows));
        let cols = (bj * BLOCK, ((bj + 1) * BLOCK).min(l.cols));
        // SAFETY: the caller's guarantees; each task writes its own block.
        unsafe {
            match unit {
                #[cfg(target_arch = "x86_64")]
                Unit::Hardware => {
                    let mut tiles = Amx::configure();
                    output_block(
                        &mut tiles,
                        l,
                        p,
                        (left, right),
                        out,
                        (rows, cols),
                        (scheme, accumulate),
                    );
                }
                #[cfg(not(target_arch = "x86_64"))]
                Unit::Hardware => unreachable!("no tile unit off x86-64"),
                Unit::Software => {
                    let mut tiles = Emulated::new();
                    output_block(
                        &mut tiles,
                        l,
                        p,
                        (left, right),
                        out,
                        (rows, cols),
                        (scheme, accumulate),
                    );
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seeded matrix of `len` values in [-1, 1) with a spread of magnitudes.
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = (s >> 40) as f32 / (1u64 << 24) as f32;
                (2.0 * u - 1.0) * if s & 1 == 0 { 1.0 } else { 1e-3 }
            })
            .collect()
    }

    /// `op(A) op(B)` through [`product`] on `unit` in `scheme`, with `A` stored transposed
    /// when `ta`.
    fn run(
        (unit, scheme): (Unit, Scheme),
        (m, n, k): (usize, usize, usize),
        ta: bool,
        a: &[f32],
        b: &[f32],
        c0: Option<&[f32]>,
    ) -> Vec<f32> {
        let (a_rs, a_cs) = if ta { (1, m as isize) } else { (k as isize, 1) };
        let p = Operands {
            m,
            n,
            k,
            a: a.as_ptr(),
            a_rs,
            a_cs,
            b: b.as_ptr(),
            b_rs: n as isize,
            b_cs: 1,
        };
        let mut c = c0.map_or_else(|| vec![f32::NAN; m * n], <[f32]>::to_vec);
        crate::flush_denormals();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .start_handler(|_| crate::flush_denormals())
            .build()
            .unwrap();
        let mut packs = Packs::default();
        // SAFETY: the operands and output are live vectors of the stated shapes.
        pool.install(|| unsafe {
            product(&p, c.as_mut_ptr(), (scheme, c0.is_some()), unit, &mut packs)
        });
        c
    }

    #[test]
    fn the_parts_sum_to_the_value_within_f32s_last_bits() {
        for x in values(10_000, 7) {
            let [x0, x1, x2] = split(x);
            let sum =
                f64::from(bf16_value(x0)) + f64::from(bf16_value(x1)) + f64::from(bf16_value(x2));
            assert!(
                (sum - f64::from(x)).abs() <= f64::from(x.abs()) * 2f64.powi(-24),
                "{x}"
            );
        }
        assert_eq!(split(f32::MAX)[0], 0x7f7f, "a finite value stays finite");
        assert_eq!(split(f32::INFINITY), [0x7f80, 0, 0]);
        assert!(bf16_value(split(f32::NAN)[0]).is_nan());
    }

    #[test]
    fn six_products_have_f32s_error_against_an_f64_reference() {
        products_err_within(Scheme::Six, 4e-7);
    }

    /// Three products: each term drops `a1 b1` and the parts' remainders, at most `3 2^-18`
    /// of `|a b|`, besides f32's accumulation.
    #[test]
    fn three_products_have_about_16_bits_against_an_f64_reference() {
        products_err_within(Scheme::Three, 3.0 * 2f64.powi(-18) + 4e-7);
    }

    /// Every element of a few products on the emulated tiles errs by at most `bound` of its
    /// terms' `sum |a b|` against an f64 product.
    fn products_err_within(scheme: Scheme, bound: f64) {
        for &(m, n, k, ta) in &[
            (37, 45, 70, false),
            (64, 300, 520, true),
            (33, 31, 600, false),
        ] {
            let (a, b) = (values(m * k, 1), values(k * n, 2));
            let c = run((Unit::Software, scheme), (m, n, k), ta, &a, &b, None);
            for i in 0..m {
                for j in 0..n {
                    let (mut exact, mut size) = (0f64, 0f64);
                    for q in 0..k {
                        let av = if ta { a[q * m + i] } else { a[i * k + q] };
                        let t = f64::from(av) * f64::from(b[q * n + j]);
                        exact += t;
                        size += t.abs();
                    }
                    let err = (f64::from(c[i * n + j]) - exact).abs();
                    assert!(
                        err <= size * bound,
                        "{scheme:?} {m}x{n}x{k} ({i}, {j}): {err} of {size}"
                    );
                }
            }
        }
    }

    #[test]
    fn accumulating_adds_to_the_output() {
        let (m, n, k) = (40, 70, 90);
        let (a, b, c0) = (values(m * k, 3), values(k * n, 4), values(m * n, 5));
        let fresh = run(
            (Unit::Software, Scheme::Six),
            (m, n, k),
            false,
            &a,
            &b,
            None,
        );
        let added = run(
            (Unit::Software, Scheme::Six),
            (m, n, k),
            false,
            &a,
            &b,
            Some(&c0),
        );
        for ((&f, &s), &c) in fresh.iter().zip(&added).zip(&c0) {
            assert!((s - (f + c)).abs() <= 1e-5 * (1.0 + c.abs()));
        }
    }

    #[test]
    fn the_tile_unit_gives_the_emulations_bits() {
        if !hardware_available() {
            eprintln!("no AMX here: the hardware half of this test is skipped");
            return;
        }
        for &(m, n, k, ta, acc, scheme) in &[
            (32, 32, 32, false, false, Scheme::Six),
            (70, 300, 600, false, true, Scheme::Six),
            (100, 257, 1100, true, false, Scheme::Six),
            (70, 300, 600, false, true, Scheme::Three),
            (100, 257, 1100, true, false, Scheme::Three),
        ] {
            let (a, b, c0) = (values(m * k, 11), values(k * n, 12), values(m * n, 13));
            let c0 = acc.then_some(&c0[..]);
            let hw = run((Unit::Hardware, scheme), (m, n, k), ta, &a, &b, c0);
            let sw = run((Unit::Software, scheme), (m, n, k), ta, &a, &b, c0);
            let same = hw
                .iter()
                .zip(&sw)
                .filter(|(h, s)| h.to_bits() == s.to_bits())
                .count();
            assert_eq!(
                same,
                m * n,
                "{scheme:?} {m}x{n}x{k}: {same} of {} elements equal",
                m * n
            );
        }
    }
}
