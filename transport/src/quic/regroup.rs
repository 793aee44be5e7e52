//! Going on without a lost peer on the connections a mesh already has: what the survivors of
//! a lost worker process do instead of binding, announcing and connecting a new mesh, whose
//! handshakes (TLS on every pair of workers) are most of a QUIC recovery's time.
//!
//! **Generations.** Each survivor regroups once per loss: on every connection to another
//! survivor it finishes its streams of the mesh so far and opens a new control stream (tagged
//! [`TAG_REGROUP`] and the connection's new generation) and new data streams; the peer's new
//! streams are read by new readers into a new event queue. Whatever was in flight on the old
//! streams goes to the old queue, which the regroup drops: a regrouped mesh starts empty, as
//! a new one would, and a stale message, abort or end can never reach it. Both ends of a
//! connection count its regroups alike, and a control stream that names another generation
//! is a protocol error.
//!
//! **The lost rank.** Its old connection is closed. Where a survivor (the adopter) hosts the
//! lost rank's program, it does so on the connections it already has
//! ([`Quic::regrouped`]): every other survivor's connection to the adopter carries,
//! after its own next generation, one generation more, the lost rank's, whose streams the
//! adopter's process reads into the hosted rank's endpoint and writes from it. Both ends
//! count that generation as the connection's, so a later regroup opens the one after it; a
//! peer on another's connection ([`Peer::shares_conn`]) ends by finishing its control stream,
//! never by closing the connection, and a later regroup drops it. The adopter and the rank it
//! hosts, one process, have no connection between them: each puts its messages straight into
//! the other's event queue ([`super::Beside`]), rounded as the wire rounds them, so a
//! replicated stage's all-reduce between them is neither encrypted nor sent through a socket.
//! So no handshake stands between a loss and the run going on.

use std::net::SocketAddr;
use std::sync::Arc;

use crossbeam_channel::unbounded;

use super::{
    Alarm, Beside, CLOSE_FAILED, CLOSE_REFUSED, Events, Peer, Quic, TAG_REGROUP, open_data_streams,
    read_control, read_data_streams, reading_of, setup_err, watch_connection,
};
use crate::host::HostId;
use crate::{Early, TransportError};

/// What a regroup takes from the endpoint it spends: the parts of its mesh that go on.
struct Spent {
    rank: u32,
    runtime: tokio::runtime::Runtime,
    peers: Vec<Option<Peer>>,
    hosts: Vec<Option<HostId>>,
    sink: Events,
    events: crossbeam_channel::Receiver<super::Event>,
}

impl Quic {
    /// The address this endpoint listens at, which the launcher names again when the
    /// survivors of a lost peer go on without it ([`Quic::regrouped`]): their connections
    /// stay, so their addresses do not change.
    ///
    /// # Errors
    /// [`TransportError::Setup`] from an endpoint that is closed or has no address.
    pub fn ready_to_regroup(&mut self) -> Result<SocketAddr, TransportError> {
        if self.closed || self.runtime.is_none() {
            return Err(TransportError::Setup(format!(
                "worker {}'s endpoint is closed: it cannot regroup",
                self.rank
            )));
        }
        self.endpoint
            .local_addr()
            .map_err(|e| setup_err("local address", e))
    }

    /// Checks that this endpoint can go on without `lost`, and spends it: it becomes a husk
    /// whose drop and close do nothing (dropping its event queue stops the old streams'
    /// readers), its peers and runtime handed to the regroup, the lost rank's connection
    /// closed.
    fn spend(&mut self, lost: u32) -> Result<Spent, TransportError> {
        let rank = self.rank;
        if lost >= self.size || lost == rank {
            return Err(TransportError::Setup(format!(
                "worker {rank} cannot go on without rank {lost} in a mesh of {}",
                self.size
            )));
        }
        let runtime = self.runtime.take().ok_or_else(|| {
            TransportError::Setup(format!(
                "worker {rank}'s endpoint is closed: it cannot regroup"
            ))
        })?;
        self.closed = true;
        self.events = unbounded().1;
        let (tx, events) = unbounded();
        let sink = Events {
            tx,
            alarm: self.alarm.clone(),
        };
        let mut peers = std::mem::take(&mut self.peers);
        let mut hosts = std::mem::take(&mut self.hosts);
        if let Some(old) = peers.get_mut(lost as usize).and_then(Option::take) {
            if !old.shares_conn {
                old.conn.close(CLOSE_FAILED.into(), b"lost");
            }
        }
        if let Some(h) = hosts.get_mut(lost as usize) {
            *h = None;
        }
        // A rank hosted since an earlier loss does not regroup with this mesh (its program
        // ended with the segment it was hosted for): its streams on another's connection end
        // here, that connection going on as the other's, and its host closes its link to it.
        for slot in &mut peers {
            if slot.as_ref().is_some_and(|p| p.shares_conn) {
                *slot = None;
            }
        }
        self.part_from_beside();
        Ok(Spent {
            rank,
            runtime,
            peers,
            hosts,
            sink,
            events,
        })
    }

