//! Losses: what the last stage turns its output and the microbatch's targets into (a loss sum
//! and the gradient that starts the backward pass). One trait, so the executor, the reference
//! trainer and delayed SGD are written once for classification today and next-token
//! prediction later (whose targets are token ids, the same `u32` per row, in an id tensor that
//! lives where the backend computes).

use pipe_kernels::{Backend, LossReading, LossStats, Tensor};

use crate::error::Result;

/// A loss over a batch of outputs and one target id per output row.
pub trait Loss: Send + Sync + std::fmt::Debug {
    /// Short name (`softmax_cross_entropy`).
    fn name(&self) -> &'static str;

    /// Evaluates the loss of `output` against `targets`. When `grad` is given it receives
    /// `dLoss/doutput * grad_scale` (the executor passes one over the samples of an update, so
    /// an update applies the mean gradient).
    ///
    /// # Errors
    /// A target outside the output's classes, or a target count that differs from the rows.
    fn evaluate(
        &self,
        be: &dyn Backend,
        output: &Tensor,
        targets: &Tensor<u32>,
        grad_scale: f32,
        grad: Option<&mut Tensor>,
    ) -> Result<LossStats>;

    /// [`Loss::evaluate`] without waiting for the statistics where the backend can queue them
    /// ([`Backend::queue_softmax_cross_entropy`]): the gradient as there, the statistics for
    /// [`Backend::read_losses`]. The default evaluates at once.
    ///
    /// # Errors
    /// As `evaluate`, where the backend checks at once.
    fn queue(
        &self,
        be: &dyn Backend,
        output: &Tensor,
        targets: &Tensor<u32>,
        grad_scale: f32,
        grad: Option<&mut Tensor>,
    ) -> Result<LossReading> {
        let stats = self.evaluate(be, output, targets, grad_scale, grad)?;
        Ok(LossReading::Ready(stats))
    }
}

/// Softmax cross-entropy over the last dimension, with accuracy (arg-max against the target).
#[derive(Clone, Copy, Debug, Default)]
pub struct SoftmaxCrossEntropy {
    /// Classes: the first columns of an output row; `None` for every column. A padded
    /// vocabulary's logits have more columns than classes
    /// ([`crate::layers::LayerSpec::LmHead`]).
    pub classes: Option<usize>,
}

impl Loss for SoftmaxCrossEntropy {
    fn name(&self) -> &'static str {
        "softmax_cross_entropy"
    }

    fn evaluate(
        &self,
        be: &dyn Backend,
        output: &Tensor,
        targets: &Tensor<u32>,
        grad_scale: f32,
        grad: Option<&mut Tensor>,
    ) -> Result<LossStats> {
        let classes = self.classes.unwrap_or(output.cols());
        Ok(be.softmax_cross_entropy(output, classes, targets, grad_scale, grad)?)
    }

    fn queue(
        &self,
        be: &dyn Backend,
        output: &Tensor,
        targets: &Tensor<u32>,
        grad_scale: f32,
        grad: Option<&mut Tensor>,
    ) -> Result<LossReading> {
        let classes = self.classes.unwrap_or(output.cols());
        Ok(be.queue_softmax_cross_entropy(output, classes, targets, grad_scale, grad)?)
    }
}
