//! Worker processes taking a lost replica's segment over where every worker stands
//! ([`super::adopt`] for threads; docs/reliability.md, "Recovery at the update").
//!
//! When a replica of a stage with another is lost, its launcher tells every survivor
//! ([`super::recover`]). The lost worker's stage's first other replica, the *adopter*, binds an
//! endpoint of the lost rank besides its own, and the survivors connect a mesh of every rank
//! of the run, the lost one's served by the adopter's process ([`super::recover::Remesh`]).
//! Over it they settle how the segment goes on ([`settle`]):
//!
//! - each survivor tells the adopter its latest step boundary and the keys of the messages
//!   its logs hold ([`Held`]); the adopter plans the takeover ([`plan_takeover`]) from them
//!   and its own rollback points, and tells every survivor the version each worker resumes
//!   at, or that the segment cannot be taken over (the run then goes back, as before);
//! - each survivor hands over the kept messages it sent that another worker's resumed program
//!   reads and its own does not send again ([`hand_over`]), and serves its own kept received
//!   ones to its resumed program;
//! - every survivor resumes its own program at its latest boundary, and the adopter runs the
//!   lost worker's program too, on a thread of its own, from its own points.
//!
//! The segment ends with the weights of a segment that lost nothing, and the layout changes at
//! its end, as with threads; where a replacement comes, every resumed program ends at the
//! update the segment was in ([`super::adopt::takeover_ends_at`]), so that the replacement
//! joins at the next update boundary. Nothing a survivor's stage applied is undone, and no
//! process starts again.

use std::collections::{HashMap, HashSet};
use std::io::Write as _;

use pipe_transport::frame::WireDType;
use pipe_transport::{Key, Kind, Message, Transport};

use super::adopt::{GoesOn, Held, Traffic, adopter_of, handed_over, plan_takeover};
use super::exec::WorkerState;
use super::fields::Fields;
use super::rollback::Points;
use super::run_plan::RunPlan;
use crate::error::{Result, StageError};

/// Control topic of the exchange that settles a takeover.
pub const TOPIC_TAKEOVER: u32 = 9;

/// The most keys one worker's [`Held`] may name: far above the messages of the few
/// boundaries a worker keeps, and a bound on what a malformed record can make a peer hold.
const MAX_HELD_KEYS: usize = 1 << 20;

fn protocol(why: String) -> StageError {
    StageError::Transport(pipe_transport::TransportError::Protocol(format!(
        "takeover exchange: {why}"
    )))
}

/// A control key of the exchange (`step` 0: a survivor's segment and [`Held`]; 1: the
/// adopter's plan).
fn key(from: u32, to: u32, step: u32) -> Key {
    Key {
        from,
        to,
        kind: Kind::Control,
        stage: TOPIC_TAKEOVER,
        index: 0,
        step,
    }
}

fn kind_code(kind: Kind) -> u32 {
    match kind {
        Kind::Activation => 0,
        Kind::Gradient => 1,
        Kind::Chunk => 2,
        Kind::Control => 3,
    }
}

fn kind_of(code: u32) -> Result<Kind> {
    Ok(match code {
        0 => Kind::Activation,
        1 => Kind::Gradient,
        2 => Kind::Chunk,
        3 => Kind::Control,
        k => return Err(protocol(format!("unknown message kind {k}"))),
    })
}

/// A survivor's [`Held`] as it travels: 0 (it cannot resume where it stands), or 1, the
/// latest step (u64), then the received and the sent keys, each list a count (u32) and six
/// u32 per key, all little-endian.
fn encode_held(h: Option<&Held>) -> Vec<u8> {
    let Some(h) = h else { return vec![0] };
    let mut b = vec![1];
    b.extend_from_slice(&h.latest.to_le_bytes());
    for keys in [&h.received, &h.sent] {
        encode_keys(&mut b, keys);
    }
    b
}

/// A list of keys as it travels: a count (u32) and six u32 per key, little-endian.
fn encode_keys(b: &mut Vec<u8>, keys: &HashSet<Key>) {
    b.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        for word in [k.from, k.to, kind_code(k.kind), k.stage, k.index, k.step] {
            b.extend_from_slice(&word.to_le_bytes());
        }
    }
}

