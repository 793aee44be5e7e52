//! A linear layer's bias added inside its product by cuBLASLt (`CUBLASLT_EPILOGUE_BIAS`), so
//! that the forward pass writes `x w + b` once instead of writing `x w` and then reading and
//! writing it again to add `b` (the `add_bias` kernel: 4 ms of GPT-2 124M's 100 ms step on an
//! H200); and with the GELU after it (`CUBLASLT_EPILOGUE_GELU_AUX_BIAS`), which writes both
//! `z = x w + b`, kept for GELU's gradient, and `GELU(z)` as the product's results are
//! written, instead of a pass that reads `z` again (the `activation` kernel, 1.7 ms of it).
//! cuBLASLt's GELU is the tanh form pipe's GELU is, in its own rounding. In the backward,
//! GELU's gradient rides in the product that makes the gradient of GELU's output
//! (`CUBLASLT_EPILOGUE_DGELU`: `dz = GELU'(z) (.) (dy w^T)`, `z` read as the auxiliary input),
//! instead of a pass that reads that gradient and `z` again (`activation_backward`, 2.2 ms).
//! And the bias gradient rides in the weight gradient's product (`CUBLASLT_EPILOGUE_BGRADA`:
//! the column sums of `dy`, cuBLASLt's A, as the product `x^T dy` reads it) instead of two
//! passes reading `dy` again (`sum_rows`, 2.4 ms). Written as `gW^T = dY^T X`: A is dY (`n x
//! k`), B is X read transposed (stored `m x k`).
//!
//! **Layout.** Row-major `Y[m, n] = X[m, k] W[k, n]` is column-major `Y^T = W^T X^T`: cuBLASLt's
//! A is W (`n x k`, leading dimension `n`), its B is X (`k x m`, leading dimension `k`), its
//! C and D are Y (`n x m` in f32, leading dimension `n`), and the bias, one value per row of D,
//! is one per output feature. The backward's `dZ[m, n] = dY[m, k] W[n, k]^T` is `dZ^T = W
//! dY^T`: A is W read transposed (stored `k x n`, leading dimension `k`), B is dY (`k x m`).
//!
//! **When it is used.** Only where cuBLASLt has an algorithm for the product with the
//! epilogue: the heuristic's answer is kept per shape, precision and epilogue, and a product
//! without one (or one the library refuses) goes back to the backend's own product and
//! elementwise kernels, which give the same values within the product's rounding.
//! `PIPE_CUBLASLT=0` turns it off, so a GPU session can time both in one run. The workspace
//! (the size cuBLASLt's documentation recommends) is allocated once per backend outside its
//! pool, as cuBLAS's own is, so the pool's peak and pipe's memory model of it leave it out
//! alike.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::cublaslt::{result as lt, sys as lt_sys};
use cudarc::driver::{CudaContext, result as driver};

use crate::backend::Precision;

/// The environment variable that turns the fused bias off (`0`).
pub(crate) const SWITCH: &str = "PIPE_CUBLASLT";

/// What a product's epilogue does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Epilogue {
    /// `y = x w + b`.
    Bias,
    /// `z = x w + b` to the auxiliary output, `y = GELU(z)`.
    BiasGelu,
    /// `dz = GELU'(z) (.) (dy w^T)`, `z` the auxiliary input (no bias).
    GeluGrad,
    /// `gw = x^T dy` (added to the output when accumulating), and the bias gradient, the
    /// column sums of `dy`, written to the bias vector.
    BiasGrad,
}

/// One product of a linear layer: the output's `m x n`, the inner dimension `k`, in
/// `precision`, with `epilogue`, added to the output when `accumulate`. The forward's weight
/// is `k x n`, the input gradient's `n x k`; the weight gradient's operands are `x` (`k x m`)
/// and `dy` (`k x n`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Product {
    pub(crate) m: u64,
    pub(crate) k: u64,
    pub(crate) n: u64,
    pub(crate) precision: Precision,
    pub(crate) epilogue: Epilogue,
    pub(crate) accumulate: bool,
}

