//! The examples in `deploy/`: the sbatch script runs (under stand-in `srun` and `scontrol`
//! that start its tasks on this machine, when Slurm itself is absent), the Kubernetes
//! manifest is an indexed Job with a headless Service whose worker arguments `pipe worker`
//! accepts, and the two-host cluster file is one `pipe worker` reads.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use yaml_rust2::{Yaml, YamlLoader};

mod common;
use common::fresh_dir;

const PIPE: &str = env!("CARGO_BIN_EXE_pipe");

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn executable(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

/// Runs `deploy/slurm/pipe.sbatch` in `d` under stand-in `srun` and `scontrol` (every task a
/// local process on 127.0.0.1) with `pipe_args` and `env`; returns its output. With
/// `FAULT_ONCE` set in `env`, the first step gives task 1 that fault (`pipe worker --fault`).
/// `slot` keeps the ports of jobs that may run at once apart.
fn sbatch(d: &Path, slot: u32, pipe_args: &str, env: &[(&str, &str)]) -> std::process::Output {
    let script = root().join("deploy/slurm/pipe.sbatch");
    let bin = d.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    // scontrol: the allocation is this one machine.
    executable(&bin.join("scontrol"), "#!/bin/bash\necho 127.0.0.1\n");
    // srun: every task of the step as a local process with its Slurm variables; the step
    // fails if one task does.
    executable(
        &bin.join("srun"),
        "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\npids=()\n\
         fault=()\nif [[ -n $FAULT_ONCE && ! -e faulted ]]; then touch faulted; fault=(--fault \"$FAULT_ONCE\"); fi\n\
         for ((t = 0; t < SLURM_NTASKS; t++)); do\n\
           extra=(); if [[ $t -eq 1 ]]; then extra=(\"${fault[@]}\"); fi\n\
           SLURM_PROCID=$t SLURM_LOCALID=$t \"$@\" \"${extra[@]}\" & pids+=($!)\ndone\n\
         rc=0\nfor p in \"${pids[@]}\"; do wait \"$p\" || rc=1; done\nexit $rc\n",
    );
    let port = 30_000 + std::process::id() % 8_000 * 2 + slot * 16_000;
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let mut cmd = Command::new("bash");
    cmd.arg(&script)
        .current_dir(d)
        .env("PATH", path)
        .env("PIPE", PIPE)
        .env("PORT", port.to_string())
        .env("SLURM_JOB_ID", "7")
        .env("SLURM_NTASKS", "2")
        .env("SLURM_NTASKS_PER_NODE", "2")
        .env("SLURM_JOB_NODELIST", "node1")
        .env("PIPE_ARGS", pipe_args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[test]
fn the_sbatch_script_parses_and_trains_under_stand_in_slurm_tools() {
    let script = root().join("deploy/slurm/pipe.sbatch");
    let syntax = Command::new("bash")
        .arg("-n")
        .arg(&script)
        .output()
        .unwrap();
    assert!(syntax.status.success(), "{syntax:?}");
    if Command::new("sbatch").arg("--version").output().is_ok() {
        eprintln!("sbatch is installed, but this test runs the script under stand-ins");
    }
    let d = fresh_dir("slurm");
    let out = sbatch(
        &d,
        0,
        "--dataset synthetic --model mlp-784-32x4-10 --stages 2 --steps 4 --partition flops",
        &[],
    );
    let text = common::ok(&out);
    assert!(text.contains("done: 4 steps"), "{text}");
    assert!(
        !d.join("pipe-cluster-7").exists(),
        "the credentials outlived the job"
    );
}

/// The batch script reruns a failed step from the newest checkpoint (`--resume auto`): task 1
/// is made to end at its 50th data message in the first step, the second step resumes, and
/// the job ends with the weights of a job that never failed.
#[test]
fn the_sbatch_script_restarts_a_failed_step_from_the_newest_checkpoint() {
    let args =
        "--dataset synthetic --model mlp-784-32x4-10 --stages 2 --steps 120 --partition flops";
    let every = [("CHECKPOINT_EVERY", "20")];
    let calm = sbatch(&fresh_dir("slurm-calm"), 1, args, &every);
    let calm_text = common::ok(&calm);
    let d = fresh_dir("slurm-restart");
    let out = sbatch(&d, 1, args, &[every[0], ("FAULT_ONCE", "exit@50")]);
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}{err}");
    assert!(d.join("faulted").exists(), "the fault was never given");
    assert!(
        err.contains("restart 1 of 2 from the newest checkpoint"),
        "{err}"
    );
    assert_eq!(common::done(&text), common::done(&calm_text));
    assert!(text.contains("resuming from"), "{text}");
}

/// The value at `path` (mapping keys) in `doc`.
fn at<'y>(doc: &'y Yaml, path: &[&str]) -> &'y Yaml {
    path.iter().fold(doc, |y, k| &y[*k])
}

