//! The QUIC transport: workers in separate processes or on separate hosts, over quinn (on a
//! tokio runtime each endpoint owns) with mutual TLS. Only peers whose certificate chains to
//! the cluster CA are accepted, and only for the same run.
//!
//! **Connections and streams.** One connection per pair of workers: the lower rank dials, the
//! higher accepts. On each connection, each side opens one unidirectional *control* stream
//! first (a hello naming its rank and run, then control records) and one data stream per
//! message [`Kind`], so messages of one (sender, receiver, kind) arrive in the order sent and a
//! large all-reduce chunk never holds up an activation. Data streams carry [`crate::frame`]
//! frames; the reader checks every frame (run, sizes, sender) before it allocates.
//!
//! **Sends overlap compute.** [`Transport::send`] encodes the frame and queues it for the
//! stream's writer task; it blocks only when `queue` frames wait for that stream
//! (back-pressure). Receives are served from one channel fed by every reader task, buffered
//! by key as in-process. Readers never wait for the worker's program: they drain quinn's
//! buffers as fast as frames arrive, so QUIC's flow control does not hold a sender back, and
//! two workers that send to each other before receiving cannot deadlock. What waits is
//! bounded twice: by the schedule, which sends a stage only as many messages ahead as it has
//! in flight, and per peer by [`QuicOptions::max_held_bytes`] (8 GiB by default), past which
//! the peer's connection is closed as a protocol error naming it, instead of memory growing
//! without bound.
//!
//! **Failures name the peer.** An abort is a control record every peer's reader turns into
//! [`TransportError::Aborted`]. A connection that times out (keep-alives every half second, idle
//! limit [`QuicOptions::idle_timeout`], 2 s) or resets is [`TransportError::Closed`] naming that
//! peer. A peer that has finished its streams is gone for the keys it would have sent.
//!
//! **Nothing is lost at the end.** QUIC discards unread data when a connection closes. A
//! worker's readers tell a peer (an `F` record) as soon as they have read all of that peer's
//! data streams to their end. [`Transport::close`] finishes this worker's data streams and
//! closes each connection once the peer has confirmed (or is gone), bounded by
//! [`QuicOptions::linger`] without progress: while data still moves (a large message on its
//! way, a peer still reading) the wait goes on; it never waits for a peer's program to end. Dropping an endpoint
//! without `close` does the same on a background thread.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, never, select, unbounded};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};

use crate::Regrouped;
pub use crate::cluster::{Cluster, Credentials, server_name};
use crate::frame::{self, FrameLimits, PREFIX_BYTES, WireDType};
use crate::host::HostId;
use crate::{Early, Key, Kind, Message, Transport, TransportError};

mod regroup;

/// Application protocol name on the TLS handshake.
/// The hello changed at 2 (it carries the worker's host identity): a worker of a build with
/// another protocol is refused in the TLS handshake, before any byte of it is read.
/// At 3 a mesh can go on without a lost peer on its connections ([`Quic::regrouped`]).
const ALPN: &[u8] = b"pipe/3";
/// First bytes of a hello.
const HELLO_MAGIC: [u8; 4] = *b"PIPH";
/// Stream tags: the first byte of every unidirectional stream.
const TAG_CONTROL: u8 = b'C';
/// A control stream of a regrouped mesh (then its generation, 4 bytes LE; no hello).
const TAG_REGROUP: u8 = b'G';
/// Control records.
const RECORD_ABORT: u8 = b'A';
const RECORD_FINISHED: u8 = b'F';
/// Connection close codes.
const CLOSE_DONE: u32 = 0;
const CLOSE_ABORT: u32 = 1;
/// A close's linger starts again after every window of this length (or of the linger, if
/// shorter) in which the endpoint's connections moved more than [`CLOSE_PROGRESS_RATE`]: data
/// is still on its way.
const CLOSE_PROGRESS_WINDOW: Duration = Duration::from_millis(250);
/// Bytes per second, sent and received together, that count as data still moving. Keep-alives
/// (a ping and its ack per connection every half second, under 100 bytes) stay far below it
/// even with dozens of peers, so a peer that stopped reading is waited for one linger only.
const CLOSE_PROGRESS_RATE: u64 = 64 << 10;
const CLOSE_REFUSED: u32 = 2;
/// A worker failed while connecting; the reason says why.
const CLOSE_FAILED: u32 = 3;

/// How long one dial attempt waits for the QUIC handshake before trying again (a peer that
/// has not bound its socket yet answers nothing, and QUIC does not hear a refusal).
const DIAL_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

const KINDS: [Kind; 4] = [Kind::Activation, Kind::Gradient, Kind::Chunk, Kind::Control];

fn kind_slot(kind: Kind) -> usize {
    match kind {
        Kind::Activation => 0,
        Kind::Gradient => 1,
        Kind::Chunk => 2,
        Kind::Control => 3,
    }
}

fn setup_err(what: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Setup(format!("{what}: {e}"))
}

/// Credentials TLS refuses (a key that is not its certificate's, a CA that is not one): bad
/// input, since they come from the cluster's files.
fn cred_err(what: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::BadFile(format!(
        "{what}, from the cluster's files: {e} (a file replaced or mixed up: write the cluster \
         again with pipe cluster init)"
    ))
}

/// Settings of a QUIC endpoint.
#[derive(Clone, Debug)]
pub struct QuicOptions {
    /// The run every peer and frame must belong to.
    pub run_id: u64,
    /// Element type of activations and gradients on the wire (all-reduce chunks are f32).
    pub wire: WireDType,
    /// How long a receive of data (activations, gradients, chunks) waits before it fails with
    /// [`TransportError::Timeout`], the stall bound (None: until the message, a failure or the
    /// idle limit). Control records are waited for without bound: the chief evaluating between
    /// epochs is not a stall.
    pub timeout: Option<Duration>,
    /// How long connecting waits for peers that start late.
    pub connect_timeout: Duration,
    /// A connection with no packet for this long is lost (keep-alives go four times within
    /// it: every half second by default). Two seconds by default: a killed peer is noticed
    /// that soon, and a freeze or cut link shorter than it is ridden out.
    pub idle_timeout: Duration,
    /// How long closing waits for peers to finish reading with nothing moving: it starts again
    /// whenever data is still on its way to them (or from them).
    pub linger: Duration,
    /// Frames queued per stream before a send blocks.
    pub queue: usize,
    /// Time a frame may take once its header has arrived, on top of its payload at 1 MB/s: a
    /// peer that stops mid-frame is an error after this, not a receive that waits forever.
    pub frame_grace: Duration,
    /// Largest payload accepted from a peer.
    pub max_payload_bytes: u64,
    /// Bytes of one peer's messages that may wait for this worker's receives (in the event
    /// channel and held by key). A schedule keeps far less in flight; a peer past the bound is
    /// a protocol error that names it, and its connection is closed. A bound on memory, not a
    /// wait: readers never block on the worker's program, so two workers sending to each other
    /// cannot deadlock (see the module documentation).
    pub max_held_bytes: u64,
    /// The largest UDP payload path MTU discovery tries, bytes (default 32,000, see
    /// [`MTU_UPPER_BOUND`]). A link's MTU bounds discovery anyway; a smaller bound makes
    /// loopback carry the datagrams of an ordinary link (a 1,500-byte MTU carries 1,472 over
    /// IPv4), which is how a benchmark measures, on one machine, what QUIC's processor time per
    /// byte will be on that link.
    pub max_datagram: u16,
}

impl QuicOptions {
    /// Defaults for run `run_id`.
    pub fn new(run_id: u64) -> Self {
        QuicOptions {
            run_id,
            wire: WireDType::F32,
            timeout: None,
            connect_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(2),
            linger: Duration::from_secs(10),
            queue: 64,
            frame_grace: Duration::from_secs(10),
            max_payload_bytes: FrameLimits::DEFAULT_MAX_PAYLOAD,
            max_held_bytes: DEFAULT_MAX_HELD_BYTES,
            max_datagram: MTU_UPPER_BOUND,
        }
    }
}

/// The default [`QuicOptions::max_held_bytes`]: 8 GiB per peer.
pub const DEFAULT_MAX_HELD_BYTES: u64 = 8 << 30;

/// A frame as its writer sends it: the prefix and header, then the payload (the tensor's own
/// buffer for an f32 wire).
type Frame = [bytes::Bytes; 2];

/// What reader tasks tell the worker's thread.
#[derive(Debug)]
enum Event {
    Message(Message),
    /// The peer finished its data stream of this kind: it sends nothing more of it.
    StreamEnd {
        peer: u32,
        kind: Kind,
    },
    /// The peer has read all of this worker's data streams to their end.
    Finished {
        peer: u32,
    },
    Aborted {
        by: u32,
    },
    /// The connection ended after the peer's closing handshake.
    Lost {
        peer: u32,
    },
    /// The connection ended without it: the peer died, went silent past the idle timeout, or
    /// reset. The run cannot go on.
    Failed {
        peer: u32,
        why: String,
    },
    /// The peer sent something the protocol does not allow; its connection is closed.
    Broken {
        peer: u32,
        why: String,
    },
}

/// One peer's connection and the writers of this worker's streams to it.
struct Peer {
    conn: quinn::Connection,
    control: Arc<tokio::sync::Mutex<quinn::SendStream>>,
    data: [Option<tokio::sync::mpsc::Sender<Frame>>; 4],
    writers: Vec<tokio::task::JoinHandle<()>>,
    /// Bytes of this peer's messages read and not yet received by the program.
    held: Arc<std::sync::atomic::AtomicU64>,
    /// How many times this connection's mesh has regrouped ([`Quic::regrouped`]): both
    /// ends count alike, and a regrouped control stream names it.
    generation: u32,
    /// Turns true once the peer's data streams of this generation have been accepted: the
    /// next streams it opens are the next generation's.
    accepted: tokio::sync::watch::Receiver<bool>,
    /// The connection is another rank's, and carries this peer's streams beside its own: a
    /// lost rank hosted by a survivor on that survivor's connections ([`Quic::regrouped`]).
    /// Closing this peer leaves the connection open.
    shares_conn: bool,
}

/// A bound endpoint that has not connected to its peers yet (its address is known, so a
/// launcher can tell the others).
pub struct Bound {
    rank: u32,
    runtime: tokio::runtime::Runtime,
    endpoint: quinn::Endpoint,
    client: quinn::ClientConfig,
    opts: QuicOptions,
    cuts: Cuts,
}

impl std::fmt::Debug for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bound").field("rank", &self.rank).finish()
    }
}

