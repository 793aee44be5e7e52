//! `pipe train`: a run of the flags' configuration ([`crate::training`]), with a progress
//! bar, per-epoch summaries, the optional JSON-lines log and Chrome trace, checkpoints,
//! resume, and a clean stop on Ctrl-C. Every run goes through the pipelined executor's
//! segment loop: its workers are threads of this process (one, running the whole model,
//! when no pipeline flag is given) or `pipe worker` processes on this host (`--placement
//! processes`, or `--transport shm|quic`; [`pipe_stages::pipeline::processes`]), whose links
//! the run's transport choice carries.

use std::cell::Cell;

use anyhow::{Context, Result};
use pipe_stages::checkpoint::CheckpointPolicy;
use pipe_stages::config::{LaunchSettings, Placement, RunConfig};
use pipe_stages::pipeline::Observer;
use pipe_stages::pipeline::PipelineTrainOptions;
use pipe_stages::pipeline::doctor::StopReport;
use pipe_stages::pipeline::relaunch::{
    Launcher, Processes, Relaunch, RelaunchEvents, Replanned, Threads, drive,
};
use pipe_stages::pipeline::restart::{Restart, RestartPolicy, fault_schedule};
use pipe_stages::pipeline::survive::LayoutChange;
use pipe_stages::train::{EpochStats, EvalStats, StepStats};
use pipe_transport::fault::{FaultPlan, FaultSchedule};

use crate::args::open_backend;
use crate::output::bad_input;
use crate::phases::Phases;
use crate::startup_view::StartView;
pub use crate::training::TrainArgs;
use crate::training::{
    Fan, finish_checkpoints, print_done, print_done_line, run_config, serve_metrics, stop_on_ctrl_c,
};
use pipe_stages::pipeline::processes::LaunchOptions;
use pipe_stages::pipeline::trace_parts::{merge_parts, part_path, worker_names};
use pipe_stages::startup::{self, PreparedRun, prepare};

/// Runs `pipe train`.
///
/// # Errors
/// Bad input for flags, config, plan or data files that describe no run; run-time failures of
/// training or of writing its outputs.
pub fn run(args: &TrainArgs) -> Result<()> {
    let phases = Phases::new();
    let (cfg, launch) = run_config(args, &phases)?;
    if launch.trace.is_some() && !cfg.pipelined {
        return Err(bad_input(
            "--trace records a pipelined run: give --stages, --replicas or --schedule".into(),
        ));
    }
    let processes = cfg.pipelined && cfg.placement == Placement::Processes;
    let faults = match &launch.faults {
        Some(plan) => {
            let faults = fault_schedule(plan, &cfg)?;
            if let FaultPlan::Random { seed, .. } = plan {
                outln!("fault schedule (seed {seed}): {faults}");
            }
            faults
        }
        None => FaultSchedule::default(),
    };
    if !processes {
        serve_metrics(launch.metrics_addr)?;
    }
    cfg.check_resources(None, &pipe_stages::limits::Machine::detect())?;
    let process = pipe_stages::limits::process_resident_bytes().unwrap_or(0);
    let be = open_backend(cfg.backend, cfg.threads)?;
    let view = StartView {
        phases: phases.clone(),
        header_threads: Some(be.threads()),
    };
    let PreparedRun {
        cfg,
        resolved,
        model,
        data,
        resume,
    } = prepare(cfg, &launch, process, &view)?;
    let mut fan = Fan::new(&cfg, phases.clone())?;
    let policy = CheckpointPolicy::of_launch(&launch, &cfg)?;
    if launch.seed_checkpoint {
        let policy = policy.context("--seed-checkpoint needs --checkpoint-dir")?;
        let dir = pipe_stages::pipeline::write_seed_checkpoint(&cfg, &model, &policy)?;
        outln!("seed checkpoint (update 0): {}", dir.display());
        return Ok(());
    }
    let workers = match &resolved {
        Some(r) => print_pipeline(&cfg, r),
        None => 1,
    };
    let stop = stop_on_ctrl_c(true);
    let how = Relaunch {
        restarts: RestartPolicy {
            max_restarts: launch.max_restarts,
            checkpoint_dir: launch.checkpoint_dir.clone(),
        },
        first: resume.as_ref().map(|(dir, _)| dir.clone()),
        rejoin: launch.rejoin,
        replan_on_restart: launch.replan_on_restart,
        stop: Some(stop.clone()),
    };
    let last_step = Cell::new(None);
    let started = Launch {
        how,
        watched: LastStep {
            inner: &mut fan,
            last: &last_step,
        },
        events: Printed { last: &last_step },
        policy,
        faults,
        stop,
    };
    if processes {
        phases.begin(
            pipe_stages::pipeline::StartPhase::Workers.describe(),
            &format!("{workers} worker processes"),
        );
        return on_processes(&launch, &cfg, workers, started);
    }
    let threads = Threads {
        data: &data,
        model: &model,
        opts: PipelineTrainOptions {
            timeline: launch.trace.is_some(),
            rejoin: launch.rejoin,
            ..PipelineTrainOptions::default()
        },
        first: resume.map(|(_, ckpt)| ckpt),
    };
    on_threads(&launch, &cfg, threads, started)
}

