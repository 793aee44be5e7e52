//! The CUDA backend's entry point. Without the `cuda` feature it only reports that the build has
//! no CUDA support, so that `--backend cuda` fails with a clear message instead of not compiling.

use crate::{KernelError, Result};

/// Handle to a CUDA device. Only constructible in builds with the `cuda` feature and a driver.
#[derive(Debug)]
pub struct CudaBackend {
    _private: (),
}

impl CudaBackend {
    /// Opens CUDA device `ordinal`.
    ///
    /// # Errors
    /// [`KernelError::NotCompiledWithCuda`] in builds without the `cuda` feature (and, until the
    /// CUDA kernels land, in every build).
    pub fn new(ordinal: usize) -> Result<Self> {
        let _ = ordinal;
        Err(KernelError::NotCompiledWithCuda)
    }
}
