//! The discrete-event simulator and the untimed dry run, one engine for both.
//!
//! Every worker runs its program in order on its own clock. Compute actions take their cost;
//! a send puts a message on the directed link to its peer (links are serialised per sender and
//! receiver; a message takes `latency + bytes / bandwidth`, and with `overlap = false` the sender
//! is busy until it lands); a receive waits until its message has arrived; a collective
//! all-reduce starts when the last replica reaches it and costs `2(r-1)/r * P / bandwidth +
//! 2(r-1) * latency` (ring all-reduce of `P` gradient bytes among `r` replicas); expanded ring
//! steps move `P / r` bytes each. Workers are advanced one at a time until they block; since a
//! worker's timing depends only on its own program and on message arrival times, the order in
//! which blocked workers are resumed does not change any result. If every unfinished worker is
//! blocked, the schedule deadlocks.
//!
//! Messages are identified by a dense index computed from the action itself (boundary, kind,
//! microbatch), so the engine needs no maps: it scales to a thousand workers and ten thousand
//! microbatches in well under a second.

use serde::{Deserialize, Serialize};

use crate::action::{Action, WorkerId};
use crate::error::{Result, ScheduleError};
use crate::grid;
use crate::lower::{LowerOptions, lower};
use crate::plan::{MemoryPeak, VersionPlan};
use crate::spec::Schedule;
use crate::timeline::{Span, Timeline};

/// Costs of one stage. Times are in seconds, sizes in bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageCost {
    /// Forward time per microbatch.
    #[serde(default)]
    pub forward: f64,
    /// Input-gradient half of the backward, per microbatch.
    #[serde(default)]
    pub backward_input: f64,
    /// Weight-gradient half of the backward, per microbatch. A fused backward costs
    /// `backward_input + backward_weight`.
    #[serde(default)]
    pub backward_weight: f64,
    /// Optimizer step time.
    #[serde(default)]
    pub update: f64,
    /// Bytes of the stage's output activation per microbatch (sent to the next stage).
    #[serde(default)]
    pub activation_bytes: f64,
    /// Bytes of the gradient sent back to this stage from the next one (default: the same as
    /// `activation_bytes`, which it is unless the wire compresses one of them).
    #[serde(default)]
    pub gradient_bytes: Option<f64>,
    /// Bytes of one weight version (also the gradient bytes an all-reduce moves).
    #[serde(default)]
    pub param_bytes: f64,
    /// Bytes the stage keeps per in-flight microbatch for its backward (default:
    /// `activation_bytes`).
    #[serde(default)]
    pub stash_bytes: Option<f64>,
}

impl StageCost {
    /// A stage with the given forward and fused backward times, the backward split evenly into
    /// its input and weight halves, and nothing else.
    pub fn compute(forward: f64, backward: f64) -> Self {
        StageCost {
            forward,
            backward_input: backward / 2.0,
            backward_weight: backward / 2.0,
            update: 0.0,
            activation_bytes: 0.0,
            gradient_bytes: None,
            param_bytes: 0.0,
            stash_bytes: None,
        }
    }

    /// The stage made of consecutive layers: times and parameter and stash bytes add up; the
    /// output activation and incoming gradient are the last layer's.
    pub fn merge(layers: &[StageCost]) -> Self {
        let mut out = StageCost::compute(0.0, 0.0);
        for l in layers {
            out.forward += l.forward;
            out.backward_input += l.backward_input;
            out.backward_weight += l.backward_weight;
            out.update += l.update;
            out.param_bytes += l.param_bytes;
            out.stash_bytes = Some(out.stash_bytes.unwrap_or(0.0) + l.stash());
        }
        if let Some(last) = layers.last() {
            out.activation_bytes = last.activation_bytes;
            out.gradient_bytes = last.gradient_bytes;
        }
        out
    }

    fn gradient(&self) -> f64 {
        self.gradient_bytes.unwrap_or(self.activation_bytes)
    }

    fn stash(&self) -> f64 {
        self.stash_bytes.unwrap_or(self.activation_bytes)
    }

    fn check(&self, which: usize) -> Result<()> {
        let fields = [
            ("forward", self.forward),
            ("backward_input", self.backward_input),
            ("backward_weight", self.backward_weight),
            ("update", self.update),
            ("activation_bytes", self.activation_bytes),
            ("gradient_bytes", self.gradient()),
            ("param_bytes", self.param_bytes),
            ("stash_bytes", self.stash()),
        ];
        for (name, v) in fields {
            if !v.is_finite() || v < 0.0 {
                return Err(ScheduleError::Cost(format!(
                    "stage {which}: {name} must be a finite number >= 0, got {v}"
                )));
            }
        }
        Ok(())
    }
}

