//! What a schedule is asked to be (policy, layout, microbatch counts) and the schedule value.

use std::fmt;
use std::str::FromStr;

use crate::action::{Action, Microbatch, StageId, WorkerId};
use crate::error::{Result, ScheduleError};

/// A pipeline policy: how microbatches are ordered and which weight versions they see.
/// The names are the CLI's `--schedule` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// One worker runs every stage, one microbatch at a time: the plain training loop.
    Sequential,
    /// All forwards of a minibatch, then all backwards, then a flush and update.
    Gpipe,
    /// 1F1B order inside a minibatch, flush and update at its end.
    OneFOneBFlush,
    /// 1F1B with `v` model chunks per worker (Megatron's interleaved schedule), flushed.
    Interleaved,
    /// Zero-bubble H1: 1F1B with the backward split into input and weight parts, the weight parts
    /// deferred into the bubbles; flushed.
    ZbH1,
    /// PipeDream: asynchronous 1F1B with weight stashing, an update after every minibatch of each
    /// replica group.
    PipeDream,
    /// As PipeDream but without stashing: the backward uses the latest weights.
    PipeDreamNoStash,
    /// As PipeDream, but every stage uses the version the input stage had when the microbatch
    /// entered the pipeline (vertical sync).
    VerticalSync,
    /// PipeDream-2BW: updates every minibatch, minibatch `t` uses version `t - 1` everywhere.
    TwoBw,
    /// Zero-bubble V (ZB-V): two chunks per worker placed in a V (worker `p` holds stages `p`
    /// and `2P - 1 - p`), backward split into input and weight parts; flushed.
    ZbV,
    /// DualPipeV: the V placement of ZB-V with DualPipe's order (each steady step pairs a
    /// forward of one chunk with a backward of the other; weight parts deferred only in the
    /// warm-up and drain); flushed.
    DualPipeV,
}

/// How a policy picks weight versions (the whole of its staleness semantics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VersionRule {
    /// Forward uses the stage's current version; backward uses the stashed forward version.
    Stash,
    /// Forward uses the current version; backward uses the current version at backward time.
    Latest,
    /// Every stage uses the version matching what the input stage had applied when the
    /// microbatch entered the pipeline.
    VerticalSync,
    /// Minibatch `t` uses version `t - 1` (clamped at 0) for forward and backward.
    DelayedByOne,
}

/// What a pass knows when it picks its weight version ([`VersionRule::forward_version`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VersionQuery {
    /// The stage.
    pub stage: StageId,
    /// The stage's current version on this worker (updates applied so far).
    pub current: u32,
    /// The update at this stage whose gradient sum holds the microbatch
    /// ([`Resolved::update_of`]).
    pub update: u32,
    /// Vertical sync: microbatches whose gradients were in the input stage's weights when the
    /// microbatch entered the pipeline ([`VersionRule::entry_tag`]); ignored otherwise.
    pub entry_tag: u64,
    /// Microbatches per update of this stage ([`Resolved::update_size`]).
    pub update_size: u32,
}

impl VersionRule {
    /// The version a forward uses: the one home of the rule, used by the version plan and by
    /// the executor.
    pub fn forward_version(self, q: &VersionQuery) -> u32 {
        match self {
            VersionRule::Stash | VersionRule::Latest => q.current,
            VersionRule::DelayedByOne => q.update.saturating_sub(1),
            VersionRule::VerticalSync if q.stage == 0 => q.current,
            VersionRule::VerticalSync => (q.entry_tag / u64::from(q.update_size.max(1))) as u32,
        }
    }

    /// The version a backward (its input-gradient half) uses, given the version its forward
    /// used and the stage's current version when it runs.
    pub fn backward_version(self, forward: u32, current: u32) -> u32 {
        match self {
            VersionRule::Latest => current,
            _ => forward,
        }
    }

    /// The tag the input stage gives a microbatch it forwarded with `version`: the number of
    /// microbatches whose gradients that version holds (`version * update size of stage 0`).
    pub fn entry_tag(version: u32, input_update_size: u32) -> u64 {
        u64::from(version) * u64::from(input_update_size)
    }
}

