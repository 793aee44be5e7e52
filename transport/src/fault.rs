//! Fault injection: a [`Transport`] that wraps a real one and breaks it on purpose, so that
//! tests can check what a run does when a message is late, reordered, duplicated or lost, when
//! a connection resets, and when a worker panics, fails or stalls. The core has no fault flags;
//! a test wraps each endpoint of a mesh in [`Faulty`] and runs the ordinary launcher.
//!
//! Counting is over the data messages a worker sends (activations, gradients, all-reduce
//! chunks): control records between the chief and the workers are passed through untouched, so
//! that a fault lands inside the schedule, where the executor must cope with it. Faults fire at
//! a given send (the `nth`, from 1) so that a test is deterministic; [`Fault::Delay`] draws its
//! delays from a seeded generator.

use std::time::Duration;

use crate::{Key, Kind, Message, Transport, TransportError};

/// What goes wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Nothing: the wrapper only passes messages through.
    None,
    /// Every data message waits a seeded random time below `max` before it is sent.
    Delay {
        /// Longest delay.
        max: Duration,
        /// Seed of the delays.
        seed: u64,
    },
    /// Data messages are held back and sent newest first, `window` at a time (and whenever the
    /// worker is about to wait in a receive or close, so that holding them never blocks a peer
    /// the worker then waits for): the reordering the protocol allows, since a receiver asks
    /// for messages by key. Control records are not held, so they may overtake held data; a
    /// send that blocks on a full queue while data is held is not covered (queues here hold far
    /// more than a window).
    Reorder {
        /// Messages held before they are released.
        window: usize,
    },
    /// The `nth` data message is sent twice.
    Duplicate {
        /// Which send.
        nth: u64,
    },
    /// The `nth` data message is never sent (and the send reports success).
    Drop {
        /// Which send.
        nth: u64,
    },
    /// At the `nth` data message the connection resets: the endpoint is dropped without the
    /// closing handshake, and every later call fails.
    Reset {
        /// Which send.
        nth: u64,
    },
    /// The worker panics at its `nth` data message.
    Panic {
        /// Which send.
        nth: u64,
    },
    /// The `nth` send fails with an error.
    Fail {
        /// Which send.
        nth: u64,
    },
    /// The worker stops for `pause` at its `nth` data message, then goes on.
    Stall {
        /// Which send.
        nth: u64,
        /// How long.
        pause: Duration,
    },
}

/// A transport endpoint with a [`Fault`].
#[derive(Debug)]
pub struct Faulty<T> {
    inner: Option<T>,
    rank: u32,
    size: u32,
    fault: Fault,
    sent: u64,
    held: Vec<Message>,
    rng: u64,
}

impl<T: Transport> Faulty<T> {
    /// Wraps `inner` with `fault`.
    pub fn new(inner: T, fault: Fault) -> Self {
        let seed = match fault {
            Fault::Delay { seed, .. } => seed,
            _ => 0,
        };
        let rank = inner.rank();
        Faulty {
            rank,
            size: inner.size(),
            inner: Some(inner),
            fault,
            sent: 0,
            held: Vec::new(),
            // Each worker draws other delays from one seed.
            rng: seed ^ u64::from(rank).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        }
    }

    fn inner(&mut self) -> Result<&mut T, TransportError> {
        let rank = self.rank;
        self.inner.as_mut().ok_or_else(|| TransportError::Lost {
            peer: rank,
            why: "the connection was reset (injected fault)".into(),
        })
    }

    /// Sends what [`Fault::Reorder`] holds, newest first.
    fn flush(&mut self) -> Result<(), TransportError> {
        while let Some(m) = self.held.pop() {
            self.inner()?.send(m)?;
        }
        Ok(())
    }

    /// The next delay of [`Fault::Delay`] (splitmix64).
    fn next_delay(&mut self, max: Duration) -> Duration {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let nanos = max.as_nanos().max(1) as u64;
        Duration::from_nanos(z % nanos)
    }
}

/// A copy of a message (for [`Fault::Duplicate`]).
fn copy_of(m: &Message) -> Result<Message, TransportError> {
    let data = m
        .tensor
        .host()
        .map_err(|e| TransportError::Protocol(format!("{:?}: {e}", m.key)))?
        .to_vec();
    let tensor = pipe_kernels::Tensor::from_vec(m.tensor.shape(), data)
        .map_err(|e| TransportError::Protocol(format!("{:?}: {e}", m.key)))?;
    Ok(Message {
        key: m.key,
        version: m.version,
        tensor,
    })
}

impl<T: Transport> Transport for Faulty<T> {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    fn send(&mut self, message: Message) -> Result<(), TransportError> {
        if message.key.kind == Kind::Control {
            return self.inner()?.send(message);
        }
        self.sent += 1;
        let n = self.sent;
        match self.fault {
            Fault::None => self.inner()?.send(message),
            Fault::Delay { max, .. } => {
                std::thread::sleep(self.next_delay(max));
                self.inner()?.send(message)
            }
            Fault::Reorder { window } => {
                self.held.push(message);
                if self.held.len() >= window.max(1) {
                    self.flush()?;
                }
                Ok(())
            }
            Fault::Duplicate { nth } if n == nth => {
                let twin = copy_of(&message)?;
                self.inner()?.send(message)?;
                self.inner()?.send(twin)
            }
            Fault::Drop { nth } if n == nth => Ok(()),
            Fault::Reset { nth } if n == nth => {
                // Dropped without `close`: peers see the connection end mid-run.
                self.inner = None;
                self.inner().map(|_| ())
            }
            Fault::Panic { nth } if n == nth => {
                panic!("injected panic at data message {n} of worker {}", self.rank)
            }
            Fault::Fail { nth } if n == nth => Err(TransportError::Send {
                message: Box::new(message),
                reason: format!("injected failure at data message {n}"),
            }),
            Fault::Stall { nth, pause } if n == nth => {
                std::thread::sleep(pause);
                self.inner()?.send(message)
            }
            _ => self.inner()?.send(message),
        }
    }

    fn recv(&mut self, key: &Key) -> Result<Message, TransportError> {
        self.flush()?;
        self.inner()?.recv(key)
    }

    fn try_recv(&mut self, key: &Key) -> Result<Option<Message>, TransportError> {
        // A poll never waits, so what is held cannot block anyone here: keep holding it.
        self.inner()?.try_recv(key)
    }

    fn buffered(&self) -> usize {
        self.inner.as_ref().map_or(0, Transport::buffered)
    }

    fn abort(&mut self) {
        self.held.clear();
        if let Some(t) = self.inner.as_mut() {
            t.abort();
        }
    }

    fn close(&mut self) -> Result<(), TransportError> {
        self.flush()?;
        self.inner()?.close()
    }
}
