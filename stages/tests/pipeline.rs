//! The pipeline oracle: for every policy, stage count, replica layout and M, the pipelined run's
//! weights equal the sequential reference trainer's bit for bit, every worker's version log
//! equals the plan, and flush policies match `sequential` with the same effective batch.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{assert_reference_weights, bits, data, even, first_replicas, flat, opt};
use pipe_kernels::CpuBackend;
use pipe_scheduler::planner::buckets::{BucketSize, StageBuckets};
use pipe_scheduler::{Action, Length, Policy, ScheduleSpec};
use pipe_stages::layers::LayerSpec;
use pipe_stages::model::{Model, ModelSpec, Params};
use pipe_stages::optim::{Corrected, NO_ROLES, OptimizerConfig, OptimizerKind};
use pipe_stages::pipeline::{
    OrderedSource, Pass, RunPlan, Setup, WorkerOutcome, WorkerState, reference_run,
    reference_train, reference_train_from, run_threads,
};
use pipe_transport::inproc::{InProcOptions, mesh};

const SEED: u64 = 11;
const MB: usize = 8;

fn model() -> Model {
    Model::new(&ModelSpec::preset("mlp-784-16x8-10").unwrap()).unwrap()
}

fn prepare(spec: &ScheduleSpec, model: &Model) -> RunPlan {
    // Layers split evenly by count: every stage of this model then holds a linear layer, so a
    // wrong version anywhere changes some weights.
    let k = spec.resolve().unwrap().layout.stages() as usize;
    RunPlan::new(model, spec, Some(even(model.len(), k))).unwrap()
}

/// `policy` on three stages with `replicas`, `m` microbatches an update, for `updates` updates.
fn on_three(policy: Policy, m: u32, replicas: &[u32], updates: u32) -> ScheduleSpec {
    ScheduleSpec::new(policy, 3, m)
        .with_replicas(replicas.to_vec())
        .with_length(Length::Updates(updates))
}

fn lr(_stage: u32, k: u32) -> f32 {
    0.05 / (1.0 + 0.01 * k as f32)
}

fn source() -> OrderedSource<'static> {
    common::source(SEED, MB)
}

fn setup<'a>(run: &'a RunPlan, model: &'a Model, source: &'a OrderedSource<'static>) -> Setup<'a> {
    common::setup(model, run, source, SEED, &lr)
}

/// Runs the pipeline and returns the final weights per worker and the outcomes.
fn pipelined(run: &RunPlan, model: &Model) -> (Vec<WorkerState>, Vec<WorkerOutcome>) {
    let eps = mesh(run.schedule.workers(), &InProcOptions::default());
    pipelined_over(run, model, eps)
}

/// [`pipelined`] over the given endpoints.
fn pipelined_over<T: pipe_transport::Transport>(
    run: &RunPlan,
    model: &Model,
    eps: Vec<T>,
) -> (Vec<WorkerState>, Vec<WorkerOutcome>) {
    pipelined_with(run, model, eps, opt())
}

/// [`pipelined_over`] with optimizer `cfg`.
fn pipelined_with<T: pipe_transport::Transport>(
    run: &RunPlan,
    model: &Model,
    eps: Vec<T>,
    cfg: OptimizerConfig,
) -> (Vec<WorkerState>, Vec<WorkerOutcome>) {
    pipelined_on(run, model, eps, cfg, |_| CpuBackend::new(1))
}

/// [`pipelined_with`] with each worker's backend made by `make(worker)`.
fn pipelined_on<T: pipe_transport::Transport, B: pipe_kernels::Backend>(
    run: &RunPlan,
    model: &Model,
    eps: Vec<T>,
    cfg: OptimizerConfig,
    make: impl Fn(u32) -> Result<B, pipe_kernels::KernelError> + Sync,
) -> (Vec<WorkerState>, Vec<WorkerOutcome>) {
    let source = source();
    let setup = setup(run, model, &source);
    let mut states = common::worker_states(&setup, &model.init_params(SEED), cfg);
    let outs = run_threads(&setup, &mut states, eps, make).unwrap_or_else(|e| panic!("{e}"));
    (states, outs)
}

/// [`pipelined_over`] with every worker on its own emulated device: the final weights.
fn on_emulated_devices<T: pipe_transport::Transport>(
    run: &RunPlan,
    model: &Model,
    eps: Vec<T>,
) -> Vec<WorkerState> {
    lent_on_emulated_devices(run, model, eps).0
}

/// Endpoints of `workers` workers over QUIC on this host.
fn quic(workers: u32) -> Vec<pipe_transport::quic::Quic> {
    pipe_transport::quic::local_mesh(workers, &pipe_transport::quic::QuicOptions::new(SEED))
        .unwrap()
}

/// Asserts that the workers of two runs of one plan hold the same weights, stage by stage, bit
/// for bit; `what` names the case.
#[track_caller]
fn assert_same_weights(a: &[WorkerState], b: &[WorkerState], what: &str) {
    for (a, b) in a.iter().zip(b) {
        for (sa, sb) in a.stages.iter().zip(&b.stages) {
            assert_eq!(
                bits(&sa.params),
                bits(&sb.params),
                "{what}: worker {} stage {}",
                a.worker,
                sa.stage
            );
        }
    }
}

/// The reference trainer's weights per stage under optimizer `cfg`.
fn reference_with(run: &RunPlan, model: &Model, cfg: OptimizerConfig) -> Vec<Params> {
    let source = source();
    common::reference(&setup(run, model, &source), &model.init_params(SEED), cfg)
}

/// Whole-model weights from replica 0 of each stage.
fn assemble(run: &RunPlan, states: &[WorkerState]) -> Vec<f32> {
    first_replicas(run, states)
        .into_iter()
        .flat_map(|p| flat(p))
        .collect()
}

