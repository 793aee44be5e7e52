//! `pipe-kernels` owns tensors and the compute backends that every other crate calls.
//!
//! A [`Tensor`] is a shape and a contiguous row-major `f32` buffer; nothing else. All arithmetic
//! goes through the [`Backend`] trait so that layers in `pipe-stages` are written once and run on
//! the CPU backend (always built) or on CUDA (behind the `cuda` feature; without it the CUDA
//! constructor returns [`KernelError::NotCompiledWithCuda`]).
//!
//! The CPU backend is built around one promise: **the same inputs give the same bits whatever the
//! thread count**. Matrix multiplies come from the `gemm` crate (with its AVX-512 kernels compiled
//! in and chosen at run time), but the work is split into output blocks whose layout depends only
//! on the problem's shape, never on the number of threads, and no reduction is ever split across
//! threads. Threads only decide *who* computes a block, not *how* it is summed. This is what lets
//! the pipelined executor be checked bit for bit against the sequential reference trainer.

#![warn(missing_docs)]

mod backend;
mod check;
mod cpu;
pub mod cuda;
mod denormals;
mod emulated;
mod error;
mod fastmath;
mod scratch;
mod sequence;
mod tensor;
mod tile;
mod timed;
mod vector;

pub use backend::{
    Activation, AdamStep, AttentionShape, Backend, BackendKind, LossStats, Precision, SgdStep,
    Trans,
};
pub use cpu::CpuBackend;
pub use cuda::CudaBackend;
#[cfg(feature = "cuda")]
pub use cuda::PoolStats;
pub use denormals::{flush_denormals, flushes_denormals};
pub use emulated::EmulatedDevice;
pub use error::KernelError;
pub use tensor::{DType, Device, DeviceMemory, Element, Storage, Tensor};
pub use timed::Timed;

/// Result type of this crate.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;
