//! A checkpoint's test loss and accuracy on the dataset it trained on, or another.

use std::path::{Path, PathBuf};

use crate::checkpoint::read_with_model;
use crate::config::{DEFAULT_EVAL_WINDOWS, DatasetKind, RunConfig};
use crate::data::{Splits, mnist, synthetic, tinyshakespeare, token_corpus};
use crate::error::{Result, StageError};
use crate::model::params_digest;
use crate::shards::Holdout;
use crate::train::evaluate;

/// A checkpoint's weights evaluated on a dataset's test split.
#[derive(Clone, Debug)]
pub struct Evaluation {
    /// The checkpoint's directory.
    pub dir: PathBuf,
    /// Its model's name.
    pub model: String,
    /// Updates it was written after.
    pub updates: u64,
    /// Its weights' digest.
    pub weights: u64,
    /// The test split's name.
    pub split: String,
    /// Samples in it.
    pub samples: usize,
    /// Mean test loss.
    pub loss: f64,
    /// Test accuracy (0 to 1).
    pub accuracy: f64,
}

impl std::fmt::Display for Evaluation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (model {}, update {}, weights {:016x}): {} ({} samples): test loss {:.4}, test accuracy {:.2}%",
            self.dir.display(),
            self.model,
            self.updates,
            self.weights,
            self.split,
            self.samples,
            self.loss,
            100.0 * self.accuracy
        )
    }
}

/// Evaluates the checkpoint at `checkpoint` (a checkpoint, or a directory of them: its
/// newest) on `dataset` (default: the one it trained on) read from `data_dir`, with
/// `threads` compute threads (0: one per core).
///
/// # Errors
/// Bad input for a missing, corrupted or truncated checkpoint, or a dataset the model does
/// not fit.
pub fn evaluate_checkpoint(
    checkpoint: &Path,
    dataset: Option<DatasetKind>,
    data_dir: Option<&Path>,
    threads: usize,
) -> Result<Evaluation> {
    let (dir, model, ckpt) = read_with_model(checkpoint)?;
    let state = &ckpt.state;
    let dataset = dataset.unwrap_or(state.dataset);
    let context = model.input_shape().first().copied().unwrap_or(1);
    // A run on packed documents is evaluated on packed documents.
    let mut pack = None;
    let data: Splits = match dataset {
        DatasetKind::Mnist => mnist(data_dir)?,
        DatasetKind::Synthetic => {
            crate::data::admit_synthetic_memory(&state.synthetic)?;
            synthetic(&state.synthetic, state.seed)?
        }
        DatasetKind::TinyShakespeare => tinyshakespeare(data_dir, context)?,
        DatasetKind::Tokens => {
            let dir = data_dir.ok_or_else(|| {
                StageError::Input(
                    "a tokenized corpus needs its directory: --dataset tokens:DIR".into(),
                )
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
            token_corpus(dir, context, holdout, windows, pack)?
        }
    };
    let model = model.with_documents(pack);
    if data.vocab.is_some() && data.vocab != state.vocab {
        return Err(StageError::Input(format!(
            "{}'s vocabulary differs from the checkpoint's",
            data.test.name
        )));
    }
    let inputs: usize = model.input_shape().iter().product();
    let outputs: usize = model.output_classes();
    if inputs != data.test.sample_size() || outputs != data.test.classes {
        return Err(StageError::Input(format!(
            "model {} takes {inputs} features and has {outputs} outputs; {} has {} and {} classes",
            state.model,
            data.test.name,
            data.test.sample_size(),
            data.test.classes
        )));
    }
    let be = crate::limits::cpu_backend(threads)?;
    let (loss, accuracy) = evaluate(&be, &model, &ckpt.params, &data.test, 1000)?;
    Ok(Evaluation {
        model: state.model.clone(),
        updates: state.updates,
        weights: params_digest(&ckpt.params),
        split: data.test.name.clone(),
        samples: data.test.len(),
        loss,
        accuracy,
        dir,
    })
}
