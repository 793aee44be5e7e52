//! Survivors of a lost worker process that go on where they stood (docs/reliability.md,
//! "Recovery where the survivors stood").
//!
//! The takeover of [`super::takeover`] stops every survivor's program and resumes it at its
//! latest step boundary: every stage runs its update in flight again, and the pipeline fills
//! again behind it. Here a survivor's program does not stop. Its endpoint is a
//! [`Recovering`]: when a call fails on the loss (the lost peer's link, or a peer's abort
//! that tells of it), the endpoint itself asks the launcher, regroups the mesh, settles the
//! takeover with the adopter ([`super::takeover::settle`], the same exchange), hands over
//! what its log holds that another program reads ([`GoesOn::WhereItStood`]), and answers the
//! call again on the new mesh. The program's state, its activations and stashed versions
//! included, is untouched, so its work since the boundary is not done again. Only the lost
//! worker's program runs again from its stage's boundary, on the adopter, as before.
//!
//! Why no message is missing or read twice: every message a survivor reads from where it
//! stood is either one it has not yet been sent (its sender's program sends it later, the
//! lost one's from its resumed boundary), or one its sender's log holds (a survivor's log
//! keeps what it sent since its earliest kept boundary, a send that failed on the loss
//! included: the log takes a copy before the send), which the sender hands over. Keys are
//! unique within a segment and the regrouped mesh holds nothing sent before, so a copy of a
//! message a survivor has already read stays unread and goes with the segment.
//!
//! Where the run cannot go on this way (a replacement comes and every program must end at
//! the update in flight, or the takeover cannot be planned), the recovery stops where it got
//! to ([`Pending`]) and the program fails as before: the worker then goes on from there at
//! its boundary or from the segment's start (`worker.rs`'s `after_failure`), without asking
//! the launcher or meshing twice.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use pipe_transport::registration::Endpoint;
use pipe_transport::{
    Interrupter, Key, Kind, Message, Transport, TransportError, ValueSink, Values,
};

use super::adopt::{GoesOn, Logging, Serving, SharedTraffic};
use super::exec::WorkerState;
use super::processes::RecordWriter;
use super::recover::{LAUNCHER_WORD_WAIT, LostPeer, RemeshHandle, Remeshed};
use super::resume::Resume;
use super::rollback::Points;
use super::run_plan::RunPlan;
use super::survive::LayoutChange;
use crate::config::RunConfig;
use crate::error::{Result, StageError};
use crate::train::RecoveryPhase;

/// The lost worker's program, resumed at its stage's boundary, for the adopter to run beside
/// its own on the lost rank's endpoint.
pub struct AdoptJob {
    /// The lost rank's endpoint, hosted by the adopter.
    pub hosted: Endpoint,
    /// Its resumed program and the older versions it reads.
    pub resume: Resume,
    /// Its stage's state at the boundary.
    pub state: WorkerState,
    /// The messages it reads that its adopter's log held, served from memory
    /// ([`super::takeover::HandOver::hosted`]).
    pub kept: HashMap<Key, Message>,
}

/// How far a recovery where the survivors stood got before it could not go on: what the
/// recovery at the boundary starts from.
#[derive(Default)]
pub struct Pending {
    /// The launcher's word (`None`: it said nothing, and the run does not go on).
    pub word: Option<LostPeer>,
    /// The mesh without the lost rank, once connected.
    pub meshed: Option<Remeshed>,
    /// The takeover exchange has run and found no plan: the run goes back.
    pub unplanned: bool,
}

/// A segment taken over with the survivors where they stood.
pub struct Recovered {
    /// The lost worker.
    pub lost: u32,
    /// The layout change, made at the segment's end.
    pub change: LayoutChange,
}

/// The word from a worker's endpoint to its loss relay that its program went on where it
/// stood on a new mesh: the lost worker's rank, taken once.
#[derive(Clone, Debug, Default)]
pub struct MovedOn(Arc<Mutex<Option<u32>>>);

impl MovedOn {
    fn set(&self, lost: u32) {
        if let Ok(mut m) = self.0.lock() {
            *m = Some(lost);
        }
    }

