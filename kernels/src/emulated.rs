//! A device backend without a device: tensors live in buffers it owns behind
//! [`Storage::Device`], as a GPU backend's do, and every operation is computed by the CPU
//! backend on host copies. Its results are the CPU backend's bit for bit.
//!
//! It exists so that the code above the backend that only a device exercises (placing inputs,
//! copying weights and messages out, staging an all-reduce through the host, passing device
//! buffers between workers) runs and is checked against the reference trainer on machines with
//! no GPU. It is as strict as the CUDA backend: an input that was not placed, or that another
//! backend holds, is an error, never a silent host read.

use std::any::Any;
use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::{
    Activation, AdamStep, AttentionShape, Backend, DelayCompensation, LionStep, LossStats, SgdStep,
    Trans,
};
use crate::{CpuBackend, Device, DeviceMemory, Element, KernelError, Result, Storage, Tensor};

/// Source of emulator identities: a buffer knows which emulator made it.
static EMULATORS: AtomicU64 = AtomicU64::new(1);

/// A buffer of the emulated device: the elements' bits, counted in its device's usage while
/// it lives.
#[derive(Debug)]
struct EmulatedMemory {
    owner: u64,
    ordinal: usize,
    bits: Vec<u32>,
    usage: Arc<Usage>,
}

/// The bytes an emulated device's buffers hold now and at most, as a device backend's pool
/// reports them ([`Backend::peak_memory`]).
#[derive(Debug, Default)]
struct Usage {
    live: AtomicU64,
    peak: AtomicU64,
}

impl Usage {
    fn add(&self, bytes: u64) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
}

impl Drop for EmulatedMemory {
    fn drop(&mut self) {
        self.usage
            .live
            .fetch_sub(self.bits.len() as u64 * 4, Ordering::Relaxed);
    }
}

impl DeviceMemory for EmulatedMemory {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn bytes(&self) -> usize {
        self.bits.len() * 4
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Element types as the bits the emulated device stores.
trait Bits: Element {
    fn to_bits(self) -> u32;
    fn from_bits(bits: u32) -> Self;
}

impl Bits for f32 {
    fn to_bits(self) -> u32 {
        f32::to_bits(self)
    }
    fn from_bits(bits: u32) -> Self {
        f32::from_bits(bits)
    }
}

impl Bits for u32 {
    fn to_bits(self) -> u32 {
        self
    }
    fn from_bits(bits: u32) -> Self {
        bits
    }
}

/// The emulated device backend (see the module docs). It presents itself as CUDA device
/// `ordinal` (so code that asks where a tensor lives sees a device) and names itself
/// `emulated`.
#[derive(Debug)]
pub struct EmulatedDevice {
    id: u64,
    ordinal: usize,
    cpu: CpuBackend,
    usage: Arc<Usage>,
}

impl EmulatedDevice {
    /// An emulated device numbered `ordinal`, computing with one CPU thread.
    ///
    /// # Errors
    /// The CPU backend's thread pool failing to start.
    pub fn new(ordinal: usize) -> Result<Self> {
        Ok(Self {
            id: EMULATORS.fetch_add(1, Ordering::Relaxed),
            ordinal,
            cpu: CpuBackend::new(1)?,
            usage: Arc::default(),
        })
    }

    fn wrong(&self, op: &'static str, found: Device) -> KernelError {
        KernelError::WrongDevice {
            op,
            expected: Device::Cuda(self.ordinal),
            found,
        }
    }

    /// A host copy of one of this emulator's tensors.
    fn input<E: Bits>(&self, t: &Tensor<E>, op: &'static str) -> Result<Tensor<E>> {
        match t.storage() {
            Storage::Device(m) => match m.as_any().downcast_ref::<EmulatedMemory>() {
                Some(e) if e.owner == self.id => {
                    Tensor::from_vec(t.shape(), e.bits.iter().map(|&b| E::from_bits(b)).collect())
                }
                _ => Err(self.wrong(op, t.device())),
            },
            Storage::Host(_) => Err(self.wrong(op, t.device())),
        }
    }

    /// A host copy of an operand updated in place: one of this emulator's tensors, or one it
    /// would copy in first (a host tensor, another device's), as a device backend does.
    fn in_place(&self, t: &Tensor) -> Result<Tensor> {
        let placed = self.place_any(t.clone())?;
        self.input(&placed, "in place")
    }

