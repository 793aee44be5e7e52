//! The layer interface: what every layer implements ([`Layer`]), what its forward saves for
//! its backward ([`Saved`]), the per-call context ([`ForwardCtx`]), and what the dense and
//! the transformer layers share: the normal initialisation and the feature-shape and matrix
//! product helpers.
//!
//! It is a module of its own so that the layer implementations (`layers`, `transformer`) and
//! the layer descriptions that build them (`layers::LayerSpec`) depend on it and not on each
//! other.

use pipe_kernels::{Backend, Result as KResult, Tensor, Trans};
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
    /// A stand-in for what the layer would have saved: `tensors` holds its input only, and
    /// the backward runs its forward again from it with this context ([`Saved::recompute`],
    /// [`materialize`]).
    pub recompute: Option<ForwardCtx>,
}

impl Saved {
    /// Saved tensors only (no reshape to undo).
    pub fn tensors(tensors: Vec<Tensor>) -> Self {
        Self {
            tensors,
            ..Self::default()
        }
    }

    /// The stand-in of a layer whose activations the backward recomputes: its `input` and the
    /// context its forward ran with (the same dropout seed, so the recomputation gives the
    /// same bits).
    pub fn recompute(input: Tensor, ctx: ForwardCtx) -> Self {
        Self {
            tensors: vec![input],
            recompute: Some(ctx),
            ..Self::default()
        }
    }

    /// Bytes held by the saved tensors (inner layers' included).
    pub fn bytes(&self) -> usize {
        let own: usize = self.tensors.iter().map(|t| t.len() * 4).sum();
        own + self.inner.iter().map(Saved::bytes).sum::<usize>()
    }
}

/// Per-call context of a forward pass.
#[derive(Clone, Debug)]
pub struct ForwardCtx {
    /// Training mode (dropout active) or evaluation.
    pub train: bool,
    /// Seed for this layer and microbatch (dropout masks); derived by the model from the run
    /// seed, the layer index and the microbatch id, so it is the same on any partition.
    pub seed: u64,
    /// Selective recomputation: a block keeps only the input of its attention layers, whose
    /// activations the backward recomputes (`--recompute selective`).
    pub recompute_attention: bool,
    /// The microbatch's packed documents (`--pack-documents`): the attention layers mask by
    /// them and the position embedding restarts at each; `None` when windows are not packed.
    pub documents: Option<std::sync::Arc<crate::documents::Documents>>,
}

/// Which activations the backward pass recomputes instead of keeping them from the forward
/// (`--recompute`): a trade of compute for the memory of activations in flight, which weight
/// stashing makes the largest term at a pipeline's first stages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Recompute {
    /// Keep everything the forward saves.
    #[default]
    None,
    /// Keep each layer's input only, where the layer would save more (a transformer block
    /// keeps its input instead of its attention and MLP activations), and run the layer's
    /// forward again in the backward.
    Full,
    /// Keep everything but the attention layers' activations (their query-key-value
    /// projection and output), recomputed from their input in the backward.
    Selective,
}

impl Recompute {
    /// The name flags and configs use.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Full => "full",
            Recompute::Selective => "selective",
        }
    }
}

impl std::str::FromStr for Recompute {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Recompute::None),
            "full" => Ok(Recompute::Full),
            "selective" => Ok(Recompute::Selective),
            _ => Err(format!(
                "unknown recomputation '{s}' (expected none, full or selective)"
            )),
        }
    }
}

/// What a forward pass keeps for a backward ([`crate::model::Model::forward_range`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    /// Evaluation: nothing; each layer's activations go once the next layer has its input.
    Nothing,
    /// Training: what the backward reads, with this kind of recomputation.
    Train(Recompute),
}

/// `--recompute`: one [`Recompute`] for every stage, or one per stage (`full,full,none,none`),
/// as the flag, a config file and a plan file write it. Per stage, a pipeline keeps
/// recomputation where memory is short (the first stages, which hold the most microbatches in
/// flight) and spends no compute on it elsewhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageRecompute(Vec<Recompute>);

impl Default for StageRecompute {
    fn default() -> Self {
        StageRecompute::every(Recompute::None)
    }
}

impl StageRecompute {
    /// The same kind on every stage.
    pub fn every(kind: Recompute) -> Self {
        StageRecompute(vec![kind])
    }

    /// One kind per stage, in stage order (one entry: every stage).
    ///
    /// # Errors
    /// An empty list.
    pub fn per_stage(kinds: Vec<Recompute>) -> Result<Self, String> {
        if kinds.is_empty() {
            return Err("--recompute needs at least one kind".into());
        }
        Ok(StageRecompute(kinds))
    }

    /// The kind stage `stage` runs with.
    pub fn at(&self, stage: usize) -> Recompute {
        match self.0.as_slice() {
            [one] => *one,
            kinds => kinds.get(stage).copied().unwrap_or_default(),
        }
    }

    /// The kinds as given: one (every stage) or one per stage.
    pub fn kinds(&self) -> &[Recompute] {
        &self.0
    }

