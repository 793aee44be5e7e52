//! The `pipe` binary: it trains, and bad input gets a one-line error and exit code 2.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{assert_bad_input, assert_bad_inputs, fresh_path, pipe, words};

/// Runs pipe, asserts success and returns its standard output.
#[track_caller]
fn pipe_ok(args: &[&str]) -> String {
    common::ok(&pipe(args))
}

/// A short run of a small MLP on the synthetic set.
fn small() -> Vec<&'static str> {
    words("train --dataset synthetic --model mlp-784-32-10 --epochs 1 --steps 20 --threads 1")
}

/// `pipe plan --profile PROFILE` with `more` arguments, writing the plan to `out`: its
/// standard output and the plan file it wrote.
#[track_caller]
fn plan_to(profile: &std::path::Path, more: &str, out: &std::path::Path) -> (String, String) {
    let profile = ["plan", "--profile", common::s(profile)];
    let text = pipe_ok(&[&profile[..], &words(more), &["-o", common::s(out)]].concat());
    (text, std::fs::read_to_string(out).unwrap())
}

/// `pipe train --plan PLAN` with `more` arguments; its standard output.
#[track_caller]
fn train_plan(plan: &std::path::Path, more: &str) -> String {
    pipe_ok(&[&["train", "--plan", common::s(plan)][..], &words(more)].concat())
}

#[test]
fn trains_on_synthetic_data_and_logs_jsonl() {
    let log = fresh_path("run.jsonl");
    let log_s = log.to_str().unwrap();
    let mut args = small();
    args.extend(["--log-jsonl", log_s]);
    let stdout = pipe_ok(&args);
    assert!(stdout.contains("test acc"), "{stdout}");
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps = lines.iter().filter(|v| v["kind"] == "step").count();
    assert_eq!(steps, 20);
    let epoch = lines.iter().find(|v| v["kind"] == "epoch").unwrap();
    assert!(epoch["test_accuracy"].as_f64().unwrap() > 0.0);
    let first = lines.iter().find(|v| v["kind"] == "step").unwrap();
    assert!(first["loss"].as_f64().unwrap().is_finite());
    // The phases of the start come first, as records.
    assert_eq!(lines[0]["kind"], "phase", "{text}");
}

#[test]
fn config_file_and_flag_override() {
    let cfg = fresh_path("run.toml");
    std::fs::write(
        &cfg,
        "dataset = \"synthetic\"\nepochs = 1\nsteps = 3\nthreads = 1\n\n[model]\ninput = [784]\n\
         layers = [{ type = \"linear\", inputs = 784, outputs = 16 }, { type = \"gelu\" },\n\
         { type = \"layer_norm\", features = 16 }, { type = \"linear\", inputs = 16, outputs = 10 }]\n",
    )
    .unwrap();
    let stdout = pipe_ok(&["train", "--config", cfg.to_str().unwrap(), "--steps", "2"]);
    assert!(stdout.contains("done: 2 steps"), "{stdout}");
}

