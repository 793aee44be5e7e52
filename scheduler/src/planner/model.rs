//! The default cost model: what PipeDream's formulas leave out, under the schedule the plan
//! will actually run.
//!
//! A stage of layers `i..=j` on `r` replicas, with `a` workers at or after it in the pipeline,
//! is charged per pipeline microbatch (each replica handles one in `r`, and updates once per
//! `M` of its own microbatches):
//!
//! - compute `(F + B + U / M + 2 (m c_m + x c_b)) / r`: forward, both backward halves, the
//!   optimizer step, and the transport's processor time for the stage's `m` links (each
//!   activation in or out and its gradient, `c_m` per message end and `c_b` per byte of the
//!   `x` bytes crossing its cuts; [`super::transport`]);
//! - all-reduce `max(2 (r-1)/r * P / bw + 2 (r-1) * latency, 4 (r-1) c_m + 4 (r-1)/r * P *
//!   c_b) / (M r)`: one ring all-reduce of the gradients per update, as the simulator charges
//!   one bucket ([`crate::sim::bucketed_all_reduce`]), bounded by its link or by the
//!   processor time its messages and bytes cost;
//! - transfer `(x_in + x_out) * wire / bw / r`: the activation the stage sends forward plus the
//!   gradient it sends back, each the size of the tensor crossing the cut (every activation
//!   crossing it, for branching graphs), halved on a bf16 wire. A worker's sends share its one
//!   link. Without overlap a send also waits out the link's latency.
//!
//! The stage's time is `max(compute + all-reduce, transfer)` when sends overlap compute, and
//! their sum when they do not. The plan minimises the slowest stage, over contiguous stages and
//! per-stage replica counts that use exactly `W` workers.
//!
//! Memory per worker is pipe's memory model ([`super::memory`]): the worker's base, its
//! stage's weights, drained and placed optimizer state and stashed versions, the activations
//! of `ceil(a / r)` microbatches in flight on each replica in 1F1B's steady state (GPipe holds
//! all `M`), one pass's working set and, at the last stage, the logits. A stage whose
//! activations do not fit `--memory` recomputes them where that fits (the layers' recomputed
//! stash, charging their forward once more in the backward); a plan whose stage exceeds
//! `--memory` either way is not considered.
//!
//! Flush schedules pay a bubble at every update, more with more stages, so for them the
//! program also tracks the number of stages: it finds the best plan for 1, 2, ... stages until
//! no more stages can score below the best `(M + S - 1) * slowest` found, and the simulator
//! times the most promising few, whole minibatch, fill and drain included; the fastest
//! simulated wins.
//!
//! Stopping: an `S`-stage plan on `W` workers has a slowest stage `T` with `W T >= C + P_R /
//! (bw M) + 2 latency / M` when `S < W`: every replicated stage pays at least `P / (bw M)` of
//! all-reduce per replica-microbatch on its parameters, and the parameters `P_R` on replicated
//! stages are at least all of them less what `S - 1` unreplicated stages, each of work at most
//! `T`, can hold (the widest run of layers of work at most `T`, found by two pointers). The
//! least such `T` (bisection), or `C / W` and the heaviest layer over the most replicas it can
//! have, bounds every `S`-stage plan from below; the search stops once no larger stage count's
//! `(M + S - 1)` times its bound is below the best score. Ignoring the all-reduce, as the plain
//! `C / W` floor does, kept the search going through 19 stage counts at 0.1 GB/s.
//!
//! The program is PipeDream's prefix recursion with exact pruning: a stage of compute `C` on
//! `r` replicas never takes less than `C / r`, and a prefix of compute `C` on `m` workers never
//! less than `C / m` (the slowest stage is at least the average), so for a current best `t`
//! only cuts with `C_stage < r t` and `C_prefix < m t` can improve it. Both are ranges of the
//! prefix sums, found through a bucket index over them; the search starts from the previous
//! layer's best cut extended by one layer. Two more cuts of the range: a stage's compute plus
//! all-reduce grows with the stage, so a binary search drops the cuts whose stage alone is
//! slower than `t` (at low bandwidth, most of them); and when the prefix comes from the
//! previous stage count's table, the fastest prefix ending at or after each layer never
//! decreases, so a second binary search drops the cuts whose prefix is slower than `t`.

use crate::error::{Result, ScheduleError};
use crate::generate::generate;
use crate::lower::{LowerOptions, lower};
use crate::planner::memory::{StageHeld, planned_in_flight, worker_bytes};
use crate::planner::types::{Bound, PartitionPlan, PlannedStage, PrefixIndex};
use crate::profile::Profile;
use crate::sim::{CostModel, Link, SimOptions, StageCost, simulate};
use crate::spec::{Length, Policy, ScheduleSpec};

/// Element type of activations and gradients on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WireDtype {
    /// 4 bytes per element, as computed.
    #[default]
    F32,
    /// 2 bytes per element: half the transfer.
    Bf16,
}

impl WireDtype {
    /// Wire bytes per profiled (f32) byte.
    pub fn factor(self) -> f64 {
        match self {
            WireDtype::F32 => 1.0,
            WireDtype::Bf16 => 0.5,
        }
    }
}

impl std::str::FromStr for WireDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(WireDtype::F32),
            "bf16" => Ok(WireDtype::Bf16),
            other => Err(format!("unknown wire dtype '{other}' (f32, bf16)")),
        }
    }
}

/// Settings of the default cost model.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanOptions {
    /// Workers to use (all of them).
    pub workers: u32,
    /// Link bandwidth, bytes per second.
    pub bandwidth: f64,
    /// Link latency, seconds per message.
    pub latency: f64,
    /// Per-worker memory bound in bytes, if any.
    pub memory: Option<f64>,
    /// Element type of activations and gradients on the wire.
    pub wire: WireDtype,
    /// Whether sends overlap compute.
    pub overlap: bool,
    /// The schedule the plan is for.
    pub policy: Policy,
    /// Microbatches per update per replica (`M`).
    pub microbatches: u32,
    /// No replication: every stage on one worker.
    pub straight: bool,
    /// Parameter-sized buffers besides the weight versions: gradient and optimizer state.
    pub state_copies: f64,
    /// Flush schedules: how many of the best plans (one per stage count) the simulator times.
    pub candidates: usize,
    /// Cores the workers share when the simulator times a plan (`None`: one each); fewer cores
    /// than workers share them fairly ([`CostModel::cores`]).
    pub cores: Option<u32>,
    /// Processor time the transport spends per message end, seconds: charged as compute, by
    /// the partition search on each stage's activations and gradients and by the simulator's
    /// check ([`CostModel::message_cpu`]). Set from the measured transport costs
    /// ([`super::transport`], [`PlanOptions::with_transport`]). Default 0.
    pub message_cpu: f64,
    /// Processor time the transport spends per byte at each end, seconds per byte
    /// ([`CostModel::byte_cpu`], charged as `message_cpu` is). Default 0.
    pub byte_cpu: f64,
    /// Bytes every worker process holds besides its stages ([`super::memory`]'s `base`: the
    /// program, its runtime, the starting weights). Default 0.
    pub worker_base: f64,
    /// The hosts the workers are placed on and the network between them
    /// ([`super::placement`]); `None` (the default): every worker on one host, every link
    /// the one above.
    pub hosts: Option<super::placement::Hosts>,
    /// The all-reduce bucket size the run will sum each stage's gradients in, for the
    /// simulator's check ([`crate::sim::bucketed_all_reduce`]); default one bucket
    /// ([`super::buckets::BucketSize::Whole`]). The partition search charges one bucket
    /// either way.
    pub bucket_size: super::buckets::BucketSize,
}

