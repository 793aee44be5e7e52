//! The process launcher behind `pipe train --transport quic`, beside the thread launcher
//! ([`super::launch`]): one worker process per worker on loopback (this executable's `worker`
//! command), with ephemeral cluster credentials, relayed to one place; and the other side of
//! it, a worker joining its cluster ([`join`]) and reporting to the launcher ([`RecordWriter`]).
//! It lives in the library so that every launcher of a run is in one place; the command line
//! keeps its flags, its progress display and its exit codes.
//!
//! It writes the credentials and the resolved run (with the partition already settled, so no
//! worker profiles or resolves on its own) into a private temporary directory, starts the workers, and
//! tells each the others' addresses once every one has bound a port (each binds port 0 and
//! reports it, so no port is guessed). From then on it relays: the chief's step and epoch
//! records (JSON lines on its standard output) go to this process's progress display and
//! log, every other line to standard error, prefixed with the worker's rank.
//!
//! **Failure.** The first worker that exits unsuccessfully is the run's failure. The others
//! are given [`LaunchOptions::grace`] to stop on their own (their transport notices a lost
//! peer within its idle timeout and names it), then killed; the launcher returns only once
//! every worker process has been reaped, so it leaves no orphans. If the launcher itself dies,
//! the workers see their standard input close and exit.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{RecvTimeoutError, Sender, unbounded};
use pipe_transport::cluster::{ClusterFile, Existing};
use pipe_transport::fault::Fault;
use pipe_transport::kinds::{self, Joined, Listen, MeshSettings};
use pipe_transport::{Interrupter, TransportKind};
use serde::{Deserialize, Serialize};

use super::doctor::{StopReport, diagnose};
use super::recover::Remeshed;
use super::restart::RestartPolicy;
use crate::checkpoint::CheckpointPolicy;
use crate::config::RunConfig;
use crate::error::{Result, StageError};
use crate::pipeline::Observer;
use crate::train::{EpochStats, EvalStats, StepStats};

/// A failure of the launch or of a worker process, at run time.
fn failed(why: String) -> StageError {
    StageError::Launch {
        why,
        bad_input: false,
    }
}

/// A failure caused by what the user gave (a worker that exited with status 2, an address
/// line or port that cannot be).
fn refused(why: String) -> StageError {
    StageError::Launch {
        why,
        bad_input: true,
    }
}

/// The line a launched worker prints once it has bound its port: this prefix, then the
/// address.
pub const LISTENING: &str = "PIPE-LISTENING ";
/// The line a launched worker prints, before its own [`LISTENING`] line, once it has bound an
/// endpoint for a lost rank whose program it adopts ([`super::takeover`]): this prefix, the
/// rank, a space, then the address. The launcher takes it only for the rank it marked absent.
pub const HOSTING: &str = "PIPE-HOSTING ";
/// The prefix of a launched chief's step and epoch records.
pub const RECORD: &str = "PIPE-RECORD ";

/// What a launched chief reports, one JSON object per line after [`RECORD`].
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Record {
    /// An optimizer step.
    Step(StepStats),
    /// An epoch, after evaluation.
    Epoch(EpochStats),
    /// A validation pass inside an epoch.
    Eval(EvalStats),
    /// The end of the run: steps done, the final weights' digest, the checkpoints written,
    /// and whether it stopped early (Ctrl-C).
    Done {
        /// Optimizer steps.
        steps: u64,
        /// [`crate::model::params_digest`] of the final weights.
        weights: u64,
        /// Checkpoint directories written, oldest first.
        checkpoints: Vec<PathBuf>,
        /// Stopped early after this many updates.
        stopped: Option<u64>,
    },
    /// Where a worker's program stopped when its part of the run failed (any rank), for the
    /// hang doctor.
    Stop(StopReport),
    /// The chief began a phase of its start (its first update, once it is up and connected).
    Phase(super::StartPhase),
    /// When the chief's training began, since the Unix epoch by its system clock: the origin
    /// of its records' `elapsed_s`.
    Began(std::time::Duration),
    /// The run went on without a lost replica, in place (the chief).
    Layout(super::survive::LayoutChange),
    /// A surviving worker reached a phase of its recovery from a lost replica (any rank),
    /// by its system clock since the Unix epoch (its launcher reads its lines in bursts
    /// while the machine is loaded, so dates them late).
    Recovery {
        /// The phase.
        phase: crate::train::RecoveryPhase,
        /// When, since the Unix epoch.
        at: std::time::Duration,
    },
    /// This worker's part of the run diverged at `update` (any rank): a failure no other
    /// replica and no restart would escape, which the launcher reports as it is.
    Diverged {
        /// The update.
        update: u64,
        /// The worker's error.
        message: String,
    },
}

/// The chief's observer in a launched run: every step and epoch as a [`Record`] line on
/// standard output, for the launcher to show and log.
#[derive(Debug, Default)]
pub struct RecordWriter;

impl RecordWriter {
    /// Writes one record line to standard output (the launcher's pipe).
    ///
    /// # Errors
    /// A record that does not serialize; standard output gone.
    pub fn write(record: &Record) -> Result<()> {
        let json = serde_json::to_string(record)
            .map_err(|e| StageError::Executor(format!("record: {e}")))?;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{RECORD}{json}")
            .and_then(|()| out.flush())
            .map_err(|e| failed(format!("writing a record for the launcher: {e}")))
    }

    /// Tells the launcher that this worker reached `phase` of a recovery.
    ///
    /// # Errors
    /// As [`RecordWriter::write`].
    pub fn recovery(phase: crate::train::RecoveryPhase) -> Result<()> {
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Self::write(&Record::Recovery { phase, at })
    }
}

impl Observer for RecordWriter {
    fn on_step(&mut self, s: &StepStats) -> Result<()> {
        Self::write(&Record::Step(s.clone()))
    }
    fn on_epoch(&mut self, e: &EpochStats) -> Result<()> {
        Self::write(&Record::Epoch(e.clone()))
    }
    fn on_eval(&mut self, e: &EvalStats) -> Result<()> {
        Self::write(&Record::Eval(e.clone()))
    }
    fn on_stop(&mut self, report: &StopReport) -> Result<()> {
        Self::write(&Record::Stop(report.clone()))
    }
    fn on_start_phase(&mut self, phase: super::StartPhase) -> Result<()> {
        Self::write(&Record::Phase(phase))
    }
    fn on_layout_change(&mut self, change: &super::survive::LayoutChange) -> Result<()> {
        Self::write(&Record::Layout(change.clone()))
    }
    fn on_training_began(&mut self, at: std::time::SystemTime) -> Result<()> {
        let since = at.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        Self::write(&Record::Began(since))
    }
}

/// The observer of a launched worker other than the chief: only where it stopped, when its
/// part of the run fails.
#[derive(Debug, Default)]
pub struct StopWriter;

impl Observer for StopWriter {
    fn on_stop(&mut self, report: &StopReport) -> Result<()> {
        RecordWriter::write(&Record::Stop(report.clone()))
    }
}

/// How the launcher runs its workers.
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// Worker processes.
    pub workers: u32,
    /// How long the workers may take to bind their ports.
    pub connect_timeout: Duration,
    /// After the first failure, how long the others may take to stop on their own before they
    /// are killed.
    pub grace: Duration,
    /// Set (Ctrl-C) to ask the chief to stop at its next drain point.
    pub stop: Option<Arc<AtomicBool>>,
    /// Ask the chief to stop at its first drain point (after a checkpoint), as a Ctrl-C
    /// would: the launcher then starts the workers again on another layout (`--rejoin`).
    pub stop_at_first_drain: bool,
    /// Which lost worker processes the others go on without in place, as one run
    /// ([`super::recover`]); `None`: any loss ends the launch.
    pub in_place: Option<InPlace>,
    /// A worker lost in place is replaced (`--rejoin`, or `--max-restarts N`): the launcher
    /// starts a `pipe worker` with its rank, which joins the survivors at their next update
    /// boundary, taking its state from them; then the run may lose a replica in place again.
    pub rejoin: bool,
    /// The run's restarts, each lost replica replaced taking one (`--max-restarts N` without
    /// `--rejoin`); `None`: every one is replaced (`--rejoin`). A loss with none left leaves
    /// the run short of the replica, and the survivors are told so at the loss.
    pub replacements: Option<RestartPolicy>,
}

/// Whether the loss of a worker process (by rank) is gone on without in place: a replica of
/// a stage that has another, not the chief. Once per launch.
#[derive(Clone)]
pub struct InPlace(pub Arc<dyn Fn(u32) -> bool + Send + Sync>);

impl std::fmt::Debug for InPlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InPlace")
    }
}

/// What a launcher tells its workers on their standard input, besides the first address line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LauncherWord {
    /// The worker of this rank was lost (how it ended): the others go on without it. A
    /// replacement comes (`lost`) or none does (`gone`: the survivors need not stop at every
    /// update for one to join).
    Lost {
        /// The lost worker's rank.
        rank: u32,
        /// A replacement is started for it.
        replaced: bool,
        /// How it ended, in words.
        how: String,
    },
    /// A worker failed and the run does not go on in place.
    Fail,
    /// Where every worker of the survivors' mesh listens ([`pipe_transport::registration::ABSENT`]
    /// for the lost).
    Peers(Vec<String>),
    /// The replacement of the lost worker of this rank has started: the survivors take it
    /// back at the chief's next drain point (`--rejoin`).
    Join(u32),
    /// No replacement comes for the lost worker of this rank after all (its replacements
    /// failed before they joined): the survivors stop ending a segment at every update.
    Unreplaced(u32),
}

