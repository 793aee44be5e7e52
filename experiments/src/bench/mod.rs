//! `pipe bench`: the throughput sweep and its report (`docs/bench.md`).
//!
//! Shaped like the staleness experiment: [`config`] expands a TOML file into configurations,
//! [`measure`] runs each (in a child process of its own when the sweep is given the `pipe`
//! binary, so that every configuration's peak memory and heap are its own), [`predict`]
//! simulates each from costs profiled in the same sweep, [`target`] adds the time to a target
//! loss, [`criterion`] reads what `cargo bench` and the numpy script left, and [`report`]
//! renders `results.json` into `REPORT.md`, SVG plots, the CSV behind each and Chrome traces.
//! The report never re-runs anything: `pipe report bench --from DIR` rebuilds it.

pub mod config;
pub mod criterion;
pub mod measure;
pub mod predict;
pub mod report;
mod results;
mod saved;
pub mod target;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pipe_kernels::CpuBackend;
use pipe_stages::model::{Model, ModelSpec};
use pipe_stages::profile::{ProfileOptions, profile_model};
use pipe_transport::inproc::{InProcOptions, mesh};
use pipe_transport::quic::{QuicOptions, local_mesh};
use serde::{Deserialize, Serialize};

pub use config::BenchConfig;
use config::{ConfigSpec, TransportName};
use measure::{MeasureOptions, Measured};
use predict::{Inputs, Predicted};
pub use results::{BenchResults, ConfigResult, Outcome, SingleWorker};

use crate::ExperimentError;
use crate::machine::Machine;
use pipe_transport::measure::LinkCost;

/// How to run a sweep.
#[derive(Clone, Debug, Default)]
pub struct SweepOptions {
    /// The `pipe` binary: each configuration runs as `pipe bench measure-config` in a child
    /// process. `None`: in this process (tests).
    pub runner: Option<PathBuf>,
    /// Criterion's output directory to summarise.
    pub criterion_dir: Option<PathBuf>,
    /// numpy's figures to summarise.
    pub numpy_json: Option<PathBuf>,
    /// Where the results, the report and traces (`DIR/traces`) go; claimed before the sweep
    /// runs ([`crate::claim_results_dir`]).
    pub out: PathBuf,
    /// Print a line per configuration.
    pub verbose: bool,
}

/// What a child process prints: the measurement or why there is none.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Attempt {
    /// Measured.
    Measured(Box<Measured>),
    /// Cannot run.
    Skipped(String),
    /// Failed.
    Failed(String),
}

/// Measures `spec` in this process, sorting errors into skipped (bad input: the
/// configuration cannot run) and failed.
pub fn attempt(spec: &ConfigSpec, opts: &MeasureOptions) -> Attempt {
    match measure::measure(spec, opts) {
        Ok(m) => Attempt::Measured(Box::new(m)),
        Err(ExperimentError::Stage(e)) if e.is_bad_input() => Attempt::Skipped(e.to_string()),
        Err(ExperimentError::Schedule(e @ pipe_scheduler::ScheduleError::Spec(_))) => {
            Attempt::Skipped(e.to_string())
        }
        Err(e) => Attempt::Failed(e.to_string()),
    }
}

/// The longest a configuration may run in its child process.
const CONFIG_TIMEOUT: Duration = Duration::from_secs(600);

/// Runs `spec` as `runner bench measure-config` and reads its [`Attempt`] from stdout.
fn attempt_in_child(runner: &Path, spec: &ConfigSpec, opts: &MeasureOptions) -> Attempt {
    let json = |v: &dyn Fn() -> serde_json::Result<String>| v().unwrap_or_default();
    let mut child = match std::process::Command::new(runner)
        .args(["bench", "measure-config", "--spec"])
        .arg(json(&|| serde_json::to_string(spec)))
        .arg("--options")
        .arg(json(&|| serde_json::to_string(opts)))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => return Attempt::Failed(format!("cannot start {}: {e}", runner.display())),
    };
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if start.elapsed() > CONFIG_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Attempt::Failed(format!(
                    "did not finish within {} s",
                    CONFIG_TIMEOUT.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Attempt::Failed(format!("waiting for the child: {e}")),
        }
    }
    match child.wait_with_output() {
        Ok(out) => {
            let stdout = String::from_utf8_lossy(&out.stdout);
            serde_json::from_str(stdout.trim()).unwrap_or_else(|_| {
                let stderr = String::from_utf8_lossy(&out.stderr);
                Attempt::Failed(format!(
                    "child exited with {}: {}",
                    out.status,
                    stderr.lines().last().unwrap_or("no output")
                ))
            })
        }
        Err(e) => Attempt::Failed(format!("reading the child's output: {e}")),
    }
}

