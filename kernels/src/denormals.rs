//! Flush-to-zero and denormals-are-zero for the calling thread.
//!
//! Arithmetic on subnormal floats (magnitudes below about 1.2e-38) takes a slow microcode path
//! on x86: a run whose activations or gradients decay towards zero slowed about twofold. Every
//! compute thread therefore treats subnormal inputs as zero and flushes subnormal results to
//! zero. The CPU backend sets both on the thread that creates it and on its pool's threads;
//! since the setting is per thread and results differ only below the normal range, the
//! reference trainer and the pipelined workers, all computing on such threads, still agree bit
//! for bit.

/// Sets flush-to-zero and denormals-are-zero on the calling thread (x86-64: MXCSR bits 15 and
/// 6; aarch64: FPCR.FZ). Idempotent and cheap. Other architectures keep their default.
pub fn flush_denormals() {
    #[cfg(target_arch = "x86_64")]
    {
        const FLUSH_TO_ZERO: u32 = 1 << 15;
        const DENORMALS_ARE_ZERO: u32 = 1 << 6;
        let mut csr: u32 = 0;
        // SAFETY: `stmxcsr` stores this thread's SSE control and status register into `csr` and
        // `ldmxcsr` loads it back with two mode bits set; both touch only that register and the
        // local they are given, and the modes change only how subnormal values are rounded.
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags));
            csr |= FLUSH_TO_ZERO | DENORMALS_ARE_ZERO;
            std::arch::asm!(
                "ldmxcsr [{}]",
                in(reg) &csr,
                options(nostack, preserves_flags, readonly)
            );
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        const FZ: u64 = 1 << 24;
        let mut fpcr: u64;
        // SAFETY: reads and writes this thread's floating-point control register, setting only
        // the flush-to-zero mode bit.
        unsafe {
            std::arch::asm!("mrs {}, fpcr", out(reg) fpcr, options(nomem, nostack, preserves_flags));
            fpcr |= FZ;
            std::arch::asm!("msr fpcr, {}", in(reg) fpcr, options(nomem, nostack, preserves_flags));
        }
    }
}

/// True when the calling thread flushes subnormal results to zero (checked by arithmetic).
pub fn flushes_denormals() -> bool {
    let tiny = std::hint::black_box(1e-30f32);
    let scale = std::hint::black_box(1e-10f32);
    std::hint::black_box(tiny * scale) == 0.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    fn a_flushing_thread_turns_subnormal_products_into_zero() {
        std::thread::spawn(|| {
            assert!(!flushes_denormals(), "a fresh thread keeps IEEE subnormals");
            flush_denormals();
            assert!(flushes_denormals());
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e));
    }
}