#[test]
fn bad_input_exits_2_with_one_line() {
    // (arguments, what the error line says)
    let cases = [
        ("train --dataset cifar", "unknown dataset 'cifar'"),
        ("train --optimizer lamb", "unknown optimizer 'lamb'"),
        ("train --epochs -1", "--epochs"),
        ("train --epochs 0", "epochs must be at least 1"),
        ("train --microbatch-size 0", "microbatch size"),
        ("train --lr 0", "learning rate"),
        ("train --model mlp-784-0-10", "not a positive width"),
        ("train --model transformer", "unknown model preset"),
        ("train --model mlp-100-32-10", "takes 100 input features"),
        ("train --model mlp-784-32-7", "has 7 outputs"),
        (
            "train --stages 4 --replicas 2,1",
            "lists 2 values for 4 stages",
        ),
        ("train --stages 2 --schedule nope", "unknown schedule"),
        (
            "train --stages 4 --schedule interleaved --chunks 2 --microbatches 3",
            "multiple of the stage count",
        ),
        ("train --stages 2 --partition 0-2,4-5", "starts at layer 4"),
        (
            "train --stages 40",
            "cannot cut the model into 40 stages that each hold parameters: it has 5 layers",
        ),
        ("train --replicas 0", "replicas must be at least 1"),
        ("train --trace t.json", "--trace records a pipelined run"),
        ("train --stages 0", "stages must be at least 1"),
    ];
    assert_bad_inputs(&cases);
    if !cfg!(feature = "cuda") {
        assert_bad_input(&["train", "--backend", "cuda"], "built without CUDA");
    } else if pipe_kernels::cuda::device_count().is_err() {
        // A CUDA build on a machine without a driver or GPU.
        assert_bad_input(&["train", "--backend", "cuda"], "CUDA is not available");
    }
    if pipe_kernels::CpuBackend::with_precision(1, pipe_kernels::Precision::Bf16x6).is_err() {
        // A CPU without AMX tiles (on one with them, bf16x6 and bf16x3 run).
        for precision in ["bf16x6", "bf16x3"] {
            let needs = format!("--precision {precision} needs a CPU with AMX bf16 tiles");
            for command in [
                &["train", "--precision", precision][..],
                &["train", "--stages", "2", "--precision", precision],
            ] {
                assert_bad_input(command, &needs);
            }
        }
    }
    let backends = [
        ("train --backend tpu", "unknown backend"),
        (
            "train --precision bf16",
            "the cpu backend computes in f32, bf16x6 or bf16x3; --precision bf16 needs --backend cuda",
        ),
        ("train --precision fp8", "fp8"),
        (
            "bench mfu --precision tf32",
            "--precision tf32 needs --backend cuda",
        ),
        (
            "bench mfu --optimizer adam",
            "unknown optimizer 'adam' (sgd or adamw)",
        ),
        ("bench mfu --breakdown 1001", "--breakdown"),
        (
            "bench mfu --model mlp-64-10 --n-layer 2",
            "the GPT-2 shape flags (--n-layer, ...) apply to gpt2 models, not mlp-64-10",
        ),
        ("bench mfu --model gpt2", "gpt2 needs a positive n_layer"),
        (
            "bench mfu --model gpt2 --n-layer 1 --n-embd 30 --n-head 4 --n-positions 8",
            "n_embd 30 is not a multiple of n_head 4",
        ),
    ];
    assert_bad_inputs(&backends);
    if pipe_kernels::cuda::device_count().is_err() {
        // Without a usable GPU, `pipe doctor gpu` still reports the library search on stdout,
        // then fails as --backend cuda does.
        let out = pipe(&["doctor", "gpu"]);
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stdout.contains("libraries:") && stdout.contains("searched"),
            "{stdout}"
        );
        assert!(
            stdout.contains("cuBLAS") && stdout.contains("NVRTC"),
            "{stdout}"
        );
        let want = if cfg!(feature = "cuda") {
            "CUDA is not available"
        } else {
            "built without CUDA"
        };
        assert!(stderr.contains(want), "{stderr}");
    }
    assert_bad_input(&["train", "--frobnicate"], "--frobnicate");
    assert_bad_input(
        &["train", "--config", "/nonexistent/pipe.toml"],
        "cannot read config",
    );
    for (text, needle) in [
        ("epochs = [1,\n", "bad.toml"),
        ("epoch = 3\n", "unknown field"),
        (
            "[model]\ninput = [784]\nlayers = [{ type = \"linear\", inputs = 784, outputs = 5 }, \
             { type = \"linear\", inputs = 6, outputs = 10 }]\n",
            "layer 1 (linear)",
        ),
    ] {
        let bad = common::fresh_file("bad.toml", text);
        assert_bad_input(&["train", "--config", common::s(&bad)], needle);
    }
}

#[test]
fn a_cblas_library_that_cannot_be_used_exits_2_before_any_work() {
    let dir = fresh_path("cblas");
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("libcblas.so");
    std::fs::write(&text, "not a library\n").unwrap();
    // (PIPE_CBLAS, what the error line says)
    let cases = [
        ("/nonexistent/libcblas.so".to_string(), "No such file"),
        (dir.display().to_string(), "not a regular file"),
        (text.display().to_string(), "dlopen failed"),
        ("libc.so.6".to_string(), "it has no cblas_sgemm"),
    ];
    for (library, says) in cases {
        for args in [&small()[..], &["schedule"]] {
            let out = common::pipe_command(args)
                .env("PIPE_CBLAS", &library)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{library}: {err}");
            assert_eq!(err.trim().lines().count(), 1, "{err}");
            assert!(
                err.starts_with("error: PIPE_CBLAS=") && err.contains(says),
                "{err}"
            );
            assert!(out.stdout.is_empty(), "no work before the error");
        }
    }
}

#[test]
fn missing_and_corrupt_data_files_exit_2() {
    let dir = fresh_path("mnist-missing");
    std::fs::create_dir_all(&dir).unwrap();
    assert_bad_input(&["train", "--data-dir", dir.to_str().unwrap()], "missing");
    let images: [(&[u8], &str); 2] = [
        (&[0, 0, 8, 3, 0, 0, 0, 9], "truncated"),
        (b"PK\x03\x04 this is a zip", "bad magic"),
    ];
    for (bytes, needle) in images {
        let dir = common::fresh_dir("mnist-corrupt");
        std::fs::write(dir.join("train-images-idx3-ubyte"), bytes).unwrap();
        assert_bad_input(&["train", "--data-dir", dir.to_str().unwrap()], needle);
    }
}

