//! The layer profiler: what each layer of a model costs on a backend at one microbatch size,
//! measured rather than estimated from FLOPs, so the partitioner sees what the kernels really
//! do (a ReLU is memory-bound, a narrow linear layer runs far below the GEMM's peak).
//!
//! Every layer is run on its own, on random inputs of the shape it receives in the model:
//! forward, backward-input, backward-weight and the optimizer step, each repeated after a
//! warm-up, and each figure is the median of the repeats. Sizes are counted, not timed: the
//! output activation, the parameters and what the forward saves for the backward. The result is
//! a [`pipe_scheduler::Profile`], the form the planner reads (and `pipe profile` writes as JSON).

use std::time::Instant;

use pipe_kernels::{Backend, Tensor};
use pipe_scheduler::{LayerProfile, Profile};
use rand::Rng as _;

use crate::error::{Result, StageError};
use crate::layers::ForwardCtx;
use crate::model::Model;
use crate::optim::{Optimizer, OptimizerConfig};
use crate::rng::rng_for;

/// How to profile.
#[derive(Clone, Debug)]
pub struct ProfileOptions {
    /// Samples per microbatch.
    pub microbatch_size: usize,
    /// Untimed runs of every operation before the timed ones.
    pub warmup: usize,
    /// Timed runs of every operation; each figure is their median.
    pub repeats: usize,
    /// The optimizer whose step is timed.
    pub optimizer: OptimizerConfig,
    /// Seed of the random inputs and weights.
    pub seed: u64,
}

impl ProfileOptions {
    /// `microbatch_size` samples, 3 warm-up runs, 11 timed runs, SGD with momentum.
    pub fn new(microbatch_size: usize) -> Self {
        ProfileOptions {
            microbatch_size,
            warmup: 3,
            repeats: 11,
            optimizer: OptimizerConfig::default(),
            seed: 0,
        }
    }
}

/// Median of `xs` (the mean of the middle two for an even count).
fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Runs `f` `warmup` times, then `repeats` times; the median of the seconds the timed runs
/// report (each run times its own operation, leaving out its set-up).
fn time_median(warmup: usize, repeats: usize, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        times.push(f()?);
    }
    Ok(median(&mut times))
}

/// Seconds `f` takes.
fn seconds<T>(f: impl FnOnce() -> Result<T>) -> Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

fn random(shape: &[usize], seed: u64, what: &str, i: u64) -> Result<Tensor> {
    let mut rng = rng_for(seed, what, i);
    let n: usize = shape.iter().product();
    let data = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Ok(Tensor::from_vec(shape, data)?)
}

/// Profiles every layer of `model` on `be` (see the module docs). The forward runs in
/// training mode, so dropout draws its masks as it does in training.
///
/// # Errors
/// [`StageError::Config`] for a zero microbatch size or repeat count; kernel errors naming the
/// layer.
pub fn profile_model(
    model: &Model,
    name: &str,
    be: &dyn Backend,
    opts: &ProfileOptions,
) -> Result<Profile> {
    if opts.microbatch_size == 0 || opts.repeats == 0 {
        return Err(StageError::Config(
            "profiling needs a microbatch size and a repeat count of at least 1".into(),
        ));
    }
    let b = opts.microbatch_size;
    let params = model.init_params(opts.seed);
    let mut layers = Vec::with_capacity(model.len());
    for (i, p) in params.iter().enumerate() {
        let layer = model.layer(i);
        let kernel = |op: &'static str| {
            move |source| StageError::Kernel {
                layer: i,
                kind: layer.kind(),
                op,
                source,
            }
        };
        let batch = |shape: &[usize]| {
            let mut s = vec![b];
            s.extend_from_slice(shape);
            s
        };
        let x = random(
            &batch(model.shape_before(i)),
            opts.seed,
            "profile-x",
            i as u64,
        )?;
        let dy = random(
            &batch(model.shape_before(i + 1)),
            opts.seed,
            "profile-dy",
            i as u64,
        )?;
        let ctx = ForwardCtx {
            train: true,
            seed: opts.seed,
        };
        let forward = time_median(opts.warmup, opts.repeats, || {
            // The forward consumes its input: copy it outside the timed call.
            let input = x.clone();
            seconds(|| layer.forward(be, p, input, ctx).map_err(kernel("forward")))
        })?;
        let (y, saved) = layer.forward(be, p, x, ctx).map_err(kernel("forward"))?;
        let backward_input = if i == 0 {
            // The model's first layer never needs its input gradient.
            0.0
        } else {
            time_median(opts.warmup, opts.repeats, || {
                seconds(|| {
                    layer
                        .backward_input(be, p, &saved, &dy)
                        .map_err(kernel("backward_input"))
                })
            })?
        };
        let (backward_weight, update) = if p.is_empty() {
            (0.0, 0.0)
        } else {
            let mut grads: Vec<Tensor> = p.iter().map(|t| Tensor::zeros(t.shape())).collect();
            let bw = time_median(opts.warmup, opts.repeats, || {
                seconds(|| {
                    layer
                        .backward_params(be, p, &saved, &dy, &mut grads, false)
                        .map_err(kernel("backward_params"))
                })
            })?;
            let mut own = vec![p.clone()];
            let grads = vec![grads];
            let mut opt = Optimizer::new(opts.optimizer, &own);
            let up = time_median(opts.warmup, opts.repeats, || {
                seconds(|| opt.step(be, &mut own, &grads, 1e-6))
            })?;
            (bw, up)
        };
        let param_elems: usize = p.iter().map(Tensor::len).sum();
        layers.push(LayerProfile {
            name: format!("{i}:{}", layer.kind()),
            forward,
            backward_input,
            backward_weight,
            update,
            activation_bytes: (y.len() * 4) as f64,
            param_bytes: (param_elems * 4) as f64,
            stash_bytes: Some(saved.bytes() as f64),
        });
    }
    Ok(Profile {
        model: name.to_string(),
        microbatch_size: b,
        layers,
        edges: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::model::ModelSpec;
    use pipe_kernels::CpuBackend;

    #[test]
    fn medians_are_the_middle_value() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }

    #[test]
    fn profiles_count_sizes_exactly_and_time_every_part() {
        let model = Model::new(&ModelSpec::preset("mlp-20-30-5").unwrap()).unwrap();
        let be = CpuBackend::new(1).unwrap();
        let opts = ProfileOptions {
            repeats: 3,
            warmup: 1,
            ..ProfileOptions::new(4)
        };
        let p = profile_model(&model, "mlp-20-30-5", &be, &opts).unwrap();
        p.check().unwrap();
        // flatten, linear 20->30, relu, linear 30->5
        assert_eq!(p.layers.len(), 4);
        assert_eq!(p.microbatch_size, 4);
        let l1 = &p.layers[1];
        assert_eq!(l1.param_bytes, ((20 * 30 + 30) * 4) as f64);
        assert_eq!(l1.activation_bytes, (4 * 30 * 4) as f64);
        assert!(l1.forward > 0.0 && l1.backward_input > 0.0);
        assert!(l1.backward_weight > 0.0 && l1.update > 0.0);
        // Parameterless layers have no weight gradient or update; the first layer no input
        // gradient.
        assert_eq!(p.layers[2].backward_weight, 0.0);
        assert_eq!(p.layers[2].param_bytes, 0.0);
        assert_eq!(p.layers[0].backward_input, 0.0);
        let back = Profile::from_json(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
    }
}
