//! What a command charges a pipeline's links: the measured costs of the transport that will
//! carry them ([`pipe_stages::startup::link_costs`]), read from pipe's cache or from a cost file, or
//! measured now and cached. `pipe plan`, `pipe simulate` and `pipe train --workers` share it.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;
use pipe_scheduler::planner::placement::{Hosts, MAX_HOSTS};
use pipe_scheduler::planner::transport::{TransportCost, TransportCosts};
use pipe_scheduler::sim::Link;
use pipe_transport::TransportKind;
use pipe_transport::cluster::ClusterFile;

use crate::output::bad_input;

/// The flags that choose a link's transport costs.
#[derive(Args, Debug, Clone, Default)]
pub struct LinkArgs {
    /// Charge each link the processor time this transport's messages take on this machine
    /// (any registered transport: inproc, shm, quic, tcp): measured once and cached (`pipe bench transport` measures
    /// again).
    #[arg(long, value_name = "TRANSPORT")]
    pub transport: Option<String>,
    /// Read the transport costs from FILE (JSON, as `pipe bench transport --costs-out`
    /// writes it) instead of the cache.
    #[arg(long, value_name = "FILE")]
    pub transport_costs: Option<PathBuf>,
}

impl LinkArgs {
    /// The costs of the transport asked for (`None` when none is), and where they came from.
    ///
    /// # Errors
    /// Bad input for an unknown transport or a bad cost file; measurement failures.
    pub fn load(&self) -> Result<Option<(TransportCost, String)>> {
        let Some(name) = &self.transport else {
            if self.transport_costs.is_some() {
                return Err(bad_input(
                    "--transport-costs needs --transport (or a placement on hosts)".into(),
                ));
            }
            return Ok(None);
        };
        let kind = transport_kind(name)?;
        match &self.transport_costs {
            Some(path) => {
                let costs = read_cost_file(path)?;
                let cost = pick(&costs, kind, &path.display().to_string())?;
                Ok(Some((cost, format!("read from {}", path.display()))))
            }
            None => {
                let (cost, origin) = measured(kind)?;
                Ok(Some((cost, origin)))
            }
        }
    }
}

/// The kinds whose costs are measured.
fn transport_kind(name: &str) -> Result<TransportKind> {
    let kind: TransportKind = name.parse().map_err(bad_input)?;
    if kind == TransportKind::Auto {
        let names = pipe_transport::kinds::names();
        return Err(bad_input(format!(
            "--transport auto names no one transport to charge: give one of {}",
            names[1..].join(", ")
        )));
    }
    Ok(kind)
}

/// `kind`'s costs in `costs`, which came from `source`.
fn pick(costs: &TransportCosts, kind: TransportKind, source: &str) -> Result<TransportCost> {
    costs.get(kind.name()).cloned().ok_or_else(|| {
        bad_input(format!(
            "{source} holds no costs for transport {}",
            kind.name()
        ))
    })
}

/// Reads and checks a cost file.
///
/// # Errors
/// Bad input naming the file and the problem.
pub fn read_cost_file(path: &Path) -> Result<TransportCosts> {
    let text = pipe_stages::limits::read_text_file(path, "transport cost file")?;
    let costs: TransportCosts = serde_json::from_str(&text)
        .map_err(|e| bad_input(format!("transport cost file {}: {e}", path.display())))?;
    costs
        .check()
        .map_err(|e| bad_input(format!("transport cost file {}: {e}", path.display())))?;
    Ok(costs)
}

/// This machine's costs for `kind`, cached or measured now, and where they came from.
///
/// # Errors
/// Measurement failures.
pub fn measured(kind: TransportKind) -> Result<(TransportCost, String)> {
    let (costs, origin) = all_measured()?;
    Ok((pick(&costs, kind, "the measured costs")?, origin))
}

/// This machine's costs of every transport, cached or measured now, and where they came from.
///
/// # Errors
/// Measurement failures.
pub fn all_measured() -> Result<(TransportCosts, String)> {
    let (costs, origin) = pipe_stages::startup::link_costs::load_or_measure(false)?;
    Ok((costs, origin.describe()))
}

/// One line naming a transport's charged costs and their source.
pub fn describe(cost: &TransportCost, source: &str) -> String {
    format!(
        "links charged as {}: {} us per message end, {} ns per byte, one way {} us, {} ({source})",
        cost.transport,
        cost.message_cpu_s.describe(1e6, ""),
        cost.byte_cpu_s.describe(1e9, ""),
        cost.latency_s.describe(1e6, ""),
        cost.bandwidth.map_or_else(
            || "no cost per byte moved".into(),
            |b| b.describe(1e-9, " GB/s")
        ),
    )
}

/// The flags that place a plan's workers on hosts ([`pipe_scheduler::planner::placement`]).
#[derive(Args, Debug, Clone, Default)]
pub struct HostArgs {
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

impl HostArgs {
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
        let cluster = ClusterFile::load(path).map_err(|e| bad_input(e.to_string()))?;
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
        return Err(bad_input(format!(
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
            return Err(bad_input(format!(
                "--hosts entry '{entry}' is not NAME:WORKERS (a name, and 1 to 4096 workers)"
            )));
        };
        total = total.saturating_add(n);
        hosts.push((name, n));
    }
    if total > 4096 {
        return Err(bad_input(format!(
            "--hosts places {total} workers, more than 4096"
        )));
    }
    Ok(hosts)
}

impl LinkArgs {
    /// The costs of `--transport`, or of `default` where it is not given, and where they
    /// came from.
    ///
    /// # Errors
    /// As [`LinkArgs::load`].
    pub fn load_or(&self, default: TransportKind) -> Result<(TransportCost, String)> {
        match &self.transport {
            Some(name) => self.load_kind(transport_kind(name)?),
            None => self.load_kind(default),
        }
    }

    /// The costs of `kind`, from `--transport-costs` where given, else measured or cached.
    ///
    /// # Errors
    /// As [`LinkArgs::load`].
    pub fn load_kind(&self, kind: TransportKind) -> Result<(TransportCost, String)> {
        match &self.transport_costs {
            Some(path) => {
                let costs = read_cost_file(path)?;
                let cost = pick(&costs, kind, &path.display().to_string())?;
                Ok((cost, format!("read from {}", path.display())))
            }
            None => measured(kind),
        }
    }
}
