//! What `pipe train` and `pipe worker` share: the training flags, merged over a TOML config
//! and a plan file (or an automatic plan for `--workers`) into one validated `RunConfig`; the
//! run's header, the cut by measured time, and the closing line; the progress display and
//! the observers every epoch is reported to.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use pipe_kernels::BackendKind;
use pipe_stages::checkpoint::CheckpointPolicy;
use pipe_stages::config::{DatasetKind, ModelChoice, RunConfig, TrainSettings};
use pipe_stages::log::JsonlLog;
use pipe_stages::model::params_digest;
use pipe_stages::optim::{LrScheduleKind, OptimizerKind};
use pipe_stages::pipeline::Observer;
use pipe_stages::pipeline::survive::LayoutChange;
use pipe_stages::pipeline::{PhaseRecord, StartPhase};
use pipe_stages::startup;
use pipe_stages::train::{EpochStats, EvalStats, StepStats, TrainReport};

use crate::args::BackendParser;
use crate::output::{Interrupted, bad_input};
use crate::phases::Phases;

/// The training flags of `pipe train` and `pipe worker`: they override the config file's values.
#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct TrainArgs {
    /// TOML config file; flags given on the command line override its values.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Model preset: mlp-784-512-512-10, mlp-784-1024x16-10, ... or gpt-mini, gpt-small (a
    /// layer list goes in --config).
    #[arg(long)]
    model: Option<String>,
    /// Share a gpt-* model's token embedding (first stage) with its LM head (last stage);
    /// gpt2 models always do.
    #[arg(long)]
    tie_embeddings: bool,
    /// Start from the weights of a Hugging Face GPT-2 directory (its model.safetensors, as
    /// `pipe export --format hf` or transformers' save_pretrained writes it).
    #[arg(long, value_name = "DIR")]
    init_from: Option<PathBuf>,
    /// A Hugging Face GPT-2 config.json giving --model gpt2 its shape and vocabulary size.
    #[arg(long, value_name = "FILE")]
    model_config: Option<PathBuf>,
    /// Transformer blocks of a gpt2 model (over its preset's or config.json's).
    #[arg(long, value_name = "N")]
    n_layer: Option<usize>,
    /// Attention heads of a gpt2 model.
    #[arg(long, value_name = "N")]
    n_head: Option<usize>,
    /// Width of a gpt2 model.
    #[arg(long, value_name = "N")]
    n_embd: Option<usize>,
    /// Positions of a gpt2 model: its training window.
    #[arg(long, value_name = "N")]
    n_positions: Option<usize>,
    /// Vocabulary of a gpt2 model (default: the data's).
    #[arg(long, value_name = "N")]
    vocab_size: Option<usize>,
    /// Dataset: mnist, synthetic, tinyshakespeare (the default for gpt-* models), or
    /// tokens:DIR, a corpus `pipe tokenize` wrote, streamed from disk.
    #[arg(long, value_parser = crate::args::parse_dataset)]
    dataset: Option<crate::args::DatasetArg>,
    /// Directory holding MNIST IDX files or tinyshakespeare.txt (default: the copies embedded
    /// in the binary).
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// The validation part of a tokenized corpus: tail:FRACTION (the default, tail:0.1) or
    /// shards:COUNT (its last shards).
    #[arg(long, value_name = "HOLDOUT")]
    holdout: Option<String>,
    /// Most validation windows of a tokenized corpus evaluated after each epoch, chosen evenly
    /// over its held-out part (default 2048).
    #[arg(long, value_name = "N")]
    eval_windows: Option<u64>,
    /// Passes over the training data.
    #[arg(long)]
    epochs: Option<u64>,
    /// Stop after this many optimizer steps.
    #[arg(long)]
    steps: Option<u64>,
    /// Evaluate on the validation set every N updates as well as at each epoch's end (a drain
    /// point, like a checkpoint: under an asynchronous schedule it changes the run's numerics,
    /// as --checkpoint-every does). Records go to the progress output and the JSON-lines log.
    #[arg(long, value_name = "N")]
    eval_every: Option<u64>,
    /// Samples per microbatch.
    #[arg(long)]
    microbatch_size: Option<usize>,
    /// Microbatches whose gradients one update sums.
    #[arg(long)]
    microbatches: Option<usize>,
    /// Optimizer: sgd, adam, adamw, muon (orthogonalised momentum for hidden weight matrices,
    /// AdamW for the rest) or lion.
    #[arg(long)]
    optimizer: Option<OptimizerKind>,
    /// Base learning rate.
    #[arg(long, value_parser = parse_f32)]
    lr: Option<f32>,
    /// Learning-rate schedule: constant, warmup or cosine.
    #[arg(long)]
    lr_schedule: Option<LrScheduleKind>,
    /// Linear warmup steps.
    #[arg(long)]
    warmup_steps: Option<u64>,
    /// SGD momentum.
    #[arg(long, value_parser = parse_f32)]
    momentum: Option<f32>,
    /// Use Nesterov momentum.
    #[arg(long)]
    nesterov: bool,
    /// Weight decay.
    #[arg(long, value_parser = parse_f32)]
    weight_decay: Option<f32>,
    /// The parameters weight decay applies to: all, or matrices (the weights of linear maps:
    /// not biases, layer-norm gains or embeddings, as nanoGPT and Megatron group a GPT's
    /// parameters). Default: matrices for AdamW on a language model, else all.
    #[arg(long, value_name = "all|matrices")]
    weight_decay_groups: Option<pipe_stages::optim::DecayGroups>,
    /// Correct each update for the pipeline's delay: none; error-feedback (the weights move
    /// by u_t + c (u_t - u_{t-1}), u the optimizer's update); dc-asgd (the gradient g, computed
    /// at stale weights w_s, becomes g + lambda g*g*(w - w_s)); dc-asgd-adaptive (lambda per
    /// element lambda_0 / sqrt(MS + 1e-7), MS a running mean of g^2). Asynchronous policies
    /// only; dc-asgd needs stashed weights (not pipedream-nostash).
    #[arg(long, value_name = "KIND")]
    delay_correction: Option<pipe_stages::optim::DelayCorrection>,
    /// The delay correction's strength: error feedback's c [default: 1], DC-ASGD's lambda
    /// [default: 0.04], the adaptive form's lambda_0 [default: 2].
    #[arg(long, value_name = "C", value_parser = parse_f32)]
    delay_correction_strength: Option<f32>,
    /// Recompute activations in the backward pass instead of keeping them: none; full (each
    /// layer keeps its input, a transformer block instead of its attention and MLP
    /// activations, and runs its forward again in the backward); selective (only the
    /// attention layers' activations are recomputed). Same bits, less memory, more compute.
    /// One kind for every stage, or one per stage (`full,full,none,none`).
    #[arg(long, value_name = "none|full|selective[,...]")]
    recompute: Option<pipe_stages::layer::StageRecompute>,
    /// Read a tokenized corpus's windows as packed documents: attention stops at each
    /// document's start (after an end-of-text id), positions restart there, and a document's
    /// first token is not a loss term.
    #[arg(long)]
    pack_documents: bool,
    /// The order each epoch visits the training samples in: shuffled (a seeded permutation
    /// per epoch, the default) or sequential (sample 0, 1, 2, ...: for a run another trainer
    /// must follow window by window).
    #[arg(long, value_name = "shuffled|sequential")]
    data_order: Option<pipe_stages::data::DataOrder>,
    /// Clip every update's gradient to this global L2 norm (over every stage and replica;
    /// docs/training.md says which stages' norms an asynchronous pipeline adds). 0 turns it
    /// off [default: 1.0 for the gpt2 models, off otherwise].
    #[arg(long, value_name = "NORM", value_parser = parse_f32)]
    grad_clip: Option<f32>,
    /// Run seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Compute threads (0: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Write one JSON object per step and per epoch to FILE.
    #[arg(long, value_name = "FILE")]
    log_jsonl: Option<PathBuf>,
    /// Pipeline stages.
    #[arg(long)]
    stages: Option<usize>,
    /// Replicas per stage: one value for all, or a comma-separated list (2,1,1,1).
    #[arg(long, value_delimiter = ',')]
    replicas: Option<Vec<u32>>,
    /// Pipeline schedule: pipedream (default), pipedream-nostash, vsync, 2bw, gpipe,
    /// 1f1b-flush, interleaved, zb-h1, zb-v, dualpipev or sequential.
    #[arg(long)]
    schedule: Option<String>,
    /// Model chunks per worker (interleaved; zb-v and dualpipev always hold 2).
    #[arg(long)]
    chunks: Option<u32>,
    /// How to cut the model into stages: `measured` (profile briefly, balance time; the
    /// default), `flops` (balance FLOPs; the same cut on every machine) or inclusive layer
    /// ranges such as 0-2,3-5.
    #[arg(long)]
    partition: Option<String>,
    /// Run a plan written by `pipe plan -o`: its schedule, stages, replicas and partition.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["stages", "replicas", "partition", "workers"])]
    plan: Option<PathBuf>,
    /// Plan automatically for W workers: profile the model, then partition it under the default
    /// cost model for the run's schedule.
    #[arg(long, conflicts_with_all = ["stages", "replicas", "partition"])]
    pub workers: Option<u32>,
    /// Write the measured timeline as Chrome trace JSON to FILE (pipelined runs).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Compute backend: cpu or cuda.
    #[arg(long, value_parser = BackendParser)]
    backend: Option<BackendKind>,
    /// Precision of the matrix products: f32, tf32 or bf16 (tensor cores with f32
    /// accumulation and f32 master weights; cuda only).
    #[arg(long, value_parser = ["f32", "tf32", "bf16"])]
    precision: Option<String>,
    /// What carries each link between workers: auto (channels between threads, shared
    /// memory between processes of one host, QUIC between hosts), or one transport for every
    /// link: inproc, shm, quic (QUIC with mutual TLS on every link) or tcp (plain TCP, for
    /// trusted networks). A transport that crosses processes runs worker processes unless
    /// --placement says otherwise.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(pipe_transport::kinds::names()))]
    transport: Option<String>,
    /// Where the workers run: threads of this process, or one `pipe worker` process each on
    /// this host.
    #[arg(long, value_parser = ["threads", "processes"])]
    placement: Option<String>,
    /// Element type of activations and gradients between stages: f32 or bf16 (half the
    /// bytes; all-reduces stay f32).
    #[arg(long, value_parser = ["f32", "bf16"])]
    wire_dtype: Option<String>,
    /// MiB of f32 gradients per all-reduce bucket, one size or one per stage (`4,1,one`; `one`:
    /// a stage's gradients in one bucket). Each bucket of a stage's last layers starts its
    /// ring all-reduce while the backward pass computes the earlier ones. Default: chosen per
    /// stage by the simulator on the run's link where the partition is measured, else 4.
    #[arg(long, value_name = "MIB[,MIB...]")]
    allreduce_bucket_mb: Option<pipe_stages::config::BucketSizes>,
    /// Precision of the gradients the replicas' all-reduce sends: f32, or bf16 (half the
    /// bytes; sums stay f32, every replica ends with the same bits).
    #[arg(long, value_parser = ["f32", "bf16"])]
    allreduce_dtype: Option<String>,
    /// Remedy for stale weights: run the first N updates with the synchronous 1f1b-flush
    /// schedule, then the asynchronous policy (pipedream, pipedream-nostash, vsync, 2bw).
    #[arg(long, value_name = "N")]
    sync_warmup: Option<u64>,
    /// Remedy for stale weights: scale each stage's learning rate by its delay tau:
    /// `staleness` (lr / (1 + tau)) or `pipemare:K` (lr * tau^-(1 - k/K), PipeMare's
    /// rescheduling over the first K updates).
    #[arg(long, value_name = "none|staleness|pipemare:K")]
    lr_scaling: Option<String>,
    /// Remedy for stale weights: predict weights from a running average of each stage's
    /// weight changes. `discrepancy[:DECAY]` (pipedream-nostash): the backward estimates the
    /// forward's weights (PipeMare); `lookahead[:DECAY]` (pipedream, vsync, 2bw): passes use
    /// the weights predicted for when the gradient is applied.
    #[arg(long, value_name = "none|discrepancy[:D]|lookahead[:D]")]
    weight_prediction: Option<String>,
    /// Seconds a worker may wait for data before the run stops as stalled and the hang doctor
    /// prints every worker's state and the wait-for graph (default 300).
    #[arg(long, value_name = "SECONDS")]
    stall_timeout: Option<f64>,
    /// Write checkpoints to DIR: at every epoch's end, every --checkpoint-every updates, and
    /// on Ctrl-C (pipelined runs).
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Also drain the pipeline and write a checkpoint every N updates.
    #[arg(long, value_name = "N", requires = "checkpoint_dir",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub checkpoint_every: Option<u64>,
    /// Write the run's starting point (update 0: the seed's weights, or --init-from's, and a
    /// fresh optimizer) as a checkpoint in --checkpoint-dir and stop without training: a seed
    /// checkpoint that runs of any layout, and exports, start from.
    #[arg(long, requires = "checkpoint_dir", conflicts_with = "resume")]
    pub seed_checkpoint: bool,
    /// Checkpoints kept, newest first.
    #[arg(long, default_value_t = 3, value_name = "K",
          value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub keep_checkpoints: u64,
    /// Serve metrics for Prometheus at ADDR (e.g. 127.0.0.1:9464) while the run lasts.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Resume from a checkpoint: a checkpoint's directory, a checkpoint directory (its
    /// newest), `latest` (the newest in --checkpoint-dir), or `auto` (the newest in
    /// --checkpoint-dir if there is one, else a fresh start: what a scheduler that restarts
    /// failed workers passes on every start).
    #[arg(long, value_name = "DIR|latest|auto")]
    pub resume: Option<String>,
    /// After a failure (a worker process killed or lost, a stall), start every worker again
    /// from the newest checkpoint in --checkpoint-dir (from the start if there is none yet),
    /// up to N times; the run then fails naming every cause.
    #[arg(long, default_value_t = 0, value_name = "N",
          value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub max_restarts: u32,
    /// After a lost replica of a replicated stage (which the run survives on the stage's other
    /// replicas), take it back at the next drain point: a replacement worker with the lost
    /// rank joins and the stage's replica count is restored. Worker processes need
    /// --checkpoint-dir (they go on from the drain point's checkpoint).
    #[arg(long)]
    pub rejoin: bool,
    /// Measure the layer profile of a measured partition or --workers' plan again, even
    /// where pipe's cache holds it for this model, machine and run shape (the new one
    /// replaces it). The cache is PIPE_CACHE_DIR, else the platform's (~/.cache/pipe).
    #[arg(long)]
    pub reprofile: bool,
    /// Run even where the memory estimate of this host's workers is over the memory this
    /// host has available (MemAvailable, or the cgroup's memory.max where lower).
    #[arg(long)]
    pub force: bool,
    /// On each restart after a worker was lost (--max-restarts), profile and plan the run
    /// again for the workers that remain (one fewer), as --workers plans: stages, replicas and
    /// partition change; the optimizer, the schedule and the minibatch stay the run's.
    #[arg(long, requires = "max_restarts")]
    pub replan_on_restart: bool,
    /// Inject faults into worker processes, for drills and tests: `RANK:FAULT[/ATTEMPT]`,
    /// comma-separated, where FAULT is exit@N (the process ends at its Nth data message, as
    /// kill -9 would end it), panic@N, fail@N, reset@N, drop@N, duplicate@N, stall@N:SECONDS,
    /// freeze@N:SECONDS (the whole process stops, as SIGSTOP stops it) or
    /// partition@N:PEER:SECONDS (no datagram passes between the worker and PEER),
    /// and ATTEMPT the start of the workers it applies to (0, the default, then one more per
    /// restart, lost replica or rejoin);
    /// or `random:SEED:COUNT`, COUNT faults of those kinds drawn from SEED, one per start.
    #[arg(long, value_name = "SCHEDULE", value_parser = pipe_transport::fault::parse_plan)]
    pub fault_schedule: Option<pipe_transport::fault::FaultPlan>,
}

