//! The worker core: the state of one worker during a run and one method per action.
//!
//! It decides everything and performs no I/O: it reads no clock and calls no transport. Sends
//! hand out the [`Message`] to send, receives take the message the driver received, and the
//! all-reduce hands out the flat gradient buffer and takes the sum back. The driver
//! ([`super::driver`]) connects these to a transport and times them; tests drive the same
//! methods directly.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use pipe_kernels::{Backend, LossReading, LossStats, Tensor};
use pipe_scheduler::{Action, ActionKind, Layout, Span, VersionQuery, VersionRule, WorkerId};
use pipe_transport::{Key, Kind, Message};

use super::clip::ClipState;
use super::setup::Setup;
use crate::error::{Result, StageError};
use crate::layers::Saved;
use crate::model::{GradientsReady, Params, place_params};
use crate::optim::{Corrected, OptimizerConfig, UpdateMean};
use crate::remedy::{Prediction, Velocity, corrected_weights, stage_delays};

/// One stage's persistent state on a worker: its current weights and optimizer state.
#[derive(Debug, Clone)]
pub struct StageState {
    /// The stage.
    pub stage: u32,
    /// Current weights.
    pub params: Params,
    /// Optimizer state, its delay correction's included.
    pub opt: Corrected,
}

/// Where a worker keeps its stage's state at each step boundary while a segment runs, so
/// that a lost replica costs the updates in flight ([`super::rollback::Points`]).
pub trait StepKeeper: Send + std::fmt::Debug {
    /// Keeps the stage's weights `params` and optimizer state `opt` (on `be`) as its state
    /// after `step` minibatches of the segment, with the worker's `outcome` so far.
    ///
    /// # Errors
    /// A device that fails the copy to host memory.
    fn keep(
        &mut self,
        step: u64,
        state: (u32, &Params, &Corrected),
        be: &dyn Backend,
        outcome: &mut WorkerOutcome,
    ) -> Result<()>;
}

/// A worker's [`StepKeeper`], shared with the launcher that reads it after a failure.
pub type SharedKeeper = std::sync::Arc<std::sync::Mutex<dyn StepKeeper>>;

/// A worker's persistent state across runs (epochs): its stages, in chunk order.
#[derive(Debug, Clone)]
pub struct WorkerState {
    /// The worker.
    pub worker: WorkerId,
    /// Its stages.
    pub stages: Vec<StageState>,
    /// Where its last run's program stands (or stopped): what the hang doctor reads.
    pub progress: super::doctor::StopPoint,
    /// Where its next run keeps its stage's state at each step boundary (none: nowhere).
    pub keeper: Option<SharedKeeper>,
}

impl WorkerState {
    /// Fresh state for `worker`: the slices of `init` (the whole model's parameters) its stages
    /// hold, and zeroed optimizer state.
    pub fn new(setup: &Setup<'_>, worker: WorkerId, init: &Params, opt: OptimizerConfig) -> Self {
        let plan = setup.plan;
        let matrices = setup.model.optimizer_roles();
        let stages = plan
            .schedule
            .layout()
            .stages_of(worker)
            .map(|stage| {
                let range = plan.partition.range(stage as usize);
                let params: Params = init[range.clone()].to_vec();
                let opt = Corrected::new(opt, &params, &matrices[range]);
                StageState { stage, params, opt }
            })
            .collect();
        WorkerState {
            worker,
            stages,
            progress: super::doctor::StopPoint::default(),
            keeper: None,
        }
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
    /// The most bytes of stashed weight versions (beyond each stage's newest) it held at once.
    pub peak_stash_bytes: u64,
    /// Payload bytes it sent: activations, gradients, its share of all-reduce traffic and tied
    /// gradients.
    pub bytes_sent: u64,
    /// Per microbatch whose loss this worker computed: (microbatch, loss sum, samples).
    pub losses: Vec<(u32, f64, usize)>,
    /// Per update of the loss stage, on its first replica when clipping: (update, the global
    /// gradient norm before clipping).
    pub grad_norms: Vec<(u32, f64)>,
    /// The peak resident memory of the worker's process when its program ended (`VmHWM`;
    /// shared by the workers of one process; 0 where it cannot be read).
    pub peak_resident_bytes: u64,
    /// The most device memory the worker's backend held for tensors at once, where it keeps a
    /// pool of its own (the CUDA backend; 0 for host backends).
    pub peak_device_bytes: u64,
    /// Activations and gradients it lent as device buffers to worker processes of its host
    /// rather than copying them out ([`super::loans`]).
    pub buffers_lent: u64,
}

impl WorkerOutcome {
    /// Adds `o`'s counts to these: sums added, peaks the larger (its lists are not taken).
    pub fn add_counts(&mut self, o: &WorkerOutcome) {
        self.loss_sum += o.loss_sum;
        self.correct += o.correct;
        self.samples += o.samples;
        self.compute_s += o.compute_s;
        self.staleness_sum += o.staleness_sum;
        self.staleness_count += o.staleness_count;
        self.peak_versions = self.peak_versions.max(o.peak_versions);
        self.peak_resident_bytes = self.peak_resident_bytes.max(o.peak_resident_bytes);
        self.peak_device_bytes = self.peak_device_bytes.max(o.peak_device_bytes);
        self.peak_stash_bytes = self.peak_stash_bytes.max(o.peak_stash_bytes);
        self.bytes_sent += o.bytes_sent;
        self.buffers_lent += o.buffers_lent;
    }

