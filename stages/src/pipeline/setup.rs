//! What every worker of one run shares, read-only ([`Setup`]): the model, the checked plan,
//! where microbatches come from, the loss and learning rates. It sits below the executor, the
//! driver, the launchers and the reference trainer, which all take it.

use pipe_kernels::Tensor;
use pipe_scheduler::StageId;

use super::RunPlan;
use crate::data::Dataset;
use crate::error::Result;
use crate::loss::Loss;
use crate::model::Model;

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

/// Microbatches cut in order from a list of sample indices (an epoch's shuffled order),
/// from a position in it on (where a segment of the epoch starts).
#[derive(Debug)]
pub struct OrderedSource<'a> {
    /// The dataset.
    pub data: &'a Dataset,
    /// Sample indices, shared by the epoch's segments.
    pub order: std::sync::Arc<Vec<u32>>,
    /// Where microbatch 0 starts in `order`: microbatch `mb` is
    /// `order[first + mb * size .. first + (mb + 1) * size]`.
    pub first: usize,
    /// Samples per microbatch.
    pub size: usize,
}

impl<'a> OrderedSource<'a> {
    /// The microbatches of `order` from its start.
    pub fn new(data: &'a Dataset, order: Vec<u32>, size: usize) -> Self {
        Self {
            data,
            order: std::sync::Arc::new(order),
            first: 0,
            size,
        }
    }

    fn slice(&self, mb: u32) -> Result<&[u32]> {
        let start = self.first + mb as usize * self.size;
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
        Ok(self.data.gather(self.slice(mb)?)?.0)
    }

    fn labels(&self, mb: u32) -> Result<Tensor<u32>> {
        Ok(self.data.gather(self.slice(mb)?)?.1)
    }
}

/// Learning rate for update `k` of a stage.
pub type LrFn<'a> = dyn Fn(StageId, u32) -> f32 + Sync + 'a;

/// Everything the workers of one run share (read-only).
#[derive(Clone, Copy)]
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
    /// Where the last stage reports each microbatch's loss as it is computed, and each
    /// update's gradient norm when clipping, so the trainer can report updates while the
    /// pipeline runs.
    pub progress: Option<&'a crossbeam_channel::Sender<Report>>,
    /// Weight prediction (a remedy for stale weights; none by default).
    pub prediction: crate::remedy::Prediction,
}

impl<'a> Setup<'a> {
    /// The setup of a run of `plan` over `model`, fed by `data`, at learning rates `lr`: the
    /// model's loss ([`Model::loss`]), seed 0, microbatches numbered from 0, no loss reports, no weight
    /// prediction. The `with_` methods change one of these.
    pub fn new(
        model: &'a Model,
        plan: &'a RunPlan,
        data: &'a dyn MicrobatchSource,
        lr: &'a LrFn<'a>,
    ) -> Self {
        Setup {
            model,
            plan,
            data,
            loss: model.loss(),
            seed: 0,
            microbatch_offset: 0,
            lr,
            progress: None,
            prediction: crate::remedy::Prediction::None,
        }
    }

    /// The run seed (dropout).
    #[must_use]
    pub fn with_seed(self, seed: u64) -> Self {
        Setup { seed, ..self }
    }

    /// Where this segment's microbatch numbers start in the run (dropout seeds).
    #[must_use]
    pub fn with_microbatch_offset(self, microbatch_offset: u64) -> Self {
        Setup {
            microbatch_offset,
            ..self
        }
    }

    /// Where the last stage reports each microbatch's loss.
    #[must_use]
    pub fn with_progress(self, progress: Option<&'a crossbeam_channel::Sender<Report>>) -> Self {
        Setup { progress, ..self }
    }

    /// Weight prediction, a remedy for stale weights.
    #[must_use]
    pub fn with_prediction(self, prediction: crate::remedy::Prediction) -> Self {
        Setup { prediction, ..self }
    }

    /// The packed documents of microbatch `mb` ([`Model::documents`]), derived by every stage
    /// from the microbatch's token ids; `None` when the model does not pack documents.
    ///
    /// # Errors
    /// Data errors; a failed placement.
    pub fn documents(
        &self,
        be: &dyn pipe_kernels::Backend,
        mb: u32,
    ) -> Result<Option<std::sync::Arc<crate::documents::Documents>>> {
        if self.model.document_end().is_none() {
            return Ok(None);
        }
        self.model.documents(be, &self.data.inputs(mb)?)
    }
}

/// What the loss stage reports while the pipeline runs, for the trainer's step records.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Report {
    /// One microbatch's loss: (microbatch of the schedule, loss sum, samples).
    Loss(u32, f64, usize),
    /// One update's global gradient norm before clipping, from the loss stage's first
    /// replica: (update of the loss stage in the schedule, norm).
    GradNorm(u32, f64),
}
