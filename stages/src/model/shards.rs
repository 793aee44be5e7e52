//! Token shards: a tokenized corpus on disk, written once by `pipe tokenize` and read by
//! training through memory maps, so a corpus larger than memory trains (only the windows a
//! run reads become resident).
//!
//! A corpus is a directory:
//! - `tokens.json`, the manifest ([`Manifest`]): the tokenizer (kind, fingerprint, vocabulary
//!   size, the file that rebuilds it), the id type, and the shards in order with their token
//!   counts;
//! - `shard-NNNNN.tok`, each a header and the ids: the 8 bytes `PIPETOK1`, the header's length
//!   as a little-endian `u32`, the header as JSON ([`ShardHeader`]: token count, id type,
//!   vocabulary size, tokenizer fingerprint) padded with spaces to a multiple of 8 bytes, then
//!   the ids as little-endian `u16` (vocabularies up to 65,536) or `u32`;
//! - the tokenizer's own file (`tokenizer.json` or `vocab.json`), so the corpus decodes alone.
//!
//! Each shard repeats what the manifest says of it, so a shard copied from another corpus,
//! cut short or written by another tokenizer is named when the corpus opens. Token ids are
//! checked against the vocabulary as windows are read (a full scan at every start would read
//! the whole corpus): a bad id is an error naming its shard and offset, and `pipe tokenize
//! --check` scans a corpus whole ahead of a run.
//!
//! Training reads non-overlapping windows ([`TokenWindows`]): window `w` of a shard reads its
//! ids `w T .. w T + T` and predicts `w T + 1 .. w T + T + 1`, as the character corpora do; no
//! window crosses a shard boundary. The held-out split is the corpus's tail or its last shards
//! ([`Holdout`]).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Result, StageError};
use crate::tokenizer::{TextTokenizer, TokenizerKind};

/// The first bytes of every shard.
pub const SHARD_MAGIC: &[u8; 8] = b"PIPETOK1";

/// The manifest's file name.
pub const MANIFEST: &str = "tokens.json";

/// The shard format this build writes and reads.
pub const FORMAT: u32 = 1;

/// Largest shard header read.
pub const MAX_HEADER_BYTES: u32 = 4096;

/// Largest manifest read (a million shards' entries fit).
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// Most shards in one corpus.
pub const MAX_SHARDS: usize = 1_000_000;

/// Tokens per shard that `pipe tokenize` writes unless told otherwise (256 MiB of `u16`).
pub const DEFAULT_SHARD_TOKENS: u64 = 128 << 20;

fn data_err(name: impl std::fmt::Display, reason: impl Into<String>) -> StageError {
    StageError::Data {
        source_name: name.to_string(),
        reason: reason.into(),
    }
}

/// How ids are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    /// Little-endian `u16`: vocabularies of at most 65,536 tokens.
    U16,
    /// Little-endian `u32`.
    U32,
}

impl TokenDtype {
    /// The narrowest type that holds every id below `vocab_size`.
    pub fn for_vocab(vocab_size: usize) -> Self {
        if vocab_size <= 1 << 16 {
            Self::U16
        } else {
            Self::U32
        }
    }

    /// Bytes per id.
    pub fn width(self) -> usize {
        match self {
            Self::U16 => 2,
            Self::U32 => 4,
        }
    }
}

/// What each shard says of itself, after the magic.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardHeader {
    /// [`FORMAT`].
    pub format: u32,
    /// Ids in the shard.
    pub tokens: u64,
    /// Their type.
    pub dtype: TokenDtype,
    /// Ids run below this.
    pub vocab_size: u64,
    /// The tokenizer's fingerprint ([`TextTokenizer::fingerprint`]).
    pub tokenizer: String,
}

/// The tokenizer a corpus was made with, as its manifest records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerRecord {
    /// Its kind.
    pub kind: TokenizerKind,
    /// Its fingerprint.
    pub fingerprint: String,
    /// Its vocabulary size.
    pub vocab_size: u64,
    /// The file in the corpus directory that rebuilds it (none for `bytes`).
    pub file: Option<String>,
    /// The id ending each document, if any.
    pub document_end: Option<u32>,
}

/// One shard's entry in the manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    /// Its file name in the corpus directory.
    pub file: String,
    /// Its ids.
    pub tokens: u64,
}

/// A corpus's manifest, `tokens.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    /// The tokenizer.
    pub tokenizer: TokenizerRecord,
    /// How ids are stored.
    pub dtype: TokenDtype,
    /// Documents (input files) tokenized.
    pub documents: u64,
    /// Ids in all shards.
    pub tokens: u64,
    /// The shards, in corpus order.
    pub shards: Vec<ShardEntry>,
}

