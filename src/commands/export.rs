//! `pipe export`: a checkpoint's weights in another tool's layout. `--format hf` writes a
//! GPT-2-shaped model as Hugging Face `transformers` loads it (`model.safetensors` with its
//! names, and `config.json`).

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, ValueEnum};
use pipe_stages::checkpoint::{is_store_entry, read_with_model};
use pipe_stages::inspect::Codec;
use pipe_stages::outputs::{Input, StagedDir, check_dir_not_in_input};

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
    #[arg(long, value_name = "SIZE", value_parser = pipe_scheduler::units::parse_shard_size)]
    max_shard_size: Option<u64>,
}

/// Runs `pipe export`.
///
/// # Errors
/// Bad input for a missing or corrupted checkpoint, or a model that is not GPT-2-shaped;
/// a failure to write.
pub fn run(args: &ExportArgs) -> Result<()> {
    let (dir, model, ckpt) = read_with_model(&args.checkpoint)?;
    let ExportFormat::Hf = args.format;
    // Every input is checked before anything is written: the tokenizer is read through the
    // tokenizer library, so a file it cannot read is refused here, not found broken by the
    // tool that loads the export; the output appears whole once every file is in.
    let tokenizer_json = match &args.tokenizer {
        // Of the model's vocabulary (and corpus), as `pipe sample` checks it: transformers
        // would load the pair and fail on the first id past the smaller of the two. The file
        // exported is the one read (a corpus or a folder names its `tokenizer.json`).
        Some(t) => match pipe_stages::inspect::codec_for(
            &dir,
            &ckpt.state,
            model.output_classes(),
            Some(t),
        )? {
            Codec::Tokenizer(tk) => {
                Some(tk.json_source().map(<[u8]>::to_vec).ok_or_else(|| {
                    bad_input(format!(
                        "--tokenizer {}: a corpus of pipe's byte or character tokenizer, which \
                     has no tokenizer.json for transformers to read",
                        t.display()
                    ))
                })?)
            }
            Codec::Chars(_) => None,
        },
        None => None,
    };
    // Never into the checkpoint it reads, nor into its store under a checkpoint's name (a
    // later run's pruning would remove it, or its next write find it in the way).
    let store = dir.parent().unwrap_or(&dir);
    let read = [
        Input::Whole("--checkpoint", &dir),
        Input::Entries("--checkpoint", store, is_store_entry),
    ];
    check_dir_not_in_input(&args.out, "--out", &read)?;
    let staged = StagedDir::claim_empty(&args.out, "export")?;
    let (layout, files) = pipe_stages::hf::export(
        &model,
        &ckpt.state.model_spec,
        &ckpt.params,
        staged.path(),
        args.max_shard_size,
    )?;
    if let Some(json) = &tokenizer_json {
        let path = staged.path().join("tokenizer.json");
        std::fs::write(&path, json)
            .map_err(|e| anyhow::anyhow!("{}: cannot write: {e}", path.display()))?;
    }
    staged.commit()?;
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