fn infinite() -> f64 {
    f64::INFINITY
}

fn yes() -> bool {
    true
}

/// A cost model: per-stage costs and one link model for every pair of workers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostModel {
    /// One entry per model stage, or a single entry used for every stage.
    #[serde(rename = "stage")]
    pub stages: Vec<StageCost>,
    /// Link bandwidth in bytes per second (default: infinite).
    #[serde(default = "infinite")]
    pub bandwidth: f64,
    /// Link latency in seconds per message (default 0).
    #[serde(default)]
    pub latency: f64,
    /// Whether sends overlap compute (default true). When false, a sender waits until its
    /// message has landed.
    #[serde(default = "yes")]
    pub overlap: bool,
}

impl CostModel {
    /// Every stage costs the same; infinitely fast links.
    pub fn uniform(stage: StageCost) -> Self {
        CostModel {
            stages: vec![stage],
            bandwidth: f64::INFINITY,
            latency: 0.0,
            overlap: true,
        }
    }

    /// Stages made of consecutive layers: `cuts` lists the first layer of every stage after
    /// the first (like `--partition`'s boundaries).
    ///
    /// # Errors
    /// [`ScheduleError::Cost`] when the cuts are not increasing or leave a stage empty.
    pub fn from_layers(layers: &[StageCost], cuts: &[usize]) -> Result<Self> {
        let mut stages = Vec::with_capacity(cuts.len() + 1);
        let mut start = 0;
        for &end in cuts.iter().chain(std::iter::once(&layers.len())) {
            if end <= start || end > layers.len() {
                return Err(ScheduleError::Cost(format!(
                    "cut at layer {end} leaves an empty stage or runs past {} layers",
                    layers.len()
                )));
            }
            stages.push(StageCost::merge(&layers[start..end]));
            start = end;
        }
        Ok(CostModel {
            stages,
            ..CostModel::uniform(StageCost::compute(0.0, 0.0))
        })
    }

    /// Costs of `stage`.
    pub fn stage(&self, stage: u32) -> &StageCost {
        if self.stages.len() == 1 {
            &self.stages[0]
        } else {
            &self.stages[stage as usize]
        }
    }

    /// Checks the values and that there is one entry or one per stage.
    ///
    /// # Errors
    /// [`ScheduleError::Cost`] naming the bad value.
    pub fn check(&self, stages: u32) -> Result<()> {
        if self.stages.len() != 1 && self.stages.len() != stages as usize {
            return Err(ScheduleError::Cost(format!(
                "{} stage entries for {stages} stages (give one, or one per stage)",
                self.stages.len()
            )));
        }
        for (i, s) in self.stages.iter().enumerate() {
            s.check(i)?;
        }
        if self.bandwidth.is_nan() || self.bandwidth <= 0.0 {
            return Err(ScheduleError::Cost(format!(
                "bandwidth must be > 0 bytes/s, got {}",
                self.bandwidth
            )));
        }
        if !self.latency.is_finite() || self.latency < 0.0 {
            return Err(ScheduleError::Cost(format!(
                "latency must be a finite number >= 0, got {}",
                self.latency
            )));
        }
        Ok(())
    }

    fn transfer(&self, bytes: f64) -> f64 {
        bytes / self.bandwidth
    }
}

/// What to record while simulating.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimOptions {
    /// Keep every action's start and end (for traces); costs memory on big schedules.
    pub timeline: bool,
}

/// Per-worker results.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct WorkerReport {
    /// Seconds spent in forward, backward and update actions.
    pub compute: f64,
    /// Seconds spent communicating without overlap (all-reduce; sends when `overlap` is off).
    pub communication: f64,
    /// Seconds neither computing nor communicating, up to the makespan.
    pub idle: f64,
    /// Peak memory.
    pub memory: MemoryPeak,
    /// Most weight versions held at once.
    pub peak_versions: u32,
    /// Most microbatches' activations held at once.
    pub peak_activations: u32,
}

