//! `pipe-transport` owns moving tensors between workers: one [`Transport`] trait and its typed
//! choice ([`TransportKind`]), an in-process implementation ([`inproc`]: crossbeam channels
//! moving owned buffers, no copies), QUIC between processes and hosts ([`quic`]: quinn, mutual
//! TLS, with its wire format in [`frame`]), cluster files and where a worker's rank comes from
//! ([`cluster`]), the ring all-reduce written once over the trait ([`collective`]), the NCCL
//! all-reduce for replicas on GPUs ([`nccl`], behind the `cuda` feature), and a wrapper that
//! injects faults into any transport for tests ([`fault`]).
//!
//! The trait is shaped around how schedules use it. Every message has a [`Key`] (sender,
//! receiver, kind, stage, microbatch or update, ring step) that the receiver asks for by value,
//! because a lowered schedule places each receive where its data is consumed, not where it was
//! sent: messages from one peer may be consumed in another order than they were sent, and the
//! transport buffers the early ones. A failed send hands the message back. A worker that fails
//! tells every peer with [`Transport::abort`], an abort message any transport can carry (no
//! process-local flag), and every blocked call of a peer returns [`TransportError::Aborted`]
//! naming the failed worker, so one failure stops all the others promptly instead of leaving
//! them waiting forever. The test suite in `tests/suite.rs` is written against the trait
//! so each implementation runs the same cases.

#![warn(missing_docs)]

pub mod cluster;
pub mod collective;
pub mod fault;
pub mod frame;
pub mod host;
mod inbox;
pub mod inproc;
pub mod kinds;
pub mod measure;
pub mod mixed;
pub mod nccl;
pub mod quic;
pub mod registration;
pub mod renumbered;
pub mod shm;
pub mod tcp;
#[cfg(test)]
mod test_meshes;

use std::time::Duration;

pub use kinds::TransportKind;

use pipe_kernels::Tensor;
use thiserror::Error;

/// What a message carries. Serialized by name (`"Activation"`, ...) where a record names
/// one, as the hang doctor's stop reports do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Kind {
    /// A stage's output activation, going to the next stage.
    Activation,
    /// The gradient of a stage's input, going to the previous stage.
    Gradient,
    /// A chunk of a ring all-reduce.
    Chunk,
    /// Run bookkeeping between a run's workers and its chief (rank 0) at drain points: the
    /// run's settings, each worker's epoch summary, weights for evaluation. Carried bit-exact
    /// (never rounded to a narrower wire type); byte payloads use [`Message::from_bytes`].
    Control,
}

/// Identifies a message. A receiver asks for exactly one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    /// Sending worker.
    pub from: u32,
    /// Receiving worker.
    pub to: u32,
    /// What it carries.
    pub kind: Kind,
    /// The stage whose boundary (or all-reduce group) it belongs to: the producing stage for
    /// activations and gradients.
    pub stage: u32,
    /// Microbatch (activations, gradients) or update (chunks).
    pub index: u32,
    /// Ring step (chunks), 0 otherwise.
    pub step: u32,
}

impl Key {
    /// The key of message `index` of `kind` from `from` to `to` at stage 0, ring step 0: the
    /// plain data messages that measurements and tests send.
    pub fn data(from: u32, to: u32, kind: Kind, index: u32) -> Key {
        Key {
            from,
            to,
            kind,
            stage: 0,
            index,
            step: 0,
        }
    }
}

/// A message to send whose payload is the concatenation of `parts`, a tensor of one
/// dimension, not yet built: what [`Transport::send_values`] takes.
#[derive(Debug, Clone, Copy)]
pub struct Values<'a> {
    /// Where the message goes and what it is.
    pub key: Key,
    /// As [`Message::version`].
    pub version: u64,
    /// The payload's values, in order.
    pub parts: &'a [&'a [f32]],
}

/// What takes a received payload's values as (offset, values) blocks that together cover
/// the payload once: [`Transport::recv_with`] hands them over as they arrive.
pub type ValueSink<'a> = dyn FnMut(usize, &[f32]) + 'a;

