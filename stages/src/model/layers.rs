//! Layers. A layer is configuration only; its parameters are passed in on every call. That keeps
//! weight versions explicit: a stage that stashes versions just hands the right tensors to the
//! same layer, and nothing has to be swapped in and out.
//!
//! Every backward comes in two parts, [`Layer::backward_input`] (gradient with respect to the
//! input) and [`Layer::backward_params`] (with respect to the parameters), so zero-bubble
//! schedules can run them at different times.

use pipe_kernels::{Activation, Backend, Result as KResult, Tensor, Trans};
use rand::Rng as _;
use rand_distr::{Distribution, Normal, Uniform};
use serde::{Deserialize, Serialize};

pub use crate::layer::{ForwardCtx, Layer, Saved};
use crate::layer::{
    INIT_STD, features_of, map_features, materialize, matmul_flops, matmul_input_grad, normal,
    with_last,
};
use crate::rng::{Rng, derive_seed, rng_for};

/// How a linear layer's weights are initialised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Init {
    /// Kaiming (He) normal, std `sqrt(2 / fan_in)`: for layers followed by ReLU-like activations.
    #[default]
    Kaiming,
    /// Xavier (Glorot) uniform, bound `sqrt(6 / (fan_in + fan_out))`.
    Xavier,
    /// Normal with standard deviation 0.02 (GPT-2's, for transformer blocks).
    Gpt,
    /// Zeros: a residual branch's last layer, so every block starts as the identity.
    Zeros,
}

/// The serialisable description of a layer, as written in model config files.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum LayerSpec {
    /// Fully connected: `y = x W + b`, `W` stored `inputs x outputs`.
    Linear {
        /// Input features.
        inputs: usize,
        /// Output features.
        outputs: usize,
        /// Whether the layer has a bias (default true).
        #[serde(default = "default_true")]
        bias: bool,
        /// Weight initialisation (default: Kaiming when followed by an activation, else Xavier).
        #[serde(default)]
        init: Option<Init>,
    },
    /// Rectified linear unit.
    Relu,
    /// GELU (tanh approximation).
    Gelu,
    /// Hyperbolic tangent.
    Tanh,
    /// Logistic sigmoid.
    Sigmoid,
    /// Layer normalisation over the last dimension, with learned scale and shift.
    LayerNorm {
        /// Features normalised (the last dimension).
        features: usize,
        /// Variance epsilon (default 1e-5).
        #[serde(default = "default_eps")]
        eps: f32,
    },
    /// Inverted dropout: zero each element with probability `p` and scale the rest by
    /// `1 / (1 - p)` in training; identity in evaluation.
    Dropout {
        /// Drop probability in `[0, 1)`.
        p: f32,
    },
    /// Flattens every per-sample dimension into one.
    Flatten,
    /// A block with a residual connection: `y = x + f(x)`, where `f` runs the inner layers in
    /// order. The block is one pipeline layer (stages cut between blocks, never inside one);
    /// its parameters are named `layers.{block}.{inner}.{name}`.
    Residual {
        /// The inner layers; their output must have the block's input shape.
        layers: Vec<LayerSpec>,
    },
    /// Inner layers run in order as one pipeline layer (no residual); parameters named
    /// `layers.{block}.{inner}.{name}`.
    Sequence {
        /// The inner layers.
        layers: Vec<LayerSpec>,
    },
    /// Token embedding plus learned position embedding: token ids `[tokens]` (whole numbers
    /// in `f32`) to `[tokens, width]`.
    Embedding {
        /// Vocabulary size.
        vocab: usize,
        /// Model width.
        width: usize,
        /// Longest sequence (rows of the position table).
        context: usize,
        /// Rows of the token table when more than `vocab` (see [`LayerSpec::LmHead`]'s).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        padded_vocab: Option<usize>,
    },
    /// Causal multi-head self-attention over `[tokens, width]`, with its query-key-value and
    /// output projections.
    Attention {
        /// Model width.
        width: usize,
        /// Heads; must divide `width`.
        heads: usize,
    },
    /// A pre-LayerNorm transformer block, one pipeline layer: `x + attention(ln(x))`, then
    /// `h + mlp(ln(h))` with a GELU MLP of `hidden` units. It is the sequence of two residual
    /// blocks, and its parameters are named accordingly (`layers.{i}.0.1.qkv.weight` is the
    /// attention's input projection, `layers.{i}.1.1.weight` the MLP's first linear layer).
    TransformerBlock {
        /// Model width.
        width: usize,
        /// Attention heads.
        heads: usize,
        /// MLP hidden units (default `4 * width`).
        #[serde(default)]
        hidden: Option<usize>,
    },
    /// Logits over the vocabulary, `x W^T` with `W` stored `[vocab, width]` (tieable to the
    /// token embedding).
    LmHead {
        /// Model width.
        width: usize,
        /// Vocabulary size.
        vocab: usize,
        /// Rows of the weight and columns of the logits when more than `vocab` (GPT-2's
        /// 50,257 padded to 50,304, a multiple of 128): a GPU's products over the vocabulary
        /// then have aligned rows. The extra rows start at zero, no token selects them, and
        /// the loss gives their logits no gradient, so they stay zero and the model computes
        /// what the unpadded one does.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        padded_vocab: Option<usize>,
    },
}

