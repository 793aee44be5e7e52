//! The transformer through the pipeline oracle: a small GPT (embedding, three blocks, final
//! layer norm, head) on a character corpus at four stages, pipelined on threads, must equal the
//! sequential reference trainer bit for bit, with and without the token embedding (stage 0)
//! tied to the head (stage 3), under the asynchronous, 2BW and flush schedules and with
//! replicated stages, and with activations recomputed in the backward.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::OnceLock;

mod common;

use common::{assert_reference_weights, bits, reference, run_in_process, worker_states};
use pipe_kernels::{CpuBackend, Tensor};
use pipe_scheduler::{Length, Policy, ScheduleSpec};
use pipe_stages::data::{Splits, char_corpus};
use pipe_stages::layer::{Keep, Recompute, Saved, StageRecompute};
use pipe_stages::layers::LayerSpec;
use pipe_stages::model::{Model, ModelSpec, Params};
use pipe_stages::optim::{OptimizerConfig, OptimizerKind};
use pipe_stages::pipeline::{OrderedSource, Partition, RunPlan, Setup, run_threads};
use pipe_stages::transformer::GptShape;
use pipe_transport::inproc::{InProcOptions, mesh};

const SEED: u64 = 5;
const CONTEXT: usize = 6;

fn data() -> &'static Splits {
    static DATA: OnceLock<Splits> = OnceLock::new();
    DATA.get_or_init(|| {
        let text = "to be, or not to be: that is the question. whether 'tis nobler in the mind "
            .repeat(20);
        char_corpus(&text, CONTEXT, "verse").unwrap()
    })
}

/// The small GPT of these tests: three blocks of width 8, two heads.
fn gpt_spec(tie: bool) -> ModelSpec {
    let shape = GptShape {
        blocks: 3,
        width: 8,
        heads: 2,
        context: CONTEXT,
    };
    let vocab = data().vocab.as_ref().unwrap().len();
    ModelSpec::gpt(shape, vocab, tie)
}

fn model(tie: bool) -> Model {
    Model::new(&gpt_spec(tie)).unwrap()
}

fn opt() -> OptimizerConfig {
    OptimizerConfig {
        kind: OptimizerKind::Adamw,
        weight_decay: 0.1,
        ..OptimizerConfig::default()
    }
}

fn lr(_stage: u32, k: u32) -> f32 {
    3e-3 / (1.0 + 0.05 * k as f32)
}

/// Layers `[emb] [block block] [block] [norm head]`: the tie spans stages 0 and 3.
fn plan(model: &Model, spec: &ScheduleSpec) -> RunPlan {
    let partition = Partition::new(vec![0..1, 1..3, 3..4, 4..6], model.len()).unwrap();
    RunPlan::new(model, spec, Some(partition)).unwrap()
}

fn source() -> OrderedSource<'static> {
    common::shuffled(&data().train, SEED, 1, 2)
}

fn setup<'a>(run: &'a RunPlan, model: &'a Model, source: &'a OrderedSource<'static>) -> Setup<'a> {
    common::setup(model, run, source, SEED, &lr)
}

/// Runs `spec` pipelined on CPU workers and by the reference; every replica of every stage must
/// match. Returns the reference's weights.
fn check(spec: &ScheduleSpec, tie: bool) -> Vec<Params> {
    check_on(spec, tie, false)
}

/// [`check`], with every worker on its own emulated device when `devices` (device buffers,
/// CPU arithmetic: the device code paths without a GPU, still bit for bit).
fn check_on(spec: &ScheduleSpec, tie: bool, devices: bool) -> Vec<Params> {
    check_with(spec, tie, devices, opt())
}

/// [`check_on`] with the optimizer `opt`.
fn check_with(spec: &ScheduleSpec, tie: bool, devices: bool, opt: OptimizerConfig) -> Vec<Params> {
    check_model(&model(tie), spec, devices, opt, &format!("tie {tie}"))
}

