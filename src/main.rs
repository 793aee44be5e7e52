//! The `pipe` command line. It only parses arguments, has the library merge and check them into
//! a validated `RunConfig` once, wires observers (progress bar, JSON-lines log, Prometheus
//! metrics) and maps errors to exit codes: 2 for bad input, 130 or 143 for a run stopped by
//! Ctrl-C or SIGTERM, 1 for failures at run time.
//!
//! This file owns the command tree, the exit status and the process allocator (mimalloc); each
//! command lives in [`commands`], shared argument handling in [`args`], what `pipe train` and
//! `pipe worker` share in [`training`],
//! output and errors in [`output`]. The
//! launchers (threads and worker processes) and the merging of worker processes' trace parts
//! live in the library, in `pipe_stages::pipeline`.

/// Prints to standard output like `print!`, except that a reader that has gone away (`pipe
/// plan | head`) ends the program quietly instead of panicking; see [`output::write_out`].
macro_rules! out {
    ($($arg:tt)*) => { $crate::output::write_out(format_args!($($arg)*)) };
}

/// [`out!`] with a newline, like `println!`.
macro_rules! outln {
    ($($arg:tt)*) => { $crate::output::write_out(format_args!("{}\n", format_args!($($arg)*))) };
}

/// The process allocator. Training allocates and frees multi-megabyte tensors every step;
/// glibc's malloc moves its mmap threshold with them, after which a later run in the same
/// process (the small model of `pipe bench pipeline` after the large one) slowed 2.7x on heap
/// growth and trimming. mimalloc keeps freed pages for reuse per thread.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `purge_delay` option: the one before `use_numa_nodes` in the option enum of the
/// mimalloc sources libmimalloc-sys builds (its bindings name that one but not this; the
/// assertion below holds the position).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
const _: () = assert!(MI_OPTION_PURGE_DELAY + 1 == libmimalloc_sys::mi_option_use_numa_nodes);

/// How long freed memory stays with the process before mimalloc returns it to the operating
/// system, in milliseconds. mimalloc's own default (1 s in the version built) faulted memory
/// back in during `pipe bench mfu` (7,000-10,000 page faults a run against about 700 at 10 s).
/// Never returning it (-1) let a process that ends threads keep what they freed: over twenty
/// kill-and-rejoin cycles over QUIC, the adopter of the lost replica grew from 81 to 123 MB
/// resident while its live heap stayed at 26 MB (at most 32 MB). A training step reuses its
/// sizes well within 10 s; memory idle for longer goes back.
const PURGE_DELAY_MS: std::ffi::c_long = 10_000;

/// Returns what mimalloc holds freed to the operating system at once, not after its purge
/// delay ([`PURGE_DELAY_MS`], or the environment's): the library calls it where a stretch of a
/// run has let go of what it held and will not soon want it again (`pipe_stages::release`).
/// A negative delay (never purge) holds freed memory for good.
fn release_freed_memory() {
    // SAFETY: asks the allocator to collect and purge its free memory; it touches no memory
    // the program holds.
    unsafe { libmimalloc_sys::mi_collect(true) };
}

mod args;
mod commands;
mod metrics_endpoint;
mod output;
mod phases;
mod startup_view;
mod training;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

use crate::commands::{
    bench, cluster, doctor, eval, experiment, export, logits, plan, profile, sample, schedule,
    simulate, sweep, tokenize, train, worker,
};
use crate::output::bad_input;

