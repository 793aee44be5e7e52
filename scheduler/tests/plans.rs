//! Version plans against their closed forms on straight pipelines (the policies of `docs/scheduling.md`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_scheduler::{
    Length, LowerOptions, Policy, ScheduleSpec, VersionPlan, generate, lower, validate,
};

fn plan(policy: Policy, stages: u32, m: u32, updates: u32) -> (VersionPlan, u32) {
    let spec = ScheduleSpec::new(policy, stages, m).with_length(Length::Updates(updates));
    let s = lower(&generate(&spec).unwrap(), LowerOptions::default());
    validate::check(&s).unwrap();
    (VersionPlan::derive(&s).unwrap(), s.total_microbatches())
}

fn clamp(v: i64) -> u32 {
    v.max(0) as u32
}

#[test]
fn pipedream_forward_is_n_minus_downstream_stages_and_backward_is_stashed() {
    for stages in 1..=6u32 {
        let (p, n) = plan(Policy::PipeDream, stages, 1, 40);
        for s in 0..stages {
            for mb in 0..n {
                let expect = clamp(i64::from(mb) - i64::from(stages - s - 1));
                assert_eq!(p.forward_version(s, mb), expect, "S={stages} s={s} n={mb}");
                assert_eq!(p.backward_version(s, mb), expect);
            }
        }
    }
}

#[test]
fn pipedream_stash_depth_is_stages_minus_stage() {
    for stages in 1..=6u32 {
        let (p, _) = plan(Policy::PipeDream, stages, 1, 40);
        for s in 0..stages {
            assert_eq!(p.peak_versions[s as usize], stages - s, "S={stages} s={s}");
            assert_eq!(p.peak_activations[s as usize], stages - s);
        }
    }
}

#[test]
fn nostash_backward_uses_the_latest_version() {
    for stages in 1..=6u32 {
        let (p, n) = plan(Policy::PipeDreamNoStash, stages, 1, 40);
        for s in 0..stages {
            for mb in 0..n {
                let fwd = clamp(i64::from(mb) - i64::from(stages - s - 1));
                assert_eq!(p.forward_version(s, mb), fwd);
                // With one microbatch per update, microbatches 0..n-1 have all been applied.
                assert_eq!(p.backward_version(s, mb), mb, "S={stages} s={s} n={mb}");
            }
            assert_eq!(p.peak_versions[s as usize], 1, "no stash: one version");
        }
    }
}

#[test]
fn vertical_sync_uses_the_input_stage_version_everywhere() {
    for stages in 1..=6u32 {
        let (p, n) = plan(Policy::VerticalSync, stages, 1, 40);
        for s in 0..stages {
            for mb in 0..n {
                let expect = clamp(i64::from(mb) - i64::from(stages - 1));
                assert_eq!(p.forward_version(s, mb), expect, "S={stages} s={s} n={mb}");
                assert_eq!(p.backward_version(s, mb), expect);
            }
        }
    }
}

#[test]
fn two_bw_minibatch_t_uses_version_t_minus_one() {
    for stages in 1..=6u32 {
        for m in [stages.saturating_sub(1).max(1), stages, 2 * stages] {
            let (p, n) = plan(Policy::TwoBw, stages, m, 10);
            for s in 0..stages {
                for mb in 0..n {
                    let expect = (mb / m).saturating_sub(1);
                    assert_eq!(p.forward_version(s, mb), expect, "S={stages} M={m} s={s}");
                    assert_eq!(p.backward_version(s, mb), expect);
                }
                // Double buffering: never more than the version in use, the one being made
                // and the current one.
                assert!(p.peak_versions[s as usize] <= 3, "S={stages} M={m} s={s}");
            }
        }
    }
}

#[test]
fn flush_policies_are_synchronous() {
    for policy in [
        Policy::Sequential,
        Policy::Gpipe,
        Policy::OneFOneBFlush,
        Policy::ZbH1,
        Policy::Interleaved,
    ] {
        for stages in 1..=4u32 {
            let m = 2 * stages;
            let (p, n) = plan(policy, stages, m, 5);
            for s in 0..p.stages() {
                for mb in 0..n {
                    assert_eq!(p.forward_version(s, mb), mb / m, "{policy} S={stages}");
                    assert_eq!(p.backward_version(s, mb), mb / m);
                }
                for k in 0..p.updates_at(s) {
                    let mut mbs: Vec<u32> = p.update(s, k).microbatches().collect();
                    mbs.sort_unstable();
                    assert_eq!(mbs, (k * m..(k + 1) * m).collect::<Vec<_>>());
                }
            }
        }
    }
}