impl PlanOptions {
    /// These options charging the processor costs measured for `cost`'s transport (medians):
    /// per message end and per byte, on every stage-to-stage link and all-reduce.
    #[must_use]
    pub fn with_transport(mut self, cost: &super::transport::TransportCost) -> Self {
        self.message_cpu = cost.message_cpu_s.median;
        self.byte_cpu = cost.byte_cpu_s.median;
        self
    }

    /// `workers` at `bandwidth` bytes/s: PipeDream's schedule, 8 microbatches per update, f32
    /// on the wire, overlapped sends, no latency, no memory bound, replication allowed.
    pub fn new(workers: u32, bandwidth: f64) -> Self {
        PlanOptions {
            workers,
            bandwidth,
            latency: 0.0,
            memory: None,
            wire: WireDtype::F32,
            overlap: true,
            policy: Policy::PipeDream,
            microbatches: 8,
            straight: false,
            state_copies: 2.0,
            candidates: 4,
            cores: None,
            message_cpu: 0.0,
            byte_cpu: 0.0,
            worker_base: 0.0,
            hosts: None,
            bucket_size: super::buckets::BucketSize::Whole,
        }
    }

    fn check(&self) -> Result<()> {
        let bad = |m: String| Err(ScheduleError::Plan(m));
        if self.workers == 0 {
            return bad("need at least one worker".into());
        }
        if self.workers > 4096 {
            return bad(format!("{} workers is more than 4096", self.workers));
        }
        if self.bandwidth.is_nan() || self.bandwidth <= 0.0 {
            return bad(format!(
                "bandwidth must be > 0 bytes/s, got {}",
                self.bandwidth
            ));
        }
        if !self.latency.is_finite() || self.latency < 0.0 {
            return bad(format!("latency must be >= 0 s, got {}", self.latency));
        }
        for (name, v) in [
            ("message_cpu", self.message_cpu),
            ("byte_cpu", self.byte_cpu),
        ] {
            if !v.is_finite() || v < 0.0 {
                return bad(format!("{name} must be >= 0 s, got {v}"));
            }
        }
        if self.microbatches == 0 {
            return bad("need at least one microbatch per update".into());
        }
        if !self.state_copies.is_finite() || self.state_copies < 0.0 {
            return bad(format!(
                "state copies must be >= 0, got {}",
                self.state_copies
            ));
        }
        if matches!(self.memory, Some(m) if m.is_nan() || m <= 0.0) {
            return bad("the memory bound must be > 0 bytes".into());
        }
        if !(self.worker_base.is_finite() && self.worker_base >= 0.0) {
            return bad("a worker's base memory must be a finite number of bytes >= 0".into());
        }
        if let Some(hosts) = &self.hosts {
            hosts.check(self.workers)?;
        }
        check_plannable(self.policy)
    }

    /// The link within a host: these options' rate, latency and processor costs.
    pub fn within(&self) -> Link {
        Link {
            bandwidth: self.bandwidth,
            latency: self.latency,
            message_cpu: self.message_cpu,
            byte_cpu: self.byte_cpu,
        }
    }
}

/// One stage's charges under the model.
#[derive(Clone, Copy, Debug)]
struct Eval {
    compute: f64,
    all_reduce: f64,
    transfer: f64,
    time: f64,
    memory: f64,
    /// The backward recomputes the stage's activations (chosen where keeping them does not
    /// fit the memory bound).
    recompute: bool,
}

/// Prefix sums of a profile and the options: evaluates any stage in O(1).
struct Costs<'a> {
    opts: &'a PlanOptions,
    n: usize,
    w: usize,
    /// Forward + backward, update, parameter and stash bytes of layers `0..i`.
    pc: Vec<f64>,
    pu: Vec<f64>,
    pp: Vec<f64>,
    ps: Vec<f64>,
    /// Stash bytes under recomputation, and the forward time recomputation runs again.
    pr: Vec<f64>,
    pf: Vec<f64>,
    /// Range maxima of each layer's one pass ([`super::memory::StageHeld::pass`]).
    pass: RangeMax,
    /// The last layer's output bytes: the logits a last stage computes its loss on.
    last_output: f64,
    crossing: Vec<f64>,
    /// Factors per replica count (index `r`), for a ring within a host and one between hosts.
    per_r: Vec<PerReplicas>,
    per_r_between: Vec<PerReplicas>,
    inv_m: f64,
    /// The link within a host and the one between hosts (the same without hosts).
    within: Link,
    between: Link,
    /// The host of each worker position in pipeline order (empty: one host).
    host_at: Vec<u32>,
    /// `same_until[p]`: the last position from `p` on whose workers are all on `p`'s host.
    same_until: Vec<usize>,
}

/// Maxima of any range of a list in O(1) after O(n log n): a sparse table.
struct RangeMax {
    /// `levels[k][i]`: the maximum of `2^k` values from `i`.
    levels: Vec<Vec<f64>>,
}

impl RangeMax {
    fn new(values: &[f64]) -> Self {
        let mut levels = vec![values.to_vec()];
        let mut width = 1;
        while 2 * width <= values.len() {
            let prev = &levels[levels.len() - 1];
            let next = (0..=values.len() - 2 * width)
                .map(|i| prev[i].max(prev[i + width]))
                .collect();
            levels.push(next);
            width *= 2;
        }
        RangeMax { levels }
    }

    /// The maximum of values `from..=to`.
    fn max(&self, from: usize, to: usize) -> f64 {
        let len = to + 1 - from;
        let k = (usize::BITS - 1 - len.leading_zeros()) as usize;
        let level = &self.levels[k];
        level[from].max(level[to + 1 - (1 << k)])
    }
}

