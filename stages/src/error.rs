use pipe_kernels::KernelError;
use thiserror::Error;

/// Errors raised while building models, reading data or training.
#[derive(Debug, Error)]
pub enum StageError {
    /// A kernel rejected its operands.
    #[error("layer {layer} ({kind}), {op}: {source}")]
    Kernel {
        /// Index of the layer in the model.
        layer: usize,
        /// Layer kind (`linear`, `relu`, ...).
        kind: &'static str,
        /// Which pass (`forward`, `backward_input`, `backward_params`).
        op: &'static str,
        /// The kernel's error.
        source: KernelError,
    },
    /// A kernel failure outside any layer (loss, optimizer).
    #[error(transparent)]
    Backend(#[from] KernelError),
    /// The model description is invalid.
    #[error("model: {0}")]
    Model(String),
    /// A data file is missing, truncated or malformed.
    #[error("data {source_name}: {reason}")]
    Data {
        /// File or dataset name.
        source_name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A configuration value is invalid.
    #[error("config: {0}")]
    Config(String),
    /// Writing a log failed.
    #[error("writing {path}: {source}")]
    Io {
        /// File being written.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Training produced a non-finite loss.
    #[error("loss became {loss} at step {step}: lower the learning rate")]
    Diverged {
        /// Optimizer step at which it happened.
        step: u64,
        /// The loss value.
        loss: f64,
    },
}

impl StageError {
    /// True when the error was caused by user input (configuration, model, data files), so a
    /// command-line front end should exit with status 2.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            StageError::Model(_) | StageError::Data { .. } | StageError::Config(_)
        )
    }
}

/// Result type of this crate.
pub type Result<T, E = StageError> = std::result::Result<T, E>;
