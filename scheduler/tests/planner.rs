//! The partitioner against PipeDream's published optimizer and against brute force.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_scheduler::planner::placement::Hosts;
use pipe_scheduler::sim::Link;
use pipe_scheduler::{
    LayerProfile, PipeDreamOptions, PlanOptions, Policy, Profile, WireDtype, frontier, pipedream,
    plan_partition,
};
use proptest::prelude::*;

fn vgg16() -> Profile {
    Profile::from_pipedream(include_str!("data/pipedream/vgg16.txt")).unwrap()
}

#[test]
fn vgg16_on_4_workers_at_1_gb_per_s_is_pipedreams_published_plan() {
    let p = vgg16();
    assert_eq!(p.layers.len(), 40, "41 nodes less the input");
    let plan = pipedream(&p, &PipeDreamOptions::new(4, 1e9)).unwrap();
    let shape: Vec<(usize, u32)> = plan
        .stages
        .iter()
        .map(|s| (s.layers.len(), s.replicas))
        .collect();
    assert_eq!(
        shape,
        vec![(15, 3), (25, 1)],
        "2 stages, cut after the first 15 states"
    );
    assert!(
        (plan.time_per_microbatch - 0.17573).abs() < 5e-6,
        "{}",
        plan.time_per_microbatch
    );
    assert!(
        (plan.speedup_over_data_parallel() - 3.32).abs() < 5e-3,
        "{}",
        plan.speedup_over_data_parallel()
    );
    let slowest = plan.stages.iter().map(|s| s.time).fold(0.0, f64::max);
    assert!((slowest - plan.time_per_microbatch).abs() < 1e-12);
}

#[test]
fn straight_pipelines_use_one_worker_per_stage() {
    let plan = pipedream(
        &vgg16(),
        &PipeDreamOptions {
            straight: true,
            ..PipeDreamOptions::new(4, 1e9)
        },
    )
    .unwrap();
    assert_eq!(plan.stages.len(), 4);
    assert!(plan.stages.iter().all(|s| s.replicas == 1));
}

