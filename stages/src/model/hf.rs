//! Weights in Hugging Face `transformers`' GPT-2 layout: `pipe export --format hf` writes a
//! GPT-2-shaped model's weights as `model.safetensors` with `transformers`' names, plus its
//! `config.json`; `--init-from` reads such a directory back into the model a run builds.
//!
//! pipe's GPT block is GPT-2's ([`crate::transformer`]) and stores its matrices as GPT-2's
//! `Conv1D` does, `[in, out]`, with the attention's packed projection in the same column
//! order (queries, keys, values; head `h` at `h C / heads` within each). So the conversion
//! renames and transposes nothing: `layers.{1 + i}.0.1.qkv.weight` is
//! `transformer.h.{i}.attn.c_attn.weight`, byte for byte. A tied head is written once, as
//! `transformer.wte.weight` (what `save_pretrained` writes for a tied GPT-2); an untied one as
//! `lm_head.weight`.

use std::collections::HashMap;
use std::path::Path;

use pipe_kernels::Tensor;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::error::{Result, StageError};
use crate::layers::LayerSpec;
use crate::model::{Model, ModelSpec, Params};

/// The weights file's name.
pub const WEIGHTS: &str = "model.safetensors";

/// The config's name.
pub const CONFIG: &str = "config.json";

/// Largest `model.safetensors` read (GPT-2 XL's f32 weights are 6.2 GB).
pub const MAX_WEIGHTS_BYTES: u64 = 16 << 30;

fn hf_err(name: impl std::fmt::Display, reason: impl Into<String>) -> StageError {
    StageError::Data {
        source_name: name.to_string(),
        reason: reason.into(),
    }
}

/// The GPT-2 shape of a model spec: blocks, width, heads, positions, vocabulary and whether
/// the head is tied; `None` when the layers are not embedding, GPT-2 blocks, a final layer
/// norm and a head.
pub fn gpt2_layout(spec: &ModelSpec) -> Option<Gpt2Layout> {
    let (first, rest) = spec.layers.split_first()?;
    let LayerSpec::Embedding {
        vocab,
        width,
        context,
    } = *first
    else {
        return None;
    };
    let [
        blocks @ ..,
        LayerSpec::LayerNorm { features, eps },
        LayerSpec::LmHead {
            width: hw,
            vocab: hv,
        },
    ] = rest
    else {
        return None;
    };
    let mut heads = None;
    for b in blocks {
        match *b {
            LayerSpec::TransformerBlock {
                width: w,
                heads: h,
                hidden,
            } if w == width && hidden.is_none_or(|x| x == 4 * width) => {
                if heads.is_some_and(|prev| prev != h) {
                    return None;
                }
                heads = Some(h);
            }
            _ => return None,
        }
    }
    let head_name = format!("layers.{}.weight", spec.layers.len() - 1);
    let tied = spec
        .tied
        .iter()
        .any(|t| t.param == head_name && t.to == "layers.0.token");
    let extra_ties = spec.tied.len() != usize::from(tied);
    if *features != width
        || (*eps - 1e-5).abs() > 1e-9
        || *hw != width
        || *hv != vocab
        || extra_ties
    {
        return None;
    }
    Some(Gpt2Layout {
        blocks: blocks.len(),
        width,
        heads: heads?,
        context,
        vocab,
        tied,
    })
}

/// A model's GPT-2 shape ([`gpt2_layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gpt2Layout {
    /// Blocks.
    pub blocks: usize,
    /// Width.
    pub width: usize,
    /// Heads.
    pub heads: usize,
    /// Positions.
    pub context: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Head tied to the token embedding.
    pub tied: bool,
}

impl Gpt2Layout {
    /// `transformers`' name of pipe parameter `name` (the model's table name), or `None`
    /// for a name outside the layout.
    pub fn hf_name(&self, name: &str) -> Option<String> {
        let rest = name.strip_prefix("layers.")?;
        let (layer, param) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let n = self.blocks;
        match (layer, param) {
            (0, "token") => Some("transformer.wte.weight".into()),
            (0, "position") => Some("transformer.wpe.weight".into()),
            (l, p) if (1..=n).contains(&l) => {
                let part = match p {
                    "0.0.weight" => "ln_1.weight",
                    "0.0.bias" => "ln_1.bias",
                    "0.1.qkv.weight" => "attn.c_attn.weight",
                    "0.1.qkv.bias" => "attn.c_attn.bias",
                    "0.1.proj.weight" => "attn.c_proj.weight",
                    "0.1.proj.bias" => "attn.c_proj.bias",
                    "1.0.weight" => "ln_2.weight",
                    "1.0.bias" => "ln_2.bias",
                    "1.1.weight" => "mlp.c_fc.weight",
                    "1.1.bias" => "mlp.c_fc.bias",
                    "1.3.weight" => "mlp.c_proj.weight",
                    "1.3.bias" => "mlp.c_proj.bias",
                    _ => return None,
                };
                Some(format!("transformer.h.{}.{part}", l - 1))
            }
            (l, "weight") if l == n + 1 => Some("transformer.ln_f.weight".into()),
            (l, "bias") if l == n + 1 => Some("transformer.ln_f.bias".into()),
            (l, "weight") if l == n + 2 => Some("lm_head.weight".into()),
            _ => None,
        }
    }

    /// The `config.json` `transformers` builds this model from.
    pub fn config_json(&self) -> serde_json::Value {
        serde_json::json!({
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "n_layer": self.blocks,
            "n_head": self.heads,
            "n_embd": self.width,
            "n_positions": self.context,
            "n_ctx": self.context,
            "vocab_size": self.vocab,
            "n_inner": null,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": self.tied,
            // The ids of the corpus's document separator are not GPT-2's 50256 (the default
            // transformers would take) unless the tokenizer is GPT-2's.
            "bos_token_id": null,
            "eos_token_id": null,
            "torch_dtype": "float32",
        })
    }
}

