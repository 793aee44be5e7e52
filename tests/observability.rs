//! What a running `pipe train` shows while it runs: the JSON-lines log grows update by
//! update during a pipelined epoch, not only at its end, and `--metrics-addr` serves live
//! metrics that a Prometheus scrape reads.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

mod common;

/// Starts `pipe train` of `mlp-784-256x4-10` on the synthetic set over two stages (a flops
/// partition, one thread a worker) with `more` arguments, its output discarded.
fn start_training(more: &[&str]) -> Child {
    let mut args = common::words(
        "train --dataset synthetic --model mlp-784-256x4-10 --stages 2 --threads 1 \
         --partition flops",
    );
    args.extend_from_slice(more);
    common::pipe_command(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn the_jsonl_log_grows_during_a_pipelined_epoch() {
    log_grows_during_an_epoch("inproc");
}

#[test]
fn the_jsonl_log_grows_during_an_epoch_of_worker_processes() {
    log_grows_during_an_epoch("quic");
}

fn log_grows_during_an_epoch(transport: &str) {
    let log = common::fresh_path("run.jsonl");
    let mut child = start_training(&[
        "--epochs",
        "1",
        "--replicas",
        "2",
        "--log-jsonl",
        common::s(&log),
        "--transport",
        transport,
    ]);
    // Line counts seen while the epoch runs (before its epoch record).
    let mut seen: Vec<usize> = Vec::new();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(120) {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("\"kind\":\"epoch\"") {
            break;
        }
        let lines = text.lines().count();
        // Only whole lines: every one parses.
        for l in text.lines() {
            serde_json::from_str::<serde_json::Value>(l).unwrap();
        }
        if lines > 0 && seen.last() != Some(&lines) {
            seen.push(lines);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(child.wait().unwrap().success());
    assert!(
        seen.len() >= 3,
        "{transport}: the log grew only {seen:?} before the epoch ended"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let steps = text
        .lines()
        .filter(|l| l.contains("\"kind\":\"step\""))
        .count();
    assert_eq!(steps, 64, "one record per update");
}

/// One scrape: the body of `GET /metrics`, or nothing if the endpoint is not up.
fn scrape(addr: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
}

/// The value of the first sample of `name` (with any labels) in a scrape.
fn value(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn prometheus_scrapes_live_metrics_during_a_pipelined_run() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let mut child = start_training(&["--epochs", "3", "--replicas", "2", "--metrics-addr", &addr]);
    let t = Instant::now();
    let mut samples = Vec::new();
    let mut last = None;
    while child.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(120) {
        if let Some(body) = scrape(&addr) {
            if let Some(n) = value(&body, "pipe_samples_total") {
                if samples.last() != Some(&n) {
                    samples.push(n);
                }
                last = Some(body);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    let body = last.expect("no scrape with pipe_samples_total");
    assert!(samples.len() >= 3, "samples seen: {samples:?}");
    for name in [
        "pipe_updates_total",
        "pipe_update_seconds",
        "pipe_worker_busy_seconds",
        "pipe_worker_idle_seconds",
        "pipe_bytes_sent_total",
        "pipe_bytes_received_total",
        "pipe_queue_depth",
        "pipe_staleness",
        "pipe_stash_versions",
        "pipe_stash_bytes",
    ] {
        assert!(
            body.contains(name),
            "{name} missing from the scrape:\n{body}"
        );
    }
    assert!(body.contains("worker=\"3\""), "{body}");
    assert!(
        value(&body, "pipe_bytes_sent_total").unwrap_or(0.0) > 0.0,
        "{body}"
    );
}

#[test]
fn launched_worker_processes_each_serve_their_metrics() {
    // Two consecutive free ports, below the range the system hands out for outgoing
    // connections and for port 0 (32768 and up by default): a port taken from that range is
    // free only until a concurrent test's scrape or listener draws it.
    let start = 20_000 + (std::process::id() % 6_000) * 2;
    let base = (0..500u32)
        .find_map(|i| {
            let p = u16::try_from(start + 2 * i).ok()?;
            let a = std::net::TcpListener::bind(("127.0.0.1", p)).ok()?;
            let b = std::net::TcpListener::bind(("127.0.0.1", p.checked_add(1)?)).ok()?;
            drop((a, b));
            Some(p)
        })
        .unwrap();
    let chief_addr = format!("127.0.0.1:{base}");
    let mut child = start_training(&[
        "--epochs",
        "50",
        "--transport",
        "quic",
        "--metrics-addr",
        &chief_addr,
    ]);
    let t = Instant::now();
    let (mut chief, mut other) = (None, None);
    while (chief.is_none() || other.is_none()) && t.elapsed() < Duration::from_secs(60) {
        let (a, b) = (
            scrape(&format!("127.0.0.1:{base}")),
            scrape(&format!("127.0.0.1:{}", base + 1)),
        );
        if a.as_deref()
            .is_some_and(|x| value(x, "pipe_samples_total").is_some())
        {
            chief = a;
        }
        if b.as_deref().is_some_and(|x| x.contains("worker=\"1\"")) {
            other = b;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    let chief = chief.expect("the chief's metrics");
    let other = other.expect("worker 1's metrics");
    assert!(
        chief.contains("pipe_worker_busy_seconds{worker=\"0\"}"),
        "{chief}"
    );
    assert!(
        other.contains("pipe_bytes_received_total{worker=\"1\"}"),
        "{other}"
    );
}
