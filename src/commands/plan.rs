//! `pipe plan`: partition a profiled model (a profile file, PipeDream's graph format, or a preset
//! profiled first) into stages and per-stage replicas under the default or PipeDream's cost
//! model; print the plan and write it as the plan file `pipe train --plan` runs. The request,
//! its checks, profiling and planning are the library's ([`pipe_stages::planning::request`]).

use anyhow::Result;
use pipe_stages::planning::request::{self, PlanRequest};

/// `pipe plan`'s flags.
pub type PlanArgs = PlanRequest;

/// Runs `pipe plan`.
///
/// # Errors
/// Bad input for unreadable profiles, an unknown model and requests no plan meets; failures
/// while profiling, planning or writing.
pub fn run(args: &PlanArgs) -> Result<()> {
    // A worker process's own bytes, read before profiling allocates anything.
    let process = pipe_stages::limits::process_resident_bytes().unwrap_or(0);
    args.check()?;
    let phases = crate::phases::Phases::new();
    if let Some(model) = args.preset() {
        phases.begin(
            "profiling",
            &format!("{model} at microbatch {}", args.microbatch_size),
        );
    }
    let profile = args.load_profile(Some(phases.profile_report()))?;
    if args.preset().is_some() {
        phases.end();
    }
    let planned = args.plan(&profile, process)?;
    for line in &planned.charged {
        outln!("{line}");
    }
    out!(
        "{}",
        request::render_plan(&profile, &planned.plan, args.memory)
    );
    if let Some(hosts) = &planned.hosts {
        out!(
            "{}",
            request::render_placement(&profile, &planned.plan, hosts)
        );
    }
    if let Some(path) = &args.output {
        let text = request::plan_file_text(&profile, &planned)?;
        pipe_stages::outputs::write_file(path, text.as_bytes())?;
        outln!("plan written to {}", path.display());
    }
    Ok(())
}
