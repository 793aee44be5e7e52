//! f32 matrix products through an external CBLAS library: Intel's oneMKL (`libmkl_rt`),
//! OpenBLAS or BLIS, opened at run time from the path in [`ENV`] (`PIPE_CBLAS`).
//!
//! No Rust crate reaches a vendor library's rate at the shapes pipe's models use (on Intel
//! Xeons `gemm` runs at 0.8-0.9 of oneMKL's: `experiments/cpu-step/results.md`), and a
//! machine that has such a library can lend it to pipe without a rebuild: the variable names
//! the shared library, every CPU backend of the process (and of the worker processes it
//! starts, which inherit it) computes its f32 products with the library's `cblas_sgemm`, and
//! nothing else changes. It is a setting of the machine, as `OMP_NUM_THREADS` is, so it is
//! read here, once per process, and not carried by every run's configuration.
//!
//! The library computes each call on one thread, and the CPU backend splits a product into
//! blocks that depend on its shape alone, one task each on its pool, as it does for `gemm`
//! (so the library's threads never compete with the pool's). The library is asked for one
//! thread per call where it has a known way to be asked (oneMKL's sequential threading layer,
//! `openblas_set_num_threads`); set a library without one to a single thread in its own
//! environment. oneMKL is also put in its conditional numerical reproducibility mode
//! (`MKL_CBWR=AUTO`) unless `MKL_CBWR` is set, so a product's bits do not depend on where its
//! operands lie in memory. The bits then depend on the library and the machine, not on the
//! thread count; they differ from `gemm`'s, so a run's weights digest does too.

use std::ffi::{c_char, c_int};
use std::path::Path;
use std::sync::{Arc, OnceLock};

use crate::{KernelError, Result};

/// The environment variable naming the CBLAS shared library.
pub const ENV: &str = "PIPE_CBLAS";

/// `CblasRowMajor`.
pub(crate) const ROW_MAJOR: c_int = 101;
/// `CblasNoTrans`.
pub(crate) const NO_TRANS: c_int = 111;
/// `CblasTrans`.
pub(crate) const TRANS: c_int = 112;
/// oneMKL's `MKL_THREADING_SEQUENTIAL`.
const MKL_THREADING_SEQUENTIAL: c_int = 1;
/// oneMKL's `MKL_CBWR_AUTO`.
const MKL_CBWR_AUTO: c_int = 2;
/// oneMKL's `MKL_CBWR_SUCCESS`.
const MKL_CBWR_SUCCESS: c_int = 0;

/// `cblas_sgemm`, with 32-bit integers (the LP64 interface).
pub(crate) type Sgemm = unsafe extern "C" fn(
    layout: c_int,
    trans_a: c_int,
    trans_b: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: f32,
    a: *const f32,
    lda: c_int,
    b: *const f32,
    ldb: c_int,
    beta: f32,
    c: *mut f32,
    ldc: c_int,
);

/// An opened CBLAS library: its `cblas_sgemm` and what it is.
pub(crate) struct Cblas {
    sgemm: Sgemm,
    /// The path it was opened from and the version it reports, for reports.
    description: String,
    /// Keeps the library mapped while `sgemm` may be called.
    _library: Option<libloading::Library>,
}

impl std::fmt::Debug for Cblas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.description)
    }
}

/// One row-major operand as CBLAS takes it: whether it is read transposed, and its leading
/// dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stored {
    trans: c_int,
    ld: c_int,
}

/// How CBLAS reads `op(x)`, a `rows x cols` operand at row stride `rs` and column stride `cs`
/// (one of them 1, as every tensor's are): row-major as it is, or transposed from its stored
/// `cols x rows`. `None` for strides CBLAS cannot express or sizes past its 32-bit integers.
pub(crate) fn stored(rows: usize, cols: usize, rs: isize, cs: isize) -> Option<Stored> {
    let int = |v: usize| c_int::try_from(v.max(1)).ok();
    if cs == 1 && (rows == 1 || rs >= cols as isize) {
        // One row's stride is never read: CBLAS only asks that it cover the row.
        let ld = if rows == 1 { cols } else { rs as usize };
        return Some(Stored {
            trans: NO_TRANS,
            ld: int(ld)?,
        });
    }
    if rs == 1 && (cols == 1 || cs >= rows as isize) {
        let ld = if cols == 1 { rows } else { cs as usize };
        return Some(Stored {
            trans: TRANS,
            ld: int(ld)?,
        });
    }
    None
}

