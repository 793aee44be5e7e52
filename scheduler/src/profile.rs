//! Layer profiles: the per-layer costs a partitioner plans from.
//!
//! Two sources: pipe's own JSON (written by `pipe profile`, documented in `docs/planning.md`)
//! and the graph files PipeDream published with its paper (`nodeK -- desc -- key=value, ...`
//! lines, then tab-indented `nodeA -- nodeB` edges). Both become a [`Profile`]: layers in a
//! topological order plus the edges between them (none for a plain chain). Everything a user
//! or a file can get wrong (negative or non-finite numbers, unknown fields, dangling edges,
//! cycles) is a [`ScheduleError::Profile`] naming it.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::error::{Result, ScheduleError};
use crate::limits::{MIN_TOTAL_SECONDS, number};
use crate::units::{bytes, secs};

/// One layer's costs. Times are seconds per microbatch, sizes bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerProfile {
    /// What the layer is (for plans and errors).
    pub name: String,
    /// Forward time.
    pub forward: f64,
    /// Backward time for the input gradient (all of the backward when the source does not
    /// split it, as in PipeDream's files).
    pub backward_input: f64,
    /// Backward time for the weight gradient.
    #[serde(default)]
    pub backward_weight: f64,
    /// The whole backward (both halves at once) where it differs from their sum: layers
    /// whose halves share work do it once in a whole backward (default: the sum).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward: Option<f64>,
    /// Optimizer step time for the layer's parameters.
    #[serde(default)]
    pub update: f64,
    /// Bytes of the layer's output activation.
    pub activation_bytes: f64,
    /// Bytes of the layer's parameters.
    pub param_bytes: f64,
    /// Bytes the layer keeps from its forward for its backward, per microbatch (default: the
    /// output activation, as PipeDream's files assume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stash_bytes: Option<f64>,
    /// Bytes the layer keeps per microbatch when its backward recomputes its activations
    /// (its input, where that is less than what it keeps otherwise; default: the same as
    /// without recomputation, so a planner never picks it for nothing). Recomputing costs
    /// one more forward in the backward.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute_stash_bytes: Option<f64>,
}

impl LayerProfile {
    /// A layer that costs `seconds` of compute (counted as forward) and moves no bytes: what
    /// a compute-only split ([`crate::balanced_replicated`]) needs.
    pub fn compute_only(name: String, seconds: f64) -> Self {
        LayerProfile {
            name,
            forward: seconds,
            backward_input: 0.0,
            backward_weight: 0.0,
            backward: None,
            update: 0.0,
            activation_bytes: 0.0,
            param_bytes: 0.0,
            stash_bytes: None,
            recompute_stash_bytes: None,
        }
    }

    /// Every figure of the layer by name, as checks and messages name them.
    pub fn fields(&self) -> [(&'static str, f64); 9] {
        [
            ("forward", self.forward),
            ("backward_input", self.backward_input),
            ("backward_weight", self.backward_weight),
            ("backward", self.whole_backward()),
            ("update", self.update),
            ("activation_bytes", self.activation_bytes),
            ("param_bytes", self.param_bytes),
            ("stash_bytes", self.stash()),
            ("recompute_stash_bytes", self.recompute_stash()),
        ]
    }

    /// The whole backward's time ([`LayerProfile::backward`], or the sum of the halves).
    pub fn whole_backward(&self) -> f64 {
        self.backward
            .unwrap_or(self.backward_input + self.backward_weight)
    }

    /// Forward plus (whole) backward time: what PipeDream's optimizer calls the compute time.
    pub fn compute(&self) -> f64 {
        self.forward + self.whole_backward()
    }

    /// Bytes kept per in-flight microbatch for the backward.
    pub fn stash(&self) -> f64 {
        self.stash_bytes.unwrap_or(self.activation_bytes)
    }

    /// Bytes kept per in-flight microbatch for the backward when it recomputes.
    pub fn recompute_stash(&self) -> f64 {
        self.recompute_stash_bytes.unwrap_or_else(|| self.stash())
    }

    /// The forward time a recomputing backward runs again: the layer's forward where it keeps
    /// less when recomputing, else none (it keeps what it kept).
    pub fn recompute_forward(&self) -> f64 {
        if self.recompute_stash() < self.stash() {
            self.forward
        } else {
            0.0
        }
    }
}

/// A model's profile: layers in a topological order and the edges between them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Model name.
    #[serde(default)]
    pub model: String,
    /// Samples per microbatch the times were measured at (0 when unknown).
    #[serde(default)]
    pub microbatch_size: usize,
    /// Layers; edges refer to them by index.
    pub layers: Vec<LayerProfile>,
    /// `(from, to)`: `from`'s output feeds `to`. Empty means a chain in layer order.
    #[serde(default)]
    pub edges: Vec<(usize, usize)>,
    /// Microbatches per update of the executor run the times were calibrated on (absent: the
    /// layers were timed alone, or the source does not say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibrated_microbatches: Option<u32>,
}