/// Message costs of `transport` between two endpoints.
fn link_cost(transport: TransportName) -> Result<LinkCost, ExperimentError> {
    match transport {
        TransportName::InProc => {
            pipe_transport::measure::measure_mesh(mesh(2, &InProcOptions::default()), 2000)
                .map_err(ExperimentError::from)
        }
        TransportName::Quic => {
            pipe_transport::measure::measure_mesh(quic_mesh(2)?, 500).map_err(ExperimentError::from)
        }
    }
}

/// Message costs of QUIC between two endpoints on loopback whose datagrams stay within
/// `max_datagram` bytes (a link's MTU less the IP and UDP headers), as on that link.
pub(crate) fn quic_link_cost(max_datagram: u16) -> Result<LinkCost, ExperimentError> {
    let opts = QuicOptions {
        max_datagram,
        ..QuicOptions::new(0x62656e6368)
    };
    let mesh =
        local_mesh(2, &opts).map_err(|e| ExperimentError::Config(format!("QUIC mesh: {e}")))?;
    pipe_transport::measure::measure_mesh(mesh, 500).map_err(ExperimentError::from)
}

fn quic_mesh(n: u32) -> Result<Vec<pipe_transport::quic::Quic>, ExperimentError> {
    local_mesh(n, &QuicOptions::new(0x62656e6368))
        .map_err(|e| ExperimentError::Config(format!("QUIC mesh: {e}")))
}

/// Seconds of an all-reduce of `values` floats among `r` workers on `transport`.
fn all_reduce_on(transport: TransportName, values: usize, r: u32) -> Result<f64, ExperimentError> {
    match transport {
        TransportName::InProc => pipe_transport::measure::all_reduce_seconds(
            mesh(r, &InProcOptions::default()),
            values,
            5,
        )
        .map_err(ExperimentError::from),
        TransportName::Quic => {
            pipe_transport::measure::all_reduce_seconds(quic_mesh(r)?, values, 5)
                .map_err(ExperimentError::from)
        }
    }
}

/// Costs measured once per sweep: links, profiles, all-reduces (memoised).
struct Shared {
    links: HashMap<TransportName, LinkCost>,
    /// Per model and number of copies calibrated at once (1 up to `[profile] concurrent`).
    profiles: HashMap<(String, usize), pipe_scheduler::Profile>,
    all_reduce: HashMap<(TransportName, usize, u32), f64>,
    cores: u32,
    max_concurrent: usize,
}

impl Shared {
    fn measure(cfg: &BenchConfig, specs: &[ConfigSpec]) -> Result<Self, ExperimentError> {
        let mut links = HashMap::new();
        for s in specs {
            if let std::collections::hash_map::Entry::Vacant(e) = links.entry(s.transport) {
                e.insert(link_cost(s.transport)?);
            }
        }
        let be = CpuBackend::new(1)?;
        let mut profiles = HashMap::new();
        for entry in &cfg.models {
            if !specs.iter().any(|s| s.model == entry.name) {
                continue;
            }
            let model = Model::new(&ModelSpec::preset(&entry.name)?)?;
            // A layer runs slower while other workers compute beside it (shared caches and
            // memory bandwidth): one profile per number of workers computing at once.
            for concurrent in 1..=cfg.profile.concurrent {
                let opts = ProfileOptions {
                    repeats: cfg.profile.repeats,
                    calibrate: Some(cfg.profile.calibrate_microbatches),
                    calibration_minibatches: cfg.profile.calibration_minibatches,
                    concurrent,
                    ..ProfileOptions::new(entry.microbatch)
                };
                let profile = profile_model(&model, &entry.name, &be, &opts)?;
                profiles.insert((entry.name.clone(), concurrent), profile);
            }
        }
        Ok(Shared {
            links,
            profiles,
            all_reduce: HashMap::new(),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()) as u32,
            max_concurrent: cfg.profile.concurrent,
        })
    }

    /// The prediction of a measured configuration (and its simulated timeline).
    fn predict(
        &mut self,
        spec: &ConfigSpec,
        m: &Measured,
        timeline: bool,
    ) -> Result<(Predicted, Option<pipe_scheduler::Timeline>), ExperimentError> {
        // As many workers compute at once as there are workers, up to the cores.
        let busy = (m.workers.min(self.cores) as usize).min(self.max_concurrent);
        let profile = self
            .profiles
            .get(&(spec.model.clone(), busy.max(1)))
            .ok_or_else(|| ExperimentError::Config(format!("no profile of {}", spec.model)))?;
        let link = *self
            .links
            .get(&spec.transport)
            .ok_or_else(|| ExperimentError::Config("no link cost".into()))?;
        let cache = &mut self.all_reduce;
        let transport = spec.transport;
        let mut all_reduce = |values: usize, r: u32| -> Result<f64, ExperimentError> {
            if let Some(&s) = cache.get(&(transport, values, r)) {
                return Ok(s);
            }
            let s = all_reduce_on(transport, values, r)?;
            cache.insert((transport, values, r), s);
            Ok(s)
        };
        let mut inputs = Inputs {
            profile,
            link,
            all_reduce: &mut all_reduce,
            cores: self.cores,
        };
        predict::predict(spec, m, &mut inputs, timeline)
    }
}