    /// This worker's figures followed by those it measured next (`after`): its counts added
    /// and its records and lists after these, in order.
    pub fn followed_by(mut self, after: WorkerOutcome) -> WorkerOutcome {
        self.add_counts(&after);
        self.worker = after.worker;
        self.versions.extend(after.versions);
        self.spans.extend(after.spans);
        self.losses.extend(after.losses);
        self.grad_norms.extend(after.grad_norms);
        self
    }
}

/// A forward's saved activations, kept until the backward.
struct ForwardSaved {
    saved: Vec<Saved>,
    version: u32,
}

/// An input-gradient half's leftovers, kept until the weight half.
struct WeightPending {
    saved: Vec<Saved>,
    output_grads: Vec<Tensor>,
    version: u32,
}

/// An activation with the tag it travels with (vertical sync's entry tag).
struct Tagged {
    tensor: Tensor,
    tag: u64,
}

/// One stage's state on this worker during one run.
struct StageRun {
    stage: u32,
    layers: Range<usize>,
    /// Workers holding this stage (its replicas), in ring order.
    replica_group: Vec<u32>,
    update_size: u32,
    /// Weight versions held, by version number.
    versions: BTreeMap<u32, Params>,
    current_version: u32,
    grads: Params,
    /// No gradient accumulated since the last update (the next one writes, not adds).
    grads_fresh: bool,
    optimizer: Corrected,
    /// Per version, the program counter of its last use.
    last_use: Vec<usize>,
    forward_saved: HashMap<u32, ForwardSaved>,
    weight_pending: HashMap<u32, WeightPending>,
    /// Activations to forward (received, or handed over by a local previous stage).
    inputs: HashMap<u32, Tagged>,
    /// Gradients of this stage's output (from the loss, a local next stage, or received).
    output_grads: HashMap<u32, Tensor>,
    /// Outputs waiting to be sent.
    outbox_activations: HashMap<u32, Tagged>,
    /// Input gradients waiting to be sent.
    outbox_gradients: HashMap<u32, Tensor>,
    /// Versions of the gradients accumulated since the last update (for staleness).
    gradient_versions: Vec<u32>,
    /// The coming update's gradients are ready for the step ([`WorkerCore::prepare`]).
    prepared: bool,
    /// Stages sharing a tied parameter with this one ([`Model::tie_partners`]), ascending.
    tie_partners: Vec<u32>,
    /// Per partner stage, its raw tied-use gradients of the coming update (received).
    tied_received: HashMap<u32, Tensor>,
    /// The velocity estimate of weight prediction ([`Prediction`]), when asked for.
    velocity: Option<Velocity>,
    /// The look-ahead's distance (the stage's delay) and, per version held, the weights its
    /// passes use.
    lookahead: Option<(f32, BTreeMap<u32, Params>)>,
}

impl StageRun {
    fn params(&self, v: u32) -> Result<&Params> {
        self.versions
            .get(&v)
            .ok_or_else(|| exec_err(format!("version {v} of stage {} is not held", self.stage)))
    }

    /// The weights the passes of version `v` use: the version itself, or its look-ahead.
    fn pass_params(&self, v: u32) -> Result<&Params> {
        pass_weights(&self.versions, &self.lookahead, self.stage, v)
    }

    /// Drops versions that nothing after `pc` uses (never the current one).
    fn free_after(&mut self, pc: usize) {
        let cur = self.current_version;
        let last = &self.last_use;
        let keep = |v: &u32| *v == cur || last.get(*v as usize).is_some_and(|&u| u > pc);
        self.versions.retain(|v, _| keep(v));
        if let Some((_, predicted)) = &mut self.lookahead {
            predicted.retain(|v, _| keep(v));
        }
    }
}

/// [`StageRun::pass_params`] over the fields it reads, so a caller can hold the weights while
/// it writes other fields of the stage.
fn pass_weights<'r>(
    versions: &'r BTreeMap<u32, Params>,
    lookahead: &'r Option<(f32, BTreeMap<u32, Params>)>,
    stage: u32,
    v: u32,
) -> Result<&'r Params> {
    let held = match lookahead {
        Some((_, predicted)) => predicted,
        None => versions,
    };
    held.get(&v)
        .ok_or_else(|| exec_err(format!("version {v} of stage {stage} is not held")))
}

/// Records in `out` the version a pass used, unless the action is replayed (`replayed`: its
/// record was made when it first ran).
fn record(
    out: &mut WorkerOutcome,
    replayed: Option<u32>,
    (stage, mb, pass, version): (u32, u32, Pass, u32),
) {
    if replayed.is_none() {
        out.versions.push(VersionRecord {
            stage,
            mb,
            pass,
            version,
        });
    }
}

fn exec_err(msg: String) -> StageError {
    StageError::Executor(msg)
}

/// One worker's state during one run of a schedule, with one method per action.
pub struct WorkerCore<'s, 'a> {
    setup: &'s Setup<'a>,
    worker: WorkerId,
    layout: &'s Layout,
    rule: VersionRule,
    stages: Vec<StageRun>,
    last_stage: u32,
    /// Gradient clipping's squared norms held and where this worker's stages are ready.
    clip: ClipState,
    /// What the run reports (versions used, losses, staleness; the driver adds times).
    pub outcome: WorkerOutcome,
    /// Where the stage's state is kept at each step boundary.
    keeper: Option<SharedKeeper>,
    /// While a resumed worker replays the actions of its microbatches in flight that ran
    /// before its step boundary ([`super::resume`]): the stage's version when each first ran.
    /// Their figures are not recorded again and no version is freed.
    replay_current: Option<u32>,
    /// While a resumed worker runs a forward later than its program has it
    /// ([`super::resume::Planned::moved_at`]): the stage's version at its place in the
    /// program, the one it reads. Its figures are recorded as the program's own.
    moved_current: Option<u32>,
    /// Losses evaluated and not yet read ([`WorkerCore::settle_losses`]).
    pending_losses: Vec<PendingLoss>,
}

/// A loss evaluated on the device and not yet read: its microbatch, its statistics as the
/// backend left them, and whether it belongs to a replayed action.
struct PendingLoss {
    mb: u32,
    reading: LossReading,
    replayed: bool,
}

impl<'s, 'a> WorkerCore<'s, 'a> {
    /// The core of `state.worker` for `setup`'s plan, starting from `state`'s weights.
    ///
    /// # Errors
    /// A parameter tied across stages (the gradient exchange between stages is not built),
    /// or a stage the worker does not hold.
    pub fn new(be: &dyn Backend, setup: &'s Setup<'a>, state: &WorkerState) -> Result<Self> {
        Self::holding(be, setup, state, state.stages.clone())
    }

