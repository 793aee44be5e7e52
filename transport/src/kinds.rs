//! The registry of transports: [`TRANSPORTS`] lists every transport's [`Registration`] (its
//! name, what it can do, how its endpoints are built for the threads of one process and for
//! a worker process joining its cluster), and everything that offers a choice of transport
//! iterates it: parsing `--transport` and its value list, the link costs the planner charges,
//! `pipe bench transport`, and the transport tests. The rule of `auto` is written here once:
//! channels between threads, shared memory between the processes a launcher started on one
//! host, and for a cluster file's workers a choice per link (QUIC to every peer first, whose
//! hellos say which peers share this host, then shared memory to those, [`crate::mixed`]).
//!
//! Adding a transport is its module, which defines its `REGISTRATION`, and one line in
//! [`TRANSPORTS`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::cluster::ClusterFile;
use crate::frame::WireDType;
use crate::inproc::InProcOptions;
use crate::mixed::Mixed;
use crate::quic::{self, QuicOptions};
use crate::shm::{self, ShmBound, ShmOptions};
use crate::{Transport, TransportError, TransportKind};

/// Every transport, in the order choices list them and costs are measured.
pub const TRANSPORTS: &[&Registration] = &[
    &crate::inproc::REGISTRATION,
    &shm::REGISTRATION,
    &quic::REGISTRATION,
    &crate::tcp::REGISTRATION,
];

/// A transport as the runtime knows it.
pub struct Registration {
    /// The name a run's settings use (`--transport NAME`).
    pub name: &'static str,
    /// What it is, in a few words (reports name it so).
    pub about: &'static str,
    /// How a run's pipeline line names its links; `None` for channels between threads,
    /// which need no word.
    pub link_description: Option<&'static str>,
    /// Whether a fault schedule can cut one of its links and leave the others
    /// (`partition@...`).
    pub cuts_links: bool,
    /// Whether its workers reach each other at network addresses (their own from the
    /// cluster file, the others' from it or from a launcher).
    pub networked: bool,
    /// Whether it carries links between processes.
    pub crosses_processes: bool,
    /// Round trips of a small message in one round of measuring its link costs.
    pub measured_messages: u32,
    /// Endpoints for `workers` threads of one process.
    pub thread_mesh: fn(u32, &MeshSettings) -> Result<Vec<Endpoint>, TransportError>,
    /// Binds a worker process of a cluster (`None`: it does not join processes).
    pub bind: Option<BindFn>,
}

/// How a transport binds rank `rank` of a cluster, listening where [`Listen`] says.
pub type BindFn = fn(&ClusterFile, u32, &Listen, &MeshSettings) -> Result<Bound, TransportError>;

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// The registered transport named `name`.
pub fn registration(name: &str) -> Option<&'static Registration> {
    TRANSPORTS.iter().copied().find(|r| r.name == name)
}

/// Every name `--transport` takes: `auto`, then each registered transport's.
pub fn names() -> Vec<&'static str> {
    std::iter::once("auto")
        .chain(TRANSPORTS.iter().map(|r| r.name))
        .collect()
}

/// Peer addresses as a launcher or cluster file gives them, parsed.
///
/// # Errors
/// [`TransportError::Setup`] naming an address that is not a socket address.
pub fn socket_addresses(peers: &[String]) -> Result<Vec<SocketAddr>, TransportError> {
    peers
        .iter()
        .map(|a| {
            a.parse::<SocketAddr>()
                .map_err(|e| TransportError::Setup(format!("peer address '{a}': {e}")))
        })
        .collect()
}

/// An endpoint of whichever kind, as the runtime holds it.
pub type Endpoint = Box<dyn Transport + Send>;

/// What every kind is told: the run, the wire precision, the stall bound and how long to
/// wait for peers. Each kind's own options start from its defaults and take these.
#[derive(Clone, Debug)]
pub struct MeshSettings {
    /// The run every peer and frame must belong to.
    pub run_id: u64,
    /// Element type of activations and gradients on the wire.
    pub wire: WireDType,
    /// How long a receive of data waits (the stall bound); `None`: without bound.
    pub timeout: Option<Duration>,
    /// How long connecting waits for peers that start late.
    pub connect_timeout: Duration,
}

impl MeshSettings {
    /// Settings of run `run_id`: f32 on the wire, no stall bound, 30 s to connect.
    pub fn new(run_id: u64) -> Self {
        MeshSettings {
            run_id,
            wire: WireDType::F32,
            timeout: None,
            connect_timeout: Duration::from_secs(30),
        }
    }

    /// QUIC's options under these settings.
    pub fn quic(&self) -> QuicOptions {
        let mut opts = QuicOptions::new(self.run_id);
        opts.wire = self.wire;
        opts.timeout = self.timeout;
        opts.connect_timeout = self.connect_timeout;
        opts
    }

    /// Shared memory's options under these settings.
    pub fn shm(&self) -> ShmOptions {
        let mut opts = ShmOptions::new(self.run_id);
        opts.wire = self.wire;
        opts.timeout = self.timeout;
        opts.connect_timeout = self.connect_timeout;
        opts
    }

    /// The in-process channels' options under these settings.
    pub fn inproc(&self) -> InProcOptions {
        InProcOptions {
            wire: self.wire,
            timeout: self.timeout,
            ..InProcOptions::default()
        }
    }
}

impl TransportKind {
    /// Whether a fault schedule can cut one link of this kind and leave the others
    /// (`partition@...`).
    pub fn cuts_links(self) -> bool {
        self.registration().is_some_and(|r| r.cuts_links)
    }