/// The rows of a vocabulary table: `padded` where given, which must hold the vocabulary and
/// not be absurdly larger (at most twice it and 4,096 rows more, which any rounding to a
/// power-of-two multiple stays within).
fn table_rows(layer: &str, vocab: usize, padded: Option<usize>) -> Result<usize, String> {
    let Some(rows) = padded else {
        return Ok(vocab);
    };
    let most = vocab.saturating_mul(2).saturating_add(4096);
    if rows < vocab || rows > most {
        return Err(format!(
            "{layer} padded_vocab {rows} must be between its vocab {vocab} and {most}"
        ));
    }
    Ok(rows)
}

fn default_true() -> bool {
    true
}

fn default_eps() -> f32 {
    1e-5
}

impl LayerSpec {
    /// Layers this spec describes, counting those inside residual blocks and sequences (one
    /// for any other layer); a transformer block counts as one.
    pub fn layer_count(&self) -> u64 {
        match self {
            LayerSpec::Residual { layers } | LayerSpec::Sequence { layers } => {
                1 + layers.iter().map(LayerSpec::layer_count).sum::<u64>()
            }
            _ => 1,
        }
    }

    /// Builds the layer, checking its own hyperparameters.
    ///
    /// `followed_by_activation` picks the default initialisation of a linear layer.
    ///
    /// # Errors
    /// Zero widths, a dropout probability outside `[0, 1)`, a non-positive epsilon.
    pub fn build(&self, followed_by_activation: bool) -> Result<Box<dyn Layer>, String> {
        Ok(match *self {
            LayerSpec::Linear {
                inputs,
                outputs,
                bias,
                init,
            } => {
                if inputs == 0 || outputs == 0 {
                    return Err(format!("linear layer {inputs}->{outputs} has a zero width"));
                }
                let init = init.unwrap_or(if followed_by_activation {
                    Init::Kaiming
                } else {
                    Init::Xavier
                });
                Box::new(Linear {
                    inputs,
                    outputs,
                    bias,
                    init,
                })
            }
            LayerSpec::Relu => Box::new(Act(Activation::Relu)),
            LayerSpec::Gelu => Box::new(Act(Activation::Gelu)),
            LayerSpec::Tanh => Box::new(Act(Activation::Tanh)),
            LayerSpec::Sigmoid => Box::new(Act(Activation::Sigmoid)),
            LayerSpec::LayerNorm { features, eps } => {
                if features == 0 {
                    return Err("layer_norm over zero features".into());
                }
                if !(eps > 0.0 && eps.is_finite()) {
                    return Err(format!("layer_norm eps must be positive, got {eps}"));
                }
                Box::new(LayerNorm { features, eps })
            }
            LayerSpec::Dropout { p } => {
                if !(0.0..1.0).contains(&p) {
                    return Err(format!("dropout probability must be in [0, 1), got {p}"));
                }
                Box::new(Dropout { p })
            }
            LayerSpec::Flatten => Box::new(Flatten),
            LayerSpec::Residual { ref layers } => Box::new(Residual::build(layers, true)?),
            LayerSpec::Sequence { ref layers } => Box::new(Residual::build(layers, false)?),
            LayerSpec::Embedding {
                vocab,
                width,
                context,
                padded_vocab,
            } => {
                if vocab == 0 || width == 0 || context == 0 {
                    return Err(format!(
                        "embedding sizes must be positive: vocab {vocab}, width {width}, \
                         context {context}"
                    ));
                }
                Box::new(crate::transformer::Embedding {
                    vocab,
                    rows: table_rows("embedding", vocab, padded_vocab)?,
                    width,
                    context,
                })
            }
            LayerSpec::Attention { width, heads } => {
                if heads == 0 || width == 0 || width % heads != 0 {
                    return Err(format!(
                        "attention width {width} must be a positive multiple of its {heads} heads"
                    ));
                }
                Box::new(crate::transformer::Attention { width, heads })
            }
            LayerSpec::TransformerBlock { .. } => {
                let inner = self.block_layers().unwrap_or_default();
                Box::new(Residual::build(&inner, false)?)
            }
            LayerSpec::LmHead {
                width,
                vocab,
                padded_vocab,
            } => {
                if width == 0 || vocab == 0 {
                    return Err(format!("lm_head {width}->{vocab} has a zero size"));
                }
                Box::new(crate::transformer::LmHead {
                    width,
                    vocab,
                    rows: table_rows("lm_head", vocab, padded_vocab)?,
                })
            }
        })
    }

