//! `pipe export`: a checkpoint's weights in another tool's layout. `--format hf` writes a
//! GPT-2-shaped model as Hugging Face `transformers` loads it (`model.safetensors` with its
//! names, and `config.json`).

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, ValueEnum};
use pipe_stages::checkpoint::read_with_model;

use crate::output::bad_input;

/// Formats `pipe export` writes.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ExportFormat {
    /// Hugging Face transformers' GPT-2 (GPT2LMHeadModel.from_pretrained reads it).
    Hf,
}

/// `pipe export`.
#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A checkpoint's directory, or a checkpoint directory (its newest checkpoint).
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// The layout to write.
    #[arg(long, value_enum)]
    format: ExportFormat,
    /// The directory to write (created).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// A tokenizer.json to copy beside the weights (a corpus directory's, say), so
    /// transformers' AutoTokenizer loads with the model.
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,
    /// Write the weights in shards of at most this size, with their index, as
    /// `save_pretrained(max_shard_size=...)` does: bytes, or with a unit (500MB, 2GB, 1GiB).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    max_shard_size: Option<u64>,
}

/// A size as `transformers` writes it: bytes, or a number with KB, MB, GB (powers of 1,000)
/// or KiB, MiB, GiB (powers of 1,024).
fn parse_size(text: &str) -> std::result::Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        other => {
            return Err(format!(
                "unknown unit {other:?}: use B, KB, MB, GB, KiB, MiB or GiB"
            ));
        }
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (a whole number, then a unit: 500MB)"))?;
    match n.checked_mul(scale) {
        Some(0) => Err("a shard must hold at least one byte".into()),
        Some(v) => Ok(v),
        None => Err(format!("{text} is past 2^64 bytes")),
    }
}

/// Runs `pipe export`.
///
/// # Errors
/// Bad input for a missing or corrupted checkpoint, or a model that is not GPT-2-shaped;
/// a failure to write.
pub fn run(args: &ExportArgs) -> Result<()> {
    let (dir, model, ckpt) = read_with_model(&args.checkpoint)?;
    let ExportFormat::Hf = args.format;
    let (layout, files) = pipe_stages::hf::export(
        &model,
        &ckpt.state.model_spec,
        &ckpt.params,
        &args.out,
        args.max_shard_size,
    )?;
    if let Some(t) = &args.tokenizer {
        // Read through the tokenizer library first: a file it cannot read is refused here,
        // not found broken by the tool that loads the export.
        pipe_stages::tokenizer::TextTokenizer::from_file(t)?;
        std::fs::copy(t, args.out.join("tokenizer.json"))
            .map_err(|e| bad_input(format!("{}: cannot copy: {e}", t.display())))?;
    }
    outln!(
        "{}: GPT-2 with {} blocks, width {}, {} heads, {} positions, vocabulary {} ({}), from {} at update {}{}",
        args.out.display(),
        layout.blocks,
        layout.width,
        layout.heads,
        layout.context,
        layout.vocab,
        if layout.tied {
            "tied head"
        } else {
            "untied head"
        },
        dir.display(),
        ckpt.state.updates,
        match files.len() {
            n if n > 2 => format!(", in {} shards", n - 2),
            _ => String::new(),
        }
    );
    Ok(())
}
