//! The shared-memory transport: worker processes on one host, one byte ring per directed link
//! in a memory segment only the two ends of the link can reach.
//!
//! **Admission before memory.** Each worker listens on a Unix-domain socket in a directory
//! only the run's user can enter (mode 0700). For every pair, the higher rank dials the lower
//! one. Both ends read the other's credentials from the kernel (`SO_PEERCRED`) and refuse a
//! process of another user; the dialler then sends a hello (magic, protocol version, run,
//! both ranks, ring size and its host identity: the kernel's boot id and its network
//! namespace) with two file descriptors (`SCM_RIGHTS`): the link's segment, a sealed `memfd`
//! that no path names, and its wake-up `eventfd`. The acceptor checks every field, the
//! segment's seals and size, and answers with its own `eventfd`, or with a refusal naming
//! the problem. Two processes with different boot ids or network namespaces are two hosts,
//! whatever their addresses: the link is refused and QUIC carries it. The socket stays open
//! for the link's life and carries its control records (an abort, a clean close): when a
//! peer's process ends, the kernel closes its end, and the survivor's wait returns at once
//! naming it, with no timer on the ring. The survivors of a lost peer go on over the
//! segments they have (`shm/regroup.rs`), only the lost rank's links made anew.
//!
//! **Rings.** A segment holds one ring per direction. A ring is a byte stream: a producer
//! position and a consumer position (64-bit, never wrapping) on separate cache lines, and a
//! data area. Frames are [`crate::frame`]'s (prefix, header, payload), so a message is
//! checked exactly as a QUIC frame is before anything is allocated from it. A sender copies
//! the tensor into the ring once; the receiver copies it out once, straight into the new
//! tensor's buffer. A frame larger than the free space goes in pieces, which is also how a
//! tensor larger than the ring travels: the ring's size is the back-pressure. Positions are
//! read from memory the peer can write, so each is checked (the consumer never ahead of the
//! producer, never more than a ring's size between them) and a bad one is
//! [`TransportError::Protocol`] naming the link, never a read out of bounds. The segment is
//! sealed against shrinking and growing, so the peer cannot make a mapped page vanish.
//!
//! **Waiting.** A blocked call parks: it sets a flag in each ring it waits on, drains its
//! `eventfd`, looks once more, and then sleeps in `poll` on the `eventfd` and every link's
//! socket. A producer that commits bytes, or a consumer that frees space, writes the other
//! end's `eventfd` only when that end is parked, so a busy pipeline makes no system call for
//! its wake-ups. No call spins. A worker blocked on a full ring reads every ring coming to
//! it while it waits, keeping what it reads by key, so two workers sending to each other
//! cannot deadlock; what waits for the program is bounded per peer by
//! [`ShmOptions::max_held_bytes`], as over QUIC.
//!
//! **Partial writes are never messages.** A producer publishes its position only after the
//! bytes before it are written, and a receiver hands a message over only once its whole
//! payload is read. A peer that dies in the middle of a frame leaves a frame that is never
//! delivered; its socket's end makes every later call return [`TransportError::Lost`].

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{EventfdFlags, PollFd, PollFlags};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::frame::{self, FrameLimits, Header, PREFIX_BYTES, PayloadBuffer, WireDType};
use crate::registration::{BoundEndpoint, Endpoint, Joined, MeshSettings, Registration};
use crate::{Early, Key, Kind, Message, Transport, TransportError, ValueSink, Values};

mod regroup;

/// The registration of shared memory ([`crate::kinds::TRANSPORTS`]).
pub const REGISTRATION: Registration = Registration {
    name: "shm",
    about: "shared memory, one copy each way",
    link_description: Some("shared memory"),
    cuts_links: false,
    networked: false,
    crosses_processes: true,
    measured_messages: 1000,
    thread_mesh: |workers, settings| {
        let eps = local_mesh(workers, &ShmOptions::from(settings))?;
        Ok(eps.into_iter().map(|e| Box::new(e) as Endpoint).collect())
    },
    bind: Some(|cluster, rank, at, settings| {
        let bound = ShmBound::bind(&at.meet, rank, cluster.size(), ShmOptions::from(settings))?;
        Ok(Box::new(bound))
    }),
};

impl From<&MeshSettings> for ShmOptions {
    fn from(s: &MeshSettings) -> Self {
        let mut opts = ShmOptions::new(s.run_id);
        opts.wire = s.wire;
        opts.timeout = s.timeout;
        opts.connect_timeout = s.connect_timeout;
        opts
    }
}

impl BoundEndpoint for ShmBound {
    fn address(&self) -> Result<String, TransportError> {
        Ok(format!("unix:{}", self.path().display()))
    }

    fn needs_addresses(&self) -> bool {
        false
    }

    fn connect(self: Box<Self>, peers: &[String]) -> Result<Joined, TransportError> {
        // A rank named absent (a lost worker) is left out of the mesh.
        let present = crate::registration::present_ranks(peers, self.size);
        let shm = (*self).connect_to(&present)?;
        let all = present.into_iter().filter(|&p| p != shm.rank()).collect();
        Ok(Joined {
            endpoint: Box::new(shm),
            shared_memory: all,
        })
    }
}

/// First bytes of a segment.
const SEGMENT_MAGIC: [u8; 8] = *b"PIPESHM1";
/// First bytes of a hello.
const HELLO_MAGIC: [u8; 8] = *b"PIPESHMH";
/// First bytes of a hello's answer.
const ANSWER_MAGIC: [u8; 8] = *b"PIPESHMA";
/// The handshake's and the ring layout's version.
pub const SHM_PROTOCOL_VERSION: u16 = 1;
/// Bytes before the first ring's data: the segment header and both ring headers.
const DATA_START: usize = 4096;
/// Where each ring's header starts.
const RING_HEADERS: [usize; 2] = [512, 1024];
/// Offsets inside a ring header, one cache line (or two) apart.
const HEAD: usize = 0;
const TAIL: usize = 128;
const READER_PARKED: usize = 256;
const WRITER_PARKED: usize = 320;
/// Control records on a link's socket.
const RECORD_ABORT: u8 = b'A';
const RECORD_CLOSE: u8 = b'C';
/// A survivor's word that it goes on without a lost peer on this link
/// ([`Shm::regrouped`]): the link's next generation, where its outgoing ring's producer
/// stopped, and whether the lost rank's link comes with it (descriptors attached).
const RECORD_REGROUP: u8 = b'R';
/// Smallest and largest ring a hello may ask for.
const MIN_RING: u64 = 4096;
const MAX_RING: u64 = 1 << 30;
/// Times a blocked call gives its core away (`sched_yield`) and looks again before it
/// sleeps: where workers outnumber cores, the peer it waits for often runs meanwhile, and
/// a sleep and its wake-up cost more. Bounded, so a wait never spins.
const YIELDS_BEFORE_PARKING: u32 = 4;
/// How often a worker that never waits looks at its links' sockets.
const SOCKET_CHECK: Duration = Duration::from_millis(2);
/// A hello or an answer is at most this long.
const MAX_HANDSHAKE: usize = 512;

/// Settings of a shared-memory endpoint.
#[derive(Clone, Debug)]
pub struct ShmOptions {
    /// The run every peer and frame must belong to.
    pub run_id: u64,
    /// Bytes of each ring (one per direction of a link).
    pub ring_bytes: u64,
    /// Element type of activations and gradients (all-reduce chunks are f32, or bf16 where
    /// they hold bf16 values, as over QUIC).
    pub wire: WireDType,
    /// How long a receive of data waits before [`TransportError::Timeout`], the stall bound
    /// (None: until the message or a failure). Control records are waited for without bound.
    pub timeout: Option<Duration>,
    /// How long connecting waits for peers that start late.
    pub connect_timeout: Duration,
    /// Largest payload accepted from a peer.
    pub max_payload_bytes: u64,
    /// Bytes of one peer's messages that may wait for this worker's receives.
    pub max_held_bytes: u64,
}

impl ShmOptions {
    /// Defaults for run `run_id`: rings of 2 MiB.
    pub fn new(run_id: u64) -> Self {
        ShmOptions {
            run_id,
            ring_bytes: 2 << 20,
            wire: WireDType::F32,
            timeout: None,
            connect_timeout: Duration::from_secs(30),
            max_payload_bytes: FrameLimits::DEFAULT_MAX_PAYLOAD,
            max_held_bytes: crate::quic::DEFAULT_MAX_HELD_BYTES,
        }
    }
}

pub use crate::host::HostId;

fn setup(why: String) -> TransportError {
    TransportError::Setup(why)
}

/// The directory a cluster's workers on one host meet in, for run `run_id`: under
/// `$XDG_RUNTIME_DIR` where it is set, else the system's temporary directory, in a
/// directory of this user's alone.
pub fn rendezvous_dir(run_id: u64) -> PathBuf {
    let base = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_dir())
        .unwrap_or_else(std::env::temp_dir);
    let uid = rustix::process::geteuid().as_raw();
    base.join(format!("pipe-{uid}"))
        .join(format!("{run_id:016x}"))
}

/// Creates `dir` (its parent must exist) for this user alone, or checks that an existing one is
/// this user's and closed to others.
///
/// # Errors
/// [`TransportError::Setup`] for a directory of another user or open to others.
pub fn private_dir(dir: &Path) -> Result<(), TransportError> {
    let uid = rustix::process::geteuid().as_raw();
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(setup(format!("creating {}: {e}", dir.display()))),
    }
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| setup(format!("reading {}: {e}", dir.display())))?;
    if !meta.is_dir() || meta.uid() != uid || meta.permissions().mode() & 0o077 != 0 {
        return Err(setup(format!(
            "{} must be a directory of user {uid} closed to others (mode 0700)",
            dir.display()
        )));
    }
    Ok(())
}

/// The socket rank `rank` listens on in `dir`.
pub fn socket_path(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("rank-{rank}.sock"))
}

/// One ring of a mapped segment. The pointers stay valid while the segment's mapping lives
/// (the [`Link`] holds both).
struct Ring {
    header: *mut u8,
    data: *mut u8,
    cap: u64,
}