/// One product for [`Cblas::product`]: `C (m x n, row stride ldc) = op(A) op(B)`, or `+=`.
pub(crate) struct Call {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: *const f32,
    pub a_stored: Stored,
    pub b: *const f32,
    pub b_stored: Stored,
    pub c: *mut f32,
    pub ldc: usize,
    pub accumulate: bool,
}

impl Cblas {
    /// Opens the library at `path` and prepares it for one-thread calls.
    ///
    /// # Errors
    /// [`KernelError::Cblas`] when it cannot be opened or has no `cblas_sgemm`.
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let fail = |reason: String| KernelError::Cblas {
            path: path.display().to_string(),
            reason,
        };
        // A path must lead to a regular file: the loader would wait forever on a named pipe.
        // A bare name is the loader's to find in its search path.
        if path.as_os_str().as_encoded_bytes().contains(&b'/') {
            let meta = std::fs::metadata(path).map_err(|e| fail(e.to_string()))?;
            if !meta.is_file() {
                return Err(fail("not a regular file (a shared library)".into()));
            }
        }
        // SAFETY: opening a shared library runs its initialisers; a BLAS library's only set up
        // its own state. The user named this library as the one to compute with.
        let library = unsafe { libloading::Library::new(path) }.map_err(|e| {
            // The loader's own words (no such file, wrong architecture) are the cause's.
            fail(match std::error::Error::source(&e) {
                Some(cause) => format!("{e}: {cause}"),
                None => e.to_string(),
            })
        })?;
        // oneMKL's controls must come before its first computation.
        // SAFETY: oneMKL's `MKL_Set_Threading_Layer(int)` and `MKL_CBWR_Set(int)`, by value.
        unsafe {
            if let Ok(set_layer) =
                library.get::<unsafe extern "C" fn(c_int) -> c_int>(b"MKL_Set_Threading_Layer\0")
            {
                set_layer(MKL_THREADING_SEQUENTIAL);
            }
            if std::env::var_os("MKL_CBWR").is_none() {
                if let Ok(cbwr) =
                    library.get::<unsafe extern "C" fn(c_int) -> c_int>(b"MKL_CBWR_Set\0")
                {
                    let status = cbwr(MKL_CBWR_AUTO);
                    if status != MKL_CBWR_SUCCESS {
                        return Err(fail(format!(
                            "MKL_CBWR_Set(MKL_CBWR_AUTO) failed with status {status}"
                        )));
                    }
                }
            }
            if let Ok(set_threads) =
                library.get::<unsafe extern "C" fn(c_int)>(b"openblas_set_num_threads\0")
            {
                set_threads(1);
            }
        }
        // SAFETY: `cblas_sgemm` has the LP64 CBLAS signature of [`Sgemm`].
        let sgemm = *unsafe { library.get::<Sgemm>(b"cblas_sgemm\0") }
            .map_err(|_| fail("it has no cblas_sgemm".into()))?;
        let description = match version(&library) {
            Some(v) => format!("{} ({v})", path.display()),
            None => path.display().to_string(),
        };
        Ok(Self {
            sgemm,
            description,
            _library: Some(library),
        })
    }

    /// A `cblas_sgemm` given directly (tests: a reference product in Rust).
    #[cfg(test)]
    pub(crate) fn from_fn(sgemm: Sgemm) -> Self {
        Self {
            sgemm,
            description: "a reference cblas_sgemm".into(),
            _library: None,
        }
    }

    /// The path it was opened from, and its version where it reports one.
    pub(crate) fn description(&self) -> &str {
        &self.description
    }

    /// Computes `call` with one `cblas_sgemm` on the calling thread.
    ///
    /// # Safety
    /// The pointers must address live operands of the call's sizes at its strides, and `c`
    /// must not overlap them; `c` is read only when accumulating. The sizes must fit CBLAS's
    /// 32-bit integers ([`fits`]).
    pub(crate) unsafe fn product(&self, call: &Call) {
        let beta = if call.accumulate { 1.0 } else { 0.0 };
        // SAFETY: the caller's guarantee; with beta 0, CBLAS writes `c` without reading it.
        unsafe {
            (self.sgemm)(
                ROW_MAJOR,
                call.a_stored.trans,
                call.b_stored.trans,
                call.m as c_int,
                call.n as c_int,
                call.k as c_int,
                1.0,
                call.a,
                call.a_stored.ld,
                call.b,
                call.b_stored.ld,
                beta,
                call.c,
                call.ldc.max(1) as c_int,
            );
        }
    }
}

/// Whether a product of these sizes (and so its output's row stride `n`) fits CBLAS's 32-bit
/// integers.
pub(crate) fn fits(m: usize, n: usize, k: usize) -> bool {
    [m, n, k].iter().all(|&v| c_int::try_from(v).is_ok())
}

