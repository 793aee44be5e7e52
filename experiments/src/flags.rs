//! The flags that describe a schedule (`pipe schedule`, `pipe simulate`), and those of
//! `pipe bench partition`, `hosts`, `pipeline` and `transport` (and the
//! all-reduce worker `transport` starts), checked and typed into each benchmark's config
//! here, beside the benchmarks: the command line parses them and prints the reports.

use std::ffi::OsStr;
use std::path::PathBuf;

use clap::builder::TypedValueParser;
use clap::error::ErrorKind;
use pipe_kernels::{BackendKind, Precision};

use pipe_scheduler::units::{parse_bandwidth, parse_bytes, parse_seconds};
use pipe_scheduler::{
    CostModel, Length, LowerOptions, Policy, Schedule, ScheduleError, ScheduleSpec, StageCost,
    generate, validate,
};

use crate::ExperimentError;

/// Checks a benchmark's counts (flag, value) against
/// [`pipe_stages::limits::MAX_BENCH_ITERATIONS`].
///
/// # Errors
/// The limit's error, naming the flag.
fn check_counts(counts: &[(&str, u64)]) -> Result<(), ExperimentError> {
    use pipe_stages::limits::{MAX_BENCH_ITERATIONS, check_count};
    for &(flag, v) in counts {
        check_count(
            flag,
            v,
            MAX_BENCH_ITERATIONS,
            "far past what a median needs",
        )?;
    }
    Ok(())
}

/// Checks `model`'s microbatch of `size` samples against the tensor limit.
///
/// # Errors
/// An unknown preset; a microbatch past the limit.
pub fn check_model_batch(model: &str, size: usize) -> Result<(), ExperimentError> {
    let spec = pipe_stages::model::ModelSpec::preset(model)?;
    pipe_stages::model::Model::new(&spec)?.check_microbatch(size)?;
    Ok(())
}

/// Checks a layout of one stage on `workers` workers with `microbatches` per update.
///
/// # Errors
/// The scheduler's limits.
fn check_layout(workers: u32, microbatches: u32) -> Result<(), ExperimentError> {
    pipe_scheduler::limits::check_microbatches(u64::from(microbatches))?;
    pipe_scheduler::limits::check_layout(1, u64::from(workers), 1)?;
    Ok(())
}

/// `pipe bench partition`: the profiled plan against the uniform split.
#[derive(clap::Args, Debug)]
pub struct PartitionBenchArgs {
    /// Model preset.
    #[arg(long, default_value = "mlp-256-1536x3-256x6-10")]
    pub model: String,
    /// Samples per microbatch.
    #[arg(long, default_value_t = 32)]
    pub microbatch_size: usize,
    /// Microbatches per update per replica.
    #[arg(long, default_value_t = 4)]
    pub microbatches: u32,
    /// Workers.
    #[arg(long, default_value_t = 2)]
    pub workers: u32,
    /// Schedule.
    #[arg(long, default_value = "pipedream", value_parser = Policy::parse_flag)]
    pub schedule: pipe_scheduler::Policy,
    /// Timed minibatches per measurement.
    #[arg(long, default_value_t = 24)]
    pub updates: u32,
    /// Rounds (figures are medians over rounds).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE", value_parser = pipe_stages::outputs::output_file)]
    pub json: Option<PathBuf>,
}

impl PartitionBenchArgs {
    /// The benchmark these flags ask for, checked.
    ///
    /// # Errors
    /// Non-positive sizes, too few workers, counts past the limits, an unusable model.
    pub fn config(&self) -> Result<crate::partition::PartitionBenchConfig, ExperimentError> {
        if self.updates == 0
            || self.microbatch_size == 0
            || self.microbatches == 0
            || self.workers < 2
        {
            return Err(ExperimentError::Config(
                "--updates, --microbatch-size and --microbatches must be positive, --workers at least 2"
                    .into(),
            ));
        }
        check_counts(&[
            ("--updates", u64::from(self.updates)),
            ("--rounds", u64::from(self.rounds)),
        ])?;
        check_layout(self.workers, self.microbatches)?;
        check_model_batch(&self.model, self.microbatch_size)?;
        Ok(crate::partition::PartitionBenchConfig {
            model: self.model.clone(),
            microbatch: self.microbatch_size,
            microbatches: self.microbatches,
            workers: self.workers,
            policy: self.schedule,
            updates: self.updates,
            rounds: self.rounds,
            ..Default::default()
        })
    }
}

