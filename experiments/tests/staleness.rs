//! The staleness experiment end to end on a small matrix: the committed configuration
//! parses, the matrix has the runs it should, a run records what the report needs, and the
//! report regenerates from saved results alone.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_experiments::staleness::config::Family;
use pipe_experiments::staleness::{StalenessConfig, load, report, run_experiment, save};

#[path = "../../tests/common/scratch.rs"]
mod scratch;

const COMMITTED: &str = include_str!("../staleness/mnist.toml");
const OPTIMIZERS_LM: &str = include_str!("../staleness/optimizers-lm.toml");

/// The language model's optimizer matrix: sequential, 2bw and pipedream at 4 stages, for each
/// of AdamW, Muon, Lion and SGD and each of three seeds, every run on one minibatch.
#[test]
fn the_optimizers_configuration_expands_into_its_matrix() {
    use pipe_stages::optim::OptimizerKind;
    let cfg = StalenessConfig::parse(OPTIMIZERS_LM, "optimizers-lm.toml").unwrap();
    let kinds: Vec<OptimizerKind> = cfg.optimizers.iter().map(|o| o.kind).collect();
    for kind in [
        OptimizerKind::Adamw,
        OptimizerKind::Muon,
        OptimizerKind::Lion,
        OptimizerKind::Sgd,
    ] {
        assert!(kinds.contains(&kind), "{kind:?}");
    }
    let runs = cfg.matrix().unwrap();
    // Sequential, 2bw and pipedream, and 2bw with each of three delay corrections, for 4
    // optimizers, 3 seeds.
    assert_eq!(runs.len(), 6 * 4 * 3);
    for correction in ["error-feedback", "dc-asgd", "dc-asgd-adaptive"] {
        assert_eq!(
            runs.iter()
                .filter(|r| r.delay_correction.map(|c| c.name()) == Some(correction)
                    && r.policy == "2bw")
                .count(),
            4 * 3,
            "{correction}"
        );
    }
    assert!(runs.iter().all(|r| r.family == Family::Pipeline));
    for r in &runs {
        assert_eq!(
            r.microbatch_size * r.microbatches,
            cfg.minibatch,
            "{}",
            r.id
        );
    }
    // Quick: one seed, the same six runs per optimizer.
    assert_eq!(cfg.quick().matrix().unwrap().len(), 6 * 4);
}

#[test]
fn the_committed_configuration_expands_into_the_full_matrix() {
    let cfg = StalenessConfig::parse(COMMITTED, "mnist.toml").unwrap();
    let runs = cfg.matrix().unwrap();
    let seeds = cfg.seeds.len();
    assert!(seeds >= 3);
    let pipeline = runs
        .iter()
        .filter(|r| r.family == Family::Pipeline && r.remedy == "none");
    // sequential at one stage, the six other policies at 2, 4 and 8, per optimizer and seed.
    assert_eq!(pipeline.count(), (1 + 6 * 3) * 2 * seeds);
    for policy in [
        "sequential",
        "1f1b-flush",
        "gpipe",
        "pipedream",
        "pipedream-nostash",
        "vsync",
        "2bw",
    ] {
        assert!(runs.iter().any(|r| r.policy == policy), "{policy}");
    }
    for s in [1, 2, 4, 8] {
        assert!(runs.iter().any(|r| r.stages == s));
    }
    // Every pipeline run takes the same samples per update, replicated or not.
    for r in runs.iter().filter(|r| r.family == Family::Pipeline) {
        assert_eq!(
            r.microbatch_size * r.microbatches * r.replicas as usize,
            cfg.minibatch,
            "{}",
            r.id
        );
    }
    let ids: std::collections::HashSet<&str> = runs.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids.len(), runs.len(), "run ids are unique");
    assert!(runs.iter().any(|r| r.family == Family::Delayed));
    // The bf16 all-reduce against the same replicated layout in f32.
    for label in ["replicas:2", "replicas:2+allreduce:bf16"] {
        assert!(
            runs.iter()
                .any(|r| r.remedy == label && r.replicas == 2 && r.stages == 8),
            "{label}"
        );
    }
}

