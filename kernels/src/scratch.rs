//! Each thread's reusable scratch buffer: the transposed products' intermediate in
//! `cpu.rs` and attention's per-sequence buffers in `sequence.rs` borrow it between kernels
//! (never inside one another), so neither allocates, and page-faults, a fresh buffer per call.

use std::cell::Cell;

thread_local! {
    /// The calling thread's scratch. Whoever takes it puts it back; every element a kernel
    /// reads from it, it has written first.
    pub(crate) static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Runs `f` on `len` elements of this thread's [`SCRATCH`]. Its contents are left from
/// earlier calls: `f` writes every element before it reads it.
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut buf = SCRATCH.with(Cell::take);
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    let out = f(&mut buf[..len]);
    SCRATCH.with(|cell| cell.set(buf));
    out
}