/// A message: its key, the weight version it was computed with (or another small tag the
/// schedule defines), and the tensor, moved rather than copied where the transport allows.
#[derive(Debug)]
pub struct Message {
    /// Identity.
    pub key: Key,
    /// A tag travelling with the data (vertical sync carries weight versions in it).
    pub version: u64,
    /// The payload.
    pub tensor: Tensor,
}

impl Message {
    /// A message carrying `bytes` exactly: packed four to an `f32` element by bit pattern
    /// (no arithmetic ever touches a payload, so every bit pattern survives), the byte count
    /// in [`Message::version`]. For [`Kind::Control`] records, which are small and rare.
    pub fn from_bytes(key: Key, bytes: &[u8]) -> Message {
        let words: Vec<f32> = bytes
            .chunks(4)
            .map(|c| {
                let mut w = [0u8; 4];
                w[..c.len()].copy_from_slice(c);
                f32::from_bits(u32::from_le_bytes(w))
            })
            .collect();
        let mut tensor = Tensor::zeros(&[0]);
        tensor.resize_host(&[words.len()]).copy_from_slice(&words);
        Message {
            key,
            version: bytes.len() as u64,
            tensor,
        }
    }

    /// A one-dimensional message of the concatenation of `parts`: what
    /// [`Transport::send_values`] sends where the transport takes owned tensors.
    ///
    /// # Errors
    /// [`TransportError::Protocol`] if the tensor cannot be built.
    pub fn of_values(values: Values<'_>) -> Result<Message, TransportError> {
        let Values {
            key,
            version,
            parts,
        } = values;
        let values: Vec<f32> = parts.concat();
        let n = values.len();
        let tensor = Tensor::from_vec(&[n], values)
            .map_err(|e| TransportError::Protocol(format!("{key:?}: {e}")))?;
        Ok(Message {
            key,
            version,
            tensor,
        })
    }

    /// Hands this message's values to `take` as one block (offset 0), as
    /// [`Transport::recv_with`] does by default; returns their count.
    ///
    /// # Errors
    /// [`TransportError::Protocol`] for a payload not in host memory.
    pub fn hand_to(&self, take: &mut ValueSink<'_>) -> Result<usize, TransportError> {
        let values = self
            .tensor
            .host()
            .map_err(|e| TransportError::Protocol(format!("{:?}: {e}", self.key)))?;
        take(0, values);
        Ok(values.len())
    }

    /// The bytes of a message made by [`Message::from_bytes`].
    ///
    /// # Errors
    /// [`TransportError::Protocol`] when the byte count does not fit the payload, or the
    /// payload is not in host memory.
    pub fn into_bytes(self) -> Result<Vec<u8>, TransportError> {
        let key = self.key;
        let words = self
            .tensor
            .host()
            .map_err(|e| TransportError::Protocol(format!("{key:?}: {e}")))?;
        let len = usize::try_from(self.version).unwrap_or(usize::MAX);
        if len > words.len() * 4 || len + 4 <= words.len() * 4 {
            return Err(TransportError::Protocol(format!(
                "{key:?} says {len} bytes but carries {} words",
                words.len()
            )));
        }
        let mut bytes: Vec<u8> = words
            .iter()
            .flat_map(|w| w.to_bits().to_le_bytes())
            .collect();
        bytes.truncate(len);
        Ok(bytes)
    }
}

/// Errors of a transport.
#[derive(Debug, Error)]
pub enum TransportError {
    /// The peer is gone (its endpoint was dropped or its connection closed).
    #[error("worker {peer} is gone")]
    Closed {
        /// The peer.
        peer: u32,
    },
    /// A peer's connection ended without the closing handshake: its process died, its host
    /// or the network went away (no word from it within the idle timeout), or it reset.
    #[error("lost worker {peer}: {why}")]
    Lost {
        /// The peer.
        peer: u32,
        /// What the connection reported.
        why: String,
    },
    /// A worker failed and the run is being stopped.
    #[error("stopped because worker {by} failed")]
    Aborted {
        /// The worker that failed (this worker's own rank after it aborted itself).
        by: u32,
    },
    /// Nothing arrived within the transport's time limit.
    #[error("no message {key:?} after {waited:?}")]
    Timeout {
        /// What was awaited.
        key: Key,
        /// How long.
        waited: Duration,
    },
    /// The peer sent something the protocol does not allow (a duplicate key, a message meant
    /// for another worker, a worker number outside the mesh).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The transport could not be set up: credentials, sockets, peers that never connected.
    #[error("transport setup: {0}")]
    Setup(String),
    /// A file a user gave (a cluster file, or a certificate or key it names) is unreadable,
    /// too large or malformed: bad input, named with the file.
    #[error("{0}")]
    BadFile(String),
    /// An address a user gave (a cluster file's rank, `--listen`) that this host cannot
    /// listen at: not one of its addresses, taken by another program, or a port its user may
    /// not bind. Bad input, named with the address.
    #[error("{0}")]
    CannotListen(String),
    /// A send failed; the message is handed back.
    #[error("sending {:?} failed: {reason}", .message.key)]
    Send {
        /// The message that was not sent.
        message: Box<Message>,
        /// Why.
        reason: String,
    },
}

