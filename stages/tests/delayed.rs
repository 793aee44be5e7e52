//! Delayed-gradient data-parallel SGD against the reference trainer: no delay is the
//! sequential run and a delay of one is one-stage 2BW, bit for bit; the remedies do what
//! they say.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{bits, load};
use pipe_kernels::CpuBackend;
use pipe_scheduler::Policy;
use pipe_stages::config::{RunConfig, TrainSettings};
use pipe_stages::delayed::{Delay, DelayedOptions, DelayedReport, train_delayed};
use pipe_stages::optim::OptimizerKind;
use pipe_stages::pipeline::Quiet;
use pipe_stages::pipeline::train_reference;

fn cfg(policy: Option<Policy>, kind: OptimizerKind, microbatches: usize) -> RunConfig {
    TrainSettings {
        epochs: Some(2),
        microbatch_size: Some(16),
        microbatches: Some(microbatches),
        optimizer: Some(kind),
        lr: Some(if kind == OptimizerKind::Sgd {
            0.1
        } else {
            0.003
        }),
        momentum: (kind == OptimizerKind::Sgd).then_some(0.9),
        weight_decay: Some(0.01),
        seed: Some(5),
        threads: Some(1),
        schedule: policy.map(|p| p.name().to_string()),
        partition: Some("flops".into()),
        ..common::on_teacher("mlp-32-48x2-4", [32, 4, 16, 640, 128])
    }
    .resolve()
    .unwrap()
}

fn delayed(cfg: &RunConfig, opts: DelayedOptions) -> DelayedReport {
    let be = CpuBackend::new(1).unwrap();
    train_delayed(cfg, &load(cfg), &be, &opts, &mut Quiet).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn no_delay_is_the_sequential_reference_and_a_delay_of_one_is_one_stage_2bw() {
    // Unclipped, and clipped to a norm the gradients exceed (the whole model's norm).
    for (kind, clip) in [
        (OptimizerKind::Sgd, None),
        (OptimizerKind::Adamw, None),
        (OptimizerKind::Adamw, Some(0.05)),
    ] {
        let cfg = |policy, kind, m| {
            let mut c = cfg(policy, kind, m);
            c.optimizer.grad_clip = clip;
            c
        };
        for m in [1, 3] {
            let seq = cfg(Some(Policy::Sequential), kind, m);
            let (want, _) = train_reference(&seq, &load(&seq)).unwrap();
            let got = delayed(&seq, DelayedOptions::new(Delay::Fixed { updates: 0 }));
            assert!(
                bits(&got.report.params) == bits(&want),
                "{kind:?} M={m} clip {clip:?}: no delay"
            );
            // One epoch: a pipelined run drains at each epoch's end, so 2BW's first minibatch
            // of an epoch uses the newest weights, where delayed SGD keeps its delay.
            let mut two = cfg(Some(Policy::TwoBw), kind, m);
            two.epochs = 1;
            let (want, _) = train_reference(&two, &load(&two)).unwrap();
            let got = delayed(&two, DelayedOptions::new(Delay::Fixed { updates: 1 }));
            assert!(
                bits(&got.report.params) == bits(&want),
                "{kind:?} M={m} clip {clip:?}: delay 1"
            );
            assert_eq!(
                got.delays[..3],
                [0, 1, 1],
                "the first update has nothing older"
            );
        }
    }
}

#[test]
fn random_delays_are_seeded_and_in_range_and_remedies_act() {
    let c = cfg(None, OptimizerKind::Sgd, 1);
    let uniform = DelayedOptions::new(Delay::Uniform { max: 4 });
    let a = delayed(&c, uniform);
    let b = delayed(&c, uniform);
    assert_eq!(a.delays, b.delays);
    assert!(bits(&a.report.params) == bits(&b.report.params));
    assert!(a.delays.iter().all(|&d| d <= 4));
    assert!((0..=4).all(|d| a.delays.contains(&d)), "{:?}", a.delays);
    // Dropping: exactly the gradients older than 2 are skipped.
    let dropped = delayed(
        &c,
        DelayedOptions {
            drop_older_than: Some(2),
            ..uniform
        },
    );
    let older = a.delays.iter().filter(|&&d| d > 2).count() as u64;
    assert_eq!(dropped.dropped, older);
    assert!(older > 0 && bits(&dropped.report.params) != bits(&a.report.params));
    // Scaling by age changes the run; a warm-up takes the delay away at the start.
    let scaled = delayed(
        &c,
        DelayedOptions {
            age_scaling: true,
            ..uniform
        },
    );
    assert!(bits(&scaled.report.params) != bits(&a.report.params));
    let warm = delayed(
        &c,
        DelayedOptions {
            warmup: 10,
            ..uniform
        },
    );
    assert!(warm.delays[..10].iter().all(|&d| d == 0));
    assert_eq!(warm.delays[10..], a.delays[10..]);
}

#[test]
fn a_fixed_delay_slows_training_down() {
    let c = cfg(None, OptimizerKind::Sgd, 1);
    let loss = |d| {
        let r = delayed(&c, DelayedOptions::new(Delay::Fixed { updates: d }));
        r.report.epochs.last().unwrap().train_loss
    };
    let (fresh, stale) = (loss(0), loss(6));
    assert!(stale > fresh, "delay 6: {stale} not above {fresh}");
}
