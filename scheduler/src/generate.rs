//! One generator per policy. Each turns a [`ScheduleSpec`] into per-worker programs of compute,
//! all-reduce and update actions (no sends or receives: [`crate::lower`] adds those).
//!
//! Most policies share one local sequencer: a worker walks its own microbatches in order,
//! forwarding while fewer than `depth` are in flight and an optional version gate allows it,
//! and otherwise running the oldest pending backward; after its last backward of each update it
//! synchronises (all-reduce when replicated, then update). The policies differ only in `depth`,
//! the update size and the gate:
//!
//! | policy | depth at stage s | microbatches per update (all replicas) | gate for forward of update t |
//! |---|---|---|---|
//! | gpipe | a replica's share of the minibatch | minibatch | t updates done (flush) |
//! | 1f1b-flush, zb-h1 | d_s | minibatch | t updates done (flush) |
//! | pipedream, nostash, vsync | d_s | M r_s | none |
//! | 2bw | d_s | M r_s | t - 1 updates done |
//!
//! with `d_s` from [`Resolved::depths`]: `ceil(sum of replicas of stages s.. / r_s)`, which is
//! `S - s` on a straight pipeline and PipeDream's "NOAM" (workers / input-stage replicas) at
//! the input stage, deepened for asynchronous policies on unequal replica counts
//! ([`crate::depth`]).
//! `zb-h1` then splits each backward and defers the weight halves, `interleaved` follows
//! Megatron-LM's interleaved order, `zb-v` and `dualpipev` follow their published per-rank
//! orders over two V-placed chunks ([`VShaped`]), and `sequential` is the plain loop on one
//! worker.

use crate::action::{Action, Microbatch, StageId};
use crate::error::{Result, ScheduleError};
use crate::spec::{Policy, Resolved, Schedule, ScheduleSpec};

/// Generates the (unlowered) schedule for a request.
///
/// # Errors
/// [`ScheduleError::Spec`] when the request is impossible (see [`ScheduleSpec::resolve`]).
pub fn generate(spec: &ScheduleSpec) -> Result<Schedule> {
    generate_resolved(spec.resolve()?)
}

/// [`generate`] for a request already resolved (depths included).
pub(crate) fn generate_resolved(resolved: Resolved) -> Result<Schedule> {
    let streams = WorkerProgram::all(&resolved);
    let mut programs = Vec::with_capacity(streams.len());
    for mut stream in streams {
        let prog: Vec<Action> = stream.by_ref().collect();
        stream.check()?;
        programs.push(prog);
    }
    Ok(Schedule {
        resolved,
        programs,
        lowered: false,
    })
}

/// One worker's (unlowered) program, produced a block at a time: what [`generate`] collects,
/// and what the streaming simulator runs without ever holding the whole schedule.
pub(crate) struct WorkerProgram {
    buf: std::collections::VecDeque<Action>,
    source: Source,
    stalled: bool,
}

/// Where a [`WorkerProgram`]'s next block comes from.
enum Source {
    /// `sequential`: one microbatch through every stage and back per block.
    Sequential {
        stages: StageId,
        minibatch: u32,
        total: u32,
        next: Microbatch,
    },
    /// Every policy built on the local sequencer.
    Sequenced(Sequenced),
    /// Megatron's interleaved order: one minibatch per block.
    Interleaved(Interleaved),
    /// ZB-V or DualPipeV: one minibatch per block.
    VShaped(VShaped),
}

impl WorkerProgram {
    /// The program of every worker under the checked request `r`, in worker order.
    pub(crate) fn all(r: &Resolved) -> Vec<Self> {
        (0..r.layout.workers())
            .map(|w| WorkerProgram::new(r, w, &r.depths))
            .collect()
    }

