//! The executor: runs exactly one worker's program.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::time::Instant;

use pipe_kernels::{Backend, Tensor};
use pipe_scheduler::{Action, Span, VersionRule, WorkerId};
use pipe_transport::collective::ring_all_reduce;
use pipe_transport::{Key, Kind, Message, Transport};

use super::{Setup, flatten, mean_step, unflatten};
use crate::error::{Result, StageError};
use crate::layers::Saved;
use crate::model::Params;
use crate::optim::{Optimizer, OptimizerConfig};

/// One stage's persistent state on a worker: its current weights and optimizer state.
#[derive(Debug, Clone)]
pub struct StageState {
    /// The stage.
    pub stage: u32,
    /// Current weights.
    pub params: Params,
    /// Optimizer state.
    pub opt: Optimizer,
}

/// A worker's persistent state across runs (epochs): its stages, in chunk order.
#[derive(Debug, Clone)]
pub struct WorkerState {
    /// The worker.
    pub worker: WorkerId,
    /// Its stages.
    pub stages: Vec<StageState>,
}

impl WorkerState {
    /// Fresh state for `worker`: the slices of `init` (the whole model's parameters) its stages
    /// hold, and zeroed optimizer state.
    pub fn new(setup: &Setup<'_>, worker: WorkerId, init: &Params, opt: OptimizerConfig) -> Self {
        let stages = setup
            .schedule
            .layout()
            .stages_of(worker)
            .map(|stage| {
                let params: Params = init[setup.partition.range(stage as usize)].to_vec();
                let opt = Optimizer::new(opt, &params);
                StageState { stage, params, opt }
            })
            .collect();
        WorkerState { worker, stages }
    }
}

/// Which pass a version record is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pass {
    /// The forward.
    Forward,
    /// The backward (its input-gradient half when split).
    Backward,
}

/// The weight version one pass actually used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VersionRecord {
    /// Stage.
    pub stage: u32,
    /// Microbatch.
    pub mb: u32,
    /// Pass.
    pub pass: Pass,
    /// Version.
    pub version: u32,
}

/// What a worker reports after running its program.
#[derive(Debug, Clone, Default)]
pub struct WorkerOutcome {
    /// The worker.
    pub worker: WorkerId,
    /// Every version used, in program order.
    pub versions: Vec<VersionRecord>,
    /// Every action's interval, seconds from the run's start.
    pub spans: Vec<Span>,
    /// Sum of losses over the microbatches whose loss this worker computed.
    pub loss_sum: f64,
    /// Correct predictions among them.
    pub correct: usize,
    /// Samples whose loss it computed.
    pub samples: usize,
    /// Seconds in forward, backward and update actions.
    pub compute_s: f64,
    /// Sum over applied gradients of (version updated - version the gradient was computed on).
    pub staleness_sum: f64,
    /// Number of gradients applied.
    pub staleness_count: u64,
    /// The most weight versions (over all its stages) this worker held at once.
    pub peak_versions: u32,
    /// Per microbatch whose loss this worker computed: (microbatch, loss sum, samples).
    pub losses: Vec<(u32, f64, usize)>,
}

/// Per-stage runtime state for one run.
struct Rt {
    stage: u32,
    range: Range<usize>,
    group: Vec<u32>,
    update_size: u32,
    versions: BTreeMap<u32, Params>,
    current: u32,
    grads: Params,
    fresh: bool,
    opt: Optimizer,
    last_use: Vec<usize>,
    fwd: HashMap<u32, (Vec<Saved>, u32)>,
    split: HashMap<u32, (Vec<Saved>, Vec<Tensor>, u32)>,
    inputs: HashMap<u32, (Tensor, u64)>,
    dys: HashMap<u32, Tensor>,
    outputs: HashMap<u32, (Tensor, u64)>,
    dxs: HashMap<u32, Tensor>,
    used: Vec<u32>,
}

fn exec_err(msg: String) -> StageError {
    StageError::Executor(msg)
}

