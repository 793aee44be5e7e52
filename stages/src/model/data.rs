//! Datasets: the IDX reader (MNIST's format, raw or gzip), the vendored MNIST (embedded in the
//! binary, so `pipe train` works anywhere), a seeded synthetic dataset labelled by a fixed random
//! teacher network, and seeded shuffling into microbatches.
//!
//! Readers trust nothing: magic, type code, rank, dimensions and length are checked before any
//! allocation sized by the file, and decompression is capped.

use std::io::Read;
use std::path::Path;

use pipe_kernels::Tensor;
use rand::Rng as _;
use rand::seq::SliceRandom;
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};

use crate::error::{Result, StageError};
use crate::rng::rng_for;

/// Largest decompressed IDX file accepted (MNIST's largest is 47 MB).
pub const MAX_IDX_BYTES: usize = 512 << 20;

const TRAIN_IMAGES: &[u8] = include_bytes!("../../../data/mnist/train-images-idx3-ubyte.gz");
const TRAIN_LABELS: &[u8] = include_bytes!("../../../data/mnist/train-labels-idx1-ubyte.gz");
const TEST_IMAGES: &[u8] = include_bytes!("../../../data/mnist/t10k-images-idx3-ubyte.gz");
const TEST_LABELS: &[u8] = include_bytes!("../../../data/mnist/t10k-labels-idx1-ubyte.gz");

/// MNIST pixel mean and standard deviation (of pixel / 255 over the training set).
const MNIST_MEAN: f32 = 0.1307;
const MNIST_STD: f32 = 0.3081;

fn data_err(name: &str, reason: impl Into<String>) -> StageError {
    StageError::Data {
        source_name: name.to_string(),
        reason: reason.into(),
    }
}

/// A parsed IDX file of unsigned bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Idx {
    /// Dimensions, outermost first.
    pub dims: Vec<usize>,
    /// The elements, row-major.
    pub data: Vec<u8>,
}

/// Decompresses `bytes` if they start with the gzip magic, refusing output over
/// [`MAX_IDX_BYTES`].
///
/// # Errors
/// [`StageError::Data`] for corrupt gzip streams or oversize output.
pub fn maybe_gunzip(bytes: &[u8], name: &str) -> Result<Vec<u8>> {
    if bytes.len() < 2 || bytes[0] != 0x1f || bytes[1] != 0x8b {
        return Ok(bytes.to_vec());
    }
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(bytes)
        .take(MAX_IDX_BYTES as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| data_err(name, format!("corrupt gzip stream: {e}")))?;
    if out.len() > MAX_IDX_BYTES {
        return Err(data_err(
            name,
            format!("decompresses to more than {MAX_IDX_BYTES} bytes"),
        ));
    }
    Ok(out)
}

/// Parses an IDX file of unsigned bytes (type code 0x08), raw or gzip-compressed.
///
/// # Errors
/// [`StageError::Data`] naming the problem: bad magic, unsupported type, zero or oversize
/// dimensions, truncated or trailing data.
pub fn parse_idx(bytes: &[u8], name: &str) -> Result<Idx> {
    let raw = maybe_gunzip(bytes, name)?;
    if raw.len() < 4 {
        return Err(data_err(
            name,
            format!("truncated: {} bytes, no IDX header", raw.len()),
        ));
    }
    if raw[0] != 0 || raw[1] != 0 {
        return Err(data_err(
            name,
            format!(
                "bad magic {:02x}{:02x}{:02x}{:02x}: not an IDX file",
                raw[0], raw[1], raw[2], raw[3]
            ),
        ));
    }
    if raw[2] != 0x08 {
        return Err(data_err(
            name,
            format!(
                "IDX type code 0x{:02x} is not supported (only unsigned bytes, 0x08)",
                raw[2]
            ),
        ));
    }
    let rank = raw[3] as usize;
    if !(1..=4).contains(&rank) {
        return Err(data_err(name, format!("IDX rank {rank} is not in 1..=4")));
    }
    let header = 4 + 4 * rank;
    if raw.len() < header {
        return Err(data_err(
            name,
            format!("truncated header: {} of {header} bytes", raw.len()),
        ));
    }
    let mut dims = Vec::with_capacity(rank);
    let mut total: usize = 1;
    for i in 0..rank {
        let o = 4 + 4 * i;
        let d = u32::from_be_bytes([raw[o], raw[o + 1], raw[o + 2], raw[o + 3]]) as usize;
        if d == 0 {
            return Err(data_err(name, format!("dimension {i} is zero")));
        }
        total = total
            .checked_mul(d)
            .filter(|t| *t <= MAX_IDX_BYTES)
            .ok_or_else(|| data_err(name, "dimensions describe more data than allowed"))?;
        dims.push(d);
    }
    let body = raw.len() - header;
    if body < total {
        return Err(data_err(
            name,
            format!("truncated: dimensions {dims:?} need {total} bytes of data, found {body}"),
        ));
    }
    if body > total {
        return Err(data_err(
            name,
            format!("{} trailing bytes after {dims:?} elements", body - total),
        ));
    }
    let mut data = raw;
    data.drain(..header);
    Ok(Idx { dims, data })
}