fn check_case(spec: &ScheduleSpec, model: &Model) {
    let run = prepare(spec, model);
    let (states, outs) = pipelined(&run, model);
    let source = source();
    let reference = reference_run(
        &CpuBackend::new(1).unwrap(),
        &setup(&run, model, &source),
        &model.init_params(SEED),
        (0..run.schedule.stages() as usize)
            .map(|s| {
                Corrected::new(
                    opt(),
                    &model.init_params(SEED)[run.partition.range(s)].to_vec(),
                    &model.hidden_matrices()[run.partition.range(s)],
                )
            })
            .collect(),
    )
    .unwrap();
    let want = reference.params;
    // Losses: every microbatch's, computed once by the worker holding its last stage, equal
    // the reference's to the bit (the forward used the planned versions all the way down).
    let mut losses: Vec<(u32, f64)> = outs
        .iter()
        .flat_map(|o| o.losses.iter().map(|&(mb, loss, _)| (mb, loss)))
        .collect();
    losses.sort_by_key(|&(mb, _)| mb);
    assert_eq!(
        losses.len(),
        reference.losses.len(),
        "{spec:?}: one loss per microbatch"
    );
    for ((mb, got), want) in losses.iter().zip(&reference.losses) {
        assert!(
            got.to_bits() == want.to_bits(),
            "{spec:?}: microbatch {mb}'s loss {got} differs from the reference's {want}"
        );
    }
    // Memory: each worker held at most as many weight versions as the plan says, and
    // exactly that many at its peak (a version freed late or early shows here).
    for o in &outs {
        assert_eq!(
            o.peak_versions, run.versions.peak_versions[o.worker as usize],
            "{spec:?}: worker {} peak weight versions",
            o.worker
        );
    }
    let layout = run.schedule.layout();
    // Weights: every replica of every stage equals the reference, bit for bit.
    assert_reference_weights(&states, &want, &format!("{spec:?}"));
    // Version logs equal the plan, and stashes hold no more versions than the plan needs.
    for out in &outs {
        assert_eq!(
            out.peak_versions, run.versions.peak_versions[out.worker as usize],
            "{spec:?}: worker {} stash peak",
            out.worker
        );
        let mut forwards = 0;
        for r in &out.versions {
            let planned = match r.pass {
                Pass::Forward => run.versions.forward_version(r.stage, r.mb),
                Pass::Backward => run.versions.backward_version(r.stage, r.mb),
            };
            assert_eq!(r.version, planned, "{spec:?}: worker {} {r:?}", out.worker);
            forwards += usize::from(r.pass == Pass::Forward);
        }
        let expect: usize = layout
            .stages_of(out.worker)
            .map(|s| {
                (0..run.schedule.total_microbatches())
                    .filter(|&mb| layout.worker_for(s, mb) == out.worker)
                    .count()
            })
            .sum();
        assert_eq!(
            forwards, expect,
            "{spec:?}: worker {} logged every forward",
            out.worker
        );
    }
    // At least 20 updates at every stage.
    for s in 0..run.schedule.stages() {
        assert!(run.versions.updates_at(s) >= 20, "{spec:?}: stage {s}");
    }
    // Flush policies: the same as `sequential` with the same effective batch, to 1e-5.
    if spec.policy.is_flush() && spec.policy != Policy::Sequential {
        let res = &run.schedule.resolved;
        let seq_spec = ScheduleSpec::new(Policy::Sequential, run.schedule.stages(), res.minibatch)
            .with_length(Length::Microbatches(res.total));
        let seq = prepare(&seq_spec, model);
        assert_eq!(seq.partition, run.partition);
        let (seq_states, _) = pipelined(&seq, model);
        let a = assemble(&run, &states);
        let b = assemble(&seq, &seq_states);
        let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let diff = a
            .iter()
            .zip(&b)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            diff <= 1e-5 * scale,
            "{spec:?}: differs from sequential by {diff} (scale {scale})"
        );
    }
}

fn specs() -> Vec<ScheduleSpec> {
    let mut out = Vec::new();
    for policy in Policy::ALL {
        for stages in 1..=4u32 {
            let mut layouts = vec![vec![1], vec![2]];
            if stages == 2 {
                // Flush minibatches of M x 3: stage 0's two replicas take shares differing by one.
                layouts.push(vec![2, 3]);
            }
            if stages == 3 {
                // Unequal replica counts: their asynchronous depths come from the depth search.
                layouts.push(vec![2, 1, 1]);
                layouts.push(vec![1, 3, 1]);
            }
            for replicas in layouts {
                for m in [1u32, 4] {
                    let (chunks, m) = match policy {
                        // Interleaving needs M to be a multiple of the stages.
                        Policy::Interleaved => (2, m.div_ceil(stages) * stages),
                        // 2BW needs M >= its in-flight depth - 1.
                        Policy::TwoBw => (
                            1,
                            m.max(stages.saturating_sub(1))
                                .max(match replicas.as_slice() {
                                    [2, 1, 1] | [2, 3] => 2,
                                    [1, 3, 1] => 4,
                                    _ => 1,
                                }),
                        ),
                        // The V schedules need M >= 2 x stages.
                        Policy::ZbV | Policy::DualPipeV => (1, m.max(2 * stages)),
                        _ => (1, m),
                    };
                    let needs_uniform = policy == Policy::Interleaved || policy.is_v_shaped();
                    if needs_uniform && replicas.len() > 1 {
                        continue;
                    }
                    out.push(
                        ScheduleSpec::new(policy, stages, m)
                            .with_replicas(replicas.clone())
                            .with_chunks(chunks)
                            .with_length(Length::Updates(20)),
                    );
                }
            }
        }
    }
    out
}

#[test]
fn pipelined_runs_equal_the_reference_trainer() {
    let model = model();
    for spec in specs() {
        check_case(&spec, &model);
    }
}

/// AdamW with decoupled weight decay 0.05.
fn adamw() -> OptimizerConfig {
    OptimizerConfig {
        kind: OptimizerKind::Adamw,
        weight_decay: 0.05,
        ..OptimizerConfig::default()
    }
}

/// Muon with Nesterov momentum 0.95 (AdamW for what is not a hidden matrix).
fn muon() -> OptimizerConfig {
    OptimizerConfig {
        kind: OptimizerKind::Muon,
        momentum: 0.95,
        nesterov: true,
        ..OptimizerConfig::default()
    }
}