// The pointers point into a mapping the owning link keeps alive; the atomics in it are
// shared with the peer process by design.
unsafe impl Send for Ring {}

impl Ring {
    fn atomic64(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `header + at` is 8-aligned (the mapping is page-aligned, offsets are
        // multiples of 64) and inside the mapping, which outlives `self`.
        unsafe { &*self.header.add(at).cast::<AtomicU64>() }
    }
    fn atomic32(&self, at: usize) -> &AtomicU32 {
        // SAFETY: as `atomic64`, 4-aligned.
        unsafe { &*self.header.add(at).cast::<AtomicU32>() }
    }
    fn head(&self) -> &AtomicU64 {
        self.atomic64(HEAD)
    }
    fn tail(&self) -> &AtomicU64 {
        self.atomic64(TAIL)
    }
    fn reader_parked(&self) -> &AtomicU32 {
        self.atomic32(READER_PARKED)
    }
    fn writer_parked(&self) -> &AtomicU32 {
        self.atomic32(WRITER_PARKED)
    }

    /// The producer's and consumer's positions, checked against each other and the ring.
    fn positions(&self) -> Result<(u64, u64), String> {
        let head = self.head().load(Ordering::SeqCst);
        let tail = self.tail().load(Ordering::SeqCst);
        if tail > head || head - tail > self.cap {
            return Err(format!(
                "ring positions out of bounds (producer {head}, consumer {tail}, ring of {} bytes)",
                self.cap
            ));
        }
        Ok((head, tail))
    }

    /// Copies as much of `bytes` as fits, publishing the new producer position; returns
    /// how many were written.
    fn write_some(&self, bytes: &[u8]) -> Result<usize, String> {
        let (head, tail) = self.positions()?;
        let free = (self.cap - (head - tail)) as usize;
        let n = free.min(bytes.len());
        if n == 0 {
            return Ok(0);
        }
        let at = (head % self.cap) as usize;
        let first = n.min(self.cap as usize - at);
        // SAFETY: `at + first <= cap` and `n - first <= cap`, both inside the data area;
        // the consumer does not read these bytes until the position below is published.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.data.add(at), first);
            std::ptr::copy_nonoverlapping(bytes.as_ptr().add(first), self.data, n - first);
        }
        self.head().store(head + n as u64, Ordering::SeqCst);
        Ok(n)
    }

    /// Copies up to `out.len()` published bytes out, freeing their space; returns how many.
    fn read_some(&self, out: &mut [u8]) -> Result<usize, String> {
        // SAFETY: `out` is valid for writes of its length.
        unsafe { self.read_raw(out.as_mut_ptr(), out.len()) }
    }

    /// Copies up to `max` published bytes to `out`, freeing their space; returns how many.
    ///
    /// # Safety
    /// `out` must be valid for writes of `max` bytes (it may be uninitialised).
    unsafe fn read_raw(&self, out: *mut u8, max: usize) -> Result<usize, String> {
        let (head, tail) = self.positions()?;
        let n = ((head - tail) as usize).min(max);
        if n == 0 {
            return Ok(0);
        }
        let at = (tail % self.cap) as usize;
        let first = n.min(self.cap as usize - at);
        // SAFETY: the source ranges are inside the data area (as `write_some`) and were
        // published by the producer; `out` holds `max >= n` bytes (the caller's promise).
        unsafe {
            std::ptr::copy_nonoverlapping(self.data.add(at), out, first);
            std::ptr::copy_nonoverlapping(self.data, out.add(first), n - first);
        }
        self.tail().store(tail + n as u64, Ordering::SeqCst);
        Ok(n)
    }

    /// The next published byte, if any.
    fn peek(&self) -> Result<Option<u8>, String> {
        let (head, tail) = self.positions()?;
        if head == tail {
            return Ok(None);
        }
        // SAFETY: inside the data area; published.
        Ok(Some(unsafe {
            self.data.add((tail % self.cap) as usize).read()
        }))
    }

    /// Skips up to `most` zero bytes, the padding that puts the next frame's payload onto a
    /// boundary; returns how many.
    fn skip_padding(&self, most: usize) -> Result<usize, String> {
        let (head, tail) = self.positions()?;
        let avail = ((head - tail) as usize).min(most);
        let mut n = 0;
        while n < avail {
            let at = ((tail + n as u64) % self.cap) as usize;
            // SAFETY: `at < cap`, inside the data area; the byte was published.
            if unsafe { self.data.add(at).read() } != 0 {
                break;
            }
            n += 1;
        }
        if n > 0 {
            self.tail().store(tail + n as u64, Ordering::SeqCst);
        }
        Ok(n)
    }

    /// Lends up to `max` published bytes (a multiple of 4, starting 4-aligned in the ring)
    /// to `take` as values where they lie, without crossing the ring's end; then frees them.
    /// Returns how many bytes.
    fn lend_some(&self, max: usize, take: &mut dyn FnMut(&[f32])) -> Result<usize, String> {
        let (head, tail) = self.positions()?;
        let at = (tail % self.cap) as usize;
        let n = ((head - tail) as usize)
            .min(max)
            .min(self.cap as usize - at)
            / 4
            * 4;
        if n == 0 || at % 4 != 0 {
            return Ok(0);
        }
        // SAFETY: `at..at + n` is inside the data area, 4-aligned (the mapping is
        // page-aligned), published by the producer, who does not write it again until the
        // consumer position passes it below.
        let values = unsafe { std::slice::from_raw_parts(self.data.add(at).cast::<f32>(), n / 4) };
        take(values);
        self.tail().store(tail + n as u64, Ordering::SeqCst);
        Ok(n)
    }

    fn readable(&self) -> bool {
        self.head().load(Ordering::SeqCst) != self.tail().load(Ordering::SeqCst)
    }
}

/// What a link's reader has of the frame in progress.
enum Reading {
    Prefix {
        buf: [u8; PREFIX_BYTES],
        got: usize,
        /// Zero bytes skipped before it ([`ALIGN`]).
        pad: usize,
    },
    Header {
        buf: Vec<u8>,
        got: usize,
    },
    Payload {
        header: Header,
        buf: Payload,
        got: usize,
        len: usize,
    },
    /// A frame a streaming receive waits for: its header is read, its f32 payload is lent
    /// from the ring as it arrives ([`Shm::lend`]); `got` bytes of it are handed over.
    Held {
        header: Header,
        got: usize,
    },
}

/// Where a payload is read to: an f32 payload straight into the new tensor's buffer, which
/// is never zeroed first (every byte comes from the ring before the buffer is used); any
/// other into [`PayloadBuffer`].
enum Payload {
    /// Capacity for the payload; its length is set once every byte has been read.
    F32(Vec<f32>),
    Other(PayloadBuffer),
}

impl Payload {
    fn for_header(header: &Header) -> Payload {
        if header.dtype == WireDType::F32 && cfg!(target_endian = "little") {
            Payload::F32(Vec::with_capacity(header.elements() as usize))
        } else {
            Payload::Other(PayloadBuffer::for_header(header))
        }
    }

    /// Reads bytes `got..len` of the payload from `ring`, as far as it has them.
    fn fill(&mut self, ring: &Ring, got: usize, len: usize) -> Result<usize, String> {
        match self {
            Payload::F32(values) => {
                debug_assert!(values.capacity() * 4 >= len);
                // SAFETY: the capacity holds `len` bytes, so bytes `got..len` are inside it.
                unsafe { ring.read_raw(values.as_mut_ptr().cast::<u8>().add(got), len - got) }
            }
            Payload::Other(buf) => ring.read_some(&mut buf.bytes_mut()[got..len]),
        }
    }

    /// The message, once all `header.payload_bytes()` bytes have been read.
    fn into_message(self, header: &Header) -> Result<Message, frame::FrameError> {
        match self {
            Payload::F32(mut values) => {
                // SAFETY: `fill` wrote every byte of the `elements` values.
                unsafe { values.set_len(header.elements() as usize) };
                let shape: Vec<usize> = header.shape.iter().map(|&d| d as usize).collect();
                let tensor = pipe_kernels::Tensor::from_vec(&shape, values).map_err(|e| {
                    frame::FrameError::Header(format!("payload does not fit the shape: {e}"))
                })?;
                Ok(Message {
                    key: header.key()?,
                    version: header.version,
                    tensor,
                })
            }
            Payload::Other(buf) => buf.into_message(header),
        }
    }
}

impl Default for Reading {
    fn default() -> Self {
        Reading::Prefix {
            buf: [0; PREFIX_BYTES],
            got: 0,
            pad: 0,
        }
    }
}

/// How a link's peer stands.
#[derive(Clone, Debug, PartialEq, Eq)]
enum PeerState {
    Running,
    /// It said it sends nothing more.
    Closed,
    /// Its process ended (or it broke the protocol) without closing.
    Lost(String),
}

/// This worker's end of the link to one peer.
struct Link {
    peer: u32,
    socket: UnixStream,
    /// The segment's mapping; the rings point into it.
    _map: memmap2::MmapRaw,
    out: Ring,
    inp: Ring,
    /// The peer's wake-up eventfd.
    bell: OwnedFd,
    reading: Reading,
    /// Bytes of control records read from the socket, not yet a whole record.
    control: Vec<u8>,
    state: PeerState,
    /// Bytes of this peer's messages held for receives.
    held: u64,
    /// Frames of this peer copied out of the ring into a buffer of their own, rather than
    /// lent where they lie ([`Shm::frames_copied_out`]).
    copied_out: u64,
    /// Its socket has ended: nothing more to read from it.
    eof: bool,
    /// The last wait saw its socket readable: read it at the next pump.
    control_ready: bool,
    /// The peer has said it failed.
    aborted: bool,
    /// The link to or from a lost rank hosted by a survivor ([`Shm::regrouped`]): it ends
    /// with the segment the rank was hosted for, and a later regroup leaves it out.
    hosted: bool,
}

