//! The planner's shared vocabulary: options, planned stages and plans, what bounds a stage,
//! PipeDream's stage formula, the bound on a planning table's size, and the index over compute
//! prefix sums that prunes cut searches.
//! Its own file so that the planning programs (`mod.rs`, `model.rs`, `antichain.rs`) import
//! it without importing each other.

/// Settings of PipeDream's optimizer.
#[derive(Clone, Debug, PartialEq)]
pub struct PipeDreamOptions {
    /// Workers to use (all of them).
    pub workers: u32,
    /// Link bandwidth, bytes per second.
    pub bandwidth: f64,
    /// Per-worker memory bound in bytes, if any.
    pub memory: Option<f64>,
    /// No replication: every stage on one worker.
    pub straight: bool,
    /// Activation compression ratio; when set, activation transfers count.
    pub activation_compression: Option<f64>,
}

impl PipeDreamOptions {
    /// `workers` at `bandwidth` bytes/s, no memory bound, replication allowed.
    pub fn new(workers: u32, bandwidth: f64) -> Self {
        PipeDreamOptions {
            workers,
            bandwidth,
            memory: None,
            straight: false,
            activation_compression: None,
        }
    }
}

/// One stage of a plan.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedStage {
    /// Layers, as indices into the profile.
    pub layers: std::ops::Range<usize>,
    /// Replicas.
    pub replicas: u32,
    /// Compute per worker per microbatch: the stage's compute time over its replicas.
    pub compute: f64,
    /// Data-parallel communication per microbatch per worker: `4 (r-1) P / (B r) / r`.
    pub communication: f64,
    /// Activation transfer time counted for the stage (0 unless compression is given).
    pub transfer: f64,
    /// The stage's time in the plan: what the cost model makes of the three above (PipeDream:
    /// `compute + communication`, or the transfer if larger).
    pub time: f64,
    /// Parameter bytes.
    pub param_bytes: f64,
    /// Bytes per worker the cost model charges the stage against the memory bound.
    pub memory: f64,
    /// The stage's backward recomputes its activations (the default cost model's choice
    /// where keeping them does not fit the memory bound).
    pub recompute: bool,
    /// Which part of the stage's time sets it.
    pub bound: Bound,
    /// The host of each of its replicas, where the plan places workers on hosts
    /// ([`super::placement`]); empty otherwise.
    pub hosts: Vec<u32>,
}

/// The part of a stage's time that sets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// Forward, backward and update compute.
    Compute,
    /// The replicas' gradient all-reduce.
    AllReduce,
    /// Activation and gradient transfers between stages.
    Transfer,
}

impl Bound {
    /// The bound of a PipeDream-model stage: transfer when it outlasts compute plus
    /// all-reduce, else the larger of those two.
    pub(crate) fn of(compute: f64, communication: f64, transfer: f64) -> Self {
        if transfer > compute + communication {
            Bound::Transfer
        } else if communication > compute {
            Bound::AllReduce
        } else {
            Bound::Compute
        }
    }

    /// Words for plans.
    pub fn describe(self) -> &'static str {
        match self {
            Bound::Compute => "compute",
            Bound::AllReduce => "gradient all-reduce",
            Bound::Transfer => "activation transfer",
        }
    }
}

/// A plan and what it predicts.
#[derive(Clone, Debug, PartialEq)]
pub struct PartitionPlan {
    /// Stages in pipeline order.
    pub stages: Vec<PlannedStage>,
    /// The slowest stage's time: seconds per microbatch in steady state.
    pub time_per_microbatch: f64,
    /// One worker's time per microbatch (all compute, no communication).
    pub single_worker: f64,
    /// `W`-worker data parallelism's time per microbatch under the same cost model (PipeDream:
    /// `(C + 4 (W-1) P / (B W)) / W`).
    pub data_parallel: f64,
    /// Which cost model made the plan: `pipedream` or `default`.
    pub cost_model: &'static str,
    /// The schedule the plan was made for (the default model's memory and bubble depend on
    /// it; PipeDream's model assumes its own asynchronous schedule).
    pub policy: crate::spec::Policy,
    /// Microbatches per update per replica the plan assumed.
    pub microbatches: u32,
    /// The simulator's time per microbatch for the plan, when it was simulated (flush
    /// schedules: the pipeline's fill and drain included).
    pub simulated: Option<f64>,
    /// The layer order the stages' ranges index: the profile's own order, except for
    /// PipeDream-model plans of branching graphs, whose stages are differences of antichain
    /// states listed one after another.
    pub order: Vec<usize>,
}