#[test]
fn one_f_one_b_flush_holds_stages_minus_stage_activations() {
    let (p, _) = plan(Policy::OneFOneBFlush, 4, 8, 2);
    assert_eq!(p.peak_activations, vec![4, 3, 2, 1]);
    assert_eq!(p.peak_versions, vec![1, 1, 1, 1]);
    let (g, _) = plan(Policy::Gpipe, 4, 8, 2);
    assert_eq!(g.peak_activations, vec![8, 8, 8, 8]);
    // zb-h1 keeps 1F1B's peak (the input stage's) on every stage.
    let (z, _) = plan(Policy::ZbH1, 4, 8, 2);
    assert_eq!(z.peak_activations, vec![4, 4, 4, 4]);
}

#[test]
fn replicas_take_microbatches_round_robin_and_sum_together() {
    let spec = ScheduleSpec::new(Policy::PipeDream, 3, 1)
        .with_replicas(vec![2, 1, 1])
        .with_length(Length::Updates(6));
    let s = lower(&generate(&spec).unwrap(), LowerOptions::default());
    validate::check(&s).unwrap();
    let p = VersionPlan::derive(&s).unwrap();
    // Stage 0 has two replicas: each update sums one microbatch from each.
    assert_eq!(p.updates_at(0), 6);
    for k in 0..6 {
        assert_eq!(
            p.update(0, k).per_replica,
            vec![&[2 * k][..], &[2 * k + 1][..]]
        );
    }
    // Stages 1 and 2 update after every microbatch.
    assert_eq!(p.updates_at(1), 12);
    assert_eq!(p.update(2, 5).per_replica, vec![&[5u32][..]]);
}

/// A flush minibatch is `M` per replica of the most replicated stage, not `M x lcm(replicas)`:
/// with replicas `[2, 3]` and `M = 2` every update sums 6 microbatches, the three replicas of
/// stage 1 take 2 each, and stage 0's two replicas take 3 each (round-robin over the run, so
/// within one update their shares may differ by one). Asynchronous policies keep PipeDream's
/// `M r_s` per update of stage `s`.
#[test]
fn flush_minibatch_is_m_per_replica_of_the_widest_stage() {
    for policy in [Policy::OneFOneBFlush, Policy::Gpipe, Policy::ZbH1] {
        let spec = ScheduleSpec::new(policy, 2, 2)
            .with_replicas(vec![2, 3])
            .with_length(Length::Updates(5));
        let s = lower(&generate(&spec).unwrap(), LowerOptions::default());
        validate::check(&s).unwrap();
        assert_eq!(s.resolved.minibatch, 6, "{policy}");
        assert_eq!(s.total_microbatches(), 30, "{policy}");
        let p = VersionPlan::derive(&s).unwrap();
        for stage in 0..2 {
            assert_eq!(p.updates_at(stage), 5, "{policy} stage {stage}");
            for k in 0..5 {
                let sums = p.update(stage, k);
                let mut mbs: Vec<u32> = sums.microbatches().collect();
                mbs.sort_unstable();
                assert_eq!(mbs, (6 * k..6 * k + 6).collect::<Vec<_>>(), "{policy}");
                let shares: Vec<usize> = sums.per_replica.iter().map(|r| r.len()).collect();
                let expect = if stage == 0 {
                    vec![3, 3]
                } else {
                    vec![2, 2, 2]
                };
                assert_eq!(shares, expect, "{policy} stage {stage} update {k}");
                for mb in sums.microbatches() {
                    assert_eq!(p.forward_version(stage, mb), k, "synchronous");
                }
            }
        }
    }
    let spec = ScheduleSpec::new(Policy::PipeDream, 2, 2)
        .with_replicas(vec![2, 3])
        .with_length(Length::Updates(2));
    let r = spec.resolve().unwrap();
    assert_eq!(
        r.minibatch, 12,
        "an asynchronous run is a whole number of M x lcm"
    );
    assert_eq!((r.update_size(0), r.update_size(1)), (4, 6));
}

/// With an odd minibatch over two replicas, the replicas' shares of one update differ by one
/// and alternate, and every microbatch is summed once.
#[test]
fn flush_shares_differ_by_one_when_the_minibatch_does_not_divide() {
    let spec = ScheduleSpec::new(Policy::OneFOneBFlush, 2, 1)
        .with_replicas(vec![2, 3])
        .with_length(Length::Updates(4));
    let s = lower(&generate(&spec).unwrap(), LowerOptions::default());
    validate::check(&s).unwrap();
    let p = VersionPlan::derive(&s).unwrap();
    let shares: Vec<Vec<usize>> = (0..4)
        .map(|k| p.update(0, k).per_replica.iter().map(|r| r.len()).collect())
        .collect();
    assert_eq!(shares, vec![vec![2, 1], vec![1, 2], vec![2, 1], vec![1, 2]]);
}

