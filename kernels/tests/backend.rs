//! One suite for every backend: each test is stamped per backend by `backend_tests!` (CPU always;
//! CUDA with the `cuda` feature, skipped with the reason printed where no GPU is found). Stamped tests build their operands on the
//! host, move them to the backend with `place` and read results back with `read`, so they run
//! unchanged on a backend that keeps tensors on a device.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::any::Any;
use std::sync::Arc;

use pipe_kernels::{
    Activation, AdamStep, AdamTensors, AttentionShape, Backend, CpuBackend, DType,
    DelayCompensation, Device, DeviceMemory, KernelError, LionStep, SgdStep, Tensor, Trans,
    UpdateSeen,
};

fn lcg(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn rand_t(shape: &[usize], seed: u64) -> Tensor {
    Tensor::from_vec(shape, lcg(shape.iter().product(), seed)).unwrap()
}

/// The Adam step the update tests take: AdamW at its third step or so (bias corrections
/// well below 1).
const ADAM: AdamStep = AdamStep {
    lr: 1e-2,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 1e-2,
    decoupled: true,
    bias_correction1: 0.1,
    bias_correction2: 0.001,
};

/// The Lion step the update tests take.
const LION: LionStep = LionStep {
    lr: 1e-2,
    beta1: 0.9,
    beta2: 0.99,
    weight_decay: 0.1,
};

/// A host tensor made resident on `be`.
fn on(be: &dyn Backend, t: &Tensor) -> Tensor {
    be.place(t.clone()).unwrap()
}

/// The elements of `t` (wherever it lives) in host memory.
fn read(be: &dyn Backend, t: &Tensor) -> Vec<f32> {
    be.read(t).unwrap().into_owned()
}

/// The ids `v` as a tensor resident on `be`.
fn ids(be: &dyn Backend, v: &[u32]) -> Tensor<u32> {
    be.place_ids(Tensor::from_vec(&[v.len()], v.to_vec()).unwrap())
        .unwrap()
}

/// Random `a` and `b` stored so that `op(a)` is m x k and `op(b)` is k x n.
fn operands(m: usize, k: usize, n: usize, ta: Trans, tb: Trans, seed: u64) -> (Tensor, Tensor) {
    let a = match ta {
        Trans::No => rand_t(&[m, k], seed),
        Trans::Yes => rand_t(&[k, m], seed),
    };
    let b = match tb {
        Trans::No => rand_t(&[k, n], seed + 1),
        Trans::Yes => rand_t(&[n, k], seed + 1),
    };
    (a, b)
}

fn naive(a: &Tensor, ta: Trans, b: &Tensor, tb: Trans) -> Vec<f64> {
    let at = |i: usize, j: usize| match ta {
        Trans::No => a.host().unwrap()[i * a.cols() + j],
        Trans::Yes => a.host().unwrap()[j * a.cols() + i],
    };
    let bt = |i: usize, j: usize| match tb {
        Trans::No => b.host().unwrap()[i * b.cols() + j],
        Trans::Yes => b.host().unwrap()[j * b.cols() + i],
    };
    let ((m, k), n) = (ta.dims(a), tb.dims(b).1);
    let mut c = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|p| at(i, p) as f64 * bt(p, j) as f64).sum();
        }
    }
    c
}

fn close(got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (*g as f64 - w).abs() <= tol * (1.0 + w.abs()),
            "element {i}: got {g}, want {w}"
        );
    }
}

/// Products with few rows read a cached packed copy of the right operand; any change to the
/// operand's contents (and only a change) must be seen.
fn small_row_products_see_every_change_to_the_operand(be: &dyn Backend) {
    for tb in [Trans::No, Trans::Yes] {
        for (m, k, n) in [(8, 256, 512), (32, 300, 1000), (1, 1024, 1024)] {
            let (a_host, b_host) = operands(m, k, n, Trans::No, tb, 7);
            let (a, mut b) = (on(be, &a_host), on(be, &b_host));
            let product = |b: &Tensor, c: &mut Tensor| {
                be.matmul(&a, Trans::No, b, tb, c, false).unwrap();
                let b_now = Tensor::from_vec(b.shape(), read(be, b)).unwrap();
                close(&read(be, c), &naive(&a_host, Trans::No, &b_now, tb), 1e-4);
            };
            let mut c = Tensor::default();
            product(&b, &mut c);
            // A clone shares the cached copy; changing the clone must not change the original.
            let mut other = b.clone();
            let mut changed = read(be, &other);
            changed[3] += 1.0;
            be.write(&changed, &mut other).unwrap();
            product(&other, &mut c);
            product(&b, &mut c);
            // In-place changes through every mutable path.
            let mut changed = read(be, &b);
            changed[k] = 5.0;
            be.write(&changed, &mut b).unwrap();
            product(&b, &mut c);
            let step = pipe_kernels::SgdStep {
                lr: 0.5,
                momentum: 0.0,
                nesterov: false,
                weight_decay: 0.0,
            };
            let g = on(be, &Tensor::full(b.shape(), 0.25));
            be.sgd_update(&mut b, &g, None, step).unwrap();
            product(&b, &mut c);
            be.fill(0.5, &mut b).unwrap();
            product(&b, &mut c);
            be.copy(&on(be, &b_host), &mut b).unwrap();
            product(&b, &mut c);
        }
    }
}

fn matmul_all_transposes(be: &dyn Backend) {
    matmul_all_transposes_within(be, 1e-4);
}

/// [`matmul_all_transposes`] at a tolerance bf16x3's 16 bits meet (their bound is checked
/// apart, in `bf16x3_errs_within_its_bound`).
fn matmul_all_transposes_at_16_bits(be: &dyn Backend) {
    matmul_all_transposes_within(be, 1e-3);
}

fn matmul_all_transposes_within(be: &dyn Backend, tol: f64) {
    for &(m, k, n) in &[
        (1, 1, 1),
        (3, 5, 7),
        (17, 33, 9),
        (64, 300, 600),
        (300, 64, 40),
        // A right operand of over 2^20 elements: transposed, it is read row-major as the left
        // operand of C^T, at any row count.
        (70, 1030, 1024),
        // Every side at least 256: on the tiles in bf16x6.
        (260, 300, 270),
    ] {
        for ta in [Trans::No, Trans::Yes] {
            for tb in [Trans::No, Trans::Yes] {
                let (a, b) = operands(m, k, n, ta, tb, 1);
                let mut c = Tensor::default();
                be.matmul(&on(be, &a), ta, &on(be, &b), tb, &mut c, false)
                    .unwrap();
                assert_eq!(c.shape(), &[m, n]);
                let want = naive(&a, ta, &b, tb);
                close(&read(be, &c), &want, tol);
                // Accumulate: c += a b gives twice the product.
                be.matmul(&on(be, &a), ta, &on(be, &b), tb, &mut c, true)
                    .unwrap();
                let twice: Vec<f64> = want.iter().map(|v| 2.0 * v).collect();
                close(&read(be, &c), &twice, tol);
            }
        }
    }
}

/// A linear layer's product with its bias ([`Backend::linear`]): the product of `x` and `w`
/// plus the bias on every row, against f64, at shapes whose rows are and are not multiples of
/// 8 values and with a three-dimensional input; with the bits of `matmul` then `add_bias`
/// where the backend does not fuse them; without a bias, the product alone; a bias of the
/// wrong length or a wrong inner dimension is an error that names it.
fn linear_adds_its_bias_to_the_product(be: &dyn Backend) {
    for &(m, k, n) in &[
        (1, 1, 1),
        (3, 5, 7),
        (64, 96, 40),
        (300, 64, 1001),
        (130, 768, 2304),
    ] {
        let (x, w) = operands(m, k, n, Trans::No, Trans::No, 11);
        let bias = rand_t(&[n], 12);
        let x = x.reshape(&[1, m, k]).unwrap();
        let (xd, wd, bd) = (on(be, &x), on(be, &w), on(be, &bias));
        let mut y = Tensor::default();
        be.linear(&xd, &wd, Some(&bd), &mut y).unwrap();
        assert_eq!(y.shape(), &[m, n], "{m}x{k}x{n}");
        let product = naive(&x, Trans::No, &w, Trans::No);
        let b = bias.host().unwrap();
        let want: Vec<f64> = product
            .iter()
            .enumerate()
            .map(|(i, p)| p + f64::from(b[i % n]))
            .collect();
        let got = read(be, &y);
        close(&got, &want, 1e-4);
        if !be.fuses_linear_epilogues() {
            let mut parts = Tensor::default();
            be.matmul(&xd, Trans::No, &wd, Trans::No, &mut parts, false)
                .unwrap();
            be.add_bias(&mut parts, &bd).unwrap();
            let parts = read(be, &parts);
            assert!(
                got.iter()
                    .map(|v| v.to_bits())
                    .eq(parts.iter().map(|v| v.to_bits())),
                "{m}x{k}x{n}: linear is not matmul then add_bias, bit for bit"
            );
        }
        be.linear(&xd, &wd, None, &mut y).unwrap();
        close(&read(be, &y), &product, 1e-4);
    }
    let (x, w) = (on(be, &rand_t(&[4, 6], 1)), on(be, &rand_t(&[6, 5], 2)));
    let mut y = Tensor::default();
    let short = be.linear(&x, &w, Some(&on(be, &rand_t(&[4], 3))), &mut y);
    let message = short.unwrap_err().to_string();
    assert!(message.contains("bias has 4 elements"), "{message}");
    let narrow = be.linear(&w, &w, Some(&on(be, &rand_t(&[5], 3))), &mut y);
    assert!(narrow.is_err(), "a 6x5 input and a 6x5 weight");
}

/// A linear layer and the activation after it in one call ([`Backend::linear_activation`]):
/// `pre` is [`Backend::linear`]'s product with its bias, `y` the activation of `pre` as the
/// CPU backend computes it (within 1e-5 where the backend applies it in the product's
/// epilogue, bit for bit otherwise, where it must also be `linear` then `activation`).
fn linear_activation_keeps_the_product_and_its_activation(be: &dyn Backend) {
    let cpu = CpuBackend::new(1).unwrap();
    for &(m, k, n) in &[(3, 5, 7), (64, 96, 40), (130, 256, 1024)] {
        for act in [Activation::Gelu, Activation::Relu] {
            for with_bias in [true, false] {
                let (x, w) = operands(m, k, n, Trans::No, Trans::No, 21);
                let bias = rand_t(&[n], 22);
                let (xd, wd, bd) = (on(be, &x), on(be, &w), on(be, &bias));
                let b = with_bias.then_some(&bd);
                let (mut pre, mut y) = (Tensor::default(), Tensor::default());
                be.linear_activation(&xd, &wd, b, act, &mut pre, &mut y)
                    .unwrap();
                assert_eq!((pre.shape(), y.shape()), (&[m, n][..], &[m, n][..]));
                let mut product = naive(&x, Trans::No, &w, Trans::No);
                if with_bias {
                    let b = bias.host().unwrap();
                    product
                        .iter_mut()
                        .enumerate()
                        .for_each(|(i, p)| *p += f64::from(b[i % n]));
                }
                let got_pre = read(be, &pre);
                close(&got_pre, &product, 1e-4);
                let mut want = Tensor::default();
                let pre_host = Tensor::from_vec(&[m, n], got_pre.clone()).unwrap();
                cpu.activation(act, &pre_host, &mut want).unwrap();
                let what = format!("{act:?} {m}x{k}x{n} bias {with_bias}");
                let tol = if be.fuses_linear_epilogues() {
                    1e-5
                } else {
                    0.0
                };
                same_as_cpu(be, &what, &read(be, &y), want.host().unwrap(), tol);
                if !be.fuses_linear_epilogues() {
                    let (mut lin, mut act_y) = (Tensor::default(), Tensor::default());
                    be.linear(&xd, &wd, b, &mut lin).unwrap();
                    be.activation(act, &lin, &mut act_y).unwrap();
                    let bits =
                        |t: &Tensor| read(be, t).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&act_y), bits(&y), "{what}: not linear then activation");
                    assert_eq!(bits(&lin), bits(&pre), "{what}: not linear then activation");
                }
            }
        }
    }
}

/// The backward of a linear layer into the activation before it in one call
/// ([`Backend::linear_grad_activation`]): `dz = act'(pre) (.) (dy w^T)` against f64, in
/// `pre`'s shape; bit for bit `matmul` then `activation_backward` where the backend does not
/// fuse them; a `pre` of the wrong size is an error.
fn linear_grad_activation_is_the_product_then_the_activation_gradient(be: &dyn Backend) {
    let cpu = CpuBackend::new(1).unwrap();
    for &(m, k, n) in &[(3, 5, 7), (64, 96, 40), (130, 256, 1024)] {
        for act in [Activation::Gelu, Activation::Relu] {
            let (dy, w) = operands(m, k, n, Trans::No, Trans::Yes, 31);
            let pre = rand_t(&[1, m, n], 32);
            let (dyd, wd, pred) = (on(be, &dy), on(be, &w), on(be, &pre));
            let mut dz = Tensor::default();
            be.linear_grad_activation(&dyd, &wd, act, &pred, &mut dz)
                .unwrap();
            assert_eq!(dz.shape(), &[1, m, n]);
            let want: Vec<f64> = naive(&dy, Trans::No, &w, Trans::Yes)
                .iter()
                .zip(slope_of(&cpu, act, &pre))
                .map(|(d, s)| d * f64::from(s))
                .collect();
            let got = read(be, &dz);
            close(&got, &want, 1e-4);
            if !be.fuses_linear_epilogues() {
                let (mut dh, mut parts) = (Tensor::default(), Tensor::default());
                be.matmul(&dyd, Trans::No, &wd, Trans::Yes, &mut dh, false)
                    .unwrap();
                be.activation_backward(act, &pred, &dh, &mut parts).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&read(be, &parts)),
                    "{act:?} {m}x{k}x{n}: not matmul then activation_backward"
                );
            }
        }
    }
    let (dy, w) = (on(be, &rand_t(&[4, 6], 1)), on(be, &rand_t(&[5, 6], 2)));
    let (pre, mut dz) = (on(be, &rand_t(&[4, 4], 3)), Tensor::default());
    let short = be.linear_grad_activation(&dy, &w, Activation::Gelu, &pre, &mut dz);
    assert!(short.is_err(), "a 4x4 activation input for a 4x5 gradient");
}

