//! Checkpoints: a run's weights, optimizer state and position, written so that nothing is
//! ever half there, and read so that nothing is ever half loaded.
//!
//! **Layout.** `DIR/ckpt-NNNNNNNN/` (N: updates done) holds
//! - `weights.safetensors`: every parameter by the model's parameter name (`layers.3.weight`),
//!   so the file is independent of the partition and loads in other tools;
//! - `optimizer.safetensors`: the optimizer's state per parameter (`layers.3.weight.first`,
//!   `.second`: momentum, or Adam's two moments; `.correction`: a delay correction's memory),
//!   present only where the optimizer keeps it;
//! - `state.json`: the run's position and identity ([`RunState`]);
//! - `manifest.json`: the SHA-256 and size of each of those files.
//!
//! `DIR/latest` names the newest complete checkpoint.
//!
//! **Writing.** Everything goes into a temporary directory (`DIR/.tmp-ckpt-...`); each file
//! and the directory are fsynced, then the directory is renamed into place and `DIR` fsynced.
//! Only then is `latest` replaced, by writing `DIR/.latest.tmp`, fsyncing and renaming it. A
//! process killed at any moment leaves either the previous state or the new one, plus perhaps
//! a temporary directory that nothing points at (removed by the next write). The newest `keep`
//! checkpoints are kept.
//!
//! **Reading.** The manifest is checked first: every file it names must exist with its size
//! and hash, before any byte of it is parsed. Then the safetensors files are parsed (which
//! rejects truncation and bad offsets), and every tensor is checked against the model's
//! shapes. Only a checkpoint that passes every check is returned: nothing is partially
//! loaded. Every error names the file and the problem.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use pipe_kernels::Tensor;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::{DatasetKind, LaunchSettings, RunConfig};
use crate::data::SyntheticConfig;
use crate::error::{Result, StageError};
use crate::model::{Model, ModelSpec, Params};
use crate::optim::{OptimizerState, ParamState};

/// The checkpoint format this build writes and reads.
pub const FORMAT: u32 = 1;
/// The pointer file naming the newest checkpoint.
pub const LATEST: &str = "latest";
/// The weights file.
pub const WEIGHTS: &str = "weights.safetensors";
/// The optimizer state file.
pub const OPTIMIZER: &str = "optimizer.safetensors";
/// The run state file.
pub const STATE: &str = "state.json";
/// The manifest.
pub const MANIFEST: &str = "manifest.json";
/// Largest `state.json` or `manifest.json` read.
const MAX_SMALL_FILE: u64 = 1 << 20;

/// Header bytes a checkpoint may spend per tensor: a name of up to a few hundred bytes, its
/// dtype, shape and offsets, with room to spare.
const HEADER_BYTES_PER_TENSOR: u64 = 4096;

/// Where a run stands, and what it is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunState {
    /// [`FORMAT`].
    pub format: u32,
    /// Updates (minibatches) done over the whole run, by the layout that wrote it.
    pub updates: u64,
    /// The epoch the next update belongs to, from 1.
    pub epoch: u64,
    /// Samples of that epoch's seeded order already trained on: the data cursor. It is
    /// counted in samples because a minibatch's size depends on the layout (M microbatches
    /// per replica of the most replicated stage), and a run may resume under another.
    pub samples_in_epoch: u64,
    /// Updates the optimizer has applied to each layer (stages with fewer replicas than
    /// others apply more, smaller updates).
    pub optimizer_steps: Vec<u64>,
    /// The run seed: the data order of every epoch and every dropout mask derive from it and
    /// the counts above, so no generator state needs saving.
    pub seed: u64,
    /// The model's name.
    pub model: String,
    /// The model itself (what `pipe eval` builds).
    pub model_spec: ModelSpec,
    /// The dataset the run trained on.
    pub dataset: DatasetKind,
    /// The character vocabulary of a language model, id by id (what `pipe sample` decodes
    /// with).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab: Option<crate::data::Vocab>,
    /// The fingerprint of the tokenized corpus it trained on, whose windows the data cursor
    /// counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub corpus: Option<String>,
    /// Its shape, for the synthetic dataset (whose samples the seed decides).
    pub synthetic: SyntheticConfig,
    /// The partition the run used (the weights do not depend on it).
    pub partition: String,
    /// The schedule policy.
    pub policy: String,
    /// Replicas per stage.
    pub replicas: Vec<u32>,
    /// The run's numerics ([`RunConfig::numerics`]) as JSON, for the record.
    pub settings: String,
    /// The delay correction whose memory the optimizer state holds (absent in checkpoints
    /// written before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_correction: Option<crate::optim::DelayCorrection>,
}

impl RunState {
    /// The identity part of `cfg`'s run state (model, dataset, seed, policy, `settings`), at
    /// position zero on one stage: callers fill in the position and layout.
    pub fn identity(cfg: &RunConfig, settings: String) -> RunState {
        RunState {
            format: FORMAT,
            updates: 0,
            epoch: 1,
            samples_in_epoch: 0,
            optimizer_steps: Vec::new(),
            seed: cfg.seed,
            model: cfg.model_name.clone(),
            model_spec: cfg.model.clone(),
            dataset: cfg.dataset,
            vocab: cfg.vocab.clone(),
            corpus: cfg.corpus.as_ref().map(|c| c.fingerprint.clone()),
            synthetic: cfg.synthetic.clone(),
            partition: String::new(),
            policy: if cfg.pipelined {
                cfg.schedule.name().to_string()
            } else {
                "single-worker".into()
            },
            replicas: vec![1],
            settings,
            delay_correction: Some(cfg.optimizer.delay_correction),
        }
    }
}

/// When and where a run writes checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointPolicy {
    /// The checkpoint directory (`DIR/ckpt-N`, `DIR/latest`).
    pub dir: PathBuf,
    /// Also write one every this many updates (at every multiple of it, counted over the
    /// whole run; a pipeline drains there); without it, at each epoch's end.
    pub every: Option<u64>,
    /// Checkpoints kept.
    pub keep: usize,
    /// The run's numerics-deciding settings, recorded in each checkpoint.
    pub settings: String,
}

