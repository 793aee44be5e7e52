//! The resolved run as it travels to worker processes: every kind of run survives the trip
//! to JSON and back unchanged, what is read back is checked as resolving would have checked
//! it, and a run whose numerics differ names the first field that does.

#![allow(clippy::unwrap_used)]

mod common;

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
        // A run's length is bounded as the command line bounds it: past it, a counter's
        // arithmetic could wrap in a release build.
        ("epochs", "18446744073709551615", "--epochs"),
        ("epochs", "0", "--epochs must be at least 1"),
        ("steps", "0", "--steps must be at least 1"),
        ("eval_every", "4294967296", "--eval-every"),
        ("lr", "-1.0", "learning rate"),
        ("schedule", r#""fifo""#, "unknown schedule"),
        (
            "backend",
            r#"["cpu", "bf16"]"#,
            "computes in f32, bf16x6 or bf16x3",
        ),
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

#[test]
fn gpt2_models_take_their_shape_from_presets_tables_and_hugging_face_configs() {
    use pipe_stages::layers::LayerSpec;
    // The preset: two blocks of 64, tied, 64 positions, the embedded corpus's vocabulary.
    let tiny = resolve("model = \"gpt2-tiny\"");
    assert_eq!(tiny.model.input, vec![64]);
    assert_eq!(tiny.model.layers.len(), 5);
    assert_eq!(tiny.model.tied.len(), 1);
    // A table overrides a preset field by field.
    let wider = resolve("model = \"gpt2-tiny\"\n[gpt2]\nn_embd = 32\nn_layer = 3");
    assert_eq!(wider.model.layers.len(), 6);
    assert!(matches!(
        wider.model.layers[0],
        LayerSpec::Embedding {
            width: 32,
            context: 64,
            ..
        }
    ));

    // A Hugging Face config.json, with the table over it.
    let dir = common::fresh_dir("gpt2");
    let json = dir.join("config.json");
    std::fs::write(
        &json,
        r#"{"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 16,
            "vocab_size": 65, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05,
            "n_inner": null, "architectures": ["GPT2LMHeadModel"]}"#,
    )
    .unwrap();
    let path = json.display();
    let from_json = resolve(&format!("model = \"gpt2\"\nmodel_config = \"{path}\""));
    assert_eq!(from_json.model.input, vec![16]);
    assert!(matches!(
        from_json.model.layers[1],
        LayerSpec::TransformerBlock {
            width: 32,
            heads: 4,
            ..
        }
    ));
    let over = resolve(&format!(
        "model = \"gpt2\"\nmodel_config = \"{path}\"\n[gpt2]\nn_positions = 8"
    ));
    assert_eq!(over.model.input, vec![8]);

    // What pipe's block is not, and shapes that are not whole, are refused by name.
    let refused = |toml: &str, needle: &str| {
        let err = TrainSettings::from_toml(toml, "test")
            .and_then(TrainSettings::resolve)
            .unwrap_err();
        assert!(matches!(err, StageError::Config(_)), "{err}");
        assert!(err.to_string().contains(needle), "{err}");
    };
    for (field, value, needle) in [
        ("activation_function", "\"relu\"", "activation_function"),
        ("n_inner", "100", "n_inner 100"),
        ("layer_norm_epsilon", "1e-6", "layer_norm_epsilon"),
        ("tie_word_embeddings", "false", "untied"),
        ("model_type", "\"llama\"", "model_type"),
    ] {
        let bad = dir.join(format!("{field}.json"));
        std::fs::write(
            &bad,
            format!(
                r#"{{"n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 16,
                    "vocab_size": 65, "{field}": {value}}}"#
            ),
        )
        .unwrap();
        refused(
            &format!("model = \"gpt2\"\nmodel_config = \"{}\"", bad.display()),
            needle,
        );
    }
    refused("model = \"gpt2\"", "n_layer");
    refused(
        "model = \"gpt2-tiny\"\n[gpt2]\nn_head = 3",
        "not a multiple of n_head",
    );
    refused(
        "model = \"gpt-mini\"\n[gpt2]\nn_layer = 3",
        "apply to gpt2 models",
    );
}