impl Policy {
    /// Every policy, in the order `docs/scheduling.md` lists them.
    pub const ALL: [Policy; 11] = [
        Policy::Sequential,
        Policy::Gpipe,
        Policy::OneFOneBFlush,
        Policy::Interleaved,
        Policy::ZbH1,
        Policy::PipeDream,
        Policy::PipeDreamNoStash,
        Policy::VerticalSync,
        Policy::TwoBw,
        Policy::ZbV,
        Policy::DualPipeV,
    ];

    /// The policies that pipeline one stage per worker (one chunk): [`Policy::ALL`] less the
    /// sequential reference, the interleaved schedule and the V shapes.
    pub const ONE_CHUNK_PIPELINES: [Policy; 7] = [
        Policy::Gpipe,
        Policy::OneFOneBFlush,
        Policy::ZbH1,
        Policy::PipeDream,
        Policy::PipeDreamNoStash,
        Policy::VerticalSync,
        Policy::TwoBw,
    ];

    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Sequential => "sequential",
            Policy::Gpipe => "gpipe",
            Policy::OneFOneBFlush => "1f1b-flush",
            Policy::Interleaved => "interleaved",
            Policy::ZbH1 => "zb-h1",
            Policy::PipeDream => "pipedream",
            Policy::PipeDreamNoStash => "pipedream-nostash",
            Policy::VerticalSync => "vsync",
            Policy::TwoBw => "2bw",
            Policy::ZbV => "zb-v",
            Policy::DualPipeV => "dualpipev",
        }
    }

    /// True for policies that drain the pipeline before every update (synchronous SGD).
    pub fn is_flush(self) -> bool {
        matches!(
            self,
            Policy::Sequential
                | Policy::Gpipe
                | Policy::OneFOneBFlush
                | Policy::Interleaved
                | Policy::ZbH1
                | Policy::ZbV
                | Policy::DualPipeV
        )
    }

    /// True for the policies that place two chunks per worker in a V ([`ChunkShape::V`]).
    pub fn is_v_shaped(self) -> bool {
        matches!(self, Policy::ZbV | Policy::DualPipeV)
    }

    /// How the policy chooses weight versions.
    pub fn version_rule(self) -> VersionRule {
        match self {
            Policy::PipeDreamNoStash => VersionRule::Latest,
            Policy::VerticalSync => VersionRule::VerticalSync,
            Policy::TwoBw => VersionRule::DelayedByOne,
            _ => VersionRule::Stash,
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A policy is written by its CLI name in records and settings files.
impl serde::Serialize for Policy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for Policy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

impl Policy {
    /// A policy by name with the message as text: what a command-line flag's parser takes.
    ///
    /// # Errors
    /// The message naming the known policies.
    pub fn parse_flag(s: &str) -> std::result::Result<Policy, String> {
        s.parse::<Policy>().map_err(|e| e.to_string())
    }
}

impl FromStr for Policy {
    type Err = ScheduleError;
    fn from_str(s: &str) -> Result<Self> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Policy::ALL.iter().map(|p| p.name()).collect();
                ScheduleError::Spec(format!(
                    "unknown schedule {s:?} (expected one of {})",
                    names.join(", ")
                ))
            })
    }
}

/// How a worker's chunks map to model stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ChunkShape {
    /// Chunk `c` of position `p` is stage `c * positions + p`: the pipeline loops through the
    /// workers `chunks` times (Megatron's interleaved placement).
    #[default]
    Loop,
    /// Two chunks: position `p` holds stages `p` and `2 positions - 1 - p`, so data runs down
    /// the workers and back up (ZB-V, DualPipeV). The last position holds two neighbouring
    /// stages, and the first holds the input and the loss stage.
    V,
}

/// Where stages live: `positions` pipeline positions, each replicated `replicas[p]` times, each
/// worker holding `chunks` model stages placed by a [`ChunkShape`] (looped: stage
/// `c * positions + p` is chunk `c` of position `p`; or V-shaped). Workers are numbered
/// position by position: position 0's replicas first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    replicas: Vec<u32>,
    chunks: u32,
    shape: ChunkShape,
    offsets: Vec<u32>,
}