impl TrainArgs {
    /// The GPT-2 shape the `--n-*` flags give, if any.
    fn gpt2_shape(&self) -> Option<pipe_stages::transformer::Gpt2Shape> {
        let shape = pipe_stages::transformer::Gpt2Shape {
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_embd: self.n_embd,
            n_positions: self.n_positions,
            vocab_size: self.vocab_size,
        };
        (shape != pipe_stages::transformer::Gpt2Shape::default()).then_some(shape)
    }

    /// Where the run's settings come from: the config file, these flags, a plan file or
    /// `--workers`.
    ///
    /// # Errors
    /// As [`TrainArgs::settings`].
    pub fn sources(&self) -> Result<startup::RunSources> {
        Ok(startup::RunSources {
            config_file: self.config.clone(),
            flags: self.settings()?,
            plan_file: self.plan.clone(),
            workers: self.workers,
            reprofile: self.reprofile,
        })
    }

    /// The flags as settings to merge over a config file's.
    ///
    /// # Errors
    /// Bad input when `--dataset tokens:DIR` and `--data-dir` both name a directory.
    fn settings(&self) -> Result<TrainSettings> {
        let (dataset, data_dir) =
            crate::args::dataset_and_dir(self.dataset.as_ref(), self.data_dir.as_deref())?;
        Ok(TrainSettings {
            model: self.model.clone().map(ModelChoice::Preset),
            tie_embeddings: self.tie_embeddings.then_some(true),
            dataset,
            data_dir,
            holdout: self.holdout.clone(),
            eval_windows: self.eval_windows,
            model_config: self.model_config.clone(),
            init_from: self.init_from.clone(),
            gpt2: self.gpt2_shape(),
            epochs: self.epochs,
            steps: self.steps,
            eval_every: self.eval_every,
            data_order: self.data_order,
            recompute: self.recompute.clone(),
            pack_documents: self.pack_documents.then_some(true),
            microbatch_size: self.microbatch_size,
            microbatches: self.microbatches,
            optimizer: self.optimizer,
            lr: self.lr,
            lr_schedule: self.lr_schedule,
            warmup_steps: self.warmup_steps,
            momentum: self.momentum,
            nesterov: self.nesterov.then_some(true),
            weight_decay: self.weight_decay,
            weight_decay_groups: self.weight_decay_groups,
            delay_correction: self.delay_correction,
            delay_correction_strength: self.delay_correction_strength,
            grad_clip: self.grad_clip,
            seed: self.seed,
            threads: self.threads,
            log_jsonl: self.log_jsonl.clone(),
            stages: self.stages,
            replicas: self.replicas.clone(),
            schedule: self.schedule.clone(),
            chunks: self.chunks,
            partition: self.partition.clone(),
            backend: self.backend.map(|b| b.name().to_string()),
            precision: self.precision.clone(),
            transport: self.transport.clone(),
            placement: self.placement.clone(),
            wire_dtype: self.wire_dtype.clone(),
            sync_warmup: self.sync_warmup,
            lr_scaling: self.lr_scaling.clone(),
            weight_prediction: self.weight_prediction.clone(),
            stall_timeout: self.stall_timeout,
            allreduce_bucket_mb: self.allreduce_bucket_mb.clone(),
            allreduce_dtype: self.allreduce_dtype.clone(),
            ..TrainSettings::default()
        })
    }
}

