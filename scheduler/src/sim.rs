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
use crate::generate::WorkerProgram;
use crate::grid;
use crate::lower::{LowerOptions, lower, peers, transfers};
use crate::plan::{MemoryPeak, VersionPlan, WorkerPeaks, streamed_peaks};
use crate::spec::{Layout, Resolved, Schedule, ScheduleSpec};
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
    /// Weight-gradient half of the backward, per microbatch.
    #[serde(default)]
    pub backward_weight: f64,
    /// The whole backward (both halves at once), per microbatch, where it differs from
    /// `backward_input + backward_weight` (the default): layers whose halves share work
    /// (attention, transformer blocks) do that work once in a whole backward and twice when
    /// a zero-bubble schedule runs the halves apart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward: Option<f64>,
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
    /// The all-reduce's buckets, in the order the backward pass completes them (default,
    /// none: one bucket of every gradient, its ring started when the backward has finished).
    /// With a measured `all_reduce`, the measurement sets the rings' processor time per byte
    /// (so that one bucket takes the measured time). See [`bucketed_all_reduce`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buckets: Option<Vec<Bucket>>,
}

/// One bucket of a stage's gradients: its bytes, and how far into the stage's backward pass
/// its last layer's gradients are final (seconds from the pass's start).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bucket {
    /// Gradient bytes.
    pub bytes: f64,
    /// Seconds into the backward pass at which they are final.
    pub ready: f64,
}

/// What a bucketed ring all-reduce costs each of `r` replicas after a backward pass of
/// `backward` seconds, over `link`: `(during, after)`, the processor time the rings started
/// during the pass add to it, and the time from the pass's end until every ring is done.
///
/// Each bucket's ring moves `2 (r-1)/r` of its bytes in `2 (r-1)` steps: it holds the link
/// `2 (r-1)/r * bytes / bandwidth + 2 (r-1) * latency` and each member's processor
/// `4 (r-1) * message_cpu + 4 (r-1)/r * bytes * byte_cpu` (a send and a receive per step), and
/// takes the longer of the two. The rings run one after another, each from when its bucket
/// is ready (and the one before is done). A worker moves its rings on between the layers of
/// its backward pass, so the processor time of every ring but the last lengthens the pass;
/// the link time overlaps it. One bucket is the unbucketed ring: nothing during, the whole
/// ring after. More buckets hide more of the link behind the pass and cost more messages.
pub fn bucketed_all_reduce(buckets: &[Bucket], backward: f64, r: f64, link: &Link) -> (f64, f64) {
    if r <= 1.0 || buckets.is_empty() {
        return (0.0, 0.0);
    }
    let steps = 2.0 * (r - 1.0);
    let ring = |bytes: f64| {
        let moved = steps / r * bytes;
        let on_link = link.transfer(moved) + steps * link.latency;
        let cpu = 2.0 * steps * link.message_cpu + 2.0 * moved * link.byte_cpu;
        (on_link.max(cpu), cpu)
    };
    let last = buckets.len() - 1;
    let mut during = 0.0;
    let mut done = 0.0f64;
    for (i, b) in buckets.iter().enumerate() {
        let (time, cpu) = ring(b.bytes);
        // The pass has been lengthened by the rings moved on so far.
        let ready = if i == last {
            backward + during
        } else {
            b.ready.min(backward) + during
        };
        done = done.max(ready) + time;
        if i < last {
            during += cpu;
        }
    }
    (during, (done - (backward + during)).max(0.0))
}

impl StageCost {
    /// A stage with the given forward and fused backward times, the backward split evenly into
    /// its input and weight halves, and nothing else.
    pub fn compute(forward: f64, backward: f64) -> Self {
        StageCost {
            forward,
            backward_input: backward / 2.0,
            backward_weight: backward / 2.0,
            backward: None,
            update: 0.0,
            activation_bytes: 0.0,
            gradient_bytes: None,
            param_bytes: 0.0,
            stash_bytes: None,
            all_reduce: None,
            buckets: None,
        }
    }

    /// The stage made of consecutive layers: times and parameter and stash bytes add up; the
    /// output activation and incoming gradient are the last layer's.
    pub fn merge(layers: &[StageCost]) -> Self {
        let mut out = StageCost::compute(0.0, 0.0);
        let (mut whole, mut any_whole) = (0.0, false);
        for l in layers {
            out.forward += l.forward;
            out.backward_input += l.backward_input;
            out.backward_weight += l.backward_weight;
            whole += l.whole_backward();
            any_whole |= l.backward.is_some();
            out.update += l.update;
            out.param_bytes += l.param_bytes;
            out.stash_bytes = Some(out.stash_bytes.unwrap_or(0.0) + l.stash());
        }
        out.backward = any_whole.then_some(whole);
        if let Some(last) = layers.last() {
            out.activation_bytes = last.activation_bytes;
            out.gradient_bytes = last.gradient_bytes;
        }
        out
    }

    /// The whole backward's time ([`StageCost::backward`], or the sum of the halves).
    pub fn whole_backward(&self) -> f64 {
        self.backward
            .unwrap_or(self.backward_input + self.backward_weight)
    }

    fn gradient(&self) -> f64 {
        self.gradient_bytes.unwrap_or(self.activation_bytes)
    }

    fn stash(&self) -> f64 {
        self.stash_bytes.unwrap_or(self.activation_bytes)
    }

    fn check(&self, which: usize) -> Result<()> {
        for (name, v) in self.figures() {
            if !v.is_finite() || v < 0.0 {
                return Err(ScheduleError::Cost(format!(
                    "stage {which}: {name} must be a finite number >= 0, got {v}"
                )));
            }
        }
        Ok(())
    }

