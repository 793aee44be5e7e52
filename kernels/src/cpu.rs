//! The CPU backend: `gemm` for matrix products (or, under `--precision bf16x6`, the AMX tiles of
//! [`crate::split_bf16`] for the large ones; where `PIPE_CBLAS` names a CBLAS library,
//! [`crate::cblas`] for the f32 ones), plain loops (auto-vectorised) for the rest, a
//! private rayon pool for threads, and a block layout that depends only on shapes. The loops
//! that compute more than they move (activations, LayerNorm, the optimizer updates, the
//! finiteness scan), and the row loops against a vector per column ([`crate::rowwise`]: bias,
//! bias gradients, the layer norm's parameter gradients, `axpy`), run compiled for the
//! machine's widest vectors ([`crate::vector`]), with the same arithmetic on every path. The
//! optimizer updates also note whether what they read and wrote is finite, so the finiteness
//! guard needs no pass of its own ([`UpdateSeen`]).

use std::borrow::Cow;
use std::collections::VecDeque;
use std::mem::MaybeUninit;
use std::ops::Range;

use crate::scratch::SCRATCH;
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use crate::backend::{
    Activation, AdamStep, AttentionShape, Backend, DelayCompensation, IGNORED_LABEL, LionStep,
    LossStats, Precision, SgdStep, Trans, UpdateSeen, counted_labels, exponent_field, lion_sign,
};
use crate::cblas::Cblas;
use crate::rowwise::{AddBias, Axpy, ColumnSums, NormParamGrads};
use crate::split_bf16;
use crate::{Device, KernelError, Result, Tensor};

/// The attention tasks of a batch: `(sequence, heads)`, one per sequence while the sequences
/// alone give every thread one, else each sequence's heads in as many groups as that needs.
/// Each task writes only its heads' columns, so the bits do not depend on the split.
fn attention_tasks(threads: usize, shape: AttentionShape) -> Vec<(usize, Range<usize>)> {
    let heads = shape.heads.max(1);
    let groups = if shape.batch >= threads {
        1
    } else {
        threads.div_ceil(shape.batch.max(1)).min(heads)
    };
    let per = heads.div_ceil(groups);
    (0..shape.batch)
        .flat_map(|b| {
            (0..heads)
                .step_by(per)
                .map(move |h0| (b, h0..(h0 + per).min(heads)))
        })
        .collect()
}

/// The host values of an attention call's document starts, checked
/// ([`crate::sequence::check_documents`]).
fn host_documents<'a>(
    op: &'static str,
    documents: Option<&'a Tensor>,
    shape: AttentionShape,
) -> Result<Option<&'a [f32]>> {
    let Some(d) = documents else {
        return Ok(None);
    };
    let starts = d.host()?;
    crate::sequence::check_documents(op, shape, starts)?;
    Ok(Some(starts))
}

/// Elementwise work below this many elements runs on the calling thread.
const PAR_MIN: usize = 1 << 16;
/// Elementwise chunk handed to one task.
const PAR_CHUNK: usize = 1 << 14;
/// Rows from which a product with a small transposed right operand reads a row-major copy.
const TALL_ROWS: usize = 1024;
/// Columns of a per-column sum (`sum_rows`, LayerNorm's parameter gradients) handed to one
/// task: each task sums its columns over every row in order, so the split changes no bit.
const SUM_COLS: usize = 64;
/// Rows per partial sum of `sum_rows` when there are more rows than this.
const SUM_ROWS_CHUNK: usize = 256;
/// Products below this many multiply-adds run as one `gemm` call on one thread.
const GEMM_SPLIT_MIN: usize = 1 << 21;

/// Products with fewer output rows than this are computed transposed: `gemm`'s register tiles
/// are 64 rows tall, so 32 rows waste half of every tile (measured on this machine:
/// 32x1024x1024 at 30-43 GFLOP/s one way, 75-81 transposed with row-major operands).
const PACK_BELOW_ROWS: usize = 64;
/// ... and only when `op(b)` has at least this many elements (a 1024x1024 weight: smaller
/// operands have short enough rows that reading them in place is as fast, and packing them
/// costs more than it saves).
const PACK_MIN: usize = 1 << 20;
/// ... or, when `op(b)` is a stored matrix read transposed (so nothing needs packing), at least
/// this many elements (the backward `dX = dY W^T`, where `gemm` reads `W^T` column by column: at
/// 8x256x256, 22 GFLOP/s in place against about 80 transposed).
const TRANSPOSED_MIN: usize = 1 << 14;
/// The shortest side (rows, columns or inner length) of a product that `--precision bf16x6`
/// computes on the tiles: below it, packing the operands' parts and moving the output's tiles
/// cost more than the tiles save (GPT-2's products at width 128, 2 threads: f32 at 123-234
/// GFLOP/s, the tiles at 52-241, those with a side of 128 the slowest; at width 512 the tiles
/// take the step's products in 0.85 of f32's time; `kernels/examples/step_products.rs`).
const TILE_MIN_SIDE: usize = 256;
/// Packed operands kept per backend (least recently used dropped first) ...
const PACK_CACHE: usize = 64;
/// ... and their bytes at most: a pipeline stage's weights over the versions it stashes (a
/// quarter of `mlp-784-1024x16-10`, 16 MiB, four times).
const PACK_BYTES: usize = 64 << 20;

/// A transposed copy of a right operand, keyed by its content stamp.
struct Packed {
    stamp: u64,
    data: Arc<Vec<f32>>,
}

/// The always-available CPU backend.
///
/// Owns a private thread pool of `threads` workers, so two backends in one process (one per
/// pipeline stage, say) do not compete for one global pool.
pub struct CpuBackend {
    threads: usize,
    pool: rayon::ThreadPool,
    /// Packed GEMM operands keyed by content stamp: a weight matrix is packed once per version
    /// and reused by every microbatch until it changes.
    packs: Mutex<VecDeque<Packed>>,
    /// Where the products of `--precision bf16x6` or `bf16x3` run and which sum of part
    /// products they make (`None`: f32 products through `gemm`), and the scratch their packed
    /// operands reuse.
    tiles: Option<(
        split_bf16::Unit,
        split_bf16::Scheme,
        Mutex<split_bf16::Packs>,
    )>,
    /// The CBLAS library that computes the f32 products instead of `gemm`, where
    /// `PIPE_CBLAS` names one ([`crate::cblas`]).
    cblas: Option<Arc<Cblas>>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("threads", &self.threads)
            .finish()
    }
}

impl CpuBackend {
    /// A backend computing on `threads` threads (0 means one per available core). It sets
    /// flush-to-zero and denormals-are-zero ([`crate::flush_denormals`]) on the calling thread,
    /// where one-thread kernels run, and on its pool's threads: compute with a backend on the
    /// thread that made it, as every launcher does.
    ///
    /// Its f32 matrix products go to the CBLAS library `PIPE_CBLAS` names, where it names one
    /// ([`crate::cblas_library`]), else to `gemm`.
    ///
    /// # Errors
    /// [`KernelError::ThreadPool`] when the threads cannot be started, [`KernelError::Cblas`]
    /// when `PIPE_CBLAS` names a library that cannot be used.
    pub fn new(threads: usize) -> Result<Self> {
        let mut backend = Self::on_gemm(threads)?;
        backend.cblas = crate::cblas::configured()?;
        Ok(backend)
    }