/// [`encode_keys`] read back (`what`: the list, for errors); a count past what the record
/// holds, or past [`MAX_HELD_KEYS`], is refused before anything is allocated for it.
fn decode_keys(f: &mut Fields<'_>, what: &'static str) -> Result<HashSet<Key>> {
    let count = |f: &mut Fields<'_>| f.u32().map(|n| n as usize);
    let keys = f.records((0, what), (24, count), |f| {
        let [from, to, kind, stage, index, step] =
            [f.u32()?, f.u32()?, f.u32()?, f.u32()?, f.u32()?, f.u32()?];
        Ok(Key {
            from,
            to,
            kind: kind_of(kind)?,
            stage,
            index,
            step,
        })
    })?;
    if keys.len() > MAX_HELD_KEYS {
        return Err(protocol(format!("a record naming {} keys", keys.len())));
    }
    Ok(keys.into_iter().collect())
}

/// [`encode_held`] read back; a count past what the record holds is refused before anything
/// is allocated for it.
fn decode_held(b: &[u8]) -> Result<Option<Held>> {
    let mut f = Fields::new(b, "takeover record");
    if f.u8()? == 0 {
        f.end()?;
        return Ok(None);
    }
    let latest = f.u64()?;
    let received = decode_keys(&mut f, "received keys")?;
    let sent = decode_keys(&mut f, "sent keys")?;
    f.end()?;
    Ok(Some(Held {
        latest,
        received,
        sent,
    }))
}

/// A takeover as the adopter planned it, for one survivor.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Planned {
    /// The version each worker resumes at.
    pub versions: Vec<u32>,
    /// The keys of the messages this survivor sent that their receivers' logs hold: they
    /// have them, and it need not hand them over ([`hand_over`]).
    pub delivered: HashSet<Key>,
    /// On the adopter, the same of the lost worker's messages: the program it adopts may
    /// replay those microbatches' forwards late ([`super::adopt::deferring_delivered`]).
    /// Empty elsewhere, and not sent: only the adopter runs that program.
    pub lost_delivered: HashSet<Key>,
}

/// The adopter's plan as it travels: 0 (no takeover), or 1, each worker's version (u32),
/// and the delivered keys ([`encode_keys`]), all little-endian.
fn encode_plan(planned: Option<&Planned>) -> Vec<u8> {
    match planned {
        None => vec![0],
        Some(p) => {
            let mut b = vec![1];
            b.extend(p.versions.iter().flat_map(|x| x.to_le_bytes()));
            encode_keys(&mut b, &p.delivered);
            b
        }
    }
}

/// [`encode_plan`] read back, for a run of `workers` workers.
fn decode_plan(b: &[u8], workers: u32) -> Result<Option<Planned>> {
    let mut f = Fields::new(b, "takeover plan");
    match f.u8()? {
        0 => {
            f.end()?;
            Ok(None)
        }
        1 => {
            let versions = (0..workers).map(|_| f.u32()).collect::<Result<_>>()?;
            let delivered = decode_keys(&mut f, "delivered keys")?;
            f.end()?;
            Ok(Some(Planned {
                versions,
                delivered,
                lost_delivered: HashSet::new(),
            }))
        }
        k => Err(protocol(format!("a plan of kind {k}"))),
    }
}

/// The keys of the messages `from` sent that their receivers' logs hold, by what every
/// survivor `held`.
fn delivered_by(from: u32, held: &[Option<Held>]) -> HashSet<Key> {
    held.iter()
        .flatten()
        .flat_map(|h| h.received.iter().filter(|k| k.from == from).copied())
        .collect()
}

