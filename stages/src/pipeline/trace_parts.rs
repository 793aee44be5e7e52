//! Chrome traces of runs whose workers are processes: each worker writes its own part (its
//! actions on its own track, times from its own start by the system clock), and the launcher
//! merges the parts onto one time axis. A part is itself a Chrome trace, so one worker's part
//! opens alone too. The in-process run writes its trace in one piece (`pipe train --trace`).

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use pipe_scheduler::{Layout, Span, Timeline};
use serde_json::{Value, json};

use super::Observer;
use super::doctor::StopReport;
use crate::error::{Result, StageError};
use crate::train::{EpochStats, EvalStats, StepStats};

/// An I/O failure on `path`.
fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StageError + '_ {
    move |source| StageError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A trace part that is not one (bad input: a file the launcher's workers did not write).
fn not_a_part(path: &Path, why: &str) -> StageError {
    StageError::Config(format!("trace part {}: {why}", path.display()))
}

/// The key of a part's header: the worker's rank and its start in microseconds since the UNIX
/// epoch.
const PART_KEY: &str = "pipeWorker";

/// The most actions a run's trace keeps, over all its workers: the first ones of the run. Past
/// them a trace would hold every action of a run of any length in memory until it ends (a
/// long run's trace exhausted it), and a viewer opens a trace this size slowly already. The
/// actions past it are counted and the run says so (`docs/reliability.md`, "Limits").
pub const MAX_TRACE_SPANS: usize = 1 << 20;

/// A trace's spans kept up to a limit, with a count of those past it.
#[derive(Debug)]
pub struct SpanBuffer {
    spans: Vec<Span>,
    limit: usize,
    dropped: u64,
}

impl SpanBuffer {
    /// An empty buffer keeping at most `limit` spans.
    pub fn new(limit: usize) -> Self {
        Self {
            spans: Vec::new(),
            limit,
            dropped: 0,
        }
    }

    /// Keeps `spans` while there is room, and counts the rest.
    pub fn extend(&mut self, spans: impl IntoIterator<Item = Span>) {
        for span in spans {
            if self.spans.len() < self.limit {
                self.spans.push(span);
            } else {
                self.dropped += 1;
            }
        }
    }

    /// The spans kept.
    pub fn spans(&self) -> &[Span] {
        &self.spans
    }

    /// The spans kept, and how many were not.
    pub fn into_parts(self) -> (Vec<Span>, u64) {
        (self.spans, self.dropped)
    }

    /// How many spans were past the limit.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

/// ", of which only the first N actions: M more past the limit" when a trace dropped any.
fn dropped_note(kept: usize, dropped: u64) -> String {
    if dropped == 0 {
        String::new()
    } else {
        format!(
            "; it holds only the run's first {kept} actions ({MAX_TRACE_SPANS} at most per \
             run): {dropped} later ones are not in it; trace fewer updates to see them"
        )
    }
}

/// A trace a run wrote, for its launcher to report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceWritten {
    /// Written in one piece (every worker a thread of one process).
    Whole {
        /// Where.
        path: PathBuf,
        /// Actions in it.
        kept: usize,
        /// Actions past [`MAX_TRACE_SPANS`], not in it.
        dropped: u64,
    },
    /// Merged from the parts the worker processes wrote.
    Merged {
        /// Where.
        path: PathBuf,
        /// Parts found.
        parts: usize,
        /// Workers of the last start.
        workers: u32,
        /// Events in the merged trace.
        events: usize,
        /// Actions the parts kept.
        kept: usize,
        /// Actions past the parts' limits, not in it.
        dropped: u64,
    },
    /// No worker wrote a part, so nothing was written.
    NoParts {
        /// Where it would have been.
        path: PathBuf,
    },
}

impl std::fmt::Display for TraceWritten {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TraceWritten::Whole {
                path,
                kept,
                dropped,
            } => write!(
                f,
                "trace written to {}{}",
                path.display(),
                dropped_note(*kept, *dropped)
            ),
            TraceWritten::Merged {
                path,
                parts,
                workers,
                events,
                kept,
                dropped,
            } => write!(
                f,
                "trace written to {} ({parts} of {workers} workers, {events} events){}",
                path.display(),
                dropped_note(*kept, *dropped)
            ),
            TraceWritten::NoParts { path } => write!(
                f,
                "no worker wrote a trace part; {} not written",
                path.display()
            ),
        }
    }
}

/// Track names: `worker W (stage P, replica R)`.
pub fn worker_names(layout: &Layout) -> Vec<String> {
    (0..layout.workers())
        .map(|w| {
            let (p, r) = layout.placement(w);
            format!("worker {w} (stage {p}, replica {r})")
        })
        .collect()
}

/// `template` with `{rank}` replaced by `rank`: how the workers of one launch, given the same
/// flags, write different parts.
pub fn part_path(template: &Path, rank: u32) -> PathBuf {
    PathBuf::from(
        template
            .to_string_lossy()
            .replace("{rank}", &rank.to_string()),
    )
}