/// [`check_with`] for `model` (`what` names it in messages).
fn check_model(
    model: &Model,
    spec: &ScheduleSpec,
    devices: bool,
    opt: OptimizerConfig,
    what: &str,
) -> Vec<Params> {
    check_model_from(model, spec, devices, opt, what, &source())
}

/// [`check_model`] reading its microbatches from `source`.
fn check_model_from(
    model: &Model,
    spec: &ScheduleSpec,
    devices: bool,
    opt: OptimizerConfig,
    what: &str,
    source: &OrderedSource<'static>,
) -> Vec<Params> {
    let run = plan(model, spec);
    let setup = setup(&run, model, source);
    let init = model.init_params(SEED);
    let mut states = worker_states(&setup, &init, opt);
    let eps = mesh(run.schedule.workers(), &InProcOptions::default());
    let backend = |w: u32| -> Result<Box<dyn pipe_kernels::Backend>, pipe_kernels::KernelError> {
        Ok(if devices {
            Box::new(pipe_kernels::EmulatedDevice::new(w as usize)?)
        } else {
            Box::new(CpuBackend::new(1)?)
        })
    };
    let outcomes = run_threads(&setup, &mut states, eps, backend)
        .unwrap_or_else(|e| panic!("{spec:?} {what} devices {devices}: {e}"));
    // A device worker reports its pool's peak (at least its stages' weights and gradients); a
    // CPU worker has none to report.
    for o in &outcomes {
        let st = &states[o.worker as usize];
        let floor: usize = st
            .stages
            .iter()
            .flat_map(|s| s.params.iter().flatten())
            .map(|t| 2 * 4 * t.len())
            .sum();
        if devices {
            assert!(
                o.peak_device_bytes as usize >= floor,
                "worker {}: peak device memory {} under its weights and gradients {floor}",
                o.worker,
                o.peak_device_bytes
            );
        } else {
            assert_eq!(o.peak_device_bytes, 0, "worker {} on the CPU", o.worker);
        }
    }
    let want = reference(&setup, &init, opt);
    assert_reference_weights(&states, &want, &format!("{spec:?} {what}"));
    for s in 0..run.schedule.stages() {
        assert!(run.versions.updates_at(s) >= 8, "{spec:?}: stage {s}");
    }
    want
}

fn spec(policy: Policy, m: u32) -> ScheduleSpec {
    ScheduleSpec::new(policy, 4, m).with_length(Length::Microbatches(48))
}

#[test]
fn pipelined_transformer_equals_the_reference() {
    for tie in [false, true] {
        for (policy, m) in [
            (Policy::PipeDream, 1),
            (Policy::TwoBw, 4),
            (Policy::OneFOneBFlush, 4),
        ] {
            check(&spec(policy, m), tie);
        }
    }
}

/// The transformer's device paths (token ids placed, positions, layer norm, attention, tied
/// gradients exchanged and replicas summed through the host) on emulated devices.
#[test]
fn pipelined_transformer_on_emulated_devices_equals_the_reference() {
    for tie in [false, true] {
        check_on(
            &spec(Policy::PipeDream, 2).with_replicas(vec![2, 1, 1, 2]),
            tie,
            true,
        );
    }
    check_on(&spec(Policy::OneFOneBFlush, 4), true, true);
}

