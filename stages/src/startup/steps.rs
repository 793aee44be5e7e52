//! The steps of a run's start, each a function from the value the step before produced to
//! the next: [`resolve`] (merge and plan), [`read_data`], [`resume_from`],
//! [`adopt_checkpoint_buckets`], [`settle_partition`] (with its buckets), [`check_memory`],
//! [`check_rejoin`]; and [`replan`], the planner a restart on fewer workers calls. A step
//! never changes a checked [`RunConfig`]: what it settles comes back as a new one, built by
//! the constructor in [`crate::config`] that names what was settled.

use std::path::{Path, PathBuf};

use pipe_scheduler::Resolved;

use super::{RunSources, StartupEvent, StartupWatcher};
use crate::checkpoint::Checkpoint;
use crate::config::{LaunchSettings, PartitionChoice, PlanFile, RunConfig, TrainSettings};
use crate::data::Splits;
use crate::error::{Result, StageError};
use crate::model::Model;
use crate::planning::link_costs;
use crate::planning::{Profiling, buckets, memory, plan_workers, settle_measured_partition};

/// A profiler that reuses the cache (unless `reprofile`) and reports to `watcher`.
fn profiling(reprofile: bool, watcher: &dyn StartupWatcher) -> Profiling {
    let profiling = Profiling::cached(reprofile);
    match watcher.profile_report() {
        Some(report) => profiling.reporting(report),
        None => profiling,
    }
}

/// Begins a phase of the start.
fn begin(watcher: &dyn StartupWatcher, name: &str, detail: String) {
    watcher.on_event(&StartupEvent::PhaseBegan { name, detail });
}

/// The settings `sources` give: the config file, then the flags, then a plan file.
///
/// # Errors
/// Bad input for unreadable or malformed files, and a plan made for another model.
pub fn merge(sources: &RunSources) -> Result<TrainSettings> {
    let mut settings = TrainSettings::default();
    if let Some(path) = &sources.config_file {
        let text = crate::limits::read_text_file(path, "config")?;
        settings = TrainSettings::from_toml(&text, &path.display().to_string())?;
    }
    settings.merge(sources.flags.clone());
    if let Some(path) = &sources.plan_file {
        let source = path.display().to_string();
        let text = crate::limits::read_text_file(path, "plan")?;
        settings.apply_plan(&PlanFile::parse(&text, &source)?, &source)?;
    }
    Ok(settings)
}

/// The run `sources` describe, merged ([`merge`]) and checked once, and its launch's
/// settings ([`TrainSettings::launch`]); for `--workers`, planned first on this machine's
/// measured profile and link costs, with its buckets chosen.
///
/// # Errors
/// Bad input for settings that describe no run; profiling, measurement and planning
/// failures.
pub fn resolve(
    sources: &RunSources,
    watcher: &dyn StartupWatcher,
) -> Result<(RunConfig, LaunchSettings)> {
    let settings = merge(sources)?;
    let launch = settings.launch()?;
    let model_config = settings.model_config.clone();
    if let Some(trace) = &launch.trace {
        crate::outputs::check_output(trace)?;
    }
    let cfg = match sources.workers {
        Some(w) => plan_for_workers(settings, w, &launch, watcher)?,
        None => settings.resolve()?,
    };
    if launch.trace.is_some() && !cfg.pipelined {
        return Err(StageError::Config(
            "--trace records a pipelined run: give --stages, --replicas or --schedule".into(),
        ));
    }
    check_outputs_apart(sources, &cfg, &launch, model_config.as_deref())?;
    Ok((cfg, launch))
}

