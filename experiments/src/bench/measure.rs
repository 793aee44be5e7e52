//! Measuring one configuration: the executor on threads of this process, over in-process
//! channels or QUIC on loopback, `warmup` untimed runs then `repeats` timed ones of the same
//! schedule, each run continuing the training of the one before (the weights keep changing, as
//! in training). A run's time covers thread start, fill and drain; the endpoints (QUIC
//! handshakes included) are made before the clock starts.
//!
//! Throughput is MLPerf's rule over the repeats: the mean without the fastest and the slowest.
//! Utilisation and the measured bubble come from the executor's own spans in the last repeat;
//! memory from the executor's accounting (weights and stash per worker) and from the process's
//! peak resident set (`VmHWM`), which is the configuration's own when the sweep runs it in a
//! child process (`pipe bench` does).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use pipe_kernels::CpuBackend;
use pipe_scheduler::{Action, Timeline};
use pipe_stages::model::{Model, ModelSpec};
use pipe_stages::optim::{OptimizerConfig, OptimizerKind};
use pipe_stages::pipeline::{RunPlan, Setup, WorkerOutcome, WorkerState, run_worker};
use pipe_stages::profile::RandomSource;
use pipe_transport::Transport;
use pipe_transport::inproc::{InProcOptions, mesh};
use pipe_transport::quic::{QuicOptions, local_mesh};
use serde::{Deserialize, Serialize};

use super::config::{ConfigSpec, TransportName};
use crate::ExperimentError;

/// How to measure.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MeasureOptions {
    /// Untimed runs first.
    pub warmup: u32,
    /// Timed runs.
    pub repeats: u32,
    /// Write the last repeat's Chrome trace here.
    pub trace: Option<std::path::PathBuf>,
}

impl MeasureOptions {
    /// Checks the counts against a sweep file's bounds (warm-up at most 100, 1 to 1000
    /// repeats), for `pipe bench measure-config`, which takes them as JSON.
    ///
    /// # Errors
    /// A message naming the field.
    pub fn check(&self) -> Result<(), String> {
        if self.warmup > 100 {
            return Err(format!("warmup = {}: at most 100", self.warmup));
        }
        if self.repeats == 0 || self.repeats > 1000 {
            return Err(format!("repeats = {}: between 1 and 1000", self.repeats));
        }
        Ok(())
    }
}

/// One worker's figures.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerFigures {
    /// Share of the last repeat's wall time spent in compute actions (forward, backward and
    /// its halves, update), from the executor's spans.
    pub busy: f64,
    /// Bytes of the weights of its stages (one version each).
    pub param_bytes: u64,
    /// Most bytes of stashed weight versions held at once.
    pub peak_stash_bytes: u64,
    /// Most weight versions held at once (all its stages).
    pub peak_versions: u32,
}

/// What one configuration measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    /// Workers.
    pub workers: u32,
    /// Model stages (positions times chunks).
    pub model_stages: u32,
    /// Layers of each model stage, `[start, end)`.
    pub partition: Vec<[usize; 2]>,
    /// Samples in one run.
    pub samples_per_run: u64,
    /// Tokens per sample (sequence length for language models, 1 otherwise).
    pub tokens_per_sample: u64,
    /// Seconds of every timed run.
    pub run_s: Vec<f64>,
    /// Samples/s: samples per run over the mean run time without the fastest and slowest.
    pub samples_per_s: f64,
    /// Coefficient of variation of the run times (all repeats).
    pub cv: f64,
    /// Per worker.
    pub per_worker: Vec<WorkerFigures>,
    /// 1 - mean busy share over the workers (last repeat).
    pub bubble: f64,
    /// Payload bytes sent by all workers per sample (activations, gradients, all-reduce
    /// traffic; f32 on both transports).
    pub bytes_sent_per_sample: f64,
    /// Peak resident set of the process, bytes (`VmHWM`).
    pub peak_rss_bytes: Option<u64>,
    /// Resident set before the first run, bytes (`VmRSS`).
    pub start_rss_bytes: Option<u64>,
}

/// Mean of `xs` without its smallest and largest value (MLPerf's rule; all of them when fewer
/// than three).
pub fn trimmed_mean(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let kept = if v.len() >= 3 {
        &v[1..v.len() - 1]
    } else {
        &v[..]
    };
    kept.iter().sum::<f64>() / kept.len().max(1) as f64
}

/// Standard deviation over mean.
pub fn coefficient_of_variation(xs: &[f64]) -> f64 {
    let n = xs.len() as f64;
    if xs.len() < 2 {
        return 0.0;
    }
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    var.sqrt() / mean
}

