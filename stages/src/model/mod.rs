//! The model layer (this folder): layers and their parameter shapes ([`layer`], [`layers`]),
//! the GPT-style blocks ([`transformer`]), losses, optimizers, data, checkpoints, sampling and
//! seeded randomness. Nothing here knows about stages, workers or transports; the runtime
//! ([`crate::pipeline`]) and planning ([`crate::planning`]) build on it.
//!
//! Models: an ordered list of layers, and a **parameter table** that names every parameter
//! (`layers.3.weight`) and says which layers use it.
//!
//! Parameters are kept apart from layers (see [`crate::layers`]): every call gets the tensors
//! its layer uses, as [`Params`], one list per layer. A parameter may be **tied**: used by
//! several layers, on one stage or on different stages (a language model's token embedding and
//! its output head). Every use holds its own copy of a tied parameter; the gradients of all
//! uses are summed before the update ([`Model::sum_tied`]) and every copy applies the same
//! summed gradient, so the copies stay bit-identical and each use reads the version its stage's
//! version plan names. Checkpoints and reports key parameters by their table name, which does
//! not depend on the partition.

pub mod data;
pub mod documents;
mod finite_value;
pub mod hf;
pub mod layer;
pub mod layers;
pub mod loss;
pub(crate) mod names;
pub mod optim;
pub mod rng;
pub mod sample;
pub mod shards;
pub mod tensor_file;
pub mod tokenize;
pub mod tokenizer;
pub mod transformer;

use pipe_kernels::{Backend, Tensor, UpdateSeen};
use serde::{Deserialize, Serialize};

use crate::error::{Result, StageError};
use crate::layer::{Keep, Recompute, StageRecompute, materialize};
use crate::layers::{ForwardCtx, Layer, LayerSpec, Saved};
use crate::rng::{derive_seed, rng_for};

/// Parameters of a model (or of a contiguous range of its layers): one list per layer, in the
/// order of [`Layer::param_shapes`].
pub type Params = Vec<Vec<Tensor>>;

/// What a backward pass calls after each layer: the layer's index within the pass's range,
/// and the range's gradients, of which that layer's and every later one's are complete.
pub type GradientsReady<'h> = dyn FnMut(usize, &mut [Vec<Tensor>]) -> Result<()> + 'h;

/// What [`Model::check_finite`] guards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Guarded {
    /// An update's gradients, as its step applied them.
    Gradients,
    /// The weights after an update's step.
    Weights,
}

/// A [`GradientsReady`] for a backward nobody waits on.
///
/// # Errors
/// None.
pub fn no_notice(_layer: usize, _grads: &mut [Vec<Tensor>]) -> Result<()> {
    Ok(())
}

/// `params` made resident where `be` computes (parameters and gradients are built on the host).
///
/// # Errors
/// Kernel errors (device allocation).
pub fn place_params(be: &dyn Backend, params: Params) -> Result<Params> {
    params
        .into_iter()
        .map(|layer| {
            layer
                .into_iter()
                .map(|t| Ok(be.place(t)?))
                .collect::<Result<Vec<Tensor>>>()
        })
        .collect()
}

/// `params` in host memory: host tensors as they are, device tensors copied out through `be`.
///
/// # Errors
/// Device failures.
pub fn host_params(be: &dyn Backend, params: Params) -> Result<Params> {
    params
        .into_iter()
        .map(|layer| layer.into_iter().map(|t| host_tensor(be, t)).collect())
        .collect()
}

/// `t` in host memory (as it is when it already is there).
///
/// # Errors
/// Device failures.
pub fn host_tensor(be: &dyn Backend, t: Tensor) -> Result<Tensor> {
    if t.device() == pipe_kernels::Device::Host {
        return Ok(t);
    }
    let values = be.read(&t)?.into_owned();
    Ok(Tensor::from_vec(t.shape(), values)?)
}

/// Index of a parameter in a model's table.
pub type ParamId = usize;

/// One parameter of the table: its name, shape and the layer parameters that use it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamEntry {
    /// Stable name: the first user's `layers.{index}.{name}`.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Every use, as (layer index, index in that layer's parameter list), in model order.
    pub uses: Vec<(usize, usize)>,
}

/// What an optimizer needs to know of one parameter beyond its shape
/// ([`Model::optimizer_roles`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParamRole {
    /// A hidden weight matrix: Muon orthogonalises its update.
    pub hidden_matrix: bool,
    /// The matrix of a linear map: what [`crate::optim::DecayGroups::Matrices`] decays.
    pub linear_matrix: bool,
}

impl From<bool> for ParamRole {
    /// A hidden weight matrix (`true`) or not; a hidden matrix is a linear map's.
    fn from(hidden_matrix: bool) -> Self {
        ParamRole {
            hidden_matrix,
            linear_matrix: hidden_matrix,
        }
    }
}

/// A sequential model with a parameter table.
#[derive(Debug)]
pub struct Model {
    specs: Vec<LayerSpec>,
    layers: Vec<Box<dyn Layer>>,
    /// Per-sample shape entering each layer, plus the final output shape.
    shapes: Vec<Vec<usize>>,
    /// The parameter table.
    table: Vec<ParamEntry>,
    /// Per layer, the table entry of each of its parameters.
    slots: Vec<Vec<ParamId>>,
    /// Some parameter has more than one use.
    tied: bool,
    /// What the backward recomputes instead of keeping, per stage ([`Model::with_recompute`]).
    recompute: StageRecompute,
    /// The end-of-text id of packed documents ([`Model::with_documents`]).
    document_end: Option<u32>,
    /// The loss of its output ([`Model::loss`]).
    loss: crate::loss::SoftmaxCrossEntropy,
}

/// A model description as written in a config file. Parsing is strict: every layer is read on
/// its own so that an error names its index, and a key a layer does not take is an error at
/// any depth (see [`RawModelSpec`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, try_from = "RawModelSpec")]
pub struct ModelSpec {
    /// Per-sample input shape (for MNIST `[28, 28]` or `[784]`).
    pub input: Vec<usize>,
    /// The layers, in order.
    pub layers: Vec<LayerSpec>,
    /// Tied parameters: each entry makes a layer parameter use another (earlier) one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tied: Vec<Tie>,
}