/// Reads and parses an IDX file from disk.
///
/// # Errors
/// [`StageError::Data`] when the file is missing, unreadable or malformed.
pub fn read_idx(path: &Path) -> Result<Idx> {
    let name = path.display().to_string();
    let bytes = crate::limits::read_file(path, MAX_IDX_BYTES as u64)?;
    parse_idx(&bytes, &name)
}

/// Where a dataset's samples are.
#[derive(Clone, Debug, PartialEq)]
pub enum Samples {
    /// In memory: features sample-major, and `targets` labels per sample.
    Memory {
        /// Features, sample-major.
        features: Vec<f32>,
        /// Labels in `0..classes`.
        labels: Vec<u32>,
    },
    /// Windows of a tokenized corpus, read from its memory-mapped shards as they are needed.
    Tokens(crate::shards::TokenWindows),
}

/// A dataset of classification samples or next-token windows.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    /// Name for messages and logs.
    pub name: String,
    /// Per-sample feature shape.
    pub feature_shape: Vec<usize>,
    /// The samples.
    pub samples: Samples,
    /// Number of classes (the vocabulary size of a language-modelling set).
    pub classes: usize,
    /// Targets per sample: 1 for classification, the tokens of a window for next-token
    /// prediction (the model's output has one row per target).
    pub targets: usize,
}

impl Dataset {
    /// Number of samples.
    pub fn len(&self) -> usize {
        match &self.samples {
            Samples::Memory { labels, .. } => labels.len() / self.targets.max(1),
            Samples::Tokens(w) => usize::try_from(w.len()).unwrap_or(usize::MAX),
        }
    }

    /// True when the dataset is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Features per sample.
    pub fn sample_size(&self) -> usize {
        self.feature_shape.iter().product()
    }

    /// Keeps the first `n` samples.
    pub fn truncate(&mut self, n: usize) {
        let (d, k) = (self.sample_size(), self.targets.max(1));
        match &mut self.samples {
            Samples::Memory { features, labels } => {
                features.truncate(n * d);
                labels.truncate(n * k);
            }
            Samples::Tokens(w) => w.truncate(n as u64),
        }
    }

