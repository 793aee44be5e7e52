//! `pipe-stages` owns compute: layers, models, losses, optimizers, data, the training loops and
//! run metrics. It is shaped around one decision: **parameters live outside layers**. A layer is
//! configuration plus forward and two-part backward code; a model is an ordered list of named
//! layers; parameters are plain tensor lists passed in on every call. So a pipeline stage that
//! keeps several weight versions (weight stashing) just hands the version its version plan names
//! to the same code, and the sequential reference trainer can keep every version side by side.
//!
//! The source has one folder per layer: [`model`] (what is computed), [`pipeline`] (the runtime
//! that runs it on workers) and [`planning`] (profiling and cutting), with the run's settings
//! ([`config`]), its files ([`checkpoint`]) and its cut ([`partition`]) between them. Imports
//! run one way: model below config, config below pipeline, pipeline below planning (the order
//! of the `mod` lines below).
//!
//! A run starts as [`config::TrainSettings`] (flags, a TOML file and a plan file merged) and is
//! checked once into a [`config::RunConfig`], the typed run every layer below takes and worker
//! processes are handed (as JSON, checked again when read). It trains with every worker a thread of this
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
//! user or a peer controls is checked against [`limits`] before anything is allocated, a
//! directory a command writes whole appears whole or not at all ([`outputs`]), and a
//! stalled pipeline is explained by the hang doctor ([`pipeline::doctor`]).

#![warn(missing_docs)]

// The run's edge: settings typed once, the limits every size is checked against, errors, and
// what every trainer reports.
// Modules in layers, each importing only those listed before it:
// error, limits, contain (a library's panic on a user's input made an error), cache
// (measurements kept on disk), outputs (directories written whole),
// release (freed memory returned at a run's quiet points); model (what is computed); partition (a model cut into stages); remedy;
// config (the run, checked); checkpoint (a run saved); train (data, evaluation and what a run
// reports); pipeline (how workers run it); planning (how it is cut, measured on the
// pipeline); log (an observer for the binary). `docs/architecture.md` says why.
pub mod cache;
pub mod checkpoint;
pub mod config;
pub mod contain;
mod error;
pub mod inspect;
pub mod limits;
pub mod log;
pub mod model;
pub mod outputs;
pub mod partition;
pub mod pipeline;
pub mod planning;
pub mod release;
pub mod remedy;
pub mod startup;
pub mod train;

// Each layer's modules by their short paths, so that `crate::optim` names the same module as
// `model::optim`.
pub use model::{
    data, documents, hf, layer, layers, loss, optim, rng, sample, shards, tokenize, tokenizer,
    transformer,
};
pub use pipeline::delayed;
pub use planning::profile;

pub use error::{Result, StageError};
