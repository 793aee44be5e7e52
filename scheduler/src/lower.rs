//! Lowering: inserting the communication a schedule implies.
//!
//! The sender side decides where both halves go: after every forward (or input-gradient
//! backward) whose consumer lives on another worker, a send; immediately before the consuming
//! action on the other worker, the matching receive. A receive therefore sits exactly where its
//! data is first needed and no worker ever waits for data it could do without, which is what lets
//! the untimed dry run decide deadlock. Stages held by the same worker hand data over locally
//! (no message). With `expand_all_reduce`, each `AllReduce` becomes the ring's `2(r-1)` send and
//! receive steps (reduce-scatter, then all-gather) so the simulator charges each chunk on the
//! link; otherwise it stays one collective action, which is how the executor runs it.

use crate::action::Action;
use crate::spec::Schedule;

/// Options for [`lower`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LowerOptions {
    /// Replace each collective all-reduce by its explicit ring steps.
    pub expand_all_reduce: bool,
}

/// Returns the schedule with sends and receives inserted. A schedule that is already lowered
/// is returned unchanged; a one-worker schedule comes back with the same programs, marked
/// lowered (nothing crosses workers).
pub fn lower(schedule: &Schedule, opts: LowerOptions) -> Schedule {
    if schedule.lowered {
        return schedule.clone();
    }
    let layout = schedule.layout();
    let last = schedule.stages() - 1;
    let programs = schedule
        .programs
        .iter()
        .enumerate()
        .map(|(w, prog)| {
            let w = w as u32;
            // At most a receive and a send around each action (ring steps aside).
            let mut out = Vec::with_capacity(prog.len() * 3);
            for &a in prog {
                match a {
                    Action::Forward { stage, mb } => {
                        if stage > 0 {
                            let from = layout.worker_for(stage - 1, mb);
                            if from != w {
                                out.push(Action::RecvActivation { stage, mb, from });
                            }
                        }
                        out.push(a);
                        if stage < last {
                            let to = layout.worker_for(stage + 1, mb);
                            if to != w {
                                out.push(Action::SendActivation { stage, mb, to });
                            }
                        }
                    }
                    Action::Backward { stage, mb } | Action::BackwardInput { stage, mb } => {
                        if stage < last {
                            let from = layout.worker_for(stage + 1, mb);
                            if from != w {
                                out.push(Action::RecvGradient { stage, mb, from });
                            }
                        }
                        out.push(a);
                        if stage > 0 {
                            let to = layout.worker_for(stage - 1, mb);
                            if to != w {
                                out.push(Action::SendGradient { stage, mb, to });
                            }
                        }
                    }
                    Action::AllReduce { stage, update } if opts.expand_all_reduce => {
                        let group = layout.group(stage);
                        let r = group.end - group.start;
                        let j = w - group.start;
                        let next = group.start + (j + 1) % r;
                        let prev = group.start + (j + r - 1) % r;
                        for step in 0..2 * (r - 1) {
                            out.push(Action::SendChunk {
                                stage,
                                update,
                                step,
                                to: next,
                            });
                            out.push(Action::RecvChunk {
                                stage,
                                update,
                                step,
                                from: prev,
                            });
                        }
                    }
                    _ => out.push(a),
                }
            }
            out
        })
        .collect();
    Schedule {
        resolved: schedule.resolved.clone(),
        programs,
        lowered: true,
    }
}
