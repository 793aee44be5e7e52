//! The partitioner on a deliberately unbalanced model: does the profiled plan beat the uniform
//! split when measured, and does the simulator predict the plan's throughput?
//!
//! Method, in one process and one sitting, `rounds` rounds (default 3) of steps 3-4, every
//! figure the median over rounds (ratios taken within a round):
//!
//! 1. **Profile** the model at the benchmark's microbatch size with one compute thread per
//!    worker, as the pipeline runs it, calibrated on the executor with as many copies at once
//!    as the pipeline has busy workers ([`pipe_stages::profile`]).
//! 2. **Plan** under the default cost model for `workers` workers and the benchmark's schedule,
//!    checked by the simulator against the simplest alternatives (`plan_checked`).
//!    The link is the in-process transport: activations move for free (a pointer hand-off),
//!    and the all-reduce's cost is measured on the executor (two replicas of the whole model)
//!    and given to the planner as the bandwidth that reproduces it.
//! 3. **Measure** the plan and the uniform split (`workers` stages of equal layer counts, one
//!    worker each) with the pipelined executor on in-process threads: a warm-up run, then
//!    `updates` timed minibatches; samples/s = samples / wall time (fill and drain included).
//! 4. **Predict**: the simulator runs the plan's schedule with the profiled per-stage costs.
//!    Every round after the first profiles again first, and predicts from that profile, so a
//!    prediction and its measurement meet the host in the same state; the ratio is taken
//!    within the round. The plan itself is made once, from the first profile.
//!
//! The model is `mlp-256-1536x3-256x6-10`: three wide layers at the front, six narrow ones
//! behind, so equal layer counts put nearly all the work on the first stage.

use std::ops::Range;

use pipe_kernels::CpuBackend;
use pipe_scheduler::{
    PartitionPlan, PlanOptions, Policy, Profile, explain, plan_checked, simulate_plan,
};
use pipe_stages::model::{Model, ModelSpec};
use pipe_stages::partition::Partition;
use pipe_stages::profile::{ProfileOptions, profile_model};
use serde::Serialize;

use crate::pipeline::{Case, pipelined};
use crate::{ExperimentError, median};

/// What to run.
#[derive(Clone, Debug)]
pub struct PartitionBenchConfig {
    /// Model preset.
    pub model: String,
    /// Samples per microbatch.
    pub microbatch: usize,
    /// Microbatches per update per replica.
    pub microbatches: u32,
    /// Workers (threads).
    pub workers: u32,
    /// Schedule.
    pub policy: Policy,
    /// Timed minibatches per measurement.
    pub updates: u32,
    /// Warm-up minibatches per measurement.
    pub warmup: u32,
    /// Rounds; figures are medians over rounds.
    pub rounds: u32,
}

impl Default for PartitionBenchConfig {
    fn default() -> Self {
        PartitionBenchConfig {
            model: "mlp-256-1536x3-256x6-10".into(),
            microbatch: 32,
            microbatches: 4,
            workers: 2,
            policy: Policy::PipeDream,
            updates: 24,
            warmup: 4,
            rounds: 3,
        }
    }
}

/// One layout's figures.
#[derive(Clone, Debug, Serialize)]
pub struct LayoutResult {
    /// Stage layer ranges, inclusive (`0-9,10-19`).
    pub partition: String,
    /// Replicas per stage.
    pub replicas: Vec<u32>,
    /// The cost model's steady-state samples/s (slowest stage; median over rounds).
    pub model_samples_per_s: f64,
    /// The simulator's samples/s (median over rounds).
    pub simulated_samples_per_s: f64,
    /// Measured samples/s (median over rounds).
    pub measured_samples_per_s: f64,
    /// Measured per round.
    pub rounds: Vec<f64>,
    /// Per worker: the cost model's busy seconds per pipeline microbatch (its stage's compute
    /// and all-reduce).
    pub busy_model: Vec<f64>,
    /// Per worker: measured seconds in forward, backward and update actions per pipeline
    /// microbatch (median over rounds).
    pub busy_measured: Vec<f64>,
}