/// The version string oneMKL reports (`MKL_Get_Version_String`), or OpenBLAS's configuration
/// (`openblas_get_config`).
fn version(library: &libloading::Library) -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: oneMKL's `MKL_Get_Version_String(char *buf, int len)` writes at most `len` bytes;
    // OpenBLAS's `openblas_get_config()` returns a static C string.
    unsafe {
        if let Ok(get) =
            library.get::<unsafe extern "C" fn(*mut c_char, c_int)>(b"MKL_Get_Version_String\0")
        {
            get(buf.as_mut_ptr().cast(), (buf.len() - 1) as c_int);
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            return Some(String::from_utf8_lossy(&buf[..end]).trim().to_string());
        }
        if let Ok(get) =
            library.get::<unsafe extern "C" fn() -> *const c_char>(b"openblas_get_config\0")
        {
            let text = get();
            if !text.is_null() {
                return Some(
                    std::ffi::CStr::from_ptr(text)
                        .to_string_lossy()
                        .trim()
                        .to_string(),
                );
            }
        }
    }
    None
}

/// The library [`ENV`] names, opened once for the process; `None` where it is unset or
/// empty.
///
/// # Errors
/// [`KernelError::Cblas`] when the named library cannot be used (every later call too).
pub(crate) fn configured() -> Result<Option<Arc<Cblas>>> {
    static OPENED: OnceLock<Result<Option<Arc<Cblas>>>> = OnceLock::new();
    OPENED
        .get_or_init(|| match std::env::var_os(ENV) {
            Some(path) if !path.is_empty() => {
                Cblas::open(Path::new(&path)).map(|c| Some(Arc::new(c)))
            }
            _ => Ok(None),
        })
        .clone()
}

/// What computes the CPU backend's f32 products in this process: the CBLAS library [`ENV`]
/// names (its path and version), or `None` for the `gemm` crate.
///
/// # Errors
/// [`KernelError::Cblas`] when the named library cannot be used.
pub fn cblas_library() -> Result<Option<String>> {
    Ok(configured()?.map(|c| c.description().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operands_map_to_cblas_transposes_and_leading_dimensions() {
        // (rows, cols, row stride, column stride) of op(x) -> (transpose, leading dimension).
        let cases = [
            // A 3 x 4 stored matrix as it is, and transposed (4 x 3 at strides 1, 4).
            ((3, 4, 4, 1), (NO_TRANS, 4)),
            ((4, 3, 1, 4), (TRANS, 4)),
            // One row or one column: a stride never read is made legal.
            ((1, 5, 1, 1), (NO_TRANS, 5)),
            ((5, 1, 1, 5), (TRANS, 5)),
            ((5, 1, 1, 1), (NO_TRANS, 1)),
        ];
        for ((rows, cols, rs, cs), (trans, ld)) in cases {
            assert_eq!(stored(rows, cols, rs, cs), Some(Stored { trans, ld }));
        }
        // Neither stride 1, or sizes past 32 bits.
        assert_eq!(stored(3, 4, 8, 2), None);
        assert_eq!(stored(3, 1 << 31, 1 << 31, 1), None);
    }

    #[test]
    fn a_library_that_cannot_be_used_is_a_one_line_error() {
        let dir = std::env::temp_dir().join(format!("pipe-cblas-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo.so");
        let c_path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid C string; makes a named pipe in the test's own folder.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        let text = dir.join("text.so");
        std::fs::write(&text, "not a library\n").unwrap();
        // The first bytes of an ELF file, cut short.
        let truncated = dir.join("truncated.so");
        std::fs::write(&truncated, b"\x7fELF\x02\x01\x01\0").unwrap();
        // (path, what the error says)
        let cases = [
            (Path::new("/nonexistent/libcblas.so"), "No such file"),
            (dir.as_path(), "not a regular file"),
            (fifo.as_path(), "not a regular file"),
            (Path::new("/dev/zero"), "not a regular file"),
            (text.as_path(), "dlopen failed"),
            (truncated.as_path(), "dlopen failed"),
            // The C library is a shared library without `cblas_sgemm`.
            (Path::new("libc.so.6"), "it has no cblas_sgemm"),
        ];
        for (path, says) in cases {
            let e = Cblas::open(path).unwrap_err();
            assert!(matches!(e, KernelError::Cblas { .. }), "{e}");
            let line = e.to_string();
            assert!(
                !line.contains('\n') && line.contains(says),
                "{path:?}: {line}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
