//! A worker resumed at a step boundary of its segment (`pipeline::resume`), from what its
//! stage's other replica kept there, ends the segment as the worker that ran it whole: the
//! same weights and optimizer state, bit for bit, and the same messages. This is what lets a
//! surviving replica take over a lost worker's program without the rest of the run going
//! back.
//!
//! Each case runs a segment on in-process workers, recording every message each worker sends
//! and receives, with every worker keeping its stage's state at each step boundary. Then, for
//! every step boundary of a replicated stage's worker, it resumes that worker alone: its
//! state and stashed versions come from its replica's kept points, its incoming messages are
//! served from the record, and what it sends is compared with what the worker sent.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use common::{bits, even, opt};
use pipe_kernels::CpuBackend;
use pipe_scheduler::{ActionKind, Length, Policy, ScheduleSpec};
use pipe_stages::model::{Model, ModelSpec, Params};
use pipe_stages::pipeline::resume::{Resume, resume_point, stash_of};
use pipe_stages::pipeline::rollback::Points;
use pipe_stages::pipeline::{
    OrderedSource, RunPlan, Setup, WorkerState, resume_worker, run_threads,
};
use pipe_transport::inproc::{InProc, InProcOptions, mesh};
use pipe_transport::{Interrupter, Key, Message, Transport, TransportError};

const SEED: u64 = 5;

/// A message as recorded: its key, version (tag) and tensor.
#[derive(Clone, Debug)]
struct Seen {
    key: Key,
    version: u64,
    tensor: pipe_kernels::Tensor,
}

impl Seen {
    fn of(m: &Message) -> Seen {
        Seen {
            key: m.key,
            version: m.version,
            tensor: m.tensor.clone(),
        }
    }

    fn message(&self) -> Message {
        Message {
            key: self.key,
            version: self.version,
            tensor: self.tensor.clone(),
        }
    }

    /// Key, tag, shape and every value's bits.
    fn same(&self, other: &Seen) -> bool {
        let values = |t: &pipe_kernels::Tensor| -> Vec<u32> {
            t.host().unwrap().iter().map(|x| x.to_bits()).collect()
        };
        self.key == other.key
            && self.version == other.version
            && self.tensor.shape() == other.tensor.shape()
            && values(&self.tensor) == values(&other.tensor)
    }
}

/// What one worker sent and received, in order.
#[derive(Default, Debug)]
struct Record {
    sent: Vec<Seen>,
    received: Vec<Seen>,
}

/// An in-process endpoint that records its worker's traffic.
struct Recording {
    inner: InProc,
    record: Arc<Mutex<Record>>,
}

impl Transport for Recording {
    fn rank(&self) -> u32 {
        self.inner.rank()
    }
    fn size(&self) -> u32 {
        self.inner.size()
    }
    fn send(&mut self, m: Message) -> Result<(), TransportError> {
        self.record.lock().unwrap().sent.push(Seen::of(&m));
        self.inner.send(m)
    }
    fn recv(&mut self, key: &Key) -> Result<Message, TransportError> {
        let m = self.inner.recv(key)?;
        self.record.lock().unwrap().received.push(Seen::of(&m));
        Ok(m)
    }
    fn try_recv(&mut self, key: &Key) -> Result<Option<Message>, TransportError> {
        let m = self.inner.try_recv(key)?;
        if let Some(m) = &m {
            self.record.lock().unwrap().received.push(Seen::of(m));
        }
        Ok(m)
    }
    fn buffered(&self) -> usize {
        self.inner.buffered()
    }
    fn abort(&mut self) {
        self.inner.abort()
    }
    fn close(&mut self) -> Result<(), TransportError> {
        self.inner.close()
    }
    fn interrupter(&self) -> Option<Interrupter> {
        None
    }
    fn carries_device_tensors(&self) -> bool {
        false
    }
    fn lends_device_buffers(&self, _: u32) -> bool {
        false
    }
    fn copies_payloads(&self) -> bool {
        false
    }
    fn link_buffer_bytes(&self) -> Option<u64> {
        None
    }
    pipe_transport::refuse_regroup!();
    pipe_transport::no_network_links!();
}

