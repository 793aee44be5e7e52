//! NVRTC compilation of `kernels.cu`: once per process and GPU architecture (every worker on the
//! same kind of GPU shares the image), and on demand for the source check that CI runs without
//! a GPU.
//!
//! A device gets a CUBIN for its own architecture when this NVRTC knows it: machine code needs
//! no JIT and, unlike PTX, loads on a driver older than NVRTC. A GPU newer than NVRTC gets PTX
//! for the newest architecture NVRTC knows below it, which the driver compiles forward.

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int};
use std::sync::{Mutex, OnceLock, PoisonError};

use cudarc::nvrtc::{Ptx, result, sys};

use crate::{KernelError, Result};

use super::source::KERNEL_SOURCE;

/// Whether the NVRTC library can be loaded (it needs no GPU and no driver).
pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library.
    unsafe { sys::is_culib_present() }
}

fn no_nvrtc() -> KernelError {
    KernelError::NoCuda {
        reason: format!(
            "the NVRTC library could not be loaded ({}); install the CUDA runtime libraries (a \
             toolkit, or the nvidia-cuda-nvrtc wheel)",
            super::libraries::explain(super::libraries::Library::Nvrtc)
        ),
    }
}

/// NVRTC's version, `(major, minor)`.
///
/// # Errors
/// [`KernelError::NoCuda`] without NVRTC.
pub(crate) fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_present() {
        return Err(no_nvrtc());
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two integers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| nvrtc_err("version", e))?;
    Ok((major, minor))
}

fn nvrtc_err(what: &str, e: impl std::fmt::Debug) -> KernelError {
    KernelError::Cuda {
        op: "nvrtc",
        detail: format!("{what}: {e:?}"),
    }
}

/// What to make of the source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Target {
    /// Machine code for `sm_<arch>`.
    Cubin(u32),
    /// PTX for `compute_<arch>`.
    Ptx(u32),
}

/// A compiled NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program came from nvrtcCreateProgram and is destroyed once.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// Compiles `source` for `target` and returns the image: CUBIN bytes, or PTX text.
///
/// # Errors
/// [`KernelError::NoCuda`] without NVRTC; [`KernelError::Cuda`] with the compiler's log when the
/// source does not compile.
pub(crate) fn compile(source: &str, target: Target) -> Result<Vec<u8>> {
    if !nvrtc_present() {
        return Err(no_nvrtc());
    }
    let src = CString::new(source).map_err(|e| nvrtc_err("source", e))?;
    let name = c"pipe_kernels.cu";
    let program =
        Program(result::create_program(&src, Some(name)).map_err(|e| nvrtc_err("create", e))?);
    let options = match target {
        Target::Cubin(arch) => vec![format!("--gpu-architecture=sm_{arch}")],
        Target::Ptx(arch) => vec![format!("--gpu-architecture=compute_{arch}")],
    };
    let options: Vec<String> = options
        .into_iter()
        .chain(["--std=c++14".to_string()])
        .collect();
    // SAFETY: a live program and well-formed options.
    if let Err(e) = unsafe { result::compile_program(program.0, &options) } {
        // SAFETY: the program is live; its log is a C string.
        let log = unsafe { result::get_program_log(program.0) }
            .map(|raw| {
                // SAFETY: NVRTC terminates the log with a NUL.
                unsafe { CStr::from_ptr(raw.as_ptr()) }
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_default();
        return Err(KernelError::Cuda {
            op: "nvrtc",
            detail: format!(
                "the CUDA source does not compile with {} ({e:?}): {}",
                options.join(" "),
                log.trim()
            ),
        });
    }
    match target {
        Target::Ptx(_) => {
            // SAFETY: the program compiled.
            let ptx = unsafe { result::get_ptx(program.0) }.map_err(|e| nvrtc_err("ptx", e))?;
            Ok(ptx
                .into_iter()
                .take_while(|&c| c != 0)
                .map(|c| c as u8)
                .collect())
        }
        Target::Cubin(_) => {
            let mut size = 0usize;
            // SAFETY: the program compiled for a real architecture, so it has a CUBIN.
            unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) }
                .result()
                .map_err(|e| nvrtc_err("cubin size", e))?;
            let mut cubin = vec![0 as c_char; size];
            // SAFETY: `cubin` holds the size NVRTC reported.
            unsafe { sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr()) }
                .result()
                .map_err(|e| nvrtc_err("cubin", e))?;
            Ok(cubin.into_iter().map(|c| c as u8).collect())
        }
    }
}