/// A worker's spans, kept for its part: its share of [`MAX_TRACE_SPANS`].
#[derive(Debug)]
pub struct PartRecorder {
    origin: Option<SystemTime>,
    spans: SpanBuffer,
}

impl PartRecorder {
    /// A recorder for one of `workers` workers.
    pub fn new(workers: u32) -> Self {
        Self {
            origin: None,
            spans: SpanBuffer::new(MAX_TRACE_SPANS / workers.max(1) as usize),
        }
    }

    /// Keeps one segment's `spans` (times from `origin`, the worker's start).
    pub fn record(&mut self, origin: SystemTime, spans: &[Span]) {
        self.origin.get_or_insert(origin);
        self.spans.extend(spans.iter().cloned());
    }

    /// Writes worker `rank`'s part to `path` (tracks named by `names`).
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn write(&self, path: &Path, rank: u32, names: Vec<String>) -> Result<()> {
        let origin = self.origin.unwrap_or_else(SystemTime::now);
        let start_us = origin
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1e6);
        let workers = names.len() as u32;
        let mut timeline = Timeline::new(workers, self.spans.spans().to_vec());
        timeline.names = names;
        let mut trace: Value = serde_json::from_str(&timeline.to_chrome_trace(None))
            .map_err(|e| StageError::Executor(format!("a trace part's events: {e}")))?;
        // The names of this worker's track and of any other its spans are on (a lost
        // worker's program it adopted): the other workers' parts name theirs.
        let mut tracks: Vec<u64> = self
            .spans
            .spans()
            .iter()
            .map(|s| u64::from(s.worker))
            .collect();
        tracks.push(u64::from(rank));
        if let Some(events) = trace["traceEvents"].as_array_mut() {
            events.retain(|e| {
                e["ph"] != "M" || e["tid"].as_u64().is_some_and(|t| tracks.contains(&t))
            });
        }
        trace[PART_KEY] = json!({
            "rank": rank,
            "start_us": start_us,
            "kept": self.spans.spans().len(),
            "dropped": self.spans.dropped(),
        });
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io(dir))?;
        }
        crate::outputs::write_file(path, trace.to_string().as_bytes())
    }
}

/// A run's observer, told everything, with the worker's spans also kept for its part.
pub struct Traced<'a> {
    /// The run's own observer.
    pub run: &'a mut dyn Observer,
    /// Where the spans go.
    pub part: &'a mut PartRecorder,
}

impl Observer for Traced<'_> {
    fn on_step(&mut self, s: &StepStats) -> Result<()> {
        self.run.on_step(s)
    }

    fn on_epoch(&mut self, e: &EpochStats) -> Result<()> {
        self.run.on_epoch(e)
    }

    fn on_eval(&mut self, e: &EvalStats) -> Result<()> {
        self.run.on_eval(e)
    }

    fn on_stop(&mut self, report: &StopReport) -> Result<()> {
        self.run.on_stop(report)
    }

    fn on_start_phase(&mut self, phase: super::StartPhase) -> Result<()> {
        self.run.on_start_phase(phase)
    }

    fn on_layout_change(&mut self, change: &super::survive::LayoutChange) -> Result<()> {
        self.run.on_layout_change(change)
    }

    fn on_lost(&mut self, lost: &crate::train::LostStats) -> Result<()> {
        self.run.on_lost(lost)
    }

    fn on_recovery(&mut self, phase: &crate::train::RecoveryStats) -> Result<()> {
        self.run.on_recovery(phase)
    }

    fn on_training_began(&mut self, at: SystemTime) -> Result<()> {
        self.run.on_training_began(at)
    }

    fn on_spans(&mut self, origin: SystemTime, spans: &[Span]) -> Result<()> {
        self.part.record(origin, spans);
        self.run.on_spans(origin, spans)
    }
}

/// What [`merge_parts`] wrote: events, and the actions the parts kept and dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Merged {
    /// Events in the merged trace.
    pub events: usize,
    /// Actions the parts kept.
    pub kept: usize,
    /// Actions past the parts' limits.
    pub dropped: u64,
}

