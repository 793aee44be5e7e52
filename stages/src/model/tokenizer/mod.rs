//! Tokenizers: text to token ids and back, for corpora tokenized once into shards
//! ([`crate::shards`]) and for sampling from the models trained on them.
//!
//! Three kinds, one type ([`TextTokenizer`]), so the shard writer, the manifest and `pipe
//! sample` never ask which kind they hold:
//! - `bytes`: each UTF-8 byte is a token (256 ids); needs no vocabulary and loses nothing.
//! - `chars`: each distinct character of the corpus is a token, ids in character order (the
//!   vocabulary Tiny Shakespeare's character models use, [`crate::data::Vocab`]).
//! - a Hugging Face `tokenizer.json` (GPT-2's byte-level BPE, or any other), through the
//!   `tokenizers` crate, the library the Python package wraps, so ids agree with the Python
//!   tokenizer's. It is used without its special-token post-processing: documents are joined by
//!   the end-of-text token when the vocabulary has one ([`TextTokenizer::document_end`]).
//!
//! A tokenizer's **fingerprint** is the SHA-256 of what defines it (the kind and, for `chars`,
//! the characters; for a `tokenizer.json`, the file's bytes). Shards record it, so a corpus
//! tokenized by one tokenizer is never read as if another had made it.

mod growth;

use std::path::Path;

use sha2::{Digest, Sha256};

use crate::data::Vocab;
use crate::error::{Result, StageError};

/// Largest `tokenizer.json` read (GPT-2's is 1.4 MB; the largest common ones are near 20 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 64 << 20;

/// The end-of-text tokens looked for, in order, to separate documents.
const DOCUMENT_END_TOKENS: [&str; 3] = ["<|endoftext|>", "</s>", "<eos>"];

fn tokenizer_err(name: &str, reason: impl Into<String>) -> StageError {
    StageError::Data {
        source_name: name.to_string(),
        reason: reason.into(),
    }
}

/// Which tokenizer a user asked for (`--tokenizer bytes|chars|PATH`), before it is built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerChoice {
    /// One token per byte.
    Bytes,
    /// One token per distinct character of the corpus.
    Chars,
    /// A Hugging Face `tokenizer.json`.
    File(std::path::PathBuf),
}

impl std::str::FromStr for TokenizerChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "" => Err("empty tokenizer: give bytes, chars or a tokenizer.json path".into()),
            "bytes" => Ok(Self::Bytes),
            "chars" => Ok(Self::Chars),
            path => Ok(Self::File(path.into())),
        }
    }
}

/// What a tokenizer is, as the shard manifest records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// One token per byte.
    Bytes,
    /// One token per character of a fixed vocabulary.
    Chars,
    /// A Hugging Face `tokenizer.json`.
    Json,
}

#[derive(Clone, Debug)]
enum Inner {
    Bytes,
    Chars(Vocab),
    /// The tokenizer and the bytes of the `tokenizer.json` it was read from (saved as they
    /// are, so the fingerprint of a saved copy is the original's).
    Json(Box<tokenizers::Tokenizer>, std::sync::Arc<[u8]>),
}

/// A built tokenizer: encodes text to ids and decodes ids to text.
#[derive(Clone, Debug)]
pub struct TextTokenizer {
    inner: Inner,
    fingerprint: String,
    vocab_size: usize,
    document_end: Option<u32>,
    /// Its model may give some text no token at all and go on (a BPE with no unknown token
    /// and no byte fallback), so each encoding is checked for text it left out.
    may_drop_text: bool,
}

