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
use crate::grid::invalid;
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
    if schedule.programs.len() != schedule.workers() as usize {
        return Err(ScheduleError::Spec(format!(
            "schedule has {} programs for {} workers",
            schedule.programs.len(),
            schedule.workers()
        )));
    }
    let mut checker = Checker::new(schedule);
    for w in 0..schedule.workers() {
        checker.worker(w)?;
    }
    checker.everything_done()
}

/// Why an action breaks a rule (the caller adds the worker, step and grid).
type Rule = std::result::Result<(), String>;

/// The state of [`validate`]'s walk: per (stage, microbatch) flags of what has happened, and
/// each stage's update count (replicas must agree).
struct Checker<'a> {
    schedule: &'a Schedule,
    layout: &'a crate::spec::Layout,
    stages: u32,
    n: u32,
    lowered: bool,
    flags: Vec<u8>,
    update_counts: Vec<Option<u32>>,
}

impl<'a> Checker<'a> {
    fn new(schedule: &'a Schedule) -> Self {
        let stages = schedule.stages();
        let n = schedule.total_microbatches();
        Checker {
            schedule,
            layout: schedule.layout(),
            stages,
            n,
            lowered: schedule.lowered,
            flags: vec![0u8; stages as usize * n as usize],
            update_counts: vec![None; stages as usize],
        }
    }

    fn idx(&self, s: StageId, mb: Microbatch) -> usize {
        s as usize * self.n as usize + mb as usize
    }

    fn flag(&self, s: StageId, mb: Microbatch) -> u8 {
        self.flags[self.idx(s, mb)]
    }

    fn set(&mut self, s: StageId, mb: Microbatch, bit: u8) {
        let i = self.idx(s, mb);
        self.flags[i] |= bit;
    }

    /// Walks worker `w`'s program, then checks what it left unfinished.
    fn worker(&mut self, w: WorkerId) -> Result<()> {
        let schedule = self.schedule;
        let prog = &schedule.programs[w as usize];
        let (position, _) = self.layout.placement(w);
        let mut upd = vec![UpdateState::default(); self.layout.chunks() as usize];
        for (pc, &a) in prog.iter().enumerate() {
            self.action(w, position, a, &mut upd)
                .map_err(|reason| invalid(schedule, w, pc, reason))?;
        }
        for (st, stage) in upd.iter().zip(self.layout.stages_of(w)) {
            self.worker_end(stage, st)
                .map_err(|reason| invalid(schedule, w, prog.len(), reason))?;
        }
        Ok(())
    }

    /// Checks one action's placement, then the rule of its kind.
    fn action(&mut self, w: WorkerId, position: u32, a: Action, upd: &mut [UpdateState]) -> Rule {
        let stages = self.stages;
        let stage = a.stage();
        if stage >= stages {
            return Err(format!("stage {stage} does not exist ({stages} stages)"));
        }
        if self.layout.position_of(stage) != position {
            return Err(format!("stage {stage} is not placed on worker {w}"));
        }
        if let Some(mb) = a.microbatch() {
            if mb >= self.n {
                return Err(format!(
                    "microbatch {mb} is beyond the run ({} microbatches)",
                    self.n
                ));
            }
            if self.layout.worker_for(stage, mb) != w {
                return Err(format!(
                    "microbatch {mb} of stage {stage} belongs to worker {} (round-robin)",
                    self.layout.worker_for(stage, mb)
                ));
            }
        }
        if a.is_communication() && !self.lowered {
            return Err("send or receive in a schedule that is not lowered".into());
        }
        let st = &mut upd[self.layout.chunk_of(stage) as usize];
        match a {
            Action::Forward { stage, mb } => self.forward(w, stage, mb),
            Action::Backward { stage, mb } => self.backward(w, stage, mb, Some(st)),
            Action::BackwardInput { stage, mb } => self.backward(w, stage, mb, None),
            Action::BackwardWeight { stage, mb } => self.weight(stage, mb, st),
            Action::SendActivation { stage, mb, to } => self.send_activation(w, stage, mb, to),
            Action::RecvActivation { stage, mb, from } => self.recv_activation(w, stage, mb, from),
            Action::SendGradient { stage, mb, to } => self.send_gradient(w, stage, mb, to),
            Action::RecvGradient { stage, mb, from } => self.recv_gradient(w, stage, mb, from),
            Action::AllReduce { stage, update } => self.all_reduce(stage, update, st),
            Action::SendChunk {
                stage,
                update,
                step,
                to,
            } => self.ring_step(w, stage, update, step, to, true, st),
            Action::RecvChunk {
                stage,
                update,
                step,
                from,
            } => self.ring_step(w, stage, update, step, from, false, st),
            Action::Update { stage, update } => self.update(stage, update, st),
        }
    }

