//! Timelines (simulated or measured) and their exports: Chrome trace JSON (one track per
//! worker, loads in Perfetto and `chrome://tracing`) and CSV.

use std::fmt::Write as _;

use serde::{Serialize, Serializer};

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
    ///
    /// Each event is serialized straight into the text, so a trace costs its own bytes (about
    /// 150 a span) and no more; building a `serde_json::Value` per event first took about
    /// 19 KB a span. Keys come in sorted order, as a `Value`'s maps wrote them.
    pub fn to_chrome_trace(&self, plan: Option<&VersionPlan>) -> String {
        let mut out = Vec::with_capacity(
            (self.spans.len() + self.workers as usize).saturating_mul(TRACE_BYTES_PER_EVENT),
        );
        out.extend_from_slice(br#"{"displayTimeUnit":"ms","traceEvents":["#);
        let mut first = true;
        for w in 0..self.workers {
            let fallback;
            let name = match self.names.get(w as usize) {
                Some(name) => name.as_str(),
                None => {
                    fallback = format!("worker {w}");
                    fallback.as_str()
                }
            };
            let track = TrackEvent {
                args: TrackArgs { name },
                name: "thread_name",
                ph: "M",
                pid: 0,
                tid: w,
            };
            append_event(&mut out, &mut first, &track);
        }
        for s in &self.spans {
            append_event(&mut out, &mut first, &SpanEvent::new(s, plan));
        }
        out.extend_from_slice(b"]}");
        // serde_json writes UTF-8 only; the lossy path is never taken.
        String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into())
    }

    /// CSV with a header: `worker,action,kind,stage,microbatch,update,start_s,end_s`.
    ///
    /// Rows are written into one buffer sized for the whole text up front, so the text is
    /// allocated once instead of doubling past its final size.
    pub fn to_csv(&self) -> String {
        const HEADER: &str = "worker,action,kind,stage,microbatch,update,start_s,end_s\n";
        let mut out = String::with_capacity(
            HEADER.len() + self.spans.len().saturating_mul(CSV_BYTES_PER_ROW),
        );
        out.push_str(HEADER);
        for s in &self.spans {
            let a = &s.action;
            // Writing to a `String` cannot fail.
            let _ = write!(out, "{},{a},{},{},", s.worker, a.kind().name(), a.stage());
            if let Some(m) = a.microbatch() {
                let _ = write!(out, "{m}");
            }
            out.push(',');
            if let Some(u) = a.update_index() {
                let _ = write!(out, "{u}");
            }
            let _ = writeln!(out, ",{:.9},{:.9}", s.start, s.end);
        }
        out
    }
}

/// Bytes a trace event takes, rounded up from the largest measured (a send with microbatch,
/// peer, stage, update and version at long run times is about 190; most are nearer 140): the
/// capacity reserved for the text, and the figure [`crate::limits::MAX_TRACE_EVENTS`] is
/// sized by.
pub const TRACE_BYTES_PER_EVENT: usize = 200;

/// Bytes a CSV row takes, rounded up (times take 11 to 15 characters each).
const CSV_BYTES_PER_ROW: usize = 64;

/// Appends one event to the trace's event list, with the comma that separates it from the one
/// before.
fn append_event(out: &mut Vec<u8>, first: &mut bool, event: &impl Serialize) {
    if !*first {
        out.push(b',');
    }
    *first = false;
    // Writing to a `Vec` cannot fail, and these events hold only strings and numbers, which
    // serde_json always writes (a number that is not finite as `null`, as `json!` did).
    let _ = serde_json::to_writer(&mut *out, event);
}

/// The metadata event naming worker `tid`'s track. Fields are declared in sorted order: the
/// order `serde_json::Value` wrote them in, so the text stays as it was.
#[derive(Serialize)]
struct TrackEvent<'a> {
    args: TrackArgs<'a>,
    name: &'static str,
    ph: &'static str,
    pid: u32,
    tid: u32,
}

/// A track's name.
#[derive(Serialize)]
struct TrackArgs<'a> {
    name: &'a str,
}

/// One span's complete event (fields in sorted order, as [`TrackEvent`]'s).
#[derive(Serialize)]
struct SpanEvent {
    args: SpanArgs,
    cat: &'static str,
    dur: f64,
    #[serde(serialize_with = "as_text")]
    name: Action,
    ph: &'static str,
    pid: u32,
    tid: WorkerId,
    ts: f64,
}

/// A span's `args`: what is absent is left out.
#[derive(Serialize)]
struct SpanArgs {
    #[serde(skip_serializing_if = "Option::is_none")]
    microbatch: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    peer: Option<WorkerId>,
    stage: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    update: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    version: Option<u32>,
}