fn sha256_hex(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

impl TextTokenizer {
    /// The byte tokenizer: ids `0..256`, no document separator (every byte is text).
    pub fn bytes() -> Self {
        Self {
            inner: Inner::Bytes,
            fingerprint: sha256_hex(&[b"bytes"]),
            vocab_size: 256,
            document_end: None,
            may_drop_text: false,
        }
    }

    /// The character tokenizer of `vocab`.
    ///
    /// # Errors
    /// [`StageError::Data`] for an empty vocabulary.
    pub fn chars(vocab: Vocab) -> Result<Self> {
        if vocab.is_empty() {
            return Err(tokenizer_err("chars", "the corpus has no characters"));
        }
        let text: String = vocab.chars.iter().collect();
        Ok(Self {
            fingerprint: sha256_hex(&[b"chars\0", text.as_bytes()]),
            vocab_size: vocab.len(),
            inner: Inner::Chars(vocab),
            document_end: None,
            may_drop_text: false,
        })
    }

    /// A Hugging Face tokenizer from the bytes of its `tokenizer.json`; `name` is for
    /// messages.
    ///
    /// Its padding and truncation, if it has any, are not applied: a corpus or a prompt is
    /// tokenized as a stream, every piece of its text kept and nothing added.
    ///
    /// # Errors
    /// [`StageError::Data`] when the bytes are not a tokenizer the `tokenizers` library reads,
    /// or its vocabulary is empty or wider than `u32` ids.
    pub fn from_json(bytes: &[u8], name: &str) -> Result<Self> {
        let mut tk = crate::contain::call(|| tokenizers::Tokenizer::from_bytes(bytes))
            .map_err(|panic| {
                tokenizer_err(
                    name,
                    format!("the tokenizers library failed on it: {panic}"),
                )
            })?
            .map_err(|e| tokenizer_err(name, format!("not a tokenizer.json: {e}")))?;
        vet_growth(&tk).map_err(|reason| tokenizer_err(name, reason))?;
        // Padding and truncation shape a batch of encodings to one length; text tokenized
        // into a stream takes neither: padding would put ids into the corpus that stand for
        // no text (a fixed length, the memory of that many ids) and truncation would drop
        // text.
        tk.with_padding(None);
        tk.with_truncation(None)
            .map_err(|e| tokenizer_err(name, format!("cannot turn truncation off: {e}")))?;
        // The ids a model must cover run to the largest one: a vocabulary's count of tokens
        // falls short of it where its ids leave gaps (ids 0..254 and 100000 are 256 tokens,
        // and a model of 256 outputs would meet id 100000).
        let vocab_size = tk
            .get_vocab(true)
            .into_values()
            .max()
            .map_or(0, |largest| largest as usize + 1);
        if vocab_size == 0 || vocab_size > u32::MAX as usize {
            return Err(tokenizer_err(
                name,
                format!("vocabulary of {vocab_size} ids, 0 to its largest (needs 1 to 2^32-1)"),
            ));
        }
        let document_end = DOCUMENT_END_TOKENS.iter().find_map(|t| tk.token_to_id(t));
        // A BPE finds no token for a character outside its vocabulary and, without an unknown
        // token or byte fallback, leaves it out; the other models fail on it or have one.
        let may_drop_text = matches!(
            tk.get_model(),
            tokenizers::ModelWrapper::BPE(bpe) if bpe.unk_token.is_none() && !bpe.byte_fallback
        );
        Ok(Self {
            may_drop_text,
            inner: Inner::Json(Box::new(tk), bytes.into()),
            fingerprint: sha256_hex(&[b"json\0", bytes]),
            vocab_size,
            document_end,
        })
    }

    /// A Hugging Face tokenizer read from `path` (a `tokenizer.json`).
    ///
    /// # Errors
    /// As [`crate::limits::read_file`] and [`TextTokenizer::from_json`].
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = crate::limits::read_file(path, MAX_TOKENIZER_BYTES)?;
        Self::from_json(&bytes, &path.display().to_string())
    }

    /// Its kind.
    pub fn kind(&self) -> TokenizerKind {
        match self.inner {
            Inner::Bytes => TokenizerKind::Bytes,
            Inner::Chars(_) => TokenizerKind::Chars,
            Inner::Json(..) => TokenizerKind::Json,
        }
    }

    /// The SHA-256 of what defines it, in hex.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Ids run `0..vocab_size()`: one past the largest id, which is more than the count of
    /// tokens where a `tokenizer.json`'s ids leave gaps.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The id that ends each document in a tokenized corpus, when the tokenizer has one.
    pub fn document_end(&self) -> Option<u32> {
        self.document_end
    }

    /// Whether text may be cut anywhere (between characters) and tokenized in pieces with
    /// the ids of tokenizing it whole: true for `bytes` and `chars`, which never join
    /// characters; a `tokenizer.json` is cut only at [`is_safe_cut`] points.
    pub fn cuts_anywhere(&self) -> bool {
        !matches!(self.inner, Inner::Json(..))
    }

    /// The character vocabulary of a `chars` tokenizer.
    pub fn vocab(&self) -> Option<&Vocab> {
        match &self.inner {
            Inner::Chars(v) => Some(v),
            _ => None,
        }
    }

    /// The ids of `text`; `name` (a file and offset) is for messages.
    ///
    /// # Errors
    /// [`StageError::Data`] for a character a `chars` vocabulary lacks, text a
    /// `tokenizer.json` gives no token (never silently left out), or the library's failure
    /// (an error, or a panic: a pattern of the file that backtracks past the regex engine's
    /// limit on this text, say).
    pub fn encode(&self, text: &str, name: &str) -> Result<Vec<u32>> {
        match &self.inner {
            Inner::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Inner::Chars(v) => v.encode(text, name),
            Inner::Json(tk, _) => crate::contain::call(|| self.encode_json(tk, text, name))
                .unwrap_or_else(|panic| {
                    Err(tokenizer_err(
                        name,
                        format!("cannot tokenize: the tokenizers library failed on this text with this tokenizer.json: {panic}"),
                    ))
                }),
        }
    }

    /// [`TextTokenizer::encode`] by a `tokenizer.json`'s tokenizer.
    fn encode_json(&self, tk: &tokenizers::Tokenizer, text: &str, name: &str) -> Result<Vec<u32>> {
        let cannot = |e| tokenizer_err(name, format!("cannot tokenize: {e}"));
        if !self.may_drop_text {
            return tk
                .encode_fast(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(cannot);
        }
        let e = tk.encode(text, false).map_err(cannot)?;
        let Some((gap, _)) = first_left_out(text, e.get_offsets()) else {
            return Ok(e.get_ids().to_vec());
        };
        // The offsets after a character left out shift back over it, so the gap says only
        // that one was: the character is the first that alone gives no token.
        let alone = |c: char| {
            tk.encode_fast(c.to_string(), false)
                .is_ok_and(|e| e.get_ids().is_empty())
        };
        let what = match text
            .char_indices()
            .find(|&(_, c)| !c.is_whitespace() && alone(c))
        {
            Some((at, c)) => format!("{c:?} at byte {at}"),
            None => format!("text at or before byte {gap}"),
        };
        Err(tokenizer_err(
            name,
            format!(
                "{what} has no token in this tokenizer, which has no unknown token or byte \
                 fallback to stand for it: the text would be lost"
            ),
        ))
    }

    /// The text of `ids`: bytes that are not UTF-8 become U+FFFD, and so do ids outside a
    /// character vocabulary; a byte id past 255 reads as `?` and a `tokenizer.json` id past
    /// the vocabulary as its last token (a model's output never holds either). Where a
    /// `tokenizer.json`'s decoder fails (or panics), the text is U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.inner {
            Inner::Bytes => {
                let bytes: Vec<u8> = ids
                    .iter()
                    .map(|&i| u8::try_from(i).unwrap_or(b'?'))
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Inner::Chars(v) => v.decode(ids),
            Inner::Json(tk, _) => {
                let known: Vec<u32> = ids
                    .iter()
                    .map(|&i| i.min(self.vocab_size as u32 - 1))
                    .collect();
                crate::contain::call(|| tk.decode(&known, false))
                    .ok()
                    .and_then(|decoded| decoded.ok())
                    .unwrap_or_else(|| "\u{fffd}".into())
            }
        }
    }

    /// The bytes of the `tokenizer.json` it was read from, for a Hugging Face tokenizer;
    /// `None` for the byte and character tokenizers, which have none.
    pub fn json_source(&self) -> Option<&[u8]> {
        match &self.inner {
            Inner::Json(_, source) => Some(source),
            Inner::Bytes | Inner::Chars(_) => None,
        }
    }

    /// Writes what rebuilds it into `dir`: `tokenizer.json` for a Hugging Face tokenizer,
    /// `vocab.json` (the characters) for `chars`, nothing for `bytes`. Returns the file name.
    ///
    /// # Errors
    /// [`StageError::Data`] when the file cannot be written.
    pub fn save(&self, dir: &Path) -> Result<Option<String>> {
        let (file, bytes) = match &self.inner {
            Inner::Bytes => return Ok(None),
            Inner::Chars(v) => (
                "vocab.json",
                serde_json::to_vec(v).map_err(|e| tokenizer_err("vocab.json", e.to_string()))?,
            ),
            Inner::Json(_, source) => ("tokenizer.json", source.to_vec()),
        };
        let path = dir.join(file);
        std::fs::write(&path, bytes).map_err(|e| {
            tokenizer_err(&path.display().to_string(), format!("cannot write: {e}"))
        })?;
        Ok(Some(file.to_string()))
    }

    /// Rebuilds the tokenizer a manifest names from `dir` (see [`TextTokenizer::save`]).
    ///
    /// # Errors
    /// [`StageError::Data`] for a missing or unreadable file.
    pub fn load(dir: &Path, kind: TokenizerKind, file: Option<&str>) -> Result<Self> {
        let path = |default: &str| dir.join(file.unwrap_or(default));
        match kind {
            TokenizerKind::Bytes => Ok(Self::bytes()),
            TokenizerKind::Chars => {
                let p = path("vocab.json");
                let bytes = crate::limits::read_file(&p, MAX_TOKENIZER_BYTES)?;
                let vocab: Vocab = serde_json::from_slice(&bytes).map_err(|e| {
                    tokenizer_err(&p.display().to_string(), format!("not a vocabulary: {e}"))
                })?;
                Self::chars(vocab)
            }
            TokenizerKind::Json => Self::from_file(&path("tokenizer.json")),
        }
    }
}