/// The run the flags describe: config file, then flags, then a plan file or an automatic
/// plan, validated once ([`startup::resolve`]).
///
/// # Errors
/// Bad input for unreadable or malformed files and settings that describe no run.
pub fn run_config(args: &TrainArgs, watcher: &dyn startup::StartupWatcher) -> Result<RunConfig> {
    Ok(startup::resolve(&args.sources()?, watcher)?)
}

/// Serves the `metrics` crate's metrics for Prometheus at `addr`, when given.
///
/// # Errors
/// Bad input when the address cannot be listened on.
pub fn serve_metrics(addr: Option<std::net::SocketAddr>) -> Result<()> {
    let Some(addr) = addr else { return Ok(()) };
    serve_metrics_quietly(addr)?;
    outln!("metrics for Prometheus at http://{addr}/metrics");
    Ok(())
}

/// [`serve_metrics`] without the line saying so.
///
/// # Errors
/// As [`serve_metrics`].
pub fn serve_metrics_quietly(addr: std::net::SocketAddr) -> Result<()> {
    // Bind first, so that an address in use is one clear line, not an exporter's panic.
    std::net::TcpListener::bind(addr)
        .map_err(|e| bad_input(format!("--metrics-addr {addr}: {e}")))?;
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|e| bad_input(format!("--metrics-addr {addr}: {e}")))?;
    Ok(())
}

