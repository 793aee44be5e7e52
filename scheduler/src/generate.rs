//! One generator per policy. Each turns a [`ScheduleSpec`] into per-worker programs of compute,
//! all-reduce and update actions (no sends or receives: [`crate::lower`] adds those).
//!
//! Most policies share one local sequencer: a worker walks its own microbatches in order,
//! forwarding while fewer than `depth` are in flight and an optional version gate allows it,
//! and otherwise running the oldest pending backward; after every `per_update` backwards it
//! synchronises (all-reduce when replicated, then update). The policies differ only in `depth`,
//! `per_update` and the gate:
//!
//! | policy | depth at stage s | per update | gate for forward of local minibatch t |
//! |---|---|---|---|
//! | gpipe | whole minibatch | minibatch / r_s | t updates done (flush) |
//! | 1f1b-flush, zb-h1 | d_s | minibatch / r_s | t updates done (flush) |
//! | pipedream, nostash, vsync | d_s | M | none |
//! | 2bw | d_s | M | t - 1 updates done |
//!
//! with `d_s = ceil(sum of replicas of stages s.. / r_s)`, which is `S - s` on a straight
//! pipeline and PipeDream's "NOAM" (workers / input-stage replicas) at the input stage.
//! `zb-h1` then splits each backward and defers the weight halves, `interleaved` follows
//! Megatron-LM's interleaved order, and `sequential` is the plain loop on one worker.

use crate::action::{Action, Microbatch, StageId};
use crate::error::{Result, ScheduleError};
use crate::spec::{Policy, Resolved, Schedule, ScheduleSpec};

/// Generates the (unlowered) schedule for a request.
///
/// # Errors
/// [`ScheduleError::Spec`] when the request is impossible (see [`ScheduleSpec::resolve`]).
pub fn generate(spec: &ScheduleSpec) -> Result<Schedule> {
    let resolved = spec.resolve()?;
    let programs = match resolved.policy {
        Policy::Sequential => sequential(&resolved),
        Policy::Gpipe => sequenced(&resolved, Depth::Minibatch, Gate::Flush, false),
        Policy::OneFOneBFlush => sequenced(&resolved, Depth::Pipeline, Gate::Flush, false),
        Policy::ZbH1 => sequenced(&resolved, Depth::Pipeline, Gate::Flush, true),
        Policy::Interleaved => interleaved(&resolved),
        Policy::PipeDream | Policy::PipeDreamNoStash | Policy::VerticalSync => {
            sequenced(&resolved, Depth::Pipeline, Gate::None, false)
        }
        Policy::TwoBw => sequenced(&resolved, Depth::Pipeline, Gate::OneBehind, false),
    }?;
    Ok(Schedule {
        resolved,
        programs,
        lowered: false,
    })
}

/// The plain training loop: every microbatch forward through all stages and back, an update of
/// every stage after each minibatch.
fn sequential(r: &Resolved) -> Result<Vec<Vec<Action>>> {
    let stages = r.layout.stages();
    let mut prog = Vec::with_capacity(r.total as usize * (2 * stages as usize) + 16);
    for mb in 0..r.total {
        prog.extend((0..stages).map(|stage| Action::Forward { stage, mb }));
        prog.extend(
            (0..stages)
                .rev()
                .map(|stage| Action::Backward { stage, mb }),
        );
        if (mb + 1) % r.minibatch == 0 {
            let update = mb / r.minibatch;
            prog.extend((0..stages).map(|stage| Action::Update { stage, update }));
        }
    }
    Ok(vec![prog])
}

#[derive(Clone, Copy)]
enum Depth {
    /// All of the worker's microbatches of a minibatch may be in flight (GPipe).
    Minibatch,
    /// `d_s` in flight (1F1B).
    Pipeline,
}

#[derive(Clone, Copy)]
enum Gate {
    /// Forward of local minibatch t waits for t updates (synchronous: a flush).
    Flush,
    /// Forward of local minibatch t waits for t - 1 updates (2BW's one-step delay).
    OneBehind,
    /// No wait (PipeDream).
    None,
}

/// In-flight limit per position (see [`crate::Layout::in_flight_limit`]).
fn pipeline_depths(r: &Resolved) -> Vec<usize> {
    (0..r.layout.positions())
        .map(|p| r.layout.in_flight_limit(p) as usize)
        .collect()
}

/// A step of a local sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    F(Microbatch),
    B(Microbatch),
    Sync(u32),
}

/// The shared local sequencer (see the module docs).
fn sequence(
    local: &[Microbatch],
    depth: usize,
    per_update: usize,
    gate: impl Fn(usize) -> u32,
) -> Result<Vec<Op>> {
    let n = local.len();
    let mut ops = Vec::with_capacity(2 * n + n / per_update.max(1) + 1);
    let (mut f, mut b, mut u) = (0usize, 0usize, 0u32);
    while b < n {
        if f < n && f - b < depth && u >= gate(f) {
            ops.push(Op::F(local[f]));
            f += 1;
            continue;
        }
        if b == f {
            return Err(ScheduleError::Spec(
                "internal: sequencer stalled (no forward allowed, nothing to backward)".into(),
            ));
        }
        ops.push(Op::B(local[b]));
        b += 1;
        if b % per_update == 0 {
            ops.push(Op::Sync(u));
            u += 1;
        }
    }
    Ok(ops)
}

/// Emits the synchronisation for one update of `stage`: all-reduce when replicated, then update.
fn push_sync(prog: &mut Vec<Action>, stage: StageId, replicas: u32, update: u32) {
    if replicas > 1 {
        prog.push(Action::AllReduce { stage, update });
    }
    prog.push(Action::Update { stage, update });
}

