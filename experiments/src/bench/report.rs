//! `REPORT.md` from `results.json`: the headline ratios, throughput, prediction and memory
//! against stages per policy (tables and SVG plots, each with its CSV), every configuration's
//! figures, the configurations the simulator misses by more than 15% with what the
//! measurements say about each, time to target, the criterion and numpy summaries, and the
//! Chrome traces kept. A hand-written `discussion.md` beside the results is included verbatim.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::config::{ConfigSpec, TransportName};
use super::measure::Measured;
use super::predict::Predicted;
use super::{BenchResults, ConfigResult, Outcome, file_name};
use crate::ExperimentError;
use crate::plot::{LineChart, Series};

/// A measured configuration with its prediction.
struct Row<'r> {
    spec: &'r ConfigSpec,
    m: &'r Measured,
    p: Option<&'r Predicted>,
    mfu: f64,
}

impl Row<'_> {
    /// Measured over simulated samples/s.
    fn ratio(&self) -> Option<f64> {
        self.p.map(|p| self.m.samples_per_s / p.samples_per_s)
    }
    /// The throughput in the model's unit (tokens/s for language models).
    fn rate(&self) -> f64 {
        self.m.samples_per_s * self.m.tokens_per_sample as f64
    }
}

fn rows(r: &BenchResults) -> Vec<Row<'_>> {
    r.configs
        .iter()
        .filter_map(|c| match &c.outcome {
            Outcome::Measured {
                measured,
                predicted,
                mfu,
                ..
            } => Some(Row {
                spec: &c.spec,
                m: measured,
                p: predicted.as_deref(),
                mfu: *mfu,
            }),
            _ => None,
        })
        .collect()
}

fn unit(m: &Measured) -> &'static str {
    if m.tokens_per_sample > 1 {
        "tokens/s"
    } else {
        "samples/s"
    }
}

fn mib(bytes: f64) -> String {
    format!("{:.1}", bytes / (1024.0 * 1024.0))
}

/// Writes `REPORT.md`, `plots/` into `dir`; returns the report's path.
///
/// # Errors
/// An unwritable directory.
pub fn write_report(r: &BenchResults, dir: &Path) -> Result<PathBuf, ExperimentError> {
    let rows = rows(r);
    let discussion = crate::read_discussion(dir)?;
    // Drawn into a staging directory that replaces `plots/` whole once every chart is drawn
    // (`StagedDir::regenerating`).
    pipe_stages::outputs::check_owned_file(dir, "REPORT.md")?;
    let plots = pipe_stages::outputs::StagedDir::regenerating(
        &dir.join("plots"),
        crate::plot::is_plot_file,
    )?;
    let mut md = String::new();
    header(&mut md, r);
    summary(&mut md, r, &rows);
    costs(&mut md, r);
    let figures = write_plots(&rows, plots.path())?;
    throughput_tables(&mut md, &rows);
    for (title, file) in &figures {
        let _ = writeln!(
            md,
            "![{title}](plots/{file}.svg) ([CSV](plots/{file}.csv))\n"
        );
    }
    config_table(&mut md, &rows);
    misses(&mut md, &rows, r);
    target_table(&mut md, r);
    criterion_table(&mut md, r);
    others(&mut md, r);
    traces(&mut md, r, dir);
    if let Some(text) = discussion {
        md.push_str("## Discussion\n\n");
        md.push_str(text.trim());
        md.push('\n');
    }
    plots.commit()?;
    Ok(pipe_stages::outputs::write_owned_file(
        dir,
        "REPORT.md",
        md.as_bytes(),
    )?)
}

