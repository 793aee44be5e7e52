//! ZB-V and DualPipeV: valid for every shape they accept, synchronous version plans, and the
//! makespan of the published schedules when forward, input-backward and weight-backward cost
//! the same.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_scheduler::validate::check;
use pipe_scheduler::{
    Action, CostModel, Length, LowerOptions, Policy, ScheduleSpec, SimOptions, StageCost,
    VersionPlan, generate, lower, simulate,
};

const V_POLICIES: [Policy; 2] = [Policy::ZbV, Policy::DualPipeV];

fn unit_split() -> CostModel {
    CostModel::uniform(StageCost {
        backward_input: 1.0,
        backward_weight: 1.0,
        ..StageCost::compute(1.0, 0.0)
    })
}

/// Every accepted shape is valid (placement, order, no deadlock), and its version plan is a
/// flush's: every pass of minibatch t uses version t, every update sums its whole minibatch.
#[test]
fn every_accepted_shape_is_valid_and_synchronous() {
    for policy in V_POLICIES {
        for p in 1..=6u32 {
            for reps in [1u32, 2, 3] {
                for m in [2 * p, 2 * p + 1, 3 * p + 2] {
                    let spec = ScheduleSpec::new(policy, p, m)
                        .with_replicas(vec![reps])
                        .with_length(Length::Updates(2));
                    let what = format!("{policy} p={p} r={reps} m={m}");
                    let s = generate(&spec).unwrap();
                    assert_eq!(s.stages(), 2 * p, "{what}");
                    check(&lower(&s, LowerOptions::default())).expect(&what);
                    let plan = VersionPlan::derive(&s).expect(&what);
                    let minibatch = m * reps;
                    for stage in 0..s.stages() {
                        assert_eq!(plan.updates_at(stage), 2, "{what}");
                        for mb in 0..s.total_microbatches() {
                            let t = mb / minibatch;
                            assert_eq!(plan.forward_version(stage, mb), t, "{what} s{stage}F{mb}");
                            assert_eq!(plan.backward_version(stage, mb), t, "{what} s{stage}B{mb}");
                        }
                        for k in 0..2 {
                            let mut sums: Vec<u32> = plan.update(stage, k).microbatches().collect();
                            sums.sort_unstable();
                            let want: Vec<u32> = (k * minibatch..(k + 1) * minibatch).collect();
                            assert_eq!(sums, want, "{what} s{stage}U{k}");
                        }
                    }
                }
            }
        }
    }
}

/// Worker `p` holds stages `p` and `2P - 1 - p`: the input and the loss stage share worker 0,
/// the V turns on the last worker.
#[test]
fn chunks_are_placed_in_a_v() {
    for policy in V_POLICIES {
        let s = generate(&ScheduleSpec::new(policy, 4, 8)).unwrap();
        for (w, want) in [(0, [0, 7]), (1, [1, 6]), (2, [2, 5]), (3, [3, 4])] {
            let stages: Vec<u32> = s.layout().stages_of(w).collect();
            assert_eq!(stages, want, "{policy} worker {w}");
            for a in &s.programs[w as usize] {
                assert!(want.contains(&a.stage()), "{policy}: {a} on worker {w}");
            }
        }
    }
}

/// With F = I = W = 1 per chunk, each worker computes 6m units per minibatch; the last worker
/// cannot start before microbatch 0 has crossed the `P - 1` workers above it, so no schedule
/// beats `6m + P - 1`. Both schedules reach that bound. Over several minibatches ZB-V pays the
/// fill once (each minibatch's warm-up overlaps the previous one's drain: a flush waits only
/// for the stage's own update), DualPipeV once per minibatch (measured here, not derived: its
/// drain and the next warm-up do not overlap).
#[test]
fn makespan_is_the_fill_bound_with_equal_f_i_w() {
    for policy in V_POLICIES {
        for p in 1..=6u32 {
            for m in [2 * p, 2 * p + 3, 5 * p] {
                for updates in [1u32, 3] {
                    let spec =
                        ScheduleSpec::new(policy, p, m).with_length(Length::Updates(updates));
                    let s = lower(&generate(&spec).unwrap(), LowerOptions::default());
                    let r = simulate(&s, &unit_split(), SimOptions::default()).unwrap();
                    let fills = if policy == Policy::ZbV { 1 } else { updates };
                    let want = f64::from(updates) * 6.0 * f64::from(m)
                        + f64::from(fills) * f64::from(p - 1);
                    assert!(
                        (r.makespan - want).abs() < 1e-9,
                        "{policy} p={p} m={m} x{updates}: {} vs {want}",
                        r.makespan
                    );
                }
            }
        }
    }
}

/// ZB-V splits every backward; DualPipeV runs whole backwards in its steady state and splits
/// them only in the warm-up and the drain.
#[test]
fn backward_split_where_each_schedule_splits_it() {
    let kinds = |policy| {
        let s = generate(&ScheduleSpec::new(policy, 4, 12)).unwrap();
        let all: Vec<Action> = s.programs.iter().flatten().copied().collect();
        let whole = all
            .iter()
            .filter(|a| matches!(a, Action::Backward { .. }))
            .count();
        let split = all
            .iter()
            .filter(|a| matches!(a, Action::BackwardInput { .. }))
            .count();
        let weight = all
            .iter()
            .filter(|a| matches!(a, Action::BackwardWeight { .. }))
            .count();
        (whole, split, weight)
    };
    assert_eq!(kinds(Policy::ZbV), (0, 96, 96));
    let (whole, split, weight) = kinds(Policy::DualPipeV);
    assert_eq!(whole + split, 96);
    assert_eq!(split, weight);
    assert!(
        whole > 0 && split > 0,
        "dualpipev: {whole} whole, {split} split"
    );
}

/// Shapes the V schedules cannot run are refused with a message that names the rule.
#[test]
fn impossible_shapes_are_refused() {
    for policy in V_POLICIES {
        let err = |spec: ScheduleSpec| generate(&spec).unwrap_err().to_string();
        assert!(err(ScheduleSpec::new(policy, 4, 7)).contains("at least 2 x stages = 8"));
        assert!(
            err(ScheduleSpec::new(policy, 2, 4).with_replicas(vec![2, 1]))
                .contains("same replica count")
        );
        assert!(err(ScheduleSpec::new(policy, 2, 4).with_chunks(3)).contains("exactly 2 chunks"));
        assert!(generate(&ScheduleSpec::new(policy, 2, 4).with_chunks(2)).is_ok());
    }
}
