//! Launching a [`PreparedRun`]: one function, [`launch`], whatever the placement. It builds
//! the run's launcher (every worker a thread of this process, or one worker process each),
//! drives it through its starts and restarts ([`relaunch::drive`]), writes the run's trace
//! (in one piece from threads, merged from the workers' parts from processes) and returns one
//! [`RunEnd`] for both. The caller prints what the driver and the end report; nothing here
//! prints.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use pipe_transport::fault::FaultSchedule;

use super::PreparedRun;
use crate::checkpoint::CheckpointPolicy;
use crate::config::{LaunchSettings, PartitionChoice, Placement, RunConfig};
use crate::error::Result;
use crate::model::params_digest;
use crate::pipeline::processes::{LaunchDir, LaunchOptions};
use crate::pipeline::relaunch::{self, Launcher, Processes, Relaunch, RelaunchEvents, Threads};
use crate::pipeline::restart::RestartPolicy;
use crate::pipeline::trace_parts::{TraceWritten, merge_parts, part_path, worker_names};
use crate::pipeline::{Observer, PipelineTrainOptions};

/// What a run is launched with beside its settings: the faults to inject (drills and tests)
/// and the flag that stops it at its next drain point (Ctrl-C).
pub struct LaunchControls {
    /// Faults, by worker and start ([`crate::pipeline::restart::fault_schedule`]).
    pub faults: FaultSchedule,
    /// Set to stop at the next drain point, after a checkpoint.
    pub stop: Arc<AtomicBool>,
}

/// How a launched run ended, on threads and on worker processes alike.
pub use crate::pipeline::processes::RunEnd;

/// Launches `run` on the placement its settings name and drives it to its end under
/// `settings`' restart, rejoin and replan rules, reporting steps and epochs to `obs` and the
/// driver's restarts and the written trace to `events`.
///
/// # Errors
/// The run's failure past its restarts; a trace that cannot be written or merged.
pub fn launch(
    run: PreparedRun,
    settings: &LaunchSettings,
    controls: LaunchControls,
    obs: &mut dyn Observer,
    events: &mut dyn RelaunchEvents,
) -> Result<RunEnd> {
    let PreparedRun {
        cfg,
        resolved,
        model,
        data,
        resume,
        // Dropped when the run returns: the directory is released then.
        held: _held,
    } = run;
    let checkpoints = CheckpointPolicy::of_launch(settings, &cfg)?;
    let how = Relaunch {
        restarts: RestartPolicy::new(settings.max_restarts, settings.checkpoint_dir.clone()),
        first: resume.as_ref().map(|(dir, _)| dir.clone()),
        rejoin: settings.rejoin,
        replan_on_restart: settings.replan_on_restart,
        stop: Some(controls.stop.clone()),
    };
    if cfg.pipelined && cfg.placement == Placement::Processes {
        let workers = resolved.as_ref().map_or(1, |r| r.layout.workers());
        let mut options = LaunchOptions::new(workers);
        options.stop = Some(controls.stop);
        // A lost replica is replaced live: every time under --rejoin, and under
        // --max-restarts N as one of the run's N restarts (of that worker alone, its state
        // from a surviving replica of its stage).
        options.rejoin = settings.rejoin || settings.max_restarts > 0;
        options.replacements = (!settings.rejoin).then(|| how.restarts.clone());
        // Each worker writes its part of the trace into a fresh private directory of this
        // run (never a directory of the user's beside the trace, which the merge would read
        // stale parts from and remove); the parts are merged once all workers have exited,
        // and the directory goes with `parts_dir`.
        let parts_dir = settings
            .trace
            .as_ref()
            .map(|_| LaunchDir::create("trace-parts"))
            .transpose()?;
        let parts = parts_dir.as_ref().map(|d| d.0.clone());
        let mut launcher = Processes {
            launch: options,
            checkpoints,
            metrics: settings.metrics_addr,
            faults: controls.faults,
            trace_parts: parts.clone(),
            kept: None,
            in_place: true,
        };
        launcher.keep_drained_states()?;
        let (end, last) = drive(&mut launcher, &cfg, &how, obs, events);
        if let (Some(dir), Some(path)) = (&parts, &settings.trace) {
            // The last start's workers (each start sets its own count).
            events.on_trace(&merge_trace_parts(dir, launcher.launch.workers, path)?);
        }
        return Ok(RunEnd {
            partition: Some(last.partition),
            ..end?
        });
    }
    let mut launcher = Threads {
        data: &data,
        model: &model,
        opts: PipelineTrainOptions {
            timeline: settings.trace.is_some(),
            rejoin: settings.rejoin,
            checkpoints,
            stop: Some(controls.stop),
            faults: controls.faults,
            ..PipelineTrainOptions::default()
        },
        first: resume.map(|(_, ckpt)| ckpt),
    };
    let (out, cfg) = drive(&mut launcher, &cfg, &how, obs, events);
    let out = out?;
    if let (Some(path), Some(timeline)) = (&settings.trace, &out.timeline) {
        let plan = pipe_scheduler::VersionPlan::derive(&out.schedule).ok();
        let mut timeline = timeline.clone();
        timeline.names = worker_names(out.schedule.layout());
        crate::outputs::write_file(path, timeline.to_chrome_trace(plan.as_ref()).as_bytes())?;
        events.on_trace(&TraceWritten::Whole {
            path: path.clone(),
            kept: timeline.spans.len(),
            dropped: out.trace_dropped,
        });
    }
    Ok(RunEnd {
        steps: out.report.steps,
        last: out.report.epochs.last().cloned(),
        weights: params_digest(&out.report.params),
        checkpoints: out.checkpoints,
        stopped: out.stopped,
        partition: cfg
            .pipelined
            .then_some(PartitionChoice::Given(out.partition)),
    })
}

/// [`relaunch::drive`] with the planner a restart on fewer workers asks
/// ([`super::replan`]).
fn drive<L: Launcher>(
    launcher: &mut L,
    cfg: &RunConfig,
    how: &Relaunch,
    obs: &mut dyn Observer,
    events: &mut dyn RelaunchEvents,
) -> (Result<L::End>, RunConfig) {
    relaunch::drive(launcher, cfg, how, obs, events, &super::replan)
}

/// Merges the trace parts the `workers` wrote into `dir` (those that exist: a worker that
/// failed early may have written none) into `out`. `dir` is the run's own
/// ([`LaunchDir`]), removed with it.
///
/// # Errors
/// A part that cannot be read; `out` cannot be written.
fn merge_trace_parts(dir: &Path, workers: u32, out: &Path) -> Result<TraceWritten> {
    let template = dir.join("worker-{rank}.json");
    let parts: Vec<_> = (0..workers)
        .map(|w| part_path(&template, w))
        .filter(|p| p.exists())
        .collect();
    if parts.is_empty() {
        return Ok(TraceWritten::NoParts {
            path: out.to_path_buf(),
        });
    }
    let merged = merge_parts(&parts, out)?;
    Ok(TraceWritten::Merged {
        path: out.to_path_buf(),
        parts: parts.len(),
        workers,
        events: merged.events,
        kept: merged.kept,
        dropped: merged.dropped,
    })
}
