//! A worker's program resumed at a step boundary of its segment, from its stage's state there:
//! what lets a surviving replica take over a lost worker's part without the rest of the run
//! going back (docs/reliability.md, "A surviving replica adopts the lost worker's program").
//!
//! Replicas of a stage agree at each of its updates, so a surviving replica's rollback points
//! ([`super::rollback`]) hold what the lost worker held at each step boundary: the stage's
//! weights and optimizer state, and the older weight versions its microbatches in flight read.
//! Resuming at step `k` (the stage at version `v`, just after its update `v - 1`):
//!
//! - the microbatches in flight there (an action before the boundary and one after it) have their actions before the boundary run
//!   again, in program order, each at the version the stage was at when it first ran: their
//!   inputs are received again, their forwards (and any backward halves) computed again, and
//!   what they sent is sent again. The arithmetic is the same, so every message is the same,
//!   bit for bit, and a receiver that already has it can drop it. Their figures (losses,
//!   version records) are not recorded twice: the rollback point holds them;
//! - every action from the boundary on runs as the program has it.
//!
//! A lost worker's program run by its adopter may replay a microbatch late, just before its
//! own next action, where its receivers already hold what the replay sends again
//! ([`ResumePoint::deferring_replays`]): the same arithmetic in another order.
//!
//! The worker then ends the segment with the weights, optimizer state and messages of the
//! worker it stands in for. `tests` below checks this for every step of a segment and every
//! policy that takes replicas.

use std::collections::{BTreeMap, BTreeSet};

use pipe_scheduler::{Action, Schedule, VersionPlan};

use crate::error::{Result, StageError};
use crate::model::Params;

/// One action of a resumed program, with the program counter it has in the whole program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planned {
    /// Its place in the worker's program (what the version plan's last uses count).
    pub pc: usize,
    /// The action.
    pub action: Action,
    /// For an action before the step boundary run again: the stage's version when it first
    /// ran (`None`: an action from the boundary on).
    pub replayed_at: Option<u32>,
    /// For a forward from the boundary on run later than the program has it
    /// ([`ResumePoint::deferring_replays`]): the stage's version at its place in the program,
    /// the one it reads. `None`: it runs where the program has it.
    pub moved_at: Option<u32>,
}

/// The whole of `program`, as it runs from the segment's start.
pub fn whole(program: &[Action]) -> Vec<Planned> {
    program
        .iter()
        .enumerate()
        .map(|(pc, &action)| Planned {
            pc,
            action,
            replayed_at: None,
            moved_at: None,
        })
        .collect()
}

/// Where a worker resumes: its stage's version there, and the older versions it reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResumePoint {
    /// The stage's version at the boundary (updates it had applied in the segment).
    pub version: u32,
    /// The actions to run: the replayed ones, then the program from the boundary on.
    pub actions: Vec<Planned>,
    /// The older versions (below `version`) those actions read.
    pub stash: BTreeSet<u32>,
    /// Versions to keep through a program counter past their last use in the program:
    /// those a replayed action moved later reads ([`ResumePoint::deferring_replays`]), kept
    /// until the action it now runs before.
    pub holds: BTreeMap<u32, usize>,
}

/// A worker's resumed program and the older weight versions it reads.
#[derive(Clone, Debug)]
pub struct Resume {
    /// Where it resumes and the actions it runs.
    pub point: ResumePoint,
    /// The weights of each version in `point.stash`.
    pub stash: BTreeMap<u32, Params>,
}

fn resume_err(msg: String) -> StageError {
    StageError::Executor(format!("resuming a worker: {msg}"))
}

