//! The CUDA kernels' source must compile with NVRTC for every architecture CI checks, on a
//! machine with no GPU. NVRTC comes from the CUDA runtime libraries (CI installs the
//! `nvidia-cuda-nvrtc-cu12` wheel and sets `PIPE_REQUIRE_NVRTC=1`, so the check cannot skip
//! there); elsewhere the test says that it skipped and why.

use pipe_kernels::KernelError;
use pipe_kernels::cuda::{CHECKED_ARCHITECTURES, KERNEL_SOURCE, check_source, nvrtc_available};

fn required() -> bool {
    std::env::var_os("PIPE_REQUIRE_NVRTC").is_some_and(|v| v == "1")
}

#[test]
fn kernel_source_compiles_with_nvrtc_for_every_checked_architecture() {
    if !cfg!(feature = "cuda") {
        assert!(
            !required(),
            "PIPE_REQUIRE_NVRTC=1 needs a build with --features cuda"
        );
        eprintln!("skipped: built without the `cuda` feature");
        return;
    }
    if !nvrtc_available() {
        assert!(
            !required(),
            "PIPE_REQUIRE_NVRTC=1 but libnvrtc.so.12 could not be loaded (LD_LIBRARY_PATH?)"
        );
        eprintln!("skipped: NVRTC (libnvrtc.so.12) is not installed here");
        return;
    }
    for arch in CHECKED_ARCHITECTURES {
        match check_source(KERNEL_SOURCE, arch) {
            Ok((ptx, cubin)) => {
                assert!(ptx > 0 && cubin > 0);
                eprintln!("compute_{arch}: {ptx} bytes of PTX; sm_{arch}: {cubin} bytes of CUBIN");
            }
            Err(e) => panic!("{e}"),
        }
    }
    // The check can fail: a source with a mistake in it is refused with the compiler's log.
    let broken = KERNEL_SOURCE.replacen("x[i] = value;", "x[i] = undefined_name;", 1);
    assert_ne!(broken, KERNEL_SOURCE);
    match check_source(&broken, 80) {
        Err(KernelError::Cuda {
            op: "nvrtc",
            detail,
        }) => {
            assert!(detail.contains("undefined_name"), "{detail}");
        }
        other => panic!("a broken source was not refused: {other:?}"),
    }
}

/// The kernels the backend looks up by name are defined in the source.
#[test]
fn every_kernel_the_backend_loads_is_defined_in_the_source() {
    let defined: Vec<&str> = KERNEL_SOURCE
        .split("extern \"C\" __global__ void ")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
        .collect();
    assert!(defined.len() >= 20, "{defined:?}");
    for name in [
        "fill_f32",
        "softmax_xent_f32",
        "attention_backward_keys_f32",
        "adam_f32",
    ] {
        assert!(defined.contains(&name), "{name} missing from {defined:?}");
    }
}
