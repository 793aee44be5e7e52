//! Checkpoints through the `pipe` binary: a run stopped (Ctrl-C) and resumed ends with the
//! weights of the same run uninterrupted, for a flush policy, for pipedream and for one
//! worker; resuming
//! under another layout works; corrupted, truncated, missing and foreign checkpoints are
//! refused naming the file; a process killed while writing one leaves the previous one
//! loadable and `latest` on it; a checkpoint directory made read-only or a full disk stops the
//! run naming the write and keeps the last checkpoint; `pipe eval` reads them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{fresh_dir, ok, pipe_command, refused, s, wait_for, weights};

const PIPE: &str = env!("CARGO_BIN_EXE_pipe");

/// A small single-worker run: two epochs of 128 updates.
fn single_flags() -> Vec<String> {
    let mut f = flags("pipedream");
    for flag in ["--stages", "--partition", "--schedule"] {
        let i = f.iter().position(|a| a == flag).unwrap();
        f.drain(i..i + 2);
    }
    f
}

#[test]
fn a_single_worker_run_stops_on_ctrl_c_and_resumes_like_the_uninterrupted_run() {
    let d = fresh_dir("single");
    let args = single_flags();
    let whole = ok(&train_into(
        &args,
        &d.join("whole"),
        &["--checkpoint-every", "8"],
    ));
    let stopped =
        interrupt_after_first_checkpoint(&args, &d.join("run"), "-INT", Signalled::Launcher);
    assert_eq!(stopped.status.code(), Some(130), "{stopped:?}");
    let every_and_latest = ["--checkpoint-every", "8", "--resume", "latest"];
    let resumed = ok(&train_into(&args, &d.join("run"), &every_and_latest));
    assert_eq!(weights(&whole), weights(&resumed));
}