    /// The program of worker `w` under the checked request `r`, given the in-flight limit of
    /// every position ([`Resolved::depths`]).
    fn new(r: &Resolved, w: u32, depths: &[u32]) -> Self {
        let sequenced = |depth, gate, split| {
            Source::Sequenced(Sequenced::new(r, w, depths, depth, gate, split))
        };
        let source = match r.policy {
            Policy::Sequential => Source::Sequential {
                stages: r.layout.stages(),
                minibatch: r.minibatch,
                total: r.total,
                next: 0,
            },
            Policy::Gpipe => sequenced(Depth::Minibatch, Gate::Flush, false),
            Policy::OneFOneBFlush => sequenced(Depth::Pipeline, Gate::Flush, false),
            Policy::ZbH1 => sequenced(Depth::Pipeline, Gate::Flush, true),
            Policy::Interleaved => Source::Interleaved(Interleaved::new(r, w)),
            Policy::PipeDream | Policy::PipeDreamNoStash | Policy::VerticalSync => {
                sequenced(Depth::Pipeline, Gate::None, false)
            }
            Policy::TwoBw => sequenced(Depth::Pipeline, Gate::OneBehind, false),
            Policy::ZbV | Policy::DualPipeV => Source::VShaped(VShaped::new(r, w)),
        };
        WorkerProgram {
            buf: std::collections::VecDeque::new(),
            source,
            stalled: false,
        }
    }

    /// `Err` when the sequencer stalled (no forward allowed and nothing to backward), which a
    /// checked request never does; the program then ended early.
    pub(crate) fn check(&self) -> Result<()> {
        if self.stalled {
            return Err(ScheduleError::Spec(
                "internal: sequencer stalled (no forward allowed, nothing to backward)".into(),
            ));
        }
        Ok(())
    }

    /// Appends the next block to the buffer; false when the program has ended.
    fn refill(&mut self) -> bool {
        match &mut self.source {
            Source::Sequential {
                stages,
                minibatch,
                total,
                next,
            } => {
                let mb = *next;
                if mb >= *total {
                    return false;
                }
                *next += 1;
                let buf = &mut self.buf;
                buf.extend((0..*stages).map(|stage| Action::Forward { stage, mb }));
                buf.extend(
                    (0..*stages)
                        .rev()
                        .map(|stage| Action::Backward { stage, mb }),
                );
                if (mb + 1) % *minibatch == 0 {
                    let update = mb / *minibatch;
                    buf.extend((0..*stages).map(|stage| Action::Update { stage, update }));
                }
                true
            }
            Source::Sequenced(s) => match s.seq.next_op() {
                Ok(Some(op)) => {
                    s.expand(op, &mut self.buf);
                    true
                }
                Ok(None) => false,
                Err(()) => {
                    self.stalled = true;
                    false
                }
            },
            Source::Interleaved(i) => i.minibatch(&mut self.buf),
            Source::VShaped(v) => v.minibatch(&mut self.buf),
        }
    }
}

impl Iterator for WorkerProgram {
    type Item = Action;

    #[inline]
    fn next(&mut self) -> Option<Action> {
        loop {
            if let Some(a) = self.buf.pop_front() {
                return Some(a);
            }
            // Fast path: a plain forward or backward needs no buffer.
            if let Source::Sequenced(s) = &mut self.source {
                if !s.split {
                    match s.seq.next_op() {
                        Ok(Some(Op::F(mb))) => return Some(Action::Forward { stage: s.stage, mb }),
                        Ok(Some(Op::B(mb))) => {
                            return Some(Action::Backward { stage: s.stage, mb });
                        }
                        Ok(Some(op)) => {
                            s.expand(op, &mut self.buf);
                            continue;
                        }
                        Ok(None) => return None,
                        Err(()) => {
                            self.stalled = true;
                            return None;
                        }
                    }
                }
            }
            if !self.refill() {
                return None;
            }
        }
    }
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

/// A step of a local sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    F(Microbatch),
    B(Microbatch),
    Sync(u32),
}