/// A model description as it arrives, before its layers are read: each layer is read from its
/// own value by [`ModelSpec`]'s `TryFrom`, which names the layer's index, the key and the value
/// in every error. serde alone cannot: an internally tagged enum's unit variants (`relu`)
/// accept any extra keys, and an error inside a list does not say which element it came from.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModelSpec {
    input: Vec<usize>,
    layers: Vec<finite_value::FiniteValue>,
    #[serde(default)]
    tied: Vec<Tie>,
}

impl TryFrom<RawModelSpec> for ModelSpec {
    type Error = String;

    fn try_from(raw: RawModelSpec) -> std::result::Result<Self, String> {
        let layers = raw
            .layers
            .into_iter()
            .enumerate()
            .map(|(i, value)| parse_layer(value.0).map_err(|e| format!("layer {i}: {e}")))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(ModelSpec {
            input: raw.input,
            layers,
            tied: raw.tied,
        })
    }
}

/// Reads one layer strictly: a serde error with the key it is about, or the first key the
/// layer (or a layer inside it) does not take.
fn parse_layer(value: serde_json::Value) -> std::result::Result<LayerSpec, String> {
    let spec: LayerSpec = serde_path_to_error::deserialize(value.clone()).map_err(|e| {
        let path = e.path().to_string();
        let msg = e.into_inner().to_string();
        if path != "." && !path.is_empty() {
            return format!("{path}: {msg}");
        }
        // An internally tagged enum reads its fields from a buffer, where the path is lost:
        // name the key whose value the message quotes.
        match offending_key(&value, &msg) {
            Some((key, v)) => format!("`{key}` = {v}: {msg}"),
            None => msg,
        }
    })?;
    let known = serde_json::to_value(&spec).map_err(|e| e.to_string())?;
    unknown_key(&value, &known, "")?;
    Ok(spec)
}

/// The key of a layer's table that serde's message `msg` is about: the unknown field it names,
/// or the one field whose value it quotes.
fn offending_key<'v>(
    layer: &'v serde_json::Value,
    msg: &str,
) -> Option<(&'v str, &'v serde_json::Value)> {
    let fields = layer.as_object()?;
    if let Some(rest) = msg.strip_prefix("unknown field `") {
        let name = rest.split('`').next()?;
        return fields.get_key_value(name).map(|(k, v)| (k.as_str(), v));
    }
    let quoted = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => {
            msg.contains(&format!("\"{s}\"")) || msg.contains(&format!("`{s}`"))
        }
        other => msg.contains(&format!("`{other}`")),
    };
    let mut hits = fields.iter().filter(|(k, v)| *k != "type" && quoted(v));
    let first = hits.next()?;
    hits.next().is_none().then_some((first.0.as_str(), first.1))
}

