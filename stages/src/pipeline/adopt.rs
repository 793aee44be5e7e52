//! A lost replica's program taken over where every worker stands, without the run going
//! back to a step every stage passed (docs/reliability.md, "A surviving replica adopts the
//! lost worker's program").
//!
//! While a segment runs, each worker keeps its stage's state at its last few step boundaries
//! ([`super::rollback::Points`]) and, through [`Logging`], copies of the messages it sent and
//! received over the same boundaries ([`Traffic`]). When a replica is lost, every worker of
//! the segment is resumed ([`super::resume`]) at *its own* latest boundary, the lost worker's
//! program included, from its stage's other replica's points ([`take_over`]):
//!
//! - a survivor loses only the work since its latest update: each stage's in-flight update
//!   runs again, and no update any stage applied is undone;
//! - the lost program resumes at the latest boundary its replica kept from which every
//!   message a survivor still waits for from it is sent again (one it sent long before and a
//!   survivor had not read yet is sent again only if the program runs its send again);
//! - every message a worker reads from its boundary on is either in its own received log, in
//!   a survivor's sent log, or sent again by the resumed program of its sender ([`Serving`]
//!   hands out the kept ones first). Arithmetic is deterministic, so a message sent again
//!   has the bits it had, and a copy that is not asked for is dropped with the segment.
//!
//! The layout does not change within the segment: the lost worker's program runs as it
//! would have, so the segment ends with the weights of a segment that lost nothing, bit for
//! bit, under every policy ([`tests`](../../tests/adopt.rs)). Where a replacement comes, every
//! program is cut at the update the segment was in ([`Takeover::cut_short`]): the segment
//! then ends with the weights of one that drained there.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use pipe_kernels::Tensor;
use pipe_scheduler::Action;
use pipe_transport::{
    Interrupter, Key, Kind, Message, Transport, TransportError, ValueSink, Values,
};

use super::exec::{StageState, WorkerState, data_key};
use super::resume::{Resume, ResumePoint, resume_point, stash_of};
use super::rollback::Points;
use super::run_plan::RunPlan;
use super::setup::Setup;
use crate::error::{Result, StageError};
use crate::model::Params;

/// The sets a takeover is planned with: every message of every worker's program from its
/// boundary on, hashed while the survivors wait on the plan, so with a hasher that is fast
/// on small integer keys (their contents come from the run's own schedule, not a peer).
type PlanSet<T> = HashSet<T, rustc_hash::FxBuildHasher>;

/// A message as kept: when (the worker's latest step boundary then) and what.
#[derive(Debug)]
struct Kept {
    step: u64,
    key: Key,
    version: u64,
    tensor: Tensor,
}

impl Kept {
    fn into_message(self) -> Message {
        Message {
            key: self.key,
            version: self.version,
            tensor: self.tensor,
        }
    }
}

/// Copies of the data messages one worker sent and received since its last few step
/// boundaries.
#[derive(Debug, Default)]
pub struct Traffic {
    /// Boundaries kept: a message older than this many boundaries before the latest is dropped.
    window: u64,
    sent: VecDeque<Kept>,
    received: VecDeque<Kept>,
    /// The buffers of copies dropped from the window, for the next copies: a run keeps a
    /// few boundaries' messages, and allocating each copy anew cost worker processes a fifth
    /// of their time in page faults.
    spare: Vec<Vec<f32>>,
    /// The length of the last message received from each (sender, kind, stage): the size a
    /// buffer is readied for before the next one arrives ([`Traffic::expected_len`]).
    last_len: HashMap<(u32, Kind, u32), usize>,
}

/// The most spare buffers a [`Traffic`] holds on to.
const SPARE_BUFFERS: usize = 64;

/// The most room a kept buffer for `len` values may have: a quarter more, or 4,096 values.
fn room_for(len: usize) -> usize {
    len.saturating_add((len / 4).max(1 << 12))
}

/// A worker's [`Traffic`], shared with the launcher that reads it after a loss.
pub type SharedTraffic = Arc<Mutex<Traffic>>;

/// Every worker's rollback points and traffic log of one segment run in process.
pub type SegmentLogs = (super::rollback::Kept, Vec<SharedTraffic>);

/// The rollback points and traffic logs of a segment of `plan` run in process (none where
/// nothing could be survived at the update), each worker's in the buffers of its `last`
/// segment's where nothing holds those any more ([`Points::reusing`], [`Traffic::reusing`]),
/// as a worker process's are: built anew, each segment freed its predecessor's copies of the
/// stages' states and messages and allocated their like again over its first steps.
pub fn segment_logs(plan: &RunPlan, last: SegmentLogs) -> SegmentLogs {
    use super::rollback::unshared;
    let (last_points, last_traffic) = last;
    let mut last_points: Vec<_> = last_points.into_iter().map(unshared).collect();
    let mut last_traffic: Vec<_> = last_traffic.into_iter().map(unshared).collect();
    let last_of = |w: u32| last_points.get_mut(w as usize).and_then(Option::take);
    let points = super::rollback::points_for(plan, last_of);
    let window = super::rollback::points_kept(plan.schedule.stages()) as u64;
    let traffic = (0..points.len())
        .map(|w| {
            let last = last_traffic.get_mut(w).and_then(Option::take);
            Arc::new(Mutex::new(Traffic::after(window, last)))
        })
        .collect();
    (points, traffic)
}

impl Traffic {
    /// Empty, keeping what was sent and received over the last `window` step boundaries.
    pub fn new(window: u64) -> Self {
        Traffic {
            window,
            ..Traffic::default()
        }
    }

    /// Empty, as [`Traffic::reusing`] `last` where there is one, else as [`Traffic::new`].
    pub fn after(window: u64, last: Option<Traffic>) -> Self {
        match last {
            Some(old) => Traffic::reusing(window, old),
            None => Traffic::new(window),
        }
    }

