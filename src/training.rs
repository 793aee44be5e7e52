//! What `pipe train` and `pipe worker` share: the training flags, merged over a TOML config
//! and a plan file (or an automatic plan for `--workers`) into one validated `RunConfig`; the
//! run's header, the cut by measured time, and the closing line; the progress display and
//! the observers every epoch is reported to.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use pipe_kernels::BackendKind;
use pipe_stages::config::{DatasetKind, LaunchSettings, RunConfig, TrainSettings};
use pipe_stages::log::JsonlLog;
use pipe_stages::model::params_digest;
use pipe_stages::pipeline::Observer;
use pipe_stages::pipeline::survive::LayoutChange;
use pipe_stages::pipeline::{PhaseRecord, StartPhase};
use pipe_stages::startup;
use pipe_stages::train::{EpochStats, EvalStats, LostStats, RecoveryStats, StepStats, TrainReport};

use crate::args::BackendParser;
use crate::output::{Interrupted, bad_input};
use crate::phases::Phases;

/// The training flags of `pipe train` and `pipe worker`: they override the config file's values.
/// Every setting is the library's [`TrainSettings`], whose fields are also config-file keys;
/// here are the sources around them and the flags whose values the command line reads in a
/// form of its own.
#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct TrainArgs {
    /// TOML config file; flags given on the command line override its values.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Dataset: mnist, synthetic, tinyshakespeare (the default for gpt-* models), or
    /// tokens:DIR, a corpus `pipe tokenize` wrote, streamed from disk.
    #[arg(long, value_parser = crate::args::parse_dataset)]
    dataset: Option<crate::args::DatasetArg>,
    /// Directory holding MNIST IDX files or tinyshakespeare.txt (default: the copies embedded
    /// in the binary).
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Compute backend: cpu or cuda.
    #[arg(long, value_parser = BackendParser)]
    backend: Option<BackendKind>,
    /// Run a plan written by `pipe plan -o`: its schedule, stages, replicas and partition.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["stages", "replicas", "partition", "workers"])]
    plan: Option<PathBuf>,
    /// Plan automatically for W workers: profile the model, then partition it under the default
    /// cost model for the run's schedule.
    #[arg(long, conflicts_with_all = ["stages", "replicas", "partition"])]
    pub workers: Option<u32>,
    /// The run's settings, each also a config-file key.
    #[command(flatten)]
    pub settings: TrainSettings,
}

impl TrainArgs {
    /// Where the run's settings come from: the config file, these flags, a plan file or
    /// `--workers`.
    ///
    /// # Errors
    /// Bad input when `--dataset tokens:DIR` and `--data-dir` both name a directory.
    pub fn sources(&self) -> Result<startup::RunSources> {
        let (dataset, data_dir) =
            crate::args::dataset_and_dir(self.dataset.as_ref(), self.data_dir.as_deref())?;
        Ok(startup::RunSources {
            config_file: self.config.clone(),
            flags: TrainSettings {
                dataset,
                data_dir,
                backend: self.backend.map(|b| b.name().to_string()),
                ..self.settings.clone()
            },
            plan_file: self.plan.clone(),
            workers: self.workers,
        })
    }
}

/// The run the flags describe (config file, then flags, then a plan file or an automatic
/// plan, validated once: [`startup::resolve`]), and its launch's settings.
///
/// # Errors
/// Bad input for unreadable or malformed files and settings that describe no run.
pub fn run_config(
    args: &TrainArgs,
    watcher: &dyn startup::StartupWatcher,
) -> Result<(RunConfig, LaunchSettings)> {
    Ok(startup::resolve(&args.sources()?, watcher)?)
}

/// Serves the `metrics` crate's metrics for Prometheus at `addr`, when given
/// ([`crate::metrics_endpoint`]), and says where (the port the system chose, for port 0).
///
/// # Errors
/// Bad input when the address cannot be listened on.
pub fn serve_metrics(addr: Option<std::net::SocketAddr>) -> Result<()> {
    let Some(addr) = addr else { return Ok(()) };
    let bound = serve_metrics_quietly(addr)?;
    outln!("metrics for Prometheus at http://{bound}/metrics");
    Ok(())
}

/// [`serve_metrics`] without the line saying so; returns the address served.
///
/// # Errors
/// As [`serve_metrics`].
pub fn serve_metrics_quietly(addr: std::net::SocketAddr) -> Result<std::net::SocketAddr> {
    crate::metrics_endpoint::serve(addr)
        .map_err(|e| bad_input(format!("--metrics-addr {addr}: {e}")))
}

