//! `REPORT.md` from saved results: tables (mean and spread over seeds), SVG plots with their
//! CSV, the published expectations checked against the data with the rule written next to
//! each verdict, and the discussion a person wrote after reading the data (`discussion.md` in
//! the results directory, included verbatim when present). Nothing here re-runs training.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::StalenessResults;
use super::config::Family;
use super::plot::{LineChart, Series};
use super::run::RunRecord;
use crate::ExperimentError;

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
    let plots = dir.join("plots");
    let mut md = String::new();
    header(&mut md, results);
    let figures = write_plots(results, &cells, &plots)?;
    main_table(&mut md, results, &cells);
    remedies_table(&mut md, results, &cells);
    delayed_table(&mut md, results, &cells);
    delays_table(&mut md, results);
    expectations(&mut md, results, &cells);
    md.push_str("\n## Figures\n\nEach SVG has the CSV of the points it draws beside it.\n\n");
    for (file, caption) in &figures {
        let _ = writeln!(
            md,
            "**{caption}** (`plots/{file}.csv`)\n\n![{caption}](plots/{file}.svg)\n"
        );
    }
    md.push_str("\n## Discussion\n\n");
    match std::fs::read_to_string(dir.join("discussion.md")) {
        Ok(text) => md.push_str(&text),
        Err(_) => md.push_str("_No `discussion.md` in the results directory._\n"),
    }
    let path = dir.join("REPORT.md");
    std::fs::write(&path, md)
        .map_err(|e| ExperimentError::Config(format!("{}: {e}", path.display())))?;
    Ok(path)
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

