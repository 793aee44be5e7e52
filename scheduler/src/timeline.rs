//! Timelines (simulated or measured) and their exports: Chrome trace JSON (one track per
//! worker, loads in Perfetto and `chrome://tracing`) and CSV.

use serde_json::{Value, json};

use crate::action::{Action, WorkerId};
use crate::plan::VersionPlan;

/// One action's interval on one worker. Times are seconds from the start of the run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    /// Worker that ran it.
    pub worker: WorkerId,
    /// The action.
    pub action: Action,
    /// Start time in seconds.
    pub start: f64,
    /// End time in seconds.
    pub end: f64,
}

/// Every action's interval, from the simulator or from a measured run.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Timeline {
    /// Number of workers (tracks).
    pub workers: u32,
    /// The intervals, in the order they were recorded.
    pub spans: Vec<Span>,
    /// Optional track names, one per worker (default `worker N`).
    pub names: Vec<String>,
}

impl Span {
    /// This span `by` seconds later: how spans timed from a segment's start are put on a
    /// run's (or a worker's) time axis.
    #[must_use]
    pub fn shifted(self, by: f64) -> Span {
        Span {
            start: self.start + by,
            end: self.end + by,
            ..self
        }
    }
}

impl Timeline {
    /// A timeline over `workers` tracks.
    pub fn new(workers: u32, spans: Vec<Span>) -> Self {
        Timeline {
            workers,
            spans,
            names: Vec::new(),
        }
    }

    /// The Chrome trace event JSON: metadata naming each worker's track, then one complete
    /// (`"ph": "X"`) event per span with times in microseconds and the stage, microbatch,
    /// update and (given a plan) weight version in `args`.
    pub fn to_chrome_trace(&self, plan: Option<&VersionPlan>) -> String {
        let mut events: Vec<Value> = Vec::with_capacity(self.spans.len() + self.workers as usize);
        for w in 0..self.workers {
            let name = self
                .names
                .get(w as usize)
                .cloned()
                .unwrap_or_else(|| format!("worker {w}"));
            events.push(json!({
                "name": "thread_name", "ph": "M", "pid": 0, "tid": w,
                "args": { "name": name }
            }));
        }
        for s in &self.spans {
            let a = &s.action;
            let mut args = serde_json::Map::new();
            args.insert("stage".into(), json!(a.stage()));
            if let Some(mb) = a.microbatch() {
                args.insert("microbatch".into(), json!(mb));
                if let Some(plan) = plan {
                    if mb < plan.microbatches() && a.stage() < plan.stages() {
                        match a {
                            Action::Forward { .. } => {
                                args.insert(
                                    "version".into(),
                                    json!(plan.forward_version(a.stage(), mb)),
                                );
                            }
                            Action::Backward { .. } | Action::BackwardInput { .. } => {
                                args.insert(
                                    "version".into(),
                                    json!(plan.backward_version(a.stage(), mb)),
                                );
                            }
                            _ => {}
                        }
                    }
                }
            }
            if let Some(u) = a.update_index() {
                args.insert("update".into(), json!(u));
            }
            if let Some(p) = a.peer() {
                args.insert("peer".into(), json!(p));
            }
            events.push(json!({
                "name": a.to_string(),
                "cat": a.kind().name(),
                "ph": "X",
                "pid": 0,
                "tid": s.worker,
                "ts": s.start * 1e6,
                "dur": (s.end - s.start).max(0.0) * 1e6,
                "args": Value::Object(args),
            }));
        }
        json!({ "traceEvents": events, "displayTimeUnit": "ms" }).to_string()
    }

    /// CSV with a header: `worker,action,kind,stage,microbatch,update,start_s,end_s`.
    pub fn to_csv(&self) -> String {
        let mut out = String::from("worker,action,kind,stage,microbatch,update,start_s,end_s\n");
        for s in &self.spans {
            let a = &s.action;
            out.push_str(&format!(
                "{},{},{},{},{},{},{:.9},{:.9}\n",
                s.worker,
                a,
                a.kind().name(),
                a.stage(),
                a.microbatch().map_or(String::new(), |m| m.to_string()),
                a.update_index().map_or(String::new(), |u| u.to_string()),
                s.start,
                s.end
            ));
        }
        out
    }
}
