//! Survival, counted and compared: a run that loses a replica (and, with `rejoin`, takes it
//! back at the next update boundary) trains every microbatch of the run exactly once at every
//! stage, and ends with the reference trainer's weights for the layout changes it met. The
//! version ledger is built from what the workers measured in the segments that completed and
//! in the steps of a failed one that stand (the work past them adds nothing), so each
//! (stage, microbatch) pair it holds was trained, and trained once.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use pipe_scheduler::Policy;
use pipe_stages::config::TrainSettings;
use pipe_stages::pipeline::Observer;
use pipe_stages::pipeline::survive::{LayoutChange, LayoutEvent, Redone};
use pipe_stages::pipeline::{PipelineTrainOptions, train_pipelined, train_reference_with};
use pipe_stages::train::EpochStats;
use pipe_transport::fault::{Fault, FaultSchedule, ScheduledFault};

/// Three epochs of PipeDream on two stages of two replicas each ([`common::small_pipeline`]).
fn settings() -> TrainSettings {
    TrainSettings {
        epochs: Some(3),
        replicas: Some(vec![2, 2]),
        ..common::small_pipeline(Policy::PipeDream, 2, 2)
    }
}

/// Every layout change and epoch the run reports.
#[derive(Default)]
struct Seen {
    changes: Vec<LayoutChange>,
    epochs: Vec<EpochStats>,
}

impl Observer for Seen {
    fn on_epoch(&mut self, e: &EpochStats) -> pipe_stages::Result<()> {
        self.epochs.push(e.clone());
        Ok(())
    }
    fn on_layout_change(&mut self, c: &LayoutChange) -> pipe_stages::Result<()> {
        self.changes.push(c.clone());
        Ok(())
    }
}

/// Runs the settings with worker 3 panicking in the second segment (the second epoch).
fn run(rejoin: bool) -> (pipe_stages::pipeline::PipelineReport, Seen) {
    run_with(&settings(), rejoin, 30)
}

/// Runs `settings` with worker 3 panicking at its `nth` data message of the second segment
/// (the second epoch).
fn run_with(
    settings: &TrainSettings,
    rejoin: bool,
    nth: u64,
) -> (pipe_stages::pipeline::PipelineReport, Seen) {
    let cfg = settings.clone().resolve().unwrap();
    let data = common::load(&cfg);
    let opts = PipelineTrainOptions {
        ledger: true,
        rejoin,
        // Every message logged, so that the loss is always taken over where every worker
        // stood (over threads' f32 links nothing is logged otherwise, and a takeover that
        // needs a logged message goes back instead).
        log_moved_messages: true,
        faults: FaultSchedule(vec![ScheduledFault {
            rank: 3,
            attempt: 1,
            fault: Fault::Panic { nth },
        }]),
        ..PipelineTrainOptions::default()
    };
    let mut seen = Seen::default();
    let out = train_pipelined(&cfg, &data, &mut seen, &opts).unwrap_or_else(|e| panic!("{e}"));
    (out, seen)
}

/// Each stage's microbatches in the ledger, sorted: 0..n once each.
fn assert_each_microbatch_once(out: &pipe_stages::pipeline::PipelineReport) {
    // 768 samples / 16 per microbatch = 48 microbatches an epoch (12 updates of 4), 3 epochs.
    let n = 48 * 3;
    for stage in 0..2 {
        let mut mbs: Vec<u64> = out
            .ledger
            .iter()
            .filter(|e| e.stage == stage)
            .map(|e| e.mb)
            .collect();
        mbs.sort_unstable();
        assert_eq!(mbs, (0..n).collect::<Vec<u64>>(), "stage {stage}");
    }
}

#[test]
fn a_lost_replica_trains_every_microbatch_once() {
    let (out, seen) = run(false);
    assert_eq!(seen.changes.len(), 1, "{:?}", seen.changes);
    let lost = &seen.changes[0];
    assert!(
        matches!(
            lost.event,
            LayoutEvent::Lost {
                worker: 3,
                stage: 1,
                ..
            }
        ),
        "{lost:?}"
    );
    // Taken over at the update: the second epoch's segment ended as if nothing was lost, and
    // the layout changed at its end.
    assert_eq!(lost.replicas, vec![2, 1]);
    assert_eq!(lost.redone, Redone::Update, "{lost}");
    assert_eq!(lost.from, 24, "{lost}");
    // It names the update it recovered at: one in the second epoch's segment (13-24).
    assert!(matches!(lost.recovered_at, Some(13..=24)), "{lost:?}");
    let at = lost.recovered_at.unwrap_or(0);
    assert!(
        lost.to_string()
            .contains(&format!("taken over at update {at}:")),
        "{lost}"
    );
    assert_each_microbatch_once(&out);
    assert_eq!(out.report.steps, 36);
    assert_eq!(seen.epochs.len(), 3);
}

