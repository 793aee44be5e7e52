//! The report's "Optimizers under delay" section: for each optimizer, how much its
//! asynchronous runs lose against its own synchronous (`sequential`) runs, seed by seed, at
//! equal updates (final test loss: a language model's validation loss per token) and at equal
//! wall time (training loss), with 95% intervals over seeds; then the published claims about
//! optimizers under a one-step delay (Zmushko et al., ICML 2026) marked agrees, disagrees or
//! cannot tell from those intervals.
//!
//! Where the matrix ran a delay correction (a remedy variant with `delay_correction`), a
//! "Delay correction" table follows: per optimizer, policy and correction, the corrected run's
//! gap and the share of the plain gap it recovered, `(gap_plain - gap_corrected) /
//! gap_plain`, seed by seed, with diverged runs counted; and the claim that error feedback
//! recovers 50-90% of 2BW's gap is marked from those shares.
//!
//! It reads `results.json` alone, like the rest of the report, and stays out of reports with
//! one optimizer or no asynchronous policy.

use std::fmt::Write as _;

use pipe_stages::optim::{DelayCorrection, OptimizerKind};

use super::StalenessResults;
use super::config::Family;
use super::run::RunRecord;

/// The optimizers the paper ranks that this runtime has (it also ranks Adan and SOAP): its
/// claims compare these with each other, and no other.
const RANKED: [OptimizerKind; 3] = [
    OptimizerKind::Adamw,
    OptimizerKind::Muon,
    OptimizerKind::Lion,
];

/// Policies whose gradients are late: every one but `sequential` and the flush schedules.
const DELAYED_POLICIES: [&str; 4] = ["2bw", "pipedream", "pipedream-nostash", "vsync"];

/// A mean with its 95% half-width over seeds (Student's t; NaN with fewer than two values).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Interval {
    mean: f64,
    half: f64,
    n: usize,
}

impl Interval {
    fn of(xs: &[f64]) -> Self {
        let v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
        let n = v.len();
        if n == 0 {
            return Interval {
                mean: f64::NAN,
                half: f64::NAN,
                n,
            };
        }
        let mean = v.iter().sum::<f64>() / n as f64;
        let half = if n < 2 {
            f64::NAN
        } else {
            let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            t95(n - 1) * (var / n as f64).sqrt()
        };
        Interval { mean, half, n }
    }

    /// Whether the whole interval lies below `other`'s (both known).
    fn below(&self, other: &Interval) -> bool {
        self.mean + self.half < other.mean - other.half
    }

    fn text(&self) -> String {
        match (self.n, self.half.is_finite()) {
            (0, _) => "-".into(),
            (_, true) => format!("{:+.4} ± {:.4}", self.mean, self.half),
            (_, false) => format!("{:+.4} (one seed)", self.mean),
        }
    }
}

/// Student's t at 97.5% for `dof` degrees of freedom.
fn t95(dof: usize) -> f64 {
    const T: [f64; 10] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    ];
    T.get(dof.saturating_sub(1)).copied().unwrap_or(1.96)
}

/// The runs of one optimizer under one policy, without remedies, by seed.
fn by_seed<'r>(
    r: &'r StalenessResults,
    policy: &str,
    stages: u32,
    opt: &str,
) -> Vec<(u64, &'r RunRecord)> {
    with_remedy(r, policy, stages, opt, "none")
}

/// The runs of one optimizer under one policy with remedy label `remedy`, by seed.
fn with_remedy<'r>(
    r: &'r StalenessResults,
    policy: &str,
    stages: u32,
    opt: &str,
    remedy: &str,
) -> Vec<(u64, &'r RunRecord)> {
    r.runs
        .iter()
        .filter(|x| {
            let s = &x.spec;
            s.family == Family::Pipeline
                && s.policy == policy
                && s.stages == stages
                && s.optimizer == opt
                && s.remedy == remedy
        })
        .map(|x| (x.spec.seed, x))
        .collect()
}

/// Mean training loss over the `window` updates ending at update `end` (exclusive).
fn window_loss(run: &RunRecord, end: usize, window: usize) -> f64 {
    let end = end.min(run.losses.len());
    let start = end.saturating_sub(window.max(1));
    if end == start || run.diverged_at.is_some() {
        return f64::NAN;
    }
    run.losses[start..end]
        .iter()
        .map(|&x| f64::from(x))
        .sum::<f64>()
        / (end - start) as f64
}