impl Manifest {
    /// The manifest's fingerprint: the SHA-256 of its canonical JSON, which names the
    /// tokenizer and every shard's length. A checkpoint records it, so a run resumes only on
    /// the corpus it trained on.
    pub fn fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        let json = serde_json::to_vec(self).unwrap_or_default();
        Sha256::digest(json)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// Bytes every shard's header is given when [`ShardWriter`] writes it (the ids go to disk
/// before their count is known, so the header is written last, into this room).
const HEADER_ROOM: usize = 512;

/// A shard's magic and header, the JSON padded with spaces to `room` bytes in all (at least
/// to a multiple of 8).
///
/// # Errors
/// [`StageError::Data`] for a header that does not fit `room`.
fn header_bytes(header: &ShardHeader, room: Option<usize>) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(room.unwrap_or(64));
    out.extend_from_slice(SHARD_MAGIC);
    out.extend_from_slice(&[0; 4]);
    serde_json::to_writer(&mut out, header).map_err(|e| data_err("shard header", e.to_string()))?;
    let want = room.unwrap_or(out.len().next_multiple_of(8));
    if out.len() > want {
        return Err(data_err(
            "shard header",
            format!("longer than {want} bytes"),
        ));
    }
    out.resize(want, b' ');
    let len = (want - 12) as u32;
    out[8..12].copy_from_slice(&len.to_le_bytes());
    Ok(out)
}

/// Appends `id` to `out` in `dtype`.
fn put_id(out: &mut Vec<u8>, id: u32, dtype: TokenDtype) -> Result<()> {
    match dtype {
        TokenDtype::U16 => {
            let v = u16::try_from(id)
                .map_err(|_| data_err("shard", format!("id {id} does not fit u16")))?;
            out.extend_from_slice(&v.to_le_bytes());
        }
        TokenDtype::U32 => out.extend_from_slice(&id.to_le_bytes()),
    }
    Ok(())
}

/// A whole shard's bytes: magic, header, ids (what [`ShardWriter`] writes, for tests and
/// tools that make a shard in memory).
///
/// # Errors
/// [`StageError::Data`] for an id that does not fit `dtype`.
pub fn encode_shard(header: &ShardHeader, ids: &[u32]) -> Result<Vec<u8>> {
    let mut out = header_bytes(header, None)?;
    out.reserve(ids.len() * header.dtype.width());
    for &id in ids {
        put_id(&mut out, id, header.dtype)?;
    }
    Ok(out)
}

/// Parses a shard's magic and header from its first bytes; returns the header and where the
/// ids start.
///
/// # Errors
/// [`StageError::Data`] naming `name` and what is wrong.
pub fn parse_shard_header(bytes: &[u8], name: &str) -> Result<(ShardHeader, usize)> {
    if bytes.len() < 12 {
        return Err(data_err(
            name,
            format!("truncated at byte {}: no shard header", bytes.len()),
        ));
    }
    if &bytes[..8] != SHARD_MAGIC {
        return Err(data_err(
            name,
            "bad magic at byte 0: not a pipe token shard (PIPETOK1)",
        ));
    }
    let len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    if len > MAX_HEADER_BYTES {
        return Err(data_err(
            name,
            format!("header length {len} at byte 8 is over the limit of {MAX_HEADER_BYTES}"),
        ));
    }
    let end = 12 + len as usize;
    let json = bytes.get(12..end).ok_or_else(|| {
        data_err(
            name,
            format!("truncated at byte {}: the header needs {end}", bytes.len()),
        )
    })?;
    let header: ShardHeader = serde_json::from_slice(json)
        .map_err(|e| data_err(name, format!("bad header at byte 12: {e}")))?;
    if header.format != FORMAT {
        return Err(data_err(
            name,
            format!("shard format {} (this build reads {FORMAT})", header.format),
        ));
    }
    Ok((header, end))
}

/// The shard being written: its file (under a temporary name) and its ids so far.
#[derive(Debug)]
struct OpenShard {
    file: std::io::BufWriter<std::fs::File>,
    partial: PathBuf,
    name: String,
    tokens: u64,
    bytes: Vec<u8>,
}

/// Writes a corpus: ids in, shards of at most `shard_tokens` ids out, each written to disk
/// as it fills (memory stays small whatever the shard size), the manifest last, so a
/// directory with a manifest is whole.
#[derive(Debug)]
pub struct ShardWriter {
    /// The corpus directory, as the user named it (in messages).
    dir: PathBuf,
    /// Where the files go until [`ShardWriter::finish`] renames them into `dir`.
    staged: crate::outputs::StagedDir,
    record: TokenizerRecord,
    dtype: TokenDtype,
    shard_tokens: u64,
    open: Option<OpenShard>,
    shards: Vec<ShardEntry>,
    documents: u64,
}

