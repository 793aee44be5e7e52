//! The one way a file that a user or another file names is opened and read: only a regular
//! file (a FIFO, device or socket would block or never end), and never more than a bound
//! the caller states for that kind of file. It lives in the lowest crate because every crate
//! that reads such files (transport's cluster files and certificates, stages' configs, plans,
//! checkpoints and shards, the experiments' results) sits above it; each maps
//! [`ReadError`] into its own error type with the file's kind in the words.
//!
//! Its counterpart for outputs, [`write_replacing`], is the one way a command writes a file
//! the user named (`-o`, `--costs-out`, a trace): whole or not at all, and never over
//! something that is not a regular file.

use std::io::Read as _;
use std::path::Path;

/// Why a bounded read failed.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The file could not be opened or read, or is not a regular file.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The file holds more than the bound.
    #[error("larger than the limit of {max} bytes")]
    Long {
        /// The bound, in bytes.
        max: u64,
    },
}

/// Opens `path` for reading if it is a regular file (after symbolic links). The open does not
/// wait (`O_NONBLOCK`, which a regular file ignores), so a FIFO with no writer is refused
/// instead of hanging.
///
/// # Errors
/// The open's error, or [`std::io::ErrorKind::InvalidInput`] naming what the path is instead.
pub fn open_regular(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if kind.is_file() {
        return Ok(file);
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("{}, not a regular file", kind_words(kind)),
    ))
}

/// Opens the regular file `path` and checks its size against `max` before anything is read.
///
/// # Errors
/// As [`open_regular`], or [`ReadError::Long`] for a larger file.
pub fn open_bounded(path: &Path, max: u64) -> Result<(std::fs::File, u64), ReadError> {
    let file = open_regular(path)?;
    let len = file.metadata()?.len();
    if len > max {
        return Err(ReadError::Long { max });
    }
    Ok((file, len))
}

/// All of the regular file `path`, which may hold at most `max` bytes: its size is checked
/// before it is read, and the read stops one byte past the bound should the file grow.
///
/// # Errors
/// As [`open_bounded`].
pub fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, ReadError> {
    let (file, len) = open_bounded(path, max)?;
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(max.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(ReadError::Long { max });
    }
    Ok(bytes)
}

/// The name a temporary file beside `name` starts with: `name` itself, or, where the
/// temporary's name would pass the 255 bytes a file name may have (a legal name of 230
/// bytes and more), its first 160 bytes and a hash of the whole. Every temporary file or
/// directory put beside an output (`.NAME.partial-PID`, `.NAME.tmp-PID`) is named from it.
pub fn temporary_stem(name: &str) -> String {
    const KEEP: usize = 160;
    if name.len() <= KEEP {
        return name.to_string();
    }
    let mut cut = KEEP;
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    // FNV-1a: a stable hash, so two long names that share their first 160 bytes differ.
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{}-{hash:016x}", &name[..cut])
}

/// Writes `bytes` as the file `path`: into a new temporary file beside it, synced, then
/// renamed over it, so that a reader sees the old file or the new one whole, never a part,
/// and a write that fails (a full disk) leaves the old one as it was. `path` may be missing
/// or a regular file; a symbolic link is followed, and the file it names is replaced. Anything
/// else (a directory, FIFO, device or socket) is refused before a byte is written: renaming
/// over it would replace it, and writing into it could block or never end.
///
/// # Errors
/// [`std::io::ErrorKind::InvalidInput`] naming what `path` is instead of a regular file, or
/// the error of creating, writing, syncing or renaming the temporary file (which is removed).
pub fn write_replacing(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let target = output_target(path)?;
    let name = target
        .file_name()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name"))?;
    let temporary = target.with_file_name(format!(
        ".{}.partial-{}",
        temporary_stem(&name.to_string_lossy()),
        std::process::id()
    ));
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temporary)
            .map_err(|e| uncreatable(&temporary, e))?;
        // What replaces a file keeps its permissions.
        if let Ok(meta) = std::fs::metadata(&target) {
            file.set_permissions(meta.permissions())?;
        }
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&temporary, &target)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    written
}

