//! `pipe-kernels` owns tensors and the compute backends that every other crate calls.
//!
//! A [`Tensor`] is a shape, an element type ([`Element`]: `f32` by default, `u32` for labels and
//! token ids; [`DType`] names it) and contiguous row-major [`Storage`]: a host `Vec`, or a buffer
//! that a device backend allocated and only it reads ([`DeviceMemory`], on a [`Device`]).
//! Host code reads elements with [`Tensor::host`], which refuses a device tensor. All arithmetic
//! goes through the [`Backend`] trait so that layers in `pipe-stages` are written once and run on
//! the CPU backend ([`CpuBackend`], always built), on CUDA ([`CudaBackend`]: cuBLAS products
//! (cuBLASLt's where a linear layer's bias, GELU and their gradients ride in the product's
//! epilogue),
//! NVRTC-compiled kernels and a caching allocator, behind the `cuda` feature; without it the
//! constructor returns [`KernelError::NotCompiledWithCuda`]; [`cuda`] also decides which CUDA
//! libraries are opened), or on [`EmulatedDevice`], a device backend whose arithmetic is the
//! CPU's, so the device code paths are tested without a GPU. [`BackendKind`] is the typed
//! backend choice, with its [`Precision`]; [`Timed`] wraps any backend to time its kernels, and
//! [`DeviceMark`]s time what a device backend queued without waiting for it.
//!
//! The CPU backend is built around one promise: **the same inputs give the same bits whatever the
//! thread count**. Matrix multiplies come from the `gemm` crate (with its AVX-512 kernels compiled
//! in and chosen at run time), but the work is split into output blocks whose layout depends only
//! on the problem's shape, never on the number of threads, and no reduction is ever split across
//! threads. Threads only decide *who* computes a block, not *how* it is summed. This is what lets
//! the pipelined executor be checked bit for bit against the sequential reference trainer.
//! Under [`Precision::Bf16x6`] the large products go to Intel's AMX tiles instead (`split_bf16`:
//! f32's accuracy from six bf16 products per term) under the same promise, and with the tile
//! instruction emulated where AMX is absent, the same bits on every CPU. Where the environment
//! names an external CBLAS library ([`CBLAS_ENV`], `PIPE_CBLAS`: oneMKL, OpenBLAS), its
//! `cblas_sgemm` computes the f32 products instead of `gemm`, one thread per block of the same
//! shape-only split, so the promise holds with that library's bits ([`cblas_library`]).

#![warn(missing_docs)]

mod backend;
mod cblas;
mod check;
mod cpu;
pub mod cuda;
mod denormals;
mod emulated;
mod error;
mod fastmath;
pub mod files;
mod marks;
mod rowwise;
mod scratch;
mod sequence;
mod split_bf16;
mod tensor;
mod tile;
mod timed;
mod vector;

pub use backend::{
    Activation, AdamStep, AdamTensors, AttentionShape, Backend, BackendKind, DelayCompensation,
    IGNORED_LABEL, LionStep, LossReading, LossStats, Precision, QueuedLoss, SgdStep, Trans,
    UpdateSeen, counted_labels, lion_sign,
};
pub use cblas::{ENV as CBLAS_ENV, cblas_library};
pub use cpu::CpuBackend;
pub use cuda::CudaBackend;
#[cfg(feature = "cuda")]
pub use cuda::PoolStats;
pub use denormals::{flush_denormals, flushes_denormals};
pub use emulated::EmulatedDevice;
pub use error::KernelError;
pub use marks::{DeviceMark, HostMark};
pub use tensor::{DType, Device, DeviceMemory, Element, Storage, Tensor};
pub use timed::{OperationTime, Timed};

/// Result type of this crate.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;