    /// The two residual blocks a [`LayerSpec::TransformerBlock`] is made of; `None` for other
    /// layers.
    pub fn block_layers(&self) -> Option<Vec<LayerSpec>> {
        let LayerSpec::TransformerBlock {
            width,
            heads,
            hidden,
        } = *self
        else {
            return None;
        };
        let hidden = hidden.unwrap_or(4 * width);
        let norm = LayerSpec::LayerNorm {
            features: width,
            eps: default_eps(),
        };
        let linear = |inputs, outputs, init| LayerSpec::Linear {
            inputs,
            outputs,
            bias: true,
            init: Some(init),
        };
        Some(vec![
            LayerSpec::Residual {
                layers: vec![norm.clone(), LayerSpec::Attention { width, heads }],
            },
            LayerSpec::Residual {
                layers: vec![
                    norm,
                    linear(width, hidden, Init::Gpt),
                    LayerSpec::Gelu,
                    linear(hidden, width, Init::Zeros),
                ],
            },
        ])
    }

    /// True for elementwise activations (used to pick initialisations).
    pub fn is_activation(&self) -> bool {
        matches!(
            self,
            LayerSpec::Relu | LayerSpec::Gelu | LayerSpec::Tanh | LayerSpec::Sigmoid
        )
    }
}

/// Fully connected layer, `W: inputs x outputs`, optional bias.
#[derive(Debug, Clone)]
pub struct Linear {
    inputs: usize,
    outputs: usize,
    bias: bool,
    init: Init,
}