/// A barrier that a failure opens for good: every party waiting (or arriving later) gets
/// `Err`, so a worker that stops never leaves the others waiting. Each opening returns the
/// instant it opened, the same for every party: the run's common start.
struct Gate {
    state: Mutex<GateState>,
    cv: Condvar,
    parties: usize,
}

struct GateState {
    generation: u64,
    arrived: usize,
    failed: bool,
    opened: Instant,
}

impl Gate {
    fn new(parties: usize) -> Self {
        Gate {
            state: Mutex::new(GateState {
                generation: 0,
                arrived: 0,
                failed: false,
                opened: Instant::now(),
            }),
            cv: Condvar::new(),
            parties,
        }
    }

    fn wait(&self) -> Result<Instant, ()> {
        let mut st = self.state.lock().map_err(|_| ())?;
        if st.failed {
            return Err(());
        }
        st.arrived += 1;
        if st.arrived == self.parties {
            st.arrived = 0;
            st.generation += 1;
            st.opened = Instant::now();
            self.cv.notify_all();
            return Ok(st.opened);
        }
        let generation = st.generation;
        while st.generation == generation && !st.failed {
            st = self.cv.wait(st).map_err(|_| ())?;
        }
        if st.failed { Err(()) } else { Ok(st.opened) }
    }

    fn fail(&self) {
        if let Ok(mut st) = self.state.lock() {
            st.failed = true;
        }
        self.cv.notify_all();
    }
}

