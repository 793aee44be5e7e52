//! Models: an ordered list of named layers with stable parameter names (`layers.3.weight`), and
//! their parameters kept apart from them (see [`crate::layers`]).

use pipe_kernels::{Backend, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{Result, StageError};
use crate::layers::{ForwardCtx, Layer, LayerSpec, Saved};
use crate::rng::{derive_seed, rng_for};

/// Parameters of a model (or of a contiguous range of its layers): one list per layer, in the
/// order of [`Layer::param_shapes`].
pub type Params = Vec<Vec<Tensor>>;

/// A sequential model.
#[derive(Debug)]
pub struct Model {
    specs: Vec<LayerSpec>,
    layers: Vec<Box<dyn Layer>>,
    /// Per-sample shape entering each layer, plus the final output shape.
    shapes: Vec<Vec<usize>>,
}

/// A model description as written in a config file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Per-sample input shape (for MNIST `[28, 28]` or `[784]`).
    pub input: Vec<usize>,
    /// The layers, in order.
    pub layers: Vec<LayerSpec>,
}

impl ModelSpec {
    /// Parses a preset name: `mlp-IN-H1-H2-...-OUT`, where a hidden width may be written `WxN`
    /// for N layers of width W (`mlp-784-1024x16-10`). Hidden layers use ReLU; a flatten layer
    /// comes first so image-shaped data fits.
    ///
    /// # Errors
    /// [`StageError::Model`] for unknown names or malformed widths.
    pub fn preset(name: &str) -> Result<Self> {
        let rest = name.strip_prefix("mlp-").ok_or_else(|| {
            StageError::Model(format!(
                "unknown model preset '{name}' (presets look like mlp-784-512-512-10)"
            ))
        })?;
        let mut widths = Vec::new();
        for part in rest.split('-') {
            let (w, n) = match part.split_once('x') {
                Some((w, n)) => (w, n),
                None => (part, "1"),
            };
            let parse = |s: &str| {
                s.parse::<usize>().ok().filter(|v| *v > 0).ok_or_else(|| {
                    StageError::Model(format!("'{name}': '{part}' is not a positive width"))
                })
            };
            let (w, n) = (parse(w)?, parse(n)?);
            if n > 10_000 {
                return Err(StageError::Model(format!(
                    "'{name}': {n} repeated layers is too many"
                )));
            }
            widths.extend(std::iter::repeat_n(w, n));
        }
        if widths.len() < 2 {
            return Err(StageError::Model(format!(
                "'{name}' needs at least an input and an output width"
            )));
        }
        let mut layers = vec![LayerSpec::Flatten];
        for (i, pair) in widths.windows(2).enumerate() {
            layers.push(LayerSpec::Linear {
                inputs: pair[0],
                outputs: pair[1],
                bias: true,
                init: None,
            });
            if i + 2 < widths.len() {
                layers.push(LayerSpec::Relu);
            }
        }
        Ok(Self {
            input: vec![widths[0]],
            layers,
        })
    }
}

impl Model {
    /// Builds a model and checks that every layer accepts the previous layer's output.
    ///
    /// # Errors
    /// [`StageError::Model`] naming the first layer whose input does not fit.
    pub fn new(spec: &ModelSpec) -> Result<Self> {
        if spec.layers.is_empty() {
            return Err(StageError::Model("the model has no layers".into()));
        }
        if spec.input.is_empty() || spec.input.contains(&0) {
            return Err(StageError::Model(format!(
                "input shape {:?} must be non-empty and positive",
                spec.input
            )));
        }
        let mut layers = Vec::with_capacity(spec.layers.len());
        let mut shapes = vec![spec.input.clone()];
        for (i, ls) in spec.layers.iter().enumerate() {
            let followed = spec.layers.get(i + 1).is_some_and(LayerSpec::is_activation);
            let layer = ls
                .build(followed)
                .map_err(|e| StageError::Model(format!("layer {i}: {e}")))?;
            let out = layer
                .output_shape(&shapes[i])
                .map_err(|e| StageError::Model(format!("layer {i} ({}): {e}", layer.kind())))?;
            shapes.push(out);
            layers.push(layer);
        }
        Ok(Self {
            specs: spec.layers.clone(),
            layers,
            shapes,
        })
    }

    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// True when the model has no layers (never, for a built model).
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// The layer specs.
    pub fn specs(&self) -> &[LayerSpec] {
        &self.specs
    }