/// A vocabulary padded with rows no token selects (`padded_vocab`, for aligned GPU products)
/// trains the same model: pipelined, on the CPU and on emulated devices, tied and untied, the
/// padded model equals its own reference bit for bit, its padding rows stay exactly zero, and
/// every other weight is the unpadded model's within the rounding of products whose shapes
/// differ (the matrix kernels may block a longer sum differently, so not bit for bit).
#[test]
fn a_padded_vocabulary_trains_the_unpadded_model() {
    let vocab = data().vocab.as_ref().unwrap().len();
    let rows = vocab.next_multiple_of(16) + 16;
    let schedule = spec(Policy::PipeDream, 2).with_replicas(vec![2, 1, 1, 2]);
    for tie in [false, true] {
        for devices in [false, true] {
            let what = format!("tie {tie} devices {devices}");
            let plain = check_model(&model(tie), &schedule, devices, opt(), &what);
            let padded_spec = gpt_spec(tie).with_padded_vocab(Some(rows));
            let padded_model = Model::new(&padded_spec).unwrap();
            assert_eq!(padded_model.output_shape(), [CONTEXT, rows]);
            assert_eq!(padded_model.output_classes(), vocab);
            let padded = check_model(&padded_model, &schedule, devices, opt(), &what);
            let (mut tables, mut worst) = (0, 0.0f32);
            for (stage, (p, q)) in plain.iter().zip(&padded).enumerate() {
                for (t, u) in p.iter().flatten().zip(q.iter().flatten()) {
                    let (p, q) = (t.host().unwrap(), u.host().unwrap());
                    let (kept, padding) = q.split_at(p.len());
                    if !padding.is_empty() {
                        tables += 1;
                        assert_eq!(u.shape(), [rows, t.shape()[1]], "{what}: stage {stage}");
                        assert!(padding.iter().all(|&v| v == 0.0), "{what}: padding moved");
                    }
                    for (a, b) in p.iter().zip(kept) {
                        worst = worst.max((a - b).abs() / a.abs().max(1e-2));
                    }
                }
            }
            assert_eq!(tables, 2, "{what}: the two vocabulary tables");
            eprintln!("{what}: largest difference {worst:e}");
            assert!(worst < 1e-3, "{what}: weights differ by {worst:e}");
        }
    }
}

#[test]
fn tied_copies_stay_equal_under_every_policy_and_replication() {
    let cases = [
        spec(Policy::PipeDream, 2).with_replicas(vec![2, 1, 1, 2]),
        spec(Policy::PipeDreamNoStash, 1),
        spec(Policy::VerticalSync, 1),
        spec(Policy::Gpipe, 4),
        spec(Policy::ZbH1, 4),
        spec(Policy::OneFOneBFlush, 2).with_replicas(vec![1, 1, 2, 3]),
    ];
    let model = model(true);
    let head = model.len() - 1;
    for case in cases {
        let want = check(&case, true);
        // The embedding's token table (stage 0) and the head (stage 3) are one parameter.
        assert_eq!(
            bits(&[vec![want[0][0][0].clone()]]),
            bits(&[vec![want[3][head - 4][0].clone()]]),
            "{case:?}: tied copies differ"
        );
    }
}

#[test]
fn tied_stages_updating_at_different_rates_are_refused() {
    let model = model(true);
    let asynchronous = spec(Policy::PipeDream, 2).with_replicas(vec![2, 1, 1, 1]);
    let e = RunPlan::new(
        &model,
        &asynchronous,
        Some(Partition::new(vec![0..1, 1..3, 3..4, 4..6], model.len()).unwrap()),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("stages 0 and 3 share a tied parameter"), "{e}");
}

#[test]
fn tying_changes_the_result() {
    let untied = check(&spec(Policy::PipeDream, 1), false);
    let tied = check(&spec(Policy::PipeDream, 1), true);
    assert_ne!(bits(&untied[3]), bits(&tied[3]));
}

/// DC-ASGD with the embedding tied to the head across stages 0 and 3, on emulated devices with
/// replicas: each stage compensates its own use against its own stale weights before the uses
/// are exchanged and summed, so the pipelined run equals the reference and the tied copies stay
/// equal. Pipedream with two microbatches per update, where an update's microbatches used
/// several versions.
#[test]
fn dc_asgd_keeps_tied_copies_equal_and_equals_the_reference() {
    use pipe_stages::optim::DelayCorrection;
    let model = model(true);
    let head = model.len() - 1;
    for (correction, strength) in [
        (DelayCorrection::DcAsgd, 2.0),
        (DelayCorrection::DcAsgdAdaptive, 0.5),
    ] {
        let cfg = OptimizerConfig {
            delay_correction: correction,
            correction_strength: strength,
            ..opt()
        };
        let case = spec(Policy::PipeDream, 2).with_replicas(vec![2, 1, 1, 2]);
        let want = check_with(&case, true, true, cfg);
        assert_eq!(
            bits(&[vec![want[0][0][0].clone()]]),
            bits(&[vec![want[3][head - 4][0].clone()]]),
            "{correction:?}: tied copies differ"
        );
        let plain = check(&case, true);
        assert_ne!(
            bits(&want[0]),
            bits(&plain[0]),
            "{correction:?} changed nothing"
        );
    }
}

