//! Training-loop properties of a run with no pipeline flag (one worker over the whole model,
//! through the executor's segment loop): it learns, it is reproducible bit for bit, and its
//! result does not depend on the thread count. Optimizer updates match hand-computed values.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{bits, load};
use pipe_kernels::{Backend, CpuBackend, Tensor, UpdateSeen};
use pipe_stages::config::{ModelChoice, RunConfig, TrainSettings};
use pipe_stages::data::Splits;
use pipe_stages::model::{Guarded, Model, Params};
use pipe_stages::optim::{
    LrScheduleKind, NO_ROLES, Optimizer, OptimizerConfig, OptimizerKind, StepSeen,
};
use pipe_stages::pipeline::Quiet;
use pipe_stages::pipeline::{PipelineTrainOptions, train_pipelined};
use pipe_stages::train::{TrainReport, load_data};

fn train(cfg: &RunConfig, data: &Splits) -> TrainReport {
    train_pipelined(cfg, data, &mut Quiet, &PipelineTrainOptions::default())
        .unwrap()
        .report
}

fn settings() -> TrainSettings {
    TrainSettings {
        epochs: Some(8),
        microbatch_size: Some(32),
        microbatches: Some(2),
        lr: Some(0.05),
        seed: Some(7),
        ..common::on_teacher("mlp-32-64-64-4", [32, 4, 16, 2048, 512])
    }
}

#[test]
fn learns_the_synthetic_teacher() {
    let cfg = settings().resolve().unwrap();
    assert!(!cfg.pipelined);
    let data = load(&cfg);
    let r = train(&cfg, &data);
    let last = r.epochs.last().unwrap();
    assert!(last.test_accuracy > 0.8, "accuracy {}", last.test_accuracy);
    assert!(r.epochs[0].train_loss > last.train_loss);
}

#[test]
fn reproducible_and_thread_count_independent() {
    let mut s = settings();
    s.epochs = Some(1);
    let wide = common::on_teacher("mlp-32-512-300-4", [32, 4, 16, 1024, 64]);
    (s.model, s.synthetic) = (wide.model, wide.synthetic);
    s.microbatch_size = Some(256);
    let data = load(&s.clone().resolve().unwrap());
    let runs: Vec<Vec<u32>> = [1usize, 2, 2, 3]
        .iter()
        .map(|&threads| {
            let mut each = s.clone();
            each.threads = Some(threads);
            bits(&train(&each.resolve().unwrap(), &data).params)
        })
        .collect();
    for r in &runs[1..] {
        assert!(
            r == &runs[0],
            "parameters differ between runs or thread counts"
        );
    }
}

#[test]
fn steps_cap_and_config_errors() {
    let mut s = settings();
    s.steps = Some(5);
    let cfg = s.resolve().unwrap();
    let data = load(&cfg);
    let r = train(&cfg, &data);
    assert_eq!(r.steps, 5);
    for bad in [
        TrainSettings {
            epochs: Some(0),
            ..settings()
        },
        TrainSettings {
            microbatch_size: Some(0),
            ..settings()
        },
        TrainSettings {
            lr: Some(-1.0),
            ..settings()
        },
        TrainSettings {
            model: Some(ModelChoice::Preset("resnet".into())),
            ..settings()
        },
        TrainSettings {
            momentum: Some(1.5),
            ..settings()
        },
    ] {
        assert!(bad.resolve().is_err());
    }
    // A model whose input width does not fit the data.
    let mut s = settings();
    s.model = Some(ModelChoice::Preset("mlp-30-8-4".into()));
    let cfg = s.resolve().unwrap();
    let e = load_data(&cfg, &Model::new(&cfg.model).unwrap()).unwrap_err();
    assert!(e.to_string().contains("takes 30 input features"), "{e}");
    let parsed =
        TrainSettings::from_toml("epochs = 3\nlr_schedule = \"warmup\"\n", "t.toml").unwrap();
    assert_eq!(parsed.lr_schedule, Some(LrScheduleKind::Warmup));
    assert!(TrainSettings::from_toml("epochs = \"x\"", "t.toml").is_err());
    assert!(TrainSettings::from_toml("bogus = 1", "t.toml").is_err());
}