/// The largest microbatch size a profile may state.
pub const MAX_PROFILE_MICROBATCH: u64 = 1 << 31;

fn bad(msg: impl Into<String>) -> ScheduleError {
    ScheduleError::Profile(msg.into())
}

/// The `key=value, ...` fields of line `no` of a PipeDream graph file, a list of sizes
/// (`[a; b; c]`, a layer with several outputs) summed.
///
/// # Errors
/// [`ScheduleError::Profile`] for a pair that is not `key=value`, a value that is not a
/// number, or a listed size that is negative or not finite.
fn pipedream_fields(no: usize, kv: &str) -> Result<HashMap<&str, f64>> {
    let mut fields: HashMap<&str, f64> = HashMap::new();
    for pair in kv.split(", ") {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| bad(format!("line {no}: {pair:?} is not key=value")))?;
        let number = |t: &str| {
            t.trim()
                .parse::<f64>()
                .map_err(|_| bad(format!("line {no}: {k} = {v:?} is not a number")))
        };
        // A layer with several outputs lists their sizes, `[a; b; c]`: their sum. Each
        // part is checked on its own, so that a negative one is not summed away.
        let parts = match v.trim().strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            Some(list) => list.split(';').map(number).collect::<Result<Vec<f64>>>()?,
            None => vec![number(v)?],
        };
        // A single value is checked with the layer's other fields, by name.
        if let Some(p) = parts
            .iter()
            .find(|p| parts.len() > 1 && (!p.is_finite() || **p < 0.0))
        {
            return Err(bad(format!(
                "line {no}: {k} must be a finite number >= 0, got {p}"
            )));
        }
        let v: f64 = parts.iter().sum();
        fields.insert(k.trim(), v);
    }
    Ok(fields)
}

/// Which layers of a PipeDream graph PipeDream's optimizer keeps: all but `Input` sources and
/// unused `__getitem__` sinks.
fn pipedream_keep(layers: &[LayerProfile], edges: &[(usize, usize)]) -> Vec<bool> {
    let n = layers.len();
    let mut indeg = vec![0usize; n];
    let mut outdeg = vec![0usize; n];
    for &(a, b) in edges {
        outdeg[a] += 1;
        indeg[b] += 1;
    }
    (0..n)
        .map(|i| {
            let input = indeg[i] == 0 && layers[i].name.starts_with("Input");
            let unused = outdeg[i] == 0 && layers[i].name.starts_with("__getitem__");
            !(input || unused)
        })
        .collect()
}

impl Profile {
    /// A chain of layers.
    pub fn chain(layers: Vec<LayerProfile>) -> Self {
        Profile {
            model: String::new(),
            microbatch_size: 0,
            layers,
            edges: Vec::new(),
            calibrated_microbatches: None,
        }
    }

    /// Parses pipe's JSON profile and checks it.
    ///
    /// # Errors
    /// [`ScheduleError::Profile`] for malformed JSON, unknown fields or bad values.
    pub fn from_json(text: &str) -> Result<Self> {
        let p: Profile = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        p.check_file()?;
        Ok(p)
    }

