//! A backend wrapper that adds up the time spent inside kernels, for measuring how much of a
//! run is *not* kernel time (executor overhead). Behaviour is added by wrapping: any backend
//! can be timed without changing it.
//!
//! The forwarding methods are generated from the one list of the trait's methods
//! (`backend_ops!` in `backend.rs`): every operation is timed under its method's name, and the
//! methods that only ask about the backend (its name, its device, waiting for it) are passed on
//! untimed. A new operation is timed without a line here. Only the products have rules of
//! their own: `matmul` because the per-operation table names each product by its shape, and
//! `linear`, `linear_activation`, `linear_weight_grads` and `linear_grad_activation` because a
//! backend that fuses them is timed per fused call (named by shape too) and one that does not
//! per part (`matmul`, `add_bias`, `activation`, `sum_rows`, `activation_backward`),
//! as a profile of the unfused step always was.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crate::backend::{
    Activation, AdamStep, AdamTensors, AttentionShape, Backend, DelayCompensation, LionStep,
    LossReading, LossStats, SgdStep, Trans, UpdateSeen, backend_ops,
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

    /// The name a product is timed under: `kind`, and with the per-operation table its shape
    /// ([`shape_name`]).
    fn product_op(
        &self,
        kind: &'static str,
        (a, ta): (&Tensor, Trans),
        (b, tb): (&Tensor, Trans),
    ) -> &'static str {
        if self.by_operation.is_some() {
            shape_name(kind, a, ta, b, tb)
        } else {
            kind
        }
    }

    fn time<T>(&self, op: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let t = Instant::now();
        let out = f();
        // A device backend only queues work: wait for it before reading the clock. What the
        // wait finds (a device fault, a check the backend queued without waiting) is this
        // call's error, since the wait reports it once.
        let waited = self.inner.synchronize();
        let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(ns, Ordering::Relaxed);
        if let Some(table) = &self.by_operation {
            let mut table = table.lock().unwrap_or_else(PoisonError::into_inner);
            let entry = table.entry(op).or_default();
            entry.calls += 1;
            entry.seconds += ns as f64 * 1e-9;
        }
        match (out, waited) {
            (Ok(_), Err(e)) => Err(e),
            (out, _) => out,
        }
    }
}

