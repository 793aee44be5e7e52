//! What a refused command leaves: every byte that was there before. A fresh run beside another
//! run's checkpoints, a seed checkpoint into them, and each writer (export, cluster init, plan
//! `-o`, a checkpoint, tokenize) given one bad input among its inputs are refused, and the
//! directory tree they would have written into has the same digest after as before. A second
//! run on a running run's log or checkpoints is refused. And a run whose update goes
//! non-finite fails, naming the update, with no checkpoint of it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use sha2::{Digest, Sha256};

mod common;
use common::{fresh_dir, ok, pipe, refused, s};

/// SHA-256 over every path under `root` (relative, sorted) with its kind and contents, and
/// its permission bits: two trees with one digest hold the same files with the same bytes.
fn tree_digest(root: &Path) -> String {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<(String, Vec<u8>)>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().flatten().collect();
        entries.sort_by_key(std::fs::DirEntry::file_name);
        for e in entries {
            let path = e.path();
            let rel = path.strip_prefix(root).unwrap().display().to_string();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            #[cfg(unix)]
            let mode = std::os::unix::fs::PermissionsExt::mode(&meta.permissions());
            #[cfg(not(unix))]
            let mode = 0;
            if meta.is_dir() {
                out.push((format!("{rel}/ {mode:o}"), Vec::new()));
                walk(&path, root, out);
            } else if meta.is_file() {
                out.push((format!("{rel} {mode:o}"), std::fs::read(&path).unwrap()));
            } else {
                // A FIFO or a link: its kind, not its contents (a FIFO's read would block).
                out.push((format!("{rel} {mode:o} {:?}", meta.file_type()), Vec::new()));
            }
        }
    }
    let mut all = Vec::new();
    walk(root, root, &mut all);
    let mut h = Sha256::new();
    for (name, bytes) in &all {
        h.update(name.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    format!("{:x} ({} entries)", h.finalize(), all.len())
}

/// Runs `args`, which must be refused as bad input naming `needle`, and asserts that `root`
/// is byte for byte what it was.
#[track_caller]
fn refused_untouched(root: &Path, args: &[&str], needle: &str) {
    let before = tree_digest(root);
    refused(&pipe(args), &[needle]);
    assert_eq!(
        tree_digest(root),
        before,
        "pipe {args:?} changed {}",
        root.display()
    );
}

#[test]
fn a_run_beside_another_runs_checkpoints_leaves_them_as_they_were() {
    let d = fresh_dir("checkpoints");
    let ck = d.join("ck");
    let every = [
        "--threads",
        "1",
        "--checkpoint-dir",
        s(&ck),
        "--checkpoint-every",
        "1",
    ];
    ok(&pipe(&[&["train", "--steps", "3"], &every[..]].concat()));
    // A fresh run, another model's fresh run, a seed checkpoint, and a run resumed from an
    // older checkpoint inside the directory (it would replace the later ones).
    let other_model = ["train", "--model", "mlp-784-32-10", "--steps", "1"];
    let older = ck.join("ckpt-00000002");
    for (args, needle) in [
        (
            &["train", "--steps", "1"][..],
            "holds another run's checkpoints",
        ),
        (&other_model[..], "holds another run's checkpoints"),
        (
            &["train", "--seed-checkpoint"][..],
            "continue that run with --resume auto",
        ),
        (
            &["train", "--steps", "5", "--resume", s(&older)][..],
            "is not the latest checkpoint",
        ),
    ] {
        refused_untouched(&d, &[args, &every[..]].concat(), needle);
    }
    // The run itself continues: the checkpoint `latest` names is resumed and written past.
    let resumed = ok(&pipe(
        &[
            &["train", "--steps", "4", "--resume", "auto"][..],
            &every[..],
        ]
        .concat(),
    ));
    assert!(resumed.contains("resuming from"), "{resumed}");
    assert!(ck.join("ckpt-00000004").is_dir());
    std::fs::remove_dir_all(&d).unwrap();
}

/// A log named by a run that is refused late (its checkpoint has nothing left to train, found
/// after the data was read) keeps what it held; a log or trace that would replace what the run
/// reads, or its checkpoint directory's checkpoints, is refused before the run; a log of the
/// user's beside the checkpoints is the user's to name.
#[test]
fn a_refused_run_leaves_its_log_and_no_output_replaces_what_the_run_reads() {
    let d = fresh_dir("log");
    let ck = d.join("ck");
    let every = ["--threads", "1", "--checkpoint-dir", s(&ck)];
    ok(&pipe(&[&["train", "--steps", "2"], &every[..]].concat()));
    let log = d.join("notes.jsonl");
    std::fs::write(&log, "the user's\n").unwrap();
    let resumed = [&["train", "--steps", "2", "--resume", "latest"], &every[..]].concat();
    refused_untouched(
        &d,
        &[&resumed[..], &["--log-jsonl", s(&log)]].concat(),
        "nothing left to train",
    );
    let latest = ck.join("latest");
    let state = ck.join("ckpt-00000002").join("state.json");
    for (flag, target) in [("--log-jsonl", &latest), ("--log-jsonl", &state)] {
        refused_untouched(
            &d,
            &[&resumed[..], &[flag, s(target)]].concat(),
            "give a file outside what the command reads",
        );
    }
    // The same through --resume naming the checkpoint directory itself.
    refused_untouched(
        &d,
        &[
            "train",
            "--steps",
            "2",
            "--threads",
            "1",
            "--resume",
            s(&ck),
            "--log-jsonl",
            s(&latest),
        ],
        "which --resume",
    );
    let beside = ck.join("train.jsonl");
    let more = [&["train", "--steps", "3", "--resume", "latest"], &every[..]].concat();
    ok(&pipe(&[&more[..], &["--log-jsonl", s(&beside)]].concat()));
    let text = std::fs::read_to_string(&beside).unwrap();
    assert!(text.contains("\"kind\":\"step\""), "{text}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// A second run given the log file or the checkpoint directory a run is writing is refused,
/// and the first run's log holds its lines only.
#[test]
fn a_second_run_on_a_running_runs_log_or_checkpoints_is_refused() {
    let d = fresh_dir("second-run");
    let (ck, log) = (d.join("ck"), d.join("run.jsonl"));
    let mut first = common::pipe_command(&[
        "train",
        "--steps",
        "1000000",
        "--threads",
        "1",
        "--checkpoint-dir",
        s(&ck),
        "--log-jsonl",
        s(&log),
    ])
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null())
    .spawn()
    .unwrap();
    common::wait_for(&log);
    let second = ["train", "--threads", "1"];
    refused(
        &pipe(&[&second[..], &["--steps", "2", "--log-jsonl", s(&log)]].concat()),
        &["--log-jsonl", "being written by another run"],
    );
    // Asked to continue the run: the directory's checkpoints are read, and the run refused.
    let resumed = [
        "--resume",
        "auto",
        "--steps",
        "2000000",
        "--checkpoint-dir",
        s(&ck),
    ];
    refused(
        &pipe(&[&second[..], &resumed[..]].concat()),
        &["--checkpoint-dir", "being written by another run"],
    );
    first.kill().unwrap();
    first.wait().unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.lines().all(|l| l.starts_with("{\"kind\":")), "{text}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// `pipe export` with a bad tokenizer, into a missing, an empty and an occupied directory.
#[test]
fn an_export_with_one_bad_input_writes_nothing() {
    let d = fresh_dir("writers");
    let ck = d.join("ck");
    ok(&pipe(&[
        "train",
        "--model",
        "gpt2-tiny",
        "--steps",
        "1",
        "--threads",
        "1",
        "--checkpoint-dir",
        s(&ck),
    ]));
    let bad_tokenizer = d.join("tokenizer.json");
    std::fs::write(&bad_tokenizer, "{ not a tokenizer").unwrap();
    let out = d.join("export");
    let export = |tokenizer: &Path| {
        vec![
            "export".to_string(),
            "--checkpoint".into(),
            s(&ck).into(),
            "--format".into(),
            "hf".into(),
            "--out".into(),
            s(&out).into(),
            "--tokenizer".into(),
            s(tokenizer).into(),
        ]
    };
    let args = export(&bad_tokenizer);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // The output directory missing, then empty: neither gains a file.
    refused_untouched(&d, &args, "tokenizer.json");
    assert!(!out.exists(), "no export directory is left behind");
    std::fs::create_dir(&out).unwrap();
    refused_untouched(&d, &args, "tokenizer.json");
    // An export into a directory that holds a file of the user's.
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let good = export(Path::new("/nonexistent-tokenizer.json"));
    let mut good: Vec<&str> = good.iter().map(String::as_str).collect();
    good.truncate(good.len() - 2);
    refused_untouched(&d, &good, "already holds files (notes.txt, ...)");
    std::fs::remove_file(out.join("notes.txt")).unwrap();
    ok(&pipe(&good));
    assert!(out.join("model.safetensors").is_file());

    std::fs::remove_dir_all(&d).unwrap();
}

/// `pipe cluster init` over a cluster or a file, and directory outputs named where a file is.
#[test]
fn a_cluster_is_never_written_over_a_cluster_or_a_file() {
    let d = fresh_dir("a_cluster_is_never_written_over_a_cluster_or_a_file");
    // A cluster over a cluster, and a new one with two ranks at one address.
    let cluster = d.join("cluster");
    ok(&pipe(&[
        "cluster",
        "init",
        "--workers",
        "2",
        "--out",
        s(&cluster),
    ]));
    refused_untouched(
        &d,
        &["cluster", "init", "--workers", "2", "--out", s(&cluster)],
        "is not empty",
    );
    refused_untouched(
        &d,
        &[
            "cluster",
            "init",
            "--workers",
            "2",
            "--addrs",
            "10.0.0.1:1,10.0.0.1:1",
            "--out",
            s(&cluster),
            "--force",
        ],
        "ranks 0 and 1 are both at 10.0.0.1:1",
    );

    // Directory outputs named where a file of the user's is: refused, the file left.
    let notes = d.join("notes");
    std::fs::write(&notes, "mine").unwrap();
    for args in [
        vec![
            "cluster",
            "init",
            "--workers",
            "2",
            "--out",
            s(&notes),
            "--force",
        ],
        vec!["train", "--steps", "1", "--checkpoint-dir", s(&notes)],
        vec![
            "train",
            "--steps",
            "1",
            "--checkpoint-dir",
            leak(&notes.join("ck")),
        ],
    ] {
        refused_untouched(&d, &args, "not a directory");
    }

    std::fs::remove_dir_all(&d).unwrap();
}

/// Single-file outputs: a plan with a bad input, outputs that are FIFOs or directories, and
/// `--costs-out` beside a cache that is a file.
#[test]
fn single_file_outputs_are_written_whole_and_only_where_asked() {
    let d = fresh_dir("single_file_outputs_are_written_whole_and_only_where_asked");
    let notes = d.join("notes");
    std::fs::write(&notes, "mine").unwrap();
    // A plan file of the user's, and a plan whose cost file is bad.
    let plan = d.join("plan.toml");
    std::fs::write(&plan, "# the user's\n").unwrap();
    let costs = d.join("costs.json");
    std::fs::write(&costs, "not json").unwrap();
    refused_untouched(
        &d,
        &[
            "plan",
            "--model",
            "mlp-784-32-10",
            "--workers",
            "2",
            "--transport",
            "shm",
            "--transport-costs",
            s(&costs),
            "-o",
            s(&plan),
        ],
        "transport cost file",
    );
    // Outputs that are not files to write: refused on the command line, before the work.
    let fifo = d.join("fifo");
    make_fifo(&fifo);
    for args in [
        vec!["plan", "--stages", "2", "-o", s(&fifo)],
        vec!["schedule", "--stages", "2", "-o", s(&d)],
        vec![
            "bench",
            "transport",
            "--costs-only",
            "--costs-out",
            s(&fifo),
        ],
        vec!["train", "--steps", "1", "--log-jsonl", s(&fifo)],
    ] {
        refused_untouched(&d, &args, "not a regular file: give a file to write");
    }

    // A cache "directory" that is a file: the costs are not kept, and --costs-out is written
    // all the same (the cache is an aid, the output was asked for).
    let costs_out = d.join("costs-out.json");
    let out = common::pipe_command(&["bench", "transport", "--costs-only"])
        .arg("--costs-out")
        .arg(&costs_out)
        .env("PIPE_CACHE_DIR", &notes)
        .output()
        .unwrap();
    let text = ok(&out);
    assert!(text.contains("not kept"), "{text}");
    assert!(costs_out.is_file(), "{text}");
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "mine");
    std::fs::remove_file(&costs_out).unwrap();

    std::fs::remove_dir_all(&d).unwrap();
}

/// `pipe tokenize` into a directory of the user's, and with an input that is not text.
#[test]
fn a_corpus_with_one_bad_input_writes_nothing() {
    let d = fresh_dir("a_corpus_with_one_bad_input_writes_nothing");
    // A corpus into a directory of the user's, and one whose last input is not text.
    let text = d.join("text");
    std::fs::create_dir(&text).unwrap();
    std::fs::write(text.join("a.txt"), "the first document. ".repeat(100)).unwrap();
    let corpus = d.join("corpus");
    std::fs::create_dir(&corpus).unwrap();
    std::fs::write(corpus.join("notes.txt"), "mine").unwrap();
    // Through a tokenizer file, which reads each input as it tokenizes it: the bad input is
    // met after the first shard is written.
    let bpe = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/data/tokenizers/shakespeare-bpe-1024.json"
    );
    let tokenize = ["tokenize", "--tokenizer", bpe, "--shard-tokens", "64"];
    let tokenize = [&tokenize[..], &["--input", s(&text)]].concat();
    let into = |out: &'static str| [&tokenize[..], &["--out", out]].concat();
    refused_untouched(
        &d,
        &into(leak(&corpus)),
        "already holds files (notes.txt, ...)",
    );
    std::fs::write(text.join("b.txt"), [0xff_u8, 0xfe, 0x00]).unwrap();
    let fresh_corpus = d.join("fresh-corpus");
    refused_untouched(&d, &into(leak(&fresh_corpus)), "b.txt");
    assert!(!fresh_corpus.exists(), "no corpus directory is left behind");
    std::fs::remove_file(text.join("b.txt")).unwrap();
    ok(&pipe(&into(leak(&fresh_corpus))));
    assert!(fresh_corpus.join("tokens.json").is_file());
    std::fs::remove_dir_all(&d).unwrap();
}

/// `path` as a string that lives as long as the test.
/// A results directory regenerated by `pipe report` whose `REPORT.md` links to a file
/// outside it, or whose `plots/` holds a file of the user's: refused, and the directory and
/// the linked file as they were (the report was written through the link, and the user's file
/// removed with the old plots).
#[test]
fn a_report_is_never_written_through_a_link_nor_over_a_users_file() {
    let root = fresh_dir("report");
    let results = root.join("results");
    std::fs::create_dir_all(results.join("plots")).unwrap();
    std::fs::copy(
        "experiments/staleness/gpt-mini/results.json",
        results.join("results.json"),
    )
    .unwrap();
    std::fs::write(root.join("keep.txt"), b"precious").unwrap();
    std::os::unix::fs::symlink(root.join("keep.txt"), results.join("REPORT.md")).unwrap();
    let report = ["report", "staleness", "--from", s(&results)];
    refused_untouched(&root, &report, "REPORT.md is a symbolic link");
    std::fs::remove_file(results.join("REPORT.md")).unwrap();
    std::fs::write(results.join("plots/notes.txt"), b"mine").unwrap();
    refused_untouched(&root, &report, "notes.txt is not a file the command writes");
    std::fs::remove_file(results.join("plots/notes.txt")).unwrap();
    ok(&pipe(&report));
    assert_eq!(std::fs::read(root.join("keep.txt")).unwrap(), b"precious");
}

/// `pipe bench` and `pipe experiment staleness` claim their output, and the sweep reads its
/// inputs, before anything runs: a directory holding another command's results, an output
/// that is a file and a figures file that does not read are refused at once, with nothing
/// written.
#[test]
fn a_sweep_or_experiment_is_refused_before_it_runs_where_it_would_replace_another_output() {
    let root = fresh_dir("sweep");
    let staleness = root.join("staleness");
    std::fs::create_dir_all(&staleness).unwrap();
    std::fs::copy(
        "experiments/staleness/gpt-mini/results.json",
        staleness.join("results.json"),
    )
    .unwrap();
    std::fs::write(root.join("keep.txt"), b"precious").unwrap();
    let report_only = root.join("report-only");
    std::fs::create_dir_all(&report_only).unwrap();
    std::fs::write(report_only.join("REPORT.md"), b"mine").unwrap();
    std::fs::write(root.join("numpy.json"), b"{\"zzz\": 1}").unwrap();
    let sweep = |out: &Path| vec!["bench", "--quick", "--in-process", "--out", leak(out)];
    for (args, needle) in [
        (
            sweep(&staleness),
            "holds a results.json that is not pipe bench's",
        ),
        (
            sweep(&report_only),
            "holds a REPORT.md with no results.json",
        ),
        (sweep(&root.join("keep.txt")), "not a directory"),
        (
            [
                &sweep(&root.join("new"))[..],
                &["--numpy", leak(&root.join("numpy.json"))],
            ]
            .concat(),
            "numpy.json",
        ),
        (
            [
                &sweep(&root.join("new"))[..],
                &["--criterion", leak(&root.join("keep.txt"))],
            ]
            .concat(),
            "keep.txt",
        ),
    ] {
        refused_untouched(&root, &args, needle);
    }
    // And the staleness experiment into the same directories.
    let bench = root.join("bench");
    std::fs::create_dir_all(&bench).unwrap();
    std::fs::copy("experiments/bench/results.json", bench.join("results.json")).unwrap();
    let experiment = |out: &Path| vec!["experiment", "staleness", "--quick", "--out", leak(out)];
    for (args, needle) in [
        (
            experiment(&bench),
            "holds a results.json that is not pipe experiment staleness's",
        ),
        (
            experiment(&report_only),
            "holds a REPORT.md with no results.json",
        ),
        (experiment(&root.join("keep.txt")), "not a directory"),
    ] {
        refused_untouched(&root, &args, needle);
    }
}

fn leak(path: &Path) -> &'static str {
    Box::leak(s(path).to_string().into_boxed_str())
}

