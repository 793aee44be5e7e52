//! A backend wrapper that adds up the time spent inside kernels, for measuring how much of a
//! run is *not* kernel time (executor overhead). Behaviour is added by wrapping: any backend
//! can be timed without changing it.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crate::backend::{
    Activation, AdamStep, AttentionShape, Backend, DelayCompensation, LionStep, LossStats, SgdStep,
    Trans,
};
use std::borrow::Cow;

use crate::{Device, Result, Tensor};

/// Wraps a backend and adds every kernel call's wall time to a shared counter, and, when asked
/// for, to a per-operation table.
#[derive(Debug)]
pub struct Timed<B> {
    inner: B,
    nanos: Arc<AtomicU64>,
    by_operation: Option<Mutex<BTreeMap<&'static str, OperationTime>>>,
}

/// The calls to one backend operation and the wall time they took, the device waited for
/// after each.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OperationTime {
    /// Calls.
    pub calls: u64,
    /// Seconds, in total.
    pub seconds: f64,
}

impl<B: Backend> Timed<B> {
    /// Times `inner`'s kernels into `counter` (nanoseconds; shareable across threads).
    pub fn new(inner: B, counter: Arc<AtomicU64>) -> Self {
        Self {
            inner,
            nanos: counter,
            by_operation: None,
        }
    }

    /// Times `inner`'s kernels operation by operation ([`Timed::operations`]).
    pub fn by_operation(inner: B) -> Self {
        Self {
            inner,
            nanos: Arc::default(),
            by_operation: Some(Mutex::default()),
        }
    }

    /// Each operation's calls and time so far, by name (empty unless made by
    /// [`Timed::by_operation`]).
    pub fn operations(&self) -> Vec<(&'static str, OperationTime)> {
        self.by_operation.as_ref().map_or_else(Vec::new, |table| {
            let table = table.lock().unwrap_or_else(PoisonError::into_inner);
            table.iter().map(|(k, v)| (*k, *v)).collect()
        })
    }

    /// Time spent in kernels so far (all backends sharing the counter).
    pub fn kernel_time(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::Relaxed))
    }

    fn time<T>(&self, op: &'static str, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        // A device backend only queues work: wait for it before reading the clock. A device
        // error found here is reported again by the next call that waits, so none is lost.
        let _ = self.inner.synchronize();
        let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(ns, Ordering::Relaxed);
        if let Some(table) = &self.by_operation {
            let mut table = table.lock().unwrap_or_else(PoisonError::into_inner);
            let entry = table.entry(op).or_default();
            entry.calls += 1;
            entry.seconds += ns as f64 * 1e-9;
        }
        out
    }
}