/// Lion with `beta2` 0.99.
fn lion() -> OptimizerConfig {
    OptimizerConfig {
        kind: OptimizerKind::Lion,
        beta2: 0.99,
        ..OptimizerConfig::default()
    }
}

/// The cases of the optimizer oracles: each policy at 4 stages and at 3 with replicas
/// `[1, 3, 1]`, for 12 updates of 2 microbatches (4 for 2bw, which needs one per stage).
fn oracle_specs(policies: &[Policy]) -> Vec<(Policy, Vec<u32>, ScheduleSpec)> {
    let mut out = Vec::new();
    for &policy in policies {
        for (stages, replicas) in [(4, vec![1]), (3, vec![1, 3, 1])] {
            let m = if policy == Policy::TwoBw { 4 } else { 2 };
            let spec = ScheduleSpec::new(policy, stages, m)
                .with_replicas(replicas.clone())
                .with_length(Length::Updates(12));
            out.push((policy, replicas, spec));
        }
    }
    out
}

/// The oracle beyond SGD with momentum and deterministic layers: Adam, AdamW with decoupled
/// weight decay, Nesterov momentum with L2 decay, Muon (its hidden matrices' momentum
/// orthogonalised by products, AdamW for the input and output layers and the biases) and
/// Lion (their state is stashed with nothing but
/// the weights, and a wrong version of it shows in every later update), and a model with
/// dropout (each microbatch's masks are seeded by the run's seed, the microbatch and the
/// layer, so the pipelined forward and backward and the reference must draw the same ones).
/// Every asynchronous policy and the flush schedules, at 4 stages and at 3 with replicas
/// `[1, 3, 1]` (three replicas summed in ring order).
#[test]
fn other_optimizers_and_dropout_equal_the_reference_trainer() {
    let decayed = |weight_decay, cfg| OptimizerConfig {
        weight_decay,
        ..cfg
    };
    let optimizers = [
        OptimizerConfig {
            kind: OptimizerKind::Adam,
            ..OptimizerConfig::default()
        },
        adamw(),
        // Decay on the linear maps' matrices only, not the biases.
        OptimizerConfig {
            decay_groups: pipe_stages::optim::DecayGroups::Matrices,
            ..adamw()
        },
        OptimizerConfig {
            nesterov: true,
            ..decayed(1e-3, opt())
        },
        decayed(0.01, muon()),
        decayed(0.1, lion()),
    ];
    let mut dropout = ModelSpec::preset("mlp-784-16x8-10").unwrap();
    dropout.layers = dropout
        .layers
        .into_iter()
        .flat_map(|l| {
            let after = l.is_activation().then_some(LayerSpec::Dropout { p: 0.2 });
            std::iter::once(l).chain(after)
        })
        .collect();
    let dropout = Model::new(&dropout).unwrap();
    let plain = model();
    let cases = optimizers
        .iter()
        .map(|&cfg| (&plain, cfg))
        .chain(std::iter::once((&dropout, opt())));
    for (model, cfg) in cases {
        let policies = [
            Policy::PipeDream,
            Policy::PipeDreamNoStash,
            Policy::VerticalSync,
            Policy::TwoBw,
            Policy::OneFOneBFlush,
            Policy::Gpipe,
        ];
        for (policy, replicas, spec) in oracle_specs(&policies) {
            let run = prepare(&spec, model);
            let eps = mesh(run.schedule.workers(), &InProcOptions::default());
            let (states, _) = pipelined_with(&run, model, eps, cfg);
            let want = reference_with(&run, model, cfg);
            let dropout = model.len() > plain.len();
            let case = format!("{policy} {replicas:?} {:?} (dropout: {dropout})", cfg.kind);
            assert_reference_weights(&states, &want, &case);
        }
    }
}

/// Every delay correction, on every asynchronous policy it allows and every optimizer kind:
/// the pipelined run equals the reference trainer bit for bit (error feedback wraps the
/// optimizer's step; DC-ASGD compensates each update against the stale weights the version
/// plan names, which under pipedream with two microbatches per update and under vertical sync
/// are often several versions, averaged), and it changes the weights (a correction that did
/// nothing would pass the first check). DC-ASGD is refused on pipedream-nostash, which keeps no
/// stale weights.
#[test]
fn delay_corrections_equal_the_reference_trainer_on_every_asynchronous_policy() {
    use pipe_stages::optim::DelayCorrection;
    let kinds = [opt(), adamw(), muon(), lion()];
    let corrections = [
        (DelayCorrection::ErrorFeedback, 0.5),
        (DelayCorrection::DcAsgd, 2.0),
        (DelayCorrection::DcAsgdAdaptive, 0.5),
    ];
    let model = model();
    for plain in kinds {
        for (correction, strength) in corrections {
            let corrected = OptimizerConfig {
                delay_correction: correction,
                correction_strength: strength,
                ..plain
            };
            let mut policies = vec![Policy::PipeDream, Policy::VerticalSync, Policy::TwoBw];
            if !correction.needs_stale_weights() {
                policies.push(Policy::PipeDreamNoStash);
            }
            for (policy, replicas, spec) in oracle_specs(&policies) {
                let run = prepare(&spec, &model);
                let eps = mesh(run.schedule.workers(), &InProcOptions::default());
                let (states, outcomes) = pipelined_with(&run, &model, eps, corrected);
                let want = reference_with(&run, &model, corrected);
                let uncorrected = reference_with(&run, &model, plain);
                let what = format!("{policy} {replicas:?} {:?} {correction:?}", plain.kind);
                if correction.needs_stale_weights() {
                    // Holding each update's stale versions until the update costs at most one
                    // more version per worker than freeing them after their last pass (as the
                    // driver counts them, after each action): none here under 2bw and
                    // pipedream, one on one worker of vertical sync at [1, 3, 1].
                    let eps = mesh(run.schedule.workers(), &InProcOptions::default());
                    let (_, base) = pipelined_with(&run, &model, eps, plain);
                    for (c, b) in outcomes.iter().zip(&base) {
                        assert!(
                            c.peak_versions <= b.peak_versions + 1,
                            "{what}: worker {} holds {} versions at most, {} without",
                            c.worker,
                            c.peak_versions,
                            b.peak_versions
                        );
                    }
                }
                for state in &states {
                    for st in &state.stages {
                        let stage = st.stage as usize;
                        assert!(
                            bits(&st.params) == bits(&want[stage]),
                            "{what}: worker {} stage {} differs",
                            state.worker,
                            st.stage
                        );
                    }
                }
                for (s, (w, u)) in want.iter().zip(&uncorrected).enumerate() {
                    assert!(
                        bits(w) != bits(u),
                        "{what}: the correction left stage {s} alone"
                    );
                }
            }
        }
    }
}

