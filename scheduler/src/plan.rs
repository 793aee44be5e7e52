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
use crate::generate::WorkerProgram;
use crate::grid::invalid;
use crate::spec::{Layout, Resolved, Schedule, VersionQuery};

/// Sentinel for "not recorded" in the per-(stage, microbatch) tables.
const UNSET: u32 = u32::MAX;

/// The gradients one update of one stage sums (a view into the plan).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct UpdateSums<'a> {
    /// Per replica (in replica order), the microbatches whose gradients it accumulated, in the
    /// order it accumulated them. The all-reduce then sums the replicas' partial sums.
    pub per_replica: Vec<&'a [Microbatch]>,
}

impl UpdateSums<'_> {
    /// Every microbatch of the update, replica by replica.
    pub fn microbatches(&self) -> impl Iterator<Item = Microbatch> + '_ {
        self.per_replica.iter().flat_map(|p| p.iter().copied())
    }
}

/// The weight-gradient contributions of one (worker, stage), in order, cut into updates.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
struct Contributions {
    mbs: Vec<Microbatch>,
    /// `ends[k]`: index in `mbs` where update `k`'s contributions end.
    ends: Vec<u32>,
}

/// The version plan of a schedule (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionPlan {
    stages: u32,
    microbatches: u32,
    forward: Vec<u32>,
    backward: Vec<u32>,
    /// Indexed by `worker * chunks + chunk`.
    contributions: Vec<Contributions>,
    /// Where the stages live (maps a stage to its position and chunk).
    layout: Layout,
    replicas: Vec<u32>,
    worker_offsets: Vec<u32>,
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
        Ok(Self::derive_with_memory(schedule, |_| 0.0, |_| 0.0)?.0)
    }

    /// [`VersionPlan::derive`], also returning each worker's peak memory in bytes given bytes
    /// per weight version and per stashed microbatch of each stage (one walk of the programs
    /// instead of two).
    ///
    /// # Errors
    /// As [`VersionPlan::derive`].
    pub fn derive_with_memory(
        schedule: &Schedule,
        param_bytes: impl Fn(StageId) -> f64 + Copy,
        stash_bytes: impl Fn(StageId) -> f64 + Copy,
    ) -> Result<(Self, Vec<MemoryPeak>)> {
        let layout = schedule.layout();
        let stages = schedule.stages();
        let n = schedule.total_microbatches();
        let mut tables = Tables::new(stages, n);
        let chunks = layout.chunks() as usize;
        let mut contributions =
            vec![Contributions::default(); schedule.workers() as usize * chunks];
        let positions = layout.positions();
        for w in walk_order(layout) {
            let prog = &schedule.programs[w as usize];
            let contrib = &mut contributions[w as usize * chunks..(w as usize + 1) * chunks];
            walk_worker(&schedule.resolved, prog, &mut tables, Some(contrib))
                .map_err(|(pc, reason)| invalid(schedule, w, pc, reason))?;
        }
        let Tables {
            forward, backward, ..
        } = tables;
        if let Some(cell) = forward.iter().position(|&v| v == UNSET) {
            return Err(missing(schedule, cell, n, "forward"));
        }
        if let Some(cell) = backward.iter().position(|&v| v == UNSET) {
            return Err(missing(schedule, cell, n, "backward"));
        }
        let mut worker_offsets: Vec<u32> = (0..positions).map(|p| layout.worker(p, 0)).collect();
        worker_offsets.push(schedule.workers());
        let mut plan = VersionPlan {
            stages,
            microbatches: n,
            forward,
            backward,
            contributions,
            layout: layout.clone(),
            replicas: layout.replica_counts().to_vec(),
            worker_offsets,
            peak_versions: Vec::new(),
            peak_activations: Vec::new(),
        };
        let mut scratch = Vec::new();
        let peaks: Vec<WorkerPeaks> = (0..schedule.workers())
            .map(|w| {
                sweep(
                    layout,
                    w,
                    &schedule.programs[w as usize],
                    |s, mb| plan.forward_version(s, mb),
                    |s, mb| plan.backward_version(s, mb),
                    (param_bytes, stash_bytes),
                    &mut scratch,
                )
            })
            .collect();
        plan.peak_versions = peaks.iter().map(|p| p.versions).collect();
        plan.peak_activations = peaks.iter().map(|p| p.activations).collect();
        let memory = peaks.iter().map(|p| p.memory).collect();
        Ok((plan, memory))
    }

    /// Number of updates `stage` makes.
    pub fn updates_at(&self, stage: StageId) -> u32 {
        let w = self.worker_offsets[self.layout.position_of(stage) as usize];
        let c = self.layout.chunk_of(stage);
        self.contributions[(w * self.layout.chunks() + c) as usize]
            .ends
            .len() as u32
    }

    /// What update `k` of `stage` sums.
    ///
    /// # Panics
    /// If `stage` or `k` is out of range.
    pub fn update(&self, stage: StageId, k: u32) -> UpdateSums<'_> {
        let p = self.layout.position_of(stage) as usize;
        let c = self.layout.chunk_of(stage);
        let per_replica = (0..self.replicas[p])
            .map(|j| {
                let w = self.worker_offsets[p] + j;
                let con = &self.contributions[(w * self.layout.chunks() + c) as usize];
                let start = if k == 0 {
                    0
                } else {
                    con.ends[k as usize - 1] as usize
                };
                &con.mbs[start..con.ends[k as usize] as usize]
            })
            .collect();
        UpdateSums { per_replica }
    }

    /// The weight versions the gradients of update `k` of `stage` were computed at (the
    /// backward version of each microbatch it sums, over every replica), ascending, each with
    /// how many of those microbatches used it: the stale weights a delay compensation measures
    /// the update's distance from.
    ///
    /// # Panics
    /// If `stage` or `k` is out of range.
    pub fn gradient_versions(&self, stage: StageId, k: u32) -> Vec<(u32, u32)> {
        let mut counts = std::collections::BTreeMap::new();
        for mb in self.update(stage, k).microbatches() {
            *counts
                .entry(self.backward_version(stage, mb))
                .or_insert(0u32) += 1;
        }
        counts.into_iter().collect()
    }

    /// [`VersionPlan::last_uses`] when every update also reads the versions its gradients were
    /// computed at ([`VersionPlan::gradient_versions`]), as a delay compensation does: those
    /// versions are held until the update, not freed after their last pass.
    pub fn last_uses_through_updates(
        &self,
        schedule: &Schedule,
        worker: WorkerId,
    ) -> Vec<Vec<usize>> {
        let layout = schedule.layout();
        let mut last = self.last_uses(schedule, worker);
        for (pc, a) in schedule.programs[worker as usize].iter().enumerate() {
            if let Action::Update { stage, update } = *a
                && let Some(uses) = last.get_mut(layout.chunk_of(stage) as usize)
            {
                for (v, _) in self.gradient_versions(stage, update) {
                    note_use(uses, v, pc);
                }
            }
        }
        last
    }

    /// The versions below `below` that `worker`'s program (a worker of one stage) reads from
    /// program counter `from` on, counting each update's gradient versions as
    /// [`VersionPlan::last_uses_through_updates`] does: the older versions a program resumed
    /// at `from` must be handed, read off its remaining actions alone (a recovery asks this
    /// of every worker while the survivors wait, so it walks no more than it must).
    pub fn read_from(
        &self,
        schedule: &Schedule,
        worker: WorkerId,
        from: usize,
        below: u32,
    ) -> std::collections::BTreeSet<u32> {
        // Versions are dense and few: one flag each.
        let mut read = vec![false; below as usize];
        let mut mark = |v: u32| {
            if let Some(flag) = read.get_mut(v as usize) {
                *flag = true;
            }
        };
        let program = &schedule.programs[worker as usize];
        for a in program.iter().skip(from) {
            if let Action::Update { stage, update } = *a {
                for mb in self.update(stage, update).microbatches() {
                    mark(self.backward_version(stage, mb));
                }
            } else if let Some(v) = self.version_read_by(*a) {
                mark(v);
            }
        }
        (0..below).filter(|&v| read[v as usize]).collect()
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

    /// The weight version pass `a` reads: its forward version for a forward, its backward
    /// version for a backward or either half of one (the executor hands the weight half the
    /// version's parameters); none for an action that reads no weights.
    pub fn version_read_by(&self, a: Action) -> Option<u32> {
        match a {
            Action::Forward { stage, mb } => Some(self.forward_version(stage, mb)),
            Action::Backward { stage, mb }
            | Action::BackwardInput { stage, mb }
            | Action::BackwardWeight { stage, mb } => Some(self.backward_version(stage, mb)),
            _ => None,
        }
    }

    /// The last use of every weight version on `worker`: per chunk (in
    /// [`Layout::stages_of`](crate::Layout::stages_of) order), indexed by version, the program
    /// counter of the last action that reads that version (0 when none does). Forwards read
    /// their forward version; backwards, their input halves and their weight halves read the
    /// backward version (the executor hands the weight half the version's parameters). The
    /// executor frees a stashed version after its last use.
    pub fn last_uses(&self, schedule: &Schedule, worker: WorkerId) -> Vec<Vec<usize>> {
        let layout = schedule.layout();
        let mut last: Vec<Vec<usize>> = vec![Vec::new(); layout.chunks() as usize];
        for (pc, a) in schedule.programs[worker as usize].iter().enumerate() {
            let Some(v) = self.version_read_by(*a) else {
                continue;
            };
            if let Some(uses) = last.get_mut(layout.chunk_of(a.stage()) as usize) {
                note_use(uses, v, pc);
            }
        }
        last
    }
}