/// A small pipelined run: two epochs of 64 updates (8,192 samples, minibatches of 2 x 64).
fn flags(schedule: &str) -> Vec<String> {
    [
        "--dataset",
        "synthetic",
        "--model",
        "mlp-784-32x4-10",
        "--epochs",
        "2",
        "--stages",
        "2",
        "--partition",
        "flops",
        "--microbatches",
        "2",
        "--threads",
        "1",
        "--schedule",
        schedule,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn train(args: &[String], extra: &[&str]) -> Output {
    pipe_command(&["train"])
        .args(args)
        .args(extra)
        .output()
        .unwrap()
}

/// [`train`] with its checkpoints in `ckpt`.
fn train_into(args: &[String], ckpt: &Path, extra: &[&str]) -> Output {
    train(args, &[&["--checkpoint-dir", s(ckpt)], extra].concat())
}

/// `pipe train` with `args` launched by `launch` (the `pipe` binary, or a command that runs
/// it), a checkpoint into `ckpt` every 8 updates, each slowed by `pause_ms` milliseconds so
/// that the run is still going when the test acts on it; not yet started.
fn checkpointing(mut launch: Command, args: &[String], ckpt: &Path, pause_ms: &str) -> Command {
    launch
        .arg("train")
        .args(args)
        .args(["--checkpoint-dir", s(ckpt), "--checkpoint-every", "8"])
        .env("PIPE_FAULT_CHECKPOINT_PAUSE_MS", pause_ms)
        .env_remove("RUST_BACKTRACE");
    launch
}

/// Sends `signal` (`-INT`, `-9`) to `child`.
fn signal(child: &Child, signal: &str) {
    let kill = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status();
    assert!(kill.unwrap().success());
}

/// Who a stop signal goes to.
#[derive(Clone, Copy)]
enum Signalled {
    /// The `pipe train` process alone.
    Launcher,
    /// Its whole process group, its worker processes with it (Ctrl-C at a terminal, `kill`
    /// of the group, a service manager).
    Group,
}

/// Stops a run with `stop` (`-INT`, `-TERM`) sent to `to` once its first checkpoint exists;
/// returns its output.
fn interrupt_after_first_checkpoint(
    args: &[String],
    ckpt: &Path,
    stop: &str,
    to: Signalled,
) -> Output {
    use std::os::unix::process::CommandExt as _;
    let mut launch = checkpointing(pipe_command(&[]), args, ckpt, "150");
    // A group of its own, which a signal to the group reaches and nothing else.
    launch.process_group(0);
    let child = common::spawn_piped(&mut launch);
    wait_for(&ckpt.join("latest"));
    match to {
        Signalled::Launcher => signal(&child, stop),
        Signalled::Group => {
            let group = format!("-{}", child.id());
            let kill = Command::new("kill").args([stop, "--", &group]).status();
            assert!(kill.unwrap().success());
        }
    }
    child.wait_with_output().unwrap()
}

/// Ctrl-C at a terminal, and SIGTERM as `kill`, Slurm and Kubernetes send it.
#[test]
fn a_run_stopped_with_ctrl_c_or_sigterm_and_resumed_ends_like_the_uninterrupted_run() {
    for (schedule, stop, code) in [("1f1b-flush", "-INT", 130), ("pipedream", "-TERM", 143)] {
        let d = fresh_dir(&format!("resume-{schedule}"));
        let args = flags(schedule);
        let every = ["--checkpoint-every", "8"];
        let whole = ok(&train(
            &args,
            &[&["--checkpoint-dir", s(&d.join("whole"))], &every[..]].concat(),
        ));
        let stopped =
            interrupt_after_first_checkpoint(&args, &d.join("run"), stop, Signalled::Launcher);
        let err = String::from_utf8_lossy(&stopped.stderr);
        assert_eq!(stopped.status.code(), Some(code), "{err}");
        let name = if code == 143 { "SIGTERM" } else { "SIGINT" };
        assert!(
            err.contains(&format!("stopped by {name} after update")),
            "{err}"
        );
        assert!(err.contains("resume with --resume"), "{err}");
        let latest = [&["--resume", "latest"], &every[..]].concat();
        let resumed = ok(&train_into(&args, &d.join("run"), &latest));
        assert!(resumed.contains("resuming from"), "{resumed}");
        assert_eq!(weights(&whole), weights(&resumed), "{schedule}");

        // Resuming from a checkpoint of the uninterrupted run, at every one kept.
        let mut kept: Vec<PathBuf> = std::fs::read_dir(d.join("whole"))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.join("manifest.json").exists())
            .collect();
        kept.sort();
        assert_eq!(kept.len(), 3, "--keep-checkpoints defaults to 3: {kept:?}");
        // The last is the run's end: nothing left to resume.
        assert!(kept[2].ends_with("ckpt-00000128"), "{kept:?}");
        for (i, c) in kept[..2].iter().enumerate() {
            let from_c = [&["--resume", s(c)], &every[..]].concat();
            let again = ok(&train_into(&args, &d.join(format!("again-{i}")), &from_c));
            assert_eq!(weights(&whole), weights(&again), "{schedule} from {c:?}");
        }
    }
}

#[test]
fn a_checkpoint_resumes_under_another_layout_and_evaluates() {
    let d = fresh_dir("layout");
    let args = flags("pipedream");
    ok(&train(&args, &["--checkpoint-dir", s(&d), "--steps", "64"]));
    // Another policy, stage count and replica layout.
    let other: Vec<String> = {
        let mut v = flags("1f1b-flush");
        let i = v.iter().position(|a| a == "--stages").unwrap();
        v.drain(i..i + 2);
        v.extend(["--stages", "4", "--replicas", "2,1,1,1"].map(String::from));
        v
    };
    let text = ok(&train(&other, &["--resume", s(&d)]));
    assert!(text.contains("resuming from"), "{text}");
    assert!(text.contains("epoch   2"), "{text}");
    let out = ok(&eval(&d));
    assert!(out.contains("test accuracy"), "{out}");
    assert!(out.contains("update 64"), "{out}");
}

/// A fresh checkpoint directory with one checkpoint; returns the checkpoint's directory.
fn one_checkpoint(name: &str) -> (PathBuf, PathBuf) {
    let d = fresh_dir(name);
    ok(&train(
        &flags("pipedream"),
        &["--checkpoint-dir", s(&d), "--steps", "64"],
    ));
    let latest = std::fs::read_to_string(d.join("latest")).unwrap();
    let c = d.join(latest.trim());
    (d, c)
}

/// Rewrites checkpoint `c`'s manifest entry for its file `name` to the file's present size and
/// SHA-256, so that a reader past the manifest has to find what was done to it.
fn reseal(c: &Path, name: &str) {
    let manifest = std::fs::read_to_string(c.join("manifest.json")).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&manifest).unwrap();
    let path = c.join(name);
    for f in m["files"].as_array_mut().unwrap() {
        if f["name"] == name {
            f["bytes"] = std::fs::metadata(&path).unwrap().len().into();
            let out = Command::new("sha256sum").arg(&path).output().unwrap();
            let hash = String::from_utf8_lossy(&out.stdout);
            f["sha256"] = hash.split_whitespace().next().unwrap().into();
        }
    }
    std::fs::write(c.join("manifest.json"), m.to_string()).unwrap();
}

