//! One module per `pipe` command: its arguments and the code that runs it. A command uses
//! [`crate::args`], [`crate::output`] and [`crate::training`], never another command.

pub mod bench;
pub mod cluster;
pub mod doctor;
pub mod eval;
pub mod experiment;
pub mod export;
pub mod logits;
pub mod plan;
pub mod profile;
pub mod sample;
pub mod schedule;
pub mod simulate;
pub mod sweep;
pub mod tokenize;
pub mod train;
pub mod worker;
