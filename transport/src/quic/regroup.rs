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
//! never by closing the connection, and a later regroup drops it. Only the adopter's own link
//! to the lost rank is a new connection, within its process, which the hosted endpoint dials
//! and the adopter takes from the late arrivals it was readied for
//! ([`Quic::ready_to_regroup`]; refused otherwise). So no handshake with another process
//! stands between a loss and the run going on.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::unbounded;

use super::{
    Alarm, CLOSE_DONE, CLOSE_FAILED, CLOSE_REFUSED, Events, Greeted, LateSlot, Me, Peer, Quic,
    TAG_REGROUP, dial, greet, open_data_streams, read_control, read_data_streams, reading_of,
    setup_err, start_peer, watch_connection,
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
    arrivals: Option<tokio::sync::mpsc::UnboundedReceiver<quinn::Incoming>>,
}

impl Quic {
    /// Readies this endpoint to go on without a lost peer ([`Quic::regrouped`]): from now on
    /// a connection that arrives late is kept for the regroup, not refused. Returns the
    /// address this endpoint listens at, where the lost rank's new endpoint reaches it.
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
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        if let Ok(mut slot) = self.late.lock() {
            *slot = Some(tx);
        }
        self.late_arrivals = Some(rx);
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
            match slot.as_ref() {
                Some(p) if p.shares_conn => *slot = None,
                Some(p) if p.to_hosted => {
                    p.conn.close(CLOSE_DONE.into(), b"done");
                    *slot = None;
                }
                _ => {}
            }
        }
        Ok(Spent {
            rank,
            runtime,
            peers,
            hosts,
            sink,
            events,
            arrivals: self.late_arrivals.take(),
        })
    }

    /// The mesh a regroup made of `spent`, on this endpoint's socket.
    fn regrouped_mesh(&self, spent: Spent) -> Quic {
        if let Ok(mut slot) = self.late.lock() {
            *slot = None;
        }
        self.mesh_on(spent, (self.endpoint.clone(), self.late.clone()))
    }

    /// A mesh of `spent`'s peers on `endpoint`, which puts a late connection in `late`, with
    /// this endpoint's settings.
    fn mesh_on(&self, spent: Spent, (endpoint, late): (quinn::Endpoint, LateSlot)) -> Quic {
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
            client: self.client.clone(),
            late,
            late_arrivals: None,
        }
    }

    /// This endpoint's mesh going on without rank `lost` on the connections it has with the
    /// others (see the module documentation); where survivor `host` hosts the lost rank, with
    /// that rank carried on `host`'s connections: no new endpoint meets the others, so no
    /// handshake stands between a loss and the run going on. Each survivor's connection to
    /// the host carries, after its own next generation of streams, one more for the lost rank
    /// ([`alias`]); only the host's own link to the lost rank is a new connection, within its
    /// process. On the host, also the lost rank's endpoint, for the program it hosts. This
    /// endpoint is spent: it holds nothing any more, and every later call fails or does
    /// nothing.
    ///
    /// # Errors
    /// [`TransportError::Setup`]: a rank that is not a peer, a host that is the lost rank or
    /// no survivor, an endpoint already closed or (on the host) not readied
    /// ([`Quic::ready_to_regroup`]), a connection that fails while its streams open.
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

    /// [`Quic::regrouped`] on the host: its own mesh, and the lost rank's endpoint
    /// on a socket of its own whose one connection is to this endpoint, its other peers on
    /// this endpoint's connections.
    fn hosting(&mut self, lost: u32) -> Result<(Quic, Quic), TransportError> {
        let at = self
            .endpoint
            .local_addr()
            .map_err(|e| setup_err("local address", e))?;
        let hosted_runtime = super::endpoint_runtime(&format!("pipe-quic-{lost}"))?;
        let socket = {
            let _guard = hosted_runtime.enter();
            super::endpoint_on(SocketAddr::new(at.ip(), 0), None, &self.cuts)?
        };
        let mut spent = self.spend(lost)?;
        let (rank, me, opts) = (spent.rank, self.me(), &self.opts);
        let hosted_me = Me {
            rank: lost,
            host: me.host,
        };
        let (client, deadline) = (self.client.clone(), Instant::now() + opts.connect_timeout);
        let dialing = {
            let (socket, opts) = (socket.clone(), opts.clone());
            hosted_runtime.spawn(async move {
                dial(&socket, &client, hosted_me, rank, at, &opts, deadline).await
            })
        };
        let arrivals = spent.arrivals.take();
        let watched = watched(&spent.peers);
        let (peers, sink) = (&mut spent.peers, &spent.sink);
        let own = spent.runtime.block_on(async {
            let renewing = renew_all(rank, peers, opts, sink);
            let taking = until_a_survivor_closes(
                take_late(arrivals, me, lost, opts.run_id, deadline),
                &watched,
                (rank, lost),
            );
            let (renewed, taken) = tokio::join!(renewing, taking);
            for (peer, joined) in renewed? {
                peers[peer] = Some(joined);
            }
            let (peer, conn, control, theirs, host) = taken?;
            let joined = start_peer(rank, peer, conn, (control, theirs), opts, sink).await?;
            Ok::<_, TransportError>((joined, host))
        });
        let (mut joined, host) = own?;
        joined.to_hosted = true;
        spent.peers[lost as usize] = Some(joined);
        spent.hosts[lost as usize] = Some(host);
        // The lost rank's side: its link to this endpoint, then one more generation of
        // streams on each of this endpoint's connections to the others.
        let (tx, hosted_events) = unbounded();
        let hosted_sink = Events {
            tx,
            alarm: Alarm::default(),
        };
        let mut hosted_peers: Vec<Option<Peer>> = (0..self.size).map(|_| None).collect();
        let mut hosted_hosts = vec![None; self.size as usize];
        let (peers, hosts) = (&mut spent.peers, &spent.hosts);
        hosted_runtime.block_on(async {
            let dialed = dialing
                .await
                .map_err(|e| setup_err("connecting the hosted rank", e))??;
            let (peer, conn, control, theirs, host) = dialed;
            hosted_peers[peer as usize] =
                Some(start_peer(lost, peer, conn, (control, theirs), opts, &hosted_sink).await?);
            hosted_hosts[peer as usize] = Some(host);
            for (other, slot) in peers.iter_mut().enumerate() {
                let Some(via) = slot.as_mut().filter(|_| other as u32 != lost) else {
                    continue;
                };
                hosted_peers[other] =
                    Some(alias(lost, other as u32, via, opts, &hosted_sink).await?);
                hosted_hosts[other] = hosts[other];
            }
            Ok::<_, TransportError>(())
        })?;
        let hosted = Spent {
            rank: lost,
            runtime: hosted_runtime,
            peers: hosted_peers,
            hosts: hosted_hosts,
            sink: hosted_sink,
            events: hosted_events,
            arrivals: None,
        };
        let hosted = self.mesh_on(hosted, (socket, LateSlot::default()));
        Ok((self.regrouped_mesh(spent), hosted))
    }

    /// This endpoint as its hellos name it.
    fn me(&self) -> Me {
        Me {
            rank: self.rank,
            host: self.host,
        }
    }
}

