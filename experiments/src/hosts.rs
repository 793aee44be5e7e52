//! PipeDream's central claim on real links: the best partition depends on the link, and the
//! planner finds it. Workers run as `pipe worker` processes spread over hosts (in
//! `experiments/hosts/run.sh`, two network namespaces joined by a rate-limited veth pair), and
//! three layouts of the same model are measured against the simulator's prediction of each:
//!
//! 1. **the plan**: `pipe plan`'s pick for `workers` workers at the link's bandwidth
//!    (`plan_checked`: the partitioner's plan, checked by the simulator against the
//!    alternatives below);
//! 2. **a pipeline**: `workers` stages, one worker each, split by time (the best straight plan);
//! 3. **data parallelism**: one stage, `workers` replicas.
//!
//! Workers fill the hosts in pipeline order, as the plan places them
//! ([`pipe_scheduler::planner::placement`]): with 4 workers on 2 hosts, ranks 0 and 1 on the
//! first, 2 and 3 on the second, each pair talking over shared memory (`--transport auto`) and
//! the pairs over QUIC on the shaped link.
//!
//! The profile is calibrated on the executor, as `pipe plan --model` does, with as many copies
//! at once as the workers have cores. The planner and the simulator share the cores
//! (`--cores`) among the workers and charge each link its own transport: inside a host,
//! shared memory's measured costs (pipe's cached transport costs, [`crate::costs`]); between
//! hosts, the link's bandwidth and QUIC's processor time per message and per byte at each end,
//! measured before planning by a ping-pong between two QUIC endpoints on loopback with
//! datagrams of the link's MTU ([`crate::link`]; the report shows the figures).
//! Measured throughput is the chief's samples/s over `updates` minibatches (fill and drain
//! included, connection setup not).

use std::ops::Range;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use pipe_kernels::CpuBackend;
use pipe_scheduler::planner::placement::Hosts;
use pipe_scheduler::{
    PartitionPlan, PlanOptions, Profile, explain, plan_checked, plan_partition, simulate_plan,
};
use pipe_stages::model::{Model, ModelSpec};
use pipe_stages::profile::profile_model;
use serde::Serialize;

use crate::ExperimentError;

/// What to run.
#[derive(Clone, Debug)]
pub struct HostsBenchConfig {
    /// Model preset.
    pub model: String,
    /// Samples per microbatch.
    pub microbatch: usize,
    /// Microbatches per update per replica.
    pub microbatches: u32,
    /// Workers (processes).
    pub workers: u32,
    /// The link's bandwidth, bytes per second, as the planner and the simulator are told.
    pub bandwidth: f64,
    /// Host addresses; the workers fill them in rank order, `ceil(workers / hosts)` each.
    pub hosts: Vec<String>,
    /// The network namespace of each host (`ip netns exec`); empty: run on this host directly.
    pub netns: Vec<String>,
    /// Timed minibatches per measurement.
    pub updates: u64,
    /// Cores the workers share, for the simulator (`None`: one each).
    pub cores: Option<u32>,
    /// The link's MTU, bytes: QUIC's processor time is measured on loopback with datagrams
    /// of that size, as the link carries them.
    pub mtu: u16,
    /// The `pipe` binary the workers run.
    pub pipe: PathBuf,
    /// Where cluster files go.
    pub dir: PathBuf,
}

/// One layout, predicted and measured.
#[derive(Clone, Debug, Serialize)]
pub struct LayoutRun {
    /// `plan`, `pipeline` or `data parallel`.
    pub name: String,
    /// Layers of each stage, as `--partition` takes them.
    pub partition: String,
    /// Replicas per stage.
    pub replicas: Vec<u32>,
    /// The simulator's samples/s.
    pub simulated: f64,
    /// The run's samples/s.
    pub measured: f64,
    /// Whether this is the planner's pick.
    pub picked: bool,
}

