//! What only the QUIC transport has: peers are authenticated by the cluster CA and bound to one
//! run. (The behaviour every transport shares is in `suite.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use pipe_transport::quic::{Bound, Cluster, QuicOptions, server_name};
use pipe_transport::{Key, Kind, Transport, TransportError};

fn opts(run_id: u64) -> QuicOptions {
    let mut o = QuicOptions::new(run_id);
    o.connect_timeout = Duration::from_secs(2);
    o
}

/// The key of message `index` of `kind` from rank 0 to rank 1, at stage 0 of step 0.
fn from_0_to_1(kind: Kind, index: u32) -> Key {
    Key {
        from: 0,
        to: 1,
        kind,
        stage: 0,
        index,
        step: 0,
    }
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// Binds the two given endpoints and connects them; returns both results.
fn pair(a: Bound, b: Bound) -> (Result<(), TransportError>, Result<(), TransportError>) {
    let addrs = vec![a.local_addr().unwrap(), b.local_addr().unwrap()];
    let other = addrs.clone();
    let h = thread::spawn(move || b.connect(&other).map(drop));
    let ra = a.connect(&addrs).map(drop);
    (ra, h.join().unwrap())
}

#[test]
fn a_worker_with_another_clusters_certificate_is_refused() {
    let ours = Cluster::generate(2).unwrap();
    let theirs = Cluster::generate(2).unwrap();
    // Rank 0 holds a certificate from another CA.
    let intruder = Bound::bind(0, loopback(), &theirs.ranks[0].2, opts(7)).unwrap();
    let worker = Bound::bind(1, loopback(), &ours.ranks[1].2, opts(7)).unwrap();
    let (ri, rw) = pair(intruder, worker);
    let ei = ri.unwrap_err().to_string();
    assert!(ei.contains("could not connect to rank 1"), "{ei}");
    let ew = rw.unwrap_err().to_string();
    assert!(ew.contains("ranks [0] did not connect"), "{ew}");
}

#[test]
fn a_client_without_a_certificate_is_refused() {
    let cluster = Cluster::generate(2).unwrap();
    // Rank 1 waits for rank 0 to dial it; instead, a client that trusts the cluster CA but
    // shows no certificate of its own tries.
    let worker = Bound::bind(1, loopback(), &cluster.ranks[1].2, opts(7)).unwrap();
    let addr = worker.local_addr().unwrap();
    let h = thread::spawn(move || worker.connect(&[loopback(), addr]).map(drop));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cluster.ranks[1].2.ca.clone()).unwrap();
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"pipe/3".to_vec()];
    let client = quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap(),
    ));
    let outcome = rt.block_on(async {
        let mut ep = quinn::Endpoint::client(loopback()).unwrap();
        ep.set_default_client_config(client);
        let conn = ep.connect(addr, &server_name(1)).unwrap().await;
        match conn {
            // TLS 1.3 lets the client finish its side first; the server's refusal then
            // closes the connection before any stream can be used.
            Ok(c) => match tokio::time::timeout(Duration::from_secs(1), c.accept_uni()).await {
                Ok(Err(e)) => Err(e.to_string()),
                Ok(Ok(_)) => Ok("served a stream"),
                Err(_) => Ok("left waiting"),
            },
            Err(e) => Err(e.to_string()),
        }
    });
    let why = outcome.expect_err("a client without a certificate was not refused");
    assert!(why.to_lowercase().contains("certificate"), "{why}");
    // The worker itself never saw its rank 0.
    let e = h.join().unwrap().unwrap_err().to_string();
    assert!(e.contains("ranks [0] did not connect"), "{e}");
}

#[test]
fn a_peer_of_another_run_is_refused() {
    let cluster = Cluster::generate(2).unwrap();
    let a = Bound::bind(0, loopback(), &cluster.ranks[0].2, opts(7)).unwrap();
    let b = Bound::bind(1, loopback(), &cluster.ranks[1].2, opts(8)).unwrap();
    let (ra, rb) = pair(a, b);
    let ea = ra.unwrap_err().to_string();
    assert!(
        ea.contains("run 0x8, this run is 0x7") || ea.contains("run 0x7, this run is 0x8"),
        "{ea}"
    );
    assert!(rb.is_err());
}

#[test]
fn a_late_worker_is_waited_for() {
    let cluster = Cluster::generate(2).unwrap();
    let a = Bound::bind(0, loopback(), &cluster.ranks[0].2, opts(7)).unwrap();
    let b = Bound::bind(1, loopback(), &cluster.ranks[1].2, opts(7)).unwrap();
    let addrs = vec![a.local_addr().unwrap(), b.local_addr().unwrap()];
    let other = addrs.clone();
    let h = thread::spawn(move || {
        thread::sleep(Duration::from_millis(700));
        b.connect(&other).map(drop)
    });
    a.connect(&addrs).unwrap();
    h.join().unwrap().unwrap();
}