    fn forward(&mut self, w: WorkerId, stage: StageId, mb: Microbatch) -> Rule {
        let f = self.flag(stage, mb);
        if f & FWD != 0 {
            return Err(format!("microbatch {mb} forwarded twice"));
        }
        if stage > 0 {
            let local = self.layout.worker_for(stage - 1, mb) == w;
            let have = if local {
                self.flag(stage - 1, mb) & FWD != 0
            } else {
                !self.lowered || f & ACT_RECV != 0
            };
            if !have {
                return Err(format!("input of microbatch {mb} not available yet"));
            }
        }
        self.set(stage, mb, FWD);
        Ok(())
    }

    /// A fused backward (`fused` holds the stage's update state) or its input half.
    fn backward(
        &mut self,
        w: WorkerId,
        stage: StageId,
        mb: Microbatch,
        fused: Option<&mut UpdateState>,
    ) -> Rule {
        let f = self.flag(stage, mb);
        if f & FWD == 0 {
            return Err(format!("backward of microbatch {mb} before its forward"));
        }
        if f & BIN != 0 {
            return Err(format!("microbatch {mb} backwarded twice"));
        }
        if stage < self.stages - 1 {
            let local = self.layout.worker_for(stage + 1, mb) == w;
            let have = if local {
                self.flag(stage + 1, mb) & BIN != 0
            } else {
                !self.lowered || f & GRAD_RECV != 0
            };
            if !have {
                return Err(format!(
                    "output gradient of microbatch {mb} not available yet"
                ));
            }
        }
        self.set(stage, mb, BIN);
        if let Some(st) = fused {
            self.set(stage, mb, BWT);
            st.pending.push(mb);
        }
        Ok(())
    }

    fn weight(&mut self, stage: StageId, mb: Microbatch, st: &mut UpdateState) -> Rule {
        let f = self.flag(stage, mb);
        if f & BIN == 0 {
            return Err(format!(
                "weight gradient of microbatch {mb} before its input gradient"
            ));
        }
        if f & BWT != 0 {
            return Err(format!("weight gradient of microbatch {mb} computed twice"));
        }
        self.set(stage, mb, BWT);
        st.pending.push(mb);
        Ok(())
    }

    /// The peer of a transfer must own the neighbouring stage of the microbatch, on another
    /// worker.
    fn peer(&self, w: WorkerId, neighbour: StageId, mb: Microbatch, peer: WorkerId) -> Rule {
        let owner = self.layout.worker_for(neighbour, mb);
        if peer != owner || owner == w {
            return Err(format!(
                "stage {neighbour} of microbatch {mb} is on worker {owner}"
            ));
        }
        Ok(())
    }

    fn send_activation(&mut self, w: WorkerId, stage: StageId, mb: Microbatch, to: u32) -> Rule {
        if stage == self.stages - 1 {
            return Err("the last stage has no activation to send".into());
        }
        let f = self.flag(stage, mb);
        if f & FWD == 0 {
            return Err(format!("sends microbatch {mb}'s output before its forward"));
        }
        if f & ACT_SENT != 0 {
            return Err("activation sent twice".into());
        }
        self.peer(w, stage + 1, mb, to)?;
        self.set(stage, mb, ACT_SENT);
        Ok(())
    }

    fn recv_activation(&mut self, w: WorkerId, stage: StageId, mb: Microbatch, from: u32) -> Rule {
        if stage == 0 {
            return Err("the first stage receives no activation".into());
        }
        self.peer(w, stage - 1, mb, from)?;
        if self.flag(stage, mb) & ACT_RECV != 0 {
            return Err("activation received twice".into());
        }
        self.set(stage, mb, ACT_RECV);
        Ok(())
    }