#[test]
fn bad_configurations_are_refused_with_the_reason() {
    let cases = [
        (
            "\"pipedream\", \"pipedream-nostash\", \"vsync\"",
            "\"fast\", \"pipedream-nostash\", \"vsync\"",
            "fast",
        ),
        ("minibatch = 64", "minibatch = 60", "does not split"),
        (
            "remedy_delay = \"uniform:7\"",
            "remedy_delay = \"soon\"",
            "delay 'soon'",
        ),
        ("seeds = [1, 2, 3]", "seeds = []", "at least one"),
        ("epochs = 3", "epochs = \"three\"", "mnist.toml"),
        (
            "target_loss = 0.15",
            "target_loss = nan",
            "mnist.toml: target_loss = NaN",
        ),
        (
            "target_loss = 0.15",
            "target_loss = -1.0",
            "target_loss = -1",
        ),
        (
            "seeds = [1, 2, 3]",
            "seeds = [1, 2, 1]",
            "seeds lists 1 twice",
        ),
        (
            "{ sync_warmup = 300 },",
            "{ sync_warmup = 300 }, { sync_warmup = 300 },",
            "comes twice in the matrix",
        ),
        // Run ids, ledgers and plots are named after the optimizers: a path in a name would
        // write outside `--out`.
        (
            "name = \"sgd-momentum\"",
            "name = \"x/../../../escaped\"",
            "optimizer name \"x/../../../escaped\"",
        ),
        (
            "name = \"sgd-momentum\"",
            "name = \"..\"",
            "the name goes into file names",
        ),
    ];
    for (from, to, want) in cases {
        let text = COMMITTED.replacen(from, to, 1);
        assert_ne!(text, COMMITTED, "{from} is in the file");
        let err = StalenessConfig::parse(&text, "mnist.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{to}: {err}");
    }
}

#[test]
fn an_empty_matrix_is_refused() {
    let mut cfg = StalenessConfig::parse(COMMITTED, "mnist.toml").unwrap();
    cfg.stages = vec![1];
    cfg.policies = vec!["pipedream".into()];
    cfg.remedies.policies.clear();
    cfg.delayed.delays.clear();
    cfg.delayed.remedies.clear();
    let err = cfg.matrix().unwrap_err().to_string();
    assert!(err.contains("no runs"), "{err}");
}

