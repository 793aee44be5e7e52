//! Each transport's link costs on this machine: measured by ping-pong between two endpoints
//! ([`pipe_transport::measure`]) over several rounds, kept as medians with their spread
//! ([`pipe_scheduler::planner::transport`]), and cached (`pipe_stages::cache`, kind
//! [`KIND`], keyed by the machine and the build) so that `pipe plan`, `pipe simulate` and
//! `pipe train`'s automatic plan read them without measuring again. An entry older than
//! [`MAX_AGE`], or one that is corrupt or written for another key, is measured again.
//!
//! [`LinkChoice`] is what a command charges a pipeline's links: the costs of the transport
//! that will carry them, read from the cache or a cost file, or measured now and cached.

use std::path::PathBuf;
use std::time::Duration;

use std::path::Path;

use pipe_scheduler::planner::transport::{Spread, TransportCost, TransportCosts};
use pipe_transport::TransportKind;
use pipe_transport::kinds::{MeshSettings, TRANSPORTS};
use pipe_transport::measure::{LinkCost, measure_mesh};

use crate::cache::{Cache, CacheKey, Lookup};
use crate::error::{Result, StageError};

/// The cache kind of transport costs.
pub const KIND: &str = "transport-costs";

/// How long measured costs are trusted: a week.
pub const MAX_AGE: Duration = Duration::from_secs(7 * 86_400);

/// Rounds measured per transport when the costs are measured for a plan.
pub const ROUNDS: u32 = 5;

/// Where costs came from.
#[derive(Clone, Debug)]
pub enum Origin {
    /// Read from the cache entry at this path.
    Reused(PathBuf),
    /// Measured now; written to this path (`None`: no cache directory, or it could not be
    /// written, with the reason); `replaced` says why an entry there was not used.
    Measured {
        /// The entry written.
        written: std::result::Result<PathBuf, String>,
        /// Why an existing entry was not trusted.
        replaced: Option<String>,
    },
}

impl Origin {
    /// One line for a run's output: where the costs came from.
    pub fn describe(&self) -> String {
        match self {
            Origin::Reused(path) => format!("reused from {}", path.display()),
            Origin::Measured { written, replaced } => {
                let why = replaced
                    .as_ref()
                    .map(|w| format!(" (the cached entry was not used: {w})"))
                    .unwrap_or_default();
                match written {
                    Ok(path) => format!("measured now{why}, kept in {}", path.display()),
                    Err(e) => format!("measured now{why}, not kept: {e}"),
                }
            }
        }
    }
}

/// The cache key of this machine's transport costs.
pub fn key() -> CacheKey {
    CacheKey::for_this_machine(KIND).with("rounds", ROUNDS)
}

/// Measures every transport's link costs over [`ROUNDS`] rounds and keeps them in pipe's
/// cache, where the planner reads them. Returns them, with the cache file, or why they were
/// not kept (no cache directory, or one that cannot be written: the figures are still
/// good, as `pipe plan` and `pipe train` carry on with them).
///
/// # Errors
/// As [`measure`].
pub fn measure_and_keep() -> Result<(
    TransportCosts,
    std::result::Result<std::path::PathBuf, String>,
)> {
    let measured = measure(ROUNDS)?;
    let kept = match crate::cache::Cache::open() {
        Some(cache) => cache.put(&key(), &measured).map_err(|e| e.to_string()),
        None => Err("no cache directory (set PIPE_CACHE_DIR)".into()),
    };
    Ok((measured, kept))
}

/// Measures every transport's link costs over `rounds` rounds.
///
/// # Errors
/// Zero rounds; transport failures.
pub fn measure(rounds: u32) -> Result<TransportCosts> {
    if rounds == 0 {
        return Err(StageError::Config("rounds must be at least 1".into()));
    }
    let settings = MeshSettings::new(0xc057);
    let mut transports = Vec::new();
    for registration in TRANSPORTS {
        let mut figures = Vec::with_capacity(rounds as usize);
        for _ in 0..rounds {
            let mesh = (registration.thread_mesh)(2, &settings)?;
            figures.push(measure_mesh(mesh, registration.measured_messages)?);
        }
        transports.push(cost_of(registration.name, &figures));
    }
    Ok(TransportCosts { transports })
}

/// The spread of `figures`, one per round, for the transport `name`.
fn cost_of(name: &str, figures: &[LinkCost]) -> TransportCost {
    let field = |f: fn(&LinkCost) -> f64| Spread::of(&figures.iter().map(f).collect::<Vec<_>>());
    let rates: Vec<f64> = figures.iter().filter_map(|l| l.bandwidth).collect();
    TransportCost {
        transport: name.into(),
        rounds: figures.len() as u32,
        latency_s: field(|l| l.latency_s),
        message_cpu_s: field(|l| l.cpu_s),
        byte_cpu_s: field(|l| l.byte_cpu_s),
        // A rate where most rounds found large messages dearer than small ones.
        bandwidth: (2 * rates.len() > figures.len()).then(|| Spread::of(&rates)),
    }
}

