//! What a worker does between its actions ([`Between`]), and while one of its receives waits:
//! a worker process forwards the losses it computes to the chief after each action, and the
//! chief takes the losses that arrive. The chief's actions wait on the pipeline (a gradient
//! from the next stage, its replicas' all-reduce chunks), so between actions alone it
//! reports an update only once its own wait ends: tens of milliseconds late, longer while the
//! pipeline refills after a loss. A wait that [`Noticing`] wraps ends early each time a message
//! the worker notices arrives ([`Transport::wait_for`]), runs [`Between::run`] and waits on.

use pipe_transport::{Interrupter, Key, Message, Transport, TransportError, ValueSink, Values};

use crate::error::{Result, StageError};

/// What a worker runs after every action, and where it [`Between::notices`] a message, while
/// a receive waits. A closure is one that notices nothing.
pub trait Between<T: ?Sized> {
    /// Runs with the worker's transport.
    ///
    /// # Errors
    /// Whatever the work fails with: the failure of the action it ran after (or in).
    fn run(&mut self, t: &mut T) -> Result<()>;

    /// Whether the arrival of a message with `key` while a receive waits runs
    /// [`Between::run`] at once. None by default.
    fn notices(&self, key: &Key) -> bool {
        let _ = key;
        false
    }

    /// Whether any message is noticed: a worker that notices none waits as the transport does.
    fn notices_any(&self) -> bool {
        false
    }
}

impl<T: ?Sized, F: FnMut(&mut T) -> Result<()>> Between<T> for F {
    fn run(&mut self, t: &mut T) -> Result<()> {
        self(t)
    }
}

/// A worker's transport while one action runs, where the worker notices messages: each wait
/// of a receive ends as a noticed message arrives, runs `between` and waits on.
pub struct Noticing<'n, T: ?Sized> {
    inner: &'n mut T,
    between: &'n mut (dyn Between<T> + Send),
    /// `between`'s failure: the action that waited fails with it.
    failed: Option<StageError>,
}

impl<'n, T: Transport + ?Sized> Noticing<'n, T> {
    /// `inner`, whose waits run `between` for what it notices.
    pub fn new(inner: &'n mut T, between: &'n mut (dyn Between<T> + Send)) -> Self {
        Noticing {
            inner,
            between,
            failed: None,
        }
    }

    /// The failure of `between` that ended the last action, if one did.
    pub fn failure(&mut self) -> Option<StageError> {
        self.failed.take()
    }

    /// Waits until `key`'s message can be received, running `between` for each noticed
    /// message that arrives first.
    fn wait(&mut self, key: &Key) -> std::result::Result<(), TransportError> {
        loop {
            let between = &*self.between;
            if self.inner.wait_for(key, &|k| between.notices(k))? {
                return Ok(());
            }
            if let Err(e) = self.between.run(self.inner) {
                let by = self.inner.rank();
                self.failed = Some(e);
                return Err(TransportError::Aborted { by });
            }
        }
    }
}

impl<T: Transport + ?Sized> Transport for Noticing<'_, T> {
    fn rank(&self) -> u32 {
        self.inner.rank()
    }
    fn carries_device_tensors(&self) -> bool {
        self.inner.carries_device_tensors()
    }
    fn lends_device_buffers(&self, peer: u32) -> bool {
        self.inner.lends_device_buffers(peer)
    }
    fn size(&self) -> u32 {
        self.inner.size()
    }
    fn copies_payloads(&self) -> bool {
        self.inner.copies_payloads()
    }
    fn link_buffer_bytes(&self) -> Option<u64> {
        self.inner.link_buffer_bytes()
    }
    fn send_values(&mut self, values: Values<'_>) -> std::result::Result<(), TransportError> {
        self.inner.send_values(values)
    }
    fn recv_with(
        &mut self,
        key: &Key,
        take: &mut ValueSink<'_>,
    ) -> std::result::Result<usize, TransportError> {
        self.wait(key)?;
        self.inner.recv_with(key, take)
    }
    fn try_recv_with(
        &mut self,
        key: &Key,
        take: &mut ValueSink<'_>,
    ) -> std::result::Result<Option<usize>, TransportError> {
        self.inner.try_recv_with(key, take)
    }
    fn send(&mut self, message: Message) -> std::result::Result<(), TransportError> {
        self.inner.send(message)
    }
    fn recv(&mut self, key: &Key) -> std::result::Result<Message, TransportError> {
        self.wait(key)?;
        self.inner.recv(key)
    }
    fn try_recv(&mut self, key: &Key) -> std::result::Result<Option<Message>, TransportError> {
        self.inner.try_recv(key)
    }
    fn wait_for(
        &mut self,
        key: &Key,
        notice: &dyn Fn(&Key) -> bool,
    ) -> std::result::Result<bool, TransportError> {
        self.inner.wait_for(key, notice)
    }
    fn buffered(&self) -> usize {
        self.inner.buffered()
    }
    fn abort(&mut self) {
        self.inner.abort();
    }
    fn close(&mut self) -> std::result::Result<(), TransportError> {
        self.inner.close()
    }
    fn cut_link(
        &mut self,
        peer: u32,
        pause: std::time::Duration,
    ) -> std::result::Result<(), TransportError> {
        self.inner.cut_link(peer, pause)
    }
    fn interrupter(&self) -> Option<Interrupter> {
        self.inner.interrupter()
    }
    fn regroup_address(&mut self) -> Option<std::result::Result<String, TransportError>> {
        self.inner.regroup_address()
    }
    fn regroup(
        &mut self,
        lost: u32,
        host: Option<u32>,
    ) -> std::result::Result<pipe_transport::Regrouped, TransportError> {
        self.inner.regroup(lost, host)
    }
}
