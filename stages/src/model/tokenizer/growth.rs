//! How many times longer a `tokenizer.json` can make the text it is given, worked out from
//! the file before any text is read.
//!
//! A tokenizer's normalizer and pre-tokenizer rewrite text before its model sees it, and its
//! decoder rewrites tokens' text on the way out. The steps Unicode defines keep text within a
//! small factor of its length, but some are set by the file: a `Replace` of `a` by 100,000
//! `e`s, a `Sequence` of thirty byte-level steps (each may double the bytes). Tokenized as it
//! comes, such text exhausts memory: one 256 KiB piece of a corpus would become 25 GB. So each
//! step has a bound on its growth (output bytes per input byte, at worst), a sequence
//! multiplies its steps' bounds, and [`check`] refuses a file whose bound passes
//! [`MAX_TEXT_GROWTH`].
//!
//! The steps are read from the tokenizer as the `tokenizers` library parsed it, written back
//! as JSON: every step then has its `type` and every field its canonical spelling, whatever
//! legacy form the file used.

use serde_json::Value;

pub use crate::limits::MAX_TEXT_GROWTH;

/// The growth of Unicode's canonical forms (NFC, NFD), in UTF-8 bytes per byte: U+1D160 and
/// U+0390 become three times as long, and composition only shortens a decomposed text.
const CANONICAL_GROWTH: f64 = 3.0;
/// The growth of Unicode's compatibility forms (NFKC, NFKD): U+FDFA (3 bytes) becomes 33.
const COMPATIBILITY_GROWTH: f64 = 11.0;
/// Lowercasing: U+0130 (2 bytes) becomes `i` and a combining dot (3).
const LOWERCASE_GROWTH: f64 = 1.5;

/// A bound on a step's growth, with the step that grows text most, for messages.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Growth {
    /// Output bytes per input byte, at worst.
    pub factor: f64,
    /// The single step with the largest factor, and what it is.
    pub largest: Option<(f64, String)>,
}

impl Growth {
    /// A step that never lengthens text.
    fn none() -> Self {
        Self {
            factor: 1.0,
            largest: None,
        }
    }

    /// One step growing text by at most `factor`.
    fn step(factor: f64, what: impl Into<String>) -> Self {
        Self {
            factor,
            largest: (factor > 1.0).then(|| (factor, what.into())),
        }
    }

    /// `self`, then `next` on its output.
    fn then(self, next: Growth) -> Self {
        let largest = match (self.largest, next.largest) {
            (Some(a), Some(b)) => Some(if b.0 > a.0 { b } else { a }),
            (a, b) => a.or(b),
        };
        Self {
            factor: self.factor * next.factor,
            largest,
        }
    }
}

/// Refuses a tokenizer whose normalizer and pre-tokenizer together, or whose decoder, may make
/// text more than [`MAX_TEXT_GROWTH`] times longer; `parts` are its `normalizer`,
/// `pre_tokenizer` and `decoder` as JSON (`null` where it has none).
///
/// # Errors
/// One sentence naming the bound and the step that grows text most.
pub(crate) fn check(
    normalizer: &Value,
    pre_tokenizer: &Value,
    decoder: &Value,
) -> Result<(), String> {
    let into_model = optional(normalizer, normalizer_growth)?
        .then(optional(pre_tokenizer, pre_tokenizer_growth)?);
    refuse_past_limit(&into_model, "its normalizer and pre-tokenizer")?;
    refuse_past_limit(&optional(decoder, decoder_growth)?, "its decoder")
}

fn refuse_past_limit(growth: &Growth, whose: &str) -> Result<(), String> {
    if growth.factor <= MAX_TEXT_GROWTH {
        return Ok(());
    }
    let by = growth
        .largest
        .as_ref()
        .map(|(f, what)| format!(" ({what} alone: {f:.0} times)"))
        .unwrap_or_default();
    Err(format!(
        "{whose} may make text up to {:.0} times longer{by}, past the {MAX_TEXT_GROWTH:.0} \
         times pipe tokenizes with (a corpus piece that long would exhaust memory)",
        growth.factor.min(1e18)
    ))
}

