//! Directories a command writes whole (an export, a cluster's credentials, a tokenized
//! corpus): claimed only when missing or empty, filled in a staging directory beside them, and
//! renamed into place once every file is written. A command that fails part-way (a bad input
//! found late, a full disk) leaves the target as it was: no half-written output for a
//! corrected command to trip over, and no file of the user's replaced without being asked.
//!
//! Single files a user names (`-o`, `--costs-out`, `--trace`) go through [`write_file`]: whole
//! or not at all, and never over a FIFO, device or directory; [`check_output`] refuses such a
//! path before the work that would fill it.

use std::path::{Path, PathBuf};

use crate::error::{Result, StageError};

/// Writes `bytes` as the file `path` that the user named, whole or not at all
/// ([`pipe_kernels::files::write_replacing`]).
///
/// # Errors
/// Bad input naming `path` when it is not a regular file (a FIFO, device or directory);
/// [`StageError::Io`] when it cannot be written.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    pipe_kernels::files::write_replacing(path, bytes).map_err(|e| output_error(path, e))
}

/// Refuses, before the work that fills it, an output `path` that [`write_file`] would refuse.
///
/// # Errors
/// As [`write_file`].
pub fn check_output(path: &Path) -> Result<()> {
    pipe_kernels::files::output_target(path)
        .map(drop)
        .map_err(|e| output_error(path, e))
}

/// What a command reads, or keeps, that no file it writes may replace: each with the flag that
/// named it.
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    /// A file, or a directory every file of which belongs to it (a tokenized corpus, a
    /// checkpoint, a model directory, a dataset directory).
    Whole(&'a str, &'a Path),
    /// A directory of which only the entries `owned` accepts belong to the input (a checkpoint
    /// directory's checkpoints and `latest`), not the other files a user keeps beside them.
    Entries(&'a str, &'a Path, fn(&std::ffi::OsStr) -> bool),
}

/// Which of a directory's entries belong to an input (`None`: all of them).
type Owned = Option<fn(&std::ffi::OsStr) -> bool>;

impl<'a> Input<'a> {
    /// Its flag, its path, and which entries of a directory belong to it.
    fn parts(&self) -> (&'a str, &'a Path, Owned) {
        match *self {
            Input::Whole(f, p) => (f, p, None),
            Input::Entries(f, p, owned) => (f, p, Some(owned)),
        }
    }

    /// The files or directories a command's flags name, each read whole; flags not given
    /// (`None`) are left out.
    pub fn named(flags: &[(&'a str, Option<&'a Path>)]) -> Vec<Input<'a>> {
        flags
            .iter()
            .filter_map(|&(flag, path)| path.map(|p| Input::Whole(flag, p)))
            .collect()
    }
}