fn one_param(v: &[f32]) -> Params {
    vec![vec![Tensor::from_vec(&[v.len()], v.to_vec()).unwrap()]]
}

#[test]
fn optimizers_match_hand_computation() {
    let be = CpuBackend::new(1).unwrap();
    let g = one_param(&[0.5, -1.0]);
    // SGD, momentum 0.9, weight decay 0.1, two steps.
    let cfg = OptimizerConfig {
        kind: OptimizerKind::Sgd,
        momentum: 0.9,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut p = one_param(&[1.0, 2.0]);
    let mut o = Optimizer::new(cfg, &p, NO_ROLES);
    o.step(&be, &mut p, &g, 0.1).unwrap();
    o.step(&be, &mut p, &g, 0.1).unwrap();
    let (mut w, mut b) = ([1.0f32, 2.0], [0.0f32; 2]);
    for _ in 0..2 {
        for i in 0..2 {
            let d = g[0][0].host().unwrap()[i] + 0.1 * w[i];
            b[i] = 0.9 * b[i] + d;
            w[i] -= 0.1 * b[i];
        }
    }
    assert_eq!(p[0][0].host().unwrap(), &w);
    // Nesterov.
    let cfg = OptimizerConfig {
        kind: OptimizerKind::Sgd,
        momentum: 0.5,
        nesterov: true,
        ..Default::default()
    };
    let mut p = one_param(&[1.0]);
    let mut o = Optimizer::new(cfg, &p, NO_ROLES);
    o.step(&be, &mut p, &one_param(&[2.0]), 0.1).unwrap();
    assert!((p[0][0].host().unwrap()[0] - (1.0 - 0.1 * (2.0 + 0.5 * 2.0))).abs() < 1e-7);
    // Adam's first step moves each weight by lr (sign of the gradient).
    for kind in [OptimizerKind::Adam, OptimizerKind::Adamw] {
        let cfg = OptimizerConfig {
            kind,
            momentum: 0.0,
            ..Default::default()
        };
        let mut p = one_param(&[1.0, 2.0]);
        let mut o = Optimizer::new(cfg, &p, NO_ROLES);
        o.step(&be, &mut p, &g, 0.01).unwrap();
        assert!((p[0][0].host().unwrap()[0] - 0.99).abs() < 1e-6);
        assert!((p[0][0].host().unwrap()[1] - 2.01).abs() < 1e-6);
    }
    // AdamW decays the weights directly, Adam through the gradient.
    let mut p = one_param(&[1.0]);
    let cfg = OptimizerConfig {
        kind: OptimizerKind::Adamw,
        momentum: 0.0,
        weight_decay: 0.5,
        ..Default::default()
    };
    Optimizer::new(cfg, &p, NO_ROLES)
        .step(&be, &mut p, &one_param(&[0.0]), 0.1)
        .unwrap();
    assert!((p[0][0].host().unwrap()[0] - 0.95).abs() < 1e-6);
    assert_eq!(be.name(), "cpu");
}

/// An orthogonal `n x n` matrix: the product of plane rotations `(i, j, angle)`.
fn rotations(n: usize, planes: &[(usize, usize, f64)]) -> Vec<Vec<f64>> {
    let mut q: Vec<Vec<f64>> = (0..n)
        .map(|i| (0..n).map(|j| f64::from(u8::from(i == j))).collect())
        .collect();
    for &(i, j, angle) in planes {
        let (c, s) = (angle.cos(), angle.sin());
        for row in q.iter_mut() {
            let (a, b) = (row[i], row[j]);
            row[i] = c * a - s * b;
            row[j] = s * a + c * b;
        }
    }
    q
}

/// `U [diag(s) 0] V^T` for `U` (`m x m`) and `V` (`n x n`), row-major.
fn from_svd(u: &[Vec<f64>], s: &[f64], v: &[Vec<f64>]) -> Vec<f64> {
    let (m, n) = (u.len(), v.len());
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..s.len()).map(|k| u[i][k] * s[k] * v[j][k]).sum();
        }
    }
    out
}