impl ShardWriter {
    /// A writer of a corpus into `dir`, which must be missing or empty, for ids of
    /// `tokenizer`, which it saves there. Everything is written into a staging directory
    /// beside `dir` and renamed into place by [`ShardWriter::finish`], so a run that fails on
    /// a late input leaves `dir` as it was ([`crate::outputs::StagedDir`]).
    ///
    /// # Errors
    /// [`StageError::Config`] for a directory that already holds a corpus or a zero shard
    /// size; bad input for one that holds other files; [`StageError::Data`] when the
    /// tokenizer cannot be written.
    pub fn create(dir: &Path, tokenizer: &TextTokenizer, shard_tokens: u64) -> Result<Self> {
        if shard_tokens == 0 {
            return Err(StageError::Config("--shard-tokens must be positive".into()));
        }
        if dir.join(MANIFEST).exists() {
            return Err(StageError::Config(format!(
                "{} already holds a tokenized corpus ({MANIFEST}); give an empty directory",
                dir.display()
            )));
        }
        let staged = crate::outputs::StagedDir::claim_empty(dir, "tokenize")?;
        let file = tokenizer.save(staged.path())?;
        Ok(Self {
            dir: dir.to_path_buf(),
            staged,
            record: TokenizerRecord {
                kind: tokenizer.kind(),
                fingerprint: tokenizer.fingerprint().to_string(),
                vocab_size: tokenizer.vocab_size() as u64,
                file,
                document_end: tokenizer.document_end(),
            },
            dtype: TokenDtype::for_vocab(tokenizer.vocab_size()),
            shard_tokens,
            open: None,
            shards: Vec::new(),
            documents: 0,
        })
    }

    /// Appends ids, writing every shard that fills.
    ///
    /// # Errors
    /// [`StageError::Data`] for an id outside the vocabulary or a shard that cannot be
    /// written.
    pub fn push(&mut self, ids: &[u32]) -> Result<()> {
        for &id in ids {
            if u64::from(id) >= self.record.vocab_size {
                // The tokenizer made it: its ids run past the vocabulary size it declares.
                return Err(data_err(
                    "--tokenizer",
                    format!(
                        "it gave id {id}, outside its vocabulary of {}",
                        self.record.vocab_size
                    ),
                ));
            }
            let shard = match &mut self.open {
                Some(s) => s,
                None => self.open.insert(self.start_shard()?),
            };
            put_id(&mut shard.bytes, id, self.dtype)?;
            shard.tokens += 1;
            if shard.bytes.len() >= 1 << 16 {
                let name = shard.name.clone();
                shard
                    .file
                    .write_all(&shard.bytes)
                    .map_err(|e| data_err(&name, format!("cannot write: {e}")))?;
                shard.bytes.clear();
            }
            if shard.tokens == self.shard_tokens {
                self.close_shard()?;
            }
        }
        Ok(())
    }

    /// Ends the current document: appends the document-end id when the tokenizer has one.
    ///
    /// # Errors
    /// As [`ShardWriter::push`].
    pub fn end_document(&mut self) -> Result<()> {
        self.documents += 1;
        match self.record.document_end {
            Some(end) => self.push(&[end]),
            None => Ok(()),
        }
    }

    fn start_shard(&self) -> Result<OpenShard> {
        let name = format!("shard-{:05}.tok", self.shards.len());
        let path = self.dir.join(&name);
        // A corpus of more shards would be refused by every reader ([`MAX_SHARDS`]).
        if self.shards.len() >= MAX_SHARDS {
            return Err(StageError::Input(format!(
                "{}: more than {MAX_SHARDS} shards of {} tokens: give a larger --shard-tokens",
                self.dir.display(),
                self.shard_tokens
            )));
        }
        let partial = self.staged.path().join(&name).with_extension("partial");
        let file = std::fs::File::create(&partial)
            .map_err(|e| data_err(path.display(), format!("cannot write: {e}")))?;
        let mut file = std::io::BufWriter::new(file);
        file.write_all(&[0; HEADER_ROOM])
            .map_err(|e| data_err(path.display(), format!("cannot write: {e}")))?;
        Ok(OpenShard {
            file,
            partial,
            name,
            tokens: 0,
            bytes: Vec::with_capacity(1 << 16),
        })
    }

