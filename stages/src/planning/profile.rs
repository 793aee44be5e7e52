//! The layer profiler: what each layer of a model costs on a backend at one microbatch size,
//! measured rather than estimated from FLOPs, so the partitioner sees what the kernels really
//! do (a ReLU is memory-bound, a narrow linear layer runs far below the GEMM's peak).
//!
//! Every layer is run on its own, on random inputs of the shape it receives in the model:
//! forward, backward-input, backward-weight and the optimizer step, each repeated after a
//! warm-up, and each figure is the median of the repeats. Layers of one shape (the same spec,
//! input shape and optimizer role, such as a GPT's identical blocks) are timed once and share
//! the figures, and [`ProfileOptions::budget_seconds`] stops repeating an operation once its
//! timed runs add up to a stable median: one slow run is already one. Sizes are counted, not timed: the
//! output activation, the parameters and what the forward saves for the backward. The result is
//! a [`pipe_scheduler::Profile`], the form the planner reads (and `pipe profile` writes as JSON).
//!
//! Layers timed alone miss what the runtime pays around them: a weight matrix is packed for
//! the GEMM once per version (so every update makes the next forward dearer), gradients are
//! accumulated over the update's microbatches rather than written, each action is dispatched
//! and its tensors moved. On a wide MLP at 32 samples these make a training step 1.5x the sum
//! of the isolated layer times, and 2.2x with an update per microbatch. So by default the
//! profile is then **calibrated on the executor**: the model runs under the `sequential`
//! policy with every layer its own stage, on one worker and one thread, `M` microbatches per
//! update, and each layer's forward, backward and update take the mean of what the executor
//! measured (means, since the per-version costs land on one microbatch in `M`). The backward
//! is split into its input and weight halves in the proportion the isolated timing found.
//! Workers of a pipeline compute at the same time and slow each other down (shared cache and
//! memory bandwidth: 15-25% per action on this machine's two cores), so the calibration runs
//! as many copies at once as the pipeline will have busy workers
//! ([`ProfileOptions::concurrent`]).
//!
//! A model with a tied parameter (GPT-2's token embedding and head) keeps its isolated
//! timings: its tied layers would be stages of one worker, whose uses are summed between
//! workers, so it cannot run one layer a stage on one worker.

use std::time::Instant;

use pipe_kernels::{Backend, Tensor};
use pipe_scheduler::{Action, LayerProfile, Length, Policy, Profile, ScheduleSpec};
use pipe_transport::inproc::{InProcOptions, mesh};
use rand::Rng as _;

use crate::error::{Result, StageError};
use crate::layers::{ForwardCtx, LayerSpec};
use crate::model::{Model, place_params};
use crate::optim::{Corrected, OptimizerConfig, UpdateMean};
use crate::partition::Partition;
use crate::pipeline::{MicrobatchSource, RunPlan, Setup, WorkerState, open_backend, run_threads};
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
    /// Calibrate on the executor with this many microbatches per update (see the module
    /// docs); `None` keeps the isolated timings.
    pub calibrate: Option<u32>,
    /// Minibatches the calibration run times (after one untimed).
    pub calibration_minibatches: u32,
    /// Copies of the calibration run timed at once, each on its own thread: the number of
    /// workers that will compute at the same time (the pipeline's workers, at most one per
    /// core), so the times include what they cost each other in shared caches and memory
    /// bandwidth.
    pub concurrent: usize,
    /// Stop repeating an operation once its timed runs add up to this many seconds (at least
    /// one timed run); `None` runs every repeat. A run of a second is its own stable median;
    /// repeats matter for short operations, whose times the clock and the cache move.
    pub budget_seconds: Option<f64>,
}

/// How far profiling has got, for a caller that shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProfileProgress {
    /// `done` of the model's `of` distinct layer shapes are timed.
    Layers {
        /// Shapes timed.
        done: usize,
        /// Distinct shapes in the model.
        of: usize,
    },
    /// The layer timings are being calibrated on the executor (one run of the whole model).
    Calibrating,
}