/// Factors of the stage formulas that depend only on the replica count.
struct PerReplicas {
    /// `1 / r`.
    inv: f64,
    /// All-reduce seconds per parameter byte per pipeline microbatch:
    /// `2 (r-1)/r / bw / (M r)`.
    ring: f64,
    /// All-reduce latency per pipeline microbatch: `2 (r-1) latency / (M r)`.
    ring_latency: f64,
    /// All-reduce processor seconds per parameter byte per pipeline microbatch: each member
    /// sends and receives `2 (r-1)/r` of the bytes, `4 (r-1)/r * byte_cpu / (M r)`.
    ring_cpu: f64,
    /// All-reduce processor seconds of its messages per pipeline microbatch: a send and a
    /// receive in each of `2 (r-1)` steps, `4 (r-1) * message_cpu / (M r)`.
    ring_messages: f64,
}

impl<'a> Costs<'a> {
    fn new(profile: &Profile, opts: &'a PlanOptions) -> Self {
        let n = profile.layers.len();
        let mut pc = vec![0.0f64; n + 1];
        let mut pu = vec![0.0f64; n + 1];
        let mut pp = vec![0.0f64; n + 1];
        let mut ps = vec![0.0f64; n + 1];
        let mut pr = vec![0.0f64; n + 1];
        let mut pf = vec![0.0f64; n + 1];
        let crossing = profile.crossing_bytes();
        let mut pass = Vec::with_capacity(n);
        for (i, l) in profile.layers.iter().enumerate() {
            pc[i + 1] = pc[i] + l.compute();
            pu[i + 1] = pu[i] + l.update;
            pp[i + 1] = pp[i] + l.param_bytes;
            ps[i + 1] = ps[i] + l.stash();
            pr[i + 1] = pr[i] + l.recompute_stash();
            // A layer that keeps less under recomputation runs its forward again in the
            // backward (and again in a split backward's weight half).
            let again = if opts.policy == Policy::ZbH1 {
                2.0
            } else {
                1.0
            };
            pf[i + 1] = pf[i] + again * l.recompute_forward();
            let input = if i > 0 { crossing[i - 1] } else { 0.0 };
            pass.push(l.stash() + input + l.activation_bytes);
        }
        let m = f64::from(opts.microbatches);
        let within = opts.within();
        let between = opts.hosts.as_ref().map_or(within, |h| h.between);
        let host_at = opts
            .hosts
            .as_ref()
            .map_or_else(Vec::new, |h| h.of_positions(opts.workers as usize));
        let per_r = |link: &Link| -> Vec<PerReplicas> {
            (0..=opts.workers as usize)
                .map(|r| {
                    let rf = (r as f64).max(1.0);
                    PerReplicas {
                        inv: 1.0 / rf,
                        ring: 2.0 * (rf - 1.0) / rf / link.bandwidth / (m * rf),
                        ring_latency: 2.0 * (rf - 1.0) * link.latency / (m * rf),
                        ring_cpu: 4.0 * (rf - 1.0) / rf * link.byte_cpu / (m * rf),
                        ring_messages: 4.0 * (rf - 1.0) * link.message_cpu / (m * rf),
                    }
                })
                .collect()
        };
        Costs {
            opts,
            n,
            w: opts.workers as usize,
            pc,
            pu,
            pp,
            ps,
            pr,
            pf,
            pass: RangeMax::new(&pass),
            last_output: profile.layers.last().map_or(0.0, |l| l.activation_bytes),
            crossing,
            per_r: per_r(&within),
            per_r_between: per_r(&between),
            inv_m: 1.0 / m,
            within,
            between,
            same_until: {
                let at = &host_at;
                let mut until: Vec<usize> = (0..at.len()).collect();
                for p in (0..at.len().saturating_sub(1)).rev() {
                    if at[p] == at[p + 1] {
                        until[p] = until[p + 1];
                    }
                }
                until
            },
            host_at,
        }
    }

    /// Whether the workers at positions `a..=b` are on more than one host.
    fn apart(&self, a: usize, b: usize) -> bool {
        self.same_until.get(a).is_some_and(|&u| u < b)
    }

    /// The links of a stage on `r` replicas with `after` workers at or after it (positions
    /// `w - after ..` in pipeline order): the one its input comes in on, the one its output
    /// goes out on, and its ring's. A boundary crosses hosts when the stage's workers and the
    /// neighbouring position are not all on one host; the ring, when its replicas are not.
    /// (The simulator, which times the plans the search picks from, counts a boundary as
    /// crossing when any worker of either stage is on another host: the same where the
    /// neighbouring stage has one replica.)
    fn links(&self, r: usize, after: usize) -> (&Link, &Link, &PerReplicas) {
        let first = self.w - after.min(self.w);
        let last = first + r.max(1) - 1;
        let pick = |apart: bool| if apart { &self.between } else { &self.within };
        let input = pick(first > 0 && self.apart(first - 1, last));
        let output = pick(last + 1 < self.w && self.apart(first, last + 1));
        let ring = if self.apart(first, last) {
            &self.per_r_between[r]
        } else {
            &self.per_r[r]
        };
        (input, output, ring)
    }

    /// Compute, all-reduce, transfer and time of layers `from..=to` on `r` replicas with
    /// `after` workers at or after the stage: the formulas of the module docs with the
    /// per-replica factors precomputed, each link charged its own costs (the program
    /// evaluates this for every cut it cannot prune).
    fn parts(
        &self,
        from: usize,
        to: usize,
        r: usize,
        after: usize,
        recompute: bool,
    ) -> (f64, f64, f64, f64) {
        let f = &self.per_r[r];
        let (mut compute, all_reduce) = self.work(from, to, r, after);
        if recompute {
            compute += (self.pf[to + 1] - self.pf[from]) * f.inv;
        }
        let (input, output, _) = self.links(r, after);
        let wire = self.opts.wire.factor();
        // Each link's messages: the activation it carries and as many gradients back. The
        // transport's processor time is compute; the link time is the transfer.
        let mut cpu = 0.0;
        let mut link_time = 0.0;
        let mut waits = 0.0;
        let mut charge = |bytes: f64, link: &Link| {
            cpu += 2.0 * (link.message_cpu + bytes * wire * link.byte_cpu);
            link_time += bytes * wire / link.bandwidth;
            waits += link.latency;
        };
        if from > 0 {
            charge(self.crossing[from - 1], input);
        }
        if to + 1 < self.n {
            charge(self.crossing[to], output);
        }
        compute += cpu * f.inv;
        if self.opts.overlap {
            let t = link_time * f.inv;
            (compute, all_reduce, t, (compute + all_reduce).max(t))
        } else {
            let t = (link_time + waits) * f.inv;
            (compute, all_reduce, t, compute + all_reduce + t)
        }
    }

