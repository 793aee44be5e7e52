//! Going on without a lost peer on the rings a mesh already has: what the survivors of a lost
//! worker process do over shared memory instead of binding, announcing and connecting a new
//! mesh, whose fresh segments every ring would then fault in page by page while the run
//! refills.
//!
//! **Generations.** Each survivor regroups once per loss, after its old endpoint has stopped
//! (aborted, or told of the abort): on every link to another survivor it sends a regroup
//! record on the link's socket, naming the link's next generation and the position where its
//! outgoing ring's producer stopped. It then reads its peer's record, skipping the old
//! generation's aborts, and moves its incoming ring's consumer to the position named there:
//! whatever the old generation left in the ring unread, a frame cut short included, is
//! dropped, so a regrouped mesh starts empty, as a new one would. Nothing is written on a
//! regrouped link before the peer's record has come, and the peer sent it once its old
//! endpoint had stopped, so no frame of the new generation is ever read as the old one's.
//! Both ends count a mesh's regroups alike; a record naming another generation, or a
//! position outside what the ring holds, is refused naming the link.
//!
//! **The lost rank.** Its link is dropped. Where a survivor (the host) runs the lost rank's
//! program, the host makes the lost rank's endpoint in its own process: a fresh segment for
//! each survivor, sent in the host's regroup record on the link the two already have, with the
//! hosted endpoint's `eventfd` and one end of a new socket pair for the link's control
//! records; the host's own link to the hosted rank is made the same way inside the process.
//! So no survivor binds, dials or admits anything, and only the lost rank's rings are new.
//! A hosted rank's program ends with the segment it was hosted for: a later regroup leaves its
//! links out.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::Instant;

