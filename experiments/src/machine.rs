//! The machine a result was measured on, recorded beside every report's figures.

use serde::{Deserialize, Serialize};

/// The machine a result was measured on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// CPU model.
    pub cpu: String,
    /// Logical cores available to the process.
    pub cores: usize,
    /// Memory, GiB.
    pub memory_gib: f64,
    /// Operating system and architecture.
    pub os: String,
}

impl Machine {
    /// This machine.
    pub fn this() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or_else(|| "unknown".to_string(), |(_, v)| v.trim().to_string());
        let limits = pipe_stages::limits::Machine::detect();
        Machine {
            cpu,
            cores: limits.cores,
            memory_gib: limits.memory_bytes as f64 / f64::from(1u32 << 30),
            os: format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
        }
    }
}