impl CheckpointPolicy {
    /// The checkpoints a launch asks for, of the run `cfg` (whose numerics each records);
    /// `None` without a checkpoint directory.
    ///
    /// # Errors
    /// A run that does not serialize (never, for a resolved one).
    pub fn of_launch(launch: &LaunchSettings, cfg: &RunConfig) -> Result<Option<Self>> {
        let Some(dir) = &launch.checkpoint_dir else {
            return Ok(None);
        };
        Ok(Some(CheckpointPolicy {
            dir: dir.clone(),
            every: launch.checkpoint_every,
            keep: usize::try_from(launch.keep_checkpoints).unwrap_or(usize::MAX),
            settings: cfg.numerics().to_json()?,
        }))
    }

    /// Whether a checkpoint is due after `done` updates (`epoch_end`: the epoch just ended;
    /// `stop`: the run is stopping).
    pub fn due(&self, done: u64, epoch_end: bool, stop: bool) -> bool {
        stop || epoch_end || self.every.is_some_and(|n| done % n.max(1) == 0)
    }
}

/// A checkpoint's contents: the whole model's weights and optimizer state (host memory, in
/// model layer order), and the run state.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// Weights, per layer.
    pub params: Params,
    /// Optimizer state per layer and parameter ([`ParamState`]: first, second, and the delay
    /// correction's memory); an empty tensor where the optimizer keeps none.
    pub optimizer: OptimizerState,
    /// Position and identity.
    pub state: RunState,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    format: u32,
    files: Vec<ManifestEntry>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ManifestEntry {
    name: String,
    bytes: u64,
    sha256: String,
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> StageError {
    StageError::Checkpoint(format!("{}: {e}", path.display()))
}

fn write_err(path: &Path, e: impl std::fmt::Display) -> StageError {
    StageError::CheckpointWrite(format!("{}: {e}", path.display()))
}

fn sha256_hex(bytes: &[u8]) -> String {
    crate::model::tensor_file::hex(&Sha256::digest(bytes))
}

/// Whether `name`, an entry of a checkpoint directory, is one the checkpoint store writes or
/// reads (`latest`, a `ckpt-*` checkpoint, or one being written): what no other output of a
/// run may replace. Other files a user keeps beside them (a log, say) are theirs.
pub fn is_store_entry(name: &std::ffi::OsStr) -> bool {
    let name = name.to_string_lossy();
    name == LATEST
        || name.starts_with("ckpt-")
        || name.starts_with(".tmp-")
        || name == ".latest.tmp"
        || name == LOCK
}

/// The file a run holds locked in its checkpoint directory while it runs
/// ([`hold_dir`]). It stays when the run ends; only the lock on it goes.
pub const LOCK: &str = ".pipe-lock";

/// A checkpoint directory held by this process: another run given the same directory is
/// refused while it is held. The lock goes with the value (or the process).
#[derive(Debug)]
pub struct HeldDir {
    _file: std::fs::File,
}

/// Holds `root` (created if needed) for this run: an exclusive, non-blocking `flock` on its
/// [`LOCK`] file (left empty, so that a run refused after taking it changes nothing). Two runs writing one directory would
/// replace each other's checkpoints and `latest`, each reporting success.
///
/// # Errors
/// [`StageError::Input`] when another process holds it;
/// [`StageError::CheckpointWrite`] when the file cannot be made or locked.
pub fn hold_dir(root: &Path) -> Result<HeldDir> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::create_dir_all(root).map_err(|e| write_err(root, e))?;
    let path = root.join(LOCK);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        // Never a lock taken through a link to a file elsewhere.
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(&path)
        .map_err(|e| write_err(&path, e))?;
    match crate::outputs::try_lock(&file) {
        Ok(true) => Ok(HeldDir { _file: file }),
        Ok(false) => Err(StageError::Input(format!(
            "--checkpoint-dir {} is being written by another run: two runs in one directory \
             would replace each other's checkpoints; give this run its own",
            root.display()
        ))),
        Err(e) => Err(write_err(&path, e)),
    }
}

/// The directory name of the checkpoint after `updates` updates.
pub fn dir_name(updates: u64) -> String {
    format!("ckpt-{updates:08}")
}

/// Writes `bytes` to `path` and fsyncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path).map_err(|e| write_err(path, e))?;
    f.write_all(bytes).map_err(|e| write_err(path, e))?;
    f.sync_all().map_err(|e| write_err(path, e))
}

/// Fsyncs a directory, so that the entries created or renamed in it are durable.
fn sync_dir(path: &Path) -> Result<()> {
    std::fs::File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(|e| write_err(path, e))
}

/// Writes one safetensors file of `(name, tensor)` pairs to `path`, streamed from the tensors
/// (`crate::model::tensor_file`), fsyncs it, and returns its manifest entry.
fn write_tensors(
    path: &Path,
    entries: &[(String, &Tensor)],
    model_name: &str,
) -> Result<ManifestEntry> {
    let info: HashMap<String, String> = [
        ("format".to_string(), "pipe".to_string()),
        ("model".to_string(), model_name.to_string()),
    ]
    .into();
    crate::model::tensor_file::write(path, entries, info)
        .map_err(|e| StageError::CheckpointWrite(format!("{}: {e}", path.display())))?;
    let (bytes, sha256) =
        crate::model::tensor_file::sync_and_digest(path).map_err(|e| write_err(path, e))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(ManifestEntry {
        name,
        bytes,
        sha256,
    })
}

