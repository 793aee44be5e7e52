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
    /// Opened (and so truncated) at the first update's record: a run refused before its
    /// first update (a checkpoint with nothing left to train, a bad layout found late) leaves
    /// the file as it was.
    out: Option<BufWriter<File>>,
    /// The start's phase records, held until then.
    held: Vec<String>,
}

#[derive(Serialize)]
struct Tagged<'a, T: Serialize> {
    kind: &'static str,
    #[serde(flatten)]
    body: &'a T,
}

impl JsonlLog {
    /// A log to write at `path`, checked now and created (truncated) at the first record
    /// past the start's phases: a run that stops before its first update (refused, or
    /// `--seed-checkpoint`) leaves the file untouched.
    ///
    /// # Errors
    /// Bad input for a path that is not a regular file (a FIFO would block the run) or whose
    /// directory is missing or cannot be written.
    pub fn create(path: &Path) -> Result<Self> {
        crate::outputs::check_output(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            out: None,
            held: Vec::new(),
        })
    }

    fn write<T: Serialize>(&mut self, kind: &'static str, body: &T) -> Result<()> {
        let io = |source| StageError::Io {
            path: self.path.display().to_string(),
            source,
        };
        let line = serde_json::to_string(&Tagged { kind, body })
            .map_err(|e| io(std::io::Error::other(e)))?;
        let out = match &mut self.out {
            Some(out) => out,
            None if kind == "phase" => {
                self.held.push(line);
                return Ok(());
            }
            None => {
                let mut out = BufWriter::new(File::create(&self.path).map_err(io)?);
                for held in self.held.drain(..) {
                    writeln!(out, "{held}").map_err(io)?;
                }
                self.out.insert(out)
            }
        };
        // Flushed line by line, so `tail -f` sees every update as it happens.
        writeln!(out, "{line}")
            .and_then(|()| out.flush())
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
