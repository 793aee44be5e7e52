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

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use pipe_kernels::Tensor;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::error::{Result, StageError};
use crate::layers::LayerSpec;
use crate::model::{Model, ModelSpec, Params};

/// The weights file's name.
pub const WEIGHTS: &str = "model.safetensors";

/// The config's name.
pub const CONFIG: &str = "config.json";

/// The index of a sharded save (`save_pretrained(max_shard_size=...)`).
pub const INDEX: &str = "model.safetensors.index.json";

/// Largest `config.json` or index read.
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Shards one save may have.
const MAX_SHARDS: usize = 100_000;

/// Tensors GPT-2's `transformers` class keeps as buffers (the causal mask), written by some
/// saves and never weights: the only names a directory may hold that the model does not take.
const BUFFER_SUFFIXES: [&str; 2] = [".attn.bias", ".attn.masked_bias"];

/// Header bytes a safetensors file may spend per tensor it holds (names, dtypes, shapes and
/// offsets in JSON), with room to spare; and per file, besides.
const HEADER_BYTES_PER_TENSOR: u64 = 4096;
const HEADER_BYTES_PER_FILE: u64 = 1 << 20;

/// The most bytes the weight files of `layout`'s model can take over `files` files: every
/// parameter in f32 (the widest type read), GPT-2's attention buffers (a `context x context`
/// mask per block, in f32 at the widest, and a scalar), and each file's header. A file past
/// it is not this model's and is refused before it is read.
fn weights_bound(model: &Model, layout: &Gpt2Layout, files: usize) -> u64 {
    let table = model.param_table();
    let elements: u64 = table
        .iter()
        .map(|e| e.shape.iter().map(|&d| d as u64).product::<u64>())
        .sum();
    let mask = (layout.context as u64).saturating_mul(layout.context as u64) + 1;
    let buffers = (layout.blocks as u64).saturating_mul(mask);
    let tensors = table.len() as u64 + 2 * layout.blocks as u64;
    elements
        .saturating_add(buffers)
        .saturating_mul(4)
        .saturating_add(HEADER_BYTES_PER_TENSOR * tensors)
        .saturating_add(HEADER_BYTES_PER_FILE * files as u64)
}

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
        padded_vocab,
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
            padded_vocab: head_padding,
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
        || *head_padding != padded_vocab
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
        rows: padded_vocab.unwrap_or(vocab),
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
    /// Rows of pipe's vocabulary tables: `vocab`, or more when padded
    /// ([`LayerSpec::LmHead`]). A directory holds `vocab` rows: export leaves the padding out
    /// and import puts it back, as zeros.
    pub rows: usize,
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

/// The GPT-2 shape a Hugging Face directory's `config.json` gives: the model's layout, as
/// [`gpt2_layout`] would give it for the model the directory holds.
///
/// # Errors
/// [`StageError::Data`] for a missing or unreadable file; [`StageError::Config`] for a
/// config pipe's GPT-2 block cannot be ([`crate::transformer::hf_gpt2_config`]).
pub fn config_of_dir(dir: &Path) -> Result<Gpt2Layout> {
    let path = dir.join(CONFIG);
    let bytes = crate::limits::read_file(&path, MAX_CONFIG_BYTES)?;
    let name = path.display().to_string();
    let (shape, tied) = crate::transformer::hf_gpt2_config(&String::from_utf8_lossy(&bytes), &name)
        .map_err(StageError::Config)?;
    let gpt = shape
        .resolve(None)
        .map_err(|e| StageError::Config(format!("{name}: {e}")))?;
    Ok(Gpt2Layout {
        blocks: gpt.blocks,
        width: gpt.width,
        heads: gpt.heads,
        context: gpt.context,
        vocab: shape.vocab_size.unwrap_or_default(),
        rows: shape.vocab_size.unwrap_or_default(),
        tied,
    })
}