fn optional(v: &Value, growth: fn(&Value) -> Result<Growth, String>) -> Result<Growth, String> {
    if v.is_null() {
        Ok(Growth::none())
    } else {
        growth(v)
    }
}

fn kind(v: &Value) -> Result<&str, String> {
    v.get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| format!("a step without a type: {}", short(v)))
}

fn text<'a>(v: &'a Value, field: &str) -> &'a str {
    v.get(field).and_then(Value::as_str).unwrap_or("")
}

fn flag(v: &Value, field: &str) -> bool {
    v.get(field).and_then(Value::as_bool).unwrap_or(false)
}

/// The first 60 characters of `v` as JSON.
fn short(v: &Value) -> String {
    v.to_string().chars().take(60).collect()
}

/// A sequence's steps, in order, under `field`.
fn sequence(
    v: &Value,
    field: &str,
    step: fn(&Value) -> Result<Growth, String>,
) -> Result<Growth, String> {
    let steps = v
        .get(field)
        .and_then(Value::as_array)
        .ok_or_else(|| format!("a Sequence without its {field}"))?;
    steps
        .iter()
        .try_fold(Growth::none(), |g, s| Ok(g.then(step(s)?)))
}

/// `Replace`: each match of `pattern` becomes `content`. A string pattern of `m` bytes matches
/// at most `n / m` times in `n` bytes; a regex (or an empty string) may match the empty text
/// at each of `n + 1` places, at most `n (1 + 2 |content|)` bytes out.
fn replace(v: &Value) -> Growth {
    let content = text(v, "content").len() as f64;
    let pattern = v.get("pattern");
    let string = pattern
        .and_then(|p| p.get("String"))
        .and_then(Value::as_str);
    let (factor, matched) = match string {
        Some(s) if !s.is_empty() => ((content / s.len() as f64).max(1.0), format!("{s:?}")),
        Some(_) => (1.0 + 2.0 * content, "the empty string".into()),
        None => (1.0 + 2.0 * content, "a regex".into()),
    };
    Growth::step(factor, format!("a Replace of {matched} by {content} bytes"))
}

/// `Prepend`: its text before each non-empty piece (at most one piece per byte).
fn prepend(v: &Value) -> Growth {
    let added = text(v, "prepend").len() as f64;
    Growth::step(1.0 + added, format!("a Prepend of {added} bytes"))
}

fn normalizer_growth(v: &Value) -> Result<Growth, String> {
    Ok(match kind(v)? {
        "Sequence" => sequence(v, "normalizers", normalizer_growth)?,
        "Replace" => replace(v),
        "Prepend" => prepend(v),
        "Precompiled" => precompiled(v)?,
        "NFC" | "NFD" => Growth::step(CANONICAL_GROWTH, "a canonical Unicode form"),
        "NFKC" | "NFKD" => Growth::step(COMPATIBILITY_GROWTH, "a compatibility Unicode form"),
        "Lowercase" => Growth::step(LOWERCASE_GROWTH, "Lowercase"),
        // Each byte becomes one of 256 characters of at most 2 bytes.
        "ByteLevel" => Growth::step(2.0, "ByteLevel"),
        "BertNormalizer" => {
            // Spaces around each CJK character (3 bytes or more become at most 5); accents
            // stripped after a canonical decomposition; lowercasing.
            let chinese = if flag(v, "handle_chinese_chars") {
                5.0 / 3.0
            } else {
                1.0
            };
            let lowercase = flag(v, "lowercase");
            let strips = v
                .get("strip_accents")
                .and_then(Value::as_bool)
                .unwrap_or(lowercase);
            let accents = if strips { CANONICAL_GROWTH } else { 1.0 };
            let lower = if lowercase { LOWERCASE_GROWTH } else { 1.0 };
            Growth::step(chinese * accents * lower, "BertNormalizer")
        }
        "Strip" | "StripAccents" | "Nmt" => Growth::none(),
        other => {
            return Err(format!(
                "a normalizer of type {other:?}, whose growth pipe cannot bound"
            ));
        }
    })
}