    /// Empty like [`Traffic::new`], with the buffers of the copies `old` (the last segment's
    /// log) held, and the lengths it last received. A segment's log holds its window's
    /// messages (tens of megabytes); built anew, each segment freed its predecessor's copies
    /// at its start and allocated their like again over its first steps, which the allocator
    /// met partly with fresh pages while it held the freed ones.
    pub fn reusing(window: u64, old: Traffic) -> Self {
        let Traffic {
            sent,
            received,
            last_len,
            ..
        } = old;
        // Not its spares, which a segment makes for itself.
        let spare = sent
            .into_iter()
            .chain(received)
            .filter_map(|k| k.tensor.into_host_vec().ok())
            .filter(|b| b.capacity() <= room_for(b.len()))
            .collect();
        Traffic {
            window,
            sent: VecDeque::new(),
            received: VecDeque::new(),
            spare,
            last_len,
        }
    }

    /// An empty buffer for a copy of `len` values: the smallest a dropped copy left that
    /// holds them with little room to spare ([`room_for`]), else a new one. (A buffer that
    /// must grow is freed and its successor's pages zeroed by the kernel, which cost worker
    /// processes more than the copies. One much larger than its copy would carry the room
    /// into every later use, and the copies it was made for would allocate anew.)
    fn buffer(&mut self, len: usize) -> Vec<f32> {
        let fit = (0..self.spare.len())
            .filter(|&i| (len..=room_for(len)).contains(&self.spare[i].capacity()))
            .min_by_key(|&i| self.spare[i].capacity());
        match fit {
            Some(i) => {
                let mut b = self.spare.swap_remove(i);
                b.clear();
                b
            }
            None => Vec::with_capacity(len),
        }
    }

    /// The length of the last message received from `key`'s sender of its kind and stage:
    /// the size to ready a buffer for before a message arrives.
    fn expected_len(&self, key: &Key) -> usize {
        let at = (key.from, key.kind, key.stage);
        self.last_len.get(&at).copied().unwrap_or(0)
    }

    fn keep(&mut self, sent: bool, step: u64, m: Message) {
        let copy = Kept {
            step,
            key: m.key,
            version: m.version,
            tensor: m.tensor,
        };
        let floor = step.saturating_sub(self.window);
        for list in [&mut self.sent, &mut self.received] {
            while list.front().is_some_and(|k| k.step < floor) {
                let old = list.pop_front().map(|k| k.tensor.into_host_vec());
                if let Some(Ok(b)) = old.filter(|_| self.spare.len() < SPARE_BUFFERS) {
                    self.spare.push(b);
                }
            }
        }
        if sent {
            self.sent.push_back(copy);
        } else {
            let at = (copy.key.from, copy.key.kind, copy.key.stage);
            self.last_len.insert(at, copy.tensor.len());
            self.received.push_back(copy);
        }
    }
}

impl Traffic {
    /// What planning a takeover reads of this log: the keys of the messages it holds, with
    /// the worker's `latest` step boundary.
    pub fn held(&self, latest: u64) -> Held {
        Held {
            latest,
            received: self.received.iter().map(|k| k.key).collect(),
            sent: self.sent.iter().map(|k| k.key).collect(),
        }
    }

    /// The messages this worker sent that `wanted` names, taken out of the log.
    pub fn take_sent(&mut self, wanted: &HashSet<Key>) -> Vec<Message> {
        let (out, kept) = std::mem::take(&mut self.sent)
            .into_iter()
            .partition(|k| wanted.contains(&k.key));
        self.sent = kept;
        out.into_iter().map(Kept::into_message).collect()
    }

    /// Every message this worker received, by key, taken out of the log.
    pub fn take_received(&mut self) -> HashMap<Key, Message> {
        let mut out = HashMap::new();
        for k in std::mem::take(&mut self.received) {
            out.entry(k.key).or_insert_with(|| k.into_message());
        }
        out
    }
}

/// What one survivor kept of a failed segment that planning its takeover reads: its latest
/// step boundary and the keys of the data messages its logs hold. Worker processes exchange
/// it; threads read it from their logs in place.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// The segment's steps the worker's stage had applied at its latest boundary.
    pub latest: u64,
    /// Keys of the messages it received over its kept boundaries.
    pub received: HashSet<Key>,
    /// Keys of the messages it sent over them.
    pub sent: HashSet<Key>,
}

fn poisoned() -> TransportError {
    TransportError::Protocol("a worker's traffic log was left poisoned".into())
}

/// An endpoint that keeps copies of the data messages its worker sends and receives in a
/// [`Traffic`], each tagged with the worker's latest step boundary ([`Points::latest`]).
pub struct Logging<T> {
    inner: T,
    traffic: SharedTraffic,
    points: Arc<Mutex<Points>>,
}

impl<T> Logging<T> {
    /// `inner`, keeping its traffic in `traffic` against the boundaries in `points`.
    pub fn new(inner: T, traffic: SharedTraffic, points: Arc<Mutex<Points>>) -> Self {
        Logging {
            inner,
            traffic,
            points,
        }
    }

    /// The endpoint it logs the traffic of.
    pub fn inner_mut(&mut self) -> &mut T {
        &mut self.inner
    }

    /// An empty buffer for a copy of `len` values, from the log's spares.
    fn buffer(&self, len: usize) -> std::result::Result<Vec<f32>, TransportError> {
        Ok(self.traffic.lock().map_err(|_| poisoned())?.buffer(len))
    }

    /// Keeps a copy of a data message, `key` at `version` of `shape` whose values are
    /// `parts` in order, in a spare buffer (a control message is not kept).
    fn keep_copy(
        &self,
        sent: bool,
        (key, version): (Key, u64),
        shape: &[usize],
        parts: &[&[f32]],
    ) -> std::result::Result<(), TransportError> {
        if key.kind == Kind::Control {
            return Ok(());
        }
        let mut b = self.buffer(parts.iter().map(|p| p.len()).sum())?;
        for part in parts {
            b.extend_from_slice(part);
        }
        let tensor = Tensor::from_vec(shape, b)
            .map_err(|e| TransportError::Protocol(format!("{key:?}: {e}")))?;
        let m = Message {
            key,
            version,
            tensor,
        };
        self.keep(sent, m)
    }