/// Checkpoint `c`'s `state.json` with `edit` applied, resealed ([`reseal`]).
fn edit_state(c: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = c.join("state.json");
    let mut state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut state);
    std::fs::write(&path, state.to_string()).unwrap();
    reseal(c, "state.json");
}

/// A copy of checkpoint `c` beside it, named `name`.
fn copy_of(c: &Path, name: &str) -> PathBuf {
    let copy = c.with_file_name(name);
    let copied = Command::new("cp")
        .arg("-r")
        .arg(c)
        .arg(&copy)
        .status()
        .unwrap();
    assert!(copied.success(), "cp -r {}", c.display());
    copy
}

fn eval(path: &Path) -> Output {
    common::pipe(&["eval", "--checkpoint", s(path)])
}

#[test]
fn corrupted_truncated_missing_and_foreign_checkpoints_are_refused() {
    // A flipped byte.
    let (_, c) = one_checkpoint("flip");
    let w = c.join("weights.safetensors");
    let mut bytes = std::fs::read(&w).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&w, &bytes).unwrap();
    refused(&eval(&c), &["weights.safetensors", "SHA-256", "corrupted"]);
    refused(
        &train(&flags("pipedream"), &["--resume", s(&c)]),
        &["weights.safetensors", "corrupted"],
    );

    // A truncated file: first as the manifest sees it, then with a manifest rewritten to
    // match, so that the safetensors reader has to find it.
    let (_, c) = one_checkpoint("truncate");
    let o = c.join("optimizer.safetensors");
    let bytes = std::fs::read(&o).unwrap();
    let short = &bytes[..bytes.len() - 100];
    std::fs::write(&o, short).unwrap();
    refused(&eval(&c), &["optimizer.safetensors", "truncated"]);
    reseal(&c, "optimizer.safetensors");
    refused(&eval(&c), &["optimizer.safetensors"]);

    // A missing file.
    let (_, c) = one_checkpoint("missing");
    std::fs::remove_file(c.join("state.json")).unwrap();
    refused(&eval(&c), &["state.json"]);

    // Another model's checkpoint.
    let (_, c) = one_checkpoint("foreign");
    let mut wider = flags("pipedream");
    let i = wider.iter().position(|a| a == "mlp-784-32x4-10").unwrap();
    wider[i] = "mlp-784-48x4-10".into();
    refused(
        &train(&wider, &["--resume", s(&c)]),
        &["weights.safetensors", "layers.1.weight", "[784, 48]"],
    );

    // A pointer to nothing, and nothing at all.
    let (d, _) = one_checkpoint("pointer");
    std::fs::write(d.join("latest"), "ckpt-99999999\n").unwrap();
    refused(&eval(&d), &["latest", "ckpt-99999999"]);
    refused(&eval(&d.join("nowhere")), &["nowhere"]);
}