impl LauncherWord {
    /// The line that carries this word.
    fn line(&self) -> String {
        match self {
            LauncherWord::Lost {
                rank,
                replaced,
                how,
            } => format!("{} {rank} {how}", if *replaced { "lost" } else { "gone" }),
            LauncherWord::Fail => "fail".into(),
            LauncherWord::Peers(addrs) => addrs.join(","),
            LauncherWord::Join(rank) => format!("join {rank}"),
            LauncherWord::Unreplaced(rank) => format!("unreplaced {rank}"),
        }
    }

    /// A line read back (`None`: `stop`, or nothing).
    fn parse(line: &str) -> Option<Self> {
        let line = line.trim();
        let (first, rest) = line.split_once(' ').unwrap_or((line, ""));
        if first == "lost" || first == "gone" {
            let (rank, how) = rest.split_once(' ').unwrap_or((rest, ""));
            return Some(LauncherWord::Lost {
                rank: rank.parse().ok()?,
                replaced: first == "lost",
                how: how.to_string(),
            });
        }
        if first == "join" {
            return Some(LauncherWord::Join(rest.parse().ok()?));
        }
        if first == "unreplaced" {
            return Some(LauncherWord::Unreplaced(rest.parse().ok()?));
        }
        match line {
            "fail" => Some(LauncherWord::Fail),
            "stop" | "" => None,
            _ => Some(LauncherWord::Peers(
                line.split(',').map(str::to_string).collect(),
            )),
        }
    }
}

impl LaunchOptions {
    /// Defaults for `workers` processes: 30 s to start, 15 s of grace.
    pub fn new(workers: u32) -> Self {
        LaunchOptions {
            workers,
            connect_timeout: Duration::from_secs(30),
            grace: Duration::from_secs(15),
            stop: None,
            stop_at_first_drain: false,
            in_place: None,
            rejoin: false,
            replacements: None,
        }
    }
}

/// The format of [`WorkerRun`], written into every `run.json`: raised whenever a field
/// changes meaning, so that a worker of another build refuses the file naming it.
pub const WORKER_RUN_FORMAT: u32 = 1;

/// Everything a launched worker process is handed, in `run.json` (`pipe worker --launched
/// --run FILE`): the resolved run, and the settings around it that are the launch's rather
/// than the run's numerics. The worker reads and checks it and resolves nothing again; no
/// setting reaches it as a flag rebuilt into text.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerRun {
    /// [`WORKER_RUN_FORMAT`].
    pub format: u32,
    /// The run (its partition settled; no JSON-lines log, which the launcher writes).
    pub run: RunConfig,
    /// Checkpoints the chief writes.
    pub checkpoints: Option<CheckpointPolicy>,
    /// The checkpoint the run resumes from, which the chief reads.
    pub resume: Option<PathBuf>,
    /// Metrics for Prometheus: worker K serves them at this address's port + K.
    pub metrics: Option<SocketAddr>,
    /// The fault each worker injects in this start, by rank (drills and tests); empty for
    /// none.
    pub faults: Vec<Fault>,
    /// Where each worker writes its part of a trace: `worker-K.json` in this directory.
    pub trace_parts: Option<PathBuf>,
    /// A replica lost in place is replaced while the run goes on (`--rejoin`): the survivors
    /// run one update at a time until its replacement joins.
    #[serde(default)]
    pub rejoin: bool,
}

impl WorkerRun {
    /// A start of `run` with nothing around it.
    pub fn of(run: RunConfig) -> Self {
        WorkerRun {
            format: WORKER_RUN_FORMAT,
            run,
            checkpoints: None,
            resume: None,
            metrics: None,
            faults: Vec::new(),
            trace_parts: None,
            rejoin: false,
        }
    }

    /// The file's text.
    ///
    /// # Errors
    /// [`StageError::Config`] for a value JSON cannot hold (never, for a resolved run).
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string(self)
            .map_err(|e| StageError::Config(format!("writing the workers' run: {e}")))
    }

    /// Reads a file [`WorkerRun::to_json`] wrote and checks its run
    /// ([`RunConfig::check`]); `source` names it in errors. A file of another format is
    /// refused naming both formats; a bare run, as the release before this format wrote
    /// it, is read as a start with nothing around it.
    ///
    /// # Errors
    /// [`StageError::Config`] naming `source`: malformed text, another format, a run that
    /// does not hold together.
    pub fn from_json(text: &str, source: &str) -> Result<Self> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| StageError::Config(format!("{source}: {e}")))?;
        let Some(format) = value.get("format") else {
            return Ok(WorkerRun::of(RunConfig::from_json(text, source)?));
        };
        if format.as_u64() != Some(u64::from(WORKER_RUN_FORMAT)) {
            return Err(StageError::Config(format!(
                "{source}: a workers' run of format {format}, where this build reads format \
                 {WORKER_RUN_FORMAT}: start the workers with the same build as the launcher"
            )));
        }
        let mut de = serde_json::Deserializer::from_str(text);
        let read: WorkerRun = serde_path_to_error::deserialize(&mut de)
            .map_err(|e| StageError::Config(format!("{source}: {}: {}", e.path(), e.inner())))?;
        let run = read
            .run
            .checked()
            .map_err(|e| StageError::Config(format!("{source}: run: {e}")))?;
        Ok(WorkerRun { run, ..read })
    }

    /// Where worker `rank` serves its metrics.
    ///
    /// # Errors
    /// [`StageError::Config`] when the port would pass 65535.
    pub fn metrics_of(&self, rank: u32) -> Result<Option<SocketAddr>> {
        let Some(base) = self.metrics else {
            return Ok(None);
        };
        let port = u32::from(base.port()) + rank;
        let port = u16::try_from(port).map_err(|_| {
            StageError::Config(format!(
                "--metrics-addr {base}: worker {rank} would need port {port}"
            ))
        })?;
        Ok(Some(SocketAddr::new(base.ip(), port)))
    }

    /// The fault worker `rank` injects.
    pub fn fault_of(&self, rank: u32) -> Fault {
        self.faults
            .get(rank as usize)
            .copied()
            .unwrap_or(Fault::None)
    }

    /// The file worker `rank` writes its part of the trace to.
    pub fn trace_part_of(&self, rank: u32) -> Option<PathBuf> {
        self.trace_parts
            .as_ref()
            .map(|dir| dir.join(format!("worker-{rank}.json")))
    }
}

/// A private directory (mode 0700) of this process, removed when dropped: a start's
/// credentials, resolved run and shared-memory sockets, the drained states a launcher keeps
/// across starts, or the workers' parts of a run's trace.
pub(crate) struct LaunchDir(pub(crate) PathBuf);

impl LaunchDir {
    pub(crate) fn create(what: &str) -> Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path =
            std::env::temp_dir().join(format!("pipe-{what}-{}-{nanos:09}", std::process::id()));
        // Created closed to others (0700), not opened then closed: the workers' sockets for
        // shared memory live here too.
        pipe_transport::shm::private_dir(&path)
            .map_err(|e| failed(format!("creating {what} directory: {e}")))?;
        Ok(LaunchDir(path))
    }
}

impl Drop for LaunchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One worker process and what the launcher knows of it.
struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
    exit: Option<ExitStatus>,
}

/// Every worker process; dropping it kills and reaps any still running.
#[derive(Default)]
struct Workers(Vec<Worker>);

impl Workers {
    fn kill_all(&mut self) {
        for w in self.0.iter_mut().filter(|w| w.exit.is_none()) {
            let _ = w.child.kill();
        }
    }

    /// Reaps every worker that has exited since the last call; returns (rank, status) of each.
    fn reap(&mut self) -> Vec<(u32, ExitStatus)> {
        let mut out = Vec::new();
        for (rank, w) in self.0.iter_mut().enumerate() {
            if w.exit.is_none() {
                if let Ok(Some(status)) = w.child.try_wait() {
                    w.exit = Some(status);
                    out.push((rank as u32, status));
                }
            }
        }
        out
    }

    fn all_exited(&self) -> bool {
        self.0.iter().all(|w| w.exit.is_some())
    }

    /// After a worker's failure (`failing`: a worker's exit, the launcher's own failure), tells
    /// the others and gives them `grace` to end (`stop_by`), killing them past it, or at once
    /// on the launcher's failure. Returns whether every worker has exited.
    fn wind_down(
        &mut self,
        failing: (bool, bool),
        stop_by: &mut Option<Instant>,
        grace: Duration,
    ) -> bool {
        if (failing.0 || failing.1) && stop_by.is_none() {
            // Workers waiting for a word on a lost peer end as they are.
            self.tell(&LauncherWord::Fail.line());
            *stop_by = Some(Instant::now() + grace);
            if failing.1 {
                self.kill_all();
            }
        }
        if self.all_exited() {
            return true;
        }
        if stop_by.is_some_and(|t| Instant::now() > t) {
            self.kill_all();
        }
        false
    }

    /// On Ctrl-C here (or a layout change to come, `opts`): asks the chief to stop at its next
    /// drain point, after a checkpoint (it tells the others). Returns whether it asked.
    fn ask_chief_to_stop(&mut self, opts: &LaunchOptions) -> bool {
        let asked = opts.stop_at_first_drain
            || opts.stop.as_ref().is_some_and(|f| f.load(Ordering::SeqCst));
        if let Some(stdin) = self
            .0
            .first_mut()
            .and_then(|w| w.stdin.as_mut())
            .filter(|_| asked)
        {
            let _ = writeln!(stdin, "stop").and_then(|()| stdin.flush());
        }
        asked
    }

    /// Writes `line` to every running worker's standard input (one that has just died is
    /// reported when it is reaped).
    fn tell(&mut self, line: &str) {
        self.tell_but(line, None);
    }