fn header(md: &mut String, r: &BenchResults) {
    let m = &r.machine;
    let _ = writeln!(md, "# pipe bench: throughput, prediction and memory\n");
    let _ = writeln!(
        md,
        "Produced by `{}` on {} ({} cores, {:.1} GiB, {}), started {} UTC, {:.1} min wall{}. \
         {} configurations: {} measured, {} skipped (cannot run), {} failed, {} not run \
         (budget). Each configuration ran {}.\n",
        r.command,
        m.cpu,
        m.cores,
        m.memory_gib,
        m.os,
        crate::staleness::report::utc(r.started_unix),
        r.wall_s / 60.0,
        if r.quick {
            ", **quick mode** (a smoke run: figures are not meant to be read)"
        } else {
            ""
        },
        r.configs.len(),
        count(r, |o| matches!(o, Outcome::Measured { .. })),
        count(r, |o| matches!(o, Outcome::Skipped { .. })),
        count(r, |o| matches!(o, Outcome::Failed { .. })),
        count(r, |o| matches!(o, Outcome::NotRun)),
        if r.isolated {
            "in a child process of its own"
        } else {
            "in the sweep's process"
        },
    );
    let c = &r.config;
    let _ = writeln!(
        md,
        "Method (`docs/bench.md`): every worker is a thread of one process (one compute thread \
         each), over in-process channels or QUIC on loopback; {} untimed run(s), then {} timed \
         runs of {} minibatch(es) each; throughput is the mean run time without the fastest and \
         the slowest (MLPerf's rule), CV over all timed runs. MFU is model FLOP/s over the \
         reference GEMM's rate on all {} cores ({:.1} GFLOP/s in this run). The simulator gets \
         per-layer costs profiled in this run (calibrated on the executor, {} copies at once), \
         message costs from a ping-pong per transport, a timed all-reduce per replicated stage, \
         and the machine's cores shared by all workers.\n",
        c.warmup, c.repeats, c.minibatches, m.cores, r.peak_gflops, c.profile.concurrent
    );
}

fn count(r: &BenchResults, f: impl Fn(&Outcome) -> bool) -> usize {
    r.configs.iter().filter(|c| f(&c.outcome)).count()
}

