//! `pipe train`: a run of the flags' configuration ([`crate::training`]), with a progress
//! bar, per-epoch summaries, the optional JSON-lines log and Chrome trace, checkpoints,
//! resume, and a clean stop on Ctrl-C. Every run goes through the pipelined executor's
//! segment loop: its workers are threads of this process (one, running the whole model,
//! when no pipeline flag is given) or `pipe worker` processes on this host (`--placement
//! processes`, or `--transport shm|quic`; [`pipe_stages::pipeline::processes`]), whose links
//! the run's transport choice carries.

use anyhow::{Context, Result};
use pipe_stages::checkpoint::CheckpointPolicy;
use pipe_stages::config::{Placement, RunConfig};
use pipe_stages::pipeline::StartPhase;
use pipe_stages::pipeline::relaunch::{RelaunchEvents, Replanned};
use pipe_stages::pipeline::restart::{Restart, fault_schedule};
use pipe_stages::pipeline::trace_parts::TraceWritten;
use pipe_stages::startup::{self, LaunchControls, prepare};
use pipe_transport::fault::{FaultPlan, FaultSchedule, ScheduledFault};

use crate::args::open_backend;
use crate::phases::Phases;
use crate::startup_view::StartView;
pub use crate::training::TrainArgs;
use crate::training::{
    Fan, check_worker_metrics_ports, finish_checkpoints, print_done_line, run_config,
    serve_metrics, stop_on_signal,
};

/// Runs `pipe train`.
///
/// # Errors
/// Bad input for flags, config, plan or data files that describe no run; run-time failures of
/// training or of writing its outputs.
pub fn run(args: &TrainArgs) -> Result<()> {
    let phases = Phases::new();
    let (cfg, launch) = run_config(args, &phases)?;
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
    if processes {
        let workers = cfg.resolved()?.layout.workers();
        check_worker_metrics_ports(launch.metrics_addr, workers)?;
    } else {
        serve_metrics(launch.metrics_addr)?;
    }
    cfg.check_resources(None, &pipe_stages::limits::Machine::detect())?;
    let process = pipe_stages::limits::process_resident_bytes().unwrap_or(0);
    let be = open_backend(cfg.backend, cfg.threads)?;
    let view = StartView {
        phases: phases.clone(),
        header_threads: Some(be.threads()),
    };
    let prepared = prepare(cfg, &launch, process, &view)?;
    let mut fan = Fan::new(&prepared.cfg, phases.clone())?;
    if launch.seed_checkpoint {
        let policy = CheckpointPolicy::of_launch(&launch, &prepared.cfg)?
            .context("--seed-checkpoint needs --checkpoint-dir")?;
        let dir =
            pipe_stages::pipeline::write_seed_checkpoint(&prepared.cfg, &prepared.model, &policy)?;
        outln!("seed checkpoint (update 0): {}", dir.display());
        return Ok(());
    }
    if let Some(resolved) = &prepared.resolved {
        print_pipeline(&prepared.cfg, resolved);
        if processes {
            phases.begin(
                StartPhase::Workers.describe(),
                &format!("{} worker processes", resolved.layout.workers()),
            );
        }
    }
    let controls = LaunchControls {
        faults,
        stop: stop_on_signal(true, launch.checkpoint_dir.is_some()),
    };
    let end = startup::launch(prepared, &launch, controls, &mut fan, &mut Printed)
        .context("training failed")?;
    finish_checkpoints(&end.checkpoints, end.stopped)?;
    if let Some(partition) = &end.partition {
        outln!("partition: {partition}");
    }
    if let Some(epoch) = &end.last {
        print_done_line(end.steps, epoch, end.weights);
    }
    Ok(())
}

/// Prints the driver's restarts, what planning again gave, and the trace the run wrote.
struct Printed;

impl RelaunchEvents for Printed {
    fn on_restart(&mut self, r: &Restart<'_>, replanned: Option<&Replanned>) {
        print_restart(r);
        match replanned {
            Some(Replanned::Planned {
                cfg,
                workers,
                samples_per_s,
            }) => eprintln!(
                "planned again for {workers} workers: partition {}, replicas {:?}, {} per update, predicted {samples_per_s:.0} samples/s",
                cfg.partition,
                cfg.replicas,
                pipe_stages::pipeline::survive::microbatches(cfg.microbatches as u64)
            ),
            Some(Replanned::Kept { workers, why }) => eprintln!(
                "not planned again for {workers} workers ({why}); the run restarts on its layout as it was"
            ),
            None => {}
        }
    }

    fn on_trace(&mut self, written: &TraceWritten) {
        outln!("{written}");
    }

    fn on_faults_never_applied(&mut self, entries: &[ScheduledFault], attempts: u32) {
        let made = match attempts {
            0 => "none".to_string(),
            1 => "only attempt 0".to_string(),
            n => format!("attempts 0 to {}", n - 1),
        };
        for e in entries {
            eprintln!(
                "fault schedule: worker {}'s {}/{} never applied: the run made {made}",
                e.rank, e.fault, e.attempt
            );
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

/// Prints the pipeline line: schedule, layout, and where the workers run.
fn print_pipeline(cfg: &RunConfig, resolved: &pipe_scheduler::Resolved) {
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
}