/// `padded_vocab_size` pads a gpt2 model's token table and head, which stay tied; a size
/// under the vocabulary, or far past it, is refused naming it, in a `[gpt2]` table as in a
/// layer list.
#[test]
fn a_gpt2_vocabulary_pads_to_the_size_given_and_no_smaller() {
    use pipe_stages::layers::LayerSpec;
    use pipe_stages::model::Model;
    let padded = resolve("model = \"gpt2-tiny\"\n[gpt2]\npadded_vocab_size = 128");
    assert!(matches!(
        padded.model.layers[0],
        LayerSpec::Embedding {
            vocab: 65,
            padded_vocab: Some(128),
            ..
        }
    ));
    assert!(matches!(
        padded.model.layers.last(),
        Some(LayerSpec::LmHead {
            vocab: 65,
            padded_vocab: Some(128),
            ..
        })
    ));
    let model = Model::new(&padded.model).unwrap();
    assert_eq!(
        (model.output_shape(), model.output_classes()),
        (&[64, 128][..], 65)
    );
    assert_eq!(model.param_table()[0].shape, vec![128, 64]);
    // The vocabulary itself pads nothing: the spec is the unpadded one.
    let same = resolve("model = \"gpt2-tiny\"\n[gpt2]\npadded_vocab_size = 65");
    assert_eq!(same.model, resolve("model = \"gpt2-tiny\"").model);

    let err = |toml: &str| {
        TrainSettings::from_toml(toml, "test")
            .and_then(TrainSettings::resolve)
            .and_then(|c| Model::new(&c.model).map(|_| c))
            .unwrap_err()
            .to_string()
    };
    let small = err("model = \"gpt2-tiny\"\n[gpt2]\npadded_vocab_size = 64");
    assert!(
        small.contains("padded_vocab_size 64 is smaller than the vocabulary of 65"),
        "{small}"
    );
    let large = err("model = \"gpt2-tiny\"\n[gpt2]\npadded_vocab_size = 100000");
    assert!(
        large.contains("padded_vocab 100000 must be between its vocab 65 and 4226"),
        "{large}"
    );
    let untied = err(
        "dataset = \"tinyshakespeare\"\n[model]\ninput = [8]\nlayers = [\
         {type = \"embedding\", vocab = 65, width = 8, context = 8, padded_vocab = 64}, \
         {type = \"lm_head\", width = 8, vocab = 65}]",
    );
    assert!(
        untied.contains("padded_vocab 64 must be between"),
        "{untied}"
    );
}

/// AdamW on a language model decays only the linear maps' matrices unless told otherwise;
/// an MLP, or a language model under another optimizer, decays every parameter.
#[test]
fn weight_decay_groups_default_to_matrices_for_adamw_language_models() {
    use pipe_stages::optim::DecayGroups;
    let groups = |toml: &str| resolve(toml).optimizer.decay_groups;
    assert_eq!(groups("model = \"gpt-mini\""), DecayGroups::Matrices);
    assert_eq!(
        groups("model = \"gpt-mini\"\nweight_decay_groups = \"all\""),
        DecayGroups::All
    );
    assert_eq!(
        groups("model = \"gpt-mini\"\noptimizer = \"lion\""),
        DecayGroups::All
    );
    assert_eq!(groups(""), DecayGroups::All);
    assert_eq!(groups("optimizer = \"adamw\""), DecayGroups::All);
    assert_eq!(
        groups("optimizer = \"adamw\"\nweight_decay_groups = \"matrices\""),
        DecayGroups::Matrices
    );
}

/// A run carries the layout it resolved to: the same whether it was resolved from settings or
/// read back and checked; a peer's run read only to compare with compares by its settings.
#[test]
fn the_resolved_layout_travels_with_the_run_and_is_derived_again_when_read() {
    for run in runs() {
        let json = run.to_json().unwrap();
        let read = RunConfig::from_json(&json, "test").unwrap();
        assert_eq!(read.resolved().unwrap(), run.resolved().unwrap());
        let unchecked: RunConfig = serde_json::from_str(&json).unwrap();
        assert!(
            unchecked.resolved().is_err(),
            "an unchecked run has no layout"
        );
        assert_eq!(run.numerics_difference(&unchecked), None);
        assert_eq!(unchecked, run);
    }
}
