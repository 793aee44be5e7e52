//! The transport test suite, written against the `Transport` trait: every implementation runs
//! the same cases through `transport_suite!`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::thread;
use std::time::{Duration, Instant};

use pipe_kernels::Tensor;
use pipe_transport::collective::{ring_all_reduce, ring_all_reduce_segments, ring_sum};
use pipe_transport::inproc::{InProcOptions, mesh};
use pipe_transport::{Key, Kind, Message, Transport, TransportError};

#[path = "../../tests/common/scratch.rs"]
mod scratch;

fn key(from: u32, to: u32, kind: Kind, index: u32) -> Key {
    Key::data(from, to, kind, index)
}

fn msg(k: Key, values: &[f32]) -> Message {
    Message {
        key: k,
        version: 7,
        tensor: Tensor::from_vec(&[values.len()], values.to_vec()).unwrap(),
    }
}

/// The cases. `make(workers, timeout)` builds one endpoint per worker.
macro_rules! transport_suite {
    ($name:ident, notices: $notices:expr, $make:expr) => {
        mod $name {
            use super::*;

            fn make(n: u32, timeout: Option<Duration>) -> Vec<impl Transport + 'static> {
                ($make)(n, timeout)
            }

            #[test]
            fn delivers_by_key_in_any_order() {
                let mut eps = make(2, None);
                let mut b = eps.pop().unwrap();
                let mut a = eps.pop().unwrap();
                // Four messages: what the queue holds before a sender blocks.
                for i in 0..3 {
                    a.send(msg(key(0, 1, Kind::Activation, i), &[i as f32; 3]))
                        .unwrap();
                }
                a.send(msg(key(0, 1, Kind::Gradient, 9), &[9.0])).unwrap();
                let g = b.recv(&key(0, 1, Kind::Gradient, 9)).unwrap();
                assert_eq!(g.tensor.host().unwrap(), &[9.0]);
                assert_eq!(g.version, 7);
                for i in (0..3).rev() {
                    let m = b.recv(&key(0, 1, Kind::Activation, i)).unwrap();
                    assert_eq!(m.tensor.host().unwrap(), &[i as f32; 3]);
                }
            }

            #[test]
            fn moves_between_threads_both_ways() {
                let mut eps = make(2, None);
                let mut b = eps.pop().unwrap();
                let mut a = eps.pop().unwrap();
                let h = thread::spawn(move || {
                    for i in 0..200 {
                        let m = b.recv(&key(0, 1, Kind::Activation, i)).unwrap();
                        b.send(msg(
                            key(1, 0, Kind::Gradient, i),
                            &[m.tensor.host().unwrap()[0] * 2.0],
                        ))
                        .unwrap();
                    }
                });
                for i in 0..200 {
                    a.send(msg(key(0, 1, Kind::Activation, i), &[i as f32]))
                        .unwrap();
                    let g = a.recv(&key(1, 0, Kind::Gradient, i)).unwrap();
                    assert_eq!(g.tensor.host().unwrap(), &[2.0 * i as f32]);
                }
                h.join().unwrap();
            }

            #[test]
            fn moves_a_256_mib_tensor_intact() {
                let mut eps = make(2, None);
                let mut b = eps.pop().unwrap();
                let mut a = eps.pop().unwrap();
                let n = 64 << 20;
                let values: Vec<f32> = (0..n).map(|i| (i % 1021) as f32 - 510.5).collect();
                let t = Tensor::from_vec(&[n / 1024, 1024], values).unwrap();
                let h = thread::spawn(move || {
                    a.send(Message {
                        key: key(0, 1, Kind::Chunk, 1),
                        version: 3,
                        tensor: t,
                    })
                    .unwrap();
                    a.close().unwrap();
                });
                let m = b.recv(&key(0, 1, Kind::Chunk, 1)).unwrap();
                h.join().unwrap();
                assert_eq!(m.tensor.shape(), &[n / 1024, 1024]);
                let got = m.tensor.host().unwrap();
                assert!(
                    got.iter()
                        .enumerate()
                        .all(|(i, &v)| v == (i % 1021) as f32 - 510.5)
                );
            }

            #[test]
            fn thousands_of_small_messages_arrive_in_order_per_kind() {
                let mut eps = make(2, None);
                let mut b = eps.pop().unwrap();
                let mut a = eps.pop().unwrap();
                let count = 5000u32;
                let h = thread::spawn(move || {
                    for i in 0..count {
                        let kind = if i % 2 == 0 {
                            Kind::Activation
                        } else {
                            Kind::Gradient
                        };
                        a.send(msg(key(0, 1, kind, i), &[i as f32])).unwrap();
                    }
                    a.close().unwrap();
                });
                // Received in send order, all of one kind first: the other kind waits buffered.
                for kind in [Kind::Gradient, Kind::Activation] {
                    let first = u32::from(kind == Kind::Gradient);
                    for i in (first..count).step_by(2) {
                        let m = b.recv(&key(0, 1, kind, i)).unwrap();
                        assert_eq!(m.tensor.host().unwrap(), &[i as f32]);
                    }
                }
                h.join().unwrap();
            }

            #[test]
            fn many_peers_exchange_at_once() {
                let n = 8u32;
                let eps = make(n, None);
                let handles: Vec<_> = eps
                    .into_iter()
                    .map(|mut ep| {
                        thread::spawn(move || {
                            let me = ep.rank();
                            for round in 0..20 {
                                for to in (0..n).filter(|&p| p != me) {
                                    let v = (me * 1000 + to * 10 + round) as f32;
                                    ep.send(msg(key(me, to, Kind::Activation, round), &[v; 16]))
                                        .unwrap();
                                }
                                for from in (0..n).filter(|&p| p != me) {
                                    let m =
                                        ep.recv(&key(from, me, Kind::Activation, round)).unwrap();
                                    let v = (from * 1000 + me * 10 + round) as f32;
                                    assert_eq!(m.tensor.host().unwrap(), &[v; 16]);
                                }
                            }
                            ep.close().unwrap();
                        })
                    })
                    .collect();
                for h in handles {
                    h.join().unwrap();
                }
            }

            #[test]
            fn a_stream_of_tensors_larger_than_a_ring_keeps_flowing() {
                // Each tensor fills more than a small ring: the sender waits for space after
                // every one, and the receiver must wake it whichever read frees the space.
                let mut eps = make(2, None);
                let mut b = eps.pop().unwrap();
                let mut a = eps.pop().unwrap();
                let h = thread::spawn(move || {
                    for i in 0..64u32 {
                        a.send(msg(key(0, 1, Kind::Activation, i), &[i as f32; 1100]))
                            .unwrap();
                    }
                    a
                });
                for i in 0..64u32 {
                    let m = b.recv(&key(0, 1, Kind::Activation, i)).unwrap();
                    assert_eq!(m.tensor.host().unwrap()[1099], i as f32);
                }
                drop(h.join().unwrap());
            }

            #[test]
            fn a_peer_that_closes_mid_stream_loses_nothing_it_sent() {
                let mut eps = make(2, None);
                let mut b = eps.pop().unwrap();
                let mut a = eps.pop().unwrap();
                let h = thread::spawn(move || {
                    for i in 0..100 {
                        a.send(msg(key(0, 1, Kind::Activation, i), &[i as f32; 1000]))
                            .unwrap();
                    }
                    // Worker 0 goes away without closing, its messages possibly in flight.
                    drop(a);
                });
                for i in 0..100 {
                    let m = b.recv(&key(0, 1, Kind::Activation, i)).unwrap();
                    assert_eq!(m.tensor.host().unwrap()[999], i as f32);
                }
                h.join().unwrap();
                let e = b.recv(&key(0, 1, Kind::Activation, 100)).unwrap_err();
                assert!(matches!(e, TransportError::Closed { peer: 0 }), "{e}");
            }

            #[test]
            fn a_wait_ends_when_a_noticed_message_arrives_first() {
                let mut eps = make(3, None);
                let mut c = eps.pop().unwrap();
                let mut b = eps.pop().unwrap();
                let mut a = eps.pop().unwrap();
                // Worker 0 waits for worker 1's large message; worker 2's two small ones,
                // which it notices, come first, the second once the first is held.
                let wanted = key(1, 0, Kind::Activation, 3);
                let values: Vec<f32> = (0..20_000).map(|i| i as f32).collect();
                let noticed = |i| key(2, 0, Kind::Gradient, i);
                let notice = |k: &Key| k.from == 2;
                let (go_on, went_on) = std::sync::mpsc::channel::<()>();
                let sent = values.clone();
                let h = thread::spawn(move || {
                    thread::sleep(Duration::from_millis(30));
                    // A transport that notices nothing waits on: the sender goes on anyway.
                    let wake = Duration::from_millis(300);
                    c.send(msg(noticed(0), &[1.0])).unwrap();
                    let _ = went_on.recv_timeout(wake);
                    thread::sleep(Duration::from_millis(30));
                    c.send(msg(noticed(1), &[2.0])).unwrap();
                    let _ = went_on.recv_timeout(wake);
                    thread::sleep(Duration::from_millis(30));
                    b.send(msg(wanted, &sent)).unwrap();
                    (b, c)
                });
                let mut woken = Vec::new();
                loop {
                    let ready = a.wait_for(&wanted, &notice).unwrap();
                    if ready {
                        break;
                    }
                    // A message held from before the call does not end the next wait.
                    woken.push(());
                    let _ = go_on.send(());
                }
                if $notices {
                    assert_eq!(woken.len(), 2, "each noticed message ends one wait, once");
                } else {
                    assert!(woken.is_empty());
                }
                // Whatever ended the waits, every message is still there to be received.
                assert_eq!(a.recv(&wanted).unwrap().tensor.host().unwrap(), &values[..]);
                for (i, v) in [1.0, 2.0].into_iter().enumerate() {
                    let m = a.recv(&noticed(i as u32)).unwrap();
                    assert_eq!(m.tensor.host().unwrap(), &[v]);
                }
                drop(h.join().unwrap());
            }

            #[test]
            fn abort_stops_a_blocked_receive() {
                let mut eps = make(3, None);
                let mut c = eps.pop().unwrap();
                let mut b = eps.pop().unwrap();
                let mut a = eps.pop().unwrap();
                // Worker 2 waits on worker 0; worker 1 fails and says so.
                let h = thread::spawn(move || {
                    thread::sleep(Duration::from_millis(30));
                    b.abort();
                    b
                });
                let t = Instant::now();
                let e = c.recv(&key(0, 2, Kind::Activation, 0)).unwrap_err();
                assert!(matches!(e, TransportError::Aborted { by: 1 }), "{e}");
                assert!(t.elapsed() < Duration::from_secs(2));
                // Later calls keep failing, on every peer, naming the failed worker.
                let e = c
                    .send(msg(key(2, 0, Kind::Gradient, 0), &[1.0]))
                    .unwrap_err();
                assert!(matches!(e, TransportError::Aborted { by: 1 }), "{e}");
                let e = a.recv(&key(2, 0, Kind::Gradient, 0)).unwrap_err();
                assert!(matches!(e, TransportError::Aborted { by: 1 }), "{e}");
                let mut b = h.join().unwrap();
                let e = b.recv(&key(0, 1, Kind::Activation, 0)).unwrap_err();
                assert!(matches!(e, TransportError::Aborted { by: 1 }), "{e}");
            }

            #[test]
            fn abort_stops_a_blocked_send() {
                let mut eps = make(2, None);
                let mut b = eps.pop().unwrap();
                let mut a = eps.pop().unwrap();
                // Fill the channel from 0 to 1 until a send would block, then abort from 1.
                let h = thread::spawn(move || {
                    thread::sleep(Duration::from_millis(30));
                    b.abort();
                    b
                });
                let t = Instant::now();
                let mut i = 0;
                let e = loop {
                    match a.send(msg(key(0, 1, Kind::Activation, i), &[1.0])) {
                        Ok(()) => i += 1,
                        Err(e) => break e,
                    }
                };
                assert!(matches!(e, TransportError::Aborted { by: 1 }), "{e}");
                assert!(t.elapsed() < Duration::from_secs(2));
                drop(h.join().unwrap());
            }

            #[test]
            fn a_gone_peer_is_an_error_not_a_hang() {
                let mut eps = make(2, None);
                let mut b = eps.pop().unwrap();
                let a = eps.pop().unwrap();
                drop(a);
                let e = b.recv(&key(0, 1, Kind::Activation, 0)).unwrap_err();
                assert!(matches!(e, TransportError::Closed { peer: 0 }), "{e}");
                let e = b
                    .send(msg(key(1, 0, Kind::Gradient, 0), &[1.0]))
                    .unwrap_err();
                match e {
                    TransportError::Send { message, .. } => {
                        assert_eq!(message.tensor.host().unwrap(), &[1.0])
                    }
                    other => panic!("{other}"),
                }
            }

            #[test]
            fn receive_times_out_when_asked_to() {
                let mut eps = make(2, Some(Duration::from_millis(50)));
                let mut b = eps.pop().unwrap();
                let _a = eps.pop().unwrap();
                let e = b.recv(&key(0, 1, Kind::Activation, 0)).unwrap_err();
                assert!(matches!(e, TransportError::Timeout { .. }), "{e}");
            }

            #[test]
            fn bad_keys_are_protocol_errors() {
                let mut eps = make(2, None);
                let mut b = eps.pop().unwrap();
                let mut a = eps.pop().unwrap();
                assert!(matches!(
                    b.recv(&key(0, 0, Kind::Activation, 0)),
                    Err(TransportError::Protocol(_))
                ));
                assert!(matches!(
                    b.recv(&key(5, 1, Kind::Activation, 0)),
                    Err(TransportError::Protocol(_))
                ));
                assert!(matches!(
                    a.send(msg(key(0, 9, Kind::Activation, 0), &[1.0])),
                    Err(TransportError::Send { .. })
                ));
                // The same key twice before it is consumed.
                a.send(msg(key(0, 1, Kind::Activation, 3), &[1.0])).unwrap();
                a.send(msg(key(0, 1, Kind::Activation, 3), &[1.0])).unwrap();
                let e = b.recv(&key(0, 1, Kind::Activation, 4)).unwrap_err();
                assert!(matches!(e, TransportError::Protocol(_)), "{e}");
            }

            #[test]
            fn ring_all_reduce_matches_the_single_thread_ring_sum() {
                // The last length sends each chunk in two or three pieces.
                let pieces = 5 * pipe_transport::collective::RING_PIECE_VALUES + 3;
                for r in [2u32, 3, 4] {
                    for len in [1usize, 5, 64, 1000, pieces] {
                        let eps = make(r, None);
                        let parts: Vec<Vec<f32>> = (0..r)
                            .map(|w| {
                                (0..len)
                                    .map(|i| {
                                        ((i * 7 + w as usize * 13) % 17) as f32 * 0.1
                                            + 1e-3 * w as f32
                                    })
                                    .collect()
                            })
                            .collect();
                        let expect =
                            ring_sum(&parts.iter().map(|p| p.as_slice()).collect::<Vec<_>>());
                        let group: Vec<u32> = (0..r).collect();
                        let handles: Vec<_> = eps
                            .into_iter()
                            .zip(parts.clone())
                            .map(|(mut ep, mut data)| {
                                let group = group.clone();
                                thread::spawn(move || {
                                    ring_all_reduce(&mut ep, &group, 2, 5, &mut data).unwrap();
                                    data
                                })
                            })
                            .collect();
                        for h in handles {
                            let got = h.join().unwrap();
                            assert_eq!(got, expect, "r={r} len={len}");
                        }
                        let naive: Vec<f32> =
                            (0..len).map(|i| parts.iter().map(|p| p[i]).sum()).collect();
                        for (a, b) in expect.iter().zip(&naive) {
                            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0));
                        }
                    }
                }
            }

            /// A bf16 ring: f32 sums, bf16 values sent; every replica ends with the same bits,
            /// `ring_sum_as`'s, which differ from the f32 sum by rounding only.
            #[test]
            fn a_bf16_ring_gives_every_replica_the_rounded_ring_sum() {
                use pipe_transport::collective::{RingAllReduce, RingSpec, ring_sum_as};
                use pipe_transport::frame::WireDType;
                let pieces = 2 * pipe_transport::collective::RING_PIECE_VALUES + 5;
                for r in [2u32, 3, 4] {
                    for len in [3usize, 1000, pieces] {
                        let eps = make(r, None);
                        let parts: Vec<Vec<f32>> = (0..r)
                            .map(|w| {
                                (0..len)
                                    .map(|i| ((i * 7 + w as usize * 13) % 17) as f32 * 0.1 + 0.013)
                                    .collect()
                            })
                            .collect();
                        let slices: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
                        let expect = ring_sum_as(&slices, WireDType::Bf16);
                        let exact = ring_sum(&slices);
                        assert_ne!(expect, exact, "r={r} len={len}: nothing was rounded");
                        for (a, b) in expect.iter().zip(&exact) {
                            assert!((a - b).abs() <= 1.6e-2 * b.abs(), "{a} against {b}");
                        }
                        let group: Vec<u32> = (0..r).collect();
                        let handles: Vec<_> = eps
                            .into_iter()
                            .zip(parts.clone())
                            .map(|(mut ep, mut data)| {
                                let group = group.clone();
                                thread::spawn(move || {
                                    let spec = RingSpec {
                                        stage: 2,
                                        update: 5,
                                        first_step: 9,
                                        wire: WireDType::Bf16,
                                    };
                                    let mut segments = [data.as_mut_slice()];
                                    RingAllReduce::start(&mut ep, &group, spec, &mut segments)
                                        .unwrap()
                                        .finish(&mut ep, &mut segments)
                                        .unwrap();
                                    data
                                })
                            })
                            .collect();
                        for h in handles {
                            assert_eq!(h.join().unwrap(), expect, "r={r} len={len}");
                        }
                    }
                }
            }

            #[test]
            fn segmented_ring_all_reduce_is_the_ring_sum_of_the_concatenation() {
                for r in [2u32, 3] {
                    let sizes = [1usize, 7, 0, 300, 2, 64];
                    let eps = make(r, None);
                    let parts: Vec<Vec<Vec<f32>>> = (0..r)
                        .map(|w| {
                            sizes
                                .iter()
                                .enumerate()
                                .map(|(b, &n)| {
                                    (0..n)
                                        .map(|i| {
                                            ((i * 5 + b * 3 + w as usize * 11) % 13) as f32 * 0.37
                                        })
                                        .collect()
                                })
                                .collect()
                        })
                        .collect();
                    let flats: Vec<Vec<f32>> = parts.iter().map(|p| p.concat()).collect();
                    let expect = ring_sum(&flats.iter().map(Vec::as_slice).collect::<Vec<_>>());
                    let group: Vec<u32> = (0..r).collect();
                    let handles: Vec<_> = eps
                        .into_iter()
                        .zip(parts.clone())
                        .map(|(mut ep, mut data)| {
                            let group = group.clone();
                            thread::spawn(move || {
                                let mut buckets: Vec<&mut [f32]> =
                                    data.iter_mut().map(Vec::as_mut_slice).collect();
                                ring_all_reduce_segments(&mut ep, &group, 1, 3, &mut buckets)
                                    .unwrap();
                                data.concat()
                            })
                        })
                        .collect();
                    for h in handles {
                        assert_eq!(h.join().unwrap(), expect, "r={r}");
                    }
                }
            }
        }
    };
}

