//! The all-reduce of a stage's gradients among its replicas: the bucket layout, the
//! bucketed ring the executor starts during the backward pass, and the sum of device
//! gradients between threads.
//!
//! **Buckets.** As in data-parallel trainers, a stage's gradients are cut into buckets of
//! whole layers, from its last layer backwards, each closed once it holds at least the bucket
//! size ([`gradient_buckets`]). The backward pass finishes the last layers first, so the
//! executor starts a bucket's ring as soon as its layers' gradients are final and moves it on
//! between the remaining layers ([`BucketedAllReduce`]); the update waits only for what is
//! still in flight. Each bucket is one ring over its tensors, so the order of additions is
//! fixed by the ring and the layout, never by timing: the reference trainer sums each bucket
//! with [`ring_sum_as`] ([`bucketed_ring_sum`]) and agrees bit for bit, on every transport.

use std::collections::HashMap;
use std::ops::Range;

use pipe_kernels::{Backend, Tensor};
use pipe_scheduler::Action;
use pipe_scheduler::planner::buckets::BucketSize;
use pipe_transport::Transport;
use pipe_transport::collective::{RingAllReduce, RingSpec, ring_step_count, ring_sum_as};
use pipe_transport::frame::WireDType;

use crate::error::{Result, StageError};
use crate::model::Params;

pub use crate::config::DEFAULT_BUCKET_SIZE;

/// One bucket of a stage's gradients.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GradientBucket {
    /// Its layers, relative to the stage's first; all their parameter tensors, in order.
    pub layers: Range<usize>,
    /// Values it holds.
    pub values: usize,
    /// The first ring key step it uses (the buckets of one update use disjoint steps).
    pub first_step: u32,
}

/// The buckets of gradients `grads` (per layer, per parameter) at `size`, for a ring of
/// `replicas`: walking from the last layer to the first, a bucket closes as soon as it is
/// full ([`BucketSize::is_full`]; one bucket never is), so a layer is never split. Buckets
/// come in the order the backward pass completes them (the last layers first); one with no
/// values (layers without parameters at the stage's start) is left out. From the shapes
/// alone, so every replica and the reference trainer cut the same buckets.
pub fn gradient_buckets(
    grads: &[Vec<Tensor>],
    size: BucketSize,
    replicas: usize,
) -> Vec<GradientBucket> {
    let mut buckets = Vec::new();
    let mut end = grads.len();
    let mut values = 0usize;
    let mut first_step = 0usize;
    for j in (0..grads.len()).rev() {
        values += grads[j].iter().map(Tensor::len).sum::<usize>();
        if size.is_full(values) || j == 0 {
            if values > 0 {
                buckets.push(GradientBucket {
                    layers: j..end,
                    values,
                    first_step: u32::try_from(first_step).unwrap_or(u32::MAX),
                });
                first_step += ring_step_count(values, replicas);
            }
            end = j;
            values = 0;
        }
    }
    buckets
}

/// The backward passes after which a program all-reduces: for each program counter of a
/// `Backward` or `BackwardWeight` that is the last to add into its stage's gradients before an
/// `AllReduce`, that all-reduce's update. These are the passes whose gradients the driver
/// starts reducing layer by layer.
pub fn last_backwards(program: &[Action]) -> HashMap<usize, u32> {
    let mut last = HashMap::new();
    // Per stage, the all-reduce that the next gradient-adding pass (walking backwards) feeds.
    let mut feeds: HashMap<u32, Option<u32>> = HashMap::new();
    for (pc, a) in program.iter().enumerate().rev() {
        match *a {
            Action::AllReduce { stage, update } => {
                feeds.insert(stage, Some(update));
            }
            Action::Backward { stage, .. } | Action::BackwardWeight { stage, .. } => {
                if let Some(Some(update)) = feeds.insert(stage, None) {
                    last.insert(pc, update);
                }
            }
            Action::Update { stage, .. } => {
                feeds.insert(stage, None);
            }
            _ => {}
        }
    }
    last
}

/// The host slices of `grads`' tensors in `layers`, in order: one bucket's flat buffer.
fn bucket_segments<'g>(
    grads: &'g mut [Vec<Tensor>],
    layers: &Range<usize>,
) -> Result<Vec<&'g mut [f32]>> {
    grads[layers.clone()]
        .iter_mut()
        .flatten()
        .map(|g| {
            g.host_mut()
                .map_err(|e| StageError::Executor(format!("all-reduce of a gradient: {e}")))
        })
        .collect()
}

