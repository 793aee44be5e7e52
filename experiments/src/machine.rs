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
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let kib: f64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        Machine {
            cpu,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory_gib: kib / (1024.0 * 1024.0),
            os: format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
        }
    }
}
