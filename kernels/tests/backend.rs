//! One suite for every backend: each test is stamped per backend by `backend_tests!` (CPU always;
//! CUDA joins when the feature and its kernels exist).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_kernels::{Activation, Backend, CpuBackend, KernelError, Tensor, Trans};

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
        Trans::No => a.data()[i * a.cols() + j],
        Trans::Yes => a.data()[j * a.cols() + i],
    };
    let bt = |i: usize, j: usize| match tb {
        Trans::No => b.data()[i * b.cols() + j],
        Trans::Yes => b.data()[j * b.cols() + i],
    };
    let (m, k) = match ta {
        Trans::No => (a.rows(), a.cols()),
        Trans::Yes => (a.cols(), a.rows()),
    };
    let n = match tb {
        Trans::No => b.cols(),
        Trans::Yes => b.rows(),
    };
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
            let (a, mut b) = operands(m, k, n, Trans::No, tb, 7);
            let mut c = Tensor::default();
            be.matmul(&a, Trans::No, &b, tb, &mut c, false).unwrap();
            close(c.data(), &naive(&a, Trans::No, &b, tb), 1e-4);
            // A clone shares the cached copy; changing the clone must not change the original.
            let mut other = b.clone();
            other.data_mut()[3] += 1.0;
            be.matmul(&a, Trans::No, &other, tb, &mut c, false).unwrap();
            close(c.data(), &naive(&a, Trans::No, &other, tb), 1e-4);
            be.matmul(&a, Trans::No, &b, tb, &mut c, false).unwrap();
            close(c.data(), &naive(&a, Trans::No, &b, tb), 1e-4);
            // In-place changes through every mutable path.
            b.data_mut()[k] = 5.0;
            be.matmul(&a, Trans::No, &b, tb, &mut c, false).unwrap();
            close(c.data(), &naive(&a, Trans::No, &b, tb), 1e-4);
            let step = pipe_kernels::SgdStep {
                lr: 0.5,
                momentum: 0.0,
                nesterov: false,
                weight_decay: 0.0,
            };
            let g = Tensor::full(b.shape(), 0.25);
            be.sgd_update(&mut b, &g, None, step).unwrap();
            be.matmul(&a, Trans::No, &b, tb, &mut c, false).unwrap();
            close(c.data(), &naive(&a, Trans::No, &b, tb), 1e-4);
            b.fill(0.5);
            be.matmul(&a, Trans::No, &b, tb, &mut c, false).unwrap();
            close(c.data(), &naive(&a, Trans::No, &b, tb), 1e-4);
        }
    }
}

fn matmul_all_transposes(be: &dyn Backend) {
    for &(m, k, n) in &[
        (1, 1, 1),
        (3, 5, 7),
        (17, 33, 9),
        (64, 300, 600),
        (300, 64, 40),
    ] {
        for ta in [Trans::No, Trans::Yes] {
            for tb in [Trans::No, Trans::Yes] {
                let (a, b) = operands(m, k, n, ta, tb, 1);
                let mut c = Tensor::default();
                be.matmul(&a, ta, &b, tb, &mut c, false).unwrap();
                assert_eq!(c.shape(), &[m, n]);
                let want = naive(&a, ta, &b, tb);
                close(c.data(), &want, 1e-4);
                // Accumulate: c += a b gives twice the product.
                be.matmul(&a, ta, &b, tb, &mut c, true).unwrap();
                let twice: Vec<f64> = want.iter().map(|v| 2.0 * v).collect();
                close(c.data(), &twice, 1e-4);
            }
        }
    }
}

fn matmul_rejects_bad_shapes(be: &dyn Backend) {
    let a = rand_t(&[3, 4], 1);
    let b = rand_t(&[5, 6], 2);
    let mut c = Tensor::default();
    let e = be
        .matmul(&a, Trans::No, &b, Trans::No, &mut c, false)
        .unwrap_err();
    assert!(matches!(e, KernelError::Shape { .. }), "{e}");
    let b = rand_t(&[4, 6], 2);
    let mut wrong = Tensor::zeros(&[2, 2]);
    assert!(
        be.matmul(&a, Trans::No, &b, Trans::No, &mut wrong, true)
            .is_err()
    );
}