/// The result of a simulation.
#[derive(Clone, Debug, PartialEq)]
pub struct SimReport {
    /// Time from the first action to the last, in seconds.
    pub makespan: f64,
    /// Microbatches in the run.
    pub microbatches: u32,
    /// Microbatches per second.
    pub throughput: f64,
    /// Idle share of all workers' time: `sum idle / (workers * makespan)`.
    pub bubble_fraction: f64,
    /// Per worker.
    pub workers: Vec<WorkerReport>,
    /// Every action's interval, when asked for.
    pub timeline: Option<Timeline>,
}

/// Simulates a schedule under a cost model (lowering it first if needed, with collective
/// all-reduces).
///
/// # Errors
/// [`ScheduleError::Cost`] for a bad cost model, [`ScheduleError::Invalid`] from the version
/// plan, [`ScheduleError::Deadlock`] if the programs cannot finish.
pub fn simulate(schedule: &Schedule, costs: &CostModel, opts: SimOptions) -> Result<SimReport> {
    costs.check(schedule.stages())?;
    let lowered;
    let schedule = if schedule.lowered {
        schedule
    } else {
        lowered = lower(schedule, LowerOptions::default());
        &lowered
    };
    let (plan, memory) = VersionPlan::derive_with_memory(
        schedule,
        |s| costs.stage(s).param_bytes,
        |s| costs.stage(s).stash(),
    )?;
    let mut engine = Engine::new(schedule, Some(costs), opts.timeline);
    engine.run()?;
    let makespan = engine.clock.iter().copied().fold(0.0, f64::max);
    let workers: Vec<WorkerReport> = (0..schedule.workers() as usize)
        .map(|w| WorkerReport {
            compute: engine.compute[w],
            communication: engine.comm[w],
            idle: (makespan - engine.compute[w] - engine.comm[w]).max(0.0),
            memory: memory[w],
            peak_versions: plan.peak_versions[w],
            peak_activations: plan.peak_activations[w],
        })
        .collect();
    let idle: f64 = workers.iter().map(|w| w.idle).sum();
    let n = schedule.total_microbatches();
    Ok(SimReport {
        makespan,
        microbatches: n,
        throughput: if makespan > 0.0 {
            f64::from(n) / makespan
        } else {
            f64::INFINITY
        },
        bubble_fraction: if makespan > 0.0 {
            idle / (f64::from(schedule.workers()) * makespan)
        } else {
            0.0
        },
        timeline: engine
            .spans
            .map(|spans| Timeline::new(schedule.workers(), spans)),
        workers,
    })
}

/// The untimed dry run (see [`crate::validate::dry_run`]).
pub(crate) fn run_untimed(schedule: &Schedule) -> Result<()> {
    Engine::new(schedule, None, false).run()
}

#[derive(Clone, Copy, PartialEq)]
enum Wait {
    Nothing,
    Message(usize),
    Group(usize),
}

struct Engine<'a> {
    schedule: &'a Schedule,
    costs: Option<&'a CostModel>,
    n: usize,
    stages: usize,
    chunk_base: usize,
    chunk_offset: Vec<usize>,
    group_offset: Vec<usize>,
    pc: Vec<usize>,
    clock: Vec<f64>,
    compute: Vec<f64>,
    comm: Vec<f64>,
    wait: Vec<Wait>,
    arrival: Vec<f64>,
    group_count: Vec<u32>,
    group_start: Vec<f64>,
    links: Vec<Vec<(WorkerId, f64)>>,
    spans: Option<Vec<Span>>,
}

impl<'a> Engine<'a> {
    fn new(schedule: &'a Schedule, costs: Option<&'a CostModel>, record: bool) -> Self {
        let layout = schedule.layout();
        let n = schedule.total_microbatches() as usize;
        let stages = schedule.stages() as usize;
        let mut chunk_offset = Vec::with_capacity(stages);
        let mut group_offset = Vec::with_capacity(stages);
        let (mut chunks, mut groups) = (0usize, 0usize);
        for s in 0..stages as u32 {
            let r = layout.replicas_of(s) as usize;
            let k = schedule.resolved.updates_at(s) as usize;
            chunk_offset.push(chunks);
            group_offset.push(groups);
            if r > 1 {
                chunks += k * r * 2 * (r - 1);
                groups += k;
            }
        }
        let chunk_base = 2 * stages.saturating_sub(1) * n;
        let workers = schedule.workers() as usize;
        Engine {
            schedule,
            costs,
            n,
            stages,
            chunk_base,
            chunk_offset,
            group_offset,
            pc: vec![0; workers],
            clock: vec![0.0; workers],
            compute: vec![0.0; workers],
            comm: vec![0.0; workers],
            wait: vec![Wait::Nothing; workers],
            arrival: vec![f64::NAN; chunk_base + chunks],
            group_count: vec![0; groups],
            group_start: vec![0.0; groups],
            links: vec![Vec::new(); workers],
            spans: record.then(Vec::new),
        }
    }

