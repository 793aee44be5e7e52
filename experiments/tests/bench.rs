//! The sweep end to end on a tiny configuration (in this process), and the pieces a report
//! depends on: the sweep file's checks, MLPerf's trimmed mean, the criterion reader.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_experiments::bench::config::TransportName;
use pipe_experiments::bench::criterion::read_criterion;
use pipe_experiments::bench::measure::{coefficient_of_variation, trimmed_mean};
use pipe_experiments::bench::{BenchConfig, Outcome, SweepOptions, load, report, run_sweep, save};

#[path = "../../tests/common/scratch.rs"]
mod scratch;

const DEFAULT: &str = include_str!("../bench/default.toml");

fn tiny() -> BenchConfig {
    let mut cfg = BenchConfig::parse(DEFAULT, "default.toml").unwrap();
    cfg.models = vec![pipe_experiments::bench::config::ModelEntry {
        name: "mlp-4-4-4-2".into(),
        microbatch: 4,
        minibatches: Some(2),
    }];
    cfg.sweeps = vec![pipe_experiments::bench::config::Sweep {
        name: "tiny".into(),
        models: vec!["mlp-4-4-4-2".into()],
        stages: vec![1, 2, 3],
        replicas: vec![1, 2],
        microbatches: vec![2],
        policies: vec!["1f1b-flush".into(), "pipedream".into(), "zb-v".into()],
        transports: vec![TransportName::InProc, TransportName::Quic],
        chunks: 2,
    }];
    cfg.traces = vec!["mlp-4-4-4-2/s2r1m2/pipedream/inproc".into()];
    cfg.profile.repeats = 1;
    cfg.target.train_samples = 256;
    cfg.target.test_samples = 256;
    cfg.target.epochs = 1;
    cfg.target.policies = vec!["sequential".into(), "pipedream".into()];
    cfg.target.model = "mlp-784-16x2-10".into();
    cfg
}

#[test]
fn a_tiny_sweep_measures_predicts_and_reports() {
    let cfg = tiny();
    let out = scratch::fresh_path("bench");
    let opts = SweepOptions {
        out: out.clone(),
        ..SweepOptions::default()
    };
    let results = run_sweep(&cfg, false, "test".into(), &opts).unwrap();
    let specs = cfg.expand().unwrap();
    assert_eq!(results.configs.len(), specs.len());
    let mut measured = 0;
    for c in &results.configs {
        match &c.outcome {
            Outcome::Measured {
                measured: m,
                predicted,
                mfu,
                ..
            } => {
                measured += 1;
                assert_eq!(m.run_s.len(), cfg.repeats as usize, "{}", c.spec.id);
                assert!(m.samples_per_s > 0.0 && m.samples_per_s.is_finite());
                assert!(*mfu > 0.0);
                assert_eq!(m.per_worker.len() as u32, m.workers);
                assert!(m.per_worker.iter().all(|w| (0.0..=1.5).contains(&w.busy)));
                let p = predicted
                    .as_ref()
                    .expect("every measured configuration is predicted");
                assert!(p.samples_per_s > 0.0 && p.samples_per_s.is_finite());
                assert!((0.0..1.0).contains(&p.ideal_bubble));
                // Weights are counted per worker: every stage once over a replica group.
                assert!(m.per_worker.iter().all(|w| w.param_bytes > 0));
                if c.spec.policy.name() == "pipedream" && c.spec.stages > 1 {
                    let first = &m.per_worker[0];
                    assert!(first.peak_versions > 1, "{}: pipedream stashes", c.spec.id);
                    assert!(first.peak_stash_bytes > 0, "{}", c.spec.id);
                }
                if c.spec.stages > 1 || c.spec.replicas > 1 {
                    assert!(m.bytes_sent_per_sample > 0.0, "{}", c.spec.id);
                } else {
                    assert_eq!(m.bytes_sent_per_sample, 0.0, "{}", c.spec.id);
                }
            }
            // zb-v at 3 positions needs 6 stages with weights; the model has 3.
            Outcome::Skipped { reason } => {
                assert!(
                    c.spec.policy.name() == "zb-v" && c.spec.stages >= 2,
                    "{}: {reason}",
                    c.spec.id
                );
            }
            other => panic!("{}: {other:?}", c.spec.id),
        }
    }
    assert!(measured >= 20, "{measured} measured");
    assert_eq!(results.target.len(), 2);
    assert_eq!(results.links.len(), 2);
    save(&results, &out).unwrap();
    let back = load(&out).unwrap();
    assert_eq!(back, results);
    let path = report::write_report(&back, &out).unwrap();
    let md = std::fs::read_to_string(path).unwrap();
    for needle in [
        "## Summary",
        "QUIC / in-process throughput",
        "measured / simulated",
        "## Every measured configuration",
        "## Time to target loss",
        "## Configurations not measured",
        "## Chrome traces",
    ] {
        assert!(md.contains(needle), "report lacks {needle:?}");
    }
    for plot in [
        "throughput-mlp-4-4-4-2-r1",
        "memory-mlp-4-4-4-2-r2",
        "predicted-vs-measured",
    ] {
        for ext in ["svg", "csv"] {
            let p = out.join("plots").join(format!("{plot}.{ext}"));
            assert!(p.is_file(), "{} missing", p.display());
        }
    }
    let trace = out
        .join("traces")
        .join("mlp-4-4-4-2_s2r1m2_pipedream_inproc.measured.json");
    let text = std::fs::read_to_string(trace).unwrap();
    assert!(text.contains("\"ph\":\"X\"") || text.contains("\"ph\": \"X\""));
    results_out_of_range_are_refused_at_load(&results, &out);
    let _ = std::fs::remove_dir_all(&out);
}

