//! Run logs: JSON lines, one object per optimizer step, per epoch, per validation pass
//! between epochs and per worker seen lost, each tagged with `"kind"`, so a log can be read back with any JSON tool;
//! each line is flushed as it is written (`docs/training.md` has the schema).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::{Result, StageError};
use crate::pipeline::Observer;
use crate::train::{EpochStats, EvalStats, LostStats, StepStats};

/// Writes steps and epochs as JSON lines.
#[derive(Debug)]
pub struct JsonlLog {
    path: PathBuf,
    out: BufWriter<File>,
}

#[derive(Serialize)]
struct Tagged<'a, T: Serialize> {
    kind: &'static str,
    #[serde(flatten)]
    body: &'a T,
}

impl JsonlLog {
    /// Creates (truncates) the log file.
    ///
    /// # Errors
    /// Bad input for a path that is not a regular file (a FIFO would block the run);
    /// [`StageError::Io`] when the file cannot be created.
    pub fn create(path: &Path) -> Result<Self> {
        crate::outputs::check_output(path)?;
        let f = File::create(path).map_err(|source| StageError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            out: BufWriter::new(f),
        })
    }

    fn write<T: Serialize>(&mut self, kind: &'static str, body: &T) -> Result<()> {
        let io = |source| StageError::Io {
            path: self.path.display().to_string(),
            source,
        };
        let line = serde_json::to_string(&Tagged { kind, body })
            .map_err(|e| io(std::io::Error::other(e)))?;
        // Flushed line by line, so `tail -f` sees every update as it happens.
        writeln!(self.out, "{line}")
            .and_then(|()| self.out.flush())
            .map_err(io)
    }
}

impl Observer for JsonlLog {
    fn on_step(&mut self, s: &StepStats) -> Result<()> {
        self.write("step", s)
    }
    fn on_epoch(&mut self, e: &EpochStats) -> Result<()> {
        self.write("epoch", e)
    }
    fn on_eval(&mut self, e: &EvalStats) -> Result<()> {
        self.write("eval", e)
    }
    fn on_phase(&mut self, record: &crate::pipeline::PhaseRecord) -> Result<()> {
        self.write("phase", record)
    }
    fn on_lost(&mut self, lost: &LostStats) -> Result<()> {
        self.write("lost", lost)
    }
    fn on_recovery(&mut self, phase: &crate::train::RecoveryStats) -> Result<()> {
        self.write("recovery", phase)
    }
}
