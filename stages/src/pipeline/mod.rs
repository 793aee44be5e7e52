//! The pipelined runtime: a checked plan ([`RunPlan`]), the worker core that runs one worker's
//! program ([`exec`]), the worker driver that connects it to a backend and a transport
//! ([`driver::run_worker`]), the in-process launcher that runs every worker as a thread
//! ([`launch::run_threads`]), one worker of a run whose others are in other processes
//! ([`worker::train_worker`]), the sequential reference trainer that follows a version plan
//! literally, partitions, and the pipelined training loop.
//!
//! The seams are shaped for every place a worker can run. The driver takes a rank, a backend,
//! a transport endpoint and the checked plan, and nothing else; a launcher only starts
//! drivers (threads here; one process per worker or one host per worker later, calling the
//! same driver). The core ([`exec::WorkerCore`]) makes every decision (which weight version a
//! pass uses, when a stashed version is freed, what a message carries) without reading a clock
//! or touching a transport, so it is driven by the driver at run time and directly by tests.
//!
//! There is no schedule-specific code here: the core interprets actions, picks weight versions
//! by the policy's [`VersionRule`](pipe_scheduler::VersionRule) from its own state and the
//! tags messages carry, and frees stashed versions once the plan says nothing pending needs
//! them. Every forward and backward records the version it actually used, so a run's log can be
//! compared with the plan, and the final weights with the reference trainer's.

pub mod doctor;
pub mod driver;
pub mod exec;
pub mod launch;
pub mod ledger;
pub mod partition;
pub mod reference;
pub mod run_plan;
pub mod train;
pub mod worker;

pub use driver::{run_worker, run_worker_with};
pub use exec::{Pass, StageState, VersionRecord, WorkerOutcome, WorkerState};
pub use launch::run_threads;
pub use ledger::LedgerEntry;
pub use partition::Partition;
pub use reference::{ReferenceRun, reference_run, reference_train, reference_train_from};
pub use run_plan::RunPlan;
pub use train::{
    PipelineReport, PipelineTrainOptions, open_backend, train_pipelined, train_reference,
};
pub use worker::train_worker;

use pipe_kernels::{Backend, Tensor};
use pipe_scheduler::StageId;

use crate::data::Dataset;
use crate::error::Result;
use crate::loss::Loss;
use crate::model::{Model, Params};
use crate::optim::Optimizer;

/// Where microbatches come from: stage 0 asks for inputs, the last stage for targets.
pub trait MicrobatchSource: Sync {
    /// Samples per microbatch.
    fn microbatch_size(&self) -> usize;
    /// Inputs of microbatch `mb` (of this run), in host memory.
    ///
    /// # Errors
    /// Data errors.
    fn inputs(&self, mb: u32) -> Result<Tensor>;
    /// Targets (class labels, or token ids) of microbatch `mb`, one per output row, in host
    /// memory.
    ///
    /// # Errors
    /// Data errors.
    fn labels(&self, mb: u32) -> Result<Tensor<u32>>;
}

/// Microbatches cut in order from a list of sample indices (an epoch's shuffled order).
#[derive(Debug)]
pub struct OrderedSource<'a> {
    /// The dataset.
    pub data: &'a Dataset,
    /// Sample indices; microbatch `mb` is `order[mb * size .. (mb + 1) * size]`.
    pub order: Vec<u32>,
    /// Samples per microbatch.
    pub size: usize,
}

impl OrderedSource<'_> {
    fn slice(&self, mb: u32) -> Result<&[u32]> {
        let start = mb as usize * self.size;
        self.order.get(start..start + self.size).ok_or_else(|| {
            crate::StageError::Executor(format!("microbatch {mb} is beyond the data"))
        })
    }
}

impl MicrobatchSource for OrderedSource<'_> {
    fn microbatch_size(&self) -> usize {
        self.size
    }

    fn inputs(&self, mb: u32) -> Result<Tensor> {
        Ok(self.data.gather(self.slice(mb)?).0)
    }

    fn labels(&self, mb: u32) -> Result<Tensor<u32>> {
        Ok(self.data.gather(self.slice(mb)?).1)
    }
}