/// The version a replica has applied when it starts the forward of its local microbatch `i`
/// (its `i`-th microbatch of the stage): a 1F1B sequencer of in-flight depth `depth` has then
/// finished `i + 1 - depth` backwards (none while filling), and it updates after every `m`.
fn async_forward_version(i: u32, depth: u32, m: u32) -> u32 {
    (i + 1).saturating_sub(depth) / m
}

fn plan_with(
    policy: Policy,
    replicas: Vec<u32>,
    m: u32,
    updates: u32,
) -> (VersionPlan, u32, Vec<u32>) {
    let spec = ScheduleSpec::new(policy, replicas.len() as u32, m)
        .with_replicas(replicas)
        .with_length(Length::Updates(updates));
    let s = lower(&generate(&spec).unwrap(), LowerOptions::default());
    validate::check(&s).unwrap();
    let depths = s.resolved.depths.clone();
    (
        VersionPlan::derive(&s).unwrap(),
        s.total_microbatches(),
        depths,
    )
}

/// The asynchronous policies at `M > 1` on straight pipelines: the forward at stage `s` sees
/// `floor((n - (S - s - 1)) / M)` updates, so stage 0 is `S - 1` microbatches behind at every
/// `M`, and an update sums `M` consecutive microbatches.
#[test]
fn asynchronous_policies_at_several_microbatches_per_update() {
    for stages in 1..=5u32 {
        for m in [2u32, 3, 4] {
            let straight = vec![1; stages as usize];
            for policy in [
                Policy::PipeDream,
                Policy::PipeDreamNoStash,
                Policy::VerticalSync,
            ] {
                let (p, n, depths) = plan_with(policy, straight.clone(), m, 12);
                let want_depths: Vec<u32> = (0..stages).map(|s| stages - s).collect();
                assert_eq!(depths, want_depths, "{policy} S={stages}");
                for s in 0..stages {
                    for mb in 0..n {
                        let ctx = format!("{policy} S={stages} M={m} s={s} n={mb}");
                        let own = async_forward_version(mb, stages - s, m);
                        let input_stage = async_forward_version(mb, stages, m);
                        let (fwd, bwd) = match policy {
                            Policy::PipeDream => (own, own),
                            Policy::PipeDreamNoStash => (own, mb / m),
                            _ => (input_stage, input_stage),
                        };
                        assert_eq!(p.forward_version(s, mb), fwd, "{ctx} forward");
                        assert_eq!(p.backward_version(s, mb), bwd, "{ctx} backward");
                    }
                    for k in 0..p.updates_at(s) {
                        let mbs: Vec<u32> = p.update(s, k).microbatches().collect();
                        assert_eq!(mbs, (k * m..(k + 1) * m).collect::<Vec<_>>(), "{policy}");
                    }
                }
            }
        }
    }
}