    /// Writes the open shard's remaining ids and its header, and renames it into place.
    fn close_shard(&mut self) -> Result<()> {
        use std::io::Seek;
        let Some(mut s) = self.open.take() else {
            return Ok(());
        };
        let header = ShardHeader {
            format: FORMAT,
            tokens: s.tokens,
            dtype: self.dtype,
            vocab_size: self.record.vocab_size,
            tokenizer: self.record.fingerprint.clone(),
        };
        let path = self.dir.join(&s.name);
        let staged = self.staged.path().join(&s.name);
        let fail = |e: std::io::Error| data_err(path.display(), format!("cannot write: {e}"));
        s.file.write_all(&s.bytes).map_err(fail)?;
        let mut file = s.file.into_inner().map_err(|e| fail(e.into_error()))?;
        file.seek(std::io::SeekFrom::Start(0)).map_err(fail)?;
        file.write_all(&header_bytes(&header, Some(HEADER_ROOM))?)
            .and_then(|()| file.sync_all())
            .map_err(fail)?;
        std::fs::rename(&s.partial, &staged).map_err(fail)?;
        self.shards.push(ShardEntry {
            file: s.name,
            tokens: s.tokens,
        });
        Ok(())
    }

    /// Writes the last shard and the manifest, and renames the corpus into place; returns the
    /// manifest.
    ///
    /// # Errors
    /// [`StageError::Data`] when nothing was tokenized or a file cannot be written; bad input
    /// when the directory cannot be moved into place.
    pub fn finish(mut self) -> Result<Manifest> {
        self.close_shard()?;
        if self.shards.is_empty() {
            return Err(data_err("--input", "holds no text to tokenize"));
        }
        let manifest = Manifest {
            format: FORMAT,
            tokenizer: self.record,
            dtype: self.dtype,
            documents: self.documents,
            tokens: self.shards.iter().map(|s| s.tokens).sum(),
            shards: self.shards,
        };
        let json =
            serde_json::to_vec_pretty(&manifest).map_err(|e| data_err(MANIFEST, e.to_string()))?;
        let path = self.dir.join(MANIFEST);
        let fail = |e: std::io::Error| data_err(path.display(), format!("cannot write: {e}"));
        std::fs::write(self.staged.path().join(MANIFEST), json).map_err(fail)?;
        self.staged.commit()?;
        Ok(manifest)
    }
}

/// One open shard: its memory map and where its ids start.
#[derive(Debug)]
struct Shard {
    name: String,
    map: memmap2::Mmap,
    body: usize,
    tokens: u64,
}

/// Windows read between two releases of the shards' mapped pages ([`TokenCorpus::read`]).
const RELEASE_EVERY: u64 = 128;

/// An open corpus: its manifest and every shard mapped.
#[derive(Debug)]
pub struct TokenCorpus {
    dir: PathBuf,
    manifest: Manifest,
    shards: Vec<Shard>,
    /// Reads so far, for releasing the mapped pages every [`RELEASE_EVERY`].
    reads: std::sync::atomic::AtomicU64,
}

