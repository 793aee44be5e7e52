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

pub mod allreduce;
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

pub use allreduce::{
    BucketedAllReduce, DEFAULT_BUCKET_VALUES, DEVICE_SUM_STEP, GradientBucket,
    all_reduce_gradients, all_reduce_on_devices, gradient_buckets, last_backwards,
};
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
