//! Lowering: inserting the communication a schedule implies.
//!
//! The sender side decides where both halves go: after every forward (or input-gradient
//! backward) whose consumer lives on another worker, a send; immediately before the consuming
//! action on the other worker, the matching receive. A receive therefore sits exactly where its
//! data is first needed and no worker ever waits for data it could do without, which is what lets
//! the untimed dry run decide deadlock. Stages held by the same worker hand data over locally
//! (no message). With `expand_all_reduce`, each `AllReduce` becomes the ring's `2(r-1)` send and
//! receive steps (reduce-scatter, then all-gather) so the simulator charges each chunk on the
//! link; otherwise it stays one collective action, which is how the executor runs it.

use crate::action::{Action, WorkerId};
use crate::error::Result;
use crate::spec::{Layout, Schedule};

/// Options for [`lower`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LowerOptions {
    /// Replace each collective all-reduce by its explicit ring steps.
    pub expand_all_reduce: bool,
}

/// Returns the schedule with sends and receives inserted. A schedule that is already lowered
/// is returned unchanged; a one-worker schedule comes back with the same programs, marked
/// lowered (nothing crosses workers).
pub fn lower(schedule: &Schedule, opts: LowerOptions) -> Schedule {
    if schedule.lowered {
        return schedule.clone();
    }
    let layout = schedule.layout();
    let programs = schedule
        .programs
        .iter()
        .enumerate()
        .map(|(w, prog)| {
            // At most a receive and a send around each action (ring steps aside).
            let mut out = Vec::with_capacity(prog.len() * 3);
            for &a in prog {
                match a {
                    Action::AllReduce { stage, update } if opts.expand_all_reduce => {
                        expand_all_reduce(layout, w as WorkerId, stage, update, &mut out);
                    }
                    _ => out.extend(lower_action(layout, w as WorkerId, a).into_iter().flatten()),
                }
            }
            out
        })
        .collect();
    Schedule {
        resolved: schedule.resolved.clone(),
        programs,
        lowered: true,
    }
}

/// [`lower`], refusing first an expansion of all-reduces whose ring steps are past
/// [`crate::limits::MAX_RING_STEPS`]. The schedule's size limits count microbatch passes, not
/// ring steps, and a stage of `r` replicas adds `r x 2(r-1)` of them per update: 4,096
/// replicas over 3 updates would lower to 100 million steps (over 6 GB).
///
/// # Errors
/// [`crate::ScheduleError::Spec`] naming the ring steps and the limit.
pub fn lower_checked(schedule: &Schedule, opts: LowerOptions) -> Result<Schedule> {
    if opts.expand_all_reduce && !schedule.lowered {
        crate::limits::check_ring_steps(ring_steps(schedule))?;
    }
    Ok(lower(schedule, opts))
}

/// The ring steps expanding every all-reduce of `schedule` adds: `2(r-1)` on each replica of
/// a stage of `r` replicas, for each of its all-reduces (each step a send and a receive).
pub fn ring_steps(schedule: &Schedule) -> u64 {
    let layout = schedule.layout();
    schedule
        .programs
        .iter()
        .flatten()
        .map(|a| match *a {
            Action::AllReduce { stage, .. } => {
                let group = layout.group(stage);
                2 * u64::from(group.end - group.start).saturating_sub(1)
            }
            _ => 0,
        })
        .sum()
}

/// The peers action `a` of worker `w`'s program talks to: the worker it receives its input
/// from and the worker it sends its output to, where those live on other workers (the one
/// home of the lowering rule, shared by [`lower`] and the streaming simulator). A collective
/// all-reduce talks to no single peer.
#[inline(always)]
pub(crate) fn peers(
    layout: &Layout,
    w: WorkerId,
    a: Action,
) -> (Option<WorkerId>, Option<WorkerId>) {
    let last = layout.stages() - 1;
    let (stage, mb, upstream_in) = match a {
        Action::Forward { stage, mb } => (stage, mb, true),
        Action::Backward { stage, mb } | Action::BackwardInput { stage, mb } => (stage, mb, false),
        _ => return (None, None),
    };
    let before = (stage > 0)
        .then(|| layout.worker_for(stage - 1, mb))
        .filter(|&p| p != w);
    let after = (stage < last)
        .then(|| layout.worker_for(stage + 1, mb))
        .filter(|&p| p != w);
    if upstream_in {
        (before, after)
    } else {
        (after, before)
    }
}