/// Pipeline-parallel training with weight stashing.
#[derive(Parser, Debug)]
#[command(name = "pipe", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train a model.
    Train(Box<train::TrainArgs>),
    /// Run the benchmark sweep and write its report, or one benchmark (subcommands).
    Bench(Box<BenchArgs>),
    /// Print a policy's schedule (grid, text, CSV or Chrome trace).
    Schedule(schedule::ScheduleArgs),
    /// Simulate a schedule under a cost model: makespan, bubble, per-worker busy time and memory.
    Simulate(simulate::SimulateArgs),
    /// Partition a profiled model into stages and per-stage replicas.
    Plan(plan::PlanArgs),
    /// Time every layer of a model (forward, both backward halves, update) and count its sizes.
    Profile(profile::ProfileArgs),
    /// Cluster credentials for workers on separate hosts.
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// Run one worker of a pipelined run (one per host or process), over QUIC.
    Worker(Box<worker::WorkerArgs>),
    /// Test loss and accuracy of a checkpoint.
    Eval(eval::EvalArgs),
    /// Generate text from a language model's checkpoint.
    Sample(sample::SampleArgs),
    /// A language model's logits for given ids, as JSON (from a checkpoint or a Hugging Face
    /// GPT-2 directory).
    Logits(logits::LogitsArgs),
    /// Write a checkpoint's weights in another tool's layout (--format hf: transformers' GPT-2).
    Export(export::ExportArgs),
    /// Tokenize text files into shards that training streams from disk (--dataset tokens:DIR).
    Tokenize(tokenize::TokenizeArgs),
    /// Run a research experiment and write its report.
    #[command(subcommand)]
    Experiment(experiment::ExperimentCommand),
    /// Regenerate an experiment's report from its saved results.
    #[command(subcommand)]
    Report(ReportCommand),
    /// Check the machine: `pipe doctor gpu` says which GPU, driver and CUDA libraries are used.
    #[command(subcommand)]
    Doctor(doctor::DoctorCommand),
}

/// `pipe bench`: the sweep without a subcommand.
#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
struct BenchArgs {
    #[command(subcommand)]
    command: Option<BenchCommand>,
    #[command(flatten)]
    sweep: sweep::SweepArgs,
}

/// `pipe report`.
#[derive(Subcommand, Debug)]
enum ReportCommand {
    /// Regenerate the staleness experiment's REPORT.md, plots and CSV from DIR/results.json.
    Staleness(experiment::ReportArgs),
    /// Regenerate the `pipe bench` sweep's REPORT.md, plots and CSV from DIR/results.json.
    Bench(sweep::ReportBenchArgs),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Single-worker training throughput and model FLOP utilisation against the GEMM rate.
    Mfu(bench::MfuArgs),
    /// Pipelined throughput against one worker and against the simulator; executor overhead.
    Pipeline(bench::PipelineBenchArgs),
    /// The profiled plan against the uniform split on an unbalanced model, and the simulator's
    /// prediction for the plan.
    Partition(bench::PartitionBenchArgs),
    /// Tensor streaming per transport against a TCP socket; the ring all-reduce.
    Transport(bench::TransportBenchArgs),
    /// The planner's pick against a pipeline and data parallelism, as worker processes over
    /// (rate-limited) hosts, each against the simulator (`experiments/hosts/run.sh`).
    Hosts(bench::HostsBenchArgs),
    /// One process of `pipe bench transport`'s all-reduce among processes.
    #[command(hide = true)]
    AllreduceWorker(bench::AllreduceWorkerArgs),
    /// One configuration of the sweep, measured in its own process (JSON in and out).
    #[command(hide = true)]
    MeasureConfig(sweep::MeasureConfigArgs),
}

