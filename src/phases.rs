//! The phases of a run before its first update, shown as they happen: each prints a line when
//! it begins and its duration when it ends, and on a terminal a bar moves while it runs (with
//! its length where it has one: the layer shapes of a profile), so that a start that takes
//! minutes never looks like a hang. Every ended phase is also kept as a [`PhaseRecord`] for the
//! run's JSON-lines log, which takes records and no lines.
//!
//! One [`Phases`] per command, cloned into whatever reports: the profiler's callback runs on
//! the profiling thread, so the state sits behind a mutex.

use std::io::IsTerminal as _;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressFinish, ProgressStyle};
use pipe_stages::pipeline::PhaseRecord;
use pipe_stages::planning::ProfileEvent;
use pipe_stages::profile::ProfileProgress;

/// How often a running phase's bar redraws on a terminal.
const TICK: Duration = Duration::from_millis(150);

/// The phase display of one command (cheap to clone: one shared state).
#[derive(Clone)]
pub struct Phases(Arc<Mutex<State>>);

struct State {
    /// A bar is drawn (standard error is a terminal).
    tty: bool,
    /// The command's start.
    origin: Instant,
    current: Option<Current>,
    /// Ended phases not yet handed to the log.
    ended: Vec<PhaseRecord>,
}

struct Current {
    name: String,
    began: Instant,
    bar: Option<ProgressBar>,
    note: String,
}

impl Phases {
    /// A display that draws bars when standard error is a terminal.
    pub fn new() -> Self {
        Phases::with_terminal(std::io::stderr().is_terminal())
    }

    /// A display that draws bars only when `tty`.
    pub fn with_terminal(tty: bool) -> Self {
        Phases(Arc::new(Mutex::new(State {
            tty,
            origin: Instant::now(),
            current: None,
            ended: Vec::new(),
        })))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ends the running phase (if any) and begins `name`, printing `name` and `detail`; on a
    /// terminal a spinner moves until the phase ends or [`Phases::progress`] gives it a
    /// length.
    pub fn begin(&self, name: &str, detail: &str) {
        let mut st = self.state();
        st.end_current();
        let line = if detail.is_empty() {
            format!("{name} ...")
        } else {
            format!("{name} ({detail}) ...")
        };
        outln!("{line}");
        let bar = st.tty.then(|| {
            // A run that fails mid-phase leaves no bar above its error.
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
                .with_finish(ProgressFinish::AndClear);
            if let Ok(style) = ProgressStyle::with_template("  {spinner} {msg} {elapsed}") {
                bar.set_style(style);
            }
            bar.set_message(name.to_string());
            bar.enable_steady_tick(TICK);
            bar
        });
        st.current = Some(Current {
            name: name.to_string(),
            began: Instant::now(),
            bar,
            note: String::new(),
        });
    }

    /// Sets the running phase's progress: `done` of `of` `unit`.
    pub fn progress(&self, done: u64, of: u64, unit: &str) {
        let st = self.state();
        let Some(bar) = st.current.as_ref().and_then(|c| c.bar.as_ref()) else {
            return;
        };
        if bar.length() != Some(of) {
            bar.set_length(of);
            if let Ok(style) =
                ProgressStyle::with_template("  [{bar:30}] {pos}/{len} {msg} {elapsed}")
            {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_message(unit.to_string());
        }
        bar.set_position(done);
    }

    /// Adds `note` to what the running phase's closing line says.
    pub fn note(&self, note: &str) {
        if let Some(c) = self.state().current.as_mut() {
            if !c.note.is_empty() {
                c.note.push_str("; ");
            }
            c.note.push_str(note);
        }
    }

    /// Ends the running phase, printing its duration.
    pub fn end(&self) {
        self.state().end_current();
    }

    /// The name of the running phase.
    pub fn running(&self) -> Option<String> {
        self.state().current.as_ref().map(|c| c.name.clone())
    }

    /// The ended phases not yet taken, oldest first.
    pub fn take_ended(&self) -> Vec<PhaseRecord> {
        std::mem::take(&mut self.state().ended)
    }

    /// Prints `line` without tearing the running phase's bar.
    pub fn println(&self, line: &str) {
        let st = self.state();
        match st.current.as_ref().and_then(|c| c.bar.as_ref()) {
            Some(bar) => bar.suspend(|| outln!("{line}")),
            None => outln!("{line}"),
        }
    }

    /// A profiler's report that moves this display: the layer shapes timed as a bar, the
    /// calibration run and where the profile came from as notes and lines.
    pub fn profile_report(&self) -> pipe_stages::planning::ProfileReport {
        let phases = self.clone();
        Arc::new(move |event: &ProfileEvent| match event {
            ProfileEvent::Progress(ProfileProgress::Layers { done, of }) => {
                phases.progress(*done as u64, *of as u64, "layer shapes timed");
            }
            ProfileEvent::Progress(ProfileProgress::Calibrating) => {
                phases.println("  calibrating on the executor (one run of the whole model)");
            }
            ProfileEvent::Reused { path } => {
                phases.note(&format!("profile reused from {}", path.display()));
            }
            ProfileEvent::Ignored { path, why } => {
                // A warning on standard error, as every warning.
                let st = phases.state();
                let warn = || {
                    eprintln!(
                        "warning: the cached profile {} is not used: {why}; measuring again",
                        path.display()
                    );
                };
                match st.current.as_ref().and_then(|c| c.bar.as_ref()) {
                    Some(bar) => bar.suspend(warn),
                    None => warn(),
                }
            }
            ProfileEvent::Measured {
                seconds,
                kept,
                not_kept,
            } => {
                let whereto = match (kept, not_kept) {
                    (Some(path), _) => format!("kept in {}", path.display()),
                    (None, Some(why)) => format!("not kept: {why}"),
                    (None, None) => "not kept".into(),
                };
                phases.note(&format!("profile measured in {seconds:.1} s, {whereto}"));
            }
        })
    }
}

impl Default for Phases {
    fn default() -> Self {
        Phases::new()
    }
}

impl State {
    fn end_current(&mut self) {
        let Some(c) = self.current.take() else {
            return;
        };
        if let Some(bar) = &c.bar {
            bar.finish_and_clear();
        }
        let seconds = c.began.elapsed().as_secs_f64();
        let note = if c.note.is_empty() {
            String::new()
        } else {
            format!(" ({})", c.note)
        };
        outln!("{}: {seconds:.1} s{note}", c.name);
        self.ended.push(PhaseRecord {
            phase: c.name,
            began_s: c.began.duration_since(self.origin).as_secs_f64(),
            seconds,
            note: c.note,
        });
    }
}