/// Every live connection of `peers`, by rank: what a regroup watches for a survivor lost
/// meanwhile.
fn watched(peers: &[Option<Peer>]) -> Vec<(u32, quinn::Connection)> {
    peers
        .iter()
        .enumerate()
        .filter_map(|(r, p)| p.as_ref().map(|p| (r as u32, p.conn.clone())))
        .collect()
}

/// `connect`, unless a survivor of `watched` is lost first (the host of the lost rank's new
/// endpoint among them): that ends the wait at once, rather than at the connect timeout.
async fn until_a_survivor_closes(
    connect: impl std::future::Future<Output = Result<Greeted, TransportError>>,
    watched: &[(u32, quinn::Connection)],
    (rank, lost): (u32, u32),
) -> Result<Greeted, TransportError> {
    tokio::select! {
        greeted = connect => greeted,
        (peer, why) = first_closed(watched) => Err(TransportError::Setup(format!(
            "rank {rank}: rank {peer} was lost while the mesh regrouped without rank {lost} ({why})"
        ))),
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
        to_hosted: false,
    })
}

/// The first of `peers`' connections to close, and why; pending while none does.
async fn first_closed(peers: &[(u32, quinn::Connection)]) -> (u32, quinn::ConnectionError) {
    // Dropped with this future, the set stops every watch.
    let mut watches = tokio::task::JoinSet::new();
    for (rank, conn) in peers {
        let (rank, conn) = (*rank, conn.clone());
        watches.spawn(async move { (rank, conn.closed().await) });
    }
    match watches.join_next().await {
        Some(Ok(closed)) => closed,
        _ => std::future::pending().await,
    }
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

/// The connection of rank `lost`'s new endpoint, from the late `arrivals` this endpoint was
/// readied for; any other is refused.
async fn take_late(
    arrivals: Option<tokio::sync::mpsc::UnboundedReceiver<quinn::Incoming>>,
    me: Me,
    lost: u32,
    run_id: u64,
    deadline: Instant,
) -> Result<Greeted, TransportError> {
    let rank = me.rank;
    let mut arrivals = arrivals.ok_or_else(|| {
        TransportError::Setup(format!(
            "worker {rank} regrouped without being readied for rank {lost}'s connection"
        ))
    })?;
    let missing = || {
        TransportError::Setup(format!(
            "rank {rank}: rank {lost}'s new endpoint did not connect before the connect timeout"
        ))
    };
    loop {
        let incoming = tokio::time::timeout_at(deadline.into(), arrivals.recv())
            .await
            .map_err(|_| missing())?
            .ok_or_else(missing)?;
        let conn = match tokio::time::timeout_at(deadline.into(), incoming).await {
            Ok(Ok(conn)) => conn,
            // A failed handshake (a peer without a valid certificate) is dropped.
            Ok(Err(_)) => continue,
            Err(_) => return Err(missing()),
        };
        let greeted =
            tokio::time::timeout_at(deadline.into(), greet(&conn, rank, run_id, &me.host))
                .await
                .map_err(|_| missing())?;
        match greeted {
            Ok((peer, control, theirs, host)) if peer == lost => {
                return Ok((peer, conn, control, theirs, host));
            }
            Ok((peer, ..)) => conn.close(
                CLOSE_REFUSED.into(),
                format!("rank {peer} refused").as_bytes(),
            ),
            Err(e) => conn.close(CLOSE_REFUSED.into(), e.why.as_bytes()),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use super::super::QuicOptions;
    use super::*;
    use crate::{Key, Kind, Message, Transport, TransportError};

    fn key(from: u32, to: u32, index: u32) -> Key {
        Key {
            from,
            to,
            kind: Kind::Activation,
            stage: 0,
            index,
            step: 0,
        }
    }

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

    /// Each of `eps` regroups without `lost`, which `host` hosts on its connections where
    /// named, on a thread of its own; the hosted rank's endpoint joins them.
    fn regroup_all(
        eps: Vec<Box<dyn Transport>>,
        lost: u32,
        host: Option<u32>,
    ) -> Vec<Box<dyn Transport>> {
        let threads: Vec<_> = eps
            .into_iter()
            .map(|mut ep| {
                ep.regroup_address().unwrap().unwrap();
                std::thread::spawn(move || ep.regroup(lost, host).unwrap())
            })
            .collect();
        let mut out: Vec<Box<dyn Transport>> = Vec::new();
        for t in threads {
            let (mesh, hosted) = t.join().unwrap();
            out.push(mesh);
            out.extend(hosted.map(|h| h as Box<dyn Transport>));
        }
        out.sort_by_key(|ep| ep.rank());
        out
    }

    /// What a regroup is handed is checked before anything is spent: a lost rank that is this
    /// worker or no rank of the mesh, and a host that is the lost rank or no survivor, are
    /// refused, and the endpoint still regroups afterwards. A host that was never readied
    /// for its link to the rank it hosts fails naming that, instead of waiting.
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
        // Rank 2 would take the hosted rank's link from the late arrivals it was readied for.
        let unready = err(eps[2].regroup(0, Some(2)));
        assert!(unready.contains("without being readied"), "{unready}");
        // Spent: every later call fails.
        assert!(eps[2].regroup(0, None).is_err());
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
        let t = Instant::now();
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
