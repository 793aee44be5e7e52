//! Where a plan's workers run: the hosts a command names (`--hosts NAME:WORKERS,...`, or a
//! cluster file's ranks), read and checked before anything is measured, and joined by the
//! link between them into the planner's [`Hosts`].

use pipe_scheduler::planner::placement::{Hosts, MAX_HOSTS};
use pipe_scheduler::sim::Link;
use pipe_transport::cluster::ClusterFile;
use std::path::PathBuf;

use crate::error::{Result, StageError};

/// The flags that place a plan's workers on hosts ([`pipe_scheduler::planner::placement`]).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct HostChoice {
    /// Place the workers on hosts, each taking a number of them, filled in pipeline order:
    /// NAME:WORKERS,... Links inside a host are charged as `--transport` (default shm);
    /// links between hosts as QUIC over the network `--bandwidth` and `--latency` describe.
    #[arg(long, value_name = "NAME:WORKERS,...", conflicts_with = "cluster")]
    pub hosts: Option<String>,
    /// Place the workers as a cluster file's ranks are (`pipe cluster init`): ranks whose
    /// addresses name one host share it.
    #[arg(long, value_name = "FILE")]
    pub cluster: Option<PathBuf>,
}

impl HostChoice {
    /// Whether a placement was asked for.
    pub fn given(&self) -> bool {
        self.hosts.is_some() || self.cluster.is_some()
    }

    /// The hosts asked for, read and checked before anything is measured; `None` when no
    /// placement was asked for.
    ///
    /// # Errors
    /// Bad input for a malformed host list or cluster file.
    pub fn parse(&self) -> Result<Option<HostList>> {
        if let Some(list) = &self.hosts {
            return Ok(Some(HostList::Filled(parse_hosts(list)?)));
        }
        let Some(path) = &self.cluster else {
            return Ok(None);
        };
        let cluster = ClusterFile::load(path).map_err(|e| StageError::Config(e.to_string()))?;
        Ok(Some(HostList::Ranks(
            cluster
                .workers
                .iter()
                .map(|w| host_of_address(&w.addr))
                .collect(),
        )))
    }
}

/// Hosts as the flags give them, before the link between them is known.
#[derive(Clone, Debug)]
pub enum HostList {
    /// `--hosts`: each host's name and how many workers it takes.
    Filled(Vec<(String, u32)>),
    /// `--cluster`: the host of each rank.
    Ranks(Vec<String>),
}

impl HostList {
    /// These hosts, joined by `between`.
    pub fn joined_by(&self, between: Link) -> Hosts {
        match self {
            HostList::Filled(hosts) => Hosts::filled(hosts, between),
            HostList::Ranks(ranks) => Hosts::of_ranks(ranks, between),
        }
    }
}

/// The host part of `host:port` (an IPv6 address in brackets loses them).
fn host_of_address(addr: &str) -> String {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .to_string()
}

/// `NAME:WORKERS,...` as (name, workers) pairs.
///
/// # Errors
/// Bad input naming the entry that is not `NAME:WORKERS` with a count of 1 to 4096, or a
/// list of more than [`MAX_HOSTS`] entries or 4096 workers in all.
fn parse_hosts(list: &str) -> Result<Vec<(String, u32)>> {
    let entries: Vec<&str> = list.split(',').collect();
    if entries.len() > MAX_HOSTS {
        return Err(StageError::Config(format!(
            "--hosts lists {} hosts, more than {MAX_HOSTS}",
            entries.len()
        )));
    }
    let mut hosts = Vec::with_capacity(entries.len());
    let mut total = 0u32;
    for entry in entries {
        let parsed = entry.rsplit_once(':').and_then(|(name, n)| {
            let n: u32 = n.trim().parse().ok()?;
            let name = name.trim();
            (!name.is_empty() && (1..=4096).contains(&n)).then(|| (name.to_string(), n))
        });
        let Some((name, n)) = parsed else {
            return Err(StageError::Config(format!(
                "--hosts entry '{entry}' is not NAME:WORKERS (a name, and 1 to 4096 workers)"
            )));
        };
        total = total.saturating_add(n);
        hosts.push((name, n));
    }
    if total > 4096 {
        return Err(StageError::Config(format!(
            "--hosts places {total} workers, more than 4096"
        )));
    }
    Ok(hosts)
}