impl Layout {
    /// A layout with the given replica count per position and model chunks per worker.
    ///
    /// # Errors
    /// [`ScheduleError::Spec`] for zero positions, a zero replica count or zero chunks.
    pub fn new(replicas: Vec<u32>, chunks: u32) -> Result<Self> {
        if replicas.is_empty() {
            return Err(ScheduleError::Spec(
                "a pipeline needs at least one stage".into(),
            ));
        }
        if let Some(p) = replicas.iter().position(|&r| r == 0) {
            return Err(ScheduleError::Spec(format!("stage {p} has 0 replicas")));
        }
        if chunks == 0 {
            return Err(ScheduleError::Spec(
                "chunks per worker must be at least 1".into(),
            ));
        }
        let mut offsets = Vec::with_capacity(replicas.len() + 1);
        let mut total = 0u64;
        for &r in &replicas {
            offsets.push(total as u32);
            total += u64::from(r);
        }
        crate::limits::check_layout(replicas.len() as u64, total, u64::from(chunks))?;
        offsets.push(total as u32);
        Ok(Layout {
            replicas,
            chunks,
            shape: ChunkShape::Loop,
            offsets,
        })
    }

    /// A V-shaped layout ([`ChunkShape::V`]): two chunks per worker.
    ///
    /// # Errors
    /// As [`Layout::new`].
    pub fn v_shape(replicas: Vec<u32>) -> Result<Self> {
        Ok(Layout {
            shape: ChunkShape::V,
            ..Layout::new(replicas, 2)?
        })
    }

    /// How chunks map to stages.
    pub fn shape(&self) -> ChunkShape {
        self.shape
    }

    /// Number of pipeline positions.
    pub fn positions(&self) -> u32 {
        self.replicas.len() as u32
    }

    /// Model chunks per worker.
    pub fn chunks(&self) -> u32 {
        self.chunks
    }

    /// Number of model stages (`positions * chunks`).
    pub fn stages(&self) -> u32 {
        self.positions() * self.chunks
    }

    /// Total number of workers.
    pub fn workers(&self) -> u32 {
        self.offsets[self.replicas.len()]
    }

    /// Replica count per position.
    pub fn replica_counts(&self) -> &[u32] {
        &self.replicas
    }

    /// Which of its worker's chunks a stage is (`stage / positions` in both shapes): the index
    /// of the stage among [`Layout::stages_of`] its worker.
    #[inline]
    pub fn chunk_of(&self, stage: StageId) -> u32 {
        if self.chunks == 1 {
            0
        } else {
            stage / self.positions()
        }
    }

    /// Position that holds a stage.
    #[inline]
    pub fn position_of(&self, stage: StageId) -> u32 {
        if self.chunks == 1 {
            return stage;
        }
        let positions = self.positions();
        match self.shape {
            ChunkShape::Loop => stage % positions,
            ChunkShape::V if stage < positions => stage,
            ChunkShape::V => 2 * positions - 1 - stage,
        }
    }

    /// Stage of chunk `c` at `position`.
    #[inline]
    pub fn stage_at(&self, position: u32, c: u32) -> StageId {
        let positions = self.positions();
        match self.shape {
            ChunkShape::V if c == 1 => 2 * positions - 1 - position,
            _ => c * positions + position,
        }
    }

    /// Number of replicas of a stage.
    pub fn replicas_of(&self, stage: StageId) -> u32 {
        self.replicas[self.position_of(stage) as usize]
    }

    /// The worker running `replica` of `position`.
    pub fn worker(&self, position: u32, replica: u32) -> WorkerId {
        self.offsets[position as usize] + replica
    }

    /// `(position, replica)` of a worker.
    pub fn placement(&self, worker: WorkerId) -> (u32, u32) {
        let p = self.offsets.partition_point(|&o| o <= worker) - 1;
        (p as u32, worker - self.offsets[p])
    }

    /// The replica of `stage` that handles microbatch `mb` (round-robin).
    pub fn replica_for(&self, stage: StageId, mb: Microbatch) -> u32 {
        mb % self.replicas_of(stage)
    }

    /// The worker that handles microbatch `mb` at `stage`.
    #[inline]
    pub fn worker_for(&self, stage: StageId, mb: Microbatch) -> WorkerId {
        // The hot path of lowering and simulation: skip the divisions where they are no-ops.
        let p = if self.chunks == 1 {
            stage
        } else {
            self.position_of(stage)
        };
        let r = self.replicas[p as usize];
        let j = if r == 1 { 0 } else { mb % r };
        self.worker(p, j)
    }

