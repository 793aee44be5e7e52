//! Worker processes going on in place after a lost replica: the survivors keep running, with
//! their state in memory, and no process starts again.
//!
//! When a launched worker process is killed or crashes and it was a replica of a stage that
//! has another (and not the chief), its launcher tells every survivor (`lost RANK HOW` on
//! their standard input). Each survivor, whose part of the segment has failed by then (its
//! peer is gone, or a peer stopped the run for that), goes on over a mesh of the same ranks
//! with the lost one absent, whose workers are numbered for the new layout
//! ([`pipe_transport::renumbered::Renumbered`]): its old one regrouped on its connections
//! where the transport can (QUIC, [`pipe_transport::Transport::regroup`]), else a new one of
//! the same kind. Either way the mesh starts empty, which keeps the failed segment's
//! messages in flight from meeting the new segment's, whose keys start again from 0. Where the lost worker's stage's other replica can
//! take its segment over, it hosts the lost rank in that mesh and the survivors resume where
//! they stand ([`super::takeover`]); what follows is the way back where it cannot (a survivor
//! that had finished its program, a policy or remedy whose exchanges no log keeps). Over the
//! mesh the chief settles where the run goes on:
//! the latest step of the failed segment that every stage passed, from the rollback points
//! each worker kept ([`super::rollback`]), or the segment's start where a worker no longer
//! holds that step. Each worker takes its own stage's state there, sends the chief its
//! figures over the steps that stand, and the segment loop goes on under the new layout.
//!
//! The weights are those of the in-process recovery ([`super::survive`]): the run whose
//! pipeline drains at that step and whose layout changes there.
//!
//! Under `--rejoin` the way back goes through the same [`Remesh`]: the launcher starts a
//! replacement with the lost rank and says when it is ready ([`Remesh::joining`]), and at
//! the chief's next drain point every worker connects a mesh of all ranks
//! ([`Remesh::connect_all`]), over which the replacement is handed its stage's state
//! ([`super::worker`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pipe_transport::renumbered::Renumbered;
use pipe_transport::{Key, Kind, Message, Transport};

use super::exec::{WorkerOutcome, WorkerState};
use super::rollback::Points;
use super::run_plan::RunPlan;
use super::survive::LayoutChange;
use crate::error::{Result, StageError};

/// The launcher's word of a peer the run goes on without in place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostPeer {
    /// The lost worker's rank.
    pub rank: u32,
    /// A replacement is started for it (`--rejoin`, or `--max-restarts` with replacements
    /// left): the survivors run one update at a time until it joins.
    pub replaced: bool,
    /// How it ended, in words.
    pub how: String,
}

/// How a worker process reaches its launcher to go on after a lost peer.
pub trait Remesh: Send {
    /// After this worker's part of a segment failed: the launcher's word, waited for at most
    /// `within`: the rank lost, how it ended and whether it is replaced, or `None` when the
    /// run does not go on in place (the launcher said so, or said nothing).
    fn lost(&mut self, within: Duration) -> Option<LostPeer>;

    /// The survivors' mesh of the run's ranks with `lost` absent, connected where the
    /// launcher says: `ep`, this worker's mesh so far, regrouped on its connections where its
    /// transport can ([`Transport::regroup`]), else a new one. With `host`, `lost`'s place is
    /// this worker's too: it binds and connects an endpoint of that rank as well, for the
    /// lost program it adopts ([`super::takeover`]).
    ///
    /// # Errors
    /// A port that cannot be bound, peers that do not connect in time.
    fn connect_without(
        &mut self,
        ep: &mut dyn Transport,
        lost: u32,
        host: bool,
    ) -> Result<Remeshed>;

    /// The rank of a lost replica's replacement that has started and is ready to join
    /// (`--rejoin`), if the launcher has said so; never waits. The chief asks at the end of
    /// each segment the run is short of it.
    fn joining(&mut self) -> Option<u32>;

    /// A new mesh of every rank of the run, the replacement `joining` among them, connected
    /// where the launcher says, numbered as the run's own layout.
    ///
    /// # Errors
    /// As [`Remesh::connect_without`].
    fn connect_all(&mut self, joining: u32) -> Result<Box<dyn Transport>>;

    /// Whether the launcher has said that no replacement comes for the replica the run is
    /// short of after all (its replacements kept failing before they joined); never waits.
    /// The chief asks at the end of each segment the run waits for one.
    fn unreplaced(&mut self) -> bool;
}

/// The survivors' mesh after a loss, from this worker's side.
pub struct Remeshed {
    /// This worker's endpoint, numbered by the run's ranks.
    pub ep: Box<dyn Transport>,
    /// The lost rank's endpoint, where this worker hosts it.
    pub hosted: Option<pipe_transport::registration::Endpoint>,
    /// Some survivor hosts the lost rank in this mesh (the launcher named an address for it).
    pub lost_hosted: bool,
}