    /// Keeps a copy of `m`, sent or received.
    fn keep_message(&self, sent: bool, m: &Message) -> std::result::Result<(), TransportError> {
        if m.key.kind == Kind::Control {
            return Ok(());
        }
        let values = m
            .tensor
            .host()
            .map_err(|e| TransportError::Protocol(format!("{:?}: {e}", m.key)))?;
        self.keep_copy(sent, (m.key, m.version), m.tensor.shape(), &[values])
    }

    /// Keeps `m` (a copy the caller made, or one it no longer needs).
    fn keep(&self, sent: bool, m: Message) -> std::result::Result<(), TransportError> {
        if m.key.kind == Kind::Control {
            return Ok(());
        }
        let step = self.points.lock().map_err(|_| poisoned())?.latest();
        self.traffic
            .lock()
            .map_err(|_| poisoned())?
            .keep(sent, step, m);
        Ok(())
    }
}

/// The values handed to `take`, gathered into one tensor as the message carried them, in a
/// spare buffer of `traffic` taken once a message arrives.
fn gathered(
    (key, traffic): (Key, &SharedTraffic),
    take: &mut ValueSink<'_>,
    recv: impl FnOnce(&mut ValueSink<'_>) -> std::result::Result<Option<usize>, TransportError>,
) -> std::result::Result<Option<(usize, Message)>, TransportError> {
    let mut values: Option<Vec<f32>> = None;
    let got = recv(&mut |at, block| {
        let values = values.get_or_insert_with(|| match traffic.lock() {
            Ok(mut t) => {
                let len = t.expected_len(&key);
                t.buffer(len)
            }
            Err(_) => Vec::new(),
        });
        if values.len() < at + block.len() {
            values.resize(at + block.len(), 0.0);
        }
        values[at..at + block.len()].copy_from_slice(block);
        take(at, block);
    })?;
    let Some(n) = got else { return Ok(None) };
    let mut values = values.unwrap_or_default();
    values.resize(n, 0.0);
    // Grown block by block past the length expected, it may hold twice its values.
    if values.capacity() > room_for(n) {
        values.shrink_to_fit();
    }
    let tensor = Tensor::from_vec(&[n], values)
        .map_err(|e| TransportError::Protocol(format!("{key:?}: {e}")))?;
    let m = Message {
        key,
        version: 0,
        tensor,
    };
    Ok(Some((n, m)))
}

impl<T: Transport> Transport for Logging<T> {
    fn rank(&self) -> u32 {
        self.inner.rank()
    }
    fn size(&self) -> u32 {
        self.inner.size()
    }
    fn copies_payloads(&self) -> bool {
        self.inner.copies_payloads()
    }
    fn link_buffer_bytes(&self) -> Option<u64> {
        self.inner.link_buffer_bytes()
    }
    fn send_values(&mut self, values: Values<'_>) -> std::result::Result<(), TransportError> {
        let len = values.parts.iter().map(|p| p.len()).sum();
        self.keep_copy(true, (values.key, values.version), &[len], values.parts)?;
        self.inner.send_values(values)
    }
    fn recv_with(
        &mut self,
        key: &Key,
        take: &mut ValueSink<'_>,
    ) -> std::result::Result<usize, TransportError> {
        let inner = &mut self.inner;
        let got = gathered((*key, &self.traffic), take, |sink| {
            inner.recv_with(key, sink).map(Some)
        })?;
        let (n, m) = got.ok_or_else(|| TransportError::Protocol(format!("{key:?} lost")))?;
        self.keep(false, m)?;
        Ok(n)
    }
    fn try_recv_with(
        &mut self,
        key: &Key,
        take: &mut ValueSink<'_>,
    ) -> std::result::Result<Option<usize>, TransportError> {
        let inner = &mut self.inner;
        let got = gathered((*key, &self.traffic), take, |sink| {
            inner.try_recv_with(key, sink)
        })?;
        match got {
            Some((n, m)) => {
                self.keep(false, m)?;
                Ok(Some(n))
            }
            None => Ok(None),
        }
    }
    fn send(&mut self, m: Message) -> std::result::Result<(), TransportError> {
        self.keep_message(true, &m)?;
        self.inner.send(m)
    }
    fn recv(&mut self, key: &Key) -> std::result::Result<Message, TransportError> {
        let m = self.inner.recv(key)?;
        self.keep_message(false, &m)?;
        Ok(m)
    }
    fn wait_for(
        &mut self,
        key: &Key,
        notice: &dyn Fn(&Key) -> bool,
    ) -> std::result::Result<bool, TransportError> {
        self.inner.wait_for(key, notice)
    }
    fn try_recv(&mut self, key: &Key) -> std::result::Result<Option<Message>, TransportError> {
        let m = self.inner.try_recv(key)?;
        if let Some(m) = m.as_ref() {
            self.keep_message(false, m)?;
        }
        Ok(m)
    }
    fn buffered(&self) -> usize {
        self.inner.buffered()
    }
    fn abort(&mut self) {
        self.inner.abort()
    }
    fn close(&mut self) -> std::result::Result<(), TransportError> {
        self.inner.close()
    }
    fn interrupter(&self) -> Option<Interrupter> {
        self.inner.interrupter()
    }
    /// False: the log keeps what passes, so it must be host tensors, not device buffers a
    /// backend may reuse.
    fn carries_device_tensors(&self) -> bool {
        false
    }
    /// Its log keeps payloads; a lent buffer is not one it could hand out again.
    fn lends_device_buffers(&self, _: u32) -> bool {
        false
    }
    fn cut_link(&mut self, peer: u32, pause: std::time::Duration) -> Result<(), TransportError> {
        self.inner.cut_link(peer, pause)
    }
    // No regroup: a regrouped mesh would not keep this traffic log.
    pipe_transport::refuse_regroup!();
}

/// An endpoint of a resumed worker: the kept messages it reads from its boundary on are
/// handed out first, then what arrives.
pub struct Serving<T> {
    inner: T,
    kept: HashMap<Key, Message>,
}

impl<T> Serving<T> {
    /// `inner`, handing out `kept` first.
    pub fn new(inner: T, kept: HashMap<Key, Message>) -> Self {
        Serving { inner, kept }
    }

    /// The endpoint served from, with what was not handed out dropped.
    pub fn into_inner(self) -> T {
        self.inner
    }
}

impl<T: Transport> Transport for Serving<T> {
    fn rank(&self) -> u32 {
        self.inner.rank()
    }
    fn size(&self) -> u32 {
        self.inner.size()
    }
    fn copies_payloads(&self) -> bool {
        self.inner.copies_payloads()
    }
    fn link_buffer_bytes(&self) -> Option<u64> {
        self.inner.link_buffer_bytes()
    }
    fn send_values(&mut self, values: Values<'_>) -> std::result::Result<(), TransportError> {
        self.inner.send_values(values)
    }
    fn recv_with(
        &mut self,
        key: &Key,
        take: &mut ValueSink<'_>,
    ) -> std::result::Result<usize, TransportError> {
        match self.kept.remove(key) {
            Some(m) => m.hand_to(take),
            None => self.inner.recv_with(key, take),
        }
    }
    fn try_recv_with(
        &mut self,
        key: &Key,
        take: &mut ValueSink<'_>,
    ) -> std::result::Result<Option<usize>, TransportError> {
        match self.kept.remove(key) {
            Some(m) => m.hand_to(take).map(Some),
            None => self.inner.try_recv_with(key, take),
        }
    }
    fn send(&mut self, m: Message) -> std::result::Result<(), TransportError> {
        self.inner.send(m)
    }
    fn recv(&mut self, key: &Key) -> std::result::Result<Message, TransportError> {
        match self.kept.remove(key) {
            Some(m) => Ok(m),
            None => self.inner.recv(key),
        }
    }
    fn wait_for(
        &mut self,
        key: &Key,
        notice: &dyn Fn(&Key) -> bool,
    ) -> std::result::Result<bool, TransportError> {
        if self.kept.contains_key(key) {
            return Ok(true);
        }
        self.inner.wait_for(key, notice)
    }
    fn try_recv(&mut self, key: &Key) -> std::result::Result<Option<Message>, TransportError> {
        match self.kept.remove(key) {
            Some(m) => Ok(Some(m)),
            None => self.inner.try_recv(key),
        }
    }
    fn buffered(&self) -> usize {
        self.inner.buffered() + self.kept.len()
    }
    fn abort(&mut self) {
        self.inner.abort()
    }
    fn close(&mut self) -> std::result::Result<(), TransportError> {
        self.inner.close()
    }
    fn interrupter(&self) -> Option<Interrupter> {
        self.inner.interrupter()
    }
    /// False: what it hands out first was kept from a log, as host tensors.
    fn carries_device_tensors(&self) -> bool {
        false
    }
    /// Its log keeps payloads; a lent buffer is not one it could hand out again.
    fn lends_device_buffers(&self, _: u32) -> bool {
        false
    }
    fn cut_link(&mut self, peer: u32, pause: std::time::Duration) -> Result<(), TransportError> {
        self.inner.cut_link(peer, pause)
    }
    // No regroup: a regrouped mesh would not hand out the messages kept here.
    pipe_transport::refuse_regroup!();
}

/// How every worker of a segment in which a replica was lost goes on.
pub struct Takeover {
    /// Each worker's state at its boundary (the lost one's from its replica).
    pub states: Vec<WorkerState>,
    /// Each worker's resumed program and the older versions it reads.
    pub resumes: Vec<Resume>,
    /// The kept messages each worker reads from its boundary on.
    pub kept: Vec<HashMap<Key, Message>>,
    /// The update the segment was in when the replica was lost ([`update_in_flight`]).
    pub in_flight: u64,
    /// The steps of the segment its programs run to: all of it, or, cut short for a
    /// replacement that comes ([`end_at_step`]), the update in flight.
    pub ends_at: u64,
}

impl Takeover {
    /// Cuts every resumed program short at the update in flight, for a replacement that
    /// comes ([`end_at_step`]).
    ///
    /// # Errors
    /// As [`end_at_step`].
    pub fn cut_short(&mut self, plan: &RunPlan) -> Result<()> {
        self.ends_at = self.in_flight.min(self.ends_at);
        for (w, resume) in self.resumes.iter_mut().enumerate() {
            end_at_step(plan, w as u32, resume, self.ends_at)?;
        }
        Ok(())
    }
}

/// The steps of a segment of `plan` that `worker` has passed when its stage is at `version`
/// (its updates in the segment).
pub fn steps_at_version(plan: &RunPlan, worker: u32, version: u32) -> u64 {
    let resolved = &plan.schedule.resolved;
    let (stage, _) = plan.schedule.layout().placement(worker);
    let applied = u64::from(version) * u64::from(resolved.update_size(stage));
    applied / u64::from(resolved.minibatch.max(1))
}

/// The update of a segment of `plan` (from 1) that its furthest stage was in when a segment
/// taken over resumes each worker at `versions`: the one after the furthest boundary. Under
/// an asynchronous policy the earlier stages stand a few updates behind; a flush schedule's
/// stages all stand at one boundary.
pub fn update_in_flight(plan: &RunPlan, versions: &[u32]) -> u64 {
    let furthest = versions
        .iter()
        .enumerate()
        .map(|(w, &v)| steps_at_version(plan, w as u32, v))
        .max()
        .unwrap_or(0);
    furthest + 1
}

/// `resume`, `worker`'s program resumed in a segment of `plan`, ending at step `steps` of the
/// segment ([`ResumePoint::ending_at`](super::resume::ResumePoint::ending_at)): a segment
/// taken over for a replacement that comes ends at the update it was in, so that the
/// replacement joins at the next update boundary rather than at the segment's end.
///
/// # Errors
/// A step that falls within an update of `worker`'s stage.
pub fn end_at_step(plan: &RunPlan, worker: u32, resume: &mut Resume, steps: u64) -> Result<()> {
    let (stage, _) = plan.schedule.layout().placement(worker);
    let end = version_at_step(plan, worker, steps)?;
    resume.point.ending_at(&plan.schedule.resolved, stage, end);
    Ok(())
}

/// `worker`'s resumed program with the replay of each microbatch in flight moved to just
/// before its first action from the boundary on, wherever its receivers' logs hold every
/// message that replay sends again (`delivered`,
/// [`super::resume::ResumePoint::deferring_replays`]).
pub fn deferring_delivered(
    plan: &RunPlan,
    worker: u32,
    resume: &mut Resume,
    delivered: &HashSet<Key>,
) {
    let held = |a: &Action| data_key(worker, *a).is_some_and(|k| delivered.contains(&k));
    resume.point.deferring_replays(&plan.versions, held);
}

/// Where a segment of `plan` taken over with every worker resumed at `versions` ends: at its
/// update in flight when it is `cut` short for a replacement that comes, else at its end.
pub fn takeover_ends_at(plan: &RunPlan, versions: &[u32], cut: bool) -> u64 {
    let len = plan.steps();
    if cut {
        update_in_flight(plan, versions).min(len)
    } else {
        len
    }
}

fn takeover_err(msg: String) -> StageError {
    StageError::Executor(format!("taking over a lost replica: {msg}"))
}

/// A worker's resumed program at the boundary where its stage has applied `version`
/// updates, with the stash from `points` (`start`: the stage's state at the segment's
/// start, version 0).
///
/// # Errors
/// A version whose state or older versions `points` no longer keeps.
pub fn resume_from(
    plan: &RunPlan,
    worker: u32,
    version: u32,
    (points, start): (&Points, &WorkerState),
) -> Result<(Resume, WorkerState)> {
    resumed_with(plan, worker, version, (PointStates::Copied(points), start))
}

/// [`resume_from`], the states moved out of `points` rather than copied
/// ([`Points::take_params_at`], [`Points::take_state_at`]): the survivors of a lost worker
/// process resume this way, every one at once on the path back to training, and so does the
/// lost program on its adopter. A version whose state was taken before is no longer kept.
///
/// # Errors
/// As [`resume_from`].
pub fn resume_taking(
    plan: &RunPlan,
    worker: u32,
    version: u32,
    (points, start): (&mut Points, &WorkerState),
) -> Result<(Resume, WorkerState)> {
    resumed_with(plan, worker, version, (PointStates::Taken(points), start))
}

/// The rollback points a resume reads its states from, past the segment's start: copied
/// ([`resume_from`]) or moved out ([`resume_taking`]).
enum PointStates<'p> {
    Copied(&'p Points),
    Taken(&'p mut Points),
}

impl PointStates<'_> {
    /// The stage's weights and optimizer state at step `step` of the segment.
    fn state(&mut self, step: u64) -> Option<StageState> {
        match self {
            PointStates::Copied(points) => points.state_at(step),
            PointStates::Taken(points) => points.take_state_at(step),
        }
    }

    /// The stage's weights alone at step `step`.
    fn params(&mut self, step: u64) -> Option<Params> {
        match self {
            PointStates::Copied(points) => points.params_at(step),
            PointStates::Taken(points) => points.take_params_at(step),
        }
    }
}

/// `worker`'s program resumed at `version`, its state and stash from `held` (from `start`,
/// copied, at the segment's start).
fn resumed_with(
    plan: &RunPlan,
    worker: u32,
    version: u32,
    (mut held, start): (PointStates<'_>, &WorkerState),
) -> Result<(Resume, WorkerState)> {
    let point = resume_point(&plan.schedule, &plan.versions, worker, version)?;
    // The older versions' weights alone: their optimizer states are not read.
    let stash = stash_of(&point, |v| match step_of_version(plan, worker, v)? {
        0 => start.stages.first().map(|s| s.params.clone()),
        step => held.params(step),
    })?;
    let state = match step_of_version(plan, worker, version) {
        Some(0) => start.stages.first().cloned(),
        Some(step) => held.state(step),
        None => None,
    };
    let state = WorkerState {
        worker,
        stages: vec![state.ok_or_else(|| {
            let (stage, _) = plan.schedule.layout().placement(worker);
            takeover_err(format!("version {version} of stage {stage} is not kept"))
        })?],
        progress: super::doctor::StopPoint::default(),
        keeper: None,
    };
    Ok((Resume { point, stash }, state))
}

/// Whether [`resume_from`] would resume `worker` at `version` from these points, without
/// copying any state.
pub fn resumable(
    plan: &RunPlan,
    worker: u32,
    version: u32,
    (points, start): (&Points, &WorkerState),
) -> bool {
    let kept = |v: u32| match step_of_version(plan, worker, v) {
        Some(0) => !start.stages.is_empty(),
        Some(step) => points.holds(step),
        None => false,
    };
    resume_point(&plan.schedule, &plan.versions, worker, version)
        .is_ok_and(|point| kept(version) && point.stash.iter().all(|&v| kept(v)))
}

/// The step boundary (minibatches into the segment) where `worker`'s stage had applied
/// `version` updates; `None` where it falls within a minibatch.
fn step_of_version(plan: &RunPlan, worker: u32, version: u32) -> Option<u64> {
    let resolved = &plan.schedule.resolved;
    let (stage, _) = plan.schedule.layout().placement(worker);
    let applied = u64::from(version) * u64::from(resolved.update_size(stage));
    let minibatch = u64::from(resolved.minibatch.max(1));
    (applied % minibatch == 0).then_some(applied / minibatch)
}

/// The version a worker's stage is at after `step` minibatches of the segment.
///
/// # Errors
/// A step that falls within an update of the worker's stage.
pub fn version_at_step(plan: &RunPlan, worker: u32, step: u64) -> Result<u32> {
    let resolved = &plan.schedule.resolved;
    let (stage, _) = plan.schedule.layout().placement(worker);
    let applied = step * u64::from(resolved.minibatch.max(1));
    let update_size = u64::from(resolved.update_size(stage).max(1));
    if applied % update_size != 0 {
        return Err(takeover_err(format!(
            "stage {stage}'s step boundary falls within an update"
        )));
    }
    u32::try_from(applied / update_size).map_err(|_| takeover_err("too many updates".into()))
}

/// Every message a worker will read from its boundary on that some other worker's resumed
/// program does not send again and no log holds: the reason a takeover cannot go on. For an
/// all-reduce, a peer of the group that does not run it again must have left its chunks in
/// a log.
fn unmet(
    plan: &RunPlan,
    resumes: &[ResumePoint],
    kept: &[PlanSet<Key>],
    sent_again: &PlanSet<Key>,
) -> Option<Key> {
    let layout = plan.schedule.layout();
    // Every (worker, stage, update) whose all-reduce runs again, and per worker the
    // (sender, stage, update) of the all-reduce chunks kept for it.
    let reduces: PlanSet<(u32, u32, u32)> = resumes
        .iter()
        .enumerate()
        .flat_map(|(w, r)| {
            r.actions.iter().filter_map(move |p| match p.action {
                Action::AllReduce { stage, update } => Some((w as u32, stage, update)),
                _ => None,
            })
        })
        .collect();
    let chunks: Vec<PlanSet<(u32, u32, u32)>> = kept
        .iter()
        .map(|k| {
            k.iter()
                .filter(|key| key.kind == Kind::Chunk)
                .map(|key| (key.from, key.stage, key.index))
                .collect()
        })
        .collect();
    resumes
        .iter()
        .zip(kept.iter().zip(&chunks))
        .enumerate()
        .find_map(|(w, (r, (k, chunks)))| {
            let w = w as u32;
            r.actions.iter().find_map(|p| match p.action {
                Action::AllReduce { stage, update } => layout
                    .group(stage)
                    .filter(|&g| g != w && !reduces.contains(&(g, stage, update)))
                    .find(|&g| !chunks.contains(&(g, stage, update)))
                    .map(|g| Key {
                        from: g,
                        to: w,
                        kind: Kind::Chunk,
                        stage,
                        index: update,
                        step: 0,
                    }),
                a => data_key(w, a)
                    .filter(|key| key.to == w)
                    .filter(|key| !k.contains(key) && !sent_again.contains(key)),
            })
        })
}

/// Why a run's segments cannot be taken over at all (`clips`: the optimizer clips gradients): a stage that updates within a step (an
/// asynchronous policy on replica counts that differ), whose versions between boundaries no
/// point keeps, or exchanges between stages at each update that no log keeps (gradient
/// clipping's norms, tied parameters' gradients).
pub fn refused(plan: &RunPlan, model: &crate::model::Model, clips: bool) -> Option<&'static str> {
    let resolved = &plan.schedule.resolved;
    let stages = plan.schedule.stages();
    if (0..stages).any(|s| resolved.update_size(s) != resolved.minibatch) {
        // The versions between two step boundaries are not kept.
        return Some("a stage updating more than once a step");
    }
    let ranges = plan.partition.ranges();
    let ties = (0..ranges.len()).any(|s| !model.tie_partners(ranges, s).is_empty());
    match (clips, ties) {
        (true, _) => Some("gradient clipping"),
        (_, true) => Some("parameters tied across stages"),
        _ => None,
    }
}

/// The keys `worker`'s resumed program sends from `point` on.
fn sends_of(worker: u32, point: &ResumePoint) -> impl Iterator<Item = Key> + '_ {
    point
        .actions
        .iter()
        .filter_map(move |p| data_key(worker, p.action))
        .filter(move |k| k.from == worker)
}

