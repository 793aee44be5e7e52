//! Finite-difference gradient checks for every layer, for the loss and for a whole model.
//!
//! The objective is `L = sum(y * r)` for a fixed random `r`, so `dL/dy = r`; analytic input and
//! parameter gradients are compared with central differences computed in f64 sums over f32 math.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_kernels::{Backend, CpuBackend, Tensor};
use pipe_stages::documents::Documents;
use pipe_stages::layers::{ForwardCtx, Layer, LayerSpec};
use pipe_stages::model::{Model, ModelSpec};
use pipe_stages::rng::rng_for;
use rand::Rng;

fn rand_t(shape: &[usize], seed: u64, away_from_zero: bool) -> Tensor {
    let mut rng = rng_for(seed, "test", 0);
    let n = shape.iter().product();
    let data = (0..n)
        .map(|_| {
            let v: f32 = rng.random_range(-1.0..1.0);
            if away_from_zero {
                v.signum() * (0.2 + v.abs())
            } else {
                v
            }
        })
        .collect();
    Tensor::from_vec(shape, data).unwrap()
}

fn objective(y: &Tensor, r: &Tensor) -> f64 {
    y.host()
        .unwrap()
        .iter()
        .zip(r.host().unwrap())
        .map(|(a, b)| *a as f64 * *b as f64)
        .sum()
}

const H: f32 = 1e-2;

/// Central differences of an objective in each of `n` values: `(f(i, H) - f(i, -H)) / 2H`,
/// where `f(i, d)` is the objective with value `i` moved by `d`.
fn central(n: usize, f: impl Fn(usize, f32) -> f64) -> Vec<f64> {
    (0..n)
        .map(|i| (f(i, H) - f(i, -H)) / (2.0 * H as f64))
        .collect()
}

/// `t` with value `i` moved by `d`.
fn moved(t: &Tensor, i: usize, d: f32) -> Tensor {
    let mut t = t.clone();
    t.host_mut().unwrap()[i] += d;
    t
}

fn check(name: &str, analytic: &[f32], numeric: &[f64]) {
    let scale = numeric.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
    for (i, (a, n)) in analytic.iter().zip(numeric).enumerate() {
        let err = (*a as f64 - n).abs() / scale;
        assert!(
            err < 2e-2,
            "{name}[{i}]: analytic {a}, numeric {n} (relative error {err:.3e})"
        );
    }
}

/// Checks one layer's input and parameter gradients at a random `x`.
fn grad_check_layer(spec: LayerSpec, x_shape: &[usize], away_from_zero: bool) {
    grad_check_at(spec, rand_t(x_shape, 2, away_from_zero), true);
}

/// Checks one layer's parameter gradients, and its input gradient when `input_grad`, at `x`;
/// and that the fused backward gives the bits of its two halves.
fn grad_check_at(spec: LayerSpec, x: Tensor, input_grad: bool) {
    grad_check_in(spec, x, input_grad, None);
}

/// [`grad_check_at`] on a microbatch of packed `documents`.
fn grad_check_in(
    spec: LayerSpec,
    x: Tensor,
    input_grad: bool,
    documents: Option<std::sync::Arc<Documents>>,
) {
    let be = CpuBackend::new(1).unwrap();
    let layer: Box<dyn Layer> = spec.build(false).unwrap();
    let mut params = layer.init_params(&mut rng_for(1, "init", 0));
    // Non-trivial parameters (LayerNorm starts at ones and zeros).
    for (k, p) in params.iter_mut().enumerate() {
        let noise = rand_t(p.shape(), 100 + k as u64, false);
        for (v, n) in p.host_mut().unwrap().iter_mut().zip(noise.host().unwrap()) {
            *v += 0.3 * n;
        }
    }
    let ctx = ForwardCtx {
        train: true,
        seed: 42,
        recompute_attention: false,
        documents,
    };
    let (y, saved) = layer.forward(&be, &params, x.clone(), ctx.clone()).unwrap();
    let r = rand_t(y.shape(), 3, false);
    let dx = layer.backward_input(&be, &params, &saved, &r).unwrap();
    assert_eq!(
        dx.shape(),
        x.shape(),
        "{}: input gradient shape",
        layer.kind()
    );
    let mut grads: Vec<Tensor> = params.iter().map(|p| Tensor::zeros(p.shape())).collect();
    layer
        .backward_params(&be, &params, &saved, &r, &mut grads, false)
        .unwrap();
    let eval = |params: &[Tensor], x: &Tensor| {
        let (y, _) = layer.forward(&be, params, x.clone(), ctx.clone()).unwrap();
        objective(&y, &r)
    };
    if input_grad {
        let numeric_x = central(x.len(), |i, d| eval(&params, &moved(&x, i, d)));
        check(
            &format!("{} dx", layer.kind()),
            dx.host().unwrap(),
            &numeric_x,
        );
    }
    let mut fused: Vec<Tensor> = params.iter().map(|p| Tensor::zeros(p.shape())).collect();
    let fused_dx = layer
        .backward(&be, &params, &saved, &r, &mut fused, false, true)
        .unwrap();
    assert_eq!(fused_dx.as_ref(), Some(&dx), "{}: fused dx", layer.kind());
    assert_eq!(fused, grads, "{}: fused parameter gradients", layer.kind());
    for (k, g) in grads.iter().enumerate() {
        let numeric = central(params[k].len(), |i, d| {
            let mut p = params.clone();
            p[k] = moved(&params[k], i, d);
            eval(&p, &x)
        });
        check(
            &format!("{} param {k}", layer.kind()),
            g.host().unwrap(),
            &numeric,
        );
    }
    // Accumulating adds to what is there.
    let before = grads.clone();
    layer
        .backward_params(&be, &params, &saved, &r, &mut grads, true)
        .unwrap();
    for (a, b) in grads.iter().zip(&before) {
        for (x, y) in a.host().unwrap().iter().zip(b.host().unwrap()) {
            assert!((x - 2.0 * y).abs() <= 1e-5 * (1.0 + y.abs()));
        }
    }
}