/// The resumed program of `worker` of `schedule` at the boundary where its stage has applied
/// `version` updates of the segment (0: the segment's start).
///
/// # Errors
/// A worker of several stages, or a version the program never reaches.
pub fn resume_point(
    schedule: &Schedule,
    versions: &VersionPlan,
    worker: u32,
    version: u32,
) -> Result<ResumePoint> {
    let layout = schedule.layout();
    if layout.chunks() != 1 {
        return Err(resume_err("a worker of several stages".into()));
    }
    let program = schedule
        .programs
        .get(worker as usize)
        .ok_or_else(|| resume_err(format!("no worker {worker}")))?;
    let (stage, _) = layout.placement(worker);
    let boundary = match version {
        0 => 0,
        v => {
            let update = Action::Update {
                stage,
                update: v - 1,
            };
            1 + program
                .iter()
                .position(|&a| a == update)
                .ok_or_else(|| resume_err(format!("stage {stage} never reaches version {v}")))?
        }
    };
    // Microbatches in flight at the boundary: an action on either side of it. (None of a
    // later update's gradient is computed before it: the stage's one gradient sum would
    // have added it to update `version - 1`.)
    // Microbatch numbers are dense: one flag each (a recovery asks this of every worker
    // while the survivors wait).
    let mut after = vec![false; versions.microbatches() as usize];
    for mb in program[boundary..].iter().filter_map(Action::microbatch) {
        if let Some(flag) = after.get_mut(mb as usize) {
            *flag = true;
        }
    }
    let in_flight = |mb: u32| after.get(mb as usize).copied().unwrap_or(false);
    let mut actions = Vec::new();
    let mut at = 0;
    for (pc, &action) in program[..boundary].iter().enumerate() {
        if let Action::Update { .. } = action {
            at += 1;
        }
        if action.microbatch().is_some_and(in_flight) {
            actions.push(Planned {
                pc,
                action,
                replayed_at: Some(at),
                moved_at: None,
            });
        }
    }
    actions.extend(whole(program).into_iter().skip(boundary));
    let mut stash = versions.read_from(schedule, worker, boundary, version);
    for p in actions.iter().filter(|p| p.replayed_at.is_some()) {
        if let Some(mb) = p.action.microbatch() {
            stash.insert(versions.forward_version(stage, mb));
            stash.insert(versions.backward_version(stage, mb));
        }
    }
    stash.retain(|&v| v < version);
    Ok(ResumePoint {
        version,
        actions,
        stash,
        holds: BTreeMap::new(),
    })
}

impl ResumePoint {
    /// Runs the replayed actions of each microbatch in flight just before that microbatch's
    /// first action from the boundary on, rather than all of them first, wherever each of
    /// its replayed sends is one its receiver already holds (`delivered`): its forward is
    /// then needed only for its own backward, so the microbatch the pipeline waits on (the
    /// stage's update in flight) goes first. A replayed send its receiver may still wait for
    /// stays in front, in program order, as must its forward: moved, the receiver could wait
    /// for it while this program waits on the receiver. The same holds for a forward from the
    /// boundary on whose sends have all arrived (the lost worker ran it before it was lost):
    /// it runs just before its microbatch's next action, at the version it reads where the
    /// program has it ([`Planned::moved_at`]). The arithmetic is the same (each moved action
    /// still reads the version it read in program order, held for it in
    /// [`ResumePoint::holds`]), so are the weights and the messages; only their order moves.
    pub fn deferring_replays(
        &mut self,
        versions: &VersionPlan,
        delivered: impl Fn(&Action) -> bool,
    ) {
        let first_kept = self
            .actions
            .iter()
            .position(|p| p.replayed_at.is_none())
            .unwrap_or(self.actions.len());
        let rest = self.actions.split_off(first_kept);
        let replayed = std::mem::take(&mut self.actions);
        // Microbatches whose replay stays in front: one of its sends may not have arrived,
        // or it replays a backward half (whose gradient sum and all-reduce follow the program's
        // order).
        let in_front: BTreeSet<u32> = replayed
            .iter()
            .filter(|p| match p.action.kind() {
                pipe_scheduler::ActionKind::Send => !delivered(&p.action),
                kind => kind.is_compute() && !matches!(p.action, Action::Forward { .. }),
            })
            .filter_map(|p| p.action.microbatch())
            .collect();
        // Where each moved action goes: before the action of `rest` at the index it is filed
        // under.
        let mut before: BTreeMap<usize, Vec<Planned>> = BTreeMap::new();
        for p in replayed {
            let at = p
                .action
                .microbatch()
                .filter(|mb| !in_front.contains(mb))
                .and_then(|mb| rest.iter().position(|r| r.action.microbatch() == Some(mb)));
            match at {
                Some(at) => {
                    self.hold(versions, &p, rest[at].pc);
                    before.entry(at).or_default().push(p);
                }
                None => self.actions.push(p),
            }
        }
        let mut moved = vec![false; rest.len()];
        for (group, at) in delivered_forwards(&rest, &delivered) {
            let updates = rest[..group[0]]
                .iter()
                .filter(|r| matches!(r.action, Action::Update { .. }))
                .count() as u32;
            for i in group {
                let p = Planned {
                    moved_at: Some(self.version + updates),
                    ..rest[i]
                };
                self.hold(versions, &p, rest[at].pc);
                before.entry(at).or_default().push(p);
                moved[i] = true;
            }
        }
        for (i, p) in rest.into_iter().enumerate() {
            if let Some(moved) = before.remove(&i) {
                self.actions.extend(moved);
            }
            if !moved[i] {
                self.actions.push(p);
            }
        }
    }