    /// Dense index of the message a send or receive moves.
    fn message(&self, w: WorkerId, a: &Action) -> usize {
        let n = self.n;
        let grads = self.stages - 1;
        match *a {
            Action::SendActivation { stage, mb, .. } => stage as usize * n + mb as usize,
            Action::RecvActivation { stage, mb, .. } => (stage as usize - 1) * n + mb as usize,
            Action::SendGradient { stage, mb, .. } => {
                (grads + stage as usize - 1) * n + mb as usize
            }
            Action::RecvGradient { stage, mb, .. } => (grads + stage as usize) * n + mb as usize,
            Action::SendChunk {
                stage,
                update,
                step,
                ..
            }
            | Action::RecvChunk {
                stage,
                update,
                step,
                ..
            } => {
                let group = self.schedule.layout().group(stage);
                let r = (group.end - group.start) as usize;
                let sender = match *a {
                    Action::SendChunk { .. } => w,
                    _ => a.peer().unwrap_or(w),
                };
                let j = (sender - group.start) as usize;
                let steps = 2 * (r - 1);
                self.chunk_base
                    + self.chunk_offset[stage as usize]
                    + (update as usize * r + j) * steps
                    + step as usize
            }
            _ => usize::MAX,
        }
    }

    fn record(&mut self, worker: WorkerId, action: Action, start: f64, end: f64) {
        if let Some(spans) = &mut self.spans {
            spans.push(Span {
                worker,
                action,
                start,
                end,
            });
        }
    }

    fn run(&mut self) -> Result<()> {
        let workers = self.schedule.workers();
        let times = stage_times(self.schedule, self.costs);
        let mut ready: Vec<WorkerId> = (0..workers).rev().collect();
        while let Some(w) = ready.pop() {
            self.advance(w, &mut ready, &times);
        }
        let blocked: Vec<(WorkerId, usize)> = (0..workers)
            .filter(|&w| self.pc[w as usize] < self.schedule.programs[w as usize].len())
            .map(|w| (w, self.pc[w as usize]))
            .collect();
        if blocked.is_empty() {
            return Ok(());
        }
        let shown: Vec<(WorkerId, usize)> = blocked.iter().take(16).copied().collect();
        let reason = format!(
            "{} of {workers} workers cannot go on ({}{})",
            blocked.len(),
            shown
                .iter()
                .map(|&(w, pc)| format!("w{w} waits at {}", self.schedule.programs[w as usize][pc]))
                .collect::<Vec<_>>()
                .join(", "),
            if blocked.len() > shown.len() {
                ", ..."
            } else {
                ""
            }
        );
        Err(ScheduleError::Deadlock {
            reason,
            grid: grid::blocked(self.schedule, &shown),
        })
    }

