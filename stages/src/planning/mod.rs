//! The planning layer (this folder): profiling a model's layers ([`profile`]), cutting it into
//! stages ([`partition`]), and, here, planning a run on this machine.
//!
//! Planning a run on this machine: what `pipe train --stages S` (with no `--partition`),
//! `pipe train --workers W` and `pipe plan --model` measure before they cut the model. The model
//! is profiled at the run's microbatch size with one compute thread per worker
//! ([`crate::profile`]). A fixed stage count is then cut by measured time
//! ([`measured_partition`]); a worker count is planned in full: the in-process link is measured
//! as the executor's own all-reduce, and the planner ([`pipe_scheduler::plan_checked`]) picks the
//! layout under the default cost model.

pub mod buckets;
pub mod device_memory;
pub mod hosts;
pub mod link_costs;
pub mod memory;
pub mod profile;
pub mod request;
pub mod reuse;

use pipe_kernels::CpuBackend;
use pipe_scheduler::planner::transport::{TransportCost, TransportCosts};
use pipe_scheduler::{
    Action, Length, PartitionPlan, PlanOptions, Policy, Profile, ScheduleSpec, plan_checked,
};
use pipe_transport::inproc::{InProcOptions, mesh};

use crate::config::{PartitionChoice, PlannedLayout, RunConfig, TrainSettings, layout_of};
use crate::error::{Result, StageError};
use crate::model::Model;
use crate::optim::OptimizerConfig;
use crate::partition::Partition;
use crate::pipeline::{RunPlan, Setup, WorkerState, run_threads};
use crate::profile::{ProfileOptions, RandomSource};
pub use reuse::{ProfileEvent, ProfileReport, Profiling};

/// Seconds of timed runs after which the planning profiles stop repeating an operation
/// ([`ProfileOptions::budget_seconds`]): short operations get their five repeats, a GPT-2
/// block's forward (0.3-0.7 s at 2 x 1,024 tokens on one core) one.
pub const PLANNING_BUDGET_SECONDS: f64 = 0.5;

/// How every plan profiles (a measured partition, `pipe train --workers`, `pipe plan
/// --model`), so that they find each other's profile in the cache: one warm-up and up to 5
/// timed runs per operation within [`PLANNING_BUDGET_SECONDS`], at `microbatch_size` samples,
/// calibrated at `calibrate` microbatches per update (or not), `concurrent` copies at once.
pub fn planning_profile(
    microbatch_size: usize,
    calibrate: Option<u32>,
    concurrent: usize,
) -> ProfileOptions {
    ProfileOptions {
        warmup: 1,
        repeats: 5,
        calibrate,
        concurrent,
        budget_seconds: Some(PLANNING_BUDGET_SECONDS),
        ..ProfileOptions::new(microbatch_size)
    }
}

/// Workers that compute at once: one per worker, at most one per core.
pub fn busy_workers(workers: u32) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    (workers as usize).clamp(1, cores)
}

/// The median of a sample (NaN when empty).
fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => xs[n / 2],
        n => 0.5 * (xs[n / 2 - 1] + xs[n / 2]),
    }
}

/// The link bandwidth that reproduces the executor's all-reduce of `model`'s gradients between
/// two in-process replicas: a one-stage, two-replica `pipedream` run at one microbatch per
/// update, whose all-reduce actions (flattening the gradients, the ring, unflattening, waiting
/// for the peer) are timed after a warm-up run; a ring of two moves `2 (r-1)/r P = P` bytes,
/// so `P / median`.
///
/// # Errors
/// A failure of the run.
pub fn in_process_bandwidth(model: &Model, microbatch: usize) -> Result<f64> {
    let source = RandomSource::for_model(model, microbatch, 0)?;
    let lr = |_: u32, _: u32| 1e-3f32;
    let init = model.init_params(0);
    let mut states: Vec<WorkerState> = Vec::new();
    let mut times = Vec::new();
    for (round, updates) in [2u32, 6].into_iter().enumerate() {
        let spec = ScheduleSpec::new(Policy::PipeDream, 1, 1)
            .with_replicas(vec![2])
            .with_length(Length::Updates(updates));
        let plan = RunPlan::new(model, &spec, None)?;
        let setup = Setup::new(model, &plan, &source, &lr);
        if states.is_empty() {
            states = (0..2)
                .map(|w| WorkerState::new(&setup, w, &init, OptimizerConfig::default()))
                .collect();
        }
        let eps = mesh(2, &InProcOptions::default());
        let outs = run_threads(&setup, &mut states, eps, |_| CpuBackend::new(1))?;
        if round == 0 {
            continue;
        }
        times.extend(
            outs.iter()
                .flat_map(|o| &o.spans)
                .filter(|sp| matches!(sp.action, Action::AllReduce { .. }))
                .map(|sp| sp.end - sp.start),
        );
    }
    let t = median(times);
    let bytes = (model.param_count().max(1) * 4) as f64;
    Ok(if t.is_finite() && t > 0.0 {
        bytes / t
    } else {
        f64::INFINITY
    })
}