/// The checkpoint policy the flags ask for, if any.
///
/// # Errors
/// A run that does not serialize (never, for a resolved one).
pub fn checkpoint_policy(args: &TrainArgs, cfg: &RunConfig) -> Result<Option<CheckpointPolicy>> {
    let Some(dir) = &args.checkpoint_dir else {
        return Ok(None);
    };
    Ok(Some(CheckpointPolicy {
        dir: dir.clone(),
        every: args.checkpoint_every,
        keep: usize::try_from(args.keep_checkpoints).unwrap_or(usize::MAX),
        settings: cfg.numerics().to_json()?,
    }))
}

/// Reports the checkpoints a run wrote; a run stopped by Ctrl-C ends here (exit 130), naming
/// the checkpoint to resume from.
///
/// # Errors
/// [`Interrupted`] when the run stopped early.
pub fn finish_checkpoints(written: &[PathBuf], stopped: Option<u64>) -> Result<()> {
    if let Some(last) = written.last() {
        outln!(
            "checkpoints: {} written, the last {}",
            written.len(),
            last.display()
        );
    }
    if let Some(updates) = stopped {
        let saved = match written.last() {
            Some(dir) => format!("; resume with --resume {}", dir.display()),
            None => "; nothing saved (no --checkpoint-dir)".into(),
        };
        return Err(Interrupted(format!("stopped after update {updates}{saved}")).into());
    }
    Ok(())
}

