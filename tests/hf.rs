//! Weights in Hugging Face's GPT-2 layout from the command line: `pipe export --format hf`
//! writes `transformers`' names and a `config.json`, the exported directory gives the
//! checkpoint's logits bit for bit (`pipe logits --hf`), `--init-from` starts a run from it,
//! and a model that is not GPT-2-shaped is refused. The comparison with `transformers` itself
//! is `experiments/hf/interop.py` (it needs torch).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Output;

mod common;
use common::{fresh_path, ok, pipe, s};

/// `pipe export --format hf` of checkpoint `ckpt` into `out`.
fn export_hf(ckpt: &Path, out: &Path) -> Output {
    export_hf_with(ckpt, out, &[])
}

/// `pipe export --format hf` of checkpoint `ckpt` into `out`, with `more` arguments.
fn export_hf_with(ckpt: &Path, out: &Path, more: &[&str]) -> Output {
    let args = [
        "export",
        "--checkpoint",
        s(ckpt),
        "--format",
        "hf",
        "--out",
        s(out),
    ];
    pipe(&[&args[..], more].concat())
}

/// The tensor names in a safetensors file's header.
fn tensor_names(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    let mut names: Vec<String> = header
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    names.sort();
    names
}

#[test]
fn an_exported_gpt2_keeps_its_logits_names_its_tensors_as_transformers_does_and_trains_on() {
    let ckpt = fresh_path("ckpt");
    ok(&pipe(&[
        "train",
        "--model",
        "gpt2-tiny",
        "--steps",
        "3",
        "--threads",
        "1",
        "--checkpoint-dir",
        s(&ckpt),
    ]));
    let out = fresh_path("exported");
    let text = ok(&export_hf(&ckpt, &out));
    assert!(
        text.contains("2 blocks, width 64, 2 heads, 64 positions"),
        "{text}"
    );

    let names = tensor_names(&out.join("model.safetensors"));
    // Embeddings, 12 tensors per block, the final norm; the tied head is the embedding.
    assert_eq!(names.len(), 2 + 2 * 12 + 2, "{names:?}");
    for want in [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.h.0.ln_1.weight",
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.1.attn.c_proj.bias",
        "transformer.h.1.mlp.c_fc.weight",
        "transformer.h.1.mlp.c_proj.weight",
        "transformer.ln_f.bias",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "{want} missing from {names:?}"
        );
    }
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["n_layer"], 2);
    assert_eq!(config["activation_function"], "gelu_new");
    assert_eq!(config["tie_word_embeddings"], true);

    let ids = "3,14,15,9,26,5,35";
    let from_ckpt = ok(&pipe(&["logits", "--checkpoint", s(&ckpt), "--ids", ids]));
    let from_hf = ok(&pipe(&["logits", "--hf", s(&out), "--ids", ids]));
    assert_eq!(from_ckpt, from_hf);
    let rows: Vec<Vec<f32>> = serde_json::from_str(&from_hf).unwrap();
    assert_eq!((rows.len(), rows[0].len()), (7, 65));

    // A run starts from the exported weights: its first evaluation is of those weights.
    let one_update = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--model",
            "gpt2-tiny",
            "--steps",
            "1",
            "--threads",
            "1",
        ];
        args.extend_from_slice(extra);
        common::weights(&ok(&pipe(&args)))
    };
    assert_ne!(one_update(&["--init-from", s(&out)]), one_update(&[]));
}

#[test]
fn models_outside_gpt2s_layout_and_bad_directories_are_refused() {
    let ckpt = fresh_path("mlp");
    ok(&pipe(&[
        "train",
        "--steps",
        "1",
        "--checkpoint-dir",
        s(&ckpt),
    ]));
    let out = export_hf(&ckpt, &fresh_path("x"));
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("GPT-2-shaped"),
        "{out:?}"
    );

    let empty = fresh_path("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = pipe(&[
        "train",
        "--model",
        "gpt2-tiny",
        "--steps",
        "1",
        "--init-from",
        s(&empty),
    ]);
    // A directory is read from its config.json, which says what model it holds.
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("config.json"),
        "{out:?}"
    );
    let out = pipe(&["logits", "--hf", s(&empty), "--ids", "1"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("config.json"),
        "{out:?}"
    );
}