    /// A backend as [`CpuBackend::new`] makes, its f32 products through `gemm` whatever the
    /// environment says.
    fn on_gemm(threads: usize) -> Result<Self> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        // Subnormals are flushed on every thread that computes: this one (one-thread kernels
        // run on the caller) and the pool's.
        crate::flush_denormals();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("pipe-cpu-{i}"))
            .start_handler(|_| crate::flush_denormals())
            .build()
            .map_err(|e| KernelError::ThreadPool {
                threads,
                reason: e.to_string(),
            })?;
        Ok(Self {
            threads,
            pool,
            packs: Mutex::new(VecDeque::new()),
            tiles: None,
            cblas: None,
        })
    }

    /// A backend as [`CpuBackend::new`] makes, its matrix products in `precision`: f32 through
    /// `gemm`, or [`Precision::Bf16x6`] or [`Precision::Bf16x3`] on the CPU's AMX tiles
    /// (products whose rows, columns and inner length are all at least 256, `TILE_MIN_SIDE`;
    /// others stay f32, a rule of the shape alone).
    ///
    /// # Errors
    /// [`KernelError::NoTileUnit`] for bf16x6 or bf16x3 where the CPU or OS offers no AMX
    /// tiles, [`KernelError::Cuda`] for a precision only CUDA offers, and
    /// [`CpuBackend::new`]'s.
    pub fn with_precision(threads: usize, precision: Precision) -> Result<Self> {
        match (precision, split_bf16::Scheme::of(precision)) {
            (Precision::F32, _) => Self::new(threads),
            (_, Some(scheme)) if split_bf16::hardware_available() => {
                Self::with_tiles(threads, split_bf16::Unit::Hardware, scheme)
            }
            (_, Some(_)) => Err(KernelError::NoTileUnit { precision }),
            (_, None) => Err(KernelError::Cuda {
                op: "open",
                detail: format!("--precision {precision} needs --backend cuda"),
            }),
        }
    }

    /// A backend in a tile precision (bf16x6 or bf16x3) whose tile arithmetic is emulated in
    /// scalar code, with the same bits as the AMX tiles, on any CPU: for tests of those
    /// precisions where AMX is absent (it is tens of times slower than the tiles). Other
    /// precisions open as [`CpuBackend::with_precision`] opens them.
    ///
    /// # Errors
    /// As [`CpuBackend::with_precision`] for the other precisions, else [`CpuBackend::new`]'s.
    #[doc(hidden)]
    pub fn with_emulated_tiles(threads: usize, precision: Precision) -> Result<Self> {
        match split_bf16::Scheme::of(precision) {
            Some(scheme) => Self::with_tiles(threads, split_bf16::Unit::Software, scheme),
            None => Self::with_precision(threads, precision),
        }
    }

    fn with_tiles(
        threads: usize,
        unit: split_bf16::Unit,
        scheme: split_bf16::Scheme,
    ) -> Result<Self> {
        let mut backend = Self::new(threads)?;
        backend.tiles = Some((unit, scheme, Mutex::new(split_bf16::Packs::default())));
        Ok(backend)
    }

    /// The precision of this backend's matrix products.
    pub fn precision(&self) -> Precision {
        self.tiles
            .as_ref()
            .map_or(Precision::F32, |(_, scheme, _)| scheme.precision())
    }

    /// Computes `C (m x n) = op(a) op(b)` (or adds it) on the tiles, where this backend has
    /// them and the product is large enough; `false` where the f32 route must compute it.
    #[allow(clippy::too_many_arguments)]
    fn tile_product(
        &self,
        a: &Tensor,
        (a_rs, a_cs): (isize, isize),
        b: &Tensor,
        (b_rs, b_cs): (isize, isize),
        (m, n, k): (usize, usize, usize),
        c: &mut Tensor,
        accumulate: bool,
    ) -> Result<bool> {
        let Some((unit, scheme, packs)) = &self.tiles else {
            return Ok(false);
        };
        if m.min(n).min(k) < TILE_MIN_SIDE {
            return Ok(false);
        }
        let operands = split_bf16::Operands {
            m,
            n,
            k,
            a: a.host()?.as_ptr(),
            a_rs,
            a_cs,
            b: b.host()?.as_ptr(),
            b_rs,
            b_cs,
        };
        let mut held = packs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let packs: &mut split_bf16::Packs = &mut held;
        let mut run = |out: *mut f32| {
            let out = SendPtr(out);
            // SAFETY: the operands are live tensors of the checked shapes and strides, `out` is
            // the m x n output (a distinct tensor: `c` is borrowed mutably), and a `Hardware`
            // unit exists only where `hardware_available` said so.
            self.pool.install(|| unsafe {
                split_bf16::product(&operands, out.get(), (*scheme, accumulate), *unit, packs);
            });
        };
        if accumulate {
            run(c.host_mut()?.as_mut_ptr());
        } else {
            // SAFETY: `product` writes every element of the m x n output without reading it
            // when not accumulating.
            unsafe { c.write_host_with(&[m, n], |out| run(out.as_mut_ptr().cast())) };
        }
        Ok(true)
    }

    /// `b` (`k x n`, row-major) transposed into a row-major `n x k` copy, from the cache when
    /// `b`'s contents were transposed before (a weight matrix: once per version).
    fn transposed(&self, b: &Tensor, k: usize, n: usize) -> Result<Arc<Vec<f32>>> {
        let key = b.stamp();
        if let Ok(mut cache) = self.packs.lock() {
            if let Some(i) = cache.iter().position(|p| p.stamp == key) {
                if let Some(hit) = cache.remove(i) {
                    let data = Arc::clone(&hit.data);
                    cache.push_back(hit);
                    return Ok(data);
                }
            }
        }
        // Room is made first, and the buffer of a copy dropped for it is reused when nobody
        // holds it: a fresh multi-megabyte buffer costs a page fault and a cleared page per
        // 4 KiB on first touch (9% of a 4-stage pipeline's cycles at microbatch 32, where every
        // update makes new weights to transpose).
        let need = n * k * std::mem::size_of::<f32>();
        let mut recycled: Option<Vec<f32>> = None;
        if let Ok(mut cache) = self.packs.lock() {
            let mut bytes: usize = cache.iter().map(|p| p.data.len() * 4).sum();
            while !cache.is_empty() && (cache.len() >= PACK_CACHE || bytes + need > PACK_BYTES) {
                let Some(old) = cache.pop_front() else { break };
                bytes -= old.data.len() * 4;
                if let Ok(buf) = Arc::try_unwrap(old.data) {
                    if recycled
                        .as_ref()
                        .is_none_or(|r| r.capacity() < buf.capacity())
                    {
                        recycled = Some(buf);
                    }
                }
            }
        }
        let mut data = recycled.unwrap_or_default();
        data.resize(n * k, 0.0);
        self.transpose_on_pool(b.host()?, k, n, &mut data);
        let data = Arc::new(data);
        if let Ok(mut cache) = self.packs.lock() {
            cache.push_back(Packed {
                stamp: key,
                data: Arc::clone(&data),
            });
        }
        Ok(data)
    }

    /// `src` (`rows x cols`, row-major) transposed into `dst` (`cols x rows`): bands of 64
    /// output rows, one task each on the pool, each filled in 8 x 8 tiles (a tile's 8 source
    /// rows stay in L1 however far apart they are, where 32 x 32 tiles of rows 4 KiB apart
    /// share one L1 set and evict each other). On one thread, the `transpose` crate's
    /// recursive tiling, which is faster there (a 1024 x 1024 weight in about 1.5 ms).
    fn transpose_on_pool(&self, src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
        const TILE: usize = 8;
        const BAND: usize = 64;
        if self.threads <= 1 || src.len() < PAR_MIN {
            transpose::transpose(src, dst, cols, rows);
            return;
        }
        let band = |(b, out): (usize, &mut [f32])| {
            let j0 = b * BAND;
            let j1 = (j0 + BAND).min(cols);
            for i0 in (0..rows).step_by(TILE) {
                for jt in (j0..j1).step_by(TILE) {
                    let jt1 = (jt + TILE).min(j1);
                    for i in i0..(i0 + TILE).min(rows) {
                        let row = &src[i * cols + jt..i * cols + jt1];
                        for (dj, &v) in row.iter().enumerate() {
                            out[(jt - j0 + dj) * rows + i] = v;
                        }
                    }
                }
            }
        };
        self.pool.install(|| {
            dst[..rows * cols]
                .par_chunks_mut(BAND * rows)
                .enumerate()
                .for_each(band);
        });
    }

    /// `C = op(a) op(b)` computed as `C^T = op(b)^T op(a)^T` with both operands row-major:
    /// `op(b)^T` is `b` itself when transposed, else a cached transposed copy; `op(a)^T` is `a`
    /// itself when transposed, else a transposed copy in a per-thread scratch, made on the pool.
    /// `C^T` is computed in row blocks of `width` (one task each) into a second scratch. With
    /// more than one thread, each task then moves its block into its columns of `C`, so that
    /// both transposes run on the pool (on the calling thread alone they were 0.45 ms of the
    /// single-worker MLP's 3.8 ms `dX = dY W^T`, 256x1024x1024, while the other thread
    /// waited); on one thread, the whole `C^T` is moved at the end. Either way each value of
    /// `C` is the same one product's value (or `C`'s plus it, once), so the bits are the same.
    /// Used where `gemm` would read a short or a column-major right operand.
    #[allow(clippy::too_many_arguments)]
    fn matmul_transposed(
        &self,
        a: &Tensor,
        ta: Trans,
        b: &Tensor,
        tb: Trans,
        c: &mut Tensor,
        accumulate: bool,
        width: usize,
    ) -> Result<()> {
        let (m, k, _, _) = strides(a, ta);
        let n = c.cols();
        let owned;
        let lhs = match tb {
            Trans::Yes => b.host()?.as_ptr() as usize,
            Trans::No => {
                owned = self.transposed(b, k, n)?;
                owned.as_ptr() as usize
            }
        };
        let mut held_a = SCRATCH_A.with(|cell| cell.take());
        let rhs = match ta {
            Trans::Yes => a.host()?.as_ptr() as usize,
            Trans::No => {
                held_a.resize(m * k, 0.0);
                self.transpose_on_pool(a.host()?, m, k, &mut held_a[..m * k]);
                held_a.as_ptr() as usize
            }
        };
        let mut held = SCRATCH.with(|cell| cell.take());
        if held.len() < n * m {
            held = vec![0.0f32; n * m];
        }
        let scratch = SendPtr(held[..n * m].as_mut_ptr());
        let out = c.host_mut()?;
        let out_ptr = SendPtr(out.as_mut_ptr());
        // On one thread the whole `C^T` is moved at the end, where the `transpose` crate does
        // it faster than `columns_from_rows` (0.22 against 0.30 ms for 1024 x 256).
        let per_block = self.threads > 1;
        let one = |i: usize| {
            let j0 = i * width;
            let rows = width.min(n - j0);
            // SAFETY: lhs holds n x k values and rhs k x m (both row-major), the scratch n x m
            // and `C` m x n; task i alone writes the scratch's rows j0..j0+rows and `C`'s
            // columns j0..j0+rows.
            unsafe {
                let block = scratch.get().add(j0 * m);
                gemm::gemm(
                    rows,
                    m,
                    k,
                    block,
                    1,
                    m as isize,
                    false,
                    (lhs as *const f32).add(j0 * k),
                    1,
                    k as isize,
                    rhs as *const f32,
                    1,
                    m as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
                if per_block {
                    let block = std::slice::from_raw_parts(block, rows * m);
                    columns_from_rows(block, (rows, m), (out_ptr.get().add(j0), n), accumulate);
                }
            }
        };
        self.for_each_block(n.div_ceil(width), one);
        if !per_block {
            let whole = &held[..n * m];
            if accumulate {
                // SAFETY: `out` is `C`, m rows of n values.
                unsafe { columns_from_rows(whole, (n, m), (out.as_mut_ptr(), n), true) };
            } else {
                transpose::transpose(whole, out, m, n);
            }
        }
        SCRATCH.with(|cell| cell.set(held));
        SCRATCH_A.with(|cell| cell.set(held_a));
        Ok(())
    }

    /// Runs `f(i)` for every block index `i < count`: on the pool when it has more than one
    /// thread, else in order on the calling thread. Entering a one-thread pool would hand every
    /// kernel to another thread and back (a few microseconds each), which small pipeline
    /// microbatches cannot afford; blocks write disjoint outputs, so the results are the same.
    fn for_each_block(&self, count: usize, f: impl Fn(usize) + Sync + Send) {
        if self.threads > 1 && count > 1 {
            self.pool.install(|| (0..count).into_par_iter().for_each(f));
        } else {
            (0..count).for_each(f);
        }
    }

    fn par_map_inplace(&self, data: &mut [f32], f: impl Fn(&mut [f32]) + Sync + Send) {
        if self.threads > 1 && data.len() >= PAR_MIN {
            self.pool
                .install(|| data.par_chunks_mut(PAR_CHUNK).for_each(&f));
        } else {
            f(data);
        }
    }

    /// Runs `f(first_column, block)` on [`SUM_COLS`]-column blocks of the per-column
    /// accumulator `out`, on the pool when the reduction reads `elements` values or more.
    fn column_blocks(
        &self,
        out: &mut [f32],
        elements: usize,
        f: impl Fn(usize, &mut [f32]) + Sync,
    ) {
        if self.threads > 1 && elements >= PAR_MIN && out.len() > SUM_COLS {
            self.pool.install(|| {
                out.par_chunks_mut(SUM_COLS)
                    .enumerate()
                    .for_each(|(b, block)| f(b * SUM_COLS, block));
            });
        } else {
            f(0, out);
        }
    }

    /// Chunk length for the fused optimizer updates: parallel chunks for large tensors, one chunk
    /// on the calling pool thread otherwise.
    fn update_chunk(&self, n: usize) -> usize {
        if self.threads > 1 && n >= PAR_MIN {
            PAR_CHUNK
        } else {
            n.max(1)
        }
    }

    /// The largest exponent fields an optimizer update's chunks saw, reduced on the pool
    /// ([`UpdateSeen::from_tops`]): `chunks` yields each chunk's, of the gradient and of the
    /// updated parameter.
    fn largest_tops(&self, chunks: impl ParallelIterator<Item = (u32, u32)>) -> (u32, u32) {
        self.pool
            .install(|| chunks.reduce(|| (0, 0), |a, b| (a.0.max(b.0), a.1.max(b.1))))
    }

    fn par_zip<T: Send>(
        &self,
        out: &mut [T],
        a: &[f32],
        b: &[f32],
        f: impl Fn(&mut [T], &[f32], &[f32]) + Sync + Send,
    ) {
        if self.threads > 1 && out.len() >= PAR_MIN {
            self.pool.install(|| {
                out.par_chunks_mut(PAR_CHUNK)
                    .zip(a.par_chunks(PAR_CHUNK))
                    .zip(b.par_chunks(PAR_CHUNK))
                    .for_each(|((o, a), b)| f(o, a, b));
            });
        } else {
            f(out, a, b);
        }
    }
}

