//! The actions a worker runs, and their short text form.
//!
//! Every action names the model stage it works on (a worker may hold several stages: interleaved
//! chunks, or all of them under `sequential`). Text forms:
//!
//! | action | text | meaning |
//! |---|---|---|
//! | `Forward` | `s1F7` | forward of microbatch 7 through stage 1 |
//! | `Backward` | `s1B7` | fused backward (input and weight gradients) |
//! | `BackwardInput` | `s1I7` | gradient with respect to the stage input only |
//! | `BackwardWeight` | `s1W7` | gradient with respect to the stage weights only |
//! | `AllReduce` | `s1A3` | replicas of stage 1 all-reduce the gradients of update 3 |
//! | `Update` | `s1U3` | optimizer step 3 of stage 1 (weight version 3 becomes 4) |
//! | `SendActivation` | `s1F7>4` | send stage 1's output of microbatch 7 to worker 4 |
//! | `RecvActivation` | `s2F7<2` | receive stage 2's input of microbatch 7 from worker 2 |
//! | `SendGradient` | `s2B7>2` | send the gradient of stage 2's input to worker 2 |
//! | `RecvGradient` | `s1B7<4` | receive the gradient of stage 1's output from worker 4 |
//! | `SendChunk` | `s0A3.1>1` | step 1 of update 3's ring all-reduce: send a chunk to worker 1 |
//! | `RecvChunk` | `s0A3.1<1` | step 1 of update 3's ring all-reduce: receive from worker 1 |

use std::fmt;
use std::str::FromStr;

use crate::error::ScheduleError;

/// Index of a model stage (a contiguous slice of layers).
pub type StageId = u32;
/// Index of a microbatch in the whole run (0, 1, 2, ... across updates).
pub type Microbatch = u32;
/// Index of a worker: a replica of a stage position, numbered position by position.
pub type WorkerId = u32;

/// One step of a worker's program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Forward pass of a microbatch through a stage.
    Forward {
        /// Stage.
        stage: StageId,
        /// Microbatch.
        mb: Microbatch,
    },
    /// Fused backward pass: input gradient and weight gradient together.
    Backward {
        /// Stage.
        stage: StageId,
        /// Microbatch.
        mb: Microbatch,
    },
    /// The input-gradient half of a split backward (the half on the critical path).
    BackwardInput {
        /// Stage.
        stage: StageId,
        /// Microbatch.
        mb: Microbatch,
    },
    /// The weight-gradient half of a split backward (may be deferred into bubbles).
    BackwardWeight {
        /// Stage.
        stage: StageId,
        /// Microbatch.
        mb: Microbatch,
    },
    /// Collective all-reduce of one update's gradients among the replicas of a stage.
    AllReduce {
        /// Stage.
        stage: StageId,
        /// Update index at that stage.
        update: u32,
    },
    /// Optimizer step: applies the summed gradients, turning version `update` into `update + 1`.
    Update {
        /// Stage.
        stage: StageId,
        /// Update index at that stage.
        update: u32,
    },
    /// Send a stage's output activation to the worker holding the next stage.
    SendActivation {
        /// Producing stage (local to the sender).
        stage: StageId,
        /// Microbatch.
        mb: Microbatch,
        /// Receiving worker.
        to: WorkerId,
    },
    /// Receive a stage's input activation from the worker holding the previous stage.
    RecvActivation {
        /// Consuming stage (local to the receiver).
        stage: StageId,
        /// Microbatch.
        mb: Microbatch,
        /// Sending worker.
        from: WorkerId,
    },
    /// Send the gradient with respect to a stage's input to the worker holding the previous stage.
    SendGradient {
        /// Producing stage (local to the sender).
        stage: StageId,
        /// Microbatch.
        mb: Microbatch,
        /// Receiving worker.
        to: WorkerId,
    },
    /// Receive the gradient with respect to a stage's output from the worker holding the next stage.
    RecvGradient {
        /// Consuming stage (local to the receiver).
        stage: StageId,
        /// Microbatch.
        mb: Microbatch,
        /// Sending worker.
        from: WorkerId,
    },
    /// One step of a ring all-reduce, expanded: send a gradient chunk to the next replica.
    SendChunk {
        /// Stage.
        stage: StageId,
        /// Update index.
        update: u32,
        /// Ring step, `0 .. 2(r-1)`: reduce-scatter first, then all-gather.
        step: u32,
        /// Receiving worker.
        to: WorkerId,
    },
    /// One step of a ring all-reduce, expanded: receive a gradient chunk from the previous replica.
    RecvChunk {
        /// Stage.
        stage: StageId,
        /// Update index.
        update: u32,
        /// Ring step.
        step: u32,
        /// Sending worker.
        from: WorkerId,
    },
}

/// The coarse class of an action, used by cost models and statistics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ActionKind {
    /// [`Action::Forward`].
    Forward,
    /// [`Action::Backward`].
    Backward,
    /// [`Action::BackwardInput`].
    BackwardInput,
    /// [`Action::BackwardWeight`].
    BackwardWeight,
    /// [`Action::AllReduce`].
    AllReduce,
    /// [`Action::Update`].
    Update,
    /// Any send.
    Send,
    /// Any receive.
    Recv,
}

