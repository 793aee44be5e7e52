//! `pipe doctor gpu`'s report: the library search's choice, then what the driver says about
//! the CUDA version, NVRTC and the GPUs. It lives apart from the backend so that the report of a
//! machine where the backend cannot open is still made.

use crate::Result;

/// What `pipe doctor gpu` reports: the libraries the search chose (and what it tried for those
/// it could not find), then, in a build with the `cuda` feature, the driver's CUDA version,
/// NVRTC's, and every GPU with its architecture and memory. The report comes back with the
/// outcome, so it is shown even when the GPU cannot be used.
///
/// # Errors
/// [`crate::KernelError::NotCompiledWithCuda`] without the feature;
/// [`crate::KernelError::NoCuda`] when the driver, a GPU or NVRTC cannot be opened.
pub fn doctor() -> (String, Result<()>) {
    let res = super::libraries::resolve(&super::libraries::SearchPath::from_environment());
    let mut report = String::from("libraries:\n");
    for line in res.report().lines() {
        report.push_str("  ");
        report.push_str(line);
        report.push('\n');
    }
    match std::env::var_os(super::libraries::LINKS_VARIABLE) {
        Some(dir) => report.push_str(&format!(
            "  opened through the links in {}\n",
            std::path::Path::new(&dir).display()
        )),
        None => report.push_str("  not linked for this process: the loader's own search applies\n"),
    }
    #[cfg(feature = "cuda")]
    {
        let outcome = super::device::describe_devices(&mut report);
        (report, outcome)
    }
    #[cfg(not(feature = "cuda"))]
    {
        (report, Err(crate::KernelError::NotCompiledWithCuda))
    }
}
