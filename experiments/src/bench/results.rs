//! What a sweep leaves, as `results.json` holds it: every configuration's outcome, the
//! single workers, the link costs and the figures read from elsewhere. Its own file so that
//! the checks a saved file passes and the report read the types without
//! importing the sweep that makes them.

use serde::{Deserialize, Serialize};

use super::config::{BenchConfig, ConfigSpec, TransportName};
use super::measure::Measured;
use super::predict::Predicted;
use super::{criterion, target};
use crate::machine::Machine;
use pipe_transport::measure::LinkCost;

/// How one configuration ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Measured, with the simulator's prediction.
    Measured {
        /// The measurement.
        measured: Box<Measured>,
        /// The prediction (None when the simulator refused; the error is in `note`).
        predicted: Option<Box<Predicted>>,
        /// Model FLOP utilisation: model FLOP/s over the machine's GEMM rate on all cores.
        mfu: f64,
        /// Why there is no prediction.
        note: Option<String>,
    },
    /// The configuration cannot run (too few layers for the stages, a layout the policy
    /// refuses); the reason, as `pipe train` would print it.
    Skipped {
        /// Why.
        reason: String,
    },
    /// It failed while running.
    Failed {
        /// The error.
        error: String,
    },
    /// The sweep's time budget ran out first.
    NotRun,
}

/// One configuration's result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConfigResult {
    /// What was asked.
    pub spec: ConfigSpec,
    /// What happened.
    pub outcome: Outcome,
}

/// One model's single worker: the ordinary training step with every core ([`crate::mfu`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SingleWorker {
    /// Model.
    pub model: String,
    /// Samples per step (the sweep's microbatch times 8).
    pub batch: usize,
    /// Samples/s.
    pub samples_per_s: f64,
    /// Model FLOP utilisation.
    pub mfu: f64,
}

/// Everything a sweep leaves.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BenchResults {
    /// The command line.
    pub command: String,
    /// The machine.
    pub machine: Machine,
    /// Seconds since the Unix epoch at the start.
    pub started_unix: u64,
    /// Wall seconds of the sweep.
    pub wall_s: f64,
    /// `--quick`.
    pub quick: bool,
    /// Whether each configuration ran in a child process of its own.
    pub isolated: bool,
    /// The configuration as run.
    pub config: BenchConfig,
    /// GFLOP/s of the reference GEMM on all cores: the MFU denominator.
    pub peak_gflops: f64,
    /// Message costs per transport.
    pub links: Vec<(TransportName, LinkCost)>,
    /// Single worker per model.
    pub single: Vec<SingleWorker>,
    /// Every configuration.
    pub configs: Vec<ConfigResult>,
    /// Time to target per policy.
    pub target: Vec<target::TargetResult>,
    /// `cargo bench` results, when given.
    pub criterion: Vec<criterion::CriterionFigure>,
    /// numpy's GEMM figures, when given.
    pub numpy: Option<criterion::NumpyFigures>,
}