impl ActionKind {
    /// Short lower-case name (used in traces and CSV).
    pub fn name(self) -> &'static str {
        match self {
            ActionKind::Forward => "forward",
            ActionKind::Backward => "backward",
            ActionKind::BackwardInput => "backward_input",
            ActionKind::BackwardWeight => "backward_weight",
            ActionKind::AllReduce => "all_reduce",
            ActionKind::Update => "update",
            ActionKind::Send => "send",
            ActionKind::Recv => "recv",
        }
    }

    /// True for forward and backward passes (the actions that run layers).
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            ActionKind::Forward
                | ActionKind::Backward
                | ActionKind::BackwardInput
                | ActionKind::BackwardWeight
        )
    }
}

impl Action {
    /// The stage this action works on.
    pub fn stage(&self) -> StageId {
        match *self {
            Action::Forward { stage, .. }
            | Action::Backward { stage, .. }
            | Action::BackwardInput { stage, .. }
            | Action::BackwardWeight { stage, .. }
            | Action::AllReduce { stage, .. }
            | Action::Update { stage, .. }
            | Action::SendActivation { stage, .. }
            | Action::RecvActivation { stage, .. }
            | Action::SendGradient { stage, .. }
            | Action::RecvGradient { stage, .. }
            | Action::SendChunk { stage, .. }
            | Action::RecvChunk { stage, .. } => stage,
        }
    }

    /// The microbatch, for actions that have one.
    pub fn microbatch(&self) -> Option<Microbatch> {
        match *self {
            Action::Forward { mb, .. }
            | Action::Backward { mb, .. }
            | Action::BackwardInput { mb, .. }
            | Action::BackwardWeight { mb, .. }
            | Action::SendActivation { mb, .. }
            | Action::RecvActivation { mb, .. }
            | Action::SendGradient { mb, .. }
            | Action::RecvGradient { mb, .. } => Some(mb),
            _ => None,
        }
    }

    /// The update index, for all-reduce, update and chunk actions.
    pub fn update_index(&self) -> Option<u32> {
        match *self {
            Action::AllReduce { update, .. }
            | Action::Update { update, .. }
            | Action::SendChunk { update, .. }
            | Action::RecvChunk { update, .. } => Some(update),
            _ => None,
        }
    }

    /// The peer worker, for sends and receives.
    pub fn peer(&self) -> Option<WorkerId> {
        match *self {
            Action::SendActivation { to, .. }
            | Action::SendGradient { to, .. }
            | Action::SendChunk { to, .. } => Some(to),
            Action::RecvActivation { from, .. }
            | Action::RecvGradient { from, .. }
            | Action::RecvChunk { from, .. } => Some(from),
            _ => None,
        }
    }

    /// The action's class.
    pub fn kind(&self) -> ActionKind {
        match self {
            Action::Forward { .. } => ActionKind::Forward,
            Action::Backward { .. } => ActionKind::Backward,
            Action::BackwardInput { .. } => ActionKind::BackwardInput,
            Action::BackwardWeight { .. } => ActionKind::BackwardWeight,
            Action::AllReduce { .. } => ActionKind::AllReduce,
            Action::Update { .. } => ActionKind::Update,
            Action::SendActivation { .. }
            | Action::SendGradient { .. }
            | Action::SendChunk { .. } => ActionKind::Send,
            Action::RecvActivation { .. }
            | Action::RecvGradient { .. }
            | Action::RecvChunk { .. } => ActionKind::Recv,
        }
    }

    /// True for sends and receives (the actions the lowering pass inserts).
    pub fn is_communication(&self) -> bool {
        matches!(self.kind(), ActionKind::Send | ActionKind::Recv)
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Action::Forward { stage, mb } => write!(f, "s{stage}F{mb}"),
            Action::Backward { stage, mb } => write!(f, "s{stage}B{mb}"),
            Action::BackwardInput { stage, mb } => write!(f, "s{stage}I{mb}"),
            Action::BackwardWeight { stage, mb } => write!(f, "s{stage}W{mb}"),
            Action::AllReduce { stage, update } => write!(f, "s{stage}A{update}"),
            Action::Update { stage, update } => write!(f, "s{stage}U{update}"),
            Action::SendActivation { stage, mb, to } => write!(f, "s{stage}F{mb}>{to}"),
            Action::RecvActivation { stage, mb, from } => write!(f, "s{stage}F{mb}<{from}"),
            Action::SendGradient { stage, mb, to } => write!(f, "s{stage}B{mb}>{to}"),
            Action::RecvGradient { stage, mb, from } => write!(f, "s{stage}B{mb}<{from}"),
            Action::SendChunk {
                stage,
                update,
                step,
                to,
            } => write!(f, "s{stage}A{update}.{step}>{to}"),
            Action::RecvChunk {
                stage,
                update,
                step,
                from,
            } => write!(f, "s{stage}A{update}.{step}<{from}"),
        }
    }
}

