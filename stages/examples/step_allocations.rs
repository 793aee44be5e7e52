//! What one training step allocates, step by step: the allocations of 64 KiB or more and
//! their bytes, counted by a global allocator around the system's, for the step `pipe bench
//! mfu` times (forward, loss, backward, update over one batch already in memory).
//!
//! ```sh
//! cargo run --release -p pipe-stages --example step_allocations              # the MLP preset
//! MODEL=gpt2 WIDTH=768 BATCH=16 cargo run --release -p pipe-stages --example step_allocations
//! ```
//!
//! `MODEL` is a preset (default `mlp-784-1024x16-10`, batch 256, SGD) or `gpt2`: 8 blocks of
//! `WIDTH` (default 768) with `WIDTH / 32` heads, 128 positions, a vocabulary of 1,024 and
//! AdamW, as `experiments/cpu-step/run.sh` trains it. `THREADS` defaults to 2. The batch is
//! copied before each step is counted, as a data loader's batch is made outside the step.
//!
//! The `pipe` binary allocates through mimalloc, which keeps freed pages for 10 s
//! (`docs/architecture.md`), so these allocations cost it no page faults after the first
//! step; this example runs on the system allocator, and its page-fault column shows what
//! glibc does with the same allocations.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use pipe_kernels::{CpuBackend, Tensor};
use pipe_stages::model::{Model, ModelSpec, place_params};
use pipe_stages::optim::{Optimizer, OptimizerConfig, OptimizerKind};
use pipe_stages::planning::profile::random_input;
use pipe_stages::train::{StepState, train_step};
use pipe_stages::transformer::GptShape;

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
    let model_name = std::env::var("MODEL").unwrap_or_else(|_| "mlp-784-1024x16-10".into());
    let threads = var("THREADS", 2);
    let (spec, batch, kind) = if model_name == "gpt2" {
        let width = var("WIDTH", 768);
        let shape = GptShape {
            blocks: 8,
            width,
            heads: width / 32,
            context: 128,
        };
        let spec = ModelSpec::gpt(shape, 1024, true);
        (spec, var("BATCH", 16), OptimizerKind::Adamw)
    } else {
        let spec = ModelSpec::preset(&model_name).expect("a model preset or gpt2");
        (spec, var("BATCH", 256), OptimizerKind::Sgd)
    };
    let be = CpuBackend::new(threads).unwrap();
    let model = Model::new(&spec).unwrap();
    let mut params = place_params(&be, model.init_params(0)).unwrap();
    let mut grads = place_params(&be, model.zero_grads(0..model.len())).unwrap();
    let config = OptimizerConfig {
        kind,
        ..OptimizerConfig::default()
    };
    let roles = model.optimizer_roles();
    let mut opt = Optimizer::new(config, &params, &roles).placed(&be).unwrap();
    let (&classes, rows) = model.output_shape().split_last().unwrap();
    let targets = batch * rows.iter().product::<usize>();
    let mut shape = vec![batch];
    shape.extend_from_slice(model.input_shape());
    let x = random_input(&model, 0, &shape, 0, "x").unwrap();
    let labels = (0..targets).map(|i| (i % classes) as u32).collect();
    let y = Tensor::from_vec(&[targets], labels).unwrap();
    println!("{model_name}, batch {batch}, {threads} thread(s), the system allocator");
    println!("| step | ms | allocations of 64 KiB or more | their MiB | page faults |");
    println!("|---|---|---|---|---|");
    let mut microbatch = 0;
    for step in 0..6 {
        let batches = vec![(x.clone(), y.clone())];
        let (count, bytes, faults) = (
            COUNT.load(Ordering::Relaxed),
            BYTES.load(Ordering::Relaxed),
            minor_faults(),
        );
        let start = Instant::now();
        let mut st = StepState {
            params: &mut params,
            grads: &mut grads,
            opt: &mut opt,
        };
        let scale = 1.0 / targets as f32;
        train_step(
            &be,
            &model,
            &mut st,
            batches,
            scale,
            0.01,
            0,
            &mut microbatch,
        )
        .unwrap();
        println!(
            "| {step} | {:.0} | {} | {:.1} | {} |",
            start.elapsed().as_secs_f64() * 1e3,
            COUNT.load(Ordering::Relaxed) - count,
            (BYTES.load(Ordering::Relaxed) - bytes) as f64 / f64::from(1 << 20),
            minor_faults() - faults
        );
    }
}
