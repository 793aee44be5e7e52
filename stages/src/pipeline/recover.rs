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

/// Who hosts a lost rank in the survivors' mesh: the survivor that would, for the program
/// it adopts ([`super::adopt::adopter_of`]), and whether this worker does.
pub type Hosting = (Option<u32>, bool);

/// How a worker process reaches its launcher to go on after a lost peer.
pub trait Remesh: Send {
    /// After this worker's part of a segment failed: the launcher's word, waited for at most
    /// `within`: the rank lost, how it ended and whether it is replaced, or `None` when the
    /// run does not go on in place (the launcher said so, or said nothing).
    fn lost(&mut self, within: Duration) -> Option<LostPeer>;

    /// The survivors' mesh of the run's ranks with `lost` absent, connected where the
    /// launcher says: `ep`, this worker's mesh so far, regrouped on its connections where its
    /// transport can ([`Transport::regroup`]), else a new one. `hosting`: the survivor that
    /// would host `lost` for the program it adopts ([`super::takeover`]), and whether this
    /// worker hosts it. The host's mesh carries the lost rank on its own connections where
    /// its transport regroups ([`Transport::regroup`]); otherwise it binds and
    /// connects an endpoint of that rank as well.
    ///
    /// # Errors
    /// A port that cannot be bound, peers that do not connect in time.
    fn connect_without(
        &mut self,
        ep: &mut dyn Transport,
        lost: u32,
        hosting: Hosting,
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
    /// This worker finished the segment before the one the chief stood in, and goes on from
    /// its end, the start of the chief's (its figures are over and its segment counts one
    /// more).
    pub behind: bool,
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
    // The mesh is new, so the exchange's keys need no segment number; each record carries
    // its sender's instead, so that survivors that stood in different segments find it out
    // rather than wait for each other's records without end.
    let mine = Stood {
        latest: points.latest(),
        earliest: points.earliest(),
        index: u64::from(at.index),
        finished: at.start.is_none(),
    };
    let (step, behind_me) = if id == 0 {
        chief_settles(ep.as_mut(), &mine, at.len)?
    } else {
        ep.send(Message::from_bytes(key(id, 0, 0, 0), &mine.to_bytes()))?;
        let m = ep.recv(&key(0, id, 0, 1))?;
        match read_words::<1>(&m.into_bytes()?)?[0] {
            APART => return Err(protocol("the survivors stood in different segments".into())),
            step => (step, false),
        }
    };
    let minibatch = u64::from(at.plan.schedule.resolved.minibatch.max(1));
    let state = match (step, at.start) {
        // This worker finished the segment before the chief's and stands at its end.
        (BEHIND, Some(_)) => {
            return Err(protocol(format!(
                "worker {me} was told it finished a segment it stood in"
            )));
        }
        (BEHIND, None) => WorkerState {
            worker: id,
            stages: vec![points.state_at(mine.latest).ok_or_else(|| {
                protocol(format!("worker {me} no longer holds its segment's end"))
            })?],
            progress: super::doctor::StopPoint::default(),
            keeper: None,
        },
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
    let behind = step == BEHIND;
    let own = (step > 0 && !behind).then(|| WorkerOutcome {
        worker: id,
        ..super::rollback::standing(&points, step, minibatch, me)
    });
    drop(points);
    let change = match step {
        // A survivor never started the segment: only its updates in flight run again.
        0 if behind_me => change.rolled_back(0),
        0 => change,
        BEHIND => change.rolled_back(at.len),
        s => change.rolled_back(s),
    };
    Ok(GoneOn {
        ep,
        change,
        state,
        own,
        ranks,
        behind,
    })
}

/// The chief's answer when the survivors stood in different segments: none goes on in place.
const APART: u64 = u64::MAX;

/// The chief's answer to a survivor that stood at the end of the segment before the chief's:
/// its end-of-segment exchange was cut short after the chief had drained that segment and
/// gone on, so it goes on from the end it stands at, the start of the chief's segment.
const BEHIND: u64 = u64::MAX - 1;

/// Where a survivor stood when its part of a segment failed, as it tells the chief.
struct Stood {
    /// The latest step its rollback points keep.
    latest: u64,
    /// The earliest.
    earliest: u64,
    /// Its segment's number.
    index: u64,
    /// It had finished its program (its end-of-segment exchange failed).
    finished: bool,
}

impl Stood {
    fn to_bytes(&self) -> Vec<u8> {
        [
            self.latest,
            self.earliest,
            self.index,
            u64::from(self.finished),
        ]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect()
    }

    /// # Errors
    /// A record that is not four words, or a flag that is neither 0 nor 1.
    fn read(b: &[u8]) -> Result<Self> {
        let [latest, earliest, index, finished] = read_words::<4>(b)?;
        if finished > 1 {
            return Err(protocol(format!("a record whose flag reads {finished}")));
        }
        Ok(Stood {
            latest,
            earliest,
            index,
            finished: finished == 1,
        })
    }
}

/// The chief's side of the exchange that settles where the survivors go on, over `ep`: it
/// gathers where each stood and answers each with the step it goes on from ([`settle`] over
/// a segment of `len` updates). A survivor that finished the segment before the chief's
/// (`mine`), the loss cutting its end-of-segment exchange short after the chief had drained
/// it, is told [`BEHIND`], and the chief's segment runs again from its start, where the
/// chief holds it. Returns the chief's own step, and whether a survivor stood behind.
///
/// # Errors
/// A peer that fails the exchange or sends a malformed record; survivors that stood further
/// apart, once each was told so.
fn chief_settles(ep: &mut dyn Transport, mine: &Stood, len: u64) -> Result<(u64, bool)> {
    let mut kept = vec![(mine.latest, mine.earliest)];
    let mut behind = Vec::new();
    let mut apart = None;
    for w in 1..ep.size() {
        let m = ep.recv(&key(w, 0, 0, 0))?;
        let theirs = Stood::read(&m.into_bytes()?)?;
        if theirs.index == mine.index {
            kept.push((theirs.latest, theirs.earliest));
        } else if theirs.index.checked_add(1) == Some(mine.index)
            && theirs.finished
            && !mine.finished
        {
            behind.push(w);
        } else {
            apart = apart.or(Some((w, theirs.index)));
        }
    }
    let step = match (apart, behind.is_empty()) {
        (Some(_), _) => APART,
        (None, true) => settle(&kept, len),
        (None, false) => 0,
    };
    for w in 1..ep.size() {
        let answer = if step != APART && behind.contains(&w) {
            BEHIND
        } else {
            step
        };
        ep.send(Message::from_bytes(key(0, w, 0, 1), &answer.to_le_bytes()))?;
    }
    if let Some((w, theirs)) = apart {
        return Err(protocol(format!(
            "worker {w} stood in segment {theirs}, the chief in segment {}",
            mine.index
        )));
    }
    Ok((step, !behind.is_empty()))
}

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

    /// What `chief_settles` on rank 0 answers the followers standing as `theirs` (ranks 1
    /// on), the chief standing as `mine`: its own result and each follower's answer.
    fn settled(mine: Stood, theirs: Vec<Stood>) -> (Result<(u64, bool)>, Vec<u64>) {
        let opts = pipe_transport::inproc::InProcOptions::default();
        let mut eps = pipe_transport::inproc::mesh(theirs.len() as u32 + 1, &opts);
        let mut chief = eps.remove(0);
        std::thread::scope(|s| {
            let followers: Vec<_> = eps
                .into_iter()
                .zip(theirs)
                .map(|(mut ep, stood)| {
                    s.spawn(move || {
                        let id = ep.rank();
                        ep.send(Message::from_bytes(key(id, 0, 0, 0), &stood.to_bytes()))
                            .unwrap();
                        let m = ep.recv(&key(0, id, 0, 1)).unwrap();
                        read_words::<1>(&m.into_bytes().unwrap()).unwrap()[0]
                    })
                })
                .collect();
            let own = chief_settles(&mut chief, &mine, 20);
            (
                own,
                followers.into_iter().map(|f| f.join().unwrap()).collect(),
            )
        })
    }

    fn stood(index: u64, (latest, earliest): (u64, u64), finished: bool) -> Stood {
        Stood {
            latest,
            earliest,
            index,
            finished,
        }
    }

    #[test]
    fn a_survivor_whose_end_of_segment_exchange_was_cut_short_goes_on_behind_the_chief() {
        // Rank 1 answered the chief's drain of segment 5 and never began segment 6, where the
        // chief and rank 2 stood when the loss stopped them: segment 6 runs again.
        let (own, answers) = settled(
            stood(6, (0, 0), false),
            vec![stood(5, (20, 17), true), stood(6, (1, 1), false)],
        );
        assert_eq!(own.unwrap(), (0, true));
        assert_eq!(answers, [BEHIND, 0]);
        // The same segment everywhere: the latest step every worker holds.
        let (own, answers) = settled(
            stood(6, (7, 3), false),
            vec![stood(6, (5, 1), false), stood(6, (9, 4), false)],
        );
        assert_eq!(own.unwrap(), (5, false));
        assert_eq!(answers, [5, 5]);
    }

    #[test]
    fn survivors_further_apart_are_each_told_so() {
        let apart = [
            // Two segments behind.
            (stood(7, (0, 0), false), stood(5, (20, 17), true)),
            // One behind, but in the middle of its program.
            (stood(6, (0, 0), false), stood(5, (3, 1), false)),
            // The chief finished its segment too: no one drained the one before.
            (stood(6, (20, 17), true), stood(5, (20, 17), true)),
            // Ahead of the chief.
            (stood(5, (0, 0), false), stood(6, (0, 0), false)),
            // A hostile segment number.
            (stood(0, (0, 0), false), stood(u64::MAX, (0, 0), true)),
        ];
        for (mine, theirs) in apart {
            let (own, answers) = settled(mine, vec![theirs, stood(6, (0, 0), false)]);
            assert!(own.is_err());
            assert_eq!(answers, [APART, APART]);
        }
        assert!(
            Stood::read(&[[0u8; 8], [0; 8], [0; 8], [2, 0, 0, 0, 0, 0, 0, 0]].concat()).is_err()
        );
    }
}
