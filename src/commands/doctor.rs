//! `pipe doctor gpu`: which GPU, driver and CUDA library files this machine offers and which of
//! them pipe uses, and the loader path that selects them for other programs (the CUDA test
//! binaries of experiments/gpu/run.sh).

use anyhow::Result;
use clap::{Args, Subcommand};
use pipe_kernels::KernelError;
use pipe_kernels::cuda::libraries::{LINKS_VARIABLE, SearchPath, link_base, link_folder, resolve};

use crate::output::bad_input;

/// `pipe doctor`.
#[derive(Subcommand, Debug)]
pub enum DoctorCommand {
    /// The GPU, driver and CUDA libraries: what was found where, and what pipe opens.
    Gpu(GpuArgs),
}

/// `pipe doctor gpu`.
#[derive(Args, Debug)]
pub struct GpuArgs {
    /// Print only the LD_LIBRARY_PATH under which another program opens the libraries pipe
    /// chose (the link folder first, stubs left out), making the link folder if needed.
    #[arg(long)]
    library_path: bool,
}

/// Runs `pipe doctor`.
///
/// # Errors
/// Bad input (exit 2) when the GPU cannot be used, with the report so far.
pub fn run(cmd: &DoctorCommand) -> Result<()> {
    match cmd {
        DoctorCommand::Gpu(args) if args.library_path => {
            outln!("{}", library_path()?);
            Ok(())
        }
        DoctorCommand::Gpu(_) => {
            let (report, outcome) = pipe_kernels::cuda::doctor();
            out!("{report}");
            match outcome {
                Ok(()) => Ok(()),
                Err(e @ (KernelError::NotCompiledWithCuda | KernelError::NoCuda { .. })) => {
                    Err(bad_input(e.to_string()))
                }
                Err(e) => Err(e.into()),
            }
        }
    }
}

/// The loader path for the libraries the search chooses here.
fn library_path() -> Result<String> {
    let res = resolve(&SearchPath::from_environment());
    if !res.complete() {
        return Err(bad_input(format!(
            "the CUDA libraries are incomplete here: {}",
            res.report().trim_end().replace('\n', "; ")
        )));
    }
    let dir = match std::env::var_os(LINKS_VARIABLE) {
        Some(d) => d.into(),
        None => link_folder(&res, &link_base())?,
    };
    let previous = std::env::var_os("LD_LIBRARY_PATH");
    Ok(res
        .library_path(&dir, previous.as_deref())
        .to_string_lossy()
        .into_owned())
}

/// In a build with CUDA, makes this process open the CUDA libraries the search chooses (never
/// a stub, CUDA 12's or 13's versioned names alike): when they are not yet in place, puts the
/// link folder first on `LD_LIBRARY_PATH` and starts this program again with the same
/// arguments (the loader reads that path only when a process starts). Every worker process it
/// launches inherits the setting. Does nothing where no driver is found (the backend's error
/// then says what was searched) or when starting again fails.
pub fn use_found_cuda_libraries() {
    #[cfg(all(feature = "cuda", unix))]
    {
        use std::os::unix::process::CommandExt;
        if std::env::var_os(LINKS_VARIABLE).is_some() {
            return;
        }
        let res = resolve(&SearchPath::from_environment());
        if res
            .get(pipe_kernels::cuda::libraries::Library::Driver)
            .is_none()
        {
            return;
        }
        let (Ok(dir), Ok(exe)) = (link_folder(&res, &link_base()), std::env::current_exe()) else {
            return;
        };
        let previous = std::env::var_os("LD_LIBRARY_PATH");
        let path = res.library_path(&dir, previous.as_deref());
        // `exec` returns only when it fails; the loader's own search then applies.
        let _ = std::process::Command::new(exe)
            .args(std::env::args_os().skip(1))
            .env("LD_LIBRARY_PATH", path)
            .env(LINKS_VARIABLE, &dir)
            .exec();
    }
}
