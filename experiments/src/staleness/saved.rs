//! The checks a saved `results.json` passes when it is read back ([`super::load`]): the
//! configuration's own checks ([`StalenessConfig::check`]), then every run: a unique id, a
//! policy, stage count and optimizer the configuration lists, counts of at least 1, finite
//! losses of at least 0 (none only for a run that diverged), epochs with shares in `[0, 1]`,
//! and times of at least 0. The report trusts what passes, so a run that could not have been
//! run is refused on one line naming it, rather than dropped from a table or shown as NaN.

use std::collections::HashSet;

use pipe_scheduler::Policy;

use super::config::{Family, StalenessConfig};
use super::results::StalenessResults;
use super::run::RunRecord;

/// The most logical cores a saved machine may say it had.
const MAX_CORES: usize = 1 << 20;

/// `Err` naming `what`'s `field` unless `v` is finite and at least 0 (and at most 1 when
/// `share`).
fn figure(what: &str, field: &str, v: f64, share: bool) -> Result<(), String> {
    let ok = v.is_finite() && v >= 0.0 && (!share || v <= 1.0);
    match (ok, share) {
        (true, _) => Ok(()),
        (false, true) => Err(format!("{what}: {field} = {v}: must be in [0, 1]")),
        (false, false) => Err(format!(
            "{what}: {field} = {v}: must be finite and at least 0"
        )),
    }
}

/// Checks the configuration and every run of `r`.
///
/// # Errors
/// A message naming the field and the run it belongs to.
pub(super) fn check(r: &StalenessResults) -> Result<(), String> {
    r.config.check().map_err(|e| format!("config: {e}"))?;
    figure("results", "wall_s", r.wall_s, false)?;
    if r.machine.cores == 0 || r.machine.cores > MAX_CORES {
        return Err(format!(
            "machine: cores = {}: must be from 1 to {MAX_CORES}",
            r.machine.cores
        ));
    }
    figure("machine", "memory_gib", r.machine.memory_gib, false)?;
    if r.runs.is_empty() {
        return Err("runs is empty: an experiment runs at least one".into());
    }
    let mut ids = HashSet::new();
    for run in &r.runs {
        if !ids.insert(run.spec.id.as_str()) {
            return Err(format!("run {} appears twice", run.spec.id));
        }
        check_spec(&r.config, run)?;
        check_record(run)?;
    }
    Ok(())
}

/// A run's spec against the configuration it ran under.
fn check_spec(cfg: &StalenessConfig, run: &RunRecord) -> Result<(), String> {
    let s = &run.spec;
    super::config::run_id_fits(&s.id)?;
    let what = format!("run {}", s.id);
    let listed = |list: &[String], name: &str| list.iter().any(|p| p == name);
    match s.family {
        Family::Pipeline => {
            s.policy
                .parse::<Policy>()
                .map_err(|e| format!("{what}: policy: {e}"))?;
            if !listed(&cfg.policies, &s.policy) && !listed(&cfg.remedies.policies, &s.policy) {
                return Err(format!(
                    "{what}: policy {:?} is not among the configuration's policies",
                    s.policy
                ));
            }
            if !cfg.stages.contains(&s.stages) && s.stages != cfg.remedies.stages {
                return Err(format!(
                    "{what}: stages = {} is not among the configuration's stage counts {:?}",
                    s.stages, cfg.stages
                ));
            }
        }
        Family::Delayed => {
            let delay = s.policy.strip_prefix("delay:").unwrap_or_default();
            if !listed(&cfg.delayed.delays, delay) && delay != cfg.delayed.remedy_delay {
                return Err(format!(
                    "{what}: policy {:?} is not one of the configuration's delays",
                    s.policy
                ));
            }
            if s.stages != 1 {
                return Err(format!(
                    "{what}: stages = {}: the delayed baseline runs on 1",
                    s.stages
                ));
            }
        }
    }
    if !cfg.optimizers.iter().any(|o| o.name == s.optimizer) {
        return Err(format!(
            "{what}: optimizer {:?} is not among the configuration's optimizers",
            s.optimizer
        ));
    }
    for (field, v) in [
        ("microbatch_size", s.microbatch_size as u64),
        ("microbatches", s.microbatches as u64),
        ("replicas", u64::from(s.replicas)),
    ] {
        if v == 0 {
            return Err(format!("{what}: {field} = 0: must be at least 1"));
        }
    }
    let f = f64::from(s.lr_factor);
    if !(f.is_finite() && f > 0.0) {
        return Err(format!(
            "{what}: lr_factor = {f}: must be finite and above 0"
        ));
    }
    Ok(())
}