    /// Compute and all-reduce of layers `from..=to` on `r` replicas with `after` workers at or
    /// after it: their sum is a lower bound on the stage's time (the transfer can only add to
    /// it), never decreasing as the stage grows (its position fixed), which is what lets
    /// [`Costs::first_cut_within`] prune cuts.
    #[inline]
    fn work(&self, from: usize, to: usize, r: usize, after: usize) -> (f64, f64) {
        let f = &self.per_r[r];
        let ring = self.links(r, after).2;
        let c = self.pc[to + 1] - self.pc[from];
        let u = self.pu[to + 1] - self.pu[from];
        let p = self.pp[to + 1] - self.pp[from];
        let all_reduce =
            (p * ring.ring + ring.ring_latency).max(p * ring.ring_cpu + ring.ring_messages);
        ((c + u * self.inv_m) * f.inv, all_reduce)
    }

    /// The first cut `k` in `cuts` whose stage `k+1..=j` on `r` replicas (with `after` workers
    /// at or after it) has compute plus all-reduce at most `t` (`cuts.end` if none): cuts
    /// before it give a stage slower than `t` whatever its transfer. The compute-only range of
    /// [`PrefixIndex`] ignores the all-reduce, which at low bandwidth leaves most cuts in; this
    /// binary search removes them.
    fn first_cut_within(
        &self,
        cuts: std::ops::Range<usize>,
        (j, r, after): (usize, usize, usize),
        t: f64,
    ) -> usize {
        let slower = |k: usize| {
            let (compute, all_reduce) = self.work(k + 1, j, r, after);
            compute + all_reduce > t
        };
        let (mut lo, mut hi) = (cuts.start, cuts.end);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if slower(mid) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// A lower bound on the slowest stage of any plan with exactly `stages` stages on all the
    /// workers, for the flush search's stopping rule (module docs, "Stopping").
    fn stage_count_bound(&self, stages: usize) -> f64 {
        let (n, w) = (self.n, self.w);
        let work =
            |i: usize| (self.pc[i + 1] - self.pc[i]) + (self.pu[i + 1] - self.pu[i]) * self.inv_m;
        let total = self.pc[n] + self.pu[n] * self.inv_m;
        // Some stage holds the heaviest layer on at most `w - stages + 1` replicas.
        let heaviest = (0..n).map(work).fold(0.0, f64::max) / (w + 1 - stages.min(w)) as f64;
        let floor = (total / w as f64).max(heaviest);
        if stages >= w {
            return floor;
        }
        // A replicated stage pays at least `P / (bw M) + 2 latency / M` per replica-microbatch
        // on its parameters `P`; at most `stages - 1` unreplicated stages, each of work at most
        // `T`, can hold parameters without paying it. (The cheaper of the two rings, where
        // hosts differ: a bound for either.)
        let per_byte = self.per_r[2].ring.min(self.per_r_between[2].ring) * 2.0;
        let latency = self.per_r[2]
            .ring_latency
            .min(self.per_r_between[2].ring_latency)
            * 2.0;
        let params = self.pp[n];
        let widest = |t: f64| {
            // Most parameter bytes in a run of layers whose work is at most `t` (two pointers).
            let (mut best, mut start, mut c, mut p) = (0.0f64, 0usize, 0.0f64, 0.0f64);
            for end in 0..n {
                c += work(end);
                p += self.pp[end + 1] - self.pp[end];
                while c > t && start <= end {
                    c -= work(start);
                    p -= self.pp[start + 1] - self.pp[start];
                    start += 1;
                }
                best = best.max(p);
            }
            best
        };
        let feasible = |t: f64| {
            let paid = (params - (stages - 1) as f64 * widest(t)).max(0.0);
            w as f64 * t >= total + paid * per_byte + latency
        };
        let (mut lo, mut hi) = (floor, (total + params * per_byte + latency) / w as f64);
        if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater) || feasible(lo) {
            return lo;
        }
        for _ in 0..60 {
            let mid = 0.5 * (lo + hi);
            if feasible(mid) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        // The bisection's lower end is infeasible: every plan is slower than it.
        lo
    }

    /// Bytes per worker of layers `from..=to` on `r` replicas with `after` workers at or after
    /// the stage, keeping its activations or recomputing them ([`super::memory`]).
    fn memory(&self, from: usize, to: usize, r: usize, after: usize, recompute: bool) -> f64 {
        let o = self.opts;
        let kept = if recompute { &self.pr } else { &self.ps };
        let stage = StageHeld {
            params: self.pp[to + 1] - self.pp[from],
            kept: kept[to + 1] - kept[from],
            in_flight: planned_in_flight(o.policy, o.microbatches, after as u64, r as u64),
            pass: self.pass.max(from, to),
            logits: if to + 1 == self.n {
                self.last_output
            } else {
                0.0
            },
        };
        o.worker_base + worker_bytes(o.policy, &[stage], 1.0, o.state_copies).total()
    }

    /// The bytes of a worker of layers `from..=to` that do not depend on the schedule's
    /// counts in flight: its base, drained state, working set and loss ([`super::memory`]);
    /// the simulator holds the rest.
    fn beside_schedule(&self, from: usize, to: usize) -> f64 {
        let o = self.opts;
        let stage = StageHeld {
            params: self.pp[to + 1] - self.pp[from],
            pass: self.pass.max(from, to),
            logits: if to + 1 == self.n {
                self.last_output
            } else {
                0.0
            },
            ..StageHeld::default()
        };
        let w = worker_bytes(o.policy, &[stage], 1.0, o.state_copies);
        o.worker_base + w.state + w.working + w.loss
    }

    /// Whether the stage recomputes: only where keeping its activations does not fit the
    /// memory bound and recomputing them does.
    fn recomputes(&self, from: usize, to: usize, r: usize, after: usize) -> bool {
        match self.opts.memory {
            Some(limit) => {
                self.memory(from, to, r, after, false) > limit
                    && self.memory(from, to, r, after, true) <= limit
            }
            None => false,
        }
    }

    /// Everything about layers `from..=to` on `r` replicas with `after` workers at or after.
    fn eval(&self, from: usize, to: usize, r: usize, after: usize) -> Eval {
        let recompute = self.recomputes(from, to, r, after);
        let (compute, all_reduce, transfer, time) = self.parts(from, to, r, after, recompute);
        Eval {
            compute,
            all_reduce,
            transfer,
            time,
            memory: self.memory(from, to, r, after, recompute),
            recompute,
        }
    }

    /// The stage's time if it fits the memory bound (recomputing where it must).
    fn time_if_fits(&self, from: usize, to: usize, r: usize, after: usize) -> Option<f64> {
        if self.opts.memory.is_none() {
            return Some(self.parts(from, to, r, after, false).3);
        }
        let e = self.eval(from, to, r, after);
        self.fits(&e).then_some(e.time)
    }

    fn fits(&self, e: &Eval) -> bool {
        self.opts.memory.is_none_or(|limit| e.memory <= limit)
    }
}

/// Checks that the planner plans `policy`: one contiguous stage per worker group. A plan file
/// naming another schedule is refused the same way.
///
/// # Errors
/// [`ScheduleError::Plan`] naming the schedule and those the planner plans.
pub fn check_plannable(policy: Policy) -> Result<()> {
    match policy {
        Policy::Sequential | Policy::Interleaved | Policy::ZbV | Policy::DualPipeV => {
            Err(ScheduleError::Plan(format!(
                "the planner plans one contiguous stage per worker group; schedule '{}' is not \
                 planned (use pipedream, pipedream-nostash, vsync, 2bw, gpipe, 1f1b-flush or \
                 zb-h1)",
                policy.name()
            )))
        }
        _ => Ok(()),
    }
}

#[derive(Clone, Copy)]
struct Cell {
    time: f64,
    /// Last layer of the prefix before this cell's last stage (`u32::MAX`: one stage).
    k: u32,
    /// Replicas of the last stage.
    r: u32,
    /// Stages in the plan: of two plans equally fast, the one with fewer stages wins (shorter
    /// pipeline, fewer transfers, less in flight).
    stages: u32,
}

impl Cell {
    fn beats(&self, other: &Cell) -> bool {
        self.time < other.time || (self.time == other.time && self.stages < other.stages)
    }
}

const EMPTY: Cell = Cell {
    time: f64::INFINITY,
    k: u32::MAX,
    r: 0,
    stages: u32::MAX,
};

/// One table of the dynamic program, `n x w` cells: cell `(j, m)`, at `m * n + j`, is the
/// best plan of layers `0..=j` on `m + 1` workers. Worker-major, so the cut loop (over `k` at
/// fixed workers) reads consecutive cells.
type Table = Vec<Cell>;

/// Fills a table. With `prev`, cell `(j, m)` is the best plan whose last stage follows a plan
/// from `prev` (one stage more than `prev`'s); without, the prefix comes from the table itself
/// (any number of stages) and a single stage on all `m + 1` workers competes too.
fn fill(costs: &Costs, prev: Option<&Table>) -> Table {
    let (n, w) = (costs.n, costs.w);
    let straight = costs.opts.straight;
    let index = PrefixIndex::new(&costs.pc);
    // Per worker count, the fastest prefix of `prev` ending at or after each layer: never
    // decreasing in the layer, so the cuts whose prefix alone is slower than the best found
    // are a tail of the range, cut off by a binary search.
    let fastest_from: Vec<f64> = prev.map_or_else(Vec::new, |prev| {
        let mut out = vec![f64::INFINITY; n * w];
        for q in 0..w {
            let mut least = f64::INFINITY;
            for k in (0..n).rev() {
                least = least.min(prev[q * n + k].time);
                out[q * n + k] = least;
            }
        }
        out
    });
    let mut cur: Table = vec![EMPTY; n * w];
    for j in 0..n {
        for m in 0..w {
            let mut best = if prev.is_none() {
                single_stage(costs, j, m)
            } else {
                EMPTY
            };
            if m > 0 && j > 0 {
                let prefix = prev.unwrap_or(&cur);
                let after_base = w - (m + 1);
                let consider = |k: usize, r: usize, best: &mut Cell| {
                    let before = prefix[(m - r) * n + k];
                    if before.time > best.time || !before.time.is_finite() {
                        return;
                    }
                    let Some(t) = costs.time_if_fits(k + 1, j, r, r + after_base) else {
                        return;
                    };
                    let cand = Cell {
                        time: before.time.max(t),
                        k: k as u32,
                        r: r as u32,
                        stages: before.stages + 1,
                    };
                    if cand.beats(best) {
                        *best = cand;
                    }
                };
                // Seed: the previous layer's best cut, its last stage grown by this layer.
                let seed = cur[m * n + j - 1];
                if seed.k != u32::MAX && seed.time.is_finite() {
                    consider(seed.k as usize, seed.r as usize, &mut best);
                }
                let max_r = if straight { 1 } else { m };
                for r in 1..=max_r {
                    let cuts = index.cuts_that_can_win(j, m, r, best.time);
                    let (first, end) = if best.time.is_finite() {
                        let first =
                            costs.first_cut_within(cuts.clone(), (j, r, r + after_base), best.time);
                        let end = if fastest_from.is_empty() {
                            cuts.end
                        } else {
                            let row = &fastest_from[(m - r) * n..(m - r + 1) * n];
                            first + row[first..cuts.end].partition_point(|&t| t <= best.time)
                        };
                        (first, end)
                    } else {
                        (cuts.start, cuts.end)
                    };
                    for k in first..end {
                        consider(k, r, &mut best);
                    }
                }
            }
            cur[m * n + j] = best;
        }
    }
    cur
}

/// The plan of layers `0..=j` as one stage on all `m + 1` workers (empty when it does not fit
/// the memory bound, or needs replicas a straight pipeline does not allow).
fn single_stage(costs: &Costs, j: usize, m: usize) -> Cell {
    if costs.opts.straight && m > 0 {
        return EMPTY;
    }
    let e = costs.eval(0, j, m + 1, costs.w);
    if !costs.fits(&e) {
        return EMPTY;
    }
    Cell {
        time: e.time,
        k: u32::MAX,
        r: (m + 1) as u32,
        stages: 1,
    }
}

/// The table of one-stage plans: the first of the per-stage-count tables (`tables[s]` holds
/// plans of `s + 1` stages).
fn first_layer(costs: &Costs) -> Table {
    let w = costs.w;
    (0..costs.n * w)
        .map(|i| single_stage(costs, i % costs.n, i / costs.n))
        .collect()
}

/// Refuses to hold `tables` tables of `n x w` cells past 1 GiB (flush schedules keep one table
/// per stage count).
fn check_table_memory(tables: usize, n: usize, w: usize) -> Result<()> {
    let bytes = tables
        .saturating_mul(n)
        .saturating_mul(w)
        .saturating_mul(std::mem::size_of::<Cell>());
    if bytes > 1 << 30 {
        return Err(ScheduleError::Plan(format!(
            "planning {n} layers on {w} workers for a flush schedule needs {tables} tables of \
             {n} x {w} cells, over 1 GiB; plan for fewer workers or an asynchronous schedule"
        )));
    }
    Ok(())
}

/// Walks a plan back from the last cell: `(from, to, replicas)` per stage, in order. `tables`
/// is one table (any stage count) or the per-stage-count tables up to the plan's.
fn walk(tables: &[Table], n: usize, w: usize) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    let (mut j, mut m) = (n - 1, w - 1);
    let mut s = tables.len() - 1;
    loop {
        let c = tables[s][m * n + j];
        if c.k == u32::MAX {
            out.push((0, j, c.r as usize));
            break;
        }
        let k = c.k as usize;
        out.push((k + 1, j, c.r as usize));
        j = k;
        m -= c.r as usize;
        s = s.saturating_sub(1);
    }
    out.reverse();
    out
}

