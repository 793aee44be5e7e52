//! Property tests: for every policy, stages <= 8, replicas per stage <= 3 and M <= 32, the
//! generated schedule validates (lowered either way), the dry run completes, and the version
//! plan's invariants hold.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_scheduler::{
    Length, LowerOptions, Policy, ScheduleError, ScheduleSpec, VersionPlan, VersionRule, generate,
    lower, validate,
};
use proptest::prelude::*;

fn spec_strategy() -> impl Strategy<Value = ScheduleSpec> {
    (
        0..Policy::ALL.len(),
        1u32..=8,
        prop::collection::vec(1u32..=3, 8),
        1u32..=32,
        1u32..=3,
        1u32..=3,
        any::<bool>(),
    )
        .prop_map(|(p, stages, reps, m, updates, chunks, uniform)| {
            let policy = Policy::ALL[p];
            let mut replicas: Vec<u32> = reps[..stages as usize].to_vec();
            if uniform {
                replicas = vec![replicas[0]];
            }
            let (chunks, m) = if policy == Policy::Interleaved {
                // Interleaving needs M to be a multiple of the stage count.
                (chunks, (m.div_ceil(stages)).max(1) * stages)
            } else if policy.is_v_shaped() {
                // The V schedules need M >= 2 x stages.
                (1, m.max(2 * stages))
            } else {
                (1, m)
            };
            ScheduleSpec::new(policy, stages, m)
                .with_replicas(replicas)
                .with_chunks(chunks)
                .with_length(Length::Updates(updates))
        })
}

/// Checks everything the acceptance asks of one request.
fn check_spec(spec: &ScheduleSpec, expand: bool) -> Result<(), TestCaseError> {
    let generated = match generate(spec) {
        Ok(s) => s,
        // The requests a policy may refuse: interleaving and the V schedules over non-uniform
        // replication, and 2BW
        // with fewer microbatches per update than it keeps in flight.
        Err(ScheduleError::Spec(msg))
            if ((spec.policy == Policy::Interleaved || spec.policy.is_v_shaped())
                && msg.contains("same replica count"))
                || (spec.policy == Policy::TwoBw && msg.contains("2bw needs at least")) =>
        {
            return Ok(());
        }
        Err(e) => return Err(TestCaseError::fail(format!("{spec:?}: {e}"))),
    };
    validate::validate(&generated).map_err(|e| TestCaseError::fail(format!("{e}")))?;
    let lowered = lower(
        &generated,
        LowerOptions {
            expand_all_reduce: expand,
        },
    );
    validate::check(&lowered).map_err(|e| TestCaseError::fail(format!("{spec:?}\n{e}")))?;
    let plan = VersionPlan::derive(&lowered).map_err(|e| TestCaseError::fail(format!("{e}")))?;
    let r = &generated.resolved;
    let n = r.total;
    for s in 0..generated.stages() {
        // Every microbatch's gradient is summed into exactly one update of every stage.
        let mut seen = vec![0u32; n as usize];
        for k in 0..plan.updates_at(s) {
            for mb in plan.update(s, k).microbatches() {
                seen[mb as usize] += 1;
            }
        }
        prop_assert!(
            seen.iter().all(|&c| c == 1),
            "stage {s}: gradient counts {seen:?}"
        );
        for mb in 0..n {
            let (f, b) = (plan.forward_version(s, mb), plan.backward_version(s, mb));
            match spec.policy.version_rule() {
                VersionRule::Latest => prop_assert!(b >= f),
                _ => prop_assert_eq!(f, b, "stage {} mb {}: stashing must reuse", s, mb),
            }
            if spec.policy.is_flush() {
                prop_assert_eq!(f, mb / r.minibatch, "flush policies are synchronous");
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, ..ProptestConfig::default() })]

    #[test]
    fn every_generated_schedule_validates(spec in spec_strategy(), expand in any::<bool>()) {
        check_spec(&spec, expand)?;
    }
}

/// Every policy at every stage count and replica count, deterministically (the proptest above
/// samples; this sweeps the corners it might miss).
#[test]
fn sweep_every_policy_small() {
    for policy in Policy::ALL {
        for stages in 1..=4u32 {
            for replicas in [vec![1], vec![2], vec![3], vec![2, 1, 3, 1]] {
                let replicas = if replicas.len() > 1 {
                    replicas[..stages as usize].to_vec()
                } else {
                    replicas
                };
                for m in [1u32, 2, 4, 5] {
                    let m = if policy == Policy::Interleaved {
                        m * stages
                    } else if policy.is_v_shaped() {
                        m + 2 * stages - 1
                    } else {
                        m
                    };
                    let spec = ScheduleSpec::new(policy, stages, m)
                        .with_replicas(replicas.clone())
                        .with_chunks(if policy == Policy::Interleaved { 2 } else { 1 })
                        .with_length(Length::Updates(3));
                    check_spec(&spec, stages % 2 == 0).unwrap();
                }
            }
        }
    }
}
