//! Remedies for stale weights under the reference trainer: every remedy on every asynchronous
//! policy ends a pipelined run with the reference trainer's weights, bit for bit, and each
//! remedy changes the run the way it says it does.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{bits, load};
use pipe_scheduler::Policy;
use pipe_stages::config::{RunConfig, TrainSettings};
use pipe_stages::model::Params;
use pipe_stages::pipeline::Quiet;
use pipe_stages::pipeline::{PipelineTrainOptions, train_pipelined, train_reference};
use pipe_stages::remedy::LrScaling;

/// Two epochs of `policy` on four stages ([`common::small_pipeline`]).
fn settings(policy: Policy, microbatches: usize) -> TrainSettings {
    common::small_pipeline(policy, 4, microbatches)
}

fn pipelined(cfg: &RunConfig, ledger: bool) -> pipe_stages::pipeline::PipelineReport {
    let data = load(cfg);
    let opts = PipelineTrainOptions {
        ledger,
        ..PipelineTrainOptions::default()
    };
    train_pipelined(cfg, &data, &mut Quiet, &opts).unwrap_or_else(|e| panic!("{e}"))
}

fn reference(cfg: &RunConfig) -> (Params, Vec<f64>) {
    train_reference(cfg, &load(cfg)).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn every_remedy_on_every_asynchronous_policy_equals_the_reference_trainer() {
    // (sync warm-up, lr scaling, weight prediction): `true` asks for the prediction that
    // fits the policy (the discrepancy correction without stashing, the look-ahead with).
    let remedies = [
        (Some(7), None, false),
        (None, Some("staleness"), false),
        (None, Some("pipemare:40"), false),
        (Some(5), Some("pipemare:30"), false),
        (None, None, true),
        (Some(5), Some("staleness"), true),
    ];
    for (policy, m) in [
        (Policy::PipeDream, 1),
        (Policy::PipeDreamNoStash, 1),
        (Policy::VerticalSync, 1),
        (Policy::TwoBw, 3),
    ] {
        for (warmup, scaling, predict) in remedies {
            let mut s = settings(policy, m);
            s.sync_warmup = warmup;
            s.lr_scaling = scaling.map(str::to_string);
            let fitting = if policy == Policy::PipeDreamNoStash {
                "discrepancy:0.8"
            } else {
                "lookahead:0.8"
            };
            s.weight_prediction = predict.then(|| fitting.to_string());
            let cfg = s.resolve().unwrap();
            let got = pipelined(&cfg, false);
            let (want, losses) = reference(&cfg);
            assert!(
                bits(&got.report.params) == bits(&want),
                "{policy} {}: the pipelined run differs from the reference trainer",
                cfg.remedies.label()
            );
            assert_eq!(losses.len() as u64, got.report.steps);
            // Each epoch's training loss is the mean of its updates' losses.
            let per_epoch = losses.len() / got.report.epochs.len();
            for (e, epoch) in got.report.epochs.iter().enumerate() {
                let want = losses[e * per_epoch..(e + 1) * per_epoch]
                    .iter()
                    .sum::<f64>()
                    / per_epoch as f64;
                assert!(
                    (epoch.train_loss - want).abs() <= 1e-9 * want.abs(),
                    "{policy}: epoch {} train loss {} against {want}",
                    e + 1,
                    epoch.train_loss
                );
            }
            // Not a remedy that changes nothing: the weights differ from the plain run's
            // (except PipeMare's scaling under 2BW, whose delay of one leaves `tau^-p` at 1).
            if policy == Policy::TwoBw && warmup.is_none() && scaling == Some("pipemare:40") {
                continue;
            }
            let plain = reference(&settings(policy, m).resolve().unwrap()).0;
            assert!(
                bits(&plain) != bits(&want),
                "{policy} {}: the remedy changed nothing",
                cfg.remedies.label()
            );
        }
    }
}

#[test]
fn a_synchronous_warm_up_has_no_delay_until_it_ends() {
    let mut s = settings(Policy::PipeDreamNoStash, 1);
    s.sync_warmup = Some(10);
    let cfg = s.resolve().unwrap();
    let out = pipelined(&cfg, true);
    assert!(!out.ledger.is_empty());
    // Updates 0..10 (microbatches 0..10 at one microbatch per update) were synchronous:
    // forward and backward on the weights the update steps from.
    for e in out.ledger.iter().filter(|e| e.update < 10) {
        assert_eq!((e.forward_delay(), e.backward_delay()), (0, 0), "{e:?}");
    }
    // Afterwards stage 0 of four runs three updates behind, as pipedream-nostash does.
    let late = out
        .ledger
        .iter()
        .filter(|e| e.stage == 0 && e.update >= 20)
        .map(|e| e.forward_delay())
        .max();
    assert_eq!(late, Some(3));
    // Every (stage, microbatch) appears once: 4 stages x 48 microbatches x 2 epochs.
    assert_eq!(out.ledger.len(), 4 * 48 * 2);
}

#[test]
fn the_ledger_shows_each_policys_delays() {
    let want = [
        (Policy::PipeDream, 1, [3, 2, 1, 0], [3, 2, 1, 0]),
        (Policy::PipeDreamNoStash, 1, [3, 2, 1, 0], [0, 0, 0, 0]),
        (Policy::TwoBw, 3, [1, 1, 1, 1], [1, 1, 1, 1]),
        (Policy::OneFOneBFlush, 3, [0, 0, 0, 0], [0, 0, 0, 0]),
    ];
    for (policy, m, fwd, bwd) in want {
        let out = pipelined(&settings(policy, m).resolve().unwrap(), true);
        // The staleness each epoch reports per stage is the mean backward delay of its
        // gradients, as the ledger has it.
        for (e, epoch) in out.report.epochs.iter().enumerate() {
            let first = e as u64 * 48;
            for st in &epoch.stages {
                let delays: Vec<f64> = out
                    .ledger
                    .iter()
                    .filter(|x| x.stage == st.stage && (first..first + 48).contains(&x.mb))
                    .map(|x| x.backward_delay() as f64)
                    .collect();
                let mean = delays.iter().sum::<f64>() / delays.len() as f64;
                assert!(
                    (st.staleness - mean).abs() < 1e-12,
                    "{policy} epoch {} stage {}: staleness {} against the ledger's {mean}",
                    e + 1,
                    st.stage,
                    st.staleness
                );
            }
        }
        for s in 0..4u32 {
            let of = |f: fn(&pipe_stages::pipeline::LedgerEntry) -> u64| {
                out.ledger
                    .iter()
                    .filter(|e| e.stage == s)
                    .map(f)
                    .max()
                    .unwrap()
            };
            assert_eq!(
                (of(|e| e.forward_delay()), of(|e| e.backward_delay())),
                (fwd[s as usize], bwd[s as usize]),
                "{policy} stage {s}"
            );
        }
    }
}

#[test]
fn lr_scaling_factors_follow_their_formulas() {
    assert_eq!(LrScaling::None.factor(7, 0), 1.0);
    assert_eq!(LrScaling::Staleness.factor(3, 1000), 0.25);
    assert_eq!(LrScaling::Staleness.factor(0, 0), 1.0);
    let pm = LrScaling::PipeMare { anneal: 100 };
    assert!((pm.factor(4, 0) - 0.25).abs() < 1e-7);
    assert!((pm.factor(4, 50) - 0.5).abs() < 1e-7);
    assert_eq!(pm.factor(4, 100), 1.0);
    assert_eq!(pm.factor(4, 500), 1.0);
    assert_eq!(pm.factor(1, 0), 1.0);
    for text in ["none", "staleness", "pipemare:30"] {
        assert_eq!(text.parse::<LrScaling>().unwrap().to_string(), text);
    }
    for bad in ["pipemare:0", "pipemare", "fast"] {
        assert!(bad.parse::<LrScaling>().is_err(), "{bad}");
    }
}

#[test]
fn remedies_are_refused_where_they_do_not_apply() {
    let mut s = settings(Policy::Gpipe, 2);
    s.lr_scaling = Some("staleness".into());
    let err = s.resolve().unwrap_err().to_string();
    assert!(err.contains("asynchronous"), "{err}");
    let mut s = settings(Policy::PipeDream, 1);
    s.weight_prediction = Some("discrepancy".into());
    let err = s.resolve().unwrap_err().to_string();
    assert!(err.contains("pipedream-nostash"), "{err}");
    let mut s = settings(Policy::PipeDreamNoStash, 1);
    s.weight_prediction = Some("lookahead".into());
    let err = s.resolve().unwrap_err().to_string();
    assert!(err.contains("look-ahead"), "{err}");
    for bad in ["lookahead:1.5", "ahead", "discrepancy:x"] {
        let mut s = settings(Policy::PipeDream, 1);
        s.weight_prediction = Some(bad.into());
        assert!(s.resolve().is_err(), "{bad}");
    }
    // One stage has no stale gradient but under 2bw, whose updates lag by design.
    for policy in [
        Policy::PipeDream,
        Policy::PipeDreamNoStash,
        Policy::VerticalSync,
    ] {
        let mut s = common::small_pipeline(policy, 1, 2);
        s.lr_scaling = Some("staleness".into());
        let err = s.resolve().unwrap_err().to_string();
        assert!(err.contains("do nothing on one stage"), "{policy}: {err}");
    }
    let mut s = common::small_pipeline(Policy::TwoBw, 1, 2);
    s.lr_scaling = Some("staleness".into());
    s.resolve().unwrap();
}