    /// Gathers the samples `indices` into a batch tensor `[len, feature_shape...]` and a label
    /// tensor (`targets` per sample), both in host memory.
    ///
    /// # Errors
    /// [`StageError::Data`] for an index past the end, or a token id outside a corpus's
    /// vocabulary (naming its shard and offset).
    pub fn gather(&self, indices: &[u32]) -> Result<(Tensor, Tensor<u32>)> {
        let d = self.sample_size();
        let k = self.targets.max(1);
        let mut x = Vec::with_capacity(indices.len() * d);
        let mut y = Vec::with_capacity(indices.len() * k);
        let past = |i: u32| {
            data_err(
                &self.name,
                format!("sample {i} is past its {} samples", self.len()),
            )
        };
        match &self.samples {
            Samples::Memory { features, labels } => {
                for &i in indices {
                    let i = i as usize;
                    x.extend_from_slice(
                        features
                            .get(i * d..(i + 1) * d)
                            .ok_or_else(|| past(i as u32))?,
                    );
                    y.extend_from_slice(&labels[i * k..(i + 1) * k]);
                }
            }
            Samples::Tokens(w) => {
                let mut ids = Vec::with_capacity(w.context() + 1);
                for &i in indices {
                    if u64::from(i) >= w.len() {
                        return Err(past(i));
                    }
                    w.gather_into(u64::from(i), &mut x, &mut y, &mut ids)?;
                }
            }
        }
        let mut shape = vec![indices.len()];
        shape.extend_from_slice(&self.feature_shape);
        let n = y.len();
        Ok((Tensor::from_vec(&shape, x)?, Tensor::from_vec(&[n], y)?))
    }

    /// The fingerprint of the tokenized corpus the samples are read from (`None` for data in
    /// memory).
    pub fn corpus_fingerprint(&self) -> Option<String> {
        match &self.samples {
            Samples::Memory { .. } => None,
            Samples::Tokens(w) => Some(w.corpus().manifest().fingerprint()),
        }
    }

    /// The order of samples in epoch `epoch`: a seeded permutation, independent per epoch, or
    /// the stored order.
    pub fn epoch_order(&self, seed: u64, epoch: u64, how: DataOrder) -> Vec<u32> {
        let mut order: Vec<u32> = (0..self.len() as u32).collect();
        if how == DataOrder::Shuffled {
            order.shuffle(&mut rng_for(seed, "shuffle", epoch));
        }
        order
    }
}

/// The order an epoch visits the training samples in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DataOrder {
    /// A seeded permutation per epoch (`derive_seed(seed, "shuffle", epoch)`).
    #[default]
    Shuffled,
    /// Sample 0, 1, 2, ... every epoch: for a run another trainer must follow window by
    /// window (`experiments/parity/`).
    Sequential,
}

impl DataOrder {
    /// The name flags and configs use.
    pub fn name(self) -> &'static str {
        match self {
            DataOrder::Shuffled => "shuffled",
            DataOrder::Sequential => "sequential",
        }
    }
}

impl std::str::FromStr for DataOrder {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "shuffled" => Ok(DataOrder::Shuffled),
            "sequential" => Ok(DataOrder::Sequential),
            _ => Err(format!(
                "unknown data order '{s}' (expected shuffled or sequential)"
            )),
        }
    }
}

/// A train and a test split.
#[derive(Clone, Debug)]
pub struct Splits {
    /// Training samples.
    pub train: Dataset,
    /// Held-out samples.
    pub test: Dataset,
    /// The vocabulary of a text corpus (None for other data).
    pub vocab: Option<Vocab>,
}

/// Tiny Shakespeare (1,115,394 characters of Shakespeare's plays, public domain; see
/// `data/README.md`), embedded so that character models train anywhere.
const TINYSHAKESPEARE: &str = include_str!("../../../data/tinyshakespeare.txt");

/// Largest text corpus read from disk.
pub const MAX_TEXT_BYTES: usize = 256 << 20;

/// Smallest corpus file read: shorter texts leave too little to hold out.
pub const MIN_TEXT_BYTES: usize = 1024;

/// Share of a corpus, in tenths, that trains; the rest (the end of the text) validates.
const TRAIN_TENTHS: usize = 9;

/// A character vocabulary: the distinct characters of a training text, sorted, id = index.
/// One read from a file (a corpus's `vocab.json`, a checkpoint's run state) is refused unless
/// its characters are sorted and distinct, as [`Vocab::encode`]'s search needs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "VocabFile")]
pub struct Vocab {
    /// The characters, by id.
    pub chars: Vec<char>,
}

/// A [`Vocab`] as a file holds it, before its order is checked.
#[derive(Deserialize)]
struct VocabFile {
    chars: Vec<char>,
}

impl TryFrom<VocabFile> for Vocab {
    type Error = String;

