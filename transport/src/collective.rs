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
    let r = group.len();
    if r <= 1 {
        return Ok(());
    }
    let me = t.rank();
    let i = group.iter().position(|&w| w == me).ok_or_else(|| {
        TransportError::Protocol(format!("worker {me} is not in all-reduce group {group:?}"))
    })?;
    let next = group[(i + 1) % r];
    let prev = group[(i + r - 1) % r];
    let len = data.len();
    for step in 0..2 * (r - 1) {
        let k = step % (r - 1);
        let gather = step >= r - 1;
        let (send_c, recv_c) = if gather {
            ((i + 1 + r - k) % r, (i + r - k) % r)
        } else {
            ((i + r - k) % r, (i + 2 * r - k - 1) % r)
        };
        let out = data[chunk(len, r, send_c)].to_vec();
        let n = out.len();
        let tensor = Tensor::from_vec(&[n], out)
            .map_err(|e| TransportError::Protocol(format!("chunk tensor: {e}")))?;
        t.send(Message {
            key: Key {
                from: me,
                to: next,
                kind: Kind::Chunk,
                stage,
                index: update,
                step: step as u32,
            },
            version: 0,
            tensor,
        })?;
        let got = t.recv(&Key {
            from: prev,
            to: me,
            kind: Kind::Chunk,
            stage,
            index: update,
            step: step as u32,
        })?;
        let dst = &mut data[chunk(len, r, recv_c)];
        let src = got
            .tensor
            .host()
            .map_err(|e| TransportError::Protocol(format!("all-reduce chunk: {e}")))?;
        if src.len() != dst.len() {
            return Err(TransportError::Protocol(format!(
                "all-reduce chunk of {} values where {} were expected",
                src.len(),
                dst.len()
            )));
        }
        if gather {
            dst.copy_from_slice(src);
        } else {
            for (d, s) in dst.iter_mut().zip(src) {
                *d += *s;
            }
        }
    }
    Ok(())
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