    /// Whether this kind's workers reach each other at network addresses (`auto` among a
    /// cluster's workers starts with QUIC); shared memory meets in a directory instead.
    pub fn is_networked(self) -> bool {
        self.registration().is_none_or(|r| r.networked)
    }

    /// Whether this kind can carry links between processes (`auto` picks one that can).
    /// Naming such a kind without `--placement` asks for worker processes.
    pub fn crosses_processes(self) -> bool {
        self.registration().is_none_or(|r| r.crosses_processes)
    }

    /// How a run's pipeline line names this kind's links; `None` for channels between
    /// threads, which need no word (`auto` is named by what it picks).
    pub fn link_description(self) -> Option<&'static str> {
        self.registration().and_then(|r| r.link_description)
    }

    /// What carries the links of a worker process: `auto` is shared memory for the workers
    /// a launcher started on its own host (`launched`); for a cluster file's workers, which
    /// may be on several hosts, it stays `auto`, chosen per link when they connect
    /// ([`BoundEndpoint::connect`]). Any other kind is itself.
    pub fn for_processes(self, launched: bool) -> TransportKind {
        match self {
            TransportKind::Auto if launched => TransportKind::SHM,
            kind => kind,
        }
    }
}

/// Endpoints for `workers` threads of this process, over `kind` (`auto`: channels).
///
/// # Errors
/// [`TransportError::Setup`] where the kind's mesh cannot be built.
pub fn thread_mesh(
    kind: TransportKind,
    workers: u32,
    settings: &MeshSettings,
) -> Result<Vec<Endpoint>, TransportError> {
    let registration = kind.registration().unwrap_or(&crate::inproc::REGISTRATION);
    (registration.thread_mesh)(workers, settings)
}

/// A worker process's connected endpoint, and the peers it reaches over shared memory (the
/// others over its network transport).
pub struct Joined {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// Peers on this host, reached over shared memory.
    pub shared_memory: Vec<u32>,
}

/// Where a worker process listens before it knows its peers.
#[derive(Clone, Debug)]
pub struct Listen {
    /// The address to bind for a networked kind (default: the rank's own address in the
    /// cluster file, resolved by the caller).
    pub addr: SocketAddr,
    /// The directory where the workers of one host meet to set up shared memory.
    pub meet: PathBuf,
}

/// A worker process's endpoint, listening but not yet connected.
pub trait BoundEndpoint: Send {
    /// What a launcher is told this worker listens at: a socket address, or `unix:PATH`.
    ///
    /// # Errors
    /// [`TransportError::Setup`] if the socket has no address.
    fn address(&self) -> Result<String, TransportError>;

    /// Whether connecting needs every peer's network address ([`BoundEndpoint::connect`]'s
    /// `peers`); shared memory finds its peers in the meeting directory.
    fn needs_addresses(&self) -> bool;

    /// Connects to every other worker; `peers[r]` is rank r's address where
    /// [`BoundEndpoint::needs_addresses`] (ignored otherwise).
    ///
    /// # Errors
    /// [`TransportError::Setup`] naming a peer that never connected or was refused, or an
    /// address that is not a socket address.
    fn connect(self: Box<Self>, peers: &[String]) -> Result<Joined, TransportError>;
}

/// A bound endpoint of whichever kind.
pub type Bound = Box<dyn BoundEndpoint>;

/// Binds rank `rank` of `cluster` over `kind` (a concrete kind, or `auto` chosen per link:
/// see [`TransportKind::for_processes`]).
///
/// # Errors
/// [`TransportError::Setup`]: credentials missing from the cluster file, a socket that cannot
/// be bound, a kind that does not join across processes.
pub fn bind(
    kind: TransportKind,
    cluster: &ClusterFile,
    rank: u32,
    at: &Listen,
    settings: &MeshSettings,
) -> Result<Bound, TransportError> {
    let Some(registration) = kind.registration() else {
        let creds = cluster.credentials(rank)?;
        let quic = quic::Bound::bind(rank, at.addr, &creds, settings.quic())?;
        let shm = ShmBound::bind(&at.meet, rank, cluster.size(), settings.shm())?;
        return Ok(Box::new(PerLink { quic, shm }));
    };
    let bind = registration
        .bind
        .ok_or_else(|| TransportError::Setup(format!("{kind} does not join worker processes")))?;
    bind(cluster, rank, at, settings)
}

/// `auto` among a cluster's workers: QUIC and shared memory both bound, the links chosen
/// when connecting (shared memory to the peers of this host).
struct PerLink {
    quic: quic::Bound,
    shm: ShmBound,
}

impl BoundEndpoint for PerLink {
    fn address(&self) -> Result<String, TransportError> {
        Ok(self.quic.local_addr()?.to_string())
    }

    fn needs_addresses(&self) -> bool {
        true
    }

    fn connect(self: Box<Self>, peers: &[String]) -> Result<Joined, TransportError> {
        let PerLink { quic, shm } = *self;
        let quic = quic.connect(&socket_addresses(peers)?)?;
        let local = quic.peers_on_this_host();
        if local.is_empty() {
            return Ok(Joined {
                endpoint: Box::new(quic),
                shared_memory: local,
            });
        }
        let shm = shm.connect_to(&local)?;
        Ok(Joined {
            endpoint: Box::new(Mixed::new(quic, shm, &local)?),
            shared_memory: local,
        })
    }
}