#[test]
fn help_works() {
    let out = pipe(&["train", "--help"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("--microbatch-size"));
}

/// The quick start's promise: the default run (MLP on the embedded MNIST) reaches 97.5%.
#[test]
fn default_run_reaches_97_5_percent_on_mnist() {
    let stdout = pipe_ok(&["train"]);
    let done = stdout
        .lines()
        .find(|l| l.starts_with("done:"))
        .expect("summary line");
    let acc: f64 = done
        .split("test accuracy ")
        .nth(1)
        .and_then(|s| s.split('%').next())
        .and_then(|s| s.parse().ok())
        .expect("accuracy in summary");
    assert!(acc >= 97.5, "default run reached only {acc}%: {stdout}");
    assert_eq!(stdout.lines().filter(|l| l.starts_with("epoch")).count(), 6);
}

#[test]
fn pipelined_training_reports_stages_and_writes_a_trace() {
    let trace = fresh_path("train-trace.json");
    let mut args = small();
    args.extend([
        "--stages",
        "2",
        "--replicas",
        "2,1",
        "--schedule",
        "1f1b-flush",
        "--microbatches",
        "2",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    let text = pipe_ok(&args);
    assert!(
        text.contains("pipeline: schedule 1f1b-flush, 2 stages x replicas [2, 1], 3 workers"),
        "{text}"
    );
    assert!(
        text.contains("s0 util") && text.contains("s1 util"),
        "{text}"
    );
    assert!(
        text.contains("staleness 0.00"),
        "flush policies are synchronous: {text}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    assert!(
        events
            .iter()
            .any(|e| e["name"] == "s1F0" && e["args"]["version"] == 0)
    );
    assert!(
        events.iter().any(|e| e["name"] == "s0A0"),
        "replicas all-reduce"
    );
}

#[test]
fn schedule_prints_grid_text_csv_and_trace() {
    let out = pipe(&words(
        "schedule --schedule 1f1b-flush --stages 4 --microbatches 8 --unlowered",
    ));
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let w0 = text.lines().find(|l| l.starts_with("w0 ")).unwrap();
    let cells: Vec<&str> = w0.split_whitespace().skip(1).collect();
    assert_eq!(cells[..6], ["s0F0", "s0F1", "s0F2", "s0F3", "s0B0", "s0F4"]);

    let out = pipe(&words(
        "schedule --schedule pipedream --stages 3 --replicas 2,1,1 --microbatches 1 --format text",
    ));
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().count(), 4, "{text}");
    assert!(
        text.contains("s0A0"),
        "replicated stage all-reduces: {text}"
    );

    let out = pipe(&words("schedule --schedule vsync --stages 3 --format csv"));
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("worker,step,action,kind,stage,microbatch,update,forward_version"));
    assert!(text.lines().count() > 20);

    let path = fresh_path("schedule-trace.json");
    let schedule = words("schedule --schedule zb-h1 --stages 2 --microbatches 2 --format trace");
    let out = pipe(&[&schedule[..], &["-o", path.to_str().unwrap()]].concat());
    assert!(out.status.success());
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    assert!(events.iter().any(|e| e["name"] == "s1W0" && e["ph"] == "X"));
}

/// Four stages of gpipe on four microbatches, forwards of 1 ms and backwards of 2 ms.
const GPIPE_4X4: [&str; 11] = [
    "simulate",
    "--schedule",
    "gpipe",
    "--stages",
    "4",
    "--microbatches",
    "4",
    "--forward",
    "1ms",
    "--backward",
    "2ms",
];

#[test]
fn simulate_prints_the_summary_and_writes_a_trace() {
    let path = fresh_path("sim-trace.json");
    let out = pipe(&[&GPIPE_4X4[..], &["--trace", path.to_str().unwrap()]].concat());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    // (m + p - 1)(f + b) = 7 * 3 ms, bubble (p - 1)/(m + p - 1) = 3/7.
    assert!(text.contains("makespan 21.0000 ms"), "{text}");
    assert!(text.contains("bubble 42.86%"), "{text}");
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let first_fwd = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "s3F0")
        .unwrap();
    assert_eq!(
        first_fwd["ts"].as_f64().unwrap(),
        3000.0,
        "starts after three forwards"
    );
    assert_eq!(first_fwd["args"]["version"], 0);

    let costs = fresh_path("costs.toml");
    std::fs::write(
        &costs,
        "bandwidth = 1e9\nlatency = 0.0\n[[stage]]\nforward = 1.0\nbackward_input = 1.0\n\
         backward_weight = 1.0\nactivation_bytes = 0\n",
    )
    .unwrap();
    let zb = words("simulate --schedule zb-h1 --stages 3 --microbatches 6 --costs");
    let out = pipe(&[&zb[..], &[costs.to_str().unwrap()]].concat());
    let text = String::from_utf8_lossy(&out.stdout);
    // 3m + (p - 1) = 20 s.
    assert!(text.contains("makespan 20.0000 s"), "{text}");
}

