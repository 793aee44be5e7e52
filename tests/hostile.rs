//! The hostile-input suite: one table of bad inputs across the command line, TOML configs,
//! plan files, both profile formats, IDX files, text corpora and checkpoints, each row with
//! the message it must produce and its exit code; and a table of hostile network frames
//! against the decoder every worker runs. Every row must be refused on one `error:` line, with
//! no panic, within a time bound and under an address-space limit (so that a size that is not
//! checked before allocation shows up as a crash rather than passing unnoticed).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

mod common;

/// A file a row writes before it runs, under the row's directory.
#[derive(Clone)]
enum File {
    Text(&'static str, String),
    Bytes(&'static str, Vec<u8>),
    Dir(&'static str),
    /// A FIFO in place of whatever the row's setup left there: made after the setup runs.
    Fifo(&'static str),
    /// A sparse file of this many bytes (none of them stored), in place of whatever the
    /// row's setup left there: made after the setup runs.
    Sparse(&'static str, u64),
    /// A symbolic link at the first path to the second (both in the row's directory), made
    /// after the setup runs.
    Link(&'static str, &'static str),
    /// A hard link at the first path to the second, made after the setup runs.
    HardLink(&'static str, &'static str),
}

/// One bad input: the command (`{d}` is the row's directory), the files it needs, the `pipe`
/// commands that prepare it (a checkpoint, a corpus), a needle its one error line must
/// contain, and its exit code.
struct Row {
    args: String,
    files: Vec<File>,
    setup: Vec<&'static str>,
    /// Environment variables the command runs with (not the setup's).
    env: Vec<(&'static str, &'static str)>,
    want: &'static str,
    code: i32,
}

fn row(args: &str, want: &'static str) -> Row {
    Row {
        args: args.to_string(),
        files: Vec::new(),
        setup: Vec::new(),
        env: Vec::new(),
        want,
        code: 2,
    }
}

/// A row whose `setup` commands run first (after its files are written).
fn after(setup: &[&'static str], args: &str, files: Vec<File>, want: &'static str) -> Row {
    Row {
        setup: setup.to_vec(),
        ..with(args, files, want)
    }
}

fn with(args: &str, files: Vec<File>, want: &'static str) -> Row {
    Row {
        files,
        ..row(args, want)
    }
}

fn text(name: &'static str, body: impl Into<String>) -> Vec<File> {
    vec![File::Text(name, body.into())]
}

/// A config file `c.toml` holding `body`, trained with `pipe train --config`.
fn config(body: impl Into<String>, want: &'static str) -> Row {
    with(
        "train --config {d}/c.toml --steps 1",
        text("c.toml", body),
        want,
    )
}

/// A model table with `layers` (a TOML array body) on MNIST's 784 inputs.
fn layers(layers: &str, want: &'static str) -> Row {
    config(
        format!("[model]\ninput = [784]\nlayers = [ {layers} ]\n"),
        want,
    )
}

/// A plan file `p.toml` with `body`, trained with `pipe train --plan`.
fn plan(body: &str, want: &'static str) -> Row {
    with(
        "train --plan {d}/p.toml --steps 1",
        text("p.toml", body),
        want,
    )
}

const PLAN_OK: &str = "model = \"mlp-784-1024x4-10\"\nschedule = \"pipedream\"\nmicrobatches = 4\npartition = \"0-3,4-8\"\nreplicas = [1, 1]\n";

/// A JSON profile planned with `pipe plan --profile`.
fn profile_json(body: &str, want: &'static str) -> Row {
    with(
        "plan --profile {d}/p.json --workers 2",
        text("p.json", body),
        want,
    )
}

fn layer_json(fields: &str) -> String {
    format!(
        r#"{{"layers": [{{"name": "a", "forward": 1, "backward_input": 1, "activation_bytes": 1, "param_bytes": 1{fields}}}, {{"name": "b", "forward": 1, "backward_input": 1, "activation_bytes": 1, "param_bytes": 1}}]}}"#
    )
}

/// A PipeDream graph profile planned with `pipe plan --profile`.
fn profile_graph(body: &str, want: &'static str) -> Row {
    with(
        "plan --profile {d}/g.txt --workers 2",
        text("g.txt", body),
        want,
    )
}

const GRAPH: &str = "node1 -- Input -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=100.0, parameter_size=0.000\nnode2 -- Linear -- forward_compute_time=2.000, backward_compute_time=3.000, activation_size=10.0, parameter_size=50.000\nnode3 -- ReLU -- forward_compute_time=1.000, backward_compute_time=1.000, activation_size=10.0, parameter_size=0.000\n\tnode1 -- node2\n\tnode2 -- node3\n";

/// An IDX file header: type 0x08, the dimensions, big-endian.
fn idx(dims: &[u32], body: usize) -> Vec<u8> {
    let mut b = vec![0, 0, 8, dims.len() as u8];
    for d in dims {
        b.extend(d.to_be_bytes());
    }
    b.extend(std::iter::repeat_n(0u8, body));
    b
}

/// MNIST from `{d}` whose training images file is `bytes`.
fn mnist_images(bytes: Vec<u8>, want: &'static str) -> Row {
    with(
        "train --data-dir {d} --steps 1",
        vec![File::Bytes("train-images-idx3-ubyte", bytes)],
        want,
    )
}

/// Tiny Shakespeare from `{d}` holding `bytes`.
fn corpus(bytes: Vec<u8>, want: &'static str) -> Row {
    with(
        "train --model gpt-mini --data-dir {d} --steps 1",
        vec![File::Bytes("tinyshakespeare.txt", bytes)],
        want,
    )
}

/// A checkpoint directory `{d}/ck` holding `files`, evaluated with `pipe eval`.
/// (The names in `files` are relative to `{d}`, so they start with `ck/`.)
fn checkpoint(files: Vec<(&'static str, Vec<u8>)>, want: &'static str) -> Row {
    let mut all = vec![File::Dir("ck")];
    all.extend(files.into_iter().map(|(n, b)| File::Bytes(n, b)));
    with("eval --checkpoint {d}/ck", all, want)
}

fn cli_rows() -> Vec<Row> {
    let mut rows = cli_size_rows();
    rows.extend(cli_value_rows());
    rows.extend(cli_file_and_command_rows());
    rows.extend(cli_simulate_and_bench_rows());
    rows
}

/// Counts and sizes on the command line, and requests past this machine.
fn cli_size_rows() -> Vec<Row> {
    vec![
        // Counts and sizes on the command line.
        row("train --stages 0", "stages must be at least 1"),
        row("train --replicas 0", "replicas must be at least 1"),
        row(
            "train --microbatch-size 0",
            "microbatch size must be at least 1",
        ),
        row("train --microbatches 0", "at least 1"),
        row("train --epochs 0", "epochs must be at least 1"),
        row("train --steps 0", "steps must be at least 1"),
        row(
            "train --epochs 1000000",
            "--epochs is 1000000, over the limit of 100000",
        ),
        row(
            "train --steps 99999999999",
            "--steps is 99999999999, over the limit",
        ),
        row(
            "train --threads 100000",
            "--threads is 100000, over the limit",
        ),
        row(
            "train --stages 2 --replicas 3000",
            "workers (replicas summed over stages) is 6000",
        ),
        // Refused on any host of fewer than 250 cores, and under 1 TB of memory.
        row(
            "train --stages 2 --replicas 2000",
            "workers on this host is 4000",
        ),
        row(
            "train --model mlp-784-40000x40-10",
            "the run needs an estimated",
        ),
        row(
            "profile --model mlp-784-40000x40-10",
            "the run needs an estimated",
        ),
        row(
            "train --stages 9999999999",
            "model stages (stages x chunks) is 9999999999",
        ),
        row(
            "train --stages 2000",
            "model stages (stages x chunks) is 2000",
        ),
        row(
            "train --stages 2 --microbatches 100000",
            "microbatches per update is 100000",
        ),
        row(
            "train --stages 3 --replicas 1,2",
            "lists 2 values for 3 stages",
        ),
        row(
            "train --microbatch-size 100000000",
            "over the limit of 2147483648",
        ),
        row(
            "train --stages 4 --microbatches 65536 --steps 1",
            "one update needs 4194304 samples",
        ),
    ]
}

/// Numbers out of range, names nothing knows, and layouts the schedules refuse.
fn cli_value_rows() -> Vec<Row> {
    vec![
        // Numbers that are not numbers, or not in range.
        row("train --lr 0", "learning rate must be positive"),
        row("train --lr -1", "learning rate must be positive"),
        row("train --lr 1e300", "1e300 is too large"),
        row("train --lr nan", "NaN is not a finite number"),
        row("train --lr inf", "inf is not a finite number"),
        row("train --lr abc", "'abc' is not a number"),
        row("train --momentum 1.5", "momentum must be in [0, 1)"),
        row("train --weight-decay -1", "weight decay must be >= 0"),
        row(
            "train --stages 2 --stall-timeout 0",
            "stall timeout must be above 0",
        ),
        row(
            "train --stages 2 --stall-timeout 1e9",
            "stall timeout must be above 0",
        ),
        row("train --epochs -1", "invalid value '-1'"),
        row("train --stages 99999999999999999999", "invalid value"),
        // Names.
        row("train --model nope", "unknown model preset 'nope'"),
        row(
            "train --model mlp-784",
            "needs at least an input and an output width",
        ),
        row("train --model mlp-784-0-10", "'0' is not a positive width"),
        row("train --model mlp-784--10", "is not a positive width"),
        row(
            "train --model mlp-784-1000000000-10",
            "layers.1.weight [784, 1000000000]",
        ),
        row(
            "train --model mlp-784-10x100000-10",
            "repeated layers is too many",
        ),
        row(
            "train --model mlp-784-10x9000-10x9000-10",
            "the number of layers is",
        ),
        row("train --schedule nope", "nope"),
        row("train --backend tpu", "tpu"),
        row("train --backend cuda", "CUDA"),
        row("train --transport pigeon", "pigeon"),
        row("train --placement cloud", "cloud"),
        row(
            "train --stages 2 --placement processes --transport inproc",
            "not between worker processes",
        ),
        row(
            "train --stages 2 --transport shm --fault-schedule 0:partition@3:1:1",
            "only QUIC links are cut",
        ),
        row(
            "bench allreduce-worker --mb 1 --rounds 1 --cluster /nonexistent --rank 0 --transport carrier",
            "carrier",
        ),
        row("train --wire-dtype f8", "f8"),
        row("train --dataset imagenet", "imagenet"),
        row("train --model gpt-mini --dataset mnist", "language model"),
        row("train --tie-embeddings", "gpt-* presets"),
        row("train --lr-scaling bogus", "bogus"),
        row("train --weight-prediction bogus", "bogus"),
        // Layouts the schedules refuse.
        row(
            "train --chunks 2 --stages 2",
            "needs --schedule interleaved",
        ),
        row(
            "train --schedule interleaved --stages 2 --chunks 2 --microbatches 3",
            "multiple of the stage count",
        ),
        row(
            "train --schedule zb-v --stages 2 --microbatches 2",
            "needs at least 2 x stages",
        ),
        row(
            "train --schedule interleaved --stages 2 --chunks 2 --replicas 1,2 --microbatches 2",
            "same replica count",
        ),
        row("train --stages 2 --partition 0-1,5-9", "partition"),
        row("train --stages 2 --partition 0-100", "partition"),
        row("train --stages 2 --partition banana", "partition"),
        row("train --stages 20 --model mlp-784-10-10", "stages"),
    ]
}

/// Files that are not there or not files, and the other commands' flags.
fn cli_file_and_command_rows() -> Vec<Row> {
    vec![
        // Files that are not there or not files.
        row("train --config {d}/missing.toml", "missing.toml"),
        row("train --plan {d}/missing.toml", "missing.toml"),
        row("train --data-dir {d}/nowhere --steps 1", "nowhere"),
        row("train --config /dev/zero", "a device, not a regular file"),
        row("train --config {d}", "cannot read"),
        row("eval --checkpoint {d}/nowhere", "nowhere"),
        // Other commands.
        row(
            "plan --model mlp-784-1024x4-10 --stages 0",
            "--stages must be at least 1",
        ),
        row(
            "plan --model mlp-784-1024x4-10 --workers 0",
            "--workers must be at least 1",
        ),
        row(
            "plan --model mlp-784-1024x4-10 --workers 100000",
            "over the limit of 4096",
        ),
        row(
            "plan --model mlp-784-1024x4-10 --workers 2 --microbatches 0",
            "--microbatches must be at least 1",
        ),
        row(
            "plan --model mlp-784-1024x4-10 --workers 2 --schedule interleaved",
            "is not planned",
        ),
        row(
            "plan --model mlp-784-1024x4-10 --workers 2 --bandwidth 0",
            "bandwidth",
        ),
        row("plan --workers 2", "--profile"),
        row(
            "profile --warmup 18446744073709551615",
            "--warmup is 18446744073709551615, over the limit of 10000",
        ),
        row("profile --repeats 0", "at least 1"),
        row("profile --repeats 100000", "--repeats is 100000"),
        row("profile --threads 100000", "--threads is 100000"),
        row(
            "profile --model mlp-784-1000000000-10",
            "over the limit of 2147483648",
        ),
        row("profile --microbatch-size 0", "at least 1"),
        row(
            "schedule --stages 100000 --microbatches 100000",
            "microbatches per update is 100000",
        ),
        row(
            "schedule --stages 100000",
            "model stages (stages x chunks) is 100000",
        ),
        row(
            "schedule --stages 2 --replicas 1000000",
            "workers (replicas summed over stages) is 2000000",
        ),
        row(
            "schedule --stages 8 --microbatches 60000 --updates 100",
            "microbatch passes",
        ),
        // Refused before the schedule is built (12 s and 2.4 GB before), in the words of the
        // format asked for.
        row(
            "schedule --stages 1024 --microbatches 8192 --format text",
            "the printed schedule's actions is 16777216",
        ),
        row(
            "schedule --stages 1024 --microbatches 8192 --format trace",
            "about 200 bytes each in a Chrome trace",
        ),
        row("schedule --schedule nope", "nope"),
        row("simulate --stages 0", "at least 1"),
        row(
            "simulate --forward 1e300",
            "for '--forward <FORWARD>': the time \"1e300\" is 1e300, over the limit",
        ),
        row(
            "simulate --forward 0 --backward 0",
            "the stages compute for 0 s in all",
        ),
    ]
}

/// The simulator's cost files and the size limits of `train`'s and `bench`'s flags.
fn cli_simulate_and_bench_rows() -> Vec<Row> {
    vec![
        with(
            "simulate --costs {d}/c.toml --stages 2",
            text(
                "c.toml",
                "[[stage]]\nforward = 1e-320\nbackward_input = 0\n",
            ),
            "under 1e-9 s",
        ),
        with(
            "simulate --costs {d}/c.toml --stages 1",
            text("c.toml", "bandwidth = 1e-300\n[[stage]]\nforward = 1\n"),
            "bandwidth must be at least 1 byte/s",
        ),
        with(
            "simulate --costs {d}/c.toml --stages 1",
            text("c.toml", "[[stages]]\nforward = 1\n"),
            "unknown field `stages`",
        ),
        with(
            "simulate --costs {d}/c.toml --stages 2",
            text("c.toml", "hosts = [0, 1, 0]\n[[stage]]\nforward = 1\n"),
            "3 hosts given for 2 workers",
        ),
        with(
            "simulate --costs {d}/c.toml --stages 2",
            text(
                "c.toml",
                "hosts = [0, 1]\n[between]\nbandwidth = 0\n[[stage]]\nforward = 1\n",
            ),
            "the link between hosts: bandwidth must be > 0",
        ),
        with(
            "simulate --costs {d}/c.toml --stages 2",
            text(
                "c.toml",
                "hosts = [0, 1]\n[between]\nbandwidth = 1e-300\n[[stage]]\nforward = 1\n",
            ),
            "the link between hosts: bandwidth must be at least 1 byte/s",
        ),
        with(
            "simulate --costs {d}/c.toml --stages 1 --replicas 2",
            text(
                "c.toml",
                "[[stage]]\nforward = 1\nparam_bytes = 8\nbuckets = [{ bytes = -1, ready = 0 }]\n",
            ),
            "bucket bytes must be a finite number >= 0, got -1",
        ),
        with(
            "simulate --costs {d}/c.toml --stages 1 --replicas 2",
            text(
                "c.toml",
                "[[stage]]\nforward = 1\nparam_bytes = 8\nbuckets = [{ bytes = 1e300, ready = 0 }]\n",
            ),
            "stage 0: bucket bytes is 1e300, over the limit",
        ),
        row(
            "plan --model mlp-784-1024x4-10 --workers 2 --latency 1e300",
            "the time \"1e300\" is 1e300, over the limit",
        ),
        row(
            "plan --model mlp-784-1024x4-10 --workers 2 --bandwidth 1e-300B/s",
            "must be at least 1 byte/s",
        ),
        row(
            "train --stages 2 --replicas 2 --allreduce-bucket-mb 1,0 --steps 1",
            "all-reduce bucket must be above 0 and at most 65536 MiB, or one, got '0'",
        ),
        row(
            "train --stages 2 --replicas 2 --allreduce-bucket-mb one,many --steps 1",
            "got 'many'",
        ),
        row(
            &format!(
                "train --allreduce-bucket-mb {}one --steps 1",
                "1,".repeat(1100)
            ),
            "all-reduce bucket sizes is 1101, over the limit",
        ),
        row("frobnicate", "frobnicate"),
        row(
            "train --microbatches 4611686018427387904",
            "microbatches per update is 4611686018427387904",
        ),
        row(
            "train --microbatch-size 4294967296",
            "at microbatch size 4294967296",
        ),
        row(
            "bench mfu --batch 100000000",
            "over the limit of 2147483648",
        ),
        row(
            "bench mfu --steps 18446744073709551615",
            "--steps is 18446744073709551615",
        ),
        row("bench mfu --threads 100000", "--threads is 100000"),
        row(
            "bench mfu --model gpt2 --n-layer 3000 --n-embd 8192 --n-head 1 --n-positions 64 \
             --vocab-size 64",
            "the run needs an estimated",
        ),
        row(
            "bench pipeline --updates 4000000000",
            "--updates is 4000000000",
        ),
        row("bench partition --workers 100000", "over the limit of 4096"),
        row(
            "bench partition --model mlp-64-64-10 --workers 9",
            "the uniform split needs a layer for each worker",
        ),
        row(
            "bench partition --microbatch-size 100000000",
            "over the limit of 2147483648",
        ),
        row(
            "bench transport --message-mib 100000",
            "100000 is not in 1..=1024",
        ),
        row(
            "bench transport --allreduce-workers 100000",
            "100000 is not in 2..=64",
        ),
        row(
            "bench transport --rounds 4000000000",
            "4000000000 is not in 1..=100",
        ),
    ]
}

/// Fault schedules, restart and resume flags, and the resolved run a launcher hands its worker
/// processes.
fn fault_and_launch_rows() -> Vec<Row> {
    vec![
        // Fault schedules: malformed, in process, past the run's workers.
        row(
            "train --stages 2 --transport quic --fault-schedule 1:explode@3",
            "unknown fault 'explode@3'",
        ),
        row(
            "train --stages 2 --transport quic --fault-schedule 1:exit@0",
            "the send count must be at least 1",
        ),
        row(
            "train --stages 2 --fault-schedule ,",
            "--fault-schedule: ',' lists no fault",
        ),
        row(
            "train --stages 2 --transport quic --fault-schedule 1:exit@18446744073709551616",
            "the send count '18446744073709551616' is not a whole number of sends",
        ),
        row(
            "train --stages 2 --transport quic --fault-schedule 1:exit@3,1:drop@4",
            "worker 1 already has a fault in attempt 0",
        ),
        row(
            "train --stages 2 --fault-schedule 1:exit@3",
            "exit@3 acts on a worker's process or its network, and in process that is the whole run",
        ),
        row(
            "train --fault-schedule 0:panic@3",
            "--fault-schedule injects faults into a pipeline's workers",
        ),
        row(
            "train --stages 2 --transport quic --partition 0-4,5-9 --fault-schedule 7:exit@3",
            "names worker 7, but the run has 2 workers",
        ),
        row("train --max-restarts 1001", "--max-restarts"),
        row(
            "train --resume auto",
            "--resume auto needs --checkpoint-dir",
        ),
        row(
            "train --stages 2 --transport quic --fault-schedule random:1:0",
            "the count must be 1 to 1000",
        ),
        row(
            "train --stages 2 --fault-schedule 0:freeze@3:1",
            "freeze@3:1 acts on a worker's process or its network",
        ),
        row(
            "train --stages 2 --transport quic --fault-schedule 0:partition@3:0:1",
            "cuts a link to worker 0, which worker 0 does not have",
        ),
        row(
            "train --stages 2 --transport quic --fault-schedule 0:partition@3:1",
            "unknown fault 'partition@3:1'",
        ),
        row("train --stages 2 --replan-on-restart", "--max-restarts"),
        row(
            "train --stages 2 --rejoin",
            "--rejoin takes back a lost replica, but no stage of this run has two",
        ),
        // A replacement is started by a launcher only.
        row(
            "worker --cluster {d}/absent.toml --stages 2 --replacing",
            "--launched",
        ),
        row(
            "worker --cluster {d}/absent.toml --stages 2 --max-restarts 1",
            "--max-restarts, --rejoin and --fault-schedule are pipe train's",
        ),
        // The resolved run a launcher hands its worker processes, read back and checked.
        with(
            "worker --cluster {d}/absent.toml --launched --run {d}/r.json",
            text("r.json", "{\"model_name\": 3"),
            "r.json",
        ),
        with(
            "worker --cluster {d}/absent.toml --launched --run {d}/r.json",
            text("r.json", "3"),
            "r.json: invalid type",
        ),
        // A workers' run of another format is refused naming both; a field of the wrong type
        // is named by its path.
        with(
            "worker --cluster {d}/absent.toml --launched --run {d}/r.json",
            text("r.json", "{\"format\": 99, \"run\": {}}"),
            "a workers' run of format 99, where this build reads format 1",
        ),
        with(
            "worker --cluster {d}/absent.toml --launched --run {d}/r.json",
            text("r.json", "{\"format\": 1, \"run\": 3}"),
            "r.json: run: invalid type",
        ),
        // A workers' run that is a directory, cut short, or past the size limit.
        with(
            "worker --cluster {d}/absent.toml --launched --run {d}/rdir",
            vec![File::Dir("rdir")],
            "cannot read run",
        ),
        with(
            "worker --cluster {d}/absent.toml --launched --run {d}/r.json",
            text("r.json", "{\"format\": 1, \"run\": {"),
            "r.json: EOF while parsing",
        ),
        with(
            "worker --cluster {d}/absent.toml --launched --run {d}/r.json",
            vec![File::Bytes("r.json", vec![b' '; (16 << 20) + 1])],
            "larger than the limit",
        ),
    ]
}

fn config_rows() -> Vec<Row> {
    let many: String = (0..200_000)
        .map(|_| "{ type = \"relu\" },")
        .collect::<Vec<_>>()
        .join(" ");
    let nested: String = (0..20_000)
        .map(|_| "{ type = \"relu\" },")
        .collect::<Vec<_>>()
        .join(" ");
    let mut rows = vec![
        layers(
            &format!(
                "{{ type = \"flatten\" }}, {{ type = \"sequence\", layers = [ {nested} ] }}, {{ type = \"linear\", inputs = 784, outputs = 10 }}"
            ),
            "the number of layers is 20003, over the limit of 10000",
        ),
        config("this is not toml", "c.toml"),
        config("colour = 3\n", "unknown field `colour`"),
        config("model = 42\n", "a preset name"),
        config("lr = 1e300\n", "too large"),
        config("lr = nan\n", "not a finite number"),
        config("epochs = -1\n", "epochs"),
        config("stages = \"two\"\n", "stages"),
        config("replicas = []\n", "replicas must be at least 1"),
        config("schedule = 7\n", "schedule"),
        config("eval_every = 0\n", "--eval-every must be at least 1"),
        config("eval_every = -3\n", "eval_every (line 1)"),
        config("weight_decay_groups = \"bias\"\n", "unknown variant `bias`"),
        config(
            "grad_clip = -0.5\n",
            "the gradient clipping norm must be finite and > 0",
        ),
        config("grad_clip = \"on\"\n", "grad_clip (line 1)"),
        config("data_order = \"random\"\n", "unknown variant `random`"),
        config("recompute = true\n", "recompute (line 1)"),
        config(
            "delay_correction = \"dc-asgd\"\nschedule = \"pipedream-nostash\"\nstages = 2\n",
            "pipedream-nostash stashes none",
        ),
        config(
            "delay_correction = \"dc-asgd\"\nstages = 2\ndelay_correction_strength = nan\n",
            "NaN is not a finite number",
        ),
        layers(
            r#"{ type = "flatten", foo = 1 }, { type = "linear", inputs = 784, outputs = 10 }"#,
            "layer 0: unknown key `foo` = 1",
        ),
        layers(
            r#"{ type = "flatten" }, { type = "relu", foo = 1 }, { type = "linear", inputs = 784, outputs = 10 }"#,
            "layer 1: unknown key `foo`",
        ),
        layers(
            r#"{ type = "flatten" }, { type = "linear", inputs = 784, outputs = 10, bogus = 2 }"#,
            "layer 1: `bogus` = 2: unknown field `bogus`",
        ),
        layers(
            r#"{ type = "flatten" }, { type = "linar", inputs = 784, outputs = 10 }"#,
            "layer 1: type: unknown variant `linar`",
        ),
        layers(
            r#"{ type = "flatten" }, { type = "linear", inputs = 784, outputs = -5 }"#,
            "layer 1: `outputs` = -5: invalid value",
        ),
        layers(
            r#"{ type = "flatten" }, { type = "linear", inputs = 784, outputs = "ten" }"#,
            "layer 1: `outputs` = \"ten\": invalid type",
        ),
        layers(
            r#"{ type = "flatten" }, { type = "linear", inputs = 784 }"#,
            "layer 1: missing field `outputs`",
        ),
        layers(r#"{ inputs = 784 }"#, "layer 0: missing field `type`"),
        layers(
            r#"{ type = "flatten" }, { type = "residual", layers = [ { type = "relu", foo = 1 } ] }, { type = "linear", inputs = 784, outputs = 10 }"#,
            "layer 1: unknown key `layers.0.foo`",
        ),
        layers(
            r#"{ type = "flatten" }, { type = "linear", inputs = 784, outputs = 10, init = "magic" }"#,
            "layer 1: `init` = \"magic\": unknown variant",
        ),
        layers(
            r#"{ type = "flatten" }, { type = "dropout", p = 1.5 }, { type = "linear", inputs = 784, outputs = 10 }"#,
            "layer 1",
        ),
        // TOML's nan and inf, which a JSON value would have turned into null.
        layers(
            r#"{ type = "flatten" }, { type = "dropout", p = nan }, { type = "linear", inputs = 784, outputs = 10 }"#,
            "model.layers[1].p (line 3): NaN is not a finite number",
        ),
        layers(
            r#"{ type = "flatten" }, { type = "layer_norm", features = 784, eps = -1.0 }, { type = "linear", inputs = 784, outputs = 10 }"#,
            "layer 1",
        ),
        layers(
            r#"{ type = "flatten" }, { type = "linear", inputs = 784, outputs = 20 }, { type = "linear", inputs = 30, outputs = 10 }"#,
            "layer 2",
        ),
        layers(
            r#"{ type = "flatten" }, { type = "linear", inputs = 784, outputs = 7 }"#,
            "has 7 outputs but",
        ),
        layers(
            r#"{ type = "relu" }, { type = "linear", inputs = 784, outputs = 10 }"#,
            "which its layers do not take",
        ),
        layers(
            r#"{ type = "flatten" }, { type = "linear", inputs = 784, outputs = 4000000000 }, { type = "linear", inputs = 4000000000, outputs = 10 }"#,
            "over the limit of 2147483648",
        ),
        layers("", "the model has no layers"),
        config(
            "[model]\ninput = []\nlayers = [ { type = \"flatten\" } ]\n",
            "input shape",
        ),
        config(
            "[model]\ninput = [0]\nlayers = [ { type = \"flatten\" } ]\n",
            "input shape",
        ),
        config(
            "[model]\ninput = [4294967295, 4294967295]\nlayers = [ { type = \"flatten\" } ]\n",
            "over the limit of 2147483648",
        ),
        config(
            "[model]\ninput = [784]\nlayers = [ { type = \"flatten\" } ]\ncolour = 1\n",
            "unknown field `colour`",
        ),
        config(
            "[model]\ninput = [784]\nlayers = [ { type = \"flatten\" }, { type = \"linear\", inputs = 784, outputs = 10 } ]\ntied = [ { param = \"layers.9.weight\", to = \"layers.1.weight\" } ]\n",
            "layers.9.weight",
        ),
        config(
            format!("[model]\ninput = [784]\nlayers = [ {many} ]\n"),
            "the number of layers is 200000, over the limit of 10000",
        ),
        with(
            "train --config {d}/c.toml",
            vec![File::Bytes("c.toml", vec![0xff, 0xfe, 0x00, 0x41])],
            "not UTF-8",
        ),
        with(
            "train --config {d}/c.toml",
            vec![File::Bytes("c.toml", vec![b'#'; 17 << 20])],
            "larger than the limit",
        ),
    ];
    rows.extend(synthetic_rows());
    rows
}

/// Synthetic datasets: unknown keys, shapes past the tensor bound, and one within it that
/// this host's memory cannot hold.
fn synthetic_rows() -> Vec<Row> {
    vec![
        config("[synthetic]\nshade = 1\n", "unknown field `shade`"),
        config(
            "dataset = \"synthetic\"\n[synthetic]\ntrain = 1000000000000\n",
            "synthetic samples x inputs",
        ),
        config(
            "dataset = \"synthetic\"\n[synthetic]\nhidden = 1000000000000\n",
            "synthetic inputs x hidden",
        ),
        // Within the shape bounds (2.1e9 elements), past what the suite's 8 GiB address
        // space leaves: refused before it is drawn (`pipe eval` of a checkpoint asking for
        // it passes the same gate).
        config(
            "dataset = \"synthetic\"\n[synthetic]\ntest = 2700000\n",
            "and a synthetic dataset of 2708192 samples of 784 inputs labelled by a teacher \
             of 64 hidden units), over the",
        ),
        // Two samples, but a teacher of two 8 GiB layers (each within the shape bound):
        // the teacher counts too, where the gate counted the samples alone and the teacher
        // was allocated past it.
        config(
            "dataset = \"synthetic\"\n[synthetic]\ninputs = 2\nhidden = 1073741824\n\
             classes = 2\ntrain = 1\ntest = 1\n",
            "labelled by a teacher of 1073741824 hidden units), over the",
        ),
    ]
}

fn plan_rows() -> Vec<Row> {
    let swap = |from: &str, to: &str| PLAN_OK.replace(from, to);
    vec![
        plan(
            &swap("\"pipedream\"", "\"interleaved\""),
            "schedule 'interleaved' is not planned",
        ),
        plan(&swap("\"pipedream\"", "\"zb-v\""), "is not planned"),
        plan(&swap("\"pipedream\"", "\"nope\""), "nope"),
        plan(
            &swap("[1, 1]", "[]"),
            "replicas and microbatches must be at least 1",
        ),
        plan(
            &swap("[1, 1]", "[0, 1]"),
            "replicas and microbatches must be at least 1",
        ),
        plan(
            &swap("microbatches = 4", "microbatches = 0"),
            "replicas and microbatches must be at least 1",
        ),
        plan(
            &swap("microbatches = 4", "microbatches = 100000"),
            "microbatches per update is 100000",
        ),
        plan(&swap("[1, 1]", "[5000, 1]"), "over the limit of 4096"),
        plan(
            &(PLAN_OK.to_string() + "time_per_microbatch = -1.0\n"),
            "finite number >= 0",
        ),
        plan(
            &(PLAN_OK.to_string() + "time_per_microbatch = inf\n"),
            "finite number >= 0",
        ),
        plan(
            &(PLAN_OK.to_string() + "colour = 1\n"),
            "unknown field `colour`",
        ),
        plan(&swap("mlp-784-1024x4-10", "mlp-784-10"), "partition"),
        plan(&swap("0-3,4-8", "banana"), "partition"),
        plan(&swap("0-3,4-8", "0-3,4-99"), "partition"),
        plan(
            &swap("model = \"mlp-784-1024x4-10\"\n", ""),
            "names no model",
        ),
        plan("not a plan", "p.toml"),
        plan(
            &format!("{PLAN_OK}recompute = \"full,none,full\"\n"),
            "names 3 stages, but the run has 2",
        ),
        plan(
            &format!("{PLAN_OK}recompute = \"full,sometimes\"\n"),
            "unknown recomputation 'sometimes'",
        ),
        plan(
            &format!("{PLAN_OK}hosts = [\"a\"]\n"),
            "hosts names 1 workers' hosts, the plan has 2 workers",
        ),
        plan(
            &format!("{PLAN_OK}hosts = [\"a\", \"\"]\n"),
            "a host name must have 1 to 255 characters",
        ),
        with(
            "train --plan {d}/p.toml --model mlp-784-32-10 --steps 1",
            text("p.toml", PLAN_OK),
            "was made for model",
        ),
    ]
}

/// A transport cost file `c.json` holding `body`, read by `pipe plan --transport shm`.
fn cost_file(body: &str, want: &'static str) -> Row {
    with(
        "plan --profile {d}/p.json --workers 2 --transport shm --transport-costs {d}/c.json",
        [text("p.json", many_layers(4)), text("c.json", body)]
            .into_iter()
            .flatten()
            .collect(),
        want,
    )
}

/// A cost file of one transport, `name`, whose per-message processor time is `cpu`.
fn costs_of(name: &str, cpu: &str) -> String {
    let s = |v: &str| format!(r#"{{"median": {v}, "min": {v}, "max": {v}}}"#);
    format!(
        r#"{{"transports": [{{"transport": "{name}", "rounds": 1, "latency_s": {}, "message_cpu_s": {}, "byte_cpu_s": {}, "bandwidth": null}}]}}"#,
        s("1e-5"),
        s(cpu),
        s("0")
    )
}

/// `pipe plan` of a 4-layer profile on 2 workers with the placement flags `flags`, its link
/// costs read from a file (shared memory and QUIC).
fn hosts_row(flags: &str, want: &'static str) -> Row {
    let both = costs_of("shm", "1e-6").replace(
        "]}",
        &format!(
            ", {}]}}",
            costs_of("quic", "3e-5")
                .trim_start_matches(r#"{"transports": ["#)
                .trim_end_matches("]}")
        ),
    );
    with(
        &format!("plan --profile {{d}}/p.json --workers 2 --transport-costs {{d}}/c.json {flags}"),
        [text("p.json", many_layers(4)), text("c.json", both)]
            .into_iter()
            .flatten()
            .collect(),
        want,
    )
}

/// Transport costs: the cost file and the flags that read it.
fn transport_cost_rows() -> Vec<Row> {
    vec![
        cost_file("not json", "transport cost file"),
        cost_file(
            &costs_of("shm", "-1"),
            "message_cpu_s must be a finite number >= 0, got -1",
        ),
        cost_file(
            &costs_of("inproc", "1e-6"),
            "holds no costs for transport shm",
        ),
        cost_file(
            &costs_of("shm", "1e300"),
            "message_cpu_s is 1e300, over the limit",
        ),
        // A spread whose median is outside its own min and max was printed as "(5.000-0.000)".
        cost_file(
            &costs_of("shm", "1e-6").replacen(
                r#""median": 1e-5, "min": 1e-5"#,
                r#""median": 1e-5, "min": 5e-5"#,
                1,
            ),
            "latency_s's median 0.00001 is not between its min 0.00005 and max 0.00001",
        ),
        // A cost file that is a FIFO would block forever.
        with(
            "plan --profile {d}/p.json --workers 2 --transport shm --transport-costs {d}/c.json",
            vec![File::Text("p.json", many_layers(4)), File::Fifo("c.json")],
            "a FIFO, not a regular file",
        ),
        row(
            &format!("train --recompute {}full --steps 1", "none,".repeat(1100)),
            "recompute kinds is 1101, over the limit of 1024",
        ),
        cost_file(
            &costs_of("shm", "1e-6").replace("\"rounds\"", "\"colour\": 1, \"rounds\""),
            "unknown field `colour`",
        ),
        with(
            "plan --profile {d}/p.json --workers 2 --transport auto",
            text("p.json", many_layers(4)),
            "--transport auto names no one transport",
        ),
        with(
            "plan --profile {d}/p.json --workers 2 --cost-model pipedream --transport shm",
            text("p.json", many_layers(4)),
            "belong to --cost-model default",
        ),
        row(
            "simulate --stages 2 --transport pigeon",
            "unknown transport 'pigeon'",
        ),
        hosts_row("--hosts a:2,b", "--hosts entry 'b' is not NAME:WORKERS"),
        hosts_row("--hosts a:0,b:2", "--hosts entry 'a:0' is not NAME:WORKERS"),
        hosts_row(
            "--hosts a:5000",
            "--hosts entry 'a:5000' is not NAME:WORKERS",
        ),
        hosts_row("--hosts a:1,a:1", "host 'a' is named twice"),
        hosts_row(
            "--hosts a:1",
            "the hosts take 1 workers in all, fewer than the 2",
        ),
        hosts_row(
            &format!(
                "--hosts {}",
                (0..4097)
                    .map(|i| format!("h{i}:1"))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            "--hosts lists 4097 hosts, more than 4096",
        ),
        hosts_row(
            "--hosts a:4000,b:4000",
            "--hosts places 8000 workers, more than 4096",
        ),
        hosts_row("--cluster {d}/none.toml", "none.toml"),
        hosts_row(
            "--hosts a:1,b:1 --cluster {d}/c.toml",
            "cannot be used with",
        ),
        with(
            "plan --profile {d}/p.json --workers 2 --cost-model pipedream --hosts a:1,b:1",
            text("p.json", many_layers(4)),
            "belong to --cost-model default",
        ),
        with(
            "plan --profile {d}/p.json --workers 2 --transport-costs {d}/c.json",
            [
                text("p.json", many_layers(4)),
                text("c.json", costs_of("shm", "1e-6")),
            ]
            .into_iter()
            .flatten()
            .collect(),
            "--transport-costs needs --transport",
        ),
    ]
}

/// A JSON profile of `n` equal layers.
fn many_layers(n: usize) -> String {
    let layer = r#"{"name": "l", "forward": 0.001, "backward_input": 0.002, "activation_bytes": 4096, "param_bytes": 1024}"#;
    format!("{{\"layers\": [{}]}}", vec![layer; n].join(", "))
}

fn profile_rows() -> Vec<Row> {
    vec![
        // JSON that is not an object is read as JSON, not as PipeDream's graph format.
        profile_json(r#"[{"name": "a"}]"#, "profile: invalid type"),
        with(
            "plan --profile {d}/p.json --workers 1024",
            text("p.json", many_layers(10_000)),
            "a plan's table (layers x workers) is 10240000",
        ),
        with(
            "plan --profile {d}/p.json --workers 1000",
            text("p.json", many_layers(1000)),
            "a plan's work (layers x workers^2) is 1000000000",
        ),
        with(
            "plan --profile {d}/p.json --workers 2",
            text("p.json", many_layers(10_001)),
            "the number of layers is 10001, over the limit of 10000",
        ),
        profile_json(
            &layer_json("")
                .replace("\"forward\": 1", "\"forward\": 0")
                .replace("\"backward_input\": 1", "\"backward_input\": 0"),
            "the layers take 0 s in all",
        ),
        profile_json(
            &layer_json("").replace("\"activation_bytes\": 1,", "\"activation_bytes\": 1e308,"),
            "activation_bytes is 1e308, over the limit",
        ),
        profile_json(
            &layer_json("").replace("\"forward\": 1,", "\"forward\": 1e300,"),
            "forward is 1e300, over the limit",
        ),
        profile_json(
            &layer_json("").replace("\"forward\": 1,", "\"forward\": -1,"),
            "forward must be a finite number >= 0",
        ),
        profile_json(&layer_json(", \"colour\": 3"), "colour"),
        profile_json(r#"{"layers": []}"#, "no layers"),
        profile_json(
            &layer_json("").replace("]}", "], \"edges\": [[0, 9]]}"),
            "names a layer past the last",
        ),
        profile_json(
            &layer_json("").replace("]}", "], \"edges\": [[1, 0]]}"),
            "earlier layer",
        ),
        profile_json("{\"layers\": [", "p.json"),
        profile_json(
            &layer_json("").replace(
                "{\"layers\"",
                "{\"microbatch_size\": 99999999999, \"layers\"",
            ),
            "microbatch_size",
        ),
        profile_graph(
            &GRAPH.replace(
                "activation_size=10.0, parameter_size=50",
                "activation_size=[5; -10], parameter_size=50",
            ),
            "activation_size must be a finite number >= 0, got -10",
        ),
        profile_graph(
            &GRAPH.replace("forward_compute_time=2.000", "forward_compute_time=x"),
            "is not a number",
        ),
        profile_graph(
            &GRAPH.replace("\tnode2 -- node3", "\tnode2 -- node9"),
            "unknown node node9",
        ),
        profile_graph(&(GRAPH.to_string() + "\tnode3 -- node2\n"), "cycle"),
        profile_graph(
            &GRAPH.replace(", parameter_size=50.000", ""),
            "missing parameter_size",
        ),
        profile_graph(
            &GRAPH.replace("node2 -- Linear -- ", "node2 -- "),
            "node is not",
        ),
        profile_graph(
            &GRAPH.replace("forward_compute_time=2.000", "forward_compute_time=inf"),
            "finite number >= 0",
        ),
        profile_graph(
            &GRAPH
                .replace("forward_compute_time=2.000", "forward_compute_time=0")
                .replace(
                    "forward_compute_time=1.000, backward_compute_time=1.000",
                    "forward_compute_time=0, backward_compute_time=0",
                )
                .replace("backward_compute_time=3.000", "backward_compute_time=0"),
            "the layers take 0 s in all",
        ),
    ]
}

fn data_rows() -> Vec<Row> {
    vec![
        mnist_images(vec![0, 0], "truncated"),
        mnist_images(vec![1, 2, 8, 3], "magic"),
        mnist_images(vec![0, 0, 0x0d, 3], "type code 0x0d"),
        mnist_images(vec![0, 0, 8, 9], "IDX rank 9"),
        mnist_images(
            idx(&[60000, 28, 28], 10),
            "truncated: dimensions [60000, 28, 28]",
        ),
        mnist_images(idx(&[4, 28, 28], 4 * 28 * 28 + 5), "5 trailing bytes"),
        mnist_images(idx(&[0, 28, 28], 0), "dimension 0 is zero"),
        mnist_images(idx(&[65535, 65535, 65535], 0), "more data than allowed"),
        with(
            "train --data-dir {d} --steps 1",
            vec![File::Bytes(
                "train-images-idx3-ubyte.gz",
                vec![0x1f, 0x8b, 0, 1, 2, 3],
            )],
            "train-images-idx3-ubyte.gz",
        ),
        with(
            "train --data-dir {d} --steps 1",
            vec![
                File::Bytes("train-images-idx3-ubyte", idx(&[4, 14, 56], 4 * 14 * 56)),
                File::Bytes("train-labels-idx1-ubyte", idx(&[4], 4)),
                File::Bytes("t10k-images-idx3-ubyte", idx(&[4, 28, 28], 4 * 28 * 28)),
                File::Bytes("t10k-labels-idx1-ubyte", idx(&[4], 4)),
            ],
            "training images are",
        ),
        corpus(Vec::new(), "0 bytes; a corpus needs at least 1024"),
        corpus([0xffu8, 0xfe, 0xfd].repeat(400), "not UTF-8"),
        corpus(b"to be".to_vec(), "5 bytes; a corpus needs at least 1024"),
        corpus(vec![b'a'; 300 << 20], "larger than"),
    ]
}

fn checkpoint_rows() -> Vec<Row> {
    vec![
        checkpoint(vec![], "manifest.json"),
        checkpoint(vec![("ck/manifest.json", b"not json".to_vec())], "manifest.json"),
        checkpoint(vec![("ck/manifest.json", b"{}".to_vec())], "manifest.json"),
        checkpoint(vec![("ck/manifest.json", vec![b' '; 2 << 20])], "larger than"),
        checkpoint(
            vec![("ck/manifest.json", br#"{"format": 1, "files": [{"name": "../../etc/passwd", "bytes": 1, "sha256": "00"}]}"#.to_vec())],
            "manifest.json",
        ),
        with(
            "eval --checkpoint {d}",
            vec![File::Text("latest", "ckpt-00000001\n".into())],
            "ckpt-00000001",
        ),
        with(
            "eval --checkpoint {d}",
            vec![File::Text("latest", "../../../etc\n".into())],
            "latest",
        ),
        with(
            "train --resume {d}/ck --steps 1",
            vec![File::Dir("ck"), File::Bytes("ck/manifest.json", b"[1, 2".to_vec())],
            "manifest.json",
        ),
    ]
}

/// `gpt2-tiny` on Tiny Shakespeare, as a Hugging Face directory would hold it: every tensor's
/// name and shape (2 blocks, width 64, 64 positions, 65 characters, tied head).
fn gpt2_tiny_tensors() -> Vec<(String, Vec<usize>)> {
    let (c, v, t) = (64, 65, 64);
    let mut out = vec![
        ("transformer.wte.weight".to_string(), vec![v, c]),
        ("transformer.wpe.weight".to_string(), vec![t, c]),
    ];
    for b in 0..2 {
        for (part, shape) in [
            ("ln_1.weight", vec![c]),
            ("ln_1.bias", vec![c]),
            ("attn.c_attn.weight", vec![c, 3 * c]),
            ("attn.c_attn.bias", vec![3 * c]),
            ("attn.c_proj.weight", vec![c, c]),
            ("attn.c_proj.bias", vec![c]),
            ("ln_2.weight", vec![c]),
            ("ln_2.bias", vec![c]),
            ("mlp.c_fc.weight", vec![c, 4 * c]),
            ("mlp.c_fc.bias", vec![4 * c]),
            ("mlp.c_proj.weight", vec![4 * c, c]),
            ("mlp.c_proj.bias", vec![c]),
        ] {
            out.push((format!("transformer.h.{b}.{part}"), shape));
        }
    }
    out.push(("transformer.ln_f.weight".into(), vec![c]));
    out.push(("transformer.ln_f.bias".into(), vec![c]));
    out
}

/// A safetensors file of f32 `tensors`, each filled with 0.01 except where `value` says.
fn safetensors_of(tensors: &[(String, Vec<usize>)], value: impl Fn(&str) -> f32) -> Vec<u8> {
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(n, shape)| {
            let v = value(n);
            std::iter::repeat_n(v.to_le_bytes(), shape.iter().product())
                .flatten()
                .collect()
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&data)
        .map(|((n, shape), d)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), d)
                    .unwrap();
            (n.clone(), view)
        })
        .collect();
    safetensors::tensor::serialize(views, None).unwrap()
}

/// gpt2-tiny's `config.json`, with `edit` applied to its text.
fn hf_config(edit: impl Fn(String) -> String) -> String {
    edit(
        r#"{"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64, "n_positions": 64,
            "vocab_size": 65, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05,
            "tie_word_embeddings": true}"#
            .to_string(),
    )
}

/// `pipe train --model gpt2-tiny --init-from {d}/hf` from a directory of `config` and a
/// `model.safetensors` of `tensors` (values by `value`).
fn init_from(
    config: String,
    tensors: &[(String, Vec<usize>)],
    value: impl Fn(&str) -> f32,
    want: &'static str,
) -> Row {
    with(
        "train --model gpt2-tiny --steps 1 --threads 1 --init-from {d}/hf",
        vec![
            File::Text("hf/config.json", config),
            File::Bytes("hf/model.safetensors", safetensors_of(tensors, value)),
        ],
        want,
    )
}

/// The surfaces added with token corpora and GPT-2 weights: shards, sizes of a GPT-2,
/// Hugging Face directories, exports, logits and the optimizer.
fn newer_surface_rows() -> Vec<Row> {
    let mut rows = linked_input_and_buffer_rows();
    rows.extend(file_and_size_rows());
    rows.extend(hugging_face_rows());
    rows.extend(export_logits_and_optimizer_rows());
    rows.extend(cluster_file_rows());
    rows.extend(unasked_overwrite_and_silent_value_rows());
    rows.extend(inputs_written_over_rows());
    rows.extend(value_and_address_rows());
    rows.extend(environment_rows());
    rows.extend(report_rows());
    rows.extend(other_model_and_store_name_rows());
    rows.extend(checkpoint_dir_rows());
    rows.extend(checkpoint_pointer_rows());
    rows.extend(settings_that_do_nothing_rows());
    rows.extend(staleness_rows());
    rows.extend(hostile_tokenizer_rows());
    rows
}

/// Staleness experiments refused before their first run.
fn staleness_rows() -> Vec<Row> {
    vec![
        // A staleness experiment refused before its first run: a target that no loss meets,
        // a seed twice (two runs of one id), no policy.
        staleness(
            "target_loss = 0.15",
            "target_loss = nan",
            "target_loss = NaN: must be finite and above 0",
        ),
        staleness(
            "seeds = [1, 2, 3]",
            "seeds = [1, 2, 1]",
            "seeds lists 1 twice",
        ),
        // An optimizer's name goes into run ids and file names: a path would write outside
        // `--out` (it did, run after run, before the plots failed).
        staleness(
            "name = \"sgd-momentum\"",
            "name = \"x/../../../escaped\"",
            "optimizer name \"x/../../../escaped\": use 1 to 64 letters",
        ),
        staleness(
            "policies = [\"sequential\", \"1f1b-flush\", \"gpipe\", \"pipedream\", \"pipedream-nostash\", \"vsync\", \"2bw\"]",
            "policies = []",
            "policies is empty",
        ),
        // More samples than MNIST has were run on all of it, the report naming the figure.
        staleness(
            "train_samples = 8192",
            "train_samples = 100000000",
            "train_samples = 100000000: the dataset has 60000",
        ),
    ]
}

/// A checkpoint directory's `latest` that names no checkpoint there (its checkpoint removed
/// by hand), or is not a pointer at all: `--resume auto` started afresh without a word and
/// wrote over it.
fn checkpoint_pointer_rows() -> Vec<Row> {
    vec![
        with(
            "train --steps 1 --threads 1 --checkpoint-dir {d}/ck --resume auto",
            vec![File::Text("ck/latest", "ckpt-00000005\n".into())],
            "latest: names ckpt-00000005, which has no manifest: this run would replace it",
        ),
        with(
            "train --steps 1 --threads 1 --checkpoint-dir {d}/ck",
            vec![File::Text("ck/latest", "important data\n".into())],
            "names 'important data', not a checkpoint",
        ),
        with(
            "train --steps 1 --threads 1 --checkpoint-dir {d}/ck --resume auto",
            vec![File::Dir("ck"), File::Fifo("ck/latest")],
            "latest: is not a regular file",
        ),
        with(
            "eval --checkpoint {d}/ck",
            vec![File::Dir("ck"), File::Fifo("ck/latest")],
            "latest: is not a regular file",
        ),
    ]
}

/// Settings that would do nothing in the run given (a model without the matrices an optimizer
/// treats apart, a remedy or correction with no stale gradient to act on), and delay
/// corrections' malformed strengths.
fn settings_that_do_nothing_rows() -> Vec<Row> {
    vec![
        row(
            "train --model mlp-784-10 --optimizer muon --steps 1",
            "this model has none",
        ),
        row(
            "train --delay-correction error-feedback --steps 1",
            "sequential has none",
        ),
        row(
            "train --lr-schedule constant --warmup-steps 5 --steps 1",
            "--warmup-steps applies to a learning-rate schedule with a warm-up",
        ),
        // A remedy asks for a pipeline, and one stage of one has no stale gradient (2bw's
        // lag by design apart): the run's weights were the plain run's.
        row(
            "train --lr-scaling staleness --steps 1",
            "(lr:staleness) do nothing on one stage under pipedream",
        ),
        row(
            "train --schedule vsync --sync-warmup 5 --steps 1",
            "do nothing on one stage under vsync",
        ),
        row(
            "train --stages 2 --schedule 1f1b-flush --delay-correction error-feedback --steps 1",
            "1f1b-flush has none",
        ),
        row(
            "train --stages 2 --delay-correction error-feedback --delay-correction-strength -1 --steps 1",
            "strength must be finite and >= 0",
        ),
        row(
            "train --stages 2 --delay-correction error-feedback --delay-correction-strength NaN --steps 1",
            "NaN is not a finite number",
        ),
        row(
            "train --stages 2 --schedule pipedream-nostash --delay-correction dc-asgd --steps 1",
            "pipedream-nostash stashes none",
        ),
        row(
            "train --stages 2 --schedule gpipe --delay-correction dc-asgd-adaptive --steps 1",
            "gpipe has none",
        ),
        row(
            "train --delay-correction dc-asgd --steps 1",
            "sequential has none",
        ),
        row(
            "train --stages 2 --delay-correction dc-asgd --weight-prediction lookahead --steps 1",
            "both correct the same delay",
        ),
        row(
            "train --stages 2 --delay-correction dc-asgd --delay-correction-strength inf --steps 1",
            "inf is not a finite number",
        ),
        row(
            "train --stages 2 --delay-correction dc-asgd-fast --steps 1",
            "unknown delay correction",
        ),
    ]
}

/// Inputs reached through links by an output, outputs where the checkpoint directory goes, a
/// user's directory where a checkpoint goes, and benchmarks' buffers past the memory gate.
fn linked_input_and_buffer_rows() -> Vec<Row> {
    let earlier = "train --steps 2 --threads 1 --checkpoint-dir {d}/ck --checkpoint-every 1";
    let cfg = || text("c.toml", "epochs = 1\n");
    vec![
        with(
            "train --config {d}/c.toml --steps 1 --threads 1 --log-jsonl {d}/hard",
            [cfg(), vec![File::HardLink("hard", "c.toml")]].concat(),
            "is a file that --config",
        ),
        after(
            &[earlier],
            "train --steps 3 --threads 1 --checkpoint-dir {d}/ck --resume latest --log-jsonl {d}/outside.json",
            vec![
                File::Text("outside.json", "{}".into()),
                File::Link("ck/ckpt-00000002/extra.json", "outside.json"),
            ],
            "(the same file through a link)",
        ),
        row(
            "train --steps 1 --threads 1 --checkpoint-dir {d}/lj/ck --log-jsonl {d}/lj",
            "clash: the directory would be the file or under it",
        ),
        row(
            "train --stages 2 --steps 1 --threads 1 --checkpoint-dir {d}/ck2 --trace {d}/ck2",
            "clash",
        ),
        after(
            &[earlier],
            "train --steps 3 --threads 1 --checkpoint-dir {d}/ck --resume auto --checkpoint-every 1",
            // A user's directory under the next checkpoint's name, made after the setup.
            vec![File::Sparse("ck/ckpt-00000003/notes.txt", 10)],
            "is in the way and is not a checkpoint",
        ),
        row(
            "bench mfu --model gpt-mini --steps 1 --batch 100000",
            "give a smaller --batch",
        ),
        row(
            "bench transport --allreduce-mb 4096 --allreduce-workers 64 --rounds 1 --messages 1",
            "a smaller --allreduce-mb",
        ),
        row(
            "bench transport --message-mib 1024 --messages 100000 --rounds 1",
            "fewer --messages",
        ),
    ]
}

/// A cluster file at `cl.toml` of two ranks at `a` and `b` whose credentials are under `cl/`
/// (made by `cluster init`, relative to the file).
fn cluster_toml(a: &str, b: &str, ca: &str) -> String {
    let rank = |addr: &str, k: u32| {
        format!(
            "[[worker]]\naddr = \"{addr}\"\ncert = \"cl/rank-{k}.pem\"\nkey = \"cl/rank-{k}.key\"\n"
        )
    };
    format!("run_id = 1\nca = \"{ca}\"\n{}{}", rank(a, 0), rank(b, 1))
}

/// Cluster files and the credentials they name: FIFOs, two ranks at one address, a CA that
/// is not a certificate; `cluster init` over a cluster.
fn cluster_file_rows() -> Vec<Row> {
    let plan = |cluster: &str| {
        format!(
            "plan --profile {{d}}/p.json --workers 2 --cost-model default --cluster {{d}}/{cluster}"
        )
    };
    let profile = || text("p.json", many_layers(4));
    let init = "cluster init --workers 2 --out {d}/cl";
    vec![
        with(
            &plan("cl.toml"),
            [profile(), vec![File::Fifo("cl.toml")]].concat(),
            "a FIFO, not a regular file",
        ),
        with(
            &plan("cl.toml"),
            [
                profile(),
                text(
                    "cl.toml",
                    cluster_toml("10.0.0.1:29400", "10.0.0.1:29400", "ca.pem"),
                ),
            ]
            .concat(),
            "ranks 0 and 1 are both at 10.0.0.1:29400",
        ),
        after(
            &[init],
            "worker --cluster {d}/cl.toml --rank 0 --stages 2 --steps 1",
            text(
                "cl.toml",
                cluster_toml("127.0.0.1:0", "127.0.0.1:0", "cl/rank-0.key"),
            ),
            "cl/rank-0.key",
        ),
        // An address that is not this host's (TEST-NET-1), and a run that is no pipeline.
        after(
            &[init],
            "worker --cluster {d}/cl.toml --rank 0 --stages 2 --steps 1",
            text(
                "cl.toml",
                cluster_toml("192.0.2.1:29400", "127.0.0.1:0", "cl/ca.pem"),
            ),
            "cannot listen at 192.0.2.1:29400: it is not an address of this host",
        ),
        after(
            &[init],
            "worker --cluster {d}/cl.toml --rank 0 --stages 1 --steps 1",
            text(
                "cl.toml",
                cluster_toml("127.0.0.1:0", "127.0.0.1:0", "cl/ca.pem"),
            ),
            "this run is one worker training the whole model",
        ),
        after(
            &[init],
            "worker --cluster {d}/cl.toml --rank 0 --stages 2 --steps 1",
            [
                text(
                    "cl.toml",
                    cluster_toml("127.0.0.1:0", "127.0.0.1:0", "ca.pem"),
                ),
                vec![File::Fifo("ca.pem")],
            ]
            .concat(),
            "a FIFO, not a regular file",
        ),
        after(
            &[init],
            "cluster init --workers 1 --out {d}/cl",
            Vec::new(),
            "is not empty",
        ),
        // Rank 0's key swapped for rank 1's: the certificate and key do not match.
        after(
            &[init],
            "worker --cluster {d}/cl.toml --rank 0 --stages 2 --steps 1",
            text(
                "cl.toml",
                cluster_toml("127.0.0.1:0", "127.0.0.1:0", "cl/ca.pem").replacen(
                    "cl/rank-0.key",
                    "cl/rank-1.key",
                    1,
                ),
            ),
            "this rank's certificate and key, from the cluster's files",
        ),
        // Another cluster's CA: this rank's certificate is not one it signed.
        after(
            &[init, "cluster init --workers 2 --out {d}/other"],
            "worker --cluster {d}/cl.toml --rank 0 --stages 2 --steps 1",
            text(
                "cl.toml",
                cluster_toml("127.0.0.1:0", "127.0.0.1:0", "other/ca.pem"),
            ),
            "this rank's certificate is not one the cluster's CA signed",
        ),
        // A cluster file with more ranks than the plan has workers.
        with(
            &plan("cl.toml"),
            [
                profile(),
                text(
                    "cl.toml",
                    cluster_toml("127.0.0.1:0", "127.0.0.1:0", "cl/ca.pem")
                        + "[[worker]]\naddr = \"127.0.0.2:0\"\ncert = \"cl/rank-1.pem\"\nkey = \"cl/rank-1.key\"\n",
                ),
            ]
            .concat(),
            "the cluster file has 3 ranks and the plan 2 workers",
        ),
        // --force over a directory of the user's (a home directory given by mistake).
        with(
            "cluster init --workers 2 --out {d}/home --force",
            text("home/notes.txt", "mine"),
            "holds notes.txt, which is not a file of a cluster",
        ),
        // A cluster written over a file of the user's.
        with(
            "cluster init --workers 2 --out {d}/notes --force",
            text("notes", "mine"),
            "notes: not a directory",
        ),
        row(
            "cluster init --workers 2 --addrs 10.0.0.1:1,10.0.0.1:1 --out {d}/two",
            "ranks 0 and 1 are both at 10.0.0.1:1",
        ),
        // A plan `pipe plan` would write that `pipe train --plan` then refuses.
        with(
            &plan("cl.toml"),
            [
                profile(),
                text(
                    "cl.toml",
                    cluster_toml("10.0.0.1:1", "10.0.0.2:1", "ca.pem")
                        + "[[worker]]\naddr = \"10.0.0.3:1\"\ncert = \"c\"\nkey = \"k\"\n",
                ),
            ]
            .concat(),
            "the cluster file has 3 ranks and the plan 2 workers",
        ),
        hosts_row(
            &format!("--hosts {}:1,b:1", "h".repeat(256)),
            "a host name must have 1 to 255 characters, got 256",
        ),
    ]
}

/// Outputs a command was not asked to overwrite, and values that did nothing or went
/// through unchecked.
fn unasked_overwrite_and_silent_value_rows() -> Vec<Row> {
    let earlier = "train --steps 2 --threads 1 --checkpoint-dir {d}/ck --checkpoint-every 1";
    let gpt2_ckpt = "train --model gpt2-tiny --steps 1 --threads 1 --checkpoint-dir {d}/ck";
    vec![
        after(
            &[earlier],
            "train --steps 1 --threads 1 --checkpoint-dir {d}/ck",
            Vec::new(),
            "holds another run's checkpoints (latest: ckpt-00000002)",
        ),
        after(
            &[earlier],
            "train --seed-checkpoint --checkpoint-dir {d}/ck",
            Vec::new(),
            "continue that run with --resume auto",
        ),
        after(
            &[earlier],
            "train --steps 3 --threads 1 --checkpoint-dir {d}/ck --resume {d}/ck/ckpt-00000001",
            Vec::new(),
            "is not the latest checkpoint",
        ),
        after(
            &[gpt2_ckpt],
            "export --checkpoint {d}/ck --format hf --out {d}/out --tokenizer {d}/tok.json",
            text_file("tok.json", "{ not a tokenizer".into()),
            "tok.json",
        ),
        // A checkpoint's weights of 10 GB (sparse), its manifest unchanged: refused by the
        // model's size before they are read or digested.
        after(
            &[gpt2_ckpt],
            "eval --checkpoint {d}/ck",
            vec![File::Sparse(
                "ck/ckpt-00000001/weights.safetensors",
                10 << 30,
            )],
            "weights.safetensors: larger than the 1596672 bytes the model's weights.safetensors can take",
        ),
        Row {
            code: 1,
            ..row(
                "train --stages 2 --delay-correction error-feedback \
                 --delay-correction-strength 1e30 --steps 3 --threads 1",
                "is not finite at update",
            )
        },
        row(
            "train --stages 2 --delay-correction-strength 0.5 --steps 1",
            "this run has none: give one with --delay-correction",
        ),
        // Settings that would do nothing in the run they are given to.
        row(
            "train --optimizer adamw --momentum 0.5 --steps 1",
            "--momentum applies to the optimizers sgd, muon; this run's is adamw",
        ),
        row(
            "train --eps 1e-8 --steps 1",
            "--eps applies to the optimizers adam, adamw, muon; this run's is sgd",
        ),
        row(
            "train --stages 2 --allreduce-dtype bf16 --steps 1",
            "--allreduce-dtype applies to a stage with two or more replicas",
        ),
        row(
            "train --replicas 2 --wire-dtype bf16 --steps 1",
            "--wire-dtype applies to activations sent between stages",
        ),
        row(
            "train --stall-timeout 5 --steps 1",
            "--stall-timeout applies to a pipeline's workers",
        ),
        row(
            "train --keep-checkpoints 3 --steps 1",
            "--keep-checkpoints needs --checkpoint-dir",
        ),
        row(
            "train --steps 1 --checkpoint-dir /dev/null",
            "--checkpoint-dir /dev/null: not a directory",
        ),
        cost_file(
            &costs_of("shm", "1e-6").replace(
                "\"bandwidth\": null",
                "\"bandwidth\": {\"median\": 1e-300, \"min\": 1e-300, \"max\": 1e-300}",
            ),
            "bandwidth must be at least 1 byte/s, got 1e-300",
        ),
        Row {
            code: 1,
            ..row(
                "train --lr 1e30 --steps 1 --threads 1",
                "is not finite at update 1",
            )
        },
        Row {
            code: 1,
            ..row(
                "train --stages 2 --lr 1e30 --steps 1 --threads 1",
                "is not finite at update 1",
            )
        },
    ]
}

/// A checkpoint directory inside what the run reads, and a user's file under the name the
/// pointer to the latest checkpoint is written to.
fn checkpoint_dir_rows() -> Vec<Row> {
    vec![
        // Checkpoints written among the corpus's shards, or in a folder inside it.
        after(
            &["tokenize --tokenizer bytes --input {d}/text --out {d}/c"],
            "train --model gpt-mini --dataset tokens:{d}/c --steps 1 --checkpoint-dir {d}/c",
            vec![File::Text(
                "text/a.txt",
                "the corpus of one document. ".repeat(200),
            )],
            "/c is /",
        ),
        after(
            &["tokenize --tokenizer bytes --input {d}/text --out {d}/c"],
            "train --model gpt-mini --dataset tokens:{d}/c --steps 1 --checkpoint-dir {d}/c/runs/a",
            vec![File::Text(
                "text/a.txt",
                "the corpus of one document. ".repeat(200),
            )],
            "/c/runs/a is inside",
        ),
        // A user's file under the name the pointer to the latest checkpoint is written to.
        with(
            "train --steps 1 --threads 1 --checkpoint-dir {d}/ck",
            text("ck/.latest.tmp", "my notes"),
            ".latest.tmp is in the way",
        ),
    ]
}

/// Outputs that name what the command reads or one another, an output's missing directory,
/// and bounds of the search and simulation work a command is given.
fn inputs_written_over_rows() -> Vec<Row> {
    let earlier = "train --steps 2 --threads 1 --checkpoint-dir {d}/ck --checkpoint-every 1";
    let costs = || text("c.toml", "[[stage]]\nforward = 1\nbackward_input = 2\n");
    vec![
        after(
            &[earlier],
            "train --steps 3 --threads 1 --checkpoint-dir {d}/ck --resume latest --log-jsonl {d}/ck/latest",
            Vec::new(),
            "/ck/latest would overwrite",
        ),
        after(
            &[earlier],
            "train --steps 3 --threads 1 --resume {d}/ck/ckpt-00000002 --log-jsonl {d}/ck/ckpt-00000002/state.json",
            Vec::new(),
            "ck/ckpt-00000002 names",
        ),
        with(
            "plan --profile {d}/p.json --workers 2 -o {d}/p.json",
            text("p.json", many_layers(4)),
            "/p.json would overwrite",
        ),
        with(
            "simulate --costs {d}/c.toml --stages 2 --csv {d}/c.toml",
            costs(),
            "/c.toml names: give a file outside",
        ),
        row(
            "train --steps 1 --log-jsonl {d}/missing/log.jsonl",
            "/missing cannot be used",
        ),
        with(
            "train --model gpt2 --model-config {d}/config.json --stages 2 --steps 1 --threads 1 \
             --trace {d}/config.json",
            text(
                "config.json",
                r#"{"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64, "n_positions": 64, "vocab_size": 65}"#,
            ),
            "which --model-config",
        ),
        row(
            "train --stages 2 --steps 1 --threads 1 --trace {d}/t.json --log-jsonl {d}/./t.json",
            "name the same file",
        ),
        row(
            "simulate --stages 2 --microbatches 4 --trace {d}/x --csv {d}/./x",
            "name the same file",
        ),
        row(
            "simulate --stages 1 --replicas 4096 --microbatches 1 --expand-all-reduce --updates 3",
            "the all-reduce ring steps",
        ),
        with(
            "plan --profile {d}/dense.txt --workers 4 --cost-model pipedream",
            text("dense.txt", dense_graph(400)),
            "the antichain search's work",
        ),
        // A message quotes what it refuses; a line of megabytes is cut.
        config(
            format!("lr = \"{}\"\n", "a".repeat(100_000)),
            "characters left out) ... aaa",
        ),
        row("doctor", "a subcommand is missing: pipe doctor <COMMAND>"),
        row(
            "plan --model mlp-784-1024x4-10 --workers 2 --memory 0",
            "a memory bound must be above 0",
        ),
        row(
            "worker --cluster {d}/absent.toml --stages 2 --connect-timeout 0",
            "--connect-timeout 0: give above 0",
        ),
        with(
            "tokenize --tokenizer bytes --input {d}/empty.txt --out {d}/out",
            text("empty.txt", ""),
            "data --input: holds no text to tokenize",
        ),
        with(
            "cluster init --workers 2 --out {d}/loop1",
            vec![File::Link("loop1", "loop2"), File::Link("loop2", "loop1")],
            "loop1: a symbolic link that names nothing usable",
        ),
        with(
            "train --steps 1 --threads 1 --checkpoint-dir {d}/ck",
            vec![File::Dir("ck/latest")],
            "latest is a directory, where the run writes the name of its latest checkpoint",
        ),
        with(
            "simulate --stages 2 --trace {d}/samelink --csv {d}/same.out",
            vec![File::Link("samelink", "same.out")],
            "name the same file",
        ),
    ]
}

/// Output names that are no file, thread counts of the commands that build their own
/// backend, cluster addresses that are not `host:port`, and the bounds of sweep and
/// experiment settings.
fn value_and_address_rows() -> Vec<Row> {
    let earlier = "train --steps 2 --threads 1 --checkpoint-dir {d}/ck --checkpoint-every 1";
    let gpt2_ckpt = "train --model gpt2-tiny --steps 1 --threads 1 --checkpoint-dir {d}/ck";
    let too_many = "--threads 1000000";
    vec![
        // procfs and sysfs grant root a write that making a file there refuses: once exit 1
        // after the work, naming no reason.
        row(
            "schedule --stages 2 -o /proc/self/status",
            "is in /proc or /sys, the kernel's view, where no file can be made",
        ),
        row(
            "simulate --stages 2 --csv /sys/kernel/pipe.csv",
            "its directory /sys/kernel is in /proc or /sys",
        ),
        row(
            "train --steps 1 --checkpoint-dir /proc/pipe-ck",
            "--checkpoint-dir /proc/pipe-ck: /proc is in /proc or /sys",
        ),
        row(
            "cluster init --workers 2 --out /sys/kernel/pipe-cluster",
            "/sys/kernel is in /proc or /sys",
        ),
        row(
            "bench mfu --batch 1 --steps 1 --threads 1 --model mlp-4-4-2 --json ''",
            "not a file name",
        ),
        row(
            "bench transport --costs-only --json {d}/a.json",
            "'--costs-only' cannot be used with '--json <FILE>'",
        ),
        row(
            &format!(
                "cluster init --workers 2 --out {{d}}/cl --addrs {}:1,b:2",
                "a".repeat(300)
            ),
            "host name of 1 to 255 characters",
        ),
        // Digits and dots alone are an IPv4 address or nothing: refused at once, not left to
        // a resolver and a connection timeout.
        row(
            "cluster init --workers 2 --out {d}/cl --addrs 999.1.1.1:1,b:2",
            "that is not all digits and dots",
        ),
        row(
            "bench hosts --bandwidth 1e9 --hosts 999.1.1.1",
            "--hosts: '999.1.1.1' is not a host",
        ),
        row(
            "train --model gpt2-zzz --steps 1",
            "unknown model preset 'gpt2-zzz' (the GPT-2 presets are gpt2-small and gpt2-tiny",
        ),
        with(
            "tokenize --tokenizer bytes --input {d}/fifo --out {d}/out",
            vec![File::Fifo("fifo")],
            "is not a regular file or a directory (a FIFO, socket or device)",
        ),
        row("bench mfu --momentum NaN", "momentum must be in [0, 1)"),
        row("bench mfu --momentum=-1", "momentum must be in [0, 1)"),
        staleness(
            "stages = [1, 2, 4, 8]",
            "stages = [0]",
            "stages must each be at least 1",
        ),
        staleness("stages = 8\n", "stages = 0\n", "remedies.stages is 0"),
        staleness("threads = 1\n", "threads = 100000\n", "--threads is 100000"),
        after(
            &[earlier],
            &format!("eval --checkpoint {{d}}/ck {too_many}"),
            Vec::new(),
            "over the limit of",
        ),
        after(
            &[gpt2_ckpt],
            &format!("logits --checkpoint {{d}}/ck --ids 1,2 {too_many}"),
            Vec::new(),
            "over the limit of",
        ),
        after(
            &[gpt2_ckpt],
            &format!("sample --checkpoint {{d}}/ck --tokens 2 {too_many}"),
            Vec::new(),
            "over the limit of",
        ),
        with(
            "plan --profile {d}/p.json --workers 2 --cost-model default --cluster {d}/cl.toml",
            [
                text("p.json", many_layers(4)),
                text(
                    "cl.toml",
                    cluster_toml("nonsense", "10.0.0.1:29401", "ca.pem"),
                ),
            ]
            .concat(),
            "rank 0's address 'nonsense' is not host:port",
        ),
        row(
            "cluster init --workers 2 --out {d}/cl --base-port 0",
            "--base-port 0: port 0 means any free port",
        ),
        row(
            "cluster init --workers 2 --out {d}/cl --addrs 10.0.0.1:1,:29400",
            "rank 1's address ':29400' is not host:port",
        ),
        // The sweep's child command takes its configuration as JSON: bounded as a sweep
        // file is (a microbatch of 2^64-1 panicked, 2^32-1 repeats aborted).
        row(
            r#"bench measure-config --spec '{"id":"x","sweep":"s","model":"mlp-784-16-10","policy":"pipedream","transport":"inproc","chunks":1,"microbatch":18446744073709551615,"stages":2,"replicas":1,"m":2,"minibatches":2}' --options '{"warmup":0,"repeats":1,"trace":null}'"#,
            "--spec: microbatch = 18446744073709551615: between 1 and 65536",
        ),
        row(
            r#"bench measure-config --spec '{"id":"x","sweep":"s","model":"mlp-784-16-10","policy":"pipedream","transport":"inproc","chunks":1,"microbatch":32,"stages":2,"replicas":1,"m":2,"minibatches":2}' --options '{"warmup":0,"repeats":4294967295,"trace":null}'"#,
            "--options: repeats = 4294967295: between 1 and 1000",
        ),
        // A sweep file's profile concurrency: each count up to it is profiled as that many
        // workers at once (100,000 profiled for minutes at 4 GB before a refusal).
        with(
            "bench --config {d}/b.toml --out {d}/out",
            text(
                "b.toml",
                include_str!("../experiments/bench/default.toml").replacen(
                    "concurrent = 2 ",
                    "concurrent = 100000 ",
                    1,
                ),
            ),
            "profile: concurrent: limit: the number of workers on this host is 100000",
        ),
        // Worker processes serve at port + K: port 0 would hide every worker's port.
        row(
            "train --steps 1 --stages 2 --placement processes --metrics-addr 127.0.0.1:0",
            "give a port, not 0",
        ),
    ]
}

/// Results directories `pipe report` regenerates a report from, with something in them that
/// is not what a sweep or an experiment saved.
fn report_rows() -> Vec<Row> {
    let staleness = || {
        text(
            "r/results.json",
            include_str!("../experiments/staleness/gpt-mini/results.json"),
        )
    };
    vec![
        // The discussion beside the results: a FIFO hung the report forever (a link to
        // /dev/zero filled memory), and text that is not UTF-8 vanished without a word.
        with(
            "report staleness --from {d}/r",
            [staleness(), vec![File::Fifo("r/discussion.md")]].concat(),
            "cannot read the discussion",
        ),
        with(
            "report staleness --from {d}/r",
            [
                staleness(),
                vec![File::Bytes("r/discussion.md", vec![0xff, 0xfe])],
            ]
            .concat(),
            "discussion.md is not UTF-8 text",
        ),
    ]
}

/// Weights and settings that make another model than they say, and outputs placed among a
/// checkpoint store's own names.
fn other_model_and_store_name_rows() -> Vec<Row> {
    let tiny = gpt2_tiny_tensors();
    let gpt2_ckpt = "train --model gpt2-tiny --steps 1 --threads 1 --checkpoint-dir {d}/ck";
    let mnist_ckpt = "train --steps 2 --threads 1 --checkpoint-dir {d}/ck";
    vec![
        // Finite weights whose forward pass overflows: the logits were a row of JSON nulls.
        with(
            "logits --hf {d}/hf --ids 1,2",
            vec![
                File::Text("hf/config.json", hf_config(|c| c)),
                File::Bytes("hf/model.safetensors", safetensors_of(&tiny, |_| 3e38)),
            ],
            "the logits at position 0 are not finite",
        ),
        // Attention scaled otherwise: the same weights, another function (read as GPT-2's).
        init_from(
            hf_config(|c| c.replace("true}", "true, \"scale_attn_weights\": false}")),
            &tiny,
            |_| 0.01,
            "scale_attn_weights false",
        ),
        init_from(
            hf_config(|c| c.replace("true}", "true, \"scale_attn_by_inverse_layer_idx\": true}")),
            &tiny,
            |_| 0.01,
            "scale_attn_by_inverse_layer_idx true",
        ),
        after(
            &[gpt2_ckpt],
            "export --checkpoint {d}/ck --format hf --out {d}/out --tokenizer {d}/tok.json",
            text(
                "tok.json",
                include_str!("../data/tokenizers/shakespeare-bpe-1024.json"),
            ),
            "--tokenizer has a vocabulary of 1024 tokens",
        ),
        // An export into the checkpoint it reads was pruned with it by a later run.
        after(
            &[gpt2_ckpt],
            "export --checkpoint {d}/ck --format hf --out {d}/ck/ckpt-00000001/hf",
            Vec::new(),
            "the command would write its files among what it reads",
        ),
        after(
            &[gpt2_ckpt],
            "export --checkpoint {d}/ck --format hf --out {d}/ck/ckpt-00000009",
            Vec::new(),
            "the command would write its files among what it reads",
        ),
        // Another dataset's cursor was carried into this one's order without a word.
        after(
            &[mnist_ckpt],
            "train --steps 4 --threads 1 --checkpoint-dir {d}/ck --resume latest --dataset synthetic",
            Vec::new(),
            "was written by a run on mnist, and this run reads synthetic",
        ),
        // A trace or log named as the store's pointer before there is one: written over it at
        // the run's end, or renamed over by the first checkpoint.
        with(
            "train --steps 2 --stages 2 --threads 1 --checkpoint-dir {d}/ck --trace {d}/ck/latest",
            vec![File::Dir("ck")],
            "/ck/latest would overwrite",
        ),
        with(
            &format!("{mnist_ckpt} --log-jsonl {{d}}/ck/ckpt-00000002"),
            vec![File::Dir("ck")],
            "which --checkpoint-dir",
        ),
    ]
}

/// Environment variables pipe reads, set to what they cannot mean.
fn environment_rows() -> Vec<Row> {
    vec![
        Row {
            env: vec![("PIPE_AVAILABLE_MEMORY", "junk")],
            ..row(
                "train --steps 1",
                "PIPE_AVAILABLE_MEMORY=\"junk\": not a whole number",
            )
        },
        Row {
            env: vec![("PIPE_AVAILABLE_MEMORY", "1GiB")],
            ..row("train --steps 1", "PIPE_AVAILABLE_MEMORY=\"1GiB\"")
        },
        Row {
            env: vec![("PIPE_AVAILABLE_MEMORY", "-1")],
            ..row("train --steps 1", "PIPE_AVAILABLE_MEMORY=\"-1\"")
        },
        // The checkpoint writer's test hook, once passed over where malformed.
        Row {
            env: vec![("PIPE_FAULT_CHECKPOINT_PAUSE_MS", "abc")],
            ..row(
                "train --steps 1 --checkpoint-dir {d}/ck",
                "PIPE_FAULT_CHECKPOINT_PAUSE_MS=\"abc\": the test hook's pause",
            )
        },
        Row {
            env: vec![("PIPE_FAULT_CHECKPOINT_PAUSE_MS", "86400000")],
            ..row("train --steps 1 --checkpoint-dir {d}/ck", "from 0 to 60000")
        },
    ]
}

/// The byte-level BPE of the repository with `edit` applied to its JSON.
fn edited_tokenizer(edit: impl Fn(&mut serde_json::Value)) -> String {
    let plain = include_str!("../data/tokenizers/shakespeare-bpe-1024.json");
    let mut json: serde_json::Value = serde_json::from_str(plain).unwrap();
    edit(&mut json);
    json.to_string()
}

/// `tokenizer.json` files that make the tokenizers library panic or grow text without bound.
fn hostile_tokenizer_rows() -> Vec<Row> {
    // A pattern that backtracks past the regex engine's retry limit on forty `a`s and a `b`:
    // the library panics inside the encoding call.
    let backtracks = edited_tokenizer(|j| {
        j["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(a|a)+$"}, "behavior": "Isolated",
             "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
             "use_regex": true}]});
    });
    let input = || File::Text("text/a.txt", format!("{}b", "a".repeat(40)));
    // A normalizer that makes each `a` 100,000 bytes, and thirty that each double the bytes.
    let expands = edited_tokenizer(|j| {
        j["normalizer"] = serde_json::json!({"type": "Replace", "pattern": {"String": "a"},
            "content": "e".repeat(100_000)});
    });
    let doubles = edited_tokenizer(|j| {
        j["normalizer"] = serde_json::json!({"type": "Sequence",
            "normalizers": vec![serde_json::json!({"type": "ByteLevel"}); 30]});
    });
    let tokenize = "tokenize --tokenizer {d}/tok.json --input {d}/text --out {d}/c";
    vec![
        with(
            tokenize,
            vec![File::Text("tok.json", backtracks.clone()), input()],
            "the tokenizers library failed on this text with this tokenizer.json: \
             Onig: Regex search error: retry-limit-in-match over",
        ),
        // A model trained on the plain tokenizer's corpus, sampled with the hostile one.
        after(
            &[
                "tokenize --tokenizer data/tokenizers/shakespeare-bpe-1024.json --input {d}/text \
                 --out {d}/c",
                "train --model gpt-mini --dataset tokens:{d}/c --steps 1 --checkpoint-dir {d}/ck",
            ],
            "sample --checkpoint {d}/ck --tokenizer {d}/tok.json --tokens 1 --prompt \
             aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab",
            vec![
                File::Text("tok.json", backtracks),
                File::Text("text/a.txt", "the corpus of one document. ".repeat(200)),
            ],
            "retry-limit-in-match over",
        ),
        with(
            tokenize,
            vec![File::Text("tok.json", expands), input()],
            "a Replace of \"a\" by 100000 bytes alone",
        ),
        with(
            tokenize,
            vec![File::Text("tok.json", doubles), input()],
            "may make text up to 2147483648 times longer (ByteLevel alone: 2 times)",
        ),
    ]
}

fn file_and_size_rows() -> Vec<Row> {
    let tiny = gpt2_tiny_tensors();
    let same = |_: &str| 0.01;
    let corpus = "tokenize --tokenizer bytes --input {d}/text --out {d}/c --shard-tokens 2048";
    let text = || File::Text("text/a.txt", "the corpus of one document. ".repeat(200));
    vec![
        // A shard or an input that is a FIFO would block forever.
        after(
            &[corpus],
            "tokenize --check {d}/c",
            vec![text(), File::Fifo("c/shard-00000.tok")],
            "a FIFO, not a regular file",
        ),
        after(
            &[corpus],
            "train --model gpt-mini --dataset tokens:{d}/c --steps 1",
            vec![text(), File::Fifo("c/shard-00001.tok")],
            "shard-00001.tok: cannot read: a FIFO",
        ),
        with(
            "tokenize --tokenizer bytes --input {d}/text --out {d}/c",
            vec![text(), File::Fifo("text/b.txt")],
            "b.txt: is not a regular file",
        ),
        // Bytes have no end-of-text id, so there are no documents to pack.
        after(
            &[corpus],
            "train --model gpt-mini --dataset tokens:{d}/c --steps 1 --pack-documents",
            vec![text()],
            "--pack-documents needs documents that end with an end-of-text id",
        ),
        init_from(hf_config(|c| c), &tiny, same, "")
            .fifo_weights("model.safetensors: cannot read: a FIFO"),
        // Sizes of a GPT-2, checked before the layer list is built.
        row(
            "train --model gpt2-tiny --n-layer 4611686018427387904 --steps 1",
            "n_layer 4611686018427387904 is past the limit",
        ),
        row(
            "train --model gpt2-tiny --n-layer 1000000000 --steps 1",
            "n_layer 1000000000 is past the limit",
        ),
        row(
            "train --model gpt2-tiny --n-embd 4611686018427387904 --n-head 1 --steps 1",
            "n_embd 4611686018427387904 is past the limit",
        ),
        with(
            "train --model gpt2 --model-config {d}/config.json --steps 1",
            text_file(
                "config.json",
                hf_config(|c| c.replace("\"n_layer\": 2", "\"n_layer\": 4611686018427387904")),
            ),
            "n_layer 4611686018427387904 is past the limit",
        ),
        with(
            "train --model gpt2 --model-config {d}/config.json --steps 1",
            text_file(
                "config.json",
                hf_config(|c| c.replace("\"n_embd\": 64", "\"n_embd\": 18446744073709551615")),
            ),
            "n_embd 18446744073709551615 is past the limit",
        ),
    ]
}

/// Hugging Face directories whose `config.json` or tensors describe another model, or hold
/// a value that is not finite.
fn hugging_face_rows() -> Vec<Row> {
    let tiny = gpt2_tiny_tensors();
    let plus = |extra: &[(&str, Vec<usize>)]| {
        let mut t = tiny.clone();
        t.extend(extra.iter().map(|(n, s)| (n.to_string(), s.clone())));
        t
    };
    let same = |_: &str| 0.01;
    vec![
        // Hugging Face weights that describe or hold another model.
        init_from(
            hf_config(|c| c.replace("\"n_head\": 2", "\"n_head\": 4")),
            &tiny,
            same,
            "n_head is 4, but the model this run builds has 2",
        ),
        init_from(
            hf_config(|c| c.replace("\"n_layer\": 2", "\"n_layer\": 3")),
            &tiny,
            same,
            "n_layer is 3, but the model this run builds has 2",
        ),
        init_from(
            hf_config(|c| c.replace("true}", "false}")),
            &tiny,
            same,
            "tie_word_embeddings is false, but the model this run builds has true",
        ),
        init_from(
            hf_config(|c| c),
            &plus(&[
                ("transformer.h.2.ln_1.weight", vec![64]),
                ("transformer.h.2.ln_1.bias", vec![64]),
            ]),
            same,
            "holds transformer.h.2.ln_1.bias and 1 more tensors, which the model this run builds has no place for",
        ),
        init_from(
            hf_config(|c| c),
            &plus(&[("transformer.extra", vec![3])]),
            same,
            "holds transformer.extra, which the model this run builds has no place for",
        ),
        init_from(
            hf_config(|c| c),
            &plus(&[("lm_head.weight", vec![65, 64])]),
            |n| if n == "lm_head.weight" { 0.5 } else { 0.01 },
            "lm_head.weight that differs from transformer.wte.weight",
        ),
        init_from(
            hf_config(|c| c),
            &tiny,
            |n| {
                if n == "transformer.h.1.ln_2.bias" {
                    f32::NAN
                } else {
                    0.01
                }
            },
            "transformer.h.1.ln_2.bias holds NaN at element 0: weights must be finite",
        ),
        init_from(
            hf_config(|c| c),
            &tiny[..tiny.len() - 1],
            same,
            "has no transformer.ln_f.bias",
        ),
        with(
            "train --model gpt2-tiny --steps 1 --init-from {d}/hf",
            vec![
                File::Text("hf/config.json", hf_config(|c| c)),
                File::Bytes(
                    "hf/model.safetensors",
                    safetensors_of(&tiny, same)[..5000].to_vec(),
                ),
            ],
            "model.safetensors: not a whole safetensors file: its header describes",
        ),
        // A 10 GB shard (sparse: nothing stored) is refused by its size, before a byte is read.
        with(
            "train --model gpt2-tiny --steps 1 --init-from {d}/hf",
            vec![
                File::Text("hf/config.json", hf_config(|c| c)),
                File::Sparse("hf/model.safetensors", 10 << 30),
            ],
            "is larger than the limit of",
        ),
        // An index that names 100,001 shards is refused at once.
        with(
            "train --model gpt2-tiny --steps 1 --init-from {d}/hf",
            vec![
                File::Text("hf/config.json", hf_config(|c| c)),
                File::Text("hf/model.safetensors.index.json", {
                    let map: Vec<String> = (0..100_001)
                        .map(|i| format!("\"t{i}\": \"s{i}.safetensors\""))
                        .collect();
                    format!("{{\"weight_map\": {{{}}}}}", map.join(", "))
                }),
            ],
            "names more than 100000 shards",
        ),
        // A header length past what the model's tensors take: refused before it is read.
        with(
            "train --model gpt2-tiny --steps 1 --init-from {d}/hf",
            vec![
                File::Text("hf/config.json", hf_config(|c| c)),
                File::Bytes("hf/model.safetensors", {
                    let mut b = (1u64 << 40).to_le_bytes().to_vec();
                    b.extend_from_slice(b"{}");
                    b
                }),
            ],
            "its header would be 1099511627776 bytes (the file holds 10;",
        ),
        with(
            "logits --hf {d}/hf --ids 1",
            vec![
                File::Text("hf/config.json", hf_config(|c| c)),
                File::Text("hf/model.safetensors.index.json", "{\"weight_map\": [1".into()),
            ],
            "not a safetensors index",
        ),
        with(
            "logits --hf {d}/hf --ids 1",
            vec![
                File::Text("hf/config.json", hf_config(|c| c)),
                File::Text(
                    "hf/model.safetensors.index.json",
                    r#"{"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}}"#
                        .into(),
                ),
            ],
            "model-00001-of-00002.safetensors: cannot read",
        ),
        with(
            "train --model gpt2-tiny --steps 1 --init-from {d}/hf",
            vec![
                File::Text("hf/config.json", hf_config(|c| c)),
                File::Text(
                    "hf/model.safetensors.index.json",
                    r#"{"weight_map": {"transformer.wte.weight": "../../x.safetensors"}}"#.into(),
                ),
            ],
            "names shard \"../../x.safetensors\"",
        ),
    ]
}

/// Exports into a used directory, logits outside a language model's vocabulary, and
/// optimizer settings that would do nothing.
fn export_logits_and_optimizer_rows() -> Vec<Row> {
    let gpt2_ckpt = "train --model gpt2-tiny --steps 1 --threads 1 --checkpoint-dir {d}/ck";
    vec![
        // An export owns its directory; logits take ids of a language model's vocabulary.
        after(
            &[gpt2_ckpt],
            "export --checkpoint {d}/ck --format hf --out {d}/out",
            text_file("out/tokenizer.json", "{}".into()),
            "already holds files (tokenizer.json, ...)",
        ),
        after(
            &[gpt2_ckpt],
            "logits --checkpoint {d}/ck --ids 1,2,999",
            Vec::new(),
            "id 999 (position 2) is outside the vocabulary of 65 tokens",
        ),
        after(
            &["train --steps 1 --checkpoint-dir {d}/ck"],
            "logits --checkpoint {d}/ck --ids 1,2",
            Vec::new(),
            "not a language model",
        ),
        after(
            &[gpt2_ckpt],
            "export --checkpoint {d}/ck --format hf --out {d}/out --max-shard-size 0",
            Vec::new(),
            "a shard must hold at least one byte",
        ),
        after(
            &[gpt2_ckpt],
            "export --checkpoint {d}/ck --format hf --out {d}/out --max-shard-size 99999999999GB",
            Vec::new(),
            "past 2^64 bytes",
        ),
        after(
            &[gpt2_ckpt],
            "export --checkpoint {d}/ck --format hf --out {d}/out --max-shard-size 5XB",
            Vec::new(),
            "unknown unit",
        ),
        // A checkpoint's correction memory read as another correction's.
        after(
            &[
                "train --model mlp-784-32-10 --stages 2 --schedule 2bw --microbatches 2 --steps 2 \
               --threads 1 --delay-correction error-feedback --checkpoint-dir {d}/ck \
               --checkpoint-every 1",
            ],
            "train --model mlp-784-32-10 --stages 2 --schedule 2bw --microbatches 2 --steps 4 \
             --threads 1 --delay-correction dc-asgd-adaptive --resume {d}/ck",
            Vec::new(),
            "does not carry over to --delay-correction dc-asgd-adaptive",
        ),
        row(
            "train --weight-decay-groups biases --steps 1",
            "unknown weight-decay groups 'biases'",
        ),
        row(
            "train --eval-every 0 --steps 1",
            "--eval-every must be at least 1",
        ),
        row(
            "train --eval-every 99999999999999 --steps 1",
            "--eval-every",
        ),
        row(
            "train --grad-clip -1 --steps 1",
            "the gradient clipping norm must be finite and > 0",
        ),
        row(
            "train --grad-clip NaN --steps 1",
            "NaN is not a finite number",
        ),
        row(
            "train --grad-clip inf --steps 1",
            "inf is not a finite number",
        ),
        row(
            "train --data-order random --steps 1",
            "unknown data order 'random'",
        ),
        row(
            "train --seed-checkpoint --steps 1",
            "--checkpoint-dir <DIR>",
        ),
        row(
            "train --recompute some --steps 1",
            "unknown recomputation 'some'",
        ),
        row(
            "train --stages 2 --recompute full,none,full --steps 1",
            "names 3 stages, but the run has 2",
        ),
        config("recompute = \"full,,none\"\n", "unknown recomputation ''"),
        row(
            "train --model gpt-mini --pack-documents --steps 1",
            "--pack-documents apply to a tokenized corpus",
        ),
        config(
            "pack_documents = \"yes\"\n",
            "invalid type: string \"yes\", expected a boolean",
        ),
    ]
}

/// A PipeDream graph of `k` layers in which every layer feeds every later one.
fn dense_graph(k: usize) -> String {
    let mut g = String::new();
    for i in 0..k {
        g += &format!(
            "node{i} -- L -- forward_compute_time=1.0, backward_compute_time=1.0, \
             activation_size=100.0, parameter_size=10.0\n"
        );
    }
    for i in 0..k {
        for j in i + 1..k {
            g += &format!("\tnode{i} -- node{j}\n");
        }
    }
    g
}

/// `pipe experiment staleness --quick` on the MNIST experiment's config with `from` replaced
/// by `to` (once), refused with `want` before any run.
fn staleness(from: &str, to: &str, want: &'static str) -> Row {
    let body = include_str!("../experiments/staleness/mnist.toml");
    assert!(body.contains(from), "{from}");
    with(
        "experiment staleness --quick --config {d}/s.toml --out {d}/out",
        text("s.toml", body.replacen(from, to, 1)),
        want,
    )
}

fn text_file(name: &'static str, body: String) -> Vec<File> {
    vec![File::Text(name, body)]
}

impl Row {
    /// This row with its `model.safetensors` a FIFO, refused with `want`.
    fn fifo_weights(mut self, want: &'static str) -> Self {
        self.files
            .retain(|f| !matches!(f, File::Bytes("hf/model.safetensors", _)));
        self.files.push(File::Fifo("hf/model.safetensors"));
        self.want = want;
        self
    }
}

/// Runs row `r` in `dir` (the row's own), with measured transport costs in `cache`.
fn run_row(r: &Row, dir: &Path, cache: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).unwrap();
    for f in &r.files {
        match f {
            File::Text(n, body) => write_under(dir, n, body.as_bytes()),
            File::Bytes(n, body) => write_under(dir, n, body),
            File::Dir(n) => std::fs::create_dir_all(dir.join(n)).unwrap(),
            File::Fifo(_) | File::Sparse(..) | File::Link(..) | File::HardLink(..) => {}
        }
    }
    for cmd in &r.setup {
        let args = cmd.replace("{d}", &dir.display().to_string());
        let out = Command::new(env!("CARGO_BIN_EXE_pipe"))
            .args(args.split_whitespace())
            .env("PIPE_CACHE_DIR", cache)
            .output()
            .expect("run pipe");
        assert!(out.status.success(), "setup `pipe {args}`: {out:?}");
    }
    for f in &r.files {
        if let File::Fifo(n) = f {
            let path = dir.join(n);
            let _ = std::fs::remove_file(&path);
            let made = Command::new("mkfifo").arg(&path).status().expect("mkfifo");
            assert!(made.success(), "mkfifo {}", path.display());
        }
        if let File::Sparse(n, len) = f {
            let path = dir.join(n);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).unwrap();
            }
            std::fs::File::create(&path).unwrap().set_len(*len).unwrap();
        }
        if let File::Link(at, to) | File::HardLink(at, to) = f {
            let (at, to) = (dir.join(at), dir.join(to));
            let _ = std::fs::remove_file(&at);
            if matches!(f, File::Link(..)) {
                std::os::unix::fs::symlink(&to, &at).unwrap();
            } else {
                std::fs::hard_link(&to, &at).unwrap();
            }
        }
    }
    let args = r.args.replace("{d}", &dir.display().to_string());
    // An 8 GiB address space: a size that is not checked before allocation aborts.
    let start = Instant::now();
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v 8388608; exec timeout 60 \"$0\" {args}"))
        .arg(env!("CARGO_BIN_EXE_pipe"))
        .env_remove("RUST_BACKTRACE")
        .env("PIPE_CACHE_DIR", cache)
        .envs(r.env.iter().copied())
        .output()
        .expect("run pipe");
    let took = start.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    let code = out.status.code();
    let fails = [
        (
            code != Some(r.code),
            format!("exit {code:?}, want {}", r.code),
        ),
        (lines.len() != 1, format!("{} error lines", lines.len())),
        (!err.starts_with("error: "), "no `error:` line".to_string()),
        (!err.contains(r.want), format!("no '{}'", r.want)),
        (err.contains("panicked"), "a panic".to_string()),
        (took > Duration::from_secs(30), format!("took {took:?}")),
    ];
    let why: Vec<&String> = fails
        .iter()
        .filter(|(bad, _)| *bad)
        .map(|(_, w)| w)
        .collect();
    if why.is_empty() {
        Ok(())
    } else {
        Err(format!("pipe {args}: {why:?}\n  stderr: {}", err.trim()))
    }
}

/// Writes `body` at `name` under `dir`, creating the folders between.
fn write_under(dir: &Path, name: &str, body: &[u8]) {
    let path = dir.join(name);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    std::fs::write(path, body).unwrap();
}

/// The rows that are bad input on this machine: `--backend cuda` is not where a CUDA build
/// finds a GPU.
fn usable_here(mut rows: Vec<Row>) -> Vec<Row> {
    if pipe_kernels::cuda::device_count().is_ok() {
        rows.retain(|r| !r.args.contains("--backend cuda"));
    }
    rows
}

#[test]
fn every_bad_input_is_refused_on_one_line_with_its_exit_code() {
    let tables = [
        ("cli", usable_here(cli_rows())),
        ("config", config_rows()),
        ("faults", fault_and_launch_rows()),
        ("plan", plan_rows()),
        ("transport-costs", transport_cost_rows()),
        ("profile", profile_rows()),
        ("data", data_rows()),
        ("checkpoint", checkpoint_rows()),
        ("newer-surfaces", newer_surface_rows()),
    ];
    let total: usize = tables.iter().map(|(_, rows)| rows.len()).sum();
    let mut failures = Vec::new();
    // Every row in a folder of its own; measured transport costs in one cache for the table.
    let (rows_dir, cache) = (common::fresh_dir("rows"), common::fresh_dir("cache"));
    for (name, rows) in &tables {
        for (i, r) in rows.iter().enumerate() {
            if let Err(e) = run_row(r, &rows_dir.join(format!("{name}-{i}")), &cache) {
                failures.push(e);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&rows_dir);
    eprintln!(
        "{total} bad inputs, {} not refused as expected",
        failures.len()
    );
    assert!(total >= 100, "the suite has {total} rows");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Hostile frames against the decoder every worker runs on what a peer sends. A worker that
/// receives one stops the run naming the peer and this error (exit 1: the fault is the peer's,
/// not the user's input).
#[test]
fn every_hostile_frame_is_refused_by_name() {
    use pipe_kernels::Tensor;
    use pipe_transport::frame::{self, FrameLimits, Header, WireDType};
    use pipe_transport::{Key, Kind, Message};
    const RUN: u64 = 0x5eed;
    let message = Message {
        key: Key {
            from: 1,
            to: 0,
            kind: Kind::Activation,
            stage: 0,
            index: 3,
            step: 0,
        },
        version: 0,
        tensor: Tensor::from_vec(&[2, 3], vec![1.0; 6]).unwrap(),
    };
    let good = frame::encode(&message, RUN, WireDType::F32).unwrap();
    let base: Header = frame::header_of(&message, RUN, WireDType::F32);
    let with_header = |h: &Header, payload: usize| {
        let mut out = frame::encode_header(h).unwrap();
        out.extend(std::iter::repeat_n(0u8, payload));
        out
    };
    let header = |f: &dyn Fn(&mut Header)| {
        let mut h = base.clone();
        f(&mut h);
        h
    };
    let mut long_prefix = good.clone();
    long_prefix[4..8].copy_from_slice(&100_000u32.to_le_bytes());
    let mut garbage_header = good.clone();
    for b in &mut garbage_header[8..20] {
        *b = 0xff;
    }
    // A rank the encoder refuses to write: eight dimensions of 1, the count patched to nine
    // and a ninth appended (the width of a dimension is read off the encoding itself).
    let seven = with_header(&header(&|h| h.shape = vec![1; 7]), 0);
    let mut rank_nine = with_header(&header(&|h| h.shape = vec![1; 8]), 0);
    let width = rank_nine.len() - seven.len();
    let count_at = rank_nine.len() - 8 * width - width;
    rank_nine[count_at] = 9;
    rank_nine.extend_from_within(rank_nine.len() - width..);
    let header_len = u32::from_le_bytes(rank_nine[4..8].try_into().unwrap()) + width as u32;
    rank_nine[4..8].copy_from_slice(&header_len.to_le_bytes());
    let rows: Vec<(Vec<u8>, &str)> = vec![
        (Vec::new(), "truncated"),
        (good[..5].to_vec(), "truncated"),
        (good[..12].to_vec(), "truncated"),
        (good[..good.len() - 1].to_vec(), "truncated"),
        ([good.clone(), vec![0]].concat(), "1 bytes after the end"),
        (
            [b"HTTP".as_slice(), &good[4..]].concat(),
            "not a pipe frame",
        ),
        (long_prefix, "header of 100000 bytes"),
        (garbage_header, "protocol version 65535"),
        (
            with_header(&header(&|h| h.protocol = 9), 24),
            "protocol version 9",
        ),
        (
            with_header(&header(&|h| h.run_id = 7), 24),
            "frame of run 0x7",
        ),
        (
            with_header(&header(&|h| h.kind = 9), 24),
            "unknown message kind 9",
        ),
        (rank_nine, "rank above 8"),
        (
            with_header(&header(&|h| h.shape = vec![u64::MAX, u64::MAX]), 0),
            "shape",
        ),
        (
            with_header(&header(&|h| h.shape = vec![1 << 40]), 0),
            "payload of",
        ),
        (with_header(&header(&|h| h.shape = vec![4]), 8), "truncated"),
    ];
    let limits = FrameLimits::new(RUN);
    let mut failures = Vec::new();
    for (bytes, want) in &rows {
        match frame::decode(bytes, &limits) {
            Ok(m) => failures.push(format!("accepted {:?} ({want})", m.key)),
            Err(e) if !e.to_string().contains(want) => {
                failures.push(format!("'{e}' lacks '{want}'"));
            }
            Err(_) => {}
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
