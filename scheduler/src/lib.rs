//! `pipe-scheduler` owns planning, and only planning: layer profiles and the partitioner
//! (PipeDream's optimizer and the default cost model, [`planner`]), schedules as data
//! (per-worker action lists for every policy), their lowering into sends and receives,
//! validation and deadlock detection, version plans, the timed simulator and timeline exports,
//! the in-flight depths of unequal replica layouts ([`depth`]), text grids ([`grid`]) and the
//! bounds on every size a schedule may have ([`limits`]).
//!
//! It is pure by design: no tensors, no threads, no I/O, no clock. A schedule is a value made
//! by one generator per policy ([`generate`]), and everything else (the lowering pass, the
//! validator, the version plan, the simulator and, in `pipe-stages`, the executor) interprets
//! that value without knowing which policy made it. That is what lets a new policy be added
//! in one place, lets tests hold schedules as golden text, and lets a plan be checked and
//! simulated in milliseconds before a worker starts.
//!
//! The usual path:
//!
//! ```
//! use pipe_scheduler::{generate, lower, validate, simulate, CostModel, LowerOptions, Policy,
//!                      ScheduleSpec, SimOptions, StageCost, VersionPlan};
//! let spec = ScheduleSpec::new(Policy::OneFOneBFlush, 4, 8);
//! let schedule = lower(&generate(&spec)?, LowerOptions::default());
//! validate::check(&schedule)?;
//! let plan = VersionPlan::derive(&schedule)?;
//! assert_eq!(plan.forward_version(3, 7), 0);
//! let report = simulate(&schedule, &CostModel::uniform(StageCost::compute(1.0, 2.0)),
//!                       SimOptions::default())?;
//! assert!((report.bubble_fraction - 3.0 / 11.0).abs() < 1e-12);
//! # Ok::<(), pipe_scheduler::ScheduleError>(())
//! ```

#![warn(missing_docs)]

pub mod action;
pub mod depth;
mod error;
mod generate;
pub mod grid;
pub mod limits;
mod lower;
pub mod norms;
pub mod plan;
pub mod planner;
pub mod profile;
pub mod sim;
mod sim_render;
pub mod spec;
pub mod timeline;
pub mod units;
pub mod validate;

pub use action::{Action, ActionKind, Microbatch, StageId, WorkerId};
pub use error::{Result, ScheduleError};
pub use generate::generate;
pub use lower::{LowerOptions, lower, lower_checked, ring_steps};
pub use norms::NormPlan;
pub use plan::{MemoryPeak, UpdateSums, VersionPlan};
pub use planner::{
    Bound, PartitionPlan, PipeDreamOptions, PlanOptions, PlannedStage, WireDtype, balanced,
    balanced_replicated, explain, frontier, pipedream, plan as plan_partition, plan_checked,
    range_costs, simulate_plan, simulate_plan_with_memory, stage_costs,
};
pub use profile::{LayerProfile, Profile};
pub use sim::{CostModel, SimOptions, SimReport, StageCost, WorkerReport, simulate, simulate_spec};
pub use spec::{
    ChunkShape, Layout, Length, Policy, Resolved, Schedule, ScheduleSpec, VersionQuery, VersionRule,
};
pub use timeline::{Span, Timeline};
