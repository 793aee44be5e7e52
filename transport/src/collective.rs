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

use crate::{Key, Kind, Message, Transport, TransportError};

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

/// [`ring_all_reduce`] of the concatenation of `segments`, without concatenating them: the
/// ring's chunks are ranges of the virtual flat buffer, copied out of the segments they span
/// when sent and added into them when received. A stage's gradient tensors are reduced where
/// they live, with exactly the bare ring's copies, messages and additions, and the result is
/// [`ring_sum`] of the replicas' concatenations. One chunk buffer is passed around: each
/// received chunk's buffer carries the next chunk this worker sends, and the last one received
/// is kept by the calling thread for its next all-reduce, so that the steady state allocates
/// nothing (a fresh buffer of a 4-million-value stage's chunk page-faulted 2,000 pages a call).
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
    let r = group.len();
    if r <= 1 {
        return Ok(());
    }
    let me = t.rank();
    let i = group.iter().position(|&w| w == me).ok_or_else(|| {
        TransportError::Protocol(format!("worker {me} is not in all-reduce group {group:?}"))
    })?;
    let (next, prev) = (group[(i + 1) % r], group[(i + r - 1) % r]);
    let mut flat = Segments::new(segments);
    let len = flat.len();
    let mut spare: Vec<f32> = CHUNK_BUFFER.with(std::cell::Cell::take);
    for step in 0..2 * (r - 1) {
        let k = step % (r - 1);
        let gather = step >= r - 1;
        let (send_c, recv_c) = if gather {
            ((i + 1 + r - k) % r, (i + r - k) % r)
        } else {
            ((i + r - k) % r, (i + 2 * r - k - 1) % r)
        };
        spare.clear();
        flat.copy_out(chunk(len, r, send_c), &mut spare);
        let n = spare.len();
        let tensor = Tensor::from_vec(&[n], std::mem::take(&mut spare))
            .map_err(|e| TransportError::Protocol(format!("chunk tensor: {e}")))?;
        let key = |from: u32, to: u32| Key {
            from,
            to,
            kind: Kind::Chunk,
            stage,
            index: update,
            step: step as u32,
        };
        t.send(Message {
            key: key(me, next),
            version: 0,
            tensor,
        })?;
        let got = t.recv(&key(prev, me))?;
        let range = chunk(len, r, recv_c);
        let src = got
            .tensor
            .host()
            .map_err(|e| TransportError::Protocol(format!("all-reduce chunk: {e}")))?;
        if src.len() != range.len() {
            return Err(TransportError::Protocol(format!(
                "all-reduce chunk of {} values where {} were expected",
                src.len(),
                range.len()
            )));
        }
        flat.merge_in(range, src, gather);
        // The received buffer carries the next send (a host tensor gives its Vec back).
        spare = got.tensor.into_host_vec().unwrap_or_default();
    }
    CHUNK_BUFFER.with(|cell| cell.set(spare));
    Ok(())
}

thread_local! {
    /// The calling thread's chunk buffer between all-reduces (see
    /// [`ring_all_reduce_segments`]).
    static CHUNK_BUFFER: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
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
            let src = &parts[(c + k) % r][range.clone()];
            for (d, s) in dst.iter_mut().zip(src) {
                *d += *s;
            }
        }
    }
    out
}