impl Layer for Linear {
    fn kind(&self) -> &'static str {
        "linear"
    }

    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let mut v = vec![("weight".into(), vec![self.inputs, self.outputs])];
        if self.bias {
            v.push(("bias".into(), vec![self.outputs]));
        }
        v
    }

    fn init_params(&self, rng: &mut Rng) -> Vec<Tensor> {
        let n = self.inputs * self.outputs;
        let data: Vec<f32> = match self.init {
            Init::Kaiming => {
                let std = (2.0 / self.inputs as f64).sqrt();
                match Normal::new(0.0, std) {
                    Ok(d) => (0..n).map(|_| d.sample(rng) as f32).collect(),
                    Err(_) => vec![0.0; n],
                }
            }
            Init::Xavier => {
                let a = (6.0 / (self.inputs + self.outputs) as f64).sqrt();
                match Uniform::new(-a, a) {
                    Ok(d) => (0..n).map(|_| d.sample(rng) as f32).collect(),
                    Err(_) => vec![0.0; n],
                }
            }
            Init::Gpt => normal(rng, &[self.inputs, self.outputs], INIT_STD)
                .into_host_vec()
                .unwrap_or_default(),
            Init::Zeros => vec![0.0; n],
        };
        let mut v = vec![Tensor::from_vec(&[self.inputs, self.outputs], data).unwrap_or_default()];
        if self.bias {
            v.push(Tensor::zeros(&[self.outputs]));
        }
        v
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String> {
        let what = ("linear layer", "input features");
        map_features(input, self.inputs, self.outputs, what)
    }

    fn flops_per_sample(&self, input: &[usize]) -> u64 {
        matmul_flops(input, self.inputs, self.outputs)
    }

    fn forward(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        x: Tensor,
        _ctx: ForwardCtx,
    ) -> KResult<(Tensor, Saved)> {
        features_of(&x, "linear forward", self.inputs)?;
        let mut y = Tensor::default();
        be.linear(&x, &params[0], params.get(1).filter(|_| self.bias), &mut y)?;
        let y = y.reshape(&with_last(x.shape(), self.outputs))?;
        Ok((y, Saved::tensors(vec![x])))
    }

    fn backward_input(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        saved: &Saved,
        dy: &Tensor,
    ) -> KResult<Tensor> {
        features_of(dy, "linear backward_input", self.outputs)?;
        matmul_input_grad(be, dy, &params[0], Trans::Yes, &saved.tensors[0])
    }

    fn backward_params(
        &self,
        be: &dyn Backend,
        _params: &[Tensor],
        saved: &Saved,
        dy: &Tensor,
        grads: &mut [Tensor],
        accumulate: bool,
    ) -> KResult<()> {
        features_of(dy, "linear backward_params", self.outputs)?;
        let x = &saved.tensors[0];
        let (gw, rest) = grads.split_at_mut(1);
        let gb = match (self.bias, rest.first_mut()) {
            (false, _) => None,
            (true, Some(gb)) => Some(gb),
            (true, None) => {
                return Err(pipe_kernels::KernelError::Shape {
                    op: "linear backward_params",
                    detail: "no gradient tensor for the bias".into(),
                });
            }
        };
        be.linear_weight_grads(x, dy, &mut gw[0], gb, accumulate)
    }
}

/// A linear layer (`params`: its weight, and its bias if it has one) and the activation `act`
/// after it, run as one backend call ([`Backend::linear_activation`]: on CUDA the GELU is
/// applied as the product's results are written). Gives the activation's output and what each
/// layer keeps on its own ([`Linear`]: its input; [`Act`]: its input, `x w + b`), so their
/// backward passes are unchanged; on a backend that does not fuse them, the same calls and
/// bits as the two layers' forward passes.
fn linear_then_activation(
    be: &dyn Backend,
    params: &[Tensor],
    x: Tensor,
    act: Activation,
) -> KResult<(Tensor, Saved, Saved)> {
    let w = &params[0];
    features_of(&x, "linear forward", w.rows())?;
    let (mut pre, mut y) = (Tensor::default(), Tensor::default());
    be.linear_activation(&x, w, params.get(1), act, &mut pre, &mut y)?;
    let shape = with_last(x.shape(), w.cols());
    let (pre, y) = (pre.reshape(&shape)?, y.reshape(&shape)?);
    Ok((y, Saved::tensors(vec![x]), Saved::tensors(vec![pre])))
}

/// Elementwise activation layer.
#[derive(Debug, Clone, Copy)]
pub struct Act(pub Activation);