    /// Parses a PipeDream graph file. As PipeDream's optimizer does, `Input` sources are
    /// removed with their costs (the input always lives on the first stage) and unused
    /// `__getitem__` sinks are dropped. Times are converted from milliseconds to seconds; the
    /// file's one backward time becomes `backward_input`.
    ///
    /// # Errors
    /// [`ScheduleError::Profile`] naming the line that does not parse, a value that is negative
    /// or not finite, an edge to an unknown node, or a cycle.
    pub fn from_pipedream(text: &str) -> Result<Self> {
        let mut ids: HashMap<String, usize> = HashMap::new();
        let mut layers = Vec::new();
        let mut raw_edges = Vec::new();
        for (no, line) in text.lines().enumerate() {
            let no = no + 1;
            if line.trim().is_empty() {
                continue;
            }
            if line.starts_with('\t') || line.starts_with(' ') {
                let (a, b) = line
                    .trim()
                    .split_once(" -- ")
                    .ok_or_else(|| bad(format!("line {no}: edge is not `nodeA -- nodeB`")))?;
                raw_edges.push((no, a.trim().to_string(), b.trim().to_string()));
                continue;
            }
            let mut parts = line.splitn(3, " -- ");
            let (Some(id), Some(desc), Some(kv)) = (parts.next(), parts.next(), parts.next())
            else {
                return Err(bad(format!(
                    "line {no}: node is not `nodeK -- description -- key=value, ...`"
                )));
            };
            let fields = pipedream_fields(no, kv)?;
            let get = |k: &str| {
                fields
                    .get(k)
                    .copied()
                    .ok_or_else(|| bad(format!("line {no}: missing {k}")))
            };
            if ids.insert(id.trim().to_string(), layers.len()).is_some() {
                return Err(bad(format!("line {no}: node {id} defined twice")));
            }
            layers.push(LayerProfile {
                name: desc.trim().to_string(),
                forward: get("forward_compute_time")? / 1000.0,
                backward_input: get("backward_compute_time")? / 1000.0,
                backward_weight: 0.0,
                backward: None,
                update: 0.0,
                activation_bytes: get("activation_size")?,
                param_bytes: get("parameter_size")?,
                stash_bytes: None,
                recompute_stash_bytes: None,
            });
        }
        let mut edges = Vec::with_capacity(raw_edges.len());
        for (no, a, b) in raw_edges {
            let find = |n: &str| {
                ids.get(n)
                    .copied()
                    .ok_or_else(|| bad(format!("line {no}: edge names unknown node {n}")))
            };
            edges.push((find(&a)?, find(&b)?));
        }
        let keep = pipedream_keep(&layers, &edges);
        let profile = Profile {
            edges,
            ..Profile::chain(layers)
        };
        let profile = profile.retain(&keep)?.sorted()?;
        profile.check_file()?;
        Ok(profile)
    }

    /// The profile without the layers `keep` marks false (and their edges).
    fn retain(self, keep: &[bool]) -> Result<Self> {
        let mut map = vec![usize::MAX; self.layers.len()];
        let mut layers = Vec::new();
        for (i, l) in self.layers.into_iter().enumerate() {
            if keep[i] {
                map[i] = layers.len();
                layers.push(l);
            }
        }
        let edges = self
            .edges
            .into_iter()
            .filter(|&(a, b)| keep[a] && keep[b])
            .map(|(a, b)| (map[a], map[b]))
            .collect();
        if layers.is_empty() {
            return Err(bad("no layers"));
        }
        Ok(Profile {
            layers,
            edges,
            ..Profile::chain(Vec::new())
        })
    }

    /// A topological order of the layers (Kahn's algorithm, lowest index first).
    ///
    /// # Errors
    /// [`ScheduleError::Profile`] when the edges have a cycle.
    pub fn topological_order(&self) -> Result<Vec<usize>> {
        let n = self.layers.len();
        if self.edges.is_empty() {
            return Ok((0..n).collect());
        }
        let mut indeg = vec![0usize; n];
        let mut out: Vec<Vec<usize>> = vec![Vec::new(); n];
        for &(a, b) in &self.edges {
            indeg[b] += 1;
            out[a].push(b);
        }
        let mut ready: std::collections::BinaryHeap<std::cmp::Reverse<usize>> = (0..n)
            .filter(|&i| indeg[i] == 0)
            .map(std::cmp::Reverse)
            .collect();
        let mut order = Vec::with_capacity(n);
        while let Some(std::cmp::Reverse(i)) = ready.pop() {
            order.push(i);
            for &j in &out[i] {
                indeg[j] -= 1;
                if indeg[j] == 0 {
                    ready.push(std::cmp::Reverse(j));
                }
            }
        }
        if order.len() < n {
            let stuck = (0..n).find(|&i| indeg[i] > 0).unwrap_or(0);
            return Err(bad(format!(
                "the layer graph has a cycle (through layer {stuck}, {:?})",
                self.layers[stuck].name
            )));
        }
        Ok(order)
    }

