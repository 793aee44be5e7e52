//! What a command charges a pipeline's links: the measured costs of the transport that will
//! carry them ([`pipe_experiments::costs`]), read from pipe's cache or from a cost file, or
//! measured now and cached. `pipe plan`, `pipe simulate` and `pipe train --workers` share it.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;
use pipe_scheduler::planner::transport::{TransportCost, TransportCosts};
use pipe_transport::TransportKind;

use crate::output::{bad_input, experiment_error};

/// The flags that choose a link's transport costs.
#[derive(Args, Debug, Clone, Default)]
pub struct LinkArgs {
    /// Charge each link the processor time this transport's messages take on this machine
    /// (inproc, shm or quic): measured once and cached (`pipe bench transport` measures
    /// again).
    #[arg(long, value_name = "inproc|shm|quic")]
    pub transport: Option<String>,
    /// Read the transport costs from FILE (JSON, as `pipe bench transport --costs-out`
    /// writes it) instead of the cache.
    #[arg(long, value_name = "FILE", requires = "transport")]
    pub transport_costs: Option<PathBuf>,
}

impl LinkArgs {
    /// The costs of the transport asked for (`None` when none is), and where they came from.
    ///
    /// # Errors
    /// Bad input for an unknown transport or a bad cost file; measurement failures.
    pub fn load(&self) -> Result<Option<(TransportCost, String)>> {
        let Some(name) = &self.transport else {
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
        return Err(bad_input(
            "--transport auto names no one transport to charge: give inproc, shm or quic".into(),
        ));
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
    let (costs, origin) =
        pipe_experiments::costs::load_or_measure(false).map_err(experiment_error)?;
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