/// Refuses, before worker processes start, a `--metrics-addr` whose ports (one a worker:
/// `P`, `P+1`, ...) cannot all be listened on: a worker that finds its port taken would
/// fail alone, after the others had started, and its peers' errors would bury the cause.
/// Port 0 is refused: each worker would take a port nobody is told.
///
/// # Errors
/// Bad input naming the worker and its port.
pub fn check_worker_metrics_ports(addr: Option<std::net::SocketAddr>, workers: u32) -> Result<()> {
    let Some(base) = addr else { return Ok(()) };
    if base.port() == 0 {
        return Err(bad_input(format!(
            "--metrics-addr {base}: worker processes serve at the port given and the ones after \
             it (worker K at port + K): give a port, not 0"
        )));
    }
    for rank in 0..workers {
        let port = u32::from(base.port()) + rank;
        let addr = u16::try_from(port)
            .map(|p| std::net::SocketAddr::new(base.ip(), p))
            .map_err(|_| {
                bad_input(format!(
                    "--metrics-addr {base}: worker {rank} would need port {port}"
                ))
            })?;
        std::net::TcpListener::bind(addr).map_err(|e| {
            bad_input(format!(
                "--metrics-addr {base}: worker {rank}'s port {addr}: {e}"
            ))
        })?;
    }
    Ok(())
}

/// Reports the checkpoints a run wrote; a run stopped by a signal ([`stop_on_signal`]) ends
/// here (exit 128 plus the signal's number: 130 for Ctrl-C, 143 for SIGTERM), naming the
/// checkpoint to resume from.
///
/// # Errors
/// [`Interrupted`] when the run stopped early.
pub fn finish_checkpoints(written: &[PathBuf], stopped: Option<u64>) -> Result<()> {
    if let Some(last) = written.last() {
        outln!(
            "checkpoints: {} written, the last {}",
            written.len(),
            last.display()
        );
    }
    if let Some(updates) = stopped {
        let saved = match written.last() {
            Some(dir) => format!("; resume with --resume {}", dir.display()),
            None => "; nothing saved (no --checkpoint-dir)".into(),
        };
        // A chief stopped by its launcher or by a peer's request saw no signal of its own.
        let signal = match STOP_SIGNAL.load(Ordering::SeqCst) {
            0 => signal_hook::consts::SIGINT,
            signal => signal,
        };
        return Err(Interrupted {
            message: format!(
                "stopped by {} after update {updates}{saved}",
                signal_name(signal)
            ),
            code: u8::try_from(128 + signal).unwrap_or(130),
        }
        .into());
    }
    Ok(())
}

/// The signal that asked the run to stop (SIGINT or SIGTERM), 0 while none has.
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

/// A flag SIGINT (Ctrl-C) or SIGTERM (what `kill`, Slurm at a job's time limit, and Kubernetes
/// when it evicts a pod send) sets: the run stops at its next drain point, after a checkpoint
/// (saying so when `announce`), and exits 128 plus the signal's number. A second signal ends
/// the process at once.
///
/// A worker that is not the one writing checkpoints reads no flag: it goes on until the chief
/// stops the run, so that a whole job asked to stop (every worker signalled) ends with the
/// chief's checkpoint rather than with the chief's peers lost.
///
/// A run that writes no checkpoints (`saves` false) has nothing to keep from a stop: SIGTERM
/// ends it at once, as `timeout` or a scheduler expects; Ctrl-C still stops it at a drain
/// point, with its last figures.
pub fn stop_on_signal(announce: bool, saves: bool) -> Arc<AtomicBool> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let watched = signal_hook::iterator::Signals::new([SIGINT, SIGTERM]).and_then(|mut signals| {
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                for signal in signals.forever() {
                    // Recorded before the flag is raised, so the stop names its signal.
                    let _ = STOP_SIGNAL.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
                    let unsaved = !saves && signal == SIGTERM;
                    if flag.swap(true, Ordering::SeqCst) || unsaved {
                        std::process::exit(128 + signal);
                    }
                    if announce {
                        let name = signal_name(signal);
                        eprintln!("{name}: stopping at the next drain point ({name} again to quit at once)");
                    }
                }
            })
    });
    if let Err(e) = watched {
        eprintln!("warning: Ctrl-C and SIGTERM will end the run without a checkpoint: {e}");
    }
    stop
}

/// Leaves SIGINT and SIGTERM to this process's launcher (`pipe train`, which asks the chief
/// to stop through its standard input and ends the others itself): a signal sent to the whole
/// process group (Ctrl-C at a terminal, `kill` of the group, `timeout`, which signals the
/// group again) must not end a launched worker under its launcher's stop.
pub fn leave_signals_to_launcher() {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let seen = Arc::new(AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM] {
        if let Err(e) = signal_hook::flag::register(signal, seen.clone()) {
            eprintln!("warning: a signal to the process group will end this worker: {e}");
        }
    }
}