use rustix::event::{EventfdFlags, PollFd, PollFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

use super::{
    Fields, Link, NO_ALARM, RECORD_ABORT, RECORD_CLOSE, RECORD_REGROUP, Reading, Ring, Shm,
    create_segment, map_segment, rings, same_user, setup, take_fds,
};
use crate::{Early, TransportError};

/// Bytes of a regroup record: its tag, the generation, the producer's position, and whether
/// the lost rank's link comes with it.
const REGROUP_BYTES: usize = 1 + 4 + 8 + 1;

/// Descriptors that come with the lost rank's link: its segment, the hosted endpoint's
/// `eventfd`, and the socket of the link's control records.
const HOSTED_FDS: usize = 3;

/// A peer's regroup record, read.
struct Regroup {
    generation: u32,
    /// Where the peer's producer stopped on the ring to this endpoint.
    head: u64,
    /// The lost rank's link (segment, `eventfd`, socket), where the peer hosts it.
    hosted: Option<[OwnedFd; HOSTED_FDS]>,
}

/// A ring's two ends for the worker `me` of the link between `me` and `peer`: (outgoing,
/// incoming). Ring 0 runs from the lower rank to the higher.
fn ends(map: &memmap2::MmapRaw, cap: u64, me: u32, peer: u32) -> (Ring, Ring) {
    let (up, down) = rings(map, cap);
    if me < peer { (up, down) } else { (down, up) }
}

/// A new, non-blocking socket pair for a link's control records.
fn socket_pair() -> Result<(UnixStream, UnixStream), TransportError> {
    let (a, b) = UnixStream::pair().map_err(|e| setup(format!("socket pair: {e}")))?;
    for s in [&a, &b] {
        s.set_nonblocking(true)
            .map_err(|e| setup(format!("socket pair: {e}")))?;
    }
    Ok((a, b))
}

fn dup(fd: &OwnedFd) -> Result<OwnedFd, TransportError> {
    rustix::io::dup(fd).map_err(|e| setup(format!("duplicating a descriptor: {e}")))
}

/// What the host makes for the lost rank: its endpoint's links and `eventfd`, and for each
/// survivor the descriptors its regroup record carries.
struct HostedParts {
    bell: OwnedFd,
    links: Vec<Option<Link>>,
    /// Per survivor rank: (segment, `eventfd`, the survivor's end of the socket pair).
    sent: Vec<Option<[OwnedFd; HOSTED_FDS]>>,
}

impl Shm {
    /// The address this endpoint listened at, which the launcher names again when the
    /// survivors of a lost peer go on without it on their rings ([`Shm::regrouped`]).
    ///
    /// # Errors
    /// [`TransportError::Setup`] from an endpoint that is closed or already regrouped.
    pub(super) fn ready_to_regroup(&self) -> Result<String, TransportError> {
        if self.closed {
            return Err(setup(format!(
                "worker {}'s endpoint is closed: it cannot regroup",
                self.rank
            )));
        }
        Ok(self.address.clone())
    }

    /// This endpoint's mesh going on without rank `lost` on the rings it already has (see
    /// the module documentation); where survivor `host` hosts the lost rank, with a link to
    /// that rank's endpoint in `host`'s process. On the host, also the lost rank's endpoint,
    /// for the program it hosts. This endpoint is spent: it holds nothing any more, and
    /// every later call fails or does nothing. Waits for every survivor's regroup record,
    /// up to the connect timeout.
    ///
    /// # Errors
    /// [`TransportError::Setup`]: a rank that is not a peer, a host that is the lost rank or
    /// no survivor, an endpoint already closed, a survivor lost too or silent past the
    /// connect timeout, a regroup record of another generation or naming a position the
    /// ring does not hold.
    pub fn regrouped(
        &mut self,
        lost: u32,
        host: Option<u32>,
    ) -> Result<(Shm, Option<Shm>), TransportError> {
        let rank = self.rank;
        if lost >= self.size || lost == rank {
            return Err(setup(format!(
                "worker {rank} cannot go on without rank {lost} in a mesh of {}",
                self.size
            )));
        }
        if let Some(host) = host {
            let survivor = host == rank
                || self
                    .links
                    .get(host as usize)
                    .is_some_and(|l| l.as_ref().is_some_and(|l| !l.hosted));
            if host == lost || !survivor {
                return Err(setup(format!(
                    "worker {rank}: rank {host} cannot host rank {lost}: it is no survivor"
                )));
            }
        }
        self.ready_to_regroup()?;
        let deadline = Instant::now() + self.opts.connect_timeout;
        let generation = self.generation.wrapping_add(1);
        let mut links = self.spend(lost);
        let hosting = host == Some(rank);
        let mut parts = if hosting {
            Some(self.hosted_parts(lost, &links)?)
        } else {
            None
        };
        for link in links.iter().flatten() {
            let fds = parts
                .as_ref()
                .and_then(|p| p.sent[link.peer as usize].as_ref());
            send_record(link, generation, fds, deadline)
                .map_err(|why| regroup_err(rank, link, why))?;
        }
        // The descriptors are the survivors' now (sent with the records).
        if let Some(p) = parts.as_mut() {
            p.sent.clear();
        }
        let mut hosted_link = None;
        for link in links.iter_mut().flatten() {
            let record = read_record(link, deadline).map_err(|why| regroup_err(rank, link, why))?;
            let carried = self
                .go_on(link, record, (generation, lost, host))
                .map_err(|why| regroup_err(rank, link, why))?;
            hosted_link = hosted_link.or(carried);
        }
        match (host, hosted_link) {
            (Some(h), Some(link)) if h != rank => links[lost as usize] = Some(link),
            (Some(h), None) if h != rank => {
                return Err(setup(format!(
                    "worker {rank}: rank {h} hosts rank {lost} but sent no link to it"
                )));
            }
            _ => {}
        }
        let own_bell = dup(&self.bell)?;
        let hosted = match parts {
            Some(p) => {
                let (own_side, hosted_side) = self.beside(lost, &p.bell)?;
                links[lost as usize] = Some(own_side);
                let mut hosted_links = p.links;
                hosted_links[rank as usize] = Some(hosted_side);
                Some(self.regrouped_mesh(lost, hosted_links, p.bell, generation))
            }
            None => None,
        };
        self.raised.store(NO_ALARM, Ordering::SeqCst);
        let own = self.regrouped_mesh(rank, links, own_bell, generation);
        Ok((own, hosted))
    }

    /// Takes this endpoint's links to the survivors out of it (the lost rank's, those of a
    /// rank hosted since an earlier loss and those of peers that closed are dropped), and
    /// leaves it a husk whose calls fail and whose drop does nothing.
    fn spend(&mut self, lost: u32) -> Vec<Option<Link>> {
        self.closed = true;
        self.early = Early::default();
        let mut links = std::mem::take(&mut self.links);
        for slot in &mut links {
            let gone = slot
                .as_ref()
                .is_some_and(|l| l.peer == lost || l.hosted || l.state == super::PeerState::Closed);
            if gone {
                *slot = None;
            }
        }
        links
    }

    /// The lost rank's endpoint's links to every survivor but this one, on fresh segments,
    /// and the descriptors each survivor's regroup record carries.
    fn hosted_parts(
        &self,
        lost: u32,
        links: &[Option<Link>],
    ) -> Result<HostedParts, TransportError> {
        let bell = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(|e| setup(format!("eventfd: {e}")))?;
        let cap = self.opts.ring_bytes;
        let mut hosted: Vec<Option<Link>> = (0..self.size).map(|_| None).collect();
        let mut sent: Vec<Option<[OwnedFd; HOSTED_FDS]>> = (0..self.size).map(|_| None).collect();
        for survivor in links.iter().flatten() {
            let peer = survivor.peer;
            let (low, high) = (peer.min(lost), peer.max(lost));
            let (memfd, map) = create_segment(self.opts.run_id, low, high, cap).map_err(setup)?;
            let (here, there) = socket_pair()?;
            let (out, inp) = ends(&map, cap, lost, peer);
            let mut link = Link::new(peer, here, map, out, inp, dup(&survivor.bell)?);
            link.hosted = true;
            hosted[peer as usize] = Some(link);
            sent[peer as usize] = Some([memfd, dup(&bell)?, OwnedFd::from(there)]);
        }
        Ok(HostedParts {
            bell,
            links: hosted,
            sent,
        })
    }

    /// The link between this endpoint and the lost rank's, both in this process: (this
    /// endpoint's side, the hosted endpoint's side).
    fn beside(&self, lost: u32, hosted_bell: &OwnedFd) -> Result<(Link, Link), TransportError> {
        let (rank, cap, run) = (self.rank, self.opts.ring_bytes, self.opts.run_id);
        let (low, high) = (rank.min(lost), rank.max(lost));
        let (memfd, map) = create_segment(run, low, high, cap).map_err(setup)?;
        let again = map_segment(&memfd, run, low, high, cap).map_err(setup)?;
        let (mine, theirs) = socket_pair()?;
        let (out, inp) = ends(&map, cap, rank, lost);
        let mut own_side = Link::new(lost, mine, map, out, inp, dup(hosted_bell)?);
        let (out, inp) = ends(&again, cap, lost, rank);
        let mut hosted_side = Link::new(rank, theirs, again, out, inp, dup(&self.bell)?);
        own_side.hosted = true;
        hosted_side.hosted = true;
        Ok((own_side, hosted_side))
    }

    /// `link` in the new generation once its peer's `record` has come: its incoming ring's
    /// consumer where the peer's producer stopped, its reader and flags as a new link's.
    /// Returns the link to the lost rank that the record carried, where the peer hosts it.
    fn go_on(
        &self,
        link: &mut Link,
        record: Regroup,
        (generation, lost, host): (u32, u32, Option<u32>),
    ) -> Result<Option<Link>, String> {
        if record.generation != generation {
            return Err(format!(
                "its regroup names generation {} where {generation} is due",
                record.generation
            ));
        }
        let (head, tail) = link.inp.positions()?;
        if record.head < tail || record.head > head {
            return Err(format!(
                "its regroup names ring position {} where the ring holds {tail} to {head}",
                record.head
            ));
        }
        link.inp.tail().store(record.head, Ordering::SeqCst);
        link.inp.reader_parked().store(0, Ordering::SeqCst);
        link.out.writer_parked().store(0, Ordering::SeqCst);
        link.reading = Reading::default();
        link.held = 0;
        link.aborted = false;
        link.control_ready = !link.control.is_empty();
        // A producer of the new generation parked on a full ring is woken to the space freed.
        link.ring_bell();
        let Some([memfd, bell, socket]) = record.hosted else {
            return Ok(None);
        };
        if host != Some(link.peer) || host == Some(self.rank) {
            return Err(format!(
                "it sent rank {lost}'s link, which it does not host"
            ));
        }
        let (me, cap) = (self.rank, self.opts.ring_bytes);
        let map = map_segment(&memfd, self.opts.run_id, me.min(lost), me.max(lost), cap)?;
        let socket = UnixStream::from(socket);
        same_user(&socket)?;
        socket
            .set_nonblocking(true)
            .map_err(|e| format!("socket of rank {lost}: {e}"))?;
        let (out, inp) = ends(&map, cap, me, lost);
        let mut hosted = Link::new(lost, socket, map, out, inp, bell);
        hosted.hosted = true;
        Ok(Some(hosted))
    }

    /// The endpoint of rank `rank` over `links` in `generation`, with this endpoint's
    /// settings.
    fn regrouped_mesh(
        &self,
        rank: u32,
        links: Vec<Option<Link>>,
        bell: OwnedFd,
        generation: u32,
    ) -> Shm {
        let raised = if rank == self.rank {
            self.raised.clone()
        } else {
            std::sync::Arc::new(std::sync::atomic::AtomicU64::new(NO_ALARM))
        };
        Shm {
            rank,
            size: self.size,
            links,
            bell,
            raised,
            early: Early::default(),
            aborted_by: None,
            closed: false,
            checked: Instant::now(),
            bounce: vec![0.0; super::BOUNCE_VALUES],
            opts: self.opts.clone(),
            limits: self.limits,
            address: self.address.clone(),
            generation,
        }
    }
}

fn regroup_err(rank: u32, link: &Link, why: String) -> TransportError {
    setup(format!(
        "worker {rank} going on with worker {} over shared memory: {why}",
        link.peer
    ))
}

/// Sends `link`'s regroup record in `generation`, with the lost rank's link (`hosted`) where
/// this worker hosts it.
fn send_record(
    link: &Link,
    generation: u32,
    hosted: Option<&[OwnedFd; HOSTED_FDS]>,
    deadline: Instant,
) -> Result<(), String> {
    let (head, _) = link.out.positions()?;
    let mut record = Vec::with_capacity(REGROUP_BYTES);
    record.push(RECORD_REGROUP);
    record.extend_from_slice(&generation.to_le_bytes());
    record.extend_from_slice(&head.to_le_bytes());
    record.push(u8::from(hosted.is_some()));
    let fds: Vec<_> = hosted
        .iter()
        .flat_map(|fds| fds.iter().map(AsFd::as_fd))
        .collect();
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(HOSTED_FDS))];
    loop {
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err("descriptors do not fit the control buffer".into());
        }
        let iov = [IoSlice::new(&record)];
        match rustix::net::sendmsg(&link.socket, &iov, &mut control, SendFlags::NOSIGNAL) {
            Ok(n) if n == record.len() => return Ok(()),
            Ok(_) => return Err("its regroup record was cut short".into()),
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) if Instant::now() < deadline => {
                // A socket full of the old generation's records frees as the peer reads them.
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Err(e) => return Err(format!("sending its regroup record: {e}")),
        }
    }
}