/// `act'(pre)`, element by element, as the CPU backend takes it.
fn slope_of(cpu: &CpuBackend, act: Activation, pre: &Tensor) -> Vec<f32> {
    let mut slope = Tensor::default();
    let ones = Tensor::full(pre.shape(), 1.0);
    cpu.activation_backward(act, pre, &ones, &mut slope)
        .unwrap();
    slope.into_host_vec().unwrap()
}

/// A linear layer's weight gradients in one call ([`Backend::linear_weight_grads`]): `x^T dy`
/// and `dy`'s column sums against f64, written and then added to; without a bias, the
/// product alone; bit for bit `matmul` then `sum_rows` where the backend does not fuse them.
fn linear_weight_grads_are_the_product_and_the_column_sums(be: &dyn Backend) {
    for &(rows, inputs, outputs) in &[(3, 5, 7), (64, 96, 40), (256, 130, 1024)] {
        let (x, dy) = (rand_t(&[rows, inputs], 41), rand_t(&[rows, outputs], 42));
        let (xd, dyd) = (on(be, &x), on(be, &dy));
        let product = naive(&x, Trans::Yes, &dy, Trans::No);
        let d = dy.host().unwrap();
        let sums: Vec<f64> = (0..outputs)
            .map(|j| (0..rows).map(|i| f64::from(d[i * outputs + j])).sum())
            .collect();
        let (mut gw, mut gb) = (Tensor::default(), Tensor::default());
        be.linear_weight_grads(&xd, &dyd, &mut gw, Some(&mut gb), false)
            .unwrap();
        close(&read(be, &gw), &product, 1e-4);
        close(&read(be, &gb), &sums, 1e-4);
        be.linear_weight_grads(&xd, &dyd, &mut gw, Some(&mut gb), true)
            .unwrap();
        let twice = |v: &[f64]| v.iter().map(|x| 2.0 * x).collect::<Vec<_>>();
        close(&read(be, &gw), &twice(&product), 1e-4);
        close(&read(be, &gb), &twice(&sums), 1e-4);
        let mut alone = Tensor::default();
        be.linear_weight_grads(&xd, &dyd, &mut alone, None, false)
            .unwrap();
        close(&read(be, &alone), &product, 1e-4);
        if !be.fuses_linear_epilogues() {
            let (mut pw, mut pb) = (Tensor::default(), Tensor::default());
            be.matmul(&xd, Trans::Yes, &dyd, Trans::No, &mut pw, false)
                .unwrap();
            be.sum_rows(&dyd, &mut pb, false).unwrap();
            be.matmul(&xd, Trans::Yes, &dyd, Trans::No, &mut pw, true)
                .unwrap();
            be.sum_rows(&dyd, &mut pb, true).unwrap();
            let bits = |t: &Tensor| read(be, t).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&gw),
                bits(&pw),
                "{rows}x{inputs}x{outputs}: weight gradient"
            );
            assert_eq!(
                bits(&gb),
                bits(&pb),
                "{rows}x{inputs}x{outputs}: bias gradient"
            );
        }
    }
}

fn matmul_rejects_bad_shapes(be: &dyn Backend) {
    let a = on(be, &rand_t(&[3, 4], 1));
    let b = on(be, &rand_t(&[5, 6], 2));
    let mut c = Tensor::default();
    let e = be
        .matmul(&a, Trans::No, &b, Trans::No, &mut c, false)
        .unwrap_err();
    assert!(matches!(e, KernelError::Shape { .. }), "{e}");
    let b = on(be, &rand_t(&[4, 6], 2));
    let mut wrong = on(be, &Tensor::zeros(&[2, 2]));
    assert!(
        be.matmul(&a, Trans::No, &b, Trans::No, &mut wrong, true)
            .is_err()
    );
}

fn elementwise_and_reductions(be: &dyn Backend) {
    let xh = rand_t(&[7, 13], 3);
    let xv = xh.host().unwrap().to_vec();
    let x = on(be, &xh);
    let mut t = Tensor::default();
    be.transpose(&x, &mut t).unwrap();
    assert_eq!(t.shape(), &[13, 7]);
    let tv = read(be, &t);
    for i in 0..7 {
        for j in 0..13 {
            assert_eq!(tv[j * 7 + i], xv[i * 13 + j]);
        }
    }
    let bias_h = rand_t(&[13], 4);
    let mut y = x.clone();
    be.add_bias(&mut y, &on(be, &bias_h)).unwrap();
    assert_eq!(read(be, &y)[13 + 5], xv[13 + 5] + bias_h.host().unwrap()[5]);
    assert!(be.add_bias(&mut y, &on(be, &rand_t(&[12], 4))).is_err());
    let mut s = Tensor::default();
    be.sum_rows(&x, &mut s, false).unwrap();
    let want: Vec<f64> = (0..13)
        .map(|j| (0..7).map(|i| xv[i * 13 + j] as f64).sum())
        .collect();
    close(&read(be, &s), &want, 1e-6);
    // Many rows (summed in chunks of rows on the CPU), then accumulated onto that sum.
    let tall = rand_t(&[600, 13], 11);
    let tv = tall.host().unwrap().to_vec();
    be.sum_rows(&on(be, &tall), &mut s, true).unwrap();
    let want_tall: Vec<f64> = (0..13)
        .map(|j| want[j] + (0..600).map(|i| tv[i * 13 + j] as f64).sum::<f64>())
        .collect();
    close(&read(be, &s), &want_tall, 1e-5);
    let total = be.sum(&x).unwrap();
    assert!((total - want.iter().sum::<f64>()).abs() < 1e-5);
    let sq = be.sum_squares(&x).unwrap();
    assert!((sq - xv.iter().map(|v| (*v as f64).powi(2)).sum::<f64>()).abs() < 1e-9);
    let mut r = Tensor::default();
    be.activation(Activation::Relu, &x, &mut r).unwrap();
    assert!(read(be, &r).iter().zip(&xv).all(|(r, x)| *r == x.max(0.0)));
    let mut yy = x.clone();
    be.axpy(2.0, &x, &mut yy).unwrap();
    let yv = read(be, &yy);
    assert!(yv.iter().zip(&xv).all(|(y, x)| (y - 3.0 * x).abs() < 1e-6));
    be.scale(0.5, &mut yy).unwrap();
    let yv = read(be, &yy);
    assert!(yv.iter().zip(&xv).all(|(y, x)| (y - 1.5 * x).abs() < 1e-6));
    // `yy` started as a clone of `x`: its writes must not reach `x`.
    assert_eq!(read(be, &x), xv);
}

/// Moving tensors in and out, copies, fills and the elementwise product.
fn data_movement_and_products(be: &dyn Backend) {
    let ah = rand_t(&[6, 5], 11);
    let bh = rand_t(&[6, 5], 12);
    let (a, b) = (on(be, &ah), on(be, &bh));
    assert_eq!(a.device(), be.device());
    assert_eq!(read(be, &a), ah.host().unwrap());
    let mut p = Tensor::default();
    be.mul(&a, &b, &mut p).unwrap();
    assert_eq!(p.shape(), &[6, 5]);
    let want: Vec<f32> = ah
        .host()
        .unwrap()
        .iter()
        .zip(bh.host().unwrap())
        .map(|(x, y)| x * y)
        .collect();
    assert_eq!(read(be, &p), want);
    let e = be.mul(&a, &on(be, &rand_t(&[4], 1)), &mut p).unwrap_err();
    assert!(matches!(e, KernelError::Shape { op: "mul", .. }), "{e}");
    let mut c = Tensor::default();
    be.copy(&a, &mut c).unwrap();
    assert_eq!((c.shape(), read(be, &c)), (a.shape(), read(be, &a)));
    be.fill(-2.0, &mut c).unwrap();
    assert!(read(be, &c).iter().all(|&v| v == -2.0));
    assert_eq!(read(be, &a), ah.host().unwrap(), "a copy is not an alias");
    let values: Vec<f32> = (0..30).map(|i| i as f32).collect();
    be.write(&values, &mut c).unwrap();
    assert_eq!(read(be, &c), values);
    assert!(matches!(
        be.write(&values[..29], &mut c).unwrap_err(),
        KernelError::Shape { op: "write", .. }
    ));
    let labels = ids(be, &[3, 1, 4]);
    assert_eq!((labels.dtype(), labels.shape()), (DType::U32, &[3][..]));
}

/// Rows labelled `IGNORED_LABEL` add no loss, are not counted and get a zero gradient row;
/// the other rows are exactly what they are without them.
fn ignored_labels_are_not_loss_terms(be: &dyn Backend) {
    use pipe_kernels::IGNORED_LABEL;
    let lh = rand_t(&[5, 4], 9);
    let logits = on(be, &lh);
    let kept = [0u32, 3, 2, 1, 3];
    let some = [0u32, IGNORED_LABEL, 2, IGNORED_LABEL, 3];
    let (mut all_d, mut some_d) = (Tensor::default(), Tensor::default());
    let all = be
        .softmax_cross_entropy(&logits, 4, &ids(be, &kept), 0.5, Some(&mut all_d))
        .unwrap();
    let s = be
        .softmax_cross_entropy(&logits, 4, &ids(be, &some), 0.5, Some(&mut some_d))
        .unwrap();
    assert_eq!(s.rows, 3);
    let (all_d, some_d) = (read(be, &all_d), read(be, &some_d));
    let mut want = 0.0f64;
    for (i, &l) in some.iter().enumerate() {
        let row = &some_d[i * 4..i * 4 + 4];
        if l == IGNORED_LABEL {
            assert!(row.iter().all(|&v| v == 0.0), "row {i}: {row:?}");
        } else {
            assert_eq!(row, &all_d[i * 4..i * 4 + 4], "row {i}");
            let one = be
                .softmax_cross_entropy(&on(be, &row_of(&lh, i)), 4, &ids(be, &[l]), 1.0, None)
                .unwrap();
            want += one.loss_sum;
        }
    }
    assert!(
        (s.loss_sum - want).abs() < 1e-9,
        "{} against {want}",
        s.loss_sum
    );
    assert!(s.loss_sum < all.loss_sum);
}

/// Rows as wide as GPT-2's vocabulary (50,257 classes in rows of 50,304, the padded head's)
/// against the CPU backend: logits spread over +-8 (each lane's maximum grows several times
/// along a row), a maximum in the last class, two equal maxima (the first wins the arg-max), an
/// ignored row. Loss within 1e-6 relative, every gradient element within 1e-5 of its own size.
fn wide_softmax_cross_entropy_agrees_with_the_cpu_backend(be: &dyn Backend) {
    use pipe_kernels::IGNORED_LABEL;
    let cpu = CpuBackend::new(1).unwrap();
    let (rows, classes, stride) = (6, 50_257, 50_304);
    let mut values = lcg(rows * stride, 41);
    values.iter_mut().for_each(|v| *v *= 8.0);
    values[stride + classes - 1] = 30.0;
    values[2 * stride + 100] = 20.0;
    values[2 * stride + 40_000] = 20.0;
    values[5 * stride + 7] = 25.0;
    let logits = Tensor::from_vec(&[rows, stride], values).unwrap();
    let labels = [3u32, 50_256, 40_000, 17, IGNORED_LABEL, 7];
    let (mut d, mut dc) = (Tensor::default(), Tensor::default());
    let got = be
        .softmax_cross_entropy(
            &on(be, &logits),
            classes,
            &ids(be, &labels),
            0.25,
            Some(&mut d),
        )
        .unwrap();
    let want = cpu
        .softmax_cross_entropy(&logits, classes, &ids(&cpu, &labels), 0.25, Some(&mut dc))
        .unwrap();
    assert_eq!((got.rows, got.correct), (5, 2));
    assert_eq!((got.rows, got.correct), (want.rows, want.correct));
    assert!(
        (got.loss_sum - want.loss_sum).abs() <= 1e-6 * want.loss_sum.abs(),
        "loss {} on {}, {} on the cpu",
        got.loss_sum,
        be.name(),
        want.loss_sum
    );
    let (d, dc) = (read(be, &d), read(&cpu, &dc));
    assert_eq!(d.len(), rows * stride);
    for (i, (g, w)) in d.iter().zip(&dc).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs() + 1e-12,
            "gradient element {i}: {g} on {}, {w} on the cpu",
            be.name()
        );
    }
    let without = be
        .softmax_cross_entropy(&on(be, &logits), classes, &ids(be, &labels), 0.25, None)
        .unwrap();
    assert_eq!(without, got);
}

/// Row `i` of a host matrix, as a one-row matrix.
fn row_of(t: &Tensor, i: usize) -> Tensor {
    let n = t.cols();
    Tensor::from_vec(&[1, n], t.host().unwrap()[i * n..(i + 1) * n].to_vec()).unwrap()
}

/// Per token of sequences of `seq`, where its document starts, from each sequence's
/// documents as `[start, end)` ranges.
fn document_starts(seq: usize, docs: &[&[(usize, usize)]]) -> Vec<f32> {
    let mut starts = vec![0f32; docs.len() * seq];
    for (b, ds) in docs.iter().enumerate() {
        for &(s, e) in *ds {
            starts[b * seq + s..b * seq + e].fill(s as f32);
        }
    }
    starts
}