/// `pipe bench hosts`: the planner's pick against a pipeline and data parallelism, measured as
/// worker processes over hosts.
#[derive(clap::Args, Debug)]
pub struct HostsBenchArgs {
    /// Model preset.
    #[arg(long, default_value = "mlp-784-1024x16-10")]
    pub model: String,
    /// Samples per microbatch.
    #[arg(long, default_value_t = 32)]
    pub microbatch_size: usize,
    /// Microbatches per update per replica.
    #[arg(long, default_value_t = 4)]
    pub microbatches: u32,
    /// Workers (processes).
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// The link's bandwidth, as the planner and the simulator are told (GB means 10^9 bytes).
    #[arg(long, value_parser = pipe_scheduler::units::parse_bandwidth)]
    pub bandwidth: f64,
    /// Host addresses, comma-separated; ranks fill them in order, as the plan places them.
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1")]
    pub hosts: Vec<String>,
    /// The network namespace of each host, comma-separated (workers start with `ip netns
    /// exec`); none: on this host.
    #[arg(long, value_delimiter = ',')]
    pub netns: Vec<String>,
    /// Timed minibatches per measurement.
    #[arg(long, default_value_t = 30)]
    pub updates: u64,
    /// Cores the workers share, for the simulator (default: this machine's).
    #[arg(long)]
    pub cores: Option<u32>,
    /// The link's MTU in bytes (1,280 to 32,028): QUIC's processor time per message and per
    /// byte, which the simulator charges, is measured on loopback with datagrams that fit it.
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u16).range(1280..=32028))]
    pub mtu: u16,
    /// Where cluster files go (default: a folder in the temporary directory).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE", value_parser = pipe_stages::outputs::output_file)]
    pub json: Option<PathBuf>,
}

impl HostsBenchArgs {
    /// The benchmark these flags ask for, checked; `pipe` is the binary that starts the
    /// workers.
    ///
    /// # Errors
    /// Non-positive sizes, too few workers, counts past the limits, an unusable model.
    pub fn config(&self, pipe: PathBuf) -> Result<crate::hosts::HostsBenchConfig, ExperimentError> {
        if self.workers < 2 || self.microbatch_size == 0 || self.microbatches == 0 {
            return Err(ExperimentError::Config(
                "--workers must be at least 2, --microbatch-size and --microbatches positive"
                    .into(),
            ));
        }
        check_counts(&[("--updates", self.updates)])?;
        check_layout(self.workers, self.microbatches)?;
        check_model_batch(&self.model, self.microbatch_size)?;
        // The workers' cluster file takes these as addresses; one that cannot be one would
        // otherwise wait out the connection timeout after the profiling.
        if let Some(bad) = self
            .hosts
            .iter()
            .find(|h| !pipe_transport::cluster::is_host(h))
        {
            return Err(ExperimentError::Config(format!(
                "--hosts: '{}' is not a host (a name of letters, digits, '-', '_' and '.' of 1 \
                 to 255 characters that is not all digits and dots, an IPv4 address or a \
                 bracketed IPv6 one)",
                bad.escape_debug()
            )));
        }
        let cores = self.cores.or_else(|| {
            std::thread::available_parallelism()
                .ok()
                .map(|n| n.get() as u32)
        });
        let dir = self.dir.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("pipe-bench-hosts-{}", std::process::id()))
        });
        Ok(crate::hosts::HostsBenchConfig {
            model: self.model.clone(),
            microbatch: self.microbatch_size,
            microbatches: self.microbatches,
            workers: self.workers,
            bandwidth: self.bandwidth,
            hosts: self.hosts.clone(),
            netns: self.netns.clone(),
            updates: self.updates,
            cores,
            mtu: self.mtu,
            pipe,
            dir,
        })
    }
}

/// `pipe bench pipeline`: pipelined throughput against one worker and the simulator.
#[derive(clap::Args, Debug)]
pub struct PipelineBenchArgs {
    /// Timed minibatches per case.
    #[arg(long, default_value_t = 24)]
    pub updates: u32,
    /// Warm-up minibatches per case.
    #[arg(long, default_value_t = 6)]
    pub warmup: u32,
    /// Only the small model (256-256x8-10).
    #[arg(long)]
    pub small_only: bool,
    /// Rounds of every measurement (figures are medians over rounds).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// Only the cases on threads of this process (no worker-process cases).
    #[arg(long)]
    pub threads_only: bool,
    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE", value_parser = pipe_stages::outputs::output_file)]
    pub json: Option<PathBuf>,
}