/// What either launcher takes from the run's start: how it restarts, what watches it, its
/// checkpoints, its faults and the Ctrl-C flag.
struct Launch<'a> {
    how: Relaunch,
    watched: LastStep<'a>,
    events: Printed<'a>,
    policy: Option<pipe_stages::checkpoint::CheckpointPolicy>,
    faults: FaultSchedule,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Launch<'_> {
    /// Drives `launcher` through the run's starts, with this launch's restart rules and
    /// observers; returns how it ended and the run's last layout.
    fn drive<L: Launcher>(
        &mut self,
        launcher: &mut L,
        cfg: &RunConfig,
    ) -> (pipe_stages::Result<L::End>, RunConfig) {
        drive(
            launcher,
            cfg,
            &self.how,
            &mut self.watched,
            &mut self.events,
            &startup::replan,
        )
    }
}

/// Runs `cfg` on `workers` worker processes of this host and reports how it ended.
///
/// # Errors
/// The run's failure past its restarts; a trace that cannot be merged; Ctrl-C.
fn on_processes(
    settings: &LaunchSettings,
    cfg: &RunConfig,
    workers: u32,
    mut launch: Launch<'_>,
) -> Result<()> {
    let mut options = LaunchOptions::new(workers);
    options.stop = Some(launch.stop.clone());
    // Each worker writes its part of the trace; they are merged once all have exited.
    let parts = settings
        .trace
        .as_ref()
        .map(|path| path.with_extension("parts"));
    let mut launcher = Processes {
        launch: options,
        checkpoints: launch.policy.take(),
        metrics: settings.metrics_addr,
        faults: std::mem::take(&mut launch.faults),
        trace_parts: parts.clone(),
        kept: None,
    };
    launcher.keep_drained_states()?;
    let (end, last) = launch.drive(&mut launcher, cfg);
    if let (Some(dir), Some(path)) = (&parts, &settings.trace) {
        // The last start's workers (each start sets its own count).
        merge_trace_parts(dir, launcher.launch.workers, path)?;
    }
    let end = end.context("training failed")?;
    finish_checkpoints(&end.checkpoints, end.stopped)?;
    outln!("partition: {}", last.partition);
    if let Some(epoch) = &end.last {
        print_done_line(end.steps, epoch, end.weights);
    }
    Ok(())
}

/// Runs `cfg` on threads of this process and reports how it ended, with its trace.
///
/// # Errors
/// The run's failure past its restarts; a trace that cannot be written; Ctrl-C.
fn on_threads(
    settings: &LaunchSettings,
    cfg: &RunConfig,
    mut launcher: Threads<'_>,
    mut launch: Launch<'_>,
) -> Result<()> {
    launcher.opts.checkpoints = launch.policy.take();
    launcher.opts.stop = Some(launch.stop.clone());
    launcher.opts.faults = std::mem::take(&mut launch.faults);
    let (out, cfg) = launch.drive(&mut launcher, cfg);
    let out = out.context("training failed")?;
    finish_checkpoints(&out.checkpoints, out.stopped)?;
    if cfg.pipelined {
        outln!("partition: {}", out.partition);
    }
    if let (Some(path), Some(timeline)) = (&settings.trace, &out.timeline) {
        let plan = pipe_scheduler::VersionPlan::derive(&out.schedule).ok();
        let mut tl = timeline.clone();
        tl.names = worker_names(out.schedule.layout());
        std::fs::write(path, tl.to_chrome_trace(plan.as_ref()))
            .with_context(|| format!("writing {}", path.display()))?;
        outln!("trace written to {}", path.display());
    }
    print_done(&out.report);
    Ok(())
}

/// Prints the driver's restarts and what planning again gave.
struct Printed<'a> {
    last: &'a Cell<Option<u64>>,
}