/// The report.
#[derive(Clone, Debug, Serialize)]
pub struct PartitionReport {
    /// Model preset.
    pub model: String,
    /// Samples per microbatch.
    pub microbatch: usize,
    /// Workers.
    pub workers: u32,
    /// Schedule.
    pub policy: String,
    /// Bandwidth given to the planner (bytes/s), from the measured all-reduce.
    pub bandwidth: f64,
    /// The profile measured.
    pub profile: Profile,
    /// The profiled plan.
    pub plan: LayoutResult,
    /// The uniform split.
    pub uniform: LayoutResult,
    /// Plan over uniform, measured (median of per-round ratios).
    pub plan_over_uniform: f64,
    /// Plan: measured over simulated (median of the per-round ratios, each round simulating
    /// from its own fresh profile).
    pub measured_over_simulated: f64,
}

/// Stage ranges as `--partition` writes them (`0-9,10-19`).
fn ranges_text(ranges: &[Range<usize>]) -> String {
    let layers = ranges.last().map_or(0, |r| r.end);
    Partition::new(ranges.to_vec(), layers)
        .map_or_else(|_| format!("{ranges:?}"), |p| p.to_string())
}

/// `n` layers in `s` stages of equal counts (the first stages one longer when uneven).
fn uniform(n: usize, s: usize) -> Vec<Range<usize>> {
    let (base, extra) = (n / s, n % s);
    let mut out = Vec::with_capacity(s);
    let mut start = 0;
    for i in 0..s {
        let len = base + usize::from(i < extra);
        out.push(start..start + len);
        start += len;
    }
    out
}

fn case_of(cfg: &PartitionBenchConfig, name: &str, plan: &PartitionPlan) -> Case {
    Case {
        name: name.into(),
        policy: cfg.policy,
        stages: plan.stages.len() as u32,
        replicas: 1,
        microbatch: cfg.microbatch,
        m: cfg.microbatches,
        replica_counts: Some(plan.stages.iter().map(|s| s.replicas).collect()),
        partition: Some(plan.stages.iter().map(|s| s.layers.clone()).collect()),
        bucket_size: None,
        stage_buckets: None,
        processes: false,
    }
}

/// Samples/s of a timed run after a warm-up, and each worker's compute seconds per pipeline
/// microbatch.
fn measure(
    model: &Model,
    case: &Case,
    cfg: &PartitionBenchConfig,
) -> Result<(f64, Vec<f64>), ExperimentError> {
    let mut states = Vec::new();
    pipelined(model, case, cfg.warmup.max(1), &mut states)?;
    let (measured, outs, schedule) = pipelined(model, case, cfg.updates, &mut states)?;
    let mbs = f64::from(schedule.total_microbatches());
    Ok((measured, outs.iter().map(|o| o.compute_s / mbs).collect()))
}

/// One layout's figures over the rounds.
#[derive(Default)]
struct Rounds {
    measured: Vec<f64>,
    simulated: Vec<f64>,
    model: Vec<f64>,
    busy_model: Vec<Vec<f64>>,
    busy_measured: Vec<Vec<f64>>,
}

impl Rounds {
    /// Predicts `layout` from `profile` and measures it: `(measured, simulated)` samples/s.
    #[allow(clippy::too_many_arguments)]
    fn record(
        &mut self,
        model: &Model,
        case: &Case,
        cfg: &PartitionBenchConfig,
        profile: &Profile,
        opts: &PlanOptions,
        layout: &[(Range<usize>, u32)],
        b: f64,
    ) -> Result<(f64, f64), ExperimentError> {
        let predicted = explain(profile, opts, layout)?;
        let simulated = b / simulate_plan(profile, &predicted, opts)?;
        let (measured, busy) = measure(model, case, cfg)?;
        self.model.push(b / predicted.time_per_microbatch);
        self.simulated.push(simulated);
        self.measured.push(measured);
        self.busy_model.push(
            predicted
                .stages
                .iter()
                .flat_map(|s| std::iter::repeat_n(s.compute + s.communication, s.replicas as usize))
                .collect(),
        );
        self.busy_measured.push(busy);
        Ok((measured, simulated))
    }

