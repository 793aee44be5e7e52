//! Plain TCP against hostile peers: a connection from another program or run is closed and the
//! mesh still forms; a peer that joins properly and then sends a truncated frame, an oversized
//! header, a frame of another run or a frame keyed as someone else ends its link with an error
//! naming it, never a hang or a panic.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use pipe_kernels::Tensor;
use pipe_transport::frame::{self, WireDType};
use pipe_transport::tcp::{TcpBound, TcpOptions};
use pipe_transport::{Key, Kind, Message, Transport};

const RUN: u64 = 0x7c9;

fn options() -> TcpOptions {
    let mut opts = TcpOptions::new(RUN);
    opts.timeout = Some(Duration::from_secs(5));
    opts.connect_timeout = Duration::from_secs(20);
    opts.linger = Duration::from_millis(200);
    opts
}

/// A hello as a worker writes it: magic, run, from, to.
fn hello(run: u64, from: u32, to: u32) -> Vec<u8> {
    let mut out = b"PTCP".to_vec();
    out.extend(run.to_le_bytes());
    out.extend(from.to_le_bytes());
    out.extend(to.to_le_bytes());
    out
}

fn key(from: u32, to: u32) -> Key {
    Key::data(from, to, Kind::Activation, 0)
}

/// The tag before a message on the stream.
const TAG_MESSAGE: u8 = 0;

/// An activation from worker `from` to worker 0 of run `run`, encoded as a frame.
fn frame_of(run: u64, from: u32) -> Vec<u8> {
    let message = Message {
        key: key(from, 0),
        version: 0,
        tensor: Tensor::from_vec(&[2, 3], vec![1.0; 6]).unwrap(),
    };
    frame::encode(&message, run, WireDType::F32).unwrap()
}

/// `frame` as the stream carries it, after its tag.
fn tagged(frame: &[u8]) -> Vec<u8> {
    [&[TAG_MESSAGE], frame].concat()
}

/// Worker 0 of two, listening; returns it with its address.
fn listening() -> (TcpBound, SocketAddr) {
    let bound = TcpBound::bind(0, 2, SocketAddr::from(([127, 0, 0, 1], 0)), options()).unwrap();
    let addr = bound.local_addr().unwrap();
    (bound, addr)
}

/// Worker 1 played by hand: connects to worker 0 at `addr`, greets it, reads its answer.
fn impostor(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&hello(RUN, 1, 0)).unwrap();
    let mut answer = [0u8; 20];
    s.read_exact(&mut answer).unwrap();
    assert_eq!(answer.to_vec(), hello(RUN, 0, 1));
    s
}

/// What worker 0 gets for its first receive from worker 1 when worker 1 sends `bytes` and
/// closes its end: the error's text, within the stall bound.
fn received_after(bytes: Vec<u8>) -> String {
    let (bound, addr) = listening();
    let peer = std::thread::spawn(move || {
        let mut s = impostor(addr);
        s.write_all(&bytes).unwrap();
        s.flush().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        drop(s);
    });
    let mut ep = bound.connect(&[addr, addr]).unwrap();
    let start = Instant::now();
    let got = ep.recv(&key(1, 0));
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "it waited too long"
    );
    peer.join().unwrap();
    let _ = ep.close();
    got.expect_err("a hostile frame was delivered").to_string()
}

#[test]
fn a_connection_from_another_program_or_run_is_closed_and_the_mesh_still_forms() {
    let (bound, addr) = listening();
    // Strangers first, one of them silent after a partial hello: each is closed unanswered,
    // and none holds up the real peer behind it.
    let strangers: Vec<_> = [
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        hello(RUN + 1, 1, 0),
        hello(RUN, 5, 0),
        hello(RUN, 1, 3),
    ]
    .into_iter()
    .map(|bytes| {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&bytes).unwrap();
        std::thread::spawn(move || {
            let mut answer = Vec::new();
            let _ = s.read_to_end(&mut answer);
            assert!(answer.is_empty(), "a stranger was answered: {answer:?}");
        })
    })
    .collect();
    let start = Instant::now();
    let peer = std::thread::spawn(move || {
        let mut s = impostor(addr);
        s.write_all(&tagged(&frame_of(RUN, 1))).unwrap();
        s.flush().unwrap();
        s
    });
    let mut ep = bound.connect(&[addr, addr]).unwrap();
    let m = ep.recv(&key(1, 0)).unwrap();
    assert_eq!(m.tensor.host().unwrap(), &[1.0; 6]);
    // The silent stranger's hello would have held the mesh for its whole timeout (10 s).
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "a silent stranger held up the mesh"
    );
    drop(peer.join().unwrap());
    let _ = ep.close();
    for s in strangers {
        s.join().unwrap();
    }
}