fn delayed_table(md: &mut String, r: &StalenessResults, cells: &Cells<'_>) {
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
         into, forward / backward. Every seed and optimizer has the same ledger; the first is \
         shown.\n"
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
        let Some(run) = r.runs.iter().find(|x| {
            x.spec.family == Family::Pipeline
                && &x.spec.policy == policy
                && x.spec.stages == s
                && x.spec.remedy == "none"
        }) else {
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

/// Accuracy difference (percentage points) that counts as "the same": two standard deviations
/// of the synchronous runs over seeds, and at least `FLOOR_PP`.
const FLOOR_PP: f64 = 0.3;

fn expectations(md: &mut String, r: &StalenessResults, cells: &Cells<'_>) {
    let s = r.config.stages.iter().copied().max().unwrap_or(1);
    md.push_str("## The published expectations against these data\n\n");
    let _ = writeln!(
        md,
        "At {s} stages, final test accuracy (mean over seeds). \"Same\" means within two standard \
         deviations of the sequential runs over seeds, and at least {FLOOR_PP} points; a diverged \
         run counts as a large difference.\n"
    );
    md.push_str("| expectation | optimizer | evidence | verdict |\n|---|---|---|---|\n");
    for opt in optimizer_names(r) {
        let acc = |policy: &str, stages: u32| {
            let runs = cells.get(Family::Pipeline, policy, stages, &opt, "none");
            let sp = Cells::accuracy(runs);
            let diverged = runs.iter().any(|x| x.diverged_at.is_some());
            (sp, diverged)
        };
        let (seq, _) = acc("sequential", 1);
        let tol = (2.0 * seq.sd).max(FLOOR_PP);
        let same = |a: (Spread, bool), b: Spread| !a.1 && (a.0.mean - b.mean).abs() <= tol;
        let mut row = |what: &str, evidence: String, agrees: bool| {
            let verdict = if agrees { "agrees" } else { "disagrees" };
            let _ = writeln!(md, "| {what} | {opt} | {evidence} | {verdict} |");
        };
        let pd = acc("pipedream", s);
        row(
            "weight stashing tracks synchronous training",
            format!(
                "pipedream {} vs sequential {:.2} (tolerance {tol:.2})",
                show(pd),
                seq.mean
            ),
            same(pd, seq),
        );
        let ns: Vec<(u32, (Spread, bool))> = r
            .config
            .stages
            .iter()
            .filter(|&&k| k > 1)
            .map(|&k| (k, acc("pipedream-nostash", k)))
            .collect();
        let falling = ns
            .windows(2)
            .all(|w| w[1].1.1 || w[1].1.0.mean < w[0].1.0.mean)
            && ns.last().is_some_and(|l| !same(l.1, seq));
        let ev: Vec<String> = ns
            .iter()
            .map(|(k, a)| format!("{k}: {}", show(*a)))
            .collect();
        row(
            "without stashing, quality degrades as stages grow",
            format!("pipedream-nostash by stages {}", ev.join(", ")),
            falling,
        );
        let vs = acc("vsync", s);
        row(
            "vertical sync behaves like stashing",
            format!("vsync {} vs pipedream {}", show(vs), show(pd)),
            !vs.1 && !pd.1 && (vs.0.mean - pd.0.mean).abs() <= tol,
        );
        let tb = acc("2bw", s);
        row(
            "2BW behaves like synchronous training",
            format!("2bw {} vs sequential {:.2}", show(tb), seq.mean),
            same(tb, seq),
        );
    }
    sensitivity(md, r, cells, s);
    md.push('\n');
}

/// AdamW against SGD: the accuracy each loses, relative to its own sequential run, averaged
/// over the asynchronous policies at `s` stages and over the delayed baseline's fixed delays.
fn sensitivity(md: &mut String, r: &StalenessResults, cells: &Cells<'_>, s: u32) {
    let names = optimizer_names(r);
    let (Some(sgd), Some(adam)) = (
        names.iter().find(|n| n.contains("sgd")),
        names.iter().find(|n| n.contains("adam")),
    ) else {
        return;
    };
    let loss_of = |opt: &str| -> (f64, usize) {
        let seq = Cells::accuracy(cells.get(Family::Pipeline, "sequential", 1, opt, "none")).mean;
        let mut drops = Vec::new();
        for p in ["pipedream", "pipedream-nostash", "vsync", "2bw"] {
            let runs = cells.get(Family::Pipeline, p, s, opt, "none");
            for x in runs {
                // A diverged run has lost everything above chance (10% on ten classes).
                let a = if x.diverged_at.is_some() {
                    10.0
                } else {
                    100.0 * x.final_accuracy()
                };
                drops.push(seq - a);
            }
        }
        (Spread::of(drops.iter().copied()).mean, drops.len())
    };
    let (ds, n1) = loss_of(sgd);
    let (da, n2) = loss_of(adam);
    let _ = writeln!(
        md,
        "| AdamW is more sensitive to delay than SGD | both | mean accuracy lost against its own \
         sequential run over the asynchronous policies at {s} stages ({n1} and {n2} runs; a \
         diverged run counts as 10%): {sgd} {ds:.2} points, {adam} {da:.2} points | {} |",
        if da > ds { "agrees" } else { "disagrees" }
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
) -> Result<Vec<(String, String)>, ExperimentError> {
    let mut figures = Vec::new();
    let s = r.config.stages.iter().copied().max().unwrap_or(1);
    let w = r.config.target_window;
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
        let chart = LineChart {
            title: format!(
                "Training loss at {s} stages, {opt} (mean over seeds, {w}-update average)"
            ),
            x_label: "update".into(),
            y_label: "training loss".into(),
            log_y: true,
            markers: false,
            series,
        };
        chart.write(dir, &name)?;
        figures.push((
            name,
            format!("Loss against update per policy at {s} stages, {opt}"),
        ));
        figures.push(quality_plot(r, cells, dir, &opt)?);
        figures.extend(remedy_plots(r, cells, dir, &opt)?);
        figures.push(delayed_plot(r, cells, dir, &opt)?);
    }
    figures.push(staleness_plot(r, dir)?);
    Ok(figures)
}

fn quality_plot(
    r: &StalenessResults,
    cells: &Cells<'_>,
    dir: &Path,
    opt: &str,
) -> Result<(String, String), ExperimentError> {
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
    LineChart {
        title: format!("Final test accuracy against stages, {opt} (1 stage: sequential)"),
        x_label: "stages".into(),
        y_label: "test accuracy %".into(),
        log_y: false,
        markers: true,
        series,
    }
    .write(dir, &name)?;
    Ok((
        name,
        format!("Final quality against stage count per policy, {opt}"),
    ))
}

fn remedy_plots(
    r: &StalenessResults,
    cells: &Cells<'_>,
    dir: &Path,
    opt: &str,
) -> Result<Vec<(String, String)>, ExperimentError> {
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
        let series = remedies
            .iter()
            .map(|m| Series {
                name: m.clone(),
                points: curve(cells.get(Family::Pipeline, policy, s, opt, m), w),
            })
            .collect();
        let name = format!("remedies-{policy}-{s}-stages-{opt}");
        LineChart {
            title: format!("{policy} at {s} stages, {opt}: remedies against none"),
            x_label: "update".into(),
            y_label: "training loss".into(),
            log_y: true,
            markers: false,
            series,
        }
        .write(dir, &name)?;
        out.push((
            name,
            format!("Remedies against no remedy, {policy} at {s} stages, {opt}"),
        ));
    }
    Ok(out)
}

fn delayed_plot(
    r: &StalenessResults,
    cells: &Cells<'_>,
    dir: &Path,
    opt: &str,
) -> Result<(String, String), ExperimentError> {
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
    LineChart {
        title: format!("Delayed data-parallel SGD, {opt}: delays and remedies"),
        x_label: "update".into(),
        y_label: "training loss".into(),
        log_y: true,
        markers: false,
        series,
    }
    .write(dir, &name)?;
    Ok((
        name,
        format!("Delayed data-parallel SGD: loss against update per delay and remedy, {opt}"),
    ))
}

fn staleness_plot(r: &StalenessResults, dir: &Path) -> Result<(String, String), ExperimentError> {
    let s = r.config.stages.iter().copied().max().unwrap_or(1);
    let mut series = Vec::new();
    for policy in &r.config.policies {
        let Some(run) = r.runs.iter().find(|x| {
            x.spec.family == Family::Pipeline
                && &x.spec.policy == policy
                && x.spec.stages == s
                && x.spec.remedy == "none"
        }) else {
            continue;
        };
        let fwd = run
            .stage_delays
            .iter()
            .map(|d| (f64::from(d.stage), d.forward_mean));
        series.push(Series {
            name: format!("{policy} forward"),
            points: fwd.collect(),
        });
        if run
            .stage_delays
            .iter()
            .any(|d| d.backward_mean != d.forward_mean)
        {
            let bwd = run
                .stage_delays
                .iter()
                .map(|d| (f64::from(d.stage), d.backward_mean));
            series.push(Series {
                name: format!("{policy} backward"),
                points: bwd.collect(),
            });
        }
    }
    let name = format!("staleness-per-stage-{s}");
    LineChart {
        title: format!("Measured delay per stage at {s} stages (updates)"),
        x_label: "stage".into(),
        y_label: "mean delay (updates)".into(),
        log_y: false,
        markers: true,
        series,
    }
    .write(dir, &name)?;
    Ok((
        name,
        format!("Measured staleness per stage at {s} stages, from the ledgers"),
    ))
}

/// `YYYY-MM-DD HH:MM` of a Unix time (UTC).
fn utc(secs: u64) -> String {
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
