//! A device backend without a device: tensors live in buffers it owns behind
//! [`Storage::Device`], as a GPU backend's do, and every operation is computed by the CPU
//! backend on host copies. Its results are the CPU backend's bit for bit.
//!
//! It exists so that the code above the backend that only a device exercises (placing inputs,
//! copying weights and messages out, staging an all-reduce through the host, passing device
//! buffers between workers, lending them to a borrower as between processes) runs and is
//! checked against the reference trainer on machines with no GPU. It is as strict as the CUDA backend: an input that was not placed, or that another
//! backend holds, is an error, never a silent host read.
//!
//! Its operations are generated from the one list of the trait's methods (`backend_ops!` in
//! `backend.rs`), all in the same way: each operand is staged to the host by its type
//! ([`Stage`]: a tensor it reads must be this device's, one it writes is copied in first where
//! it lives elsewhere, other values pass as they are), the CPU backend computes, and each
//! tensor it wrote becomes one of this device's buffers. A new operation needs no line here
//! (an operand of a new type that is not a tensor, one word in `by_value!`).
//! Written out by hand are only the methods with logic of their own: what the device is, and
//! the transfers (`place`, `read`, `write`, `fill`) that make its buffers from host values or
//! read them back.

use std::any::Any;
use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::{
    Activation, AdamStep, AttentionShape, Backend, DelayCompensation, LionStep, LossStats, SgdStep,
    Trans, UpdateSeen, backend_ops,
};
use crate::{CpuBackend, Device, DeviceMemory, Element, KernelError, Result, Storage, Tensor};

/// Source of emulator identities: a buffer knows which emulator made it.
static EMULATORS: AtomicU64 = AtomicU64::new(1);

/// A buffer of the emulated device: the elements' bits, counted in its device's usage while
/// it lives.
#[derive(Debug)]
struct EmulatedMemory {
    owner: u64,
    ordinal: usize,
    bits: Vec<u32>,
    usage: Arc<Usage>,
}

/// The bytes an emulated device's buffers hold now and at most, as the CUDA backend's pool
/// reports them ([`Backend::peak_memory`]): each buffer counted as the block the pool would
/// serve it from ([`crate::cuda::block_bytes`]), so that pipe's model of a device's memory
/// is checked against the same count without a GPU.
#[derive(Debug, Default)]
struct Usage {
    live: AtomicU64,
    peak: AtomicU64,
}

impl Usage {
    /// The bytes a buffer of `len` 4-byte elements counts for.
    fn block(len: usize) -> u64 {
        crate::cuda::block_bytes(len.saturating_mul(4)) as u64
    }

    fn add(&self, len: usize) {
        let bytes = Self::block(len);
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
}

impl Drop for EmulatedMemory {
    fn drop(&mut self) {
        self.usage
            .live
            .fetch_sub(Usage::block(self.bits.len()), Ordering::Relaxed);
    }
}

impl DeviceMemory for EmulatedMemory {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn bytes(&self) -> usize {
        self.bits.len() * 4
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Element types as the bits the emulated device stores.
trait Bits: Element {
    fn to_bits(self) -> u32;
    fn from_bits(bits: u32) -> Self;
}

impl Bits for f32 {
    fn to_bits(self) -> u32 {
        f32::to_bits(self)
    }
    fn from_bits(bits: u32) -> Self {
        f32::from_bits(bits)
    }
}

impl Bits for u32 {
    fn to_bits(self) -> u32 {
        self
    }
    fn from_bits(bits: u32) -> Self {
        bits
    }
}

/// The emulated device backend (see the module docs). It presents itself as CUDA device
/// `ordinal` (so code that asks where a tensor lives sees a device) and names itself
/// `emulated`.
#[derive(Debug)]
pub struct EmulatedDevice {
    id: u64,
    ordinal: usize,
    cpu: CpuBackend,
    usage: Arc<Usage>,
    /// Whether it copies buffers other devices lend ([`Backend::copy_lent`]); one that does not
    /// stands for a GPU without peer access to the lender's.
    borrows: bool,
}

impl EmulatedDevice {
    /// An emulated device numbered `ordinal`, computing with one CPU thread.
    ///
    /// # Errors
    /// The CPU backend's thread pool failing to start.
    pub fn new(ordinal: usize) -> Result<Self> {
        Ok(Self {
            id: EMULATORS.fetch_add(1, Ordering::Relaxed),
            ordinal,
            cpu: CpuBackend::new(1)?,
            usage: Arc::default(),
            borrows: true,
        })
    }

