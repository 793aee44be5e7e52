//! Safetensors files of `f32` tensors, streamed to disk from the tensors themselves.
//!
//! A checkpoint or an export used to turn every tensor into little-endian bytes (one copy of
//! the model) and then the whole file into one buffer (a second) before writing it: a drain
//! point's checkpoint of a 4 M-parameter model held about 70 MB more on the chief for as long
//! as it was written, and a GPT-2 124M's optimizer file would hold 2 GB more. Here each
//! tensor is a [`View`] onto its own values, which on a little-endian machine are already the
//! file's bytes, and `safetensors` writes the header and then each tensor in turn through a
//! 1 MiB buffer into a temporary file beside the target, which it renames over the target.
//! The bytes are those `safetensors::tensor::serialize` gives for the same tensors.

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Read as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

use pipe_kernels::Tensor;
use safetensors::tensor::{Dtype, SafeTensorError, View};
use sha2::{Digest, Sha256};

/// One `f32` tensor as a safetensors [`View`] of its host values.
struct F32View<'a> {
    shape: &'a [usize],
    values: &'a [f32],
}

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        if cfg!(target_endian = "little") {
            Cow::Borrowed(bytemuck::cast_slice(self.values))
        } else {
            Cow::Owned(self.values.iter().flat_map(|v| v.to_le_bytes()).collect())
        }
    }

    fn data_len(&self) -> usize {
        std::mem::size_of_val(self.values)
    }
}

/// Why a file could not be written: a tensor not on the host, or the write itself.
#[derive(Debug, thiserror::Error)]
pub enum TensorFileError {
    /// A tensor whose values are not in host memory.
    #[error("tensor {0} is not on the host")]
    NotOnHost(String),
    /// The header or a write failed.
    #[error("{0}")]
    Write(#[from] SafeTensorError),
    /// Setting the file's permissions, or reading it back for its digest, failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Writes `entries` (name, tensor) to `path` as one safetensors file with `metadata`, each
/// tensor streamed from its own values; `path` is replaced whole or left as it was. The
/// tensors are ordered by name in the file, as `safetensors` orders them. The file takes its
/// directory's read and write bits (the temporary file it is written as is the owner's
/// alone): in a directory a run made, what creating the file would have given under the
/// process's umask.
///
/// # Errors
/// [`TensorFileError`]: a tensor not on the host, or the file could not be written.
pub fn write(
    path: &Path,
    entries: &[(String, &Tensor)],
    metadata: HashMap<String, String>,
) -> Result<(), TensorFileError> {
    let views = entries
        .iter()
        .map(|(name, t)| {
            let values = t
                .host()
                .map_err(|_| TensorFileError::NotOnHost(name.clone()))?;
            Ok((
                name.as_str(),
                F32View {
                    shape: t.shape(),
                    values,
                },
            ))
        })
        .collect::<Result<Vec<_>, TensorFileError>>()?;
    safetensors::tensor::serialize_to_file(views, Some(metadata), path)?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let dir_mode = std::fs::metadata(dir.unwrap_or(Path::new(".")))?
        .permissions()
        .mode();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(dir_mode & 0o666))?;
    Ok(())
}

/// The size and SHA-256 (lowercase hex) of the file at `path`, read in 1 MiB pieces, after
/// asking the operating system to make it durable (fsync).
///
/// # Errors
/// The file cannot be opened, read or synced.
pub fn sync_and_digest(path: &Path) -> std::io::Result<(u64, String)> {
    let mut file = std::fs::File::open(path)?;
    file.sync_all()?;
    let mut hasher = Sha256::new();
    let mut piece = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut piece)?;
        if n == 0 {
            break;
        }
        hasher.update(&piece[..n]);
        bytes += n as u64;
    }
    Ok((bytes, hex(&hasher.finalize())))
}

/// A digest as lowercase hex, as a checkpoint's manifest records it.
pub fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(shape: &[usize], seed: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let values = (0..n).map(|i| seed + i as f32 * 0.25 - 3.0).collect();
        Tensor::from_vec(shape, values).unwrap()
    }

    #[test]
    fn streamed_bytes_equal_the_serialized_file() {
        let (a, b, c) = (
            tensor(&[3, 5], 1.5),
            tensor(&[7], -2.0),
            tensor(&[2, 2, 2], 9.0),
        );
        let entries = vec![
            ("z.weight".to_string(), &a),
            ("a.bias".to_string(), &b),
            ("m.first".to_string(), &c),
        ];
        let meta: HashMap<String, String> = [("format".to_string(), "pipe".to_string())].into();
        let dir = std::env::temp_dir().join(format!("pipe-tensor-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        std::fs::write(&path, b"an older file").unwrap();
        write(&path, &entries, meta.clone()).unwrap();
        let streamed = std::fs::read(&path).unwrap();

        let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = entries
            .iter()
            .map(|(n, t)| {
                let b = t.host().unwrap().iter().flat_map(|v| v.to_le_bytes());
                (n.clone(), b.collect(), t.shape().to_vec())
            })
            .collect();
        let views = bytes.iter().map(|(n, b, s)| {
            let v = safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b).unwrap();
            (n.clone(), v)
        });
        let whole = safetensors::tensor::serialize(views, Some(meta)).unwrap();
        assert_eq!(streamed, whole);

        let (len, digest) = sync_and_digest(&path).unwrap();
        assert_eq!(len, whole.len() as u64);
        assert_eq!(digest, hex(&Sha256::digest(&whole)));
        // The directory's read and write bits, and nothing but the file itself beside it.
        let dir_mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, dir_mode & 0o666);
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(names.len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