/// What a lent payload is handed to: (offset in values, values).
type Taker<'a> = dyn FnMut(usize, &[f32]) + 'a;

/// What a receive got: a whole message, or a payload lent to its taker (its elements).
enum Received {
    Whole(Message),
    Lent(usize),
}

/// Frames' payloads start on this boundary of the ring (zero bytes before a frame's prefix
/// pad it there): a cache line, and whole f32 values.
const ALIGN: usize = 64;

/// Values a lent payload passes through at a time (64 KiB: it stays in cache).
const BOUNCE_VALUES: usize = 1 << 14;

/// One worker's endpoint of a shared-memory mesh.
pub struct Shm {
    rank: u32,
    size: u32,
    links: Vec<Option<Link>>,
    /// This worker's wake-up eventfd.
    bell: OwnedFd,
    /// A failure heard elsewhere ([`Shm::alarm`]): the rank it names, or [`NO_ALARM`].
    raised: Arc<AtomicU64>,
    early: Early,
    aborted_by: Option<u32>,
    /// This worker has said it sends nothing more.
    closed: bool,
    /// When the sockets were last checked ([`Shm::check_sockets`]).
    checked: Instant,
    /// Where a lent payload passes through ([`Shm::lend`]).
    bounce: Vec<f32>,
    opts: ShmOptions,
    limits: FrameLimits,
    /// Where this endpoint listened, which the launcher names again at a regroup.
    address: String,
    /// Regroups of this mesh so far ([`Shm::regrouped`]); both ends of a link count alike.
    generation: u32,
}

impl std::fmt::Debug for Shm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

/// A worker listening on its socket, not yet connected to its peers (so a launcher can
/// wait until every worker listens).
pub struct ShmBound {
    rank: u32,
    size: u32,
    dir: PathBuf,
    listener: UnixListener,
    opts: ShmOptions,
}

impl ShmBound {
    /// Listens as rank `rank` of `size` in `dir` (created for this user alone if missing).
    ///
    /// # Errors
    /// [`TransportError::Setup`]: a directory open to others, a socket already there.
    pub fn bind(
        dir: &Path,
        rank: u32,
        size: u32,
        opts: ShmOptions,
    ) -> Result<ShmBound, TransportError> {
        if rank >= size {
            return Err(setup(format!("rank {rank} in a mesh of {size}")));
        }
        if !(MIN_RING..=MAX_RING).contains(&opts.ring_bytes) {
            return Err(setup(format!(
                "rings of {} bytes (give {MIN_RING} to {MAX_RING})",
                opts.ring_bytes
            )));
        }
        private_dir(dir)?;
        let path = socket_path(dir, rank);
        // A socket left by a worker of this run that died before connecting answers no one.
        if UnixStream::connect(&path)
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            let _ = std::fs::remove_file(&path);
        }
        let listener = UnixListener::bind(&path).map_err(|e| {
            setup(format!(
                "worker {rank} listening on {}: {e}",
                path.display()
            ))
        })?;
        // The directory already keeps others out; the socket says the same.
        let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
        Ok(ShmBound {
            rank,
            size,
            dir: dir.to_path_buf(),
            listener,
            opts,
        })
    }

    /// The socket this worker listens on.
    pub fn path(&self) -> PathBuf {
        socket_path(&self.dir, self.rank)
    }

    /// Connects to every other worker: dials each lower rank, then admits each higher one.
    ///
    /// # Errors
    /// [`TransportError::Setup`] naming the peer: one that never listened or answered, a
    /// refused admission (another user, run, host or protocol).
    pub fn connect(self) -> Result<Shm, TransportError> {
        let all: Vec<u32> = (0..self.size).collect();
        self.connect_to(&all)
    }

    /// Connects to the workers in `peers` only (the others are reached another way).
    ///
    /// # Errors
    /// As [`ShmBound::connect`].
    pub fn connect_to(self, peers: &[u32]) -> Result<Shm, TransportError> {
        let deadline = Instant::now() + self.opts.connect_timeout;
        let bell = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(|e| setup(format!("eventfd: {e}")))?;
        let host = HostId::current()?;
        let mut links: Vec<Option<Link>> = (0..self.size).map(|_| None).collect();
        for &peer in peers.iter().filter(|&&p| p < self.rank) {
            let link = self.dial(peer, &bell, &host, deadline)?;
            links[peer as usize] = Some(link);
        }
        let mut waiting: Vec<u32> = peers
            .iter()
            .copied()
            .filter(|&p| p > self.rank && p < self.size)
            .collect();
        self.listener
            .set_nonblocking(true)
            .map_err(|e| setup(format!("listener: {e}")))?;
        while !waiting.is_empty() {
            let stream = accept_by(&self.listener, deadline).map_err(|e| {
                setup(format!(
                    "worker {} waited for worker{} {waiting:?}: {e}{ONE_HOST}",
                    self.rank,
                    if waiting.len() > 1 { "s" } else { "" }
                ))
            })?;
            // A connection that fails admission is dropped; the run waits on for its peers.
            match self.admit(stream, &bell, &host, &waiting, deadline) {
                Ok(link) => {
                    waiting.retain(|&p| p != link.peer);
                    let p = link.peer as usize;
                    links[p] = Some(link);
                }
                Err(why) => {
                    let _ = writeln!(
                        std::io::stderr(),
                        "worker {}: refused a connection: {why}",
                        self.rank
                    );
                }
            }
        }
        let _ = std::fs::remove_file(self.path());
        for link in links.iter().flatten() {
            link.socket
                .set_nonblocking(true)
                .map_err(|e| setup(format!("socket of worker {}: {e}", link.peer)))?;
        }
        let mut limits = FrameLimits::new(self.opts.run_id);
        limits.max_payload_bytes = self.opts.max_payload_bytes;
        let address = format!("unix:{}", self.path().display());
        Ok(Shm {
            rank: self.rank,
            size: self.size,
            links,
            bell,
            raised: Arc::new(AtomicU64::new(NO_ALARM)),
            early: Early::default(),
            aborted_by: None,
            closed: false,
            checked: Instant::now(),
            bounce: vec![0.0; BOUNCE_VALUES],
            opts: self.opts,
            limits,
            address,
            generation: 0,
        })
    }

    /// Dials `peer` (lower than this rank): creates the link's segment, sends the hello with
    /// the segment and this worker's eventfd, and reads the peer's answer.
    fn dial(
        &self,
        peer: u32,
        bell: &OwnedFd,
        host: &HostId,
        deadline: Instant,
    ) -> Result<Link, TransportError> {
        let path = socket_path(&self.dir, peer);
        let socket = loop {
            match UnixStream::connect(&path) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(setup(format!(
                        "worker {} could not reach worker {peer} at {}: {e}{ONE_HOST}",
                        self.rank,
                        path.display()
                    )));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let fail =
            |why: String| setup(format!("worker {} joining worker {peer}: {why}", self.rank));
        same_user(&socket).map_err(fail)?;
        let cap = self.opts.ring_bytes;
        let (memfd, map) = create_segment(self.opts.run_id, peer, self.rank, cap).map_err(fail)?;
        let mut hello = Vec::with_capacity(128);
        hello.extend_from_slice(&HELLO_MAGIC);
        hello.extend_from_slice(&SHM_PROTOCOL_VERSION.to_le_bytes());
        hello.extend_from_slice(&self.opts.run_id.to_le_bytes());
        hello.extend_from_slice(&self.rank.to_le_bytes());
        hello.extend_from_slice(&peer.to_le_bytes());
        hello.extend_from_slice(&cap.to_le_bytes());
        host.encode(&mut hello);
        send_with_fds(&socket, &hello, &[memfd.as_fd(), bell.as_fd()]).map_err(fail)?;
        set_timeout(&socket, deadline).map_err(fail)?;
        let (answer, mut fds) = recv_with_fds(&socket, 1).map_err(fail)?;
        let mut r = Fields::new(&answer);
        if r.bytes(8).map_err(fail)? != ANSWER_MAGIC {
            return Err(fail("its answer is not a pipe shared-memory answer".into()));
        }
        if r.u8().map_err(fail)? != 0 {
            let why = String::from_utf8_lossy(r.rest()).into_owned();
            return Err(fail(format!("refused: {why}")));
        }
        let bell_of_peer = fds
            .pop()
            .ok_or_else(|| fail("its answer carried no eventfd".into()))?;
        // The dialler is the higher rank: ring 0 runs low to high, ring 1 high to low.
        let (inp, out) = rings(&map, cap);
        Ok(Link::new(peer, socket, map, out, inp, bell_of_peer))
    }

    /// Admits a dialling worker: checks its credentials, hello and segment, and answers.
    fn admit(
        &self,
        socket: UnixStream,
        bell: &OwnedFd,
        host: &HostId,
        waiting: &[u32],
        deadline: Instant,
    ) -> Result<Link, String> {
        socket
            .set_nonblocking(false)
            .map_err(|e| format!("socket: {e}"))?;
        same_user(&socket)?;
        set_timeout(&socket, deadline)?;
        let (hello, mut fds) = recv_with_fds(&socket, 2)?;
        let checked = self.check_hello(&hello, host, waiting, &mut fds);
        let (peer, cap, memfd, bell_of_peer) = match checked {
            Ok(v) => v,
            Err(why) => {
                let mut answer = ANSWER_MAGIC.to_vec();
                answer.push(1);
                answer.extend_from_slice(why.as_bytes());
                let _ = send_with_fds(&socket, &answer, &[]);
                return Err(why);
            }
        };
        let map = map_segment(&memfd, self.opts.run_id, self.rank, peer, cap)?;
        let mut answer = ANSWER_MAGIC.to_vec();
        answer.push(0);
        send_with_fds(&socket, &answer, &[bell.as_fd()])?;
        let (out, inp) = rings(&map, cap);
        Ok(Link::new(peer, socket, map, out, inp, bell_of_peer))
    }

    /// A hello's fields, checked: the peer's rank, the ring size, the segment and its
    /// eventfd.
    fn check_hello(
        &self,
        hello: &[u8],
        host: &HostId,
        waiting: &[u32],
        fds: &mut Vec<OwnedFd>,
    ) -> Result<(u32, u64, OwnedFd, OwnedFd), String> {
        let mut r = Fields::new(hello);
        if r.bytes(8)? != HELLO_MAGIC {
            return Err("not a pipe shared-memory hello".into());
        }
        let version = r.u16()?;
        if version != SHM_PROTOCOL_VERSION {
            return Err(format!(
                "protocol version {version}, this build speaks {SHM_PROTOCOL_VERSION}"
            ));
        }
        let run = r.u64()?;
        if run != self.opts.run_id {
            return Err(format!(
                "a hello of run {run:#x}, this run is {:#x}",
                self.opts.run_id
            ));
        }
        let from = r.u32()?;
        let to = r.u32()?;
        if to != self.rank || !waiting.contains(&from) {
            return Err(format!(
                "worker {from} dialled worker {to}; worker {} waits for {waiting:?}",
                self.rank
            ));
        }
        let cap = r.u64()?;
        if cap != self.opts.ring_bytes {
            return Err(format!(
                "worker {from} asks for rings of {cap} bytes, this worker's are {}",
                self.opts.ring_bytes
            ));
        }
        let mut boot = [0u8; 36];
        boot.copy_from_slice(r.bytes(36)?);
        let theirs = HostId {
            boot,
            netns: (r.u64()?, r.u64()?),
        };
        if theirs != *host {
            return Err(format!(
                "worker {from} is on another host (its boot id or network namespace differs)"
            ));
        }
        if fds.len() != 2 {
            return Err(format!(
                "worker {from}'s hello carried {} descriptors, not 2",
                fds.len()
            ));
        }
        let bell = fds.pop().ok_or("no eventfd")?;
        let memfd = fds.pop().ok_or("no segment")?;
        Ok((from, cap, memfd, bell))
    }
}