    /// The mesh a regroup made of `spent`, on this endpoint's socket.
    fn regrouped_mesh(&self, spent: Spent) -> Quic {
        self.mesh_on(spent, self.endpoint.clone())
    }

    /// A mesh of `spent`'s peers on `endpoint`, with this endpoint's settings.
    fn mesh_on(&self, spent: Spent, endpoint: quinn::Endpoint) -> Quic {
        Quic {
            rank: spent.rank,
            size: self.size,
            runtime: Some(spent.runtime),
            endpoint,
            peers: spent.peers,
            interrupt: spent.sink.tx.clone(),
            events: spent.events,
            early: Early::default(),
            ended: Default::default(),
            finished_by: Default::default(),
            lost: Default::default(),
            failed: None,
            aborted_by: None,
            told_abort: false,
            opts: self.opts.clone(),
            closed: false,
            cuts: self.cuts.clone(),
            host: self.host,
            hosts: spent.hosts,
            alarm: spent.sink.alarm.clone(),
            beside: None,
        }
    }

    /// This endpoint's mesh going on without rank `lost` on the connections it has with the
    /// others (see the module documentation); where survivor `host` hosts the lost rank, with
    /// that rank carried on `host`'s connections: no new endpoint meets the others, so no
    /// handshake stands between a loss and the run going on. Each survivor's connection to
    /// the host carries, after its own next generation of streams, one more for the lost rank
    /// ([`alias`]); the host and the lost rank, one process, reach each other through memory
    /// ([`Beside`]). On the host, also the lost rank's endpoint, for the program it hosts.
    /// This endpoint is spent: it holds nothing any more, and every later call fails or does
    /// nothing.
    ///
    /// # Errors
    /// [`TransportError::Setup`]: a rank that is not a peer, a host that is the lost rank or
    /// no survivor, an endpoint already closed, a connection that fails while its streams
    /// open.
    pub fn regrouped(
        &mut self,
        lost: u32,
        host: Option<u32>,
    ) -> Result<(Quic, Option<Quic>), TransportError> {
        if let Some(host) = host {
            let survivor =
                host == self.rank || self.peers.get(host as usize).is_some_and(Option::is_some);
            if host == lost || !survivor {
                return Err(TransportError::Setup(format!(
                    "worker {}: rank {host} cannot host rank {lost}: it is no survivor",
                    self.rank
                )));
            }
            if host == self.rank {
                return self
                    .hosting(lost)
                    .map(|(mesh, hosted)| (mesh, Some(hosted)));
            }
        }
        let mut spent = self.spend(lost)?;
        let (rank, opts) = (spent.rank, &self.opts);
        let (peers, sink) = (&mut spent.peers, &spent.sink);
        let aliased = spent.runtime.block_on(async {
            // Every connection renewed at once: each waits on its peer, and one after another
            // they added up.
            for (peer, joined) in renew_all(rank, peers, opts, sink).await? {
                peers[peer] = Some(joined);
            }
            let Some(host) = host else {
                return Ok(None);
            };
            let via = peers[host as usize].as_mut().ok_or_else(|| {
                TransportError::Setup(format!("rank {rank} has no connection to rank {host}"))
            })?;
            alias(rank, lost, via, opts, sink).await.map(Some)
        })?;
        if let (Some(host), Some(aliased)) = (host, aliased) {
            spent.hosts[lost as usize] = spent.hosts[host as usize];
            spent.peers[lost as usize] = Some(aliased);
        }
        Ok((self.regrouped_mesh(spent), None))
    }