    /// The lost worker's rank, once, after the program went on.
    pub fn take(&self) -> Option<u32> {
        self.0.lock().ok().and_then(|mut m| m.take())
    }
}

/// What became of a [`Recovering`] endpoint's recovery.
#[derive(Default)]
pub enum Outcome {
    /// Nothing was lost, or the failure was not one the run goes on after.
    #[default]
    Untouched,
    /// It stopped part way ([`Pending`]).
    Pending(Pending),
    /// The segment was taken over, and the program went on.
    Recovered(Recovered),
    /// The recovery itself failed: this is the worker's failure.
    Failed(StageError),
}

/// What a survivor's recovery where it stood reads and where it leaves its results.
pub struct InPlace<'a> {
    /// The segment's plan, its run's settings, its first step and number.
    pub plan: &'a RunPlan,
    /// The run's settings.
    pub cfg: &'a RunConfig,
    /// Steps done before the segment, and the segment's number.
    pub at: (u64, u32),
    /// The way to the launcher.
    pub remesh: RemeshHandle,
    /// This worker's rollback points and traffic log.
    pub points: Arc<Mutex<Points>>,
    /// This worker's traffic log.
    pub traffic: SharedTraffic,
    /// This worker's state at the segment's start, where it may adopt a lost replica (its
    /// program resumed at the segment's start, or reading the version there, needs it).
    pub start: Option<WorkerState>,
    /// Where the lost program goes to run beside this worker's own.
    pub adopt: Option<crossbeam_channel::Sender<AdoptJob>>,
    /// Told once the program goes on: its loss relay sends its reports again.
    pub moved: MovedOn,
    /// What became of it.
    pub outcome: Outcome,
}

/// The mesh a program goes on over after a loss, and the kept messages it reads from it.
type GoingOn = (Box<dyn Transport>, HashMap<Key, Message>);

/// Whether a call that failed with `e` failed on a lost peer (or on a peer's word of one),
/// which the run may go on after; anything else is the worker's own failure.
fn on_a_loss(e: &TransportError) -> bool {
    matches!(
        e,
        TransportError::Closed { .. }
            | TransportError::Lost { .. }
            | TransportError::Aborted { .. }
            | TransportError::Timeout { .. }
            | TransportError::Send { .. }
    )
}

fn poisoned(what: &str) -> StageError {
    StageError::Executor(format!("{what} was left poisoned"))
}

