//! Partitioning: which layers each stage gets and how many replicas each stage runs on.
//!
//! [`pipedream`] is PipeDream's optimizer, formula for formula, so its published plans can be
//! reproduced: a dynamic program over contiguous stages and per-stage replication that
//! minimises the slowest stage's time. A stage of compute time `C` (forward plus backward) and
//! parameter bytes `P` on `r` replicas costs `(C + 4 (r-1) P / (B r)) / r` at bandwidth `B`.
//! Activation transfers count only when an activation compression ratio is given (input and
//! output each `2 a / (B r) / ratio`, compared with, not added to, compute), and the optional
//! memory bound keeps a stage's stash, `ceil((W - used) / r) * (activations + parameters)`,
//! under the limit, both as PipeDream's code has them. Every plan uses exactly `W` workers.
//!
//! PipeDream charges transfers asymmetrically, and so does this: the first stage never pays
//! for its output; every later stage pays for its input and (unless last) its output at its
//! own replica count.
//!
//! Layer graphs that branch are planned the way PipeDream plans them, over its antichain
//! states ([`antichain`]): a state is everything at or before an antichain, a stage the
//! difference of two states, and a cut sends the activations of every layer in the state with
//! an edge leaving it. On a chain the states are its prefixes and the program below runs.
//! [`plan`] (the default model) plans every graph over the prefixes of its topological order,
//! which is exact for the chains pipe trains; on branching graphs it can miss cuts through a
//! residual block at two depths.
//!
//! The program runs over `L` layers: `A[j][m]` is the best time for layers `0..=j` on `m + 1`
//! workers, either one stage replicated `m + 1` times or a best prefix `A[k][m - r]` followed
//! by the stage `k+1..=j` on `r` workers. That is `O(L^2 W^2)` as written; the search over `k`
//! is cut, exactly, to the cuts whose compute bounds can still beat the best time found.

pub mod antichain;
mod model;

pub use model::{
    PlanOptions, WireDtype, explain, frontier, plan, plan_checked, simulate_plan, stage_costs,
};

use crate::error::{Result, ScheduleError};
use crate::profile::Profile;

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
    /// Which part of the stage's time sets it.
    pub bound: Bound,
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
    fn of(compute: f64, communication: f64, transfer: f64) -> Self {
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

#[derive(Clone, Copy)]
struct Cell {
    time: f64,
    /// `(k, m_rest)`: the prefix `0..=k` on `m_rest + 1` workers; `None` for one stage.
    split: Option<(usize, usize)>,
    replicas: u32,
}

/// Compute prefix sums `pc` (never decreasing) with a bucket index over their values, so
/// "the first prefix at or above `v`" takes a step or two instead of a binary search: the
/// planners ask it twice per cut range, millions of times on big profiles.
struct PrefixIndex<'a> {
    pc: &'a [f64],
    /// `first[q]`: the first index whose value is at least `q * step`.
    first: Vec<usize>,
    step: f64,
}