    /// The stages a worker holds, in chunk order.
    pub fn stages_of(&self, worker: WorkerId) -> impl Iterator<Item = StageId> + '_ {
        let (p, _) = self.placement(worker);
        (0..self.chunks).map(move |c| self.stage_at(p, c))
    }

    /// The workers holding a stage, replica by replica.
    pub fn group(&self, stage: StageId) -> std::ops::Range<WorkerId> {
        let p = self.position_of(stage) as usize;
        self.offsets[p]..self.offsets[p + 1]
    }

    /// How many of its microbatches a replica of `position` has in flight in 1F1B's steady
    /// state: `ceil(sum of replicas at positions >= p / r_p)`. That is `S - p` on a straight
    /// pipeline, and PipeDream's "NOAM" (workers over input-stage replicas) at the input stage.
    pub fn in_flight_limit(&self, position: u32) -> u32 {
        let p = position as usize;
        let downstream: u64 = self.replicas[p..].iter().map(|&x| u64::from(x)).sum();
        downstream.div_ceil(u64::from(self.replicas[p])) as u32
    }

    /// [`Layout::in_flight_limit`] of every position, in one pass over suffix sums.
    pub fn in_flight_limits(&self) -> Vec<u32> {
        let mut downstream = 0u64;
        let mut limits = vec![0u32; self.replicas.len()];
        for (p, &r) in self.replicas.iter().enumerate().rev() {
            downstream += u64::from(r);
            limits[p] = downstream.div_ceil(u64::from(r)) as u32;
        }
        limits
    }

    /// The largest replica count: a synchronous minibatch is `M` times this many microbatches,
    /// so each replica of the most replicated stage takes exactly `M` per update.
    pub fn widest(&self) -> u32 {
        self.replicas.iter().copied().max().unwrap_or(1)
    }

    /// Least common multiple of the replica counts: an asynchronous run is a whole number of
    /// `M` times this many microbatches, so that every stage (updating after `M r_s`) ends on
    /// a whole update.
    pub fn replica_lcm(&self) -> u32 {
        self.replicas
            .iter()
            .fold(1u64, |a, &r| lcm(a, u64::from(r))) as u32
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: u64, b: u64) -> u64 {
    a / gcd(a, b) * b
}

/// How long a schedule runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Length {
    /// A number of minibatches (updates of the most replicated stage).
    Updates(u32),
    /// A number of microbatches in total; must be a whole number of minibatches.
    Microbatches(u32),
}

/// The request a generator turns into a schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduleSpec {
    /// The policy.
    pub policy: Policy,
    /// Pipeline stages (positions). For `interleaved`, the model has `stages * chunks` stages;
    /// for the V-shaped policies (`zb-v`, `dualpipev`), `2 * stages`.
    pub stages: u32,
    /// Replicas per stage: one value for all stages, or one per stage.
    pub replicas: Vec<u32>,
    /// Model chunks per worker (`interleaved`; the V-shaped policies always hold 2, and
    /// accept 1 or 2 here; 1 otherwise).
    pub chunks: u32,
    /// Microbatches per update, per replica (`M`).
    pub microbatches: u32,
    /// How long the schedule runs.
    pub length: Length,
}

impl ScheduleSpec {
    /// A spec with one replica per stage, one chunk and one update.
    pub fn new(policy: Policy, stages: u32, microbatches: u32) -> Self {
        ScheduleSpec {
            policy,
            stages,
            replicas: vec![1],
            chunks: 1,
            microbatches,
            length: Length::Updates(1),
        }
    }

    /// Sets the replica list (one value for all stages, or one per stage).
    pub fn with_replicas(mut self, replicas: Vec<u32>) -> Self {
        self.replicas = replicas;
        self
    }

    /// Sets the number of model chunks per worker.
    pub fn with_chunks(mut self, chunks: u32) -> Self {
        self.chunks = chunks;
        self
    }

    /// Sets how long the schedule runs.
    pub fn with_length(mut self, length: Length) -> Self {
        self.length = length;
        self
    }

