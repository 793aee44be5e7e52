//! The sizes a schedule request may ask for, checked before anything is allocated.
//!
//! Every number here bounds something a user (a flag, a config, a plan file) or a peer (a
//! cluster file) controls, so that an absurd request is refused with a message instead of
//! being allocated until the process is killed. They are constants because a schedule is pure
//! and knows nothing of the machine; the checks that depend on the machine's memory and cores
//! live in `pipe_stages::limits`, which applies these too, so that `pipe train`, `pipe plan`,
//! `pipe profile` and `pipe schedule` refuse the same requests with the same words.

use crate::error::{Result, ScheduleError};

/// Workers in one run: the cluster file's bound (`pipe_transport::cluster::MAX_WORKERS` is
/// kept equal), far past the largest pipeline this system has been run with.
pub const MAX_WORKERS: u64 = 4096;

/// Model stages in one pipeline (positions times chunks): no model this system builds has
/// more layers than [`MAX_LAYERS`], and a stage holds at least one layer.
pub const MAX_STAGES: u64 = 1024;

/// Layers in one model. The largest preset has under 40; a layer list of more is a mistake
/// or an attack, and every layer costs a thread-safe allocation per microbatch.
pub const MAX_LAYERS: u64 = 10_000;

/// Microbatches per update per replica (`M`).
pub const MAX_MICROBATCHES: u64 = 1 << 16;

/// Microbatch passes one schedule holds: total microbatches times model stages. A lowered
/// schedule costs about 400 bytes per pass (measured: `pipe schedule --stages 8
/// --microbatches 100000 --total-microbatches 100000` peaks at 333 MB), so this bound keeps
/// the largest schedule near 3.4 GB. A training run builds one schedule per epoch, or per
/// checkpoint interval when that is shorter.
pub const MAX_SCHEDULE_PASSES: u64 = 1 << 23;

/// Ring steps of expanded all-reduces in one schedule: a stage of `r` replicas adds
/// `r x 2(r-1)` per update, which [`MAX_SCHEDULE_PASSES`] does not count. A step (a send and a
/// receive) costs about 70 bytes lowered and simulated (measured: `pipe simulate --stages 1
/// --replicas 1024 --microbatches 1 --expand-all-reduce --updates 3`, 6.3 million steps,
/// peaks at 443 MB), so this bound keeps them near 1.2 GB.
pub const MAX_RING_STEPS: u64 = 1 << 24;

/// Events one timeline may hold when it is kept for a Chrome trace or a CSV: one per action of
/// the lowered schedule. At about [`crate::timeline::TRACE_BYTES_PER_EVENT`] bytes an event
/// the trace's text stays under 1.7 GB (a CSV under 540 MB), on top of the schedule it
/// traces. [`MAX_SCHEDULE_PASSES`] alone does not bound it: a pass lowers to up to six
/// actions (a forward, a backward and their sends and receives), so a schedule at that limit
/// would trace to about 10 GB.
pub const MAX_TRACE_EVENTS: u64 = 1 << 23;

/// Cells of a planner's table, layers times workers: the default cost model's tables measured
/// about 950 MB at 2,000 layers and 512 workers (a million cells).
pub const MAX_PLAN_CELLS: u64 = 1 << 20;

/// Work of one plan, layers times workers squared: 2,000 layers on 512 workers (2^29) took
/// 10 s here; the bound keeps any plan under about as long.
pub const MAX_PLAN_WORK: u64 = 1 << 29;

/// The most seconds one pass of one layer or stage may take in a profile or a cost file (about
/// 11 days): past it, sums and speed-ups stop being meaningful figures.
pub const MAX_FIGURE_SECONDS: f64 = 1e6;

/// The most bytes one activation, parameter set or stash may have in a profile or a cost file
/// (1 PiB).
pub const MAX_FIGURE_BYTES: f64 = (1u64 << 50) as f64;

/// The least time the layers of a profile, or the stages of a cost file, may take in all (a
/// nanosecond): with less, throughputs and speed-ups are not finite.
pub const MIN_TOTAL_SECONDS: f64 = 1e-9;

