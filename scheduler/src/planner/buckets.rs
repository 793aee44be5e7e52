//! The all-reduce's bucket size, chosen per stage by the simulator's cost of a bucketed ring
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

use crate::sim::{Bucket, Link, bucketed_all_reduce};

/// The bucket sizes tried, in gradient values: 64 Ki to 16 Mi values (256 KiB to 64 MiB of
/// f32), and one bucket for the whole stage (`usize::MAX`).
pub const BUCKET_CANDIDATES: [usize; 6] = [1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, usize::MAX];

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

/// The buckets of `layers` (the stage's, first to last) at `values` gradient values each,
/// `bytes_per_value` bytes on the wire: walking from the last layer to the first, a bucket
/// closes as soon as it holds at least `values`, and is ready once the backward pass, which
/// runs the last layer first, has passed its first layer. Buckets without values are left
/// out, as the executor leaves them.
pub fn buckets_of(layers: &[LayerGradients], values: usize, bytes_per_value: f64) -> Vec<Bucket> {
    let mut out = Vec::new();
    let (mut held, mut elapsed) = (0usize, 0.0f64);
    for (j, l) in layers.iter().enumerate().rev() {
        held += l.values;
        elapsed += l.backward;
        if held >= values.max(1) || j == 0 {
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
    /// Gradient values per bucket (`usize::MAX`: one bucket).
    pub values: usize,
    /// Seconds the all-reduce adds to each replica's update at that size.
    pub seconds: f64,
    /// Seconds it adds with one bucket.
    pub one_bucket: f64,
}

/// The bucket size of [`BUCKET_CANDIDATES`] whose bucketed ring adds least to an update of a
/// stage of `layers` on `replicas` replicas over `link` ([`bucketed_all_reduce`]: processor
/// time during the backward pass plus the wait after it); `None` for one replica.
pub fn choose_bucket_values(
    layers: &[LayerGradients],
    replicas: u32,
    link: &Link,
    bytes_per_value: f64,
) -> Option<BucketChoice> {
    if replicas <= 1 {
        return None;
    }
    let backward: f64 = layers.iter().map(|l| l.backward).sum();
    let cost = |values: usize| {
        let buckets = buckets_of(layers, values, bytes_per_value);
        let (during, after) = bucketed_all_reduce(&buckets, backward, f64::from(replicas), link);
        during + after
    };
    let one_bucket = cost(usize::MAX);
    let mut best = BucketChoice {
        values: usize::MAX,
        seconds: one_bucket,
        one_bucket,
    };
    // From the largest down: a smaller size must be strictly cheaper to win.
    for &values in BUCKET_CANDIDATES.iter().rev().skip(1) {
        let seconds = cost(values);
        if seconds < best.seconds {
            best = BucketChoice {
                values,
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
        let b = buckets_of(&l, 4, 4.0);
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
        assert_eq!(buckets_of(&l, usize::MAX, 4.0).len(), 1);
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
        let c = choose_bucket_values(&stage, 2, &network, 4.0).unwrap();
        assert!(
            c.values < usize::MAX && c.seconds < 0.5 * c.one_bucket,
            "{c:?}"
        );
        // Threads: no link time, 50 us of processor time per message end.
        let threads = Link {
            bandwidth: f64::INFINITY,
            latency: 2e-5,
            message_cpu: 5e-5,
            byte_cpu: 0.0,
        };
        let c = choose_bucket_values(&stage, 2, &threads, 4.0).unwrap();
        assert_eq!(c.values, usize::MAX, "{c:?}");
        assert!(choose_bucket_values(&stage, 1, &threads, 4.0).is_none());
    }
}