/// Runs `state.worker`'s program of `setup.schedule` over transport `t`, updating `state`.
/// `t0` is the run's start (span times are relative to it).
///
/// # Errors
/// [`StageError::Worker`] naming the worker, its stage and replica, and the action that failed.
pub fn run_worker<B: Backend, T: Transport + ?Sized>(
    be: &B,
    t: &mut T,
    setup: &Setup<'_>,
    state: &mut WorkerState,
    t0: Instant,
) -> Result<WorkerOutcome> {
    let w = state.worker;
    let layout = setup.schedule.layout();
    let (position, replica) = layout.placement(w);
    let wrap = |action: String, e: StageError| StageError::Worker {
        worker: w,
        stage: position,
        replica,
        action,
        source: Box::new(e),
    };
    let mut ex = Exec::new(setup, state).map_err(|e| wrap("start".into(), e))?;
    let program = &setup.schedule.programs[w as usize];
    let mut out = WorkerOutcome {
        worker: w,
        ..WorkerOutcome::default()
    };
    for (pc, &a) in program.iter().enumerate() {
        let start = t0.elapsed().as_secs_f64();
        ex.step(be, t, pc, a, &mut out)
            .map_err(|e| wrap(a.to_string(), e))?;
        let held: usize = ex.rts.iter().map(|rt| rt.versions.len()).sum();
        out.peak_versions = out.peak_versions.max(held as u32);
        let end = t0.elapsed().as_secs_f64();
        if a.kind().is_compute() || matches!(a, Action::Update { .. }) {
            out.compute_s += end - start;
        }
        out.spans.push(Span {
            worker: w,
            action: a,
            start,
            end,
        });
    }
    ex.finish(state).map_err(|e| wrap("end".into(), e))?;
    Ok(out)
}

struct Exec<'s, 'a> {
    setup: &'s Setup<'a>,
    worker: WorkerId,
    rule: VersionRule,
    rts: Vec<Rt>,
    positions: u32,
    last_stage: u32,
}

impl<'s, 'a> Exec<'s, 'a> {
    fn new(setup: &'s Setup<'a>, state: &WorkerState) -> Result<Self> {
        let schedule = setup.schedule;
        let layout = schedule.layout();
        let w = state.worker;
        let plan = setup.plan;
        let positions = layout.positions();
        let mut rts: Vec<Rt> = state
            .stages
            .iter()
            .map(|st| {
                let s = st.stage;
                let mut versions = BTreeMap::new();
                versions.insert(0, st.params.clone());
                let range = setup.partition.range(s as usize);
                Rt {
                    stage: s,
                    grads: setup.model.zero_grads(range.clone()),
                    range,
                    group: layout.group(s).collect(),
                    update_size: schedule.resolved.update_size(s),
                    versions,
                    current: 0,
                    fresh: true,
                    opt: st.opt.clone(),
                    last_use: Vec::new(),
                    fwd: HashMap::new(),
                    split: HashMap::new(),
                    inputs: HashMap::new(),
                    dys: HashMap::new(),
                    outputs: HashMap::new(),
                    dxs: HashMap::new(),
                    used: Vec::new(),
                }
            })
            .collect();
        // Last use of each version, from the plan: versions are freed after it.
        for (pc, a) in schedule.programs[w as usize].iter().enumerate() {
            let v = match *a {
                Action::Forward { stage, mb } => plan.forward_version(stage, mb),
                Action::Backward { stage, mb }
                | Action::BackwardInput { stage, mb }
                | Action::BackwardWeight { stage, mb } => plan.backward_version(stage, mb),
                _ => continue,
            };
            let c = (a.stage() / positions) as usize;
            let rt = rts
                .get_mut(c)
                .ok_or_else(|| exec_err(format!("stage {} is not held here", a.stage())))?;
            let v = v as usize;
            if rt.last_use.len() <= v {
                rt.last_use.resize(v + 1, 0);
            }
            rt.last_use[v] = rt.last_use[v].max(pc);
        }
        Ok(Exec {
            setup,
            worker: w,
            rule: schedule.resolved.policy.version_rule(),
            rts,
            positions,
            last_stage: schedule.stages() - 1,
        })
    }

    fn chunk(&self, stage: u32) -> Result<usize> {
        let c = (stage / self.positions) as usize;
        match self.rts.get(c) {
            Some(rt) if rt.stage == stage => Ok(c),
            _ => Err(exec_err(format!(
                "stage {stage} is not held by this worker"
            ))),
        }
    }

    /// True when `stage` of microbatch `mb` runs on this worker too (local hand-off).
    fn local(&self, stage: u32, mb: u32) -> bool {
        self.setup.schedule.layout().worker_for(stage, mb) == self.worker
    }