/// The receive that brings the input of compute action `a` from `from`, and the send that
/// carries its output to `to`: activations for a forward, gradients for anything else.
#[inline]
pub(crate) fn transfers(a: Action, from: WorkerId, to: WorkerId) -> (Action, Action) {
    let (stage, mb) = stage_and_microbatch(a);
    match a {
        Action::Forward { .. } => (
            Action::RecvActivation { stage, mb, from },
            Action::SendActivation { stage, mb, to },
        ),
        _ => (
            Action::RecvGradient { stage, mb, from },
            Action::SendGradient { stage, mb, to },
        ),
    }
}

/// Stage and microbatch of a compute action ([`peers`] gives peers to those only).
#[inline]
fn stage_and_microbatch(a: Action) -> (u32, u32) {
    (a.stage(), a.microbatch().unwrap_or_default())
}

/// Action `a` of worker `w`'s program with the communication it implies: the receive it
/// waits for, the action, the send it makes.
fn lower_action(layout: &Layout, w: WorkerId, a: Action) -> [Option<Action>; 3] {
    let (from, to) = peers(layout, w, a);
    let (recv, send) = transfers(a, from.unwrap_or_default(), to.unwrap_or_default());
    [from.map(|_| recv), Some(a), to.map(|_| send)]
}

/// Worker `w`'s ring steps of an all-reduce: `2(r-1)` sends to the next replica, each followed
/// by a receive from the previous one (reduce-scatter, then all-gather).
fn expand_all_reduce(layout: &Layout, w: WorkerId, stage: u32, update: u32, out: &mut Vec<Action>) {
    let group = layout.group(stage);
    let r = group.end - group.start;
    let j = w - group.start;
    let next = group.start + (j + 1) % r;
    let prev = group.start + (j + r - 1) % r;
    for step in 0..2 * (r - 1) {
        out.push(Action::SendChunk {
            stage,
            update,
            step,
            to: next,
        });
        out.push(Action::RecvChunk {
            stage,
            update,
            step,
            from: prev,
        });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::generate::generate;
    use crate::spec::{Length, Policy, ScheduleSpec};

    /// Ring steps are counted as expansion adds them, and an expansion past the limit is
    /// refused before it is built (4,096 replicas over 3 updates: 100,638,720 steps).
    #[test]
    fn expanding_all_reduces_past_the_ring_step_limit_is_refused() {
        let expand = LowerOptions {
            expand_all_reduce: true,
        };
        let spec = ScheduleSpec::new(Policy::OneFOneBFlush, 2, 2)
            .with_replicas(vec![3, 1])
            .with_length(Length::Updates(2));
        let small = generate(&spec).unwrap();
        // Stage 0: 3 replicas x 2 updates x 2(3-1) steps; stage 1 has no all-reduce steps.
        assert_eq!(ring_steps(&small), 24);
        let lowered = lower_checked(&small, expand).unwrap();
        let chunks = lowered
            .programs
            .iter()
            .flatten()
            .filter(|a| matches!(a, Action::SendChunk { .. }))
            .count();
        assert_eq!(chunks, 24);
        let spec = ScheduleSpec::new(Policy::OneFOneBFlush, 1, 1)
            .with_replicas(vec![4096])
            .with_length(Length::Updates(3));
        let big = generate(&spec).unwrap();
        let e = lower_checked(&big, expand).unwrap_err().to_string();
        assert!(e.contains("ring steps") && e.contains("100638720"), "{e}");
        assert!(lower_checked(&big, LowerOptions::default()).is_ok());
    }
}