/// Refuses a tokenizer that may make text more than [`crate::limits::MAX_TEXT_GROWTH`] times
/// longer on its way to the model or out of its decoder ([`growth`]).
fn vet_growth(tk: &tokenizers::Tokenizer) -> std::result::Result<(), String> {
    let json = |part: std::result::Result<serde_json::Value, serde_json::Error>| {
        part.map_err(|e| format!("cannot read its steps back: {e}"))
    };
    growth::check(
        &json(serde_json::to_value(tk.get_normalizer()))?,
        &json(serde_json::to_value(tk.get_pre_tokenizer()))?,
        &json(serde_json::to_value(tk.get_decoder()))?,
    )
}

/// The first character of `text` that no token's byte range in `offsets` covers and that is
/// not whitespace (which a pre-tokenizer may drop by design), with its byte position: where
/// text was left out (a BPE's offsets after it shift back over it, so the position is where
/// the gap shows, at the end of the pre-tokenized word).
fn first_left_out(text: &str, offsets: &[(usize, usize)]) -> Option<(usize, char)> {
    let mut spans = offsets.to_vec();
    spans.sort_unstable();
    spans.push((text.len(), text.len()));
    let bytes = text.as_bytes();
    let mut covered = 0;
    for (start, end) in spans {
        if let Some(gap) = bytes.get(covered..start.max(covered)) {
            // A character a token's range cuts reads as U+FFFD here: left out in part.
            let gap_text = String::from_utf8_lossy(gap);
            if let Some((i, c)) = gap_text.char_indices().find(|(_, c)| !c.is_whitespace()) {
                return Some((covered + i.min(gap.len()), c));
            }
        }
        covered = covered.max(end);
    }
    None
}