/// A figure as a message shows it: plain, or in exponent form when it is huge or tiny.
pub fn number(v: f64) -> String {
    if v != 0.0 && !(1e-4..1e9).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// Checks one figure of a profile or a cost file, named `name` (sizes end in `bytes`, the
/// rest are seconds), against [`MAX_FIGURE_BYTES`] or [`MAX_FIGURE_SECONDS`].
///
/// # Errors
/// The message naming the figure, its value and the bound.
pub fn check_figure(name: &str, v: f64) -> std::result::Result<(), String> {
    let (bound, unit) = if name.ends_with("bytes") {
        (MAX_FIGURE_BYTES, "bytes, 1 PiB")
    } else {
        (MAX_FIGURE_SECONDS, "seconds, 11 days")
    };
    if v > bound {
        return Err(format!(
            "{name} is {}, over the limit of {bound:e} {unit}",
            number(v)
        ));
    }
    Ok(())
}

/// Checks a link rate a user gave (a cost file, a transport cost file, a flag), named `name`:
/// at least a byte a second (infinite: no cost per byte), so that no transfer time it gives
/// is past every bound. Every command that reads a rate checks it here, so what one accepts
/// the others do.
///
/// # Errors
/// The message naming the rate and its value.
pub fn check_bandwidth(name: &str, v: f64) -> std::result::Result<(), String> {
    if v >= 1.0 {
        return Ok(());
    }
    Err(format!(
        "{name} must be at least 1 byte/s, got {}",
        number(v)
    ))
}

/// A request past a limit: what was asked, the limit and why it exists.
pub fn exceeded(what: &str, asked: u64, limit: u64, why: &str) -> ScheduleError {
    ScheduleError::Spec(format!(
        "{what} is {asked}, over the limit of {limit} ({why})"
    ))
}

/// `Ok` when `asked` is at most `limit`, else [`exceeded`]'s error for `what`, `why`.
fn at_most(what: &str, asked: u64, limit: u64, why: &str) -> Result<()> {
    if asked > limit {
        return Err(exceeded(what, asked, limit, why));
    }
    Ok(())
}

/// Checks a layout's size: `positions` pipeline positions of `workers` workers in all, each
/// holding `chunks` model stages.
///
/// # Errors
/// [`ScheduleError::Spec`] naming the first size over its limit.
pub fn check_layout(positions: u64, workers: u64, chunks: u64) -> Result<()> {
    at_most(
        "the number of model stages (stages x chunks)",
        positions.saturating_mul(chunks),
        MAX_STAGES,
        "a stage holds at least one layer, and models have at most 10000",
    )?;
    at_most(
        "the number of workers (replicas summed over stages)",
        workers,
        MAX_WORKERS,
        "the largest mesh the transport admits",
    )
}

/// Checks microbatches per update per replica.
///
/// # Errors
/// [`ScheduleError::Spec`] past [`MAX_MICROBATCHES`].
pub fn check_microbatches(microbatches: u64) -> Result<()> {
    at_most(
        "microbatches per update",
        microbatches,
        MAX_MICROBATCHES,
        "each one is a schedule slot on every worker; use larger microbatches instead",
    )
}

/// Checks the size of one schedule: `total` microbatches through `stages` model stages.
///
/// # Errors
/// [`ScheduleError::Spec`] past [`MAX_SCHEDULE_PASSES`].
pub fn check_schedule(total: u64, stages: u64) -> Result<()> {
    at_most(
        "one schedule's microbatch passes (microbatches x stages)",
        total.saturating_mul(stages),
        MAX_SCHEDULE_PASSES,
        "about 400 bytes each once lowered; ask for fewer updates, or checkpoint more often \
         so that a run builds shorter schedules",
    )
}

/// Checks the ring steps expanding a schedule's all-reduces adds (see
/// [`crate::ring_steps`]).
///
/// # Errors
/// [`ScheduleError::Spec`] past [`MAX_RING_STEPS`].
pub fn check_ring_steps(steps: u64) -> Result<()> {
    at_most(
        "the all-reduce ring steps (replicas x 2(replicas-1) per stage and update)",
        steps,
        MAX_RING_STEPS,
        "about 70 bytes each once lowered; ask for fewer replicas or updates, or keep each \
         all-reduce one collective action",
    )
}

/// Checks the size of a timeline to be kept for a trace or a CSV: `events` actions.
///
/// # Errors
/// [`ScheduleError::Spec`] past [`MAX_TRACE_EVENTS`].
pub fn check_trace(events: u64) -> Result<()> {
    at_most(
        "a timeline's events (actions of the lowered schedule)",
        events,
        MAX_TRACE_EVENTS,
        "about 200 bytes each in a Chrome trace; ask for fewer microbatches, updates or stages",
    )
}

/// Checks the size of a schedule to be printed (`pipe schedule` as text, a grid or CSV):
/// `actions` actions, a line or more each, bounded as a trace's events are.
///
/// # Errors
/// [`ScheduleError::Spec`] past [`MAX_TRACE_EVENTS`].
pub fn check_printed(actions: u64) -> Result<()> {
    at_most(
        "the printed schedule's actions",
        actions,
        MAX_TRACE_EVENTS,
        "a line or more each; ask for fewer microbatches, updates or stages",
    )
}

/// Checks the size of a planning problem: `layers` layers on `workers` workers.
///
/// # Errors
/// [`ScheduleError::Plan`] past [`MAX_PLAN_CELLS`] or [`MAX_PLAN_WORK`].
pub fn check_plan(layers: u64, workers: u64) -> Result<()> {
    let cells = layers.saturating_mul(workers);
    let work = cells.saturating_mul(workers);
    let plan_err = |e: ScheduleError| ScheduleError::Plan(e.to_string());
    at_most(
        "a plan's table (layers x workers)",
        cells,
        MAX_PLAN_CELLS,
        "about 1 KB a cell; plan fewer workers, or merge layers into blocks",
    )
    .map_err(plan_err)?;
    at_most(
        "a plan's work (layers x workers^2)",
        work,
        MAX_PLAN_WORK,
        "10 s at the limit; plan fewer workers, or merge layers into blocks",
    )
    .map_err(plan_err)
}

/// Checks a model's layer count.
///
/// # Errors
/// [`ScheduleError::Spec`] past [`MAX_LAYERS`].
pub fn check_layers(layers: u64) -> Result<()> {
    at_most(
        "the number of layers",
        layers,
        MAX_LAYERS,
        "no model this system builds comes close",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_name_the_request_and_the_bound() {
        let e = check_layout(100_000, 100_000, 1).unwrap_err().to_string();
        assert!(e.contains("100000") && e.contains("1024"), "{e}");
        let e = check_layout(4, 1_000_000, 1).unwrap_err().to_string();
        assert!(e.contains("workers") && e.contains("4096"), "{e}");
        assert!(check_layout(1024, 4096, 1).is_ok());
        assert!(check_microbatches(MAX_MICROBATCHES).is_ok());
        assert!(check_microbatches(MAX_MICROBATCHES + 1).is_err());
        assert!(check_schedule(u64::MAX, u64::MAX).is_err());
        assert!(check_schedule(60_000, 8).is_ok());
        assert!(check_layers(MAX_LAYERS + 1).is_err());
        assert!(check_trace(MAX_TRACE_EVENTS).is_ok());
        let e = check_trace(MAX_TRACE_EVENTS + 1).unwrap_err().to_string();
        assert!(
            e.contains("timeline's events") && e.contains("8388608"),
            "{e}"
        );
        assert!(check_plan(2000, 512).is_ok());
        let e = check_plan(10_000, 1024).unwrap_err().to_string();
        assert!(
            e.contains("layers x workers") && e.contains("10240000"),
            "{e}"
        );
        let e = check_plan(1000, 1000).unwrap_err().to_string();
        assert!(e.contains("layers x workers^2"), "{e}");
    }
}