impl Layer for Act {
    fn kind(&self) -> &'static str {
        match self.0 {
            Activation::Relu => "relu",
            Activation::Gelu => "gelu",
            Activation::Tanh => "tanh",
            Activation::Sigmoid => "sigmoid",
        }
    }

    fn activation(&self) -> Option<Activation> {
        Some(self.0)
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String> {
        Ok(input.to_vec())
    }

    fn forward(
        &self,
        be: &dyn Backend,
        _params: &[Tensor],
        x: Tensor,
        _ctx: ForwardCtx,
    ) -> KResult<(Tensor, Saved)> {
        let mut y = Tensor::default();
        be.activation(self.0, &x, &mut y)?;
        Ok((y, Saved::tensors(vec![x])))
    }

    fn backward_input(
        &self,
        be: &dyn Backend,
        _params: &[Tensor],
        saved: &Saved,
        dy: &Tensor,
    ) -> KResult<Tensor> {
        let mut dx = Tensor::default();
        be.activation_backward(self.0, &saved.tensors[0], dy, &mut dx)?;
        Ok(dx)
    }
}

/// Layer normalisation over the last dimension.
#[derive(Debug, Clone, Copy)]
pub struct LayerNorm {
    features: usize,
    eps: f32,
}

impl Layer for LayerNorm {
    fn kind(&self) -> &'static str {
        "layer_norm"
    }

    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        vec![
            ("weight".into(), vec![self.features]),
            ("bias".into(), vec![self.features]),
        ]
    }

    fn init_params(&self, _rng: &mut Rng) -> Vec<Tensor> {
        vec![
            Tensor::full(&[self.features], 1.0),
            Tensor::zeros(&[self.features]),
        ]
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String> {
        let what = ("layer_norm", "features");
        map_features(input, self.features, self.features, what)
    }

    fn flops_per_sample(&self, input: &[usize]) -> u64 {
        8 * input.iter().product::<usize>() as u64
    }

    fn forward(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        x: Tensor,
        _ctx: ForwardCtx,
    ) -> KResult<(Tensor, Saved)> {
        let (mut y, mut mean, mut rstd) = (Tensor::default(), Tensor::default(), Tensor::default());
        be.layer_norm(
            &x, &params[0], &params[1], self.eps, &mut y, &mut mean, &mut rstd,
        )?;
        Ok((y, Saved::tensors(vec![x, mean, rstd])))
    }

    fn backward_input(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        saved: &Saved,
        dy: &Tensor,
    ) -> KResult<Tensor> {
        let mut dx = Tensor::default();
        let t = &saved.tensors;
        be.layer_norm_backward_input(&t[0], &params[0], &t[1], &t[2], dy, &mut dx)?;
        Ok(dx)
    }

    fn backward_params(
        &self,
        be: &dyn Backend,
        _params: &[Tensor],
        saved: &Saved,
        dy: &Tensor,
        grads: &mut [Tensor],
        accumulate: bool,
    ) -> KResult<()> {
        let t = &saved.tensors;
        let (g, b) = grads.split_at_mut(1);
        be.layer_norm_backward_params(&t[0], &t[1], &t[2], dy, &mut g[0], &mut b[0], accumulate)
    }
}

/// Inverted dropout with masks drawn from the per-call seed.
#[derive(Debug, Clone, Copy)]
pub struct Dropout {
    p: f32,
}

impl Layer for Dropout {
    fn kind(&self) -> &'static str {
        "dropout"
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String> {
        Ok(input.to_vec())
    }

    fn forward(
        &self,
        be: &dyn Backend,
        _params: &[Tensor],
        x: Tensor,
        ctx: ForwardCtx,
    ) -> KResult<(Tensor, Saved)> {
        if !ctx.train || self.p == 0.0 {
            let ones = be.place(Tensor::full(x.shape(), 1.0))?;
            return Ok((x, Saved::tensors(vec![ones])));
        }
        let mut rng = rng_for(derive_seed(ctx.seed, "dropout", 0), "mask", 0);
        let keep = 1.0 / (1.0 - self.p);
        let mask: Vec<f32> = (0..x.len())
            .map(|_| {
                if rng.random::<f32>() < self.p {
                    0.0
                } else {
                    keep
                }
            })
            .collect();
        // The mask is drawn on the host from the seeded stream (so every backend drops the
        // same units), then moved to the backend.
        let mask = be.place(Tensor::from_vec(x.shape(), mask)?)?;
        let mut y = Tensor::default();
        be.mul(&x, &mask, &mut y)?;
        Ok((y, Saved::tensors(vec![mask])))
    }