    /// `t` (a host tensor) as one of this emulator's.
    fn output<E: Bits>(&self, t: Tensor<E>) -> Result<Tensor<E>> {
        let shape = t.shape().to_vec();
        let bits: Vec<u32> = t.into_host_vec()?.into_iter().map(Bits::to_bits).collect();
        self.usage.add(bits.len() as u64 * 4);
        let memory: Arc<dyn DeviceMemory> = Arc::new(EmulatedMemory {
            owner: self.id,
            ordinal: self.ordinal,
            bits,
            usage: Arc::clone(&self.usage),
        });
        Tensor::from_device(&shape, memory)
    }

    fn place_any<E: Bits>(&self, t: Tensor<E>) -> Result<Tensor<E>> {
        match t.storage() {
            Storage::Host(v) if v.is_empty() => self.output(Tensor::from_vec(&[0], Vec::new())?),
            Storage::Host(_) => self.output(t),
            Storage::Device(m) => match m.as_any().downcast_ref::<EmulatedMemory>() {
                Some(e) if e.owner == self.id => Ok(t),
                // Another emulator's buffer: copied, as a peer copy would.
                Some(e) => {
                    let values = e.bits.iter().map(|&b| E::from_bits(b)).collect();
                    self.output(Tensor::from_vec(t.shape(), values)?)
                }
                None => Err(self.wrong("place", t.device())),
            },
        }
    }

    /// Runs `f` on a fresh host output and makes the result this emulator's.
    fn produce(&self, f: impl FnOnce(&mut Tensor) -> Result<()>) -> Result<Tensor> {
        let mut out = Tensor::default();
        f(&mut out)?;
        self.output(out)
    }
}

impl Backend for EmulatedDevice {
    fn name(&self) -> &'static str {
        "emulated"
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn threads(&self) -> usize {
        1
    }

    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn peak_memory(&self) -> Option<u64> {
        Some(self.usage.peak.load(Ordering::Relaxed))
    }

    fn place(&self, t: Tensor) -> Result<Tensor> {
        self.place_any(t)
    }

    fn place_ids(&self, t: Tensor<u32>) -> Result<Tensor<u32>> {
        self.place_any(t)
    }

    fn read<'a>(&self, t: &'a Tensor) -> Result<Cow<'a, [f32]>> {
        match t.storage() {
            Storage::Host(v) => Ok(Cow::Borrowed(v)),
            Storage::Device(_) => {
                let placed = self.place_any(t.clone())?;
                Ok(Cow::Owned(self.input(&placed, "read")?.into_host_vec()?))
            }
        }
    }

    fn write(&self, src: &[f32], t: &mut Tensor) -> Result<()> {
        crate::check::write(src.len(), t)?;
        *t = self.output(Tensor::from_vec(t.shape(), src.to_vec())?)?;
        Ok(())
    }

    fn copy(&self, src: &Tensor, dst: &mut Tensor) -> Result<()> {
        let s = self.input(src, "copy")?;
        *dst = self.produce(|o| self.cpu.copy(&s, o))?;
        Ok(())
    }

    fn fill(&self, value: f32, x: &mut Tensor) -> Result<()> {
        *x = self.output(Tensor::full(x.shape(), value))?;
        Ok(())
    }

    fn mul(&self, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
        crate::check::same_len("mul", (a, b), ("a", "b"))?;
        let (a, b) = (self.input(a, "mul")?, self.input(b, "mul")?);
        *out = self.produce(|o| self.cpu.mul(&a, &b, o))?;
        Ok(())
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
        crate::check::matmul((a, ta), (b, tb), c, accumulate)?;
        let (a, b) = (self.input(a, "matmul")?, self.input(b, "matmul")?);
        let mut host = if accumulate {
            self.in_place(c)?
        } else {
            Tensor::default()
        };
        self.cpu.matmul(&a, ta, &b, tb, &mut host, accumulate)?;
        *c = self.output(host)?;
        Ok(())
    }

    fn transpose(&self, a: &Tensor, out: &mut Tensor) -> Result<()> {
        let a = self.input(a, "transpose")?;
        *out = self.produce(|o| self.cpu.transpose(&a, o))?;
        Ok(())
    }

    fn add_bias(&self, y: &mut Tensor, bias: &Tensor) -> Result<()> {
        crate::check::bias(y, bias)?;
        let bias = self.input(bias, "add_bias")?;
        let mut host = self.in_place(y)?;
        self.cpu.add_bias(&mut host, &bias)?;
        *y = self.output(host)?;
        Ok(())
    }

    fn sum_rows(&self, x: &Tensor, out: &mut Tensor, accumulate: bool) -> Result<()> {
        if accumulate {
            crate::check::sum_rows_into(x, out)?;
        }
        let x = self.input(x, "sum_rows")?;
        let mut host = if accumulate {
            self.in_place(out)?
        } else {
            Tensor::default()
        };
        self.cpu.sum_rows(&x, &mut host, accumulate)?;
        *out = self.output(host)?;
        Ok(())
    }