    fn try_from(file: VocabFile) -> std::result::Result<Self, String> {
        if let Some(pair) = file.chars.windows(2).find(|pair| pair[0] >= pair[1]) {
            return Err(format!(
                "a character vocabulary must be sorted with each character once: {:?} comes \
                 before {:?}",
                pair[0], pair[1]
            ));
        }
        Ok(Self { chars: file.chars })
    }
}

impl Vocab {
    /// The vocabulary of `text`.
    pub fn from_text(text: &str) -> Self {
        let set: std::collections::BTreeSet<char> = text.chars().collect();
        Self {
            chars: set.into_iter().collect(),
        }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    /// True for an empty vocabulary.
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The ids of `text`.
    ///
    /// # Errors
    /// [`StageError::Data`] naming the first character the vocabulary lacks.
    pub fn encode(&self, text: &str, name: &str) -> Result<Vec<u32>> {
        text.chars()
            .enumerate()
            .map(|(i, c)| {
                self.chars
                    .binary_search(&c)
                    .map(|id| id as u32)
                    .map_err(|_| {
                        data_err(
                            name,
                            format!("character {c:?} at {i} is not in the vocabulary"),
                        )
                    })
            })
            .collect()
    }

    /// The text of `ids` (ids outside the vocabulary become U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&i| self.chars.get(i as usize).copied().unwrap_or('\u{fffd}'))
            .collect()
    }
}

/// Cuts token ids into next-token windows of `context`: sample `i` reads
/// `ids[i T .. i T + T]` and predicts `ids[i T + 1 .. i T + T + 1]`.
fn windows(ids: &[u32], context: usize, vocab: usize, name: &str) -> Result<Dataset> {
    let n = ids.len().saturating_sub(1) / context.max(1);
    if n == 0 {
        return Err(data_err(
            name,
            format!(
                "{} tokens cannot fill one window of {context} (plus the next token)",
                ids.len()
            ),
        ));
    }
    let used = n * context;
    Ok(Dataset {
        name: name.to_string(),
        feature_shape: vec![context],
        samples: Samples::Memory {
            features: ids[..used].iter().map(|&t| t as f32).collect(),
            labels: ids[1..=used].to_vec(),
        },
        classes: vocab,
        targets: context,
    })
}

/// A character corpus as next-token data: the first 90% of `text` trains (and defines the
/// vocabulary), the last 10% validates, both cut into windows of `context` characters.
///
/// # Errors
/// [`StageError::Data`] for a corpus too short for a window in either split, or a validation
/// character the training text lacks.
pub fn char_corpus(text: &str, context: usize, name: &str) -> Result<Splits> {
    let (train_text, test_text) = split_text(text);
    let vocab = Vocab::from_text(&train_text);
    let train_name = format!("{name}-train");
    let test_name = format!("{name}-val");
    let train_ids = vocab.encode(&train_text, &train_name)?;
    let test_ids = vocab.encode(&test_text, &test_name)?;
    Ok(Splits {
        train: windows(&train_ids, context, vocab.len(), &train_name)?,
        test: windows(&test_ids, context, vocab.len(), &test_name)?,
        vocab: Some(vocab),
    })
}

/// The text of Tiny Shakespeare: the embedded copy, or `dir/tinyshakespeare.txt` (UTF-8).
///
/// # Errors
/// [`StageError::Data`] for a missing, oversize or non-UTF-8 file.
pub fn tinyshakespeare_text(dir: Option<&Path>) -> Result<std::borrow::Cow<'static, str>> {
    let Some(d) = dir else {
        return Ok(std::borrow::Cow::Borrowed(TINYSHAKESPEARE));
    };
    let path = d.join("tinyshakespeare.txt");
    let name = path.display().to_string();
    let file = crate::limits::open_regular(&path)
        .map_err(|e| data_err(&name, format!("cannot read: {e}")))?;
    let mut bytes = Vec::new();
    file.take(MAX_TEXT_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| data_err(&name, format!("cannot read: {e}")))?;
    if bytes.len() > MAX_TEXT_BYTES {
        return Err(data_err(
            &name,
            format!("larger than {MAX_TEXT_BYTES} bytes"),
        ));
    }
    if bytes.len() < MIN_TEXT_BYTES {
        return Err(data_err(
            &name,
            format!(
                "{} bytes; a corpus needs at least {MIN_TEXT_BYTES} (its last tenth is held out, \
                 and both parts must cover its characters)",
                bytes.len()
            ),
        ));
    }
    let text =
        String::from_utf8(bytes).map_err(|e| data_err(&name, format!("not UTF-8 text: {e}")))?;
    Ok(std::borrow::Cow::Owned(text))
}

