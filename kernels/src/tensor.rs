use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{KernelError, Result, error::shape_err};

/// Source of content stamps: every new or mutably borrowed tensor gets the next value.
static STAMPS: AtomicU64 = AtomicU64::new(1);

fn next_stamp() -> u64 {
    STAMPS.fetch_add(1, Ordering::Relaxed)
}

/// The element types a tensor can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float: activations, gradients, weights.
    F32,
    /// 32-bit unsigned integer: class labels and token ids.
    U32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        4
    }

    /// Short name (`f32`, `u32`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::U32 => "u32",
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u32 {}
}

/// A type a [`Tensor`] can hold: `f32` (the default) or `u32` (ids).
pub trait Element:
    sealed::Sealed + Copy + Default + PartialEq + fmt::Debug + Send + Sync + 'static
{
    /// The matching [`DType`].
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}

impl Element for u32 {
    const DTYPE: DType = DType::U32;
}

/// Where a tensor's elements live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory (a `Vec`).
    Host,
    /// Memory of CUDA device `ordinal`.
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Host => f.write_str("host"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// A buffer a device backend allocated and owns. Only that backend knows what is inside: it
/// gets its own type back with [`DeviceMemory::as_any`]. Everything else sees the device and
/// the size.
pub trait DeviceMemory: Any + Send + Sync + fmt::Debug {
    /// The device holding the buffer.
    fn device(&self) -> Device;
    /// Size in bytes.
    fn bytes(&self) -> usize;
    /// The backend's own type, for downcasting.
    fn as_any(&self) -> &dyn Any;
}

/// A tensor's elements: host memory, or a buffer owned by a device backend.
///
/// Device buffers are shared by clones of a tensor (an `Arc`); a backend that writes one it
/// does not hold alone copies it first, so a clone never sees another's writes.
#[derive(Clone, Debug)]
pub enum Storage<E: Element> {
    /// Elements in host memory, row-major.
    Host(Vec<E>),
    /// A device buffer of `len * size_of::<E>()` bytes.
    Device(Arc<dyn DeviceMemory>),
}

/// A dense tensor: a shape, an element type `E` (`f32` unless said otherwise; `u32` for ids)
/// and contiguous row-major storage on the host or on a device ([`Storage`]).
///
/// Two-dimensional views are used throughout: [`Tensor::rows`] is the product of all dimensions
/// but the last and [`Tensor::cols`] is the last dimension (a 1-D tensor is one row).
///
/// Host code reads elements with [`Tensor::host`], which refuses a tensor held by a device;
/// layers never do, they go through the backend, which is what lets one layer run on the CPU
/// and on a GPU. Backends move tensors between the host and their device.
///
/// Every tensor carries a content stamp ([`Tensor::stamp`]): a process-wide unique number that
/// changes whenever the contents may change (any mutable access) and is shared by clones, which
/// hold the same contents. Backends key caches of derived data (packed GEMM operands) on it.
#[derive(Clone, Debug)]
pub struct Tensor<E: Element = f32> {
    shape: Vec<usize>,
    storage: Storage<E>,
    stamp: u64,
}

impl<E: Element> Default for Tensor<E> {
    /// An empty host tensor (a scratch output for a backend to fill). It allocates nothing:
    /// scratch outputs are made for every kernel call.
    fn default() -> Self {
        Self {
            shape: Vec::new(),
            storage: Storage::Host(Vec::new()),
            stamp: next_stamp(),
        }
    }
}

impl<E: Element> PartialEq for Tensor<E> {
    /// Shapes and elements equal for host tensors; the same buffer for device tensors (the
    /// stamp is not compared).
    fn eq(&self, other: &Self) -> bool {
        self.shape == other.shape
            && match (&self.storage, &other.storage) {
                (Storage::Host(a), Storage::Host(b)) => a == b,
                (Storage::Device(a), Storage::Device(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
    }
}

impl<E: Element> Tensor<E> {
    /// The content stamp: equal stamps mean equal contents (see the type's docs).
    pub fn stamp(&self) -> u64 {
        self.stamp
    }

    /// A host tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        Self::full(shape, E::default())
    }

    /// A host tensor with every element equal to `value`.
    pub fn full(shape: &[usize], value: E) -> Self {
        Self {
            shape: shape.to_vec(),
            storage: Storage::Host(vec![value; shape.iter().product()]),
            stamp: next_stamp(),
        }
    }

    /// Wraps host `data` with `shape`.
    ///
    /// # Errors
    /// [`KernelError::Shape`] when the element count differs from the shape's product.
    pub fn from_vec(shape: &[usize], data: Vec<E>) -> Result<Self> {
        let want: usize = shape.iter().product();
        if want != data.len() {
            return Err(shape_err(
                "from_vec",
                format!("shape {shape:?} needs {want} elements, got {}", data.len()),
            ));
        }
        Ok(Self {
            shape: shape.to_vec(),
            storage: Storage::Host(data),
            stamp: next_stamp(),
        })
    }

    /// Wraps a device buffer with `shape` (for device backends).
    ///
    /// # Errors
    /// [`KernelError::Shape`] when the buffer's size does not hold exactly the shape's elements.
    pub fn from_device(shape: &[usize], memory: Arc<dyn DeviceMemory>) -> Result<Self> {
        let want = shape.iter().product::<usize>() * E::DTYPE.size();
        if want != memory.bytes() {
            return Err(shape_err(
                "from_device",
                format!(
                    "shape {shape:?} of {} needs {want} bytes, the buffer has {}",
                    E::DTYPE.name(),
                    memory.bytes()
                ),
            ));
        }
        Ok(Self {
            shape: shape.to_vec(),
            storage: Storage::Device(memory),
            stamp: next_stamp(),
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        E::DTYPE
    }

    /// Where the elements live.
    pub fn device(&self) -> Device {
        match &self.storage {
            Storage::Host(_) => Device::Host,
            Storage::Device(m) => m.device(),
        }
    }

    /// The storage (for backends).
    pub fn storage(&self) -> &Storage<E> {
        &self.storage
    }

    /// Replaces the storage, keeping the shape (for backends).
    ///
    /// # Errors
    /// [`KernelError::Shape`] when the new storage does not hold exactly the shape's elements.
    pub fn set_storage(&mut self, storage: Storage<E>) -> Result<()> {
        let have = match &storage {
            Storage::Host(v) => v.len() * E::DTYPE.size(),
            Storage::Device(m) => m.bytes(),
        };
        if have != self.len() * E::DTYPE.size() {
            return Err(shape_err(
                "set_storage",
                format!("{have} bytes for shape {:?}", self.shape),
            ));
        }
        self.storage = storage;
        self.stamp = next_stamp();
        Ok(())
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements (0 for an empty default tensor).
    pub fn len(&self) -> usize {
        match &self.storage {
            Storage::Host(v) => v.len(),
            Storage::Device(m) => m.bytes() / E::DTYPE.size(),
        }
    }

    /// True when the tensor holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size of the elements in bytes.
    pub fn bytes(&self) -> usize {
        self.len() * E::DTYPE.size()
    }

    /// Rows of the 2-D view (product of all dimensions but the last; 1 for a scalar or vector).
    pub fn rows(&self) -> usize {
        match self.shape.len() {
            0 | 1 => 1,
            n => self.shape[..n - 1].iter().product(),
        }
    }

    /// Columns of the 2-D view (the last dimension; 1 for a scalar).
    pub fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// The elements, row-major, of a host tensor.
    ///
    /// # Errors
    /// [`KernelError::NotOnHost`] for a tensor held by a device (read it through its backend).
    pub fn host(&self) -> Result<&[E]> {
        match &self.storage {
            Storage::Host(v) => Ok(v),
            Storage::Device(m) => Err(KernelError::NotOnHost { device: m.device() }),
        }
    }

    /// The elements, row-major, of a host tensor, mutably.
    ///
    /// # Errors
    /// [`KernelError::NotOnHost`] for a tensor held by a device.
    pub fn host_mut(&mut self) -> Result<&mut [E]> {
        self.stamp = next_stamp();
        match &mut self.storage {
            Storage::Host(v) => Ok(v),
            Storage::Device(m) => Err(KernelError::NotOnHost { device: m.device() }),
        }
    }

    /// Gives a host tensor's storage back.
    ///
    /// # Errors
    /// [`KernelError::NotOnHost`] for a tensor held by a device.
    pub fn into_host_vec(self) -> Result<Vec<E>> {
        match self.storage {
            Storage::Host(v) => Ok(v),
            Storage::Device(m) => Err(KernelError::NotOnHost { device: m.device() }),
        }
    }

    /// Changes the shape keeping the elements (on any device).
    ///
    /// # Errors
    /// [`KernelError::Shape`] when the element count would change.
    pub fn reshape(mut self, shape: &[usize]) -> Result<Self> {
        let want: usize = shape.iter().product();
        if want != self.len() {
            return Err(KernelError::Shape {
                op: "reshape",
                detail: format!("cannot view {:?} as {shape:?}", self.shape),
            });
        }
        self.shape = shape.to_vec();
        self.stamp = next_stamp();
        Ok(self)
    }

    /// Makes this a host tensor of `shape` whose elements `write` fills, reusing a host
    /// allocation without clearing it first: for an output that a kernel overwrites whole, where
    /// [`Tensor::resize_host`] would write every new element twice (a multi-megabyte pass of
    /// zeros per fresh output).
    ///
    /// # Safety
    /// `write` must initialise every element of the slice it is given before it returns, and
    /// must not read an element it has not written.
    pub unsafe fn write_host_with<R>(
        &mut self,
        shape: &[usize],
        write: impl FnOnce(&mut [std::mem::MaybeUninit<E>]) -> R,
    ) -> R {
        let n = shape.iter().product();
        let mut v = match std::mem::replace(&mut self.storage, Storage::Host(Vec::new())) {
            Storage::Host(v) => v,
            Storage::Device(_) => Vec::new(),
        };
        v.clear();
        v.reserve(n);
        let out = write(&mut v.spare_capacity_mut()[..n]);
        // SAFETY: the caller's `write` initialised the first n elements.
        unsafe { v.set_len(n) };
        self.storage = Storage::Host(v);
        self.shape.clear();
        self.shape.extend_from_slice(shape);
        self.stamp = next_stamp();
        out
    }

    /// Makes this a host tensor of `shape` and returns its elements, reusing a host allocation;
    /// contents are unspecified afterwards (zero where new storage was added). For host
    /// backends writing an output.
    pub fn resize_host(&mut self, shape: &[usize]) -> &mut [E] {
        self.stamp = next_stamp();
        let n = shape.iter().product();
        if self.shape != shape {
            self.shape.clear();
            self.shape.extend_from_slice(shape);
        }
        if let Storage::Device(_) = self.storage {
            self.storage = Storage::Host(Vec::new());
        }
        match &mut self.storage {
            Storage::Host(v) => {
                v.resize(n, E::default());
                v
            }
            // Unreachable: the storage was made host memory above.
            Storage::Device(_) => &mut [],
        }
    }
}