fn elementwise_and_reductions(be: &dyn Backend) {
    let x = rand_t(&[7, 13], 3);
    let mut t = Tensor::default();
    be.transpose(&x, &mut t).unwrap();
    assert_eq!(t.shape(), &[13, 7]);
    for i in 0..7 {
        for j in 0..13 {
            assert_eq!(t.data()[j * 7 + i], x.data()[i * 13 + j]);
        }
    }
    let bias = rand_t(&[13], 4);
    let mut y = x.clone();
    be.add_bias(&mut y, &bias).unwrap();
    assert_eq!(y.data()[13 + 5], x.data()[13 + 5] + bias.data()[5]);
    assert!(be.add_bias(&mut y, &rand_t(&[12], 4)).is_err());
    let mut s = Tensor::default();
    be.sum_rows(&x, &mut s, false).unwrap();
    let want: Vec<f64> = (0..13)
        .map(|j| (0..7).map(|i| x.data()[i * 13 + j] as f64).sum())
        .collect();
    close(s.data(), &want, 1e-6);
    let total = be.sum(&x).unwrap();
    assert!((total - want.iter().sum::<f64>()).abs() < 1e-5);
    let sq = be.sum_squares(&x).unwrap();
    assert!((sq - x.data().iter().map(|v| (*v as f64).powi(2)).sum::<f64>()).abs() < 1e-9);
    let mut r = Tensor::default();
    be.activation(Activation::Relu, &x, &mut r).unwrap();
    assert!(r.data().iter().zip(x.data()).all(|(r, x)| *r == x.max(0.0)));
    let mut yy = x.clone();
    be.axpy(2.0, &x, &mut yy).unwrap();
    assert!(
        yy.data()
            .iter()
            .zip(x.data())
            .all(|(y, x)| (y - 3.0 * x).abs() < 1e-6)
    );
    be.scale(0.5, &mut yy).unwrap();
    assert!(
        yy.data()
            .iter()
            .zip(x.data())
            .all(|(y, x)| (y - 1.5 * x).abs() < 1e-6)
    );
}

fn softmax_cross_entropy_matches_reference(be: &dyn Backend) {
    let logits = rand_t(&[5, 4], 9);
    let labels = [0u32, 3, 2, 1, 3];
    let mut d = Tensor::default();
    let s = be
        .softmax_cross_entropy(&logits, &labels, 0.5, Some(&mut d))
        .unwrap();
    let mut want = 0.0f64;
    for (i, &l) in labels.iter().enumerate() {
        let row: Vec<f64> = logits.data()[i * 4..i * 4 + 4]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let z: f64 = row.iter().map(|v| v.exp()).sum();
        want += z.ln() - row[l as usize];
        for (j, v) in row.iter().enumerate() {
            let p = v.exp() / z;
            let g = 0.5 * (p - if j == l as usize { 1.0 } else { 0.0 });
            assert!((d.data()[i * 4 + j] as f64 - g).abs() < 1e-6);
        }
    }
    assert!((s.loss_sum - want).abs() < 1e-5);
    assert_eq!(s.rows, 5);
    let e = be
        .softmax_cross_entropy(&logits, &[0, 1, 2, 3, 4], 1.0, None)
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
        be.softmax_cross_entropy(&logits, &[0, 1], 1.0, None)
            .is_err()
    );
}

macro_rules! backend_tests {
    ($backend:ident, $make:expr, [$($test:ident),* $(,)?]) => {
        mod $backend {
            $(
                #[test]
                fn $test() {
                    let be = $make;
                    super::$test(&be);
                }
            )*
        }
    };
}

backend_tests!(
    cpu,
    pipe_kernels::CpuBackend::new(2).unwrap(),
    [
        matmul_all_transposes,
        small_row_products_see_every_change_to_the_operand,
        matmul_rejects_bad_shapes,
        elementwise_and_reductions,
        softmax_cross_entropy_matches_reference,
    ]
);

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
                        c.data().iter().map(|v| v.to_bits()).collect()
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
                out.extend(y.data().iter().chain(dx.data()).map(|v| v.to_bits()));
            }
            let mut s = Tensor::default();
            be.sum_rows(&x, &mut s, false).unwrap();
            out.extend(s.data().iter().map(|v| v.to_bits()));
            let mut t = Tensor::default();
            be.transpose(&x, &mut t).unwrap();
            out.extend(t.data().iter().map(|v| v.to_bits()));
            out
        })
        .collect();
    for r in &results[1..] {
        assert!(r == &results[0]);
    }
}

#[test]
fn cuda_without_feature_is_a_clear_error() {
    let e = pipe_kernels::CudaBackend::new(0).unwrap_err();
    assert_eq!(e, KernelError::NotCompiledWithCuda);
    assert!(e.to_string().contains("built without CUDA"));
}