    fn backward_input(
        &self,
        be: &dyn Backend,
        _params: &[Tensor],
        saved: &Saved,
        dy: &Tensor,
    ) -> KResult<Tensor> {
        let mask = &saved.tensors[0];
        if mask.len() != dy.len() {
            return Err(pipe_kernels::KernelError::Shape {
                op: "dropout backward",
                detail: format!("mask {:?}, gradient {:?}", mask.shape(), dy.shape()),
            });
        }
        let mut dx = Tensor::default();
        be.mul(dy, mask, &mut dx)?;
        Ok(dx)
    }
}

/// Flattens per-sample dimensions: `[batch, d1, d2, ...] -> [batch, d1 * d2 * ...]`.
#[derive(Debug, Clone, Copy)]
pub struct Flatten;

impl Layer for Flatten {
    fn kind(&self) -> &'static str {
        "flatten"
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String> {
        Ok(vec![input.iter().product()])
    }

    fn flops_per_sample(&self, _input: &[usize]) -> u64 {
        0
    }

    fn forward(
        &self,
        _be: &dyn Backend,
        _params: &[Tensor],
        x: Tensor,
        _ctx: ForwardCtx,
    ) -> KResult<(Tensor, Saved)> {
        let batch = x.shape().first().copied().unwrap_or(1);
        let per = x.len().checked_div(batch).unwrap_or(0);
        let shape = x.shape().to_vec();
        Ok((
            x.reshape(&[batch, per])?,
            Saved {
                shape,
                ..Saved::default()
            },
        ))
    }

    fn backward_input(
        &self,
        _be: &dyn Backend,
        _params: &[Tensor],
        saved: &Saved,
        dy: &Tensor,
    ) -> KResult<Tensor> {
        dy.clone().reshape(&saved.shape)
    }
}

/// A residual block, `y = x + f(x)` with `f` the inner layers in order (see
/// [`LayerSpec::Residual`]).
///
/// Parameters are the inner layers' lists, concatenated. The weight-gradient half needs the
/// gradient reaching each inner layer's output, which the input-gradient half computes; since
/// the two halves may run at different times (zero-bubble schedules) and [`Saved`] is read-only
/// in the backward, [`Layer::backward_params`] recomputes the inner input gradients it needs.
#[derive(Debug)]
pub struct Residual {
    inner: Vec<Box<dyn Layer>>,
    /// Adds the input to the output (a residual block); without, a plain sequence.
    skip: bool,
    /// Parameter count of each inner layer (to cut the block's parameter list).
    counts: Vec<usize>,
}

impl Residual {
    fn build(specs: &[LayerSpec], skip: bool) -> Result<Self, String> {
        if specs.is_empty() {
            return Err("a block needs at least one inner layer".into());
        }
        let mut inner = Vec::with_capacity(specs.len());
        for (j, spec) in specs.iter().enumerate() {
            let followed = specs.get(j + 1).is_some_and(LayerSpec::is_activation);
            inner.push(
                spec.build(followed)
                    .map_err(|e| format!("inner layer {j}: {e}"))?,
            );
        }
        let counts = inner.iter().map(|l| l.param_shapes().len()).collect();
        Ok(Self {
            inner,
            skip,
            counts,
        })
    }