/// Each figure that no sweep could measure, saved into `out`, is refused by `load` naming
/// its field.
fn results_out_of_range_are_refused_at_load(
    good: &pipe_experiments::bench::BenchResults,
    out: &std::path::Path,
) {
    type Edit = fn(&mut pipe_experiments::bench::BenchResults);
    fn measured(
        r: &mut pipe_experiments::bench::BenchResults,
    ) -> &mut pipe_experiments::bench::measure::Measured {
        r.configs
            .iter_mut()
            .find_map(|c| match &mut c.outcome {
                Outcome::Measured { measured, .. } => Some(&mut **measured),
                _ => None,
            })
            .unwrap()
    }
    let edits: [(Edit, &str); 10] = [
        (|r| measured(r).samples_per_s = -5.0, "samples_per_s = -5"),
        (|r| measured(r).samples_per_s = 0.0, "samples_per_s = 0"),
        (|r| measured(r).workers = 0, "workers = 0"),
        (|r| r.configs.clear(), "configs is empty"),
        (
            |r| r.target[0].test_accuracy = Some(5.0),
            "test_accuracy = 5",
        ),
        (|r| r.peak_gflops = -1.0, "peak_gflops = -1"),
        (|r| measured(r).cv = -0.5, "cv = -0.5"),
        (|r| r.links[0].1.bandwidth = Some(-1.0), "bandwidth = -1"),
        (
            |r| measured(r).partition[0] = [10, 0],
            "partition range [10, 0]",
        ),
        (|r| measured(r).per_worker[0].busy = 1.5, "busy = 1.5"),
    ];
    for (edit, want) in edits {
        let mut bad = good.clone();
        edit(&mut bad);
        save(&bad, out).unwrap();
        let e = load(out).unwrap_err().to_string();
        assert!(
            e.contains("results.json") && e.contains(want),
            "{want}: {e}"
        );
    }
}

#[test]
fn sweep_files_are_checked() {
    let bad = |edit: &dyn Fn(&str) -> String, want: &str| {
        let text = edit(DEFAULT);
        let err = BenchConfig::parse(&text, "f.toml").unwrap_err().to_string();
        assert!(err.contains(want), "{err:?} lacks {want:?}");
        assert!(err.starts_with("f.toml: "), "{err}");
    };
    bad(
        &|s| s.replace("repeats = 5  ", "repeats = 3  "),
        "repeats = 3: between 5",
    );
    bad(
        &|s| s.replace("repeats = 5  ", "repeats = 5000  "),
        "and 1000",
    );
    bad(
        &|s| s.replace("budget_minutes = 60", "budget_minutes = -1"),
        "budget_minutes",
    );
    bad(
        &|s| s.replace("minibatches = 2 ", "minibatches = 0 "),
        "minibatches = 0",
    );
    bad(
        &|s| s.replace("stages = [2, 4, 8]", "stages = [0]"),
        "stages",
    );
    bad(
        &|s| s.replace("replicas = [1, 2]", "replicas = [100]"),
        "replicas",
    );
    bad(
        &|s| s.replace("\"1f1b-flush\", \"pipedream\"]", "\"1f1b\"]"),
        "unknown schedule",
    );
    bad(
        &|s| s.replace("transports = [\"inproc\"]", "transports = [\"tcp\"]"),
        "tcp",
    );
    bad(
        &|s| s.replace("repeats = 5  ", "repeats = 5\nrepeat = 5  "),
        "unknown field",
    );
    bad(
        &|s| s.replace("models = [\"mlp-784-1024x16-10\"]", "models = [\"nope\"]"),
        "\"nope\" is not in [[models]]",
    );
    bad(
        &|s| s.replace("lr = 0.01", "lr = -0.01"),
        "lr and target_loss",
    );
    assert!(BenchConfig::parse(DEFAULT, "f").is_ok());
}

