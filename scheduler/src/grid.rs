//! Worker-by-step text grids: the whole schedule for reading, or a window around a failing cell
//! for error messages (the marked cell is wrapped in `[ ]`).

use crate::action::WorkerId;
use crate::error::ScheduleError;
use crate::spec::Schedule;

/// Cells shown on each side of a marked cell.
const HALF_WINDOW: usize = 6;
/// Rows shown on each side of a marked worker when there are many workers.
const HALF_ROWS: u32 = 4;

/// Renders every worker's whole program, one row per worker, columns aligned by step.
pub fn full(schedule: &Schedule) -> String {
    let steps = schedule.programs.iter().map(Vec::len).max().unwrap_or(0);
    render(schedule, 0..schedule.workers(), 0..steps, &[])
}

/// Renders the rows near `worker` and the steps near `step`, marking `(worker, step)`.
pub fn around(schedule: &Schedule, worker: WorkerId, step: usize) -> String {
    let rows = if schedule.workers() <= 2 * HALF_ROWS + 1 {
        0..schedule.workers()
    } else {
        worker.saturating_sub(HALF_ROWS)..(worker + HALF_ROWS + 1).min(schedule.workers())
    };
    let cols = step.saturating_sub(HALF_WINDOW)..step + HALF_WINDOW + 1;
    render(schedule, rows, cols, &[(worker, step)])
}

/// Renders one line per listed worker, each windowed around its own marked step (workers
/// blocked in a deadlock are usually at very different steps).
pub fn blocked(schedule: &Schedule, marks: &[(WorkerId, usize)]) -> String {
    let mut out = String::new();
    for &(w, step) in marks {
        let prog = &schedule.programs[w as usize];
        let lo = step.saturating_sub(HALF_WINDOW);
        let hi = (step + HALF_WINDOW + 1).min(prog.len());
        out.push_str(&format!("  w{w} step {step}:"));
        if lo > 0 {
            out.push_str(" ...");
        }
        for (i, a) in prog.iter().enumerate().take(hi).skip(lo) {
            if i == step {
                out.push_str(&format!(" [{a}]"));
            } else {
                out.push_str(&format!(" {a}"));
            }
        }
        if hi < prog.len() {
            out.push_str(" ...");
        }
        out.push('\n');
    }
    out
}

fn render(
    schedule: &Schedule,
    rows: std::ops::Range<WorkerId>,
    cols: std::ops::Range<usize>,
    marks: &[(WorkerId, usize)],
) -> String {
    let cell = |w: WorkerId, i: usize| -> String {
        let text = schedule.programs[w as usize]
            .get(i)
            .map_or_else(String::new, |a| a.to_string());
        let marked = marks.contains(&(w, i));
        match (marked, text.is_empty()) {
            (true, true) => "[end]".to_string(),
            (true, false) => format!("[{text}]"),
            _ => text,
        }
    };
    let mut width = 4usize;
    for w in rows.clone() {
        for i in cols.clone() {
            width = width.max(cell(w, i).len());
        }
    }
    let label_width = format!("w{}", rows.end.saturating_sub(1)).len().max(4);
    let mut out = format!("{:label_width$}", "step");
    for i in cols.clone() {
        out.push_str(&format!(" {i:>width$}"));
    }
    out.push('\n');
    for w in rows {
        let len = schedule.programs[w as usize].len();
        let label = format!("w{w}");
        out.push_str(&format!("{label:label_width$}"));
        for i in cols.clone() {
            let c = cell(w, i);
            if c.is_empty() && i >= len {
                out.push_str(&format!(" {:>width$}", "."));
            } else {
                out.push_str(&format!(" {c:>width$}"));
            }
        }
        out.push('\n');
    }
    out
}

/// The error for a broken rule at `step` of `worker`'s program, with the grid around it.
pub(crate) fn invalid(
    schedule: &Schedule,
    worker: WorkerId,
    step: usize,
    reason: String,
) -> ScheduleError {
    let action = schedule.programs[worker as usize]
        .get(step)
        .map_or_else(|| "end".to_string(), |a| a.to_string());
    ScheduleError::Invalid {
        worker,
        step,
        action,
        reason,
        grid: around(schedule, worker, step),
    }
}