/// Over QUIC (loopback, mutual TLS, f32 on the wire), every policy ends with the same weights
/// on every worker as in-process, bit for bit: `--stages 4 --replicas 2` and `--replicas 2,1,1`.
#[test]
fn quic_runs_equal_in_process_runs() {
    let model = model();
    for policy in Policy::ALL {
        for replicas in [vec![2], vec![2, 1, 1]] {
            let stages = if replicas.len() == 1 { 4 } else { 3 };
            if (policy == Policy::Interleaved || policy.is_v_shaped()) && replicas.len() > 1 {
                continue;
            }
            let (chunks, m) = match policy {
                Policy::Interleaved => (2, 4),
                Policy::ZbV | Policy::DualPipeV => (1, 8),
                _ => (1, 4),
            };
            let spec = ScheduleSpec::new(policy, stages, m)
                .with_replicas(replicas.clone())
                .with_chunks(chunks)
                .with_length(Length::Updates(6));
            let run = prepare(&spec, &model);
            let (inproc, _) = pipelined(&run, &model);
            let (quic, _) = pipelined_over(&run, &model, quic(run.schedule.workers()));
            assert_same_weights(&inproc, &quic, &format!("{policy} {replicas:?}"));
        }
    }
}

/// The code paths only a device backend takes, run without a GPU: every worker on its own
/// emulated device (`pipe_kernels::EmulatedDevice`: device buffers, CPU arithmetic). In
/// process the device buffers cross the channels and each receiver copies them in; over QUIC
/// the senders copy them out; over shared memory (the link of worker processes on one host)
/// the senders lend their buffers and the receivers copy them device to device
/// (`pipe_stages::pipeline::loans`); replicas sum on the devices in process and through the
/// host over QUIC and shared memory; finished workers hand back host weights. Every path must
/// end with the CPU run's weights, bit for bit.
#[test]
fn workers_on_emulated_devices_end_with_the_cpu_weights() {
    let model = model();
    for (policy, replicas, chunks, m) in [
        (Policy::PipeDream, vec![2, 1, 1], 1, 4),
        (Policy::OneFOneBFlush, vec![1, 2, 1], 1, 4),
        (Policy::Interleaved, vec![1], 2, 6),
        // One worker over the whole model, as a run with no pipeline flag is.
        (Policy::Sequential, vec![1], 1, 3),
    ] {
        let run = prepare(
            &on_three(policy, m, &replicas, 4).with_chunks(chunks),
            &model,
        );
        let (cpu, _) = pipelined(&run, &model);
        let workers = run.schedule.workers();
        let inproc = mesh(workers, &InProcOptions::default());
        let in_process = on_emulated_devices(&run, &model, inproc);
        let over_quic = on_emulated_devices(&run, &model, quic(workers));
        let (over_shm, lent) = lent_on_emulated_devices(&run, &model, shm(workers));
        // Every activation and gradient a worker sends is lent.
        let sends: Vec<u64> = run
            .schedule
            .programs
            .iter()
            .map(|p| {
                let send = |a: &&Action| {
                    matches!(
                        a,
                        Action::SendActivation { .. } | Action::SendGradient { .. }
                    )
                };
                p.iter().filter(send).count() as u64
            })
            .collect();
        assert_eq!(lent, sends, "{policy} {replicas:?}: lent against sent");
        for (path, states) in [
            ("in process", &in_process),
            ("over QUIC", &over_quic),
            ("over shared memory", &over_shm),
        ] {
            assert_same_weights(&cpu, states, &format!("{policy} {replicas:?} {path}"));
        }
    }
}

/// Every action of every worker's program has its span, in program order, on the host's
/// clock (the CPU: a wait after each action) and on a device's marks (the emulated device:
/// the spans read from marks queued around each action, without a wait), and the worker's
/// computing time is its computing actions' spans.
#[test]
fn every_action_has_its_span_on_the_host_clock_and_on_device_marks() {
    let model = model();
    let run = prepare(&on_three(Policy::PipeDream, 4, &[2, 1, 1], 3), &model);
    let workers = run.schedule.workers();
    let eps = || mesh(workers, &InProcOptions::default());
    let (_, on_cpu) = pipelined(&run, &model);
    let on_device = |w: u32| pipe_kernels::EmulatedDevice::new(w as usize);
    let (_, on_marks) = pipelined_on(&run, &model, eps(), opt(), on_device);
    for (clock, outcomes) in [("host clock", &on_cpu), ("device marks", &on_marks)] {
        for (w, (out, program)) in outcomes.iter().zip(&run.schedule.programs).enumerate() {
            let actions: Vec<Action> = out.spans.iter().map(|sp| sp.action).collect();
            assert_eq!(
                &actions, program,
                "{clock}: worker {w}'s spans against its program"
            );
            assert!(
                out.spans
                    .iter()
                    .all(|sp| sp.worker == w as u32 && sp.end >= sp.start)
            );
            assert!(
                out.spans.windows(2).all(|p| p[1].start >= p[0].end - 1e-9),
                "{clock}: worker {w}'s spans overlap"
            );
            let computing: f64 = out
                .spans
                .iter()
                .filter(|sp| {
                    sp.action.kind().is_compute() || matches!(sp.action, Action::Update { .. })
                })
                .map(|sp| sp.end - sp.start)
                .sum();
            assert!(
                (computing - out.compute_s).abs() < 1e-9 && computing > 0.0,
                "{clock}: worker {w} computed {} s, its spans say {computing}",
                out.compute_s
            );
        }
    }
}

