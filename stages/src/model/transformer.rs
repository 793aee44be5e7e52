//! The layers of a GPT-style decoder and its presets: token and learned position embeddings,
//! causal multi-head self-attention, the language-model head, and the `gpt-*` models built
//! from them with the existing layer norm, GELU, linear and residual layers.
//!
//! A transformer block is one pipeline layer ([`crate::layers::LayerSpec::TransformerBlock`]):
//! pre-LayerNorm attention and a GELU MLP, each inside its own residual, run as one sequence,
//! so stages cut between blocks. The embedding and the head are layers of their own, so the
//! profiler costs them and the partitioner can give them a stage's share like any block.
//!
//! Token ids travel as whole numbers in `f32` tensors: they are the first stage's input
//! activation, and every transport and checkpoint already moves `f32`. The embedding checks
//! every id (a fractional, negative or out-of-vocabulary value is an error naming it).

use pipe_kernels::{AttentionShape, Backend, Result as KResult, Tensor, Trans};

use crate::layer::{
    ForwardCtx, INIT_STD, Layer, Saved, features_of, map_features, matmul_flops, matmul_input_grad,
    normal, with_last,
};
use crate::rng::Rng;

fn shape_err(op: &'static str, detail: String) -> pipe_kernels::KernelError {
    pipe_kernels::KernelError::Shape { op, detail }
}

/// `(batch, tokens)` of a batch whose per-sample shape is `[tokens, ...]`.
fn batch_and_tokens(x: &Tensor, op: &'static str) -> KResult<(usize, usize)> {
    match x.shape() {
        [b, t, ..] => Ok((*b, *t)),
        other => Err(shape_err(
            op,
            format!("expected [batch, tokens, ...], got {other:?}"),
        )),
    }
}

/// The ids `0..n` as an `f32` tensor placed on `be` (the positions of a sequence).
fn positions(be: &dyn Backend, n: usize) -> KResult<Tensor> {
    be.place(Tensor::from_vec(&[n], (0..n).map(|i| i as f32).collect())?)
}

/// Token embedding plus learned position embedding: `[tokens]` ids to `[tokens, width]`.
/// Parameters `token` (`[rows, width]`) and `position` (`[context, width]`); a batch may be
/// shorter than `context` (sampling from a short prompt). With packed documents
/// ([`ForwardCtx::documents`]) a token's position is its place in its own document.
#[derive(Debug, Clone, Copy)]
pub struct Embedding {
    /// Vocabulary size.
    pub vocab: usize,
    /// Rows of the token table: the vocabulary, or more when it is padded
    /// ([`crate::layers::LayerSpec::LmHead`]); the rows past `vocab` start at zero.
    pub rows: usize,
    /// Model width.
    pub width: usize,
    /// Longest sequence.
    pub context: usize,
}

/// A `[rows, width]` vocabulary table: `vocab` rows drawn as an unpadded table's are (the same
/// draws, so padding changes no other parameter), then zeros.
fn vocabulary_table(rng: &mut Rng, vocab: usize, rows: usize, width: usize) -> Tensor {
    let drawn = normal(rng, &[vocab, width], INIT_STD);
    if rows == vocab {
        return drawn;
    }
    let mut values = drawn.into_host_vec().unwrap_or_default();
    values.resize(rows * width, 0.0);
    Tensor::from_vec(&[rows, width], values).unwrap_or_default()
}

/// Where the embedding's saved tensors keep the per-token positions of packed documents
/// (after the ids).
const SAVED_POSITIONS: usize = 1;