/// A state whose counters or synthetic data shape no run could have written, its manifest
/// resealed so that only the state's own checks stand between it and the reader: refused
/// before anything is allocated or trained, where it used to wrap its update count and train
/// on, or allocate the data's petabytes.
#[test]
fn a_state_no_run_could_have_written_is_refused_past_a_resealed_manifest() {
    let (_, good) = one_checkpoint("state-range");
    let cases: [(&str, serde_json::Value, &str); 4] = [
        (
            "updates",
            u64::MAX.into(),
            "updates 18446744073709551615 is past",
        ),
        (
            "epoch",
            (1u64 << 63).into(),
            "epoch 9223372036854775808 is outside",
        ),
        ("epoch", 0.into(), "epoch 0 is outside"),
        (
            "optimizer_steps",
            vec![u64::MAX; 2].into(),
            "optimizer steps",
        ),
    ];
    for (i, (field, value, needle)) in cases.into_iter().enumerate() {
        let c = copy_of(&good, &format!("edited-{i}"));
        edit_state(&c, |state| state[field] = value);
        refused(&eval(&c), &["state.json", needle]);
        refused(
            &train(&flags("pipedream"), &["--resume", s(&c)]),
            &["state.json", needle],
        );
    }
    // A data cursor of whole minibatches, past the end of the run's epoch (2^27 samples is a
    // whole number of any power-of-two minibatch): named as past the end.
    let c = copy_of(&good, "past-the-epoch");
    edit_state(&c, |state| state["samples_in_epoch"] = (1u64 << 27).into());
    refused(
        &train(&flags("pipedream"), &["--resume", s(&c)]),
        &[
            "stopped 134217728 samples into epoch",
            "past the end of this run's epochs",
        ],
    );
    // A model of 1.6 billion weights that the 100 KB weights file does not hold: refused by
    // the first tensor's shape before the model is allocated, within 2 GB of address space
    // (it used to fill 6.5 GB of weights first).
    let c = copy_of(&good, "larger-model");
    edit_state(&c, |state| {
        for layer in state["model_spec"]["layers"].as_array_mut().unwrap() {
            for side in ["inputs", "outputs"] {
                if layer[side] == 32 {
                    layer[side] = 40_000.into();
                }
            }
        }
    });
    let limited = Command::new("prlimit")
        .arg("--as=2000000000")
        .arg(env!("CARGO_BIN_EXE_pipe"))
        .args(["eval", "--checkpoint", s(&c)])
        .output()
        .unwrap();
    refused(
        &limited,
        &[
            "weights.safetensors",
            "[784, 32]",
            "the model has F32 [784, 40000]",
        ],
    );
    // A synthetic dataset of 2^40 hidden units: checked before its teacher is drawn.
    let c = copy_of(&good, "synthetic");
    edit_state(&c, |state| {
        state["dataset"] = "synthetic".into();
        state["synthetic"]["hidden"] = (1u64 << 40).into();
    });
    refused(&eval(&c), &["synthetic inputs x hidden", "over the limit"]);
}

/// A weight or a momentum that is not finite, written into a checkpoint's last value and
/// resealed: no run writes either (it stops first), so each is refused by name where `pipe
/// eval` used to print a loss of NaN and exit 0 (the other parts' rules:
/// [`optimizer_state_and_manifests_no_run_could_have_written_are_refused`]).
#[test]
fn values_no_run_could_have_written_are_refused_past_a_resealed_manifest() {
    let (_, good) = one_checkpoint("values-range");
    let set_last = |c: &Path, file: &str, v: f32| {
        let path = c.join(file);
        let mut bytes = std::fs::read(&path).unwrap();
        let at = bytes.len() - 4;
        bytes[at..].copy_from_slice(&v.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        reseal(c, file);
    };
    for (i, v) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY]
        .into_iter()
        .enumerate()
    {
        let c = copy_of(&good, &format!("weight-{i}"));
        set_last(&c, "weights.safetensors", v);
        let needles = ["weights.safetensors", "at element", "weights are finite"];
        refused(&eval(&c), &needles);
        refused(&train(&flags("pipedream"), &["--resume", s(&c)]), &needles);
    }
    // The file's last tensor is a momentum (SGD's first moment): NaN and infinity alike.
    for (i, v) in [f32::NAN, f32::INFINITY].into_iter().enumerate() {
        let c = copy_of(&good, &format!("moment-{i}"));
        set_last(&c, "optimizer.safetensors", v);
        refused(
            &eval(&c),
            &["optimizer.safetensors", "first moments are finite"],
        );
    }
}

/// Checkpoint `c`'s safetensors file `file` rewritten with `edit` applied to its tensors
/// (name, shape, values), and resealed ([`reseal`]).
fn edit_tensors(c: &Path, file: &str, edit: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<f32>)>)) {
    let path = c.join(file);
    let bytes = std::fs::read(&path).unwrap();
    let read = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = read
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, view.shape().to_vec(), values)
        })
        .collect();
    edit(&mut tensors);
    let raw: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(name, shape, values)| {
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (name, shape, bytes)
        })
        .collect();
    let views = raw.iter().map(|(name, shape, bytes)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes);
        (name.clone(), view.unwrap())
    });
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    reseal(c, file);
}

