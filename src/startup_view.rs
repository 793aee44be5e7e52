//! How a run's start reads on the terminal: the lines for each [`StartupEvent`] the library's
//! start-up ([`pipe_stages::startup`]) reports, the run's header, and the phases shown as
//! they happen ([`Phases`]). Formatting only: every figure comes from the event.

use pipe_stages::config::RunConfig;
use pipe_stages::data::Splits;
use pipe_stages::model::Model;
use pipe_stages::planning::ProfileReport;
use pipe_stages::startup::{StartupEvent, StartupWatcher};

use crate::phases::Phases;

/// A command's view of a run's start: its phases, and, where the command shows a header
/// (`pipe train`, a chief started by hand), the header once the data is read with the
/// backend's `threads`.
pub struct StartView {
    /// The phases shown as they happen.
    pub phases: Phases,
    /// The compute threads the header names; `None` shows no header.
    pub header_threads: Option<usize>,
}

impl StartupWatcher for StartView {
    fn on_event(&self, event: &StartupEvent<'_>) {
        match event {
            StartupEvent::DataRead { run, model, data } => {
                if let Some(threads) = self.header_threads {
                    print_header(run, model, data, threads);
                }
            }
            StartupEvent::Resuming { dir, checkpoint } => {
                if self.header_threads.is_some() {
                    print_resuming(dir, checkpoint);
                }
            }
            other => self.phases.on_event(other),
        }
    }

    fn profile_report(&self) -> Option<ProfileReport> {
        Some(self.phases.profile_report())
    }
}

impl StartupWatcher for Phases {
    fn on_event(&self, event: &StartupEvent<'_>) {
        match event {
            StartupEvent::PhaseBegan { name, detail } => self.begin(name, detail),
            StartupEvent::PhaseEnded => self.end(),
            StartupEvent::LinksCharged { cost, source } => {
                outln!(
                    "{}",
                    pipe_stages::planning::link_costs::describe(cost, source)
                );
            }
            StartupEvent::AutoPlan {
                workers,
                run,
                samples_per_s,
                simulated_samples_per_s,
            } => outln!(
                "auto plan for {workers} workers: partition {}, replicas {:?}, predicted {samples_per_s:.0} samples/s (simulated {simulated_samples_per_s:.0})",
                run.partition,
                run.replicas,
            ),
            StartupEvent::MeasuredCut {
                partition,
                stage_seconds,
            } => {
                let ms: Vec<String> = stage_seconds
                    .iter()
                    .map(|s| format!("{:.2}", s * 1e3))
                    .collect();
                outln!(
                    "partition {partition} by measured time (ms per microbatch per stage: {}; --partition {partition} repeats it)",
                    ms.join(", "),
                );
            }
            StartupEvent::BucketsChosen {
                link,
                source,
                choices,
                flag,
            } => print_buckets_chosen(link, source, choices, flag),
            StartupEvent::BucketsAdopted { flag } => outln!(
                "all-reduce buckets as the checkpoint's run chose them: --allreduce-bucket-mb {flag}"
            ),
            StartupEvent::MemoryEstimate {
                workers,
                process,
                processes,
                need,
            } => print_memory_estimate(workers, *process, *processes, *need),
            StartupEvent::MemoryForced(why) => eprintln!("warning: {why}; running it (--force)"),
            StartupEvent::DeviceMemoryEstimate { workers } => print_device_estimate(workers),
            StartupEvent::DataRead { .. } | StartupEvent::Resuming { .. } => {}
        }
    }

    fn profile_report(&self) -> Option<ProfileReport> {
        Some(Phases::profile_report(self))
    }
}

/// Says which bucket sizes were chosen per stage, on which link, and the flag that repeats
/// them.
fn print_buckets_chosen(
    link: &pipe_scheduler::planner::transport::TransportCost,
    source: &str,
    choices: &[Option<pipe_scheduler::planner::buckets::BucketChoice>],
    flag: &pipe_scheduler::planner::buckets::StageBuckets,
) {
    let per_stage: Vec<String> = choices
        .iter()
        .map(|c| match c {
            Some(c) => format!(
                "{} ({:.2} ms per update, one bucket {:.2} ms)",
                c.size,
                c.seconds * 1e3,
                c.one_bucket * 1e3
            ),
            None => "-".into(),
        })
        .collect();
    outln!(
        "all-reduce buckets chosen per stage on {}'s measured link ({source}): {}; \
         --allreduce-bucket-mb {flag} repeats them",
        link.transport,
        per_stage.join(", "),
    );
}

/// Prints the estimated peak resident memory: each worker process's, or, for workers that
/// are threads of this process, the process's and each worker's own share.
fn print_memory_estimate(
    workers: &[pipe_stages::planning::memory::WorkerMemory],
    process: u64,
    processes: bool,
    need: u64,
) {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    if processes {
        let each: Vec<String> = workers
            .iter()
            .map(|w| format!("w{} {:.1}", w.worker, mib(w.total())))
            .collect();
        outln!(
            "memory estimate per worker (MiB, peak resident): {}",
            each.join(", ")
        );
    } else {
        let own: Vec<String> = workers
            .iter()
            .map(|w| {
                format!(
                    "w{} {:.1}",
                    w.worker,
                    mib(w.total().saturating_sub(process))
                )
            })
            .collect();
        outln!(
            "memory estimate (MiB, peak resident): this process {:.1} (the process {:.1}, each worker thread as alone: {})",
            mib(need),
            mib(process),
            own.join(", ")
        );
    }
}

