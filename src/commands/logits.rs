//! `pipe logits`: a language model's logits for given token ids, as JSON, from a checkpoint
//! or a Hugging Face GPT-2 directory: what interoperability checks compare against another
//! implementation's (`experiments/hf/interop.py`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use pipe_kernels::{Backend, CpuBackend, Tensor};

use pipe_stages::checkpoint::read_with_model;
use pipe_stages::layers::LayerSpec;
use pipe_stages::model::Model;

use crate::output::bad_input;

/// `pipe logits`.
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("weights").required(true).args(["checkpoint", "hf"])))]
pub struct LogitsArgs {
    /// A checkpoint's directory, or a checkpoint directory (its newest checkpoint).
    #[arg(long, value_name = "DIR")]
    checkpoint: Option<PathBuf>,
    /// A Hugging Face GPT-2 directory (config.json and model.safetensors).
    #[arg(long, value_name = "DIR")]
    hf: Option<PathBuf>,
    /// The token ids, comma-separated (at most the model's context).
    #[arg(long, value_delimiter = ',', required = true)]
    ids: Vec<u32>,
    /// Compute threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

/// Runs `pipe logits`: prints `[[logit; vocab]; ids]` as JSON.
///
/// # Errors
/// Bad input for unreadable weights, ids outside the vocabulary or more ids than the
/// model's context.
pub fn run(args: &LogitsArgs) -> Result<()> {
    let (model, spec, params) = match (&args.checkpoint, &args.hf) {
        (Some(c), _) => {
            let (_, model, ckpt) = read_with_model(c)?;
            (model, ckpt.state.model_spec, ckpt.params)
        }
        (None, Some(dir)) => {
            let spec = pipe_stages::hf::spec_from_dir(dir)?;
            let model = Model::new(&spec)?;
            let params = pipe_stages::hf::import(&model, &spec, dir)?;
            (model, spec, params)
        }
        (None, None) => return Err(bad_input("give --checkpoint or --hf".into())),
    };
    // Only a language model takes token ids: its first layer is a token embedding.
    let Some(&LayerSpec::Embedding { vocab, context, .. }) = spec.layers.first() else {
        return Err(bad_input(
            "the model is not a language model (its first layer is not a token embedding), \
             so it has no logits over tokens"
                .into(),
        ));
    };
    if args.ids.is_empty() || args.ids.len() > context {
        return Err(bad_input(format!(
            "{} ids; the model takes 1 to {context}",
            args.ids.len()
        )));
    }
    if let Some((at, id)) = args
        .ids
        .iter()
        .enumerate()
        .find(|(_, id)| **id as usize >= vocab)
    {
        return Err(bad_input(format!(
            "--ids: id {id} (position {at}) is outside the vocabulary of {vocab} tokens"
        )));
    }
    let be = CpuBackend::new(args.threads)?;
    let x = Tensor::from_vec(
        &[1, args.ids.len()],
        args.ids.iter().map(|&i| i as f32).collect(),
    )?;
    let (logits, _) = model.forward_range(
        &be,
        0..model.len(),
        &params,
        be.place(x)?,
        pipe_stages::layer::Keep::Nothing,
        0,
        0,
        None,
    )?;
    let vocab = model.output_shape().last().copied().unwrap_or(1);
    let values = be.read(&logits)?;
    let rows: Vec<&[f32]> = values.chunks(vocab).collect();
    outln!("{}", serde_json::to_string(&rows)?);
    Ok(())
}
