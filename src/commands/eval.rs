//! `pipe eval`: test loss and accuracy of a checkpoint's weights. The checkpoint says which
//! model and dataset it was trained on; `--dataset` and `--data-dir` evaluate on others.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use pipe_kernels::CpuBackend;
use pipe_stages::checkpoint::read_with_model;
use pipe_stages::config::{DEFAULT_EVAL_WINDOWS, DatasetKind, RunConfig};
use pipe_stages::data::{mnist, synthetic, tinyshakespeare, token_corpus};
use pipe_stages::model::params_digest;
use pipe_stages::shards::Holdout;
use pipe_stages::train::evaluate;

use crate::output::bad_input;

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
    let (dir, model, ckpt) = read_with_model(&args.checkpoint)?;
    let state = &ckpt.state;
    let (dataset, data_dir) =
        crate::args::dataset_and_dir(args.dataset.as_ref(), args.data_dir.as_deref())?;
    let dataset = dataset.unwrap_or(state.dataset);
    let context = model.input_shape().first().copied().unwrap_or(1);
    // A run on packed documents is evaluated on packed documents.
    let mut pack = None;
    let data = match dataset {
        DatasetKind::Mnist => mnist(data_dir.as_deref())?,
        DatasetKind::Synthetic => synthetic(&state.synthetic, state.seed)?,
        DatasetKind::TinyShakespeare => tinyshakespeare(data_dir.as_deref(), context)?,
        DatasetKind::Tokens => {
            let dir = data_dir.ok_or_else(|| {
                bad_input("a tokenized corpus needs its directory: --dataset tokens:DIR".into())
            })?;
            // The run's own holdout when the checkpoint records it.
            let corpus = RunConfig::from_json(&state.settings, "state.json")
                .ok()
                .and_then(|c| c.corpus);
            let (holdout, windows) = corpus
                .as_ref()
                .map_or((Holdout::default(), DEFAULT_EVAL_WINDOWS), |c| {
                    (c.holdout, c.eval_windows)
                });
            pack = corpus.and_then(|c| c.pack_documents);
            token_corpus(&dir, context, holdout, windows, pack)?
        }
    };
    let model = model.with_documents(pack);
    if data.vocab.is_some() && data.vocab != state.vocab {
        return Err(bad_input(format!(
            "{}'s vocabulary differs from the checkpoint's",
            data.test.name
        )));
    }
    let inputs: usize = model.input_shape().iter().product();
    let outputs: usize = model.output_shape().last().copied().unwrap_or(0);
    if inputs != data.test.sample_size() || outputs != data.test.classes {
        return Err(bad_input(format!(
            "model {} takes {inputs} features and has {outputs} outputs; {} has {} and {} classes",
            state.model,
            data.test.name,
            data.test.sample_size(),
            data.test.classes
        )));
    }
    let be = CpuBackend::new(args.threads)?;
    let (loss, accuracy) = evaluate(&be, &model, &ckpt.params, &data.test, 1000)?;
    outln!(
        "{} (model {}, update {}, weights {:016x}): {} ({} samples): test loss {loss:.4}, test accuracy {:.2}%",
        dir.display(),
        state.model,
        state.updates,
        params_digest(&ckpt.params),
        data.test.name,
        data.test.len(),
        100.0 * accuracy
    );
    Ok(())
}