impl Layer for Embedding {
    fn kind(&self) -> &'static str {
        "embedding"
    }

    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        vec![
            ("token".into(), vec![self.rows, self.width]),
            ("position".into(), vec![self.context, self.width]),
        ]
    }

    fn init_params(&self, rng: &mut Rng) -> Vec<Tensor> {
        vec![
            vocabulary_table(rng, self.vocab, self.rows, self.width),
            normal(rng, &[self.context, self.width], INIT_STD),
        ]
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String> {
        match input {
            [t] if (1..=self.context).contains(t) => Ok(vec![*t, self.width]),
            _ => Err(format!(
                "embedding takes [tokens] with 1..={} tokens, gets {input:?}",
                self.context
            )),
        }
    }

    fn flops_per_sample(&self, input: &[usize]) -> u64 {
        // A gather and an add per element.
        (input.iter().product::<usize>() * self.width) as u64
    }

    fn forward(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        x: Tensor,
        ctx: ForwardCtx,
    ) -> KResult<(Tensor, Saved)> {
        let (b, t) = batch_and_tokens(&x, "embedding forward")?;
        if t > self.context || x.len() != b * t {
            return Err(shape_err(
                "embedding forward",
                format!("ids {:?}, context {}", x.shape(), self.context),
            ));
        }
        let (mut y, mut pos) = (Tensor::default(), Tensor::default());
        be.embedding(&x, &params[0], &mut y)?;
        if let Some(docs) = &ctx.documents {
            // Packed documents: each token's position in its own document, row by row.
            be.embedding(&docs.positions, &params[1], &mut pos)?;
            be.axpy(1.0, &pos, &mut y)?;
            let saved = Saved::tensors(vec![x.clone(), docs.positions.clone()]);
            return Ok((y.reshape(&[b, t, self.width])?, saved));
        }
        be.embedding(&positions(be, t)?, &params[1], &mut pos)?;
        let pos = pos.reshape(&[t * self.width])?;
        let mut y = y.reshape(&[b, t * self.width])?;
        be.add_bias(&mut y, &pos)?;
        Ok((y.reshape(&[b, t, self.width])?, Saved::tensors(vec![x])))
    }

    /// Token ids have no gradient: zeros shaped like them (the model's first layer never asks).
    fn backward_input(
        &self,
        be: &dyn Backend,
        _params: &[Tensor],
        saved: &Saved,
        _dy: &Tensor,
    ) -> KResult<Tensor> {
        be.place(Tensor::zeros(saved.tensors[0].shape()))
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
        let ids = &saved.tensors[0];
        let (b, t) = batch_and_tokens(ids, "embedding backward")?;
        let (dtok, dpos) = grads.split_at_mut(1);
        be.embedding_backward(ids, dy, &mut dtok[0], accumulate)?;
        if let Some(positions) = saved.tensors.get(SAVED_POSITIONS) {
            return be.embedding_backward(positions, dy, &mut dpos[0], accumulate);
        }
        let flat = dy.clone().reshape(&[b, t * self.width])?;
        let mut per_position = Tensor::default();
        be.sum_rows(&flat, &mut per_position, false)?;
        let per_position = per_position.reshape(&[t, self.width])?;
        be.embedding_backward(&positions(be, t)?, &per_position, &mut dpos[0], accumulate)
    }
}

/// Causal multi-head self-attention with its input and output projections:
/// `y = attention(x W_qkv + b_qkv) W_proj + b_proj` over `[tokens, width]`.
#[derive(Debug, Clone, Copy)]
pub struct Attention {
    /// Model width.
    pub width: usize,
    /// Heads (dividing `width`).
    pub heads: usize,
}

/// What the attention forward keeps: its input, the packed query-key-value rows, the
/// attention output before projection and each row's log-sum-exp (no `T x T` tensor), and
/// with packed documents each token's document start.
const SAVED_X: usize = 0;
const SAVED_QKV: usize = 1;
const SAVED_OUT: usize = 2;
const SAVED_LSE: usize = 3;
const SAVED_STARTS: usize = 4;

impl Attention {
    fn shape(&self, x_shape: &[usize]) -> KResult<AttentionShape> {
        match x_shape {
            [b, t, c] if *c == self.width => Ok(AttentionShape {
                batch: *b,
                seq: *t,
                heads: self.heads,
                width: self.width,
            }),
            other => Err(shape_err(
                "attention",
                format!("expected [batch, tokens, {}], got {other:?}", self.width),
            )),
        }
    }

    /// The gradient at the attention output (before projection) and at the packed
    /// query-key-value rows.
    fn inner_grads(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        saved: &Saved,
        dy: &Tensor,
    ) -> KResult<(Tensor, Tensor)> {
        let s = &saved.tensors;
        let shape = self.shape(s[SAVED_X].shape())?;
        let mut dout = Tensor::default();
        be.matmul(dy, Trans::No, &params[2], Trans::Yes, &mut dout, false)?;
        let mut dqkv = Tensor::default();
        be.attention_backward(
            &s[SAVED_QKV],
            s.get(SAVED_STARTS),
            &s[SAVED_OUT],
            &s[SAVED_LSE],
            &dout,
            shape,
            &mut dqkv,
        )?;
        Ok((dout, dqkv))
    }