#[test]
fn linear() {
    grad_check_layer(
        LayerSpec::Linear {
            inputs: 6,
            outputs: 5,
            bias: true,
            init: None,
        },
        &[4, 6],
        false,
    );
    grad_check_layer(
        LayerSpec::Linear {
            inputs: 6,
            outputs: 3,
            bias: false,
            init: None,
        },
        &[2, 6],
        false,
    );
}

#[test]
fn activations() {
    for spec in [
        LayerSpec::Relu,
        LayerSpec::Gelu,
        LayerSpec::Tanh,
        LayerSpec::Sigmoid,
    ] {
        grad_check_layer(spec, &[3, 7], true);
    }
}

#[test]
fn layer_norm() {
    grad_check_layer(
        LayerSpec::LayerNorm {
            features: 8,
            eps: 1e-5,
        },
        &[3, 8],
        false,
    );
}

#[test]
fn dropout_is_seeded_and_checks() {
    grad_check_layer(LayerSpec::Dropout { p: 0.3 }, &[4, 16], false);
    let be = CpuBackend::new(1).unwrap();
    let layer = LayerSpec::Dropout { p: 0.5 }.build(false).unwrap();
    let x = Tensor::full(&[8, 64], 1.0);
    let run = |seed| {
        layer
            .forward(
                &be,
                &[],
                x.clone(),
                ForwardCtx {
                    train: true,
                    seed,
                    recompute_attention: false,
                    documents: None,
                },
            )
            .unwrap()
            .0
    };
    assert_eq!(run(7), run(7), "same seed, same mask");
    assert_ne!(run(7), run(8), "another seed, another mask");
    let kept = run(7).host().unwrap().iter().filter(|v| **v != 0.0).count();
    assert!(
        (150..362).contains(&kept),
        "about half kept, got {kept} of 512"
    );
    let eval = layer
        .forward(
            &be,
            &[],
            x.clone(),
            ForwardCtx {
                train: false,
                seed: 7,
                recompute_attention: false,
                documents: None,
            },
        )
        .unwrap()
        .0;
    assert_eq!(eval, x, "identity in evaluation");
}

#[test]
fn residual_block() {
    grad_check_layer(
        LayerSpec::Residual {
            layers: vec![
                LayerSpec::LayerNorm {
                    features: 6,
                    eps: 1e-5,
                },
                LayerSpec::Linear {
                    inputs: 6,
                    outputs: 9,
                    bias: true,
                    init: None,
                },
                LayerSpec::Gelu,
                LayerSpec::Linear {
                    inputs: 9,
                    outputs: 6,
                    bias: true,
                    init: None,
                },
            ],
        },
        &[3, 6],
        false,
    );
}

#[test]
fn embedding() {
    // Ids repeat (their gradients sum) and the sequence is shorter than the context.
    let ids = Tensor::from_vec(&[2, 4], vec![3., 0., 3., 6., 1., 1., 5., 2.]).unwrap();
    grad_check_at(
        LayerSpec::Embedding {
            vocab: 7,
            width: 5,
            context: 6,
            padded_vocab: None,
        },
        ids.clone(),
        false,
    );
    // A padded table: the padding's rows take no gradient.
    grad_check_at(
        LayerSpec::Embedding {
            vocab: 7,
            width: 5,
            context: 6,
            padded_vocab: Some(9),
        },
        ids,
        false,
    );
}