/// `--weight-decay-groups matrices` on a GPT: the linear maps' matrices (attention's, the
/// MLP's, the head's) decay; embeddings, biases and layer-norm gains do not; a token table tied
/// to the head is the head's matrix and decays. One AdamW step from a zero gradient moves
/// exactly the decayed parameters, by the factor `1 - lr wd`.
#[test]
fn matrices_decay_and_embeddings_biases_and_gains_do_not() {
    use pipe_stages::optim::{DecayGroups, Optimizer};
    let be = CpuBackend::new(1).unwrap();
    for tie in [false, true] {
        let model = model(tie);
        let roles = model.optimizer_roles();
        let names = model.param_names();
        let table = model.param_table();
        let mut decayed = Vec::new();
        for (layer, slots) in roles.iter().enumerate() {
            for (slot, role) in slots.iter().enumerate() {
                let entry = &table[model.param_id(layer, slot)];
                if role.linear_matrix {
                    decayed.push(entry.name.clone());
                }
                assert!(
                    !role.linear_matrix || entry.shape.len() == 2,
                    "{}",
                    entry.name
                );
            }
        }
        // Per block: attention's input and output projections and the MLP's two matrices.
        let blocks = 3;
        let want = blocks * 4 + if tie { 2 } else { 1 };
        assert_eq!(decayed.len(), want, "tie {tie}: {decayed:?} of {names:?}");
        assert!(
            decayed.iter().all(|n| !n.starts_with("layers.0.") || tie),
            "{decayed:?}"
        );
        let cfg = OptimizerConfig {
            kind: OptimizerKind::Adamw,
            weight_decay: 0.5,
            decay_groups: DecayGroups::Matrices,
            ..OptimizerConfig::default()
        };
        let mut params = model.init_params(SEED);
        let before = params.clone();
        let zeros = model.zero_grads(0..model.len());
        let mut opt = Optimizer::new(cfg, &params, &roles);
        opt.step(&be, &mut params, &zeros, 0.1).unwrap();
        for (layer, slots) in roles.iter().enumerate() {
            for (slot, role) in slots.iter().enumerate() {
                let (a, b) = (&before[layer][slot], &params[layer][slot]);
                let scale = if role.linear_matrix {
                    1.0 - 0.1 * 0.5
                } else {
                    1.0
                };
                for (x, y) in a.host().unwrap().iter().zip(b.host().unwrap()) {
                    assert!(
                        (x * scale - y).abs() <= 1e-7 * x.abs().max(1.0),
                        "{layer}.{slot}"
                    );
                }
            }
        }
    }
}