fn pre_tokenizer_growth(v: &Value) -> Result<Growth, String> {
    Ok(match kind(v)? {
        "Sequence" => sequence(v, "pretokenizers", pre_tokenizer_growth)?,
        // A space before each piece that lacks one (at most one per byte), then each byte as a
        // character of at most 2 bytes.
        "ByteLevel" if flag(v, "add_prefix_space") => {
            Growth::step(4.0, "ByteLevel with a prefix space")
        }
        "ByteLevel" => Growth::step(2.0, "ByteLevel"),
        "Metaspace" => {
            // Each space becomes the replacement character; unless the scheme is `never`, the
            // character also goes before each piece (at most one per byte).
            let mark = text(v, "replacement")
                .chars()
                .next()
                .map_or(4, char::len_utf8) as f64;
            let before = if text(v, "prepend_scheme") == "never" {
                0.0
            } else {
                mark
            };
            Growth::step(mark + before, "Metaspace")
        }
        "Split" | "Whitespace" | "WhitespaceSplit" | "BertPreTokenizer" | "Punctuation"
        | "Digits" | "UnicodeScripts" | "CharDelimiterSplit" | "FixedLength" => Growth::none(),
        other => {
            return Err(format!(
                "a pre-tokenizer of type {other:?}, whose growth pipe cannot bound"
            ));
        }
    })
}

/// A decoder's growth, per byte of the tokens' text it is given.
fn decoder_growth(v: &Value) -> Result<Growth, String> {
    Ok(match kind(v)? {
        "Sequence" => sequence(v, "decoders", decoder_growth)?,
        "Replace" => replace(v),
        // An empty suffix or word delimiter is replaced at each of a token's places.
        "BPEDecoder" if text(v, "suffix").is_empty() => {
            Growth::step(3.0, "a BPEDecoder without a suffix")
        }
        "CTC" if text(v, "word_delimiter_token").is_empty() => {
            Growth::step(3.0, "a CTC decoder without a delimiter")
        }
        // A space before each token that does not continue a word.
        "WordPiece" => Growth::step(2.0, "WordPiece"),
        "BPEDecoder" | "CTC" | "ByteLevel" | "Metaspace" | "ByteFallback" | "Fuse" | "Strip" => {
            Growth::none()
        }
        other => {
            return Err(format!(
                "a decoder of type {other:?}, whose growth pipe cannot bound"
            ));
        }
    })
}