/// A resumed worker's endpoint: every message its worker received in the recorded run,
/// served by key; what it sends is kept.
struct Served {
    rank: u32,
    size: u32,
    waiting: HashMap<Key, VecDeque<Seen>>,
    sent: Vec<Seen>,
}

impl Transport for Served {
    fn rank(&self) -> u32 {
        self.rank
    }
    fn size(&self) -> u32 {
        self.size
    }
    fn send(&mut self, m: Message) -> Result<(), TransportError> {
        self.sent.push(Seen::of(&m));
        Ok(())
    }
    fn recv(&mut self, key: &Key) -> Result<Message, TransportError> {
        self.try_recv(key)?
            .ok_or_else(|| TransportError::Protocol(format!("{key:?} was never received")))
    }
    fn try_recv(&mut self, key: &Key) -> Result<Option<Message>, TransportError> {
        Ok(self
            .waiting
            .get_mut(key)
            .and_then(VecDeque::pop_front)
            .map(|s| s.message()))
    }
    fn buffered(&self) -> usize {
        0
    }
    fn abort(&mut self) {}
    fn close(&mut self) -> Result<(), TransportError> {
        Ok(())
    }
    fn interrupter(&self) -> Option<Interrupter> {
        None
    }
    fn carries_device_tensors(&self) -> bool {
        false
    }
    fn lends_device_buffers(&self, _: u32) -> bool {
        false
    }
    fn copies_payloads(&self) -> bool {
        false
    }
    fn link_buffer_bytes(&self) -> Option<u64> {
        None
    }
    pipe_transport::refuse_regroup!();
    pipe_transport::no_network_links!();
}

/// The optimizer state's values in words, without the tensors' allocation stamps.
fn unstamped(opt: &impl std::fmt::Debug) -> String {
    let words = format!("{opt:?}");
    let mut out = String::with_capacity(words.len());
    let mut rest = words.as_str();
    while let Some(at) = rest.find("stamp: ") {
        out.push_str(&rest[..at]);
        rest = rest[at + 7..].trim_start_matches(|c: char| c.is_ascii_digit());
    }
    out.push_str(rest);
    out
}

/// Messages as sorted (key, tag, bits) triples.
fn canonical(ms: &[Seen]) -> Vec<(String, u64, Vec<u32>)> {
    let mut out: Vec<_> = ms
        .iter()
        .map(|m| {
            let bits = m
                .tensor
                .host()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect();
            (format!("{:?}", m.key), m.version, bits)
        })
        .collect();
    out.sort();
    out
}

fn lr(_stage: u32, k: u32) -> f32 {
    0.05 / (1.0 + 0.01 * k as f32)
}

/// A segment run whole: every worker's state at its start and end, the steps each kept, and
/// what each sent and received.
struct Recorded {
    start: Vec<WorkerState>,
    end: Vec<WorkerState>,
    points: Vec<Arc<Mutex<Points>>>,
    records: Vec<Arc<Mutex<Record>>>,
}

/// Runs `setup`'s segment on in-process workers, each keeping every step boundary and
/// recording its traffic.
fn run_recorded(setup: &Setup<'_>, init: &Params) -> Recorded {
    let workers = setup.plan.schedule.workers();
    let start = common::worker_states(setup, init, opt());
    let points: Vec<Arc<Mutex<Points>>> = (0..workers)
        .map(|_| Arc::new(Mutex::new(Points::new(1_000))))
        .collect();
    let mut end = start.clone();
    for (st, p) in end.iter_mut().zip(&points) {
        st.keeper = Some(p.clone());
    }
    let records: Vec<Arc<Mutex<Record>>> = (0..workers).map(|_| Arc::default()).collect();
    let eps: Vec<Recording> = mesh(workers, &InProcOptions::default())
        .into_iter()
        .zip(&records)
        .map(|(inner, record)| Recording {
            inner,
            record: record.clone(),
        })
        .collect();
    run_threads(setup, &mut end, eps, |_| CpuBackend::new(1)).unwrap();
    Recorded {
        start,
        end,
        points,
        records,
    }
}

