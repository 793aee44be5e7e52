use thiserror::Error;

/// Errors raised by tensors and backends.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum KernelError {
    /// A device buffer lent by another process cannot be copied
    /// ([`Backend::copy_lent`](crate::Backend::copy_lent)).
    #[error("lent device buffer: {detail}")]
    Lent {
        /// What is wrong with it.
        detail: String,
    },
    /// A mark read against an origin it cannot be compared with
    /// ([`DeviceMark::seconds_since`](crate::DeviceMark::seconds_since)).
    #[error("device mark: {detail}")]
    Mark {
        /// Which marks were compared.
        detail: String,
    },
    /// Operand shapes do not fit the operation.
    #[error("{op}: shape mismatch: {detail}")]
    Shape {
        /// The operation that rejected its operands.
        op: &'static str,
        /// What did not fit.
        detail: String,
    },
    /// A class label is outside `0..classes`.
    #[error("label {label} at row {row} is outside 0..{classes}")]
    Label {
        /// Row of the offending label.
        row: usize,
        /// The label.
        label: u32,
        /// Number of classes (columns of the logits).
        classes: usize,
    },
    /// A token id that is not a whole number below the vocabulary size.
    #[error("token id {value} at position {index} is not a whole number in 0..{vocab}")]
    Token {
        /// Position in the id tensor.
        index: usize,
        /// The value found.
        value: f32,
        /// Vocabulary size (rows of the embedding table).
        vocab: usize,
    },
    /// Host code asked for the elements of a tensor that a device holds.
    #[error("the tensor is held by {device}, not host memory; move it through its backend")]
    NotOnHost {
        /// Where the tensor is.
        device: crate::Device,
    },
    /// The CUDA backend was requested but this build has no CUDA support.
    #[error("built without CUDA: rebuild with `--features cuda` to use the cuda backend")]
    NotCompiledWithCuda,
    /// A precision this CPU cannot compute in: bf16x6 or bf16x3 on a CPU (or OS) without AMX
    /// tiles.
    #[error(
        "--precision {precision} needs a CPU with AMX bf16 tiles (Intel Xeon of the 4th \
         generation or later) and an OS that grants them; this one has none"
    )]
    NoTileUnit {
        /// The precision asked for.
        precision: crate::Precision,
    },
    /// The CBLAS library `PIPE_CBLAS` names cannot be used.
    #[error("PIPE_CBLAS={path}: {reason}")]
    Cblas {
        /// The path the variable gives.
        path: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// The CUDA backend cannot run here: no driver, no device, or no NVRTC.
    #[error("CUDA is not available: {reason}")]
    NoCuda {
        /// What is missing.
        reason: String,
    },
    /// A CUDA driver, cuBLAS or NVRTC call failed.
    #[error("cuda {op}: {detail}")]
    Cuda {
        /// The step that failed.
        op: &'static str,
        /// The library's error.
        detail: String,
    },
    /// An operand lives where this backend cannot compute on it (move it with `place` first).
    #[error(
        "{op}: operand is held by {found}, this backend computes on {expected}; place it first"
    )]
    WrongDevice {
        /// The operation that refused it.
        op: &'static str,
        /// Where the backend computes.
        expected: crate::Device,
        /// Where the operand is.
        found: crate::Device,
    },
    /// The CPU backend could not start its worker threads.
    #[error("could not start {threads} compute threads: {reason}")]
    ThreadPool {
        /// Requested thread count.
        threads: usize,
        /// Why it failed.
        reason: String,
    },
}

impl KernelError {
    /// True when the error names something this machine or its environment lacks, which
    /// the user chose (a CUDA build or device, AMX tiles, the CBLAS library `PIPE_CBLAS`
    /// names), so a command-line front end should exit with status 2.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            KernelError::NotCompiledWithCuda
                | KernelError::NoCuda { .. }
                | KernelError::NoTileUnit { .. }
                | KernelError::Cblas { .. }
        )
    }
}

pub(crate) fn shape_err(op: &'static str, detail: impl Into<String>) -> KernelError {
    KernelError::Shape {
        op,
        detail: detail.into(),
    }
}
