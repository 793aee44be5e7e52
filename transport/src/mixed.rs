//! Shared memory to the peers on this host, QUIC to the others: the endpoint of a cluster
//! file's worker under `--transport auto` ([`crate::kinds`]). Which peers share this host
//! comes from the QUIC hellos, which carry each worker's host identity (boot id and network
//! namespace, [`crate::shm::HostId`]), so both ends of a link decide alike; those links are
//! then set up over the shared-memory rendezvous and carry every message, the others stay on
//! QUIC. Each call goes to the transport of the link it names (a receive by its key's sender,
//! a send by its receiver); an abort and a close go to both, and an abort names the same cause
//! on both (the peer that was lost, or the worker that failed first), so every worker's error
//! points at one rank whichever way it heard.
//!
//! A call blocked on shared memory wakes as soon as QUIC hears of a failure (QUIC's
//! connection tasks raise the shared-memory endpoint's alarm). The other way round, a call
//! blocked on QUIC hears of a failure on this host when the peer it waits for stops, which it
//! does once told (every worker that fails tells all its peers, over both transports), or at
//! the stall bound.

use std::time::Duration;

use crate::quic::Quic;
use crate::shm::Shm;
use crate::{Key, Message, Transport, TransportError, ValueSink, Values};

/// Shared memory to some peers, QUIC to the rest.
pub struct Mixed {
    quic: Quic,
    shm: Shm,
    /// `local[p]`: peer `p` is on this host (reached over shared memory).
    local: Vec<bool>,
}

impl Mixed {
    /// Joins `quic` (connected to every peer) and `shm` (connected to the peers in `local`,
    /// which route over it from now on).
    ///
    /// # Errors
    /// [`TransportError::Setup`] when the two disagree on the rank or the mesh.
    pub fn new(quic: Quic, shm: Shm, local: &[u32]) -> Result<Mixed, TransportError> {
        if quic.rank() != shm.rank() || quic.size() != shm.size() {
            return Err(TransportError::Setup(format!(
                "QUIC endpoint {} of {} and shared-memory endpoint {} of {}",
                quic.rank(),
                quic.size(),
                shm.rank(),
                shm.size()
            )));
        }
        // A failure QUIC hears wakes a call blocked on shared memory.
        let alarm = shm.alarm()?;
        quic.on_failure(Box::new(move |by| alarm.raise(by)));
        let mut on_host = vec![false; quic.size() as usize];
        for &p in local {
            if let Some(slot) = on_host.get_mut(p as usize) {
                *slot = true;
            }
        }
        Ok(Mixed {
            quic,
            shm,
            local: on_host,
        })
    }

    /// The peers reached over shared memory.
    pub fn local_peers(&self) -> Vec<u32> {
        (0..self.local.len() as u32)
            .filter(|&p| self.is_local(p))
            .collect()
    }

    /// Whether the link to `peer` is shared memory's.
    fn is_local(&self, peer: u32) -> bool {
        self.local.get(peer as usize).copied().unwrap_or(false)
    }

    /// The transport of the link to `peer`.
    fn to(&mut self, peer: u32) -> &mut dyn Transport {
        if self.is_local(peer) {
            &mut self.shm
        } else {
            &mut self.quic
        }
    }
}

impl Transport for Mixed {
    fn rank(&self) -> u32 {
        self.quic.rank()
    }

    fn size(&self) -> u32 {
        self.quic.size()
    }

    fn copies_payloads(&self) -> bool {
        // The ring lends values to every link; QUIC's links take them through the defaults.
        true
    }

    fn link_buffer_bytes(&self) -> Option<u64> {
        self.shm.link_buffer_bytes()
    }

    fn send_values(&mut self, values: Values<'_>) -> Result<(), TransportError> {
        self.to(values.key.to).send_values(values)
    }

    fn recv_with(&mut self, key: &Key, take: &mut ValueSink<'_>) -> Result<usize, TransportError> {
        self.to(key.from).recv_with(key, take)
    }

    fn try_recv_with(
        &mut self,
        key: &Key,
        take: &mut ValueSink<'_>,
    ) -> Result<Option<usize>, TransportError> {
        self.to(key.from).try_recv_with(key, take)
    }

    fn send(&mut self, message: Message) -> Result<(), TransportError> {
        self.to(message.key.to).send(message)
    }

    fn recv(&mut self, key: &Key) -> Result<Message, TransportError> {
        self.to(key.from).recv(key)
    }

    fn try_recv(&mut self, key: &Key) -> Result<Option<Message>, TransportError> {
        self.to(key.from).try_recv(key)
    }

    /// Noticing only what arrives over the link that `key` comes by.
    fn wait_for(
        &mut self,
        key: &Key,
        notice: &dyn Fn(&Key) -> bool,
    ) -> Result<bool, TransportError> {
        self.to(key.from).wait_for(key, notice)
    }

    fn buffered(&self) -> usize {
        self.quic.buffered() + self.shm.buffered()
    }

    fn abort(&mut self) {
        let by = self
            .quic
            .cause()
            .or(self.shm.cause())
            .unwrap_or(self.quic.rank());
        self.quic.abort_as(by);
        self.shm.abort_as(by);
    }

    fn close(&mut self) -> Result<(), TransportError> {
        let shm = self.shm.close();
        let quic = self.quic.close();
        shm.and(quic)
    }

    fn cut_link(&mut self, peer: u32, pause: Duration) -> Result<(), TransportError> {
        self.to(peer).cut_link(peer, pause)
    }
    fn carries_device_tensors(&self) -> bool {
        false
    }
    /// As the link to `peer` does: shared memory's within the host, QUIC's (none) beyond it.
    fn lends_device_buffers(&self, peer: u32) -> bool {
        if self.is_local(peer) {
            self.shm.lends_device_buffers(peer)
        } else {
            self.quic.lends_device_buffers(peer)
        }
    }
    /// QUIC's: it notices a dead peer only by its silence, and a failure it hears wakes the
    /// calls blocked on shared memory too.
    fn interrupter(&self) -> Option<crate::Interrupter> {
        self.quic.interrupter()
    }
    // Mixed meshes do not regroup: their survivors connect a new mesh.
    crate::refuse_regroup!();
}
