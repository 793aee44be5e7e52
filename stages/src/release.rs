//! Returning freed memory to the operating system at a run's quiet points.
//!
//! The allocator is the binary's to choose: `pipe` uses mimalloc, which keeps freed memory for
//! reuse a while (ten seconds there) before it returns it. What the library knows is when a
//! stretch of work has let go of what it held and will not want it again soon:
//! - an epoch's end, once its drain, evaluation and checkpoint are done: the chief's gathered
//!   state, its evaluation batches and its checkpoint's bytes, and in process, the segment's
//!   rollback points and traffic log (a worker process keeps those for its next segment). The
//!   next epoch's end wants their like again an epoch later, so only an epoch that lasted
//!   longer than the allocator holds freed memory gains by it ([`after`]); a shorter one's
//!   successor reuses it before the allocator would have returned it, and releasing it would
//!   only fault it in again (300 epochs of 3 ms each ran 35% slower for it);
//! - a replacement's rejoin: the lost replica's program its adopter ran, and the survivors'
//!   mesh of the short layout ([`now`]).
//!
//! Memory freed there and kept for the allocator's delay stayed resident beside what the next
//! stretch allocated, which the allocator met partly with fresh pages: a worker process's
//! resident memory rose by 2-15% for ten seconds after every epoch's end
//! (`docs/reliability.md`, "Memory over rejoin cycles"). The binary registers how to return it
//! ([`register`]); where nothing is registered (the library's tests, another binary), nothing
//! happens.

use std::sync::OnceLock;
use std::time::Duration;

/// How the binary returns freed memory, and how long its allocator holds freed memory
/// otherwise.
struct Release {
    release: fn(),
    holds: Duration,
}

static RELEASE: OnceLock<Release> = OnceLock::new();

/// Registers `release`, which returns the memory the process's allocator holds freed to the
/// operating system, whose allocator otherwise holds freed memory for `holds`; the first
/// registration stands.
pub fn register(release: fn(), holds: Duration) {
    let _ = RELEASE.set(Release { release, holds });
}

/// Returns the memory the process holds freed to the operating system, where the binary
/// registered how ([`register`]).
pub fn now() {
    if let Some(r) = RELEASE.get() {
        (r.release)();
    }
}

/// As [`now`], after a stretch of work that `lasted` and whose like comes next: only where it
/// lasted longer than the allocator holds freed memory.
pub fn after(lasted: Duration) {
    if let Some(r) = RELEASE.get()
        && lasted > r.holds
    {
        (r.release)();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    static FIRST: AtomicUsize = AtomicUsize::new(0);
    static SECOND: AtomicUsize = AtomicUsize::new(0);

    fn first() {
        FIRST.fetch_add(1, Ordering::SeqCst);
    }

    fn second() {
        SECOND.fetch_add(1, Ordering::SeqCst);
    }

    /// One test: the registration is the process's, once.
    #[test]
    fn the_first_registration_is_called_now_and_after_stretches_longer_than_it_holds() {
        let hour = Duration::from_secs(3600);
        super::register(first, hour);
        super::register(second, Duration::ZERO);
        let calls = || FIRST.load(Ordering::SeqCst);
        let before = calls();
        super::now();
        assert_eq!(calls(), before + 1);
        super::after(hour / 2);
        super::after(hour);
        assert_eq!(calls(), before + 1);
        super::after(hour * 2);
        assert_eq!(calls(), before + 2);
        assert_eq!(SECOND.load(Ordering::SeqCst), 0);
    }
}
