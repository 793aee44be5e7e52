//! The kernels' CUDA C source, part of every build (with or without the `cuda` feature) so that
//! NVRTC can check it on a machine with no GPU.

/// The CUDA C source of the backend's kernels (compiled at run time by NVRTC).
pub const KERNEL_SOURCE: &str = include_str!("kernels.cu");

/// The GPU architectures CI compiles the kernels for (`compute_XY`): Volta, Ampere, Hopper.
pub const CHECKED_ARCHITECTURES: [u32; 3] = [70, 80, 90];