/// Writes `ckpt` under `root` (created if needed) as [`dir_name`]`(updates)`, points `latest`
/// at it, and removes all but the newest `keep` checkpoints. Returns its directory.
///
/// # Errors
/// [`StageError::Checkpoint`] naming the file that could not be written.
pub fn write(root: &Path, model: &Model, ckpt: &Checkpoint, keep: usize) -> Result<PathBuf> {
    std::fs::create_dir_all(root).map_err(|e| write_err(root, e))?;
    check_pointer_temporary(root)?;
    remove_stale_temporaries(root);
    let name = dir_name(ckpt.state.updates);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).map_err(|e| write_err(&tmp, e))?;
    let written = write_into(root, &tmp, &name, model, ckpt);
    if written.is_err() {
        // A full disk or a directory made read-only: give back what the partial copy and the
        // pointer being written took. `latest` still names the previous checkpoint, or, where
        // this write replaced a checkpoint of the same update count (a run resumed from before
        // it), the new one or the old one ([`replace_checkpoint`]).
        let _ = std::fs::remove_dir_all(&tmp);
        let _ = std::fs::remove_file(root.join(".latest.tmp"));
    }
    let dest = written?;
    prune(root, keep.max(1), &name);
    Ok(dest)
}

/// Refuses a `.latest.tmp` in `root` that is not a pointer a writer left (a regular file of a
/// few bytes naming a `ckpt-N`, or part of one): the writer replaces that file, and a user's file by that name
/// is not its to replace.
///
/// # Errors
/// [`StageError::Input`] naming the file.
pub fn check_pointer_temporary(root: &Path) -> Result<()> {
    let path = root.join(".latest.tmp");
    let Ok(meta) = std::fs::symlink_metadata(&path) else {
        return Ok(());
    };
    // What a writer stopped part way through left is a start of such a name, or nothing.
    let a_pointer = |text: String| {
        let name = text.trim();
        "ckpt-".starts_with(name) || number_of(name).is_some()
    };
    if meta.is_file() && meta.len() <= 64 && std::fs::read_to_string(&path).is_ok_and(a_pointer) {
        return Ok(());
    }
    Err(StageError::Input(format!(
        "{} is in the way and is not a pointer a checkpoint writer left (a ckpt-N name): pipe \
         replaces only its own; move it, or give another --checkpoint-dir",
        path.display()
    )))
}

/// Writes checkpoint `name` into `tmp`, renames it into place under `root` and points `latest`
/// at it.
fn write_into(
    root: &Path,
    tmp: &Path,
    name: &str,
    model: &Model,
    ckpt: &Checkpoint,
) -> Result<PathBuf> {
    let mut weights = Vec::new();
    let mut moments = Vec::new();
    for entry in model.param_table() {
        let (l, s) = entry.uses[0];
        weights.push((entry.name.clone(), &ckpt.params[l][s]));
        for (part, t) in ckpt.optimizer[l][s].parts() {
            if !t.is_empty() {
                moments.push((format!("{}.{part}", entry.name), t));
            }
        }
    }
    let state = serde_json::to_vec_pretty(&ckpt.state)
        .map_err(|e| StageError::CheckpointWrite(format!("run state: {e}")))?;
    let mut manifest = Manifest {
        format: FORMAT,
        files: Vec::new(),
    };
    // Each tensor file goes from the tensors to the disk without a copy of the model.
    for (file, entries) in [(WEIGHTS, &weights), (OPTIMIZER, &moments)] {
        let entry = write_tensors(&tmp.join(file), entries, &ckpt.state.model)?;
        manifest.files.push(entry);
        fault_pause();
    }
    write_synced(&tmp.join(STATE), &state)?;
    manifest.files.push(ManifestEntry {
        name: STATE.to_string(),
        bytes: state.len() as u64,
        sha256: sha256_hex(&state),
    });
    fault_pause();
    let manifest = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| StageError::CheckpointWrite(format!("manifest: {e}")))?;
    write_synced(&tmp.join(MANIFEST), &manifest)?;
    sync_dir(tmp)?;
    let dest = root.join(name);
    if std::fs::symlink_metadata(&dest).is_ok() {
        // Only a checkpoint is replaced: a user's directory or file under a checkpoint's name
        // is left as it is, and the write fails.
        if !is_checkpoint(&dest) {
            return Err(StageError::Input(format!(
                "checkpoint {} is in the way and is not a checkpoint (no {MANIFEST}): pipe replaces only \
                 its own checkpoints; move it, or give another --checkpoint-dir",
                dest.display()
            )));
        }
        replace_checkpoint(tmp, &dest)?;
    } else {
        std::fs::rename(tmp, &dest).map_err(|e| write_err(&dest, e))?;
    }
    sync_dir(root)?;
    let pointer = root.join(".latest.tmp");
    write_synced(&pointer, format!("{name}\n").as_bytes())?;
    std::fs::rename(&pointer, root.join(LATEST)).map_err(|e| write_err(&root.join(LATEST), e))?;
    sync_dir(root)?;
    Ok(dest)
}

/// Puts the written checkpoint `tmp` in the place of the checkpoint `dest` of the same update
/// count (a run resumed from before it writes it again). On Linux the two are swapped in one
/// step (`renameat2` with `RENAME_EXCHANGE`), so that a crash leaves one of them under the
/// name `latest` gives, never neither, and the old one, now under `tmp`'s name, is removed
/// after. Where the system cannot swap them, the old one is removed first, as before.
fn replace_checkpoint(tmp: &Path, dest: &Path) -> Result<()> {
    #[cfg(target_os = "linux")]
    {
        use rustix::fs::{CWD, RenameFlags, renameat_with};
        use rustix::io::Errno;
        match renameat_with(CWD, tmp, CWD, dest, RenameFlags::EXCHANGE) {
            // The old checkpoint is the temporary now: a crash before it is removed leaves a
            // dead writer's temporary, which the next write removes.
            Ok(()) => return std::fs::remove_dir_all(tmp).map_err(|e| write_err(tmp, e)),
            // A kernel or file system without the swap.
            Err(Errno::INVAL | Errno::NOSYS | Errno::NOTSUP) => {}
            Err(e) => return Err(write_err(dest, e)),
        }
    }
    std::fs::remove_dir_all(dest).map_err(|e| write_err(dest, e))?;
    std::fs::rename(tmp, dest).map_err(|e| write_err(dest, e))
}