/// The file [`write_replacing`] would replace for `path`: `path` itself when it is missing,
/// the file a symbolic link names, or `path` when it is a regular file. A command checks its
/// outputs with it before its work, so that a bad one is refused before the work is lost.
///
/// # Errors
/// [`std::io::ErrorKind::InvalidInput`] for a path that is not a regular file, or the error of
/// resolving it.
pub fn output_target(path: &Path) -> std::io::Result<std::path::PathBuf> {
    // An empty path or one ending in `..` names no file to write.
    if path.file_name().is_none() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a file name",
        ));
    }
    match std::fs::canonicalize(path) {
        Ok(real) => {
            let kind = std::fs::metadata(&real)?.file_type();
            if !kind.is_file() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{}, not a regular file", kind_words(kind)),
                ));
            }
            // It is replaced by a file written beside it.
            writable_parent(&real)?;
            Ok(real)
        }
        // Missing, or under a file (which the parent's check names).
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
            ) =>
        {
            writable_parent(path)?;
            Ok(path.to_path_buf())
        }
        Err(e) => Err(e),
    }
}

/// The directory `path` lies in: its parent, or `.` for a bare name (whose parent is empty)
/// and for `/`.
pub fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Checks that the directory a missing file `path` would be created in exists and can be
/// written, so that a bad output path is refused before the work that fills it.
///
/// # Errors
/// [`std::io::ErrorKind::InvalidInput`] saying what is wrong with the directory.
fn writable_parent(path: &Path) -> std::io::Result<()> {
    let parent = parent_dir(path);
    let refused = |why: String| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("its directory {} {why}", parent.display()),
        )
    };
    match std::fs::metadata(parent) {
        Ok(meta) if meta.is_dir() => writable_dir(parent).map_err(refused),
        Ok(_) => Err(refused("is not a directory".into())),
        Err(e) => Err(refused(format!("cannot be used: {e}"))),
    }
}

/// Checks that files can be made in the existing directory `dir`: not in procfs or sysfs,
/// and writable by this process.
///
/// # Errors
/// What is wrong, in words that follow the directory's name (`cannot be written: ...`).
pub fn writable_dir(dir: &Path) -> Result<(), String> {
    if is_kernel_view(dir) {
        return Err("is in /proc or /sys, the kernel's view, where no file can be made".into());
    }
    rustix::fs::access(dir, rustix::fs::Access::WRITE_OK)
        .map_err(|e| format!("cannot be written: {e}"))
}

/// Whether `dir` is on procfs or sysfs, where `access` grants root a write that creating a
/// file then refuses.
fn is_kernel_view(dir: &Path) -> bool {
    const SYSFS_MAGIC: u64 = 0x6265_6572;
    rustix::fs::statfs(dir).is_ok_and(|fs| {
        // The word's width differs between targets; the magic numbers fit in 32 bits.
        let kind = fs.f_type as u64;
        kind == rustix::fs::PROC_SUPER_MAGIC as u64 || kind == SYSFS_MAGIC
    })
}

/// The error of creating a file at `path` as bad input where the directory refuses a new file
/// (no permission, a read-only file system, gone meanwhile): the path given cannot be
/// written, which the user changes; other failures (no space, too many open files) stand.
fn uncreatable(path: &Path, e: std::io::Error) -> std::io::Error {
    use std::io::ErrorKind::{NotFound, PermissionDenied, ReadOnlyFilesystem};
    if matches!(e.kind(), NotFound | PermissionDenied | ReadOnlyFilesystem) {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "cannot create a file in {}: {e}",
                parent_dir(path).display()
            ),
        )
    } else {
        e
    }
}