    /// [`WorkerCore::new`] with the stages' state `held` (in `state.stages`' order) moved in
    /// rather than copied from `state`.
    fn holding(
        be: &dyn Backend,
        setup: &'s Setup<'a>,
        state: &WorkerState,
        held: Vec<StageState>,
    ) -> Result<Self> {
        let plan = setup.plan;
        let schedule = &plan.schedule;
        let layout = schedule.layout();
        let ranges = plan.partition.ranges();
        // DC-ASGD reads each update's stale versions at the update: they are held until then.
        let compensating = held.iter().any(|st| st.opt.needs_stale_weights());
        let max_norm = held
            .first()
            .and_then(|st| st.opt.optimizer().config().grad_clip);
        let last_uses = if compensating {
            plan.versions
                .last_uses_through_updates(schedule, state.worker)
        } else {
            plan.versions.last_uses(schedule, state.worker)
        };
        let delays = match setup.prediction {
            Prediction::LookAhead { .. } => stage_delays(&schedule.resolved, &plan.versions),
            _ => Vec::new(),
        };
        let mut stages = Vec::with_capacity(held.len());
        for (st, last_use) in held.into_iter().zip(last_uses) {
            let layers = plan.partition.range(st.stage as usize);
            let tie_partners: Vec<u32> = setup
                .model
                .tie_partners(ranges, st.stage as usize)
                .into_iter()
                .map(|p| p as u32)
                .collect();
            if let Some(&p) = tie_partners
                .iter()
                .find(|&&p| layout.group(p).contains(&state.worker))
            {
                return Err(StageError::Config(format!(
                    "stages {} and {p} share a tied parameter and run on one worker (worker {}); \
                     tied stages must be on different workers",
                    st.stage, state.worker
                )));
            }
            let weights = place_params(be, st.params)?;
            let velocity = match setup.prediction.decay() {
                Some(decay) => Some(Velocity::new(be, &weights, decay)?),
                None => None,
            };
            let lookahead = match (&velocity, delays.get(st.stage as usize)) {
                (Some(vel), Some(&tau)) => {
                    let ahead = vel.extrapolate(be, &weights, tau as f32)?;
                    Some((tau as f32, BTreeMap::from([(0, ahead)])))
                }
                _ => None,
            };
            stages.push(StageRun {
                stage: st.stage,
                velocity,
                lookahead,
                tie_partners,
                tied_received: HashMap::new(),
                grads: place_params(be, setup.model.zero_grads(layers.clone()))?,
                layers,
                replica_group: layout.group(st.stage).collect(),
                update_size: schedule.resolved.update_size(st.stage),
                versions: BTreeMap::from([(0, weights)]),
                current_version: 0,
                grads_fresh: true,
                optimizer: st.opt.placed(be)?,
                last_use,
                forward_saved: HashMap::new(),
                weight_pending: HashMap::new(),
                inputs: HashMap::new(),
                output_grads: HashMap::new(),
                outbox_activations: HashMap::new(),
                outbox_gradients: HashMap::new(),
                gradient_versions: Vec::new(),
                prepared: false,
            });
        }
        let clip = ClipState::new(schedule, plan.norms.is_exact(), state.worker, max_norm);
        Ok(WorkerCore {
            setup,
            worker: state.worker,
            layout,
            rule: schedule.resolved.policy.version_rule(),
            clip,
            stages,
            last_stage: schedule.stages() - 1,
            outcome: WorkerOutcome {
                worker: state.worker,
                ..WorkerOutcome::default()
            },
            keeper: state.keeper.clone(),
            replay_current: None,
            moved_current: None,
            pending_losses: Vec::new(),
        })
    }

    /// The core of `state.worker` resumed at a step boundary of its segment, where its stage
    /// is at weight version `version` with `state`'s weights and optimizer state, holding the
    /// older versions in `stash` that the actions from there on read ([`super::resume`]).
    ///
    /// `state`'s stages and `stash` are moved in, not copied (a resume is on the path back to
    /// training after a loss, where every survivor resumes at once); [`WorkerCore::finish`]
    /// puts the stages back, and an error leaves them empty.
    ///
    /// # Errors
    /// As [`WorkerCore::new`]; a worker of several stages, or weight prediction (whose
    /// running averages a step boundary does not hold).
    pub fn resumed(
        be: &dyn Backend,
        setup: &'s Setup<'a>,
        state: &mut WorkerState,
        stash: BTreeMap<u32, Params>,
        (version, holds): (u32, &BTreeMap<u32, usize>),
    ) -> Result<Self> {
        let held = std::mem::take(&mut state.stages);
        let mut core = Self::holding(be, setup, state, held)?;
        let [run] = core.stages.as_mut_slice() else {
            return Err(exec_err("a worker of several stages cannot resume".into()));
        };
        if run.velocity.is_some() {
            return Err(exec_err(
                "a worker predicting its weights cannot resume at a step".into(),
            ));
        }
        let current = run
            .versions
            .remove(&0)
            .ok_or_else(|| exec_err("current version lost".into()))?;
        for (v, params) in stash.into_iter().filter(|&(v, _)| v < version) {
            run.versions.insert(v, place_params(be, params)?);
        }
        run.versions.insert(version, current);
        run.current_version = version;
        // A replayed action moved later reads its version past the version's last use.
        for (&v, &pc) in holds {
            let v = v as usize;
            if run.last_use.len() <= v {
                run.last_use.resize(v + 1, 0);
            }
            run.last_use[v] = run.last_use[v].max(pc);
        }
        Ok(core)
    }

    /// Marks the actions run from now on as replayed ones that first ran at the stage's
    /// version `current` (`None`: the program goes on as itself). Ending a replay frees the
    /// versions nothing from `pc` on reads.
    pub fn replaying(&mut self, current: Option<u32>, pc: usize) {
        if self.replay_current.is_some() && current.is_none() {
            for run in &mut self.stages {
                run.free_after(pc.saturating_sub(1));
            }
        }
        self.replay_current = current;
    }

    /// Marks the action run next as one the program has earlier, where the stage stood at
    /// version `current` (`None`: it runs where the program has it).
    pub fn moved(&mut self, current: Option<u32>) {
        self.moved_current = current;
    }

    /// The run this core is part of.
    pub fn setup(&self) -> &'s Setup<'a> {
        self.setup
    }

    /// Index of `stage` among this worker's stages.
    fn chunk(&self, stage: u32) -> Result<usize> {
        let c = self.layout.chunk_of(stage) as usize;
        match self.stages.get(c) {
            Some(s) if s.stage == stage => Ok(c),
            _ => Err(exec_err(format!(
                "stage {stage} is not held by this worker"
            ))),
        }
    }