    fn step<B: Backend, T: Transport + ?Sized>(
        &mut self,
        be: &B,
        t: &mut T,
        pc: usize,
        a: Action,
        out: &mut WorkerOutcome,
    ) -> Result<()> {
        let setup = self.setup;
        let model = setup.model;
        let bed: &dyn Backend = be;
        let me = self.worker;
        match a {
            Action::Forward { stage, mb } => {
                let c = self.chunk(stage)?;
                let last = stage == self.last_stage;
                let next_local = if !last && self.local(stage + 1, mb) {
                    Some(self.chunk(stage + 1)?)
                } else {
                    None
                };
                let (x, tag) = if stage == 0 {
                    (setup.data.inputs(mb)?, 0u64)
                } else {
                    self.rts[c]
                        .inputs
                        .remove(&mb)
                        .ok_or_else(|| exec_err(format!("no input for microbatch {mb}")))?
                };
                let rt = &mut self.rts[c];
                let v = match self.rule {
                    VersionRule::Stash | VersionRule::Latest => rt.current,
                    VersionRule::DelayedByOne => (mb / rt.update_size).saturating_sub(1),
                    VersionRule::VerticalSync if stage == 0 => rt.current,
                    VersionRule::VerticalSync => (tag / u64::from(rt.update_size)) as u32,
                };
                let params = rt
                    .versions
                    .get(&v)
                    .ok_or_else(|| exec_err(format!("version {v} of stage {stage} is not held")))?;
                let (y, saved) = model.forward_range(
                    bed,
                    rt.range.clone(),
                    params,
                    x,
                    true,
                    setup.seed,
                    setup.microbatch_offset + u64::from(mb),
                )?;
                rt.fwd.insert(mb, (saved, v));
                out.versions.push(VersionRecord {
                    stage,
                    mb,
                    pass: Pass::Forward,
                    version: v,
                });
                let out_tag = if stage == 0 {
                    u64::from(v) * u64::from(rt.update_size)
                } else {
                    tag
                };
                match next_local {
                    _ if last => {
                        let labels = setup.data.labels(mb)?;
                        let b = labels.len().max(1);
                        let mut dlogits = Tensor::default();
                        let stats = bed.softmax_cross_entropy(
                            &y,
                            &labels,
                            1.0 / b as f32,
                            Some(&mut dlogits),
                        )?;
                        out.loss_sum += stats.loss_sum;
                        out.correct += stats.correct;
                        out.samples += stats.rows;
                        out.losses.push((mb, stats.loss_sum, stats.rows));
                        rt.dys.insert(mb, dlogits);
                    }
                    None => {
                        rt.outputs.insert(mb, (y, out_tag));
                    }
                    Some(n) => {
                        self.rts[n].inputs.insert(mb, (y, out_tag));
                    }
                }
                self.free(c, pc);
            }
            Action::Backward { stage, mb } | Action::BackwardInput { stage, mb } => {
                let c = self.chunk(stage)?;
                let split = matches!(a, Action::BackwardInput { .. });
                let rule = self.rule;
                let rt = &mut self.rts[c];
                let (saved, fv) = rt.fwd.remove(&mb).ok_or_else(|| {
                    exec_err(format!("backward of microbatch {mb} before its forward"))
                })?;
                let dy = rt
                    .dys
                    .remove(&mb)
                    .ok_or_else(|| exec_err(format!("no output gradient for microbatch {mb}")))?;
                let v = if rule == VersionRule::Latest {
                    rt.current
                } else {
                    fv
                };
                let params = rt
                    .versions
                    .get(&v)
                    .ok_or_else(|| exec_err(format!("version {v} of stage {stage} is not held")))?;
                let dx = if split {
                    let (dx, dys) = model.backward_input_range(
                        bed,
                        rt.range.clone(),
                        params,
                        &saved,
                        dy,
                        stage > 0,
                    )?;
                    rt.split.insert(mb, (saved, dys, v));
                    dx
                } else {
                    let dx = model.backward_range(
                        bed,
                        rt.range.clone(),
                        params,
                        &saved,
                        dy,
                        &mut rt.grads,
                        !rt.fresh,
                        stage > 0,
                    )?;
                    rt.fresh = false;
                    rt.used.push(v);
                    dx
                };
                out.versions.push(VersionRecord {
                    stage,
                    mb,
                    pass: Pass::Backward,
                    version: v,
                });
                if let Some(dx) = dx {
                    if self.local(stage - 1, mb) {
                        let p = self.chunk(stage - 1)?;
                        self.rts[p].dys.insert(mb, dx);
                    } else {
                        self.rts[c].dxs.insert(mb, dx);
                    }
                }
                self.free(c, pc);
            }
            Action::BackwardWeight { stage, mb } => {
                let c = self.chunk(stage)?;
                let rt = &mut self.rts[c];
                let (saved, dys, v) = rt.split.remove(&mb).ok_or_else(|| {
                    exec_err(format!(
                        "weight gradient of microbatch {mb} before its input gradient"
                    ))
                })?;
                let params = rt
                    .versions
                    .get(&v)
                    .ok_or_else(|| exec_err(format!("version {v} of stage {stage} is not held")))?;
                model.backward_params_range(
                    bed,
                    rt.range.clone(),
                    params,
                    &saved,
                    &dys,
                    &mut rt.grads,
                    !rt.fresh,
                )?;
                rt.fresh = false;
                rt.used.push(v);
                self.free(c, pc);
            }
            Action::AllReduce { stage, update } => {
                let c = self.chunk(stage)?;
                let rt = &mut self.rts[c];
                if rt.fresh {
                    zero(&mut rt.grads);
                    rt.fresh = false;
                }
                let mut flat = flatten(&rt.grads);
                ring_all_reduce(t, &rt.group, stage, update, &mut flat)?;
                unflatten(&mut rt.grads, &flat);
            }
            Action::Update { stage, update } => {
                let c = self.chunk(stage)?;
                let rt = &mut self.rts[c];
                if update != rt.current {
                    return Err(exec_err(format!(
                        "update {update} but the stage is at version {}",
                        rt.current
                    )));
                }
                if rt.fresh {
                    zero(&mut rt.grads);
                }
                let lr = (setup.lr)(stage, update);
                let cur = rt.current;
                let mut p = rt
                    .versions
                    .remove(&cur)
                    .ok_or_else(|| exec_err(format!("current version {cur} is not held")))?;
                if rt.last_use.get(cur as usize).is_some_and(|&u| u > pc) {
                    rt.versions.insert(cur, p.clone());
                }
                mean_step(bed, &mut rt.opt, &mut p, &mut rt.grads, rt.update_size, lr)?;
                rt.current += 1;
                rt.versions.insert(rt.current, p);
                rt.fresh = true;
                for v in rt.used.drain(..) {
                    out.staleness_sum += f64::from(cur - v.min(cur));
                    out.staleness_count += 1;
                }
                self.free(c, pc);
            }
            Action::SendActivation { stage, mb, to } => {
                let c = self.chunk(stage)?;
                let (tensor, tag) = self.rts[c]
                    .outputs
                    .remove(&mb)
                    .ok_or_else(|| exec_err(format!("no output of microbatch {mb} to send")))?;
                t.send(Message {
                    key: Key {
                        from: me,
                        to,
                        kind: Kind::Activation,
                        stage,
                        index: mb,
                        step: 0,
                    },
                    version: tag,
                    tensor,
                })?;
            }
            Action::SendGradient { stage, mb, to } => {
                let c = self.chunk(stage)?;
                let tensor = self.rts[c].dxs.remove(&mb).ok_or_else(|| {
                    exec_err(format!("no input gradient of microbatch {mb} to send"))
                })?;
                t.send(Message {
                    key: Key {
                        from: me,
                        to,
                        kind: Kind::Gradient,
                        stage,
                        index: mb,
                        step: 0,
                    },
                    version: 0,
                    tensor,
                })?;
            }
            Action::RecvActivation { stage, mb, from } => {
                let c = self.chunk(stage)?;
                let m = t.recv(&Key {
                    from,
                    to: me,
                    kind: Kind::Activation,
                    stage: stage - 1,
                    index: mb,
                    step: 0,
                })?;
                self.rts[c].inputs.insert(mb, (m.tensor, m.version));
            }
            Action::RecvGradient { stage, mb, from } => {
                let c = self.chunk(stage)?;
                let m = t.recv(&Key {
                    from,
                    to: me,
                    kind: Kind::Gradient,
                    stage: stage + 1,
                    index: mb,
                    step: 0,
                })?;
                self.rts[c].dys.insert(mb, m.tensor);
            }
            Action::SendChunk { .. } | Action::RecvChunk { .. } => {
                return Err(exec_err(
                    "expanded ring all-reduce steps are for the simulator; lower the schedule \
                     with collective all-reduces"
                        .into(),
                ));
            }
        }
        Ok(())
    }

    /// Drops versions of stage chunk `c` that nothing after `pc` uses (never the current one).
    fn free(&mut self, c: usize, pc: usize) {
        let rt = &mut self.rts[c];
        let cur = rt.current;
        let last = &rt.last_use;
        rt.versions
            .retain(|&v, _| v == cur || last.get(v as usize).is_some_and(|&u| u > pc));
    }

    /// Moves the final weights and optimizer state back into `state`.
    fn finish(self, state: &mut WorkerState) -> Result<()> {
        for (rt, st) in self.rts.into_iter().zip(state.stages.iter_mut()) {
            if !rt.fwd.is_empty()
                || !rt.split.is_empty()
                || !rt.outputs.is_empty()
                || !rt.dxs.is_empty()
            {
                return Err(exec_err(format!(
                    "stage {} ended with unfinished microbatches",
                    rt.stage
                )));
            }
            let mut versions = rt.versions;
            st.params = versions
                .remove(&rt.current)
                .ok_or_else(|| exec_err("current version lost".into()))?;
            st.opt = rt.opt;
        }
        Ok(())
    }
}

fn zero(p: &mut Params) {
    for g in p.iter_mut().flatten() {
        g.fill(0.0);
    }
}
