//! What an experiment leaves, as `results.json` holds it. Its own file so that the checks a
//! saved file passes read the type without importing the experiment that makes it.

use serde::{Deserialize, Serialize};

use super::config::StalenessConfig;
use super::run::RunRecord;
use crate::machine::Machine;

/// Everything an experiment run leaves: what was asked, where, and every run's record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StalenessResults {
    /// The command line that produced it.
    pub command: String,
    /// The machine.
    pub machine: Machine,
    /// Seconds since the Unix epoch when it started.
    pub started_unix: u64,
    /// Wall seconds of the whole experiment.
    pub wall_s: f64,
    /// `--quick`.
    pub quick: bool,
    /// The configuration as run (after `--quick`).
    pub config: StalenessConfig,
    /// Every run, in the order run.
    pub runs: Vec<RunRecord>,
    /// Runs kept from earlier sittings on other machines: their ids and the machine of each
    /// (their wall times are that machine's).
    #[serde(default)]
    pub kept_elsewhere: Vec<(String, Machine)>,
}
