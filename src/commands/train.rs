//! `pipe train`: a run of the flags' configuration ([`crate::training`]), with a progress
//! bar, per-epoch summaries, the optional JSON-lines log and Chrome trace, checkpoints,
//! resume, and a clean stop on Ctrl-C. Every run goes through the pipelined executor's
//! segment loop: its workers are threads of this process (one, running the whole model,
//! when no pipeline flag is given) or `pipe worker` processes on this host (`--placement
//! processes`, or `--transport shm|quic`; [`pipe_stages::pipeline::processes`]), whose links
//! the run's transport choice carries.

use std::cell::{Cell, RefCell};

use anyhow::{Context, Result};
use pipe_stages::config::{Placement, RunConfig};
use pipe_stages::model::Model;
use pipe_stages::pipeline::doctor::StopReport;
use pipe_stages::pipeline::restart::fault_schedule;
use pipe_stages::pipeline::restart::{Restart, RestartPolicy, with_restarts};
use pipe_stages::pipeline::survive::LayoutChange;
use pipe_stages::pipeline::{PipelineTrainOptions, train_pipelined};
use pipe_stages::train::{self, EpochStats, Observer, StepStats};
use pipe_transport::fault::{FaultPlan, FaultSchedule};

use crate::args::open_backend;
use crate::output::bad_input;
use crate::trace::{merge_parts, part_path, worker_names};
pub use crate::training::TrainArgs;
use crate::training::{
    Fan, checkpoint_args, checkpoint_policy, finish_checkpoints, print_done, print_done_line,
    print_header, print_resuming, resume_from, run_config, serve_metrics, settle_partition,
    stop_on_ctrl_c,
};
use pipe_stages::pipeline::processes::{LaunchOptions, run_processes};