/// One product for [`CpuBackend::run_plan`]: `op(a)` (`m x k`) and `op(b)` (`k x n`) as base
/// addresses and (row, column) strides, and whether the output is added to.
struct Operands {
    m: usize,
    n: usize,
    k: usize,
    a: usize,
    a_rs: isize,
    a_cs: isize,
    b: usize,
    b_rs: isize,
    b_cs: isize,
    accumulate: bool,
}

/// One task of the layer norm's forward: output, input, mean and rstd rows.
type LayerNormChunk<'a> = (((&'a mut [f32], &'a [f32]), &'a mut [f32]), &'a mut [f32]);
/// One task of the layer norm's input gradient: dx, x, dy, mean and rstd rows.
type LayerNormBackChunk<'a> = (
    (((&'a mut [f32], &'a [f32]), &'a [f32]), &'a [f32]),
    &'a [f32],
);

impl CpuBackend {
    /// Runs one product's `gemm` calls over the blocks of `plan`, writing to `c` (row-major,
    /// `m x n`): the whole product split by `gemm` itself, or column or row blocks, one task
    /// each.
    fn run_plan(&self, plan: Blocks, p: &Operands, c: SendPtr) {
        let (m, n) = (p.m, p.n);
        // One block: rows r0..r0+mr, cols c0..c0+nc of the output.
        let run = |r0: usize, mr: usize, c0: usize, nc: usize, par: gemm::Parallelism| {
            // SAFETY: the pointers come from live tensors whose shapes the caller checked; the
            // offsets stay inside them (r0 + mr <= m, c0 + nc <= n), and blocks handed to
            // different tasks write disjoint output elements.
            unsafe {
                gemm::gemm(
                    mr,
                    nc,
                    p.k,
                    c.get().add(r0 * n + c0),
                    1,
                    n as isize,
                    p.accumulate,
                    (p.a as *const f32).offset(r0 as isize * p.a_rs),
                    p.a_cs,
                    p.a_rs,
                    (p.b as *const f32).offset(c0 as isize * p.b_cs),
                    p.b_cs,
                    p.b_rs,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    par,
                );
            }
        };
        match plan {
            Blocks::Whole => {
                if self.threads > 1 && m * n * p.k >= GEMM_SPLIT_MIN {
                    let par = gemm::Parallelism::Rayon(self.threads);
                    self.pool.install(|| run(0, m, 0, n, par));
                } else {
                    run(0, m, 0, n, gemm::Parallelism::None);
                }
            }
            Blocks::Cols(w) => {
                self.for_each_block(n.div_ceil(w), |i| {
                    let c0 = i * w;
                    run(0, m, c0, w.min(n - c0), gemm::Parallelism::None);
                });
            }
            Blocks::Rows(h) => {
                self.for_each_block(m.div_ceil(h), |i| {
                    let r0 = i * h;
                    run(r0, h.min(m - r0), 0, n, gemm::Parallelism::None);
                });
            }
        }
    }

    /// Computes `p` into `c` with the CBLAS library: one one-thread call per block of
    /// [`split_plan`] (blocks of the shape alone, as for `gemm`), one task each on the pool.
    fn cblas_product(&self, cblas: &Cblas, p: &Operands, c: &mut Tensor) -> Result<()> {
        let (m, n, k) = (p.m, p.n, p.k);
        let stored = crate::cblas::stored(m, k, p.a_rs, p.a_cs)
            .zip(crate::cblas::stored(k, n, p.b_rs, p.b_cs))
            .filter(|_| crate::cblas::fits(m, n, k));
        let Some((a_stored, b_stored)) = stored else {
            return Err(KernelError::Shape {
                op: "matmul",
                detail: format!("{m}x{k}x{n} is past the CBLAS library's 32-bit sizes"),
            });
        };
        let run = |out: SendPtr, r0: usize, mr: usize, c0: usize, nc: usize| {
            let call = crate::cblas::Call {
                m: mr,
                n: nc,
                k,
                a: (p.a as *const f32).wrapping_offset(r0 as isize * p.a_rs),
                a_stored,
                b: (p.b as *const f32).wrapping_offset(c0 as isize * p.b_cs),
                b_stored,
                c: out.get().wrapping_add(r0 * n + c0),
                ldc: n,
                accumulate: p.accumulate,
            };
            // SAFETY: the block lies inside the live operands and output (r0 + mr <= m,
            // c0 + nc <= n), blocks write disjoint parts of the output, and the sizes fit.
            unsafe { cblas.product(&call) }
        };
        let blocks = |out: SendPtr| match split_plan(m, n, k) {
            Blocks::Whole => run(out, 0, m, 0, n),
            Blocks::Cols(w) => self.for_each_block(n.div_ceil(w), |i| {
                run(out, 0, m, i * w, w.min(n - i * w));
            }),
            Blocks::Rows(h) => self.for_each_block(m.div_ceil(h), |i| {
                run(out, i * h, h.min(m - i * h), 0, n);
            }),
        };
        if p.accumulate {
            blocks(SendPtr(c.host_mut()?.as_mut_ptr()));
        } else {
            // SAFETY: the blocks cover the m x n output and CBLAS writes every element of
            // each without reading it (beta 0).
            unsafe { c.write_host_with(&[m, n], |out| blocks(SendPtr(out.as_mut_ptr().cast()))) };
        }
        Ok(())
    }

    /// Runs `body` on every row chunk of `tasks` on the pool (whose threads flush subnormals
    /// like the caller's). Each row is one chunk's alone, so the split never changes a result.
    fn run_rows<I>(&self, tasks: I, body: impl Fn(I::Item) + Sync + Send)
    where
        I: IndexedParallelIterator,
    {
        self.pool.install(|| tasks.for_each(body));
    }
}

thread_local! {
    /// The calling thread's scratch for a left operand copied transposed (row-major `op(a)^T`).
    static SCRATCH_A: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A raw output pointer that may cross threads: each task writes a disjoint block.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: only used to hand disjoint output blocks of one live buffer to pool tasks that all end
// before the buffer's borrow does.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer. A method (not a field access) so closures capture the whole `SendPtr`.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// The `rows x cols` row-major `block` moved (or added, with `accumulate`) transposed into
/// the `cols x rows` rectangle at `dst` whose rows are `stride` apart: `dst[i][j] =
/// block[j][i]`. In 16-column strips: the 16 block rows a strip reads stay in L1 while every
/// destination row takes its 16 values from them.
///
/// # Safety
/// `dst` must address `cols` rows of `rows` writable values, `stride` apart, that nobody else
/// reads or writes meanwhile.
unsafe fn columns_from_rows(
    block: &[f32],
    (rows, cols): (usize, usize),
    (dst, stride): (*mut f32, usize),
    accumulate: bool,
) {
    for j0 in (0..rows).step_by(16) {
        let j1 = (j0 + 16).min(rows);
        for i in 0..cols {
            // SAFETY: row i of the rectangle, columns j0..j1 < rows (the caller's promise).
            let row = unsafe { std::slice::from_raw_parts_mut(dst.add(i * stride + j0), j1 - j0) };
            let src = block[j0 * cols + i..].iter().step_by(cols);
            if accumulate {
                row.iter_mut().zip(src).for_each(|(v, &x)| *v += x);
            } else {
                row.iter_mut().zip(src).for_each(|(v, &x)| *v = x);
            }
        }
    }
}

/// How a product is cut into independent output blocks. Chosen from the shape alone, so the
/// arithmetic (and so the bits) never depends on the thread count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Blocks {
    /// One call.
    Whole,
    /// Column blocks of this width (last one shorter).
    Cols(usize),
    /// Row blocks of this height (last one shorter).
    Rows(usize),
}

