//! Version plans: which weight version every forward and backward uses, which microbatches each
//! update sums, and how many versions and activations each worker must hold.
//!
//! The plan is derived from the order of actions, never written per policy: a worker's current
//! version of a stage is the number of `Update`s it has run for that stage, and the policy's
//! [`VersionRule`] says how an action picks its version from that order:
//!
//! - `Stash`: forward uses the current version; the backward uses the one its forward used.
//! - `Latest`: forward and backward each use the current version when they run.
//! - `VerticalSync`: the forward at the input stage tags the microbatch with the number of
//!   microbatches whose gradients are in the input stage's weights (`version * update size`);
//!   every stage uses its newest version holding no other gradients: `tag / update size`.
//! - `DelayedByOne`: a microbatch of the stage's minibatch `t` uses version `t - 1` (0 for
//!   `t = 0`), both ways.
//!
//! Only the input-gradient half of a backward reads weights; the weight-gradient half (`W`)
//! needs activations and output gradients only, so it has no version of its own. Deriving the
//! plan also checks that no action uses a version before that version exists.

use crate::action::{Action, Microbatch, StageId, WorkerId};
use crate::error::{Result, ScheduleError};
use crate::spec::{Schedule, VersionRule};
use crate::validate::invalid;

/// Sentinel for "not recorded" in the per-(stage, microbatch) tables.
const UNSET: u32 = u32::MAX;

/// The gradients one update of one stage sums.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct UpdateSums {
    /// Per replica (in replica order), the microbatches whose gradients it accumulated, in the
    /// order it accumulated them. The all-reduce then sums the replicas' partial sums.
    pub per_replica: Vec<Vec<Microbatch>>,
}

impl UpdateSums {
    /// Every microbatch of the update, replica by replica.
    pub fn microbatches(&self) -> impl Iterator<Item = Microbatch> + '_ {
        self.per_replica.iter().flatten().copied()
    }
}

/// The version plan of a schedule (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionPlan {
    stages: u32,
    microbatches: u32,
    forward: Vec<u32>,
    backward: Vec<u32>,
    /// `updates[s][k]`: what update `k` of stage `s` sums.
    pub updates: Vec<Vec<UpdateSums>>,
    /// Per worker: the most weight versions (over all its stages) held at once.
    pub peak_versions: Vec<u32>,
    /// Per worker: the most microbatches whose activations are held at once (forward done,
    /// backward, or its weight half, not yet).
    pub peak_activations: Vec<u32>,
}

/// Peak memory of one worker, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct MemoryPeak {
    /// Most bytes of stashed activations held at once.
    pub activations: f64,
    /// Most bytes of weight versions held at once (the current version included).
    pub weights: f64,
    /// Most bytes of both held at once.
    pub total: f64,
}