/// A flag Ctrl-C sets: the run stops at its next drain point, after a checkpoint (saying so
/// when `announce`). A second Ctrl-C ends the process at once (exit 130).
pub fn stop_on_ctrl_c(announce: bool) -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let installed = ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        if announce {
            eprintln!("stopping at the next drain point (Ctrl-C again to quit at once)");
        }
    });
    if let Err(e) = installed {
        eprintln!("warning: Ctrl-C will end the run without a checkpoint: {e}");
    }
    stop
}

/// Prints the closing line of a run.
pub fn print_done(report: &TrainReport) {
    if let Some(last) = report.epochs.last() {
        print_done_line(report.steps, last, params_digest(&report.params));
    }
}

/// The closing line, from the last epoch's figures and the final weights' digest
/// ([`params_digest`]: equal digests, equal weights, bit for bit).
pub fn print_done_line(steps: u64, last: &EpochStats, digest: u64) {
    outln!(
        "done: {} steps, test accuracy {:.2}%, test loss {:.4}, weights {digest:016x}, {:.1} s",
        steps,
        100.0 * last.test_accuracy,
        last.test_loss,
        last.elapsed_s
    );
}

/// Hands every step and epoch to the progress display first, then to the other observers
/// (the JSON-lines log); shows the phases of the run's start on `phases` and logs them once
/// ended.
pub struct Fan {
    first: Progress,
    rest: Vec<Box<dyn Observer>>,
    phases: Phases,
}