/// A `config.json` edited to 3,000 blocks beside the weights of 2: refused by the first block
/// the weights lack before the model is allocated, within 2 GB of address space (it used to
/// fill 5.8 GB of weights first).
#[test]
fn a_config_deeper_than_its_weights_is_refused_before_the_model_is_built() {
    let ckpt = fresh_path("deep");
    ok(&pipe(&[
        "train",
        "--model",
        "gpt2-tiny",
        "--n-embd",
        "256",
        "--n-head",
        "2",
        "--seed-checkpoint",
        "--checkpoint-dir",
        s(&ckpt),
    ]));
    let hf = fresh_path("deep-hf");
    ok(&export_hf(&ckpt, &hf));
    let config = hf.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    c["n_layer"] = 3000.into();
    std::fs::write(&config, c.to_string()).unwrap();
    let out = std::process::Command::new("prlimit")
        .arg("--as=2000000000")
        .arg(env!("CARGO_BIN_EXE_pipe"))
        .args(["logits", "--hf", s(&hf), "--ids", "1,2"])
        .output()
        .unwrap();
    common::refused(&out, &["has no transformer.h.2."]);
}

#[test]
fn sharded_and_untied_exports_read_back_and_gpt2_buffers_are_skipped() {
    // A gpt2-tiny exported in shards of at most 100 kB.
    let ckpt = fresh_path("tied");
    ok(&pipe(&[
        "train",
        "--model",
        "gpt2-tiny",
        "--steps",
        "2",
        "--threads",
        "1",
        "--checkpoint-dir",
        s(&ckpt),
    ]));
    let sharded = fresh_path("sharded");
    let text = ok(&pipe(&[
        "export",
        "--checkpoint",
        s(&ckpt),
        "--format",
        "hf",
        "--out",
        s(&sharded),
        "--max-shard-size",
        "100KB",
    ]));
    assert!(text.contains("in 6 shards"), "{text}");
    assert!(!sharded.join("model.safetensors").exists());
    let index: serde_json::Value = serde_json::from_slice(
        &std::fs::read(sharded.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), 2 + 2 * 12 + 2);
    for file in map.values() {
        let bytes = std::fs::metadata(sharded.join(file.as_str().unwrap()))
            .unwrap()
            .len();
        // 100 kB of tensors and the shard's header.
        assert!(bytes < 100_000 + 4096, "{file}: {bytes} bytes");
    }
    let ids = "1,4,9,16,25";
    let from_ckpt = ok(&pipe(&["logits", "--checkpoint", s(&ckpt), "--ids", ids]));
    assert_eq!(
        ok(&pipe(&["logits", "--hf", s(&sharded), "--ids", ids])),
        from_ckpt
    );
    // An index that places a tensor in a shard that does not hold it describes other files.
    let mut lying = index.clone();
    let first = map.values().next().unwrap().clone();
    lying["weight_map"]["transformer.h.0.mlp.c_extra.weight"] = first.clone();
    let index_path = sharded.join("model.safetensors.index.json");
    std::fs::write(&index_path, serde_json::to_vec(&lying).unwrap()).unwrap();
    common::refused(
        &pipe(&["logits", "--hf", s(&sharded), "--ids", ids]),
        &[&format!(
            "places transformer.h.0.mlp.c_extra.weight in {}, which does not hold it",
            first.as_str().unwrap()
        )],
    );
    std::fs::write(&index_path, serde_json::to_vec(&index).unwrap()).unwrap();

    // GPT-2's attention buffers, as older saves hold them, are not weights: skipped.
    let whole = fresh_path("whole");
    ok(&export_hf(&ckpt, &whole));
    let path = whole.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mask = vec![0u8; 4 * 64 * 64];
    let mut views: Vec<(String, safetensors::tensor::TensorView<'_>)> =
        file.tensors().into_iter().collect();
    for b in 0..2 {
        views.push((
            format!("transformer.h.{b}.attn.bias"),
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                vec![1, 1, 64, 64],
                &mask,
            )
            .unwrap(),
        ));
    }
    let with_buffers = safetensors::tensor::serialize(views, None).unwrap();
    std::fs::write(&path, with_buffers).unwrap();
    assert_eq!(
        ok(&pipe(&["logits", "--hf", s(&whole), "--ids", ids])),
        from_ckpt
    );

    // An untied model's export names its head lm_head.weight and reads back untied.
    let untied = fresh_path("untied-ckpt");
    ok(&pipe(&[
        "train",
        "--model",
        "gpt-mini",
        "--steps",
        "1",
        "--checkpoint-dir",
        s(&untied),
    ]));
    let out = fresh_path("untied-out");
    assert!(ok(&export_hf(&untied, &out)).contains("untied head"));
    assert!(tensor_names(&out.join("model.safetensors")).contains(&"lm_head.weight".to_string()));
    let ids = "3,1,4,1,5";
    assert_eq!(
        ok(&pipe(&["logits", "--hf", s(&out), "--ids", ids])),
        ok(&pipe(&["logits", "--checkpoint", s(&untied), "--ids", ids]))
    );
}