/// The model a Hugging Face GPT-2 directory's `config.json` describes.
///
/// # Errors
/// [`StageError::Data`] for a missing or unreadable file; [`StageError::Config`] for a
/// config pipe's GPT-2 block cannot be ([`crate::transformer::gpt2_from_hf_config`]).
pub fn spec_from_dir(dir: &Path) -> Result<ModelSpec> {
    let path = dir.join(CONFIG);
    let bytes = crate::limits::read_file(&path, 1 << 20)?;
    let name = path.display().to_string();
    let shape = crate::transformer::gpt2_from_hf_config(&String::from_utf8_lossy(&bytes), &name)
        .map_err(StageError::Config)?;
    let vocab = shape.vocab_size.unwrap_or_default();
    let gpt = shape.resolve(None).map_err(StageError::Config)?;
    Ok(ModelSpec::gpt(gpt, vocab, true))
}

/// The layout of `model`, or an error naming why it is not GPT-2's.
fn layout_of(model: &Model, spec: &ModelSpec) -> Result<Gpt2Layout> {
    let layout = gpt2_layout(spec).ok_or_else(|| {
        StageError::Model(
            "only GPT-2-shaped models (embedding, GPT blocks, a final layer norm and a head: \
             the gpt-* and gpt2* presets) have a Hugging Face layout"
                .into(),
        )
    })?;
    for e in model.param_table() {
        if layout.hf_name(&e.name).is_none() {
            return Err(StageError::Model(format!(
                "parameter {} has no place in GPT-2's layout",
                e.name
            )));
        }
    }
    Ok(layout)
}

/// Writes `params` of `model` (built from `spec`) into `out` as `model.safetensors` with
/// `transformers`' names and `config.json`; returns the layout.
///
/// # Errors
/// [`StageError::Model`] for a model that is not GPT-2-shaped; [`StageError::Data`] when a
/// file cannot be written.
pub fn export(model: &Model, spec: &ModelSpec, params: &Params, out: &Path) -> Result<Gpt2Layout> {
    let layout = layout_of(model, spec)?;
    let mut named: Vec<(String, Vec<u8>, Vec<usize>)> = Vec::new();
    for e in model.param_table() {
        let (l, s) = e.uses[0];
        let t = &params[l][s];
        let bytes: Vec<u8> = t.host()?.iter().flat_map(|v| v.to_le_bytes()).collect();
        named.push((
            layout.hf_name(&e.name).unwrap_or_default(),
            bytes,
            t.shape().to_vec(),
        ));
    }
    let views = named
        .iter()
        .map(|(n, b, shape)| {
            TensorView::new(Dtype::F32, shape.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| hf_err(n, e.to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let bytes = safetensors::tensor::serialize(views, Some(meta))
        .map_err(|e| hf_err(WEIGHTS, e.to_string()))?;
    std::fs::create_dir_all(out)
        .map_err(|e| hf_err(out.display(), format!("cannot create: {e}")))?;
    let write = |name: &str, data: &[u8]| {
        let path = out.join(name);
        std::fs::write(&path, data)
            .map_err(|e| hf_err(path.display(), format!("cannot write: {e}")))
    };
    write(WEIGHTS, &bytes)?;
    let config = serde_json::to_vec_pretty(&layout.config_json())
        .map_err(|e| hf_err(CONFIG, e.to_string()))?;
    write(CONFIG, &config)?;
    Ok(layout)
}

/// Reads the weights of `model` (built from `spec`) from a Hugging Face directory's
/// `model.safetensors` (names with or without the `transformer.` prefix, f32, f16 or bf16),
/// every use of a tied parameter given the same tensor.
///
/// # Errors
/// [`StageError::Model`] for a model that is not GPT-2-shaped; [`StageError::Data`] naming
/// the file and tensor for a missing file, a missing tensor, or one of another shape or type.
pub fn import(model: &Model, spec: &ModelSpec, dir: &Path) -> Result<Params> {
    let layout = layout_of(model, spec)?;
    let path = dir.join(WEIGHTS);
    let bytes = crate::limits::read_file(&path, MAX_WEIGHTS_BYTES)?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| hf_err(path.display(), format!("not a safetensors file: {e}")))?;
    let mut params = model.init_params(0);
    for e in model.param_table() {
        let name = layout.hf_name(&e.name).unwrap_or_default();
        let short = name
            .strip_prefix("transformer.")
            .unwrap_or(&name)
            .to_string();
        let view = file
            .tensor(&name)
            .or_else(|_| file.tensor(&short))
            .map_err(|_| hf_err(path.display(), format!("has no {name} (for {})", e.name)))?;
        let t = tensor_of(&view, &e.shape, &name, &path)?;
        for &(l, s) in &e.uses {
            params[l][s] = t.clone();
        }
    }
    Ok(params)
}

/// An f32 tensor of `shape` from a view in f32, f16 or bf16.
fn tensor_of(view: &TensorView<'_>, shape: &[usize], name: &str, path: &Path) -> Result<Tensor> {
    if view.shape() != shape {
        return Err(hf_err(
            path.display(),
            format!("{name} is {:?}, the model has {shape:?}", view.shape()),
        ));
    }
    let data = view.data();
    let values: Vec<f32> = match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(hf_err(
                path.display(),
                format!("{name} is {other:?}; f32, f16 or bf16 are read"),
            ));
        }
    };
    Ok(Tensor::from_vec(shape, values)?)
}