    fn param_grads(
        &self,
        be: &dyn Backend,
        saved: &Saved,
        dy: &Tensor,
        dqkv: &Tensor,
        grads: &mut [Tensor],
        accumulate: bool,
    ) -> KResult<()> {
        let s = &saved.tensors;
        let [gw, gb, pw, pb] = grads else {
            return Err(shape_err(
                "attention backward",
                format!("{} gradient tensors for 4 parameters", grads.len()),
            ));
        };
        be.linear_weight_grads(&s[SAVED_X], dqkv, gw, Some(gb), accumulate)?;
        be.linear_weight_grads(&s[SAVED_OUT], dy, pw, Some(pb), accumulate)
    }

    fn input_grad(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        saved: &Saved,
        dqkv: &Tensor,
    ) -> KResult<Tensor> {
        matmul_input_grad(be, dqkv, &params[0], Trans::Yes, &saved.tensors[SAVED_X])
    }
}

impl Layer for Attention {
    fn kind(&self) -> &'static str {
        "attention"
    }

    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let c = self.width;
        vec![
            ("qkv.weight".into(), vec![c, 3 * c]),
            ("qkv.bias".into(), vec![3 * c]),
            ("proj.weight".into(), vec![c, c]),
            ("proj.bias".into(), vec![c]),
        ]
    }

    fn init_params(&self, rng: &mut Rng) -> Vec<Tensor> {
        let c = self.width;
        vec![
            normal(rng, &[c, 3 * c], INIT_STD),
            Tensor::zeros(&[3 * c]),
            // The residual branch starts closed (see `Init::Zeros`).
            Tensor::zeros(&[c, c]),
            Tensor::zeros(&[c]),
        ]
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String> {
        match input {
            [_, c] if *c == self.width => Ok(input.to_vec()),
            _ => Err(format!(
                "attention expects [tokens, {}], gets {input:?}",
                self.width
            )),
        }
    }

    fn flops_per_sample(&self, input: &[usize]) -> u64 {
        let (t, c) = (input.first().copied().unwrap_or(1), self.width);
        // Projections in and out, then Q K^T and P V over the full T x T tile per head, as
        // Megatron-LM's and PaLM's model-FLOP counts take them (the CPU kernel forms only the
        // causal blocks, about 10/16 of the tile at T = 128).
        (2 * t * c * 3 * c + 2 * t * c * c + 4 * t * t * c) as u64
    }

    fn forward(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        x: Tensor,
        ctx: ForwardCtx,
    ) -> KResult<(Tensor, Saved)> {
        let shape = self.shape(x.shape())?;
        let mut qkv = Tensor::default();
        be.linear(&x, &params[0], Some(&params[1]), &mut qkv)?;
        let (mut out, mut lse) = (Tensor::default(), Tensor::default());
        let starts = ctx.documents.as_ref().map(|d| &d.starts);
        be.attention(&qkv, starts, shape, &mut out, &mut lse)?;
        let mut y = Tensor::default();
        be.linear(&out, &params[2], Some(&params[3]), &mut y)?;
        let y = y.reshape(x.shape())?;
        let mut saved = vec![x, qkv, out, lse];
        saved.extend(starts.cloned());
        Ok((y, Saved::tensors(saved)))
    }

    fn backward_input(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        saved: &Saved,
        dy: &Tensor,
    ) -> KResult<Tensor> {
        let (_, dqkv) = self.inner_grads(be, params, saved, dy)?;
        self.input_grad(be, params, saved, &dqkv)
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
        let (_, dqkv) = self.inner_grads(be, params, saved, dy)?;
        self.param_grads(be, saved, dy, &dqkv, grads, accumulate)
    }

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
        let (_, dqkv) = self.inner_grads(be, params, saved, dy)?;
        self.param_grads(be, saved, dy, &dqkv, grads, accumulate)?;
        if need_input_grad {
            return self.input_grad(be, params, saved, &dqkv).map(Some);
        }
        Ok(None)
    }
}