#[test]
fn a_rejoined_replica_trains_every_microbatch_once_and_restores_the_layout() {
    let (out, seen) = run(true);
    let events: Vec<(Vec<u32>, u64)> = seen
        .changes
        .iter()
        .map(|c| (c.replicas.clone(), c.from))
        .collect();
    assert_eq!(events.len(), 2, "{events:?}");
    // Taken over, and cut short at the update it was in (one of the second epoch's, 13-24),
    // not run to its segment's end: the replacement joins at the next update boundary.
    let lost = &seen.changes[0];
    assert_eq!(lost.replicas, vec![2, 1]);
    assert_eq!(lost.redone, Redone::Update, "{lost}");
    assert_eq!(Some(lost.from), lost.recovered_at, "{lost:?}");
    assert!(matches!(lost.from, 13..24), "{lost:?}");
    assert_eq!(events[1], (vec![2, 2], events[0].1 + 1));
    assert_eq!(seen.changes[1].event, LayoutEvent::Rejoined);
    assert_each_microbatch_once(&out);
    assert_eq!(out.schedule.layout().replica_counts(), &[2, 2]);
    assert_eq!(seen.epochs.len(), 3);
}

/// Every policy that takes replicas recovers at the update: the segment is taken over where
/// every worker stood, and the run ends with the reference trainer's weights for a layout
/// that changes at the segment's end, bit for bit. With `--rejoin` the segment taken over
/// ends at the update it was in, and the replacement joins one update later: the weights are
/// the reference's for those two changes.
#[test]
fn a_lost_replica_costs_the_updates_in_flight_under_every_policy() {
    for policy in [
        Policy::PipeDream,
        Policy::VerticalSync,
        Policy::TwoBw,
        Policy::Gpipe,
        Policy::OneFOneBFlush,
    ] {
        let settings = TrainSettings {
            epochs: Some(3),
            replicas: Some(vec![2, 2]),
            ..common::small_pipeline(policy, 2, 2)
        };
        let (out, seen) = run_with(&settings, false, 30);
        assert_eq!(seen.changes.len(), 1, "{policy}: {:?}", seen.changes);
        let lost = &seen.changes[0];
        assert_eq!(lost.redone, Redone::Update, "{policy}: {lost}");
        assert_eq!(lost.from, 24, "{policy}: {lost}");
        assert!(
            matches!(lost.recovered_at, Some(13..=24)),
            "{policy}: {lost:?}"
        );
        let cfg = settings.clone().resolve().unwrap();
        let (want, _) = train_reference_with(&cfg, &common::load(&cfg), &seen.changes).unwrap();
        assert!(
            common::bits(&out.report.params) == common::bits(&want),
            "{policy}: the weights differ from the reference run whose layout changes at update {}",
            lost.from
        );
        assert_eq!(out.report.steps, 36, "{policy}");

        let (out, seen) = run_with(&settings, true, 30);
        assert_eq!(seen.changes.len(), 2, "{policy}: {:?}", seen.changes);
        let (lost, back) = (&seen.changes[0], &seen.changes[1]);
        assert_eq!(lost.redone, Redone::Update, "{policy}: {lost}");
        assert_eq!(Some(lost.from), lost.recovered_at, "{policy}: {lost:?}");
        assert!(matches!(lost.from, 13..24), "{policy}: {lost:?}");
        assert_eq!(
            (back.event.clone(), back.from),
            (LayoutEvent::Rejoined, lost.from + 1),
            "{policy}"
        );
        let (want, _) = train_reference_with(&cfg, &common::load(&cfg), &seen.changes).unwrap();
        assert!(
            common::bits(&out.report.params) == common::bits(&want),
            "{policy}: the weights differ from the reference run whose layout changes at updates {} and {}",
            lost.from,
            back.from
        );
        assert_each_microbatch_once(&out);
    }
}

/// `--rejoin`, twenty times over: worker 3 panics in every segment it runs on the run's own
/// layout (each loss is taken over up to the update it was in), a replacement joins one
/// update later each time, and the run ends on its own layout with the reference trainer's
/// weights for the whole sequence of layouts.
#[test]
fn twenty_losses_and_rejoins_end_with_the_reference_weights() {
    let settings = TrainSettings {
        epochs: Some(20),
        replicas: Some(vec![2, 2]),
        ..common::small_pipeline(Policy::PipeDream, 2, 2)
    };
    let cfg = settings.clone().resolve().unwrap();
    let data = common::load(&cfg);
    let faults = (0..200)
        .map(|attempt| ScheduledFault {
            rank: 3,
            attempt,
            fault: Fault::Panic { nth: 12 },
        })
        .collect();
    let opts = PipelineTrainOptions {
        ledger: true,
        rejoin: true,
        faults: FaultSchedule(faults),
        ..PipelineTrainOptions::default()
    };
    let mut seen = Seen::default();
    let out = train_pipelined(&cfg, &data, &mut seen, &opts).unwrap_or_else(|e| panic!("{e}"));
    let losses = seen
        .changes
        .iter()
        .filter(|c| matches!(c.event, LayoutEvent::Lost { .. }))
        .count();
    assert!(losses >= 20, "{losses} losses: {:?}", seen.changes);
    for pair in seen.changes.chunks(2) {
        assert_eq!(pair[0].replicas, vec![2, 1], "{pair:?}");
        if let Some(back) = pair.get(1) {
            assert_eq!(back.event, LayoutEvent::Rejoined, "{pair:?}");
            assert_eq!(
                (back.replicas.clone(), back.from),
                (vec![2, 2], pair[0].from + 1)
            );
        }
    }
    assert_eq!(out.report.steps, 240);
    let (want, _) = train_reference_with(&cfg, &data, &seen.changes).unwrap();
    assert!(common::bits(&out.report.params) == common::bits(&want));
}