/// Whether a frame's prefix begins in `ring` now, after `pad` bytes of padding were skipped:
/// its next byte is there and not padding.
///
/// # Errors
/// A message naming a ring that holds [`ALIGN`] or more zero bytes before a frame, which no
/// sender writes; the ring's own failures.
fn prefix_begins(ring: &Ring, pad: usize) -> Result<bool, String> {
    match ring.peek()? {
        Some(0) if pad >= ALIGN - 1 => Err(format!("{ALIGN} or more zero bytes before a frame")),
        Some(0) | None => Ok(false),
        Some(_) => Ok(true),
    }
}

impl Link {
    /// Reads the payload of `header` next, into a buffer of its own: a message kept by key
    /// until a receive takes it (counted against the bytes held).
    fn read_payload(&mut self, header: Header) {
        let len = header.payload_bytes() as usize;
        self.held += header.elements() * 4;
        self.copied_out += 1;
        let buf = Payload::for_header(&header);
        self.reading = Reading::Payload {
            header,
            buf,
            got: 0,
            len,
        };
    }

    fn new(
        peer: u32,
        socket: UnixStream,
        map: memmap2::MmapRaw,
        out: Ring,
        inp: Ring,
        bell: OwnedFd,
    ) -> Link {
        Link {
            peer,
            socket,
            _map: map,
            out,
            inp,
            bell,
            reading: Reading::default(),
            control: Vec::new(),
            state: PeerState::Running,
            held: 0,
            copied_out: 0,
            eof: false,
            control_ready: false,
            aborted: false,
            hosted: false,
        }
    }

    /// Wakes the peer (a write to its eventfd); a peer that is gone needs no waking.
    fn ring_bell(&self) {
        ring(&self.bell);
    }

    /// Reads the control records that have arrived on the socket, without waiting.
    /// Returns whether anything changed.
    fn read_control(&mut self, aborted_by: &mut Option<u32>) -> bool {
        let mut changed = false;
        let mut ended: Option<String> = None;
        let mut buf = [0u8; 64];
        loop {
            match (&self.socket).read(&mut buf) {
                Ok(0) => {
                    ended = Some(format!(
                        "worker {}'s process ended without closing its link (its socket closed)",
                        self.peer
                    ));
                    break;
                }
                Ok(n) => {
                    self.control.extend_from_slice(&buf[..n]);
                    changed = true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    ended = Some(format!("worker {}'s socket failed: {e}", self.peer));
                    break;
                }
            }
        }
        // Records before the end count: an abort, then the process ending, is an abort.
        while let Some(&record) = self.control.first() {
            match record {
                RECORD_CLOSE => {
                    self.control.remove(0);
                    if self.state == PeerState::Running {
                        self.state = PeerState::Closed;
                    }
                }
                RECORD_ABORT if self.control.len() >= 5 => {
                    let by = u32::from_le_bytes([
                        self.control[1],
                        self.control[2],
                        self.control[3],
                        self.control[4],
                    ]);
                    self.control.drain(..5);
                    self.aborted = true;
                    aborted_by.get_or_insert(by);
                }
                RECORD_ABORT => break,
                // The peer regroups without a lost worker: this generation has ended for it.
                // The record stays for this endpoint's own regroup to read.
                RECORD_REGROUP => {
                    self.aborted = true;
                    aborted_by.get_or_insert(self.peer);
                    break;
                }
                other => {
                    self.control.clear();
                    self.state = PeerState::Lost(format!(
                        "worker {} sent control record {other:#04x} on its link",
                        self.peer
                    ));
                }
            }
        }
        if let Some(why) = ended {
            self.eof = true;
            // A peer that aborted ends next: its end is the abort's echo, not a loss.
            if self.state == PeerState::Running && !self.aborted {
                self.state = PeerState::Lost(why);
            }
            changed = true;
        }
        changed
    }
}

/// No failure heard elsewhere.
const NO_ALARM: u64 = u64::MAX;

/// Tells a shared-memory endpoint of a failure heard by another transport of the same worker
/// ([`Shm::alarm`]), waking it if it is parked.
pub struct ShmAlarm {
    raised: Arc<AtomicU64>,
    bell: OwnedFd,
}

impl ShmAlarm {
    /// The run failed, naming `by`: the endpoint's calls return [`TransportError::Aborted`]
    /// naming it (the first alarm stands).
    pub fn raise(&self, by: u32) {
        let _ = self.raised.compare_exchange(
            NO_ALARM,
            u64::from(by),
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
        ring(&self.bell);
    }
}

impl Shm {
    /// A handle another transport of this worker raises when it hears of a failure, so that a
    /// call blocked here returns at once rather than when a peer of this host stops
    /// ([`crate::mixed::Mixed`]).
    ///
    /// # Errors
    /// [`TransportError::Setup`] when the wake-up descriptor cannot be duplicated.
    pub fn alarm(&self) -> Result<ShmAlarm, TransportError> {
        let bell = rustix::io::dup(&self.bell).map_err(|e| setup(format!("eventfd: {e}")))?;
        Ok(ShmAlarm {
            raised: self.raised.clone(),
            bell,
        })
    }

    /// The rank a failure of this endpoint names: the worker whose abort stopped this one,
    /// or the peer lost first.
    pub fn cause(&self) -> Option<u32> {
        self.aborted_by.or_else(|| {
            self.links.iter().flatten().find_map(|l| match l.state {
                PeerState::Lost(_) => Some(l.peer),
                _ => None,
            })
        })
    }

    /// [`Transport::abort`] naming `by` as the failure's cause: what an endpoint that holds
    /// this one among others ([`crate::mixed::Mixed`]) tells every peer.
    pub fn abort_as(&mut self, by: u32) {
        let by = *self.aborted_by.get_or_insert(by);
        let mut record = vec![RECORD_ABORT];
        record.extend_from_slice(&by.to_le_bytes());
        self.tell_all(&record);
    }

    /// Frames this endpoint has received by copying them out of a ring into a buffer of
    /// their own: every plain [`Transport::recv`], and a frame that arrived ahead of the one
    /// a receive waited for (or while a send waited for room). A lending ring all-reduce
    /// whose window fits the rings copies none.
    pub fn frames_copied_out(&self) -> u64 {
        self.links.iter().flatten().map(|l| l.copied_out).sum()
    }

    /// The link to `peer`, or a protocol error for a worker this endpoint has no link to.
    fn link_index(&self, peer: u32) -> Result<usize, TransportError> {
        if peer == self.rank || peer >= self.size {
            return Err(TransportError::Protocol(format!(
                "no peer {peer} for worker {} in a mesh of {}",
                self.rank, self.size
            )));
        }
        match self.links.get(peer as usize) {
            Some(Some(_)) => Ok(peer as usize),
            _ => Err(TransportError::Protocol(format!(
                "worker {} has no shared-memory link to worker {peer}",
                self.rank
            ))),
        }
    }

    /// The error every call gives once a peer is lost or an abort has arrived. A lost peer
    /// comes first: when a process dies, its neighbours' aborts follow its end, and the end
    /// names the worker that was lost.
    fn failure(&self) -> Option<TransportError> {
        let lost = self.links.iter().flatten().find_map(|l| match &l.state {
            PeerState::Lost(why) => Some(TransportError::Lost {
                peer: l.peer,
                why: why.clone(),
            }),
            _ => None,
        });
        let raised = self.raised.load(Ordering::SeqCst);
        let heard = (raised != NO_ALARM).then_some(raised as u32);
        lost.or(self
            .aborted_by
            .or(heard)
            .map(|by| TransportError::Aborted { by }))
    }

    /// Reads every ring's frames as far as they have arrived, keeping messages by key, and
    /// the control records of the links whose sockets have something: what a blocked call
    /// does, so that two workers sending to each other cannot deadlock. Link `want.0` stops
    /// at the frame a streaming receive waits for (`want.1`). Returns whether anything moved.
    fn pump(&mut self, want: Option<(usize, &Key)>) -> Result<bool, TransportError> {
        let mut moved = false;
        for i in 0..self.links.len() {
            let stop_at = want.filter(|(w, _)| *w == i).map(|(_, k)| k);
            moved |= self.pump_one(i, stop_at)?;
        }
        Ok(moved)
    }

