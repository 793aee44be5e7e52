//! The [`Backend`] trait, its operand types and the typed backend choice ([`BackendKind`]).
//!
//! Every method of the trait is written once, in [`backend_ops`]: its documentation, its
//! signature and any default body. That list declares the trait and generates the methods of
//! every wrapper that forwards to another backend (a `Box`, [`Timed`](crate::Timed),
//! [`EmulatedDevice`](crate::EmulatedDevice)): each wrapper hands it a macro that writes one
//! method from one signature. A new operation is therefore written in the list and in the
//! backends that compute (the CPU's, CUDA's), and nowhere else; a wrapper writes out by hand
//! only the methods whose logic is its own, and says why beside them.
use std::borrow::Cow;

use crate::{Device, Result, Tensor};

/// Whether a matrix operand is used as stored or transposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Trans {
    /// Use the operand as stored.
    No,
    /// Use the operand's transpose.
    Yes,
}

/// What an optimizer update saw of the values it read and wrote: whether its gradient, and
/// its parameter after the update, hold only finite values (`Some(true)`), a NaN or an
/// infinity (`Some(false)`), or were not looked at (`None`). The CPU backend looks inside the
/// update's own pass, where it costs nothing but a few vector instructions, and so spares the
/// finiteness guard a pass over every gradient and every weight; a device backend does not,
/// and its guard batches the whole update's check into one wait.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UpdateSeen {
    /// Whether every value of the gradient is finite, if the update looked.
    pub grad: Option<bool>,
    /// Whether every value of the parameter after the update is finite, if the update looked.
    pub param: Option<bool>,
}

impl UpdateSeen {
    /// Both looked at: `grad_top` and `param_top`, the largest exponent field of the gradient's
    /// and of the updated parameter's values ([`exponent_field`]).
    pub(crate) fn from_tops((grad_top, param_top): (u32, u32)) -> Self {
        UpdateSeen {
            grad: Some(grad_top < NON_FINITE_EXPONENT),
            param: Some(param_top < NON_FINITE_EXPONENT),
        }
    }
}

/// The exponent field of infinities and NaNs; a finite value's is smaller.
pub(crate) const NON_FINITE_EXPONENT: u32 = 0x7f80_0000;

/// `v`'s exponent field, in place: the largest over a block is below
/// [`NON_FINITE_EXPONENT`] exactly when every value of the block is finite.
#[inline(always)]
pub(crate) fn exponent_field(v: f32) -> u32 {
    v.to_bits() & NON_FINITE_EXPONENT
}

/// Whether every value is finite, at memory speed: the largest exponent field of each block
/// (an integer maximum, which vectorizes where a short-circuiting test does not) is below
/// the all-ones of infinities and NaNs.
/// Compiled for the widest vectors the CPU has ([`crate::vector`]): on the baseline (SSE2,
/// which has no unsigned 32-bit maximum) the same loop ran at about a third of the speed.
pub fn all_finite(values: &[f32]) -> bool {
    crate::vector::vectorized(AllFinite(values))
}

/// [`all_finite`]'s loop.
struct AllFinite<'a>(&'a [f32]);

impl crate::vector::Kernel for AllFinite<'_> {
    type Output = bool;

    #[inline(always)]
    fn run(self) -> bool {
        self.0.chunks(1 << 14).all(|block| {
            block
                .iter()
                .fold(0u32, |top, &v| top.max(exponent_field(v)))
                < NON_FINITE_EXPONENT
        })
    }
}

impl Trans {
    /// The rows and columns of the operand `t` used this way: as stored, or transposed.
    pub fn dims(self, t: &Tensor) -> (usize, usize) {
        match self {
            Trans::No => (t.rows(), t.cols()),
            Trans::Yes => (t.cols(), t.rows()),
        }
    }
}

/// Elementwise activation functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `max(x, 0)`.
    Relu,
    /// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    Gelu,
    /// Hyperbolic tangent.
    Tanh,
    /// Logistic sigmoid.
    Sigmoid,
}

/// What a softmax cross-entropy evaluation returns besides the gradient.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossStats {
    /// Sum over rows of `-log softmax(logits)[label]`, accumulated in `f64` in row order.
    pub loss_sum: f64,
    /// Rows whose arg-max equals the label (first maximum wins ties).
    pub correct: usize,
    /// Rows evaluated: those not labelled [`IGNORED_LABEL`].
    pub rows: usize,
}

/// A loss's statistics as [`Backend::queue_softmax_cross_entropy`] leaves them: read already,
/// or still in a device buffer that [`Backend::read_losses`] reads, with others, in one wait.
#[derive(Debug)]
pub enum LossReading {
    /// Read (a backend that computes on the host has them at once).
    Ready(LossStats),
    /// Still on the device that computed them.
    Queued(QueuedLoss),
}

/// The device side of a [`LossReading`]: what the backend's kernel wrote and what reading it
/// needs. Only the backend that made it reads it (the CUDA backend, so a build without it reads
/// no field).
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct QueuedLoss {
    /// The kernel's results (their layout is the backend's).
    pub(crate) results: Tensor,
    /// The labels, kept to name one that its check refused.
    pub(crate) labels: Tensor<u32>,
    /// Rows of logits.
    pub(crate) rows: usize,
    /// Classes: a label must be below it (or ignored).
    pub(crate) classes: usize,
}

/// The label of a row that is not a loss term (the first token of a packed document, which
/// is not predicted from the document before it).
pub const IGNORED_LABEL: u32 = u32::MAX;