    /// This worker's chunk for `stage` of `mb` when that stage runs here too (local hand-off).
    fn local_chunk(&self, stage: u32, mb: u32) -> Result<Option<usize>> {
        if self.layout.worker_for(stage, mb) == self.worker {
            Ok(Some(self.chunk(stage)?))
        } else {
            Ok(None)
        }
    }

    /// Weight versions held now, over all stages.
    pub fn versions_held(&self) -> usize {
        self.stages.iter().map(|s| s.versions.len()).sum()
    }

    /// Bytes of the weight versions held beyond each stage's newest: the stash.
    pub fn stash_bytes(&self) -> usize {
        self.stages
            .iter()
            .map(|s| {
                let one: usize = s
                    .versions
                    .values()
                    .next()
                    .map_or(0, |p| p.iter().flatten().map(Tensor::bytes).sum());
                one * s.versions.len().saturating_sub(1)
            })
            .sum()
    }

    /// Runs a compute action (forward, backward or its halves, update) at program counter
    /// `pc`. Communication actions go through [`WorkerCore::outgoing`],
    /// [`WorkerCore::incoming_key`]/[`WorkerCore::deliver`] and the all-reduce pair.
    ///
    /// # Errors
    /// Kernel and data errors, or an action the state does not allow.
    pub fn compute(&mut self, be: &dyn Backend, pc: usize, a: Action) -> Result<()> {
        self.compute_notify(be, pc, a, &mut |_, _| Ok(()))
    }

    /// [`WorkerCore::compute`], calling `ready` after each layer of a backward pass that
    /// computes weight gradients (fused, or the weight half), as
    /// [`crate::model::Model::backward_range`] describes: how the driver starts
    /// all-reducing a bucket while earlier layers compute.
    ///
    /// # Errors
    /// As [`WorkerCore::compute`], or `ready`'s error.
    pub fn compute_notify(
        &mut self,
        be: &dyn Backend,
        pc: usize,
        a: Action,
        ready: &mut GradientsReady<'_>,
    ) -> Result<()> {
        match a {
            Action::Forward { stage, mb } => self.forward(be, pc, stage, mb),
            Action::Backward { stage, mb } => self.backward(be, (pc, stage, mb), false, ready),
            Action::BackwardInput { stage, mb } => {
                self.backward(be, (pc, stage, mb), true, &mut |_, _| Ok(()))
            }
            Action::BackwardWeight { stage, mb } => {
                self.backward_weight(be, (pc, stage, mb), ready)
            }
            Action::Update { stage, update } => self.update(be, pc, stage, update),
            other => Err(exec_err(format!("{other} is not a compute action"))),
        }
    }

    fn forward(&mut self, be: &dyn Backend, pc: usize, stage: u32, mb: u32) -> Result<()> {
        let setup = self.setup;
        let c = self.chunk(stage)?;
        let last = stage == self.last_stage;
        let next_local = if last {
            None
        } else {
            self.local_chunk(stage + 1, mb)?
        };
        let input = if stage == 0 {
            Tagged {
                tensor: be.place(setup.data.inputs(mb)?)?,
                tag: 0,
            }
        } else {
            self.stages[c]
                .inputs
                .remove(&mb)
                .ok_or_else(|| exec_err(format!("no input for microbatch {mb}")))?
        };
        let replayed = self.replay_current;
        let at = replayed.or(self.moved_current);
        let run = &mut self.stages[c];
        let v = self.rule.forward_version(&VersionQuery {
            stage,
            current: at.unwrap_or(run.current_version),
            update: setup.plan.schedule.resolved.update_of(stage, mb),
            entry_tag: input.tag,
            update_size: run.update_size,
        });
        let documents = setup.documents(be, mb)?;
        let (y, saved) = setup.model.forward_range(
            be,
            run.layers.clone(),
            run.pass_params(v)?,
            input.tensor,
            setup.model.training(stage as usize),
            setup.seed,
            setup.microbatch_offset + u64::from(mb),
            documents.as_ref(),
        )?;
        run.forward_saved
            .insert(mb, ForwardSaved { saved, version: v });
        record(&mut self.outcome, replayed, (stage, mb, Pass::Forward, v));
        let tag = if stage == 0 {
            VersionRule::entry_tag(v, run.update_size)
        } else {
            input.tag
        };
        if last {
            let dy = self.loss(be, mb, &y)?;
            self.stages[c].output_grads.insert(mb, dy);
        } else if let Some(n) = next_local {
            let out = Tagged { tensor: y, tag };
            self.stages[n].inputs.insert(mb, out);
        } else {
            let out = Tagged { tensor: y, tag };
            self.stages[c].outbox_activations.insert(mb, out);
        }
        if replayed.is_none() {
            self.stages[c].free_after(pc);
        }
        Ok(())
    }

    /// The loss of microbatch `mb`'s output; returns the gradient that starts its backward.
    /// Its statistics are read with the others at the next update or at the end
    /// ([`WorkerCore::settle_losses`]), so a device need not be waited for at every loss.
    fn loss(&mut self, be: &dyn Backend, mb: u32, y: &Tensor) -> Result<Tensor> {
        let labels = self.setup.data.labels(mb)?;
        let mean = UpdateMean::of(&self.setup.plan.schedule.resolved);
        let scale = mean.loss_scale(pipe_kernels::counted_labels(labels.host()?));
        let targets = be.place_ids(labels)?;
        let mut dy = Tensor::default();
        let reading = self
            .setup
            .loss
            .queue(be, y, &targets, scale, Some(&mut dy))?;
        self.pending_losses.push(PendingLoss {
            mb,
            reading,
            replayed: self.replay_current.is_some(),
        });
        Ok(dy)
    }

