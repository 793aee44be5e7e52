//! `pipe-transport` owns moving tensors between workers: one [`Transport`] trait, an in-process
//! implementation ([`inproc`]: crossbeam channels moving owned buffers, no copies), the ring
//! all-reduce written once over the trait ([`collective`]), and, in later work, QUIC and NCCL.
//!
//! The trait is shaped around how schedules use it. Every message has a [`Key`] (sender,
//! receiver, kind, stage, microbatch or update, ring step) that the receiver asks for by value,
//! because a lowered schedule places each receive where its data is consumed, not where it was
//! sent: messages from one peer may be consumed in another order than they were sent, and the
//! transport buffers the early ones. A failed send hands the message back. Every blocking call
//! watches a shared abort flag, so one failing worker stops all the others promptly instead of
//! leaving them waiting forever. The test suite in `tests/suite.rs` is written against the trait
//! so each implementation runs the same cases.

#![warn(missing_docs)]

pub mod collective;
pub mod inproc;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pipe_kernels::Tensor;
use thiserror::Error;

/// What a message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A stage's output activation, going to the next stage.
    Activation,
    /// The gradient of a stage's input, going to the previous stage.
    Gradient,
    /// A chunk of a ring all-reduce.
    Chunk,
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

/// Errors of a transport.
#[derive(Debug, Error)]
pub enum TransportError {
    /// The peer is gone (its endpoint was dropped or its connection closed).
    #[error("worker {peer} is gone")]
    Closed {
        /// The peer.
        peer: u32,
    },
    /// Another worker failed and the run is being stopped.
    #[error("stopped because another worker failed")]
    Aborted,
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
    /// A send failed; the message is handed back.
    #[error("sending {:?} failed: {reason}", .message.key)]
    Send {
        /// The message that was not sent.
        message: Box<Message>,
        /// Why.
        reason: String,
    },
}

/// A worker's end of the mesh.
pub trait Transport: Send {
    /// This worker's number.
    fn rank(&self) -> u32;

    /// Number of workers in the mesh.
    fn size(&self) -> u32;

    /// Sends a message to `message.key.to`. May block while the peer's queue is full.
    ///
    /// # Errors
    /// [`TransportError::Send`] with the message handed back, or [`TransportError::Aborted`].
    fn send(&mut self, message: Message) -> Result<(), TransportError>;

    /// Receives the message with exactly this key, buffering any other message that arrives
    /// first.
    ///
    /// # Errors
    /// [`TransportError::Closed`], [`TransportError::Aborted`], [`TransportError::Timeout`] or
    /// [`TransportError::Protocol`].
    fn recv(&mut self, key: &Key) -> Result<Message, TransportError>;
}

/// A flag shared by every worker of a run: set once, by the first worker that fails.
#[derive(Clone, Debug, Default)]
pub struct Abort(Arc<AtomicBool>);

impl Abort {
    /// A fresh, unset flag.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stops the run.
    pub fn trigger(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// True once some worker has stopped the run.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}