/// Recomputation changes memory, never bits: with every block keeping only its input (`full`)
/// or only its attention layers recomputed (`selective`), the pipelined run's weights equal the
/// reference trainer's (which keeps everything) bit for bit, under stashing (the recomputed
/// forward uses the stashed version), 2BW, a flush with replicas, and zero-bubble's split
/// backward (whose weight half recomputes again). Dropout is on, so the recomputed forward must
/// draw the same masks. Per stage, each stage recomputes its own kind, and the bits are the
/// same again.
#[test]
fn recomputed_activations_give_the_reference_weights() {
    // Untied: the dropout layers move the head, which a tie names by index.
    let mut spec_with_dropout = gpt_spec(false);
    spec_with_dropout.layers = spec_with_dropout
        .layers
        .into_iter()
        .flat_map(|l| {
            let block = matches!(l, LayerSpec::TransformerBlock { .. });
            let after = block.then_some(LayerSpec::Dropout { p: 0.1 });
            std::iter::once(l).chain(after)
        })
        .collect();
    let plain = Model::new(&spec_with_dropout).unwrap();
    let init = plain.init_params(SEED);
    for what in ["full", "selective", "full,selective,none,full"] {
        let what: StageRecompute = what.parse().unwrap();
        let recomputing = Model::new(&spec_with_dropout)
            .unwrap()
            .with_stage_recompute(what.clone());
        if let [uniform] = *what.kinds() {
            check_stand_ins(&plain, &init, uniform);
        }
        for case in [
            ScheduleSpec::new(Policy::PipeDream, 4, 1).with_length(Length::Microbatches(24)),
            ScheduleSpec::new(Policy::TwoBw, 4, 4).with_length(Length::Microbatches(24)),
            ScheduleSpec::new(Policy::ZbH1, 4, 4).with_length(Length::Microbatches(24)),
            ScheduleSpec::new(Policy::OneFOneBFlush, 4, 2)
                .with_replicas(vec![1, 1, 2, 3])
                .with_length(Length::Microbatches(24)),
        ] {
            let partition = Partition::new(vec![0..1, 1..3, 3..5, 5..plain.len()], plain.len());
            let run = RunPlan::new(&plain, &case, Some(partition.unwrap())).unwrap();
            let source = source();
            let pipelined = setup(&run, &recomputing, &source);
            let mut states = worker_states(&pipelined, &init, opt());
            run_in_process(&pipelined, &mut states).unwrap();
            let want = reference(&setup(&run, &plain, &source), &init, opt());
            assert_reference_weights(&states, &want, &format!("{what} {case:?}"));
        }
    }
}

/// Stand-ins, not activations: with `what` on every layer, a block keeps its input (full) or
/// its attention layers keep theirs (selective), and less is held either way.
fn check_stand_ins(plain: &Model, init: &[Vec<Tensor>], what: Recompute) {
    let be = CpuBackend::new(1).unwrap();
    let x = data().train.gather(&[0, 1]).unwrap().0;
    let range = 0..plain.len();
    let (_, kept) = plain
        .forward_range(
            &be,
            range.clone(),
            init,
            x.clone(),
            plain.training(0),
            SEED,
            0,
            None,
        )
        .unwrap();
    let (_, stand_ins) = plain
        .forward_range(&be, range, init, x, Keep::Train(what), SEED, 0, None)
        .unwrap();
    let bytes = |s: &[Saved]| s.iter().map(|s| s.bytes()).sum::<usize>();
    let (held, all) = (bytes(&stand_ins), bytes(&kept));
    match what {
        Recompute::Full => assert!(held < all / 2, "{what:?}: {held} of {all} bytes"),
        _ => assert!(held < all, "{what:?}: {held} of {all} bytes"),
    }
    let marked = |s: &Saved| {
        s.recompute.is_some()
            || s.inner
                .iter()
                .flat_map(|i| &i.inner)
                .any(|i| i.recompute.is_some())
    };
    assert!(stand_ins.iter().any(marked), "{what:?}: nothing recomputed");
}

/// The verse read as packed documents: each sentence (up to and including its '.', ':' or
/// ',') is a document, those characters its end id; the windows are the verse's, their
/// labels ignored where the input is an end (the next document's first token).
fn packed_data(end: char) -> (pipe_stages::data::Dataset, u32) {
    let train = &data().train;
    let end = data()
        .vocab
        .as_ref()
        .unwrap()
        .chars
        .iter()
        .position(|&c| c == end)
        .unwrap() as u32;
    let all: Vec<u32> = (0..train.len() as u32).collect();
    let (x, y) = train.gather(&all).unwrap();
    let labels = x
        .host()
        .unwrap()
        .iter()
        .zip(y.host().unwrap())
        .map(|(&input, &label)| {
            if input == end as f32 {
                pipe_kernels::IGNORED_LABEL
            } else {
                label
            }
        })
        .collect();
    let features = x.host().unwrap().to_vec();
    let packed = pipe_stages::data::Dataset {
        name: "verse-packed".into(),
        samples: pipe_stages::data::Samples::Memory { features, labels },
        ..train.clone()
    };
    (packed, end)
}