/// Per seed, what `late` loses against `sync`: final test loss at equal updates, and training
/// loss at equal wall time (the synchronous run's loss at the update it had reached when the
/// late one ended, updates taken as evenly spaced in its wall time).
fn gaps(
    sync: &[(u64, &RunRecord)],
    late: &[(u64, &RunRecord)],
    window: usize,
) -> (Interval, Interval) {
    let mut at_updates = Vec::new();
    let mut at_time = Vec::new();
    for (seed, l) in late {
        let Some((_, s)) = sync.iter().find(|(k, _)| k == seed) else {
            continue;
        };
        at_updates.push(l.final_test_loss() - s.final_test_loss());
        let share = (l.wall_s / s.wall_s.max(1e-9)).min(1.0);
        let reached = (share * s.losses.len() as f64).round() as usize;
        let late_loss = window_loss(l, l.losses.len(), window);
        at_time.push(late_loss - window_loss(s, reached, window));
    }
    (Interval::of(&at_updates), Interval::of(&at_time))
}

/// Writes the section (nothing for a report with fewer than two optimizers or no late
/// policy).
pub(super) fn optimizers_under_delay(md: &mut String, r: &StalenessResults) {
    let stages = r.config.stages.iter().copied().max().unwrap_or(1);
    let late: Vec<&str> = DELAYED_POLICIES
        .into_iter()
        .filter(|p| r.config.policies.iter().any(|q| q == p))
        .collect();
    if r.config.optimizers.len() < 2 || late.is_empty() || stages < 2 {
        return;
    }
    let w = r.config.target_window;
    let _ = writeln!(md, "## Optimizers under delay\n");
    let _ = writeln!(
        md,
        "What each asynchronous policy at {stages} stages loses against the same optimizer run \
         synchronously (`sequential`), seed by seed: the final test loss (a language model's \
         validation loss per token) at equal updates, and the training loss (mean of {w} \
         updates) at equal wall time. Mean ± 95% interval over seeds (Student's t); positive \
         is worse. Wall time here is threads sharing 2 cores, so equal wall time compares \
         this machine's runs, not a pipeline on dedicated workers.\n"
    );
    let mut head = String::from("| optimizer | sequential test loss |");
    let mut rule = String::from("|---|---|");
    for p in &late {
        let _ = write!(head, " {p}: at equal updates | {p}: at equal wall time |");
        rule.push_str("---|---|");
    }
    let _ = writeln!(md, "{head}\n{rule}");
    let mut two_bw: Vec<(OptimizerKind, &str, Interval)> = Vec::new();
    for o in &r.config.optimizers {
        let sync = by_seed(r, "sequential", 1, &o.name);
        let base = Interval::of(
            &sync
                .iter()
                .map(|(_, x)| x.final_test_loss())
                .collect::<Vec<_>>(),
        );
        let mut row = format!("| {} | {:.4} |", o.name, base.mean);
        for p in &late {
            let (updates, time) = gaps(&sync, &by_seed(r, p, stages, &o.name), w);
            let _ = write!(row, " {} | {} |", updates.text(), time.text());
            if *p == "2bw" && RANKED.contains(&o.kind) {
                two_bw.push((o.kind, o.name.as_str(), updates));
            }
        }
        let _ = writeln!(md, "{row}");
    }
    md.push('\n');
    let recovered = delay_correction(md, r, stages);
    // The claims rank optimizers against each other: two at least.
    if two_bw.len() >= 2 {
        claims(md, &two_bw, &recovered);
    }
}