/// Sets the first value of tensor `name` in `tensors` ([`edit_tensors`]) to `v`.
fn set_first(tensors: &mut [(String, Vec<usize>, Vec<f32>)], name: &str, v: f32) {
    let t = tensors.iter_mut().find(|t| t.0 == name).unwrap();
    t.2[0] = v;
}

/// Optimizer state no run could have written, resealed: an infinite first moment (a run's
/// next update would have made its weight infinite or NaN, so the run stops first), a
/// negative second moment (a mean of squares), a tensor that is no part of the model's
/// parameters (state nobody would read), and a manifest that lists a file no reader verifies
/// or one file twice. Each is refused by name, `pipe eval` and `--resume` alike, where the
/// first two were read and failed at the first update or trained on, and the others were
/// passed over. An infinite second moment, which a finite gradient can reach, is read.
#[test]
fn optimizer_state_and_manifests_no_run_could_have_written_are_refused() {
    let d = fresh_dir("adam-values");
    let adam = [
        flags("pipedream"),
        vec!["--optimizer".into(), "adam".into()],
    ]
    .concat();
    ok(&train(&adam, &["--checkpoint-dir", s(&d), "--steps", "16"]));
    let good = d.join(std::fs::read_to_string(d.join("latest")).unwrap().trim());
    let resume = |c: &Path| train(&adam, &["--resume", s(c)]);
    let moment = "layers.1.weight";
    let cases: [(&str, &str, f32, &[&str]); 3] = [
        (
            "first",
            "first-inf",
            f32::INFINITY,
            &["holds inf", "first moments are finite"],
        ),
        (
            "first",
            "first-minus-inf",
            f32::NEG_INFINITY,
            &["holds -inf", "first moments are finite"],
        ),
        (
            "second",
            "second-negative",
            -1.0,
            &["holds -1", "never negative"],
        ),
    ];
    for (part, name, v, needles) in cases {
        let c = copy_of(&good, name);
        let tensor = format!("{moment}.{part}");
        edit_tensors(&c, "optimizer.safetensors", |t| set_first(t, &tensor, v));
        let needles = [&["optimizer.safetensors", tensor.as_str()], needles].concat();
        refused(&eval(&c), &needles);
        refused(&resume(&c), &needles);
    }
    let c = copy_of(&good, "second-inf");
    let second = format!("{moment}.second");
    edit_tensors(&c, "optimizer.safetensors", |t| {
        set_first(t, &second, f32::INFINITY)
    });
    ok(&eval(&c));

    let c = copy_of(&good, "stray-tensor");
    edit_tensors(&c, "optimizer.safetensors", |t| {
        t.push(("layers.1.weight.third".into(), vec![1], vec![0.0]));
    });
    let needles = [
        "optimizer.safetensors",
        "layers.1.weight.third",
        "no part of this model",
    ];
    refused(&eval(&c), &needles);
    refused(&resume(&c), &needles);

    let edit_manifest = |c: &Path, edit: &dyn Fn(&mut Vec<serde_json::Value>)| {
        let path = c.join("manifest.json");
        let mut m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(m["files"].as_array_mut().unwrap());
        std::fs::write(&path, m.to_string()).unwrap();
    };
    let c = copy_of(&good, "listed-extra");
    std::fs::write(c.join("notes.txt"), "").unwrap();
    edit_manifest(&c, &|files| {
        let empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        files.push(serde_json::json!({"name": "notes.txt", "bytes": 0, "sha256": empty}));
    });
    let needles = ["manifest.json", "\"notes.txt\"", "not a checkpoint's file"];
    refused(&eval(&c), &needles);
    refused(&resume(&c), &needles);
    let c = copy_of(&good, "listed-twice");
    edit_manifest(&c, &|files| files.push(files[0].clone()));
    refused(&eval(&c), &["manifest.json", "twice"]);
}

