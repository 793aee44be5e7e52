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
    /// The file, opened and locked when the log is made, not yet emptied; `None` once it is
    /// being written.
    held: Option<HeldFile>,
    /// Emptied and written from the first update's record on: a run refused before its
    /// first update (a checkpoint with nothing left to train, a bad layout found late) leaves
    /// the file as it was.
    out: Option<BufWriter<File>>,
    /// The start's phase records, kept until then.
    phases: Vec<String>,
}

/// A log file opened and locked, not yet written.
#[derive(Debug)]
struct HeldFile {
    file: File,
    /// This log created it (removed again if the run writes nothing).
    created: bool,
}

#[derive(Serialize)]
struct Tagged<'a, T: Serialize> {
    kind: &'static str,
    #[serde(flatten)]
    body: &'a T,
}

impl JsonlLog {
    /// A log to write at `path`, checked, opened and locked now (an exclusive `flock`, held
    /// until the log is dropped), and emptied at the first record past the start's phases: a
    /// run that stops before its first update (refused, or `--seed-checkpoint`) leaves the
    /// file as it was.
    ///
    /// # Errors
    /// Bad input for a path that is not a regular file (a FIFO would block the run), whose
    /// directory is missing or cannot be written, or that another run is writing its log to
    /// (two runs' lines in one file would interleave, and each would empty the other's).
    pub fn create(path: &Path) -> Result<Self> {
        crate::outputs::check_output(path)?;
        let held = hold_file(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            held: Some(held),
            out: None,
            phases: Vec::new(),
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
                self.phases.push(line);
                return Ok(());
            }
            None => {
                let Some(HeldFile { file, .. }) = self.held.take() else {
                    return Err(io(std::io::Error::other("the log file is closed")));
                };
                // Opened without truncating when it was locked: emptied now, as the run
                // begins to write it.
                file.set_len(0).map_err(io)?;
                let mut out = BufWriter::new(file);
                for phase in self.phases.drain(..) {
                    writeln!(out, "{phase}").map_err(io)?;
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

/// Opens `path` for writing without truncating it (creating it where it is missing) and takes
/// an exclusive, non-blocking `flock` on it.
fn hold_file(path: &Path) -> Result<HeldFile> {
    let io = |source| StageError::Io {
        path: path.display().to_string(),
        source,
    };
    // Created new where it is missing (so that a run that writes nothing removes it again);
    // opened, or created through a dangling link, otherwise.
    let open = |create_new| {
        let mut options = std::fs::OpenOptions::new();
        options.write(true);
        if create_new {
            options.create_new(true);
        } else {
            options.create(true).truncate(false);
        }
        options.open(path)
    };
    let (file, created) = match open(true) {
        Ok(file) => (file, true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            (open(false).map_err(io)?, false)
        }
        Err(e) => return Err(io(e)),
    };
    match crate::outputs::try_lock(&file) {
        Ok(true) => Ok(HeldFile { file, created }),
        Ok(false) => Err(StageError::Input(format!(
            "--log-jsonl {} is being written by another run: two runs in one log would \
             replace each other's lines; give this run its own",
            path.display()
        ))),
        Err(e) => Err(io(e)),
    }
}

impl Drop for JsonlLog {
    /// A log file this run created and never wrote is removed: a refused run leaves no
    /// empty file behind.
    fn drop(&mut self) {
        if let Some(HeldFile { created: true, .. }) = self.held {
            // Best effort: the run has ended, and an empty file left behind harms nothing.
            let _ = std::fs::remove_file(&self.path);
        }
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

#[cfg(test)]
mod tests {
    use super::JsonlLog;
    use crate::pipeline::{Observer, PhaseRecord};
    use crate::train::StepStats;

    fn step() -> StepStats {
        StepStats {
            step: 1,
            epoch: 1,
            loss: 1.0,
            lr: 0.1,
            samples: 4,
            samples_per_sec: 1.0,
            tokens_per_sec: None,
            elapsed_s: 1.0,
            steps_in_epoch: 1,
            step_in_epoch: 1,
            grad_norm: None,
        }
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("pipe-log-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_second_log_on_one_file_is_refused_and_the_first_keeps_its_lines() {
        let dir = scratch("second");
        let path = dir.join("run.jsonl");
        std::fs::write(&path, "an earlier run's line\n").unwrap();
        let mut first = JsonlLog::create(&path).unwrap();
        let e = JsonlLog::create(&path).unwrap_err();
        assert!(
            e.to_string().contains("being written by another run"),
            "{e}"
        );
        assert!(e.is_bad_input(), "{e}");
        // Nothing is emptied before the first update's record.
        let phase = PhaseRecord {
            phase: "profiling".into(),
            began_s: 0.0,
            seconds: 1.0,
            note: String::new(),
        };
        first.on_phase(&phase).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "an earlier run's line\n"
        );
        first.on_step(&step()).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 2, "{text}");
        assert!(text.lines().all(|l| l.starts_with("{\"kind\"")), "{text}");
        drop(first);
        // Released with the log, and a log dropped unwritten leaves a file it found as it was.
        drop(JsonlLog::create(&path).unwrap());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_log_file_created_and_never_written_is_removed() {
        let dir = scratch("created");
        let path = dir.join("new.jsonl");
        drop(JsonlLog::create(&path).unwrap());
        assert!(!path.exists());
        let mut log = JsonlLog::create(&path).unwrap();
        log.on_step(&step()).unwrap();
        drop(log);
        assert!(path.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