    /// Microbatch passes of the schedule (its microbatches times its model stages), as
    /// resolving it counts and checks them, without generating anything: what a command that
    /// prints every action can bound its output by before the schedule is built.
    ///
    /// # Errors
    /// As [`ScheduleSpec::resolve`].
    pub fn passes(&self) -> Result<u64> {
        let shape = self.resolve_shape()?;
        Ok(u64::from(shape.total)
            .saturating_mul(u64::from(self.stages))
            .saturating_mul(u64::from(shape.layout.chunks())))
    }

    /// [`ScheduleSpec::resolve`] up to the in-flight depths, which are NOAM here: the checks,
    /// the layout and the sizes. `resolve` itself lives in [`crate::depth`], which deepens
    /// them by simulating, so that this file does not depend on the generators.
    ///
    /// # Errors
    /// As [`ScheduleSpec::resolve`].
    pub(crate) fn resolve_shape(&self) -> Result<Resolved> {
        let spec_err = |m: String| Err(ScheduleError::Spec(m));
        if self.stages == 0 {
            return spec_err("--stages must be at least 1".into());
        }
        if self.microbatches == 0 {
            return spec_err("--microbatches must be at least 1".into());
        }
        crate::limits::check_microbatches(u64::from(self.microbatches))?;
        let workers: u64 = match self.replicas.len() {
            1 => u64::from(self.replicas[0]).saturating_mul(u64::from(self.stages)),
            _ => self.replicas.iter().map(|&r| u64::from(r)).sum(),
        };
        let chunks = if self.policy.is_v_shaped() {
            2
        } else {
            self.chunks
        };
        crate::limits::check_layout(u64::from(self.stages), workers, u64::from(chunks))?;
        let replicas = self.stage_replicas()?;
        self.check_chunks()?;
        let pipeline = if self.policy.is_v_shaped() {
            Layout::v_shape(replicas)?
        } else {
            Layout::new(replicas, self.chunks)?
        };
        // Synchronous policies update every stage once per minibatch of `M` per replica of the
        // widest stage. Asynchronous ones update stage s after `M r_s`; their run unit is the
        // least common multiple of those, so that every stage ends on a whole update.
        let unit = if self.policy.is_flush() {
            pipeline.widest()
        } else {
            pipeline.replica_lcm()
        };
        let minibatch = u64::from(self.microbatches) * u64::from(unit);
        if minibatch > u64::from(u32::MAX / 4) {
            return spec_err("microbatches per update times replicas is too large".into());
        }
        let minibatch = minibatch as u32;
        self.check_policy_layout(&pipeline)?;
        let total = self.total_microbatches(minibatch, unit)?;
        crate::limits::check_schedule(
            total,
            u64::from(self.stages) * u64::from(pipeline.chunks()),
        )?;
        let total = total as u32;
        // `sequential` runs everything on one worker: one position holding every stage.
        let layout = if self.policy == Policy::Sequential {
            Layout::new(vec![1], self.stages)?
        } else {
            pipeline
        };
        let depths = layout.in_flight_limits();
        Ok(Resolved {
            policy: self.policy,
            layout,
            microbatches_per_update: self.microbatches,
            minibatch,
            total,
            depths,
        })
    }

    /// The replicas of every stage: the one value given for all, or the list of one per stage.
    ///
    /// # Errors
    /// [`ScheduleError::Spec`] for a list of neither length, or a stage of 0 replicas.
    fn stage_replicas(&self) -> Result<Vec<u32>> {
        let spec_err = |m: String| Err(ScheduleError::Spec(m));
        let replicas = match self.replicas.len() {
            1 => vec![self.replicas[0]; self.stages as usize],
            n if n == self.stages as usize => self.replicas.clone(),
            n => {
                return spec_err(format!(
                    "--replicas lists {n} values for {} stages (give one value, or one per stage)",
                    self.stages
                ));
            }
        };
        if let Some(p) = replicas.iter().position(|&r| r == 0) {
            return spec_err(format!("stage {p} has 0 replicas"));
        }
        Ok(replicas)
    }