fn make_plan(costs: &Costs, profile: &Profile, bounds: &[(usize, usize, usize)]) -> PartitionPlan {
    let o = costs.opts;
    let w = costs.w;
    let mut used = 0usize;
    let stages: Vec<PlannedStage> = bounds
        .iter()
        .map(|&(from, to, r)| {
            let e = costs.eval(from, to, r, w - used);
            used += r;
            // Overlapped, the transfer sets the time when it outlasts the work; serialised,
            // when it is the largest part.
            let rival = if o.overlap {
                e.compute + e.all_reduce
            } else {
                e.compute.max(e.all_reduce)
            };
            let bound = if e.transfer > rival {
                Bound::Transfer
            } else if e.all_reduce > e.compute {
                Bound::AllReduce
            } else {
                Bound::Compute
            };
            PlannedStage {
                layers: from..to + 1,
                replicas: r as u32,
                compute: e.compute,
                communication: e.all_reduce,
                transfer: e.transfer,
                time: e.time,
                param_bytes: costs.pp[to + 1] - costs.pp[from],
                memory: e.memory,
                recompute: e.recompute,
                bound,
                hosts: costs
                    .host_at
                    .get(used - r..used)
                    .map_or_else(Vec::new, <[u32]>::to_vec),
            }
        })
        .collect();
    let n = profile.layers.len();
    let time = stages.iter().map(|s| s.time).fold(0.0, f64::max);
    PartitionPlan {
        stages,
        time_per_microbatch: time,
        single_worker: costs.eval(0, n - 1, 1, 1).time,
        data_parallel: costs.eval(0, n - 1, w, w).time,
        cost_model: "default",
        policy: o.policy,
        microbatches: o.microbatches,
        simulated: None,
        order: (0..n).collect(),
    }
}