    /// [`Quic::regrouped`] on the host: its own mesh, and the lost rank's endpoint, whose
    /// other peers are on this endpoint's connections and which reaches this one through
    /// memory ([`Beside`]): the two share a process, so their messages (a replicated
    /// stage's all-reduce among them) are neither encrypted nor sent through a socket.
    fn hosting(&mut self, lost: u32) -> Result<(Quic, Quic), TransportError> {
        let at = self
            .endpoint
            .local_addr()
            .map_err(|e| setup_err("local address", e))?;
        let hosted_runtime = super::endpoint_runtime(&format!("pipe-quic-{lost}"))?;
        // The hosted endpoint dials no one: its socket only closes with it.
        let socket = {
            let _guard = hosted_runtime.enter();
            super::endpoint_on(SocketAddr::new(at.ip(), 0), None, &self.cuts)?
        };
        let mut spent = self.spend(lost)?;
        let (rank, opts) = (spent.rank, &self.opts);
        let (peers, sink) = (&mut spent.peers, &spent.sink);
        for (peer, joined) in spent.runtime.block_on(renew_all(rank, peers, opts, sink))? {
            peers[peer] = Some(joined);
        }
        spent.hosts[lost as usize] = Some(self.host);
        // The lost rank's side: one more generation of streams on each of this endpoint's
        // connections to the others.
        let (tx, hosted_events) = unbounded();
        let hosted_sink = Events {
            tx,
            alarm: Alarm::default(),
        };
        let mut hosted_peers: Vec<Option<Peer>> = (0..self.size).map(|_| None).collect();
        let mut hosted_hosts = vec![None; self.size as usize];
        hosted_hosts[rank as usize] = Some(self.host);
        let (peers, hosts) = (&mut spent.peers, &spent.hosts);
        hosted_runtime.block_on(async {
            for (other, slot) in peers.iter_mut().enumerate() {
                let Some(via) = slot.as_mut() else {
                    continue;
                };
                hosted_peers[other] =
                    Some(alias(lost, other as u32, via, opts, &hosted_sink).await?);
                hosted_hosts[other] = hosts[other];
            }
            Ok::<_, TransportError>(())
        })?;
        let own_events = spent.sink.clone();
        let hosted = Spent {
            rank: lost,
            runtime: hosted_runtime,
            peers: hosted_peers,
            hosts: hosted_hosts,
            sink: hosted_sink.clone(),
            events: hosted_events,
        };
        let mut hosted = self.mesh_on(hosted, socket);
        hosted.beside = Some(Beside {
            rank,
            events: own_events,
        });
        let mut own = self.regrouped_mesh(spent);
        own.beside = Some(Beside {
            rank: lost,
            events: hosted_sink,
        });
        Ok((own, hosted))
    }
}

/// Every connection of `peers` in its next generation ([`renew`]), renewed at once: each
/// waits on its peer. Returns them by rank, the slots left empty.
async fn renew_all(
    rank: u32,
    peers: &mut [Option<Peer>],
    opts: &super::QuicOptions,
    sink: &Events,
) -> Result<Vec<(usize, Peer)>, TransportError> {
    let mut set = tokio::task::JoinSet::new();
    for (peer, slot) in peers.iter_mut().enumerate() {
        if let Some(old) = slot.take() {
            let (opts, sink) = (opts.clone(), sink.clone());
            set.spawn(async move { (peer, renew(rank, peer as u32, old, &opts, &sink).await) });
        }
    }
    let mut renewed = Vec::new();
    while let Some(done) = set.join_next().await {
        let (peer, joined) = done.map_err(|e| setup_err("renewing a connection", e))?;
        renewed.push((peer, joined?));
    }
    Ok(renewed)
}

/// `old`, the connection to `peer`, in its next generation: this side's streams of the last
/// one finished, new ones opened, and the peer's new streams read into `sink` once it opens
/// them.
async fn renew(
    rank: u32,
    peer: u32,
    old: Peer,
    opts: &super::QuicOptions,
    sink: &Events,
) -> Result<Peer, TransportError> {
    let Peer {
        conn,
        control: last_control,
        data,
        generation,
        accepted: last_accepted,
        ..
    } = old;
    // The old writers finish their streams once their queues are sent.
    drop(data);
    let _ = last_control.lock().await.finish();
    let generation = generation.wrapping_add(1);
    generation_on(
        rank,
        (peer, conn),
        (generation, last_accepted),
        opts,
        (sink, false),
    )
    .await
}