    /// Every figure by name, its buckets' too, as checks name them.
    fn figures(&self) -> impl Iterator<Item = (&'static str, f64)> + '_ {
        let buckets = self.buckets.iter().flatten();
        self.fields()
            .into_iter()
            .chain(buckets.flat_map(|b| [("bucket bytes", b.bytes), ("bucket ready", b.ready)]))
    }

    /// Every figure by name, as checks name them.
    fn fields(&self) -> [(&'static str, f64); 10] {
        [
            ("forward", self.forward),
            ("backward_input", self.backward_input),
            ("backward_weight", self.backward_weight),
            (
                // Named by what it is made of where the file gives only the halves.
                if self.backward.is_some() {
                    "backward"
                } else {
                    "backward (backward_input + backward_weight)"
                },
                self.whole_backward(),
            ),
            ("update", self.update),
            ("activation_bytes", self.activation_bytes),
            ("gradient_bytes", self.gradient()),
            ("param_bytes", self.param_bytes),
            ("stash_bytes", self.stash()),
            ("all_reduce", self.all_reduce.unwrap_or(0.0)),
        ]
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
    /// Processor time a worker spends on each message it sends or receives between stages
    /// (waking the peer, being woken and scheduled), in seconds (default 0). It is added to
    /// the compute of the action that produces or consumes the message: a stage's forward pays
    /// for its input and output activations, its backward (or input half) for the gradients.
    /// Threads on shared cores pay this; latency, by contrast, delays without occupying a core.
    #[serde(default)]
    pub message_cpu: f64,
    /// Processor time a worker spends on each byte it sends or receives, in seconds per byte
    /// (default 0): what an encrypted transport costs beyond a message's fixed part (packets,
    /// encryption, copies). Charged like `message_cpu`, on the compute that produces or
    /// consumes the bytes; a ring all-reduce among `r` replicas costs each member
    /// `4(r-1)/r * P` bytes of it (it sends and receives `2(r-1)/r * P`), and takes the longer
    /// of that and its link time.
    #[serde(default)]
    pub byte_cpu: f64,
    /// The host of each worker, in worker order, where the workers are on more than one host
    /// (default, empty: every worker on one). A message between workers of two hosts, and a
    /// ring all-reduce among replicas on more than one, take [`CostModel::between`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<u32>,
    /// The link between hosts: their network's rate and one-way time, and the processor time
    /// its transport costs each end (default: the same as within a host, the fields above).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub between: Option<Link>,
}

/// One kind of link's costs: its rate, its one-way time, and the processor time its transport
/// spends at each end per message and per byte (as [`CostModel`]'s own fields, which are the
/// link within a host).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Bytes per second.
    pub bandwidth: f64,
    /// Seconds per message.
    #[serde(default)]
    pub latency: f64,
    /// Processor seconds per message end.
    #[serde(default)]
    pub message_cpu: f64,
    /// Processor seconds per byte at each end.
    #[serde(default)]
    pub byte_cpu: f64,
}

/// Checks that a link's `bandwidth` is positive.
///
/// # Errors
/// The message naming the bandwidth.
fn check_bandwidth(bandwidth: f64) -> std::result::Result<(), String> {
    if bandwidth.is_nan() || bandwidth <= 0.0 {
        return Err(format!("bandwidth must be > 0 bytes/s, got {bandwidth}"));
    }
    Ok(())
}

/// Checks that every named figure of seconds is finite and not negative.
///
/// # Errors
/// The message naming the first figure that is not.
fn check_seconds(figures: &[(&str, f64)]) -> std::result::Result<(), String> {
    for &(name, v) in figures {
        if !v.is_finite() || v < 0.0 {
            return Err(format!(
                "{name} must be a finite number of seconds >= 0, got {v}"
            ));
        }
    }
    Ok(())
}

impl Link {
    /// Checks that the rate is positive and every time finite and not negative.
    ///
    /// # Errors
    /// [`ScheduleError::Cost`] naming `what` and the figure.
    pub fn check(&self, what: &str) -> Result<()> {
        check_bandwidth(self.bandwidth)
            .and_then(|()| {
                check_seconds(&[
                    ("latency", self.latency),
                    ("message_cpu", self.message_cpu),
                    ("byte_cpu", self.byte_cpu),
                ])
            })
            .map_err(|why| ScheduleError::Cost(format!("{what}: {why}")))
    }

    /// Seconds `bytes` keep the link busy.
    pub fn transfer(&self, bytes: f64) -> f64 {
        bytes / self.bandwidth
    }
}

impl CostModel {
    /// The link within a host: the model's own rate, latency and processor costs.
    pub fn within(&self) -> Link {
        Link {
            bandwidth: self.bandwidth,
            latency: self.latency,
            message_cpu: self.message_cpu,
            byte_cpu: self.byte_cpu,
        }
    }

    /// The link the messages between workers `a` and workers `b` take (the same range twice:
    /// a ring among them): [`CostModel::between`] where any two of them are on different
    /// hosts, else the link within a host. A stage's replicas exchange with every replica of
    /// the next stage over the schedule's microbatches, so one pair apart puts the whole
    /// stage boundary on the slower link.
    pub fn link(&self, a: std::ops::Range<WorkerId>, b: std::ops::Range<WorkerId>) -> Link {
        let host = |w: WorkerId| self.hosts.get(w as usize).copied();
        let first = host(a.start);
        let apart = a.chain(b).any(|w| host(w) != first);
        match (apart, self.between) {
            (true, Some(link)) => link,
            _ => self.within(),
        }
    }

    /// Checks that `hosts`, where given, names a host for each of `workers` workers.
    ///
    /// # Errors
    /// [`ScheduleError::Cost`] for another count.
    pub fn check_hosts(&self, workers: u32) -> Result<()> {
        if !self.hosts.is_empty() && self.hosts.len() != workers as usize {
            return Err(ScheduleError::Cost(format!(
                "{} hosts given for {workers} workers (give one per worker, or none)",
                self.hosts.len()
            )));
        }
        Ok(())
    }

    /// Every stage costs the same; infinitely fast links.
    pub fn uniform(stage: StageCost) -> Self {
        CostModel {
            stages: vec![stage],
            bandwidth: f64::INFINITY,
            latency: 0.0,
            overlap: true,
            cores: None,
            message_cpu: 0.0,
            byte_cpu: 0.0,
            hosts: Vec::new(),
            between: None,
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
        check_bandwidth(self.bandwidth).map_err(ScheduleError::Cost)?;
        if self.cores == Some(0) {
            return Err(ScheduleError::Cost("cores must be at least 1".into()));
        }
        if !self.latency.is_finite() || self.latency < 0.0 {
            return Err(ScheduleError::Cost(format!(
                "latency must be a finite number >= 0, got {}",
                self.latency
            )));
        }
        check_seconds(&[
            ("message_cpu", self.message_cpu),
            ("byte_cpu", self.byte_cpu),
        ])
        .map_err(ScheduleError::Cost)?;
        if let Some(link) = &self.between {
            link.check("the link between hosts")?;
        }
        Ok(())
    }

    /// A cost file's text (`pipe simulate --costs`): JSON when `json`, else TOML. Its values
    /// are checked by [`CostModel::check_input`], once the schedule's stage count is known.
    ///
    /// # Errors
    /// The parser's message.
    pub fn parse(text: &str, json: bool) -> std::result::Result<CostModel, String> {
        if json {
            serde_json::from_str(text).map_err(|e| e.to_string())
        } else {
            toml::from_str(text).map_err(|e| e.message().to_string())
        }
    }

    /// [`CostModel::check`] for costs a user gave (a cost file, `pipe simulate`'s flags):
    /// every figure within [`crate::limits::MAX_FIGURE_SECONDS`] or
    /// [`crate::limits::MAX_FIGURE_BYTES`], some compute time, a bandwidth of at least a
    /// byte a second; so that every figure the simulator prints is finite.
    ///
    /// # Errors
    /// [`ScheduleError::Cost`] naming the figure and the bound.
    pub fn check_input(&self, stages: u32) -> Result<()> {
        use crate::limits::{MIN_TOTAL_SECONDS, check_bandwidth, check_figure, number};
        self.check(stages)?;
        let cost = |m: String| ScheduleError::Cost(m);
        for (i, s) in self.stages.iter().enumerate() {
            for (name, v) in s.figures() {
                check_figure(name, v).map_err(|why| cost(format!("stage {i}: {why}")))?;
            }
        }
        check_figure("latency", self.latency).map_err(cost)?;
        check_figure("message_cpu", self.message_cpu).map_err(cost)?;
        check_figure("byte_cpu", self.byte_cpu).map_err(cost)?;
        if let Some(link) = &self.between {
            for (name, v) in [
                ("between.latency", link.latency),
                ("between.message_cpu", link.message_cpu),
                ("between.byte_cpu", link.byte_cpu),
            ] {
                check_figure(name, v).map_err(cost)?;
            }
            check_bandwidth("the link between hosts: bandwidth", link.bandwidth).map_err(cost)?;
        }
        let total: f64 = self
            .stages
            .iter()
            .map(|s| s.forward + s.whole_backward())
            .sum();
        if total < MIN_TOTAL_SECONDS {
            return Err(cost(format!(
                "the stages compute for {} s in all, under {MIN_TOTAL_SECONDS:e} s: throughputs \
                 would not be finite",
                number(total)
            )));
        }
        check_bandwidth("bandwidth", self.bandwidth).map_err(cost)
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
/// [`ScheduleError::Spec`] when a timeline is asked for and would hold more events than
/// [`crate::limits::MAX_TRACE_EVENTS`]; [`ScheduleError::Cost`] for a bad cost model, [`ScheduleError::Invalid`] from the version
/// plan, [`ScheduleError::Deadlock`] if the programs cannot finish.
pub fn simulate(schedule: &Schedule, costs: &CostModel, opts: SimOptions) -> Result<SimReport> {
    costs.check(schedule.stages())?;
    costs.check_hosts(schedule.workers())?;
    let lowered;
    let schedule = if schedule.lowered {
        schedule
    } else {
        lowered = lower(schedule, LowerOptions::default());
        &lowered
    };
    if opts.timeline {
        // A timeline is kept to be written out: refuse one whose trace would not fit in
        // memory before spending the simulation on it.
        crate::limits::check_trace(schedule.len() as u64)?;
    }
    let (plan, memory) = VersionPlan::derive_with_memory(
        schedule,
        |s| costs.stage(s).param_bytes,
        |s| costs.stage(s).stash(),
    )?;
    let programs = Materialized::new(schedule);
    let mut engine = Engine::new(&schedule.resolved, programs, Some(costs), opts.timeline);
    match costs.cores {
        Some(c) if c < schedule.workers() => engine.run_shared(f64::from(c))?,
        _ => engine.run()?,
    }
    let peaks: Vec<WorkerPeaks> = (0..schedule.workers() as usize)
        .map(|w| WorkerPeaks {
            versions: plan.peak_versions[w],
            activations: plan.peak_activations[w],
            memory: memory[w],
        })
        .collect();
    Ok(engine.report(&peaks))
}

/// Simulates the schedule a request describes without materialising it: every worker's
/// program is generated and lowered a block at a time while the engine runs, and peak memory
/// comes from a second pass that holds one worker's program at a time. Memory is `O(stages x
/// microbatches)` words for the version tables plus the messages in flight, instead of every
/// action of every worker; the times and figures are those of [`simulate`] on the generated
/// schedule, bit for bit (tested on every policy). Timelines and fewer cores than workers need
/// the whole schedule: with either, this generates it and calls [`simulate`].
///
/// # Errors
/// [`ScheduleError::Spec`] for an impossible request, otherwise as [`simulate`].
pub fn simulate_spec(
    spec: &ScheduleSpec,
    costs: &CostModel,
    opts: SimOptions,
) -> Result<SimReport> {
    let resolved = spec.resolve()?;
    costs.check(resolved.layout.stages())?;
    costs.check_hosts(resolved.layout.workers())?;
    let shared = costs.cores.is_some_and(|c| c < resolved.layout.workers());
    if opts.timeline || shared {
        return simulate(&crate::generate(spec)?, costs, opts);
    }
    // Peak memory and timing are independent passes over the same programs, one after the
    // other (the crate runs no threads: two cores took the pair from 0.92 s to 0.75 s on
    // the 1,024-stage benchmark, `docs/scheduling.md`).
    let peaks = streamed_peaks(
        &resolved,
        |s| costs.stage(s).param_bytes,
        |s| costs.stage(s).stash(),
    );
    let mut engine = Engine::new(&resolved, Streamed::new(&resolved), Some(costs), false);
    engine.run()?;
    let peaks = peaks?;
    Ok(engine.report(&peaks))
}

/// The untimed dry run (see [`crate::validate::dry_run`]).
pub(crate) fn run_untimed(schedule: &Schedule) -> Result<()> {
    Engine::new(&schedule.resolved, Materialized::new(schedule), None, false).run()
}

/// Where the engine reads every worker's program from.
trait Programs {
    /// The worker's current action; `None` once its program has ended.
    fn current(&mut self, w: usize) -> Option<Action>;
    /// Moves the worker past its current action.
    fn step(&mut self, w: usize);
    /// How many actions the worker has completed.
    fn position(&self, w: usize) -> usize;
    /// The worker-by-step grid around blocked workers, for a deadlock report.
    fn grid(&self, marks: &[(WorkerId, usize)]) -> String;
}

/// The programs of a schedule held in memory.
struct Materialized<'a> {
    schedule: &'a Schedule,
    pc: Vec<usize>,
}

impl<'a> Materialized<'a> {
    fn new(schedule: &'a Schedule) -> Self {
        Materialized {
            schedule,
            pc: vec![0; schedule.workers() as usize],
        }
    }
}

impl Programs for Materialized<'_> {
    fn current(&mut self, w: usize) -> Option<Action> {
        self.schedule.programs[w].get(self.pc[w]).copied()
    }

    fn step(&mut self, w: usize) {
        self.pc[w] += 1;
    }

    fn position(&self, w: usize) -> usize {
        self.pc[w]
    }

    fn grid(&self, marks: &[(WorkerId, usize)]) -> String {
        grid::blocked(self.schedule, marks)
    }
}

/// Programs generated and lowered on demand: each worker holds only the lowered form of its
/// current action (receive, action, send).
struct Streamed<'a> {
    layout: &'a Layout,
    programs: Vec<WorkerProgram>,
    lowered: Vec<Lowered>,
    done: Vec<usize>,
}

/// A worker's current action with the communication lowering adds around it: the receive
/// from `from` (phase 0), the action (phase 1), the send to `to` (phase 2); `NONE` where
/// there is none. Kept in this compact form and expanded on demand.
#[derive(Clone, Copy)]
struct Lowered {
    action: Action,
    from: WorkerId,
    to: WorkerId,
    phase: u8,
}

/// The pattern of the actions a worker does by itself for their compute time (passes and
/// the optimizer step), as both engines interpret them.
macro_rules! local_work {
    () => {
        Action::Forward { .. }
            | Action::Backward { .. }
            | Action::BackwardInput { .. }
            | Action::BackwardWeight { .. }
            | Action::Update { .. }
    };
}

const NONE: WorkerId = WorkerId::MAX;

impl<'a> Streamed<'a> {
    fn new(resolved: &'a Resolved) -> Self {
        let workers = resolved.layout.workers() as usize;
        let ended = Lowered {
            action: Action::Update {
                stage: 0,
                update: 0,
            },
            from: NONE,
            to: NONE,
            phase: 3,
        };
        Streamed {
            layout: &resolved.layout,
            programs: WorkerProgram::all(resolved),
            lowered: vec![ended; workers],
            done: vec![0; workers],
        }
    }
}

impl Programs for Streamed<'_> {
    #[inline]
    fn current(&mut self, w: usize) -> Option<Action> {
        let l = &mut self.lowered[w];
        loop {
            match l.phase {
                0 if l.from != NONE => return Some(transfers(l.action, l.from, l.to).0),
                1 => return Some(l.action),
                2 if l.to != NONE => return Some(transfers(l.action, l.from, l.to).1),
                0 | 2 => l.phase += 1,
                _ => {
                    let a = self.programs[w].next()?;
                    let (from, to) = peers(self.layout, w as WorkerId, a);
                    *l = Lowered {
                        action: a,
                        from: from.unwrap_or(NONE),
                        to: to.unwrap_or(NONE),
                        phase: 0,
                    };
                }
            }
        }
    }

    #[inline]
    fn step(&mut self, w: usize) {
        self.lowered[w].phase += 1;
        self.done[w] += 1;
    }

    fn position(&self, w: usize) -> usize {
        self.done[w]
    }

    fn grid(&self, _marks: &[(WorkerId, usize)]) -> String {
        String::new()
    }
}

/// Arrival times of one channel's messages in flight (a stage boundary and direction, or a
/// stage's ring steps), keyed by microbatch or ring step: `(key, arrival)`, `EMPTY` keys free.
/// A power-of-two array indexed by the key's low bits that doubles when two keys in flight
/// collide and shrinks when it empties, so memory follows the messages actually in flight.
#[derive(Clone, Default)]
struct Slots {
    slots: Vec<(u64, f64)>,
    live: usize,
}

const EMPTY: u64 = u64::MAX;
const MIN_SLOTS: usize = 16;

impl Slots {
    #[inline]
    fn insert(&mut self, key: u64, at: f64) {
        if self.slots.is_empty() {
            self.slots = vec![(EMPTY, 0.0); MIN_SLOTS];
        }
        loop {
            let i = key as usize & (self.slots.len() - 1);
            let slot = &mut self.slots[i];
            if slot.0 == EMPTY || slot.0 == key {
                if slot.0 == EMPTY {
                    self.live += 1;
                }
                *slot = (key, at);
                return;
            }
            self.grow();
        }
    }

