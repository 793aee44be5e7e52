//! The checks a saved `results.json` passes when it is read back ([`super::load`]): every
//! figure finite and in its range, every count that cannot be 0 at least 1, every share in
//! `[0, 1]`, every partition a run of contiguous, non-empty layer ranges from layer 0. The
//! report trusts what passes, so a hand-edited or damaged file is refused on one line naming
//! the field and the configuration, rather than rendered as "-5 samples/s" or "NaN".

use std::collections::HashSet;

use super::criterion::{CriterionFigure, NumpyFigures};
use super::measure::Measured;
use super::predict::Predicted;
use super::results::{BenchResults, Outcome};
use super::target::TargetResult;

/// The range a figure must lie in.
#[derive(Clone, Copy)]
enum Range {
    /// Finite and above 0.
    Positive,
    /// Finite and at least 0.
    NonNegative,
    /// A share: in `[0, 1]`.
    Fraction,
}

/// The largest figure a saved file may hold (seconds, rates, bytes, ratios): far past any
/// measurement, and small enough that the report's unit conversions and sums stay finite
/// (1e308 seconds rendered as "inf ms").
const MAX_FIGURE: f64 = 1e15;

/// `Err` naming `what`'s `field` unless `v` lies in `range` (and at most [`MAX_FIGURE`]).
fn figure(what: &str, field: &str, v: f64, range: Range) -> Result<(), String> {
    let (ok, says) = match range {
        Range::Positive => (
            v > 0.0 && v <= MAX_FIGURE,
            "must be finite, above 0 and at most 1e15",
        ),
        Range::NonNegative => (
            (0.0..=MAX_FIGURE).contains(&v),
            "must be finite, at least 0 and at most 1e15",
        ),
        Range::Fraction => ((0.0..=1.0).contains(&v), "must be in [0, 1]"),
    };
    if v.is_finite() && ok {
        Ok(())
    } else {
        Err(format!("{what}: {field} = {v}: {says}"))
    }
}

/// `Err` naming `what`'s `field` unless the count `v` is at least 1.
fn count(what: &str, field: &str, v: u64) -> Result<(), String> {
    if v == 0 {
        Err(format!("{what}: {field} = 0: must be at least 1"))
    } else {
        Ok(())
    }
}

/// Checks every figure of `r`.
///
/// # Errors
/// A message naming the field and the configuration (or run) it belongs to.
pub(super) fn check(r: &BenchResults) -> Result<(), String> {
    r.config.check().map_err(|e| format!("config: {e}"))?;
    figure("results", "wall_s", r.wall_s, Range::NonNegative)?;
    figure("results", "peak_gflops", r.peak_gflops, Range::Positive)?;
    count("machine", "cores", r.machine.cores as u64)?;
    figure(
        "machine",
        "memory_gib",
        r.machine.memory_gib,
        Range::NonNegative,
    )?;
    for (transport, link) in &r.links {
        let what = format!("link {}", transport.name());
        figure(&what, "latency_s", link.latency_s, Range::NonNegative)?;
        figure(&what, "cpu_s", link.cpu_s, Range::NonNegative)?;
        figure(&what, "byte_cpu_s", link.byte_cpu_s, Range::NonNegative)?;
        if let Some(b) = link.bandwidth {
            figure(&what, "bandwidth", b, Range::Positive)?;
        }
    }
    for s in &r.single {
        let what = format!("single worker {}", s.model);
        count(&what, "batch", s.batch as u64)?;
        figure(&what, "samples_per_s", s.samples_per_s, Range::Positive)?;
        figure(&what, "mfu", s.mfu, Range::NonNegative)?;
    }
    if r.configs.is_empty() {
        return Err("configs is empty: a sweep measures at least one configuration".into());
    }
    let mut ids = HashSet::new();
    for c in &r.configs {
        let what = format!("configuration `{}`", c.spec.id);
        if !ids.insert(c.spec.id.as_str()) {
            return Err(format!("{what} appears twice"));
        }
        let s = &c.spec;
        for (field, v) in [
            ("microbatch", s.microbatch as u64),
            ("stages", u64::from(s.stages)),
            ("replicas", u64::from(s.replicas)),
            ("m", u64::from(s.m)),
            ("chunks", u64::from(s.chunks)),
            ("minibatches", u64::from(s.minibatches)),
        ] {
            count(&what, field, v)?;
        }
        if let Outcome::Measured {
            measured,
            predicted,
            mfu,
            ..
        } = &c.outcome
        {
            check_measured(&what, measured)?;
            if let Some(p) = predicted {
                check_predicted(&what, p, measured.workers)?;
            }
            figure(&what, "mfu", *mfu, Range::NonNegative)?;
        }
    }
    for t in &r.target {
        check_target(t)?;
    }
    for c in &r.criterion {
        check_criterion(c)?;
    }
    if let Some(n) = &r.numpy {
        check_numpy(n)?;
    }
    Ok(())
}

