//! `pipe train`: a run of the flags' configuration ([`crate::training`]), with a progress
//! bar, per-epoch summaries, the optional JSON-lines log and Chrome trace, checkpoints,
//! resume, and a clean stop on Ctrl-C. Every run goes through the pipelined executor's
//! segment loop: its workers are threads of this process (one, running the whole model,
//! when no pipeline flag is given; `--transport inproc`) or `pipe worker` processes talking
//! QUIC on loopback (`--transport quic`, [`pipe_stages::pipeline::processes`]).

use anyhow::{Context, Result};
use pipe_stages::config::RunConfig;
use pipe_stages::model::Model;
use pipe_stages::pipeline::{PipelineTrainOptions, train_pipelined};
use pipe_stages::train;
use pipe_transport::TransportKind;

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
    let processes = cfg.pipelined && cfg.transport == TransportKind::Quic;
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
    let resume = resume_from(args, &model)?.map(|(dir, ckpt)| {
        print_resuming(&dir, &ckpt);
        ckpt
    });
    settle_partition(&mut cfg, &model)?;
    // A run with no pipeline flag is one worker over the whole model: no pipeline to describe.
    let workers = if cfg.pipelined {
        print_pipeline(&cfg, processes)?
    } else {
        1
    };
    if processes {
        // The launcher logs what the chief reports; the workers write no log of their own.
        let worker_run = RunConfig {
            log_jsonl: None,
            ..cfg.clone()
        };
        let mut opts = LaunchOptions::new(workers);
        opts.extra = checkpoint_args(args);
        opts.stop = Some(stop_on_ctrl_c(true));
        opts.metrics = args.metrics_addr;
        // Each worker writes its part of the trace; they are merged once all have exited.
        let parts = args.trace.as_ref().map(|path| path.with_extension("parts"));
        if let Some(dir) = &parts {
            opts.extra.push("--trace".into());
            opts.extra
                .push(dir.join("worker-{rank}.json").into_os_string());
        }
        let end = run_processes(&worker_run, &opts, &mut fan);
        if let (Some(dir), Some(path)) = (&parts, &args.trace) {
            merge_trace_parts(dir, workers, path)?;
        }
        let end = end.context("training failed")?;
        finish_checkpoints(&end.checkpoints, end.stopped)?;
        outln!("partition: {}", cfg.partition);
        if let Some(last) = &end.last {
            print_done_line(end.steps, last, end.weights);
        }
        return Ok(());
    }
    let opts = PipelineTrainOptions {
        timeline: args.trace.is_some(),
        checkpoints: policy,
        resume,
        stop: Some(stop_on_ctrl_c(true)),
        ..PipelineTrainOptions::default()
    };
    let out = train_pipelined(&cfg, &data, &mut fan, &opts).context("training failed")?;
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
fn print_pipeline(cfg: &RunConfig, processes: bool) -> Result<u32> {
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
        if processes {
            "one process each, QUIC on loopback"
        } else {
            "one thread each"
        },
        resolved.minibatch
    );
    Ok(resolved.layout.workers())
}
