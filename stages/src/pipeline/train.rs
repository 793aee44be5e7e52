//! Pipelined training: one schedule per epoch (the pipeline drains at every epoch's end, where
//! the model is evaluated), workers as threads on the in-process transport, worker state
//! (weights, optimizer) carried from epoch to epoch.

use std::time::Instant;

use pipe_kernels::{Backend, CpuBackend};
use pipe_scheduler::{
    Length, LowerOptions, Policy, Schedule, ScheduleSpec, Span, Timeline, VersionPlan, generate,
    lower, validate,
};
use pipe_transport::Abort;
use pipe_transport::inproc::{InProcOptions, mesh};

use super::{OrderedSource, Partition, RunOptions, Setup, WorkerState, run_threads};
use crate::config::RunConfig;
use crate::data::Splits;
use crate::error::{Result, StageError};
use crate::model::{Model, Params};
use crate::optim::LrSchedule;
use crate::train::{EpochStats, Observer, StageEpochStats, StepStats, TrainReport, evaluate};

/// Extra outputs of a pipelined run.
#[derive(Debug)]
pub struct PipelineReport {
    /// The usual training report (final weights assembled from replica 0 of each stage).
    pub report: TrainReport,
    /// The partition used.
    pub partition: Partition,
    /// The schedule of one epoch (lowered).
    pub schedule: Schedule,
    /// Every action's measured interval over the whole run, when asked for.
    pub timeline: Option<Timeline>,
}

/// Options of [`train_pipelined`].
#[derive(Clone, Debug, Default)]
pub struct PipelineTrainOptions {
    /// Record the measured timeline (for `--trace`).
    pub timeline: bool,
}

/// The schedule request a run configuration implies for `microbatches` microbatches.
pub fn schedule_spec(cfg: &RunConfig, length: Length) -> Result<ScheduleSpec> {
    let policy: Policy = cfg.schedule.parse()?;
    Ok(
        ScheduleSpec::new(policy, cfg.stages as u32, cfg.microbatches as u32)
            .with_replicas(cfg.replicas.clone())
            .with_chunks(cfg.chunks)
            .with_length(length),
    )
}