#[test]
fn a_process_killed_while_writing_a_checkpoint_leaves_the_previous_one_whole() {
    let d = fresh_dir("kill");
    let mut child = checkpointing(pipe_command(&[]), &flags("pipedream"), &d, "400")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    // The first checkpoint is complete; the second is being written.
    let partial = loop {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no second checkpoint"
        );
        if d.join("latest").exists() {
            let tmp = std::fs::read_dir(&d)
                .unwrap()
                .flatten()
                .map(|e| e.path())
                .find(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with(".tmp-ckpt-"))
                });
            if let Some(tmp) = tmp.filter(|p| p.join("weights.safetensors").exists()) {
                break tmp;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    signal(&child, "-9");
    child.wait().unwrap();
    let latest = std::fs::read_to_string(d.join("latest")).unwrap();
    assert_eq!(
        latest.trim(),
        "ckpt-00000008",
        "latest moved to a partial checkpoint"
    );
    let text = ok(&eval(&d));
    assert!(text.contains("ckpt-00000008"), "{text}");
    // The partial one has no manifest, so nothing reads it as a checkpoint.
    assert!(!partial.join("manifest.json").exists());
    let out = eval(&partial);
    assert_eq!(out.status.code(), Some(2));
    // A resumed run cleans it up and carries on.
    let text = ok(&train(
        &flags("pipedream"),
        &["--checkpoint-dir", s(&d), "--resume", "latest"],
    ));
    assert!(text.contains("done: 128 steps"), "{text}");
    assert!(!partial.exists());
}

/// A run with each delay correction resumed from a checkpoint taken mid-run ends with the
/// uninterrupted run's weights: the correction's memory (error feedback's last update, the
/// adaptive DC-ASGD's mean square) is checkpointed with the optimizer's state. Without it, the
/// first resumed step would be a plain one and the weights would differ.
#[test]
fn a_run_with_each_delay_correction_resumes_to_the_uninterrupted_weights() {
    let mut plain = flags("2bw");
    plain.extend(["--checkpoint-every", "8"].map(String::from));
    let plain = ok(&train(
        &plain,
        &[
            "--checkpoint-dir",
            s(&fresh_dir("feedback-plain")),
            "--steps",
            "24",
        ],
    ));
    for (correction, policy) in [
        ("error-feedback", "2bw"),
        ("dc-asgd", "pipedream"),
        ("dc-asgd-adaptive", "2bw"),
    ] {
        let d = fresh_dir(correction);
        let mut args = flags(policy);
        args.extend(
            [
                "--delay-correction",
                correction,
                "--delay-correction-strength",
                "0.5",
                "--checkpoint-every",
                "8",
            ]
            .map(String::from),
        );
        let whole = ok(&train_into(&args, &d, &["--steps", "24"]));
        let again = fresh_dir(&format!("{correction}-resumed"));
        let from = d.join("ckpt-00000008");
        let resumed = ok(&train_into(
            &args,
            &again,
            &["--resume", s(&from), "--steps", "24"],
        ));
        assert!(resumed.contains("resuming from"), "{resumed}");
        assert_eq!(weights(&resumed), weights(&whole), "{correction}");
        assert_ne!(weights(&plain), weights(&whole), "{correction}");
    }
}

#[test]
fn a_checkpoint_renamed_into_place_before_latest_was_written_is_resumed_by_auto() {
    // A writer killed between the rename and `latest` leaves a whole checkpoint and no
    // pointer: the first checkpoint of a run, here.
    let d = fresh_dir("no-latest");
    let args = flags("pipedream");
    ok(&train_into(&args, &d, &["--steps", "8"]));
    std::fs::remove_file(d.join("latest")).unwrap();
    let resumed = ok(&train_into(
        &args,
        &d,
        &["--resume", "auto", "--steps", "16"],
    ));
    assert!(resumed.contains("resuming from"), "{resumed}");
    assert!(resumed.contains("ckpt-00000008"), "{resumed}");
    // The same as naming the checkpoint by hand.
    let by_hand = ok(&train(
        &args,
        &["--resume", s(&d.join("ckpt-00000008")), "--steps", "16"],
    ));
    assert_eq!(weights(&resumed), weights(&by_hand));
}