/// A partition cut by measured time, with what each stage was measured to cost.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredPartition {
    /// The cut.
    pub partition: Partition,
    /// The layer profile it was cut by (none for one stage, which is not profiled).
    pub profile: Option<Profile>,
    /// Seconds per pipeline microbatch of each stage: its layers' forward and backward, plus
    /// its update spread over the microbatches of an update, over its replicas.
    pub stage_seconds: Vec<f64>,
}

/// The cut `pipe train --stages S` makes when no partition is given: `model` profiled briefly
/// at `microbatch_size` samples with one thread (isolated layer timings, no calibration run,
/// each layer shape once, `optimizer`'s step; found in or kept in `profiling`'s cache),
/// each layer costing its forward and backward time plus its update over `microbatches`, split
/// into one stage per entry of `replicas` by [`Partition::by_cost`] (a stage's time is over its
/// replicas; no stage is only parameter-free layers, whose memory traffic the times include
/// and a FLOP count misses).
///
/// The cut depends on measured times, so it can differ between machines; runs print it, and
/// `--partition` with the printed ranges repeats a run exactly.
///
/// # Errors
/// More stages than layers with parameters; profiling failures.
pub fn measured_partition(
    model: &Model,
    microbatch_size: usize,
    microbatches: u32,
    replicas: &[u32],
    optimizer: OptimizerConfig,
    profiling: &Profiling,
) -> Result<MeasuredPartition> {
    if replicas.len() == 1 {
        return Ok(MeasuredPartition {
            partition: Partition::new(std::iter::once(0..model.len()).collect(), model.len())?,
            profile: None,
            stage_seconds: vec![f64::NAN],
        });
    }
    let be = CpuBackend::new(1)?;
    let opts = ProfileOptions {
        optimizer,
        ..planning_profile(microbatch_size, None, 1)
    };
    let profile = profiling.profile(model, "", &be, &opts, microbatches)?;
    let per_update = f64::from(microbatches.max(1));
    let costs: Vec<f64> = profile
        .layers
        .iter()
        .map(|l| l.compute() + l.update / per_update)
        .collect();
    let partition = Partition::by_cost(model, &costs, replicas)?;
    let stage_seconds = partition
        .ranges()
        .iter()
        .zip(replicas)
        .map(|(r, &reps)| costs[r.clone()].iter().sum::<f64>() / f64::from(reps))
        .collect();
    Ok(MeasuredPartition {
        partition,
        profile: Some(profile),
        stage_seconds,
    })
}

/// What `pipe train --workers W` plans with: the model profiled at the run's microbatch size
/// with one thread (calibrated on the executor, as many copies at once as there are busy
/// workers; found in or kept in `profiling`'s cache), planned under the default cost model for the run's schedule. In-process
/// activations move for free; the all-reduce's measured cost sets the bandwidth; `link`, the
/// measured costs of the transport that will carry the run's links, charges each stage its
/// messages' processor time.
///
/// # Errors
/// Profiling or planning failures (an unplannable schedule is bad input).
pub fn auto_plan(
    cfg: &RunConfig,
    model: &Model,
    policy: Policy,
    workers: u32,
    link: Option<&TransportCost>,
    profiling: &Profiling,
) -> Result<(Profile, PartitionPlan)> {
    let (name, microbatch_size) = (cfg.model_name.as_str(), cfg.microbatch_size);
    let microbatches = u32::try_from(cfg.microbatches).unwrap_or(u32::MAX);
    let be = CpuBackend::new(1)?;
    let opts = planning_profile(microbatch_size, Some(microbatches), busy_workers(workers));
    let profile = profiling.profile(model, name, &be, &opts, microbatches)?;
    let bandwidth = in_process_bandwidth(model, microbatch_size)?;
    let mut opts = PlanOptions {
        policy,
        microbatches,
        ..PlanOptions::new(workers, bandwidth)
    };
    if let Some(link) = link {
        opts = opts.with_transport(link);
    }
    let plan = plan_checked(&profile, &opts)?;
    Ok((profile, plan))
}