#[test]
fn a_small_experiment_runs_saves_and_regenerates_its_report() {
    let mut cfg = StalenessConfig::parse(COMMITTED, "mnist.toml").unwrap();
    cfg.quick.train_samples = 1024;
    cfg.quick.test_samples = 256;
    cfg.quick.stages = vec![1, 2];
    cfg.delayed.delays = vec!["0".into(), "2".into()];
    cfg.remedies.variants.truncate(2);
    cfg.target_loss = 10.0;
    cfg.target_window = 4;
    let dir = scratch::fresh_path("staleness");
    let mut seen = 0;
    let results = run_experiment(&cfg, true, &dir, "pipe test", &mut |i, n, _| {
        seen = i;
        assert!(i <= n);
    })
    .unwrap();
    assert_eq!(seen, results.runs.len());
    for r in &results.runs {
        let updates = 1024 / r.spec.microbatch_size / r.spec.microbatches;
        assert_eq!(
            r.losses.len(),
            updates,
            "{}: one loss per update",
            r.spec.id
        );
        assert_eq!(r.epochs.len(), 1);
        // A target of 10 nats is met as soon as the window is full.
        assert_eq!(r.updates_to_target, Some(4), "{}", r.spec.id);
    }
    // The measured delays: pipedream at two stages runs stage 0 one update behind.
    let pd = results
        .runs
        .iter()
        .find(|r| r.spec.policy == "pipedream" && r.spec.remedy == "none")
        .unwrap();
    assert_eq!(pd.stage_delays[0].forward_max, 1);
    assert_eq!(pd.stage_delays[1].forward_max, 0);
    assert!(
        dir.join("ledgers")
            .join(format!("{}.csv.gz", pd.spec.id))
            .exists()
    );
    save(&results, &dir).unwrap();
    let again = load(&dir).unwrap();
    assert_eq!(again, results);
    std::fs::write(dir.join("discussion.md"), "Written by hand.\n").unwrap();
    let path = report::write_report(&again, &dir).unwrap();
    let text = std::fs::read_to_string(path).unwrap();
    for want in [
        "pipe test",
        "## Policies against stage count",
        "## Remedies at 2 stages",
        "## Delayed data-parallel SGD",
        "## Measured delay per stage at 2 stages",
        "weight stashing tracks synchronous training",
        "## Optimizers under delay",
        "Written by hand.",
    ] {
        assert!(text.contains(want), "{want}");
    }
    let plots = dir.join("plots");
    for name in [
        "loss-2-stages-adamw",
        "quality-vs-stages-sgd-momentum",
        "staleness-per-stage-2",
    ] {
        assert!(plots.join(format!("{name}.svg")).exists(), "{name}.svg");
        let csv = std::fs::read_to_string(plots.join(format!("{name}.csv"))).unwrap();
        assert!(csv.lines().count() > 1, "{name}.csv has rows");
    }
    // A second sitting reruns only what it has no record of: one record removed, one run.
    let kept = dir.join("runs");
    let mtime = |id: &str| {
        std::fs::metadata(kept.join(format!("{id}.json")))
            .and_then(|m| m.modified())
            .unwrap()
    };
    let before: Vec<_> = results.runs.iter().map(|r| mtime(&r.spec.id)).collect();
    let gone = &results.runs[1].spec.id;
    std::fs::remove_file(kept.join(format!("{gone}.json"))).unwrap();
    // One record says it ran on another machine: it is kept, and the report says so.
    let moved = &results.runs[0].spec.id;
    let path = kept.join(format!("{moved}.json"));
    let mut record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    record["machine"]["cpu"] = "Another CPU".into();
    std::fs::write(&path, record.to_string()).unwrap();
    let before = {
        let mut b = before;
        b[0] = mtime(moved);
        b
    };
    let resumed = run_experiment(&cfg, true, &dir, "pipe test", &mut |_, _, _| {}).unwrap();
    assert_eq!(resumed.kept_elsewhere.len(), 1);
    assert_eq!(&resumed.kept_elsewhere[0].0, moved);
    let path = report::write_report(&resumed, &dir).unwrap();
    let text = std::fs::read_to_string(path).unwrap();
    assert!(
        text.contains("kept from earlier sittings on other machines (Another CPU"),
        "{text}"
    );
    for (i, r) in resumed.runs.iter().enumerate() {
        assert_eq!(r.spec, results.runs[i].spec);
        assert_eq!(r.losses, results.runs[i].losses, "{}", r.spec.id);
        if &r.spec.id != gone {
            assert_eq!(mtime(&r.spec.id), before[i], "{} was run again", r.spec.id);
        }
    }
    assert!(kept.join(format!("{gone}.json")).exists());
    // Another optimizer's rate leaves a run's record good; its own reruns it.
    let mut retuned = cfg.clone();
    retuned.optimizers[1].lr *= 2.0;
    let mut ran = Vec::new();
    let again = run_experiment(&retuned, true, &dir, "pipe test", &mut |_, _, r| {
        ran.push(r.spec.optimizer.clone())
    })
    .unwrap();
    let second = &cfg.optimizers[1].name;
    for (r, old) in again.runs.iter().zip(&resumed.runs) {
        assert_eq!(
            r.losses == old.losses,
            &r.spec.optimizer != second,
            "{}",
            r.spec.id
        );
    }
    assert_eq!(ran.len(), again.runs.len());
    // A remedy variant added to the matrix (a delay correction) runs its own runs alone.
    let stamps: Vec<_> = again.runs.iter().map(|r| mtime(&r.spec.id)).collect();
    let mut grown = retuned.clone();
    grown
        .remedies
        .variants
        .push(pipe_experiments::staleness::config::RemedyVariant {
            delay_correction: Some(pipe_stages::optim::DelayCorrection::ErrorFeedback),
            ..Default::default()
        });
    let more = run_experiment(&grown, true, &dir, "pipe test", &mut |_, _, _| {}).unwrap();
    let added: Vec<&str> = more
        .runs
        .iter()
        .filter(|r| r.spec.delay_correction.is_some())
        .map(|r| r.spec.id.as_str())
        .collect();
    assert!(!added.is_empty());
    assert_eq!(more.runs.len(), again.runs.len() + added.len());
    for (r, stamp) in again.runs.iter().zip(&stamps) {
        assert_eq!(mtime(&r.spec.id), *stamp, "{} was run again", r.spec.id);
    }
    // Another configuration runs everything again.
    let mut other = cfg.clone();
    other.target_window = 5;
    let mut ran = 0;
    run_experiment(&other, true, &dir, "pipe test", &mut |_, _, _| ran += 1).unwrap();
    assert!(
        results
            .runs
            .iter()
            .all(|r| mtime(&r.spec.id) > before[0] || &r.spec.id == gone),
        "records of another configuration are replaced"
    );
    assert_eq!(ran, results.runs.len());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_experiment_of_too_many_runs_is_refused() {
    let mut cfg = StalenessConfig::parse(COMMITTED, "mnist.toml").unwrap();
    cfg.seeds = (0..5000).collect();
    let err = cfg.matrix().unwrap_err().to_string();
    assert!(err.contains("over the limit of 1000"), "{err}");
}

/// The deep-stages supplement's remedies: every delay correction under pipedream at 8
/// stages; under pipedream-nostash error feedback only, as DC-ASGD needs the stashed weights
/// that policy does not keep (skipped, as `pipe train` would refuse it).
#[test]
fn dc_asgd_variants_skip_the_policy_without_a_stash() {
    let text = include_str!("../staleness/deep-stages.toml");
    let cfg = StalenessConfig::parse(text, "deep-stages.toml").unwrap();
    let runs = cfg.matrix().unwrap();
    let count = |policy: &str, correction: &str| {
        runs.iter()
            .filter(|r| {
                r.policy == policy && r.delay_correction.map(|c| c.name()) == Some(correction)
            })
            .count()
    };
    for correction in ["error-feedback", "dc-asgd", "dc-asgd-adaptive"] {
        assert_eq!(count("pipedream", correction), 2 * 3, "{correction}");
    }
    assert_eq!(count("pipedream-nostash", "error-feedback"), 2 * 3);
    assert_eq!(count("pipedream-nostash", "dc-asgd"), 0);
    assert_eq!(count("pipedream-nostash", "dc-asgd-adaptive"), 0);
}

#[test]
fn empty_policies_are_refused_before_any_run() {
    let mut cfg = StalenessConfig::parse(COMMITTED, "mnist.toml").unwrap();
    cfg.policies.clear();
    let err = cfg.matrix().unwrap_err().to_string();
    assert!(err.contains("policies is empty"), "{err}");
}

/// A matrix whose every run diverged is a result: its report is written, each chart with no
/// finite point named in place of its figure.
#[test]
fn a_report_of_runs_that_all_diverged_is_written() {
    let text = include_str!("../staleness/optimizers-lm-rates/results.json");
    let mut results: pipe_experiments::staleness::StalenessResults =
        serde_json::from_str(text).unwrap();
    for r in &mut results.runs {
        r.losses.clear();
        r.epochs.clear();
        r.stage_delays.clear();
        r.diverged_at = Some(0);
        r.updates_to_target = None;
        r.seconds_to_target = None;
    }
    let dir = scratch::fresh_path("diverged");
    save(&results, &dir).unwrap();
    let back = load(&dir).unwrap();
    let path = report::write_report(&back, &dir).unwrap();
    let md = std::fs::read_to_string(path).unwrap();
    assert!(
        md.contains("not drawn: no run behind it left a finite point"),
        "{md}"
    );
    assert!(md.contains("diverged"), "{md}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A saved run whose id is a path is refused on reading, before the report writes anything
/// by that name.
#[test]
fn a_saved_run_whose_id_is_a_path_is_refused() {
    let text = include_str!("../staleness/optimizers-lm-rates/results.json");
    let mut results: pipe_experiments::staleness::StalenessResults =
        serde_json::from_str(text).unwrap();
    results.runs[0].spec.id = "../../escaped".into();
    let dir = scratch::fresh_path("id-path");
    save(&results, &dir).unwrap();
    let err = load(&dir).unwrap_err().to_string();
    assert!(
        err.contains("run id \"../../escaped\" is no file name"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
