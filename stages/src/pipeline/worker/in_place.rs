//! A worker process's side of going on in place after a lost replica: the segment taken
//! over where every worker stands ([`crate::pipeline::takeover`]), the adopter running the lost
//! program beside its own and hosting the lost rank's endpoint, or, where that cannot be,
//! the run going back to the latest step every stage passed ([`crate::pipeline::recover`]).
//! Apart from the segment loop's other parts in [`super`], whose private items it shares.

use super::*;
use crate::pipeline::adopt::{Serving, resume_from};
use crate::pipeline::driver::resume_worker_with;
use crate::pipeline::rollback::Points;

/// A lost rank's endpoint that this worker hosts after taking its segment over
/// ([`crate::pipeline::takeover`]).
pub(super) enum Hosted {
    /// The lost program's end-of-segment exchange with the chief, on a thread of its own;
    /// the endpoint comes back when it ends.
    Ending(std::thread::JoinHandle<Result<Endpoint>>),
    /// Idle, kept open while the survivors' mesh is in use: its peers would take its close
    /// for a loss.
    Idle(Endpoint),
}

impl Hosted {
    /// The endpoint, once the exchange has ended.
    ///
    /// # Errors
    /// The lost program's end-of-segment exchange failed.
    pub(super) fn idle(self) -> Result<Endpoint> {
        match self {
            Hosted::Idle(ep) => Ok(ep),
            Hosted::Ending(h) => h.join().map_err(|_| {
                StageError::Executor("the lost program's end-of-segment exchange panicked".into())
            })?,
        }
    }

    /// Closes it (or aborts it, unless `cleanly`) on a thread of its own, beside this
    /// worker's own endpoint's close, which waits for every peer's.
    pub(super) fn close(self, cleanly: bool) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            if let Ok(mut ep) = self.idle() {
                if cleanly {
                    let _ = ep.close();
                } else {
                    ep.abort();
                }
            }
        })
    }
}

/// What a worker process holds of a segment whose part failed.
pub(super) struct Failure<'f, 'r> {
    /// Every worker's rollback points (this worker's filled).
    pub(super) points: &'f crate::pipeline::rollback::Kept,
    /// This worker's state is still the segment's start (its program failed), not its end
    /// (the exchange after it did).
    pub(super) at_start: bool,
    /// This worker's traffic log, where one was kept.
    pub(super) traffic: Option<&'f SharedTraffic>,
    /// Its loss relay, the reports its program sent it, and where they are sent.
    pub(super) relay: (
        &'f mut LossRelay<'r>,
        &'f crossbeam_channel::Receiver<Report>,
        &'f crossbeam_channel::Sender<Report>,
    ),
}

impl<T: Transport> Process<'_, T> {
    /// After this worker's part of segment `at` of `plan` failed with `err`: goes on in place
    /// where its launcher names a lost replica the run can do without, else returns `err`.
    /// The segment is taken over where every worker stands where it can be
    /// ([`crate::pipeline::takeover`]); else the run goes back to the latest step every stage passed
    /// ([`crate::pipeline::recover`]).
    pub(super) fn after_failure(
        &mut self,
        plan: &RunPlan,
        at: &Segment,
        err: StageError,
        failed: Failure<'_, '_>,
        obs: &mut dyn Observer,
    ) -> Result<SegmentEnd> {
        let (Some(handle), Some(start)) = (self.remesh.clone(), &self.state) else {
            return Err(err);
        };
        // Nothing to go on without: no stage has a second replica.
        if err.diverged_at().is_some()
            || err.is_bad_input()
            || !crate::pipeline::survive::could_survive(plan)
        {
            return Err(err);
        }
        let ep = current(&mut *self.ep, &mut self.renewed);
        let rank = ep.rank();
        if !err.is_abort_echo() {
            ep.abort();
        }
        let mut remesh = handle.0.lock().map_err(|_| {
            StageError::Executor("the way to the launcher was left poisoned".into())
        })?;
        let Some(word) = remesh.lost(crate::pipeline::recover::LAUNCHER_WORD_WAIT) else {
            return Err(err);
        };
        let (lost, how) = (word.rank, word.how);
        self.replacement_coming = word.replaced;
        let Some(change) = LayoutChange::without(self.run.cfg, lost, how, at.done) else {
            return Err(err);
        };
        let own = failed
            .points
            .get(rank as usize)
            .ok_or_else(|| StageError::Executor("a worker without rollback points".into()))?;
        let clips = start
            .stages
            .iter()
            .any(|st| st.opt.optimizer().config().grad_clip.is_some());
        let adopter = crate::pipeline::adopt::adopter_of(plan, lost).ok();
        // This worker can resume where it stands: its program failed (its state is the
        // segment's start), its traffic was logged, and the run's exchanges are all logged.
        let traffic = failed
            .traffic
            .filter(|_| failed.at_start)
            .filter(|_| crate::pipeline::adopt::refused(plan, &self.run.model, clips).is_none());
        let host = traffic.is_some() && adopter == Some(rank);
        let meshes = remesh.connect_without(lost, host)?;
        drop(remesh);
        self.hosted = meshes.hosted.map(Hosted::Idle);
        let mut ep = meshes.ep;
        // The adopter hosts the lost rank where it can take the segment over; then every
        // survivor settles with it whether they do.
        if meshes.lost_hosted {
            let points = own
                .lock()
                .map_err(|_| crate::pipeline::rollback::poisoned())?;
            let held = match traffic {
                Some(log) => Some(
                    log.lock()
                        .map_err(|_| crate::pipeline::rollback::poisoned())?
                        .held(points.latest()),
                ),
                None => None,
            };
            let adopting = host.then_some((&*points, start));
            let planned = crate::pipeline::takeover::settle(
                ep.as_mut(),
                (plan, self.index),
                lost,
                held,
                adopting,
            )?;
            drop(points);
            if let Some(versions) = planned {
                let adopted = Adopted {
                    lost,
                    change: change.taken_over(at.len),
                    versions,
                };
                return self.run_taken_over(plan, at, (ep, adopted), failed, obs);
            }
        }
        let gone_on = crate::pipeline::recover::Failed {
            plan,
            len: at.len,
            index: self.index,
            worker: rank,
            start: failed.at_start.then_some(start),
            points: own,
        };
        let mut gone = crate::pipeline::recover::go_on(ep, lost, change, gone_on)?;
        let standing = standing_after(&mut gone, plan.schedule.workers(), self.index)?;
        self.renewed = Some(gone.ep);
        self.state = Some(gone.state);
        Ok(SegmentEnd::Relayout(gone.change, standing))
    }
}

