//! pipe's on-disk cache: measurements that take seconds to minutes to repeat and hold on one
//! machine and one build (each transport's message costs now, the layer profiles of the
//! measured partition next), kept in one directory under one key scheme.
//!
//! - **Where**: `PIPE_CACHE_DIR` when set, else the platform's cache directory (`pipe` under
//!   `$XDG_CACHE_HOME` or `~/.cache` on Linux, `~/Library/Caches` on macOS).
//! - **Key**: a kind and named fields ([`CacheKey`]). An entry's file is named by its kind and
//!   a SHA-256 of the key's fields, and holds the key itself beside the value, so a file under
//!   another key's name (a collision, a copy, an edit) is seen and ignored. Every key names
//!   the machine and the build ([`CacheKey::for_this_machine`]): figures measured by another
//!   CPU or another binary are another key, measured again.
//! - **Trust**: an entry is JSON read within a size bound, and carries the SHA-256 of its
//!   value. One that does not parse, names another key or another format, whose value does
//!   not match its digest (cut short, edited by hand, damaged), or that is older than its
//!   kind's age bound is never used: the caller measures again and overwrites it, and says
//!   why ([`Lookup`]). The digest guards against accidents, not against an attacker who can
//!   write the user's cache directory.
//! - **Writes** go to a temporary file renamed over the entry, so a reader never sees half of
//!   one and two writers leave one whole entry.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Result, StageError};

/// The entry format this build reads and writes (2: with the value's digest).
const FORMAT: u32 = 2;

/// The largest entry read: far above any figure file's size, far below memory.
const MAX_ENTRY_BYTES: u64 = 16 << 20;

/// The environment variable that names the cache directory.
pub const CACHE_DIR_VAR: &str = "PIPE_CACHE_DIR";

/// What a cached measurement is keyed by: its kind and named fields, all text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheKey {
    /// What is measured (`transport-costs`, `profile`): the entry's file name starts with it.
    pub kind: String,
    /// What the measurement depends on, by name.
    pub fields: BTreeMap<String, String>,
}

impl CacheKey {
    /// A key of `kind` with no fields yet.
    pub fn new(kind: &str) -> Self {
        CacheKey {
            kind: kind.into(),
            fields: BTreeMap::new(),
        }
    }

    /// A key of `kind` naming this machine (its CPU model and cores) and this build of pipe
    /// (its version, and the size and time of its executable).
    pub fn for_this_machine(kind: &str) -> Self {
        let machine = crate::limits::Machine::detect();
        CacheKey::new(kind)
            .with("cpu", cpu_model())
            .with("cores", machine.cores)
            .with("build", build_id())
    }

    /// This key with `name` set to `value`.
    #[must_use]
    pub fn with(mut self, name: &str, value: impl std::fmt::Display) -> Self {
        self.fields.insert(name.into(), value.to_string());
        self
    }

    /// Where `self` differs from `wanted`, field by field (`cpu: Intel Xeon, not AMD EPYC`).
    fn differences(&self, wanted: &CacheKey) -> String {
        let mut out = Vec::new();
        if self.kind != wanted.kind {
            out.push(format!("kind {}, not {}", self.kind, wanted.kind));
        }
        let names: std::collections::BTreeSet<&String> =
            self.fields.keys().chain(wanted.fields.keys()).collect();
        for name in names {
            let (has, want) = (self.fields.get(name), wanted.fields.get(name));
            if has != want {
                let show = |v: Option<&String>| v.map_or("none".to_string(), Clone::clone);
                out.push(format!("{name} {}, not {}", show(has), show(want)));
            }
        }
        out.join("; ")
    }

    /// The entry's file name: the kind and the first 16 hex digits of the fields' SHA-256.
    fn file_name(&self) -> String {
        let mut hash = Sha256::new();
        for (k, v) in &self.fields {
            hash.update(k.as_bytes());
            hash.update([0]);
            hash.update(v.as_bytes());
            hash.update([0]);
        }
        let digest = hash.finalize();
        let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        format!("{}-{hex}.json", self.kind)
    }
}

/// This machine's CPU model, as `/proc/cpuinfo` names it (`unknown` elsewhere).
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or_else(|| "unknown".to_string(), |(_, v)| v.trim().to_string())
}