/// Test hook: this environment variable sleeps this many milliseconds after each file of a
/// checkpoint is written, so a test can kill the process while one is half written.
const FAULT_PAUSE_VAR: &str = "PIPE_FAULT_CHECKPOINT_PAUSE_MS";

/// The longest [`FAULT_PAUSE_VAR`] pause, in milliseconds.
const MAX_FAULT_PAUSE_MS: u64 = 60_000;

/// The checkpoint test hook's pause ([`FAULT_PAUSE_VAR`]), where set: checked before a run
/// that writes checkpoints starts, so that a malformed one is not passed over.
///
/// # Errors
/// Bad input naming the variable for anything but whole milliseconds up to
/// [`MAX_FAULT_PAUSE_MS`].
pub fn fault_pause_ms() -> Result<Option<u64>> {
    let Some(value) = std::env::var_os(FAULT_PAUSE_VAR) else {
        return Ok(None);
    };
    let text = value.to_string_lossy();
    match text.trim().parse::<u64>() {
        Ok(ms) if ms <= MAX_FAULT_PAUSE_MS => Ok(Some(ms)),
        _ => Err(StageError::Input(format!(
            "{FAULT_PAUSE_VAR}={text:?}: the test hook's pause after each file of a \
             checkpoint takes whole milliseconds from 0 to {MAX_FAULT_PAUSE_MS}"
        ))),
    }
}

/// Sleeps [`FAULT_PAUSE_VAR`]'s pause, where set (checked as the run started).
fn fault_pause() {
    if let Ok(Some(ms)) = fault_pause_ms() {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// Removes temporary directories of writers that did not finish: this process's, and those
/// of processes no longer running (the PID ends each name). A live writer's temporary, another
/// run's writing into the same directory at this moment, is left alone, as is a name this
/// module did not make.
fn remove_stale_temporaries(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    let own = std::process::id().to_string();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(writer) = name
            .strip_prefix(".tmp-ckpt-")
            .and_then(|rest| rest.rsplit('-').next())
        else {
            continue;
        };
        let gone = writer == own
            || writer
                .parse::<i32>()
                .ok()
                .and_then(rustix::process::Pid::from_raw)
                .is_some_and(|pid| {
                    rustix::process::test_kill_process(pid) == Err(rustix::io::Errno::SRCH)
                });
        if gone && holds_only_checkpoint_files(&e.path()) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Whether `dir` is a directory that holds nothing but plain files with the names a writer
/// gives them: only such a temporary is this module's to remove. A folder of the user's that
/// happens to have a temporary's name is left alone.
fn holds_only_checkpoint_files(dir: &Path) -> bool {
    let is_dir = std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    is_dir
        && entries.into_iter().all(|e| {
            e.is_ok_and(|e| {
                let name = e.file_name();
                // The safetensors writer's temporary (`tempfile`'s `.tmpXXXXXX`), left by a
                // writer killed mid-file, is one of them.
                let known = [WEIGHTS, OPTIMIZER, STATE, MANIFEST]
                    .iter()
                    .any(|f| name.as_os_str() == std::ffi::OsStr::new(f))
                    || name.to_string_lossy().starts_with(".tmp");
                known && e.file_type().is_ok_and(|t| t.is_file())
            })
        })
}

/// The checkpoints under `root`, oldest first, by update count.
pub fn list(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| Some((number_of(&e.file_name().to_string_lossy())?, e.path())))
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// The update count a checkpoint's directory name (`ckpt-N`, [`dir_name`]) carries.
fn number_of(name: &str) -> Option<u64> {
    name.strip_prefix("ckpt-")?.parse().ok()
}

/// Whether `path` is a checkpoint this module wrote: a directory itself (not a link) that
/// holds a manifest.
fn is_checkpoint(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) && path.join(MANIFEST).is_file()
}

/// Keeps the newest `keep` checkpoints (and always `current`). Only checkpoints count and are
/// removed: a directory named like one without a manifest is a user's, and is left alone.
fn prune(root: &Path, keep: usize, current: &str) {
    let all: Vec<_> = list(root)
        .into_iter()
        .filter(|(_, path)| is_checkpoint(path))
        .collect();
    let excess = all.len().saturating_sub(keep);
    for (_, path) in all.into_iter().take(excess) {
        if path.file_name().is_some_and(|n| n != current) {
            let _ = std::fs::remove_dir_all(path);
        }
    }
}

/// The checkpoint directory `path` names: a checkpoint itself, or a checkpoint root whose
/// `latest` is followed (without one, its newest `ckpt-*` that has a manifest).
///
/// # Errors
/// [`StageError::Checkpoint`]: no such directory, or a `latest` that names nothing.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    if let Some(dir) = latest_of(path)? {
        return Ok(dir);
    }
    // A writer stopped between renaming a checkpoint into place and writing `latest` leaves
    // a whole checkpoint (only a finished one is renamed in) and no pointer: take the newest.
    if let Some((_, dir)) = list(path)
        .into_iter()
        .rev()
        .find(|(_, d)| d.join(MANIFEST).is_file())
    {
        return Ok(dir);
    }
    Err(io_err(
        path,
        "neither a checkpoint (no manifest.json) nor a checkpoint directory (no latest)",
    ))
}

/// The checkpoint `root`'s `latest` names, or `None` where there is no `latest`.
///
/// # Errors
/// [`StageError::Checkpoint`] naming the pointer: not a regular file (a FIFO would block the
/// read), not text, a name that is no checkpoint's, or one that has no manifest.
pub fn latest_of(root: &Path) -> Result<Option<PathBuf>> {
    let pointer = root.join(LATEST);
    let Ok(meta) = std::fs::symlink_metadata(&pointer) else {
        return Ok(None);
    };
    if !meta.is_file() {
        return Err(io_err(
            &pointer,
            "is not a regular file, where the name of the latest checkpoint goes",
        ));
    }
    let name = read_small(&pointer)?;
    let name = String::from_utf8(name).map_err(|_| io_err(&pointer, "not text"))?;
    let name = name.trim();
    if number_of(name).is_none() {
        return Err(io_err(
            &pointer,
            format!("names '{name}', not a checkpoint (ckpt-N)"),
        ));
    }
    let dir = root.join(name);
    if !dir.join(MANIFEST).is_file() {
        return Err(io_err(
            &pointer,
            format!("names {name}, which has no manifest"),
        ));
    }
    Ok(Some(dir))
}