/// Forwards one method of [`Backend`] from the list in `backend_ops!`: a method that asks about
/// the backend goes to the inner backend untimed; an operation is timed under its own name.
macro_rules! timed_method {
    // The per-operation table names each product by its shape (`shape_name`).
    (
        $(#[$meta:meta])* op fn matmul
        (
            &self, $a:ident: $a_ty:ty, $ta:ident: $ta_ty:ty, $b:ident: $b_ty:ty,
            $tb:ident: $tb_ty:ty $(, $arg:ident: $ty:ty)* $(,)?
        ) -> $ret:ty;
    ) => {
        fn matmul(&self, $a: $a_ty, $ta: $ta_ty, $b: $b_ty, $tb: $tb_ty $(, $arg: $ty)*) -> $ret {
            let op = self.product_op("matmul", ($a, $ta), ($b, $tb));
            self.time(op, || self.inner.matmul($a, $ta, $b, $tb $(, $arg)*))
        }
    };
    // A fused linear product is one product, named by its shape as `linear MxKxN`; the
    // default's two parts are timed apart under their own names, as a layer calling them would.
    ($(#[$meta:meta])* op fn linear $($rest:tt)*) => {
        fn linear(
            &self,
            x: &Tensor,
            w: &Tensor,
            bias: Option<&Tensor>,
            y: &mut Tensor,
        ) -> Result<()> {
            if !self.inner.fuses_linear_epilogues() {
                return crate::backend::linear_by_parts(self, x, w, bias, y);
            }
            let op = self.product_op("linear", (x, Trans::No), (w, Trans::No));
            self.time(op, || self.inner.linear(x, w, bias, y))
        }
    };
    ($(#[$meta:meta])* op fn linear_activation $($rest:tt)*) => {
        fn linear_activation(
            &self,
            x: &Tensor,
            w: &Tensor,
            bias: Option<&Tensor>,
            act: Activation,
            pre: &mut Tensor,
            y: &mut Tensor,
        ) -> Result<()> {
            if !self.inner.fuses_linear_epilogues() {
                return crate::backend::linear_activation_by_parts(self, (x, w, bias), act, pre, y);
            }
            let op = self.product_op("linear_activation", (x, Trans::No), (w, Trans::No));
            self.time(op, || self.inner.linear_activation(x, w, bias, act, pre, y))
        }
    };
    ($(#[$meta:meta])* op fn linear_weight_grads $($rest:tt)*) => {
        fn linear_weight_grads(
            &self,
            x: &Tensor,
            dy: &Tensor,
            gw: &mut Tensor,
            gb: Option<&mut Tensor>,
            accumulate: bool,
        ) -> Result<()> {
            if !self.inner.fuses_linear_epilogues() {
                return crate::backend::linear_weight_grads_by_parts(self, (x, dy), gw, gb, accumulate);
            }
            let op = self.product_op("linear_weight_grads", (x, Trans::Yes), (dy, Trans::No));
            self.time(op, || self.inner.linear_weight_grads(x, dy, gw, gb, accumulate))
        }
    };
    ($(#[$meta:meta])* op fn linear_grad_activation $($rest:tt)*) => {
        fn linear_grad_activation(
            &self,
            dy: &Tensor,
            w: &Tensor,
            act: Activation,
            pre: &Tensor,
            dz: &mut Tensor,
        ) -> Result<()> {
            if !self.inner.fuses_linear_epilogues() {
                return crate::backend::linear_grad_activation_by_parts(self, dy, w, act, pre, dz);
            }
            let op = self.product_op("linear_grad_activation", (dy, Trans::No), (w, Trans::Yes));
            self.time(op, || self.inner.linear_grad_activation(dy, w, act, pre, dz))
        }
    };
    (
        $(#[$meta:meta])* about fn $name:ident $(<$lt:lifetime>)?
        (&self $(, $arg:ident: $ty:ty)* $(,)?) -> $ret:ty $(;)? $($default:block)?
    ) => {
        fn $name $(<$lt>)? (&self $(, $arg: $ty)*) -> $ret {
            self.inner.$name($($arg),*)
        }
    };
    (
        $(#[$meta:meta])* op fn $name:ident $(<$lt:lifetime>)?
        (&self $(, $arg:ident: $ty:ty)* $(,)?) -> $ret:ty $(;)? $($default:block)?
    ) => {
        fn $name $(<$lt>)? (&self $(, $arg: $ty)*) -> $ret {
            self.time(stringify!($name), || self.inner.$name($($arg),*))
        }
    };
}

impl<B: Backend> Backend for Timed<B> {
    backend_ops!(timed_method);
}

/// `{kind} MxKxN XY` (`matmul` and the fused products) for a product of `op(a)` (`M x K`) and `op(b)` (`K x
/// N`), X and Y `N` or `T` for the transposes: the per-operation table tells products apart by
/// shape. Each name is made once per process (a run has a handful of shapes).
fn shape_name(kind: &str, a: &Tensor, ta: Trans, b: &Tensor, tb: Trans) -> &'static str {
    static NAMES: OnceLock<Mutex<HashMap<String, &'static str>>> = OnceLock::new();
    let ((m, k), (_, n)) = (ta.dims(a), tb.dims(b));
    let flag = |t: Trans| if t == Trans::Yes { 'T' } else { 'N' };
    let name = format!("{kind} {m}x{k}x{n} {}{}", flag(ta), flag(tb));
    let mut names = NAMES
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    names
        .entry(name)
        .or_insert_with_key(|k| Box::leak(k.clone().into_boxed_str()))
}