/// `Precompiled` (SentencePiece's character map): a text replaces each matched character (a
/// byte or more). The map is base64 of a 4-byte little-endian trie size, the trie, then the
/// replacement texts, each ended by a NUL; a match may start inside one, so the longest text
/// bounds a match's output.
fn precompiled(v: &Value) -> Result<Growth, String> {
    use base64::Engine as _;
    let encoded = text(v, "precompiled_charsmap");
    let map = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|e| format!("a Precompiled map that is not base64: {e}"))?;
    let trie = map
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or("a Precompiled map shorter than its header")?;
    let texts = map.get(4 + (trie / 4) * 4..).unwrap_or(&[]);
    let longest = texts.split(|&b| b == 0).map(<[u8]>::len).max().unwrap_or(0);
    Ok(Growth::step(
        (longest as f64).max(1.0),
        format!("a Precompiled map whose longest replacement is {longest} bytes"),
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;

    fn growth(normalizer: Value, pre: Value) -> f64 {
        optional(&normalizer, normalizer_growth)
            .unwrap()
            .then(optional(&pre, pre_tokenizer_growth).unwrap())
            .factor
    }

    #[test]
    fn common_tokenizers_are_well_within_the_limit() {
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false});
        // GPT-2: no normalizer, byte level.
        assert_eq!(growth(Value::Null, byte_level.clone()), 2.0);
        // Qwen-like: NFC, then a split and byte level.
        let qwen_pre = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\s+"}}, byte_level]});
        assert_eq!(growth(json!({"type": "NFC"}), qwen_pre), 6.0);
        // Llama-like: prepend and replace a space by U+2581.
        let llama = json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]});
        assert_eq!(growth(llama, Value::Null), 12.0);
        // BERT.
        let bert = json!({"type": "BertNormalizer", "clean_text": true,
            "handle_chinese_chars": true, "strip_accents": null, "lowercase": true});
        assert!(growth(bert, json!({"type": "BertPreTokenizer"})) < 8.0);
        // A T5-like map (the longest replacement is U+FDFA's 33 bytes) and Metaspace.
        let map = [
            &16u32.to_le_bytes()[..],
            &[0; 16],
            "a\0".as_bytes(),
            &[b'x'; 33],
            b"\0",
        ]
        .concat();
        let t5 = json!({"type": "Precompiled", "precompiled_charsmap":
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, map)});
        let meta =
            json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "always"});
        assert_eq!(growth(t5.clone(), meta.clone()), 198.0);
        assert_eq!(check(&t5, &meta, &Value::Null), Ok(()));
    }

    #[test]
    fn a_file_that_grows_text_past_the_limit_is_refused_naming_the_step() {
        let long = "e".repeat(100_000);
        let expand = json!({"type": "Replace", "pattern": {"String": "a"}, "content": long});
        let err = check(&expand, &Value::Null, &Value::Null).unwrap_err();
        assert!(err.contains("100000 times longer"), "{err}");
        assert!(err.contains("a Replace of \"a\" by 100000 bytes"), "{err}");
        // Thirty byte-level steps, each fine alone.
        let steps = vec![json!({"type": "ByteLevel"}); 30];
        let doubled = json!({"type": "Sequence", "normalizers": steps});
        let err = check(&doubled, &Value::Null, &Value::Null).unwrap_err();
        assert!(err.contains("1073741824 times"), "{err}");
        // A regex replaced by a short text may match everywhere.
        let regex =
            json!({"type": "Replace", "pattern": {"Regex": ""}, "content": "x".repeat(200)});
        assert!(check(&regex, &Value::Null, &Value::Null).is_err());
        // The decoder is bounded on its own.
        let decoder = json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "_"}, "content": "y".repeat(1000)}]});
        let err = check(&Value::Null, &Value::Null, &decoder).unwrap_err();
        assert!(err.starts_with("its decoder"), "{err}");
        // A step pipe does not know is refused rather than guessed at.
        assert!(check(&json!({"type": "Novel"}), &Value::Null, &Value::Null).is_err());
    }

    /// The Unicode bounds hold for every character, as the `tokenizers` library normalizes it.
    #[test]
    fn unicode_forms_stay_within_their_bounds_for_every_character() {
        use tokenizers::normalizers::{Lowercase, NFC, NFD, NFKC, NFKD};
        use tokenizers::{NormalizedString, Normalizer};
        let forms: [(&dyn Normalizer, f64); 5] = [
            (&NFC, CANONICAL_GROWTH),
            (&NFD, CANONICAL_GROWTH),
            (&NFKC, COMPATIBILITY_GROWTH),
            (&NFKD, COMPATIBILITY_GROWTH),
            (&Lowercase, LOWERCASE_GROWTH),
        ];
        let mut buf = [0u8; 4];
        for c in (0..=0x10FFFF).filter_map(char::from_u32) {
            let s = c.encode_utf8(&mut buf);
            for (form, bound) in &forms {
                let mut n = NormalizedString::from(&*s);
                form.normalize(&mut n).unwrap();
                let grew = n.get().len() as f64 / s.len() as f64;
                assert!(grew <= *bound, "U+{:04X} grows {grew} times", c as u32);
            }
        }
    }
}