/// Parses the command line and runs the command.
fn run() -> Result<()> {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            // --help, --version
            e.print().ok();
            return Ok(());
        }
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
                    | clap::error::ErrorKind::MissingSubcommand
            ) =>
        {
            // Clap shows the command's help, whose first line is its description: the line
            // says what is missing instead, with the usage that names the choices.
            let text = e.render().to_string();
            let usage = text
                .lines()
                .find_map(|l| l.trim().strip_prefix("Usage:"))
                .map_or(String::new(), |u| format!(": {}", u.trim()));
            return Err(bad_input(format!(
                "a subcommand is missing{usage} (see --help)"
            )));
        }
        Err(e) => {
            // One line: clap's message with the lines that name what is missing or wrong
            // (the required arguments it lists below its first line), without its usage hint.
            let text = e.render().to_string();
            let parts: Vec<&str> = text
                .lines()
                .map(str::trim)
                .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
                .filter(|l| !l.is_empty() && !l.starts_with("tip:"))
                .collect();
            let line = parts.join(" ");
            let line = line.trim_start_matches("error: ");
            return Err(bad_input(if line.is_empty() {
                "invalid arguments".to_string()
            } else {
                line.to_string()
            }));
        }
    };
    // The CBLAS library the environment names for the CPU's products is part of the input:
    // one that cannot be used stops every command here, before any work.
    pipe_kernels::cblas_library().map_err(|e| bad_input(e.to_string()))?;
    match cli.command {
        Command::Train(args) => train::run(&args),
        Command::Bench(b) => match b.command {
            None => sweep::run(&b.sweep),
            Some(BenchCommand::Mfu(args)) => bench::run_mfu(&args),
            Some(BenchCommand::Pipeline(args)) => bench::run_pipeline(&args),
            Some(BenchCommand::Partition(args)) => bench::run_partition(&args),
            Some(BenchCommand::Transport(args)) => bench::run_transport(&args),
            Some(BenchCommand::Hosts(args)) => bench::run_hosts(&args),
            Some(BenchCommand::AllreduceWorker(args)) => bench::run_allreduce_worker(&args),
            Some(BenchCommand::MeasureConfig(args)) => sweep::run_measure_config(&args),
        },
        Command::Schedule(args) => schedule::run(&args),
        Command::Simulate(args) => simulate::run(&args),
        Command::Plan(args) => plan::run(&args),
        Command::Profile(args) => profile::run(&args),
        Command::Cluster(cmd) => cluster::run(&cmd),
        Command::Worker(args) => worker::run(&args),
        Command::Eval(args) => eval::run(&args),
        Command::Sample(args) => sample::run(&args),
        Command::Tokenize(args) => tokenize::run(&args),
        Command::Export(args) => export::run(&args),
        Command::Logits(args) => logits::run(&args),
        Command::Experiment(cmd) => experiment::run(&cmd),
        Command::Report(ReportCommand::Staleness(args)) => experiment::run_report(&args),
        Command::Report(ReportCommand::Bench(args)) => sweep::run_report(&args),
        Command::Doctor(cmd) => doctor::run(&cmd),
    }
}

fn main() -> ExitCode {
    // Keep freed memory for reuse a while (a training step frees and allocates the same sizes
    // again); `MIMALLOC_PURGE_DELAY` in the environment, read at mimalloc's start, stands.
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one integer option of the allocator; no memory is touched.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) };
    }
    // SAFETY: reads one integer option of the allocator.
    let delay = unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
    let holds = std::time::Duration::from_millis(u64::try_from(delay).unwrap_or(u64::MAX));
    pipe_stages::release::register(release_freed_memory, holds);
    // A library's panic on a user's file (a tokenizer.json's regex) is reported once, as an
    // error, by the call that contains it; the hook stays silent for it.
    pipe_stages::contain::quiet_contained_panics();
    // With CUDA built in and a driver present: the CUDA libraries the search chooses, put in
    // place by starting again (returns when nothing needs doing).
    doctor::use_found_cuda_libraries();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let code = output::exit_code(&e);
            // The error and its causes joined, no backtrace; a cause whose text its parent
            // already shows is not repeated. Bad input is one line; a failure at run time may
            // carry a report of several (the hang doctor's wait-for graph).
            let mut msg = String::new();
            for cause in e.chain().map(|c| c.to_string()) {
                if !msg.ends_with(&cause) {
                    if !msg.is_empty() {
                        msg.push_str(": ");
                    }
                    msg.push_str(&cause);
                }
            }
            let msg = if code == 2 {
                bounded_line(&msg.replace('\n', " "))
            } else {
                msg
            };
            eprintln!("error: {msg}");
            ExitCode::from(code)
        }
    }
}

/// Characters of a bad-input line shown at most: a message quotes what it refuses, and a
/// value of megabytes (a config line, a list on the command line) would fill the terminal.
const MAX_ERROR_CHARS: usize = 1_000;

/// `line` cut to about [`MAX_ERROR_CHARS`] characters in its middle, saying how many were
/// left out: its start names what is refused and its end why, with the quoted value between.
fn bounded_line(line: &str) -> String {
    let total = line.chars().count();
    if total <= MAX_ERROR_CHARS {
        return line.to_string();
    }
    let (head, tail) = (MAX_ERROR_CHARS * 2 / 5, MAX_ERROR_CHARS * 3 / 5);
    let start: String = line.chars().take(head).collect();
    let end: String = line.chars().skip(total - tail).collect();
    format!(
        "{start} ... ({} characters left out) ... {end}",
        total - head - tail
    )
}