impl InPlace<'_> {
    /// After a call on `old` failed with `e`: the new mesh and the kept messages this
    /// worker's program reads from it, or `None` where the program is to fail as before
    /// ([`Outcome::Pending`] says how far it got).
    ///
    /// # Errors
    /// A mesh, settlement or hand-over that failed: the worker's failure.
    fn recover(&mut self, e: &TransportError, old: &mut dyn Transport) -> Result<Option<GoingOn>> {
        let (plan, (done, index)) = (self.plan, self.at);
        if !matches!(e, TransportError::Aborted { .. }) {
            old.abort();
        }
        let handle = self.remesh.clone();
        let mut remesh = handle
            .0
            .lock()
            .map_err(|_| poisoned("the way to the launcher"))?;
        // A launcher gone cannot be told, nor one that names no loss: the failure is then the
        // program's own.
        let word = match RecordWriter::recovery(RecoveryPhase::Stopped) {
            Ok(()) => remesh.lost(LAUNCHER_WORD_WAIT),
            Err(_) => None,
        };
        let Some(word) = word else {
            self.outcome = Outcome::Pending(Pending::default());
            return Ok(None);
        };
        let lost = word.rank;
        let change = LayoutChange::without(self.cfg, lost, word.how.clone(), done);
        let (Some(change), false) = (change, word.replaced) else {
            self.outcome = Outcome::Pending(Pending {
                word: Some(word),
                ..Pending::default()
            });
            return Ok(None);
        };
        let me = old.rank();
        let adopter = super::adopt::adopter_of(plan, lost).ok();
        let host = adopter == Some(me);
        let meshed = remesh.connect_without(old, lost, (adopter, host))?;
        drop(remesh);
        RecordWriter::recovery(RecoveryPhase::Meshed)?;
        if !meshed.lost_hosted {
            self.outcome = Outcome::Pending(Pending {
                word: Some(word),
                meshed: Some(meshed),
                unplanned: false,
            });
            return Ok(None);
        }
        let Remeshed {
            mut ep,
            hosted,
            lost_hosted,
        } = meshed;
        let own = self.points.clone();
        let mut points = own.lock().map_err(|_| poisoned("a rollback point"))?;
        let latest = points.latest();
        let held = self
            .traffic
            .lock()
            .map_err(|_| poisoned("a traffic log"))?
            .held(latest);
        let adopting = match (host, &self.start) {
            (true, Some(start)) => Some((&*points, start)),
            _ => None,
        };
        let planned =
            super::takeover::settle(ep.as_mut(), (plan, index), lost, Some(held), adopting)?;
        let Some(planned) = planned else {
            drop(points);
            self.outcome = Outcome::Pending(Pending {
                word: Some(word),
                meshed: Some(Remeshed {
                    ep,
                    hosted,
                    lost_hosted,
                }),
                unplanned: true,
            });
            return Ok(None);
        };
        RecordWriter::recovery(RecoveryPhase::Planned)?;
        let versions = &planned.versions;
        let ends_at = super::adopt::takeover_ends_at(plan, versions, false);
        let in_flight = super::adopt::update_in_flight(plan, versions);
        let traffic = self.traffic.clone();
        let mut log = traffic.lock().map_err(|_| poisoned("a traffic log"))?;
        let goes_on = (plan, GoesOn::WhereItStood);
        let beside = hosted.is_some().then_some((lost, self.cfg.wire));
        let logged = (&mut *log, latest);
        let hand = super::takeover::to_hand_over(me, goes_on, &planned, logged, beside)?;
        if let Some(hosted) = hosted {
            let version = versions.get(lost as usize).copied().unwrap_or(0);
            let lost_part = (hosted, lost, version, hand.hosted);
            let ending = (ends_at, &planned.lost_delivered);
            self.adopt_lost(lost_part, (&mut points, ending))?;
        }
        drop(points);
        super::takeover::send_all(ep.as_mut(), hand.send)?;
        let kept = log.take_received();
        drop(log);
        self.moved.set(lost);
        RecordWriter::recovery(RecoveryPhase::Restarted)?;
        self.outcome = Outcome::Recovered(Recovered {
            lost,
            change: change.taken_over_where_they_stood(ends_at, in_flight),
        });
        Ok(Some((ep, kept)))
    }

    /// Hands the lost program, resumed at `version` and ending at step `ends_at`, with the
    /// messages this worker's log `kept` for it, to the thread that runs it beside this
    /// worker's own; it replays late the microbatches whose messages their receivers hold
    /// (`delivered`). Its states are moved out of this worker's `points`, not copied: this
    /// worker's program went on where it stood, so no recovery of this segment reads them
    /// again.
    fn adopt_lost(
        &mut self,
        (hosted, lost, version, kept): (Endpoint, u32, u32, HashMap<Key, Message>),
        (points, (ends_at, delivered)): (&mut Points, (u64, &HashSet<Key>)),
    ) -> Result<()> {
        let start = self
            .start
            .as_ref()
            .ok_or_else(|| StageError::Executor("an adopter without its start".into()))?;
        let (mut resume, state) =
            super::adopt::resume_taking(self.plan, lost, version, (points, start))?;
        super::adopt::end_at_step(self.plan, lost, &mut resume, ends_at)?;
        super::adopt::deferring_delivered(self.plan, lost, &mut resume, delivered);
        let job = AdoptJob {
            hosted,
            resume,
            state,
            kept,
        };
        self.adopt
            .take()
            .and_then(|tx| tx.send(job).ok())
            .ok_or_else(|| StageError::Executor("the adopted program's thread is gone".into()))
    }
}