/// Whether `text[..at]` may be tokenized apart from `text[at..]` without changing any id:
/// the cut follows a line break that sits between two characters that are not whitespace.
/// Byte-level BPE pre-tokenizers (GPT-2's) never join a token across such a break, and the
/// other kinds never join characters at all.
pub fn is_safe_cut(text: &str, at: usize) -> bool {
    let (Some(before), Some(after)) = (text.get(..at), text.get(at..)) else {
        return false;
    };
    let mut back = before.chars().rev();
    matches!(
        (back.next(), back.next(), after.chars().next()),
        (Some('\n'), Some(b), Some(a)) if !b.is_whitespace() && !a.is_whitespace()
    )
}

/// Splits `text` into pieces of about `target` bytes at safe cuts ([`is_safe_cut`]), so that
/// large files tokenize in parallel with the ids whole-file tokenizing would give. A text
/// with no safe cut stays whole.
pub fn split_at_safe_cuts(text: &str, target: usize) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut start = 0;
    while text.len() - start > target {
        let mut at = start + target;
        while at < text.len() && !is_safe_cut(text, at) {
            at += 1;
        }
        if at >= text.len() {
            break;
        }
        pieces.push(&text[start..at]);
        start = at;
    }
    pieces.push(&text[start..]);
    pieces
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::{TextTokenizer, first_left_out};

    #[test]
    fn a_tokenizer_json_pads_and_truncates_nothing() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../data/tokenizers/shakespeare-bpe-1024.json"
        );
        let plain = std::fs::read_to_string(path).unwrap();
        let mut json: serde_json::Value = serde_json::from_str(&plain).unwrap();
        // A fixed length of 10^8 ids would take 1.6 GB if it were applied.
        json["padding"] = serde_json::json!({
            "strategy": {"Fixed": 100_000_000}, "direction": "Right", "pad_to_multiple_of": 1000,
            "pad_id": 5, "pad_type_id": 0, "pad_token": "<|endoftext|>"
        });
        json["truncation"] = serde_json::json!({
            "direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0
        });
        let shaped = serde_json::to_vec(&json).unwrap();
        let text = "ROMEO: But soft, what light through yonder window breaks?\n";
        let want = TextTokenizer::from_json(plain.as_bytes(), "plain")
            .unwrap()
            .encode(text, "text")
            .unwrap();
        assert!(want.len() > 3);
        let got = TextTokenizer::from_json(&shaped, "shaped")
            .unwrap()
            .encode(text, "text")
            .unwrap();
        assert_eq!(got, want);
    }

    /// A word-level vocabulary of 256 tokens whose ids leave a gap: its ids run to 100000, so
    /// a model must cover 100001 of them (a model of 256 outputs would meet id 100000).
    #[test]
    fn ids_with_gaps_count_to_the_largest() {
        let mut vocab: serde_json::Map<String, serde_json::Value> = (0..255)
            .map(|i| (format!("t{i}"), serde_json::json!(i)))
            .collect();
        vocab.insert("zz".into(), serde_json::json!(100_000));
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}
        });
        let tk = TextTokenizer::from_json(&serde_json::to_vec(&json).unwrap(), "gaps").unwrap();
        assert_eq!(tk.vocab_size(), 100_001);
        assert_eq!(tk.encode("t1 zz", "text").unwrap(), vec![1, 100_000]);
    }

    #[test]
    fn text_no_token_covers_is_found_and_whitespace_between_tokens_is_not() {
        // "ab cab": tokens over "ab", "ab" (4..6); the space is the pre-tokenizer's.
        assert_eq!(first_left_out("ab cab", &[(0, 2), (4, 6)]), Some((3, 'c')));
        assert_eq!(first_left_out("ab ab", &[(0, 2), (3, 5)]), None);
        // Left out at the end, or everything; unordered and overlapping ranges.
        assert_eq!(first_left_out("abé", &[(0, 2)]), Some((2, 'é')));
        assert_eq!(first_left_out("x", &[]), Some((0, 'x')));
        assert_eq!(first_left_out("aé", &[(1, 3), (0, 1), (1, 3)]), None);
        assert_eq!(first_left_out(" \n\t", &[]), None);
        // A character a token's range cuts is left out in part.
        assert_eq!(first_left_out("é", &[(0, 1)]).map(|(at, _)| at), Some(1));
    }
}