/// Device pointers of one product: cuBLASLt's A, `w` (the weight; `dy` for the weight
/// gradient), and B, `x` (the rows it multiplies: `dy` for the input gradient, `x` for the
/// weight gradient), as the precision reads them (bf16 copies under bf16); the f32 bias (read;
/// written under [`Epilogue::BiasGrad`]; none for [`Epilogue::GeluGrad`]), the f32 output `y`
/// (`m x n`), and the f32 auxiliary matrix (`m x n`): written `z` under
/// [`Epilogue::BiasGelu`], read `z` under [`Epilogue::GeluGrad`].
pub(crate) struct Operands {
    pub(crate) w: u64,
    pub(crate) x: u64,
    pub(crate) bias: u64,
    pub(crate) y: u64,
    pub(crate) aux: u64,
}

/// A cuBLASLt handle, its workspace and the algorithms its heuristic chose, by product.
pub(crate) struct Lt {
    handle: Mutex<Handle>,
    workspace: Workspace,
    algorithms: Mutex<HashMap<Product, Option<lt_sys::cublasLtMatmulAlgo_t>>>,
}

struct Handle(lt_sys::cublasLtHandle_t);

/// Device memory of `bytes` at `ptr` in `ctx`, freed when dropped.
struct Workspace {
    ctx: Arc<CudaContext>,
    ptr: u64,
    bytes: usize,
}

impl Drop for Workspace {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `malloc_sync` in this context, freed once here, after the
            // backend waited for its stream (its `Drop`).
            let _ = unsafe { driver::free_sync(self.ptr) };
        }
    }
}

// SAFETY: the handle is used under the mutex only, on the owning backend's stream.
unsafe impl Send for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: made by `create_handle`, destroyed once here.
        let _ = unsafe { lt::destroy_handle(self.0) };
    }
}

impl std::fmt::Debug for Lt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Lt")
    }
}

/// The workspace cuBLASLt's documentation recommends: 32 MiB on Hopper and newer, 4 MiB before.
fn workspace_bytes(arch: u32) -> usize {
    if arch >= 90 { 32 << 20 } else { 4 << 20 }
}

impl Lt {
    /// A handle and workspace for a backend of `ctx` on a device of compute capability
    /// `arch`, or `None` where the fused bias is not to be used: turned off by
    /// `PIPE_CUBLASLT=0`, or the library absent, refusing a handle, or no memory for the
    /// workspace (the backend then adds every bias itself).
    pub(crate) fn open(ctx: &Arc<CudaContext>, arch: u32) -> Option<Lt> {
        if std::env::var_os(SWITCH).is_some_and(|v| v == "0") {
            return None;
        }
        // SAFETY: only tries to open the library; cudarc's loader panics without it.
        if !unsafe { lt_sys::is_culib_present() } {
            return None;
        }
        ctx.bind_to_thread().ok()?;
        let bytes = workspace_bytes(arch);
        // SAFETY: a plain allocation in the bound context, owned by the `Workspace`.
        let ptr = unsafe { driver::malloc_sync(bytes) }.ok()?;
        let workspace = Workspace {
            ctx: Arc::clone(ctx),
            ptr,
            bytes,
        };
        let handle = lt::create_handle().ok()?;
        Some(Lt {
            handle: Mutex::new(Handle(handle)),
            workspace,
            algorithms: Mutex::default(),
        })
    }

    /// Whether cuBLASLt was asked about `p` before and had no algorithm for it.
    pub(crate) fn refuses(&self, p: &Product) -> bool {
        self.algorithms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(p)
            .is_some_and(Option::is_none)
    }