/// The first key of `given` (with its path below `at`) that the parsed layer `known` does not
/// have.
fn unknown_key(
    given: &serde_json::Value,
    known: &serde_json::Value,
    at: &str,
) -> std::result::Result<(), String> {
    use serde_json::Value;
    match (given, known) {
        (Value::Object(g), Value::Object(k)) => {
            for (key, v) in g {
                let path = format!("{at}{key}");
                match k.get(key) {
                    None => {
                        let kind = k.get("type").and_then(Value::as_str).unwrap_or("layer");
                        let takes: Vec<&str> = k
                            .keys()
                            .map(String::as_str)
                            .filter(|n| *n != "type")
                            .collect();
                        let takes = if takes.is_empty() {
                            "no keys besides type".to_string()
                        } else {
                            takes.join(", ")
                        };
                        return Err(format!(
                            "unknown key `{path}` = {v} (a {kind} layer takes {takes})"
                        ));
                    }
                    Some(kv) => unknown_key(v, kv, &format!("{path}."))?,
                }
            }
            Ok(())
        }
        (Value::Array(g), Value::Array(k)) => {
            for (i, (gv, kv)) in g.iter().zip(k).enumerate() {
                unknown_key(gv, kv, &format!("{at}{i}."))?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// One tie: layer parameter `param` uses the parameter named `to` instead of its own.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tie {
    /// The using parameter, `layers.{index}.{name}`.
    pub param: String,
    /// The parameter it uses, named the same way; it must come earlier and have the same shape.
    pub to: String,
}

impl ModelSpec {
    /// A GPT-style decoder over `vocab` tokens: embedding, `blocks` transformer blocks, final layer
    /// norm, head; with `tie`, the head uses the token embedding (`layers.{last}.weight` tied to
    /// `layers.0.token`).
    pub fn gpt(shape: crate::transformer::GptShape, vocab: usize, tie: bool) -> Self {
        let crate::transformer::GptShape {
            blocks,
            width,
            heads,
            context,
        } = shape;
        let mut layers = vec![LayerSpec::Embedding {
            vocab,
            width,
            context,
            padded_vocab: None,
        }];
        layers.extend((0..blocks).map(|_| LayerSpec::TransformerBlock {
            width,
            heads,
            hidden: None,
        }));
        layers.push(LayerSpec::LayerNorm {
            features: width,
            eps: 1e-5,
        });
        layers.push(LayerSpec::LmHead {
            width,
            vocab,
            padded_vocab: None,
        });
        let tied = if tie {
            vec![Tie {
                param: format!("layers.{}.weight", layers.len() - 1),
                to: "layers.0.token".into(),
            }]
        } else {
            Vec::new()
        };
        Self {
            input: vec![context],
            layers,
            tied,
        }
    }

    /// This spec with its vocabulary tables padded to `rows` rows (the token embedding's and
    /// the head's, [`LayerSpec::LmHead`]); `None`, or the vocabulary itself, pads nothing.
    #[must_use]
    pub fn with_padded_vocab(mut self, rows: Option<usize>) -> Self {
        for layer in &mut self.layers {
            if let LayerSpec::Embedding {
                vocab,
                padded_vocab,
                ..
            }
            | LayerSpec::LmHead {
                vocab,
                padded_vocab,
                ..
            } = layer
            {
                *padded_vocab = rows.filter(|r| r != vocab);
            }
        }
        self
    }

    /// The classes of the model's output: the head's vocabulary when its last layer is a
    /// language-model head (fewer than the logits' columns when padded); `None` when every
    /// output column is a class.
    pub fn classes(&self) -> Option<usize> {
        match self.layers.last() {
            Some(LayerSpec::LmHead { vocab, .. }) => Some(*vocab),
            _ => None,
        }
    }

    /// Parses a preset name: a GPT preset (`gpt-mini`, `gpt-small`: a character model sized
    /// for the embedded Tiny Shakespeare's vocabulary, untied), or `mlp-IN-H1-H2-...-OUT`, where a hidden width may be written `WxN`
    /// for N layers of width W (`mlp-784-1024x16-10`). Hidden layers use ReLU; a flatten layer
    /// comes first so image-shaped data fits.
    ///
    /// # Errors
    /// [`StageError::Model`] for unknown names or malformed widths.
    pub fn preset(name: &str) -> Result<Self> {
        if let Some(shape) = crate::transformer::gpt_shape(name) {
            let vocab = crate::data::corpus_vocab(&crate::data::tinyshakespeare_text(None)?);
            return Ok(Self::gpt(
                shape,
                vocab.len(),
                crate::transformer::is_gpt2(name),
            ));
        }
        let rest = name.strip_prefix("mlp-").ok_or_else(|| {
            StageError::Model(format!(
                "unknown model preset '{name}' (presets look like mlp-784-512-512-10, or gpt-mini \
                 and gpt-small)"
            ))
        })?;
        let mut widths = Vec::new();
        for part in rest.split('-') {
            let (w, n) = match part.split_once('x') {
                Some((w, n)) => (w, n),
                None => (part, "1"),
            };
            let parse = |s: &str| {
                s.parse::<usize>().ok().filter(|v| *v > 0).ok_or_else(|| {
                    StageError::Model(format!("'{name}': '{part}' is not a positive width"))
                })
            };
            let (w, n) = (parse(w)?, parse(n)?);
            if n > 10_000 {
                return Err(StageError::Model(format!(
                    "'{name}': {n} repeated layers is too many"
                )));
            }
            // Checked before the widths exist: a long name of many parts is as big a request.
            pipe_scheduler::limits::check_layers((widths.len() + n) as u64)
                .map_err(|e| StageError::Limit(e.to_string()))?;
            widths.extend(std::iter::repeat_n(w, n));
        }
        if widths.len() < 2 {
            return Err(StageError::Model(format!(
                "'{name}' needs at least an input and an output width"
            )));
        }
        let mut layers = vec![LayerSpec::Flatten];
        for (i, pair) in widths.windows(2).enumerate() {
            layers.push(LayerSpec::Linear {
                inputs: pair[0],
                outputs: pair[1],
                bias: true,
                init: None,
            });
            if i + 2 < widths.len() {
                layers.push(LayerSpec::Relu);
            }
        }
        Ok(Self {
            input: vec![widths[0]],
            layers,
            tied: Vec::new(),
        })
    }
}

impl Model {
    /// Builds a model and checks that every layer accepts the previous layer's output.
    ///
    /// # Errors
    /// [`StageError::Model`] naming the first layer whose input does not fit.
    pub fn new(spec: &ModelSpec) -> Result<Self> {
        if spec.layers.is_empty() {
            return Err(StageError::Model("the model has no layers".into()));
        }
        // Layers inside residual blocks and sequences count too.
        let nested: u64 = spec.layers.iter().map(LayerSpec::layer_count).sum();
        pipe_scheduler::limits::check_layers(nested)
            .map_err(|e| StageError::Limit(e.to_string()))?;
        crate::limits::check_shape("the model's input", &spec.input)?;
        if spec.input.is_empty() || spec.input.contains(&0) {
            return Err(StageError::Model(format!(
                "input shape {:?} must be non-empty and positive",
                spec.input
            )));
        }
        let mut layers = Vec::with_capacity(spec.layers.len());
        let mut shapes = vec![spec.input.clone()];
        for (i, ls) in spec.layers.iter().enumerate() {
            let followed = spec.layers.get(i + 1).is_some_and(LayerSpec::is_activation);
            let layer = ls
                .build(followed)
                .map_err(|e| StageError::Model(format!("layer {i}: {e}")))?;
            let out = layer
                .output_shape(&shapes[i])
                .map_err(|e| StageError::Model(format!("layer {i} ({}): {e}", layer.kind())))?;
            shapes.push(out);
            layers.push(layer);
        }
        let (table, slots) = param_table(&layers, &spec.tied)?;
        let tied = table.iter().any(|e| e.uses.len() > 1);
        let model = Self {
            tied,
            recompute: StageRecompute::default(),
            document_end: None,
            loss: crate::loss::SoftmaxCrossEntropy {
                classes: spec.classes(),
            },
            specs: spec.layers.clone(),
            layers,
            shapes,
            table,
            slots,
        };
        model.check_sizes()?;
        Ok(model)
    }

    /// This model with the backward recomputing `what` instead of keeping it from the forward
    /// ([`Recompute`]). Only memory changes: the recomputed forward runs with the same weights
    /// (the stashed version the forward used) and the same dropout seeds, so every gradient has
    /// the same bits.
    #[must_use]
    pub fn with_recompute(self, what: Recompute) -> Self {
        self.with_stage_recompute(StageRecompute::every(what))
    }

    /// This model with each pipeline stage recomputing its own kind ([`StageRecompute`]).
    #[must_use]
    pub fn with_stage_recompute(mut self, what: StageRecompute) -> Self {
        self.recompute = what;
        self
    }

    /// What the backward recomputes, per stage.
    pub fn recompute(&self) -> &StageRecompute {
        &self.recompute
    }

    /// The loss of the model's output: softmax cross-entropy over its classes (a padded
    /// vocabulary's extra logits are not classes, [`LayerSpec::LmHead`]).
    pub fn loss(&self) -> &dyn crate::loss::Loss {
        &self.loss
    }

    /// The classes of an output row: the first columns of the model's output, all of them
    /// unless a padded vocabulary adds columns that are not classes.
    pub fn output_classes(&self) -> usize {
        let columns = self.output_shape().last().copied().unwrap_or(0);
        self.loss.classes.unwrap_or(columns).min(columns)
    }

    /// Output columns past the classes: the rows a padded vocabulary adds (0 unpadded).
    pub fn vocab_padding(&self) -> usize {
        let columns = self.output_shape().last().copied().unwrap_or(0);
        columns - self.output_classes()
    }

    /// What a training forward of stage `stage` keeps ([`Keep::Train`] with its kind).
    pub fn training(&self, stage: usize) -> Keep {
        Keep::Train(self.recompute.at(stage))
    }

    /// This model reading its token windows as packed documents ending with the id `end`
    /// (`--pack-documents`, [`crate::documents`]); `None` reads each window as one sequence.
    #[must_use]
    pub fn with_documents(mut self, end: Option<u32>) -> Self {
        self.document_end = end;
        self
    }

    /// The end-of-text id packed documents end with, when the model packs them.
    pub fn document_end(&self) -> Option<u32> {
        self.document_end
    }

    /// The documents of a microbatch whose token ids are `ids` (host memory, `[batch, seq]`),
    /// placed on `be`, for [`Model::forward_range`]; `None` when the model does not pack
    /// documents.
    ///
    /// # Errors
    /// Ids not shaped `[batch, seq]`; a failed placement.
    pub fn documents(
        &self,
        be: &dyn Backend,
        ids: &Tensor,
    ) -> Result<Option<std::sync::Arc<crate::documents::Documents>>> {
        let Some(end) = self.document_end else {
            return Ok(None);
        };
        let docs =
            crate::documents::Documents::of(be, ids, end).map_err(|source| StageError::Kernel {
                layer: 0,
                kind: "embedding",
                op: "documents",
                source,
            })?;
        Ok(Some(std::sync::Arc::new(docs)))
    }

    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// True when the model has no layers (never, for a built model).
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// The layer specs.
    pub fn specs(&self) -> &[LayerSpec] {
        &self.specs
    }

    /// Layer `i`.
    pub fn layer(&self, i: usize) -> &dyn Layer {
        self.layers[i].as_ref()
    }

    /// Per-sample input shape.
    pub fn input_shape(&self) -> &[usize] {
        &self.shapes[0]
    }

    /// Per-sample output shape.
    pub fn output_shape(&self) -> &[usize] {
        &self.shapes[self.layers.len()]
    }

    /// Per-sample shape entering layer `i` (`i == len()` gives the output shape).
    pub fn shape_before(&self, i: usize) -> &[usize] {
        &self.shapes[i]
    }

    /// The parameter table, in model order of first use.
    pub fn param_table(&self) -> &[ParamEntry] {
        &self.table
    }

    /// The table entry of parameter `slot` of layer `layer`.
    pub fn param_id(&self, layer: usize, slot: usize) -> ParamId {
        self.slots[layer][slot]
    }

    /// Per layer, per parameter: whether it is a hidden weight matrix, whose update Muon
    /// orthogonalises ([`crate::optim::OptimizerKind::Muon`]): a 2-D parameter of any layer
    /// but the token embedding, the language-model head, and the first and last layers that
    /// have parameters (an MLP's input layer reads raw features and its last layer is the
    /// classifier, the embedding and head of a language model). Every other parameter
    /// (embeddings, heads, biases, norms) takes AdamW's step under Muon, as its authors
    /// prescribe.
    pub fn hidden_matrices(&self) -> Vec<Vec<bool>> {
        let with_params: Vec<usize> = (0..self.slots.len())
            .filter(|&i| !self.slots[i].is_empty())
            .collect();
        let edges = [with_params.first().copied(), with_params.last().copied()];
        self.slots
            .iter()
            .enumerate()
            .map(|(i, slots)| {
                let outer = edges.contains(&Some(i))
                    || matches!(
                        self.specs.get(i),
                        Some(LayerSpec::Embedding { .. } | LayerSpec::LmHead { .. })
                    );
                slots
                    .iter()
                    .map(|&id| !outer && self.table[id].shape.len() == 2)
                    .collect()
            })
            .collect()
    }

    /// Per layer and parameter, what the optimizer needs to know of it
    /// ([`ParamRole`]): a hidden weight matrix ([`Model::hidden_matrices`]), and
    /// the matrix of a linear map (2-D, and used by some layer other than an embedding: the
    /// linear layers', attention's and the MLP's weights and the head; a token table tied to
    /// the head is one). Embeddings, biases and layer-norm gains are neither.
    pub fn optimizer_roles(&self) -> Vec<Vec<ParamRole>> {
        let hidden = self.hidden_matrices();
        let linear = |id: ParamId| {
            let e = &self.table[id];
            e.shape.len() == 2
                && e.uses.iter().any(|&(layer, _)| {
                    !matches!(self.specs.get(layer), Some(LayerSpec::Embedding { .. }))
                })
        };
        self.slots
            .iter()
            .zip(hidden)
            .map(|(slots, hidden)| {
                slots
                    .iter()
                    .zip(hidden)
                    .map(|(&id, hidden_matrix)| ParamRole {
                        hidden_matrix,
                        linear_matrix: linear(id),
                    })
                    .collect()
            })
            .collect()
    }

    /// Stable parameter names (the table's), `layers.{index}.{name}`, in model order.
    pub fn param_names(&self) -> Vec<String> {
        self.table.iter().map(|e| e.name.clone()).collect()
    }

    /// Checks the built model's sizes before any parameter is allocated: every parameter's and
    /// every per-sample activation's element count against
    /// [`crate::limits::MAX_TENSOR_ELEMENTS`] ([`Model::check_microbatch`] adds the
    /// microbatch). The layer count is checked before the layers are built.
    fn check_sizes(&self) -> Result<()> {
        use crate::limits::{MAX_TENSOR_ELEMENTS, elements, limit};
        self.check_microbatch(1)?;
        for entry in &self.table {
            let n = elements(&entry.shape).unwrap_or(u64::MAX);
            if n > MAX_TENSOR_ELEMENTS {
                return Err(limit(
                    format_args!("parameter {} {:?}, in elements,", entry.name, entry.shape),
                    n,
                    MAX_TENSOR_ELEMENTS,
                    "elements of one tensor, 8 GiB of f32",
                ));
            }
        }
        Ok(())
    }

    /// Elements of one microbatch's activation entering layer `i` (`i == len()` is the output).
    fn activation_elements(&self, i: usize, microbatch_size: usize) -> u64 {
        crate::limits::elements(self.shape_before(i))
            .unwrap_or(u64::MAX)
            .saturating_mul(microbatch_size as u64)
    }

    /// Checks every activation of a microbatch of `microbatch_size` samples against
    /// [`crate::limits::MAX_TENSOR_ELEMENTS`].
    ///
    /// # Errors
    /// [`StageError::Limit`] naming the first layer boundary over it.
    pub fn check_microbatch(&self, microbatch_size: usize) -> Result<()> {
        use crate::limits::{MAX_TENSOR_ELEMENTS, limit};
        for i in 0..=self.len() {
            let n = self.activation_elements(i, microbatch_size);
            if n > MAX_TENSOR_ELEMENTS {
                let at = if i == self.len() {
                    "the model's output".to_string()
                } else {
                    format!("the input of layer {i}")
                };
                return Err(limit(
                    format_args!(
                        "{at} at microbatch size {microbatch_size} ({:?} per sample), in \
                         elements,",
                        self.shape_before(i)
                    ),
                    n,
                    MAX_TENSOR_ELEMENTS,
                    "elements of one tensor, 8 GiB of f32; use smaller microbatches",
                ));
            }
        }
        Ok(())
    }

    /// A coarse memory estimate of one worker of `run` in bytes, before any partition is
    /// settled: pipe's memory model ([`pipe_scheduler::planner::memory`]) on a stage of the
    /// largest parameters and the largest activations (every layer's input and output) of an
    /// even cut by layer count, with the deepest count in flight, so that it bounds any worker
    /// of a balanced run. The start-up checks read it; a settled run's estimate per worker is
    /// [`crate::planning::memory`].
    pub fn worker_memory_bytes(
        &self,
        run: &pipe_scheduler::Resolved,
        microbatch_size: usize,
        state_copies: f64,
    ) -> f64 {
        let layers = self.len().max(1);
        let stages = (run.layout.stages() as usize).clamp(1, layers);
        let per_stage = layers.div_ceil(stages);
        // Every use holds its own copy of a tied parameter.
        let mut layer_params = vec![0.0f64; layers];
        for entry in &self.table {
            let n = crate::limits::elements(&entry.shape).unwrap_or(u64::MAX) as f64;
            for &(l, _) in &entry.uses {
                layer_params[l] += n;
            }
        }
        let (mut params, mut stash) = (0.0f64, 0.0f64);
        for s in 0..stages {
            let range = (s * per_stage).min(layers)..((s + 1) * per_stage).min(layers);
            let p: f64 = layer_params[range.clone()].iter().sum();
            let a: f64 = range
                .map(|l| {
                    (self.activation_elements(l, microbatch_size) as f64)
                        + self.activation_elements(l + 1, microbatch_size) as f64
                })
                .sum();
            params = params.max(p * 4.0);
            stash = stash.max(a * 4.0);
        }
        use pipe_scheduler::planner::memory::{StageHeld, planned_in_flight, worker_bytes};
        let deepest = run.depths.iter().copied().max().unwrap_or(1);
        let stage = StageHeld {
            params,
            kept: stash,
            in_flight: planned_in_flight(
                run.policy,
                run.microbatches_per_update,
                u64::from(deepest),
                1,
            ),
            ..StageHeld::default()
        };
        worker_bytes(run.policy, &[stage], 1.0, state_copies).total()
    }

    /// Total number of parameters (a tied parameter counts once).
    pub fn param_count(&self) -> usize {
        self.table
            .iter()
            .map(|e| e.shape.iter().product::<usize>())
            .sum()
    }

    /// True when some parameter has more than one use.
    pub fn has_ties(&self) -> bool {
        self.tied
    }

    /// The first tied parameter whose uses fall in different parts of `ranges` (stages), as
    /// (name, first part, other part).
    pub fn tie_across(&self, ranges: &[std::ops::Range<usize>]) -> Option<(&str, usize, usize)> {
        let part = |layer: usize| ranges.iter().position(|r| r.contains(&layer));
        self.table.iter().find_map(|e| {
            let first = part(e.uses.first()?.0)?;
            let other = e
                .uses
                .iter()
                .filter_map(|&(l, _)| part(l))
                .find(|&p| p != first)?;
            Some((e.name.as_str(), first, other))
        })
    }

    /// The uses, as (layer, slot), that layers `mine` make of parameters also used in layers
    /// `theirs`: what a stage sends a stage it shares tied parameters with. In table order,
    /// then use order, so both sides agree on the layout of the message.
    pub fn tied_uses_shared(
        &self,
        mine: std::ops::Range<usize>,
        theirs: std::ops::Range<usize>,
    ) -> Vec<(usize, usize)> {
        self.table
            .iter()
            .filter(|e| e.uses.iter().any(|(l, _)| theirs.contains(l)))
            .flat_map(|e| e.uses.iter().copied().filter(|(l, _)| mine.contains(l)))
            .collect()
    }

    /// The parts of `ranges` (stages) that share a tied parameter with part `me`, ascending.
    pub fn tie_partners(&self, ranges: &[std::ops::Range<usize>], me: usize) -> Vec<usize> {
        let mine = &ranges[me];
        (0..ranges.len())
            .filter(|&p| p != me)
            .filter(|&p| {
                !self
                    .tied_uses_shared(mine.clone(), ranges[p].clone())
                    .is_empty()
            })
            .collect()
    }

    /// The squared L2 norm of `grads` (the gradients of layers `first..`), each parameter
    /// counted once: of a parameter several layers use (tied), only the first use in the table
    /// counts, because once the uses are summed ([`Model::sum_tied`]) every copy holds the
    /// same gradient. Summed in `f64`, layer by layer and slot by slot, so every trainer that
    /// holds the same gradients gets the same bits.
    ///
    /// # Errors
    /// Kernel errors.
    pub fn gradient_square_norm(
        &self,
        be: &dyn Backend,
        first: usize,
        grads: &Params,
    ) -> Result<f64> {
        let repeated: std::collections::HashSet<(usize, usize)> = self
            .table
            .iter()
            .flat_map(|e| e.uses.iter().skip(1).copied())
            .collect();
        let mut sum = 0.0;
        for (i, layer) in grads.iter().enumerate() {
            for (slot, g) in layer.iter().enumerate() {
                if !repeated.contains(&(first + i, slot)) {
                    sum += be.sum_squares(g)?;
                }
            }
        }
        Ok(sum)
    }

    /// The guard on a stage's tensors: every value of `tensors` (one list per layer, from
    /// layer `first`) must be finite: the gradients before update `update` applies them, the
    /// weights after its step, so that no later update, evaluation or checkpoint starts from
    /// a value that is not.
    ///
    /// # Errors
    /// [`StageError::NonFinite`] naming the first parameter whose tensor is not, and `update`.
    pub fn check_finite(
        &self,
        be: &dyn Backend,
        (first, tensors): (usize, &Params),
        what: Guarded,
        update: u64,
    ) -> Result<()> {
        match self.first_non_finite_slot(be, tensors, |_| None)? {
            Some(slot) => Err(self.non_finite(first, slot, what, update)),
            None => Ok(()),
        }
    }

    /// The guard on one update's gradients and new weights, as [`Model::check_finite`] twice
    /// (the gradients first), where `seen` says what the update's kernels already looked at,
    /// per layer and parameter (the optimizer's `StepSeen`): only the rest is scanned. The CPU backend's updates see every tensor
    /// they touch, so an update there costs the guard no pass of its own. The gradients are
    /// checked after the step rather than before it: a run whose gradient is not finite stops
    /// at this update either way, and nothing reads the weights the step made from it.
    ///
    /// # Errors
    /// [`StageError::NonFinite`] naming the first parameter whose gradient is not finite, else
    /// the first whose weights after the step are not, and `update`.
    pub fn check_update(
        &self,
        be: &dyn Backend,
        (first, grads, weights): (usize, &Params, &Params),
        seen: &[Vec<UpdateSeen>],
        update: u64,
    ) -> Result<()> {
        let seen_at = |(i, s): (usize, usize)| seen.get(i).and_then(|l| l.get(s)).copied();
        let grad = self.first_non_finite_slot(be, grads, |slot| seen_at(slot)?.grad)?;
        if let Some(slot) = grad {
            return Err(self.non_finite(first, slot, Guarded::Gradients, update));
        }
        let weight = self.first_non_finite_slot(be, weights, |slot| seen_at(slot)?.param)?;
        match weight {
            Some(slot) => Err(self.non_finite(first, slot, Guarded::Weights, update)),
            None => Ok(()),
        }
    }

    /// The error of the guard for the tensor at `(layer, slot)` of the layers from `first`.
    fn non_finite(
        &self,
        first: usize,
        (i, slot): (usize, usize),
        what: Guarded,
        update: u64,
    ) -> StageError {
        let id = self.param_id(first + i, slot);
        let name = self
            .param_table()
            .get(id)
            .map_or_else(|| format!("layers.{}", first + i), |e| e.name.clone());
        StageError::NonFinite {
            what: match what {
                Guarded::Gradients => format!("the gradient of {name}"),
                Guarded::Weights => format!("the parameter {name} after the optimizer's step"),
            },
            update,
            detail: String::new(),
        }
    }

    /// The (layer, slot) of the first tensor of `tensors`, in order, that holds a value that is
    /// not finite, if one does: `known` answers for a slot already looked at (`Some(true)`:
    /// finite), and the others are scanned in one call ([`Backend::first_non_finite`]).
    fn first_non_finite_slot(
        &self,
        be: &dyn Backend,
        tensors: &Params,
        known: impl Fn((usize, usize)) -> Option<bool>,
    ) -> Result<Option<(usize, usize)>> {
        let slots = tensors
            .iter()
            .enumerate()
            .flat_map(|(i, layer)| layer.iter().enumerate().map(move |(s, t)| ((i, s), t)));
        let mut flagged = None;
        let mut unknown: Vec<((usize, usize), &Tensor)> = Vec::new();
        for (slot, t) in slots {
            match known(slot) {
                Some(true) => {}
                Some(false) => {
                    flagged = Some(slot);
                    break;
                }
                None => unknown.push((slot, t)),
            }
        }
        let refs: Vec<&Tensor> = unknown.iter().map(|&(_, t)| t).collect();
        let scanned = if refs.is_empty() {
            None
        } else {
            let bad = be.first_non_finite(&refs)?;
            bad.and_then(|b| unknown.get(b)).map(|&(s, _)| s)
        };
        // Slots are in order, so the smaller of the two is the first.
        Ok(match (flagged, scanned) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        })
    }

    /// Sums the gradients of every use of each tied parameter and gives every use the sum.
    /// `parts` are gradient lists of disjoint layer ranges, each with its first layer's index
    /// (one part for a stage; every stage sharing a parameter for the reference trainer).
    /// Uses are summed in model order, so the result does not depend on how `parts` are
    /// listed. Uses outside `parts` are left alone. Does nothing for a model without ties.
    ///
    /// # Errors
    /// Kernel errors.
    pub fn sum_tied(&self, be: &dyn Backend, parts: &mut [(usize, &mut Params)]) -> Result<()> {
        if !self.has_ties() {
            return Ok(());
        }
        for entry in self.table.iter().filter(|e| e.uses.len() > 1) {
            let mut held: Vec<(usize, usize, usize)> = Vec::new(); // (part, layer in part, slot)
            for &(layer, slot) in &entry.uses {
                for (k, (start, grads)) in parts.iter().enumerate() {
                    if layer >= *start && layer - *start < grads.len() {
                        held.push((k, layer - *start, slot));
                    }
                }
            }
            if held.len() < 2 {
                continue;
            }
            let (k0, l0, s0) = held[0];
            let mut sum = parts[k0].1[l0][s0].clone();
            for &(k, l, s) in &held[1..] {
                be.axpy(1.0, &parts[k].1[l][s], &mut sum)?;
            }
            for &(k, l, s) in &held {
                be.copy(&sum, &mut parts[k].1[l][s])?;
            }
        }
        Ok(())
    }

    /// Forward FLOPs per sample over all layers.
    pub fn flops_per_sample(&self) -> u64 {
        (0..self.len())
            .map(|i| self.layers[i].flops_per_sample(&self.shapes[i]))
            .sum()
    }

    /// Initial parameters. Each layer draws from its own stream (seed, layer index), so a
    /// layer's initial weights do not depend on the rest of the model or on the partition.
    /// Every use of a tied parameter starts as a copy of its first use.
    pub fn init_params(&self, seed: u64) -> Params {
        self.init_params_of(seed, &vec![true; self.len()])
    }

    /// [`Model::init_params`] for the layers `keep` marks only, each with the same values as
    /// in the whole model's (every layer draws from its own seeded stream, and a tied
    /// parameter is its first use's); the other layers hold no tensors. A worker process
    /// builds its own stages' weights this way, not the whole model's.
    pub fn init_params_of(&self, seed: u64, keep: &[bool]) -> Params {
        let kept = |l: usize| keep.get(l).copied().unwrap_or(false);
        // A kept layer's tied parameter is drawn by its first use's layer.
        let mut draw: Vec<bool> = (0..self.len()).map(kept).collect();
        for entry in self.table.iter().filter(|e| e.uses.len() > 1) {
            if entry.uses.iter().any(|&(l, _)| kept(l)) {
                draw[entry.uses[0].0] = true;
            }
        }
        let mut params: Params = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                if draw[i] {
                    l.init_params(&mut rng_for(seed, "init", i as u64))
                } else {
                    Vec::new()
                }
            })
            .collect();
        for entry in self.table.iter().filter(|e| e.uses.len() > 1) {
            let (l0, s0) = entry.uses[0];
            let Some(first) = params[l0].get(s0).cloned() else {
                continue;
            };
            for &(l, s) in &entry.uses[1..] {
                if let Some(p) = params[l].get_mut(s) {
                    *p = first.clone();
                }
            }
        }
        for (i, p) in params.iter_mut().enumerate() {
            if !kept(i) {
                *p = Vec::new();
            }
        }
        params
    }

    /// Zeroed gradient buffers shaped like the parameters of layers `range`.
    pub fn zero_grads(&self, range: std::ops::Range<usize>) -> Params {
        self.layers[range]
            .iter()
            .map(|l| {
                l.param_shapes()
                    .into_iter()
                    .map(|(_, s)| Tensor::zeros(&s))
                    .collect()
            })
            .collect()
    }

    /// Runs layers `range` forward on `x` (a batch), with `params` holding exactly those
    /// layers' parameters. `microbatch` identifies the batch for dropout seeds, and
    /// `documents` its packed documents ([`Model::documents`]; `None` when not packed). In
    /// training each layer's [`Saved`] is returned for the backward (a stand-in where the model
    /// recomputes, [`Keep::Train`]); in evaluation ([`Keep::Nothing`]) nothing is kept.
    ///
    /// # Errors
    /// [`StageError::Kernel`] naming the layer that failed.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_range(
        &self,
        be: &dyn Backend,
        range: std::ops::Range<usize>,
        params: &[Vec<Tensor>],
        x: Tensor,
        keep: Keep,
        seed: u64,
        microbatch: u64,
        documents: Option<&std::sync::Arc<crate::documents::Documents>>,
    ) -> Result<(Tensor, Vec<Saved>)> {
        let (train, recompute) = match keep {
            Keep::Nothing => (false, Recompute::None),
            Keep::Train(kind) => (true, kind),
        };
        let mut saved = Vec::with_capacity(range.len());
        let mut h = x;
        for (j, i) in range.enumerate() {
            let layer = &self.layers[i];
            let ctx = ForwardCtx {
                train,
                seed: derive_seed(seed, "layer", ((i as u64) << 40) ^ microbatch),
                recompute_attention: recompute == Recompute::Selective,
                documents: documents.cloned(),
            };
            // Full recomputation keeps a layer's input where it would save more.
            let input = (recompute == Recompute::Full).then(|| h.clone());
            let (y, s) = layer
                .forward(be, &params[j], h, ctx.clone())
                .map_err(self.kernel_error(i, "forward"))?;
            saved.push(match input {
                Some(x) if s.bytes() > x.len() * 4 => Saved::recompute(x, ctx),
                // Evaluation has no backward: each layer's activations go as soon as the next
                // layer has its input.
                _ if !train => Saved::default(),
                _ => s,
            });
            h = y;
        }
        Ok((h, saved))
    }

    /// Layer `i`'s input gradient, errors naming the layer.
    fn layer_input_grad(
        &self,
        be: &dyn Backend,
        i: usize,
        params: &[Tensor],
        saved: &Saved,
        g: &Tensor,
    ) -> Result<Tensor> {
        let layer = &self.layers[i];
        materialize(layer.as_ref(), be, params, saved)
            .and_then(|saved| layer.backward_input(be, params, &saved, g))
            .map_err(self.kernel_error(i, "backward_input"))
    }

    /// The error of layer `i`'s kernel failing in `op`, naming the layer.
    fn kernel_error(
        &self,
        i: usize,
        op: &'static str,
    ) -> impl FnOnce(pipe_kernels::KernelError) -> StageError + '_ {
        move |source| StageError::Kernel {
            layer: i,
            kind: self.layers[i].kind(),
            op,
            source,
        }
    }

    /// The first layer of `range` whose input gradient the backward over `range` computes:
    /// `range.start` when `need_input_grad` (an earlier stage waits for it), else the layer
    /// after the range's first layer with parameters (`range.end` when none has any). Below
    /// it nothing trains, so a model that opens with layers without parameters (an MLP's
    /// `flatten`) skips its first product's input gradient, as autograd does for an input
    /// that needs no gradient.
    fn first_input_grad(&self, range: &std::ops::Range<usize>, need_input_grad: bool) -> usize {
        if need_input_grad {
            return range.start;
        }
        range
            .clone()
            .find(|&i| !self.slots[i].is_empty())
            .map_or(range.end, |i| i + 1)
    }

    /// Whether a backward pass computes layer `i`'s input gradient: some earlier layer has
    /// parameters ([`Model::first_input_grad`] from the model's first layer; a later stage's
    /// layers always have one before them, since every stage holds a layer with parameters).
    /// What the profiler times layer `i`'s backward with.
    pub fn computes_input_grad(&self, i: usize) -> bool {
        i >= self.first_input_grad(&(0..self.layers.len()), false)
    }

    /// Runs layers `range` backward from `dy`: for each layer, last first, the input gradient
    /// (skipped below [`Model::first_input_grad`], where nobody reads it, and then every
    /// layer below, none of which has parameters) and the parameter gradients, added into
    /// `grads` when `accumulate`. Calls `ready` after each layer with the
    /// layer's index within `range` and `grads`: that layer and every later one hold their
    /// parameter gradients of this pass (what lets the executor start all-reducing them while
    /// the earlier layers compute; [`no_notice`] where nobody waits). Returns the gradient
    /// entering `range.start`, or `None` when it is not needed.
    ///
    /// # Errors
    /// [`StageError::Kernel`] naming the layer that failed, or `ready`'s error.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_range(
        &self,
        be: &dyn Backend,
        range: std::ops::Range<usize>,
        params: &[Vec<Tensor>],
        saved: &[Saved],
        (dy, need_input_grad): (Tensor, bool),
        grads: &mut [Vec<Tensor>],
        accumulate: bool,
        ready: &mut GradientsReady<'_>,
    ) -> Result<Option<Tensor>> {
        let start = range.start;
        let first = self.first_input_grad(&range, need_input_grad);
        let mut g = dy;
        for i in range.rev() {
            let j = i - start;
            let layer = &self.layers[i];
            let need = i >= first;
            let next = materialize(layer.as_ref(), be, &params[j], &saved[j])
                .and_then(|saved| {
                    layer.backward(be, &params[j], &saved, &g, &mut grads[j], accumulate, need)
                })
                .map_err(self.kernel_error(i, "backward"))?;
            ready(j, grads)?;
            match next {
                Some(next) => g = next,
                None => {
                    // The layers below have no parameters: nothing of theirs to compute.
                    for below in (0..j).rev() {
                        ready(below, grads)?;
                    }
                    return Ok(None);
                }
            }
        }
        Ok(Some(g))
    }

    /// The input-gradient half of a split backward over layers `range`: runs each layer's
    /// `backward_input`, last first, and returns the gradient entering `range.start` (None
    /// below [`Model::first_input_grad`], where nobody reads it) together with the gradient that
    /// reached each layer's output (in layer order), which [`Model::backward_params_range`]
    /// needs later (an empty tensor for the layers without parameters under the last one
    /// computed, which it skips).
    ///
    /// # Errors
    /// [`StageError::Kernel`] naming the layer that failed.
    pub fn backward_input_range(
        &self,
        be: &dyn Backend,
        range: std::ops::Range<usize>,
        params: &[Vec<Tensor>],
        saved: &[Saved],
        dy: Tensor,
        need_input_grad: bool,
    ) -> Result<(Option<Tensor>, Vec<Tensor>)> {
        let start = range.start;
        let mut dys: Vec<Tensor> = Vec::with_capacity(range.len());
        let first = self.first_input_grad(&range, need_input_grad);
        let mut g = dy;
        for i in range.rev() {
            let j = i - start;
            if i < first {
                dys.push(g);
                dys.extend((0..j).map(|_| Tensor::default()));
                dys.reverse();
                return Ok((None, dys));
            }
            let next = self.layer_input_grad(be, i, &params[j], &saved[j], &g)?;
            dys.push(std::mem::replace(&mut g, next));
        }
        dys.reverse();
        Ok((Some(g), dys))
    }

    /// The weight-gradient half of a split backward: each layer's `backward_params` from its
    /// saved activations and the output gradient [`Model::backward_input_range`] recorded,
    /// added into `grads` when `accumulate`. Gives the same bits as the fused
    /// [`Model::backward_range`]. Calls `ready` after each layer, as
    /// [`Model::backward_range`] does.
    ///
    /// # Errors
    /// [`StageError::Kernel`] naming the layer that failed.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_params_range(
        &self,
        be: &dyn Backend,
        range: std::ops::Range<usize>,
        params: &[Vec<Tensor>],
        saved: &[Saved],
        dys: &[Tensor],
        grads: &mut [Vec<Tensor>],
        accumulate: bool,
        ready: &mut GradientsReady<'_>,
    ) -> Result<()> {
        let start = range.start;
        for i in range.rev() {
            let j = i - start;
            let layer = &self.layers[i];
            if self.slots[i].is_empty() {
                // No parameters, so no gradients to compute (and no output gradient kept for
                // those below the input gradients' cut).
                ready(j, grads)?;
                continue;
            }
            materialize(layer.as_ref(), be, &params[j], &saved[j])
                .and_then(|saved| {
                    layer.backward_params(
                        be,
                        &params[j],
                        &saved,
                        &dys[j],
                        &mut grads[j],
                        accumulate,
                    )
                })
                .map_err(self.kernel_error(i, "backward_params"))?;
            ready(j, grads)?;
        }
        Ok(())
    }
}

