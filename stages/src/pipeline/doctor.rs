//! The hang doctor: when a run stalls, what every worker was doing, who waits for whom, and why
//! nobody moves.
//!
//! Each worker records where its program stands ([`StopPoint`]: the action it is in and the
//! last it completed) as it runs. When a receive of data waits past the stall bound, the
//! transport fails it ([`pipe_transport::TransportError::Timeout`]), the worker tells its peers
//! and every worker stops where it is. The launcher then has every worker's stop point, from
//! which [`diagnose`] draws the wait-for graph (a worker in a receive waits for the sender; one
//! in an all-reduce for its replicas; one in a send for the receiver) and follows it from the
//! worker that stalled: to a cycle (the program deadlocks), to a worker that finished its
//! program without sending (a message was lost), or to a worker that waits for nobody (it is
//! stuck in its own action). A schedule that validates never deadlocks, so a cycle means the
//! programs and the transport disagree; the other two are what injected faults produce.

use std::fmt::Write as _;
use std::time::Duration;

use pipe_scheduler::{Action, Policy, Schedule, WorkerId};
use pipe_transport::{Key, Kind};
use serde::{Deserialize, Serialize};

/// Where a worker's program stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StopPoint {
    /// The action it is running (None: between actions, or finished).
    pub at: Option<Action>,
    /// Actions completed.
    pub completed: usize,
    /// The last action it completed.
    pub last_completed: Option<Action>,
    /// It ran its whole program.
    pub finished: bool,
}

/// A worker process's stop point as it reports it to its launcher, which has no view of the
/// process: where its program stood by index, the segment's schedule (policy and length) so
/// the launcher can rebuild the programs, and, for the worker whose wait timed out, what it
/// waited for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StopReport {
    /// The worker.
    pub rank: u32,
    /// The segment's policy.
    pub policy: Policy,
    /// The segment's length in updates.
    pub updates: u32,
    /// Actions completed.
    pub completed: usize,
    /// It was inside action `completed` (not between actions).
    pub in_action: bool,
    /// It ran its whole program.
    pub finished: bool,
    /// For the worker that stalled: the awaited message's key (from, kind, stage, index) and
    /// how long it waited, in seconds.
    pub stalled: Option<(u32, Kind, u32, u32, f64)>,
}

impl StopReport {
    /// The report of `rank` at `stop`, in a segment of `updates` updates of `policy`; `stall`
    /// when its own receive timed out.
    pub fn new(
        rank: u32,
        (policy, updates): (Policy, u32),
        stop: &StopPoint,
        stall: Option<(&Key, Duration)>,
    ) -> Self {
        StopReport {
            rank,
            policy,
            updates,
            completed: stop.completed,
            in_action: stop.at.is_some(),
            finished: stop.finished,
            stalled: stall
                .map(|(k, waited)| (k.from, k.kind, k.stage, k.index, waited.as_secs_f64())),
        }
    }

    /// The stop point on `program` (the worker's program in the rebuilt schedule).
    pub fn stop_point(&self, program: &[Action]) -> StopPoint {
        StopPoint {
            at: if self.in_action {
                program.get(self.completed).copied()
            } else {
                None
            },
            completed: self.completed,
            last_completed: self
                .completed
                .checked_sub(1)
                .and_then(|i| program.get(i).copied()),
            finished: self.finished,
        }
    }

    /// What the stalled worker waited for, and how long; `None` where it waited for nothing,
    /// or its report (a worker's record, read by the launcher) gives a wait no `Duration`
    /// holds.
    pub fn awaited(&self) -> Option<(Key, Duration)> {
        let (from, kind, stage, index, waited) = self.stalled?;
        let key = Key {
            from,
            to: self.rank,
            kind,
            stage,
            index,
            step: 0,
        };
        Some((key, Duration::try_from_secs_f64(waited.max(0.0)).ok()?))
    }
}

/// What a worker waits for, read off the action it stopped in.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Wait {
    /// A message from one peer.
    Message(Key),
    /// A send to one peer (whose queue is full).
    Send(WorkerId, Action),
    /// Its replicas, in an all-reduce.
    Group(Vec<WorkerId>, Action),
    /// Nobody: it is inside a computation (or an update).
    Nobody(Action),
}