/// Merges the parts at `parts` into one Chrome trace at `out`: every part's events shifted by
/// its start's distance from the earliest start.
///
/// # Errors
/// A part that cannot be read or is not a part; `out` cannot be written.
pub fn merge_parts(parts: &[PathBuf], out: &Path) -> Result<Merged> {
    let mut loaded = Vec::with_capacity(parts.len());
    let (mut kept, mut dropped) = (0usize, 0u64);
    for path in parts {
        let text = std::fs::read_to_string(path).map_err(|e| {
            StageError::Executor(format!("reading trace part {}: {e}", path.display()))
        })?;
        let part: Value =
            serde_json::from_str(&text).map_err(|e| not_a_part(path, &format!("not JSON: {e}")))?;
        let Some(start) = part[PART_KEY]["start_us"].as_f64() else {
            return Err(not_a_part(path, "not a worker's trace part"));
        };
        kept += part[PART_KEY]["kept"].as_u64().unwrap_or(0) as usize;
        dropped += part[PART_KEY]["dropped"].as_u64().unwrap_or(0);
        loaded.push((start, part));
    }
    let first = loaded.iter().map(|(s, _)| *s).fold(f64::INFINITY, f64::min);
    let mut events = Vec::new();
    // One name per track: a lost worker's track is named by the part of its adopter and by
    // its replacement's.
    let mut named = std::collections::HashSet::new();
    for (start, mut part) in loaded {
        let shift = start - first;
        if let Some(list) = part["traceEvents"].as_array_mut() {
            for mut e in list.drain(..) {
                if e["ph"] == "M" && !named.insert((e["tid"].as_u64(), e["name"].to_string())) {
                    continue;
                }
                if let Some(ts) = e["ts"].as_f64() {
                    e["ts"] = json!(ts + shift);
                }
                events.push(e);
            }
        }
    }
    let n = events.len();
    let trace = json!({ "traceEvents": events, "displayTimeUnit": "ms" });
    crate::outputs::write_file(out, trace.to_string().as_bytes())?;
    Ok(Merged {
        events: n,
        kept,
        dropped,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use pipe_scheduler::Action;

    #[test]
    fn parts_of_two_workers_merge_on_one_time_axis() {
        let dir = std::env::temp_dir().join(format!("pipe-trace-test-{}", std::process::id()));
        let template = dir.join("part-{rank}.json");
        let names = vec!["a".to_string(), "b".to_string()];
        let t0 = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
        let mut paths = Vec::new();
        for (rank, late) in [(0u32, 0.0f64), (1, 0.5)] {
            let mut rec = PartRecorder::new(2);
            let origin = t0 + std::time::Duration::from_secs_f64(late);
            let span = Span {
                worker: rank,
                action: Action::Forward { stage: rank, mb: 0 },
                start: 0.25,
                end: 0.5,
            };
            rec.record(origin, &[span]);
            let path = part_path(&template, rank);
            rec.write(&path, rank, names.clone()).unwrap();
            paths.push(path);
        }
        let out = dir.join("merged.json");
        assert_eq!(merge_parts(&paths, &out).unwrap().events, 4);
        let merged: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        let events = merged["traceEvents"].as_array().unwrap();
        let ts = |tid: u32| {
            events
                .iter()
                .find(|e| e["ph"] == "X" && e["tid"] == tid)
                .and_then(|e| e["ts"].as_f64())
                .unwrap()
        };
        assert!((ts(0) - 250_000.0).abs() < 1.0);
        assert!((ts(1) - 750_000.0).abs() < 1.0);
        let named: Vec<_> = events.iter().filter(|e| e["ph"] == "M").collect();
        assert_eq!(named.len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
        let err = merge_parts(&[out], &dir.join("x.json")).unwrap_err();
        assert!(err.to_string().contains("reading trace part"), "{err}");
    }

    fn span(worker: u32, mb: u32) -> Span {
        Span {
            worker,
            action: Action::Forward { stage: worker, mb },
            start: f64::from(mb),
            end: f64::from(mb) + 0.5,
        }
    }

    #[test]
    fn a_trace_keeps_the_first_actions_up_to_its_limit_and_says_how_many_it_left_out() {
        let mut buf = SpanBuffer::new(3);
        buf.extend((0..2).map(|mb| span(0, mb)));
        buf.extend((2..7).map(|mb| span(0, mb)));
        assert_eq!(buf.dropped(), 4);
        let (kept, dropped) = buf.into_parts();
        assert_eq!((kept.len(), dropped), (3, 4));
        assert_eq!(kept[2].action, Action::Forward { stage: 0, mb: 2 });

        let whole = TraceWritten::Whole {
            path: "t.json".into(),
            kept: 3,
            dropped: 4,
        };
        let said = whole.to_string();
        assert!(
            said.contains("first 3 actions") && said.contains("4 later ones"),
            "{said}"
        );
        let all = TraceWritten::Whole {
            path: "t.json".into(),
            kept: 3,
            dropped: 0,
        };
        assert_eq!(all.to_string(), "trace written to t.json");
    }

    #[test]
    fn each_worker_keeps_its_share_and_the_merge_adds_up_what_the_parts_left_out() {
        let dir = std::env::temp_dir().join(format!("pipe-trace-cap-{}", std::process::id()));
        let workers = 4u32;
        let share = MAX_TRACE_SPANS / workers as usize;
        let t0 = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
        let mut paths = Vec::new();
        for rank in 0..2u32 {
            let mut rec = PartRecorder::new(workers);
            // Worker 0 records 10 past its share; worker 1 a few.
            let n = if rank == 0 { share + 10 } else { 5 };
            let spans: Vec<_> = (0..n as u32).map(|mb| span(rank, mb)).collect();
            rec.record(t0, &spans);
            let path = part_path(&dir.join("part-{rank}.json"), rank);
            rec.write(&path, rank, vec!["a".into(), "b".into()])
                .unwrap();
            paths.push(path);
        }
        let merged = merge_parts(&paths, &dir.join("merged.json")).unwrap();
        assert_eq!((merged.kept, merged.dropped), (share + 5, 10));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
