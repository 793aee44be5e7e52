//! The CUDA backend proper: one context, one stream, one cuBLAS handle and one memory pool per
//! backend (per worker). Every operation is queued on the stream; the host waits only where it
//! must have a value (`read`, the loss statistics, the f64 sums, id checks) or before timing
//! ([`Backend::synchronize`]).
//!
//! Kernels receive raw device pointers: the stream's order is the only synchronisation, which is
//! why a tensor from another backend is copied in by [`Backend::place`] before use and refused
//! anywhere else.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::cublas::{CudaBlas, result as blas, sys as blas_sys};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, LaunchArgs, LaunchConfig, PushKernelArg,
    result as driver, sys as driver_sys,
};

use crate::backend::{
    Activation, AdamStep, AdamTensors, AttentionShape, Backend, DelayCompensation, LionStep,
    LossReading, LossStats, Precision, QueuedLoss, SgdStep, Trans, UpdateSeen,
};
use crate::error::shape_err;
use crate::{Device, Element, KernelError, Result, Storage, Tensor};

use super::compile::module_for;
use super::deferred::{DeferredChecks, PendingIds};
use super::epilogue::{Epilogue, Lt, Operands, Product};
use super::events::{self, CudaMark};
use super::lending;
use super::libraries::{Library, explain};
use super::memory::{CudaMemory, Pool, PoolStats, driver_err};
use super::multi_tensor::{AdamOperands, adam_groups};

/// Threads per block for elementwise and per-column kernels.
const THREADS: u32 = 256;
/// Grid-stride kernels never need more blocks than this to fill a GPU.
const MAX_BLOCKS: u64 = 8192;
/// Warps (rows) per block for the one-warp-per-row kernels.
const WARPS_PER_BLOCK: u64 = 4;
/// The partial-sum grid of `partial_sums_f32` (fixed, so the summation order depends on the
/// length alone).
const REDUCE_BLOCKS: u32 = 256;
const REDUCE_THREADS: u32 = 256;
/// The attention kernels keep a head's features in registers, 32 lanes x 8.
const MAX_HEAD_DIM: usize = 256;

macro_rules! kernel_table {
    ($($name:ident),* $(,)?) => {
        /// Every kernel of `kernels.cu`, looked up once.
        struct Kernels {
            $($name: CudaFunction,)*
        }

        impl Kernels {
            fn load(module: &Arc<CudaModule>) -> Result<Self> {
                Ok(Self {
                    $($name: module
                        .load_function(stringify!($name))
                        .map_err(driver_err(stringify!($name)))?,)*
                })
            }
        }
    };
}

kernel_table!(
    fill_f32,
    flag_non_finite_f32,
    mul_f32,
    axpy_f32,
    scale_f32,
    add_bias_f32,
    column_partials_f32,
    sum_partials_f32,
    transpose_f32,
    activation_f32,
    activation_backward_f32,
    layer_norm_f32,
    layer_norm_backward_input_f32,
    layer_norm_param_partials_f32,
    check_labels_u32,
    check_ids_f32,
    check_document_starts_f32,
    softmax_xent_f32,
    embedding_f32,
    embedding_backward_rows_f32,
    embedding_rank_ids_f32,
    exclusive_scan_u32,
    embedding_group_ids_f32,
    embedding_backward_grouped_f32,
    attention_f32,
    attention_backward_queries_f32,
    attention_backward_keys_f32,
    attention_tiled_16,
    attention_tiled_32,
    attention_tiled_64,
    attention_backward_queries_tiled_16,
    attention_backward_queries_tiled_32,
    attention_backward_queries_tiled_64,
    attention_backward_keys_tiled_16,
    attention_backward_keys_tiled_32,
    attention_backward_keys_tiled_64,
    attention_mma_64,
    attention_backward_queries_mma_64,
    attention_backward_keys_mma_64,
    to_bf16,
    sgd_f32,
    adam_f32,
    adam_group_f32,
    lion_f32,
    delay_compensate_f32,
    partial_sums_f32,
);

/// A compute backend on one CUDA device (see the module docs).
pub struct CudaBackend {
    ordinal: usize,
    /// Compute capability as `10 * major + minor`.
    arch: u32,
    precision: Precision,
    name: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: Mutex<CudaBlas>,
    /// cuBLASLt, for the linear layers' bias inside their products
    /// ([`epilogue`](super::epilogue)); `None` where it is turned off or absent.
    lt: Option<Lt>,
    /// Whether [`Backend::mark`] records events ([`events`](super::events)).
    marks: bool,
    kernels: Kernels,
    pool: Arc<Pool>,
    /// The content stamps ([`Tensor::stamp`]) of the last [`CHECKED_STARTS`] document-start
    /// tensors whose check passed: a microbatch's starts serve every attention layer's forward
    /// and backward, and equal stamps mean equal contents, so each is checked (one wait) once.
    checked_starts: Mutex<VecDeque<u64>>,
    /// The embedding's token-id checks, queued without a wait and read at the next one
    /// ([`deferred`](super::deferred)).
    deferred: DeferredChecks,
    /// bf16 copies of the last [`ROUNDED_KEPT`] tensors rounded for a product under bf16, by
    /// content stamp ([`CudaBackend::to_bf16`]).
    rounded: Mutex<VecDeque<Rounded>>,
    /// Buffers other processes lent this backend, opened once each ([`lending`]).
    borrowed: lending::Borrowed,
}

/// How many checked document-start tensors [`CudaBackend`] remembers (a pipeline stage holds
/// a few microbatches in flight).
const CHECKED_STARTS: usize = 64;

/// How many bf16 copies [`CudaBackend`] keeps for a later product to read: enough for a linear
/// layer's output gradient to outlive the other operands of the two products that read it.
const ROUNDED_KEPT: usize = 3;

/// A tensor's bf16 copy (two values per f32 slot of `copy`) and its device address.
#[derive(Debug)]
struct Rounded {
    stamp: u64,
    copy: Tensor,
    ptr: u64,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.ordinal)
            .field("precision", &self.precision)
            .field("device", &self.name)
            .field("pool", &self.pool)
            .finish()
    }
}

/// The number of CUDA devices this process can see.
///
/// # Errors
/// [`KernelError::NoCuda`] when no driver can be loaded or it reports no device.
pub fn device_count() -> Result<usize> {
    // SAFETY: only tries to open the driver library. Without it cudarc's entry points panic,
    // which is why this comes first.
    if !unsafe { driver_sys::is_culib_present() } {
        return Err(KernelError::NoCuda {
            reason: format!(
                "no NVIDIA driver found (libcuda.so could not be loaded; {})",
                explain(Library::Driver)
            ),
        });
    }
    let count = CudaContext::device_count().map_err(|e| KernelError::NoCuda {
        reason: format!("the CUDA driver did not start: {e}"),
    })?;
    match usize::try_from(count) {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(KernelError::NoCuda {
            reason: "the CUDA driver reports no device".into(),
        }),
    }
}

/// Bytes of memory GPU `ordinal` has in all (what `pipe doctor gpu` prints beside its name),
/// asked of the driver without making a context on the GPU.
///
/// # Errors
/// [`KernelError::NoCuda`] when no driver can be loaded or there is no such GPU.
pub fn device_memory(ordinal: usize) -> Result<u64> {
    let count = device_count()?;
    let no_such = || KernelError::NoCuda {
        reason: format!("no GPU {ordinal}: this process sees {count}"),
    };
    let index = std::ffi::c_int::try_from(ordinal).map_err(|_| no_such())?;
    if ordinal >= count {
        return Err(no_such());
    }
    let device = driver::device::get(index).map_err(|e| KernelError::NoCuda {
        reason: format!("GPU {ordinal}: {e}"),
    })?;
    // SAFETY: `device` is a handle the initialised driver (device_count) just gave out.
    let bytes = unsafe { driver::device::total_mem(device) }.map_err(|e| KernelError::NoCuda {
        reason: format!("GPU {ordinal}'s memory: {e}"),
    })?;
    Ok(bytes as u64)
}

/// Appends the driver's CUDA version, NVRTC's, and every GPU (name, architecture, memory) to
/// `report`, for `pipe doctor gpu`.
///
/// # Errors
/// [`KernelError::NoCuda`] when the driver, NVRTC or a GPU cannot be opened.
pub(crate) fn describe_devices(report: &mut String) -> Result<()> {
    let count = device_count()?;
    let mut version: std::ffi::c_int = 0;
    // SAFETY: the driver is loaded (device_count succeeded); writes one integer.
    unsafe { driver_sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| KernelError::NoCuda {
            reason: format!("driver version: {e}"),
        })?;
    report.push_str(&format!(
        "driver API: CUDA {}.{}\n",
        version / 1000,
        (version % 1000) / 10
    ));
    let (major, minor) = super::compile::nvrtc_version()?;
    report.push_str(&format!("NVRTC: {major}.{minor}\n"));
    report.push_str(&format!("GPUs: {count}\n"));
    for ordinal in 0..count {
        let ctx = CudaContext::new(ordinal).map_err(|e| KernelError::NoCuda {
            reason: format!("GPU {ordinal}: {e}"),
        })?;
        let name = ctx.name().unwrap_or_else(|_| "?".into());
        let (major, minor) = ctx.compute_capability().unwrap_or((0, 0));
        let memory = ctx.total_mem().unwrap_or(0) as f64 / f64::from(1u32 << 30);
        report.push_str(&format!(
            "  {ordinal}: {name}, sm_{major}{minor}, {memory:.1} GiB\n"
        ));
    }
    Ok(())
}

fn cublas_err(e: blas::CublasError) -> KernelError {
    KernelError::Cuda {
        op: "cublas",
        detail: e.to_string(),
    }
}

fn blocks_for(n: u64, per_block: u64) -> u32 {
    // At most MAX_BLOCKS, which fits u32.
    n.div_ceil(per_block).clamp(1, MAX_BLOCKS) as u32
}

/// Bytes of a cross-entropy's results over `rows` rows: per-row losses (f64), per-row hits
/// (i32), and the label check's flag (u32).
fn loss_results_bytes(rows: usize) -> usize {
    rows * 8 + rows * 4 + 4
}