/// Prints what each worker's device is expected to hold at its peak, beside which the epoch
/// lines print what each stage's device held (`device ... GiB`).
fn print_device_estimate(workers: &[pipe_stages::planning::memory::WorkerMemory]) {
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    let each: Vec<String> = workers
        .iter()
        .map(|w| format!("w{} {:.2}", w.worker, gib(w.total())))
        .collect();
    outln!(
        "device memory estimate (GiB, the peak of each worker's pool): {}",
        each.join(", ")
    );
}

/// Prints where a run resumes from.
pub fn print_resuming(dir: &std::path::Path, ckpt: &pipe_stages::checkpoint::Checkpoint) {
    outln!(
        "resuming from {} (update {}, epoch {}, {} samples into it)",
        dir.display(),
        ckpt.state.updates,
        ckpt.state.epoch,
        ckpt.state.samples_in_epoch
    );
}

/// The momentum in the run header, for SGD and Muon; weight decay and the parameters it applies
/// to; gradient clipping; the delay correction.
pub fn momentum_note(opt: &pipe_stages::optim::OptimizerConfig) -> String {
    use pipe_stages::optim::{DecayGroups, DelayCorrection, OptimizerKind};
    let mut momentum = if matches!(opt.kind, OptimizerKind::Sgd | OptimizerKind::Muon) {
        format!(" momentum {:.2}", opt.momentum)
    } else {
        String::new()
    };
    if opt.weight_decay != 0.0 {
        let on = match opt.decay_groups {
            DecayGroups::All => "every parameter",
            DecayGroups::Matrices => "matrices only",
        };
        momentum.push_str(&format!(", weight decay {} on {on}", opt.weight_decay));
    }
    if let Some(c) = opt.grad_clip {
        momentum.push_str(&format!(", gradient clipping at norm {c}"));
    }
    match opt.delay_correction {
        DelayCorrection::None => momentum,
        c => format!(
            "{momentum}, delay correction {} (strength {})",
            c.name(),
            opt.correction_strength
        ),
    }
}

/// Prints the run's header line: model, data, optimizer, seed, compute threads, and on CUDA
/// the precision of the products (on the CPU, a precision other than f32 and the CBLAS
/// library `PIPE_CBLAS` names).
pub fn print_header(cfg: &RunConfig, model: &Model, data: &Splits, threads: usize) {
    outln!(
        "pipe train: model {} ({} parameters{}), {} ({} train / {} test{}){}, {} epochs, microbatch {} x {}, {:?} lr {} ({:?}){}, seed {}, {} threads{}",
        cfg.model_name,
        model.param_count(),
        match model.vocab_padding() {
            0 => String::new(),
            rows => format!(
                " with a vocabulary of {} padded by {rows} rows",
                model.output_classes()
            ),
        },
        data.train.name.trim_end_matches("-train"),
        data.train.len(),
        data.test.len(),
        match cfg.corpus.as_ref().and_then(|c| c.pack_documents) {
            Some(end) => format!(", packed documents ending with id {end}"),
            None => String::new(),
        },
        recompute_note(&cfg.recompute),
        cfg.epochs,
        cfg.microbatch_size,
        cfg.microbatches,
        cfg.optimizer.kind,
        cfg.lr,
        cfg.lr_schedule,
        momentum_note(&cfg.optimizer),
        cfg.seed,
        threads,
        match (cfg.backend, pipe_kernels::cblas_library().ok().flatten()) {
            (pipe_kernels::BackendKind::Cpu(pipe_kernels::Precision::F32), None) => String::new(),
            (pipe_kernels::BackendKind::Cpu(pipe_kernels::Precision::F32), Some(library)) =>
                format!(", cpu (f32 products by {library})"),
            (pipe_kernels::BackendKind::Cpu(p), None) => format!(", cpu ({p} products)"),
            (pipe_kernels::BackendKind::Cpu(p), Some(library)) =>
                format!(", cpu ({p} products, the f32 ones by {library})"),
            (pipe_kernels::BackendKind::Cuda(p), _) => format!(", cuda ({p} products)"),
        }
    );
    if !cfg.hosts.is_empty() {
        outln!("placed by the plan: {}", hosts_note(&cfg.hosts));
    }
}

/// Each host of a plan's placement with its workers: `a (workers 0, 1), b (workers 2, 3)`.
pub fn hosts_note(hosts: &[String]) -> String {
    let mut order: Vec<(&str, Vec<usize>)> = Vec::new();
    for (w, h) in hosts.iter().enumerate() {
        match order.iter_mut().find(|(name, _)| name == h) {
            Some((_, workers)) => workers.push(w),
            None => order.push((h, vec![w])),
        }
    }
    order
        .iter()
        .map(|(name, workers)| {
            let list: Vec<String> = workers.iter().map(usize::to_string).collect();
            format!("{name} (workers {})", list.join(", "))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The header's note on recomputation: nothing when no stage recomputes.
fn recompute_note(recompute: &pipe_stages::layer::StageRecompute) -> String {
    match recompute.kinds() {
        _ if !recompute.any() => String::new(),
        [one] => format!(", recompute {}", one.name()),
        _ => format!(", recompute per stage {recompute}"),
    }
}
