//! Plain TCP between workers, for trusted networks: one connection per pair of workers, no
//! encryption (gloo's default between hosts), so a link costs the socket's copies and no TLS
//! processor time. Messages travel in QUIC's frame format ([`crate::frame`]): the same
//! header, the same payload encoding and the same checks on what a peer sends, so a run's
//! bits are those of every other transport.
//!
//! Each connection is read by a thread of its own that decodes frames into a channel, so a
//! peer's socket is always drained (a ring all-reduce sends a whole chunk's pieces before it
//! receives, as QUIC's receiving side takes them); a receive waits on that channel, the control
//! channel (aborts) and the stall timer at once and keeps early messages by key. A send
//! writes its frame on the caller's thread: a peer that reads slowly holds the sender back.
//! On the stream each frame is preceded by a tag byte: a message, or an abort naming the
//! worker that failed. An abort also shuts every link's writing side, so a send blocked on a
//! full socket returns at once.
//!
//! Connecting: every worker listens; rank `i` connects to every rank below it and accepts
//! every rank above it. A connection opens with a hello (magic, run id, the two ranks) that
//! the acceptor checks and answers; a connection from another run, or naming a rank that is
//! not its peer, is closed and the wait goes on.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, unbounded};

use crate::frame::{self, FrameLimits, PREFIX_BYTES, PayloadBuffer, WireDType};
use crate::inbox::Inbox;
use crate::inproc::wire_for;
use crate::registration::{BoundEndpoint, Endpoint, Joined, MeshSettings, Registration};
use crate::{Key, Message, Transport, TransportError};

/// The registration of plain TCP ([`crate::kinds::TRANSPORTS`]).
pub const REGISTRATION: Registration = Registration {
    name: "tcp",
    about: "plain TCP, no encryption (trusted networks)",
    link_description: Some("TCP on loopback"),
    cuts_links: false,
    networked: true,
    crosses_processes: true,
    measured_messages: 1000,
    thread_mesh: |workers, settings| {
        let eps = local_mesh(workers, &TcpOptions::from(settings))?;
        Ok(eps.into_iter().map(|e| Box::new(e) as Endpoint).collect())
    },
    bind: Some(|cluster, rank, at, settings| {
        let bound = TcpBound::bind(rank, cluster.size(), at.addr, TcpOptions::from(settings))?;
        Ok(Box::new(bound))
    }),
};

/// The first bytes of a connection's hello.
const HELLO_MAGIC: [u8; 4] = *b"PTCP";

/// The hello's length: magic, run id, from, to.
const HELLO_BYTES: usize = 4 + 8 + 4 + 4;

/// The tag before a frame.
const TAG_MESSAGE: u8 = 0;

/// The tag before an abort (then the failed worker's rank, u32 LE).
const TAG_ABORT: u8 = 1;

/// How long a hello may take once a connection is open.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepted connections whose hellos are read at once; more are closed unread.
const MAX_PENDING_HELLOS: usize = 64;

/// A joined link's keep-alive: how long it may be silent before the kernel probes the peer,
/// the time between probes, and how many go unanswered before the link ends. A host lost
/// without a word (no FIN, no reset) is noticed in about 25 s, where a worker waiting on a
/// control record from it, a wait with no stall bound, waited for ever.
const KEEPALIVE: (Duration, Duration, u32) = (Duration::from_secs(10), Duration::from_secs(5), 3);

/// Turns [`KEEPALIVE`] on for `s`.
fn keep_alive(s: &TcpStream) -> std::io::Result<()> {
    use rustix::net::sockopt;
    sockopt::set_socket_keepalive(s, true)?;
    #[cfg(target_os = "linux")]
    {
        sockopt::set_tcp_keepidle(s, KEEPALIVE.0)?;
        sockopt::set_tcp_keepintvl(s, KEEPALIVE.1)?;
        sockopt::set_tcp_keepcnt(s, KEEPALIVE.2)?;
    }
    Ok(())
}