    fn activation(&self, act: Activation, x: &Tensor, y: &mut Tensor) -> Result<()> {
        let x = self.input(x, "activation")?;
        *y = self.produce(|o| self.cpu.activation(act, &x, o))?;
        Ok(())
    }

    fn activation_backward(
        &self,
        act: Activation,
        x: &Tensor,
        dy: &Tensor,
        dx: &mut Tensor,
    ) -> Result<()> {
        crate::check::activation_backward(x, dy)?;
        let (x, dy) = (
            self.input(x, "activation_backward")?,
            self.input(dy, "activation_backward")?,
        );
        *dx = self.produce(|o| self.cpu.activation_backward(act, &x, &dy, o))?;
        Ok(())
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
        crate::check::layer_norm(x, gamma, beta)?;
        let op = "layer_norm";
        let (x, g, b) = (
            self.input(x, op)?,
            self.input(gamma, op)?,
            self.input(beta, op)?,
        );
        let (mut yh, mut mh, mut rh) = (Tensor::default(), Tensor::default(), Tensor::default());
        self.cpu
            .layer_norm(&x, &g, &b, eps, &mut yh, &mut mh, &mut rh)?;
        *y = self.output(yh)?;
        *mean = self.output(mh)?;
        *rstd = self.output(rh)?;
        Ok(())
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
        crate::check::layer_norm_backward_input(x, gamma, (mean, rstd), dy)?;
        let op = "layer_norm_backward_input";
        let (x, g) = (self.input(x, op)?, self.input(gamma, op)?);
        let (m, r, dy) = (
            self.input(mean, op)?,
            self.input(rstd, op)?,
            self.input(dy, op)?,
        );
        *dx = self.produce(|o| self.cpu.layer_norm_backward_input(&x, &g, &m, &r, &dy, o))?;
        Ok(())
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
        crate::check::layer_norm_backward_params(x, (mean, rstd), dy, (dgamma, dbeta), accumulate)?;
        let op = "layer_norm_backward_params";
        let (x, m) = (self.input(x, op)?, self.input(mean, op)?);
        let (r, dy) = (self.input(rstd, op)?, self.input(dy, op)?);
        let (mut g, mut b) = if accumulate {
            (self.in_place(dgamma)?, self.in_place(dbeta)?)
        } else {
            (Tensor::default(), Tensor::default())
        };
        self.cpu
            .layer_norm_backward_params(&x, &m, &r, &dy, &mut g, &mut b, accumulate)?;
        *dgamma = self.output(g)?;
        *dbeta = self.output(b)?;
        Ok(())
    }

    fn softmax_cross_entropy(
        &self,
        logits: &Tensor,
        labels: &Tensor<u32>,
        grad_scale: f32,
        dlogits: Option<&mut Tensor>,
    ) -> Result<LossStats> {
        crate::check::label_count(logits, labels)?;
        let op = "softmax_cross_entropy";
        let (l, y) = (self.input(logits, op)?, self.input(labels, op)?);
        match dlogits {
            Some(d) => {
                let mut host = Tensor::default();
                let stats = self
                    .cpu
                    .softmax_cross_entropy(&l, &y, grad_scale, Some(&mut host))?;
                *d = self.output(host)?;
                Ok(stats)
            }
            None => self.cpu.softmax_cross_entropy(&l, &y, grad_scale, None),
        }
    }

    fn embedding(&self, ids: &Tensor, table: &Tensor, out: &mut Tensor) -> Result<()> {
        let (ids, table) = (
            self.input(ids, "embedding")?,
            self.input(table, "embedding")?,
        );
        *out = self.produce(|o| self.cpu.embedding(&ids, &table, o))?;
        Ok(())
    }

    fn embedding_backward(
        &self,
        ids: &Tensor,
        dy: &Tensor,
        dtable: &mut Tensor,
        accumulate: bool,
    ) -> Result<()> {
        crate::check::embedding_backward(ids, dy, dtable.cols())?;
        let op = "embedding_backward";
        let (ids, dy) = (self.input(ids, op)?, self.input(dy, op)?);
        let mut host = self.in_place(dtable)?;
        self.cpu
            .embedding_backward(&ids, &dy, &mut host, accumulate)?;
        *dtable = self.output(host)?;
        Ok(())
    }