/// Refuses a run whose trace or log would overwrite what it reads ([`crate::outputs::
/// check_not_input`]): its config, plan and model config files, its dataset or corpus
/// directory, the model directory it starts from, the checkpoint it resumes, or the
/// checkpoints of its checkpoint directory; or each other; and a checkpoint directory inside
/// a directory it reads ([`crate::outputs::check_dir_not_in_input`]).
fn check_outputs_apart(
    sources: &RunSources,
    cfg: &RunConfig,
    launch: &LaunchSettings,
    model_config: Option<&Path>,
) -> Result<()> {
    use crate::outputs::{Input, check_not_input, check_outputs_distinct};
    let data_flag = match cfg.dataset {
        crate::config::DatasetKind::Tokens => "--dataset",
        _ => "--data-dir",
    };
    let named = [
        ("--config", sources.config_file.as_deref()),
        ("--plan", sources.plan_file.as_deref()),
        (data_flag, cfg.data_dir.as_deref()),
        ("--init-from", cfg.init_from.as_deref()),
        ("--model-config", model_config),
    ];
    let mut inputs = Input::named(&named);
    let resumed = launch.resume.as_deref().map(Path::new);
    if let Some(path) = resumed.filter(|r| !matches!(r.to_str(), Some("latest" | "auto"))) {
        // A checkpoint (it has a manifest), or a checkpoint directory whose latest it takes.
        inputs.push(if path.join(crate::checkpoint::MANIFEST).is_file() {
            Input::Whole("--resume", path)
        } else {
            Input::Entries("--resume", path, crate::checkpoint::is_store_entry)
        });
    }
    if let Some(dir) = &launch.checkpoint_dir {
        crate::outputs::check_dir_not_in_input(dir, "--checkpoint-dir", &inputs)?;
        inputs.push(Input::Entries(
            "--checkpoint-dir",
            dir,
            crate::checkpoint::is_store_entry,
        ));
    }
    let outputs = [
        ("--trace", launch.trace.as_deref()),
        ("--log-jsonl", cfg.log_jsonl.as_deref()),
    ];
    for (flag, path) in outputs {
        if let Some(path) = path {
            check_not_input(path, flag, &inputs)?;
            if let Some(dir) = &launch.checkpoint_dir {
                crate::outputs::check_file_not_over_dir(path, flag, dir, "--checkpoint-dir")?;
            }
        }
    }
    check_outputs_distinct(&outputs)
}

/// The run `settings` describe planned for `w` workers on this machine's measured profile
/// and link costs, with its buckets chosen.
fn plan_for_workers(
    settings: TrainSettings,
    w: u32,
    launch: &LaunchSettings,
    watcher: &dyn StartupWatcher,
) -> Result<RunConfig> {
    let (costs, origin) = link_costs::load_or_measure(false)?;
    let source = origin.describe();
    begin(
        watcher,
        "profiling and planning",
        format!("the layouts of {w} workers"),
    );
    let profiling = profiling(launch.reprofile, watcher);
    let (cfg, plan, profile) = plan_workers(settings, w, Some(&costs), &profiling)?;
    watcher.on_event(&StartupEvent::PhaseEnded);
    let cfg = match costs.get(cfg.link_transport().name()) {
        Some(cost) => {
            watcher.on_event(&StartupEvent::LinksCharged {
                cost,
                source: &source,
            });
            choose_buckets(cfg, &profile, cost, &source, watcher)
        }
        None => cfg,
    };
    let per_sample = cfg.microbatch_size as f64;
    watcher.on_event(&StartupEvent::AutoPlan {
        workers: w,
        run: &cfg,
        samples_per_s: per_sample / plan.time_per_microbatch,
        simulated_samples_per_s: plan.simulated.map_or(f64::NAN, |t| per_sample / t),
    });
    Ok(cfg)
}

/// Reads and checks the run's data, as a phase of its start.
///
/// # Errors
/// Data that cannot be read or does not fit the model (bad input).
pub fn read_data(cfg: &RunConfig, model: &Model, watcher: &dyn StartupWatcher) -> Result<Splits> {
    let kind = format!("{:?}", cfg.dataset).to_lowercase();
    let source = match &cfg.data_dir {
        Some(dir) => format!("{kind} at {}", dir.display()),
        None => kind,
    };
    begin(watcher, "reading and checking the data", source);
    let data = crate::train::load_data(cfg, model)?;
    watcher.on_event(&StartupEvent::PhaseEnded);
    Ok(data)
}

