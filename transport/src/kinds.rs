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

use crate::TransportError;
use crate::cluster::ClusterFile;
use crate::mixed::Mixed;
use crate::quic::{self, QuicOptions};
use crate::shm::{self, ShmBound, ShmOptions};

pub use crate::registration::{
    BindFn, Bound, BoundEndpoint, Endpoint, Joined, Listen, MeshSettings, Registration,
    present_addresses,
};

/// Every transport, in the order choices list them and costs are measured.
pub const TRANSPORTS: &[&Registration] = &[
    &crate::inproc::REGISTRATION,
    &shm::REGISTRATION,
    &QUIC_REGISTRATION,
    &crate::tcp::REGISTRATION,
];

/// How the workers of a run exchange tensors: the typed form of a run's transport choice,
/// parsed once at the edge. Where the workers run is another choice (the run's placement);
/// this one says what carries each link between them. A kind is `auto` or one of the
/// registered transports ([`TRANSPORTS`]); two kinds are equal when their names are.
#[derive(Clone, Copy, Default)]
pub enum TransportKind {
    /// Chosen per link from where its two ends are: channels between threads of one
    /// process, shared memory between processes on one host, QUIC between hosts.
    #[default]
    Auto,
    /// A registered transport.
    Registered(&'static Registration),
}

impl TransportKind {
    /// Threads of one process over crossbeam channels ([`crate::inproc`]).
    pub const INPROC: TransportKind = TransportKind::Registered(&crate::inproc::REGISTRATION);
    /// Shared-memory rings between processes of one host ([`crate::shm`]); a run that spans hosts
    /// is refused.
    pub const SHM: TransportKind = TransportKind::Registered(&shm::REGISTRATION);
    /// QUIC with mutual TLS on every link ([`crate::quic`]): one connection per pair of workers.
    pub const QUIC: TransportKind = TransportKind::Registered(&QUIC_REGISTRATION);

    /// The name a run's settings use.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Auto => "auto",
            TransportKind::Registered(r) => r.name,
        }
    }

    /// Its registration; `None` for `auto`.
    pub fn registration(self) -> Option<&'static Registration> {
        match self {
            TransportKind::Auto => None,
            TransportKind::Registered(r) => Some(r),
        }
    }
}

impl PartialEq for TransportKind {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name()
    }
}

impl Eq for TransportKind {}

impl std::hash::Hash for TransportKind {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.name().hash(state);
    }
}

impl std::fmt::Debug for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(TransportKind::Auto);
        }
        registration(s)
            .map(TransportKind::Registered)
            .ok_or_else(|| format!("unknown transport '{s}' ({})", names().join(", ")))
    }
}

/// The registration of QUIC. It sits here rather than in [`crate::quic`] because a cluster
/// file, which binding takes, is built on QUIC's credentials ([`crate::cluster`] uses
/// [`crate::quic`]); the other transports' registrations live in their own modules.
pub const QUIC_REGISTRATION: Registration = Registration {
    name: "quic",
    about: "QUIC with mutual TLS",
    link_description: Some("QUIC on loopback"),
    cuts_links: true,
    networked: true,
    crosses_processes: true,
    measured_messages: 300,
    thread_mesh: |workers, settings| {
        let eps = quic::local_mesh(workers, &quic_options(settings))?;
        Ok(eps.into_iter().map(|e| Box::new(e) as Endpoint).collect())
    },
    bind: Some(|cluster, rank, at, settings| {
        let creds = cluster.credentials(rank)?;
        let bound = quic::Bound::bind(rank, at.addr, &creds, quic_options(settings))?;
        Ok(Box::new(bound))
    }),
};

/// QUIC's options under `settings`.
pub fn quic_options(settings: &MeshSettings) -> QuicOptions {
    let mut opts = QuicOptions::new(settings.run_id);
    opts.wire = settings.wire;
    opts.timeout = settings.timeout;
    opts.connect_timeout = settings.connect_timeout;
    opts
}

impl BoundEndpoint for quic::Bound {
    fn address(&self) -> Result<String, TransportError> {
        Ok(self.local_addr()?.to_string())
    }

    fn needs_addresses(&self) -> bool {
        true
    }

    fn connect(self: Box<Self>, peers: &[String]) -> Result<Joined, TransportError> {
        let addrs = present_addresses(peers)?;
        Ok(Joined {
            endpoint: Box::new((*self).connect_present(&addrs)?),
            shared_memory: Vec::new(),
        })
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
        let quic = quic::Bound::bind(rank, at.addr, &creds, quic_options(settings))?;
        let shm = ShmBound::bind(&at.meet, rank, cluster.size(), ShmOptions::from(settings))?;
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
        let quic = quic.connect_present(&present_addresses(peers)?)?;
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
