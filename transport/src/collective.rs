//! Collectives written once over [`Transport`]: the ring all-reduce.
//!
//! `r` replicas in ring order split the buffer into `r` chunks (boundaries from the length
//! alone). Reduce-scatter: at step `k` replica `i` sends chunk `(i - k) mod r` to the next
//! replica and adds the chunk `(i - k - 1) mod r` it receives from the previous one into its
//! own; after `r - 1` steps replica `i` holds the complete sum of chunk `(i + 1) mod r`.
//! All-gather: `r - 1` more steps pass the complete chunks around. Each replica sends
//! `2 (r - 1) / r` of the buffer. Chunk `c` is summed in a fixed order,
//! `((x_c + x_{c+1}) + x_{c+2}) + ...`, which [`ring_sum`] reproduces on one thread, so a
//! single-threaded reference can match the distributed result bit for bit.

use pipe_kernels::Tensor;

use crate::frame::{WireDType, round_to_wire};
use crate::{Key, Kind, Message, Transport, TransportError, Values};

/// Start of chunk `c` of `r` over a buffer of `len` values.
fn chunk_start(len: usize, r: usize, c: usize) -> usize {
    c * len / r
}

fn chunk(len: usize, r: usize, c: usize) -> std::ops::Range<usize> {
    chunk_start(len, r, c)..chunk_start(len, r, c + 1)
}

/// Sums `data` across the workers in `group` (ring order; this worker must be in it), in place.
/// `stage` and `update` name the messages (keys `Chunk`, with the ring step).
///
/// # Errors
/// Transport errors, or [`TransportError::Protocol`] if this worker is not in the group or a
/// chunk arrives with the wrong length.
pub fn ring_all_reduce<T: Transport + ?Sized>(
    t: &mut T,
    group: &[u32],
    stage: u32,
    update: u32,
    data: &mut [f32],
) -> Result<(), TransportError> {
    ring_all_reduce_segments(t, group, stage, update, &mut [data])
}

/// Values per piece of a ring chunk: chunks travel in pieces of at most this many values
/// (256 KiB of f32), so that a piece received can be added and passed on while the next one
/// is still arriving. Over shared memory a piece is written into a ring and read from it, so
/// its size sets how much memory the ring cycles through: 256 KiB pieces in 1-2 MiB rings ran
/// 100 MB among 4 workers in 0.057-0.078 s against 0.077-0.083 s for 1 MiB pieces in 4 MiB
/// rings (threads in process: 0.058-0.069 s; `cargo run --release -p pipe-transport
/// --example ring_profile`, `docs/benchmarks.md`).
pub const RING_PIECE_VALUES: usize = 1 << 16;

/// The pieces of a chunk of `n` values: their count and the range of piece `j` within the
/// chunk. From the length alone, so sender and receiver agree.
fn pieces_of(n: usize) -> usize {
    n.div_ceil(RING_PIECE_VALUES).max(1)
}

fn piece(range: &std::ops::Range<usize>, count: usize, j: usize) -> std::ops::Range<usize> {
    let n = range.len();
    range.start + j * n / count..range.start + (j + 1) * n / count
}