/// The language-model head: logits `x W^T` over the vocabulary, with `W` stored
/// `[rows, width]` like the token embedding so the two can be tied. With a padded vocabulary
/// (`rows > vocab`) the logits have `rows` columns, of which the loss reads the first `vocab`.
#[derive(Debug, Clone, Copy)]
pub struct LmHead {
    /// Model width.
    pub width: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Rows of the weight and columns of the logits (`vocab`, or more when padded).
    pub rows: usize,
}

impl Layer for LmHead {
    fn kind(&self) -> &'static str {
        "lm_head"
    }

    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        vec![("weight".into(), vec![self.rows, self.width])]
    }

    fn init_params(&self, rng: &mut Rng) -> Vec<Tensor> {
        vec![vocabulary_table(rng, self.vocab, self.rows, self.width)]
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String> {
        map_features(input, self.width, self.rows, ("lm_head", "features"))
    }

    fn flops_per_sample(&self, input: &[usize]) -> u64 {
        matmul_flops(input, self.width, self.rows)
    }

    fn forward(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        x: Tensor,
        _ctx: ForwardCtx,
    ) -> KResult<(Tensor, Saved)> {
        features_of(&x, "lm_head forward", self.width)?;
        let mut y = Tensor::default();
        be.matmul(&x, Trans::No, &params[0], Trans::Yes, &mut y, false)?;
        let y = y.reshape(&with_last(x.shape(), self.rows))?;
        Ok((y, Saved::tensors(vec![x])))
    }

    fn backward_input(
        &self,
        be: &dyn Backend,
        params: &[Tensor],
        saved: &Saved,
        dy: &Tensor,
    ) -> KResult<Tensor> {
        matmul_input_grad(be, dy, &params[0], Trans::No, &saved.tensors[0])
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
        be.matmul(
            dy,
            Trans::Yes,
            &saved.tensors[0],
            Trans::No,
            &mut grads[0],
            accumulate,
        )
    }
}

/// The shape of a GPT-style preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptShape {
    /// Transformer blocks.
    pub blocks: usize,
    /// Model width.
    pub width: usize,
    /// Attention heads.
    pub heads: usize,
    /// Context length (tokens per sample).
    pub context: usize,
}

/// The named GPT presets:
/// - `gpt-mini`: trains to a useful character model on two cores in half an hour; eight
///   blocks, so four stages hold two each.
/// - `gpt-small`: for benchmarks, about four times the compute per token.
/// - `gpt2-small`: GPT-2's 124 M shape (12 blocks of width 768, 12 heads, 1,024 positions;
///   124 M parameters with GPT-2's 50,257-token vocabulary).
/// - `gpt2-tiny`: the same family at test size.
///
/// The `gpt2*` presets and `gpt2` tie the head to the token embedding, as GPT-2 does.
pub const GPT_PRESETS: [(&str, GptShape); 4] = [
    (
        "gpt-mini",
        GptShape {
            blocks: 8,
            width: 128,
            heads: 4,
            context: 128,
        },
    ),
    (
        "gpt-small",
        GptShape {
            blocks: 8,
            width: 256,
            heads: 8,
            context: 128,
        },
    ),
    (
        "gpt2-small",
        GptShape {
            blocks: 12,
            width: 768,
            heads: 12,
            context: 1024,
        },
    ),
    (
        "gpt2-tiny",
        GptShape {
            blocks: 2,
            width: 64,
            heads: 2,
            context: 64,
        },
    ),
];

/// Whether preset `name` is of the GPT-2 family (`gpt2`, `gpt2-*`): its head is tied to its
/// token embedding unless told otherwise.
pub fn is_gpt2(name: &str) -> bool {
    name == "gpt2" || name.starts_with("gpt2-")
}