impl TokenCorpus {
    /// Opens the corpus in `dir`: reads the manifest, maps every shard and checks each
    /// shard's header and length against the manifest.
    ///
    /// # Errors
    /// [`StageError::Data`] naming the file and byte where it goes wrong: a missing or
    /// malformed manifest, a shard path outside the directory, a shard whose magic, header,
    /// tokenizer or length disagrees with the manifest.
    pub fn open(dir: &Path) -> Result<Self> {
        let manifest = read_manifest(dir)?;
        check_maps_left(dir, manifest.shards.len())?;
        let shards = manifest
            .shards
            .iter()
            .map(|entry| open_shard(dir, entry, &manifest))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
            shards,
            reads: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The tokenizer the corpus was made with, rebuilt from its directory.
    ///
    /// # Errors
    /// As [`TextTokenizer::load`]; [`StageError::Data`] when the rebuilt tokenizer's
    /// fingerprint is not the manifest's.
    pub fn tokenizer(&self) -> Result<TextTokenizer> {
        let rec = &self.manifest.tokenizer;
        let tk = TextTokenizer::load(&self.dir, rec.kind, rec.file.as_deref())?;
        if tk.fingerprint() != rec.fingerprint {
            return Err(data_err(
                self.dir.display(),
                "its tokenizer file is not the one the shards were made with (fingerprints \
                 differ)",
            ));
        }
        Ok(tk)
    }

    /// Appends ids `start .. start + n` of shard `shard` to `out`, each checked against the
    /// vocabulary.
    ///
    /// # Errors
    /// [`StageError::Data`] for a range past the shard's end or an id outside the
    /// vocabulary, naming the shard and the id's offset.
    pub fn read(&self, shard: usize, start: u64, n: usize, out: &mut Vec<u32>) -> Result<()> {
        let s = self
            .shards
            .get(shard)
            .ok_or_else(|| data_err(self.dir.display(), format!("no shard {shard}")))?;
        if start.saturating_add(n as u64) > s.tokens {
            return Err(data_err(
                &s.name,
                format!(
                    "ids {start}..{} are past its {} tokens",
                    start + n as u64,
                    s.tokens
                ),
            ));
        }
        let width = self.manifest.dtype.width();
        let from = s.body + start as usize * width;
        let bytes = &s.map[from..from + n * width];
        let ids = IdRun {
            dtype: self.manifest.dtype,
            vocab: self.manifest.tokenizer.vocab_size,
            body: s.body,
            start,
        };
        ids.decode(bytes, &s.name, out)?;
        let reads = self
            .reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        if reads % RELEASE_EVERY == 0 {
            self.release_pages();
        }
        Ok(())
    }

    /// Unmaps every page the shards' maps hold (they stay in the page cache, and the next
    /// read of one faults it back in). A run reads windows all over the corpus, so without
    /// this the resident set would grow toward the corpus's size over an epoch; with it, it
    /// holds at most the pages of [`RELEASE_EVERY`] windows.
    fn release_pages(&self) {
        #[cfg(unix)]
        for s in &self.shards {
            // SAFETY: the maps are shared, read-only maps of files nobody writes (see
            // `open_shard`): dropping their pages loses nothing, and a read racing with it
            // faults the same bytes back in from the page cache.
            let _ = unsafe { s.map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
        }
    }

    /// Reads every id of every shard, in pieces, checking each against the vocabulary
    /// (`pipe tokenize --check`); `progress` hears the ids checked so far.
    ///
    /// # Errors
    /// As [`TokenCorpus::read`].
    pub fn check_all(&self, progress: &dyn Fn(u64)) -> Result<()> {
        const PIECE: u64 = 1 << 20;
        let mut buf = Vec::with_capacity(PIECE as usize);
        let mut done = 0;
        for (i, s) in self.shards.iter().enumerate() {
            let mut at = 0;
            while at < s.tokens {
                let n = (s.tokens - at).min(PIECE);
                buf.clear();
                self.read(i, at, n as usize, &mut buf)?;
                at += n;
                done += n;
                progress(done);
            }
        }
        Ok(())
    }

    /// Ids per shard.
    pub fn shard_tokens(&self) -> impl Iterator<Item = u64> + '_ {
        self.shards.iter().map(|s| s.tokens)
    }
}

/// Reads and checks the manifest of the corpus in `dir` (no shard is opened).
///
/// # Errors
/// [`StageError::Data`] for a missing or malformed manifest, naming what is wrong.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let bytes = crate::limits::read_file(&path, MAX_MANIFEST_BYTES)?;
    parse_manifest(&bytes, &path.display().to_string())
}

/// A manifest's bytes (`name` for messages), parsed and checked before any file it names is
/// opened: its format, shard count, vocabulary against its id type, file names, and that its
/// shards' counts add up to its total.
///
/// # Errors
/// [`StageError::Data`] naming what is wrong.
pub fn parse_manifest(bytes: &[u8], name: &str) -> Result<Manifest> {
    let manifest: Manifest = serde_json::from_slice(bytes)
        .map_err(|e| data_err(name, format!("not a token manifest: {e}")))?;
    check_manifest(&manifest, name)?;
    Ok(manifest)
}

/// Checks what a manifest says before any file it names is opened.
fn check_manifest(m: &Manifest, name: &str) -> Result<()> {
    if m.format != FORMAT {
        return Err(data_err(
            name,
            format!("corpus format {} (this build reads {FORMAT})", m.format),
        ));
    }
    if m.shards.is_empty() || m.shards.len() > MAX_SHARDS {
        return Err(data_err(
            name,
            format!("{} shards (a corpus has 1 to {MAX_SHARDS})", m.shards.len()),
        ));
    }
    let vocab = m.tokenizer.vocab_size;
    if vocab == 0 || (m.dtype == TokenDtype::U16 && vocab > 1 << 16) || vocab > 1 << 32 {
        return Err(data_err(
            name,
            format!(
                "vocabulary of {vocab} tokens does not fit {:?} ids",
                m.dtype
            ),
        ));
    }
    if let Some(end) = m.tokenizer.document_end
        && u64::from(end) >= vocab
    {
        return Err(data_err(
            name,
            format!("document-end id {end} is outside the vocabulary of {vocab} tokens"),
        ));
    }
    let mut named = std::collections::HashSet::with_capacity(m.shards.len());
    for e in &m.shards {
        // The same file twice would be read twice: its tokens trained on twice as often.
        if !named.insert(e.file.as_str()) {
            return Err(data_err(
                name,
                format!("shard {:?} is listed twice", e.file),
            ));
        }
        if !crate::outputs::is_plain_name(&e.file) {
            return Err(data_err(
                name,
                format!(
                    "shard {:?} is not a file name in the corpus directory",
                    e.file
                ),
            ));
        }
    }
    if let Some(f) = &m.tokenizer.file
        && !crate::outputs::is_plain_name(f)
    {
        return Err(data_err(
            name,
            format!("tokenizer file {f:?} is not a file name in the corpus directory"),
        ));
    }
    let sum = m
        .shards
        .iter()
        .try_fold(0u64, |acc, s| acc.checked_add(s.tokens));
    if sum != Some(m.tokens) {
        return Err(data_err(
            name,
            format!(
                "its shards' token counts do not add up to its total {}",
                m.tokens
            ),
        ));
    }
    Ok(())
}

