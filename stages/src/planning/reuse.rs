//! A measured layer profile kept in pipe's cache ([`crate::cache`]) and reused: the profile
//! a measured partition, `pipe train --workers`, `pipe plan --model` and `pipe profile` take
//! minutes to measure on a large model, and the same on every start of the same run on the
//! same machine.
//!
//! The key ([`profile_key`]) names everything the figures depend on: the machine and the build
//! (every cache key does), the model's layers and input shape, the optimizer whose step is
//! timed, the backend and its precision, the compute threads, the microbatch size, the
//! microbatches per update, the workers that compute at once, and how it was measured (warm-up,
//! repeats, budget, calibration). Another value of any of them is another entry. An entry
//! that is cut short, edited, from another key or too old is ignored with the reason, and the
//! profile is measured again and kept in its place.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pipe_kernels::Backend;
use pipe_scheduler::Profile;
use sha2::{Digest, Sha256};

use crate::cache::{Cache, CacheKey, Lookup};
use crate::error::Result;
use crate::model::Model;
use crate::profile::{ProfileOptions, ProfileProgress, profile_model_with};

/// The cache kind of a layer profile.
pub const PROFILE_KIND: &str = "layer-profile";

/// How long a kept profile is trusted: a machine's speed drifts with its software, and a
/// profile measured a month ago is measured again.
pub const MAX_AGE: Duration = Duration::from_secs(30 * 86_400);

/// What happened while a profile was found, for a caller that shows it.
#[derive(Clone, Debug, PartialEq)]
pub enum ProfileEvent {
    /// Measuring: how far it has got.
    Progress(ProfileProgress),
    /// The cache held it: nothing was measured.
    Reused {
        /// The entry.
        path: PathBuf,
    },
    /// The cache held an entry under the key that is not trusted; it is measured again.
    Ignored {
        /// The entry.
        path: PathBuf,
        /// Why (cut short, edited, another key or format, too old).
        why: String,
    },
    /// Measured, in `seconds`, and kept at `kept` (none: no cache, or it could not be
    /// written, with why).
    Measured {
        /// Seconds measuring took.
        seconds: f64,
        /// The entry written.
        kept: Option<PathBuf>,
        /// Why it was not kept, where it was not.
        not_kept: Option<String>,
    },
}

/// What is told of a profile's events ([`Profiling::report`]); called from the profiling
/// thread.
pub type ProfileReport = Arc<dyn Fn(&ProfileEvent) + Send + Sync>;

/// Where a run's profile comes from: pipe's cache, or a measurement kept there.
#[derive(Clone, Default)]
pub struct Profiling {
    /// The cache read and written (`None`: measure every time, keep nothing).
    pub cache: Option<Cache>,
    /// Measure again even where the cache holds the profile (`--reprofile`); the new
    /// measurement replaces the entry.
    pub reprofile: bool,
    /// Told of progress and of where the profile came from.
    pub report: Option<ProfileReport>,
}

impl std::fmt::Debug for Profiling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Profiling")
            .field("cache", &self.cache)
            .field("reprofile", &self.reprofile)
            .field("report", &self.report.is_some())
            .finish()
    }
}

impl Profiling {
    /// The platform's cache ([`Cache::open`]), measuring again when `reprofile`.
    pub fn cached(reprofile: bool) -> Self {
        Profiling {
            cache: Cache::open(),
            reprofile,
            report: None,
        }
    }

    /// This with `report` told of every event.
    #[must_use]
    pub fn reporting(mut self, report: ProfileReport) -> Self {
        self.report = Some(report);
        self
    }

    fn tell(&self, event: &ProfileEvent) {
        if let Some(report) = &self.report {
            report(event);
        }
    }