/// A model with a padded vocabulary (`--padded-vocab-size`) exports without its padding (a
/// directory holds the vocabulary's rows, as `transformers` expects), its logits have the
/// vocabulary's columns and agree with the export's, and a padded run starts from the export.
#[test]
fn a_padded_vocabulary_exports_without_its_padding_and_reads_back_into_it() {
    let ckpt = fresh_path("padded-ckpt");
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--model",
            "gpt2-tiny",
            "--padded-vocab-size",
            "80",
            "--tie-embeddings=false",
            "--steps",
            "2",
            "--threads",
            "1",
        ];
        args.extend_from_slice(extra);
        ok(&pipe(&args))
    };
    train(&["--checkpoint-dir", s(&ckpt)]);
    let out = fresh_path("padded-exported");
    let text = ok(&export_hf(&ckpt, &out));
    assert!(text.contains("vocabulary 65 (untied head)"), "{text}");
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    for table in ["transformer.wte.weight", "lm_head.weight"] {
        assert_eq!(
            header[table]["shape"],
            serde_json::json!([65, 64]),
            "{table}"
        );
    }
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["vocab_size"], 65);

    let ids = "3,14,15,9,26,5,35";
    let logits = |source: &[&str]| -> Vec<Vec<f32>> {
        let mut args = vec!["logits", "--ids", ids];
        args.extend_from_slice(source);
        serde_json::from_str(&ok(&pipe(&args))).unwrap()
    };
    let (padded, exported) = (
        logits(&["--checkpoint", s(&ckpt)]),
        logits(&["--hf", s(&out)]),
    );
    assert_eq!((padded.len(), padded[0].len()), (7, 65));
    for (p, e) in padded.iter().flatten().zip(exported.iter().flatten()) {
        assert!((p - e).abs() <= 1e-5 * e.abs().max(1.0), "{p} against {e}");
    }
    train(&["--init-from", s(&out)]);
}

/// `--tokenizer` names a corpus, a folder holding a `tokenizer.json` or the file itself, and
/// the export carries the `tokenizer.json` that was read and checked (a corpus or a folder
/// was accepted, then copied as a path, which failed after the weights were written); a corpus
/// of pipe's byte tokenizer, which has no `tokenizer.json`, is refused before anything is
/// written.
#[test]
fn an_export_carries_the_tokenizer_json_it_read_from_a_corpus_a_folder_or_a_file() {
    const BPE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/data/tokenizers/shakespeare-bpe-1024.json"
    );
    let shakespeare = include_str!("../data/tinyshakespeare.txt");
    let text = common::fresh_file("hf-tokenizer-text.txt", &shakespeare[..40_000]);
    let train_on = |tokenizer: &str, name: &str| {
        let corpus = fresh_path(&format!("{name}-corpus"));
        let ckpt = fresh_path(&format!("{name}-ckpt"));
        ok(&pipe(&[
            "tokenize",
            "--tokenizer",
            tokenizer,
            "--input",
            s(&text),
            "--out",
            s(&corpus),
        ]));
        let dataset = format!("tokens:{}", s(&corpus));
        ok(&pipe(&[
            "train",
            "--model",
            "gpt2-tiny",
            "--dataset",
            &dataset,
            "--steps",
            "1",
            "--threads",
            "1",
            "--checkpoint-dir",
            s(&ckpt),
        ]));
        (corpus, ckpt)
    };
    let export = |ckpt: &Path, tokenizer: &Path, out: &Path| {
        export_hf_with(ckpt, out, &["--tokenizer", s(tokenizer)])
    };
    let (corpus, ckpt) = train_on(BPE, "hf-bpe");
    let folder = fresh_path("hf-tokenizer-folder");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(BPE, folder.join("tokenizer.json")).unwrap();
    let want = std::fs::read(BPE).unwrap();
    for (i, tokenizer) in [corpus.as_path(), folder.as_path(), Path::new(BPE)]
        .into_iter()
        .enumerate()
    {
        let out = fresh_path(&format!("hf-tokenizer-out-{i}"));
        ok(&export(&ckpt, tokenizer, &out));
        assert_eq!(std::fs::read(out.join("tokenizer.json")).unwrap(), want);
        assert!(out.join("model.safetensors").is_file());
    }
    let (bytes_corpus, bytes_ckpt) = train_on("bytes", "hf-bytes");
    let out = fresh_path("hf-tokenizer-bytes-out");
    common::refused(
        &export(&bytes_ckpt, &bytes_corpus, &out),
        &["byte or character tokenizer", "no tokenizer.json"],
    );
    assert!(!out.exists(), "nothing is written");
}
