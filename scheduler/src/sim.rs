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
//! With fewer cores than workers (`CostModel::cores`), a second engine keeps one global clock
//! and shares the cores fairly: while `n` workers compute on `c < n` cores, each advances at
//! `c / n` of its speed (processor sharing, the limit of an operating system's fair scheduler
//! with short time slices). Its cost is `O(actions x workers)`, fine for the sizes that do run
//! on one machine; with a core per worker it times every action exactly as the first engine
//! (a unit test checks both on every policy).
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
    /// Seconds one all-reduce of this stage's gradients takes among its replicas, when measured
    /// (default: from the link, `2(r-1)/r * param_bytes / bandwidth + 2(r-1) * latency`). An
    /// in-process all-reduce moves buffers for free but spends time adding them.
    #[serde(default)]
    pub all_reduce: Option<f64>,
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
            all_reduce: None,
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
            ("all_reduce", self.all_reduce.unwrap_or(0.0)),
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
    /// Cores the workers share (default: one per worker). With fewer cores than workers, the
    /// simulator shares them fairly: while `n` workers compute on `c < n` cores, each advances
    /// at `c / n` of its speed (processor sharing, as threads on an operating system's fair
    /// scheduler). Costs are then the times of actions running alone.
    #[serde(default)]
    pub cores: Option<u32>,
}