/// Learning rate for update `k` of a stage.
pub type LrFn<'a> = dyn Fn(StageId, u32) -> f32 + Sync + 'a;

/// Everything the workers of one run share (read-only).
pub struct Setup<'a> {
    /// The model.
    pub model: &'a Model,
    /// The checked plan: schedule, version plan and partition.
    pub plan: &'a RunPlan,
    /// Microbatches.
    pub data: &'a dyn MicrobatchSource,
    /// The loss the last stage computes.
    pub loss: &'a dyn Loss,
    /// Run seed (dropout).
    pub seed: u64,
    /// Added to microbatch numbers for dropout seeds, so epochs differ.
    pub microbatch_offset: u64,
    /// Learning rate per stage and update.
    pub lr: &'a LrFn<'a>,
    /// Where the last stage reports each microbatch's loss as it is computed (microbatch,
    /// loss sum, samples), so the trainer can report updates while the pipeline runs.
    pub progress: Option<&'a crossbeam_channel::Sender<LossReport>>,
    /// Weight prediction (a remedy for stale weights; none by default).
    pub prediction: crate::remedy::Prediction,
}

/// One microbatch's loss as the last stage reports it: (microbatch of the schedule, loss
/// sum, samples).
pub type LossReport = (u32, f64, usize);

/// The executor's all-reduce: sums a stage's gradients across its replicas `group` (ring
/// order), in place. The gradient tensors, in layer and parameter order, are reduced as one
/// flat buffer without being copied into one
/// ([`pipe_transport::collective::ring_all_reduce_segments`]): the same chunks, messages and
/// additions as the bare ring, so the reference trainer, which sums the concatenated
/// gradients with [`pipe_transport::collective::ring_sum`], agrees bit for bit. Flattening the
/// tensors into a buffer and back, as the executor once did, copied every gradient twice per
/// update on top of the ring's own work. `stage` and `update` name the messages.
///
/// # Errors
/// A gradient not held on the host; transport errors.
pub fn all_reduce_gradients<T: pipe_transport::Transport + ?Sized>(
    be: &dyn Backend,
    t: &mut T,
    group: &[u32],
    stage: u32,
    update: u32,
    grads: &mut Params,
) -> Result<()> {
    if grads
        .iter()
        .flatten()
        .any(|g| g.device() != pipe_kernels::Device::Host)
    {
        if t.carries_device_tensors() {
            return all_reduce_on_devices(be, t, group, stage, update, grads);
        }
        // Device gradients go through the host: copied out, summed by the ring, written back.
        let mut staged = crate::model::host_params(be, grads.clone())?;
        all_reduce_gradients(be, t, group, stage, update, &mut staged)?;
        for (g, s) in grads.iter_mut().flatten().zip(staged.iter().flatten()) {
            be.write(s.host()?, g)?;
        }
        return Ok(());
    }
    let mut segments = grads
        .iter_mut()
        .flatten()
        .map(|g| {
            g.host_mut()
                .map_err(|e| crate::StageError::Executor(format!("all-reduce of a gradient: {e}")))
        })
        .collect::<Result<Vec<&mut [f32]>>>()?;
    pipe_transport::collective::ring_all_reduce_segments(t, group, stage, update, &mut segments)?;
    Ok(())
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
pub fn all_reduce_on_devices<T: pipe_transport::Transport + ?Sized>(
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
            .ok_or_else(|| crate::StageError::Executor(format!("{j} gradients to all-reduce")))?;
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

/// The update the executor and the reference trainer both apply, with the same operations so
/// their weights agree bit for bit: scale the summed gradients (tied parameters' uses already
/// summed, [`Model::sum_tied`]) to a mean over the update's `microbatches`, then one optimizer
/// step on `params`.
pub(crate) fn mean_step(
    be: &dyn Backend,
    opt: &mut Optimizer,
    params: &mut Params,
    grads: &mut Params,
    microbatches: u32,
    lr: f32,
) -> Result<()> {
    let inv = 1.0 / microbatches as f32;
    for g in grads.iter_mut().flatten() {
        be.scale(inv, g)?;
    }
    opt.step(be, params, grads, lr)
}