    fn result(self, p: &PartitionPlan) -> LayoutResult {
        let per_worker = |rounds: &[Vec<f64>]| -> Vec<f64> {
            let workers = rounds.first().map_or(0, Vec::len);
            (0..workers)
                .map(|w| median(&rounds.iter().map(|r| r[w]).collect::<Vec<_>>()))
                .collect()
        };
        LayoutResult {
            partition: ranges_text(
                &p.stages
                    .iter()
                    .map(|s| s.layers.clone())
                    .collect::<Vec<_>>(),
            ),
            replicas: p.stages.iter().map(|s| s.replicas).collect(),
            model_samples_per_s: median(&self.model),
            simulated_samples_per_s: median(&self.simulated),
            measured_samples_per_s: median(&self.measured),
            busy_model: per_worker(&self.busy_model),
            busy_measured: per_worker(&self.busy_measured),
            rounds: self.measured,
        }
    }
}

/// How a plan's profile is taken: calibrated on the executor at `microbatches` per update,
/// with as many copies at once as `workers` keep cores busy (as `pipe plan --model` does).
pub(crate) fn plan_profile_options(
    microbatch: usize,
    microbatches: u32,
    workers: u32,
) -> ProfileOptions {
    ProfileOptions {
        calibrate: Some(microbatches),
        concurrent: pipe_stages::planning::busy_workers(workers),
        ..ProfileOptions::new(microbatch)
    }
}

/// Runs the benchmark (see the module docs).
///
/// # Errors
/// Bad configuration (model, sizes), or a failure while profiling, planning or running.
pub fn run(cfg: &PartitionBenchConfig) -> Result<PartitionReport, ExperimentError> {
    if cfg.workers < 2 || cfg.updates == 0 || cfg.rounds == 0 || cfg.microbatch == 0 {
        return Err(ExperimentError::Config(
            "need at least 2 workers, 1 update, 1 round and 1 sample per microbatch".into(),
        ));
    }
    let model = Model::new(&ModelSpec::preset(&cfg.model)?)?;
    if cfg.workers as usize > model.len() {
        // The uniform split it is measured against gives every worker a stage of its own.
        return Err(ExperimentError::Config(format!(
            "--workers {} is more than {}'s {} layers: the uniform split needs a layer for each worker",
            cfg.workers,
            cfg.model,
            model.len()
        )));
    }
    let be = CpuBackend::new(1)?;
    let profile_opts = plan_profile_options(cfg.microbatch, cfg.microbatches, cfg.workers);
    let profile = profile_model(&model, &cfg.model, &be, &profile_opts)?;
    let bandwidth = pipe_stages::planning::in_process_bandwidth(&model, cfg.microbatch)?;
    let opts = PlanOptions {
        policy: cfg.policy,
        microbatches: cfg.microbatches,
        ..PlanOptions::new(cfg.workers, bandwidth)
    };
    let plan = plan_checked(&profile, &opts)?;
    let even: Vec<(Range<usize>, u32)> = uniform(model.len(), cfg.workers as usize)
        .into_iter()
        .map(|r| (r, 1))
        .collect();
    let planned: Vec<(Range<usize>, u32)> = plan
        .stages
        .iter()
        .map(|s| (s.layers.clone(), s.replicas))
        .collect();
    let flat = explain(&profile, &opts, &even)?;
    let plan_case = case_of(cfg, "plan", &plan);
    let flat_case = case_of(cfg, "uniform", &flat);
    let b = cfg.microbatch as f64;
    let mut plan_rounds = Rounds::default();
    let mut flat_rounds = Rounds::default();
    let (mut ratios, mut accuracy) = (Vec::new(), Vec::new());
    for round in 0..cfg.rounds {
        // Each round predicts from a profile taken just before it measures, so the prediction
        // and the measurement see the host in the same state.
        let fresh = if round == 0 {
            profile.clone()
        } else {
            profile_model(&model, &cfg.model, &be, &profile_opts)?
        };
        let p = plan_rounds.record(&model, &plan_case, cfg, &fresh, &opts, &planned, b)?;
        let u = flat_rounds.record(&model, &flat_case, cfg, &fresh, &opts, &even, b)?;
        ratios.push(p.0 / u.0);
        accuracy.push(p.0 / p.1);
    }
    let plan_result = plan_rounds.result(&plan);
    let flat_result = flat_rounds.result(&flat);
    let measured_over_simulated = median(&accuracy);
    Ok(PartitionReport {
        model: cfg.model.clone(),
        microbatch: cfg.microbatch,
        workers: cfg.workers,
        policy: cfg.policy.name().into(),
        bandwidth,
        profile,
        plan: plan_result,
        uniform: flat_result,
        plan_over_uniform: median(&ratios),
        measured_over_simulated,
    })
}