    /// Checks the chunks per worker: at least 1, at most 2 for the V-shaped policies, and more
    /// than 1 only for them and `interleaved`.
    ///
    /// # Errors
    /// [`ScheduleError::Spec`] naming the rule broken.
    fn check_chunks(&self) -> Result<()> {
        let spec_err = |m: String| Err(ScheduleError::Spec(m));
        if self.chunks == 0 {
            return spec_err("--chunks must be at least 1".into());
        }
        let v_shaped = self.policy.is_v_shaped();
        if v_shaped && self.chunks > 2 {
            return spec_err(format!(
                "--chunks {}: {} holds exactly 2 chunks per worker (placed in a V)",
                self.chunks, self.policy
            ));
        }
        if self.chunks > 1 && self.policy != Policy::Interleaved && !v_shaped {
            return spec_err(format!(
                "--chunks {} needs --schedule interleaved ({} runs one chunk per worker)",
                self.chunks, self.policy
            ));
        }
        Ok(())
    }

    /// The microbatches the schedule runs in all, with minibatches of `minibatch` (`unit`
    /// times the microbatches per replica).
    ///
    /// # Errors
    /// [`ScheduleError::Spec`] for a length of nothing, or microbatches that are not a whole
    /// number of minibatches.
    fn total_microbatches(&self, minibatch: u32, unit: u32) -> Result<u64> {
        let spec_err = |m: String| Err(ScheduleError::Spec(m));
        match self.length {
            Length::Updates(0) | Length::Microbatches(0) => {
                spec_err("the schedule must run at least one update".into())
            }
            Length::Updates(k) => Ok(u64::from(k) * u64::from(minibatch)),
            Length::Microbatches(n) => {
                if n % minibatch != 0 {
                    return spec_err(format!(
                        "{n} microbatches is not a whole number of minibatches of {minibatch} \
                         ({} per replica times {unit} for the replica layout)",
                        self.microbatches
                    ));
                }
                Ok(u64::from(n))
            }
        }
    }

    /// The layout rules of particular policies: interleaved and the V-shaped ones need one
    /// replica count everywhere and enough microbatches to fill their chunks; 2BW needs enough
    /// microbatches for version `t - 1` to exist when minibatch `t` starts.
    ///
    /// # Errors
    /// [`ScheduleError::Spec`] naming the policy and the rule.
    fn check_policy_layout(&self, pipeline: &Layout) -> Result<()> {
        let spec_err = |m: String| Err(ScheduleError::Spec(m));
        let counts = pipeline.replica_counts();
        let uniform = counts.iter().all(|&r| r == counts[0]);
        if self.policy == Policy::Interleaved {
            if !uniform {
                return spec_err("interleaved needs the same replica count at every stage".into());
            }
            if self.microbatches % self.stages != 0 {
                return spec_err(format!(
                    "interleaved needs microbatches per update to be a multiple of the stage \
                     count: {} is not a multiple of {}",
                    self.microbatches, self.stages
                ));
            }
        }
        if self.policy.is_v_shaped() {
            if !uniform {
                return spec_err(format!(
                    "{} needs the same replica count at every stage",
                    self.policy
                ));
            }
            let least = u64::from(self.stages) * 2;
            if u64::from(self.microbatches) < least {
                return spec_err(format!(
                    "{} needs at least 2 x stages = {least} microbatches per update (its warm-up \
                     fills both chunks of every worker); got {}",
                    self.policy, self.microbatches
                ));
            }
        }
        if self.policy == Policy::TwoBw {
            // Minibatch t uses version t - 1, which must exist by the time its first forward
            // runs: at most M + 1 microbatches in flight per replica.
            let deepest = (0..pipeline.positions())
                .map(|p| pipeline.in_flight_limit(p))
                .max()
                .unwrap_or(1);
            if self.microbatches + 1 < deepest {
                return spec_err(format!(
                    "2bw needs at least {} microbatches per update with this layout (it keeps \
                     {deepest} in flight per replica and uses version t-1 for minibatch t); \
                     got {}",
                    deepest - 1,
                    self.microbatches
                ));
            }
        }
        Ok(())
    }
}

