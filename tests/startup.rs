//! A run's start: the measured partition's profile kept in pipe's cache and reused, entries
//! that cannot be trusted ignored with a warning, and every phase before the first update
//! announced (and logged as a record).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::pipe_cached;

use std::path::{Path, PathBuf};

/// A two-stage run of a small MLP whose partition is measured.
const MEASURED: &[&str] = &[
    "train",
    "--dataset",
    "synthetic",
    "--model",
    "mlp-784-32-10",
    "--steps",
    "4",
    "--stages",
    "2",
    "--threads",
    "1",
];

/// The layer-profile entries in `cache`.
fn entries(cache: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(cache)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("layer-profile-"))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The `partition ... by measured time` line's cut.
fn cut(out: &str) -> String {
    out.lines()
        .find_map(|l| l.strip_prefix("partition "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_default()
        .to_string()
}

#[test]
fn a_measured_profile_is_kept_and_reused() {
    let cache = common::fresh_path("reuse-cache");
    let first = common::ok(&pipe_cached(&cache, MEASURED));
    assert!(
        first.contains("(profile measured in") && first.contains("kept in"),
        "{first}"
    );
    let kept = entries(&cache);
    assert_eq!(kept.len(), 1, "{kept:?}");
    let second = common::ok(&pipe_cached(&cache, MEASURED));
    assert!(
        second.contains(&format!("profile reused from {}", kept[0].display())),
        "{second}"
    );
    assert_eq!(cut(&first), cut(&second));
    assert!(!cut(&first).is_empty(), "{first}");
    // --reprofile measures again and replaces the entry.
    let mut again = MEASURED.to_vec();
    again.push("--reprofile");
    let third = common::ok(&pipe_cached(&cache, &again));
    assert!(third.contains("(profile measured in"), "{third}");
    assert_eq!(entries(&cache), kept);
    // Another microbatch size is another key.
    let mut other = MEASURED.to_vec();
    other.extend(["--microbatch-size", "16"]);
    let fourth = common::ok(&pipe_cached(&cache, &other));
    assert!(fourth.contains("(profile measured in"), "{fourth}");
    assert_eq!(entries(&cache).len(), 2);
}

#[test]
fn a_cut_short_edited_or_foreign_entry_is_not_used() {
    let cache = common::fresh_path("hostile-cache");
    common::ok(&pipe_cached(&cache, MEASURED));
    let entry = entries(&cache).pop().unwrap();
    let whole = std::fs::read_to_string(&entry).unwrap();
    let edited = {
        // One layer's forward time changed by hand.
        let at = whole.find("\"forward\": ").unwrap() + "\"forward\": ".len();
        format!("{}9{}", &whole[..at], &whole[at..])
    };
    let foreign = {
        let at = whole.find("\"cpu\": \"").unwrap() + "\"cpu\": \"".len();
        format!("{}Another CPU {}", &whole[..at], &whole[at..])
    };
    let cases = [
        (whole[..whole.len() / 2].to_string(), "not a cache entry"),
        (edited, "does not match its digest"),
        (foreign, "written for another key (cpu Another CPU"),
    ];
    for (body, why) in cases {
        std::fs::write(&entry, body).unwrap();
        let out = pipe_cached(&cache, MEASURED);
        let text = common::ok(&out);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("is not used") && err.contains(why),
            "{why}: {err}"
        );
        assert!(text.contains("(profile measured in"), "{why}: {text}");
        // The entry measured again replaces it, and is trusted.
        let next = common::ok(&pipe_cached(&cache, MEASURED));
        assert!(next.contains("profile reused from"), "{why}: {next}");
    }
}

#[test]
fn every_phase_before_the_first_update_is_announced_and_logged() {
    let cache = common::fresh_path("phases-cache");
    let log = common::fresh_path("phases.jsonl");
    let mut args = MEASURED.to_vec();
    args.extend(["--log-jsonl", common::s(&log)]);
    let out = common::ok(&pipe_cached(&cache, &args));
    let phases = [
        "reading and checking the data",
        "profiling",
        "planning",
        "building the model",
        "starting workers and connecting them",
        "the first update",
    ];
    let mut from = 0;
    for phase in phases {
        let begin = out[from..]
            .find(&format!("{phase} ("))
            .or_else(|| out[from..].find(&format!("{phase} ...")))
            .unwrap_or_else(|| panic!("no line beginning '{phase}' after byte {from}: {out}"));
        let end = out[from + begin..]
            .find(&format!("{phase}: "))
            .unwrap_or_else(|| panic!("no line ending '{phase}': {out}"));
        from += begin + end;
    }
    let text = std::fs::read_to_string(&log).unwrap();
    let logged: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["kind"] == "phase")
        .collect();
    let names: Vec<&str> = logged
        .iter()
        .map(|v| v["phase"].as_str().unwrap())
        .collect();
    assert_eq!(names, phases, "{text}");
    for v in &logged {
        assert!(v["seconds"].as_f64().unwrap() >= 0.0, "{v}");
    }
    // Phase lines are records in the log, never lines of their own.
    assert!(!text.contains("..."), "{text}");
}

#[test]
fn a_run_over_the_memory_available_is_refused_unless_forced() {
    let cache = common::fresh_path("memory-cache");
    let run = |extra: &[&str]| {
        let mut args = MEASURED.to_vec();
        args.extend(["--partition", "0-1,2-3"]);
        args.extend(extra);
        common::pipe_command(&args)
            .env("PIPE_CACHE_DIR", &cache)
            // This host as if it had 1 MiB available.
            .env("PIPE_AVAILABLE_MEMORY", "1048576")
            .output()
            .expect("run pipe")
    };
    let out = run(&[]);
    common::refused(
        &out,
        &[
            "the run needs an estimated",
            "over the 1.0 MiB this host has available (PIPE_AVAILABLE_MEMORY)",
            "--microbatch-size",
            "--force",
        ],
    );
    let forced = run(&["--force"]);
    let text = common::ok(&forced);
    assert!(text.contains("done: 4 steps"), "{text}");
    let err = String::from_utf8_lossy(&forced.stderr);
    assert!(err.contains("running it (--force)"), "{err}");
}

/// An entry under the right key whose digest holds, but whose profile is of another model
/// shape (a layer fewer): checked against the model it is for, not used, measured again.
#[test]
fn an_entry_of_another_layer_count_is_not_used() {
    let cache = common::fresh_path("layer-count-cache");
    common::ok(&pipe_cached(&cache, MEASURED));
    let entry = entries(&cache).pop().unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&entry).unwrap()).unwrap();
    let key: pipe_stages::cache::CacheKey = serde_json::from_value(json["key"].clone()).unwrap();
    let mut value = json["value"].clone();
    value["layers"].as_array_mut().unwrap().pop();
    pipe_stages::cache::Cache::at(cache.clone())
        .put(&key, &value)
        .unwrap();
    let out = pipe_cached(&cache, MEASURED);
    let text = common::ok(&out);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is not used") && err.contains("layers, the model has"),
        "{err}"
    );
    assert!(text.contains("(profile measured in"), "{text}");
}