    /// [`Shm::pump`] of link `i` alone: what a call that has not had to wait does, leaving
    /// the other rings to their receives.
    fn pump_one(&mut self, i: usize, stop_at: Option<&Key>) -> Result<bool, TransportError> {
        self.check_sockets();
        let Some(link) = self.links[i].as_mut() else {
            return Ok(false);
        };
        let mut moved = false;
        if link.control_ready && !link.eof {
            link.control_ready = false;
            moved |= link.read_control(&mut self.aborted_by);
        }
        Ok(self.read_link(i, stop_at)? || moved)
    }

    /// Marks the open links (in order) whose sockets a `poll` saw readable.
    fn mark_ready(&mut self, ready: Vec<bool>) {
        let open = self.links.iter_mut().flatten().filter(|l| !l.eof);
        for (link, r) in open.zip(ready) {
            link.control_ready |= r;
        }
    }

    /// Reads the control records of every link whose socket was seen readable.
    fn read_ready_controls(&mut self) {
        for link in self.links.iter_mut().flatten() {
            if link.control_ready && !link.eof {
                link.control_ready = false;
                link.read_control(&mut self.aborted_by);
            }
        }
    }

    /// Marks the links whose sockets have something to read, with one `poll` that does
    /// not wait, at most every [`SOCKET_CHECK`]: a worker that never has to wait still sees
    /// an abort or a peer's end that soon, without a system call per link per message.
    fn check_sockets(&mut self) {
        if self.checked.elapsed() < SOCKET_CHECK {
            return;
        }
        self.checked = Instant::now();
        let ready: Vec<bool> = {
            let mut fds: Vec<PollFd<'_>> = self
                .links
                .iter()
                .flatten()
                .filter(|l| !l.eof)
                .map(|l| PollFd::new(&l.socket, PollFlags::IN))
                .collect();
            if fds.is_empty() {
                return;
            }
            let zero = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            if rustix::event::poll(&mut fds, Some(&zero)).is_err() {
                // Read them all: a failed check must not hide an end.
                fds.iter().map(|_| true).collect()
            } else {
                fds.iter().map(|f| !f.revents().is_empty()).collect()
            }
        };
        self.mark_ready(ready);
    }

    /// Reads link `i`'s ring as far as it has bytes, keeping whole messages by key; stops at
    /// the header of the f32 frame keyed `stop_at`, held for a streaming receive. Returns
    /// whether it read any.
    fn read_link(&mut self, i: usize, stop_at: Option<&Key>) -> Result<bool, TransportError> {
        let (rank, limits, max_held) = (self.rank, self.limits, self.opts.max_held_bytes);
        let Some(link) = self.links[i].as_mut() else {
            return Ok(false);
        };
        let peer = link.peer;
        let broken = |why: String| broken_link(peer, why);
        let mut moved = false;
        loop {
            let read = match &mut link.reading {
                Reading::Prefix { buf, got, pad } => {
                    let mut skipped = 0;
                    if *got == 0 {
                        // Padding first, and the prefix only from its first (non-zero) byte:
                        // the padding may still be arriving.
                        skipped = link.inp.skip_padding(ALIGN - 1 - *pad).map_err(broken)?;
                        *pad += skipped;
                        if !prefix_begins(&link.inp, *pad).map_err(broken)? {
                            if skipped == 0 {
                                break;
                            }
                            moved = true;
                            continue;
                        }
                    }
                    let n = link.inp.read_some(&mut buf[*got..]).map_err(broken)?;
                    *got += n;
                    let n = n + skipped;
                    if *got == PREFIX_BYTES {
                        let len = frame::parse_prefix(buf).map_err(|e| broken(e.to_string()))?;
                        link.reading = Reading::Header {
                            buf: vec![0; len],
                            got: 0,
                        };
                    }
                    n
                }
                Reading::Header { buf, got } => {
                    let n = link.inp.read_some(&mut buf[*got..]).map_err(broken)?;
                    *got += n;
                    if *got == buf.len() {
                        let header =
                            frame::parse_header(buf, &limits).map_err(|e| broken(e.to_string()))?;
                        let key = header.key().map_err(|e| broken(e.to_string()))?;
                        if key.from != peer || key.to != rank {
                            return Err(broken(format!("a frame keyed {key:?}")));
                        }
                        if stop_at == Some(&key) && header.dtype == WireDType::F32 {
                            // Held for the streaming receive: the next turn stops here.
                            link.reading = Reading::Held { header, got: 0 };
                        } else {
                            if link.held + header.elements() * 4 > max_held {
                                return Err(broken(format!(
                                    "more than {max_held} bytes wait for this worker's receives"
                                )));
                            }
                            link.read_payload(header);
                        }
                    }
                    n
                }
                Reading::Payload { buf, got, len, .. } => {
                    let n = buf.fill(&link.inp, *got, *len).map_err(broken)?;
                    *got += n;
                    n
                }
                Reading::Held { header, got } => {
                    let held_key = header.key().map_err(|e| broken(e.to_string()))?;
                    if stop_at == Some(&held_key) {
                        return Ok(moved);
                    }
                    if *got > 0 {
                        return Err(broken(format!(
                            "{held_key:?} was cut short while it was being received"
                        )));
                    }
                    // Another call needs what lies behind it: keep it as a message after all.
                    let header = header.clone();
                    link.read_payload(header);
                    continue;
                }
            };
            if read > 0 {
                moved = true;
                // Space freed: a producer waiting for it must hear, whatever comes next.
                if link.inp.writer_parked().load(Ordering::SeqCst) != 0 {
                    link.ring_bell();
                }
            }
            let complete = matches!(&link.reading, Reading::Payload { got, len, .. } if got == len);
            if complete {
                if let Reading::Payload { header, buf, .. } = std::mem::take(&mut link.reading) {
                    let m = buf
                        .into_message(&header)
                        .map_err(|e| broken(e.to_string()))?;
                    self.early.keep(m)?;
                    moved = true;
                    continue;
                }
            }
            if read == 0 {
                break;
            }
        }
        Ok(moved)
    }

    /// Hands the held frame of link `i` to `take`, block by block, as far as its payload has
    /// arrived: each block is copied from the ring into a small buffer that stays in cache
    /// and lent from there. Returns the payload's element count once all of it is handed
    /// over (the link then reads on), and whether any bytes moved.
    fn lend(
        &mut self,
        i: usize,
        take: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(Option<usize>, bool), TransportError> {
        let Some(link) = self.links[i].as_mut() else {
            return Ok((None, false));
        };
        let Reading::Held { header, got } = &mut link.reading else {
            return Ok((None, false));
        };
        let peer = link.peer;
        let broken = |why: String| broken_link(peer, why);
        let len = header.payload_bytes() as usize;
        let mut moved = false;
        while *got < len {
            // In place where the payload lies aligned (a padded frame); through the small
            // buffer otherwise.
            let off = *got / 4;
            let lent = link
                .inp
                .lend_some(len - *got, &mut |values| take(off, values))
                .map_err(broken)?;
            let read = if lent > 0 {
                lent
            } else {
                let (head, tail) = link.inp.positions().map_err(broken)?;
                let whole = ((head - tail) as usize / 4 * 4).min(len - *got);
                let n = whole.min(self.bounce.len() * 4);
                if n == 0 {
                    break;
                }
                // SAFETY: the bounce buffer holds at least `n` bytes.
                let read = unsafe { link.inp.read_raw(self.bounce.as_mut_ptr().cast::<u8>(), n) }
                    .map_err(broken)?;
                take(off, &self.bounce[..read / 4]);
                read
            };
            *got += read;
            moved = true;
            if link.inp.writer_parked().load(Ordering::SeqCst) != 0 {
                ring(&link.bell);
            }
        }
        if *got < len {
            return Ok((None, moved));
        }
        let elements = len / 4;
        link.reading = Reading::default();
        Ok((Some(elements), true))
    }

    /// Checks that `key` is addressed to this worker and returns its link.
    fn link_for(&self, key: &Key) -> Result<usize, TransportError> {
        if key.to != self.rank {
            return Err(TransportError::Protocol(format!(
                "worker {} asked for a message addressed to {}",
                self.rank, key.to
            )));
        }
        self.link_index(key.from)
    }

    /// Whether link `i`'s peer has closed and left nothing more to read.
    fn drained_and_closed(&self, i: usize) -> bool {
        self.links[i].as_ref().is_some_and(|l| {
            l.state == PeerState::Closed
                && !l.inp.readable()
                && matches!(l.reading, Reading::Prefix { got: 0, .. })
        })
    }

    /// The receive loop behind [`Transport::recv`] (`take` absent: the whole message) and
    /// [`Transport::recv_with`] (`take` present: the payload lent as it arrives).
    fn receive(
        &mut self,
        key: &Key,
        mut take: Option<&mut Taker<'_>>,
    ) -> Result<Received, TransportError> {
        let i = self.link_for(key)?;
        let start = Instant::now();
        let deadline = crate::stall_deadline(self.opts.timeout, key, start);
        let stop_at = take.is_some().then_some(key);
        let mut idle = 0;
        loop {
            if let Some(m) = self.early.take(key) {
                return Ok(Received::Whole(self.handed(m)));
            }
            // What its sender wrote before a failure elsewhere is delivered: a follower
            // waiting for the chief's word at a segment's end takes it even when another
            // peer died meanwhile, and stands where the chief does.
            let mut moved = self.pump_one(i, stop_at)?;
            if let Some(m) = self.early.take(key) {
                return Ok(Received::Whole(self.handed(m)));
            }
            if let Some(take) = take.as_mut() {
                let (done, lent) = self.lend(i, *take)?;
                if let Some(n) = done {
                    return Ok(Received::Lent(n));
                }
                moved |= lent;
            }
            self.may_wait_on(i, key, (start, deadline))?;
            if !moved {
                // Blocked: read every other ring too, so no cycle of full rings can form.
                moved = self.pump(Some((i, key)).filter(|_| stop_at.is_some()))?;
            }
            self.back_off(moved, &mut idle, deadline, None)?;
        }
    }

    /// Why a wait for `key` on link `i`, begun at `start`, cannot go on: a failure, the
    /// link closed with nothing left to read, or the deadline passed.
    fn may_wait_on(
        &self,
        i: usize,
        key: &Key,
        (start, deadline): (Instant, Option<Instant>),
    ) -> Result<(), TransportError> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        if self.drained_and_closed(i) {
            return Err(TransportError::Closed { peer: key.from });
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(TransportError::Timeout {
                key: *key,
                waited: start.elapsed(),
            });
        }
        Ok(())
    }

