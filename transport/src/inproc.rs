//! The in-process transport: every worker is a thread; each ordered pair of workers has a
//! bounded crossbeam channel that moves `Message`s (the tensor's buffer moves, it is never
//! copied). A receive drains the sender's channel into a small map until its key shows up, so
//! messages may be consumed in a different order than they were sent.
//!
//! Every endpoint also has an unbounded control channel that any peer may write to: an abort
//! ([`Transport::abort`]) is a message on it naming the worker that failed. Blocked sends and
//! receives wait on their data channel and the control channel at once (`select!`), so an abort
//! wakes them immediately and nothing polls.

use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, bounded, select, unbounded};

use crate::frame::{WireDType, round_to_wire};
use crate::inbox::Inbox;
use crate::registration::{Endpoint, MeshSettings, Registration};
use crate::{Key, Kind, Message, Transport, TransportError};

/// The registration of the in-process channels ([`crate::kinds::TRANSPORTS`]).
pub const REGISTRATION: Registration = Registration {
    name: "inproc",
    about: "in-process channels (move the buffer)",
    link_description: None,
    cuts_links: false,
    networked: false,
    crosses_processes: false,
    measured_messages: 1000,
    thread_mesh: |workers, settings| {
        let eps = mesh(workers, &InProcOptions::from(settings));
        Ok(eps.into_iter().map(|e| Box::new(e) as Endpoint).collect())
    },
    bind: None,
};

/// Options of an in-process mesh.
#[derive(Clone, Debug)]
pub struct InProcOptions {
    /// Messages each directed channel holds before a sender blocks.
    pub capacity: usize,
    /// How long a receive of data waits before failing with a timeout, the stall bound (None:
    /// forever, until aborted). Control records are waited for without bound.
    pub timeout: Option<Duration>,
    /// The wire precision to give activations and gradients: with bf16, their values are
    /// rounded as a networked transport's wire would round them (nothing is encoded), so an
    /// in-process run has exactly a QUIC run's numerics. All-reduce chunks stay f32.
    pub wire: WireDType,
}

impl Default for InProcOptions {
    fn default() -> Self {
        InProcOptions {
            capacity: 1024,
            timeout: None,
            wire: WireDType::F32,
        }
    }
}

impl From<&MeshSettings> for InProcOptions {
    fn from(s: &MeshSettings) -> Self {
        InProcOptions {
            wire: s.wire,
            timeout: s.timeout,
            ..InProcOptions::default()
        }
    }
}

/// One worker's endpoint of an in-process mesh.
#[derive(Debug)]
pub struct InProc {
    rank: u32,
    to: Vec<Sender<Message>>,
    from: Vec<Receiver<Message>>,
    /// Control channels of every worker (aborts), this one's included.
    control_to: Vec<Sender<u32>>,
    /// Aborts from peers and messages that arrived early.
    inbox: Inbox,
    wire: WireDType,
}