/// Walks one worker's program and returns the peaks of weighted live versions and live
/// activations (counts, then bytes given bytes per weight version and per stashed microbatch of
/// each stage). A version is live from the update that creates it until the later of the update
/// that replaces it and its last use; an activation from its forward until the backward (or
/// weight half) that consumes it.
fn sweep(
    layout: &Layout,
    w: WorkerId,
    prog: &[Action],
    forward_version: impl Fn(StageId, Microbatch) -> u32,
    backward_version: impl Fn(StageId, Microbatch) -> u32,
    (param_bytes, stash_bytes): (impl Fn(StageId) -> f64, impl Fn(StageId) -> f64),
    scratch: &mut Vec<Diff>,
) -> WorkerPeaks {
    let len = prog.len();
    let chunks = layout.chunks() as usize;
    // Difference arrays (reused across workers): counts and bytes of live activations and
    // versions.
    scratch.clear();
    scratch.resize(len + 1, Diff::default());
    let diff = scratch;
    let stash: Vec<f64> = layout.stages_of(w).map(&stash_bytes).collect();
    // Per chunk: position of each update, and last use of each version.
    let mut update_pc: Vec<Vec<usize>> = vec![Vec::new(); chunks];
    let mut last_use: Vec<Vec<usize>> = vec![Vec::new(); chunks];
    for (pc, a) in prog.iter().enumerate() {
        let stage = a.stage();
        let c = layout.chunk_of(stage) as usize;
        match *a {
            Action::Forward { mb, .. } => {
                note_use(&mut last_use[c], forward_version(stage, mb), pc);
                diff[pc].act_n += 1;
                diff[pc].act_b += stash[c];
            }
            Action::Backward { mb, .. } | Action::BackwardInput { mb, .. } => {
                note_use(&mut last_use[c], backward_version(stage, mb), pc);
                if matches!(a, Action::Backward { .. }) {
                    diff[pc + 1].act_n -= 1;
                    diff[pc + 1].act_b -= stash[c];
                }
            }
            // The weight half is the last reader of the stashed activations.
            Action::BackwardWeight { .. } => {
                diff[pc + 1].act_n -= 1;
                diff[pc + 1].act_b -= stash[c];
            }
            Action::Update { .. } => update_pc[c].push(pc),
            _ => {}
        }
    }
    for (c, stage) in layout.stages_of(w).enumerate() {
        let bytes = param_bytes(stage);
        let ups = &update_pc[c];
        for v in 0..=ups.len() {
            let start = if v == 0 { 0 } else { ups[v - 1] };
            let replaced = ups.get(v).copied().unwrap_or(len);
            let end = replaced
                .max(last_use[c].get(v).map_or(0, |&u| u + 1))
                .min(len);
            diff[start].wts_n += 1;
            diff[start].wts_b += bytes;
            diff[end].wts_n -= 1;
            diff[end].wts_b -= bytes;
        }
    }
    let (mut an, mut ab, mut wn, mut wb) = (0i32, 0.0f64, 0i32, 0.0f64);
    let mut peaks = WorkerPeaks::default();
    for d in &diff[..len.max(1)] {
        an += d.act_n;
        ab += d.act_b;
        wn += d.wts_n;
        wb += d.wts_b;
        peaks.activations = peaks.activations.max(an.max(0) as u32);
        peaks.versions = peaks.versions.max(wn.max(0) as u32);
        let m = &mut peaks.memory;
        m.activations = m.activations.max(ab);
        m.weights = m.weights.max(wb);
        m.total = m.total.max(ab + wb);
    }
    peaks
}

