//! `pipe-scheduler` will own planning, and only planning: layer profiles, the partitioner,
//! schedules as data (per-worker action lists for every policy), their version plans, validation,
//! the timed simulator and timeline exports. It is pure by design (no tensors, no threads, no
//! I/O, no clock) so that every schedule can be generated, checked and simulated
//! deterministically in tests and planned in microseconds, before any worker starts.
//!
//! Nothing is here yet; the scheduler issue fills it in. It depends on no other workspace crate.

#![warn(missing_docs)]