    /// The block's parameter list cut per inner layer.
    fn split<'p, T>(&self, mut params: &'p [T]) -> Vec<&'p [T]> {
        self.counts
            .iter()
            .map(|&n| {
                let (head, rest) = params.split_at(n.min(params.len()));
                params = rest;
                head
            })
            .collect()
    }

    fn inner_ctx(ctx: ForwardCtx, j: usize) -> ForwardCtx {
        ForwardCtx {
            seed: derive_seed(ctx.seed, "inner", j as u64),
            ..ctx
        }
    }

    /// The activation of inner layer `j + 1` where inner layer `j` is a linear layer: the two
    /// then run as one backend call ([`linear_then_activation`]).
    fn fused_activation(&self, j: usize) -> Option<Activation> {
        if self.inner[j].kind() != "linear" {
            return None;
        }
        self.inner.get(j + 1)?.activation()
    }

    /// The activation of inner layer `j - 1` where inner layer `j` is a linear layer: the
    /// gradient then crosses both in one backend call ([`Residual::grad_into_activation`]).
    /// The activation has no parameters, so only its input gradient is skipped.
    fn activation_before(&self, j: usize) -> Option<Activation> {
        if j == 0 || self.inner[j].kind() != "linear" {
            return None;
        }
        self.inner[j - 1].activation()
    }

    /// The gradient at the input of activation `j - 1` from `dy` at the output of linear
    /// layer `j` (`params`: its weight first), as [`Backend::linear_grad_activation`] gives
    /// it: the same calls and bits as the two layers' input gradients on a backend that does
    /// not fuse them.
    fn grad_into_activation(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        saved: &Saved,
        j: usize,
        (dy, act): (&Tensor, Activation),
    ) -> KResult<Tensor> {
        let w = &params[0];
        features_of(dy, "linear backward_input", w.cols())?;
        let before = &self.inner[j - 1];
        let kept = materialize(before.as_ref(), be, &[], Self::saved_of(saved, j - 1)?)?;
        let pre = kept
            .tensors
            .first()
            .ok_or_else(|| pipe_kernels::KernelError::Shape {
                op: "residual backward",
                detail: format!("nothing saved for inner layer {}", j - 1),
            })?;
        let mut dz = Tensor::default();
        be.linear_grad_activation(dy, w, act, pre, &mut dz)?;
        Ok(dz)
    }

    fn saved_of(saved: &Saved, j: usize) -> KResult<&Saved> {
        saved
            .inner
            .get(j)
            .ok_or_else(|| pipe_kernels::KernelError::Shape {
                op: "residual backward",
                detail: format!("nothing saved for inner layer {j}"),
            })
    }
}