/// The training part of a corpus (its first 90%) and the rest.
fn split_text(text: &str) -> (String, String) {
    let chars: Vec<char> = text.chars().collect();
    let cut = chars.len() * TRAIN_TENTHS / 10;
    (chars[..cut].iter().collect(), chars[cut..].iter().collect())
}

/// The vocabulary a corpus's training part defines.
pub fn corpus_vocab(text: &str) -> Vocab {
    Vocab::from_text(&split_text(text).0)
}

/// Tiny Shakespeare (see [`tinyshakespeare_text`]) as next-token windows of `context`
/// characters.
///
/// # Errors
/// As [`tinyshakespeare_text`] and [`char_corpus`].
pub fn tinyshakespeare(dir: Option<&Path>, context: usize) -> Result<Splits> {
    char_corpus(&tinyshakespeare_text(dir)?, context, "tinyshakespeare")
}

fn mnist_pair(images: Idx, labels: Idx, name: &str) -> Result<Dataset> {
    if images.dims.len() != 3 {
        return Err(data_err(
            name,
            format!(
                "images have dimensions {:?}, expected [n, rows, cols]",
                images.dims
            ),
        ));
    }
    if labels.dims.len() != 1 {
        return Err(data_err(
            name,
            format!("labels have dimensions {:?}, expected [n]", labels.dims),
        ));
    }
    if images.dims[0] != labels.dims[0] {
        return Err(data_err(
            name,
            format!("{} images but {} labels", images.dims[0], labels.dims[0]),
        ));
    }
    if let Some(pos) = labels.data.iter().position(|&l| l > 9) {
        return Err(data_err(
            name,
            format!("label {} at {pos} is not a digit", labels.data[pos]),
        ));
    }
    let features = images
        .data
        .iter()
        .map(|&p| (p as f32 / 255.0 - MNIST_MEAN) / MNIST_STD)
        .collect();
    Ok(Dataset {
        name: name.to_string(),
        feature_shape: images.dims[1..].to_vec(),
        samples: Samples::Memory {
            features,
            labels: labels.data.iter().map(|&l| u32::from(l)).collect(),
        },
        classes: 10,
        targets: 1,
    })
}

/// A tokenized corpus ([`crate::shards`]) as next-token windows of `context` ids: its
/// `holdout` part validates, thinned evenly to at most `max_eval` windows; read as packed
/// documents ending with the id `pack` when given ([`crate::shards::TokenWindows::packed`]).
///
/// # Errors
/// As [`crate::shards::token_splits`].
pub fn token_corpus(
    dir: &Path,
    context: usize,
    holdout: crate::shards::Holdout,
    max_eval: u64,
    pack: Option<u32>,
) -> Result<Splits> {
    let (train, eval) = crate::shards::token_splits(dir, context, holdout, max_eval)?;
    let (train, eval) = (train.packed(pack), eval.packed(pack));
    let vocab =
        usize::try_from(train.corpus().manifest().tokenizer.vocab_size).unwrap_or(usize::MAX);
    let name = dir.display().to_string();
    let dataset = |w, part: &str| Dataset {
        name: format!("{name}-{part}"),
        feature_shape: vec![context],
        samples: Samples::Tokens(w),
        classes: vocab,
        targets: context,
    };
    Ok(Splits {
        train: dataset(train, "train"),
        test: dataset(eval, "val"),
        vocab: None,
    })
}

