//! Resource limits: every size a user or a peer controls, checked before anything is allocated
//! or spawned, in one place.
//!
//! Three kinds of bound meet here. The schedule's sizes (stages, workers, microbatches per
//! update, the length of one schedule, layers) are constants of `pipe_scheduler::limits`, pure
//! because a schedule knows nothing of the machine. The wire's sizes (frame header and payload,
//! cluster files) are constants of `pipe_transport::frame` and `pipe_transport::cluster`,
//! re-exported here so that this module lists every bound. The rest depend on the machine
//! ([`Machine`]: memory and cores) and are checked here: a run's memory against the machine's
//! share and what the host has available, the one memory gate ([`admit_memory`]; its
//! estimates are the planner's closed-form model,
//! [`crate::model::Model::worker_memory_bytes`], and the probed one of
//! `crate::planning::memory`); tensors; threads; workers on one host; profiling repeats; the
//! run's length; file sizes.
//!
//! This module imports nothing else of the crate: the model, the config and the data check
//! their own values with its functions and bounds (`Model::check_microbatch`,
//! `RunConfig::check_resources`, `SyntheticConfig::check`), so that every bound is stated here
//! once and any module can use it.
//!
//! Every refusal is a [`StageError::Limit`] (exit 2) that says what was asked, the limit, and
//! why the limit exists. `pipe train`, `pipe profile`, `pipe plan` and `pipe schedule` call the
//! same checks, so they refuse the same requests. The estimates are lower bounds of what a run
//! holds (parameters, optimizer state, stashed weight versions and activations; not the
//! allocator's slack or the dataset), so a refusal is certain to be right; what passes may
//! still fail at run time on a machine already busy with other work.

pub use pipe_kernels::files::open_regular;
use pipe_kernels::files::{ReadError, read_bounded};

use crate::error::{Result, StageError};

pub use pipe_scheduler::limits::{
    MAX_LAYERS, MAX_MICROBATCHES, MAX_SCHEDULE_PASSES, MAX_STAGES, MAX_WORKERS,
};
pub use pipe_transport::frame::{MAX_HEADER_BYTES, MAX_RANK};

/// Elements of any one tensor (activation of a whole microbatch, or parameter): 2^31, 8 GiB of
/// `f32`. Kernels index with `usize` but compute offsets in products of dimensions; bounding
/// every tensor keeps those products far from overflow.
pub const MAX_TENSOR_ELEMENTS: u64 = 1 << 31;

/// Warm-up or timed repeats per layer when profiling.
pub const MAX_PROFILE_REPEATS: u64 = 10_000;

/// Timed steps, updates, rounds, warm-ups or messages of one `pipe bench` measurement: far past
/// what a median needs.
pub const MAX_BENCH_ITERATIONS: u64 = 100_000;

/// Passes over the training set in one run (a run of more would not end within a year on the
/// smallest model and the embedded data).
pub const MAX_EPOCHS: u64 = 100_000;

/// Optimizer steps in one run.
pub const MAX_STEPS: u64 = 1 << 31;

/// The share of the machine's memory a run's estimate may take: the rest is left to the
/// allocator's slack, the dataset, the schedule and other processes.
pub const MEMORY_SHARE: f64 = 0.8;

/// The machine a run is checked against.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Machine {
    /// Bytes of memory the process may use: the smaller of physical memory and its cgroup's
    /// limit.
    pub memory_bytes: u64,
    /// Logical cores available to the process.
    pub cores: usize,
}

impl Machine {
    /// This machine, read from `/proc/meminfo` and the cgroup's `memory.max` (on systems
    /// without them: 16 GiB, a conservative guess).
    pub fn detect() -> Self {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let physical = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kib| kib.saturating_mul(1024));
        let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok());
        let memory_bytes = match (physical, cgroup) {
            (Some(p), Some(c)) => p.min(c),
            (Some(p), None) => p,
            (None, Some(c)) => c,
            (None, None) => 16 << 30,
        };
        Machine {
            memory_bytes,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }

    /// Compute threads a process may ask for: 4 per core, at least 16 (past that they only
    /// take turns on the cores, and each holds a stack and scratch buffers).
    pub fn max_threads(&self) -> u64 {
        (4 * self.cores as u64).max(16)
    }

    /// Workers on this host (threads of one process, or processes on loopback): 16 per core,
    /// at least 64.
    pub fn max_local_workers(&self) -> u64 {
        (16 * self.cores as u64).max(64)
    }

    /// Bytes a run's estimate may reach ([`MEMORY_SHARE`] of the machine's memory).
    pub fn memory_budget(&self) -> u64 {
        (self.memory_bytes as f64 * MEMORY_SHARE) as u64
    }
}

