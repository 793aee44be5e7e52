//! Device buffers lent between processes of one host (CUDA IPC), so that a stage's activation
//! or gradient reaches a worker process on the same host device to device, never through host
//! memory ([`Backend::lend`](crate::Backend::lend), [`Backend::copy_lent`](crate::Backend::copy_lent)).
//!
//! **Lending.** The lender hands out its pool block's IPC handle (`cuIpcGetMemHandle`, taken
//! once per block) with its process id, its device and the block's address. A block whose
//! handle went out is never given back to the driver while the pool lives (the pool keeps it
//! cached instead): a borrower may hold it open, and freeing memory another process has open
//! is undefined. The executor keeps the lent tensor until the borrower says it has copied it,
//! so the block is not reused meanwhile.
//!
//! **Borrowing.** The borrower opens the handle once (`cuIpcOpenMemHandle`, kept open for the
//! backend's life and closed when it is dropped), checks the allocation's extent with
//! `cuMemGetAddressRange` before reading, copies into a block of its own pool on its stream and
//! waits for the copy. A handle from its own process (workers as threads over shared memory)
//! is not opened: CUDA refuses that, and the address is already valid there; its extent is
//! checked the same way. A lender is a process of the same user on this host (the
//! shared-memory link checks its credentials), so a handle is trusted no further than the
//! driver's own checks and the extent.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use cudarc::driver::sys as driver_sys;

use super::memory::{Pool, driver_err};
use crate::{KernelError, Result};

/// The first bytes of a CUDA backend's handle.
const MAGIC: [u8; 4] = *b"CUD1";
/// A handle's length: the magic, the process id (u32), the device ordinal (u32), the block's
/// address (u64) and the driver's IPC handle (64 bytes).
const HANDLE_BYTES: usize = 4 + 4 + 4 + 8 + 64;

fn refused(detail: impl Into<String>) -> KernelError {
    KernelError::Lent {
        detail: detail.into(),
    }
}

/// The handles a borrowing backend has opened, by the driver's handle bytes: each stays open
/// until the backend is dropped.
#[derive(Debug, Default)]
pub(crate) struct Borrowed {
    opened: Mutex<HashMap<[u8; 64], u64>>,
}

impl Borrowed {
    /// The address of the lent block `ipc` names in this process, opening it the first time.
    pub(crate) fn open(&self, ipc: [u8; 64]) -> Result<u64> {
        let mut opened = self.opened.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(&ptr) = opened.get(&ipc) {
            return Ok(ptr);
        }
        let handle = driver_sys::CUipcMemHandle {
            reserved: ipc.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: driver_sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the handle is plain bytes the driver checks.
        unsafe {
            driver_sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                handle,
                driver_sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(driver_err("open a lent buffer"))?;
        opened.insert(ipc, ptr);
        Ok(ptr)
    }

    /// Closes every opened handle (the backend's context is bound and its stream idle).
    pub(crate) fn close_all(&self) {
        let mut opened = self.opened.lock().unwrap_or_else(PoisonError::into_inner);
        for (_, ptr) in opened.drain() {
            // SAFETY: `ptr` came from `cuIpcOpenMemHandle` and no queued work reads it.
            let _ = unsafe { driver_sys::cuIpcCloseMemHandle(ptr) };
        }
    }
}

/// A handle taken apart.
struct Handle {
    pid: u32,
    ordinal: u32,
    ptr: u64,
    ipc: [u8; 64],
}

impl Handle {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HANDLE_BYTES);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.ordinal.to_le_bytes());
        out.extend_from_slice(&self.ptr.to_le_bytes());
        out.extend_from_slice(&self.ipc);
        out
    }

    fn decode(bytes: &[u8]) -> Result<Handle> {
        if bytes.len() != HANDLE_BYTES || bytes[..4] != MAGIC {
            return Err(refused(format!(
                "not a CUDA backend's handle ({} bytes)",
                bytes.len()
            )));
        }
        let word = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let mut ptr = [0u8; 8];
        ptr.copy_from_slice(&bytes[12..20]);
        let mut ipc = [0u8; 64];
        ipc.copy_from_slice(&bytes[20..]);
        Ok(Handle {
            pid: word(4),
            ordinal: word(8),
            ptr: u64::from_le_bytes(ptr),
            ipc,
        })
    }
}

/// The bytes of `shape`'s `f32` elements.
pub(crate) fn byte_len(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .and_then(|n| n.checked_mul(4))
        .ok_or_else(|| refused(format!("a shape of {shape:?} is too large")))
}

/// The handle of the block at `ptr` of `pool`, on device `ordinal`, for
/// [`Backend::lend`](crate::Backend::lend) (the context bound, the block written).
pub(crate) fn lend(pool: &Pool, ordinal: usize, ptr: u64) -> Result<Vec<u8>> {
    let ipc = pool.ipc_handle(ptr)?;
    Ok(Handle {
        pid: std::process::id(),
        ordinal: ordinal as u32,
        ptr,
        ipc,
    }
    .encode())
}

/// The address in this process of the buffer `handle` names, checked to hold `len` bytes, for
/// [`Backend::copy_lent`](crate::Backend::copy_lent) (the context bound): opened through
/// `borrowed` where another process lent it.
pub(crate) fn source(borrowed: &Borrowed, handle: &[u8], len: usize) -> Result<u64> {
    let handle = Handle::decode(handle)?;
    let src = if handle.pid == std::process::id() {
        handle.ptr
    } else {
        borrowed.open(handle.ipc)?
    };
    // The lent allocation's extent, from the driver, not from the lender's word.
    let (mut base, mut size): (driver_sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-pointers; the driver checks `src` and fails for an unknown address.
    unsafe { driver_sys::cuMemGetAddressRange_v2(&mut base, &mut size, src) }
        .result()
        .map_err(|e| {
            refused(format!(
                "lent by process {} on cuda:{}: {e}",
                handle.pid, handle.ordinal
            ))
        })?;
    if base != src || size < len {
        return Err(refused(format!(
            "an allocation of {size} bytes does not hold the {len} bytes lent"
        )));
    }
    Ok(src)
}

impl Pool {
    /// The IPC handle of the block at `ptr` (a block of this pool), taken once per block; the
    /// block is marked lent, so the pool never frees it while it lives.
    pub(crate) fn ipc_handle(&self, ptr: u64) -> Result<[u8; 64]> {
        if let Some(ipc) = self.lent_handle(ptr) {
            return Ok(ipc);
        }
        let mut handle = driver_sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `ptr` is the start of a live `cuMemAlloc` allocation of this pool.
        unsafe { driver_sys::cuIpcGetMemHandle(&mut handle, ptr) }
            .result()
            .map_err(driver_err("lend a buffer"))?;
        let ipc = handle.reserved.map(|b| b as u8);
        self.mark_lent(ptr, ipc);
        Ok(ipc)
    }
}