/// Reads `link`'s socket until the peer's regroup record, skipping the old generation's
/// aborts; what comes after it stays for the new generation's reader.
fn read_record(link: &mut Link, deadline: Instant) -> Result<Regroup, String> {
    let mut fds: Vec<OwnedFd> = Vec::new();
    loop {
        while let Some(&first) = link.control.first() {
            match first {
                RECORD_ABORT if link.control.len() >= 5 => {
                    link.control.drain(..5);
                }
                RECORD_REGROUP if link.control.len() >= REGROUP_BYTES => {
                    let mut r = Fields::new(&link.control[1..REGROUP_BYTES]);
                    let (generation, head, carries) = (r.u32()?, r.u64()?, r.u8()?);
                    link.control.drain(..REGROUP_BYTES);
                    let hosted = match (carries, fds.len()) {
                        (0, 0) => None,
                        (1, HOSTED_FDS) => {
                            let mut it = fds.drain(..);
                            it.next()
                                .zip(it.next())
                                .zip(it.next())
                                .map(|((a, b), c)| [a, b, c])
                        }
                        (c, n) => {
                            return Err(format!(
                                "its regroup record (hosting {c}) carried {n} descriptors"
                            ));
                        }
                    };
                    return Ok(Regroup {
                        generation,
                        head,
                        hosted,
                    });
                }
                RECORD_ABORT | RECORD_REGROUP => break,
                RECORD_CLOSE => return Err("it closed its link: it does not go on".into()),
                other => return Err(format!("it sent control record {other:#04x}")),
            }
        }
        if link.eof {
            return Err("its socket closed before it regrouped".into());
        }
        wait_readable(&link.socket, deadline)?;
        receive(link, &mut fds)?;
    }
}

