//! How a language model's ids become text and back: a character model's checkpoint carries
//! its vocabulary; a model trained on a tokenized corpus takes the corpus's tokenizer,
//! checked against the checkpoint where the corpus directory is given.

use std::path::Path;

use crate::checkpoint::RunState;
use crate::data::Vocab;
use crate::error::{Result, StageError};
use crate::shards::{MANIFEST, TokenCorpus};
use crate::tokenizer::TextTokenizer;

/// How sampled ids become text: the checkpoint's character vocabulary, or a tokenizer.
pub enum Codec {
    /// A character model's vocabulary.
    Chars(Vocab),
    /// A tokenized corpus's tokenizer.
    Tokenizer(TextTokenizer),
}

impl Codec {
    /// `text` as ids (`what` names it in an error).
    ///
    /// # Errors
    /// Text the vocabulary or tokenizer cannot encode.
    pub fn encode(&self, text: &str, what: &str) -> Result<Vec<u32>> {
        match self {
            Codec::Chars(vocab) => vocab.encode(text, what),
            Codec::Tokenizer(tk) => tk.encode(text, what),
        }
    }

    /// The prompt and what followed it, as text.
    pub fn decode(&self, prompt_text: &str, prompt: &[u32], sampled: &[u32]) -> String {
        match self {
            Codec::Chars(vocab) => format!("{prompt_text}{}", vocab.decode(sampled)),
            // Decoded whole: a subword tokenizer may join a token across the prompt's end.
            Codec::Tokenizer(tk) => tk.decode(&[prompt, sampled].concat()),
        }
    }
}

/// The tokenizer at `path`, for a checkpoint trained on corpus `trained_on`.
fn tokenizer_at(path: &Path, trained_on: Option<&str>) -> Result<TextTokenizer> {
    if path.join(MANIFEST).is_file() {
        let corpus = TokenCorpus::open(path)?;
        let fingerprint = corpus.manifest().fingerprint();
        if let Some(expected) = trained_on.filter(|&f| f != fingerprint) {
            return Err(StageError::Input(format!(
                "--tokenizer {}: not the corpus the checkpoint trained on (its fingerprint is \
                 {fingerprint}, the checkpoint's {expected})",
                path.display()
            )));
        }
        return corpus.tokenizer();
    }
    let file = if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    };
    TextTokenizer::from_file(&file)
}

/// The codec of the checkpoint in `dir` whose run state is `state`, predicting `outputs`
/// tokens: the tokenizer at `tokenizer` when given, else its character vocabulary.
///
/// # Errors
/// Bad input for a checkpoint of a model without a vocabulary or tokenizer, or a tokenizer
/// of another corpus or vocabulary size.
pub fn codec_for(
    dir: &Path,
    state: &RunState,
    outputs: usize,
    tokenizer: Option<&Path>,
) -> Result<Codec> {
    if let Some(path) = tokenizer {
        let tk = tokenizer_at(path, state.corpus.as_deref())?;
        if tk.vocab_size() != outputs {
            return Err(StageError::Input(format!(
                "--tokenizer has a vocabulary of {} tokens; the model in {} predicts {outputs}",
                tk.vocab_size(),
                dir.display()
            )));
        }
        return Ok(Codec::Tokenizer(tk));
    }
    if let Some(vocab) = &state.vocab {
        // The run state's vocabulary must be the one the model was sized for: one character
        // per output, each once (a state edited by hand and given a fresh hash is read here).
        let distinct = vocab
            .chars
            .iter()
            .collect::<std::collections::HashSet<_>>()
            .len();
        if vocab.len() != outputs || distinct != vocab.len() {
            return Err(StageError::Input(format!(
                "{}: its vocabulary ({} characters, {} distinct) is not the one its model \
                 predicts ({outputs} tokens): the checkpoint is damaged",
                dir.display(),
                vocab.len(),
                distinct
            )));
        }
        return Ok(Codec::Chars(vocab.clone()));
    }
    Err(StageError::Input(if state.corpus.is_some() {
        format!(
            "{} was trained on a tokenized corpus: give its tokenizer with --tokenizer (the \
             corpus's directory or a tokenizer.json)",
            dir.display()
        )
    } else {
        format!(
            "{} holds model {}, which is not a language model (no vocabulary)",
            dir.display(),
            state.model
        )
    }))
}