/// The shared local sequencer (see the module docs) as a state machine over the worker's
/// local microbatches `first, first + step, ...` (`n` of them).
struct Sequencer {
    first: Microbatch,
    step: u32,
    n: usize,
    depth: usize,
    /// Microbatches (of every replica) one update of the stage sums.
    update_size: u32,
    gate: Gate,
    f: usize,
    b: usize,
    u: u32,
    /// Local index one past the last backward of update `u`.
    update_end: usize,
    sync_due: bool,
}

impl Sequencer {
    /// The update count the forward of local microbatch `f` waits for.
    fn gate(&self, f: usize) -> u32 {
        let t = self.local(f) / self.update_size;
        match self.gate {
            Gate::Flush => t,
            Gate::OneBehind => t.saturating_sub(1),
            Gate::None => 0,
        }
    }

    fn local(&self, i: usize) -> Microbatch {
        self.first + self.step * i as u32
    }

    /// Local index one past the worker's last microbatch of update `t`: the first `i` with
    /// `first + step * i >= (t + 1) * update_size`, at most `n`. A replica's share of an
    /// update differs by one between replicas when the update size is not a multiple of the
    /// replica count.
    fn end_of_update(&self, t: u32) -> usize {
        let end = (u64::from(t) + 1) * u64::from(self.update_size);
        let share = end
            .saturating_sub(u64::from(self.first))
            .div_ceil(u64::from(self.step));
        (share as usize).min(self.n)
    }

    /// The next step, `Ok(None)` at the end, `Err` if the sequencer stalls.
    #[inline]
    fn next_op(&mut self) -> std::result::Result<Option<Op>, ()> {
        if self.sync_due {
            self.sync_due = false;
            let u = self.u;
            self.u += 1;
            self.update_end = self.end_of_update(self.u);
            return Ok(Some(Op::Sync(u)));
        }
        if self.b >= self.n {
            return Ok(None);
        }
        let f = self.f;
        if f < self.n && f - self.b < self.depth && self.u >= self.gate(f) {
            self.f += 1;
            return Ok(Some(Op::F(self.local(f))));
        }
        if self.b == self.f {
            return Err(());
        }
        let b = self.b;
        self.b += 1;
        if self.b == self.update_end {
            self.sync_due = true;
        }
        Ok(Some(Op::B(self.local(b))))
    }
}

/// Emits the synchronisation for one update of `stage`: all-reduce when replicated, then update.
fn push_sync(out: &mut impl Extend<Action>, stage: StageId, replicas: u32, update: u32) {
    if replicas > 1 {
        out.extend([Action::AllReduce { stage, update }]);
    }
    out.extend([Action::Update { stage, update }]);
}

/// Every policy built on [`Sequencer`]. `split` turns it into zero-bubble H1: backward split
/// into input and weight halves, weight halves deferred by `max depth - depth_s` (so every
/// stage holds at most the input stage's activations, as 1F1B does) and drained before each
/// update.
struct Sequenced {
    seq: Sequencer,
    stage: StageId,
    reps: u32,
    split: bool,
    defer: usize,
    pending: std::collections::VecDeque<Microbatch>,
}

impl Sequenced {
    fn new(r: &Resolved, w: u32, depths: &[u32], depth: Depth, gate: Gate, split: bool) -> Self {
        let layout = &r.layout;
        let max_depth = depths.iter().copied().max().unwrap_or(1) as usize;
        let (p, j) = layout.placement(w);
        let stage = p;
        let reps = layout.replicas_of(stage);
        let n = if j < r.total {
            (r.total - j).div_ceil(reps) as usize
        } else {
            0
        };
        let update_size = r.update_size(stage);
        let pipeline_depth = depths[p as usize] as usize;
        let depth = match depth {
            // The largest share of an update any replica holds.
            Depth::Minibatch => update_size.div_ceil(reps) as usize,
            Depth::Pipeline => pipeline_depth,
        };
        let mut seq = Sequencer {
            first: j,
            step: reps,
            n,
            depth,
            update_size,
            gate,
            f: 0,
            b: 0,
            u: 0,
            update_end: 0,
            sync_due: false,
        };
        seq.update_end = seq.end_of_update(0);
        Sequenced {
            seq,
            stage,
            reps,
            split,
            defer: max_depth - pipeline_depth,
            pending: std::collections::VecDeque::new(),
        }
    }