/// Resumes worker `w` alone at `version` of its stage, with its state and stash from `peer`'s
/// kept points and its incoming messages from the record, and checks that it ends as it ran;
/// `late`: its replays moved to just before their microbatches' next actions, as for
/// receivers that hold every message they send again
/// ([`pipe_stages::pipeline::resume::ResumePoint::deferring_replays`]).
fn check_resume(
    setup: &Setup<'_>,
    run: &Recorded,
    (w, peer): (u32, u32),
    (version, late): (u32, bool),
) -> usize {
    let mut moved = 0;
    let plan = setup.plan;
    let minibatch = u64::from(plan.schedule.resolved.minibatch);
    let (stage, _) = plan.schedule.layout().placement(w);
    let update_size = u64::from(plan.schedule.resolved.update_size(stage));
    let record = run.records[w as usize].lock().unwrap();
    let peer_points = run.points[peer as usize].lock().unwrap();
    // Version v is the stage's state after v updates: the segment's start, or a kept step.
    let held = |v: u32| -> Option<Params> {
        let applied = u64::from(v) * update_size;
        if v == 0 {
            return Some(run.start[peer as usize].stages[0].params.clone());
        }
        (applied % minibatch == 0)
            .then(|| peer_points.state_at(applied / minibatch))
            .flatten()
            .map(|s| s.params)
    };
    let mut point = resume_point(&plan.schedule, &plan.versions, w, version).unwrap();
    if late {
        point.deferring_replays(&plan.versions, |_| true);
        // Every replayed forward whose microbatch replays no backward half now runs just
        // before that microbatch's first action from the boundary on.
        use pipe_scheduler::Action;
        let halves: Vec<u32> = point
            .actions
            .iter()
            .filter(|p| p.replayed_at.is_some())
            .filter(|p| p.action.kind().is_compute() && !matches!(p.action, Action::Forward { .. }))
            .filter_map(|p| p.action.microbatch())
            .collect();
        for (i, p) in point.actions.iter().enumerate() {
            let Action::Forward { mb, .. } = p.action else {
                continue;
            };
            if p.replayed_at.is_none() || halves.contains(&mb) {
                continue;
            }
            let next = point.actions[i..].iter().find(|q| q.replayed_at.is_none());
            let policy = plan.schedule.resolved.policy;
            assert!(
                next.is_some_and(|q| q.action.microbatch() == Some(mb)),
                "{policy:?} worker {w} at {version}: {p:?} not moved"
            );
        }
        // A forward from the boundary on that runs later runs just before its microbatch's
        // next action, after every action the program has between them.
        for (i, p) in point.actions.iter().enumerate() {
            let (Action::Forward { mb, .. }, Some(_)) = (p.action, p.moved_at) else {
                continue;
            };
            moved += 1;
            let next = point.actions[i + 1..]
                .iter()
                .find(|q| q.moved_at.is_none() && q.replayed_at.is_none());
            let policy = plan.schedule.resolved.policy;
            assert!(
                next.is_some_and(|q| q.action.microbatch() == Some(mb) && q.pc > p.pc),
                "{policy:?} worker {w} at {version}: {p:?} not where it belongs"
            );
        }
    }
    let stash = stash_of(&point, held).unwrap();
    let resume = Resume { point, stash };
    let step = u64::from(version) * update_size / minibatch;
    let mut state = WorkerState {
        worker: w,
        stages: vec![peer_points.state_at(step).unwrap()],
        progress: Default::default(),
        keeper: None,
    };
    let mut waiting: HashMap<Key, VecDeque<Seen>> = HashMap::new();
    for m in &record.received {
        waiting.entry(m.key).or_default().push_back(m.clone());
    }
    let mut ep = Served {
        rank: w,
        size: plan.schedule.workers(),
        waiting,
        sent: Vec::new(),
    };
    let be = CpuBackend::new(1).unwrap();
    let policy = plan.schedule.resolved.policy;
    let what = format!("{policy:?} worker {w} resumed at version {version} (late: {late})");
    let replayed = resume
        .point
        .actions
        .iter()
        .filter(|p| p.replayed_at.is_some() && p.action.kind() == ActionKind::Send)
        .count();
    resume_worker(&be, &mut ep, setup, &mut state, resume, Instant::now())
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let ran = &run.end[w as usize].stages[0];
    assert_eq!(
        bits(&state.stages[0].params),
        bits(&ran.params),
        "{what}: weights"
    );
    assert!(
        unstamped(&state.stages[0].opt) == unstamped(&ran.opt),
        "{what}: optimizer state"
    );
    // Every message it sends is one the worker sent, to the bit.
    for m in &ep.sent {
        let same = record.sent.iter().any(|o| o.same(m));
        assert!(
            same,
            "{what}: {:?} differs from what the worker sent",
            m.key
        );
    }
    // From the boundary on it sends what the worker sent then, message for message (an
    // all-reduce's chunks may leave in another order), and the replays send again what it
    // sent before (keys are unique in a segment).
    let after = ep.sent.len() - replayed;
    let tail = record.sent.len() - after;
    let before: std::collections::HashSet<Key> =
        record.sent[..tail].iter().map(|m| m.key).collect();
    let (again, from_boundary): (Vec<Seen>, Vec<Seen>) = ep
        .sent
        .iter()
        .cloned()
        .partition(|m| before.contains(&m.key));
    assert_eq!(again.len(), replayed, "{what}: the messages replayed");
    assert_eq!(
        canonical(&from_boundary),
        canonical(&record.sent[tail..]),
        "{what}: the messages from the boundary on"
    );
    moved
}