impl ProfileOptions {
    /// `microbatch_size` samples, 3 warm-up runs, 11 timed runs, SGD with momentum,
    /// calibrated on the executor at 4 microbatches per update over 6 minibatches.
    pub fn new(microbatch_size: usize) -> Self {
        ProfileOptions {
            microbatch_size,
            warmup: 3,
            repeats: 11,
            optimizer: OptimizerConfig::default(),
            seed: 0,
            calibrate: Some(4),
            calibration_minibatches: 6,
            concurrent: 1,
            budget_seconds: None,
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

/// How often each operation runs: untimed, then timed at most, and the timed seconds after
/// which it stops ([`ProfileOptions::budget_seconds`]).
#[derive(Clone, Copy, Debug)]
struct Repeats {
    warmup: usize,
    most: usize,
    budget: Option<f64>,
}

impl Repeats {
    /// Runs `f` `warmup` times, then up to `most` times (stopping once the timed runs add up
    /// to the budget, after at least one); the median of the seconds the timed runs report
    /// (each run times its own operation, leaving out its set-up).
    fn median(self, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
        for _ in 0..self.warmup {
            f()?;
        }
        let mut times = Vec::with_capacity(self.most);
        let mut spent = 0.0;
        while times.len() < self.most.max(1) && self.budget.is_none_or(|b| spent < b) {
            let t = f()?;
            spent += t;
            times.push(t);
        }
        Ok(median(&mut times))
    }
}

/// Seconds `f` takes on `be`, from an idle device to the end of the work `f` queued.
fn seconds<T>(be: &dyn Backend, f: impl FnOnce() -> Result<T>) -> Result<f64> {
    be.synchronize()?;
    let t = Instant::now();
    f()?;
    be.synchronize()?;
    Ok(t.elapsed().as_secs_f64())
}

pub(crate) fn random(shape: &[usize], seed: u64, what: &str, i: u64) -> Result<Tensor> {
    let mut rng = rng_for(seed, what, i);
    let n: usize = shape.iter().product();
    let data = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Ok(Tensor::from_vec(shape, data)?)
}

/// A random input batch (`shape`, batch first) for layer `i` of `model`: token ids below the
/// vocabulary for an embedding, uniform values in `[-1, 1)` otherwise.
///
/// # Errors
/// A shape whose element count does not fit a tensor.
pub fn random_input(
    model: &Model,
    i: usize,
    shape: &[usize],
    seed: u64,
    what: &str,
) -> Result<Tensor> {
    match model.specs().get(i) {
        Some(&LayerSpec::Embedding { vocab, .. }) => {
            let mut rng = rng_for(seed, what, i as u64);
            let n: usize = shape.iter().product();
            let ids = (0..n).map(|_| rng.random_range(0..vocab) as f32).collect();
            Ok(Tensor::from_vec(shape, ids)?)
        }
        _ => random(shape, seed, what, i as u64),
    }
}

/// The limits a profile request must keep ([`crate::limits`]): repeat counts, activation
/// sizes, and the memory of `concurrent` single-worker copies of the model on this machine.
fn check_profile_request(model: &Model, opts: &ProfileOptions) -> Result<()> {
    use crate::limits::{self, Machine};
    limits::check_profile_repeats(opts.warmup as u64, opts.repeats as u64)?;
    model.check_microbatch(opts.microbatch_size)?;
    let run =
        pipe_scheduler::ScheduleSpec::new(pipe_scheduler::Policy::Sequential, 1, 1).resolve()?;
    let copies = opts.concurrent as u64;
    let state = crate::optim::OptimizerKind::Sgd.state_copies();
    let need = model.worker_memory_bytes(&run, opts.microbatch_size, state) * copies as f64;
    let holding = format!(
        "{} parameters and a microbatch's activations",
        model.param_count()
    );
    let machine = Machine::detect();
    limits::check_local_workers(copies, &machine)?;
    let need = limits::MemoryNeed {
        bytes: need,
        workers: copies,
        holding: &holding,
        lower: "profile a smaller --microbatch-size",
    };
    limits::admit_memory(&need, &machine)
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
    profile_model_with(model, name, be, opts, &mut |_| {})
}

/// What makes two layers cost the same: their spec, the shape they receive, whether their
/// backward computes an input gradient (none before the model's first layer with parameters)
/// and their optimizer role.
fn shape_key(model: &Model, roles: &[Vec<crate::model::ParamRole>], i: usize) -> String {
    format!(
        "{:?}|{:?}|{}|{:?}",
        model.specs().get(i),
        model.shape_before(i),
        model.computes_input_grad(i),
        roles.get(i)
    )
}

/// [`profile_model`], telling `progress` after each distinct layer shape and before the
/// calibration run.
///
/// # Errors
/// As [`profile_model`].
pub fn profile_model_with(
    model: &Model,
    name: &str,
    be: &dyn Backend,
    opts: &ProfileOptions,
    progress: &mut dyn FnMut(ProfileProgress),
) -> Result<Profile> {
    if opts.microbatch_size == 0 || opts.repeats == 0 {
        return Err(StageError::Config(
            "profiling needs a microbatch size and a repeat count of at least 1".into(),
        ));
    }
    check_profile_request(model, opts)?;
    let params = place_params(be, model.init_params(opts.seed))?;
    let roles = model.optimizer_roles();
    let keys: Vec<String> = (0..model.len())
        .map(|i| shape_key(model, &roles, i))
        .collect();
    let of = {
        let mut distinct = keys.clone();
        distinct.sort();
        distinct.dedup();
        distinct.len()
    };
    progress(ProfileProgress::Layers { done: 0, of });
    let mut layers: Vec<LayerProfile> = Vec::with_capacity(model.len());
    for (i, p) in params.iter().enumerate() {
        let kind = model.layer(i).kind();
        // A layer of a shape already timed takes that one's figures.
        if let Some(same) = keys[..i].iter().position(|k| *k == keys[i]) {
            let timed = layers[same].clone();
            layers.push(LayerProfile {
                name: format!("{i}:{kind}"),
                ..timed
            });
            continue;
        }
        layers.push(time_layer(model, i, p, &roles[i], be, opts)?);
        let done = {
            let mut seen = keys[..=i].to_vec();
            seen.sort();
            seen.dedup();
            seen.len()
        };
        progress(ProfileProgress::Layers { done, of });
    }
    let mut profile = Profile {
        model: name.to_string(),
        microbatch_size: opts.microbatch_size,
        ..Profile::chain(layers)
    };
    if let Some(m) = opts.calibrate.filter(|_| !model.has_ties()) {
        progress(ProfileProgress::Calibrating);
        calibrate(model, &mut profile, opts, m, be.name())?;
        profile.calibrated_microbatches = Some(m);
    }
    Ok(profile)
}

/// Random inputs of layer `i` at the profile's microbatch, placed on `be`: its input `x`
/// and the gradient `dy` of its output.
///
/// # Errors
/// Shapes past the limits; device allocation.
fn layer_inputs(
    model: &Model,
    i: usize,
    be: &dyn Backend,
    opts: &ProfileOptions,
) -> Result<(Tensor, Tensor)> {
    let batch = |shape: &[usize]| {
        let mut s = vec![opts.microbatch_size];
        s.extend_from_slice(shape);
        s
    };
    let x = be.place(random_input(
        model,
        i,
        &batch(model.shape_before(i)),
        opts.seed,
        "profile-x",
    )?)?;
    let dy = be.place(random(
        &batch(model.shape_before(i + 1)),
        opts.seed,
        "profile-dy",
        i as u64,
    )?)?;
    Ok((x, dy))
}

/// The median time of one update over a layer's parameters `p` (roles `role`) with
/// gradients `grads`, as a run applies it: the optimizer's step with its delay correction
/// around it (a compensation reads the current weights as the stale ones).
///
/// # Errors
/// Kernel errors.
fn time_update(
    p: &[Tensor],
    role: &[crate::model::ParamRole],
    grads: Vec<Tensor>,
    be: &dyn Backend,
    opts: &ProfileOptions,
    repeats: Repeats,
) -> Result<f64> {
    let mut own = vec![p.to_vec()];
    let mut grads = vec![grads];
    let mine = [role.to_vec()];
    let mut opt = Corrected::new(opts.optimizer, &own, &mine).placed(be)?;
    let mean = (UpdateMean::new(1), 1);
    repeats.median(|| {
        seconds(be, || {
            let current = &own;
            opt.compensate(be, &mut grads, mean, || {
                Ok((current, std::borrow::Cow::Borrowed(current)))
            })?;
            opt.step(be, &mut own, &mut grads, mean, 1e-6)
        })
    })
}

/// Times layer `i` of `model` with its parameters `p` on random inputs: forward, the whole
/// backward and its two halves, and the optimizer step, and counts its sizes.
fn time_layer(
    model: &Model,
    i: usize,
    p: &[Tensor],
    role: &[crate::model::ParamRole],
    be: &dyn Backend,
    opts: &ProfileOptions,
) -> Result<LayerProfile> {
    let layer = model.layer(i);
    let kernel = |op: &'static str| {
        move |source| StageError::Kernel {
            layer: i,
            kind: layer.kind(),
            op,
            source,
        }
    };
    let (x, dy) = layer_inputs(model, i, be, opts)?;
    let ctx = ForwardCtx {
        train: true,
        seed: opts.seed,
        recompute_attention: false,
        documents: None,
    };
    let repeats = Repeats {
        warmup: opts.warmup,
        most: opts.repeats,
        budget: opts.budget_seconds,
    };
    // Every operation is warmed up on its own: a first run pays for touching its memory for
    // the first time (a GPT-2 block's first backward at 2 x 1,024 tokens takes 1.4-1.7x its
    // later ones), which a run that reuses its freed blocks does not.
    let forward = repeats.median(|| {
        // The forward consumes its input: copy it outside the timed call.
        let input = x.clone();
        seconds(be, || {
            layer
                .forward(be, p, input, ctx.clone())
                .map_err(kernel("forward"))
        })
    })?;
    let input_bytes = x.len() * 4;
    let (y, saved) = layer.forward(be, p, x, ctx).map_err(kernel("forward"))?;
    let backward_input = |repeats: Repeats| {
        if !model.computes_input_grad(i) {
            // Nothing before layer i trains, so the backward never computes its input
            // gradient (`Model::backward_range`).
            return Ok(0.0);
        }
        repeats.median(|| {
            seconds(be, || {
                layer
                    .backward_input(be, p, &saved, &dy)
                    .map_err(kernel("backward_input"))
            })
        })
    };
    let (backward_input, backward_weight, whole, update) = if p.is_empty() {
        let bi = backward_input(repeats)?;
        (bi, 0.0, bi, 0.0)
    } else {
        let mut grads: Vec<Tensor> = p
            .iter()
            .map(|t| be.place(Tensor::zeros(t.shape())))
            .collect::<std::result::Result<_, _>>()?;
        // Both halves at once: a layer whose halves share work does it once here.
        let whole = repeats.median(|| {
            seconds(be, || {
                layer
                    .backward(be, p, &saved, &dy, &mut grads, false, i != 0)
                    .map_err(kernel("backward"))
            })
        })?;
        let bi = backward_input(repeats)?;
        let bw = repeats.median(|| {
            seconds(be, || {
                layer
                    .backward_params(be, p, &saved, &dy, &mut grads, false)
                    .map_err(kernel("backward_params"))
            })
        })?;
        let up = time_update(p, role, grads, be, opts, repeats)?;
        (bi, bw, whole, up)
    };
    let param_elems: usize = p.iter().map(Tensor::len).sum();
    Ok(LayerProfile {
        name: format!("{i}:{}", layer.kind()),
        forward,
        backward_input,
        backward_weight,
        backward: Some(whole),
        update,
        activation_bytes: (y.len() * 4) as f64,
        param_bytes: (param_elems * 4) as f64,
        stash_bytes: Some(saved.bytes() as f64),
        // Full recomputation keeps the layer's input where it would keep more
        // (`Model::forward_range`).
        recompute_stash_bytes: Some(saved.bytes().min(input_bytes) as f64),
    })
}

/// Profiles the model preset `name` on `be` (see [`profile_model`]).
///
/// # Errors
/// An unknown preset ([`StageError::Model`]) or a failure while measuring.
pub fn profile_preset(name: &str, opts: &ProfileOptions, be: &dyn Backend) -> Result<Profile> {
    let model = Model::new(&crate::model::ModelSpec::preset(name)?)?;
    profile_model(&model, name, be, opts)
}

/// Microbatches of random numbers for runs whose data does not matter (calibration, planning,
/// benchmarks): one fixed input of the model's shape, and labels cycling over its outputs.
#[derive(Debug)]
pub struct RandomSource {
    x: Tensor,
    classes: u32,
    /// Targets (output rows) per sample.
    targets: usize,
}

impl RandomSource {
    /// Random inputs for `model` at `microbatch_size` samples, labels cycling over its outputs.
    ///
    /// # Errors
    /// A shape whose element count does not fit a tensor.
    pub fn for_model(model: &Model, microbatch_size: usize, seed: u64) -> Result<Self> {
        let mut shape = vec![microbatch_size];
        shape.extend_from_slice(model.input_shape());
        let (_, rows) = model.output_shape().split_last().unwrap_or((&1, &[]));
        let classes = model.output_classes();
        Ok(RandomSource {
            x: random_input(model, 0, &shape, seed, "calibrate-x")?,
            classes: classes.max(1) as u32,
            targets: rows.iter().product::<usize>().max(1),
        })
    }
}

impl MicrobatchSource for RandomSource {
    fn microbatch_size(&self) -> usize {
        self.x.shape().first().copied().unwrap_or(0)
    }
    fn inputs(&self, _mb: u32) -> Result<Tensor> {
        Ok(self.x.clone())
    }
    fn labels(&self, mb: u32) -> Result<Tensor<u32>> {
        let n = (self.x.shape().first().copied().unwrap_or(0) * self.targets) as u32;
        let ids = (0..n).map(|i| (i + mb) % self.classes).collect();
        Ok(Tensor::from_vec(&[n as usize], ids)?)
    }
}

/// Per layer: (seconds, count) of its forward, backward and update actions.
type Sums = Vec<[(f64, u32); 3]>;

/// Replaces the profile's times with the executor's means (see the module docs).
fn calibrate(
    model: &Model,
    profile: &mut Profile,
    opts: &ProfileOptions,
    m: u32,
    backend: &str,
) -> Result<()> {
    let kind: pipe_kernels::BackendKind = backend.parse().map_err(StageError::Config)?;
    if m == 0 || opts.calibration_minibatches == 0 {
        return Err(StageError::Config(
            "calibration needs at least one microbatch per update and one minibatch".into(),
        ));
    }
    let n = model.len();
    let b = opts.microbatch_size;
    let spec = ScheduleSpec::new(Policy::Sequential, n as u32, m)
        .with_length(Length::Updates(opts.calibration_minibatches));
    let partition = Partition::new((0..n).map(|i| i..i + 1).collect(), n)?;
    let plan = RunPlan::new(model, &spec, Some(partition))?;
    let source = RandomSource::for_model(model, b, opts.seed)?;
    let lr = |_: u32, _: u32| 1e-6f32;
    let setup = Setup::new(model, &plan, &source, &lr).with_seed(opts.seed);
    let init = model.init_params(opts.seed);
    let copies = opts.concurrent.max(1);
    let barrier = std::sync::Barrier::new(copies);
    // One copy of the run: an untimed pass, then (with every copy at once) the timed one;
    // [forward, backward, update] sums and counts per layer.
    let run = || -> Result<Sums> {
        let mut states = vec![WorkerState::new(&setup, 0, &init, opts.optimizer)];
        let mut sums = vec![[(0.0f64, 0u32); 3]; n];
        for timed in [false, true] {
            if timed {
                barrier.wait();
            }
            let eps = mesh(1, &InProcOptions::default());
            let outs = run_threads(&setup, &mut states, eps, |w| open_backend(kind, 1, w))?;
            if !timed {
                continue;
            }
            for sp in outs.iter().flat_map(|o| &o.spans) {
                let slot = match sp.action {
                    Action::Forward { .. } => 0,
                    Action::Backward { .. } => 1,
                    Action::Update { .. } => 2,
                    _ => continue,
                };
                let cell = &mut sums[sp.action.stage() as usize][slot];
                cell.0 += sp.end - sp.start;
                cell.1 += 1;
            }
        }
        Ok(sums)
    };
    let results: Vec<Result<Sums>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..copies).map(|_| scope.spawn(run)).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(StageError::Config("a calibration thread panicked".into()))
                })
            })
            .collect()
    });
    let mut sums = vec![[(0.0f64, 0u32); 3]; n];
    for r in results {
        for (acc, layer) in sums.iter_mut().zip(r?) {
            for (a, x) in acc.iter_mut().zip(layer) {
                a.0 += x.0;
                a.1 += x.1;
            }
        }
    }
    let mean = |c: (f64, u32)| if c.1 == 0 { 0.0 } else { c.0 / f64::from(c.1) };
    for (l, s) in profile.layers.iter_mut().zip(&sums) {
        // The executor ran whole backwards: they set the whole backward's time, and the
        // halves (run apart by zero-bubble schedules) keep their isolated ratio to it.
        let backward = mean(s[1]);
        let isolated = l.whole_backward();
        let scale = if isolated > 0.0 {
            backward / isolated
        } else {
            1.0
        };
        l.forward = mean(s[0]);
        if isolated > 0.0 {
            l.backward_input *= scale;
            l.backward_weight *= scale;
        } else {
            l.backward_input = backward;
        }
        l.backward = Some(backward);
        if l.param_bytes > 0.0 {
            l.update = mean(s[2]);
        }
    }
    Ok(())
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
            calibrate: None,
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
        assert!(l1.forward > 0.0 && l1.backward_weight > 0.0 && l1.update > 0.0);
        // Parameterless layers have no weight gradient or update; the layers up to the first
        // with parameters no input gradient (nothing before them trains), those after it one.
        assert_eq!(p.layers[2].backward_weight, 0.0);
        assert_eq!(p.layers[2].param_bytes, 0.0);
        assert_eq!(p.layers[0].backward_input, 0.0);
        assert_eq!(l1.backward_input, 0.0);
        assert!(p.layers[2].backward_input > 0.0 && p.layers[3].backward_input > 0.0);
        let back = Profile::from_json(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
    }

    #[test]
    fn calibration_takes_every_time_from_the_executor() {
        let model = Model::new(&ModelSpec::preset("mlp-20-30-5").unwrap()).unwrap();
        let be = CpuBackend::new(1).unwrap();
        let opts = ProfileOptions {
            repeats: 3,
            warmup: 1,
            calibrate: Some(2),
            calibration_minibatches: 2,
            concurrent: 2,
            ..ProfileOptions::new(4)
        };
        let p = profile_model(&model, "mlp-20-30-5", &be, &opts).unwrap();
        p.check().unwrap();
        for l in &p.layers {
            assert!(l.forward > 0.0, "{l:?}");
            assert!(l.backward_input + l.backward_weight > 0.0, "{l:?}");
        }
        // Layers with parameters update; sizes are untouched by calibration.
        assert!(p.layers[1].update > 0.0 && p.layers[3].update > 0.0);
        assert_eq!(p.layers[2].update, 0.0);
        assert_eq!(p.layers[1].param_bytes, ((20 * 30 + 30) * 4) as f64);
    }
}
