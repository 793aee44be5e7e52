//! Structural validation of a schedule, and the untimed dry run that finds deadlocks.
//!
//! [`validate`] walks each worker's program once and checks, per stage and microbatch:
//! every action is on the worker that owns its stage and microbatch (round-robin replicas);
//! a forward has its input (a local forward of the previous stage, or a receive, once lowered)
//! and happens once; a backward (or input half) follows its forward and has its output
//! gradient; a weight half follows its input half; sends carry data that exists, go to the
//! owner of the consuming stage and pair with exactly one receive; updates of each stage run
//! in order, after an all-reduce when the stage is replicated (never otherwise), every
//! replica makes the same number of them, and no gradient is left out of an update. A lowered
//! schedule must carry every cross-worker transfer as a send and a receive; an unlowered one
//! must carry none. [`dry_run`] then runs the lowered programs with every action taking no
//! time, and reports a deadlock if workers end up waiting on each other.

use crate::action::{Action, Microbatch, StageId, WorkerId};
use crate::error::{Result, ScheduleError};
use crate::grid;
use crate::sim;
use crate::spec::Schedule;

const FWD: u8 = 1;
const BIN: u8 = 2;
const BWT: u8 = 4;
const ACT_SENT: u8 = 8;
const ACT_RECV: u8 = 16;
const GRAD_SENT: u8 = 32;
const GRAD_RECV: u8 = 64;

/// Per (worker, stage) bookkeeping of updates.
#[derive(Clone, Default)]
struct UpdateState {
    next: u32,
    reduced: bool,
    /// Ring steps done for the current update: `2 * step + (0 after send, 1 after receive)`.
    ring: u32,
    pending: Vec<Microbatch>,
}

