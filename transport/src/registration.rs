//! What a transport registers ([`Registration`]) and the types its registration speaks in:
//! the settings every kind is told ([`MeshSettings`]), where a worker process listens
//! ([`Listen`]), a bound endpoint ([`BoundEndpoint`]) and what connecting it gives
//! ([`Joined`]). The list of registered transports, and what `auto` means, are
//! [`crate::kinds`]'s; this file names no transport, so that a transport's module can take
//! these types without an import circle.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::cluster::ClusterFile;
use crate::frame::WireDType;
use crate::{Transport, TransportError};

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
}

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

/// The entry of a peer address list for a rank that is not in the mesh: a lost worker whose
/// survivors connect a mesh of their own ([`present_addresses`]).
pub const ABSENT: &str = "-";

/// Peer addresses as a launcher or cluster file gives them, parsed: [`ABSENT`] is `None`.
///
/// # Errors
/// [`TransportError::Setup`] naming an address that is not a socket address.
pub fn present_addresses(peers: &[String]) -> Result<Vec<Option<SocketAddr>>, TransportError> {
    peers
        .iter()
        .map(|a| match a.as_str() {
            ABSENT => Ok(None),
            _ => a
                .parse::<SocketAddr>()
                .map(Some)
                .map_err(|e| TransportError::Setup(format!("peer address '{a}': {e}"))),
        })
        .collect()
}

/// The ranks of a peer address list that are in the mesh (every rank of `size` when the list
/// is empty: a transport that needs no addresses was given none).
pub fn present_ranks(peers: &[String], size: u32) -> Vec<u32> {
    (0..size)
        .filter(|&r| peers.get(r as usize).is_none_or(|a| a != ABSENT))
        .collect()
}

/// Peer addresses as a launcher or cluster file gives them, parsed, every rank present.
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