/// `SIGINT` or `SIGTERM`, as a reader knows them.
fn signal_name(signal: i32) -> &'static str {
    if signal == signal_hook::consts::SIGTERM {
        "SIGTERM"
    } else {
        "SIGINT"
    }
}

/// Prints the closing line of a run.
pub fn print_done(report: &TrainReport) {
    if let Some(last) = report.epochs.last() {
        print_done_line(report.steps, last, params_digest(&report.params));
    }
}

/// The closing line, from the last epoch's figures and the final weights' digest
/// ([`params_digest`]: equal digests, equal weights, bit for bit).
pub fn print_done_line(steps: u64, last: &EpochStats, digest: u64) {
    outln!(
        "done: {} steps, test accuracy {:.2}%, test loss {:.4}, weights {digest:016x}, {:.1} s",
        steps,
        100.0 * last.test_accuracy,
        last.test_loss,
        last.elapsed_s
    );
}

/// Hands every step and epoch to the progress display first, then to the other observers
/// (the JSON-lines log); shows the phases of the run's start on `phases` and logs them once
/// ended.
pub struct Fan {
    first: Progress,
    rest: Vec<Box<dyn Observer>>,
    phases: Phases,
}

impl Fan {
    /// Hands the ended phases of the run's start to the log.
    fn log_phases(&mut self) -> pipe_stages::Result<()> {
        for record in self.phases.take_ended() {
            self.rest.iter_mut().try_for_each(|o| o.on_phase(&record))?;
        }
        Ok(())
    }
}

impl Fan {
    /// The progress display (a bar on a terminal) and the log `cfg` asks for.
    ///
    /// # Errors
    /// A log file that cannot be created.
    pub fn new(cfg: &RunConfig, phases: Phases) -> Result<Self> {
        let mut rest: Vec<Box<dyn Observer>> = Vec::new();
        if let Some(path) = &cfg.log_jsonl {
            rest.push(Box::new(JsonlLog::create(path)?));
        }
        // A tokenized corpus's tokens are whatever its tokenizer made; Tiny Shakespeare's are
        // characters.
        let unit = if cfg.dataset == DatasetKind::Tokens {
            "nats/token"
        } else {
            "nats/char"
        };
        let language = matches!(
            cfg.dataset,
            DatasetKind::Tokens | DatasetKind::TinyShakespeare
        );
        Ok(Fan {
            first: Progress::new(std::io::stderr().is_terminal(), unit, language),
            rest,
            phases,
        })
    }
}

impl Observer for Fan {
    fn on_start_phase(&mut self, phase: StartPhase) -> pipe_stages::Result<()> {
        let detail = match phase {
            StartPhase::FirstUpdate => "every worker is up",
            StartPhase::Weights | StartPhase::Workers => "",
        };
        self.phases.begin(phase.describe(), detail);
        self.log_phases()
    }
    fn on_phase(&mut self, record: &PhaseRecord) -> pipe_stages::Result<()> {
        self.rest.iter_mut().try_for_each(|o| o.on_phase(record))
    }
    fn on_step(&mut self, s: &StepStats) -> pipe_stages::Result<()> {
        if self.phases.running().is_some() {
            self.phases.end();
            self.log_phases()?;
        }
        self.first.on_step(s)?;
        self.rest.iter_mut().try_for_each(|o| o.on_step(s))
    }
    fn on_epoch(&mut self, e: &EpochStats) -> pipe_stages::Result<()> {
        self.first.on_epoch(e)?;
        self.rest.iter_mut().try_for_each(|o| o.on_epoch(e))
    }
    fn on_eval(&mut self, e: &EvalStats) -> pipe_stages::Result<()> {
        self.first.on_eval(e)?;
        self.rest.iter_mut().try_for_each(|o| o.on_eval(e))
    }
    fn on_layout_change(&mut self, c: &LayoutChange) -> pipe_stages::Result<()> {
        outln!("{c}");
        self.rest.iter_mut().try_for_each(|o| o.on_layout_change(c))
    }
    fn on_lost(&mut self, lost: &LostStats) -> pipe_stages::Result<()> {
        self.rest.iter_mut().try_for_each(|o| o.on_lost(lost))
    }
    fn on_recovery(&mut self, phase: &RecoveryStats) -> pipe_stages::Result<()> {
        self.rest.iter_mut().try_for_each(|o| o.on_recovery(phase))
    }
}