/// The checkpoint `resume` names (`--resume`: a checkpoint's directory, a checkpoint
/// directory, `latest` or `auto` in `checkpoint_dir`), read and checked against `model`,
/// with its directory. `auto` with no checkpoint yet is a fresh start.
///
/// # Errors
/// Bad input: `latest` or `auto` without a checkpoint directory; a checkpoint that is
/// missing, corrupted, truncated or made for another model (the error names the file).
pub fn resume_from(
    resume: Option<&str>,
    checkpoint_dir: Option<&Path>,
    model: &Model,
) -> Result<Option<(PathBuf, Checkpoint)>> {
    let Some(r) = resume else {
        return Ok(None);
    };
    let path = match r {
        "latest" | "auto" => checkpoint_dir
            .map(Path::to_path_buf)
            .ok_or_else(|| StageError::Config(format!("--resume {r} needs --checkpoint-dir")))?,
        given => PathBuf::from(given),
    };
    // What a scheduler passes on every start: the first finds nothing and starts fresh.
    if r == "auto" && crate::checkpoint::list(&path).is_empty() {
        return Ok(None);
    }
    Ok(Some(crate::checkpoint::read(&path, model)?))
}

/// Refuses a checkpoint directory whose checkpoints this run would replace or prune without
/// being asked: any, for a run that does not continue them (a fresh run, a seed checkpoint, a
/// run resumed from elsewhere); and the later ones, for a run resumed from an older checkpoint
/// inside it. A run that resumes the checkpoint the directory's `latest` names (what
/// `--resume latest` and `auto` take) continues the directory's own run.
///
/// # Errors
/// Bad input naming the directory, its latest checkpoint, and what to give instead.
pub fn check_checkpoint_dir(dir: Option<&Path>, resumed: Option<&Path>) -> Result<()> {
    let Some(dir) = dir else {
        return Ok(());
    };
    crate::outputs::check_output_dir(dir, "--checkpoint-dir")?;
    crate::checkpoint::check_pointer_temporary(dir)?;
    crate::checkpoint::fault_pause_ms()?;
    // The pointer to the latest checkpoint is written by a rename over `latest`, which a
    // directory there would fail only after the first checkpoint's training.
    let pointer = dir.join(crate::checkpoint::LATEST);
    if std::fs::symlink_metadata(&pointer).is_ok_and(|m| m.is_dir()) {
        return Err(StageError::Input(format!(
            "--checkpoint-dir {}: {} is a directory, where the run writes the name of its latest \
             checkpoint: move it, or give another directory",
            dir.display(),
            pointer.display()
        )));
    }
    // A `latest` that names no checkpoint here (one removed by hand, say) is not this run's to
    // replace: `--resume auto` would otherwise start afresh without a word, and a user's file
    // by that name would be written over.
    if let Err(e) = crate::checkpoint::latest_of(dir) {
        return Err(StageError::Input(format!(
            "--checkpoint-dir {}: {e}: this run would replace it; remove it to start afresh \
             there, or give another directory",
            dir.display()
        )));
    }
    let Some((_, newest)) = crate::checkpoint::list(dir).pop() else {
        return Ok(());
    };
    let current = crate::checkpoint::resolve(dir).unwrap_or(newest);
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    let shown = |p: &Path| {
        p.file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into())
    };
    match resumed {
        Some(from) if same(from, &current) => Ok(()),
        Some(from) if from.parent().is_some_and(|p| same(p, dir)) => {
            Err(StageError::Input(format!(
                "--resume {} is not the latest checkpoint of --checkpoint-dir {} ({}): this run \
             would replace the later ones; resume the latest (--resume latest), or write \
             this run's checkpoints into a new directory",
                from.display(),
                dir.display(),
                shown(&current)
            )))
        }
        _ => Err(StageError::Input(format!(
            "--checkpoint-dir {} holds another run's checkpoints (latest: {}), which this run \
             would replace: continue that run with --resume auto, or give this run a new \
             directory",
            dir.display(),
            shown(&current)
        ))),
    }
}