    /// Layer `i`.
    pub fn layer(&self, i: usize) -> &dyn Layer {
        self.layers[i].as_ref()
    }

    /// Per-sample input shape.
    pub fn input_shape(&self) -> &[usize] {
        &self.shapes[0]
    }

    /// Per-sample output shape.
    pub fn output_shape(&self) -> &[usize] {
        &self.shapes[self.layers.len()]
    }

    /// Per-sample shape entering layer `i` (`i == len()` gives the output shape).
    pub fn shape_before(&self, i: usize) -> &[usize] {
        &self.shapes[i]
    }

    /// Stable parameter names, `layers.{index}.{name}`, in model order.
    pub fn param_names(&self) -> Vec<String> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| {
                l.param_shapes()
                    .into_iter()
                    .map(move |(n, _)| format!("layers.{i}.{n}"))
            })
            .collect()
    }

    /// Total number of parameters.
    pub fn param_count(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| l.param_shapes())
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// Forward FLOPs per sample over all layers.
    pub fn flops_per_sample(&self) -> u64 {
        (0..self.len())
            .map(|i| self.layers[i].flops_per_sample(&self.shapes[i]))
            .sum()
    }

    /// Initial parameters. Each layer draws from its own stream (seed, layer index), so a
    /// layer's initial weights do not depend on the rest of the model or on the partition.
    pub fn init_params(&self, seed: u64) -> Params {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, l)| l.init_params(&mut rng_for(seed, "init", i as u64)))
            .collect()
    }

    /// Zeroed gradient buffers shaped like the parameters of layers `range`.
    pub fn zero_grads(&self, range: std::ops::Range<usize>) -> Params {
        self.layers[range]
            .iter()
            .map(|l| {
                l.param_shapes()
                    .into_iter()
                    .map(|(_, s)| Tensor::zeros(&s))
                    .collect()
            })
            .collect()
    }

    /// Runs layers `range` forward on `x` (a batch), with `params` holding exactly those
    /// layers' parameters. `microbatch` identifies the batch for dropout seeds.
    ///
    /// # Errors
    /// [`StageError::Kernel`] naming the layer that failed.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_range(
        &self,
        be: &dyn Backend,
        range: std::ops::Range<usize>,
        params: &[Vec<Tensor>],
        x: Tensor,
        train: bool,
        seed: u64,
        microbatch: u64,
    ) -> Result<(Tensor, Vec<Saved>)> {
        let mut saved = Vec::with_capacity(range.len());
        let mut h = x;
        for (j, i) in range.enumerate() {
            let layer = &self.layers[i];
            let ctx = ForwardCtx {
                train,
                seed: derive_seed(seed, "layer", ((i as u64) << 40) ^ microbatch),
            };
            let (y, s) =
                layer
                    .forward(be, &params[j], h, ctx)
                    .map_err(|source| StageError::Kernel {
                        layer: i,
                        kind: layer.kind(),
                        op: "forward",
                        source,
                    })?;
            saved.push(s);
            h = y;
        }
        Ok((h, saved))
    }

    /// Layer `i`'s input gradient, errors naming the layer.
    fn layer_input_grad(
        &self,
        be: &dyn Backend,
        i: usize,
        params: &[Tensor],
        saved: &Saved,
        g: &Tensor,
    ) -> Result<Tensor> {
        let layer = &self.layers[i];
        layer
            .backward_input(be, params, saved, g)
            .map_err(|source| StageError::Kernel {
                layer: i,
                kind: layer.kind(),
                op: "backward_input",
                source,
            })
    }

    /// Layer `i`'s parameter gradients into `grads`, errors naming the layer.
    #[allow(clippy::too_many_arguments)]
    fn layer_params_grad(
        &self,
        be: &dyn Backend,
        i: usize,
        params: &[Tensor],
        saved: &Saved,
        g: &Tensor,
        grads: &mut [Tensor],
        accumulate: bool,
    ) -> Result<()> {
        let layer = &self.layers[i];
        layer
            .backward_params(be, params, saved, g, grads, accumulate)
            .map_err(|source| StageError::Kernel {
                layer: i,
                kind: layer.kind(),
                op: "backward_params",
                source,
            })
    }

    /// Runs layers `range` backward from `dy`: for each layer, last first, the input gradient
    /// (skipped for the model's first layer unless `need_input_grad`) and the parameter gradients,
    /// added into `grads` when `accumulate`. Returns the gradient entering `range.start`.
    ///
    /// # Errors
    /// [`StageError::Kernel`] naming the layer that failed.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_range(
        &self,
        be: &dyn Backend,
        range: std::ops::Range<usize>,
        params: &[Vec<Tensor>],
        saved: &[Saved],
        dy: Tensor,
        grads: &mut [Vec<Tensor>],
        accumulate: bool,
        need_input_grad: bool,
    ) -> Result<Option<Tensor>> {
        let start = range.start;
        let mut g = dy;
        for i in range.rev() {
            let j = i - start;
            self.layer_params_grad(be, i, &params[j], &saved[j], &g, &mut grads[j], accumulate)?;
            if i == start && !need_input_grad {
                return Ok(None);
            }
            g = self.layer_input_grad(be, i, &params[j], &saved[j], &g)?;
        }
        Ok(Some(g))
    }

    /// The input-gradient half of a split backward over layers `range`: runs each layer's
    /// `backward_input`, last first, and returns the gradient entering `range.start` (None for
    /// the model's first layer unless `need_input_grad`) together with the gradient that reached
    /// each layer's output (in layer order), which [`Model::backward_params_range`] needs later.
    ///
    /// # Errors
    /// [`StageError::Kernel`] naming the layer that failed.
    pub fn backward_input_range(
        &self,
        be: &dyn Backend,
        range: std::ops::Range<usize>,
        params: &[Vec<Tensor>],
        saved: &[Saved],
        dy: Tensor,
        need_input_grad: bool,
    ) -> Result<(Option<Tensor>, Vec<Tensor>)> {
        let start = range.start;
        let mut dys: Vec<Tensor> = Vec::with_capacity(range.len());
        let mut g = dy;
        for i in range.rev() {
            let j = i - start;
            if i == start && !need_input_grad {
                dys.push(g);
                dys.reverse();
                return Ok((None, dys));
            }
            let next = self.layer_input_grad(be, i, &params[j], &saved[j], &g)?;
            dys.push(std::mem::replace(&mut g, next));
        }
        dys.reverse();
        Ok((Some(g), dys))
    }

    /// The weight-gradient half of a split backward: each layer's `backward_params` from its
    /// saved activations and the output gradient [`Model::backward_input_range`] recorded,
    /// added into `grads` when `accumulate`. Gives the same bits as the fused
    /// [`Model::backward_range`].
    ///
    /// # Errors
    /// [`StageError::Kernel`] naming the layer that failed.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_params_range(
        &self,
        be: &dyn Backend,
        range: std::ops::Range<usize>,
        params: &[Vec<Tensor>],
        saved: &[Saved],
        dys: &[Tensor],
        grads: &mut [Vec<Tensor>],
        accumulate: bool,
    ) -> Result<()> {
        let start = range.start;
        for i in range.rev() {
            let j = i - start;
            let layer = &self.layers[i];
            layer
                .backward_params(
                    be,
                    &params[j],
                    &saved[j],
                    &dys[j],
                    &mut grads[j],
                    accumulate,
                )
                .map_err(|source| StageError::Kernel {
                    layer: i,
                    kind: layer.kind(),
                    op: "backward_params",
                    source,
                })?;
        }
        Ok(())
    }
}