impl<B: Backend> Backend for Timed<B> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn threads(&self) -> usize {
        self.inner.threads()
    }

    fn device(&self) -> Device {
        self.inner.device()
    }

    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }

    fn peak_memory(&self) -> Option<u64> {
        self.inner.peak_memory()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self.inner.as_any()
    }

    fn place(&self, t: Tensor) -> Result<Tensor> {
        self.time("place", || self.inner.place(t))
    }

    fn place_ids(&self, t: Tensor<u32>) -> Result<Tensor<u32>> {
        self.time("place_ids", || self.inner.place_ids(t))
    }

    fn read<'a>(&self, t: &'a Tensor) -> Result<Cow<'a, [f32]>> {
        self.time("read", || self.inner.read(t))
    }

    fn write(&self, src: &[f32], t: &mut Tensor) -> Result<()> {
        self.time("write", || self.inner.write(src, t))
    }

    fn copy(&self, src: &Tensor, dst: &mut Tensor) -> Result<()> {
        self.time("copy", || self.inner.copy(src, dst))
    }

    fn fill(&self, value: f32, x: &mut Tensor) -> Result<()> {
        self.time("fill", || self.inner.fill(value, x))
    }

    fn mul(&self, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
        self.time("mul", || self.inner.mul(a, b, out))
    }

    fn matmul(
        &self,
        a: &Tensor,
        ta: Trans,
        b: &Tensor,
        tb: Trans,
        c: &mut Tensor,
        accumulate: bool,
    ) -> Result<()> {
        let op = if self.by_operation.is_some() {
            product_name(a, ta, b, tb)
        } else {
            "matmul"
        };
        self.time(op, || self.inner.matmul(a, ta, b, tb, c, accumulate))
    }

    fn transpose(&self, a: &Tensor, out: &mut Tensor) -> Result<()> {
        self.time("transpose", || self.inner.transpose(a, out))
    }

    fn add_bias(&self, y: &mut Tensor, bias: &Tensor) -> Result<()> {
        self.time("add_bias", || self.inner.add_bias(y, bias))
    }

    fn sum_rows(&self, x: &Tensor, out: &mut Tensor, accumulate: bool) -> Result<()> {
        self.time("sum_rows", || self.inner.sum_rows(x, out, accumulate))
    }

    fn activation(&self, act: Activation, x: &Tensor, y: &mut Tensor) -> Result<()> {
        self.time("activation", || self.inner.activation(act, x, y))
    }

    fn activation_backward(
        &self,
        act: Activation,
        x: &Tensor,
        dy: &Tensor,
        dx: &mut Tensor,
    ) -> Result<()> {
        self.time("activation_backward", || {
            self.inner.activation_backward(act, x, dy, dx)
        })
    }

    fn layer_norm(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        eps: f32,
        y: &mut Tensor,
        mean: &mut Tensor,
        rstd: &mut Tensor,
    ) -> Result<()> {
        self.time("layer_norm", || {
            self.inner.layer_norm(x, gamma, beta, eps, y, mean, rstd)
        })
    }

    fn layer_norm_backward_input(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
        dx: &mut Tensor,
    ) -> Result<()> {
        self.time("layer_norm_backward_input", || {
            self.inner
                .layer_norm_backward_input(x, gamma, mean, rstd, dy, dx)
        })
    }

    fn layer_norm_backward_params(
        &self,
        x: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
        dgamma: &mut Tensor,
        dbeta: &mut Tensor,
        accumulate: bool,
    ) -> Result<()> {
        self.time("layer_norm_backward_params", || {
            self.inner
                .layer_norm_backward_params(x, mean, rstd, dy, dgamma, dbeta, accumulate)
        })
    }

    fn softmax_cross_entropy(
        &self,
        logits: &Tensor,
        labels: &Tensor<u32>,
        grad_scale: f32,
        dlogits: Option<&mut Tensor>,
    ) -> Result<LossStats> {
        self.time("softmax_cross_entropy", || {
            self.inner
                .softmax_cross_entropy(logits, labels, grad_scale, dlogits)
        })
    }

    fn embedding(&self, ids: &Tensor, table: &Tensor, out: &mut Tensor) -> Result<()> {
        self.time("embedding", || self.inner.embedding(ids, table, out))
    }

    fn embedding_backward(
        &self,
        ids: &Tensor,
        dy: &Tensor,
        dtable: &mut Tensor,
        accumulate: bool,
    ) -> Result<()> {
        self.time("embedding_backward", || {
            self.inner.embedding_backward(ids, dy, dtable, accumulate)
        })
    }

    fn attention(
        &self,
        qkv: &Tensor,
        documents: Option<&Tensor>,
        shape: AttentionShape,
        out: &mut Tensor,
        lse: &mut Tensor,
    ) -> Result<()> {
        self.time("attention", || {
            self.inner.attention(qkv, documents, shape, out, lse)
        })
    }

    fn attention_backward(
        &self,
        qkv: &Tensor,
        documents: Option<&Tensor>,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        shape: AttentionShape,
        dqkv: &mut Tensor,
    ) -> Result<()> {
        self.time("attention_backward", || {
            self.inner
                .attention_backward(qkv, documents, out, lse, dout, shape, dqkv)
        })
    }

    fn axpy(&self, alpha: f32, x: &Tensor, y: &mut Tensor) -> Result<()> {
        self.time("axpy", || self.inner.axpy(alpha, x, y))
    }

    fn scale(&self, alpha: f32, x: &mut Tensor) -> Result<()> {
        self.time("scale", || self.inner.scale(alpha, x))
    }

    fn sgd_update(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        buf: Option<&mut Tensor>,
        hp: SgdStep,
    ) -> Result<()> {
        self.time("sgd_update", || self.inner.sgd_update(param, grad, buf, hp))
    }

    fn adam_update(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        hp: AdamStep,
    ) -> Result<()> {
        self.time("adam_update", || {
            self.inner.adam_update(param, grad, m, v, hp)
        })
    }

    fn lion_update(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        hp: LionStep,
    ) -> Result<()> {
        self.time("lion_update", || self.inner.lion_update(param, grad, m, hp))
    }

    fn delay_compensate(
        &self,
        grad: &mut Tensor,
        current: &Tensor,
        stale: &Tensor,
        mean_square: Option<&mut Tensor>,
        hp: DelayCompensation,
    ) -> Result<()> {
        self.time("delay_compensate", || {
            self.inner
                .delay_compensate(grad, current, stale, mean_square, hp)
        })
    }

    fn sum(&self, x: &Tensor) -> Result<f64> {
        self.time("sum", || self.inner.sum(x))
    }

    fn sum_squares(&self, x: &Tensor) -> Result<f64> {
        self.time("sum_squares", || self.inner.sum_squares(x))
    }

    fn first_non_finite(&self, xs: &[&Tensor]) -> Result<Option<usize>> {
        self.time("first_non_finite", || self.inner.first_non_finite(xs))
    }
}

/// `matmul MxKxN XY` for a product of `op(a)` (`M x K`) and `op(b)` (`K x N`), X and Y `N` or
/// `T` for the transposes: the per-operation table tells products apart by shape. Each name is
/// made once per process (a run has a handful of shapes).
fn product_name(a: &Tensor, ta: Trans, b: &Tensor, tb: Trans) -> &'static str {
    static NAMES: OnceLock<Mutex<HashMap<String, &'static str>>> = OnceLock::new();
    let ((m, k), (_, n)) = (
        crate::check::operand_dims(a, ta),
        crate::check::operand_dims(b, tb),
    );
    let flag = |t: Trans| if t == Trans::Yes { 'T' } else { 'N' };
    let name = format!("matmul {m}x{k}x{n} {}{}", flag(ta), flag(tb));
    let mut names = NAMES
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    names
        .entry(name)
        .or_insert_with_key(|k| Box::leak(k.clone().into_boxed_str()))
}
