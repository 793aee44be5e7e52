//! The layout `pipe plan -o` writes and `pipe train --plan` runs.

use pipe_scheduler::Policy;
use serde::{Deserialize, Serialize};

use crate::error::{Result, StageError};
use crate::partition::Partition;

/// A plan as `pipe plan -o` writes it and `pipe train --plan` reads it (TOML).
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
    /// Recomputation per stage, where the planner chose it to fit the memory bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute: Option<crate::layer::StageRecompute>,
    /// The host of each worker in rank order, where the plan placed its workers on hosts
    /// (`pipe plan --hosts` or `--cluster`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hosts: Option<Vec<String>>,
}

/// The recomputation `plan` chose per stage (`None` where no stage recomputes).
fn plan_recompute(plan: &pipe_scheduler::PartitionPlan) -> Option<crate::layer::StageRecompute> {
    use crate::layer::{Recompute, StageRecompute};
    plan.stages.iter().any(|s| s.recompute).then(|| {
        let kinds = plan
            .stages
            .iter()
            .map(|s| {
                if s.recompute {
                    Recompute::Full
                } else {
                    Recompute::None
                }
            })
            .collect();
        StageRecompute::per_stage(kinds).unwrap_or_default()
    })
}

impl PlanFile {
    /// A plan file for `plan`, made from `profile`.
    ///
    /// # Errors
    /// When the plan's stages do not tile the profile's layers.
    pub fn from_plan(
        profile: &pipe_scheduler::Profile,
        plan: &pipe_scheduler::PartitionPlan,
    ) -> Result<Self> {
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
            recompute: plan_recompute(plan),
            hosts: None,
        })
    }

    /// Parses and checks a plan file's text; `source` names it in errors.
    ///
    /// # Errors
    /// [`StageError::Config`] naming the file and the problem.
    pub fn parse(text: &str, source: &str) -> Result<Self> {
        let f: PlanFile = toml::from_str(text).map_err(|e| {
            StageError::Config(format!(
                "plan {source}: {}",
                e.to_string().replace('\n', " ")
            ))
        })?;
        f.check()
            .map_err(|e| StageError::Config(format!("plan {source}: {e}")))?;
        Ok(f)
    }

    /// Checks what a plan file says as its flags would be checked, before any of it is used:
    /// a schedule the planner plans, counts within [`crate::limits`], finite figures. The
    /// partition is checked against the model when the run resolves.
    fn check(&self) -> std::result::Result<(), String> {
        let policy: Policy = self
            .schedule
            .parse()
            .map_err(|e: pipe_scheduler::ScheduleError| e.to_string())?;
        pipe_scheduler::planner::check_plannable(policy).map_err(|e| e.to_string())?;
        if self.replicas.is_empty() || self.replicas.contains(&0) || self.microbatches == 0 {
            return Err("replicas and microbatches must be at least 1".into());
        }
        let workers: u64 = self.replicas.iter().map(|&r| u64::from(r)).sum();
        pipe_scheduler::limits::check_layout(self.replicas.len() as u64, workers, 1)
            .and_then(|()| pipe_scheduler::limits::check_microbatches(u64::from(self.microbatches)))
            .map_err(|e| e.to_string())?;
        if self.microbatch_size > 0 {
            crate::limits::check_count(
                "microbatch_size",
                self.microbatch_size as u64,
                crate::limits::MAX_TENSOR_ELEMENTS,
                "a microbatch is one tensor",
            )
            .map_err(|e| e.to_string())?;
        }
        let times = [
            Some(self.time_per_microbatch),
            self.simulated_time_per_microbatch,
        ];
        if let Some(t) = times
            .into_iter()
            .flatten()
            .find(|t| !(t.is_finite() && *t >= 0.0))
        {
            return Err(format!(
                "a predicted time must be a finite number >= 0, got {t}"
            ));
        }
        if let Some(r) = &self.recompute {
            r.check_stages(self.replicas.len() as u32)?;
        }
        if let Some(hosts) = &self.hosts {
            if hosts.len() as u64 != workers {
                return Err(format!(
                    "hosts names {} workers' hosts, the plan has {workers} workers",
                    hosts.len()
                ));
            }
            hosts
                .iter()
                .try_for_each(|h| pipe_scheduler::planner::placement::check_host_name(h))?;
        }
        Ok(())
    }
}

/// A plan's stages as the partition `--partition` takes, and its replica counts.
///
/// # Errors
/// When the stages do not tile the layers (never, for a plan the planner made).
pub fn layout_of(plan: &pipe_scheduler::PartitionPlan) -> Result<(Partition, Vec<u32>)> {
    let ranges = plan.stages.iter().map(|s| s.layers.clone()).collect();
    let partition = Partition::new(ranges, plan.order.len())?;
    Ok((partition, plan.stages.iter().map(|s| s.replicas).collect()))
}