fn block_plan(m: usize, n: usize, k: usize, ta: Trans) -> Blocks {
    // Small products run whole on one thread; products over thousands of token rows (`m`, or
    // `k` in a weight gradient `X^T dY`, where `m` is the layer's input width) run whole with
    // `gemm` splitting the work itself: it packs each operand once for all its threads, where
    // every output block here packs the whole left operand again (at 2,048 rows, 4-16 MiB per
    // block). `gemm` never splits the inner dimension, so its split does not change a bit.
    let token_rows = match ta {
        Trans::No => m,
        Trans::Yes => k,
    };
    if token_rows >= TALL_ROWS {
        return Blocks::Whole;
    }
    match split_plan(m, n, k) {
        // A weight gradient `X^T dY` over few token rows splits by rows of its output: each
        // block packs its own rows of the transposed left operand and the row-major right one,
        // where a column block packs the whole transposed operand again. 3-4% faster at
        // 64-512 rows and widths 784-1024, the same bits (`gemm` never splits `k`;
        // `kernels/examples/tn_splits.rs`).
        Blocks::Cols(_) if ta == Trans::Yes && m >= 256 => Blocks::Rows(block_len(m)),
        plan => plan,
    }
}

/// The length of each of the 2 to 8 blocks (about 512 long, a multiple of 16) that a split
/// cuts `len` rows or columns into.
fn block_len(len: usize) -> usize {
    len.div_ceil((len / 512).clamp(2, 8)).next_multiple_of(16)
}

/// The output blocks of a product split here: one block when it is small, else column blocks
/// (row blocks for a narrow output) of 512 columns or rows or so, from 2 to 8 of them.
fn split_plan(m: usize, n: usize, k: usize) -> Blocks {
    if m.saturating_mul(n).saturating_mul(k) < GEMM_SPLIT_MIN {
        return Blocks::Whole;
    }
    if n >= 256 {
        Blocks::Cols(block_len(n))
    } else if m >= 256 {
        Blocks::Rows(block_len(m))
    } else {
        Blocks::Whole
    }
}

