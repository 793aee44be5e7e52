//! Each replicated stage's all-reduce bucket size for a run, chosen by the simulator's cost
//! of a bucketed ring ([`pipe_scheduler::planner::buckets`]) from the run's measured layer
//! profile and the measured costs of the transport that carries its rings. The sizes decide
//! the order of the replicas' additions, so they are part of the run: the header prints them
//! with the flag that repeats them.

use pipe_scheduler::Profile;
use pipe_scheduler::planner::buckets::{BucketChoice, LayerGradients, choose_bucket_values};
use pipe_scheduler::planner::transport::TransportCost;
use pipe_transport::frame::WireDType;

use crate::config::{BucketOrigin, RunConfig};

/// Chooses each stage's bucket size for `cfg` (whose partition is settled) from `profile`
/// (the model's layers, measured at the run's microbatch size) and `link`, the costs of the
/// transport that carries the run's rings. Returns each stage's size (the run's default for a
/// stage of one replica) and each stage's choice (`None` for a stage of one replica), or
/// nothing where the sizes were given or no stage is replicated; the run takes the sizes
/// through [`RunConfig::with_stage_buckets`].
pub fn choose_for_run(
    cfg: &RunConfig,
    profile: &Profile,
    link: &TransportCost,
) -> Option<(Vec<usize>, Vec<Option<BucketChoice>>)> {
    let partition = match &cfg.partition {
        crate::config::PartitionChoice::Given(p) => p.clone(),
        _ => return None,
    };
    if cfg.bucket_origin != BucketOrigin::Default || cfg.replicas.iter().all(|&r| r <= 1) {
        return None;
    }
    let bytes_per_value = match cfg.allreduce_wire {
        WireDType::Bf16 => 2.0,
        _ => 4.0,
    };
    let link = link.link();
    let choices: Vec<Option<BucketChoice>> = partition
        .ranges()
        .iter()
        .zip(&cfg.replicas)
        .map(|(range, &r)| {
            let layers: Vec<LayerGradients> = profile
                .layers
                .get(range.clone())?
                .iter()
                .map(LayerGradients::of)
                .collect();
            choose_bucket_values(&layers, r, &link, bytes_per_value)
        })
        .collect();
    let values = choices
        .iter()
        .map(|c| c.map_or(cfg.bucket_values, |c| c.values))
        .collect();
    Some((values, choices))
}

/// Takes the bucket sizes a checkpoint's run chose where `cfg` gives none: `settings` is the
/// run's numerics as the checkpoint records them (JSON). A resumed run then sums its
/// replicas' gradients in the same buckets as the run it continues, whatever a new
/// measurement would choose. Returns the sizes taken, if any.
pub fn adopt_recorded(cfg: &RunConfig, settings: &str) -> Option<Vec<usize>> {
    let recorded = RunConfig::from_json(settings, "the checkpoint's settings").ok()?;
    cfg.buckets_to_adopt(&recorded)
}