impl Fan {
    /// Hands the ended phases of the run's start to the log.
    fn log_phases(&mut self) -> pipe_stages::Result<()> {
        for record in self.phases.take_ended() {
            self.rest.iter_mut().try_for_each(|o| o.on_phase(&record))?;
        }
        Ok(())
    }
}

impl Fan {
    /// The progress display (a bar on a terminal) and the log `cfg` asks for.
    ///
    /// # Errors
    /// A log file that cannot be created.
    pub fn new(cfg: &RunConfig, phases: Phases) -> Result<Self> {
        let mut rest: Vec<Box<dyn Observer>> = Vec::new();
        if let Some(path) = &cfg.log_jsonl {
            rest.push(Box::new(JsonlLog::create(path)?));
        }
        // A tokenized corpus's tokens are whatever its tokenizer made; Tiny Shakespeare's are
        // characters.
        let unit = if cfg.dataset == DatasetKind::Tokens {
            "nats/token"
        } else {
            "nats/char"
        };
        let language = matches!(
            cfg.dataset,
            DatasetKind::Tokens | DatasetKind::TinyShakespeare
        );
        Ok(Fan {
            first: Progress::new(std::io::stderr().is_terminal(), unit, language),
            rest,
            phases,
        })
    }
}

impl Observer for Fan {
    fn on_start_phase(&mut self, phase: StartPhase) -> pipe_stages::Result<()> {
        let detail = match phase {
            StartPhase::FirstUpdate => "every worker is up",
            StartPhase::Weights | StartPhase::Workers => "",
        };
        self.phases.begin(phase.describe(), detail);
        self.log_phases()
    }
    fn on_phase(&mut self, record: &PhaseRecord) -> pipe_stages::Result<()> {
        self.rest.iter_mut().try_for_each(|o| o.on_phase(record))
    }
    fn on_step(&mut self, s: &StepStats) -> pipe_stages::Result<()> {
        if self.phases.running().is_some() {
            self.phases.end();
            self.log_phases()?;
        }
        self.first.on_step(s)?;
        self.rest.iter_mut().try_for_each(|o| o.on_step(s))
    }
    fn on_epoch(&mut self, e: &EpochStats) -> pipe_stages::Result<()> {
        self.first.on_epoch(e)?;
        self.rest.iter_mut().try_for_each(|o| o.on_epoch(e))
    }
    fn on_eval(&mut self, e: &EvalStats) -> pipe_stages::Result<()> {
        self.first.on_eval(e)?;
        self.rest.iter_mut().try_for_each(|o| o.on_eval(e))
    }
    fn on_layout_change(&mut self, c: &LayoutChange) -> pipe_stages::Result<()> {
        outln!("{c}");
        self.rest.iter_mut().try_for_each(|o| o.on_layout_change(c))
    }
}