#[test]
fn policies_get_the_microbatches_they_need() {
    let cfg = BenchConfig::parse(DEFAULT, "f").unwrap();
    let specs = cfg.expand().unwrap();
    let find = |id: &str| {
        specs
            .iter()
            .find(|s| s.id == id)
            .unwrap_or_else(|| panic!("{id}"))
    };
    // zb-v and dualpipev need 2 x stages, interleaved a multiple of the stages.
    assert_eq!(find("gpt-mini/s8r1m16/zb-v/inproc").m, 16);
    assert_eq!(find("gpt-mini/s8r2m16/dualpipev/inproc").m, 16);
    assert_eq!(
        find("mlp-784-1024x16-10/s8r1m8/interleaved/inproc").chunks,
        2
    );
    // M = 4 is raised to 8 for zb-v at 4 stages: the same configuration as the policies
    // sweep's, run once.
    assert!(
        !specs
            .iter()
            .any(|s| s.id == "mlp-784-1024x16-10/s4r1m4/zb-v/inproc")
    );
    assert_eq!(
        find("mlp-784-1024x16-10/s4r1m8/zb-v/inproc").sweep,
        "policies"
    );
    // No configuration twice, even where sweeps overlap.
    let mut ids: Vec<&str> = specs.iter().map(|s| s.id.as_str()).collect();
    ids.sort_unstable();
    let n = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), n);
    // Every trace names a configuration of the sweep.
    for t in &cfg.traces {
        find(t);
    }
    let quick = cfg.quick();
    for t in &quick.traces {
        assert!(quick.expand().unwrap().iter().any(|s| &s.id == t), "{t}");
    }
}

#[test]
fn mlperf_mean_drops_the_fastest_and_slowest() {
    assert_eq!(trimmed_mean(&[1.0, 100.0, 2.0, 3.0, 0.0]), 2.0);
    assert_eq!(trimmed_mean(&[4.0, 2.0]), 3.0);
    assert!((coefficient_of_variation(&[1.0, 1.0, 1.0])).abs() < 1e-12);
    let cv = coefficient_of_variation(&[1.0, 3.0]);
    assert!((cv - 2f64.sqrt() / 2.0).abs() < 1e-12, "{cv}");
}

#[test]
fn criterion_results_are_read_and_malformed_ones_named() {
    let dir = scratch::fresh_path("criterion");
    let new = dir.join("group").join("case").join("new");
    std::fs::create_dir_all(&new).unwrap();
    std::fs::write(
        new.join("estimates.json"),
        r#"{"mean":{"point_estimate":2.0,"confidence_interval":{"lower_bound":1.0,"upper_bound":3.0}},
            "median":{"point_estimate":2000.0,"confidence_interval":{"lower_bound":1900.0,"upper_bound":2100.0}}}"#,
    )
    .unwrap();
    std::fs::write(
        new.join("benchmark.json"),
        r#"{"group_id":"group","function_id":"case","full_id":"group/case","throughput":{"Bytes":4000}}"#,
    )
    .unwrap();
    let figs = read_criterion(&dir).unwrap();
    assert_eq!(figs.len(), 1);
    assert_eq!(figs[0].id, "group/case");
    assert!((figs[0].median_s - 2e-6).abs() < 1e-15);
    assert!((figs[0].throughput.unwrap() - 2e9).abs() < 1.0);
    std::fs::write(new.join("estimates.json"), "{").unwrap();
    let err = read_criterion(&dir).unwrap_err().to_string();
    assert!(
        err.contains("estimates.json") && err.contains("not a criterion file"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every results file committed beside a report still loads, the earlier runs' included: a
/// field added to the format since must not leave a committed run unreadable.
#[test]
fn every_committed_results_file_loads() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for dir in ["bench", "bench/earlier-run"] {
        let r = load(&root.join(dir)).unwrap_or_else(|e| panic!("{dir}: {e}"));
        assert!(!r.configs.is_empty(), "{dir}");
    }
    for dir in [
        "staleness",
        "staleness/deep-stages",
        "staleness/gpt-mini",
        "staleness/optimizers-lm",
        "staleness/optimizers-lm-rates",
        "staleness/optimizers-lm-sweep",
    ] {
        pipe_experiments::staleness::load(&root.join(dir)).unwrap_or_else(|e| panic!("{dir}: {e}"));
    }
}