    /// [`Workers::tell`], but not to rank `but` (a replacement, whose first line is its mesh).
    fn tell_but(&mut self, line: &str, but: Option<u32>) {
        for (rank, w) in self.0.iter_mut().enumerate() {
            if w.exit.is_some() || but == Some(rank as u32) {
                continue;
            }
            if let Some(stdin) = w.stdin.as_mut() {
                let _ = writeln!(stdin, "{line}").and_then(|()| stdin.flush());
            }
        }
    }

    /// Once every worker but the replacement `rank` has exited (the run ended before it
    /// joined): stops it and reaps it, its end no failure. Returns whether it did.
    fn abandon(&mut self, rank: u32) -> bool {
        let others_done =
            (self.0.iter().enumerate()).all(|(k, w)| k == rank as usize || w.exit.is_some());
        let Some(w) = self.0.get_mut(rank as usize).filter(|_| others_done) else {
            return false;
        };
        let _ = w.child.kill();
        w.exit = w.child.wait().ok();
        true
    }
}

/// Where the replacement of a worker lost in place stands (`--rejoin`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mend {
    /// Every rank has its worker (or a lost one is not replaced).
    Whole,
    /// The survivors connect their mesh without the lost rank; its replacement starts once
    /// they have.
    Regrouping(u32),
    /// The replacement has started; it says where it listens once ready.
    Starting(u32),
    /// The survivors were told it is ready: they connect a mesh with it at the chief's next
    /// drain point.
    Joining(u32),
    /// No replacement comes (no `--rejoin`, or its replacements kept failing): the run goes
    /// on short of it, a later loss on the segment path.
    Short,
}

/// How many replacements in a row may fail before they joined before the run goes on
/// without one.
const REPLACEMENT_TRIES: u32 = 3;

/// The launcher's side of replacing a worker lost in place (`--rejoin`).
struct Mender {
    mend: Mend,
    /// Replacements of the current loss that failed before they said where they listen.
    failed: u32,
    /// What starts a replacement: its arguments and where its lines go (none without
    /// `--rejoin` or `--max-restarts`).
    replacing: Option<(Vec<OsString>, Sender<Line>)>,
    /// The restarts a replacement takes one of ([`LaunchOptions::replacements`]).
    budget: Option<RestartPolicy>,
    /// The current loss is replaced.
    replace_this: bool,
    exe: PathBuf,
    dir: PathBuf,
}

impl Mender {
    /// Once every worker of a mesh was told where the others listen: the survivors' mesh
    /// without a lost worker starts its replacement; the mesh it joined makes the run whole
    /// again (returns true: another replica may be lost in place).
    ///
    /// # Errors
    /// The replacement cannot be started.
    fn told(&mut self, workers: &mut Workers, relay: &mut Relay<'_>) -> Result<bool> {
        match (self.mend, &self.replacing) {
            (Mend::Regrouping(r), Some((args, tx))) if self.replace_this => {
                if let Some(slot) = workers.0.get_mut(r as usize) {
                    *slot = spawn(&self.exe, args, &self.dir, r, tx)?;
                }
                relay.joining = Some((r, None));
                self.mend = Mend::Starting(r);
            }
            // No replacement (no `--rejoin`, or none left): the run stays short of it.
            (Mend::Regrouping(_), _) => self.mend = Mend::Short,
            (Mend::Joining(_), _) => {
                (self.mend, self.failed) = (Mend::Whole, 0);
                return Ok(true);
            }
            _ => {}
        }
        Ok(false)
    }

    /// When the replacement of rank `rank` ended with `status` before it said where it
    /// listens: starts another, or after [`REPLACEMENT_TRIES`] the run goes on short of the
    /// replica (a later loss then takes the segment path). Returns whether the exit was such a
    /// replacement's, and so no failure of the run.
    ///
    /// # Errors
    /// Another replacement cannot be started.
    fn replacement_failed(
        &mut self,
        rank: u32,
        status: ExitStatus,
        workers: &mut Workers,
        relay: &mut Relay<'_>,
    ) -> Result<bool> {
        if self.mend != Mend::Starting(rank) || status.success() {
            return Ok(false);
        }
        self.failed += 1;
        let how = describe(status);
        if self.failed >= REPLACEMENT_TRIES {
            let _ = writeln!(
                std::io::stderr(),
                "warning: worker {rank}'s replacement {how} before it joined, {} times in a row; the run goes on without it",
                self.failed
            );
            relay.joining = None;
            self.mend = Mend::Short;
            workers.tell_but(&LauncherWord::Unreplaced(rank).line(), Some(rank));
            return Ok(true);
        }
        let _ = writeln!(
            std::io::stderr(),
            "warning: worker {rank}'s replacement {how} before it joined; starting another"
        );
        self.mend = Mend::Regrouping(rank);
        self.told(workers, relay)?;
        Ok(true)
    }

    /// Once the replacement says where it listens: tells the survivors, who connect a mesh
    /// with it at the chief's next drain point, and returns true (a mesh to collect). Also
    /// stops a replacement the run ended without.
    fn ready(&mut self, workers: &mut Workers, relay: &mut Relay<'_>) -> bool {
        if self.mend.pending().is_some_and(|r| workers.abandon(r)) {
            self.mend = Mend::Whole;
            return false;
        }
        let (Mend::Starting(r), Some((_, Some(at)))) = (self.mend, &relay.joining) else {
            return false;
        };
        let n = relay.listening.len() as u32;
        relay.listening = (0..n).map(|k| (k == r).then(|| at.clone())).collect();
        relay.joining = None;
        workers.tell_but(&LauncherWord::Join(r).line(), Some(r));
        self.mend = Mend::Joining(r);
        true
    }
}

impl Mender {
    /// The launcher's mender: it replaces lost workers when `opts` says so, starting `exe`
    /// with the workers' `args` and `--replacing`, in `dir`, its lines to `tx`.
    fn new(
        opts: &LaunchOptions,
        (exe, args): (&Path, &[OsString]),
        dir: &Path,
        tx: &Sender<Line>,
    ) -> Self {
        Mender {
            mend: Mend::Whole,
            failed: 0,
            replacing: opts.rejoin.then(|| {
                let mut args = args.to_vec();
                args.push("--replacing".into());
                (args, tx.clone())
            }),
            budget: opts.replacements.clone(),
            replace_this: false,
            exe: exe.to_path_buf(),
            dir: dir.to_path_buf(),
        }
    }

    /// Whether the loss of worker `rank`, which the run goes on without in place, is
    /// replaced: under `--rejoin` always, under `--max-restarts` while restarts are left (this
    /// one takes one, and says so), else never.
    fn replaces_next_loss(&mut self, rank: u32) -> bool {
        self.replace_this = match (&self.replacing, &self.budget) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(_), Some(budget)) => {
                let number = budget.take_restart();
                let of = budget.max_restarts;
                let _ = match number {
                    Some(n) => writeln!(
                        std::io::stderr(),
                        "restart {n} of {of}: worker {rank} alone, live: its replacement takes its stage's state from a surviving replica"
                    ),
                    None => writeln!(
                        std::io::stderr(),
                        "warning: no restart left for worker {rank} (--max-restarts {of}): the run goes on without it"
                    ),
                };
                number.is_some()
            }
        };
        self.replace_this
    }
}

impl Mend {
    /// The replacement's rank while it is not yet part of the run.
    fn pending(self) -> Option<u32> {
        match self {
            Mend::Starting(r) | Mend::Joining(r) => Some(r),
            Mend::Whole | Mend::Regrouping(_) | Mend::Short => None,
        }
    }
}

/// Tells every worker that `rank` ended with `status` and the others go on without it: they
/// connect a mesh of their own and report where they listen again. Returns the listening
/// slots to fill, the lost rank's already marked absent.
fn go_on_without(
    workers: &mut Workers,
    (rank, replaced): (u32, bool),
    status: ExitStatus,
    n: u32,
) -> Vec<Option<String>> {
    let how = describe(status);
    workers.tell(
        &LauncherWord::Lost {
            rank,
            replaced,
            how,
        }
        .line(),
    );
    (0..n)
        .map(|r| (r == rank).then(|| pipe_transport::registration::ABSENT.into()))
        .collect()
}

/// Whether a worker process that ended with `status` died (killed by a signal, or a panic)
/// rather than failed with an error of its own: the loss a run goes on without in place.
fn died(status: ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt as _;
    status.signal().is_some() || status.code() == Some(101)
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.kill_all();
        for w in self.0.iter_mut().filter(|w| w.exit.is_none()) {
            let _ = w.child.wait();
        }
    }
}

/// A replacement ready to join waits for the survivors' mesh without a deadline: they connect
/// it at the chief's next drain point, which may be a long segment away (a lost replica's
/// segment is taken over to its end); a stall there is the stall timeout's to find.
const JOIN_UNBOUNDED: Option<Instant> = None;

/// How long after a worker's output ended the launcher looks for its exit every millisecond,
/// so that its process is reaped within milliseconds of its end, not at the next 50 ms tick.
const ENDING_REAPED_WITHIN: Duration = Duration::from_millis(200);

/// A line of a worker's output.
struct Line {
    rank: u32,
    stderr: bool,
    /// The line; `None` once the stream has ended (its process is ending or gone).
    text: Option<String>,
}

/// The most bytes of one line of a worker's output the launcher keeps: far past any record
/// (a `Done` record naming every checkpoint of a long run is a few MB); the rest of a longer
/// line is read and dropped, so a worker cannot grow the launcher's memory without end.
const MAX_WORKER_LINE: usize = 64 << 20;