#[test]
fn attention() {
    grad_check_layer(
        LayerSpec::Attention { width: 8, heads: 2 },
        &[2, 5, 8],
        false,
    );
}

/// Two windows of 6 tokens holding packed documents (end id 9): the embedding's positions
/// restart after each end id, and attention stops at each document's start.
fn packed_documents() -> (Tensor, std::sync::Arc<Documents>) {
    let ids = Tensor::from_vec(
        &[2, 6],
        vec![1., 9., 2., 3., 9., 4., 5., 6., 9., 9., 0., 2.],
    )
    .unwrap();
    let be = CpuBackend::new(1).unwrap();
    let docs = Documents::of(&be, &ids, 9).unwrap();
    (ids, std::sync::Arc::new(docs))
}

#[test]
fn embedding_attention_and_block_on_packed_documents() {
    let (ids, docs) = packed_documents();
    let spec = LayerSpec::Embedding {
        vocab: 10,
        width: 5,
        context: 6,
        padded_vocab: None,
    };
    grad_check_in(spec, ids, false, Some(docs.clone()));
    let attention = LayerSpec::Attention { width: 8, heads: 2 };
    grad_check_in(
        attention,
        rand_t(&[2, 6, 8], 2, false),
        true,
        Some(docs.clone()),
    );
    let block = LayerSpec::TransformerBlock {
        width: 8,
        heads: 2,
        hidden: Some(12),
    };
    grad_check_in(block, rand_t(&[2, 6, 8], 2, false), true, Some(docs));
}

#[test]
fn transformer_block() {
    grad_check_layer(
        LayerSpec::TransformerBlock {
            width: 8,
            heads: 2,
            hidden: Some(12),
        },
        &[2, 4, 8],
        false,
    );
}

#[test]
fn final_norm_and_lm_head() {
    grad_check_layer(
        LayerSpec::LayerNorm {
            features: 6,
            eps: 1e-5,
        },
        &[2, 3, 6],
        false,
    );
    for padded_vocab in [None, Some(8)] {
        let head = LayerSpec::LmHead {
            width: 6,
            vocab: 5,
            padded_vocab,
        };
        grad_check_layer(head, &[2, 3, 6], false);
    }
}

#[test]
fn flatten() {
    grad_check_layer(LayerSpec::Flatten, &[2, 3, 4], false);
}

#[test]
fn softmax_cross_entropy_loss() {
    let be = CpuBackend::new(1).unwrap();
    let logits = rand_t(&[4, 5], 11, false);
    // Every column a class, then the last two columns a padded vocabulary's (their numeric
    // gradient is zero: the loss does not read them).
    for (classes, labels) in [(5, vec![1u32, 0, 4, 2]), (3, vec![1u32, 0, 2, 2])] {
        let labels = Tensor::from_vec(&[4], labels).unwrap();
        let mut d = Tensor::default();
        be.softmax_cross_entropy(&logits, classes, &labels, 1.0, Some(&mut d))
            .unwrap();
        let loss = |l: &Tensor| {
            be.softmax_cross_entropy(l, classes, &labels, 1.0, None)
                .unwrap()
                .loss_sum
        };
        let numeric = central(logits.len(), |i, d| loss(&moved(&logits, i, d)));
        check("softmax_cross_entropy", d.host().unwrap(), &numeric);
    }
}

#[test]
fn whole_model() {
    let be = CpuBackend::new(1).unwrap();
    let spec = ModelSpec {
        input: vec![2, 3],
        layers: vec![
            LayerSpec::Flatten,
            LayerSpec::Linear {
                inputs: 6,
                outputs: 8,
                bias: true,
                init: None,
            },
            LayerSpec::LayerNorm {
                features: 8,
                eps: 1e-5,
            },
            LayerSpec::Gelu,
            LayerSpec::Dropout { p: 0.25 },
            LayerSpec::Linear {
                inputs: 8,
                outputs: 8,
                bias: true,
                init: None,
            },
            LayerSpec::Tanh,
            LayerSpec::Linear {
                inputs: 8,
                outputs: 4,
                bias: true,
                init: None,
            },
        ],
        tied: Vec::new(),
    };
    let model = Model::new(&spec).unwrap();
    let params = model.init_params(5);
    let x = rand_t(&[3, 2, 3], 12, false);
    let labels = Tensor::from_vec(&[3], vec![3u32, 0, 2]).unwrap();
    let loss = |params: &Vec<Vec<Tensor>>, x: &Tensor| {
        let (logits, _) = model
            .forward_range(
                &be,
                0..model.len(),
                params,
                x.clone(),
                model.training(0),
                9,
                4,
                None,
            )
            .unwrap();
        be.softmax_cross_entropy(&logits, logits.cols(), &labels, 1.0, None)
            .unwrap()
            .loss_sum
    };
    let (logits, saved) = model
        .forward_range(
            &be,
            0..model.len(),
            &params,
            x.clone(),
            model.training(0),
            9,
            4,
            None,
        )
        .unwrap();
    let mut dl = Tensor::default();
    be.softmax_cross_entropy(&logits, logits.cols(), &labels, 1.0, Some(&mut dl))
        .unwrap();
    let mut grads = model.zero_grads(0..model.len());
    let dx = model
        .backward_range(
            &be,
            0..model.len(),
            &params,
            &saved,
            (dl, true),
            &mut grads,
            false,
            &mut pipe_stages::model::no_notice,
        )
        .unwrap()
        .unwrap();
    let numeric_x = central(x.len(), |i, d| loss(&params, &moved(&x, i, d)));
    check("model dx", dx.host().unwrap(), &numeric_x);
    for (li, layer_grads) in grads.iter().enumerate() {
        for (k, g) in layer_grads.iter().enumerate() {
            let numeric = central(g.len(), |i, d| {
                let mut p = params.clone();
                p[li][k] = moved(&params[li][k], i, d);
                loss(&p, &x)
            });
            check(
                &format!("model layers.{li} param {k}"),
                g.host().unwrap(),
                &numeric,
            );
        }
    }
    assert_eq!(model.param_names()[0], "layers.1.weight");
    assert_eq!(model.param_names().len(), 8);
}

