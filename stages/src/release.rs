//! Returning freed memory to the operating system at a run's quiet points.
//!
//! The allocator is the binary's to choose: `pipe` uses mimalloc, which keeps freed memory for
//! reuse a while (ten seconds there) before it returns it. What the library knows is when a
//! stretch of work has let go of what it held and will not want it again soon:
//! - an epoch's end, once its drain, evaluation and checkpoint are done: the segment's rollback
//!   points and traffic log, the chief's gathered state, its evaluation batches and its
//!   checkpoint's bytes;
//! - a replacement's rejoin: the lost replica's program its adopter ran, and the survivors'
//!   mesh of the short layout.
//!
//! Memory freed there and kept for the allocator's delay stayed resident beside what the next
//! stretch allocated, which the allocator met partly with fresh pages: a worker process's
//! resident memory rose by 5-15% for ten seconds after every epoch's end
//! (`docs/reliability.md`, "Memory over rejoin cycles"). The binary registers how to return it
//! ([`register`]); where nothing is registered (the library's tests, another binary), [`now`]
//! does nothing.

use std::sync::OnceLock;

static RELEASE: OnceLock<fn()> = OnceLock::new();

/// Registers `release`, which returns the memory the process's allocator holds freed to the
/// operating system; the first registration stands.
pub fn register(release: fn()) {
    let _ = RELEASE.set(release);
}

/// Returns the memory the process holds freed to the operating system, where the binary
/// registered how ([`register`]).
pub fn now() {
    if let Some(release) = RELEASE.get() {
        release();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    static FIRST: AtomicUsize = AtomicUsize::new(0);
    static SECOND: AtomicUsize = AtomicUsize::new(0);

    fn first() {
        FIRST.fetch_add(1, Ordering::SeqCst);
    }

    fn second() {
        SECOND.fetch_add(1, Ordering::SeqCst);
    }

    #[test]
    fn now_calls_the_first_registration_only() {
        super::register(first);
        super::register(second);
        let before = FIRST.load(Ordering::SeqCst);
        super::now();
        assert!(FIRST.load(Ordering::SeqCst) > before);
        assert_eq!(SECOND.load(Ordering::SeqCst), 0);
    }
}