    /// Doubles the table until every key in it has a slot of its own.
    fn grow(&mut self) {
        let mut size = self.slots.len() * 2;
        'sizes: loop {
            let mut next = vec![(EMPTY, 0.0); size];
            for &(key, at) in self.slots.iter().filter(|s| s.0 != EMPTY) {
                let slot = &mut next[key as usize & (size - 1)];
                if slot.0 != EMPTY {
                    size *= 2;
                    continue 'sizes;
                }
                *slot = (key, at);
            }
            self.slots = next;
            return;
        }
    }

    /// Removes and returns the arrival of `key`, if it has been sent.
    #[inline]
    fn take(&mut self, key: u64) -> Option<f64> {
        if self.slots.is_empty() {
            return None;
        }
        let i = key as usize & (self.slots.len() - 1);
        let slot = &mut self.slots[i];
        if slot.0 != key {
            return None;
        }
        slot.0 = EMPTY;
        let at = slot.1;
        self.live -= 1;
        if self.live == 0 && self.slots.len() > 16 * MIN_SLOTS {
            self.slots = Vec::new();
        }
        Some(at)
    }
}

/// Which message a send or receive moves: its channel and key.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct MessageId {
    channel: usize,
    key: u64,
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
    Message(MessageId),
    Group(usize),
}

