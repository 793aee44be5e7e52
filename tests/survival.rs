//! A lost replica leaves its stage running (in process): a replica thread that panics mid-run
//! is dropped, and the run goes on with the stage's other replicas taking its microbatches.
//! Over a bf16 wire (each message copied anyway, and logged) the segment is taken over where
//! every worker stood; over the in-process f32 wire (tensors moved between threads, not
//! copied, so no message is logged) it is taken over where no logged message is needed, and
//! otherwise goes back to the latest update every stage had applied (the updates in flight run
//! again). Either way it ends with the weights of the new layout resumed by hand
//! from the update it went on from. The last replica of a stage cannot be lost that way; with
//! `--rejoin` a replacement takes the lost replica's place back at the next update boundary.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Output;

mod common;
use common::{done, fresh_dir, lost_replica, lost_then_rejoined, ok};

/// A small synthetic run of 120 updates ([`common::small_config`]): its config file.
fn small_config(d: &Path) -> String {
    common::small_config(d, "epochs = 100\nsteps = 120\n")
}

fn train(config: &str, ck: &Path, flags: &[impl AsRef<std::ffi::OsStr>]) -> Output {
    common::pipe_command(&["train", "--config", config, "--stages", "2"])
        .args(["--checkpoint-every", "20", "--keep-checkpoints", "100"])
        // Given, since its default follows the layout and a run keeps its own.
        .args(["--momentum", "0.5"])
        // Constant, so that a run cut short by `--steps` has the same numerics up to its end.
        .args(["--lr-schedule", "constant"])
        .arg("--checkpoint-dir")
        .arg(ck)
        .args(flags)
        .output()
        .unwrap()
}

/// The checkpoint at update `at` of the undisturbed run with `flags`, written into `ck`: the
/// run stopped there (`--steps`), which drains where the survivor went on (the learning rate
/// is constant, so the shorter run's numerics are the same up to there).
fn calm_checkpoint(config: &str, ck: &Path, at: u64, flags: &[String]) -> std::path::PathBuf {
    let mut with: Vec<String> = flags.to_vec();
    with.extend(["--steps".to_string(), at.to_string()]);
    ok(&train(config, ck, &with));
    ck.join(format!("ckpt-{at:08}"))
}

#[test]
fn a_lost_replica_leaves_its_stage_running_with_the_new_layouts_weights() {
    lost_replica_case("replica", &[], Recovery::Either);
}

/// Over a bf16 wire each message is copied as it is sent, so the workers' traffic is logged
/// and the segment is taken over where every worker stood.
#[test]
fn a_lost_replica_is_taken_over_where_messages_are_copied() {
    lost_replica_case(
        "replica-bf16",
        &["--wire-dtype", "bf16"],
        Recovery::TakenOver,
    );
}

/// The same with error feedback and with the adaptive DC-ASGD: the correction's memory is
/// part of the drained state the segment runs again from, so the weights are still the by-hand
/// resume's.
#[test]
fn a_lost_replica_is_survived_with_a_delay_correction() {
    lost_replica_case(
        "replica-feedback",
        &["--delay-correction", "error-feedback"],
        Recovery::Either,
    );
    lost_replica_case(
        "replica-dc-asgd",
        &[
            "--delay-correction",
            "dc-asgd-adaptive",
            "--wire-dtype",
            "bf16",
        ],
        Recovery::TakenOver,
    );
}

/// How a run recovers from a lost replica in process.
#[derive(Clone, Copy, PartialEq)]
enum Recovery {
    /// The segment taken over where every worker stood, or, where a message the takeover
    /// needs was not logged (threads over an f32 wire log none), back to the latest update
    /// every stage had applied (the updates in flight run again): which one depends on where
    /// each thread stood at the loss.
    Either,
    /// The segment taken over where every worker stood.
    TakenOver,
}