/// The report as text.
pub fn render(r: &PartitionReport) -> String {
    let mut out = format!(
        "partition benchmark: {} at microbatch {}, {} workers, schedule {}, all-reduce as {:.2} GB/s\n",
        r.model,
        r.microbatch,
        r.workers,
        r.policy,
        r.bandwidth / 1e9
    );
    out.push_str(&format!(
        "{:<10} {:>16} {:>10} {:>14} {:>14} {:>14}\n",
        "layout", "layers", "replicas", "model s/s", "simulated s/s", "measured s/s"
    ));
    for (name, l) in [("plan", &r.plan), ("uniform", &r.uniform)] {
        out.push_str(&format!(
            "{:<10} {:>16} {:>10} {:>14.0} {:>14.0} {:>14.0}\n",
            name,
            l.partition,
            format!("{:?}", l.replicas),
            l.model_samples_per_s,
            l.simulated_samples_per_s,
            l.measured_samples_per_s
        ));
    }
    for (name, l) in [("plan", &r.plan), ("uniform", &r.uniform)] {
        let ms = |v: &[f64]| {
            v.iter()
                .map(|t| format!("{:.2}", t * 1e3))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        out.push_str(&format!(
            "{name}: per-worker busy ms per microbatch, model {} , measured {}\n",
            ms(&l.busy_model),
            ms(&l.busy_measured)
        ));
    }
    out.push_str(&format!(
        "plan / uniform (measured): {:.2}x; plan measured / simulated: {:.2}\n",
        r.plan_over_uniform, r.measured_over_simulated
    ));
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_small_run_reports_both_layouts() {
        let r = run(&PartitionBenchConfig {
            model: "mlp-32-128x2-16x4-10".into(),
            microbatch: 4,
            microbatches: 2,
            updates: 2,
            warmup: 1,
            rounds: 1,
            ..PartitionBenchConfig::default()
        })
        .unwrap();
        for l in [&r.plan, &r.uniform] {
            assert!(l.measured_samples_per_s > 0.0 && l.simulated_samples_per_s > 0.0);
            assert_eq!(l.busy_measured.len(), 2, "{l:?}");
            assert_eq!(l.busy_model.len(), 2, "{l:?}");
        }
        assert_eq!(r.uniform.partition, "0-6,7-13");
        assert!(r.profile.calibrated_microbatches == Some(2));
        // The uniform split is one straight layout: the program's best straight plan is never
        // slower under the model, and the check keeps only what the simulator finds faster.
        let replicas: u32 = r.plan.replicas.iter().sum();
        assert_eq!(replicas, 2);
    }

    #[test]
    fn uniform_splits_cover_every_layer_evenly() {
        assert_eq!(uniform(20, 2), vec![0..10, 10..20]);
        assert_eq!(uniform(7, 3), vec![0..3, 3..5, 5..7]);
        assert_eq!(ranges_text(&uniform(4, 2)), "0-1,2-3");
    }
}