impl VersionPlan {
    /// Derives the plan from a schedule's action order.
    ///
    /// # Errors
    /// [`ScheduleError::Invalid`] when an action would use a version that does not exist yet,
    /// or a microbatch lacks a forward or backward at some stage (run [`crate::validate`] first
    /// for the full structural check).
    pub fn derive(schedule: &Schedule) -> Result<Self> {
        let layout = schedule.layout();
        let stages = schedule.stages();
        let n = schedule.total_microbatches();
        let rule = schedule.resolved.policy.version_rule();
        let cells = stages as usize * n as usize;
        let mut forward = vec![UNSET; cells];
        let mut backward = vec![UNSET; cells];
        let mut updates: Vec<Vec<UpdateSums>> = (0..stages)
            .map(|s| {
                let k = schedule.resolved.updates_at(s) as usize;
                let r = layout.replicas_of(s) as usize;
                vec![
                    UpdateSums {
                        per_replica: vec![Vec::new(); r]
                    };
                    k
                ]
            })
            .collect();
        let idx = |s: StageId, mb: Microbatch| s as usize * n as usize + mb as usize;
        let size0 = u64::from(schedule.resolved.update_size(0));

        // Vertical sync reads the input stage's forward versions, so walk input-stage workers
        // first.
        let mut order: Vec<WorkerId> = (0..schedule.workers()).collect();
        order.sort_by_key(|&w| !layout.stages_of(w).any(|s| s == 0));

        let mut peak_versions = vec![0; schedule.workers() as usize];
        let mut peak_activations = vec![0; schedule.workers() as usize];
        for &w in &order {
            let prog = &schedule.programs[w as usize];
            let (_, replica) = layout.placement(w);
            let chunks = layout.chunks() as usize;
            let positions = layout.positions();
            let mut current = vec![0u32; chunks];
            let mut pending: Vec<Vec<Microbatch>> = vec![Vec::new(); chunks];
            for (pc, &a) in prog.iter().enumerate() {
                let fail = |reason: String| invalid(schedule, w, pc, reason);
                let stage = a.stage();
                if stage >= stages {
                    return Err(fail(format!("stage {stage} does not exist")));
                }
                let c = (stage / positions) as usize;
                if c >= chunks {
                    return Err(fail(format!("stage {stage} is not held by this worker")));
                }
                if let Some(mb) = a.microbatch() {
                    if mb >= n {
                        return Err(fail(format!("microbatch {mb} is beyond the run ({n})")));
                    }
                }
                match a {
                    Action::Forward { stage, mb } => {
                        let v = match rule {
                            VersionRule::Stash | VersionRule::Latest => current[c],
                            VersionRule::DelayedByOne => {
                                schedule.resolved.update_of(stage, mb).saturating_sub(1)
                            }
                            VersionRule::VerticalSync => {
                                if stage == 0 {
                                    current[c]
                                } else {
                                    let v0 = forward[idx(0, mb)];
                                    if v0 == UNSET {
                                        return Err(fail(format!(
                                            "microbatch {mb} reaches stage {stage} without a \
                                             forward at stage 0"
                                        )));
                                    }
                                    let tag = u64::from(v0) * size0;
                                    (tag / u64::from(schedule.resolved.update_size(stage))) as u32
                                }
                            }
                        };
                        if v > current[c] {
                            return Err(fail(format!(
                                "forward needs version {v} of stage {stage}, which does not \
                                 exist yet (current {})",
                                current[c]
                            )));
                        }
                        forward[idx(stage, mb)] = v;
                    }
                    Action::Backward { stage, mb } | Action::BackwardInput { stage, mb } => {
                        let f = forward[idx(stage, mb)];
                        if f == UNSET {
                            return Err(fail(format!(
                                "backward of microbatch {mb} before its forward"
                            )));
                        }
                        let v = match rule {
                            VersionRule::Latest => current[c],
                            _ => f,
                        };
                        backward[idx(stage, mb)] = v;
                        if matches!(a, Action::Backward { .. }) {
                            pending[c].push(mb);
                        }
                    }
                    Action::BackwardWeight { mb, .. } => pending[c].push(mb),
                    Action::Update { stage, update } => {
                        let slot = updates[stage as usize]
                            .get_mut(update as usize)
                            .ok_or_else(|| fail(format!("update {update} is beyond the run")))?;
                        let dst = slot
                            .per_replica
                            .get_mut(replica as usize)
                            .ok_or_else(|| fail("replica outside the stage's group".into()))?;
                        *dst = std::mem::take(&mut pending[c]);
                        current[c] += 1;
                    }
                    _ => {}
                }
            }
        }
        if let Some(cell) = forward.iter().position(|&v| v == UNSET) {
            return Err(missing(schedule, cell, n, "forward"));
        }
        if let Some(cell) = backward.iter().position(|&v| v == UNSET) {
            return Err(missing(schedule, cell, n, "backward"));
        }
        let mut plan = VersionPlan {
            stages,
            microbatches: n,
            forward,
            backward,
            updates,
            peak_versions: Vec::new(),
            peak_activations: Vec::new(),
        };
        for w in 0..schedule.workers() {
            let p = plan.sweep(schedule, w, |_| 1.0, |_| 1.0);
            peak_versions[w as usize] = p.weights as u32;
            peak_activations[w as usize] = p.activations as u32;
        }
        plan.peak_versions = peak_versions;
        plan.peak_activations = peak_activations;
        Ok(plan)
    }

    /// Number of stages.
    pub fn stages(&self) -> u32 {
        self.stages
    }

    /// Number of microbatches.
    pub fn microbatches(&self) -> u32 {
        self.microbatches
    }

