//! Pipelined training: one schedule per epoch (the pipeline drains at every epoch's end, where
//! the model is evaluated), workers launched as threads of this process that exchange tensors
//! in process or over QUIC on loopback, worker state (weights, optimizer) carried from epoch
//! to epoch.

use std::time::Instant;

use pipe_kernels::{Backend, BackendKind, CpuBackend};
use pipe_scheduler::{Length, Schedule, Span, Timeline};
use pipe_transport::TransportKind;
use pipe_transport::inproc::{InProcOptions, mesh};
use pipe_transport::quic::{QuicOptions, local_mesh};

use super::{OrderedSource, Partition, RunPlan, Setup, WorkerOutcome, WorkerState, run_threads};
use crate::config::{PartitionChoice, RunConfig};
use crate::data::Splits;
use crate::error::{Result, StageError};
use crate::loss::SoftmaxCrossEntropy;
use crate::model::{Model, Params};
use crate::optim::LrSchedule;
use crate::planning::{MeasuredPartition, measured_partition};
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

/// An epoch that has ended, as the chief sees it.
pub(super) struct EpochEnd<'p> {
    /// Its schedule.
    pub plan: &'p RunPlan,
    /// Every worker's outcome, in worker order.
    pub outcomes: &'p [WorkerOutcome],
    /// The epoch, from 1.
    pub epoch: u64,
    /// Minibatches done by its end.
    pub done: u64,
    /// Minibatches in it.
    pub this: u64,
    /// Its wall time.
    pub secs: f64,
}

/// What every epoch of a run shares.
pub(super) struct Run<'c> {
    pub(super) cfg: &'c RunConfig,
    pub(super) model: Model,
    /// Microbatches per minibatch.
    minibatch: u64,
    /// Minibatches per epoch.
    pub(super) per_epoch: u64,
    /// Minibatches over the whole run.
    pub(super) total: u64,
    lr: LrSchedule,
    start: Instant,
}

/// Trains `cfg`'s model with the pipelined executor.
///
/// # Errors
/// Configuration errors (impossible schedules, partitions, a backend or transport this build
/// cannot run), worker failures naming the worker and action, a diverged loss, or an
/// observer's error.
pub fn train_pipelined(
    cfg: &RunConfig,
    data: &Splits,
    obs: &mut dyn Observer,
    opts: &PipelineTrainOptions,
) -> Result<PipelineReport> {
    if cfg.backend != BackendKind::Cpu {
        BackendKind::open(cfg.backend, 1, 0)?;
    }
    let run = Run::new(cfg, data)?;
    let partition = run_partition(cfg, &run.model)?;
    let init = run.model.init_params(cfg.seed);
    let eval_be = CpuBackend::new(0)?;
    let mut states: Vec<WorkerState> = Vec::new();
    let mut epochs = Vec::new();
    let mut done = 0u64;
    let mut spans: Vec<Span> = Vec::new();
    let mut last = None;
    let mut params: Params = init.clone();
    for epoch in 1..=cfg.epochs {
        let this = (run.total - done).min(run.per_epoch);
        if this == 0 {
            break;
        }
        let spec = cfg.schedule_spec(Length::Updates(this as u32));
        let plan = RunPlan::new(&run.model, &spec, partition.clone())?;
        let epoch_start = Instant::now();
        let outcomes = run.epoch(&plan, data, epoch, done, &init, &mut states)?;
        let secs = epoch_start.elapsed().as_secs_f64();
        done += this;
        if opts.timeline {
            let base = run.start.elapsed().as_secs_f64() - secs;
            for o in &outcomes {
                spans.extend(o.spans.iter().map(|sp| Span {
                    start: sp.start + base,
                    end: sp.end + base,
                    ..*sp
                }));
            }
        }
        params = assemble(&plan, &states)?;
        let ended = EpochEnd {
            plan: &plan,
            outcomes: &outcomes,
            epoch,
            done,
            this,
            secs,
        };
        epochs.push(run.finish_epoch(&ended, &params, data, &eval_be, obs)?);
        last = Some(plan);
    }
    let plan = last.ok_or_else(|| StageError::Config("nothing to train".into()))?;
    let workers = plan.schedule.workers();
    Ok(PipelineReport {
        report: TrainReport {
            epochs,
            params,
            steps: done,
        },
        partition: plan.partition,
        schedule: plan.schedule,
        timeline: opts.timeline.then(|| Timeline::new(workers, spans)),
    })
}