/// This machine's transport costs: the cached ones when they are there and trusted (and
/// `refresh` is false), else measured now and cached.
///
/// # Errors
/// Measurement failures.
pub fn load_or_measure(refresh: bool) -> Result<(TransportCosts, Origin)> {
    let cache = Cache::open();
    let key = key();
    let mut replaced = None;
    if let (Some(cache), false) = (&cache, refresh) {
        match cache.get::<TransportCosts>(&key, MAX_AGE) {
            Lookup::Hit { value, path } => match covers_every_transport(&value) {
                Ok(()) => return Ok((value, Origin::Reused(path))),
                Err(e) => replaced = Some(e),
            },
            Lookup::Ignored { why, .. } => replaced = Some(why),
            Lookup::Missing { .. } => {}
        }
    }
    let costs = measure(ROUNDS)?;
    let written = match &cache {
        Some(cache) => cache.put(&key, &costs).map_err(|e| e.to_string()),
        None => Err("no cache directory (set PIPE_CACHE_DIR)".into()),
    };
    Ok((costs, Origin::Measured { written, replaced }))
}

/// Checks cached costs, and that they hold every registered transport's (an entry
/// measured before a transport was added is measured again).
fn covers_every_transport(costs: &TransportCosts) -> std::result::Result<(), String> {
    costs.check()?;
    match TRANSPORTS.iter().find(|r| costs.get(r.name).is_none()) {
        Some(r) => Err(format!("it holds no costs for transport {}", r.name)),
        None => Ok(()),
    }
}

/// The costs as text: per transport, each figure's median and spread.
pub fn render(costs: &TransportCosts) -> String {
    let mut out = format!(
        "{:<8} {:>6} {:>26} {:>26} {:>26} {:>26}\n",
        "link", "rounds", "latency us", "cpu us per message end", "cpu ns per byte", "rate GB/s"
    );
    for t in &costs.transports {
        out.push_str(&format!(
            "{:<8} {:>6} {:>26} {:>26} {:>26} {:>26}\n",
            t.transport,
            t.rounds,
            t.latency_s.describe(1e6, ""),
            t.message_cpu_s.describe(1e6, ""),
            t.byte_cpu_s.describe(1e9, ""),
            t.bandwidth
                .map_or_else(|| "no cost".to_string(), |b| b.describe(1e-9, "")),
        ));
    }
    out
}

/// The flags that choose a link's transport costs.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct LinkChoice {
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

impl LinkChoice {
    /// The costs of the transport asked for (`None` when none is), and where they came from.
    ///
    /// # Errors
    /// Bad input for an unknown transport or a bad cost file; measurement failures.
    pub fn load(&self) -> Result<Option<(TransportCost, String)>> {
        let Some(name) = &self.transport else {
            if self.transport_costs.is_some() {
                return Err(StageError::Config(
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
    let kind: TransportKind = name.parse().map_err(StageError::Config)?;
    if kind == TransportKind::Auto {
        let names = pipe_transport::kinds::names();
        return Err(StageError::Config(format!(
            "--transport auto names no one transport to charge: give one of {}",
            names[1..].join(", ")
        )));
    }
    Ok(kind)
}

/// `kind`'s costs in `costs`, which came from `source`.
fn pick(costs: &TransportCosts, kind: TransportKind, source: &str) -> Result<TransportCost> {
    costs.get(kind.name()).cloned().ok_or_else(|| {
        StageError::Config(format!(
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
    let text = crate::limits::read_text_file(path, "transport cost file")?;
    TransportCosts::parse(&text)
        .map_err(|e| StageError::Config(format!("transport cost file {}: {e}", path.display())))
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
    let (costs, origin) = load_or_measure(false)?;
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

impl LinkChoice {
    /// The costs of `--transport`, or of `default` where it is not given, and where they
    /// came from.
    ///
    /// # Errors
    /// As [`LinkChoice::load`].
    pub fn load_or(&self, default: TransportKind) -> Result<(TransportCost, String)> {
        match &self.transport {
            Some(name) => self.load_kind(transport_kind(name)?),
            None => self.load_kind(default),
        }
    }

    /// The costs of `kind`, from `--transport-costs` where given, else measured or cached.
    ///
    /// # Errors
    /// As [`LinkChoice::load`].
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
