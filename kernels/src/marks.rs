//! Marks in a backend's queue of work ([`Backend::mark`](crate::Backend::mark)): the time a
//! device passed a point of its queue, read later, so that a caller can time what it queued
//! without waiting for it at once.
//!
//! A device backend computes asynchronously: timing an operation by the host's clock needs a
//! wait for the device after it ([`Backend::synchronize`](crate::Backend::synchronize)), and
//! the host then queues nothing until the device has drained its queue. A pipelined worker
//! that times every action that way keeps its stream empty between actions. With marks, it
//! queues a mark before and after each action and reads their times when they have passed.
//! The CUDA backend's marks are CUDA events; the emulated device's are the host's clock at the
//! mark (it computes as it is called), so the code that reads marks runs without a GPU.

use std::any::Any;
use std::fmt;
use std::time::Instant;

use crate::{KernelError, Result};

/// A point in one backend's queue of work.
pub trait DeviceMark: Send + fmt::Debug {
    /// Whether the device has passed this mark. Never waits.
    ///
    /// # Errors
    /// Device failures reported by the work queued before the mark.
    fn passed(&self) -> Result<bool>;

    /// Seconds from `origin`, an earlier mark of the same backend, to this one. Waits until
    /// the device has passed this mark.
    ///
    /// # Errors
    /// An `origin` of another backend or kind; device failures.
    fn seconds_since(&self, origin: &dyn DeviceMark) -> Result<f64>;

    /// The mark as [`Any`], for the downcast of an `origin`.
    fn as_any(&self) -> &dyn Any;
}

/// A mark of a backend that computes as it is called: the host's clock at the call.
#[derive(Clone, Copy, Debug)]
pub struct HostMark(pub Instant);

impl DeviceMark for HostMark {
    fn passed(&self) -> Result<bool> {
        Ok(true)
    }

    fn seconds_since(&self, origin: &dyn DeviceMark) -> Result<f64> {
        let origin = origin
            .as_any()
            .downcast_ref::<HostMark>()
            .ok_or_else(|| foreign_origin("a host mark", origin))?;
        Ok(self.0.saturating_duration_since(origin.0).as_secs_f64())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The error for an origin of another kind than the mark read from it.
pub(crate) fn foreign_origin(kind: &str, origin: &dyn DeviceMark) -> KernelError {
    KernelError::Mark {
        detail: format!("{kind} read from an origin of another backend: {origin:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_marks_count_seconds_from_their_origin_and_refuse_another_kind() {
        #[derive(Debug)]
        struct Other;
        impl DeviceMark for Other {
            fn passed(&self) -> Result<bool> {
                Ok(false)
            }
            fn seconds_since(&self, _: &dyn DeviceMark) -> Result<f64> {
                Ok(0.0)
            }
            fn as_any(&self) -> &dyn Any {
                self
            }
        }
        let origin = HostMark(Instant::now());
        let later = HostMark(origin.0 + std::time::Duration::from_millis(250));
        assert!(later.passed().unwrap());
        assert!((later.seconds_since(&origin).unwrap() - 0.25).abs() < 1e-9);
        assert_eq!(origin.seconds_since(&later).unwrap(), 0.0);
        let err = later.seconds_since(&Other).unwrap_err().to_string();
        assert!(err.contains("another backend"), "{err}");
    }
}