/// The refusal of `asked` past `limit`: what, the limit and why.
pub fn limit(what: impl std::fmt::Display, asked: u64, limit: u64, why: &str) -> StageError {
    StageError::Limit(format!(
        "{what} is {asked}, over the limit of {limit} ({why})"
    ))
}

/// Bytes of a config, plan, profile or experiment file: 16 MiB, a hundred times the largest
/// this project writes (a 10,000-layer config is under 1 MiB).
pub const MAX_TEXT_FILE_BYTES: u64 = 16 << 20;

/// How many times longer a `tokenizer.json`'s normalizer and pre-tokenizer (or its decoder)
/// may make text, at worst: 256. Common tokenizers stay far below (GPT-2's byte level: 2;
/// BERT's: under 8; T5's character map with its Metaspace: 198 at worst), while a 256 KiB
/// corpus piece grown 256 times still fits in memory as it is tokenized.
pub const MAX_TEXT_GROWTH: f64 = 256.0;

/// Reads a file of at most `max` bytes. The bound holds for files whose size the file system
/// does not report (pipes, `/dev/zero`): reading stops one byte past it.
///
/// # Errors
/// [`StageError::Limit`] for a longer file; [`StageError::Data`] naming `path` when it cannot
/// be read.
pub fn read_file(path: &std::path::Path, max: u64) -> Result<Vec<u8>> {
    let name = path.display().to_string();
    read_bounded(path, max).map_err(|e| match e {
        ReadError::Io(e) => StageError::Data {
            source_name: name,
            reason: format!("cannot read: {e}"),
        },
        ReadError::Long { .. } => too_long(path, max),
    })
}

/// Opens the regular file `path` for a reader that reads it in parts (a header first),
/// after comparing its size with `max`: the file and its size.
///
/// # Errors
/// As [`read_file`].
pub fn open_file(path: &std::path::Path, max: u64) -> Result<(std::fs::File, u64)> {
    pipe_kernels::files::open_bounded(path, max).map_err(|e| match e {
        ReadError::Io(e) => StageError::Data {
            source_name: path.display().to_string(),
            reason: format!("cannot read: {e}"),
        },
        ReadError::Long { .. } => too_long(path, max),
    })
}

fn too_long(path: &std::path::Path, max: u64) -> StageError {
    StageError::Limit(format!(
        "{} is larger than the limit of {max} bytes for this kind of file (those this \
         project writes are far smaller; is it the right file?)",
        path.display()
    ))
}

/// Reads a UTF-8 text file of at most [`MAX_TEXT_FILE_BYTES`]; `what` names the kind of file
/// in errors (`config`, `plan`, `profile`, `cost file`).
///
/// # Errors
/// [`StageError::Config`] naming `what` and `path` when it cannot be read or is not UTF-8;
/// [`StageError::Limit`] for a longer file.
pub fn read_text_file(path: &std::path::Path, what: &str) -> Result<String> {
    let shown = path.display();
    let bytes = read_bounded(path, MAX_TEXT_FILE_BYTES).map_err(|e| match e {
        ReadError::Io(e) => StageError::Config(format!("cannot read {what} {shown}: {e}")),
        ReadError::Long { .. } => too_long(path, MAX_TEXT_FILE_BYTES),
    })?;
    String::from_utf8(bytes)
        .map_err(|e| StageError::Config(format!("{what} {shown} is not UTF-8 text: {e}")))
}

/// Checks a count against its bound.
///
/// # Errors
/// [`StageError::Limit`] naming `what`, the count, the bound and `why`.
pub fn check_count(what: &str, asked: u64, bound: u64, why: &str) -> Result<()> {
    if asked > bound {
        return Err(limit(what, asked, bound, why));
    }
    Ok(())
}

/// Checks a run's length: epochs from 1 to [`MAX_EPOCHS`], steps and the evaluation's
/// spacing (where given) from 1 to [`MAX_STEPS`]. The one check of them, for settings
/// resolved from the command line and a run read back (a worker's `--run` file) alike.
///
/// # Errors
/// [`StageError::Config`] for zero; [`StageError::Limit`] past a run that would end.
pub fn check_run_length(epochs: u64, steps: Option<u64>, eval_every: Option<u64>) -> Result<()> {
    let never = "a run that would not end this year";
    for (what, count, bound) in [
        ("--epochs", Some(epochs), MAX_EPOCHS),
        ("--steps", steps, MAX_STEPS),
        ("--eval-every", eval_every, MAX_STEPS),
    ] {
        match count {
            Some(0) => {
                return Err(StageError::Config(format!("{what} must be at least 1")));
            }
            Some(n) => check_count(what, n, bound, never)?,
            None => {}
        }
    }
    Ok(())
}