/// Maps one shard and checks it against its manifest entry.
fn open_shard(dir: &Path, entry: &ShardEntry, m: &Manifest) -> Result<Shard> {
    let path = dir.join(&entry.file);
    let name = path.display().to_string();
    let file = crate::limits::open_regular(&path)
        .map_err(|e| data_err(&name, format!("cannot read: {e}")))?;
    let mut head = vec![0u8; 12 + MAX_HEADER_BYTES as usize];
    let got =
        read_up_to(&file, &mut head).map_err(|e| data_err(&name, format!("cannot read: {e}")))?;
    let (header, body) = parse_shard_header(&head[..got], &name)?;
    let expect = |what: &str, found: String, want: String| {
        data_err(
            &name,
            format!("its header says {what} {found} but the manifest says {want}"),
        )
    };
    if header.tokenizer != m.tokenizer.fingerprint {
        return Err(expect(
            "tokenizer",
            short(&header.tokenizer),
            short(&m.tokenizer.fingerprint),
        ));
    }
    if header.dtype != m.dtype {
        return Err(expect(
            "ids of",
            format!("{:?}", header.dtype),
            format!("{:?}", m.dtype),
        ));
    }
    if header.vocab_size != m.tokenizer.vocab_size {
        return Err(expect(
            "a vocabulary of",
            header.vocab_size.to_string(),
            m.tokenizer.vocab_size.to_string(),
        ));
    }
    if header.tokens != entry.tokens {
        return Err(expect(
            "tokens:",
            header.tokens.to_string(),
            entry.tokens.to_string(),
        ));
    }
    let len = file
        .metadata()
        .map_err(|e| data_err(&name, format!("cannot read: {e}")))?
        .len();
    check_shard_len(&header, body, len, &name)?;
    // SAFETY: the map is read-only and lives as long as the corpus; the shard files are
    // written once (to a temporary name, then renamed) and never modified in place. A file
    // truncated under a running job is the one case this cannot guard (the process would get
    // SIGBUS), as with every memory-mapped reader.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|e| data_err(&name, format!("cannot map: {e}")))?;
    // Windows are read in a random order: without this hint the kernel reads ahead (and maps,
    // in large folios) up to megabytes around each window, and the resident set grows by
    // that much per window read. A failure only loses the hint.
    #[cfg(unix)]
    let _ = map.advise(memmap2::Advice::Random);
    Ok(Shard {
        name,
        map,
        body,
        tokens: header.tokens,
    })
}

/// Memory maps a process keeps for itself beside a corpus's (its libraries, thread stacks,
/// the allocator's large blocks, the transport's rings).
const MAPS_KEPT: u64 = 8192;

/// Refuses a corpus of more shards than this process may still map, one map each, before
/// the first is mapped: past Linux's `vm.max_map_count` (65,530 by default) the map that
/// goes over fails with "Cannot allocate memory", which names neither cause nor cure.
///
/// # Errors
/// [`StageError::Data`] naming the shard count, the limit and what to do.
fn check_maps_left(dir: &Path, shards: usize) -> Result<()> {
    let Some((limit, used)) = map_limit_and_use() else {
        return Ok(());
    };
    let left = limit.saturating_sub(used.saturating_add(MAPS_KEPT));
    if shards as u64 > left {
        return Err(data_err(
            dir.display(),
            format!(
                "{shards} shards, one memory map each, and this system lets a process make \
                 {limit} maps (vm.max_map_count; {used} in use here): tokenize again with a \
                 larger --shard-tokens, or raise vm.max_map_count"
            ),
        ));
    }
    Ok(())
}

/// Linux's per-process map limit and this process's maps now; `None` where either cannot
/// be read (another system), which leaves the check to the map itself.
fn map_limit_and_use() -> Option<(u64, u64)> {
    let limit = std::fs::read_to_string("/proc/sys/vm/max_map_count").ok()?;
    let limit = limit.trim().parse::<u64>().ok()?;
    let maps = std::fs::read("/proc/self/maps").ok()?;
    let used = maps.iter().filter(|&&b| b == b'\n').count() as u64;
    Some((limit, used))
}