/// A FIFO at `path` (through `mkfifo`, which every test machine has).
fn make_fifo(path: &Path) {
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success());
}

#[test]
fn an_update_that_goes_non_finite_fails_naming_it_with_no_checkpoint_of_it() {
    // At 1e30 the weights after update 1 are finite but overflow the forward: the epoch's
    // evaluation (before its checkpoint) finds it. Update 2's loss finds it mid-epoch.
    for (stages, steps, needle) in [
        (
            "1",
            "1",
            "the test loss (NaN) of the weights is not finite at update 1; the output of layer 3 (linear) overflows, the largest parameter up to it being layers.3.weight at magnitude",
        ),
        (
            "2",
            "1",
            "the test loss (NaN) of the weights is not finite at update 1; the output of layer 3 (linear) overflows, the largest parameter up to it being layers.3.weight at magnitude",
        ),
        (
            "1",
            "3",
            "the loss of microbatch 1 is not finite at update 2",
        ),
    ] {
        let d = fresh_dir(&format!("non-finite-{stages}-{steps}"));
        let ck = d.join("ck");
        let out = pipe(&[
            "train",
            "--stages",
            stages,
            "--lr",
            "1e30",
            "--steps",
            steps,
            "--threads",
            "1",
            "--checkpoint-dir",
            s(&ck),
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(needle), "{err}");
        // No checkpoint of the weights that went non-finite.
        let kept: Vec<_> = std::fs::read_dir(&ck)
            .map(|r| r.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(
            kept.iter()
                .all(|n| !n.to_string_lossy().starts_with("ckpt-")),
            "{kept:?}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}