/// Whether `hf_name` is a vocabulary table's (`[vocab, width]` in a directory, padded in the
/// model where [`Gpt2Layout::rows`] is larger).
fn is_vocabulary_table(hf_name: &str) -> bool {
    hf_name == "transformer.wte.weight" || hf_name == "lm_head.weight"
}

/// The model a Hugging Face GPT-2 directory's `config.json` describes.
///
/// # Errors
/// As [`config_of_dir`].
pub fn spec_from_dir(dir: &Path) -> Result<ModelSpec> {
    let c = config_of_dir(dir)?;
    let gpt = crate::transformer::GptShape {
        blocks: c.blocks,
        width: c.width,
        heads: c.heads,
        context: c.context,
    };
    Ok(ModelSpec::gpt(gpt, c.vocab, c.tied))
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

/// Writes `params` of `model` (built from `spec`) into `out`, an empty directory (a
/// [`crate::outputs::StagedDir`]'s, which the caller commits), as `transformers` saves it: `config.json`, and `model.safetensors` with
/// `transformers`' names, or, with `max_shard_bytes`, shards of at most that many bytes of
/// tensors each (a tensor larger than that alone in its shard, as `save_pretrained` does)
/// with their index. Returns the layout and the files written.
///
/// # Errors
/// [`StageError::Model`] for a model that is not GPT-2-shaped; [`StageError::Data`] when a
/// file cannot be written.
pub fn export(
    model: &Model,
    spec: &ModelSpec,
    params: &Params,
    out: &Path,
    max_shard_bytes: Option<u64>,
) -> Result<(Gpt2Layout, Vec<PathBuf>)> {
    let layout = layout_of(model, spec)?;
    // A padded vocabulary's tables lose their padding: a copy of their first rows.
    let mut unpadded: HashMap<String, Tensor> = HashMap::new();
    for e in model.param_table() {
        let name = layout.hf_name(&e.name).unwrap_or_default();
        if layout.rows > layout.vocab && is_vocabulary_table(&name) {
            let (l, s) = e.uses[0];
            let t = &params[l][s];
            let rows = t
                .host()?
                .get(..layout.vocab * layout.width)
                .unwrap_or_default();
            let kept = Tensor::from_vec(&[layout.vocab, layout.width], rows.to_vec())?;
            unpadded.insert(name, kept);
        }
    }
    let mut named: Vec<(String, &Tensor)> = Vec::new();
    for e in model.param_table() {
        let (l, s) = e.uses[0];
        let name = layout.hf_name(&e.name).unwrap_or_default();
        let t = unpadded.get(&name).unwrap_or(&params[l][s]);
        named.push((name, t));
    }
    let sizes: Vec<u64> = named.iter().map(|(_, t)| 4 * t.len() as u64).collect();
    let shards = shard_plan(&sizes, max_shard_bytes);
    let mut written = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (k, range) in shards.iter().enumerate() {
        let file = if shards.len() == 1 {
            WEIGHTS.to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", k + 1, shards.len())
        };
        for (n, _) in &named[range.clone()] {
            weight_map.insert(n.clone(), file.clone());
        }
        // Streamed from the tensors: no copy of the model is held while it is written.
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        let path = out.join(&file);
        super::tensor_file::write(&path, &named[range.clone()], meta)
            .map_err(|e| hf_err(path.display(), format!("cannot write: {e}")))?;
        written.push(path);
    }
    let mut write = |name: &str, data: &[u8]| {
        let path = out.join(name);
        std::fs::write(&path, data)
            .map_err(|e| hf_err(path.display(), format!("cannot write: {e}")))?;
        written.push(path);
        Ok::<(), StageError>(())
    };
    if shards.len() > 1 {
        let total: u64 = sizes.iter().sum();
        let index = serde_json::json!({
            "metadata": { "total_size": total },
            "weight_map": weight_map,
        });
        let text = serde_json::to_vec_pretty(&index).map_err(|e| hf_err(INDEX, e.to_string()))?;
        write(INDEX, &text)?;
    }
    let config = serde_json::to_vec_pretty(&layout.config_json())
        .map_err(|e| hf_err(CONFIG, e.to_string()))?;
    write(CONFIG, &config)?;
    Ok((layout, written))
}

/// The tensors of each shard, in order: consecutive runs of at most `max` bytes each (one
/// tensor alone where it is larger), or one shard of all without a limit.
fn shard_plan(sizes: &[u64], max: Option<u64>) -> Vec<std::ops::Range<usize>> {
    let Some(max) = max else {
        return std::iter::once(0..sizes.len()).collect();
    };
    let mut shards = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, &size) in sizes.iter().enumerate() {
        if i > start && bytes + size > max {
            shards.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    shards.push(start..sizes.len());
    shards
}

/// The safetensors files of a Hugging Face directory: `model.safetensors`, or the shards its
/// index names (each once, in the index's order), with the index's map from tensor to file.
fn weight_files(dir: &Path) -> Result<(Vec<PathBuf>, Option<WeightMap>)> {
    let single = dir.join(WEIGHTS);
    let index = dir.join(INDEX);
    if single.exists() || !index.exists() {
        return Ok((vec![single], None));
    }
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: WeightMap,
    }
    let bytes = crate::limits::read_file(&index, MAX_CONFIG_BYTES)?;
    let parsed: Index = serde_json::from_slice(&bytes)
        .map_err(|e| hf_err(index.display(), format!("not a safetensors index: {e}")))?;
    let mut files: Vec<String> = Vec::new();
    let mut seen: std::collections::HashSet<&str> = std::collections::HashSet::new();
    for file in parsed.weight_map.values() {
        let plain = !file.is_empty()
            && file.ends_with(".safetensors")
            && !file.contains(['/', '\\'])
            && !file.starts_with('.');
        if !plain {
            return Err(hf_err(
                index.display(),
                format!("names shard {file:?}, which is not a .safetensors file beside it"),
            ));
        }
        if seen.insert(file.as_str()) {
            if files.len() == MAX_SHARDS {
                return Err(hf_err(
                    index.display(),
                    format!("names more than {MAX_SHARDS} shards"),
                ));
            }
            files.push(file.clone());
        }
    }
    let paths = files.iter().map(|f| dir.join(f)).collect();
    Ok((paths, Some(parsed.weight_map)))
}

/// An index's map from tensor name to shard file.
type WeightMap = BTreeMap<String, String>;

/// Whether `name` is one of GPT-2's attention buffers, which are not weights.
fn is_buffer(name: &str) -> bool {
    name.starts_with("transformer.h.") && BUFFER_SUFFIXES.iter().any(|s| name.ends_with(s))
}

/// Refuses a directory whose `config.json` describes another model than `layout`, naming
/// the first field that differs.
fn check_config(dir: &Path, layout: &Gpt2Layout) -> Result<()> {
    let given = config_of_dir(dir)?;
    let fields = [
        ("n_layer", given.blocks, layout.blocks),
        ("n_head", given.heads, layout.heads),
        ("n_embd", given.width, layout.width),
        ("n_positions", given.context, layout.context),
        ("vocab_size", given.vocab, layout.vocab),
        (
            "tie_word_embeddings",
            usize::from(given.tied),
            usize::from(layout.tied),
        ),
    ];
    for (field, got, want) in fields {
        if got != want {
            let shown = |v: usize| match field {
                "tie_word_embeddings" => (v == 1).to_string(),
                _ => v.to_string(),
            };
            return Err(StageError::Config(format!(
                "{}: {field} is {}, but the model this run builds has {}",
                dir.join(CONFIG).display(),
                shown(got),
                shown(want)
            )));
        }
    }
    Ok(())
}

/// Reads the weights of `model` (built from `spec`) from a Hugging Face directory: its
/// `config.json` must describe this model, and its `model.safetensors` (or the shards of
/// `model.safetensors.index.json`) must hold every parameter, of its shape, in f32, f16 or
/// bf16, finite, and nothing else but GPT-2's attention buffers. Names are read with or
/// without the `transformer.` prefix; every use of a tied parameter gets the same tensor, and
/// a tied model takes an `lm_head.weight` only where it equals the token embedding.
///
/// # Errors
/// [`StageError::Model`] for a model that is not GPT-2-shaped; [`StageError::Config`] for a
/// config that describes another model; [`StageError::Data`] naming the file and tensor for
/// a missing file, a missing or unknown tensor, or one of another shape or type, or holding a
/// value that is not finite; [`StageError::Limit`] for files past the size limit.
pub fn import(model: &Model, spec: &ModelSpec, dir: &Path) -> Result<Params> {
    let layout = layout_of(model, spec)?;
    check_config(dir, &layout)?;
    let (files, index) = weight_files(dir)?;
    // Every tensor of every file, under its full name, with the file it came from.
    let mut found: BTreeMap<String, (Tensor, PathBuf)> = BTreeMap::new();
    // The index's entries no shard has been seen to hold yet.
    let mut unplaced: std::collections::BTreeSet<&String> =
        index.iter().flat_map(BTreeMap::keys).collect();
    let mut budget = weights_bound(model, &layout, files.len());
    let expected = expected_tensors(model, &layout);
    for path in &files {
        let bytes = read_shard(path, budget, &expected)?;
        budget -= bytes.len() as u64;
        for (name, full, t) in read_weights(&bytes, &path.display().to_string())? {
            if let Some(map) = &index {
                let key = map
                    .get_key_value(&name)
                    .or_else(|| map.get_key_value(&full));
                let listed = key.map(|(k, file)| {
                    unplaced.remove(k);
                    file
                });
                let here = path.file_name().map(|f| f.to_string_lossy().into_owned());
                if listed.map(String::as_str) != here.as_deref() {
                    return Err(hf_err(
                        path.display(),
                        format!("holds {name}, which the index does not place in this shard"),
                    ));
                }
            }
            if found.insert(full.clone(), (t, path.clone())).is_some() {
                return Err(hf_err(
                    path.display(),
                    format!("holds {full} a second time"),
                ));
            }
        }
    }
    // An index that places a tensor in a shard that does not hold it describes other files
    // (GPT-2's attention buffers, which are read past, apart).
    if let Some(name) = unplaced
        .iter()
        .find(|n| !is_buffer(n) && !is_buffer(&format!("transformer.{n}")))
    {
        let shard = index
            .as_ref()
            .and_then(|m| m.get(*name))
            .map_or("", String::as_str);
        return Err(hf_err(
            dir.join(INDEX).display(),
            format!("places {name} in {shard}, which does not hold it"),
        ));
    }
    // Every parameter is in the files before anything the model's size decides is allocated:
    // the files, read above within their bound, then bound it (a config.json can describe a
    // model of any depth; its weights hold what they hold).
    let table = model.param_table();
    let hf_names: Vec<String> = table
        .iter()
        .map(|e| layout.hf_name(&e.name).unwrap_or_default())
        .collect();
    if let Some((e, name)) = table
        .iter()
        .zip(&hf_names)
        .find(|(_, name)| !found.contains_key(*name))
    {
        return Err(hf_err(
            dir.display(),
            format!("has no {name} (for {})", e.name),
        ));
    }
    let mut params = model.init_params(0);
    for (e, name) in table.iter().zip(&hf_names) {
        // Present (above), and of the model's shape: the header was checked ([`read_shard`]).
        let (t, _) = found.remove(name).ok_or_else(|| {
            hf_err(
                dir.display(),
                format!("names {name} twice (for {})", e.name),
            )
        })?;
        let t = if is_vocabulary_table(name) {
            padded_rows(t, layout.rows)?
        } else {
            t
        };
        for &(l, s) in &e.uses {
            params[l][s] = t.clone();
        }
    }
    if layout.tied {
        if let Some((head, path)) = found.remove("lm_head.weight") {
            let wte = found_wte(model, &layout, &params)?;
            if head.host()? != wte.get(..head.len()).unwrap_or_default() {
                return Err(hf_err(
                    path.display(),
                    "holds an lm_head.weight that differs from transformer.wte.weight: an \
                     untied head, which this model (tied) would drop; train an untied model \
                     (--tie-embeddings false) to load it",
                ));
            }
        }
    }
    // Nothing is left in `found`: each file's header named only the model's tensors
    // ([`read_shard`]), each once.
    Ok(params)
}

/// The shape of every tensor a Hugging Face directory may hold for the model, by its full
/// `transformers` name: each parameter's, and a tied model's `lm_head.weight` (the token
/// embedding's shape). GPT-2's attention buffers are not listed: they are skipped.
fn expected_tensors(model: &Model, layout: &Gpt2Layout) -> HashMap<String, Vec<usize>> {
    let mut shapes: HashMap<String, Vec<usize>> = model
        .param_table()
        .iter()
        .filter_map(|e| Some((layout.hf_name(&e.name)?, e.shape.clone())))
        .collect();
    for (name, shape) in &mut shapes {
        if is_vocabulary_table(name) {
            shape[0] = layout.vocab;
        }
    }
    if layout.tied {
        if let Some(wte) = shapes.get("transformer.wte.weight").cloned() {
            shapes.insert("lm_head.weight".into(), wte);
        }
    }
    shapes
}

/// `table` (`[vocab, width]`) with zero rows after its own up to `rows`.
fn padded_rows(table: Tensor, rows: usize) -> Result<Tensor> {
    if table.rows() >= rows {
        return Ok(table);
    }
    let width = table.cols();
    let mut values = table.into_host_vec()?;
    values.resize(rows * width, 0.0);
    Ok(Tensor::from_vec(&[rows, width], values)?)
}

/// The bytes of the safetensors file `path`, read header first: its size is compared with
/// `budget` (what is left of the model's bound), then its header alone is read, bounded by the
/// tensors the model has, and every tensor it lists is checked against `expected` (name,
/// shape and type) and the data it describes against the file's size, before a byte of the
/// data is read. A shard of another model, or one whose header and size disagree, is
/// refused after reading a few kilobytes, however large it is.
///
/// # Errors
/// [`StageError::Limit`] for a file past `budget`; [`StageError::Data`] naming the file and
/// what its header holds that the model does not.
fn read_shard(path: &Path, budget: u64, expected: &HashMap<String, Vec<usize>>) -> Result<Vec<u8>> {
    use std::io::{Read as _, Seek as _};
    let name = path.display();
    let (mut file, len) = crate::limits::open_file(path, budget)?;
    let io = |e: std::io::Error| hf_err(&name, format!("cannot read: {e}"));
    let mut n = [0u8; 8];
    file.read_exact(&mut n).map_err(|_| {
        hf_err(
            &name,
            "not a safetensors file: shorter than its 8-byte header length",
        )
    })?;
    let header_len = u64::from_le_bytes(n);
    // Buffers are listed besides parameters: room for as many again.
    let max_header = HEADER_BYTES_PER_TENSOR * 2 * expected.len() as u64 + HEADER_BYTES_PER_FILE;
    if header_len > max_header || header_len > len - 8 {
        return Err(hf_err(
            &name,
            format!(
                "not a safetensors file of this model: its header would be {header_len} bytes \
                 (the file holds {len}; this model's headers take at most {max_header})"
            ),
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io)?;
    let meta: safetensors::tensor::Metadata = serde_json::from_slice(&header)
        .map_err(|e| hf_err(&name, format!("not a safetensors file: its header: {e}")))?;
    let data = 8 + header_len + meta.data_len() as u64;
    if data != len {
        return Err(hf_err(
            &name,
            format!(
                "not a whole safetensors file: its header describes {data} bytes, the file \
                 holds {len} (truncated or padded)"
            ),
        ));
    }
    let mut listed: Vec<_> = meta
        .tensors()
        .into_iter()
        .map(|(tensor, info)| (full_name(&tensor), info))
        .filter(|(full, _)| !is_buffer(full))
        .collect();
    listed.sort_by(|a, b| a.0.cmp(&b.0));
    let unknown: Vec<&String> = listed
        .iter()
        .map(|(full, _)| full)
        .filter(|full| !expected.contains_key(*full))
        .collect();
    if let Some(first) = unknown.first() {
        return Err(hf_err(
            &name,
            format!(
                "holds {first}{}, which the model this run builds has no place for (a \
                 different model: compare its config.json)",
                match unknown.len() {
                    1 => String::new(),
                    n => format!(" and {} more tensors", n - 1),
                }
            ),
        ));
    }
    for (tensor, info) in listed {
        let Some(shape) = expected.get(&tensor) else {
            continue;
        };
        if &info.shape != shape {
            return Err(hf_err(
                &name,
                format!("{tensor} is {:?}, the model has {shape:?}", info.shape),
            ));
        }
        if !matches!(info.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
            return Err(hf_err(
                &name,
                format!("{tensor} is {:?}; f32, f16 or bf16 are read", info.dtype),
            ));
        }
    }
    file.rewind().map_err(io)?;
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(len).read_to_end(&mut bytes).map_err(io)?;
    Ok(bytes)
}

/// The full `transformers` name of a tensor a file names with or without its
/// `transformer.` prefix.
fn full_name(tensor: &str) -> String {
    if tensor.starts_with("transformer.") || tensor == "lm_head.weight" {
        tensor.to_string()
    } else {
        format!("transformer.{tensor}")
    }
}

/// The tensors of one safetensors file's bytes (`name` for messages), as the name in the
/// file, the full `transformers` name (with its `transformer.` prefix), and the values in
/// f32; GPT-2's attention buffers left out. Every tensor must be f32, f16 or bf16 and finite;
/// the header's offsets and shapes are checked against the bytes by the safetensors crate
/// before any value is read.
///
/// # Errors
/// [`StageError::Data`] naming the file and the tensor.
pub fn read_weights(bytes: &[u8], name: &str) -> Result<Vec<(String, String, Tensor)>> {
    let file = SafeTensors::deserialize(bytes)
        .map_err(|e| hf_err(name, format!("not a safetensors file: {e}")))?;
    let mut out = Vec::new();
    for (tensor, view) in file.tensors() {
        let full = full_name(&tensor);
        if is_buffer(&full) {
            continue;
        }
        let t = tensor_of(&view, &tensor, name)?;
        out.push((tensor, full, t));
    }
    Ok(out)
}

/// The token embedding's values as imported.
fn found_wte(model: &Model, layout: &Gpt2Layout, params: &Params) -> Result<Vec<f32>> {
    for e in model.param_table() {
        if layout.hf_name(&e.name).as_deref() == Some("transformer.wte.weight") {
            let (l, s) = e.uses[0];
            return Ok(params[l][s].host()?.to_vec());
        }
    }
    Err(StageError::Model("the model has no token embedding".into()))
}

/// An f32 tensor from a view in f32, f16 or bf16, every value finite.
fn tensor_of(view: &TensorView<'_>, name: &str, path: &str) -> Result<Tensor> {
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
                path,
                format!("{name} is {other:?}; f32, f16 or bf16 are read"),
            ));
        }
    };
    if let Some(at) = values.iter().position(|v| !v.is_finite()) {
        return Err(hf_err(
            path,
            format!(
                "{name} holds {} at element {at}: weights must be finite",
                values[at]
            ),
        ));
    }
    Ok(Tensor::from_vec(view.shape(), values)?)
}