/// One configuration's measurement.
fn check_measured(what: &str, m: &Measured) -> Result<(), String> {
    count(what, "workers", u64::from(m.workers))?;
    count(what, "model_stages", u64::from(m.model_stages))?;
    count(what, "samples_per_run", m.samples_per_run)?;
    count(what, "tokens_per_sample", m.tokens_per_sample)?;
    check_partition(what, &m.partition, m.model_stages)?;
    if m.run_s.is_empty() {
        return Err(format!(
            "{what}: run_s is empty: every timed run has a time"
        ));
    }
    for &t in &m.run_s {
        figure(what, "run_s", t, Range::Positive)?;
    }
    figure(what, "samples_per_s", m.samples_per_s, Range::Positive)?;
    figure(what, "cv", m.cv, Range::NonNegative)?;
    figure(what, "bubble", m.bubble, Range::Fraction)?;
    figure(
        what,
        "bytes_sent_per_sample",
        m.bytes_sent_per_sample,
        Range::NonNegative,
    )?;
    if m.per_worker.len() != m.workers as usize {
        return Err(format!(
            "{what}: per_worker holds {} entries for {} workers",
            m.per_worker.len(),
            m.workers
        ));
    }
    for w in &m.per_worker {
        figure(what, "per_worker busy", w.busy, Range::Fraction)?;
    }
    Ok(())
}

/// A partition: `stages` ranges `[start, end)` of layers, each non-empty, the first from
/// layer 0, each starting where the one before ends.
fn check_partition(what: &str, partition: &[[usize; 2]], stages: u32) -> Result<(), String> {
    if partition.len() != stages as usize {
        return Err(format!(
            "{what}: partition holds {} ranges for {stages} model stages",
            partition.len()
        ));
    }
    let mut next = 0;
    for &[start, end] in partition {
        if start != next || end <= start {
            return Err(format!(
                "{what}: partition range [{start}, {end}] is not a non-empty range starting at \
                 layer {next}"
            ));
        }
        next = end;
    }
    Ok(())
}

/// One configuration's prediction, for a run of `workers` workers.
fn check_predicted(what: &str, p: &Predicted, workers: u32) -> Result<(), String> {
    figure(
        what,
        "predicted samples_per_s",
        p.samples_per_s,
        Range::Positive,
    )?;
    figure(what, "predicted bubble", p.bubble, Range::Fraction)?;
    figure(
        what,
        "predicted ideal_bubble",
        p.ideal_bubble,
        Range::Fraction,
    )?;
    if p.busy.len() != workers as usize {
        return Err(format!(
            "{what}: predicted busy holds {} entries for {workers} workers",
            p.busy.len()
        ));
    }
    for &b in &p.busy {
        figure(what, "predicted busy", b, Range::Fraction)?;
    }
    for &b in p.weight_bytes.iter().chain(&p.activation_bytes) {
        figure(what, "predicted bytes", b, Range::NonNegative)?;
    }
    Ok(())
}