/// [`ring_all_reduce`] of the concatenation of `segments`, without concatenating them: the
/// ring's chunks are ranges of the virtual flat buffer, copied out of the segments they span
/// when sent and added into them when received. A stage's gradient tensors are reduced where
/// they live, and the result is [`ring_sum`] of the replicas' concatenations.
///
/// **Pipelined.** Each chunk travels in pieces ([`RING_PIECE_VALUES`]). The chunk a worker
/// sends at step `k + 1` is the one it received (and added into) at step `k`, so each piece is
/// passed on as soon as it is merged, while the next piece is still on its way: every link
/// carries several pieces at once, and adding overlaps receiving. A piece follows the same
/// route as its whole chunk did, so every value is summed in the same order, whatever the
/// timing.
///
/// **Buffers.** A received piece's buffer carries the same piece onward; the buffers left at
/// the end are kept by the calling thread for its next all-reduce, so the steady state
/// allocates little (a fresh buffer of a 4-million-value stage's chunk page-faulted 2,000
/// pages a call).
///
/// # Errors
/// As [`ring_all_reduce`].
pub fn ring_all_reduce_segments<T: Transport + ?Sized>(
    t: &mut T,
    group: &[u32],
    stage: u32,
    update: u32,
    segments: &mut [&mut [f32]],
) -> Result<(), TransportError> {
    let spec = RingSpec {
        stage,
        update,
        first_step: 0,
        wire: WireDType::F32,
    };
    RingAllReduce::start(t, group, spec, segments)?.finish(t, segments)
}

/// One ring all-reduce: what names its messages, its `stage` and `update` (the keys' stage and
/// index) and the first of the `step` values it uses ([`ring_step_count`] of them), so that
/// several rings of one update (gradient buckets) never share a key; and the precision its
/// values travel in.
///
/// With a bf16 `wire` the sums stay f32 and only what is sent is rounded (nearest even): each
/// partial sum is rounded as it leaves for the next replica, which adds its own f32 values to
/// it, and the owner of a finished chunk rounds it before passing it around and keeps the
/// rounded values itself, so every replica ends with the same bits, [`ring_sum_as`]'s. A piece
/// whose values are all bf16 values travels in two bytes each ([`crate::frame::exact_in_bf16`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingSpec {
    /// The keys' stage.
    pub stage: u32,
    /// The keys' index.
    pub update: u32,
    /// The first key step this ring uses.
    pub first_step: u32,
    /// The precision of the values sent.
    pub wire: WireDType,
}

/// The key steps a ring all-reduce of `len` values among `replicas` uses: one per piece per
/// ring step (zero for a single replica).
pub fn ring_step_count(len: usize, replicas: usize) -> usize {
    if replicas <= 1 {
        return 0;
    }
    // No chunk has more pieces than the whole buffer would.
    2 * (replicas - 1) * pieces_of(len)
}

/// A ring all-reduce in progress ([`ring_all_reduce_segments`], taken apart): started by
/// [`RingAllReduce::start`], moved on without waiting by [`RingAllReduce::poll`] (what a worker
/// calls between the layers of its backward pass, so a bucket of gradients is summed while
/// earlier layers compute), and completed by [`RingAllReduce::finish`]. It holds no borrow of
/// the buffer: each call is given the same `segments` again, untouched by anyone else in
/// between. The pieces are received in one fixed order whatever the timing, so the sum is
/// [`ring_sum`]'s, bit for bit.
#[derive(Debug)]
pub struct RingAllReduce {
    /// Replicas in the ring; 0 or 1 means nothing to do.
    r: usize,
    /// This worker's place in the ring.
    i: usize,
    next: u32,
    prev: u32,
    me: u32,
    spec: RingSpec,
    /// Values in the flat buffer.
    len: usize,
    /// The next piece to receive: (ring step, piece).
    step: usize,
    piece: usize,
    /// Lending rings only: the next piece to send, (ring step, piece), in key order; pieces
    /// sent and received so far; and how many more pieces than it has received a worker
    /// may have sent ([`RingAllReduce::window`]).
    send_step: usize,
    send_piece: usize,
    sent: usize,
    received: usize,
    window: usize,
    /// Buffers taken from the thread's spares, returned when the ring ends.
    spares: Vec<Vec<f32>>,
}