#[test]
fn a_non_finite_loss_stops_the_run_naming_it_and_keeps_the_last_good_checkpoint() {
    let d = fresh_dir("guard");
    let out = train(
        &flags("pipedream"),
        &[
            "--lr",
            "1e30",
            "--checkpoint-dir",
            s(&d),
            "--checkpoint-every",
            "1",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("is not finite at update"), "{err}");
    assert!(err.contains("(stage "), "{err}");
    assert!(
        [
            "the loss of microbatch",
            "the gradient of layers.",
            "the parameter layers.",
            "the test loss"
        ]
        .iter()
        .any(|n| err.contains(n)),
        "{err}"
    );
    let text = ok(&eval(&d));
    assert!(text.contains("test accuracy"), "{text}");
}

#[test]
fn worker_processes_checkpoint_through_the_chief_and_resume_like_one_process() {
    let d = fresh_dir("processes");
    let mut args = flags("pipedream");
    let i = args.iter().position(|a| a == "--stages").unwrap();
    args.drain(i..i + 2);
    args.extend(["--stages", "2", "--replicas", "2,1"].map(String::from));
    let every = ["--checkpoint-every", "8"];
    let whole = ok(&train(
        &args,
        &[&["--checkpoint-dir", s(&d.join("whole"))], &every[..]].concat(),
    ));
    // SIGTERM to the whole process group: the launched workers leave it to the launcher,
    // which asks the chief to stop at its next drain point.
    let mut quic = args.clone();
    quic.extend(["--transport", "quic"].map(String::from));
    let stopped =
        interrupt_after_first_checkpoint(&quic, &d.join("run"), "-TERM", Signalled::Group);
    let err = String::from_utf8_lossy(&stopped.stderr);
    assert_eq!(stopped.status.code(), Some(143), "{err}");
    assert!(err.contains("resume with --resume"), "{err}");
    // Keep the chief's checkpoint aside (resuming prunes old ones).
    let latest = std::fs::read_to_string(d.join("run").join("latest")).unwrap();
    let saved = d.join("saved");
    std::fs::create_dir_all(&saved).unwrap();
    for f in std::fs::read_dir(d.join("run").join(latest.trim()))
        .unwrap()
        .flatten()
    {
        std::fs::copy(f.path(), saved.join(f.file_name())).unwrap();
    }
    let resumed = ok(&train(
        &quic,
        &[
            &["--checkpoint-dir", s(&d.join("run")), "--resume", "latest"],
            &every[..],
        ]
        .concat(),
    ));
    assert_eq!(weights(&whole), weights(&resumed));
    // What the chief wrote resumes in one process too.
    let again = ok(&train(
        &args,
        &[
            &[
                "--checkpoint-dir",
                s(&d.join("again")),
                "--resume",
                s(&saved),
            ],
            &every[..],
        ]
        .concat(),
    ));
    assert_eq!(weights(&whole), weights(&again));
}

/// A run whose checkpoint directory is taken away from under it (read-only or full), started
/// by `launch` with the directory `d`: it must stop with one error line naming the write and
/// `cause`, and leave the first checkpoint whole and `latest` on it. `spoil` spoils the
/// directory once the first checkpoint exists.
fn storage_fault(d: &Path, launch: Command, spoil: impl FnOnce(), cause: &str) {
    // Each checkpoint slowed down so the directory is spoiled before the second.
    let child = common::spawn_piped(&mut checkpointing(launch, &flags("pipedream"), d, "200"));
    wait_for(&d.join("latest"));
    spoil();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains("writing checkpoint") && lines[0].contains(cause),
        "{err}"
    );
    let latest = std::fs::read_to_string(d.join("latest")).unwrap();
    assert_eq!(latest.trim(), "ckpt-00000008", "{err}");
    let text = ok(&eval(d));
    assert!(text.contains("ckpt-00000008"), "{text}");
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

#[test]
fn a_checkpoint_directory_made_read_only_stops_the_run_and_keeps_the_last_checkpoint() {
    // Permission bits do not bind root: the run drops to `nobody`, and root takes the
    // directory's write permission away.
    if !is_root() || Command::new("setpriv").arg("--version").output().is_err() {
        eprintln!("skipped: needs root and setpriv to run pipe as another user");
        return;
    }
    let d = fresh_dir("readonly");
    std::os::unix::fs::chown(&d, Some(65534), Some(65534)).unwrap();
    let mut launch = Command::new("setpriv");
    launch.args(["--reuid=65534", "--regid=65534", "--clear-groups", PIPE]);
    let spoil = || {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o555)).unwrap();
    };
    storage_fault(&d, launch, spoil, "Permission denied");
}