/// Reads a small file, bounded.
fn read_small(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read as _;
    let file = crate::limits::open_regular(path).map_err(|e| io_err(path, e))?;
    let mut bytes = Vec::new();
    file.take(MAX_SMALL_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| io_err(path, e))?;
    if bytes.len() as u64 > MAX_SMALL_FILE {
        return Err(io_err(path, format!("larger than {MAX_SMALL_FILE} bytes")));
    }
    Ok(bytes)
}

/// The manifest of checkpoint `dir`, parsed and of this build's format.
fn manifest_of(dir: &Path) -> Result<Manifest> {
    let mpath = dir.join(MANIFEST);
    let manifest: Manifest = serde_json::from_slice(&read_small(&mpath)?)
        .map_err(|e| io_err(&mpath, format!("malformed: {e}")))?;
    if manifest.format != FORMAT {
        return Err(io_err(
            &mpath,
            format!("format {} (this build reads {FORMAT})", manifest.format),
        ));
    }
    check_listing(&manifest).map_err(|e| io_err(&mpath, e))?;
    Ok(manifest)
}

/// Checks that a manifest lists exactly the files a checkpoint is made of, each once: a file
/// it lists that no reader verifies, or one it lists twice with two digests, would make the
/// manifest vouch for what nobody checked.
fn check_listing(manifest: &Manifest) -> std::result::Result<(), String> {
    const FILES: [&str; 3] = [WEIGHTS, OPTIMIZER, STATE];
    for (i, entry) in manifest.files.iter().enumerate() {
        if !FILES.contains(&entry.name.as_str()) {
            return Err(format!(
                "lists {:?}, which is not a checkpoint's file (they are {})",
                entry.name,
                FILES.join(", ")
            ));
        }
        if manifest.files[..i].iter().any(|e| e.name == entry.name) {
            return Err(format!("lists {} twice", entry.name));
        }
    }
    Ok(())
}

/// File `want` of checkpoint `dir`, checked against the manifest's size and SHA-256 and
/// against `max`, the most that kind of file may hold for the model: the size is compared
/// before a byte is read, so a file the manifest agrees with but the model cannot fill is
/// refused without being read.
fn verified_file(dir: &Path, manifest: &Manifest, want: &str, max: u64) -> Result<Vec<u8>> {
    let mpath = dir.join(MANIFEST);
    let entry = manifest
        .files
        .iter()
        .find(|e| e.name == want)
        .ok_or_else(|| io_err(&mpath, format!("does not list {want}")))?;
    let path = dir.join(want);
    let (file, len) = pipe_kernels::files::open_bounded(&path, max).map_err(|e| match e {
        pipe_kernels::files::ReadError::Long { max } => io_err(
            &path,
            format!("larger than the {max} bytes the model's {want} can take (not this model's?)"),
        ),
        other => io_err(&path, other),
    })?;
    if len != entry.bytes {
        return Err(io_err(
            &path,
            format!(
                "{len} bytes, the manifest says {} (truncated or replaced)",
                entry.bytes
            ),
        ));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    {
        use std::io::Read as _;
        file.take(len).read_to_end(&mut bytes)
    }
    .map_err(|e| io_err(&path, e))?;
    if sha256_hex(&bytes) != entry.sha256 {
        return Err(io_err(
            &path,
            "SHA-256 differs from the manifest's (corrupted)",
        ));
    }
    Ok(bytes)
}

/// The most bytes a checkpoint's safetensors file of `tensors` tensors holding `elements`
/// f32 values can take: the values, and a header of at most [`HEADER_BYTES_PER_TENSOR`]
/// per tensor (names, dtypes, shapes and offsets, in JSON) plus its length prefix.
fn safetensors_bound(tensors: usize, elements: u64) -> u64 {
    let header = MAX_SMALL_FILE + HEADER_BYTES_PER_TENSOR * tensors as u64;
    elements.saturating_mul(4).saturating_add(header)
}

/// Which values a checkpoint's tensor can hold that a run could have written. A run stops
/// before an update leaves a weight that is not finite, and before a NaN reaches an optimizer
/// moment. A first moment (momentum) that is infinite moves its weight to infinity or NaN at
/// the next update, so a run never keeps one; a second moment (a mean of squares, Adam's or
/// the adaptive DC-ASGD's) is never negative and may overflow to infinity from a finite
/// gradient (its update is then 0, and the weights stay finite).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Written {
    /// Weights: finite.
    Weight,
    /// First moments: finite.
    FirstMoment,
    /// Second moments: neither NaN nor negative.
    MeanSquare,
    /// A delay correction's memory (a last update, or a mean of squares): not NaN.
    NotNan,
}

impl Written {
    /// What each optimizer state's part may hold, in [`ParamState::PART_NAMES`]' order.
    const OF_PARTS: [Written; 3] = [Written::FirstMoment, Written::MeanSquare, Written::NotNan];

    /// The first value a run could not have written, with its index.
    fn first_foreign(self, values: &[f32]) -> Option<(usize, f32)> {
        let foreign = |v: &f32| match self {
            Written::Weight | Written::FirstMoment => !v.is_finite(),
            Written::MeanSquare => v.is_nan() || *v < 0.0,
            Written::NotNan => v.is_nan(),
        };
        values.iter().position(foreign).map(|at| (at, values[at]))
    }

    /// The rule a foreign value breaks, in words.
    fn rule(self) -> &'static str {
        match self {
            Written::Weight => "a checkpoint's weights are finite",
            Written::FirstMoment => "a checkpoint's first moments are finite",
            Written::MeanSquare => "a checkpoint's second moments are never negative or NaN",
            Written::NotNan => "a checkpoint's optimizer state is never NaN",
        }
    }
}