/// The bucketed ring all-reduce of one update of one stage, in progress. Created before the
/// update's last backward pass; [`BucketedAllReduce::layers_ready`] starts the buckets that
/// pass completes and moves every started one on without waiting, and
/// [`BucketedAllReduce::finish`] starts the rest and waits for all of them. Host gradients
/// only (device gradients go through [`all_reduce_gradients`]).
#[derive(Debug)]
pub struct BucketedAllReduce {
    group: Vec<u32>,
    stage: u32,
    update: u32,
    buckets: Vec<GradientBucket>,
    /// The precision the rings send in.
    wire: WireDType,
    /// The rings of the buckets started so far, in bucket order.
    rings: Vec<RingAllReduce>,
}

impl BucketedAllReduce {
    /// The all-reduce of update `update` of `stage` among `group` (ring order), with the
    /// buckets of `grads` at `size`, sending in `wire`'s precision.
    pub fn new(
        group: &[u32],
        (stage, update): (u32, u32),
        grads: &[Vec<Tensor>],
        (size, wire): (BucketSize, WireDType),
    ) -> Self {
        BucketedAllReduce {
            group: group.to_vec(),
            stage,
            update,
            buckets: gradient_buckets(grads, size, group.len()),
            wire,
            rings: Vec::new(),
        }
    }

    /// The stage and update this all-reduce sums.
    pub fn names(&self) -> (u32, u32) {
        (self.stage, self.update)
    }

    /// Layers `ready..` of the stage hold their final gradients: starts every bucket that lies
    /// within them, then moves every started ring on with what has arrived.
    ///
    /// # Errors
    /// Transport errors; gradients not on the host.
    pub fn layers_ready<T: Transport + ?Sized>(
        &mut self,
        t: &mut T,
        ready: usize,
        grads: &mut [Vec<Tensor>],
    ) -> Result<()> {
        while let Some(b) = self.buckets.get(self.rings.len()) {
            if b.layers.start < ready {
                break;
            }
            let names = RingSpec {
                stage: self.stage,
                update: self.update,
                first_step: b.first_step,
                wire: self.wire,
            };
            let ring = RingAllReduce::start(
                t,
                &self.group,
                names,
                &mut bucket_segments(grads, &b.layers)?,
            )?;
            self.rings.push(ring);
        }
        self.poll(t, grads)
    }

    /// Moves every started ring on with what has arrived, without waiting.
    ///
    /// # Errors
    /// As [`BucketedAllReduce::layers_ready`].
    pub fn poll<T: Transport + ?Sized>(
        &mut self,
        t: &mut T,
        grads: &mut [Vec<Tensor>],
    ) -> Result<()> {
        for (ring, b) in self.rings.iter_mut().zip(&self.buckets) {
            if !ring.is_done() {
                ring.poll(t, &mut bucket_segments(grads, &b.layers)?)?;
            }
        }
        Ok(())
    }

    /// Starts every bucket not started yet and waits until all are summed: afterwards every
    /// replica holds the same sum in `grads`.
    ///
    /// # Errors
    /// As [`BucketedAllReduce::layers_ready`].
    pub fn finish<T: Transport + ?Sized>(
        mut self,
        t: &mut T,
        grads: &mut [Vec<Tensor>],
    ) -> Result<()> {
        self.layers_ready(t, 0, grads)?;
        for (ring, b) in self.rings.into_iter().zip(&self.buckets) {
            ring.finish(t, &mut bucket_segments(grads, &b.layers)?)?;
        }
        Ok(())
    }
}

/// What the bucketed all-reduce leaves in every replica, on one thread: each bucket of the
/// replicas' gradients `partials` (in ring order) summed with [`ring_sum_as`]. Returns the
/// first replica's tensors holding the sum. `wire` is the rings' precision.
///
/// # Errors
/// Kernel errors reading or writing a gradient.
pub(crate) fn bucketed_ring_sum(
    be: &dyn Backend,
    mut partials: Vec<Params>,
    (size, wire): (BucketSize, WireDType),
) -> Result<Params> {
    let Some(first) = partials.first() else {
        return Ok(Params::new());
    };
    let buckets = gradient_buckets(first, size, partials.len());
    for b in &buckets {
        let flats: Vec<Vec<f32>> = partials
            .iter()
            .map(|p| {
                let mut flat = Vec::with_capacity(b.values);
                for t in p[b.layers.clone()].iter().flatten() {
                    flat.extend_from_slice(&be.read(t)?);
                }
                Ok(flat)
            })
            .collect::<Result<_>>()?;
        let sum = ring_sum_as(&flats.iter().map(Vec::as_slice).collect::<Vec<_>>(), wire);
        let mut at = 0;
        for t in partials[0][b.layers.clone()].iter_mut().flatten() {
            let n = t.len();
            be.write(&sum[at..at + n], t)?;
            at += n;
        }
    }
    Ok(partials.swap_remove(0))
}

