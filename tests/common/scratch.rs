//! Scratch paths that belong to one test alone, shared by the integration tests of the `pipe`
//! binary and of the crates (which include this file by its path). Each test binary's paths lie
//! under `TMP/pipe-SUITE-PID`, SUITE being the test binary's crate name.

#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;

/// A path `name` that no other call has returned: under this test binary's scratch folder
/// (`TMP/pipe-SUITE-PID`), in a numbered folder of its own, so that tests running side by
/// side never write or delete each other's files, and a file one run reads is never rewritten
/// under it by another test. Nothing is at the path yet; its parent exists.
pub fn fresh_path(name: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let suite = env!("CARGO_CRATE_NAME");
    let d = std::env::temp_dir()
        .join(format!("pipe-{suite}-{}", std::process::id()))
        .join(n.to_string());
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