/// MNIST: from `dir` (the four `*-idx?-ubyte[.gz]` files) or, with `None`, the copy embedded in
/// this build. Pixels are scaled to `[0, 1]` and standardised with MNIST's mean and deviation.
///
/// # Errors
/// [`StageError::Data`] when a file is missing or malformed, or images and labels disagree.
pub fn mnist(dir: Option<&Path>) -> Result<Splits> {
    let load = |stem: &str, embedded: &'static [u8]| -> Result<Idx> {
        match dir {
            None => parse_idx(embedded, &format!("embedded mnist {stem}")),
            Some(d) => {
                let gz = d.join(format!("{stem}.gz"));
                let raw = d.join(stem);
                if gz.exists() {
                    read_idx(&gz)
                } else if raw.exists() {
                    read_idx(&raw)
                } else {
                    Err(data_err(
                        &raw.display().to_string(),
                        "missing (neither it nor its .gz exists)",
                    ))
                }
            }
        }
    };
    let train = mnist_pair(
        load("train-images-idx3-ubyte", TRAIN_IMAGES)?,
        load("train-labels-idx1-ubyte", TRAIN_LABELS)?,
        "mnist-train",
    )?;
    let test = mnist_pair(
        load("t10k-images-idx3-ubyte", TEST_IMAGES)?,
        load("t10k-labels-idx1-ubyte", TEST_LABELS)?,
        "mnist-test",
    )?;
    if train.feature_shape != test.feature_shape {
        return Err(data_err(
            "mnist",
            format!(
                "training images are {:?} and test images {:?}: a model takes one shape",
                train.feature_shape, test.feature_shape
            ),
        ));
    }
    Ok(Splits {
        train,
        test,
        vocab: None,
    })
}

/// Shape of the synthetic dataset.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SyntheticConfig {
    /// Features per sample.
    pub inputs: usize,
    /// Classes.
    pub classes: usize,
    /// Hidden width of the teacher network.
    pub hidden: usize,
    /// Training samples.
    pub train: usize,
    /// Test samples.
    pub test: usize,
}

impl SyntheticConfig {
    /// Checks the shape against [`crate::limits::MAX_TENSOR_ELEMENTS`]: samples times inputs
    /// (the features it generates) and its teacher network's layers (inputs times hidden,
    /// hidden times classes).
    ///
    /// # Errors
    /// [`StageError::Limit`] naming the setting.
    pub fn check(&self) -> Result<()> {
        use crate::limits::{MAX_TENSOR_ELEMENTS, check_count};
        let why = "elements of one tensor, 8 GiB of f32";
        let samples = (self.train as u64).saturating_add(self.test as u64);
        let inputs = self.inputs as u64;
        let hidden = self.hidden as u64;
        for (what, n) in [
            ("synthetic samples x inputs", samples.saturating_mul(inputs)),
            ("synthetic inputs x hidden", inputs.saturating_mul(hidden)),
            (
                "synthetic hidden x classes",
                hidden.saturating_mul(self.classes as u64),
            ),
        ] {
            check_count(what, n, MAX_TENSOR_ELEMENTS, why)?;
        }
        Ok(())
    }
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        Self {
            inputs: 784,
            classes: 10,
            hidden: 64,
            train: 8192,
            test: 2048,
        }
    }
}

impl SyntheticConfig {
    /// The bytes the dataset takes while it is drawn: its `f32` features and `u32` labels,
    /// both splits, and the teacher network that labels them (its `inputs x hidden` and
    /// `hidden x classes` weights, the classes' biases, one sample's hidden units), which
    /// [`SyntheticConfig::check`] admits at up to 8 GiB a layer.
    pub fn bytes(&self) -> f64 {
        let (d, h, c) = (self.inputs as f64, self.hidden as f64, self.classes as f64);
        let samples = self.train as f64 + self.test as f64;
        (samples * (d + 1.0) + d * h + h * c + c + h) * 4.0
    }

