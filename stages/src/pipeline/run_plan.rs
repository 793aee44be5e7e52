//! The one path from a request to a checked plan: generate the policy's schedule, lower it
//! (sends and receives), validate it and dry-run it for deadlock, derive its version and norm
//! plans, and fix the partition. Training, profiling, benchmarks and tests all build a [`RunPlan`] this
//! way, so nothing runs a schedule that skipped a check.

use pipe_scheduler::planner::buckets::{BucketSize, StageBuckets};
use pipe_scheduler::{
    LowerOptions, NormPlan, Schedule, ScheduleSpec, VersionPlan, generate, lower, validate,
};

use crate::error::{Result, StageError};
use crate::model::Model;
use crate::partition::Partition;

/// A schedule that passed every check, its version plan, and the layers of each stage.
#[derive(Clone, Debug)]
pub struct RunPlan {
    /// The lowered, validated schedule.
    pub schedule: Schedule,
    /// Its version plan.
    pub versions: VersionPlan,
    /// Which stages' gradient norms each update's global norm adds (gradient clipping).
    pub norms: NormPlan,
    /// Layers of each model stage.
    pub partition: Partition,
    /// Each stage's all-reduce bucket size ([`super::gradient_buckets`]), one per stage:
    /// part of the plan because the buckets fix the order of the replicas' additions, which
    /// the reference trainer must follow.
    pub buckets: StageBuckets,
    /// The precision all-reduce rings send in (f32, or bf16 with f32 sums): part of the
    /// numerics, like the buckets.
    pub allreduce_wire: pipe_transport::frame::WireDType,
}

impl RunPlan {
    /// Generates, lowers, checks and plans `spec` for `model`, with `partition` or (when
    /// `None`) the FLOP-balanced split.
    ///
    /// # Errors
    /// An impossible request or a schedule that fails its checks; a partition with another
    /// stage count than the schedule's or another layer count than the model's.
    pub fn new(model: &Model, spec: &ScheduleSpec, partition: Option<Partition>) -> Result<Self> {
        let schedule = lower(&generate(spec)?, LowerOptions::default());
        validate::check(&schedule)?;
        let versions = VersionPlan::derive(&schedule)?;
        let norms = NormPlan::derive(&schedule)?;
        let stages = schedule.stages() as usize;
        let partition = match partition {
            Some(p) => p,
            None => {
                let layout = schedule.layout();
                let replicas: Vec<u32> =
                    (0..stages as u32).map(|s| layout.replicas_of(s)).collect();
                Partition::balanced(model, &replicas)?
            }
        };
        if partition.stages() != stages {
            return Err(StageError::Config(format!(
                "--partition has {} stages but the schedule needs {stages}",
                partition.stages()
            )));
        }
        if partition.layers() != model.len() {
            return Err(StageError::Config(format!(
                "the partition covers {} layers but the model has {}",
                partition.layers(),
                model.len()
            )));
        }
        // Stages sharing a tied parameter sum its gradients at every update, so they must
        // update equally often (asynchronous policies update a stage after M r_s microbatches).
        for s in 0..stages {
            for p in model.tie_partners(partition.ranges(), s) {
                let rate = |s: usize| {
                    let s = s as u32;
                    (versions.updates_at(s), schedule.resolved.update_size(s))
                };
                if rate(s) != rate(p) {
                    return Err(StageError::Config(format!(
                        "stages {s} and {p} share a tied parameter but update at different \
                         rates ({} and {} updates of {} and {} microbatches); give them the same \
                         replica count or use a flush schedule",
                        rate(s).0,
                        rate(p).0,
                        rate(s).1,
                        rate(p).1
                    )));
                }
            }
        }
        Ok(RunPlan {
            schedule,
            versions,
            norms,
            partition,
            buckets: StageBuckets::uniform(super::DEFAULT_BUCKET_SIZE, stages),
            allreduce_wire: pipe_transport::frame::WireDType::F32,
        })
    }

    /// This plan with all-reduce rings that send in `wire`'s precision.
    #[must_use]
    pub fn with_allreduce_wire(mut self, wire: pipe_transport::frame::WireDType) -> Self {
        self.allreduce_wire = wire;
        self
    }

    /// This plan with every stage's all-reduce buckets of `size`.
    #[must_use]
    pub fn with_bucket_size(mut self, size: BucketSize) -> Self {
        self.buckets = StageBuckets::uniform(size, self.schedule.stages() as usize);
        self
    }

    /// This plan with each stage's own bucket size (`sizes`, the first stage's first; a list
    /// of another length than the stages is ignored).
    #[must_use]
    pub fn with_stage_buckets(mut self, sizes: &StageBuckets) -> Self {
        if sizes.len() == self.schedule.stages() as usize {
            self.buckets = sizes.clone();
        }
        self
    }

    /// The all-reduce bucket size of `stage`.
    pub fn bucket_size_of(&self, stage: u32) -> BucketSize {
        self.buckets
            .get(stage as usize)
            .unwrap_or(super::DEFAULT_BUCKET_SIZE)
    }

    /// The minibatches (steps) its schedule runs.
    pub fn steps(&self) -> u64 {
        let minibatch = u64::from(self.schedule.resolved.minibatch.max(1));
        u64::from(self.schedule.total_microbatches()) / minibatch
    }
}