impl RingAllReduce {
    /// Starts the ring: checks the group and sends this worker's first chunk.
    ///
    /// # Errors
    /// As [`ring_all_reduce`].
    pub fn start<T: Transport + ?Sized>(
        t: &mut T,
        group: &[u32],
        spec: RingSpec,
        segments: &mut [&mut [f32]],
    ) -> Result<Self, TransportError> {
        let r = group.len();
        let me = t.rank();
        let flat = Segments::new(segments);
        let mut ring = RingAllReduce {
            r,
            i: 0,
            next: me,
            prev: me,
            me,
            spec,
            len: flat.len(),
            step: 0,
            piece: 0,
            send_step: 0,
            send_piece: 0,
            sent: 0,
            received: 0,
            window: usize::MAX,
            spares: Vec::new(),
        };
        if r <= 1 {
            return Ok(ring);
        }
        let i = group.iter().position(|&w| w == me).ok_or_else(|| {
            TransportError::Protocol(format!("worker {me} is not in all-reduce group {group:?}"))
        })?;
        ring.i = i;
        (ring.next, ring.prev) = (group[(i + 1) % r], group[(i + r - 1) % r]);
        let last = u64::from(spec.first_step) + ring_step_count(ring.len, r) as u64;
        if last > u64::from(RING_STEP_LIMIT) {
            return Err(TransportError::Protocol(
                "all-reduce of too many pieces".into(),
            ));
        }
        let first = chunk(ring.len, r, ring.chunks(0).0);
        let count = pieces_of(first.len());
        if ring.lends(t) {
            ring.window = Self::window(t, ring.len, r);
            ring.send_ready(t, &flat)?;
            return Ok(ring);
        }
        ring.spares = CHUNK_BUFFERS.with(std::cell::Cell::take);
        for j in 0..count {
            let mut buf = ring.spares.pop().unwrap_or_default();
            buf.clear();
            flat.copy_out(piece(&first, count, j), &mut buf);
            round_to_wire(&mut buf, spec.wire);
            send_piece(t, ring.key(ring.me, ring.next, 0, j), buf)?;
        }
        Ok(ring)
    }

    /// Whether every piece has been received (this worker holds the whole sum).
    pub fn is_done(&self) -> bool {
        self.r <= 1 || self.step >= 2 * (self.r - 1)
    }

    /// Takes every piece that has already arrived, adding it in and passing it on, without
    /// waiting. Returns whether the ring is done.
    ///
    /// # Errors
    /// As [`ring_all_reduce`].
    pub fn poll<T: Transport + ?Sized>(
        &mut self,
        t: &mut T,
        segments: &mut [&mut [f32]],
    ) -> Result<bool, TransportError> {
        self.advance(t, segments, false)
    }

    /// Waits for the remaining pieces and completes the sum.
    ///
    /// # Errors
    /// As [`ring_all_reduce`].
    pub fn finish<T: Transport + ?Sized>(
        mut self,
        t: &mut T,
        segments: &mut [&mut [f32]],
    ) -> Result<(), TransportError> {
        self.advance(t, segments, true)?;
        Ok(())
    }

    /// Whether pieces go by lending values to a transport that copies them anyway
    /// ([`Transport::copies_payloads`]): written from the buffer straight into it and added
    /// from it as they arrive, with no piece buffer between (f32 rings; a bf16 ring rounds
    /// what it sends, so it keeps its buffers).
    fn lends<T: Transport + ?Sized>(&self, t: &T) -> bool {
        self.spec.wire == WireDType::F32 && t.copies_payloads()
    }

    /// How many pieces more than it has received a worker of a lending ring may have sent:
    /// as many as keep every link's share of what the whole ring holds in flight within the
    /// link's buffer ([`Transport::link_buffer_bytes`]), at least one. Each worker sends one
    /// piece per piece received beyond its first `window`, so the ring holds `r * window`
    /// pieces in flight at any time, however they are spread over its links: a send then
    /// finds room in the ring and never waits, and the transport never has to take arrivals
    /// aside to break a wait (a copy out of the ring and another into the buffer).
    fn window<T: Transport + ?Sized>(t: &T, len: usize, r: usize) -> usize {
        let Some(buffer) = t.link_buffer_bytes() else {
            return usize::MAX;
        };
        // A piece's frame: its values and at most this much of header and padding.
        const FRAME_BYTES: u64 = 256;
        let widest = len.div_ceil(r);
        let values = widest.div_ceil(pieces_of(widest)) as u64;
        let per_piece = values * 4 + FRAME_BYTES;
        ((buffer / per_piece / r as u64) as usize).max(1)
    }

