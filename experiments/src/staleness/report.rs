//! `REPORT.md` from saved results: tables (mean and spread over seeds), SVG plots with their
//! CSV, the published expectations checked against the data with the rule written next to
//! each verdict, and the discussion a person wrote after reading the data (`discussion.md` in
//! the results directory, included verbatim when present). Nothing here re-runs training.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::StalenessResults;
use super::config::Family;
use super::run::{RunRecord, StageDelay};
use crate::ExperimentError;
use crate::plot::{LineChart, Series};

/// Mean and sample standard deviation of the finite values, and how many there were.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    /// Mean.
    pub mean: f64,
    /// Sample standard deviation (0 for one value).
    pub sd: f64,
    /// Finite values.
    pub n: usize,
}

impl Spread {
    /// Of `xs`' finite values (NaN mean when none).
    pub fn of(xs: impl IntoIterator<Item = f64>) -> Self {
        let v: Vec<f64> = xs.into_iter().filter(|x| x.is_finite()).collect();
        let n = v.len();
        if n == 0 {
            return Spread {
                mean: f64::NAN,
                sd: f64::NAN,
                n,
            };
        }
        let mean = v.iter().sum::<f64>() / n as f64;
        let var = if n > 1 {
            v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64
        } else {
            0.0
        };
        Spread {
            mean,
            sd: var.sqrt(),
            n,
        }
    }
}

/// The runs of one cell of a table: same family, policy, stages, optimizer and remedy; one
/// per seed.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct CellKey {
    family: String,
    policy: String,
    stages: u32,
    optimizer: String,
    remedy: String,
}

/// Runs grouped by cell.
struct Cells<'r> {
    cells: BTreeMap<CellKey, Vec<&'r RunRecord>>,
    window: usize,
}

impl<'r> Cells<'r> {
    fn new(results: &'r StalenessResults) -> Self {
        let mut cells: BTreeMap<CellKey, Vec<&RunRecord>> = BTreeMap::new();
        for r in &results.runs {
            let s = &r.spec;
            let key = CellKey {
                family: format!("{:?}", s.family),
                policy: s.policy.clone(),
                stages: s.stages,
                optimizer: s.optimizer.clone(),
                remedy: s.remedy.clone(),
            };
            cells.entry(key).or_default().push(r);
        }
        Cells {
            cells,
            window: results.config.target_window,
        }
    }

    fn get(
        &self,
        family: Family,
        policy: &str,
        stages: u32,
        opt: &str,
        remedy: &str,
    ) -> &[&'r RunRecord] {
        let key = CellKey {
            family: format!("{family:?}"),
            policy: policy.into(),
            stages,
            optimizer: opt.into(),
            remedy: remedy.into(),
        };
        self.cells.get(&key).map_or(&[], Vec::as_slice)
    }

    /// Final test accuracy over seeds (percent).
    fn accuracy(runs: &[&RunRecord]) -> Spread {
        Spread::of(runs.iter().map(|r| 100.0 * r.final_accuracy()))
    }

    /// Final training loss (mean of the last window) over seeds; NaN for diverged runs.
    fn final_loss(&self, runs: &[&RunRecord]) -> Spread {
        Spread::of(runs.iter().map(|r| {
            if r.diverged_at.is_some() || r.losses.is_empty() {
                return f64::NAN;
            }
            let n = r.losses.len();
            let w = self.window.min(n);
            r.losses[n - w..].iter().map(|&x| f64::from(x)).sum::<f64>() / w as f64
        }))
    }
}

/// One table cell's text: accuracy, final loss, updates and seconds to target.
fn cell_text(cells: &Cells<'_>, runs: &[&RunRecord]) -> [String; 4] {
    if runs.is_empty() {
        return ["".into(), "".into(), "".into(), "".into()];
    }
    let diverged = runs.iter().filter(|r| r.diverged_at.is_some()).count();
    let acc = Cells::accuracy(runs);
    let loss = cells.final_loss(runs);
    let mut a = if acc.n == 0 {
        "diverged".to_string()
    } else {
        format!("{:.2} ± {:.2}", acc.mean, acc.sd)
    };
    if diverged > 0 && acc.n > 0 {
        let _ = write!(a, " ({diverged}/{} diverged)", runs.len());
    }
    let l = if loss.n == 0 {
        "-".into()
    } else {
        format!("{:.4} ± {:.4}", loss.mean, loss.sd)
    };
    let reached: Vec<&&RunRecord> = runs
        .iter()
        .filter(|r| r.updates_to_target.is_some())
        .collect();
    let (u, s) = if reached.is_empty() {
        ("not reached".to_string(), "-".to_string())
    } else {
        let u = Spread::of(
            reached
                .iter()
                .filter_map(|r| r.updates_to_target)
                .map(|u| u as f64),
        );
        let s = Spread::of(reached.iter().filter_map(|r| r.seconds_to_target));
        let of = if reached.len() < runs.len() {
            format!(" ({}/{})", reached.len(), runs.len())
        } else {
            String::new()
        };
        (format!("{:.0}{of}", u.mean), format!("{:.1}", s.mean))
    };
    [a, l, u, s]
}