impl Layer for Residual {
    fn kind(&self) -> &'static str {
        if self.skip { "residual" } else { "sequence" }
    }

    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.inner
            .iter()
            .enumerate()
            .flat_map(|(j, l)| {
                l.param_shapes()
                    .into_iter()
                    .map(move |(n, s)| (format!("{j}.{n}"), s))
            })
            .collect()
    }

    fn init_params(&self, rng: &mut Rng) -> Vec<Tensor> {
        self.inner.iter().flat_map(|l| l.init_params(rng)).collect()
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String> {
        let mut shape = input.to_vec();
        for (j, l) in self.inner.iter().enumerate() {
            shape = l
                .output_shape(&shape)
                .map_err(|e| format!("inner layer {j} ({}): {e}", l.kind()))?;
        }
        if self.skip && shape != input {
            return Err(format!(
                "residual block maps {input:?} to {shape:?}; the two must match"
            ));
        }
        Ok(shape)
    }

    fn flops_per_sample(&self, input: &[usize]) -> u64 {
        let mut shape = input.to_vec();
        // The residual add.
        let mut flops = if self.skip {
            input.iter().product::<usize>() as u64
        } else {
            0
        };
        for l in &self.inner {
            flops += l.flops_per_sample(&shape);
            shape = l.output_shape(&shape).unwrap_or(shape);
        }
        flops
    }

    fn forward(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        x: Tensor,
        ctx: ForwardCtx,
    ) -> KResult<(Tensor, Saved)> {
        let skip = x.clone();
        let mut h = x;
        let mut inner = Vec::with_capacity(self.inner.len());
        let parts = self.split(params);
        let mut j = 0;
        while j < self.inner.len() {
            let (l, p) = (&self.inner[j], parts[j]);
            if let Some(act) = self.fused_activation(j) {
                let (y, linear, activation) = linear_then_activation(be, p, h, act)?;
                inner.extend([linear, activation]);
                h = y;
                j += 2;
                continue;
            }
            let ictx = Self::inner_ctx(ctx.clone(), j);
            // Selective recomputation keeps an attention layer's input only.
            let stand_in = (ctx.train && ctx.recompute_attention && l.kind() == "attention")
                .then(|| h.clone());
            let (y, s) = l.forward(be, p, h, ictx.clone())?;
            inner.push(match stand_in {
                Some(input) => Saved::recompute(input, ictx),
                None => s,
            });
            h = y;
            j += 1;
        }
        if self.skip {
            be.axpy(1.0, &skip, &mut h)?;
        }
        Ok((
            h,
            Saved {
                inner,
                ..Saved::default()
            },
        ))
    }

    fn backward_input(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        saved: &Saved,
        dy: &Tensor,
    ) -> KResult<Tensor> {
        let parts = self.split(params);
        // The gradient reaching the current inner layer's output: `dy` itself for the last.
        let mut g: Option<Tensor> = None;
        let mut j = self.inner.len();
        while j > 0 {
            j -= 1;
            let at = g.as_ref().unwrap_or(dy);
            if let Some(act) = self.activation_before(j) {
                g = Some(self.grad_into_activation(be, parts[j], saved, j, (at, act))?);
                j -= 1;
                continue;
            }
            let l = self.inner[j].as_ref();
            let s = materialize(l, be, parts[j], Self::saved_of(saved, j)?)?;
            g = Some(l.backward_input(be, parts[j], &s, at)?);
        }
        let mut g = g.unwrap_or_else(|| dy.clone());
        if self.skip {
            be.axpy(1.0, dy, &mut g)?;
        }
        Ok(g)
    }

    fn backward_params(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        saved: &Saved,
        dy: &Tensor,
        grads: &mut [Tensor],
        accumulate: bool,
    ) -> KResult<()> {
        self.backward(be, params, saved, dy, grads, accumulate, false)
            .map(|_| ())
    }

    /// One pass over the inner layers, last first, each doing both halves of its backward
    /// with the work they share done once. The weight half alone
    /// ([`Layer::backward_params`]) is this pass without the block's own input gradient.
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
        let parts = self.split(params);
        let mut grad_parts: Vec<&mut [Tensor]> = Vec::with_capacity(self.counts.len());
        let mut rest = grads;
        for &n in &self.counts {
            let (head, tail) = rest.split_at_mut(n.min(rest.len()));
            grad_parts.push(head);
            rest = tail;
        }
        // The gradient reaching the current inner layer's output: `dy` itself for the last.
        let mut g: Option<Tensor> = None;
        let mut j = self.inner.len();
        while j > 0 {
            j -= 1;
            let s = materialize(
                self.inner[j].as_ref(),
                be,
                parts[j],
                Self::saved_of(saved, j)?,
            )?;
            // An activation first in the block has no input gradient to give unless asked.
            let fused = self
                .activation_before(j)
                .filter(|_| j > 1 || need_input_grad);
            if let Some(act) = fused {
                let at = g.as_ref().unwrap_or(dy);
                let l = self.inner[j].as_ref();
                l.backward_params(be, parts[j], &s, at, &mut *grad_parts[j], accumulate)?;
                g = Some(self.grad_into_activation(be, parts[j], saved, j, (at, act))?);
                j -= 1;
                continue;
            }
            let need = j > 0 || need_input_grad;
            let next = self.inner[j].backward(
                be,
                parts[j],
                &s,
                g.as_ref().unwrap_or(dy),
                &mut *grad_parts[j],
                accumulate,
                need,
            )?;
            match next {
                Some(next) => g = Some(next),
                None => return Ok(None),
            }
        }
        let mut g = g.unwrap_or_else(|| dy.clone());
        if self.skip {
            be.axpy(1.0, dy, &mut g)?;
        }
        Ok(Some(g))
    }
}
