//! GEMM throughput per training shape, at 1 and 2 threads.
//!
//! Each benchmark's throughput is reported in elements where one element is one floating-point
//! operation (2 m n k per product), so criterion's `Gelem/s` reads as GFLOP/s.
//! `experiments/gemm-vs-numpy/run.sh` runs this beside numpy and prints the ratio table.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use pipe_kernels::{Backend, CpuBackend, Tensor, Trans};
use std::time::Duration;

/// (name, m, k, n, transpose a, transpose b) with op(a) m x k and op(b) k x n.
fn shapes() -> Vec<(String, usize, usize, usize, Trans, Trans)> {
    let mut v = Vec::new();
    for batch in [64usize, 256] {
        for width in [256usize, 1024, 4096] {
            v.push((
                format!("fwd_b{batch}_w{width}"),
                batch,
                width,
                width,
                Trans::No,
                Trans::No,
            ));
            v.push((
                format!("dx_b{batch}_w{width}"),
                batch,
                width,
                width,
                Trans::No,
                Trans::Yes,
            ));
            v.push((
                format!("dw_b{batch}_w{width}"),
                width,
                batch,
                width,
                Trans::Yes,
                Trans::No,
            ));
        }
    }
    for s in [256usize, 512, 1024, 2048] {
        v.push((format!("square_{s}"), s, s, s, Trans::No, Trans::No));
    }
    v
}

fn operand(rows: usize, cols: usize, seed: u32) -> Tensor {
    let data = (0..rows * cols)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 9) as f32 / 8_388_608.0
                - 0.5
        })
        .collect();
    Tensor::from_vec(&[rows, cols], data).expect("shape matches")
}

fn bench(c: &mut Criterion) {
    let filter = std::env::var("PIPE_GEMM_THREADS").ok();
    for threads in [1usize, 2] {
        if filter.as_deref().is_some_and(|f| f != threads.to_string()) {
            continue;
        }
        let be = CpuBackend::new(threads).expect("thread pool");
        let mut group = c.benchmark_group(format!("gemm_t{threads}"));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        for (name, m, k, n, ta, tb) in shapes() {
            let a = match ta {
                Trans::No => operand(m, k, 1),
                Trans::Yes => operand(k, m, 1),
            };
            let b = match tb {
                Trans::No => operand(k, n, 2),
                Trans::Yes => operand(n, k, 2),
            };
            let mut out = Tensor::zeros(&[m, n]);
            group.throughput(Throughput::Elements((2 * m * n * k) as u64));
            group.bench_function(BenchmarkId::from_parameter(&name), |bch| {
                bch.iter(|| be.matmul(&a, ta, &b, tb, &mut out, false).expect("matmul"))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