/// Worker 3 of `--replicas 2` panics in the third segment; the run recovers as `recovery`
/// says, goes on on [2, 1] from the update it names, and ends with the weights of the
/// undisturbed run's checkpoint there, resumed by hand on [2, 1]; `extra` flags go to every
/// run.
fn lost_replica_case(name: &str, extra: &[&str], recovery: Recovery) {
    let d = fresh_dir(name);
    let config = small_config(&d);
    let with = |flags: &[&str]| -> Vec<String> {
        flags.iter().chain(extra).map(|f| f.to_string()).collect()
    };
    // Worker 3 (stage 1, replica 1) panics at its 15th data message of the third segment.
    let out = train(
        &config,
        &d.join("survived"),
        &with(&["--replicas", "2", "--fault-schedule", "3:panic@15/2"]),
    );
    let text = ok(&out);
    let (line, from) = lost_replica(&text, "worker 3 (stage 1) lost:");
    assert!(line.contains("injected panic"), "{line}");
    // It names the update it went on from or was taken over at, one of the third segment's
    // (20 updates).
    match common::taken_over_at(line) {
        Some(at) => assert!(at > from.saturating_sub(20) && at <= from, "{line}"),
        None => assert!(
            recovery == Recovery::Either && line.contains("the updates in flight run again"),
            "{line}"
        ),
    }
    assert!(done(&text).starts_with("done: 120 steps"), "{text}");
    // The same run undisturbed, then resumed by hand from the update the survivor went on
    // from, with the stage's remaining replica.
    let undisturbed = done(&ok(&train(
        &config,
        &d.join("undisturbed"),
        &with(&["--replicas", "2"]),
    )));
    let at = calm_checkpoint(&config, &d.join("calm"), from, &with(&["--replicas", "2"]));
    let resumed = ok(&train(
        &config,
        &d.join("resumed"),
        &with(&["--replicas", "2,1", "--resume", at.to_str().unwrap()]),
    ));
    assert_eq!(done(&text), done(&resumed));
    assert_ne!(
        done(&text),
        undisturbed,
        "the layout change should show in the weights"
    );
}

#[test]
fn the_last_replica_of_a_stage_cannot_be_lost() {
    let d = fresh_dir("last");
    let config = small_config(&d);
    // Worker 2 is stage 1's only replica.
    let flags = ["--replicas", "2,1", "--fault-schedule", "2:panic@5/1"];
    let out = train(&config, &d.join("ck"), &flags);
    common::failed(&out, "injected panic");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("lost:"));
}

/// `--rejoin`: the lost replica is taken back at the next update boundary (a replacement worker
/// thread joins), and the run ends with the weights of the layout sequence it reports: the
/// undisturbed run's checkpoint at the loss, resumed by hand on the shrunk layout up to the
/// rejoin, then on the run's own layout to the end.
#[test]
fn a_lost_replica_rejoins_at_the_next_update_boundary() {
    let d = fresh_dir("rejoin");
    let config = small_config(&d);
    let out = train(
        &config,
        &d.join("rejoined"),
        &[
            "--replicas",
            "2",
            "--fault-schedule",
            "3:panic@15/2",
            "--rejoin",
        ],
    );
    let text = ok(&out);
    let (from, to) = lost_then_rejoined(&text, "worker 3 (stage 1) lost:");
    assert!(done(&text).starts_with("done: 120 steps"), "{text}");
    let at = calm_checkpoint(
        &config,
        &d.join("calm"),
        from,
        &["--replicas".into(), "2".into()],
    );
    // The replacement joined one update after the loss.
    assert_eq!(to, from + 1, "{text}");
    let shrunk = d.join("shrunk");
    let steps = to.to_string();
    ok(&train(
        &config,
        &shrunk,
        &[
            "--replicas",
            "2,1",
            "--resume",
            at.to_str().unwrap(),
            "--steps",
            &steps,
        ],
    ));
    let at = shrunk.join(format!("ckpt-{to:08}"));
    let resumed = ok(&train(
        &config,
        &d.join("resumed"),
        &["--replicas", "2", "--resume", at.to_str().unwrap()],
    ));
    assert_eq!(done(&text), done(&resumed));
}