    /// The same profile with layers renumbered in topological order.
    fn sorted(self) -> Result<Self> {
        let order = self.topological_order()?;
        let mut pos = vec![0usize; order.len()];
        for (p, &i) in order.iter().enumerate() {
            pos[i] = p;
        }
        let layers = order.iter().map(|&i| self.layers[i].clone()).collect();
        let mut edges: Vec<(usize, usize)> =
            self.edges.iter().map(|&(a, b)| (pos[a], pos[b])).collect();
        edges.sort_unstable();
        Ok(Profile {
            layers,
            edges,
            ..self
        })
    }

    /// Bytes crossing the cut after each layer: the activations of every layer up to it that
    /// feed a later layer past it (a chain: the layer's own output; the last layer: 0).
    pub fn crossing_bytes(&self) -> Vec<f64> {
        let n = self.layers.len();
        if self.edges.is_empty() {
            let mut v: Vec<f64> = self.layers.iter().map(|l| l.activation_bytes).collect();
            v[n - 1] = 0.0;
            return v;
        }
        // Each layer's output crosses the cuts from itself up to its last consumer.
        let mut last_use = vec![0usize; n];
        for &(a, b) in &self.edges {
            last_use[a] = last_use[a].max(b);
        }
        let mut delta = vec![0.0f64; n + 1];
        for (i, l) in self.layers.iter().enumerate() {
            if last_use[i] > i {
                delta[i] += l.activation_bytes;
                delta[last_use[i]] -= l.activation_bytes;
            }
        }
        let mut acc = 0.0;
        (0..n)
            .map(|i| {
                acc += delta[i];
                acc.max(0.0)
            })
            .collect()
    }

    /// Whether the layers form one chain in index order (no edges, or exactly `i -> i+1`).
    pub fn is_chain(&self) -> bool {
        self.edges.is_empty()
            || (self.edges.len() + 1 == self.layers.len()
                && self.edges.iter().enumerate().all(|(i, &e)| e == (i, i + 1)))
    }

    /// Checks a profile read from a file ([`Profile::check`], then the bounds of what a
    /// measured profile can hold): at most [`crate::limits::MAX_LAYERS`] layers, times up to
    /// [`crate::limits::MAX_FIGURE_SECONDS`], sizes up to [`crate::limits::MAX_FIGURE_BYTES`], a plausible microbatch size,
    /// and some time in some layer, so that every figure printed from it is finite. Profiles
    /// made in memory (FLOP counts standing in for times, say) need only [`Profile::check`].
    ///
    /// # Errors
    /// [`ScheduleError::Profile`] naming the layer, the field and the bound.
    pub fn check_file(&self) -> Result<()> {
        self.check()?;
        crate::limits::check_layers(self.layers.len() as u64)?;
        if self.microbatch_size as u64 > MAX_PROFILE_MICROBATCH {
            return Err(bad(format!(
                "microbatch_size {} is over the limit of {MAX_PROFILE_MICROBATCH}",
                self.microbatch_size
            )));
        }
        for (i, l) in self.layers.iter().enumerate() {
            for (name, v) in l.fields() {
                crate::limits::check_figure(name, v)
                    .map_err(|why| bad(format!("layer {i} ({:?}): {why}", l.name)))?;
            }
        }
        let total: f64 = self.layers.iter().map(LayerProfile::compute).sum();
        if total < MIN_TOTAL_SECONDS {
            return Err(bad(format!(
                "the layers take {} s in all, under {MIN_TOTAL_SECONDS:e} s: a profile needs \
                 some time to balance (was it measured?)",
                number(total)
            )));
        }
        Ok(())
    }