/// Refuses an output file `output` (named by `flag`) that is one of `inputs` or would replace
/// a file inside one: a command must not destroy what it reads, nor a checkpoint directory's
/// checkpoints. Compared after symbolic links; a file that does not exist yet is compared
/// where it would land: a new file beside an input's files replaces none of them, but one
/// under a checkpoint store's name (its pointer, a checkpoint, before they are written) is
/// refused too. An input that cannot be resolved is left to its reader's own error.
///
/// # Errors
/// Bad input naming both flags and paths.
pub fn check_not_input(output: &Path, flag: &str, inputs: &[Input<'_>]) -> Result<()> {
    // A file not written yet is placed where it would land: a log named `latest` in a
    // checkpoint directory that has none yet would be renamed over by the first checkpoint's
    // pointer, or a trace written over the pointer at the run's end.
    let Some(target) = resolved_output(output) else {
        return Ok(());
    };
    let exists = std::fs::symlink_metadata(&target).is_ok();
    for input in inputs {
        let (input_flag, path, owned) = input.parts();
        let Ok(real) = std::fs::canonicalize(path) else {
            continue;
        };
        let Ok(inside) = target.strip_prefix(&real) else {
            continue;
        };
        let replaces = match (inside.components().next(), owned) {
            // The input itself (a file, or the directory: refused as a file to write anyway).
            (None, _) => true,
            // A new file beside an input's files replaces none of them.
            (Some(_), None) => exists,
            // A checkpoint store's names are its own, made or to be made.
            (Some(first), Some(owned)) => owned(first.as_os_str()),
        };
        if replaces {
            return Err(StageError::Input(format!(
                "{flag} {} would overwrite {}, which {input_flag} {} names: give a file outside \
                 what the command reads",
                output.display(),
                target.display(),
                path.display()
            )));
        }
    }
    // The same file reached another way: a link inside an input to a file outside it (a
    // corpus's shard kept elsewhere), or a hard link to an input.
    if let Some(id) = identity(&target) {
        for input in inputs {
            let (input_flag, path, owned) = input.parts();
            let mut budget = IDENTITY_WALK;
            if holds_file(path, owned, id, INPUT_DEPTH, &mut budget) {
                return Err(StageError::Input(format!(
                    "{flag} {} is a file that {input_flag} {} reads (the same file through a \
                     link): give a file outside what the command reads",
                    output.display(),
                    path.display()
                )));
            }
        }
    }
    Ok(())
}

/// How deep [`check_not_input`] looks inside an input directory: a checkpoint directory's
/// checkpoints hold their files one level down, a model's shards sit at the top.
const INPUT_DEPTH: u32 = 3;
/// The most entries it looks at per input (a corpus of a million shards is not walked whole).
const IDENTITY_WALK: usize = 100_000;

/// A file's identity (device and inode), after links; `None` off Unix or when it cannot be
/// read.
fn identity(path: &Path) -> Option<(u64, u64)> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        Some((m.dev(), m.ino()))
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        None
    }
}

/// Whether `path`, or a file under it (`depth` levels, the top level's entries filtered by
/// `owned`, at most `budget` entries), is the file `id`. Links are followed.
fn holds_file(path: &Path, owned: Owned, id: (u64, u64), depth: u32, budget: &mut usize) -> bool {
    if identity(path) == Some(id) {
        return true;
    }
    if depth == 0 || !path.is_dir() {
        return false;
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return false;
    };
    for entry in entries.flatten() {
        if *budget == 0 {
            return false;
        }
        *budget -= 1;
        if owned.is_some_and(|owned| !owned(&entry.file_name())) {
            continue;
        }
        if holds_file(&entry.path(), None, id, depth - 1, budget) {
            return true;
        }
    }
    false
}

