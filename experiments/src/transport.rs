//! `pipe bench transport`: how fast tensors move between workers over every registered
//! transport ([`pipe_transport::kinds::TRANSPORTS`]), next to a plain TCP socket on the same
//! loopback; and the ring all-reduce over each.
//!
//! Method. *Streaming*: one worker sends `messages` tensors of `message_mib` MiB to another
//! through the [`Transport`] trait, which receives each by key, after a quarter as many again
//! that warm the connection up; the time runs from the last warm-up receive to the last receive, so it includes encoding, TLS, the wire, decoding and the
//! receiver's allocation. The tensors are made before the clock starts. *TCP*: the same bytes
//! written to a `std::net::TcpStream` on loopback and read into one buffer, no framing: the
//! ceiling a socket gives on this machine. *All-reduce*: `workers` endpoints, each on its own
//! thread of this process, run [`ring_all_reduce`] over a buffer of `allreduce_mb` MB, once
//! untimed and once timed (the slowest worker's time); with every endpoint in its own
//! process (`pipe bench transport` starts them), [`allreduce_rounds`] is each one's part.
//! Algorithm bandwidth is bytes /
//! time, bus bandwidth that times `2 (n - 1) / n`, as NCCL's tests report them. Every figure
//! is the median over `rounds`.

use std::io::{Read, Write};
use std::time::Instant;

use pipe_kernels::Tensor;
use pipe_transport::collective::ring_all_reduce;
use pipe_transport::frame::WireDType;
use pipe_transport::kinds::{MeshSettings, TRANSPORTS};
use pipe_transport::{Key, Kind, Message, Transport, TransportError};
use serde::Serialize;

use crate::{ExperimentError, median};

/// What to measure.
#[derive(Clone, Debug)]
pub struct TransportBenchConfig {
    /// Size of each streamed tensor in MiB.
    pub message_mib: usize,
    /// Tensors per streaming round.
    pub messages: u32,
    /// Size of the all-reduced buffer in MB (10^6 bytes).
    pub allreduce_mb: usize,
    /// Workers in the all-reduce.
    pub allreduce_workers: u32,
    /// Rounds per figure.
    pub rounds: u32,
}

impl Default for TransportBenchConfig {
    fn default() -> Self {
        TransportBenchConfig {
            message_mib: 4,
            messages: 64,
            allreduce_mb: 100,
            allreduce_workers: 4,
            rounds: 3,
        }
    }
}

/// One streaming figure.
#[derive(Clone, Debug, Serialize)]
pub struct Stream {
    /// What moved the bytes.
    pub transport: String,
    /// Median GB/s (10^9 bytes per second) of payload.
    pub gbytes_per_s: f64,
    /// Every round's GB/s.
    pub rounds: Vec<f64>,
}

/// The all-reduce figure.
#[derive(Clone, Debug, Serialize)]
pub struct AllReduce {
    /// Transport.
    pub transport: String,
    /// Workers.
    pub workers: u32,
    /// Bytes reduced.
    pub bytes: usize,
    /// Median seconds per all-reduce.
    pub seconds: f64,
    /// Algorithm bandwidth, GB/s.
    pub algbw: f64,
    /// Bus bandwidth, GB/s.
    pub busbw: f64,
}

/// The report.
#[derive(Clone, Debug, Serialize)]
pub struct TransportReport {
    /// MiB per streamed tensor.
    pub message_mib: usize,
    /// Tensors per round.
    pub messages: u32,
    /// Streaming figures: every registered transport in f32 (the networked ones in bf16
    /// too), then a raw TCP socket.
    pub streams: Vec<Stream>,
    /// QUIC (f32) over TCP.
    pub quic_over_tcp: f64,
    /// All-reduce figures.
    pub allreduce: Vec<AllReduce>,
}

/// The settings every transport's mesh is built with: `wire` on the wire.
fn settings(wire: WireDType) -> MeshSettings {
    MeshSettings {
        wire,
        ..MeshSettings::new(0xbe7c)
    }
}