/// Trains `cfg`'s model with the pipelined executor.
///
/// # Errors
/// Configuration errors (impossible schedules, partitions), worker failures naming the worker
/// and action, a diverged loss, or an observer's error.
pub fn train_pipelined(
    cfg: &RunConfig,
    data: &Splits,
    obs: &mut dyn Observer,
    opts: &PipelineTrainOptions,
) -> Result<PipelineReport> {
    let model = Model::new(&cfg.model)?;
    let b = cfg.microbatch_size;
    // One minibatch: M per replica times the lcm of the replica counts.
    let probe = schedule_spec(cfg, Length::Updates(1))?.resolve()?;
    let minibatch = probe.minibatch as usize;
    let per_epoch = data.train.len() / b / minibatch;
    if per_epoch == 0 {
        return Err(StageError::Config(format!(
            "one minibatch needs {} samples ({minibatch} microbatches of {b}) but {} has {}",
            minibatch * b,
            data.train.name,
            data.train.len()
        )));
    }
    let total_minibatches = cfg.steps.map_or(per_epoch as u64 * cfg.epochs, |s| {
        s.min(per_epoch as u64 * cfg.epochs)
    });
    let sched = LrSchedule {
        kind: cfg.lr_schedule,
        base: cfg.lr,
        warmup: cfg.warmup_steps,
        total: total_minibatches,
        min_ratio: 0.0,
    };
    let layout_stages = probe.layout.stages() as usize;
    let partition = match &cfg.partition {
        Some(text) => Partition::parse(text, model.len())?,
        None => Partition::balanced(&model, layout_stages)?,
    };
    if partition.stages() != layout_stages {
        return Err(StageError::Config(format!(
            "--partition has {} stages but the schedule needs {layout_stages}",
            partition.stages()
        )));
    }
    let init = model.init_params(cfg.seed);
    let threads = if cfg.threads == 0 { 1 } else { cfg.threads };
    let eval_be = CpuBackend::new(0)?;
    let start = Instant::now();
    let mut states: Vec<WorkerState> = Vec::new();
    let mut epochs = Vec::new();
    let mut done_minibatches = 0u64;
    let mut spans: Vec<Span> = Vec::new();
    let mut last_schedule = None;
    let mut params: Params = init.clone();
    for epoch in 1..=cfg.epochs {
        let remaining = total_minibatches - done_minibatches;
        if remaining == 0 {
            break;
        }
        let this = remaining.min(per_epoch as u64) as u32;
        let spec = schedule_spec(cfg, Length::Updates(this))?;
        let schedule = lower(&generate(&spec)?, LowerOptions::default());
        validate::check(&schedule)?;
        let plan = VersionPlan::derive(&schedule)?;
        let source = OrderedSource {
            data: &data.train,
            order: data.train.epoch_order(cfg.seed, epoch),
            size: b,
        };
        let offset = done_minibatches;
        let res = &schedule.resolved;
        let lr = |stage: u32, k: u32| -> f32 {
            let mb = u64::from(k) * u64::from(res.update_size(stage));
            sched.at(offset + mb / u64::from(res.minibatch))
        };
        let setup = Setup {
            model: &model,
            partition: &partition,
            schedule: &schedule,
            plan: &plan,
            data: &source,
            seed: cfg.seed,
            microbatch_offset: done_minibatches * minibatch as u64,
            lr: &lr,
        };
        if states.is_empty() {
            states = (0..schedule.workers())
                .map(|w| WorkerState::new(&setup, w, &init, cfg.optimizer))
                .collect();
        }
        let abort = Abort::new();
        let endpoints = mesh(schedule.workers(), &InProcOptions::default(), &abort);
        let epoch_start = Instant::now();
        let outcomes = run_threads(
            &setup,
            &mut states,
            endpoints,
            &abort,
            || CpuBackend::new(threads),
            &RunOptions::default(),
        )?;
        let secs = epoch_start.elapsed().as_secs_f64();
        done_minibatches += u64::from(this);
        let (mut loss, mut samples) = (0.0f64, 0usize);
        for o in &outcomes {
            loss += o.loss_sum;
            samples += o.samples;
        }
        let train_loss = loss / samples.max(1) as f64;
        if !train_loss.is_finite() {
            return Err(StageError::Diverged {
                step: done_minibatches,
                loss: train_loss,
            });
        }
        // One step record per minibatch (its microbatches' losses), reported after the epoch:
        // the pipeline has no global step boundary while it runs.
        let mut per_step = vec![(0.0f64, 0usize); this as usize];
        for o in &outcomes {
            for &(mb, l, n) in &o.losses {
                if let Some(slot) = per_step.get_mut(mb as usize / minibatch) {
                    slot.0 += l;
                    slot.1 += n;
                }
            }
        }
        let epoch_rate = samples as f64 / secs.max(1e-9);
        for (t, &(l, n)) in per_step.iter().enumerate() {
            let step = done_minibatches - u64::from(this) + t as u64;
            obs.on_step(&StepStats {
                step: step + 1,
                epoch,
                loss: l / n.max(1) as f64,
                lr: sched.at(step),
                samples: n,
                samples_per_sec: epoch_rate,
                elapsed_s: start.elapsed().as_secs_f64(),
                steps_in_epoch: u64::from(this),
                step_in_epoch: t as u64 + 1,
            })?;
        }
        let layout = schedule.layout();
        let stage_stats: Vec<StageEpochStats> = (0..schedule.stages())
            .map(|s| {
                let group: Vec<u32> = layout.group(s).collect();
                let busy: f64 = group.iter().map(|&w| outcomes[w as usize].compute_s).sum();
                let (st_sum, st_n) = group.iter().fold((0.0, 0u64), |(a, n), &w| {
                    (
                        a + outcomes[w as usize].staleness_sum,
                        n + outcomes[w as usize].staleness_count,
                    )
                });
                StageEpochStats {
                    stage: s,
                    // A worker holding several chunks counts its time once per chunk; divide
                    // by chunks so the figure stays a share of the worker's time.
                    utilisation: busy
                        / (group.len() as f64 * secs.max(1e-9))
                        / f64::from(layout.chunks()),
                    staleness: st_sum / st_n.max(1) as f64,
                }
            })
            .collect();
        if opts.timeline {
            let base = start.elapsed().as_secs_f64() - secs;
            for o in &outcomes {
                spans.extend(o.spans.iter().map(|sp| Span {
                    start: sp.start + base,
                    end: sp.end + base,
                    ..*sp
                }));
            }
        }
        params = assemble(&schedule, &partition, &states)?;
        let (test_loss, test_accuracy) =
            evaluate(&eval_be as &dyn Backend, &model, &params, &data.test, 1000)?;
        let e = EpochStats {
            epoch,
            train_loss,
            test_loss,
            test_accuracy,
            samples_per_sec: samples as f64 / secs.max(1e-9),
            elapsed_s: start.elapsed().as_secs_f64(),
            steps: done_minibatches,
            stages: stage_stats,
        };
        obs.on_epoch(&e)?;
        epochs.push(e);
        last_schedule = Some(schedule);
    }
    let schedule = last_schedule.ok_or_else(|| StageError::Config("nothing to train".into()))?;
    let workers = schedule.workers();
    Ok(PipelineReport {
        report: TrainReport {
            epochs,
            params,
            steps: done_minibatches,
        },
        partition,
        schedule,
        timeline: opts.timeline.then(|| Timeline::new(workers, spans)),
    })
}

/// The whole model's weights, from replica 0 of each stage.
fn assemble(schedule: &Schedule, partition: &Partition, states: &[WorkerState]) -> Result<Params> {
    let layout = schedule.layout();
    let mut out: Params = Vec::new();
    for s in 0..schedule.stages() {
        let w = layout.worker_for(s, 0);
        let st = states[w as usize]
            .stages
            .iter()
            .find(|x| x.stage == s)
            .ok_or_else(|| StageError::Executor(format!("stage {s} missing on worker {w}")))?;
        debug_assert_eq!(st.params.len(), partition.range(s as usize).len());
        out.extend(st.params.iter().cloned());
    }
    Ok(out)
}