impl CostModel {
    /// Every stage costs the same; infinitely fast links.
    pub fn uniform(stage: StageCost) -> Self {
        CostModel {
            stages: vec![stage],
            bandwidth: f64::INFINITY,
            latency: 0.0,
            overlap: true,
            cores: None,
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
        if self.cores == Some(0) {
            return Err(ScheduleError::Cost("cores must be at least 1".into()));
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
    match costs.cores {
        Some(c) if c < schedule.workers() => engine.run_shared(f64::from(c))?,
        _ => engine.run()?,
    }
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

/// What a worker is doing in the shared-core engine.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Busy {
    /// About to interpret its next action.
    Ready,
    /// Computing (or doing its share of a collective) with `left` seconds of work to go.
    Work { left: f64, start: f64 },
    /// Waiting for a message in flight, or for its own send to land, until `until`.
    Sleep { until: f64, start: f64 },
    /// Waiting for a message not yet sent, or for a collective's other members.
    Blocked,
    /// Finished its program.
    Done,
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
        self.finished()
    }

    /// `Ok` when every worker ran its whole program, else the deadlock naming who waits where.
    fn finished(&self) -> Result<()> {
        let workers = self.schedule.workers();
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

    /// Puts the message of send `a` from `w` to `to` on their link at `clock`: returns the
    /// message's index and when it lands (the link is busy until then, less the latency).
    fn post(
        &mut self,
        w: WorkerId,
        a: &Action,
        to: WorkerId,
        t: &StageTimes,
        clock: f64,
        latency: f64,
    ) -> (usize, f64) {
        let wi = w as usize;
        let id = self.message(w, a);
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
        self.arrival[id] = arrive;
        (id, arrive)
    }

    /// The engine for fewer cores than workers: one global clock; between events every
    /// computing worker advances at `min(1, cores / computing)` of its speed. Costs
    /// `O(actions x workers)`, so it is meant for the sizes a machine actually runs.
    fn run_shared(&mut self, cores: f64) -> Result<()> {
        let workers = self.schedule.workers() as usize;
        let times = stage_times(self.schedule, self.costs);
        let mut state = vec![Busy::Ready; workers];
        let mut group_left = vec![0u32; self.group_count.len()];
        let mut ready: Vec<usize> = (0..workers).rev().collect();
        let mut now = 0.0f64;
        loop {
            while let Some(w) = ready.pop() {
                self.step_shared(w, now, &mut state, &mut ready, &times, &mut group_left);
            }
            let computing = state
                .iter()
                .filter(|b| matches!(b, Busy::Work { .. }))
                .count();
            let rate = if computing as f64 <= cores {
                1.0
            } else {
                cores / computing as f64
            };
            let mut next = f64::INFINITY;
            for b in &state {
                match *b {
                    Busy::Work { left, .. } => next = next.min(now + left / rate),
                    Busy::Sleep { until, .. } => next = next.min(until),
                    _ => {}
                }
            }
            if !next.is_finite() {
                break;
            }
            let dt = next - now;
            let before = now;
            now = next;
            for w in 0..workers {
                match state[w] {
                    Busy::Work { left, start } => {
                        if before + left / rate > next {
                            state[w] = Busy::Work {
                                left: left - dt * rate,
                                start,
                            };
                            continue;
                        }
                        let a = self.schedule.programs[w][self.pc[w]];
                        if let Action::AllReduce { stage, update } = a {
                            // This member's share is done; the collective ends with its last.
                            let gid = self.group_offset[stage as usize] + update as usize;
                            group_left[gid] -= 1;
                            state[w] = Busy::Blocked;
                            if group_left[gid] == 0 {
                                let begin = self.group_start[gid];
                                for m in self.schedule.layout().group(stage) {
                                    let mi = m as usize;
                                    self.record(m, a, begin, now);
                                    self.comm[mi] += now - begin;
                                    self.pc[mi] += 1;
                                    self.clock[mi] = now;
                                    state[mi] = Busy::Ready;
                                    ready.push(mi);
                                }
                            }
                        } else {
                            self.record(w as WorkerId, a, start, now);
                            self.compute[w] += now - start;
                            self.pc[w] += 1;
                            self.clock[w] = now;
                            state[w] = Busy::Ready;
                            ready.push(w);
                        }
                    }
                    Busy::Sleep { until, start } if until <= now => {
                        let a = self.schedule.programs[w][self.pc[w]];
                        if matches!(
                            a,
                            Action::SendActivation { .. }
                                | Action::SendGradient { .. }
                                | Action::SendChunk { .. }
                        ) {
                            self.comm[w] += now - start;
                        }
                        self.record(w as WorkerId, a, start, now);
                        self.pc[w] += 1;
                        self.clock[w] = now;
                        state[w] = Busy::Ready;
                        ready.push(w);
                    }
                    _ => {}
                }
            }
        }
        self.finished()
    }

    /// Interprets worker `w`'s program at time `now` until it starts computing, sleeps, blocks
    /// or finishes.
    fn step_shared(
        &mut self,
        w: usize,
        now: f64,
        state: &mut [Busy],
        ready: &mut Vec<usize>,
        times: &[StageTimes],
        group_left: &mut [u32],
    ) {
        let schedule: &'a Schedule = self.schedule;
        let prog = &schedule.programs[w];
        let (latency, overlap) = self.costs.map_or((0.0, true), |c| (c.latency, c.overlap));
        loop {
            let Some(&a) = prog.get(self.pc[w]) else {
                state[w] = Busy::Done;
                self.clock[w] = now;
                return;
            };
            let t = &times[a.stage() as usize];
            match a {
                Action::Forward { .. }
                | Action::Backward { .. }
                | Action::BackwardInput { .. }
                | Action::BackwardWeight { .. }
                | Action::Update { .. } => {
                    let d = t.compute(&a);
                    if d > 0.0 {
                        state[w] = Busy::Work {
                            left: d,
                            start: now,
                        };
                        return;
                    }
                    self.record(w as WorkerId, a, now, now);
                }
                Action::SendActivation { to, .. }
                | Action::SendGradient { to, .. }
                | Action::SendChunk { to, .. } => {
                    let (id, arrive) = self.post(w as WorkerId, &a, to, t, now, latency);
                    if self.wait[to as usize] == Wait::Message(id) {
                        self.wait[to as usize] = Wait::Nothing;
                        state[to as usize] = Busy::Ready;
                        ready.push(to as usize);
                    }
                    if !overlap && arrive > now {
                        state[w] = Busy::Sleep {
                            until: arrive,
                            start: now,
                        };
                        return;
                    }
                    self.record(w as WorkerId, a, now, now);
                }
                Action::RecvActivation { .. }
                | Action::RecvGradient { .. }
                | Action::RecvChunk { .. } => {
                    let id = self.message(w as WorkerId, &a);
                    let arrived = self.arrival[id];
                    if arrived.is_nan() {
                        self.wait[w] = Wait::Message(id);
                        state[w] = Busy::Blocked;
                        return;
                    }
                    // A receive's span starts when the worker reached it (it may have been
                    // blocked since), as in the per-worker engine.
                    let reached = self.clock[w];
                    if arrived > now {
                        state[w] = Busy::Sleep {
                            until: arrived,
                            start: reached,
                        };
                        return;
                    }
                    self.record(w as WorkerId, a, reached, now);
                }
                Action::AllReduce { stage, update } => {
                    let gid = self.group_offset[stage as usize] + update as usize;
                    self.group_count[gid] += 1;
                    self.group_start[gid] = self.group_start[gid].max(now);
                    let group = schedule.layout().group(stage);
                    if self.group_count[gid] < group.end - group.start {
                        self.wait[w] = Wait::Group(gid);
                        state[w] = Busy::Blocked;
                        return;
                    }
                    if t.all_reduce > 0.0 {
                        // Every member now works on its share of the reduction.
                        group_left[gid] = group.end - group.start;
                        for m in group {
                            self.wait[m as usize] = Wait::Nothing;
                            state[m as usize] = Busy::Work {
                                left: t.all_reduce,
                                start: now,
                            };
                        }
                        return;
                    }
                    for m in group {
                        let mi = m as usize;
                        self.record(m, a, now, now);
                        if mi != w {
                            self.wait[mi] = Wait::Nothing;
                            self.pc[mi] += 1;
                            self.clock[mi] = now;
                            state[mi] = Busy::Ready;
                            ready.push(mi);
                        }
                    }
                }
            }
            self.pc[w] += 1;
            self.clock[w] = now;
        }
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
                    let (id, arrive) = self.post(w, &a, to, t, clock, latency);
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
                all_reduce: match st.all_reduce {
                    _ if r <= 1.0 => 0.0,
                    Some(measured) => measured,
                    None => {
                        2.0 * (r - 1.0) / r * c.transfer(st.param_bytes)
                            + 2.0 * (r - 1.0) * c.latency
                    }
                },
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::generate::generate;
    use crate::spec::{Length, Policy, ScheduleSpec};

    /// With a core per worker, the shared-core engine must time every action exactly as the
    /// per-worker engine does (links, latency, overlap off, collectives and ring steps).
    #[test]
    fn shared_engine_with_a_core_each_matches_the_per_worker_engine() {
        let policies = [
            Policy::Gpipe,
            Policy::OneFOneBFlush,
            Policy::ZbH1,
            Policy::PipeDream,
            Policy::PipeDreamNoStash,
            Policy::VerticalSync,
            Policy::TwoBw,
        ];
        for policy in policies {
            for replicas in [vec![1], vec![2], vec![2, 1, 1]] {
                for (overlap, expand) in [(true, false), (false, false), (true, true)] {
                    let spec = ScheduleSpec::new(policy, 3, 4)
                        .with_replicas(replicas.clone())
                        .with_length(Length::Updates(2));
                    let schedule = lower(
                        &generate(&spec).unwrap(),
                        LowerOptions {
                            expand_all_reduce: expand,
                        },
                    );
                    let costs = CostModel {
                        latency: 0.01,
                        bandwidth: 1e3,
                        overlap,
                        ..CostModel::uniform(StageCost {
                            activation_bytes: 5.0,
                            param_bytes: 20.0,
                            update: 0.1,
                            ..StageCost::compute(1.0, 2.0)
                        })
                    };
                    let mut a = Engine::new(&schedule, Some(&costs), true);
                    a.run().unwrap();
                    let mut b = Engine::new(&schedule, Some(&costs), true);
                    b.run_shared(f64::from(schedule.workers())).unwrap();
                    let what = format!("{policy} {replicas:?} overlap={overlap}");
                    for w in 0..schedule.workers() as usize {
                        for (x, y) in [
                            (a.clock[w], b.clock[w]),
                            (a.compute[w], b.compute[w]),
                            (a.comm[w], b.comm[w]),
                        ] {
                            assert!((x - y).abs() < 1e-9, "{what} worker {w}: {x} vs {y}");
                        }
                    }
                    let key = |s: &Span| (s.worker, s.start.to_bits(), s.end.to_bits());
                    let (mut sa, mut sb) = (a.spans.unwrap(), b.spans.unwrap());
                    sa.sort_by_key(key);
                    sb.sort_by_key(key);
                    assert_eq!(sa.len(), sb.len(), "{what}");
                    for (x, y) in sa.iter().zip(&sb) {
                        assert_eq!(x.action, y.action, "{what}");
                        assert!(
                            (x.start - y.start).abs() < 1e-9 && (x.end - y.end).abs() < 1e-9,
                            "{what}: {x:?} vs {y:?}"
                        );
                    }
                }
            }
        }
    }
}