    /// Checks every value and edge.
    ///
    /// # Errors
    /// [`ScheduleError::Profile`] naming the bad layer and field, a dangling or self edge, or
    /// a cycle.
    pub fn check(&self) -> Result<()> {
        if self.layers.is_empty() {
            return Err(bad("no layers"));
        }
        for (i, l) in self.layers.iter().enumerate() {
            for (name, v) in l.fields() {
                if !v.is_finite() || v < 0.0 {
                    return Err(bad(format!(
                        "layer {i} ({:?}): {name} must be a finite number >= 0, got {}",
                        l.name,
                        number(v)
                    )));
                }
            }
        }
        let n = self.layers.len();
        for &(a, b) in &self.edges {
            if a >= n || b >= n {
                return Err(bad(format!(
                    "edge ({a}, {b}) names a layer past the last ({})",
                    n - 1
                )));
            }
            if a >= b {
                return Err(bad(format!(
                    "edge ({a}, {b}) does not go from an earlier layer to a later one (layers \
                     must be listed in a topological order)"
                )));
            }
        }
        Ok(())
    }
}

impl Profile {
    /// The profile as `pipe profile` prints it: one row per layer and the total per
    /// microbatch.
    pub fn render(&self) -> String {
        let p = self;
        let how = match p.calibrated_microbatches {
            Some(m) => format!("calibrated on the executor at {m} microbatches per update"),
            None => "medians, one layer at a time".into(),
        };
        let mut out = format!(
            "profile of {} at microbatch {} ({how})\n{:<5} {:<12} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
            p.model,
            p.microbatch_size,
            "layer",
            "kind",
            "forward",
            "backward",
            "bwd-input",
            "bwd-weight",
            "update",
            "activation",
            "params"
        );
        for (i, l) in p.layers.iter().enumerate() {
            let kind = l.name.split_once(':').map_or(l.name.as_str(), |(_, k)| k);
            out.push_str(&format!(
                "{:<5} {:<12} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
                i,
                kind,
                secs(l.forward),
                secs(l.whole_backward()),
                secs(l.backward_input),
                secs(l.backward_weight),
                secs(l.update),
                bytes(l.activation_bytes),
                bytes(l.param_bytes)
            ));
        }
        let total: f64 = p.layers.iter().map(|l| l.compute() + l.update).sum();
        out.push_str(&format!("total per microbatch: {}\n", secs(total)));
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const SMALL: &str = "node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=100.0, parameter_size=0.000
node2 -- Linear(a) -- forward_compute_time=2.000, backward_compute_time=4.000, activation_size=10.0, parameter_size=50.000
node3 -- ReLU -- forward_compute_time=1.000, backward_compute_time=1.000, activation_size=10.0, parameter_size=0.000
\tnode1 -- node2
\tnode2 -- node3
";

    #[test]
    fn pipedream_files_lose_their_input_and_convert_milliseconds() {
        let p = Profile::from_pipedream(SMALL).unwrap();
        assert_eq!(p.layers.len(), 2);
        assert_eq!(p.layers[0].name, "Linear(a)");
        assert!((p.layers[0].compute() - 0.006).abs() < 1e-15);
        assert!(p.is_chain());
    }

    #[test]
    fn bad_profiles_are_named() {
        let cases = [
            (
                SMALL.replace("forward_compute_time=2.000", "forward_compute_time=-2"),
                "finite number >= 0",
            ),
            (
                SMALL.replace("\tnode2 -- node3", "\tnode2 -- node9"),
                "unknown node node9",
            ),
            (SMALL.to_string() + "\tnode3 -- node2\n", "cycle"),
            (
                SMALL.replace(
                    "activation_size=10.0, parameter_size=50.000",
                    "activation_size=x",
                ),
                "not a number",
            ),
        ];
        for (text, want) in cases {
            let e = Profile::from_pipedream(&text).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        let json = r#"{"layers": [{"name": "a", "forward": 1, "backward_input": 1, "activation_bytes": 1, "param_bytes": 1, "colour": 3}]}"#;
        let dangling = r#"{"layers": [{"name": "a", "forward": 1, "backward_input": 1, "activation_bytes": 1, "param_bytes": 1}], "edges": [[0, 4]]}"#;
        for (text, want) in [(json, "colour"), (dangling, "past the last")] {
            let e = Profile::from_json(text).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }
}
