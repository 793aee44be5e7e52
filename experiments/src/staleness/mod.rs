//! The staleness experiment (`pipe experiment staleness`): how much stale weights cost each
//! pipeline policy, and what the remedies buy, next to the parameter-server picture of
//! staleness (delayed data-parallel SGD), on one runtime under one semantics.
//!
//! Shaped as three steps that meet at one file: [`config`] expands a TOML file into runs,
//! [`run`] turns each into a [`run::RunRecord`], and [`report`] renders `results.json` into
//! `REPORT.md`, SVG plots and the CSV behind each. The report never re-runs anything, so
//! `pipe report staleness --from DIR` regenerates it from saved results alone.

pub mod config;
mod delay_gap;
pub mod report;
mod results;
pub mod run;
mod saved;

use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};

pub use config::StalenessConfig;
pub use results::StalenessResults;
pub use run::RunRecord;

use crate::ExperimentError;
pub use crate::machine::Machine;

/// Runs every run of `cfg` (its `--quick` reduction when `quick`), writing ledgers under
/// `out`, and calls `progress` after each with its position, the count and its record.
///
/// An experiment is resumable run by run: each finished run's record is kept in
/// `out/runs/ID.json` with the configuration it ran under (its own optimizer's entry alone),
/// and a run whose record is there under the same configuration is not run again. So a matrix too long for one sitting is
/// run in parts: stop it (Ctrl-C, or a machine's time limit) and give the same command again.
/// `wall_s` then counts this sitting only; each run keeps its own time.
///
/// # Errors
/// Configuration and data errors; before any run, an `out` that cannot be a directory or
/// holds another command's results ([`crate::claim_results_dir`]); a run failing other than
/// by divergence; a record that cannot be written.
pub fn run_experiment(
    cfg: &StalenessConfig,
    quick: bool,
    out: &Path,
    command: &str,
    progress: &mut dyn FnMut(usize, usize, &RunRecord),
) -> Result<StalenessResults, ExperimentError> {
    let cfg = if quick { cfg.quick() } else { cfg.clone() };
    let specs = cfg.matrix()?;
    crate::claim_results_dir(out, "pipe experiment staleness", |d| load(d).map(drop))?;
    let data = run::load(&cfg)?;
    // Held to the end: a second sitting started meanwhile would run the same runs beside it.
    let _held = pipe_stages::outputs::hold_output_dir(out, "--out")?;
    let started_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let start = Instant::now();
    let mut runs = Vec::with_capacity(specs.len());
    let here = Machine::this();
    let mut kept_elsewhere = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let kept = out.join("runs").join(format!("{}.json", spec.id));
        let r = match kept_run(&kept, &cfg, spec) {
            Some((r, machine)) => {
                if machine != here {
                    kept_elsewhere.push((spec.id.clone(), machine));
                }
                r
            }
            None => {
                let r = run::run_one(&cfg, spec, &data, out)?;
                keep_run(&kept, &cfg, &r, &here)?;
                r
            }
        };
        progress(i + 1, specs.len(), &r);
        runs.push(r);
    }
    Ok(StalenessResults {
        command: command.to_string(),
        machine: here,
        kept_elsewhere,
        started_unix,
        wall_s: start.elapsed().as_secs_f64(),
        quick,
        config: cfg,
        runs,
    })
}

/// What a run's result depends on besides its spec: the configuration with its own
/// optimizer alone (another optimizer's rate, or one added to the matrix, leaves its record
/// good), and without the lists that only say which runs the matrix holds (seeds, stage
/// counts, policies, remedy variants, delays): each spec names its own, so a variant added to
/// the matrix reruns nothing else.
fn run_basis(cfg: &StalenessConfig, spec: &config::RunSpec) -> StalenessConfig {
    StalenessConfig {
        optimizers: cfg
            .optimizers
            .iter()
            .filter(|o| o.name == spec.optimizer)
            .cloned()
            .collect(),
        seeds: Vec::new(),
        stages: Vec::new(),
        policies: Vec::new(),
        remedies: config::RemedyMatrix {
            stages: 0,
            policies: Vec::new(),
            variants: Vec::new(),
        },
        delayed: config::DelayedMatrix {
            delays: Vec::new(),
            remedy_delay: String::new(),
            remedies: Vec::new(),
        },
        ..cfg.clone()
    }
}

/// A finished run as kept between sittings: what it ran under ([`run_basis`]), the machine
/// it ran on, and its record.
#[derive(Serialize, Deserialize)]
struct KeptRun {
    config: StalenessConfig,
    /// Absent in records kept before machines were noted (taken as this one).
    #[serde(default)]
    machine: Option<Machine>,
    record: RunRecord,
}

/// The record kept at `path` for `spec` and the machine it ran on, if one is there and was
/// made under `cfg` (anything else, unreadable files included, means the run is run again).
fn kept_run(
    path: &Path,
    cfg: &StalenessConfig,
    spec: &config::RunSpec,
) -> Option<(RunRecord, Machine)> {
    let text = std::fs::read_to_string(path).ok()?;
    let kept: KeptRun = serde_json::from_str(&text).ok()?;
    let machine = kept.machine.unwrap_or_else(Machine::this);
    // A record kept with the whole configuration (before `run_basis`) is read the same way.
    let basis = run_basis(&kept.config, spec) == run_basis(cfg, spec);
    (basis && kept.record.spec == *spec).then_some((kept.record, machine))
}

/// Keeps `record` at `path` (written whole, then renamed into place, so that a sitting
/// stopped while writing leaves no half record).
///
/// # Errors
/// An unwritable directory.
fn keep_run(
    path: &Path,
    cfg: &StalenessConfig,
    record: &RunRecord,
    machine: &Machine,
) -> Result<(), ExperimentError> {
    let io = |e: String| ExperimentError::Config(format!("{}: {e}", path.display()));
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io(e.to_string()))?;
    }
    let kept = KeptRun {
        config: run_basis(cfg, &record.spec),
        machine: Some(machine.clone()),
        record: record.clone(),
    };
    let text = serde_json::to_string(&kept).map_err(|e| io(e.to_string()))?;
    let partial = path.with_extension("json.partial");
    std::fs::write(&partial, text).map_err(|e| io(e.to_string()))?;
    std::fs::rename(&partial, path).map_err(|e| io(e.to_string()))
}

/// Writes `results.json` under `out`.
///
/// # Errors
/// An unwritable directory.
pub fn save(results: &StalenessResults, out: &Path) -> Result<(), ExperimentError> {
    let io = |e: String| ExperimentError::Config(format!("{}: {e}", out.display()));
    std::fs::create_dir_all(out).map_err(|e| io(e.to_string()))?;
    let text = serde_json::to_string(results).map_err(|e| io(e.to_string()))?;
    std::fs::write(out.join("results.json"), text).map_err(|e| io(e.to_string()))
}

/// Reads `results.json` from `dir` and checks its configuration and every run in it (a
/// unique id; a policy, stage count and optimizer the configuration lists; finite losses and
/// times of at least 0; shares in `[0, 1]`), so the report renders only runs that could have
/// been run.
///
/// # Errors
/// A missing or malformed file, named; a run that could not have been run, named with its
/// field.
pub fn load(dir: &Path) -> Result<StalenessResults, ExperimentError> {
    let path = dir.join("results.json");
    let text = crate::read_results_file(&path)?;
    let bad = |e: String| ExperimentError::Config(format!("{}: {e}", path.display()));
    let results: StalenessResults = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    saved::check(&results).map_err(bad)?;
    Ok(results)
}