/// [`on_emulated_devices`], and how many buffers each worker lent.
fn lent_on_emulated_devices<T: pipe_transport::Transport>(
    run: &RunPlan,
    model: &Model,
    eps: Vec<T>,
) -> (Vec<WorkerState>, Vec<u64>) {
    let on_devices = |w: u32| pipe_kernels::EmulatedDevice::new(w as usize);
    let (states, outcomes) = pipelined_on(run, model, eps, opt(), on_devices);
    (states, outcomes.iter().map(|o| o.buffers_lent).collect())
}

/// Loans are agreed link by link: where the receiver cannot open the sender's buffers (a GPU
/// without peer access, here an emulated device that refuses them), that link carries its
/// messages through the host while the other direction lends, and the weights are the CPU
/// run's either way.
#[test]
fn a_link_whose_receiver_cannot_borrow_goes_through_the_host() {
    let model = model();
    let run = prepare(&on_three(Policy::PipeDream, 4, &[1, 1, 1], 4), &model);
    let (cpu, _) = pipelined(&run, &model);
    let workers = run.schedule.workers();
    let device = |w: u32| match w {
        1 => pipe_kernels::EmulatedDevice::without_peer_access(1),
        w => pipe_kernels::EmulatedDevice::new(w as usize),
    };
    let (states, outcomes) = pipelined_on(&run, &model, shm(workers), opt(), device);
    assert_same_weights(&cpu, &states, "worker 1 without peer access");
    let lent: Vec<u64> = outcomes.iter().map(|o| o.buffers_lent).collect();
    // Worker 0 sends only to worker 1 (nothing lent); worker 1's gradients to worker 0 and
    // worker 2's to worker 1 (refused) decide the rest.
    assert_eq!(lent[0], 0, "{lent:?}");
    assert!(lent[1] > 0, "{lent:?}");
    assert_eq!(lent[2], 0, "{lent:?}");
}

/// Endpoints of `workers` workers over shared memory, as worker processes of one host link.
fn shm(workers: u32) -> Vec<pipe_transport::shm::Shm> {
    pipe_transport::shm::local_mesh(workers, &pipe_transport::shm::ShmOptions::new(SEED)).unwrap()
}

/// On a wire that rounds activations to bf16 nothing is lent (a loan would carry the f32
/// bits): the messages go through the host, rounded, as over QUIC with the same wire.
#[test]
fn a_rounding_wire_lends_nothing() {
    let model = model();
    let run = prepare(&on_three(Policy::PipeDream, 4, &[1, 1, 1], 4), &model);
    let workers = run.schedule.workers();
    let wire = pipe_transport::frame::WireDType::Bf16;
    let mut opts = pipe_transport::shm::ShmOptions::new(SEED);
    opts.wire = wire;
    let (over_shm, lent) = lent_on_emulated_devices(
        &run,
        &model,
        pipe_transport::shm::local_mesh(workers, &opts).unwrap(),
    );
    assert!(lent.iter().all(|&n| n == 0), "{lent:?}");
    let mut quic_opts = pipe_transport::quic::QuicOptions::new(SEED);
    quic_opts.wire = wire;
    let over_quic = on_emulated_devices(
        &run,
        &model,
        pipe_transport::quic::local_mesh(workers, &quic_opts).unwrap(),
    );
    // Lent, the activations would keep their f32 bits, and the weights would differ.
    assert_same_weights(&over_quic, &over_shm, "bf16 wire");
}

/// Three replicas on emulated devices in one process sum their gradients on the devices in
/// group order, not the ring's order: every replica of the stage holds the same bits, within
/// rounding of the CPU run's.
#[test]
fn three_replicas_on_devices_sum_on_the_devices_within_rounding_of_the_ring() {
    let model = model();
    let run = prepare(&on_three(Policy::PipeDream, 3, &[3, 1, 1], 4), &model);
    let (cpu, _) = pipelined(&run, &model);
    let inproc = mesh(run.schedule.workers(), &InProcOptions::default());
    let devices = on_emulated_devices(&run, &model, inproc);
    let mut stage0 = Vec::new();
    for (a, b) in cpu.iter().zip(&devices) {
        for (sa, sb) in a.stages.iter().zip(&b.stages) {
            let worst = common::worst_gap(&flat(&sb.params), &flat(&sa.params));
            assert!(
                worst <= 1e-5,
                "worker {} stage {}: {worst:e}",
                a.worker,
                sa.stage
            );
            if sb.stage == 0 {
                stage0.push(bits(&sb.params));
            }
        }
    }
    assert_eq!(stage0.len(), 3);
    assert!(stage0.windows(2).all(|w| w[0] == w[1]), "replicas disagree");
}

/// Runs `run` in process and over QUIC, checks every worker's weights against the reference
/// trainer's bit for bit (`what` names the case), and returns the reference's.
fn equal_to_the_reference_in_process_and_over_quic(
    run: &RunPlan,
    model: &Model,
    what: &dyn std::fmt::Display,
) -> Vec<Params> {
    let (inproc, _) = pipelined(run, model);
    let (quic, _) = pipelined_over(run, model, quic(run.schedule.workers()));
    let want = reference_with(run, model, opt());
    for states in [&inproc, &quic] {
        assert_reference_weights(states, &want, &what.to_string());
    }
    want
}

/// Buckets of 300 gradient values.
fn three_hundred() -> BucketSize {
    BucketSize::of_values(300).unwrap()
}

/// Checks a run whose replicas of `stage` sum their gradients in buckets of 300 values: that
/// stage's gradients make several buckets, the run equals the reference trainer in process and
/// over QUIC, and `one_bucket` (the run with that stage summed in one bucket) ends the stage
/// with other weights; `what` names the case.
fn buckets_matter(
    model: &Model,
    run: &RunPlan,
    one_bucket: &RunPlan,
    stage: usize,
    what: &dyn std::fmt::Display,
) {
    let grads = model.zero_grads(run.partition.range(stage));
    let buckets = pipe_stages::pipeline::gradient_buckets(&grads, three_hundred(), 3);
    assert!(buckets.len() >= 2, "{what}: {buckets:?}");
    let want = equal_to_the_reference_in_process_and_over_quic(run, model, what);
    let one = reference_with(one_bucket, model, opt());
    assert!(
        bits(&one[stage]) != bits(&want[stage]),
        "{what}: stage {stage} summed in one bucket ends as in several"
    );
}

