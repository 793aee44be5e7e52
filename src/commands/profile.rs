//! `pipe profile`: time every layer of a model preset (forward, both backward halves, update)
//! and count its activation and parameter sizes; print the table and write the profile as JSON
//! on request. Measuring is `pipe-stages`'.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use pipe_stages::config::DEFAULT_MODEL;
use pipe_stages::profile::ProfileOptions;

use crate::args::{BackendParser, open_backend};
use crate::output::bad_input;
use pipe_kernels::BackendKind;
use pipe_stages::model::{Model, ModelSpec};

/// `pipe profile`: time every layer of a model.
#[derive(Args, Debug)]
pub struct ProfileArgs {
    /// Model preset.
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// Samples per microbatch.
    #[arg(long, default_value_t = 64)]
    microbatch_size: usize,
    /// Compute threads (a pipeline worker has one).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Untimed runs of each operation.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Timed runs of each operation (figures are medians).
    #[arg(long, default_value_t = 11)]
    repeats: usize,
    /// Microbatches per update of the executor run the times are calibrated on.
    #[arg(long, default_value_t = 4)]
    microbatches: u32,
    /// Keep the layers' isolated timings (no executor calibration).
    #[arg(long)]
    isolated: bool,
    /// Calibration copies run at once: the pipeline's busy workers (at most one per core).
    #[arg(long, default_value_t = 1)]
    concurrent: usize,
    /// Compute backend: cpu or cuda.
    #[arg(long, default_value = "cpu", value_parser = BackendParser)]
    backend: BackendKind,
    /// Write the profile as JSON to FILE.
    #[arg(short, long, value_name = "FILE", value_parser = pipe_stages::outputs::output_file)]
    output: Option<PathBuf>,
    /// Measure again even where pipe's cache holds this profile (the new one replaces it).
    #[arg(long)]
    reprofile: bool,
}

/// Runs `pipe profile`.
///
/// # Errors
/// Bad input for non-positive counts, an unknown model or a backend this build lacks;
/// failures while measuring or writing.
pub fn run(args: &ProfileArgs) -> Result<()> {
    if args.microbatch_size == 0 || args.repeats == 0 || args.threads == 0 || args.microbatches == 0
    {
        return Err(bad_input(
            "--microbatch-size, --repeats, --threads and --microbatches must be at least 1".into(),
        ));
    }
    if args.concurrent == 0 {
        return Err(bad_input("--concurrent must be at least 1".into()));
    }
    pipe_stages::limits::check_threads(
        args.threads as u64,
        &pipe_stages::limits::Machine::detect(),
    )?;
    let opts = ProfileOptions {
        warmup: args.warmup,
        repeats: args.repeats,
        calibrate: (!args.isolated).then_some(args.microbatches),
        concurrent: args.concurrent,
        ..ProfileOptions::new(args.microbatch_size)
    };
    let be = open_backend(args.backend, args.threads)?;
    let phases = crate::phases::Phases::new();
    phases.begin(
        "profiling",
        &format!("{} at microbatch {}", args.model, args.microbatch_size),
    );
    let profiling =
        pipe_stages::planning::Profiling::cached(args.reprofile).reporting(phases.profile_report());
    let model = Model::new(&ModelSpec::preset(&args.model)?)?;
    let profile = profiling.profile(&model, &args.model, be.as_ref(), &opts, args.microbatches)?;
    phases.end();
    out!("{}", profile.render());
    if let Some(path) = &args.output {
        let text = serde_json::to_string_pretty(&profile)?;
        pipe_stages::outputs::write_file(path, (text + "\n").as_bytes())?;
        outln!("profile written to {}", path.display());
    }
    Ok(())
}