    /// The profile of `model` on `be` under `opts` ([`crate::profile::profile_model`]): the
    /// cache's entry under [`profile_key`] where there is a trusted one and no `reprofile`,
    /// else measured and kept. `microbatches` is the run's per update (part of the key: the
    /// figures a partition is cut by depend on it).
    ///
    /// # Errors
    /// Profiling failures (a cache that cannot be written is reported, not an error).
    pub fn profile(
        &self,
        model: &Model,
        name: &str,
        be: &dyn Backend,
        opts: &ProfileOptions,
        microbatches: u32,
    ) -> Result<Profile> {
        let key = profile_key(model, name, be, opts, microbatches);
        if let (Some(cache), false) = (&self.cache, self.reprofile) {
            match cache.get::<Profile>(&key, MAX_AGE) {
                Lookup::Hit { value, path } => match profile_fits(&value, model, opts) {
                    Ok(()) => {
                        self.tell(&ProfileEvent::Reused { path });
                        return Ok(value);
                    }
                    Err(why) => self.tell(&ProfileEvent::Ignored { path, why }),
                },
                Lookup::Ignored { path, why } => self.tell(&ProfileEvent::Ignored { path, why }),
                Lookup::Missing { .. } => {}
            }
        }
        let t = Instant::now();
        let profile = profile_model_with(model, name, be, opts, &mut |p| {
            self.tell(&ProfileEvent::Progress(p));
        })?;
        let seconds = t.elapsed().as_secs_f64();
        let (kept, not_kept) = match &self.cache {
            Some(cache) => match cache.put(&key, &profile) {
                Ok(path) => (Some(path), None),
                Err(e) => (None, Some(e.to_string())),
            },
            None => (
                None,
                Some(format!(
                    "no cache directory (set {})",
                    crate::cache::CACHE_DIR_VAR
                )),
            ),
        };
        self.tell(&ProfileEvent::Measured {
            seconds,
            kept,
            not_kept,
        });
        Ok(profile)
    }
}

/// Whether a cached `profile` can stand for `model` under `opts`: well formed, one entry per
/// layer of the model, each of that layer's kind, at the microbatch size asked for. An entry
/// under the right key that fails is ignored and measured again, never used.
///
/// # Errors
/// What does not fit, in words.
fn profile_fits(
    profile: &Profile,
    model: &Model,
    opts: &ProfileOptions,
) -> std::result::Result<(), String> {
    profile.check().map_err(|e| e.to_string())?;
    if profile.layers.len() != model.len() {
        return Err(format!(
            "it profiles {} layers, the model has {}",
            profile.layers.len(),
            model.len()
        ));
    }
    if profile.microbatch_size != opts.microbatch_size {
        return Err(format!(
            "it was measured at microbatch size {}, not {}",
            profile.microbatch_size, opts.microbatch_size
        ));
    }
    for (i, l) in profile.layers.iter().enumerate() {
        let want = format!("{i}:{}", model.layer(i).kind());
        if l.name != want {
            return Err(format!(
                "its layer {i} is {}, the model's is {want}",
                l.name
            ));
        }
    }
    Ok(())
}

/// The key of `model`'s profile on `be` under `opts` for a run of `microbatches` per update
/// (see the module docs).
pub fn profile_key(
    model: &Model,
    name: &str,
    be: &dyn Backend,
    opts: &ProfileOptions,
    microbatches: u32,
) -> CacheKey {
    let shape = format!("{:?} {:?}", model.input_shape(), model.specs());
    let shape: String = Sha256::digest(shape.as_bytes())[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let precision = be
        .name()
        .parse::<pipe_kernels::BackendKind>()
        .map_or_else(|_| "unknown".to_string(), |k| k.precision().to_string());
    CacheKey::for_this_machine(PROFILE_KIND)
        .with("model", name)
        .with("model-shape", shape)
        .with("parameters", model.param_count())
        .with("optimizer", format!("{:?}", opts.optimizer))
        .with("backend", be.name())
        .with("precision", precision)
        .with("threads", be.threads())
        .with("microbatch-size", opts.microbatch_size)
        .with("microbatches", microbatches)
        .with("workers-at-once", opts.concurrent)
        .with(
            "method",
            format!(
                "warmup {} repeats {} budget {:?} calibrate {:?} over {} seed {}",
                opts.warmup,
                opts.repeats,
                opts.budget_seconds,
                opts.calibrate,
                opts.calibration_minibatches,
                opts.seed
            ),
        )
}