impl PipelineBenchArgs {
    /// The benchmark these flags ask for, checked; `pipe` is the binary that starts the
    /// worker-process cases (none with `--threads-only`).
    ///
    /// # Errors
    /// Zero updates; counts past the limits.
    pub fn config(
        &self,
        pipe: Option<PathBuf>,
    ) -> Result<crate::pipeline::PipelineBenchConfig, ExperimentError> {
        if self.updates == 0 {
            return Err(ExperimentError::Config("--updates must be positive".into()));
        }
        check_counts(&[
            ("--updates", u64::from(self.updates)),
            ("--warmup", u64::from(self.warmup)),
            ("--rounds", u64::from(self.rounds)),
        ])?;
        Ok(crate::pipeline::PipelineBenchConfig {
            updates: self.updates,
            warmup: self.warmup,
            small_only: self.small_only,
            rounds: self.rounds,
            pipe: pipe.filter(|_| !self.threads_only),
        })
    }
}

/// `pipe bench transport`: tensor streaming per transport, TCP, the ring all-reduce.
#[derive(clap::Args, Debug)]
pub struct TransportBenchArgs {
    /// MiB per streamed tensor.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub message_mib: u64,
    /// Tensors per streaming round.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub messages: u32,
    /// MB all-reduced.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub allreduce_mb: u64,
    /// Workers in the all-reduce.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..=64))]
    pub allreduce_workers: u32,
    /// Rounds per figure (medians).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE", value_parser = pipe_stages::outputs::output_file)]
    pub json: Option<PathBuf>,
    /// Measure only the link costs the planner charges (each transport's latency and
    /// processor time per message and per byte, over 5 rounds), cache them, and skip the
    /// streaming and all-reduce figures (so no `--json` report: `--costs-out` writes them).
    #[arg(long, conflicts_with = "json")]
    pub costs_only: bool,
    /// Also write the link costs as JSON to FILE (what `pipe plan --transport-costs` reads).
    #[arg(long, value_name = "FILE", value_parser = pipe_stages::outputs::output_file)]
    pub costs_out: Option<PathBuf>,
}

impl TransportBenchArgs {
    /// The benchmark these flags ask for (sizes, workers and rounds are bounded by their
    /// flags' ranges).
    pub fn config(&self) -> crate::transport::TransportBenchConfig {
        crate::transport::TransportBenchConfig {
            message_mib: self.message_mib as usize,
            messages: self.messages,
            allreduce_mb: self.allreduce_mb as usize,
            allreduce_workers: self.allreduce_workers,
            rounds: self.rounds,
        }
    }
}

/// `pipe bench allreduce-worker`: one process of `pipe bench transport`'s all-reduce among
/// processes (started by it, not by hand).
#[derive(clap::Args, Debug)]
pub struct AllreduceWorkerArgs {
    /// MB all-reduced.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub mb: u64,
    /// Timed rounds.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    /// The cluster file.
    #[arg(long)]
    pub cluster: PathBuf,
    /// This worker's rank.
    #[arg(long)]
    pub rank: u32,
    /// Started by a launcher.
    #[arg(long)]
    pub launched: bool,
    /// What carries the ring: a registered transport that crosses processes.
    #[arg(long, default_value = "quic", value_parser = clap::builder::PossibleValuesParser::new(pipe_transport::kinds::names()))]
    pub transport: String,
}

/// What describes a schedule on the command line (shared by `pipe schedule` and `pipe
/// simulate`).
#[derive(clap::Args, Debug)]
pub struct ScheduleOpts {
    /// Policy: sequential, gpipe, 1f1b-flush, interleaved, zb-h1, zb-v, dualpipev, pipedream,
    /// pipedream-nostash, vsync or 2bw.
    #[arg(long, default_value = "1f1b-flush", value_parser = Policy::parse_flag)]
    schedule: Policy,
    /// Pipeline stages.
    #[arg(long, default_value_t = 4)]
    stages: u32,
    /// Microbatches per update, per replica (M).
    #[arg(long, default_value_t = 8)]
    microbatches: u32,
    /// Replicas per stage: one value for all, or a comma-separated list (2,1,1,1).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    replicas: Vec<u32>,
    /// Model chunks per worker (interleaved; zb-v and dualpipev always hold 2).
    #[arg(long, default_value_t = 1)]
    chunks: u32,
    /// Minibatches to run (default: 1 for flush policies, 2 x stages for asynchronous ones, so
    /// the steady state shows).
    #[arg(long, conflicts_with = "total_microbatches")]
    updates: Option<u32>,
    /// Microbatches to run in total (a whole number of minibatches).
    #[arg(long)]
    total_microbatches: Option<u32>,
    /// Expand each all-reduce into its ring send and receive steps.
    #[arg(long)]
    expand_all_reduce: bool,
}

