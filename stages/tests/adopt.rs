//! A segment that loses a replica mid-way and is taken over (`pipeline::adopt::take_over`):
//! every survivor resumes at its own latest step boundary and the lost worker's program at
//! one its replica kept, with the messages they read from there served from the logs the
//! workers kept. The segment ends with the weights of the segment that lost nothing, bit for
//! bit, and no worker goes back more than the update it was in.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{bits, even, opt};
use pipe_kernels::CpuBackend;
use pipe_scheduler::{Action, Length, Policy, ScheduleSpec};
use pipe_stages::model::{Model, ModelSpec};
use pipe_stages::pipeline::adopt::{
    Logging, Serving, SharedTraffic, Traffic, resumable, resume_from, take_over,
};
use pipe_stages::pipeline::rollback::{Points, points_kept};
use pipe_stages::pipeline::{
    OrderedSource, RunPlan, Setup, WorkerState, run_threads, run_threads_resumed,
};
use pipe_transport::Transport;
use pipe_transport::fault::{Fault, Faulty};
use pipe_transport::frame::WireDType;
use pipe_transport::inproc::{InProcOptions, mesh};

const SEED: u64 = 9;

fn lr(_stage: u32, k: u32) -> f32 {
    0.05 / (1.0 + 0.01 * k as f32)
}

/// Endpoints that give up on a message after 20 s, so a missing one fails the test.
fn bounded() -> InProcOptions {
    InProcOptions {
        timeout: Some(Duration::from_secs(20)),
        ..InProcOptions::default()
    }
}

/// Updates of the worker's stage its program had completed when it stopped.
fn updates_done(setup: &Setup<'_>, state: &WorkerState) -> u32 {
    let program = &setup.plan.schedule.programs[state.worker as usize];
    program[..state.progress.completed.min(program.len())]
        .iter()
        .filter(|a| matches!(a, Action::Update { .. }))
        .count() as u32
}

/// Runs the segment with worker `lost` failing at its `nth` send, then takes it over; `None`
/// when the worker sends fewer messages. Returns each worker's final state and how many
/// updates each went back.
fn lose_and_take_over(
    setup: &Setup<'_>,
    start: &[WorkerState],
    lost: u32,
    nth: u64,
) -> Option<(Vec<WorkerState>, Vec<u32>)> {
    let workers = setup.plan.schedule.workers();
    let policy = setup.plan.schedule.resolved.policy;
    let kept = points_kept(setup.plan.schedule.stages());
    let points: Vec<Arc<Mutex<Points>>> = (0..workers)
        .map(|_| Arc::new(Mutex::new(Points::new(kept))))
        .collect();
    let traffic: Vec<SharedTraffic> = (0..workers)
        .map(|_| Arc::new(Mutex::new(Traffic::new(kept as u64))))
        .collect();
    let mut states = start.to_vec();
    for (st, p) in states.iter_mut().zip(&points) {
        st.keeper = Some(p.clone());
    }
    let eps: Vec<Box<dyn Transport>> = mesh(workers, &bounded())
        .into_iter()
        .enumerate()
        .map(|(w, ep)| {
            let fault = if w as u32 == lost {
                Fault::Fail { nth }
            } else {
                Fault::None
            };
            let logged = Logging::new(
                Faulty::new(ep, fault),
                traffic[w].clone(),
                points[w].clone(),
            );
            Box::new(logged) as Box<dyn Transport>
        })
        .collect();
    if run_threads(setup, &mut states, eps, |_| CpuBackend::new(1)).is_ok() {
        return None;
    }
    let done: Vec<u32> = states.iter().map(|s| updates_done(setup, s)).collect();
    // What the planner asks of the points without copying them, the resume answers alike.
    for w in 0..workers {
        let held = points[w as usize].lock().unwrap();
        let at = (&*held, &start[w as usize]);
        for v in 0..=done[w as usize] + 1 {
            let resumes = resume_from(setup.plan, w, v, at).is_ok();
            assert_eq!(
                resumable(setup.plan, w, v, at),
                resumes,
                "worker {w} version {v}"
            );
        }
    }
    let mut takeover = take_over(
        setup,
        (lost, None),
        start,
        (&points, &traffic),
        WireDType::F32,
    )
    .unwrap_or_else(|e| panic!("{policy:?} worker {lost} lost at send {nth}: {e}"));
    let eps: Vec<Serving<_>> = mesh(workers, &bounded())
        .into_iter()
        .zip(std::mem::take(&mut takeover.kept))
        .map(|(ep, kept)| Serving::new(ep, kept))
        .collect();
    let make = |_| CpuBackend::new(1);
    let resumes = std::mem::take(&mut takeover.resumes);
    let back = done
        .iter()
        .zip(&resumes)
        .map(|(&d, r)| d.saturating_sub(r.point.version))
        .collect();
    run_threads_resumed(setup, &mut takeover.states, (eps, make), None, resumes)
        .unwrap_or_else(|e| panic!("{policy:?} worker {lost} lost at send {nth}, taken over: {e}"));
    Some((takeover.states, back))
}