/// Muon's orthogonalisation in closed form: for `g = U [diag(s) 0] V^T`, five Newton-Schulz
/// rounds keep `U` and `V` and map each singular value of `g / |g|_F` through the quintic
/// `f(x) = a x + b x^3 + c x^5` five times; a tall matrix (taken through its transpose) gives
/// the transposed result, and a zero matrix stays zero.
#[test]
fn newton_schulz_maps_each_singular_value_through_its_quintic_and_keeps_the_vectors() {
    use pipe_stages::optim::{NEWTON_SCHULZ, newton_schulz};
    let be = CpuBackend::new(1).unwrap();
    let u = rotations(3, &[(0, 1, 0.3), (1, 2, -1.1), (0, 2, 0.7)]);
    let v = rotations(5, &[(0, 1, 0.5), (2, 3, 1.3), (1, 4, -0.4), (0, 3, 0.9)]);
    let s = [3.0, 1.0, 0.25];
    let norm = s.iter().map(|x| x * x).sum::<f64>().sqrt();
    let (a, b, c) = NEWTON_SCHULZ;
    let (a, b, c) = (f64::from(a), f64::from(b), f64::from(c));
    let mapped: Vec<f64> = s
        .iter()
        .map(|&x| (0..5).fold(x / norm, |x, _| a * x + b * x.powi(3) + c * x.powi(5)))
        .collect();
    let g = from_svd(&u, &s, &v);
    let want = from_svd(&u, &mapped, &v);
    let wide = Tensor::from_vec(&[3, 5], g.iter().map(|&x| x as f32).collect()).unwrap();
    let got = newton_schulz(&be, &wide, 5).unwrap();
    assert_eq!(got.shape(), &[3, 5]);
    for (x, w) in got.host().unwrap().iter().zip(&want) {
        assert!((f64::from(*x) - w).abs() < 1e-4, "{x} against {w}");
    }
    // The singular values land near 1, the update Muon wants, though they differ by 12x.
    assert!(
        mapped.iter().all(|&m| (0.6..1.25).contains(&m)),
        "{mapped:?}"
    );
    // The transpose.
    let tall_values: Vec<f32> = (0..5)
        .flat_map(|j| (0..3).map(move |i| (i, j)))
        .map(|(i, j)| g[i * 5 + j] as f32)
        .collect();
    let tall = Tensor::from_vec(&[5, 3], tall_values).unwrap();
    let got = newton_schulz(&be, &tall, 5).unwrap();
    assert_eq!(got.shape(), &[5, 3]);
    let got = got.host().unwrap();
    for i in 0..3 {
        for j in 0..5 {
            let (x, w) = (f64::from(got[j * 3 + i]), want[i * 5 + j]);
            assert!((x - w).abs() < 1e-4, "({j}, {i}): {x} against {w}");
        }
    }
    let zero = newton_schulz(&be, &Tensor::zeros(&[3, 5]), 5).unwrap();
    assert!(zero.host().unwrap().iter().all(|&x| x == 0.0));
}