    /// Queues product `p` with its epilogue on `stream`. `false` where cuBLASLt has no
    /// algorithm for it or refuses the call (nothing was queued: the caller computes it its
    /// own way).
    pub(crate) fn product(&self, p: Product, ops: &Operands, stream: lt_sys::cudaStream_t) -> bool {
        let known = self
            .algorithms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&p)
            .copied();
        if known == Some(None) {
            return false;
        }
        let Ok(plan) = Plan::new(p, ops) else {
            self.remember(p, None);
            return false;
        };
        let handle = self.handle.lock().unwrap_or_else(PoisonError::into_inner);
        let algorithm = match known.flatten() {
            Some(a) => a,
            None => match plan.heuristic(handle.0, self.workspace.bytes) {
                Some(a) => {
                    self.remember(p, Some(a));
                    a
                }
                None => {
                    self.remember(p, None);
                    return false;
                }
            },
        };
        let (alpha, beta) = (1.0f32, if p.accumulate { 1.0f32 } else { 0.0 });
        // SAFETY: the descriptors describe the buffers behind `ops` (the caller's checked
        // shapes); C and D are the same f32 output (read only when accumulating); the
        // workspace holds its bytes on this
        // stream's device, and the stream orders every use of it.
        let queued = unsafe {
            lt::matmul(
                handle.0,
                plan.desc.0,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                ops.w as *const c_void,
                plan.a.0,
                ops.x as *const c_void,
                plan.b.0,
                ops.y as *const c_void,
                plan.d.0,
                ops.y as *mut c_void,
                plan.d.0,
                &algorithm,
                self.workspace.ptr as *mut c_void,
                self.workspace.bytes,
                stream,
            )
        };
        // cuBLASLt checks a call before it queues anything: a refused call leaves the product
        // to the backend's own kernels, for this shape from now on. A device fault would fail
        // those too, and be reported there.
        if queued.is_err() {
            self.remember(p, None);
        }
        queued.is_ok()
    }

    fn remember(&self, p: Product, algorithm: Option<lt_sys::cublasLtMatmulAlgo_t>) {
        self.algorithms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(p, algorithm);
    }
}

/// The descriptors of one product (destroyed when dropped).
struct Plan {
    desc: Desc,
    a: Layout,
    b: Layout,
    d: Layout,
}

