//! `pipe-transport` will own moving tensors between workers: one `Transport` trait with an
//! in-process implementation (crossbeam channels moving owned buffers) and a QUIC one (quinn,
//! mutual TLS), collectives written once over the trait (ring all-reduce), and NCCL behind the
//! `cuda` feature. Decoding never trusts a peer: sizes are checked against the header before any
//! allocation.
//!
//! Nothing is here yet; the pipeline-runtime issue fills it in. It depends only on
//! `pipe-kernels`, for tensors.

#![warn(missing_docs)]