/// Waits until `socket` has something to read, up to `deadline`.
fn wait_readable(socket: &UnixStream, deadline: Instant) -> Result<(), String> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err("it sent no regroup record within the connect timeout".into());
        }
        let timeout = rustix::event::Timespec {
            tv_sec: left.as_secs() as i64,
            tv_nsec: i64::from(left.subsec_nanos()),
        };
        let mut fds = [PollFd::new(socket, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&timeout)) {
            Ok(n) if n > 0 => return Ok(()),
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(format!("waiting on its socket: {e}")),
        }
    }
}

/// Reads what `link`'s socket has into its control bytes, and the descriptors that came with
/// it into `fds` (at most [`HOSTED_FDS`] in all).
fn receive(link: &mut Link, fds: &mut Vec<OwnedFd>) -> Result<(), String> {
    let mut buf = [0u8; 256];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(HOSTED_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        match rustix::net::recvmsg(
            &link.socket,
            &mut iov,
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(got) => got,
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => return Ok(()),
            Err(e) => return Err(format!("reading its socket: {e}")),
        }
    };
    take_fds(&mut control, got.flags, fds, HOSTED_FDS)
        .map_err(|most| format!("its records carried more than {most} descriptors"))?;
    if got.bytes == 0 {
        link.eof = true;
    }
    link.control.extend_from_slice(&buf[..got.bytes]);
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::io::Write;
    use std::time::Duration;

    use super::super::{ShmOptions, local_mesh};
    use super::*;
    use crate::test_meshes::{key, regroup_all};
    use crate::{Message, Transport};

    /// A message of `len` values from `from` to `to`, its values telling where it came from.
    fn message(from: u32, to: u32, index: u32, len: usize) -> Message {
        let values = (0..len)
            .map(|i| (from * 1000 + index) as f32 + i as f32)
            .collect();
        Message {
            key: key(from, to, index),
            version: 0,
            tensor: pipe_kernels::Tensor::from_vec(&[len], values).unwrap(),
        }
    }

    fn options(run: u64, ring_bytes: u64) -> ShmOptions {
        let mut opts = ShmOptions::new(run);
        opts.ring_bytes = ring_bytes;
        opts.connect_timeout = Duration::from_secs(5);
        opts
    }

    fn boxed(mesh: Vec<Shm>) -> Vec<Box<dyn Transport>> {
        mesh.into_iter()
            .map(|q| Box::new(q) as Box<dyn Transport>)
            .collect()
    }

    /// The endpoint of rank `rank` in `eps` lost: dropped without a word, as a killed process
    /// ends; every other endpoint then stops, as a survivor's recovery does.
    fn lose(eps: &mut Vec<Box<dyn Transport>>, rank: u32) {
        let at = eps.iter().position(|e| e.rank() == rank).unwrap();
        let mut gone = eps.remove(at);
        // Its sockets close with it; an aborted endpoint's drop says nothing more.
        gone.abort();
        drop(gone);
        for ep in eps.iter_mut() {
            ep.abort();
        }
    }

    /// Every endpoint sends message `index` of `len` values to every other, each on a
    /// thread of its own (a ring smaller than a message needs its reader going), and checks
    /// what it receives.
    fn exchange(eps: Vec<Box<dyn Transport>>, index: u32, len: usize) -> Vec<Box<dyn Transport>> {
        let ranks: Vec<u32> = eps.iter().map(|e| e.rank()).collect();
        let threads: Vec<_> = eps
            .into_iter()
            .map(|mut ep| {
                let ranks = ranks.clone();
                std::thread::spawn(move || {
                    let me = ep.rank();
                    for &to in ranks.iter().filter(|&&t| t != me) {
                        ep.send(message(me, to, index, len)).unwrap();
                    }
                    for &from in ranks.iter().filter(|&&f| f != me) {
                        let got = ep.recv(&key(from, me, index)).unwrap();
                        let want = message(from, me, index, len).tensor;
                        assert_eq!(
                            got.tensor.into_host_vec().unwrap(),
                            want.into_host_vec().unwrap()
                        );
                    }
                    ep
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    /// Survivors go on over their rings without the lost rank, hosted by one of them: what
    /// was in flight before the loss (a frame cut short included) is never delivered, frames
    /// after it wrap the same rings, and a second loss regroups again, leaving out the rank
    /// hosted for the first.
    #[test]
    fn survivors_go_on_over_their_rings_with_the_lost_rank_hosted() {
        let mut eps = boxed(local_mesh(4, &options(0x5e1, 4096)).unwrap());
        eps = exchange(eps, 1, 300);
        // In flight at the loss: a whole message from 0 to 1, and one from 2 to 1 too large
        // for the ring, cut short.
        eps[0].send(message(0, 1, 7, 100)).unwrap();
        let mut cut = message(2, 1, 8, 3000);
        cut.key = key(2, 1, 8);
        let two = eps.remove(2);
        let writer = std::thread::spawn(move || {
            let mut two = two;
            let r = two.send(cut);
            (two, r)
        });
        std::thread::sleep(Duration::from_millis(50));
        lose(&mut eps, 3);
        let (two, sent) = writer.join().unwrap();
        assert!(sent.is_err(), "the cut send was stopped by the aborts");
        eps.insert(2, two);
        let mut eps = regroup_all(eps, 3, Some(1));
        assert_eq!(
            eps.iter().map(|e| e.rank()).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        assert!(eps[1].try_recv(&key(0, 1, 7)).unwrap().is_none());
        assert!(eps[1].try_recv(&key(2, 1, 8)).unwrap().is_none());
        // Frames of 1200 bytes round rings of 4096 several times.
        for index in 10..14 {
            eps = exchange(eps, index, 300);
        }
        // The second loss: rank 2, hosted by 0; rank 3, hosted for the first, is left out.
        let hosted3 = eps.remove(3);
        drop(hosted3);
        lose(&mut eps, 2);
        let mut eps = regroup_all(eps, 2, Some(0));
        assert_eq!(eps.iter().map(|e| e.rank()).collect::<Vec<_>>(), [0, 1, 2]);
        for index in 20..24 {
            eps = exchange(eps, index, 500);
        }
        for mut ep in eps {
            ep.close().unwrap();
        }
    }

    /// What a regroup is handed is checked before anything is spent, and a spent endpoint
    /// regroups no more.
    #[test]
    fn a_regroup_refuses_what_it_cannot_go_on_without() {
        let mut eps = boxed(local_mesh(3, &options(0x5e2, 4096)).unwrap());
        let err = |r: Result<crate::Regrouped, TransportError>| r.err().unwrap().to_string();
        assert!(err(eps[1].regroup(1, None)).contains("cannot go on without rank 1"));
        assert!(err(eps[1].regroup(3, None)).contains("cannot go on without rank 3"));
        assert!(err(eps[1].regroup(0, Some(0))).contains("cannot host rank 0"));
        assert!(err(eps[1].regroup(0, Some(7))).contains("cannot host rank 0"));
        lose(&mut eps, 0);
        let mut two = eps.pop().unwrap();
        let mut one = eps.pop().unwrap();
        let other = std::thread::spawn(move || one.regroup(0, None).unwrap().0);
        let regrouped = two.regroup(0, None).unwrap().0;
        assert!(err(two.regroup(0, None)).contains("closed"));
        exchange(vec![other.join().unwrap(), regrouped], 3, 10);
    }

    /// A regroup record naming another generation, or a ring position the ring does not
    /// hold, is refused naming the link, at once rather than at the connect timeout.
    #[test]
    fn a_hostile_regroup_record_is_refused_naming_the_link() {
        for (generation, head, why) in [
            (5u32, 0u64, "generation 5 where 1 is due"),
            (1, 1 << 40, "ring position 1099511627776"),
        ] {
            let mut mesh = local_mesh(3, &options(0x5e3, 4096)).unwrap();
            let mut record = vec![RECORD_REGROUP];
            record.extend_from_slice(&generation.to_le_bytes());
            record.extend_from_slice(&head.to_le_bytes());
            record.push(0);
            // Rank 1 writes the record by hand on its link to rank 0, and stays silent.
            let link = mesh[1].links[0].as_ref().unwrap();
            (&link.socket).write_all(&record).unwrap();
            let mut zero = mesh.remove(0);
            zero.abort();
            let started = Instant::now();
            let e = zero.regrouped(2, None).err().unwrap().to_string();
            assert!(e.contains(why) && e.contains("with worker 1"), "{e}");
            assert!(started.elapsed() < Duration::from_secs(2));
        }
    }

    /// Three descriptors of `/dev/null`: what a peer could send in place of a segment's.
    fn not_a_segment() -> [OwnedFd; HOSTED_FDS] {
        let open = || OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        [open(), open(), open()]
    }

    /// Sends `bytes` on `link`'s socket with `fds` (at most four) beside them.
    fn send_with(link: &Link, bytes: &[u8], fds: &[OwnedFd]) {
        let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        assert!(control.push(SendAncillaryMessage::ScmRights(&borrowed)));
        let iov = [IoSlice::new(bytes)];
        rustix::net::sendmsg(&link.socket, &iov, &mut control, SendFlags::NOSIGNAL).unwrap();
    }

    /// A regroup record of `generation` whose producer stopped at 0, saying whether it
    /// `carries` the lost rank's link.
    fn record(generation: u32, carries: u8) -> Vec<u8> {
        let mut r = vec![RECORD_REGROUP];
        r.extend_from_slice(&generation.to_le_bytes());
        r.extend_from_slice(&0u64.to_le_bytes());
        r.push(carries);
        r
    }

    /// Rank 0 of a fresh mesh of `size` regroups without rank `lost` (hosted by `host`) after
    /// rank 1 did `hostile` on its link to rank 0 and went silent: the error and how long it
    /// took.
    fn refused(
        size: u32,
        (lost, host): (u32, Option<u32>),
        timeout: Duration,
        hostile: impl FnOnce(&Link),
    ) -> (String, Duration) {
        let mut opts = options(0x5e4, 4096);
        opts.connect_timeout = timeout;
        let mut mesh = local_mesh(size, &opts).unwrap();
        hostile(mesh[1].links[0].as_ref().unwrap());
        let mut zero = mesh.remove(0);
        zero.abort();
        let started = Instant::now();
        let e = zero.regrouped(lost, host).err().unwrap().to_string();
        (e, started.elapsed())
    }

    /// What a peer can send in place of its regroup record, or fail to send, is refused
    /// naming the link: descriptors where the record carries none or from a rank that hosts
    /// nothing, a host's descriptors that are no segment, a record saying it carries a link
    /// with none sent, more descriptors than a link takes, a close, an ended socket, a record
    /// of no kind, and silence past the connect timeout.
    #[test]
    fn every_hostile_regroup_is_refused_naming_the_link() {
        let soon = Duration::from_secs(5);
        let raw = |bytes: Vec<u8>| move |link: &Link| (&link.socket).write_all(&bytes).unwrap();
        let with_fds = |carries: bool| {
            move |link: &Link| {
                let fds = not_a_segment();
                let deadline = Instant::now() + Duration::from_secs(1);
                if carries {
                    send_record(link, 1, Some(&fds), deadline).unwrap();
                } else {
                    // The descriptors ride on the record of a rank that says it carries none.
                    send_with(link, &record(1, 0), &fds);
                }
            }
        };
        /// What the error says, the mesh's size, the lost rank and its host, what rank 1 does.
        type Case<'a> = (&'a str, u32, (u32, Option<u32>), Box<dyn FnOnce(&Link)>);
        let cases: Vec<Case> = vec![
            (
                "hosting 0) carried 3 descriptors",
                3,
                (2, None),
                Box::new(with_fds(false)),
            ),
            (
                "which it does not host",
                4,
                (3, Some(2)),
                Box::new(with_fds(true)),
            ),
            (
                "hosting 1) carried 0 descriptors",
                3,
                (2, Some(1)),
                Box::new(raw(record(1, 1))),
            ),
            (
                "closed its link",
                3,
                (2, None),
                Box::new(raw(vec![RECORD_CLOSE])),
            ),
            (
                "control record 0x7f",
                3,
                (2, None),
                Box::new(raw(vec![0x7f; 20])),
            ),
            (
                "socket closed before it regrouped",
                3,
                (2, None),
                Box::new(|link: &Link| link.socket.shutdown(std::net::Shutdown::Write).unwrap()),
            ),
            (
                "more than 3 descriptors",
                3,
                (2, Some(1)),
                Box::new(|link: &Link| {
                    let (a, b) = (not_a_segment(), not_a_segment());
                    let [x, y, z] = a;
                    let [w, ..] = b;
                    send_with(link, &record(1, 1), &[x, y, z, w]);
                }),
            ),
        ];
        for (why, size, lost, hostile) in cases {
            let (e, took) = refused(size, lost, soon, hostile);
            assert!(e.contains(why) && e.contains("with worker 1"), "{why}: {e}");
            assert!(took < Duration::from_secs(2), "{why}: {took:?}");
        }
        // The lost rank's link from its host, on descriptors that are no segment.
        let (e, took) = refused(3, (2, Some(1)), soon, with_fds(true));
        assert!(e.contains("with worker 1"), "{e}");
        assert!(took < Duration::from_secs(2), "{took:?}");
        // A silent peer: refused at the connect timeout, not waited on for good.
        let timeout = Duration::from_millis(300);
        let (e, took) = refused(3, (2, None), timeout, |_| {});
        assert!(
            e.contains("no regroup record within the connect timeout"),
            "{e}"
        );
        assert!(took >= timeout && took < Duration::from_secs(2), "{took:?}");
    }
}
