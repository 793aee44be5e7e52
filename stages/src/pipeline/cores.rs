//! Core tokens: at most `cores` workers of a process compute at once, served in arrival order.
//!
//! An in-process run puts 4 to 8 worker threads on a 2-core machine. Left to the operating
//! system, every runnable worker gets slices of a core: an action is cut into pieces, a woken
//! worker waits for its next slice, and the workers evict each other's caches. That was the
//! largest gap between measured runs and the simulator, which assumed smooth processor
//! sharing. With a gate, a worker takes a token before each compute action (forward, backward
//! halves, update) and returns it after, so each action runs to completion on a core, and the
//! tokens go out first come, first served. Waiting for a message or an all-reduce holds no
//! token (a peer may need one to send it). The simulator models the same discipline
//! ([`pipe_scheduler::CoreSharing::Queue`]).

use std::sync::{Condvar, Mutex, PoisonError};

/// A first-come, first-served counting semaphore of compute tokens.
#[derive(Debug)]
pub struct CoreGate {
    state: Mutex<Tickets>,
    turn: Condvar,
}

#[derive(Debug)]
struct Tickets {
    free: usize,
    /// The next ticket handed out.
    next: u64,
    /// The oldest ticket not yet served.
    head: u64,
}

/// A held token; dropping it gives the token back (also when the action fails or panics).
#[derive(Debug)]
pub struct CoreToken<'a> {
    gate: &'a CoreGate,
}

impl CoreGate {
    /// A gate with `cores` tokens (at least one).
    pub fn new(cores: usize) -> Self {
        CoreGate {
            state: Mutex::new(Tickets {
                free: cores.max(1),
                next: 0,
                head: 0,
            }),
            turn: Condvar::new(),
        }
    }

    /// Waits for a token, after every earlier caller got theirs.
    pub fn acquire(&self) -> CoreToken<'_> {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let mine = s.next;
        s.next += 1;
        while !(s.head == mine && s.free > 0) {
            s = self.turn.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        s.free -= 1;
        s.head += 1;
        drop(s);
        // The next in line may find a token free too.
        self.turn.notify_all();
        CoreToken { gate: self }
    }
}

impl Drop for CoreToken<'_> {
    fn drop(&mut self) {
        let mut s = self
            .gate
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        s.free += 1;
        drop(s);
        self.gate.turn.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn never_more_holders_than_tokens() {
        let gate = CoreGate::new(2);
        let holding = AtomicUsize::new(0);
        let most = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..6 {
                s.spawn(|| {
                    for _ in 0..200 {
                        let _t = gate.acquire();
                        let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::hint::spin_loop();
                        holding.fetch_sub(1, Ordering::SeqCst);
                    }
                });
            }
        });
        assert_eq!(most.load(Ordering::SeqCst), 2);
    }
}