/// One worker's peaks: most weight versions and most microbatches' activations held at once,
/// and most bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct WorkerPeaks {
    /// Most weight versions held at once.
    pub(crate) versions: u32,
    /// Most microbatches' activations held at once.
    pub(crate) activations: u32,
    /// Most bytes.
    pub(crate) memory: MemoryPeak,
}

/// Forward and backward versions over (stage, microbatch), [`UNSET`] until recorded.
struct Tables {
    n: usize,
    forward: Vec<u32>,
    backward: Vec<u32>,
}

impl Tables {
    fn new(stages: u32, n: u32) -> Self {
        let cells = stages as usize * n as usize;
        Tables {
            n: n as usize,
            forward: vec![UNSET; cells],
            backward: vec![UNSET; cells],
        }
    }

    fn idx(&self, s: StageId, mb: Microbatch) -> usize {
        s as usize * self.n + mb as usize
    }
}

/// Workers in the order their programs must be walked: vertical sync reads the input stage's
/// forward versions, so input-stage workers come first.
fn walk_order(layout: &Layout) -> Vec<WorkerId> {
    let mut order: Vec<WorkerId> = (0..layout.workers()).collect();
    order.sort_by_key(|&w| !layout.stages_of(w).any(|s| s == 0));
    order
}

/// Walks one worker's program: records the version every forward and backward uses (the
/// policy's [`crate::VersionRule`] applied to the action order) and, when asked, the gradient
/// contributions of each update; checks that no action uses a version before it exists.
/// Returns the failing step and the reason.
fn walk_worker(
    resolved: &Resolved,
    prog: &[Action],
    tables: &mut Tables,
    mut contrib: Option<&mut [Contributions]>,
) -> std::result::Result<(), (usize, String)> {
    let layout = &resolved.layout;
    let stages = layout.stages();
    let n = resolved.total;
    let rule = resolved.policy.version_rule();
    let chunks = layout.chunks() as usize;
    let mut current = vec![0u32; chunks];
    for (pc, &a) in prog.iter().enumerate() {
        let fail = |reason: String| Err((pc, reason));
        let stage = a.stage();
        if stage >= stages {
            return fail(format!("stage {stage} does not exist"));
        }
        let c = layout.chunk_of(stage) as usize;
        if c >= chunks {
            return fail(format!("stage {stage} is not held by this worker"));
        }
        if let Some(mb) = a.microbatch() {
            if mb >= n {
                return fail(format!("microbatch {mb} is beyond the run ({n})"));
            }
        }
        match a {
            Action::Forward { stage, mb } => {
                let entry_tag = if stage == 0 || rule != crate::VersionRule::VerticalSync {
                    0
                } else {
                    let v0 = tables.forward[tables.idx(0, mb)];
                    if v0 == UNSET {
                        return fail(format!(
                            "microbatch {mb} reaches stage {stage} without a forward at stage 0"
                        ));
                    }
                    crate::VersionRule::entry_tag(v0, resolved.update_size(0))
                };
                // Only 2BW reads the update and only vertical sync the update size: skip their
                // divisions otherwise (this walk runs over every action of big schedules).
                let (update, update_size) = match rule {
                    crate::VersionRule::DelayedByOne => (resolved.update_of(stage, mb), 0),
                    crate::VersionRule::VerticalSync => (0, resolved.update_size(stage)),
                    _ => (0, 0),
                };
                let v = rule.forward_version(&VersionQuery {
                    stage,
                    current: current[c],
                    update,
                    entry_tag,
                    update_size,
                });
                if v > current[c] {
                    return fail(format!(
                        "forward needs version {v} of stage {stage}, which does not exist yet \
                         (current {})",
                        current[c]
                    ));
                }
                let i = tables.idx(stage, mb);
                tables.forward[i] = v;
            }
            Action::Backward { stage, mb } | Action::BackwardInput { stage, mb } => {
                let i = tables.idx(stage, mb);
                let f = tables.forward[i];
                if f == UNSET {
                    return fail(format!("backward of microbatch {mb} before its forward"));
                }
                tables.backward[i] = rule.backward_version(f, current[c]);
                if let (Action::Backward { .. }, Some(contrib)) = (a, contrib.as_deref_mut()) {
                    contrib[c].mbs.push(mb);
                }
            }
            Action::BackwardWeight { mb, .. } => {
                if let Some(contrib) = contrib.as_deref_mut() {
                    contrib[c].mbs.push(mb);
                }
            }
            Action::Update { update, .. } => {
                if update != current[c] {
                    return fail(format!(
                        "update {update} out of order (expected {})",
                        current[c]
                    ));
                }
                if let Some(contrib) = contrib.as_deref_mut() {
                    let end = contrib[c].mbs.len() as u32;
                    contrib[c].ends.push(end);
                }
                current[c] += 1;
            }
            _ => {}
        }
    }
    Ok(())
}

