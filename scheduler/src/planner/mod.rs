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
pub mod buckets;
pub mod memory;
mod model;
pub mod placement;
pub mod transport;
mod types;

pub use model::{
    PlanOptions, WireDtype, check_plannable, explain, frontier, plan, plan_checked, range_costs,
    simulate_plan, simulate_plan_with_memory, stage_costs,
};

use crate::error::{Result, ScheduleError};
use crate::profile::Profile;
pub use types::{Bound, PartitionPlan, PipeDreamOptions, PlannedStage};
pub(crate) use types::{PrefixIndex, check_table, pipedream_stage_time};

#[derive(Clone, Copy)]
struct Cell {
    time: f64,
    /// `(k, m_rest)`: the prefix `0..=k` on `m_rest + 1` workers; `None` for one stage.
    split: Option<(usize, usize)>,
    replicas: u32,
}

/// Refuses a chain plan for no workers or a bandwidth that is not positive.
fn check_workers_and_bandwidth(opts: &PipeDreamOptions) -> Result<()> {
    if opts.workers == 0 {
        return Err(ScheduleError::Plan("need at least one worker".into()));
    }
    if opts.bandwidth.is_nan() || opts.bandwidth <= 0.0 {
        return Err(ScheduleError::Plan(format!(
            "bandwidth must be > 0 bytes/s, got {}",
            opts.bandwidth
        )));
    }
    Ok(())
}

/// The stages of the best plan of `n` layers on `w` workers in table `a`, first to last, as
/// (first layer, last layer, replicas): the splits walked back from the last stage.
fn walk_back(a: &[Cell], n: usize, w: usize) -> Vec<(usize, usize, u32)> {
    let mut bounds = Vec::new();
    let (mut j, mut cell) = (n - 1, a[(n - 1) * w + (w - 1)]);
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
    bounds
}

/// Prefix sums over a chain's layers: entry `i` of each is the total of layers `0..i`.
struct ChainSums {
    /// Compute time (forward plus backward).
    compute: Vec<f64>,
    /// Activation bytes.
    activations: Vec<f64>,
    /// Parameter bytes.
    params: Vec<f64>,
}

impl ChainSums {
    /// The prefix sums of `layers`.
    fn new(layers: &[crate::LayerProfile]) -> Self {
        let n = layers.len();
        let mut pc = vec![0.0f64; n + 1];
        let mut pa = vec![0.0f64; n + 1];
        let mut pp = vec![0.0f64; n + 1];
        for (i, l) in layers.iter().enumerate() {
            pc[i + 1] = pc[i] + l.compute();
            pa[i + 1] = pa[i] + l.activation_bytes;
            pp[i + 1] = pp[i] + l.param_bytes;
        }
        ChainSums {
            compute: pc,
            activations: pa,
            params: pp,
        }
    }

    /// Compute time and parameter bytes of layers `from..=to`.
    fn range(&self, from: usize, to: usize) -> (f64, f64) {
        (
            self.compute[to + 1] - self.compute[from],
            self.params[to + 1] - self.params[from],
        )
    }

    /// Activation bytes of layers `from..=to`.
    fn activations(&self, from: usize, to: usize) -> f64 {
        self.activations[to + 1] - self.activations[from]
    }

    /// Whether `copies` stashed copies of the activations and parameters of layers
    /// `from..=to` stay under the memory bound `memory` (always, without one).
    fn fits(&self, memory: Option<f64>, from: usize, to: usize, copies: usize) -> bool {
        match memory {
            None => true,
            Some(limit) => {
                let act = self.activations(from, to);
                let par = self.params[to + 1] - self.params[from];
                copies as f64 * (act + par) <= limit
            }
        }
    }
}

/// PipeDream's optimizer (see the module docs).
///
/// # Errors
/// [`ScheduleError::Plan`] for zero workers, a bandwidth that is not positive, or a memory
/// bound no plan meets; [`ScheduleError::Profile`] for a bad profile.
pub fn pipedream(profile: &Profile, opts: &PipeDreamOptions) -> Result<PartitionPlan> {
    profile.check()?;
    crate::limits::check_plan(profile.layers.len() as u64, u64::from(opts.workers))?;
    if opts.workers > 4096 {
        return Err(ScheduleError::Plan(format!(
            "{} workers is more than 4096",
            opts.workers
        )));
    }
    if !profile.is_chain() {
        return antichain::plan(profile, opts);
    }
    check_workers_and_bandwidth(opts)?;
    let layers = &profile.layers;
    let crossing = profile.crossing_bytes();
    let n = layers.len();
    let w = opts.workers as usize;
    let sums = ChainSums::new(layers);
    let a = chain_table(&sums, &crossing, opts)?;
    let top = a[(n - 1) * w + (w - 1)];
    if !top.time.is_finite() {
        return Err(ScheduleError::Plan(format!(
            "no plan of {n} layers on {w} workers fits the memory bound"
        )));
    }
    let bounds = walk_back(&a, n, w);
    let stages = chain_stages(&bounds, &sums, &crossing, opts);
    let total = sums.compute[n];
    let wf = w as f64;
    Ok(PartitionPlan {
        stages,
        time_per_microbatch: top.time,
        single_worker: total,
        data_parallel: pipedream_stage_time(total, sums.params[n], wf, opts.bandwidth),
        cost_model: "pipedream",
        policy: crate::spec::Policy::PipeDream,
        microbatches: 1,
        simulated: None,
        order: (0..n).collect(),
    })
}