/// Replicated and unequal layouts: microbatch `n` goes to replica `n mod r_s` as its local
/// microbatch `n / r_s`; each replica runs the same 1F1B sequencer at its position's depth
/// (pinned here: NOAM where it is kept; the searched depths where replica counts differ and
/// the search deepens them, `[2, 1, 1]` to 3, 2, 1 from NOAM's 2, 2, 1 and `[1, 2, 1]` to
/// 6, 2, 1 from 4, 2, 1), and the replicas
/// of a stage update together after `M` local backwards each. Vertical sync converts the
/// input stage's version into microbatches (`v M r_0`) and each stage takes its newest
/// version holding no other gradients; 2BW's minibatch `t` (of `M r_s` microbatches) uses
/// version `t - 1`.
#[test]
fn replicated_and_unequal_layouts_follow_their_closed_forms() {
    // (replicas, M, in-flight depth per stage for the asynchronous policies)
    let cases: [(&[u32], u32, &[u32]); 9] = [
        (&[2, 1, 1], 1, &[3, 2, 1]),
        (&[2, 1, 1], 2, &[3, 2, 1]),
        (&[2, 1, 1], 3, &[3, 2, 1]),
        (&[1, 2, 1], 1, &[6, 2, 1]),
        (&[1, 2, 1], 2, &[6, 2, 1]),
        (&[1, 2, 1], 3, &[6, 2, 1]),
        (&[3, 1], 1, &[2, 1]),
        (&[3, 1], 2, &[2, 1]),
        (&[2, 2, 2], 2, &[3, 2, 1]),
    ];
    for (replicas, m, want_depths) in cases {
        let r = |s: u32| replicas[s as usize];
        for policy in [
            Policy::PipeDream,
            Policy::PipeDreamNoStash,
            Policy::VerticalSync,
            Policy::TwoBw,
        ] {
            let m = if policy == Policy::TwoBw { m.max(3) } else { m };
            let (p, n, depths) = plan_with(policy, replicas.to_vec(), m, 8);
            if policy != Policy::TwoBw {
                assert_eq!(depths, want_depths, "{policy} {replicas:?} M={m} depths");
            }
            let stages = replicas.len() as u32;
            for s in 0..stages {
                for mb in 0..n {
                    let ctx = format!("{policy} {replicas:?} M={m} s={s} n={mb}");
                    let local = mb / r(s);
                    let own = async_forward_version(local, depths[s as usize], m);
                    let (fwd, bwd) = match policy {
                        Policy::PipeDream => (own, own),
                        Policy::PipeDreamNoStash => (own, local / m),
                        Policy::VerticalSync => {
                            let v0 = async_forward_version(mb / r(0), depths[0], m);
                            let v = v0 * m * r(0) / (m * r(s));
                            (v, v)
                        }
                        _ => {
                            let t = mb / (m * r(s));
                            (t.saturating_sub(1), t.saturating_sub(1))
                        }
                    };
                    assert_eq!(p.forward_version(s, mb), fwd, "{ctx} forward");
                    assert_eq!(p.backward_version(s, mb), bwd, "{ctx} backward");
                }
                for k in 0..p.updates_at(s) {
                    let sums = p.update(s, k);
                    assert_eq!(sums.per_replica.len(), r(s) as usize);
                    for (j, mbs) in sums.per_replica.iter().enumerate() {
                        let want: Vec<u32> =
                            (k * m..(k + 1) * m).map(|i| i * r(s) + j as u32).collect();
                        assert_eq!(mbs.to_vec(), want, "{policy} {replicas:?} s={s} k={k}");
                    }
                }
            }
        }
    }
}

#[test]
fn only_zero_bubble_splits_the_backward() {
    for policy in Policy::ALL {
        let chunks = if policy == Policy::Interleaved { 2 } else { 1 };
        // The V-shaped schedules need 2 x stages microbatches per update.
        let m = if policy.is_v_shaped() { 8 } else { 4 };
        let spec = ScheduleSpec::new(policy, 4, m)
            .with_chunks(chunks)
            .with_length(Length::Updates(3));
        let s = lower(&generate(&spec).unwrap(), LowerOptions::default());
        let split = s.programs.iter().flatten().any(|a| {
            matches!(
                a,
                pipe_scheduler::Action::BackwardInput { .. }
                    | pipe_scheduler::Action::BackwardWeight { .. }
            )
        });
        let whole = s
            .programs
            .iter()
            .flatten()
            .any(|a| matches!(a, pipe_scheduler::Action::Backward { .. }));
        // DualPipeV runs whole backwards in its steady state and splits them elsewhere.
        let zero_bubble = matches!(policy, Policy::ZbH1 | Policy::ZbV | Policy::DualPipeV);
        assert_eq!(split, zero_bubble, "{policy}: split backward");
        let all_split = matches!(policy, Policy::ZbH1 | Policy::ZbV);
        assert_eq!(whole, !all_split, "{policy}: whole backward");
    }
}

/// Every policy on a few layouts (interleaved with 2 chunks per worker; the V-shaped policies
/// with 2 x stages microbatches and uniform replicas), lowered and checked.
fn every_schedule() -> Vec<pipe_scheduler::Schedule> {
    let mut out = Vec::new();
    for policy in Policy::ALL {
        for replicas in [vec![1, 1, 1, 1], vec![2, 1, 1, 1], vec![2]] {
            let uniform = replicas.len() == 1 || replicas.iter().all(|&r| r == replicas[0]);
            let needs_uniform = policy == Policy::Interleaved || policy.is_v_shaped();
            if needs_uniform && !uniform || !needs_uniform && replicas.len() == 1 {
                continue;
            }
            let chunks = if policy == Policy::Interleaved { 2 } else { 1 };
            let m = if policy.is_v_shaped() { 8 } else { 4 };
            let spec = ScheduleSpec::new(policy, 4, m)
                .with_replicas(replicas)
                .with_chunks(chunks)
                .with_length(Length::Updates(3));
            let s = lower(&generate(&spec).unwrap(), LowerOptions::default());
            validate::check(&s).unwrap();
            out.push(s);
        }
    }
    out
}

