//! The wrappers forward every operation: a timed backend, a boxed one and the emulated device
//! give the CPU backend's bits for one call of each operation, the timed one names each call in
//! its per-operation table, and the methods that ask about a backend reach the wrapped one.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_kernels::{
    Activation, AdamStep, AdamTensors, AttentionShape, Backend, CpuBackend, DelayCompensation,
    EmulatedDevice, LionStep, SgdStep, Tensor, Timed, Trans,
};

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

/// A host tensor of `shape` with values from `seed`, placed on `be`.
fn on(be: &dyn Backend, shape: &[usize], seed: u32) -> Tensor {
    let t = Tensor::from_vec(shape, values(shape.iter().product(), seed)).unwrap();
    be.place(t).unwrap()
}

/// The elements of `t`, read back from `be`.
fn host(be: &dyn Backend, t: &Tensor) -> Vec<f32> {
    be.read(t).unwrap().into_owned()
}

/// Calls every operation of [`Backend`] once on `be` and returns what each wrote or returned,
/// read back to the host, in call order.
fn every_operation(be: &dyn Backend) -> Vec<Vec<f32>> {
    let mut seen = Vec::new();
    let (a, b) = (on(be, &[4, 3], 1), on(be, &[3, 5], 2));

    let mut t = on(be, &[2, 2], 3);
    be.write(&[1.0, 2.0, 3.0, 4.0], &mut t).unwrap();
    seen.push(host(be, &t));
    let mut c = Tensor::default();
    be.copy(&a, &mut c).unwrap();
    seen.push(host(be, &c));
    be.fill(0.5, &mut c).unwrap();
    seen.push(host(be, &c));
    be.mul(&a, &a, &mut c).unwrap();
    seen.push(host(be, &c));
    be.matmul(&a, Trans::No, &b, Trans::No, &mut c, false)
        .unwrap();
    be.matmul(&a, Trans::No, &b, Trans::No, &mut c, true)
        .unwrap();
    seen.push(host(be, &c));
    be.transpose(&a, &mut c).unwrap();
    seen.push(host(be, &c));
    let bias = on(be, &[3], 4);
    let mut y = on(be, &[4, 3], 5);
    be.add_bias(&mut y, &bias).unwrap();
    seen.push(host(be, &y));
    let wide_bias = on(be, &[5], 8);
    be.linear(&a, &b, Some(&wide_bias), &mut c).unwrap();
    seen.push(host(be, &c));
    be.linear(&a, &b, None, &mut c).unwrap();
    seen.push(host(be, &c));
    let mut pre = Tensor::default();
    be.linear_activation(&a, &b, Some(&wide_bias), Activation::Gelu, &mut pre, &mut c)
        .unwrap();
    seen.push(host(be, &pre));
    seen.push(host(be, &c));
    // Back through the same weight into the GELU at `a`: `c` (4 x 5) times `b^T`.
    let mut dz = Tensor::default();
    be.linear_grad_activation(&c, &b, Activation::Gelu, &a, &mut dz)
        .unwrap();
    seen.push(host(be, &dz));
    // The weight gradients of that linear layer: `a^T c` and `c`'s column sums.
    let (mut gw, mut gb) = (Tensor::default(), Tensor::default());
    be.linear_weight_grads(&a, &c, &mut gw, Some(&mut gb), false)
        .unwrap();
    be.linear_weight_grads(&a, &c, &mut gw, Some(&mut gb), true)
        .unwrap();
    seen.push(host(be, &gw));
    seen.push(host(be, &gb));
    be.sum_rows(&a, &mut c, false).unwrap();
    be.sum_rows(&a, &mut c, true).unwrap();
    seen.push(host(be, &c));
    be.activation(Activation::Gelu, &a, &mut c).unwrap();
    seen.push(host(be, &c));
    be.activation_backward(Activation::Tanh, &a, &y, &mut c)
        .unwrap();
    seen.push(host(be, &c));

    let (gamma, beta) = (on(be, &[3], 6), on(be, &[3], 7));
    let (mut ln, mut mean, mut rstd) = (Tensor::default(), Tensor::default(), Tensor::default());
    be.layer_norm(&a, &gamma, &beta, 1e-5, &mut ln, &mut mean, &mut rstd)
        .unwrap();
    seen.push(host(be, &ln));
    seen.push(host(be, &mean));
    seen.push(host(be, &rstd));
    be.layer_norm_backward_input(&a, &gamma, &mean, &rstd, &y, &mut c)
        .unwrap();
    seen.push(host(be, &c));
    let (mut dg, mut db) = (Tensor::default(), Tensor::default());
    be.layer_norm_backward_params(&a, &mean, &rstd, &y, &mut dg, &mut db, false)
        .unwrap();
    be.layer_norm_backward_params(&a, &mean, &rstd, &y, &mut dg, &mut db, true)
        .unwrap();
    seen.push(host(be, &dg));
    seen.push(host(be, &db));

    let labels = Tensor::from_vec(&[4], vec![0, 2, 1, 2]).unwrap();
    let labels = be.place_ids(labels).unwrap();
    let stats = be
        .softmax_cross_entropy(&a, a.cols(), &labels, 0.25, Some(&mut c))
        .unwrap();
    seen.push(host(be, &c));
    let again = be
        .softmax_cross_entropy(&a, a.cols(), &labels, 1.0, None)
        .unwrap();
    assert_eq!(stats, again);
    let mut queued_grad = Tensor::default();
    let reading = be
        .queue_softmax_cross_entropy(&a, a.cols(), &labels, 0.25, Some(&mut queued_grad))
        .unwrap();
    assert_eq!(be.read_losses(vec![reading]).unwrap(), [stats]);
    seen.push(host(be, &queued_grad));
    seen.push(vec![
        stats.loss_sum as f32,
        stats.correct as f32,
        stats.rows as f32,
    ]);

    let ids = be
        .place(Tensor::from_vec(&[3], vec![2.0, 0.0, 2.0]).unwrap())
        .unwrap();
    let table = on(be, &[4, 3], 8);
    let mut e = Tensor::default();
    be.embedding(&ids, &table, &mut e).unwrap();
    seen.push(host(be, &e));
    let mut dtable = on(be, &[4, 3], 9);
    be.embedding_backward(&ids, &e, &mut dtable, true).unwrap();
    seen.push(host(be, &dtable));

    let shape = AttentionShape {
        batch: 2,
        seq: 3,
        heads: 2,
        width: 4,
    };
    let qkv = on(be, &[6, 12], 10);
    let starts = Tensor::from_vec(&[6], vec![0.0, 0.0, 2.0, 0.0, 1.0, 1.0]).unwrap();
    let starts = be.place(starts).unwrap();
    for documents in [None, Some(&starts)] {
        let (mut out, mut lse, mut dqkv) =
            (Tensor::default(), Tensor::default(), Tensor::default());
        be.attention(&qkv, documents, shape, &mut out, &mut lse)
            .unwrap();
        let dout = on(be, &[6, 4], 11);
        be.attention_backward(&qkv, documents, &out, &lse, &dout, shape, &mut dqkv)
            .unwrap();
        seen.push(host(be, &out));
        seen.push(host(be, &lse));
        seen.push(host(be, &dqkv));
    }

    let mut w = on(be, &[4, 3], 12);
    be.axpy(0.5, &a, &mut w).unwrap();
    be.scale(1.5, &mut w).unwrap();
    seen.push(host(be, &w));
    let sgd = SgdStep {
        lr: 0.1,
        momentum: 0.9,
        nesterov: true,
        weight_decay: 0.01,
    };
    let mut buf = on(be, &[4, 3], 13);
    be.sgd_update(&mut w, &a, Some(&mut buf), sgd).unwrap();
    seen.push(host(be, &w));
    seen.push(host(be, &buf));
    let adam = AdamStep {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        decoupled: true,
        bias_correction1: 0.1,
        bias_correction2: 0.001,
    };
    let (mut m, mut v) = (on(be, &[4, 3], 14), on(be, &[4, 3], 15));
    be.adam_update(&mut w, &a, &mut m, &mut v, adam).unwrap();
    seen.push(host(be, &w));
    seen.push(host(be, &m));
    seen.push(host(be, &v));
    let (mut w2, mut m2, mut v2, g2) = (
        on(be, &[5], 16),
        on(be, &[5], 17),
        on(be, &[5], 18),
        on(be, &[5], 19),
    );
    let mut list = [AdamTensors {
        param: &mut w2,
        grad: &g2,
        m: &mut m2,
        v: &mut v2,
        hp: adam,
    }];
    be.adam_updates(&mut list).unwrap();
    seen.push(host(be, &w2));
    seen.push(host(be, &m2));
    seen.push(host(be, &v2));
    let lion = LionStep {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.99,
        weight_decay: 0.1,
    };
    be.lion_update(&mut w, &a, &mut m, lion).unwrap();
    seen.push(host(be, &w));
    seen.push(host(be, &m));
    let mut g = on(be, &[4, 3], 16);
    let mut ms = on(be, &[4, 3], 17);
    let dc = DelayCompensation {
        lambda: 0.5,
        adaptive: Some(0.9),
        eps: 1e-7,
    };
    be.delay_compensate(&mut g, &w, &a, Some(&mut ms), dc)
        .unwrap();
    let plain = DelayCompensation {
        adaptive: None,
        ..dc
    };
    be.delay_compensate(&mut g, &w, &a, None, plain).unwrap();
    seen.push(host(be, &g));
    seen.push(host(be, &ms));

    let sums = [be.sum(&a).unwrap(), be.sum_squares(&a).unwrap()];
    let inf = be
        .place(Tensor::from_vec(&[2], vec![1.0, f32::INFINITY]).unwrap())
        .unwrap();
    let bad = be.first_non_finite(&[&a, &inf, &a]).unwrap();
    seen.push(vec![
        sums[0] as f32,
        sums[1] as f32,
        bad.map_or(-1.0, |i| i as f32),
    ]);
    seen
}