/// Runs `pipe train`.
///
/// # Errors
/// Bad input for flags, config, plan or data files that describe no run; run-time failures of
/// training or of writing its outputs.
pub fn run(args: &TrainArgs) -> Result<()> {
    let mut cfg = run_config(args)?;
    if args.trace.is_some() && !cfg.pipelined {
        return Err(bad_input(
            "--trace records a pipelined run: give --stages, --replicas or --schedule".into(),
        ));
    }
    let processes = cfg.pipelined && cfg.placement == Placement::Processes;
    if args.rejoin {
        check_rejoin(args, &cfg, processes)?;
    }
    let faults = match &args.fault_schedule {
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
        serve_metrics(args.metrics_addr)?;
    }
    cfg.check_resources(None, &pipe_stages::limits::Machine::detect())?;
    let be = open_backend(cfg.backend, cfg.threads)?;
    let model = Model::new(&cfg.model)?;
    let data = train::load_data(&cfg, &model)?;
    print_header(&cfg, &model, &data, be.threads());
    let mut fan = Fan::new(&cfg)?;
    let policy = checkpoint_policy(args, &cfg)?;
    let resume = resume_from(args, &model)?;
    if let Some((dir, ckpt)) = &resume {
        print_resuming(dir, ckpt);
    }
    settle_partition(&mut cfg, &model)?;
    // A run with no pipeline flag is one worker over the whole model: no pipeline to describe.
    let workers = if cfg.pipelined {
        print_pipeline(&cfg)?
    } else {
        1
    };
    let restarts = RestartPolicy {
        max_restarts: args.max_restarts,
        checkpoint_dir: args.checkpoint_dir.clone(),
    };
    let first = resume.as_ref().map(|(dir, _)| dir.clone());
    let last_step = Cell::new(None);
    let mut watched = LastStep {
        inner: &mut fan,
        last: &last_step,
    };
    let stop = stop_on_ctrl_c(true);
    if processes {
        let launch = ProcessLaunch {
            args,
            cfg: &cfg,
            workers,
            faults,
            stop,
        };
        return launch.run(&restarts, first.as_deref(), &mut watched, &last_step);
    }
    let mut opts = PipelineTrainOptions {
        timeline: args.trace.is_some(),
        checkpoints: policy,
        stop: Some(stop),
        faults,
        rejoin: args.rejoin,
        ..PipelineTrainOptions::default()
    };
    let mut resume = resume.map(|(_, ckpt)| ckpt);
    let current = RefCell::new(cfg.clone());
    let out = with_restarts(
        &restarts,
        first.as_deref(),
        |attempt, from| {
            opts.resume = match (attempt, from) {
                (0, _) => resume.take(),
                (_, Some(dir)) => Some(pipe_stages::checkpoint::read(dir, &model)?.1),
                (_, None) => None,
            };
            train_pipelined(&current.borrow(), &data, &mut watched, &opts)
        },
        || last_step.get(),
        |r| {
            print_restart(r);
            if args.replan_on_restart {
                replan_after(&current, r.cause);
            }
        },
        // A lost replica in process is survived inside the run (pipeline::survive).
        |_, _| false,
    )
    .context("training failed")?;
    let cfg = current.into_inner();
    finish_checkpoints(&out.checkpoints, out.stopped)?;
    if cfg.pipelined {
        outln!("partition: {}", out.partition);
    }
    if let (Some(path), Some(timeline)) = (&args.trace, &out.timeline) {
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

/// A run of worker processes (`--placement processes`), restarted under `--max-restarts`.
struct ProcessLaunch<'a> {
    args: &'a TrainArgs,
    cfg: &'a RunConfig,
    workers: u32,
    faults: FaultSchedule,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl ProcessLaunch<'_> {
    /// Launches the workers until the run ends: after a lost replica of a replicated stage
    /// (with checkpoints to go on from), again with one replica fewer from the newest
    /// checkpoint, counting no restart, and with `--rejoin`, once more at the next drain point
    /// on the run's own layout; after another failure, restarting them from the newest
    /// checkpoint as `restarts` allows. Merges their trace parts and prints the end.
    fn run(
        &self,
        restarts: &RestartPolicy,
        first: Option<&std::path::Path>,
        obs: &mut dyn Observer,
        last_step: &Cell<Option<u64>>,
    ) -> Result<()> {
        let args = self.args;
        // The launcher logs what the chief reports; the workers write no log of their own.
        // The run's own layout (planned again after a lost worker, with --replan-on-restart),
        // and the one it is on (short of lost replicas until they rejoin).
        let own = RefCell::new(RunConfig {
            log_jsonl: None,
            ..self.cfg.clone()
        });
        let current = RefCell::new(own.borrow().clone());
        let pending: RefCell<Option<LayoutChange>> = RefCell::new(None);
        let mut opts = LaunchOptions::new(self.workers);
        opts.stop = Some(self.stop.clone());
        opts.metrics = args.metrics_addr;
        opts.faults = self.faults.clone();
        // Each worker writes its part of the trace; they are merged once all have exited.
        let parts = args.trace.as_ref().map(|path| path.with_extension("parts"));
        let mut starts = 0;
        let end = with_restarts(
            restarts,
            first,
            |_, from| {
                let mut from = from.map(std::path::Path::to_path_buf);
                loop {
                    if let Some(change) = pending.borrow_mut().take() {
                        obs.on_layout_change(&change)?;
                    }
                    let run = current.borrow().clone();
                    let layout = run.resolved()?.layout;
                    opts.workers = layout.workers();
                    opts.attempt = starts;
                    starts += 1;
                    // A run short of a lost replica stops at its next drain point to take
                    // it back.
                    let own_layout = own.borrow().resolved()?.layout;
                    opts.stop_at_first_drain =
                        args.rejoin && layout.replica_counts() != own_layout.replica_counts();
                    opts.extra = checkpoint_args(args, from.as_deref());
                    if let Some(dir) = &parts {
                        opts.extra.push("--trace".into());
                        opts.extra
                            .push(dir.join("worker-{rank}.json").into_os_string());
                    }
                    let end = run_processes(&run, &opts, obs)?;
                    let asked = self.stop.load(std::sync::atomic::Ordering::SeqCst);
                    match end.stopped {
                        Some(at) if opts.stop_at_first_drain && !asked => {
                            *current.borrow_mut() = own.borrow().clone();
                            *pending.borrow_mut() =
                                Some(LayoutChange::restored(&own.borrow(), at)?);
                            from = args
                                .checkpoint_dir
                                .as_deref()
                                .and_then(|d| pipe_stages::checkpoint::list(d).pop())
                                .map(|(_, dir)| dir);
                        }
                        _ => return Ok(end),
                    }
                }
            },
            || last_step.get(),
            |r| {
                print_restart(r);
                if args.replan_on_restart && replan_after(&current, r.cause) {
                    *own.borrow_mut() = current.borrow().clone();
                }
            },
            |err, from| {
                if args.checkpoint_dir.is_none() {
                    return false;
                }
                let change = LayoutChange::after_exit(&current.borrow(), err, from);
                let Some(change) = change else {
                    return false;
                };
                let next = change.apply(&current.borrow());
                *current.borrow_mut() = next;
                *pending.borrow_mut() = Some(change);
                true
            },
        );
        let workers = current
            .borrow()
            .resolved()
            .map_or(self.workers, |r| r.layout.workers());
        if let (Some(dir), Some(path)) = (&parts, &args.trace) {
            merge_trace_parts(dir, workers, path)?;
        }
        let end = end.context("training failed")?;
        finish_checkpoints(&end.checkpoints, end.stopped)?;
        outln!("partition: {}", current.borrow().partition);
        if let Some(last) = &end.last {
            print_done_line(end.steps, last, end.weights);
        }
        Ok(())
    }
}

/// Refuses `--rejoin` where there is nothing it could do: no stage with two or more replicas
/// (a stage's last replica is never survived, so never taken back), or worker processes
/// without a checkpoint directory to go on from.
fn check_rejoin(args: &TrainArgs, cfg: &RunConfig, processes: bool) -> Result<()> {
    let replicated = cfg.pipelined
        && cfg
            .resolved()
            .is_ok_and(|r| r.layout.replica_counts().iter().any(|&n| n >= 2));
    if !replicated {
        return Err(bad_input(
            "--rejoin takes back a lost replica, but no stage of this run has two or more replicas: give --replicas".into(),
        ));
    }
    if processes && args.checkpoint_dir.is_none() {
        return Err(bad_input(
            "--rejoin with worker processes needs --checkpoint-dir: the workers go on from the checkpoint of the drain point where the replica rejoins".into(),
        ));
    }
    Ok(())
}

/// `--replan-on-restart`: after a start that lost a worker (`cause` names it), plans the run
/// in `current` again for the workers that remain ([`pipe_stages::planning::replan`]) and
/// says what it chose. A run that cannot be planned for fewer workers (one worker left, no
/// layout that keeps the minibatch) restarts on its layout as it was, saying why. Returns
/// whether the layout changed.
fn replan_after(current: &RefCell<RunConfig>, cause: &pipe_stages::StageError) -> bool {
    use pipe_stages::StageError;
    if !matches!(cause, StageError::Exited { .. } | StageError::Worker { .. }) {
        return false;
    }
    let workers = match current.borrow().resolved() {
        Ok(r) => r.layout.workers(),
        Err(_) => return false,
    };
    if workers < 2 {
        return false;
    }
    let planned = pipe_stages::planning::replan(&current.borrow(), workers - 1);
    match planned {
        Ok((next, plan)) => {
            eprintln!(
                "planned again for {} workers: partition {}, replicas {:?}, {} microbatches per update, predicted {:.0} samples/s",
                workers - 1,
                next.partition,
                next.replicas,
                next.microbatches,
                next.microbatch_size as f64 / plan.time_per_microbatch
            );
            *current.borrow_mut() = next;
            true
        }
        Err(e) => {
            eprintln!(
                "not planned again for {} workers ({e}); the run restarts on its layout as it was",
                workers - 1
            );
            false
        }
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
    fn on_stop(&mut self, report: &StopReport) -> pipe_stages::Result<()> {
        self.inner.on_stop(report)
    }
    fn on_layout_change(&mut self, change: &LayoutChange) -> pipe_stages::Result<()> {
        self.inner.on_layout_change(change)
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
fn print_pipeline(cfg: &RunConfig) -> Result<u32> {
    let resolved = cfg.resolved().map_err(|e| bad_input(e.to_string()))?;
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
    Ok(resolved.layout.workers())
}