impl TransportError {
    /// Whether the user can fix it in what they gave (a file, an address), so a command-line
    /// front end should exit with status 2.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            TransportError::BadFile(_) | TransportError::CannotListen(_)
        )
    }

    /// The failure to listen at `addr` (`e`, from binding it): [`TransportError::CannotListen`]
    /// where the address is the user's to change, else [`TransportError::Setup`].
    pub fn binding(addr: std::net::SocketAddr, e: &std::io::Error) -> Self {
        use std::io::ErrorKind::{AddrInUse, AddrNotAvailable, PermissionDenied};
        let why = match e.kind() {
            AddrNotAvailable => "it is not an address of this host",
            AddrInUse => "another program listens there",
            PermissionDenied => "this user may not bind that port",
            _ => return TransportError::Setup(format!("binding {addr}: {e}")),
        };
        TransportError::CannotListen(format!("cannot listen at {addr}: {why} ({e})"))
    }

    /// [`TransportError::Send`]: `message`, handed back unsent, and why.
    pub(crate) fn unsent(message: Message, reason: impl Into<String>) -> Self {
        TransportError::Send {
            message: Box::new(message),
            reason: reason.into(),
        }
    }
}

/// Messages that arrived before they were asked for, by key: what lets a receive take keys
/// in another order than they were sent. Shared by every transport.
#[derive(Debug, Default)]
pub(crate) struct Early(std::collections::HashMap<Key, Message>);

impl Early {
    /// Keeps `m` until its key is asked for.
    ///
    /// # Errors
    /// [`TransportError::Protocol`] for a second message with a key already held.
    pub(crate) fn keep(&mut self, m: Message) -> Result<(), TransportError> {
        match self.0.entry(m.key) {
            std::collections::hash_map::Entry::Occupied(_) => Err(TransportError::Protocol(
                format!("duplicate message {:?}", m.key),
            )),
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(m);
                Ok(())
            }
        }
    }

    /// The message with `key`, if it has arrived.
    pub(crate) fn take(&mut self, key: &Key) -> Option<Message> {
        self.0.remove(key)
    }

    /// Whether the message with `key` has arrived.
    pub(crate) fn holds(&self, key: &Key) -> bool {
        self.0.contains_key(key)
    }

    /// How many messages held have a key that `pick` picks.
    pub(crate) fn count(&self, pick: &dyn Fn(&Key) -> bool) -> usize {
        self.0.keys().filter(|k| pick(k)).count()
    }

    /// Messages held.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}

/// When a receive of `key` that started at `start` gives up, under a stall bound of `timeout`:
/// data only, never control records (whose waits are the chief's work between epochs).
pub(crate) fn stall_deadline(
    timeout: Option<Duration>,
    key: &Key,
    start: std::time::Instant,
) -> Option<std::time::Instant> {
    if key.kind == Kind::Control {
        return None;
    }
    timeout.map(|t| start + t)
}

/// What another thread holds to stop an endpoint's blocked calls as if a peer were lost
/// ([`Transport::interrupter`]): a launcher that reaps a dead worker knows before the
/// transport's own timeout does.
#[derive(Clone)]
pub struct Interrupter(pub std::sync::Arc<dyn Fn(u32) + Send + Sync>);

impl Interrupter {
    /// The endpoint's calls fail as if `peer` were lost.
    pub fn lost(&self, peer: u32) {
        (self.0)(peer);
    }
}