/// Options of a TCP endpoint.
#[derive(Clone, Debug)]
pub struct TcpOptions {
    /// The run every peer and frame must belong to.
    pub run_id: u64,
    /// Element type of activations and gradients on the wire.
    pub wire: WireDType,
    /// How long a receive of data waits (the stall bound); `None`: without bound.
    pub timeout: Option<Duration>,
    /// How long connecting waits for peers that start late.
    pub connect_timeout: Duration,
    /// How long [`Transport::close`] waits for peers to close their ends.
    pub linger: Duration,
    /// The most bytes of one peer's messages held for receives that have not asked for
    /// them yet (decoded and in the link's channel or kept early), as over QUIC
    /// ([`crate::quic::QuicOptions::max_held_bytes`]): a peer past it ends its link.
    pub max_held_bytes: u64,
}

impl TcpOptions {
    /// Options of run `run_id`: f32 on the wire, no stall bound, 30 s to connect.
    pub fn new(run_id: u64) -> Self {
        TcpOptions {
            run_id,
            wire: WireDType::F32,
            timeout: None,
            connect_timeout: Duration::from_secs(30),
            linger: Duration::from_secs(10),
            max_held_bytes: crate::quic::DEFAULT_MAX_HELD_BYTES,
        }
    }
}

impl From<&MeshSettings> for TcpOptions {
    fn from(s: &MeshSettings) -> Self {
        TcpOptions {
            wire: s.wire,
            timeout: s.timeout,
            connect_timeout: s.connect_timeout,
            ..TcpOptions::new(s.run_id)
        }
    }
}

fn setup(what: impl std::fmt::Display) -> TransportError {
    TransportError::Setup(format!("tcp: {what}"))
}

/// A worker's listening socket, before it knows its peers.
pub struct TcpBound {
    rank: u32,
    size: u32,
    listener: TcpListener,
    opts: TcpOptions,
}

impl TcpBound {
    /// Listens at `addr` as rank `rank` of `size` workers.
    ///
    /// # Errors
    /// [`TransportError::Setup`] when the address cannot be bound.
    pub fn bind(
        rank: u32,
        size: u32,
        addr: SocketAddr,
        opts: TcpOptions,
    ) -> Result<Self, TransportError> {
        if rank >= size {
            return Err(setup(format!("rank {rank} in a run of {size} workers")));
        }
        let listener = TcpListener::bind(addr).map_err(|e| TransportError::binding(addr, &e))?;
        Ok(TcpBound {
            rank,
            size,
            listener,
            opts,
        })
    }