/// Packed documents: each row attends within its own document only, so the output, the
/// log-sum-exp and the gradient of a packed batch are those of each document run alone as
/// its own sequence. Documents cross the CPU kernel's 32-row blocks and the CUDA kernels'
/// 64-row tiles, and start past a tile's first keys; head widths 16 and 64 (the CUDA
/// backend's tiled kernels) and 24 (its one-warp kernels). A start past a token's own index,
/// and documents that are not contiguous, are refused.
fn attention_masks_packed_documents(be: &dyn Backend) {
    let long: [&[(usize, usize)]; 2] = [
        &[(0, 20), (20, 130), (130, 200)],
        &[(0, 5), (5, 70), (70, 71), (71, 200)],
    ];
    for (seq, width, docs) in [
        (
            70,
            32,
            [&[(0, 20), (20, 53), (53, 70)][..], &[(0, 5), (5, 70)]],
        ),
        (200, 48, long),
        (200, 128, long),
    ] {
        let shape = AttentionShape {
            batch: 2,
            seq,
            heads: 2,
            width,
        };
        packed_documents_case(be, shape, &docs);
    }
    let shape = AttentionShape {
        batch: 2,
        seq: 70,
        heads: 2,
        width: 32,
    };
    let qkv = on(be, &rand_t(&[2 * 70, 3 * 32], 31));
    let (mut o, mut l) = (Tensor::default(), Tensor::default());
    let mut refused = |starts: &Tensor, says: &str| {
        let e = be
            .attention(&qkv, Some(starts), shape, &mut o, &mut l)
            .unwrap_err();
        assert!(e.to_string().contains(says), "{e}");
    };
    let placed = |starts: Vec<f32>| on(be, &Tensor::from_vec(&[2 * 70], starts).unwrap());
    let mut late = document_starts(70, &[&[(0, 70)], &[(0, 70)]]);
    late[3] = 4.0;
    refused(&placed(late), "starts its document at 4");
    // Documents are contiguous: token 3 cannot start at 1 after token 2 started at itself.
    let mut apart = document_starts(70, &[&[(0, 2), (2, 70)], &[(0, 70)]]);
    apart[3] = 1.0;
    refused(
        &placed(apart),
        "token 3 of sequence 0 starts its document at 1, neither where token 2",
    );
    // Starts that passed, then overwritten in place with a bad one: checked again, refused.
    let mut starts = placed(vec![0.0; 2 * 70]);
    let (mut o2, mut l2) = (Tensor::default(), Tensor::default());
    be.attention(&qkv, Some(&starts), shape, &mut o2, &mut l2)
        .unwrap();
    let mut bad = vec![0.0; 2 * 70];
    bad[75] = 6.0;
    be.write(&bad, &mut starts).unwrap();
    refused(&starts, "token 5 of sequence 1 starts its document at 6");
    refused(
        &on(be, &Tensor::from_vec(&[3], vec![0.0; 3]).unwrap()),
        "3 document starts",
    );
}

/// One shape of [`attention_masks_packed_documents`].
fn packed_documents_case(be: &dyn Backend, shape: AttentionShape, docs: &[&[(usize, usize)]]) {
    let (t, c, h) = (shape.seq, shape.width, shape.heads);
    let starts = document_starts(t, docs);
    let starts = Tensor::from_vec(&[2 * t], starts).unwrap();
    let qkv = rand_t(&[2 * t, 3 * c], 31);
    let dout = rand_t(&[2 * t, c], 32);
    let (mut out, mut lse, mut dqkv) = (Tensor::default(), Tensor::default(), Tensor::default());
    let placed = (on(be, &qkv), on(be, &starts), on(be, &dout));
    be.attention(&placed.0, Some(&placed.1), shape, &mut out, &mut lse)
        .unwrap();
    be.attention_backward(
        &placed.0,
        Some(&placed.1),
        &out,
        &lse,
        &placed.2,
        shape,
        &mut dqkv,
    )
    .unwrap();
    let (out, lse, dqkv) = (read(be, &out), read(be, &lse), read(be, &dqkv));
    let rows = |x: &Tensor, b: usize, (s, e): (usize, usize), w: usize| {
        Tensor::from_vec(
            &[e - s, w],
            x.host().unwrap()[(b * t + s) * w..(b * t + e) * w].to_vec(),
        )
        .unwrap()
    };
    for (b, ds) in docs.iter().enumerate() {
        for &(s, e) in *ds {
            let alone = AttentionShape {
                batch: 1,
                seq: e - s,
                ..shape
            };
            let q = on(be, &rows(&qkv, b, (s, e), 3 * c));
            let (mut o, mut l, mut d) = (Tensor::default(), Tensor::default(), Tensor::default());
            be.attention(&q, None, alone, &mut o, &mut l).unwrap();
            let g = on(be, &rows(&dout, b, (s, e), c));
            be.attention_backward(&q, None, &o, &l, &g, alone, &mut d)
                .unwrap();
            let f64s = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
            close(
                &out[(b * t + s) * c..(b * t + e) * c],
                &f64s(read(be, &o)),
                1e-6,
            );
            close(
                &dqkv[(b * t + s) * 3 * c..(b * t + e) * 3 * c],
                &f64s(read(be, &d)),
                1e-6,
            );
            let l = read(be, &l);
            for hd in 0..h {
                let packed = &lse[(b * h + hd) * t + s..(b * h + hd) * t + e];
                close(
                    packed,
                    &f64s(l[hd * (e - s)..(hd + 1) * (e - s)].to_vec()),
                    1e-6,
                );
            }
        }
    }
}

/// Losses queued without a wait and read together give the statistics and gradients of the
/// same losses evaluated one by one, in order (an ignored label included); a label out of
/// range is an error from the queueing call or from the read.
fn queued_losses_are_read_together(be: &dyn Backend) {
    let cases: [(u64, Vec<u32>); 3] = [
        (41, vec![0, 6, 2, 1, 6, 3]),
        (42, vec![5, pipe_kernels::IGNORED_LABEL, 0, 4, 4, 2]),
        (43, vec![1, 1, 1, 0, 6, 5]),
    ];
    let mut readings = Vec::new();
    let mut want = Vec::new();
    for (seed, labels) in &cases {
        let logits = on(be, &rand_t(&[6, 7], *seed));
        let (mut queued_grad, mut grad) = (Tensor::default(), Tensor::default());
        let labels = ids(be, labels);
        let reading = be
            .queue_softmax_cross_entropy(&logits, 7, &labels, 0.5, Some(&mut queued_grad))
            .unwrap();
        readings.push(reading);
        let stats = be
            .softmax_cross_entropy(&logits, 7, &labels, 0.5, Some(&mut grad))
            .unwrap();
        let same = read(be, &queued_grad)
            .iter()
            .zip(&read(be, &grad))
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "seed {seed}: the queued loss's gradient differs");
        want.push(stats);
    }
    let got = be.read_losses(readings).unwrap();
    assert_eq!(got, want);
    assert_eq!(got[1].rows, 5, "the ignored row is no loss term");
    let logits = on(be, &rand_t(&[2, 7], 44));
    let bad = be
        .queue_softmax_cross_entropy(&logits, 7, &ids(be, &[0, 7]), 1.0, None)
        .and_then(|reading| be.read_losses(vec![reading]))
        .unwrap_err();
    assert!(
        matches!(
            bad,
            KernelError::Label {
                row: 1,
                label: 7,
                classes: 7
            }
        ),
        "{bad}"
    );
}

fn softmax_cross_entropy_matches_reference(be: &dyn Backend) {
    let lh = rand_t(&[5, 4], 9);
    let logits = on(be, &lh);
    let labels = [0u32, 3, 2, 1, 3];
    let mut d = Tensor::default();
    let s = be
        .softmax_cross_entropy(&logits, 4, &ids(be, &labels), 0.5, Some(&mut d))
        .unwrap();
    let dv = read(be, &d);
    let mut want = 0.0f64;
    for (i, &l) in labels.iter().enumerate() {
        let row: Vec<f64> = lh.host().unwrap()[i * 4..i * 4 + 4]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let z: f64 = row.iter().map(|v| v.exp()).sum();
        want += z.ln() - row[l as usize];
        for (j, v) in row.iter().enumerate() {
            let p = v.exp() / z;
            let g = 0.5 * (p - if j == l as usize { 1.0 } else { 0.0 });
            assert!((dv[i * 4 + j] as f64 - g).abs() < 1e-6);
        }
    }
    assert!((s.loss_sum - want).abs() < 1e-5);
    assert_eq!(s.rows, 5);
    let e = be
        .softmax_cross_entropy(&logits, 4, &ids(be, &[0, 1, 2, 3, 4]), 1.0, None)
        .unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::Label {
                row: 4,
                label: 4,
                classes: 4
            }
        ),
        "{e}"
    );
    assert!(
        be.softmax_cross_entropy(&logits, 4, &ids(be, &[0, 1]), 1.0, None)
            .is_err()
    );
    assert!(
        be.softmax_cross_entropy(&logits, 5, &ids(be, &labels), 1.0, None)
            .is_err(),
        "more classes than columns"
    );
    // A padded vocabulary: two more columns, larger than any class's logit, are not classes.
    // The loss, the hits and the classes' gradient are the unpadded ones, bit for bit; the
    // padding's gradient is zero.
    let padded: Vec<f32> = lh
        .host()
        .unwrap()
        .chunks(4)
        .flat_map(|row| row.iter().copied().chain([50.0, -0.0]))
        .collect();
    let padded = on(be, &Tensor::from_vec(&[5, 6], padded).unwrap());
    // The gradient's buffer holds sevens first: the padding's zeros are written, not left.
    let mut pd = be
        .place(Tensor::from_vec(&[5, 6], vec![7.0; 30]).unwrap())
        .unwrap();
    let p = be
        .softmax_cross_entropy(&padded, 4, &ids(be, &labels), 0.5, Some(&mut pd))
        .unwrap();
    assert_eq!(p.loss_sum.to_bits(), s.loss_sum.to_bits());
    assert_eq!((p.rows, p.correct), (s.rows, s.correct));
    let pv = read(be, &pd);
    for (i, row) in pv.chunks(6).enumerate() {
        assert_eq!(&row[..4], &dv[i * 4..i * 4 + 4], "row {i}");
        assert_eq!(&row[4..], &[0.0, 0.0], "row {i}: the padding's gradient");
    }
    let e = be
        .softmax_cross_entropy(&padded, 4, &ids(be, &[0, 1, 2, 3, 4]), 1.0, None)
        .unwrap_err();
    assert!(matches!(e, KernelError::Label { classes: 4, .. }), "{e}");
}

/// Stamps the suite for one backend. `$make` gives `Option<backend>`: `None` where the backend
/// cannot run here (no GPU), and then each test says it skipped and why, and passes.
macro_rules! backend_tests {
    ($backend:ident, $make:expr, [$($test:ident),* $(,)?]) => {
        mod $backend {
            $(
                #[test]
                fn $test() {
                    let Some(be) = $make else { return };
                    super::$test(&be);
                }
            )*
        }
    };
}

/// The CUDA backend on device 0, or `None` after saying why not. `PIPE_REQUIRE_GPU=1` turns a
/// missing GPU into a failure (for runs on a GPU machine, so that a broken driver cannot pass
/// as a skip).
#[cfg(feature = "cuda")]
fn cuda_or_skip() -> Option<pipe_kernels::CudaBackend> {
    cuda_with_precision_or_skip(pipe_kernels::Precision::F32)
}

/// [`cuda_or_skip`] with the products in `precision`.
#[cfg(feature = "cuda")]
fn cuda_with_precision_or_skip(
    precision: pipe_kernels::Precision,
) -> Option<pipe_kernels::CudaBackend> {
    match pipe_kernels::CudaBackend::with_precision(0, precision) {
        Ok(be) => Some(be),
        Err(e) => {
            assert!(
                std::env::var_os("PIPE_REQUIRE_GPU").is_none_or(|v| v != "1"),
                "PIPE_REQUIRE_GPU=1 but the CUDA backend did not open: {e}"
            );
            eprintln!("skipped on the cuda backend: {e}");
            None
        }
    }
}

/// Compares `got` (computed on `be`) with `want` (on the CPU backend): bit for bit when `be` is
/// the CPU backend itself, within `tol` relative otherwise.
fn same_as_cpu(be: &dyn Backend, what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}");
    let exact = be.name() == "cpu";
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if exact {
            g.to_bits() == w.to_bits()
        } else {
            (g - w).abs() <= tol * (1.0 + w.abs())
        };
        assert!(
            ok,
            "{what}: element {i}: {g} on {}, {w} on the cpu",
            be.name()
        );
    }
}

