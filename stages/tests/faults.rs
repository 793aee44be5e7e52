//! Faults injected through the transport wrapper (`pipe_transport::fault`), each with its
//! expected outcome: the run ends with the reference trainer's weights bit for bit, or it stops
//! within a bound with an error that names the cause. Nothing hangs: every case runs under a
//! stall bound of 2 s and a test-wide deadline.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

mod common;

use common::{bits, even, first_replicas, opt};
use pipe_kernels::CpuBackend;
use pipe_scheduler::{Length, Policy, ScheduleSpec};
use pipe_stages::StageError;
use pipe_stages::model::{Model, ModelSpec};
use pipe_stages::pipeline::{OrderedSource, RunPlan, Setup, run_threads};
use pipe_transport::fault::{Fault, Faulty};
use pipe_transport::inproc::{InProcOptions, mesh};
use pipe_transport::quic::{QuicOptions, local_mesh};

const SEED: u64 = 5;
const STALL: Duration = Duration::from_secs(2);

fn model() -> Model {
    Model::new(&ModelSpec::preset("mlp-784-16x4-10").unwrap()).unwrap()
}

fn lr(_stage: u32, _k: u32) -> f32 {
    0.05
}

/// PipeDream on 3 stages, the middle one replicated twice (4 workers): activations,
/// gradients and an all-reduce, over 2 updates of M = 4.
fn plan(model: &Model) -> RunPlan {
    let spec = ScheduleSpec::new(Policy::PipeDream, 3, 4)
        .with_replicas(vec![1, 2, 1])
        .with_length(Length::Updates(2));
    RunPlan::new(model, &spec, Some(even(model.len(), 3))).unwrap()
}

fn source() -> OrderedSource<'static> {
    common::source(SEED, 8)
}

fn setup<'a>(run: &'a RunPlan, model: &'a Model, source: &'a OrderedSource<'static>) -> Setup<'a> {
    common::setup(model, run, source, SEED, &lr)
}

/// The reference trainer's weights, per stage.
fn reference(run: &RunPlan, model: &Model) -> Vec<Vec<u32>> {
    let source = source();
    let params = common::reference(&setup(run, model, &source), &model.init_params(SEED), opt());
    params.iter().map(|p| bits(p)).collect()
}

/// Runs the plan over `endpoints`, each wrapped with the fault `fault_of` gives its rank.
fn run_with<T: pipe_transport::Transport>(
    run: &RunPlan,
    model: &Model,
    endpoints: Vec<T>,
    fault_of: impl Fn(u32) -> Fault,
) -> (Result<Vec<Vec<u32>>, StageError>, Duration) {
    let source = source();
    let setup = setup(run, model, &source);
    let mut states = common::worker_states(&setup, &model.init_params(SEED), opt());
    let eps: Vec<Faulty<T>> = endpoints
        .into_iter()
        .enumerate()
        .map(|(w, ep)| Faulty::new(ep, fault_of(w as u32)))
        .collect();
    let start = Instant::now();
    let result = run_threads(&setup, &mut states, eps, |_| CpuBackend::new(1));
    let took = start.elapsed();
    let weights = result.map(|_| {
        first_replicas(run, &states)
            .into_iter()
            .map(|p| bits(p))
            .collect()
    });
    (weights, took)
}

fn inproc(run: &RunPlan) -> Vec<pipe_transport::inproc::InProc> {
    mesh(
        run.schedule.workers(),
        &InProcOptions {
            timeout: Some(STALL),
            ..InProcOptions::default()
        },
    )
}

fn quic(run: &RunPlan) -> Vec<pipe_transport::quic::Quic> {
    let mut opts = QuicOptions::new(77);
    opts.timeout = Some(STALL);
    local_mesh(run.schedule.workers(), &opts).unwrap()
}

/// Every fault on worker 1 (the first replica of the middle stage), the others clean.
fn on_worker_1(fault: Fault) -> impl Fn(u32) -> Fault {
    move |w| if w == 1 { fault } else { Fault::None }
}

