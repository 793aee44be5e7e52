//! `pipe eval`: test loss and accuracy of a checkpoint's weights. The checkpoint says which
//! model and dataset it was trained on; `--dataset` and `--data-dir` evaluate on others.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use pipe_stages::inspect::evaluate_checkpoint;

/// `pipe eval`.
#[derive(Args, Debug)]
pub struct EvalArgs {
    /// A checkpoint's directory, or a checkpoint directory (its newest checkpoint).
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// Dataset to evaluate on (default: the one the run trained on): mnist, synthetic,
    /// tinyshakespeare or tokens:DIR.
    #[arg(long, value_parser = crate::args::parse_dataset)]
    dataset: Option<crate::args::DatasetArg>,
    /// Directory holding MNIST IDX files (default: the copy embedded in the binary).
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Compute threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

/// Runs `pipe eval`.
///
/// # Errors
/// Bad input for a missing, corrupted or truncated checkpoint (the error names the file) or a
/// dataset the model does not fit.
pub fn run(args: &EvalArgs) -> Result<()> {
    let (dataset, data_dir) =
        crate::args::dataset_and_dir(args.dataset.as_ref(), args.data_dir.as_deref())?;
    let evaluation =
        evaluate_checkpoint(&args.checkpoint, dataset, data_dir.as_deref(), args.threads)?;
    outln!("{evaluation}");
    Ok(())
}