/// One policy's time to target.
fn check_target(t: &TargetResult) -> Result<(), String> {
    let what = format!("target run {}", t.policy);
    // Its heading names the policy: one that is no schedule was printed as if it ran.
    t.policy
        .parse::<pipe_scheduler::Policy>()
        .map_err(|e| format!("{what}: policy: {e}"))?;
    count(&what, "stages", u64::from(t.stages))?;
    if let Some(s) = t.seconds {
        figure(&what, "seconds", s, Range::NonNegative)?;
    }
    if let Some(a) = t.test_accuracy {
        figure(&what, "test_accuracy", a, Range::Fraction)?;
    }
    figure(&what, "wall_s", t.wall_s, Range::NonNegative)
}

/// One criterion figure.
fn check_criterion(c: &CriterionFigure) -> Result<(), String> {
    let what = format!("criterion bench `{}`", c.id);
    figure(&what, "median_s", c.median_s, Range::Positive)?;
    let [lo, hi] = c.interval_s;
    figure(&what, "interval_s", lo, Range::NonNegative)?;
    figure(&what, "interval_s", hi, Range::NonNegative)?;
    if lo > hi {
        return Err(format!("{what}: interval_s [{lo}, {hi}] is reversed"));
    }
    if let Some(t) = c.throughput {
        figure(&what, "throughput", t, Range::Positive)?;
    }
    Ok(())
}

/// numpy's figures, as [`super::criterion::read_numpy`] checks them.
fn check_numpy(n: &NumpyFigures) -> Result<(), String> {
    if n.rows.is_empty() {
        return Err("numpy: rows is empty".into());
    }
    for r in &n.rows {
        let what = format!("numpy row {}", r.shape);
        count(&what, "threads", u64::from(r.threads))?;
        figure(&what, "pipe_gflops", r.pipe_gflops, Range::Positive)?;
        figure(&what, "numpy_gflops", r.numpy_gflops, Range::Positive)?;
        figure(&what, "ratio", r.ratio, Range::Positive)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_outside_their_range_are_named() {
        assert!(figure("c", "f", 1.0, Range::Positive).is_ok());
        assert!(figure("c", "f", 0.0, Range::NonNegative).is_ok());
        assert!(figure("c", "f", 1.0, Range::Fraction).is_ok());
        for (v, range) in [
            (0.0, Range::Positive),
            (-5.0, Range::Positive),
            (f64::INFINITY, Range::Positive),
            (-1e-9, Range::NonNegative),
            (f64::NAN, Range::NonNegative),
            (5.0, Range::Fraction),
            (-0.1, Range::Fraction),
            (1e308, Range::Positive),
            (1e16, Range::NonNegative),
        ] {
            let e = figure("configuration `x`", "samples_per_s", v, range).unwrap_err();
            assert!(e.starts_with("configuration `x`: samples_per_s = "), "{e}");
        }
        assert!(
            count("c", "workers", 0)
                .unwrap_err()
                .contains("workers = 0")
        );
    }

    #[test]
    fn partitions_are_contiguous_nonempty_ranges_from_layer_0() {
        assert!(check_partition("c", &[[0, 5], [5, 10]], 2).is_ok());
        for (p, stages) in [
            (vec![[10, 0]], 1),
            (vec![[0, 0]], 1),
            (vec![[1, 5]], 1),
            (vec![[0, 5], [6, 10]], 2),
            (vec![[0, 5]], 2),
        ] {
            assert!(check_partition("c", &p, stages).is_err(), "{p:?}");
        }
    }

    #[test]
    fn a_target_run_of_no_schedule_is_refused() {
        let run = |policy: &str| TargetResult {
            policy: policy.into(),
            stages: 4,
            updates: Some(10),
            seconds: Some(1.0),
            test_accuracy: Some(0.9),
            wall_s: 2.0,
            error: None,
        };
        assert!(check_target(&run("pipedream")).is_ok());
        assert!(check_target(&run("sequential")).is_ok());
        let e = check_target(&run("zzz")).unwrap_err();
        assert!(e.starts_with("target run zzz: policy: "), "{e}");
    }
}