/// The report of one model at one bandwidth.
#[derive(Clone, Debug, Serialize)]
pub struct HostsReport {
    /// Model preset.
    pub model: String,
    /// Samples per microbatch.
    pub microbatch: usize,
    /// Microbatches per update per replica.
    pub microbatches: u32,
    /// Workers.
    pub workers: u32,
    /// Bandwidth the planner was told, bytes/s.
    pub bandwidth: f64,
    /// QUIC's processor time, measured on loopback before planning and charged by the
    /// simulator on links between hosts.
    pub quic: pipe_transport::measure::LinkCost,
    /// Shared memory's costs, charged on links inside a host.
    pub shm: pipe_scheduler::sim::Link,
    /// The host of each rank.
    pub placement: Vec<String>,
    /// The layouts, each measured once: the plan (where it is neither of the others), the
    /// pipeline, data parallelism.
    pub layouts: Vec<LayoutRun>,
}

impl HostsReport {
    /// The planner's pick.
    pub fn picked(&self) -> Option<&LayoutRun> {
        self.layouts.iter().find(|l| l.picked)
    }

    /// The name of the fastest layout as measured.
    pub fn fastest(&self) -> &str {
        self.layouts
            .iter()
            .max_by(|a, b| a.measured.total_cmp(&b.measured))
            .map_or("", |l| l.name.as_str())
    }
}

/// `--partition` text of layer ranges: `0-2,3-9`.
fn partition_text(ranges: &[Range<usize>]) -> String {
    ranges
        .iter()
        .map(|r| format!("{}-{}", r.start, r.end.saturating_sub(1)))
        .collect::<Vec<_>>()
        .join(",")
}

/// Runs the benchmark (see the module docs).
///
/// # Errors
/// An unusable model or configuration; a plan the simulator cannot run; a worker that fails
/// or reports no throughput.
pub fn run(cfg: &HostsBenchConfig) -> Result<HostsReport, ExperimentError> {
    if cfg.workers < 2 || cfg.updates == 0 || cfg.hosts.is_empty() {
        return Err(ExperimentError::Config(
            "need at least 2 workers, 1 update and 1 host".into(),
        ));
    }
    if !cfg.netns.is_empty() && cfg.netns.len() != cfg.hosts.len() {
        return Err(ExperimentError::Config(format!(
            "{} namespaces for {} hosts: give one per host or none",
            cfg.netns.len(),
            cfg.hosts.len()
        )));
    }
    let model = Model::new(&ModelSpec::preset(&cfg.model)?)?;
    let be = CpuBackend::new(1)?;
    let profile_opts =
        crate::partition::plan_profile_options(cfg.microbatch, cfg.microbatches, cfg.workers);
    let profile = profile_model(&model, &cfg.model, &be, &profile_opts)?;
    // The link's MTU less 20 bytes of IPv4 and 8 of UDP header.
    let quic = crate::bench::quic_link_cost(cfg.mtu.saturating_sub(28))?;
    let (costs, _) = pipe_stages::planning::link_costs::load_or_measure(false)?;
    let shm = costs
        .get("shm")
        .map(pipe_scheduler::planner::transport::TransportCost::link)
        .ok_or_else(|| ExperimentError::Config("no shared-memory costs were measured".into()))?;
    let per_host = per_host(cfg);
    let hosts: Vec<(String, u32)> = cfg.hosts.iter().map(|h| (h.clone(), per_host)).collect();
    let between = pipe_scheduler::sim::Link {
        bandwidth: cfg.bandwidth,
        latency: quic.latency_s,
        message_cpu: quic.cpu_s,
        byte_cpu: quic.byte_cpu_s,
    };
    let placement = Hosts::filled(&hosts, between);
    let opts = PlanOptions {
        microbatches: cfg.microbatches,
        cores: cfg.cores,
        latency: shm.latency,
        message_cpu: shm.message_cpu,
        byte_cpu: shm.byte_cpu,
        hosts: Some(placement.clone()),
        // The workers sum their gradients in buckets of the default size.
        bucket_size: pipe_stages::pipeline::DEFAULT_BUCKET_SIZE,
        ..PlanOptions::new(cfg.workers, shm.bandwidth)
    };
    let picked = plan_checked(&profile, &opts)?;
    let straight = plan_partition(
        &profile,
        &PlanOptions {
            straight: true,
            ..opts.clone()
        },
    )?;
    let data_parallel = explain(&profile, &opts, &[(0..model.len(), cfg.workers)])?;
    let layout = |p: &PartitionPlan| -> Vec<(Range<usize>, u32)> {
        p.stages
            .iter()
            .map(|s| (s.layers.clone(), s.replicas))
            .collect()
    };
    let mut candidates = vec![("pipeline", &straight), ("data parallel", &data_parallel)];
    if candidates.iter().all(|(_, p)| layout(p) != layout(&picked)) {
        candidates.insert(0, ("plan", &picked));
    }
    // A language model's chief reports tokens/s: one token per input position.
    let tokens = (!model.is_empty() && model.layer(0).kind() == "embedding")
        .then(|| model.input_shape().iter().product::<usize>());
    let mut layouts = Vec::new();
    for (name, p) in candidates {
        let mut run = predict_and_measure(cfg, &profile, &opts, (name, tokens), p)?;
        run.picked = layout(p) == layout(&picked);
        layouts.push(run);
    }
    Ok(HostsReport {
        model: cfg.model.clone(),
        microbatch: cfg.microbatch,
        microbatches: cfg.microbatches,
        workers: cfg.workers,
        bandwidth: cfg.bandwidth,
        quic,
        shm,
        placement: placement
            .of_positions(cfg.workers as usize)
            .iter()
            .map(|&h| placement.name(h).to_string())
            .collect(),
        layouts,
    })
}