#[test]
fn memory_bounds_follow_pipedreams_stash_formula() {
    // A stage on all W workers stashes ceil(0 / W) = 0 copies, so a bound of one byte leaves
    // exactly data parallelism; without replication nothing fits.
    let tight = PipeDreamOptions {
        memory: Some(1.0),
        ..PipeDreamOptions::new(4, 1e9)
    };
    let plan = pipedream(&vgg16(), &tight).unwrap();
    assert_eq!(plan.stages.len(), 1);
    assert_eq!(plan.stages[0].replicas, 4);
    let e = pipedream(
        &vgg16(),
        &PipeDreamOptions {
            straight: true,
            ..tight
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("memory"), "{e}");
}

/// Every split into contiguous stages with every replica assignment summing to `w`, under
/// the same formulas: the best slowest-stage time.
fn brute_force(p: &Profile, w: u32, b: f64, ratio: Option<f64>) -> f64 {
    let n = p.layers.len();
    let mut best = f64::INFINITY;
    // Cut masks over the n-1 gaps.
    for stages in splits(n) {
        if stages.len() > w as usize {
            continue;
        }
        for reps in compositions(w, stages.len()) {
            let mut t = 0.0f64;
            for (s, r) in stages.iter().zip(&reps) {
                let c: f64 = p.layers[s.clone()].iter().map(LayerProfile::compute).sum();
                let pb: f64 = p.layers[s.clone()].iter().map(|l| l.param_bytes).sum();
                let rf = f64::from(*r);
                t = t.max((c + 4.0 * (rf - 1.0) * pb / (b * rf)) / rf);
                // As PipeDream charges transfers: every stage but the first, for its input and
                // (unless last) its output, at its own replica count.
                if let (Some(ratio), true) = (ratio, s.start > 0) {
                    t = t.max(2.0 * p.layers[s.start - 1].activation_bytes / (b * rf) / ratio);
                    if s.end < n {
                        t = t.max(2.0 * p.layers[s.end - 1].activation_bytes / (b * rf) / ratio);
                    }
                }
            }
            best = best.min(t);
        }
    }
    best
}

/// Every split of layers `0..n` into contiguous non-empty stages (one per set of cuts among the
/// `n - 1` gaps).
fn splits(n: usize) -> Vec<Vec<std::ops::Range<usize>>> {
    (0u32..(1 << (n - 1)))
        .map(|mask| {
            let mut stages = Vec::new();
            let mut start = 0;
            for i in 0..n {
                if i == n - 1 || mask & (1 << i) != 0 {
                    stages.push(start..i + 1);
                    start = i + 1;
                }
            }
            stages
        })
        .collect()
}

/// Every way to write `w` as `k` positive parts, in order.
fn compositions(w: u32, k: usize) -> Vec<Vec<u32>> {
    if k == 1 {
        return vec![vec![w]];
    }
    let mut out = Vec::new();
    for first in 1..=w.saturating_sub(k as u32 - 1) {
        for mut rest in compositions(w - first, k - 1) {
            rest.insert(0, first);
            out.push(rest);
        }
    }
    out
}

fn layer() -> impl Strategy<Value = LayerProfile> {
    (
        0.0f64..10.0,
        0.0f64..20.0,
        0.0f64..1e4,
        0.0f64..1e4,
        prop::option::of(0.0f64..1.0),
    )
        .prop_map(|(f, bw, a, p, kept)| LayerProfile {
            name: "l".into(),
            forward: f,
            backward_input: bw,
            backward_weight: 0.0,
            backward: None,
            update: 0.0,
            activation_bytes: a,
            param_bytes: p,
            stash_bytes: None,
            // Some layers keep a share of their activations when they recompute.
            recompute_stash_bytes: kept.map(|k| k * a),
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn brute_force_finds_nothing_better_than_the_dynamic_program(
        layers in prop::collection::vec(layer(), 1..=10),
        w in 1u32..=6,
        b in prop::sample::select(vec![1e2, 1e3, 1e4]),
        ratio in prop::option::of(prop::sample::select(vec![1.0, 4.0])),
    ) {
        let p = Profile::chain(layers);
        let plan = pipedream(&p, &PipeDreamOptions {
            activation_compression: ratio,
            ..PipeDreamOptions::new(w, b)
        }).unwrap();
        let brute = brute_force(&p, w, b, ratio);
        prop_assert!((plan.time_per_microbatch - brute).abs() <= 1e-9 * brute.max(1.0),
            "dp {} brute {}", plan.time_per_microbatch, brute);
        let used: u32 = plan.stages.iter().map(|s| s.replicas).sum();
        prop_assert_eq!(used, w);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn the_balanced_split_is_the_exact_min_max(
        layers in prop::collection::vec(layer(), 1..=10),
        stages in 1usize..=10,
    ) {
        let p = Profile::chain(layers);
        let n = p.layers.len();
        if stages > n {
            prop_assert!(pipe_scheduler::balanced(&p, stages).is_err());
            return Ok(());
        }
        let split = pipe_scheduler::balanced(&p, stages).unwrap();
        prop_assert_eq!(split.len(), stages);
        prop_assert_eq!(split[0].start, 0);
        prop_assert_eq!(split[stages - 1].end, n);
        prop_assert!(split.windows(2).all(|w| w[0].end == w[1].start && !w[0].is_empty()));
        let cost = |r: &std::ops::Range<usize>| -> f64 {
            p.layers[r.clone()].iter().map(LayerProfile::compute).sum()
        };
        let got = split.iter().map(cost).fold(0.0, f64::max);
        // Brute force over every choice of stages - 1 cuts among the n - 1 gaps.
        let mut brute = f64::INFINITY;
        for split in splits(n).into_iter().filter(|s| s.len() == stages) {
            brute = brute.min(split.iter().map(cost).fold(0.0, f64::max));
        }
        prop_assert!((got - brute).abs() <= 1e-9 * brute.max(1.0), "dp {} brute {}", got, brute);
    }
}

/// The default model's charge for one stage, written out from docs/planning.md independently
/// of the planner: `(time, memory)`.
#[allow(clippy::too_many_arguments)]
fn default_stage(
    p: &Profile,
    o: &PlanOptions,
    s: &std::ops::Range<usize>,
    r: u32,
    after: u32,
) -> (f64, f64) {
    let n = p.layers.len();
    let ls = &p.layers[s.clone()];
    let rf = f64::from(r);
    let m = f64::from(o.microbatches);
    let (mem, again) = default_stage_memory(p, o, s, r, after);
    let c: f64 = ls.iter().map(LayerProfile::compute).sum::<f64>() + again;
    let u: f64 = ls.iter().map(|l| l.update).sum();
    let pb: f64 = ls.iter().map(|l| l.param_bytes).sum();
    // The stage's workers are positions `first..=last` in pipeline order; a link crosses hosts
    // where the positions it joins are not all on one host.
    let w = o.workers as usize;
    let first = w - after as usize;
    let last = first + r as usize - 1;
    let host = |q: usize| o.hosts.as_ref().map(|h| h.of_worker[q]);
    let spans = |a: usize, b: usize| (a..=b).any(|q| host(q) != host(a));
    let link = |remote: bool| match (&o.hosts, remote) {
        (Some(h), true) => h.between,
        _ => o.within(),
    };
    let mut sends = Vec::new();
    if s.start > 0 {
        sends.push((
            p.layers[s.start - 1].activation_bytes,
            link(spans(first - 1, last)),
        ));
    }
    if s.end < n {
        sends.push((
            p.layers[s.end - 1].activation_bytes,
            link(spans(first, last + 1)),
        ));
    }
    let ring = link(spans(first, last));
    let wire = o.wire.factor();
    // Each activation in or out, and its gradient, costs the transport's processor time at
    // this end: per message and per byte on the wire.
    let transport: f64 = sends
        .iter()
        .map(|(b, l)| 2.0 * (l.message_cpu + b * wire * l.byte_cpu))
        .sum();
    let all_reduce = if r > 1 {
        let link = 2.0 * (rf - 1.0) / rf * pb / ring.bandwidth + 2.0 * (rf - 1.0) * ring.latency;
        let cpu = 4.0 * (rf - 1.0) / rf * pb * ring.byte_cpu + 4.0 * (rf - 1.0) * ring.message_cpu;
        link.max(cpu) / (m * rf)
    } else {
        0.0
    };
    let work = (c + u / m + transport) / rf + all_reduce;
    let time = if o.overlap {
        work.max(
            sends
                .iter()
                .map(|(b, l)| b * wire / l.bandwidth)
                .sum::<f64>()
                / rf,
        )
    } else {
        work + sends
            .iter()
            .map(|(b, l)| b * wire / l.bandwidth + l.latency)
            .sum::<f64>()
            / rf
    };
    (time, mem)
}

/// The memory model's bytes for one worker of stage `s` (written out here, term by term, as
/// `docs/planning.md` gives them), and the forward time recomputation adds: the stage keeps
/// its activations when they fit the bound, else recomputes where that fits.
fn default_stage_memory(
    p: &Profile,
    o: &PlanOptions,
    s: &std::ops::Range<usize>,
    r: u32,
    after: u32,
) -> (f64, f64) {
    let ls = &p.layers[s.clone()];
    let m = f64::from(o.microbatches);
    let pb: f64 = ls.iter().map(|l| l.param_bytes).sum();
    let in_flight = f64::from(after.div_ceil(r));
    let (versions, acts) = match o.policy {
        Policy::PipeDream | Policy::VerticalSync => (in_flight, in_flight),
        Policy::TwoBw => (2.0, in_flight),
        Policy::PipeDreamNoStash => (1.0, in_flight),
        Policy::Gpipe => (1.0, m),
        _ => (1.0, in_flight.min(m)),
    };
    let stash = |l: &LayerProfile| l.stash_bytes.unwrap_or(l.activation_bytes);
    let pass = s
        .clone()
        .map(|i| {
            let input = if i > 0 {
                p.layers[i - 1].activation_bytes
            } else {
                0.0
            };
            stash(&p.layers[i]) + input + p.layers[i].activation_bytes
        })
        .fold(0.0, f64::max);
    let loss = if s.end == p.layers.len() {
        3.0 * p.layers[s.end - 1].activation_bytes
    } else {
        0.0
    };
    let bytes = |kept: f64| {
        o.worker_base + (versions + 2.0 * o.state_copies) * pb + acts * kept + 2.7 * pass + loss
    };
    let kept: f64 = ls.iter().map(stash).sum();
    let recomputed: f64 = ls
        .iter()
        .map(|l| l.recompute_stash_bytes.unwrap_or(stash(l)))
        .sum();
    let again: f64 = ls
        .iter()
        .filter(|l| l.recompute_stash_bytes.is_some_and(|b| b < stash(l)))
        .map(|l| l.forward)
        .sum();
    match o.memory {
        Some(limit) if bytes(kept) > limit && bytes(recomputed) <= limit => {
            (bytes(recomputed), again)
        }
        _ => (bytes(kept), 0.0),
    }
}

/// Brute force under the default model: the best slowest stage for every stage count (index
/// `S - 1`), over every split and every replica assignment that fits the memory bound.
fn brute_force_default(p: &Profile, o: &PlanOptions) -> Vec<f64> {
    let n = p.layers.len();
    let w = o.workers;
    let mut best = vec![f64::INFINITY; n.min(w as usize)];
    for stages in splits(n) {
        if stages.len() > w as usize {
            continue;
        }
        for reps in compositions(w, stages.len()) {
            if o.straight && reps.iter().any(|&r| r > 1) {
                continue;
            }
            let (mut t, mut used, mut fits) = (0.0f64, 0, true);
            for (s, &r) in stages.iter().zip(&reps) {
                let (time, mem) = default_stage(p, o, s, r, w - used);
                used += r;
                t = t.max(time);
                fits &= o.memory.is_none_or(|limit| mem <= limit);
            }
            if fits {
                let k = stages.len() - 1;
                best[k] = best[k].min(t);
            }
        }
    }
    best
}

fn policy() -> impl Strategy<Value = Policy> {
    prop::sample::select(vec![
        Policy::PipeDream,
        Policy::PipeDreamNoStash,
        Policy::TwoBw,
        Policy::Gpipe,
        Policy::OneFOneBFlush,
    ])
}

fn with_updates() -> impl Strategy<Value = LayerProfile> {
    (layer(), 0.0f64..2.0).prop_map(|(mut l, u)| {
        l.update = u;
        l
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn brute_force_finds_nothing_better_under_the_default_model(
        layers in prop::collection::vec(with_updates(), 1..=8),
        w in 1u32..=6,
        b in prop::sample::select(vec![1e2, 1e3, 1e4]),
        latency in prop::sample::select(vec![0.0, 0.5]),
        overlap in any::<bool>(),
        bf16 in any::<bool>(),
        straight in prop::bool::weighted(0.2),
        memory in prop::option::of(prop::sample::select(vec![2e4, 6e4, 2e5])),
        policy in policy(),
        microbatches in 1u32..=4,
        message_cpu in prop::sample::select(vec![0.0, 0.3]),
        byte_cpu in prop::sample::select(vec![0.0, 1e-4]),
        split in prop::option::of(1u32..=5),
    ) {
        let p = Profile::chain(layers);
        // Two hosts, the first taking `split` workers, joined by a slower, dearer link.
        let hosts = split.map(|k| {
            Hosts::filled(
                &[("a".to_string(), k), ("b".to_string(), w)],
                Link { bandwidth: b / 10.0, latency: latency + 0.2, message_cpu: message_cpu + 0.1, byte_cpu: byte_cpu + 2e-4 },
            )
        });
        let o = PlanOptions {
            hosts,
            latency,
            overlap,
            wire: if bf16 { WireDtype::Bf16 } else { WireDtype::F32 },
            straight: straight && w as usize <= p.layers.len(),
            memory,
            policy,
            microbatches,
            message_cpu,
            byte_cpu,
            ..PlanOptions::new(w, b)
        };
        let brute = brute_force_default(&p, &o);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
        // Every stage count's best, as the flush planner sees them.
        let front = frontier(&p, &o).unwrap();
        prop_assert_eq!(front.len(), brute.len());
        for (s, (got, want)) in front.iter().zip(&brute).enumerate() {
            match got {
                Some(plan) => {
                    prop_assert_eq!(plan.stages.len(), s + 1);
                    prop_assert!(close(plan.time_per_microbatch, *want),
                        "{} stages: dp {} brute {}", s + 1, plan.time_per_microbatch, want);
                    let used: u32 = plan.stages.iter().map(|s| s.replicas).sum();
                    prop_assert_eq!(used, w);
                }
                None => prop_assert!(want.is_infinite(), "{} stages: brute {}", s + 1, want),
            }
        }
        // The asynchronous planner: the best over all stage counts.
        let asynchronous = PlanOptions { policy: if policy.is_flush() { Policy::PipeDream } else { policy }, ..o.clone() };
        let brute_async = brute_force_default(&p, &asynchronous)
            .into_iter()
            .fold(f64::INFINITY, f64::min);
        match plan_partition(&p, &asynchronous) {
            Ok(plan) => prop_assert!(close(plan.time_per_microbatch, brute_async),
                "dp {} brute {}", plan.time_per_microbatch, brute_async),
            Err(e) => prop_assert!(brute_async.is_infinite(), "{e}; brute {brute_async}"),
        }
    }
}

fn pipedream_file(name: &str) -> Profile {
    let text = match name {
        "resnet18" => include_str!("data/pipedream/resnet18.txt"),
        "squeezenet1_0" => include_str!("data/pipedream/squeezenet1_0.txt"),
        "gnmt" => include_str!("data/pipedream/gnmt.txt"),
        _ => include_str!("data/pipedream/vgg16.txt"),
    };
    Profile::from_pipedream(text).unwrap()
}

/// Checks a PipeDream-model plan of a branching graph against the layers themselves: the order
/// is a permutation, every run of stages from the first is closed under predecessors (a state),
/// and each stage's compute, all-reduce and time follow from its own layers.
fn check_antichain_plan(p: &Profile, plan: &pipe_scheduler::PartitionPlan, b: f64) {
    let n = p.layers.len();
    let mut seen = plan.order.clone();
    seen.sort_unstable();
    assert_eq!(seen, (0..n).collect::<Vec<_>>());
    let mut pos = vec![0; n];
    for (at, &l) in plan.order.iter().enumerate() {
        pos[l] = at;
    }
    // Every edge goes forward in the new order, so every prefix is a downset.
    for &(a, c) in &p.edges {
        assert!(pos[a] < pos[c], "edge {a}->{c} goes backwards");
    }
    assert_eq!(plan.stages.last().unwrap().layers.end, n);
    let mut worst = 0.0f64;
    for s in &plan.stages {
        let layers: Vec<&LayerProfile> = plan.order[s.layers.clone()]
            .iter()
            .map(|&i| &p.layers[i])
            .collect();
        let c: f64 = layers.iter().map(|l| l.compute()).sum();
        let pb: f64 = layers.iter().map(|l| l.param_bytes).sum();
        let r = f64::from(s.replicas);
        assert!((s.compute - c / r).abs() <= 1e-12 * c.max(1.0));
        let dp = 4.0 * (r - 1.0) * pb / (b * r) / r;
        assert!((s.communication - dp).abs() <= 1e-12 * dp.max(1.0));
        worst = worst.max(s.time);
    }
    assert!((worst - plan.time_per_microbatch).abs() <= 1e-12);
    let used: u32 = plan.stages.iter().map(|s| s.replicas).sum();
    assert!(used >= 1);
}

#[test]
fn branching_graphs_are_planned_over_pipedreams_antichain_states() {
    // resnet18 on 4 workers at 1 GB/s: prefixes of one topological order reach 67.19 ms per
    // microbatch; PipeDream's antichain states find 65.92 ms (a residual block cut at two
    // depths).
    let p = pipedream_file("resnet18");
    assert!(!p.is_chain());
    let plan = pipedream(&p, &PipeDreamOptions::new(4, 1e9)).unwrap();
    assert!(
        (plan.time_per_microbatch - 0.065918).abs() < 5e-6,
        "{}",
        plan.time_per_microbatch
    );
    check_antichain_plan(&p, &plan, 1e9);
    for name in ["resnet18", "squeezenet1_0", "gnmt", "vgg16"] {
        let p = pipedream_file(name);
        for w in [2u32, 3, 8] {
            for ratio in [None, Some(1.0)] {
                let o = PipeDreamOptions {
                    activation_compression: ratio,
                    ..PipeDreamOptions::new(w, 1e9)
                };
                let plan = pipedream(&p, &o).unwrap();
                check_antichain_plan(&p, &plan, 1e9);
                assert_eq!(plan.stages.iter().map(|s| s.replicas).sum::<u32>(), w);
            }
        }
    }
}

#[test]
fn gnmt_lists_of_activation_sizes_count_as_their_sum() {
    let p = pipedream_file("gnmt");
    let listed = p
        .layers
        .iter()
        .find(|l| (l.activation_bytes - (6291456.0 + 131072.0 + 131072.0)).abs() < 0.5);
    assert!(listed.is_some(), "the [6291456; 131072; 131072] layer");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100))]
    #[test]
    fn on_chains_antichain_states_are_the_prefixes(
        layers in prop::collection::vec(layer(), 1..=10),
        w in 1u32..=6,
        b in prop::sample::select(vec![1e2, 1e3, 1e4]),
        ratio in prop::option::of(prop::sample::select(vec![1.0, 4.0])),
    ) {
        // The same chain written with explicit edges goes through the antichain program.
        let n = layers.len();
        let chain = Profile::chain(layers);
        let mut graph = chain.clone();
        graph.edges = (1..n).map(|i| (i - 1, i)).collect();
        let o = PipeDreamOptions { activation_compression: ratio, ..PipeDreamOptions::new(w, b) };
        let prefix = pipedream(&chain, &o).unwrap();
        let states = pipe_scheduler::planner::antichain::plan(&graph, &o).unwrap();
        prop_assert!((prefix.time_per_microbatch - states.time_per_microbatch).abs()
            <= 1e-9 * prefix.time_per_microbatch.max(1.0),
            "prefix {} antichain {}", prefix.time_per_microbatch, states.time_per_microbatch);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]
    #[test]
    fn the_simulator_check_never_picks_a_slower_plan(
        layers in prop::collection::vec(with_updates(), 2..=12),
        w in 2u32..=6,
        b in prop::sample::select(vec![1e2, 1e4]),
        policy in prop::sample::select(vec![Policy::PipeDream, Policy::TwoBw]),
    ) {
        let p = Profile::chain(layers);
        let o = PlanOptions { policy, microbatches: 2, ..PlanOptions::new(w, b) };
        let raw = plan_partition(&p, &o).unwrap();
        // The schedule may refuse the layout (2BW with too few microbatches for it).
        let raw_sim = pipe_scheduler::simulate_plan(&p, &raw, &o).ok();
        let checked = match pipe_scheduler::plan_checked(&p, &o) {
            Ok(c) => c,
            Err(e) => {
                prop_assert!(raw_sim.is_none(), "{e}");
                return Ok(());
            }
        };
        let sim = checked.simulated.unwrap();
        if let Some(raw_sim) = raw_sim {
            prop_assert!(sim <= raw_sim * (1.0 + 1e-12), "checked {} raw {}", sim, raw_sim);
        }
        prop_assert_eq!(checked.stages.iter().map(|s| s.replicas).sum::<u32>(), w);
        // Whatever it picked, its figure is the simulator's for that plan.
        let again = pipe_scheduler::simulate_plan(&p, &checked, &o).unwrap();
        prop_assert!((again - sim).abs() <= 1e-12 * sim.max(1.0));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(50))]
    #[test]
    fn flush_plans_are_the_best_simulated_of_the_best_per_stage_count(
        layers in prop::collection::vec(with_updates(), 2..=10),
        w in 2u32..=6,
        policy in prop::sample::select(vec![Policy::OneFOneBFlush, Policy::Gpipe]),
        microbatches in 1u32..=8,
    ) {
        let p = Profile::chain(layers);
        let o = PlanOptions { policy, microbatches, ..PlanOptions::new(w, 1e3) };
        let chosen = plan_partition(&p, &o).unwrap();
        let sim = chosen.simulated.unwrap();
        let front = frontier(&p, &o).unwrap();
        // The choice is the per-stage-count best for its stage count ...
        let same = front[chosen.stages.len() - 1].as_ref().unwrap();
        prop_assert_eq!(&same.stages, &chosen.stages);
        // ... and simulates no slower than the plan with the best (M + S - 1) x slowest score.
        let m = f64::from(microbatches);
        let best_score = front
            .iter()
            .flatten()
            .min_by(|a, b| {
                let sa = (m + a.stages.len() as f64 - 1.0) * a.time_per_microbatch;
                let sb = (m + b.stages.len() as f64 - 1.0) * b.time_per_microbatch;
                sa.total_cmp(&sb)
            })
            .unwrap();
        let reference = pipe_scheduler::simulate_plan(&p, best_score, &o).unwrap();
        prop_assert!(sim <= reference * (1.0 + 1e-12), "chosen {} best-score {}", sim, reference);
    }
}

/// On unequal replica counts the generator deepens the asynchronous schedule beyond the
/// planner's `ceil(a / r)` model; the checked plan reports, and bounds, what the simulated
/// schedule really holds.
#[test]
fn checked_plans_charge_the_memory_the_simulated_schedule_holds() {
    let layer = |w: f64| LayerProfile {
        name: "l".into(),
        forward: w,
        backward_input: w,
        backward_weight: w,
        backward: None,
        update: 0.0,
        activation_bytes: 1000.0,
        param_bytes: 1e4,
        stash_bytes: Some(1e6),
        recompute_stash_bytes: None,
    };
    // Stashed activations dominate (the model counts `ceil(a / r)` weight versions, which
    // overstates them when M > 1, and as many activations, which understates a deepened
    // stage). Balanced under [1, 3, 1]: the middle stage has three times the work.
    let profile = Profile {
        model: "unequal".into(),
        microbatch_size: 1,
        layers: vec![layer(1.0), layer(1.5), layer(1.5), layer(1.0)],
        edges: Vec::new(),
        calibrated_microbatches: None,
    };
    let opts = PlanOptions {
        policy: Policy::PipeDream,
        microbatches: 4,
        ..PlanOptions::new(5, f64::INFINITY)
    };
    let layout = [(0..1, 1), (1..3, 3), (3..4, 1)];
    let modelled = pipe_scheduler::explain(&profile, &opts, &layout).unwrap();
    let (_, held) = pipe_scheduler::simulate_plan_with_memory(&profile, &modelled, &opts).unwrap();
    assert!(
        held[0] > modelled.stages[0].memory,
        "the searched depth stashes more activations at the input stage: {held:?} against {:?}",
        modelled.stages.iter().map(|s| s.memory).collect::<Vec<_>>()
    );
    let checked = pipe_scheduler::plan_checked(&profile, &opts).unwrap();
    let (_, held) = pipe_scheduler::simulate_plan_with_memory(&profile, &checked, &opts).unwrap();
    for (s, h) in checked.stages.iter().zip(&held) {
        assert!(s.memory >= *h, "reported {} < simulated {h}", s.memory);
    }
    // A bound between the model's figure and the schedule's refuses that layout.
    let bound = (modelled.stages[0].memory + held[0]) / 2.0;
    let bounded = PlanOptions {
        memory: Some(bound),
        ..opts.clone()
    };
    if let Ok(p) = pipe_scheduler::plan_checked(&profile, &bounded) {
        let (_, held) = pipe_scheduler::simulate_plan_with_memory(&profile, &p, &bounded).unwrap();
        assert!(held.iter().all(|&h| h <= bound), "{held:?} over {bound}");
    }
}

/// Under a memory bound, a stage whose activations do not fit recomputes them where that
/// fits, and pays one more forward in its backward; stages that fit keep theirs. Without a
/// recomputed stash in the profile, nothing fits and no plan is made.
#[test]
fn a_memory_bound_makes_the_first_stages_recompute() {
    let block = LayerProfile {
        name: "block".into(),
        forward: 1.0,
        backward_input: 2.0,
        backward_weight: 0.0,
        backward: None,
        update: 0.0,
        activation_bytes: 10.0,
        param_bytes: 100.0,
        stash_bytes: Some(200.0),
        recompute_stash_bytes: Some(10.0),
    };
    let profile = Profile::chain(vec![block.clone(); 4]);
    let opts = PlanOptions {
        straight: true,
        ..PlanOptions::new(4, f64::INFINITY)
    };
    let free = plan_partition(&profile, &opts).unwrap();
    assert!(free.stages.iter().all(|s| !s.recompute));
    // PipeDream holds 4, 3, 2 and 1 microbatches at the four stages: a bound between the
    // second and third stage's keeping everything makes the first two recompute.
    let kept: Vec<f64> = free.stages.iter().map(|s| s.memory).collect();
    let bound = (kept[1] + kept[2]) / 2.0;
    let bounded = PlanOptions {
        memory: Some(bound),
        ..opts.clone()
    };
    let plan = plan_partition(&profile, &bounded).unwrap();
    let recomputes: Vec<bool> = plan.stages.iter().map(|s| s.recompute).collect();
    assert_eq!(recomputes, [true, true, false, false]);
    for (s, k) in plan.stages.iter().zip(&kept) {
        assert!(s.memory <= bound, "{} over {bound}", s.memory);
        if s.recompute {
            // 190 bytes less per microbatch in flight, one more forward of 1 s.
            assert!(s.memory < *k);
            assert_eq!(s.compute, 4.0);
        } else {
            assert_eq!(s.compute, 3.0);
        }
    }
    let unable = Profile::chain(vec![
        LayerProfile {
            recompute_stash_bytes: None,
            ..block
        };
        4
    ]);
    assert!(plan_partition(&unable, &bounded).is_err());
}

/// Four equal layers whose activations are heavy except between the second and the third, on
/// two hosts joined by a slow network: the host boundary falls on the light activation, and
/// the plan says so. The first host takes one worker, so its stage must hold two layers.
#[test]
fn the_heavy_links_stay_inside_a_host() {
    let layer = |activation_bytes: f64| LayerProfile {
        forward: 0.5,
        backward_input: 0.5,
        activation_bytes,
        ..LayerProfile::compute_only("l".into(), 0.0)
    };
    let p = Profile::chain(vec![layer(1e9), layer(1e3), layer(1e9), layer(0.0)]);
    let within = PlanOptions {
        straight: true,
        ..PlanOptions::new(3, 1e12)
    };
    let network = Link {
        bandwidth: 1e6,
        latency: 0.0,
        message_cpu: 0.0,
        byte_cpu: 0.0,
    };
    let placed = PlanOptions {
        hosts: Some(Hosts::filled(
            &[("a".to_string(), 1), ("b".to_string(), 2)],
            network,
        )),
        ..within.clone()
    };
    // On one host, the first stage may be any size; across hosts, it takes layers 0-1, so
    // that the 1 KB activation crosses instead of a 1 GB one.
    let plan = plan_partition(&p, &placed).unwrap();
    assert_eq!(plan.stages[0].layers, 0..2, "{plan:?}");
    assert_eq!(plan.stages[0].hosts, vec![0]);
    assert!(plan.stages[1..].iter().all(|s| s.hosts == vec![1]));
    assert!(plan.time_per_microbatch < 10.0, "{plan:?}");
    // The same cut as the first without the placement costs 1,000 s per microbatch on the
    // network.
    let cut_first =
        pipe_scheduler::explain(&p, &placed, &[(0..1, 1), (1..2, 1), (2..4, 1)]).unwrap();
    assert!(cut_first.time_per_microbatch >= 1000.0, "{cut_first:?}");
    // The simulator charges the network on the crossing boundary as the plan does.
    let sim = pipe_scheduler::simulate_plan(&p, &cut_first, &placed).unwrap();
    assert!(sim >= 1000.0, "{sim}");
    let sim_planned = pipe_scheduler::simulate_plan(&p, &plan, &placed).unwrap();
    assert!(sim_planned < 10.0, "{sim_planned}");
}