/// The version each worker of a segment of `plan` resumes at after worker `lost` failed,
/// from what each survivor `held` (none for the lost one) and the points of the lost
/// worker's stage's first other replica (`adopter`: its rollback points and its state at the
/// segment's start): every survivor at its latest boundary, the lost worker's program at
/// the latest boundary the adopter kept (and not past `own`, the lost worker's own latest
/// step where it is known) from which nothing a survivor waits for is missing.
///
/// # Errors
/// A lost worker with no other replica, a stage whose boundaries fall within an update, a
/// message that is no longer kept.
pub fn plan_takeover(
    plan: &RunPlan,
    (lost, own): (u32, Option<u64>),
    held: &[Option<Held>],
    adopter: (&Points, &WorkerState),
) -> Result<Vec<u32>> {
    let workers = plan.schedule.workers();
    let mut versions = vec![0u32; workers as usize];
    let mut points = Vec::with_capacity(workers as usize);
    for w in 0..workers {
        let latest = match held.get(w as usize) {
            Some(Some(h)) => h.latest,
            _ if w == lost => adopter.0.latest(),
            _ => return Err(takeover_err(format!("nothing held of worker {w}"))),
        };
        let from = if w == lost {
            adopter_of(plan, lost)?
        } else {
            w
        };
        versions[w as usize] = version_at_step(plan, from, latest)?;
        points.push(resume_point(
            &plan.schedule,
            &plan.versions,
            w,
            versions[w as usize],
        )?);
    }
    // What a log holds for each worker: its own received messages (the lost worker's are
    // gone with it), and what every survivor sent it.
    let mut available: Vec<PlanSet<Key>> = vec![PlanSet::default(); workers as usize];
    for h in held.iter().flatten() {
        for k in &h.received {
            if let Some(slot) = available.get_mut(k.to as usize) {
                slot.insert(*k);
            }
        }
        for k in &h.sent {
            if let Some(slot) = available.get_mut(k.to as usize) {
                slot.insert(*k);
            }
        }
    }
    // The lost program goes back boundary by boundary until it sends again every message a
    // survivor still waits for from it.
    let own = match own {
        Some(step) => version_at_step(plan, lost, step)?,
        None => u32::MAX,
    };
    let adopted = versions[lost as usize].min(own);
    for version in (0..=adopted).rev() {
        if !resumable(plan, lost, version, adopter) {
            break;
        }
        versions[lost as usize] = version;
        points[lost as usize] = resume_point(&plan.schedule, &plan.versions, lost, version)?;
        let sent_again: PlanSet<Key> = points
            .iter()
            .enumerate()
            .flat_map(|(w, p)| sends_of(w as u32, p))
            .collect();
        match unmet(plan, &points, &available, &sent_again) {
            None => return Ok(versions),
            Some(key) if key.from != lost => {
                return Err(takeover_err(format!("message {key:?} is no longer kept")));
            }
            Some(_) => {}
        }
    }
    Err(takeover_err(format!(
        "no boundary the lost worker's replica kept sends again what the survivors wait for from worker {lost}"
    )))
}