    fn expand(&mut self, op: Op, out: &mut std::collections::VecDeque<Action>) {
        let stage = self.stage;
        match op {
            Op::F(mb) => out.push_back(Action::Forward { stage, mb }),
            Op::B(mb) if self.split => {
                out.push_back(Action::BackwardInput { stage, mb });
                self.pending.push_back(mb);
                if self.pending.len() > self.defer {
                    if let Some(old) = self.pending.pop_front() {
                        out.push_back(Action::BackwardWeight { stage, mb: old });
                    }
                }
            }
            Op::B(mb) => out.push_back(Action::Backward { stage, mb }),
            Op::Sync(u) => {
                while let Some(old) = self.pending.pop_front() {
                    out.push_back(Action::BackwardWeight { stage, mb: old });
                }
                push_sync(out, stage, self.reps, u);
            }
        }
    }
}

/// Megatron-LM's interleaved 1F1B: each worker holds `v` chunks (stages `c * P + p`); inside a
/// minibatch of `m` local microbatches it runs `(P - p - 1) * 2 + (v - 1) * P` warm-up forwards,
/// then one forward and one backward at a time, then the remaining backwards. Forward `k` works
/// on chunk `(k / P) mod v` and local microbatch `(k / (P v)) P + k mod P`; backward `k` on
/// chunk `v - 1 - (k / P) mod v` and the same microbatch formula.
struct Interleaved {
    at: ChunkedWorker,
    v: usize,
}

impl Interleaved {
    fn new(r: &Resolved, w: u32) -> Self {
        Interleaved {
            at: ChunkedWorker::new(r, w),
            v: r.layout.chunks() as usize,
        }
    }

    /// Appends the next minibatch's actions; false after the last.
    fn minibatch(&mut self, out: &mut std::collections::VecDeque<Action>) -> bool {
        let Some(t) = self.at.next_minibatch() else {
            return false;
        };
        let at = &self.at;
        let (big_p, v, p) = (at.big_p, self.v, at.p);
        let total = at.local_microbatches() * v;
        let warmup = ((big_p - p - 1) * 2 + (v - 1) * big_p).min(total);
        let local = |k: usize| -> Microbatch {
            let i = (k / (big_p * v)) * big_p + k % big_p;
            at.microbatch(t, i)
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
        out.extend((0..warmup).map(fwd));
        for i in 0..total - warmup {
            out.push_back(fwd(warmup + i));
            out.push_back(bwd(i));
        }
        out.extend((total - warmup..total).map(bwd));
        for c in 0..v {
            push_sync(out, stage_of(c), at.reps, t);
        }
        true
    }
}

/// A worker's place in a layout of one replica count at every position, and its way through
/// the run's minibatches: what the chunked generators ([`Interleaved`], [`VShaped`]) share.
struct ChunkedWorker {
    /// Positions (`P`).
    big_p: usize,
    /// The worker's position.
    p: usize,
    /// The worker's replica index.
    j: u32,
    /// Replicas per stage.
    reps: u32,
    /// Microbatches per minibatch, over every replica.
    minibatch: u32,
    /// Minibatches the run has.
    minibatches: u32,
    /// The next minibatch to generate.
    next: u32,
}

impl ChunkedWorker {
    /// Worker `w` of `r`'s layout, before its first minibatch.
    fn new(r: &Resolved, w: u32) -> Self {
        let layout = &r.layout;
        let (p, j) = layout.placement(w);
        ChunkedWorker {
            big_p: layout.positions() as usize,
            p: p as usize,
            j,
            reps: layout.replica_counts()[0],
            minibatch: r.minibatch,
            minibatches: r.total / r.minibatch,
            next: 0,
        }
    }