/// Writes `bytes` as the file `name` of directory `dir` that a command owns there (a report's
/// `REPORT.md`), whole or not at all ([`write_file`]). Unlike a file the user names, a link
/// there is refused rather than followed: the directory may come from elsewhere, and its
/// `REPORT.md` linked to a file outside it would have that file overwritten.
///
/// # Errors
/// Bad input naming the link; as [`write_file`].
pub fn write_owned_file(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf> {
    let path = check_owned_file(dir, name)?;
    write_file(&path, bytes)?;
    Ok(path)
}

/// The path of the file `name` a command owns in `dir`, refused as [`write_owned_file`]
/// would refuse it: a writer checks it before its work, so that nothing is written beside it
/// first.
///
/// # Errors
/// Bad input naming the link.
pub fn check_owned_file(dir: &Path, name: &str) -> Result<PathBuf> {
    let path = dir.join(name);
    if is_link(&path) {
        return Err(StageError::Input(format!(
            "{} is a symbolic link: the command writes {name} itself; remove the link",
            path.display()
        )));
    }
    check_output(&path)?;
    Ok(path)
}

/// Whether `path` is a symbolic link itself (not followed).
fn is_link(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

/// Refuses two outputs of one command that name the same file (through links or other
/// spellings): one would be written over the other, and the user would keep only the last.
/// Flags not given (`None`) are left out; a path whose directory cannot be resolved is left to
/// its writer's own error.
///
/// # Errors
/// Bad input naming both flags and the path.
pub fn check_outputs_distinct(outputs: &[(&str, Option<&Path>)]) -> Result<()> {
    let resolved: Vec<(&str, &Path, PathBuf)> = outputs
        .iter()
        .filter_map(|&(flag, path)| {
            let path = path?;
            Some((flag, path, resolved_output(path)?))
        })
        .collect();
    for (i, (flag, path, real)) in resolved.iter().enumerate() {
        if let Some((other, other_path, _)) = resolved[..i].iter().find(|(_, _, r)| r == real) {
            return Err(StageError::Input(format!(
                "{other} {} and {flag} {} name the same file: give each its own",
                other_path.display(),
                path.display()
            )));
        }
    }
    Ok(())
}

/// Refuses an output file `file` (named by `flag`) where the output directory `dir` (named by
/// `dir_flag`) goes: the same path, or a path the directory would be under. One of them could
/// not be written, and the run would find out only at its first write (a checkpoint, after
/// its first updates).
///
/// # Errors
/// Bad input naming both flags and paths.
pub fn check_file_not_over_dir(file: &Path, flag: &str, dir: &Path, dir_flag: &str) -> Result<()> {
    let (f, d) = (landing(file), landing(dir));
    if d == f || d.starts_with(&f) {
        return Err(StageError::Input(format!(
            "{flag} {} and {dir_flag} {} clash: the directory would be the file or under it; \
             give each its own place",
            file.display(),
            dir.display()
        )));
    }
    Ok(())
}

/// Refuses a directory a command writes into (`dir`, named by `flag`: a checkpoint directory,
/// an export) that is a directory of `inputs` read whole, or lies inside one: its files would
/// be written among the input's (a corpus's shards, a model's weights, a dataset's files), and
/// every later reader of the input would find them there. Of a directory only some entries of
/// which belong to an input (a checkpoint store), `dir` must not be, nor lie inside, one of
/// those entries: an export into a checkpoint would be pruned with it, and one under a
/// checkpoint's name would stop the store's next write. Compared after symbolic links; a
/// `dir` not made yet is placed where it would be made.
///
/// # Errors
/// Bad input naming both flags and paths.
pub fn check_dir_not_in_input(dir: &Path, flag: &str, inputs: &[Input<'_>]) -> Result<()> {
    let lands = landing(dir);
    for input in inputs {
        let (input_flag, path, owned) = input.parts();
        let Ok(real) = std::fs::canonicalize(path) else {
            continue;
        };
        let Ok(inside) = lands.strip_prefix(&real) else {
            continue;
        };
        if !real.is_dir() {
            continue;
        }
        let refused = match (owned, inside.components().next()) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(owned), Some(first)) => owned(first.as_os_str()),
        };
        if refused {
            let place = if lands == real { "is" } else { "is inside" };
            return Err(StageError::Input(format!(
                "{flag} {} {place} {}, which {input_flag} {} names: the command would write its \
                 files among what it reads; give a directory outside it",
                dir.display(),
                real.display(),
                path.display()
            )));
        }
    }
    Ok(())
}

/// Where `path` lands: its longest existing ancestor after links, joined with the rest of it
/// as written (`..` and `.` in the rest taken lexically).
fn landing(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut rest = Vec::new();
    let mut base = absolute.as_path();
    let real = loop {
        if let Ok(real) = std::fs::canonicalize(base) {
            break real;
        }
        match (base.parent(), base.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                base = parent;
            }
            _ => break base.to_path_buf(),
        }
    };
    rest.iter().rev().fold(real, |acc, name| acc.join(name))
}

/// Where an output file lands: the file after links when it exists, else its directory after
/// links joined with its name.
fn resolved_output(path: &Path) -> Option<PathBuf> {
    if let Ok(real) = std::fs::canonicalize(path) {
        return Some(real);
    }
    // A link to a file not yet written is written through: where it lands is its target's
    // place (links followed as the kernel would, at most 40).
    let mut path = path.to_path_buf();
    for _ in 0..40 {
        let Ok(target) = std::fs::read_link(&path) else {
            break;
        };
        path = pipe_kernels::files::parent_dir(&path).join(target);
    }
    let dir = pipe_kernels::files::parent_dir(&path);
    Some(std::fs::canonicalize(dir).ok()?.join(path.file_name()?))
}

