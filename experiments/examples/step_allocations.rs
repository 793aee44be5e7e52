//! What one training step allocates, step by step: the allocations of 64 KiB or more and
//! their bytes, counted by a global allocator around the system's, in the step `pipe bench
//! mfu` times ([`StepBench`]: forward, loss, backward and update over one batch in memory).
//!
//! ```sh
//! cargo run --release -p pipe-experiments --example step_allocations            # the MLP preset
//! MODEL=gpt2 cargo run --release -p pipe-experiments --example step_allocations  # width 768
//! ```
//!
//! `MODEL` is a preset (default `mlp-784-1024x16-10`, batch 256, SGD, as `pipe bench mfu`
//! runs it) or `gpt2`: 8 blocks of `WIDTH` (default 768) with `WIDTH / 32` heads, 128
//! positions, a vocabulary of 1,024, batch 16 and AdamW, as `experiments/cpu-step/profile.sh`
//! measures it. `THREADS` defaults to 2.
//!
//! The `pipe` binary allocates through mimalloc, which keeps freed pages for 10 s
//! (`docs/architecture.md`), so these allocations cost it almost no page faults after the
//! first step; this example runs on the system allocator, and its page-fault column shows
//! what glibc does with the same allocations.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use pipe_experiments::mfu::{MfuConfig, MfuOptimizer, StepBench};
use pipe_kernels::CpuBackend;
use pipe_stages::transformer::Gpt2Shape;

/// The smallest allocation counted.
const LARGE: usize = 64 * 1024;

/// The system allocator, counting allocations of [`LARGE`] bytes or more and their bytes.
struct Counting;

static COUNT: AtomicUsize = AtomicUsize::new(0);
static BYTES: AtomicUsize = AtomicUsize::new(0);

fn count(size: usize) {
    if size >= LARGE {
        COUNT.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(size, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Minor page faults of this process so far (`/proc/self/stat`, field 10).
fn minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after_name = stat.rfind(')').map_or("", |i| &stat[i + 1..]);
    after_name
        .split_whitespace()
        .nth(7)
        .and_then(|f| f.parse().ok())
        .unwrap_or(0)
}

fn var(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let model = std::env::var("MODEL").unwrap_or_else(|_| "mlp-784-1024x16-10".into());
    let mut cfg = MfuConfig {
        threads: var("THREADS", 2),
        ..MfuConfig::default()
    };
    if model == "gpt2" {
        let width = var("WIDTH", 768);
        cfg.gpt2 = Gpt2Shape {
            n_layer: Some(8),
            n_head: Some(width / 32),
            n_embd: Some(width),
            n_positions: Some(128),
            vocab_size: Some(1024),
            padded_vocab_size: None,
        };
        cfg.batch = 16;
        cfg.optimizer = MfuOptimizer::Adamw;
    }
    cfg.model = model;
    let be = CpuBackend::new(cfg.threads).expect("backend");
    let mut bench = StepBench::new(&be, &cfg).expect("the model and its batch");
    println!(
        "{}, batch {}, {} thread(s), the system allocator",
        cfg.model, cfg.batch, cfg.threads
    );
    println!("| step | ms | allocations of 64 KiB or more | their MiB | page faults |");
    println!("|---|---|---|---|---|");
    for step in 0..6 {
        let (count, bytes, faults) = (
            COUNT.load(Ordering::Relaxed),
            BYTES.load(Ordering::Relaxed),
            minor_faults(),
        );
        let start = Instant::now();
        bench.step(&be).expect("step");
        println!(
            "| {step} | {:.0} | {} | {:.1} | {} |",
            start.elapsed().as_secs_f64() * 1e3,
            COUNT.load(Ordering::Relaxed) - count,
            (BYTES.load(Ordering::Relaxed) - bytes) as f64 / f64::from(1 << 20),
            minor_faults() - faults
        );
    }
}