/// A [`Remesh`] a worker's options can carry.
#[derive(Clone)]
pub struct RemeshHandle(pub Arc<Mutex<Box<dyn Remesh>>>);

impl std::fmt::Debug for RemeshHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RemeshHandle")
    }
}

/// How long a survivor waits for its launcher's word after its part of a segment failed: the
/// launcher reaps a dead worker within milliseconds of its output's end (a twentieth of a
/// second at most), and a failure that is no lost peer (a stall, a worker's own error) ends
/// the run this much later.
pub const LAUNCHER_WORD_WAIT: Duration = Duration::from_secs(5);

/// Control topic of the exchange that settles where the survivors go on.
pub const TOPIC_RECOVER: u32 = 7;

/// Where the survivors go on, and with what.
pub struct GoneOn {
    /// The survivors' mesh, numbered for the new layout.
    pub ep: Box<dyn Transport>,
    /// The new layout, from the update it goes on at.
    pub change: LayoutChange,
    /// This worker's state there, numbered for the new layout.
    pub state: WorkerState,
    /// This worker's figures over the steps that stand, numbered as in the new layout (none
    /// when the segment runs again from its start).
    pub own: Option<WorkerOutcome>,
    /// The old layout's number of each of the new layout's workers.
    pub ranks: Vec<u32>,
}

/// A control key of the recovery exchange.
fn key(from: u32, to: u32, index: u32, step: u32) -> Key {
    Key {
        from,
        to,
        kind: Kind::Control,
        stage: TOPIC_RECOVER,
        index,
        step,
    }
}

fn protocol(why: String) -> StageError {
    StageError::Executor(format!("recovery exchange: {why}"))
}

/// The step a run goes on from, given each worker's (latest, earliest) kept steps: the latest
/// every stage passed where every worker still holds it, else 0 (the segment's start). Never
/// the segment's end (`len`): a peer lost in the exchange that ends a segment, after every
/// survivor finished its program, costs the segment's last update, which the new layout runs
/// again and ends the segment with its drain point, as any segment ends.
pub fn settle(kept: &[(u64, u64)], len: u64) -> u64 {
    let latest = kept
        .iter()
        .map(|k| k.0)
        .min()
        .unwrap_or(0)
        .min(len.saturating_sub(1));
    let earliest = kept.iter().map(|k| k.1).max().unwrap_or(0);
    if latest < earliest { 0 } else { latest }
}

/// What a survivor needs to go on: the failed segment's plan and its place, the worker's
/// state at the segment's start and its rollback points.
pub struct Failed<'p> {
    /// The failed segment's plan (the old layout).
    pub plan: &'p RunPlan,
    /// The segment's length in updates.
    pub len: u64,
    /// The segment's number (the exchange's key).
    pub index: u32,
    /// This worker's number in the failed segment's layout.
    pub worker: u32,
    /// This worker's state at the segment's start (none: it finished the segment, so holds
    /// its end instead).
    pub start: Option<&'p WorkerState>,
    /// Its rollback points.
    pub points: &'p Mutex<Points>,
}

/// Each of `change`'s layout's workers as `plan`'s (the ranks of the survivors' mesh, `lost`
/// absent): a stage's survivors keep their order.
///
/// # Errors
/// A layout `change` cannot resolve, or one with more places than survivors.
pub fn survivor_ranks(plan: &RunPlan, lost: u32, change: &LayoutChange) -> Result<Vec<u32>> {
    let old = plan.schedule.layout();
    let policy = plan.schedule.resolved.policy;
    let new = change.spec(1, policy, 1).resolve()?.layout;
    let mut ranks = vec![0; new.workers() as usize];
    for s in 0..new.stages() {
        for (r, was) in old.group(s).filter(|&w| w != lost).enumerate() {
            let slot = ranks.get_mut(new.worker(s, r as u32) as usize);
            *slot.ok_or_else(|| protocol(format!("stage {s} has more survivors than places")))? =
                was;
        }
    }
    Ok(ranks)
}