/// Forwards `stream`'s lines to `tx` on a thread of its own, and then that it ended. A line
/// that is not UTF-8 (a native library's bytes on the worker's standard error) is forwarded
/// with U+FFFD in their place, and the lines after it are read on: the stream is read to its
/// end, so the worker never finds its output closed.
fn relay(rank: u32, stderr: bool, stream: impl Read + Send + 'static, tx: Sender<Line>) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        while let Ok(true) = read_line_bounded(&mut reader, &mut line, MAX_WORKER_LINE) {
            let text = Some(String::from_utf8_lossy(&line).into_owned());
            if tx.send(Line { rank, stderr, text }).is_err() {
                return;
            }
        }
        let _ = tx.send(Line {
            rank,
            stderr,
            text: None,
        });
    });
}

/// Reads the next line of `reader` into `line`, without its `\n` or `\r\n`, keeping at most
/// `max` bytes of it (the rest is read and dropped). `Ok(false)` at the end of the stream.
fn read_line_bounded(
    reader: &mut impl BufRead,
    line: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<bool> {
    line.clear();
    let mut read_any = false;
    loop {
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(read_any);
        }
        read_any = true;
        let end = buf.iter().position(|&b| b == b'\n');
        let take = end.unwrap_or(buf.len());
        let room = max.saturating_sub(line.len());
        line.extend_from_slice(&buf[..take.min(room)]);
        reader.consume(end.map_or(take, |at| at + 1));
        if end.is_some() {
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            return Ok(true);
        }
    }
}

/// How a worker process ended, in words.
fn describe(status: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt as _;
        if let Some(signal) = status.signal() {
            return format!("was killed by signal {signal}");
        }
    }
    match status.code() {
        Some(code) => format!("exited with status {code}"),
        None => "ended".into(),
    }
}

/// Starts rank `rank`'s worker process: `exe args --cluster DIR/cluster.toml --rank K
/// --launched`.
fn spawn(
    exe: &Path,
    args: &[OsString],
    dir: &Path,
    rank: u32,
    tx: &Sender<Line>,
) -> Result<Worker> {
    let mut child = Command::new(exe)
        .args(args)
        .arg("--cluster")
        .arg(dir.join("cluster.toml"))
        .arg("--rank")
        .arg(rank.to_string())
        .arg("--launched")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| failed(format!("starting worker {rank} ({}): {e}", exe.display())))?;
    if let Some(out) = child.stdout.take() {
        relay(rank, false, out, tx.clone());
    }
    if let Some(err) = child.stderr.take() {
        relay(rank, true, err, tx.clone());
    }
    let stdin = child.stdin.take();
    Ok(Worker {
        child,
        stdin,
        exit: None,
    })
}

/// What the relay loop has seen so far.
struct Relay<'r> {
    on_record: &'r mut dyn LaunchEvents,
    listening: Vec<Option<String>>,
    failure: Option<StageError>,
    /// A replacement that has started ([`Mend::Starting`]): its rank, and where it listens
    /// once it has said, kept apart from the survivors' mesh.
    joining: Option<(u32, Option<String>)>,
}

impl Relay<'_> {
    /// A [`HOSTING`] line (`RANK ADDRESS`): the address of a lost rank's endpoint that a
    /// survivor hosts, taken only into that rank's slot while it is marked absent (a mesh of
    /// the survivors is being set up); anything else is ignored.
    fn hosted(&mut self, line: &str) {
        let Some((rank, addr)) = line.trim().split_once(' ') else {
            return;
        };
        let Ok(rank) = rank.parse::<usize>() else {
            return;
        };
        if let Some(slot) = self
            .listening
            .get_mut(rank)
            .filter(|s| s.as_deref() == Some(pipe_transport::registration::ABSENT))
        {
            *slot = Some(addr.trim().to_string());
        }
    }

    /// Worker `rank` ended with `status`, and the others go on without it.
    fn lost(&mut self, rank: u32, status: ExitStatus) {
        if let Err(e) = self.on_record.lost(rank, &describe(status)) {
            self.failure.get_or_insert(e);
        }
    }

    /// Handles one line of a worker's output.
    fn line(&mut self, line: Line) {
        let Line { rank, stderr, text } = line;
        let Some(text) = text else { return };
        if !stderr {
            if let Some(json) = text.strip_prefix(RECORD) {
                if let Err(e) = self.on_record.record(rank, json) {
                    self.failure.get_or_insert(e);
                }
                return;
            }
            if let Some(hosted) = text.strip_prefix(HOSTING) {
                self.hosted(hosted);
                return;
            }
            if let Some(addr) = text.strip_prefix(LISTENING) {
                if let Some((_, at)) = self.joining.as_mut().filter(|(r, _)| *r == rank) {
                    *at = Some(addr.trim().to_string());
                } else if let Some(slot) = self.listening.get_mut(rank as usize) {
                    *slot = Some(addr.trim().to_string());
                }
                return;
            }
        }
        // Standard error is where the launcher's user reads; if it is gone, there is no one
        // to tell.
        let _ = writeln!(std::io::stderr(), "worker {rank}: {text}");
    }
}

/// How a run ended, one type for every placement: worker processes as the chief reported it,
/// threads as the launch gathers it.
#[derive(Debug)]
pub struct RunEnd {
    /// The last epoch's figures (none if it stopped before one ended).
    pub last: Option<EpochStats>,
    /// Updates done.
    pub steps: u64,
    /// The final weights' digest.
    pub weights: u64,
    /// Checkpoints written.
    pub checkpoints: Vec<PathBuf>,
    /// Stopped early after this many updates.
    pub stopped: Option<u64>,
    /// The partition the run ended on (none for one worker over the whole model; the launch
    /// sets it from the layout the run ended on).
    pub partition: Option<crate::config::PartitionChoice>,
}

/// What a launcher hands on from its workers as they run: their [`RECORD`] lines, and each
/// worker it sees lost before the run goes on without it. A closure takes the records alone.
pub trait LaunchEvents {
    /// A worker's [`RECORD`] line (its JSON), from worker `rank`.
    ///
    /// # Errors
    /// A record that does not parse, or that its handler fails on: the run fails with it.
    fn record(&mut self, rank: u32, json: &str) -> Result<()>;

    /// Worker `rank` died (`cause`, as its status reads), and the others go on without it.
    ///
    /// # Errors
    /// As for [`LaunchEvents::record`].
    fn lost(&mut self, rank: u32, cause: &str) -> Result<()> {
        let _ = (rank, cause);
        Ok(())
    }
}

impl<F: FnMut(u32, &str) -> Result<()>> LaunchEvents for F {
    fn record(&mut self, rank: u32, json: &str) -> Result<()> {
        self(rank, json)
    }
}

/// What a launched run's chief has reported so far, and its observer: every rank's stop point
/// and divergence, the run's records from the chief only.
struct ChiefReports<'o> {
    obs: &'o mut dyn Observer,
    last: Option<EpochStats>,
    done: Option<(u64, u64, Vec<PathBuf>, Option<u64>)>,
    stops: Vec<StopReport>,
    diverged: Option<StageError>,
    /// When the chief's training began, by the system clock: the origin of its records'
    /// times, which a loss seen here is dated on.
    began: Option<std::time::SystemTime>,
}

impl LaunchEvents for ChiefReports<'_> {
    fn record(&mut self, rank: u32, json: &str) -> Result<()> {
        let record = serde_json::from_str::<Record>(json)
            .map_err(|e| failed(format!("a worker's record: {e}")))?;
        let obs = &mut *self.obs;
        match record {
            Record::Stop(report) => self.stops.push(report),
            Record::Diverged { update, message } => {
                self.diverged.get_or_insert(StageError::WorkerDiverged {
                    worker: rank,
                    update,
                    message,
                });
            }
            Record::Recovery { phase, at } => {
                let at = std::time::UNIX_EPOCH.checked_add(at);
                obs.on_recovery(&crate::train::RecoveryStats {
                    worker: rank,
                    phase,
                    elapsed_s: at.and_then(|at| since(self.began, at)),
                })?;
            }
            _ if rank != 0 => {}
            Record::Began(since_epoch) => {
                let at = std::time::UNIX_EPOCH
                    .checked_add(since_epoch)
                    .ok_or_else(|| {
                        failed("a chief's start past the system clock's range".into())
                    })?;
                self.began = Some(at);
                obs.on_training_began(at)?;
            }
            Record::Phase(p) => obs.on_start_phase(p)?,
            Record::Layout(change) => obs.on_layout_change(&change)?,
            Record::Step(s) => obs.on_step(&s)?,
            Record::Eval(e) => obs.on_eval(&e)?,
            Record::Epoch(e) => {
                obs.on_epoch(&e)?;
                self.last = Some(e);
            }
            Record::Done {
                steps,
                weights,
                checkpoints,
                stopped,
            } => self.done = Some((steps, weights, checkpoints, stopped)),
        }
        Ok(())
    }

    fn lost(&mut self, rank: u32, cause: &str) -> Result<()> {
        self.obs.on_lost(&crate::train::LostStats {
            worker: rank,
            cause: cause.to_string(),
            elapsed_s: since(self.began, std::time::SystemTime::now()),
        })
    }
}

/// Seconds from `began` (the chief's training began) to `at`: a time on the clock of the
/// chief's records. `None` before the chief said when it began, or for a time before that.
fn since(began: Option<std::time::SystemTime>, at: std::time::SystemTime) -> Option<f64> {
    began
        .and_then(|t| at.duration_since(t).ok())
        .map(|d| d.as_secs_f64())
}

