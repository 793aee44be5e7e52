//! The all-reduce's bucket size ([`BucketSize`], one per stage: [`StageBuckets`]), and its
//! choice per stage by the simulator's cost of a bucketed ring
//! ([`crate::sim::bucketed_all_reduce`]) on the link that carries it.
//!
//! A stage's gradients are cut into buckets of whole layers from its last layer backwards, a
//! bucket closing once it holds at least the bucket size (as the executor cuts them). Small
//! buckets start their rings early, hiding the link behind the rest of the backward pass;
//! each costs its messages' processor time, which the pass pays. Where the link is fast and
//! messages dear (threads or shared memory on a few cores), one bucket wins; where the link is
//! slow against the pass (a network between hosts), smaller ones do. The choice minimises
//! what the all-reduce adds to an update, during the pass and after it, over a fixed list of
//! sizes ([`BUCKET_CANDIDATES`]); a tie goes to the larger bucket, which sends fewer messages.
//!
//! A size is a value of its own type, not a count with a reserved number: one bucket for the
//! whole stage is [`BucketSize::Whole`]. Its text is what `--allreduce-bucket-mb` takes (MiB
//! of f32 gradients, or `one`); its serialized form is the count of values that run files,
//! checkpoints and reports have always held (the largest count for one bucket), so that those
//! written before the type existed still read.

use std::num::NonZeroUsize;

use serde::{Deserialize, Serialize};

use crate::error::ScheduleError;
use crate::sim::{Bucket, Link, bucketed_all_reduce};

/// How one stage's gradients are cut into all-reduce buckets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "usize", into = "usize")]
pub enum BucketSize {
    /// Buckets of at least this many gradient values (f32 on the host): walking from the
    /// stage's last layer to its first, a bucket closes on the first whole layer that brings
    /// it to the size.
    Values(NonZeroUsize),
    /// One bucket of all the stage's gradients, summed once its backward pass is done
    /// (`one`).
    Whole,
}

/// [`BucketSize::Whole`] as run files, checkpoints and reports hold it: the count of values
/// no stage reaches, as written before the size had a type of its own.
const WHOLE_SERIALIZED: usize = usize::MAX;

/// Bytes of one f32 gradient value: what a MiB size counts in.
const BYTES_PER_VALUE: f64 = 4.0;

/// Bytes in a MiB.
const MIB: f64 = 1024.0 * 1024.0;

impl BucketSize {
    /// Largest bucket `--allreduce-bucket-mb` takes, in MiB (64 GiB).
    pub const MAX_MIB: f64 = 65_536.0;

    /// Buckets of `values` gradient values; `None` for none.
    pub const fn of_values(values: usize) -> Option<Self> {
        match NonZeroUsize::new(values) {
            Some(v) => Some(BucketSize::Values(v)),
            None => None,
        }
    }

    /// Buckets of `mib` MiB of f32 gradients: whole values of 4 bytes, at least one.
    pub fn of_mib(mib: f64) -> Self {
        let values = (mib * MIB / BYTES_PER_VALUE) as usize;
        BucketSize::Values(NonZeroUsize::new(values).unwrap_or(NonZeroUsize::MIN))
    }

    /// The size in MiB of f32 gradients; `None` for one bucket.
    pub fn mib(self) -> Option<f64> {
        match self {
            BucketSize::Values(v) => Some(v.get() as f64 * BYTES_PER_VALUE / MIB),
            BucketSize::Whole => None,
        }
    }

    /// Whether a bucket holding `held` gradient values is full: it closes after the layer
    /// that brought it there. One bucket never fills; it closes with the stage's first layer.
    pub fn is_full(self, held: usize) -> bool {
        match self {
            BucketSize::Values(v) => held >= v.get(),
            BucketSize::Whole => false,
        }
    }
}

/// As `--allreduce-bucket-mb` takes it: MiB of f32 gradients (`4`, `0.25`), or `one`.
impl std::fmt::Display for BucketSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.mib() {
            Some(mib) => write!(f, "{mib}"),
            None => f.write_str("one"),
        }
    }
}

/// Parses one size of `--allreduce-bucket-mb`: MiB of f32 gradients, above 0 and at most
/// [`BucketSize::MAX_MIB`], or `one`.
impl std::str::FromStr for BucketSize {
    type Err = ScheduleError;
    fn from_str(text: &str) -> Result<Self, ScheduleError> {
        if text == "one" {
            return Ok(BucketSize::Whole);
        }
        match text.parse::<f64>() {
            Ok(mib) if mib.is_finite() && mib > 0.0 && mib <= Self::MAX_MIB => {
                Ok(BucketSize::of_mib(mib))
            }
            _ => Err(ScheduleError::Spec(format!(
                "all-reduce bucket must be above 0 and at most {} MiB, or one, got '{text}'",
                Self::MAX_MIB
            ))),
        }
    }
}