/// A GPT-2 shape as Hugging Face's `config.json`, a TOML `[gpt2]` table or the `--n-*` flags
/// give it: every field optional, so a later source overrides an earlier one field by field.
#[derive(
    Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::Args,
)]
#[serde(deny_unknown_fields)]
pub struct Gpt2Shape {
    /// Transformer blocks of a gpt2 model (over its preset's or config.json's).
    #[arg(long, value_name = "N")]
    pub n_layer: Option<usize>,
    /// Attention heads of a gpt2 model.
    #[arg(long, value_name = "N")]
    pub n_head: Option<usize>,
    /// Width of a gpt2 model.
    #[arg(long, value_name = "N")]
    pub n_embd: Option<usize>,
    /// Positions of a gpt2 model: its training window.
    #[arg(long, value_name = "N")]
    pub n_positions: Option<usize>,
    /// Vocabulary of a gpt2 model (default: the data's).
    #[arg(long, value_name = "N")]
    pub vocab_size: Option<usize>,
    /// Rows of a gpt2 model's token table and head, at least its vocabulary (default: the
    /// vocabulary): 50304 pads GPT-2's 50,257 to a multiple of 128, so a GPU's products over
    /// the vocabulary have aligned rows. The extra rows stay zero and take no token and no
    /// gradient: the model computes what the unpadded one does.
    #[arg(long, value_name = "N")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub padded_vocab_size: Option<usize>,
}

impl Gpt2Shape {
    /// `self` with every field `other` sets taken from it.
    #[must_use]
    pub fn merged(self, other: &Gpt2Shape) -> Self {
        Self {
            n_layer: other.n_layer.or(self.n_layer),
            n_head: other.n_head.or(self.n_head),
            n_embd: other.n_embd.or(self.n_embd),
            n_positions: other.n_positions.or(self.n_positions),
            vocab_size: other.vocab_size.or(self.vocab_size),
            padded_vocab_size: other.padded_vocab_size.or(self.padded_vocab_size),
        }
    }

    /// The rows of the vocabulary tables `padded_vocab_size` asks for over a vocabulary of
    /// `vocab`: `None` for no padding.
    ///
    /// # Errors
    /// A message naming the setting when it is smaller than the vocabulary.
    pub fn padded_rows(&self, vocab: usize) -> Result<Option<usize>, String> {
        match self.padded_vocab_size {
            Some(rows) if rows < vocab => Err(format!(
                "padded_vocab_size {rows} is smaller than the vocabulary of {vocab} tokens; it \
                 must hold it (GPT-2's 50257 pads to 50304)"
            )),
            other => Ok(other),
        }
    }

    /// The shape: `base`'s fields where `self` sets none.
    ///
    /// # Errors
    /// A message naming the missing or zero field, or heads that do not divide the width.
    pub fn resolve(&self, base: Option<GptShape>) -> Result<GptShape, String> {
        let pick = |v: Option<usize>, b: Option<usize>, name: &str| {
            v.or(b).filter(|&n| n > 0).ok_or_else(|| {
                format!("gpt2 needs a positive {name} (a flag, [gpt2] or config.json)")
            })
        };
        let shape = GptShape {
            blocks: pick(self.n_layer, base.map(|b| b.blocks), "n_layer")?,
            width: pick(self.n_embd, base.map(|b| b.width), "n_embd")?,
            heads: pick(self.n_head, base.map(|b| b.heads), "n_head")?,
            context: pick(self.n_positions, base.map(|b| b.context), "n_positions")?,
        };
        // Every size is bounded before anything is built from it: the layer list has one
        // entry a block, and every tensor is a product of these.
        let blocks_limit = crate::limits::MAX_LAYERS - 3;
        if shape.blocks as u64 > blocks_limit {
            return Err(format!(
                "n_layer {} is past the limit of {blocks_limit} blocks (no model this system \
                 builds comes close)",
                shape.blocks
            ));
        }
        let tensor_limit = crate::limits::MAX_TENSOR_ELEMENTS;
        for (name, v) in [
            ("n_embd", Some(shape.width)),
            ("n_head", Some(shape.heads)),
            ("n_positions", Some(shape.context)),
            ("vocab_size", self.vocab_size),
            ("padded_vocab_size", self.padded_vocab_size),
        ] {
            if let Some(v) = v.filter(|&v| v as u64 > tensor_limit) {
                return Err(format!(
                    "{name} {v} is past the limit of {tensor_limit} (elements of one tensor)"
                ));
            }
        }
        if shape.width % shape.heads != 0 {
            return Err(format!(
                "n_embd {} is not a multiple of n_head {}",
                shape.width, shape.heads
            ));
        }
        Ok(shape)
    }
}