/// Peer `peer` of rank `rank` on `via`'s connection: one more generation of streams on it,
/// after `via`'s own, for a rank one end hosts ([`Quic::regrouped`]). `via` counts it
/// as its own, so that a later regroup of `via` opens the generation after it.
async fn alias(
    rank: u32,
    peer: u32,
    via: &mut Peer,
    opts: &super::QuicOptions,
    sink: &Events,
) -> Result<Peer, TransportError> {
    let generation = via.generation.wrapping_add(1);
    let after = via.accepted.clone();
    let aliased = generation_on(
        rank,
        (peer, via.conn.clone()),
        (generation, after),
        opts,
        (sink, true),
    )
    .await?;
    via.generation = generation;
    via.accepted = aliased.accepted.clone();
    Ok(aliased)
}

/// Generation `generation` of `peer`'s streams on `conn`: this side's control stream (tagged
/// [`TAG_REGROUP`] and the generation) and data streams opened, and the peer's read into
/// `sink` once its streams before them (`after`) are accepted. `shared`: the connection is
/// another rank's too ([`Peer::shares_conn`]).
async fn generation_on(
    rank: u32,
    (peer, conn): (u32, quinn::Connection),
    (generation, after): (u32, tokio::sync::watch::Receiver<bool>),
    opts: &super::QuicOptions,
    (sink, shared): (&Events, bool),
) -> Result<Peer, TransportError> {
    let failed = |e: &dyn std::fmt::Display| setup_err(&format!("stream to rank {peer}"), e);
    let mut control = conn.open_uni().await.map_err(|e| failed(&e))?;
    let mut tag = vec![TAG_REGROUP];
    tag.extend_from_slice(&generation.to_le_bytes());
    control.write_all(&tag).await.map_err(|e| failed(&e))?;
    let (data, writers) = open_data_streams(&conn, peer, opts).await?;
    let control = Arc::new(tokio::sync::Mutex::new(control));
    let held = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (accepted_tx, accepted) = tokio::sync::watch::channel(false);
    let reading = reading_of(opts, &held);
    let (events, read_on) = (sink.clone(), conn.clone());
    let ours = control.clone();
    tokio::spawn(async move {
        // The peer's streams of the generation before come first.
        let mut before = after;
        let _ = before.wait_for(|done| *done).await;
        match accept_control(&read_on, generation).await {
            Ok(theirs) => {
                tokio::spawn(read_control(peer, theirs, events.clone(), shared));
                read_data_streams((rank, peer), read_on, reading, events, (ours, accepted_tx))
                    .await;
            }
            Err(why) => {
                read_on.close(CLOSE_REFUSED.into(), why.as_bytes());
                let _ = events.send(super::Event::Broken { peer, why });
            }
        }
    });
    tokio::spawn(watch_connection(peer, conn.clone(), sink.clone(), shared));
    Ok(Peer {
        conn,
        control,
        data,
        writers,
        held,
        generation,
        accepted,
        shares_conn: shared,
    })
}

