//! The settings of a run's launch rather than of its numerics: checkpoints, resuming,
//! restarts and rejoins, the memory override, profiling again, metrics, traces and injected
//! faults. They come from the same flags and config file as the run's
//! ([`TrainSettings`]) and are typed and checked here once, after the sources merge, so a
//! value from a config file meets the same rules as one from the command line.

use std::net::SocketAddr;
use std::path::PathBuf;

use pipe_transport::fault::FaultPlan;

use super::TrainSettings;
use crate::error::{Result, StageError};

/// Checkpoints kept when `keep_checkpoints` is not given.
pub const DEFAULT_KEEP_CHECKPOINTS: u64 = 3;

/// The most checkpoints a run keeps.
pub const MAX_KEEP_CHECKPOINTS: u64 = 10_000;

/// The most restarts a run asks for.
pub const MAX_RESTARTS: u32 = 1000;

/// A launch's settings, checked: what `pipe train` and `pipe worker` do around the run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LaunchSettings {
    /// Write the measured timeline as a Chrome trace here.
    pub trace: Option<PathBuf>,
    /// The checkpoint directory.
    pub checkpoint_dir: Option<PathBuf>,
    /// Also checkpoint every this many updates (at least 1; needs the directory).
    pub checkpoint_every: Option<u64>,
    /// Checkpoints kept, newest first (1 to [`MAX_KEEP_CHECKPOINTS`]).
    pub keep_checkpoints: u64,
    /// Write the starting point as a checkpoint and stop.
    pub seed_checkpoint: bool,
    /// Serve Prometheus metrics here.
    pub metrics_addr: Option<SocketAddr>,
    /// A checkpoint's directory, a checkpoint directory, `latest` or `auto`.
    pub resume: Option<String>,
    /// Restarts after failures (at most [`MAX_RESTARTS`]).
    pub max_restarts: u32,
    /// Take a lost replica back (in process at the next update boundary, worker processes at
    /// the next drain point).
    pub rejoin: bool,
    /// Profile again even where the cache holds a profile.
    pub reprofile: bool,
    /// Run over the memory estimate.
    pub force: bool,
    /// Plan again for the remaining workers on each restart.
    pub replan_on_restart: bool,
    /// Faults to inject into worker processes.
    pub faults: Option<FaultPlan>,
}

impl TrainSettings {
    /// The launch these settings ask for, checked: a checkpoint interval or a seed checkpoint
    /// needs a checkpoint directory, a seed checkpoint starts fresh, replanning needs
    /// restarts, and the counts are in range.
    ///
    /// # Errors
    /// [`StageError::Config`] naming the setting and what it needs.
    pub fn launch(&self) -> Result<LaunchSettings> {
        let bad = |m: String| Err(StageError::Config(m));
        let seed_checkpoint = self.seed_checkpoint.unwrap_or(false);
        if self.checkpoint_dir.is_none() {
            if self.checkpoint_every.is_some() {
                return bad("--checkpoint-every needs --checkpoint-dir <DIR>".into());
            }
            if self.keep_checkpoints.is_some() {
                return bad("--keep-checkpoints needs --checkpoint-dir <DIR>".into());
            }
            if seed_checkpoint {
                return bad(
                    "--seed-checkpoint writes into --checkpoint-dir <DIR>; give one".into(),
                );
            }
        }
        if self.checkpoint_every == Some(0) {
            return bad("--checkpoint-every must be at least 1".into());
        }
        if seed_checkpoint && self.resume.is_some() {
            return bad(
                "--seed-checkpoint starts a run afresh; it cannot be used with --resume".into(),
            );
        }
        let keep_checkpoints = self.keep_checkpoints.unwrap_or(DEFAULT_KEEP_CHECKPOINTS);
        if !(1..=MAX_KEEP_CHECKPOINTS).contains(&keep_checkpoints) {
            return bad(format!(
                "--keep-checkpoints {keep_checkpoints}: keep 1 to {MAX_KEEP_CHECKPOINTS}"
            ));
        }
        let max_restarts = self.max_restarts.unwrap_or(0);
        if max_restarts > MAX_RESTARTS {
            return bad(format!(
                "--max-restarts {max_restarts}: at most {MAX_RESTARTS} restarts"
            ));
        }
        let replan_on_restart = self.replan_on_restart.unwrap_or(false);
        if replan_on_restart && self.max_restarts.is_none() {
            return bad("--replan-on-restart plans each restart: it needs --max-restarts N".into());
        }
        let faults = self
            .fault_schedule
            .as_deref()
            .map(|text| {
                pipe_transport::fault::parse_plan(text)
                    .map_err(|e| StageError::Config(format!("--fault-schedule: {e}")))
            })
            .transpose()?;
        Ok(LaunchSettings {
            trace: self.trace.clone(),
            checkpoint_dir: self.checkpoint_dir.clone(),
            checkpoint_every: self.checkpoint_every,
            keep_checkpoints,
            seed_checkpoint,
            metrics_addr: self.metrics_addr,
            resume: self.resume.clone(),
            max_restarts,
            rejoin: self.rejoin.unwrap_or(false),
            reprofile: self.reprofile.unwrap_or(false),
            force: self.force.unwrap_or(false),
            replan_on_restart,
            faults,
        })
    }
}