/// Writes `REPORT.md`, `plots/*.svg` and `plots/*.csv` into `dir`; returns the report's path.
///
/// # Errors
/// Unwritable files; results with no runs.
pub fn write_report(results: &StalenessResults, dir: &Path) -> Result<PathBuf, ExperimentError> {
    if results.runs.is_empty() {
        return Err(ExperimentError::Config("the results hold no runs".into()));
    }
    let cells = Cells::new(results);
    let discussion = crate::read_discussion(dir)?;
    // The charts are drawn into a staging directory that replaces `plots/` whole once every
    // one is drawn: a chart that cannot be drawn leaves the earlier report's plots as they were.
    pipe_stages::outputs::check_owned_file(dir, "REPORT.md")?;
    let plots = pipe_stages::outputs::StagedDir::regenerating(
        &dir.join("plots"),
        crate::plot::is_plot_file,
    )?;
    let mut md = String::new();
    header(&mut md, results);
    let figures = write_plots(results, &cells, plots.path())?;
    // A synchronous sweep (one stage) has no remedies, delays or expectations to show.
    if results.config.stages.iter().all(|&k| k == 1) {
        sweep_table(&mut md, results, &cells);
    } else {
        main_table(&mut md, results, &cells);
        if !results.config.remedies.policies.is_empty() {
            remedies_table(&mut md, results, &cells);
        }
        delayed_table(&mut md, results, &cells);
        delays_table(&mut md, results);
        expectations(&mut md, results, &cells);
        super::delay_gap::optimizers_under_delay(&mut md, results);
    }
    md.push_str("\n## Figures\n\nEach SVG has the CSV of the points it draws beside it.\n\n");
    for f in &figures {
        let (file, caption) = (&f.file, &f.caption);
        if f.drawn {
            let _ = writeln!(
                md,
                "**{caption}** (`plots/{file}.csv`)\n\n![{caption}](plots/{file}.svg)\n"
            );
        } else {
            let _ = writeln!(
                md,
                "**{caption}**: not drawn: no run behind it left a finite point (each diverged \
                 before a full window of updates or an evaluation; the tables above say which).\n"
            );
        }
    }
    md.push_str("\n## Discussion\n\n");
    match discussion {
        Some(text) => md.push_str(&text),
        None => md.push_str("_No `discussion.md` in the results directory._\n"),
    }
    plots.commit()?;
    Ok(pipe_stages::outputs::write_owned_file(
        dir,
        "REPORT.md",
        md.as_bytes(),
    )?)
}

