//! Tokenizing a corpus into shards (`pipe tokenize`): input files streamed in blocks, cut
//! where cutting changes no id, encoded in parallel, and written in order by
//! [`ShardWriter`].
//!
//! Each input file is one document. Files are read in path order, in blocks of
//! [`BLOCK_BYTES`]; a block ends at the last safe cut in it ([`is_safe_cut`]: after a line
//! break between two non-space characters, which no byte-level BPE pre-tokenizer joins
//! across; anywhere for `bytes` and `chars`), and is cut again into pieces of about
//! [`PIECE_BYTES`]. Pieces from several blocks and files are encoded together on every core
//! (rayon), then pushed in order, so the ids are those of tokenizing each file whole and the
//! memory held is a few blocks, whatever the corpus's size.

use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::data::Vocab;
use crate::error::{Result, StageError};
use crate::shards::ShardWriter;
use crate::tokenizer::{TextTokenizer, is_safe_cut};

/// Bytes read from a file at a time.
pub const BLOCK_BYTES: usize = 8 << 20;

/// Bytes of text one encoding call takes, about.
pub const PIECE_BYTES: usize = 256 << 10;

/// Bytes gathered before they are encoded together.
const BATCH_BYTES: usize = 32 << 20;

/// Longest stretch of text with no safe cut accepted for a `tokenizer.json` (it is encoded
/// whole, so it must fit in memory with room to spare).
pub const MAX_UNCUT_BYTES: usize = 256 << 20;

fn data_err(name: impl std::fmt::Display, reason: impl Into<String>) -> StageError {
    StageError::Data {
        source_name: name.to_string(),
        reason: reason.into(),
    }
}

/// The files under `input` (itself, when it is a file), in path order, with their sizes.
/// Hidden files and directories (names starting with `.`) are skipped.
///
/// # Errors
/// [`StageError::Data`] for a missing input, an unreadable directory, or one with no file.
pub fn input_files(input: &Path) -> Result<Vec<(PathBuf, u64)>> {
    let meta = std::fs::metadata(input)
        .map_err(|e| data_err(input.display(), format!("cannot read: {e}")))?;
    if meta.is_file() {
        return Ok(vec![(input.to_path_buf(), meta.len())]);
    }
    if !meta.is_dir() {
        return Err(data_err(
            input.display(),
            "is not a regular file or a directory (a FIFO, socket or device): give text files",
        ));
    }
    let mut out = Vec::new();
    let mut dirs = vec![input.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| data_err(dir.display(), format!("cannot read: {e}")))?;
        for entry in entries {
            let entry = entry.map_err(|e| data_err(dir.display(), format!("cannot read: {e}")))?;
            if entry.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            let path = entry.path();
            let meta = std::fs::metadata(&path)
                .map_err(|e| data_err(path.display(), format!("cannot read: {e}")))?;
            if meta.is_dir() {
                dirs.push(path);
            } else if meta.is_file() {
                out.push((path, meta.len()));
            } else {
                // A FIFO or a device would block or never end; skipping it would lose a
                // document without a word.
                return Err(data_err(
                    path.display(),
                    "is not a regular file (a FIFO, socket or device): move it out of the input",
                ));
            }
        }
    }
    if out.is_empty() {
        return Err(data_err(input.display(), "holds no file to tokenize"));
    }
    out.sort();
    Ok(out)
}

/// A file read as UTF-8 text in blocks that end at safe cuts.
struct TextBlocks {
    file: std::fs::File,
    name: String,
    /// Bytes read and not yet handed out.
    carry: Vec<u8>,
    /// Bytes of the file handed out so far.
    offset: u64,
    eof: bool,
    cut_anywhere: bool,
}

impl TextBlocks {
    fn open(path: &Path, cut_anywhere: bool) -> Result<Self> {
        let name = path.display().to_string();
        let file = crate::limits::open_regular(path)
            .map_err(|e| data_err(&name, format!("cannot read: {e}")))?;
        Ok(Self {
            file,
            name,
            carry: Vec::new(),
            offset: 0,
            eof: false,
            cut_anywhere,
        })
    }

    /// The next block of text, ending at a safe cut (or at the file's end), with the byte
    /// offset it starts at; `None` at the end.
    fn next_block(&mut self) -> Result<Option<(String, u64)>> {
        loop {
            if !self.eof {
                let have = self.carry.len();
                self.carry.resize(have + BLOCK_BYTES, 0);
                let n = crate::shards::read_up_to(&self.file, &mut self.carry[have..])
                    .map_err(|e| data_err(&self.name, format!("cannot read: {e}")))?;
                self.carry.truncate(have + n);
                self.eof = n < BLOCK_BYTES;
            }
            if self.carry.is_empty() {
                return Ok(None);
            }
            let valid = match std::str::from_utf8(&self.carry) {
                Ok(text) => text.len(),
                Err(e) if e.error_len().is_none() && !self.eof => e.valid_up_to(),
                Err(e) => {
                    return Err(data_err(
                        &self.name,
                        format!(
                            "not UTF-8 text: invalid byte at byte {}",
                            self.offset + e.valid_up_to() as u64
                        ),
                    ));
                }
            };
            let text = std::str::from_utf8(&self.carry[..valid]).unwrap_or_default();
            let cut = if self.eof && valid == self.carry.len() {
                Some(valid)
            } else {
                self.last_cut(text)
            };
            match cut {
                Some(at) if at > 0 => {
                    let block = String::from_utf8_lossy(&self.carry[..at]).into_owned();
                    self.carry.drain(..at);
                    let start = self.offset;
                    self.offset += at as u64;
                    return Ok(Some((block, start)));
                }
                _ if self.eof => {
                    return Err(data_err(
                        &self.name,
                        format!(
                            "not UTF-8 text: it ends inside a character at byte {}",
                            self.offset + valid as u64
                        ),
                    ));
                }
                _ if self.carry.len() > MAX_UNCUT_BYTES => {
                    return Err(data_err(
                        &self.name,
                        format!(
                            "no line break to cut at in the {MAX_UNCUT_BYTES} bytes from byte {} \
                             (a tokenizer.json's text is cut only between lines)",
                            self.offset
                        ),
                    ));
                }
                _ => {} // read more
            }
        }
    }