    /// Reads the statistics of the losses queued since the last call (one wait on a device)
    /// and records them in order, as each loss was recorded when it was evaluated: a loss that
    /// is not finite stops the run, a replayed one is not recorded again. Called before an
    /// update's step (whose kept figures include them) and at the end.
    fn settle_losses(&mut self, be: &dyn Backend) -> Result<()> {
        if self.pending_losses.is_empty() {
            return Ok(());
        }
        let pending = std::mem::take(&mut self.pending_losses);
        let (marks, readings): (Vec<(u32, bool)>, Vec<LossReading>) = pending
            .into_iter()
            .map(|p| ((p.mb, p.replayed), p.reading))
            .unzip();
        let stats = be.read_losses(readings)?;
        // A backend returns one reading's statistics per reading; fewer would drop a
        // microbatch's loss without a word.
        if stats.len() != marks.len() {
            return Err(crate::StageError::Executor(format!(
                "the {} backend read {} loss statistics for {} queued losses",
                be.name(),
                stats.len(),
                marks.len()
            )));
        }
        for ((mb, replayed), stats) in marks.into_iter().zip(stats) {
            self.record_loss(mb, replayed, stats)?;
        }
        Ok(())
    }

    /// Records microbatch `mb`'s loss statistics (see [`WorkerCore::settle_losses`]).
    fn record_loss(&mut self, mb: u32, replayed: bool, stats: LossStats) -> Result<()> {
        let minibatch = u64::from(self.setup.plan.schedule.resolved.minibatch.max(1));
        let global = self.setup.microbatch_offset + u64::from(mb);
        if !stats.loss_sum.is_finite() {
            return Err(crate::StageError::NonFinite {
                what: format!("the loss of microbatch {global}"),
                update: global / minibatch + 1,
                detail: String::new(),
            });
        }
        if replayed {
            // Reported and recorded when it first ran.
            return Ok(());
        }
        if let Some(tx) = self.setup.progress {
            // The trainer's thread reports each update as its losses arrive; if it has gone,
            // nothing is lost (the outcome keeps them too).
            let _ = tx.send(super::setup::Report::Loss(mb, stats.loss_sum, stats.rows));
        }
        let out = &mut self.outcome;
        out.loss_sum += stats.loss_sum;
        out.correct += stats.correct;
        out.samples += stats.rows;
        out.losses.push((mb, stats.loss_sum, stats.rows));
        Ok(())
    }

    fn backward(
        &mut self,
        be: &dyn Backend,
        (pc, stage, mb): (usize, u32, u32),
        split: bool,
        ready: &mut GradientsReady<'_>,
    ) -> Result<()> {
        let model = self.setup.model;
        let c = self.chunk(stage)?;
        let rule = self.rule;
        let replayed = self.replay_current;
        let run = &mut self.stages[c];
        let fwd = run
            .forward_saved
            .remove(&mb)
            .ok_or_else(|| exec_err(format!("backward of microbatch {mb} before its forward")))?;
        let dy = run
            .output_grads
            .remove(&mb)
            .ok_or_else(|| exec_err(format!("no output gradient for microbatch {mb}")))?;
        let v = rule.backward_version(fwd.version, replayed.unwrap_or(run.current_version));
        let corrected = match &run.velocity {
            Some(vel) if run.lookahead.is_none() => {
                corrected_weights(be, vel, run.params(v)?, v, fwd.version)?
            }
            _ => None,
        };
        let params = match &corrected {
            Some(p) => p,
            None => pass_weights(&run.versions, &run.lookahead, stage, v)?,
        };
        let dx = if split {
            let (dx, output_grads) = model.backward_input_range(
                be,
                run.layers.clone(),
                params,
                &fwd.saved,
                dy,
                stage > 0,
            )?;
            let pending = WeightPending {
                saved: fwd.saved,
                output_grads,
                version: v,
            };
            run.weight_pending.insert(mb, pending);
            dx
        } else {
            let dx = model.backward_range(
                be,
                run.layers.clone(),
                params,
                &fwd.saved,
                (dy, stage > 0),
                &mut run.grads,
                !run.grads_fresh,
                ready,
            )?;
            run.grads_fresh = false;
            run.gradient_versions.push(v);
            dx
        };
        record(&mut self.outcome, replayed, (stage, mb, Pass::Backward, v));
        if let Some(dx) = dx {
            match self.local_chunk(stage - 1, mb)? {
                Some(p) => self.stages[p].output_grads.insert(mb, dx),
                None => self.stages[c].outbox_gradients.insert(mb, dx),
            };
        }
        if replayed.is_none() {
            self.stages[c].free_after(pc);
        }
        Ok(())
    }

    fn backward_weight(
        &mut self,
        be: &dyn Backend,
        (pc, stage, mb): (usize, u32, u32),
        ready: &mut GradientsReady<'_>,
    ) -> Result<()> {
        let c = self.chunk(stage)?;
        let run = &mut self.stages[c];
        let pending = run.weight_pending.remove(&mb).ok_or_else(|| {
            exec_err(format!(
                "weight gradient of microbatch {mb} before its input gradient"
            ))
        })?;
        let params = run.versions.get(&pending.version).ok_or_else(|| {
            exec_err(format!(
                "version {} of stage {stage} is not held",
                pending.version
            ))
        })?;
        self.setup.model.backward_params_range(
            be,
            run.layers.clone(),
            params,
            &pending.saved,
            &pending.output_grads,
            &mut run.grads,
            !run.grads_fresh,
            ready,
        )?;
        run.grads_fresh = false;
        run.gradient_versions.push(pending.version);
        if self.replay_current.is_none() {
            run.free_after(pc);
        }
        Ok(())
    }