    /// [`Transport::wait_for`]: the blocked loop of [`Shm::receive`], which reads every other
    /// ring while link `i`'s is empty, ended as soon as a message that `notice` picks is
    /// among those read. A frame of `key` that can be lent stays in its ring.
    fn wait_noticing(
        &mut self,
        key: &Key,
        notice: &dyn Fn(&Key) -> bool,
    ) -> Result<bool, TransportError> {
        let i = self.link_for(key)?;
        let start = Instant::now();
        let deadline = crate::stall_deadline(self.opts.timeout, key, start);
        let noticed_before = self.early.count(notice);
        let mut idle = 0;
        loop {
            let mut moved = self.pump_one(i, Some(key))?;
            let held = self.links[i].as_ref().is_some_and(|l| {
                matches!(&l.reading, Reading::Held { header, .. } if header.key().is_ok_and(|k| k == *key))
            });
            if held || self.early.holds(key) {
                return Ok(true);
            }
            self.may_wait_on(i, key, (start, deadline))?;
            if !moved {
                moved = self.pump(Some((i, key)))?;
                if self.early.count(notice) > noticed_before {
                    return Ok(false);
                }
            }
            self.back_off(moved, &mut idle, deadline, None)?;
        }
    }

    /// The wait at the end of a round of a blocked loop: none after a round that `moved`
    /// (which starts the count in `idle` again), else the core given away for the first
    /// [`YIELDS_BEFORE_PARKING`] rounds in a row, then [`Shm::park`] with `deadline` and
    /// `writing`.
    fn back_off(
        &mut self,
        moved: bool,
        idle: &mut u32,
        deadline: Option<Instant>,
        writing: Option<usize>,
    ) -> Result<(), TransportError> {
        if moved {
            *idle = 0;
        } else if *idle < YIELDS_BEFORE_PARKING {
            *idle += 1;
            std::thread::yield_now();
        } else {
            self.park(deadline, writing)?;
        }
        Ok(())
    }

    /// Sleeps until a peer writes, frees space, sends a control record or goes, or until
    /// `deadline`. Flags this worker as parked on every incoming ring (and on the outgoing
    /// ring of `writing`), drains its eventfd, and returns at once if anything moved since.
    fn park(
        &mut self,
        deadline: Option<Instant>,
        writing: Option<usize>,
    ) -> Result<(), TransportError> {
        for link in self.links.iter().flatten() {
            link.inp.reader_parked().store(1, Ordering::SeqCst);
        }
        if let Some(Some(link)) = writing.map(|i| &self.links[i]) {
            link.out.writer_parked().store(1, Ordering::SeqCst);
        }
        let mut word = [0u8; 8];
        let _ = rustix::io::read(&self.bell, &mut word);
        let ready = self.raised.load(Ordering::SeqCst) != NO_ALARM
            || self.links.iter().flatten().any(|l| l.inp.readable())
            || writing.is_some_and(|i| {
                self.links[i]
                    .as_ref()
                    .is_some_and(|l| l.out.positions().is_ok_and(|(h, t)| h - t < l.out.cap))
            });
        if !ready {
            let timeout = deadline.map(|d| {
                let left = d.saturating_duration_since(Instant::now());
                rustix::event::Timespec {
                    tv_sec: left.as_secs() as i64,
                    tv_nsec: i64::from(left.subsec_nanos()),
                }
            });
            let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(self.links.len() + 1);
            fds.push(PollFd::new(&self.bell, PollFlags::IN));
            for link in self.links.iter().flatten() {
                if !link.eof {
                    fds.push(PollFd::new(&link.socket, PollFlags::IN));
                }
            }
            match rustix::event::poll(&mut fds, timeout.as_ref()) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(setup(format!("waiting on shared memory: {e}"))),
            }
            let ready: Vec<bool> = fds[1..].iter().map(|f| !f.revents().is_empty()).collect();
            drop(fds);
            self.mark_ready(ready);
        }
        for link in self.links.iter().flatten() {
            link.inp.reader_parked().store(0, Ordering::SeqCst);
        }
        if let Some(Some(link)) = writing.map(|i| &self.links[i]) {
            link.out.writer_parked().store(0, Ordering::SeqCst);
        }
        Ok(())
    }

    /// Writes a frame's prefix and header (`head`) into link `i`'s ring, after as many zero
    /// bytes as put its payload on a cache-line boundary of the ring, so that the receiver
    /// can lend the payload's values where they lie.
    fn write_head(&mut self, i: usize, head: &[u8]) -> Result<(), String> {
        let link = self.links[i].as_ref().ok_or("no link")?;
        let (at, _) = link
            .out
            .positions()
            .map_err(|why| format!("shared-memory link to worker {}: {why}", link.peer))?;
        let pad = (ALIGN - (at as usize + head.len()) % ALIGN) % ALIGN;
        self.write_all(i, &[0u8; ALIGN][..pad])?;
        self.write_all(i, head)
    }

