//! `pipe-stages` owns compute: layers, models, losses, optimizers, data, the training loops and
//! run metrics. It is shaped around one decision: **parameters live outside layers**. A layer is
//! configuration plus forward and two-part backward code; a model is an ordered list of named
//! layers; parameters are plain tensor lists passed in on every call. So a pipeline stage that
//! keeps several weight versions (weight stashing) just hands the version its version plan names
//! to the same code, and the sequential reference trainer can keep every version side by side.
//!
//! A run starts as [`config::TrainSettings`] (flags, a TOML file and a plan file merged) and is
//! checked once into a [`config::RunConfig`]. It trains with every worker a thread of this
//! process ([`pipeline::train_pipelined`]; a run with no pipeline flag is one worker running
//! the whole model under `sequential`), or as one worker of a run spread over processes or
//! hosts ([`pipeline::train_worker`]); both go through one segment loop, and so does the
//! staleness experiment's data-parallel baseline with delayed gradients
//! ([`delayed::train_delayed`]). The executor, the sequential reference trainer
//! ([`pipeline::reference`]) and the remedies for stale weights ([`remedy`]) build on the same
//! model and layer API, and so does the profiler ([`profile`]), which times layers alone and
//! then on the executor itself, so the cuts of [`planning`] and [`partition`] are made from what
//! the runtime really pays. Runs save and resume through [`checkpoint`], whose files are keyed by
//! parameter name, so a checkpoint does not depend on the partition that wrote it. Every size a
//! user or a peer controls is checked against [`limits`] before anything is allocated, and a
//! stalled pipeline is explained by the hang doctor ([`pipeline::doctor`]).

#![warn(missing_docs)]

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod delayed;
mod error;
pub mod layer;
pub mod layers;
pub mod limits;
pub mod log;
pub mod loss;
pub mod model;
pub mod optim;
pub mod partition;
pub mod pipeline;
pub mod planning;
pub mod profile;
pub mod remedy;
pub mod rng;
pub mod sample;
pub mod train;
pub mod transformer;

pub use error::{Result, StageError};
