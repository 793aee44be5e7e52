//! `pipe sample`: text from a language model's checkpoint. A character model's checkpoint
//! carries its vocabulary, so nothing else is needed; a model trained on a tokenized corpus
//! takes the corpus's tokenizer (`--tokenizer`), checked against the checkpoint where the
//! corpus directory is given.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;
use pipe_kernels::CpuBackend;
use pipe_stages::checkpoint::{RunState, read_with_model};
use pipe_stages::sample::{SampleOptions, generate};
use pipe_stages::shards::TokenCorpus;
use pipe_stages::tokenizer::TextTokenizer;

use crate::output::bad_input;

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
    #[arg(long, default_value_t = 0.8)]
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

/// How the sampled ids become text: the checkpoint's character vocabulary, or a tokenizer.
enum Codec {
    Chars(pipe_stages::data::Vocab),
    Tokenizer(TextTokenizer),
}

impl Codec {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(match self {
            Codec::Chars(vocab) => vocab.encode(text, "--prompt")?,
            Codec::Tokenizer(tk) => tk.encode(text, "--prompt")?,
        })
    }

    /// The prompt and what followed it, as text.
    fn decode(&self, prompt_text: &str, prompt: &[u32], sampled: &[u32]) -> String {
        match self {
            Codec::Chars(vocab) => format!("{prompt_text}{}", vocab.decode(sampled)),
            // Decoded whole: a subword tokenizer may join a token across the prompt's end.
            Codec::Tokenizer(tk) => tk.decode(&[prompt, sampled].concat()),
        }
    }
}

/// The tokenizer `--tokenizer PATH` names, for a checkpoint trained on corpus `trained_on`.
fn tokenizer_at(path: &Path, trained_on: Option<&str>) -> Result<TextTokenizer> {
    if path.join(pipe_stages::shards::MANIFEST).is_file() {
        let corpus = TokenCorpus::open(path)?;
        let fingerprint = corpus.manifest().fingerprint();
        if let Some(expected) = trained_on.filter(|&f| f != fingerprint) {
            return Err(bad_input(format!(
                "--tokenizer {}: not the corpus the checkpoint trained on (its fingerprint is \
                 {fingerprint}, the checkpoint's {expected})",
                path.display()
            )));
        }
        return Ok(corpus.tokenizer()?);
    }
    let file = if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    };
    Ok(TextTokenizer::from_file(&file)?)
}

/// The codec for checkpoint `dir`: `--tokenizer` when given, else its character vocabulary.
fn codec(args: &SampleArgs, dir: &Path, state: &RunState) -> Result<Codec> {
    if let Some(path) = &args.tokenizer {
        return Ok(Codec::Tokenizer(tokenizer_at(
            path,
            state.corpus.as_deref(),
        )?));
    }
    if let Some(vocab) = &state.vocab {
        return Ok(Codec::Chars(vocab.clone()));
    }
    Err(bad_input(if state.corpus.is_some() {
        format!(
            "{} was trained on a tokenized corpus: give its tokenizer with --tokenizer (the \
             corpus's directory or a tokenizer.json)",
            dir.display()
        )
    } else {
        format!(
            "{} holds model {}, which is not a language model (no vocabulary)",
            dir.display(),
            state.model
        )
    }))
}

/// Runs `pipe sample`: prints the prompt followed by the generated text.
///
/// # Errors
/// Bad input for a missing or corrupted checkpoint, a checkpoint of a model without a
/// vocabulary or tokenizer, a tokenizer of another corpus or vocabulary size, a prompt the
/// vocabulary cannot encode, or bad sampling options.
pub fn run(args: &SampleArgs) -> Result<()> {
    let (dir, model, ckpt) = read_with_model(&args.checkpoint)?;
    let codec = codec(args, &dir, &ckpt.state)?;
    if let Codec::Tokenizer(tk) = &codec {
        let outputs = model.output_shape().last().copied().unwrap_or(0);
        if tk.vocab_size() != outputs {
            return Err(bad_input(format!(
                "--tokenizer has a vocabulary of {} tokens; the model in {} predicts {outputs}",
                tk.vocab_size(),
                dir.display()
            )));
        }
    }
    let prompt = codec.encode(&args.prompt)?;
    let opts = SampleOptions {
        tokens: args.tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
    };
    let be = CpuBackend::new(args.threads)?;
    let ids = generate(&be, &model, &ckpt.params, &prompt, &opts)?;
    outln!("{}", codec.decode(&args.prompt, &prompt, &ids));
    Ok(())
}
