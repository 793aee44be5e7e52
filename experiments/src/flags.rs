//! The flags of `pipe bench partition`, `hosts`, `pipeline` and `transport` (and the
//! all-reduce worker `transport` starts), checked and typed into each benchmark's config
//! here, beside the benchmarks: the command line parses them and prints the reports.

use std::path::PathBuf;

use pipe_scheduler::Policy;

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
    #[arg(long, value_name = "FILE")]
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
    #[arg(long, value_name = "FILE")]
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
    #[arg(long, value_name = "FILE")]
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
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Measure only the link costs the planner charges (each transport's latency and
    /// processor time per message and per byte, over 5 rounds), cache them, and skip the
    /// streaming and all-reduce figures.
    #[arg(long)]
    pub costs_only: bool,
    /// Also write the link costs as JSON to FILE (what `pipe plan --transport-costs` reads).
    #[arg(long, value_name = "FILE")]
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