/// The value parser of every flag that names a file to write (`-o`, `--json`,
/// `--costs-out`, `--trace`, `--log-jsonl`): the path as given, refused at the command line,
/// before any work, when [`write_file`] would refuse it.
///
/// # Errors
/// The path's problem, in words (clap prefixes the flag).
pub fn output_file(text: &str) -> std::result::Result<PathBuf, String> {
    let path = PathBuf::from(text);
    pipe_kernels::files::output_target(&path)
        .map(|_| path)
        .map_err(|e| format!("{e}: give a file to write"))
}

/// `e`, met writing `path`: bad input when `path` is not a file one can write.
fn output_error(path: &Path, e: std::io::Error) -> StageError {
    if e.kind() == std::io::ErrorKind::InvalidInput {
        StageError::Input(format!("{}: {e}: give a file to write", path.display()))
    } else {
        StageError::Io {
            path: path.display().to_string(),
            source: e,
        }
    }
}

/// Refuses, before the work that fills it, an output directory `dir` that cannot be one: a
/// path that is a file, FIFO or device (after symbolic links), a link that leads nowhere, or
/// a missing one whose nearest
/// existing ancestor is not a directory or cannot be written. `flag` names it in the words.
///
/// # Errors
/// Bad input naming `flag`, `dir` and what is wrong.
pub fn check_output_dir(dir: &Path, flag: &str) -> Result<()> {
    let refused = |why: String| StageError::Input(format!("{flag} {}: {why}", dir.display()));
    // A link that leads nowhere (dangling, or a loop) would be found only when written.
    if is_link(dir) {
        if let Err(e) = std::fs::metadata(dir) {
            return Err(refused(format!(
                "a symbolic link that names nothing usable: {e}"
            )));
        }
    }
    let mut at = dir;
    loop {
        match std::fs::metadata(at) {
            Ok(meta) if meta.is_dir() => break,
            Ok(_) if at == dir => return Err(refused("not a directory".into())),
            Ok(_) => {
                return Err(refused(format!("{} is not a directory", at.display())));
            }
            // Missing, or under a file (the file is found on the way up).
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
                ) => {}
            Err(e) => return Err(refused(e.to_string())),
        }
        at = pipe_kernels::files::parent_dir(at);
    }
    pipe_kernels::files::writable_dir(at).map_err(|why| refused(format!("{} {why}", at.display())))
}