/// Checks a schedule's structure (see the module docs).
///
/// # Errors
/// [`ScheduleError::Invalid`] naming the first broken rule, with the grid around it.
pub fn validate(schedule: &Schedule) -> Result<()> {
    let layout = schedule.layout();
    let stages = schedule.stages();
    let n = schedule.total_microbatches();
    let lowered = schedule.lowered;
    let mut flags = vec![0u8; stages as usize * n as usize];
    let idx = |s: StageId, mb: Microbatch| s as usize * n as usize + mb as usize;
    let mut update_counts: Vec<Option<u32>> = vec![None; stages as usize];
    if schedule.programs.len() != schedule.workers() as usize {
        return Err(ScheduleError::Spec(format!(
            "schedule has {} programs for {} workers",
            schedule.programs.len(),
            schedule.workers()
        )));
    }
    for w in 0..schedule.workers() {
        let prog = &schedule.programs[w as usize];
        let (position, _) = layout.placement(w);
        let chunks = layout.chunks() as usize;
        let mut upd = vec![UpdateState::default(); chunks];
        for (pc, &a) in prog.iter().enumerate() {
            let fail = |reason: String| Err(invalid(schedule, w, pc, reason));
            let stage = a.stage();
            if stage >= stages {
                return fail(format!("stage {stage} does not exist ({stages} stages)"));
            }
            if layout.position_of(stage) != position {
                return fail(format!("stage {stage} is not placed on worker {w}"));
            }
            if let Some(mb) = a.microbatch() {
                if mb >= n {
                    return fail(format!(
                        "microbatch {mb} is beyond the run ({n} microbatches)"
                    ));
                }
                if layout.worker_for(stage, mb) != w {
                    return fail(format!(
                        "microbatch {mb} of stage {stage} belongs to worker {} (round-robin)",
                        layout.worker_for(stage, mb)
                    ));
                }
            }
            if a.is_communication() && !lowered {
                return fail("send or receive in a schedule that is not lowered".into());
            }
            let c = layout.chunk_of(stage) as usize;
            let last = stages - 1;
            match a {
                Action::Forward { stage, mb } => {
                    let f = flags[idx(stage, mb)];
                    if f & FWD != 0 {
                        return fail(format!("microbatch {mb} forwarded twice"));
                    }
                    if stage > 0 {
                        let local = layout.worker_for(stage - 1, mb) == w;
                        let have = if local {
                            flags[idx(stage - 1, mb)] & FWD != 0
                        } else {
                            !lowered || f & ACT_RECV != 0
                        };
                        if !have {
                            return fail(format!("input of microbatch {mb} not available yet"));
                        }
                    }
                    flags[idx(stage, mb)] |= FWD;
                }
                Action::Backward { stage, mb } | Action::BackwardInput { stage, mb } => {
                    let f = flags[idx(stage, mb)];
                    if f & FWD == 0 {
                        return fail(format!("backward of microbatch {mb} before its forward"));
                    }
                    if f & BIN != 0 {
                        return fail(format!("microbatch {mb} backwarded twice"));
                    }
                    if stage < last {
                        let local = layout.worker_for(stage + 1, mb) == w;
                        let have = if local {
                            flags[idx(stage + 1, mb)] & BIN != 0
                        } else {
                            !lowered || f & GRAD_RECV != 0
                        };
                        if !have {
                            return fail(format!(
                                "output gradient of microbatch {mb} not available yet"
                            ));
                        }
                    }
                    flags[idx(stage, mb)] |= BIN;
                    if matches!(a, Action::Backward { .. }) {
                        flags[idx(stage, mb)] |= BWT;
                        upd[c].pending.push(mb);
                    }
                }
                Action::BackwardWeight { stage, mb } => {
                    let f = flags[idx(stage, mb)];
                    if f & BIN == 0 {
                        return fail(format!(
                            "weight gradient of microbatch {mb} before its input gradient"
                        ));
                    }
                    if f & BWT != 0 {
                        return fail(format!("weight gradient of microbatch {mb} computed twice"));
                    }
                    flags[idx(stage, mb)] |= BWT;
                    upd[c].pending.push(mb);
                }
                Action::SendActivation { stage, mb, to } => {
                    if stage == last {
                        return fail("the last stage has no activation to send".into());
                    }
                    let f = flags[idx(stage, mb)];
                    if f & FWD == 0 {
                        return fail(format!("sends microbatch {mb}'s output before its forward"));
                    }
                    if f & ACT_SENT != 0 {
                        return fail("activation sent twice".into());
                    }
                    let owner = layout.worker_for(stage + 1, mb);
                    if to != owner || owner == w {
                        return fail(format!(
                            "stage {} of microbatch {mb} is on worker {owner}",
                            stage + 1
                        ));
                    }
                    flags[idx(stage, mb)] |= ACT_SENT;
                }
                Action::RecvActivation { stage, mb, from } => {
                    if stage == 0 {
                        return fail("the first stage receives no activation".into());
                    }
                    let owner = layout.worker_for(stage - 1, mb);
                    if from != owner || owner == w {
                        return fail(format!(
                            "stage {} of microbatch {mb} is on worker {owner}",
                            stage - 1
                        ));
                    }
                    if flags[idx(stage, mb)] & ACT_RECV != 0 {
                        return fail("activation received twice".into());
                    }
                    flags[idx(stage, mb)] |= ACT_RECV;
                }
                Action::SendGradient { stage, mb, to } => {
                    if stage == 0 {
                        return fail("the first stage has no input gradient to send".into());
                    }
                    let f = flags[idx(stage, mb)];
                    if f & BIN == 0 {
                        return fail(format!(
                            "sends microbatch {mb}'s gradient before its backward"
                        ));
                    }
                    if f & GRAD_SENT != 0 {
                        return fail("gradient sent twice".into());
                    }
                    let owner = layout.worker_for(stage - 1, mb);
                    if to != owner || owner == w {
                        return fail(format!(
                            "stage {} of microbatch {mb} is on worker {owner}",
                            stage - 1
                        ));
                    }
                    flags[idx(stage, mb)] |= GRAD_SENT;
                }
                Action::RecvGradient { stage, mb, from } => {
                    if stage == last {
                        return fail("the last stage receives no gradient".into());
                    }
                    let owner = layout.worker_for(stage + 1, mb);
                    if from != owner || owner == w {
                        return fail(format!(
                            "stage {} of microbatch {mb} is on worker {owner}",
                            stage + 1
                        ));
                    }
                    if flags[idx(stage, mb)] & GRAD_RECV != 0 {
                        return fail("gradient received twice".into());
                    }
                    flags[idx(stage, mb)] |= GRAD_RECV;
                }
                Action::AllReduce { stage, update } => {
                    let st = &mut upd[c];
                    if layout.replicas_of(stage) < 2 {
                        return fail(format!(
                            "all-reduce on stage {stage}, which has one replica"
                        ));
                    }
                    if update != st.next || st.reduced || st.ring != 0 {
                        return fail(format!(
                            "all-reduce {update} out of order (next update is {})",
                            st.next
                        ));
                    }
                    st.reduced = true;
                }
                Action::SendChunk {
                    stage,
                    update,
                    step,
                    to,
                }
                | Action::RecvChunk {
                    stage,
                    update,
                    step,
                    from: to,
                } => {
                    let group = layout.group(stage);
                    let r = group.end - group.start;
                    let j = w - group.start;
                    let is_send = matches!(a, Action::SendChunk { .. });
                    let peer = if is_send {
                        group.start + (j + 1) % r
                    } else {
                        group.start + (j + r - 1) % r
                    };
                    let st = &mut upd[c];
                    let expect = 2 * step + u32::from(!is_send);
                    if r < 2 || update != st.next || st.reduced || st.ring != expect || to != peer {
                        return fail(format!(
                            "ring all-reduce step out of order or to the wrong peer (expected a {} of step {} with worker {peer})",
                            if st.ring % 2 == 0 { "send" } else { "receive" },
                            st.ring / 2
                        ));
                    }
                    st.ring += 1;
                    if st.ring == 4 * (r - 1) {
                        st.ring = 0;
                        st.reduced = true;
                    }
                }
                Action::Update { stage, update } => {
                    let st = &mut upd[c];
                    if update != st.next {
                        return fail(format!(
                            "update {update} out of order (expected {})",
                            st.next
                        ));
                    }
                    if layout.replicas_of(stage) > 1 && !st.reduced {
                        return fail("update of a replicated stage without an all-reduce".into());
                    }
                    if st.ring != 0 {
                        return fail("update in the middle of a ring all-reduce".into());
                    }
                    st.next += 1;
                    st.reduced = false;
                    st.pending.clear();
                }
            }
        }
        for (c, st) in upd.iter().enumerate() {
            let stage = c as u32 * layout.positions() + position;
            if let Some(&mb) = st.pending.first() {
                return Err(invalid(
                    schedule,
                    w,
                    prog.len(),
                    format!(
                        "gradient of microbatch {mb} at stage {stage} is never applied by an update"
                    ),
                ));
            }
            if st.reduced || st.ring != 0 {
                return Err(invalid(
                    schedule,
                    w,
                    prog.len(),
                    format!("all-reduce at stage {stage} without an update"),
                ));
            }
            match update_counts[stage as usize] {
                None => update_counts[stage as usize] = Some(st.next),
                Some(k) if k != st.next => {
                    return Err(invalid(
                        schedule,
                        w,
                        prog.len(),
                        format!(
                            "replicas of stage {stage} make different numbers of updates ({k} and {})",
                            st.next
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
    }
    // Everything done exactly once, and every transfer paired.
    for s in 0..stages {
        for mb in 0..n {
            let f = flags[idx(s, mb)];
            let w = layout.worker_for(s, mb);
            let end = schedule.programs[w as usize].len();
            let miss = |what: &str| {
                Err(invalid(
                    schedule,
                    w,
                    end,
                    format!("microbatch {mb} has no {what} at stage {s}"),
                ))
            };
            if f & FWD == 0 {
                return miss("forward");
            }
            if f & BIN == 0 {
                return miss("backward");
            }
            if f & BWT == 0 {
                return miss("weight gradient");
            }
            if s < stages - 1 && layout.worker_for(s + 1, mb) != w && lowered {
                let g = flags[idx(s + 1, mb)];
                if f & ACT_SENT == 0 || g & ACT_RECV == 0 {
                    return miss("send of its output activation paired with a receive");
                }
                if f & GRAD_RECV == 0 || g & GRAD_SENT == 0 {
                    return miss("receive of its output gradient paired with a send");
                }
            }
        }
    }
    Ok(())
}

/// Runs a lowered schedule with every action taking no time and reports whether every worker
/// reaches the end of its program.
///
/// # Errors
/// [`ScheduleError::Spec`] for an unlowered schedule; [`ScheduleError::Deadlock`] with each
/// blocked worker's position marked.
pub fn dry_run(schedule: &Schedule) -> Result<()> {
    if !schedule.lowered {
        return Err(ScheduleError::Spec(
            "the dry run needs a lowered schedule".into(),
        ));
    }
    sim::run_untimed(schedule)
}

/// [`validate`], then [`dry_run`].
///
/// # Errors
/// As the two checks.
pub fn check(schedule: &Schedule) -> Result<()> {
    validate(schedule)?;
    dry_run(schedule)
}

pub(crate) fn invalid(
    schedule: &Schedule,
    worker: WorkerId,
    step: usize,
    reason: String,
) -> ScheduleError {
    let action = schedule.programs[worker as usize]
        .get(step)
        .map_or_else(|| "end".to_string(), |a| a.to_string());
    ScheduleError::Invalid {
        worker,
        step,
        action,
        reason,
        grid: grid::around(schedule, worker, step),
    }
}