#[test]
fn simulate_shares_fewer_cores_than_workers() {
    // On one core, the 4 x 4 gpipe run is all its work back to back: 16 x (1 + 2) ms.
    let out = pipe(&[&GPIPE_4X4[..], &["--cores", "1"]].concat());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("makespan 48.0000 ms"), "{text}");
    assert!(text.contains("on 1 shared core(s)"), "{text}");
    let bad = pipe(&["simulate", "--stages", "2", "--cores", "0"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("cores must be at least 1"));
}

#[test]
fn schedule_and_simulate_reject_bad_input_with_exit_2() {
    // (arguments, what the error line says)
    let cases = [
        ("schedule --stages 0", "--stages must be at least 1"),
        (
            "schedule --stages 4 --replicas 2,1",
            "lists 2 values for 4 stages",
        ),
        ("schedule --replicas 0", "0 replicas"),
        ("schedule --schedule nope", "unknown schedule"),
        (
            "schedule --schedule interleaved --stages 4 --microbatches 6",
            "multiple of the stage count",
        ),
        (
            "schedule --schedule 2bw --stages 4 --microbatches 1",
            "2bw needs at least 3 microbatches",
        ),
        ("schedule --chunks 2", "needs --schedule interleaved"),
        (
            "schedule --total-microbatches 7",
            "not a whole number of minibatches",
        ),
        ("simulate --forward -1", "must be a finite number >= 0"),
        (
            "simulate --bandwidth 0GB/s",
            "must be at least 1 byte/s, got 0",
        ),
        ("simulate --costs /nonexistent/costs.toml", "cost file"),
    ];
    assert_bad_inputs(&cases);
    // (the cost file, more arguments, what the error line says)
    let files = [
        ("[[stage]]\nforward = 1.0\nbogus = 2\n", "", "unknown field"),
        ("[[stage]]\nforward = -1.0\n", "", "forward must be"),
        (
            "[[stage]]\nforward = 1.0\n[[stage]]\nforward = 1.0\n",
            "--stages 3",
            "2 stage entries for 3 stages",
        ),
    ];
    for (text, more, needle) in files {
        let costs = common::fresh_file("bad-costs.toml", text);
        let args = [
            &["simulate"],
            &words(more)[..],
            &["--costs", common::s(&costs)],
        ]
        .concat();
        assert_bad_input(&args, needle);
    }
}