/// Single-worker figures per model used by the sweep.
fn single_workers(
    cfg: &BenchConfig,
    specs: &[ConfigSpec],
    quick: bool,
) -> Result<Vec<SingleWorker>, ExperimentError> {
    let mut out = Vec::new();
    for entry in &cfg.models {
        if !specs.iter().any(|s| s.model == entry.name) {
            continue;
        }
        let r = crate::mfu::run(&crate::mfu::MfuConfig {
            model: entry.name.clone(),
            batch: entry.microbatch * 8,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            steps: if quick { 5 } else { 20 },
            warmup: 2,
            momentum: 0.9,
            ..crate::mfu::MfuConfig::default()
        })?;
        out.push(SingleWorker {
            model: entry.name.clone(),
            batch: r.batch,
            samples_per_s: r.samples_per_s,
            mfu: r.mfu,
        });
    }
    Ok(out)
}

/// A file name for a configuration id.
pub fn file_name(id: &str) -> String {
    id.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Runs the sweep `cfg` (already reduced by `--quick` when `quick`).
///
/// # Errors
/// Failures outside a configuration (profiling, link measurement, the target runs); before
/// anything runs, unreadable criterion or numpy files and an output directory that cannot be
/// one or holds another command's results. A configuration that fails is a result, not an
/// error.
pub fn run_sweep(
    cfg: &BenchConfig,
    quick: bool,
    command: String,
    opts: &SweepOptions,
) -> Result<BenchResults, ExperimentError> {
    let start = Instant::now();
    let started_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let specs = cfg.expand()?;
    // Every input read and every output claimed before the first configuration runs.
    crate::claim_results_dir(&opts.out, "pipe bench", |d| load(d).map(drop))?;
    let traces = opts.out.join("traces");
    if !cfg.traces.is_empty() {
        pipe_stages::outputs::check_output_dir(&traces, "--out's traces")?;
    }
    let criterion = match &opts.criterion_dir {
        Some(d) => criterion::read_criterion(d)?,
        None => Vec::new(),
    };
    let numpy = match &opts.numpy_json {
        Some(p) => Some(criterion::read_numpy(p)?),
        None => None,
    };
    // Held to the end, once every input is read: a second sweep started meanwhile would
    // measure beside this one, each skewing the other's figures.
    let _held = pipe_stages::outputs::hold_output_dir(&opts.out, "--out")?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let peak_gflops = crate::mfu::gemm_rate(&CpuBackend::new(cores)?, 15)?;
    let mut shared = Shared::measure(cfg, &specs)?;
    let single = single_workers(cfg, &specs, quick)?;
    let budget = Duration::from_secs_f64(cfg.budget_minutes * 60.0);
    let mut configs = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        if start.elapsed() > budget {
            configs.push(ConfigResult {
                spec: spec.clone(),
                outcome: Outcome::NotRun,
            });
            continue;
        }
        let traced = cfg.traces.contains(&spec.id);
        if traced {
            std::fs::create_dir_all(&traces)
                .map_err(|e| ExperimentError::Config(format!("{}: {e}", traces.display())))?;
        }
        let mopts = MeasureOptions {
            warmup: cfg.warmup,
            repeats: cfg.repeats,
            trace: traced.then(|| traces.join(format!("{}.measured.json", file_name(&spec.id)))),
        };
        let attempt = match &opts.runner {
            Some(runner) => attempt_in_child(runner, spec, &mopts),
            None => attempt(spec, &mopts),
        };
        let outcome = outcome_of(attempt, spec, &mut shared, traced, &traces, peak_gflops)?;
        if opts.verbose {
            eprintln!(
                "[{}/{}] {} {}",
                i + 1,
                specs.len(),
                spec.id,
                summary(&outcome)
            );
        }
        configs.push(ConfigResult {
            spec: spec.clone(),
            outcome,
        });
    }
    let target = target::run_targets(&cfg.target)?;
    let mut links: Vec<_> = shared.links.into_iter().collect();
    links.sort_by_key(|(t, _)| t.name());
    Ok(BenchResults {
        command,
        machine: Machine::this(),
        started_unix,
        wall_s: start.elapsed().as_secs_f64(),
        quick,
        isolated: opts.runner.is_some(),
        config: cfg.clone(),
        peak_gflops,
        links,
        single,
        configs,
        target,
        criterion,
        numpy,
    })
}

