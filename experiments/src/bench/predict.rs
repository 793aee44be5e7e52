//! The simulator's prediction of a measured configuration, from costs profiled in the same
//! sweep: each layer's forward, backward halves and update from `pipe profile`'s profiler
//! (calibrated on the executor, with as many copies at once as the machine has cores), summed
//! over the stages of the partition the run used; each message's latency and processor time
//! and the link's bandwidth from a ping-pong on the same transport ([`crate::link`]); each
//! replicated stage's all-reduce timed on that transport among as many threads as replicas;
//! and the machine's cores shared by every worker (processor sharing), as the threads of the
//! run share them.
//!
//! Next to it, the schedule's ideal bubble: the same schedule simulated with equal costs
//! (forward 1, each backward half 1) on a core per worker and free messages, which is the
//! closed form where one exists (`scheduler/tests/simulator.rs`, `v_shaped.rs`).

use pipe_scheduler::{
    CostModel, LowerOptions, Profile, SimOptions, StageCost, Timeline, WireDtype, generate, lower,
    range_costs, simulate,
};
use serde::{Deserialize, Serialize};

use super::config::ConfigSpec;
use super::measure::Measured;
use crate::ExperimentError;
use pipe_transport::measure::LinkCost;

/// What the simulator predicts for one configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Predicted {
    /// Samples/s.
    pub samples_per_s: f64,
    /// The simulator's bubble: idle share of the workers' time (profiled costs, shared cores).
    pub bubble: f64,
    /// The schedule's bubble with equal costs and a core per worker.
    pub ideal_bubble: f64,
    /// Per worker: compute share of the makespan.
    pub busy: Vec<f64>,
    /// Per worker: most bytes of weights (all versions) held at once.
    pub weight_bytes: Vec<f64>,
    /// Per worker: most bytes of stashed activations held at once.
    pub activation_bytes: Vec<f64>,
}

/// Costs shared by every configuration of a transport.
pub struct Inputs<'a> {
    /// The model's profile at the configuration's microbatch size.
    pub profile: &'a Profile,
    /// The transport's message costs.
    pub link: LinkCost,
    /// Seconds of an all-reduce of `values` floats among `replicas` workers on the transport.
    pub all_reduce: &'a mut dyn FnMut(usize, u32) -> Result<f64, ExperimentError>,
    /// Cores the workers share.
    pub cores: u32,
}

/// Simulates `spec` as `measured` ran it (same schedule length and partition). With
/// `timeline`, also returns the simulated timeline.
///
/// # Errors
/// A schedule or cost model the simulator refuses; an all-reduce that could not be timed.
pub fn predict(
    spec: &ConfigSpec,
    measured: &Measured,
    inputs: &mut Inputs<'_>,
    timeline: bool,
) -> Result<(Predicted, Option<Timeline>), ExperimentError> {
    let schedule = lower(&generate(&spec.schedule()?)?, LowerOptions::default());
    let ranges: Vec<_> = measured.partition.iter().map(|r| r[0]..r[1]).collect();
    if ranges.last().map(|r| r.end) != Some(inputs.profile.layers.len()) {
        return Err(ExperimentError::Config(format!(
            "{}: the partition does not cover the profile's {} layers",
            spec.id,
            inputs.profile.layers.len()
        )));
    }
    let mut stages = range_costs(inputs.profile, &ranges, WireDtype::F32);
    if spec.replicas > 1 {
        for st in &mut stages {
            let values = (st.param_bytes / 4.0) as usize;
            st.all_reduce = Some((inputs.all_reduce)(values, spec.replicas)?);
        }
    }
    let costs = CostModel {
        stages,
        cores: Some(inputs.cores),
        latency: inputs.link.latency_s,
        message_cpu: inputs.link.cpu_s,
        byte_cpu: inputs.link.byte_cpu_s,
        bandwidth: inputs.link.bandwidth.unwrap_or(f64::INFINITY),
        ..CostModel::uniform(StageCost::compute(0.0, 0.0))
    };
    let sim = simulate(&schedule, &costs, SimOptions { timeline })?;
    let unit = StageCost {
        backward_input: 1.0,
        backward_weight: 1.0,
        ..StageCost::compute(1.0, 0.0)
    };
    let ideal = simulate(&schedule, &CostModel::uniform(unit), SimOptions::default())?;
    let per = |f: fn(&pipe_scheduler::WorkerReport) -> f64| sim.workers.iter().map(f).collect();
    let makespan = sim.makespan;
    Ok((
        Predicted {
            samples_per_s: sim.throughput * spec.microbatch as f64,
            bubble: sim.bubble_fraction,
            ideal_bubble: ideal.bubble_fraction,
            busy: sim.workers.iter().map(|w| w.compute / makespan).collect(),
            weight_bytes: per(|w| w.memory.weights),
            activation_bytes: per(|w| w.memory.activations),
        },
        sim.timeline,
    ))
}