/// A run's figures: losses, epochs, delays and times.
fn check_record(run: &RunRecord) -> Result<(), String> {
    let what = format!("run {}", run.spec.id);
    if run.losses.is_empty() && run.diverged_at.is_none() {
        return Err(format!(
            "{what}: losses is empty, yet the run did not diverge: a run records the loss of \
             every update"
        ));
    }
    for &l in &run.losses {
        figure(&what, "a loss", f64::from(l), false)?;
    }
    for (i, e) in run.epochs.iter().enumerate() {
        if e.epoch != i as u64 + 1 {
            return Err(format!(
                "{what}: epoch {} recorded in place {}: epochs count from 1 in order",
                e.epoch,
                i + 1
            ));
        }
        figure(&what, "train_loss", e.train_loss, false)?;
        figure(&what, "test_loss", e.test_loss, false)?;
        figure(&what, "test_accuracy", e.test_accuracy, true)?;
        figure(&what, "elapsed_s", e.elapsed_s, false)?;
    }
    if let Some(s) = run.seconds_to_target {
        figure(&what, "seconds_to_target", s, false)?;
    }
    // Counted in the updates the run recorded: the target is reached at a recorded loss, and
    // a run diverges at most one update past its last finite one.
    let recorded = run.losses.len() as u64;
    if let Some(u) = run.updates_to_target.filter(|&u| u == 0 || u > recorded) {
        return Err(format!(
            "{what}: updates_to_target = {u}: must be from 1 to the {recorded} updates recorded"
        ));
    }
    if let Some(d) = run.diverged_at.filter(|&d| d > recorded + 1) {
        return Err(format!(
            "{what}: diverged_at = {d}: past the {recorded} updates recorded"
        ));
    }
    for d in &run.stage_delays {
        if d.stage >= run.spec.stages {
            return Err(format!(
                "{what}: stage_delays names stage {} of {} stages",
                d.stage, run.spec.stages
            ));
        }
        figure(&what, "forward_mean", d.forward_mean, false)?;
        figure(&what, "backward_mean", d.backward_mean, false)?;
    }
    figure(&what, "wall_s", run.wall_s, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn committed() -> StalenessResults {
        let text = include_str!("../../staleness/optimizers-lm-rates/results.json");
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn runs_that_could_not_have_run_are_refused_by_name() {
        assert_eq!(check(&committed()), Ok(()));
        type Edit = fn(&mut StalenessResults);
        let edits: [(Edit, &str); 14] = [
            (
                |r| r.runs[0].spec.stages = 1_000_000_000,
                "stages = 1000000000",
            ),
            (|r| r.runs[0].spec.stages = 0, "stages = 0"),
            (|r| r.runs[0].losses[0] = -1.0, "a loss = -1"),
            (|r| r.runs[0].losses.clear(), "losses is empty"),
            (|r| r.runs[0].spec.policy = "zzz".into(), "unknown schedule"),
            (|r| r.runs.push(r.runs[0].clone()), "appears twice"),
            (|r| r.runs[0].wall_s = -1.0, "wall_s = -1"),
            (|r| r.runs[0].spec.optimizer = "x".into(), "optimizer \"x\""),
            (|r| r.config.target_loss = -1.0, "config: target_loss = -1"),
            (
                |r| r.runs[0].updates_to_target = Some(u64::MAX),
                "updates_to_target = 18446744073709551615",
            ),
            (|r| r.runs[0].diverged_at = Some(1 << 40), "diverged_at = "),
            (|r| r.machine.memory_gib = -1e308, "memory_gib = "),
            (|r| r.machine.cores = usize::MAX, "cores = "),
            (|r| r.config.target_window = usize::MAX, "target_window = "),
        ];
        for (edit, want) in edits {
            let mut bad = committed();
            edit(&mut bad);
            let e = check(&bad).unwrap_err();
            assert!(e.contains(want), "{want}: {e}");
        }
        // A run that diverged at its first update has no loss to record.
        let mut diverged = committed();
        diverged.runs[0].losses.clear();
        diverged.runs[0].diverged_at = Some(0);
        assert_eq!(check(&diverged), Ok(()));
    }
}
