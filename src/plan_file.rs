//! Plans as files and plans made on the spot: the plan file `pipe plan -o` writes and `pipe
//! train --plan` reads, the profile-then-plan step behind `pipe train --workers`, and turning a
//! planner's stages into the partition and replica counts a run takes. No argument handling:
//! this module uses only the library crates and [`crate::output`]'s errors.

use std::path::Path;

use anyhow::Result;
use pipe_kernels::{Backend, CpuBackend};
use pipe_scheduler::{PartitionPlan, PlanOptions, Policy, Profile};
use pipe_stages::model::{Model, ModelSpec};
use pipe_stages::pipeline::Partition;
use pipe_stages::profile::{ProfileOptions, profile_model};
use serde::{Deserialize, Serialize};

use crate::output::{bad_input, schedule_error};

/// A plan as `pipe plan -o` writes it and `pipe train --plan` reads it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    /// Model preset the profile was taken from (empty when unknown).
    #[serde(default)]
    pub model: String,
    /// Samples per microbatch the profile was taken at (0 when unknown).
    #[serde(default)]
    pub microbatch_size: usize,
    /// Schedule.
    pub schedule: String,
    /// Microbatches per update per replica.
    pub microbatches: u32,
    /// Inclusive layer ranges per stage, as `--partition` takes them.
    pub partition: String,
    /// Replicas per stage.
    pub replicas: Vec<u32>,
    /// Cost model that made the plan.
    #[serde(default)]
    pub cost_model: String,
    /// Predicted seconds per microbatch (slowest stage).
    #[serde(default)]
    pub time_per_microbatch: f64,
    /// The simulator's seconds per microbatch, when simulated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub simulated_time_per_microbatch: Option<f64>,
}

impl PlanFile {
    /// The file for a plan made from `profile`.
    ///
    /// # Errors
    /// When the plan's stages do not tile the layers (never, for a plan the planner made).
    pub fn from_plan(profile: &Profile, plan: &PartitionPlan) -> Result<Self> {
        let (partition, replicas) = layout_of(plan)?;
        Ok(PlanFile {
            model: profile.model.clone(),
            microbatch_size: profile.microbatch_size,
            schedule: plan.policy.name().into(),
            microbatches: plan.microbatches,
            partition: partition.to_string(),
            replicas,
            cost_model: plan.cost_model.into(),
            time_per_microbatch: plan.time_per_microbatch,
            simulated_time_per_microbatch: plan.simulated,
        })
    }

    /// Reads and checks a plan file.
    ///
    /// # Errors
    /// A bad-input error naming the file and the problem.
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad_input(format!("plan {}: {e}", path.display())))?;
        let f: PlanFile = toml::from_str(&text).map_err(|e| {
            bad_input(format!(
                "plan {}: {}",
                path.display(),
                e.to_string().replace('\n', " ")
            ))
        })?;
        if f.replicas.is_empty() || f.replicas.contains(&0) || f.microbatches == 0 {
            return Err(bad_input(format!(
                "plan {}: replicas and microbatches must be at least 1",
                path.display()
            )));
        }
        Ok(f)
    }
}

/// Profiles the model preset `name` on `be`.
///
/// # Errors
/// An unknown preset (bad input) or a failure while measuring.
pub fn profile_preset(name: &str, opts: &ProfileOptions, be: &dyn Backend) -> Result<Profile> {
    let model = Model::new(&ModelSpec::preset(name)?)?;
    Ok(profile_model(&model, name, be, opts)?)
}

/// What `pipe train --workers W` plans with: the model profiled at the run's microbatch size
/// with one thread, planned under the default model for the run's schedule. In-process
/// activations move for free; the all-reduce's measured cost sets the bandwidth.
///
/// # Errors
/// Profiling or planning failures (an unplannable schedule is bad input).
pub fn auto_plan(
    name: &str,
    spec: &ModelSpec,
    microbatch_size: usize,
    policy: &str,
    microbatches: u32,
    workers: u32,
) -> Result<(Profile, PartitionPlan)> {
    let model = Model::new(spec)?;
    let be = CpuBackend::new(1)?;
    let opts = ProfileOptions {
        warmup: 2,
        repeats: 5,
        calibrate: Some(microbatches),
        concurrent: pipe_experiments::partition::busy_workers(workers),
        ..ProfileOptions::new(microbatch_size)
    };
    let profile = profile_model(&model, name, &be, &opts)?;
    let policy: Policy = policy.parse().map_err(schedule_error)?;
    let bandwidth = pipe_experiments::partition::in_process_bandwidth(&model, microbatch_size)?;
    let opts = PlanOptions {
        policy,
        microbatches,
        ..PlanOptions::new(workers, bandwidth)
    };
    let plan = pipe_scheduler::plan_checked(&profile, &opts).map_err(schedule_error)?;
    Ok((profile, plan))
}

/// A plan's stages as the partition `--partition` takes (its text is what a plan file holds),
/// and its replica counts.
///
/// # Errors
/// When the stages do not tile the layers (never, for a plan the planner made).
pub fn layout_of(plan: &PartitionPlan) -> Result<(Partition, Vec<u32>)> {
    let ranges = plan.stages.iter().map(|s| s.layers.clone()).collect();
    let partition = Partition::new(ranges, plan.order.len())?;
    Ok((partition, plan.stages.iter().map(|s| s.replicas).collect()))
}