/// A progress bar on a terminal; nothing per step otherwise. One summary line per epoch.
struct Progress {
    bar: Option<ProgressBar>,
    tty: bool,
    /// The latest validation loss of a language model, shown while the next epoch runs.
    last_val: Option<f64>,
    /// A language model's loss unit.
    unit: &'static str,
    /// A language model (validation loss) rather than a classifier (test loss).
    language: bool,
}

impl Progress {
    fn new(tty: bool, unit: &'static str, language: bool) -> Self {
        Self {
            bar: None,
            tty,
            last_val: None,
            unit,
            language,
        }
    }
}

impl Observer for Progress {
    fn on_step(&mut self, s: &StepStats) -> pipe_stages::Result<()> {
        if !self.tty {
            return Ok(());
        }
        let bar = self.bar.get_or_insert_with(|| {
            let b = ProgressBar::new(s.steps_in_epoch);
            if let Ok(style) = ProgressStyle::with_template(
                "epoch {prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed}, eta {eta})",
            ) {
                b.set_style(style.progress_chars("=> "));
            }
            b.set_prefix(s.epoch.to_string());
            b.enable_steady_tick(Duration::from_millis(200));
            b
        });
        bar.set_position(s.step_in_epoch);
        if s.step_in_epoch % 10 == 1 || s.step_in_epoch == s.steps_in_epoch {
            let rate = match s.tokens_per_sec {
                Some(t) => format!("{t:.0} tokens/s"),
                None => format!("{:.0} samples/s", s.samples_per_sec),
            };
            let val = self
                .last_val
                .map(|v| format!(", val loss {v:.4}"))
                .unwrap_or_default();
            let norm = s
                .grad_norm
                .map(|n| format!(", grad norm {n:.3}"))
                .unwrap_or_default();
            bar.set_message(format!("loss {:.4}{norm}{val}, {rate}", s.loss));
        }
        Ok(())
    }

    fn on_eval(&mut self, e: &EvalStats) -> pipe_stages::Result<()> {
        let (what, unit) = if self.language {
            self.last_val = Some(e.test_loss);
            ("val", format!(" {}", self.unit))
        } else {
            ("test", String::new())
        };
        let line = format!(
            "eval at update {:>6}  {what} loss {:.4}{unit}  {what} acc {:6.2}%  {:>7.1} s",
            e.steps,
            e.test_loss,
            100.0 * e.test_accuracy,
            e.elapsed_s
        );
        // Standard output, as the epoch lines; the bar steps aside while it is written.
        match &self.bar {
            Some(bar) => bar.suspend(|| outln!("{line}")),
            None => outln!("{line}"),
        }
        Ok(())
    }

    fn on_epoch(&mut self, e: &EpochStats) -> pipe_stages::Result<()> {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
        let train_loss = if e.train_loss.is_finite() {
            format!("{:.4}", e.train_loss)
        } else {
            "-".into()
        };
        match e.tokens_per_sec {
            Some(tokens) => {
                self.last_val = Some(e.test_loss);
                outln!(
                    "epoch {:>3}  train loss {}  val loss {:.4} {}  val acc {:6.2}%  {:>8.0} tokens/s  {:>7.1} s",
                    e.epoch,
                    train_loss,
                    e.test_loss,
                    self.unit,
                    100.0 * e.test_accuracy,
                    tokens,
                    e.elapsed_s
                );
            }
            None => outln!(
                "epoch {:>3}  train loss {}  test loss {:.4}  test acc {:6.2}%  {:>8.0} samples/s  {:>7.1} s",
                e.epoch,
                train_loss,
                e.test_loss,
                100.0 * e.test_accuracy,
                e.samples_per_sec,
                e.elapsed_s
            ),
        }
        if !e.stages.is_empty() {
            let parts: Vec<String> = e
                .stages
                .iter()
                .map(|s| {
                    let peak = s.peak_resident_bytes.map_or(String::new(), |b| {
                        format!(" peak {:.1} MiB", b as f64 / (1024.0 * 1024.0))
                    });
                    let device = s.peak_device_bytes.map_or(String::new(), |b| {
                        format!(" device {:.2} GiB", b as f64 / f64::from(1u32 << 30))
                    });
                    let lent = s
                        .buffers_lent
                        .map_or(String::new(), |n| format!(" lent {n}"));
                    format!(
                        "s{} util {:3.0}% staleness {:.2}{peak}{device}{lent}",
                        s.stage,
                        100.0 * s.utilisation,
                        s.staleness
                    )
                })
                .collect();
            outln!("           {}", parts.join(" | "));
        }
        Ok(())
    }
}