/// Checks compute threads against [`Machine::max_threads`].
///
/// # Errors
/// [`StageError::Limit`].
pub fn check_threads(threads: u64, machine: &Machine) -> Result<()> {
    check_count(
        "--threads",
        threads,
        machine.max_threads(),
        &format!(
            "4 per core on this machine's {} cores: more only take turns",
            machine.cores
        ),
    )
}

/// A CPU backend on the compute threads a user asked for (0: one per core), checked first by
/// [`check_threads`] against this machine: every command that takes `--threads` and builds its
/// own backend builds it here, so that none starts a pool of a million threads.
///
/// # Errors
/// [`StageError::Limit`] for too many threads; the backend's error when its pool cannot start.
pub fn cpu_backend(threads: usize) -> Result<pipe_kernels::CpuBackend> {
    check_threads(threads as u64, &Machine::detect())?;
    Ok(pipe_kernels::CpuBackend::new(threads)?)
}

/// Checks profiling's warm-up and timed repeats against [`MAX_PROFILE_REPEATS`].
///
/// # Errors
/// [`StageError::Limit`].
pub fn check_profile_repeats(warmup: u64, repeats: u64) -> Result<()> {
    let why = "a profile's medians are stable after a few dozen";
    check_count("--warmup", warmup, MAX_PROFILE_REPEATS, why)?;
    check_count("--repeats", repeats, MAX_PROFILE_REPEATS, why)
}

/// Elements of a shape, or `None` past `u64`.
pub fn elements(shape: &[usize]) -> Option<u64> {
    shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
}

/// Checks that a per-sample shape given in a model description has at most
/// [`MAX_TENSOR_ELEMENTS`] elements.
///
/// # Errors
/// [`StageError::Limit`] naming `what`.
pub fn check_shape(what: &str, shape: &[usize]) -> Result<()> {
    let n = elements(shape).unwrap_or(u64::MAX);
    if n > MAX_TENSOR_ELEMENTS {
        return Err(limit(
            format_args!("{what} {shape:?}, in elements,"),
            n,
            MAX_TENSOR_ELEMENTS,
            "elements of one tensor, 8 GiB of f32",
        ));
    }
    Ok(())
}

/// Checks how many of a run's workers live on this host against
/// [`Machine::max_local_workers`].
///
/// # Errors
/// [`StageError::Limit`] naming the count and the bound.
pub fn check_local_workers(workers: u64, machine: &Machine) -> Result<()> {
    check_count(
        "the number of workers on this host",
        workers,
        machine.max_local_workers(),
        &format!(
            "16 per core on this machine's {} cores; spread them over hosts with `pipe worker`",
            machine.cores
        ),
    )
}

/// What a run (or a profile) needs of this host's memory, for [`admit_memory`].
#[derive(Clone, Copy, Debug)]
pub struct MemoryNeed<'a> {
    /// Bytes its workers on this host need together.
    pub bytes: f64,
    /// How many workers that is.
    pub workers: u64,
    /// What the bytes hold, for the message.
    pub holding: &'a str,
    /// What would lower it (and whether `--force` runs it anyway), for the message.
    pub lower: &'a str,
}

/// The memory gate, the one rule every run and profile passes: `need` is refused over the
/// share of this machine's memory a run may take ([`Machine::memory_budget`]), and over the
/// memory this host has available now where that is known ([`available_memory`]). The caller
/// decides whether `--force` runs it anyway.
///
/// # Errors
/// [`StageError::Limit`] naming what the run needs, the limit it is over and why, the flags
/// that would lower it, and `--force`.
pub fn admit_memory(need: &MemoryNeed<'_>, machine: &Machine) -> Result<()> {
    let budget = machine.memory_budget();
    let workers = need.workers;
    let over = |limit: f64, what: String| {
        StageError::Limit(format!(
            "the run needs an estimated {} on this host ({workers} worker{}, holding {}), over \
             the {} {what}; {}",
            gib(need.bytes),
            if workers == 1 { "" } else { "s" },
            need.holding,
            gib(limit),
            need.lower,
        ))
    };
    if need.bytes > budget as f64 {
        return Err(over(
            budget as f64,
            format!(
                "a run may take ({:.0}% of this machine's {})",
                MEMORY_SHARE * 100.0,
                gib(machine.memory_bytes as f64)
            ),
        ));
    }
    match available_memory()? {
        Some((available, source)) if need.bytes > available as f64 => Err(over(
            available as f64,
            format!("this host has available ({source})"),
        )),
        _ => Ok(()),
    }
}

