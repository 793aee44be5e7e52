//! All-reduce bucket sizes as a run is given them (one size for every stage, or one per
//! stage), where they came from, and the one rule by which a run takes sizes settled
//! elsewhere ([`crate::config::RunConfig::adopt_buckets_of`], beside the run it changes).
//!
//! A size is [`pipe_scheduler::planner::buckets::BucketSize`] (one bucket for a whole stage
//! is a variant of it), a run's per-stage sizes a
//! [`pipe_scheduler::planner::buckets::StageBuckets`].

use pipe_scheduler::planner::buckets::{BucketSize, StageBuckets};
use serde::{Deserialize, Serialize};

/// `--allreduce-bucket-mb`: MiB of f32 gradients per all-reduce bucket, one size for every
/// stage (`4`) or one per stage (`4,1,one`); `one` puts a stage's gradients in one bucket,
/// summed once its backward pass is done. A config file gives a number or that text.
#[derive(Clone, Debug, PartialEq)]
pub struct BucketSizes(Vec<BucketSize>);

impl BucketSizes {
    /// The sizes given: one for every stage, or one per stage.
    pub fn sizes(&self) -> &[BucketSize] {
        &self.0
    }
}

impl std::str::FromStr for BucketSizes {
    type Err = String;
    fn from_str(text: &str) -> std::result::Result<Self, String> {
        let parts: Vec<&str> = text.split(',').map(str::trim).collect();
        crate::limits::check_count(
            "all-reduce bucket sizes",
            parts.len() as u64,
            pipe_scheduler::limits::MAX_STAGES,
            "one per stage",
        )
        .map_err(|e| e.to_string())?;
        let sizes = parts
            .iter()
            .map(|p| p.parse::<BucketSize>().map_err(|e| e.to_string()))
            .collect::<std::result::Result<_, _>>()?;
        Ok(BucketSizes(sizes))
    }
}

/// As `--allreduce-bucket-mb` takes it: the sizes, comma-separated.
impl std::fmt::Display for BucketSizes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        StageBuckets::new(self.0.clone()).fmt(f)
    }
}

impl Serialize for BucketSizes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for BucketSizes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(f64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(mb) => mb.to_string().parse(),
            Raw::Text(text) => text.parse(),
        }
        .map_err(serde::de::Error::custom)
    }
}

/// Where a run's all-reduce bucket sizes came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BucketOrigin {
    /// The default size, for every stage.
    #[default]
    Default,
    /// `--allreduce-bucket-mb`.
    Given,
    /// Chosen per stage by the simulator's cost of the bucketed ring on the run's link.
    Chosen,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::{RunConfig, TrainSettings};

    fn run(toml: &str) -> RunConfig {
        TrainSettings::from_toml(toml, "test")
            .and_then(TrainSettings::resolve)
            .unwrap()
    }

    #[test]
    fn the_flag_reads_and_prints_its_sizes() {
        let given: BucketSizes = "4, 1,one".parse().unwrap();
        assert_eq!(given.to_string(), "4,1,one");
        assert_eq!(given.sizes()[2], BucketSize::Whole);
        let e = "4,many".parse::<BucketSizes>().unwrap_err();
        assert_eq!(
            e,
            "all-reduce bucket must be above 0 and at most 65536 MiB, or one, got 'many'"
        );
        let cfg = run("stages = 2\nreplicas = [2]\nallreduce_bucket_mb = 0.25");
        assert_eq!(cfg.bucket_size, BucketSize::of_values(1 << 16).unwrap());
        assert_eq!(cfg.bucket_origin, BucketOrigin::Given);
        let cfg = run("stages = 2\nreplicas = [2]\nallreduce_bucket_mb = \"one,2\"");
        assert_eq!(cfg.stage_buckets.to_string(), "one,2");
    }

    /// One rule for checkpoints and the chief's terms: chosen sizes of as many stages are
    /// taken where none were given, and nothing else is.
    #[test]
    fn a_run_adopts_chosen_sizes_only_where_it_was_given_none() {
        let base = run("stages = 2\nreplicas = [2]");
        let sizes = StageBuckets::new(vec![BucketSize::Whole, "0.25".parse().unwrap()]);
        let chosen = base.clone().with_stage_buckets(sizes.clone());
        let adopted = base.adopt_buckets_of(&chosen).unwrap();
        assert_eq!(adopted.stage_buckets, sizes);
        assert_eq!(adopted.bucket_origin, BucketOrigin::Chosen);
        assert_eq!(adopted.numerics_difference(&chosen), None);
        let given = run("stages = 2\nreplicas = [2]\nallreduce_bucket_mb = 1");
        assert!(!given.takes_settled_buckets());
        assert!(given.adopt_buckets_of(&chosen).is_none());
        assert!(base.adopt_buckets_of(&given).is_none());
        assert!(base.adopt_buckets_of(&base).is_none());
        let three =
            run("stages = 3").with_stage_buckets(StageBuckets::uniform(BucketSize::Whole, 3));
        assert!(base.adopt_buckets_of(&three).is_none());
    }

    /// Run files and checkpoints hold the counts of values they always held, one bucket as
    /// the largest count, and read back to the same sizes.
    #[test]
    fn sizes_travel_as_the_counts_written_before() {
        let sizes = StageBuckets::new(vec![BucketSize::Whole, "0.25".parse().unwrap()]);
        let cfg = run("stages = 2\nreplicas = [2]").with_stage_buckets(sizes);
        let json = cfg.to_json().unwrap();
        assert!(json.contains("\"bucket_values\":1048576"), "{json}");
        assert!(
            json.contains("\"stage_bucket_values\":[18446744073709551615,65536]"),
            "{json}"
        );
        assert_eq!(RunConfig::from_json(&json, "run.json").unwrap(), cfg);
        let plain = run("stages = 2").to_json().unwrap();
        assert!(!plain.contains("stage_bucket_values"), "{plain}");
    }
}