    fn update(&mut self, be: &dyn Backend, pc: usize, stage: u32, update: u32) -> Result<()> {
        self.settle_losses(be)?;
        let setup = self.setup;
        let c = self.chunk(stage)?;
        let cur = self.stages[c].current_version;
        if update != cur {
            return Err(exec_err(format!(
                "update {update} but the stage is at version {cur}"
            )));
        }
        self.prepare(be, c, update)?;
        self.clip(be, c, update)?;
        let run = &mut self.stages[c];
        run.prepared = false;
        let mut p = run
            .versions
            .remove(&cur)
            .ok_or_else(|| exec_err(format!("current version {cur} is not held")))?;
        if run.last_use.get(cur as usize).is_some_and(|&u| u > pc) {
            run.versions.insert(cur, p.clone());
        }
        let minibatch = u64::from(setup.plan.schedule.resolved.minibatch.max(1));
        let first_mb = setup.microbatch_offset + u64::from(update) * u64::from(run.update_size);
        let run_update = first_mb / minibatch + 1;
        let layers = run.layers.start;
        let lr = (setup.lr)(stage, update);
        let old = run.velocity.as_ref().map(|_| p.clone());
        let mean = UpdateMean::of(&setup.plan.schedule.resolved);
        let seen = (run.optimizer).step(be, &mut p, &mut run.grads, (mean, run.update_size), lr)?;
        let guarded = (layers, &run.grads, &p);
        (setup.model).check_update(be, guarded, &seen.0, run_update)?;
        run.current_version += 1;
        let applied = u64::from(update + 1) * u64::from(run.update_size);
        if let Some(keeper) = &self.keeper
            && applied % minibatch == 0
        {
            let mut keeper = keeper
                .lock()
                .map_err(|_| exec_err("a worker's rollback points were left poisoned".into()))?;
            let state = (stage, &p, &run.optimizer);
            keeper.keep(applied / minibatch, state, be, &mut self.outcome)?;
        }
        if let (Some(vel), Some(old)) = (&mut run.velocity, old) {
            vel.advance(be, &old, &p)?;
            if let Some((tau, predicted)) = &mut run.lookahead {
                predicted.insert(run.current_version, vel.extrapolate(be, &p, *tau)?);
            }
        }
        run.versions.insert(run.current_version, p);
        run.grads_fresh = true;
        let (mut sum, mut n) = (0.0, 0u32);
        for v in run.gradient_versions.drain(..) {
            sum += f64::from(cur - v.min(cur));
            n += 1;
        }
        self.outcome.staleness_sum += sum;
        self.outcome.staleness_count += u64::from(n);
        if n > 0 {
            metrics::gauge!("pipe_staleness", "stage" => stage.to_string()).set(sum / f64::from(n));
        }
        run.free_after(pc);
        let next = self.stages.iter().map(|r| (r.stage, r.current_version));
        self.clip.forget(self.setup, next);
        Ok(())
    }

    /// Brings chunk `c`'s gradients of `update` to what its step applies, once: zeroed if no
    /// microbatch contributed, compensated (DC-ASGD), its tied uses summed with its partners'
    /// (received before). Clipping's norm is taken after, in [`WorkerCore::prepare_stage`].
    fn prepare(&mut self, be: &dyn Backend, c: usize, update: u32) -> Result<()> {
        if self.stages[c].prepared {
            return Ok(());
        }
        let setup = self.setup;
        let run = &mut self.stages[c];
        if run.grads_fresh {
            zero(be, &mut run.grads)?;
            run.grads_fresh = false;
        }
        self.compensate(be, c, update)?;
        let run = &mut self.stages[c];
        if run.tie_partners.is_empty() {
            setup
                .model
                .sum_tied(be, &mut [(run.layers.start, &mut run.grads)])?;
        } else {
            sum_tied_across(setup, be, run)?;
        }
        run.prepared = true;
        Ok(())
    }

    /// The stages to ready at `Update` of `stage` and `update`, in chunk order, before the norms
    /// are exchanged: that stage, and under a flush policy with clipping every other stage of
    /// this worker not readied yet ([`super::clip`]).
    pub fn stages_to_prepare(&self, stage: u32, update: u32) -> Vec<u32> {
        if self.clip.max_norm().is_none() || !self.setup.plan.norms.is_exact() {
            return vec![stage];
        }
        self.stages
            .iter()
            .filter(|run| run.current_version == update && !run.prepared)
            .map(|run| run.stage)
            .collect()
    }

    /// Readies `stage`'s gradients of `update` for the step (after its tied gradients were
    /// delivered), and returns the messages carrying its squared norm to the workers whose
    /// updates add it (none without clipping).
    ///
    /// # Errors
    /// A stage this worker does not hold or that is at another version; gradients the program
    /// has not completed by `pc`; kernel errors.
    pub fn prepare_stage(
        &mut self,
        be: &dyn Backend,
        pc: usize,
        stage: u32,
        update: u32,
    ) -> Result<Vec<Message>> {
        let c = self.chunk(stage)?;
        if self.stages[c].current_version != update {
            return Err(exec_err(format!(
                "stage {stage} readied for update {update} at version {}",
                self.stages[c].current_version
            )));
        }
        self.clip.check_complete(pc, stage, update)?;
        self.prepare(be, c, update)?;
        if self.clip.max_norm().is_none() {
            return Ok(Vec::new());
        }
        let setup = self.setup;
        let run = &mut self.stages[c];
        let mean = (
            UpdateMean::of(&setup.plan.schedule.resolved),
            run.update_size,
        );
        let squared = super::clip::squared_norm_at_mean(
            be,
            (setup.model, run.layers.start),
            &mut run.optimizer,
            &mut run.grads,
            mean,
        )?;
        Ok(self.clip.publish(setup, (stage, update), squared))
    }

    /// The keys of the norms `Update` of `stage` and `update` adds that this worker has not
    /// received yet.
    ///
    /// # Errors
    /// As [`ClipState::keys`].
    pub fn norm_keys(&self, stage: u32, update: u32) -> Result<Vec<Key>> {
        self.clip.keys(self.setup, stage, update)
    }

    /// Takes a squared norm another worker sent.
    ///
    /// # Errors
    /// As [`ClipState::deliver`].
    pub fn deliver_norm(&mut self, m: Message) -> Result<()> {
        self.clip.deliver(m)
    }

    /// When clipping: the global norm of chunk `c`'s update `update`, and its gradients scaled
    /// down to the clipping norm where that is larger. The loss stage's first replica records
    /// the norm.
    fn clip(&mut self, be: &dyn Backend, c: usize, update: u32) -> Result<()> {
        let Some(max_norm) = self.clip.max_norm() else {
            return Ok(());
        };
        let stage = self.stages[c].stage;
        let norm = self.clip.global_norm(self.setup, stage, update)?;
        crate::optim::clip_gradients(be, &mut self.stages[c].grads, max_norm, norm)?;
        if stage == self.last_stage && self.layout.placement(self.worker).1 == 0 {
            self.outcome.grad_norms.push((update, norm));
            if let Some(tx) = self.setup.progress {
                // As for losses: the outcome keeps the norm if the trainer's thread has gone.
                let _ = tx.send(super::setup::Report::GradNorm(update, norm));
            }
        }
        Ok(())
    }

