//! Cutting a model into contiguous stages: explicit boundaries (`--partition 0-5,6-11`) or a
//! min-max split balanced by per-layer costs (measured times, or forward FLOPs), in which every
//! stage holds parameters.

use std::ops::Range;

use pipe_scheduler::{LayerProfile, Profile};
use serde::{Deserialize, Serialize};

use crate::error::{Result, StageError};
use crate::model::Model;

impl From<Partition> for Vec<Range<usize>> {
    fn from(p: Partition) -> Self {
        p.ranges
    }
}

impl TryFrom<Vec<Range<usize>>> for Partition {
    type Error = StageError;
    fn try_from(ranges: Vec<Range<usize>>) -> Result<Self> {
        let layers = ranges.last().map_or(0, |r| r.end);
        Partition::new(ranges, layers)
    }
}

/// Contiguous layer ranges, one per model stage, covering the whole model. Written as its
/// ranges (`[{"start":0,"end":3},...]`); read back through [`Partition::new`], so a partition
/// that does not tile `0..end` is refused as it is read (the model's length is checked where
/// the run is, [`crate::config::RunConfig::check`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<Range<usize>>", into = "Vec<Range<usize>>")]
pub struct Partition {
    ranges: Vec<Range<usize>>,
}

impl Partition {
    /// Checks that `ranges` are non-empty, contiguous and cover `0..layers`.
    ///
    /// # Errors
    /// [`StageError::Config`] naming the gap, overlap or empty stage.
    pub fn new(ranges: Vec<Range<usize>>, layers: usize) -> Result<Self> {
        if ranges.is_empty() {
            return Err(StageError::Config(
                "a partition needs at least one stage".into(),
            ));
        }
        let mut next = 0;
        for (s, r) in ranges.iter().enumerate() {
            if r.start != next {
                return Err(StageError::Config(format!(
                    "partition stage {s} starts at layer {} but layer {next} is next",
                    r.start
                )));
            }
            if r.is_empty() {
                return Err(StageError::Config(format!(
                    "partition stage {s} has no layers"
                )));
            }
            next = r.end;
        }
        if next != layers {
            return Err(StageError::Config(format!(
                "partition covers layers 0-{} but the model has {layers}",
                next - 1
            )));
        }
        Ok(Partition { ranges })
    }

    /// Parses `0-5,6-11,...` (inclusive layer ranges; a single number is a one-layer stage).
    ///
    /// # Errors
    /// [`StageError::Config`] for malformed text or ranges that do not tile the model.
    pub fn parse(text: &str, layers: usize) -> Result<Self> {
        let bad = |why: &str| StageError::Config(format!("--partition {text:?}: {why}"));
        let mut ranges = Vec::new();
        for part in text.split(',') {
            let part = part.trim();
            let (a, b) = match part.split_once('-') {
                Some((a, b)) => (a.trim(), b.trim()),
                None => (part, part),
            };
            let a: usize = a
                .parse()
                .map_err(|_| bad("expected ranges like 0-5,6-11"))?;
            let b: usize = b
                .parse()
                .map_err(|_| bad("expected ranges like 0-5,6-11"))?;
            if b < a {
                return Err(bad("a range ends before it starts"));
            }
            ranges.push(a..b + 1);
        }
        Partition::new(ranges, layers)
    }

    /// The split into one contiguous stage per entry of `replicas` that minimises the largest
    /// stage's forward FLOPs per sample over its replicas (each layer also counts its output
    /// size, so activation layers are not free), cutting only where [`Partition::by_cost`] may.
    ///
    /// # Errors
    /// As [`Partition::by_cost`].
    pub fn balanced(model: &Model, replicas: &[u32]) -> Result<Self> {
        let costs: Vec<f64> = (0..model.len())
            .map(|i| {
                let shape = model.shape_before(i);
                let flops = model.layer(i).flops_per_sample(shape);
                (flops + shape.iter().product::<usize>() as u64) as f64
            })
            .collect();
        Partition::by_cost(model, &costs, replicas)
    }

    /// The split into one contiguous stage per entry of `replicas` that minimises the largest
    /// stage's total `costs` (one per layer: seconds measured, or FLOPs) over its replicas
    /// (they take its microbatches in turn), where every stage holds at least one layer with
    /// parameters: a stage starts at layer 0 or at a layer with parameters, so
    /// parameter-free layers (flatten, activations, dropout) ride with the layer before them.
    /// The split itself is the planner's exact min-max split
    /// ([`pipe_scheduler::balanced_replicated`]) over those units.
    ///
    /// # Errors
    /// [`StageError::Config`] when `costs` does not match the layers, or when there are more
    /// stages than layers with parameters (naming both counts).
    pub fn by_cost(model: &Model, costs: &[f64], replicas: &[u32]) -> Result<Self> {
        let n = model.len();
        let stages = replicas.len();
        if costs.len() != n {
            return Err(StageError::Config(format!(
                "{} layer costs for a model of {n} layers",
                costs.len()
            )));
        }
        let starts = unit_starts(model);
        if stages == 0 || stages > starts.len() {
            return Err(StageError::Config(format!(
                "cannot cut the model into {stages} stages that each hold parameters: it has \
                 {} layers with parameters ({n} layers in all); use at most {} stages, a \
                 deeper model, or an explicit --partition",
                starts.len(),
                starts.len()
            )));
        }
        let bounds: Vec<usize> = starts.iter().copied().chain([n]).collect();
        let units = bounds
            .windows(2)
            .map(|w| {
                LayerProfile::compute_only(
                    format!("layers {}-{}", w[0], w[1] - 1),
                    costs[w[0]..w[1]].iter().sum(),
                )
            })
            .collect();
        let ranges = pipe_scheduler::balanced_replicated(&Profile::chain(units), replicas)?
            .into_iter()
            .map(|u| bounds[u.start]..bounds[u.end])
            .collect();
        Partition::new(ranges, n)
    }

    /// Number of stages.
    pub fn stages(&self) -> usize {
        self.ranges.len()
    }

    /// Layers of `stage`.
    pub fn range(&self, stage: usize) -> Range<usize> {
        self.ranges[stage].clone()
    }

    /// All ranges.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// Number of layers covered.
    pub fn layers(&self) -> usize {
        self.ranges.last().map_or(0, |r| r.end)
    }
}

/// Where a stage may start: layer 0, and every layer with parameters after the first one that
/// has them. Unit `u` runs from `starts[u]` to the next start.
fn unit_starts(model: &Model) -> Vec<usize> {
    let with_params: Vec<usize> = (0..model.len())
        .filter(|&i| !model.layer(i).param_shapes().is_empty())
        .collect();
    std::iter::once(0)
        .chain(with_params.into_iter().skip(1))
        .collect()
}

impl std::fmt::Display for Partition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self
            .ranges
            .iter()
            .map(|r| format!("{}-{}", r.start, r.end - 1))
            .collect();
        f.write_str(&parts.join(","))
    }
}