/// The first other replica of `lost`'s stage: the one whose points its program resumes from.
///
/// # Errors
/// A stage with no other replica.
pub fn adopter_of(plan: &RunPlan, lost: u32) -> Result<u32> {
    let layout = plan.schedule.layout();
    let (stage, _) = layout.placement(lost);
    layout
        .group(stage)
        .find(|&w| w != lost)
        .ok_or_else(|| takeover_err(format!("stage {stage} has no other replica")))
}

/// How a survivor's program goes on after a takeover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GoesOn {
    /// Resumed at its latest step boundary: it sends again what it sent from there on.
    AtBoundary,
    /// Where it stood when the loss stopped it ([`super::in_place`]): it sends nothing again,
    /// so every message its log holds that another worker reads is handed over.
    WhereItStood,
}

/// The messages of `held` (one survivor's, worker `from`) that another worker's resumed
/// program reads and `from`'s own program does not send again, as `versions` resume them and
/// `from` goes on (`goes_on`): what `from` hands over after a takeover. All-reduce chunks are
/// handed over for every all-reduce the receiver runs again and `from` does not.
///
/// # Errors
/// A version no program reaches.
pub fn handed_over(
    plan: &RunPlan,
    (from, goes_on): (u32, GoesOn),
    versions: &[u32],
    held: &Held,
) -> Result<HashSet<Key>> {
    let point = |w: u32| {
        let v = versions.get(w as usize).copied().unwrap_or(0);
        resume_point(&plan.schedule, &plan.versions, w, v)
    };
    let reduced = |p: &ResumePoint| -> PlanSet<(u32, u32)> {
        p.actions
            .iter()
            .filter_map(|a| match a.action {
                Action::AllReduce { stage, update } => Some((stage, update)),
                _ => None,
            })
            .collect()
    };
    let (again, my_reduces): (PlanSet<Key>, PlanSet<(u32, u32)>) = match goes_on {
        GoesOn::AtBoundary => {
            let mine = point(from)?;
            (sends_of(from, &mine).collect(), reduced(&mine))
        }
        GoesOn::WhereItStood => Default::default(),
    };
    let mut out = HashSet::new();
    let targets: HashSet<u32> = held.sent.iter().map(|k| k.to).collect();
    for to in targets {
        let theirs = point(to)?;
        let reads: PlanSet<Key> = theirs
            .actions
            .iter()
            .filter_map(|p| data_key(to, p.action))
            .filter(|k| k.to == to)
            .collect();
        let their_reduces = reduced(&theirs);
        out.extend(held.sent.iter().filter(|k| k.to == to).filter(|k| {
            if k.kind == Kind::Chunk {
                let at = (k.stage, k.index);
                their_reduces.contains(&at) && !my_reduces.contains(&at)
            } else {
                reads.contains(k) && !again.contains(k)
            }
        }));
    }
    Ok(out)
}