/// PipeDream's table over a chain (see the module docs): `a[j * w + m]` is the best time for
/// layers `0..=j` on `m + 1` workers, infinite where no plan fits the memory bound.
/// `crossing[i]` is the activation bytes a cut after layer `i` sends.
///
/// # Errors
/// [`ScheduleError::Plan`] for a table too large to hold.
fn chain_table(sums: &ChainSums, crossing: &[f64], opts: &PipeDreamOptions) -> Result<Vec<Cell>> {
    let n = sums.compute.len() - 1;
    let w = opts.workers as usize;
    let b = opts.bandwidth;
    let index = PrefixIndex::new(&sums.compute);
    let stage_time = |c: f64, p: f64, r: f64| pipedream_stage_time(c, p, r, b);
    let fits = |from: usize, to: usize, copies: usize| sums.fits(opts.memory, from, to, copies);
    let none = Cell {
        time: f64::INFINITY,
        split: None,
        replicas: 0,
    };
    check_table(n, "layers", w, std::mem::size_of::<Cell>())?;
    let mut a = vec![none; n * w];
    for j in 0..n {
        let (c, p) = sums.range(0, j);
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
                    let (c, p) = sums.range(k + 1, j);
                    let mut t = prev.max(stage_time(c, p, r as f64));
                    if let Some(ratio) = opts.activation_compression {
                        let rf = r as f64;
                        t = t.max(2.0 * crossing[k] / (b * rf) / ratio);
                        if j + 1 < n {
                            t = t.max(2.0 * crossing[j] / (b * rf) / ratio);
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
    Ok(a)
}

/// The planned stages of a chain plan's `bounds` (first layer, last layer, replicas), first to
/// last, with their times and memory as PipeDream's optimizer charges them.
fn chain_stages(
    bounds: &[(usize, usize, u32)],
    sums: &ChainSums,
    crossing: &[f64],
    opts: &PipeDreamOptions,
) -> Vec<PlannedStage> {
    let n = sums.compute.len() - 1;
    let w = opts.workers as usize;
    let b = opts.bandwidth;
    let mut upto = 0usize;
    bounds
        .iter()
        .map(|&(from, to, r)| {
            upto += r as usize;
            let (c, p) = sums.range(from, to);
            let rf = f64::from(r);
            let compute = c / rf;
            let communication = 4.0 * (rf - 1.0) * p / (b * rf) / rf;
            let transfer = match opts.activation_compression {
                Some(ratio) if from > 0 => {
                    let output = if to + 1 < n { crossing[to] } else { 0.0 };
                    2.0 * crossing[from - 1].max(output) / (b * rf) / ratio
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
                memory: copies * (sums.activations(from, to) + p),
                recompute: false,
                bound,
                hosts: Vec::new(),
            }
        })
        .collect()
}

/// The exact min-max split of a chain's layers into `stages` contiguous, non-empty stages by
/// compute time (forward plus backward), one worker each and no communication: the split whose
/// slowest stage is fastest. A dynamic program over prefixes, `O(stages x L^2)`; ties go to the
/// earliest cut. [`balanced_replicated`] with one replica per stage.
///
/// # Errors
/// [`ScheduleError::Plan`] for zero stages or more stages than layers;
/// [`ScheduleError::Profile`] for a bad profile.
pub fn balanced(profile: &Profile, stages: usize) -> Result<Vec<std::ops::Range<usize>>> {
    balanced_replicated(profile, &vec![1; stages])
}

/// [`balanced`] for stages with `replicas[s]` replicas each: stage `s`'s time is its compute
/// over its replicas (they take its microbatches in turn), so a replicated stage takes
/// proportionally more layers.
///
/// # Errors
/// As [`balanced`]; a zero replica count.
pub fn balanced_replicated(
    profile: &Profile,
    replicas: &[u32],
) -> Result<Vec<std::ops::Range<usize>>> {
    profile.check()?;
    let stages = replicas.len();
    let n = profile.layers.len();
    if stages == 0 || stages > n {
        return Err(ScheduleError::Plan(format!(
            "cannot split {n} layers into {stages} non-empty stages"
        )));
    }
    if let Some(s) = replicas.iter().position(|&r| r == 0) {
        return Err(ScheduleError::Plan(format!("stage {s} has 0 replicas")));
    }
    let mut pc = vec![0.0f64; n + 1];
    for (i, l) in profile.layers.iter().enumerate() {
        pc[i + 1] = pc[i] + l.compute();
    }
    let share = |s: usize, k: usize, j: usize| (pc[j] - pc[k]) / f64::from(replicas[s]);
    // best[s][j]: slowest stage of the best split of layers 0..j into s + 1 stages.
    let mut best = vec![vec![f64::INFINITY; n + 1]; stages];
    let mut cut = vec![vec![0usize; n + 1]; stages];
    for (j, b) in best[0].iter_mut().enumerate().skip(1) {
        *b = share(0, 0, j);
    }
    for s in 1..stages {
        for j in s + 1..=n {
            for k in s..j {
                let t = best[s - 1][k].max(share(s, k, j));
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
    fn a_replicated_stage_takes_layers_in_proportion() {
        let layers = (0..9)
            .map(|i| crate::LayerProfile::compute_only(format!("l{i}"), 1.0))
            .collect();
        let p = Profile::chain(layers);
        let cut = balanced_replicated(&p, &[1, 3, 1]).unwrap();
        let times: Vec<f64> = cut
            .iter()
            .zip([1.0, 3.0, 1.0])
            .map(|(r, reps)| r.len() as f64 / reps)
            .collect();
        assert_eq!(times.iter().copied().fold(0.0, f64::max), 2.0, "{cut:?}");
        assert!(cut[1].len() >= 5, "{cut:?}");
        assert_eq!(balanced(&p, 3).unwrap(), vec![0..3, 3..6, 6..9]);
    }

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