    /// Keeps the version `p` reads through program counter `until`, where it now runs.
    fn hold(&mut self, versions: &VersionPlan, p: &Planned, until: usize) {
        if let Some(v) = versions.version_read_by(p.action) {
            let keep = self.holds.entry(v).or_insert(0);
            *keep = (*keep).max(until);
        }
    }

    /// This program ending where its stage has applied `end` updates (of `resolved`'s
    /// `stage`): every update, all-reduce and chunk from update `end` on is left out, and so
    /// is every action of a microbatch whose gradient goes to one of those updates.
    ///
    /// What remains is the program of a segment that drains there (module docs of
    /// [`super::rollback`]): the forwards and backwards of the microbatches kept read the
    /// versions they read in the longer program, since no update before them is left out.
    /// Cut at the same step of the segment, every worker keeps the same microbatches, so each
    /// send kept has its receive and nothing is left in flight.
    pub fn ending_at(&mut self, resolved: &pipe_scheduler::Resolved, stage: u32, end: u32) {
        self.actions.retain(|p| {
            let by_update = p.action.update_index().is_none_or(|u| u < end);
            let by_microbatch = p
                .action
                .microbatch()
                .is_none_or(|mb| resolved.update_of(stage, mb) < end);
            by_update && by_microbatch
        });
    }
}

/// The forwards of `rest` (a program from its boundary on) that may run later: for each
/// microbatch whose first actions there are a forward and its receive and sends, with every
/// send one its receiver holds (`delivered`) and an action of the microbatch after them
/// that others come before, the indices of those actions and of that next action.
///
/// One pass over `rest` (the rest of a segment, thousands of actions, planned while the
/// stage's other replica waits): only microbatches with a delivered send are followed.
fn delivered_forwards(
    rest: &[Planned],
    delivered: &impl Fn(&Action) -> bool,
) -> Vec<(Vec<usize>, usize)> {
    let forward_part = |a: &Action| {
        matches!(
            a,
            Action::Forward { .. } | Action::RecvActivation { .. } | Action::SendActivation { .. }
        )
    };
    let candidates: BTreeSet<u32> = rest
        .iter()
        .filter(|p| matches!(p.action, Action::SendActivation { .. }) && delivered(&p.action))
        .filter_map(|p| p.action.microbatch())
        .collect();
    let mut of_mb: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, p) in rest.iter().enumerate() {
        if let Some(mb) = p.action.microbatch().filter(|mb| candidates.contains(mb)) {
            of_mb.entry(mb).or_default().push(i);
        }
    }
    let mut out = Vec::new();
    for indices in of_mb.into_values() {
        let split = indices
            .iter()
            .position(|&j| !forward_part(&rest[j].action))
            .unwrap_or(indices.len());
        let (group, after) = indices.split_at(split);
        let Some(&next) = after.first() else {
            continue;
        };
        let has_forward = group
            .iter()
            .any(|&j| matches!(rest[j].action, Action::Forward { .. }));
        let sends_arrived = group.iter().all(|&j| {
            !matches!(rest[j].action, Action::SendActivation { .. }) || delivered(&rest[j].action)
        });
        let others_between = group.last().is_some_and(|&last| next > last + 1);
        if has_forward && sends_arrived && others_between {
            out.push((group.to_vec(), next));
        }
    }
    out
}