impl SpanEvent {
    /// The event of span `s`, with the weight version `plan` gives its pass, if any.
    fn new(s: &Span, plan: Option<&VersionPlan>) -> Self {
        let a = s.action;
        let mb = a.microbatch();
        let version = match (plan, mb) {
            (Some(plan), Some(mb)) if mb < plan.microbatches() && a.stage() < plan.stages() => {
                match a {
                    Action::Forward { .. } => Some(plan.forward_version(a.stage(), mb)),
                    Action::Backward { .. } | Action::BackwardInput { .. } => {
                        Some(plan.backward_version(a.stage(), mb))
                    }
                    _ => None,
                }
            }
            _ => None,
        };
        SpanEvent {
            args: SpanArgs {
                microbatch: mb,
                peer: a.peer(),
                stage: a.stage(),
                update: a.update_index(),
                version,
            },
            cat: a.kind().name(),
            dur: (s.end - s.start).max(0.0) * 1e6,
            name: a,
            ph: "X",
            pid: 0,
            tid: s.worker,
            ts: s.start * 1e6,
        }
    }
}

/// Serializes a value as its `Display` text (an action as `s0F3`), escaped as a JSON string.
fn as_text<T: std::fmt::Display, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::{Value, json};

    use super::*;
    use crate::generate::generate;
    use crate::lower::{LowerOptions, lower};
    use crate::sim::{CostModel, SimOptions, StageCost, simulate};
    use crate::spec::{Length, Policy, ScheduleSpec};

    /// The trace as it was built before: a `serde_json::Value` per event, then the whole.
    fn trace_through_values(t: &Timeline, plan: Option<&VersionPlan>) -> String {
        let mut events = Vec::new();
        for w in 0..t.workers {
            let name = t
                .names
                .get(w as usize)
                .cloned()
                .unwrap_or(format!("worker {w}"));
            events.push(json!({
                "name": "thread_name", "ph": "M", "pid": 0, "tid": w, "args": { "name": name }
            }));
        }
        for s in &t.spans {
            let a = &s.action;
            let mut args = serde_json::Map::new();
            args.insert("stage".into(), json!(a.stage()));
            if let Some(mb) = a.microbatch() {
                args.insert("microbatch".into(), json!(mb));
                if let Some(plan) = plan.filter(|p| mb < p.microbatches() && a.stage() < p.stages())
                {
                    match a {
                        Action::Forward { .. } => {
                            args.insert(
                                "version".into(),
                                json!(plan.forward_version(a.stage(), mb)),
                            );
                        }
                        Action::Backward { .. } | Action::BackwardInput { .. } => {
                            let v = plan.backward_version(a.stage(), mb);
                            args.insert("version".into(), json!(v));
                        }
                        _ => {}
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
                "name": a.to_string(), "cat": a.kind().name(), "ph": "X", "pid": 0,
                "tid": s.worker, "ts": s.start * 1e6, "dur": (s.end - s.start).max(0.0) * 1e6,
                "args": Value::Object(args),
            }));
        }
        json!({ "traceEvents": events, "displayTimeUnit": "ms" }).to_string()
    }

    /// A simulated timeline with sends, receives, ring steps and updates on replicated stages.
    fn timeline(policy: Policy) -> (Timeline, VersionPlan) {
        let spec = ScheduleSpec::new(policy, 3, 4)
            .with_replicas(vec![2, 1, 1])
            .with_length(Length::Updates(2));
        let schedule = lower(
            &generate(&spec).unwrap(),
            LowerOptions {
                expand_all_reduce: true,
            },
        );
        let costs = CostModel {
            latency: 0.013,
            bandwidth: 1e3,
            ..CostModel::uniform(StageCost {
                activation_bytes: 5.0,
                param_bytes: 20.0,
                update: 0.1,
                ..StageCost::compute(1.0 / 3.0, 2.0)
            })
        };
        let report = simulate(&schedule, &costs, SimOptions { timeline: true }).unwrap();
        (
            report.timeline.unwrap(),
            VersionPlan::derive(&schedule).unwrap(),
        )
    }

    /// The trace written event by event is the text the `Value` tree gave, byte for byte, and
    /// names that need escaping stay valid JSON.
    #[test]
    fn chrome_trace_text_is_unchanged_and_escapes_names() {
        for policy in [Policy::PipeDream, Policy::OneFOneBFlush, Policy::ZbH1] {
            let (mut t, plan) = timeline(policy);
            assert_eq!(
                t.to_chrome_trace(Some(&plan)),
                trace_through_values(&t, Some(&plan))
            );
            assert_eq!(t.to_chrome_trace(None), trace_through_values(&t, None));
            t.names = vec!["a \"quoted\"\\ name\n\u{1}".into(), "wörker".into()];
            t.spans[0].end = f64::NAN;
            let text = t.to_chrome_trace(Some(&plan));
            assert_eq!(text, trace_through_values(&t, Some(&plan)));
            let parsed: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(
                parsed["traceEvents"][0]["args"]["name"],
                "a \"quoted\"\\ name\n\u{1}"
            );
        }
    }

    /// The CSV is the text `format!` per row gave.
    #[test]
    fn csv_text_is_unchanged() {
        let (t, _) = timeline(Policy::PipeDream);
        let mut expected =
            String::from("worker,action,kind,stage,microbatch,update,start_s,end_s\n");
        for s in &t.spans {
            let a = &s.action;
            expected.push_str(&format!(
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
        assert_eq!(t.to_csv(), expected);
    }
}