    /// The address it listens at.
    ///
    /// # Errors
    /// [`TransportError::Setup`] if the socket has no address.
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        self.listener.local_addr().map_err(setup)
    }

    /// Connects to every other worker (`addrs[r]`: rank r's address): to those below this
    /// rank, and accepting those above it.
    ///
    /// # Errors
    /// [`TransportError::Setup`] naming a peer that never connected in time.
    pub fn connect(self, addrs: &[SocketAddr]) -> Result<Tcp, TransportError> {
        if addrs.len() != self.size as usize {
            return Err(setup(format!(
                "{} addresses for {} workers",
                addrs.len(),
                self.size
            )));
        }
        let deadline = Instant::now() + self.opts.connect_timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..self.size).map(|_| None).collect();
        for peer in 0..self.rank {
            streams[peer as usize] = Some(self.dial(peer, addrs[peer as usize], deadline)?);
        }
        self.accept_above(&mut streams, deadline)?;
        let streams = streams
            .into_iter()
            .enumerate()
            .map(|(p, s)| match s {
                Some(s) => Ok(Some(s)),
                None if p as u32 == self.rank => Ok(None),
                None => Err(setup(format!("worker {p} never connected"))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Tcp::start(self.rank, streams, &self.opts)
    }

    /// Connects to `peer` at `addr`, retrying until `deadline` (it may start late).
    fn dial(
        &self,
        peer: u32,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Result<TcpStream, TransportError> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let attempt = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1)))
                .map_err(|e| e.to_string())
                .and_then(|s| {
                    self.greet(&s, peer).map_err(|e| e.to_string())?;
                    Ok(s)
                });
            match attempt {
                Ok(s) => return Ok(s),
                Err(why) if Instant::now() >= deadline => {
                    return Err(setup(format!("worker {peer} at {addr}: {why}")));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// Sends this side's hello to `peer` on `s` and checks its answer.
    fn greet(&self, s: &TcpStream, peer: u32) -> Result<(), TransportError> {
        s.set_read_timeout(Some(HELLO_TIMEOUT)).map_err(setup)?;
        (&*s)
            .write_all(&hello(self.opts.run_id, self.rank, peer))
            .map_err(setup)?;
        let (from, to) = read_hello(s, self.opts.run_id)?;
        if (from, to) != (peer, self.rank) {
            return Err(setup(format!("worker {peer} answered as {from} to {to}")));
        }
        s.set_read_timeout(None).map_err(setup)?;
        Ok(())
    }

    /// Accepts every rank above this one until `deadline`; connections that are not a
    /// missing peer of this run are closed. Each accepted connection's hello is read on a
    /// thread of its own, so a stranger that connects and says nothing holds up only itself
    /// (until [`HELLO_TIMEOUT`]), never the peers behind it; at most [`MAX_PENDING_HELLOS`]
    /// wait at once, and connections beyond them are closed at once.
    fn accept_above(
        &self,
        streams: &mut [Option<TcpStream>],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        self.listener.set_nonblocking(true).map_err(setup)?;
        let missing = |streams: &[Option<TcpStream>]| {
            (self.rank + 1..self.size).find(|&p| streams[p as usize].is_none())
        };
        let (greeted_tx, greeted) = unbounded::<(TcpStream, (u32, u32))>();
        let pending = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        while let Some(waiting) = missing(streams) {
            while let Ok((s, (from, to))) = greeted.try_recv() {
                if self.welcome(&s, from, to, streams) {
                    streams[from as usize] = Some(s);
                }
            }
            match self.listener.accept() {
                Ok((s, _)) => self.read_hello_apart(s, &greeted_tx, &pending),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(setup(format!(
                            "worker {waiting} never connected to worker {}",
                            self.rank
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(setup(e)),
            }
        }
        Ok(())
    }

    /// Reads the hello of accepted connection `s` on a thread of its own and hands the
    /// connection with its (from, to) to `greeted`; a connection that sends no hello of this
    /// run in [`HELLO_TIMEOUT`] is dropped (closed).
    fn read_hello_apart(
        &self,
        s: TcpStream,
        greeted: &Sender<(TcpStream, (u32, u32))>,
        pending: &Arc<std::sync::atomic::AtomicUsize>,
    ) {
        use std::sync::atomic::Ordering;
        if pending.fetch_add(1, Ordering::SeqCst) >= MAX_PENDING_HELLOS {
            pending.fetch_sub(1, Ordering::SeqCst);
            return;
        }
        let (greeted, waiting, run_id) = (greeted.clone(), pending.clone(), self.opts.run_id);
        let spawned = std::thread::Builder::new()
            .name("tcp-hello".into())
            .spawn(move || {
                let ready = s.set_nonblocking(false).is_ok()
                    && s.set_read_timeout(Some(HELLO_TIMEOUT)).is_ok();
                if let Some(hello) = ready.then(|| read_hello(&s, run_id).ok()).flatten() {
                    let _ = greeted.send((s, hello));
                }
                waiting.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            // No thread for it: the connection was dropped with the closure.
            pending.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Takes a greeted connection from `from` to `to` if it is a missing peer above this rank
    /// of this run, answering its hello; `false` closes it.
    fn welcome(&self, s: &TcpStream, from: u32, to: u32, streams: &[Option<TcpStream>]) -> bool {
        let wanted = to == self.rank
            && from > self.rank
            && from < self.size
            && streams[from as usize].is_none();
        wanted
            && (&*s)
                .write_all(&hello(self.opts.run_id, self.rank, from))
                .is_ok()
            && s.set_read_timeout(None).is_ok()
    }
}

impl BoundEndpoint for TcpBound {
    fn address(&self) -> Result<String, TransportError> {
        Ok(self.local_addr()?.to_string())
    }

    fn needs_addresses(&self) -> bool {
        true
    }

    fn connect(self: Box<Self>, peers: &[String]) -> Result<Joined, TransportError> {
        let addrs = crate::registration::socket_addresses(peers)?;
        Ok(Joined {
            endpoint: Box::new((*self).connect(&addrs)?),
            shared_memory: Vec::new(),
        })
    }
}

/// A hello from `from` to `to` in run `run_id`.
fn hello(run_id: u64, from: u32, to: u32) -> [u8; HELLO_BYTES] {
    let mut out = [0u8; HELLO_BYTES];
    out[..4].copy_from_slice(&HELLO_MAGIC);
    out[4..12].copy_from_slice(&run_id.to_le_bytes());
    out[12..16].copy_from_slice(&from.to_le_bytes());
    out[16..].copy_from_slice(&to.to_le_bytes());
    out
}

/// Reads a hello of run `run_id` from `s`: its (from, to).
fn read_hello(mut s: &TcpStream, run_id: u64) -> Result<(u32, u32), TransportError> {
    let mut b = [0u8; HELLO_BYTES];
    s.read_exact(&mut b).map_err(setup)?;
    let word = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let mut id = [0u8; 8];
    id.copy_from_slice(&b[4..12]);
    if b[..4] != HELLO_MAGIC || u64::from_le_bytes(id) != run_id {
        return Err(setup("a connection from another run or program"));
    }
    Ok((word(12), word(16)))
}

/// Builds a full mesh of `workers` endpoints on loopback, for threads of one process.
///
/// # Errors
/// [`TransportError::Setup`] when a socket cannot be bound or a connection fails.
pub fn local_mesh(workers: u32, opts: &TcpOptions) -> Result<Vec<Tcp>, TransportError> {
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let bound = (0..workers)
        .map(|r| TcpBound::bind(r, workers, loopback, opts.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    let addrs = bound
        .iter()
        .map(TcpBound::local_addr)
        .collect::<Result<Vec<_>, _>>()?;
    std::thread::scope(|s| {
        let handles: Vec<_> = bound
            .into_iter()
            .map(|b| {
                let addrs = &addrs;
                s.spawn(move || b.connect(addrs))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(setup("a connecting thread panicked")))
            })
            .collect()
    })
}

/// One link's state shared with its reader thread.
#[derive(Default)]
struct LinkState {
    /// Why the reader stopped, where it was not the peer closing its end.
    broken: Mutex<Option<String>>,
    /// The reader stopped: the peer closed its end, or the link broke. Set before the
    /// reader's channel closes, so a send after a receive saw the end fails too.
    ended: std::sync::atomic::AtomicBool,
    /// Bytes of the peer's messages decoded and not yet handed to the program
    /// ([`TcpOptions::max_held_bytes`]).
    held: std::sync::atomic::AtomicU64,
}

impl LinkState {
    /// `m`, handed to the program: its bytes no longer wait.
    fn handed(&self, m: Message) -> Message {
        let bytes = m.tensor.bytes() as u64;
        let _ = self.held.fetch_update(
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
            |h| Some(h.saturating_sub(bytes)),
        );
        m
    }
}

/// One worker's endpoint of a TCP mesh.
pub struct Tcp {
    rank: u32,
    size: u32,
    /// The write side of each link (`None` for this worker itself).
    out: Vec<Option<BufWriter<TcpStream>>>,
    /// Each link's socket, as the readers and abort shut it.
    sockets: Arc<Vec<Option<TcpStream>>>,
    from: Vec<Receiver<Message>>,
    links: Vec<Arc<LinkState>>,
    /// Aborts from peers (their readers put them on its control channel) and messages that
    /// arrived early.
    inbox: Inbox,
    /// Keeps the control channel open when every reader has ended (a closed channel would
    /// read as an abort).
    _control_open: Sender<u32>,
    readers: Vec<JoinHandle<()>>,
    run_id: u64,
    wire: WireDType,
    linger: Duration,
}

impl std::fmt::Debug for Tcp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tcp {{ rank: {}, size: {}, .. }}", self.rank, self.size)
    }
}

impl Tcp {
    /// Starts an endpoint over connected `streams` (one per peer, `None` for itself): a
    /// reader thread per link.
    fn start(
        rank: u32,
        streams: Vec<Option<TcpStream>>,
        opts: &TcpOptions,
    ) -> Result<Tcp, TransportError> {
        let size = streams.len() as u32;
        let (control_tx, control) = unbounded();
        let mut out = Vec::with_capacity(streams.len());
        let mut from = Vec::with_capacity(streams.len());
        let mut links = Vec::with_capacity(streams.len());
        let mut readers = Vec::new();
        for s in streams.iter().flatten() {
            let _ = s.set_nodelay(true);
            keep_alive(s).map_err(setup)?;
        }
        let sockets: Arc<Vec<Option<TcpStream>>> = Arc::new(
            streams
                .iter()
                .map(|s| s.as_ref().map(TcpStream::try_clone).transpose())
                .collect::<Result<_, _>>()
                .map_err(setup)?,
        );
        for (peer, s) in streams.into_iter().enumerate() {
            let (tx, rx) = unbounded();
            let link = Arc::new(LinkState::default());
            if let Some(s) = s {
                let reader = Reader {
                    rank,
                    peer: peer as u32,
                    limits: FrameLimits::new(opts.run_id),
                    max_held: opts.max_held_bytes,
                    data: tx,
                    control: control_tx.clone(),
                    link: link.clone(),
                    sockets: sockets.clone(),
                };
                let read_side = s.try_clone().map_err(setup)?;
                readers.push(
                    std::thread::Builder::new()
                        .name(format!("tcp-{rank}-from-{peer}"))
                        .spawn(move || reader.run(read_side))
                        .map_err(setup)?,
                );
                // A send blocked on a peer that stopped reading (its process stopped, its host
                // gone) fails after the stall bound, as a receive does: a peer's reader drains
                // its socket whatever its program does, so nothing else blocks a send that long.
                s.set_write_timeout(opts.timeout).map_err(setup)?;
                out.push(Some(BufWriter::with_capacity(1 << 16, s)));
            } else {
                out.push(None);
            }
            from.push(rx);
            links.push(link);
        }
        Ok(Tcp {
            rank,
            size,
            out,
            sockets,
            from,
            links,
            inbox: Inbox::new(rank, control, opts.timeout),
            _control_open: control_tx,
            readers,
            run_id: opts.run_id,
            wire: opts.wire,
            linger: opts.linger,
        })
    }

    /// Checks that `key` is addressed to this worker from a peer.
    fn check_key(&self, key: &Key) -> Result<(), TransportError> {
        if key.to != self.rank || key.from >= self.size || key.from == self.rank {
            return Err(TransportError::Protocol(format!(
                "worker {} of {} asked for {key:?}",
                self.rank, self.size
            )));
        }
        Ok(())
    }

    /// Shuts every link's writing side (peers see the end of the stream after what was
    /// written) and, with `read`, its reading side too.
    fn shut(&self, read: bool) {
        let how = if read {
            Shutdown::Both
        } else {
            Shutdown::Write
        };
        for s in self.sockets.iter().flatten() {
            let _ = s.shutdown(how);
        }
    }
}

/// Why the link from `peer` ended: its reader's reason (in `links`), or the peer closing.
fn link_ended(links: &[Arc<LinkState>], inbox: &mut Inbox, peer: u32) -> TransportError {
    let broken = links[peer as usize]
        .broken
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    match broken {
        Some(why) => TransportError::Lost { peer, why },
        None => inbox.abort_or(TransportError::Closed { peer }),
    }
}

/// A link's reader: decodes frames from the peer into the endpoint's channel.
struct Reader {
    rank: u32,
    peer: u32,
    limits: FrameLimits,
    /// [`TcpOptions::max_held_bytes`].
    max_held: u64,
    data: Sender<Message>,
    control: Sender<u32>,
    link: Arc<LinkState>,
    sockets: Arc<Vec<Option<TcpStream>>>,
}

impl Reader {
    /// Reads until the peer closes, the endpoint goes away, or a frame is bad (the reason
    /// is kept for the next receive from this peer).
    fn run(self, stream: TcpStream) {
        let mut r = BufReader::with_capacity(1 << 16, stream);
        if let Err(why) = self.read_all(&mut r) {
            *self
                .link
                .broken
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(why);
            // Nothing more is read from this peer: its sends fail at once rather than fill
            // the socket and wait out their bound.
            if let Some(Some(s)) = self.sockets.get(self.peer as usize) {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        self.link
            .ended
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn read_all(&self, r: &mut impl Read) -> Result<(), String> {
        loop {
            let mut tag = [0u8; 1];
            match r.read(&mut tag) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // A socket shut by this endpoint (an abort, a close) or reset by the peer.
                Err(_) => return Ok(()),
            }
            match tag[0] {
                TAG_MESSAGE => {
                    let m = self.read_frame(r)?;
                    let bytes = m.tensor.bytes() as u64;
                    let held = self
                        .link
                        .held
                        .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed)
                        + bytes;
                    if held > self.max_held {
                        return Err(format!(
                            "worker {} has {held} bytes of messages waiting for worker {} to \
                             receive them, past the bound of {} (more than any schedule keeps \
                             in flight)",
                            self.peer, self.rank, self.max_held
                        ));
                    }
                    if self.data.send(m).is_err() {
                        return Ok(()); // the endpoint is gone
                    }
                }
                TAG_ABORT => {
                    let mut by = [0u8; 4];
                    r.read_exact(&mut by).map_err(|e| format!("abort: {e}"))?;
                    let _ = self.control.send(u32::from_le_bytes(by));
                    // Every blocked send of this endpoint returns.
                    for s in self.sockets.iter().flatten() {
                        let _ = s.shutdown(Shutdown::Write);
                    }
                }
                other => return Err(format!("tag {other} is no message")),
            }
        }
    }

    /// One frame, checked: its run, its size, and that it comes from this link's peer to
    /// this worker.
    fn read_frame(&self, r: &mut impl Read) -> Result<Message, String> {
        let mut prefix = [0u8; PREFIX_BYTES];
        r.read_exact(&mut prefix).map_err(|e| e.to_string())?;
        let len = frame::parse_prefix(&prefix).map_err(|e| e.to_string())?;
        let mut header = vec![0u8; len];
        r.read_exact(&mut header).map_err(|e| e.to_string())?;
        let header = frame::parse_header(&header, &self.limits).map_err(|e| e.to_string())?;
        let mut payload = PayloadBuffer::for_header(&header);
        r.read_exact(payload.bytes_mut())
            .map_err(|e| e.to_string())?;
        let m = payload.into_message(&header).map_err(|e| e.to_string())?;
        if m.key.from != self.peer || m.key.to != self.rank {
            return Err(format!(
                "worker {} sent {:?} on its link to worker {}",
                self.peer, m.key, self.rank
            ));
        }
        Ok(m)
    }
}

impl Transport for Tcp {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    fn copies_payloads(&self) -> bool {
        true
    }

    fn send(&mut self, message: Message) -> Result<(), TransportError> {
        self.inbox.poll_aborted()?;
        let to = message.key.to;
        let wire = wire_for(message.key.kind, self.wire);
        let head = frame::encode_header(&frame::header_of(&message, self.run_id, wire));
        let values = message.tensor.host();
        let (head, values) = match (head, values) {
            (Ok(h), Ok(v)) => (h, v),
            (Err(e), _) => {
                let reason = e.to_string();
                return Err(TransportError::unsent(message, reason));
            }
            (_, Err(e)) => {
                let reason = format!("payload not on the host: {e}");
                return Err(TransportError::unsent(message, reason));
            }
        };
        let ended = self
            .links
            .get(to as usize)
            .is_some_and(|l| l.ended.load(std::sync::atomic::Ordering::SeqCst));
        let writer = match self.out.get_mut(to as usize) {
            Some(Some(w)) if !ended => Some(w),
            _ => None,
        };
        let written = match writer {
            // An f32 payload on a little-endian machine is written from the tensor's own
            // buffer; bf16 is converted first.
            Some(w) => w
                .write_all(&[TAG_MESSAGE])
                .and_then(|()| w.write_all(&head))
                .and_then(|()| match wire {
                    WireDType::F32 if cfg!(target_endian = "little") => {
                        w.write_all(bytemuck::cast_slice(values))
                    }
                    _ => {
                        let mut payload = Vec::with_capacity(values.len() * wire.size());
                        frame::encode_payload(values, wire, &mut payload);
                        w.write_all(&payload)
                    }
                })
                .and_then(|()| w.flush()),
            None => Err(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                "no link",
            )),
        };
        match written {
            Ok(()) => Ok(()),
            Err(_) if to >= self.size || to == self.rank => Err(TransportError::unsent(
                message,
                format!("no worker {to} of {} to send to", self.size),
            )),
            Err(e) => {
                // A frame cut off part way leaves the stream unreadable: the link ends here, and
                // the peer reads a truncated frame and the end, not the next frame's bytes.
                if let Some(Some(s)) = self.sockets.get(to as usize) {
                    let _ = s.shutdown(Shutdown::Both);
                }
                Err(self.inbox.abort_or(TransportError::unsent(
                    message,
                    format!("worker {to} is gone: {e}"),
                )))
            }
        }
    }

    fn recv(&mut self, key: &Key) -> Result<Message, TransportError> {
        self.check_key(key)?;
        let (links, peer) = (&self.links, key.from);
        self.inbox
            .recv(key, &self.from[peer as usize], |inbox| {
                link_ended(links, inbox, peer)
            })
            .map(|m| links[peer as usize].handed(m))
    }

    fn try_recv(&mut self, key: &Key) -> Result<Option<Message>, TransportError> {
        self.check_key(key)?;
        let (links, peer) = (&self.links, key.from);
        self.inbox
            .try_recv(key, &self.from[peer as usize], |inbox| {
                Err(link_ended(links, inbox, peer))
            })
            .map(|m| m.map(|m| links[peer as usize].handed(m)))
    }

    fn buffered(&self) -> usize {
        self.inbox.buffered()
    }

    fn abort(&mut self) {
        self.inbox.abort_here();
        let mut note = vec![TAG_ABORT];
        note.extend_from_slice(&self.rank.to_le_bytes());
        for w in self.out.iter_mut().flatten() {
            // A peer that stopped reading must not hold the abort up.
            let _ = w.get_ref().set_write_timeout(Some(Duration::from_secs(1)));
            let _ = w.write_all(&note).and_then(|()| w.flush());
        }
        self.shut(false);
    }

    fn close(&mut self) -> Result<(), TransportError> {
        for w in self.out.iter_mut().flatten() {
            let _ = w.flush();
        }
        // Peers read what was written before the end of the stream; this end keeps
        // reading until they close theirs, so nothing they sent is cut off.
        self.shut(false);
        let deadline = Instant::now() + self.linger;
        while self.readers.iter().any(|h| !h.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.shut(true);
        for h in self.readers.drain(..) {
            let _ = h.join();
        }
        Ok(())
    }
    fn carries_device_tensors(&self) -> bool {
        false
    }
    /// A socket may reach another host, so nothing is lent over it.
    fn lends_device_buffers(&self, _: u32) -> bool {
        false
    }
    fn link_buffer_bytes(&self) -> Option<u64> {
        None
    }
    fn interrupter(&self) -> Option<crate::Interrupter> {
        None
    }
    crate::refuse_regroup!();
    crate::no_network_links!();
}

impl Drop for Tcp {
    fn drop(&mut self) {
        for w in self.out.iter_mut().flatten() {
            let _ = w.flush();
        }
        // Both sides: the readers end, and every peer sees this end close after what was
        // written.
        self.shut(true);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A joined link probes a silent peer: keep-alive on, with [`KEEPALIVE`]'s timings.
    #[test]
    fn a_link_keeps_alive() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        keep_alive(&s).unwrap();
        use rustix::net::sockopt;
        assert!(sockopt::socket_keepalive(&s).unwrap());
        #[cfg(target_os = "linux")]
        {
            assert_eq!(sockopt::tcp_keepidle(&s).unwrap(), KEEPALIVE.0);
            assert_eq!(sockopt::tcp_keepintvl(&s).unwrap(), KEEPALIVE.1);
            assert_eq!(sockopt::tcp_keepcnt(&s).unwrap(), KEEPALIVE.2);
        }
    }
}
