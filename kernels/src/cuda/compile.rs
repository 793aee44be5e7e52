//! NVRTC compilation of `kernels.cu`: once per process and GPU architecture (every worker on the
//! same kind of GPU shares the PTX), and on demand for the source check that CI runs without a
//! GPU.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, PoisonError};

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};

use crate::{KernelError, Result};

use super::source::KERNEL_SOURCE;

/// Whether the NVRTC library can be loaded (it needs no GPU and no driver).
pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn no_nvrtc() -> KernelError {
    KernelError::NoCuda {
        reason: "the NVRTC library (libnvrtc.so.12) could not be loaded; install the CUDA \
                 runtime libraries or put them on LD_LIBRARY_PATH"
            .into(),
    }
}

/// Compiles `source` for virtual architecture `compute_<arch>` (for example `80`) and
/// returns the PTX text.
///
/// # Errors
/// [`KernelError::NoCuda`] without NVRTC; [`KernelError::Cuda`] with the compiler's log when the
/// source does not compile.
pub(crate) fn compile(source: &str, arch: u32) -> Result<String> {
    if !nvrtc_present() {
        return Err(no_nvrtc());
    }
    let opts = CompileOptions {
        name: Some("pipe_kernels.cu".into()),
        options: vec![
            format!("--gpu-architecture=compute_{arch}"),
            "--std=c++14".into(),
        ],
        ..CompileOptions::default()
    };
    let ptx = compile_ptx_with_opts(source, opts).map_err(|e| KernelError::Cuda {
        op: "nvrtc",
        detail: describe(&e),
    })?;
    Ok(ptx.to_src())
}

fn describe(e: &CompileError) -> String {
    match e {
        CompileError::CompileError { log, options, .. } => format!(
            "the CUDA source does not compile with {}: {}",
            options.join(" "),
            log.to_string_lossy().trim()
        ),
        other => other.to_string(),
    }
}

/// The PTX for `arch`, compiled on first use and shared by every backend in the process.
pub(crate) fn ptx_for(arch: u32) -> Result<Ptx> {
    static CACHE: OnceLock<Mutex<HashMap<u32, String>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Mutex::default);
    let mut map = cache.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(src) = map.get(&arch) {
        return Ok(Ptx::from_src(src.clone()));
    }
    let src = compile(KERNEL_SOURCE, arch)?;
    map.insert(arch, src.clone());
    Ok(Ptx::from_src(src))
}