    /// What the dataset holds, for the memory gate's message.
    pub fn holding(&self) -> String {
        format!(
            "a synthetic dataset of {} samples of {} inputs labelled by a teacher of {} \
             hidden units",
            self.train as u64 + self.test as u64,
            self.inputs,
            self.hidden
        )
    }
}

/// Passes the synthetic dataset's memory ([`SyntheticConfig::bytes`]) through the memory
/// gate before any of it is drawn, for a command that takes no `--force` (`pipe eval` of a
/// checkpoint that asks for it, the experiments): the shape bounds of
/// [`SyntheticConfig::check`] admit 8 GiB, which a host may not have. `pipe train` counts the
/// dataset in the run's own first look instead, which `--force` lifts.
///
/// # Errors
/// [`StageError::Limit`] naming a shape past [`SyntheticConfig::check`]'s bounds, or the
/// dataset and the memory it is over.
pub fn admit_synthetic_memory(cfg: &SyntheticConfig) -> Result<()> {
    // The shape's own bounds first: a shape past them is named by the setting at fault.
    cfg.check()?;
    let holding = cfg.holding();
    let need = crate::limits::MemoryNeed {
        bytes: cfg.bytes(),
        workers: 1,
        holding: &holding,
        lower: "lower the synthetic dataset's train, test, inputs or hidden",
    };
    crate::limits::admit_memory(&need, &crate::limits::Machine::detect())
}

/// A seeded synthetic dataset: standard-normal inputs labelled by the arg-max of a fixed random
/// teacher network `inputs -> hidden (tanh) -> classes`. Learnable, file-free, reproducible.
///
/// # Errors
/// [`StageError::Config`] for zero sizes or fewer than two classes; [`StageError::Limit`] for a
/// shape past [`SyntheticConfig::check`]'s bounds (checked here, so that a shape read from a
/// checkpoint is bounded as one from a config file is).
pub fn synthetic(cfg: &SyntheticConfig, seed: u64) -> Result<Splits> {
    cfg.check()?;
    if cfg.inputs == 0 || cfg.hidden == 0 || cfg.train == 0 || cfg.test == 0 {
        return Err(StageError::Config(format!(
            "synthetic dataset sizes must be positive: {cfg:?}"
        )));
    }
    if cfg.classes < 2 {
        return Err(StageError::Config(format!(
            "synthetic dataset needs >= 2 classes, got {}",
            cfg.classes
        )));
    }
    let (d, h, c) = (cfg.inputs, cfg.hidden, cfg.classes);
    let mut trng = rng_for(seed, "synthetic-teacher", 0);
    let w1: Vec<f32> = (0..d * h)
        .map(|_| {
            let v: f32 = StandardNormal.sample(&mut trng);
            v / (d as f32).sqrt()
        })
        .collect();
    let w2: Vec<f32> = (0..h * c)
        .map(|_| StandardNormal.sample(&mut trng))
        .collect();
    let b2: Vec<f32> = (0..c).map(|_| trng.random_range(-0.1..0.1)).collect();
    let make = |n: usize, index: u64, name: &str| {
        let mut rng = rng_for(seed, "synthetic-data", index);
        let features: Vec<f32> = (0..n * d)
            .map(|_| StandardNormal.sample(&mut rng))
            .collect();
        let labels = features
            .chunks_exact(d)
            .map(|x| {
                let hid: Vec<f32> = (0..h)
                    .map(|j| (0..d).map(|i| x[i] * w1[i * h + j]).sum::<f32>().tanh())
                    .collect();
                let mut best = (0u32, f32::NEG_INFINITY);
                for k in 0..c {
                    let v = b2[k] + (0..h).map(|j| hid[j] * w2[j * c + k]).sum::<f32>();
                    if v > best.1 {
                        best = (k as u32, v);
                    }
                }
                best.0
            })
            .collect();
        Dataset {
            name: name.to_string(),
            feature_shape: vec![d],
            samples: Samples::Memory { features, labels },
            classes: c,
            targets: 1,
        }
    };
    Ok(Splits {
        train: make(cfg.train, 0, "synthetic-train"),
        test: make(cfg.test, 1, "synthetic-test"),
        vocab: None,
    })
}
