//! Time to a target training loss on real data: one reference configuration (model, stages,
//! microbatching, SGD) trained by `pipe train`'s own path under each listed policy, with the
//! seconds and updates until the training loss, averaged over a window of updates, first reaches
//! the target. Speed per sample and staleness meet in this one figure.

use pipe_stages::config::{DatasetKind, ModelChoice, TrainSettings};
use pipe_stages::optim::OptimizerKind;
use pipe_stages::pipeline::{PipelineTrainOptions, train_pipelined};
use serde::{Deserialize, Serialize};

use super::config::TargetRun;
use crate::ExperimentError;
use crate::staleness::run::{Recorder, truncate};

/// One policy's run to the target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TargetResult {
    /// Policy.
    pub policy: String,
    /// Stages (1 for `sequential`).
    pub stages: u32,
    /// Updates until the target (None: not reached within the epochs).
    pub updates: Option<u64>,
    /// Seconds of training until then.
    pub seconds: Option<f64>,
    /// Final test accuracy (None when the run stopped before its first evaluation).
    pub test_accuracy: Option<f64>,
    /// Wall seconds of the whole run.
    pub wall_s: f64,
    /// The error, when the run stopped (divergence included).
    pub error: Option<String>,
}

/// Runs every policy of `t`.
///
/// # Errors
/// Unreadable data or settings `pipe train` refuses.
pub fn run_targets(t: &TargetRun) -> Result<Vec<TargetResult>, ExperimentError> {
    let dataset: DatasetKind = t.dataset.parse().map_err(ExperimentError::Config)?;
    let mut out = Vec::new();
    let mut data = None;
    for policy in &t.policies {
        let stages = if policy == "sequential" { 1 } else { t.stages };
        let settings = TrainSettings {
            model: Some(ModelChoice::Preset(t.model.clone())),
            dataset: Some(dataset),
            epochs: Some(t.epochs),
            microbatch_size: Some(t.microbatch),
            microbatches: Some(t.microbatches),
            optimizer: Some(OptimizerKind::Sgd),
            lr: Some(t.lr),
            momentum: Some(0.9),
            seed: Some(0),
            threads: Some(1),
            stages: Some(stages as usize),
            schedule: Some(policy.clone()),
            partition: Some("flops".into()),
            ..TrainSettings::default()
        };
        let rc = settings.resolve()?;
        let splits = match data.take() {
            Some(d) => d,
            None => {
                let model = pipe_stages::model::Model::new(&rc.model)?;
                if rc.dataset == pipe_stages::config::DatasetKind::Synthetic {
                    pipe_stages::data::admit_synthetic_memory(&rc.synthetic)?;
                }
                let mut d = pipe_stages::train::load_data(&rc, &model)?;
                truncate(&mut d.train, t.train_samples);
                truncate(&mut d.test, t.test_samples);
                d
            }
        };
        let mut rec = Recorder::new(t.target_loss, t.window);
        let start = std::time::Instant::now();
        let result = train_pipelined(&rc, &splits, &mut rec, &PipelineTrainOptions::default());
        data = Some(splits);
        out.push(TargetResult {
            policy: policy.clone(),
            stages,
            updates: rec.reached.map(|r| r.0),
            seconds: rec.reached.map(|r| r.1),
            test_accuracy: rec.epochs.last().map(|e| e.test_accuracy),
            wall_s: start.elapsed().as_secs_f64(),
            error: result.err().map(|e| e.to_string()),
        });
    }
    Ok(out)
}
