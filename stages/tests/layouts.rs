//! A fast oracle over the layouts the executor handles specially: several model chunks per
//! worker (interleaved), every stage on one worker (sequential), replicas summed in ring
//! order, the split backward of zero-bubble H1 and unequal replica counts. Each pipelined run
//! of two epochs on a small synthetic problem ends with the whole-run reference trainer's
//! weights, bit for bit. (`stages/tests/pipeline.rs` is the full oracle on MNIST; this one
//! runs in seconds, so a mutation run can afford it.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_stages::config::{DatasetKind, ModelChoice, TrainSettings};
use pipe_stages::data::SyntheticConfig;
use pipe_stages::model::{Model, Params};
use pipe_stages::pipeline::{PipelineTrainOptions, train_pipelined, train_reference};
use pipe_stages::train::{Quiet, load_data};

fn bits(p: &Params) -> Vec<u32> {
    p.iter()
        .flatten()
        .flat_map(|t| t.host().unwrap().iter().map(|v| v.to_bits()))
        .collect()
}

#[test]
fn special_layouts_equal_the_reference_trainer() {
    // (policy, stages, replicas, chunks, microbatches per update)
    let cases: [(&str, usize, Vec<u32>, u32, usize); 8] = [
        ("interleaved", 2, vec![1], 2, 2),
        ("sequential", 4, vec![1], 1, 2),
        ("zb-h1", 4, vec![1], 1, 4),
        ("pipedream", 2, vec![2], 1, 1),
        ("1f1b-flush", 3, vec![2, 1, 3], 1, 2),
        ("pipedream", 3, vec![1, 3, 1], 1, 1),
        ("vsync", 3, vec![2, 1, 1], 1, 1),
        ("2bw", 2, vec![1, 2], 1, 2),
    ];
    for (policy, stages, replicas, chunks, m) in cases {
        let cfg = TrainSettings {
            model: Some(ModelChoice::Preset("mlp-16-24x3-4".into())),
            dataset: Some(DatasetKind::Synthetic),
            synthetic: Some(SyntheticConfig {
                inputs: 16,
                classes: 4,
                hidden: 8,
                train: 576,
                test: 64,
            }),
            epochs: Some(2),
            microbatch_size: Some(8),
            microbatches: Some(m),
            lr: Some(0.1),
            momentum: Some(0.9),
            seed: Some(11),
            threads: Some(1),
            stages: Some(stages),
            replicas: Some(replicas.clone()),
            chunks: Some(chunks),
            schedule: Some(policy.into()),
            partition: Some("flops".into()),
            ..TrainSettings::default()
        }
        .resolve()
        .unwrap_or_else(|e| panic!("{policy} {replicas:?}: {e}"));
        let data = load_data(&cfg, &Model::new(&cfg.model).unwrap()).unwrap();
        let got = train_pipelined(&cfg, &data, &mut Quiet, &PipelineTrainOptions::default())
            .unwrap_or_else(|e| panic!("{policy} {replicas:?}: {e}"));
        let (want, _) = train_reference(&cfg, &data).unwrap();
        assert!(
            bits(&got.report.params) == bits(&want),
            "{policy} {stages} stages {replicas:?} x{chunks}: differs from the reference"
        );
    }
}
