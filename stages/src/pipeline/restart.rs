//! Restarting a failed run by itself (`pipe train --max-restarts N`), as a scheduler would
//! relaunch it, without a person: every worker starts again from the newest checkpoint in the
//! run's checkpoint directory (or from where the run first started, when none has been written
//! yet), up to `N` times. A run stops for good on its first failure caused by what the user
//! gave (bad input: a restart would fail the same way) and after the `N`-th restart fails; it
//! then names every cause, in order.
//!
//! Worker processes restart a lost replica of a replicated stage alone, live: its launcher
//! starts a replacement that takes its stage's state from a surviving replica
//! ([`super::processes`]). Each such replacement takes one of the same `N` restarts
//! ([`RestartPolicy::take_restart`]).
//!
//! A restarted run loses the updates since the checkpoint it resumes from, and says how many;
//! it trains on from there exactly as a run resumed by hand would (checkpoints resume bit for
//! bit), so its final weights are those of an undisturbed run.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use pipe_transport::fault::{Fault, FaultPlan, FaultSchedule};

use crate::checkpoint;
use crate::config::{Placement, RunConfig};
use crate::error::{Result, StageError};

fn bad(why: String) -> StageError {
    StageError::Config(why)
}

/// When a failed run starts again.
#[derive(Clone, Debug, Default)]
pub struct RestartPolicy {
    /// Restarts after failures (0: a failure ends the run).
    pub max_restarts: u32,
    /// The run's checkpoint directory, where the newest checkpoint is looked for.
    pub checkpoint_dir: Option<PathBuf>,
    /// Restarts taken so far, of both kinds (shared by the clones a launcher holds).
    pub used: Arc<AtomicU32>,
}

impl RestartPolicy {
    /// Up to `max_restarts` restarts, the newest checkpoint looked for in `checkpoint_dir`.
    pub fn new(max_restarts: u32, checkpoint_dir: Option<PathBuf>) -> Self {
        RestartPolicy {
            max_restarts,
            checkpoint_dir,
            used: Arc::default(),
        }
    }

    /// Takes one of the run's restarts if one is left, and returns its number (from 1). Both
    /// kinds take one: a start again of every worker, and a lost replica replaced live.
    pub fn take_restart(&self) -> Option<u32> {
        let next = |used: u32| (used < self.max_restarts).then_some(used + 1);
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, next)
            .ok()
            .map(|used| used + 1)
    }
}

/// A restart about to happen, as reported before it starts.
#[derive(Debug)]
pub struct Restart<'a> {
    /// The restart, from 1.
    pub number: u32,
    /// Restarts allowed.
    pub of: u32,
    /// Why the last attempt failed.
    pub cause: &'a StageError,
    /// The checkpoint it resumes from and its update count (`None`: from the run's start).
    pub from: Option<(PathBuf, u64)>,
    /// Updates the failed attempt had reported done, when it reported any.
    pub reached: Option<u64>,
}

impl Restart<'_> {
    /// Updates the restart loses: those past its checkpoint that the failed attempt reached.
    pub fn lost(&self) -> Option<u64> {
        let from = self.from.as_ref().map_or(0, |(_, u)| *u);
        self.reached.map(|r| r.saturating_sub(from))
    }
}

/// Where attempt `attempt` starts: the first from `first` (a `--resume` the user gave, or
/// fresh), every later one from the newest checkpoint in the policy's directory, or `first`
/// when none has been written.
///
/// # Errors
/// A checkpoint directory whose newest checkpoint cannot be read.
fn start_of(policy: &RestartPolicy, attempt: u32, first: Option<&Path>) -> Result<Option<PathBuf>> {
    if attempt == 0 {
        return Ok(first.map(Path::to_path_buf));
    }
    let newest = policy
        .checkpoint_dir
        .as_deref()
        .and_then(|d| checkpoint::list(d).pop());
    Ok(match newest {
        Some((_, dir)) => Some(dir),
        None => first.map(Path::to_path_buf),
    })
}

/// The update count of the checkpoint at `dir`.
fn updates_of(dir: &Path) -> Result<u64> {
    Ok(checkpoint::read_state(dir)?.1.updates)
}