fn key(i: u32) -> Key {
    Key {
        from: 0,
        to: 1,
        kind: Kind::Activation,
        stage: 0,
        index: i,
        step: 0,
    }
}

/// Seconds to stream `tensors` from endpoint 0 to endpoint 1, not counting the first `warm`.
fn stream_once<T: Transport + 'static>(
    mut eps: Vec<T>,
    tensors: Vec<Tensor>,
    warm: u32,
) -> Result<f64, ExperimentError> {
    let err = |e: TransportError| ExperimentError::Config(format!("transport: {e}"));
    let mut b = eps
        .pop()
        .ok_or_else(|| ExperimentError::Config("no endpoint".into()))?;
    let mut a = eps
        .pop()
        .ok_or_else(|| ExperimentError::Config("no endpoint".into()))?;
    let n = tensors.len() as u32;
    let mut t = Instant::now();
    let sender = std::thread::spawn(move || -> Result<(), TransportError> {
        for (i, tensor) in tensors.into_iter().enumerate() {
            a.send(Message {
                key: key(i as u32),
                version: 0,
                tensor,
            })?;
        }
        a.close()
    });
    for i in 0..n {
        b.recv(&key(i)).map_err(err)?;
        if i + 1 == warm {
            t = Instant::now();
        }
    }
    let secs = t.elapsed().as_secs_f64();
    // The receiver has read everything; its close lets the sender's go.
    b.close().map_err(err)?;
    sender
        .join()
        .map_err(|_| ExperimentError::Config("sender panicked".into()))?
        .map_err(err)?;
    Ok(secs)
}

fn warm_up(cfg: &TransportBenchConfig) -> u32 {
    cfg.messages.div_ceil(4)
}

/// The timed tensors and, first, a quarter as many again to warm the connection up (slow
/// start, path MTU discovery), which the clock does not count.
fn tensors(cfg: &TransportBenchConfig) -> Result<Vec<Tensor>, ExperimentError> {
    let n = cfg.message_mib << 18;
    (0..cfg.messages + warm_up(cfg))
        .map(|i| Ok(Tensor::from_vec(&[n], vec![i as f32 * 0.5; n])?))
        .collect()
}

/// Seconds to write `bytes` `count` times through a loopback TCP socket, after `warm` writes
/// the clock does not count (timed by the reader, like the streams).
fn tcp_once(bytes: usize, count: u32, warm: u32) -> Result<f64, ExperimentError> {
    let io = |e: std::io::Error| ExperimentError::Config(format!("tcp: {e}"));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(io)?;
    let addr = listener.local_addr().map_err(io)?;
    let reader = std::thread::spawn(move || -> std::io::Result<f64> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; bytes];
        for _ in 0..warm {
            s.read_exact(&mut buf)?;
        }
        let t = Instant::now();
        for _ in 0..count {
            s.read_exact(&mut buf)?;
        }
        Ok(t.elapsed().as_secs_f64())
    });
    let data = vec![7u8; bytes];
    let mut s = std::net::TcpStream::connect(addr).map_err(io)?;
    s.set_nodelay(true).map_err(io)?;
    for _ in 0..warm + count {
        s.write_all(&data).map_err(io)?;
    }
    reader
        .join()
        .map_err(|_| ExperimentError::Config("tcp reader panicked".into()))?
        .map_err(io)
}

fn stream_figure(
    name: &str,
    bytes: f64,
    rounds: u32,
    mut once: impl FnMut() -> Result<f64, ExperimentError>,
) -> Result<Stream, ExperimentError> {
    let rates = (0..rounds)
        .map(|_| once().map(|s| bytes / s / 1e9))
        .collect::<Result<Vec<f64>, _>>()?;
    Ok(Stream {
        transport: name.into(),
        gbytes_per_s: median(&rates),
        rounds: rates,
    })
}