/// Packed documents through the pipeline oracle: every stage derives the microbatch's
/// documents from its token ids, so the pipelined run equals the reference trainer bit for bit
/// under stashing, 2BW, a replicated flush and zero-bubble's split backward, with the embedding
/// tied to the head and with full recomputation (the recomputed attention masks again).
#[test]
fn packed_documents_give_the_reference_weights() {
    let (packed, end) = packed_data(' ');
    let packed: &'static pipe_stages::data::Dataset = Box::leak(Box::new(packed));
    for recompute in [Recompute::None, Recompute::Full] {
        let model = self::model(true)
            .with_documents(Some(end))
            .with_recompute(recompute);
        let plain = self::model(true);
        let init = model.init_params(SEED);
        for case in [
            spec(Policy::PipeDream, 1),
            spec(Policy::TwoBw, 4),
            spec(Policy::OneFOneBFlush, 2).with_replicas(vec![1, 1, 2, 2]),
            spec(Policy::ZbH1, 4),
        ] {
            let run = plan(&model, &case);
            let source = common::shuffled(packed, SEED, 1, 2);
            let pipelined = setup(&run, &model, &source);
            let mut states = worker_states(&pipelined, &init, opt());
            run_in_process(&pipelined, &mut states).unwrap();
            let documents = self::model(true).with_documents(Some(end));
            let want = reference(&setup(&run, &documents, &source), &init, opt());
            assert_reference_weights(&states, &want, &format!("{recompute:?} {case:?}"));
            // Packing changes the training: the same windows unpacked give other weights.
            if recompute == Recompute::None && case == spec(Policy::PipeDream, 1) {
                let unpacked = reference(&setup(&run, &plain, &source), &init, opt());
                assert_ne!(bits(&unpacked[3]), bits(&want[3]));
            }
        }
    }
}

/// Packed documents on devices: the document starts and positions are placed on each
/// worker's device, and the first token of each document is an ignored label there, so the
/// device paths (here the emulated device's) give the reference trainer's weights too.
#[test]
fn packed_documents_on_emulated_devices_give_the_reference_weights() {
    let (packed, end) = packed_data(' ');
    let packed: &'static pipe_stages::data::Dataset = Box::leak(Box::new(packed));
    let model = self::model(true).with_documents(Some(end));
    for case in [
        spec(Policy::PipeDream, 1),
        spec(Policy::OneFOneBFlush, 2).with_replicas(vec![1, 1, 2, 2]),
    ] {
        let source = common::shuffled(packed, SEED, 1, 2);
        check_model_from(&model, &case, true, opt(), "packed documents", &source);
    }
}