impl RelaunchEvents for Printed<'_> {
    fn on_restart(&mut self, r: &Restart<'_>, replanned: Option<&Replanned>) {
        print_restart(r);
        match replanned {
            Some(Replanned::Planned {
                cfg,
                workers,
                samples_per_s,
            }) => eprintln!(
                "planned again for {workers} workers: partition {}, replicas {:?}, {} microbatches per update, predicted {samples_per_s:.0} samples/s",
                cfg.partition, cfg.replicas, cfg.microbatches
            ),
            Some(Replanned::Kept { workers, why }) => eprintln!(
                "not planned again for {workers} workers ({why}); the run restarts on its layout as it was"
            ),
            None => {}
        }
    }

    fn reached(&self) -> Option<u64> {
        self.last.get()
    }
}

/// Says that a failed run starts again, why, from where, and what it loses.
fn print_restart(r: &Restart<'_>) {
    let from = match &r.from {
        Some((dir, updates)) => format!("from {} (update {updates})", dir.display()),
        None => "from the start (no checkpoint yet)".to_string(),
    };
    let lost = r
        .lost()
        .map_or(String::new(), |n| format!("; {n} updates lost"));
    eprintln!(
        "restart {} of {}: {}; every worker starts again {from}{lost}",
        r.number, r.of, r.cause
    );
}

/// An observer that remembers the last update reported (what a restart loses is counted
/// from it) and passes everything on.
struct LastStep<'a> {
    inner: &'a mut dyn Observer,
    last: &'a Cell<Option<u64>>,
}

impl Observer for LastStep<'_> {
    fn on_step(&mut self, s: &StepStats) -> pipe_stages::Result<()> {
        self.last.set(Some(s.step));
        self.inner.on_step(s)
    }
    fn on_epoch(&mut self, e: &EpochStats) -> pipe_stages::Result<()> {
        self.inner.on_epoch(e)
    }
    fn on_eval(&mut self, e: &EvalStats) -> pipe_stages::Result<()> {
        self.inner.on_eval(e)
    }
    fn on_stop(&mut self, report: &StopReport) -> pipe_stages::Result<()> {
        self.inner.on_stop(report)
    }
    fn on_layout_change(&mut self, change: &LayoutChange) -> pipe_stages::Result<()> {
        self.inner.on_layout_change(change)
    }
    fn on_start_phase(
        &mut self,
        phase: pipe_stages::pipeline::StartPhase,
    ) -> pipe_stages::Result<()> {
        self.inner.on_start_phase(phase)
    }
    fn on_phase(&mut self, record: &pipe_stages::pipeline::PhaseRecord) -> pipe_stages::Result<()> {
        self.inner.on_phase(record)
    }
    fn on_spans(
        &mut self,
        origin: std::time::SystemTime,
        spans: &[pipe_scheduler::Span],
    ) -> pipe_stages::Result<()> {
        self.inner.on_spans(origin, spans)
    }
}

/// Merges the trace parts the `workers` wrote into `dir` (those that exist: a worker that
/// failed early may have written none) into `out`, and removes `dir`.
///
/// # Errors
/// A part that cannot be read; `out` cannot be written.
fn merge_trace_parts(dir: &std::path::Path, workers: u32, out: &std::path::Path) -> Result<()> {
    let template = dir.join("worker-{rank}.json");
    let parts: Vec<_> = (0..workers)
        .map(|w| part_path(&template, w))
        .filter(|p| p.exists())
        .collect();
    if parts.is_empty() {
        outln!(
            "no worker wrote a trace part; {} not written",
            out.display()
        );
        return Ok(());
    }
    let events = merge_parts(&parts, out)?;
    std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    outln!(
        "trace written to {} ({} of {workers} workers, {events} events)",
        out.display(),
        parts.len()
    );
    Ok(())
}

/// Prints the pipeline line: schedule, layout, and where the workers run. Returns the number
/// of workers.
fn print_pipeline(cfg: &RunConfig, resolved: &pipe_scheduler::Resolved) -> u32 {
    outln!(
        "pipeline: schedule {}, {} stages x replicas {:?}{}, {} workers ({}), minibatch {} microbatches",
        resolved.policy,
        cfg.stages,
        resolved.layout.replica_counts(),
        if cfg.chunks > 1 {
            format!(", {} chunks per worker", cfg.chunks)
        } else {
            String::new()
        },
        resolved.layout.workers(),
        cfg.placement_description(),
        resolved.minibatch
    );
    resolved.layout.workers()
}