/// Splits a leading run of ASCII digits off `s` and parses it as `u32`.
fn take_number<'a>(s: &'a str, what: &str, text: &str) -> Result<(u32, &'a str), ScheduleError> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    if end == 0 {
        return Err(ScheduleError::Parse {
            text: text.to_string(),
            reason: format!("expected {what}"),
        });
    }
    let value = s[..end].parse::<u32>().map_err(|_| ScheduleError::Parse {
        text: text.to_string(),
        reason: format!("{what} does not fit in 32 bits"),
    })?;
    Ok((value, &s[end..]))
}

impl FromStr for Action {
    type Err = ScheduleError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let err = |reason: &str| ScheduleError::Parse {
            text: text.to_string(),
            reason: reason.to_string(),
        };
        let rest = text
            .strip_prefix('s')
            .ok_or_else(|| err("must start with 's' and a stage number"))?;
        let (stage, rest) = take_number(rest, "a stage number", text)?;
        let mut chars = rest.chars();
        let letter = chars.next().ok_or_else(|| err("missing action letter"))?;
        let (index, rest) = take_number(chars.as_str(), "a microbatch or update number", text)?;
        // Ring steps: `s0A3.1>2`.
        let (step, rest) = match rest.strip_prefix('.') {
            Some(r) if letter == 'A' => {
                let (step, r) = take_number(r, "a ring step", text)?;
                (Some(step), r)
            }
            Some(_) => return Err(err("only all-reduce actions take a '.step'")),
            None => (None, rest),
        };
        let peer = if rest.is_empty() {
            None
        } else {
            let mut cs = rest.chars();
            let dir = cs.next().unwrap_or(' ');
            if dir != '>' && dir != '<' {
                return Err(err("unexpected text after the number"));
            }
            let (worker, tail) = take_number(cs.as_str(), "a worker number", text)?;
            if !tail.is_empty() {
                return Err(err("unexpected text after the worker number"));
            }
            Some((dir == '>', worker))
        };
        let mb = index;
        let update = index;
        Ok(match (letter, step, peer) {
            ('F', None, None) => Action::Forward { stage, mb },
            ('B', None, None) => Action::Backward { stage, mb },
            ('I', None, None) => Action::BackwardInput { stage, mb },
            ('W', None, None) => Action::BackwardWeight { stage, mb },
            ('A', None, None) => Action::AllReduce { stage, update },
            ('U', None, None) => Action::Update { stage, update },
            ('F', None, Some((true, to))) => Action::SendActivation { stage, mb, to },
            ('F', None, Some((false, from))) => Action::RecvActivation { stage, mb, from },
            ('B', None, Some((true, to))) => Action::SendGradient { stage, mb, to },
            ('B', None, Some((false, from))) => Action::RecvGradient { stage, mb, from },
            ('A', Some(step), Some((true, to))) => Action::SendChunk {
                stage,
                update,
                step,
                to,
            },
            ('A', Some(step), Some((false, from))) => Action::RecvChunk {
                stage,
                update,
                step,
                from,
            },
            ('A', Some(_), None) => return Err(err("a ring step needs '>worker' or '<worker'")),
            ('F' | 'B' | 'I' | 'W' | 'A' | 'U', _, _) => {
                return Err(err("this action letter takes no peer"));
            }
            _ => return Err(err("unknown action letter (expected F, B, I, W, A or U)")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_round_trips() {
        let all = [
            Action::Forward { stage: 1, mb: 7 },
            Action::Backward { stage: 0, mb: 12 },
            Action::BackwardInput { stage: 3, mb: 0 },
            Action::BackwardWeight { stage: 3, mb: 0 },
            Action::AllReduce {
                stage: 2,
                update: 9,
            },
            Action::Update {
                stage: 2,
                update: 9,
            },
            Action::SendActivation {
                stage: 1,
                mb: 7,
                to: 4,
            },
            Action::RecvActivation {
                stage: 2,
                mb: 7,
                from: 2,
            },
            Action::SendGradient {
                stage: 2,
                mb: 7,
                to: 2,
            },
            Action::RecvGradient {
                stage: 1,
                mb: 7,
                from: 4,
            },
            Action::SendChunk {
                stage: 0,
                update: 3,
                step: 1,
                to: 1,
            },
            Action::RecvChunk {
                stage: 0,
                update: 3,
                step: 1,
                from: 1,
            },
        ];
        for a in all {
            let text = a.to_string();
            assert_eq!(text.parse::<Action>().unwrap(), a, "{text}");
        }
    }

    #[test]
    fn bad_text_is_an_error() {
        for bad in [
            "",
            "s",
            "sF1",
            "s1",
            "s1X2",
            "s1F",
            "s1F2>",
            "s1F2>x",
            "s1I2>3",
            "s1F2.1",
            "s1A2.3",
            "s1U2<1",
            "s99999999999F1",
            "s1F2>3junk",
        ] {
            assert!(bad.parse::<Action>().is_err(), "{bad:?} parsed");
        }
    }
}