/// Checks that a safetensors view is f32 of `shape`.
fn check_view(view: &TensorView<'_>, shape: &[usize], what: &str, path: &Path) -> Result<()> {
    if view.dtype() != Dtype::F32 || view.shape() != shape {
        return Err(io_err(
            path,
            format!(
                "{what} is {:?} {:?}, the model has F32 {shape:?}",
                view.dtype(),
                view.shape()
            ),
        ));
    }
    Ok(())
}

/// A host tensor of `shape` from a safetensors view, which must be f32 of that shape and hold
/// only values a run could have written (`written`).
fn tensor_from(
    view: &TensorView<'_>,
    shape: &[usize],
    what: &str,
    path: &Path,
    written: Written,
) -> Result<Tensor> {
    check_view(view, shape, what, path)?;
    let values: Vec<f32> = view
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if let Some((at, v)) = written.first_foreign(&values) {
        return Err(io_err(
            path,
            format!(
                "{what} holds {v} at element {at}: {} (a run stops first)",
                written.rule()
            ),
        ));
    }
    Tensor::from_vec(shape, values).map_err(|e| io_err(path, e))
}

/// The run state of the checkpoint `path` names ([`resolve`]), after the manifest check of
/// every file: what a reader needs to build the model before [`read`].
///
/// # Errors
/// As [`read`].
pub fn read_state(path: &Path) -> Result<(PathBuf, RunState)> {
    let dir = resolve(path)?;
    let manifest = manifest_of(&dir)?;
    let bytes = verified_file(&dir, &manifest, STATE, MAX_SMALL_FILE)?;
    Ok((dir.clone(), parse_state(&dir, &bytes)?))
}

fn parse_state(dir: &Path, bytes: &[u8]) -> Result<RunState> {
    let spath = dir.join(STATE);
    let state: RunState =
        serde_json::from_slice(bytes).map_err(|e| io_err(&spath, format!("malformed: {e}")))?;
    if state.format != FORMAT {
        return Err(io_err(&spath, format!("format {}", state.format)));
    }
    check_counters(&state).map_err(|e| io_err(&spath, e))?;
    Ok(state)
}

/// Checks a state's counters against the bounds of a run that could have written them, so
/// that the arithmetic a resumed run does on them cannot overflow: updates at most
/// [`MAX_STEPS`](crate::limits::MAX_STEPS), the epoch from 1 to one past
/// [`MAX_EPOCHS`](crate::limits::MAX_EPOCHS), each layer's optimizer steps at most the updates
/// times [`MAX_WORKERS`](crate::limits::MAX_WORKERS) (a stage with fewer replicas applies
/// more, smaller updates), and the data cursor at most one epoch of the largest corpus a
/// tensor can index ([`MAX_TENSOR_ELEMENTS`](crate::limits::MAX_TENSOR_ELEMENTS) samples
/// times [`MAX_WORKERS`](crate::limits::MAX_WORKERS)).
fn check_counters(state: &RunState) -> std::result::Result<(), String> {
    use crate::limits::{MAX_EPOCHS, MAX_STEPS, MAX_TENSOR_ELEMENTS, MAX_WORKERS};
    if state.updates > MAX_STEPS {
        return Err(format!(
            "updates {} is past the {MAX_STEPS} a run may make",
            state.updates
        ));
    }
    if state.epoch == 0 || state.epoch > MAX_EPOCHS + 1 {
        return Err(format!(
            "epoch {} is outside 1 to {}",
            state.epoch,
            MAX_EPOCHS + 1
        ));
    }
    let steps = MAX_STEPS * MAX_WORKERS;
    if let Some(s) = state.optimizer_steps.iter().find(|&&s| s > steps) {
        return Err(format!(
            "optimizer steps {s} of a layer are past the {steps} a run may make"
        ));
    }
    let cursor = MAX_TENSOR_ELEMENTS * MAX_WORKERS;
    if state.samples_in_epoch > cursor {
        return Err(format!(
            "samples_in_epoch {} is past any epoch's {cursor} samples",
            state.samples_in_epoch
        ));
    }
    Ok(())
}

/// Reads and checks the checkpoint `path` names ([`resolve`]) with the model its state
/// describes: where a command that uses a checkpoint on its own (`pipe eval`, `sample`,
/// `export`, `logits`) starts.
///
/// # Errors
/// As [`read_state`], [`Model::new`] and [`read`].
pub fn read_with_model(path: &Path) -> Result<(PathBuf, Model, Checkpoint)> {
    let (dir, state) = read_state(path)?;
    let model = Model::new(&state.model_spec)?;
    let (dir, ckpt) = read(&dir, &model)?;
    Ok((dir, model, ckpt))
}

/// Reads and checks the checkpoint `path` names ([`resolve`]) for `model`.
///
/// # Errors
/// [`StageError::Checkpoint`] naming the file and the problem: a manifest that does not
/// match, a truncated or malformed file, a tensor missing or shaped unlike the model's.
pub fn read(path: &Path, model: &Model) -> Result<(PathBuf, Checkpoint)> {
    let dir = resolve(path)?;
    let manifest = manifest_of(&dir)?;
    let state = parse_state(
        &dir,
        &verified_file(&dir, &manifest, STATE, MAX_SMALL_FILE)?,
    )?;
    let table = model.param_table();
    let elements: u64 = table
        .iter()
        .map(|e| e.shape.iter().map(|&d| d as u64).product::<u64>())
        .sum();
    // One file's bytes at a time: the weights are decoded and their file's bytes let go
    // before the optimizer's file is read.
    let weight_bytes = safetensors_bound(table.len(), elements);
    let params = read_weights(&dir, &manifest, (model, &state), weight_bytes)?;
    // First and second moments and the delay correction's memory, at most.
    let moment_bytes = safetensors_bound(3 * table.len(), 3 * elements);
    let optimizer = read_optimizer(&dir, &manifest, model, moment_bytes)?;
    Ok((
        dir,
        Checkpoint {
            params,
            optimizer,
            state,
        },
    ))
}