    fn attention(
        &self,
        qkv: &Tensor,
        documents: Option<&Tensor>,
        shape: AttentionShape,
        out: &mut Tensor,
        lse: &mut Tensor,
    ) -> Result<()> {
        let qkv = self.input(qkv, "attention")?;
        let documents = documents.map(|d| self.input(d, "attention")).transpose()?;
        let (mut o, mut l) = (Tensor::default(), Tensor::default());
        self.cpu
            .attention(&qkv, documents.as_ref(), shape, &mut o, &mut l)?;
        *out = self.output(o)?;
        *lse = self.output(l)?;
        Ok(())
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
        crate::check::attention_backward(qkv, (out, lse, dout), shape)?;
        let op = "attention backward";
        let (q, o) = (self.input(qkv, op)?, self.input(out, op)?);
        let (l, d) = (self.input(lse, op)?, self.input(dout, op)?);
        let starts = documents.map(|d| self.input(d, op)).transpose()?;
        *dqkv = self.produce(|g| {
            self.cpu
                .attention_backward(&q, starts.as_ref(), &o, &l, &d, shape, g)
        })?;
        Ok(())
    }

    fn axpy(&self, alpha: f32, x: &Tensor, y: &mut Tensor) -> Result<()> {
        crate::check::same_len("axpy", (x, y), ("x", "y"))?;
        let x = self.input(x, "axpy")?;
        let mut host = self.in_place(y)?;
        self.cpu.axpy(alpha, &x, &mut host)?;
        *y = self.output(host)?;
        Ok(())
    }

    fn scale(&self, alpha: f32, x: &mut Tensor) -> Result<()> {
        let mut host = self.in_place(x)?;
        self.cpu.scale(alpha, &mut host)?;
        *x = self.output(host)?;
        Ok(())
    }

    fn sgd_update(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        buf: Option<&mut Tensor>,
        hp: SgdStep,
    ) -> Result<()> {
        crate::check::sgd(param, grad, buf.as_deref(), hp.momentum)?;
        let g = self.input(grad, "sgd_update")?;
        let mut w = self.in_place(param)?;
        match buf {
            Some(b) => {
                let mut bh = self.in_place(b)?;
                self.cpu.sgd_update(&mut w, &g, Some(&mut bh), hp)?;
                *b = self.output(bh)?;
            }
            None => self.cpu.sgd_update(&mut w, &g, None, hp)?,
        }
        *param = self.output(w)?;
        Ok(())
    }

    fn adam_update(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        hp: AdamStep,
    ) -> Result<()> {
        crate::check::adam(param, grad, m, v)?;
        let g = self.input(grad, "adam_update")?;
        let (mut w, mut mh, mut vh) = (self.in_place(param)?, self.in_place(m)?, self.in_place(v)?);
        self.cpu.adam_update(&mut w, &g, &mut mh, &mut vh, hp)?;
        *param = self.output(w)?;
        *m = self.output(mh)?;
        *v = self.output(vh)?;
        Ok(())
    }

    fn lion_update(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        hp: LionStep,
    ) -> Result<()> {
        crate::check::lion(param, grad, m)?;
        let g = self.input(grad, "lion_update")?;
        let (mut w, mut mh) = (self.in_place(param)?, self.in_place(m)?);
        self.cpu.lion_update(&mut w, &g, &mut mh, hp)?;
        *param = self.output(w)?;
        *m = self.output(mh)?;
        Ok(())
    }

    fn delay_compensate(
        &self,
        grad: &mut Tensor,
        current: &Tensor,
        stale: &Tensor,
        mean_square: Option<&mut Tensor>,
        hp: DelayCompensation,
    ) -> Result<()> {
        let adaptive = hp.adaptive.is_some();
        crate::check::delay_compensation(grad, current, stale, mean_square.as_deref(), adaptive)?;
        let w = self.input(current, "delay_compensate")?;
        let ws = self.input(stale, "delay_compensate")?;
        let mut g = self.in_place(grad)?;
        match mean_square {
            Some(ms) if adaptive => {
                let mut msh = self.in_place(ms)?;
                self.cpu
                    .delay_compensate(&mut g, &w, &ws, Some(&mut msh), hp)?;
                *ms = self.output(msh)?;
            }
            _ => self.cpu.delay_compensate(&mut g, &w, &ws, None, hp)?,
        }
        *grad = self.output(g)?;
        Ok(())
    }

    fn sum(&self, x: &Tensor) -> Result<f64> {
        self.cpu.sum(&self.input(x, "sum")?)
    }

    fn sum_squares(&self, x: &Tensor) -> Result<f64> {
        self.cpu.sum_squares(&self.input(x, "sum_squares")?)
    }
}