/// A regrouped mesh, and on the survivor that hosts the lost rank, that rank's endpoint
/// ([`Transport::regroup`]).
pub type Regrouped = (Box<dyn Transport>, Option<Box<dyn Transport + Send>>);

/// A worker's end of the mesh.
pub trait Transport: Send {
    /// This worker's number.
    fn rank(&self) -> u32;

    /// Whether a message may carry a tensor held by a device (a GPU buffer) as it is: true
    /// only for a transport between threads of one process that sends payloads untouched, so
    /// the receiving worker's backend copies device to device. Every other transport is given
    /// host tensors (the sender copies a device tensor out first).
    ///
    /// This and the other capabilities (`lends_device_buffers`, `copies_payloads`,
    /// `link_buffer_bytes`, `interrupter`, `regroup_address`, `regroup`, `cut_link`) have no
    /// default: a transport states each, and a wrapper forwards each to what it wraps, so a
    /// wrapper cannot drop one by leaving it out.
    fn carries_device_tensors(&self) -> bool;

    /// Whether a data message to `peer` may carry, in place of its payload, a handle to the
    /// sender's device buffer that `peer`'s process opens and copies device to device (CUDA
    /// IPC; the executor's loans, `pipe_stages::pipeline::loans`): true only for a link
    /// between processes of one host (shared memory, which refuses a peer on another host)
    /// whose wire carries payloads as they are (f32), so that the copy has the bits a host
    /// copy would. A wrapper that keeps copies of the messages it passes says false: a handle
    /// is not a payload it could replay.
    fn lends_device_buffers(&self, peer: u32) -> bool;

    /// Number of workers in the mesh.
    fn size(&self) -> u32;

    /// Whether this transport copies every payload anyway (shared memory writes it into a
    /// ring and reads it out), so that a caller gains by lending it values where they lie
    /// ([`Transport::send_values`], [`Transport::recv_with`]) rather than handing over owned
    /// buffers, which the other transports move without a copy.
    fn copies_payloads(&self) -> bool;

    /// Bytes a link to one peer holds before a send has to wait for the peer to read: the
    /// ring's size over shared memory; `None` where sends never wait on the reader (channels
    /// and QUIC streams buffer what is sent). A caller that keeps what it has in flight on a
    /// link under this never blocks in a send, so the transport never has to take incoming
    /// messages aside (copying them) to keep two senders from waiting on each other.
    fn link_buffer_bytes(&self) -> Option<u64>;

    /// Sends the concatenation of `parts` as a message of one dimension with `key` and
    /// `version`, without the caller building a tensor. By default it builds one.
    ///
    /// # Errors
    /// As [`Transport::send`].
    fn send_values(&mut self, values: Values<'_>) -> Result<(), TransportError> {
        self.send(Message::of_values(values)?)
    }

    /// Receives the message with `key` and hands its values to `take` in order, as
    /// (offset, values) blocks that together cover the payload once; returns its element
    /// count. By default in one block, from the received tensor; shared memory lends them
    /// block by block from its ring as they arrive, so a payload is read once. A transport
    /// that fails midway has handed over part of the payload: the caller treats the values
    /// as lost with the error.
    ///
    /// # Errors
    /// As [`Transport::recv`]; a payload not in host memory.
    fn recv_with(&mut self, key: &Key, take: &mut ValueSink<'_>) -> Result<usize, TransportError> {
        self.recv(key)?.hand_to(take)
    }

    /// [`Transport::recv_with`] without waiting: `None` when the message has not (wholly)
    /// arrived, and then nothing was handed to `take`.
    ///
    /// # Errors
    /// As [`Transport::try_recv`].
    fn try_recv_with(
        &mut self,
        key: &Key,
        take: &mut ValueSink<'_>,
    ) -> Result<Option<usize>, TransportError> {
        self.try_recv(key)?.map(|m| m.hand_to(take)).transpose()
    }

    /// Sends a message to `message.key.to`. May block while the peer's queue is full.
    ///
    /// # Errors
    /// [`TransportError::Send`] with the message handed back, or [`TransportError::Aborted`]
    /// when a peer has failed.
    fn send(&mut self, message: Message) -> Result<(), TransportError>;