fn same_bits(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g: Vec<u32> = g.iter().map(|x| x.to_bits()).collect();
        let w: Vec<u32> = w.iter().map(|x| x.to_bits()).collect();
        assert_eq!(g, w, "{what}: result {i}");
    }
}

#[test]
fn wrapped_backends_give_the_cpu_bits() {
    let want = every_operation(&CpuBackend::new(1).unwrap());
    let timed = Timed::by_operation(CpuBackend::new(1).unwrap());
    same_bits(&every_operation(&timed), &want, "timed cpu");
    let boxed: Box<dyn Backend> = Box::new(CpuBackend::new(1).unwrap());
    same_bits(&every_operation(&boxed), &want, "boxed cpu");
    let emulated = EmulatedDevice::new(0).unwrap();
    same_bits(&every_operation(&emulated), &want, "emulated");
    let timed = Timed::by_operation(Box::new(EmulatedDevice::new(0).unwrap()) as Box<dyn Backend>);
    same_bits(&every_operation(&timed), &want, "timed boxed emulated");
}

#[test]
fn the_timed_table_names_every_operation_and_nothing_else() {
    let timed = Timed::by_operation(CpuBackend::new(1).unwrap());
    every_operation(&timed);
    let names: Vec<&str> = timed.operations().iter().map(|(name, _)| *name).collect();
    let want = [
        "activation",
        "activation_backward",
        "adam_update",
        "adam_updates",
        "add_bias",
        "attention",
        "attention_backward",
        "axpy",
        "copy",
        "delay_compensate",
        "embedding",
        "embedding_backward",
        "fill",
        "first_non_finite",
        "layer_norm",
        "layer_norm_backward_input",
        "layer_norm_backward_params",
        "lion_update",
        "matmul 3x4x5 TN",
        "matmul 4x3x5 NN",
        "matmul 4x5x3 NT",
        "mul",
        "place",
        "place_ids",
        "queue_softmax_cross_entropy",
        "read",
        "read_losses",
        "scale",
        "sgd_update",
        "softmax_cross_entropy",
        "sum",
        "sum_rows",
        "sum_squares",
        "transpose",
        "write",
    ];
    assert_eq!(names, want);
    let calls: u64 = timed.operations().iter().map(|(_, t)| t.calls).sum();
    assert!(calls > want.len() as u64);
}

