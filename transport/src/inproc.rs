//! The in-process transport: every worker is a thread; each ordered pair of workers has a
//! bounded crossbeam channel that moves `Message`s (the tensor's buffer moves, it is never
//! copied). A receive drains the sender's channel into a small map until its key shows up, so
//! messages may be consumed in a different order than they were sent.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, SendTimeoutError, Sender, bounded};

use crate::{Abort, Key, Message, Transport, TransportError};

/// How often a blocked call looks at the abort flag.
const POLL: Duration = Duration::from_millis(5);

/// Options of an in-process mesh.
#[derive(Clone, Debug)]
pub struct InProcOptions {
    /// Messages each directed channel holds before a sender blocks.
    pub capacity: usize,
    /// How long a receive waits before failing with a timeout (None: forever, until aborted).
    pub timeout: Option<Duration>,
}

impl Default for InProcOptions {
    fn default() -> Self {
        InProcOptions {
            capacity: 1024,
            timeout: None,
        }
    }
}

/// One worker's endpoint of an in-process mesh.
#[derive(Debug)]
pub struct InProc {
    rank: u32,
    to: Vec<Sender<Message>>,
    from: Vec<Receiver<Message>>,
    early: HashMap<Key, Message>,
    abort: Abort,
    timeout: Option<Duration>,
}

/// Builds a full mesh of `workers` endpoints sharing `abort`.
pub fn mesh(workers: u32, opts: &InProcOptions, abort: &Abort) -> Vec<InProc> {
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
    senders
        .into_iter()
        .zip(receivers)
        .enumerate()
        .map(|(rank, (to, from))| InProc {
            rank: rank as u32,
            to,
            from: from.into_iter().flatten().collect(),
            early: HashMap::new(),
            abort: abort.clone(),
            timeout: opts.timeout,
        })
        .collect()
}

impl Transport for InProc {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.to.len() as u32
    }

    fn send(&mut self, message: Message) -> Result<(), TransportError> {
        let to = message.key.to as usize;
        let Some(tx) = self.to.get(to) else {
            return Err(TransportError::Send {
                reason: format!("no worker {to} in a mesh of {}", self.to.len()),
                message: Box::new(message),
            });
        };
        let mut message = message;
        loop {
            if self.abort.is_set() {
                return Err(TransportError::Aborted);
            }
            match tx.send_timeout(message, POLL) {
                Ok(()) => return Ok(()),
                Err(SendTimeoutError::Timeout(m)) => message = m,
                Err(SendTimeoutError::Disconnected(m)) => {
                    return Err(TransportError::Send {
                        reason: format!("worker {to} is gone"),
                        message: Box::new(m),
                    });
                }
            }
        }
    }

    fn recv(&mut self, key: &Key) -> Result<Message, TransportError> {
        if key.to != self.rank {
            return Err(TransportError::Protocol(format!(
                "worker {} asked for a message addressed to {}",
                self.rank, key.to
            )));
        }
        if let Some(m) = self.early.remove(key) {
            return Ok(m);
        }
        let Some(rx) = self.from.get(key.from as usize) else {
            return Err(TransportError::Protocol(format!(
                "no worker {} in a mesh of {}",
                key.from,
                self.from.len()
            )));
        };
        let start = Instant::now();
        loop {
            if self.abort.is_set() {
                return Err(TransportError::Aborted);
            }
            match rx.recv_timeout(POLL) {
                Ok(m) if m.key == *key => return Ok(m),
                Ok(m) => {
                    if m.key.to != self.rank || m.key.from != key.from {
                        return Err(TransportError::Protocol(format!(
                            "worker {} received {:?} on its channel from {}",
                            self.rank, m.key, key.from
                        )));
                    }
                    if self.early.contains_key(&m.key) {
                        return Err(TransportError::Protocol(format!(
                            "duplicate message {:?}",
                            m.key
                        )));
                    }
                    self.early.insert(m.key, m);
                }
                Err(RecvTimeoutError::Timeout) => {
                    if let Some(limit) = self.timeout {
                        if start.elapsed() >= limit {
                            return Err(TransportError::Timeout {
                                key: *key,
                                waited: start.elapsed(),
                            });
                        }
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(TransportError::Closed { peer: key.from });
                }
            }
        }
    }
}