#[test]
fn delayed_and_reordered_messages_leave_the_weights_bit_identical() {
    let model = model();
    let run = plan(&model);
    let want = reference(&run, &model);
    let delay = |w: u32| Fault::Delay {
        max: Duration::from_millis(4),
        seed: u64::from(w) + 1,
    };
    let reorder = |_: u32| Fault::Reorder { window: 3 };
    let faults: [(&str, &dyn Fn(u32) -> Fault); 2] = [("delays", &delay), ("reordering", &reorder)];
    for (what, fault) in faults {
        let (got, _) = run_with(&run, &model, inproc(&run), fault);
        assert_eq!(
            got.unwrap(),
            want,
            "{what} changed the weights (in process)"
        );
        let (got, _) = run_with(&run, &model, quic(&run), fault);
        assert_eq!(got.unwrap(), want, "{what} changed the weights (QUIC)");
    }
}

#[test]
fn a_duplicated_message_is_refused_or_harmless() {
    let model = model();
    let run = plan(&model);
    let want = reference(&run, &model);
    for nth in [1, 3, 6] {
        let (got, took) = run_with(
            &run,
            &model,
            inproc(&run),
            on_worker_1(Fault::Duplicate { nth }),
        );
        match got {
            // The copy arrived after the original was taken: nothing read it.
            Ok(w) => assert_eq!(w, want, "a duplicate changed the weights"),
            Err(e) => assert!(e.to_string().contains("duplicate message"), "{e}"),
        }
        assert!(took < Duration::from_secs(30), "{took:?}");
    }
}

#[test]
fn a_dropped_message_stops_the_run_and_the_doctor_names_the_lost_message() {
    let model = model();
    let run = plan(&model);
    let (got, took) = run_with(
        &run,
        &model,
        inproc(&run),
        on_worker_1(Fault::Drop { nth: 2 }),
    );
    let e = got.unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, StageError::Stalled(_)), "{text}");
    assert!(text.contains("wait-for graph"), "{text}");
    assert!(
        text.contains("worker 1 sent the activation of microbatch 2")
            && text.contains("the message was lost in transport"),
        "{text}"
    );
    // One stall bound, then the others stop at once.
    assert!(took < STALL * 5, "stopped after {took:?}");
    eprintln!("{text}");
}

#[test]
fn a_stalled_worker_is_found_by_the_doctor() {
    let model = model();
    let run = plan(&model);
    let fault = Fault::Stall {
        nth: 2,
        pause: STALL * 2,
    };
    let (got, took) = run_with(&run, &model, inproc(&run), on_worker_1(fault));
    let text = got.unwrap_err().to_string();
    eprintln!("{text}");
    assert!(text.contains("the run stalled"), "{text}");
    assert!(text.contains("worker 1 is stuck inside its send"), "{text}");
    assert!(took < STALL * 5, "stopped after {took:?}");
}

#[test]
fn a_reset_connection_a_panic_and_an_error_stop_the_run_naming_the_worker() {
    let model = model();
    let run = plan(&model);
    let cases = [
        (Fault::Reset { nth: 2 }, "reset"),
        (Fault::Panic { nth: 2 }, "panicked"),
        (Fault::Fail { nth: 2 }, "injected failure"),
    ];
    for (fault, want) in cases {
        let check = |got: Result<_, StageError>, took: Duration, transport: &str| {
            let text = got.unwrap_err().to_string();
            assert!(
                text.contains("worker 1") && text.contains(want),
                "{fault:?} over {transport}: {text}"
            );
            assert!(took < STALL * 5, "{fault:?} over {transport}: {took:?}");
        };
        let (got, took) = run_with(&run, &model, inproc(&run), on_worker_1(fault));
        check(got, took, "inproc");
        let (got, took) = run_with(&run, &model, quic(&run), on_worker_1(fault));
        check(got, took, "quic");
    }
}