/// Peak weight versions, peak activations (counts) and peak memory (bytes) of every worker of
/// the schedule `resolved` asks for, generated one worker at a time: what
/// [`VersionPlan::derive_with_memory`] reports, without holding the whole schedule. The
/// programs come from the generators, which produce only valid schedules (the property tests
/// check every policy), so the structural checks of [`crate::validate`] are not repeated.
///
/// # Errors
/// [`ScheduleError::Invalid`] when a program uses a version before it exists.
pub(crate) fn streamed_peaks(
    resolved: &Resolved,
    param_bytes: impl Fn(StageId) -> f64 + Copy,
    stash_bytes: impl Fn(StageId) -> f64 + Copy,
) -> Result<Vec<WorkerPeaks>> {
    let layout = &resolved.layout;
    // Flush policies are synchronous: every stage runs microbatch `mb` on version
    // `mb / minibatch` (the property tests check this of every generated flush schedule), so
    // their peaks need no version tables (two words per stage and microbatch: 82 MB for 1,024
    // stages and 10,000 microbatches).
    let synchronous = resolved.policy.is_flush();
    let mut tables = if synchronous {
        Tables::new(0, 0)
    } else {
        Tables::new(layout.stages(), resolved.total)
    };
    let mut peaks = vec![WorkerPeaks::default(); layout.workers() as usize];
    let (mut prog, mut scratch) = (Vec::new(), Vec::new());
    let mut streams: Vec<Option<WorkerProgram>> =
        WorkerProgram::all(resolved).into_iter().map(Some).collect();
    for w in walk_order(layout) {
        prog.clear();
        let Some(mut stream) = streams[w as usize].take() else {
            continue;
        };
        prog.extend(stream.by_ref());
        stream.check()?;
        if synchronous {
            let minibatch = resolved.minibatch.max(1);
            peaks[w as usize] = sweep(
                layout,
                w,
                &prog,
                |_, mb| mb / minibatch,
                |_, mb| mb / minibatch,
                (param_bytes, stash_bytes),
                &mut scratch,
            );
            continue;
        }
        walk_worker(resolved, &prog, &mut tables, None).map_err(|(pc, reason)| {
            ScheduleError::Invalid {
                worker: w,
                step: pc,
                action: prog.get(pc).map_or_else(|| "end".into(), |a| a.to_string()),
                reason,
                grid: String::new(),
            }
        })?;
        peaks[w as usize] = sweep(
            layout,
            w,
            &prog,
            |s, mb| tables.forward[tables.idx(s, mb)],
            |s, mb| tables.backward[tables.idx(s, mb)],
            (param_bytes, stash_bytes),
            &mut scratch,
        );
    }
    Ok(peaks)
}

/// Records that version `v` is used at `pc` (uses come in program order).
fn note_use(uses: &mut Vec<usize>, v: u32, pc: usize) {
    let v = v as usize;
    if uses.len() <= v {
        uses.resize(v + 1, 0);
    }
    uses[v] = uses[v].max(pc);
}

/// One entry of the memory sweep's difference array.
#[derive(Clone, Copy, Default)]
struct Diff {
    act_n: i32,
    wts_n: i32,
    act_b: f64,
    wts_b: f64,
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
