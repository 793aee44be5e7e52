//! Pipeline throughput against one worker, against the simulator, and the executor's overhead.
//!
//! Method, all in one process and one sitting so the noisy host hurts every figure alike, in
//! `rounds` rounds (default 3) of steps 1-3; each reported figure and ratio is the median over
//! rounds of the figure or of the ratio taken within its round:
//!
//! 1. **Single worker**: the ordinary training step (one microbatch of the whole batch) with
//!    2 compute threads; samples/s is the median over timed steps after warm-up.
//! 2. **Each pipelined case**: the executor on in-process threads, one compute thread per worker;
//!    a warm-up run, then a timed run of `updates` minibatches; samples/s = samples / wall time
//!    of the timed run (thread start, fill and drain included). The worker-process cases run
//!    the same layout as `pipe train --placement processes --transport shm` for `updates`
//!    minibatches and read the chief's samples/s (connection set-up excluded, fill and drain
//!    included), once for `warmup` and once for `warmup + updates` minibatches, the timed
//!    rate being the difference of the two; a pair whose longer run took no longer is taken
//!    again, up to three times, and then the bench stops with an error naming the case, where
//!    it used to report a negative rate. The replicated case runs with each stage's bucket size chosen as a run
//!    chooses it ([`pipe_scheduler::planner::buckets`], on the case's measured link, from the
//!    model's layer profile) and again with one bucket per stage.
//! 3. **Simulated**: per-stage costs come from a quick per-stage timing, the one-thread
//!    sequential run of the same partition and microbatch size, two copies at once so that
//!    both cores are busy as in the pipelined runs (mean forward, backward and update time of
//!    each stage; means, since the first forward of each weight version also builds its
//!    transposed copy); a replicated stage's all-reduce is timed alone among its
//!    replicas' threads (over shared memory for the worker-process cases), and with several
//!    buckets the simulator sums them as the executor does, the measured time setting the
//!    ring's processor time per byte (`sim::bucketed_all_reduce`). The timed run's schedule
//!    is simulated with those costs on the machine's two cores shared by all workers
//!    (`CostModel::cores`), each in-process message delayed by the one-way ping-pong time of
//!    step 4 (link latency) and costing its sender and receiver the ping-pong's processor time
//!    per message end (`CostModel::message_cpu`); worker processes' messages, shared memory's
//!    measured costs (pipe's cached transport costs); and the predicted samples/s compared
//!    with the measured one.
//! 4. **Executor overhead per action**: the executor runs `sequential` (small model) on one
//!    worker with a backend wrapper that times every kernel call; wall time minus kernel time,
//!    over the actions, is what interpreting a schedule costs (version maps, hand-offs, data
//!    gathering, timing, thread start). Median of five runs. The in-process transport's cost per message is
//!    measured separately by ping-pong between two threads: wall time per message, and
//!    both threads' processor time (`CLOCK_THREAD_CPUTIME_ID`) per message end.
//!
//! Data are random inputs and labels from a fixed pool (the figures are about speed).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use pipe_kernels::{CpuBackend, Tensor, Timed};
use pipe_scheduler::planner::buckets::{
    BucketSize, LayerGradients, StageBuckets, buckets_of, choose_bucket_size,
};
use pipe_scheduler::sim::Link;
use pipe_scheduler::{
    Action, CostModel, Length, Policy, ScheduleSpec, SimOptions, StageCost, simulate,
};
use pipe_stages::model::{Model, ModelSpec, Params};
use pipe_stages::optim::{Optimizer, OptimizerConfig, OptimizerKind};
use pipe_stages::pipeline::{
    DEFAULT_BUCKET_SIZE, MicrobatchSource, Partition, RunPlan, Setup, WorkerOutcome, WorkerState,
    all_reduce_gradients, run_threads,
};
use pipe_stages::train::{StepState, train_step};
use pipe_transport::collective::ring_all_reduce;
use pipe_transport::inproc::{InProcOptions, mesh};
use serde::Serialize;

use crate::{ExperimentError, median};
use pipe_transport::measure::LinkCost;

/// Random samples from a fixed pool; microbatch `mb` takes consecutive rows, wrapping around.
struct Pool {
    x: Vec<f32>,
    y: Vec<u32>,
    features: usize,
    size: usize,
    shape: Vec<usize>,
}