/// Takes the bucket sizes the run a checkpoint continues chose, by the adoption rule
/// ([`buckets::adopt_recorded`], [`RunConfig::adopt_buckets_of`]).
pub fn adopt_checkpoint_buckets(
    cfg: RunConfig,
    ckpt: &Checkpoint,
    watcher: &dyn StartupWatcher,
) -> RunConfig {
    let Some(adopted) = buckets::adopt_recorded(&cfg, &ckpt.state.settings) else {
        return cfg;
    };
    watcher.on_event(&StartupEvent::BucketsAdopted {
        flag: adopted.stage_buckets.clone(),
    });
    adopted
}

/// Settles a measured partition once, on this machine: profiles `model`, cuts it by time,
/// and chooses each replicated stage's buckets on the run's measured link where none were
/// given, so that every worker (thread or process) and every checkpoint runs the same.
/// A partition given (or settled already, as a launched worker's is) is kept.
///
/// # Errors
/// Profiling and measurement failures; more stages than layers with parameters.
pub fn settle_partition(
    cfg: RunConfig,
    model: &Model,
    reprofile: bool,
    watcher: &dyn StartupWatcher,
) -> Result<RunConfig> {
    if cfg.partition == PartitionChoice::Measured && cfg.stages > 1 {
        begin(
            watcher,
            "profiling",
            format!(
                "each layer shape of {} at microbatch {}, one thread",
                cfg.model_name, cfg.microbatch_size
            ),
        );
    }
    let profiling = profiling(reprofile, watcher);
    let (cfg, cut) = settle_measured_partition(cfg, model, &profiling)?;
    let Some(cut) = cut else {
        return Ok(cfg);
    };
    let stages = cut.partition.stages();
    if stages > 1 {
        begin(watcher, "planning", "the cut by measured time".into());
    }
    let cfg = match &cut.profile {
        Some(profile) if buckets::to_choose(&cfg) => {
            let (costs, origin) = link_costs::load_or_measure(false)?;
            let kind = cfg.link_transport();
            let cost = costs.get(kind.name()).ok_or_else(|| {
                StageError::Config(format!(
                    "the measured costs hold no costs for transport {}",
                    kind.name()
                ))
            })?;
            choose_buckets(cfg, profile, cost, &origin.describe(), watcher)
        }
        _ => cfg,
    };
    if stages > 1 {
        watcher.on_event(&StartupEvent::PhaseEnded);
        watcher.on_event(&StartupEvent::MeasuredCut {
            partition: &cut.partition,
            stage_seconds: &cut.stage_seconds,
        });
    }
    Ok(cfg)
}

/// Chooses the replicated stages' bucket sizes from the run's measured `profile` and `link`
/// (whose costs came from `source`) where none were given, and says what was chosen.
fn choose_buckets(
    cfg: RunConfig,
    profile: &pipe_scheduler::Profile,
    link: &pipe_scheduler::planner::transport::TransportCost,
    source: &str,
    watcher: &dyn StartupWatcher,
) -> RunConfig {
    let Some((sizes, choices)) = buckets::choose_for_run(&cfg, profile, link) else {
        return cfg;
    };
    watcher.on_event(&StartupEvent::BucketsChosen {
        link,
        source,
        choices: &choices,
        flag: sizes.clone(),
    });
    cfg.with_stage_buckets(sizes)
}

/// How to lower a run's memory, as the memory gate's refusal says it.
const LOWER_MEMORY: &str = "lower it with a smaller --microbatch-size, --recompute full, more --stages, fewer --replicas or a schedule that keeps fewer weight versions (1f1b-flush), or give --force to run it anyway";

