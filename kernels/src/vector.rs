//! Loops compiled for the widest vector instructions the running CPU has.
//!
//! The workspace is built for the baseline of its target (SSE2 on x86-64), so an ordinary loop
//! runs four `f32` lanes at a time even on a machine with AVX-512. [`vectorized`] runs a
//! [`Kernel`] inside a function compiled for AVX-512 (or AVX2 with FMA, or the baseline), chosen
//! at run time by `pulp` (the dispatch the `gemm` crate already uses); the kernel's loops are
//! inlined there and vectorised for that width. Plain `a * b + c` is never contracted into a
//! fused multiply-add by the compiler, and nothing reorders a sum, so a closure written with
//! ordinary arithmetic gives the same bits on every path; only code that asks for fused
//! operations explicitly (the attention tiles in [`crate::tile`]) rounds per machine, as the
//! `gemm` crate's products already do.

use std::sync::OnceLock;

/// The instruction set detected once per process.
pub(crate) fn arch() -> pulp::Arch {
    static ARCH: OnceLock<pulp::Arch> = OnceLock::new();
    *ARCH.get_or_init(pulp::Arch::new)
}

/// A loop to run vectorised. The code must reach the dispatched function inlined, so `run`
/// and every function it calls with a hot loop are `#[inline(always)]` (a closure handed
/// through would be compiled once, for the baseline, whenever the compiler chose not to
/// inline it).
pub(crate) trait Kernel {
    /// What the loop returns.
    type Output;
    /// Runs the loop.
    fn run(self) -> Self::Output;
}

/// Runs `kernel` compiled for the detected instruction set (see the module docs).
pub(crate) fn vectorized<K: Kernel>(kernel: K) -> K::Output {
    arch().dispatch(Run(kernel))
}

/// [`Kernel`] as a `pulp` operation.
struct Run<K>(K);

impl<K: Kernel> pulp::WithSimd for Run<K> {
    type Output = K::Output;

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) -> K::Output {
        self.0.run()
    }
}
