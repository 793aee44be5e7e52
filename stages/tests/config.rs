//! The resolved run as it travels to worker processes: every kind of run survives the trip
//! to JSON and back unchanged, what is read back is checked as resolving would have checked
//! it, and a run whose numerics differ names the first field that does.

#![allow(clippy::unwrap_used)]

use pipe_stages::StageError;
use pipe_stages::config::{PartitionChoice, PlannedLayout, RunConfig, TrainSettings};
use pipe_stages::partition::Partition;

fn resolve(toml: &str) -> RunConfig {
    TrainSettings::from_toml(toml, "test")
        .and_then(TrainSettings::resolve)
        .unwrap()
}

/// Runs that use every typed choice: one worker, a replicated pipeline with remedies and a
/// given partition, a language model on text, a layer list on the synthetic set, and the
/// CUDA backend in bf16 with compressed wires (which resolves without a GPU).
fn runs() -> Vec<RunConfig> {
    [
        "",
        "stages = 4\nreplicas = [2]\nschedule = \"pipedream-nostash\"\npartition = \"0-2,3-4,5-6,7-9\"\n\
         lr_scaling = \"staleness\"\nweight_prediction = \"discrepancy:0.9\"\nsync_warmup = 3",
        "model = \"gpt-mini\"\nstages = 2\nsteps = 7",
        "dataset = \"synthetic\"\nstages = 2\npartition = \"flops\"\n[synthetic]\ntrain = 64\n\
         test = 16\n[model]\ninput = [784]\nlayers = [{ type = \"flatten\" },\
         { type = \"linear\", inputs = 784, outputs = 16 }, { type = \"relu\" },\
         { type = \"residual\", layers = [{ type = \"linear\", inputs = 16, outputs = 16 }] },\
         { type = \"linear\", inputs = 16, outputs = 10 }]",
        "backend = \"cuda\"\nprecision = \"bf16\"\nstages = 2\nwire_dtype = \"bf16\"\n\
         allreduce_dtype = \"bf16\"\nreplicas = [1, 2]\nstall_timeout = 12.5\ntransport = \"quic\"",
    ]
    .iter()
    .map(|t| resolve(t))
    .collect()
}

#[test]
fn every_kind_of_run_survives_json_unchanged() {
    for cfg in runs() {
        let json = cfg.to_json().unwrap();
        let back = RunConfig::from_json(&json, "run.json").unwrap();
        assert_eq!(back, cfg, "{json}");
        assert_eq!(back.numerics_difference(&cfg), None);
    }
}

/// `json` with the value at `key` replaced by `value` (JSON text).
fn edited(cfg: &RunConfig, key: &str, value: &str) -> String {
    let mut v: serde_json::Value = serde_json::from_str(&cfg.to_json().unwrap()).unwrap();
    v[key] = serde_json::from_str(value).unwrap();
    v.to_string()
}

#[test]
fn a_run_read_back_is_checked_as_resolving_checks_it() {
    let cfg = resolve("stages = 4\npartition = \"0-2,3-4,5-6,7-9\"");
    let refused = [
        (
            "partition",
            r#"{"given":[{"start":0,"end":3},{"start":3,"end":5}]}"#,
            "covers layers 0-4",
        ),
        (
            "partition",
            r#"{"given":[{"start":0,"end":3},{"start":4,"end":10}]}"#,
            "starts at layer 4",
        ),
        ("replicas", "[1, 1]", "2 replica counts for 4 stages"),
        ("microbatch_size", "0", "at least 1"),
        ("lr", "-1.0", "learning rate"),
        ("schedule", r#""fifo""#, "unknown schedule"),
        ("backend", r#"["cpu", "bf16"]"#, "computes in f32 only"),
        ("transport", r#""carrier-pigeon""#, "unknown transport"),
        ("stall_timeout", r#"{"secs":0,"nanos":0}"#, "stall timeout"),
        ("extra", "1", "unknown field"),
    ];
    for (key, value, why) in refused {
        let text = edited(&cfg, key, value);
        match RunConfig::from_json(&text, "run.json") {
            Err(e @ StageError::Config(_)) => {
                let m = e.to_string();
                assert!(
                    m.contains(why) && m.contains("run.json"),
                    "{key}={value}: {m}"
                );
            }
            Err(e) => panic!("{key}={value}: not a config error: {e}"),
            Ok(_) => panic!("{key}={value} was taken"),
        }
    }
    for text in ["", "{", "[]", "{\"model_name\": 3}"] {
        let err = RunConfig::from_json(text, "run.json").unwrap_err();
        assert!(matches!(err, StageError::Config(_)), "{err}");
        assert!(err.to_string().contains("run.json"), "{err}");
    }
}

#[test]
fn numerics_leave_host_fields_out_and_name_the_first_difference() {
    let cfg = resolve("stages = 2");
    let mut here = cfg.clone();
    here.threads = 7;
    here.data_dir = Some("/elsewhere".into());
    here.log_jsonl = Some("log.jsonl".into());
    here.partition = PartitionChoice::Flops;
    assert_eq!(cfg.numerics_difference(&here), None);
    here.lr = 0.07;
    let diff = cfg.numerics_difference(&here).unwrap();
    assert!(
        diff.starts_with("lr: 0.05") && diff.contains("0.07"),
        "{diff}"
    );
}

#[test]
fn a_planned_layout_resolves_as_the_same_layout_given_in_settings() {
    let settings = TrainSettings::from_toml("epochs = 1", "test").unwrap();
    let model = pipe_stages::model::Model::new(
        &pipe_stages::model::ModelSpec::preset("mlp-784-512-512-10").unwrap(),
    )
    .unwrap();
    let planned = PlannedLayout {
        policy: pipe_scheduler::Policy::PipeDream,
        replicas: vec![2, 1],
        partition: Partition::parse("0-2,3-5", model.len()).unwrap(),
    };
    let by_plan = settings.clone().resolve_planned(Some(planned)).unwrap();
    let mut written = settings;
    written.model = Some(pipe_stages::config::ModelChoice::Preset(
        "mlp-784-512-512-10".into(),
    ));
    written.stages = Some(2);
    written.replicas = Some(vec![2, 1]);
    written.partition = Some("0-2,3-5".into());
    written.schedule = Some("pipedream".into());
    assert_eq!(by_plan, written.resolve().unwrap());
    // The asynchronous layout's default momentum, not the one-worker run's.
    assert!(by_plan.optimizer.momentum < 0.9);
}
