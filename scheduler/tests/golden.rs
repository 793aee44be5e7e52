//! Golden text schedules: small cases of every policy, held as text under `tests/golden/` so a
//! change to a generator shows up as a reviewable diff. Regenerate with `PIPE_BLESS=1`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::path::PathBuf;

use pipe_scheduler::{
    Length, LowerOptions, Policy, ScheduleSpec, VersionPlan, generate, lower, validate,
};

struct Case {
    file: &'static str,
    spec: ScheduleSpec,
}

fn cases() -> Vec<Case> {
    let s = |policy, stages, m, updates| {
        ScheduleSpec::new(policy, stages, m).with_length(Length::Updates(updates))
    };
    vec![
        Case {
            file: "sequential",
            spec: s(Policy::Sequential, 3, 2, 2),
        },
        Case {
            file: "gpipe",
            spec: s(Policy::Gpipe, 3, 4, 2),
        },
        Case {
            file: "1f1b-flush",
            spec: s(Policy::OneFOneBFlush, 3, 4, 2),
        },
        Case {
            file: "interleaved",
            spec: s(Policy::Interleaved, 2, 4, 1).with_chunks(2),
        },
        Case {
            file: "zb-h1",
            spec: s(Policy::ZbH1, 3, 4, 1),
        },
        Case {
            file: "pipedream",
            spec: s(Policy::PipeDream, 3, 1, 6),
        },
        Case {
            file: "pipedream-2-1-1",
            spec: s(Policy::PipeDream, 3, 1, 4).with_replicas(vec![2, 1, 1]),
        },
        Case {
            file: "pipedream-nostash",
            spec: s(Policy::PipeDreamNoStash, 3, 1, 6),
        },
        Case {
            file: "vsync",
            spec: s(Policy::VerticalSync, 3, 1, 6),
        },
        Case {
            file: "2bw",
            spec: s(Policy::TwoBw, 3, 2, 4),
        },
        Case {
            file: "zb-v",
            spec: s(Policy::ZbV, 2, 4, 1),
        },
        Case {
            file: "dualpipev",
            spec: s(Policy::DualPipeV, 2, 4, 1),
        },
    ]
}

fn render(spec: &ScheduleSpec) -> String {
    let schedule = generate(spec).unwrap();
    let lowered = lower(&schedule, LowerOptions::default());
    validate::check(&lowered).unwrap();
    let plan = VersionPlan::derive(&lowered).unwrap();
    let mut out = format!("# {spec:?}\n# programs\n{}", schedule.to_text());
    out.push_str("# lowered\n");
    out.push_str(&lowered.to_text());
    out.push_str("# versions: forward/backward of each microbatch, per stage\n");
    for s in 0..plan.stages() {
        write!(out, "# s{s}:").unwrap();
        for mb in 0..plan.microbatches() {
            write!(
                out,
                " {}/{}",
                plan.forward_version(s, mb),
                plan.backward_version(s, mb)
            )
            .unwrap();
        }
        out.push('\n');
    }
    out
}

#[test]
fn golden_schedules() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let bless = std::env::var_os("PIPE_BLESS").is_some();
    for case in cases() {
        let path = dir.join(format!("{}.txt", case.file));
        let text = render(&case.spec);
        if bless {
            std::fs::write(&path, &text).unwrap();
            continue;
        }
        let want = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (run with PIPE_BLESS=1)", path.display()));
        assert_eq!(text, want, "{} changed (PIPE_BLESS=1 to accept)", case.file);
    }
}

#[test]
fn golden_text_parses_back() {
    for case in cases() {
        let schedule = generate(&case.spec).unwrap();
        let lowered = lower(&schedule, LowerOptions::default());
        let parsed = schedule.clone().with_text(&lowered.to_text()).unwrap();
        assert_eq!(parsed, lowered, "{}", case.file);
        validate::check(&parsed).unwrap();
    }
}

#[test]
fn a_broken_text_schedule_is_reported_on_its_grid() {
    let spec = ScheduleSpec::new(Policy::OneFOneBFlush, 2, 2);
    let schedule = generate(&spec).unwrap();
    // Worker 1 backwards microbatch 1 before forwarding it.
    let text = "w0: s0F0 s0F1 s0B0 s0B1 s0U0\nw1: s1F0 s1B1 s1B0 s1F1 s1U0\n";
    let err = validate::validate(&schedule.clone().with_text(text).unwrap()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("worker 1, step 1 (s1B1): backward of microbatch 1 before its forward"),
        "{msg}"
    );
    assert!(msg.contains("[s1B1]"), "{msg}");
    // Worker 0 waits for microbatch 1's gradient before sending its activation: the dry run
    // finds the deadlock and says where.
    let text = "w0: s0F0 s0F0>1 s0F1 s0B1<1 s0F1>1 s0B1 s0B0<1 s0B0 s0U0\n\
                w1: s1F0<0 s1F0 s1B0 s1B0>0 s1F1<0 s1F1 s1B1 s1B1>0 s1U0\n";
    let parsed = schedule.clone().with_text(text).unwrap();
    validate::validate(&parsed).unwrap();
    let msg = validate::dry_run(&parsed).unwrap_err().to_string();
    assert!(msg.starts_with("deadlock"), "{msg}");
    assert!(msg.contains("[s0B1<1]"), "{msg}");
}