impl PartitionPlan {
    /// Speed-up over one worker.
    pub fn speedup_over_single(&self) -> f64 {
        self.single_worker / self.time_per_microbatch
    }

    /// Speed-up over data parallelism on the same workers.
    pub fn speedup_over_data_parallel(&self) -> f64 {
        self.data_parallel / self.time_per_microbatch
    }

    /// Indices of the first layer of every stage after the first.
    pub fn cuts(&self) -> Vec<usize> {
        self.stages.iter().skip(1).map(|s| s.layers.start).collect()
    }
}

/// Compute prefix sums `pc` (never decreasing) with a bucket index over their values, so
/// "the first prefix at or above `v`" takes a step or two instead of a binary search: the
/// planners ask it twice per cut range, millions of times on big profiles.
pub(crate) struct PrefixIndex<'a> {
    pc: &'a [f64],
    /// `first[q]`: the first index whose value is at least `q * step`.
    first: Vec<usize>,
    step: f64,
}

impl<'a> PrefixIndex<'a> {
    pub(crate) fn new(pc: &'a [f64]) -> Self {
        let n = pc.len();
        let top = pc.last().copied().unwrap_or(0.0);
        let buckets = 4 * n;
        let step = if top > 0.0 { top / buckets as f64 } else { 1.0 };
        let mut first = Vec::with_capacity(buckets + 2);
        let mut i = 0;
        for q in 0..=buckets + 1 {
            let v = q as f64 * step;
            while i < n && pc[i] < v {
                i += 1;
            }
            first.push(i);
        }
        PrefixIndex { pc, first, step }
    }

    /// The first index `i` in `1..=j` with `pc[i] >= v` (or `>` when `strict`), else `j + 1`.
    pub(crate) fn first_from(&self, v: f64, strict: bool, j: usize) -> usize {
        let q = (v / self.step).floor();
        let mut i = if q.is_nan() || q < 1.0 {
            1
        } else if q as usize >= self.first.len() {
            j + 1
        } else {
            // Buckets may undershoot by rounding: step back to be safe.
            self.first[q as usize].saturating_sub(1).max(1)
        };
        let past = |x: f64| if strict { x > v } else { x >= v };
        while i > 1 && past(self.pc[i - 1]) {
            i -= 1;
        }
        while i <= j && !past(self.pc[i]) {
            i += 1;
        }
        i.min(j + 1)
    }

    /// The cuts `k` (prefix `0..=k` on `m - r + 1` workers, then the stage `k+1..=j` on `r`)
    /// that can beat the best time `t` found so far: a stage is never faster than its compute
    /// over its replicas, nor a prefix than its compute over its workers (the slowest stage is
    /// at least the average), so only `pc[k+1]` in `[pc[j+1] - r t, (m - r + 1) t]`
    /// qualifies. Every cut when `t` is infinite.
    pub(crate) fn cuts_that_can_win(
        &self,
        j: usize,
        m: usize,
        r: usize,
        t: f64,
    ) -> std::ops::Range<usize> {
        if !t.is_finite() {
            return 0..j;
        }
        let low = self.pc[j + 1] - r as f64 * t;
        let high = (m - r + 1) as f64 * t;
        let lo = self.first_from(low, false, j) - 1;
        let hi = self.first_from(high, true, j) - 1;
        lo..hi.max(lo)
    }
}

/// PipeDream's time for a stage of compute `c` and parameter bytes `p` on `r` replicas at
/// bandwidth `b`: `(c + 4 (r-1) p / (b r)) / r`.
pub(crate) fn pipedream_stage_time(c: f64, p: f64, r: f64, b: f64) -> f64 {
    (c + 4.0 * (r - 1.0) * p / (b * r)) / r
}

/// Refuses a dynamic program's table of `rows` (layers or antichain states) by `w` workers of
/// `cell_bytes` each past 1 GiB.
pub(crate) fn check_table(
    rows: usize,
    what: &str,
    w: usize,
    cell_bytes: usize,
) -> crate::error::Result<()> {
    if rows.saturating_mul(w).saturating_mul(cell_bytes) > 1 << 30 {
        return Err(crate::error::ScheduleError::Plan(format!(
            "a table of {rows} {what} x {w} workers is over 1 GiB"
        )));
    }
    Ok(())
}