/// The real architectures (`sm_XY` as `XY`) this NVRTC can compile for.
pub(crate) fn supported_architectures() -> Result<Vec<u32>> {
    if !nvrtc_present() {
        return Err(no_nvrtc());
    }
    let mut count: c_int = 0;
    // SAFETY: writes one integer.
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut count) }
        .result()
        .map_err(|e| nvrtc_err("architectures", e))?;
    let mut archs = vec![0 as c_int; usize::try_from(count).unwrap_or(0)];
    // SAFETY: `archs` holds the count NVRTC reported.
    unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
        .result()
        .map_err(|e| nvrtc_err("architectures", e))?;
    Ok(archs
        .into_iter()
        .filter_map(|a| u32::try_from(a).ok())
        .collect())
}

/// What a device of compute capability `arch` gets (see the module docs).
pub(crate) fn target_for(arch: u32, supported: &[u32]) -> Result<Target> {
    if supported.contains(&arch) {
        return Ok(Target::Cubin(arch));
    }
    supported
        .iter()
        .copied()
        .filter(|&a| a < arch)
        .max()
        .map(Target::Ptx)
        .ok_or_else(|| KernelError::NoCuda {
            reason: format!(
                "this NVRTC compiles for sm_{supported:?} and none of them runs on an sm_{arch} GPU"
            ),
        })
}

/// The kernels' module image for a device of compute capability `arch`, compiled on first use
/// and shared by every backend in the process.
pub(crate) fn module_for(arch: u32) -> Result<Ptx> {
    /// Images by device architecture: what was compiled and the bytes.
    type Images = HashMap<u32, (Target, Vec<u8>)>;
    static CACHE: OnceLock<Mutex<Images>> = OnceLock::new();
    let cache = CACHE.get_or_init(Mutex::default);
    let mut map = cache.lock().unwrap_or_else(PoisonError::into_inner);
    let (target, image) = match map.entry(arch) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            let target = target_for(arch, &supported_architectures()?)?;
            e.insert((target, compile(KERNEL_SOURCE, target)?))
        }
    };
    Ok(match target {
        Target::Cubin(_) => Ptx::from_binary(image.clone()),
        Target::Ptx(_) => Ptx::from_src(String::from_utf8_lossy(image).into_owned()),
    })
}

#[cfg(test)]
mod tests {
    use super::{Target, module_for, nvrtc_present, supported_architectures, target_for};

    /// Where NVRTC is installed (CI installs it), the image a GPU would load is built as the
    /// backend builds it: machine code for a known architecture.
    #[test]
    fn the_module_image_builds_where_nvrtc_is_installed() {
        if !nvrtc_present() {
            eprintln!("skipped: NVRTC is not installed here");
            return;
        }
        let archs = supported_architectures().unwrap_or_default();
        assert!(archs.contains(&80), "{archs:?}");
        assert_eq!(target_for(80, &archs).ok(), Some(Target::Cubin(80)));
        assert!(module_for(80).is_ok());
        assert!(module_for(80).is_ok(), "from the cache");
    }

    #[test]
    fn a_known_gpu_gets_machine_code_and_a_newer_one_ptx_from_below() {
        let supported = [75, 80, 86, 90];
        assert_eq!(target_for(86, &supported).ok(), Some(Target::Cubin(86)));
        assert_eq!(target_for(89, &supported).ok(), Some(Target::Ptx(86)));
        assert_eq!(target_for(120, &supported).ok(), Some(Target::Ptx(90)));
        assert!(
            target_for(70, &supported).is_err(),
            "older than every architecture"
        );
    }
}