/// A progress bar on a terminal; nothing per step otherwise. One summary line per epoch.
struct Progress {
    bar: Option<ProgressBar>,
    tty: bool,
    /// The latest validation loss of a language model, shown while the next epoch runs.
    last_val: Option<f64>,
    /// A language model's loss unit.
    unit: &'static str,
    /// A language model (validation loss) rather than a classifier (test loss).
    language: bool,
}

impl Progress {
    fn new(tty: bool, unit: &'static str, language: bool) -> Self {
        Self {
            bar: None,
            tty,
            last_val: None,
            unit,
            language,
        }
    }
}

impl Observer for Progress {
    fn on_step(&mut self, s: &StepStats) -> pipe_stages::Result<()> {
        if !self.tty {
            return Ok(());
        }
        let bar = self.bar.get_or_insert_with(|| {
            let b = ProgressBar::new(s.steps_in_epoch);
            if let Ok(style) = ProgressStyle::with_template(
                "epoch {prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed}, eta {eta})",
            ) {
                b.set_style(style.progress_chars("=> "));
            }
            b.set_prefix(s.epoch.to_string());
            b.enable_steady_tick(Duration::from_millis(200));
            b
        });
        bar.set_position(s.step_in_epoch);
        if s.step_in_epoch % 10 == 1 || s.step_in_epoch == s.steps_in_epoch {
            let rate = match s.tokens_per_sec {
                Some(t) => format!("{t:.0} tokens/s"),
                None => format!("{:.0} samples/s", s.samples_per_sec),
            };
            let val = self
                .last_val
                .map(|v| format!(", val loss {v:.4}"))
                .unwrap_or_default();
            let norm = s
                .grad_norm
                .map(|n| format!(", grad norm {n:.3}"))
                .unwrap_or_default();
            bar.set_message(format!("loss {:.4}{norm}{val}, {rate}", s.loss));
        }
        Ok(())
    }