/// `--rejoin` where it could do nothing is refused: no stage with two replicas.
/// A fault the worker never reaches (it sends fewer data messages than the fault waits for)
/// is named as never fired, and the run ends as the undisturbed one does.
#[test]
fn a_fault_that_never_fires_is_named() {
    let d = fresh_dir("never-fires");
    let config = small_config(&d);
    let flags = ["--replicas", "2", "--steps", "20"];
    let calm = train(&config, &d.join("calm"), &flags);
    let drilled = train(
        &config,
        &d.join("drilled"),
        &[&flags[..], &["--fault-schedule", "3:panic@99999999"]].concat(),
    );
    assert_eq!(done(&ok(&drilled)), done(&ok(&calm)));
    let err = String::from_utf8_lossy(&drilled.stderr);
    assert!(
        err.contains("fault schedule: worker 3's panic@99999999 never fired: it sent ")
            && err.contains(" data messages, not 99999999"),
        "{err}"
    );
    assert!(!String::from_utf8_lossy(&calm.stderr).contains("never fired"));
}

/// An entry for an attempt the run never made (a restart or segment that did not happen) is
/// named once the run has ended, on threads (where an attempt is a segment) and on worker
/// processes (a start), and the run ends as an undisturbed one.
#[test]
fn a_fault_for_an_attempt_never_made_is_named() {
    let d = fresh_dir("never-applied");
    let config = small_config(&d);
    let flags = ["--replicas", "2", "--steps", "20"];
    let calm = train(&config, &d.join("calm"), &flags);
    for placement in ["threads", "processes"] {
        let drilled = train(
            &config,
            &d.join(placement),
            &[
                &flags[..],
                &["--placement", placement],
                &["--fault-schedule", "3:panic@5/40,1:stall@2:1/41"],
            ]
            .concat(),
        );
        assert_eq!(done(&ok(&drilled)), done(&ok(&calm)), "{placement}");
        let err = String::from_utf8_lossy(&drilled.stderr);
        for entry in ["3's panic@5/40", "1's stall@2:1/41"] {
            let line = format!("fault schedule: worker {entry} never applied: the run made ");
            assert!(err.contains(&line), "{placement}: {err}");
        }
    }
    assert!(!String::from_utf8_lossy(&calm.stderr).contains("never applied"));
}

#[test]
fn rejoin_without_a_replicated_stage_is_refused() {
    let d = fresh_dir("rejoin-refused");
    let config = small_config(&d);
    let out = train(&config, &d.join("ck"), &["--rejoin"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--rejoin takes back a lost replica"), "{err}");
}

/// A divergence is the run's arithmetic, not a fault of the replica that met it: the stage's
/// other replicas, and a restart, would meet it too. So a replicated run whose loss goes
/// non-finite ends with exit 1 naming it, without dropping a replica or starting again, on
/// threads and on worker processes.
#[test]
fn a_divergence_in_a_replicated_stage_is_neither_survived_nor_restarted() {
    for placement in ["threads", "processes"] {
        let d = fresh_dir(&format!("diverged-{placement}"));
        let out = common::pipe_command(&["train", "--stages", "2", "--replicas", "2"])
            .args(["--lr", "1e30", "--steps", "4", "--max-restarts", "2"])
            .args(["--placement", placement, "--checkpoint-dir"])
            .arg(d.join("ck"))
            .output()
            .unwrap();
        let (stdout, err) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert_eq!(out.status.code(), Some(1), "{placement}: {err}");
        let last = err.lines().last().unwrap_or_default();
        assert!(
            last.contains("is not finite at update 2"),
            "{placement}: {err}"
        );
        for word in ["lost:", "restart", "past --max-restarts"] {
            assert!(
                !stdout.contains(word) && !err.contains(word),
                "{placement}: {err}"
            );
        }
    }
}
