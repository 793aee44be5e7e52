//! Resource limits: every size a user or a peer controls, checked before anything is allocated
//! or spawned, in one place.
//!
//! Three kinds of bound meet here. The schedule's sizes (stages, workers, microbatches per
//! update, the length of one schedule, layers) are constants of `pipe_scheduler::limits`, pure
//! because a schedule knows nothing of the machine. The wire's sizes (frame header and payload,
//! cluster files) are constants of `pipe_transport::frame` and `pipe_transport::cluster`,
//! re-exported here so that this module lists every bound. The rest depend on the machine
//! ([`Machine`]: memory and cores) and are checked here: a run's memory, estimated with the
//! planner's memory model ([`pipe_scheduler::planner::worker_memory_bytes`]) from the model's
//! exact parameter and activation sizes; tensors; threads; workers on one host; profiling
//! repeats; the run's length.
//!
//! Every refusal is a [`StageError::Limit`] (exit 2) that says what was asked, the limit, and
//! why the limit exists. `pipe train`, `pipe profile`, `pipe plan` and `pipe schedule` call the
//! same checks, so they refuse the same requests. The estimates are lower bounds of what a run
//! holds (parameters, optimizer state, stashed weight versions and activations; not the
//! allocator's slack or the dataset), so a refusal is certain to be right; what passes may
//! still fail at run time on a machine already busy with other work.

use pipe_scheduler::{Policy, Resolved};

use crate::error::{Result, StageError};
use crate::model::Model;
use crate::optim::OptimizerKind;

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

fn limit(what: impl std::fmt::Display, asked: u64, limit: u64, why: &str) -> StageError {
    StageError::Limit(format!(
        "{what} is {asked}, over the limit of {limit} ({why})"
    ))
}

/// Bytes of a config, plan, profile or experiment file: 16 MiB, a hundred times the largest
/// this project writes (a 10,000-layer config is under 1 MiB).
pub const MAX_TEXT_FILE_BYTES: u64 = 16 << 20;

/// Reads a file of at most `max` bytes. The bound holds for files whose size the file system
/// does not report (pipes, `/dev/zero`): reading stops one byte past it.
///
/// # Errors
/// [`StageError::Limit`] for a longer file; [`StageError::Data`] naming `path` when it cannot
/// be read.
pub fn read_file(path: &std::path::Path, max: u64) -> Result<Vec<u8>> {
    let name = path.display().to_string();
    read_bounded(path, max).map_err(|e| match e {
        Bounded::Io(e) => StageError::Data {
            source_name: name,
            reason: format!("cannot read: {e}"),
        },
        Bounded::Long => too_long(path, max),
    })
}

/// Why [`read_bounded`] failed.
enum Bounded {
    Io(std::io::Error),
    Long,
}

fn too_long(path: &std::path::Path, max: u64) -> StageError {
    StageError::Limit(format!(
        "{} is larger than the limit of {max} bytes for this kind of file (those this \
         project writes are far smaller; is it the right file?)",
        path.display()
    ))
}