    /// Sends, in key order, every piece that is ready (its chunk received and merged at the
    /// step before) while the window allows ([`RingAllReduce::window`]).
    fn send_ready<T: Transport + ?Sized>(
        &mut self,
        t: &mut T,
        flat: &Segments<'_, '_>,
    ) -> Result<(), TransportError> {
        let steps = 2 * (self.r - 1);
        while self.send_step < steps && self.sent < self.received.saturating_add(self.window) {
            let (step, j) = (self.send_step, self.send_piece);
            // Piece j of step s > 0 is piece j of the chunk received at step s - 1.
            if step > 0 && (step - 1, j) >= (self.step, self.piece) {
                break;
            }
            let range = chunk(self.len, self.r, self.chunks(step).0);
            let count = pieces_of(range.len());
            let at = piece(&range, count, j);
            t.send_values(Values {
                key: self.key(self.me, self.next, step, j),
                version: 0,
                parts: &flat.slices(at),
            })?;
            self.sent += 1;
            (self.send_step, self.send_piece) = if j + 1 < count {
                (step, j + 1)
            } else {
                (step + 1, 0)
            };
        }
        Ok(())
    }

    /// Receives piece `at` (keyed `key`) by lending, adding it into `flat` (or copying it,
    /// in the all-gather) block by block. `None` when not waiting and it has not arrived.
    fn lend_in<T: Transport + ?Sized>(
        t: &mut T,
        key: &Key,
        flat: &mut Segments<'_, '_>,
        at: &std::ops::Range<usize>,
        gather: bool,
        wait: bool,
    ) -> Result<Option<()>, TransportError> {
        let mut overflow = false;
        let mut take = |off: usize, block: &[f32]| {
            if off + block.len() > at.len() {
                overflow = true;
                return;
            }
            let lo = at.start + off;
            flat.merge_in(lo..lo + block.len(), block, gather);
        };
        let got = if wait {
            t.recv_with(key, &mut take)?
        } else {
            match t.try_recv_with(key, &mut take)? {
                Some(n) => n,
                None => return Ok(None),
            }
        };
        if overflow || got != at.len() {
            return Err(TransportError::Protocol(format!(
                "all-reduce piece of {got} values where {} were expected",
                at.len()
            )));
        }
        Ok(Some(()))
    }

    /// (chunk sent, chunk received) at ring step `step`: reduce-scatter, then all-gather.
    fn chunks(&self, step: usize) -> (usize, usize) {
        let (r, i) = (self.r, self.i);
        let k = step % (r - 1);
        if step >= r - 1 {
            ((i + 1 + r - k) % r, (i + r - k) % r)
        } else {
            ((i + r - k) % r, (i + 2 * r - k - 1) % r)
        }
    }

    /// The key of piece `j` of ring step `step` (in range: checked by `start`).
    fn key(&self, from: u32, to: u32, step: usize, j: usize) -> Key {
        let at = step * pieces_of(self.len) + j;
        Key {
            from,
            to,
            kind: Kind::Chunk,
            stage: self.spec.stage,
            index: self.spec.update,
            step: self.spec.first_step + at as u32,
        }
    }