    /// True when some stage recomputes.
    pub fn any(&self) -> bool {
        self.0.iter().any(|&k| k != Recompute::None)
    }

    /// Checks a per-stage list against a run of `stages` stages.
    ///
    /// # Errors
    /// A list whose length is neither one nor the stage count.
    pub fn check_stages(&self, stages: u32) -> Result<(), String> {
        let n = self.0.len();
        if n == 1 || n == stages as usize {
            return Ok(());
        }
        Err(format!(
            "--recompute {self} names {n} stages, but the run has {stages}: give one kind for \
             every stage or one per stage"
        ))
    }
}

impl std::fmt::Display for StageRecompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.0.iter().map(|k| k.name()).collect();
        f.write_str(&names.join(","))
    }
}

impl std::str::FromStr for StageRecompute {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let kinds = s
            .split(',')
            .map(|k| k.trim().parse())
            .collect::<Result<Vec<Recompute>, String>>()?;
        crate::limits::check_count(
            "recompute kinds",
            kinds.len() as u64,
            pipe_scheduler::limits::MAX_STAGES,
            "one per stage",
        )
        .map_err(|e| e.to_string())?;
        StageRecompute::per_stage(kinds)
    }
}

impl serde::Serialize for StageRecompute {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for StageRecompute {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// What `layer` saved in its forward, as its backward reads it: `saved` itself, or for a
/// stand-in ([`Saved::recompute`]) the layer's forward run again from the stashed input with
/// the same parameters and context.
///
/// # Errors
/// The layer's forward errors; a stand-in without its input.
pub fn materialize<'s>(
    layer: &dyn Layer,
    be: &dyn Backend,
    params: &[Tensor],
    saved: &'s Saved,
) -> KResult<std::borrow::Cow<'s, Saved>> {
    let Some(ctx) = saved.recompute.clone() else {
        return Ok(std::borrow::Cow::Borrowed(saved));
    };
    let input = saved
        .tensors
        .first()
        .ok_or_else(|| pipe_kernels::KernelError::Shape {
            op: "recompute",
            detail: "the stashed input is missing".into(),
        })?;
    let (_, full) = layer.forward(be, params, input.clone(), ctx)?;
    Ok(std::borrow::Cow::Owned(full))
}

/// A layer: shape logic, initialisation, forward and the two halves of backward.
pub trait Layer: Send + Sync + std::fmt::Debug {
    /// Short kind name (`linear`, `relu`, ...).
    fn kind(&self) -> &'static str;

    /// The elementwise activation this layer is, if it is one: a block runs a linear layer
    /// and the activation after it as one backend call ([`Backend::linear_activation`]).
    fn activation(&self) -> Option<pipe_kernels::Activation> {
        None
    }

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

/// Checks that `x` has `want` features (columns), for op `op`'s error.
pub(crate) fn features_of(x: &Tensor, op: &'static str, want: usize) -> KResult<()> {
    if x.cols() != want {
        return Err(pipe_kernels::KernelError::Shape {
            op,
            detail: format!("expected {want} features, got {:?}", x.shape()),
        });
    }
    Ok(())
}

/// `shape` with its last dimension set to `last` (an empty shape stays empty).
pub(crate) fn with_last(shape: &[usize], last: usize) -> Vec<usize> {
    let mut out = shape.to_vec();
    if let Some(l) = out.last_mut() {
        *l = last;
    }
    out
}

/// The per-sample output shape of a layer that maps the last dimension of `input` from
/// `inputs` to `outputs` features, or an error `{layer} expects {inputs} {features}, gets
/// shape {input:?}`.
pub(crate) fn map_features(
    input: &[usize],
    inputs: usize,
    outputs: usize,
    (layer, features): (&str, &str),
) -> Result<Vec<usize>, String> {
    match input.last() {
        Some(&f) if f == inputs => Ok(with_last(input, outputs)),
        _ => Err(format!(
            "{layer} expects {inputs} {features}, gets shape {input:?}"
        )),
    }
}

/// Forward FLOPs per sample of multiplying every row of `input` (all dimensions but the
/// last) by a `k x n` matrix.
pub(crate) fn matmul_flops(input: &[usize], k: usize, n: usize) -> u64 {
    let rows: usize = input[..input.len().saturating_sub(1)].iter().product();
    (2 * rows * k * n) as u64
}

/// The input gradient of a product by the weight `w` (`dy w`, or `dy w^T` with
/// `Trans::Yes`), shaped like the saved input `x`.
///
/// # Errors
/// Kernel shape errors.
pub(crate) fn matmul_input_grad(
    be: &dyn Backend,
    dy: &Tensor,
    w: &Tensor,
    trans_w: Trans,
    x: &Tensor,
) -> KResult<Tensor> {
    let mut dx = Tensor::default();
    be.matmul(dy, Trans::No, w, trans_w, &mut dx, false)?;
    dx.reshape(x.shape())
}
