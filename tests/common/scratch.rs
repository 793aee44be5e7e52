//! Scratch paths that belong to one test alone, shared by the integration tests of the `pipe`
//! binary and of the crates (which include this file by its path). Each test binary's paths lie
//! under `TMP/pipe-SUITE-PID` ([`suite_dir`]), SUITE being the test binary's crate name. A
//! test binary cannot clean up after itself (the harness has no end hook, and a killed run
//! leaves what it made), so each one removes, as it starts, the folders its suite's earlier
//! binaries left: those whose process has ended.

#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// This test binary's scratch folder, `TMP/pipe-SUITE-PID`, made on the first call, which
/// first removes the folders of this suite's binaries that are no longer running
/// ([`sweep_ended`]).
pub fn suite_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let prefix = format!("pipe-{}-", env!("CARGO_CRATE_NAME"));
        let tmp = std::env::temp_dir();
        sweep_ended(&tmp, &prefix);
        let d = tmp.join(format!("{prefix}{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    })
}

/// Removes every folder `PREFIX<pid>` in `tmp` whose process has ended (no `/proc/<pid>`):
/// what earlier binaries of this suite left. A folder of a running binary is kept, so suites
/// and their copies can run side by side. Folders of other users cannot be removed and are
/// passed over, as is anything else that fails.
fn sweep_ended(tmp: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    let ours = std::process::id();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let ended = pid != ours && !Path::new("/proc").join(pid.to_string()).exists();
        if ended && Path::new("/proc/self").exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A path `name` that no other call has returned: under this test binary's scratch folder
/// ([`suite_dir`]), in a numbered folder of its own, so that tests running side by side never
/// write or delete each other's files, and a file one run reads is never rewritten under it
/// by another test. Nothing is at the path yet; its parent exists.
pub fn fresh_path(name: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = suite_dir().join(n.to_string());
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// A new empty folder `name` of this test's own ([`fresh_path`]).
pub fn fresh_dir(name: &str) -> PathBuf {
    let d = fresh_path(name);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes `text` to a file `name` of this call's own ([`fresh_path`]) and returns its path.
pub fn fresh_file(name: &str, text: &str) -> PathBuf {
    let p = fresh_path(name);
    std::fs::write(&p, text).unwrap();
    p
}