    /// Writes `bytes` into link `i`'s ring, in pieces as space frees, reading every
    /// incoming ring while it waits.
    fn write_all(&mut self, i: usize, bytes: &[u8]) -> Result<(), String> {
        let mut off = 0;
        let mut idle = 0;
        while off < bytes.len() {
            let link = self.links[i].as_ref().ok_or("no link")?;
            let n = link
                .out
                .write_some(&bytes[off..])
                .map_err(|why| format!("shared-memory link to worker {}: {why}", link.peer))?;
            if n > 0 {
                off += n;
                if link.out.reader_parked().load(Ordering::SeqCst) != 0 {
                    link.ring_bell();
                }
                continue;
            }
            let moved = self.pump(None).map_err(|e| e.to_string())?;
            if let Some(e) = self.failure() {
                return Err(e.to_string());
            }
            if let Some(Some(link)) = self.links.get(i) {
                if link.state != PeerState::Running {
                    return Err(format!("worker {} has closed its link", link.peer));
                }
            }
            self.back_off(moved, &mut idle, None, Some(i))
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Hands a held message to the program, counting it off its peer's bound.
    fn handed(&mut self, m: Message) -> Message {
        if let Some(Some(link)) = self.links.get_mut(m.key.from as usize) {
            let bytes = m.tensor.len() as u64 * 4;
            link.held = link.held.saturating_sub(bytes.min(link.held));
        }
        m
    }

    /// Sends `bytes` (one control record) on every link's socket, best effort.
    fn tell_all(&self, record: &[u8]) {
        for link in self.links.iter().flatten() {
            let _ = (&link.socket).write_all(record);
        }
    }
}

impl Transport for Shm {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    fn send(&mut self, message: Message) -> Result<(), TransportError> {
        let i = match self.link_index(message.key.to) {
            Ok(i) => i,
            Err(e) => return Err(TransportError::unsent(message, e.to_string())),
        };
        self.check_sockets();
        self.read_ready_controls();
        if let Some(e) = self.failure() {
            return Err(e);
        }
        if self.links[i]
            .as_ref()
            .is_some_and(|l| l.state != PeerState::Running)
        {
            let reason = format!("worker {} is gone", message.key.to);
            return Err(TransportError::unsent(message, reason));
        }
        if let Err(e) = message.tensor.host() {
            let why = e.to_string();
            return Err(TransportError::unsent(message, why));
        }
        let written = {
            let values = message.tensor.host().unwrap_or_default();
            let wire = match message.key.kind {
                Kind::Chunk if frame::exact_in_bf16(values) => WireDType::Bf16,
                kind => crate::inproc::wire_for(kind, self.opts.wire),
            };
            let header = frame::header_of(&message, self.opts.run_id, wire);
            match frame::encode_header(&header) {
                Err(e) => Err(e.to_string()),
                Ok(head) if wire == WireDType::F32 && cfg!(target_endian = "little") => self
                    .write_head(i, &head)
                    .and_then(|()| self.write_all(i, bytemuck::cast_slice(values))),
                Ok(head) => {
                    let mut payload = Vec::with_capacity(values.len() * wire.size());
                    frame::encode_payload(values, wire, &mut payload);
                    self.write_head(i, &head)
                        .and_then(|()| self.write_all(i, &payload))
                }
            }
        };
        match written {
            Ok(()) => Ok(()),
            Err(why) => match self.failure() {
                Some(TransportError::Aborted { by }) => Err(TransportError::Aborted { by }),
                _ => Err(TransportError::unsent(message, why)),
            },
        }
    }

    fn recv(&mut self, key: &Key) -> Result<Message, TransportError> {
        match self.receive(key, None)? {
            Received::Whole(m) => Ok(m),
            Received::Lent(_) => Err(TransportError::Protocol(format!(
                "{key:?} was lent without a taker"
            ))),
        }
    }

    fn try_recv(&mut self, key: &Key) -> Result<Option<Message>, TransportError> {
        let i = self.link_for(key)?;
        if let Some(m) = self.early.take(key) {
            return Ok(Some(self.handed(m)));
        }
        self.pump_one(i, None)?;
        if let Some(e) = self.failure() {
            return Err(e);
        }
        Ok(self.early.take(key).map(|m| self.handed(m)))
    }

    fn copies_payloads(&self) -> bool {
        true
    }

    fn link_buffer_bytes(&self) -> Option<u64> {
        Some(self.opts.ring_bytes)
    }

    fn send_values(&mut self, values: Values<'_>) -> Result<(), TransportError> {
        let Values {
            key,
            version,
            parts,
        } = values;
        let wire = crate::inproc::wire_for(key.kind, self.opts.wire);
        let i = self.link_index(key.to)?;
        if wire != WireDType::F32 || !cfg!(target_endian = "little") {
            return self.send(Message::of_values(values)?);
        }
        if let Some(e) = self.failure() {
            return Err(e);
        }
        if self.links[i]
            .as_ref()
            .is_some_and(|l| l.state != PeerState::Running)
        {
            return Err(TransportError::Closed { peer: key.to });
        }
        let n: usize = parts.iter().map(|p| p.len()).sum();
        let header = frame::header_for(key, version, vec![n as u64], self.opts.run_id, wire);
        let head = frame::encode_header(&header)
            .map_err(|e| TransportError::Protocol(format!("{key:?}: {e}")))?;
        let mut written = self.write_head(i, &head);
        for part in parts {
            written = written.and_then(|()| self.write_all(i, bytemuck::cast_slice(part)));
        }
        written.map_err(|why| match self.failure() {
            Some(e) => e,
            None => TransportError::Protocol(why),
        })
    }

    fn recv_with(&mut self, key: &Key, take: &mut ValueSink<'_>) -> Result<usize, TransportError> {
        match self.receive(key, Some(&mut *take))? {
            Received::Lent(n) => Ok(n),
            Received::Whole(m) => m.hand_to(take),
        }
    }

    fn try_recv_with(
        &mut self,
        key: &Key,
        take: &mut ValueSink<'_>,
    ) -> Result<Option<usize>, TransportError> {
        let i = self.link_for(key)?;
        // Reads the link as far as the frame asked for, which it holds for lending.
        self.pump_one(i, Some(key))?;
        if let Some(m) = self.early.take(key) {
            return self.handed(m).hand_to(take).map(Some);
        }
        if let Some(e) = self.failure() {
            return Err(e);
        }
        // Lent only once the whole payload is in the ring, so a poll never waits.
        let whole = self.links[i].as_ref().is_some_and(|l| match &l.reading {
            Reading::Held { header, got } => l
                .inp
                .positions()
                .is_ok_and(|(h, t)| (h - t) as usize >= header.payload_bytes() as usize - got),
            _ => false,
        });
        if !whole {
            return Ok(None);
        }
        Ok(self.lend(i, take)?.0)
    }

    fn wait_for(
        &mut self,
        key: &Key,
        notice: &dyn Fn(&Key) -> bool,
    ) -> Result<bool, TransportError> {
        self.wait_noticing(key, notice)
    }

    fn buffered(&self) -> usize {
        self.early.len()
    }

    fn abort(&mut self) {
        // A worker stopping because a peer died names that peer, not itself (as over QUIC),
        // so that every worker's error points at the rank that died, whichever saw it first.
        let by = self.cause().unwrap_or(self.rank);
        self.abort_as(by);
    }

    fn regroup_address(&mut self) -> Option<Result<String, TransportError>> {
        Some(self.ready_to_regroup())
    }

    fn regroup(
        &mut self,
        lost: u32,
        host: Option<u32>,
    ) -> Result<crate::Regrouped, TransportError> {
        let (mesh, hosted) = self.regrouped(lost, host)?;
        Ok((
            Box::new(mesh),
            hosted.map(|h| Box::new(h) as Box<dyn Transport + Send>),
        ))
    }

    fn close(&mut self) -> Result<(), TransportError> {
        // Every byte sent is in the rings, which the peers keep mapped: nothing to wait for.
        if !self.closed && self.aborted_by.is_none() {
            self.tell_all(&[RECORD_CLOSE]);
        }
        self.closed = true;
        Ok(())
    }
    fn carries_device_tensors(&self) -> bool {
        false
    }
    /// Every peer of a segment is on this host (a hello from another host is refused); a
    /// narrower wire type is rounded on the host, so a handle stands in only on an f32 wire.
    fn lends_device_buffers(&self, peer: u32) -> bool {
        self.opts.wire == WireDType::F32 && self.link_index(peer).is_ok()
    }
    fn interrupter(&self) -> Option<crate::Interrupter> {
        None
    }
    crate::no_network_links!();
}

impl Drop for Shm {
    /// Dropping an endpoint closes it, as over QUIC: what it sent stays readable.
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// What a peer's link did wrong, naming the link.
fn broken_link(peer: u32, why: String) -> TransportError {
    TransportError::Protocol(format!("shared-memory link from worker {peer}: {why}"))
}

/// Writes to an eventfd: wakes the worker that waits on it.
fn ring(bell: &OwnedFd) {
    let _ = rustix::io::write(bell, &1u64.to_ne_bytes());
}

/// What a peer that never joins over shared memory may mean.
const ONE_HOST: &str = " (shared memory joins the workers of one host: a run on several hosts \
                        needs --transport quic or auto)";

/// Accepts one connection on a non-blocking listener, waiting until `deadline`.
fn accept_by(listener: &UnixListener, deadline: Instant) -> Result<UnixStream, String> {
    loop {
        match listener.accept() {
            Ok((s, _)) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.to_string()),
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err("no connection before the connect timeout".into());
        }
        let mut fds = [PollFd::new(listener, PollFlags::IN)];
        let t = rustix::event::Timespec {
            tv_sec: left.as_secs() as i64,
            tv_nsec: i64::from(left.subsec_nanos()),
        };
        match rustix::event::poll(&mut fds, Some(&t)) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Refuses a peer process of another user (its credentials come from the kernel).
fn same_user(socket: &UnixStream) -> Result<(), String> {
    let cred = rustix::net::sockopt::socket_peercred(socket)
        .map_err(|e| format!("reading the peer's credentials: {e}"))?;
    let own = rustix::process::geteuid();
    if cred.uid != own {
        return Err(format!(
            "a process of user {} (pid {}) is not this run's user {}",
            cred.uid.as_raw(),
            cred.pid.as_raw_nonzero(),
            own.as_raw()
        ));
    }
    Ok(())
}

fn set_timeout(socket: &UnixStream, deadline: Instant) -> Result<(), String> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(10));
    socket
        .set_read_timeout(Some(left))
        .map_err(|e| format!("socket: {e}"))
}

/// Sends one handshake message with `fds` attached.
fn send_with_fds(socket: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), String> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err("descriptors do not fit the control buffer".into());
    }
    let len = (bytes.len() as u16).to_le_bytes();
    let iov = [IoSlice::new(&len), IoSlice::new(bytes)];
    let sent = rustix::net::sendmsg(socket, &iov, &mut control, SendFlags::NOSIGNAL)
        .map_err(|e| format!("sending the handshake: {e}"))?;
    if sent != bytes.len() + 2 {
        return Err("the handshake was cut short".into());
    }
    Ok(())
}

/// Receives one handshake message and at most `max_fds` descriptors (more are closed and
/// refused).
fn recv_with_fds(socket: &UnixStream, max_fds: usize) -> Result<(Vec<u8>, Vec<OwnedFd>), String> {
    let mut buf = vec![0u8; MAX_HANDSHAKE + 2];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        rustix::net::recvmsg(socket, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)
            .map_err(|e| format!("reading the handshake: {e}"))?
    };
    let mut fds = Vec::new();
    take_fds(&mut control, got.flags, &mut fds, max_fds)
        .map_err(|most| format!("the handshake carried more than {most} descriptors"))?;
    if got.bytes < 2 {
        return Err("the peer closed during the handshake".into());
    }
    let len = u16::from_le_bytes([buf[0], buf[1]]) as usize;
    if len > MAX_HANDSHAKE || got.bytes != len + 2 {
        return Err(format!(
            "a handshake of {} bytes announcing {len}",
            got.bytes.saturating_sub(2)
        ));
    }
    buf.truncate(len + 2);
    buf.drain(..2);
    Ok((buf, fds))
}

/// Moves the descriptors a `recvmsg` received in `control` into `fds`; `Err(max)` where they
/// were cut short or `fds` would hold more than `max` (those received are closed).
fn take_fds(
    control: &mut RecvAncillaryBuffer<'_>,
    flags: rustix::net::ReturnFlags,
    fds: &mut Vec<OwnedFd>,
    max: usize,
) -> Result<(), usize> {
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = msg {
            fds.extend(rights);
        }
    }
    if flags.contains(rustix::net::ReturnFlags::CTRUNC) || fds.len() > max {
        return Err(max);
    }
    Ok(())
}

/// Reads a handshake's fixed-width little-endian fields, refusing a short one.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn new(b: &'a [u8]) -> Self {
        Fields(b)
    }
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("the handshake is cut short".into());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.bytes(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        let b = self.bytes(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, String> {
        let mut w = [0u8; 4];
        w.copy_from_slice(self.bytes(4)?);
        Ok(u32::from_le_bytes(w))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut w = [0u8; 8];
        w.copy_from_slice(self.bytes(8)?);
        Ok(u64::from_le_bytes(w))
    }
    fn rest(&self) -> &'a [u8] {
        self.0
    }
}

/// Bytes of a segment with two rings of `cap` bytes.
fn segment_bytes(cap: u64) -> u64 {
    DATA_START as u64 + 2 * cap
}

/// The segment header: magic, version, ring size, run and the link's two ranks.
fn segment_header(run_id: u64, low: u32, high: u32, cap: u64) -> Vec<u8> {
    let mut h = SEGMENT_MAGIC.to_vec();
    h.extend_from_slice(&SHM_PROTOCOL_VERSION.to_le_bytes());
    h.extend_from_slice(&cap.to_le_bytes());
    h.extend_from_slice(&run_id.to_le_bytes());
    h.extend_from_slice(&low.to_le_bytes());
    h.extend_from_slice(&high.to_le_bytes());
    h
}

