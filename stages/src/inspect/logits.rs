//! A language model's logits for given token ids: what interoperability checks compare
//! against another implementation's.

use std::path::Path;

use pipe_kernels::{Backend, Tensor};

use crate::checkpoint::read_with_model;
use crate::error::{Result, StageError};
use crate::layers::LayerSpec;
use crate::model::Model;

/// Where the weights come from.
#[derive(Clone, Copy, Debug)]
pub enum WeightsSource<'a> {
    /// A checkpoint (or a directory of them: its newest).
    Checkpoint(&'a Path),
    /// A Hugging Face GPT-2 directory (config.json and model.safetensors).
    HuggingFace(&'a Path),
}

/// The logits of the model `weights` holds at each position of `ids`, one row of the
/// vocabulary's size per id, computed with `threads` compute threads (0: one per core).
///
/// # Errors
/// Bad input for unreadable weights, a model that is not a language model, ids outside the
/// vocabulary or more ids than the model's context.
pub fn logits(weights: WeightsSource<'_>, ids: &[u32], threads: usize) -> Result<Vec<Vec<f32>>> {
    let (model, spec, params) = match weights {
        WeightsSource::Checkpoint(c) => {
            let (_, model, ckpt) = read_with_model(c)?;
            (model, ckpt.state.model_spec, ckpt.params)
        }
        WeightsSource::HuggingFace(dir) => {
            let spec = crate::hf::spec_from_dir(dir)?;
            let model = Model::new(&spec)?;
            let params = crate::hf::import(&model, &spec, dir)?;
            (model, spec, params)
        }
    };
    // Only a language model takes token ids: its first layer is a token embedding.
    let Some(&LayerSpec::Embedding { vocab, context, .. }) = spec.layers.first() else {
        return Err(StageError::Input(
            "the model is not a language model (its first layer is not a token embedding), \
             so it has no logits over tokens"
                .into(),
        ));
    };
    if ids.is_empty() || ids.len() > context {
        return Err(StageError::Input(format!(
            "{} ids; the model takes 1 to {context}",
            ids.len()
        )));
    }
    if let Some((at, id)) = ids
        .iter()
        .enumerate()
        .find(|(_, id)| **id as usize >= vocab)
    {
        return Err(StageError::Input(format!(
            "--ids: id {id} (position {at}) is outside the vocabulary of {vocab} tokens"
        )));
    }
    let be = crate::limits::cpu_backend(threads)?;
    let x = Tensor::from_vec(&[1, ids.len()], ids.iter().map(|&i| i as f32).collect())?;
    let (out, _) = model.forward_range(
        &be,
        0..model.len(),
        &params,
        be.place(x)?,
        crate::layer::Keep::Nothing,
        0,
        0,
        None,
    )?;
    let columns = model.output_shape().last().copied().unwrap_or(1).max(1);
    let values = be.read(&out)?;
    // A padded vocabulary's extra columns are not tokens: each row keeps its classes.
    let rows: Vec<Vec<f32>> = values
        .chunks(columns)
        .map(|row| row[..model.output_classes().min(row.len())].to_vec())
        .collect();
    // JSON has no NaN or infinity (serde writes `null`): refused, not a row of nulls.
    crate::model::sample::check_finite_logits(&rows.concat(), vocab)?;
    Ok(rows)
}