transport_suite!(inproc, notices: false, |n, timeout| {
    mesh(
        n,
        &InProcOptions {
            capacity: 4,
            timeout,
            ..InProcOptions::default()
        },
    )
});

transport_suite!(quic, notices: true, |n, timeout| {
    let mut opts = pipe_transport::quic::QuicOptions::new(0x701e);
    opts.timeout = timeout;
    opts.queue = 4;
    opts.linger = Duration::from_secs(2);
    pipe_transport::quic::local_mesh(n, &opts).unwrap()
});

// Shared memory between ranks of equal parity, QUIC between the others: the endpoint of a
// cluster file's workers on two hosts under `--transport auto`.
transport_suite!(mixed, notices: false, |n, timeout| {
    let mut quic_opts = pipe_transport::quic::QuicOptions::new(0x313d);
    quic_opts.timeout = timeout;
    quic_opts.queue = 4;
    quic_opts.linger = Duration::from_secs(2);
    let mut shm_opts = pipe_transport::shm::ShmOptions::new(0x313d);
    shm_opts.timeout = timeout;
    shm_opts.ring_bytes = 4096;
    mixed_mesh(n, &quic_opts, &shm_opts)
});

fn mixed_mesh(
    n: u32,
    quic_opts: &pipe_transport::quic::QuicOptions,
    shm_opts: &pipe_transport::shm::ShmOptions,
) -> Vec<pipe_transport::mixed::Mixed> {
    use pipe_transport::shm::ShmBound;
    let dir = scratch::fresh_path("mixed");
    let quic = pipe_transport::quic::local_mesh(n, quic_opts).unwrap();
    let bound: Vec<ShmBound> = (0..n)
        .map(|r| ShmBound::bind(&dir, r, n, shm_opts.clone()).unwrap())
        .collect();
    let same = |r: u32| -> Vec<u32> { (0..n).filter(|&p| p != r && p % 2 == r % 2).collect() };
    let shm: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = bound
            .into_iter()
            .enumerate()
            .map(|(r, b)| {
                let peers = same(r as u32);
                s.spawn(move || b.connect_to(&peers).unwrap())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let _ = std::fs::remove_dir_all(&dir);
    quic.into_iter()
        .zip(shm)
        .enumerate()
        .map(|(r, (q, m))| pipe_transport::mixed::Mixed::new(q, m, &same(r as u32)).unwrap())
        .collect()
}

transport_suite!(tcp, notices: false, |n, timeout| {
    let mut opts = pipe_transport::tcp::TcpOptions::new(0x7c9);
    opts.timeout = timeout;
    opts.linger = Duration::from_secs(2);
    pipe_transport::tcp::local_mesh(n, &opts).unwrap()
});

/// Every registered transport as a run reaches it ([`pipe_transport::kinds::TRANSPORTS`]): its
/// name parses back to its kind, and the mesh of threads it registers delivers by key, in any
/// order, and gives every worker the ring all-reduce's exact bits. A transport added to the
/// registry is tested here with no other change.
#[test]
fn every_registered_transport_delivers_by_key_and_sums_to_the_ring_bits() {
    use pipe_transport::TransportKind;
    use pipe_transport::kinds::{MeshSettings, TRANSPORTS};
    let n = 3u32;
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|w| {
            (0..1001)
                .map(|i| (i as f32 + 0.1) * (w as f32 + 0.7))
                .collect()
        })
        .collect();
    let expected = ring_sum(&inputs.iter().map(Vec::as_slice).collect::<Vec<_>>());
    for registration in TRANSPORTS {
        let kind: TransportKind = registration.name.parse().unwrap();
        assert_eq!(kind.name(), registration.name);
        let eps = (registration.thread_mesh)(n, &MeshSettings::new(0x9e6)).unwrap();
        let group: Vec<u32> = (0..n).collect();
        let results: Vec<Vec<f32>> = thread::scope(|s| {
            let handles: Vec<_> = eps
                .into_iter()
                .map(|mut ep| {
                    let (group, inputs) = (&group, &inputs);
                    s.spawn(move || {
                        let me = ep.rank();
                        let next = (me + 1) % n;
                        let prev = (me + n - 1) % n;
                        // Two messages to the next worker, taken in the other order.
                        for i in 0..2 {
                            ep.send(msg(key(me, next, Kind::Activation, i), &[i as f32; 3]))
                                .unwrap();
                        }
                        for i in [1, 0] {
                            let m = ep.recv(&key(prev, me, Kind::Activation, i)).unwrap();
                            assert_eq!(m.tensor.host().unwrap(), &[i as f32; 3]);
                        }
                        let mut data = inputs[me as usize].clone();
                        ring_all_reduce(&mut ep, group, 0, 0, &mut data).unwrap();
                        ep.close().unwrap();
                        data
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for data in results {
            assert!(
                data.iter()
                    .zip(&expected)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{}",
                registration.name
            );
        }
    }
}

transport_suite!(shm, notices: true, |n, timeout| {
    let mut opts = pipe_transport::shm::ShmOptions::new(0x5e9);
    opts.timeout = timeout;
    // Small rings, so that the cases also cover frames in pieces and full rings.
    opts.ring_bytes = 4096;
    pipe_transport::shm::local_mesh(n, &opts).unwrap()
});

/// The ring all-reduce over shared memory keeps what it has in flight within the rings: with
/// the default rings, 4 workers and chunks of many pieces (several rings' worth each), every
/// piece is lent from the ring where it lies, none is copied out to break a wait, and the
/// result is the ring sum.
#[test]
fn a_ring_all_reduce_over_shared_memory_copies_no_frame_out_of_a_ring() {
    use pipe_transport::collective::{ring_all_reduce, ring_sum};
    let n = 4u32;
    let len = 3_000_001;
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|w| {
            (0..len)
                .map(|i| ((i * 7 + w as usize) % 13) as f32 * 0.25)
                .collect()
        })
        .collect();
    let expected = ring_sum(&inputs.iter().map(Vec::as_slice).collect::<Vec<_>>());
    let eps =
        pipe_transport::shm::local_mesh(n, &pipe_transport::shm::ShmOptions::new(0x1e4d)).unwrap();
    let group: Vec<u32> = (0..n).collect();
    let results: Vec<(Vec<f32>, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = eps
            .into_iter()
            .map(|mut ep| {
                let (group, inputs) = (&group, &inputs);
                s.spawn(move || {
                    let mut data = Vec::new();
                    for update in 0..2 {
                        data.clone_from(&inputs[ep.rank() as usize]);
                        ring_all_reduce(&mut ep, group, 0, update, &mut data).unwrap();
                    }
                    let copied = ep.frames_copied_out();
                    ep.close().unwrap();
                    (data, copied)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (data, copied) in results {
        assert_eq!(copied, 0, "frames copied out of a ring");
        assert!(
            data.iter()
                .zip(&expected)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
    }
}