/// Runs `spec` (layers cut evenly) whole, then resumes each replicated stage's first worker at
/// every step boundary of its segment; returns the boundaries checked and the forwards from
/// the boundary on that ran later than the program has them.
fn resumes_as_it_ran(spec: &ScheduleSpec) -> (usize, usize) {
    let model = Model::new(&ModelSpec::preset("mlp-784-16x6-10").unwrap()).unwrap();
    let k = spec.resolve().unwrap().layout.stages() as usize;
    let plan = RunPlan::new(&model, spec, Some(even(model.len(), k))).unwrap();
    let source: OrderedSource<'static> = common::source(SEED, 8);
    let setup = common::setup(&model, &plan, &source, SEED, &lr);
    let run = run_recorded(&setup, &model.init_params(SEED));
    let resolved = &plan.schedule.resolved;
    let minibatch = resolved.minibatch;
    let (mut checked, mut moved) = (0, 0);
    for stage in 0..plan.schedule.stages() {
        let group: Vec<u32> = plan.schedule.layout().group(stage).collect();
        let [w, peer, ..] = group[..] else { continue };
        let update_size = resolved.update_size(stage);
        for version in 1..resolved.updates_at(stage) {
            if (version * update_size) % minibatch == 0 {
                for late in [false, true] {
                    moved += check_resume(&setup, &run, (w, peer), (version, late));
                }
                checked += 1;
            }
        }
    }
    (checked, moved)
}

fn spec(policy: Policy, replicas: &[u32]) -> ScheduleSpec {
    ScheduleSpec::new(policy, replicas.len() as u32, 2)
        .with_replicas(replicas.to_vec())
        .with_length(Length::Updates(6))
}

#[test]
fn a_worker_resumed_at_any_step_ends_as_the_worker_that_ran_its_segment_whole() {
    let mut seen = BTreeMap::new();
    let mut moved = BTreeMap::new();
    for policy in [
        Policy::Gpipe,
        Policy::OneFOneBFlush,
        Policy::ZbH1,
        Policy::PipeDream,
        Policy::PipeDreamNoStash,
        Policy::VerticalSync,
        Policy::TwoBw,
    ] {
        for replicas in [&[2, 2][..], &[1, 2, 2], &[2, 1, 1]] {
            let spec = spec(policy, replicas);
            if spec.resolve().is_err() {
                continue;
            }
            let (checked, later) = resumes_as_it_ran(&spec);
            *seen.entry(format!("{policy:?}")).or_insert(0) += checked;
            *moved.entry(format!("{policy:?}")).or_insert(0) += later;
        }
    }
    // The asynchronous policies' resumed programs run forwards from the boundary on that
    // their receivers hold later than the program has them.
    for policy in ["PipeDream", "VerticalSync", "TwoBw"] {
        assert!(
            moved.get(policy).is_some_and(|&n| n > 0),
            "{policy}: {moved:?}"
        );
    }
    for policy in [
        "Gpipe",
        "OneFOneBFlush",
        "PipeDream",
        "VerticalSync",
        "TwoBw",
    ] {
        assert!(
            seen.get(policy).is_some_and(|&n| n > 0),
            "{policy}: {seen:?}"
        );
    }
}
