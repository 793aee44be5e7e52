//! The in-process transport: every worker is a thread; each ordered pair of workers has a
//! bounded crossbeam channel that moves `Message`s (the tensor's buffer moves, it is never
//! copied). A receive drains the sender's channel into a small map until its key shows up, so
//! messages may be consumed in a different order than they were sent.
//!
//! Every endpoint also has an unbounded control channel that any peer may write to: an abort
//! ([`Transport::abort`]) is a message on it naming the worker that failed. Blocked sends and
//! receives wait on their data channel and the control channel at once (`select!`), so an abort
//! wakes them immediately and nothing polls.

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, bounded, never, select, unbounded};

use crate::frame::{WireDType, round_to_wire};
use crate::registration::{Endpoint, MeshSettings, Registration};
use crate::{Early, Key, Kind, Message, Transport, TransportError};

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
    control: Receiver<u32>,
    /// The worker whose abort this endpoint has seen.
    aborted_by: Option<u32>,
    early: Early,
    timeout: Option<Duration>,
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
            control,
            aborted_by: None,
            early: Early::default(),
            timeout: opts.timeout,
            wire: opts.wire,
        })
        .collect()
}

impl InProc {
    /// Records an abort from `by` and returns the error every later call gives.
    fn aborted(&mut self, by: u32) -> TransportError {
        let by = *self.aborted_by.get_or_insert(by);
        TransportError::Aborted { by }
    }

    /// The error for a peer whose channel closed: `Aborted` when an abort reached this
    /// endpoint, else `gone`. A peer stops after an abort (its own or one it received), and
    /// the abort that stopped it was sent to every endpoint as it began, so a closed channel
    /// during a failure is the echo of that abort, not a second failure. The abort may trail
    /// the closing by the time its sender takes to tell the other peers: wait a moment for it.
    fn abort_or(&mut self, gone: TransportError) -> TransportError {
        if let Some(by) = self.aborted_by {
            return TransportError::Aborted { by };
        }
        match self.control.recv_timeout(Duration::from_millis(200)) {
            Ok(by) => self.aborted(by),
            Err(_) => gone,
        }
    }

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

    /// Keeps a message that arrived before it was asked for.
    fn keep_early(&mut self, m: Message, from: u32) -> Result<(), TransportError> {
        if m.key.to != self.rank || m.key.from != from {
            return Err(TransportError::Protocol(format!(
                "worker {} received {:?} on its channel from {from}",
                self.rank, m.key
            )));
        }
        self.early.keep(m)
    }
}

/// The wire precision of a message of `kind` on a run whose wire is `wire`: all-reduce chunks
/// are always f32 (sums of rounded chunks would drift between replicas' orders).
pub(crate) fn wire_for(kind: Kind, wire: WireDType) -> WireDType {
    match kind {
        Kind::Chunk | Kind::Control => WireDType::F32,
        Kind::Activation | Kind::Gradient => wire,
    }
}

impl Transport for InProc {
    fn carries_device_tensors(&self) -> bool {
        // A narrower wire type rounds the payload on the host.
        self.wire == WireDType::F32
    }

    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.to.len() as u32
    }

    fn send(&mut self, mut message: Message) -> Result<(), TransportError> {
        if let Some(by) = self.aborted_by {
            return Err(TransportError::Aborted { by });
        }
        let wire = wire_for(message.key.kind, self.wire);
        if wire != WireDType::F32 {
            if let Ok(values) = message.tensor.host_mut() {
                round_to_wire(values, wire);
            }
        }
        let to = message.key.to as usize;
        let Some(tx) = self.to.get(to).cloned() else {
            return Err(TransportError::Send {
                reason: format!("no worker {to} in a mesh of {}", self.to.len()),
                message: Box::new(message),
            });
        };
        let control = self.control.clone();
        select! {
            send(tx, message) -> sent => match sent {
                Ok(()) => Ok(()),
                Err(e) => Err(self.abort_or(TransportError::Send {
                    reason: format!("worker {to} is gone"),
                    message: Box::new(e.into_inner()),
                })),
            },
            recv(control) -> by => Err(self.aborted(by.unwrap_or(self.rank))),
        }
    }

    fn recv(&mut self, key: &Key) -> Result<Message, TransportError> {
        self.check_key(key)?;
        if let Some(m) = self.early.take(key) {
            return Ok(m);
        }
        if let Some(by) = self.aborted_by {
            return Err(TransportError::Aborted { by });
        }
        let rx = self.from[key.from as usize].clone();
        let control = self.control.clone();
        let start = Instant::now();
        let deadline = crate::stall_deadline(self.timeout, key, start);
        loop {
            let timer = match deadline {
                Some(d) => crossbeam_channel::at(d),
                None => never(),
            };
            select! {
                recv(rx) -> m => match m {
                    Ok(m) if m.key == *key => return Ok(m),
                    Ok(m) => self.keep_early(m, key.from)?,
                    Err(_) => {
                        return Err(self.abort_or(TransportError::Closed { peer: key.from }));
                    }
                },
                recv(control) -> by => return Err(self.aborted(by.unwrap_or(self.rank))),
                recv(timer) -> _ => {
                    return Err(TransportError::Timeout {
                        key: *key,
                        waited: start.elapsed(),
                    })
                }
            }
        }
    }

    fn close(&mut self) -> Result<(), TransportError> {
        // Channels hold what was sent until the peer takes it, even after this end is dropped.
        Ok(())
    }

    fn try_recv(&mut self, key: &Key) -> Result<Option<Message>, TransportError> {
        self.check_key(key)?;
        if let Some(m) = self.early.take(key) {
            return Ok(Some(m));
        }
        if let Ok(by) = self.control.try_recv() {
            return Err(self.aborted(by));
        }
        if let Some(by) = self.aborted_by {
            return Err(TransportError::Aborted { by });
        }
        let rx = self.from[key.from as usize].clone();
        while let Ok(m) = rx.try_recv() {
            if m.key == *key {
                return Ok(Some(m));
            }
            self.keep_early(m, key.from)?;
        }
        Ok(None)
    }

    fn buffered(&self) -> usize {
        self.early.len()
    }

    fn abort(&mut self) {
        self.aborted_by.get_or_insert(self.rank);
        for (peer, tx) in self.control_to.iter().enumerate() {
            if peer as u32 != self.rank {
                // An unbounded channel never blocks; a peer that is gone needs no word.
                let _ = tx.send(self.rank);
            }
        }
    }
}
