//! The AMX tile unit's bf16 rate with nothing but the unit at work: four accumulator tiles,
//! each adding a 16 x 32 by 32 x 16 bf16 product (`tdpbf16ps`) in turn, operands held in tiles
//! (no memory traffic), on each of `THREADS` threads at once, three rounds.
//!
//! ```sh
//! cargo run --release -p pipe-kernels --example amx_peak -- 2   # threads
//! ```
//!
//! A `--precision bf16x6` product can reach a sixth of this rate at most (six bf16 products per
//! f32 term). On a virtual machine the figure moves when another guest shares the physical
//! cores' tile units, so it is worth taking beside any bf16x6 timing.

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    if !has_tiles() {
        eprintln!("this CPU or OS offers no AMX bf16 tiles");
        std::process::exit(2);
    }
    for round in 1..=3 {
        let rates: Vec<f64> = std::thread::scope(|scope| {
            let runs: Vec<_> = (0..threads).map(|_| scope.spawn(tile_rate)).collect();
            runs.into_iter()
                .map(|run| run.join().unwrap_or(f64::NAN))
                .collect()
        });
        let each: Vec<String> = rates.iter().map(|r| format!("{r:.2}")).collect();
        println!(
            "round {round}: {} TFLOP/s a thread ({threads} threads)",
            each.join(", ")
        );
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn main() {
    eprintln!("AMX is an x86-64 unit; this probe runs on Linux only");
    std::process::exit(2);
}

/// Whether the CPU and OS run AMX bf16 tiles for this process: the backend's own check, which
/// also asks the kernel for the tile state.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn has_tiles() -> bool {
    pipe_kernels::CpuBackend::with_precision(1, pipe_kernels::Precision::Bf16x6).is_ok()
}

/// TFLOP/s of 20 million rounds of four `tdpbf16ps` on the calling thread.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn tile_rate() -> f64 {
    const ROUNDS: u64 = 20_000_000;
    // Palette 1, every tile 16 rows of 64 bytes.
    #[repr(C, align(64))]
    struct Config([u8; 64]);
    let mut config = Config([0; 64]);
    config.0[0] = 1;
    for t in 0..8 {
        config.0[16 + 2 * t] = 64;
        config.0[48 + t] = 16;
    }
    let start = std::time::Instant::now();
    // SAFETY: the process holds the tile permission (`has_tiles`), the configuration is a
    // valid aligned palette-1 block, and the tiles are released before returning.
    unsafe {
        std::arch::asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly));
        std::arch::asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "tilezero tmm4",
            "tilezero tmm5",
            "tilezero tmm6",
            "tilezero tmm7",
            options(nostack, nomem)
        );
        for _ in 0..ROUNDS {
            std::arch::asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                options(nostack, nomem)
            );
        }
        std::arch::asm!("tilerelease", options(nostack, nomem));
    }
    let flops = ROUNDS as f64 * 4.0 * (16 * 16 * 32 * 2) as f64;
    flops / start.elapsed().as_secs_f64() / 1e12
}