/// Runs `start.run` (a pipelined run with its partition settled) as `opts.workers` worker
/// processes of this executable, reporting the chief's steps and epochs to `obs`. Each worker
/// is handed `start` as JSON (`pipe worker --run FILE`, [`WorkerRun::to_json`]): it reads it
/// back and checks it, and resolves nothing again.
///
/// # Errors
/// As [`launch`]; a metrics port past 65535; a chief that ends without reporting the run's
/// end.
pub fn run_processes(
    start: &WorkerRun,
    opts: &LaunchOptions,
    obs: &mut dyn Observer,
) -> Result<RunEnd> {
    let cfg = &start.run;
    for rank in 0..opts.workers {
        start.metrics_of(rank)?;
    }
    let json = start.to_json()?;
    let mut reports = ChiefReports {
        obs,
        last: None,
        done: None,
        stops: Vec::new(),
        diverged: None,
        began: None,
    };
    let command = |dir: &Path| -> Vec<OsString> {
        vec!["worker".into(), "--run".into(), dir.join("run.json").into()]
    };
    if let Err(e) = launch(opts, &[("run.json", &json)], &command, &mut reports) {
        // A divergence is the run's own failure, whichever worker exited first because of it.
        return Err(
            match (
                reports.diverged,
                stall_report(cfg, &reports.stops, opts.workers),
            ) {
                (Some(d), _) => d,
                (None, Some(report)) => StageError::Stalled(report),
                (None, None) => e,
            },
        );
    }
    let last = reports.last;
    let (steps, weights, checkpoints, stopped) = reports
        .done
        .ok_or_else(|| failed("the chief ended without reporting the run's end".into()))?;
    Ok(RunEnd {
        last,
        steps,
        weights,
        checkpoints,
        stopped,
        partition: None,
    })
}

/// The hang doctor's report on a run of worker processes that stalled: the schedule of the
/// segment the stalled worker was in, rebuilt from `cfg`, and every worker's reported stop
/// point (a worker that sent none is reported as such). `None` when no worker stalled.
fn stall_report(cfg: &RunConfig, stops: &[StopReport], workers: u32) -> Option<String> {
    let stalled = stops.iter().find(|r| r.stalled.is_some())?;
    let (awaited, waited) = stalled.awaited()?;
    let spec = cfg.schedule_spec_of(
        stalled.policy,
        pipe_scheduler::Length::Updates(stalled.updates),
    );
    let model = crate::model::Model::new(&cfg.model).ok()?;
    let plan = super::RunPlan::new(&model, &spec, None).ok()?;
    let points: Vec<_> = (0..workers)
        .map(|w| {
            let program = plan.schedule.programs.get(w as usize)?;
            stops
                .iter()
                .find(|r| r.rank == w)
                .map(|r| r.stop_point(program))
        })
        .collect();
    Some(diagnose(
        &plan.schedule,
        &points,
        stalled.rank,
        &awaited,
        waited,
    ))
}

/// Runs `opts.workers` processes of this executable, each `command(dir)` followed by
/// `--cluster DIR/cluster.toml --rank K --launched`, where `dir` is a private directory
/// holding fresh cluster credentials for loopback and `files` (name, contents). Hands every
/// [`RECORD`] line of a worker's standard output to `on_record` (rank, JSON), and each worker
/// the others go on without in place ([`LaunchEvents::lost`]), and relays every other line to
/// standard error, prefixed with the rank.
///
/// # Errors
/// The first worker failure (its exit and, on standard error, its message; bad input when it
/// exited with status 2), a worker that does not start, an error of `on_record`. Every worker
/// process has been reaped by then.
pub fn launch(
    opts: &LaunchOptions,
    files: &[(&str, &str)],
    command: &dyn Fn(&Path) -> Vec<OsString>,
    on_record: &mut dyn LaunchEvents,
) -> Result<()> {
    let n = opts.workers;
    let dir = launch_dir(n, files)?;
    let exe =
        std::env::current_exe().map_err(|e| failed(format!("finding this executable: {e}")))?;
    let args = command(&dir.0);
    let (tx, rx) = unbounded();
    let mut workers = Workers::default();
    for rank in 0..n {
        workers.0.push(spawn(&exe, &args, &dir.0, rank, &tx)?);
    }
    // What starts a replacement, while the run may take one (`--rejoin`).
    let mut mender = Mender::new(opts, (&exe, &args), &dir.0, &tx);
    drop(tx);
    let mut relay = Relay {
        on_record,
        listening: vec![None; n as usize],
        failure: None,
        joining: None,
    };
    // By when the mesh being formed must be bound; none for a join ([`JOIN_UNBOUNDED`]).
    let mut start_by = Some(Instant::now() + opts.connect_timeout);
    let mut told = false;
    // The worker the others went on without in place (once until its replacement joined),
    // and how it ended.
    let mut lost_in_place: Option<(u32, ExitStatus)> = None;
    let mut stop_by: Option<Instant> = None;
    let mut first_exit: Option<(u32, ExitStatus)> = None;
    let mut first_at: Option<Instant> = None;
    let mut stop_sent = false;
    // Until when an ended worker is looked for every millisecond ([`ENDING_REAPED_WITHIN`]).
    let mut ending_until: Option<Instant> = None;
    loop {
        stop_sent = stop_sent || (told && workers.ask_chief_to_stop(opts));
        let ending = ending_until.is_some_and(|t| Instant::now() < t);
        let wait = Duration::from_millis(if ending { 1 } else { 50 });
        match rx.recv_timeout(wait) {
            Ok(line) => {
                if line.text.is_none() {
                    ending_until = Some(Instant::now() + ENDING_REAPED_WITHIN);
                }
                relay.line(line);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => std::thread::sleep(Duration::from_millis(50)),
        }
        if !told && relay.listening.iter().all(Option::is_some) {
            let addrs = relay.listening.iter().flatten().cloned().collect();
            workers.tell(&LauncherWord::Peers(addrs).line());
            told = true;
            if mender.told(&mut workers, &mut relay)? {
                lost_in_place = None;
            }
        }
        if mender.ready(&mut workers, &mut relay) {
            (told, start_by) = (false, JOIN_UNBOUNDED);
        }
        if !told && start_by.is_some_and(|t| Instant::now() > t) && relay.failure.is_none() {
            relay.failure = Some(failed(format!(
                "the worker processes did not all bind a port within {:?}",
                opts.connect_timeout
            )));
        }
        for (rank, status) in workers.reap() {
            let in_place = opts.in_place.as_ref().is_some_and(|f| (f.0)(rank));
            let first = lost_in_place.is_none() && first_exit.is_none() && relay.failure.is_none();
            if told && first && in_place && died(status) && mender.mend == Mend::Whole {
                lost_in_place = Some((rank, status));
                relay.lost(rank, status);
                let replaced = mender.replaces_next_loss(rank);
                relay.listening = go_on_without(&mut workers, (rank, replaced), status, n);
                (told, start_by) = (false, Some(Instant::now() + opts.connect_timeout));
                mender.mend = Mend::Regrouping(rank);
                continue;
            }
            // A replacement that failed before it joined leaves the survivors running: another
            // is started, or the run goes on without one.
            let calm = first_exit.is_none() && relay.failure.is_none();
            if calm && mender.replacement_failed(rank, status, &mut workers, &mut relay)? {
                continue;
            }
            // A replacement stopped with the others is no cause of their failure.
            let stopped_replacement = mender.mend.pending() == Some(rank) && first_exit.is_some();
            if !status.success()
                && !stopped_replacement
                && cause_first(first_exit.as_ref(), status, first_at)
            {
                first_exit = Some((rank, status));
                first_at.get_or_insert_with(Instant::now);
            }
        }
        let failing = (first_exit.is_some(), relay.failure.is_some());
        if workers.wind_down(failing, &mut stop_by, opts.grace) {
            break;
        }
    }
    // What the workers wrote before they exited.
    while let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
        relay.line(line);
    }
    drop(workers);
    // A run that failed while its workers went on without a lost one failed for that loss:
    // the workers start again without it.
    if let Some((rank, status)) = first_exit.and(lost_in_place).or(first_exit) {
        return Err(if status.code() == Some(2) {
            refused(format!("worker {rank} {}", describe(status)))
        } else {
            StageError::Exited {
                worker: rank,
                status: describe(status),
            }
        });
    }
    relay.failure.map_or(Ok(()), Err)
}

/// The launcher's private directory for `n` workers: the cluster file of a fresh run id
/// (every worker on loopback) and `files`.
///
/// # Errors
/// The directory or a file cannot be written.
fn launch_dir(n: u32, files: &[(&str, &str)]) -> Result<LaunchDir> {
    let dir = LaunchDir::create("launch")?;
    let run_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id()).rotate_left(40);
    let addrs = vec!["127.0.0.1:0".to_string(); n as usize];
    ClusterFile::init(&dir.0, &addrs, run_id, Existing::Refuse)?;
    for (name, contents) in files {
        std::fs::write(dir.0.join(name), contents)
            .map_err(|e| failed(format!("writing {name} for the workers: {e}")))?;
    }
    Ok(dir)
}

/// How a worker joins its cluster: what carries its links, and the settings every kind takes.
#[derive(Clone, Debug)]
pub struct JoinOptions {
    /// The run's transport choice: `auto` is shared memory for a launched worker (every
    /// worker of [`launch`] is on this host) and QUIC for a worker of a cluster file
    /// ([`TransportKind::for_processes`]).
    pub transport: TransportKind,
    /// The run id, wire, stall bound and connect timeout.
    pub settings: MeshSettings,
    /// Where workers on one host meet to set up shared memory: the launcher's private
    /// directory, or [`pipe_transport::shm::rendezvous_dir`] for a cluster file's workers.
    pub meet: PathBuf,
}

/// How soon after a failure the worker that caused it is still looked for among the exits.
const CAUSE_WINDOW: Duration = Duration::from_secs(1);