/// This survivor's side of a takeover of segment `index` of `plan`, after worker `lost` was
/// lost, over `ep`, the mesh of every rank ([`super::recover::Remesh::connect_without`]
/// with the lost rank hosted): what it `held`, and on the adopter its rollback points and its
/// state at the segment's start. Returns the version each worker resumes at, or `None` where
/// the segment cannot be taken over (the adopter says why on its standard error) and the run
/// goes back instead. Each survivor resumed its programs while the mesh regrouped, so the
/// adopter gathers and plans at once: the others wait on its plan.
///
/// # Errors
/// A peer that fails the exchange or sends a malformed record.
pub fn settle(
    ep: &mut dyn Transport,
    (plan, index): (&RunPlan, u32),
    lost: u32,
    held: Option<Held>,
    adopter: Option<(&Points, &WorkerState)>,
) -> Result<Option<Planned>> {
    let me = ep.rank();
    let adopting = adopter_of(plan, lost)?;
    let workers = plan.schedule.workers();
    // The mesh is new, so the keys need no segment number; each survivor's record carries
    // its own, and one that stood in another segment than the adopter (a follower whose
    // end-of-segment exchange the loss cut short) cannot resume: the run goes back, whose
    // exchange ([`super::recover::go_on`]) finds the same and fails in place of waiting.
    let mut record = index.to_le_bytes().to_vec();
    record.extend(encode_held(held.as_ref()));
    if me != adopting {
        ep.send(Message::from_bytes(key(me, adopting, 0), &record))?;
        let m = ep.recv(&key(adopting, me, 1))?;
        return decode_plan(&m.into_bytes()?, workers);
    }
    let at = adopter.ok_or_else(|| protocol("the adopter without its points".into()))?;
    let mut all: Vec<Option<Held>> = vec![None; workers as usize];
    all[me as usize] = held;
    let mut unable = all[me as usize].is_none().then_some(me);
    for w in (0..workers).filter(|&w| w != me && w != lost) {
        let m = ep.recv(&key(w, me, 0))?;
        let b = m.into_bytes()?;
        let (theirs, rest) = b
            .split_first_chunk::<4>()
            .ok_or_else(|| protocol(format!("a record of {} bytes", b.len())))?;
        let held = decode_held(rest)?.filter(|_| u32::from_le_bytes(*theirs) == index);
        unable = unable.or(held.is_none().then_some(w));
        all[w as usize] = held;
    }
    let planned = match unable {
        Some(w) => Err(protocol(format!(
            "worker {w} cannot resume where it stands"
        ))),
        None => plan_takeover(plan, (lost, None), &all, at),
    };
    let planned = match planned {
        Ok(v) => Some(v),
        Err(e) => {
            // Standard error may have gone with the launcher: then no one is told.
            let _ = writeln!(
                std::io::stderr(),
                "worker {lost}'s segment is not taken over ({e}): the run goes back"
            );
            None
        }
    };
    let of = |w: u32| {
        planned.as_ref().map(|versions| Planned {
            versions: versions.clone(),
            delivered: delivered_by(w, &all),
            lost_delivered: HashSet::new(),
        })
    };
    for w in (0..workers).filter(|&w| w != me && w != lost) {
        ep.send(Message::from_bytes(
            key(me, w, 1),
            &encode_plan(of(w).as_ref()),
        ))?;
    }
    Ok(of(me).map(|p| Planned {
        lost_delivered: delivered_by(lost, &all),
        ..p
    }))
}

/// What a worker hands over after a loss ([`to_hand_over`]).
pub struct HandOver {
    /// The messages to send, in order ([`send_all`]).
    pub send: Vec<Message>,
    /// The messages for the lost rank this worker's process hosts, by key, for its program's
    /// endpoint to serve from memory rather than be sent through a link inside the process:
    /// a link's buffer holds only so much, and the hosted program reads its messages only as
    /// it reaches them, so a hand-over through it would hold this worker's own program back
    /// until then. Their values are rounded as the wire would carry them, so the hosted
    /// program reads the bits a link would have brought.
    pub hosted: HashMap<Key, Message>,
}

