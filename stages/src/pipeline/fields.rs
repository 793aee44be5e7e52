//! Reading back the little-endian records workers send each other as control messages (an
//! epoch summary, a takeover's kept keys): one reader, so that every record fails the same
//! way on bytes a peer got wrong, with an error naming the record and never a panic or an
//! allocation a count in the bytes asked for.

use crate::error::{Result, StageError};

/// Reads little-endian fields off a peer's bytes, failing (never panicking) at the end.
pub struct Fields<'b> {
    bytes: &'b [u8],
    /// What the bytes are, for errors ("epoch summary").
    record: &'static str,
}

/// A peer's record that is not what the protocol allows: a transport protocol error, as a
/// malformed frame is.
fn malformed(record: &str, why: String) -> StageError {
    StageError::Transport(pipe_transport::TransportError::Protocol(format!(
        "a worker's {record} is malformed: {why}"
    )))
}

impl<'b> Fields<'b> {
    /// A reader of `bytes`, a `record` (named in errors).
    pub fn new(bytes: &'b [u8], record: &'static str) -> Self {
        Fields { bytes, record }
    }

    /// The bytes not yet read.
    pub fn rest(&self) -> &'b [u8] {
        self.bytes
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N]> {
        let (head, rest) = self
            .bytes
            .split_first_chunk::<N>()
            .ok_or_else(|| malformed(self.record, "it ends early".into()))?;
        self.bytes = rest;
        Ok(*head)
    }

    /// A `u8`.
    ///
    /// # Errors
    /// The bytes ended.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take::<1>()?[0])
    }

    /// A `u32`.
    ///
    /// # Errors
    /// The bytes ended.
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take()?))
    }

    /// A `u64`.
    ///
    /// # Errors
    /// The bytes ended.
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take()?))
    }

    /// A count, sent as a `u64`.
    ///
    /// # Errors
    /// The bytes ended, or the count is beyond this machine.
    pub fn usize(&mut self) -> Result<usize> {
        usize::try_from(self.u64()?)
            .map_err(|_| malformed(self.record, "a count beyond this machine".into()))
    }

    /// An `f64`.
    ///
    /// # Errors
    /// The bytes ended.
    pub fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_le_bytes(self.take()?))
    }

    /// A count (as `count` reads it), then that many records of `size` bytes, each read by
    /// `read`. A count beyond what is left is a lie, refused before any allocation (naming
    /// worker `from` and `what` the records are).
    ///
    /// # Errors
    /// Such a count; `read`'s.
    pub fn records<R>(
        &mut self,
        (from, what): (u32, &str),
        (size, count): (usize, fn(&mut Self) -> Result<usize>),
        mut read: impl FnMut(&mut Self) -> Result<R>,
    ) -> Result<Vec<R>> {
        let n = count(self)?;
        if n > self.bytes.len() / size.max(1) {
            return Err(malformed(
                self.record,
                format!(
                    "worker {from}'s claims {n} {what} in {} bytes",
                    self.bytes.len()
                ),
            ));
        }
        (0..n).map(|_| read(self)).collect()
    }

    /// Fails unless every byte was read.
    ///
    /// # Errors
    /// Bytes past the record's end.
    pub fn end(&self) -> Result<()> {
        match self.bytes.len() {
            0 => Ok(()),
            n => Err(malformed(self.record, format!("{n} bytes past its end"))),
        }
    }
}