/// Reads the serialized count of values.
impl TryFrom<usize> for BucketSize {
    type Error = ScheduleError;
    fn try_from(values: usize) -> Result<Self, ScheduleError> {
        match values {
            WHOLE_SERIALIZED => Ok(BucketSize::Whole),
            v => BucketSize::of_values(v).ok_or_else(|| {
                ScheduleError::Spec("an all-reduce bucket must hold at least 1 value".into())
            }),
        }
    }
}

/// Writes the serialized count of values.
impl From<BucketSize> for usize {
    fn from(size: BucketSize) -> usize {
        match size {
            BucketSize::Values(v) => v.get(),
            BucketSize::Whole => WHOLE_SERIALIZED,
        }
    }
}

/// Each stage's bucket size, first stage first; empty where a run gives every stage one
/// size. Serialized as the list of the stages' sizes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct StageBuckets(Vec<BucketSize>);

impl StageBuckets {
    /// `sizes`, the first stage's first.
    pub fn new(sizes: Vec<BucketSize>) -> Self {
        StageBuckets(sizes)
    }

    /// `size` for each of `stages` stages.
    pub fn uniform(size: BucketSize, stages: usize) -> Self {
        StageBuckets(vec![size; stages])
    }

    /// The size of `stage`, if the list holds it.
    pub fn get(&self, stage: usize) -> Option<BucketSize> {
        self.0.get(stage).copied()
    }

    /// How many stages the list holds.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The sizes, the first stage's first.
    pub fn as_slice(&self) -> &[BucketSize] {
        &self.0
    }
}

impl FromIterator<BucketSize> for StageBuckets {
    fn from_iter<I: IntoIterator<Item = BucketSize>>(sizes: I) -> Self {
        StageBuckets(sizes.into_iter().collect())
    }
}

/// As `--allreduce-bucket-mb` takes them back: the sizes, comma-separated (`4,one,0.25`).
impl std::fmt::Display for StageBuckets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, size) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{size}")?;
        }
        Ok(())
    }
}

/// The bucket size of `values` gradient values, for the candidates below (a constant: zero
/// would not compile).
const fn candidate(values: usize) -> BucketSize {
    match BucketSize::of_values(values) {
        Some(size) => size,
        None => panic!("a bucket candidate holds at least one value"),
    }
}

/// The bucket sizes tried: 64 Ki to 16 Mi gradient values (256 KiB to 64 MiB of f32), and
/// one bucket for the whole stage.
pub const BUCKET_CANDIDATES: [BucketSize; 6] = [
    candidate(1 << 16),
    candidate(1 << 18),
    candidate(1 << 20),
    candidate(1 << 22),
    candidate(1 << 24),
    BucketSize::Whole,
];

/// One layer of a stage for the bucket choice: its gradient values and its backward time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerGradients {
    /// Gradient values (parameters) of the layer.
    pub values: usize,
    /// Seconds of the layer's backward pass.
    pub backward: f64,
}

impl LayerGradients {
    /// A profiled layer's gradient values (its f32 parameter bytes over 4) and backward time.
    pub fn of(layer: &crate::profile::LayerProfile) -> Self {
        LayerGradients {
            values: (layer.param_bytes / 4.0) as usize,
            backward: layer.whole_backward(),
        }
    }
}

/// The buckets of `layers` (the stage's, first to last) at `size`, `bytes_per_value` bytes
/// on the wire: walking from the last layer to the first, a bucket closes as soon as it is
/// full ([`BucketSize::is_full`]), and is ready once the backward pass, which runs the last
/// layer first, has passed its first layer. Buckets without values are left out, as the
/// executor leaves them.
pub fn buckets_of(
    layers: &[LayerGradients],
    size: BucketSize,
    bytes_per_value: f64,
) -> Vec<Bucket> {
    let mut out = Vec::new();
    let (mut held, mut elapsed) = (0usize, 0.0f64);
    for (j, l) in layers.iter().enumerate().rev() {
        held += l.values;
        elapsed += l.backward;
        if size.is_full(held) || j == 0 {
            if held > 0 {
                out.push(Bucket {
                    bytes: held as f64 * bytes_per_value,
                    ready: elapsed,
                });
            }
            held = 0;
        }
    }
    out
}

/// A stage's bucket size and what its all-reduce costs an update.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BucketChoice {
    /// The size chosen.
    pub size: BucketSize,
    /// Seconds the all-reduce adds to each replica's update at that size.
    pub seconds: f64,
    /// Seconds it adds with one bucket.
    pub one_bucket: f64,
}