/// Largest UDP payload path MTU discovery tries. Loopback and jumbo-frame links carry large
/// datagrams, and fewer, larger packets cost less per byte (header protection, acknowledgements,
/// system calls): streaming 4 MiB tensors on loopback measured 0.8 GB/s at the default 1,452
/// bytes, 1.3-1.7 at 6,500, 2.0-2.6 at 16,000 and 2.1-2.6 at 32,000 (`pipe bench transport`,
/// 2026-11-26; above 6,500 only since [`BatchBounded`] cuts the GSO batches). Ordinary links
/// stop at their own MTU, which discovery finds.
pub const MTU_UPPER_BOUND: u16 = 32_000;

/// The most bytes one GSO send may carry: a UDP datagram's 65,507 bytes, with room to spare.
/// The kernel refuses a larger batch, and every packet in it is lost.
const GSO_BATCH_BYTES: usize = 65_000;

/// The most bytes the kernel hands over as one received GRO list that a receive buffer has
/// room for: 64 datagrams (the kernel's `UDP_GRO_CNT_MAX`) of an Ethernet MTU's 1,500
/// bytes. A list never passes the kernel's GRO size limit, 64 KiB unless an administrator
/// raises it, and on loopback a list is one of our own GSO sends, at most
/// [`GSO_BATCH_BYTES`]; both fit.
const RECEIVE_LIST_BYTES: usize = 64 * 1_500;

/// How many datagrams of [`MTU_UPPER_BOUND`] bytes quinn makes room for in each of the 32
/// buffers of one receive call: enough for [`RECEIVE_LIST_BYTES`]. quinn sizes every buffer
/// for `gro` datagrams of the largest payload it may see (64 of 32,000 bytes with GRO on,
/// 65.5 MB per endpoint, zeroed, resident once reused). A process that binds an endpoint for
/// every mesh it joins (a survivor of each lost replica, twice per rejoin) allocated and freed
/// that much each time, and the allocator's arena grew a step at every new place it landed
/// (`docs/reliability.md`, "Live rejoin of worker processes"); 3 segments take 3 MB.
fn receive_segments(gro: usize) -> usize {
    gro.min(RECEIVE_LIST_BYTES.div_ceil(usize::from(MTU_UPPER_BOUND)))
        .max(1)
}

/// A UDP socket that cuts quinn's GSO batches to what the kernel takes in one send. quinn
/// batches up to 10 datagrams of the path's MTU: above 6,500 bytes that passes 64 KiB, so
/// without the cut path MTU discovery lost its probes and fell back to 1,200 bytes. On links
/// with an ordinary MTU a batch fits and passes untouched.
///
/// It also carries the links cut for fault drills ([`Cuts`]): a datagram to or from a peer
/// whose link is cut is dropped, as a network partition drops it.
#[derive(Debug)]
struct BatchBounded {
    inner: Arc<dyn quinn::AsyncUdpSocket>,
    cuts: Cuts,
}

/// Links cut for fault drills ([`crate::Transport::cut_link`]): each peer's address, and
/// until when no datagram passes between it and this endpoint. Empty in every ordinary run,
/// where the check is one uncontended lock of an empty list per datagram batch.
#[derive(Clone, Debug, Default)]
struct Cuts(Arc<std::sync::Mutex<Vec<(SocketAddr, std::time::Instant)>>>);

impl Cuts {
    /// Cuts the link to `addr` until `until`.
    fn cut(&self, addr: SocketAddr, until: std::time::Instant) {
        if let Ok(mut cuts) = self.0.lock() {
            cuts.push((addr, until));
        }
    }

    /// Whether the link to `addr` is cut now (cuts that have healed are forgotten).
    fn is_cut(&self, addr: SocketAddr) -> bool {
        let Ok(mut cuts) = self.0.lock() else {
            return false;
        };
        if cuts.is_empty() {
            return false;
        }
        let now = std::time::Instant::now();
        cuts.retain(|(_, until)| *until > now);
        let same = |a: &SocketAddr| {
            a.ip().to_canonical() == addr.ip().to_canonical() && a.port() == addr.port()
        };
        cuts.iter().any(|(a, _)| same(a))
    }
}