    /// The last safe cut in `text`.
    fn last_cut(&self, text: &str) -> Option<usize> {
        if self.cut_anywhere {
            return Some(text.len());
        }
        let mut end = text.len();
        while let Some(nl) = text[..end].rfind('\n') {
            if is_safe_cut(text, nl + 1) {
                return Some(nl + 1);
            }
            end = nl;
        }
        None
    }
}

/// Pieces of `text` of about [`PIECE_BYTES`] that may be encoded apart.
fn pieces(text: &str, cut_anywhere: bool) -> Vec<&str> {
    if !cut_anywhere {
        return crate::tokenizer::split_at_safe_cuts(text, PIECE_BYTES);
    }
    let mut out = Vec::new();
    let mut start = 0;
    while text.len() - start > PIECE_BYTES {
        let mut at = start + PIECE_BYTES;
        while !text.is_char_boundary(at) {
            at += 1;
        }
        out.push(&text[start..at]);
        start = at;
    }
    out.push(&text[start..]);
    out
}

/// Text waiting to be encoded: pieces with where they come from, and whether each ends its
/// document.
#[derive(Default)]
struct Batch {
    pieces: Vec<(String, String, bool)>,
    bytes: usize,
}

impl Batch {
    /// Encodes every piece on all cores and pushes the ids to `writer` in order.
    fn flush(&mut self, tokenizer: &TextTokenizer, writer: &mut ShardWriter) -> Result<()> {
        let encoded: Vec<Result<Vec<u32>>> = self
            .pieces
            .par_iter()
            .map(|(text, name, _)| tokenizer.encode(text, name))
            .collect();
        for (ids, (_, _, ends)) in encoded.into_iter().zip(&self.pieces) {
            writer.push(&ids?)?;
            if *ends {
                writer.end_document()?;
            }
        }
        self.pieces.clear();
        self.bytes = 0;
        Ok(())
    }
}

/// Tokenizes `files` in order into `writer`, one document per file; `progress` hears the
/// input bytes done so far.
///
/// # Errors
/// [`StageError::Data`] for an unreadable file or one that is not UTF-8 text (naming the
/// byte), a character a `chars` vocabulary lacks, or a shard that cannot be written.
pub fn tokenize_files(
    files: &[(PathBuf, u64)],
    tokenizer: &TextTokenizer,
    writer: &mut ShardWriter,
    progress: &dyn Fn(u64),
) -> Result<()> {
    let cut_anywhere = tokenizer.cuts_anywhere();
    let mut batch = Batch::default();
    let mut done = 0u64;
    for (path, _) in files {
        let mut blocks = TextBlocks::open(path, cut_anywhere)?;
        let mut pending: Option<(String, u64)> = blocks.next_block()?;
        if pending.is_none() {
            // An empty file is still a document.
            batch
                .pieces
                .push((String::new(), blocks.name.clone(), true));
        }
        while let Some((block, start)) = pending.take() {
            pending = blocks.next_block()?;
            let last = pending.is_none();
            let parts = pieces(&block, cut_anywhere);
            let n = parts.len();
            let mut at = start;
            for (i, p) in parts.into_iter().enumerate() {
                let name = format!("{} (from byte {at})", blocks.name);
                at += p.len() as u64;
                batch.pieces.push((p.to_string(), name, last && i + 1 == n));
            }
            batch.bytes += block.len();
            done += block.len() as u64;
            if batch.bytes >= BATCH_BYTES {
                batch.flush(tokenizer, writer)?;
                progress(done);
            }
        }
    }
    batch.flush(tokenizer, writer)?;
    progress(done);
    Ok(())
}

/// The character vocabulary of `files` (every distinct character, in order), read in
/// blocks; `progress` hears the bytes read so far.
///
/// # Errors
/// As [`tokenize_files`].
pub fn char_vocab(files: &[(PathBuf, u64)], progress: &dyn Fn(u64)) -> Result<Vocab> {
    let mut set = std::collections::BTreeSet::new();
    let mut done = 0;
    for (path, _) in files {
        let mut blocks = TextBlocks::open(path, true)?;
        while let Some((block, _)) = blocks.next_block()? {
            set.extend(block.chars());
            done += block.len() as u64;
            progress(done);
        }
    }
    Ok(Vocab {
        chars: set.into_iter().collect(),
    })
}
