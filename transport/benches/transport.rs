//! Moving tensors: a round trip per transport, a frame's encoding and decoding, and the ring
//! all-reduce among threads.
//!
//! `cargo bench -p pipe-transport --bench transport`. A round trip sends a 64 KiB activation
//! (a 16 x 1024 microbatch) to an echo thread and receives it back, on the in-process mesh
//! (buffers move, nothing is copied) and on QUIC over loopback (mutual TLS, f32 frames). The
//! frame cases encode and decode a 1 MiB tensor as the QUIC transport does for every message.
//! The all-reduce cases sum 4 MiB of gradients (1 Mi floats) among 2 and 4 in-process workers,
//! each on its own thread, as replicas of a stage do at every update. Throughput is in bytes
//! of the tensor (each way for a round trip).
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use pipe_kernels::Tensor;
use pipe_transport::collective::ring_all_reduce;
use pipe_transport::frame::{FrameLimits, WireDType, decode, encode};
use pipe_transport::inproc::{InProcOptions, mesh};
use pipe_transport::quic::{QuicOptions, local_mesh};
use pipe_transport::{Key, Kind, Message, Transport};

const STOP: u64 = u64::MAX;

fn key(from: u32, to: u32, index: u32) -> Key {
    Key::data(from, to, Kind::Activation, index)
}

/// Round trips of `values` floats between rank 0 (this thread) and an echo thread at rank 1.
fn round_trips<T: Transport + Send + 'static>(c: &mut Criterion, name: &str, mut eps: Vec<T>) {
    let values = 16 * 1024;
    let mut echo_ep = eps.pop().unwrap();
    let mut ep = eps.pop().unwrap();
    let echo = std::thread::spawn(move || {
        let mut i = 0u32;
        loop {
            let m = echo_ep.recv(&key(0, 1, i)).unwrap();
            if m.version == STOP {
                break;
            }
            echo_ep
                .send(Message {
                    key: key(1, 0, i),
                    version: 0,
                    tensor: m.tensor,
                })
                .unwrap();
            i = i.wrapping_add(1);
        }
        echo_ep.close().unwrap();
    });
    let mut g = c.benchmark_group("round_trip_64KiB");
    g.throughput(Throughput::Bytes(2 * 4 * values as u64));
    let mut i = 0u32;
    let mut tensor = Some(Tensor::zeros(&[values]));
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                ep.send(Message {
                    key: key(0, 1, i),
                    version: 0,
                    tensor: tensor.take().unwrap(),
                })
                .unwrap();
                tensor = Some(ep.recv(&key(1, 0, i)).unwrap().tensor);
                i = i.wrapping_add(1);
            }
            t.elapsed()
        });
    });
    g.finish();
    ep.send(Message {
        key: key(0, 1, i),
        version: STOP,
        tensor: Tensor::zeros(&[1]),
    })
    .unwrap();
    echo.join().unwrap();
    ep.close().unwrap();
}

fn transports(c: &mut Criterion) {
    round_trips(c, "inproc", mesh(2, &InProcOptions::default()));
    round_trips(c, "quic", local_mesh(2, &QuicOptions::new(7)).unwrap());
}

fn frames(c: &mut Criterion) {
    let values = 256 * 1024;
    let m = Message {
        key: key(0, 1, 3),
        version: 9,
        tensor: Tensor::from_vec(&[values], (0..values).map(|i| i as f32).collect()).unwrap(),
    };
    let mut g = c.benchmark_group("frame_1MiB");
    g.throughput(Throughput::Bytes(4 * values as u64));
    for dtype in [WireDType::F32, WireDType::Bf16] {
        let bytes = encode(&m, 1, dtype).unwrap();
        let limits = FrameLimits::new(1);
        g.bench_function(format!("encode/{}", dtype.name()), |b| {
            b.iter(|| encode(std::hint::black_box(&m), 1, dtype).unwrap())
        });
        g.bench_function(format!("decode/{}", dtype.name()), |b| {
            b.iter(|| decode(std::hint::black_box(&bytes), &limits).unwrap())
        });
    }
    g.finish();
}

fn all_reduce(c: &mut Criterion) {
    let values = 1 << 20;
    let mut g = c.benchmark_group("all_reduce_4MiB");
    g.throughput(Throughput::Bytes(4 * values as u64));
    g.sample_size(20).measurement_time(Duration::from_secs(4));
    for workers in [2u32, 4] {
        g.bench_with_input(
            BenchmarkId::new("inproc_ring", workers),
            &workers,
            |b, &n| {
                b.iter_custom(|iters| {
                    let group: Vec<u32> = (0..n).collect();
                    let threads: Vec<_> = mesh(n, &InProcOptions::default())
                        .into_iter()
                        .map(|mut ep| {
                            let group = group.clone();
                            std::thread::spawn(move || {
                                let mut data = vec![1.0f32; values];
                                // One untimed round: every thread has started and allocated.
                                ring_all_reduce(&mut ep, &group, 0, 0, &mut data).unwrap();
                                let t = Instant::now();
                                for u in 1..=iters {
                                    ring_all_reduce(&mut ep, &group, 0, u as u32, &mut data)
                                        .unwrap();
                                }
                                t.elapsed()
                            })
                        })
                        .collect();
                    threads
                        .into_iter()
                        .map(|h| h.join().unwrap())
                        .max()
                        .unwrap_or_default()
                });
            },
        );
    }
    g.finish();
}

criterion_group!(benches, transports, frames, all_reduce);
criterion_main!(benches);