/// Takes an exclusive, non-blocking `flock` on `file`, held until the file is closed: `true`
/// when taken, `false` when another open file holds it. The one lock of the commands that
/// hold what they write (a checkpoint directory, a log, a results directory).
///
/// # Errors
/// Any other failure to lock.
pub fn try_lock(file: &std::fs::File) -> std::io::Result<bool> {
    match rustix::fs::flock(file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::WOULDBLOCK) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// An output directory a long command fills bit by bit (an experiment's or a sweep's results),
/// held by this process ([`hold_output_dir`]); the hold goes with the value or the process.
#[derive(Debug)]
pub struct HeldOutputDir {
    _dir: std::fs::File,
}

/// Holds the output directory `dir` (named by `flag`; created if missing), so that a second
/// command given it while this one runs is refused instead of running the same
/// work beside it and writing the same files: an exclusive, non-blocking `flock` on the
/// directory itself, which leaves no file behind in a directory of results that is kept (and
/// committed). Where the file system takes no lock on a directory (NFS), the command goes on
/// unheld (`None`), as it did before; checkpoint directories, which are shared between hosts,
/// are held through a lock file instead (`checkpoint::hold_dir`).
///
/// # Errors
/// Bad input when another process holds it, or when it cannot be made or opened.
pub fn hold_output_dir(dir: &Path, flag: &str) -> Result<Option<HeldOutputDir>> {
    let refused = |why: String| StageError::Input(format!("{flag} {}: {why}", dir.display()));
    std::fs::create_dir_all(dir).map_err(|e| refused(format!("cannot be made: {e}")))?;
    let handle = std::fs::File::open(dir).map_err(|e| refused(format!("cannot be opened: {e}")))?;
    match try_lock(&handle) {
        Ok(true) => Ok(Some(HeldOutputDir { _dir: handle })),
        Ok(false) => Err(refused(
            "another command is writing there (a sweep, an experiment or a report): two would \
             run the same work and write the same files; wait for it, or give this one its own \
             directory"
                .into(),
        )),
        Err(_) => Ok(None),
    }
}

/// An output directory being written ([`StagedDir::claim_empty`]); dropped without
/// [`StagedDir::commit`], it removes what it staged and leaves the target untouched.
#[derive(Debug)]
pub struct StagedDir {
    target: PathBuf,
    staging: PathBuf,
    committed: bool,
    /// Whether [`StagedDir::commit`] replaces a target that holds files
    /// ([`StagedDir::regenerating`]).
    replaces: bool,
}

impl StagedDir {
    /// Claims `target` for a writer that owns its whole directory: it must be missing or
    /// empty (`what` names the writer in the refusal). Files go into [`StagedDir::path`].
    ///
    /// # Errors
    /// Bad input naming `target` when it holds files, or when the staging directory beside
    /// it cannot be made.
    pub fn claim_empty(target: &Path, what: &str) -> Result<Self> {
        // A link to a directory stands for it: the output replaces the directory it names
        // (renaming over the link itself would fail once the work was done).
        let resolved;
        let target = if is_link(target) {
            resolved = std::fs::canonicalize(target).map_err(|e| {
                StageError::Input(format!(
                    "{}: a symbolic link that names nothing usable: {e}",
                    target.display()
                ))
            })?;
            resolved.as_path()
        } else {
            target
        };
        let first_entry = std::fs::read_dir(target)
            .ok()
            .and_then(|mut entries| entries.next());
        if let Some(entry) = first_entry {
            let first: String =
                entry.map_or_else(|_| "?".into(), |e| e.file_name().to_string_lossy().into());
            return Err(StageError::Input(format!(
                "{}: already holds files ({first}, ...): {what} into a new or empty directory, \
                 so that no file of yours is replaced and none of another output is left beside \
                 this one",
                target.display()
            )));
        }
        check_output_dir(target, "--out")?;
        Self::beside(target, false)
    }

    /// Claims `target`, a directory a writer regenerates whole every time (a report's
    /// `plots/`): what it holds is replaced at [`StagedDir::commit`], and a writer that fails
    /// before then leaves every file of it as it was, where writing in place would leave the
    /// files written before the failure beside the older rest. Only files the writer makes
    /// (`owned`: a name it could have written, an earlier run's or its own) may be there: a
    /// file of the user's, a directory or a link inside it, or `target` itself a link, is
    /// refused rather than removed with the rest.
    ///
    /// # Errors
    /// As [`StagedDir::claim_empty`], and bad input naming an entry `owned` does not accept.
    pub fn regenerating(target: &Path, owned: fn(&std::ffi::OsStr) -> bool) -> Result<Self> {
        // No flag names it: it is inside the directory the command writes.
        check_output_dir(target, "the regenerated directory")?;
        let foreign = |why: String| {
            StageError::Input(format!(
                "{why}: {} is regenerated whole, so it holds only the files the command writes",
                target.display()
            ))
        };
        if is_link(target) {
            return Err(foreign(format!(
                "{} is a symbolic link, not a directory of its own",
                target.display()
            )));
        }
        if target.exists() {
            let entries = std::fs::read_dir(target).map_err(|e| {
                StageError::Input(format!("{}: cannot be read: {e}", target.display()))
            })?;
            for entry in entries.flatten() {
                let plain = entry.file_type().is_ok_and(|t| t.is_file());
                if !plain || !owned(&entry.file_name()) {
                    return Err(foreign(format!(
                        "{} is not a file the command writes (move it elsewhere)",
                        entry.path().display()
                    )));
                }
            }
        }
        Self::beside(target, true)
    }

    /// A fresh staging directory beside `target`.
    fn beside(target: &Path, replaces: bool) -> Result<Self> {
        let name = target.file_name().ok_or_else(|| {
            StageError::Input(format!("{}: not a directory name", target.display()))
        })?;
        let parent = pipe_kernels::files::parent_dir(target);
        let staging = parent.join(format!(
            ".{}.partial-{}",
            pipe_kernels::files::temporary_stem(&name.to_string_lossy()),
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging)
            .map_err(|e| StageError::Input(format!("{}: cannot create: {e}", staging.display())))?;
        // What replaces an empty target keeps its permissions.
        if let Ok(meta) = std::fs::metadata(target) {
            let _ = std::fs::set_permissions(&staging, meta.permissions());
        }
        Ok(StagedDir {
            target: target.to_path_buf(),
            staging,
            committed: false,
            replaces,
        })
    }

    /// Where the files go until [`StagedDir::commit`].
    pub fn path(&self) -> &Path {
        &self.staging
    }

    /// The directory the output ends in.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Renames the staged directory into place (over the empty target, if one was there).
    ///
    /// # Errors
    /// Bad input naming the target when the rename fails (the target filled meanwhile, or
    /// another file system).
    pub fn commit(mut self) -> Result<PathBuf> {
        let _ = std::fs::remove_dir(&self.target);
        // A regenerated target is moved aside, whole, and removed once the new one is in.
        let aside = PathBuf::from(self.staging.to_string_lossy().replace(".partial-", ".old-"));
        let moved =
            self.replaces && self.target.exists() && std::fs::rename(&self.target, &aside).is_ok();
        let placed = std::fs::rename(&self.staging, &self.target);
        if let Err(e) = placed {
            if moved {
                let _ = std::fs::rename(&aside, &self.target);
            }
            return Err(StageError::Input(format!(
                "{}: cannot move the output into place: {e}",
                self.target.display()
            )));
        }
        if moved {
            let _ = std::fs::remove_dir_all(&aside);
        }
        self.committed = true;
        Ok(self.target.clone())
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.staging);
        }
    }
}