/// Strides of a row-major `rows x cols` operand used as stored or transposed: (row, col) strides
/// of op(x).
fn strides(x: &Tensor, t: Trans) -> (usize, usize, isize, isize) {
    let (r, c) = (x.rows(), x.cols());
    match t {
        Trans::No => (r, c, c as isize, 1),
        Trans::Yes => (c, r, 1, c as isize),
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn run_within(&self, f: &mut (dyn FnMut() + Send)) -> Result<()> {
        if self.threads > 1 {
            self.pool.install(f);
        } else {
            f();
        }
        Ok(())
    }

    fn threads(&self) -> usize {
        self.threads
    }

    fn device(&self) -> Device {
        Device::Host
    }

    fn place(&self, t: Tensor) -> Result<Tensor> {
        t.host()?;
        Ok(t)
    }

    fn place_ids(&self, t: Tensor<u32>) -> Result<Tensor<u32>> {
        t.host()?;
        Ok(t)
    }

    fn read<'a>(&self, t: &'a Tensor) -> Result<Cow<'a, [f32]>> {
        Ok(Cow::Borrowed(t.host()?))
    }

    fn write(&self, src: &[f32], t: &mut Tensor) -> Result<()> {
        crate::check::write(src.len(), t)?;
        t.host_mut()?.copy_from_slice(src);
        Ok(())
    }

    fn copy(&self, src: &Tensor, dst: &mut Tensor) -> Result<()> {
        let from = src.host()?;
        dst.resize_host(src.shape()).copy_from_slice(from);
        Ok(())
    }

    fn fill(&self, value: f32, x: &mut Tensor) -> Result<()> {
        x.host_mut()?.fill(value);
        Ok(())
    }

    fn mul(&self, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
        crate::check::same_len("mul", (a, b), ("a", "b"))?;
        let (xa, xb) = (a.host()?, b.host()?);
        let f = |o: &mut [f32], a: &[f32], b: &[f32]| {
            o.iter_mut()
                .zip(a)
                .zip(b)
                .for_each(|((o, &a), &b)| *o = a * b);
        };
        self.par_zip(out.resize_host(a.shape()), xa, xb, f);
        Ok(())
    }

    fn matmul(
        &self,
        a: &Tensor,
        ta: Trans,
        b: &Tensor,
        tb: Trans,
        c: &mut Tensor,
        accumulate: bool,
    ) -> Result<()> {
        crate::check::matmul((a, ta), (b, tb), c, accumulate)?;
        let (m, k, a_rs, a_cs) = strides(a, ta);
        let (_, n, b_rs, b_cs) = strides(b, tb);
        if m == 0 || n == 0 || k == 0 {
            if !accumulate {
                c.resize_host(&[m, n]).fill(0.0);
            }
            return Ok(());
        }
        let shape = (m, n, k);
        if self.tile_product(a, (a_rs, a_cs), b, (b_rs, b_cs), shape, c, accumulate)? {
            return Ok(());
        }
        if let Some(cblas) = &self.cblas {
            let operands = Operands {
                m,
                n,
                k,
                a: a.host()?.as_ptr() as usize,
                a_rs,
                a_cs,
                b: b.host()?.as_ptr() as usize,
                b_rs,
                b_cs,
                accumulate,
            };
            return self.cblas_product(cblas, &operands, c);
        }
        // A tall product whose small right operand is stored transposed (a transformer's
        // `dX = dY W^T` over thousands of token rows) reads a row-major copy of `op(b)`, cached
        // per weight version: a few hundred KiB once, where `gemm` reads the transposed operand
        // in place at about two thirds of its rate and the transposed route below would move
        // the tall output through a scratch twice.
        let tall_transposed = tb == Trans::Yes && m >= TALL_ROWS;
        let held_b;
        let (bp, b_rs, b_cs) = if tall_transposed {
            held_b = self.transposed(b, n, k)?;
            (held_b.as_ptr() as usize, n as isize, 1)
        } else {
            (b.host()?.as_ptr() as usize, b_rs, b_cs)
        };
        let min = match tb {
            Trans::Yes => TRANSPOSED_MIN,
            Trans::No => PACK_MIN,
        };
        // A large stored matrix read transposed (the backward `dX = dY W^T`) also goes this way
        // at any row count: `gemm` reads a right operand that is not row-major at about two
        // thirds of its rate (256x1024x1024, 2 threads: 4.6 ms against 2.9 ms this way;
        // `kernels/examples/dx_layouts.rs`), while here it is the row-major left operand.
        // (At 64 rows the same holds from `TRANSPOSED_MIN` on: 64x256x256 at 99 against 65
        // GFLOP/s on one thread; at 256x256x256 with 2 threads reading in place is faster.)
        let wide_transposed = tb == Trans::Yes
            && !tall_transposed
            && (k * n >= PACK_MIN || (m <= PACK_BELOW_ROWS && k * n >= TRANSPOSED_MIN));
        if (m < PACK_BELOW_ROWS && k * n >= min) || wide_transposed {
            // `C^T`'s row blocks are `C`'s column blocks, which this route always splits.
            let width = match split_plan(m, n, k) {
                Blocks::Cols(w) => w,
                _ => n,
            };
            if !accumulate {
                c.resize_host(&[m, n]);
            }
            return self.matmul_transposed(a, ta, b, tb, c, accumulate, width);
        }
        let plan = block_plan(m, n, k, ta);
        let operands = Operands {
            m,
            n,
            k,
            a: a.host()?.as_ptr() as usize,
            a_rs,
            a_cs,
            b: bp,
            b_rs,
            b_cs,
            accumulate,
        };
        if accumulate {
            self.run_plan(plan, &operands, SendPtr(c.host_mut()?.as_mut_ptr()));
        } else {
            // SAFETY: the plan's blocks cover the m x n output, and each `gemm` call writes
            // every element of its block without reading it (`read_dst` is false).
            unsafe {
                c.write_host_with(&[m, n], |out| {
                    self.run_plan(plan, &operands, SendPtr(out.as_mut_ptr().cast()));
                });
            }
        }
        Ok(())
    }

    fn transpose(&self, a: &Tensor, out: &mut Tensor) -> Result<()> {
        const T: usize = 32;
        let (r, c) = (a.rows(), a.cols());
        out.resize_host(&[c, r]);
        if r == 0 || c == 0 {
            return Ok(());
        }
        let src = a.host()?;
        // Each task owns T rows of the output (T columns of the input).
        let body = |(bj, dst): (usize, &mut [f32])| {
            let j0 = bj * T;
            let jn = dst.len() / r;
            for i0 in (0..r).step_by(T) {
                let i1 = (i0 + T).min(r);
                for jj in 0..jn {
                    let drow = &mut dst[jj * r..jj * r + r];
                    let j = j0 + jj;
                    for i in i0..i1 {
                        drow[i] = src[i * c + j];
                    }
                }
            }
        };
        let data = out.host_mut()?;
        if self.threads > 1 && r * c >= PAR_MIN {
            self.pool
                .install(|| data.par_chunks_mut(T * r).enumerate().for_each(body));
        } else {
            data.chunks_mut(T * r).enumerate().for_each(body);
        }
        Ok(())
    }

    fn add_bias(&self, y: &mut Tensor, bias: &Tensor) -> Result<()> {
        crate::check::bias(y, bias)?;
        let n = y.cols();
        if n == 0 {
            return Ok(());
        }
        let b = bias.host()?;
        let rows_per = (PAR_CHUNK / n).max(1) * n;
        let f = |rows: &mut [f32]| crate::vector::vectorized(AddBias { rows, bias: b });
        let data = y.host_mut()?;
        if self.threads > 1 && data.len() >= PAR_MIN {
            self.pool
                .install(|| data.par_chunks_mut(rows_per).for_each(f));
        } else {
            f(data);
        }
        Ok(())
    }

    fn sum_rows(&self, x: &Tensor, out: &mut Tensor, accumulate: bool) -> Result<()> {
        let n = x.cols();
        if accumulate {
            crate::check::sum_rows_into(x, out)?;
        } else {
            out.resize_host(&[n]).fill(0.0);
        }
        if n == 0 {
            return Ok(());
        }
        let xs = x.host()?;
        let sum_into = |first: usize, sums: &mut [f32], rows: &[f32]| {
            crate::vector::vectorized(ColumnSums {
                rows,
                width: n,
                first,
                sums,
            });
        };
        if xs.len() <= SUM_ROWS_CHUNK * n {
            // Column blocks in parallel; each column is summed over the rows in order, as one
            // thread would, so the split never changes a result.
            self.column_blocks(out.host_mut()?, xs.len(), |c0, sums| sum_into(c0, sums, xs));
            return Ok(());
        }
        // Many rows (a transformer's tokens): each fixed chunk of rows is summed on its own,
        // reading memory in order, and the chunks' sums are added in chunk order. The chunks
        // depend on the shape alone, so the bits do not depend on the thread count.
        let chunk_sum = |rows: &[f32]| {
            let mut sums = vec![0.0f32; n];
            sum_into(0, &mut sums, rows);
            sums
        };
        let partials: Vec<Vec<f32>> = if self.threads > 1 {
            self.pool
                .install(|| xs.par_chunks(SUM_ROWS_CHUNK * n).map(chunk_sum).collect())
        } else {
            xs.chunks(SUM_ROWS_CHUNK * n).map(chunk_sum).collect()
        };
        let o = out.host_mut()?;
        for sums in &partials {
            o.iter_mut().zip(sums).for_each(|(acc, v)| *acc += v);
        }
        Ok(())
    }

    fn activation(&self, act: Activation, x: &Tensor, y: &mut Tensor) -> Result<()> {
        let src = x.host()?;
        let f = move |out: &mut [MaybeUninit<f32>], x: &[f32], _: &[f32]| {
            crate::vector::vectorized(Activate { act, out, x });
        };
        // SAFETY: `par_zip` hands every chunk of the output to `Activate`, which writes each
        // of its elements once and reads none.
        unsafe { y.write_host_with(x.shape(), |out| self.par_zip(out, src, src, f)) };
        Ok(())
    }

    fn activation_backward(
        &self,
        act: Activation,
        x: &Tensor,
        dy: &Tensor,
        dx: &mut Tensor,
    ) -> Result<()> {
        crate::check::activation_backward(x, dy)?;
        let (xs, dys) = (x.host()?, dy.host()?);
        let f = move |out: &mut [MaybeUninit<f32>], x: &[f32], dy: &[f32]| {
            crate::vector::vectorized(ActivateBackward { act, out, x, dy });
        };
        // SAFETY: as in `activation`: every output element is written once, none is read.
        unsafe { dx.write_host_with(x.shape(), |out| self.par_zip(out, xs, dys, f)) };
        Ok(())
    }

    fn layer_norm(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        eps: f32,
        y: &mut Tensor,
        mean: &mut Tensor,
        rstd: &mut Tensor,
    ) -> Result<()> {
        crate::check::layer_norm(x, gamma, beta)?;
        let n = x.cols();
        let rows = x.rows();
        y.resize_host(x.shape());
        mean.resize_host(&[rows]);
        rstd.resize_host(&[rows]);
        if n == 0 {
            return Ok(());
        }
        let (g, b) = (gamma.host()?, beta.host()?);
        let rows_per = (PAR_CHUNK / n).max(1);
        let body = |(((y, x), mean), rstd): LayerNormChunk<'_>| {
            crate::vector::vectorized(LayerNormRows {
                y,
                x,
                mean,
                rstd,
                gamma: g,
                beta: b,
                eps,
            });
        };
        let tasks = y
            .host_mut()?
            .par_chunks_mut(rows_per * n)
            .zip(x.host()?.par_chunks(rows_per * n))
            .zip(mean.host_mut()?.par_chunks_mut(rows_per))
            .zip(rstd.host_mut()?.par_chunks_mut(rows_per));
        self.run_rows(tasks, body);
        Ok(())
    }

    fn layer_norm_backward_input(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
        dx: &mut Tensor,
    ) -> Result<()> {
        crate::check::layer_norm_backward_input(x, gamma, (mean, rstd), dy)?;
        let n = x.cols();
        dx.resize_host(x.shape());
        if n == 0 {
            return Ok(());
        }
        let g = gamma.host()?;
        let rows_per = (PAR_CHUNK / n).max(1);
        let body = |((((dx, x), dy), mean), rstd): LayerNormBackChunk<'_>| {
            crate::vector::vectorized(LayerNormBackRows {
                dx,
                x,
                dy,
                mean,
                rstd,
                gamma: g,
            });
        };
        let tasks = dx
            .host_mut()?
            .par_chunks_mut(rows_per * n)
            .zip(x.host()?.par_chunks(rows_per * n))
            .zip(dy.host()?.par_chunks(rows_per * n))
            .zip(mean.host()?.par_chunks(rows_per))
            .zip(rstd.host()?.par_chunks(rows_per));
        self.run_rows(tasks, body);
        Ok(())
    }

    fn layer_norm_backward_params(
        &self,
        x: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
        dgamma: &mut Tensor,
        dbeta: &mut Tensor,
        accumulate: bool,
    ) -> Result<()> {
        crate::check::layer_norm_backward_params(x, (mean, rstd), dy, (dgamma, dbeta), accumulate)?;
        let n = x.cols();
        if !accumulate {
            dgamma.resize_host(&[n]).fill(0.0);
            dbeta.resize_host(&[n]).fill(0.0);
        }
        if n == 0 {
            return Ok(());
        }
        let (xs, dys, means, rstds) = (x.host()?, dy.host()?, mean.host()?, rstd.host()?);
        // Column blocks in parallel, both sums in one pass over the rows, each column summed
        // over the rows in order.
        let (dg, db) = (dgamma.host_mut()?, dbeta.host_mut()?);
        let block = |(first, (dgamma, dbeta)): (usize, (&mut [f32], &mut [f32]))| {
            crate::vector::vectorized(NormParamGrads {
                x: xs,
                dy: dys,
                mean: means,
                rstd: rstds,
                width: n,
                first,
                dgamma,
                dbeta,
            });
        };
        if self.threads > 1 && xs.len() >= PAR_MIN && n > SUM_COLS {
            self.pool.install(|| {
                dg.par_chunks_mut(SUM_COLS)
                    .zip(db.par_chunks_mut(SUM_COLS))
                    .enumerate()
                    .for_each(|(b, pair)| block((b * SUM_COLS, pair)));
            });
        } else {
            block((0, (dg, db)));
        }
        Ok(())
    }

    fn softmax_cross_entropy(
        &self,
        logits: &Tensor,
        classes: usize,
        labels: &Tensor<u32>,
        grad_scale: f32,
        dlogits: Option<&mut Tensor>,
    ) -> Result<LossStats> {
        crate::check::label_count(logits, classes, labels)?;
        let (n, stride) = (classes, logits.cols());
        let labels = labels.host()?;
        if let Some((row, &label)) = labels
            .iter()
            .enumerate()
            .find(|(_, l)| **l as usize >= n && **l != IGNORED_LABEL)
        {
            return Err(KernelError::Label {
                row,
                label,
                classes: n,
            });
        }
        let mut stats = LossStats {
            rows: counted_labels(labels),
            ..LossStats::default()
        };
        if n == 0 {
            if let Some(d) = dlogits {
                d.resize_host(logits.shape());
                d.host_mut()?.fill(0.0);
            }
            return Ok(stats);
        }
        // Rows are independent: each task computes its rows' loss terms and gradient rows,
        // and the terms are summed in row order afterwards, so the split changes no bit.
        let rows = logits.host()?;
        let mut terms = vec![(0.0f64, false); labels.len()];
        let grad_rows: Option<&mut [f32]> = match dlogits {
            Some(d) => {
                d.resize_host(logits.shape());
                Some(d.host_mut()?)
            }
            None => None,
        };
        let task = |r0: usize, terms: &mut [(f64, bool)], grad: Option<&mut [f32]>| {
            let labels = &labels[r0..r0 + terms.len()];
            crate::vector::vectorized(CrossEntropyRows {
                classes: n,
                stride,
                logits: &rows[r0 * stride..(r0 + terms.len()) * stride],
                labels,
                grad_scale,
                grad,
                terms,
            });
        };
        const ROWS_PER_TASK: usize = 64;
        if self.threads > 1 && rows.len() >= PAR_MIN {
            let width = ROWS_PER_TASK * stride;
            self.pool.install(|| match grad_rows {
                Some(g) => terms
                    .par_chunks_mut(ROWS_PER_TASK)
                    .zip(g.par_chunks_mut(width))
                    .enumerate()
                    .for_each(|(i, (t, g))| task(i * ROWS_PER_TASK, t, Some(g))),
                None => terms
                    .par_chunks_mut(ROWS_PER_TASK)
                    .enumerate()
                    .for_each(|(i, t)| task(i * ROWS_PER_TASK, t, None)),
            });
        } else {
            task(0, &mut terms, grad_rows);
        }
        for (&(term, correct), &label) in terms.iter().zip(labels) {
            if label != IGNORED_LABEL {
                stats.loss_sum += term;
                stats.correct += usize::from(correct);
            }
        }
        Ok(stats)
    }

    fn embedding(&self, ids: &Tensor, table: &Tensor, out: &mut Tensor) -> Result<()> {
        let width = table.cols();
        let n = ids.len();
        crate::sequence::embedding(
            ids.host()?,
            table.host()?,
            width,
            out.resize_host(&[n, width]),
        )
    }

    fn embedding_backward(
        &self,
        ids: &Tensor,
        dy: &Tensor,
        dtable: &mut Tensor,
        accumulate: bool,
    ) -> Result<()> {
        let width = dtable.cols();
        crate::check::embedding_backward(ids, dy, width)?;
        let table = dtable.host_mut()?;
        if !accumulate {
            table.fill(0.0);
        }
        crate::sequence::embedding_backward(ids.host()?, dy.host()?, width, table)
    }

    fn attention(
        &self,
        qkv: &Tensor,
        documents: Option<&Tensor>,
        shape: AttentionShape,
        out: &mut Tensor,
        lse: &mut Tensor,
    ) -> Result<()> {
        crate::sequence::check("attention", shape, qkv.len())?;
        let starts = host_documents("attention", documents, shape)?;
        let (t, c, h) = (shape.seq, shape.width, shape.heads);
        let rows = shape.batch * t;
        let src = qkv.host()?;
        let run = |out: &mut [MaybeUninit<f32>], lse: &mut [MaybeUninit<f32>]| {
            let (out, lse) = (
                SendPtr(out.as_mut_ptr().cast()),
                SendPtr(lse.as_mut_ptr().cast()),
            );
            let one = |(b, heads): (usize, Range<usize>)| {
                let starts = starts.map(|s| &s[b * t..(b + 1) * t]);
                let to = crate::sequence::Outputs {
                    rows: out.get().wrapping_add(b * t * c),
                    lse: lse.get().wrapping_add(b * h * t),
                };
                // SAFETY: sequence b's output rows and log-sum-exp rows lie inside the buffers,
                // and no other task writes these heads of this sequence.
                unsafe {
                    let q = &src[b * t * 3 * c..(b + 1) * t * 3 * c];
                    crate::sequence::attention_heads(shape, q, starts, heads, to);
                }
            };
            let tasks = attention_tasks(self.threads, shape);
            if self.threads > 1 && tasks.len() > 1 {
                self.pool.install(|| tasks.into_par_iter().for_each(one));
            } else {
                tasks.into_iter().for_each(one);
            }
        };
        // SAFETY: the tasks together write every output element (every head's columns of every
        // row) and every log-sum-exp, and read neither.
        unsafe {
            out.write_host_with(&[rows, c], |out| {
                lse.write_host_with(&[shape.batch, h, t], |lse| run(out, lse));
            });
        }
        Ok(())
    }

    fn attention_backward(
        &self,
        qkv: &Tensor,
        documents: Option<&Tensor>,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        shape: AttentionShape,
        dqkv: &mut Tensor,
    ) -> Result<()> {
        crate::check::attention_backward(qkv, (out, lse, dout), shape)?;
        let starts = host_documents("attention backward", documents, shape)?;
        let (t, c, h) = (shape.seq, shape.width, shape.heads);
        let rows = shape.batch * t;
        let (src, o, l, go) = (qkv.host()?, out.host()?, lse.host()?, dout.host()?);
        let run = |dst: &mut [MaybeUninit<f32>]| {
            let dst = SendPtr(dst.as_mut_ptr().cast());
            let one = |(b, heads): (usize, Range<usize>)| {
                let starts = starts.map(|s| &s[b * t..(b + 1) * t]);
                let inputs = (
                    &o[b * t * c..(b + 1) * t * c],
                    &l[b * h * t..(b + 1) * h * t],
                    &go[b * t * c..(b + 1) * t * c],
                );
                let q = &src[b * t * 3 * c..(b + 1) * t * 3 * c];
                let d = dst.get().wrapping_add(b * t * 3 * c);
                // SAFETY: sequence b's gradient rows lie inside the buffer, and no other task
                // writes these heads' columns of them.
                unsafe {
                    crate::sequence::attention_backward_heads(shape, (q, starts), inputs, heads, d);
                }
            };
            let tasks = attention_tasks(self.threads, shape);
            if self.threads > 1 && tasks.len() > 1 {
                self.pool.install(|| tasks.into_par_iter().for_each(one));
            } else {
                tasks.into_iter().for_each(one);
            }
        };
        // SAFETY: the tasks together write every element of `dqkv` (each its heads' columns of
        // dQ by query blocks, and of dK and dV zeroed first, then summed into by query
        // blocks) and read only what they wrote.
        unsafe { dqkv.write_host_with(&[rows, 3 * c], run) };
        Ok(())
    }

    fn axpy(&self, alpha: f32, x: &Tensor, y: &mut Tensor) -> Result<()> {
        crate::check::same_len("axpy", (x, y), ("x", "y"))?;
        let xs = x.host()?;
        let f = move |y: &mut [f32], x: &[f32], _: &[f32]| {
            crate::vector::vectorized(Axpy { alpha, x, y });
        };
        self.par_zip(y.host_mut()?, xs, xs, f);
        Ok(())
    }

    fn scale(&self, alpha: f32, x: &mut Tensor) -> Result<()> {
        self.par_map_inplace(x.host_mut()?, move |c| {
            c.iter_mut().for_each(|v| *v *= alpha)
        });
        Ok(())
    }

    fn sgd_update(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        buf: Option<&mut Tensor>,
        hp: SgdStep,
    ) -> Result<UpdateSeen> {
        crate::check::sgd(param, grad, buf.as_deref(), hp.momentum)?;
        let n = param.len();
        let chunk = self.update_chunk(n);
        let tops = match buf {
            Some(b) if hp.momentum != 0.0 => {
                let (w, g, b) = (param.host_mut()?, grad.host()?, b.host_mut()?);
                let body = |((w, g), b): ((&mut [f32], &[f32]), &mut [f32])| {
                    crate::vector::vectorized(SgdMomentumUpdate { w, g, b, hp })
                };
                if chunk >= n {
                    body(((w, g), b))
                } else {
                    let tasks = w.par_chunks_mut(chunk).zip(g.par_chunks(chunk));
                    self.largest_tops(tasks.zip(b.par_chunks_mut(chunk)).map(body))
                }
            }
            _ => {
                let (w, g) = (param.host_mut()?, grad.host()?);
                let body = |(w, g): (&mut [f32], &[f32])| {
                    crate::vector::vectorized(SgdUpdate { w, g, hp })
                };
                if chunk >= n {
                    body((w, g))
                } else {
                    self.largest_tops(w.par_chunks_mut(chunk).zip(g.par_chunks(chunk)).map(body))
                }
            }
        };
        Ok(UpdateSeen::from_tops(tops))
    }

    fn adam_update(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        hp: AdamStep,
    ) -> Result<UpdateSeen> {
        crate::check::adam(param, grad, m, v)?;
        let n = param.len();
        let chunk = self.update_chunk(n);
        type Chunks<'a> = (((&'a mut [f32], &'a [f32]), &'a mut [f32]), &'a mut [f32]);
        let body =
            |(((w, g), m), v): Chunks<'_>| crate::vector::vectorized(AdamUpdate { w, g, m, v, hp });
        let (w, g) = (param.host_mut()?, grad.host()?);
        let (m, v) = (m.host_mut()?, v.host_mut()?);
        let tops = if chunk >= n {
            body((((w, g), m), v))
        } else {
            let tasks = w
                .par_chunks_mut(chunk)
                .zip(g.par_chunks(chunk))
                .zip(m.par_chunks_mut(chunk))
                .zip(v.par_chunks_mut(chunk));
            self.largest_tops(tasks.map(body))
        };
        Ok(UpdateSeen::from_tops(tops))
    }

    fn lion_update(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        hp: LionStep,
    ) -> Result<UpdateSeen> {
        crate::check::lion(param, grad, m)?;
        let n = param.len();
        let chunk = self.update_chunk(n);
        type Chunks<'a> = ((&'a mut [f32], &'a [f32]), &'a mut [f32]);
        let body = |((w, g), m): Chunks<'_>| crate::vector::vectorized(LionUpdate { w, g, m, hp });
        let (w, g, m) = (param.host_mut()?, grad.host()?, m.host_mut()?);
        let tops = if chunk >= n {
            body(((w, g), m))
        } else {
            let tasks = w
                .par_chunks_mut(chunk)
                .zip(g.par_chunks(chunk))
                .zip(m.par_chunks_mut(chunk));
            self.largest_tops(tasks.map(body))
        };
        Ok(UpdateSeen::from_tops(tops))
    }

    fn delay_compensate(
        &self,
        grad: &mut Tensor,
        current: &Tensor,
        stale: &Tensor,
        mean_square: Option<&mut Tensor>,
        hp: DelayCompensation,
    ) -> Result<()> {
        crate::check::delay_compensation(
            grad,
            current,
            stale,
            mean_square.as_deref(),
            hp.adaptive.is_some(),
        )?;
        let (g, w, ws) = (grad.host_mut()?, current.host()?, stale.host()?);
        match (hp.adaptive, mean_square) {
            (Some(m), Some(ms)) => {
                let ms = ms.host_mut()?;
                for (((g, &w), &ws), ms) in g.iter_mut().zip(w).zip(ws).zip(ms.iter_mut()) {
                    *ms = m * *ms + (1.0 - m) * *g * *g;
                    let lambda = hp.lambda / (*ms + hp.eps).sqrt();
                    *g += lambda * *g * *g * (w - ws);
                }
            }
            _ => {
                for ((g, &w), &ws) in g.iter_mut().zip(w).zip(ws) {
                    *g += hp.lambda * *g * *g * (w - ws);
                }
            }
        }
        Ok(())
    }

    fn first_non_finite(&self, xs: &[&Tensor]) -> Result<Option<usize>> {
        // Every tensor in blocks of `PAR_CHUNK` values, checked on the pool; the first
        // non-finite block in order names its tensor, whichever thread saw it.
        let mut blocks: Vec<(usize, &[f32])> = Vec::new();
        for (i, x) in xs.iter().enumerate() {
            blocks.extend(x.host()?.chunks(PAR_CHUNK).map(|b| (i, b)));
        }
        let bad = |(_, b): &&(usize, &[f32])| !crate::backend::all_finite(b);
        let first = if self.threads > 1 && blocks.len() > 1 {
            self.pool.install(|| blocks.par_iter().find_first(bad))
        } else {
            blocks.iter().find(bad)
        };
        Ok(first.map(|&(i, _)| i))
    }

    fn sum(&self, x: &Tensor) -> Result<f64> {
        Ok(x.host()?.iter().map(|&v| v as f64).sum())
    }

    fn sum_squares(&self, x: &Tensor) -> Result<f64> {
        let xs = x.host()?;
        let block = |b: &[f32]| crate::vector::vectorized(SquareSum(b));
        // Blocks of a fixed length, each summed alone and the block sums added in order: the
        // same bits on any number of threads.
        let sums: Vec<f64> = if self.threads > 1 && xs.len() >= PAR_MIN {
            self.pool
                .install(|| xs.par_chunks(SQUARE_SUM_BLOCK).map(block).collect())
        } else {
            xs.chunks(SQUARE_SUM_BLOCK).map(block).collect()
        };
        Ok(sums.iter().sum())
    }
}

