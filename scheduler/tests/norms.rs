//! Norm plans: exact under flush policies, causal under asynchronous ones.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_scheduler::{
    Length, LowerOptions, NormPlan, Policy, ScheduleSpec, generate, lower, validate,
};

fn plan(spec: &ScheduleSpec) -> NormPlan {
    let schedule = lower(&generate(spec).unwrap(), LowerOptions::default());
    validate::check(&schedule).unwrap();
    NormPlan::derive(&schedule).unwrap()
}

fn spec(policy: Policy, stages: u32, m: u32) -> ScheduleSpec {
    let spec = ScheduleSpec::new(policy, stages, m).with_length(Length::Updates(6));
    match policy {
        Policy::Interleaved => spec.with_chunks(2),
        _ => spec,
    }
}

#[test]
fn flush_policies_add_every_stage_s_same_update() {
    for policy in Policy::ALL.into_iter().filter(|p| p.is_flush()) {
        let positions = if policy == Policy::Sequential { 1 } else { 4 };
        let p = plan(&spec(policy, positions, 8));
        assert!(p.is_exact(), "{policy}");
        // Model stages: the chunks of interleaved and V-shaped layouts count.
        let stages = p.sources(0, 0).len() as u32;
        assert!(stages >= positions, "{policy}");
        for s in 0..stages {
            for k in 0..6 {
                assert_eq!(p.sources(s, k), vec![Some(k); stages as usize], "{policy}");
                let others: Vec<u32> = (0..stages).filter(|&t| t != s).collect();
                assert_eq!(p.readers(s, k), others, "{policy}");
            }
        }
    }
}

/// PipeDream with one microbatch per update on 4 stages: update `k` of stage `s` has seen the
/// update `k - 1` of every stage after it (their gradients of its microbatch `k` left after
/// it), and of the stages before it the update whose forward chain reached it. Written out
/// by hand from the 1F1B order.
#[test]
fn pipedream_takes_the_newest_norm_that_reached_the_stage() {
    let p = plan(&spec(Policy::PipeDream, 4, 1));
    let row = |s: u32, k: u32| p.sources(s, k).to_vec();
    assert_eq!(row(0, 0), [Some(0), None, None, None]);
    assert_eq!(row(0, 3), [Some(3), Some(2), Some(2), Some(2)]);
    assert_eq!(row(3, 0), [None, None, None, Some(0)]);
    assert_eq!(row(3, 4), [Some(0), Some(1), Some(2), Some(4)]);
    assert_eq!(row(2, 3), [Some(0), Some(1), Some(3), Some(2)]);
    assert!(!p.is_exact());
}

#[test]
fn asynchronous_plans_are_causal_monotone_and_readers_match() {
    let cases = [
        spec(Policy::PipeDream, 4, 1),
        spec(Policy::PipeDream, 4, 4),
        spec(Policy::PipeDreamNoStash, 4, 2),
        spec(Policy::TwoBw, 4, 4),
        spec(Policy::VerticalSync, 4, 2),
        spec(Policy::PipeDream, 3, 2).with_replicas(vec![2, 1, 1]),
        spec(Policy::TwoBw, 3, 4).with_replicas(vec![1, 2, 1]),
    ];
    for case in cases {
        let p = plan(&case);
        let stages = case.stages;
        for s in 0..stages {
            let mut last = vec![None; stages as usize];
            let mut k = 0;
            while !p.sources(s, k).is_empty() {
                let row = p.sources(s, k);
                assert_eq!(row[s as usize], Some(k), "{case:?}");
                for (t, (&now, before)) in row.iter().zip(&last).enumerate() {
                    assert!(now >= *before, "{case:?}: stage {s} update {k} from {t}");
                    if let Some(j) = now.filter(|_| t as u32 != s) {
                        assert!(p.readers(t as u32, j).contains(&s), "{case:?}");
                    }
                }
                last = row.to_vec();
                k += 1;
            }
            assert!(k > 0, "{case:?}: stage {s} has no updates");
        }
    }
}
