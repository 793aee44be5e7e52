//! The executor end to end: one minibatch of `mlp-784-1024x4-10` (8 microbatches of 32) through
//! the pipeline on in-process threads, per policy and stage count: kernels, schedule
//! interpretation, transport and thread start together, as a training step pays them.
//!
//! `cargo bench -p pipe-experiments --bench executor`. Throughput is in samples.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use pipe_kernels::{CpuBackend, Tensor};
use pipe_scheduler::{Length, Policy, ScheduleSpec};
use pipe_stages::model::{Model, ModelSpec};
use pipe_stages::optim::{OptimizerConfig, OptimizerKind};
use pipe_stages::pipeline::{MicrobatchSource, RunPlan, Setup, WorkerState, run_threads};
use pipe_transport::inproc::{InProcOptions, mesh};

const MICROBATCH: usize = 32;

struct Fixed {
    x: Tensor,
    y: Tensor<u32>,
}

impl MicrobatchSource for Fixed {
    fn microbatch_size(&self) -> usize {
        MICROBATCH
    }
    fn inputs(&self, _: u32) -> pipe_stages::Result<Tensor> {
        Ok(self.x.clone())
    }
    fn labels(&self, _: u32) -> pipe_stages::Result<Tensor<u32>> {
        Ok(self.y.clone())
    }
}

fn bench(c: &mut Criterion) {
    let model = Model::new(&ModelSpec::preset("mlp-784-1024x4-10").unwrap()).unwrap();
    let data = Fixed {
        x: Tensor::from_vec(
            &[MICROBATCH, 784],
            (0..MICROBATCH * 784)
                .map(|i| (i % 97) as f32 / 97.0 - 0.5)
                .collect(),
        )
        .unwrap(),
        y: Tensor::from_vec(
            &[MICROBATCH],
            (0..MICROBATCH as u32).map(|i| i % 10).collect(),
        )
        .unwrap(),
    };
    let opt = OptimizerConfig {
        kind: OptimizerKind::Sgd,
        momentum: 0.9,
        ..OptimizerConfig::default()
    };
    let lr = |_: u32, _: u32| 1e-3f32;
    let mut g = c.benchmark_group("executor_minibatch_8x32");
    g.throughput(Throughput::Elements(8 * MICROBATCH as u64));
    g.sample_size(20);
    for (policy, stages) in [
        (Policy::Sequential, 1),
        (Policy::OneFOneBFlush, 2),
        (Policy::PipeDream, 2),
        (Policy::ZbV, 2),
        (Policy::PipeDream, 4),
    ] {
        let spec = ScheduleSpec::new(policy, stages, 8).with_length(Length::Updates(1));
        let plan = RunPlan::new(&model, &spec, None).unwrap();
        let setup = Setup::new(&model, &plan, &data, &lr);
        let init = model.init_params(0);
        let mut states: Vec<WorkerState> = (0..plan.schedule.workers())
            .map(|w| WorkerState::new(&setup, w, &init, opt))
            .collect();
        let id = BenchmarkId::new(policy.name(), format!("{stages}_stages"));
        g.bench_function(id, |b| {
            b.iter(|| {
                let eps = mesh(plan.schedule.workers(), &InProcOptions::default());
                run_threads(&setup, &mut states, eps, |_| CpuBackend::new(1)).unwrap()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