/// All-reduce buckets of a few hundred values (a bucket per layer, each started during the
/// backward pass) with three replicas: in process and over QUIC the weights equal the
/// reference trainer's, which sums the same buckets, bit for bit; and the buckets are real:
/// summed as one bucket, three replicas' additions come in another order and the weights
/// differ.
#[test]
fn gradient_buckets_reduced_during_the_backward_pass_equal_the_reference() {
    let model = model();
    for policy in [Policy::PipeDream, Policy::TwoBw, Policy::OneFOneBFlush] {
        let m = if policy == Policy::TwoBw { 4 } else { 3 };
        let run =
            prepare(&on_three(policy, m, &[1, 3, 1], 6), &model).with_bucket_size(three_hundred());
        let one_bucket = run.clone().with_bucket_size(BucketSize::Whole);
        buckets_matter(&model, &run, &one_bucket, 1, &policy);
    }
}

/// Bucket sizes per stage (as the simulator chooses them): two replicated stages, one in
/// buckets of 300 values and one in a single bucket, equal the reference trainer's weights in
/// process and over QUIC, bit for bit; and the sizes are real: with the first stage summed
/// in one bucket too, its weights differ.
#[test]
fn bucket_sizes_per_stage_equal_the_reference() {
    let model = model();
    let spec = on_three(Policy::PipeDream, 3, &[3, 3, 1], 6);
    let sizes = StageBuckets::new(vec![three_hundred(), BucketSize::Whole, three_hundred()]);
    let run = prepare(&spec, &model).with_stage_buckets(&sizes);
    assert_eq!(run.bucket_size_of(0), three_hundred());
    assert_eq!(run.bucket_size_of(1), BucketSize::Whole);
    let all_one = run
        .clone()
        .with_stage_buckets(&StageBuckets::uniform(BucketSize::Whole, 3));
    buckets_matter(&model, &run, &all_one, 0, &"per stage");
}

/// `--allreduce-dtype bf16`: the replicas send bf16 and sum in f32. In process and over QUIC
/// (where the chunks travel in two bytes a value) the weights equal the reference trainer's,
/// which rounds the same sums, bit for bit; against the f32 all-reduce they differ by rounding
/// only: within 2e-3 of each weight's magnitude (plus 2e-3) after six updates.
#[test]
fn a_bf16_all_reduce_equals_the_reference_and_stays_near_f32() {
    use pipe_transport::frame::WireDType;
    let model = model();
    let spec = on_three(Policy::PipeDream, 3, &[1, 3, 1], 6);
    let f32_run = prepare(&spec, &model).with_bucket_size(three_hundred());
    let run = f32_run.clone().with_allreduce_wire(WireDType::Bf16);
    let want = equal_to_the_reference_in_process_and_over_quic(&run, &model, &"bf16");
    let exact = reference_with(&f32_run, &model, opt());
    assert!(bits(&exact[1]) != bits(&want[1]), "nothing was rounded");
    for (a, b) in flat(&want[1]).iter().zip(flat(&exact[1])) {
        assert!((a - b).abs() <= 2e-3 * b.abs() + 2e-3, "{a} against {b}");
    }
}

/// With a bf16 wire, QUIC (which encodes bf16) and in-process (which rounds as the wire
/// would) end bit-identical too, and differ from the f32 run.
#[test]
fn a_bf16_wire_has_the_same_numerics_in_process_and_over_quic() {
    use pipe_transport::frame::WireDType;
    let model = model();
    let run = prepare(&on_three(Policy::PipeDream, 4, &[2, 1, 1], 6), &model);
    let workers = run.schedule.workers();
    let inproc = InProcOptions {
        wire: WireDType::Bf16,
        ..InProcOptions::default()
    };
    let (a, _) = pipelined_over(&run, &model, mesh(workers, &inproc));
    let mut quic = pipe_transport::quic::QuicOptions::new(SEED);
    quic.wire = WireDType::Bf16;
    let eps = pipe_transport::quic::local_mesh(workers, &quic).unwrap();
    let (b, _) = pipelined_over(&run, &model, eps);
    let (f32_run, _) = pipelined(&run, &model);
    let all = |states: &[WorkerState]| -> Vec<u32> {
        states
            .iter()
            .flat_map(|w| w.stages.iter().flat_map(|s| bits(&s.params)))
            .collect()
    };
    assert_eq!(all(&a), all(&b));
    assert_ne!(all(&a), all(&f32_run));
}

/// Wraps a transport and fails its `fail_at`-th send (counting from 0).
struct Faulty<T> {
    inner: T,
    fail_at: Option<usize>,
    sends: usize,
}

impl<T: pipe_transport::Transport> pipe_transport::Transport for Faulty<T> {
    fn rank(&self) -> u32 {
        self.inner.rank()
    }
    fn size(&self) -> u32 {
        self.inner.size()
    }
    fn send(&mut self, m: pipe_transport::Message) -> Result<(), pipe_transport::TransportError> {
        let n = self.sends;
        self.sends += 1;
        if self.fail_at == Some(n) {
            return Err(pipe_transport::TransportError::Protocol(
                "injected fault".into(),
            ));
        }
        self.inner.send(m)
    }
    fn recv(
        &mut self,
        key: &pipe_transport::Key,
    ) -> Result<pipe_transport::Message, pipe_transport::TransportError> {
        self.inner.recv(key)
    }
    fn buffered(&self) -> usize {
        self.inner.buffered()
    }
    fn try_recv(
        &mut self,
        key: &pipe_transport::Key,
    ) -> Result<Option<pipe_transport::Message>, pipe_transport::TransportError> {
        self.inner.try_recv(key)
    }
    fn abort(&mut self) {
        self.inner.abort();
    }
    fn close(&mut self) -> Result<(), pipe_transport::TransportError> {
        self.inner.close()
    }
    fn carries_device_tensors(&self) -> bool {
        self.inner.carries_device_tensors()
    }
    fn lends_device_buffers(&self, peer: u32) -> bool {
        self.inner.lends_device_buffers(peer)
    }
    fn copies_payloads(&self) -> bool {
        self.inner.copies_payloads()
    }
    fn link_buffer_bytes(&self) -> Option<u64> {
        self.inner.link_buffer_bytes()
    }
    fn interrupter(&self) -> Option<pipe_transport::Interrupter> {
        self.inner.interrupter()
    }
    fn regroup_address(&mut self) -> Option<Result<String, pipe_transport::TransportError>> {
        self.inner.regroup_address()
    }
    fn regroup(
        &mut self,
        lost: u32,
        host: Option<u32>,
    ) -> Result<pipe_transport::Regrouped, pipe_transport::TransportError> {
        self.inner.regroup(lost, host)
    }
    fn cut_link(
        &mut self,
        peer: u32,
        pause: std::time::Duration,
    ) -> Result<(), pipe_transport::TransportError> {
        self.inner.cut_link(peer, pause)
    }
}