/// The values a sum of squares adds up alone before its sum joins the others' (64 KiB).
const SQUARE_SUM_BLOCK: usize = 1 << 14;

/// The running sums a block's sum of squares keeps (two AVX-512 registers of `f64`).
const SQUARE_SUM_LANES: usize = 16;

/// The sum of the squares of one block's values in `f64`: value `i` into running sum
/// `i % SQUARE_SUM_LANES`, the running sums then added in order. Independent running sums stay
/// in vector registers and overlap, where one running sum waited on every addition (on one
/// thread, about 115 ms of a 2.6 s update over GPT-2 width 768's 57.6 M gradients:
/// `kernels/examples/square_sum.rs`).
/// A square of an `f32` is exact in `f64`, so only the order of the additions rounds, and it
/// is fixed.
struct SquareSum<'a>(&'a [f32]);

impl crate::vector::Kernel for SquareSum<'_> {
    type Output = f64;

    #[inline(always)]
    fn run(self) -> f64 {
        let mut lanes = [0.0f64; SQUARE_SUM_LANES];
        let mut chunks = self.0.chunks_exact(SQUARE_SUM_LANES);
        for chunk in &mut chunks {
            for (lane, &v) in lanes.iter_mut().zip(chunk) {
                let v = f64::from(v);
                *lane += v * v;
            }
        }
        for (lane, &v) in lanes.iter_mut().zip(chunks.remainder()) {
            let v = f64::from(v);
            *lane += v * v;
        }
        lanes.iter().sum()
    }
}