/// The partition `cfg` asks for: given ranges, the FLOP-balanced split (`None`, which
/// [`RunPlan::new`] fills in), or a cut by time measured now
/// ([`crate::planning::measured_partition`]).
///
/// # Errors
/// An impossible schedule; more stages than layers with parameters; profiling failures.
pub fn run_partition(cfg: &RunConfig, model: &Model) -> Result<Option<Partition>> {
    Ok(match &cfg.partition {
        PartitionChoice::Given(p) => Some(p.clone()),
        PartitionChoice::Flops => None,
        PartitionChoice::Measured => Some(measured_cut(cfg, model)?.partition),
    })
}

/// The cut by measured time for `cfg`'s schedule (as many model stages as it has).
///
/// # Errors
/// As [`run_partition`].
pub fn measured_cut(cfg: &RunConfig, model: &Model) -> Result<MeasuredPartition> {
    let spec = cfg.schedule_spec(Length::Updates(1));
    let layout = spec.resolve()?.layout;
    let replicas: Vec<u32> = (0..layout.stages())
        .map(|s| layout.replicas_of(s))
        .collect();
    let m = u32::try_from(cfg.microbatches).unwrap_or(u32::MAX);
    measured_partition(model, cfg.microbatch_size, m, &replicas)
}

impl<'c> Run<'c> {
    pub(super) fn new(cfg: &'c RunConfig, data: &Splits) -> Result<Self> {
        let model = Model::new(&cfg.model)?;
        let b = cfg.microbatch_size;
        // One minibatch: M per replica of the most replicated stage.
        let probe = cfg.schedule_spec(Length::Updates(1)).resolve()?;
        let minibatch = u64::from(probe.minibatch);
        let per_epoch = data.train.len() as u64 / b as u64 / minibatch;
        if per_epoch == 0 {
            return Err(StageError::Config(format!(
                "one minibatch needs {} samples ({minibatch} microbatches of {b}) but {} has {}",
                minibatch * b as u64,
                data.train.name,
                data.train.len()
            )));
        }
        let total = cfg
            .steps
            .map_or(per_epoch * cfg.epochs, |s| s.min(per_epoch * cfg.epochs));
        Ok(Run {
            cfg,
            model,
            minibatch,
            per_epoch,
            total,
            lr: cfg.lr_schedule(total),
            start: Instant::now(),
        })
    }

    /// Runs one epoch's schedule (`plan`) from minibatch `done` on, creating the workers'
    /// state on the first epoch.
    fn epoch(
        &self,
        plan: &RunPlan,
        data: &Splits,
        epoch: u64,
        done: u64,
        init: &Params,
        states: &mut Vec<WorkerState>,
    ) -> Result<Vec<WorkerOutcome>> {
        let cfg = self.cfg;
        let threads = if cfg.threads == 0 { 1 } else { cfg.threads };
        let workers = plan.schedule.workers();
        let backend = || CpuBackend::new(threads);
        self.with_setup(plan, data, epoch, done, |setup| {
            if states.is_empty() {
                *states = (0..plan.schedule.workers())
                    .map(|w| WorkerState::new(setup, w, init, cfg.optimizer))
                    .collect();
            }
            match cfg.transport {
                TransportKind::InProcess => {
                    let opts = InProcOptions {
                        wire: cfg.wire,
                        ..InProcOptions::default()
                    };
                    run_threads(setup, states, mesh(workers, &opts), backend)
                }
                TransportKind::Quic => {
                    let mut opts = QuicOptions::new(run_id(cfg.seed, epoch));
                    opts.wire = cfg.wire;
                    run_threads(setup, states, local_mesh(workers, &opts)?, backend)
                }
            }
        })
    }

