//! All-reduce bucket sizes as a run is given them: one size for every stage, or one per stage.

use serde::{Deserialize, Serialize};

/// `--allreduce-bucket-mb`: MiB of f32 gradients per all-reduce bucket, one size for every
/// stage (`4`) or one per stage (`4,1,one`); `one` puts a stage's gradients in one bucket,
/// summed once its backward pass is done. A config file gives a number or that text.
#[derive(Clone, Debug, PartialEq)]
pub struct BucketSizes(Vec<Option<f64>>);

/// Largest bucket in MiB (64 GiB).
const MAX_BUCKET_MB: f64 = 65_536.0;

impl BucketSizes {
    /// Gradient values per bucket of each size given (`usize::MAX` for `one`).
    pub fn values(&self) -> Vec<usize> {
        self.0
            .iter()
            .map(|mb| match mb {
                // At least one value; whole values of 4 bytes.
                Some(mb) => ((mb * 1024.0 * 1024.0 / 4.0) as usize).max(1),
                None => usize::MAX,
            })
            .collect()
    }

    /// The sizes of `values` per stage, as `--allreduce-bucket-mb` takes them back.
    pub fn of_values(values: &[usize]) -> Self {
        BucketSizes(
            values
                .iter()
                .map(|&v| (v != usize::MAX).then(|| v as f64 * 4.0 / (1024.0 * 1024.0)))
                .collect(),
        )
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
            .map(|p| match *p {
                "one" => Ok(None),
                _ => match p.parse::<f64>() {
                    Ok(mb) if mb.is_finite() && mb > 0.0 && mb <= MAX_BUCKET_MB => Ok(Some(mb)),
                    _ => Err(format!(
                        "all-reduce bucket must be between 0 and {MAX_BUCKET_MB} MiB, or one, got \
                         '{p}'"
                    )),
                },
            })
            .collect::<std::result::Result<_, _>>()?;
        Ok(BucketSizes(sizes))
    }
}

impl std::fmt::Display for BucketSizes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text: Vec<String> = self
            .0
            .iter()
            .map(|mb| mb.map_or_else(|| "one".to_string(), |mb| format!("{mb}")))
            .collect();
        f.write_str(&text.join(","))
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