fn header(md: &mut String, r: &StalenessResults) {
    let c = &r.config;
    let m = &r.machine;
    let _ = writeln!(md, "# Staleness experiment: {} on {}\n", c.model, c.dataset);
    let _ = writeln!(
        md,
        "Generated by `pipe report staleness` from `results.json`; produced by:\n\n```\n{}\n```\n",
        r.command
    );
    let _ = writeln!(
        md,
        "- Machine: {} ({} logical cores, {:.0} GiB, {}); started {} UTC; {} runs in {:.1} min{}.",
        m.cpu,
        m.cores,
        m.memory_gib,
        m.os,
        utc(r.started_unix),
        r.runs.len(),
        r.wall_s / 60.0,
        if r.quick {
            " (`--quick`: a reduced matrix)"
        } else {
            ""
        }
    );
    if !r.kept_elsewhere.is_empty() {
        let mut machines: Vec<String> = r
            .kept_elsewhere
            .iter()
            .map(|(_, m)| format!("{} ({} logical cores)", m.cpu, m.cores))
            .collect();
        machines.sort();
        machines.dedup();
        let _ = writeln!(
            md,
            "- {} runs were kept from earlier sittings on other machines ({}): their seconds are \
             those machines', so time comparisons across sittings are rough.",
            r.kept_elsewhere.len(),
            machines.join(", ")
        );
    }
    let samples = |n: usize| {
        if n == 0 {
            "all".to_string()
        } else {
            n.to_string()
        }
    };
    let _ = writeln!(
        md,
        "- Model `{}`, {} training samples, {} test samples, {} epochs, {} samples per update in \
         every run, seeds {:?}, stages {:?}; cosine learning rate with a 5% warm-up; FLOP-balanced \
         partition; one compute thread per worker.",
        c.model,
        samples(c.train_samples),
        samples(c.test_samples),
        c.epochs,
        c.minibatch,
        c.seeds,
        c.stages
    );
    let opts: Vec<String> = c
        .optimizers
        .iter()
        .map(|o| {
            format!(
                "{} ({:?}, lr {}, momentum {}, weight decay {})",
                o.name, o.kind, o.lr, o.momentum, o.weight_decay
            )
        })
        .collect();
    let _ = writeln!(md, "- Optimizers: {}.", opts.join("; "));
    let _ = writeln!(
        md,
        "- Microbatches: PipeDream, pipedream-nostash and vsync update after every microbatch of \
         {} samples (as PipeDream does); 2BW and the flush schedules cut the same {} samples into \
         one microbatch per stage (2BW needs at least stages - 1 per update).",
        c.minibatch, c.minibatch
    );
    let _ = writeln!(
        md,
        "- Target: the training loss averaged over {} updates at or below {}; \"updates to target\" \
         is the mean over the seeds that reached it (reached/seeds when not all did), seconds are \
         wall time on this machine, where every worker is a thread sharing {} cores: they compare \
         policies' numerics, not a pipeline's speed on dedicated workers.",
        c.target_window, c.target_loss, m.cores
    );
    let _ = writeln!(
        md,
        "- A diverged run (a loss or gradient not finite) counts in no mean; the table says how \
         many diverged.\n"
    );
}

fn optimizer_names(r: &StalenessResults) -> Vec<String> {
    r.config.optimizers.iter().map(|o| o.name.clone()).collect()
}

fn table_head(md: &mut String, first: &[&str], opts: &[String]) {
    let mut cols: Vec<String> = first.iter().map(|s| (*s).to_string()).collect();
    for o in opts {
        cols.push(format!("{o}: test acc %"));
        cols.push(format!("{o}: final loss"));
        cols.push(format!("{o}: updates to target"));
        cols.push(format!("{o}: s to target"));
    }
    let _ = writeln!(md, "| {} |", cols.join(" | "));
    let _ = writeln!(md, "|{}", "---|".repeat(cols.len()));
}

fn table_row(md: &mut String, first: &[String], cells: &Cells<'_>, per_opt: &[&[&RunRecord]]) {
    let mut cols: Vec<String> = first.to_vec();
    for runs in per_opt {
        cols.extend(cell_text(cells, runs));
    }
    let _ = writeln!(md, "| {} |", cols.join(" | "));
}

/// A synchronous sweep, one row per optimizer setting: its rate and decay, then the final
/// figures (test loss is a language model's validation loss per token).
fn sweep_table(md: &mut String, r: &StalenessResults, cells: &Cells<'_>) {
    md.push_str(
        "## Sequential runs per optimizer setting

",
    );
    md.push_str(
        "Mean ± sd over seeds.

",
    );
    md.push_str(
        "| optimizer | kind | lr | weight decay | test loss | test acc % | final train loss | updates to target | s to target |\n",
    );
    md.push_str("|---|---|---|---|---|---|---|---|---|\n");
    for o in &r.config.optimizers {
        let runs = cells.get(Family::Pipeline, "sequential", 1, &o.name, "none");
        if runs.is_empty() {
            continue;
        }
        let test = Spread::of(runs.iter().map(|x| x.final_test_loss()));
        let [acc, loss, updates, seconds] = cell_text(cells, runs);
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {:.4} ± {:.4} | {acc} | {loss} | {updates} | {seconds} |",
            o.name,
            o.kind.name(),
            o.lr,
            o.weight_decay,
            test.mean,
            test.sd
        );
    }
    md.push('\n');
}