/// Every message of `traffic` (worker `from`'s log) that another worker's program, resumed
/// as `planned`, reads, its receiver's log does not hold, and `from`'s own does not send again
/// as it `goes_on`, taken out of the log; those for rank `hosted.0`, where `from`'s process
/// hosts it, kept apart and rounded as a wire of `hosted.1` would carry them. What is left in
/// the log ([`Traffic::take_received`]) is what `from`'s own program reads.
///
/// # Errors
/// A version no program reaches.
pub fn to_hand_over(
    from: u32,
    (plan, goes_on): (&RunPlan, GoesOn),
    planned: &Planned,
    (traffic, latest): (&mut Traffic, u64),
    hosted: Option<(u32, WireDType)>,
) -> Result<HandOver> {
    let mut wanted = handed_over(
        plan,
        (from, goes_on),
        &planned.versions,
        &traffic.held(latest),
    )?;
    // What a receiver's log holds it has: a resumed program is served it from there, and one
    // that stood has read it.
    wanted.retain(|k| !planned.delivered.contains(k));
    let mut hand = HandOver {
        send: Vec::new(),
        hosted: HashMap::new(),
    };
    for mut m in traffic.take_sent(&wanted) {
        match hosted {
            Some((rank, wire)) if m.key.to == rank => {
                pipe_transport::inproc::round_as_on_the_wire(&mut m, wire);
                hand.hosted.insert(m.key, m);
            }
            _ => hand.send.push(m),
        }
    }
    Ok(hand)
}

/// Sends `messages` over `ep`, in order.
///
/// # Errors
/// A send that fails.
pub fn send_all(ep: &mut dyn Transport, messages: Vec<Message>) -> Result<()> {
    for m in messages {
        ep.send(m)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u32) -> Key {
        Key {
            from: i,
            to: i + 1,
            kind: if i % 2 == 0 {
                Kind::Activation
            } else {
                Kind::Chunk
            },
            stage: i % 3,
            index: i * 7,
            step: i % 2,
        }
    }

    #[test]
    fn held_keys_round_trip_and_hostile_records_are_refused() {
        let h = Held {
            latest: 12,
            received: (0..5).map(k).collect(),
            sent: (5..9).map(k).collect(),
        };
        let b = encode_held(Some(&h));
        assert_eq!(decode_held(&b).ok(), Some(Some(h)));
        assert_eq!(decode_held(&encode_held(None)).ok(), Some(None));
        for cut in [0, 7, 8, 11, b.len() - 1] {
            assert!(decode_held(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(decode_held(&long).is_err());
        // A count far past the record is refused before any allocation.
        let mut huge = vec![1];
        huge.extend_from_slice(&3u64.to_le_bytes());
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_held(&huge).is_err());
        let mut bad_kind = encode_held(Some(&Held {
            latest: 1,
            received: [k(0)].into(),
            sent: HashSet::new(),
        }));
        bad_kind[1 + 8 + 4 + 8] = 9;
        assert!(decode_held(&bad_kind).is_err());
    }

    #[test]
    fn plans_round_trip_and_malformed_ones_are_refused() {
        let v = Planned {
            versions: vec![3, 4, 3, 5],
            delivered: [k(1), k(2)].into(),
            lost_delivered: HashSet::new(),
        };
        assert_eq!(
            decode_plan(&encode_plan(Some(&v)), 4).ok(),
            Some(Some(v.clone()))
        );
        assert_eq!(decode_plan(&encode_plan(None), 4).ok(), Some(None));
        for bad in [&[][..], &[2], &[0, 0], &[1, 0, 0, 0]] {
            assert!(decode_plan(bad, 4).is_err(), "{bad:?}");
        }
        assert!(decode_plan(&encode_plan(Some(&v)), 3).is_err());
        assert!(decode_plan(&encode_plan(Some(&v)), 5).is_err());
        // A count of delivered keys past what the plan holds.
        let mut long = encode_plan(Some(&v));
        long.truncate(1 + 16 + 4 + 24);
        assert!(decode_plan(&long, 4).is_err());
        // An absurd count, refused before anything is allocated for it.
        let mut absurd = encode_plan(Some(&v));
        absurd[1 + 16..1 + 16 + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_plan(&absurd, 4).is_err());
    }
}