/// Whether an unsuccessful exit `status` is the run's failure rather than `first`, the one
/// taken so far: the first one, or a worker killed by a signal soon after another that only
/// exited. A peer over shared memory sees a killed process's end at once and exits on its
/// own, sometimes before the launcher has reaped the killed one; the signal names the cause.
fn cause_first(
    first: Option<&(u32, ExitStatus)>,
    status: ExitStatus,
    first_at: Option<Instant>,
) -> bool {
    use std::os::unix::process::ExitStatusExt as _;
    match first {
        None => true,
        Some((_, taken)) => {
            let soon = first_at.is_none_or(|t| t.elapsed() < CAUSE_WINDOW);
            taken.signal().is_none() && status.signal().is_some() && soon
        }
    }
}

/// Joins a cluster as rank `rank`, over the kind `opts.transport` picks for a worker process
/// (the transport crate's registry, [`pipe_transport::kinds`]). A launched worker ([`launch`])
/// reports where it listens and reads everyone's from the launcher, then exits when the
/// launcher goes away; otherwise network addresses come from the cluster file, each resolved
/// with retries until the connect timeout (under Kubernetes a peer's name resolves only once
/// its pod exists).
///
/// # Errors
/// Addresses that do not resolve in time, sockets that cannot be bound, peers that never
/// connect or are refused (named), a launcher's malformed address line.
pub fn join(
    cluster: &ClusterFile,
    rank: u32,
    listen: Option<SocketAddr>,
    opts: JoinOptions,
    launched: Option<Arc<AtomicBool>>,
) -> Result<Joined> {
    let launched = launched.map(|stop| (stop, None));
    join_with(
        cluster,
        rank,
        listen,
        opts,
        launched,
        &InterruptSlot::default(),
    )
}

/// [`join`] for a launched worker that goes on in place after a lost peer: also returns the
/// way to its launcher's word and to the survivors' mesh ([`super::recover::Remesh`]).
///
/// # Errors
/// As [`join`].
pub fn join_launched(
    cluster: &ClusterFile,
    rank: u32,
    opts: JoinOptions,
    stop: Arc<AtomicBool>,
) -> Result<(Joined, LaunchedRemesh)> {
    let (tx, words) = unbounded();
    let interrupt = InterruptSlot::default();
    let launched = Some((stop, Some(tx)));
    let joined = join_with(cluster, rank, None, opts.clone(), launched, &interrupt)?;
    let remesh = LaunchedRemesh {
        words,
        held: std::collections::VecDeque::new(),
        unreplaced: false,
        cluster: cluster.clone(),
        rank,
        opts,
        interrupt,
    };
    Ok((joined, remesh))
}

/// [`join`], with what a launched worker's standard input says after the first line sent to
/// `words` where given, and the connected endpoint's [`Interrupter`] left in `interrupt`.
fn join_with(
    cluster: &ClusterFile,
    rank: u32,
    listen: Option<SocketAddr>,
    opts: JoinOptions,
    launched: Option<(Arc<AtomicBool>, Option<Sender<LauncherWord>>)>,
    interrupt: &InterruptSlot,
) -> Result<Joined> {
    let kind = opts.transport.for_processes(launched.is_some());
    let deadline = Instant::now() + opts.settings.connect_timeout;
    let addr = match (listen, kind.is_networked()) {
        (Some(a), _) => a,
        (None, true) => resolve(cluster, rank, deadline)?,
        (None, false) => SocketAddr::from(([127, 0, 0, 1], 0)),
    };
    if launched.is_none() {
        // The meeting directory's parent is this user's own too.
        if let Some(parent) = opts.meet.parent() {
            pipe_transport::shm::private_dir(parent)?;
        }
    }
    let at = Listen {
        addr,
        meet: opts.meet,
    };
    let bound = kinds::bind(kind, cluster, rank, &at, &opts.settings).map_err(|e| {
        // A credential file that cannot be read or parsed, or an address this host cannot
        // listen at, is the user's to fix.
        let bad_input = e.is_bad_input();
        StageError::Launch {
            why: format!("worker {rank} binding {kind} at {addr}: {e}"),
            bad_input,
        }
    })?;
    // Where the launcher's word that a peer was lost stops this endpoint's blocked calls at
    // once (a transport that would notice only by the peer's silence).
    let peers = match launched {
        Some((stop, words)) => {
            announce(&bound.address()?)?;
            let words = words.map(|w| (w, interrupt.clone()));
            launcher_line(cluster.size(), stop, words)?
        }
        None if bound.needs_addresses() => (0..cluster.size())
            .map(|r| resolve(cluster, r, deadline).map(|a| a.to_string()))
            .collect::<Result<Vec<_>>>()?,
        None => Vec::new(),
    };
    let joined = bound.connect(&peers)?;
    if let Ok(mut slot) = interrupt.lock() {
        *slot = joined.endpoint.interrupter();
    }
    Ok(joined)
}

/// Where a launched worker's endpoint leaves the handle that stops its blocked calls, once it
/// is connected, for the thread that reads the launcher's word.
type InterruptSlot = Arc<std::sync::Mutex<Option<Interrupter>>>;

/// A launched worker's way to its launcher's word and to the survivors' mesh after a lost
/// peer: a new endpoint of the same kind and rank, reported to the launcher as at the start.
pub struct LaunchedRemesh {
    words: crossbeam_channel::Receiver<LauncherWord>,
    /// Words read while looking for another (a loss seen while asking for a replacement).
    held: std::collections::VecDeque<LauncherWord>,
    cluster: ClusterFile,
    rank: u32,
    opts: JoinOptions,
    /// Where the current mesh's [`Interrupter`] is kept for the launcher's word of a loss.
    interrupt: InterruptSlot,
    /// The launcher said no replacement comes for the current loss
    /// ([`LauncherWord::Unreplaced`]), and the chief has not yet asked.
    unreplaced: bool,
}

impl LaunchedRemesh {
    /// The launcher's next word, held ones first, waited for until `deadline`; a word that no
    /// replacement comes is noted on the way, whatever the caller waits for.
    fn next_word(&mut self, deadline: Instant) -> Option<LauncherWord> {
        loop {
            let word = self
                .held
                .pop_front()
                .or_else(|| self.words.recv_deadline(deadline).ok())?;
            match word {
                LauncherWord::Unreplaced(_) => self.unreplaced = true,
                word => return Some(word),
            }
        }
    }

    /// The run's mesh anew, `absent` (a lost rank, and this worker's mesh so far) marked so
    /// by the launcher: this worker's mesh regrouped on its connections where its transport
    /// can ([`pipe_transport::Transport::regroup`], QUIC), else a new endpoint of the same
    /// kind and rank; either way the launcher is told where this worker listens, and the mesh
    /// connects where it says. `hosting`: the survivor that would host the lost rank, and
    /// whether this worker does. A host says so to the launcher, which names it in the lost
    /// rank's place: a regrouping host at its own address, carrying the lost rank on its
    /// connections ([`pipe_transport::Transport::regroup`]); any other with an
    /// endpoint of that rank, bound, announced first and connected on a thread of its own.
    fn connect_mesh(
        &mut self,
        what: &str,
        (absent, (adopter, host)): (
            Option<(u32, &mut dyn pipe_transport::Transport)>,
            super::recover::Hosting,
        ),
    ) -> Result<Remeshed> {
        let rank = self.rank;
        let (lost, mut regrouping) = match absent {
            Some((lost, ep)) => (Some(lost), Some(ep)),
            None => (None, None),
        };
        // This worker's own place: its mesh so far where it regroups, else a new endpoint.
        let readied = match regrouping.as_mut() {
            Some(ep) => ep
                .regroup_address()
                .transpose()
                .map_err(|e| failed(format!("worker {rank} readying its mesh to go on: {e}")))?,
            None => None,
        };
        let hosted = match (lost.filter(|_| host), &readied) {
            (Some(lost), Some(own)) => {
                announce_hosted(lost, own)?;
                None
            }
            (Some(lost), None) => {
                let b = self.bind(lost)?;
                announce_hosted(lost, &b.address()?)?;
                Some(b)
            }
            (None, _) => None,
        };
        let bound = match readied {
            Some(addr) => {
                announce(&addr)?;
                None
            }
            None => {
                let b = self.bind(rank)?;
                announce(&b.address()?)?;
                Some(b)
            }
        };
        let peers = self.named_peers(what)?;
        if lost.is_some() {
            RecordWriter::recovery(crate::train::RecoveryPhase::Named)?;
        }
        let lost_at = lost.and_then(|r| {
            peers
                .get(r as usize)
                .filter(|a| *a != pipe_transport::registration::ABSENT)
                .cloned()
        });
        let hosted = match hosted {
            Some(b) => Some(connect_on_thread("pipe-connect-hosted", b, peers.clone())?),
            None => None,
        };
        let (endpoint, hosted_here) = match (bound, regrouping, lost) {
            (Some(bound), ..) => {
                let (words, held) = (&self.words, &mut self.held);
                let joined =
                    connect_watching((bound, peers), rank, words, held, CONNECT_AFTER_A_LOSS)?;
                (joined.endpoint as Box<dyn pipe_transport::Transport>, None)
            }
            (None, Some(ep), Some(lost)) => {
                let going_on = |e: pipe_transport::TransportError| {
                    failed(format!("worker {rank} going on without worker {lost}: {e}"))
                };
                ep.regroup(lost, adopter.filter(|_| lost_at.is_some()))
                    .map_err(going_on)?
            }
            (None, ..) => return Err(failed(format!("worker {rank}: no mesh {what}"))),
        };
        if let Ok(mut slot) = self.interrupt.lock() {
            *slot = endpoint.interrupter();
        }
        let hosted = match hosted {
            Some(rx) => {
                let ended = || failed("the thread connecting a hosted rank ended".to_string());
                Some(rx.recv().map_err(|_| ended())??.endpoint)
            }
            None => hosted_here,
        };
        Ok(Remeshed {
            ep: endpoint,
            hosted,
            lost_hosted: lost_at.is_some(),
        })
    }