/// The executor's all-reduce at an update: sums a stage's gradients across its replicas
/// `group` (ring order), in place, bucket by bucket ([`BucketedAllReduce`] with every bucket
/// started at once). The tensors are reduced where they live, never flattened into one
/// buffer and back (which once copied every gradient twice per update on top of the ring's
/// own work). Device gradients are summed on the devices when the transport carries them
/// ([`all_reduce_on_devices`]), otherwise copied through the host. `stage` and `update` name
/// the messages.
///
/// # Errors
/// Transport errors; kernel errors moving device gradients.
pub fn all_reduce_gradients<T: Transport + ?Sized>(
    be: &dyn Backend,
    t: &mut T,
    group: &[u32],
    (stage, update): (u32, u32),
    grads: &mut Params,
    (size, wire): (BucketSize, WireDType),
) -> Result<()> {
    if grads
        .iter()
        .flatten()
        .any(|g| g.device() != pipe_kernels::Device::Host)
    {
        if t.carries_device_tensors() && wire == WireDType::F32 {
            return all_reduce_on_devices(be, t, group, stage, update, grads);
        }
        // Device gradients go through the host: copied out, summed by the ring, written back.
        let mut staged = crate::model::host_params(be, grads.clone())?;
        all_reduce_gradients(be, t, group, (stage, update), &mut staged, (size, wire))?;
        for (g, s) in grads.iter_mut().flatten().zip(staged.iter().flatten()) {
            be.write(s.host()?, g)?;
        }
        return Ok(());
    }
    BucketedAllReduce::new(group, (stage, update), grads, (size, wire)).finish(t, grads)
}

/// The `step` of the messages of [`all_reduce_on_devices`]: this plus the gradient tensor's
/// index (ring chunks use small steps; tied gradients and NCCL's setup the top two).
pub const DEVICE_SUM_STEP: u32 = 1 << 24;