/// How a segment of `setup`'s plan goes on after worker `lost` failed, from each worker's kept
/// `points` and `traffic` and the segment's `start` states: as [`plan_takeover`] resumes
/// them, with the kept messages each reads from its boundary on. A sent copy was kept as its
/// sender handed it over, before the links (of `wire`) rounded it: it is served rounded as
/// they did, so a resumed program reads the bits the lost run's receiver read.
///
/// # Errors
/// As [`plan_takeover`]; a worker of several stages, gradient clipping or tied parameters
/// (whose exchanges are not kept).
pub fn take_over(
    setup: &Setup<'_>,
    (lost, own): (u32, Option<u64>),
    start: &[WorkerState],
    (points, traffic): (&[Arc<Mutex<Points>>], &[SharedTraffic]),
    wire: pipe_transport::frame::WireDType,
) -> Result<Takeover> {
    let clips = start
        .iter()
        .flat_map(|w| &w.stages)
        .any(|st| st.opt.optimizer().config().grad_clip.is_some());
    if let Some(what) = refused(setup.plan, setup.model, clips) {
        return Err(takeover_err(format!("not under {what}")));
    }
    let plan = setup.plan;
    let adopter = adopter_of(plan, lost)?;
    let points: Vec<_> = points
        .iter()
        .map(|p| p.lock().map_err(|_| super::rollback::poisoned()))
        .collect::<Result<_>>()?;
    let mut traffic: Vec<_> = traffic
        .iter()
        .map(|t| t.lock().map_err(|_| super::rollback::poisoned()))
        .collect::<Result<_>>()?;
    let held: Vec<Option<Held>> = (0..plan.schedule.workers())
        .map(|w| {
            let i = w as usize;
            (w != lost).then(|| traffic[i].held(points[i].latest()))
        })
        .collect();
    let at_adopter = (&*points[adopter as usize], &start[adopter as usize]);
    let versions = plan_takeover(plan, (lost, own), &held, at_adopter)?;
    let mut resumes = Vec::with_capacity(versions.len());
    let mut states = Vec::with_capacity(versions.len());
    for (w, &version) in versions.iter().enumerate() {
        let from = if w as u32 == lost { adopter } else { w as u32 };
        let at = (&*points[from as usize], &start[from as usize]);
        let (resume, state) = resume_from(plan, w as u32, version, at)?;
        resumes.push(resume);
        states.push(WorkerState {
            worker: w as u32,
            ..state
        });
    }
    // The logs are the failed segment's: they are handed over, not copied.
    let mut kept: Vec<HashMap<Key, Message>> =
        (0..versions.len()).map(|_| HashMap::new()).collect();
    for (w, t) in traffic.iter_mut().enumerate() {
        if w as u32 == lost {
            continue;
        }
        for (key, m) in t.take_received() {
            kept[w].entry(key).or_insert(m);
        }
        let all: HashSet<Key> = t.sent.iter().map(|k| k.key).collect();
        for mut m in t.take_sent(&all) {
            pipe_transport::inproc::round_as_on_the_wire(&mut m, wire);
            if let Some(slot) = kept.get_mut(m.key.to as usize) {
                slot.entry(m.key).or_insert(m);
            }
        }
    }
    Ok(Takeover {
        in_flight: update_in_flight(plan, &versions),
        ends_at: takeover_ends_at(plan, &versions, false),
        states,
        resumes,
        kept,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_segment_in_process_takes_its_logs_over_from_the_last_once_let_go() {
        use crate::model::{Model, ModelSpec};
        use crate::optim::{Corrected, NO_ROLES, OptimizerConfig};
        use pipe_scheduler::{Length, Policy, ScheduleSpec};
        let model = Model::new(&ModelSpec::preset("mlp-784-16x4-10").unwrap()).unwrap();
        let spec = ScheduleSpec::new(Policy::PipeDream, 2, 4)
            .with_replicas(vec![2, 1])
            .with_length(Length::Updates(2));
        let plan = RunPlan::new(&model, &spec, None).unwrap();
        let be = pipe_kernels::CpuBackend::new(1).unwrap();
        let params = model.init_params(7).into_iter().take(2).collect::<Vec<_>>();
        let opt = Corrected::new(OptimizerConfig::default(), &params, NO_ROLES);
        let (mut points, traffic) = segment_logs(&plan, Default::default());
        assert_eq!((points.len(), traffic.len()), (3, 3));
        // Worker 1 (stage 0's second replica) kept two step boundaries, and let them go: the
        // next segment's points take both states to write over.
        points[1] = points_with_two(&be, &params, &opt);
        let (mut next, traffic) = segment_logs(&plan, (points, traffic));
        assert_eq!(next[1].lock().unwrap().spare_states(), 2);
        assert_eq!(next[0].lock().unwrap().spare_states(), 0);
        // Still held elsewhere (a worker not yet done with them): the next segment's are new.
        next[1] = points_with_two(&be, &params, &opt);
        let held = next[1].clone();
        let (after, _) = segment_logs(&plan, (next, traffic));
        assert_eq!(after[1].lock().unwrap().spare_states(), 0);
        assert_eq!(held.lock().unwrap().latest(), 2);
    }

    fn points_with_two(
        be: &dyn pipe_kernels::Backend,
        params: &crate::model::Params,
        opt: &crate::optim::Corrected,
    ) -> Arc<Mutex<Points>> {
        use super::super::exec::{StepKeeper, WorkerOutcome};
        let mut points = Points::new(3);
        for step in 1..=2 {
            let mut outcome = WorkerOutcome::default();
            points
                .keep(step, (0, params, opt), be, &mut outcome)
                .unwrap();
        }
        Arc::new(Mutex::new(points))
    }

    fn message(index: u32, values: Vec<f32>) -> Message {
        let len = values.len();
        Message {
            key: Key {
                from: 0,
                to: 1,
                kind: Kind::Activation,
                stage: 0,
                index,
                step: 0,
            },
            version: 0,
            tensor: Tensor::from_vec(&[len], values).unwrap(),
        }
    }

    /// Where each kept copy's values live.
    fn addresses(t: &Traffic) -> Vec<*const f32> {
        let copies = t.sent.iter().chain(&t.received);
        let mut out: Vec<_> = copies.map(|k| k.tensor.host().unwrap().as_ptr()).collect();
        out.sort();
        out
    }

    #[test]
    fn a_log_reusing_the_last_ones_copies_makes_its_own_in_their_buffers() {
        let mut old = Traffic::new(2);
        for index in 0..3 {
            let b = old.buffer(50_000);
            let mut values = b;
            values.resize(50_000, index as f32);
            old.keep(true, 1, message(index, values));
        }
        // A buffer with far more room than its copy is not kept for the next log.
        let mut roomy = Vec::with_capacity(200_000);
        roomy.resize(50_000, 9.0);
        old.keep(false, 1, message(9, roomy));
        old.last_len.insert((0, Kind::Activation, 0), 50_000);
        let before = addresses(&old);
        let mut new = Traffic::reusing(2, old);
        assert_eq!(new.spare.len(), 3);
        assert_eq!(new.expected_len(&message(0, vec![0.0]).key), 50_000);
        // A copy of another size does not take a buffer too large for it.
        assert!(new.buffer(10_000).capacity() < 50_000);
        assert_eq!(new.spare.len(), 3);
        for index in 0..3 {
            let mut values = new.buffer(50_000);
            values.resize(50_000, 7.0);
            new.keep(true, 1, message(index, values));
        }
        assert!(new.spare.is_empty());
        let after = addresses(&new);
        assert!(
            after.iter().all(|a| before.contains(a)),
            "{after:?} {before:?}"
        );
    }
}