impl<'a> PrefixIndex<'a> {
    fn new(pc: &'a [f64]) -> Self {
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
    fn first_from(&self, v: f64, strict: bool, j: usize) -> usize {
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
    fn cuts_that_can_win(&self, j: usize, m: usize, r: usize, t: f64) -> std::ops::Range<usize> {
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
fn pipedream_stage_time(c: f64, p: f64, r: f64, b: f64) -> f64 {
    (c + 4.0 * (r - 1.0) * p / (b * r)) / r
}

/// PipeDream's optimizer (see the module docs).
///
/// # Errors
/// [`ScheduleError::Plan`] for zero workers, a bandwidth that is not positive, or a memory
/// bound no plan meets; [`ScheduleError::Profile`] for a bad profile.
pub fn pipedream(profile: &Profile, opts: &PipeDreamOptions) -> Result<PartitionPlan> {
    profile.check()?;
    if opts.workers > 4096 {
        return Err(ScheduleError::Plan(format!(
            "{} workers is more than 4096",
            opts.workers
        )));
    }
    if !profile.is_chain() {
        return antichain::plan(profile, opts);
    }
    if opts.workers == 0 {
        return Err(ScheduleError::Plan("need at least one worker".into()));
    }
    if opts.bandwidth.is_nan() || opts.bandwidth <= 0.0 {
        return Err(ScheduleError::Plan(format!(
            "bandwidth must be > 0 bytes/s, got {}",
            opts.bandwidth
        )));
    }
    let layers = &profile.layers;
    let crossing = profile.crossing_bytes();
    let n = layers.len();
    let w = opts.workers as usize;
    let b = opts.bandwidth;
    // Prefix sums: compute, activation and parameter bytes of layers 0..i.
    let mut pc = vec![0.0f64; n + 1];
    let mut pa = vec![0.0f64; n + 1];
    let mut pp = vec![0.0f64; n + 1];
    for (i, l) in layers.iter().enumerate() {
        pc[i + 1] = pc[i] + l.compute();
        pa[i + 1] = pa[i] + l.activation_bytes;
        pp[i + 1] = pp[i] + l.param_bytes;
    }
    let range = |from: usize, to: usize| (pc[to + 1] - pc[from], pp[to + 1] - pp[from]);
    let index = PrefixIndex::new(&pc);
    let stage_time = |c: f64, p: f64, r: f64| pipedream_stage_time(c, p, r, b);
    let fits = |from: usize, to: usize, copies: usize| match opts.memory {
        None => true,
        Some(limit) => {
            let act = pa[to + 1] - pa[from];
            let par = pp[to + 1] - pp[from];
            copies as f64 * (act + par) <= limit
        }
    };
    let out_act = |i: usize| crossing[i];
    let none = Cell {
        time: f64::INFINITY,
        split: None,
        replicas: 0,
    };
    if n.saturating_mul(w)
        .saturating_mul(std::mem::size_of::<Cell>())
        > 1 << 30
    {
        return Err(ScheduleError::Plan(format!(
            "a table of {n} layers x {w} workers is over 1 GiB"
        )));
    }
    let mut a = vec![none; n * w];
    for j in 0..n {
        let (c, p) = range(0, j);
        let max_m = if opts.straight { 1 } else { w };
        for m in 0..max_m {
            if fits(0, j, (w - (m + 1)).div_ceil(m + 1)) {
                a[j * w + m] = Cell {
                    time: stage_time(c, p, (m + 1) as f64),
                    split: None,
                    replicas: (m + 1) as u32,
                };
            }
        }
        for m in 1..w {
            let mut best = a[j * w + m];
            let max_r = if opts.straight { 1 } else { m };
            for r in 1..=max_r {
                for k in index.cuts_that_can_win(j, m, r, best.time) {
                    let prev = a[k * w + (m - r)].time;
                    if !prev.is_finite() || prev >= best.time {
                        continue;
                    }
                    if !fits(k + 1, j, (w - (m + 1)).div_ceil(r)) {
                        continue;
                    }
                    let (c, p) = range(k + 1, j);
                    let mut t = prev.max(stage_time(c, p, r as f64));
                    if let Some(ratio) = opts.activation_compression {
                        let rf = r as f64;
                        t = t.max(2.0 * out_act(k) / (b * rf) / ratio);
                        if j + 1 < n {
                            t = t.max(2.0 * out_act(j) / (b * rf) / ratio);
                        }
                    }
                    if t < best.time {
                        best = Cell {
                            time: t,
                            split: Some((k, m - r)),
                            replicas: r as u32,
                        };
                    }
                }
            }
            a[j * w + m] = best;
        }
    }
    let top = a[(n - 1) * w + (w - 1)];
    if !top.time.is_finite() {
        return Err(ScheduleError::Plan(format!(
            "no plan of {n} layers on {w} workers fits the memory bound"
        )));
    }
    // Walk the splits back from the last stage.
    let mut bounds = Vec::new();
    let (mut j, mut cell) = (n - 1, top);
    loop {
        match cell.split {
            Some((k, rest)) => {
                bounds.push((k + 1, j, cell.replicas));
                j = k;
                cell = a[k * w + rest];
            }
            None => {
                bounds.push((0, j, cell.replicas));
                break;
            }
        }
    }
    bounds.reverse();
    let mut upto = 0usize;
    let stages = bounds
        .iter()
        .map(|&(from, to, r)| {
            upto += r as usize;
            let (c, p) = range(from, to);
            let rf = f64::from(r);
            let compute = c / rf;
            let communication = 4.0 * (rf - 1.0) * p / (b * rf) / rf;
            let transfer = match opts.activation_compression {
                Some(ratio) if from > 0 => {
                    let output = if to + 1 < n { out_act(to) } else { 0.0 };
                    2.0 * out_act(from - 1).max(output) / (b * rf) / ratio
                }
                _ => 0.0,
            };
            let bound = Bound::of(compute, communication, transfer);
            let copies = (w - upto).div_ceil(r as usize) as f64;
            PlannedStage {
                layers: from..to + 1,
                replicas: r,
                compute,
                communication,
                transfer,
                time: (compute + communication).max(transfer),
                param_bytes: p,
                memory: copies * (pa[to + 1] - pa[from] + p),
                bound,
            }
        })
        .collect();
    let total = pc[n];
    let wf = w as f64;
    Ok(PartitionPlan {
        stages,
        time_per_microbatch: top.time,
        single_worker: total,
        data_parallel: stage_time(total, pp[n], wf),
        cost_model: "pipedream",
        policy: crate::spec::Policy::PipeDream,
        microbatches: 1,
        simulated: None,
        order: (0..n).collect(),
    })
}

/// The exact min-max split of a chain's layers into `stages` contiguous, non-empty stages by
/// compute time (forward plus backward), one worker each and no communication: the split whose
/// slowest stage is fastest. A dynamic program over prefixes, `O(stages x L^2)`; ties go to the
/// earliest cut.
///
/// # Errors
/// [`ScheduleError::Plan`] for zero stages or more stages than layers;
/// [`ScheduleError::Profile`] for a bad profile.
pub fn balanced(profile: &Profile, stages: usize) -> Result<Vec<std::ops::Range<usize>>> {
    profile.check()?;
    let n = profile.layers.len();
    if stages == 0 || stages > n {
        return Err(ScheduleError::Plan(format!(
            "cannot split {n} layers into {stages} non-empty stages"
        )));
    }
    let mut pc = vec![0.0f64; n + 1];
    for (i, l) in profile.layers.iter().enumerate() {
        pc[i + 1] = pc[i] + l.compute();
    }
    // best[s][j]: slowest stage of the best split of layers 0..j into s + 1 stages.
    let mut best = vec![vec![f64::INFINITY; n + 1]; stages];
    let mut cut = vec![vec![0usize; n + 1]; stages];
    best[0][1..=n].copy_from_slice(&pc[1..=n]);
    for s in 1..stages {
        for j in s + 1..=n {
            for k in s..j {
                let t = best[s - 1][k].max(pc[j] - pc[k]);
                if t < best[s][j] {
                    best[s][j] = t;
                    cut[s][j] = k;
                }
            }
        }
    }
    let mut ranges = Vec::with_capacity(stages);
    let mut end = n;
    for s in (1..stages).rev() {
        let k = cut[s][end];
        ranges.push(k..end);
        end = k;
    }
    ranges.push(0..end);
    ranges.reverse();
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_index_finds_what_a_binary_search_finds() {
        // Monotone prefix sums with runs of equal values (zero-cost layers), probed at, between,
        // below and above every value.
        let mut state = 7u64;
        for n in [1usize, 2, 5, 40] {
            let mut pc = vec![0.0f64];
            for _ in 0..n {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let step = if state >> 62 == 0 {
                    0.0
                } else {
                    (state >> 40) as f64 / 1e6
                };
                pc.push(pc[pc.len() - 1] + step);
            }
            let index = PrefixIndex::new(&pc);
            let mut probes: Vec<f64> = pc.clone();
            probes.extend(pc.windows(2).map(|w| (w[0] + w[1]) / 2.0));
            probes.extend([-1.0, pc[n] + 1.0, pc[n] * 10.0]);
            for j in 1..=n {
                for &v in &probes {
                    let at_least = 1 + pc[1..=j].partition_point(|&x| x < v);
                    let above = 1 + pc[1..=j].partition_point(|&x| x <= v);
                    assert_eq!(index.first_from(v, false, j), at_least, "n {n} j {j} v {v}");
                    assert_eq!(index.first_from(v, true, j), above, "n {n} j {j} v {v}");
                }
            }
        }
    }
}