/// This build of pipe: its version, and its executable's size and modification time (a
/// rebuilt binary is another build).
fn build_id() -> String {
    let exe = std::env::current_exe()
        .and_then(std::fs::metadata)
        .ok()
        .map(|m| {
            let secs = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs());
            format!("{}-{secs}", m.len())
        })
        .unwrap_or_default();
    format!("{} {exe}", env!("CARGO_PKG_VERSION"))
}

/// One entry as stored.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry<T> {
    format: u32,
    key: CacheKey,
    /// Seconds since the Unix epoch when it was written.
    written: u64,
    /// The SHA-256 of the value's compact JSON, in hex ([`digest_of`]).
    digest: String,
    value: T,
}

/// The SHA-256, in hex, of `value` written as compact JSON (object keys sorted, numbers in
/// their shortest form: the same text for the same value, as written or as read back).
fn digest_of(value: &serde_json::Value) -> String {
    let text = value.to_string();
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What looking a key up found.
#[derive(Debug)]
pub enum Lookup<T> {
    /// A whole entry under this key, within the age bound.
    Hit {
        /// The value.
        value: T,
        /// Its file.
        path: PathBuf,
    },
    /// No entry.
    Missing {
        /// Where it would be.
        path: PathBuf,
    },
    /// An entry that is not used: why, for a warning.
    Ignored {
        /// Its file.
        path: PathBuf,
        /// Why it is not trusted (corrupt, another key or format, too old).
        why: String,
    },
}

/// The cache directory.
#[derive(Clone, Debug)]
pub struct Cache {
    dir: PathBuf,
}

impl Cache {
    /// The cache at `PIPE_CACHE_DIR`, else the platform's (`None` where there is neither).
    pub fn open() -> Option<Self> {
        match std::env::var_os(CACHE_DIR_VAR) {
            Some(dir) if !dir.is_empty() => Some(Cache::at(PathBuf::from(dir))),
            _ => dirs::cache_dir().map(|d| Cache::at(d.join("pipe"))),
        }
    }

    /// The cache in `dir`.
    pub fn at(dir: PathBuf) -> Self {
        Cache { dir }
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The entry under `key`, if it is whole, names `key`, and was written within `max_age`.
    pub fn get<T: DeserializeOwned>(&self, key: &CacheKey, max_age: Duration) -> Lookup<T> {
        let path = self.dir.join(key.file_name());
        if !path.exists() {
            return Lookup::Missing { path };
        }
        let ignored = |why: String| Lookup::Ignored {
            path: path.clone(),
            why,
        };
        let bytes = match crate::limits::read_file(&path, MAX_ENTRY_BYTES) {
            Ok(b) => b,
            Err(e) => return ignored(e.to_string()),
        };
        let entry: Entry<serde_json::Value> = match serde_json::from_slice(&bytes) {
            Ok(e) => e,
            Err(e) => return ignored(format!("not a cache entry of this build ({e})")),
        };
        if entry.format != FORMAT {
            return ignored(format!("entry format {}, not {FORMAT}", entry.format));
        }
        if entry.key != *key {
            return ignored(format!(
                "it was written for another key ({})",
                entry.key.differences(key)
            ));
        }
        if digest_of(&entry.value) != entry.digest {
            return ignored("its value does not match its digest (edited or damaged)".into());
        }
        let now = unix_seconds(SystemTime::now());
        let age = now.saturating_sub(entry.written);
        if entry.written > now || age > max_age.as_secs() {
            return ignored(format!(
                "written {age} s ago, past its bound of {} s",
                max_age.as_secs()
            ));
        }
        match serde_json::from_value(entry.value) {
            Ok(value) => Lookup::Hit { value, path },
            Err(e) => ignored(format!("not a cache entry of this build ({e})")),
        }
    }

    /// Writes `value` under `key` (creating the directory), replacing any entry; returns the
    /// entry's path.
    ///
    /// # Errors
    /// [`StageError::Io`] where the directory or the file cannot be written.
    pub fn put<T: Serialize>(&self, key: &CacheKey, value: &T) -> Result<PathBuf> {
        let io = |path: &Path, source: std::io::Error| StageError::Io {
            path: path.display().to_string(),
            source,
        };
        std::fs::create_dir_all(&self.dir).map_err(|e| io(&self.dir, e))?;
        let path = self.dir.join(key.file_name());
        let value = serde_json::to_value(value).map_err(|e| io(&path, e.into()))?;
        let entry = Entry {
            format: FORMAT,
            key: key.clone(),
            written: unix_seconds(SystemTime::now()),
            digest: digest_of(&value),
            value,
        };
        let text = serde_json::to_string_pretty(&entry).map_err(|e| io(&path, e.into()))?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, text).map_err(|e| io(&tmp, e))?;
        // A rename that fails (a folder where the entry goes) leaves no temporary behind.
        std::fs::rename(&tmp, &path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io(&path, e)
        })?;
        Ok(path)
    }
}

fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> Cache {
        let dir = std::env::temp_dir().join(format!("pipe-cache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Cache::at(dir)
    }

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn an_entry_is_read_back_under_its_key_only() {
        let cache = scratch("round-trip");
        let key = CacheKey::new("figures").with("cpu", "x").with("cores", 2);
        assert!(matches!(
            cache.get::<Vec<f64>>(&key, DAY),
            Lookup::Missing { .. }
        ));
        let path = cache.put(&key, &vec![1.5, 2.5]).unwrap();
        assert!(
            path.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("figures-")
        );
        match cache.get::<Vec<f64>>(&key, DAY) {
            Lookup::Hit { value, .. } => assert_eq!(value, [1.5, 2.5]),
            other => panic!("{other:?}"),
        }
        // Another key is another file; a file copied under another key's name is refused.
        let other = key.clone().with("cores", 16);
        assert!(matches!(
            cache.get::<Vec<f64>>(&other, DAY),
            Lookup::Missing { .. }
        ));
        let other_path = cache.dir().join(other.file_name());
        std::fs::copy(&path, &other_path).unwrap();
        match cache.get::<Vec<f64>>(&other, DAY) {
            Lookup::Ignored { why, .. } => assert!(why.contains("another key"), "{why}"),
            other => panic!("{other:?}"),
        }
        let _ = std::fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn an_entry_that_cannot_be_put_leaves_no_temporary() {
        let cache = scratch("in-the-way");
        let key = CacheKey::new("figures").with("cpu", "x");
        // A folder where the entry goes: the rename fails, and the temporary goes with it.
        std::fs::create_dir_all(cache.dir().join(key.file_name()).join("inside")).unwrap();
        assert!(cache.put(&key, &vec![1.0]).is_err());
        let names: Vec<String> = std::fs::read_dir(cache.dir())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, [key.file_name()]);
        let _ = std::fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn corrupt_foreign_and_old_entries_are_ignored() {
        let cache = scratch("hostile");
        let key = CacheKey::new("figures").with("cpu", "x");
        let path = cache.put(&key, &vec![1.0]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let cases = [
            ("{\"format\": 1, \"key\"".to_string(), "not a cache entry"),
            (
                text.replace("\"format\": 2", "\"format\": 9"),
                "entry format 9",
            ),
            (text.replace("1.0", "\"one\""), "does not match its digest"),
            (text.replace("1.0", "1.5"), "does not match its digest"),
            (text[..text.len() / 2].to_string(), "not a cache entry"),
            (text.replace("\"figures\"", "\"other\""), "another key"),
        ];
        for (body, want) in cases {
            std::fs::write(&path, body).unwrap();
            match cache.get::<Vec<f64>>(&key, DAY) {
                Lookup::Ignored { why, .. } => assert!(why.contains(want), "{why}"),
                other => panic!("{want}: {other:?}"),
            }
        }
        cache.put(&key, &vec![1.0]).unwrap();
        match cache.get::<Vec<f64>>(&key, Duration::ZERO) {
            Lookup::Hit { .. } => {}
            other => panic!("{other:?}"),
        }
        let old = std::fs::read_to_string(&path).unwrap();
        let written = unix_seconds(SystemTime::now()) - 2 * DAY.as_secs();
        let old = old
            .lines()
            .map(|l| {
                if l.trim_start().starts_with("\"written\"") {
                    format!("  \"written\": {written},")
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n");
        std::fs::write(&path, old).unwrap();
        match cache.get::<Vec<f64>>(&key, DAY) {
            Lookup::Ignored { why, .. } => assert!(why.contains("past its bound"), "{why}"),
            other => panic!("{other:?}"),
        }
        let _ = std::fs::remove_dir_all(cache.dir());
    }
}