/// A shard file's length against what its header says its ids need.
fn check_shard_len(header: &ShardHeader, body: usize, len: u64, name: &str) -> Result<()> {
    let want =
        (body as u64).saturating_add(header.tokens.saturating_mul(header.dtype.width() as u64));
    if len != want {
        let what = if len < want { "truncated" } else { "too long" };
        return Err(data_err(
            name,
            format!(
                "{what} at byte {len}: {} tokens need {want} bytes",
                header.tokens
            ),
        ));
    }
    Ok(())
}

/// A run of ids in a shard: their type, the vocabulary they must fall in, where the shard's
/// body starts and the index of the first.
struct IdRun {
    dtype: TokenDtype,
    vocab: u64,
    body: usize,
    start: u64,
}

impl IdRun {
    /// Decodes `bytes` (whole ids) into `out`, each checked against the vocabulary.
    fn decode(&self, bytes: &[u8], name: &str, out: &mut Vec<u32>) -> Result<()> {
        let width = self.dtype.width();
        for (i, b) in bytes.chunks_exact(width).enumerate() {
            let id = match self.dtype {
                TokenDtype::U16 => u32::from(u16::from_le_bytes([b[0], b[1]])),
                TokenDtype::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            };
            if u64::from(id) >= self.vocab {
                let at = self.start + i as u64;
                return Err(data_err(
                    name,
                    format!(
                        "token id {id} at token {at} (byte {}) is outside the vocabulary of {}",
                        self.body as u64 + at * width as u64,
                        self.vocab
                    ),
                ));
            }
            out.push(id);
        }
        Ok(())
    }
}

/// A whole shard file's bytes read as the corpus reader reads a mapped shard: its header,
/// its length against the header's token count, and every id against the header's
/// vocabulary (`name` for messages). What `pipe tokenize --check` does to one shard, without
/// the manifest's cross-checks; the fuzz target's entry.
///
/// # Errors
/// [`StageError::Data`] naming the byte where the shard goes wrong.
pub fn parse_shard(bytes: &[u8], name: &str) -> Result<(ShardHeader, Vec<u32>)> {
    let (header, body) = parse_shard_header(bytes, name)?;
    check_shard_len(&header, body, bytes.len() as u64, name)?;
    let ids = IdRun {
        dtype: header.dtype,
        vocab: header.vocab_size,
        body,
        start: 0,
    };
    let mut out = Vec::new();
    ids.decode(&bytes[body..], name, &mut out)?;
    Ok((header, out))
}

/// Reads from `file` until `buf` is full or the file ends; returns the bytes read.
pub(crate) fn read_up_to(mut file: &std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read(&mut buf[got..])? {
            0 => break,
            n => got += n,
        }
    }
    Ok(got)
}

fn short(fingerprint: &str) -> String {
    fingerprint.chars().take(16).collect()
}

/// Which part of a corpus validates.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Holdout {
    /// This fraction of the windows, from the corpus's end.
    Tail(f64),
    /// The last this many shards.
    Shards(u32),
}

impl Default for Holdout {
    fn default() -> Self {
        Self::Tail(0.1)
    }
}

impl std::str::FromStr for Holdout {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad =
            || format!("bad holdout '{s}': give tail:FRACTION (0 < FRACTION < 1) or shards:COUNT");
        let (kind, value) = s.split_once(':').ok_or_else(bad)?;
        match kind {
            "tail" => {
                let f: f64 = value.parse().map_err(|_| bad())?;
                (f > 0.0 && f < 1.0)
                    .then_some(Self::Tail(f))
                    .ok_or_else(bad)
            }
            "shards" => {
                let n: u32 = value.parse().map_err(|_| bad())?;
                (n > 0).then_some(Self::Shards(n)).ok_or_else(bad)
            }
            _ => Err(bad()),
        }
    }
}

/// Windows of `context` ids of a corpus: a range of its windows in corpus order, every
/// `stride`-th of them (a validation split thinned to its evaluation budget).
#[derive(Clone, Debug)]
pub struct TokenWindows {
    corpus: Arc<TokenCorpus>,
    context: usize,
    /// Windows before each shard (one more entry than shards).
    starts: Arc<Vec<u64>>,
    first: u64,
    count: u64,
    stride: u64,
    /// The end-of-text id of packed documents ([`TokenWindows::packed`]).
    pack: Option<u32>,
}

impl PartialEq for TokenWindows {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.corpus, &other.corpus)
            && (self.context, self.first, self.count, self.stride, self.pack)
                == (
                    other.context,
                    other.first,
                    other.count,
                    other.stride,
                    other.pack,
                )
    }
}