/// Per layer, one `T::default()` for each of its parameters: the slots a checkpoint's
/// tensors fill, by the model's parameter table (no weights are drawn to be replaced).
fn empty_slots<T: Default>(model: &Model) -> Vec<Vec<T>> {
    let mut slots: Vec<Vec<T>> = (0..model.len()).map(|_| Vec::new()).collect();
    for entry in model.param_table() {
        for &(l, s) in &entry.uses {
            if slots[l].len() <= s {
                slots[l].resize_with(s + 1, T::default);
            }
        }
    }
    slots
}

/// The weights of checkpoint `dir` for `model`, whose `state` names the model that wrote it,
/// from a weights file of at most `max` bytes: every tensor present with the model's shape
/// before any is decoded, and every value finite.
fn read_weights(
    dir: &Path,
    manifest: &Manifest,
    (model, state): (&Model, &RunState),
    max: u64,
) -> Result<Params> {
    let table = model.param_table();
    let weight_file = verified_file(dir, manifest, WEIGHTS, max)?;
    let wpath = dir.join(WEIGHTS);
    let weights = SafeTensors::deserialize(&weight_file).map_err(|e| io_err(&wpath, e))?;
    if weights.len() != table.len() {
        return Err(io_err(
            &wpath,
            format!(
                "{} tensors of the checkpoint's model {}, where the model being read has {} \
                 parameters",
                weights.len(),
                state.model,
                table.len()
            ),
        ));
    }
    let weight_view = |name: &str| {
        weights
            .tensor(name)
            .map_err(|_| io_err(&wpath, format!("has no {name} (another model?)")))
    };
    // Every weight is the model's shape before anything the model's size decides is
    // allocated: the file's tensors then bound it (a state can describe a model of any size;
    // the weights file, checked against its manifest, holds what it holds).
    for entry in table {
        check_view(
            &weight_view(&entry.name)?,
            &entry.shape,
            &entry.name,
            &wpath,
        )?;
    }
    let mut params: Params = empty_slots(model);
    for entry in table {
        let view = weight_view(&entry.name)?;
        let t = tensor_from(&view, &entry.shape, &entry.name, &wpath, Written::Weight)?;
        for &(l, s) in &entry.uses {
            params[l][s] = t.clone();
        }
    }
    Ok(params)
}