/// The labels that are loss terms: not [`IGNORED_LABEL`].
pub fn counted_labels(labels: &[u32]) -> usize {
    labels.iter().filter(|&&l| l != IGNORED_LABEL).count()
}

/// The geometry of a causal self-attention call: `batch` sequences of `seq` tokens, `heads`
/// heads over a model width `C`. The packed query-key-value tensor is `[batch * seq, 3C]`:
/// queries in columns `0..C`, keys in `C..2C`, values in `2C..3C`, head `h` at offset
/// `h C / heads` within each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Attention heads.
    pub heads: usize,
    /// Model width `C` (a multiple of `heads`).
    pub width: usize,
}

impl AttentionShape {
    /// Model width `C`.
    pub fn width(self) -> usize {
        self.width
    }
}

/// Hyperparameters of one SGD update (PyTorch semantics, dampening 0).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdStep {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor (0 disables the buffer).
    pub momentum: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// L2 penalty added to the gradient.
    pub weight_decay: f32,
}

/// Hyperparameters of one Adam or AdamW update.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Weight decay: added to the gradient (Adam) or applied to the weights (AdamW).
    pub weight_decay: f32,
    /// Decoupled weight decay (AdamW).
    pub decoupled: bool,
    /// `1 - beta1^t` for this step t (t >= 1).
    pub bias_correction1: f32,
    /// `1 - beta2^t` for this step t (t >= 1).
    pub bias_correction2: f32,
}

/// One tensor's part of a multi-tensor Adam or AdamW update ([`Backend::adam_updates`]): the
/// same operands as [`Backend::adam_update`] takes.
#[derive(Debug)]
pub struct AdamTensors<'a> {
    /// The weights, updated in place.
    pub param: &'a mut Tensor,
    /// Their gradient.
    pub grad: &'a Tensor,
    /// The first moment, updated in place.
    pub m: &'a mut Tensor,
    /// The second moment, updated in place.
    pub v: &'a mut Tensor,
    /// This tensor's hyperparameters (its group's weight decay).
    pub hp: AdamStep,
}

/// Hyperparameters of one Lion step (Chen et al., "Symbolic Discovery of Optimization
/// Algorithms", 2023): the update is the sign of an interpolation between the momentum and the
/// gradient, and the momentum is then moved toward the gradient at a slower rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LionStep {
    /// Learning rate.
    pub lr: f32,
    /// Interpolation of the update direction: `c = beta1 m + (1 - beta1) g`.
    pub beta1: f32,
    /// Momentum decay: `m = beta2 m + (1 - beta2) g`.
    pub beta2: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

/// Hyperparameters of one delay compensation (Zheng et al., "Asynchronous Stochastic Gradient
/// Descent with Delay Compensation", ICML 2017): a gradient `g` computed at stale weights `w_s`
/// and applied at `w` becomes `g + lambda g (.) g (.) (w - w_s)`, the product elementwise (the
/// outer product `g g^T`'s diagonal standing in for the Hessian).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DelayCompensation {
    /// `lambda`, or `lambda_0` of the adaptive form.
    pub lambda: f32,
    /// The adaptive form's decay `m` of the mean square `MS = m MS + (1 - m) g^2` (updated with
    /// this gradient first), whose `lambda` per element is `lambda_0 / sqrt(MS + eps)`; `None`
    /// for the plain form.
    pub adaptive: Option<f32>,
    /// The adaptive form's `eps` under the square root.
    pub eps: f32,
}

/// `sign(x)` as Lion takes it: 0 at 0 (where `f32::signum` gives 1).
#[inline]
pub fn lion_sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}