impl TokenWindows {
    /// Windows in this split.
    pub fn len(&self) -> u64 {
        self.count
    }

    /// True when the split is empty.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// These windows read as packed documents ending with the id `end`
    /// ([`crate::documents`]): a label whose input is `end` (the first token of the next
    /// document, predicted from the one before) becomes
    /// [`IGNORED_LABEL`](pipe_kernels::IGNORED_LABEL). `None` counts every label.
    #[must_use]
    pub fn packed(mut self, end: Option<u32>) -> Self {
        self.pack = end;
        self
    }

    /// The corpus the windows are read from.
    pub fn corpus(&self) -> &TokenCorpus {
        &self.corpus
    }

    /// Ids per window.
    pub fn context(&self) -> usize {
        self.context
    }

    /// Keeps the first `n` windows.
    pub fn truncate(&mut self, n: u64) {
        self.count = self.count.min(n);
    }

    /// Appends window `i`'s inputs (as `f32` ids) to `x` and its targets to `y`.
    ///
    /// # Errors
    /// As [`TokenCorpus::read`].
    pub fn gather_into(
        &self,
        i: u64,
        x: &mut Vec<f32>,
        y: &mut Vec<u32>,
        ids: &mut Vec<u32>,
    ) -> Result<()> {
        let g = self.first + i * self.stride;
        let shard = self.starts.partition_point(|&s| s <= g) - 1;
        let w = g - self.starts[shard];
        ids.clear();
        self.corpus
            .read(shard, w * self.context as u64, self.context + 1, ids)?;
        x.extend(ids[..self.context].iter().map(|&t| t as f32));
        match self.pack {
            Some(end) => y.extend(ids[..self.context].iter().zip(&ids[1..]).map(
                |(&input, &label)| {
                    if input == end {
                        pipe_kernels::IGNORED_LABEL
                    } else {
                        label
                    }
                },
            )),
            None => y.extend_from_slice(&ids[1..]),
        }
        Ok(())
    }
}

/// The train and validation windows of the corpus in `dir`: windows of `context` ids, the
/// validation part chosen by `holdout` and thinned evenly to at most `max_eval` windows.
///
/// # Errors
/// As [`TokenCorpus::open`]; [`StageError::Data`] when a split would hold no window.
pub fn token_splits(
    dir: &Path,
    context: usize,
    holdout: Holdout,
    max_eval: u64,
) -> Result<(TokenWindows, TokenWindows)> {
    let corpus = Arc::new(TokenCorpus::open(dir)?);
    let t = context.max(1) as u64;
    let mut starts = vec![0u64];
    for n in corpus.shard_tokens() {
        let last = *starts.last().unwrap_or(&0);
        starts.push(last + n.saturating_sub(1) / t);
    }
    let total = *starts.last().unwrap_or(&0);
    let cut = match holdout {
        Holdout::Tail(f) => total - ((total as f64 * f).ceil() as u64).min(total),
        Holdout::Shards(k) => {
            let shards = starts.len() - 1;
            if k as usize >= shards {
                return Err(data_err(
                    dir.display(),
                    format!("holding out {k} shards leaves none to train on ({shards} in all)"),
                ));
            }
            starts[shards - k as usize]
        }
    };
    let (train_n, eval_n) = (cut, total - cut);
    for (what, n) in [("training", train_n), ("validation", eval_n)] {
        if n == 0 {
            return Err(data_err(
                dir.display(),
                format!(
                    "its {what} split holds no window of {context} tokens ({total} windows in \
                     all)"
                ),
            ));
        }
    }
    let stride = eval_n.div_ceil(max_eval.max(1)).max(1);
    let starts = Arc::new(starts);
    let train = TokenWindows {
        corpus: corpus.clone(),
        context,
        starts: starts.clone(),
        first: 0,
        count: train_n,
        stride: 1,
        pack: None,
    };
    let eval = TokenWindows {
        corpus,
        context,
        starts,
        first: cut,
        count: eval_n.div_ceil(stride),
        stride,
        pack: None,
    };
    Ok((train, eval))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_corpus_of_more_shards_than_maps_left_is_refused_before_mapping() {
        let dir = Path::new("corpus");
        check_maps_left(dir, 16).unwrap();
        // Where the limit can be read (Linux), as many shards as it allows maps in all
        // cannot fit beside the process's own.
        if let Some((limit, _)) = map_limit_and_use() {
            let err = check_maps_left(dir, limit as usize)
                .unwrap_err()
                .to_string();
            assert!(err.contains("vm.max_map_count"), "{err}");
            assert!(err.contains(&format!("{limit} shards")), "{err}");
        }
    }
}