/// The delay corrections the matrix ran at `stages`: (policy, remedy label) pairs, policies in
/// [`DELAYED_POLICIES`] order, labels in the order first met.
fn corrections(r: &StalenessResults, stages: u32) -> Vec<(&'static str, String)> {
    let mut pairs: Vec<(&'static str, String)> = Vec::new();
    for policy in DELAYED_POLICIES {
        for x in &r.runs {
            let s = &x.spec;
            if s.policy == policy
                && s.stages == stages
                && s.delay_correction.is_some()
                && !pairs.iter().any(|(p, l)| *p == policy && *l == s.remedy)
            {
                pairs.push((policy, s.remedy.clone()));
            }
        }
    }
    pairs
}

/// Writes the "Delay correction" table (nothing when the matrix ran none) and returns, per
/// optimizer the paper ranks, the share of its 2bw gap that error feedback recovered.
fn delay_correction(
    md: &mut String,
    r: &StalenessResults,
    stages: u32,
) -> Vec<(OptimizerKind, String, Interval)> {
    let pairs = corrections(r, stages);
    let mut feedback = Vec::new();
    if pairs.is_empty() {
        return feedback;
    }
    let _ = writeln!(md, "### Delay correction\n");
    let _ = writeln!(
        md,
        "Each correction under its policy at {stages} stages against the same optimizer's \
         plain runs of that policy and its sequential runs, seed by seed, at equal updates \
         (final test loss): the corrected run's gap to sequential, and the share of the plain \
         gap it recovered, `(gap_plain - gap_corrected) / gap_plain` (1 closes the gap; 0 \
         changes nothing; negative widens it). Mean ± 95% interval over seeds; a diverged run \
         counts in \"diverged\" and in no interval.\n"
    );
    let _ = writeln!(
        md,
        "| optimizer | policy | correction | plain gap | corrected gap | gap recovered | \
         diverged |\n|---|---|---|---|---|---|---|"
    );
    for o in &r.config.optimizers {
        let sync = by_seed(r, "sequential", 1, &o.name);
        for (policy, label) in &pairs {
            let plain = by_seed(r, policy, stages, &o.name);
            let fixed = with_remedy(r, policy, stages, &o.name, label);
            if fixed.is_empty() {
                continue;
            }
            let gap = |runs: &[(u64, &RunRecord)], seed: u64| -> f64 {
                let s = sync.iter().find(|(k, _)| *k == seed);
                let l = runs.iter().find(|(k, _)| *k == seed);
                match (s, l) {
                    (Some((_, s)), Some((_, l))) if l.diverged_at.is_none() => {
                        l.final_test_loss() - s.final_test_loss()
                    }
                    _ => f64::NAN,
                }
            };
            let seeds: Vec<u64> = fixed.iter().map(|(k, _)| *k).collect();
            let plain_gaps: Vec<f64> = seeds.iter().map(|&k| gap(&plain, k)).collect();
            let fixed_gaps: Vec<f64> = seeds.iter().map(|&k| gap(&fixed, k)).collect();
            let shares: Vec<f64> = plain_gaps
                .iter()
                .zip(&fixed_gaps)
                .map(|(p, f)| (p - f) / p)
                .collect();
            let share = Interval::of(&shares);
            let diverged = fixed
                .iter()
                .filter(|(_, x)| x.diverged_at.is_some())
                .count();
            let _ = writeln!(
                md,
                "| {} | {policy} | {label} | {} | {} | {} | {diverged} of {} |",
                o.name,
                Interval::of(&plain_gaps).text(),
                Interval::of(&fixed_gaps).text(),
                share.text(),
                fixed.len()
            );
            // The claim is about 2BW's one-step delay.
            let feedback_alone = label == DelayCorrection::ErrorFeedback.name();
            if *policy == "2bw" && feedback_alone && RANKED.contains(&o.kind) {
                feedback.push((o.kind, o.name.clone(), share));
            }
        }
    }
    md.push('\n');
    feedback
}

/// The paper's claims about PipeDream-2BW's one-step delay, against the 2bw gaps at equal
/// updates (`gaps`: kind, name, interval per optimizer the paper ranks).
fn claims(
    md: &mut String,
    gaps: &[(OptimizerKind, &str, Interval)],
    recovered: &[(OptimizerKind, String, Interval)],
) {
    let _ = writeln!(
        md,
        "The published claims on PipeDream-2BW's one-step delay (Zmushko et al., \"One-Step \
         Gradient Delay is Not a Barrier for Large-Scale Asynchronous Pipeline Parallel LLM \
         Pretraining\", ICML 2026), against the 2bw gaps at equal updates above, among the \
         optimizers it ranks that this runtime has (AdamW, Muon, Lion). A claim agrees when \
         its ordering holds with the intervals apart, disagrees when the opposite does, and \
         cannot be told otherwise.\n"
    );
    let _ = writeln!(md, "| claim | evidence | verdict |\n|---|---|---|");
    let find = |k: OptimizerKind| gaps.iter().find(|g| g.0 == k);
    let list = |xs: &[(OptimizerKind, &str, Interval)]| {
        xs.iter()
            .map(|(_, n, i)| format!("{n} {}", i.text()))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let evidence = list(gaps);
    let extreme = |k: OptimizerKind, worst: bool| -> &'static str {
        let Some((_, _, me)) = find(k) else {
            return "cannot tell (not in this matrix)";
        };
        let others: Vec<&Interval> = gaps.iter().filter(|g| g.0 != k).map(|g| &g.2).collect();
        let beyond = |a: &Interval, b: &Interval| if worst { b.below(a) } else { a.below(b) };
        if others.iter().all(|o| beyond(me, o)) {
            "agrees"
        } else if others.iter().any(|o| beyond(o, me)) {
            "disagrees"
        } else {
            "cannot tell"
        }
    };
    let _ = writeln!(
        md,
        "| AdamW loses the most to the delay | {evidence} | {} |",
        extreme(OptimizerKind::Adamw, true)
    );
    let _ = writeln!(
        md,
        "| Muon loses the least | {evidence} | {} |",
        extreme(OptimizerKind::Muon, false)
    );
    let between = match (
        find(OptimizerKind::Muon),
        find(OptimizerKind::Lion),
        find(OptimizerKind::Adamw),
    ) {
        (Some(m), Some(l), Some(a)) if m.2.below(&l.2) && l.2.below(&a.2) => "agrees",
        (Some(m), Some(l), Some(a)) if l.2.below(&m.2) || a.2.below(&l.2) => "disagrees",
        (Some(_), Some(_), Some(_)) => "cannot tell",
        _ => "cannot tell (not in this matrix)",
    };
    let _ = writeln!(
        md,
        "| Lion lies between Muon and AdamW | {evidence} | {between} |"
    );
    let (evidence, verdict) = one_step_claim(gaps);
    let _ = writeln!(
        md,
        "| At a one-step delay AdamW loses more than 0.2 and Muon 0.012 | {evidence} | \
         {verdict} |"
    );
    let (evidence, verdict) = feedback_claim(recovered);
    let _ = writeln!(
        md,
        "| Error feedback recovers 50-90% of the remaining gap | {evidence} | {verdict} |"
    );
    let _ = writeln!(
        md,
        "| On a 10B MoE: synchronous 1.906, asynchronous 1.911, asynchronous with error \
         feedback 1.906 | no mixture-of-experts model in this runtime | cannot tell |"
    );
    let _ = writeln!(
        md,
        "| The more momentum, the more robust | one momentum per optimizer in this matrix | \
         cannot tell |\n"
    );
}

/// The claim that at a one-step delay AdamW's loss gap exceeds 0.2 and Muon's is 0.012: agrees
/// when AdamW's interval lies above 0.2 and Muon's reaches 0.012 or below; disagrees when
/// AdamW's lies below 0.2 or Muon's lies wholly above 0.012; cannot be told otherwise. The
/// paper's losses are per token of larger models and these per character of gpt-mini, so the
/// evidence says which.
fn one_step_claim(gaps: &[(OptimizerKind, &str, Interval)]) -> (String, &'static str) {
    let find = |k: OptimizerKind| {
        gaps.iter()
            .find(|g| g.0 == k)
            .map(|g| g.2)
            .filter(|i| i.n >= 2 && i.half.is_finite())
    };
    let (Some(adamw), Some(muon)) = (find(OptimizerKind::Adamw), find(OptimizerKind::Muon)) else {
        return ("AdamW or Muon not in this matrix".into(), "cannot tell");
    };
    let evidence = format!(
        "2bw gap adamw {}, muon {} (this matrix's loss per character)",
        adamw.text(),
        muon.text()
    );
    let verdict = if adamw.mean + adamw.half < 0.2 || muon.mean - muon.half > 0.012 {
        "disagrees"
    } else if adamw.mean - adamw.half > 0.2 && muon.mean - muon.half <= 0.012 {
        "agrees"
    } else {
        "cannot tell"
    };
    (evidence, verdict)
}

/// The claim that error feedback recovers 50-90% of the gap, from the shares recovered per
/// optimizer: agrees when every share's interval lies inside [0.5, 0.9], disagrees when one
/// lies wholly outside it, and cannot be told otherwise (or without the runs).
fn feedback_claim(recovered: &[(OptimizerKind, String, Interval)]) -> (String, &'static str) {
    if recovered.is_empty() {
        return ("error feedback not in this matrix".into(), "cannot tell");
    }
    let evidence = recovered
        .iter()
        .map(|(_, n, i)| format!("{n} recovered {}", i.text()))
        .collect::<Vec<_>>()
        .join("; ");
    let known = |i: &Interval| i.n >= 2 && i.half.is_finite();
    let inside = |i: &Interval| known(i) && i.mean - i.half >= 0.5 && i.mean + i.half <= 0.9;
    let outside = |i: &Interval| known(i) && (i.mean + i.half < 0.5 || i.mean - i.half > 0.9);
    let verdict = if recovered.iter().all(|(_, _, i)| inside(i)) {
        "agrees"
    } else if recovered.iter().any(|(_, _, i)| outside(i)) {
        "disagrees"
    } else {
        "cannot tell"
    };
    (evidence, verdict)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_use_students_t_and_order_only_when_apart() {
        let a = Interval::of(&[1.0, 2.0, 3.0]);
        assert!((a.mean - 2.0).abs() < 1e-12);
        // sd 1, n 3: 4.303 / sqrt(3).
        assert!((a.half - 4.303 / 3f64.sqrt()).abs() < 1e-9);
        let b = Interval::of(&[10.0, 10.5, 11.0]);
        assert!(a.below(&b) && !b.below(&a));
        let c = Interval::of(&[2.5, 3.0, 3.5]);
        assert!(!a.below(&c), "overlapping intervals are not ordered");
        let one = Interval::of(&[0.2]);
        assert_eq!(one.text(), "+0.2000 (one seed)");
        assert!(!one.below(&b), "one seed orders nothing");
        assert_eq!(Interval::of(&[f64::NAN]).text(), "-");
    }

    fn verdicts(gaps: &[(OptimizerKind, &str, Interval)]) -> Vec<String> {
        let mut md = String::new();
        claims(&mut md, gaps, &[]);
        md.lines()
            .filter(|l| l.starts_with("| ") && !l.starts_with("| claim"))
            .map(|l| {
                l.trim_end_matches(" |")
                    .rsplit(" | ")
                    .next()
                    .unwrap()
                    .to_string()
            })
            .collect()
    }

    #[test]
    fn each_claim_is_marked_from_the_intervals() {
        let at = |mean: f64, half: f64| Interval { mean, half, n: 3 };
        let paper = [
            (OptimizerKind::Adamw, "adamw", at(0.25, 0.02)),
            (OptimizerKind::Muon, "muon", at(0.01, 0.005)),
            (OptimizerKind::Lion, "lion", at(0.08, 0.01)),
        ];
        assert_eq!(
            verdicts(&paper)[..4],
            ["agrees", "agrees", "agrees", "agrees"],
            "the paper's ordering and sizes"
        );
        let reversed = [
            (OptimizerKind::Adamw, "adamw", at(0.01, 0.005)),
            (OptimizerKind::Muon, "muon", at(0.20, 0.02)),
            (OptimizerKind::Lion, "lion", at(0.08, 0.01)),
        ];
        assert_eq!(
            verdicts(&reversed)[..4],
            ["disagrees", "disagrees", "disagrees", "disagrees"]
        );
        let overlapping = [
            (OptimizerKind::Adamw, "adamw", at(0.05, 0.05)),
            (OptimizerKind::Muon, "muon", at(0.04, 0.05)),
        ];
        let v = verdicts(&overlapping);
        assert_eq!(v[..2], ["cannot tell", "cannot tell"]);
        assert_eq!(v[2], "cannot tell (not in this matrix)");
        assert_eq!(v[3], "disagrees", "AdamW's gap lies below 0.2");
        assert_eq!(v[4..], ["cannot tell", "cannot tell", "cannot tell"]);
        let near = [
            (OptimizerKind::Adamw, "adamw", at(0.25, 0.1)),
            (OptimizerKind::Muon, "muon", at(0.02, 0.01)),
        ];
        assert_eq!(
            verdicts(&near)[3],
            "cannot tell",
            "AdamW's interval reaches 0.2"
        );
    }

    #[test]
    fn the_feedback_claim_is_marked_from_the_shares_recovered() {
        let at = |mean: f64, half: f64| Interval { mean, half, n: 3 };
        let share = |i: Interval| vec![(OptimizerKind::Adamw, "adamw".to_string(), i)];
        assert_eq!(feedback_claim(&share(at(0.7, 0.1))).1, "agrees");
        assert_eq!(feedback_claim(&share(at(0.1, 0.1))).1, "disagrees");
        assert_eq!(feedback_claim(&share(at(1.2, 0.1))).1, "disagrees");
        assert_eq!(feedback_claim(&share(at(0.5, 0.3))).1, "cannot tell");
        assert_eq!(feedback_claim(&[]).1, "cannot tell");
        let one_seed = Interval::of(&[0.7]);
        assert_eq!(feedback_claim(&share(one_seed)).1, "cannot tell");
    }
}
