//! The README's `pipe train` table lists every flag that `pipe train --help` prints.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

/// The long flags `pipe train --help` documents, `--help` itself aside. An option line starts
/// with its flags (`  -h, --help` or `      --lr <LR>`); a description line is indented further.
fn help_flags() -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_pipe"))
        .args(["train", "--help"])
        .output()
        .expect("run pipe train --help");
    assert!(out.status.success(), "pipe train --help failed: {out:?}");
    let text = String::from_utf8(out.stdout).expect("help is UTF-8");
    let mut flags = Vec::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if !trimmed.starts_with('-') || line.len() - trimmed.len() > 6 {
            continue;
        }
        let long = trimmed
            .split([' ', ','])
            .find(|word| word.starts_with("--"))
            .and_then(|word| word.split(['=', '<', '[']).next());
        if let Some(flag) = long.filter(|f| *f != "--help") {
            flags.push(flag.to_string());
        }
    }
    flags
}

/// The rows of the table under the README's `## \`pipe train\`` heading.
fn train_table_rows(readme: &str) -> Vec<&str> {
    readme
        .lines()
        .skip_while(|l| l.trim() != "## `pipe train`")
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .filter(|l| l.starts_with('|'))
        .collect()
}

/// Whether `row` names `flag` exactly: `--lr` must not be found inside `--lr-schedule`.
fn names(row: &str, flag: &str) -> bool {
    row.match_indices(flag).any(|(at, _)| {
        !row[at + flag.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

#[test]
fn the_readme_lists_every_pipe_train_flag() {
    let flags = help_flags();
    assert!(
        flags.len() > 20,
        "too few flags parsed from the help: {flags:?}"
    );
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("read README.md");
    let rows = train_table_rows(&readme);
    assert!(!rows.is_empty(), "no `pipe train` table in README.md");
    let missing: Vec<&String> = flags
        .iter()
        .filter(|flag| !rows.iter().any(|row| names(row, flag)))
        .collect();
    assert!(
        missing.is_empty(),
        "flags of `pipe train --help` missing from README.md's `pipe train` table: {missing:?}"
    );
}

#[test]
fn a_flag_is_named_whole() {
    assert!(names("| `--lr X` | 0.05 |", "--lr"));
    assert!(!names("| `--lr-schedule S` | cosine |", "--lr"));
    assert!(names("| `--momentum X`, `--nesterov` |", "--nesterov"));
}