fn allreduce_figure<T: Transport + 'static>(
    name: &str,
    cfg: &TransportBenchConfig,
    mut make: impl FnMut() -> Result<Vec<T>, ExperimentError>,
) -> Result<AllReduce, ExperimentError> {
    let n = cfg.allreduce_workers;
    let values = cfg.allreduce_mb * 1_000_000 / 4;
    let mut times = Vec::new();
    for _ in 0..cfg.rounds {
        let eps = make()?;
        let group: Vec<u32> = (0..n).collect();
        let start = std::sync::Barrier::new(n as usize);
        let secs: Vec<Result<f64, TransportError>> = std::thread::scope(|s| {
            let handles: Vec<_> = eps
                .into_iter()
                .map(|mut ep| {
                    let (group, start) = (&group, &start);
                    s.spawn(move || {
                        let mut data = vec![ep.rank() as f32; values];
                        // One untimed all-reduce warms the connections up.
                        ring_all_reduce(&mut ep, group, 0, 0, &mut data)?;
                        start.wait();
                        let t = Instant::now();
                        ring_all_reduce(&mut ep, group, 0, 1, &mut data)?;
                        let secs = t.elapsed().as_secs_f64();
                        ep.close()?;
                        Ok(secs)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or(Err(TransportError::Protocol("panicked".into())))
                })
                .collect()
        });
        let slowest = secs
            .into_iter()
            .collect::<Result<Vec<f64>, _>>()
            .map_err(|e| ExperimentError::Config(format!("all-reduce: {e}")))?
            .into_iter()
            .fold(0.0, f64::max);
        times.push(slowest);
    }
    Ok(allreduce_from_times(name, n, values * 4, &times))
}

/// The all-reduce figure of `workers` reducing `bytes`, from each round's slowest time.
pub fn allreduce_from_times(name: &str, workers: u32, bytes: usize, times: &[f64]) -> AllReduce {
    let seconds = median(times);
    let algbw = bytes as f64 / seconds / 1e9;
    AllReduce {
        transport: name.into(),
        workers,
        bytes,
        seconds,
        algbw,
        busbw: algbw * 2.0 * f64::from(workers - 1) / f64::from(workers),
    }
}

/// One endpoint's part of the all-reduce figure when every worker is its own process: one
/// untimed all-reduce of `mb` MB, then `rounds` timed ones, each after a one-value
/// all-reduce that lines the workers up. Returns this worker's seconds per round; the
/// figure takes each round's slowest worker ([`allreduce_from_times`]).
///
/// # Errors
/// Transport failures.
pub fn allreduce_rounds<T: Transport + ?Sized>(
    ep: &mut T,
    mb: usize,
    rounds: u32,
) -> Result<Vec<f64>, ExperimentError> {
    let fail = |e: TransportError| ExperimentError::Config(format!("all-reduce: {e}"));
    let group: Vec<u32> = (0..ep.size()).collect();
    let mut data = vec![ep.rank() as f32; mb * 1_000_000 / 4];
    ring_all_reduce(ep, &group, 0, 0, &mut data).map_err(fail)?;
    let mut times = Vec::with_capacity(rounds as usize);
    for round in 1..=rounds {
        let mut one = [0.0f32];
        ring_all_reduce(ep, &group, 1, round, &mut one).map_err(fail)?;
        let t = Instant::now();
        ring_all_reduce(ep, &group, 0, round, &mut data).map_err(fail)?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(times)
}

/// The memory gate every run passes ([`pipe_stages::limits::admit_memory`]), for what the
/// measurement holds at once: every streamed tensor (they are made before a round starts)
/// or every all-reduce worker's buffer, each about twice over (what is sent and what is
/// received). Past this host's memory it is refused before anything is allocated, where it
/// aborted the process.
///
/// # Errors
/// [`ExperimentError::Stage`] with the gate's refusal.
pub fn admit_buffers(cfg: &TransportBenchConfig) -> Result<(), ExperimentError> {
    let tensors = f64::from(cfg.messages + warm_up(cfg));
    let streams = 2.0 * tensors * (cfg.message_mib << 20) as f64;
    let reduce = 2.0 * f64::from(cfg.allreduce_workers) * (cfg.allreduce_mb * 1_000_000) as f64;
    let need = pipe_stages::limits::MemoryNeed {
        bytes: streams.max(reduce),
        workers: 1,
        holding: "the streamed tensors or the all-reduce's buffers",
        lower: "give fewer --messages, a smaller --message-mib, fewer --allreduce-workers \
                or a smaller --allreduce-mb",
    };
    pipe_stages::limits::admit_memory(&need, &pipe_stages::limits::Machine::detect())?;
    Ok(())
}

/// Runs the measurement.
///
/// # Errors
/// Zero sizes; transport failures.
pub fn run(cfg: &TransportBenchConfig) -> Result<TransportReport, ExperimentError> {
    if cfg.message_mib == 0 || cfg.messages == 0 || cfg.rounds == 0 || cfg.allreduce_workers < 2 {
        return Err(ExperimentError::Config(
            "message size, messages and rounds must be positive, all-reduce workers at least 2"
                .into(),
        ));
    }
    admit_buffers(cfg)?;
    let bytes = (cfg.message_mib << 20) as f64 * f64::from(cfg.messages);
    let warm = warm_up(cfg);
    // Every registered transport streams f32; those with a wire encoding (networked) bf16 too.
    let mut streams = Vec::new();
    for registration in TRANSPORTS {
        let wires: &[WireDType] = if registration.networked {
            &[WireDType::F32, WireDType::Bf16]
        } else {
            &[WireDType::F32]
        };
        for &wire in wires {
            let name = format!("{}, {wire}", registration.about);
            streams.push(stream_figure(&name, bytes, cfg.rounds, || {
                let eps = (registration.thread_mesh)(2, &settings(wire))?;
                stream_once(eps, tensors(cfg)?, warm)
            })?);
        }
    }
    let socket = stream_figure("TCP socket (raw bytes)", bytes, cfg.rounds, || {
        tcp_once(cfg.message_mib << 20, cfg.messages, warm)
    })?;
    let quic = format!(
        "{}, {}",
        pipe_transport::kinds::QUIC_REGISTRATION.about,
        WireDType::F32
    );
    let quic_over_tcp = streams
        .iter()
        .find(|s| s.transport == quic)
        .map_or(f64::NAN, |q| q.gbytes_per_s / socket.gbytes_per_s);
    streams.push(socket);
    let n = cfg.allreduce_workers;
    let allreduce = TRANSPORTS
        .iter()
        .map(|registration| {
            let name = format!("{}, threads of one process", registration.about);
            allreduce_figure(&name, cfg, || {
                Ok((registration.thread_mesh)(n, &settings(WireDType::F32))?)
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(TransportReport {
        message_mib: cfg.message_mib,
        messages: cfg.messages,
        streams,
        quic_over_tcp,
        allreduce,
    })
}

/// The report as text.
pub fn render(r: &TransportReport) -> String {
    let mut out = format!(
        "streaming {} tensors of {} MiB from one worker to another (loopback), medians\n\n\
         | transport | GB/s | rounds |\n|---|---|---|\n",
        r.messages, r.message_mib
    );
    for s in &r.streams {
        let rounds: Vec<String> = s.rounds.iter().map(|x| format!("{x:.2}")).collect();
        out += &format!(
            "| {} | {:.2} | {} |\n",
            s.transport,
            s.gbytes_per_s,
            rounds.join(", ")
        );
    }
    out += &format!("\nQUIC (f32) / TCP: {:.2}\n\n", r.quic_over_tcp);
    // A ring's links are its transport's f32 stream measured above; in process the stream
    // moves buffers without copying them, which no ring can match, so no ratio there.
    let inproc = pipe_transport::inproc::REGISTRATION.about;
    let stream_of = |ring: &str| {
        r.streams
            .iter()
            .filter_map(|s| Some((s.transport.strip_suffix(", f32")?, s.gbytes_per_s)))
            .find(|(about, rate)| *about != inproc && *rate > 0.0 && ring.starts_with(about))
            .map(|(_, rate)| rate)
    };
    out += "ring all-reduce (busbw against its transport's f32 stream)\n\n\
            | transport | workers | MB | seconds | algbw GB/s | busbw GB/s | busbw / stream |\n\
            |---|---|---|---|---|---|---|\n";
    for a in &r.allreduce {
        let of_stream = stream_of(&a.transport)
            .map_or_else(|| "-".to_string(), |q| format!("{:.2}", a.busbw / q));
        out += &format!(
            "| {} | {} | {:.0} | {:.3} | {:.2} | {:.2} | {of_stream} |\n",
            a.transport,
            a.workers,
            a.bytes as f64 / 1e6,
            a.seconds,
            a.algbw,
            a.busbw
        );
    }
    let busbw = |name: String| {
        r.allreduce
            .iter()
            .find(|a| a.transport == name)
            .map(|a| a.busbw)
    };
    let shm = pipe_transport::shm::REGISTRATION.about;
    if let (Some(processes), Some(threads)) = (
        busbw(format!("{shm}, one process per worker")),
        busbw(format!("{inproc}, threads of one process")),
    ) {
        out += &format!(
            "\nshared memory, one process per worker / in-process threads (busbw): {:.2}\n",
            processes / threads
        );
    }
    out
}

/// The ring all-reduce of `cfg` with every worker its own `pipe bench allreduce-worker`
/// process, over a transport that crosses processes (loopback or shared memory): each
/// process's seconds per round come back as a record, and a round takes its slowest worker.
///
/// # Errors
/// A worker that fails or does not report its times.
pub fn allreduce_in_processes(
    cfg: &TransportBenchConfig,
    transport: pipe_transport::TransportKind,
) -> Result<AllReduce, ExperimentError> {
    use pipe_stages::pipeline::processes::{LaunchOptions, launch};
    let n = cfg.allreduce_workers;
    let mut per_rank: Vec<Option<Vec<f64>>> = vec![None; n as usize];
    let mut on_record = |rank: u32, json: &str| -> pipe_stages::Result<()> {
        let times: Vec<f64> = serde_json::from_str(json).map_err(|e| {
            pipe_stages::StageError::Executor(format!("a worker's all-reduce times: {e}"))
        })?;
        if let Some(slot) = per_rank.get_mut(rank as usize) {
            *slot = Some(times);
        }
        Ok(())
    };
    let (mb, rounds) = (cfg.allreduce_mb.to_string(), cfg.rounds.to_string());
    let command = |_: &std::path::Path| -> Vec<std::ffi::OsString> {
        vec![
            "bench".into(),
            "allreduce-worker".into(),
            "--mb".into(),
            mb.clone().into(),
            "--rounds".into(),
            rounds.clone().into(),
            "--transport".into(),
            transport.name().into(),
        ]
    };
    launch(&LaunchOptions::new(n), &[], &command, &mut on_record)?;
    let slowest: Vec<f64> = (0..cfg.rounds as usize)
        .map(|r| {
            per_rank
                .iter()
                .map(|t| t.as_ref().and_then(|t| t.get(r)).copied())
                .try_fold(0.0f64, |m, t| t.map(|t| m.max(t)))
                .ok_or_else(|| {
                    ExperimentError::Stage(pipe_stages::StageError::Executor(
                        "a worker did not report its all-reduce times".into(),
                    ))
                })
        })
        .collect::<Result<_, _>>()?;
    Ok(allreduce_from_times(
        &format!(
            "{}, one process per worker",
            transport.registration().map_or("auto", |r| r.about)
        ),
        n,
        cfg.allreduce_mb * 1_000_000,
        &slowest,
    ))
}