/// For `spec`, loses each replicated stage's last worker at a few points of the segment and
/// checks the takeover against the undisturbed segment; returns the cases checked.
fn taken_over_as_undisturbed(spec: &ScheduleSpec) -> usize {
    let model = Model::new(&ModelSpec::preset("mlp-784-16x6-10").unwrap()).unwrap();
    let k = spec.resolve().unwrap().layout.stages() as usize;
    let plan = RunPlan::new(&model, spec, Some(even(model.len(), k))).unwrap();
    let source: OrderedSource<'static> = common::source(SEED, 8);
    let setup = common::setup(&model, &plan, &source, SEED, &lr);
    let start = common::worker_states(&setup, &model.init_params(SEED), opt());
    let mut undisturbed = start.clone();
    run_threads(
        &setup,
        &mut undisturbed,
        mesh(plan.schedule.workers(), &bounded()),
        |_| CpuBackend::new(1),
    )
    .unwrap();
    let resolved = &plan.schedule.resolved;
    if (0..k as u32).any(|s| resolved.update_size(s) != resolved.minibatch) {
        // An asynchronous policy on replica counts that differ: refused, not taken over.
        let (points, traffic) = (Vec::new(), Vec::new());
        let lost = plan.schedule.workers() - 1;
        let err = take_over(
            &setup,
            (lost, None),
            &start,
            (&points, &traffic),
            WireDType::F32,
        )
        .err()
        .unwrap();
        assert!(err.to_string().contains("more than once a step"), "{err}");
        return 0;
    }
    let mut checked = 0;
    for stage in 0..plan.schedule.stages() {
        let group: Vec<u32> = plan.schedule.layout().group(stage).collect();
        let Some(&lost) = group.last().filter(|_| group.len() > 1) else {
            continue;
        };
        for nth in [2, 5, 9, 14, 20] {
            let Some((end, back)) = lose_and_take_over(&setup, &start, lost, nth) else {
                continue;
            };
            let what = format!("{:?} worker {lost} lost at send {nth}", spec.policy);
            for (a, b) in end.iter().zip(&undisturbed) {
                assert_eq!(
                    bits(&a.stages[0].params),
                    bits(&b.stages[0].params),
                    "{what}: worker {}",
                    a.worker
                );
            }
            assert!(
                back.iter().all(|&b| b <= 1),
                "{what}: updates gone back {back:?}"
            );
            checked += 1;
        }
    }
    checked
}

#[test]
fn a_segment_that_loses_a_replica_and_is_taken_over_ends_as_if_nothing_was_lost() {
    let mut seen = std::collections::BTreeMap::new();
    for policy in [
        Policy::Gpipe,
        Policy::OneFOneBFlush,
        Policy::ZbH1,
        Policy::PipeDream,
        Policy::PipeDreamNoStash,
        Policy::VerticalSync,
        Policy::TwoBw,
    ] {
        for replicas in [&[2, 2][..], &[1, 2, 2], &[2, 2, 2]] {
            let spec = ScheduleSpec::new(policy, replicas.len() as u32, 2)
                .with_replicas(replicas.to_vec())
                .with_length(Length::Updates(8));
            if spec.resolve().is_err() {
                continue;
            }
            *seen.entry(format!("{policy:?}")).or_insert(0) += taken_over_as_undisturbed(&spec);
        }
    }
    eprintln!("{seen:?}");
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