impl ScheduleOpts {
    /// The schedule the flags describe, before generation.
    pub fn spec(&self) -> ScheduleSpec {
        let length = match (self.updates, self.total_microbatches) {
            (_, Some(n)) => Length::Microbatches(n),
            (Some(k), None) => Length::Updates(k),
            (None, None) if self.schedule.is_flush() => Length::Updates(1),
            (None, None) => Length::Updates(2 * self.stages.max(1)),
        };
        ScheduleSpec::new(self.schedule, self.stages, self.microbatches)
            .with_replicas(self.replicas.clone())
            .with_chunks(self.chunks)
            .with_length(length)
    }

    /// True when each all-reduce is to be expanded into its ring steps.
    pub fn expands_all_reduce(&self) -> bool {
        self.expand_all_reduce
    }

    /// Generates, lowers and checks the schedule.
    ///
    /// # Errors
    /// Bad input ([`ScheduleError::is_bad_input`]) when the flags describe no schedule; a
    /// run-time failure when the generated schedule fails its checks.
    pub fn build(&self) -> Result<Schedule, ScheduleError> {
        let generated = generate(&self.spec())?;
        let lowered = pipe_scheduler::lower_checked(
            &generated,
            LowerOptions {
                expand_all_reduce: self.expand_all_reduce,
            },
        )?;
        validate::check(&lowered)?;
        Ok(lowered)
    }
}

/// The cost model of `pipe simulate`: a cost file, or inline flags, with the measured costs
/// of a transport's messages where one is named.
#[derive(clap::Args, Debug)]
pub struct CostFlags {
    /// Cost model file (TOML, or JSON if it ends in .json): `bandwidth`, `latency`, `overlap`,
    /// `cores`, `message_cpu` and `[[stage]]` tables with forward, backward_input, backward_weight, update,
    /// activation_bytes, param_bytes, stash_bytes. Overrides the inline cost flags.
    #[arg(long, value_name = "FILE")]
    pub costs: Option<PathBuf>,
    /// Forward time per microbatch and stage (seconds, or with a unit: 2ms, 150us).
    #[arg(long, default_value = "1", value_parser = parse_seconds)]
    pub forward: f64,
    /// Fused backward time (split evenly into input and weight halves).
    #[arg(long, default_value = "2", value_parser = parse_seconds)]
    pub backward: f64,
    /// Optimizer step time.
    #[arg(long, default_value = "0", value_parser = parse_seconds)]
    pub update: f64,
    /// Bytes of each stage's output activation per microbatch (also its gradient).
    #[arg(long, default_value = "0", value_parser = parse_bytes)]
    pub activation_bytes: f64,
    /// Bytes of each stage's parameters (one weight version; what an all-reduce moves).
    #[arg(long, default_value = "0", value_parser = parse_bytes)]
    pub param_bytes: f64,
    /// Link bandwidth, e.g. 10GB/s (GB = 1e9 bytes, GiB = 2^30) [default: `--transport`'s
    /// measured rate, else infinite].
    #[arg(long, value_parser = parse_bandwidth)]
    pub bandwidth: Option<f64>,
    /// Link latency per message [default: `--transport`'s measured one-way time, else 0].
    #[arg(long, value_parser = parse_seconds)]
    pub latency: Option<f64>,
    /// Senders wait until their messages land (no compute/communication overlap).
    #[arg(long)]
    pub no_overlap: bool,
    /// Processor time each message costs its sender and its receiver (waking a peer, being
    /// woken), added to the action that sends or receives it.
    #[arg(long, default_value = "0", value_parser = parse_seconds)]
    pub message_cpu: f64,
    /// Processor time each byte costs its sender and its receiver (encryption, packets,
    /// copies), added as `--message-cpu` is, in seconds per byte.
    #[arg(long, default_value = "0", value_parser = parse_seconds)]
    pub byte_cpu: f64,
    /// Cores the workers share (default: one each); fewer cores than workers share them fairly.
    /// Overrides `cores` in a cost file.
    #[arg(long)]
    pub cores: Option<u32>,
    /// With `--transport`: the measured costs of that transport's messages replace
    /// `--message-cpu` and `--byte-cpu` (and a cost file's), and its rate and one-way time
    /// stand for `--bandwidth` and `--latency` where those are not given.
    #[command(flatten)]
    pub link: pipe_stages::planning::link_costs::LinkChoice,
}

