//! Device memory owned by the CUDA backend: a caching allocator, so that a training step calls
//! `cuMemAlloc` only while the pool is still growing.
//!
//! Blocks are rounded up to a size class ([`super::block_bytes`]: a power of two from 512 bytes up to 64 MiB, then a
//! multiple of 2 MiB) and a freed block goes back to its class's free list instead of to the
//! driver. Every block is used in the order of one stream (the backend's, which the pool
//! keeps): a block freed while a kernel that reads it is still queued can be handed out again
//! at once, because whatever the next owner enqueues runs after that kernel on the same stream. A tensor that another backend
//! (another stream) made is never read in place: [`super::CudaBackend::place`] copies it after
//! both streams have finished, so a block is never shared across streams.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaContext, CudaStream, result as driver};

use crate::{Device, DeviceMemory, KernelError, Result};

/// Source of pool identities: a buffer knows which backend's pool (and so which stream) it
/// belongs to.
static POOL_IDS: AtomicU64 = AtomicU64::new(1);

/// What the pool holds, for reports and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes obtained from the driver (in use or cached).
    pub reserved_bytes: usize,
    /// Bytes of blocks handed out and not yet returned.
    pub in_use_bytes: usize,
    /// The most `in_use_bytes` has been.
    pub peak_in_use_bytes: usize,
    /// Calls to the driver's allocator.
    pub driver_allocations: u64,
}

#[derive(Default)]
struct Free {
    by_class: HashMap<usize, Vec<u64>>,
    stats: PoolStats,
    /// The IPC handles of blocks lent to other processes, by address
    /// ([`Pool::ipc_handle`]): such a block is never freed while the pool lives.
    lent: HashMap<u64, [u8; 64]>,
}

/// One backend's caching allocator on one device.
pub(crate) struct Pool {
    id: u64,
    ordinal: usize,
    ctx: Arc<CudaContext>,
    /// The one stream every block of this pool is used on (its backend's).
    stream: Arc<CudaStream>,
    free: Mutex<Free>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("id", &self.id)
            .field("ordinal", &self.ordinal)
            .field("stats", &self.stats())
            .finish()
    }
}

pub(crate) fn driver_err(op: &'static str) -> impl Fn(driver::DriverError) -> KernelError {
    move |e| KernelError::Cuda {
        op,
        detail: e.to_string(),
    }
}

impl Pool {
    pub(crate) fn new(stream: Arc<CudaStream>) -> Arc<Self> {
        let ctx = Arc::clone(stream.context());
        Arc::new(Self {
            id: POOL_IDS.fetch_add(1, Ordering::Relaxed),
            ordinal: ctx.ordinal(),
            ctx,
            stream,
            free: Mutex::new(Free::default()),
        })
    }

    /// Waits until the pool's stream has run everything queued on it: after this, no queued
    /// work reads or writes any of its blocks. Only this stream: a context-wide wait would also
    /// wait on other workers of the GPU, whose work may wait on this one.
    pub(crate) fn wait_idle(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_err("synchronize"))
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn stats(&self) -> PoolStats {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .stats
    }

    /// A buffer of exactly `bytes` bytes (contents unspecified), from the cache when a block of
    /// its class is free.
    pub(crate) fn allocate(self: &Arc<Self>, bytes: usize) -> Result<Arc<dyn DeviceMemory>> {
        let class = super::classes::block_bytes(bytes);
        let cached = {
            let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
            let ptr = free.by_class.get_mut(&class).and_then(Vec::pop);
            if ptr.is_some() {
                free.stats.in_use_bytes += class;
                free.stats.peak_in_use_bytes =
                    free.stats.peak_in_use_bytes.max(free.stats.in_use_bytes);
            }
            ptr
        };
        let ptr = match cached {
            Some(ptr) => ptr,
            None => self.allocate_from_driver(class)?,
        };
        Ok(Arc::new(CudaMemory {
            ptr,
            bytes,
            class,
            pool: Arc::clone(self),
        }))
    }