    /// The next minibatch, now counted as generated; `None` after the last.
    fn next_minibatch(&mut self) -> Option<u32> {
        let t = self.next;
        if t >= self.minibatches {
            return None;
        }
        self.next += 1;
        Some(t)
    }

    /// The worker's microbatches per minibatch (`m`).
    fn local_microbatches(&self) -> usize {
        (self.minibatch / self.reps) as usize
    }

    /// The microbatch the worker runs as its local microbatch `i` of minibatch `t`.
    fn microbatch(&self, t: u32, i: usize) -> Microbatch {
        t * self.minibatch + self.j + self.reps * i as u32
    }
}

/// A step of a V-shaped order: chunk 0 is the worker's stage on the way down, chunk 1 its
/// stage on the way back up.
#[derive(Clone, Copy, Debug)]
enum VStep {
    /// Forward of the chunk's next microbatch.
    F(usize),
    /// Whole backward of the chunk's next microbatch.
    B(usize),
    /// Input half of the chunk's next backward; its weight half is queued.
    I(usize),
    /// Weight half of the oldest queued microbatch of the chunk.
    W(usize),
    /// Weight half of the oldest queued microbatch of any chunk (DualPipe's weight store is
    /// one queue); nothing when the queue is empty.
    WAny,
}

/// ZB-V and DualPipeV on a V layout ([`crate::ChunkShape::V`]): position `p` of `P` holds
/// stages `p` (chunk 0) and `2P - 1 - p` (chunk 1). Each minibatch runs the policy's
/// published per-rank order ([`zb_v_order`], [`dualpipe_v_order`]) over the worker's `m` local
/// microbatches of each chunk, in microbatch order per chunk, then flushes: any weight half
/// still queued, then both chunks' all-reduce and update.
struct VShaped {
    dual: bool,
    at: ChunkedWorker,
}

impl VShaped {
    fn new(r: &Resolved, w: u32) -> Self {
        VShaped {
            dual: r.policy == Policy::DualPipeV,
            at: ChunkedWorker::new(r, w),
        }
    }

