//! A mesh whose workers are numbered apart from its ranks: what the survivors of a lost worker
//! run on. Their mesh keeps the ranks (and the credentials) they started with, one of them
//! absent; their new layout numbers its workers from 0 without a gap. [`Renumbered`] maps the
//! layout's worker numbers to the mesh's ranks in every key that goes out and back in every
//! key that comes in, so that the runtime above sees a mesh of `workers.len()` workers.

use std::time::Duration;

use crate::{Key, Message, Transport, TransportError, ValueSink, Values};

/// `inner` (a mesh of ranks) seen as the mesh of the workers in `ranks`: worker `w` is rank
/// `ranks[w]`.
pub struct Renumbered<T: Transport> {
    inner: T,
    /// The rank of each worker.
    ranks: Vec<u32>,
    /// The worker of each rank of `inner`, where it has one.
    workers: Vec<Option<u32>>,
    /// This endpoint's worker number.
    me: u32,
    /// XORed into the stage of every data key (not control): see [`Renumbered::tagging_data`].
    data_tag: u32,
}

impl<T: Transport> Renumbered<T> {
    /// `inner` as the mesh of the workers whose ranks are `ranks`, in worker order; `inner`'s
    /// own rank must be among them.
    ///
    /// # Errors
    /// [`TransportError::Setup`]: a rank listed twice, past `inner`'s size, or this endpoint's
    /// rank missing.
    pub fn new(inner: T, ranks: Vec<u32>) -> Result<Self, TransportError> {
        let mut workers = vec![None; inner.size() as usize];
        for (w, &r) in ranks.iter().enumerate() {
            let slot = workers.get_mut(r as usize).ok_or_else(|| {
                TransportError::Setup(format!("rank {r} in a mesh of {}", inner.size()))
            })?;
            if slot.replace(w as u32).is_some() {
                return Err(TransportError::Setup(format!("rank {r} named twice")));
            }
        }
        let me = workers
            .get(inner.rank() as usize)
            .copied()
            .flatten()
            .ok_or_else(|| {
                TransportError::Setup(format!(
                    "rank {} is not among the workers {ranks:?}",
                    inner.rank()
                ))
            })?;
        Ok(Renumbered {
            inner,
            ranks,
            workers,
            me,
            data_tag: 0,
        })
    }

    /// This mesh with `tag` XORed into the stage of every data message's key, going out and
    /// coming in: a data message sent on `inner` before it was renumbered (a copy no one
    /// read, left from a segment that was taken over) then never matches one sent after,
    /// whose keys start again from the same numbers. Every endpoint of the mesh must take
    /// the same tag.
    pub fn tagging_data(mut self, tag: u32) -> Self {
        self.data_tag = tag;
        self
    }

    /// `stage` of a key of `kind`, tagged (or untagged: XOR is its own inverse).
    fn tagged(&self, kind: crate::Kind, stage: u32) -> u32 {
        tagged(kind, stage, self.data_tag)
    }

    /// The rank of worker `w`.
    fn rank_of(&self, w: u32) -> Result<u32, TransportError> {
        self.ranks
            .get(w as usize)
            .copied()
            .ok_or_else(|| TransportError::Protocol(format!("no worker {w} in this mesh")))
    }

    /// The worker of rank `r`.
    fn worker_of(&self, r: u32) -> Result<u32, TransportError> {
        worker_of(&self.workers, r)
    }

    /// `key` with worker numbers as ranks.
    fn outward(&self, key: &Key) -> Result<Key, TransportError> {
        Ok(Key {
            from: self.rank_of(key.from)?,
            to: self.rank_of(key.to)?,
            stage: self.tagged(key.kind, key.stage),
            ..*key
        })
    }

    /// `m` with ranks as worker numbers.
    fn inward(&self, mut m: Message) -> Result<Message, TransportError> {
        m.key = inward(&m.key, &self.workers, self.data_tag)?;
        Ok(m)
    }

    /// An error of `inner` with ranks as worker numbers where it names one.
    fn named(&self, e: TransportError) -> TransportError {
        let worker = |r: u32| self.worker_of(r).unwrap_or(r);
        match e {
            TransportError::Closed { peer } => TransportError::Closed { peer: worker(peer) },
            TransportError::Lost { peer, why } => TransportError::Lost {
                peer: worker(peer),
                why,
            },
            TransportError::Aborted { by } => TransportError::Aborted { by: worker(by) },
            other => other,
        }
    }
}

/// `stage` of a key of `kind`, with `tag` XORed in where it is a data key.
fn tagged(kind: crate::Kind, stage: u32, tag: u32) -> u32 {
    match kind {
        crate::Kind::Control => stage,
        _ => stage ^ tag,
    }
}

/// The worker of rank `r`, from each rank's `workers`.
fn worker_of(workers: &[Option<u32>], r: u32) -> Result<u32, TransportError> {
    workers
        .get(r as usize)
        .copied()
        .flatten()
        .ok_or_else(|| TransportError::Protocol(format!("rank {r} has no worker here")))
}

/// `key` (of the inner mesh) with ranks as worker numbers and the data tag taken off; free
/// of the endpoint, so that a wait on the inner mesh can map what it notices.
fn inward(key: &Key, workers: &[Option<u32>], tag: u32) -> Result<Key, TransportError> {
    Ok(Key {
        from: worker_of(workers, key.from)?,
        to: worker_of(workers, key.to)?,
        stage: tagged(key.kind, key.stage, tag),
        ..*key
    })
}