/// Every elementwise operation, reduction and LayerNorm against the CPU backend on the same
/// random operands (the CPU backend is itself checked against definitions above); on the CPU
/// this compares it with itself, which must agree exactly.
fn elementwise_and_norms_agree_with_the_cpu_backend(be: &dyn Backend) {
    let cpu = CpuBackend::new(1).unwrap();
    let same =
        |what: &str, got: &[f32], want: &[f32], tol: f32| same_as_cpu(be, what, got, want, tol);
    let x = rand_t(&[37, 29], 31);
    let dy = rand_t(&[37, 29], 32);
    let bias = rand_t(&[29], 33);
    for act in [
        Activation::Relu,
        Activation::Gelu,
        Activation::Tanh,
        Activation::Sigmoid,
    ] {
        let (mut a, mut b) = (Tensor::default(), Tensor::default());
        be.activation(act, &on(be, &x), &mut a).unwrap();
        cpu.activation(act, &x, &mut b).unwrap();
        same(&format!("{act:?}"), &read(be, &a), &read(&cpu, &b), 1e-6);
        be.activation_backward(act, &on(be, &x), &on(be, &dy), &mut a)
            .unwrap();
        cpu.activation_backward(act, &x, &dy, &mut b).unwrap();
        same(
            &format!("{act:?} backward"),
            &read(be, &a),
            &read(&cpu, &b),
            1e-5,
        );
    }
    let (gamma, beta) = (rand_t(&[29], 34), rand_t(&[29], 35));
    let (mut y, mut m, mut r) = (Tensor::default(), Tensor::default(), Tensor::default());
    let (mut yc, mut mc, mut rc) = (Tensor::default(), Tensor::default(), Tensor::default());
    be.layer_norm(
        &on(be, &x),
        &on(be, &gamma),
        &on(be, &beta),
        1e-5,
        &mut y,
        &mut m,
        &mut r,
    )
    .unwrap();
    cpu.layer_norm(&x, &gamma, &beta, 1e-5, &mut yc, &mut mc, &mut rc)
        .unwrap();
    same("layer_norm", &read(be, &y), &read(&cpu, &yc), 1e-5);
    same("layer_norm rstd", &read(be, &r), &read(&cpu, &rc), 1e-5);
    let mut dx = Tensor::default();
    let mut dxc = Tensor::default();
    be.layer_norm_backward_input(&on(be, &x), &on(be, &gamma), &m, &r, &on(be, &dy), &mut dx)
        .unwrap();
    cpu.layer_norm_backward_input(&x, &gamma, &mc, &rc, &dy, &mut dxc)
        .unwrap();
    same(
        "layer_norm backward",
        &read(be, &dx),
        &read(&cpu, &dxc),
        1e-4,
    );
    let (mut dg, mut db) = (Tensor::default(), Tensor::default());
    let (mut dgc, mut dbc) = (Tensor::default(), Tensor::default());
    be.layer_norm_backward_params(&on(be, &x), &m, &r, &on(be, &dy), &mut dg, &mut db, false)
        .unwrap();
    cpu.layer_norm_backward_params(&x, &mc, &rc, &dy, &mut dgc, &mut dbc, false)
        .unwrap();
    same("layer_norm dgamma", &read(be, &dg), &read(&cpu, &dgc), 1e-4);
    same("layer_norm dbeta", &read(be, &db), &read(&cpu, &dbc), 1e-4);
    let (mut s, mut sc) = (Tensor::default(), Tensor::default());
    be.sum_rows(&on(be, &x), &mut s, false).unwrap();
    cpu.sum_rows(&x, &mut sc, false).unwrap();
    same("sum_rows", &read(be, &s), &read(&cpu, &sc), 1e-5);
    let (mut yb, mut ybc) = (on(be, &x), x.clone());
    be.add_bias(&mut yb, &on(be, &bias)).unwrap();
    cpu.add_bias(&mut ybc, &bias).unwrap();
    same("add_bias", &read(be, &yb), &read(&cpu, &ybc), 0.0);
    let sums = (be.sum(&on(be, &x)).unwrap(), cpu.sum(&x).unwrap());
    assert!((sums.0 - sums.1).abs() < 1e-9, "sum {sums:?}");
    let squares = (
        be.sum_squares(&on(be, &x)).unwrap(),
        cpu.sum_squares(&x).unwrap(),
    );
    assert!(
        (squares.0 - squares.1).abs() < 1e-9,
        "sum_squares {squares:?}"
    );
}

/// One multi-tensor Adam call gives every tensor the bits of its own `adam_update` on the same
/// backend, over three steps: lengths around a device's block of 4,096 values, empty ones,
/// more tensors than one launch takes (64), two weight decays and a second learning rate (a
/// launch shares everything but the weight decay). A length mismatch anywhere updates nothing.
fn adam_updates_give_each_tensors_own_update(be: &dyn Backend) {
    let mut lengths = vec![0, 1, 768, 4095, 4096, 4097, 9000];
    lengths.extend([3; 66]);
    lengths.push(5000);
    let hp = |i: usize, t: i32| AdamStep {
        lr: if i + 3 >= lengths.len() { 3e-3 } else { 1e-2 },
        weight_decay: if i % 2 == 0 { 0.1 } else { 0.0 },
        bias_correction1: 1.0 - 0.9f32.powi(t),
        bias_correction2: 1.0 - 0.999f32.powi(t),
        ..ADAM
    };
    let state = |seed: u64| -> Vec<[Tensor; 3]> {
        lengths
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let seed = seed + 10 * i as u64;
                // Weights, a first moment, and a second moment (never negative).
                [0, 1, 2].map(|k| {
                    let values = lcg(n, seed + k).into_iter().map(|x| match k {
                        0 => x,
                        1 => 0.01 * x,
                        _ => 0.01 * x.abs(),
                    });
                    on(be, &Tensor::from_vec(&[n], values.collect()).unwrap())
                })
            })
            .collect()
    };
    let (mut many, mut each) = (state(700), state(700));
    for t in 1..=3 {
        let grads: Vec<Tensor> = lengths
            .iter()
            .enumerate()
            .map(|(i, &n)| on(be, &rand_t(&[n], 9000 + 100 * t as u64 + i as u64)))
            .collect();
        let mut updates: Vec<AdamTensors<'_>> = many
            .iter_mut()
            .zip(&grads)
            .enumerate()
            .map(|(i, ([w, m, v], g))| AdamTensors {
                param: w,
                grad: g,
                m,
                v,
                hp: hp(i, t),
            })
            .collect();
        assert_eq!(be.adam_updates(&mut updates).unwrap().len(), lengths.len());
        for (i, ([w, m, v], g)) in each.iter_mut().zip(&grads).enumerate() {
            be.adam_update(w, g, m, v, hp(i, t)).unwrap();
        }
    }
    for (i, (a, b)) in many.iter().zip(&each).enumerate() {
        for (k, what) in ["weights", "first moment", "second moment"]
            .iter()
            .enumerate()
        {
            let (got, want) = (read(be, &a[k]), read(be, &b[k]));
            let same = got
                .iter()
                .zip(&want)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same && got.len() == want.len(),
                "tensor {i} ({} values): {what}",
                lengths[i]
            );
        }
    }
    // A gradient one value short in the middle of the list: an error, and nothing updated.
    let before: Vec<Vec<f32>> = many.iter().map(|[w, _, _]| read(be, w)).collect();
    let mut grads: Vec<Tensor> = lengths
        .iter()
        .map(|&n| on(be, &Tensor::full(&[n], 0.5)))
        .collect();
    grads[5] = on(be, &Tensor::full(&[lengths[5] - 1], 0.5));
    let mut updates: Vec<AdamTensors<'_>> = many
        .iter_mut()
        .zip(&grads)
        .map(|([w, m, v], g)| AdamTensors {
            param: w,
            grad: g,
            m,
            v,
            hp: ADAM,
        })
        .collect();
    let err = be.adam_updates(&mut updates).unwrap_err();
    assert!(err.to_string().contains("tensor 5"), "{err}");
    drop(updates);
    for (i, ([w, _, _], old)) in many.iter().zip(&before).enumerate() {
        assert_eq!(&read(be, w), old, "tensor {i} changed by a refused call");
    }
}

/// The optimizer updates and softmax cross-entropy against the CPU backend, as above.
fn updates_and_loss_agree_with_the_cpu_backend(be: &dyn Backend) {
    let cpu = CpuBackend::new(1).unwrap();
    let same =
        |what: &str, got: &[f32], want: &[f32], tol: f32| same_as_cpu(be, what, got, want, tol);
    let x = rand_t(&[37, 29], 31);
    let dy = rand_t(&[37, 29], 32);
    // Optimizer updates, several steps so the buffers matter.
    let sgd = SgdStep {
        lr: 0.1,
        momentum: 0.9,
        nesterov: true,
        weight_decay: 1e-3,
    };
    let adam = ADAM;
    let (mut w, mut buf, mut mm, mut vv) = (
        on(be, &x),
        on(be, &Tensor::zeros(&[37, 29])),
        on(be, &Tensor::zeros(&[37, 29])),
        on(be, &Tensor::zeros(&[37, 29])),
    );
    let (mut wc, mut bufc, mut mmc, mut vvc) = (
        x.clone(),
        Tensor::zeros(&[37, 29]),
        Tensor::zeros(&[37, 29]),
        Tensor::zeros(&[37, 29]),
    );
    for _ in 0..3 {
        be.sgd_update(&mut w, &on(be, &dy), Some(&mut buf), sgd)
            .unwrap();
        cpu.sgd_update(&mut wc, &dy, Some(&mut bufc), sgd).unwrap();
        be.adam_update(&mut w, &on(be, &dy), &mut mm, &mut vv, adam)
            .unwrap();
        cpu.adam_update(&mut wc, &dy, &mut mmc, &mut vvc, adam)
            .unwrap();
    }
    same("sgd + adam", &read(be, &w), &read(&cpu, &wc), 1e-5);
    same(
        "adam second moment",
        &read(be, &vv),
        &read(&cpu, &vvc),
        1e-5,
    );
    let lion = LION;
    let (mut lm, mut lmc) = (on(be, &Tensor::zeros(&[37, 29])), Tensor::zeros(&[37, 29]));
    for _ in 0..3 {
        be.lion_update(&mut w, &on(be, &dy), &mut lm, lion).unwrap();
        cpu.lion_update(&mut wc, &dy, &mut lmc, lion).unwrap();
    }
    same("lion", &read(be, &w), &read(&cpu, &wc), 1e-5);
    same("lion momentum", &read(be, &lm), &read(&cpu, &lmc), 1e-6);
    // One Lion step in closed form: c = 0.1 g from a zero momentum, its sign (0 at 0), then
    // w -= 0.1 (sign(c) + 0.5 w) and m = 0.01 g.
    let mut w1 = on(be, &Tensor::full(&[3], 1.0));
    let mut m1 = on(be, &Tensor::zeros(&[3]));
    let g1 = on(be, &Tensor::from_vec(&[3], vec![0.5, -2.0, 0.0]).unwrap());
    let step = LionStep {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.99,
        weight_decay: 0.5,
    };
    be.lion_update(&mut w1, &g1, &mut m1, step).unwrap();
    close(&read(be, &w1), &[0.85, 1.05, 0.95], 1e-6);
    close(&read(be, &m1), &[0.005, -0.02, 0.0], 1e-6);
    // Delay compensation, plain and adaptive, against the CPU; then each in closed form.
    let stale = x.clone();
    let (mut ms, mut msc) = (on(be, &Tensor::zeros(&[37, 29])), Tensor::zeros(&[37, 29]));
    for adaptive in [None, Some(0.95)] {
        let hp = DelayCompensation {
            lambda: 0.5,
            adaptive,
            eps: 1e-7,
        };
        let (mut g, mut gc) = (on(be, &dy), dy.clone());
        be.delay_compensate(&mut g, &w, &on(be, &stale), Some(&mut ms), hp)
            .unwrap();
        cpu.delay_compensate(&mut gc, &wc, &stale, Some(&mut msc), hp)
            .unwrap();
        same("delay compensation", &read(be, &g), &read(&cpu, &gc), 1e-5);
    }
    same("its mean square", &read(be, &ms), &read(&cpu, &msc), 1e-6);
    // g = (2, -1, 0.5), w - w_s = (1, 2, -4): plain with lambda 0.25 adds 0.25 g^2 (w - w_s);
    // adaptive from MS = 0 with m = 0.75 has MS = 0.25 g^2 and lambda = 1 / sqrt(MS + 0).
    let g0 = Tensor::from_vec(&[3], vec![2.0, -1.0, 0.5]).unwrap();
    let w0 = on(be, &Tensor::from_vec(&[3], vec![1.0, 2.0, -4.0]).unwrap());
    let s0 = on(be, &Tensor::zeros(&[3]));
    let mut g = on(be, &g0);
    let plain = DelayCompensation {
        lambda: 0.25,
        adaptive: None,
        eps: 0.0,
    };
    be.delay_compensate(&mut g, &w0, &s0, None, plain).unwrap();
    close(&read(be, &g), &[3.0, -0.5, 0.25], 1e-6);
    let mut g = on(be, &g0);
    let mut ms1 = on(be, &Tensor::zeros(&[3]));
    let adaptive = DelayCompensation {
        lambda: 1.0,
        adaptive: Some(0.75),
        eps: 0.0,
    };
    be.delay_compensate(&mut g, &w0, &s0, Some(&mut ms1), adaptive)
        .unwrap();
    // lambda g^2 = |g| / 0.5 = 2 |g|: g + 2 |g| (w - w_s).
    close(&read(be, &g), &[6.0, 3.0, -3.5], 1e-6);
    close(&read(be, &ms1), &[1.0, 0.25, 0.0625], 1e-6);
    assert!(
        be.delay_compensate(&mut g, &w0, &s0, None, adaptive)
            .is_err(),
        "the adaptive form without its buffer"
    );
    // Softmax cross-entropy: loss, hits and gradient.
    let labels: Vec<u32> = (0..37).map(|i| (i * 7 % 29) as u32).collect();
    let (mut d, mut dc) = (Tensor::default(), Tensor::default());
    let got = be
        .softmax_cross_entropy(&on(be, &x), x.cols(), &ids(be, &labels), 0.25, Some(&mut d))
        .unwrap();
    let want = cpu
        .softmax_cross_entropy(
            &x,
            x.cols(),
            &Tensor::from_vec(&[37], labels.clone()).unwrap(),
            0.25,
            Some(&mut dc),
        )
        .unwrap();
    assert_eq!((got.rows, got.correct), (want.rows, want.correct));
    assert!((got.loss_sum - want.loss_sum).abs() < 1e-6 * want.loss_sum.abs().max(1.0));
    same("softmax gradient", &read(be, &d), &read(&cpu, &dc), 1e-6);
}