/// Folds one gradient value and one updated parameter value into the largest exponent fields
/// seen so far ([`UpdateSeen`]).
#[inline(always)]
fn seen(tops: (u32, u32), g: f32, w: f32) -> (u32, u32) {
    (tops.0.max(exponent_field(g)), tops.1.max(exponent_field(w)))
}

/// Plain SGD over one chunk (`w -= lr (g + weight_decay w)`), vectorised: the largest exponent
/// fields of the gradient and of the new weights.
struct SgdUpdate<'a> {
    w: &'a mut [f32],
    g: &'a [f32],
    hp: SgdStep,
}

impl crate::vector::Kernel for SgdUpdate<'_> {
    type Output = (u32, u32);

    #[inline(always)]
    fn run(self) -> (u32, u32) {
        let SgdStep {
            lr,
            weight_decay: wd,
            ..
        } = self.hp;
        let mut tops = (0, 0);
        for (w, &g) in self.w.iter_mut().zip(self.g) {
            *w -= lr * (g + wd * *w);
            tops = seen(tops, g, *w);
        }
        tops
    }
}

/// SGD with momentum over one chunk (PyTorch's, dampening 0, Nesterov's where asked),
/// vectorised: the largest exponent fields of the gradient and of the new weights.
struct SgdMomentumUpdate<'a> {
    w: &'a mut [f32],
    g: &'a [f32],
    b: &'a mut [f32],
    hp: SgdStep,
}

impl crate::vector::Kernel for SgdMomentumUpdate<'_> {
    type Output = (u32, u32);

    #[inline(always)]
    fn run(self) -> (u32, u32) {
        let SgdStep {
            lr,
            momentum,
            nesterov,
            weight_decay: wd,
        } = self.hp;
        let mut tops = (0, 0);
        for ((w, &g), b) in self.w.iter_mut().zip(self.g).zip(self.b.iter_mut()) {
            let d = g + wd * *w;
            *b = momentum * *b + d;
            let step = if nesterov { d + momentum * *b } else { *b };
            *w -= lr * step;
            tops = seen(tops, g, *w);
        }
        tops
    }
}

/// Adam or AdamW over one chunk, vectorised: the largest exponent fields of the gradient and
/// of the new weights.
struct AdamUpdate<'a> {
    w: &'a mut [f32],
    g: &'a [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
    hp: AdamStep,
}

impl crate::vector::Kernel for AdamUpdate<'_> {
    type Output = (u32, u32);

    #[inline(always)]
    fn run(self) -> (u32, u32) {
        let hp = self.hp;
        let mut tops = (0, 0);
        let each = self.w.iter_mut().zip(self.g).zip(self.m.iter_mut());
        for (((w, &grad), m), v) in each.zip(self.v.iter_mut()) {
            let g = if hp.decoupled {
                grad
            } else {
                grad + hp.weight_decay * *w
            };
            if hp.decoupled {
                *w -= hp.lr * hp.weight_decay * *w;
            }
            *m = hp.beta1 * *m + (1.0 - hp.beta1) * g;
            *v = hp.beta2 * *v + (1.0 - hp.beta2) * g * g;
            let mhat = *m / hp.bias_correction1;
            let vhat = *v / hp.bias_correction2;
            *w -= hp.lr * mhat / (vhat.sqrt() + hp.eps);
            tops = seen(tops, grad, *w);
        }
        tops
    }
}

/// Lion over one chunk, vectorised: the largest exponent fields of the gradient and of the
/// new weights.
struct LionUpdate<'a> {
    w: &'a mut [f32],
    g: &'a [f32],
    m: &'a mut [f32],
    hp: LionStep,
}

impl crate::vector::Kernel for LionUpdate<'_> {
    type Output = (u32, u32);

    #[inline(always)]
    fn run(self) -> (u32, u32) {
        let hp = self.hp;
        let mut tops = (0, 0);
        for ((w, &g), m) in self.w.iter_mut().zip(self.g).zip(self.m.iter_mut()) {
            let c = hp.beta1 * *m + (1.0 - hp.beta1) * g;
            *w -= hp.lr * (lion_sign(c) + hp.weight_decay * *w);
            *m = hp.beta2 * *m + (1.0 - hp.beta2) * g;
            tops = seen(tops, g, *w);
        }
        tops
    }
}

/// `out = act(x)`, vectorised ([`crate::vector`]).
struct Activate<'a> {
    act: Activation,
    out: &'a mut [MaybeUninit<f32>],
    x: &'a [f32],
}

impl crate::vector::Kernel for Activate<'_> {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        let it = self.out.iter_mut().zip(self.x);
        match self.act {
            Activation::Relu => it.for_each(|(o, &v)| _ = o.write(v.max(0.0))),
            Activation::Gelu => it.for_each(|(o, &v)| _ = o.write(gelu(v))),
            Activation::Tanh => it.for_each(|(o, &v)| _ = o.write(v.tanh())),
            Activation::Sigmoid => it.for_each(|(o, &v)| _ = o.write(sigmoid(v))),
        }
    }
}

/// `out = dy * act'(x)`, vectorised.
struct ActivateBackward<'a> {
    act: Activation,
    out: &'a mut [MaybeUninit<f32>],
    x: &'a [f32],
    dy: &'a [f32],
}

impl crate::vector::Kernel for ActivateBackward<'_> {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        let it = self.out.iter_mut().zip(self.x).zip(self.dy);
        match self.act {
            Activation::Relu => {
                it.for_each(|((o, &v), &g)| _ = o.write(if v > 0.0 { g } else { 0.0 }))
            }
            Activation::Gelu => it.for_each(|((o, &v), &g)| _ = o.write(g * gelu_grad(v))),
            Activation::Tanh => it.for_each(|((o, &v), &g)| {
                let t = v.tanh();
                o.write(g * (1.0 - t * t));
            }),
            Activation::Sigmoid => it.for_each(|((o, &v), &g)| {
                let s = sigmoid(v);
                o.write(g * s * (1.0 - s));
            }),
        }
    }
}

/// Layer norm over whole rows of `x` (`gamma.len()` features each), vectorised.
struct LayerNormRows<'a> {
    y: &'a mut [f32],
    x: &'a [f32],
    mean: &'a mut [f32],
    rstd: &'a mut [f32],
    gamma: &'a [f32],
    beta: &'a [f32],
    eps: f32,
}

impl crate::vector::Kernel for LayerNormRows<'_> {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        let n = self.gamma.len();
        for (((yr, xr), m), r) in self
            .y
            .chunks_exact_mut(n)
            .zip(self.x.chunks_exact(n))
            .zip(self.mean)
            .zip(self.rstd)
        {
            let mu = crate::fastmath::sum_f64(xr, f64::from) / n as f64;
            let var = crate::fastmath::sum_f64(xr, |v| (f64::from(v) - mu).powi(2)) / n as f64;
            let rs = 1.0 / (var + f64::from(self.eps)).sqrt();
            let (mu, rs) = (mu as f32, rs as f32);
            for (((o, &xv), &gv), &bv) in yr.iter_mut().zip(xr).zip(self.gamma).zip(self.beta) {
                *o = (xv - mu) * rs * gv + bv;
            }
            *m = mu;
            *r = rs;
        }
    }
}

/// The layer norm's input gradient over whole rows, vectorised:
/// `dx = rstd * (g*dy - mean(g*dy) - xhat * mean(g*dy*xhat))`, the two means summed in f64.
struct LayerNormBackRows<'a> {
    dx: &'a mut [f32],
    x: &'a [f32],
    dy: &'a [f32],
    mean: &'a [f32],
    rstd: &'a [f32],
    gamma: &'a [f32],
}

impl crate::vector::Kernel for LayerNormBackRows<'_> {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        let n = self.gamma.len();
        for ((((dxr, xr), dyr), &mu), &rs) in self
            .dx
            .chunks_exact_mut(n)
            .zip(self.x.chunks_exact(n))
            .zip(self.dy.chunks_exact(n))
            .zip(self.mean)
            .zip(self.rstd)
        {
            // The products g*dy go through dx as scratch first.
            for ((o, &gv), &d) in dxr.iter_mut().zip(self.gamma).zip(dyr) {
                *o = gv * d;
            }
            let s1 = crate::fastmath::sum_f64(dxr, f64::from);
            let s2 = crate::fastmath::sum_f64_pairs(dxr, xr, |gd, xv| {
                f64::from(gd) * f64::from((xv - mu) * rs)
            });
            let (m1, m2) = ((s1 / n as f64) as f32, (s2 / n as f64) as f32);
            for (o, &xv) in dxr.iter_mut().zip(xr) {
                let xhat = (xv - mu) * rs;
                *o = rs * (*o - m1 - xhat * m2);
            }
        }
    }
}

