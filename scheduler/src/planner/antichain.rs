//! PipeDream's own treatment of branching graphs, kept as a reference for the prefix states
//! the planner uses: states are antichains of the layer graph, reached from the first layer by
//! PipeDream's "next antichain" moves; a state stands for every layer at or before its
//! antichain (a downset), and a stage is the difference of two states where one is an ancestor
//! of the other in the antichain graph. The cut after a state sends the activations of its
//! augmented antichain (every layer in the downset with an edge leaving it).
//!
//! [`plan`] runs PipeDream's optimizer over these states with the same formulas as the prefix
//! program in [`crate::planner::pipedream`], which calls it for every graph that is not a
//! chain. Planning over prefixes of one topological order instead would miss PipeDream's
//! optimum on its ResNet and SqueezeNet graphs (resnet18 on 4 workers at 1 GB/s: 67.19 ms per
//! microbatch over prefixes against 65.92 ms over antichains), because a residual block's two
//! branches can be cut at different depths.

use std::collections::HashMap;

use crate::error::{Result, ScheduleError};
use crate::planner::types::{
    Bound, PartitionPlan, PipeDreamOptions, PlannedStage, check_table, pipedream_stage_time,
};
use crate::profile::Profile;
use crate::spec::Policy;

/// A set of layers as a bitset.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Bits(Vec<u64>);

impl Bits {
    fn new(n: usize) -> Self {
        Bits(vec![0; n.div_ceil(64)])
    }
    fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }
    fn has(&self, i: usize) -> bool {
        self.0[i / 64] & (1 << (i % 64)) != 0
    }
    fn union(&mut self, o: &Bits) {
        for (a, b) in self.0.iter_mut().zip(&o.0) {
            *a |= b;
        }
    }
    fn is_subset(&self, o: &Bits) -> bool {
        self.0.iter().zip(&o.0).all(|(a, b)| a & !b == 0)
    }
    fn ones(&self) -> impl Iterator<Item = usize> + '_ {
        self.0.iter().enumerate().flat_map(|(w, &x)| {
            (0..64)
                .filter(move |b| x & (1 << b) != 0)
                .map(move |b| w * 64 + b)
        })
    }
}

struct Graph {
    n: usize,
    /// Edges in all.
    edges: usize,
    out: Vec<Vec<usize>>,
    /// Strict ancestors and descendants of each layer.
    preds: Vec<Bits>,
    succs: Vec<Bits>,
}

impl Graph {
    fn new(p: &Profile) -> Self {
        let n = p.layers.len();
        let mut out = vec![Vec::new(); n];
        let mut inn = vec![Vec::new(); n];
        for &(a, b) in &p.edges {
            out[a].push(b);
            inn[b].push(a);
        }
        // Layers are in a topological order (edges go forward).
        let mut preds = vec![Bits::new(n); n];
        for v in 0..n {
            for &u in &inn[v] {
                let pu = preds[u].clone();
                preds[v].union(&pu);
                preds[v].set(u);
            }
        }
        let mut succs = vec![Bits::new(n); n];
        for v in (0..n).rev() {
            for &w in &out[v] {
                let sw = succs[w].clone();
                succs[v].union(&sw);
                succs[v].set(w);
            }
        }
        Graph {
            n,
            edges: p.edges.len(),
            out,
            preds,
            succs,
        }
    }

    /// PipeDream's `augment_antichain`: the antichain plus every ancestor of one of its layers
    /// with an edge to a layer that is neither that layer nor its ancestor. Adds the edges it
    /// looks at to `work`.
    fn augment(&self, antichain: &[usize], work: &mut u64) -> Vec<usize> {
        let mut extra = Bits::new(self.n);
        for &a in antichain {
            for p in self.preds[a].ones() {
                *work += 1 + self.out[p].len() as u64;
                if self.out[p].iter().any(|&o| o != a && !self.preds[a].has(o)) {
                    extra.set(p);
                }
            }
        }
        let mut v: Vec<usize> = extra.ones().collect();
        v.extend_from_slice(antichain);
        v.sort_unstable();
        v.dedup();
        v
    }