/// A survivor's endpoint for a segment that may go on where it stands after a loss: its
/// traffic logged, and on a loss regrouped under its program ([`InPlace`]), once.
pub struct Recovering<'a, E> {
    logging: Logging<E>,
    renewed: Option<Serving<Box<dyn Transport>>>,
    in_place: InPlace<'a>,
}

impl<'a, E: Transport> Recovering<'a, E> {
    /// `logging`, going on in place with `in_place` after a loss.
    pub fn new(logging: Logging<E>, in_place: InPlace<'a>) -> Self {
        Recovering {
            logging,
            renewed: None,
            in_place,
        }
    }

    /// The mesh it went on over (if it did) and what became of its recovery.
    pub fn into_parts(self) -> (Option<Box<dyn Transport>>, InPlace<'a>) {
        (self.renewed.map(Serving::into_inner), self.in_place)
    }

    fn active(&mut self) -> &mut dyn Transport {
        match &mut self.renewed {
            Some(ep) => ep,
            None => &mut self.logging,
        }
    }

    fn active_ref(&self) -> &dyn Transport {
        match &self.renewed {
            Some(ep) => ep,
            None => &self.logging,
        }
    }

    /// After a call failed with `e`: `Ok` once the program can go on over the new mesh, else
    /// `e` back.
    fn goes_on_after(&mut self, e: TransportError) -> std::result::Result<(), TransportError> {
        // Once only: a recovery that went on, stopped part way or failed is not tried again.
        let untouched = matches!(self.in_place.outcome, Outcome::Untouched);
        if !untouched || !on_a_loss(&e) {
            return Err(e);
        }
        match self.in_place.recover(&e, self.logging.inner_mut()) {
            Ok(Some((ep, kept))) => {
                self.renewed = Some(Serving::new(ep, kept));
                Ok(())
            }
            Ok(None) => Err(e),
            Err(failure) => {
                self.in_place.outcome = Outcome::Failed(failure);
                Err(e)
            }
        }
    }

    /// `call` on the active endpoint, once more on the new mesh after a loss gone on from.
    fn again<R>(
        &mut self,
        mut call: impl FnMut(&mut dyn Transport) -> std::result::Result<R, TransportError>,
    ) -> std::result::Result<R, TransportError> {
        match call(self.active()) {
            Err(e) => {
                self.goes_on_after(e)?;
                call(self.active())
            }
            ok => ok,
        }
    }

    /// [`Recovering::again`] for a call that does not wait, for `key`: a loss report's, whose
    /// numbering changes with the mesh, is not asked again on the new mesh (its loss relay
    /// asks anew once it has heard, [`MovedOn`]).
    fn again_unless_control<R>(
        &mut self,
        key: &Key,
        mut call: impl FnMut(&mut dyn Transport) -> std::result::Result<Option<R>, TransportError>,
    ) -> std::result::Result<Option<R>, TransportError> {
        match call(self.active()) {
            Err(e) => {
                self.goes_on_after(e)?;
                if key.kind == Kind::Control {
                    return Ok(None);
                }
                call(self.active())
            }
            ok => ok,
        }
    }

    /// A send: one that failed on the loss is not sent again, as its copy in the log is
    /// handed over (a data message) or its loss relay sends it again (a loss report).
    fn sent(
        &mut self,
        r: std::result::Result<(), TransportError>,
    ) -> std::result::Result<(), TransportError> {
        match r {
            Err(e) => self.goes_on_after(e),
            ok => ok,
        }
    }
}

/// A payload's values handed to `take` once each. A sender lost part way through a payload
/// leaves its first `taken` values handed over already (a transport that lends a payload as it
/// arrives, [`Transport::recv_with`]); the same payload from the new mesh (the lost program's
/// again, or its copy handed over) starts from its first value, and a sink that adds what it
/// is handed (an all-reduce's reduce-scatter) must not see those again. A payload's blocks
/// come in the order of their offsets.
struct TakenOnce<'s, 't> {
    take: &'s mut ValueSink<'t>,
    /// Values handed over so far, from the payload's start.
    taken: usize,
}