    /// Receives pieces in their fixed order, waiting for each when `wait`, otherwise until
    /// the next has not arrived yet. Returns whether the ring is done.
    fn advance<T: Transport + ?Sized>(
        &mut self,
        t: &mut T,
        segments: &mut [&mut [f32]],
        wait: bool,
    ) -> Result<bool, TransportError> {
        if self.is_done() {
            return Ok(true);
        }
        let mut flat = Segments::new(segments);
        if flat.len() != self.len {
            return Err(TransportError::Protocol(format!(
                "all-reduce buffer of {} values resumed with {}",
                self.len,
                flat.len()
            )));
        }
        let steps = 2 * (self.r - 1);
        while self.step < steps {
            let step = self.step;
            let gather = step >= self.r - 1;
            let range = chunk(self.len, self.r, self.chunks(step).1);
            let count = pieces_of(range.len());
            let j = self.piece;
            let at = piece(&range, count, j);
            let key = self.key(self.prev, self.me, step, j);
            if self.lends(t) {
                if Self::lend_in(t, &key, &mut flat, &at, gather, wait)?.is_none() {
                    return Ok(false);
                }
                (self.step, self.piece) = if j + 1 < count {
                    (step, j + 1)
                } else {
                    (step + 1, 0)
                };
                self.received += 1;
                // The merged piece (or the finished one, in the all-gather) goes on, as the
                // window allows.
                self.send_ready(t, &flat)?;
                continue;
            }
            let got = if wait {
                t.recv(&key)?
            } else {
                match t.try_recv(&key)? {
                    Some(m) => m,
                    None => return Ok(false),
                }
            };
            let src = got
                .tensor
                .host()
                .map_err(|e| TransportError::Protocol(format!("all-reduce chunk: {e}")))?;
            if src.len() != at.len() {
                return Err(TransportError::Protocol(format!(
                    "all-reduce piece of {} values where {} were expected",
                    src.len(),
                    at.len()
                )));
            }
            flat.merge_in(at.clone(), src, gather);
            let mut buf = got.tensor.into_host_vec().unwrap_or_default();
            if step + 1 < steps {
                // The chunk received now is the one sent next: pass this piece on at once
                // (after the all-gather's copy the buffer already holds its values).
                if !gather {
                    buf.clear();
                    flat.copy_out(at.clone(), &mut buf);
                    round_to_wire(&mut buf, self.spec.wire);
                    if step + 2 == self.r && self.spec.wire != WireDType::F32 {
                        // The finished sum of the chunk this worker owns: it keeps what it
                        // sends, as every other replica will.
                        flat.merge_in(at, &buf, true);
                    }
                }
                send_piece(t, self.key(self.me, self.next, step + 1, j), buf)?;
            } else {
                self.spares.push(buf);
            }
            (self.step, self.piece) = if j + 1 < count {
                (step, j + 1)
            } else {
                (step + 1, 0)
            };
        }
        let spares = std::mem::take(&mut self.spares);
        CHUNK_BUFFERS.with(|cell| {
            // Another ring of this thread may have returned its buffers meanwhile.
            let mut held = cell.take();
            held.extend(spares);
            held.truncate(SPARE_BUFFERS);
            cell.set(held);
        });
        Ok(true)
    }
}

/// Ring steps and pieces share the message's `step` below this (the executor's other chunk
/// messages, tied gradients and device sums, use steps from 2^24 up).
const RING_STEP_LIMIT: u32 = 1 << 24;

/// Buffers a thread keeps between all-reduces.
const SPARE_BUFFERS: usize = 16;

fn send_piece<T: Transport + ?Sized>(
    t: &mut T,
    key: Key,
    buf: Vec<f32>,
) -> Result<(), TransportError> {
    let n = buf.len();
    let tensor = Tensor::from_vec(&[n], buf)
        .map_err(|e| TransportError::Protocol(format!("chunk tensor: {e}")))?;
    t.send(Message {
        key,
        version: 0,
        tensor,
    })
}

thread_local! {
    /// The calling thread's piece buffers between all-reduces (see
    /// [`ring_all_reduce_segments`]).
    static CHUNK_BUFFERS: std::cell::Cell<Vec<Vec<f32>>> =
        const { std::cell::Cell::new(Vec::new()) };
}

