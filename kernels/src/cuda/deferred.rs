//! Checks the CUDA backend queues without waiting for them: the token ids of an embedding.
//!
//! A bad token id must still be an error that names its position, as on the CPU. Waiting for
//! the check's flag at every embedding call would stop the host from queueing ahead at every
//! microbatch of a first stage (twice: forward and backward), and a step with such a wait
//! cannot be captured as a CUDA graph. So the check's kernel is queued, its flag is kept here
//! with the ids it read, and the flags are read at the backend's next wait for its stream,
//! which comes at least once an update (the finiteness guard, a loss's statistics, a read of
//! the weights) and before any value leaves the device. Until then the embedding's kernels
//! skip a bad id (`token_row` in kernels.cu): it is never read or written past the table.
//!
//! The ids of a microbatch serve the embedding's forward and its backward: their content stamp
//! ([`Tensor::stamp`]) is remembered once queued, so they are checked once.

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

use crate::Tensor;

/// Checks kept unread at most: the next one waits and reads them all (a stage with many
/// microbatches in flight and no wait between them still holds a bounded list).
pub(crate) const MAX_PENDING: usize = 64;

/// How many checked id tensors are remembered (a pipeline stage holds a few microbatches in
/// flight).
const REMEMBERED: usize = 64;

/// One queued check: its flag (`u32::MAX`, or the first bad index once the kernel ran), the
/// ids it read (held so that a bad value can be read back), and the table's rows.
#[derive(Debug)]
pub(crate) struct PendingIds {
    /// The scratch tensor holding the flag (kept alive until it is read).
    pub(crate) flag: Tensor,
    /// The ids the check read.
    pub(crate) ids: Tensor,
    /// The table's rows: an id must be a whole number below it.
    pub(crate) vocab: usize,
}

/// The queued checks and the id tensors already checked (or queued).
#[derive(Debug, Default)]
pub(crate) struct DeferredChecks {
    pending: Mutex<Vec<PendingIds>>,
    checked: Mutex<VecDeque<(u64, usize)>>,
}

impl DeferredChecks {
    /// Whether ids with content stamp `stamp` were checked (or queued) against `vocab` rows.
    pub(crate) fn checked(&self, stamp: u64, vocab: usize) -> bool {
        self.checked
            .lock()
            .is_ok_and(|c| c.contains(&(stamp, vocab)))
    }

    /// Keeps a queued check; true when the list is full and should be read now.
    pub(crate) fn push(&self, check: PendingIds) -> bool {
        let key = (check.ids.stamp(), check.vocab);
        if let Ok(mut checked) = self.checked.lock() {
            if checked.len() == REMEMBERED {
                checked.pop_front();
            }
            checked.push_back(key);
        }
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        pending.push(check);
        pending.len() >= MAX_PENDING
    }

    /// The queued checks, in the order they were queued, leaving none.
    pub(crate) fn take(&self) -> Vec<PendingIds> {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Forgets every checked stamp (after a failed check: ids that failed are checked again
    /// if they come back).
    pub(crate) fn forget(&self) {
        if let Ok(mut checked) = self.checked.lock() {
            checked.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(ids: &Tensor, vocab: usize) -> PendingIds {
        PendingIds {
            flag: Tensor::default(),
            ids: ids.clone(),
            vocab,
        }
    }

    #[test]
    fn queued_ids_count_as_checked_until_forgotten() {
        let checks = DeferredChecks::default();
        let ids = Tensor::from_vec(&[2], vec![1.0, 2.0]).unwrap();
        assert!(!checks.checked(ids.stamp(), 10));
        assert!(!checks.push(pending(&ids, 10)));
        assert!(checks.checked(ids.stamp(), 10));
        // Another table, or other contents, is another check.
        assert!(!checks.checked(ids.stamp(), 11));
        let other = Tensor::from_vec(&[2], vec![1.0, 2.0]).unwrap();
        assert!(!checks.checked(other.stamp(), 10));
        assert_eq!(checks.take().len(), 1);
        assert!(checks.take().is_empty());
        assert!(checks.checked(ids.stamp(), 10));
        checks.forget();
        assert!(!checks.checked(ids.stamp(), 10));
    }

    #[test]
    fn a_full_list_asks_to_be_read() {
        let checks = DeferredChecks::default();
        let ids = Tensor::from_vec(&[1], vec![0.0]).unwrap();
        for i in 1..MAX_PENDING {
            assert!(!checks.push(pending(&ids, i)), "{i}");
        }
        assert!(checks.push(pending(&ids, MAX_PENDING)));
        assert_eq!(checks.take().len(), MAX_PENDING);
    }
}