    fn send_gradient(&mut self, w: WorkerId, stage: StageId, mb: Microbatch, to: u32) -> Rule {
        if stage == 0 {
            return Err("the first stage has no input gradient to send".into());
        }
        let f = self.flag(stage, mb);
        if f & BIN == 0 {
            return Err(format!(
                "sends microbatch {mb}'s gradient before its backward"
            ));
        }
        if f & GRAD_SENT != 0 {
            return Err("gradient sent twice".into());
        }
        self.peer(w, stage - 1, mb, to)?;
        self.set(stage, mb, GRAD_SENT);
        Ok(())
    }

    fn recv_gradient(&mut self, w: WorkerId, stage: StageId, mb: Microbatch, from: u32) -> Rule {
        if stage == self.stages - 1 {
            return Err("the last stage receives no gradient".into());
        }
        self.peer(w, stage + 1, mb, from)?;
        if self.flag(stage, mb) & GRAD_RECV != 0 {
            return Err("gradient received twice".into());
        }
        self.set(stage, mb, GRAD_RECV);
        Ok(())
    }

    fn all_reduce(&self, stage: StageId, update: u32, st: &mut UpdateState) -> Rule {
        if self.layout.replicas_of(stage) < 2 {
            return Err(format!(
                "all-reduce on stage {stage}, which has one replica"
            ));
        }
        if update != st.next || st.reduced || st.ring != 0 {
            return Err(format!(
                "all-reduce {update} out of order (next update is {})",
                st.next
            ));
        }
        st.reduced = true;
        Ok(())
    }

    /// One send (`is_send`) or receive of an expanded ring all-reduce.
    #[allow(clippy::too_many_arguments)]
    fn ring_step(
        &self,
        w: WorkerId,
        stage: StageId,
        update: u32,
        step: u32,
        with: u32,
        is_send: bool,
        st: &mut UpdateState,
    ) -> Rule {
        let group = self.layout.group(stage);
        let r = group.end - group.start;
        let j = w - group.start;
        let peer = if is_send {
            group.start + (j + 1) % r
        } else {
            group.start + (j + r - 1) % r
        };
        let expect = 2 * step + u32::from(!is_send);
        if r < 2 || update != st.next || st.reduced || st.ring != expect || with != peer {
            return Err(format!(
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
        Ok(())
    }

    fn update(&self, stage: StageId, update: u32, st: &mut UpdateState) -> Rule {
        if update != st.next {
            return Err(format!(
                "update {update} out of order (expected {})",
                st.next
            ));
        }
        if self.layout.replicas_of(stage) > 1 && !st.reduced {
            return Err("update of a replicated stage without an all-reduce".into());
        }
        if st.ring != 0 {
            return Err("update in the middle of a ring all-reduce".into());
        }
        st.next += 1;
        st.reduced = false;
        st.pending.clear();
        Ok(())
    }

    /// At the end of a worker's program: every gradient applied, no all-reduce left hanging,
    /// and the same number of updates as the stage's other replicas.
    fn worker_end(&mut self, stage: StageId, st: &UpdateState) -> Rule {
        if let Some(&mb) = st.pending.first() {
            return Err(format!(
                "gradient of microbatch {mb} at stage {stage} is never applied by an update"
            ));
        }
        if st.reduced || st.ring != 0 {
            return Err(format!("all-reduce at stage {stage} without an update"));
        }
        match self.update_counts[stage as usize] {
            None => self.update_counts[stage as usize] = Some(st.next),
            Some(k) if k != st.next => {
                return Err(format!(
                    "replicas of stage {stage} make different numbers of updates ({k} and {})",
                    st.next
                ));
            }
            Some(_) => {}
        }
        Ok(())
    }

    /// Everything done exactly once, and every transfer paired.
    fn everything_done(&self) -> Result<()> {
        let (stages, layout) = (self.stages, self.layout);
        for s in 0..stages {
            for mb in 0..self.n {
                let f = self.flag(s, mb);
                let w = layout.worker_for(s, mb);
                let end = self.schedule.programs[w as usize].len();
                let miss = |what: &str| {
                    Err(invalid(
                        self.schedule,
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
                if s < stages - 1 && layout.worker_for(s + 1, mb) != w && self.lowered {
                    let g = self.flag(s + 1, mb);
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
