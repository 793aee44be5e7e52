//! The receiving side shared by the transports whose messages arrive on crossbeam channels
//! ([`crate::inproc`], [`crate::tcp`]): the control channel that carries aborts, the abort this
//! endpoint has seen, the messages that arrived before they were asked for, and the stall
//! bound. A receive waits on the peer's data channel, the control channel and the stall timer
//! at once (`select!`), so an abort wakes it immediately and nothing polls.

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TryRecvError, never, select};

use crate::{Early, Key, Message, TransportError};

/// One endpoint's aborts, early messages and stall bound (see the module docs).
#[derive(Debug)]
pub(crate) struct Inbox {
    /// This worker's number.
    rank: u32,
    /// Aborts from peers: the rank of the worker that failed.
    control: Receiver<u32>,
    /// The worker whose abort this endpoint has seen.
    aborted_by: Option<u32>,
    early: Early,
    /// How long a receive of data waits (the stall bound); `None`: without bound.
    timeout: Option<Duration>,
}

impl Inbox {
    /// The inbox of worker `rank`, told of aborts on `control`.
    pub(crate) fn new(rank: u32, control: Receiver<u32>, timeout: Option<Duration>) -> Self {
        Inbox {
            rank,
            control,
            aborted_by: None,
            early: Early::default(),
            timeout,
        }
    }

    /// The channel aborts arrive on.
    pub(crate) fn control(&self) -> &Receiver<u32> {
        &self.control
    }

    /// Records an abort from `by` and returns the error every later call gives.
    pub(crate) fn aborted(&mut self, by: u32) -> TransportError {
        let by = *self.aborted_by.get_or_insert(by);
        TransportError::Aborted { by }
    }

    /// Records this worker's own abort, unless a peer's reached it first.
    pub(crate) fn abort_here(&mut self) {
        self.aborted_by.get_or_insert(self.rank);
    }

    /// `Aborted` once an abort has reached this endpoint (without looking for a new one).
    pub(crate) fn check_aborted(&self) -> Result<(), TransportError> {
        match self.aborted_by {
            Some(by) => Err(TransportError::Aborted { by }),
            None => Ok(()),
        }
    }

    /// [`Inbox::check_aborted`], after taking in an abort that waits on the control channel.
    pub(crate) fn poll_aborted(&mut self) -> Result<(), TransportError> {
        if let Ok(by) = self.control.try_recv() {
            return Err(self.aborted(by));
        }
        self.check_aborted()
    }

    /// The error for a peer whose channel closed: `Aborted` when an abort reached this
    /// endpoint, else `gone`. A peer stops after an abort (its own or one it received), and
    /// the abort that stopped it was sent to every endpoint as it began, so a closed channel
    /// during a failure is the echo of that abort, not a second failure. The abort may trail
    /// the closing by the time its sender takes to tell the other peers: wait a moment for it.
    pub(crate) fn abort_or(&mut self, gone: TransportError) -> TransportError {
        if let Some(by) = self.aborted_by {
            return TransportError::Aborted { by };
        }
        match self.control.recv_timeout(Duration::from_millis(200)) {
            Ok(by) => self.aborted(by),
            Err(_) => gone,
        }
    }

    /// Messages that arrived before they were asked for.
    pub(crate) fn buffered(&self) -> usize {
        self.early.len()
    }

    /// Keeps a message that arrived on the channel from `from` before it was asked for.
    fn keep_early(&mut self, m: Message, from: u32) -> Result<(), TransportError> {
        if m.key.to != self.rank || m.key.from != from {
            return Err(TransportError::Protocol(format!(
                "worker {} received {:?} on its channel from {from}",
                self.rank, m.key
            )));
        }
        self.early.keep(m)
    }

    /// Receives the message with `key` (checked by the caller) from `rx`, the channel from
    /// `key.from`, keeping the messages that come before it. `closed` gives the error for a
    /// channel that closed.
    pub(crate) fn recv(
        &mut self,
        key: &Key,
        rx: &Receiver<Message>,
        closed: impl FnOnce(&mut Self) -> TransportError,
    ) -> Result<Message, TransportError> {
        if let Some(m) = self.early.take(key) {
            return Ok(m);
        }
        self.check_aborted()?;
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
                    Err(_) => return Err(closed(self)),
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

    /// [`Inbox::recv`] without waiting: `None` when the message has not arrived. `closed`
    /// answers for a channel that closed.
    pub(crate) fn try_recv(
        &mut self,
        key: &Key,
        rx: &Receiver<Message>,
        closed: impl FnOnce(&mut Self) -> Result<Option<Message>, TransportError>,
    ) -> Result<Option<Message>, TransportError> {
        if let Some(m) = self.early.take(key) {
            return Ok(Some(m));
        }
        self.poll_aborted()?;
        loop {
            match rx.try_recv() {
                Ok(m) if m.key == *key => return Ok(Some(m)),
                Ok(m) => self.keep_early(m, key.from)?,
                Err(TryRecvError::Empty) => return Ok(None),
                Err(TryRecvError::Disconnected) => return closed(self),
            }
        }
    }
}