    /// Calls `f` with the [`Setup`] of one epoch's schedule (`plan`) from minibatch `done` on:
    /// the epoch's sample order, the learning rate of each stage's updates, dropout offsets.
    pub(super) fn with_setup<R>(
        &self,
        plan: &RunPlan,
        data: &Splits,
        epoch: u64,
        done: u64,
        f: impl FnOnce(&Setup<'_>) -> R,
    ) -> R {
        let cfg = self.cfg;
        let source = OrderedSource {
            data: &data.train,
            order: data.train.epoch_order(cfg.seed, epoch),
            size: cfg.microbatch_size,
        };
        let res = &plan.schedule.resolved;
        // Update k of a stage is global step `done + (k-th update's first microbatch) /
        // minibatch`: the schedule's LR at that step.
        let lr = |stage: u32, k: u32| -> f32 {
            let mb = u64::from(k) * u64::from(res.update_size(stage));
            self.lr.at(done + mb / u64::from(res.minibatch))
        };
        let setup = Setup {
            model: &self.model,
            plan,
            data: &source,
            loss: &SoftmaxCrossEntropy,
            seed: cfg.seed,
            microbatch_offset: done * self.minibatch,
            lr: &lr,
        };
        f(&setup)
    }

    /// The end of an epoch on the chief: reports its steps, evaluates the assembled `params`
    /// on the test split, and reports the epoch.
    pub(super) fn finish_epoch(
        &self,
        ended: &EpochEnd<'_>,
        params: &Params,
        data: &Splits,
        eval_be: &CpuBackend,
        obs: &mut dyn Observer,
    ) -> Result<EpochStats> {
        let (train_loss, samples) = self.report_steps(ended, obs)?;
        let (test_loss, test_accuracy) = evaluate(
            eval_be as &dyn Backend,
            &self.model,
            params,
            &data.test,
            1000,
        )?;
        let e = EpochStats {
            epoch: ended.epoch,
            train_loss,
            test_loss,
            test_accuracy,
            samples_per_sec: samples as f64 / ended.secs.max(1e-9),
            elapsed_s: self.start.elapsed().as_secs_f64(),
            steps: ended.done,
            stages: stage_stats(&ended.plan.schedule, ended.outcomes, ended.secs),
        };
        obs.on_epoch(&e)?;
        Ok(e)
    }

    /// Reports one step record per minibatch of the epoch (its microbatches' losses), after
    /// the epoch: the pipeline has no global step boundary while it runs. Returns the epoch's
    /// mean training loss and its samples.
    fn report_steps(&self, ended: &EpochEnd<'_>, obs: &mut dyn Observer) -> Result<(f64, usize)> {
        let (outcomes, epoch, done, this, secs) = (
            ended.outcomes,
            ended.epoch,
            ended.done,
            ended.this,
            ended.secs,
        );
        let (loss, samples) = outcomes.iter().fold((0.0f64, 0usize), |(l, n), o| {
            (l + o.loss_sum, n + o.samples)
        });
        let train_loss = loss / samples.max(1) as f64;
        if !train_loss.is_finite() {
            return Err(StageError::Diverged {
                step: done,
                loss: train_loss,
            });
        }
        let mut per_step = vec![(0.0f64, 0usize); this as usize];
        for o in outcomes {
            for &(mb, l, n) in &o.losses {
                if let Some(slot) = per_step.get_mut((u64::from(mb) / self.minibatch) as usize) {
                    slot.0 += l;
                    slot.1 += n;
                }
            }
        }
        let rate = samples as f64 / secs.max(1e-9);
        for (t, &(l, n)) in per_step.iter().enumerate() {
            let step = done - this + t as u64;
            obs.on_step(&StepStats {
                step: step + 1,
                epoch,
                loss: l / n.max(1) as f64,
                lr: self.lr.at(step),
                samples: n,
                samples_per_sec: rate,
                elapsed_s: self.start.elapsed().as_secs_f64(),
                steps_in_epoch: this,
                step_in_epoch: t as u64 + 1,
            })?;
        }
        Ok((train_loss, samples))
    }
}

/// A run id for one epoch's QUIC mesh: unique to this process and moment, so that peers of
/// another run (or an earlier epoch) on the same ports are refused; never part of the
/// numerics.
fn run_id(seed: u64, epoch: u64) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    seed.rotate_left(17) ^ epoch.rotate_left(41) ^ u64::from(std::process::id()) ^ now
}

/// Each stage's utilisation and measured staleness over an epoch of `secs`.
fn stage_stats(schedule: &Schedule, outcomes: &[WorkerOutcome], secs: f64) -> Vec<StageEpochStats> {
    let layout = schedule.layout();
    (0..schedule.stages())
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
                // A worker holding several chunks counts its time once per chunk; divide by
                // chunks so the figure stays a share of the worker's time.
                utilisation: busy
                    / (group.len() as f64 * secs.max(1e-9))
                    / f64::from(layout.chunks()),
                staleness: st_sum / st_n.max(1) as f64,
            }
        })
        .collect()
}

/// The whole model's weights, from replica 0 of each stage.
pub fn assemble(plan: &RunPlan, states: &[WorkerState]) -> Result<Params> {
    let layout = plan.schedule.layout();
    let mut out: Params = Vec::new();
    for s in 0..plan.schedule.stages() {
        let w = layout.worker_for(s, 0);
        let st = states[w as usize]
            .stages
            .iter()
            .find(|x| x.stage == s)
            .ok_or_else(|| StageError::Executor(format!("stage {s} missing on worker {w}")))?;
        out.extend(st.params.iter().cloned());
    }
    Ok(out)
}