/// Turns an attempt into an outcome: MFU and the prediction for a measurement.
fn outcome_of(
    attempt: Attempt,
    spec: &ConfigSpec,
    shared: &mut Shared,
    traced: bool,
    traces: &Path,
    peak_gflops: f64,
) -> Result<Outcome, ExperimentError> {
    Ok(match attempt {
        Attempt::Skipped(reason) => Outcome::Skipped { reason },
        Attempt::Failed(error) => Outcome::Failed { error },
        Attempt::Measured(measured) => {
            let model = Model::new(&ModelSpec::preset(&spec.model)?)?;
            let flops = crate::mfu::training_flops_per_sample(&model);
            let mfu = flops * measured.samples_per_s / (peak_gflops * 1e9);
            let (predicted, note) = match shared.predict(spec, &measured, traced) {
                Ok((p, timeline)) => {
                    if let Some(t) = timeline {
                        let path = traces.join(format!("{}.simulated.json", file_name(&spec.id)));
                        std::fs::write(&path, t.to_chrome_trace(None)).map_err(|e| {
                            ExperimentError::Config(format!("{}: {e}", path.display()))
                        })?;
                    }
                    (Some(Box::new(p)), None)
                }
                Err(e) => (None, Some(e.to_string())),
            };
            Outcome::Measured {
                measured,
                predicted,
                mfu,
                note,
            }
        }
    })
}

/// One line about an outcome (progress output).
fn summary(o: &Outcome) -> String {
    match o {
        Outcome::Measured {
            measured,
            predicted,
            ..
        } => match predicted {
            Some(p) => format!(
                "{:.0} samples/s, simulated {:.0} ({:.2})",
                measured.samples_per_s,
                p.samples_per_s,
                measured.samples_per_s / p.samples_per_s
            ),
            None => format!("{:.0} samples/s, no prediction", measured.samples_per_s),
        },
        Outcome::Skipped { reason } => format!("skipped: {reason}"),
        Outcome::Failed { error } => format!("FAILED: {error}"),
        Outcome::NotRun => "not run (budget)".into(),
    }
}

/// Writes `results.json` into `out`.
///
/// # Errors
/// An unwritable directory.
pub fn save(results: &BenchResults, out: &Path) -> Result<(), ExperimentError> {
    let err = |e: String| ExperimentError::Config(format!("{}: {e}", out.display()));
    std::fs::create_dir_all(out).map_err(|e| err(e.to_string()))?;
    let json = serde_json::to_string_pretty(results).map_err(|e| err(e.to_string()))?;
    // JSON has no NaN or infinity (serde_json writes null): refuse to save what cannot load.
    if let Err(e) = serde_json::from_str::<BenchResults>(&json) {
        return Err(err(format!("a figure is not finite: {e}")));
    }
    std::fs::write(out.join("results.json"), json).map_err(|e| err(e.to_string()))
}

/// Reads `DIR/results.json` and checks every figure in it (finite and in its range; counts
/// at least 1; shares in `[0, 1]`; partitions well formed), so the report renders only what a
/// sweep could have measured.
///
/// # Errors
/// A missing or malformed file (named); a figure out of its range, named with its field and
/// configuration.
pub fn load(dir: &Path) -> Result<BenchResults, ExperimentError> {
    let path = dir.join("results.json");
    let text = crate::read_results_file(&path)?;
    let results: BenchResults = serde_json::from_str(&text).map_err(|e| {
        ExperimentError::Config(format!("{}: not a bench results file: {e}", path.display()))
    })?;
    saved::check(&results)
        .map_err(|e| ExperimentError::Config(format!("{}: {e}", path.display())))?;
    Ok(results)
}
