//! `pipe sample`: text from a language model's checkpoint. The checkpoint carries the model
//! and its vocabulary, so nothing else is needed.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use pipe_kernels::CpuBackend;
use pipe_stages::checkpoint::{read, read_state};
use pipe_stages::model::Model;
use pipe_stages::sample::{SampleOptions, generate};

use crate::output::bad_input;

/// `pipe sample`.
#[derive(Args, Debug)]
pub struct SampleArgs {
    /// A checkpoint's directory, or a checkpoint directory (its newest checkpoint).
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// Text the generated characters follow.
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Characters to generate.
    #[arg(long, default_value_t = 500)]
    tokens: usize,
    /// Softmax temperature (0: always the most likely character).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Draw only among the K most likely characters.
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
/// vocabulary, a prompt character outside it, or bad sampling options.
pub fn run(args: &SampleArgs) -> Result<()> {
    let (dir, state) = read_state(&args.checkpoint)?;
    let Some(vocab) = state.vocab.clone() else {
        return Err(bad_input(format!(
            "{} holds model {}, which is not a language model (no vocabulary)",
            dir.display(),
            state.model
        )));
    };
    let model = Model::new(&state.model_spec)?;
    let (_, ckpt) = read(&dir, &model)?;
    let prompt = vocab.encode(&args.prompt, "--prompt")?;
    let opts = SampleOptions {
        tokens: args.tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
    };
    let be = CpuBackend::new(args.threads)?;
    let ids = generate(&be, &model, &ckpt.params, &prompt, &opts)?;
    outln!("{}{}", args.prompt, vocab.decode(&ids));
    Ok(())
}
