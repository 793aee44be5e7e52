//! `pipe logits`: a language model's logits for given token ids, as JSON, from a checkpoint
//! or a Hugging Face GPT-2 directory: what interoperability checks compare against another
//! implementation's (`experiments/hf/interop.py`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use pipe_stages::inspect::{WeightsSource, logits};

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
    let weights = match (&args.checkpoint, &args.hf) {
        (Some(c), _) => WeightsSource::Checkpoint(c),
        (None, Some(dir)) => WeightsSource::HuggingFace(dir),
        (None, None) => return Err(bad_input("give --checkpoint or --hf".into())),
    };
    let rows = logits(weights, &args.ids, args.threads)?;
    outln!("{}", serde_json::to_string(&rows)?);
    Ok(())
}