/// Builds the parameter table of `layers` with `tied` applied.
fn param_table(
    layers: &[Box<dyn Layer>],
    tied: &[Tie],
) -> Result<(Vec<ParamEntry>, Vec<Vec<ParamId>>)> {
    let mut table: Vec<ParamEntry> = Vec::new();
    let mut slots = Vec::with_capacity(layers.len());
    let mut by_name = std::collections::HashMap::new();
    let mut used_ties = vec![false; tied.len()];
    for (i, layer) in layers.iter().enumerate() {
        let mut ids = Vec::new();
        for (slot, (name, shape)) in layer.param_shapes().into_iter().enumerate() {
            let name = format!("layers.{i}.{name}");
            let tie = tied.iter().position(|t| t.param == name);
            let id = match tie {
                Some(t) => {
                    used_ties[t] = true;
                    let to = &tied[t].to;
                    let &id = by_name.get(to).ok_or_else(|| {
                        StageError::Model(format!(
                            "tie {name} -> {to}: {to} is not a parameter of an earlier layer"
                        ))
                    })?;
                    let entry: &mut ParamEntry = &mut table[id];
                    if entry.shape != shape {
                        return Err(StageError::Model(format!(
                            "tie {name} -> {to}: shapes {shape:?} and {:?} differ",
                            entry.shape
                        )));
                    }
                    entry.uses.push((i, slot));
                    id
                }
                None => {
                    table.push(ParamEntry {
                        name: name.clone(),
                        shape,
                        uses: vec![(i, slot)],
                    });
                    table.len() - 1
                }
            };
            by_name.insert(name, id);
            ids.push(id);
        }
        slots.push(ids);
    }
    if let Some(t) = used_ties.iter().position(|u| !u) {
        return Err(StageError::Model(format!(
            "tie {} -> {}: the model has no parameter {}",
            tied[t].param, tied[t].to, tied[t].param
        )));
    }
    Ok((table, slots))
}

/// A 64-bit FNV-1a digest of `params`' exact bits (shapes included), in layer order: what
/// runs print so that two runs' final weights can be compared bit for bit without saving
/// them. Host tensors only; a device tensor counts as its shape alone.
pub fn params_digest(params: &Params) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(PRIME);
        }
    };
    for t in params.iter().flatten() {
        for &d in t.shape() {
            eat(&(d as u64).to_le_bytes());
        }
        if let Ok(values) = t.host() {
            for v in values {
                eat(&v.to_bits().to_le_bytes());
            }
        }
    }
    h
}