/// The cut by measured time for `cfg`'s schedule (as many model stages as it has).
///
/// # Errors
/// An impossible schedule; more stages than layers with parameters; profiling failures.
pub fn measured_cut(
    cfg: &RunConfig,
    model: &Model,
    profiling: &Profiling,
) -> Result<MeasuredPartition> {
    let layout = cfg.resolved()?.layout.clone();
    let replicas: Vec<u32> = (0..layout.stages())
        .map(|s| layout.replicas_of(s))
        .collect();
    let m = u32::try_from(cfg.microbatches).unwrap_or(u32::MAX);
    measured_partition(
        model,
        cfg.microbatch_size,
        m,
        &replicas,
        cfg.optimizer,
        profiling,
    )
}

/// Settles `--workers W`: plans the run `settings` describe for `workers` workers
/// ([`auto_plan`]) and resolves them with the layout the plan picked
/// ([`TrainSettings::resolve_planned`]), since the layout sets defaults of its own (an
/// asynchronous layout's SGD momentum). Returns the run, the plan and the profile it was
/// planned from.
///
/// # Errors
/// [`StageError::Config`] for no workers or settings that describe no run; profiling and
/// planning failures.
pub fn plan_workers(
    settings: TrainSettings,
    workers: u32,
    costs: Option<&TransportCosts>,
    profiling: &Profiling,
) -> Result<(RunConfig, PartitionPlan, Profile)> {
    if workers == 0 {
        return Err(StageError::Config("--workers must be at least 1".into()));
    }
    let cfg = settings.clone().resolve()?;
    let model = Model::new(&cfg.model)?;
    let policy = cfg.pipeline_policy();
    let (profile, plan) = auto_plan(
        &cfg,
        &model,
        policy,
        workers,
        costs.and_then(|c| c.get(cfg.link_transport().name())),
        profiling,
    )?;
    let (partition, replicas) = layout_of(&plan)?;
    let planned = PlannedLayout {
        policy,
        replicas,
        partition,
    };
    Ok((settings.resolve_planned(Some(planned))?, plan, profile))
}

/// Plans `cfg`'s run again for `workers` workers (`pipe train --replan-on-restart`, after a
/// start that lost one): profiles the model on this machine and lets the planner pick the
/// stages, replicas and partition for the run's schedule, as `--workers` does. Everything
/// else is the run's own (model, data, optimizer with its momentum, learning rate, schedule),
/// and so is its minibatch wherever the new layout divides it: the microbatches per replica
/// are chosen for it, so the data order and the update count stay those of the run.
///
/// # Errors
/// No layout for that many workers; a new layout whose minibatch cannot be the run's (the
/// message names both), profiling failures.
pub fn replan(
    cfg: &RunConfig,
    workers: u32,
    costs: Option<&TransportCosts>,
    profiling: &Profiling,
) -> Result<(RunConfig, PartitionPlan)> {
    let model = Model::new(&cfg.model)?;
    let (_, plan) = auto_plan(
        cfg,
        &model,
        cfg.schedule,
        workers,
        costs.and_then(|c| c.get(cfg.link_transport().name())),
        profiling,
    )?;
    let (partition, replicas) = layout_of(&plan)?;
    let minibatch = cfg.resolved()?.minibatch;
    // The minibatch of one microbatch per replica: the unit the run's must be a multiple of.
    let unit = pipe_scheduler::ScheduleSpec::new(cfg.schedule, replicas.len() as u32, 1)
        .with_replicas(replicas.clone())
        .resolve()?
        .minibatch;
    if minibatch % unit != 0 {
        return Err(StageError::Config(format!(
            "planned again for {workers} workers, replicas {replicas:?} take minibatches of a multiple of {unit} microbatches, not the run's {minibatch}"
        )));
    }
    let next = cfg.with_layout(replicas, partition, (minibatch / unit) as usize)?;
    Ok((next, plan))
}

/// Settles `--partition measured` (the default of a pipelined run): cuts `model` by the
/// time its stages measure on this machine ([`measured_cut`]) and returns the run with that
/// cut ([`RunConfig::with_partition`]), so that worker processes and checkpoints name the
/// partition the run used, and the cut; the run as it was and `None` when its partition was
/// given.
///
/// # Errors
/// Profiling failures.
pub fn settle_measured_partition(
    cfg: RunConfig,
    model: &Model,
    profiling: &Profiling,
) -> Result<(RunConfig, Option<MeasuredPartition>)> {
    if cfg.partition != PartitionChoice::Measured {
        return Ok((cfg, None));
    }
    let cut = measured_cut(&cfg, model, profiling)?;
    Ok((cfg.with_partition(cut.partition.clone()), Some(cut)))
}
