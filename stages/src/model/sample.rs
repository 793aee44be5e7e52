//! Text generation from a trained language model: the model runs forward on the last
//! `context` tokens, and the next token is drawn from its final row's distribution, with a
//! temperature and an optional top-k cut, from a seeded generator (the same seed and
//! checkpoint give the same text).

use pipe_kernels::Backend;
use rand::Rng as _;

use crate::error::{Result, StageError};
use crate::layer::Keep;
use crate::model::{Model, Params};
use crate::rng::rng_for;

/// Most tokens one call generates.
pub const MAX_SAMPLE_TOKENS: usize = 1 << 20;

/// How to draw tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleOptions {
    /// Tokens to generate.
    pub tokens: usize,
    /// Softmax temperature; 0 picks the most likely token every time.
    pub temperature: f32,
    /// Draw only among the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Seed of the draws.
    pub seed: u64,
}

impl SampleOptions {
    fn check(&self) -> Result<()> {
        let bad = |m: String| Err(StageError::Config(m));
        if self.tokens > MAX_SAMPLE_TOKENS {
            return bad(format!(
                "--tokens {} is more than the {MAX_SAMPLE_TOKENS} one call generates",
                self.tokens
            ));
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(format!(
                "--temperature must be zero or positive, got {}",
                self.temperature
            ));
        }
        if self.top_k == Some(0) {
            return bad("--top-k must be at least 1".into());
        }
        Ok(())
    }
}

/// Generates `opts.tokens` token ids after `prompt` (ids below the model's vocabulary).
///
/// # Errors
/// An empty prompt, bad options, a model whose input is not a token window; kernel errors.
pub fn generate(
    be: &dyn Backend,
    model: &Model,
    params: &Params,
    prompt: &[u32],
    opts: &SampleOptions,
) -> Result<Vec<u32>> {
    opts.check()?;
    let context = match model.input_shape() {
        [t] => *t,
        other => {
            return Err(StageError::Model(format!(
                "the model takes {other:?}, not a window of tokens"
            )));
        }
    };
    if prompt.is_empty() {
        return Err(StageError::Config(
            "the prompt is empty: give at least one character".into(),
        ));
    }
    let mut ids: Vec<u32> = prompt.to_vec();
    let mut out = Vec::with_capacity(opts.tokens);
    for i in 0..opts.tokens {
        let window = &ids[ids.len().saturating_sub(context)..];
        let x = pipe_kernels::Tensor::from_vec(
            &[1, window.len()],
            window.iter().map(|&t| t as f32).collect(),
        )?;
        let (logits, _) = model.forward_range(
            be,
            0..model.len(),
            params,
            be.place(x)?,
            Keep::Nothing,
            0,
            0,
            None,
        )?;
        let logits = be.read(&logits)?;
        let columns = model.output_shape().last().copied().unwrap_or(0);
        let row = &logits[logits.len().saturating_sub(columns)..];
        // A padded vocabulary's extra columns are not tokens.
        let last = &row[..model.output_classes().min(row.len())];
        check_finite_logits(last, last.len())?;
        let mut rng = rng_for(opts.seed, "sample", i as u64);
        let next = draw(last, opts, rng.random::<f64>());
        ids.push(next);
        out.push(next);
    }
    Ok(out)
}

/// Refuses logits (rows of `vocab`) that are not all finite: weights that overflow in the
/// forward pass (finite, but past what f32 products can hold) give NaN or infinity, from which
/// no token can be drawn and which JSON cannot write.
///
/// # Errors
/// Bad input naming the first position whose logits are not finite.
pub fn check_finite_logits(values: &[f32], vocab: usize) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(at) => Err(StageError::Input(format!(
            "the logits at position {} are not finite ({}): the weights overflow in the forward \
             pass",
            at / vocab.max(1),
            values[at]
        ))),
    }
}

/// The token `u` (uniform in `[0, 1)`) picks from `logits` under `opts`: the arg-max at
/// temperature 0, else the inverse of the cumulative softmax over the top-k logits.
fn draw(logits: &[f32], opts: &SampleOptions, u: f64) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // Most likely first; ties by id, so the order is total.
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if opts.temperature == 0.0 {
        return order.first().copied().unwrap_or(0) as u32;
    }
    order.truncate(opts.top_k.unwrap_or(order.len()).max(1));
    let max = f64::from(logits[order[0]]);
    let t = f64::from(opts.temperature);
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((f64::from(logits[i]) - max) / t).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    for (&i, w) in order.iter().zip(&weights) {
        acc += w / total;
        if u < acc {
            return i as u32;
        }
    }
    order.last().copied().unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(temperature: f32, top_k: Option<usize>) -> SampleOptions {
        SampleOptions {
            tokens: 1,
            temperature,
            top_k,
            seed: 0,
        }
    }

    #[test]
    fn temperature_zero_is_greedy_and_top_one_is_too() {
        let logits = [0.1, 2.0, -1.0, 1.9];
        assert_eq!(draw(&logits, &opts(0.0, None), 0.99), 1);
        assert_eq!(draw(&logits, &opts(1.0, Some(1)), 0.99), 1);
    }

    #[test]
    fn draws_follow_the_softmax_within_the_top_k() {
        // Two equal logits share the mass; the low ones are cut by top-2.
        let logits = [5.0, -9.0, 5.0, -9.0];
        let o = opts(1.0, Some(2));
        assert_eq!(draw(&logits, &o, 0.25), 0);
        assert_eq!(draw(&logits, &o, 0.75), 2);
        // Without the cut, u close to 1 still lands on a likely token.
        assert_eq!(draw(&logits, &opts(1.0, None), 0.999_9), 2);
    }

    #[test]
    fn bad_options_are_refused() {
        for o in [
            opts(-1.0, None),
            opts(f32::NAN, None),
            opts(1.0, Some(0)),
            SampleOptions {
                tokens: MAX_SAMPLE_TOKENS + 1,
                ..opts(1.0, None)
            },
        ] {
            assert!(o.check().is_err(), "{o:?}");
        }
    }
}