/// Builds a full mesh of `workers` endpoints.
pub fn mesh(workers: u32, opts: &InProcOptions) -> Vec<InProc> {
    let n = workers as usize;
    // channels[a][b]: from a to b.
    let mut senders: Vec<Vec<Sender<Message>>> = (0..n).map(|_| Vec::with_capacity(n)).collect();
    let mut receivers: Vec<Vec<Option<Receiver<Message>>>> =
        (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
    for (a, row) in senders.iter_mut().enumerate() {
        for col in receivers.iter_mut() {
            let (tx, rx) = bounded(opts.capacity.max(1));
            row.push(tx);
            col[a] = Some(rx);
        }
    }
    let (control_to, controls): (Vec<Sender<u32>>, Vec<Receiver<u32>>) =
        (0..n).map(|_| unbounded()).unzip();
    senders
        .into_iter()
        .zip(receivers)
        .zip(controls)
        .enumerate()
        .map(|(rank, ((to, from), control))| InProc {
            rank: rank as u32,
            to,
            from: from.into_iter().flatten().collect(),
            control_to: control_to.clone(),
            inbox: Inbox::new(rank as u32, control, opts.timeout),
            wire: opts.wire,
        })
        .collect()
}

impl InProc {
    fn check_key(&self, key: &Key) -> Result<(), TransportError> {
        if key.to != self.rank {
            return Err(TransportError::Protocol(format!(
                "worker {} asked for a message addressed to {}",
                self.rank, key.to
            )));
        }
        if key.from as usize >= self.from.len() {
            return Err(TransportError::Protocol(format!(
                "no worker {} in a mesh of {}",
                key.from,
                self.from.len()
            )));
        }
        Ok(())
    }
}

/// The wire precision of a message of `kind` on a run whose wire is `wire`: all-reduce chunks
/// are always f32 (sums of rounded chunks would drift between replicas' orders).
pub fn wire_for(kind: Kind, wire: WireDType) -> WireDType {
    match kind {
        Kind::Chunk | Kind::Control => WireDType::F32,
        Kind::Activation | Kind::Gradient => wire,
    }
}

/// `message`'s values rounded as a wire of `wire` would carry them ([`wire_for`]), for a
/// link that moves the message itself: what its receiver reads has a networked link's bits.
pub fn round_as_on_the_wire(message: &mut Message, wire: WireDType) {
    let wire = wire_for(message.key.kind, wire);
    if wire != WireDType::F32 {
        if let Ok(values) = message.tensor.host_mut() {
            round_to_wire(values, wire);
        }
    }
}

impl Transport for InProc {
    fn carries_device_tensors(&self) -> bool {
        // A narrower wire type rounds the payload on the host.
        self.wire == WireDType::F32
    }

    /// One process: a device tensor passes as it is where the wire allows, and is rounded on
    /// the host where it does not; there is no other process to lend it to.
    fn lends_device_buffers(&self, _: u32) -> bool {
        false
    }

    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.to.len() as u32
    }

    fn send(&mut self, mut message: Message) -> Result<(), TransportError> {
        self.inbox.check_aborted()?;
        round_as_on_the_wire(&mut message, self.wire);
        let to = message.key.to as usize;
        let Some(tx) = self.to.get(to).cloned() else {
            let reason = format!("no worker {to} in a mesh of {}", self.to.len());
            return Err(TransportError::unsent(message, reason));
        };
        let control = self.inbox.control().clone();
        select! {
            send(tx, message) -> sent => match sent {
                Ok(()) => Ok(()),
                Err(e) => Err(self.inbox.abort_or(TransportError::unsent(
                    e.into_inner(),
                    format!("worker {to} is gone"),
                ))),
            },
            recv(control) -> by => Err(self.inbox.aborted(by.unwrap_or(self.rank))),
        }
    }

    fn recv(&mut self, key: &Key) -> Result<Message, TransportError> {
        self.check_key(key)?;
        let peer = key.from;
        self.inbox.recv(key, &self.from[peer as usize], |inbox| {
            inbox.abort_or(TransportError::Closed { peer })
        })
    }

    fn close(&mut self) -> Result<(), TransportError> {
        // Channels hold what was sent until the peer takes it, even after this end is dropped.
        Ok(())
    }

    fn try_recv(&mut self, key: &Key) -> Result<Option<Message>, TransportError> {
        self.check_key(key)?;
        // A closed channel has been drained: what was asked for has not arrived.
        self.inbox
            .try_recv(key, &self.from[key.from as usize], |_| Ok(None))
    }

    fn buffered(&self) -> usize {
        self.inbox.buffered()
    }

    fn abort(&mut self) {
        self.inbox.abort_here();
        for (peer, tx) in self.control_to.iter().enumerate() {
            if peer as u32 != self.rank {
                // An unbounded channel never blocks; a peer that is gone needs no word.
                let _ = tx.send(self.rank);
            }
        }
    }
    fn copies_payloads(&self) -> bool {
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