fn wait_of(schedule: &Schedule, worker: WorkerId, a: Action) -> Wait {
    let key = |kind, stage, mb, from| Key {
        from,
        to: worker,
        kind,
        stage,
        index: mb,
        step: 0,
    };
    match a {
        Action::RecvActivation { stage, mb, from } => {
            Wait::Message(key(Kind::Activation, stage.wrapping_sub(1), mb, from))
        }
        Action::RecvGradient { stage, mb, from } => {
            Wait::Message(key(Kind::Gradient, stage + 1, mb, from))
        }
        Action::SendActivation { to, .. } | Action::SendGradient { to, .. } => Wait::Send(to, a),
        Action::AllReduce { stage, .. } => {
            let layout = schedule.layout();
            let group = (0..layout.workers())
                .filter(|&w| w != worker && layout.stages_of(w).any(|s| s == stage))
                .collect();
            Wait::Group(group, a)
        }
        other => Wait::Nobody(other),
    }
}

fn describe(key: &Key) -> String {
    let (what, of) = match key.kind {
        Kind::Activation => ("the activation", "microbatch"),
        Kind::Gradient => ("the gradient", "microbatch"),
        Kind::Chunk => ("an all-reduce or tied-gradient chunk", "update"),
        Kind::Control => ("a control record", "record"),
    };
    format!(
        "{what} of {of} {} from worker {} (stage {})",
        key.index, key.from, key.stage
    )
}

/// The report on a stalled run of `schedule`: the stall, every worker's state (`None`: it sent
/// no report), the wait-for graph as one line per worker, and the cause found by following the
/// waits from `stalled`.
pub fn diagnose(
    schedule: &Schedule,
    stops: &[Option<StopPoint>],
    stalled: WorkerId,
    awaited: &Key,
    waited: Duration,
) -> String {
    let layout = schedule.layout();
    let mut out = format!(
        "worker {stalled} waited {:.1} s for {} and the run was stopped.\nwait-for graph:\n",
        waited.as_secs_f64(),
        describe(awaited)
    );
    let waits: Vec<Option<Wait>> = stops
        .iter()
        .enumerate()
        .map(|(w, s)| {
            s.and_then(|s| s.at)
                .map(|a| wait_of(schedule, w as WorkerId, a))
        })
        .collect();
    for (w, (stop, wait)) in stops.iter().zip(&waits).enumerate() {
        let (position, replica) = layout.placement(w as WorkerId);
        let Some(stop) = stop else {
            let _ = writeln!(
                out,
                "  worker {w} (stage {position}, replica {replica}): sent no report (it is not \
                 running its program: stopped, stuck outside the transport, or gone)"
            );
            continue;
        };
        let last = stop
            .last_completed
            .map_or_else(|| "nothing yet".to_string(), |a| a.to_string());
        let state = match (stop.finished, wait) {
            (true, _) => "finished its program".to_string(),
            (false, Some(Wait::Message(k))) => format!("waits for {}", describe(k)),
            (false, Some(Wait::Send(to, a))) => format!("is sending to worker {to} ({a})"),
            (false, Some(Wait::Group(g, a))) => format!("waits for replicas {g:?} ({a})"),
            (false, Some(Wait::Nobody(a @ Action::Update { .. }))) => {
                format!("is inside {a} (with tied parameters it waits for the partner stage)")
            }
            (false, Some(Wait::Nobody(a))) => format!("waits for nobody: it is inside {a}"),
            (false, None) => "stopped outside its program".to_string(),
        };
        let _ = writeln!(
            out,
            "  worker {w} (stage {position}, replica {replica}): {state}; last completed {last} \
             ({} actions)",
            stop.completed
        );
    }
    let _ = write!(
        out,
        "cause: {}",
        cause(schedule, stops, &waits, stalled, awaited)
    );
    out
}

/// Why `waiter` still waits for `k` if its sender has sent it already (it was lost on the
/// way); `None` where the sender has not, or `k` is no message a program sends.
fn lost_message(
    schedule: &Schedule,
    stops: &[Option<StopPoint>],
    waiter: WorkerId,
    k: &Key,
) -> Option<String> {
    let send = match k.kind {
        Kind::Activation => Action::SendActivation {
            stage: k.stage,
            mb: k.index,
            to: waiter,
        },
        Kind::Gradient => Action::SendGradient {
            stage: k.stage,
            mb: k.index,
            to: waiter,
        },
        _ => return None,
    };
    let program = schedule.programs.get(k.from as usize)?;
    let at = program.iter().position(|&a| a == send)?;
    let done = stops.get(k.from as usize)?.as_ref()?;
    (done.finished || at < done.completed).then(|| {
        format!(
            "worker {} sent {} ({send}, action {at} of its program) but worker {waiter} \
             never received it: the message was lost in transport",
            k.from,
            describe(k).replace(&format!(" from worker {}", k.from), "")
        )
    })
}