    /// Runs worker `w` until it blocks or finishes; wakes the workers it unblocks. The hot loop
    /// keeps the worker's position and clock in locals and reads per-stage times from a table.
    fn advance(&mut self, w: WorkerId, ready: &mut Vec<WorkerId>, times: &[StageTimes]) {
        let wi = w as usize;
        let schedule: &'a Schedule = self.schedule;
        let prog = &schedule.programs[wi];
        let layout = schedule.layout();
        let (latency, overlap) = self.costs.map_or((0.0, true), |c| (c.latency, c.overlap));
        let mut pc = self.pc[wi];
        let mut clock = self.clock[wi];
        let mut compute = 0.0;
        let mut comm = 0.0;
        while let Some(&a) = prog.get(pc) {
            let t = &times[a.stage() as usize];
            match a {
                Action::Forward { .. }
                | Action::Backward { .. }
                | Action::BackwardInput { .. }
                | Action::BackwardWeight { .. }
                | Action::Update { .. } => {
                    let d = t.compute(&a);
                    self.record(w, a, clock, clock + d);
                    clock += d;
                    compute += d;
                }
                Action::SendActivation { to, .. }
                | Action::SendGradient { to, .. }
                | Action::SendChunk { to, .. } => {
                    let id = self.message(w, &a);
                    let busy = match a {
                        Action::SendActivation { .. } => t.activation_transfer,
                        Action::SendGradient { .. } => t.gradient_transfer,
                        _ => t.chunk_transfer,
                    };
                    let link = match self.links[wi].iter().position(|&(p, _)| p == to) {
                        Some(i) => i,
                        None => {
                            self.links[wi].push((to, 0.0));
                            self.links[wi].len() - 1
                        }
                    };
                    let begin = clock.max(self.links[wi][link].1);
                    self.links[wi][link].1 = begin + busy;
                    let arrive = begin + busy + latency;
                    let start = clock;
                    if !overlap {
                        comm += arrive - clock;
                        clock = arrive;
                    }
                    self.arrival[id] = arrive;
                    self.record(w, a, start, clock);
                    if self.wait[to as usize] == Wait::Message(id) {
                        self.wait[to as usize] = Wait::Nothing;
                        ready.push(to);
                    }
                }
                Action::RecvActivation { .. }
                | Action::RecvGradient { .. }
                | Action::RecvChunk { .. } => {
                    let id = self.message(w, &a);
                    let arrived = self.arrival[id];
                    if arrived.is_nan() {
                        self.wait[wi] = Wait::Message(id);
                        break;
                    }
                    let start = clock;
                    clock = clock.max(arrived);
                    self.record(w, a, start, clock);
                }
                Action::AllReduce { stage, update } => {
                    let gid = self.group_offset[stage as usize] + update as usize;
                    self.group_count[gid] += 1;
                    self.group_start[gid] = self.group_start[gid].max(clock);
                    let group = layout.group(stage);
                    if self.group_count[gid] < group.end - group.start {
                        self.wait[wi] = Wait::Group(gid);
                        break;
                    }
                    let begin = self.group_start[gid];
                    let end = begin + t.all_reduce;
                    for m in group {
                        let mi = m as usize;
                        self.record(m, a, begin, end);
                        if m != w {
                            self.comm[mi] += t.all_reduce;
                            self.clock[mi] = end;
                            self.pc[mi] += 1;
                            self.wait[mi] = Wait::Nothing;
                            ready.push(m);
                        }
                    }
                    comm += t.all_reduce;
                    clock = end;
                }
            }
            pc += 1;
        }
        self.pc[wi] = pc;
        self.clock[wi] = clock;
        self.compute[wi] += compute;
        self.comm[wi] += comm;
    }
}

/// Per-stage times the engine reads for every action (all zero for the dry run).
#[derive(Clone, Copy, Default)]
struct StageTimes {
    forward: f64,
    backward: f64,
    backward_input: f64,
    backward_weight: f64,
    update: f64,
    /// Link time of this stage's output activation.
    activation_transfer: f64,
    /// Link time of the gradient this stage sends back (sized by the previous stage).
    gradient_transfer: f64,
    /// Link time of one ring all-reduce chunk (`P / r`).
    chunk_transfer: f64,
    /// Whole collective all-reduce: `2(r-1)/r * P / bandwidth + 2(r-1) * latency`.
    all_reduce: f64,
}

impl StageTimes {
    /// Duration of a compute or update action (0 for anything else).
    fn compute(&self, a: &Action) -> f64 {
        match a {
            Action::Forward { .. } => self.forward,
            Action::Backward { .. } => self.backward,
            Action::BackwardInput { .. } => self.backward_input,
            Action::BackwardWeight { .. } => self.backward_weight,
            Action::Update { .. } => self.update,
            _ => 0.0,
        }
    }
}

fn stage_times(schedule: &Schedule, costs: Option<&CostModel>) -> Vec<StageTimes> {
    let layout = schedule.layout();
    (0..schedule.stages())
        .map(|s| {
            let Some(c) = costs else {
                return StageTimes::default();
            };
            let st = c.stage(s);
            let r = f64::from(layout.replicas_of(s));
            StageTimes {
                forward: st.forward,
                backward: st.backward_input + st.backward_weight,
                backward_input: st.backward_input,
                backward_weight: st.backward_weight,
                update: st.update,
                activation_transfer: c.transfer(st.activation_bytes),
                gradient_transfer: if s > 0 {
                    c.transfer(c.stage(s - 1).gradient())
                } else {
                    0.0
                },
                chunk_transfer: c.transfer(st.param_bytes / r),
                all_reduce: if r > 1.0 {
                    2.0 * (r - 1.0) / r * c.transfer(st.param_bytes) + 2.0 * (r - 1.0) * c.latency
                } else {
                    0.0
                },
            }
        })
        .collect()
}