#[test]
fn last_uses_are_the_last_action_reading_each_version() {
    for s in every_schedule() {
        let plan = VersionPlan::derive(&s).unwrap();
        let layout = s.layout();
        for w in 0..s.workers() {
            // Recomputed here from the plan's versions: forwards read the forward version,
            // every backward half the backward version.
            let mut want: Vec<Vec<usize>> = vec![Vec::new(); layout.chunks() as usize];
            for (pc, a) in s.programs[w as usize].iter().enumerate() {
                use pipe_scheduler::Action::*;
                let (stage, v) = match *a {
                    Forward { stage, mb } => (stage, plan.forward_version(stage, mb)),
                    Backward { stage, mb }
                    | BackwardInput { stage, mb }
                    | BackwardWeight { stage, mb } => (stage, plan.backward_version(stage, mb)),
                    _ => continue,
                };
                let uses = &mut want[layout.chunk_of(stage) as usize];
                if uses.len() <= v as usize {
                    uses.resize(v as usize + 1, 0);
                }
                uses[v as usize] = pc;
            }
            let got = plan.last_uses(&s, w);
            assert_eq!(got.len(), want.len(), "{} w{w}", s.resolved.policy);
            for (g, x) in got.iter().zip(&want) {
                // Versions past the last one read may be listed with 0.
                assert_eq!(&g[..x.len()], &x[..], "{} w{w}", s.resolved.policy);
                assert!(g[x.len()..].iter().all(|&u| u == 0));
            }
        }
    }
}

#[test]
fn versions_read_from_a_point_on_are_those_whose_last_use_is_there_or_later() {
    for s in every_schedule() {
        if s.layout().chunks() != 1 {
            continue;
        }
        let plan = VersionPlan::derive(&s).unwrap();
        for w in 0..s.workers() {
            let last = plan.last_uses_through_updates(&s, w);
            let uses = last.first().map(Vec::as_slice).unwrap_or(&[]);
            let len = s.programs[w as usize].len();
            let newest = uses.len() as u32 + 1;
            for from in 1..=len {
                for below in [1, newest / 2, newest] {
                    let want: std::collections::BTreeSet<u32> = (0..below)
                        .filter(|&v| uses.get(v as usize).is_some_and(|&u| u >= from))
                        .collect();
                    let got = plan.read_from(&s, w, from, below);
                    assert_eq!(
                        got, want,
                        "{} w{w} from {from} below {below}",
                        s.resolved.policy
                    );
                }
            }
        }
    }
}

#[test]
fn updates_per_stage_match_the_layout() {
    for s in every_schedule() {
        let plan = VersionPlan::derive(&s).unwrap();
        for st in 0..s.stages() {
            assert_eq!(
                plan.updates_at(st),
                s.resolved.updates_at(st),
                "{} stage {st}",
                s.resolved.policy
            );
        }
    }
}

#[test]
fn memory_peaks_in_bytes_agree_with_the_counts() {
    for s in every_schedule() {
        // One byte per version and per stashed microbatch of every stage: with one stage per
        // worker, bytes are counts.
        let (plan, mem) = VersionPlan::derive_with_memory(&s, |_| 1.0, |_| 1.0).unwrap();
        if s.layout().chunks() > 1 {
            continue;
        }
        for (w, m) in mem.iter().enumerate() {
            let p = s.resolved.policy;
            assert_eq!(m.weights, f64::from(plan.peak_versions[w]), "{p} w{w}");
            assert_eq!(
                m.activations,
                f64::from(plan.peak_activations[w]),
                "{p} w{w}"
            );
            assert!(
                m.total <= m.weights + m.activations && m.total >= m.weights.max(m.activations)
            );
        }
        // Bytes scale with what each stage holds.
        let (_, scaled) = VersionPlan::derive_with_memory(&s, |_| 3.0, |_| 5.0).unwrap();
        for (a, b) in mem.iter().zip(&scaled) {
            assert_eq!(b.weights, 3.0 * a.weights);
            assert_eq!(b.activations, 5.0 * a.activations);
        }
    }
}

#[test]
fn a_program_missing_a_backward_is_refused_naming_it() {
    let spec = ScheduleSpec::new(Policy::PipeDream, 3, 1).with_length(Length::Updates(5));
    let mut s = lower(&generate(&spec).unwrap(), LowerOptions::default());
    // Worker 1 (stage 1) loses its backward of microbatch 3.
    s.programs[1].retain(|a| !matches!(a, pipe_scheduler::Action::Backward { stage: 1, mb: 3 }));
    let err = VersionPlan::derive(&s).unwrap_err().to_string();
    assert!(
        err.contains("microbatch 3 never has a backward at stage 1"),
        "{err}"
    );
}