    /// The weight version the forward of `mb` at `stage` uses.
    pub fn forward_version(&self, stage: StageId, mb: Microbatch) -> u32 {
        self.forward[stage as usize * self.microbatches as usize + mb as usize]
    }

    /// The weight version the backward (its input-gradient half) of `mb` at `stage` uses.
    pub fn backward_version(&self, stage: StageId, mb: Microbatch) -> u32 {
        self.backward[stage as usize * self.microbatches as usize + mb as usize]
    }

    /// Peak memory per worker in bytes, given bytes per weight version and bytes of stashed
    /// activations per in-flight microbatch, both per stage.
    pub fn peak_memory(
        &self,
        schedule: &Schedule,
        param_bytes: impl Fn(StageId) -> f64 + Copy,
        stash_bytes: impl Fn(StageId) -> f64 + Copy,
    ) -> Vec<MemoryPeak> {
        (0..schedule.workers())
            .map(|w| self.sweep(schedule, w, param_bytes, stash_bytes))
            .collect()
    }

    /// Walks one worker's program and returns the peaks of weighted live versions and live
    /// activations. A version is live from the update that creates it until the later of the
    /// update that replaces it and its last use; an activation from its forward until the
    /// backward (or weight half) that consumes it.
    fn sweep(
        &self,
        schedule: &Schedule,
        w: WorkerId,
        param_bytes: impl Fn(StageId) -> f64,
        stash_bytes: impl Fn(StageId) -> f64,
    ) -> MemoryPeak {
        let prog = &schedule.programs[w as usize];
        let layout = schedule.layout();
        let len = prog.len();
        let mut act = vec![0.0f64; len + 1];
        let mut wts = vec![0.0f64; len + 1];
        for stage in layout.stages_of(w) {
            let c_stage = stage;
            // Position of each update of this stage, and last use of each version.
            let mut update_pc: Vec<usize> = Vec::new();
            let mut last_use: Vec<usize> = Vec::new();
            let note = |v: u32, pc: usize, last_use: &mut Vec<usize>| {
                let v = v as usize;
                if last_use.len() <= v {
                    last_use.resize(v + 1, 0);
                }
                last_use[v] = last_use[v].max(pc);
            };
            let split = prog
                .iter()
                .any(|a| matches!(a, Action::BackwardWeight { stage, .. } if *stage == c_stage));
            for (pc, a) in prog.iter().enumerate() {
                if a.stage() != c_stage {
                    continue;
                }
                match *a {
                    Action::Forward { mb, .. } => {
                        note(self.forward_version(stage, mb), pc, &mut last_use);
                        act[pc] += stash_bytes(stage);
                    }
                    Action::Backward { mb, .. } | Action::BackwardInput { mb, .. } => {
                        note(self.backward_version(stage, mb), pc, &mut last_use);
                        if !split || matches!(a, Action::Backward { .. }) {
                            act[pc + 1] -= stash_bytes(stage);
                        }
                    }
                    Action::BackwardWeight { .. } => act[pc + 1] -= stash_bytes(stage),
                    Action::Update { .. } => update_pc.push(pc),
                    _ => {}
                }
            }
            let bytes = param_bytes(stage);
            for v in 0..=update_pc.len() {
                let start = if v == 0 { 0 } else { update_pc[v - 1] };
                let replaced = update_pc.get(v).copied().unwrap_or(len);
                let end = replaced.max(last_use.get(v).map_or(0, |&u| u + 1));
                wts[start] += bytes;
                wts[end.min(len)] -= bytes;
            }
        }
        let (mut a, mut ws) = (0.0f64, 0.0f64);
        let mut peak = MemoryPeak::default();
        for pc in 0..len.max(1) {
            a += act[pc];
            ws += wts[pc];
            peak.activations = peak.activations.max(a);
            peak.weights = peak.weights.max(ws);
            peak.total = peak.total.max(a + ws);
        }
        peak
    }
}

fn missing(schedule: &Schedule, cell: usize, n: u32, what: &str) -> ScheduleError {
    let stage = (cell / n as usize) as u32;
    let mb = (cell % n as usize) as u32;
    let w = schedule.layout().worker_for(stage, mb);
    let end = schedule.programs[w as usize].len();
    invalid(
        schedule,
        w,
        end,
        format!("microbatch {mb} never has a {what} at stage {stage}"),
    )
}
