//! The runtime layer (this folder). The pipelined runtime: a checked plan ([`RunPlan`]), the
//! worker core that runs one worker's program ([`exec`]), the worker driver that connects it
//! to a backend and a transport ([`driver::run_worker`]; between worker processes of one host
//! it lends device buffers rather than copying them through host memory, [`loans`]), the
//! in-process launcher that runs
//! every worker as a thread ([`launch::run_threads`]), the launcher that runs every worker as
//! a process ([`processes::run_processes`]), one worker of a run whose others are in other
//! processes ([`worker::train_worker`]), the sequential reference trainer that follows a
//! version plan literally, and the run's lifecycle: one segment loop ([`train`]) over three
//! coordinators (threads, worker processes, and delayed SGD on one worker, [`delayed`]), with
//! what lets a run survive faults: a lost replica's stage going on with one replica fewer
//! ([`survive`]) and a failed run starting again from its newest checkpoint ([`restart`]),
//! both driven for threads and processes alike by one driver ([`relaunch`]), and a worker's
//! program resumed at a step boundary from its stage's kept state ([`resume`]) or, in a worker
//! process, going on where it stood while its endpoint regroups under it ([`in_place`]). The stale weights
//! a delay compensation measures an update against are worked out in one place ([`stale`]),
//! and the gradient norms that clipping adds across stages in another ([`clip`]).
//!
//! The seams are shaped for every place a worker can run. The driver takes a rank, a backend,
//! a transport endpoint and the checked plan, and nothing else; a launcher only starts
//! drivers (threads here; one process per worker or one host per worker later, calling the
//! same driver). The core ([`exec::WorkerCore`]) makes every decision (which weight version a
//! pass uses, when a stashed version is freed, what a message carries) without reading a clock
//! or touching a transport, so it is driven by the driver at run time and directly by tests.
//!
//! There is no schedule-specific code here: the core interprets actions, picks weight versions
//! by the policy's [`VersionRule`](pipe_scheduler::VersionRule) from its own state and the
//! tags messages carry, and frees stashed versions once the plan says nothing pending needs
//! them. Every forward and backward records the version it actually used, so a run's log can be
//! compared with the plan, and the final weights with the reference trainer's.

pub mod adopt;
pub mod allreduce;
pub mod between;
pub mod clip;
mod clock;
pub mod delayed;
pub mod doctor;
pub mod driver;
pub mod exec;
pub mod fields;
pub mod in_place;
pub mod launch;
pub mod ledger;
pub mod loans;
pub mod observe;
pub mod processes;
pub mod recover;
pub mod reference;
pub mod relaunch;
pub mod restart;
pub mod resume;
pub mod rollback;
pub mod run_plan;
pub mod setup;
pub mod stale;
pub mod survive;
pub mod takeover;
pub mod trace_parts;
pub mod train;
pub mod worker;

pub use crate::partition::Partition;
pub use allreduce::{
    BucketedAllReduce, DEFAULT_BUCKET_SIZE, DEVICE_SUM_STEP, GradientBucket, all_reduce_gradients,
    all_reduce_on_devices, gradient_buckets, last_backwards,
};
pub use driver::{resume_worker, run_worker, run_worker_with};
pub use exec::{Pass, StageState, VersionRecord, WorkerOutcome, WorkerState};
pub use launch::{run_threads, run_threads_resumed};
pub use ledger::LedgerEntry;
pub use observe::{Observer, PhaseRecord, Quiet, StartPhase};
pub use reference::{ReferenceRun, reference_run, reference_train, reference_train_from};
pub use run_plan::RunPlan;
pub use setup::{LrFn, MicrobatchSource, OrderedSource, Report, Setup};
pub use train::{
    PipelineReport, PipelineTrainOptions, initial_params, open_backend, run_partition,
    train_pipelined, train_reference, train_reference_with, write_seed_checkpoint,
};
pub use worker::train_worker;