/// Muon on one hidden matrix and one bias, by hand: the matrix moves by the orthogonalised
/// Nesterov momentum scaled to AdamW's size, the bias by AdamW's first step (the sign of its
/// gradient times the rate), both after decoupled weight decay.
#[test]
fn muon_steps_hidden_matrices_by_their_orthogonalised_momentum_and_the_rest_by_adamw() {
    use pipe_stages::optim::{MUON_RMS_SCALE, newton_schulz};
    let be = CpuBackend::new(1).unwrap();
    let w0: Vec<f32> = (0..6).map(|i| 0.1 * i as f32 - 0.2).collect();
    let g0: Vec<f32> = vec![0.3, -0.1, 0.2, 0.05, -0.4, 0.15];
    let mut p: Params = vec![vec![
        Tensor::from_vec(&[2, 3], w0.clone()).unwrap(),
        Tensor::from_vec(&[2], vec![1.0, -1.0]).unwrap(),
    ]];
    let g: Params = vec![vec![
        Tensor::from_vec(&[2, 3], g0.clone()).unwrap(),
        Tensor::from_vec(&[2], vec![0.5, -0.5]).unwrap(),
    ]];
    let cfg = OptimizerConfig {
        kind: OptimizerKind::Muon,
        momentum: 0.95,
        nesterov: true,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut o = Optimizer::new(cfg, &p, &[vec![true, false]]);
    // Muon keeps one buffer for the matrix, AdamW two for the bias.
    assert!(o.state()[0][0].second.is_empty() && !o.state()[0][1].second.is_empty());
    let lr = 0.02;
    o.step(&be, &mut p, &g, lr).unwrap();
    // From a zero momentum: buf = g, u = g + 0.95 g.
    let u: Vec<f32> = g0.iter().map(|x| x + 0.95 * x).collect();
    let o_u = newton_schulz(&be, &Tensor::from_vec(&[2, 3], u).unwrap(), 5).unwrap();
    let scale = MUON_RMS_SCALE * 3f32.sqrt();
    for ((got, w), o) in p[0][0]
        .host()
        .unwrap()
        .iter()
        .zip(&w0)
        .zip(o_u.host().unwrap())
    {
        let want = w * (1.0 - lr * 0.1) - lr * scale * o;
        assert!((got - want).abs() < 1e-6, "{got} against {want}");
    }
    let bias = p[0][1].host().unwrap();
    assert!(
        (bias[0] - (1.0 * (1.0 - lr * 0.1) - lr)).abs() < 1e-5,
        "{bias:?}"
    );
    assert!(
        (bias[1] - (-(1.0 - lr * 0.1) + lr)).abs() < 1e-5,
        "{bias:?}"
    );
}

/// The base optimizers of the delayed-quadratic closed forms below, in f64: SGD
/// (`u_t = lr g_t`), SGD with momentum (`b_t = mu b_{t-1} + g_t`, `u_t = lr b_t`) and AdamW
/// (bias-corrected moments, decoupled decay: `u_t = lr (m_hat / (sqrt(v_hat) + eps) + wd w_t)`),
/// with the f32 optimizer each stands for.
struct ClosedForm {
    kind: &'static str,
    b: f64,
    m: f64,
    v: f64,
}

impl ClosedForm {
    const LR: f64 = 0.1;
    const MU: f64 = 0.9;
    const WD: f64 = 0.01;
    const BETAS: (f64, f64) = (0.9, 0.999);
    const EPS: f64 = 1e-8;
    /// The quadratic `f(w) = A w^2 / 2` and where it starts.
    const A: f64 = 0.8;
    const W0: f64 = 1.5;
    const KINDS: [&'static str; 3] = ["sgd", "momentum", "adamw"];

    fn new(kind: &'static str) -> Self {
        ClosedForm {
            kind,
            b: 0.0,
            m: 0.0,
            v: 0.0,
        }
    }

    /// The optimizer this form describes, with `correction` at `strength`.
    fn config(
        &self,
        correction: pipe_stages::optim::DelayCorrection,
        strength: f64,
    ) -> OptimizerConfig {
        OptimizerConfig {
            kind: if self.kind == "adamw" {
                OptimizerKind::Adamw
            } else {
                OptimizerKind::Sgd
            },
            momentum: if self.kind == "momentum" {
                Self::MU as f32
            } else {
                0.0
            },
            weight_decay: if self.kind == "adamw" {
                Self::WD as f32
            } else {
                0.0
            },
            delay_correction: correction,
            correction_strength: strength as f32,
            ..Default::default()
        }
    }

    /// Update `t` (from 1) from gradient `g` at weights `w`.
    fn update(&mut self, g: f64, w: f64, t: i32) -> f64 {
        let (b1, b2) = Self::BETAS;
        match self.kind {
            "sgd" => Self::LR * g,
            "momentum" => {
                self.b = Self::MU * self.b + g;
                Self::LR * self.b
            }
            _ => {
                self.m = b1 * self.m + (1.0 - b1) * g;
                self.v = b2 * self.v + (1.0 - b2) * g * g;
                let (mh, vh) = (self.m / (1.0 - b1.powi(t)), self.v / (1.0 - b2.powi(t)));
                Self::LR * (mh / (vh.sqrt() + Self::EPS) + Self::WD * w)
            }
        }
    }

    /// f32 against f64, absolute: Adam's m / sqrt(v) amplifies rounding where the gradient
    /// changes sign, so its trajectory is held to 5e-5 and SGD's to 1e-6; a correction's
    /// terms are of the update's size (about 0.1 here), so a wrong formula is far outside
    /// either.
    fn tolerance(&self) -> f64 {
        if self.kind == "adamw" { 5e-5 } else { 1e-6 }
    }
}

/// One weight as the optimizer's parameters.
fn scalar(w: f64) -> Params {
    vec![vec![Tensor::from_vec(&[1], vec![w as f32]).unwrap()]]
}

/// Error feedback in closed form on a quadratic `f(w) = a w^2 / 2` with the one-step delay of
/// 2bw (each gradient is taken at the weights before the last update, `g_t = a w_{t-1}`):
/// with `u_t` the optimizer's update from `g_t` ([`ClosedForm`]), the weights follow
/// `w_{t+1} = w_t - u_t - c (u_t - u_{t-1})` (the first step plain). Checked in f64 against
/// the optimizer's f32 trajectory for SGD, SGD with momentum and AdamW.
#[test]
fn error_feedback_follows_its_closed_form_on_a_delayed_quadratic() {
    use pipe_stages::optim::{Corrected, DelayCorrection, UpdateMean};
    let be = CpuBackend::new(1).unwrap();
    let (a, c, w0) = (ClosedForm::A, 0.7f64, ClosedForm::W0);
    for kind in ClosedForm::KINDS {
        let mut form = ClosedForm::new(kind);
        let mut p = scalar(w0);
        let mut opt = Corrected::new(
            form.config(DelayCorrection::ErrorFeedback, c),
            &p,
            &[vec![false]],
        );
        let (mut w, mut prev_w, mut last_u) = (w0, w0, 0.0f64);
        let mut stale = w0 as f32;
        for t in 1..=40 {
            let u = form.update(a * prev_w, w, t);
            let next = if t == 1 {
                w - u
            } else {
                w - u - c * (u - last_u)
            };
            (prev_w, w, last_u) = (w, next, u);
            // The optimizer, given the gradient at the weights before its last update.
            let now = p[0][0].host().unwrap()[0];
            let mut grad = scalar(a * f64::from(stale));
            let mean = (UpdateMean::new(1), 1);
            opt.step(&be, &mut p, &mut grad, mean, ClosedForm::LR as f32)
                .unwrap();
            stale = now;
            let got = f64::from(p[0][0].host().unwrap()[0]);
            assert!(
                (got - w).abs() <= form.tolerance(),
                "{kind}, step {t}: {got} against the formula's {w}"
            );
        }
    }
}

/// DC-ASGD in closed form on the same delayed quadratic (`g_t = a w_{t-1}`, computed at the
/// stale weights `w_s = w_{t-1}` and applied at `w_t`): the optimizer steps from
/// `g'_t = g_t + lambda_t g_t^2 (w_t - w_{t-1})`, with `lambda_t = lambda` (plain) or
/// `lambda_0 / sqrt(MS_t + 1e-7)`, `MS_t = 0.95 MS_{t-1} + 0.05 g_t^2` (adaptive). Checked in
/// f64 against the optimizer's f32 trajectory for SGD, SGD with momentum and AdamW. The
/// strengths are large enough that the compensation moves each step by a tenth or more.
#[test]
fn dc_asgd_follows_its_closed_form_on_a_delayed_quadratic() {
    use pipe_stages::optim::{Corrected, DelayCorrection, UpdateMean};
    let be = CpuBackend::new(1).unwrap();
    let (a, w0) = (ClosedForm::A, ClosedForm::W0);
    for (correction, lambda) in [
        (DelayCorrection::DcAsgd, 2.0f64),
        (DelayCorrection::DcAsgdAdaptive, 0.5f64),
    ] {
        for kind in ClosedForm::KINDS {
            let mut form = ClosedForm::new(kind);
            let mut p = scalar(w0);
            let mut opt = Corrected::new(form.config(correction, lambda), &p, &[vec![false]]);
            let (mut w, mut prev_w, mut ms) = (w0, w0, 0.0f64);
            let mut largest_share = 0.0f64;
            let mut before = p.clone();
            for t in 1..=40 {
                let g = a * prev_w;
                let l = if correction == DelayCorrection::DcAsgd {
                    lambda
                } else {
                    ms = 0.95 * ms + 0.05 * g * g;
                    lambda / (ms + 1e-7).sqrt()
                };
                let compensation = l * g * g * (w - prev_w);
                largest_share = largest_share.max((compensation / g).abs());
                let u = form.update(g + compensation, w, t);
                // The optimizer: the gradient at the weights before its last update.
                let current = p.clone();
                let stale_w = before[0][0].host().unwrap()[0];
                let mut grad = scalar(a * f64::from(stale_w));
                let mean = (UpdateMean::new(1), 1);
                opt.compensate(&be, &mut grad, mean, || {
                    Ok((&current, std::borrow::Cow::Borrowed(&before)))
                })
                .unwrap();
                opt.step(&be, &mut p, &mut grad, mean, ClosedForm::LR as f32)
                    .unwrap();
                before = current;
                (prev_w, w) = (w, w - u);
                let got = f64::from(p[0][0].host().unwrap()[0]);
                assert!(
                    (got - w).abs() <= form.tolerance(),
                    "{correction:?} {kind}, step {t}: {got} against the formula's {w}"
                );
            }
            assert!(
                largest_share > 0.1,
                "{correction:?} {kind}: the compensation never mattered ({largest_share})"
            );
        }
    }
}

/// The guards on a stage's tensors name the first parameter (in the model's table) that holds
/// a value that is not finite, and the update: the gradients before a step, the weights after.
#[test]
fn the_finiteness_guards_name_the_first_non_finite_parameter_and_the_update() {
    let model = Model::new(&pipe_stages::model::ModelSpec::preset("mlp-20-30-5").unwrap()).unwrap();
    let be = CpuBackend::new(1).unwrap();
    let mut params = model.init_params(1);
    model
        .check_finite(&be, (0, &params), Guarded::Weights, 7)
        .unwrap();
    model
        .check_finite(&be, (0, &params), Guarded::Gradients, 7)
        .unwrap();
    for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
        let mut values = params[3][0].host().unwrap().to_vec();
        values[17] = bad;
        params[3][0] = Tensor::from_vec(params[3][0].shape(), values).unwrap();
        let e = model
            .check_finite(&be, (0, &params), Guarded::Weights, 7)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "the parameter layers.3.weight after the optimizer's step is not finite at update 7"
            ),
            "{e}"
        );
        let e = model
            .check_finite(&be, (0, &params), Guarded::Gradients, 7)
            .unwrap_err()
            .to_string();
        assert!(e.contains("the gradient of layers.3.weight"), "{e}");
        // A stage's own layers, numbered from its first: the same name.
        let stage = params[3..].to_vec();
        let e = model
            .check_finite(&be, (3, &stage), Guarded::Weights, 2)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("layers.3.weight") && e.contains("update 2"),
            "{e}"
        );
    }
}