    /// The delay correction's compensation of chunk `c`'s gradients of `update`
    /// ([`Corrected::compensate`]), before its tied uses leave or are summed: against the
    /// stale weights of [`super::stale::stale_weights`] at the current version, which the
    /// correction reads only where it compensates, once per update.
    fn compensate(&mut self, be: &dyn Backend, c: usize, update: u32) -> Result<()> {
        let setup = self.setup;
        let run = &mut self.stages[c];
        let (stage, versions) = (run.stage, &run.versions);
        let held = |v: u32| {
            versions
                .get(&v)
                .ok_or_else(|| exec_err(format!("version {v} of stage {stage} is not held")))
        };
        let current = run.current_version;
        let mean = (
            UpdateMean::of(&setup.plan.schedule.resolved),
            run.update_size,
        );
        run.optimizer.compensate(be, &mut run.grads, mean, || {
            let stale =
                super::stale::stale_weights(be, &setup.plan.versions, (stage, update), held)?;
            Ok((held(current)?, stale))
        })
    }

    /// The message a send action sends.
    ///
    /// # Errors
    /// Nothing to send (the program sends before it computed), or not a send action.
    pub fn outgoing(&mut self, a: Action) -> Result<Message> {
        let not_a_send = || exec_err(format!("{a} is not a send"));
        let key = data_key(self.worker, a)
            .filter(|k| k.from == self.worker)
            .ok_or_else(not_a_send)?;
        match a {
            Action::SendActivation { stage, mb, .. } => {
                let c = self.chunk(stage)?;
                let out = self.stages[c]
                    .outbox_activations
                    .remove(&mb)
                    .ok_or_else(|| exec_err(format!("no output of microbatch {mb} to send")))?;
                Ok(Message {
                    key,
                    version: out.tag,
                    tensor: out.tensor,
                })
            }
            Action::SendGradient { stage, mb, .. } => {
                let c = self.chunk(stage)?;
                let tensor = self.stages[c].outbox_gradients.remove(&mb).ok_or_else(|| {
                    exec_err(format!("no input gradient of microbatch {mb} to send"))
                })?;
                Ok(Message {
                    key,
                    version: 0,
                    tensor,
                })
            }
            _ => Err(not_a_send()),
        }
    }

    /// The key a receive action waits for.
    ///
    /// # Errors
    /// Not a receive action.
    pub fn incoming_key(&self, a: Action) -> Result<Key> {
        data_key(self.worker, a)
            .filter(|k| k.to == self.worker && matches!(a.kind(), ActionKind::Recv))
            .ok_or_else(|| exec_err(format!("{a} is not a receive")))
    }

    /// Takes the message a receive action received.
    ///
    /// # Errors
    /// Not a receive action, or a stage this worker does not hold.
    pub fn deliver(&mut self, a: Action, m: Message) -> Result<()> {
        match a {
            Action::RecvActivation { stage, mb, .. } => {
                let c = self.chunk(stage)?;
                let input = Tagged {
                    tensor: m.tensor,
                    tag: m.version,
                };
                self.stages[c].inputs.insert(mb, input);
            }
            Action::RecvGradient { stage, mb, .. } => {
                let c = self.chunk(stage)?;
                self.stages[c].output_grads.insert(mb, m.tensor);
            }
            other => return Err(exec_err(format!("{other} is not a receive"))),
        }
        Ok(())
    }

    /// For an all-reduce of `stage`: its replica group (ring order) and its accumulated
    /// gradients (zeros when nothing was accumulated since the last update), which the
    /// all-reduce sums in place ([`super::all_reduce_gradients`]).
    ///
    /// # Errors
    /// A stage this worker does not hold.
    pub fn all_reduce_gradients(
        &mut self,
        be: &dyn Backend,
        stage: u32,
    ) -> Result<(Vec<u32>, &mut Params)> {
        let c = self.chunk(stage)?;
        let run = &mut self.stages[c];
        if run.grads_fresh {
            zero(be, &mut run.grads)?;
            run.grads_fresh = false;
        }
        Ok((run.replica_group.clone(), &mut run.grads))
    }

    /// The replica group of `stage` (ring order).
    ///
    /// # Errors
    /// A stage this worker does not hold.
    pub fn replica_group(&self, stage: u32) -> Result<Vec<u32>> {
        Ok(self.stages[self.chunk(stage)?].replica_group.clone())
    }

    /// The gradients `stage` has accumulated, as they are (what an all-reduce in flight moves
    /// on between actions).
    ///
    /// # Errors
    /// A stage this worker does not hold.
    pub fn gradients_mut(&mut self, stage: u32) -> Result<&mut Params> {
        let c = self.chunk(stage)?;
        Ok(&mut self.stages[c].grads)
    }

    /// Before update `update` of `stage`: the messages carrying its raw tied-use gradients
    /// to the replicas of each stage it shares a tied parameter with, and the keys of theirs
    /// to receive (with the sending stage). Empty when the stage shares none.
    ///
    /// Replica `i` of a stage receives from replica `i mod R` of a partner with `R`
    /// replicas; every replica holds the same all-reduced gradient, so one copy suffices.
    ///
    /// # Errors
    /// A stage this worker does not hold; gradients not on the host.
    pub fn tie_exchange(
        &mut self,
        be: &dyn Backend,
        stage: u32,
        update: u32,
    ) -> Result<TieExchange> {
        let c = self.chunk(stage)?;
        let (mut sends, mut recvs) = (Vec::new(), Vec::new());
        if self.stages[c].tie_partners.is_empty() {
            return Ok((sends, recvs));
        }
        if self.stages[c].grads_fresh {
            zero(be, &mut self.stages[c].grads)?;
            self.stages[c].grads_fresh = false;
        }
        self.compensate(be, c, update)?;
        let run = &self.stages[c];
        let ranges = self.setup.plan.partition.ranges();
        let me = self.worker;
        let mine: Vec<u32> = self.layout.group(stage).collect();
        let q = mine.iter().position(|&w| w == me).unwrap_or(0);
        for &p in &run.tie_partners {
            let theirs: Vec<u32> = self.layout.group(p).collect();
            let uses = self
                .setup
                .model
                .tied_uses_shared(run.layers.clone(), ranges[p as usize].clone());
            let mut flat = Vec::new();
            for (layer, slot) in uses {
                flat.extend_from_slice(&be.read(&run.grads[layer - run.layers.start][slot])?);
            }
            let key = |from: u32, to: u32, producer: u32| Key {
                from,
                to,
                kind: Kind::Chunk,
                stage: producer,
                index: update,
                step: TIED_GRADIENT_STEP,
            };
            for (r, &to) in theirs.iter().enumerate() {
                if r % mine.len() == q {
                    let n = flat.len();
                    sends.push(Message {
                        key: key(me, to, stage),
                        version: 0,
                        tensor: Tensor::from_vec(&[n], flat.clone())?,
                    });
                }
            }
            recvs.push((key(theirs[q % theirs.len()], me, p), p));
        }
        Ok((sends, recvs))
    }