impl quinn::AsyncUdpSocket for BatchBounded {
    fn create_io_poller(self: Arc<Self>) -> std::pin::Pin<Box<dyn quinn::UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &quinn::udp::Transmit) -> std::io::Result<()> {
        if self.cuts.is_cut(transmit.destination) {
            // Lost on the way, as across a partition.
            return Ok(());
        }
        let Some(segment) = transmit
            .segment_size
            .filter(|_| transmit.contents.len() > GSO_BATCH_BYTES)
        else {
            return self.inner.try_send(transmit);
        };
        let per_send = (GSO_BATCH_BYTES / segment.max(1)).max(1) * segment;
        for (i, part) in transmit.contents.chunks(per_send).enumerate() {
            let cut = quinn::udp::Transmit {
                contents: part,
                segment_size: (part.len() > segment).then_some(segment),
                ..*transmit
            };
            match self.inner.try_send(&cut) {
                Ok(()) => {}
                // Nothing sent yet: quinn waits for the socket and retries the whole batch.
                Err(e) if i == 0 => return Err(e),
                // Part of the batch has left: the rest counts as lost, and QUIC's loss
                // recovery resends it (retrying all would duplicate what left).
                Err(_) => return Ok(()),
            }
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut std::task::Context,
        bufs: &mut [std::io::IoSliceMut<'_>],
        meta: &mut [quinn::udp::RecvMeta],
    ) -> std::task::Poll<std::io::Result<usize>> {
        loop {
            let n = match self.inner.poll_recv(cx, bufs, meta) {
                std::task::Poll::Ready(Ok(n)) => n,
                other => return other,
            };
            // Datagrams from across a cut link are dropped; the others move up to fill the gaps.
            let mut kept = 0;
            for i in 0..n {
                if self.cuts.is_cut(meta[i].addr) {
                    continue;
                }
                if kept != i {
                    let len = meta[i].len;
                    let (to, from) = bufs.split_at_mut(i);
                    to[kept][..len].copy_from_slice(&from[0][..len]);
                    meta[kept] = meta[i];
                }
                kept += 1;
            }
            if kept > 0 || n == 0 {
                return std::task::Poll::Ready(Ok(kept));
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        receive_segments(self.inner.max_receive_segments())
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

/// The congestion window a connection starts with. A connection that has carried only
/// control records (two workers whose programs never talk, until a regroup carries a lost
/// rank on it) never leaves its first window, since a sender that is not using its window
/// does not grow it; at quinn's default of 14,720 bytes, the first activation or gradient it
/// carried after a loss climbed through slow start, one round trip per doubling, on hosts
/// whose round trips are long while every worker recovers at once.
const INITIAL_WINDOW_BYTES: u64 = 1 << 20;

fn transport_config(opts: &QuicOptions) -> Result<Arc<quinn::TransportConfig>, TransportError> {
    let mut t = quinn::TransportConfig::default();
    let idle = quinn::IdleTimeout::try_from(opts.idle_timeout)
        .map_err(|e| setup_err("idle timeout", e))?;
    t.max_idle_timeout(Some(idle))
        .keep_alive_interval(Some(opts.idle_timeout / 4))
        .stream_receive_window(quinn::VarInt::from_u32(16 << 20))
        .receive_window(quinn::VarInt::from_u32(64 << 20))
        .send_window(64 << 20)
        // A generation's five streams each way, and room for the next two while the last
        // closes: a survivor's own, and a lost rank's it hosts on the same connection
        // ([`Quic::regrouped`]).
        .max_concurrent_uni_streams(quinn::VarInt::from_u32(24));
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(opts.max_datagram.clamp(1200, MTU_UPPER_BOUND));
    t.mtu_discovery_config(Some(mtu));
    let mut cubic = quinn::congestion::CubicConfig::default();
    cubic.initial_window(INITIAL_WINDOW_BYTES);
    t.congestion_controller_factory(Arc::new(cubic));
    Ok(Arc::new(t))
}

fn tls_configs(
    creds: &Credentials,
    opts: &QuicOptions,
) -> Result<(quinn::ServerConfig, quinn::ClientConfig), TransportError> {
    // AES-128-GCM first: QUIC encrypts every packet with the negotiated suite, and 128-bit
    // AES takes 10 rounds to 256-bit's 14 (TLS 1.3 offers both; both peers are ours).
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    let provider = Arc::new(provider);
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(creds.ca.clone())
        .map_err(|e| cred_err("the cluster's CA", e))?;
    let roots = Arc::new(roots);
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots.clone(),
        provider.clone(),
    )
    .build()
    .map_err(|e| setup_err("client verifier", e))?;
    // This rank's own certificate, checked against the CA as every peer will check it: a
    // certificate of another cluster is named here, at the start, not as a peer's refused
    // handshake (or a wait for peers that refuse it).
    let (leaf, intermediates) = creds
        .chain
        .split_first()
        .ok_or_else(|| cred_err("this rank's certificate", "the chain is empty"))?;
    verifier
        .verify_client_cert(leaf, intermediates, rustls::pki_types::UnixTime::now())
        .map_err(|e| {
            cred_err(
                "this rank's certificate is not one the cluster's CA signed",
                e,
            )
        })?;
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| setup_err("TLS", e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(creds.chain.clone(), creds.key.clone_key())
        .map_err(|e| cred_err("this rank's certificate and key", e))?;
    server.alpn_protocols = vec![ALPN.to_vec()];
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| setup_err("TLS", e))?
        .with_root_certificates(roots)
        .with_client_auth_cert(creds.chain.clone(), creds.key.clone_key())
        .map_err(|e| cred_err("this rank's certificate and key", e))?;
    client.alpn_protocols = vec![ALPN.to_vec()];
    let transport = transport_config(opts)?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(
        QuicServerConfig::try_from(server).map_err(|e| setup_err("QUIC TLS", e))?,
    ));
    server.transport_config(transport.clone());
    let mut client = quinn::ClientConfig::new(Arc::new(
        QuicClientConfig::try_from(client).map_err(|e| setup_err("QUIC TLS", e))?,
    ));
    client.transport_config(transport);
    Ok((server, client))
}

/// Socket buffers asked for. At the kernel's default (about 200 KB) a receiver that falls
/// behind for a moment drops datagrams, and every loss halves the sender's congestion window:
/// loopback streaming measured about 6,800 receive-buffer errors per run at the default.
/// The kernel caps the request at `net.core.rmem_max` / `wmem_max`.
const SOCKET_BUFFER_BYTES: usize = 8 << 20;

/// A UDP socket bound to `addr` with large buffers (best effort: a capped request is kept).
fn udp_socket(addr: SocketAddr) -> Result<std::net::UdpSocket, TransportError> {
    let socket = std::net::UdpSocket::bind(addr).map_err(|e| TransportError::binding(addr, &e))?;
    let state = quinn::udp::UdpSocketState::new((&socket).into())
        .map_err(|e| setup_err("UDP socket", e))?;
    let _ = state.set_recv_buffer_size((&socket).into(), SOCKET_BUFFER_BYTES);
    let _ = state.set_send_buffer_size((&socket).into(), SOCKET_BUFFER_BYTES);
    Ok(socket)
}

/// The runtime an endpoint's connections run on: one worker thread, named `name`.
fn endpoint_runtime(name: &str) -> Result<tokio::runtime::Runtime, TransportError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(name)
        .enable_all()
        .build()
        .map_err(|e| setup_err("runtime", e))
}

/// A QUIC endpoint on a new UDP socket at `addr`, in the runtime entered; it accepts
/// connections where it has a `server` configuration. Its datagrams pass `cuts`.
fn endpoint_on(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
    cuts: &Cuts,
) -> Result<quinn::Endpoint, TransportError> {
    let socket = udp_socket(addr)?;
    let mut config = quinn::EndpointConfig::default();
    config
        .max_udp_payload_size(MTU_UPPER_BOUND)
        .map_err(|e| setup_err("UDP payload size", e))?;
    let runtime: Arc<dyn quinn::Runtime> = Arc::new(quinn::TokioRuntime);
    let socket = runtime
        .wrap_udp_socket(socket)
        .map_err(|e| setup_err(&format!("UDP socket on {addr}"), e))?;
    let socket = Arc::new(BatchBounded {
        inner: socket,
        cuts: cuts.clone(),
    });
    quinn::Endpoint::new_with_abstract_socket(config, server, socket, runtime)
        .map_err(|e| setup_err(&format!("endpoint on {addr}"), e))
}

impl Bound {
    /// Binds rank `rank`'s endpoint to `addr` (port 0: any free port).
    ///
    /// # Errors
    /// [`TransportError::Setup`]: bad credentials, a socket that cannot be bound.
    pub fn bind(
        rank: u32,
        addr: SocketAddr,
        creds: &Credentials,
        opts: QuicOptions,
    ) -> Result<Self, TransportError> {
        let runtime = endpoint_runtime(&format!("pipe-quic-{rank}"))?;
        let (server, client) = tls_configs(creds, &opts)?;
        let cuts = Cuts::default();
        let endpoint = {
            let _guard = runtime.enter();
            endpoint_on(addr, Some(server), &cuts)?
        };
        Ok(Bound {
            rank,
            runtime,
            endpoint,
            client,
            opts,
            cuts,
        })
    }

    /// The address peers reach this endpoint at.
    ///
    /// # Errors
    /// [`TransportError::Setup`] if the socket has no address.
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        self.endpoint
            .local_addr()
            .map_err(|e| setup_err("local address", e))
    }

    /// Connects to every other worker (`addrs[r]` is rank r's address; this one's entry is
    /// ignored): dials the higher ranks, accepts the lower ones, exchanges hellos, and opens
    /// the streams. Peers that start late are waited for up to the connect timeout.
    ///
    /// # Errors
    /// [`TransportError::Setup`] naming the peers that never connected, or a refused one.
    pub fn connect(self, addrs: &[SocketAddr]) -> Result<Quic, TransportError> {
        let present: Vec<Option<SocketAddr>> = addrs.iter().copied().map(Some).collect();
        self.connect_present(&present)
    }

    /// [`Bound::connect`] to the ranks whose address is given: a `None` is a rank that is not
    /// in the mesh (a lost worker whose survivors connect a mesh of their own), neither dialled
    /// nor waited for.
    ///
    /// # Errors
    /// As [`Bound::connect`].
    pub fn connect_present(self, addrs: &[Option<SocketAddr>]) -> Result<Quic, TransportError> {
        let Bound {
            rank,
            runtime,
            endpoint,
            client,
            opts,
            cuts,
        } = self;
        let size = addrs.len() as u32;
        if rank >= size {
            return Err(TransportError::Setup(format!(
                "rank {rank} in a mesh of {size}"
            )));
        }
        let (tx, events) = unbounded();
        let alarm = Alarm::default();
        let events_tx = Events {
            tx,
            alarm: alarm.clone(),
        };
        let interrupt = events_tx.tx.clone();
        let host = HostId::current()?;
        let me = Me { rank, host };
        let (peers, hosts) = runtime.block_on(connect_all(
            me,
            addrs,
            (&endpoint, &client),
            &opts,
            &events_tx,
        ))?;
        Ok(Quic {
            rank,
            size,
            runtime: Some(runtime),
            endpoint,
            peers,
            events,
            early: Early::default(),
            ended: HashSet::new(),
            finished_by: HashSet::new(),
            lost: HashSet::new(),
            failed: None,
            aborted_by: None,
            told_abort: false,
            opts,
            closed: false,
            cuts,
            host,
            hosts,
            alarm,
            interrupt,
            beside: None,
        })
    }
}

/// The hello a side sends first on its control stream: its run, its rank and its host
/// identity (so that a cluster's workers on one host can also talk through shared memory).
fn hello(rank: u32, run_id: u64, host: &HostId) -> Vec<u8> {
    let mut out = vec![TAG_CONTROL];
    out.extend_from_slice(&HELLO_MAGIC);
    out.extend_from_slice(&run_id.to_le_bytes());
    out.extend_from_slice(&rank.to_le_bytes());
    host.encode(&mut out);
    out
}

/// Bytes of a hello.
const HELLO_BYTES: usize = 17 + HostId::BYTES;

/// Reads a peer's hello from its first stream: returns its rank and host.
async fn read_hello(stream: &mut quinn::RecvStream, run_id: u64) -> Result<(u32, HostId), String> {
    let mut buf = [0u8; HELLO_BYTES];
    stream
        .read_exact(&mut buf)
        .await
        .map_err(|e| format!("reading the hello: {e}"))?;
    if buf[0] != TAG_CONTROL || buf[1..5] != HELLO_MAGIC {
        return Err("the first stream is not a pipe hello".into());
    }
    let mut run = [0u8; 8];
    run.copy_from_slice(&buf[5..13]);
    let run = u64::from_le_bytes(run);
    if run != run_id {
        return Err(format!("peer of run {run:#x}, this run is {run_id:#x}"));
    }
    let rank = u32::from_le_bytes([buf[13], buf[14], buf[15], buf[16]]);
    Ok((rank, HostId::decode(&buf[17..])))
}

/// Why a hello exchange failed, and whether trying again could help: a peer of another run,
/// one that is not a pipe worker, or one that refused this worker will say the same again.
#[derive(Debug)]
struct GreetError {
    definitive: bool,
    why: String,
}

/// Hello exchange on a fresh connection: returns the peer's rank, this side's control stream,
/// the peer's control stream (past the hello) and the peer's host.
async fn greet(
    conn: &quinn::Connection,
    rank: u32,
    run_id: u64,
    host: &HostId,
) -> Result<(u32, quinn::SendStream, quinn::RecvStream, HostId), GreetError> {
    // A transport failure is worth retrying unless the peer closed the connection to refuse.
    let transient = |e: String| GreetError {
        definitive: matches!(conn.close_reason(),
            Some(quinn::ConnectionError::ApplicationClosed(c)) if c.error_code == CLOSE_REFUSED.into()),
        why: e,
    };
    let mut control = conn
        .open_uni()
        .await
        .map_err(|e| transient(e.to_string()))?;
    control
        .write_all(&hello(rank, run_id, host))
        .await
        .map_err(|e| transient(e.to_string()))?;
    let mut theirs = conn
        .accept_uni()
        .await
        .map_err(|e| transient(e.to_string()))?;
    let (peer, their_host) = read_hello(&mut theirs, run_id)
        .await
        .map_err(|why| GreetError {
            definitive: !why.starts_with("reading the hello"),
            why,
        })?;
    Ok((peer, control, theirs, their_host))
}

/// This worker, as its hellos name it.
#[derive(Clone, Copy, Debug)]
struct Me {
    rank: u32,
    host: HostId,
}

type Greeted = (
    u32,
    quinn::Connection,
    quinn::SendStream,
    quinn::RecvStream,
    HostId,
);

/// Dials `to` until it answers or the deadline passes. Only the QUIC handshake of an attempt
/// is bounded by a short timer (a peer that has not bound its socket yet answers nothing):
/// once the handshake is done the peer may already hold this connection as rank `rank`'s, so
/// the hello exchange is never abandoned on a timer, only when the connection fails or the
/// deadline passes. Abandoning it would leave the peer holding a connection this side had
/// dropped.
async fn dial(
    endpoint: &quinn::Endpoint,
    client: &quinn::ClientConfig,
    me: Me,
    to: u32,
    addr: SocketAddr,
    opts: &QuicOptions,
    deadline: Instant,
) -> Result<Greeted, TransportError> {
    let Me { rank, host } = me;
    let give_up = |why: &str| {
        TransportError::Setup(format!(
            "rank {rank} could not connect to rank {to} at {addr}: {why}"
        ))
    };
    let mut last = String::new();
    while Instant::now() < deadline {
        let connecting = endpoint
            .connect_with(client.clone(), addr, &server_name(to))
            .map_err(|e| give_up(&e.to_string()))?;
        let conn = match tokio::time::timeout(DIAL_HANDSHAKE_TIMEOUT, connecting).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => {
                last = e.to_string();
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(_) => {
                last = "handshake timed out".into();
                continue;
            }
        };
        let greeting = greet(&conn, rank, opts.run_id, &host);
        match tokio::time::timeout_at(deadline.into(), greeting).await {
            Ok(Ok((peer, control, theirs, their_host))) if peer == to => {
                return Ok((peer, conn, control, theirs, their_host));
            }
            Ok(Ok((peer, ..))) => {
                conn.close(CLOSE_REFUSED.into(), b"wrong rank");
                return Err(give_up(&format!("the worker there says it is rank {peer}")));
            }
            Ok(Err(e)) if e.definitive => return Err(give_up(&e.why)),
            Ok(Err(e)) => last = e.why,
            Err(_) => last = "no hello before the connect timeout".into(),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(TransportError::Setup(format!(
        "rank {rank} could not connect to rank {to} at {addr} within {:?}: {last}",
        opts.connect_timeout
    )))
}

/// Accepts the lower ranks' connections; refuses peers of another run or rank. Each incoming
/// connection is handshaken and greeted in a task of its own, so that one slow or silent peer
/// holds up no other (quinn does not start an incoming connection's handshake until it is
/// accepted).
async fn accept_lower(
    endpoint: quinn::Endpoint,
    me: Me,
    opts: QuicOptions,
    found: tokio::sync::mpsc::UnboundedSender<Result<Greeted, TransportError>>,
) {
    let Me { rank, host } = me;
    let mut have = HashSet::new();
    let mut greeting = tokio::task::JoinSet::new();
    while (have.len() as u32) < rank {
        tokio::select! {
            incoming = endpoint.accept() => {
                let Some(incoming) = incoming else { break };
                let run_id = opts.run_id;
                greeting.spawn(async move {
                    // A failed handshake (a peer without a valid certificate) is dropped.
                    let conn = incoming.await.ok()?;
                    let greeted = greet(&conn, rank, run_id, &host).await;
                    Some((conn, greeted))
                });
            }
            Some(done) = greeting.join_next() => {
                let Ok(Some((conn, greeted))) = done else { continue };
                match greeted {
                    Ok((peer, control, theirs, their_host)) if peer < rank && have.insert(peer) => {
                        if found.send(Ok((peer, conn, control, theirs, their_host))).is_err() {
                            return;
                        }
                    }
                    Ok((peer, ..)) => conn.close(
                        CLOSE_REFUSED.into(),
                        format!("rank {peer} refused").as_bytes(),
                    ),
                    Err(e) => conn.close(CLOSE_REFUSED.into(), e.why.as_bytes()),
                }
            }
        }
    }
}

/// Waits until the connection to `peer`, made while connecting, closes: why, if the peer
/// closed it (a peer that failed while connecting closes every connection it has made with
/// [`CLOSE_FAILED`] and the reason).
async fn closed_while_connecting(peer: u32, conn: quinn::Connection) -> (u32, String) {
    let why = match conn.closed().await {
        quinn::ConnectionError::ApplicationClosed(c) if c.error_code == CLOSE_FAILED.into() => {
            String::from_utf8_lossy(&c.reason).into_owned()
        }
        other => format!("its connection ended: {other}"),
    };
    (peer, why)
}

/// Connects to every peer: dials the higher ranks, accepts the lower ones. Fails at once,
/// not at the connect timeout, when a dial fails for good or a connection already made closes
/// (a peer failed while connecting, or its process died); either way it closes every
/// connection it has made with [`CLOSE_FAILED`] and the reason, so that its peers stop at
/// once too, and each of theirs in turn.
async fn connect_all(
    me: Me,
    addrs: &[Option<SocketAddr>],
    (endpoint, client): (&quinn::Endpoint, &quinn::ClientConfig),
    opts: &QuicOptions,
    events: &Events,
) -> Result<(Vec<Option<Peer>>, Vec<Option<HostId>>), TransportError> {
    let rank = me.rank;
    // Every task ends by itself: a dial at the deadline (after its last attempt), the accepts
    // at the connect timeout; the channel then closes.
    let deadline = Instant::now() + opts.connect_timeout;
    let (found, mut arrivals) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = tokio::task::JoinSet::new();
    for to in rank + 1..addrs.len() as u32 {
        let Some(addr) = addrs[to as usize] else {
            continue;
        };
        let (endpoint, client, opts) = (endpoint.clone(), client.clone(), opts.clone());
        let found = found.clone();
        tasks.spawn(async move {
            let _ = found.send(dial(&endpoint, &client, me, to, addr, &opts, deadline).await);
        });
    }
    let accepting = accept_lower(endpoint.clone(), me, opts.clone(), found);
    let wait = opts.connect_timeout;
    tasks.spawn(async move {
        let _ = tokio::time::timeout(wait, accepting).await;
    });
    let mut greeted: Vec<Greeted> = Vec::new();
    let mut watches = tokio::task::JoinSet::new();
    let present = |p: u32| addrs.get(p as usize).is_some_and(Option::is_some);
    let expected = (0..addrs.len() as u32)
        .filter(|&p| p != rank && present(p))
        .count();
    let failure = loop {
        if greeted.len() == expected {
            break None;
        }
        tokio::select! {
            got = arrivals.recv() => match got {
                Some(Ok(g)) => {
                    watches.spawn(closed_while_connecting(g.0, g.1.clone()));
                    greeted.push(g);
                }
                Some(Err(e)) => break Some(e),
                None => break None,
            },
            Some(Ok((peer, why))) = watches.join_next() => {
                break Some(TransportError::Setup(format!(
                    "rank {rank}: rank {peer} failed while connecting: {why}"
                )));
            }
        }
    };
    tasks.abort_all();
    watches.abort_all();
    let missing: Vec<u32> = (0..addrs.len() as u32)
        .filter(|&p| p != rank && present(p) && greeted.iter().all(|g| g.0 != p))
        .collect();
    let failure = failure.or_else(|| {
        (!missing.is_empty()).then(|| {
            TransportError::Setup(format!(
                "rank {rank}: ranks {missing:?} did not connect within {:?}",
                opts.connect_timeout
            ))
        })
    });
    if let Some(e) = failure {
        let why = e.to_string();
        for (_, conn, ..) in &greeted {
            conn.close(CLOSE_FAILED.into(), why.as_bytes());
        }
        // The closes go out with the endpoint's next packets: let them leave before the
        // caller drops the endpoint (bounded; a peer that does not answer costs a second).
        let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
        return Err(e);
    }
    let mut peers: Vec<Option<Peer>> = (0..addrs.len()).map(|_| None).collect();
    let mut hosts: Vec<Option<HostId>> = vec![None; addrs.len()];
    for (peer, conn, control, theirs, host) in greeted {
        hosts[peer as usize] = Some(host);
        peers[peer as usize] =
            Some(start_peer(rank, peer, conn, (control, theirs), opts, events).await?);
    }
    // The mesh is complete: any later connection attempt is refused at once.
    let arrivals = endpoint.clone();
    tokio::spawn(async move {
        while let Some(incoming) = arrivals.accept().await {
            incoming.refuse();
        }
    });
    Ok((peers, hosts))
}

/// Opens this side's data streams to `peer`, starts their writers, and starts the readers of
/// the peer's control stream, data streams and connection state.
async fn start_peer(
    rank: u32,
    peer: u32,
    conn: quinn::Connection,
    (control, theirs): (quinn::SendStream, quinn::RecvStream),
    opts: &QuicOptions,
    events: &Events,
) -> Result<Peer, TransportError> {
    let (data, writers) = open_data_streams(&conn, peer, opts).await?;
    tokio::spawn(read_control(peer, theirs, events.clone(), false));
    let control = Arc::new(tokio::sync::Mutex::new(control));
    let held = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (accepted_tx, accepted) = tokio::sync::watch::channel(false);
    tokio::spawn(read_data_streams(
        (rank, peer),
        conn.clone(),
        reading_of(opts, &held),
        events.clone(),
        (control.clone(), accepted_tx),
    ));
    tokio::spawn(watch_connection(peer, conn.clone(), events.clone(), false));
    Ok(Peer {
        conn,
        control,
        data,
        writers,
        held,
        generation: 0,
        accepted,
        shares_conn: false,
    })
}

/// How `opts` has a peer's data streams read, `held` counting what waits for the program.
fn reading_of(opts: &QuicOptions, held: &Arc<std::sync::atomic::AtomicU64>) -> Reading {
    Reading {
        limits: FrameLimits {
            run_id: opts.run_id,
            max_payload_bytes: opts.max_payload_bytes,
        },
        grace: opts.frame_grace,
        held: held.clone(),
        max_held: opts.max_held_bytes,
    }
}

/// The writers of this side's streams to a peer: one data stream per [`Kind`] opened on
/// `conn`, each tagged with its kind and fed by a task of its own.
type DataStreams = (
    [Option<tokio::sync::mpsc::Sender<Frame>>; 4],
    Vec<tokio::task::JoinHandle<()>>,
);

/// Opens this side's data streams to `peer` on `conn` and starts their writers.
async fn open_data_streams(
    conn: &quinn::Connection,
    peer: u32,
    opts: &QuicOptions,
) -> Result<DataStreams, TransportError> {
    let mut data: [Option<tokio::sync::mpsc::Sender<Frame>>; 4] = [None, None, None, None];
    let mut writers = Vec::new();
    for kind in KINDS {
        let mut stream = conn
            .open_uni()
            .await
            .map_err(|e| setup_err(&format!("stream to rank {peer}"), e))?;
        stream
            .write_all(&[kind_slot(kind) as u8])
            .await
            .map_err(|e| setup_err(&format!("stream to rank {peer}"), e))?;
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Frame>(opts.queue.max(1));
        data[kind_slot(kind)] = Some(tx);
        writers.push(tokio::spawn(async move {
            while let Some(mut frame) = rx.recv().await {
                if stream.write_all_chunks(&mut frame).await.is_err() {
                    // The connection's reader reports why; dropping `rx` fails later sends.
                    return;
                }
            }
            // Delivery is the closing handshake's business (see `Quic::shutdown`).
            let _ = stream.finish();
        }));
    }
    Ok((data, writers))
}

/// Reads the peer's control records. A peer that shares another's connection
/// ([`Peer::shares_conn`]) finishes its control stream as it closes: that end is its loss,
/// as the connection's closing handshake is another peer's.
async fn read_control(peer: u32, mut stream: quinn::RecvStream, events: Events, shared: bool) {
    let mut record = [0u8; 5];
    loop {
        if let Err(e) = stream.read_exact(&mut record).await {
            if shared && matches!(e, quinn::ReadExactError::FinishedEarly(0)) {
                let _ = events.send(Event::Lost { peer });
            }
            return;
        }
        let by = u32::from_le_bytes([record[1], record[2], record[3], record[4]]);
        let event = match record[0] {
            RECORD_ABORT => Event::Aborted { by },
            RECORD_FINISHED => Event::Finished { peer },
            other => Event::Broken {
                peer,
                why: format!("unknown control record {other}"),
            },
        };
        if events.send(event).is_err() {
            return;
        }
    }
}

/// Reads the peer's data streams; once all of them have ended cleanly, tells the peer (an `F`
/// record on this side's control stream) that everything it sent has been read, so it may
/// close the connection without waiting for this worker's program to end.
async fn read_data_streams(
    (rank, peer): (u32, u32),
    conn: quinn::Connection,
    reading: Reading,
    events: Events,
    (control, accepted): (
        Arc<tokio::sync::Mutex<quinn::SendStream>>,
        tokio::sync::watch::Sender<bool>,
    ),
) {
    let mut readers = Vec::new();
    for _ in KINDS {
        let Ok(mut stream) = conn.accept_uni().await else {
            return;
        };
        let (events, conn, reading) = (events.clone(), conn.clone(), reading.clone());
        readers.push(tokio::spawn(async move {
            let mut tag = [0u8; 1];
            let kind = match stream.read_exact(&mut tag).await {
                Ok(()) => KINDS.get(tag[0] as usize).copied(),
                Err(_) => return false,
            };
            let Some(kind) = kind else {
                let _ = events.send(Event::Broken {
                    peer,
                    why: format!("unknown stream tag {}", tag[0]),
                });
                return false;
            };
            let read = read_frames((rank, peer, kind), &mut stream, &reading, &events).await;
            let (end, clean) = match read {
                Ok(()) => (Event::StreamEnd { peer, kind }, true),
                Err(why) => {
                    conn.close(CLOSE_REFUSED.into(), why.as_bytes());
                    (Event::Broken { peer, why }, false)
                }
            };
            let _ = events.send(end);
            clean
        }));
    }
    let _ = accepted.send(true);
    let mut all_clean = true;
    for r in readers {
        all_clean &= r.await.unwrap_or(false);
    }
    if all_clean {
        let mut record = vec![RECORD_FINISHED];
        record.extend_from_slice(&rank.to_le_bytes());
        let _ = control.lock().await.write_all(&record).await;
    }
}

/// Slowest payload rate a peer is allowed, bytes per second (see
/// [`QuicOptions::frame_grace`]).
const MIN_RATE: f64 = 1e6;

/// How a peer's data streams are read: the frame checks, the grace a begun frame has, and the
/// bound on what may wait for the program ([`QuicOptions::max_held_bytes`]).
#[derive(Clone, Debug)]
struct Reading {
    limits: FrameLimits,
    grace: Duration,
    held: Arc<std::sync::atomic::AtomicU64>,
    max_held: u64,
}

/// Reads frames from one data stream until it ends; every check before any allocation.
async fn read_frames(
    (rank, peer, kind): (u32, u32, Kind),
    stream: &mut quinn::RecvStream,
    reading: &Reading,
    events: &Events,
) -> Result<(), String> {
    let (limits, grace) = (&reading.limits, reading.grace);
    loop {
        let mut prefix = [0u8; PREFIX_BYTES];
        match stream.read_exact(&mut prefix).await {
            Ok(()) => {}
            Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(()),
            Err(e) => return Err(format!("reading from rank {peer}: {e}")),
        }
        let header_len = frame::parse_prefix(&prefix).map_err(|e| format!("rank {peer}: {e}"))?;
        let mut header = vec![0u8; header_len];
        stream
            .read_exact(&mut header)
            .await
            .map_err(|e| format!("reading from rank {peer}: {e}"))?;
        let header =
            frame::parse_header(&header, limits).map_err(|e| format!("rank {peer}: {e}"))?;
        let key = header.key().map_err(|e| format!("rank {peer}: {e}"))?;
        if key.from != peer || key.to != rank || key.kind != kind {
            return Err(format!(
                "rank {peer} sent {key:?} on its {kind:?} stream to rank {rank}"
            ));
        }
        let mut payload = frame::PayloadBuffer::for_header(&header);
        // A frame that has begun must finish: a peer that stops mid-payload (or sends fewer
        // bytes than its header says) is an error, not a receive that waits forever.
        let limit = grace + Duration::from_secs_f64(header.payload_bytes() as f64 / MIN_RATE);
        match tokio::time::timeout(limit, stream.read_exact(payload.bytes_mut())).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("reading from rank {peer}: {e}")),
            Err(_) => {
                return Err(format!(
                    "rank {peer} did not finish a {}-byte payload within {limit:?}",
                    header.payload_bytes()
                ));
            }
        }
        let message = payload
            .into_message(&header)
            .map_err(|e| format!("rank {peer}: {e}"))?;
        let bytes = message.tensor.bytes() as u64;
        let held = reading
            .held
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed)
            + bytes;
        if held > reading.max_held {
            return Err(format!(
                "rank {peer} has {held} bytes of messages waiting for rank {rank} to receive \
                 them, past the bound of {} (more than any schedule keeps in flight)",
                reading.max_held
            ));
        }
        if events.send(Event::Message(message)).is_err() {
            return Ok(());
        }
    }
}