/// Workers per host: the workers spread over the hosts, the first hosts taking one more
/// where they do not divide evenly.
fn per_host(cfg: &HostsBenchConfig) -> u32 {
    let hosts = u32::try_from(cfg.hosts.len()).unwrap_or(u32::MAX).max(1);
    cfg.workers.div_ceil(hosts)
}

fn predict_and_measure(
    cfg: &HostsBenchConfig,
    profile: &Profile,
    opts: &PlanOptions,
    (name, tokens): (&str, Option<usize>),
    p: &PartitionPlan,
) -> Result<LayoutRun, ExperimentError> {
    let ranges: Vec<Range<usize>> = p.stages.iter().map(|s| s.layers.clone()).collect();
    let replicas: Vec<u32> = p.stages.iter().map(|s| s.replicas).collect();
    let simulated = cfg.microbatch as f64 / simulate_plan(profile, p, opts)?;
    let partition = partition_text(&ranges);
    let measured = measure(cfg, (&partition, &replicas), name, tokens)?;
    Ok(LayoutRun {
        name: name.into(),
        partition,
        replicas,
        simulated,
        measured,
        picked: false,
    })
}

/// Samples/s of the layout run as worker processes over the hosts: the chief's figure.
/// `tokens`: tokens per sample of a language model, whose chief reports tokens/s.
fn measure(
    cfg: &HostsBenchConfig,
    (partition, replicas): (&str, &[u32]),
    name: &str,
    tokens: Option<usize>,
) -> Result<f64, ExperimentError> {
    let workers = cfg.workers as usize;
    let fail = |m: String| ExperimentError::Config(format!("{name}: {m}"));
    let io = |what: &str, e: std::io::Error| fail(format!("{what}: {e}"));
    let cluster = cfg.dir.join(name.replace(' ', "-"));
    // Ranks fill the hosts in order, as the plan placed them.
    let host_of = |r: usize| (r / per_host(cfg) as usize).min(cfg.hosts.len() - 1);
    let addrs: Vec<String> = (0..workers)
        .map(|r| format!("{}:{}", cfg.hosts[host_of(r)], 29_500 + r))
        .collect();
    let init = Command::new(&cfg.pipe)
        .args(["cluster", "init", "--workers", &workers.to_string()])
        .args(["--addrs", &addrs.join(","), "-o"])
        .arg(&cluster)
        .output()
        .map_err(|e| io("pipe cluster init", e))?;
    if !init.status.success() {
        return Err(fail(String::from_utf8_lossy(&init.stderr).into_owned()));
    }
    let replicas = replicas
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let stages = partition.split(',').count().to_string();
    let mut children = Vec::with_capacity(workers);
    for r in 0..workers {
        let mut c = if cfg.netns.is_empty() {
            Command::new(&cfg.pipe)
        } else {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &cfg.netns[host_of(r)]])
                .arg(&cfg.pipe);
            c
        };
        c.arg("worker")
            .arg("--cluster")
            .arg(cluster.join("cluster.toml"))
            .args(["--rank", &r.to_string(), "--model", &cfg.model])
            .args(["--stages", &stages, "--replicas", &replicas])
            .args(["--partition", partition, "--schedule", "pipedream"])
            .args(["--microbatch-size", &cfg.microbatch.to_string()])
            .args(["--microbatches", &cfg.microbatches.to_string()])
            .args(["--steps", &cfg.updates.to_string(), "--threads", "1"])
            .args(["--transport", "auto"])
            .stdout(if r == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stderr(Stdio::piped());
        children.push(c.spawn().map_err(|e| io("starting a worker", e))?);
    }
    let mut chief_out = String::new();
    let mut errors = Vec::new();
    for (r, child) in children.into_iter().enumerate() {
        let out = child
            .wait_with_output()
            .map_err(|e| io("waiting for a worker", e))?;
        if r == 0 {
            chief_out = String::from_utf8_lossy(&out.stdout).into_owned();
        }
        if !out.status.success() {
            errors.push(format!(
                "worker {r}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    if !errors.is_empty() {
        return Err(fail(errors.join("; ")));
    }
    crate::chief_samples_per_s(&chief_out, tokens)
        .ok_or_else(|| fail(format!("no throughput in the chief's output:\n{chief_out}")))
}

/// The report as text.
pub fn render(r: &HostsReport) -> String {
    let mut s = format!(
        "{} at {:.0} MB/s, {} workers, microbatch {}, M = {} (pipedream)\n\n\
         ranks on hosts {}: shared memory inside a host ({:.1} us per message end, {:.3} ns per \
         byte), QUIC between ({:.1} us per message end, {:.2} ns per byte at each end, measured \
         on loopback at the link's MTU)\n\n\
         | layout | partition | replicas | simulated samples/s | measured samples/s | measured / simulated |\n\
         |---|---|---|---|---|---|\n",
        r.model,
        r.bandwidth / 1e6,
        r.workers,
        r.microbatch,
        r.microbatches,
        r.placement.join(", "),
        r.shm.message_cpu * 1e6,
        r.shm.byte_cpu * 1e9,
        r.quic.cpu_s * 1e6,
        r.quic.byte_cpu_s * 1e9
    );
    for l in &r.layouts {
        s.push_str(&format!(
            "| {} | {} | {:?} | {:.0} | {:.0} | {:.2} |\n",
            l.name,
            l.partition,
            l.replicas,
            l.simulated,
            l.measured,
            l.measured / l.simulated
        ));
    }
    s.push_str(&format!(
        "\nthe planner picked: {}; fastest measured: {}\n",
        r.picked().map_or("", |l| l.name.as_str()),
        r.fastest()
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_print_as_the_flag_takes_them() {
        assert_eq!(partition_text(&[0..3, 3..5, 5..10]), "0-2,3-4,5-9");
    }

    #[test]
    fn the_chiefs_last_epoch_figure_is_read() {
        let out = "pipeline: ...\nepoch   1  train loss 0.3  test acc 96.44%      4702 samples/s     13.2 s\n\
                   epoch   2  train loss 0.2  test acc 97.00%      4800 samples/s     13.0 s\ndone: 2";
        assert_eq!(crate::chief_samples_per_s(out, None), Some(4800.0));
        assert_eq!(crate::chief_samples_per_s("done", None), None);
        let lm = "epoch   1  train loss 3.2  val loss 2.9 nats/char  val acc  23.13%     13076 tokens/s     53.6 s";
        assert_eq!(crate::chief_samples_per_s(lm, Some(4)), Some(3269.0));
    }
}