/// Passes `need` through the memory gate ([`crate::limits::admit_memory`]); over it, `force`
/// runs it anyway, and the watcher is told why.
fn admit(
    need: &crate::limits::MemoryNeed<'_>,
    force: bool,
    watcher: &dyn StartupWatcher,
) -> Result<()> {
    match crate::limits::admit_memory(need, &crate::limits::Machine::detect()) {
        Err(e) if force => {
            watcher.on_event(&StartupEvent::MemoryForced(e.to_string()));
            Ok(())
        }
        other => other,
    }
}

/// The memory gate's first look, before anything is read, profiled or allocated: the
/// planner's closed-form estimate of the run's workers on this host
/// ([`Model::worker_memory_bytes`]; `local_workers`: `None` for all of them, as `pipe train`
/// runs them, `Some(1)` for `pipe worker`). Where it is over and `force` is given, a pipelined
/// run goes on to the measured estimate ([`check_memory`]), which says so.
///
/// # Errors
/// A layout the estimate cannot resolve; [`StageError::Limit`] for a run over the gate.
pub fn check_memory_floor(
    cfg: &RunConfig,
    model: &Model,
    local_workers: Option<u64>,
    force: bool,
    watcher: &dyn StartupWatcher,
) -> Result<()> {
    let run = if cfg.pipelined {
        cfg.resolved()?.clone()
    } else {
        pipe_scheduler::ScheduleSpec::new(pipe_scheduler::Policy::Sequential, 1, 1).resolve()?
    };
    let workers = local_workers.unwrap_or(u64::from(run.layout.workers()));
    let per_worker =
        model.worker_memory_bytes(&run, cfg.microbatch_size, cfg.optimizer.kind.state_copies());
    let mut holding = format!(
        "{} parameters' weights{}, optimizer state and stashed activations",
        model.param_count(),
        if matches!(
            run.policy,
            pipe_scheduler::Policy::PipeDream | pipe_scheduler::Policy::VerticalSync
        ) {
            " in every version stashed"
        } else {
            ""
        }
    );
    // A synthetic dataset is drawn whole in memory, once by each process that trains.
    let mut data = 0.0;
    if cfg.dataset == crate::config::DatasetKind::Synthetic {
        let processes = cfg.pipelined && cfg.placement == crate::config::Placement::Processes;
        data = cfg.synthetic.bytes() * if processes { workers as f64 } else { 1.0 };
        holding = format!("{holding}, and {}", cfg.synthetic.holding());
    }
    let lower = if data > 0.0 {
        LOWER_MEMORY.replacen(
            "lower it with ",
            "lower it with a smaller synthetic dataset, ",
            1,
        )
    } else {
        LOWER_MEMORY.to_string()
    };
    let need = crate::limits::MemoryNeed {
        bytes: per_worker * workers as f64 + data,
        workers,
        holding: &holding,
        lower: &lower,
    };
    // A forced pipelined run is reported once, by the measured estimate.
    let quiet = cfg.pipelined && local_workers.is_none();
    admit(
        &need,
        force,
        if quiet { &super::Unwatched } else { watcher },
    )
}

/// The memory gate on the measured estimate: the peak resident memory of a pipelined run's
/// workers on this host (pipe's memory model, [`memory`]), refused where together they need
/// more than the gate admits ([`crate::limits::admit_memory`]), unless `force`. `process` is
/// this process's resident bytes before it built the run; `processes` says the workers are
/// processes, not threads of it.
///
/// # Errors
/// A layout or model the estimate cannot build; [`StageError::Limit`] for a run over the
/// gate.
pub fn check_memory(
    cfg: &RunConfig,
    process: u64,
    processes: bool,
    force: bool,
    watcher: &dyn StartupWatcher,
) -> Result<()> {
    if !cfg.pipelined {
        return Ok(());
    }
    let workers = memory::estimate_run(cfg, process)?;
    let need = if processes {
        workers.iter().map(memory::WorkerMemory::total).sum()
    } else {
        memory::in_one_process(&workers)
    };
    watcher.on_event(&StartupEvent::MemoryEstimate {
        workers: &workers,
        process,
        processes,
        need,
    });
    let need = crate::limits::MemoryNeed {
        bytes: need as f64,
        workers: workers.len() as u64,
        holding: "weights, optimizer state, activations and buffers, measured per layer",
        lower: LOWER_MEMORY,
    };
    admit(&need, force, watcher)
}