    /// [`EmulatedDevice::new`], refusing every buffer another device lends it, as a GPU without
    /// peer access to the lender's GPU would: what checks that a link whose receiver cannot
    /// borrow carries its messages through the host.
    ///
    /// # Errors
    /// As [`EmulatedDevice::new`].
    pub fn without_peer_access(ordinal: usize) -> Result<Self> {
        Ok(Self {
            borrows: false,
            ..Self::new(ordinal)?
        })
    }

    fn wrong(&self, op: &'static str, found: Device) -> KernelError {
        KernelError::WrongDevice {
            op,
            expected: Device::Cuda(self.ordinal),
            found,
        }
    }

    /// A host copy of one of this emulator's tensors.
    fn input<E: Bits>(&self, t: &Tensor<E>, op: &'static str) -> Result<Tensor<E>> {
        match t.storage() {
            Storage::Device(m) => match m.as_any().downcast_ref::<EmulatedMemory>() {
                Some(e) if e.owner == self.id => {
                    Tensor::from_vec(t.shape(), e.bits.iter().map(|&b| E::from_bits(b)).collect())
                }
                _ => Err(self.wrong(op, t.device())),
            },
            Storage::Host(_) => Err(self.wrong(op, t.device())),
        }
    }

    /// A host copy of an operand updated in place: one of this emulator's tensors, or one it
    /// would copy in first (a host tensor, another device's), as a device backend does.
    fn in_place(&self, t: &Tensor) -> Result<Tensor> {
        let placed = self.place_any(t.clone())?;
        self.input(&placed, "in place")
    }

    /// `t` (a host tensor) as one of this emulator's.
    fn output<E: Bits>(&self, t: Tensor<E>) -> Result<Tensor<E>> {
        let shape = t.shape().to_vec();
        let bits: Vec<u32> = t.into_host_vec()?.into_iter().map(Bits::to_bits).collect();
        self.usage.add(bits.len());
        let memory: Arc<dyn DeviceMemory> = Arc::new(EmulatedMemory {
            owner: self.id,
            ordinal: self.ordinal,
            bits,
            usage: Arc::clone(&self.usage),
        });
        Tensor::from_device(&shape, memory)
    }