#[test]
fn hostile_frames_from_a_joined_peer_end_its_link_with_an_error() {
    let good = frame_of(RUN, 1);
    let mut oversized = good.clone();
    oversized[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut garbage = good.clone();
    for b in &mut garbage[8..20] {
        *b = 0xff;
    }
    let rows: Vec<(Vec<u8>, &str)> = vec![
        (tagged(&good[..good.len() - 3]), "lost worker 1"),
        (tagged(&good[..6]), "lost worker 1"),
        (tagged(&oversized), "header"),
        (tagged(&garbage), "protocol version"),
        (tagged(&frame_of(RUN + 1, 1)), "run"),
        (tagged(&frame_of(RUN, 0)), "worker 1 sent"),
        (tagged(b"HTTP/1.1 200 OK\r\n\r\n"), "not a pipe frame"),
        (b"HTTP/1.1 200 OK\r\n\r\n".to_vec(), "is no message"),
    ];
    for (bytes, needle) in rows {
        let shown = format!("{:?}", &bytes[..bytes.len().min(12)]);
        let err = received_after(bytes);
        assert!(err.contains(needle), "{shown}: {err}");
        assert!(err.contains("worker 1"), "{shown}: {err}");
    }
}

/// What waits for worker 0's receives is bounded per peer, as over QUIC: a joined peer that
/// sends messages nobody asks for ends its link past the bound, naming it, where they were
/// held without end.
#[test]
fn bytes_held_for_receives_are_bounded_per_peer() {
    let mut opts = options();
    opts.max_held_bytes = 64; // Two of the 24-byte messages, not three.
    let bound = TcpBound::bind(0, 2, SocketAddr::from(([127, 0, 0, 1], 0)), opts).unwrap();
    let addr = bound.local_addr().unwrap();
    let peer = std::thread::spawn(move || {
        let mut s = impostor(addr);
        for index in 0..3 {
            let message = Message {
                key: Key::data(1, 0, Kind::Activation, index),
                version: 0,
                tensor: Tensor::from_vec(&[2, 3], vec![1.0; 6]).unwrap(),
            };
            let frame = frame::encode(&message, RUN, WireDType::F32).unwrap();
            s.write_all(&tagged(&frame)).unwrap();
        }
        s.flush().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        drop(s);
    });
    let mut ep = bound.connect(&[addr, addr]).unwrap();
    let never_sent = Key::data(1, 0, Kind::Activation, 999);
    let err = ep.recv(&never_sent).expect_err("held without bound");
    peer.join().unwrap();
    let _ = ep.close();
    let err = err.to_string();
    assert!(
        err.contains("past the bound of 64") && err.contains("worker 1"),
        "{err}"
    );
}

/// A send to a peer that joined and then stopped reading fails after the stall bound, where
/// it blocked on the full socket for ever.
#[test]
fn a_send_to_a_peer_that_stopped_reading_fails_within_the_stall_bound() {
    let mut opts = options();
    opts.timeout = Some(Duration::from_secs(1));
    let bound = TcpBound::bind(0, 2, SocketAddr::from(([127, 0, 0, 1], 0)), opts).unwrap();
    let addr = bound.local_addr().unwrap();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let peer = std::thread::spawn(move || {
        let s = impostor(addr);
        // Joined, and reads nothing more until the test is over.
        let _ = done_rx.recv_timeout(Duration::from_secs(60));
        drop(s);
    });
    let mut ep = bound.connect(&[addr, addr]).unwrap();
    let start = Instant::now();
    let big = Message {
        key: Key::data(0, 1, Kind::Activation, 0),
        version: 0,
        tensor: Tensor::zeros(&[64 << 20]),
    };
    let err = ep.send(big).expect_err("a send into a socket nobody reads");
    let took = start.elapsed();
    done_tx.send(()).unwrap();
    peer.join().unwrap();
    let _ = ep.close();
    assert!(took < Duration::from_secs(30), "it took {took:?}");
    assert!(err.to_string().contains("worker 1"), "{err}");
}