impl CostFlags {
    /// The cost model ([`CostFlags::flag_or_file_costs`]), its message costs those of
    /// `--transport` where it is given; `say` is handed the line describing those costs.
    ///
    /// # Errors
    /// Bad input for an unreadable or malformed cost file, or link costs that cannot be
    /// read or measured.
    pub fn load(&self, say: impl Fn(&str)) -> Result<CostModel, ExperimentError> {
        let mut costs = self.flag_or_file_costs()?;
        if let Some((cost, source)) = self.link.load()? {
            say(&pipe_stages::planning::link_costs::describe(&cost, &source));
            costs.message_cpu = cost.message_cpu_s.median;
            costs.byte_cpu = cost.byte_cpu_s.median;
            if self.costs.is_none() {
                if self.bandwidth.is_none() {
                    costs.bandwidth = cost.bandwidth.map_or(f64::INFINITY, |b| b.median);
                }
                if self.latency.is_none() {
                    costs.latency = cost.latency_s.median;
                }
            }
        }
        Ok(costs)
    }

    /// The cost model: the cost file when given (with `--cores` over its own), else the flags.
    fn flag_or_file_costs(&self) -> Result<CostModel, ExperimentError> {
        if let Some(path) = &self.costs {
            let text = pipe_stages::limits::read_text_file(path, "cost file")?;
            let json = path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("json"));
            let mut costs = CostModel::parse(&text, json).map_err(|e| {
                ExperimentError::Config(format!("cost file {}: {e}", path.display()))
            })?;
            costs.cores = self.cores.or(costs.cores);
            return Ok(costs);
        }
        Ok(CostModel {
            stages: vec![StageCost {
                update: self.update,
                activation_bytes: self.activation_bytes,
                param_bytes: self.param_bytes,
                ..StageCost::compute(self.forward, self.backward)
            }],
            bandwidth: self.bandwidth.unwrap_or(f64::INFINITY),
            latency: self.latency.unwrap_or(0.0),
            overlap: !self.no_overlap,
            cores: self.cores,
            message_cpu: self.message_cpu,
            byte_cpu: self.byte_cpu,
            hosts: Vec::new(),
            between: None,
        })
    }
}

/// `pipe bench mfu`: single-worker throughput and model FLOP utilisation.
#[derive(clap::Args, Debug)]
pub struct MfuArgs {
    /// Model preset: an MLP (`mlp-784-1024x16-10`), a `gpt-*` preset, or `gpt2` / a `gpt2-*`
    /// preset, whose shape the `--n-*` flags set (at GPT-2's vocabulary unless
    /// `--vocab-size` says otherwise).
    #[arg(long, default_value = "mlp-784-1024x16-10")]
    pub model: String,
    /// A gpt2 model's shape over its preset's.
    #[command(flatten)]
    pub gpt2: pipe_stages::transformer::Gpt2Shape,
    /// Samples per step (windows, for a language model).
    #[arg(long, default_value_t = 256)]
    pub batch: usize,
    /// Compute threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// SGD momentum (0: plain SGD).
    #[arg(long, default_value_t = 0.0)]
    pub momentum: f32,
    /// Optimizer: sgd (learning rate 1e-3, --momentum), or adamw as GPT-2 trains (learning
    /// rate 6e-4, betas 0.9 and 0.95, weight decay 0.1).
    #[arg(long, default_value = "sgd")]
    pub optimizer: crate::mfu::MfuOptimizer,
    /// Also time this many steps operation by operation (the device waited for after each),
    /// on a fresh backend after the measurement: where a step's time goes.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1000))]
    pub breakdown: u64,
    /// Compute backend: cpu, or cuda (device 0; builds with `--features cuda`).
    #[arg(long, default_value = "cpu", value_parser = BackendParser)]
    pub backend: BackendKind,
    /// Precision of the matrix products: f32, tf32 or bf16 (cuda only), or bf16x6 or bf16x3
    /// (cpu with AMX only).
    #[arg(long, default_value = "f32", value_parser = |s: &str| s.parse::<Precision>())]
    pub precision: Precision,
    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE", value_parser = pipe_stages::outputs::output_file)]
    pub json: Option<PathBuf>,
}