    /// An endpoint of rank `r`, of this run's kind, bound where this worker binds.
    fn bind(&self, r: u32) -> Result<kinds::Bound> {
        let kind = self.opts.transport.for_processes(true);
        let at = Listen {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            meet: self.opts.meet.clone(),
        };
        let rank = self.rank;
        kinds::bind(kind, &self.cluster, r, &at, &self.opts.settings)
            .map_err(|e| failed(format!("worker {rank} binding {kind} for rank {r}: {e}")))
    }

    /// Every worker's address, as the launcher names them once each has said where it
    /// listens (the mesh `what` is for, in its error).
    fn named_peers(&mut self, what: &str) -> Result<Vec<String>> {
        let rank = self.rank;
        let deadline = Instant::now() + self.opts.settings.connect_timeout;
        let peers = loop {
            match self.next_word(deadline) {
                Some(LauncherWord::Peers(p)) => break p,
                Some(LauncherWord::Fail) | None => {
                    return Err(failed(format!(
                        "worker {rank}: the launcher named no mesh {what}"
                    )));
                }
                Some(
                    LauncherWord::Lost { .. } | LauncherWord::Join(_) | LauncherWord::Unreplaced(_),
                ) => {}
            }
        };
        if peers.len() != self.cluster.size() as usize {
            return Err(refused(format!(
                "the launcher named {} addresses for {} workers",
                peers.len(),
                self.cluster.size()
            )));
        }
        Ok(peers)
    }
}

/// Connects `bound` to `peers` on a thread named `name`: the connect's end comes on the
/// returned channel.
fn connect_on_thread(
    name: &str,
    bound: kinds::Bound,
    peers: Vec<String>,
) -> Result<crossbeam_channel::Receiver<std::result::Result<Joined, pipe_transport::TransportError>>>
{
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _ = tx.send(bound.connect(&peers));
        })
        .map_err(|e| failed(format!("starting a thread to connect: {e}")))?;
    Ok(rx)
}

/// How long a connect may go on once the launcher said a worker of the mesh was lost
/// ([`connect_watching`]).
const CONNECT_AFTER_A_LOSS: Duration = Duration::from_secs(2);

/// Connects `bound` to `peers` on a thread of its own while watching the launcher's `words`,
/// which it keeps in `held` for the caller. A worker lost meanwhile (a replacement killed as
/// it joins) gives the connect `grace` to finish: the lost worker may have connected before
/// it died (the next segment then meets the loss), or not, and the connect would wait for it
/// up to the connect timeout; it fails instead, and the run goes on from its last drain
/// point. The launcher's word that the run is stopping ends the wait at once. An abandoned
/// connect ends by itself, and its endpoint is dropped.
///
/// # Errors
/// The connect's own; a loss the connect did not finish within `grace` of; the run stopping.
fn connect_watching(
    (bound, peers): (kinds::Bound, Vec<String>),
    rank: u32,
    words: &crossbeam_channel::Receiver<LauncherWord>,
    held: &mut std::collections::VecDeque<LauncherWord>,
    grace: Duration,
) -> Result<Joined> {
    let joined = connect_on_thread("pipe-connect", bound, peers)?;
    let ended = || failed("the thread connecting this worker ended".to_string());
    let mut lost: Option<(u32, Instant)> = None;
    loop {
        let give_up = lost.map(|(_, at)| at + grace);
        let timer = give_up.map_or_else(crossbeam_channel::never, crossbeam_channel::at);
        crossbeam_channel::select! {
            recv(joined) -> j => return Ok(j.map_err(|_| ended())??),
            recv(words) -> word => match word {
                // The run is ending: the mesh would wait for workers that are stopping.
                Ok(LauncherWord::Fail) => {
                    return Err(failed(format!(
                        "worker {rank}: the run stopped while the mesh connected"
                    )));
                }
                Ok(word) => {
                    if let LauncherWord::Lost { rank, .. } = &word {
                        lost.get_or_insert((*rank, Instant::now()));
                    }
                    held.push_back(word);
                }
                // The launcher is gone: this process ends with its standard input.
                Err(_) => return Ok(joined.recv().map_err(|_| ended())??),
            },
            recv(timer) -> _ => {
                let gone = lost.map_or(0, |(r, _)| r);
                return Err(failed(format!(
                    "worker {rank}: worker {gone} was lost while the mesh connected, before it had connected"
                )));
            }
        }
    }
}

impl super::recover::Remesh for LaunchedRemesh {
    fn lost(&mut self, within: Duration) -> Option<super::recover::LostPeer> {
        let deadline = Instant::now() + within;
        loop {
            match self.next_word(deadline)? {
                LauncherWord::Lost {
                    rank,
                    replaced,
                    how,
                } => {
                    // A new loss: whatever was said of the last one's replacement is past.
                    self.unreplaced = false;
                    // A launcher that cannot be told has gone: its word is then no use.
                    RecordWriter::recovery(crate::train::RecoveryPhase::Told).ok()?;
                    return Some(super::recover::LostPeer {
                        rank,
                        replaced,
                        how,
                    });
                }
                LauncherWord::Fail => return None,
                // A replacement's word after a later loss concerns the earlier one.
                LauncherWord::Peers(_) | LauncherWord::Join(_) | LauncherWord::Unreplaced(_) => {}
            }
        }
    }

    fn connect_without(
        &mut self,
        ep: &mut dyn pipe_transport::Transport,
        lost: u32,
        hosting: super::recover::Hosting,
    ) -> Result<Remeshed> {
        let what = format!("of the survivors after worker {lost} was lost");
        self.connect_mesh(&what, (Some((lost, ep)), hosting))
    }

    fn joining(&mut self) -> Option<u32> {
        if let Some(at) = self
            .held
            .iter()
            .position(|w| matches!(w, LauncherWord::Join(_)))
        {
            if let Some(LauncherWord::Join(rank)) = self.held.remove(at) {
                return Some(rank);
            }
        }
        while let Ok(word) = self.words.try_recv() {
            match word {
                LauncherWord::Join(rank) => return Some(rank),
                other => self.held.push_back(other),
            }
        }
        None
    }

    fn connect_all(&mut self, joining: u32) -> Result<Box<dyn pipe_transport::Transport>> {
        let what = format!("for worker {joining}'s replacement to join");
        Ok(self.connect_mesh(&what, (None, (None, false)))?.ep)
    }

    fn unreplaced(&mut self) -> bool {
        let before = self.held.len();
        self.held
            .retain(|w| !matches!(w, LauncherWord::Unreplaced(_)));
        self.unreplaced |= self.held.len() < before;
        while let Ok(word) = self.words.try_recv() {
            match word {
                LauncherWord::Unreplaced(_) => self.unreplaced = true,
                other => self.held.push_back(other),
            }
        }
        std::mem::take(&mut self.unreplaced)
    }
}

/// Tells the launcher where this worker listens.
fn announce(at: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{LISTENING}{at}")
        .and_then(|()| out.flush())
        .map_err(|e| {
            failed(format!(
                "telling the launcher where this worker listens: {e}"
            ))
        })
}

/// Tells the launcher where this worker listens for `rank`, a lost rank it hosts.
fn announce_hosted(rank: u32, at: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{HOSTING}{rank} {at}")
        .and_then(|()| out.flush())
        .map_err(|e| {
            failed(format!(
                "telling the launcher where rank {rank} listens: {e}"
            ))
        })
}