/// The part of a Hugging Face GPT-2 `config.json` pipe reads, with what it must say for the
/// model to be the one pipe builds.
#[derive(serde::Deserialize)]
struct HfGpt2Config {
    model_type: Option<String>,
    n_layer: usize,
    n_head: usize,
    n_embd: usize,
    n_positions: usize,
    vocab_size: usize,
    n_inner: Option<usize>,
    activation_function: Option<String>,
    layer_norm_epsilon: Option<f64>,
    tie_word_embeddings: Option<bool>,
    /// Attention scores divided by the square root of the head width (true when absent).
    scale_attn_weights: Option<bool>,
    /// Layer `i`'s scores further divided by `i + 1` (false when absent).
    scale_attn_by_inverse_layer_idx: Option<bool>,
}

/// The GPT-2 shape of a Hugging Face `config.json`'s text (`name` for messages), for a run
/// whose head is tied as GPT-2's is.
///
/// # Errors
/// As [`hf_gpt2_config`], and an untied head.
pub fn gpt2_from_hf_config(text: &str, name: &str) -> Result<Gpt2Shape, String> {
    let (shape, tied) = hf_gpt2_config(text, name)?;
    if !tied {
        return Err(format!(
            "{name}: an untied head (tie_word_embeddings false), which pipe's GPT-2 presets \
             are not"
        ));
    }
    Ok(shape)
}

/// The GPT-2 shape of a Hugging Face `config.json`'s text (`name` for messages), and whether
/// its head is tied to the token embedding (`tie_word_embeddings`, true when absent).
///
/// # Errors
/// A message naming what pipe's GPT-2 block cannot be: another model type, an MLP width
/// other than 4 × `n_embd`, an activation other than tanh-approximated GELU, a layer-norm
/// epsilon other than 1e-5, or attention scores scaled otherwise than by the square root of the
/// head width (`scale_attn_weights` false, `scale_attn_by_inverse_layer_idx` true): each
/// computes another function from the same weights.
pub fn hf_gpt2_config(text: &str, name: &str) -> Result<(Gpt2Shape, bool), String> {
    let c: HfGpt2Config =
        serde_json::from_str(text).map_err(|e| format!("{name}: not a GPT-2 config.json: {e}"))?;
    let refuse = |what: String| Err(format!("{name}: {what}, which pipe's GPT-2 block is not"));
    if let Some(t) = c.model_type.as_deref().filter(|t| *t != "gpt2") {
        return refuse(format!("model_type {t:?}"));
    }
    if let Some(n) = c.n_inner.filter(|&n| Some(n) != c.n_embd.checked_mul(4)) {
        return refuse(format!(
            "n_inner {n} (4 x n_embd is {})",
            c.n_embd.saturating_mul(4)
        ));
    }
    if let Some(a) = c
        .activation_function
        .as_deref()
        .filter(|a| !matches!(*a, "gelu_new" | "gelu_pytorch_tanh"))
    {
        return refuse(format!("activation_function {a:?} (tanh GELU is gelu_new)"));
    }
    if let Some(e) = c.layer_norm_epsilon.filter(|&e| (e - 1e-5).abs() > 1e-12) {
        return refuse(format!("layer_norm_epsilon {e}"));
    }
    if c.scale_attn_weights == Some(false) {
        return refuse(
            "scale_attn_weights false (scores not divided by the square root of the head width)"
                .into(),
        );
    }
    if c.scale_attn_by_inverse_layer_idx == Some(true) {
        return refuse(
            "scale_attn_by_inverse_layer_idx true (each layer's scores divided by its index + 1)"
                .into(),
        );
    }
    let shape = Gpt2Shape {
        n_layer: Some(c.n_layer),
        n_head: Some(c.n_head),
        n_embd: Some(c.n_embd),
        n_positions: Some(c.n_positions),
        vocab_size: Some(c.vocab_size),
        padded_vocab_size: None,
    };
    Ok((shape, c.tie_word_embeddings.unwrap_or(true)))
}

/// The shape of GPT preset `name`, if it is one.
pub fn gpt_shape(name: &str) -> Option<GptShape> {
    GPT_PRESETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, s)| *s)
}