/// Every policy built on [`sequence`]. `split` turns it into zero-bubble H1: backward split into
/// input and weight halves, weight halves deferred by `max depth - depth_s` (so every stage
/// holds at most the input stage's activations, as 1F1B does) and drained before each update.
fn sequenced(r: &Resolved, depth: Depth, gate: Gate, split: bool) -> Result<Vec<Vec<Action>>> {
    let layout = &r.layout;
    let depths = pipeline_depths(r);
    let max_depth = depths.iter().copied().max().unwrap_or(1);
    let mut programs = Vec::with_capacity(layout.workers() as usize);
    for w in 0..layout.workers() {
        let (p, j) = layout.placement(w);
        let stage = p;
        let reps = layout.replicas_of(stage);
        let local: Vec<Microbatch> = (j..r.total).step_by(reps as usize).collect();
        let per_update = (r.update_size(stage) / reps) as usize;
        let depth = match depth {
            Depth::Minibatch => per_update,
            Depth::Pipeline => depths[p as usize],
        };
        let ops = match gate {
            Gate::Flush => sequence(&local, depth, per_update, |f| (f / per_update) as u32)?,
            Gate::OneBehind => sequence(&local, depth, per_update, |f| {
                ((f / per_update) as u32).saturating_sub(1)
            })?,
            Gate::None => sequence(&local, depth, per_update, |_| 0)?,
        };
        let defer = max_depth - depths[p as usize];
        let mut prog = Vec::with_capacity(ops.len() * if split { 2 } else { 1 } + 8);
        let mut pending = std::collections::VecDeque::new();
        for op in ops {
            match op {
                Op::F(mb) => prog.push(Action::Forward { stage, mb }),
                Op::B(mb) if split => {
                    prog.push(Action::BackwardInput { stage, mb });
                    pending.push_back(mb);
                    if pending.len() > defer {
                        if let Some(old) = pending.pop_front() {
                            prog.push(Action::BackwardWeight { stage, mb: old });
                        }
                    }
                }
                Op::B(mb) => prog.push(Action::Backward { stage, mb }),
                Op::Sync(u) => {
                    while let Some(old) = pending.pop_front() {
                        prog.push(Action::BackwardWeight { stage, mb: old });
                    }
                    push_sync(&mut prog, stage, reps, u);
                }
            }
        }
        programs.push(prog);
    }
    Ok(programs)
}

/// Megatron-LM's interleaved 1F1B: each worker holds `v` chunks (stages `c * P + p`); inside a
/// minibatch of `m` local microbatches it runs `(P - p - 1) * 2 + (v - 1) * P` warm-up forwards,
/// then one forward and one backward at a time, then the remaining backwards. Forward `k` works
/// on chunk `(k / P) mod v` and local microbatch `(k / (P v)) P + k mod P`; backward `k` on
/// chunk `v - 1 - (k / P) mod v` and the same microbatch formula.
fn interleaved(r: &Resolved) -> Result<Vec<Vec<Action>>> {
    let layout = &r.layout;
    let big_p = layout.positions() as usize;
    let v = layout.chunks() as usize;
    let reps = layout.replica_counts()[0];
    let m = (r.minibatch / reps) as usize;
    let total = m * v;
    let mut programs = Vec::with_capacity(layout.workers() as usize);
    for w in 0..layout.workers() {
        let (p, j) = layout.placement(w);
        let p = p as usize;
        let warmup = ((big_p - p - 1) * 2 + (v - 1) * big_p).min(total);
        let mut prog = Vec::with_capacity((2 * total + 2 * v) * (r.total / r.minibatch) as usize);
        for t in 0..r.total / r.minibatch {
            let local = |k: usize| -> Microbatch {
                let i = (k / (big_p * v)) * big_p + k % big_p;
                t * r.minibatch + j + reps * i as u32
            };
            let stage_of = |chunk: usize| (chunk * big_p + p) as StageId;
            let fwd = |k: usize| Action::Forward {
                stage: stage_of((k / big_p) % v),
                mb: local(k),
            };
            let bwd = |k: usize| Action::Backward {
                stage: stage_of(v - 1 - (k / big_p) % v),
                mb: local(k),
            };
            prog.extend((0..warmup).map(fwd));
            for i in 0..total - warmup {
                prog.push(fwd(warmup + i));
                prog.push(bwd(i));
            }
            prog.extend((total - warmup..total).map(bwd));
            for c in 0..v {
                push_sync(&mut prog, stage_of(c), reps, t);
            }
        }
        programs.push(prog);
    }
    Ok(programs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(spec: &ScheduleSpec) -> Vec<String> {
        let s = generate(spec).unwrap();
        s.programs
            .iter()
            .map(|p| {
                p.iter()
                    .map(|a| a.to_string())
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect()
    }

    #[test]
    fn one_f_one_b_warmup_is_stages_minus_one() {
        let t = text(&ScheduleSpec::new(Policy::OneFOneBFlush, 3, 4));
        assert_eq!(t[0], "s0F0 s0F1 s0F2 s0B0 s0F3 s0B1 s0B2 s0B3 s0U0");
        assert_eq!(t[2], "s2F0 s2B0 s2F1 s2B1 s2F2 s2B2 s2F3 s2B3 s2U0");
    }

    #[test]
    fn zb_h1_defers_weight_halves_by_stage_index() {
        let t = text(&ScheduleSpec::new(Policy::ZbH1, 2, 2));
        assert_eq!(t[0], "s0F0 s0F1 s0I0 s0W0 s0I1 s0W1 s0U0");
        assert_eq!(t[1], "s1F0 s1I0 s1F1 s1I1 s1W0 s1W1 s1U0");
    }
}