impl Pool {
    fn new(model: &Model, size: usize) -> Self {
        let features: usize = model.input_shape().iter().product();
        let classes: usize = model.output_shape().iter().product();
        let n = 4096;
        let x = (0..n * features)
            .map(|i| ((i.wrapping_mul(2_654_435_761) >> 7) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let y = (0..n).map(|i| ((i * 7) % classes) as u32).collect();
        let mut shape = vec![size];
        shape.extend_from_slice(model.input_shape());
        Pool {
            x,
            y,
            features,
            size,
            shape,
        }
    }

    fn rows(&self, mb: u32) -> impl Iterator<Item = usize> + '_ {
        let n = self.y.len();
        (0..self.size).map(move |i| (mb as usize * self.size + i) % n)
    }

    fn batch(&self, mb: u32) -> (Tensor, Tensor<u32>) {
        let mut x = Vec::with_capacity(self.size * self.features);
        let mut y = Vec::with_capacity(self.size);
        for r in self.rows(mb) {
            x.extend_from_slice(&self.x[r * self.features..(r + 1) * self.features]);
            y.push(self.y[r]);
        }
        let n = y.len();
        (
            Tensor::from_vec(&self.shape, x).unwrap_or_default(),
            Tensor::from_vec(&[n], y).unwrap_or_default(),
        )
    }
}

impl MicrobatchSource for Pool {
    fn microbatch_size(&self) -> usize {
        self.size
    }
    fn inputs(&self, mb: u32) -> pipe_stages::Result<Tensor> {
        Ok(self.batch(mb).0)
    }
    fn labels(&self, mb: u32) -> pipe_stages::Result<Tensor<u32>> {
        Ok(self.batch(mb).1)
    }
}

/// One pipelined configuration.
#[derive(Clone, Debug, Serialize)]
pub struct Case {
    /// Short name.
    pub name: String,
    /// Policy.
    pub policy: Policy,
    /// Stages.
    pub stages: u32,
    /// Replicas per stage.
    pub replicas: u32,
    /// Samples per microbatch.
    pub microbatch: usize,
    /// Microbatches per update per replica.
    pub m: u32,
    /// Replicas per stage when they differ (overrides `replicas`).
    pub replica_counts: Option<Vec<u32>>,
    /// Layers of each stage (default: balanced by FLOPs).
    pub partition: Option<Vec<std::ops::Range<usize>>>,
    /// The all-reduce bucket size (default [`pipe_stages::pipeline::DEFAULT_BUCKET_SIZE`];
    /// [`BucketSize::Whole`]: one bucket per stage, started when the stage's last backward
    /// pass has finished). Reported as `bucket_values`, its count of values.
    #[serde(default, rename = "bucket_values")]
    pub bucket_size: Option<BucketSize>,
    /// The bucket size of each stage, where chosen per stage
    /// ([`pipe_scheduler::planner::buckets`], on the link of the case's transport). Reported
    /// as `stage_bucket_values`.
    #[serde(default, rename = "stage_bucket_values")]
    pub stage_buckets: Option<StageBuckets>,
    /// Run as worker processes over shared memory (`pipe train --placement processes`), not
    /// threads of this process.
    #[serde(default)]
    pub processes: bool,
}

impl Case {
    /// The whole model's four stages run one after another on one thread: the sequential
    /// reference the pipelined cases are compared with.
    fn sequential(microbatch: usize, m: u32) -> Self {
        Case {
            name: "sequential".into(),
            policy: Policy::Sequential,
            stages: 4,
            replicas: 1,
            microbatch,
            m,
            replica_counts: None,
            partition: None,
            bucket_size: None,
            stage_buckets: None,
            processes: false,
        }
    }
}

/// Results of one case.
#[derive(Clone, Debug, Serialize)]
pub struct CaseResult {
    /// The case.
    pub case: Case,
    /// Measured samples/s.
    pub samples_per_s: f64,
    /// Measured over the single worker's samples/s.
    pub ratio_to_single: f64,
    /// Measured over twice the one-core figure: how much of two cores the pipeline keeps busy
    /// at its own microbatch size.
    pub core_scaling: f64,
    /// Simulated samples/s with per-stage costs from the one-thread sequential run, on two
    /// shared cores.
    pub simulated_samples_per_s: f64,
    /// Measured over simulated.
    pub measured_over_simulated: f64,
}

/// A model's results.
#[derive(Clone, Debug, Serialize)]
pub struct ModelResult {
    /// Model preset.
    pub model: String,
    /// Samples per update.
    pub batch: usize,
    /// Single worker, 2 threads, samples/s.
    pub single_samples_per_s: f64,
    /// The executor running `sequential` on one worker with one thread, same microbatches as
    /// the pipelined cases: what one core does at that microbatch size.
    pub one_core_samples_per_s: f64,
    /// Pipelined cases.
    pub cases: Vec<CaseResult>,
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct PipelineReport {
    /// Per model.
    pub models: Vec<ModelResult>,
    /// Executor overhead per action, microseconds (small model, sequential on one worker).
    pub overhead_us_per_action: f64,
    /// In-process transport, microseconds per message (ping-pong wall time, one way).
    pub transport_us_per_message: f64,
    /// Processor time per message at each end (sender or receiver), microseconds: the
    /// ping-pong's thread CPU time over both threads, per message and end.
    pub transport_cpu_us_per_message: f64,
    /// The executor's all-reduce against the bare ring on the same gradients.
    pub all_reduce: AllReduceResult,
    /// Timed updates per case.
    pub updates: u32,
    /// Rounds each figure is the median of.
    pub rounds: u32,
}

/// The executor's all-reduce of one stage's gradients between two in-process replicas, each on
/// its own thread, against the bare ring on one flat buffer of the same length, and against
/// flattening the gradients into such a buffer and back around the ring (how the executor did
/// it before its all-reduce reduced the tensors in place). Medians over repeats, the three
/// variants alternating in every repeat.
#[derive(Clone, Debug, Serialize)]
pub struct AllReduceResult {
    /// The model and the stage whose gradients are summed.
    pub what: String,
    /// Gradient tensors and values.
    pub tensors: usize,
    /// Values summed.
    pub values: usize,
    /// Seconds: the executor's all-reduce (`pipe_stages::pipeline::all_reduce_gradients`).
    pub executor_s: f64,
    /// Seconds: `ring_all_reduce` on one flat buffer.
    pub bare_ring_s: f64,
    /// Seconds: flatten, ring, unflatten.
    pub flattened_s: f64,
    /// Executor over bare ring.
    pub ratio: f64,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct PipelineBenchConfig {
    /// Timed minibatches per case.
    pub updates: u32,
    /// Warm-up minibatches per case.
    pub warmup: u32,
    /// Run only the small model (fast; for tests).
    pub small_only: bool,
    /// Rounds of every measurement; the report gives the median of each figure and of each
    /// ratio over the rounds, each round's ratios taken within the round.
    pub rounds: u32,
    /// The `pipe` binary that runs the worker-process cases (`pipe train --placement
    /// processes`); none: in-process cases only.
    pub pipe: Option<std::path::PathBuf>,
}

impl Default for PipelineBenchConfig {
    fn default() -> Self {
        Self {
            updates: 24,
            warmup: 6,
            small_only: false,
            rounds: 3,
            pipe: None,
        }
    }
}

fn sgd() -> OptimizerConfig {
    OptimizerConfig {
        kind: OptimizerKind::Sgd,
        momentum: 0.9,
        ..OptimizerConfig::default()
    }
}

fn single_worker(
    model: &Model,
    batch: usize,
    steps: u32,
    warmup: u32,
) -> Result<f64, ExperimentError> {
    let be = CpuBackend::new(2)?;
    let pool = Pool::new(model, batch);
    let mut params = model.init_params(0);
    let mut grads = model.zero_grads(0..model.len());
    let mut opt = Optimizer::new(sgd(), &params, &model.optimizer_roles());
    let mut times = Vec::new();
    let mut id = 0u64;
    for i in 0..warmup + steps {
        let t = Instant::now();
        let mut st = StepState {
            params: &mut params,
            grads: &mut grads,
            opt: &mut opt,
        };
        train_step(
            &be,
            model,
            &mut st,
            vec![pool.batch(i)],
            1.0 / batch as f32,
            1e-3,
            0,
            &mut id,
        )?;
        if i >= warmup {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(batch as f64 / median(&times))
}

/// Runs `minibatches` minibatches of `case` with `states` (created when empty).
pub(crate) fn pipelined(
    model: &Model,
    case: &Case,
    minibatches: u32,
    states: &mut Vec<WorkerState>,
) -> Result<(f64, Vec<WorkerOutcome>, pipe_scheduler::Schedule), ExperimentError> {
    pipelined_with(model, case, minibatches, states, |_| CpuBackend::new(1))
}

/// [`pipelined`] with backends made by `make`.
fn pipelined_with<B: pipe_kernels::Backend>(
    model: &Model,
    case: &Case,
    minibatches: u32,
    states: &mut Vec<WorkerState>,
    make: impl Fn(u32) -> Result<B, pipe_kernels::KernelError> + Sync,
) -> Result<(f64, Vec<WorkerOutcome>, pipe_scheduler::Schedule), ExperimentError> {
    let policy = case.policy;
    let replicas = case
        .replica_counts
        .clone()
        .unwrap_or_else(|| vec![case.replicas]);
    let spec = ScheduleSpec::new(policy, case.stages, case.m)
        .with_replicas(replicas)
        .with_length(Length::Updates(minibatches));
    let partition = match &case.partition {
        Some(ranges) => Some(Partition::new(ranges.clone(), model.len())?),
        None => None,
    };
    let mut plan = RunPlan::new(model, &spec, partition)?
        .with_bucket_size(case.bucket_size.unwrap_or(DEFAULT_BUCKET_SIZE));
    if let Some(sizes) = &case.stage_buckets {
        plan = plan.with_stage_buckets(sizes);
    }
    let schedule = &plan.schedule;
    let pool = Pool::new(model, case.microbatch);
    let lr = |_: u32, _: u32| 1e-3f32;
    let setup = Setup::new(model, &plan, &pool, &lr);
    if states.is_empty() {
        let init = model.init_params(0);
        *states = (0..schedule.workers())
            .map(|w| WorkerState::new(&setup, w, &init, sgd()))
            .collect();
    }
    let eps = mesh(schedule.workers(), &InProcOptions::default());
    let t = Instant::now();
    let outs = run_threads(&setup, states, eps, make)?;
    let secs = t.elapsed().as_secs_f64();
    let samples = f64::from(schedule.total_microbatches()) * case.microbatch as f64;
    Ok((samples / secs, outs, plan.schedule))
}

/// Per-stage costs: means of the measured action durations (means, not medians: the first
/// forward of every weight version also builds the version's transposed copy, a cost every
/// version pays once).
fn costs_from(outs: &[WorkerOutcome], stages: u32) -> CostModel {
    let mut per: Vec<[Vec<f64>; 3]> = (0..stages)
        .map(|_| [Vec::new(), Vec::new(), Vec::new()])
        .collect();
    for o in outs {
        for sp in &o.spans {
            let d = sp.end - sp.start;
            let slot = match sp.action {
                Action::Forward { .. } => 0,
                Action::Backward { .. } => 1,
                Action::Update { .. } => 2,
                _ => continue,
            };
            per[sp.action.stage() as usize][slot].push(d);
        }
    }
    let stages = per
        .iter()
        .map(|p| {
            let m = |v: &Vec<f64>| {
                if v.is_empty() {
                    0.0
                } else {
                    v.iter().sum::<f64>() / v.len() as f64
                }
            };
            StageCost {
                update: m(&p[2]),
                ..StageCost::compute(m(&p[0]), m(&p[1]))
            }
        })
        .collect();
    CostModel {
        stages,
        ..CostModel::uniform(StageCost::compute(0.0, 0.0))
    }
}

/// Seconds one ring all-reduce of `len` values takes among `r` workers, each on its own
/// thread ([`pipe_transport::measure::all_reduce_seconds`]): over channels, or over shared memory as
/// worker processes sum theirs.
fn all_reduce_cost(len: usize, r: u32, processes: bool) -> Result<f64, ExperimentError> {
    if processes {
        let opts = pipe_transport::shm::ShmOptions::new(0x5eed);
        let eps = pipe_transport::shm::local_mesh(r, &opts)
            .map_err(|e| ExperimentError::Config(format!("shared-memory mesh: {e}")))?;
        return pipe_transport::measure::all_reduce_seconds(eps, len, 7)
            .map_err(ExperimentError::from);
    }
    pipe_transport::measure::all_reduce_seconds(mesh(r, &InProcOptions::default()), len, 7)
        .map_err(ExperimentError::from)
}

/// Per-stage costs of `one` (the one-thread sequential run) timed with two copies running at
/// once, one per core, as the pipelined cases keep both cores busy: two busy cores share cache
/// and memory bandwidth, which can slow each action (the profiler calibrates the same way,
/// `pipe profile --concurrent`). On the benchmark's models the simulated figures moved by under
/// 5% against costs timed alone: contention is not where the gap to the measured runs is.
fn contended_costs(
    model: &Model,
    one: &Case,
    updates: u32,
    states: &mut Vec<WorkerState>,
) -> Result<CostModel, ExperimentError> {
    let mut twin = states.clone();
    let (a, b) = std::thread::scope(|scope| {
        let other = scope.spawn(|| pipelined(model, one, updates, &mut twin));
        let mine = pipelined(model, one, updates, states);
        let theirs = other
            .join()
            .map_err(|_| ExperimentError::Config("timing thread panicked".into()));
        (mine, theirs)
    });
    let (_, mut outs, _) = a?;
    let (_, more, _) = b??;
    outs.extend(more);
    Ok(costs_from(&outs, one.stages))
}

/// Measures [`AllReduceResult`] for `grads` (one stage's gradient shapes) on two replicas.
fn all_reduce_against_ring(
    what: String,
    grads: &Params,
) -> Result<AllReduceResult, ExperimentError> {
    const REPEATS: u32 = 15;
    let group = [0u32, 1];
    let values: usize = grads.iter().flatten().map(Tensor::len).sum();
    let handles: Vec<_> = mesh(2, &InProcOptions::default())
        .into_iter()
        .map(|mut ep| {
            let mut tensors = grads.clone();
            std::thread::spawn(move || -> Result<[Vec<f64>; 3], ExperimentError> {
                let mut flat = vec![1.0f32; values];
                let be = CpuBackend::new(1)?;
                let mut times: [Vec<f64>; 3] = Default::default();
                let err =
                    |e: pipe_transport::TransportError| ExperimentError::Config(e.to_string());
                for round in 0..=REPEATS {
                    let update = 3 * round;
                    let t = Instant::now();
                    all_reduce_gradients(
                        &be,
                        &mut ep,
                        &group,
                        (0, update),
                        &mut tensors,
                        (DEFAULT_BUCKET_SIZE, pipe_transport::frame::WireDType::F32),
                    )?;
                    let executor = t.elapsed().as_secs_f64();
                    let t = Instant::now();
                    ring_all_reduce(&mut ep, &group, 0, update + 1, &mut flat).map_err(err)?;
                    let bare = t.elapsed().as_secs_f64();
                    let t = Instant::now();
                    let mut copy = Vec::with_capacity(values);
                    for g in tensors.iter().flatten() {
                        copy.extend_from_slice(
                            g.host()
                                .map_err(|e| ExperimentError::Config(e.to_string()))?,
                        );
                    }
                    ring_all_reduce(&mut ep, &group, 0, update + 2, &mut copy).map_err(err)?;
                    let mut at = 0;
                    for g in tensors.iter_mut().flatten() {
                        let dst = g
                            .host_mut()
                            .map_err(|e| ExperimentError::Config(e.to_string()))?;
                        dst.copy_from_slice(&copy[at..at + dst.len()]);
                        at += dst.len();
                    }
                    let flattened = t.elapsed().as_secs_f64();
                    if round > 0 {
                        times[0].push(executor);
                        times[1].push(bare);
                        times[2].push(flattened);
                    }
                }
                Ok(times)
            })
        })
        .collect();
    let mut all: [Vec<f64>; 3] = Default::default();
    for h in handles {
        let mine = h
            .join()
            .map_err(|_| ExperimentError::Config("all-reduce thread panicked".into()))??;
        for (a, m) in all.iter_mut().zip(mine) {
            a.extend(m);
        }
    }
    let [executor_s, bare_ring_s, flattened_s] = all.map(|t| median(&t));
    Ok(AllReduceResult {
        what,
        tensors: grads.iter().map(Vec::len).sum(),
        values,
        executor_s,
        bare_ring_s,
        flattened_s,
        ratio: executor_s / bare_ring_s,
    })
}

/// What the cases of one model share: the per-stage times of the one-thread sequential run,
/// the model's layer profile (what a run chooses its bucket sizes from), and the measured
/// links of threads and of worker processes.
struct ModelContext<'a> {
    model: &'a Model,
    preset: &'a str,
    base: CostModel,
    profile: pipe_scheduler::Profile,
    inproc: Link,
    shm: Link,
}

impl ModelContext<'_> {
    /// The link a case's stages talk over.
    fn link(&self, case: &Case) -> Link {
        if case.processes {
            self.shm
        } else {
            self.inproc
        }
    }

    /// Each replicated stage's bucket size, chosen as a run chooses it: the layers' measured
    /// backward times and parameters, on the case's link.
    fn chosen_buckets(&self, case: &Case) -> Result<StageBuckets, ExperimentError> {
        let partition =
            Partition::balanced(self.model, &vec![case.replicas; case.stages as usize])?;
        let link = self.link(case);
        Ok(partition
            .ranges()
            .iter()
            .map(|range| {
                let layers = self.layers(range.clone());
                choose_bucket_size(&layers, case.replicas, &link, 4.0)
                    .map_or(DEFAULT_BUCKET_SIZE, |c| c.size)
            })
            .collect())
    }

    fn layers(&self, range: std::ops::Range<usize>) -> Vec<LayerGradients> {
        self.profile.layers[range]
            .iter()
            .map(LayerGradients::of)
            .collect()
    }

    /// The simulator's costs for `case`: the per-stage times of the one-thread sequential
    /// run, the case's link (latency and processor time per message end and per byte), a
    /// measured all-reduce per replicated stage on the case's transport, its buckets where the
    /// case has several (their ready times the profile's, scaled to the stage's measured
    /// backward), and the machine's two cores shared by every worker.
    fn case_costs(&self, case: &Case) -> Result<CostModel, ExperimentError> {
        let link = self.link(case);
        let mut costs = CostModel {
            cores: Some(2),
            bandwidth: link.bandwidth,
            latency: link.latency,
            message_cpu: link.message_cpu,
            byte_cpu: link.byte_cpu,
            ..self.base.clone()
        };
        if case.replicas <= 1 {
            return Ok(costs);
        }
        let partition =
            Partition::balanced(self.model, &vec![case.replicas; case.stages as usize])?;
        for (s, st) in costs.stages.iter_mut().enumerate() {
            let range = partition.range(s);
            let len: usize = self
                .model
                .zero_grads(range.clone())
                .iter()
                .flatten()
                .map(Tensor::len)
                .sum();
            st.all_reduce = Some(all_reduce_cost(len, case.replicas, case.processes)?);
            let size = match (&case.stage_buckets, case.bucket_size) {
                (Some(sizes), _) => sizes.get(s).unwrap_or(DEFAULT_BUCKET_SIZE),
                (None, Some(size)) => size,
                (None, None) => DEFAULT_BUCKET_SIZE,
            };
            let layers = self.layers(range);
            let profiled: f64 = layers.iter().map(|l| l.backward).sum();
            let scale = if profiled > 0.0 {
                st.whole_backward() / profiled
            } else {
                1.0
            };
            let mut buckets = buckets_of(&layers, size, 4.0);
            for b in &mut buckets {
                b.ready *= scale;
            }
            st.buckets = (buckets.len() > 1).then_some(buckets);
        }
        Ok(costs)
    }
}

fn run_case(
    ctx: &ModelContext<'_>,
    case: &Case,
    cfg: &PipelineBenchConfig,
    (single, one_core): (f64, f64),
) -> Result<CaseResult, ExperimentError> {
    let mut case = case.clone();
    if case.replicas > 1 && case.bucket_size.is_none() {
        case.stage_buckets = Some(ctx.chosen_buckets(&case)?);
    }
    let costs = ctx.case_costs(&case)?;
    let (measured, simulated) = if case.processes {
        let pipe = cfg.pipe.as_ref().ok_or_else(|| {
            ExperimentError::Config("worker-process cases need the pipe binary".into())
        })?;
        // Runs of `warmup` and of `warmup + updates` minibatches: the timed minibatches' rate
        // is the difference of the two, measured and simulated alike, so that neither the
        // processes' start nor their first minibatches' page faults count.
        let warmup = cfg.warmup.max(1);
        let measured = measured_in_processes(pipe, ctx, &case, warmup, cfg.updates)?;
        let simulate_for = |updates: u32| -> Result<(f64, f64), ExperimentError> {
            let spec = ScheduleSpec::new(case.policy, case.stages, case.m)
                .with_replicas(vec![case.replicas; case.stages as usize])
                .with_length(Length::Updates(updates));
            let schedule = pipe_scheduler::lower(
                &pipe_scheduler::generate(&spec)?,
                pipe_scheduler::LowerOptions::default(),
            );
            let sim = simulate(&schedule, &costs, SimOptions::default())?;
            let samples = f64::from(schedule.total_microbatches()) * case.microbatch as f64;
            Ok((samples, sim.makespan))
        };
        let (a, b) = (simulate_for(warmup)?, simulate_for(warmup + cfg.updates)?);
        let simulated = difference_rate(a, b).ok_or_else(|| {
            ExperimentError::Config(format!(
                "{}: the simulated run of {} updates ends no later than the run of {warmup}",
                case.name,
                warmup + cfg.updates
            ))
        })?;
        (measured, simulated)
    } else {
        let mut states = Vec::new();
        pipelined(ctx.model, &case, cfg.warmup.max(1), &mut states)?;
        let (measured, _, schedule) = pipelined(ctx.model, &case, cfg.updates, &mut states)?;
        let sim = simulate(&schedule, &costs, SimOptions::default())?;
        (measured, sim.throughput * case.microbatch as f64)
    };
    Ok(CaseResult {
        case,
        samples_per_s: measured,
        ratio_to_single: measured / single,
        core_scaling: measured / (2.0 * one_core),
        simulated_samples_per_s: simulated,
        measured_over_simulated: measured / simulated,
    })
}

/// How many times a worker-process case's pair of runs is taken before the bench gives up on
/// a pair whose longer run took no longer than its shorter one.
const PROCESS_PAIR_ATTEMPTS: u32 = 3;

/// The rate of the samples the longer of two runs `(samples, seconds)` trained past the
/// shorter: `None` where it trained no more samples or took no more time, where a quotient
/// would be meaningless (negative, or infinite).
fn difference_rate((s1, t1): (f64, f64), (s2, t2): (f64, f64)) -> Option<f64> {
    let (samples, seconds) = (s2 - s1, t2 - t1);
    (samples > 0.0 && seconds > 0.0).then(|| samples / seconds)
}

/// The samples/s of `updates` minibatches of `case` as worker processes, past `warmup` ones:
/// the difference of a run of `warmup` and one of `warmup + updates`. Where the machine's
/// noise exceeds the timed updates' time, so that the longer run took no longer, the pair is
/// taken again, up to [`PROCESS_PAIR_ATTEMPTS`] times.
///
/// # Errors
/// A run's failure, or [`ExperimentError::Config`] naming the case and the last pair's times
/// when no pair gave a positive difference (too few `--updates` to time on this machine).
fn measured_in_processes(
    pipe: &std::path::Path,
    ctx: &ModelContext<'_>,
    case: &Case,
    warmup: u32,
    updates: u32,
) -> Result<f64, ExperimentError> {
    let mut last = None;
    for _ in 0..PROCESS_PAIR_ATTEMPTS {
        let short = in_processes(pipe, ctx, case, warmup)?;
        let long = in_processes(pipe, ctx, case, warmup + updates)?;
        if let Some(rate) = difference_rate(short, long) {
            return Ok(rate);
        }
        last = Some((short.1, long.1));
    }
    let (short, long) = last.unwrap_or_default();
    Err(ExperimentError::Config(format!(
        "{}: the run of {} updates took no longer than the run of {warmup} in \
         {PROCESS_PAIR_ATTEMPTS} tries (last {long:.3} s against {short:.3} s): too few \
         timed updates to measure here; raise --updates",
        case.name,
        warmup + updates
    )))
}

/// `case` run as worker processes over shared memory: `pipe train --placement processes` on
/// synthetic samples of the model's input size, `updates` minibatches, the FLOP-balanced
/// partition the in-process cases run: the samples trained and the seconds they took (from
/// the chief's samples/s, connection set-up excluded).
fn in_processes(
    pipe: &std::path::Path,
    ctx: &ModelContext<'_>,
    case: &Case,
    updates: u32,
) -> Result<(f64, f64), ExperimentError> {
    let replicas = vec![case.replicas; case.stages as usize];
    let partition = Partition::balanced(ctx.model, &replicas)?;
    let buckets = match (&case.stage_buckets, case.bucket_size) {
        (Some(sizes), _) => sizes.to_string(),
        (None, Some(size)) => size.to_string(),
        (None, None) => "4".into(),
    };
    // Synthetic samples of the model's input size, as the threads' random pool.
    let inputs: usize = ctx.model.input_shape().iter().product();
    let config = std::env::temp_dir().join(format!(
        "pipe-bench-pipeline-{}-{inputs}.toml",
        std::process::id()
    ));
    std::fs::write(
        &config,
        format!(
            "dataset = \"synthetic\"\n[synthetic]\ninputs = {inputs}\nclasses = 10\n\
             hidden = 64\ntrain = 65536\ntest = 256\n"
        ),
    )
    .map_err(|e| ExperimentError::Config(format!("writing {}: {e}", config.display())))?;
    let mut train = std::process::Command::new(pipe);
    train
        .arg("train")
        .arg("--config")
        .arg(&config)
        .args(["--model", ctx.preset, "--epochs", "1"])
        .args(["--stages", &case.stages.to_string()])
        .args(["--replicas", &case.replicas.to_string()])
        .args(["--schedule", case.policy.name()])
        .args(["--partition", &partition.to_string()])
        .args(["--microbatch-size", &case.microbatch.to_string()])
        .args(["--microbatches", &case.m.to_string()])
        .args([
            "--steps",
            &updates.to_string(),
            "--threads",
            "1",
            "--lr",
            "0.001",
        ])
        .args(["--placement", "processes", "--transport", "shm"]);
    // Bucket sizes apply to replicated stages only: `pipe train` refuses them elsewhere.
    if case.replicas > 1 {
        train.args(["--allreduce-bucket-mb", &buckets]);
    }
    let out = train
        .output()
        .map_err(|e| ExperimentError::Config(format!("starting pipe train: {e}")))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(ExperimentError::Config(format!(
            "{}: pipe train failed: {}",
            case.name,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let rate = crate::chief_samples_per_s(&text, None).ok_or_else(|| {
        ExperimentError::Config(format!(
            "{}: no samples/s in pipe train's output",
            case.name
        ))
    })?;
    let minibatch = u64::from(case.m) * u64::from(case.replicas) * case.microbatch as u64;
    let samples = (u64::from(updates) * minibatch) as f64;
    Ok((samples, samples / rate))
}

fn model_cases(preset: &str, batch: usize, m: u32, processes: bool) -> Vec<Case> {
    let micro = batch / m as usize;
    let case = |name: &str, policy: Policy, replicas: u32| Case {
        name: format!("{preset} {name}"),
        policy,
        stages: 4,
        replicas,
        microbatch: micro,
        m: m / replicas,
        replica_counts: None,
        partition: None,
        bucket_size: None,
        stage_buckets: None,
        processes: false,
    };
    // The same replicated run with each stage's gradients in one bucket: what overlapping
    // the all-reduce with the backward pass gains, against the sizes chosen per stage.
    let one_bucket = Case {
        bucket_size: Some(BucketSize::Whole),
        ..case(
            "--stages 4 --replicas 2 pipedream, one bucket",
            Policy::PipeDream,
            2,
        )
    };
    let threads = vec![
        case("--stages 4 1f1b-flush", Policy::OneFOneBFlush, 1),
        case("--stages 4 pipedream", Policy::PipeDream, 1),
        case(
            "--stages 4 --replicas 2 pipedream, chosen buckets",
            Policy::PipeDream,
            2,
        ),
        one_bucket,
    ];
    let in_processes: Vec<Case> = threads
        .iter()
        .map(|c| Case {
            name: format!("{}, worker processes", c.name),
            processes: true,
            ..c.clone()
        })
        .collect();
    let mut all = threads;
    if processes {
        all.extend(in_processes);
    }
    all
}

/// Executor overhead per action: the executor runs `sequential` on one worker with a backend
/// that times every kernel call; the run's wall time minus its kernel time, over its actions, is
/// what interpreting the schedule costs (version maps, hand-offs, data gathering, timing, the
/// thread start). Median of five runs.
fn overhead(model: &Model, batch: usize, m: u32, updates: u32) -> Result<f64, ExperimentError> {
    let micro = batch / m as usize;
    let case = Case::sequential(micro, m);
    let mut states = Vec::new();
    pipelined(model, &case, updates, &mut states)?;
    let mut per_action = Vec::new();
    for _ in 0..5 {
        let counter = Arc::new(AtomicU64::new(0));
        let t = Instant::now();
        let (_, outs, _) = pipelined_with(model, &case, updates, &mut states, |_| {
            Ok(Timed::new(CpuBackend::new(1)?, Arc::clone(&counter)))
        })?;
        let wall = t.elapsed().as_secs_f64();
        let kernels = counter.load(Ordering::Relaxed) as f64 * 1e-9;
        let actions: usize = outs.iter().map(|o| o.spans.len()).sum();
        per_action.push((wall - kernels) / actions as f64 * 1e6);
    }
    Ok(median(&per_action))
}

/// Ping-pong between two threads over the in-process transport ([`crate::link`]).
fn transport_cost() -> Result<LinkCost, ExperimentError> {
    pipe_transport::measure::measure_mesh(mesh(2, &InProcOptions::default()), 2000)
        .map_err(ExperimentError::from)
}

/// One round of one model: the single worker, the one-thread sequential run (which also gives
/// the simulator its per-stage costs) and every pipelined case, back to back.
fn model_round(
    model: &Model,
    preset: &str,
    batch: usize,
    m: u32,
    cfg: &PipelineBenchConfig,
    (message, shm): (&LinkCost, &Link),
) -> Result<ModelResult, ExperimentError> {
    let single = single_worker(model, batch, cfg.updates, cfg.warmup)?;
    let one = Case::sequential(batch / m as usize, m);
    let mut states = Vec::new();
    pipelined(model, &one, cfg.warmup.max(1), &mut states)?;
    let (one_core, _, _) = pipelined(model, &one, cfg.updates, &mut states)?;
    let base = contended_costs(model, &one, cfg.updates, &mut states)?;
    let profile_opts = pipe_stages::profile::ProfileOptions {
        warmup: 2,
        repeats: 5,
        calibrate: None,
        ..pipe_stages::profile::ProfileOptions::new(one.microbatch)
    };
    let ctx = ModelContext {
        model,
        preset,
        base,
        profile: pipe_stages::profile::profile_model(
            model,
            preset,
            &CpuBackend::new(1)?,
            &profile_opts,
        )?,
        // Every in-process message is delayed by the measured one-way ping-pong time and
        // costs its sender and its receiver the ping-pong's measured processor time per
        // message end; worker processes' messages, shared memory's measured costs.
        inproc: Link {
            bandwidth: f64::INFINITY,
            latency: message.latency_s,
            message_cpu: message.cpu_s,
            byte_cpu: 0.0,
        },
        shm: *shm,
    };
    let mut cases = Vec::new();
    for case in model_cases(preset, batch, m, cfg.pipe.is_some()) {
        cases.push(run_case(&ctx, &case, cfg, (single, one_core))?);
    }
    Ok(ModelResult {
        model: preset.into(),
        batch,
        single_samples_per_s: single,
        one_core_samples_per_s: one_core,
        cases,
    })
}

/// Medians over rounds of every figure and every (within-round) ratio.
fn combine(rounds: &[ModelResult]) -> ModelResult {
    let med = |f: &dyn Fn(&ModelResult) -> f64| median(&rounds.iter().map(f).collect::<Vec<_>>());
    let first = &rounds[0];
    let cases = (0..first.cases.len())
        .map(|i| {
            let at = |f: fn(&CaseResult) -> f64| med(&|r: &ModelResult| f(&r.cases[i]));
            CaseResult {
                case: first.cases[i].case.clone(),
                samples_per_s: at(|c| c.samples_per_s),
                ratio_to_single: at(|c| c.ratio_to_single),
                core_scaling: at(|c| c.core_scaling),
                simulated_samples_per_s: at(|c| c.simulated_samples_per_s),
                measured_over_simulated: at(|c| c.measured_over_simulated),
            }
        })
        .collect();
    ModelResult {
        model: first.model.clone(),
        batch: first.batch,
        single_samples_per_s: med(&|r| r.single_samples_per_s),
        one_core_samples_per_s: med(&|r| r.one_core_samples_per_s),
        cases,
    }
}

/// Runs the benchmark.
///
/// # Errors
/// Model, schedule or worker failures.
pub fn run(cfg: &PipelineBenchConfig) -> Result<PipelineReport, ExperimentError> {
    let message = transport_cost()?;
    let (costs, _) = pipe_stages::planning::link_costs::load_or_measure(false)?;
    let shm = costs
        .get("shm")
        .map(pipe_scheduler::planner::transport::TransportCost::link)
        .ok_or_else(|| ExperimentError::Config("no shared-memory costs were measured".into()))?;
    let mut models = Vec::new();
    let mut list = vec![("mlp-256-256x8-10", 64usize, 8u32)];
    if !cfg.small_only {
        list.insert(0, ("mlp-784-1024x16-10", 256, 8));
    }
    for &(preset, batch, m) in &list {
        let model = Model::new(&ModelSpec::preset(preset)?)?;
        let rounds = (0..cfg.rounds.max(1))
            .map(|_| model_round(&model, preset, batch, m, cfg, (&message, &shm)))
            .collect::<Result<Vec<_>, _>>()?;
        models.push(combine(&rounds));
    }
    let small = Model::new(&ModelSpec::preset("mlp-256-256x8-10")?)?;
    let overhead_us_per_action = overhead(&small, 64, 8, cfg.updates.max(10))?;
    // The replicated stage of the `--stages 4 --replicas 2` case of the first model.
    let (preset, _, _) = list[0];
    let model = Model::new(&ModelSpec::preset(preset)?)?;
    let partition = Partition::balanced(&model, &[2; 4])?;
    let all_reduce = all_reduce_against_ring(
        format!("{preset}, stage 1 of 4 (layers {:?})", partition.range(1)),
        &model.zero_grads(partition.range(1)),
    )?;
    Ok(PipelineReport {
        models,
        overhead_us_per_action,
        transport_us_per_message: message.latency_s * 1e6,
        transport_cpu_us_per_message: message.cpu_s * 1e6,
        all_reduce,
        updates: cfg.updates,
        rounds: cfg.rounds.max(1),
    })
}

/// A Markdown table of the report.
pub fn render(r: &PipelineReport) -> String {
    let mut out = format!(
        "medians over {} round(s); ratios taken within each round\n\n",
        r.rounds
    );
    for m in &r.models {
        out.push_str(&format!(
            "{}, batch {}: single worker (2 threads, one microbatch of {}) {:.0} samples/s; \
             one worker with one thread at the pipelines' microbatch size {:.0} samples/s\n\n\
             | case | samples/s | / single | / (2 x one thread) | simulated | measured / simulated |\n\
             |---|---|---|---|---|---|\n",
            m.model, m.batch, m.batch, m.single_samples_per_s, m.one_core_samples_per_s
        ));
        for c in &m.cases {
            out.push_str(&format!(
                "| {} ({} x {}, M={}) | {:.0} | {:.2} | {:.2} | {:.0} | {:.2} |\n",
                c.case.name.trim_start_matches(&m.model).trim(),
                c.case.m * c.case.replicas,
                c.case.microbatch,
                c.case.m,
                c.samples_per_s,
                c.ratio_to_single,
                c.core_scaling,
                c.simulated_samples_per_s,
                c.measured_over_simulated
            ));
        }
        out.push('\n');
    }
    out.push_str(&format!(
        "executor overhead per action: {:.1} us (wall time minus kernel time, sequential on one worker)\n\
         in-process transport: {:.1} us per message one way, {:.1} us of processor time at each end (ping-pong)\n",
        r.overhead_us_per_action, r.transport_us_per_message, r.transport_cpu_us_per_message
    ));
    let a = &r.all_reduce;
    out.push_str(&format!(
        "all-reduce, 2 replicas, {} ({} tensors, {} values): executor {:.3} ms, bare ring on one \
         flat buffer {:.3} ms, executor / bare ring {:.2}; flattening around the ring (the \
         earlier executor) {:.3} ms, {:.2}x the bare ring\n",
        a.what,
        a.tensors,
        a.values,
        a.executor_s * 1e3,
        a.bare_ring_s * 1e3,
        a.ratio,
        a.flattened_s * 1e3,
        a.flattened_s / a.bare_ring_s
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_bench_reports_consistent_numbers() {
        let r = run(&PipelineBenchConfig {
            updates: 3,
            warmup: 1,
            small_only: true,
            rounds: 1,
            pipe: None,
        })
        .unwrap();
        assert_eq!(r.models.len(), 1);
        for c in &r.models[0].cases {
            assert!(
                c.samples_per_s > 0.0 && c.simulated_samples_per_s > 0.0,
                "{c:?}"
            );
            assert!(
                (c.ratio_to_single - c.samples_per_s / r.models[0].single_samples_per_s).abs()
                    < 1e-9
            );
        }
        assert!(r.transport_us_per_message > 0.0);
        assert!(r.all_reduce.executor_s > 0.0 && r.all_reduce.bare_ring_s > 0.0);
        assert!(r.overhead_us_per_action.is_finite());
    }

    #[test]
    fn a_pair_of_runs_gives_a_rate_only_when_the_longer_took_longer() {
        assert_eq!(difference_rate((6.0, 1.0), (30.0, 3.0)), Some(12.0));
        // Noise larger than the timed updates: the longer run finished first.
        assert_eq!(difference_rate((6.0, 1.2), (30.0, 1.1)), None);
        assert_eq!(difference_rate((6.0, 1.0), (30.0, 1.0)), None);
        assert_eq!(difference_rate((6.0, 1.0), (6.0, 2.0)), None);
        assert_eq!(difference_rate((6.0, 1.0), (30.0, f64::NAN)), None);
    }

    #[test]
    fn rounds_combine_into_medians_of_figures_and_of_ratios() {
        let round = |single: f64, measured: f64| ModelResult {
            model: "m".into(),
            batch: 8,
            single_samples_per_s: single,
            one_core_samples_per_s: single / 2.0,
            cases: vec![CaseResult {
                case: Case {
                    name: "c".into(),
                    policy: Policy::PipeDream,
                    stages: 2,
                    replicas: 1,
                    microbatch: 4,
                    m: 2,
                    replica_counts: None,
                    partition: None,
                    bucket_size: None,
                    stage_buckets: None,
                    processes: false,
                },
                samples_per_s: measured,
                ratio_to_single: measured / single,
                core_scaling: measured / single,
                simulated_samples_per_s: 2.0 * measured,
                measured_over_simulated: 0.5,
            }],
        };
        // A slow round (both sides slow) must not drag the ratio: ratios 0.5, 0.5, 0.9.
        let c = combine(&[round(100.0, 50.0), round(40.0, 20.0), round(100.0, 90.0)]);
        assert_eq!(c.single_samples_per_s, 100.0);
        assert_eq!(c.cases[0].samples_per_s, 50.0);
        assert_eq!(c.cases[0].ratio_to_single, 0.5);
        assert_eq!(c.cases[0].simulated_samples_per_s, 100.0);
    }
}