struct Engine<'a, P: Programs> {
    resolved: &'a Resolved,
    programs: P,
    costs: Option<&'a CostModel>,
    stages: usize,
    group_offset: Vec<usize>,
    clock: Vec<f64>,
    compute: Vec<f64>,
    comm: Vec<f64>,
    wait: Vec<Wait>,
    /// Per channel.
    arrivals: Vec<Slots>,
    group_count: Vec<u32>,
    group_start: Vec<f64>,
    links: Vec<Vec<(WorkerId, f64)>>,
    spans: Option<Vec<Span>>,
}

impl<'a, P: Programs> Engine<'a, P> {
    fn new(
        resolved: &'a Resolved,
        programs: P,
        costs: Option<&'a CostModel>,
        record: bool,
    ) -> Self {
        let layout = &resolved.layout;
        let stages = layout.stages() as usize;
        let mut group_offset = Vec::with_capacity(stages);
        let mut groups = 0usize;
        for s in 0..stages as u32 {
            group_offset.push(groups);
            if layout.replicas_of(s) > 1 {
                groups += resolved.updates_at(s) as usize;
            }
        }
        let workers = layout.workers() as usize;
        // Activations (one channel per boundary), gradients (likewise), ring steps (per stage).
        let channels = 2 * stages.saturating_sub(1) + stages;
        Engine {
            resolved,
            programs,
            costs,
            stages,
            group_offset,
            clock: vec![0.0; workers],
            compute: vec![0.0; workers],
            comm: vec![0.0; workers],
            wait: vec![Wait::Nothing; workers],
            arrivals: vec![Slots::default(); channels],
            group_count: vec![0; groups],
            group_start: vec![0.0; groups],
            links: vec![Vec::new(); workers],
            spans: record.then(Vec::new),
        }
    }