    fn place_any<E: Bits>(&self, t: Tensor<E>) -> Result<Tensor<E>> {
        match t.storage() {
            Storage::Host(v) if v.is_empty() => self.output(Tensor::from_vec(&[0], Vec::new())?),
            Storage::Host(_) => self.output(t),
            Storage::Device(m) => match m.as_any().downcast_ref::<EmulatedMemory>() {
                Some(e) if e.owner == self.id => Ok(t),
                // Another emulator's buffer: copied, as a peer copy would.
                Some(e) => {
                    let values = e.bits.iter().map(|&b| E::from_bits(b)).collect();
                    self.output(Tensor::from_vec(t.shape(), values)?)
                }
                None => Err(self.wrong("place", t.device())),
            },
        }
    }
}

/// Writes one method of [`Backend`] from the list in `backend_ops!`: each operand is staged to
/// the host ([`Stage`]), the CPU backend computes on the copies, and each operand it wrote
/// becomes one of this device's buffers again. A written operand is staged whether the
/// operation reads it (an accumulation, an update) or only overwrites it (an output), since
/// the CPU backend decides which. An operation that fails writes nothing back.
macro_rules! emulated_method {
    // Written out in the impl: the device's own description (`synchronize` is the trait's
    // default: the CPU computes synchronously).
    ($(#[$meta:meta])* about fn $($rest:tt)*) => {};
    // Written out in the impl: they move host values into this device's buffers or out of them
    // (`fill` makes a buffer from a shape alone, reading nothing), where staging has nothing
    // to copy.
    ($(#[$meta:meta])* op fn place $($rest:tt)*) => {};
    ($(#[$meta:meta])* op fn place_ids $($rest:tt)*) => {};
    ($(#[$meta:meta])* op fn read $($rest:tt)*) => {};
    ($(#[$meta:meta])* op fn write $($rest:tt)*) => {};
    ($(#[$meta:meta])* op fn fill $($rest:tt)*) => {};
    // The trait's default: it reads each device tensor through `sum`, which is staged (a list
    // of tensors has no host copy to lend).
    ($(#[$meta:meta])* op fn first_non_finite $($rest:tt)*) => {};
    // The trait's defaults: a device that does not fuse a linear layer's products with their
    // elementwise work runs them as their parts, each staged as its own kernel with its
    // outputs in this device's buffers, as the CUDA backend does without cuBLASLt. Staged
    // whole, their intermediates (the input gradient before the activation's) would live on
    // the host and leave the device's peak.
    ($(#[$meta:meta])* op fn linear $($rest:tt)*) => {};
    ($(#[$meta:meta])* op fn linear_activation $($rest:tt)*) => {};
    ($(#[$meta:meta])* op fn linear_grad_activation $($rest:tt)*) => {};
    ($(#[$meta:meta])* op fn linear_weight_grads $($rest:tt)*) => {};
    // The trait's default: each tensor's update staged as its own call (a list of borrowed
    // tensors has no host copy to lend as one operand).
    ($(#[$meta:meta])* op fn adam_updates $($rest:tt)*) => {};
    // The trait's defaults: the loss computed at once (staged as `softmax_cross_entropy`),
    // so its statistics are ready.
    ($(#[$meta:meta])* op fn queue_softmax_cross_entropy $($rest:tt)*) => {};
    ($(#[$meta:meta])* op fn read_losses $($rest:tt)*) => {};
    (
        $(#[$meta:meta])* op fn $name:ident $(<$lt:lifetime>)?
        (&self $(, $arg:ident: $ty:ty)* $(,)?) -> $ret:ty $(;)? $($default:block)?
    ) => {
        fn $name $(<$lt>)? (&self $(, $arg: $ty)*) -> $ret {
            let op = stringify!($name);
            $(let mut $arg = Stage::stage($arg, self, op)?;)*
            self.cpu.$name($(Staged::lend(&mut $arg)),*).and_then(|out| {
                $(Staged::finish($arg, self)?;)*
                Ok(out)
            })
        }
    };
}

/// An operand of an operation as the CPU backend takes it, copied from this device.
trait Stage: Sized {
    /// The host copy (or the value itself).
    type Staged: Staged;

    /// Copies the operand to the host for `op`: a tensor read with [`EmulatedDevice::input`]
    /// (only this device's buffers), a tensor written with [`EmulatedDevice::in_place`] (copied
    /// in first where it lives elsewhere, as a device backend does); other values as they are.
    fn stage(self, device: &EmulatedDevice, op: &'static str) -> Result<Self::Staged>;
}

/// A staged operand: lent to the CPU backend, then made this device's again if it was written.
trait Staged {
    /// The operand as the CPU backend's method takes it.
    type Lent<'s>
    where
        Self: 's;

    /// The operand for the CPU backend's call.
    fn lend(&mut self) -> Self::Lent<'_>;

    /// Makes a written operand this device's buffer again (nothing for the others).
    fn finish(self, device: &EmulatedDevice) -> Result<()>;
}

/// A tensor operand that an operation writes (an output, or one it updates in place): its host
/// copy, and where the result goes.
struct Written<'a> {
    to: &'a mut Tensor,
    host: Tensor,
}

impl<E: Bits> Stage for &Tensor<E> {
    type Staged = Tensor<E>;
    fn stage(self, device: &EmulatedDevice, op: &'static str) -> Result<Tensor<E>> {
        device.input(self, op)
    }
}

impl<E: Bits> Staged for Tensor<E> {
    type Lent<'s> = &'s Tensor<E>;
    fn lend(&mut self) -> &Tensor<E> {
        self
    }
    fn finish(self, _: &EmulatedDevice) -> Result<()> {
        Ok(())
    }
}

impl Stage for Option<&Tensor> {
    type Staged = Option<Tensor>;
    fn stage(self, device: &EmulatedDevice, op: &'static str) -> Result<Option<Tensor>> {
        self.map(|t| device.input(t, op)).transpose()
    }
}

impl Staged for Option<Tensor> {
    type Lent<'s> = Option<&'s Tensor>;
    fn lend(&mut self) -> Option<&Tensor> {
        self.as_ref()
    }
    fn finish(self, _: &EmulatedDevice) -> Result<()> {
        Ok(())
    }
}

impl<'a> Stage for &'a mut Tensor {
    type Staged = Written<'a>;
    fn stage(self, device: &EmulatedDevice, _: &'static str) -> Result<Written<'a>> {
        let host = device.in_place(self)?;
        Ok(Written { to: self, host })
    }
}

impl Staged for Written<'_> {
    type Lent<'s>
        = &'s mut Tensor
    where
        Self: 's;
    fn lend(&mut self) -> &mut Tensor {
        &mut self.host
    }
    fn finish(self, device: &EmulatedDevice) -> Result<()> {
        *self.to = device.output(self.host)?;
        Ok(())
    }
}

impl<'a> Stage for Option<&'a mut Tensor> {
    type Staged = Option<Written<'a>>;
    fn stage(self, device: &EmulatedDevice, op: &'static str) -> Result<Option<Written<'a>>> {
        self.map(|t| t.stage(device, op)).transpose()
    }
}

impl Staged for Option<Written<'_>> {
    type Lent<'s>
        = Option<&'s mut Tensor>
    where
        Self: 's;
    fn lend(&mut self) -> Option<&mut Tensor> {
        self.as_mut().map(|w| &mut w.host)
    }
    fn finish(self, device: &EmulatedDevice) -> Result<()> {
        self.map_or(Ok(()), |w| w.finish(device))
    }
}

/// Operands that are not tensors: passed to the CPU backend as they are. An operation with a
/// new type of such operand names it in the list below.
macro_rules! by_value {
    ($($t:ty),*) => {$(
        impl Stage for $t {
            type Staged = Self;
            fn stage(self, _: &EmulatedDevice, _: &'static str) -> Result<Self> {
                Ok(self)
            }
        }

        impl Staged for $t {
            type Lent<'s> = Self;
            fn lend(&mut self) -> Self {
                *self
            }
            fn finish(self, _: &EmulatedDevice) -> Result<()> {
                Ok(())
            }
        }
    )*};
}

by_value!(
    f32,
    usize,
    bool,
    Trans,
    Activation,
    AttentionShape,
    SgdStep,
    AdamStep,
    LionStep,
    DelayCompensation
);

impl Backend for EmulatedDevice {
    backend_ops!(emulated_method);

    // Written out (see `emulated_method` for why): what the device is, and its transfers.
    fn name(&self) -> &'static str {
        "emulated"
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn threads(&self) -> usize {
        1
    }

    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn peak_memory(&self) -> Option<u64> {
        Some(self.usage.peak.load(Ordering::Relaxed))
    }

    /// The host's clock: every operation has run when it returns, as a GPU's has when it
    /// passes the mark, so the callers' reading of marks runs without one.
    fn mark(&self) -> Result<Option<Box<dyn crate::DeviceMark>>> {
        Ok(Some(Box::new(crate::HostMark(std::time::Instant::now()))))
    }

    /// Registers the buffer under a number of this process ([`lent`]): the handle names the
    /// process and the number, as a CUDA IPC handle names an allocation.
    fn lend(&self, t: &Tensor) -> Result<Option<Vec<u8>>> {
        match t.storage() {
            Storage::Device(m)
                if m.as_any()
                    .downcast_ref::<EmulatedMemory>()
                    .is_some_and(|e| e.owner == self.id) =>
            {
                Ok(Some(lent::register(m)))
            }
            Storage::Host(_) => Ok(None),
            Storage::Device(_) => Err(self.wrong("lend", t.device())),
        }
    }

    /// Copies a buffer lent in this process that its lender still holds: one released before
    /// its borrower copied it is an error, where a GPU would have copied whatever the block
    /// held by then.
    fn copy_lent(&self, handle: &[u8], shape: &[usize]) -> Result<Tensor> {
        if !self.borrows {
            return Err(lent::refused(format!(
                "emulated device {} has no peer access to the lender's",
                self.ordinal
            )));
        }
        let memory = lent::take(handle)?;
        let Some(buffer) = memory.as_any().downcast_ref::<EmulatedMemory>() else {
            return Err(lent::refused("it is not an emulated device's buffer"));
        };
        let len = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        let bits = match len {
            Some(len) if len <= buffer.bits.len() => &buffer.bits[..len],
            _ => {
                return Err(lent::refused(format!(
                    "{} values do not fill a tensor of shape {shape:?}",
                    buffer.bits.len()
                )));
            }
        };
        let values = bits.iter().map(|&b| f32::from_bits(b)).collect();
        self.output(Tensor::from_vec(shape, values)?)
    }

    fn place(&self, t: Tensor) -> Result<Tensor> {
        self.place_any(t)
    }

    fn place_ids(&self, t: Tensor<u32>) -> Result<Tensor<u32>> {
        self.place_any(t)
    }

    fn read<'a>(&self, t: &'a Tensor) -> Result<Cow<'a, [f32]>> {
        match t.storage() {
            Storage::Host(v) => Ok(Cow::Borrowed(v)),
            Storage::Device(_) => {
                let placed = self.place_any(t.clone())?;
                Ok(Cow::Owned(self.input(&placed, "read")?.into_host_vec()?))
            }
        }
    }

    fn write(&self, src: &[f32], t: &mut Tensor) -> Result<()> {
        crate::check::write(src.len(), t)?;
        *t = self.output(Tensor::from_vec(t.shape(), src.to_vec())?)?;
        Ok(())
    }

    fn fill(&self, value: f32, x: &mut Tensor) -> Result<()> {
        *x = self.output(Tensor::full(x.shape(), value))?;
        Ok(())
    }
}

/// The buffers emulated devices lend in this process, by number: what stands in for the
/// driver's IPC handles, so that a run over shared memory takes the executor's lending path
/// without a GPU and checks its protocol (a buffer is held until its borrower has copied it).
mod lent {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex, PoisonError, Weak};

    use crate::{DeviceMemory, KernelError, Result};

    /// The first bytes of an emulated device's handle.
    const MAGIC: [u8; 4] = *b"EMU1";

    static NEXT: AtomicU64 = AtomicU64::new(1);

    type Registry = Mutex<HashMap<u64, Weak<dyn DeviceMemory>>>;

    fn registry() -> &'static Registry {
        static LENT: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
        LENT.get_or_init(Registry::default)
    }

    pub(crate) fn refused(detail: impl Into<String>) -> KernelError {
        KernelError::Lent {
            detail: detail.into(),
        }
    }

    /// Registers `memory` and returns its handle: the magic, this process's id and the number.
    /// Buffers released without being copied leave their entries, dropped here as they are
    /// found.
    pub(crate) fn register(memory: &Arc<dyn DeviceMemory>) -> Vec<u8> {
        let number = NEXT.fetch_add(1, Ordering::Relaxed);
        let mut lent = registry().lock().unwrap_or_else(PoisonError::into_inner);
        lent.retain(|_, m| m.strong_count() > 0);
        lent.insert(number, Arc::downgrade(memory));
        let mut handle = MAGIC.to_vec();
        handle.extend_from_slice(&std::process::id().to_le_bytes());
        handle.extend_from_slice(&number.to_le_bytes());
        handle
    }

    /// The buffer `handle` names, taken off the registry (each loan is copied once).
    pub(crate) fn take(handle: &[u8]) -> Result<Arc<dyn DeviceMemory>> {
        let (Some(magic), Some(pid), Some(number)) =
            (handle.get(..4), handle.get(4..8), handle.get(8..16))
        else {
            return Err(refused(format!(
                "a handle of {} bytes, not 16",
                handle.len()
            )));
        };
        if magic != MAGIC || handle.len() != 16 {
            return Err(refused("not an emulated device's handle"));
        }
        let pid = u32::from_le_bytes(pid.try_into().unwrap_or_default());
        if pid != std::process::id() {
            return Err(refused(format!(
                "lent by process {pid}: an emulated device borrows only within its own process"
            )));
        }
        let number = u64::from_le_bytes(number.try_into().unwrap_or_default());
        let entry = registry()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&number);
        let memory = entry.and_then(|m| m.upgrade()).ok_or_else(|| {
            refused(format!(
                "loan {number} was released by its lender before it was copied"
            ))
        })?;
        Ok(memory)
    }
}