    /// Appends the next minibatch's actions; false after the last.
    fn minibatch(&mut self, out: &mut std::collections::VecDeque<Action>) -> bool {
        let Some(t) = self.at.next_minibatch() else {
            return false;
        };
        let at = &self.at;
        let m = at.local_microbatches();
        let steps = if self.dual {
            dualpipe_v_order(at.big_p, at.p, m)
        } else {
            zb_v_order(at.big_p, at.p, m)
        };
        let mb = |i: usize| at.microbatch(t, i);
        let stage = [at.p as StageId, (2 * at.big_p - 1 - at.p) as StageId];
        let mut forwards = [0usize; 2];
        let mut backwards = [0usize; 2];
        let mut queued: std::collections::VecDeque<(usize, usize)> = Default::default();
        let weight = |c: usize, i: usize| Action::BackwardWeight {
            stage: stage[c],
            mb: mb(i),
        };
        for step in steps {
            match step {
                VStep::F(c) => {
                    out.push_back(Action::Forward {
                        stage: stage[c],
                        mb: mb(forwards[c]),
                    });
                    forwards[c] += 1;
                }
                VStep::B(c) => {
                    out.push_back(Action::Backward {
                        stage: stage[c],
                        mb: mb(backwards[c]),
                    });
                    backwards[c] += 1;
                }
                VStep::I(c) => {
                    out.push_back(Action::BackwardInput {
                        stage: stage[c],
                        mb: mb(backwards[c]),
                    });
                    queued.push_back((c, backwards[c]));
                    backwards[c] += 1;
                }
                VStep::W(c) => {
                    if let Some(k) = queued.iter().position(|&(qc, _)| qc == c) {
                        if let Some((c, i)) = queued.remove(k) {
                            out.push_back(weight(c, i));
                        }
                    }
                }
                VStep::WAny => {
                    if let Some((c, i)) = queued.pop_front() {
                        out.push_back(weight(c, i));
                    }
                }
            }
        }
        out.extend(queued.drain(..).map(|(c, i)| weight(c, i)));
        for s in stage {
            push_sync(out, s, at.reps, t);
        }
        true
    }
}

/// ZB-V's order for rank `p` of `big_p` over `m >= 2 big_p` microbatches per chunk (the
/// handcrafted V schedule of "Pipeline Parallelism with Controllable Memory", Qi et al. 2024,
/// as PyTorch's `ScheduleZBVZeroBubble` lays it out): warm-up forwards that fill both chunks,
/// a steady state of `F0 B0 F1 B1` with each backward's weight half right behind its input
/// half, and a drain whose input halves run first and whose weight halves fill the bubbles.
fn zb_v_order(big_p: usize, p: usize, m: usize) -> Vec<VStep> {
    use VStep::{F, I, W};
    let mut order = Vec::with_capacity(6 * m);
    order.extend(std::iter::repeat_n(F(0), 2 * (big_p - p) - 1));
    for _ in 0..p {
        order.extend([F(1), F(0)]);
    }
    for _ in 0..big_p - p {
        order.extend([F(1), I(1), W(1)]);
    }
    let (mut f0, mut f1) = (2 * big_p - p - 1, big_p);
    while f1 < f0 || f0 < m {
        if f0 < m {
            order.push(F(0));
            f0 += 1;
        }
        order.extend([I(0), W(0), F(1), I(1), W(1)]);
        f1 += 1;
    }
    for _ in 0..p {
        order.extend([I(0), I(1)]);
    }
    for _ in 0..big_p - p {
        order.extend([I(0), W(0)]);
    }
    // The flush drains what is still queued: chunk 1's weight halves, then chunk 0's.
    order.extend(std::iter::repeat_n(W(1), p));
    order.extend(std::iter::repeat_n(W(0), p));
    order
}

/// DualPipeV's order for rank `p` of `big_p` over `m >= 2 big_p` microbatches per chunk
/// (DeepSeek's DualPipe folded into a V, as the reference implementation's eight steps lay it
/// out). A step that overlaps a forward of one chunk with a backward of the other runs here as
/// the forward, then the backward. Weight halves go through one queue.
fn dualpipe_v_order(big_p: usize, p: usize, m: usize) -> Vec<VStep> {
    use VStep::{B, F, I, WAny};
    let mut order = Vec::with_capacity(6 * m);
    // 1: forwards of chunk 0; 2: one more of chunk 0 and one of chunk 1, `p + 1` times.
    order.extend(std::iter::repeat_n(F(0), 2 * (big_p - p - 1)));
    for _ in 0..=p {
        order.extend([F(0), F(1)]);
    }
    // 3: chunk 1's backward split, its weight half at once, then a forward of chunk 1.
    for _ in 0..big_p - p - 1 {
        order.extend([I(1), WAny, F(1)]);
    }
    // 4, the steady state: F0 B1 F1 B0 with whole backwards.
    for _ in 0..(m + p + 1).saturating_sub(2 * big_p) {
        order.extend([F(0), B(1), F(1), B(0)]);
    }
    // 5: B1 F1 B0.
    for _ in 0..big_p - p - 1 {
        order.extend([B(1), F(1), B(0)]);
    }
    // 6: backwards of both chunks, split from the middle step on (chunk 1 first on odd ranks).
    let steps = p + 1;
    let half = steps / 2;
    let mut split = false;
    for i in 0..steps {
        if i == half && p % 2 == 1 {
            split = true;
        }
        order.push(if split { I(1) } else { B(1) });
        if i == half && p % 2 == 0 {
            split = true;
        }
        order.push(if split { I(0) } else { B(0) });
    }
    // 7: a queued weight half, then chunk 0's backward split; 8: the queued weight halves.
    for _ in 0..big_p - p - 1 {
        order.extend([WAny, I(0)]);
    }
    order.extend(std::iter::repeat_n(WAny, p + 1));
    order
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