/// The first replica of `group` not in the same all-reduce `a`: the one that holds the group
/// up (`None` when all are in it).
fn held_up(waits: &[Option<Wait>], group: &[WorkerId], a: &Action) -> Option<WorkerId> {
    group
        .iter()
        .copied()
        .find(|&g| !matches!(&waits[g as usize], Some(Wait::Group(_, b)) if b == a))
}

/// Follows the waits from `stalled`, which waits for `awaited`.
fn cause(
    schedule: &Schedule,
    stops: &[Option<StopPoint>],
    waits: &[Option<Wait>],
    stalled: WorkerId,
    awaited: &Key,
) -> String {
    // A message its sender has already sent, but its receiver still waits for, was lost on
    // the way; the first such wait along the graph is the cause.
    let lost = |waiter: WorkerId, k: &Key| lost_message(schedule, stops, waiter, k);
    if let Some(why) = lost(stalled, awaited) {
        return why;
    }
    for (w, wait) in waits.iter().enumerate() {
        if let Some(Wait::Message(k)) = wait {
            if let Some(why) = lost(w as WorkerId, k) {
                return why;
            }
        }
    }
    let mut path = vec![stalled];
    let mut next = awaited.from;
    let mut wanted = describe(awaited);
    loop {
        if let Some(i) = path.iter().position(|&w| w == next) {
            let cycle: Vec<String> = path[i..]
                .iter()
                .chain([&next])
                .map(|w| format!("worker {w}"))
                .collect();
            return format!(
                "a cycle: {} each wait for the next; the programs and the transport disagree",
                cycle.join(" -> ")
            );
        }
        let Some(stop) = stops.get(next as usize) else {
            return format!("worker {next} is not in this run");
        };
        let waiter = path[path.len() - 1];
        let Some(stop) = stop else {
            return format!(
                "worker {next} sent no report: it is not running its program (stopped, stuck \
                 outside the transport, or gone), and worker {waiter} waits for {wanted}"
            );
        };
        if stop.finished {
            return format!(
                "worker {next} finished its program, but worker {waiter} still waits for \
                 {wanted}: the message was lost"
            );
        }
        match &waits[next as usize] {
            Some(Wait::Message(k)) => {
                wanted = describe(k);
                path.push(next);
                next = k.from;
            }
            Some(Wait::Send(to, a)) => {
                // A receiver waiting for this very message cannot be what holds the send up.
                if matches!(&waits[*to as usize], Some(Wait::Message(k)) if k.from == next) {
                    return format!(
                        "worker {next} is stuck inside its send {a} while worker {to} waits for \
                         it, and worker {waiter} waits for {wanted}"
                    );
                }
                wanted = format!("room in worker {to}'s queue");
                path.push(next);
                next = *to;
            }
            Some(Wait::Group(group, a)) => match held_up(waits, group, a) {
                Some(g) => {
                    wanted = format!("its part of {a}");
                    path.push(next);
                    next = g;
                }
                None => {
                    return format!(
                        "workers {next} and {group:?} are all in {a} and none completes it"
                    );
                }
            },
            Some(Wait::Nobody(a)) => {
                return format!(
                    "worker {next} waits for nobody: it stalled inside {a}, and worker {waiter} \
                     waits for {wanted}"
                );
            }
            None => {
                return format!(
                    "worker {next} stopped outside its program, and worker {waiter} waits for \
                     {wanted}"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A stop report arrives from a worker process: a wait past what a `Duration` holds is
    /// no wait, where it panicked the launcher.
    #[test]
    fn a_reported_wait_no_duration_holds_is_left_out() {
        let report = |waited: f64| StopReport {
            rank: 1,
            policy: Policy::PipeDream,
            updates: 1,
            completed: 0,
            in_action: false,
            finished: false,
            stalled: Some((0, Kind::Activation, 0, 0, waited)),
        };
        assert_eq!(
            report(2.5).awaited().map(|(_, d)| d),
            Some(Duration::from_millis(2500))
        );
        assert_eq!(report(-1.0).awaited().map(|(_, d)| d), Some(Duration::ZERO));
        for hostile in [1e20, f64::INFINITY] {
            assert_eq!(report(hostile).awaited(), None, "{hostile}");
        }
    }
}
