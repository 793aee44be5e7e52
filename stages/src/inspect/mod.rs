//! What a trained checkpoint is used for once training is over: evaluating its weights on a
//! dataset ([`evaluate_checkpoint`]), a language model's logits for given ids ([`logits`]),
//! and the text codec sampling speaks through ([`Codec`]). Each takes typed requests and
//! returns typed results; the command line parses and prints.
//!
//! It sits above [`crate::checkpoint`] and [`crate::train`], whose reading and evaluation it
//! puts together, and below the pipeline, which it never needs.

mod eval;
mod logits;
mod text;

pub use eval::{Evaluation, evaluate_checkpoint};
pub use logits::{WeightsSource, logits};
pub use text::{Codec, codec_for};