fn main_table(md: &mut String, r: &StalenessResults, cells: &Cells<'_>) {
    let opts = optimizer_names(r);
    md.push_str("## Policies against stage count (no remedy)\n\n");
    md.push_str("Final test accuracy and training loss: mean ± sd over seeds.\n\n");
    table_head(md, &["policy", "stages"], &opts);
    for policy in &r.config.policies {
        for &s in &r.config.stages {
            let per: Vec<&[&RunRecord]> = opts
                .iter()
                .map(|o| cells.get(Family::Pipeline, policy, s, o, "none"))
                .collect();
            if per.iter().all(|p| p.is_empty()) {
                continue;
            }
            table_row(md, &[policy.clone(), s.to_string()], cells, &per);
        }
    }
    md.push('\n');
}

fn remedies_table(md: &mut String, r: &StalenessResults, cells: &Cells<'_>) {
    let opts = optimizer_names(r);
    let s = r.config.remedies.stages;
    let _ = writeln!(md, "## Remedies at {s} stages\n");
    table_head(md, &["policy", "remedy"], &opts);
    for policy in &r.config.remedies.policies {
        let mut remedies: Vec<String> = vec!["none".into()];
        for run in &r.runs {
            let sp = &run.spec;
            if sp.family == Family::Pipeline
                && &sp.policy == policy
                && sp.stages == s
                && !remedies.contains(&sp.remedy)
            {
                remedies.push(sp.remedy.clone());
            }
        }
        for remedy in remedies {
            let per: Vec<&[&RunRecord]> = opts
                .iter()
                .map(|o| cells.get(Family::Pipeline, policy, s, o, &remedy))
                .collect();
            table_row(md, &[policy.clone(), remedy], cells, &per);
        }
    }
    md.push('\n');
}

/// Whether the experiment ran the delayed data-parallel baseline (a configuration may leave
/// it out, with no delays).
fn has_delayed(r: &StalenessResults) -> bool {
    r.runs.iter().any(|x| x.spec.family == Family::Delayed)
}

fn delayed_table(md: &mut String, r: &StalenessResults, cells: &Cells<'_>) {
    if !has_delayed(r) {
        return;
    }
    let opts = optimizer_names(r);
    md.push_str("## Delayed data-parallel SGD (the parameter-server picture)\n\n");
    md.push_str(
        "One worker trains the whole model; the gradient applied at update t was computed on the \
         weights of update t - d. `uniform:N` draws d from 0..=N per update.\n\n",
    );
    table_head(md, &["delay", "remedy"], &opts);
    let mut seen: Vec<(String, String)> = Vec::new();
    for run in r.runs.iter().filter(|x| x.spec.family == Family::Delayed) {
        let k = (run.spec.policy.clone(), run.spec.remedy.clone());
        if seen.contains(&k) {
            continue;
        }
        seen.push(k.clone());
        let per: Vec<&[&RunRecord]> = opts
            .iter()
            .map(|o| cells.get(Family::Delayed, &k.0, 1, o, &k.1))
            .collect();
        let delay = k.0.trim_start_matches("delay:").to_string();
        table_row(md, &[delay, k.1], cells, &per);
    }
    md.push('\n');
}