/// The all-reduce of device gradients among workers of one process (the transport moves
/// device buffers untouched): a group NCCL cannot serve, because its members share a GPU or
/// NCCL is missing. Tensor by tensor, every member sends its gradient to every other member,
/// copies theirs onto its device (device to device, [`Backend::place`]) and adds all of them in
/// group order, so every member holds the same bits and nothing passes through host memory.
/// With two replicas the sum is the ring's (`a + b` either way round), bit for bit; with more,
/// the additions come in another order than [`pipe_transport::collective::ring_sum`]'s, so it
/// agrees with the reference trainer within rounding.
///
/// # Errors
/// Transport errors; device failures; a gradient count past the message steps.
pub fn all_reduce_on_devices<T: Transport + ?Sized>(
    be: &dyn Backend,
    t: &mut T,
    group: &[u32],
    stage: u32,
    update: u32,
    grads: &mut Params,
) -> Result<()> {
    use pipe_transport::{Key, Kind, Message};
    let me = t.rank();
    let key = |from: u32, to: u32, j: usize| -> Result<Key> {
        let step = u32::try_from(j)
            .ok()
            .filter(|&j| j < DEVICE_SUM_STEP)
            .map(|j| DEVICE_SUM_STEP + j)
            .ok_or_else(|| StageError::Executor(format!("{j} gradients to all-reduce")))?;
        Ok(Key {
            from,
            to,
            kind: Kind::Chunk,
            stage,
            index: update,
            step,
        })
    };
    for (j, g) in grads.iter_mut().flatten().enumerate() {
        for &peer in group.iter().filter(|&&w| w != me) {
            let message = Message {
                key: key(me, peer, j)?,
                version: 0,
                tensor: g.clone(),
            };
            t.send(message)?;
        }
        let mut sum: Option<Tensor> = None;
        for &w in group {
            let part = if w == me {
                g.clone()
            } else {
                be.place(t.recv(&key(w, me, j)?)?.tensor)?
            };
            match sum.as_mut() {
                None => sum = Some(part),
                Some(s) => be.axpy(1.0, &part, s)?,
            }
        }
        if let Some(s) = sum {
            *g = s;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use pipe_scheduler::{LowerOptions, Policy, ScheduleSpec, generate, lower};
    use pipe_transport::inproc::{InProcOptions, mesh};

    fn values(n: usize) -> BucketSize {
        BucketSize::of_values(n).unwrap()
    }

    fn layer(sizes: &[usize], fill: impl Fn(usize) -> f32) -> Vec<Tensor> {
        sizes
            .iter()
            .map(|&n| Tensor::from_vec(&[n], (0..n).map(&fill).collect()).unwrap())
            .collect()
    }

    #[test]
    fn buckets_close_from_the_last_layer_and_never_split_one() {
        // Layers of 10, 0 (an activation), 6 + 2, 0 and 5 values, buckets of 7.
        let grads = vec![
            layer(&[10], |_| 0.0),
            vec![],
            layer(&[6, 2], |_| 0.0),
            vec![],
            layer(&[5], |_| 0.0),
        ];
        let buckets = gradient_buckets(&grads, values(7), 3);
        let layers: Vec<_> = buckets.iter().map(|b| b.layers.clone()).collect();
        assert_eq!(layers, vec![2..5, 0..2]);
        assert_eq!(buckets[0].values, 13);
        assert_eq!(buckets[1].values, 10);
        assert_eq!(buckets[0].first_step, 0);
        assert_eq!(buckets[1].first_step as usize, ring_step_count(13, 3));
        // Leading layers without parameters make no empty bucket.
        let tail = vec![vec![], layer(&[4], |_| 0.0)];
        let b = gradient_buckets(&tail, values(1), 2);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].layers, 1..2);
    }

    #[test]
    fn each_all_reduce_is_fed_by_the_backward_pass_just_before_it() {
        for policy in [Policy::PipeDream, Policy::OneFOneBFlush, Policy::ZbV] {
            let replicated = !policy.is_v_shaped();
            let spec = ScheduleSpec::new(policy, 2, 4);
            let spec = if replicated {
                spec.with_replicas(vec![2, 2])
            } else {
                spec
            };
            let schedule = lower(&generate(&spec).unwrap(), LowerOptions::default());
            for program in &schedule.programs {
                let last = last_backwards(program);
                let reduces = program
                    .iter()
                    .filter(|a| matches!(a, Action::AllReduce { .. }))
                    .count();
                assert_eq!(last.len(), reduces, "{policy}");
                for (&pc, &update) in &last {
                    let (Action::Backward { stage, .. } | Action::BackwardWeight { stage, .. }) =
                        program[pc]
                    else {
                        panic!("{policy}: {} is not a backward pass", program[pc]);
                    };
                    let next = program[pc + 1..]
                        .iter()
                        .find(|a| {
                            matches!(a,
                                Action::Backward { stage: s, .. }
                                | Action::BackwardWeight { stage: s, .. }
                                | Action::AllReduce { stage: s, .. } if *s == stage)
                        })
                        .copied();
                    assert_eq!(next, Some(Action::AllReduce { stage, update }), "{policy}");
                }
            }
        }
    }

    /// Two replicas driven from one thread, never waiting: the buckets a pass completes start,
    /// polls alone finish them, and each holds its ring sum.
    #[test]
    fn polls_alone_complete_buckets_started_as_layers_finish() {
        let sizes: [&[usize]; 4] = [&[300_000], &[1_000, 8], &[], &[300_001, 3]];
        let replica = |r: usize| -> Params {
            sizes
                .iter()
                .enumerate()
                .map(|(l, s)| layer(s, |i| (i % 97) as f32 * 0.25 + (l * 3 + r) as f32))
                .collect()
        };
        let mut grads = [replica(0), replica(1)];
        let want = bucketed_ring_sum(
            &pipe_kernels::CpuBackend::new(1).unwrap(),
            grads.to_vec(),
            (values(1_000), WireDType::F32),
        )
        .unwrap();
        let mut eps = mesh(2, &InProcOptions::default());
        let group = [0, 1];
        let mut ars: Vec<BucketedAllReduce> = grads
            .iter()
            .map(|g| BucketedAllReduce::new(&group, (1, 7), g, (values(1_000), WireDType::F32)))
            .collect();
        assert_eq!(ars[0].buckets.len(), 3);
        for ready in (0..sizes.len()).rev() {
            for r in 0..2 {
                ars[r]
                    .layers_ready(&mut eps[r], ready, &mut grads[r])
                    .unwrap();
            }
        }
        for _ in 0..64 {
            for r in 0..2 {
                ars[r].poll(&mut eps[r], &mut grads[r]).unwrap();
            }
        }
        for (r, ar) in ars.iter().enumerate() {
            assert!(ar.rings.iter().all(RingAllReduce::is_done), "replica {r}");
        }
        for (r, ar) in ars.into_iter().enumerate() {
            ar.finish(&mut eps[r], &mut grads[r]).unwrap();
        }
        let values = |p: &Params| -> Vec<u32> {
            p.iter()
                .flatten()
                .flat_map(|t| t.host().unwrap().iter().map(|v| v.to_bits()))
                .collect()
        };
        assert_eq!(values(&grads[0]), values(&want));
        assert_eq!(values(&grads[1]), values(&want));
    }
}