    /// Hands over partner stage `from`'s tied-use gradients for `stage`'s coming update.
    ///
    /// # Errors
    /// A stage this worker does not hold.
    pub fn deliver_tied(&mut self, stage: u32, from: u32, tensor: Tensor) -> Result<()> {
        let c = self.chunk(stage)?;
        self.stages[c].tied_received.insert(from, tensor);
        Ok(())
    }

    /// Ends the run: moves the final weights and optimizer state back into `state`, in host
    /// memory (a device backend's tensors are copied out), where checkpoints, evaluation and
    /// the next segment read them.
    ///
    /// # Errors
    /// Microbatches left unfinished, the current version lost, or a device that fails the copy.
    pub fn finish(mut self, be: &dyn Backend, state: &mut WorkerState) -> Result<WorkerOutcome> {
        self.settle_losses(be)?;
        let mut ended = Vec::with_capacity(self.stages.len());
        for run in self.stages {
            if !run.forward_saved.is_empty()
                || !run.weight_pending.is_empty()
                || !run.outbox_activations.is_empty()
                || !run.outbox_gradients.is_empty()
            {
                return Err(exec_err(format!(
                    "stage {} ended with unfinished microbatches",
                    run.stage
                )));
            }
            let mut versions = run.versions;
            let params = versions
                .remove(&run.current_version)
                .ok_or_else(|| exec_err("current version lost".into()))?;
            ended.push(StageState {
                stage: run.stage,
                params: crate::model::host_params(be, params)?,
                opt: run.optimizer.on_host(be)?,
            });
        }
        state.stages = ended;
        Ok(self.outcome)
    }
}

/// The key of the data message that a send or receive action of `worker` moves (an
/// activation to the next stage, a gradient to the one before); `None` for any other action.
/// A producing stage names the message: the sender's for an activation and for a gradient.
pub fn data_key(worker: WorkerId, a: Action) -> Option<Key> {
    let key = |from, to, kind, stage, mb| Key {
        from,
        to,
        kind,
        stage,
        index: mb,
        step: 0,
    };
    match a {
        Action::SendActivation { stage, mb, to } => {
            Some(key(worker, to, Kind::Activation, stage, mb))
        }
        Action::SendGradient { stage, mb, to } => Some(key(worker, to, Kind::Gradient, stage, mb)),
        Action::RecvActivation { stage, mb, from } => Some(key(
            from,
            worker,
            Kind::Activation,
            stage.wrapping_sub(1),
            mb,
        )),
        Action::RecvGradient { stage, mb, from } => {
            Some(key(from, worker, Kind::Gradient, stage + 1, mb))
        }
        _ => None,
    }
}

/// The [`Key::step`] of a tied-gradient message (ring steps of all-reduce chunks, which share
/// the kind, stay far below it).
pub const TIED_GRADIENT_STEP: u32 = u32::MAX;

/// What [`WorkerCore::tie_exchange`] returns: the messages to send, and the keys to receive with
/// the stage each comes from.
pub type TieExchange = (Vec<Message>, Vec<(Key, u32)>);

/// Sums each tied parameter's uses across `run` and the partner stages whose gradients it
/// received, exactly as the reference trainer sums a tie group's stages
/// ([`crate::model::Model::sum_tied`] over every stage's part), so every copy applies the
/// same bits.
fn sum_tied_across(setup: &Setup<'_>, be: &dyn Backend, run: &mut StageRun) -> Result<()> {
    let model = setup.model;
    let ranges = setup.plan.partition.ranges();
    let mut remote: Vec<(usize, Params)> = Vec::with_capacity(run.tie_partners.len());
    for &p in &run.tie_partners {
        let flat = run.tied_received.remove(&p).ok_or_else(|| {
            exec_err(format!(
                "stage {} updates without stage {p}'s tied gradients",
                run.stage
            ))
        })?;
        let flat = be.read(&flat)?;
        let theirs = ranges[p as usize].clone();
        let mut part: Params = theirs
            .clone()
            .map(|l| vec![Tensor::default(); model.layer(l).param_shapes().len()])
            .collect();
        let mut at = 0;
        for (layer, slot) in model.tied_uses_shared(theirs.clone(), run.layers.clone()) {
            let shape = model.param_table()[model.param_id(layer, slot)]
                .shape
                .clone();
            let n: usize = shape.iter().product();
            let values = flat
                .get(at..at + n)
                .ok_or_else(|| exec_err(format!("stage {p}'s tied gradients are too short")))?;
            part[layer - theirs.start][slot] =
                be.place(Tensor::from_vec(&shape, values.to_vec())?)?;
            at += n;
        }
        if at != flat.len() {
            return Err(exec_err(format!("stage {p}'s tied gradients are too long")));
        }
        remote.push((theirs.start, part));
    }
    let mut parts: Vec<(usize, &mut Params)> = vec![(run.layers.start, &mut run.grads)];
    parts.extend(remote.iter_mut().map(|(start, p)| (*start, p)));
    model.sum_tied(be, &mut parts)
}

fn zero(be: &dyn Backend, p: &mut Params) -> Result<()> {
    for g in p.iter_mut().flatten() {
        be.fill(0.0, g)?;
    }
    Ok(())
}