/// Slices seen as one flat buffer.
struct Segments<'a, 'b> {
    parts: &'a mut [&'b mut [f32]],
    /// `starts[s]`: where part `s` begins in the flat buffer; one more entry for the end.
    starts: Vec<usize>,
}

impl<'a, 'b> Segments<'a, 'b> {
    fn new(parts: &'a mut [&'b mut [f32]]) -> Self {
        let mut starts = Vec::with_capacity(parts.len() + 1);
        let mut at = 0;
        for p in parts.iter() {
            starts.push(at);
            at += p.len();
        }
        starts.push(at);
        Segments { parts, starts }
    }

    fn len(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }

    /// The pieces of flat range `range`: (part, range within the part, offset in `range`).
    fn pieces(
        &self,
        range: std::ops::Range<usize>,
    ) -> impl Iterator<Item = (usize, std::ops::Range<usize>, usize)> + '_ {
        let first = self
            .starts
            .partition_point(|&s| s <= range.start)
            .saturating_sub(1);
        (first..self.parts.len())
            .take_while(move |&p| self.starts[p] < range.end)
            .filter_map(move |p| {
                let lo = range.start.max(self.starts[p]);
                let hi = range.end.min(self.starts[p + 1]);
                (lo < hi).then(|| {
                    (
                        p,
                        lo - self.starts[p]..hi - self.starts[p],
                        lo - range.start,
                    )
                })
            })
    }

    /// Flat range `range` as the slices of the parts it spans.
    fn slices(&self, range: std::ops::Range<usize>) -> Vec<&[f32]> {
        self.pieces(range)
            .map(|(p, within, _)| &self.parts[p][within])
            .collect()
    }

    /// Appends flat range `range` to `out`.
    fn copy_out(&self, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
        for (p, within, _) in self.pieces(range) {
            out.extend_from_slice(&self.parts[p][within]);
        }
    }

    /// Adds `src` into flat range `range` (or copies it, for the all-gather).
    fn merge_in(&mut self, range: std::ops::Range<usize>, src: &[f32], copy: bool) {
        let pieces: Vec<_> = self.pieces(range).collect();
        for (p, within, offset) in pieces {
            let n = within.len();
            let dst = &mut self.parts[p][within];
            let src = &src[offset..offset + n];
            if copy {
                dst.copy_from_slice(src);
            } else {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d += *s;
                }
            }
        }
    }
}

/// What [`ring_all_reduce`] leaves in every replica, computed on one thread from the replicas'
/// buffers (in ring order), with the same order of additions.
///
/// # Panics
/// If the buffers differ in length.
pub fn ring_sum(parts: &[&[f32]]) -> Vec<f32> {
    ring_sum_as(parts, WireDType::F32)
}

/// [`ring_sum`] of a ring whose values travel as `wire` ([`RingSpec`]): each partial sum
/// rounded before the next replica adds to it, and the finished sum rounded.
///
/// # Panics
/// If the buffers differ in length.
pub fn ring_sum_as(parts: &[&[f32]], wire: WireDType) -> Vec<f32> {
    let r = parts.len();
    let Some(first) = parts.first() else {
        return Vec::new();
    };
    let len = first.len();
    assert!(
        parts.iter().all(|p| p.len() == len),
        "ring_sum: buffers differ in length"
    );
    let mut out = vec![0.0f32; len];
    for c in 0..r {
        let range = chunk(len, r, c);
        let dst = &mut out[range.clone()];
        dst.copy_from_slice(&parts[c][range.clone()]);
        for k in 1..r {
            round_to_wire(dst, wire);
            let src = &parts[(c + k) % r][range.clone()];
            for (d, s) in dst.iter_mut().zip(src) {
                *d += *s;
            }
        }
        if r > 1 {
            round_to_wire(dst, wire);
        }
    }
    out
}