    /// Receives the message with exactly this key, buffering any other message that arrives
    /// first.
    ///
    /// # Errors
    /// [`TransportError::Closed`], [`TransportError::Aborted`], [`TransportError::Timeout`] or
    /// [`TransportError::Protocol`].
    fn recv(&mut self, key: &Key) -> Result<Message, TransportError>;

    /// The message with exactly this key if it has already arrived, without waiting: what a
    /// worker polls between actions (the chief collecting losses as they are computed).
    ///
    /// # Errors
    /// As [`Transport::recv`], except that nothing having arrived is `Ok(None)`.
    fn try_recv(&mut self, key: &Key) -> Result<Option<Message>, TransportError>;

    /// Waits as a receive of `key` would, until its message can be taken (`true`) or until a
    /// message that `notice` picks arrives first (`false`; it is kept for its own receive),
    /// taking neither: how the chief reads loss reports while its own program waits. Only a
    /// message that arrives during the call is noticed. By default it does not wait: `true`,
    /// and the receive that follows waits alone.
    ///
    /// # Errors
    /// As [`Transport::recv`].
    fn wait_for(
        &mut self,
        key: &Key,
        notice: &dyn Fn(&Key) -> bool,
    ) -> Result<bool, TransportError> {
        let _ = (key, notice);
        Ok(true)
    }

    /// Messages that have arrived and wait for their receive: this worker's input queue, as
    /// the metrics report it.
    fn buffered(&self) -> usize;

    /// Tells every peer that this worker has failed, so their blocked calls return
    /// [`TransportError::Aborted`]. Best effort and never blocks: a peer that is already gone
    /// is skipped. Later calls on this endpoint fail with `Aborted` too.
    fn abort(&mut self);

    /// Ends this worker's part: everything it sent reaches its peers before the transport lets
    /// go (a networked transport waits, bounded, until each peer has read it all). Call it
    /// once a worker's program is complete, or after [`Transport::abort`], before dropping the
    /// endpoint.
    ///
    /// # Errors
    /// Transport errors while finishing.
    fn close(&mut self) -> Result<(), TransportError>;

    /// A handle that stops this endpoint's calls as if a peer were lost, for a transport that
    /// notices a dead peer only by its silence (QUIC's idle timeout); `None` where a dead
    /// peer is noticed at once (shared memory, whose socket closes with the process).
    fn interrupter(&self) -> Option<Interrupter>;

    /// Where this endpoint listens, for a regroup after a peer is lost on the connections it
    /// has with the others ([`Transport::regroup`]): the address the survivors' launcher names
    /// again (on the survivor that hosts the lost rank, in that rank's place too). `None`
    /// where this transport cannot regroup: its survivors connect a new mesh.
    fn regroup_address(&mut self) -> Option<Result<String, TransportError>>;

    /// This endpoint's mesh going on without rank `lost` on the connections it has with the
    /// others ([`Transport::regroup_address`]); where survivor `host` hosts the
    /// lost rank, with that rank carried on `host`'s connections, so that no new endpoint and
    /// no handshake stand between the loss and the run going on. On the host, also the lost
    /// rank's endpoint. A regrouped mesh holds nothing sent before (QUIC:
    /// [`quic::Quic::regrouped`]). This endpoint is spent.
    ///
    /// # Errors
    /// [`TransportError::Setup`] from a transport that cannot regroup ([`cannot_regroup`]),
    /// or a regroup that fails.
    fn regroup(&mut self, lost: u32, host: Option<u32>) -> Result<Regrouped, TransportError>;

    /// Cuts the network link to `peer` for `pause`, in both directions, as a network
    /// partition would (for fault drills, [`fault::Fault::Partition`]). A transport with no
    /// network between its workers has no link to cut.
    ///
    /// # Errors
    /// [`TransportError::Setup`] from a transport with no link to cut ([`no_link_to_cut`]),
    /// or for a peer it does not have.
    fn cut_link(&mut self, peer: u32, pause: Duration) -> Result<(), TransportError>;
}

/// The error of [`Transport::regroup`] from worker `rank`'s transport that cannot regroup
/// without worker `lost`.
pub fn cannot_regroup(rank: u32, lost: u32) -> TransportError {
    TransportError::Setup(format!(
        "worker {rank} cannot go on without worker {lost} on its own connections"
    ))
}

