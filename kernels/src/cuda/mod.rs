//! The CUDA backend: cuBLAS for products (cuBLASLt where a linear layer's bias, GELU and
//! their gradients ride in the product's epilogue), NVRTC-compiled kernels (`kernels.cu`) for everything
//! else, device memory from a caching allocator, one stream per backend.
//!
//! It is built only with the `cuda` feature, against cudarc with dynamic loading: the build needs
//! no CUDA toolkit, and the driver, cuBLAS and NVRTC libraries are opened at run time. Opening the
//! backend on a machine without them is an error ([`KernelError::NoCuda`]), never a panic: the
//! driver library's presence is checked before any cudarc entry point is called. Without the
//! feature every entry point returns [`KernelError::NotCompiledWithCuda`].
//!
//! The kernel source is part of every build ([`KERNEL_SOURCE`]) so that it can be compiled by
//! NVRTC on a machine with no GPU ([`check_source`]): a kernel that does not compile
//! cannot land.

#[cfg(doc)]
use crate::KernelError;
use crate::Result;

mod classes;
mod doctor;
pub mod libraries;
mod source;

pub use classes::block_bytes;
pub use doctor::doctor;

pub use source::{CHECKED_ARCHITECTURES, KERNEL_SOURCE};

#[cfg(feature = "cuda")]
mod compile;
#[cfg(feature = "cuda")]
mod deferred;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod epilogue;
#[cfg(feature = "cuda")]
mod events;
#[cfg(feature = "cuda")]
mod lending;
#[cfg(feature = "cuda")]
mod memory;
#[cfg(feature = "cuda")]
mod multi_tensor;

#[cfg(feature = "cuda")]
pub use device::{CudaBackend, device_count, device_memory};
#[cfg(feature = "cuda")]
pub use memory::PoolStats;

/// Compiles CUDA C `source` (the backend's is [`KERNEL_SOURCE`]) with NVRTC both ways the
/// backend loads it, PTX for `compute_<arch>` and machine code for `sm_<arch>`, and returns the
/// sizes `(ptx, cubin)`. Needs the NVRTC library, not a GPU.
///
/// # Errors
/// [`KernelError::NotCompiledWithCuda`] without the `cuda` feature, [`KernelError::NoCuda`]
/// when NVRTC cannot be loaded, [`KernelError::Cuda`] with the compiler's log when the source
/// does not compile.
pub fn check_source(source: &str, arch: u32) -> Result<(usize, usize)> {
    #[cfg(feature = "cuda")]
    {
        let ptx = compile::compile(source, compile::Target::Ptx(arch))?;
        let cubin = compile::compile(source, compile::Target::Cubin(arch))?;
        Ok((ptx.len(), cubin.len()))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (source, arch);
        Err(crate::KernelError::NotCompiledWithCuda)
    }
}

/// Opens the CUDA backend on device `ordinal`, its products in `precision`, as a trait object.
pub(crate) fn open(ordinal: usize, precision: crate::Precision) -> Result<Box<dyn crate::Backend>> {
    #[cfg(feature = "cuda")]
    {
        Ok(Box::new(CudaBackend::with_precision(ordinal, precision)?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = precision;
        CudaBackend::new(ordinal)?;
        Err(crate::KernelError::NotCompiledWithCuda)
    }
}

/// Whether NVRTC can be loaded here (false without the `cuda` feature).
pub fn nvrtc_available() -> bool {
    #[cfg(feature = "cuda")]
    {
        compile::nvrtc_present()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

#[cfg(not(feature = "cuda"))]
mod absent {
    use crate::{KernelError, Result};

    /// The CUDA backend; this build has no CUDA support, so it cannot be opened.
    #[derive(Debug)]
    pub struct CudaBackend {
        _private: (),
    }

    impl CudaBackend {
        /// `be` as the CUDA backend: never, in this build.
        pub fn of(be: &dyn crate::Backend) -> Option<&CudaBackend> {
            be.as_any().downcast_ref()
        }

        /// Opens CUDA device `ordinal`.
        ///
        /// # Errors
        /// Always [`KernelError::NotCompiledWithCuda`] in this build.
        pub fn new(ordinal: usize) -> Result<Self> {
            let _ = ordinal;
            Err(KernelError::NotCompiledWithCuda)
        }
    }

    /// The number of CUDA devices this process can see.
    ///
    /// # Errors
    /// Always [`KernelError::NotCompiledWithCuda`] in this build.
    pub fn device_count() -> Result<usize> {
        Err(KernelError::NotCompiledWithCuda)
    }

    /// Bytes of memory GPU `ordinal` has in all.
    ///
    /// # Errors
    /// Always [`KernelError::NotCompiledWithCuda`] in this build.
    pub fn device_memory(ordinal: usize) -> Result<u64> {
        let _ = ordinal;
        Err(KernelError::NotCompiledWithCuda)
    }
}

#[cfg(not(feature = "cuda"))]
pub use absent::{CudaBackend, device_count, device_memory};