impl MfuArgs {
    /// The benchmark the flags describe, checked: positive sizes, counts within
    /// [`pipe_stages::limits::MAX_BENCH_ITERATIONS`], threads this machine has, a model the
    /// batch fits, and a precision the backend takes.
    ///
    /// # Errors
    /// Bad input naming the flag.
    pub fn config(&self) -> Result<crate::mfu::MfuConfig, ExperimentError> {
        use pipe_stages::limits::{Machine, check_threads};
        if self.threads == 0 || self.batch == 0 || self.steps == 0 {
            return Err(ExperimentError::Config(
                "--threads, --batch and --steps must be positive".into(),
            ));
        }
        check_counts(&[("--steps", self.steps as u64)])?;
        check_threads(self.threads as u64, &Machine::detect())?;
        let spec = crate::mfu::measured_spec(&self.model, &self.gpt2)?;
        let model = pipe_stages::model::Model::new(&spec)?;
        model.check_microbatch(self.batch)?;
        // A shape the flags give can be too large as a whole with every tensor in bounds:
        // the weights, their gradients and two optimizer moments are refused at the memory
        // gate before any is allocated.
        let holding = format!(
            "{} parameters' weights, gradients and two optimizer moments",
            model.param_count()
        );
        pipe_stages::limits::admit_memory(
            &pipe_stages::limits::MemoryNeed {
                bytes: model.param_count() as f64 * 16.0,
                workers: 1,
                holding: &holding,
                lower: "lower it with a smaller model (--n-layer, --n-embd, --vocab-size)",
            },
            &Machine::detect(),
        )?;
        let backend = self
            .backend
            .with_precision(self.precision)
            .map_err(ExperimentError::Config)?;
        // The optimizer's settings pass the checks `pipe train` makes of its own (a momentum
        // of NaN, infinity or past 1 diverged in the measured steps, one below 0 ran).
        self.optimizer.config(self.momentum).0.validate()?;
        Ok(crate::mfu::MfuConfig {
            model: self.model.clone(),
            gpt2: self.gpt2.clone(),
            batch: self.batch,
            threads: self.threads,
            steps: self.steps,
            warmup: 3,
            momentum: self.momentum,
            optimizer: self.optimizer,
            backend,
        })
    }
}

/// Parses `--backend`. An unknown name is reported as `unknown backend 'NAME' (cpu, cuda)`, on
/// its own rather than inside clap's "invalid value" sentence.
#[derive(Clone, Copy, Debug)]
pub struct BackendParser;

impl TypedValueParser for BackendParser {
    type Value = BackendKind;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<BackendKind, clap::Error> {
        let name = value.to_string_lossy();
        name.parse::<BackendKind>().map_err(|_| {
            clap::Error::raw(
                ErrorKind::InvalidValue,
                format!("unknown backend '{name}' (cpu, cuda)\n"),
            )
            .with_cmd(cmd)
        })
    }
}

/// Parses `--precision` (`f32`, `tf32`, `bf16`, `bf16x6`, `bf16x3`).
///
/// # Errors
/// The one-line message naming the choices.
pub fn parse_precision(s: &str) -> Result<Precision, String> {
    s.parse()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::builder::TypedValueParser;
    use std::ffi::OsStr;

    #[test]
    fn backends_parse_by_name() {
        let cmd = clap::Command::new("t");
        let parse = |s: &str| BackendParser.parse_ref(&cmd, None, OsStr::new(s));
        assert_eq!(parse("cpu").ok(), Some(BackendKind::default()));
        assert_eq!(
            parse("cuda").ok(),
            Some(BackendKind::Cuda(pipe_kernels::Precision::F32))
        );
        let err = parse("tpu")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.starts_with("error: unknown backend 'tpu' (cpu, cuda)"),
            "{err}"
        );
    }
}
