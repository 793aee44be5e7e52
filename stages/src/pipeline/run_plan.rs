//! The one path from a request to a checked plan: generate the policy's schedule, lower it
//! (sends and receives), validate it and dry-run it for deadlock, derive its version plan, and
//! fix the partition. Training, profiling, benchmarks and tests all build a [`RunPlan`] this
//! way, so nothing runs a schedule that skipped a check.

use pipe_scheduler::{
    LowerOptions, Schedule, ScheduleSpec, VersionPlan, generate, lower, validate,
};

use super::Partition;
use crate::error::{Result, StageError};
use crate::model::Model;

/// A schedule that passed every check, its version plan, and the layers of each stage.
#[derive(Clone, Debug)]
pub struct RunPlan {
    /// The lowered, validated schedule.
    pub schedule: Schedule,
    /// Its version plan.
    pub versions: VersionPlan,
    /// Layers of each model stage.
    pub partition: Partition,
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
        Ok(RunPlan {
            schedule,
            versions,
            partition,
        })
    }
}
