//! `pipe sample`: text from a language model's checkpoint. A character model's checkpoint
//! carries its vocabulary, so nothing else is needed; a model trained on a tokenized corpus
//! takes the corpus's tokenizer (`--tokenizer`), checked against the checkpoint where the
//! corpus directory is given.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use pipe_stages::checkpoint::read_with_model;
use pipe_stages::inspect::codec_for;
use pipe_stages::sample::{SampleOptions, generate};

/// `pipe sample`.
#[derive(Args, Debug)]
pub struct SampleArgs {
    /// A checkpoint's directory, or a checkpoint directory (its newest checkpoint).
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// The tokenizer of a model trained on a tokenized corpus: the corpus's directory (its
    /// manifest must be the one the checkpoint trained on), a `tokenizer.json`, or a directory
    /// holding one (what `pipe export --format hf --tokenizer` writes).
    #[arg(long, value_name = "DIR|FILE")]
    tokenizer: Option<PathBuf>,
    /// Text the generated tokens follow.
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Tokens to generate (characters, for a character model).
    #[arg(long, default_value_t = 500)]
    tokens: usize,
    /// Softmax temperature (0: always the most likely token).
    #[arg(long, default_value_t = 0.8, value_parser = pipe_stages::config::parse_f32)]
    temperature: f32,
    /// Draw only among the K most likely tokens.
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    /// Seed of the draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Compute threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

/// Runs `pipe sample`: prints the prompt followed by the generated text.
///
/// # Errors
/// Bad input for a missing or corrupted checkpoint, a checkpoint of a model without a
/// vocabulary or tokenizer, a tokenizer of another corpus or vocabulary size, a prompt the
/// vocabulary cannot encode, or bad sampling options.
pub fn run(args: &SampleArgs) -> Result<()> {
    let (dir, model, ckpt) = read_with_model(&args.checkpoint)?;
    let outputs = model.output_classes();
    let codec = codec_for(&dir, &ckpt.state, outputs, args.tokenizer.as_deref())?;
    let prompt = codec.encode(&args.prompt, "--prompt")?;
    let opts = SampleOptions {
        tokens: args.tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
    };
    let be = pipe_stages::limits::cpu_backend(args.threads)?;
    let ids = generate(&be, &model, &ckpt.params, &prompt, &opts)?;
    outln!("{}", codec.decode(&args.prompt, &prompt, &ids));
    Ok(())
}