/// Runs `attempt` (given its number, from 0, and the checkpoint to resume from) until it
/// succeeds, restarting it under `policy`. `first` is where the first attempt starts;
/// `reached` says how many updates the attempt that just failed had reported; `survive` is
/// asked first about each failure, with the update the next attempt would start from, and
/// returns true when the run goes on without counting a restart (a lost replica, after which
/// the caller has changed the layout); `on_restart` hears of each restart before it starts.
///
/// # Errors
/// The first failure caused by bad input or a divergence; otherwise, once no restart is left, a
/// [`StageError::Launch`] naming every counted failure's cause in order (the last failure
/// alone when no restart was allowed).
pub fn with_restarts<T>(
    policy: &RestartPolicy,
    first: Option<&Path>,
    mut attempt: impl FnMut(u32, Option<&Path>) -> Result<T>,
    mut reached: impl FnMut() -> Option<u64>,
    mut on_restart: impl FnMut(&Restart<'_>),
    mut survive: impl FnMut(&StageError, u64) -> bool,
) -> Result<T> {
    let mut causes: Vec<String> = Vec::new();
    let mut number = 0;
    let mut from = start_of(policy, 0, first)?;
    loop {
        let err = match attempt(number, from.as_deref()) {
            Ok(out) => return Ok(out),
            Err(e) => e,
        };
        // Bad input, and a run whose arithmetic diverged, fail the same way however often
        // they start again.
        if err.is_bad_input() || err.diverged_at().is_some() {
            return Err(err);
        }
        let next = match start_of(policy, number + 1, first)? {
            Some(dir) => {
                let updates = updates_of(&dir)?;
                Some((dir, updates))
            }
            None => None,
        };
        number += 1;
        from = next.as_ref().map(|(dir, _)| dir.clone());
        if survive(&err, next.as_ref().map_or(0, |(_, u)| *u)) {
            continue;
        }
        if policy.max_restarts == 0 {
            return Err(err);
        }
        causes.push(err.to_string());
        let Some(number) = policy.take_restart() else {
            return Err(past_restarts(policy, &causes));
        };
        on_restart(&Restart {
            number,
            of: policy.max_restarts,
            cause: &err,
            from: next,
            reached: reached(),
        });
    }
}

/// The failure of a run whose restarts are spent: every counted cause, in order, and the
/// restarts that replaced lost replicas live, if any did.
fn past_restarts(policy: &RestartPolicy, causes: &[String]) -> StageError {
    let list: Vec<String> = causes
        .iter()
        .enumerate()
        .map(|(i, c)| format!("({}) {c}", i + 1))
        .collect();
    let starts = causes.len().saturating_sub(1) as u32;
    let replaced = policy.used.load(Ordering::SeqCst).saturating_sub(starts);
    let replaced = match replaced {
        0 => String::new(),
        1 => " (1 restart replaced a lost replica live)".into(),
        n => format!(" ({n} restarts replaced lost replicas live)"),
    };
    StageError::Launch {
        why: format!(
            "the run failed {} times, past --max-restarts {}{replaced}: {}",
            causes.len(),
            policy.max_restarts,
            list.join("; ")
        ),
        bad_input: false,
    }
}

/// Data messages of a worker within which a drawn fault fires (`--fault-schedule
/// random:SEED:COUNT`): early enough that every start of a short run meets its fault.
pub const DRAWN_FAULT_WITHIN: u64 = 100;

/// The fault schedule `plan` gives this run, drawn for its workers when it is seeded (the
/// caller prints a drawn one, so that the run can be repeated); refused for a run it cannot apply to: one with no
/// pipeline, one in process that would end the process (`exit@N`), or one that names a
/// worker the run lacks, or a cut link where links are not QUIC's.
///
/// # Errors
/// [`StageError::Config`] naming the fault that cannot apply.
pub fn fault_schedule(plan: &FaultPlan, cfg: &RunConfig) -> Result<FaultSchedule> {
    let processes = cfg.pipelined && cfg.placement == Placement::Processes;
    if !cfg.pipelined {
        return Err(bad(
            "--fault-schedule injects faults into a pipeline's workers: give a pipeline flag"
                .into(),
        ));
    }
    let workers = cfg.resolved()?.layout.workers();
    let faults = plan.schedule(workers, DRAWN_FAULT_WITHIN, cfg.stall_timeout);
    if let Some(rank) = faults.max_rank().filter(|&r| r >= workers) {
        return Err(bad(format!(
            "--fault-schedule names worker {rank}, but the run has {workers} workers"
        )));
    }
    for f in &faults.0 {
        if let Fault::Partition { peer, .. } = f.fault {
            if peer >= workers || peer == f.rank {
                return Err(bad(format!(
                    "--fault-schedule: {}:{} cuts a link to worker {peer}, which worker {} does not have ({workers} workers)",
                    f.rank, f.fault, f.rank
                )));
            }
        }
        let whole_process = matches!(
            f.fault,
            Fault::Exit { .. } | Fault::Freeze { .. } | Fault::Partition { .. }
        );
        if !processes && whole_process {
            return Err(bad(format!(
                "--fault-schedule: {} acts on a worker's process or its network, and in process that is the whole run: give --placement processes, or panic@N or stall@N:SECONDS",
                f.fault
            )));
        }
        // The launcher's workers run on this host: `auto` is shared memory there.
        let cuts = cfg.transport.for_processes(true).cuts_links();
        if matches!(f.fault, Fault::Partition { .. }) && !cuts {
            return Err(bad(format!(
                "--fault-schedule: {} cuts a network link, and only QUIC links are cut (workers on one host talk through shared memory): give --transport quic",
                f.fault
            )));
        }
    }
    Ok(faults)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(bad_input: bool) -> StageError {
        StageError::Launch {
            why: "worker 1 was killed by signal 9".into(),
            bad_input,
        }
    }

    #[test]
    fn a_run_restarts_up_to_its_limit_then_names_every_cause() {
        let policy = RestartPolicy::new(2, None);
        let mut seen = Vec::new();
        let mut restarts = 0;
        let err = with_restarts(
            &policy,
            None,
            |n, from| -> Result<()> {
                seen.push((n, from.map(Path::to_path_buf)));
                Err(failure(false))
            },
            || Some(7),
            |r| {
                restarts += 1;
                assert_eq!((r.number, r.of, r.lost()), (restarts, 2, Some(7)));
            },
            |_, _| false,
        )
        .unwrap_err();
        assert_eq!(seen, vec![(0, None), (1, None), (2, None)]);
        let msg = err.to_string();
        assert!(
            msg.contains("failed 3 times, past --max-restarts 2"),
            "{msg}"
        );
        assert_eq!(msg.matches("killed by signal 9").count(), 3, "{msg}");
        assert!(!err.is_bad_input());
    }

    #[test]
    fn a_lost_replica_replaced_live_takes_one_of_the_same_restarts() {
        let policy = RestartPolicy::new(2, None);
        // The launcher's clone replaces a lost replica: restart 1 of 2.
        assert_eq!(policy.clone().take_restart(), Some(1));
        let mut numbers = Vec::new();
        let err = with_restarts(
            &policy,
            None,
            |_, _| -> Result<()> { Err(failure(false)) },
            || None,
            |r| numbers.push((r.number, r.of)),
            |_, _| false,
        )
        .unwrap_err();
        // One start again is left, then the run fails.
        assert_eq!(numbers, vec![(2, 2)]);
        let msg = err.to_string();
        assert!(
            msg.contains(
                "failed 2 times, past --max-restarts 2 (1 restart replaced a lost replica live)"
            ),
            "{msg}"
        );
        assert_eq!(policy.take_restart(), None);
    }

    #[test]
    fn bad_input_and_success_end_the_loop_at_once() {
        let policy = RestartPolicy::new(5, None);
        let mut calls = 0;
        let err = with_restarts(
            &policy,
            None,
            |_, _| -> Result<()> {
                calls += 1;
                Err(failure(true))
            },
            || None,
            |_| {},
            |_, _| false,
        )
        .unwrap_err();
        assert!(err.is_bad_input());
        assert_eq!(calls, 1);
        let mut calls = 0;
        let out = with_restarts(
            &policy,
            None,
            |n, _| {
                calls += 1;
                if n < 2 { Err(failure(false)) } else { Ok(n) }
            },
            || None,
            |_| {},
            |_, _| false,
        );
        assert_eq!((out.ok(), calls), (Some(2), 3));
    }

    #[test]
    fn a_survived_failure_counts_no_restart() {
        let policy = RestartPolicy::default();
        let mut survived = 0;
        let out = with_restarts(
            &policy,
            None,
            |n, _| if n < 2 { Err(failure(false)) } else { Ok(n) },
            || None,
            |_| panic!("no restart is counted"),
            |_, from| {
                assert_eq!(from, 0);
                survived += 1;
                true
            },
        );
        assert_eq!((out.ok(), survived), (Some(2), 2));
    }

    #[test]
    fn no_restarts_returns_the_failure_itself() {
        let err = with_restarts(
            &RestartPolicy::default(),
            None,
            |_, _| -> Result<()> { Err(failure(false)) },
            || None,
            |_| {},
            |_, _| false,
        )
        .unwrap_err();
        assert_eq!(err.to_string(), "worker 1 was killed by signal 9");
    }
}