/// XORed into the stage of every data key on the survivors' mesh after a takeover
/// ([`Renumbered::tagging_data`]).
pub(super) const TAKEN_OVER_TAG: u32 = 1 << 31;

/// A segment taken over after a loss ([`crate::pipeline::takeover`]).
struct Adopted {
    /// The lost worker.
    lost: u32,
    /// The layout change, made at the segment's end.
    change: LayoutChange,
    /// The version each worker resumes at.
    versions: Vec<u32>,
}

/// A worker's figures when it passed the step boundary where its stage was at `version`,
/// from its rollback `points` (none measured at the segment's start).
fn measured_at_version(
    plan: &RunPlan,
    worker: u32,
    version: u32,
    points: &Points,
) -> Result<WorkerOutcome> {
    let resolved = &plan.schedule.resolved;
    let (stage, _) = plan.schedule.layout().placement(worker);
    let applied = u64::from(version) * u64::from(resolved.update_size(stage));
    match applied / u64::from(resolved.minibatch.max(1)) {
        0 => Ok(WorkerOutcome::default()),
        step => points.measured_at(step).ok_or_else(|| {
            StageError::Executor(format!(
                "worker {worker}'s figures at step {step} are no longer kept"
            ))
        }),
    }
}

impl<T: Transport> Process<'_, T> {
    /// Runs the rest of segment `at` of `plan` taken over (`adopted`) over `ep`, the mesh of
    /// every rank: this worker's own program from its boundary, and on the adopter the lost
    /// worker's too, on a thread of its own; then ends the segment as any segment ends. The
    /// layout changes after the drain ([`Coordinator::taken_over`]).
    fn run_taken_over(
        &mut self,
        plan: &RunPlan,
        at: &Segment,
        (mut ep, adopted): (Box<dyn Transport>, Adopted),
        failed: Failure<'_, '_>,
        obs: &mut dyn Observer,
    ) -> Result<SegmentEnd> {
        let (run, cfg, index) = (self.run, self.run.cfg, self.index);
        let me = ep.rank();
        let lost = adopted.lost;
        let (losses, rx, tx) = failed.relay;
        let start = mine(&self.state)?;
        let points = failed
            .points
            .get(me as usize)
            .ok_or_else(|| StageError::Executor("a worker without rollback points".into()))?
            .lock()
            .map_err(|_| crate::pipeline::rollback::poisoned())?;
        let version = |w: u32| adopted.versions.get(w as usize).copied().unwrap_or(0);
        let (resume, mut state) = resume_from(plan, me, version(me), (&points, start))?;
        let before = measured_at_version(plan, me, version(me), &points)?;
        let mut lost_part = match self.hosted.take() {
            Some(h) => {
                let (r, s) = resume_from(plan, lost, version(lost), (&points, start))?;
                Some((h.idle()?, r, s))
            }
            None => None,
        };
        let latest = points.latest();
        drop(points);
        let log = failed
            .traffic
            .ok_or_else(|| StageError::Executor("a takeover without a traffic log".into()))?;
        let kept = {
            let mut log = log
                .lock()
                .map_err(|_| crate::pipeline::rollback::poisoned())?;
            crate::pipeline::takeover::hand_over(
                ep.as_mut(),
                plan,
                &adopted.versions,
                (&mut log, latest),
            )?
        };
        losses.restart(
            ep.as_mut(),
            rx,
            before.losses.len() + before.grad_norms.len(),
            obs,
        )?;
        let t = Instant::now();
        let be = &self.be;
        let ran = run.with_setup(plan, self.data, (at.epoch, at.done), Some(tx), |setup| {
            std::thread::scope(|s| {
                let adoption = lost_part.take().map(|(hosted, resume, mut st)| {
                    s.spawn(move || {
                        let (tx, rx) = crossbeam_channel::unbounded();
                        let setup = crate::pipeline::setup::Setup {
                            progress: Some(&tx),
                            ..*setup
                        };
                        let be = crate::pipeline::train::open_backend(
                            cfg.backend,
                            cfg.threads.max(1),
                            lost,
                        )?;
                        let mut relay = LossRelay::new(run, plan, at, index, lost);
                        let mut quiet = crate::pipeline::observe::Quiet;
                        let mut ep = Serving::new(hosted, Default::default());
                        let out = resume_worker_with(
                            &be,
                            &mut ep,
                            &setup,
                            &mut st,
                            &resume,
                            t,
                            &mut |ep| relay.poll(ep, &rx, &mut quiet),
                        )?;
                        let mut ep = ep.into_inner();
                        relay.poll(&mut ep, &rx, &mut quiet)?;
                        Ok::<_, StageError>((ep, st, out))
                    })
                });
                let mut served = Serving::new(&mut ep, kept);
                let own =
                    resume_worker_with(be, &mut served, setup, &mut state, &resume, t, &mut |ep| {
                        losses.poll(ep, rx, obs)
                    });
                let other = adoption.map(|h| {
                    h.join()
                        .map_err(|_| StageError::Executor("the adopted program panicked".into()))?
                });
                Ok::<_, StageError>((own?, other.transpose()?))
            })
        });
        let (own, other) = ran?;
        self.renewed = Some(ep);
        self.state = Some(state);
        self.taken_over = Some(adopted.change);
        if let Some((hosted, st, out)) = other {
            // The lost program's figures before its boundary went with it; the chief has its
            // losses from its reports.
            let plan = plan.clone();
            self.hosted = Some(Hosted::Ending(std::thread::spawn(move || {
                let mut hosted = hosted;
                report_to_chief(&mut hosted, &out, (&plan, &st), index)?;
                Ok(hosted)
            })));
        }
        self.end_segment(plan, before.followed_by(own), (losses, rx), obs)
    }
}