/// Rows of the softmax cross-entropy, vectorised: for each row its loss term
/// `logsumexp(row) - row[label]` and whether the row's largest logit is the label's (the first
/// of equal ones, as an argmax), writing `(softmax(row) - onehot) * grad_scale` to `grad` when
/// given. An ignored row's term is 0 and its gradient zeros.
///
/// One exponential per logit, in `f32` ([`crate::fastmath::exp`], as attention's softmax):
/// with a gradient, `e^(v - max)` goes to the gradient row, whose sum (in `f64`, fixed
/// partials) gives the log-sum-exp, and is then scaled in place. The order of every sum is
/// fixed, so the bits do not depend on the vector width or the thread count.
struct CrossEntropyRows<'a> {
    /// Classes per row (at least 1): the first columns of a row.
    classes: usize,
    /// Columns per row (at least `classes`); the gradient of the rest is zero.
    stride: usize,
    logits: &'a [f32],
    labels: &'a [u32],
    grad_scale: f32,
    grad: Option<&'a mut [f32]>,
    terms: &'a mut [(f64, bool)],
}

impl crate::vector::Kernel for CrossEntropyRows<'_> {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        let (n, stride) = (self.classes, self.stride);
        let mut grad = self.grad.map(|g| g.chunks_exact_mut(stride));
        let rows = self.logits.chunks_exact(stride).zip(self.labels);
        for (term, (row, &label)) in self.terms.iter_mut().zip(rows) {
            let grad_row = grad.as_mut().and_then(|g| g.next()).map(|g| {
                let (classes, padding) = g.split_at_mut(n);
                padding.fill(0.0);
                classes
            });
            *term = cross_entropy_row(&row[..n], label, self.grad_scale, grad_row);
        }
    }
}

/// One row of [`CrossEntropyRows`].
#[inline(always)]
fn cross_entropy_row(
    row: &[f32],
    label: u32,
    grad_scale: f32,
    grad: Option<&mut [f32]>,
) -> (f64, bool) {
    use crate::fastmath::{exp, max, sum_f64};
    if label == IGNORED_LABEL {
        if let Some(d) = grad {
            d.fill(0.0);
        }
        return (0.0, false);
    }
    let label = label as usize;
    let top = max(row);
    let at_label = row[label];
    let correct = at_label == top && !row[..label].contains(&top);
    let sum = match grad {
        Some(d) => {
            for (o, &v) in d.iter_mut().zip(row) {
                *o = exp(v - top);
            }
            let sum = sum_f64(d, f64::from);
            let e_label = d[label];
            let scale = (1.0 / sum) as f32;
            for o in d.iter_mut() {
                *o = *o * scale * grad_scale;
            }
            d[label] = (e_label * scale - 1.0) * grad_scale;
            sum
        }
        None => sum_f64(row, |v| f64::from(exp(v - top))),
    };
    (sum.ln() - f64::from(at_label - top), correct)
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

#[inline(always)]
fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + crate::fastmath::tanh(SQRT_2_OVER_PI * (x + GELU_C * x * x * x)))
}

#[inline(always)]
fn gelu_grad(x: f32) -> f32 {
    let t = crate::fastmath::tanh(SQRT_2_OVER_PI * (x + GELU_C * x * x * x));
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x)
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposing_on_the_pool_matches_the_single_thread_transpose() {
        let be = CpuBackend::new(2).unwrap();
        for (rows, cols) in [(3, 5), (300, 257), (1024, 64), (77, 1030)] {
            let src: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let mut want = vec![0.0; rows * cols];
            transpose::transpose(&src, &mut want, cols, rows);
            let mut got = vec![-1.0; rows * cols];
            be.transpose_on_pool(&src, rows, cols, &mut got);
            assert_eq!(got, want, "{rows} x {cols}");
        }
    }

    /// CBLAS's row-major `cblas_sgemm` written out (f64 sums), for the backend's calls to a
    /// CBLAS library: it reads the operands only through the arguments the backend passes.
    unsafe extern "C" fn reference_sgemm(
        layout: std::ffi::c_int,
        trans_a: std::ffi::c_int,
        trans_b: std::ffi::c_int,
        m: std::ffi::c_int,
        n: std::ffi::c_int,
        k: std::ffi::c_int,
        alpha: f32,
        a: *const f32,
        lda: std::ffi::c_int,
        b: *const f32,
        ldb: std::ffi::c_int,
        beta: f32,
        c: *mut f32,
        ldc: std::ffi::c_int,
    ) {
        assert_eq!(layout, crate::cblas::ROW_MAJOR, "row-major");
        let [m, n, k, lda, ldb, ldc] = [m, n, k, lda, ldb, ldc].map(|v| v as usize);
        // CBLAS's own argument checks for row-major operands.
        let (a_cols, b_cols) = (
            if trans_a == crate::cblas::NO_TRANS {
                k
            } else {
                m
            },
            if trans_b == crate::cblas::NO_TRANS {
                n
            } else {
                k
            },
        );
        assert!(lda >= a_cols.max(1) && ldb >= b_cols.max(1) && ldc >= n.max(1));
        for i in 0..m {
            for j in 0..n {
                let mut sum = 0.0f64;
                for p in 0..k {
                    // SAFETY: inside the operands the arguments describe.
                    let (x, y) = unsafe {
                        (
                            *a.add(if trans_a == crate::cblas::NO_TRANS {
                                i * lda + p
                            } else {
                                p * lda + i
                            }),
                            *b.add(if trans_b == crate::cblas::NO_TRANS {
                                p * ldb + j
                            } else {
                                j * ldb + p
                            }),
                        )
                    };
                    sum += f64::from(x) * f64::from(y);
                }
                // SAFETY: inside the output; read only when beta is not 0, as CBLAS does.
                unsafe {
                    let out = c.add(i * ldc + j);
                    let old = if beta == 0.0 { 0.0 } else { beta * *out };
                    *out = old + alpha * sum as f32;
                }
            }
        }
    }

    #[test]
    fn cblas_products_match_gemm_in_every_layout_and_block_split() {
        let gemm = CpuBackend::on_gemm(2).unwrap();
        let mut cblas = CpuBackend::on_gemm(2).unwrap();
        cblas.cblas = Some(Arc::new(Cblas::from_fn(reference_sgemm)));
        let value = |i: usize| ((i * 37 + 11) % 23) as f32 * 0.01 - 0.1;
        // Whole, column blocks, row blocks, and one row, column or inner element.
        let shapes = [
            (5, 7, 3),
            (64, 1024, 64),
            (1024, 64, 64),
            (1, 9, 4),
            (9, 1, 4),
            (6, 5, 1),
        ];
        for (m, n, k) in shapes {
            for (ta, tb) in [
                (Trans::No, Trans::No),
                (Trans::Yes, Trans::No),
                (Trans::No, Trans::Yes),
                (Trans::Yes, Trans::Yes),
            ] {
                let stored = |t: Trans, r: usize, c: usize| match t {
                    Trans::No => [r, c],
                    Trans::Yes => [c, r],
                };
                let a = Tensor::from_vec(&stored(ta, m, k), (0..m * k).map(value).collect());
                let b = Tensor::from_vec(
                    &stored(tb, k, n),
                    (0..k * n).map(|i| value(i + 5)).collect(),
                );
                let (a, b) = (a.unwrap(), b.unwrap());
                for accumulate in [false, true] {
                    let start =
                        Tensor::from_vec(&[m, n], (0..m * n).map(|i| value(i + 9)).collect());
                    let (mut want, mut got) = (start.clone().unwrap(), start.unwrap());
                    gemm.matmul(&a, ta, &b, tb, &mut want, accumulate).unwrap();
                    cblas.matmul(&a, ta, &b, tb, &mut got, accumulate).unwrap();
                    let (want, got) = (want.host().unwrap(), got.host().unwrap());
                    for (w, g) in want.iter().zip(got) {
                        assert!(
                            (w - g).abs() <= 1e-5 * (1.0 + w.abs()),
                            "{m}x{n}x{k} {ta:?} {tb:?} accumulate {accumulate}: {w} against {g}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn block_plan_depends_on_shape_only() {
        let no = Trans::No;
        assert_eq!(block_plan(4, 4, 4, no), Blocks::Whole);
        assert!(matches!(block_plan(256, 1024, 1024, no), Blocks::Cols(512)));
        assert!(matches!(block_plan(512, 10, 512, no), Blocks::Rows(_)));
        assert_eq!(block_plan(2048, 512, 512, no), Blocks::Whole);
        assert_eq!(block_plan(512, 512, 2048, Trans::Yes), Blocks::Whole);
        // A weight gradient over few token rows splits by rows of its output.
        assert!(matches!(
            block_plan(1024, 1024, 256, Trans::Yes),
            Blocks::Rows(512)
        ));
        assert!(matches!(
            block_plan(128, 1024, 256, Trans::Yes),
            Blocks::Cols(512)
        ));
    }

    /// A gradient norm's sum of squares: the same bits on one thread and two (its blocks are
    /// the tensor's alone), and the exact sum where no addition rounds, over lengths around a
    /// block's and a lane group's ends.
    #[test]
    fn sum_squares_is_exact_to_rounding_and_thread_free() {
        let (one, two) = (CpuBackend::new(1).unwrap(), CpuBackend::new(2).unwrap());
        for n in [
            0,
            1,
            15,
            17,
            SQUARE_SUM_BLOCK + 3,
            PAR_MIN + 5,
            5 * SQUARE_SUM_BLOCK - 1,
        ] {
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 1013) as f32 / 1024.0 - 0.5)
                .collect();
            let t = Tensor::from_vec(&[n], v.clone()).unwrap();
            let (a, b) = (one.sum_squares(&t).unwrap(), two.sum_squares(&t).unwrap());
            assert_eq!(a.to_bits(), b.to_bits(), "n = {n}");
            // The values are multiples of 2^-10, so their squares are whole multiples of
            // 2^-20: summed exactly as integers.
            let exact: i128 = v
                .iter()
                .map(|&x| {
                    let x = f64::from(x);
                    (x * x * 2f64.powi(20)) as i128
                })
                .sum();
            let exact = exact as f64 / 2f64.powi(20);
            assert!(
                (a - exact).abs() <= exact * 1e-14,
                "n = {n}: {a} against {exact}"
            );
        }
    }
}
