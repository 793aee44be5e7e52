//! Each replicated stage's all-reduce bucket size for a run, chosen by the simulator's cost
//! of a bucketed ring ([`pipe_scheduler::planner::buckets`]) from the run's measured layer
//! profile and the measured costs of the transport that carries its rings. The sizes decide
//! the order of the replicas' additions, so they are part of the run: the header prints them
//! with the flag that repeats them. A run takes them only where it was given none
//! ([`RunConfig::takes_settled_buckets`], the guard of adoption too).

use pipe_scheduler::Profile;
use pipe_scheduler::planner::buckets::{
    BucketChoice, LayerGradients, StageBuckets, choose_bucket_size,
};
use pipe_scheduler::planner::transport::TransportCost;
use pipe_transport::frame::WireDType;

use crate::config::RunConfig;

/// Whether `cfg`'s bucket sizes are to be chosen on its measured link: it takes settled
/// sizes ([`RunConfig::takes_settled_buckets`]) and some stage has replicas to sum.
pub fn to_choose(cfg: &RunConfig) -> bool {
    cfg.takes_settled_buckets() && cfg.replicas.iter().any(|&r| r > 1)
}

/// Chooses each stage's bucket size for `cfg` (whose partition is settled) from `profile`
/// (the model's layers, measured at the run's microbatch size) and `link`, the costs of the
/// transport that carries the run's rings. Returns each stage's size (the run's default for a
/// stage of one replica) and each stage's choice (`None` for a stage of one replica), or
/// nothing where there is nothing to choose ([`to_choose`]); the run takes the sizes through
/// [`RunConfig::with_stage_buckets`].
pub fn choose_for_run(
    cfg: &RunConfig,
    profile: &Profile,
    link: &TransportCost,
) -> Option<(StageBuckets, Vec<Option<BucketChoice>>)> {
    let partition = match &cfg.partition {
        crate::config::PartitionChoice::Given(p) => p.clone(),
        _ => return None,
    };
    if !to_choose(cfg) {
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
            choose_bucket_size(&layers, r, &link, bytes_per_value)
        })
        .collect();
    let sizes = choices
        .iter()
        .map(|c| c.map_or(cfg.bucket_size, |c| c.size))
        .collect();
    Some((sizes, choices))
}

/// Takes the bucket sizes a checkpoint's run chose, by the adoption rule
/// ([`RunConfig::adopt_buckets_of`]): `settings` is the run's numerics as the checkpoint
/// records them (JSON). A resumed run then sums its replicas' gradients in the same buckets
/// as the run it continues, whatever a new measurement would choose. Returns the run with
/// the sizes taken, if any.
pub fn adopt_recorded(cfg: &RunConfig, settings: &str) -> Option<RunConfig> {
    let recorded = RunConfig::from_json(settings, "the checkpoint's settings").ok()?;
    cfg.adopt_buckets_of(&recorded)
}