/// The weights of each version in `point.stash`, from `held` (a version's weights, if kept).
///
/// # Errors
/// A version that is not kept.
pub fn stash_of(
    point: &ResumePoint,
    mut held: impl FnMut(u32) -> Option<Params>,
) -> Result<BTreeMap<u32, Params>> {
    point
        .stash
        .iter()
        .map(|&v| {
            held(v)
                .map(|p| (v, p))
                .ok_or_else(|| resume_err(format!("weight version {v} is no longer kept")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipe_scheduler::{Length, LowerOptions, Policy, ScheduleSpec, generate, lower};

    fn pipedream() -> (Schedule, VersionPlan) {
        let spec = ScheduleSpec::new(Policy::PipeDream, 2, 2)
            .with_replicas(vec![2, 2])
            .with_length(Length::Updates(4));
        let schedule = lower(
            &generate(&spec).expect("a schedule"),
            LowerOptions::default(),
        );
        let versions = VersionPlan::derive(&schedule).expect("a version plan");
        (schedule, versions)
    }

    #[test]
    fn at_the_segments_start_the_whole_program_runs_and_nothing_is_replayed() {
        let (schedule, versions) = pipedream();
        for w in 0..schedule.workers() {
            let point = resume_point(&schedule, &versions, w, 0).expect("a point");
            assert_eq!(point.actions, whole(&schedule.programs[w as usize]));
            assert!(point.stash.is_empty());
        }
    }

    #[test]
    fn a_boundary_replays_the_first_stages_forwards_in_flight_at_the_version_they_ran() {
        let (schedule, versions) = pipedream();
        // Worker 0 holds stage 0, whose forwards run ahead of its updates.
        let point = resume_point(&schedule, &versions, 0, 2).expect("a point");
        let replayed: Vec<_> = point
            .actions
            .iter()
            .filter(|p| p.replayed_at.is_some())
            .collect();
        assert!(!replayed.is_empty(), "{:?}", point.actions);
        for p in &replayed {
            assert!(p.action.microbatch().is_some(), "{p:?}");
            assert!(p.replayed_at < Some(2), "{p:?}");
        }
        // Replayed actions keep program order and come before the rest.
        let pcs: Vec<usize> = replayed.iter().map(|p| p.pc).collect();
        assert!(pcs.windows(2).all(|w| w[0] < w[1]));
        assert!(point.stash.iter().all(|&v| v < 2) && !point.stash.is_empty());
    }

    #[test]
    fn programs_cut_at_a_step_keep_its_microbatches_and_every_send_its_receive() {
        let (schedule, versions) = pipedream();
        let resolved = &schedule.resolved;
        let step = 2u32;
        let mut sends = std::collections::HashSet::new();
        let mut receives = std::collections::HashSet::new();
        for w in 0..schedule.workers() {
            let (stage, _) = schedule.layout().placement(w);
            let end = step * resolved.minibatch / resolved.update_size(stage);
            let mut point = resume_point(&schedule, &versions, w, 0).expect("a point");
            let whole_len = point.actions.len();
            point.ending_at(resolved, stage, end);
            assert!(point.actions.len() < whole_len, "worker {w}: nothing cut");
            for p in &point.actions {
                if let Some(mb) = p.action.microbatch() {
                    assert!(mb < step * resolved.minibatch, "worker {w}: {p:?}");
                }
                if let Some(u) = p.action.update_index() {
                    assert!(u < end, "worker {w}: {p:?}");
                }
                let key = crate::pipeline::exec::data_key(w, p.action);
                match p.action {
                    Action::SendActivation { .. } | Action::SendGradient { .. } => {
                        sends.extend(key);
                    }
                    Action::RecvActivation { .. } | Action::RecvGradient { .. } => {
                        receives.extend(key);
                    }
                    _ => {}
                }
            }
            // The stage ends at its update `end - 1`.
            let last = point.actions.iter().rev().find_map(|p| match p.action {
                Action::Update { update, .. } => Some(update),
                _ => None,
            });
            assert_eq!(last, Some(end - 1), "worker {w}");
        }
        // Every worker cut at the same step: each send kept has its receive kept, and none is
        // left waiting.
        assert!(!sends.is_empty());
        assert_eq!(sends, receives);
    }

    #[test]
    fn a_version_the_stage_never_reaches_is_refused() {
        let (schedule, versions) = pipedream();
        assert!(resume_point(&schedule, &versions, 0, 99).is_err());
        assert!(resume_point(&schedule, &versions, 99, 1).is_err());
    }
}