/// The optimizer state of checkpoint `dir` for `model`, from an optimizer file of at most
/// `max` bytes: each parameter's parts the file holds, of the parameter's shape, holding what
/// a run could have written ([`Written::OF_PARTS`]), and no tensor besides (a tensor no reader
/// takes would be state silently dropped).
fn read_optimizer(
    dir: &Path,
    manifest: &Manifest,
    model: &Model,
    max: u64,
) -> Result<OptimizerState> {
    let moment_file = verified_file(dir, manifest, OPTIMIZER, max)?;
    let opath = dir.join(OPTIMIZER);
    let moments = SafeTensors::deserialize(&moment_file).map_err(|e| io_err(&opath, e))?;
    let table = model.param_table();
    let part_name = |entry: &crate::model::ParamEntry, part: &str| format!("{}.{part}", entry.name);
    let known: std::collections::HashSet<String> = table
        .iter()
        .flat_map(|e| ParamState::PART_NAMES.map(|part| part_name(e, part)))
        .collect();
    if let Some(stray) = moments.names().into_iter().find(|n| !known.contains(*n)) {
        return Err(io_err(
            &opath,
            format!(
                "holds {stray}, which is no part of this model's parameters (another model's?)"
            ),
        ));
    }
    let mut optimizer: OptimizerState = empty_slots(model);
    for entry in table {
        let read = |k: usize| {
            let name = part_name(entry, ParamState::PART_NAMES[k]);
            match moments.tensor(&name) {
                Ok(view) => tensor_from(&view, &entry.shape, &name, &opath, Written::OF_PARTS[k]),
                Err(_) => Ok(Tensor::default()),
            }
        };
        let state = ParamState::from_parts([read(0)?, read(1)?, read(2)?]);
        for &(l, s) in &entry.uses {
            optimizer[l][s] = state.clone();
        }
    }
    Ok(optimizer)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::optim::{Corrected, OptimizerConfig, OptimizerKind};

    fn model() -> Model {
        Model::new(&model_spec()).unwrap()
    }

    fn checkpoint(model: &Model) -> Checkpoint {
        let params = model.init_params(7);
        let cfg = OptimizerConfig {
            kind: OptimizerKind::Adam,
            ..OptimizerConfig::default()
        };
        let opt = Corrected::new(cfg, &params, &model.optimizer_roles());
        Checkpoint {
            optimizer: opt.into_state(),
            params,
            state: RunState {
                format: FORMAT,
                updates: 5,
                epoch: 1,
                samples_in_epoch: 320,
                optimizer_steps: vec![5; model.len()],
                seed: 7,
                model: "mlp-8-6-4".into(),
                model_spec: model_spec(),
                dataset: DatasetKind::Synthetic,
                vocab: None,
                corpus: None,
                synthetic: SyntheticConfig::default(),
                partition: "0-1,2-3".into(),
                policy: "pipedream".into(),
                replicas: vec![1, 1],
                settings: String::new(),
                delay_correction: None,
            },
        }
    }

    fn model_spec() -> ModelSpec {
        let text = "input = [8]\nlayers = [{ type = \"linear\", inputs = 8, outputs = 6 }, \
                    { type = \"relu\" }, { type = \"linear\", inputs = 6, outputs = 4 }]\n";
        toml::from_str(text).unwrap()
    }

    #[test]
    fn weights_round_trip_through_the_safetensors_crate_by_parameter_name() {
        let model = model();
        let ckpt = checkpoint(&model);
        let root = std::env::temp_dir().join(format!("pipe-ckpt-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dir = write(&root, &model, &ckpt, 2).unwrap();
        let bytes = std::fs::read(dir.join(WEIGHTS)).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let mut names = file.names();
        names.sort();
        let mut want = model.param_names();
        want.sort();
        assert_eq!(
            names.into_iter().map(str::to_string).collect::<Vec<_>>(),
            want
        );
        for entry in model.param_table() {
            let (l, s) = entry.uses[0];
            let view = file.tensor(&entry.name).unwrap();
            assert_eq!(view.shape(), entry.shape.as_slice());
            let expect: Vec<u8> = ckpt.params[l][s]
                .host()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            assert_eq!(view.data(), expect.as_slice(), "{}", entry.name);
        }
        let (_, back) = read(&root, &model).unwrap();
        assert_eq!(back.state, ckpt.state);
        assert_eq!(
            crate::model::params_digest(&back.params),
            crate::model::params_digest(&ckpt.params)
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    /// Only temporaries of writers that are gone (or of this process) are removed: a live
    /// writer's, names this module did not make, and folders holding files it never writes
    /// stay.
    #[test]
    fn a_held_directory_refuses_a_second_holder_until_released() {
        let root = std::env::temp_dir().join(format!("pipe-held-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let first = hold_dir(&root).unwrap();
        // flock is per open file: a second opening, even in this process, is refused.
        let e = hold_dir(&root).unwrap_err().to_string();
        assert!(e.contains("being written by another run"), "{e}");
        drop(first);
        let again = hold_dir(&root).unwrap();
        assert!(is_store_entry(std::ffi::OsStr::new(LOCK)));
        drop(again);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_live_writers_temporary_is_left_alone() {
        let root = std::env::temp_dir().join(format!("pipe-tmp-ckpt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let names = [
            format!(".tmp-ckpt-00000001-{}", std::process::id()),
            format!(".tmp-ckpt-00000002-{dead}"),
            ".tmp-ckpt-00000003-1".to_string(),
            ".tmp-ckpt-notes".to_string(),
        ];
        for n in &names {
            std::fs::create_dir(root.join(n)).unwrap();
        }
        std::fs::write(root.join(&names[1]).join(STATE), "{").unwrap();
        std::fs::write(root.join(&names[1]).join(".tmpA1b2C3"), "").unwrap();
        // A folder of the user's under a dead writer's name: not this module's to remove.
        let users = format!(".tmp-ckpt-00000004-{dead}");
        std::fs::create_dir(root.join(&users)).unwrap();
        std::fs::write(root.join(&users).join("data.txt"), "precious").unwrap();
        remove_stale_temporaries(&root);
        let left: Vec<bool> = names.iter().map(|n| root.join(n).exists()).collect();
        assert_eq!(left, [false, false, true, true]);
        assert!(root.join(&users).join("data.txt").exists());
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// A checkpoint written again at its update count (a run resumed from before it) takes the
    /// old one's place whole, and no temporary is left: the old one is swapped out, not
    /// removed before the new one is in place.
    #[test]
    fn a_checkpoint_of_the_same_update_count_is_replaced_whole() {
        let model = model();
        let mut ckpt = checkpoint(&model);
        let root = std::env::temp_dir().join(format!("pipe-ckpt-again-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let first = write(&root, &model, &ckpt, 2).unwrap();
        let old_weights = std::fs::read(first.join(WEIGHTS)).unwrap();
        ckpt.state.seed += 1;
        ckpt.params[0][0].host_mut().unwrap().fill(0.25);
        let again = write(&root, &model, &ckpt, 2).unwrap();
        assert_eq!(again, first);
        let (_, read_back) = read(&root, &model).unwrap();
        assert_eq!(read_back.state.seed, ckpt.state.seed);
        assert_eq!(read_back.params[0][0].host().unwrap(), &[0.25; 48][..]);
        assert_ne!(std::fs::read(again.join(WEIGHTS)).unwrap(), old_weights);
        let names: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tmp-"))
            .collect();
        assert!(names.is_empty(), "{names:?}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// A directory or file under a checkpoint's name that is not a checkpoint is never
    /// replaced or pruned: writing over it fails as bad input, and pruning passes it by.
    #[test]
    fn only_checkpoints_are_replaced_or_pruned() {
        let model = model();
        let mut ckpt = checkpoint(&model);
        let root = std::env::temp_dir().join(format!("pipe-ckpt-mine-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        // A user's directories named like checkpoints, one where the next write goes.
        for name in ["ckpt-0", "ckpt-00000001", &dir_name(ckpt.state.updates)] {
            std::fs::create_dir_all(root.join(name)).unwrap();
            std::fs::write(root.join(name).join("notes.txt"), b"precious").unwrap();
        }
        let e = write(&root, &model, &ckpt, 1).unwrap_err();
        assert!(
            e.is_bad_input() && e.to_string().contains("is in the way"),
            "{e}"
        );
        std::fs::remove_dir_all(root.join(dir_name(ckpt.state.updates))).unwrap();
        // Two checkpoints kept at most one: the older checkpoint goes, the user's stay.
        write(&root, &model, &ckpt, 1).unwrap();
        ckpt.state.updates += 1;
        write(&root, &model, &ckpt, 1).unwrap();
        for name in ["ckpt-0", "ckpt-00000001"] {
            assert!(
                root.join(name).join("notes.txt").is_file(),
                "{name} was removed"
            );
        }
        let checkpoints: Vec<_> = list(&root)
            .into_iter()
            .filter(|(_, p)| is_checkpoint(p))
            .collect();
        assert_eq!(checkpoints.len(), 1);
        // The pointer's temporary: a user's file by its name stays and the write fails; what a
        // stopped writer left (a name, part of one, or nothing) is replaced.
        let pointer = root.join(".latest.tmp");
        std::fs::write(&pointer, b"my notes").unwrap();
        let e = write(&root, &model, &ckpt, 1).unwrap_err();
        assert!(
            e.is_bad_input() && e.to_string().contains(".latest.tmp is in the way"),
            "{e}"
        );
        assert_eq!(std::fs::read(&pointer).unwrap(), b"my notes");
        for left in ["ckpt-00000007\n", "ckpt-0", "ck", ""] {
            std::fs::write(&pointer, left).unwrap();
            write(&root, &model, &ckpt, 1).unwrap();
            assert!(!pointer.exists());
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}
