//! The one way a file that a user or another file names is opened and read: only a regular
//! file (a FIFO, device or socket would block or never end), and never more than a bound
//! the caller states for that kind of file. It lives in the lowest crate because every crate
//! that reads such files (transport's cluster files and certificates, stages' configs, plans,
//! checkpoints and shards, the experiments' results) sits above it; each maps
//! [`ReadError`] into its own error type with the file's kind in the words.

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
    use std::os::unix::fs::{FileTypeExt as _, OpenOptionsExt as _};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if kind.is_file() {
        return Ok(file);
    }
    let what = if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "a device"
    };
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("{what}, not a regular file"),
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

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
}