/// Creates the sealed segment of the link between `low` and `high`, mapped.
fn create_segment(
    run_id: u64,
    low: u32,
    high: u32,
    cap: u64,
) -> Result<(OwnedFd, memmap2::MmapRaw), String> {
    let fd = rustix::fs::memfd_create("pipe-shm", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(|e| format!("memfd_create: {e}"))?;
    rustix::fs::ftruncate(&fd, segment_bytes(cap))
        .map_err(|e| format!("sizing the segment: {e}"))?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
        .map_err(|e| format!("sealing the segment: {e}"))?;
    let file = std::fs::File::from(fd.try_clone().map_err(|e| e.to_string())?);
    let map = memmap2::MmapOptions::new()
        .len(segment_bytes(cap) as usize)
        .map_raw(&file)
        .map_err(|e| format!("mapping the segment: {e}"))?;
    let header = segment_header(run_id, low, high, cap);
    // SAFETY: the mapping is at least DATA_START bytes and nobody else has it yet.
    unsafe { std::ptr::copy_nonoverlapping(header.as_ptr(), map.as_mut_ptr(), header.len()) };
    Ok((fd, map))
}

/// Maps a segment a peer sent, after checking its seals, size and header.
fn map_segment(
    fd: &OwnedFd,
    run_id: u64,
    low: u32,
    high: u32,
    cap: u64,
) -> Result<memmap2::MmapRaw, String> {
    let seals = rustix::fs::fcntl_get_seals(fd).map_err(|e| format!("the segment: {e}"))?;
    if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
        return Err("the segment is not sealed against resizing".into());
    }
    let size = rustix::fs::fstat(fd)
        .map_err(|e| format!("the segment: {e}"))?
        .st_size as u64;
    if size != segment_bytes(cap) {
        return Err(format!(
            "a segment of {size} bytes for rings of {cap} (expected {})",
            segment_bytes(cap)
        ));
    }
    let file = std::fs::File::from(fd.try_clone().map_err(|e| e.to_string())?);
    let map = memmap2::MmapOptions::new()
        .len(size as usize)
        .map_raw(&file)
        .map_err(|e| format!("mapping the segment: {e}"))?;
    let expected = segment_header(run_id, low, high, cap);
    // SAFETY: the mapping holds DATA_START bytes and more.
    let got = unsafe { std::slice::from_raw_parts(map.as_ptr(), expected.len()) };
    if got != expected.as_slice() {
        return Err("the segment's header does not name this run and link".into());
    }
    Ok(map)
}

/// The segment's two rings: (low to high, high to low).
fn rings(map: &memmap2::MmapRaw, cap: u64) -> (Ring, Ring) {
    let base = map.as_mut_ptr();
    let ring = |k: usize| Ring {
        // SAFETY: offsets inside the mapping of `segment_bytes(cap)` bytes.
        header: unsafe { base.add(RING_HEADERS[k]) },
        data: unsafe { base.add(DATA_START + k * cap as usize) },
        cap,
    };
    (ring(0), ring(1))
}

/// A full mesh of `workers` shared-memory endpoints in this process (threads; for tests and
/// benchmarks), through the same sockets and handshake as worker processes, in a fresh
/// private directory.
///
/// # Errors
/// As [`ShmBound::bind`] and [`ShmBound::connect`].
pub fn local_mesh(workers: u32, opts: &ShmOptions) -> Result<Vec<Shm>, TransportError> {
    static MESHES: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "pipe-shm-{}-{}",
        std::process::id(),
        MESHES.fetch_add(1, Ordering::SeqCst)
    ));
    let bound = (0..workers)
        .map(|r| ShmBound::bind(&dir, r, workers, opts.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    let joined: Vec<Result<Shm, TransportError>> = std::thread::scope(|s| {
        let handles: Vec<_> = bound
            .into_iter()
            .map(|b| s.spawn(move || b.connect()))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(setup("a connecting thread panicked".into())))
            })
            .collect()
    });
    let _ = std::fs::remove_dir_all(&dir);
    joined.into_iter().collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::os::fd::AsRawFd;

    use super::*;

    const RUN: u64 = 0x7e57;

    fn fresh_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pipe-shm-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// Rank 0 of two, connecting in a thread (it waits for rank 1).
    fn victim(
        dir: &Path,
        connect_timeout: Duration,
    ) -> std::thread::JoinHandle<Result<Shm, TransportError>> {
        let mut opts = ShmOptions::new(RUN);
        opts.ring_bytes = 4096;
        opts.connect_timeout = connect_timeout;
        let bound = ShmBound::bind(dir, 0, 2, opts).unwrap();
        std::thread::spawn(move || bound.connect())
    }

    fn hello(run: u64, cap: u64, host: &HostId) -> Vec<u8> {
        let mut h = HELLO_MAGIC.to_vec();
        h.extend_from_slice(&SHM_PROTOCOL_VERSION.to_le_bytes());
        h.extend_from_slice(&run.to_le_bytes());
        h.extend_from_slice(&1u32.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&cap.to_le_bytes());
        host.encode(&mut h);
        h
    }

    /// A peer written by hand that dials rank 0 in `dir` as rank 1 with `hello`; returns
    /// its socket, its mapping of the segment and rank 0's answer.
    fn hostile_peer(dir: &Path, hello: &[u8]) -> (UnixStream, memmap2::MmapRaw, Vec<u8>) {
        let socket = UnixStream::connect(socket_path(dir, 0)).unwrap();
        let (memfd, map) = create_segment(RUN, 0, 1, 4096).unwrap();
        let bell = rustix::event::eventfd(0, EventfdFlags::CLOEXEC).unwrap();
        send_with_fds(&socket, hello, &[memfd.as_fd(), bell.as_fd()]).unwrap();
        let (answer, _) = recv_with_fds(&socket, 1).unwrap();
        (socket, map, answer)
    }

    /// Rank 0 in a fresh directory for `name`, connected to a hostile rank 1 it admitted;
    /// returns the directory, rank 0's endpoint, and the peer's socket (kept open) and
    /// mapping of the segment.
    fn admitted_hostile_peer(name: &str) -> (PathBuf, Shm, UnixStream, memmap2::MmapRaw) {
        let dir = fresh_dir(name);
        let v = victim(&dir, Duration::from_secs(10));
        let host = HostId::current().unwrap();
        let (socket, map, answer) = hostile_peer(&dir, &hello(RUN, 4096, &host));
        assert_eq!(answer[8], 0, "admitted");
        let ep = v.join().unwrap().unwrap();
        (dir, ep, socket, map)
    }

    fn activation_from_1() -> Key {
        crate::measure::key(1, 0, 0)
    }

    /// The error rank 0 gives receiving from a hostile rank 1: a protocol error naming the
    /// link and saying `why`.
    fn refused_naming_the_link(ep: &mut Shm, why: &str) {
        let e = ep.recv(&activation_from_1()).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, TransportError::Protocol(_)), "{text}");
        assert!(text.contains("from worker 1"), "{text}");
        assert!(text.contains(why), "{text}");
    }

    #[test]
    fn a_ring_position_out_of_bounds_is_refused_naming_the_link() {
        let (dir, mut ep, _socket, map) = admitted_hostile_peer("bounds");
        // The peer claims to have written three rings' worth.
        let (_, to_victim) = rings(&map, 4096);
        to_victim.head().store(3 * 4096, Ordering::SeqCst);
        refused_naming_the_link(&mut ep, "out of bounds");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_frame_with_a_corrupt_header_length_is_refused_naming_the_link() {
        let (dir, mut ep, _socket, map) = admitted_hostile_peer("length");
        let (_, to_victim) = rings(&map, 4096);
        let mut prefix = frame::MAGIC.to_vec();
        prefix.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(to_victim.write_some(&prefix).unwrap(), prefix.len());
        refused_naming_the_link(&mut ep, "header of");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn peers_of_another_host_or_run_are_refused() {
        let host = HostId::current().unwrap();
        let mut elsewhere = host;
        elsewhere.netns.1 ^= 1;
        for (name, hello, why) in [
            ("host", hello(RUN, 4096, &elsewhere), "on another host"),
            ("run", hello(RUN + 1, 4096, &host), "of run"),
            ("ring", hello(RUN, 8192, &host), "rings of 8192 bytes"),
        ] {
            let dir = fresh_dir(name);
            let v = victim(&dir, Duration::from_millis(800));
            let (_socket, _map, answer) = hostile_peer(&dir, &hello);
            assert_eq!(&answer[..8], &ANSWER_MAGIC);
            assert_eq!(answer[8], 1, "{name}: refused");
            let text = String::from_utf8_lossy(&answer[9..]).into_owned();
            assert!(text.contains(why), "{name}: {text}");
            // The refused peer is not rank 1: rank 0 still waits for one, then gives up.
            let e = v.join().unwrap().unwrap_err();
            assert!(e.to_string().contains("[1]"), "{e}");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    /// Another user can neither reach the socket nor open the segment: checked from a thread
    /// that runs as `nobody` where the tests run as root (a thread's credentials are its own
    /// on Linux), and by the modes otherwise.
    #[test]
    fn another_user_cannot_reach_the_socket_or_open_the_segment() {
        let dir = fresh_dir("intruder");
        let bound = ShmBound::bind(&dir, 0, 2, ShmOptions::new(RUN)).unwrap();
        let (memfd, _map) = create_segment(RUN, 0, 1, 4096).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&bound.path()), 0o600);
        let segment = format!("/proc/{}/fd/{}", std::process::id(), memfd.as_raw_fd());
        let socket = bound.path();
        if rustix::process::geteuid().is_root() {
            // The socket, from a thread of this process running as nobody.
            let connect = std::thread::spawn(move || {
                // Only this thread changes user, and it ends right after.
                let nobody = rustix::process::Uid::from_raw(65534);
                rustix::thread::set_thread_res_uid(nobody, nobody, nobody).unwrap();
                UnixStream::connect(&socket).map(|_| ())
            })
            .join()
            .unwrap();
            assert_eq!(
                connect.unwrap_err().kind(),
                std::io::ErrorKind::PermissionDenied
            );
            // The segment, from a process of nobody's (a thread of this process would pass
            // /proc's same-process check).
            use std::os::unix::process::CommandExt as _;
            let out = std::process::Command::new("cat")
                .arg(&segment)
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "nobody read the segment");
            assert!(err.contains("Permission denied"), "{err}");
        } else {
            eprintln!("not root: checked the modes only");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
