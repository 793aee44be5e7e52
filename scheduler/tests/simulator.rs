//! The simulator against the published closed forms (to 1e-9).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_scheduler::{
    CostModel, Length, LowerOptions, Policy, ScheduleSpec, SimOptions, SimReport, StageCost,
    generate, lower, simulate,
};

const TOL: f64 = 1e-9;

fn run(spec: &ScheduleSpec, costs: &CostModel) -> SimReport {
    simulate(&generate(spec).unwrap(), costs, SimOptions::default()).unwrap()
}

fn close(a: f64, b: f64, what: &str) {
    assert!(
        (a - b).abs() <= TOL * b.abs().max(1.0),
        "{what}: {a} vs {b}"
    );
}

#[test]
fn gpipe_and_1f1b_flush_bubble_is_p_minus_1_over_m_plus_p_minus_1() {
    for policy in [Policy::Gpipe, Policy::OneFOneBFlush] {
        for p in 1..=6u32 {
            for m in [1u32, 2, 4, 8, 13] {
                for updates in [1u32, 3] {
                    for (f, b) in [(1.0, 2.0), (0.3, 0.7)] {
                        let spec =
                            ScheduleSpec::new(policy, p, m).with_length(Length::Updates(updates));
                        let r = run(&spec, &CostModel::uniform(StageCost::compute(f, b)));
                        let expect = f64::from(p - 1) / f64::from(m + p - 1);
                        close(r.bubble_fraction, expect, &format!("{policy} p={p} m={m}"));
                        close(
                            r.makespan,
                            f64::from(updates) * f64::from(m + p - 1) * (f + b),
                            "makespan",
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn interleaved_bubble_is_p_minus_1_over_v_m_of_ideal() {
    for p in [2u32, 3, 4] {
        for v in [1u32, 2, 3, 4] {
            for m in [p, 2 * p, 4 * p] {
                // A worker's v chunks together cost f + b per microbatch.
                let (f, b) = (1.0, 2.0);
                let chunk = StageCost::compute(f / f64::from(v), b / f64::from(v));
                let spec = ScheduleSpec::new(Policy::Interleaved, p, m).with_chunks(v);
                let r = run(&spec, &CostModel::uniform(chunk));
                let ideal = f64::from(m) * (f + b);
                close(
                    (r.makespan - ideal) / ideal,
                    f64::from(p - 1) / f64::from(v * m),
                    &format!("interleaved p={p} v={v} m={m}"),
                );
            }
        }
    }
}

#[test]
fn zb_h1_has_a_third_of_1f1b_bubble_with_equal_f_b_w() {
    for p in 2..=6u32 {
        for m in [p, p + 1, 2 * p, 3 * p + 2] {
            let split = StageCost {
                backward_input: 1.0,
                backward_weight: 1.0,
                ..StageCost::compute(1.0, 0.0)
            };
            let costs = CostModel::uniform(split);
            let ideal = 3.0 * f64::from(m);
            let zb = run(&ScheduleSpec::new(Policy::ZbH1, p, m), &costs);
            let ofob = run(&ScheduleSpec::new(Policy::OneFOneBFlush, p, m), &costs);
            close(
                zb.makespan - ideal,
                (ofob.makespan - ideal) / 3.0,
                &format!("p={p} m={m}"),
            );
            close(
                zb.makespan - ideal,
                f64::from(p - 1),
                "zb-h1 bubble (p-1)(F+B-W)",
            );
        }
    }
}

#[test]
fn pipedream_pays_the_fill_once() {
    for p in 1..=6u32 {
        let (f, b, u) = (1.0, 2.0, 0.25);
        let cost = StageCost {
            update: u,
            ..StageCost::compute(f, b)
        };
        let costs = CostModel::uniform(cost);
        let at = |n: u32| {
            run(
                &ScheduleSpec::new(Policy::PipeDream, p, 1).with_length(Length::Microbatches(n)),
                &costs,
            )
        };
        let (short, long) = (at(50), at(150));
        // Every extra microbatch costs exactly one forward, backward and update: no bubble in
        // the steady state, whatever the depth of the pipeline.
        close(
            long.makespan - short.makespan,
            100.0 * (f + b + u),
            &format!("p={p}"),
        );
        // With free updates, the whole run is the fill plus one slot per microbatch.
        let free = run(
            &ScheduleSpec::new(Policy::PipeDream, p, 1).with_length(Length::Microbatches(50)),
            &CostModel::uniform(StageCost::compute(f, b)),
        );
        close(
            free.makespan,
            f64::from(50 + p - 1) * (f + b),
            "fill paid once",
        );
    }
}

#[test]
fn ring_all_reduce_costs_2_r_minus_1_over_r_of_the_parameters() {
    for r in [2u32, 3] {
        for expand in [false, true] {
            let cost = StageCost {
                param_bytes: 6.0e6,
                ..StageCost::compute(0.0, 0.0)
            };
            let costs = CostModel {
                bandwidth: 1.0e9,
                latency: 1.0e-5,
                overlap: true,
                ..CostModel::uniform(cost)
            };
            let spec = ScheduleSpec::new(Policy::PipeDream, 1, 1)
                .with_replicas(vec![r])
                .with_length(Length::Updates(4));
            let schedule = lower(
                &generate(&spec).unwrap(),
                LowerOptions {
                    expand_all_reduce: expand,
                },
            );
            let rep = simulate(&schedule, &costs, SimOptions::default()).unwrap();
            let rf = f64::from(r);
            let one = 2.0 * (rf - 1.0) / rf * 6.0e6 / 1.0e9 + 2.0 * (rf - 1.0) * 1.0e-5;
            close(rep.makespan, 4.0 * one, &format!("r={r} expand={expand}"));
        }
    }
}

#[test]
fn activation_transfers_cost_latency_plus_bytes_over_bandwidth() {
    // Two stages, one microbatch, no compute: forward hop then gradient hop.
    for overlap in [true, false] {
        let cost = StageCost {
            activation_bytes: 2.0e6,
            ..StageCost::compute(0.0, 0.0)
        };
        let costs = CostModel {
            bandwidth: 1.0e9,
            latency: 5.0e-6,
            overlap,
            ..CostModel::uniform(cost)
        };
        let rep = run(&ScheduleSpec::new(Policy::Gpipe, 2, 1), &costs);
        close(rep.makespan, 2.0 * (5.0e-6 + 2.0e-3), "two hops");
        let comm: f64 = rep.workers.iter().map(|w| w.communication).sum();
        close(
            comm,
            if overlap {
                0.0
            } else {
                2.0 * (5.0e-6 + 2.0e-3)
            },
            "sender busy",
        );
    }
}

/// Hosts: a boundary between workers of two hosts takes the link between hosts (its rate,
/// one-way time and processor costs), one inside a host the model's own; a ring among
/// replicas on two hosts takes the link between them. Three stages, one microbatch, no
/// compute: four hops, the two over the host boundary at its own cost.
#[test]
fn links_between_hosts_take_their_own_costs() {
    let cost = StageCost {
        activation_bytes: 2.0e6,
        ..StageCost::compute(0.0, 0.0)
    };
    let between = pipe_scheduler::sim::Link {
        bandwidth: 1.0e8,
        latency: 1.0e-3,
        message_cpu: 0.5,
        byte_cpu: 0.0,
    };
    let costs = CostModel {
        bandwidth: 1.0e9,
        latency: 5.0e-6,
        hosts: vec![0, 0, 1],
        between: Some(between),
        ..CostModel::uniform(cost.clone())
    };
    let rep = run(&ScheduleSpec::new(Policy::Gpipe, 3, 1), &costs);
    // Within: 2 ms + 5 us each way. Between: 20 ms + 1 ms each way, and half a second of
    // processor time at each end of each of its two messages.
    let within = 2.0 * (5.0e-6 + 2.0e-3);
    let crossing = 2.0 * (1.0e-3 + 2.0e-2) + 4.0 * 0.5;
    close(
        rep.makespan,
        within + crossing,
        "two hops within, two between",
    );
    // No hosts: the four hops alike.
    let one_host = CostModel {
        hosts: Vec::new(),
        ..costs.clone()
    };
    close(
        run(&ScheduleSpec::new(Policy::Gpipe, 3, 1), &one_host).makespan,
        2.0 * within,
        "one host",
    );
    // A ring of two replicas on two hosts: 2 (r-1)/r * P over the network, 2 (r-1) latencies
    // (the processor time of its 4 (r-1) message ends, here, is 2 s: the link's time is
    // compared without it).
    let ring = CostModel {
        hosts: vec![0, 1],
        between: Some(pipe_scheduler::sim::Link {
            message_cpu: 0.0,
            ..between
        }),
        ..CostModel::uniform(StageCost {
            param_bytes: 4.0e6,
            ..StageCost::compute(0.0, 0.0)
        })
    };
    let spec = ScheduleSpec::new(Policy::Gpipe, 1, 1).with_replicas(vec![2]);
    close(
        run(&spec, &ring).makespan,
        4.0e6 / 1.0e8 + 2.0 * 1.0e-3,
        "ring between hosts",
    );
    // A host list of the wrong length is refused.
    let wrong = CostModel {
        hosts: vec![0, 1, 0, 1],
        ..costs
    };
    let e = simulate(
        &generate(&ScheduleSpec::new(Policy::Gpipe, 3, 1)).unwrap(),
        &wrong,
        SimOptions::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("4 hosts given for 3 workers"), "{e}");
}

/// Each message costs its sender and its receiver `message_cpu` of compute: one microbatch
/// through `S` stages sends `S - 1` activations and `S - 1` gradients, each paid at both ends,
/// so the makespan grows by `4 (S - 1) c`; on one worker there are no messages. On shared
/// cores the cost occupies a core: one core runs everything back to back.
#[test]
fn message_cpu_is_paid_at_both_ends_of_every_message() {
    let (f, b, c) = (1.0, 2.0, 0.125);
    for stages in 1..=5u32 {
        let costs = CostModel {
            message_cpu: c,
            ..CostModel::uniform(StageCost::compute(f, b))
        };
        let spec = ScheduleSpec::new(Policy::Gpipe, stages, 1);
        let s = f64::from(stages);
        let expect = s * (f + b) + 4.0 * (s - 1.0) * c;
        close(run(&spec, &costs).makespan, expect, "one microbatch");
        let one_core = CostModel {
            cores: Some(1),
            ..costs.clone()
        };
        let m = 6u32;
        let spec = ScheduleSpec::new(Policy::OneFOneBFlush, stages, m);
        close(
            run(&spec, &one_core).makespan,
            f64::from(m) * expect,
            "one core: all the work, messages included",
        );
        let sequential = ScheduleSpec::new(Policy::Sequential, stages, 1);
        close(run(&sequential, &costs).makespan, s * (f + b), "one worker");
    }
    let bad = CostModel {
        message_cpu: -1.0,
        ..CostModel::uniform(StageCost::compute(f, b))
    };
    assert!(bad.check(2).is_err());
}

/// Each byte sent or received costs its worker `byte_cpu` of compute: one microbatch of
/// `a`-byte activations through `S` stages moves `2 (S - 1)` messages of `a` bytes, each paid
/// at both ends, so the makespan grows by `4 (S - 1) a k` (with infinitely fast links).
#[test]
fn byte_cpu_is_paid_at_both_ends_of_every_byte() {
    let (f, b, a, k) = (1.0, 2.0, 1000.0, 1.0e-4);
    for stages in 1..=4u32 {
        let costs = CostModel {
            byte_cpu: k,
            ..CostModel::uniform(StageCost {
                activation_bytes: a,
                ..StageCost::compute(f, b)
            })
        };
        let s = f64::from(stages);
        let spec = ScheduleSpec::new(Policy::Gpipe, stages, 1);
        close(
            run(&spec, &costs).makespan,
            s * (f + b) + 4.0 * (s - 1.0) * a * k,
            "one microbatch",
        );
    }
    let bad = CostModel {
        byte_cpu: f64::NAN,
        ..CostModel::uniform(StageCost::compute(f, b))
    };
    assert!(bad.check(2).is_err());
}

/// A ring all-reduce costs each member `4 (r-1)/r P k` of processor time (it sends and
/// receives `2 (r-1)/r P` bytes), and takes the longer of that and its link time.
#[test]
fn an_all_reduce_takes_the_longer_of_its_link_time_and_its_byte_cpu() {
    let p = 6.0e6;
    for r in [2u32, 4] {
        for (bandwidth, k) in [(1.0e9, 1.0e-10), (1.0e9, 1.0e-9), (f64::INFINITY, 3.0e-10)] {
            let costs = CostModel {
                bandwidth,
                byte_cpu: k,
                ..CostModel::uniform(StageCost {
                    param_bytes: p,
                    ..StageCost::compute(0.0, 0.0)
                })
            };
            let spec = ScheduleSpec::new(Policy::PipeDream, 1, 1)
                .with_replicas(vec![r])
                .with_length(Length::Updates(3));
            let rf = f64::from(r);
            let moved = 2.0 * (rf - 1.0) / rf * p;
            let one = (moved / bandwidth).max(2.0 * moved * k);
            let what = format!("r={r} bandwidth={bandwidth} k={k}");
            close(run(&spec, &costs).makespan, 3.0 * one, &what);
        }
    }
}

#[test]
fn peak_memory_counts_stash_and_versions_in_bytes() {
    let cost = StageCost {
        param_bytes: 1000.0,
        stash_bytes: Some(10.0),
        ..StageCost::compute(1.0, 2.0)
    };
    let spec = ScheduleSpec::new(Policy::PipeDream, 4, 1).with_length(Length::Updates(20));
    let rep = run(&spec, &CostModel::uniform(cost));
    for (s, w) in rep.workers.iter().enumerate() {
        let depth = 4.0 - s as f64;
        close(w.memory.weights, 1000.0 * depth, "stashed versions");
        close(w.memory.activations, 10.0 * depth, "activations in flight");
    }
}

#[test]
fn bad_cost_models_are_rejected() {
    let spec = ScheduleSpec::new(Policy::Gpipe, 2, 2);
    let s = generate(&spec).unwrap();
    let bad = [
        CostModel::uniform(StageCost::compute(-1.0, 1.0)),
        CostModel::uniform(StageCost::compute(f64::NAN, 1.0)),
        CostModel {
            bandwidth: 0.0,
            ..CostModel::uniform(StageCost::compute(1.0, 1.0))
        },
        CostModel {
            stages: vec![StageCost::compute(1.0, 1.0); 3],
            ..CostModel::uniform(StageCost::compute(1.0, 1.0))
        },
    ];
    for c in bad {
        let e = simulate(&s, &c, SimOptions::default()).unwrap_err();
        assert!(e.is_bad_input(), "{e}");
    }
}

fn all_policies() -> Vec<(Policy, ScheduleSpec)> {
    Policy::ONE_CHUNK_PIPELINES
        .into_iter()
        .map(|p| {
            (
                p,
                ScheduleSpec::new(p, 4, 4).with_length(Length::Updates(3)),
            )
        })
        .chain([(
            Policy::Interleaved,
            ScheduleSpec::new(Policy::Interleaved, 2, 4).with_chunks(2),
        )])
        .collect()
}

#[test]
fn one_shared_core_runs_all_the_work_back_to_back() {
    // A pipeline always has a worker with work to do, so one core never idles: the makespan is
    // the sum of every compute action, and that is spread over the workers.
    for (policy, spec) in all_policies() {
        let stage = StageCost {
            update: 0.25,
            ..StageCost::compute(1.0, 2.0)
        };
        let alone = run(&spec, &CostModel::uniform(stage.clone()));
        let total: f64 = alone.workers.iter().map(|w| w.compute).sum();
        let shared = run(
            &spec,
            &CostModel {
                cores: Some(1),
                ..CostModel::uniform(stage)
            },
        );
        close(shared.makespan, total, &format!("{policy} on one core"));
        assert!(shared.makespan > alone.makespan, "{policy}");
    }
}

#[test]
fn data_parallel_replicas_on_half_the_cores_take_twice_as_long() {
    // Four replicas of one stage on two cores: every action of every replica runs at half
    // speed, the measured all-reduce included.
    let stage = StageCost {
        update: 0.5,
        all_reduce: Some(0.75),
        ..StageCost::compute(1.0, 2.0)
    };
    let spec = ScheduleSpec::new(Policy::PipeDream, 1, 3)
        .with_replicas(vec![4])
        .with_length(Length::Updates(2));
    let alone = run(&spec, &CostModel::uniform(stage.clone()));
    close(alone.makespan, 2.0 * (3.0 * 3.0 + 0.75 + 0.5), "alone");
    let shared = run(
        &spec,
        &CostModel {
            cores: Some(2),
            ..CostModel::uniform(stage)
        },
    );
    close(shared.makespan, 2.0 * alone.makespan, "two cores");
}

#[test]
fn cores_beyond_the_workers_change_nothing() {
    for (policy, spec) in all_policies() {
        let costs = CostModel {
            latency: 0.01,
            bandwidth: 1e3,
            ..CostModel::uniform(StageCost {
                activation_bytes: 5.0,
                param_bytes: 20.0,
                update: 0.1,
                ..StageCost::compute(1.0, 2.0)
            })
        };
        let a = run(&spec, &costs);
        let b = run(
            &spec,
            &CostModel {
                cores: Some(64),
                ..costs
            },
        );
        assert_eq!(a, b, "{policy}");
    }
}

/// The streaming simulator (programs generated a block at a time, never held whole) reports
/// exactly what the simulator reports on the materialised schedule: every policy, straight,
/// replicated and unequal layouts, with links, latency, updates and all-reduces.
#[test]
fn streaming_simulation_equals_the_materialised_one_bit_for_bit() {
    let layouts: [(u32, Vec<u32>); 5] = [
        (1, vec![1]),
        (4, vec![1]),
        (3, vec![2]),
        (3, vec![2, 1, 3]),
        (2, vec![3, 1]),
    ];
    for policy in Policy::ALL {
        for (stages, replicas) in &layouts {
            for m in [1u32, 4] {
                let (m, chunks) = match policy {
                    Policy::Interleaved => (m.max(1) * stages, 2),
                    Policy::TwoBw => (m.max(6), 1),
                    _ => (m, 1),
                };
                let spec = ScheduleSpec::new(policy, *stages, m)
                    .with_replicas(replicas.clone())
                    .with_chunks(chunks)
                    .with_length(Length::Updates(3));
                let Ok(schedule) = generate(&spec) else {
                    continue; // a layout the policy refuses (interleaved, unequal replicas)
                };
                let costs = CostModel {
                    bandwidth: 1e3,
                    latency: 0.01,
                    ..CostModel {
                        stages: (0..schedule.stages())
                            .map(|s| StageCost {
                                activation_bytes: 5.0 + f64::from(s),
                                param_bytes: 20.0 * f64::from(s + 1),
                                update: 0.1,
                                stash_bytes: Some(3.0),
                                ..StageCost::compute(1.0 + 0.25 * f64::from(s), 2.0)
                            })
                            .collect(),
                        ..CostModel::uniform(StageCost::compute(0.0, 0.0))
                    }
                };
                let what = format!("{policy} {stages} stages {replicas:?} M={m}");
                let whole = simulate(&schedule, &costs, SimOptions::default()).unwrap();
                let streamed =
                    pipe_scheduler::simulate_spec(&spec, &costs, SimOptions::default()).unwrap();
                assert_eq!(streamed, whole, "{what}");
            }
        }
    }
}

/// Unequal replica counts on balanced stages (each stage costs its replica count, so every
/// worker has the same work and the bound is one microbatch per 3 time units): the
/// asynchronous policies reach within 10% of the bound, as uniform layouts do. With NOAM's
/// depths alone `[1, 3, 1]` ran at 0.43-0.5 of it.
#[test]
fn unequal_replicas_on_balanced_stages_run_near_the_bound() {
    for replicas in [
        vec![1, 3, 1],
        vec![2, 1, 1],
        vec![1, 2, 1, 1],
        vec![1, 4, 2, 1],
        vec![1, 3],
    ] {
        let layout = pipe_scheduler::Layout::new(replicas.clone(), 1).unwrap();
        let costs = pipe_scheduler::depth::balanced_costs(&layout);
        for policy in [
            Policy::PipeDream,
            Policy::PipeDreamNoStash,
            Policy::VerticalSync,
        ] {
            for m in [1u32, 4] {
                let spec = ScheduleSpec::new(policy, replicas.len() as u32, m)
                    .with_replicas(replicas.clone())
                    .with_length(Length::Updates(30));
                let r = run(&spec, &costs);
                let of_bound = r.throughput * 3.0;
                assert!(
                    of_bound >= 0.9,
                    "{policy} {replicas:?} M={m}: {of_bound:.3} of the bound"
                );
            }
        }
    }
}

/// The bucketed ring against its closed form: one bucket is the unbucketed ring, after the
/// pass; two halves on a slow link hide the first half's ring behind the pass when it fits,
/// and the first half's processor time lengthens the pass.
#[test]
fn bucketed_rings_hide_the_link_behind_the_backward_pass() {
    use pipe_scheduler::sim::{Bucket, Link, bucketed_all_reduce};
    let link = Link {
        bandwidth: 1.0e6,
        latency: 0.01,
        message_cpu: 0.001,
        byte_cpu: 0.0,
    };
    // Two replicas: each ring moves its bytes once in two steps: bytes / 1e6 + 0.02 s of link,
    // 4 ms of processor.
    let one = [Bucket {
        bytes: 2.0e6,
        ready: 3.0,
    }];
    let (during, after) = bucketed_all_reduce(&one, 3.0, 2.0, &link);
    close(during, 0.0, "one bucket: nothing during");
    close(after, 2.0 + 0.02, "one bucket: the whole ring after");
    let halves = [
        Bucket {
            bytes: 1.0e6,
            ready: 1.0,
        },
        Bucket {
            bytes: 1.0e6,
            ready: 3.0,
        },
    ];
    let (during, after) = bucketed_all_reduce(&halves, 3.0, 2.0, &link);
    close(during, 0.004, "the first ring's messages");
    // The first ring runs from 1 s to 2.02 s, inside the pass (now 3.004 s); the second
    // from its end.
    close(after, 1.0 + 0.02, "the second half after the pass");
    // A pass too short to hide the first ring: the second waits for it.
    let (during, after) = bucketed_all_reduce(&halves, 1.5, 2.0, &link);
    close(during, 0.004, "short pass: the first ring's messages");
    close(
        after,
        (1.0 + 2.0 * 1.02) - 1.504,
        "short pass: both rings end to end",
    );
    // In a schedule: a replicated stage's all-reduce is what its buckets leave after the pass.
    let costs = CostModel {
        bandwidth: 1.0e6,
        latency: 0.01,
        ..CostModel::uniform(StageCost {
            param_bytes: 2.0e6,
            buckets: Some(halves.to_vec()),
            ..StageCost::compute(0.0, 3.0)
        })
    };
    let spec = ScheduleSpec::new(Policy::Gpipe, 1, 1).with_replicas(vec![2]);
    close(
        run(&spec, &costs).makespan,
        3.0 + 1.02,
        "pass and the second half",
    );
}

/// On shared cores, a ring bound by its link waits on the link and leaves the cores to others:
/// four replicas of one stage on two cores take the ring's link time, as on four; a ring
/// bound by its processor time shares the cores and takes twice as long on two.
#[test]
fn a_link_bound_ring_leaves_the_cores_free() {
    let spec = ScheduleSpec::new(Policy::Gpipe, 1, 1).with_replicas(vec![4]);
    let stage = StageCost {
        param_bytes: 4.0e6,
        ..StageCost::compute(0.0, 0.0)
    };
    let link_bound = CostModel {
        bandwidth: 1.0e6,
        ..CostModel::uniform(stage.clone())
    };
    let ring = 2.0 * 3.0 / 4.0 * 4.0e6 / 1.0e6;
    for cores in [Some(2), Some(4), None] {
        let costs = CostModel {
            cores,
            ..link_bound.clone()
        };
        close(run(&spec, &costs).makespan, ring, "link-bound ring");
    }
    let cpu_bound = CostModel {
        byte_cpu: 1.0e-6,
        ..CostModel::uniform(stage)
    };
    let cpu = 2.0 * (2.0 * 3.0 / 4.0 * 4.0e6) * 1.0e-6;
    let on = |cores| {
        run(
            &spec,
            &CostModel {
                cores,
                ..cpu_bound.clone()
            },
        )
        .makespan
    };
    close(on(Some(4)), cpu, "processor-bound ring, a core each");
    close(
        on(Some(2)),
        2.0 * cpu,
        "processor-bound ring, two cores for four",
    );
}