struct Desc(lt_sys::cublasLtMatmulDesc_t);
struct Layout(lt_sys::cublasLtMatrixLayout_t);
struct Preference(lt_sys::cublasLtMatmulPreference_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: made by `create_matmul_desc`, destroyed once here.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: made by `create_matrix_layout`, destroyed once here.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: made by `create_matmul_pref`, destroyed once here.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

impl Plan {
    fn new(p: Product, ops: &Operands) -> std::result::Result<Plan, lt::CublasError> {
        use lt_sys::cublasComputeType_t as Compute;
        use lt_sys::cudaDataType_t as Type;
        let (input, compute) = match p.precision {
            Precision::Bf16 => (Type::CUDA_R_16BF, Compute::CUBLAS_COMPUTE_32F),
            Precision::Tf32 => (Type::CUDA_R_32F, Compute::CUBLAS_COMPUTE_32F_FAST_TF32),
            Precision::F32 | Precision::Bf16x6 | Precision::Bf16x3 => {
                (Type::CUDA_R_32F, Compute::CUBLAS_COMPUTE_32F)
            }
        };
        let ld = |v: u64| i64::try_from(v).map_err(|_| lt::CublasError(not_supported()));
        let desc = Desc(lt::create_matmul_desc(compute, Type::CUDA_R_32F)?);
        use lt_sys::cublasLtEpilogue_t as E;
        use lt_sys::cublasLtMatmulDescAttributes_t as Attribute;
        let epilogue = match p.epilogue {
            Epilogue::Bias => E::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::BiasGelu => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            Epilogue::GeluGrad => E::CUBLASLT_EPILOGUE_DGELU,
            Epilogue::BiasGrad => E::CUBLASLT_EPILOGUE_BGRADA,
        };
        let backward = p.epilogue == Epilogue::GeluGrad;
        let weight_grad = p.epilogue == Epilogue::BiasGrad;
        // SAFETY: each attribute is given a value of the type and size cuBLASLt reads for it
        // (the auxiliary matrix's type is left at its default, the output's: f32).
        unsafe {
            lt::set_matmul_desc_attribute(
                desc.0,
                Attribute::CUBLASLT_MATMUL_DESC_EPILOGUE,
                (&epilogue as *const E).cast(),
                size_of::<E>(),
            )?;
            // cuBLASLt's op on A or B, an `i32` (`cublasOperation_t`): 1 for transposed.
            let transposed: i32 = 1;
            if backward || weight_grad {
                let attribute = if backward {
                    Attribute::CUBLASLT_MATMUL_DESC_TRANSA
                } else {
                    Attribute::CUBLASLT_MATMUL_DESC_TRANSB
                };
                lt::set_matmul_desc_attribute(
                    desc.0,
                    attribute,
                    (&transposed as *const i32).cast(),
                    size_of::<i32>(),
                )?;
            }
            if !backward {
                lt::set_matmul_desc_attribute(
                    desc.0,
                    Attribute::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    (&ops.bias as *const u64).cast(),
                    size_of::<u64>(),
                )?;
            }
            if matches!(p.epilogue, Epilogue::BiasGelu | Epilogue::GeluGrad) {
                let aux_ld = ld(p.n)?;
                lt::set_matmul_desc_attribute(
                    desc.0,
                    Attribute::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                    (&ops.aux as *const u64).cast(),
                    size_of::<u64>(),
                )?;
                lt::set_matmul_desc_attribute(
                    desc.0,
                    Attribute::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                    (&aux_ld as *const i64).cast(),
                    size_of::<i64>(),
                )?;
            }
        }
        // A as stored: the forward's weight `k x n` row-major is `n x k` column-major; the
        // backward's `n x k` row-major is `k x n`, read transposed.
        let a = if backward {
            Layout(lt::create_matrix_layout(input, p.k, p.n, ld(p.k)?)?)
        } else {
            Layout(lt::create_matrix_layout(input, p.n, p.k, ld(p.n)?)?)
        };
        // B as stored: the rows (`m x k` row-major, `k x m`); the weight gradient's `x` (`k x
        // m` row-major, `m x k`), read transposed.
        let b = if weight_grad {
            Layout(lt::create_matrix_layout(input, p.m, p.k, ld(p.m)?)?)
        } else {
            Layout(lt::create_matrix_layout(input, p.k, p.m, ld(p.k)?)?)
        };
        Ok(Plan {
            desc,
            a,
            b,
            d: Layout(lt::create_matrix_layout(
                Type::CUDA_R_32F,
                p.n,
                p.m,
                ld(p.n)?,
            )?),
        })
    }

    /// cuBLASLt's best algorithm for this product within `workspace` bytes, if it has one.
    fn heuristic(
        &self,
        handle: lt_sys::cublasLtHandle_t,
        workspace: usize,
    ) -> Option<lt_sys::cublasLtMatmulAlgo_t> {
        let preference = Preference(lt::create_matmul_pref().ok()?);
        let bytes = workspace as u64;
        // SAFETY: the attribute is a u64 byte count; every descriptor is live.
        unsafe {
            lt::set_matmul_pref_attribute(
                preference.0,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&bytes as *const u64).cast(),
                size_of::<u64>(),
            )
            .ok()?;
            let found = lt::get_matmul_algo_heuristic(
                handle,
                self.desc.0,
                self.a.0,
                self.b.0,
                self.d.0,
                self.d.0,
                preference.0,
            )
            .ok()?;
            (found.workspaceSize <= workspace).then_some(found.algo)
        }
    }
}

fn not_supported() -> lt_sys::cublasStatus_t {
    lt_sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED
}