/// A checked request: the layout and the sizes a generator works with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// The policy.
    pub policy: Policy,
    /// Where stages live.
    pub layout: Layout,
    /// `M`: microbatches per update per replica, as requested.
    pub microbatches_per_update: u32,
    /// Microbatches in one minibatch. Synchronous policies (flush, `sequential`): `M` times the
    /// largest replica count, the training batch of every update; each replica of the most
    /// replicated stage takes `M` of them, and a stage with fewer replicas splits it
    /// round-robin, so its replicas' shares differ by at most one. Asynchronous policies,
    /// whose stage `s` updates after `M r_s`: `M` times the least common multiple of the
    /// replica counts, the unit a run is a whole number of.
    pub minibatch: u32,
    /// Microbatches in the whole run.
    pub total: u32,
    /// How many of its microbatches a replica of each position keeps in flight (forward done,
    /// backward not yet) under the 1F1B-style policies: [`Layout::in_flight_limits`], deepened
    /// for asynchronous policies on unequal replica counts ([`crate::depth`]).
    pub depths: Vec<u32>,
}

impl Resolved {
    /// Microbatches that one update of `stage` sums: all of a minibatch for flush policies and
    /// `sequential`; `M` per replica for the asynchronous ones.
    pub fn update_size(&self, stage: StageId) -> u32 {
        if self.policy.is_flush() {
            self.minibatch
        } else {
            self.microbatches_per_update * self.layout.replicas_of(stage)
        }
    }

    /// Update index at `stage` whose gradient sum holds microbatch `mb`.
    pub fn update_of(&self, stage: StageId, mb: Microbatch) -> u32 {
        mb / self.update_size(stage)
    }

    /// Number of updates `stage` makes over the run.
    pub fn updates_at(&self, stage: StageId) -> u32 {
        self.total / self.update_size(stage)
    }
}

/// A schedule: one program (ordered action list) per worker, and what it was made from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// The checked request.
    pub resolved: Resolved,
    /// `programs[w]` is worker `w`'s program.
    pub programs: Vec<Vec<Action>>,
    /// True once sends and receives have been inserted.
    pub lowered: bool,
}

impl Schedule {
    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.resolved.layout
    }

    /// Number of model stages.
    pub fn stages(&self) -> u32 {
        self.resolved.layout.stages()
    }

    /// Number of workers.
    pub fn workers(&self) -> u32 {
        self.resolved.layout.workers()
    }

    /// Microbatches in the whole run.
    pub fn total_microbatches(&self) -> u32 {
        self.resolved.total
    }

    /// Total number of actions over all workers.
    pub fn len(&self) -> usize {
        self.programs.iter().map(Vec::len).sum()
    }

    /// True if no worker has any action.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The schedule as text: one line per worker, `wN:` then its actions separated by spaces.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        for (w, prog) in self.programs.iter().enumerate() {
            out.push_str(&format!("w{w}:"));
            for a in prog {
                out.push(' ');
                out.push_str(&a.to_string());
            }
            out.push('\n');
        }
        out
    }

    /// Replaces the programs with ones parsed from [`Schedule::to_text`]'s format (lines
    /// `wN: a a a`, blank lines and `#` comments ignored). The result counts as lowered when
    /// it holds sends or receives, or runs on one worker (where the two forms are the same).
    ///
    /// # Errors
    /// [`ScheduleError::Parse`] for a malformed line or action, or a worker number outside the
    /// layout.
    pub fn with_text(mut self, text: &str) -> Result<Self> {
        let workers = self.workers() as usize;
        let mut programs = vec![Vec::new(); workers];
        for line in text.lines() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bad = |reason: &str| ScheduleError::Parse {
                text: line.to_string(),
                reason: reason.to_string(),
            };
            let (head, body) = line
                .split_once(':')
                .ok_or_else(|| bad("expected 'wN: actions'"))?;
            let w: usize = head
                .trim()
                .strip_prefix('w')
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| bad("expected a worker label like 'w0:'"))?;
            if w >= workers {
                return Err(bad(&format!(
                    "worker {w} is outside the layout ({workers} workers)"
                )));
            }
            for tok in body.split_whitespace() {
                programs[w].push(tok.parse()?);
            }
        }
        self.lowered = workers == 1 || programs.iter().flatten().any(Action::is_communication);
        self.programs = programs;
        Ok(self)
    }
}