#[test]
fn the_kubernetes_manifest_is_an_indexed_job_behind_a_headless_service() {
    let text = std::fs::read_to_string(root().join("deploy/kubernetes/pipe-job.yaml")).unwrap();
    let docs = YamlLoader::load_from_str(&text).unwrap();
    assert_eq!(docs.len(), 2);
    let service = docs
        .iter()
        .find(|d| d["kind"].as_str() == Some("Service"))
        .unwrap();
    let job = docs
        .iter()
        .find(|d| d["kind"].as_str() == Some("Job"))
        .unwrap();
    assert_eq!(at(service, &["spec", "clusterIP"]).as_str(), Some("None"));
    assert_eq!(
        at(service, &["spec", "publishNotReadyAddresses"]).as_bool(),
        Some(true)
    );
    let service_name = at(service, &["metadata", "name"]).as_str().unwrap();
    let job_name = at(job, &["metadata", "name"]).as_str().unwrap();
    assert_eq!(
        at(service, &["spec", "selector", "job-name"]).as_str(),
        Some(job_name)
    );
    let spec = &job["spec"];
    assert_eq!(spec["completionMode"].as_str(), Some("Indexed"));
    let n = spec["completions"].as_i64().unwrap();
    assert_eq!(spec["parallelism"].as_i64(), Some(n));
    let pod = at(spec, &["template", "spec"]);
    assert_eq!(pod["subdomain"].as_str(), Some(service_name));
    let container = &pod["containers"][0];
    let command: Vec<&str> = container["command"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert_eq!(command, ["pipe", "worker"]);
    let mut args: Vec<String> = container["args"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    // The cluster the header's commands make, with the pods' DNS names.
    let d = fresh_dir("k8s");
    let addrs: Vec<String> = (0..n)
        .map(|i| format!("{job_name}-{i}.{service_name}:29400"))
        .collect();
    let init = common::pipe_command(&[])
        .args(["cluster", "init", "--workers", &n.to_string(), "--addrs"])
        .arg(addrs.join(","))
        .arg("-o")
        .arg(&d)
        .output()
        .unwrap();
    assert!(init.status.success(), "{init:?}");
    let cluster = args.iter().position(|a| a == "--cluster").unwrap();
    args[cluster + 1] = d.join("cluster.toml").to_string_lossy().into_owned();
    // With a rank outside the cluster, `pipe worker` gets as far as checking the rank: every
    // argument parsed, the run's settings resolved and the cluster file read.
    let out = common::pipe_command(&[])
        .arg("worker")
        .args(&args)
        .env("JOB_COMPLETION_INDEX", n.to_string())
        .args(["--dataset", "synthetic"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!(
            "rank {n} (from JOB_COMPLETION_INDEX) in a cluster of {n}"
        )),
        "{err}"
    );
    let stages: i64 = args[args.iter().position(|a| a == "--stages").unwrap() + 1]
        .parse()
        .unwrap();
    let replicas: i64 = args[args.iter().position(|a| a == "--replicas").unwrap() + 1]
        .parse()
        .unwrap();
    assert_eq!(stages * replicas, n, "completions must equal the workers");
    // A replaced pod resumes from the newest checkpoint; bad input fails the Job at once.
    let value = |flag: &str| args[args.iter().position(|a| a == flag).unwrap() + 1].clone();
    assert_eq!(value("--resume"), "auto");
    assert_eq!(value("--checkpoint-dir"), "/checkpoints");
    assert!(spec["backoffLimit"].as_i64().unwrap() >= n);
    assert_eq!(pod["restartPolicy"].as_str(), Some("Never"));
    let rule = &at(spec, &["podFailurePolicy", "rules"])[0];
    assert_eq!(rule["action"].as_str(), Some("FailJob"));
    assert_eq!(rule["onExitCodes"]["values"][0].as_i64(), Some(2));
    // An evicted pod (SIGTERM: rank 0 checkpoints) is replaced without counting as a failure.
    let evicted = &at(spec, &["podFailurePolicy", "rules"])[1];
    assert_eq!(evicted["action"].as_str(), Some("Ignore"));
    assert_eq!(
        evicted["onPodConditions"][0]["type"].as_str(),
        Some("DisruptionTarget")
    );
    assert!(
        pod["terminationGracePeriodSeconds"]
            .as_i64()
            .is_some_and(|s| s >= 30)
    );
    let mounts = container["volumeMounts"].as_vec().unwrap();
    assert!(
        mounts
            .iter()
            .any(|m| m["mountPath"].as_str() == Some("/checkpoints"))
    );
}

#[test]
fn the_two_host_cluster_file_is_what_cluster_init_writes() {
    let shipped = std::fs::read_to_string(root().join("deploy/two-hosts/cluster.toml")).unwrap();
    let d = fresh_dir("two-hosts");
    let addrs = shipped
        .lines()
        .filter_map(|l| l.strip_prefix("addr = "))
        .map(|a| a.trim_matches('"'))
        .collect::<Vec<_>>()
        .join(",");
    assert_eq!(addrs, "10.0.0.1:29400,10.0.0.2:29400");
    let init = common::pipe_command(&[])
        .args(["cluster", "init", "--workers", "2", "--addrs", &addrs, "-o"])
        .arg(&d)
        .output()
        .unwrap();
    assert!(init.status.success(), "{init:?}");
    let made = std::fs::read_to_string(d.join("cluster.toml")).unwrap();
    let body = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| !l.starts_with('#') && !l.starts_with("run_id"))
            .map(str::to_string)
            .collect()
    };
    assert_eq!(body(&shipped), body(&made));
    // With the credentials next to it, pipe worker reads the shipped file.
    std::fs::copy(
        root().join("deploy/two-hosts/cluster.toml"),
        d.join("cluster.toml"),
    )
    .unwrap();
    let out = common::pipe_command(&[])
        .args(["worker", "--cluster"])
        .arg(d.join("cluster.toml"))
        .args(["--rank", "2", "--stages", "2", "--dataset", "synthetic"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("rank 2 (from --rank) in a cluster of 2"),
        "{err}"
    );
}
