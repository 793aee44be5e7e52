//! `pipe tokenize`: text files to token shards that `pipe train --dataset tokens:DIR`
//! streams from disk, and `--check`, which reads a corpus whole ahead of a run.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use pipe_stages::shards::{DEFAULT_SHARD_TOKENS, ShardWriter, TokenCorpus};
use pipe_stages::tokenize::{char_vocab, input_files, tokenize_files};
use pipe_stages::tokenizer::{TextTokenizer, TokenizerChoice};

use crate::output::bad_input;

/// `pipe tokenize`.
#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// bytes (one token per byte), chars (one per distinct character of the input), or the
    /// path of a Hugging Face tokenizer.json (GPT-2's byte-level BPE, say).
    #[arg(long, required_unless_present = "check")]
    tokenizer: Option<TokenizerChoice>,
    /// A text file, or a directory whose files (all of them, in path order, hidden ones
    /// skipped) are the documents.
    #[arg(long, value_name = "FILE|DIR", required_unless_present = "check")]
    input: Option<PathBuf>,
    /// The corpus directory to write (it must not hold a corpus yet).
    #[arg(long, value_name = "DIR", required_unless_present = "check")]
    out: Option<PathBuf>,
    /// Tokens per shard file.
    #[arg(long, default_value_t = DEFAULT_SHARD_TOKENS)]
    shard_tokens: u64,
    /// Read the corpus in DIR whole instead: every shard's header against the manifest and
    /// every id against the vocabulary.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["tokenizer", "input", "out"])]
    check: Option<PathBuf>,
}

/// A progress bar over `total` units, drawn only on a terminal.
fn bar(total: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(
        Some(total),
        indicatif::ProgressDrawTarget::stderr_with_hz(4),
    );
    if let Ok(style) = ProgressStyle::with_template(&format!(
        "{what} {{bar:40}} {{percent:>3}}% {{binary_bytes_per_sec}} eta {{eta}}"
    )) {
        bar.set_style(style);
    }
    bar
}

/// Runs `pipe tokenize`.
///
/// # Errors
/// Bad input (exit 2) for a missing or unreadable input, text that is not UTF-8, an
/// unreadable tokenizer, an output directory that already holds a corpus, or (with
/// `--check`) a corpus whose shards are malformed; each names the file and byte.
pub fn run(args: &TokenizeArgs) -> Result<()> {
    if let Some(dir) = &args.check {
        return check(dir);
    }
    let (Some(choice), Some(input), Some(out)) = (&args.tokenizer, &args.input, &args.out) else {
        return Err(bad_input(
            "pipe tokenize needs --tokenizer, --input and --out (or --check DIR)".into(),
        ));
    };
    let started = Instant::now();
    let files = input_files(input)?;
    let bytes: u64 = files.iter().map(|(_, n)| n).sum();
    let tokenizer = match choice {
        TokenizerChoice::Bytes => TextTokenizer::bytes(),
        TokenizerChoice::File(path) => TextTokenizer::from_file(path)?,
        TokenizerChoice::Chars => {
            let bar = bar(bytes, "vocabulary");
            let vocab = char_vocab(&files, &|done| bar.set_position(done))?;
            bar.finish_and_clear();
            TextTokenizer::chars(vocab)?
        }
    };
    let mut writer = ShardWriter::create(out, &tokenizer, args.shard_tokens)?;
    let bar = bar(bytes, "tokenizing");
    tokenize_files(&files, &tokenizer, &mut writer, &|done| {
        bar.set_position(done)
    })?;
    bar.finish_and_clear();
    let manifest = writer.finish()?;
    let secs = started.elapsed().as_secs_f64();
    outln!(
        "{}: {} tokens, {} {} ({} bytes), {} {}, vocabulary {}, {:.1} s ({:.2} MB/s)",
        out.display(),
        manifest.tokens,
        manifest.documents,
        if manifest.documents == 1 {
            "document"
        } else {
            "documents"
        },
        bytes,
        manifest.shards.len(),
        if manifest.shards.len() == 1 {
            "shard"
        } else {
            "shards"
        },
        manifest.tokenizer.vocab_size,
        secs,
        bytes as f64 / secs.max(1e-9) / 1e6
    );
    Ok(())
}

/// `pipe tokenize --check DIR`.
fn check(dir: &std::path::Path) -> Result<()> {
    let corpus = TokenCorpus::open(dir)?;
    corpus.tokenizer()?;
    let total = corpus.manifest().tokens;
    let bar = bar(total, "checking");
    corpus.check_all(&|done| bar.set_position(done))?;
    bar.finish_and_clear();
    outln!(
        "{}: {} tokens in {} shards, every id below {}",
        dir.display(),
        total,
        corpus.manifest().shards.len(),
        corpus.manifest().tokenizer.vocab_size
    );
    Ok(())
}