/// Microbatches made up from their number: any count, no dataset needed.
struct Made {
    features: usize,
    panic_at: Option<u32>,
}

impl pipe_stages::pipeline::MicrobatchSource for Made {
    fn microbatch_size(&self) -> usize {
        2
    }
    fn inputs(&self, mb: u32) -> pipe_stages::Result<pipe_kernels::Tensor> {
        let v: Vec<f32> = (0..2 * self.features)
            .map(|i| ((mb as usize * 7 + i) % 11) as f32 / 11.0 - 0.5)
            .collect();
        Ok(pipe_kernels::Tensor::from_vec(&[2, self.features], v).unwrap())
    }
    fn labels(&self, mb: u32) -> pipe_stages::Result<pipe_kernels::Tensor<u32>> {
        assert!(
            self.panic_at != Some(mb),
            "injected panic at microbatch {mb}"
        );
        Ok(pipe_kernels::Tensor::from_vec(&[2], vec![mb % 2, (mb / 2) % 2]).unwrap())
    }
}

fn small_setup_run(
    spec: &ScheduleSpec,
    source: &Made,
    faults: impl Fn(u32) -> Option<usize>,
) -> pipe_stages::Result<Vec<WorkerOutcome>> {
    let model = Model::new(&ModelSpec::preset("mlp-4-4-4-2").unwrap()).unwrap();
    let plan = prepare(spec, &model);
    let schedule = &plan.schedule;
    let setup = common::setup(&model, &plan, source, 1, &lr);
    let mut states = common::worker_states(&setup, &model.init_params(1), opt());
    let eps: Vec<Faulty<_>> = mesh(schedule.workers(), &InProcOptions::default())
        .into_iter()
        .enumerate()
        .map(|(w, inner)| Faulty {
            inner,
            fail_at: faults(w as u32),
            sends: 0,
        })
        .collect();
    run_threads(&setup, &mut states, eps, |_| CpuBackend::new(1))
}

#[test]
fn a_failing_worker_stops_every_worker_and_is_named() {
    let spec = ScheduleSpec::new(Policy::PipeDream, 4, 1)
        .with_replicas(vec![1, 2, 1, 1])
        .with_length(Length::Microbatches(400));
    let source = Made {
        features: 4,
        panic_at: None,
    };
    let t = std::time::Instant::now();
    // Worker 2 (stage 1, replica 1) fails on its 15th send.
    let err = small_setup_run(&spec, &source, |w| (w == 2).then_some(14)).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with("worker 2 (stage 1, replica 1) failed at s1"),
        "{msg}"
    );
    assert!(msg.contains("injected fault"), "{msg}");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );

    // A panic inside a worker (the last stage reading labels) is caught and named too.
    let source = Made {
        features: 4,
        panic_at: Some(37),
    };
    let err = small_setup_run(&spec, &source, |_| None).unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with("worker 4 (stage 3, replica 0)"), "{msg}");
    assert!(msg.contains("injected panic at microbatch 37"), "{msg}");
}

#[test]
fn ten_thousand_microbatches_complete_for_every_policy() {
    let source = Made {
        features: 4,
        panic_at: None,
    };
    for policy in Policy::ALL {
        // Two chunks per worker on two positions: the small model's layers cover 4 stages.
        let (stages, chunks) = match policy {
            Policy::Interleaved => (2, 2),
            Policy::ZbV | Policy::DualPipeV => (2, 1),
            _ => (3, 1),
        };
        let spec = ScheduleSpec::new(policy, stages, 4)
            .with_chunks(chunks)
            .with_length(Length::Microbatches(10_000));
        let outs =
            small_setup_run(&spec, &source, |_| None).unwrap_or_else(|e| panic!("{policy}: {e}"));
        let samples: usize = outs.iter().map(|o| o.samples).sum();
        assert_eq!(
            samples, 20_000,
            "{policy}: every microbatch reached the loss"
        );
    }
}

/// A run cut into schedules at drain points (epochs, or segments between checkpoints) carries
/// weights and optimizer state from one to the next; the reference trainer, given the same
/// drains and carrying the same state, ends with the same weights bit for bit.
#[test]
fn segments_with_carried_state_equal_the_reference_over_the_same_drains() {
    let model = model();
    let be = CpuBackend::new(1).unwrap();
    for policy in [
        Policy::PipeDream,
        Policy::OneFOneBFlush,
        Policy::TwoBw,
        Policy::VerticalSync,
    ] {
        for replicas in [vec![1, 1, 1], vec![2, 1, 1]] {
            let run = prepare(&on_three(policy, 2, &replicas, 3), &model);
            let per_segment = run.schedule.total_microbatches() as usize;
            let init = model.init_params(SEED);
            // Segment k reads the epoch's order from its first unused sample on.
            let source_at = |k: usize| {
                let mut order = source().order.to_vec();
                order.drain(..k * per_segment * MB);
                OrderedSource::new(&data().train, order, MB)
            };
            let sources = [source_at(0), source_at(1)];
            let setups: Vec<Setup<'_>> = sources
                .iter()
                .enumerate()
                .map(|(k, src)| {
                    setup(&run, &model, src).with_microbatch_offset((k * per_segment) as u64)
                })
                .collect();
            let mut states = common::worker_states(&setups[0], &init, opt());
            for s in &setups {
                common::run_in_process(s, &mut states).unwrap();
            }
            let mut params = init.clone();
            let mut opts: Vec<Corrected> = (0..run.schedule.stages() as usize)
                .map(|s| Corrected::new(opt(), &init[run.partition.range(s)].to_vec(), NO_ROLES))
                .collect();
            for s in &setups {
                let (stages, carried) = reference_train_from(&be, s, &params, opts).unwrap();
                params = stages.into_iter().flatten().collect();
                opts = carried;
            }
            let want: Vec<f32> = flat(&params);
            assert_eq!(
                assemble(&run, &states)
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{policy} {replicas:?}"
            );
        }
    }
}

