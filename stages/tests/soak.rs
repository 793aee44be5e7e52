//! Soak runs, ignored by default: PipeDream with a replicated stage for 500,000 microbatches in
//! process and 100,000 over QUIC (five times what the reliability target asks), in segments as
//! a run of epochs is. Each must
//! finish (no deadlock), keep every worker's weight versions at the plan's peak, and keep the
//! process's resident memory flat after the first segments (no growth after warm-up).
//!
//! ```sh
//! cargo test --release -p pipe-stages --test soak -- --ignored --nocapture
//! ```
//!
//! `docs/reliability.md` records the figures of a run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

mod common;

use common::{data, even, opt};
use pipe_kernels::CpuBackend;
use pipe_scheduler::{Length, Policy, ScheduleSpec};
use pipe_stages::model::{Model, ModelSpec};
use pipe_stages::pipeline::{RunPlan, WorkerState, run_threads};
use pipe_transport::Transport;
use pipe_transport::inproc::{InProcOptions, mesh};
use pipe_transport::quic::{QuicOptions, local_mesh};

/// The soaks share the process whose memory they measure: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Resident memory of this process, bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

fn lr(_stage: u32, _k: u32) -> f32 {
    0.01
}

/// Runs `segments` segments of `updates` updates of PipeDream on 3 stages with replicas
/// [1, 2, 1] and M = 4 (8 microbatches per update), over endpoints `mesh_for` makes for each
/// segment. Returns the microbatches run.
fn soak<T: Transport>(
    name: &str,
    segments: u32,
    updates: u32,
    mesh_for: impl Fn(u32) -> Vec<T>,
) -> u64 {
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let model = Model::new(&ModelSpec::preset("mlp-784-32x3-10").unwrap()).unwrap();
    let spec = ScheduleSpec::new(Policy::PipeDream, 3, 4)
        .with_replicas(vec![1, 2, 1])
        .with_length(Length::Updates(updates));
    let run = RunPlan::new(&model, &spec, Some(even(model.len(), 3))).unwrap();
    let per_segment = u64::from(run.schedule.resolved.total);
    let mut states: Vec<WorkerState> = Vec::new();
    let mut samples = Vec::new();
    let start = Instant::now();
    for seg in 0..segments {
        let source = common::shuffled(&data().train, 1, u64::from(seg) + 1, 4);
        let setup = common::setup(&model, &run, &source, 1, &lr);
        if states.is_empty() {
            states = common::worker_states(&setup, &model.init_params(1), opt());
        }
        let outs = run_threads(&setup, &mut states, mesh_for(seg), |_| CpuBackend::new(1))
            .unwrap_or_else(|e| panic!("{name}, segment {seg}: {e}"));
        for o in &outs {
            assert_eq!(
                o.peak_versions, run.versions.peak_versions[o.worker as usize],
                "{name}: worker {} held more weight versions than planned",
                o.worker
            );
        }
        samples.push(rss());
    }
    let secs = start.elapsed().as_secs_f64();
    let total = per_segment * u64::from(segments);
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let warm = samples[samples.len() / 4];
    let last = *samples.last().unwrap();
    let peak = *samples.iter().max().unwrap();
    eprintln!(
        "{name}: {total} microbatches in {secs:.1} s ({:.0}/s); resident memory after warm-up \
         {:.1} MiB, at the end {:.1} MiB, peak {:.1} MiB",
        total as f64 / secs,
        mib(warm),
        mib(last),
        mib(peak)
    );
    let series: Vec<String> = samples
        .iter()
        .step_by((samples.len() / 8).max(1))
        .map(|&b| format!("{:.1}", mib(b)))
        .collect();
    eprintln!(
        "{name}: resident MiB every {} segments: {}",
        (samples.len() / 8).max(1),
        series.join(" ")
    );
    // Flat: the end within 5% (or 8 MiB) of the warm level.
    let allowed = (warm / 20).max(8 << 20);
    assert!(
        last <= warm + allowed,
        "{name}: resident memory grew from {:.1} MiB to {:.1} MiB",
        mib(warm),
        mib(last)
    );
    total
}

#[test]
#[ignore = "soak: under a minute in release; run with --ignored"]
fn pipedream_with_replicas_runs_500k_microbatches_in_process_with_flat_memory() {
    let total = soak("in-process", 100, 625, |_| {
        mesh(
            4,
            &InProcOptions {
                timeout: Some(Duration::from_secs(60)),
                ..InProcOptions::default()
            },
        )
    });
    assert!(total >= 500_000);
}

#[test]
#[ignore = "soak: under a minute in release; run with --ignored"]
fn pipedream_with_replicas_runs_100k_microbatches_over_quic_with_flat_memory() {
    let total = soak("QUIC", 40, 313, |seg| {
        let mut opts = QuicOptions::new(0x50a4 + u64::from(seg));
        opts.timeout = Some(Duration::from_secs(60));
        local_mesh(4, &opts).unwrap()
    });
    assert!(total >= 100_000);
}