impl<T: Transport> Transport for Renumbered<T> {
    fn rank(&self) -> u32 {
        self.me
    }
    fn carries_device_tensors(&self) -> bool {
        self.inner.carries_device_tensors()
    }
    fn lends_device_buffers(&self, peer: u32) -> bool {
        self.rank_of(peer)
            .is_ok_and(|rank| self.inner.lends_device_buffers(rank))
    }
    fn size(&self) -> u32 {
        self.ranks.len() as u32
    }
    fn copies_payloads(&self) -> bool {
        self.inner.copies_payloads()
    }
    fn link_buffer_bytes(&self) -> Option<u64> {
        self.inner.link_buffer_bytes()
    }
    fn send_values(&mut self, values: Values<'_>) -> Result<(), TransportError> {
        let key = self.outward(&values.key)?;
        let values = Values { key, ..values };
        self.inner.send_values(values).map_err(|e| self.named(e))
    }
    fn recv_with(&mut self, key: &Key, take: &mut ValueSink<'_>) -> Result<usize, TransportError> {
        let key = self.outward(key)?;
        self.inner.recv_with(&key, take).map_err(|e| self.named(e))
    }
    fn try_recv_with(
        &mut self,
        key: &Key,
        take: &mut ValueSink<'_>,
    ) -> Result<Option<usize>, TransportError> {
        let key = self.outward(key)?;
        self.inner
            .try_recv_with(&key, take)
            .map_err(|e| self.named(e))
    }
    fn send(&mut self, mut message: Message) -> Result<(), TransportError> {
        message.key = self.outward(&message.key)?;
        self.inner.send(message).map_err(|e| self.named(e))
    }
    fn recv(&mut self, key: &Key) -> Result<Message, TransportError> {
        let key = self.outward(key)?;
        let m = self.inner.recv(&key).map_err(|e| self.named(e))?;
        self.inward(m)
    }
    fn try_recv(&mut self, key: &Key) -> Result<Option<Message>, TransportError> {
        let key = self.outward(key)?;
        match self.inner.try_recv(&key).map_err(|e| self.named(e))? {
            Some(m) => self.inward(m).map(Some),
            None => Ok(None),
        }
    }
    fn wait_for(
        &mut self,
        key: &Key,
        notice: &dyn Fn(&Key) -> bool,
    ) -> Result<bool, TransportError> {
        let outward = self.outward(key)?;
        let (workers, tag) = (&self.workers, self.data_tag);
        let noticed = |k: &Key| inward(k, workers, tag).is_ok_and(|k| notice(&k));
        let waited = self.inner.wait_for(&outward, &noticed);
        waited.map_err(|e| self.named(e))
    }
    fn buffered(&self) -> usize {
        self.inner.buffered()
    }
    fn abort(&mut self) {
        self.inner.abort();
    }
    fn close(&mut self) -> Result<(), TransportError> {
        self.inner.close().map_err(|e| self.named(e))
    }
    fn cut_link(&mut self, peer: u32, pause: Duration) -> Result<(), TransportError> {
        let peer = self.rank_of(peer)?;
        self.inner.cut_link(peer, pause).map_err(|e| self.named(e))
    }
    /// The inner endpoint's: told of a peer by its mesh rank, as a launcher knows it.
    fn interrupter(&self) -> Option<crate::Interrupter> {
        self.inner.interrupter()
    }
    crate::refuse_regroup!();
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::Kind;

    /// Three survivors of a mesh of four (rank 1 lost) talk as workers 0, 1 and 2, and the
    /// keys they see name workers, not ranks.
    #[test]
    fn survivors_talk_as_a_mesh_of_their_own() {
        let mut eps: Vec<_> = crate::inproc::mesh(4, &crate::inproc::InProcOptions::default())
            .into_iter()
            .filter(|ep| ep.rank() != 1)
            .map(|ep| Renumbered::new(ep, vec![0, 2, 3]).unwrap())
            .collect();
        assert_eq!(
            eps.iter().map(|e| (e.rank(), e.size())).collect::<Vec<_>>(),
            [(0, 3), (1, 3), (2, 3)]
        );
        let key = Key::data(2, 1, Kind::Activation, 7);
        eps[2]
            .send(Message::from_bytes(key, b"from worker 2"))
            .unwrap();
        let got = eps[1].recv(&key).unwrap();
        assert_eq!((got.key.from, got.key.to), (2, 1));
        assert_eq!(got.into_bytes().unwrap(), b"from worker 2");
    }

    /// A launcher that reaps a dead worker stops its peers' calls through the endpoint's
    /// interrupter, naming the mesh rank: a renumbered QUIC endpoint (the survivors' after a
    /// regroup) hands it on, where it once had none and a call waited out the stall bound.
    #[test]
    fn the_interrupter_of_the_mesh_underneath_reaches_its_calls() {
        let mut opts = crate::quic::QuicOptions::new(3);
        opts.timeout = Some(Duration::from_secs(60));
        let mut eps = crate::quic::local_mesh(3, &opts).unwrap().into_iter();
        let mut ep = Renumbered::new(eps.next().unwrap(), vec![0, 2]).unwrap();
        let stop = ep.interrupter().expect("the QUIC endpoint's interrupter");
        stop.lost(2);
        let started = std::time::Instant::now();
        let key = crate::test_meshes::key(1, 0, 0);
        let e = ep.recv(&key).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(30), "{e}");
        assert!(e.to_string().contains("process ended"), "{e}");
    }

    #[test]
    fn a_rank_twice_or_missing_is_refused() {
        let mut mesh = crate::inproc::mesh(3, &crate::inproc::InProcOptions::default()).into_iter();
        let ep = mesh.next().unwrap();
        assert!(Renumbered::new(ep, vec![0, 0]).is_err());
        let ep = mesh.next().unwrap();
        assert!(
            Renumbered::new(ep, vec![0, 2]).is_err(),
            "rank 1 is not listed"
        );
    }
}