/// The peer's control stream of `generation` on `conn`: the next stream it opens.
async fn accept_control(
    conn: &quinn::Connection,
    generation: u32,
) -> Result<quinn::RecvStream, String> {
    let mut stream = conn
        .accept_uni()
        .await
        .map_err(|e| format!("its regrouped control stream: {e}"))?;
    let mut tag = [0u8; 5];
    stream
        .read_exact(&mut tag)
        .await
        .map_err(|e| format!("its regrouped control stream: {e}"))?;
    let theirs = u32::from_le_bytes([tag[1], tag[2], tag[3], tag[4]]);
    if tag[0] != TAG_REGROUP || theirs != generation {
        return Err(format!(
            "a stream tagged {} of generation {theirs} where its control stream of generation {generation} was due",
            tag[0]
        ));
    }
    Ok(stream)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use super::super::QuicOptions;
    use super::*;
    use crate::test_meshes::{key, regroup_all};
    use crate::{Key, Kind, Message, Transport, TransportError};

    fn message(from: u32, to: u32, index: u32) -> Message {
        Message {
            key: key(from, to, index),
            version: 0,
            tensor: pipe_kernels::Tensor::from_vec(&[2], vec![from as f32, index as f32]).unwrap(),
        }
    }

    /// `mesh`'s endpoints, each boxed as the workers hold it.
    fn boxed(mesh: Vec<Quic>) -> Vec<Box<dyn Transport>> {
        mesh.into_iter()
            .map(|q| Box::new(q) as Box<dyn Transport>)
            .collect()
    }

    /// The endpoint at `at` of `eps` lost: aborted and dropped.
    fn lose(eps: &mut Vec<Box<dyn Transport>>, at: usize) {
        let mut gone = eps.remove(at);
        gone.abort();
        drop(gone);
    }

    /// Every endpoint sends message `index` to every other and receives theirs.
    fn all_to_all(eps: &mut [Box<dyn Transport>], index: u32) {
        for ep in eps.iter_mut() {
            let me = ep.rank();
            for to in (0..ep.size()).filter(|&t| t != me) {
                ep.send(message(me, to, index)).unwrap();
            }
        }
        for ep in eps.iter_mut() {
            let me = ep.rank();
            for from in (0..ep.size()).filter(|&f| f != me) {
                let m = ep.recv(&key(from, me, index)).unwrap();
                assert_eq!(
                    m.tensor.into_host_vec().unwrap(),
                    vec![from as f32, index as f32]
                );
            }
        }
    }

    /// What a regroup is handed is checked before anything is spent: a lost rank that is this
    /// worker or no rank of the mesh, and a host that is the lost rank or no survivor, are
    /// refused, and the endpoint still regroups afterwards. Once regrouped, an endpoint is
    /// spent: a second regroup fails.
    #[test]
    fn a_regroup_refuses_what_it_cannot_go_on_without() {
        let mut opts = QuicOptions::new(43);
        opts.connect_timeout = Duration::from_secs(5);
        let mut eps = boxed(super::super::local_mesh(3, &opts).unwrap());
        let err = |r: Result<crate::Regrouped, TransportError>| r.err().unwrap().to_string();
        assert!(err(eps[1].regroup(1, None)).contains("cannot go on without rank 1"));
        assert!(err(eps[1].regroup(3, None)).contains("cannot go on without rank 3"));
        assert!(err(eps[1].regroup(u32::MAX, None)).contains("in a mesh of 3"));
        assert!(err(eps[1].regroup(0, Some(0))).contains("cannot host rank 0"));
        assert!(err(eps[1].regroup(0, Some(7))).contains("cannot host rank 0"));
        let regrouped = eps[2].regroup(0, None).unwrap();
        assert!(err(eps[2].regroup(0, None)).contains("closed"));
        drop(regrouped);
        // Rank 1, untouched by the refusals, still regroups.
        eps[1].regroup_address().unwrap().unwrap();
        let mut one = eps.remove(1);
        drop(eps);
        assert!(one.regroup(0, None).is_ok());
    }

    /// A peer whose regrouped control stream carries another generation than the one due (a
    /// stale or hostile peer) has its connection refused, on both sides here: each survivor
    /// fails its next receive from the other, naming the stream refused (its own refusal, or
    /// the peer's in the close that reached it first), within the connect timeout rather than
    /// waiting.
    #[test]
    fn a_regrouped_control_stream_of_another_generation_is_refused() {
        let mut opts = QuicOptions::new(47);
        opts.connect_timeout = Duration::from_secs(5);
        let mut eps = super::super::local_mesh(4, &opts).unwrap();
        // Rank 1 holds its connection to rank 0 four generations on: it opens generation 5
        // where rank 0 waits for 1, and waits for 5 where rank 0 opens 1.
        if let Some(peer) = eps[1].peers[0].as_mut() {
            peer.generation += 4;
        }
        let mut eps = boxed(eps);
        lose(&mut eps, 3);
        let mut eps = regroup_all(eps, 3, None);
        let started = std::time::Instant::now();
        // Each side finds the connection failed, and one that refused the stream itself says
        // why. The other reads the refusal in the peer's close, or, where that close was
        // lost and the peer's end of the connection already gone, a reset.
        let refusals: Vec<String> = [(0u32, 1u32), (1, 0)]
            .into_iter()
            .map(|(me, from)| {
                eps[me as usize]
                    .recv(&key(from, me, 9))
                    .err()
                    .unwrap()
                    .to_string()
            })
            .collect();
        let named = |refused: &String| {
            ["of generation 5 where", "of generation 1 where"]
                .iter()
                .any(|s| refused.contains(s))
                && refused.contains("control stream of generation")
        };
        assert!(refusals.iter().any(named), "{refusals:?}");
        for refused in &refusals {
            assert!(named(refused) || refused.contains("reset"), "{refused}");
        }
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    /// Closes every one of `eps` at once, each on a thread of its own, all cleanly and
    /// within `bound`.
    fn close_all_within(eps: Vec<Box<dyn Transport>>, bound: Duration) {
        let t = std::time::Instant::now();
        let closing: Vec<_> = eps
            .into_iter()
            .map(|mut ep| std::thread::spawn(move || ep.close()))
            .collect();
        for c in closing {
            c.join().unwrap().unwrap();
        }
        assert!(t.elapsed() < bound, "{:?}", t.elapsed());
    }

    /// Every endpoint of `eps` sends message `index` to each of `ranks` but itself, then
    /// receives theirs.
    fn exchange(eps: &mut [Box<dyn Transport>], ranks: &[u32], index: u32) {
        for ep in eps.iter_mut() {
            let me = ep.rank();
            for &to in ranks.iter().filter(|&&t| t != me) {
                ep.send(message(me, to, index)).unwrap();
            }
        }
        for ep in eps.iter_mut() {
            let me = ep.rank();
            for &from in ranks.iter().filter(|&&f| f != me) {
                let m = ep.recv(&key(from, me, index)).unwrap();
                assert_eq!(
                    m.tensor.into_host_vec().unwrap(),
                    vec![from as f32, index as f32]
                );
            }
        }
    }

    /// A mesh of four loses rank 2, which rank 3 hosts on the connections it already has
    /// (no new endpoint meets ranks 0 and 1): what was in flight at the loss stays behind,
    /// and every pair, the hosted rank among them, talks both ways. Then rank 1 is lost, with
    /// no one in its place, while the hosted rank idles: ranks 0 and 3 regroup again, each
    /// connection in the generation past the hosted rank's, and talk. Everything closes
    /// cleanly, well within the linger.
    #[test]
    fn a_lost_rank_hosted_on_its_adopters_connections_talks_to_every_survivor() {
        let mut opts = QuicOptions::new(61);
        opts.connect_timeout = Duration::from_secs(20);
        opts.linger = Duration::from_secs(10);
        let mut eps = boxed(super::super::local_mesh(4, &opts).unwrap());
        exchange(&mut eps, &[0, 1, 2, 3], 1);
        for ep in &mut eps {
            let me = ep.rank();
            for to in (0..4).filter(|&t| t != me) {
                ep.send(message(me, to, 2)).unwrap();
            }
        }
        lose(&mut eps, 2);
        let mut eps = regroup_all(eps, 2, Some(3));
        let ranks: Vec<u32> = eps.iter().map(|ep| ep.rank()).collect();
        assert_eq!(ranks, [0, 1, 2, 3]);
        exchange(&mut eps, &[0, 1, 2, 3], 3);
        for ep in &mut eps {
            let me = ep.rank();
            for from in (0..4).filter(|&f| f != me) {
                assert!(ep.try_recv(&key(from, me, 2)).unwrap().is_none());
            }
            assert_eq!(ep.buffered(), 0);
        }
        let idle = eps.remove(2);
        lose(&mut eps, 1);
        let mut eps = regroup_all(eps, 1, None);
        exchange(&mut eps, &[0, 3], 4);
        eps.push(idle);
        close_all_within(eps, Duration::from_secs(5));
    }

    /// The host of a lost rank and the rank it hosts share no connection: each puts its
    /// messages into the other's queue. On a bf16 wire, an activation that crosses that link
    /// is rounded exactly as one that crosses a connection to another survivor, and an
    /// all-reduce chunk keeps every bit. The hosted rank's abort stops its host's receive
    /// at once, naming it; and once it has closed, a receive from it finds it gone rather
    /// than waiting.
    #[test]
    fn a_hosted_rank_and_its_host_talk_through_memory_with_the_wires_bits() {
        let mut opts = QuicOptions::new(67);
        opts.connect_timeout = Duration::from_secs(20);
        opts.linger = Duration::from_secs(5);
        opts.wire = crate::frame::WireDType::Bf16;
        // Three ranks; rank 1 lost and hosted by rank 2.
        let hosted_mesh = || {
            let mut eps = boxed(super::super::local_mesh(3, &opts).unwrap());
            lose(&mut eps, 1);
            regroup_all(eps, 1, Some(2))
        };
        let mut eps = hosted_mesh();
        let values = vec![1.0 + f32::EPSILON, -3.333_333, 1e-3, 65_537.0];
        let sent = |kind: Kind, to: u32, index: u32| Message {
            key: Key {
                kind,
                ..key(1, to, index)
            },
            version: 7,
            tensor: pipe_kernels::Tensor::from_vec(&[2, 2], values.clone()).unwrap(),
        };
        for kind in [Kind::Activation, Kind::Chunk] {
            eps[1].send(sent(kind, 0, 1)).unwrap();
            eps[1].send(sent(kind, 2, 1)).unwrap();
            let got = |ep: &mut Box<dyn Transport>, me: u32| {
                let key = Key {
                    kind,
                    ..key(1, me, 1)
                };
                let m = ep.recv(&key).unwrap();
                assert_eq!((m.version, m.tensor.shape().to_vec()), (7, vec![2, 2]));
                m.tensor.into_host_vec().unwrap()
            };
            let over_quic = got(&mut eps[0], 0);
            let through_memory = got(&mut eps[2], 2);
            assert_eq!(over_quic, through_memory, "{kind:?}");
            assert_eq!(over_quic == values, kind == Kind::Chunk, "{kind:?}");
        }
        // Closed, the hosted rank is gone to its host; aborted, in another mesh, it stops
        // its host's receive.
        let mut hosted = eps.remove(1);
        hosted.close().unwrap();
        let e = eps[1].recv(&key(1, 2, 9)).err().unwrap();
        assert!(matches!(e, TransportError::Closed { peer: 1 }), "{e}");
        close_all_within(eps, Duration::from_secs(4));
        let mut eps = hosted_mesh();
        let mut hosted = eps.remove(1);
        let mut host = eps.pop().unwrap();
        let waiting = std::thread::spawn(move || host.recv(&key(1, 2, 9)).err().unwrap());
        std::thread::sleep(Duration::from_millis(50));
        hosted.abort();
        let e = waiting.join().unwrap();
        assert!(matches!(e, TransportError::Aborted { by: 1 }), "{e}");
    }

    /// A mesh of four loses rank 2, then rank 1, with no one in either's place: each time the
    /// survivors go on on their connections, every message sent before the loss stays behind
    /// (none is received after), every pair still talks, and the mesh closes cleanly at the
    /// end.
    #[test]
    fn survivors_regroup_on_their_connections_and_leave_what_was_in_flight_behind() {
        let mut opts = QuicOptions::new(41);
        opts.connect_timeout = Duration::from_secs(20);
        opts.linger = Duration::from_secs(5);
        let mut eps = boxed(super::super::local_mesh(4, &opts).unwrap());
        all_to_all(&mut eps, 1);
        let in_flight = |eps: &mut [Box<dyn Transport>], to: &[u32], index: u32| {
            for ep in eps.iter_mut() {
                let me = ep.rank();
                for &t in to.iter().filter(|&&t| t != me) {
                    ep.send(message(me, t, index)).unwrap();
                }
            }
        };
        // Messages in flight when rank 2 is lost: sent, never received.
        in_flight(&mut eps, &[0, 1, 2, 3], 2);
        lose(&mut eps, 2);
        let mut eps = regroup_all(eps, 2, None);
        exchange(&mut eps, &[0, 1, 3], 3);
        for ep in &mut eps {
            let me = ep.rank();
            for from in [0, 1, 3].into_iter().filter(|&f| f != me) {
                assert!(
                    ep.try_recv(&key(from, me, 2)).unwrap().is_none(),
                    "{from} -> {me}"
                );
            }
            assert_eq!(ep.buffered(), 0);
        }
        // Then rank 1: the others' connections regroup again.
        in_flight(&mut eps, &[0, 1, 3], 4);
        lose(&mut eps, 1);
        let mut eps = regroup_all(eps, 1, None);
        for ep in &mut eps {
            let me = ep.rank();
            assert!(ep.send(message(me, 1, 5)).is_err());
            assert!(ep.send(message(me, 2, 5)).is_err());
        }
        exchange(&mut eps, &[0, 3], 5);
        for ep in &mut eps {
            let me = ep.rank();
            for from in [0, 3].into_iter().filter(|&f| f != me) {
                assert!(ep.try_recv(&key(from, me, 4)).unwrap().is_none());
            }
        }
        close_all_within(eps, Duration::from_secs(4));
    }
}
