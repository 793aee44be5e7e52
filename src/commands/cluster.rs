//! `pipe cluster init`: a cluster's credentials and `cluster.toml` (`pipe_transport::cluster`).

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Subcommand};
use pipe_transport::cluster::{ClusterFile, Existing, MAX_WORKERS};

use crate::output::bad_input;

/// `pipe cluster ...`.
#[derive(Subcommand, Debug)]
pub enum ClusterCommand {
    /// Create a cluster CA, one certificate and key per rank, and cluster.toml in a directory.
    Init(InitArgs),
}

/// `pipe cluster init`.
#[derive(Args, Debug)]
pub struct InitArgs {
    /// Workers (ranks).
    #[arg(long)]
    workers: u32,
    /// Output directory.
    #[arg(short = 'o', long = "out")]
    out: PathBuf,
    /// Each rank's address, `host:port`, comma-separated in rank order (default: loopback,
    /// ports from --base-port up).
    #[arg(long, value_delimiter = ',')]
    addrs: Vec<String>,
    /// First port when --addrs is not given.
    #[arg(long, default_value_t = 29400)]
    base_port: u16,
    /// Replace an existing cluster's directory whole (its old credentials stop working on
    /// every worker they were deployed to); a directory holding anything else is refused.
    #[arg(long)]
    force: bool,
}

/// Runs `pipe cluster ...`.
///
/// # Errors
/// Bad input for impossible worker counts or address lists; unwritable files.
pub fn run(cmd: &ClusterCommand) -> Result<()> {
    let ClusterCommand::Init(args) = cmd;
    pipe_stages::outputs::check_output_dir(&args.out, "--out")?;
    if args.workers == 0 || args.workers > MAX_WORKERS {
        return Err(bad_input(format!(
            "--workers {}: a cluster has 1 to {MAX_WORKERS} workers",
            args.workers
        )));
    }
    if args.addrs.is_empty() && args.base_port == 0 {
        return Err(bad_input(
            "--base-port 0: port 0 means any free port, and the ranks after it would take \
             ports 1, 2, ...: give the first port of a free range"
                .into(),
        ));
    }
    let addrs: Vec<String> = if args.addrs.is_empty() {
        (0..args.workers)
            .map(|r| {
                let port = u32::from(args.base_port) + r;
                u16::try_from(port)
                    .map(|p| format!("127.0.0.1:{p}"))
                    .map_err(|_| {
                        bad_input(format!(
                            "--base-port {}: rank {r} would need port {port}",
                            args.base_port
                        ))
                    })
            })
            .collect::<Result<_>>()?
    } else {
        args.addrs.clone()
    };
    if addrs.len() != args.workers as usize {
        return Err(bad_input(format!(
            "--addrs names {} addresses for {} workers",
            addrs.len(),
            args.workers
        )));
    }
    let run_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id()).rotate_left(32);
    let existing = if args.force {
        Existing::Replace
    } else {
        Existing::Refuse
    };
    let file = ClusterFile::init(&args.out, &addrs, run_id, existing).map_err(|e| match e {
        pipe_transport::TransportError::BadFile(m) => bad_input(m),
        other => other.into(),
    })?;
    outln!(
        "cluster of {} workers (run {:#x}) in {}: ca.pem, rank-K.pem, rank-K.key (owner-only), cluster.toml",
        file.size(),
        file.run_id,
        args.out.display()
    );
    Ok(())
}