/// Runs one configuration `runs` times on endpoints made once: each worker is a thread that
/// keeps its endpoint (connections stay up between runs, as in training) and its state; a
/// run starts when every worker has reached the gate (all share that instant as the start of
/// their spans) and lasts until the last worker ends. Returns each run's seconds and the last
/// run's outcomes.
fn run_persistent<T: Transport + Send>(
    setup: &Setup<'_>,
    states: &mut [WorkerState],
    endpoints: Vec<T>,
    runs: u32,
) -> Result<(Vec<f64>, Vec<WorkerOutcome>), ExperimentError> {
    let gate = Gate::new(states.len());
    // Per run, its start and the latest end over the workers.
    let bounds: Mutex<Vec<Option<(Instant, Instant)>>> = Mutex::new(vec![None; runs as usize]);
    let first_error: Mutex<Option<String>> = Mutex::new(None);
    let fail = |e: String| {
        if let Ok(mut slot) = first_error.lock() {
            slot.get_or_insert(e);
        }
        gate.fail();
    };
    let outcomes: Vec<Option<WorkerOutcome>> = std::thread::scope(|scope| {
        let handles: Vec<_> = states
            .iter_mut()
            .zip(endpoints)
            .map(|(state, mut ep)| {
                let (gate, fail, bounds) = (&gate, &fail, &bounds);
                scope.spawn(move || {
                    let result = catch_unwind(AssertUnwindSafe(|| {
                        worker_runs(setup, state, &mut ep, gate, runs, bounds)
                    }));
                    match result {
                        Ok(Ok(out)) => {
                            let _ = ep.close();
                            out
                        }
                        Ok(Err(e)) => {
                            ep.abort();
                            fail(e);
                            None
                        }
                        Err(_) => {
                            ep.abort();
                            fail(format!("worker {} panicked", state.worker));
                            None
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().ok().flatten())
            .collect()
    });
    if let Some(e) = first_error.into_inner().ok().flatten() {
        return Err(ExperimentError::Config(e));
    }
    let outs = outcomes
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| ExperimentError::Config("a worker stopped without an error".into()))?;
    let times = bounds
        .into_inner()
        .map_err(|_| ExperimentError::Config("run bounds lost".into()))?
        .into_iter()
        .map(|b| b.map_or(f64::NAN, |(start, end)| (end - start).as_secs_f64()))
        .collect();
    Ok((times, outs))
}

/// One worker's side of [`run_persistent`]: `runs` runs, each after a gate, each recording
/// its end in the run's bounds; the last outcome.
fn worker_runs<T: Transport>(
    setup: &Setup<'_>,
    state: &mut WorkerState,
    ep: &mut T,
    gate: &Gate,
    runs: u32,
    bounds: &Mutex<Vec<Option<(Instant, Instant)>>>,
) -> Result<Option<WorkerOutcome>, String> {
    let be = CpuBackend::new(1).map_err(|e| e.to_string())?;
    let mut last = None;
    for run in 0..runs as usize {
        let Ok(start) = gate.wait() else {
            return Ok(None);
        };
        let out = run_worker(&be, ep, setup, state, start).map_err(|e| e.to_string())?;
        let end = Instant::now();
        if let Ok(mut b) = bounds.lock() {
            if let Some(slot) = b.get_mut(run) {
                let latest = slot.map_or(end, |(_, e)| e.max(end));
                *slot = Some((start, latest));
            }
        }
        last = Some(out);
    }
    Ok(last)
}

/// The optimizer every configuration trains with.
pub fn sgd() -> OptimizerConfig {
    OptimizerConfig {
        kind: OptimizerKind::Sgd,
        momentum: 0.9,
        ..OptimizerConfig::default()
    }
}

/// Measures `spec` (see the module docs).
///
/// # Errors
/// An impossible configuration ([`ExperimentError::Stage`] or [`ExperimentError::Schedule`]
/// with the reason: too few layers for the stages, a layout the policy refuses), or a failure
/// while running.
pub fn measure(spec: &ConfigSpec, opts: &MeasureOptions) -> Result<Measured, ExperimentError> {
    let model = Model::new(&ModelSpec::preset(&spec.model)?)?;
    let plan = RunPlan::new(&model, &spec.schedule()?, None)?;
    let pool = RandomSource::for_model(&model, spec.microbatch, 0)?;
    let lr = |_: u32, _: u32| 1e-3f32;
    let setup = Setup::new(&model, &plan, &pool, &lr);
    let init = model.init_params(0);
    let mut states: Vec<WorkerState> = (0..plan.schedule.workers())
        .map(|w| WorkerState::new(&setup, w, &init, sgd()))
        .collect();
    drop(init);
    let partition: Vec<[usize; 2]> = plan
        .partition
        .ranges()
        .iter()
        .map(|r| [r.start, r.end])
        .collect();
    let samples_per_run = u64::from(plan.schedule.total_microbatches()) * spec.microbatch as u64;
    let start_rss_bytes = pipe_stages::limits::process_resident_bytes();
    let workers = plan.schedule.workers();
    let runs = opts.warmup + opts.repeats.max(1);
    let (times, last) = match spec.transport {
        TransportName::InProc => run_persistent(
            &setup,
            &mut states,
            mesh(workers, &InProcOptions::default()),
            runs,
        )?,
        TransportName::Quic => {
            let eps = local_mesh(workers, &QuicOptions::new(0x62656e6368))
                .map_err(|e| ExperimentError::Config(format!("QUIC mesh: {e}")))?;
            run_persistent(&setup, &mut states, eps, runs)?
        }
    };
    let run_s: Vec<f64> = times.into_iter().skip(opts.warmup as usize).collect();
    let wall = run_s.last().copied().unwrap_or(f64::NAN);
    let per_worker = worker_figures(&model, &plan, &last, wall);
    let bubble =
        1.0 - per_worker.iter().map(|w| w.busy).sum::<f64>() / per_worker.len().max(1) as f64;
    let sent: u64 = last.iter().map(|o| o.bytes_sent).sum();
    if let Some(path) = &opts.trace {
        let spans = last.iter().flat_map(|o| o.spans.iter().copied()).collect();
        let timeline = Timeline::new(plan.schedule.workers(), spans);
        std::fs::write(path, timeline.to_chrome_trace(Some(&plan.versions)))
            .map_err(|e| ExperimentError::Config(format!("{}: {e}", path.display())))?;
    }
    let language = crate::mfu::is_language_model(&model);
    Ok(Measured {
        workers: plan.schedule.workers(),
        model_stages: plan.schedule.stages(),
        partition,
        samples_per_run,
        tokens_per_sample: if language {
            model.input_shape()[0] as u64
        } else {
            1
        },
        samples_per_s: samples_per_run as f64 / trimmed_mean(&run_s),
        cv: coefficient_of_variation(&run_s),
        run_s,
        per_worker,
        bubble,
        bytes_sent_per_sample: sent as f64 / samples_per_run as f64,
        peak_rss_bytes: pipe_stages::limits::process_peak_bytes(),
        start_rss_bytes,
    })
}

/// Per-worker figures of the last run (`wall` seconds).
fn worker_figures(
    model: &Model,
    plan: &RunPlan,
    outs: &[WorkerOutcome],
    wall: f64,
) -> Vec<WorkerFigures> {
    let layout = plan.schedule.layout();
    outs.iter()
        .map(|o| {
            let compute: f64 = o
                .spans
                .iter()
                .filter(|s| {
                    s.action.kind().is_compute() || matches!(s.action, Action::Update { .. })
                })
                .map(|s| s.end - s.start)
                .sum();
            let param_bytes = layout
                .stages_of(o.worker)
                .map(|s| {
                    model
                        .zero_grads(plan.partition.range(s as usize))
                        .iter()
                        .flatten()
                        .map(|t| t.bytes() as u64)
                        .sum::<u64>()
                })
                .sum();
            WorkerFigures {
                busy: compute / wall,
                param_bytes,
                peak_stash_bytes: o.peak_stash_bytes,
                peak_versions: o.peak_versions,
            }
        })
        .collect()
}