/// Rank `rank`'s address from the cluster file, retried until `deadline`.
fn resolve(cluster: &ClusterFile, rank: u32, deadline: Instant) -> Result<SocketAddr> {
    let name = cluster
        .workers
        .get(rank as usize)
        .map(|w| w.addr.clone())
        .ok_or_else(|| refused(format!("rank {rank} is not in the cluster file")))?;
    loop {
        if let Some(a) = name.to_socket_addrs().ok().and_then(|mut a| a.next()) {
            return Ok(a);
        }
        if Instant::now() >= deadline {
            return Err(failed(format!(
                "rank {rank}'s address '{name}' did not resolve before the connect timeout"
            )));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The launcher's line of where every worker listens (after this worker reported its own),
/// one entry per worker; then a watcher of standard input: a `stop` line sets `stop` (the
/// launcher's Ctrl-C), and its end (the launcher went away) ends this process, so no worker
/// outlives it.
fn launcher_line(
    size: u32,
    stop: Arc<AtomicBool>,
    words: Option<(Sender<LauncherWord>, InterruptSlot)>,
) -> Result<Vec<String>> {
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).map_err(|e| {
        failed(format!(
            "reading where the workers listen from the launcher: {e}"
        ))
    })?;
    let addrs: Vec<String> = line.trim().split(',').map(str::to_string).collect();
    if addrs.len() != size as usize {
        return Err(refused(format!(
            "the launcher named {} addresses for {size} workers",
            addrs.len()
        )));
    }
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            match line {
                Ok(l) if l.trim() == "stop" => stop.store(true, Ordering::SeqCst),
                Ok(l) => {
                    let Some(((words, interrupt), word)) =
                        words.as_ref().zip(LauncherWord::parse(&l))
                    else {
                        continue;
                    };
                    if let LauncherWord::Lost { rank, .. } = &word {
                        let held = interrupt.lock().ok().and_then(|i| i.clone());
                        if let Some(stop_calls) = held {
                            stop_calls.lost(*rank);
                        }
                    }
                    let _ = words.send(word);
                }
                Err(_) => break,
            }
        }
        // Not eprintln!: standard error went with the launcher, and eprintln! panics when it
        // cannot write (which would end this thread, not the process).
        let _ = writeln!(std::io::stderr(), "error: the launcher is gone");
        std::process::exit(1);
    });
    Ok(addrs)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use pipe_transport::fault::Fault;

    /// A worker's output is read to its end: a line that is not UTF-8 is handed on with
    /// U+FFFD (the launcher stopped reading there, and the worker's next write failed), and a
    /// line past the bound is cut to it.
    #[test]
    fn a_workers_lines_are_read_to_the_end_whatever_their_bytes() {
        let (tx, rx) = crossbeam_channel::unbounded();
        relay(3, true, &b"a\n\xff\r\nb\r\nlast"[..], tx);
        let lines: Vec<Option<String>> = rx.iter().map(|l| l.text).collect();
        let want = [Some("a"), Some("\u{fffd}"), Some("b"), Some("last"), None];
        assert_eq!(lines, want.map(|l| l.map(String::from)));
        let mut reader = &b"abcdefgh\nij\n"[..];
        let mut line = Vec::new();
        for want in [&b"abcd"[..], b"ij"] {
            assert!(read_line_bounded(&mut reader, &mut line, 4).unwrap());
            assert_eq!(line, want);
        }
        assert!(!read_line_bounded(&mut reader, &mut line, 4).unwrap());
    }

    /// Keeps the recovery records a launcher hands on.
    #[derive(Default)]
    struct Recoveries(Vec<crate::train::RecoveryStats>);

    impl Observer for Recoveries {
        fn on_recovery(&mut self, phase: &crate::train::RecoveryStats) -> Result<()> {
            self.0.push(phase.clone());
            Ok(())
        }
    }

    /// A worker's recovery record is dated from the chief's start by the worker's clock; one
    /// from before that start or past the clock's range has no date, and a phase no build
    /// writes is refused.
    #[test]
    fn recovery_records_are_dated_and_hostile_ones_are_refused() {
        let mut obs = Recoveries::default();
        let began = std::time::UNIX_EPOCH + Duration::from_secs(1_000);
        let mut reports = ChiefReports {
            obs: &mut obs,
            last: None,
            done: None,
            stops: Vec::new(),
            diverged: None,
            began: Some(began),
        };
        let line = |phase: &str, secs: u64| {
            format!(
                r#"{{"recovery":{{"phase":"{phase}","at":{{"secs":{secs},"nanos":500000000}}}}}}"#
            )
        };
        reports.record(4, &line("told", 1_001)).unwrap();
        reports.record(5, &line("named", 1_001)).unwrap();
        reports.record(3, &line("meshed", 1_002)).unwrap();
        reports.record(2, &line("restarted", 999)).unwrap();
        reports.record(1, &line("planned", u64::MAX)).unwrap();
        assert!(reports.record(1, &line("resumed", 1_002)).is_err());
        assert!(
            reports
                .record(1, r#"{"recovery":{"phase":"meshed"}}"#)
                .is_err()
        );
        let got: Vec<_> = obs
            .0
            .iter()
            .map(|r| (r.worker, r.phase, r.elapsed_s))
            .collect();
        use crate::train::RecoveryPhase::{Meshed, Named, Planned, Restarted, Told};
        assert_eq!(
            got,
            [
                (4, Told, Some(1.5)),
                (5, Named, Some(1.5)),
                (3, Meshed, Some(2.5)),
                (2, Restarted, None),
                (1, Planned, None)
            ]
        );
    }

    /// A bound endpoint whose connect waits for a peer that never comes (until `wait`).
    struct Waiting(Duration);

    impl pipe_transport::registration::BoundEndpoint for Waiting {
        fn address(&self) -> std::result::Result<String, pipe_transport::TransportError> {
            Ok("127.0.0.1:1".into())
        }

        fn needs_addresses(&self) -> bool {
            true
        }

        fn connect(
            self: Box<Self>,
            _: &[String],
        ) -> std::result::Result<Joined, pipe_transport::TransportError> {
            std::thread::sleep(self.0);
            Err(pipe_transport::TransportError::Setup(
                "rank 3 did not connect".into(),
            ))
        }
    }

    #[test]
    fn a_loss_named_while_a_mesh_connects_ends_the_wait_after_the_grace() {
        let (tx, words) = crossbeam_channel::unbounded();
        let mut held = std::collections::VecDeque::new();
        // A connect that takes `takes`, watched: how long the watch took, and its error.
        let watch = |takes: Duration, held: &mut std::collections::VecDeque<LauncherWord>| {
            let t = Instant::now();
            let bound: kinds::Bound = Box::new(Waiting(takes));
            let grace = Duration::from_millis(200);
            let err = connect_watching((bound, vec![]), 1, &words, held, grace)
                .err()
                .unwrap()
                .to_string();
            (t.elapsed(), err)
        };
        let lost = LauncherWord::Lost {
            rank: 3,
            replaced: true,
            how: "was killed by signal 9".into(),
        };
        tx.send(LauncherWord::Join(5)).unwrap();
        tx.send(lost.clone()).unwrap();
        let (took, err) = watch(Duration::from_secs(60), &mut held);
        assert!(took < Duration::from_secs(30), "{took:?}");
        assert!(
            err.contains("worker 1: worker 3 was lost while the mesh connected"),
            "{err}"
        );
        // Every word read meanwhile is kept, in order, for the caller.
        assert_eq!(held, [LauncherWord::Join(5), lost]);
        // The launcher stopping the run ends the wait at once.
        tx.send(LauncherWord::Fail).unwrap();
        let (took, err) = watch(Duration::from_secs(60), &mut held);
        assert!(took < Duration::from_secs(30), "{took:?}");
        assert!(
            err.contains("the run stopped while the mesh connected"),
            "{err}"
        );
        // Without a loss the connect's own end is the answer.
        let (_, err) = watch(Duration::from_millis(10), &mut held);
        assert!(err.contains("rank 3 did not connect"), "{err}");
    }

    fn a_run() -> RunConfig {
        let settings = crate::config::TrainSettings {
            stages: Some(2),
            ..crate::config::TrainSettings::default()
        };
        settings.resolve().unwrap()
    }

    /// The launcher's words read back; a malformed one (a rank that is no number) is no word.
    #[test]
    fn launcher_words_read_back_and_malformed_ones_are_none() {
        for word in [
            LauncherWord::Lost {
                rank: 3,
                replaced: true,
                how: "was killed by signal 9".into(),
            },
            LauncherWord::Lost {
                rank: 5,
                replaced: false,
                how: "exited with status 101".into(),
            },
            LauncherWord::Fail,
            LauncherWord::Peers(vec!["127.0.0.1:5".into(), "-".into()]),
            LauncherWord::Join(3),
            LauncherWord::Unreplaced(3),
        ] {
            assert_eq!(LauncherWord::parse(&word.line()), Some(word));
        }
        for line in [
            "lost",
            "lost x died",
            "lost -1 died",
            "lost 99999999999 died",
            "gone",
            "gone x died",
            "join",
            "join x",
            "unreplaced",
            "unreplaced -3",
            "join -1",
            "join 3 4",
            "join 99999999999",
            "stop",
            "",
        ] {
            assert_eq!(LauncherWord::parse(line), None, "{line:?}");
        }
    }

    #[test]
    fn a_workers_run_reads_back_as_written() {
        let handed = WorkerRun {
            checkpoints: Some(CheckpointPolicy {
                dir: "/tmp/ckpt".into(),
                every: Some(7),
                keep: 3,
                settings: "{}".into(),
            }),
            resume: Some("/tmp/ckpt/ckpt-14".into()),
            metrics: Some("127.0.0.1:9100".parse().unwrap()),
            faults: vec![Fault::None, "exit@5".parse().unwrap()],
            trace_parts: Some("/tmp/trace.parts".into()),
            ..WorkerRun::of(a_run())
        };
        let back = WorkerRun::from_json(&handed.to_json().unwrap(), "run.json").unwrap();
        assert_eq!(back, handed);
        assert_eq!(back.fault_of(1), "exit@5".parse().unwrap());
        assert_eq!(back.fault_of(9), Fault::None);
        assert_eq!(
            back.metrics_of(2).unwrap(),
            Some("127.0.0.1:9102".parse().unwrap())
        );
        assert_eq!(
            back.trace_part_of(1),
            Some("/tmp/trace.parts/worker-1.json".into())
        );
    }

    #[test]
    fn a_bare_run_of_the_release_before_reads_as_a_start_with_nothing_around_it() {
        let text = a_run().to_json().unwrap();
        assert_eq!(
            WorkerRun::from_json(&text, "run.json").unwrap(),
            WorkerRun::of(a_run())
        );
    }

    #[test]
    fn another_format_or_a_port_past_the_last_is_refused() {
        let text = WorkerRun::of(a_run())
            .to_json()
            .unwrap()
            .replace("\"format\":1", "\"format\":2");
        let e = WorkerRun::from_json(&text, "run.json").unwrap_err();
        assert!(
            e.to_string()
                .contains("format 2, where this build reads format 1")
        );
        let high = WorkerRun {
            metrics: Some("127.0.0.1:65535".parse().unwrap()),
            ..WorkerRun::of(a_run())
        };
        assert!(high.metrics_of(0).is_ok());
        assert!(
            high.metrics_of(1)
                .unwrap_err()
                .to_string()
                .contains("port 65536")
        );
    }
}