/// After this worker's part of a segment failed and its launcher named `lost`: over `inner`,
/// the survivors' mesh ([`Remesh::connect_without`]), settles with them where the run goes on
/// under `change` (the layout without `lost`).
///
/// # Errors
/// A peer that fails the exchange.
pub fn go_on(
    inner: Box<dyn Transport>,
    lost: u32,
    change: LayoutChange,
    at: Failed<'_>,
) -> Result<GoneOn> {
    let me = at.worker;
    let ranks = survivor_ranks(at.plan, lost, &change)?;
    let mut ep: Box<dyn Transport> = Box::new(Renumbered::new(inner, ranks.clone())?);
    let id = ep.rank();
    let points = at.points.lock().map_err(|_| super::rollback::poisoned())?;
    let mine = (points.latest(), points.earliest());
    // The mesh is new, so the exchange's keys need no segment number; each record carries
    // its sender's instead, so that survivors that stood in different segments (a follower
    // whose end-of-segment exchange the loss cut short, while the chief had gone on to the
    // next) find it out rather than wait for each other's records without end.
    let index = u64::from(at.index);
    let step = if id == 0 {
        let mut kept = vec![mine];
        let mut apart = None;
        for w in 1..ep.size() {
            let m = ep.recv(&key(w, 0, 0, 0))?;
            let [latest, earliest, theirs] = read_words::<3>(&m.into_bytes()?)?;
            kept.push((latest, earliest));
            apart = apart.or((theirs != index).then_some((w, theirs)));
        }
        let step = match apart {
            Some(_) => APART,
            None => settle(&kept, at.len),
        };
        for w in 1..ep.size() {
            ep.send(Message::from_bytes(key(0, w, 0, 1), &step.to_le_bytes()))?;
        }
        if let Some((w, theirs)) = apart {
            return Err(protocol(format!(
                "worker {w} stood in segment {theirs}, the chief in segment {index}"
            )));
        }
        step
    } else {
        let b: Vec<u8> = [mine.0, mine.1, index]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        ep.send(Message::from_bytes(key(id, 0, 0, 0), &b))?;
        let m = ep.recv(&key(0, id, 0, 1))?;
        match read_words::<1>(&m.into_bytes()?)?[0] {
            APART => return Err(protocol("the survivors stood in different segments".into())),
            step => step,
        }
    };
    let minibatch = u64::from(at.plan.schedule.resolved.minibatch.max(1));
    let state = match (step, at.start) {
        (0, Some(start)) => WorkerState {
            worker: id,
            keeper: None,
            ..start.clone()
        },
        (0, None) => {
            return Err(protocol(format!(
                "worker {me} finished the segment and no longer holds its start"
            )));
        }
        _ => WorkerState {
            worker: id,
            stages: vec![
                points
                    .state_at(step)
                    .ok_or_else(|| protocol(format!("worker {me} no longer holds step {step}")))?,
            ],
            progress: super::doctor::StopPoint::default(),
            keeper: None,
        },
    };
    // This worker's figures over the steps that stand, as its new number (none: the segment
    // runs again from its start), for the chief to gather ([`super::worker`]).
    let own = (step > 0).then(|| WorkerOutcome {
        worker: id,
        ..super::rollback::standing(&points, step, minibatch, me)
    });
    drop(points);
    let change = match step {
        0 => change,
        s => change.rolled_back(s),
    };
    Ok(GoneOn {
        ep,
        change,
        state,
        own,
        ranks,
    })
}

/// The chief's answer when the survivors stood in different segments: none goes on in place.
const APART: u64 = u64::MAX;

/// `N` little-endian `u64`s, exactly.
fn read_words<const N: usize>(b: &[u8]) -> Result<[u64; N]> {
    if b.len() != 8 * N {
        return Err(protocol(format!("a malformed record of {} bytes", b.len())));
    }
    let mut out = [0u64; N];
    for (o, chunk) in out.iter_mut().zip(b.chunks_exact(8)) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        *o = u64::from_le_bytes(word);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_record_of_the_exchange_is_refused() {
        assert_eq!(read_words::<2>(&[0; 16]).unwrap_or_default(), [0, 0]);
        for len in [0, 8, 15, 17, 1 << 12] {
            assert!(read_words::<2>(&vec![0; len]).is_err(), "{len} bytes");
        }
    }

    #[test]
    fn the_run_goes_on_from_the_latest_step_every_worker_holds() {
        assert_eq!(settle(&[(7, 3), (5, 1), (9, 4)], 20), 5);
        // A worker that no longer holds step 5 sends the run back to the segment's start.
        assert_eq!(settle(&[(7, 6), (5, 1)], 20), 0);
        assert_eq!(settle(&[(0, 0), (5, 1)], 20), 0);
        // Every worker finished the segment: its last update runs again, not the segment.
        assert_eq!(
            settle(&[(20, 18), (20, 17)], 20),
            19,
            "never the segment's end"
        );
        assert_eq!(settle(&[(20, 20), (20, 17)], 20), 0, "19 no longer held");
        assert_eq!(settle(&[(1, 1), (1, 1)], 1), 0);
    }
}
