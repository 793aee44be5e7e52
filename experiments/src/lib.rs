//! `pipe-experiments` owns experiments and benchmarks that span crates: what a user runs to get a
//! number they can trust, with the method written next to it. Each experiment is a function that
//! returns a typed report (so tests can run it small) plus a renderer; the `pipe bench`
//! subcommands only parse flags and print. Staleness studies, throughput sweeps and the
//! Markdown/SVG/CSV reports (`docs/architecture.md`, "Files") will live here too.

#![warn(missing_docs)]

pub mod mfu;
pub mod partition;
pub mod pipeline;
pub mod staleness;
pub mod transport;

/// Errors of experiments.
#[derive(Debug, thiserror::Error)]
pub enum ExperimentError {
    /// Training or model construction failed.
    #[error(transparent)]
    Stage(#[from] pipe_stages::StageError),
    /// A kernel failed.
    #[error(transparent)]
    Kernel(#[from] pipe_kernels::KernelError),
    /// A schedule could not be built or simulated.
    #[error(transparent)]
    Schedule(#[from] pipe_scheduler::ScheduleError),
    /// The experiment's parameters are invalid.
    #[error("{0}")]
    Config(String),
}

/// Median of a non-empty sample (mean of the two middle values for even sizes).
pub fn median(xs: &[f64]) -> f64 {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}