#[test]
fn a_full_disk_stops_the_run_and_keeps_the_last_checkpoint() {
    // A 400 KiB file system holds one checkpoint of this model (about 230 KiB), not two.
    let d = fresh_dir("full");
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=400k", "tmpfs", s(&d)])
        .output();
    if !mounted.as_ref().is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: cannot mount a tmpfs here ({mounted:?})");
        return;
    }
    let result = std::panic::catch_unwind(|| {
        storage_fault(&d, pipe_command(&[]), || {}, "No space left on device");
        // The partial copy was removed, giving its space back.
        let partial = std::fs::read_dir(&d)
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(".tmp-ckpt-"));
        assert!(!partial, "a partial checkpoint was left on the full disk");
    });
    let _ = Command::new("umount").arg(s(&d)).status();
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

/// `--seed-checkpoint` writes a run's starting point (update 0) and stops: resuming from it is
/// the fresh run bit for bit, on one worker and on a pipeline of another layout, and `pipe
/// export` writes its weights (how `experiments/parity/` hands pipe's initial weights to
/// PyTorch). With `--data-order sequential` the run differs from the shuffled one.
#[test]
fn a_seed_checkpoint_resumes_as_the_fresh_run_on_any_layout_and_exports() {
    let d = fresh_dir("seed");
    let ck = d.join("ck");
    let base = [
        "train",
        "--model",
        "gpt2-tiny",
        "--steps",
        "5",
        "--threads",
        "1",
    ];
    let seeded = ok(&pipe_command(&[])
        .args(base)
        .arg("--checkpoint-dir")
        .arg(&ck)
        .arg("--seed-checkpoint")
        .output()
        .unwrap());
    assert!(seeded.contains("seed checkpoint (update 0)"), "{seeded}");
    assert!(!seeded.contains("done:"), "{seeded}");
    for layout in [&[][..], &["--stages", "2"][..]] {
        let fresh = ok(&pipe_command(&[]).args(base).args(layout).output().unwrap());
        let resumed = ok(&pipe_command(&[])
            .args(base)
            .args(layout)
            .arg("--resume")
            .arg(&ck)
            .output()
            .unwrap());
        assert_eq!(weights(&fresh), weights(&resumed), "{layout:?}");
    }
    let hf = d.join("hf");
    let exported = ok(&pipe_command(&[])
        .args(["export", "--format", "hf", "--checkpoint"])
        .arg(&ck)
        .arg("--out")
        .arg(&hf)
        .output()
        .unwrap());
    assert!(exported.contains("at update 0"), "{exported}");
    let sequential = ok(&pipe_command(&[])
        .args(base)
        .args(["--data-order", "sequential"])
        .output()
        .unwrap());
    let shuffled = ok(&pipe_command(&[]).args(base).output().unwrap());
    assert_ne!(weights(&sequential), weights(&shuffled));
}

/// The launch's settings are config-file keys as every other setting is: a run whose file
/// gives the checkpoint directory, interval and count writes what the same flags write, and
/// a value the flags would refuse is refused from the file too.
#[test]
fn checkpoint_settings_from_a_config_file_act_as_the_flags() {
    let d = fresh_dir("config-keys");
    let args = single_flags();
    let by_flags = ok(&train(
        &args,
        &[
            "--checkpoint-dir",
            s(&d.join("flags")),
            "--checkpoint-every",
            "64",
            "--keep-checkpoints",
            "1",
        ],
    ));
    let config = d.join("run.toml");
    std::fs::write(
        &config,
        format!(
            "checkpoint_dir = \"{}\"\ncheckpoint_every = 64\nkeep_checkpoints = 1\n",
            d.join("file").display()
        ),
    )
    .unwrap();
    let by_file = ok(&train(&args, &["--config", s(&config)]));
    assert_eq!(weights(&by_flags), weights(&by_file));
    let listed = |dir: &str| {
        let mut names: Vec<String> = std::fs::read_dir(d.join(dir))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("ckpt-"))
            .collect();
        names.sort();
        names
    };
    assert_eq!(listed("flags"), listed("file"));
    assert_eq!(listed("file").len(), 1, "keep_checkpoints = 1 keeps one");
    std::fs::write(&config, "checkpoint_every = 8\n").unwrap();
    refused(
        &train(&args, &["--config", s(&config)]),
        &["--checkpoint-every needs --checkpoint-dir"],
    );
    std::fs::write(&config, "keep_checkpoints = 0\ncheckpoint_dir = \"x\"\n").unwrap();
    refused(
        &train(&args, &["--config", s(&config)]),
        &["--keep-checkpoints 0"],
    );
}
