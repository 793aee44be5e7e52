//! The one place a transport is registered: what each [`TransportKind`] builds for the
//! threads of one process ([`thread_mesh`]) and for a worker process joining its cluster
//! ([`bind`], then [`Bound::connect`]), what `auto` means for each placement, and what a
//! kind can do ([`TransportKind::cuts_links`]). For a cluster file's workers `auto` is
//! chosen per link: QUIC to every peer first, whose hellos say which peers share this host,
//! then shared memory to those ([`crate::mixed`]). The runtime above names no kind: it asks
//! here. Adding a transport is its module, a `TransportKind` variant with its name
//! (`lib.rs`), and an arm in each match of this file.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::cluster::ClusterFile;
use crate::frame::WireDType;
use crate::inproc::{InProcOptions, mesh};
use crate::mixed::Mixed;
use crate::quic::{self, QuicOptions};
use crate::shm::{self, ShmBound, ShmOptions};
use crate::{Transport, TransportError, TransportKind};

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
    /// (`partition@...`): QUIC's links are connections that can be dropped one at a time.
    pub fn cuts_links(self) -> bool {
        match self {
            TransportKind::Quic => true,
            TransportKind::Auto | TransportKind::InProcess | TransportKind::Shm => false,
        }
    }

    /// Whether this kind's workers reach each other at network addresses (their own from
    /// the cluster file, the others' from it or from a launcher); shared memory meets in a
    /// directory instead.
    pub fn is_networked(self) -> bool {
        match self {
            TransportKind::Auto | TransportKind::Quic => true,
            TransportKind::InProcess | TransportKind::Shm => false,
        }
    }

    /// Whether this kind can carry links between processes (`auto` picks one that can).
    /// Naming such a kind without `--placement` asks for worker processes.
    pub fn crosses_processes(self) -> bool {
        match self {
            TransportKind::Auto | TransportKind::Shm | TransportKind::Quic => true,
            TransportKind::InProcess => false,
        }
    }

    /// How a run's pipeline line names this kind's links; `None` for channels between
    /// threads, which need no word (`auto` is named by what it picks).
    pub fn link_description(self) -> Option<&'static str> {
        match self {
            TransportKind::Shm => Some("shared memory"),
            TransportKind::Quic => Some("QUIC on loopback"),
            TransportKind::Auto | TransportKind::InProcess => None,
        }
    }

    /// What carries the links of a worker process: `auto` is shared memory for the workers
    /// a launcher started on its own host (`launched`); for a cluster file's workers, which
    /// may be on several hosts, it stays `auto`, chosen per link when they connect
    /// ([`Bound::connect`]). Any other kind is itself.
    pub fn for_processes(self, launched: bool) -> TransportKind {
        match self {
            TransportKind::Auto if launched => TransportKind::Shm,
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
    fn boxed<T: Transport + Send + 'static>(eps: Vec<T>) -> Vec<Endpoint> {
        eps.into_iter().map(|ep| Box::new(ep) as Endpoint).collect()
    }
    Ok(match kind {
        TransportKind::Auto | TransportKind::InProcess => boxed(mesh(workers, &settings.inproc())),
        TransportKind::Quic => boxed(quic::local_mesh(workers, &settings.quic())?),
        TransportKind::Shm => boxed(shm::local_mesh(workers, &settings.shm())?),
    })
}

/// A worker process's connected endpoint, and the peers it reaches over shared memory (the
/// others over QUIC).
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
pub enum Bound {
    /// QUIC, bound to a UDP port.
    Quic(Box<quic::Bound>),
    /// Shared memory, listening on a Unix socket in the meeting directory.
    Shm(ShmBound),
    /// Both, for links chosen when connecting: shared memory to the peers of this host.
    PerLink(Box<quic::Bound>, ShmBound),
}

/// Binds rank `rank` of `cluster` over `kind` (a concrete kind: see
/// [`TransportKind::for_processes`]).
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
    match kind {
        TransportKind::Quic => {
            let creds = cluster.credentials(rank)?;
            Ok(Bound::Quic(Box::new(quic::Bound::bind(
                rank,
                at.addr,
                &creds,
                settings.quic(),
            )?)))
        }
        TransportKind::Shm => Ok(Bound::Shm(ShmBound::bind(
            &at.meet,
            rank,
            cluster.size(),
            settings.shm(),
        )?)),
        TransportKind::Auto => {
            let creds = cluster.credentials(rank)?;
            let quic = quic::Bound::bind(rank, at.addr, &creds, settings.quic())?;
            let shm = ShmBound::bind(&at.meet, rank, cluster.size(), settings.shm())?;
            Ok(Bound::PerLink(Box::new(quic), shm))
        }
        TransportKind::InProcess => Err(TransportError::Setup(format!(
            "{kind} does not join worker processes"
        ))),
    }
}

impl Bound {
    /// What a launcher is told this worker listens at: a socket address, or `unix:PATH`.
    ///
    /// # Errors
    /// [`TransportError::Setup`] if the socket has no address.
    pub fn address(&self) -> Result<String, TransportError> {
        match self {
            Bound::Quic(b) | Bound::PerLink(b, _) => Ok(b.local_addr()?.to_string()),
            Bound::Shm(b) => Ok(format!("unix:{}", b.path().display())),
        }
    }

    /// Whether connecting needs every peer's network address ([`Bound::connect`]'s
    /// `peers`); shared memory finds its peers in the meeting directory.
    pub fn needs_addresses(&self) -> bool {
        matches!(self, Bound::Quic(_) | Bound::PerLink(..))
    }

    /// Connects to every other worker; `peers[r]` is rank r's address where
    /// [`Bound::needs_addresses`] (ignored otherwise).
    ///
    /// # Errors
    /// [`TransportError::Setup`] naming a peer that never connected or was refused, or an
    /// address that is not a socket address.
    pub fn connect(self, peers: &[String]) -> Result<Joined, TransportError> {
        let addrs = || {
            peers
                .iter()
                .map(|a| {
                    a.parse::<SocketAddr>()
                        .map_err(|e| TransportError::Setup(format!("peer address '{a}': {e}")))
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let joined = |endpoint: Endpoint, shared_memory: Vec<u32>| Joined {
            endpoint,
            shared_memory,
        };
        match self {
            Bound::Quic(b) => Ok(joined(Box::new(b.connect(&addrs()?)?), Vec::new())),
            Bound::Shm(b) => {
                let shm = b.connect()?;
                let all = (0..shm.size()).filter(|&p| p != shm.rank()).collect();
                Ok(joined(Box::new(shm), all))
            }
            Bound::PerLink(quic, shm) => {
                let quic = quic.connect(&addrs()?)?;
                let local = quic.peers_on_this_host();
                if local.is_empty() {
                    return Ok(joined(Box::new(quic), local));
                }
                let shm = shm.connect_to(&local)?;
                Ok(joined(Box::new(Mixed::new(quic, shm, &local)?), local))
            }
        }
    }
}