#[test]
fn questions_about_the_backend_reach_the_wrapped_one() {
    let emulated = EmulatedDevice::new(3).unwrap();
    let fresh = emulated.peak_memory();
    every_operation(&emulated);
    let peak = emulated.peak_memory();
    assert!(peak > fresh, "{peak:?}");

    let timed = Timed::new(
        Box::new(EmulatedDevice::new(3).unwrap()) as Box<dyn Backend>,
        Default::default(),
    );
    every_operation(&timed);
    assert_eq!(timed.peak_memory(), peak);
    assert_eq!(timed.name(), "emulated");
    assert_eq!(timed.threads(), 1);
    assert_eq!(timed.device(), emulated.device());
    assert!(timed.synchronize().is_ok());
    assert!(timed.as_any().downcast_ref::<EmulatedDevice>().is_some());
    assert!(timed.kernel_time() > std::time::Duration::ZERO);
    assert!(timed.operations().is_empty());
}

/// The emulated device counts a buffer as the CUDA pool's block for it
/// ([`pipe_kernels::cuda::block_bytes`]), so its peak is the count the pool reports; a clone
/// shares its buffer, and a dropped buffer leaves the count.
#[test]
fn the_emulated_device_counts_buffers_as_the_pools_blocks() {
    let emulated = EmulatedDevice::new(0).unwrap();
    let a = on(&emulated, &[129], 1); // 516 bytes: a 1,024-byte block
    let b = a.clone();
    assert_eq!(emulated.peak_memory(), Some(1024));
    let c = on(&emulated, &[3, 1000], 2); // 12,000 bytes: 16,384
    assert_eq!(emulated.peak_memory(), Some(1024 + 16_384));
    drop((a, b, c));
    let _d = on(&emulated, &[10], 3); // 40 bytes: the smallest block, 512
    assert_eq!(emulated.peak_memory(), Some(1024 + 16_384));
    assert_eq!(pipe_kernels::cuda::block_bytes(12_000), 16_384);
}