/// The summary table: the headline ratios, measured in this run.
fn summary(md: &mut String, r: &BenchResults, rows: &[Row<'_>]) {
    md.push_str("## Summary\n\n| figure | value | how |\n|---|---|---|\n");
    match &r.numpy {
        Some(n) => {
            let ratios: Vec<f64> = n.rows.iter().map(|x| x.ratio).collect();
            let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
            let _ = writeln!(
                md,
                "| kernels: pipe GEMM / numpy matmul | median {:.2}, lowest {:.2} over {} shapes | criterion bench `gemm` beside numpy ({}) |",
                crate::median(&ratios),
                low,
                n.rows.len(),
                n.numpy
            );
        }
        None => md.push_str(
            "| kernels: pipe GEMM / numpy matmul | not measured in this run | `experiments/bench/run.sh` measures it |\n",
        ),
    }
    for s in &r.single {
        let _ = writeln!(
            md,
            "| single worker MFU, {} | {:.2} ({:.0} samples/s) | training step, batch {}, all cores |",
            s.model, s.mfu, s.samples_per_s, s.batch
        );
    }
    for s in &r.single {
        let best = rows
            .iter()
            .filter(|x| x.spec.model == s.model && x.spec.transport == TransportName::InProc)
            .max_by(|a, b| a.m.samples_per_s.total_cmp(&b.m.samples_per_s));
        if let Some(b) = best {
            let _ = writeln!(
                md,
                "| pipelined / single worker, {} | {:.2} | best configuration `{}` |",
                s.model,
                b.m.samples_per_s / s.samples_per_s,
                b.spec.id
            );
        }
        let reference = format!("{}/s4r1m8/pipedream/inproc", s.model);
        if let Some(x) = rows.iter().find(|x| x.spec.id == reference) {
            let _ = writeln!(
                md,
                "| pipelined / single worker, {} | {:.2} | `{reference}` |",
                s.model,
                x.m.samples_per_s / s.samples_per_s
            );
        }
    }
    let pairs = quic_pairs(rows);
    if !pairs.is_empty() {
        let ratios: Vec<f64> = pairs.iter().map(|(_, q)| *q).collect();
        let _ = writeln!(
            md,
            "| QUIC / in-process throughput | median {:.2} (range {:.2}-{:.2}) over {} pairs | same configuration on both transports |",
            crate::median(&ratios),
            ratios.iter().copied().fold(f64::INFINITY, f64::min),
            ratios.iter().copied().fold(0.0, f64::max),
            pairs.len()
        );
    }
    let ratios: Vec<f64> = rows.iter().filter_map(Row::ratio).collect();
    let within = |t: f64| ratios.iter().filter(|x| (*x - 1.0).abs() <= t).count();
    let _ = writeln!(
        md,
        "| measured / simulated | median {:.2}; {} of {} within 10%, {} within 15% | every measured configuration |",
        crate::median(&ratios),
        within(0.10),
        ratios.len(),
        within(0.15)
    );
    for t in &r.target {
        let _ = writeln!(
            md,
            "| time to target loss, {} ({} stages) | {} | `{}`, loss {} (mean of {} updates) |",
            t.policy,
            t.stages,
            t.seconds.map_or("not reached".into(), |s| format!(
                "{s:.1} s ({} updates)",
                t.updates.unwrap_or(0)
            )),
            r.config.target.model,
            r.config.target.target_loss,
            r.config.target.window
        );
    }
    md.push('\n');
}

/// (in-process id, QUIC over in-process) for configurations measured on both transports.
fn quic_pairs<'r>(rows: &'r [Row<'r>]) -> Vec<(&'r str, f64)> {
    rows.iter()
        .filter(|q| q.spec.transport == TransportName::Quic)
        .filter_map(|q| {
            let twin = rows.iter().find(|i| {
                i.spec.transport == TransportName::InProc
                    && ConfigSpec {
                        id: String::new(),
                        sweep: String::new(),
                        transport: TransportName::Quic,
                        ..i.spec.clone()
                    } == ConfigSpec {
                        id: String::new(),
                        sweep: String::new(),
                        ..q.spec.clone()
                    }
            })?;
            Some((
                twin.spec.id.as_str(),
                q.m.samples_per_s / twin.m.samples_per_s,
            ))
        })
        .collect()
}

fn costs(md: &mut String, r: &BenchResults) {
    md.push_str("## Measured costs the simulator uses\n\n| transport | latency per message | CPU per message end | bandwidth |\n|---|---|---|---|\n");
    for (t, l) in &r.links {
        let bw = match l.bandwidth {
            Some(b) => format!("{:.2} GB/s", b / 1e9),
            None => "no cost beyond latency (owned buffers move)".into(),
        };
        let _ = writeln!(
            md,
            "| {} | {:.1} us | {:.1} us | {bw} |",
            t.name(),
            l.latency_s * 1e6,
            l.cpu_s * 1e6
        );
    }
    md.push('\n');
}

/// Per model: samples/s by policy (rows) and stages x replicas (columns), in-process.
fn throughput_tables(md: &mut String, rows: &[Row<'_>]) {
    md.push_str("## Throughput against stages per policy (in-process)\n\n");
    let mut models: Vec<&str> = rows.iter().map(|r| r.spec.model.as_str()).collect();
    models.dedup();
    models.sort_unstable();
    models.dedup();
    for model in models {
        let mine: Vec<&Row<'_>> = rows
            .iter()
            .filter(|r| r.spec.model == model && r.spec.transport == TransportName::InProc)
            .collect();
        let mut cols: Vec<(u32, u32)> = mine
            .iter()
            .map(|r| (r.spec.stages, r.spec.replicas))
            .collect();
        cols.sort_unstable();
        cols.dedup();
        let mut policies: Vec<&str> = Vec::new();
        for r in &mine {
            if !policies.contains(&r.spec.policy.name()) {
                policies.push(r.spec.policy.name());
            }
        }
        let u = mine.first().map_or("samples/s", |r| unit(r.m));
        let _ = write!(
            md,
            "**{model}** ({u}, measured / simulated in brackets; highest M per cell)\n\n| policy |"
        );
        for (s, rep) in &cols {
            let _ = write!(md, " {s} x {rep} |");
        }
        md.push_str("\n|---|");
        md.push_str(&"---|".repeat(cols.len()));
        md.push('\n');
        for p in policies {
            let _ = write!(md, "| {p} |");
            for &(s, rep) in &cols {
                let cell = mine
                    .iter()
                    .filter(|r| {
                        r.spec.policy.name() == p && r.spec.stages == s && r.spec.replicas == rep
                    })
                    .max_by_key(|r| r.spec.m);
                match cell {
                    Some(r) => {
                        let _ = write!(
                            md,
                            " {:.0} ({}) |",
                            r.rate(),
                            r.ratio().map_or("-".into(), |x| format!("{x:.2}"))
                        );
                    }
                    None => md.push_str(" |"),
                }
            }
            md.push('\n');
        }
        md.push('\n');
    }
}

/// Every measured configuration, every figure.
fn config_table(md: &mut String, rows: &[Row<'_>]) {
    md.push_str("## Every measured configuration\n\n");
    md.push_str(
        "Busy: share of the last run's wall time each worker spent computing (lowest-highest \
         over workers), from the executor's spans; bubble: 1 - mean busy, measured / simulated \
         / the schedule's ideal (equal costs, a core per worker). With more workers than cores \
         the measured busy share counts time a thread waited for a core inside an action. \
         Memory: peak resident set of the configuration's process, and per worker the weights \
         (one version of each stage) and the most stashed-weight bytes held, both at their \
         highest over workers. Wire: payload bytes sent per sample.\n\n",
    );
    md.push_str("| configuration | rate | CV | MFU | measured / simulated | busy | bubble m / s / ideal | peak RSS MiB | weights MiB | stash MiB | wire KiB/sample |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let busy: Vec<f64> = r.m.per_worker.iter().map(|w| w.busy).collect();
        let lo = busy.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = busy.iter().copied().fold(0.0, f64::max);
        let max = |f: fn(&super::measure::WorkerFigures) -> u64| {
            r.m.per_worker.iter().map(f).max().unwrap_or(0) as f64
        };
        let _ = writeln!(
            md,
            "| `{}` | {:.0} {} | {:.3} | {:.3} | {} | {:.2}-{:.2} | {:.2} / {} / {} | {} | {} | {} | {:.1} |",
            r.spec.id,
            r.rate(),
            unit(r.m),
            r.m.cv,
            r.mfu,
            r.ratio().map_or("-".into(), |x| format!("**{x:.2}**")),
            lo,
            hi,
            r.m.bubble,
            r.p.map_or("-".into(), |p| format!("{:.2}", p.bubble)),
            r.p.map_or("-".into(), |p| format!("{:.2}", p.ideal_bubble)),
            r.m.peak_rss_bytes.map_or("-".into(), |b| mib(b as f64)),
            mib(max(|w| w.param_bytes)),
            mib(max(|w| w.peak_stash_bytes)),
            r.m.bytes_sent_per_sample / 1024.0
        );
    }
    md.push('\n');
}

/// What the measurements say about one configuration the simulator misses by more than 15%.
fn diagnose(r: &Row<'_>, cores: usize) -> String {
    let mut why = Vec::new();
    let Some(p) = r.p else {
        return "no prediction".into();
    };
    let ratio = r.m.samples_per_s / p.samples_per_s;
    if r.m.workers as usize > cores {
        why.push(format!("{} workers share {cores} cores", r.m.workers));
    }
    let busy_m: f64 = r.m.per_worker.iter().map(|w| w.busy).sum::<f64>();
    let busy_p: f64 = p.busy.iter().sum::<f64>();
    if busy_p > 0.0 {
        why.push(format!(
            "summed busy share measured {busy_m:.2} against simulated {busy_p:.2}"
        ));
    }
    if r.m.cv > 0.1 {
        why.push(format!("runs vary (CV {:.2})", r.m.cv));
    }
    if r.spec.replicas > 1 {
        why.push("replicated stages (all-reduce timed alone, not under load)".into());
    }
    if r.spec.transport == TransportName::Quic {
        why.push("QUIC: message costs from a two-endpoint ping-pong, not under load".into());
    }
    let dir = if ratio < 1.0 { "slower" } else { "faster" };
    format!("{dir} than predicted; {}", why.join("; "))
}

fn misses(md: &mut String, rows: &[Row<'_>], r: &BenchResults) {
    let out: Vec<&Row<'_>> = rows
        .iter()
        .filter(|x| x.ratio().is_some_and(|q| (q - 1.0).abs() > 0.15))
        .collect();
    let _ = writeln!(
        md,
        "## Configurations the simulator misses by more than 15% ({} of {})\n",
        out.len(),
        rows.len()
    );
    if out.is_empty() {
        md.push_str("None.\n\n");
        return;
    }
    md.push_str("What the measurements of each say (the causes are discussed below):\n\n| configuration | measured / simulated | measured |\n|---|---|---|\n");
    for x in out {
        let _ = writeln!(
            md,
            "| `{}` | {:.2} | {} |",
            x.spec.id,
            x.ratio().unwrap_or(f64::NAN),
            diagnose(x, r.machine.cores)
        );
    }
    md.push('\n');
}

fn target_table(md: &mut String, r: &BenchResults) {
    if r.target.is_empty() {
        return;
    }
    let t = &r.config.target;
    let _ = writeln!(
        md,
        "## Time to target loss\n\n`{}` on {} ({} training samples), microbatch {} x {}, SGD lr {} momentum 0.9, FLOP-balanced stages, in-process; target: training loss {} averaged over {} updates.\n\n| policy | stages | seconds to target | updates to target | final test accuracy | wall s |\n|---|---|---|---|---|---|",
        t.model,
        t.dataset,
        t.train_samples,
        t.microbatch,
        t.microbatches,
        t.lr,
        t.target_loss,
        t.window
    );
    for x in &r.target {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {:.1} |{}",
            x.policy,
            x.stages,
            x.seconds
                .map_or("not reached".into(), |s| format!("{s:.1}")),
            x.updates.map_or("-".into(), |u| u.to_string()),
            x.test_accuracy
                .map_or("-".into(), |a| format!("{:.2}%", a * 100.0)),
            x.wall_s,
            x.error
                .as_ref()
                .map_or(String::new(), |e| format!(" stopped: {e}"))
        );
    }
    md.push('\n');
}

fn criterion_table(md: &mut String, r: &BenchResults) {
    md.push_str("## Criterion benches\n\n");
    if r.criterion.is_empty() {
        md.push_str("Not given to this run (`experiments/bench/run.sh` runs `cargo bench` first and passes `--criterion target/criterion`).\n\n");
    } else {
        md.push_str("| bench | median | interval | throughput |\n|---|---|---|---|\n");
        for c in &r.criterion {
            let tp = match (c.throughput, &c.throughput_unit) {
                (Some(t), Some(u)) if u == "bytes" => format!("{:.2} GB/s", t / 1e9),
                (Some(t), Some(_)) => format!("{:.2} G/s", t / 1e9),
                _ => String::new(),
            };
            let _ = writeln!(
                md,
                "| `{}` | {} | {}-{} | {tp} |",
                c.id,
                seconds(c.median_s),
                seconds(c.interval_s[0]),
                seconds(c.interval_s[1])
            );
        }
        md.push('\n');
    }
    if let Some(n) = &r.numpy {
        let _ = writeln!(
            md,
            "numpy: {}\n\n| shape | threads | pipe GFLOP/s | numpy GFLOP/s | pipe / numpy |\n|---|---|---|---|---|",
            n.numpy
        );
        for x in &n.rows {
            let _ = writeln!(
                md,
                "| {} | {} | {:.1} | {:.1} | {:.2} |",
                x.shape, x.threads, x.pipe_gflops, x.numpy_gflops, x.ratio
            );
        }
        md.push('\n');
    }
}

fn seconds(s: f64) -> String {
    if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else if s >= 1e-6 {
        format!("{:.3} us", s * 1e6)
    } else {
        format!("{:.1} ns", s * 1e9)
    }
}

/// Skipped, failed and not-run configurations.
fn others(md: &mut String, r: &BenchResults) {
    let list: Vec<&ConfigResult> = r
        .configs
        .iter()
        .filter(|c| !matches!(c.outcome, Outcome::Measured { .. }))
        .collect();
    if list.is_empty() {
        return;
    }
    md.push_str("## Configurations not measured\n\n| configuration | why |\n|---|---|\n");
    for c in list {
        let why = match &c.outcome {
            Outcome::Skipped { reason } => format!("cannot run: {reason}"),
            Outcome::Failed { error } => format!("**failed**: {error}"),
            Outcome::NotRun => "not run: the time budget ran out".into(),
            Outcome::Measured { .. } => String::new(),
        };
        let _ = writeln!(md, "| `{}` | {} |", c.spec.id, why.replace('|', "/"));
    }
    md.push('\n');
}

fn traces(md: &mut String, r: &BenchResults, dir: &Path) {
    let kept: Vec<&String> = r
        .config
        .traces
        .iter()
        .filter(|id| {
            dir.join("traces")
                .join(format!("{}.measured.json", file_name(id)))
                .is_file()
        })
        .collect();
    if kept.is_empty() {
        return;
    }
    md.push_str("## Chrome traces\n\nMeasured (the last timed run) and simulated timelines of the same schedule; open in Perfetto or `chrome://tracing`.\n\n");
    for id in kept {
        let f = file_name(id);
        let _ = writeln!(
            md,
            "- `{id}`: [measured](traces/{f}.measured.json), [simulated](traces/{f}.simulated.json)"
        );
    }
    md.push('\n');
}

/// The plots: throughput, measured against simulated, and stash against stages, per model.
fn write_plots(rows: &[Row<'_>], dir: &Path) -> Result<Vec<(String, String)>, ExperimentError> {
    let mut figures = Vec::new();
    let mut models: Vec<&str> = rows.iter().map(|x| x.spec.model.as_str()).collect();
    models.sort_unstable();
    models.dedup();
    for model in models {
        for replicas in [1u32, 2] {
            let pick = |x: &&Row<'_>| {
                x.spec.model == model
                    && x.spec.replicas == replicas
                    && x.spec.transport == TransportName::InProc
            };
            let mine: Vec<&Row<'_>> = rows.iter().filter(pick).collect();
            if mine.is_empty() {
                continue;
            }
            let u = unit(mine[0].m);
            let name = format!("throughput-{}-r{replicas}", file_name(model));
            let title = format!("{model}, {replicas} replica(s): {u} against stages");
            by_policy(&mine, |x| x.rate(), &title, "stages", u).write(dir, &name)?;
            figures.push((title, name));
            let name = format!("memory-{}-r{replicas}", file_name(model));
            let title = format!("{model}, {replicas} replica(s): stashed weights against stages");
            let stash = |x: &Row<'_>| {
                x.m.per_worker
                    .iter()
                    .map(|w| w.peak_stash_bytes)
                    .max()
                    .unwrap_or(0) as f64
                    / (1024.0 * 1024.0)
            };
            by_policy(
                &mine,
                stash,
                &title,
                "stages",
                "most stashed MiB on a worker",
            )
            .write(dir, &name)?;
            figures.push((title, name));
        }
    }
    let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for x in rows {
        if let Some(p) = x.p {
            series
                .entry(x.spec.model.clone())
                .or_default()
                .push((p.samples_per_s, x.m.samples_per_s));
        }
    }
    if !series.is_empty() {
        let hi = series
            .values()
            .flatten()
            .map(|&(a, b)| a.max(b))
            .fold(0.0, f64::max);
        let mut list: Vec<Series> = series
            .into_iter()
            .map(|(name, points)| Series { name, points })
            .collect();
        // The diagonal, as a dotted line of markers.
        list.push(Series {
            name: "measured = simulated".into(),
            points: (0..=40)
                .map(|i| (hi * f64::from(i) / 40.0, hi * f64::from(i) / 40.0))
                .collect(),
        });
        let chart = LineChart {
            title: "Measured against simulated samples/s, every configuration".into(),
            x_label: "simulated samples/s".into(),
            y_label: "measured samples/s".into(),
            log_y: false,
            markers: false,
            scatter: true,
            series: list,
        };
        chart.write(dir, "predicted-vs-measured")?;
        figures.push((chart.title.clone(), "predicted-vs-measured".into()));
    }
    Ok(figures)
}

/// One line per policy: `y` against stages (highest M at each stage count).
fn by_policy(
    rows: &[&Row<'_>],
    y: impl Fn(&Row<'_>) -> f64,
    title: &str,
    x: &str,
    y_label: &str,
) -> LineChart {
    let mut by: BTreeMap<&str, BTreeMap<u32, (u32, f64)>> = BTreeMap::new();
    for r in rows {
        let e = by.entry(r.spec.policy.name()).or_default();
        let v = (r.spec.m, y(r));
        e.entry(r.spec.stages)
            .and_modify(|old| {
                if v.0 > old.0 {
                    *old = v;
                }
            })
            .or_insert(v);
    }
    let series = by
        .into_iter()
        .map(|(name, pts)| Series {
            name: name.into(),
            points: pts
                .into_iter()
                .map(|(s, (_, v))| (f64::from(s), v))
                .collect(),
        })
        .collect();
    LineChart::marked(title.into(), x, y_label, series)
}