fn gib(bytes: f64) -> String {
    if bytes >= (1u64 << 30) as f64 {
        format!("{:.1} GiB", bytes / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes / (1u64 << 20) as f64)
    }
}

/// This process's resident bytes now (`VmRSS`), the memory model's measured `process` term;
/// `None` where `/proc/self/status` cannot be read.
pub fn process_resident_bytes() -> Option<u64> {
    status_bytes("VmRSS:")
}

/// This process's peak resident bytes so far (`VmHWM`), what the memory model's estimate is
/// checked against; `None` where `/proc/self/status` cannot be read.
pub fn process_peak_bytes() -> Option<u64> {
    status_bytes("VmHWM:")
}

/// The environment variable that sets the memory [`available_memory`] reports, in bytes,
/// instead of this host's: a dry run of the refusal for a smaller machine, and the tests'.
pub const AVAILABLE_MEMORY_VAR: &str = "PIPE_AVAILABLE_MEMORY";

/// Memory this host has available now, and what says so: the kernel's `MemAvailable` (what
/// can be allocated without swapping, page cache that can be dropped included), or, where
/// lower, what the process's cgroup has left (`memory.max` less `memory.current`) or what its
/// address-space limit (`ulimit -v`) leaves beyond what it maps already (`VmSize`);
/// [`AVAILABLE_MEMORY_VAR`] where set. `None` where none can be read (not Linux).
///
/// # Errors
/// Bad input naming [`AVAILABLE_MEMORY_VAR`] when it is set to anything but a whole number
/// of bytes.
pub fn available_memory() -> Result<Option<(u64, &'static str)>> {
    if let Some(value) = std::env::var_os(AVAILABLE_MEMORY_VAR) {
        let text = value.to_string_lossy();
        return match text.trim().parse::<u64>() {
            Ok(bytes) => Ok(Some((bytes, AVAILABLE_MEMORY_VAR))),
            Err(_) => Err(StageError::Input(format!(
                "{AVAILABLE_MEMORY_VAR}={text:?}: not a whole number of bytes from 0 to 2^64-1"
            ))),
        };
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let available = meminfo.as_deref().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))?
            .split_whitespace()
            .next()?
            .parse::<u64>()
            .ok()
            .map(|kib| kib.saturating_mul(1024))
    });
    let read = |name: &str| {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{name}"))
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let cgroup =
        read("memory.max").map(|max| max.saturating_sub(read("memory.current").unwrap_or(0)));
    let address_space = rustix::process::getrlimit(rustix::process::Resource::As)
        .current
        .map(|limit| limit.saturating_sub(status_bytes("VmSize:").unwrap_or(0)));
    Ok([
        (available, "MemAvailable"),
        (cgroup, "the cgroup's memory.max less its memory.current"),
        (
            address_space,
            "the address-space limit, ulimit -v, less what the process maps",
        ),
    ]
    .into_iter()
    .filter_map(|(bytes, source)| Some((bytes?, source)))
    .min_by_key(|&(bytes, _)| bytes))
}

/// A `kB` field of `/proc/self/status`, in bytes.
fn status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(gib: u64) -> Machine {
        Machine {
            memory_bytes: gib << 30,
            cores: 2,
        }
    }

    #[test]
    fn counts_threads_repeats_and_memory_have_bounds() {
        assert!(check_threads(8, &machine(1)).is_ok());
        assert!(check_threads(100_000, &machine(1)).is_err());
        assert!(check_profile_repeats(u64::MAX, 1).is_err());
        assert!(check_profile_repeats(3, 10).is_ok());
        let need = |bytes: f64| MemoryNeed {
            bytes,
            workers: 4,
            holding: "weights",
            lower: "use fewer replicas",
        };
        assert!(admit_memory(&need(1e6), &machine(24)).is_ok());
        assert!(check_local_workers(4, &machine(24)).is_ok());
        let e = check_local_workers(3000, &machine(24))
            .unwrap_err()
            .to_string();
        assert!(e.contains("workers on this host is 3000"), "{e}");
        let e = admit_memory(&need(30e9), &machine(24))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("needs an estimated 27.9 GiB")
                && e.contains("19.2 GiB a run may take")
                && e.contains("use fewer replicas"),
            "{e}"
        );
        assert!(check_shape("input", &[usize::MAX, 2]).is_err());
        assert_eq!(elements(&[3, 4]), Some(12));
    }
}