    /// The report once the engine has run: times from the engine, peaks per worker from the
    /// version plan's sweep.
    fn report(self, peaks: &[WorkerPeaks]) -> SimReport {
        let makespan = self.clock.iter().copied().fold(0.0, f64::max);
        let workers: Vec<WorkerReport> = peaks
            .iter()
            .enumerate()
            .map(|(w, p)| WorkerReport {
                compute: self.compute[w],
                communication: self.comm[w],
                idle: (makespan - self.compute[w] - self.comm[w]).max(0.0),
                memory: p.memory,
                peak_versions: p.versions,
                peak_activations: p.activations,
            })
            .collect();
        let idle: f64 = workers.iter().map(|w| w.idle).sum();
        let n = self.resolved.total;
        let count = self.resolved.layout.workers();
        SimReport {
            makespan,
            microbatches: n,
            throughput: if makespan > 0.0 {
                f64::from(n) / makespan
            } else {
                f64::INFINITY
            },
            bubble_fraction: if makespan > 0.0 {
                idle / (f64::from(count) * makespan)
            } else {
                0.0
            },
            timeline: self.spans.map(|spans| Timeline::new(count, spans)),
            workers,
        }
    }

    /// The message a send or receive of worker `w` moves.
    fn message(&self, w: WorkerId, a: &Action) -> MessageId {
        let grads = self.stages - 1;
        let (channel, key) = match *a {
            Action::SendActivation { stage, mb, .. } => (stage as usize, mb),
            Action::RecvActivation { stage, mb, .. } => (stage as usize - 1, mb),
            Action::SendGradient { stage, mb, .. } => (grads + stage as usize - 1, mb),
            Action::RecvGradient { stage, mb, .. } => (grads + stage as usize, mb),
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
                let group = self.resolved.layout.group(stage);
                let r = u64::from(group.end - group.start);
                let sender = match *a {
                    Action::SendChunk { .. } => w,
                    _ => a.peer().unwrap_or(w),
                };
                let j = u64::from(sender - group.start);
                let steps = 2 * (r - 1);
                let key = (u64::from(update) * r + j) * steps + u64::from(step);
                return MessageId {
                    channel: 2 * grads + stage as usize,
                    key,
                };
            }
            _ => (usize::MAX, 0),
        };
        MessageId {
            channel,
            key: u64::from(key),
        }
    }

    /// The arrival of message `id` if it has been sent (and then forgets it: every message is
    /// received once).
    fn take_arrival(&mut self, id: MessageId) -> Option<f64> {
        self.arrivals[id.channel].take(id.key)
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
        let workers = self.resolved.layout.workers();
        let times = stage_times(self.resolved, self.costs);
        let mut ready: Vec<WorkerId> = (0..workers).rev().collect();
        while let Some(w) = ready.pop() {
            self.advance(w, &mut ready, &times);
        }
        self.finished()
    }

    /// `Ok` when every worker ran its whole program, else the deadlock naming who waits where.
    fn finished(&mut self) -> Result<()> {
        let workers = self.resolved.layout.workers();
        let mut blocked: Vec<(WorkerId, usize, Action)> = Vec::new();
        for w in 0..workers {
            if let Some(a) = self.programs.current(w as usize) {
                blocked.push((w, self.programs.position(w as usize), a));
            }
        }
        if blocked.is_empty() {
            return Ok(());
        }
        let shown: Vec<(WorkerId, usize)> = blocked.iter().take(16).map(|b| (b.0, b.1)).collect();
        let reason = format!(
            "{} of {workers} workers cannot go on ({}{})",
            blocked.len(),
            blocked
                .iter()
                .take(16)
                .map(|&(w, _, a)| format!("w{w} waits at {a}"))
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
            grid: self.programs.grid(&shown),
        })
    }

    /// Puts the message of send `a` from `w` to `to` on their link at `clock`: returns the
    /// message and when it lands (the link is busy until then, less the latency).
    fn post(
        &mut self,
        w: WorkerId,
        a: &Action,
        to: WorkerId,
        t: &StageTimes,
        clock: f64,
    ) -> (MessageId, f64) {
        let wi = w as usize;
        let id = self.message(w, a);
        let (busy, latency) = match a {
            Action::SendActivation { .. } => (t.activation_transfer, t.activation_latency),
            Action::SendGradient { .. } => (t.gradient_transfer, t.gradient_latency),
            _ => (t.chunk_transfer, t.chunk_latency),
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
        self.arrivals[id.channel].insert(id.key, arrive);
        (id, arrive)
    }
    /// The engine for fewer cores than workers: one global clock; between events every
    /// computing worker advances at `min(1, cores / computing)` of its speed. Costs
    /// `O(actions x workers)`, so it is meant for the sizes a machine actually runs.
    fn run_shared(&mut self, cores: f64) -> Result<()> {
        let workers = self.resolved.layout.workers() as usize;
        let times = stage_times(self.resolved, self.costs);
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
                        let Some(a) = self.programs.current(w) else {
                            continue;
                        };
                        if let Action::AllReduce { stage, update } = a {
                            // This member's share is done; the collective ends with its last.
                            let gid = self.group_offset[stage as usize] + update as usize;
                            group_left[gid] -= 1;
                            state[w] = Busy::Blocked;
                            if group_left[gid] == 0 {
                                let begin = self.group_start[gid];
                                for m in self.resolved.layout.group(stage) {
                                    let mi = m as usize;
                                    self.record(m, a, begin, now);
                                    self.comm[mi] += now - begin;
                                    self.resume_shared(mi, now, &mut state, &mut ready);
                                }
                            }
                        } else {
                            self.record(w as WorkerId, a, start, now);
                            self.compute[w] += now - start;
                            self.resume_shared(w, now, &mut state, &mut ready);
                        }
                    }
                    Busy::Sleep { until, start } if until <= now => {
                        let Some(a) = self.programs.current(w) else {
                            continue;
                        };
                        if matches!(
                            a,
                            Action::SendActivation { .. }
                                | Action::SendGradient { .. }
                                | Action::SendChunk { .. }
                                | Action::AllReduce { .. }
                        ) {
                            self.comm[w] += now - start;
                        }
                        self.record(w as WorkerId, a, start, now);
                        self.resume_shared(w, now, &mut state, &mut ready);
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
        let overlap = self.costs.is_none_or(|c| c.overlap);
        loop {
            let Some(a) = self.programs.current(w) else {
                state[w] = Busy::Done;
                self.clock[w] = now;
                return;
            };
            let t = &times[a.stage() as usize];
            match a {
                local_work!() => {
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
                    let (id, arrive) = self.post(w as WorkerId, &a, to, t, now);
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
                    let Some(arrived) = self.take_arrival(id) else {
                        self.wait[w] = Wait::Message(id);
                        state[w] = Busy::Blocked;
                        return;
                    };
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
                    let Some(gid) = self.join_group(w, now, stage, update) else {
                        state[w] = Busy::Blocked;
                        return;
                    };
                    if t.all_reduce > 0.0 {
                        self.start_all_reduce_shared(stage, gid, now, t, state, group_left);
                        return;
                    }
                    for m in self.resolved.layout.group(stage) {
                        let mi = m as usize;
                        self.record(m, a, now, now);
                        if mi != w {
                            self.wait[mi] = Wait::Nothing;
                            self.resume_shared(mi, now, state, ready);
                        }
                    }
                }
            }
            self.programs.step(w);
            self.clock[w] = now;
        }
    }

    /// Counts worker `w` in at the all-reduce of `stage`'s update `update`, reached at `at`:
    /// the all-reduce's group index once every replica is in, else `None` (and `w` waits on
    /// the group).
    fn join_group(&mut self, w: usize, at: f64, stage: u32, update: u32) -> Option<usize> {
        let gid = self.group_offset[stage as usize] + update as usize;
        self.group_count[gid] += 1;
        self.group_start[gid] = self.group_start[gid].max(at);
        let group = self.resolved.layout.group(stage);
        if self.group_count[gid] < group.end - group.start {
            self.wait[w] = Wait::Group(gid);
            return None;
        }
        Some(gid)
    }

    /// Starts the costed all-reduce `gid` of `stage`'s replicas at `now` in the shared engine:
    /// a ring bound by its link puts every member to sleep for its time, off the cores; one on
    /// the cores sets every member to work on its share.
    fn start_all_reduce_shared(
        &mut self,
        stage: u32,
        gid: usize,
        now: f64,
        t: &StageTimes,
        state: &mut [Busy],
        group_left: &mut [u32],
    ) {
        let group = self.resolved.layout.group(stage);
        if t.all_reduce_on_cores {
            group_left[gid] = group.end - group.start;
        }
        for m in group {
            self.wait[m as usize] = Wait::Nothing;
            state[m as usize] = if t.all_reduce_on_cores {
                Busy::Work {
                    left: t.all_reduce,
                    start: now,
                }
            } else {
                Busy::Sleep {
                    until: now + t.all_reduce,
                    start: now,
                }
            };
        }
    }

    /// Steps worker `w` past its current action, ended at `now`, and readies it for its next
    /// in the shared engine.
    fn resume_shared(&mut self, w: usize, now: f64, state: &mut [Busy], ready: &mut Vec<usize>) {
        self.programs.step(w);
        self.clock[w] = now;
        state[w] = Busy::Ready;
        ready.push(w);
    }

    /// Runs worker `w` until it blocks or finishes; wakes the workers it unblocks.
    fn advance(&mut self, w: WorkerId, ready: &mut Vec<WorkerId>, times: &[StageTimes]) {
        let wi = w as usize;
        let layout: &'a Layout = &self.resolved.layout;
        let overlap = self.costs.is_none_or(|c| c.overlap);
        let mut clock = self.clock[wi];
        let mut compute = 0.0;
        let mut comm = 0.0;
        while let Some(a) = self.programs.current(wi) {
            let t = &times[a.stage() as usize];
            match a {
                local_work!() => {
                    let d = t.compute(&a);
                    self.record(w, a, clock, clock + d);
                    clock += d;
                    compute += d;
                }
                Action::SendActivation { to, .. }
                | Action::SendGradient { to, .. }
                | Action::SendChunk { to, .. } => {
                    let (id, arrive) = self.post(w, &a, to, t, clock);
                    let start = clock;
                    if !overlap {
                        comm += arrive - clock;
                        clock = arrive;
                    }
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
                    let Some(arrived) = self.take_arrival(id) else {
                        self.wait[wi] = Wait::Message(id);
                        break;
                    };
                    let start = clock;
                    clock = clock.max(arrived);
                    self.record(w, a, start, clock);
                }
                Action::AllReduce { stage, update } => {
                    let Some(gid) = self.join_group(wi, clock, stage, update) else {
                        break;
                    };
                    let group = layout.group(stage);
                    let begin = self.group_start[gid];
                    let end = begin + t.all_reduce;
                    for m in group {
                        let mi = m as usize;
                        self.record(m, a, begin, end);
                        if m != w {
                            self.comm[mi] += t.all_reduce;
                            self.clock[mi] = end;
                            self.programs.step(mi);
                            self.wait[mi] = Wait::Nothing;
                            ready.push(m);
                        }
                    }
                    comm += t.all_reduce;
                    clock = end;
                }
            }
            self.programs.step(wi);
        }
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
    /// One-way time of the link it takes.
    activation_latency: f64,
    /// Link time of the gradient this stage sends back (sized by the previous stage).
    gradient_transfer: f64,
    /// One-way time of the link it takes.
    gradient_latency: f64,
    /// Link time of one ring all-reduce chunk (`P / r`).
    chunk_transfer: f64,
    /// One-way time of the ring's link.
    chunk_latency: f64,
    /// Whole collective all-reduce: `2(r-1)/r * P / bandwidth + 2(r-1) * latency`.
    all_reduce: f64,
    /// Whether the all-reduce occupies its members' cores (a measured one, or a ring whose
    /// processor time outlasts its link time); a ring bound by its link waits on it instead,
    /// leaving the cores to other workers.
    all_reduce_on_cores: bool,
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

/// Per-stage times the engine reads: from `costs`, or all zero for the dry run.
fn stage_times(resolved: &Resolved, costs: Option<&CostModel>) -> Vec<StageTimes> {
    (0..resolved.layout.stages())
        .map(|s| costs.map_or_else(StageTimes::default, |c| stage_times_of(resolved, c, s)))
        .collect()
}

/// The times the engine reads for stage `s` under cost model `c`.
fn stage_times_of(resolved: &Resolved, c: &CostModel, s: u32) -> StageTimes {
    let layout = &resolved.layout;
    let st = c.stage(s);
    let r = f64::from(layout.replicas_of(s));
    // Messages per forward (activation in, activation out) and per backward (gradient
    // in, gradient out); none to a neighbour on the same position (one position
    // holding every stage, the turn of a V). Each boundary and the ring take their
    // own link (within a host or between hosts).
    let apart = |n: u32| layout.position_of(n) != layout.position_of(s);
    let after = s + 1 < layout.stages() && apart(s + 1);
    let before = (s > 0 && apart(s - 1)).then(|| c.stage(s - 1));
    let out_link = if s + 1 < layout.stages() {
        c.link(layout.group(s), layout.group(s + 1))
    } else {
        c.within()
    };
    let in_link = if s > 0 {
        c.link(layout.group(s - 1), layout.group(s))
    } else {
        c.within()
    };
    let ring = c.link(layout.group(s), layout.group(s));
    // Processor time of a pass's messages: `bytes` over the link in and over the
    // link out.
    let cpu = |bytes_in: f64, bytes_out: f64| {
        let mut t = 0.0;
        if before.is_some() {
            t += in_link.message_cpu + in_link.byte_cpu * bytes_in;
        }
        if after {
            t += out_link.message_cpu + out_link.byte_cpu * bytes_out;
        }
        t
    };
    let forward_cpu = cpu(
        before.map_or(0.0, |p| p.activation_bytes),
        st.activation_bytes,
    );
    let backward_cpu = cpu(before.map_or(0.0, StageCost::gradient), st.gradient());
    // The all-reduce. The processor time of rings moved on during the update's last backward
    // is spread over the update's backward passes.
    let (ring_during, all_reduce) = stage_all_reduce(st, r, &ring);
    let passes = f64::from(resolved.update_size(s).max(1)) / r;
    let ring_cpu = ring_during / passes.max(1.0);
    StageTimes {
        forward: st.forward + forward_cpu,
        backward: st.whole_backward() + backward_cpu + ring_cpu,
        backward_input: st.backward_input + backward_cpu,
        backward_weight: st.backward_weight + ring_cpu,
        update: st.update,
        activation_transfer: out_link.transfer(st.activation_bytes),
        activation_latency: out_link.latency,
        gradient_transfer: if s > 0 {
            in_link.transfer(c.stage(s - 1).gradient())
        } else {
            0.0
        },
        gradient_latency: in_link.latency,
        chunk_transfer: ring.transfer(st.param_bytes / r),
        chunk_latency: ring.latency,
        all_reduce,
        all_reduce_on_cores: all_reduce_on_cores(st, r, &ring),
    }
}

/// The all-reduce of stage `st` among `r` replicas over `ring`, as [`bucketed_all_reduce`]'s
/// `(during, after)`: measured, or the (bucketed) ring over its link.
fn stage_all_reduce(st: &StageCost, r: f64, ring: &Link) -> (f64, f64) {
    match (st.all_reduce, &st.buckets) {
        _ if r <= 1.0 => (0.0, 0.0),
        // A measured whole all-reduce in buckets: the measurement sets the ring's
        // processor time per byte (an in-process ring's additions), so that one bucket
        // takes exactly the measured time.
        (Some(measured), Some(buckets)) => {
            let moved = 4.0 * (r - 1.0) / r * st.param_bytes;
            let messages = 4.0 * (r - 1.0) * ring.message_cpu;
            let calibrated = Link {
                byte_cpu: if moved > 0.0 {
                    (measured - messages).max(0.0) / moved
                } else {
                    0.0
                },
                ..*ring
            };
            bucketed_all_reduce(buckets, st.whole_backward(), r, &calibrated)
        }
        (Some(measured), None) => (0.0, measured),
        (None, _) => {
            let whole = [Bucket {
                bytes: st.param_bytes,
                ready: st.whole_backward(),
            }];
            let buckets = st.buckets.as_deref().unwrap_or(&whole);
            bucketed_all_reduce(buckets, st.whole_backward(), r, ring)
        }
    }
}

/// Whether the all-reduce of stage `st` among `r` replicas over `ring` occupies their cores
/// (see [`StageTimes::all_reduce_on_cores`]).
fn all_reduce_on_cores(st: &StageCost, r: f64, ring: &Link) -> bool {
    st.all_reduce.is_some() || {
        let moved = 2.0 * (r - 1.0) / r * st.param_bytes;
        let on_link = ring.transfer(moved) + 2.0 * (r - 1.0) * ring.latency;
        let cpu = 4.0 * (r - 1.0) * ring.message_cpu + 2.0 * moved * ring.byte_cpu;
        cpu >= on_link
    }
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
        for policy in Policy::ONE_CHUNK_PIPELINES {
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
                    let mut a = Engine::new(
                        &schedule.resolved,
                        Materialized::new(&schedule),
                        Some(&costs),
                        true,
                    );
                    a.run().unwrap();
                    let mut b = Engine::new(
                        &schedule.resolved,
                        Materialized::new(&schedule),
                        Some(&costs),
                        true,
                    );
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