/// Gradient clipping by the global norm, on every policy: the pipelined run equals the
/// reference trainer bit for bit, the loss stage's logged norms before clipping are the
/// reference's, and clipping changed the weights. Under a flush policy every update adds every
/// stage's norm of the same update (a worker holding several stages, as `sequential`,
/// `interleaved` and the V schedules do, readies all of them at its first update); under the
/// asynchronous ones, the newest norms the schedule's causal order delivers
/// ([`pipe_scheduler::NormPlan`]). Replicated layouts add each stage's all-reduced norm once.
#[test]
fn gradient_clipping_equals_the_reference_trainer_on_every_policy() {
    let model = model();
    let clipped = |kind| OptimizerConfig {
        kind,
        grad_clip: Some(0.25),
        ..opt()
    };
    for policy in Policy::ALL {
        let (chunks, m) = match policy {
            Policy::Interleaved => (2, 4),
            Policy::ZbV | Policy::DualPipeV => (1, 8),
            Policy::TwoBw => (1, 4),
            _ => (1, 2),
        };
        let mut layouts = vec![(4, vec![1])];
        if !(policy == Policy::Interleaved || policy.is_v_shaped()) {
            layouts.push((3, vec![1, 3, 1]));
        }
        for (stages, replicas) in layouts {
            let spec = ScheduleSpec::new(policy, stages, m)
                .with_replicas(replicas.clone())
                .with_chunks(chunks)
                .with_length(Length::Updates(8));
            let run = prepare(&spec, &model);
            for kind in [OptimizerKind::Sgd, OptimizerKind::Adamw] {
                let cfg = clipped(kind);
                let eps = mesh(run.schedule.workers(), &InProcOptions::default());
                let (states, outs) = pipelined_with(&run, &model, eps, cfg);
                let source = source();
                let setup = setup(&run, &model, &source);
                let init = model.init_params(SEED);
                let be = CpuBackend::new(1).unwrap();
                let opts = (0..run.schedule.stages() as usize)
                    .map(|s| {
                        let range = run.partition.range(s);
                        Corrected::new(cfg, &init[range.clone()].to_vec(), NO_ROLES)
                    })
                    .collect();
                let want = reference_run(&be, &setup, &init, opts).unwrap();
                let case = format!("{policy} {replicas:?} {kind:?}");
                assert_reference_weights(&states, &want.params, &case);
                let logged: Vec<f64> = outs
                    .iter()
                    .flat_map(|o| o.grad_norms.iter().map(|&(_, n)| n))
                    .collect();
                assert_eq!(logged, want.grad_norms, "{case}: logged norms");
                assert!(
                    logged.iter().any(|&n| n > 0.25),
                    "{case}: nothing clipped ({logged:?})"
                );
                let plain = reference_with(
                    &run,
                    &model,
                    OptimizerConfig {
                        grad_clip: None,
                        ..cfg
                    },
                );
                assert_ne!(
                    bits(&plain[0]),
                    bits(&want.params[0]),
                    "{case}: clipping did nothing"
                );
            }
        }
    }
}

/// With bf16x6 products (on AMX tiles where this CPU has them, else their emulation in scalar
/// code: the same bits), PipeDream's pipelined run with a replicated stage still equals the
/// reference trainer on that backend, weight for weight, bit for bit. The model and batch are
/// large enough that the hidden layers' products go to the tiles (256 x 784 x 256 and
/// 256 x 256 x 256 multiply-adds and their gradients).
#[test]
fn bf16x6_products_keep_the_reference_trainers_bits() {
    tile_products_keep_the_reference_trainers_bits(pipe_kernels::Precision::Bf16x6);
}

/// The same with bf16x3 products.
#[test]
fn bf16x3_products_keep_the_reference_trainers_bits() {
    tile_products_keep_the_reference_trainers_bits(pipe_kernels::Precision::Bf16x3);
}

fn tile_products_keep_the_reference_trainers_bits(precision: pipe_kernels::Precision) {
    let make = |_| {
        CpuBackend::with_precision(1, precision)
            .or_else(|_| CpuBackend::with_emulated_tiles(1, precision))
    };
    let model = Model::new(&ModelSpec::preset("mlp-784-256x3-10").unwrap()).unwrap();
    let spec = on_three(Policy::PipeDream, 2, &[1, 2, 1], 2);
    let run = prepare(&spec, &model);
    let source = common::source(SEED, 256);
    let setup = common::setup(&model, &run, &source, SEED, &lr);
    let init = model.init_params(SEED);
    let mut states = common::worker_states(&setup, &init, opt());
    let eps = mesh(run.schedule.workers(), &InProcOptions::default());
    run_threads(&setup, &mut states, eps, make).unwrap_or_else(|e| panic!("{e}"));
    let be = make(0).unwrap();
    let want = reference_train(&be, &setup, &init, opt()).unwrap();
    let f32_weights = common::reference(&setup, &init, opt());
    let got = first_replicas(&run, &states);
    for (s, (got, want)) in got.iter().zip(&want).enumerate() {
        assert_eq!(bits(got), bits(want), "stage {s}");
    }
    // ... and the products did go to the tiles: the weights are not the f32 run's.
    assert_ne!(
        want.iter().map(|p| bits(p)).collect::<Vec<_>>(),
        f32_weights.iter().map(|p| bits(p)).collect::<Vec<_>>()
    );
}