/// At most `max` bytes of `path`.
fn read_bounded(path: &std::path::Path, max: u64) -> std::result::Result<Vec<u8>, Bounded> {
    use std::io::Read as _;
    let file = std::fs::File::open(path).map_err(Bounded::Io)?;
    let mut bytes = Vec::new();
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(Bounded::Io)?;
    if bytes.len() as u64 > max {
        return Err(Bounded::Long);
    }
    Ok(bytes)
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
        Bounded::Io(e) => StageError::Config(format!("cannot read {what} {shown}: {e}")),
        Bounded::Long => too_long(path, MAX_TEXT_FILE_BYTES),
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

/// Checks profiling's warm-up and timed repeats against [`MAX_PROFILE_REPEATS`].
///
/// # Errors
/// [`StageError::Limit`].
pub fn check_profile_repeats(warmup: u64, repeats: u64) -> Result<()> {
    let why = "a profile's medians are stable after a few dozen";
    check_count("--warmup", warmup, MAX_PROFILE_REPEATS, why)?;
    check_count("--repeats", repeats, MAX_PROFILE_REPEATS, why)
}

/// Checks the synthetic dataset's shape: its samples times inputs (the features it
/// generates), and its teacher network (inputs times hidden, hidden times classes), each
/// against [`MAX_TENSOR_ELEMENTS`].
///
/// # Errors
/// [`StageError::Limit`] naming the setting.
pub fn check_synthetic(c: &crate::data::SyntheticConfig) -> Result<()> {
    let why = "elements of one tensor, 8 GiB of f32";
    let samples = (c.train as u64).saturating_add(c.test as u64);
    for (what, n) in [
        (
            "synthetic samples x inputs",
            samples.saturating_mul(c.inputs as u64),
        ),
        (
            "synthetic inputs x hidden",
            (c.inputs as u64).saturating_mul(c.hidden as u64),
        ),
        (
            "synthetic hidden x classes",
            (c.hidden as u64).saturating_mul(c.classes as u64),
        ),
    ] {
        check_count(what, n, MAX_TENSOR_ELEMENTS, why)?;
    }
    Ok(())
}

/// Elements of a shape, or `None` past `u64`.
fn elements(shape: &[usize]) -> Option<u64> {
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

/// Checks a built model's sizes before any parameter is allocated: every parameter's and every
/// per-sample activation's element count ([`check_activations`] adds the microbatch). The
/// layer count is checked before the layers are built ([`Model::new`]).
///
/// # Errors
/// [`StageError::Limit`] naming the layer and its size.
pub fn check_model_shapes(model: &Model) -> Result<()> {
    check_activations(model, 1)?;
    for entry in model.param_table() {
        let n = elements(&entry.shape).unwrap_or(u64::MAX);
        if n > MAX_TENSOR_ELEMENTS {
            return Err(limit(
                format_args!("parameter {} {:?}, in elements,", entry.name, entry.shape),
                n,
                MAX_TENSOR_ELEMENTS,
                "elements of one tensor, 8 GiB of f32",
            ));
        }
    }
    Ok(())
}

/// Bytes of one microbatch's activation entering layer `i` (`i == len` is the output).
fn activation_elements(model: &Model, i: usize, microbatch_size: usize) -> u64 {
    elements(model.shape_before(i))
        .unwrap_or(u64::MAX)
        .saturating_mul(microbatch_size as u64)
}

/// Checks every activation of a microbatch of `microbatch_size` samples against
/// [`MAX_TENSOR_ELEMENTS`].
///
/// # Errors
/// [`StageError::Limit`] naming the widest layer boundary.
pub fn check_activations(model: &Model, microbatch_size: usize) -> Result<()> {
    for i in 0..=model.len() {
        let n = activation_elements(model, i, microbatch_size);
        if n > MAX_TENSOR_ELEMENTS {
            let at = if i == model.len() {
                "the model's output".to_string()
            } else {
                format!("the input of layer {i}")
            };
            return Err(limit(
                format_args!(
                    "{at} at microbatch size {microbatch_size} ({:?} per sample), in elements,",
                    model.shape_before(i)
                ),
                n,
                MAX_TENSOR_ELEMENTS,
                "elements of one tensor, 8 GiB of f32; use smaller microbatches",
            ));
        }
    }
    Ok(())
}

/// Copies of a stage's parameters an optimizer keeps besides the weights: the gradient, plus
/// momentum (SGD) or both moments (Adam, AdamW).
fn state_copies(optimizer: OptimizerKind) -> f64 {
    match optimizer {
        OptimizerKind::Sgd => 2.0,
        _ => 3.0,
    }
}

/// What a run asks of this host, for [`check_run_memory`].
#[derive(Clone, Copy, Debug)]
pub struct RunShape<'a> {
    /// The model.
    pub model: &'a Model,
    /// The resolved schedule (policy, layout, in-flight depths).
    pub run: &'a Resolved,
    /// Samples per microbatch.
    pub microbatch_size: usize,
    /// The optimizer.
    pub optimizer: OptimizerKind,
    /// Workers of the run that live on this host (all of them for `pipe train`, one for
    /// `pipe worker`).
    pub local_workers: u64,
}

/// The planner's memory estimate for a run, in bytes on this host: per worker, its stage's
/// parameters times the weight versions it keeps plus the optimizer's state, and its in-flight
/// microbatches' stashed activations (every layer's input and output), summed over the
/// workers on this host. Layers are shared out evenly by count, the stage ranges a balanced
/// cut would give; the largest stage's share is charged to every worker.
pub fn run_memory_bytes(shape: &RunShape<'_>) -> f64 {
    let model = shape.model;
    let layers = model.len().max(1);
    let stages = (shape.run.layout.stages() as usize).clamp(1, layers);
    let per_stage = layers.div_ceil(stages);
    // Every use holds its own copy of a tied parameter.
    let mut layer_params = vec![0.0f64; layers];
    for entry in model.param_table() {
        let n = elements(&entry.shape).unwrap_or(u64::MAX) as f64;
        for &(l, _) in &entry.uses {
            layer_params[l] += n;
        }
    }
    let mut worst_params = 0.0f64;
    let mut worst_stash = 0.0f64;
    for s in 0..stages {
        let range = (s * per_stage).min(layers)..((s + 1) * per_stage).min(layers);
        let params: f64 = layer_params[range.clone()].iter().sum();
        let stash: f64 = range
            .map(|l| {
                (activation_elements(model, l, shape.microbatch_size) as f64)
                    + activation_elements(model, l + 1, shape.microbatch_size) as f64
            })
            .sum();
        worst_params = worst_params.max(params * 4.0);
        worst_stash = worst_stash.max(stash * 4.0);
    }
    let deepest = shape.run.depths.iter().copied().max().unwrap_or(1);
    let per_worker = pipe_scheduler::planner::worker_memory_bytes(
        shape.run.policy,
        shape.run.microbatches_per_update,
        u64::from(deepest),
        worst_params,
        worst_stash,
        state_copies(shape.optimizer),
    );
    per_worker * shape.local_workers as f64
}

/// Checks a run against this host: workers on the host, and the planner's memory estimate
/// ([`run_memory_bytes`]) against [`Machine::memory_budget`].
///
/// # Errors
/// [`StageError::Limit`] saying what the run needs and what the machine has.
pub fn check_run_memory(shape: &RunShape<'_>, machine: &Machine) -> Result<()> {
    check_count(
        "the number of workers on this host",
        shape.local_workers,
        machine.max_local_workers(),
        &format!(
            "16 per core on this machine's {} cores; spread them over hosts with `pipe worker`",
            machine.cores
        ),
    )?;
    let need = run_memory_bytes(shape);
    let budget = machine.memory_budget();
    if need > budget as f64 {
        return Err(StageError::Limit(format!(
            "the run needs at least {} of memory ({} workers on this host holding {} \
             parameters' weights, optimizer state{} and stashed activations), over the limit of \
             {} ({:.0}% of this machine's {}); use fewer replicas, more stages or smaller \
             microbatches",
            gib(need),
            shape.local_workers,
            shape.model.param_count(),
            if matches!(shape.run.policy, Policy::PipeDream | Policy::VerticalSync) {
                ", stashed weight versions"
            } else {
                ""
            },
            gib(budget as f64),
            MEMORY_SHARE * 100.0,
            gib(machine.memory_bytes as f64),
        )));
    }
    Ok(())
}

/// Checks a resolved run against this host: its threads, and when it is pipelined or not, its
/// workers and memory ([`check_run_memory`]). `local_workers` is how many of the run's workers
/// live on this host: `None` for all of them (`pipe train`), `Some(1)` for `pipe worker`.
///
/// # Errors
/// [`StageError::Limit`] for the first bound exceeded; [`StageError::Schedule`] or
/// [`StageError::Model`] when the run's layout or model cannot be built.
pub fn check_run(
    cfg: &crate::config::RunConfig,
    local_workers: Option<u64>,
    machine: &Machine,
) -> Result<()> {
    check_threads(cfg.threads as u64, machine)?;
    let model = Model::new(&cfg.model)?;
    check_activations(&model, cfg.microbatch_size)?;
    let spec = if cfg.pipelined {
        cfg.schedule_spec(pipe_scheduler::Length::Updates(1))
    } else {
        pipe_scheduler::ScheduleSpec::new(Policy::Sequential, 1, 1)
    };
    let run = spec.resolve()?;
    let shape = RunShape {
        model: &model,
        run: &run,
        microbatch_size: cfg.microbatch_size,
        optimizer: cfg.optimizer.kind,
        local_workers: local_workers.unwrap_or(u64::from(run.layout.workers())),
    };
    check_run_memory(&shape, machine)
}

fn gib(bytes: f64) -> String {
    if bytes >= (1u64 << 30) as f64 {
        format!("{:.1} GiB", bytes / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes / (1u64 << 20) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelSpec;
    use pipe_scheduler::ScheduleSpec;

    fn machine(gib: u64) -> Machine {
        Machine {
            memory_bytes: gib << 30,
            cores: 2,
        }
    }

    #[test]
    fn huge_widths_are_refused_before_allocation() {
        let model = Model::new(&ModelSpec::preset("mlp-784-1000000000-10").unwrap()).unwrap();
        let e = check_model_shapes(&model).unwrap_err().to_string();
        assert!(
            e.contains("layers.1.weight") && e.contains("2147483648"),
            "{e}"
        );
        assert!(check_activations(&model, 64).is_err());
    }

    #[test]
    fn memory_estimate_follows_the_planner_and_scales_with_workers() {
        let model = Model::new(&ModelSpec::preset("mlp-784-1024x4-10").unwrap()).unwrap();
        let run = ScheduleSpec::new(Policy::OneFOneBFlush, 1, 1)
            .resolve()
            .unwrap();
        let one = RunShape {
            model: &model,
            run: &run,
            microbatch_size: 64,
            optimizer: OptimizerKind::Sgd,
            local_workers: 1,
        };
        // One worker, one version: weights + gradient + momentum, and one microbatch's
        // activations in and out of every layer.
        let params = model.param_count() as f64 * 4.0;
        let acts: f64 = (0..model.len())
            .map(|l| {
                (activation_elements(&model, l, 64) + activation_elements(&model, l + 1, 64)) as f64
            })
            .sum::<f64>()
            * 4.0;
        assert_eq!(run_memory_bytes(&one), 3.0 * params + acts);
        assert!(check_run_memory(&one, &machine(24)).is_ok());
        let many = RunShape {
            local_workers: 3000,
            ..one
        };
        let e = check_run_memory(&many, &machine(24))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("workers on this host") && e.contains("3000"),
            "{e}"
        );
        let tight = check_run_memory(&one, &machine(0)).unwrap_err().to_string();
        assert!(tight.contains("needs at least"), "{tight}");
    }

    #[test]
    fn threads_and_repeats_have_bounds() {
        assert!(check_threads(8, &machine(1)).is_ok());
        assert!(check_threads(100_000, &machine(1)).is_err());
        assert!(check_profile_repeats(u64::MAX, 1).is_err());
        assert!(check_profile_repeats(3, 10).is_ok());
    }
}