/// Token ids 3, 0, 3, 1 into a 4 x 2 table; the gradient of the repeated id sums in order.
fn embedding_gathers_and_scatters_rows(be: &dyn Backend) {
    let table = on(
        be,
        &Tensor::from_vec(&[4, 2], (0..8).map(|v| v as f32).collect()).unwrap(),
    );
    let ids_t = on(
        be,
        &Tensor::from_vec(&[4], vec![3.0, 0.0, 3.0, 1.0]).unwrap(),
    );
    let mut out = Tensor::default();
    be.embedding(&ids_t, &table, &mut out).unwrap();
    assert_eq!(read(be, &out), [6., 7., 0., 1., 6., 7., 2., 3.]);
    let dy = on(
        be,
        &Tensor::from_vec(&[4, 2], vec![1., 2., 3., 4., 5., 6., 7., 8.]).unwrap(),
    );
    let mut d = on(be, &Tensor::full(&[4, 2], 1.0));
    be.embedding_backward(&ids_t, &dy, &mut d, true).unwrap();
    assert_eq!(read(be, &d), [4., 5., 8., 9., 1., 1., 7., 9.]);
    be.embedding_backward(&ids_t, &dy, &mut d, false).unwrap();
    assert_eq!(read(be, &d), [3., 4., 7., 8., 0., 0., 6., 8.]);
    // A table large enough (rows x ids over 2^22) for the CUDA backend's grouped kernels, with
    // ids repeated up to hundreds of times and rows never hit: every element adds its terms in
    // position order, so the CPU backend's bits, accumulated and not.
    let (rows, width, n) = (5_000, 130, 1_500);
    let ids: Vec<f32> = (0..n)
        .map(|i: usize| ((i * i * 7 + i / 3) % 1_009 * (i % 5)) as f32)
        .collect();
    let ids_t = Tensor::from_vec(&[n], ids).unwrap();
    let dy = rand_t(&[n, width], 41);
    let cpu = CpuBackend::new(1).unwrap();
    for accumulate in [false, true] {
        let start = rand_t(&[rows, width], 42);
        let (mut got, mut want) = (on(be, &start), start.clone());
        be.embedding_backward(&on(be, &ids_t), &on(be, &dy), &mut got, accumulate)
            .unwrap();
        cpu.embedding_backward(&ids_t, &dy, &mut want, accumulate)
            .unwrap();
        let (got, want) = (read(be, &got), read(&cpu, &want));
        assert!(
            got.iter()
                .zip(&want)
                .all(|(g, w)| g.to_bits() == w.to_bits()),
            "large-table embedding gradient (accumulate {accumulate})"
        );
    }
    // A bad id is an error naming its position: from the call on the CPU, by the next wait on
    // a device that queues the check (the CUDA backend); the kernels never read past the table
    // meanwhile, and the backend goes on working after it.
    let is_token_error = |e: &KernelError, index: usize, vocab: usize| matches!(e, KernelError::Token { index: i, vocab: v, .. } if *i == index && *v == vocab);
    for bad in [4.0, -1.0, 1.5, f32::NAN] {
        let ids_t = on(be, &Tensor::from_vec(&[2], vec![0.0, bad]).unwrap());
        let e = be
            .embedding(&ids_t, &table, &mut out)
            .and_then(|()| be.synchronize())
            .unwrap_err();
        assert!(is_token_error(&e, 1, 4), "{e}");
        let dy = on(be, &rand_t(&[2, 3], 5));
        let mut dtable = on(be, &Tensor::zeros(&[4, 3]));
        let e = be
            .embedding_backward(&ids_t, &dy, &mut dtable, true)
            .and_then(|()| be.synchronize())
            .unwrap_err();
        assert!(is_token_error(&e, 1, 4), "{e}");
    }
    // The same through the large-table gradient (ids grouped by table row first).
    let (rows, n) = (5000, 1000);
    let mut many: Vec<f32> = (0..n).map(|i| (i * 7 % rows) as f32).collect();
    many[7] = rows as f32;
    let ids_t = on(be, &Tensor::from_vec(&[n], many).unwrap());
    let dy = on(be, &rand_t(&[n, 3], 6));
    let mut dtable = on(be, &Tensor::zeros(&[rows, 3]));
    let e = be
        .embedding_backward(&ids_t, &dy, &mut dtable, false)
        .and_then(|()| be.synchronize())
        .unwrap_err();
    assert!(is_token_error(&e, 7, rows), "{e}");
    let good = on(be, &Tensor::from_vec(&[2], vec![3.0, 0.0]).unwrap());
    be.embedding(&good, &table, &mut out).unwrap();
    be.synchronize().unwrap();
    let (rows_of, w) = (read(be, &table), table.cols());
    assert_eq!(
        read(be, &out),
        [&rows_of[3 * w..4 * w], &rows_of[..w]].concat()
    );
}

/// Causal attention in f64, the definition: per sequence and head, scores over positions up
/// to the row's own, softmax, weighted values. Returns (out, lse).
fn naive_attention(qkv: &[f32], s: AttentionShape) -> (Vec<f64>, Vec<f64>) {
    naive_attention_within(qkv, None, s)
}