    /// PipeDream's `deaugment_augmented_antichain`: drops every layer with a descendant in the
    /// set.
    fn deaugment(&self, set: &[usize]) -> Vec<usize> {
        let mut v: Vec<usize> = set
            .iter()
            .copied()
            .filter(|&x| !set.iter().any(|&y| self.succs[x].has(y)))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// PipeDream's `next_antichains`. Adds the layers it compares to `work`: on a dense graph
    /// (every layer feeding every later one) each of the `n` states costs `O(n^4)` of them.
    fn next(&self, antichain: &[usize], work: &mut u64) -> Vec<Vec<usize>> {
        let aug = self.augment(antichain, work);
        let k = aug.len() as u64;
        let mut out = Vec::new();
        for &u in &aug {
            for &v in &self.out[u] {
                *work += k + antichain.len() as u64;
                if antichain.contains(&v) {
                    continue;
                }
                if aug.iter().any(|&x| self.succs[v].has(x)) {
                    continue;
                }
                // Deaugmenting compares every pair of the set.
                *work += k * k;
                let replaced: Vec<usize> =
                    aug.iter().map(|&x| if x == u { v } else { x }).collect();
                out.push(self.deaugment(&replaced));
            }
        }
        out
    }

    fn downset(&self, antichain: &[usize]) -> Bits {
        let mut d = Bits::new(self.n);
        for &a in antichain {
            d.union(&self.preds[a]);
            d.set(a);
        }
        d
    }
}

/// One antichain state.
struct State {
    downset: Bits,
    compute: f64,
    params: f64,
    activations: f64,
    output: f64,
}

/// A table cell: the best time, the split `(state before the last stage, workers before it)`
/// or `None` for one stage, and the last stage's replicas.
type Cell = (f64, Option<(usize, usize)>, usize);

/// The largest number of states explored before giving up (their ancestor sets take `s^2` bits).
const MAX_STATES: usize = 50_000;

/// The most work (layers and edges compared while finding next antichains) the search may do
/// before giving up. [`MAX_STATES`] bounds the states but not the cost of each, which grows
/// with the graph's density: a graph of 200 layers each feeding every later one has only 200
/// states but took 6 s, and 400 such layers over a minute. Measured here, 150 such layers
/// do 3.9e9 of work in 1.4 s, while densenet121, the largest of PipeDream's published
/// profiles, does 2.1e5; this bound stops a search after about 0.7 s.
const MAX_SEARCH_WORK: u64 = 1 << 31;

/// PipeDream's optimizer over antichain states (see the module docs).
///
/// The plan's layer ranges index [`PartitionPlan::order`]: the layers listed state by state
/// (each stage's layers in profile order), so every stage is a contiguous range even though a
/// downset difference need not be contiguous in the profile's own order.
///
/// # Errors
/// [`ScheduleError::Profile`] for a bad profile; [`ScheduleError::Plan`] for bad options, no
/// plan within the memory bound, or more than 50,000 states.
pub fn plan(profile: &Profile, opts: &PipeDreamOptions) -> Result<PartitionPlan> {
    profile.check()?;
    if opts.workers == 0 || opts.workers > 4096 || opts.bandwidth.is_nan() || opts.bandwidth <= 0.0
    {
        return Err(ScheduleError::Plan(
            "need 1 to 4096 workers and a bandwidth > 0".into(),
        ));
    }
    let g = Graph::new(profile);
    let (antichains, edges) = state_graph(&g)?;
    let layers = &profile.layers;
    let states: Vec<State> = antichains.iter().map(|a| state_of(&g, layers, a)).collect();
    let s = states.len();
    let order = topological(&edges);
    let ancestors = state_ancestors(&edges, &order);
    // The final state: the one whose downset holds every layer.
    let all = g.downset(&(0..g.n).collect::<Vec<_>>());
    let last = (0..s)
        .find(|&i| all.is_subset(&states[i].downset))
        .ok_or_else(|| ScheduleError::Plan("no antichain state covers every layer".into()))?;
    let w = opts.workers as usize;
    let b = opts.bandwidth;
    let stage_time = |c: f64, p: f64, r: f64| pipedream_stage_time(c, p, r, b);
    let fits = |act: f64, par: f64, copies: usize| {
        opts.memory
            .is_none_or(|limit| copies as f64 * (act + par) <= limit)
    };
    let transfer = |k: usize, j: usize, r: usize| match opts.activation_compression {
        Some(ratio) => {
            let out = if j == last { 0.0 } else { states[j].output };
            2.0 * states[k].output.max(out) / (b * r as f64) / ratio
        }
        None => 0.0,
    };
    check_table(s, "antichain states", w, std::mem::size_of::<Cell>())?;
    let mut a: Vec<Cell> = vec![(f64::INFINITY, None, 0); s * w];
    for &j in &order {
        let st = &states[j];
        let max_m = if opts.straight { 1 } else { w };
        for m in 0..max_m {
            if fits(st.activations, st.params, (w - (m + 1)).div_ceil(m + 1)) {
                a[j * w + m] = (
                    stage_time(st.compute, st.params, (m + 1) as f64),
                    None,
                    m + 1,
                );
            }
        }
        for m in 1..w {
            let mut best = a[j * w + m];
            for k in ancestors[j].ones() {
                let sk = &states[k];
                let (c, p) = (st.compute - sk.compute, st.params - sk.params);
                let act = st.activations - sk.activations;
                let max_r = if opts.straight { 1 } else { m };
                for r in 1..=max_r {
                    let prev = a[k * w + (m - r)].0;
                    if !prev.is_finite() || !fits(act, p, (w - (m + 1)).div_ceil(r)) {
                        continue;
                    }
                    let t = prev.max(stage_time(c, p, r as f64)).max(transfer(k, j, r));
                    if t < best.0 {
                        best = (t, Some((k, m - r)), r);
                    }
                }
            }
            a[j * w + m] = best;
        }
    }
    let top = a[last * w + (w - 1)];
    if !top.0.is_finite() {
        return Err(ScheduleError::Plan(format!(
            "no plan of {} layers on {w} workers fits the memory bound",
            g.n
        )));
    }
    let chain = walk_back(&a, last, w);
    let (stages, layer_order) = stages_of_chain(&chain, &states, g.n, w, b, &transfer);
    let total: f64 = layers.iter().map(|l| l.compute()).sum();
    let params: f64 = layers.iter().map(|l| l.param_bytes).sum();
    Ok(PartitionPlan {
        stages,
        time_per_microbatch: top.0,
        single_worker: total,
        data_parallel: stage_time(total, params, w as f64),
        cost_model: "pipedream",
        policy: Policy::PipeDream,
        microbatches: 1,
        simulated: None,
        order: layer_order,
    })
}

/// The strict ancestors of every state of the graph given by out-edges `edges`, whose
/// topological order is `order`.
fn state_ancestors(edges: &[Vec<usize>], order: &[usize]) -> Vec<Bits> {
    let s = edges.len();
    let mut ancestors = vec![Bits::new(s); s];
    for &v in order {
        for &t in &edges[v] {
            let av = ancestors[v].clone();
            ancestors[t].union(&av);
            ancestors[t].set(v);
        }
    }
    ancestors
}

/// The stages of the best plan ending at state `last` on `w` workers in table `a`, first to
/// last, as (state before the stage or `None`, state ending it, replicas): the splits walked
/// back from the last stage.
fn walk_back(a: &[Cell], last: usize, w: usize) -> Vec<(Option<usize>, usize, usize)> {
    let mut chain = Vec::new();
    let (mut j, mut m) = (last, w - 1);
    loop {
        let (_, split, r) = a[j * w + m];
        chain.push((split.map(|(k, _)| k), j, r));
        match split {
            Some((k, rest)) => {
                j = k;
                m = rest;
            }
            None => break,
        }
    }
    chain.reverse();
    chain
}

/// The state an antichain stands for: its downset and the compute, parameter and activation
/// totals of the layers in it, and the bytes its frontier sends on.
fn state_of(g: &Graph, layers: &[crate::LayerProfile], antichain: &[usize]) -> State {
    let downset = g.downset(antichain);
    let (mut compute, mut params, mut activations) = (0.0, 0.0, 0.0);
    for i in downset.ones() {
        compute += layers[i].compute();
        params += layers[i].param_bytes;
        activations += layers[i].activation_bytes;
    }
    let output = g
        .augment(antichain, &mut 0)
        .iter()
        .map(|&i| layers[i].activation_bytes)
        .sum();
    State {
        downset,
        compute,
        params,
        activations,
        output,
    }
}

/// The planned stages of a walked-back chain of (state before the stage or none, state ending
/// it, replicas), and the order of the layers they hold, on `w` workers at bandwidth `b`;
/// `transfer(k, j, r)` is the time to move a stage's boundary activations.
fn stages_of_chain(
    chain: &[(Option<usize>, usize, usize)],
    states: &[State],
    layers: usize,
    w: usize,
    b: f64,
    transfer: &dyn Fn(usize, usize, usize) -> f64,
) -> (Vec<PlannedStage>, Vec<usize>) {
    let mut layer_order = Vec::with_capacity(layers);
    let mut upto = 0usize;
    let mut stages = Vec::with_capacity(chain.len());
    for &(k, j, r) in chain {
        let first = layer_order.len();
        let before = k.map(|k| &states[k]);
        layer_order.extend(
            states[j]
                .downset
                .ones()
                .filter(|&i| before.is_none_or(|sk| !sk.downset.has(i))),
        );
        upto += r;
        let (c0, p0, a0) = before.map_or((0.0, 0.0, 0.0), |sk| {
            (sk.compute, sk.params, sk.activations)
        });
        let st = &states[j];
        let rf = r as f64;
        let compute = (st.compute - c0) / rf;
        let p = st.params - p0;
        let communication = 4.0 * (rf - 1.0) * p / (b * rf) / rf;
        let moved = k.map_or(0.0, |k| transfer(k, j, r));
        stages.push(PlannedStage {
            layers: first..layer_order.len(),
            replicas: r as u32,
            compute,
            communication,
            transfer: moved,
            time: (compute + communication).max(moved),
            param_bytes: p,
            memory: (w - upto).div_ceil(r) as f64 * (st.activations - a0 + p),
            recompute: false,
            bound: Bound::of(compute, communication, moved),
            hosts: Vec::new(),
        });
    }
    (stages, layer_order)
}

/// PipeDream's antichain graph: breadth-first over next antichains from the first layer.
///
/// # Errors
/// [`ScheduleError::Plan`] past [`MAX_STATES`] states or [`MAX_SEARCH_WORK`].
#[allow(clippy::type_complexity)]
fn state_graph(g: &Graph) -> Result<(Vec<Vec<usize>>, Vec<Vec<usize>>)> {
    let mut work = 0u64;
    let mut ids: HashMap<Vec<usize>, usize> = HashMap::new();
    let mut antichains: Vec<Vec<usize>> = vec![vec![0]];
    let mut edges: Vec<Vec<usize>> = vec![Vec::new()];
    ids.insert(vec![0], 0);
    let mut head = 0;
    while head < antichains.len() {
        let a = antichains[head].clone();
        let nexts = g.next(&a, &mut work);
        if work > MAX_SEARCH_WORK {
            return Err(ScheduleError::Plan(format!(
                "the antichain search's work (layers compared) passed the limit of \
                 {MAX_SEARCH_WORK} after {} states; the graph has {} nodes and {} edges; plan \
                 with the default cost model or merge layers",
                head + 1,
                g.n,
                g.edges
            )));
        }
        for next in nexts {
            let id = match ids.get(&next) {
                Some(&id) => id,
                None => {
                    if antichains.len() >= MAX_STATES {
                        return Err(ScheduleError::Plan(format!(
                            "more than {MAX_STATES} antichain states"
                        )));
                    }
                    ids.insert(next.clone(), antichains.len());
                    antichains.push(next);
                    edges.push(Vec::new());
                    antichains.len() - 1
                }
            };
            if !edges[head].contains(&id) {
                edges[head].push(id);
            }
        }
        head += 1;
    }
    Ok((antichains, edges))
}

/// A topological order of a graph given by out-edges (Kahn).
fn topological(edges: &[Vec<usize>]) -> Vec<usize> {
    let s = edges.len();
    let mut indeg = vec![0usize; s];
    for e in edges {
        for &t in e {
            indeg[t] += 1;
        }
    }
    let mut order: Vec<usize> = (0..s).filter(|&i| indeg[i] == 0).collect();
    let mut at = 0;
    while at < order.len() {
        let v = order[at];
        at += 1;
        for &t in &edges[v] {
            indeg[t] -= 1;
            if indeg[t] == 0 {
                order.push(t);
            }
        }
    }
    order
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A graph whose every layer feeds every later one has few states but costs `O(n^4)` work
    /// each: its search is refused by its work, naming the graph's size.
    #[test]
    fn a_dense_layer_graph_is_refused_by_its_search_work() {
        let k = 200;
        let mut text = String::new();
        for i in 0..k {
            text.push_str(&format!(
                "node{i} -- Layer{i} -- forward_compute_time=1.000, backward_compute_time=2.000, \
                 activation_size=1000.0, parameter_size=1000.000\n"
            ));
        }
        for i in 0..k {
            for j in i + 1..k {
                text.push_str(&format!("\tnode{i} -- node{j}\n"));
            }
        }
        let profile = Profile::from_pipedream(&text).unwrap();
        let e = plan(&profile, &PipeDreamOptions::new(4, 1e10))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("antichain search's work") && e.contains("200 nodes and 19900 edges"),
            "{e}"
        );
    }
}