/// Whether `name` is one plain file name, to be joined under a directory without leaving it:
/// not empty, `.` or `..`, and without a separator or NUL (a manifest's shard, a run's id).
pub fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
        && Path::new(name).components().count() == 1
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn an_output_directory_is_held_by_one_command_at_a_time_and_left_without_a_lock_file() {
        let dir = std::env::temp_dir().join(format!("pipe-held-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = hold_output_dir(&dir, "--out").unwrap();
        assert!(first.is_some(), "tmp takes a lock on a directory");
        let e = hold_output_dir(&dir, "--out").unwrap_err();
        assert!(e.is_bad_input(), "{e}");
        assert!(
            e.to_string().contains("another command is writing there"),
            "{e}"
        );
        drop(first);
        drop(hold_output_dir(&dir, "--out").unwrap());
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "no lock file is left"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_output_over_an_input_or_a_checkpoint_is_refused_and_one_beside_them_is_not() {
        let root = std::env::temp_dir().join(format!("pipe-apart-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (corpus, ck) = (root.join("corpus"), root.join("ck"));
        std::fs::create_dir_all(&corpus).unwrap();
        std::fs::create_dir_all(ck.join("ckpt-00000001")).unwrap();
        let config = root.join("c.toml");
        for f in [&config, &corpus.join("shard-0.tok"), &ck.join("latest")] {
            std::fs::write(f, b"x").unwrap();
        }
        std::fs::write(ck.join("ckpt-00000001").join("state.json"), b"{}").unwrap();
        std::fs::write(ck.join("mine.jsonl"), b"").unwrap();
        let link = root.join("link");
        std::os::unix::fs::symlink(&config, &link).unwrap();
        let inputs = [
            Input::Whole("--config", &config),
            Input::Whole("--dataset", &corpus),
            Input::Entries("--checkpoint-dir", &ck, |name| {
                name == "latest" || name.to_string_lossy().starts_with("ckpt-")
            }),
        ];
        let refused = |out: &Path| {
            let e = check_not_input(out, "--log-jsonl", &inputs).unwrap_err();
            assert!(e.is_bad_input(), "{e}");
            e.to_string()
        };
        assert!(refused(&config).contains("which --config"));
        assert!(refused(&link).contains("which --config"));
        assert!(refused(&corpus.join("shard-0.tok")).contains("which --dataset"));
        assert!(refused(&ck.join("latest")).contains("which --checkpoint-dir"));
        assert!(refused(&ck.join("ckpt-00000001/state.json")).contains("--checkpoint-dir"));
        // The store's names before they are made: its next checkpoint's.
        assert!(refused(&ck.join("ckpt-00000002")).contains("--checkpoint-dir"));
        // A user's file beside the checkpoints, a new file, and one elsewhere are not inputs.
        for fine in [
            ck.join("mine.jsonl"),
            corpus.join("new.jsonl"),
            root.join("log"),
        ] {
            check_not_input(&fine, "--log-jsonl", &inputs).unwrap();
        }
        // The same file reached another way: a shard kept outside its corpus through a link
        // in it, a checkpoint's file likewise, and a hard link to the config.
        let outside = root.join("elsewhere");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("s1.tok"), b"x").unwrap();
        std::os::unix::fs::symlink(outside.join("s1.tok"), corpus.join("shard-1.tok")).unwrap();
        std::fs::write(outside.join("state.json"), b"{}").unwrap();
        let linked_state = ck.join("ckpt-00000001").join("linked.json");
        std::os::unix::fs::symlink(outside.join("state.json"), &linked_state).unwrap();
        std::fs::hard_link(&config, root.join("hard")).unwrap();
        assert!(refused(&outside.join("s1.tok")).contains("--dataset"));
        assert!(refused(&outside.join("state.json")).contains("--checkpoint-dir"));
        assert!(refused(&root.join("hard")).contains("--config"));
        // A file outside every input that no input links to stays fine.
        std::fs::write(outside.join("free.jsonl"), b"").unwrap();
        check_not_input(&outside.join("free.jsonl"), "--log-jsonl", &inputs).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_file_output_where_the_checkpoint_directory_goes_is_refused() {
        let root = std::env::temp_dir().join(format!("pipe-clash-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let refused = |file: &Path, dir: &Path| {
            let e =
                check_file_not_over_dir(file, "--log-jsonl", dir, "--checkpoint-dir").unwrap_err();
            assert!(e.is_bad_input() && e.to_string().contains("clash"), "{e}");
        };
        // Neither exists yet: the same path, and the directory under the file.
        refused(&root.join("ck"), &root.join("ck"));
        refused(&root.join("lj"), &root.join("lj/ck"));
        refused(&root.join("lj"), &root.join("./lj/deeper/ck"));
        // A log beside the checkpoints, or inside the checkpoint directory, is fine.
        check_file_not_over_dir(&root.join("log"), "--log-jsonl", &root.join("ck"), "--c").unwrap();
        check_file_not_over_dir(&root.join("ck/log"), "--log-jsonl", &root.join("ck"), "--c")
            .unwrap();
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_regenerated_directory_is_replaced_whole_or_left_as_it_was() {
        let root = std::env::temp_dir().join(format!("pipe-regen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let plots = root.join("plots");
        std::fs::create_dir_all(&plots).unwrap();
        std::fs::write(plots.join("a.svg"), b"old a").unwrap();
        std::fs::write(plots.join("b.svg"), b"old b").unwrap();
        // A writer that fails after its first chart: every old file as it was.
        let staged = StagedDir::regenerating(&plots, is_plot).unwrap();
        std::fs::write(staged.path().join("a.svg"), b"new a").unwrap();
        drop(staged);
        assert_eq!(std::fs::read(plots.join("a.svg")).unwrap(), b"old a");
        assert_eq!(std::fs::read(plots.join("b.svg")).unwrap(), b"old b");
        // One that finishes: only what it wrote, and nothing left beside the directory.
        let staged = StagedDir::regenerating(&plots, is_plot).unwrap();
        std::fs::write(staged.path().join("a.svg"), b"new a").unwrap();
        staged.commit().unwrap();
        assert_eq!(std::fs::read(plots.join("a.svg")).unwrap(), b"new a");
        assert!(!plots.join("b.svg").exists());
        let left: Vec<_> = std::fs::read_dir(&root).unwrap().flatten().collect();
        assert_eq!(left.len(), 1, "{left:?}");
        // A file of the user's, a directory or a link in it, or the directory a link: refused,
        // and nothing removed.
        std::fs::write(plots.join("notes.txt"), b"mine").unwrap();
        let e = StagedDir::regenerating(&plots, is_plot).unwrap_err();
        assert!(
            e.is_bad_input()
                && e.to_string()
                    .contains("notes.txt is not a file the command writes"),
            "{e}"
        );
        std::fs::remove_file(plots.join("notes.txt")).unwrap();
        // A file where the directory goes: named as what it is, not as a flag the command
        // never took.
        let file = root.join("plots-file");
        std::fs::write(&file, b"mine").unwrap();
        let e = StagedDir::regenerating(&file, is_plot)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("regenerated directory")
                && e.contains("not a directory")
                && !e.contains("--out"),
            "{e}"
        );
        std::fs::remove_file(&file).unwrap();
        std::fs::create_dir(plots.join("sub.svg")).unwrap();
        assert!(StagedDir::regenerating(&plots, is_plot).is_err());
        std::fs::remove_dir(plots.join("sub.svg")).unwrap();
        let elsewhere = root.join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        let linked = root.join("linked");
        std::os::unix::fs::symlink(&elsewhere, &linked).unwrap();
        let e = StagedDir::regenerating(&linked, is_plot).unwrap_err();
        assert!(e.to_string().contains("is a symbolic link"), "{e}");
        assert_eq!(std::fs::read(plots.join("a.svg")).unwrap(), b"new a");
        std::fs::remove_dir_all(&root).unwrap();
    }

    fn is_plot(name: &std::ffi::OsStr) -> bool {
        name.to_str()
            .is_some_and(|n| n.ends_with(".svg") || n.ends_with(".csv"))
    }

    #[test]
    fn an_owned_file_is_never_written_through_a_link_and_a_linked_out_dir_stands_for_its_directory()
    {
        let root = std::env::temp_dir().join(format!("pipe-owned-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (dir, victim) = (root.join("results"), root.join("keep.txt"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&victim, b"precious").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("REPORT.md")).unwrap();
        let e = write_owned_file(&dir, "REPORT.md", b"report").unwrap_err();
        assert!(
            e.is_bad_input() && e.to_string().contains("symbolic link"),
            "{e}"
        );
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        std::fs::remove_file(dir.join("REPORT.md")).unwrap();
        write_owned_file(&dir, "REPORT.md", b"report").unwrap();
        // An --out that links to an empty directory: the output lands in that directory.
        let (real, link) = (root.join("real"), root.join("out"));
        std::fs::create_dir(&real).unwrap();
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let staged = StagedDir::claim_empty(&link, "write").unwrap();
        std::fs::write(staged.path().join("a"), b"1").unwrap();
        staged.commit().unwrap();
        assert_eq!(std::fs::read(link.join("a")).unwrap(), b"1");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_staged_directory_appears_whole_or_not_at_all() {
        let root = std::env::temp_dir().join(format!("pipe-outputs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let out = root.join("out");
        // Dropped before committing: nothing is left, not even the staging directory.
        let staged = StagedDir::claim_empty(&out, "write").unwrap();
        std::fs::write(staged.path().join("a"), b"1").unwrap();
        drop(staged);
        assert!(!out.exists());
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0);
        // Committed over an empty directory.
        std::fs::create_dir(&out).unwrap();
        let staged = StagedDir::claim_empty(&out, "write").unwrap();
        std::fs::write(staged.path().join("a"), b"1").unwrap();
        assert_eq!(staged.commit().unwrap(), out);
        assert_eq!(std::fs::read(out.join("a")).unwrap(), b"1");
        // A directory that holds files is refused, and kept as it was.
        let e = StagedDir::claim_empty(&out, "write")
            .unwrap_err()
            .to_string();
        assert!(e.contains("already holds files (a, ...)"), "{e}");
        assert_eq!(std::fs::read(out.join("a")).unwrap(), b"1");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