/// Matrix products a timed backend has run, over every shape and layout.
fn products(be: &pipe_kernels::Timed<CpuBackend>) -> u64 {
    be.operations()
        .iter()
        .filter(|(name, _)| name.starts_with("matmul"))
        .map(|(_, t)| t.calls)
        .sum()
}

#[test]
fn the_backward_skips_input_gradients_nobody_reads() {
    // flatten, linear 20->30, relu, linear 30->5: nothing before the first linear layer
    // trains, so its input gradient (and flatten's) is never needed from the first stage.
    let model = Model::new(&ModelSpec::preset("mlp-20-30-5").unwrap()).unwrap();
    let be = pipe_kernels::Timed::by_operation(CpuBackend::new(1).unwrap());
    let params = model.init_params(3);
    let x = rand_t(&[4, 20], 8, false);
    let labels = Tensor::from_vec(&[4], vec![1u32, 0, 4, 2]).unwrap();
    let n = model.len();
    let (logits, saved) = model
        .forward_range(&be, 0..n, &params, x, model.training(0), 1, 0, None)
        .unwrap();
    let mut dl = Tensor::default();
    be.softmax_cross_entropy(&logits, logits.cols(), &labels, 1.0, Some(&mut dl))
        .unwrap();
    let backward = |need_input_grad: bool| {
        let mut grads = model.zero_grads(0..n);
        let mut readied = Vec::new();
        let before = products(&be);
        let dx = model
            .backward_range(
                &be,
                0..n,
                &params,
                &saved,
                (dl.clone(), need_input_grad),
                &mut grads,
                false,
                &mut |layer, _| {
                    readied.push(layer);
                    Ok(())
                },
            )
            .unwrap();
        (dx, grads, readied, products(&be) - before)
    };
    let (dx, grads, readied, calls) = backward(false);
    assert!(dx.is_none());
    // The last linear layer's dW and dX, the first's dW only.
    assert_eq!(calls, 3);
    assert_eq!(
        readied,
        vec![3, 2, 1, 0],
        "every layer is reported ready, last first"
    );
    let (dx_all, grads_all, _, calls_all) = backward(true);
    assert_eq!(dx_all.unwrap().shape(), &[4, 20]);
    assert_eq!(calls_all, 4);
    let bits = |g: &[Vec<Tensor>]| -> Vec<Vec<f32>> {
        g.iter()
            .flatten()
            .map(|t| t.host().unwrap().to_vec())
            .collect()
    };
    assert_eq!(
        bits(&grads),
        bits(&grads_all),
        "the same parameter gradients"
    );
    // The split backward stops at the same layer and gives the same gradients.
    let before = products(&be);
    let (dx, dys) = model
        .backward_input_range(&be, 0..n, &params, &saved, dl.clone(), false)
        .unwrap();
    assert!(dx.is_none());
    assert_eq!(dys.len(), n);
    let mut split = model.zero_grads(0..n);
    model
        .backward_params_range(
            &be,
            0..n,
            &params,
            &saved,
            &dys,
            &mut split,
            false,
            &mut pipe_stages::model::no_notice,
        )
        .unwrap();
    assert_eq!(products(&be) - before, 3);
    assert_eq!(bits(&split), bits(&grads_all));
    assert!(!model.computes_input_grad(0) && !model.computes_input_grad(1));
    assert!(model.computes_input_grad(2) && model.computes_input_grad(3));
}