/// The device memory gate of a run on a device backend (nothing on the CPU): tells `watcher`
/// what each worker's device is expected to hold at its peak
/// ([`crate::planning::device_memory`]), and refuses the run where the workers sharing a GPU
/// are expected to need more than the GPU has in all, unless `force`. Only over the total: the
/// model's estimates lie within a tenth of the peaks it was checked on, and what else holds the
/// GPU (the CUDA context, other processes) is not known here, so a run close to the total is
/// left to try.
///
/// # Errors
/// A layout or model the estimate cannot build; no CUDA driver or GPU; [`StageError::Limit`]
/// for a run over a GPU's memory.
pub fn check_device_memory(
    cfg: &RunConfig,
    force: bool,
    watcher: &dyn StartupWatcher,
) -> Result<()> {
    if !matches!(cfg.backend, pipe_kernels::BackendKind::Cuda(_)) {
        return Ok(());
    }
    let workers = crate::planning::device_memory::estimate_run_device(cfg)?;
    watcher.on_event(&StartupEvent::DeviceMemoryEstimate { workers: &workers });
    let devices = pipe_kernels::cuda::device_count()?;
    let need = crate::planning::device_memory::per_device(&workers, devices);
    for (gpu, &need) in need.iter().enumerate() {
        let has = pipe_kernels::cuda::device_memory(gpu)?;
        if need > has {
            let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
            let why = format!(
                "the workers on GPU {gpu} need an estimated {:.1} GiB at their peaks and it has {:.1} GiB in all (docs/gpu.md, \"Device memory\"): \
                 give smaller or fewer microbatches in flight, --recompute, more stages or more GPUs, or --force to try",
                gib(need),
                gib(has)
            );
            if !force {
                return Err(StageError::Limit(why));
            }
            watcher.on_event(&StartupEvent::MemoryForced(why));
        }
    }
    Ok(())
}

/// Refuses `--rejoin` where there is nothing it could do: no stage with two or more replicas
/// (a stage's last replica is never survived, so never taken back).
///
/// # Errors
/// [`StageError::Config`] naming what is missing.
pub fn check_rejoin(resolved: Option<&Resolved>) -> Result<()> {
    let replicated = resolved.is_some_and(|r| r.layout.replica_counts().iter().any(|&n| n >= 2));
    if !replicated {
        return Err(StageError::Config(
            "--rejoin takes back a lost replica, but no stage of this run has two or more replicas: give --replicas".into(),
        ));
    }
    Ok(())
}

/// `--replan-on-restart`'s planner: the layout of `cfg` for `workers` workers
/// ([`crate::planning::replan`]) and its predicted samples/s.
///
/// # Errors
/// As [`crate::planning::replan`].
pub fn replan(cfg: &RunConfig, workers: u32) -> Result<(RunConfig, f64)> {
    // The costs were measured or read when the run was planned; a failure to read them now
    // plans without them rather than not at all.
    let costs = link_costs::load_or_measure(false).ok().map(|(c, _)| c);
    // The run's profile, kept when it was planned, serves again.
    let profiling = Profiling::cached(false);
    let (next, plan) = crate::planning::replan(cfg, workers, costs.as_ref(), &profiling)?;
    let rate = next.microbatch_size as f64 / plan.time_per_microbatch;
    Ok((next, rate))
}