/// [`naive_attention`] of packed documents: row `i` of sequence `b` attends over keys
/// `starts[b * seq + i]..=i` (all of `0..=i` without `starts`).
fn naive_attention_within(
    qkv: &[f32],
    starts: Option<&[f32]>,
    s: AttentionShape,
) -> (Vec<f64>, Vec<f64>) {
    let (t, c, h) = (s.seq, s.width, s.heads);
    let d = c / h;
    let at = |b: usize, i: usize, col: usize| f64::from(qkv[(b * t + i) * 3 * c + col]);
    let mut out = vec![0.0; s.batch * t * c];
    let mut lse = vec![0.0; s.batch * h * t];
    for b in 0..s.batch {
        for hd in 0..h {
            for i in 0..t {
                let first = starts.map_or(0, |st| st[b * t + i] as usize);
                let scores: Vec<f64> = (first..=i)
                    .map(|j| {
                        (0..d)
                            .map(|p| at(b, i, hd * d + p) * at(b, j, c + hd * d + p))
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|v| (v - m).exp()).sum();
                lse[(b * h + hd) * t + i] = m + z.ln();
                for p in 0..d {
                    out[(b * t + i) * c + hd * d + p] = scores
                        .iter()
                        .enumerate()
                        .map(|(j, v)| (v - m).exp() / z * at(b, first + j, 2 * c + hd * d + p))
                        .sum();
                }
            }
        }
    }
    (out, lse)
}

const ATTN: AttentionShape = AttentionShape {
    batch: 3,
    seq: 7,
    heads: 2,
    width: 8,
};

/// Longer than the CPU kernel's 32-row causal blocks, and not a multiple of them: the blocks
/// past the first, the skipped tiles and a partial last block are all exercised.
const LONG_ATTN: AttentionShape = AttentionShape {
    batch: 2,
    seq: 70,
    heads: 2,
    width: 8,
};

/// Heads as wide as `gpt-mini`'s (32: whole vectors of every width) and 24 wide (a vector and
/// a remainder on AVX-512), over several causal blocks: the CPU kernel's register tiles and
/// their edges. Also 16 and 64 wide: the CUDA backend's tiled kernels have one of each.
const WIDE_ATTN: [AttentionShape; 4] = [
    AttentionShape {
        batch: 1,
        seq: 70,
        heads: 3,
        width: 96,
    },
    AttentionShape {
        batch: 2,
        seq: 45,
        heads: 2,
        width: 48,
    },
    // Head widths 16 and 64, over three and two of the CUDA kernels' 64-row tiles.
    AttentionShape {
        batch: 1,
        seq: 130,
        heads: 2,
        width: 32,
    },
    AttentionShape {
        batch: 1,
        seq: 70,
        heads: 1,
        width: 64,
    },
];

fn attention_matches_reference(be: &dyn Backend) {
    attention_forward_case(be, ATTN, 1e-5);
    attention_forward_case(be, LONG_ATTN, 1e-5);
    // Scores six times larger and sums over wider heads: f32's rounding grows with them.
    for shape in WIDE_ATTN {
        attention_forward_case(be, shape, 4e-5);
    }
}

fn attention_forward_case(be: &dyn Backend, shape: AttentionShape, tol: f64) {
    let rows = shape.batch * shape.seq;
    let mut qkv = rand_t(&[rows, 3 * shape.width], 21);
    // Large scores too: the softmax must subtract its row maximum.
    qkv.host_mut().unwrap().iter_mut().for_each(|v| *v *= 6.0);
    let (want, want_lse) = naive_attention(qkv.host().unwrap(), shape);
    let (mut out, mut lse) = (Tensor::default(), Tensor::default());
    be.attention(&on(be, &qkv), None, shape, &mut out, &mut lse)
        .unwrap();
    assert_eq!(out.shape(), [rows, shape.width]);
    close(&read(be, &out), &want, tol);
    close(&read(be, &lse), &want_lse, tol);
    let short = rand_t(&[rows - 1, 3 * shape.width], 1);
    assert!(
        be.attention(&on(be, &short), None, shape, &mut out, &mut lse)
            .is_err()
    );
    let odd = AttentionShape { heads: 5, ..shape };
    assert!(
        be.attention(&on(be, &qkv), None, odd, &mut out, &mut lse)
            .is_err()
    );
}

/// The backward against central differences of `sum(out * g)` computed in f64.
fn attention_backward_matches_reference(be: &dyn Backend) {
    attention_backward_case(be, ATTN, 1);
    attention_backward_case(
        be,
        AttentionShape {
            batch: 1,
            ..LONG_ATTN
        },
        1,
    );
    // Every 11th input of the wide shapes (11 is prime to 3C, so every part and head is hit).
    for shape in WIDE_ATTN {
        attention_backward_case(be, shape, 11);
    }
}

/// Checks every `every`-th element of the query-key-value gradient.
fn attention_backward_case(be: &dyn Backend, shape: AttentionShape, every: usize) {
    let rows = shape.batch * shape.seq;
    let qkv = rand_t(&[rows, 3 * shape.width], 22);
    let g = lcg(rows * shape.width, 23);
    let (mut out, mut lse) = (Tensor::default(), Tensor::default());
    be.attention(&on(be, &qkv), None, shape, &mut out, &mut lse)
        .unwrap();
    let dout = Tensor::from_vec(&[rows, shape.width], g.clone()).unwrap();
    let mut dqkv = Tensor::default();
    be.attention_backward(
        &on(be, &qkv),
        None,
        &out,
        &lse,
        &on(be, &dout),
        shape,
        &mut dqkv,
    )
    .unwrap();
    let objective = |x: &[f32]| -> f64 {
        let (o, _) = naive_attention(x, shape);
        o.iter().zip(&g).map(|(o, g)| o * f64::from(*g)).sum()
    };
    let base = qkv.host().unwrap().to_vec();
    let h = 1e-3f32;
    let checked: Vec<usize> = (0..base.len()).step_by(every).collect();
    let want: Vec<f64> = checked
        .iter()
        .map(|&i| {
            let (mut up, mut down) = (base.clone(), base.clone());
            up[i] += h;
            down[i] -= h;
            (objective(&up) - objective(&down)) / f64::from(2.0 * h)
        })
        .collect();
    let got = read(be, &dqkv);
    assert_eq!(got.len(), base.len());
    let got: Vec<f32> = checked.iter().map(|&i| got[i]).collect();
    close(&got, &want, 2e-3);
}

backend_tests!(
    cpu,
    Some(pipe_kernels::CpuBackend::new(2).unwrap()),
    [
        elementwise_and_norms_agree_with_the_cpu_backend,
        updates_and_loss_agree_with_the_cpu_backend,
        adam_updates_give_each_tensors_own_update,
        matmul_all_transposes,
        small_row_products_see_every_change_to_the_operand,
        matmul_rejects_bad_shapes,
        elementwise_and_reductions,
        data_movement_and_products,
        softmax_cross_entropy_matches_reference,
        queued_losses_are_read_together,
        embedding_gathers_and_scatters_rows,
        attention_matches_reference,
        attention_backward_matches_reference,
        attention_masks_packed_documents,
        ignored_labels_are_not_loss_terms,
        wide_softmax_cross_entropy_agrees_with_the_cpu_backend,
        non_finite_values_are_found_by_tensor,
        updates_say_what_they_saw,
        lent_buffers_are_copied_whole,
        linear_adds_its_bias_to_the_product,
        linear_activation_keeps_the_product_and_its_activation,
        linear_grad_activation_is_the_product_then_the_activation_gradient,
        linear_weight_grads_are_the_product_and_the_column_sums,
    ]
);

// The CPU's bf16x6 products: the tile arithmetic emulated in scalar code (every CPU), and on
// the AMX tiles where this CPU has them (skipped otherwise). Both within the f32 tolerance.
backend_tests!(
    cpu_bf16x6_emulated,
    Some(
        pipe_kernels::CpuBackend::with_emulated_tiles(2, pipe_kernels::Precision::Bf16x6).unwrap()
    ),
    [
        matmul_all_transposes,
        small_row_products_see_every_change_to_the_operand,
        matmul_rejects_bad_shapes,
        data_movement_and_products,
    ]
);

backend_tests!(
    cpu_bf16x6,
    pipe_kernels::CpuBackend::with_precision(2, pipe_kernels::Precision::Bf16x6).ok(),
    [
        matmul_all_transposes,
        small_row_products_see_every_change_to_the_operand,
        matmul_rejects_bad_shapes,
        data_movement_and_products,
        bf16x6_is_as_accurate_as_f32,
    ]
);

// The CPU's bf16x3 products, as bf16x6's above; within the tolerance of these checks (the
// products' error is about 2^-16 of `sum |a b|`: `bf16x3_errs_within_its_bound`).
backend_tests!(
    cpu_bf16x3_emulated,
    Some(
        pipe_kernels::CpuBackend::with_emulated_tiles(2, pipe_kernels::Precision::Bf16x3).unwrap()
    ),
    [
        matmul_all_transposes_at_16_bits,
        small_row_products_see_every_change_to_the_operand,
        matmul_rejects_bad_shapes,
        data_movement_and_products,
        bf16x3_errs_within_its_bound,
    ]
);

backend_tests!(
    cpu_bf16x3,
    pipe_kernels::CpuBackend::with_precision(2, pipe_kernels::Precision::Bf16x3).ok(),
    [
        matmul_all_transposes_at_16_bits,
        small_row_products_see_every_change_to_the_operand,
        matmul_rejects_bad_shapes,
        data_movement_and_products,
        bf16x3_errs_within_its_bound,
    ]
);

/// The largest error against an f64 product, relative to `sum |a b|` of its terms.
fn largest_error(got: &[f32], a: &Tensor, ta: Trans, b: &Tensor, tb: Trans) -> f64 {
    let abs = |t: &Tensor| {
        Tensor::from_vec(
            t.shape(),
            t.host().unwrap().iter().map(|v| v.abs()).collect(),
        )
        .unwrap()
    };
    let (want, size) = (naive(a, ta, b, tb), naive(&abs(a), ta, &abs(b), tb));
    got.iter()
        .zip(want.iter().zip(&size))
        .map(|(&g, (&w, &s))| (f64::from(g) - w).abs() / s.max(f64::MIN_POSITIVE))
        .fold(0.0, f64::max)
}

/// For every transpose at a shape the tiles take (256 x 700 x 300): the largest error of
/// `be`'s product and of the f32 products', each against an f64 product ([`largest_error`]).
fn tile_and_f32_errors(be: &dyn Backend) -> Vec<(Trans, Trans, f64, f64)> {
    let f32_products = CpuBackend::new(2).unwrap();
    let mut errors = Vec::new();
    for ta in [Trans::No, Trans::Yes] {
        for tb in [Trans::No, Trans::Yes] {
            let (a, b) = operands(256, 700, 300, ta, tb, 21);
            let (mut split, mut plain) = (Tensor::default(), Tensor::default());
            be.matmul(&a, ta, &b, tb, &mut split, false).unwrap();
            f32_products
                .matmul(&a, ta, &b, tb, &mut plain, false)
                .unwrap();
            let split = largest_error(split.host().unwrap(), &a, ta, &b, tb);
            let plain = largest_error(plain.host().unwrap(), &a, ta, &b, tb);
            errors.push((ta, tb, split, plain));
        }
    }
    errors
}

/// bf16x6 products err no more than the f32 products do (at most 1.5 times their largest
/// error, over every transpose at a shape the tiles take).
fn bf16x6_is_as_accurate_as_f32(be: &dyn Backend) {
    for (ta, tb, split, plain) in tile_and_f32_errors(be) {
        assert!(
            split <= 1.5 * plain,
            "{ta:?}{tb:?}: bf16x6 {split:e}, f32 {plain:e}"
        );
    }
}

/// bf16x3 products err by at most `2^-16` of `sum |a b|` beyond the f32 products' error: each
/// term drops `a1 b1` and the parts' remainders, together at most `3 2^-18` of `|a b|`
/// (`split_bf16.rs`). And they are not f32's accuracy: the bound is the class, not slack.
fn bf16x3_errs_within_its_bound(be: &dyn Backend) {
    for (ta, tb, split, plain) in tile_and_f32_errors(be) {
        assert!(
            split <= 2f64.powi(-16) + plain,
            "{ta:?}{tb:?}: bf16x3 {split:e}, f32 {plain:e}"
        );
        assert!(
            split > 4.0 * plain,
            "{ta:?}{tb:?}: bf16x3 {split:e} as close as f32's {plain:e}: not on the tiles?"
        );
    }
}

/// The tile arithmetic emulated in scalar code gives the AMX tiles' bits through the backend,
/// and neither depends on the thread count.
#[test]
fn bf16x6_bits_are_the_same_with_or_without_amx_at_any_thread_count() {
    tile_bits_are_the_same_with_or_without_amx_at_any_thread_count(pipe_kernels::Precision::Bf16x6);
}

/// The same for bf16x3.
#[test]
fn bf16x3_bits_are_the_same_with_or_without_amx_at_any_thread_count() {
    tile_bits_are_the_same_with_or_without_amx_at_any_thread_count(pipe_kernels::Precision::Bf16x3);
}

fn tile_bits_are_the_same_with_or_without_amx_at_any_thread_count(
    precision: pipe_kernels::Precision,
) {
    let emulated: Vec<CpuBackend> = [1, 3]
        .iter()
        .map(|&t| CpuBackend::with_emulated_tiles(t, precision).unwrap())
        .collect();
    let hardware = CpuBackend::with_precision(2, precision).ok();
    if hardware.is_none() {
        eprintln!("no AMX here: the emulated tiles are compared across thread counts only");
    }
    for &(m, k, n) in &[(300, 260, 270), (256, 1024, 290)] {
        for ta in [Trans::No, Trans::Yes] {
            for tb in [Trans::No, Trans::Yes] {
                let (a, b) = operands(m, k, n, ta, tb, 9);
                let bits = |be: &CpuBackend| {
                    let mut c = Tensor::default();
                    be.matmul(&a, ta, &b, tb, &mut c, false).unwrap();
                    be.matmul(&a, ta, &b, tb, &mut c, true).unwrap();
                    c.host()
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<u32>>()
                };
                let first = bits(&emulated[0]);
                assert!(
                    bits(&emulated[1]) == first,
                    "{m}x{k}x{n} {ta:?}{tb:?}: threads"
                );
                if let Some(hw) = &hardware {
                    assert!(bits(hw) == first, "{m}x{k}x{n} {ta:?}{tb:?}: AMX");
                }
            }
        }
    }
}

#[test]
fn tile_precisions_without_amx_are_a_clear_error_and_cuda_refuses_them() {
    use pipe_kernels::{BackendKind, Precision};
    for precision in [Precision::Bf16x6, Precision::Bf16x3] {
        assert_eq!(precision.name().parse::<Precision>(), Ok(precision));
        match CpuBackend::with_precision(1, precision) {
            Ok(be) => assert_eq!(be.precision(), precision),
            Err(e) => assert!(e.to_string().contains("AMX"), "{e}"),
        }
        let cuda: BackendKind = "cuda".parse().unwrap();
        let refused = cuda.with_precision(precision).unwrap_err();
        assert!(refused.contains(precision.name()), "{refused}");
        match BackendKind::default().with_precision(precision) {
            Ok(cpu) => assert_eq!(cpu.precision(), precision),
            Err(e) => assert!(e.contains("needs a CPU with AMX"), "{e}"),
        }
    }
    assert!(
        BackendKind::default()
            .with_precision(Precision::Tf32)
            .is_err()
    );
}

// The device code paths (placement, copies, strict operands) with the CPU's results.
backend_tests!(
    emulated,
    Some(pipe_kernels::EmulatedDevice::new(0).unwrap()),
    [
        elementwise_and_norms_agree_with_the_cpu_backend,
        updates_and_loss_agree_with_the_cpu_backend,
        adam_updates_give_each_tensors_own_update,
        matmul_all_transposes,
        small_row_products_see_every_change_to_the_operand,
        matmul_rejects_bad_shapes,
        elementwise_and_reductions,
        data_movement_and_products,
        softmax_cross_entropy_matches_reference,
        queued_losses_are_read_together,
        embedding_gathers_and_scatters_rows,
        attention_matches_reference,
        attention_backward_matches_reference,
        attention_masks_packed_documents,
        ignored_labels_are_not_loss_terms,
        wide_softmax_cross_entropy_agrees_with_the_cpu_backend,
        non_finite_values_are_found_by_tensor,
        updates_say_what_they_saw,
        lent_buffers_are_copied_whole,
        linear_adds_its_bias_to_the_product,
        linear_activation_keeps_the_product_and_its_activation,
        linear_grad_activation_is_the_product_then_the_activation_gradient,
        linear_weight_grads_are_the_product_and_the_column_sums,
    ]
);

#[cfg(feature = "cuda")]
backend_tests!(
    cuda,
    super::cuda_or_skip(),
    [
        elementwise_and_norms_agree_with_the_cpu_backend,
        updates_and_loss_agree_with_the_cpu_backend,
        adam_updates_give_each_tensors_own_update,
        matmul_all_transposes,
        small_row_products_see_every_change_to_the_operand,
        matmul_rejects_bad_shapes,
        elementwise_and_reductions,
        data_movement_and_products,
        softmax_cross_entropy_matches_reference,
        queued_losses_are_read_together,
        embedding_gathers_and_scatters_rows,
        attention_matches_reference,
        attention_backward_matches_reference,
        attention_masks_packed_documents,
        ignored_labels_are_not_loss_terms,
        wide_softmax_cross_entropy_agrees_with_the_cpu_backend,
        non_finite_values_are_found_by_tensor,
        updates_say_what_they_saw,
        lent_buffers_are_copied_whole,
        linear_adds_its_bias_to_the_product,
        linear_activation_keeps_the_product_and_its_activation,
        linear_grad_activation_is_the_product_then_the_activation_gradient,
        linear_weight_grads_are_the_product_and_the_column_sums,
    ]
);

/// The guard over an update's gradients: the first tensor holding a NaN or an infinity is
/// named, wherever in it the value sits; empty and finite tensors pass.
fn non_finite_values_are_found_by_tensor(be: &dyn Backend) {
    let finite = rand_t(&[64, 33], 21);
    let empty = Tensor::from_vec(&[0], Vec::new()).unwrap();
    assert_eq!(be.first_non_finite(&[]).unwrap(), None);
    let (f, e) = (on(be, &finite), on(be, &empty));
    assert_eq!(be.first_non_finite(&[&f, &e, &f]).unwrap(), None);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for at in [0, 1000, 64 * 33 - 1] {
            let mut values = finite.host().unwrap().to_vec();
            values[at] = bad;
            let b = on(be, &Tensor::from_vec(&[64, 33], values).unwrap());
            assert_eq!(
                be.first_non_finite(&[&f, &e, &b, &b]).unwrap(),
                Some(2),
                "{bad} at {at}"
            );
        }
    }
}

/// An optimizer update says what it saw of its gradient and its new weights: a backend that
/// looked (the CPU's, and the emulator through it) must say so, and rightly, for a NaN or an
/// infinity anywhere in a tensor of several parallel chunks; one that did not says nothing.
fn updates_say_what_they_saw(be: &dyn Backend) {
    let shape = [300, 300];
    let n = 300 * 300;
    let sgd = SgdStep {
        lr: 1.0,
        momentum: 0.0,
        nesterov: false,
        weight_decay: 0.0,
    };
    let momentum = SgdStep {
        momentum: 0.9,
        ..sgd
    };
    let adam = ADAM;
    let lion = LION;
    // Every update kind, from weights `w` and gradient `g`.
    let update = |w: &[f32], g: &[f32]| -> Vec<UpdateSeen> {
        let (g, zeros) = (
            on(be, &Tensor::from_vec(&shape, g.to_vec()).unwrap()),
            Tensor::zeros(&shape),
        );
        let fresh = || on(be, &Tensor::from_vec(&shape, w.to_vec()).unwrap());
        let (mut a, mut b, mut c, mut d) = (fresh(), fresh(), fresh(), fresh());
        let (mut m1, mut m2, mut m3, mut v) = (
            on(be, &zeros),
            on(be, &zeros),
            on(be, &zeros),
            on(be, &zeros),
        );
        vec![
            be.sgd_update(&mut a, &g, None, sgd).unwrap(),
            be.sgd_update(&mut b, &g, Some(&mut m1), momentum).unwrap(),
            be.adam_update(&mut c, &g, &mut m2, &mut v, adam).unwrap(),
            be.lion_update(&mut d, &g, &mut m3, lion).unwrap(),
        ]
    };
    let looked = be.name() == "cpu" || be.name().starts_with("emulated");
    let check = |seen: Vec<UpdateSeen>, grad: bool, param: bool, case: &str| {
        for (kind, s) in seen.iter().enumerate() {
            if looked {
                assert_eq!(
                    (s.grad, s.param),
                    (Some(grad), Some(param)),
                    "{case}, update {kind}"
                );
            } else {
                assert_eq!((s.grad, s.param), (None, None), "{case}, update {kind}");
            }
        }
    };
    let w = lcg(n, 5);
    let g = lcg(n, 6);
    check(update(&w, &g), true, true, "finite");
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for at in [0, 40_000, n - 1] {
            let mut g_bad = g.clone();
            g_bad[at] = bad;
            // A gradient that is not finite makes the weights of every one of these updates so
            // too, but Lion's: its step is a sign, of a NaN 0, of an infinity 1.
            let seen = update(&w, &g_bad);
            let (rest, lion) = seen.split_at(3);
            check(
                rest.to_vec(),
                false,
                false,
                &format!("{bad} in the gradient at {at}"),
            );
            check(
                lion.to_vec(),
                false,
                true,
                &format!("{bad} in Lion's gradient at {at}"),
            );
        }
    }
    // Finite operands whose plain SGD step overflows: the weights are seen, not the gradient.
    let mut w_big = w.clone();
    let mut g_big = g.clone();
    w_big[50_000] = 3e38;
    g_big[50_000] = -3e38;
    let seen = update(&w_big, &g_big);
    check(seen[..1].to_vec(), true, false, "an overflowing step");
}