    fn allocate_from_driver(&self, class: usize) -> Result<u64> {
        self.ctx.bind_to_thread().map_err(driver_err("bind"))?;
        // SAFETY: a plain allocation in the bound context; the pointer is owned by this pool
        // until `Drop` frees it.
        let first = unsafe { driver::malloc_sync(class) };
        let ptr = match first {
            Ok(ptr) => ptr,
            Err(_) => {
                // Out of memory with blocks cached in other classes: give them back and retry.
                self.release_cached()?;
                // SAFETY: as above.
                unsafe { driver::malloc_sync(class) }.map_err(|e| KernelError::Cuda {
                    op: "allocate",
                    detail: format!("{class} bytes on cuda:{}: {e}", self.ordinal),
                })?
            }
        };
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        free.stats.reserved_bytes += class;
        free.stats.in_use_bytes += class;
        free.stats.peak_in_use_bytes = free.stats.peak_in_use_bytes.max(free.stats.in_use_bytes);
        free.stats.driver_allocations += 1;
        Ok(ptr)
    }

    /// The IPC handle of the block at `ptr`, if it was lent before.
    pub(crate) fn lent_handle(&self, ptr: u64) -> Option<[u8; 64]> {
        let free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        free.lent.get(&ptr).copied()
    }

    /// Records that the block at `ptr` was lent with IPC handle `ipc`.
    pub(crate) fn mark_lent(&self, ptr: u64, ipc: [u8; 64]) {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        free.lent.insert(ptr, ipc);
    }

    /// Frees every cached block (after the stream has finished with them) but those lent to
    /// another process, which may still have them open.
    fn release_cached(&self) -> Result<()> {
        self.wait_idle()?;
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        let classes: Vec<(usize, Vec<u64>)> = free.by_class.drain().collect();
        for (class, ptrs) in classes {
            let (kept, ptrs): (Vec<u64>, Vec<u64>) =
                ptrs.into_iter().partition(|p| free.lent.contains_key(p));
            if !kept.is_empty() {
                free.by_class.insert(class, kept);
            }
            for ptr in ptrs {
                // SAFETY: the block is cached (no tensor holds it) and its stream is idle.
                unsafe { driver::free_sync(ptr) }.map_err(driver_err("free"))?;
                free.stats.reserved_bytes -= class;
            }
        }
        Ok(())
    }

    fn give_back(&self, ptr: u64, class: usize) {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        free.stats.in_use_bytes -= class;
        free.by_class.entry(class).or_default().push(ptr);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Nothing can report an error from here; a failure leaves device memory to the driver,
        // which frees it with the context.
        if self.ctx.bind_to_thread().is_ok() && self.stream.synchronize().is_ok() {
            let free = self.free.get_mut().unwrap_or_else(PoisonError::into_inner);
            for ptr in free.by_class.drain().flat_map(|(_, ptrs)| ptrs) {
                // SAFETY: every buffer has been dropped (each holds the pool) and the stream
                // that used them is idle.
                let _ = unsafe { driver::free_sync(ptr) };
            }
        }
    }
}

/// A tensor's device buffer: `bytes` bytes at `ptr`, inside a block of `class` bytes that goes
/// back to `pool` when the last tensor holding it is dropped.
pub(crate) struct CudaMemory {
    ptr: u64,
    bytes: usize,
    class: usize,
    pool: Arc<Pool>,
}

impl CudaMemory {
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    pub(crate) fn pool_id(&self) -> u64 {
        self.pool.id
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.pool.ctx
    }

    /// Waits until the stream that produces this buffer has run everything queued on it.
    pub(crate) fn wait_for_producer(&self) -> Result<()> {
        self.pool.wait_idle()
    }
}

impl fmt::Debug for CudaMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CudaMemory({} bytes on cuda:{}, pool {})",
            self.bytes, self.pool.ordinal, self.pool.id
        )
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        self.pool.give_back(self.ptr, self.class);
    }
}

impl DeviceMemory for CudaMemory {
    fn device(&self) -> Device {
        Device::Cuda(self.pool.ordinal)
    }

    fn bytes(&self) -> usize {
        self.bytes
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