/// The guard on one update with what its kernels saw ([`StepSeen`]): the first parameter in
/// order whose gradient is not finite is named, whether a kernel saw it or a scan found it,
/// before any whose weights are not; a tensor a kernel saw finite is not scanned again.
#[test]
fn the_guard_on_an_update_takes_what_its_kernels_saw_and_scans_the_rest() {
    let model = Model::new(&pipe_stages::model::ModelSpec::preset("mlp-20-30-5").unwrap()).unwrap();
    let be = CpuBackend::new(1).unwrap();
    let params = model.init_params(1);
    // The first and the last layer that hold parameters, each with a weight and a bias.
    let held: Vec<usize> = (0..params.len())
        .filter(|&i| params[i].len() == 2)
        .collect();
    let (early, late) = (held[0], held[held.len() - 1]);
    assert!(early < late);
    let (early_w, late_w) = (
        format!("layers.{early}.weight"),
        format!("layers.{late}.weight"),
    );
    let with_nan = |at: (usize, usize)| {
        let mut p = params.clone();
        let mut values = p[at.0][at.1].host().unwrap().to_vec();
        values[3] = f32::NAN;
        p[at.0][at.1] = Tensor::from_vec(p[at.0][at.1].shape(), values).unwrap();
        p
    };
    let seen = |f: &dyn Fn((usize, usize)) -> UpdateSeen| {
        StepSeen(
            params
                .iter()
                .enumerate()
                .map(|(i, l)| (0..l.len()).map(|s| f((i, s))).collect())
                .collect(),
        )
    };
    let finite = UpdateSeen {
        grad: Some(true),
        param: Some(true),
    };
    let unseen = seen(&|_| UpdateSeen::default());
    let message = |grads: &Params, weights: &Params, s: &StepSeen| {
        model
            .check_update(&be, (0, grads, weights), &s.0, 9)
            .err()
            .map(|e| e.to_string())
    };
    assert_eq!(message(&params, &params, &unseen), None);
    assert_eq!(message(&params, &params, &seen(&|_| finite)), None);
    // Nothing seen: the scans find it.
    let e = message(&with_nan((late, 0)), &params, &unseen).unwrap();
    assert!(
        e.contains(&format!("the gradient of {late_w}")) && e.contains("update 9"),
        "{e}"
    );
    let e = message(&params, &with_nan((early, 1)), &unseen).unwrap();
    let bias = format!("the parameter layers.{early}.bias after the optimizer's step");
    assert!(e.contains(&bias), "{e}");
    // A kernel's word is taken: a tensor it saw finite is not scanned again.
    let e = message(&with_nan((late, 0)), &params, &seen(&|_| finite));
    assert_eq!(e, None, "a tensor seen finite was scanned");
    // A gradient a kernel saw bad late against one a scan finds early: the early one first.
    let bad_late = seen(&|at| match at {
        (i, 0) if i == late => UpdateSeen {
            grad: Some(false),
            param: Some(false),
        },
        (i, _) if i == early => UpdateSeen::default(),
        _ => finite,
    });
    let e = message(&with_nan((early, 0)), &params, &bad_late).unwrap();
    assert!(e.contains(&format!("the gradient of {early_w}")), "{e}");
    let e = message(&params, &params, &bad_late).unwrap();
    assert!(e.contains(&format!("the gradient of {late_w}")), "{e}");
    // Weights after the step, only where no gradient is.
    let weights_late = seen(&|at| match at {
        (i, 0) if i == late => UpdateSeen {
            grad: Some(true),
            param: Some(false),
        },
        _ => finite,
    });
    let e = message(&params, &params, &weights_late).unwrap();
    assert!(e.contains(&format!("the parameter {late_w} after")), "{e}");
}