async fn watch_connection(peer: u32, conn: quinn::Connection, events: Events, shared: bool) {
    let event = match conn.closed().await {
        quinn::ConnectionError::ApplicationClosed(c) if c.error_code == CLOSE_ABORT.into() => {
            let by = c
                .reason
                .get(..4)
                .map_or(peer, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            Event::Aborted { by }
        }
        quinn::ConnectionError::ApplicationClosed(c) if c.error_code == CLOSE_DONE.into() => {
            Event::Lost { peer }
        }
        // Closed by this process: for a peer on another's connection, by that other rank's
        // endpoint as it closes, after which nothing more comes from this one either.
        quinn::ConnectionError::LocallyClosed if shared => Event::Lost { peer },
        quinn::ConnectionError::LocallyClosed => return,
        quinn::ConnectionError::TimedOut => Event::Failed {
            peer,
            why: "no word from it within the idle timeout (its process, host or network is gone)"
                .into(),
        },
        other => Event::Failed {
            peer,
            why: format!("its connection ended: {other}"),
        },
    };
    let _ = events.send(event);
}

/// One worker's QUIC endpoint, connected to every other worker.
pub struct Quic {
    rank: u32,
    size: u32,
    /// Taken when the endpoint lingers on a background thread after a drop.
    runtime: Option<tokio::runtime::Runtime>,
    endpoint: quinn::Endpoint,
    peers: Vec<Option<Peer>>,
    events: Receiver<Event>,
    early: Early,
    /// Data streams (peer, kind) that have ended.
    ended: HashSet<(u32, Kind)>,
    /// Peers that have read all of this worker's data.
    finished_by: HashSet<u32>,
    /// Peers whose connection ended.
    lost: HashSet<u32>,
    /// The first peer lost without a closing handshake: the failure this worker's abort
    /// names, so every worker's error points at the rank that died.
    failed: Option<u32>,
    aborted_by: Option<u32>,
    /// This worker told its peers to stop.
    told_abort: bool,
    opts: QuicOptions,
    closed: bool,
    /// Links cut for fault drills ([`Transport::cut_link`]).
    cuts: Cuts,
    /// This worker's host, and each peer's as its hello said.
    host: HostId,
    hosts: Vec<Option<HostId>>,
    /// Called when a failure is heard ([`Quic::on_failure`]).
    alarm: Alarm,
    /// Into the event queue from outside: [`Transport::interrupter`].
    interrupt: Sender<Event>,
    /// The rank in this endpoint's process that it reaches through memory, not a connection:
    /// a lost rank's host and the rank it hosts ([`Quic::regrouped`]).
    beside: Option<Beside>,
}

/// A rank in this endpoint's process: its messages go straight into its event queue, as its
/// connections' readers would put them there, rounded as the wire would round them, so that
/// what it reads has the bits it would have read over a connection.
struct Beside {
    rank: u32,
    events: Events,
}

impl Beside {
    /// `message` into this rank's event queue, its values rounded as a wire of `wire` would
    /// carry them.
    fn send(&self, mut message: Message, wire: WireDType) -> Result<(), TransportError> {
        if let Err(e) = message.tensor.host() {
            return Err(TransportError::unsent(message, e.to_string()));
        }
        crate::inproc::round_as_on_the_wire(&mut message, wire);
        self.events
            .send(Event::Message(message))
            .map_err(|unsent| match unsent.0 {
                Event::Message(m) => {
                    let reason = format!("worker {} is gone", m.key.to);
                    TransportError::unsent(m, reason)
                }
                _ => TransportError::Protocol("a message came back as another event".into()),
            })
    }
}

/// What a worker calls when its QUIC endpoint hears of a failure, set once.
type Alarm = Arc<std::sync::OnceLock<Box<dyn Fn(u32) + Send + Sync>>>;

/// Where the connection tasks report: the endpoint's event queue, and the alarm, rung as a
/// failure is queued (a peer's abort, a lost connection) rather than when the endpoint next
/// looks.
#[derive(Clone)]
struct Events {
    tx: Sender<Event>,
    alarm: Alarm,
}

impl Events {
    fn send(&self, event: Event) -> Result<(), crossbeam_channel::SendError<Event>> {
        let cause = match &event {
            Event::Aborted { by } => Some(*by),
            Event::Failed { peer, .. } => Some(*peer),
            _ => None,
        };
        if let (Some(by), Some(alarm)) = (cause, self.alarm.get()) {
            alarm(by);
        }
        self.tx.send(event)
    }
}

impl Quic {
    /// Calls `hook` with the rank a failure names as soon as this endpoint hears of it (a
    /// peer's abort, a connection lost), from the connection's task: what lets a worker that
    /// waits on another transport ([`crate::mixed::Mixed`]) stop at once. Set once; a second
    /// hook is ignored.
    pub fn on_failure(&self, hook: Box<dyn Fn(u32) + Send + Sync>) {
        let _ = self.alarm.set(hook);
    }

    /// The peers whose hellos named this worker's host (boot id and network namespace).
    pub fn peers_on_this_host(&self) -> Vec<u32> {
        (0..self.size)
            .filter(|&p| self.hosts.get(p as usize) == Some(&Some(self.host)))
            .collect()
    }

    /// The rank a failure of this endpoint names: the peer lost first, or the worker whose
    /// abort stopped this one.
    pub fn cause(&self) -> Option<u32> {
        self.failed.or(self.aborted_by)
    }

    /// [`Transport::abort`] naming `by` as the failure's cause: what an endpoint that holds
    /// this one among others ([`crate::mixed::Mixed`]) tells every peer.
    pub fn abort_as(&mut self, by: u32) {
        self.aborted_by.get_or_insert(by);
        self.told_abort = true;
        self.tell_all(RECORD_ABORT, by, false);
        if let Some(beside) = &self.beside {
            let _ = beside.events.send(Event::Aborted { by });
        }
    }
}

impl std::fmt::Debug for Quic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quic")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

/// Binds and connects `workers` endpoints on loopback, with fresh credentials: what tests,
/// benchmarks and local launches of one process use.
///
/// # Errors
/// As [`Bound::bind`] and [`Bound::connect`].
pub fn local_mesh(workers: u32, opts: &QuicOptions) -> Result<Vec<Quic>, TransportError> {
    let cluster = Cluster::generate(workers)?;
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let bound = cluster
        .ranks
        .iter()
        .enumerate()
        .map(|(r, (_, _, creds))| Bound::bind(r as u32, loopback, creds, opts.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    let addrs = bound
        .iter()
        .map(Bound::local_addr)
        .collect::<Result<Vec<_>, _>>()?;
    let handles: Vec<_> = bound
        .into_iter()
        .map(|b| {
            let addrs = addrs.clone();
            std::thread::spawn(move || b.connect(&addrs))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .map_err(|_| TransportError::Setup("a connecting thread panicked".into()))?
        })
        .collect()
}

impl Quic {
    fn aborted(&mut self, by: u32) -> TransportError {
        let by = *self.aborted_by.get_or_insert(by);
        TransportError::Aborted { by }
    }

    /// Applies one event; returns the message it carried, if any.
    fn apply(&mut self, event: Event) -> Result<Option<Message>, TransportError> {
        match event {
            Event::Message(m) => Ok(Some(m)),
            Event::StreamEnd { peer, kind } => {
                self.ended.insert((peer, kind));
                Ok(None)
            }
            Event::Finished { peer } => {
                self.finished_by.insert(peer);
                Ok(None)
            }
            Event::Aborted { by } => Err(self.aborted(by)),
            Event::Lost { peer } => {
                self.lost.insert(peer);
                Ok(None)
            }
            Event::Failed { peer, why } => {
                self.lost.insert(peer);
                self.failed.get_or_insert(peer);
                Err(TransportError::Lost { peer, why })
            }
            Event::Broken { peer, why } => {
                self.lost.insert(peer);
                Err(TransportError::Protocol(format!("worker {peer}: {why}")))
            }
        }
    }

    /// Waits for the message with `key` (taken, not yet handed) or, first, for another that
    /// arrives now and `notice` picks (`None`; kept in `early`).
    fn wait_on(
        &mut self,
        key: &Key,
        notice: &dyn Fn(&Key) -> bool,
    ) -> Result<Option<Message>, TransportError> {
        if key.to != self.rank {
            return Err(TransportError::Protocol(format!(
                "worker {} asked for a message addressed to {}",
                self.rank, key.to
            )));
        }
        if key.from >= self.size || key.from == self.rank {
            return Err(TransportError::Protocol(format!(
                "no peer {} for worker {} in a mesh of {}",
                key.from, self.rank, self.size
            )));
        }
        if let Some(m) = self.early.take(key) {
            return Ok(Some(m));
        }
        if let Some(by) = self.aborted_by {
            return Err(TransportError::Aborted { by });
        }
        let start = Instant::now();
        let deadline = crate::stall_deadline(self.opts.timeout, key, start);
        loop {
            if let Some(e) = self.gone(key.from, Some(key.kind)) {
                // Frames read before the stream ended are already in the channel.
                self.drain()?;
                return match self.early.take(key) {
                    Some(m) => Ok(Some(m)),
                    None => Err(e),
                };
            }
            let timer = match deadline {
                Some(d) => crossbeam_channel::at(d),
                None => never(),
            };
            let events = self.events.clone();
            select! {
                recv(events) -> event => {
                    let Ok(event) = event else {
                        return Err(TransportError::Closed { peer: key.from });
                    };
                    if let Some(m) = self.apply(event)? {
                        if m.key == *key {
                            return Ok(Some(m));
                        }
                        let noticed = notice(&m.key);
                        self.early.keep(m)?;
                        if noticed {
                            return Ok(None);
                        }
                    }
                }
                recv(timer) -> _ => {
                    return Err(TransportError::Timeout {
                        key: *key,
                        waited: start.elapsed(),
                    });
                }
            }
        }
    }

    /// `m`, handed to the program: its bytes no longer wait ([`QuicOptions::max_held_bytes`]).
    fn handed(&self, m: Message) -> Message {
        if let Some(Some(p)) = self.peers.get(m.key.from as usize) {
            let bytes = m.tensor.bytes() as u64;
            let _ = p.held.fetch_update(
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
                |h| Some(h.saturating_sub(bytes)),
            );
        }
        m
    }

    /// Ends the link to the rank beside this endpoint: it hears this rank's end as it would
    /// a connection's closing handshake, after every message sent before.
    fn part_from_beside(&mut self) {
        if let Some(beside) = self.beside.take() {
            let _ = beside.events.send(Event::Lost { peer: self.rank });
        }
    }

    /// Takes every event already waiting (messages are kept by key).
    fn drain(&mut self) -> Result<(), TransportError> {
        while let Ok(event) = self.events.try_recv() {
            if let Some(m) = self.apply(event)? {
                self.early.keep(m)?;
            }
        }
        Ok(())
    }

    /// Why nothing more can come from `peer` on `kind`, if so.
    fn gone(&self, peer: u32, kind: Option<Kind>) -> Option<TransportError> {
        if self.lost.contains(&peer) {
            return Some(TransportError::Closed { peer });
        }
        let ended = match kind {
            Some(k) => self.ended.contains(&(peer, k)),
            None => KINDS.iter().any(|&k| self.ended.contains(&(peer, k))),
        };
        ended.then_some(TransportError::Closed { peer })
    }

    fn runtime(&self) -> Result<&tokio::runtime::Runtime, TransportError> {
        self.runtime
            .as_ref()
            .ok_or_else(|| TransportError::Protocol("endpoint already closed".into()))
    }

    /// Sends one control record to every connected peer; waits for the writes when `wait`.
    fn tell_all(&self, record: u8, value: u32, wait: bool) {
        let Ok(rt) = self.runtime() else { return };
        let mut bytes = vec![record];
        bytes.extend_from_slice(&value.to_le_bytes());
        let tasks: Vec<_> = self
            .peers
            .iter()
            .flatten()
            .map(|p| {
                let control = p.control.clone();
                let bytes = bytes.clone();
                rt.spawn(async move {
                    let _ = control.lock().await.write_all(&bytes).await;
                })
            })
            .collect();
        if wait {
            rt.block_on(async {
                for t in tasks {
                    let _ = tokio::time::timeout(Duration::from_secs(1), t).await;
                }
            });
        }
    }

    /// Bytes this endpoint's connections have sent and received so far, keep-alives included:
    /// the close's measure of whether anything is still moving.
    fn bytes_moved(&self) -> u64 {
        self.peers
            .iter()
            .flatten()
            .map(|p| {
                let stats = p.conn.stats();
                stats.udp_tx.bytes + stats.udp_rx.bytes
            })
            .sum()
    }

    /// The closing handshake (see the module documentation), bounded by `linger` without
    /// progress.
    fn shutdown(&mut self, linger: Duration) {
        if self.closed {
            return;
        }
        self.closed = true;
        self.part_from_beside();
        let deadline = Instant::now() + linger;
        let aborted = self.aborted_by.is_some();
        for p in self.peers.iter_mut().flatten() {
            p.data = [None, None, None, None];
        }
        // Every peer's readers confirm (an `F` record) once they have read this worker's
        // finished streams to the end; a peer that has gone needs nothing more.
        // A rank absent from the mesh (a lost worker the survivors connected without) has
        // nothing to confirm.
        let others: Vec<u32> = (0..self.size)
            .filter(|&p| p != self.rank && self.peers.get(p as usize).is_some_and(Option::is_some))
            .collect();
        // The linger bounds a wait in which nothing moves, not the transfer: a large message
        // still on its way when the close began (or a peer still reading it) keeps the wait
        // going for as long as bytes keep flowing.
        let mut deadline = deadline;
        let window = linger.min(CLOSE_PROGRESS_WINDOW);
        let enough = (CLOSE_PROGRESS_RATE as f64 * window.as_secs_f64()) as u64;
        let mut measured = (Instant::now(), self.bytes_moved());
        loop {
            if measured.0.elapsed() >= window {
                let moved = self.bytes_moved();
                if moved > measured.1 + enough {
                    deadline = Instant::now() + linger;
                }
                measured = (Instant::now(), moved);
            }
            if aborted || Instant::now() >= deadline {
                break;
            }
            let _ = self.drain();
            // A peer whose connection has closed confirms nothing more: QUIC has discarded
            // what it did not read. That includes a lost rank hosted on a survivor's
            // connection, whose host closed it before the hosted rank finished its control
            // stream: its end came as no record, and the close waited out the whole linger.
            let closed = |p: u32| {
                self.peers
                    .get(p as usize)
                    .and_then(Option::as_ref)
                    .is_some_and(|peer| peer.conn.close_reason().is_some())
            };
            let done = others
                .iter()
                .all(|&p| self.finished_by.contains(&p) || self.lost.contains(&p) || closed(p));
            if done {
                break;
            }
            if let Ok(event) = self.events.recv_timeout(Duration::from_millis(20)) {
                let _ = self.apply(event).map(|m| m.map(|m| self.early.keep(m)));
            }
        }
        let Some(rt) = self.runtime.take() else {
            return;
        };
        let writers: Vec<_> = self
            .peers
            .iter_mut()
            .flatten()
            .flat_map(|p| p.writers.drain(..))
            .collect();
        rt.block_on(async {
            for w in writers {
                let _ = tokio::time::timeout(Duration::from_millis(200), w).await;
            }
        });
        let (code, reason) = match self.aborted_by {
            Some(by) => (CLOSE_ABORT, by.to_le_bytes().to_vec()),
            None => (CLOSE_DONE, b"done".to_vec()),
        };
        for p in self.peers.iter().flatten() {
            if p.shares_conn {
                // The connection is another rank's: its end is this peer's loss there.
                let control = p.control.clone();
                rt.block_on(async move {
                    let _ = control.lock().await.finish();
                });
            } else {
                p.conn.close(code.into(), &reason);
            }
        }
        let endpoint = self.endpoint.clone();
        rt.block_on(async {
            let _ = tokio::time::timeout(Duration::from_millis(500), endpoint.wait_idle()).await;
        });
        rt.shutdown_timeout(Duration::from_millis(100));
    }
}

impl Transport for Quic {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    fn send(&mut self, message: Message) -> Result<(), TransportError> {
        self.drain()?;
        if let Some(by) = self.aborted_by {
            return Err(TransportError::Aborted { by });
        }
        let to = message.key.to;
        if to == self.rank || to >= self.size {
            let reason = format!(
                "no peer {to} for worker {} in a mesh of {}",
                self.rank, self.size
            );
            return Err(TransportError::unsent(message, reason));
        }
        if let Some(e) = self.gone(to, None) {
            return Err(TransportError::unsent(message, e.to_string()));
        }
        if let Some(beside) = self.beside.as_ref().filter(|b| b.rank == to) {
            return beside.send(message, self.opts.wire);
        }
        let slot = kind_slot(message.key.kind);
        let Some(tx) = self.peers[to as usize]
            .as_ref()
            .and_then(|p| p.data[slot].clone())
        else {
            return Err(TransportError::unsent(message, "endpoint closed"));
        };
        if let Err(e) = message.tensor.host() {
            return Err(TransportError::unsent(message, e.to_string()));
        }
        let wire = match message.key.kind {
            // A chunk of a bf16 all-reduce holds bf16 values: two bytes each, losslessly.
            Kind::Chunk if message.tensor.host().is_ok_and(frame::exact_in_bf16) => WireDType::Bf16,
            kind => crate::inproc::wire_for(kind, self.opts.wire),
        };
        let header = frame::header_of(&message, self.opts.run_id, wire);
        let head = match frame::encode_header(&header) {
            Ok(h) => h,
            Err(e) => return Err(TransportError::unsent(message, e.to_string())),
        };
        let values = message.tensor.into_host_vec().unwrap_or_default();
        let frame = [bytes::Bytes::from(head), frame::payload(values, wire)];
        match tx.try_send(frame) {
            Ok(()) => Ok(()),
            Err(tokio::sync::mpsc::error::TrySendError::Closed(frame)) => {
                self.drain()?;
                Err(send_failed(
                    &header,
                    &frame,
                    format!("the stream to worker {to} failed"),
                ))
            }
            Err(tokio::sync::mpsc::error::TrySendError::Full(frame)) => {
                self.send_when_room(&header, &tx, frame)
            }
        }
    }

    fn recv(&mut self, key: &Key) -> Result<Message, TransportError> {
        loop {
            if let Some(m) = self.wait_on(key, &|_| false)? {
                return Ok(self.handed(m));
            }
        }
    }

    fn wait_for(
        &mut self,
        key: &Key,
        notice: &dyn Fn(&Key) -> bool,
    ) -> Result<bool, TransportError> {
        match self.wait_on(key, notice)? {
            Some(m) => {
                self.early.keep(m)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn try_recv(&mut self, key: &Key) -> Result<Option<Message>, TransportError> {
        if key.to != self.rank || key.from >= self.size || key.from == self.rank {
            return Err(TransportError::Protocol(format!(
                "worker {} cannot receive {key:?}",
                self.rank
            )));
        }
        self.drain()?;
        if let Some(m) = self.early.take(key) {
            return Ok(Some(self.handed(m)));
        }
        if let Some(by) = self.aborted_by {
            return Err(TransportError::Aborted { by });
        }
        Ok(None)
    }

    fn buffered(&self) -> usize {
        self.early.len()
    }

    fn abort(&mut self) {
        // A worker stopping because a peer died names that peer, not itself.
        self.abort_as(self.failed.unwrap_or(self.rank));
    }

    fn close(&mut self) -> Result<(), TransportError> {
        if self.told_abort {
            // Let the abort records reach the peers before the connections close.
            let by = self.aborted_by.unwrap_or(self.rank);
            self.tell_all(RECORD_ABORT, by, true);
        }
        let linger = self.opts.linger;
        self.shutdown(linger);
        Ok(())
    }

    fn interrupter(&self) -> Option<crate::Interrupter> {
        let tx = self.interrupt.clone();
        Some(crate::Interrupter(Arc::new(move |peer| {
            let why = "its process ended (its launcher reaped it)".to_string();
            let _ = tx.send(Event::Failed { peer, why });
        })))
    }

    fn regroup_address(&mut self) -> Option<Result<String, TransportError>> {
        Some(self.ready_to_regroup().map(|a| a.to_string()))
    }

    fn regroup(&mut self, lost: u32, host: Option<u32>) -> Result<Regrouped, TransportError> {
        let (mesh, hosted) = self.regrouped(lost, host)?;
        Ok((
            Box::new(mesh),
            hosted.map(|h| Box::new(h) as Box<dyn Transport + Send>),
        ))
    }

    fn cut_link(&mut self, peer: u32, pause: Duration) -> Result<(), TransportError> {
        let addr = self
            .peers
            .get(peer as usize)
            .and_then(Option::as_ref)
            .map(|p| p.conn.remote_address())
            .ok_or_else(|| {
                TransportError::Setup(format!(
                    "worker {} has no link to worker {peer} to cut",
                    self.rank
                ))
            })?;
        self.cuts.cut(addr, std::time::Instant::now() + pause);
        Ok(())
    }
    fn carries_device_tensors(&self) -> bool {
        false
    }
    /// QUIC reaches other hosts, so nothing is lent over it.
    fn lends_device_buffers(&self, _: u32) -> bool {
        false
    }
    fn copies_payloads(&self) -> bool {
        false
    }
    fn link_buffer_bytes(&self) -> Option<u64> {
        None
    }
}

impl Quic {
    /// Waits for room in a full stream queue (back-pressure), watching for aborts and lost
    /// peers between waits.
    fn send_when_room(
        &mut self,
        header: &frame::Header,
        tx: &tokio::sync::mpsc::Sender<Frame>,
        frame: Frame,
    ) -> Result<(), TransportError> {
        let to = header.to;
        loop {
            self.drain()?;
            if let Some(by) = self.aborted_by {
                return Err(TransportError::Aborted { by });
            }
            if let Some(e) = self.gone(to, None) {
                return Err(send_failed(header, &frame, e.to_string()));
            }
            let permit = self.runtime()?.block_on(async {
                tokio::time::timeout(Duration::from_millis(20), tx.reserve()).await
            });
            match permit {
                Ok(Ok(p)) => {
                    p.send(frame);
                    return Ok(());
                }
                Ok(Err(_)) => {
                    let reason = format!("the stream to worker {to} failed");
                    return Err(send_failed(header, &frame, reason));
                }
                Err(_) => continue,
            }
        }
    }
}

/// The error for a frame that could not be sent, with its message rebuilt from the frame (the
/// tensor was handed to the frame without a copy; a bf16 wire hands back rounded values).
fn send_failed(header: &frame::Header, frame: &Frame, reason: String) -> TransportError {
    match frame::payload_into_message(header, &frame[1]) {
        Ok(message) => TransportError::unsent(message, reason),
        Err(e) => TransportError::Protocol(format!("{reason}; the message is lost: {e}")),
    }
}

impl Drop for Quic {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        // Finish on a background thread, so that dropping one endpoint never waits for a peer
        // that the same thread would drop next.
        let mut me = Quic {
            rank: self.rank,
            size: self.size,
            runtime: self.runtime.take(),
            endpoint: self.endpoint.clone(),
            peers: std::mem::take(&mut self.peers),
            events: self.events.clone(),
            early: Early::default(),
            ended: std::mem::take(&mut self.ended),
            finished_by: std::mem::take(&mut self.finished_by),
            lost: std::mem::take(&mut self.lost),
            failed: self.failed,
            aborted_by: self.aborted_by,
            told_abort: self.told_abort,
            opts: self.opts.clone(),
            closed: false,
            cuts: self.cuts.clone(),
            host: self.host,
            hosts: std::mem::take(&mut self.hosts),
            alarm: self.alarm.clone(),
            interrupt: self.interrupt.clone(),
            beside: self.beside.take(),
        };
        self.closed = true;
        if me.runtime.is_none() {
            return;
        }
        let linger = me.opts.linger;
        let _ = std::thread::Builder::new()
            .name(format!("pipe-quic-close-{}", me.rank))
            .spawn(move || {
                if me.told_abort {
                    let by = me.aborted_by.unwrap_or(me.rank);
                    me.tell_all(RECORD_ABORT, by, true);
                }
                me.shutdown(linger);
            });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use std::sync::Mutex;

    #[test]
    fn a_receive_buffer_holds_the_largest_gro_list_and_no_more() {
        let segments = receive_segments(64);
        let per_buffer = segments * usize::from(MTU_UPPER_BOUND);
        // Room for a default kernel's largest list (64 KiB, more than a loopback GSO send)...
        const { assert!(GSO_BATCH_BYTES <= 65_536 && RECEIVE_LIST_BYTES >= 65_536) };
        assert!(per_buffer >= RECEIVE_LIST_BYTES);
        // ...in a twentieth of what 64 segments of the largest payload took.
        assert!(segments * 20 <= 64);
        // Without GRO one datagram per buffer, as quinn asks.
        assert_eq!(receive_segments(1), 1);
    }

    /// A socket that records each send's length and segment size, and fails the sends whose
    /// numbers are listed.
    #[derive(Debug, Default)]
    struct Recorder {
        sends: Mutex<Vec<(usize, Option<usize>)>>,
        fail: Vec<usize>,
    }

    #[derive(Debug)]
    struct Ready;

    impl quinn::UdpPoller for Ready {
        fn poll_writable(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    impl quinn::AsyncUdpSocket for Recorder {
        fn create_io_poller(self: Arc<Self>) -> std::pin::Pin<Box<dyn quinn::UdpPoller>> {
            Box::pin(Ready)
        }

        fn try_send(&self, t: &quinn::udp::Transmit) -> std::io::Result<()> {
            let mut sends = self.sends.lock().unwrap();
            if self.fail.contains(&sends.len()) {
                sends.push((0, None));
                return Err(std::io::ErrorKind::WouldBlock.into());
            }
            sends.push((t.contents.len(), t.segment_size));
            Ok(())
        }

        fn poll_recv(
            &self,
            _: &mut std::task::Context,
            _: &mut [std::io::IoSliceMut<'_>],
            _: &mut [quinn::udp::RecvMeta],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::task::Poll::Pending
        }

        fn local_addr(&self) -> std::io::Result<SocketAddr> {
            Ok(SocketAddr::from(([127, 0, 0, 1], 9)))
        }
    }

    fn send(
        fail: Vec<usize>,
        len: usize,
        segment: Option<usize>,
    ) -> (std::io::Result<()>, Vec<(usize, Option<usize>)>) {
        use quinn::AsyncUdpSocket;
        let inner = Arc::new(Recorder {
            fail,
            ..Recorder::default()
        });
        let socket = BatchBounded {
            inner: inner.clone(),
            cuts: Cuts::default(),
        };
        let contents = vec![0u8; len];
        let transmit = quinn::udp::Transmit {
            destination: SocketAddr::from(([127, 0, 0, 1], 10)),
            ecn: None,
            contents: &contents,
            segment_size: segment,
            src_ip: None,
        };
        let result = socket.try_send(&transmit);
        let sends = inner.sends.lock().unwrap().clone();
        (result, sends)
    }

    #[test]
    fn gso_batches_are_cut_to_what_one_send_takes() {
        // Ten datagrams of 32,000 bytes, the last one short: five sends of at most two.
        let (r, sends) = send(vec![], 9 * 32_000 + 100, Some(32_000));
        assert!(r.is_ok());
        assert_eq!(
            sends,
            vec![
                (64_000, Some(32_000)),
                (64_000, Some(32_000)),
                (64_000, Some(32_000)),
                (64_000, Some(32_000)),
                (32_100, Some(32_000)),
            ]
        );
        // A batch that fits, and a single datagram, pass untouched.
        assert_eq!(
            send(vec![], 10 * 1_452, Some(1_452)).1,
            vec![(14_520, Some(1_452))]
        );
        assert_eq!(send(vec![], 40_000, None).1, vec![(40_000, None)]);
        // A last part of one datagram goes without a segment size.
        let (_, sends) = send(vec![], 2 * 40_000 + 10, Some(40_000));
        assert_eq!(sends, vec![(40_000, None), (40_000, None), (10, None)]);
    }

    #[test]
    fn a_cut_link_drops_datagrams_until_it_heals() {
        use quinn::AsyncUdpSocket;
        let inner = Arc::new(Recorder::default());
        let socket = BatchBounded {
            inner: inner.clone(),
            cuts: Cuts::default(),
        };
        let contents = vec![0u8; 100];
        let to = |port: u16| quinn::udp::Transmit {
            destination: SocketAddr::from(([127, 0, 0, 1], port)),
            ecn: None,
            contents: &contents,
            segment_size: None,
            src_ip: None,
        };
        socket.cuts.cut(
            SocketAddr::from(([127, 0, 0, 1], 10)),
            std::time::Instant::now() + Duration::from_millis(200),
        );
        // Dropped, as across a partition, yet reported sent; another peer is reached.
        assert!(socket.try_send(&to(10)).is_ok());
        assert!(socket.try_send(&to(11)).is_ok());
        assert_eq!(inner.sends.lock().unwrap().len(), 1);
        // The same peer as an IPv4-mapped IPv6 address is cut too.
        let mapped = SocketAddr::new("::ffff:127.0.0.1".parse().unwrap(), 10);
        assert!(socket.cuts.is_cut(mapped));
        std::thread::sleep(Duration::from_millis(250));
        assert!(socket.try_send(&to(10)).is_ok());
        assert_eq!(inner.sends.lock().unwrap().len(), 2);
        assert!(
            socket.cuts.0.lock().unwrap().is_empty(),
            "healed cuts are forgotten"
        );
    }

    fn message(from: u32, to: u32, index: u32, values: usize) -> Message {
        Message {
            key: crate::measure::key(from, to, index),
            version: 0,
            tensor: pipe_kernels::Tensor::zeros(&[values]),
        }
    }

    /// What waits for a worker's receives is bounded per peer: received messages stop
    /// counting, and a peer past the bound is a protocol error naming it, not memory without
    /// end.
    #[test]
    fn bytes_waiting_for_receives_are_bounded_per_peer() {
        let mut opts = QuicOptions::new(7);
        opts.max_held_bytes = 3 << 19; // 1.5 MiB: one 1 MiB message at a time.
        opts.timeout = Some(Duration::from_secs(20));
        let mut eps = local_mesh(2, &opts).unwrap();
        let mut b = eps.pop().unwrap();
        let mut a = eps.pop().unwrap();
        let mib = 1 << 18;
        // Received one by one, eight messages of 1 MiB pass a bound of 1.5 MiB.
        for i in 0..8 {
            a.send(message(0, 1, i, mib)).unwrap();
            b.recv(&message(0, 1, i, 0).key).unwrap();
            b.send(message(1, 0, i, 1)).unwrap();
            a.recv(&message(1, 0, i, 0).key).unwrap();
        }
        // Sent and never received: the second is past the bound. The receiver closes the
        // connection once it is, so a later send may find it closed, naming the bound.
        for i in 100..103 {
            match a.send(message(0, 1, i, mib)) {
                Ok(()) => {}
                Err(TransportError::Lost { why, .. })
                    if i > 100 && why.contains("past the bound") =>
                {
                    break;
                }
                Err(e) => panic!("send {i}: {e}"),
            }
        }
        let err = b.recv(&message(0, 1, 999, 0).key).unwrap_err();
        assert!(
            matches!(&err, TransportError::Protocol(why) if why.contains("past the bound")),
            "{err}"
        );
    }

    /// Binds every rank of a fresh cluster on loopback, each with `opts`.
    fn bind_all(workers: u32, opts: &QuicOptions) -> (Vec<Bound>, Vec<SocketAddr>) {
        let cluster = Cluster::generate(workers).unwrap();
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        let bound: Vec<Bound> = cluster
            .ranks
            .iter()
            .enumerate()
            .map(|(r, (_, _, creds))| Bound::bind(r as u32, loopback, creds, opts.clone()).unwrap())
            .collect();
        let addrs = bound.iter().map(|b| b.local_addr().unwrap()).collect();
        (bound, addrs)
    }

    /// Rank 1 finishes the QUIC handshake at once but greets only after 3 s, longer than a
    /// dial attempt's handshake timer. Rank 0 keeps that first connection and greets on it: a
    /// dialler that dropped it on a timer would leave rank 1 holding a dead connection (the
    /// two-host test's failure), and rank 1 would see a second one.
    #[test]
    fn a_peer_that_greets_late_is_kept_on_its_first_connection() {
        let mut opts = QuicOptions::new(12);
        opts.connect_timeout = Duration::from_secs(10);
        let (mut bound, addrs) = bind_all(2, &opts);
        let late = bound.pop().unwrap();
        let dialler = bound.pop().unwrap();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let accepting = std::thread::spawn(move || {
            late.runtime.block_on(async {
                let conn = late.endpoint.accept().await.unwrap().await.unwrap();
                tokio::time::sleep(DIAL_HANDSHAKE_TIMEOUT + Duration::from_secs(1)).await;
                let host = HostId::current().unwrap();
                let greeted = greet(&conn, 1, 12, &host).await.map(|g| g.0);
                // Keep the connection open until the dialler is done, and count the others.
                let _ = tokio::task::spawn_blocking(move || done_rx.recv()).await;
                let again =
                    tokio::time::timeout(Duration::from_millis(200), late.endpoint.accept());
                (greeted, again.await.is_ok())
            })
        });
        let dialled = dialler.connect(&addrs).map(|_| ());
        done_tx.send(()).unwrap();
        let (greeted, second) = accepting.join().unwrap();
        assert!(dialled.is_ok(), "{dialled:?}");
        assert_eq!(greeted.unwrap(), 0);
        assert!(!second, "the dialler opened a second connection");
    }

    /// A peer that completes the QUIC handshake and then says nothing holds up no other:
    /// rank 1 greets the real rank 0 while the silent one waits.
    #[test]
    fn a_silent_connection_holds_up_no_other_peer() {
        let mut opts = QuicOptions::new(13);
        opts.connect_timeout = Duration::from_secs(8);
        let (mut bound, addrs) = bind_all(2, &opts);
        let acceptor = bound.pop().unwrap();
        let dialler = bound.pop().unwrap();
        let accepting = std::thread::spawn({
            let addrs = addrs.clone();
            move || acceptor.connect(&addrs).map(|_| ())
        });
        // The silent peer holds rank 0's certificate, so its handshake succeeds.
        let silent = dialler.runtime.block_on(async {
            let connecting = dialler
                .endpoint
                .connect_with(dialler.client.clone(), addrs[1], &server_name(1))
                .unwrap();
            connecting.await.unwrap()
        });
        let start = Instant::now();
        let dialled = dialler.connect(&addrs).map(|_| ());
        let accepted = accepting.join().unwrap();
        assert!(
            dialled.is_ok() && accepted.is_ok(),
            "{dialled:?} {accepted:?}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        drop(silent);
    }

    /// Rank 2 never starts. Rank 1 gives up at its own connect timeout (1 s) and closes the
    /// connection it had made to rank 0 saying why; rank 0, whose timeout is 30 s, stops at
    /// once, naming rank 1 and its reason.
    #[test]
    fn a_worker_failing_while_connecting_stops_its_peers_at_once() {
        let cluster = Cluster::generate(3).unwrap();
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        let bound: Vec<Bound> = cluster
            .ranks
            .iter()
            .enumerate()
            .map(|(r, (_, _, creds))| {
                let mut opts = QuicOptions::new(11);
                opts.connect_timeout = Duration::from_secs(if r == 1 { 1 } else { 30 });
                Bound::bind(r as u32, loopback, creds, opts).unwrap()
            })
            .collect();
        let addrs: Vec<SocketAddr> = bound.iter().map(|b| b.local_addr().unwrap()).collect();
        let start = Instant::now();
        let handles: Vec<_> = bound
            .into_iter()
            .take(2)
            .map(|b| {
                let addrs = addrs.clone();
                std::thread::spawn(move || (b.connect(&addrs).map(|_| ()), start.elapsed()))
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let err = |r: usize| results[r].0.as_ref().unwrap_err().to_string();
        assert!(err(1).contains("could not connect to rank 2"), "{}", err(1));
        assert!(
            err(0).contains("rank 1 failed while connecting")
                && err(0).contains("could not connect to rank 2"),
            "{}",
            err(0)
        );
        assert!(
            results[0].1 < Duration::from_secs(10),
            "rank 0 took {:?}",
            results[0].1
        );
    }

    #[test]
    fn a_cut_batch_reports_blocking_only_before_anything_left() {
        let (r, sends) = send(vec![0], 4 * 32_000, Some(32_000));
        assert_eq!(r.unwrap_err().kind(), std::io::ErrorKind::WouldBlock);
        assert_eq!(sends.len(), 1);
        // Once part has left, the rest is dropped (QUIC resends it as lost).
        let (r, sends) = send(vec![1], 6 * 32_000, Some(32_000));
        assert!(r.is_ok());
        assert_eq!(sends.len(), 2);
    }
}