/// The promise the whole project's oracle rests on: same inputs, same bits, any thread count.
#[test]
fn cpu_results_do_not_depend_on_thread_count() {
    let shapes = [
        (32, 1024, 1024),
        (8, 512, 256),
        (256, 1024, 1024),
        (64, 1024, 4096),
        (1024, 256, 1024),
        (1024, 64, 10),
        (33, 77, 5),
    ];
    let backends: Vec<CpuBackend> = [1, 2, 3, 4]
        .iter()
        .map(|&t| CpuBackend::new(t).unwrap())
        .collect();
    for &(m, k, n) in &shapes {
        for ta in [Trans::No, Trans::Yes] {
            for tb in [Trans::No, Trans::Yes] {
                let (a, b) = operands(m, k, n, ta, tb, 5);
                let outs: Vec<Vec<u32>> = backends
                    .iter()
                    .map(|be| {
                        let mut c = Tensor::default();
                        be.matmul(&a, ta, &b, tb, &mut c, false).unwrap();
                        be.matmul(&a, ta, &b, tb, &mut c, true).unwrap();
                        c.host().unwrap().iter().map(|v| v.to_bits()).collect()
                    })
                    .collect();
                for (t, o) in outs.iter().enumerate().skip(1) {
                    assert!(
                        o == &outs[0],
                        "{m}x{k}x{n} {ta:?}{tb:?}: {} threads differ from 1",
                        t + 1
                    );
                }
            }
        }
    }
    // Elementwise kernels and reductions above the parallel threshold.
    let x = rand_t(&[512, 1024], 7);
    let dy = rand_t(&[512, 1024], 8);
    let results: Vec<Vec<u32>> = backends
        .iter()
        .map(|be| {
            let mut out = Vec::new();
            for act in [
                Activation::Relu,
                Activation::Gelu,
                Activation::Tanh,
                Activation::Sigmoid,
            ] {
                let (mut y, mut dx) = (Tensor::default(), Tensor::default());
                be.activation(act, &x, &mut y).unwrap();
                be.activation_backward(act, &x, &dy, &mut dx).unwrap();
                out.extend(
                    y.host()
                        .unwrap()
                        .iter()
                        .chain(dx.host().unwrap())
                        .map(|v| v.to_bits()),
                );
            }
            let mut s = Tensor::default();
            be.sum_rows(&x, &mut s, false).unwrap();
            out.extend(s.host().unwrap().iter().map(|v| v.to_bits()));
            let mut t = Tensor::default();
            be.transpose(&x, &mut t).unwrap();
            out.extend(t.host().unwrap().iter().map(|v| v.to_bits()));
            // A sequence per task, and (fewer sequences than threads) each sequence's heads
            // split between tasks.
            for (batch, seq, heads, width) in [(4, 64, 4, 64), (1, 70, 3, 96), (3, 40, 5, 40)] {
                let shape = AttentionShape {
                    batch,
                    seq,
                    heads,
                    width,
                };
                let qkv = rand_t(&[batch * seq, 3 * width], 9);
                let dout = rand_t(&[batch * seq, width], 10);
                let (mut o, mut l) = (Tensor::default(), Tensor::default());
                let mut d = Tensor::default();
                be.attention(&qkv, None, shape, &mut o, &mut l).unwrap();
                be.attention_backward(&qkv, None, &o, &l, &dout, shape, &mut d)
                    .unwrap();
                for r in [&o, &l, &d] {
                    out.extend(r.host().unwrap().iter().map(|v| v.to_bits()));
                }
            }
            out
        })
        .collect();
    for r in &results[1..] {
        assert!(r == &results[0]);
    }
}

#[test]
#[cfg(not(feature = "cuda"))]
fn cuda_without_feature_is_a_clear_error() {
    let e = pipe_kernels::CudaBackend::new(0).unwrap_err();
    assert_eq!(e, KernelError::NotCompiledWithCuda);
    assert!(e.to_string().contains("built without CUDA"));
    assert_eq!(
        pipe_kernels::cuda::device_count().unwrap_err(),
        KernelError::NotCompiledWithCuda
    );
}

/// With the feature and no driver, opening the backend is an error that says what is missing
/// (never the panic cudarc gives without a driver); with a GPU, a device that does not exist is
/// refused the same way.
#[test]
#[cfg(feature = "cuda")]
fn cuda_without_a_gpu_is_a_clear_error() {
    match pipe_kernels::cuda::device_count() {
        Err(e) => {
            assert!(matches!(e, KernelError::NoCuda { .. }), "{e}");
            assert!(e.to_string().starts_with("CUDA is not available: "), "{e}");
            let again = pipe_kernels::CudaBackend::new(0).unwrap_err();
            assert_eq!(again, e);
        }
        Ok(n) => {
            let e = pipe_kernels::CudaBackend::new(n).unwrap_err();
            assert!(
                e.to_string().contains(&format!("device {n} requested")),
                "{e}"
            );
        }
    }
}

/// Memory a device backend would own: here only a size and a device, to check how host code
/// and the CPU backend treat a tensor they cannot read.
#[derive(Debug)]
struct ForeignMemory {
    bytes: usize,
}

impl DeviceMemory for ForeignMemory {
    fn device(&self) -> Device {
        Device::Cuda(3)
    }
    fn bytes(&self) -> usize {
        self.bytes
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[test]
fn device_tensors_are_refused_by_host_code_not_read() {
    let mem: Arc<dyn DeviceMemory> = Arc::new(ForeignMemory { bytes: 24 });
    let e = Tensor::<f32>::from_device(&[4, 2], Arc::clone(&mem)).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::Shape {
                op: "from_device",
                ..
            }
        ),
        "{e}"
    );
    let dev = Tensor::<f32>::from_device(&[2, 3], Arc::clone(&mem)).unwrap();
    assert_eq!(
        (dev.device(), dev.len(), dev.bytes()),
        (Device::Cuda(3), 6, 24)
    );
    let not_host = KernelError::NotOnHost {
        device: Device::Cuda(3),
    };
    assert_eq!(dev.host().unwrap_err(), not_host);
    assert_eq!(dev.clone().into_host_vec().unwrap_err(), not_host);
    assert_eq!(dev, dev.clone(), "clones share the device buffer");
    let be = CpuBackend::new(1).unwrap();
    assert_eq!(be.place(dev.clone()).unwrap_err(), not_host);
    assert_eq!(be.read(&dev).unwrap_err(), not_host);
    let host = rand_t(&[3, 2], 1);
    let mut c = Tensor::default();
    let e = be
        .matmul(&dev, Trans::No, &host, Trans::No, &mut c, false)
        .unwrap_err();
    assert_eq!(e, not_host);
    assert!(e.to_string().contains("cuda:3"), "{e}");
    // An output the backend overwrites may start anywhere: it becomes host memory.
    let mut out = dev.clone();
    be.activation(Activation::Relu, &host, &mut out).unwrap();
    assert_eq!(out.device(), Device::Host);
}

#[test]
fn id_tensors_hold_u32() {
    let t = Tensor::<u32>::from_vec(&[2, 2], vec![1, 2, 3, 4]).unwrap();
    assert_eq!((t.dtype(), t.rows(), t.cols()), (DType::U32, 2, 2));
    assert_eq!(t.host().unwrap(), &[1, 2, 3, 4]);
    assert_eq!(Tensor::<u32>::zeros(&[3]).host().unwrap(), &[0, 0, 0]);
    assert!(Tensor::<u32>::from_vec(&[3], vec![1]).is_err());
    assert!(Tensor::<f32>::default().is_empty());
}

/// `x` rounded to `mantissa` bits (round to nearest, ties to even): what TF32 (10) and bf16 (7)
/// keep of an f32 product input.
fn round_mantissa(x: f32, mantissa: u32) -> f32 {
    let drop = 23 - mantissa;
    let bits = x.to_bits();
    let half = (1u32 << (drop - 1)) - 1 + ((bits >> drop) & 1);
    f32::from_bits((bits + half) & !((1u32 << drop) - 1))
}

/// The reduced precisions on CUDA, for every transpose and with accumulation, with rows that
/// are and are not multiples of 8 values (cuBLAS's aligned and unaligned kernels): bf16 products
/// equal the f64 product of the inputs rounded to bf16 up to f32 accumulation (1e-4); TF32
/// products are within 5e-3 of the product of inputs rounded to TF32 (cuBLAS may truncate
/// rather than round the inputs, so looser); the same call twice gives the same bits.
#[cfg(feature = "cuda")]
#[test]
fn cuda_reduced_precision_products_round_their_inputs() {
    use pipe_kernels::Precision;
    for (precision, mantissa, tol) in [(Precision::Bf16, 7, 1e-4), (Precision::Tf32, 10, 5e-3)] {
        let Some(be) = cuda_with_precision_or_skip(precision) else {
            return;
        };
        assert_eq!(be.precision(), precision);
        // Rows of 33, 7 and 1,001 values, not multiples of 8 (GPT-2's head is 50,257 wide).
        for (m, k, n) in [
            (64, 256, 96),
            (5, 33, 7),
            (256, 1024, 512),
            (300, 64, 1001),
            (130, 1001, 24),
        ] {
            for ta in [Trans::No, Trans::Yes] {
                for tb in [Trans::No, Trans::Yes] {
                    let (a, b) = operands(m, k, n, ta, tb, 3);
                    let rounded = |t: &Tensor| {
                        let v = t
                            .host()
                            .unwrap()
                            .iter()
                            .map(|&x| round_mantissa(x, mantissa));
                        Tensor::from_vec(t.shape(), v.collect()).unwrap()
                    };
                    let want = naive(&rounded(&a), ta, &rounded(&b), tb);
                    let (ad, bd) = (on(&be, &a), on(&be, &b));
                    let mut c = Tensor::default();
                    be.matmul(&ad, ta, &bd, tb, &mut c, false).unwrap();
                    let first = read(&be, &c);
                    close(&first, &want, tol);
                    be.matmul(&ad, ta, &bd, tb, &mut c, false).unwrap();
                    assert!(
                        read(&be, &c)
                            .iter()
                            .map(|v| v.to_bits())
                            .eq(first.iter().map(|v| v.to_bits())),
                        "{precision} {m}x{k}x{n}: a repeated product changed its bits"
                    );
                    be.matmul(&ad, ta, &bd, tb, &mut c, true).unwrap();
                    let twice: Vec<f64> = want.iter().map(|w| 2.0 * w).collect();
                    close(&read(&be, &c), &twice, tol);
                    // An operand changed in place is rounded again (the backend keeps bf16
                    // copies by content stamp): doubling `a` doubles the product exactly.
                    let mut ad = ad;
                    be.scale(2.0, &mut ad).unwrap();
                    be.matmul(&ad, ta, &bd, tb, &mut c, false).unwrap();
                    let doubled: Vec<f32> = first.iter().map(|v| 2.0 * v).collect();
                    assert!(
                        read(&be, &c)
                            .iter()
                            .map(|v| v.to_bits())
                            .eq(doubled.iter().map(|v| v.to_bits())),
                        "{precision} {m}x{k}x{n}: a product read a stale copy of its operand"
                    );
                }
            }
        }
    }
}

/// The linear layers' product with its bias ([`Backend::linear`], through cuBLASLt's bias
/// epilogue where the backend fuses it) in bf16 and TF32: the product of the rounded inputs
/// plus the unrounded f32 bias, at GPT-2's block shapes and at rows that are not multiples of
/// 8 values; the same call twice gives the same bits.
#[cfg(feature = "cuda")]
#[test]
fn cuda_reduced_precision_linear_adds_the_bias_in_f32() {
    use pipe_kernels::Precision;
    for (precision, mantissa, tol) in [(Precision::Bf16, 7, 1e-4), (Precision::Tf32, 10, 5e-3)] {
        let Some(be) = cuda_with_precision_or_skip(precision) else {
            return;
        };
        for (m, k, n) in [
            (5, 33, 7),
            (300, 64, 1001),
            (256, 768, 2304),
            (256, 3072, 768),
        ] {
            let (x, w) = operands(m, k, n, Trans::No, Trans::No, 5);
            let bias = rand_t(&[n], 6);
            let rounded = |t: &Tensor| {
                let v = t
                    .host()
                    .unwrap()
                    .iter()
                    .map(|&v| round_mantissa(v, mantissa));
                Tensor::from_vec(t.shape(), v.collect()).unwrap()
            };
            let b = bias.host().unwrap();
            let want: Vec<f64> = naive(&rounded(&x), Trans::No, &rounded(&w), Trans::No)
                .iter()
                .enumerate()
                .map(|(i, p)| p + f64::from(b[i % n]))
                .collect();
            let (xd, wd, bd) = (on(&be, &x), on(&be, &w), on(&be, &bias));
            let mut y = Tensor::default();
            be.linear(&xd, &wd, Some(&bd), &mut y).unwrap();
            let first = read(&be, &y);
            close(&first, &want, tol);
            be.linear(&xd, &wd, Some(&bd), &mut y).unwrap();
            assert!(
                read(&be, &y)
                    .iter()
                    .map(|v| v.to_bits())
                    .eq(first.iter().map(|v| v.to_bits())),
                "{precision} {m}x{k}x{n}: a repeated linear product changed its bits"
            );
            // With the GELU after it: the same product kept, its GELU as the CPU's.
            let (mut pre, mut gelu) = (Tensor::default(), Tensor::default());
            be.linear_activation(&xd, &wd, Some(&bd), Activation::Gelu, &mut pre, &mut gelu)
                .unwrap();
            let pre = read(&be, &pre);
            close(&pre, &want, tol);
            let cpu = CpuBackend::new(1).unwrap();
            let mut want_gelu = Tensor::default();
            let pre = Tensor::from_vec(&[m, n], pre).unwrap();
            cpu.activation(Activation::Gelu, &pre, &mut want_gelu)
                .unwrap();
            let what = format!("{precision} {m}x{k}x{n} GELU");
            same_as_cpu(
                &be,
                &what,
                &read(&be, &gelu),
                want_gelu.host().unwrap(),
                1e-5,
            );
            // GELU's gradient in the backward's product: a gradient of the output's shape
            // through the same weight into GELU at `x`, against the rounded inputs' product
            // times GELU'(x).
            let dy = rand_t(&[m, n], 7);
            let mut dz = Tensor::default();
            be.linear_grad_activation(&on(&be, &dy), &wd, Activation::Gelu, &xd, &mut dz)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let want_dz: Vec<f64> = naive(&rounded(&dy), Trans::No, &rounded(&w), Trans::Yes)
                .iter()
                .zip(slope_of(&cpu, Activation::Gelu, &x))
                .map(|(d, s)| d * f64::from(s))
                .collect();
            close(&read(&be, &dz), &want_dz, tol);
            // The weight gradients: `x^T dy` and `dy`'s column sums, both from the inputs as
            // the product reads them (rounded), written and then added to.
            let (mut gw, mut gb) = (Tensor::default(), Tensor::default());
            let dyd = on(&be, &dy);
            let want_gw = naive(&rounded(&x), Trans::Yes, &rounded(&dy), Trans::No);
            let r = rounded(&dy).into_host_vec().unwrap();
            let want_gb: Vec<f64> = (0..n)
                .map(|j| (0..m).map(|i| f64::from(r[i * n + j])).sum())
                .collect();
            for accumulate in [false, true] {
                be.linear_weight_grads(&xd, &dyd, &mut gw, Some(&mut gb), accumulate)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
            }
            let twice = |v: &[f64]| v.iter().map(|x| 2.0 * x).collect::<Vec<_>>();
            close(&read(&be, &gw), &twice(&want_gw), tol);
            close(&read(&be, &gb), &twice(&want_gb), tol);
        }
    }
}

