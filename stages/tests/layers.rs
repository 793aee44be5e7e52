//! Imports inside `stages/src` run one way: each module uses only modules of the layers below
//! it (the order of `lib.rs`'s `mod` lines, argued in `docs/architecture.md`). The test reads
//! the source and fails naming every reference that runs back up.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

/// The layers, lowest first. Modules of one layer may use each other.
const LAYERS: &[&[&str]] = &[
    &["error", "limits"],
    &["model"],
    &["partition"],
    &["remedy"],
    &["config"],
    &["checkpoint"],
    &["train"],
    &["pipeline"],
    &["planning"],
    &["log"],
];

/// `lib.rs`'s short paths: the module each names.
const ALIASES: &[(&str, &str)] = &[
    ("data", "model"),
    ("hf", "model"),
    ("layer", "model"),
    ("layers", "model"),
    ("loss", "model"),
    ("optim", "model"),
    ("rng", "model"),
    ("sample", "model"),
    ("shards", "model"),
    ("tokenize", "model"),
    ("tokenizer", "model"),
    ("transformer", "model"),
    ("delayed", "pipeline"),
    ("profile", "planning"),
    ("Result", "error"),
    ("StageError", "error"),
];

fn layer_of(module: &str) -> Option<usize> {
    let module = ALIASES
        .iter()
        .find(|(alias, _)| *alias == module)
        .map_or(module, |(_, m)| m);
    LAYERS.iter().position(|l| l.contains(&module))
}

/// The code of a source file: comments and the unit tests left out.
fn code_of(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules a piece of code names after `crate::`, including inside `use crate::{..}`.
fn referenced(code: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find("};").unwrap_or(group.len())];
            // The first word of each top-level item of the group.
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars().chain(std::iter::once(',')) {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        let head: String = item
                            .trim()
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        if !head.is_empty() {
                            names.push(head);
                        }
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
        } else {
            names.push(
                rest.chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect(),
            );
        }
    }
    names
}

fn visit(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            visit(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

#[test]
fn no_import_inside_stages_runs_back_up() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    visit(&src, &mut files);
    let mut upward = Vec::new();
    let mut checked = 0;
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let first = rel.iter().next().unwrap().to_string_lossy();
        let module = first.trim_end_matches(".rs");
        if module == "lib" {
            continue;
        }
        let own = layer_of(module)
            .unwrap_or_else(|| panic!("{} is in no layer of this test", rel.display()));
        for name in referenced(&code_of(&std::fs::read_to_string(file).unwrap())) {
            let Some(theirs) = layer_of(&name) else {
                continue;
            };
            checked += 1;
            if theirs > own {
                upward.push(format!("{} uses crate::{name}", rel.display()));
            }
        }
    }
    assert!(checked > 100, "the scan found only {checked} references");
    assert!(
        upward.is_empty(),
        "imports running back up:\n{}",
        upward.join("\n")
    );
}

#[test]
fn the_scan_sees_a_grouped_import() {
    let code = code_of(
        "use crate::{config::RunConfig, pipeline::{Setup, Observer}};\n// crate::planning\n",
    );
    assert_eq!(referenced(&code), ["config", "pipeline"]);
}