/// What a file of `kind` is, in words.
fn kind_words(kind: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt as _;
    if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "a device"
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_kernels_views_are_refused_before_anything_is_written() {
        for path in [
            "/proc/self/status",
            "/proc/pipe.txt",
            "/sys/kernel/pipe.txt",
        ] {
            let e = output_target(Path::new(path)).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{path}: {e}");
            assert!(e.to_string().contains("in /proc or /sys"), "{path}: {e}");
        }
        assert!(!is_kernel_view(&std::env::temp_dir()));
    }

    #[test]
    fn a_directory_that_refuses_a_new_file_is_bad_input_and_a_full_disk_is_not() {
        let gone = std::io::Error::from(std::io::ErrorKind::NotFound);
        let e = uncreatable(Path::new("/gone/.f.partial-1"), gone);
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        assert!(
            e.to_string().starts_with("cannot create a file in /gone: "),
            "{e}"
        );
        let full = std::io::Error::from(std::io::ErrorKind::StorageFull);
        assert_eq!(
            uncreatable(Path::new("/f"), full).kind(),
            std::io::ErrorKind::StorageFull
        );
    }

    #[test]
    fn a_file_whose_name_is_as_long_as_a_name_may_be_is_written() {
        let dir = std::env::temp_dir().join(format!("pipe-long-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // 255 bytes, in two-byte characters past the temporary's cut.
        let name = format!("{}{}", "m".repeat(155), "é".repeat(50));
        assert_eq!(name.len(), 255);
        let path = dir.join(&name);
        write_replacing(&path, b"one").unwrap();
        write_replacing(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "no temporary left"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_new_output_needs_a_directory_it_can_be_written_in() {
        let dir = std::env::temp_dir().join(format!("pipe-parent-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("file");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(output_target(&dir.join("new")).unwrap(), dir.join("new"));
        for (path, words) in [
            (dir.join("missing/new"), "cannot be used"),
            (file.join("new"), "is not a directory"),
        ] {
            let e = output_target(&path).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
            assert!(e.to_string().contains(words), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_fifo_a_directory_and_a_long_file_are_refused_without_reading() {
        let dir = std::env::temp_dir().join(format!("pipe-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let _ = std::fs::remove_file(&fifo);
        rustix::fs::mkfifoat(rustix::fs::CWD, &fifo, rustix::fs::Mode::RUSR).unwrap();
        let e = read_bounded(&fifo, 10).unwrap_err().to_string();
        assert!(e.contains("a FIFO, not a regular file"), "{e}");
        let e = read_bounded(&dir, 10).unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
        let long = dir.join("long");
        std::fs::File::create(&long)
            .unwrap()
            .set_len(1 << 40)
            .unwrap();
        let e = read_bounded(&long, 10).unwrap_err();
        assert!(matches!(e, ReadError::Long { max: 10 }), "{e}");
        std::fs::write(&long, b"0123456789").unwrap();
        assert_eq!(read_bounded(&long, 10).unwrap(), b"0123456789");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_output_is_replaced_whole_through_a_link_and_never_over_a_fifo() {
        let dir = std::env::temp_dir().join(format!("pipe-write-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("out.json");
        write_replacing(&out, b"first").unwrap();
        write_replacing(&out, b"second").unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"second");
        let link = dir.join("link.json");
        std::os::unix::fs::symlink(&out, &link).unwrap();
        write_replacing(&link, b"third").unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
        assert_eq!(std::fs::read(&out).unwrap(), b"third");
        let fifo = dir.join("fifo");
        rustix::fs::mkfifoat(rustix::fs::CWD, &fifo, rustix::fs::Mode::RUSR).unwrap();
        let e = write_replacing(&fifo, b"x").unwrap_err().to_string();
        assert!(e.contains("a FIFO, not a regular file"), "{e}");
        let e = write_replacing(&dir, b"x").unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["fifo", "link.json", "out.json"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