impl TakenOnce<'_, '_> {
    /// Hands on the values of `block`, at offset `at`, that `take` has not had.
    fn hand(&mut self, at: usize, block: &[f32]) {
        let skip = self.taken.saturating_sub(at).min(block.len());
        if skip < block.len() {
            (self.take)(at + skip, &block[skip..]);
        }
        self.taken = self.taken.max(at + block.len());
    }
}

impl<E: Transport> Transport for Recovering<'_, E> {
    fn rank(&self) -> u32 {
        self.active_ref().rank()
    }
    fn size(&self) -> u32 {
        self.active_ref().size()
    }
    fn copies_payloads(&self) -> bool {
        self.active_ref().copies_payloads()
    }
    fn link_buffer_bytes(&self) -> Option<u64> {
        self.active_ref().link_buffer_bytes()
    }
    fn send_values(&mut self, values: Values<'_>) -> std::result::Result<(), TransportError> {
        let r = self.active().send_values(values);
        self.sent(r)
    }
    fn recv_with(
        &mut self,
        key: &Key,
        take: &mut ValueSink<'_>,
    ) -> std::result::Result<usize, TransportError> {
        let mut once = TakenOnce { take, taken: 0 };
        self.again(|t| t.recv_with(key, &mut |at, block| once.hand(at, block)))
    }
    fn try_recv_with(
        &mut self,
        key: &Key,
        take: &mut ValueSink<'_>,
    ) -> std::result::Result<Option<usize>, TransportError> {
        let mut once = TakenOnce { take, taken: 0 };
        self.again_unless_control(key, |t| {
            t.try_recv_with(key, &mut |at, block| once.hand(at, block))
        })
    }
    fn send(&mut self, m: Message) -> std::result::Result<(), TransportError> {
        let r = self.active().send(m);
        self.sent(r)
    }
    fn recv(&mut self, key: &Key) -> std::result::Result<Message, TransportError> {
        self.again(|t| t.recv(key))
    }
    fn wait_for(
        &mut self,
        key: &Key,
        notice: &dyn Fn(&Key) -> bool,
    ) -> std::result::Result<bool, TransportError> {
        self.again(|t| t.wait_for(key, notice))
    }
    fn try_recv(&mut self, key: &Key) -> std::result::Result<Option<Message>, TransportError> {
        self.again_unless_control(key, |t| t.try_recv(key))
    }
    fn buffered(&self) -> usize {
        self.active_ref().buffered()
    }
    fn abort(&mut self) {
        self.active().abort()
    }
    fn close(&mut self) -> std::result::Result<(), TransportError> {
        self.active().close()
    }
    fn interrupter(&self) -> Option<Interrupter> {
        self.active_ref().interrupter()
    }
    fn carries_device_tensors(&self) -> bool {
        self.active_ref().carries_device_tensors()
    }
    /// A loss is gone on from through the payloads its peers kept: none is lent, before a
    /// regroup or after it.
    fn lends_device_buffers(&self, _: u32) -> bool {
        false
    }
    fn cut_link(&mut self, peer: u32, pause: std::time::Duration) -> Result<(), TransportError> {
        self.active().cut_link(peer, pause)
    }
    // No regroup through it: a loss regroups this endpoint's mesh itself, under its program
    // (`InPlace`), once.
    pipe_transport::refuse_regroup!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_cut_short_and_received_again_is_handed_over_once() {
        let mut sum = [0.0f32; 6];
        let mut take = |at: usize, block: &[f32]| {
            for (s, v) in sum[at..at + block.len()].iter_mut().zip(block) {
                *s += v;
            }
        };
        let mut once = TakenOnce {
            take: &mut take,
            taken: 0,
        };
        let payload = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        // The first four values lent as they arrived, then the sender was lost.
        once.hand(0, &payload[..2]);
        once.hand(2, &payload[2..4]);
        // The same payload from the new mesh, whole, then in other pieces.
        once.hand(0, &payload);
        once.hand(0, &payload[..3]);
        once.hand(3, &payload[3..]);
        assert_eq!(sum, payload);
    }
}
