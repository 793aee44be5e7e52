//! The source layout: no file-level import circles in any crate of the workspace, and inside
//! `pipe-stages` no import that runs back up its layers.
//!
//! Each source file is a module; an edge `a -> b` means file `a` refers to an item of file `b`
//! (`crate::...` or `super::...` paths, or a child module's items used in the parent's own
//! code). A parent's `pub use child::...` re-exports declare the module's surface and are not
//! counted, and a file's `#[cfg(test)]` tail is skipped (its `super::` is the file itself).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module path of a source file relative to its crate's `src`.
fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Identifier paths following `prefix` in `text` (`prefix a::b`, or each head of
/// `prefix{a, b::c}`).
fn paths_after(text: &str, prefix: &str) -> Vec<Vec<String>> {
    let ident = |s: &str| -> Vec<String> {
        s.split("::")
            .map(|p| {
                p.chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect::<String>()
            })
            .take_while(|p| !p.is_empty())
            .collect()
    };
    let mut out = Vec::new();
    for (at, _) in text.match_indices(prefix) {
        let before = text[..at].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &text[at + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let inner = &group[..group.find('}').unwrap_or(group.len())];
            out.extend(inner.split(',').map(|p| ident(p.trim())));
        } else {
            out.push(ident(rest));
        }
    }
    out
}

/// The import graph of one crate: module path -> modules it refers to.
fn graph(src: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeSet<Vec<String>> = files
        .iter()
        .map(|f| module_of(f.strip_prefix(src).unwrap()))
        .collect();
    let resolve = |path: &[String]| -> Option<Vec<String>> {
        (1..=path.len())
            .rev()
            .map(|k| path[..k].to_vec())
            .find(|p| modules.contains(p))
            .or_else(|| Some(Vec::new()))
    };
    let mut edges = BTreeMap::new();
    for file in &files {
        let me = module_of(file.strip_prefix(src).unwrap());
        let text = std::fs::read_to_string(file).unwrap();
        let text = &text[..text.find("#[cfg(test)]").unwrap_or(text.len())];
        let code: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("pub use") && !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let mut targets = BTreeSet::new();
        for p in paths_after(&code, "crate::") {
            targets.extend(resolve(&p));
        }
        let parent: Vec<String> = me[..me.len().saturating_sub(1)].to_vec();
        for p in paths_after(&code, "super::") {
            let full: Vec<String> = parent.iter().cloned().chain(p).collect();
            targets.extend(resolve(&full));
        }
        for child in modules
            .iter()
            .filter(|m| m.len() == me.len() + 1 && m.starts_with(&me))
        {
            let name = child.last().unwrap();
            if !paths_after(&code, &format!("{name}::")).is_empty() {
                targets.insert(child.clone());
            }
        }
        targets.remove(&me);
        edges.insert(me, targets);
    }
    edges
}

/// A cycle in `g`, if any, as the modules along it.
fn find_cycle(g: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<Vec<String>>> {
    fn visit(
        g: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        node: &Vec<String>,
        state: &mut BTreeMap<Vec<String>, u8>,
        stack: &mut Vec<Vec<String>>,
    ) -> Option<Vec<Vec<String>>> {
        state.insert(node.clone(), 1);
        stack.push(node.clone());
        for next in g.get(node).into_iter().flatten() {
            match state.get(next) {
                Some(1) => {
                    let at = stack.iter().position(|m| m == next).unwrap_or(0);
                    let mut cycle = stack[at..].to_vec();
                    cycle.push(next.clone());
                    return Some(cycle);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(g, next, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(node.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in g.keys() {
        if !state.contains_key(node) {
            if let Some(c) = visit(g, node, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn no_crate_has_a_file_level_import_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for krate in [
        "src",
        "kernels/src",
        "scheduler/src",
        "transport/src",
        "stages/src",
        "experiments/src",
    ] {
        let g = graph(&root.join(krate));
        if let Some(cycle) = find_cycle(&g) {
            let names: Vec<String> = cycle
                .iter()
                .map(|m| {
                    if m.is_empty() {
                        "(root)".into()
                    } else {
                        m.join("/")
                    }
                })
                .collect();
            panic!("{krate}: import circle {}", names.join(" -> "));
        }
    }
}

#[test]
fn the_checker_finds_a_circle() {
    let g: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = [
        (
            vec!["a".to_string()],
            BTreeSet::from([vec!["b".to_string()]]),
        ),
        (
            vec!["b".to_string()],
            BTreeSet::from([vec!["a".to_string()]]),
        ),
    ]
    .into();
    assert!(find_cycle(&g).is_some());
    assert_eq!(
        paths_after("use crate::{x::Y, z};", "crate::"),
        vec![
            vec!["x".to_string(), "Y".to_string()],
            vec!["z".to_string()]
        ]
    );
}

/// `pipe-stages`'s layers, lowest first (the order of its `lib.rs`'s `mod` lines, argued in
/// `docs/architecture.md`). Modules of one layer may use each other.
const STAGES_LAYERS: &[&[&str]] = &[
    &["error", "limits", "contain", "cache", "outputs", "release"],
    &["model"],
    &["partition"],
    &["remedy"],
    &["config"],
    &["checkpoint"],
    &["train"],
    &["inspect"],
    &["pipeline"],
    &["planning"],
    &["startup"],
    &["log"],
];

/// `pipe-stages`'s short paths (`lib.rs`'s re-exports): the top-level module each names.
const STAGES_SHORT_PATHS: &[(&str, &str)] = &[
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

fn stages_layer(module: &str) -> Option<usize> {
    let module = STAGES_SHORT_PATHS
        .iter()
        .find(|(short, _)| *short == module)
        .map_or(module, |(_, m)| m);
    STAGES_LAYERS.iter().position(|l| l.contains(&module))
}

/// Inside `stages/src`, imports run one way: each top-level module uses only those of the
/// layers below it. Fails naming every reference that runs back up.
#[test]
fn no_import_inside_stages_runs_back_up() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("stages/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut upward = Vec::new();
    let mut checked = 0;
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let module = module_of(rel);
        let Some(top) = module.first() else {
            continue; // lib.rs
        };
        let own = stages_layer(top)
            .unwrap_or_else(|| panic!("{} is in no layer of this test", rel.display()));
        let text = std::fs::read_to_string(file).unwrap();
        let text = &text[..text.find("#[cfg(test)]").unwrap_or(text.len())];
        let code: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        for path in paths_after(&code, "crate::") {
            let Some(theirs) = path.first().and_then(|m| stages_layer(m)) else {
                continue;
            };
            checked += 1;
            if theirs > own {
                upward.push(format!("{} uses crate::{}", rel.display(), path.join("::")));
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