/// The figures over the steps of a failed segment that stand, once its survivors have gone
/// on in place ([`crate::pipeline::recover`]): the chief gathers every survivor's, in the old layout's
/// numbering of `old_workers` (the lost one counting none); the others send theirs and get an
/// empty list. `None` when the segment runs again from its start.
///
/// # Errors
/// A survivor that does not answer, or answers malformed.
fn standing_after(
    gone: &mut crate::pipeline::recover::GoneOn,
    old_workers: u32,
    index: u32,
) -> Result<Option<Vec<WorkerOutcome>>> {
    let Some(own) = gone.own.take() else {
        return Ok(None);
    };
    let ep = gone.ep.as_mut();
    let id = ep.rank();
    let key = |from: u32| {
        control(
            from,
            CHIEF,
            crate::pipeline::recover::TOPIC_RECOVER,
            index,
            2,
        )
    };
    if id != CHIEF {
        ep.send(Message::from_bytes(key(id), &encode_summary(&own)))?;
        return Ok(Some(Vec::new()));
    }
    let ranks = &gone.ranks;
    let was = |w: u32| ranks.get(w as usize).copied().unwrap_or(w);
    let mut all = vec![WorkerOutcome::default(); old_workers as usize];
    let mut place = |w: u32, o: WorkerOutcome| {
        if let Some(slot) = all.get_mut(was(w) as usize) {
            *slot = WorkerOutcome {
                worker: was(w),
                ..o
            };
        }
    };
    place(CHIEF, own);
    for w in 1..ep.size() {
        let m = ep.recv(&key(w))?;
        place(w, decode_summary(&m.into_bytes()?, w)?);
    }
    Ok(Some(all))
}