#[test]
fn mantissa_rounding_is_to_nearest_even() {
    assert_eq!(round_mantissa(1.0, 7), 1.0);
    // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa, 1.
    assert_eq!(round_mantissa(1.0 + 2f32.powi(-8), 7), 1.0);
    assert_eq!(
        round_mantissa(1.0 + 3.0 * 2f32.powi(-8), 7),
        1.0 + 2.0 * 2f32.powi(-7)
    );
    assert_eq!(
        round_mantissa(-1.0 - 2f32.powi(-6), 7),
        -1.0 - 2f32.powi(-6)
    );
}

/// The gradient of causal attention in f64, from its definition: per sequence, head and query
/// row `i`, `dP_ij = dO_i . v_j`, `dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik)`, then
/// `dq_i = sum_j dS_ij k_j / sqrt(d)`, `dk_j += dS_ij q_i / sqrt(d)`, `dv_j += P_ij dO_i`.
/// Row `i` of sequence `b` attends over keys `starts[b * seq + i]..=i` when `starts` is given.
#[cfg(feature = "cuda")]
fn naive_attention_backward(
    qkv: &[f32],
    dout: &[f32],
    starts: Option<&[f32]>,
    s: AttentionShape,
) -> Vec<f64> {
    let (t, c, h) = (s.seq, s.width, s.heads);
    let d = c / h;
    let scale = 1.0 / (d as f64).sqrt();
    let at = |b: usize, i: usize, col: usize| f64::from(qkv[(b * t + i) * 3 * c + col]);
    let mut grad = vec![0.0; qkv.len()];
    for b in 0..s.batch {
        for hd in 0..h {
            for i in 0..t {
                let first = starts.map_or(0, |st| st[b * t + i] as usize);
                let dot = |j: usize, part: usize| -> f64 {
                    (0..d)
                        .map(|p| at(b, i, hd * d + p) * at(b, j, part * c + hd * d + p))
                        .sum()
                };
                let keys = first..=i;
                let scores: Vec<f64> = keys.clone().map(|j| dot(j, 1) * scale).collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|v| (v - m).exp()).sum();
                let p: Vec<f64> = scores.iter().map(|v| (v - m).exp() / z).collect();
                let go = |q: usize| f64::from(dout[(b * t + i) * c + hd * d + q]);
                let dp: Vec<f64> = keys
                    .clone()
                    .map(|j| (0..d).map(|q| go(q) * at(b, j, 2 * c + hd * d + q)).sum())
                    .collect();
                let mean: f64 = p.iter().zip(&dp).map(|(p, g)| p * g).sum();
                for (k, j) in keys.enumerate() {
                    let ds = p[k] * (dp[k] - mean) * scale;
                    for q in 0..d {
                        grad[(b * t + i) * 3 * c + hd * d + q] += ds * at(b, j, c + hd * d + q);
                        grad[(b * t + j) * 3 * c + c + hd * d + q] += ds * at(b, i, hd * d + q);
                        grad[(b * t + j) * 3 * c + 2 * c + hd * d + q] += p[k] * go(q);
                    }
                }
            }
        }
    }
    grad
}

/// Every element of `got` within `tol` of `want`'s root mean square (a bound for values
/// computed from bf16-rounded inputs, whose errors scale with the tensor, not the element).
#[cfg(feature = "cuda")]
fn close_to_scale(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    let rms = (want.iter().map(|w| w * w).sum::<f64>() / want.len().max(1) as f64).sqrt();
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (f64::from(*g) - w).abs() / rms.max(1e-30))
        .fold(0.0, f64::max);
    eprintln!("{what}: worst error {worst:.2e} of the rms {rms:.3e}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(*g) - w).abs() <= tol * rms.max(1e-30),
            "{what} element {i}: got {g}, want {w} (rms {rms})"
        );
    }
}

/// In bf16 precision the CUDA backend computes attention of head width 64 on tensor cores
/// (flash attention: bf16 products, f32 softmax). Forward, log-sum-exp and the whole
/// query-key-value gradient against the f64 definitions evaluated at the inputs the kernels
/// compute from (qkv and the output gradient rounded to bf16), over shapes that leave partial
/// tiles (sequences of 1, 70, 200 and 256 against blocks of 64 and 128 rows) and scores up to
/// a few units. What remains is the rounding of the softmax weights and their gradients to
/// bf16 before they meet the values, keys and queries: the output within 3e-2 and the gradient
/// within 8e-2 of each tensor's root mean square, the log-sum-exp within 1e-4.
/// `experiments/gpu/attention_numerics.py` emulates the kernels' roundings in numpy: worst
/// 1.2e-2 (output) and 4.4e-2 (gradient) on these shapes, and against the unrounded inputs
/// it gives the errors the H200 printed for this test's first version to three digits
/// (3.34e-3, 5.47e-3, 1.89e-2, 3.12e-2, 3.82e-2). A second call gives the same bits.
#[cfg(feature = "cuda")]
#[test]
fn cuda_bf16_attention_matches_the_f64_definition() {
    use pipe_kernels::Precision;
    let Some(be) = cuda_with_precision_or_skip(Precision::Bf16) else {
        return;
    };
    let shapes = [
        (1, 1, 1, 64, 1.0),
        (2, 70, 2, 128, 2.0),
        (1, 200, 3, 192, 3.0),
        (1, 256, 1, 64, 1.0),
    ];
    for (batch, seq, heads, width, spread) in shapes {
        let shape = AttentionShape {
            batch,
            seq,
            heads,
            width,
        };
        bf16_attention_case(&be, shape, spread, None);
    }
}

/// Packed documents on the tensor cores, against the f64 definitions masked the same way and
/// within the same bounds: documents that start past the first key tile and past a block's
/// first rows (so that a row's first tiles hold no key of its document, and a block's first
/// tiles are skipped), a document of one token, and documents across block edges.
#[cfg(feature = "cuda")]
#[test]
fn cuda_bf16_attention_masks_packed_documents() {
    use pipe_kernels::Precision;
    let Some(be) = cuda_with_precision_or_skip(Precision::Bf16) else {
        return;
    };
    let shape = AttentionShape {
        batch: 2,
        seq: 200,
        heads: 2,
        width: 128,
    };
    let starts = document_starts(
        shape.seq,
        &[
            &[(0, 20), (20, 130), (130, 200)],
            &[(0, 5), (5, 70), (70, 71), (71, 200)],
        ],
    );
    bf16_attention_case(&be, shape, 2.0, Some(&starts));
}

/// One shape of [`cuda_bf16_attention_matches_the_f64_definition`], with packed documents
/// when `starts` is given.
#[cfg(feature = "cuda")]
fn bf16_attention_case(
    be: &dyn Backend,
    shape: AttentionShape,
    spread: f32,
    starts: Option<&[f32]>,
) {
    let (rows, width) = (shape.batch * shape.seq, shape.width);
    let mut qkv = rand_t(&[rows, 3 * width], 31);
    qkv.host_mut()
        .unwrap()
        .iter_mut()
        .for_each(|v| *v *= spread);
    let dout = rand_t(&[rows, width], 32);
    let bf16 = |t: &Tensor| -> Vec<f32> {
        t.host()
            .unwrap()
            .iter()
            .map(|&x| round_mantissa(x, 7))
            .collect()
    };
    let (qkv16, dout16) = (bf16(&qkv), bf16(&dout));
    let (want, want_lse) = naive_attention_within(&qkv16, starts, shape);
    let want_grad = naive_attention_backward(&qkv16, &dout16, starts, shape);
    let placed_starts = starts.map(|s| on(be, &Tensor::from_vec(&[rows], s.to_vec()).unwrap()));
    let run = || {
        let (mut out, mut lse, mut dqkv) =
            (Tensor::default(), Tensor::default(), Tensor::default());
        let x = on(be, &qkv);
        let docs = placed_starts.as_ref();
        be.attention(&x, docs, shape, &mut out, &mut lse).unwrap();
        be.attention_backward(&x, docs, &out, &lse, &on(be, &dout), shape, &mut dqkv)
            .unwrap();
        (read(be, &out), read(be, &lse), read(be, &dqkv))
    };
    let (out, lse, dqkv) = run();
    let what = format!("{shape:?}, documents {}", starts.is_some());
    close_to_scale(&format!("out {what}"), &out, &want, 3e-2);
    for (i, (g, w)) in lse.iter().zip(&want_lse).enumerate() {
        assert!(
            (f64::from(*g) - w).abs() <= 1e-4,
            "lse {what} row {i}: got {g}, want {w}"
        );
    }
    close_to_scale(&format!("dqkv {what}"), &dqkv, &want_grad, 8e-2);
    let again = run();
    assert!(
        again.0 == out && again.1 == lse && again.2 == dqkv,
        "{what}: a repeated call gave other bits"
    );
}

/// A device buffer lent ([`Backend::lend`]) and copied back in by the same backend
/// ([`Backend::copy_lent`]) holds the lent tensor's bits; a shape past the buffer and a damaged
/// handle are refused. A host backend lends nothing and borrows nothing.
fn lent_buffers_are_copied_whole(be: &dyn Backend) {
    let host = rand_t(&[3, 5, 7], 41);
    let t = on(be, &host);
    let lent = be.lend(&t).unwrap();
    let Some(handle) = lent else {
        assert_eq!(
            be.device(),
            Device::Host,
            "a device backend lends its buffers"
        );
        let e = be.copy_lent(b"handle", &[1]).unwrap_err().to_string();
        assert!(e.contains("borrows nothing"), "{e}");
        return;
    };
    let copy = be.copy_lent(&handle, &[3, 5, 7]).unwrap();
    assert_eq!(copy.shape(), &[3, 5, 7]);
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<u32>>();
    assert_eq!(bits(read(be, &copy)), bits(host.host().unwrap().to_vec()));
    let again = be.lend(&t).unwrap().unwrap();
    let e = be.copy_lent(&again, &[1 << 24]).unwrap_err().to_string();
    assert!(e.contains("lent device buffer"), "{e}");
    let mut damaged = be.lend(&t).unwrap().unwrap();
    damaged[0] ^= 0xff;
    let e = be.copy_lent(&damaged, &[3, 5, 7]).unwrap_err().to_string();
    assert!(e.contains("lent device buffer"), "{e}");
    let e = be
        .copy_lent(&damaged[..5], &[3, 5, 7])
        .unwrap_err()
        .to_string();
    assert!(e.contains("lent device buffer"), "{e}");
}

/// The lending side of [`a_buffer_lent_by_another_process`]: run only as that test's child
/// (`PIPE_LEND_CHILD` names the backend), it lends a tensor, prints the handle and holds the
/// tensor until its parent closes its input.
#[test]
fn lending_child() {
    let Some(kind) = std::env::var_os("PIPE_LEND_CHILD") else {
        return;
    };
    let be: Box<dyn Backend> = match kind.to_str() {
        Some("emulated") => Box::new(pipe_kernels::EmulatedDevice::new(0).unwrap()),
        #[cfg(feature = "cuda")]
        Some("cuda") => Box::new(pipe_kernels::CudaBackend::new(0).unwrap()),
        other => panic!("no backend {other:?}"),
    };
    let t = on(be.as_ref(), &rand_t(&[64, 48], 77));
    let handle = be.lend(&t).unwrap().unwrap();
    let hex: String = handle.iter().map(|b| format!("{b:02x}")).collect();
    println!("HANDLE {hex}");
    use std::io::{Read, Write};
    std::io::stdout().flush().unwrap();
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    drop(t);
}

/// Runs [`lending_child`] for `kind` and hands `copy` the handle it lent, while the child holds
/// the buffer; returns what `copy` returned.
fn borrow_from_child<R>(kind: &str, copy: impl FnOnce(&[u8]) -> R) -> R {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "lending_child",
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("PIPE_LEND_CHILD", kind)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = std::io::BufReader::new(stdout).lines().map(Result::unwrap);
    // The harness prints the test's name on the same line first.
    let hex = lines
        .by_ref()
        .find_map(|l| l.split_once("HANDLE ").map(|(_, hex)| hex.to_string()))
        .expect("the child printed no handle");
    let handle: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let out = copy(&handle);
    drop(child.stdin.take());
    // Read to the end, so the child's last lines do not meet a closed pipe.
    lines.for_each(drop);
    assert!(child.wait().unwrap().success());
    out
}

/// A buffer lent by another process: the emulated device, whose loans stand for handles within
/// one process, refuses it by name; the CUDA backend (on a GPU) copies it, bit for bit.
#[test]
fn a_buffer_lent_by_another_process() {
    let borrower = pipe_kernels::EmulatedDevice::new(1).unwrap();
    let e = borrow_from_child("emulated", |h| borrower.copy_lent(h, &[64, 48]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("borrows only within its own process"), "{e}");
    #[cfg(feature = "cuda")]
    if let Some(be) = cuda_or_skip() {
        let copy = borrow_from_child("cuda", |h| be.copy_lent(h, &[64, 48])).unwrap();
        let want = rand_t(&[64, 48], 77);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(&read(&be, &copy)), bits(want.host().unwrap()));
    }
}
