//! The layer interface: what every layer implements ([`Layer`]), what its forward saves for
//! its backward ([`Saved`]), the per-call context ([`ForwardCtx`]), and the normal
//! initialisation shared by the dense and the transformer layers.
//!
//! It is a module of its own so that the layer implementations (`layers`, `transformer`) and
//! the layer descriptions that build them (`layers::LayerSpec`) depend on it and not on each
//! other.

use pipe_kernels::{Backend, Result as KResult, Tensor};
use rand_distr::{Distribution, Normal};

use crate::rng::Rng;

/// Everything a layer saves in its forward pass for its backward pass.
#[derive(Clone, Debug, Default)]
pub struct Saved {
    /// Saved tensors (inputs, masks, statistics), layer-specific.
    pub tensors: Vec<Tensor>,
    /// Saved input shape, for layers that reshape.
    pub shape: Vec<usize>,
    /// What the inner layers of a block saved, in order.
    pub inner: Vec<Saved>,
}

impl Saved {
    /// Saved tensors only (no reshape to undo).
    pub fn tensors(tensors: Vec<Tensor>) -> Self {
        Self {
            tensors,
            shape: Vec::new(),
            inner: Vec::new(),
        }
    }

    /// Bytes held by the saved tensors (inner layers' included).
    pub fn bytes(&self) -> usize {
        let own: usize = self.tensors.iter().map(|t| t.len() * 4).sum();
        own + self.inner.iter().map(Saved::bytes).sum::<usize>()
    }
}

/// Per-call context of a forward pass.
#[derive(Clone, Copy, Debug)]
pub struct ForwardCtx {
    /// Training mode (dropout active) or evaluation.
    pub train: bool,
    /// Seed for this layer and microbatch (dropout masks); derived by the model from the run
    /// seed, the layer index and the microbatch id, so it is the same on any partition.
    pub seed: u64,
}

/// A layer: shape logic, initialisation, forward and the two halves of backward.
pub trait Layer: Send + Sync + std::fmt::Debug {
    /// Short kind name (`linear`, `relu`, ...).
    fn kind(&self) -> &'static str;

    /// Names and shapes of the parameters, in the order the other methods take them. A block
    /// names its inner layers' parameters `{inner index}.{name}`.
    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        Vec::new()
    }

    /// Fresh parameters drawn from `rng`.
    fn init_params(&self, rng: &mut Rng) -> Vec<Tensor> {
        let _ = rng;
        Vec::new()
    }

    /// Per-sample output shape for a per-sample input shape, or why the input does not fit.
    ///
    /// # Errors
    /// A message naming the mismatch.
    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String>;

    /// Forward floating-point operations per sample (multiply-add counted as 2).
    fn flops_per_sample(&self, input: &[usize]) -> u64 {
        input.iter().product::<usize>() as u64
    }

    /// Forward pass.
    ///
    /// # Errors
    /// Kernel shape errors.
    fn forward(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        x: Tensor,
        ctx: ForwardCtx,
    ) -> KResult<(Tensor, Saved)>;

    /// Gradient with respect to the input.
    ///
    /// # Errors
    /// Kernel shape errors.
    fn backward_input(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        saved: &Saved,
        dy: &Tensor,
    ) -> KResult<Tensor>;

    /// Gradient with respect to the parameters, written (or added, when `accumulate`) to
    /// `grads`, one tensor per parameter. Layers without parameters do nothing.
    ///
    /// # Errors
    /// Kernel shape errors.
    fn backward_params(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        saved: &Saved,
        dy: &Tensor,
        grads: &mut [Tensor],
        accumulate: bool,
    ) -> KResult<()> {
        let _ = (be, params, saved, dy, grads, accumulate);
        Ok(())
    }

    /// Both halves of the backward at once: the parameter gradients into `grads` (as
    /// [`Layer::backward_params`]), then the input gradient when `need_input_grad`. Layers
    /// whose two halves share work (attention, blocks) override it to do that work once; the
    /// bits equal the two halves called apart.
    ///
    /// # Errors
    /// Kernel shape errors.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        saved: &Saved,
        dy: &Tensor,
        grads: &mut [Tensor],
        accumulate: bool,
        need_input_grad: bool,
    ) -> KResult<Option<Tensor>> {
        self.backward_params(be, params, saved, dy, grads, accumulate)?;
        if need_input_grad {
            return self.backward_input(be, params, saved, dy).map(Some);
        }
        Ok(None)
    }
}

/// Standard deviation of the normal initialisation of embeddings, attention and the head
/// (GPT-2's).
pub const INIT_STD: f64 = 0.02;

/// `shape` filled from `N(0, std)`.
pub(crate) fn normal(rng: &mut Rng, shape: &[usize], std: f64) -> Tensor {
    let n = shape.iter().product();
    let data = match Normal::new(0.0, std) {
        Ok(d) => (0..n).map(|_| d.sample(rng) as f32).collect(),
        Err(_) => vec![0.0; n],
    };
    Tensor::from_vec(shape, data).unwrap_or_default()
}