    fn on_eval(&mut self, e: &EvalStats) -> pipe_stages::Result<()> {
        let (what, unit) = if self.language {
            self.last_val = Some(e.test_loss);
            ("val", format!(" {}", self.unit))
        } else {
            ("test", String::new())
        };
        let line = format!(
            "eval at update {:>6}  {what} loss {:.4}{unit}  {what} acc {:6.2}%  {:>7.1} s",
            e.steps,
            e.test_loss,
            100.0 * e.test_accuracy,
            e.elapsed_s
        );
        // Standard output, as the epoch lines; the bar steps aside while it is written.
        match &self.bar {
            Some(bar) => bar.suspend(|| outln!("{line}")),
            None => outln!("{line}"),
        }
        Ok(())
    }

    fn on_epoch(&mut self, e: &EpochStats) -> pipe_stages::Result<()> {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
        let train_loss = if e.train_loss.is_finite() {
            format!("{:.4}", e.train_loss)
        } else {
            "-".into()
        };
        match e.tokens_per_sec {
            Some(tokens) => {
                self.last_val = Some(e.test_loss);
                outln!(
                    "epoch {:>3}  train loss {}  val loss {:.4} {}  val acc {:6.2}%  {:>8.0} tokens/s  {:>7.1} s",
                    e.epoch,
                    train_loss,
                    e.test_loss,
                    self.unit,
                    100.0 * e.test_accuracy,
                    tokens,
                    e.elapsed_s
                );
            }
            None => outln!(
                "epoch {:>3}  train loss {}  test loss {:.4}  test acc {:6.2}%  {:>8.0} samples/s  {:>7.1} s",
                e.epoch,
                train_loss,
                e.test_loss,
                100.0 * e.test_accuracy,
                e.samples_per_sec,
                e.elapsed_s
            ),
        }
        if !e.stages.is_empty() {
            let parts: Vec<String> = e
                .stages
                .iter()
                .map(|s| {
                    let peak = s.peak_resident_bytes.map_or(String::new(), |b| {
                        format!(" peak {:.1} MiB", b as f64 / (1024.0 * 1024.0))
                    });
                    let device = s.peak_device_bytes.map_or(String::new(), |b| {
                        format!(" device {:.2} GiB", b as f64 / f64::from(1u32 << 30))
                    });
                    format!(
                        "s{} util {:3.0}% staleness {:.2}{peak}{device}",
                        s.stage,
                        100.0 * s.utilisation,
                        s.staleness
                    )
                })
                .collect();
            outln!("           {}", parts.join(" | "));
        }
        Ok(())
    }
}

/// Parses a floating-point flag, refusing what an `f32` cannot hold (`1e300`, `inf`, `nan`)
/// with the value as given.
fn parse_f32(text: &str) -> Result<f32, String> {
    let v: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("'{text}' is not a number"))?;
    pipe_stages::config::to_f32(v)
}