/// The bucket size of [`BUCKET_CANDIDATES`] whose bucketed ring adds least to an update of a
/// stage of `layers` on `replicas` replicas over `link` ([`bucketed_all_reduce`]: processor
/// time during the backward pass plus the wait after it); `None` for one replica.
pub fn choose_bucket_size(
    layers: &[LayerGradients],
    replicas: u32,
    link: &Link,
    bytes_per_value: f64,
) -> Option<BucketChoice> {
    if replicas <= 1 {
        return None;
    }
    let backward: f64 = layers.iter().map(|l| l.backward).sum();
    let cost = |size: BucketSize| {
        let buckets = buckets_of(layers, size, bytes_per_value);
        let (during, after) = bucketed_all_reduce(&buckets, backward, f64::from(replicas), link);
        during + after
    };
    let one_bucket = cost(BucketSize::Whole);
    let mut best = BucketChoice {
        size: BucketSize::Whole,
        seconds: one_bucket,
        one_bucket,
    };
    // From the largest down: a smaller size must be strictly cheaper to win.
    for &size in BUCKET_CANDIDATES.iter().rev().skip(1) {
        let seconds = cost(size);
        if seconds < best.seconds {
            best = BucketChoice {
                size,
                seconds,
                one_bucket,
            };
        }
    }
    Some(best)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn layers(n: usize, values: usize, backward: f64) -> Vec<LayerGradients> {
        vec![LayerGradients { values, backward }; n]
    }

    #[test]
    fn buckets_close_on_whole_layers_from_the_last() {
        let l = [
            LayerGradients {
                values: 0,
                backward: 1.0,
            },
            LayerGradients {
                values: 5,
                backward: 2.0,
            },
            LayerGradients {
                values: 5,
                backward: 3.0,
            },
        ];
        let four = BucketSize::of_values(4).unwrap();
        let b = buckets_of(&l, four, 4.0);
        assert_eq!(
            b,
            vec![
                Bucket {
                    bytes: 20.0,
                    ready: 3.0
                },
                Bucket {
                    bytes: 20.0,
                    ready: 5.0
                }
            ]
        );
        assert_eq!(buckets_of(&l, BucketSize::Whole, 4.0).len(), 1);
    }

    #[test]
    fn a_slow_link_takes_small_buckets_and_dear_messages_take_one() {
        // 16 layers of 1 Mi values (4 MiB each), 10 ms of backward each.
        let stage = layers(16, 1 << 20, 0.01);
        let network = Link {
            bandwidth: 1.25e9,
            latency: 1e-4,
            message_cpu: 1e-6,
            byte_cpu: 0.0,
        };
        let c = choose_bucket_size(&stage, 2, &network, 4.0).unwrap();
        assert!(
            c.size != BucketSize::Whole && c.seconds < 0.5 * c.one_bucket,
            "{c:?}"
        );
        // Threads: no link time, 50 us of processor time per message end.
        let threads = Link {
            bandwidth: f64::INFINITY,
            latency: 2e-5,
            message_cpu: 5e-5,
            byte_cpu: 0.0,
        };
        let c = choose_bucket_size(&stage, 2, &threads, 4.0).unwrap();
        assert_eq!(c.size, BucketSize::Whole, "{c:?}");
        assert!(choose_bucket_size(&stage, 1, &threads, 4.0).is_none());
    }

    #[test]
    fn sizes_read_and_print_as_the_flag_takes_them() {
        let four: BucketSize = "4".parse().unwrap();
        assert_eq!(four, BucketSize::of_values(1 << 20).unwrap());
        assert_eq!(four.to_string(), "4");
        assert_eq!("one".parse::<BucketSize>().unwrap(), BucketSize::Whole);
        assert_eq!(BucketSize::Whole.to_string(), "one");
        // Below one value: one value.
        assert_eq!(BucketSize::of_mib(1e-9), BucketSize::of_values(1).unwrap());
        for bad in ["0", "-1", "inf", "NaN", "65537", "many", ""] {
            let e = bad.parse::<BucketSize>().unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "all-reduce bucket must be above 0 and at most 65536 MiB, or one, got '{bad}'"
                )
            );
        }
        // Every size prints as text that reads back as it.
        for size in BUCKET_CANDIDATES
            .into_iter()
            .chain(BucketSize::of_values(3))
        {
            assert_eq!(size.to_string().parse::<BucketSize>().unwrap(), size);
        }
        let stages = StageBuckets::new(vec![four, BucketSize::Whole, BUCKET_CANDIDATES[0]]);
        assert_eq!(stages.to_string(), "4,one,0.25");
    }

    #[test]
    fn sizes_serialize_as_the_counts_written_before() {
        let stages =
            StageBuckets::new(vec![BucketSize::of_values(300).unwrap(), BucketSize::Whole]);
        let json = serde_json::to_string(&stages).unwrap();
        assert_eq!(json, "[300,18446744073709551615]");
        assert_eq!(serde_json::from_str::<StageBuckets>(&json).unwrap(), stages);
        assert!(serde_json::from_str::<BucketSize>("0").is_err());
    }
}