fn grid(n: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks_for(n, u64::from(THREADS)), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row; rows beyond the grid's x limit are refused by the caller's shape checks
/// long before (2^31 blocks of 4 rows).
fn warp_rows(rows: u64) -> LaunchConfig {
    let blocks = u32::try_from(rows.div_ceil(WARPS_PER_BLOCK).max(1)).unwrap_or(u32::MAX);
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: ((WARPS_PER_BLOCK * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Threads per block of `embedding_backward_rows_f32` (`EMBED_THREADS` in `kernels.cu`).
const EMBED_THREADS: u64 = 128;
/// Table rows x ids up to which the embedding gradient scans the ids once per table row: each
/// of those blocks reads every id, so large vocabularies keep the kernel with one thread per
/// column.
const EMBEDDING_ROW_SCAN_LIMIT: u64 = 1 << 22;

/// A column-major product's operations, sizes and leading dimensions, in cuBLAS's order:
/// `(transa, transb)`, `(m, n, k)`, `(lda, ldb, ldc)`.
#[derive(Clone, Copy)]
struct GemmDims {
    ops: (blas_sys::cublasOperation_t, blas_sys::cublasOperation_t),
    mnk: (i32, i32, i32),
    lds: (i32, i32, i32),
}

/// The tiled attention kernels of one head width and their blocks.
struct TiledAttention<'a> {
    forward: &'a CudaFunction,
    queries: &'a CudaFunction,
    keys: &'a CudaFunction,
    /// Query rows and threads per block of the forward kernel.
    forward_block: (u64, u32),
    /// Rows and threads per block of the two backward kernels.
    backward_block: (u64, u32),
    /// Whether the kernels read bf16 copies of qkv and dout (the tensor-core kernels).
    bf16_inputs: bool,
}

/// Rows per block of the SIMT tiled attention kernels, one thread each (`ATT_TILE` in
/// `kernels.cu`).
const ATTENTION_TILE: u64 = 64;

/// Warps per block of the tensor-core attention kernels, 16 rows each (`FA_FORWARD_WARPS`,
/// `FA_BACKWARD_WARPS` in `kernels.cu`).
const FLASH_FORWARD_WARPS: u64 = 8;
const FLASH_BACKWARD_WARPS: u64 = 4;

/// The tiled attention kernels' grid: blocks of `rows` rows of a sequence along x, (sequence,
/// head) pairs along y, `threads` threads a block.
fn attention_tiles(seq: u64, pairs: u64, (rows, threads): (u64, u32)) -> Result<LaunchConfig> {
    let too_many = |_| shape_err("attention", "too many sequences or heads for one launch");
    Ok(LaunchConfig {
        grid_dim: (
            u32::try_from(seq.div_ceil(rows)).map_err(too_many)?,
            u32::try_from(pairs).map_err(too_many)?,
            1,
        ),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Rows per chunk of the column sums' first pass (`COLUMN_CHUNK_ROWS` in `kernels.cu`).
const COLUMN_CHUNK_ROWS: u64 = 128;

/// The first pass of the column sums: 32 columns by 8 row threads a block, one block per
/// chunk of rows along y (looped past y's 65,535).
fn column_grid(chunks: u64, cols: u64) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (
            u32::try_from(cols.div_ceil(32)).map_err(|_| shape_err("column sums", "too wide"))?,
            chunks.clamp(1, 65_535) as u32,
            1,
        ),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    })
}

fn as_u64(n: usize) -> u64 {
    n as u64
}

fn gemm_dim(op: &'static str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| shape_err(op, format!("dimension {n} exceeds cuBLAS's 2^31")))
}

impl CudaBackend {
    /// `be` as the CUDA backend, for libraries that compute on its device buffers in its
    /// stream's order (NCCL); `None` for every other backend.
    pub fn of(be: &dyn Backend) -> Option<&CudaBackend> {
        be.as_any().downcast_ref()
    }

    /// Opens CUDA device `ordinal`: a context, a stream, a cuBLAS handle, the kernels compiled
    /// for the device's architecture by NVRTC, and an empty memory pool.
    ///
    /// # Errors
    /// [`KernelError::NoCuda`] without a driver, a device `ordinal` or NVRTC;
    /// [`KernelError::Cuda`] when the device refuses a step.
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_precision(ordinal, Precision::F32)
    }

    /// Opens CUDA device `ordinal` as [`CudaBackend::new`] does, its matrix products in
    /// `precision` (TF32 or bf16 inputs on tensor cores, f32 accumulation; see
    /// [`Precision`]).
    ///
    /// # Errors
    /// As [`CudaBackend::new`].
    pub fn with_precision(ordinal: usize, precision: Precision) -> Result<Self> {
        if matches!(precision, Precision::Bf16x6 | Precision::Bf16x3) {
            return Err(KernelError::Cuda {
                op: "open",
                detail: format!("{precision} is the cpu backend's precision (AMX tiles)"),
            });
        }
        let count = device_count()?;
        if ordinal >= count {
            return Err(KernelError::NoCuda {
                reason: format!("device {ordinal} requested, {count} visible"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err("context"))?;
        let name = ctx.name().map_err(driver_err("device name"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver_err("compute capability"))?;
        let arch = u32::try_from(major * 10 + minor).map_err(|_| KernelError::Cuda {
            op: "compute capability",
            detail: format!("{major}.{minor}"),
        })?;
        let stream = ctx.new_stream().map_err(driver_err("stream"))?;
        let module = ctx
            .load_module(module_for(arch)?)
            .map_err(driver_err("load module"))?;
        let kernels = Kernels::load(&module)?;
        // SAFETY: only tries to open the library; cudarc's loader panics without it.
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(KernelError::NoCuda {
                reason: format!(
                    "the cuBLAS library could not be loaded ({}); install the CUDA runtime \
                     libraries (a toolkit, or the nvidia-cublas wheel)",
                    explain(Library::Cublas)
                ),
            });
        }
        let blas = CudaBlas::new(Arc::clone(&stream)).map_err(cublas_err)?;
        let pool = Pool::new(Arc::clone(&stream));
        let lt = Lt::open(&ctx, arch);
        Ok(Self {
            ordinal,
            arch,
            precision,
            name,
            ctx,
            stream,
            blas: Mutex::new(blas),
            lt,
            marks: events::enabled(),
            kernels,
            pool,
            checked_starts: Mutex::default(),
            deferred: DeferredChecks::default(),
            rounded: Mutex::default(),
            borrowed: lending::Borrowed::default(),
        })
    }

    /// For a library that computes on this backend's tensors in its stream's order (NCCL):
    /// makes `t` one of this backend's buffers that no clone holds (copying it in where it is
    /// not), binds the context to this thread and returns the buffer's device pointer. The
    /// caller queues its work on [`CudaBackend::raw_stream`] and keeps `t` alive meanwhile.
    ///
    /// # Errors
    /// Device failures.
    pub fn raw_in_place(&self, t: &mut Tensor) -> Result<u64> {
        let ptr = self.in_place(t, "raw_in_place")?;
        self.ctx.bind_to_thread().map_err(driver_err("bind"))?;
        Ok(ptr)
    }

    /// Makes this backend's context current on the calling thread (libraries that use the
    /// current device, such as NCCL, need it).
    ///
    /// # Errors
    /// Device failures.
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_err("bind"))
    }

    /// The GPU's UUID: the same GPU has the same UUID in every process on every host.
    ///
    /// # Errors
    /// Device failures.
    pub fn device_uuid(&self) -> Result<[u8; 16]> {
        let uuid = self.ctx.uuid().map_err(driver_err("device uuid"))?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    /// The stream every operation of this backend is queued on.
    pub fn raw_stream(&self) -> driver_sys::CUstream {
        self.stream.cu_stream()
    }

    /// The precision of this backend's matrix products.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The CUDA device this backend computes on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// What the memory pool holds.
    pub fn memory(&self) -> PoolStats {
        self.pool.stats()
    }

    /// This backend's buffer behind `t`.
    ///
    /// # Errors
    /// [`KernelError::WrongDevice`] for a host tensor or another backend's buffer.
    fn buffer<'a, E: Element>(&self, t: &'a Tensor<E>, op: &'static str) -> Result<&'a CudaMemory> {
        let wrong = || KernelError::WrongDevice {
            op,
            expected: Device::Cuda(self.ordinal),
            found: t.device(),
        };
        match t.storage() {
            Storage::Device(m) => match m.as_any().downcast_ref::<CudaMemory>() {
                Some(c) if c.pool_id() == self.pool.id() => Ok(c),
                _ => Err(wrong()),
            },
            Storage::Host(_) => Err(wrong()),
        }
    }

    /// Launches `kernel` with a thread per element of `n` ([`grid`]) and the arguments `push`
    /// gives it; nothing where `n` is 0. `op` names the kernel in errors.
    ///
    /// # Safety
    /// `push` gives the arguments of the kernel's signature, and every buffer among them
    /// holds the `n` elements the kernel reaches.
    unsafe fn launch_elementwise<'a>(
        &'a self,
        kernel: &'a CudaFunction,
        n: u64,
        op: &'static str,
        push: impl FnOnce(&mut LaunchArgs<'a>),
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let mut b = self.stream.launch_builder(kernel);
        push(&mut b);
        // SAFETY: the caller's promise: the arguments match and the buffers hold n elements.
        unsafe { b.launch(grid(n)) }.map_err(driver_err(op))?;
        Ok(())
    }

    fn ptr<E: Element>(&self, t: &Tensor<E>, op: &'static str) -> Result<u64> {
        Ok(self.buffer(t, op)?.ptr())
    }

    /// Makes `t` a buffer of this backend's of `shape` that no clone shares, without keeping
    /// its contents (an output the kernel overwrites).
    fn output<E: Element>(&self, t: &mut Tensor<E>, shape: &[usize]) -> Result<u64> {
        let bytes = shape.iter().product::<usize>() * E::DTYPE.size();
        let reusable = match t.storage() {
            Storage::Device(m) => {
                Arc::strong_count(m) == 1
                    && m.bytes() == bytes
                    && m.as_any()
                        .downcast_ref::<CudaMemory>()
                        .is_some_and(|c| c.pool_id() == self.pool.id())
            }
            Storage::Host(_) => false,
        };
        let memory = match t.storage() {
            Storage::Device(m) if reusable => Arc::clone(m),
            _ => self.pool.allocate(bytes)?,
        };
        let ptr = memory
            .as_any()
            .downcast_ref::<CudaMemory>()
            .map(CudaMemory::ptr)
            .ok_or_else(|| shape_err("output", "not a CUDA buffer"))?;
        // Drop the old storage first so a reused buffer is held once again.
        *t = Tensor::default();
        *t = Tensor::from_device(shape, memory)?;
        Ok(ptr)
    }

    /// Makes `t` a buffer of this backend's that no clone shares, keeping its contents (copied
    /// from the host, from another backend, or from a shared buffer), for an in-place update.
    fn in_place(&self, t: &mut Tensor, op: &'static str) -> Result<u64> {
        let mine_alone = match t.storage() {
            Storage::Device(m) => Arc::strong_count(m) == 1 && self.buffer(t, op).is_ok(),
            Storage::Host(_) => false,
        };
        if !mine_alone {
            let shape = t.shape().to_vec();
            let source = std::mem::take(t);
            let placed = self.place_owned(source)?;
            *t = placed;
            if let Storage::Device(m) = t.storage()
                && Arc::strong_count(m) > 1
            {
                let copy = self.copy_to_new(&*t, &shape)?;
                *t = copy;
            }
        }
        let memory = match t.storage() {
            Storage::Device(m) => Arc::clone(m),
            Storage::Host(_) => return Err(shape_err(op, "in-place operand stayed on the host")),
        };
        // Re-setting the storage gives the tensor a new content stamp: it is about to change.
        t.set_storage(Storage::Device(memory))?;
        self.ptr(t, op)
    }

    fn copy_to_new<E: Element>(&self, src: &Tensor<E>, shape: &[usize]) -> Result<Tensor<E>> {
        let from = self.ptr(src, "copy")?;
        let mut out = Tensor::default();
        let to = self.output(&mut out, shape)?;
        self.copy_bytes(to, from, src.bytes())?;
        Ok(out)
    }

    fn copy_bytes(&self, to: u64, from: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(driver_err("bind"))?;
        // SAFETY: both pointers are this backend's live buffers of at least `bytes` bytes,
        // used in this stream's order.
        unsafe { driver::memcpy_dtod_async(to, from, bytes, self.stream.cu_stream()) }
            .map_err(driver_err("copy"))
    }

    fn upload<E: Element>(&self, data: &[E], shape: &[usize]) -> Result<Tensor<E>> {
        let mut out = Tensor::default();
        let ptr = self.output(&mut out, shape)?;
        if !data.is_empty() {
            self.ctx.bind_to_thread().map_err(driver_err("bind"))?;
            // SAFETY: `ptr` holds `size_of_val(data)` bytes; the stream is synchronised below,
            // before `data` (pageable memory the caller may free) can go away.
            unsafe { driver::memcpy_htod_async(ptr, data, self.stream.cu_stream()) }
                .map_err(driver_err("upload"))?;
            self.sync()?;
        }
        Ok(out)
    }

    fn download<T: Copy + Default>(&self, ptr: u64, len: usize) -> Result<Vec<T>> {
        let mut host = vec![T::default(); len];
        if len > 0 {
            self.ctx.bind_to_thread().map_err(driver_err("bind"))?;
            // SAFETY: `ptr` holds `len` elements of `T`, written in this stream's order; the
            // stream is synchronised before `host` is read.
            unsafe { driver::memcpy_dtoh_async(&mut host, ptr, self.stream.cu_stream()) }
                .map_err(driver_err("download"))?;
            self.sync()?;
        }
        Ok(host)
    }

    /// Element `index` of `t`, one of this backend's tensors, copied back (a wait); `None`
    /// past its end.
    fn element<E: Element>(
        &self,
        t: &Tensor<E>,
        index: usize,
        op: &'static str,
    ) -> Result<Option<E>> {
        if index >= t.len() {
            return Ok(None);
        }
        let ptr = self.ptr(t, op)? + as_u64(index * E::DTYPE.size());
        Ok(self.download::<E>(ptr, 1)?.first().copied())
    }

    /// Waits for the stream, then reads the checks queued without a wait
    /// ([`deferred`](super::deferred)): the first bad token id since the last wait is an
    /// error here.
    fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(driver_err("synchronize"))?;
        self.read_deferred_checks()
    }

    /// The queued token-id checks' flags, read in the order they were queued (the stream is
    /// idle): the first that failed, as the CPU backend's error names it.
    fn read_deferred_checks(&self) -> Result<()> {
        // Taken first, so the downloads below (which wait, and so come back here) find none.
        for check in self.deferred.take() {
            let flag = self.download::<u32>(self.ptr(&check.flag, "embedding")?, 1)?;
            let Some(index) = flag.first().copied().filter(|&v| v != u32::MAX) else {
                continue;
            };
            let index = index as usize;
            self.deferred.forget();
            let value = self.element(&check.ids, index, "embedding")?;
            return Err(KernelError::Token {
                index,
                value: value.unwrap_or(f32::NAN),
                vocab: check.vocab,
            });
        }
        Ok(())
    }

    /// `t` as one of this backend's tensors: as it is when it already is, uploaded from the
    /// host, or copied from another backend's buffer (another stream, perhaps another GPU)
    /// once both streams have finished with it.
    fn place_owned<E: Element>(&self, t: Tensor<E>) -> Result<Tensor<E>> {
        let shape = t.shape().to_vec();
        if self.buffer(&t, "place").is_ok() {
            return Ok(t);
        }
        match t.storage() {
            // An empty scratch tensor (no shape, no elements) stays empty.
            Storage::Host(v) if v.is_empty() => self.upload(v, &[0]),
            Storage::Host(v) => self.upload(v, &shape),
            Storage::Device(m) => {
                let Some(other) = m.as_any().downcast_ref::<CudaMemory>() else {
                    return Err(KernelError::WrongDevice {
                        op: "place",
                        expected: Device::Cuda(self.ordinal),
                        found: t.device(),
                    });
                };
                // The producer's queued work on the buffer must be done: wait for its stream,
                // then copy, then wait for our copy so the buffer can go back to its pool at
                // once.
                other.wait_for_producer()?;
                let mut out = Tensor::default();
                let to = self.output(&mut out, &shape)?;
                let bytes = t.bytes();
                if bytes > 0 {
                    self.ctx.bind_to_thread().map_err(driver_err("bind"))?;
                    // SAFETY: both buffers are live and hold `bytes` bytes; the source's device
                    // is idle and ours waits below before the source can be reused.
                    unsafe {
                        driver_sys::cuMemcpyPeerAsync(
                            to,
                            self.ctx.cu_ctx(),
                            other.ptr(),
                            other.context().cu_ctx(),
                            bytes,
                            self.stream.cu_stream(),
                        )
                    }
                    .result()
                    .map_err(driver_err("peer copy"))?;
                    self.sync()?;
                }
                Ok(out)
            }
        }
    }

    /// Queues a check kernel over the `n` ids at `data` against `limit`: it lowers the `u32`
    /// at `flag` from `u32::MAX` (set here, on the stream, with no wait) to the first bad index.
    fn queue_check(
        &self,
        check: &CudaFunction,
        data: u64,
        n: usize,
        limit: usize,
        flag: u64,
    ) -> Result<()> {
        let (n64, limit64, one) = (as_u64(n), as_u64(limit), 1u64);
        // All ones: the bits of u32::MAX written through the f32 fill.
        let all_ones = f32::from_bits(u32::MAX);
        let mut b = self.stream.launch_builder(&self.kernels.fill_f32);
        b.arg(&flag).arg(&one).arg(&all_ones);
        // SAFETY: `flag` is one live u32 slot of this backend's.
        unsafe { b.launch(grid(1)) }.map_err(driver_err("check ids"))?;
        if n == 0 {
            return Ok(());
        }
        let mut b = self.stream.launch_builder(check);
        b.arg(&data).arg(&n64).arg(&limit64).arg(&flag);
        // SAFETY: the argument list matches the kernel's signature; `data` holds n ids.
        unsafe { b.launch(grid(n64)) }.map_err(driver_err("check ids"))?;
        Ok(())
    }

    /// Runs a check kernel and reads its flag (one wait); `None` when every id passed.
    fn first_bad(
        &self,
        check: &CudaFunction,
        data: u64,
        n: usize,
        limit: usize,
    ) -> Result<Option<usize>> {
        let (_flag, flag_ptr) = self.scratch(1)?;
        self.queue_check(check, data, n, limit, flag_ptr)?;
        let got = self.download::<u32>(flag_ptr, 1)?;
        Ok(got
            .first()
            .copied()
            .filter(|&v| v != u32::MAX)
            .map(|v| v as usize))
    }

    /// Queues the check of `ids` against a table of `vocab` rows, read at the next wait
    /// ([`deferred`](super::deferred)); nothing when these contents were checked before.
    fn check_tokens(&self, ids: &Tensor, vocab: usize, op: &'static str) -> Result<()> {
        if self.deferred.checked(ids.stamp(), vocab) {
            return Ok(());
        }
        let ids_ptr = self.ptr(ids, op)?;
        let (flag, flag_ptr) = self.scratch(1)?;
        let check = &self.kernels.check_ids_f32;
        self.queue_check(check, ids_ptr, ids.len(), vocab, flag_ptr)?;
        let full = self.deferred.push(PendingIds {
            flag,
            ids: ids.clone(),
            vocab,
        });
        if full { self.sync() } else { Ok(()) }
    }

    /// The device address of an attention call's document starts (0, the kernels' null, for
    /// one document per sequence), checked as the CPU backend checks them before any kernel
    /// reads them: one wait, as the embedding's token check, the first time this backend sees
    /// these contents ([`CudaBackend::checked_starts`]).
    fn document_starts(
        &self,
        documents: Option<&Tensor>,
        shape: AttentionShape,
        op: &'static str,
    ) -> Result<u64> {
        let Some(starts) = documents else {
            return Ok(0);
        };
        crate::sequence::check_document_count(op, shape, starts.len())?;
        let starts_ptr = self.ptr(starts, op)?;
        let stamp = starts.stamp();
        if self.checked_starts.lock().is_ok_and(|s| s.contains(&stamp)) {
            return Ok(starts_ptr);
        }
        let check = &self.kernels.check_document_starts_f32;
        if let Some(k) = self.first_bad(check, starts_ptr, starts.len(), shape.seq)? {
            // The refused start and its predecessor's in its sequence, as the CPU reads them.
            let first = if k % shape.seq.max(1) > 0 { k - 1 } else { k };
            let values = self.download::<f32>(starts_ptr + as_u64(first * 4), k + 1 - first)?;
            let value = values.last().copied().unwrap_or(f32::NAN);
            let previous = (first < k).then(|| values.first().copied().unwrap_or(f32::NAN));
            let fault = crate::sequence::document_start_fault(op, shape, k, value, previous);
            return Err(fault.unwrap_or_else(|| {
                shape_err(
                    op,
                    format!("token {k}'s document start was refused on the device"),
                )
            }));
        }
        if let Ok(mut stamps) = self.checked_starts.lock() {
            if stamps.len() == CHECKED_STARTS {
                stamps.pop_front();
            }
            stamps.push_back(stamp);
        }
        Ok(starts_ptr)
    }

    fn reduce(&self, x: &Tensor, squares: bool) -> Result<f64> {
        if x.is_empty() {
            return Ok(0.0);
        }
        let xp = self.ptr(x, "sum")?;
        let mut partials = Tensor::<f32>::default();
        // REDUCE_BLOCKS f64 values are REDUCE_BLOCKS * 2 f32 slots.
        let pp = self.output(&mut partials, &[REDUCE_BLOCKS as usize * 2])?;
        let n = as_u64(x.len());
        let sq = i32::from(squares);
        let mut b = self.stream.launch_builder(&self.kernels.partial_sums_f32);
        b.arg(&xp).arg(&n).arg(&sq).arg(&pp);
        let cfg = LaunchConfig {
            grid_dim: (REDUCE_BLOCKS, 1, 1),
            block_dim: (REDUCE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `partials` holds REDUCE_BLOCKS doubles.
        unsafe { b.launch(cfg) }.map_err(driver_err("sum"))?;
        Ok(self
            .download::<f64>(pp, REDUCE_BLOCKS as usize)?
            .iter()
            .sum())
    }

    /// Column-major `C = alpha op(A) op(B) + beta C` in f32 (cuBLAS `sgemm`).
    fn sgemm(
        &self,
        d: GemmDims,
        (alpha, beta): (f32, f32),
        (a, b, c): (u64, u64, u64),
    ) -> Result<()> {
        let handle = self.blas.lock().unwrap_or_else(PoisonError::into_inner);
        self.ctx.bind_to_thread().map_err(driver_err("bind"))?;
        // SAFETY: the pointers are this backend's buffers of the sizes `d` describes (checked
        // by the caller); the handle is bound to this backend's stream.
        unsafe {
            blas::sgemm(
                *handle.handle(),
                d.ops.0,
                d.ops.1,
                d.mnk.0,
                d.mnk.1,
                d.mnk.2,
                &alpha,
                a as *const f32,
                d.lds.0,
                b as *const f32,
                d.lds.1,
                &beta,
                c as *mut f32,
                d.lds.2,
            )
        }
        .map_err(cublas_err)
    }

    /// Column-major `C = alpha op(A) op(B) + beta C` with A and B of `input` type, C in f32,
    /// accumulated as `compute` says (cuBLAS `GemmEx`).
    fn gemm_ex(
        &self,
        d: GemmDims,
        (alpha, beta): (f32, f32),
        (a, b, c): (u64, u64, u64),
        input: blas_sys::cudaDataType,
        compute: blas_sys::cublasComputeType_t,
    ) -> Result<()> {
        let handle = self.blas.lock().unwrap_or_else(PoisonError::into_inner);
        self.ctx.bind_to_thread().map_err(driver_err("bind"))?;
        // SAFETY: as `sgemm`; A and B hold elements of `input` type, C f32; alpha and beta
        // are f32, as the f32 compute types take them.
        unsafe {
            blas::gemm_ex(
                *handle.handle(),
                d.ops.0,
                d.ops.1,
                d.mnk.0,
                d.mnk.1,
                d.mnk.2,
                (&alpha as *const f32).cast(),
                a as *const std::ffi::c_void,
                input,
                d.lds.0,
                b as *const std::ffi::c_void,
                input,
                d.lds.1,
                (&beta as *const f32).cast(),
                c as *mut std::ffi::c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                d.lds.2,
                compute,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(cublas_err)
    }

    /// `y = x w + bias` through cuBLASLt's bias epilogue ([`epilogue`](super::epilogue)), or
    /// with `gelu`, `gelu = x w + bias` and `y = GELU(gelu)`: `false` where it has no
    /// algorithm for the product, with nothing queued.
    fn fused_linear(
        &self,
        lt: &Lt,
        (x, w, bias): (&Tensor, &Tensor, &Tensor),
        y: &mut Tensor,
        gelu: Option<&mut Tensor>,
    ) -> Result<bool> {
        let (m, k, n) = crate::check::matmul((x, Trans::No), (w, Trans::No), y, false)?;
        crate::backend::linear_bias(w, bias)?;
        let product = Product {
            m: as_u64(m),
            k: as_u64(k),
            n: as_u64(n),
            precision: self.precision,
            epilogue: if gelu.is_some() {
                Epilogue::BiasGelu
            } else {
                Epilogue::Bias
            },
            accumulate: false,
        };
        if m == 0 || n == 0 || k == 0 || lt.refuses(&product) {
            return Ok(false);
        }
        let (xp, wp, bp) = (
            self.ptr(x, "linear")?,
            self.ptr(w, "linear")?,
            self.ptr(bias, "linear")?,
        );
        let yp = self.output(y, &[m, n])?;
        let aux = match gelu {
            Some(z) => self.output(z, &[m, n])?,
            None => 0,
        };
        let operands = Operands {
            w: wp,
            x: xp,
            bias: bp,
            y: yp,
            aux,
        };
        self.lt_product(lt, product, operands, (x, w))
    }

    /// `dz = GELU'(pre) (.) (dy w^T)` through cuBLASLt's GELU-gradient epilogue
    /// ([`epilogue`](super::epilogue)): `false` where it has no algorithm for the product, with
    /// nothing queued.
    fn fused_gelu_grad(
        &self,
        lt: &Lt,
        (dy, w, pre): (&Tensor, &Tensor, &Tensor),
        dz: &mut Tensor,
    ) -> Result<bool> {
        let (m, k, n) = crate::check::matmul((dy, Trans::No), (w, Trans::Yes), dz, false)?;
        if pre.len() != m * n {
            return Err(shape_err(
                "linear_grad_activation",
                format!(
                    "the activation's input {:?} for a {m}x{n} gradient",
                    pre.shape()
                ),
            ));
        }
        let product = Product {
            m: as_u64(m),
            k: as_u64(k),
            n: as_u64(n),
            precision: self.precision,
            epilogue: Epilogue::GeluGrad,
            accumulate: false,
        };
        if m == 0 || n == 0 || k == 0 || lt.refuses(&product) {
            return Ok(false);
        }
        let (dyp, wp, zp) = (
            self.ptr(dy, "linear_grad_activation")?,
            self.ptr(w, "linear_grad_activation")?,
            self.ptr(pre, "linear_grad_activation")?,
        );
        let operands = Operands {
            w: wp,
            x: dyp,
            bias: 0,
            y: self.output(dz, pre.shape())?,
            aux: zp,
        };
        self.lt_product(lt, product, operands, (dy, w))
    }

    /// `gw (+)= x^T dy` with the bias gradient, `dy`'s column sums, summed in the product
    /// by cuBLASLt's `BGRADA` epilogue ([`epilogue`](super::epilogue)) into `gb` (into a
    /// scratch vector added to `gb` when accumulating: the epilogue writes, it does not add):
    /// `false` where it has no algorithm for the product, with nothing queued.
    fn fused_weight_grads(
        &self,
        lt: &Lt,
        (x, dy): (&Tensor, &Tensor),
        gw: &mut Tensor,
        gb: &mut Tensor,
        accumulate: bool,
    ) -> Result<bool> {
        let (m, k, n) = crate::check::matmul((x, Trans::Yes), (dy, Trans::No), gw, accumulate)?;
        if accumulate {
            crate::check::sum_rows_into(dy, gb)?;
        }
        let product = Product {
            m: as_u64(m),
            k: as_u64(k),
            n: as_u64(n),
            precision: self.precision,
            epilogue: Epilogue::BiasGrad,
            accumulate,
        };
        if m == 0 || n == 0 || k == 0 || lt.refuses(&product) {
            return Ok(false);
        }
        let (xp, dyp) = (
            self.ptr(x, "linear_weight_grads")?,
            self.ptr(dy, "linear_weight_grads")?,
        );
        let gwp = if accumulate {
            self.in_place(gw, "linear_weight_grads")?
        } else {
            self.output(gw, &[m, n])?
        };
        let mut sums = Tensor::default();
        let bias = if accumulate {
            self.output(&mut sums, &[n])?
        } else {
            self.output(gb, &[n])?
        };
        let operands = Operands {
            w: dyp,
            x: xp,
            bias,
            y: gwp,
            aux: 0,
        };
        if !self.lt_product(lt, product, operands, (x, dy))? {
            return Ok(false);
        }
        if accumulate {
            self.axpy(1.0, &sums, gb)?;
        }
        Ok(true)
    }

    /// Queues `product` through cuBLASLt with `operands`, whose weight `w` and rows `x` are
    /// first rounded into bf16 copies under bf16 (kept until the product is queued; the
    /// stream orders their reuse).
    fn lt_product(
        &self,
        lt: &Lt,
        product: Product,
        mut operands: Operands,
        (x, w): (&Tensor, &Tensor),
    ) -> Result<bool> {
        let _copies = if self.precision == Precision::Bf16 {
            let (x16, x16p) = self.to_bf16(x, "linear")?;
            let (w16, w16p) = self.to_bf16(w, "linear")?;
            (operands.x, operands.w) = (x16p, w16p);
            Some((x16, w16))
        } else {
            None
        };
        self.ctx.bind_to_thread().map_err(driver_err("bind"))?;
        Ok(lt.product(product, &operands, self.stream.cu_stream().cast()))
    }

    /// `t` rounded to bf16 (nearest even) in a scratch buffer, and the buffer's pointer.
    ///
    /// The copy is kept for the next product that reads the same contents (equal content
    /// stamps), among the last [`ROUNDED_KEPT`] rounded, and handed over once more: a linear
    /// layer's output gradient is read by its input gradient's product and its weight
    /// gradient's, one after the other, and is rounded once for both. A copy handed over twice
    /// is forgotten, so a buffer outlives its products by at most three roundings.
    fn to_bf16(&self, t: &Tensor, op: &'static str) -> Result<(Tensor, u64)> {
        let stamp = t.stamp();
        if let Ok(mut kept) = self.rounded.lock()
            && let Some(i) = kept.iter().position(|r| r.stamp == stamp)
            && let Some(hit) = kept.remove(i)
        {
            return Ok((hit.copy, hit.ptr));
        }
        let from = self.ptr(t, op)?;
        let n = as_u64(t.len());
        // Two bf16 values per f32 slot of the scratch buffer.
        let (scratch, to) = self.scratch(t.len().div_ceil(2))?;
        if n > 0 {
            let mut b = self.stream.launch_builder(&self.kernels.to_bf16);
            b.arg(&from).arg(&to).arg(&n);
            // SAFETY: `from` holds n floats, `to` room for n bf16 values; four a thread.
            unsafe { b.launch(grid(n.div_ceil(4))) }.map_err(driver_err(op))?;
        }
        if let Ok(mut kept) = self.rounded.lock() {
            kept.push_back(Rounded {
                stamp,
                copy: scratch.clone(),
                ptr: to,
            });
            while kept.len() > ROUNDED_KEPT {
                kept.pop_front();
            }
        }
        Ok((scratch, to))
    }

    /// The statistics of one queued cross-entropy ([`Backend::queue_softmax_cross_entropy`]):
    /// its results copied back (a wait), the label check's flag first.
    fn read_loss(&self, queued: &QueuedLoss) -> Result<LossStats> {
        let rows = queued.rows;
        let lossp = self.ptr(&queued.results, "read_losses")?;
        let bytes = self.download::<u8>(lossp, loss_results_bytes(rows))?;
        let (losses, rest) = bytes.split_at(rows * 8);
        let (hits, flag) = rest.split_at(rows * 4);
        let flag = flag.try_into().map(u32::from_le_bytes).unwrap_or(u32::MAX);
        if flag != u32::MAX {
            let row = flag as usize;
            let label = self.element(&queued.labels, row, "read_losses")?;
            return Err(KernelError::Label {
                row,
                label: label.unwrap_or(u32::MAX),
                classes: queued.classes,
            });
        }
        // Summed in row order on the host, as the CPU backend sums them (an ignored row's 0
        // adds nothing).
        let mut stats = LossStats {
            loss_sum: losses
                .chunks_exact(8)
                .filter_map(|b| b.try_into().ok().map(f64::from_le_bytes))
                .sum(),
            ..LossStats::default()
        };
        for hit in hits.chunks_exact(4).filter_map(|b| b.try_into().ok()) {
            match i32::from_le_bytes(hit) {
                -1 => {}
                h => {
                    stats.rows += 1;
                    stats.correct += usize::from(h == 1);
                }
            }
        }
        Ok(stats)
    }

    /// Large tables' embedding gradient (`embedding_backward_grouped_f32` and its passes in
    /// `kernels.cu`): the `n` ids at `ip` grouped by id, then each table row of the `rows x w`
    /// table at `tp` adds its gradient rows of `dyp` in position order.
    fn embedding_backward_grouped(
        &self,
        (ip, n): (u64, u64),
        dyp: u64,
        (tp, rows, w): (u64, u64, u64),
    ) -> Result<()> {
        let op = "embedding_backward";
        let too_many = |_| shape_err(op, "too many ids or table rows for one launch");
        let slots = |k: u64| usize::try_from(k).map_err(too_many);
        // u32 scratch in f32 slots: counts (zeroed), offsets, ranks and grouped positions.
        let (mut count, countp) = self.scratch(slots(rows)?)?;
        self.fill(0.0, &mut count)?;
        let (_offset, offsetp) = self.scratch(slots(rows + 1)?)?;
        let (_rank, rankp) = self.scratch(slots(n)?)?;
        let (_positions, positionsp) = self.scratch(slots(n)?)?;
        let ranks = LaunchConfig {
            grid_dim: (u32::try_from(n.div_ceil(256)).map_err(too_many)?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self
            .stream
            .launch_builder(&self.kernels.embedding_rank_ids_f32);
        b.arg(&ip).arg(&n).arg(&rankp).arg(&countp).arg(&rows);
        // SAFETY: n ids, n ranks, rows counts (an id that is no row is not counted).
        unsafe { b.launch(ranks) }.map_err(driver_err(op))?;
        let scan = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.kernels.exclusive_scan_u32);
        b.arg(&countp).arg(&offsetp).arg(&rows);
        // SAFETY: rows counts, rows + 1 offsets.
        unsafe { b.launch(scan) }.map_err(driver_err(op))?;
        let mut b = self
            .stream
            .launch_builder(&self.kernels.embedding_group_ids_f32);
        b.arg(&ip)
            .arg(&rankp)
            .arg(&offsetp)
            .arg(&n)
            .arg(&positionsp)
            .arg(&rows);
        // SAFETY: every counted id's offset plus rank is below n; the others are skipped.
        unsafe { b.launch(grid(n)) }.map_err(driver_err(op))?;
        let rows_cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(w.div_ceil(EMBED_THREADS)).map_err(|_| shape_err(op, "too wide"))?,
                rows.clamp(1, 65_535) as u32,
                1,
            ),
            block_dim: (EMBED_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self
            .stream
            .launch_builder(&self.kernels.embedding_backward_grouped_f32);
        b.arg(&offsetp)
            .arg(&positionsp)
            .arg(&dyp)
            .arg(&tp)
            .arg(&w)
            .arg(&rows);
        // SAFETY: positions index dy's n rows; the table holds rows x w floats.
        unsafe { b.launch(rows_cfg) }.map_err(driver_err(op))?;
        Ok(())
    }

    /// A scratch buffer of this backend's holding `len` floats, returned to the pool when
    /// dropped (later work on this stream may reuse it: the stream orders every use).
    fn scratch(&self, len: usize) -> Result<(Tensor, u64)> {
        let mut t = Tensor::default();
        let ptr = self.output(&mut t, &[len])?;
        Ok((t, ptr))
    }

    /// The column sums of a row-major `rows x cols` buffer at `xp` into the `cols` floats at
    /// `out` (added to them when `accumulate`), by the two deterministic passes of
    /// `column_partials_f32` and `sum_partials_f32`.
    fn column_sums(
        &self,
        xp: u64,
        (rows, cols): (u64, u64),
        out: u64,
        accumulate: bool,
    ) -> Result<()> {
        let chunks = rows.div_ceil(COLUMN_CHUNK_ROWS);
        let (_partials, pp) = self.scratch(usize::try_from(chunks * cols).unwrap_or(usize::MAX))?;
        if chunks > 0 {
            let mut b = self
                .stream
                .launch_builder(&self.kernels.column_partials_f32);
            b.arg(&xp).arg(&pp).arg(&rows).arg(&cols);
            // SAFETY: x holds rows x cols floats, the partials chunks x cols.
            unsafe { b.launch(column_grid(chunks, cols)?) }.map_err(driver_err("column sums"))?;
        }
        self.sum_partials(pp, chunks, cols, out, accumulate)
    }

    /// `out[j] (+)= sum over c of partials[c * cols + j]`, one warp per column.
    fn sum_partials(
        &self,
        pp: u64,
        chunks: u64,
        cols: u64,
        out: u64,
        accumulate: bool,
    ) -> Result<()> {
        let acc = i32::from(accumulate);
        let mut b = self.stream.launch_builder(&self.kernels.sum_partials_f32);
        b.arg(&pp).arg(&out).arg(&chunks).arg(&cols).arg(&acc);
        // SAFETY: the partials hold chunks x cols floats, out cols.
        unsafe { b.launch(warp_rows(cols)) }.map_err(driver_err("column sums"))?;
        Ok(())
    }

    /// The tiled attention kernels for this shape's head width, where there are some (16, 32
    /// and 64 features); other widths take the one-warp-per-row kernels. In bf16 precision on
    /// sm_80 or newer, 64 features take the tensor-core kernels (see `kernels.cu`).
    fn tiled_attention(&self, shape: AttentionShape) -> Option<TiledAttention<'_>> {
        if shape.batch * shape.heads > 65_535 {
            return None;
        }
        let k = &self.kernels;
        let head = shape.width / shape.heads.max(1);
        if head == 64 && self.precision == Precision::Bf16 && self.arch >= 80 {
            return Some(TiledAttention {
                forward: &k.attention_mma_64,
                queries: &k.attention_backward_queries_mma_64,
                keys: &k.attention_backward_keys_mma_64,
                forward_block: (16 * FLASH_FORWARD_WARPS, 32 * FLASH_FORWARD_WARPS as u32),
                backward_block: (16 * FLASH_BACKWARD_WARPS, 32 * FLASH_BACKWARD_WARPS as u32),
                bf16_inputs: true,
            });
        }
        let simt = (ATTENTION_TILE, ATTENTION_TILE as u32);
        let (forward, queries, keys) = match shape.width / shape.heads.max(1) {
            16 => (
                &k.attention_tiled_16,
                &k.attention_backward_queries_tiled_16,
                &k.attention_backward_keys_tiled_16,
            ),
            32 => (
                &k.attention_tiled_32,
                &k.attention_backward_queries_tiled_32,
                &k.attention_backward_keys_tiled_32,
            ),
            64 => (
                &k.attention_tiled_64,
                &k.attention_backward_queries_tiled_64,
                &k.attention_backward_keys_tiled_64,
            ),
            _ => return None,
        };
        Some(TiledAttention {
            forward,
            queries,
            keys,
            forward_block: simt,
            backward_block: simt,
            bf16_inputs: false,
        })
    }

    fn attention_dims(shape: AttentionShape, op: &'static str) -> Result<[u64; 4]> {
        let head = shape.width / shape.heads.max(1);
        if head > MAX_HEAD_DIM {
            return Err(shape_err(
                op,
                format!("head width {head} exceeds the CUDA kernels' {MAX_HEAD_DIM}"),
            ));
        }
        Ok([
            as_u64(shape.batch),
            as_u64(shape.seq),
            as_u64(shape.heads),
            as_u64(shape.width),
        ])
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Queued kernels must finish before their module and cuBLAS handle go; nothing can
        // report an error from here, and a device fault is reported by the call that queued it.
        let _ = self.stream.synchronize();
        if self.ctx.bind_to_thread().is_ok() {
            self.borrowed.close_all();
        }
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn threads(&self) -> usize {
        1
    }

    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn synchronize(&self) -> Result<()> {
        self.sync()
    }

    fn peak_memory(&self) -> Option<u64> {
        Some(self.pool.stats().peak_in_use_bytes as u64)
    }

    fn mark(&self) -> Result<Option<Box<dyn crate::DeviceMark>>> {
        if !self.marks {
            return Ok(None);
        }
        Ok(Some(Box::new(CudaMark::record(&self.stream)?)))
    }

    fn lend(&self, t: &Tensor) -> Result<Option<Vec<u8>>> {
        let memory = match t.storage() {
            Storage::Host(_) => return Ok(None),
            Storage::Device(_) => self.buffer(t, "lend")?,
        };
        // The buffer must be written before another process reads it.
        self.sync()?;
        self.ctx.bind_to_thread().map_err(driver_err("bind"))?;
        lending::lend(&self.pool, self.ordinal, memory.ptr()).map(Some)
    }

    fn copy_lent(&self, handle: &[u8], shape: &[usize]) -> Result<Tensor> {
        let len = lending::byte_len(shape)?;
        self.ctx.bind_to_thread().map_err(driver_err("bind"))?;
        let src = lending::source(&self.borrowed, handle, len)?;
        let mut out = Tensor::default();
        let dst = self.output(&mut out, shape)?;
        if len > 0 {
            // SAFETY: `dst` holds `len` bytes of this pool; `src` is a live allocation of at
            // least `len` bytes (checked by `source`) that its lender does not write until told
            // the copy is done, which the wait below comes before.
            unsafe { driver_sys::cuMemcpyAsync(dst, src, len, self.stream.cu_stream()) }
                .result()
                .map_err(driver_err("copy a lent buffer"))?;
        }
        self.sync()?;
        Ok(out)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn place(&self, t: Tensor) -> Result<Tensor> {
        self.place_owned(t)
    }

    fn place_ids(&self, t: Tensor<u32>) -> Result<Tensor<u32>> {
        self.place_owned(t)
    }

    fn read<'a>(&self, t: &'a Tensor) -> Result<Cow<'a, [f32]>> {
        match t.storage() {
            Storage::Host(v) => Ok(Cow::Borrowed(v)),
            Storage::Device(_) => {
                let mine = self.place_owned(t.clone())?;
                Ok(Cow::Owned(
                    self.download(self.ptr(&mine, "read")?, t.len())?,
                ))
            }
        }
    }

    fn write(&self, src: &[f32], t: &mut Tensor) -> Result<()> {
        crate::check::write(src.len(), t)?;
        let shape = t.shape().to_vec();
        *t = self.upload(src, &shape)?;
        Ok(())
    }

    fn copy(&self, src: &Tensor, dst: &mut Tensor) -> Result<()> {
        let from = self.ptr(src, "copy")?;
        let to = self.output(dst, src.shape())?;
        self.copy_bytes(to, from, src.bytes())
    }

    fn fill(&self, value: f32, x: &mut Tensor) -> Result<()> {
        let shape = x.shape().to_vec();
        let p = self.output(x, &shape)?;
        let n = as_u64(x.len());
        // SAFETY: `x` holds n floats.
        unsafe {
            self.launch_elementwise(&self.kernels.fill_f32, n, "fill", |b| {
                b.arg(&p).arg(&n).arg(&value);
            })
        }
    }

    fn mul(&self, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
        crate::check::same_len("mul", (a, b), ("a", "b"))?;
        let (ap, bp) = (self.ptr(a, "mul")?, self.ptr(b, "mul")?);
        let op = self.output(out, a.shape())?;
        let n = as_u64(a.len());
        // SAFETY: the three buffers hold n floats.
        unsafe {
            self.launch_elementwise(&self.kernels.mul_f32, n, "mul", |b| {
                b.arg(&ap).arg(&bp).arg(&op).arg(&n);
            })
        }
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
        let (m, k, n) = crate::check::matmul((a, ta), (b, tb), c, accumulate)?;
        let (ap, bp) = (self.ptr(a, "matmul")?, self.ptr(b, "matmul")?);
        let cp = if accumulate {
            self.in_place(c, "matmul")?
        } else {
            self.output(c, &[m, n])?
        };
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            return if accumulate {
                Ok(())
            } else {
                self.fill(0.0, c)
            };
        }
        // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: hand cuBLAS B first.
        let op = |t: Trans| match t {
            Trans::No => blas_sys::cublasOperation_t::CUBLAS_OP_N,
            Trans::Yes => blas_sys::cublasOperation_t::CUBLAS_OP_T,
        };
        let (mi, ni, ki) = (
            gemm_dim("matmul", m)?,
            gemm_dim("matmul", n)?,
            gemm_dim("matmul", k)?,
        );
        let (lda, ldb) = (gemm_dim("matmul", a.cols())?, gemm_dim("matmul", b.cols())?);
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let dims = GemmDims {
            ops: (op(tb), op(ta)),
            mnk: (ni, mi, ki),
            lds: (ldb, lda, ni),
        };
        match self.precision {
            // bf16x6 and bf16x3 are refused when the backend opens (`with_precision`).
            Precision::F32 | Precision::Bf16x6 | Precision::Bf16x3 => {
                self.sgemm(dims, (alpha, beta), (bp, ap, cp))
            }
            Precision::Tf32 => {
                let f32_type = blas_sys::cudaDataType::CUDA_R_32F;
                let compute = blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32;
                self.gemm_ex(dims, (alpha, beta), (bp, ap, cp), f32_type, compute)
            }
            Precision::Bf16 => {
                // Both operands rounded to bf16 in scratch buffers (freed to the pool when
                // this returns; the stream orders their reuse after the product).
                let (_b16, b16p) = self.to_bf16(b, "matmul")?;
                let (_a16, a16p) = self.to_bf16(a, "matmul")?;
                let bf16_type = blas_sys::cudaDataType::CUDA_R_16BF;
                let compute = blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
                self.gemm_ex(dims, (alpha, beta), (b16p, a16p, cp), bf16_type, compute)
            }
        }
    }

    fn fuses_linear_epilogues(&self) -> bool {
        self.lt.is_some()
    }

    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, y: &mut Tensor) -> Result<()> {
        if let (Some(b), Some(lt)) = (bias, &self.lt)
            && self.fused_linear(lt, (x, w, b), y, None)?
        {
            return Ok(());
        }
        crate::backend::linear_by_parts(self, x, w, bias, y)
    }

    fn linear_activation(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        act: Activation,
        pre: &mut Tensor,
        y: &mut Tensor,
    ) -> Result<()> {
        if let (Some(b), Some(lt), Activation::Gelu) = (bias, &self.lt, act)
            && self.fused_linear(lt, (x, w, b), y, Some(pre))?
        {
            return Ok(());
        }
        crate::backend::linear_activation_by_parts(self, (x, w, bias), act, pre, y)
    }

    fn linear_weight_grads(
        &self,
        x: &Tensor,
        dy: &Tensor,
        gw: &mut Tensor,
        gb: Option<&mut Tensor>,
        accumulate: bool,
    ) -> Result<()> {
        match (gb, &self.lt) {
            (Some(gb), Some(lt)) => {
                if self.fused_weight_grads(lt, (x, dy), gw, gb, accumulate)? {
                    return Ok(());
                }
                let parts = Some(gb);
                crate::backend::linear_weight_grads_by_parts(self, (x, dy), gw, parts, accumulate)
            }
            (gb, _) => {
                crate::backend::linear_weight_grads_by_parts(self, (x, dy), gw, gb, accumulate)
            }
        }
    }

    fn linear_grad_activation(
        &self,
        dy: &Tensor,
        w: &Tensor,
        act: Activation,
        pre: &Tensor,
        dz: &mut Tensor,
    ) -> Result<()> {
        if let (Some(lt), Activation::Gelu) = (&self.lt, act)
            && self.fused_gelu_grad(lt, (dy, w, pre), dz)?
        {
            return Ok(());
        }
        crate::backend::linear_grad_activation_by_parts(self, dy, w, act, pre, dz)
    }

    fn transpose(&self, a: &Tensor, out: &mut Tensor) -> Result<()> {
        let (rows, cols) = (a.rows(), a.cols());
        let ap = self.ptr(a, "transpose")?;
        let op = self.output(out, &[cols, rows])?;
        if a.is_empty() {
            return Ok(());
        }
        let (r, c) = (as_u64(rows), as_u64(cols));
        // Column tiles across x (up to 2^31 - 1), row tiles across y, looped past y's 65,535.
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(c.div_ceil(32)).map_err(|_| shape_err("transpose", "too wide"))?,
                r.div_ceil(32).min(65_535) as u32,
                1,
            ),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.kernels.transpose_f32);
        b.arg(&ap).arg(&op).arg(&r).arg(&c);
        // SAFETY: both buffers hold rows x cols floats.
        unsafe { b.launch(cfg) }.map_err(driver_err("transpose"))?;
        Ok(())
    }

    fn add_bias(&self, y: &mut Tensor, bias: &Tensor) -> Result<()> {
        crate::check::bias(y, bias)?;
        let bp = self.ptr(bias, "add_bias")?;
        let yp = self.in_place(y, "add_bias")?;
        let (rows, cols) = (as_u64(y.rows()), as_u64(y.cols()));
        if y.is_empty() {
            return Ok(());
        }
        let mut b = self.stream.launch_builder(&self.kernels.add_bias_f32);
        b.arg(&yp).arg(&bp).arg(&rows).arg(&cols);
        // SAFETY: y holds rows x cols floats, bias cols.
        unsafe { b.launch(grid(rows * cols)) }.map_err(driver_err("add_bias"))?;
        Ok(())
    }

    fn sum_rows(&self, x: &Tensor, out: &mut Tensor, accumulate: bool) -> Result<()> {
        let cols = x.cols();
        let xp = self.ptr(x, "sum_rows")?;
        let op = if accumulate {
            crate::check::sum_rows_into(x, out)?;
            self.in_place(out, "sum_rows")?
        } else {
            self.output(out, &[cols])?
        };
        if cols == 0 {
            return Ok(());
        }
        let (r, c) = (
            as_u64(if x.is_empty() { 0 } else { x.rows() }),
            as_u64(cols),
        );
        self.column_sums(xp, (r, c), op, accumulate)
    }

    fn activation(&self, act: Activation, x: &Tensor, y: &mut Tensor) -> Result<()> {
        let xp = self.ptr(x, "activation")?;
        let yp = self.output(y, x.shape())?;
        let code = activation_code(act);
        let n = as_u64(x.len());
        // SAFETY: both buffers hold n floats.
        unsafe {
            self.launch_elementwise(&self.kernels.activation_f32, n, "activation", |b| {
                b.arg(&code).arg(&xp).arg(&yp).arg(&n);
            })
        }
    }

    fn activation_backward(
        &self,
        act: Activation,
        x: &Tensor,
        dy: &Tensor,
        dx: &mut Tensor,
    ) -> Result<()> {
        crate::check::activation_backward(x, dy)?;
        let (xp, dyp) = (
            self.ptr(x, "activation_backward")?,
            self.ptr(dy, "activation_backward")?,
        );
        let dxp = self.output(dx, x.shape())?;
        let code = activation_code(act);
        let n = as_u64(x.len());
        // SAFETY: all three buffers hold n floats.
        unsafe {
            self.launch_elementwise(
                &self.kernels.activation_backward_f32,
                n,
                "activation_backward",
                |b| {
                    b.arg(&code).arg(&xp).arg(&dyp).arg(&dxp).arg(&n);
                },
            )
        }
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
        let (rows, cols) = (x.rows(), x.cols());
        crate::check::layer_norm(x, gamma, beta)?;
        let (xp, gp, bp) = (
            self.ptr(x, "layer_norm")?,
            self.ptr(gamma, "layer_norm")?,
            self.ptr(beta, "layer_norm")?,
        );
        let yp = self.output(y, x.shape())?;
        let mp = self.output(mean, &[rows])?;
        let rp = self.output(rstd, &[rows])?;
        if cols == 0 || x.is_empty() {
            return Ok(());
        }
        let (r, c) = (as_u64(rows), as_u64(cols));
        let mut b = self.stream.launch_builder(&self.kernels.layer_norm_f32);
        b.arg(&xp).arg(&gp).arg(&bp).arg(&eps);
        b.arg(&yp).arg(&mp).arg(&rp).arg(&r).arg(&c);
        // SAFETY: shapes checked above; one warp per row.
        unsafe { b.launch(warp_rows(r)) }.map_err(driver_err("layer_norm"))?;
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
        let (rows, cols) = (x.rows(), x.cols());
        crate::check::layer_norm_backward_input(x, gamma, (mean, rstd), dy)?;
        let op = "layer_norm_backward_input";
        let (xp, gp, mp, rp, dyp) = (
            self.ptr(x, op)?,
            self.ptr(gamma, op)?,
            self.ptr(mean, op)?,
            self.ptr(rstd, op)?,
            self.ptr(dy, op)?,
        );
        let dxp = self.output(dx, x.shape())?;
        if cols == 0 || x.is_empty() {
            return Ok(());
        }
        let (r, c) = (as_u64(rows), as_u64(cols));
        let mut b = self
            .stream
            .launch_builder(&self.kernels.layer_norm_backward_input_f32);
        b.arg(&xp).arg(&gp).arg(&mp).arg(&rp).arg(&dyp).arg(&dxp);
        b.arg(&r).arg(&c);
        // SAFETY: shapes checked above; one warp per row.
        unsafe { b.launch(warp_rows(r)) }.map_err(driver_err(op))?;
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
        let (rows, cols) = (x.rows(), x.cols());
        let op = "layer_norm_backward_params";
        crate::check::layer_norm_backward_params(x, (mean, rstd), dy, (dgamma, dbeta), accumulate)?;

        let (xp, mp, rp, dyp) = (
            self.ptr(x, op)?,
            self.ptr(mean, op)?,
            self.ptr(rstd, op)?,
            self.ptr(dy, op)?,
        );
        let (gp, bp) = if accumulate {
            (self.in_place(dgamma, op)?, self.in_place(dbeta, op)?)
        } else {
            (self.output(dgamma, &[cols])?, self.output(dbeta, &[cols])?)
        };
        if cols == 0 {
            return Ok(());
        }
        let (r, c) = (as_u64(if x.is_empty() { 0 } else { rows }), as_u64(cols));
        let chunks = r.div_ceil(COLUMN_CHUNK_ROWS);
        let (_partials, pp) =
            self.scratch(usize::try_from(2 * chunks * c).unwrap_or(usize::MAX))?;
        if chunks > 0 {
            let mut b = self
                .stream
                .launch_builder(&self.kernels.layer_norm_param_partials_f32);
            b.arg(&xp)
                .arg(&mp)
                .arg(&rp)
                .arg(&dyp)
                .arg(&pp)
                .arg(&r)
                .arg(&c);
            // SAFETY: shapes checked above; the partials hold 2 x chunks x cols floats.
            unsafe { b.launch(column_grid(chunks, c)?) }.map_err(driver_err(op))?;
        }
        self.sum_partials(pp, chunks, c, gp, accumulate)?;
        self.sum_partials(pp + 4 * chunks * c, chunks, c, bp, accumulate)
    }

    fn softmax_cross_entropy(
        &self,
        logits: &Tensor,
        classes: usize,
        labels: &Tensor<u32>,
        grad_scale: f32,
        dlogits: Option<&mut Tensor>,
    ) -> Result<LossStats> {
        let reading =
            self.queue_softmax_cross_entropy(logits, classes, labels, grad_scale, dlogits)?;
        let stats = self.read_losses(vec![reading])?;
        Ok(stats.into_iter().next().unwrap_or_default())
    }

    fn queue_softmax_cross_entropy(
        &self,
        logits: &Tensor,
        classes: usize,
        labels: &Tensor<u32>,
        grad_scale: f32,
        dlogits: Option<&mut Tensor>,
    ) -> Result<LossReading> {
        let (rows, n) = (logits.rows(), classes);
        let op = "softmax_cross_entropy";
        crate::check::label_count(logits, classes, labels)?;
        let (lp, yp) = (self.ptr(logits, op)?, self.ptr(labels, op)?);
        if rows == 0 {
            return Ok(LossReading::Ready(LossStats::default()));
        }
        // One buffer, read later in one copy (`read_losses`): per-row losses (f64), per-row
        // hits (i32: 1 a hit, 0 a miss, -1 a row labelled IGNORED_LABEL), then the label
        // check's flag (u32::MAX when every label is below n or ignored).
        let (results, lossp) = self.scratch(loss_results_bytes(rows).div_ceil(4))?;
        let hitp = lossp + as_u64(rows * 8);
        let flagp = hitp + as_u64(rows * 4);
        self.queue_check(&self.kernels.check_labels_u32, yp, rows, n, flagp)?;
        let dp = match dlogits {
            Some(d) => self.output(d, logits.shape())?,
            None => 0,
        };
        let (r, c, stride) = (as_u64(rows), as_u64(n), as_u64(logits.cols()));
        let mut b = self.stream.launch_builder(&self.kernels.softmax_xent_f32);
        b.arg(&lp)
            .arg(&yp)
            .arg(&r)
            .arg(&c)
            .arg(&stride)
            .arg(&grad_scale);
        b.arg(&dp).arg(&lossp).arg(&hitp);
        // SAFETY: shapes checked above; `dp` is null when no gradient is wanted; a row whose
        // label is out of range or ignored reads no logit by it (the kernel skips it), so no
        // class is read when there are none.
        unsafe { b.launch(warp_rows(r)) }.map_err(driver_err(op))?;
        Ok(LossReading::Queued(QueuedLoss {
            results,
            labels: labels.clone(),
            rows,
            classes: n,
        }))
    }

    fn read_losses(&self, readings: Vec<LossReading>) -> Result<Vec<LossStats>> {
        // One wait for all: the first download waits, the rest find the stream idle.
        readings
            .into_iter()
            .map(|reading| match reading {
                LossReading::Ready(stats) => Ok(stats),
                LossReading::Queued(queued) => self.read_loss(&queued),
            })
            .collect()
    }

    fn embedding(&self, ids: &Tensor, table: &Tensor, out: &mut Tensor) -> Result<()> {
        let width = table.cols();
        let vocab = table.rows();
        self.check_tokens(ids, vocab, "embedding")?;
        let (ip, tp) = (self.ptr(ids, "embedding")?, self.ptr(table, "embedding")?);
        let op = self.output(out, &[ids.len(), width])?;
        let (n, w) = (as_u64(ids.len()), as_u64(width));
        if n * w == 0 {
            return Ok(());
        }
        let rows = as_u64(vocab);
        let mut b = self.stream.launch_builder(&self.kernels.embedding_f32);
        b.arg(&ip).arg(&tp).arg(&op).arg(&n).arg(&w).arg(&rows);
        // SAFETY: the kernel reads only ids that are rows of the table (a bad one gives a
        // zero row; its check is queued above).
        unsafe { b.launch(grid(n * w)) }.map_err(driver_err("embedding"))?;
        Ok(())
    }

    fn embedding_backward(
        &self,
        ids: &Tensor,
        dy: &Tensor,
        dtable: &mut Tensor,
        accumulate: bool,
    ) -> Result<()> {
        let (width, vocab) = (dtable.cols(), dtable.rows());
        crate::check::embedding_backward(ids, dy, width)?;
        self.check_tokens(ids, vocab, "embedding_backward")?;
        let (ip, dyp) = (
            self.ptr(ids, "embedding_backward")?,
            self.ptr(dy, "embedding_backward")?,
        );
        if !accumulate {
            self.fill(0.0, dtable)?;
        }
        let tp = self.in_place(dtable, "embedding_backward")?;
        let (n, w) = (as_u64(ids.len()), as_u64(width));
        if n * w == 0 {
            return Ok(());
        }
        let rows = as_u64(vocab);
        if rows * n <= EMBEDDING_ROW_SCAN_LIMIT {
            // Small tables: a block per table row and 128 columns (same bits, far more blocks).
            let cfg = LaunchConfig {
                grid_dim: (
                    u32::try_from(w.div_ceil(EMBED_THREADS))
                        .map_err(|_| shape_err("embedding_backward", "too wide"))?,
                    rows.clamp(1, 65_535) as u32,
                    1,
                ),
                block_dim: (EMBED_THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self
                .stream
                .launch_builder(&self.kernels.embedding_backward_rows_f32);
            b.arg(&ip).arg(&dyp).arg(&tp).arg(&n).arg(&w).arg(&rows);
            // SAFETY: an id that is no row of the table matches no block's row; the table
            // holds rows x w floats.
            unsafe { b.launch(cfg) }.map_err(driver_err("embedding_backward"))?;
            return Ok(());
        }
        self.embedding_backward_grouped((ip, n), dyp, (tp, rows, w))
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
        let [batch, seq, heads, width] = Self::attention_dims(shape, "attention")?;
        let qp = self.ptr(qkv, "attention")?;
        let sp = self.document_starts(documents, shape, "attention")?;
        let op = self.output(out, &[shape.batch * shape.seq, shape.width])?;
        let lp = self.output(lse, &[shape.batch, shape.heads, shape.seq])?;
        let rows = batch * heads * seq;
        if rows == 0 {
            return Ok(());
        }
        let scale = 1.0 / ((shape.width / shape.heads) as f32).sqrt();
        if let Some(tiled) = self.tiled_attention(shape) {
            // The tensor-core kernels read qkv rounded to bf16 (a scratch copy).
            let (_q16, qp) = if tiled.bf16_inputs {
                self.to_bf16(qkv, "attention")?
            } else {
                (Tensor::default(), qp)
            };
            let mut b = self.stream.launch_builder(tiled.forward);
            b.arg(&qp).arg(&sp).arg(&op).arg(&lp);
            b.arg(&seq).arg(&heads).arg(&width).arg(&scale);
            // SAFETY: sizes and document starts checked above; one thread per query row.
            unsafe { b.launch(attention_tiles(seq, batch * heads, tiled.forward_block)?) }
                .map_err(driver_err("attention"))?;
            return Ok(());
        }
        let mut b = self.stream.launch_builder(&self.kernels.attention_f32);
        b.arg(&qp).arg(&sp).arg(&op).arg(&lp);
        b.arg(&batch).arg(&seq).arg(&heads).arg(&width).arg(&scale);
        // SAFETY: sizes and document starts checked above; one warp per query row.
        unsafe { b.launch(warp_rows(rows)) }.map_err(driver_err("attention"))?;
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
        let op = "attention backward";
        crate::check::attention_backward(qkv, (out, lse, dout), shape)?;
        let [batch, seq, heads, width] = Self::attention_dims(shape, op)?;
        let sp = self.document_starts(documents, shape, op)?;
        let (qp, outp, lp, dop) = (
            self.ptr(qkv, op)?,
            self.ptr(out, op)?,
            self.ptr(lse, op)?,
            self.ptr(dout, op)?,
        );
        let dp = self.output(dqkv, qkv.shape())?;
        let mut delta = Tensor::<f32>::default();
        let deltap = self.output(&mut delta, &[shape.batch, shape.heads, shape.seq])?;
        let rows = batch * heads * seq;
        if rows == 0 {
            return Ok(());
        }
        let scale = 1.0 / ((shape.width / shape.heads) as f32).sqrt();
        if let Some(tiled) = self.tiled_attention(shape) {
            let cfg = attention_tiles(seq, batch * heads, tiled.backward_block)?;
            if tiled.bf16_inputs {
                // The tensor-core kernels read qkv and dout rounded to bf16 (scratch copies),
                // and dout and out in f32 for delta.
                let (_q16, q16p) = self.to_bf16(qkv, op)?;
                let (_d16, d16p) = self.to_bf16(dout, op)?;
                let mut b = self.stream.launch_builder(tiled.queries);
                b.arg(&q16p)
                    .arg(&sp)
                    .arg(&outp)
                    .arg(&lp)
                    .arg(&dop)
                    .arg(&d16p);
                b.arg(&dp).arg(&deltap);
                b.arg(&seq).arg(&heads).arg(&width).arg(&scale);
                // SAFETY: as the forward; writes the query third of dqkv and delta.
                unsafe { b.launch(cfg) }.map_err(driver_err(op))?;
                let mut b = self.stream.launch_builder(tiled.keys);
                b.arg(&q16p)
                    .arg(&sp)
                    .arg(&lp)
                    .arg(&d16p)
                    .arg(&deltap)
                    .arg(&dp);
                b.arg(&seq).arg(&heads).arg(&width).arg(&scale);
                // SAFETY: as above; writes the key and value thirds of dqkv after the
                // queries' kernel (same stream) has written delta.
                unsafe { b.launch(cfg) }.map_err(driver_err(op))?;
                return Ok(());
            }
            let mut b = self.stream.launch_builder(tiled.queries);
            b.arg(&qp)
                .arg(&sp)
                .arg(&outp)
                .arg(&lp)
                .arg(&dop)
                .arg(&dp)
                .arg(&deltap);
            b.arg(&seq).arg(&heads).arg(&width).arg(&scale);
            // SAFETY: as the forward; writes the query third of dqkv and delta.
            unsafe { b.launch(cfg) }.map_err(driver_err(op))?;
            let mut b = self.stream.launch_builder(tiled.keys);
            b.arg(&qp).arg(&sp).arg(&lp).arg(&dop).arg(&deltap).arg(&dp);
            b.arg(&seq).arg(&heads).arg(&width).arg(&scale);
            // SAFETY: as above; writes the key and value thirds of dqkv after the queries'
            // kernel (same stream) has written delta.
            unsafe { b.launch(cfg) }.map_err(driver_err(op))?;
            return Ok(());
        }
        let mut b = self
            .stream
            .launch_builder(&self.kernels.attention_backward_queries_f32);
        b.arg(&qp)
            .arg(&sp)
            .arg(&outp)
            .arg(&lp)
            .arg(&dop)
            .arg(&dp)
            .arg(&deltap);
        b.arg(&batch).arg(&seq).arg(&heads).arg(&width).arg(&scale);
        // SAFETY: as the forward; writes the query third of dqkv and delta.
        unsafe { b.launch(warp_rows(rows)) }.map_err(driver_err(op))?;
        let mut b = self
            .stream
            .launch_builder(&self.kernels.attention_backward_keys_f32);
        b.arg(&qp).arg(&sp).arg(&lp).arg(&dop).arg(&deltap).arg(&dp);
        b.arg(&batch).arg(&seq).arg(&heads).arg(&width).arg(&scale);
        // SAFETY: as above; writes the key and value thirds of dqkv, after the queries'
        // kernel (same stream) has written delta.
        unsafe { b.launch(warp_rows(rows)) }.map_err(driver_err(op))?;
        Ok(())
    }

    fn axpy(&self, alpha: f32, x: &Tensor, y: &mut Tensor) -> Result<()> {
        crate::check::same_len("axpy", (x, y), ("x", "y"))?;
        let xp = self.ptr(x, "axpy")?;
        let yp = self.in_place(y, "axpy")?;
        let n = as_u64(x.len());
        // SAFETY: both buffers hold n floats.
        unsafe {
            self.launch_elementwise(&self.kernels.axpy_f32, n, "axpy", |b| {
                b.arg(&alpha).arg(&xp).arg(&yp).arg(&n);
            })
        }
    }

    fn scale(&self, alpha: f32, x: &mut Tensor) -> Result<()> {
        let xp = self.in_place(x, "scale")?;
        let n = as_u64(x.len());
        // SAFETY: x holds n floats.
        unsafe {
            self.launch_elementwise(&self.kernels.scale_f32, n, "scale", |b| {
                b.arg(&alpha).arg(&xp).arg(&n);
            })
        }
    }

    fn sgd_update(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        buf: Option<&mut Tensor>,
        hp: SgdStep,
    ) -> Result<UpdateSeen> {
        crate::check::sgd(param, grad, buf.as_deref(), hp.momentum)?;
        let gp = self.ptr(grad, "sgd_update")?;
        let bufp = match buf {
            Some(b) if hp.momentum != 0.0 => self.in_place(b, "sgd_update")?,
            _ => 0,
        };
        let wp = self.in_place(param, "sgd_update")?;
        let n = as_u64(param.len());
        if n == 0 {
            return Ok(UpdateSeen::default());
        }
        let nesterov = i32::from(hp.nesterov);
        let mut b = self.stream.launch_builder(&self.kernels.sgd_f32);
        b.arg(&wp).arg(&gp).arg(&bufp).arg(&n);
        b.arg(&hp.lr)
            .arg(&hp.momentum)
            .arg(&nesterov)
            .arg(&hp.weight_decay);
        // SAFETY: all buffers hold n floats; `bufp` is null without momentum.
        unsafe { b.launch(grid(n)) }.map_err(driver_err("sgd_update"))?;
        // The guard batches its check into one wait on this device.
        Ok(UpdateSeen::default())
    }

    fn adam_update(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        hp: AdamStep,
    ) -> Result<UpdateSeen> {
        let n = param.len();
        crate::check::adam(param, grad, m, v)?;
        let gp = self.ptr(grad, "adam_update")?;
        let mp = self.in_place(m, "adam_update")?;
        let vp = self.in_place(v, "adam_update")?;
        let wp = self.in_place(param, "adam_update")?;
        let n = as_u64(n);
        if n == 0 {
            return Ok(UpdateSeen::default());
        }
        let decoupled = i32::from(hp.decoupled);
        let mut b = self.stream.launch_builder(&self.kernels.adam_f32);
        b.arg(&wp).arg(&gp).arg(&mp).arg(&vp).arg(&n);
        b.arg(&hp.lr).arg(&hp.beta1).arg(&hp.beta2).arg(&hp.eps);
        b.arg(&hp.weight_decay).arg(&decoupled);
        b.arg(&hp.bias_correction1).arg(&hp.bias_correction2);
        // SAFETY: all four buffers hold n floats.
        unsafe { b.launch(grid(n)) }.map_err(driver_err("adam_update"))?;
        // The guard batches its check into one wait on this device.
        Ok(UpdateSeen::default())
    }

    fn adam_updates(&self, updates: &mut [AdamTensors<'_>]) -> Result<Vec<UpdateSeen>> {
        // Every tensor is checked before anything is queued, so a bad one updates none.
        crate::backend::adam_lengths(updates)?;
        let op = "adam_updates";
        let mut operands = Vec::with_capacity(updates.len());
        for u in updates.iter_mut() {
            operands.push(AdamOperands {
                g: self.ptr(u.grad, op)?,
                m: self.in_place(u.m, op)?,
                v: self.in_place(u.v, op)?,
                w: self.in_place(u.param, op)?,
                n: as_u64(u.param.len()),
                hp: u.hp,
            });
        }
        for group in adam_groups(&operands)? {
            let cfg = LaunchConfig {
                grid_dim: (group.blocks(), 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.stream.launch_builder(&self.kernels.adam_group_f32);
            b.arg(&group);
            // SAFETY: the group's addresses are this backend's buffers, each holding its
            // tensor's n floats, and its blocks cover exactly their elements.
            unsafe { b.launch(cfg) }.map_err(driver_err(op))?;
        }
        // The guard batches its check into one wait on this device.
        Ok(vec![UpdateSeen::default(); updates.len()])
    }

    fn lion_update(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        hp: LionStep,
    ) -> Result<UpdateSeen> {
        let n = param.len();
        crate::check::lion(param, grad, m)?;
        let gp = self.ptr(grad, "lion_update")?;
        let mp = self.in_place(m, "lion_update")?;
        let wp = self.in_place(param, "lion_update")?;
        let n = as_u64(n);
        if n == 0 {
            return Ok(UpdateSeen::default());
        }
        let mut b = self.stream.launch_builder(&self.kernels.lion_f32);
        b.arg(&wp).arg(&gp).arg(&mp).arg(&n);
        b.arg(&hp.lr)
            .arg(&hp.beta1)
            .arg(&hp.beta2)
            .arg(&hp.weight_decay);
        // SAFETY: all three buffers hold n floats.
        unsafe { b.launch(grid(n)) }.map_err(driver_err("lion_update"))?;
        // The guard batches its check into one wait on this device.
        Ok(UpdateSeen::default())
    }

    fn delay_compensate(
        &self,
        grad: &mut Tensor,
        current: &Tensor,
        stale: &Tensor,
        mean_square: Option<&mut Tensor>,
        hp: DelayCompensation,
    ) -> Result<()> {
        let n = grad.len();
        let adaptive = hp.adaptive.is_some();
        crate::check::delay_compensation(grad, current, stale, mean_square.as_deref(), adaptive)?;
        let wp = self.ptr(current, "delay_compensate")?;
        let sp = self.ptr(stale, "delay_compensate")?;
        // The plain form never reads the mean square; it is handed the gradient's pointer.
        let msp = match mean_square {
            Some(ms) if adaptive => Some(self.in_place(ms, "delay_compensate")?),
            _ => None,
        };
        let gp = self.in_place(grad, "delay_compensate")?;
        let n = as_u64(n);
        if n == 0 {
            return Ok(());
        }
        let flag = i32::from(adaptive);
        let decay = hp.adaptive.unwrap_or(0.0);
        let mut b = self
            .stream
            .launch_builder(&self.kernels.delay_compensate_f32);
        b.arg(&gp).arg(&wp).arg(&sp);
        match &msp {
            Some(p) => b.arg(p),
            None => b.arg(&gp),
        };
        b.arg(&n)
            .arg(&hp.lambda)
            .arg(&flag)
            .arg(&decay)
            .arg(&hp.eps);
        // SAFETY: every buffer holds n floats; the plain form never touches its fourth.
        unsafe { b.launch(grid(n)) }.map_err(driver_err("delay_compensate"))?;
        Ok(())
    }

    fn sum(&self, x: &Tensor) -> Result<f64> {
        self.reduce(x, false)
    }

    fn sum_squares(&self, x: &Tensor) -> Result<f64> {
        self.reduce(x, true)
    }

    fn first_non_finite(&self, xs: &[&Tensor]) -> Result<Option<usize>> {
        if xs.is_empty() {
            return Ok(None);
        }
        // One u32 flag per tensor, zeroed on the stream, raised by a kernel per tensor, read
        // back together.
        let (_flags, flags) = self.scratch(xs.len())?;
        let (count, zero) = (as_u64(xs.len()), 0.0f32);
        let mut b = self.stream.launch_builder(&self.kernels.fill_f32);
        b.arg(&flags).arg(&count).arg(&zero);
        // SAFETY: the flags hold xs.len() u32 slots (zero bits).
        unsafe { b.launch(grid(count)) }.map_err(driver_err("non-finite check"))?;
        for (i, x) in xs.iter().enumerate() {
            let n = as_u64(x.len());
            if n == 0 {
                continue;
            }
            let (xp, slot) = (self.ptr(x, "non-finite check")?, flags + 4 * as_u64(i));
            let mut b = self
                .stream
                .launch_builder(&self.kernels.flag_non_finite_f32);
            b.arg(&xp).arg(&n).arg(&slot);
            // SAFETY: x holds n floats; `slot` is one live u32.
            unsafe { b.launch(grid(n)) }.map_err(driver_err("non-finite check"))?;
        }
        let raised = self.download::<u32>(flags, xs.len())?;
        Ok(raised.iter().position(|&f| f != 0))
    }
}

fn activation_code(act: Activation) -> i32 {
    match act {
        Activation::Relu => 0,
        Activation::Gelu => 1,
        Activation::Tanh => 2,
        Activation::Sigmoid => 3,
    }
}