/// Plans `profile` under the default cost model (see the module docs).
///
/// # Errors
/// [`ScheduleError::Plan`] for bad options, a schedule the planner does not plan, or a memory
/// bound no plan meets; [`ScheduleError::Profile`] for a bad profile; simulator errors for
/// flush schedules.
pub fn plan(profile: &Profile, opts: &PlanOptions) -> Result<PartitionPlan> {
    profile.check()?;
    crate::limits::check_plan(profile.layers.len() as u64, u64::from(opts.workers))?;
    opts.check()?;
    let costs = Costs::new(profile, opts);
    let n = costs.n;
    let w = costs.w;
    if opts.straight && w > n {
        return Err(ScheduleError::Plan(format!(
            "{w} workers cannot each hold a stage of a {n}-layer model without replication"
        )));
    }
    let none = || {
        ScheduleError::Plan(format!(
            "no plan of {n} layers on {w} workers fits the memory bound"
        ))
    };
    let last = (w - 1) * n + (n - 1);
    check_table_memory(1, n, w)?;
    if !opts.policy.is_flush() {
        let table = fill(&costs, None);
        if !table[last].time.is_finite() {
            return Err(none());
        }
        return Ok(make_plan(&costs, profile, &walk(&[table], n, w)));
    }
    // Flush: the best plan for each stage count in turn, ranked by (M + S - 1) x slowest
    // stage. No S-stage plan scores under (M + S - 1) x C / W (its slowest stage is at least
    // the average), so the search stops once that bound passes the best score; the best few
    // of the stage counts tried are simulated.
    let m = f64::from(opts.microbatches);
    let keep = opts.candidates.max(1);
    // `stop[s]`: no plan of more than `s + 1` stages scores below it.
    let counts = n.min(w);
    let mut stop = vec![f64::INFINITY; counts + 1];
    for s in (0..counts).rev() {
        let score = (m + s as f64) * costs.stage_count_bound(s + 1);
        stop[s] = stop[s + 1].min(score);
    }
    let mut tables = vec![first_layer(&costs)];
    let mut ranked: Vec<(f64, usize)> = Vec::new();
    for s in 0..n.min(w) {
        if s > 0 {
            check_table_memory(s + 1, n, w)?;
            let next = fill(&costs, tables.last());
            tables.push(next);
        }
        let t = tables[s][last].time;
        if t.is_finite() {
            ranked.push(((m + s as f64) * t, s));
            ranked.sort_by(|a, b| a.0.total_cmp(&b.0));
            ranked.truncate(keep);
        }
        // No plan with more stages can score below the best so far.
        if ranked.first().is_some_and(|b| stop[s + 1] >= b.0) {
            break;
        }
    }
    if ranked.is_empty() {
        return Err(none());
    }
    let mut best: Option<PartitionPlan> = None;
    let mut failure = None;
    for &(_, s) in &ranked {
        let mut p = make_plan(&costs, profile, &walk(&tables[..=s], n, w));
        match simulate_plan(profile, &p, opts) {
            Ok(t) => p.simulated = Some(t),
            Err(e) => {
                // A layout the schedule cannot run is no candidate.
                failure.get_or_insert(e);
                continue;
            }
        }
        if best.as_ref().is_none_or(|b| p.simulated < b.simulated) {
            best = Some(p);
        }
    }
    match (best, failure) {
        (Some(p), _) => Ok(p),
        (None, Some(e)) => Err(e),
        (None, None) => Err(none()),
    }
}