/// The measured delays per stage at the most stages, from the first seed's ledgers.
fn delays_table(md: &mut String, r: &StalenessResults) {
    let s = r.config.stages.iter().copied().max().unwrap_or(1);
    let _ = writeln!(
        md,
        "## Measured delay per stage at {s} stages\n\nFrom the version ledgers (`ledgers/`): mean \
         updates between the weights a forward (backward) used and the update its gradient went \
         into, forward / backward. Every seed and optimizer has the same ledger; the first that \
         ran to the end is shown (a diverged run leaves no ledger).\n"
    );
    let _ = writeln!(
        md,
        "| policy | {} |",
        (0..s)
            .map(|i| format!("stage {i}"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let _ = writeln!(md, "|---|{}", "---|".repeat(s as usize));
    for policy in &r.config.policies {
        let Some(run) = first_ledger(r, policy, s) else {
            continue;
        };
        let cols: Vec<String> = run
            .stage_delays
            .iter()
            .map(|d| format!("{:.2} / {:.2}", d.forward_mean, d.backward_mean))
            .collect();
        let _ = writeln!(md, "| {policy} | {} |", cols.join(" | "));
    }
    md.push('\n');
}

/// The first run of `policy` at `stages` without remedy that has a ledger (a run that
/// diverged has none).
fn first_ledger<'r>(r: &'r StalenessResults, policy: &str, stages: u32) -> Option<&'r RunRecord> {
    r.runs.iter().find(|x| {
        x.spec.family == Family::Pipeline
            && x.spec.policy == policy
            && x.spec.stages == stages
            && x.spec.remedy == "none"
            && !x.stage_delays.is_empty()
    })
}

/// Accuracy difference (percentage points) that counts as "the same": two standard deviations
/// of the synchronous runs over seeds, and at least `FLOOR_PP`.
const FLOOR_PP: f64 = 0.3;

fn expectations(md: &mut String, r: &StalenessResults, cells: &Cells<'_>) {
    md.push_str("## The published expectations against these data\n\n");
    let _ = writeln!(
        md,
        "Final test accuracy (mean over seeds) at each stage count. \"Same\" means within two \
         standard deviations of the sequential runs over seeds, and at least {FLOOR_PP} points; a \
         diverged run is never the same. Verdicts are computed from the tables above.\n"
    );
    md.push_str("| expectation | optimizer | evidence | verdict |\n|---|---|---|---|\n");
    let stages: Vec<u32> = r.config.stages.iter().copied().filter(|&k| k > 1).collect();
    for opt in optimizer_names(r) {
        let acc = |policy: &str, k: u32| {
            let runs = cells.get(Family::Pipeline, policy, k, &opt, "none");
            (
                Cells::accuracy(runs),
                runs.iter().any(|x| x.diverged_at.is_some()),
            )
        };
        let (seq, seq_diverged) = acc("sequential", 1);
        let tol = (2.0 * seq.sd).max(FLOOR_PP);
        let near = |a: (Spread, bool), b: f64| !a.1 && (a.0.mean - b).abs() <= tol;
        let by_stage_of = |policy: &str| -> String {
            let parts: Vec<String> = stages
                .iter()
                .map(|&k| format!("{k}: {}", show(acc(policy, k))))
                .collect();
            format!("{policy} {}", parts.join(", "))
        };
        // A baseline that diverged, or that the matrix did not run for this optimizer, is no
        // baseline: the rows that compare with it say so rather than compare with NaN.
        let baseline = (!seq_diverged && seq.mean.is_finite()).then_some(seq.mean);
        let missing = if seq_diverged {
            ("diverged", "the sequential baseline diverged")
        } else {
            (
                "none run",
                "no sequential run of this optimizer to compare with",
            )
        };
        let against_sequential = |policy: &str, shows_tolerance: bool| match baseline {
            Some(mean) => (
                format!(
                    "{} vs sequential {mean:.2}{}",
                    by_stage_of(policy),
                    if shows_tolerance {
                        format!(" (tolerance {tol:.2})")
                    } else {
                        String::new()
                    }
                ),
                per_stage(&stages, |k| near(acc(policy, k), mean)),
            ),
            None => (
                format!("{} vs sequential: {}", by_stage_of(policy), missing.0),
                format!("cannot tell: {}", missing.1),
            ),
        };
        // A row only for the policies the experiment ran.
        let ran = |p: &str| r.config.policies.iter().any(|x| x == p);
        let mut row = |what: &str, needs: &[&str], evidence: String, verdict: String| {
            if needs.iter().all(|p| ran(p)) {
                let _ = writeln!(md, "| {what} | {opt} | {evidence} | {verdict} |");
            }
        };
        let (evidence, verdict) = against_sequential("pipedream", true);
        row(
            "weight stashing tracks synchronous training",
            &["pipedream"],
            evidence,
            verdict,
        );
        // Without stashing, quality falls with the stage count, and below stashing's.
        row(
            "without stashing, quality degrades as stages grow (below stashing)",
            &["pipedream", "pipedream-nostash"],
            format!(
                "{}; {}",
                by_stage_of("pipedream-nostash"),
                by_stage_of("pipedream")
            ),
            per_stage(&stages, |k| {
                let (ns, pd) = (acc("pipedream-nostash", k), acc("pipedream", k));
                ns.1 && !pd.1 || ns.0.mean < pd.0.mean - tol
            }),
        );
        row(
            "vertical sync behaves like stashing",
            &["pipedream", "vsync"],
            format!("{}; {}", by_stage_of("vsync"), by_stage_of("pipedream")),
            per_stage(&stages, |k| {
                let pd = acc("pipedream", k);
                !pd.1 && near(acc("vsync", k), pd.0.mean)
            }),
        );
        let (evidence, verdict) = against_sequential("2bw", false);
        row(
            "2BW behaves like synchronous training",
            &["2bw"],
            evidence,
            verdict,
        );
    }
    sensitivity(md, r, cells);
    md.push('\n');
}

/// `agrees` / `disagrees`, or which stage counts agree when they differ.
fn per_stage(stages: &[u32], agrees: impl Fn(u32) -> bool) -> String {
    let (yes, no): (Vec<u32>, Vec<u32>) = stages.iter().partition(|&&k| agrees(k));
    let list = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
    match (yes.is_empty(), no.is_empty()) {
        (false, true) => "agrees".into(),
        (true, false) => "disagrees".into(),
        _ => format!(
            "agrees at {} stages; disagrees at {}",
            list(&yes),
            list(&no)
        ),
    }
}

/// AdamW against SGD: the accuracy each loses to a fixed gradient delay in the delayed
/// data-parallel baseline (one model, one semantics, the delay the only change), relative to
/// its own undelayed run.
fn sensitivity(md: &mut String, r: &StalenessResults, cells: &Cells<'_>) {
    let names = optimizer_names(r);
    let (Some(sgd), Some(adam)) = (
        names.iter().find(|n| n.contains("sgd")),
        names.iter().find(|n| n.contains("adam")),
    ) else {
        return;
    };
    let delays: Vec<&str> = r
        .config
        .delayed
        .delays
        .iter()
        .map(String::as_str)
        .filter(|d| *d != "0" && d.parse::<u32>().is_ok())
        .collect();
    let lost = |opt: &str, d: &str| -> Option<f64> {
        let base = Cells::accuracy(cells.get(Family::Delayed, "delay:0", 1, opt, "none")).mean;
        let runs = cells.get(Family::Delayed, &format!("delay:{d}"), 1, opt, "none");
        if runs.is_empty() || runs.iter().any(|x| x.diverged_at.is_some()) {
            return None;
        }
        Some(base - Cells::accuracy(runs).mean)
    };
    let mut evidence = Vec::new();
    let (mut adam_worse, mut sgd_worse) = (0, 0);
    for d in delays {
        let (a, b) = (lost(sgd, d), lost(adam, d));
        let text = |x: Option<f64>| x.map_or("diverged".to_string(), |v| format!("{v:.2}"));
        evidence.push(format!("delay {d}: {sgd} {}, {adam} {}", text(a), text(b)));
        match (a, b) {
            (Some(x), Some(y)) if y > x => adam_worse += 1,
            (None, Some(_)) => sgd_worse += 1,
            (Some(_), None) => adam_worse += 1,
            (Some(_), Some(_)) => sgd_worse += 1,
            (None, None) => {}
        }
    }
    if evidence.is_empty() {
        return;
    }
    let verdict = match (adam_worse, sgd_worse) {
        (a, 0) if a > 0 => "agrees",
        (0, s) if s > 0 => "disagrees",
        _ => "mixed",
    };
    let _ = writeln!(
        md,
        "| AdamW is more sensitive to delay than SGD | both | accuracy points lost against the \
         undelayed run in the delayed data-parallel baseline: {} | {verdict} |",
        evidence.join("; ")
    );
}

fn show((sp, diverged): (Spread, bool)) -> String {
    if sp.n == 0 {
        return "diverged".into();
    }
    let d = if diverged { " (some diverged)" } else { "" };
    format!("{:.2} ± {:.2}{d}", sp.mean, sp.sd)
}

/// A seed-averaged, smoothed loss curve of `runs` (moving average over `window` updates,
/// at most 400 points). Diverged runs are left out.
fn curve(runs: &[&RunRecord], window: usize) -> Vec<(f64, f64)> {
    let ok: Vec<&&RunRecord> = runs.iter().filter(|r| r.diverged_at.is_none()).collect();
    let n = ok.iter().map(|r| r.losses.len()).min().unwrap_or(0);
    if n == 0 {
        return Vec::new();
    }
    let mean: Vec<f64> = (0..n)
        .map(|i| ok.iter().map(|r| f64::from(r.losses[i])).sum::<f64>() / ok.len() as f64)
        .collect();
    let w = window.max(1);
    let step = n.div_ceil(400).max(1);
    let mut out = Vec::new();
    let mut sum = 0.0;
    for (i, &x) in mean.iter().enumerate() {
        sum += x;
        if i >= w {
            sum -= mean[i - w];
        }
        if (i + 1) % step == 0 || i + 1 == n {
            out.push(((i + 1) as f64, sum / (i + 1).min(w) as f64));
        }
    }
    out
}

fn write_plots(
    r: &StalenessResults,
    cells: &Cells<'_>,
    dir: &Path,
) -> Result<Vec<Figure>, ExperimentError> {
    let mut figures = Vec::new();
    let s = r.config.stages.iter().copied().max().unwrap_or(1);
    let w = r.config.target_window;
    if s == 1 {
        // A synchronous sweep (one stage, `sequential` only): one chart of every optimizer.
        let series = optimizer_names(r)
            .into_iter()
            .map(|opt| Series {
                points: curve(
                    cells.get(Family::Pipeline, "sequential", 1, &opt, "none"),
                    w,
                ),
                name: opt,
            })
            .collect();
        let title = format!("Training loss, sequential (mean over seeds, {w}-update average)");
        let caption = "Loss against update per optimizer, sequential".to_string();
        let chart = LineChart::loss(title, series);
        figures.push(figure(dir, "loss-sequential".into(), caption, &chart)?);
        return Ok(figures);
    }
    for opt in optimizer_names(r) {
        // Loss against update per policy at the most stages.
        let mut series = vec![Series {
            name: "sequential (1 stage)".into(),
            points: curve(
                cells.get(Family::Pipeline, "sequential", 1, &opt, "none"),
                w,
            ),
        }];
        for p in r
            .config
            .policies
            .iter()
            .filter(|p| p.as_str() != "sequential")
        {
            series.push(Series {
                name: p.clone(),
                points: curve(cells.get(Family::Pipeline, p, s, &opt, "none"), w),
            });
        }
        let name = format!("loss-{s}-stages-{opt}");
        let title =
            format!("Training loss at {s} stages, {opt} (mean over seeds, {w}-update average)");
        let caption = format!("Loss against update per policy at {s} stages, {opt}");
        figures.push(figure(dir, name, caption, &LineChart::loss(title, series))?);
        figures.push(quality_plot(r, cells, dir, &opt)?);
        figures.extend(remedy_plots(r, cells, dir, &opt)?);
        if has_delayed(r) {
            figures.push(delayed_plot(r, cells, dir, &opt)?);
        }
    }
    figures.push(staleness_plot(r, dir)?);
    Ok(figures)
}

fn quality_plot(
    r: &StalenessResults,
    cells: &Cells<'_>,
    dir: &Path,
    opt: &str,
) -> Result<Figure, ExperimentError> {
    let seq = Cells::accuracy(cells.get(Family::Pipeline, "sequential", 1, opt, "none")).mean;
    let series = r
        .config
        .policies
        .iter()
        .filter(|p| p.as_str() != "sequential")
        .map(|p| {
            let mut points = vec![(1.0, seq)];
            for &k in r.config.stages.iter().filter(|&&k| k > 1) {
                let runs = cells.get(Family::Pipeline, p, k, opt, "none");
                points.push((f64::from(k), Cells::accuracy(runs).mean));
            }
            Series {
                name: p.clone(),
                points,
            }
        })
        .collect();
    let name = format!("quality-vs-stages-{opt}");
    let chart = LineChart::marked(
        format!("Final test accuracy against stages, {opt} (1 stage: sequential)"),
        "stages",
        "test accuracy %",
        series,
    );
    figure(
        dir,
        name,
        format!("Final quality against stage count per policy, {opt}"),
        &chart,
    )
}

fn remedy_plots(
    r: &StalenessResults,
    cells: &Cells<'_>,
    dir: &Path,
    opt: &str,
) -> Result<Vec<Figure>, ExperimentError> {
    let s = r.config.remedies.stages;
    let w = r.config.target_window;
    let mut out = Vec::new();
    for policy in &r.config.remedies.policies {
        let mut remedies: Vec<String> = vec!["none".into()];
        for run in r.runs.iter().filter(|x| {
            x.spec.family == Family::Pipeline && &x.spec.policy == policy && x.spec.stages == s
        }) {
            if !remedies.contains(&run.spec.remedy) {
                remedies.push(run.spec.remedy.clone());
            }
        }
        if remedies.len() < 2 {
            // No remedy ran on this policy: nothing to set against "none".
            continue;
        }
        let series: Vec<Series> = remedies
            .iter()
            .map(|m| Series {
                name: m.clone(),
                points: curve(cells.get(Family::Pipeline, policy, s, opt, m), w),
            })
            .collect();
        let finite = |s: &Series| s.points.iter().any(|(x, y)| x.is_finite() && y.is_finite());
        if !series.iter().any(finite) {
            // Every run diverged before a full window: the tables say so, and a chart would
            // have nothing to draw.
            continue;
        }
        let name = format!("remedies-{policy}-{s}-stages-{opt}");
        let title = format!("{policy} at {s} stages, {opt}: remedies against none");
        let caption = format!("Remedies against no remedy, {policy} at {s} stages, {opt}");
        out.push(figure(dir, name, caption, &LineChart::loss(title, series))?);
    }
    Ok(out)
}

fn delayed_plot(
    r: &StalenessResults,
    cells: &Cells<'_>,
    dir: &Path,
    opt: &str,
) -> Result<Figure, ExperimentError> {
    let w = r.config.target_window;
    let mut seen: Vec<(String, String)> = Vec::new();
    for run in r.runs.iter().filter(|x| x.spec.family == Family::Delayed) {
        let k = (run.spec.policy.clone(), run.spec.remedy.clone());
        if !seen.contains(&k) {
            seen.push(k);
        }
    }
    let series = seen
        .iter()
        .map(|(p, m)| Series {
            name: format!("{p} {m}"),
            points: curve(cells.get(Family::Delayed, p, 1, opt, m), w),
        })
        .collect();
    let name = format!("delayed-{opt}");
    let title = format!("Delayed data-parallel SGD, {opt}: delays and remedies");
    let caption =
        format!("Delayed data-parallel SGD: loss against update per delay and remedy, {opt}");
    figure(dir, name, caption, &LineChart::loss(title, series))
}

fn staleness_plot(r: &StalenessResults, dir: &Path) -> Result<Figure, ExperimentError> {
    let s = r.config.stages.iter().copied().max().unwrap_or(1);
    let mut series = Vec::new();
    for policy in &r.config.policies {
        let Some(run) = first_ledger(r, policy, s) else {
            continue;
        };
        let delays = &run.stage_delays;
        let mut push = |pass: &str, mean: fn(&StageDelay) -> f64| {
            series.push(Series {
                name: format!("{policy} {pass}"),
                points: delays
                    .iter()
                    .map(|d| (f64::from(d.stage), mean(d)))
                    .collect(),
            });
        };
        push("forward", |d| d.forward_mean);
        if delays.iter().any(|d| d.backward_mean != d.forward_mean) {
            push("backward", |d| d.backward_mean);
        }
    }
    let name = format!("staleness-per-stage-{s}");
    let chart = LineChart::marked(
        format!("Measured delay per stage at {s} stages (updates)"),
        "stage",
        "mean delay (updates)",
        series,
    );
    figure(
        dir,
        name,
        format!("Measured staleness per stage at {s} stages, from the ledgers"),
        &chart,
    )
}

/// A figure of the report: its file stem and caption, and whether it was drawn.
struct Figure {
    file: String,
    caption: String,
    /// False for a chart with no finite point (every run behind it diverged): the report
    /// says so in its place, as a diverged run is a result.
    drawn: bool,
}

/// Writes `chart` as `name` (SVG and CSV) when it has a point to draw, and returns the figure.
fn figure(
    dir: &Path,
    name: String,
    caption: String,
    chart: &LineChart,
) -> Result<Figure, ExperimentError> {
    let drawn = chart.has_finite_point();
    if drawn {
        chart.write(dir, &name)?;
    }
    Ok(Figure {
        file: name,
        caption,
        drawn,
    })
}

/// `YYYY-MM-DD HH:MM` of a Unix time (UTC).
pub(crate) fn utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_and_dates() {
        let s = Spread::of([1.0, 2.0, 3.0, f64::NAN]);
        assert_eq!((s.mean, s.n), (2.0, 3));
        assert!((s.sd - 1.0).abs() < 1e-12);
        assert_eq!(Spread::of([5.0]).sd, 0.0);
        assert!(Spread::of([]).mean.is_nan());
        assert_eq!(utc(0), "1970-01-01 00:00");
        assert_eq!(utc(1_795_000_000), "2026-11-18 11:06");
    }
}