#[test]
fn a_bf16_wire_rounds_activations_and_gradients_and_keeps_chunks_exact() {
    use pipe_kernels::Tensor;
    use pipe_transport::frame::{WireDType, round_to_wire};
    use pipe_transport::{Message, Transport};
    let mut o = opts(9);
    o.wire = WireDType::Bf16;
    let mut eps = pipe_transport::quic::local_mesh(2, &o).unwrap();
    let mut b = eps.pop().unwrap();
    let mut a = eps.pop().unwrap();
    let values: Vec<f32> = (0..300).map(|i| 1.0 + i as f32 * 1e-3).collect();
    let key = from_0_to_1;
    for (i, kind) in [Kind::Activation, Kind::Chunk, Kind::Gradient]
        .into_iter()
        .enumerate()
    {
        a.send(Message {
            key: key(kind, i as u32),
            version: 1,
            tensor: Tensor::from_vec(&[3, 100], values.clone()).unwrap(),
        })
        .unwrap();
    }
    let mut rounded = values.clone();
    round_to_wire(&mut rounded, WireDType::Bf16);
    assert_ne!(rounded, values);
    for (i, kind) in [Kind::Activation, Kind::Chunk, Kind::Gradient]
        .into_iter()
        .enumerate()
    {
        let m = b.recv(&key(kind, i as u32)).unwrap();
        let want = if kind == Kind::Chunk {
            &values
        } else {
            &rounded
        };
        assert_eq!(m.tensor.host().unwrap(), &want[..], "{kind:?}");
    }
}

/// A peer with a valid certificate that breaks the protocol on its data stream: what the
/// honest worker (rank 1) reports, and how long it takes.
fn hostile_peer(data: Vec<u8>, keep_open: Duration) -> (TransportError, Duration) {
    use pipe_transport::Transport;
    let cluster = Cluster::generate(2).unwrap();
    let mut o = opts(7);
    o.frame_grace = Duration::from_millis(500);
    let worker = Bound::bind(1, loopback(), &cluster.ranks[1].2, o).unwrap();
    let addr = worker.local_addr().unwrap();
    let h = thread::spawn(move || {
        let mut ep = worker.connect(&[loopback(), addr]).unwrap();
        let t = std::time::Instant::now();
        let e = ep.recv(&from_0_to_1(Kind::Activation, 0)).unwrap_err();
        (e, t.elapsed())
    });
    // Rank 0, played by hand: a valid certificate and hello, then `data` on an activation stream.
    let creds = &cluster.ranks[0].2;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(creds.ca.clone()).unwrap();
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(creds.chain.clone(), creds.key.clone_key())
        .unwrap();
    tls.alpn_protocols = vec![b"pipe/3".to_vec()];
    let client = quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap(),
    ));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut ep = quinn::Endpoint::client(loopback()).unwrap();
        ep.set_default_client_config(client);
        let conn = ep.connect(addr, &server_name(1)).unwrap().await.unwrap();
        let mut control = conn.open_uni().await.unwrap();
        let mut hello = vec![b'C'];
        hello.extend_from_slice(b"PIPH");
        hello.extend_from_slice(&7u64.to_le_bytes());
        hello.extend_from_slice(&0u32.to_le_bytes());
        // A host identity no host has (zeros): rank 0 is on another host.
        hello.extend_from_slice(&[0u8; pipe_transport::host::HostId::BYTES]);
        control.write_all(&hello).await.unwrap();
        let mut stream = conn.open_uni().await.unwrap();
        stream.write_all(&[0]).await.unwrap();
        stream.write_all(&data).await.unwrap();
        tokio::time::sleep(keep_open).await;
    });
    h.join().unwrap()
}

#[test]
fn a_peer_sending_garbage_is_refused_by_name() {
    let (e, _) = hostile_peer(b"GARBAGE!garbage garbage".to_vec(), Duration::from_secs(1));
    let msg = e.to_string();
    assert!(matches!(e, TransportError::Protocol(_)), "{msg}");
    assert!(
        msg.contains("worker 0") && msg.contains("not a pipe frame"),
        "{msg}"
    );
}

#[test]
fn a_peer_that_stops_mid_payload_is_an_error_not_a_hang() {
    use pipe_kernels::Tensor;
    use pipe_transport::Message;
    use pipe_transport::frame::{self, WireDType};
    let m = Message {
        key: from_0_to_1(Kind::Activation, 0),
        version: 0,
        tensor: Tensor::from_vec(&[1000], vec![1.0; 1000]).unwrap(),
    };
    let mut bytes = frame::encode(&m, 7, WireDType::F32).unwrap();
    bytes.truncate(bytes.len() - 3000);
    // The peer keeps its connection open (keep-alives flow) but never finishes the frame.
    let (e, waited) = hostile_peer(bytes, Duration::from_secs(3));
    let msg = e.to_string();
    assert!(msg.contains("did not finish a 4000-byte payload"), "{msg}");
    assert!(waited < Duration::from_secs(3), "{waited:?}");
}

/// The linger bounds a close's wait in which nothing moves, not the transfer: a 256 MiB message
/// still on its way when the sender closes arrives whole, with a linger far shorter than its
/// transfer takes. (With the linger counted from the close, the receiver saw the connection
/// close under it: `Closed { peer: 0 }`.)
#[test]
fn a_close_waits_while_a_large_message_is_still_moving() {
    let mut o = opts(0x11e6);
    o.linger = Duration::from_millis(100);
    let mut eps = pipe_transport::quic::local_mesh(2, &o).unwrap();
    let mut b = eps.pop().unwrap();
    let mut a = eps.pop().unwrap();
    let n = 64 << 20;
    let values: Vec<f32> = (0..n).map(|i| (i % 977) as f32).collect();
    let tensor = pipe_kernels::Tensor::from_vec(&[n], values).unwrap();
    let key = from_0_to_1(Kind::Chunk, 1);
    let sender = thread::spawn(move || {
        a.send(pipe_transport::Message {
            key,
            version: 1,
            tensor,
        })
        .unwrap();
        a.close()
    });
    let got = b.recv(&key).unwrap();
    sender.join().unwrap().unwrap();
    let host = got.tensor.host().unwrap();
    assert_eq!(host.len(), n);
    assert!(host.iter().enumerate().all(|(i, &v)| v == (i % 977) as f32));
}