/// Calls `$op!` once for each method of [`Backend`], in the trait's order, with its
/// documentation and attributes, a kind, its signature and, where the trait provides one, its
/// default body. The kind is `about` for a method that asks about the backend itself (its name,
/// its device, waiting for it) and computes nothing, `op` for an operation on tensors.
///
/// This is the one place a method's signature is written: the trait below and every forwarding
/// wrapper are generated from it, so a wrapper cannot miss a method or forward one with the
/// wrong signature.
macro_rules! backend_ops {
    ($op:ident) => {
        $op! {
            /// Short name (`cpu`, `cuda`).
            about fn name(&self) -> &'static str;
        }
        $op! {
            /// Number of compute threads this backend uses.
            about fn threads(&self) -> usize;
        }
        $op! {
            /// Where this backend keeps the tensors it computes on.
            about fn device(&self) -> Device;
        }
        $op! {
            /// The backend that computes, as [`Any`](std::any::Any), for the downcast a device's
            /// own code makes when a library must compute on its buffers in its stream's order
            /// ([`CudaBackend::of`](crate::CudaBackend::of), for NCCL). A wrapper that only
            /// observes another backend (timing) returns the one it wraps.
            about fn as_any(&self) -> &dyn std::any::Any;
        }
        $op! {
            /// Waits until every operation queued so far has finished: call it before reading a
            /// clock. Backends that compute synchronously (the CPU) return at once.
            ///
            /// # Errors
            /// Device failures reported by queued work.
            about fn synchronize(&self) -> Result<()> {
                Ok(())
            }
        }
        $op! {
            /// Runs `f` where this backend's kernels are cheapest to call from: a backend with
            /// a thread pool runs it on one of the pool's threads, so that every kernel `f`
            /// calls starts there rather than handing its work to the pool and sleeping until
            /// it is done (two thread switches a call). Others run it on the calling thread.
            ///
            /// # Errors
            /// None from the backends here: `f` reports its own.
            about fn run_within(&self, f: &mut (dyn FnMut() + Send)) -> Result<()> {
                f();
                Ok(())
            }
        }
        $op! {
            /// A mark queued after every operation queued so far ([`DeviceMark`](crate::DeviceMark)):
            /// when the device passes it is read later, so a caller times what it queued without
            /// waiting for it. `None` where the backend does not mark (the CPU: it computes as
            /// it is called, and its callers read the host's clock); the caller then waits with
            /// [`Backend::synchronize`] and reads the host's clock.
            ///
            /// # Errors
            /// Device failures.
            about fn mark(&self) -> Result<Option<Box<dyn crate::DeviceMark>>> {
                Ok(None)
            }
        }
        $op! {
            /// The most device memory this backend has held for tensors at once, in bytes, where it
            /// keeps its own pool (CUDA); `None` for host backends.
            about fn peak_memory(&self) -> Option<u64> {
                None
            }
        }
        $op! {
            /// Lends `t`'s device buffer to another process of this host: a handle by which that
            /// process's backend copies it ([`Backend::copy_lent`]), or `None` where this backend
            /// lends nothing (host memory). It returns once the device has finished writing the
            /// buffer. The caller keeps `t` (so its buffer stays this tensor's, unwritten) until
            /// the borrower says it has copied it.
            ///
            /// # Errors
            /// Device failures.
            about fn lend(&self, t: &Tensor) -> Result<Option<Vec<u8>>> {
                let _ = t;
                Ok(None)
            }
        }
        $op! {
            /// A tensor of this backend of `shape`, copied from the buffer another process lent
            /// with `handle` ([`Backend::lend`]). It returns once the copy has been made, so the
            /// lender may then reuse its buffer.
            ///
            /// # Errors
            /// [`KernelError::Lent`](crate::KernelError::Lent) for a handle this backend cannot
            /// open or a buffer smaller than `shape`; device failures.
            about fn copy_lent(&self, handle: &[u8], shape: &[usize]) -> Result<Tensor> {
                let _ = shape;
                let bytes = handle.len();
                Err(crate::KernelError::Lent {
                    detail: format!("a handle of {bytes} bytes, but {} borrows nothing", self.name()),
                })
            }
        }
        $op! {
            /// Whether the linear layers' operations ([`Backend::linear`],
            /// [`Backend::linear_activation`], [`Backend::linear_grad_activation`],
            /// [`Backend::linear_weight_grads`]) do their elementwise work inside the product
            /// (CUDA, through cuBLASLt's epilogues) rather than as the trait's defaults, their
            /// parts with those calls' bits. A timing wrapper times a fused call as one product
            /// and the default's parts apart.
            about fn fuses_linear_epilogues(&self) -> bool {
                false
            }
        }
        $op! {
            /// Makes `t` resident where this backend computes: a host tensor is copied to the
            /// device, a tensor already there is returned as it is (the CPU backend returns every
            /// host tensor as it is).
            ///
            /// # Errors
            /// A tensor held by a device this backend cannot reach; device allocation failures.
            op fn place(&self, t: Tensor) -> Result<Tensor>;
        }
        $op! {
            /// [`Backend::place`] for id tensors (labels, token ids).
            ///
            /// # Errors
            /// As [`Backend::place`].
            op fn place_ids(&self, t: Tensor<u32>) -> Result<Tensor<u32>>;
        }
        $op! {
            /// The elements of `t` in host memory: borrowed where they already are, copied from the
            /// device otherwise (after the device has finished writing them).
            ///
            /// # Errors
            /// A tensor held by a device this backend cannot reach; device failures.
            op fn read<'a>(&self, t: &'a Tensor) -> Result<Cow<'a, [f32]>>;
        }
        $op! {
            /// Overwrites the elements of `t` with host values `src` (as many as `t` has).
            ///
            /// # Errors
            /// Length mismatch; device failures.
            op fn write(&self, src: &[f32], t: &mut Tensor) -> Result<()>;
        }
        $op! {
            /// `dst = src` (`dst` takes `src`'s shape).
            ///
            /// # Errors
            /// None today; reserved for device failures.
            op fn copy(&self, src: &Tensor, dst: &mut Tensor) -> Result<()>;
        }
        $op! {
            /// Sets every element of `x` to `value`.
            ///
            /// # Errors
            /// None today; reserved for device failures.
            op fn fill(&self, value: f32, x: &mut Tensor) -> Result<()>;
        }
        $op! {
            /// `out = a * b`, elementwise; `out` takes `a`'s shape.
            ///
            /// # Errors
            /// `a` and `b` differ in length.
            op fn mul(&self, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()>;
        }
        $op! {
            /// `c = op(a) op(b)`, or `c += op(a) op(b)` when `accumulate`. `c` is resized to
            /// `rows(op(a)) x cols(op(b))` unless accumulating.
            ///
            /// # Errors
            /// Shape mismatch between the inner dimensions, or an accumulating `c` of the wrong
            /// shape.
            op fn matmul(
                &self,
                a: &Tensor,
                ta: Trans,
                b: &Tensor,
                tb: Trans,
                c: &mut Tensor,
                accumulate: bool,
            ) -> Result<()>;
        }
        $op! {
            /// `out = a^T` for a 2-D view of `a`.
            ///
            /// # Errors
            /// None today; reserved for device failures.
            op fn transpose(&self, a: &Tensor, out: &mut Tensor) -> Result<()>;
        }
        $op! {
            /// Adds `bias` (length `cols`) to every row of `y`.
            ///
            /// # Errors
            /// `bias` length differs from `y.cols()`.
            op fn add_bias(&self, y: &mut Tensor, bias: &Tensor) -> Result<()>;
        }
        $op! {
            /// A linear layer's forward product: `y = x w`, plus `bias` (length `cols(w)`) on
            /// every row where one is given. `y` is resized to `rows(x) x cols(w)`. The default
            /// is [`Backend::matmul`] then [`Backend::add_bias`], with their bits; a backend
            /// that adds the bias inside the product says so with
            /// [`Backend::fuses_linear_epilogues`] (it saves a pass over `y`).
            ///
            /// # Errors
            /// As [`Backend::matmul`] and [`Backend::add_bias`]: inner dimensions that differ, a
            /// bias of another length than `cols(w)`.
            op fn linear(
                &self,
                x: &Tensor,
                w: &Tensor,
                bias: Option<&Tensor>,
                y: &mut Tensor,
            ) -> Result<()> {
                crate::backend::linear_by_parts(self, x, w, bias, y)
            }
        }
        $op! {
            /// A linear layer and the activation after it: `pre = x w (+ bias)` as
            /// [`Backend::linear`] makes it (kept for the activation's gradient) and
            /// `y = act(pre)`. The default is [`Backend::linear`] then [`Backend::activation`],
            /// with their bits; a backend that fuses the bias
            /// ([`Backend::fuses_linear_epilogues`]) may apply the activation as the product's
            /// results are written (CUDA: GELU).
            ///
            /// # Errors
            /// As [`Backend::linear`].
            op fn linear_activation(
                &self,
                x: &Tensor,
                w: &Tensor,
                bias: Option<&Tensor>,
                act: Activation,
                pre: &mut Tensor,
                y: &mut Tensor,
            ) -> Result<()> {
                crate::backend::linear_activation_by_parts(self, (x, w, bias), act, pre, y)
            }
        }
        $op! {
            /// A linear layer's weight gradients: `gw (+)= x^T dy` and, where the layer has a
            /// bias, `gb (+)= sum of dy's rows` (added to when `accumulate`, as
            /// [`Backend::matmul`] and [`Backend::sum_rows`] do). The default is those two
            /// calls, with their bits; a backend that fuses
            /// ([`Backend::fuses_linear_epilogues`]) may sum the bias gradient inside the product
            /// (CUDA: cuBLASLt's `BGRADA`).
            ///
            /// # Errors
            /// As [`Backend::matmul`] and [`Backend::sum_rows`].
            op fn linear_weight_grads(
                &self,
                x: &Tensor,
                dy: &Tensor,
                gw: &mut Tensor,
                gb: Option<&mut Tensor>,
                accumulate: bool,
            ) -> Result<()> {
                crate::backend::linear_weight_grads_by_parts(self, (x, dy), gw, gb, accumulate)
            }
        }
        $op! {
            /// The backward of a linear layer of weight `w` into the activation before it:
            /// with `dy` the gradient at the linear layer's output and `pre` the activation's
            /// input, `dz = act'(pre) (.) (dy w^T)`, the gradient at the activation's input
            /// (`dz` takes `pre`'s shape). The default is [`Backend::matmul`] then
            /// [`Backend::activation_backward`], with their bits; a backend that fuses
            /// ([`Backend::fuses_linear_epilogues`]) may apply the activation's gradient as the
            /// product's results are written (CUDA: GELU's).
            ///
            /// # Errors
            /// As [`Backend::matmul`] and [`Backend::activation_backward`]: `dy` and `w` of
            /// different widths, a `pre` of another size than the product.
            op fn linear_grad_activation(
                &self,
                dy: &Tensor,
                w: &Tensor,
                act: Activation,
                pre: &Tensor,
                dz: &mut Tensor,
            ) -> Result<()> {
                crate::backend::linear_grad_activation_by_parts(self, dy, w, act, pre, dz)
            }
        }
        $op! {
            /// Column sums: `out[j] (+)= sum_i x[i, j]`, rows summed in order.
            ///
            /// # Errors
            /// `out` length differs from `x.cols()` when accumulating.
            op fn sum_rows(&self, x: &Tensor, out: &mut Tensor, accumulate: bool) -> Result<()>;
        }
        $op! {
            /// `y = act(x)`, elementwise; `y` takes `x`'s shape.
            ///
            /// # Errors
            /// None today; reserved for device failures.
            op fn activation(&self, act: Activation, x: &Tensor, y: &mut Tensor) -> Result<()>;
        }
        $op! {
            /// `dx = act'(x) * dy`, elementwise.
            ///
            /// # Errors
            /// `x` and `dy` differ in shape.
            op fn activation_backward(
                &self,
                act: Activation,
                x: &Tensor,
                dy: &Tensor,
                dx: &mut Tensor,
            ) -> Result<()>;
        }
        $op! {
            /// Row-wise layer normalisation: `y = (x - mean) * rstd * gamma + beta`, also writing
            /// each row's `mean` and `rstd = 1 / sqrt(var + eps)` for the backward pass.
            ///
            /// # Errors
            /// `gamma`/`beta` length differs from `x.cols()`.
            #[allow(clippy::too_many_arguments)]
            op fn layer_norm(
                &self,
                x: &Tensor,
                gamma: &Tensor,
                beta: &Tensor,
                eps: f32,
                y: &mut Tensor,
                mean: &mut Tensor,
                rstd: &mut Tensor,
            ) -> Result<()>;
        }
        $op! {
            /// Gradient of layer normalisation with respect to its input.
            ///
            /// # Errors
            /// Operand shapes disagree.
            op fn layer_norm_backward_input(
                &self,
                x: &Tensor,
                gamma: &Tensor,
                mean: &Tensor,
                rstd: &Tensor,
                dy: &Tensor,
                dx: &mut Tensor,
            ) -> Result<()>;
        }
        $op! {
            /// Gradient of layer normalisation with respect to `gamma` and `beta`, accumulated into
            /// `dgamma` and `dbeta` when `accumulate`.
            ///
            /// # Errors
            /// Operand shapes disagree.
            #[allow(clippy::too_many_arguments)]
            op fn layer_norm_backward_params(
                &self,
                x: &Tensor,
                mean: &Tensor,
                rstd: &Tensor,
                dy: &Tensor,
                dgamma: &mut Tensor,
                dbeta: &mut Tensor,
                accumulate: bool,
            ) -> Result<()>;
        }
        $op! {
            /// Softmax cross-entropy of the first `classes` columns of `logits` (rows x
            /// columns, `classes <= columns`) against `labels` (one id per row). When `dlogits`
            /// is given it receives `(softmax - onehot) * grad_scale` in those columns and zeros
            /// in the rest: columns past `classes` are a padded vocabulary's (rows of the head's
            /// weight kept so a GPU's products have aligned rows), not classes. A row labelled
            /// [`IGNORED_LABEL`] is not a loss term: it adds nothing, is not counted, and its
            /// gradient row is zero.
            ///
            /// # Errors
            /// A label outside `0..classes`, `classes` over the columns, or a label count
            /// different from the row count.
            op fn softmax_cross_entropy(
                &self,
                logits: &Tensor,
                classes: usize,
                labels: &Tensor<u32>,
                grad_scale: f32,
                dlogits: Option<&mut Tensor>,
            ) -> Result<LossStats>;
        }
        $op! {
            /// [`Backend::softmax_cross_entropy`] without waiting for its statistics: the
            /// gradient is queued as there, and the statistics come back as a [`LossReading`]
            /// for [`Backend::read_losses`]. A device backend queues the label check too, so a
            /// label out of range is reported by `read_losses`; the trait's default computes
            /// at once.
            ///
            /// # Errors
            /// As `softmax_cross_entropy`, where the backend checks at once.
            op fn queue_softmax_cross_entropy(
                &self,
                logits: &Tensor,
                classes: usize,
                labels: &Tensor<u32>,
                grad_scale: f32,
                dlogits: Option<&mut Tensor>,
            ) -> Result<LossReading> {
                self.softmax_cross_entropy(logits, classes, labels, grad_scale, dlogits)
                    .map(LossReading::Ready)
            }
        }
        $op! {
            /// The statistics of `readings`, in their order: one wait for all that are still
            /// on this backend's device.
            ///
            /// # Errors
            /// A label out of range in a queued reading; a reading another backend queued;
            /// device failures.
            op fn read_losses(&self, readings: Vec<LossReading>) -> Result<Vec<LossStats>> {
                readings
                    .into_iter()
                    .map(|reading| match reading {
                        LossReading::Ready(stats) => Ok(stats),
                        LossReading::Queued(_) => Err($crate::error::shape_err(
                            "read_losses",
                            "a loss another backend queued",
                        )),
                    })
                    .collect()
            }
        }
        $op! {
            /// Token-embedding lookup: row `i` of `out` (`[ids, C]`) is row `ids[i]` of `table`
            /// (`[vocab, C]`). Token ids travel as exact whole numbers in an `f32` tensor (a
            /// pipeline's first stage receives them as its input activation).
            ///
            /// # Errors
            /// [`crate::KernelError::Token`] for an id that is not a whole number below `vocab`.
            op fn embedding(&self, ids: &Tensor, table: &Tensor, out: &mut Tensor) -> Result<()>;
        }
        $op! {
            /// The embedding's weight gradient: `dtable[ids[i]] += dy[i]`, rows summed in order;
            /// `dtable` is zeroed first unless `accumulate`.
            ///
            /// # Errors
            /// As [`Backend::embedding`]; `dy` rows differing from the id count.
            op fn embedding_backward(
                &self,
                ids: &Tensor,
                dy: &Tensor,
                dtable: &mut Tensor,
                accumulate: bool,
            ) -> Result<()>;
        }
        $op! {
            /// Causal multi-head self-attention: `out[b, t]` (`[batch * seq, C]`) attends over
            /// positions `0..=t` of sequence `b` with `softmax(q k^T / sqrt(C / heads)) v`, per
            /// head, from the packed `qkv` (see [`AttentionShape`]). `lse` receives each row's
            /// log-sum-exp of scaled scores (`[batch, heads, seq]`), all the backward needs besides
            /// the inputs.
            ///
            /// `documents` masks packed documents: per token (`[batch * seq]`, whole numbers in
            /// `f32`, as token ids are), the index in its sequence where its document starts. Token
            /// `t` then attends over positions `starts[t]..=t` only. Documents are contiguous: a
            /// token's start is its predecessor's, or its own index. `None` is one document per
            /// sequence.
            ///
            /// # Errors
            /// Operand sizes that do not match `shape`; a document start that is not a whole number
            /// in `0..=t`, or neither its predecessor's start nor `t`.
            op fn attention(
                &self,
                qkv: &Tensor,
                documents: Option<&Tensor>,
                shape: AttentionShape,
                out: &mut Tensor,
                lse: &mut Tensor,
            ) -> Result<()>;
        }
        $op! {
            /// The gradient of [`Backend::attention`] with respect to `qkv`, from the forward's
            /// inputs (the same `documents`) and outputs and `dout`.
            ///
            /// # Errors
            /// As [`Backend::attention`].
            #[allow(clippy::too_many_arguments)]
            op fn attention_backward(
                &self,
                qkv: &Tensor,
                documents: Option<&Tensor>,
                out: &Tensor,
                lse: &Tensor,
                dout: &Tensor,
                shape: AttentionShape,
                dqkv: &mut Tensor,
            ) -> Result<()>;
        }
        $op! {
            /// `y += alpha * x`, elementwise.
            ///
            /// # Errors
            /// Length mismatch.
            op fn axpy(&self, alpha: f32, x: &Tensor, y: &mut Tensor) -> Result<()>;
        }
        $op! {
            /// `x *= alpha`, elementwise.
            ///
            /// # Errors
            /// None today; reserved for device failures.
            op fn scale(&self, alpha: f32, x: &mut Tensor) -> Result<()>;
        }
        $op! {
            /// One SGD update of `param` from `grad`, with the momentum buffer `buf` when momentum
            /// is on; what it saw of their finiteness ([`UpdateSeen`]).
            ///
            /// # Errors
            /// Length mismatch, or momentum requested without a buffer.
            op fn sgd_update(
                &self,
                param: &mut Tensor,
                grad: &Tensor,
                buf: Option<&mut Tensor>,
                hp: SgdStep,
            ) -> Result<UpdateSeen>;
        }
        $op! {
            /// One Adam/AdamW update of `param` from `grad` with moment buffers `m` and `v`; what
            /// it saw of their finiteness ([`UpdateSeen`]).
            ///
            /// # Errors
            /// Length mismatch.
            op fn adam_update(
                &self,
                param: &mut Tensor,
                grad: &Tensor,
                m: &mut Tensor,
                v: &mut Tensor,
                hp: AdamStep,
            ) -> Result<UpdateSeen>;
        }
        $op! {
            /// Adam/AdamW updates of many tensors at once: [`Backend::adam_update`] on each (each
            /// reads and writes only its own operands, so their order does not matter), with
            /// the same bits; what each saw, in `updates`' order. A device backend launches a
            /// few kernels for the whole list rather than one per tensor (a GPT-2 has 149).
            ///
            /// # Errors
            /// Length mismatch in any of them; nothing is updated then.
            op fn adam_updates(&self, updates: &mut [AdamTensors<'_>]) -> Result<Vec<UpdateSeen>> {
                $crate::backend::adam_lengths(updates)?;
                updates
                    .iter_mut()
                    .map(|u| self.adam_update(u.param, u.grad, u.m, u.v, u.hp))
                    .collect()
            }
        }
        $op! {
            /// One Lion update of `param` from `grad` with its momentum `m`: `w -= lr (sign(beta1 m
            /// + (1 - beta1) g) + weight_decay w)`, then `m = beta2 m + (1 - beta2) g`; what it
            /// saw of their finiteness ([`UpdateSeen`]).
            ///
            /// # Errors
            /// Length mismatch.
            op fn lion_update(
                &self,
                param: &mut Tensor,
                grad: &Tensor,
                m: &mut Tensor,
                hp: LionStep,
            ) -> Result<UpdateSeen>;
        }
        $op! {
            /// One delay compensation of `grad` ([`DelayCompensation`]) for the weights `current`
            /// it is applied to and the `stale` ones it was computed at; `mean_square` is the
            /// adaptive form's `MS` (required by it, ignored otherwise).
            ///
            /// # Errors
            /// Length mismatch, or the adaptive form without its buffer.
            op fn delay_compensate(
                &self,
                grad: &mut Tensor,
                current: &Tensor,
                stale: &Tensor,
                mean_square: Option<&mut Tensor>,
                hp: DelayCompensation,
            ) -> Result<()>;
        }
        $op! {
            /// Sum of all elements, accumulated in `f64` in a fixed order.
            ///
            /// # Errors
            /// None today; reserved for device failures.
            op fn sum(&self, x: &Tensor) -> Result<f64>;
        }
        $op! {
            /// Sum of squares of all elements, accumulated in `f64` in a fixed order.
            ///
            /// # Errors
            /// None today; reserved for device failures.
            op fn sum_squares(&self, x: &Tensor) -> Result<f64>;
        }
        $op! {
            /// The index of the first tensor of `xs` that holds a value that is not finite (NaN or
            /// an infinity), or `None`. A device backend answers for the whole list with one wait,
            /// so a guard over every gradient of an update costs one round trip, not one per
            /// tensor.
            ///
            /// # Errors
            /// Device failures.
            op fn first_non_finite(&self, xs: &[&Tensor]) -> Result<Option<usize>> {
                for (i, x) in xs.iter().enumerate() {
                    // A sum of f32 values in f64 is finite exactly when every value is.
                    let finite = match x.host() {
                        Ok(values) => $crate::backend::all_finite(values),
                        Err(_) => self.sum(x)?.is_finite(),
                    };
                    if !finite {
                        return Ok(Some(i));
                    }
                }
                Ok(None)
            }
        }
    };
}
pub(crate) use backend_ops;

/// The operand lengths of every update of an [`Backend::adam_updates`] call, checked before
/// any is applied.
///
/// # Errors
/// The first update whose gradient or moments differ in length from its weights.
pub(crate) fn adam_lengths(updates: &[AdamTensors<'_>]) -> Result<()> {
    for (i, u) in updates.iter().enumerate() {
        let n = u.param.len();
        if u.grad.len() != n || u.m.len() != n || u.v.len() != n {
            return Err(crate::error::shape_err(
                "adam_updates",
                format!(
                    "tensor {i}: param {:?}, grad {:?}, moments {:?} and {:?}",
                    u.param.shape(),
                    u.grad.shape(),
                    u.m.shape(),
                    u.v.shape()
                ),
            ));
        }
    }
    Ok(())
}

/// [`Backend::linear`] as [`Backend::matmul`] then [`Backend::add_bias`] on `be` (the trait's
/// default, and what a timing wrapper times part by part), the bias's length checked first.
pub(crate) fn linear_by_parts<B: Backend + ?Sized>(
    be: &B,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    y: &mut Tensor,
) -> Result<()> {
    if let Some(b) = bias {
        linear_bias(w, b)?;
    }
    be.matmul(x, Trans::No, w, Trans::No, y, false)?;
    match bias {
        Some(b) => be.add_bias(y, b),
        None => Ok(()),
    }
}

/// [`Backend::linear_activation`] as [`Backend::linear`] then [`Backend::activation`] on
/// `be` (the trait's default, and what a timing wrapper times part by part).
pub(crate) fn linear_activation_by_parts<B: Backend + ?Sized>(
    be: &B,
    (x, w, bias): (&Tensor, &Tensor, Option<&Tensor>),
    act: Activation,
    pre: &mut Tensor,
    y: &mut Tensor,
) -> Result<()> {
    be.linear(x, w, bias, pre)?;
    be.activation(act, pre, y)
}

/// [`Backend::linear_grad_activation`] as [`Backend::matmul`] then
/// [`Backend::activation_backward`] on `be` (the trait's default, and what a timing wrapper
/// times part by part).
pub(crate) fn linear_grad_activation_by_parts<B: Backend + ?Sized>(
    be: &B,
    dy: &Tensor,
    w: &Tensor,
    act: Activation,
    pre: &Tensor,
    dz: &mut Tensor,
) -> Result<()> {
    let mut dh = Tensor::default();
    be.matmul(dy, Trans::No, w, Trans::Yes, &mut dh, false)?;
    be.activation_backward(act, pre, &dh, dz)
}

/// [`Backend::linear_weight_grads`] as [`Backend::matmul`] then [`Backend::sum_rows`] on `be`
/// (the trait's default, and what a timing wrapper times part by part).
pub(crate) fn linear_weight_grads_by_parts<B: Backend + ?Sized>(
    be: &B,
    (x, dy): (&Tensor, &Tensor),
    gw: &mut Tensor,
    gb: Option<&mut Tensor>,
    accumulate: bool,
) -> Result<()> {
    be.matmul(x, Trans::Yes, dy, Trans::No, gw, accumulate)?;
    match gb {
        Some(gb) => be.sum_rows(dy, gb, accumulate),
        None => Ok(()),
    }
}

/// A linear layer's bias: one value per column of its weight `w`.
pub(crate) fn linear_bias(w: &Tensor, bias: &Tensor) -> Result<()> {
    let n = w.cols();
    if bias.len() == n {
        return Ok(());
    }
    Err(crate::error::shape_err(
        "linear",
        format!("bias has {} elements, the weight {n} columns", bias.len()),
    ))
}

/// Declares one method of [`Backend`] from [`backend_ops`] (`self` is taken from the list, where
/// the default bodies that use it are written).
macro_rules! declare_method {
    (
        $(#[$meta:meta])* $kind:ident fn $name:ident $(<$lt:lifetime>)?
        (&$self:ident $(, $arg:ident: $ty:ty)* $(,)?) -> $ret:ty;
    ) => {
        $(#[$meta])*
        fn $name $(<$lt>)? (&$self $(, $arg: $ty)*) -> $ret;
    };
    (
        $(#[$meta:meta])* $kind:ident fn $name:ident $(<$lt:lifetime>)?
        (&$self:ident $(, $arg:ident: $ty:ty)* $(,)?) -> $ret:ty $default:block
    ) => {
        $(#[$meta])*
        fn $name $(<$lt>)? (&$self $(, $arg: $ty)*) -> $ret $default
    };
}

/// The compute interface every layer is written against.
///
/// Operands are viewed as 2-D (`rows x cols`, see [`Tensor::rows`]). Outputs are resized by the
/// callee when `resize` applies, so callers may pass reusable scratch tensors. Every
/// implementation must be deterministic: the same inputs give the same bits on every call,
/// whatever the thread count.
///
/// The methods are declared from the one list in `backend_ops!`, which also writes the
/// forwarding methods of the wrappers: `Box`, [`Timed`](crate::Timed) and
/// [`EmulatedDevice`](crate::EmulatedDevice).
pub trait Backend: Send + Sync + std::fmt::Debug {
    backend_ops!(declare_method);
}

/// Forwards one method of [`Backend`] from a box to the backend in it.
macro_rules! boxed_method {
    (
        $(#[$meta:meta])* $kind:ident fn $name:ident $(<$lt:lifetime>)?
        (&self $(, $arg:ident: $ty:ty)* $(,)?) -> $ret:ty $(;)? $($default:block)?
    ) => {
        fn $name $(<$lt>)? (&self $(, $arg: $ty)*) -> $ret {
            (**self).$name($($arg),*)
        }
    };
}

/// A boxed backend is a backend: runs choose theirs at run time (`--backend`) and hand the box
/// to code written for any `B: Backend`. Every method, the provided ones too, goes to the boxed
/// backend, so its own overrides are the ones that run.
impl<B: Backend + ?Sized> Backend for Box<B> {
    backend_ops!(boxed_method);
}

/// The arithmetic of a backend's matrix products: the typed form of `--precision`.
///
/// Weights, optimizer state, gradients and every operation other than the products stay f32
/// in all of them. The CUDA backend offers TF32 and bf16; the CPU backend offers bf16x6, f32's
/// accuracy from bf16 tile products, and bf16x3, about 16 bits from half as many.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// Full f32 products.
    #[default]
    F32,
    /// Products on tensor cores with inputs rounded to TF32 (10-bit mantissa), f32 accumulation
    /// (PyTorch's `allow_tf32`).
    Tf32,
    /// Products on tensor cores with inputs rounded to bf16 (round to nearest even), f32
    /// accumulation and f32 results.
    Bf16,
    /// f32 products summed from six bf16 products of each element's three bf16 parts on the
    /// CPU's AMX tiles, accumulated in f32: f32's accuracy (the dropped terms are below f32's
    /// rounding), other bits than [`Precision::F32`]'s, the same bits with or without AMX
    /// (the CPU backend only; see `split_bf16.rs`).
    Bf16x6,
    /// Products summed from three bf16 products of each element's two leading bf16 parts on
    /// the CPU's AMX tiles (`a0 b1 + a0 b0 + a1 b0`), accumulated in f32: about 16 bits of
    /// each term (PyTorch's `set_float32_matmul_precision("high")` describes the same
    /// split), in half the tile products of [`Precision::Bf16x6`]; the same bits with or
    /// without AMX (the CPU backend only; see `split_bf16.rs`).
    Bf16x3,
}

impl Precision {
    /// The name `--precision` takes.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
            Precision::Bf16x6 => "bf16x6",
            Precision::Bf16x3 => "bf16x3",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "tf32" => Ok(Precision::Tf32),
            "bf16" => Ok(Precision::Bf16),
            "bf16x6" => Ok(Precision::Bf16x6),
            "bf16x3" => Ok(Precision::Bf16x3),
            other => Err(format!(
                "unknown precision '{other}' (f32, tf32, bf16, bf16x6, bf16x3)"
            )),
        }
    }
}

/// Which compute backend a run uses: the typed form of `--backend` (and, for CUDA,
/// `--precision`), parsed once at the edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The CPU backend (always built), with the precision of its products (f32, bf16x6 or
    /// bf16x3).
    Cpu(Precision),
    /// The CUDA backend (behind the `cuda` feature), with the precision of its products.
    Cuda(Precision),
}

impl Default for BackendKind {
    /// The CPU in f32.
    fn default() -> Self {
        BackendKind::Cpu(Precision::F32)
    }
}

impl BackendKind {
    /// The name `--backend` takes.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu(_) => "cpu",
            BackendKind::Cuda(_) => "cuda",
        }
    }

    /// The precision of this backend's products.
    pub fn precision(self) -> Precision {
        match self {
            BackendKind::Cpu(p) | BackendKind::Cuda(p) => p,
        }
    }

    /// This backend computing its products in `precision`.
    ///
    /// # Errors
    /// A one-line message when the backend cannot (the CPU computes in f32, or in bf16x6 or
    /// bf16x3 where it has AMX tiles; CUDA in f32, tf32 or bf16).
    pub fn with_precision(self, precision: Precision) -> std::result::Result<Self, String> {
        match (self, precision) {
            (BackendKind::Cpu(_), Precision::F32) => Ok(BackendKind::Cpu(Precision::F32)),
            (BackendKind::Cpu(_), precision @ (Precision::Bf16x6 | Precision::Bf16x3)) => {
                if crate::split_bf16::hardware_available() {
                    Ok(BackendKind::Cpu(precision))
                } else {
                    Err(crate::KernelError::NoTileUnit { precision }.to_string())
                }
            }
            (BackendKind::Cpu(_), p) => Err(format!(
                "the cpu backend computes in f32, bf16x6 or bf16x3; --precision {p} needs \
                 --backend cuda"
            )),
            (BackendKind::Cuda(_), p @ (Precision::Bf16x6 | Precision::Bf16x3)) => Err(format!(
                "--precision {p} is the cpu backend's (AMX tiles); the cuda backend computes in \
                 f32, tf32 or bf16"
            )),
            (BackendKind::Cuda(_), p) => Ok(BackendKind::Cuda(p)),
        }
    }

    /// Opens the backend with `threads` compute threads (0: one per core; the CPU's) on device
    /// `ordinal` (CUDA's).
    ///
    /// # Errors
    /// [`crate::KernelError::NotCompiledWithCuda`] for CUDA in a build without it,
    /// [`crate::KernelError::NoCuda`] where no driver, device or NVRTC is found; thread-pool
    /// failures for the CPU.
    pub fn open(self, threads: usize, ordinal: usize) -> Result<Box<dyn Backend>> {
        match self {
            BackendKind::Cpu(precision) => Ok(Box::new(crate::CpuBackend::with_precision(
                threads, precision,
            )?)),
            BackendKind::Cuda(precision) => crate::cuda::open(ordinal, precision),
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    /// `cpu` or `cuda` (f32 products; [`BackendKind::with_precision`] sets another).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(BackendKind::Cpu(Precision::F32)),
            "cuda" => Ok(BackendKind::Cuda(Precision::F32)),
            other => Err(format!("unknown backend '{other}' (cpu, cuda)")),
        }
    }
}