/// [`plan`], then checked by the simulator against the simplest alternatives, keeping the
/// fastest simulated: for asynchronous schedules the program's plan, the best straight
/// pipeline (one worker per stage, when there are at least as many layers as workers) and plain
/// data parallelism (one stage on every worker), each that fits `--memory`. The program's
/// steady state cannot see how the schedules' fixed per-replica orders stall when replica
/// counts differ between stages (see docs/planning.md); the simulator does. Flush schedules
/// are already ranked by simulation in [`plan`]. The returned plan carries its simulated time.
///
/// # Errors
/// As [`plan`] and [`simulate_plan`].
pub fn plan_checked(profile: &Profile, opts: &PlanOptions) -> Result<PartitionPlan> {
    let first = plan(profile, opts)?;
    let n = profile.layers.len();
    let w = opts.workers as usize;
    let mut candidates = Vec::new();
    if !opts.policy.is_flush() && !opts.straight && w > 1 {
        if w <= n {
            let straight = PlanOptions {
                straight: true,
                ..opts.clone()
            };
            candidates.push(plan(profile, &straight));
        }
        candidates.push(explain(profile, opts, &[(0..n, w as u32)]));
    }
    let mut best: Option<PartitionPlan> = None;
    let mut failure = None;
    let fits = |p: &PartitionPlan| {
        opts.memory
            .is_none_or(|limit| p.stages.iter().all(|s| s.memory <= limit))
    };
    let layout_of = |p: &PartitionPlan| -> Vec<(std::ops::Range<usize>, u32)> {
        p.stages
            .iter()
            .map(|s| (s.layers.clone(), s.replicas))
            .collect()
    };
    for (i, candidate) in std::iter::once(Ok(first.clone()))
        .chain(candidates)
        .enumerate()
    {
        let Ok(mut p) = candidate else { continue };
        if !fits(&p) || (i > 0 && layout_of(&p) == layout_of(&first)) {
            continue;
        }
        // A layout the schedule cannot run (2BW with too few microbatches, say) is skipped.
        let (simulated, memory) = match simulate_plan_with_memory(profile, &p, opts) {
            Ok(r) => r,
            Err(e) => {
                failure.get_or_insert(e);
                continue;
            }
        };
        // What the real schedule holds, where it holds more than the model said (searched
        // in-flight depths on unequal layouts), and the bound checked again on it.
        for (st, held) in p.stages.iter_mut().zip(memory) {
            st.memory = st.memory.max(held);
        }
        if !fits(&p) {
            failure.get_or_insert(ScheduleError::Plan(format!(
                "the plan's simulated schedule holds more than the memory bound on a stage \
                 ({})",
                p.stages
                    .iter()
                    .map(|s| format!("{:.0} B", s.memory))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
            continue;
        }
        p.simulated = Some(simulated);
        if best
            .as_ref()
            .is_none_or(|b| b.simulated.is_some_and(|t| simulated < t))
        {
            best = Some(p);
        }
    }
    match (best, failure) {
        (Some(p), _) => Ok(p),
        (None, Some(e)) => Err(e),
        (None, None) => Ok(first),
    }
}

/// A given layout under the default model: `layout` lists each stage's layers and replicas, in
/// order, covering every layer once and using exactly `W` workers. What `pipe plan` compares
/// its plan with (a uniform split, a user's partition).
///
/// # Errors
/// [`ScheduleError::Plan`] when the layout does not tile the layers or does not use `W`
/// workers; as [`plan`] otherwise (the memory bound is reported, not enforced).
pub fn explain(
    profile: &Profile,
    opts: &PlanOptions,
    layout: &[(std::ops::Range<usize>, u32)],
) -> Result<PartitionPlan> {
    profile.check()?;
    opts.check()?;
    let costs = Costs::new(profile, opts);
    let mut next = 0;
    let mut bounds = Vec::with_capacity(layout.len());
    for (range, r) in layout {
        if range.start != next || range.is_empty() || *r == 0 {
            return Err(ScheduleError::Plan(format!(
                "layout stage {} ({range:?} on {r}) does not continue at layer {next}",
                bounds.len()
            )));
        }
        next = range.end;
        bounds.push((range.start, range.end - 1, *r as usize));
    }
    let used: usize = bounds.iter().map(|b| b.2).sum();
    if next != costs.n || used != costs.w {
        return Err(ScheduleError::Plan(format!(
            "the layout covers {next} of {} layers on {used} of {} workers",
            costs.n, costs.w
        )));
    }
    Ok(make_plan(&costs, profile, &bounds))
}

/// The best plan for every stage count `1..=min(W, L)` (None where no plan fits the memory
/// bound), by the slowest stage's time, without simulating: what [`plan`] picks from for flush
/// schedules.
///
/// # Errors
/// As [`plan`].
pub fn frontier(profile: &Profile, opts: &PlanOptions) -> Result<Vec<Option<PartitionPlan>>> {
    profile.check()?;
    crate::limits::check_plan(profile.layers.len() as u64, u64::from(opts.workers))?;
    opts.check()?;
    let costs = Costs::new(profile, opts);
    let (n, w) = (costs.n, costs.w);
    let mut tables = vec![first_layer(&costs)];
    for s in 1..n.min(w) {
        check_table_memory(s + 1, n, w)?;
        let next = fill(&costs, tables.last());
        tables.push(next);
    }
    Ok((0..tables.len())
        .map(|s| {
            tables[s][(w - 1) * n + (n - 1)]
                .time
                .is_finite()
                .then(|| make_plan(&costs, profile, &walk(&tables[..=s], n, w)))
        })
        .collect())
}

/// Per-stage costs of a plan's stages for the simulator: times and bytes summed over each
/// stage's layers, activations and gradients at the wire's size ([`range_costs`]).
pub fn stage_costs(profile: &Profile, plan: &PartitionPlan, wire: WireDtype) -> Vec<StageCost> {
    let ranges: Vec<_> = plan.stages.iter().map(|s| s.layers.clone()).collect();
    let mut costs = range_costs(profile, &ranges, wire);
    for (c, s) in costs.iter_mut().zip(&plan.stages) {
        c.param_bytes = s.param_bytes;
        if s.recompute {
            // The backward runs the recomputing layers' forward again first; a split
            // backward's weight half runs it once more.
            let layers = &profile.layers[s.layers.clone()];
            let again: f64 = layers
                .iter()
                .map(crate::profile::LayerProfile::recompute_forward)
                .sum();
            let whole = c.whole_backward();
            c.backward_input += again;
            c.backward_weight += again;
            c.backward = Some(whole + again);
            c.stash_bytes = Some(layers.iter().map(|l| l.recompute_stash()).sum());
        }
    }
    costs
}

/// Per-stage costs of stages given as layer ranges (any partition, any number of stages):
/// times, parameter and stash bytes summed over each stage's layers, the activation its last
/// layer sends at the wire's size.
///
/// # Panics
/// If a range runs past the profile's layers or is empty.
pub fn range_costs(
    profile: &Profile,
    ranges: &[std::ops::Range<usize>],
    wire: WireDtype,
) -> Vec<StageCost> {
    let crossing = profile.crossing_bytes();
    ranges
        .iter()
        .map(|r| {
            let layers = &profile.layers[r.clone()];
            let sum = |f: fn(&crate::profile::LayerProfile) -> f64| layers.iter().map(f).sum();
            StageCost {
                forward: sum(|l| l.forward),
                backward_input: sum(|l| l.backward_input),
                backward_weight: sum(|l| l.backward_weight),
                backward: layers
                    .iter()
                    .any(|l| l.backward.is_some())
                    .then(|| sum(|l| l.whole_backward())),
                update: sum(|l| l.update),
                activation_bytes: crossing[r.end - 1] * wire.factor(),
                gradient_bytes: None,
                param_bytes: sum(|l| l.param_bytes),
                stash_bytes: Some(sum(|l| l.stash())),
                all_reduce: None,
                buckets: None,
            }
        })
        .collect()
}

/// The simulator's seconds per microbatch for `plan` run with `opts`' schedule, link and
/// microbatch count: one minibatch for flush schedules (they repeat it exactly); for
/// asynchronous ones `2 S` minibatches (fill, then steady state), fewer when minibatches are
/// long (a minibatch is `M` times the largest replica count), but at
/// least one and about 20,000 microbatches at most.
///
/// # Errors
/// Errors of the schedule generator or the simulator (an impossible layout).
pub fn simulate_plan(profile: &Profile, plan: &PartitionPlan, opts: &PlanOptions) -> Result<f64> {
    Ok(simulate_plan_with_memory(profile, plan, opts)?.0)
}

/// [`simulate_plan`], and each stage's bytes per worker as the simulated schedule holds them:
/// the most any of its workers holds at once of stashed activations and weight versions (the
/// version plan of the real schedule, with the in-flight depths it actually uses), plus the
/// gradient and optimizer copies the cost model counts (`state_copies` parameter copies), and
/// the memory model's terms beside the schedule (the worker's base, drained state, working set
/// and loss: [`super::memory`]). Where the generator deepens unequal layouts ([`crate::ScheduleSpec::resolve`]) this is
/// more than the planner's own `ceil(a / r)` model.
///
/// # Errors
/// As [`simulate_plan`].
pub fn simulate_plan_with_memory(
    profile: &Profile,
    plan: &PartitionPlan,
    opts: &PlanOptions,
) -> Result<(f64, Vec<f64>)> {
    let stages = plan.stages.len() as u32;
    let replicas: Vec<u32> = plan.stages.iter().map(|s| s.replicas).collect();
    let spec = ScheduleSpec::new(opts.policy, stages, opts.microbatches).with_replicas(replicas);
    let minibatch = spec.resolve()?.minibatch.max(1);
    let updates = if opts.policy.is_flush() {
        1
    } else {
        (20_000 / minibatch).clamp(1, 2 * stages)
    };
    let schedule = lower(
        &generate(&spec.with_length(Length::Updates(updates)))?,
        LowerOptions::default(),
    );
    let mut stages = stage_costs(profile, plan, opts.wire);
    if opts.bucket_size != super::buckets::BucketSize::Whole {
        for (c, s) in stages.iter_mut().zip(&plan.stages) {
            let layers: Vec<super::buckets::LayerGradients> = plan.order[s.layers.clone()]
                .iter()
                .filter_map(|&l| profile.layers.get(l))
                .map(super::buckets::LayerGradients::of)
                .collect();
            let buckets = super::buckets::buckets_of(&layers, opts.bucket_size, 4.0);
            c.buckets = (buckets.len() > 1).then_some(buckets);
        }
    }
    let costs = CostModel {
        stages,
        bandwidth: opts.bandwidth,
        latency: opts.latency,
        overlap: opts.overlap,
        cores: opts.cores,
        message_cpu: opts.message_cpu,
        byte_cpu: opts.byte_cpu,
        hosts: opts.hosts.as_ref().map_or_else(Vec::new, |h| {
            h.of_positions(plan.stages.iter().map(|s| s.replicas as usize).sum())
        }),
        between: opts.hosts.as_ref().map(|h| h.between),
    };
    let report = simulate(&schedule, &costs, SimOptions::default())?;
    let layout = schedule.layout();
    let model = Costs::new(profile, opts);
    let beside: Vec<f64> = plan
        .stages
        .iter()
        .map(|st| model.beside_schedule(st.layers.start, st.layers.end - 1))
        .collect();
    let memory = plan
        .stages
        .iter()
        .enumerate()
        .map(|(s, st)| {
            let held = layout
                .group(s as u32)
                .map(|w| report.workers[w as usize].memory.total)
                .fold(0.0, f64::max);
            held + opts.state_copies * st.param_bytes + beside[s]
        })
        .collect();
    Ok((report.makespan / f64::from(report.microbatches), memory))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::profile::LayerProfile;
    use proptest::prelude::*;

    fn layer() -> impl Strategy<Value = LayerProfile> {
        (
            0.0f64..4.0,
            0.0f64..4.0,
            0.0f64..1.0,
            0.0f64..2e4,
            0.0f64..1e4,
        )
            .prop_map(
                |(forward, backward, update, param_bytes, activation_bytes)| LayerProfile {
                    name: String::new(),
                    forward,
                    backward_input: backward / 2.0,
                    backward_weight: backward / 2.0,
                    backward: None,
                    update,
                    activation_bytes,
                    param_bytes,
                    stash_bytes: None,
                    recompute_stash_bytes: None,
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        /// The flush search stops on `stage_count_bound`: it must never exceed the best plan of
        /// that many stages, at any bandwidth, latency and overlap.
        #[test]
        fn the_stage_count_bound_is_below_every_plan_of_that_many_stages(
            layers in prop::collection::vec(layer(), 1..=9),
            w in 1u32..=7,
            b in prop::sample::select(vec![1e2, 1e3, 1e5]),
            latency in prop::sample::select(vec![0.0, 0.3]),
            overlap in any::<bool>(),
            microbatches in 1u32..=4,
        ) {
            let p = Profile::chain(layers);
            let o = PlanOptions {
                latency,
                overlap,
                microbatches,
                policy: Policy::OneFOneBFlush,
                ..PlanOptions::new(w, b)
            };
            let costs = Costs::new(&p, &o);
            for (s, plan) in frontier(&p, &o).unwrap().iter().enumerate() {
                let bound = costs.stage_count_bound(s + 1);
                if let Some(plan) = plan {
                    prop_assert!(bound <= plan.time_per_microbatch * (1.0 + 1e-12),
                        "{} stages: bound {} plan {}", s + 1, bound, plan.time_per_microbatch);
                }
            }
        }
    }
}
