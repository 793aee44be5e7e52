//! Each transport's link costs on this machine: measured by ping-pong between two endpoints
//! ([`pipe_transport::measure`]) over several rounds, kept as medians with their spread
//! ([`pipe_scheduler::planner::transport`]), and cached (`pipe_stages::cache`, kind
//! [`KIND`], keyed by the machine and the build) so that `pipe plan`, `pipe simulate` and
//! `pipe train`'s automatic plan read them without measuring again. An entry older than
//! [`MAX_AGE`], or one that is corrupt or written for another key, is measured again.

use std::path::PathBuf;
use std::time::Duration;

use pipe_scheduler::planner::transport::{Spread, TransportCost, TransportCosts};
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