#[test]
fn pipedream_four_stages_two_replicas_reaches_97_5_percent_on_mnist() {
    let text = pipe_ok(&["train", "--stages", "4", "--replicas", "2"]);
    assert!(
        text.contains("schedule pipedream, 4 stages x replicas [2, 2, 2, 2], 8 workers"),
        "{text}"
    );
    // Measured staleness per stage: S - s - 1 updates for PipeDream's 1F1B.
    let last_stage_line = text.lines().rev().find(|l| l.contains("s0 util")).unwrap();
    for (s, want) in [(0, 3.0), (1, 2.0), (2, 1.0), (3, 0.0)] {
        let field = last_stage_line
            .split('|')
            .find(|p| p.trim().starts_with(&format!("s{s} ")))
            .unwrap();
        let staleness: f64 = field.split_whitespace().last().unwrap().parse().unwrap();
        assert!(
            (staleness - want).abs() < 0.05,
            "stage {s}: {staleness} in {last_stage_line}"
        );
    }
    let acc: f64 = text
        .lines()
        .find(|l| l.starts_with("done:"))
        .and_then(|l| l.split("test accuracy ").nth(1))
        .and_then(|r| r.split('%').next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(acc >= 97.5, "test accuracy {acc}% < 97.5%: {text}");
}

#[test]
fn plan_reproduces_pipedreams_vgg16_plan_and_rejects_bad_profiles() {
    let vgg = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scheduler/tests/data/pipedream/vgg16.txt"
    );
    let out = pipe(&[
        "plan",
        "--profile",
        vgg,
        "--workers",
        "4",
        "--bandwidth",
        "1GB/s",
        "--cost-model",
        "pipedream",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("175.7326 ms per microbatch"), "{text}");
    assert!(text.contains("3.32x data parallelism"), "{text}");
    assert!(text.contains("0-14        3"), "{text}");
    let bad = fresh_path("bad-profile.txt");
    std::fs::write(
        &bad,
        "node1 -- Linear -- forward_compute_time=-1, backward_compute_time=1, activation_size=1, parameter_size=1\n",
    )
    .unwrap();
    let flags = words("--workers 2 --cost-model pipedream");
    assert_bad_input(
        &[&["plan", "--profile", common::s(&bad)][..], &flags].concat(),
        "forward must be a finite number >= 0",
    );
}

#[test]
fn profile_plan_and_train_the_plan() {
    let profile = fresh_path("profile-mlp.json");
    let profile_path = profile.to_str().unwrap();
    let text = pipe_ok(&[
        "profile",
        "--model",
        "mlp-784-64-64-10",
        "--microbatch-size",
        "16",
        "--repeats",
        "3",
        "--microbatches",
        "2",
        "-o",
        profile_path,
    ]);
    assert!(text.contains("calibrated on the executor at 2"), "{text}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&profile).unwrap()).unwrap();
    assert_eq!(json["layers"].as_array().unwrap().len(), 6);
    assert_eq!(json["microbatch_size"], 16);

    let plan = fresh_path("plan-mlp.toml");
    let plan_path = plan.to_str().unwrap();
    let (text, written) = plan_to(&profile, "--stages 2 --microbatches 2", &plan);
    assert!(
        text.contains("2 stage(s) on 2 worker(s), cost model default"),
        "{text}"
    );
    assert!(text.contains("simulated:"), "{text}");
    assert!(written.contains("replicas = [1, 1]"), "{written}");

    let text = train_plan(&plan, "--steps 20 --epochs 1");
    assert!(text.contains("2 stages x replicas [1, 1]"), "{text}");
    assert!(text.contains("done: 20 steps"), "{text}");

    // A plan file with an unknown field, and one for another model.
    let bad = fresh_path("bad-plan.toml");
    std::fs::write(
        &bad,
        written.replace("schedule =", "colour = 1\nschedule ="),
    )
    .unwrap();
    assert_bad_input(
        &["train", "--plan", bad.to_str().unwrap(), "--steps", "1"],
        "colour",
    );
    let other = words("--model mlp-784-32-10 --steps 1");
    assert_bad_input(
        &[&["train", "--plan", plan_path][..], &other].concat(),
        "was made for model",
    );
}

/// `pipe plan --memory` recomputes where keeping activations does not fit, writes it into
/// the plan file, and `pipe train --plan` runs it: a profile of gpt-mini's 11 layers whose
/// blocks keep 64 MB per microbatch, or 1 MB recomputing.
#[test]
fn a_plan_under_a_memory_bound_recomputes_and_trains_so() {
    let layer = |name: &str, stash: f64, recomputed: f64| {
        format!(
            r#"{{"name": "{name}", "forward": 0.001, "backward_input": 0.002, "activation_bytes": 1e6, "param_bytes": 1e5, "stash_bytes": {stash}, "recompute_stash_bytes": {recomputed}}}"#
        )
    };
    let mut layers = vec![layer("embedding", 1e6, 1e6)];
    layers.extend((0..8).map(|_| layer("block", 64e6, 1e6)));
    layers.extend([layer("norm", 1e6, 1e6), layer("head", 1e6, 1e6)]);
    let profile = fresh_path("recompute-profile.json");
    std::fs::write(
        &profile,
        format!(
            r#"{{"model": "gpt-mini", "microbatch_size": 4, "layers": [{}]}}"#,
            layers.join(", ")
        ),
    )
    .unwrap();
    let plan = fresh_path("recompute-plan.toml");
    let (text, written) = plan_to(&profile, "--stages 2 --memory 600MB", &plan);
    assert!(text.contains("recompute full on stage(s) 0:"), "{text}");
    assert!(written.contains("recompute = \"full,none\""), "{written}");
    let text = train_plan(&plan, "--steps 1");
    assert!(text.contains("recompute per stage full,none"), "{text}");
    assert!(text.contains("done: 1 steps"), "{text}");
}

/// Transport costs are measured once and cached: `pipe bench transport --costs-only` keeps
/// them, `pipe plan --transport` reuses them, and a corrupt entry is measured again, saying
/// why. A cost file's processor time per message end is charged: at a second per message, a
/// pipeline's links cost more than data parallelism's all-reduce, and the plan changes.
#[test]
fn transport_costs_are_cached_and_change_the_plan() {
    let cache = fresh_path("transport-cache");
    let _ = std::fs::remove_dir_all(&cache);
    let run = |args: &[&str]| common::ok(&common::pipe_cached(&cache, args));
    let layer = r#"{"name": "l", "forward": 0.001, "backward_input": 0.002, "activation_bytes": 4096, "param_bytes": 1e8}"#;
    let profile = fresh_path("transport-profile.json");
    std::fs::write(
        &profile,
        format!(r#"{{"layers": [{}]}}"#, [layer; 4].join(", ")),
    )
    .unwrap();
    let profile = profile.to_str().unwrap();
    let plan = ["plan", "--profile", profile, "--workers", "2"];
    let measured = run(&["bench", "transport", "--costs-only"]);
    assert!(
        measured.contains("shm ") && measured.contains("kept in"),
        "{measured}"
    );
    let reused = run(&[&plan[..], &["--transport", "shm"]].concat());
    assert!(
        reused.contains("links charged as shm") && reused.contains("reused from"),
        "{reused}"
    );
    let entry = std::fs::read_dir(&cache)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::write(&entry, "{ half an entry").unwrap();
    let again = run(&[&plan[..], &["--transport", "shm"]].concat());
    assert!(
        again.contains("measured now (the cached entry was not used: not a cache entry"),
        "{again}"
    );
    let free = run(&plan);
    assert!(free.starts_with("2 stage(s)"), "{free}");
    let costs = fresh_path("transport-costs.json");
    let s = |v: &str| format!(r#"{{"median": {v}, "min": {v}, "max": {v}}}"#);
    std::fs::write(
        &costs,
        format!(
            r#"{{"transports": [{{"transport": "quic", "rounds": 1, "latency_s": {}, "message_cpu_s": {}, "byte_cpu_s": {}, "bandwidth": null}}]}}"#,
            s("0"),
            s("1"),
            s("0")
        ),
    )
    .unwrap();
    let dear = run(&[
        &plan[..],
        &[
            "--transport",
            "quic",
            "--transport-costs",
            costs.to_str().unwrap(),
        ],
    ]
    .concat());
    assert!(
        dear.contains("links charged as quic: 1000000.000"),
        "{dear}"
    );
    assert!(dear.contains("1 stage(s) on 2 worker(s)"), "{dear}");
}

#[test]
fn train_with_workers_plans_automatically() {
    let text = pipe_ok(&words(
        "train --model mlp-784-64-64-10 --workers 2 --microbatch-size 16 --steps 10 --epochs 1",
    ));
    assert!(text.contains("auto plan for 2 workers"), "{text}");
    assert!(text.contains("done: 10 steps"), "{text}");
    assert_bad_input(
        &[
            "train",
            "--workers",
            "2",
            "--schedule",
            "interleaved",
            "--steps",
            "1",
        ],
        "is not planned",
    );
    // A model with a tied parameter is planned on its isolated timings (its calibration
    // would put tied stages on one worker), and its plan trains.
    let plan = fresh_path("tied-plan.toml");
    let (out, _) = plan_to_model("gpt2-tiny", 2, &plan);
    assert!(out.contains("plan written to"), "{out}");
    let text = train_plan(&plan, "--steps 2 --threads 1");
    assert!(text.contains("done: 2 steps"), "{text}");
}

/// `pipe plan --model MODEL --workers W -o OUT`: its standard output and error.
fn plan_to_model(model: &str, workers: u32, out: &std::path::Path) -> (String, String) {
    let o = pipe(&words(&format!(
        "plan --model {model} --workers {workers} -o {}",
        out.display()
    )));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn plan_rejects_cyclic_and_unknown_profiles_and_impossible_requests() {
    let cyc = fresh_path("cyclic.json");
    std::fs::write(
        &cyc,
        r#"{"layers": [{"name": "a", "forward": 1, "backward_input": 1, "activation_bytes": 1, "param_bytes": 1},
                       {"name": "b", "forward": 1, "backward_input": 1, "activation_bytes": 1, "param_bytes": 1}],
            "edges": [[1, 0]]}"#,
    )
    .unwrap();
    assert_bad_input(
        &["plan", "--profile", cyc.to_str().unwrap(), "--workers", "2"],
        "does not go from an earlier layer",
    );
    let two = fresh_path("two-layers.json");
    std::fs::write(
        &two,
        r#"{"layers": [{"name": "a", "forward": 1, "backward_input": 1, "activation_bytes": 1, "param_bytes": 1e9},
                       {"name": "b", "forward": 1, "backward_input": 1, "activation_bytes": 1, "param_bytes": 1e9}]}"#,
    )
    .unwrap();
    let two = two.to_str().unwrap();
    assert_bad_input(
        &["plan", "--profile", two, "--stages", "3"],
        "cannot each hold a stage",
    );
    assert_bad_input(
        &[
            "plan",
            "--profile",
            two,
            "--workers",
            "2",
            "--memory",
            "1MB",
        ],
        "memory bound",
    );
}

#[test]
fn a_reader_that_leaves_early_ends_the_output_quietly() {
    use std::io::Read as _;
    // Far more than a pipe buffer holds, so the writer is still writing when the reader leaves.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_pipe"))
        .args([
            "schedule",
            "--stages",
            "32",
            "--microbatches",
            "256",
            "--format",
            "text",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 64];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    // The read end is dropped here.
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(first.starts_with(b"w0: "));
}

#[test]
fn quic_training_matches_in_process_training_and_cluster_init_writes_credentials() {
    let mut args = small();
    args.extend(["--stages", "2", "--replicas", "2,1"]);
    let inproc = pipe_ok(&args);
    args.extend(["--transport", "quic"]);
    let quic = pipe_ok(&args);
    let summary = |t: &str| {
        t.lines().find(|l| l.starts_with("done:")).map(|l| {
            // The wall time differs; the loss and accuracy must not.
            l.rsplit_once(',')
                .map_or(l.to_string(), |(head, _)| head.to_string())
        })
    };
    assert_eq!(summary(&inproc), summary(&quic), "{inproc}\n{quic}");
    assert!(summary(&quic).is_some(), "{quic}");
    let dir = fresh_path("cluster");
    let d = dir.to_str().unwrap();
    let text = pipe_ok(&["cluster", "init", "--workers", "2", "-o", d]);
    assert!(text.contains("cluster of 2 workers"), "{text}");
    for f in ["ca.pem", "rank-0.pem", "rank-1.key", "cluster.toml"] {
        assert!(dir.join(f).exists(), "{f}");
    }
    assert_bad_input(
        &["cluster", "init", "--workers", "0", "-o", d],
        "--workers 0",
    );
    assert_bad_input(
        &[
            "cluster",
            "init",
            "--workers",
            "2",
            "--addrs",
            "a:1",
            "-o",
            d,
        ],
        "1 addresses for 2 workers",
    );
    assert_bad_input(&["train", "--transport", "udp"], "udp");
}

#[test]
fn experiment_and_report_refuse_bad_input() {
    // The staleness experiment and the benchmark sweep: (the command before `--config`, a
    // config missing a field, `report`'s name for it, a results file it refuses and why).
    let sweeps = [
        (
            "experiment staleness",
            "model = \"mlp-784-10\"\nepochs = 1\n",
            "staleness",
            "{\"runs\": 3",
            "results.json",
        ),
        (
            "bench",
            "repeats = 5\n",
            "bench",
            "{\"configs\": 3",
            "not a bench results file",
        ),
    ];
    for (command, config, report, results, why) in sweeps {
        let bad = common::fresh_file("sweep-bad.toml", config);
        let refused = |config: &str, needle: &str| {
            assert_bad_input(
                &[&words(command)[..], &["--config", config]].concat(),
                needle,
            );
        };
        refused(common::s(&bad), "missing field");
        refused("/nonexistent/sweep.toml", "cannot read");
        let empty = common::fresh_dir("sweep-empty");
        assert_bad_input(
            &["report", report, "--from", common::s(&empty)],
            "results.json",
        );
        let bad = common::fresh_dir("sweep-results");
        std::fs::write(bad.join("results.json"), results).unwrap();
        assert_bad_input(&["report", report, "--from", common::s(&bad)], why);
    }
    let cases = [
        ("bench measure-config --spec { --options {}", "--spec"),
        ("bench --quick mfu", "cannot be used"),
        // Bad remedies on `pipe train` too.
        (
            "train --stages 2 --schedule gpipe --sync-warmup 5",
            "asynchronous",
        ),
        ("train --stages 2 --lr-scaling quick", "unknown lr scaling"),
    ];
    assert_bad_inputs(&cases);
}

/// `pipe plan --hosts`: on two hosts joined by a slow network, the plan says which workers each
/// host runs and which links cross, writes the hosts into its file, and `pipe train --plan`
/// names the placement in its header.
#[test]
fn a_plan_on_hosts_places_its_workers_and_the_run_carries_it() {
    let s = |v: &str| format!(r#"{{"median": {v}, "min": {v}, "max": {v}}}"#);
    let cost = |name: &str, cpu: &str| {
        format!(
            r#"{{"transport": "{name}", "rounds": 1, "latency_s": {}, "message_cpu_s": {}, "byte_cpu_s": {}, "bandwidth": null}}"#,
            s("1e-5"),
            s(cpu),
            s("0")
        )
    };
    let costs = fresh_path("hosts-costs.json");
    std::fs::write(
        &costs,
        format!(
            r#"{{"transports": [{}, {}]}}"#,
            cost("shm", "3e-6"),
            cost("quic", "3e-5")
        ),
    )
    .unwrap();
    let plan_file = fresh_path("hosts-plan.toml");
    let text = pipe_ok(&[
        "plan",
        "--model",
        "mlp-784-64-64-10",
        "--microbatch-size",
        "16",
        "--workers",
        "3",
        "--straight",
        "--hosts",
        "a:1,b:2",
        "--bandwidth",
        "1MB/s",
        "--transport-costs",
        costs.to_str().unwrap(),
        "-o",
        plan_file.to_str().unwrap(),
    ]);
    assert!(text.contains("between hosts: 976.56 KiB/s"), "{text}");
    assert!(text.contains("links charged as shm"), "{text}");
    assert!(
        text.contains("host a: worker 0 (stage 0)")
            && text.contains("host b: worker 1 (stage 1), worker 2 (stage 2)"),
        "{text}"
    );
    assert!(
        text.contains("links crossing hosts: stage 0 -> 1 ("),
        "{text}"
    );
    let written = std::fs::read_to_string(&plan_file).unwrap();
    assert!(written.contains(r#"hosts = ["a", "b", "b"]"#), "{written}");
    let run = train_plan(&plan_file, "--steps 2 --epochs 1");
    assert!(
        run.contains("placed by the plan: a (workers 0), b (workers 1, 2)"),
        "{run}"
    );
}

/// Replicated stages without a bucket size: each stage's is chosen on the run's measured link
/// and printed with the flag that repeats it; the repeat trains to the same weights, bit for
/// bit, and a list of sizes for another stage count is refused.
#[test]
fn bucket_sizes_are_chosen_per_stage_and_repeat() {
    let base = [
        "train",
        "--stages",
        "2",
        "--replicas",
        "3",
        "--steps",
        "6",
        "--epochs",
        "1",
    ];
    let chosen = pipe_ok(&base);
    let line = chosen
        .lines()
        .find(|l| l.starts_with("all-reduce buckets chosen per stage on inproc's measured link"))
        .unwrap_or_else(|| panic!("{chosen}"));
    let flag = line
        .rsplit_once("--allreduce-bucket-mb ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap();
    assert_eq!(flag.split(',').count(), 2, "{line}");
    let digest = |text: &str| {
        text.lines()
            .find_map(|l| l.split("weights ").nth(1))
            .map(|w| w[..16].to_string())
            .unwrap_or_else(|| panic!("{text}"))
    };
    // The partition is measured too: the repeat takes the printed one.
    let partition = chosen
        .lines()
        .find_map(|l| l.split("--partition ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("{chosen}"));
    let repeated = pipe_ok(
        &[
            &base[..],
            &["--allreduce-bucket-mb", flag, "--partition", partition],
        ]
        .concat(),
    );
    assert!(!repeated.contains("buckets chosen"), "{repeated}");
    assert_eq!(digest(&chosen), digest(&repeated));
    assert_bad_input(
        &[&base[..], &["--allreduce-bucket-mb", "1,2,3"]].concat(),
        "gives 3 sizes for 2 stages",
    );
}

/// `pipe bench mfu` as GPT-2 runs train: AdamW, the GPT-2 preset at GPT-2's 50,257-token
/// vocabulary, tokens per second, and the step's time by operation with products by shape.
#[test]
fn bench_mfu_measures_a_gpt2_step_with_adamw_and_breaks_it_down() {
    let json = fresh_path("mfu-gpt2.json");
    let out = pipe_ok(&[
        "bench",
        "mfu",
        "--model",
        "gpt2-tiny",
        "--batch",
        "1",
        "--steps",
        "1",
        "--threads",
        "1",
        "--optimizer",
        "adamw",
        "--breakdown",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.contains("adamw") && out.contains("tokens/s"), "{out}");
    assert!(out.contains("by operation"), "{out}");
    assert!(
        out.contains("adam_update") && out.contains("softmax_cross_entropy"),
        "{out}"
    );
    // The head: 64 positions by 64 features into the 50,257 classes.
    assert!(out.contains("matmul 64x64x50257 NT"), "{out}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["optimizer"], "adamw");
    assert_eq!(report["tokens_per_sample"], 64);
    // Token and tied head 50,257 x 64, positions 64 x 64, two blocks of width 64, final norm.
    let blocks = 2 * (12 * 64 * 64 + 13 * 64);
    assert_eq!(
        report["parameters"],
        50_257 * 64 + 64 * 64 + blocks + 2 * 64
    );
    assert!(report["peak_device_bytes"].is_null(), "{report}");
}

/// `pipe bench mfu --model gpt2` in the shape its flags give, at the vocabulary
/// `--vocab-size` gives: the shape `experiments/cpu-step/run.sh` trains.
#[test]
fn bench_mfu_measures_a_gpt2_of_the_shape_its_flags_give() {
    let json = fresh_path("mfu-gpt2-shape.json");
    pipe_ok(&[
        "bench",
        "mfu",
        "--model",
        "gpt2",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--n-positions",
        "16",
        "--vocab-size",
        "64",
        "--batch",
        "2",
        "--steps",
        "1",
        "--threads",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["tokens_per_sample"], 16);
    // Token and tied head 64 x 32, positions 16 x 32, one block of width 32, final norm.
    let block = 12 * 32 * 32 + 13 * 32;
    assert_eq!(report["parameters"], 64 * 32 + 16 * 32 + block + 2 * 32);
}