/// A document's loss is its own: the loss of each document packed into one window with
/// others (the last one cut by the window's end) equals, within 1e-6, its loss run alone as
/// its own sequence. Weights are perturbed away from the initialisation (whose attention
/// output projections are zero) so that attention across a document's start would show, and
/// does: unpacked, the later documents' losses differ.
#[test]
fn a_packed_documents_loss_equals_its_loss_alone() {
    use pipe_kernels::{Backend, IGNORED_LABEL, Tensor};
    use rand::Rng;
    let vocab = data().vocab.as_ref().unwrap();
    let end = vocab.chars.iter().position(|&c| c == '.').unwrap() as u32;
    let shape = GptShape {
        blocks: 2,
        width: 16,
        heads: 2,
        context: 32,
    };
    let spec = ModelSpec::gpt(shape, vocab.len(), true);
    let packing = Model::new(&spec).unwrap().with_documents(Some(end));
    let unpacked = Model::new(&spec).unwrap();
    let mut params = packing.init_params(SEED);
    let mut rng = pipe_stages::rng::rng_for(SEED, "perturb", 0);
    for t in params.iter_mut().flatten() {
        for v in t.host_mut().unwrap() {
            *v += rng.random_range(-0.1..0.1);
        }
    }
    let be = CpuBackend::new(1).unwrap();
    let docs = ["to be.", "or not to be.", "that is the question."];
    let ids: Vec<u32> = docs
        .iter()
        .flat_map(|d| vocab.encode(d, "doc").unwrap())
        .collect();
    // One window of 32 inputs and their next tokens; the third document is cut.
    let window = &ids[..33];
    // Labels: the next token, ignored where the input ends a document.
    let labels_of = |inputs: &[u32], next: &[u32]| -> Vec<u32> {
        inputs
            .iter()
            .zip(next)
            .map(|(&i, &n)| if i == end { IGNORED_LABEL } else { n })
            .collect()
    };
    // Each row's loss (0 where ignored).
    let losses = |model: &Model, inputs: &[u32], labels: &[u32]| -> Vec<f64> {
        let x = inputs.iter().map(|&i| i as f32).collect();
        let x = Tensor::from_vec(&[1, inputs.len()], x).unwrap();
        let documents = model.documents(&be, &x).unwrap();
        let range = 0..model.len();
        let (logits, _) = model
            .forward_range(
                &be,
                range,
                &params,
                x,
                Keep::Nothing,
                0,
                0,
                documents.as_ref(),
            )
            .unwrap();
        let n = logits.cols();
        (0..labels.len())
            .map(|r| {
                let row = logits.host().unwrap()[r * n..(r + 1) * n].to_vec();
                let row = Tensor::from_vec(&[1, n], row).unwrap();
                let label = Tensor::from_vec(&[1], vec![labels[r]]).unwrap();
                be.softmax_cross_entropy(&row, row.cols(), &label, 1.0, None)
                    .unwrap()
                    .loss_sum
            })
            .collect()
    };
    let labels = labels_of(&window[..32], &window[1..]);
    let packed = losses(&packing, &window[..32], &labels);
    let crossing = losses(&unpacked, &window[..32], &labels);
    let mut start = 0;
    for (k, d) in docs.iter().enumerate() {
        let len = d.chars().count().min(32 - start);
        let doc = &window[start..start + len];
        let next = &window[start + 1..start + len + 1];
        let alone: f64 = losses(&packing, doc, &labels_of(doc, next)).iter().sum();
        let within: f64 = packed[start..start + len].iter().sum();
        assert!(
            (alone - within).abs() <= 1e-6 * alone.abs(),
            "'{d}': alone {alone}, packed {within}"
        );
        let across: f64 = crossing[start..start + len].iter().sum();
        if k > 0 {
            assert!(
                (alone - across).abs() > 1e-3 * alone.abs(),
                "'{d}': {alone} {across}"
            );
        }
        start += len;
    }
    assert_eq!(start, 32);
}

/// A worker process draws only its own stages' weights, each as the whole model draws it:
/// the tied head (whose weight is the embedding's) and a block, with the rest left empty.
#[test]
fn a_worker_draws_its_own_layers_as_the_whole_model_does() {
    let model = Model::new(&gpt_spec(true)).unwrap();
    let whole = model.init_params(SEED);
    let n = model.len();
    let keep: Vec<bool> = (0..n).map(|l| l == n - 1 || l == 2).collect();
    let part = model.init_params_of(SEED, &keep);
    for l in 0..n {
        if keep[l] {
            assert!(!part[l].is_empty(), "layer {l}");
            assert!(bits(&part[l..=l]) == bits(&whole[l..=l]), "layer {l}");
        } else {
            assert!(part[l].is_empty(), "layer {l}");
        }
    }
}