/// The error of [`Transport::cut_link`] from a transport with no network link to `peer`.
pub fn no_link_to_cut(peer: u32) -> TransportError {
    TransportError::Setup(format!(
        "no network link to worker {peer} to cut: a partition needs worker processes (--transport quic)"
    ))
}

/// Inside an `impl Transport`, the answers of an endpoint that cannot regroup: no
/// [`Transport::regroup_address`], and [`Transport::regroup`] refused ([`cannot_regroup`]).
/// Stated where it is true, so that leaving regrouping out is a choice an impl writes down.
#[macro_export]
macro_rules! refuse_regroup {
    () => {
        fn regroup_address(
            &mut self,
        ) -> Option<std::result::Result<String, $crate::TransportError>> {
            None
        }
        fn regroup(
            &mut self,
            lost: u32,
            _host: Option<u32>,
        ) -> std::result::Result<$crate::Regrouped, $crate::TransportError> {
            Err($crate::cannot_regroup($crate::Transport::rank(self), lost))
        }
    };
}

/// Inside an `impl Transport`, [`Transport::cut_link`] of an endpoint with no network link
/// to cut ([`no_link_to_cut`]).
#[macro_export]
macro_rules! no_network_links {
    () => {
        fn cut_link(
            &mut self,
            peer: u32,
            _pause: std::time::Duration,
        ) -> std::result::Result<(), $crate::TransportError> {
            Err($crate::no_link_to_cut(peer))
        }
    };
}

/// A transport behind a box or a borrow is a transport: a box is what a worker holds when its
/// links were chosen at run time, a borrow what a wrapper around another's endpoint holds.
macro_rules! forward_transport {
    ($holder:ty) => {
        impl<T: Transport + ?Sized> Transport for $holder {
            fn rank(&self) -> u32 {
                (**self).rank()
            }
            fn carries_device_tensors(&self) -> bool {
                (**self).carries_device_tensors()
            }
            fn lends_device_buffers(&self, peer: u32) -> bool {
                (**self).lends_device_buffers(peer)
            }
            fn size(&self) -> u32 {
                (**self).size()
            }
            fn copies_payloads(&self) -> bool {
                (**self).copies_payloads()
            }
            fn link_buffer_bytes(&self) -> Option<u64> {
                (**self).link_buffer_bytes()
            }
            fn send_values(&mut self, values: Values<'_>) -> Result<(), TransportError> {
                (**self).send_values(values)
            }
            fn recv_with(
                &mut self,
                key: &Key,
                take: &mut ValueSink<'_>,
            ) -> Result<usize, TransportError> {
                (**self).recv_with(key, take)
            }
            fn try_recv_with(
                &mut self,
                key: &Key,
                take: &mut ValueSink<'_>,
            ) -> Result<Option<usize>, TransportError> {
                (**self).try_recv_with(key, take)
            }
            fn send(&mut self, message: Message) -> Result<(), TransportError> {
                (**self).send(message)
            }
            fn recv(&mut self, key: &Key) -> Result<Message, TransportError> {
                (**self).recv(key)
            }
            fn try_recv(&mut self, key: &Key) -> Result<Option<Message>, TransportError> {
                (**self).try_recv(key)
            }
            fn wait_for(
                &mut self,
                key: &Key,
                notice: &dyn Fn(&Key) -> bool,
            ) -> Result<bool, TransportError> {
                (**self).wait_for(key, notice)
            }
            fn buffered(&self) -> usize {
                (**self).buffered()
            }
            fn abort(&mut self) {
                (**self).abort()
            }
            fn close(&mut self) -> Result<(), TransportError> {
                (**self).close()
            }
            fn cut_link(&mut self, peer: u32, pause: Duration) -> Result<(), TransportError> {
                (**self).cut_link(peer, pause)
            }
            fn interrupter(&self) -> Option<Interrupter> {
                (**self).interrupter()
            }
            fn regroup_address(&mut self) -> Option<Result<String, TransportError>> {
                (**self).regroup_address()
            }
            fn regroup(
                &mut self,
                lost: u32,
                host: Option<u32>,
            ) -> Result<Regrouped, TransportError> {
                (**self).regroup(lost, host)
            }
        }
    };
}

forward_transport!(Box<T>);
forward_transport!(&mut T);
