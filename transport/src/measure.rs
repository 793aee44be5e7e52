//! What a message costs on a transport, measured by ping-pong between two threads: the one-way
//! wall time of a small message (the simulator's link latency), the processor time each end
//! spends on it (the simulator's `message_cpu`), and the one-way time and processor time of a
//! large one, whose excess over the small one gives the link's bandwidth and the processor
//! time per byte (the simulator's `byte_cpu`). Generic over [`Transport`], so the in-process
//! channels and QUIC on loopback are measured by the same code.
//!
//! The planner charges links these figures (`pipe_stages::planning::link_costs` caches them per
//! machine); `pipe bench transport` prints them.
//!
//! Processor time is the whole process's (`CLOCK_PROCESS_CPUTIME_ID`): a QUIC endpoint does
//! its packet and encryption work on its own runtime thread, not on the thread that calls
//! `send` and `recv`, so the callers' time alone would miss most of it. Both ends run in this
//! process, so its time over twice the messages is one end's share.

use std::time::Instant;

use pipe_kernels::Tensor;
use serde::{Deserialize, Serialize};

use crate::{Key, Kind, Message, Transport, TransportError};

/// What a message costs on one transport.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkCost {
    /// Wall time per small message, one way, seconds.
    pub latency_s: f64,
    /// Processor time per small message at each end (sender or receiver), seconds.
    pub cpu_s: f64,
    /// Bytes per second beyond the small message's cost (`None` when large messages cost no
    /// more than small ones, as on the in-process transport, which moves owned buffers).
    pub bandwidth: Option<f64>,
    /// Processor time per byte at each end beyond the small message's, seconds per byte
    /// (0 where large messages cost no more processor time, as in process).
    #[serde(default)]
    pub byte_cpu_s: f64,
}

/// This process's processor time in seconds, every thread's (`CLOCK_PROCESS_CPUTIME_ID`).
pub fn process_cpu_seconds() -> f64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// The key of activation `index` from `from` to `to`: the messages a measurement sends.
pub(crate) fn key(from: u32, to: u32, index: u32) -> Key {
    Key::data(from, to, Kind::Activation, index)
}

/// One ping-pong series of `rounds` round trips of a tensor of `values` floats starting at
/// message index `first`: (wall seconds per message one way, processor seconds per message
/// end).
fn ping_pong<T: Transport + Send + 'static>(
    a: &mut T,
    b: T,
    values: usize,
    rounds: u32,
    first: u32,
) -> Result<(f64, f64, T), TransportError> {
    let mut b = b;
    let cpu0 = process_cpu_seconds();
    let t = Instant::now();
    let echo = std::thread::spawn(move || -> Result<T, TransportError> {
        for i in first..first + rounds {
            let m = b.recv(&key(0, 1, i))?;
            b.send(Message {
                key: key(1, 0, i),
                version: 0,
                tensor: m.tensor,
            })?;
        }
        Ok(b)
    });
    let mut tensor = Tensor::zeros(&[values]);
    for i in first..first + rounds {
        a.send(Message {
            key: key(0, 1, i),
            version: 0,
            tensor,
        })?;
        tensor = a.recv(&key(1, 0, i))?.tensor;
    }
    let secs = t.elapsed().as_secs_f64();
    let b = echo
        .join()
        .map_err(|_| TransportError::Setup("ping-pong thread panicked".into()))??;
    let cpu = process_cpu_seconds() - cpu0;
    let messages = f64::from(2 * rounds);
    // Every message has two ends: the process's time over twice the messages.
    Ok((secs / messages, cpu / (2.0 * messages), b))
}

/// Measures [`LinkCost`] between two endpoints of one transport (ranks 0 and 1): a warm-up,
/// then `rounds` round trips of a 2,048-value tensor and `rounds / 10` (at least 5) of a
/// 1 Mi-value one.
///
/// # Errors
/// Transport failures, or a panicked echo thread.
pub fn measure<T: Transport + Send + 'static>(
    mut a: T,
    b: T,
    rounds: u32,
) -> Result<LinkCost, TransportError> {
    const SMALL: usize = 2048;
    const LARGE: usize = 1 << 20;
    let (_, _, b) = ping_pong(&mut a, b, SMALL, 50, 0)?;
    let (small_s, cpu_s, b) = ping_pong(&mut a, b, SMALL, rounds.max(10), 50)?;
    let large_rounds = (rounds / 10).max(5);
    let (large_s, large_cpu_s, _) = ping_pong(&mut a, b, LARGE, large_rounds, 50 + rounds.max(10))?;
    let extra_bytes = ((LARGE - SMALL) * 4) as f64;
    let extra_s = large_s - small_s;
    // Under 10 us for 4 MiB more (over 400 GB/s) is no cost within the noise.
    let bandwidth = (extra_s > 1e-5).then(|| extra_bytes / extra_s);
    Ok(LinkCost {
        latency_s: small_s,
        cpu_s,
        bandwidth,
        byte_cpu_s: ((large_cpu_s - cpu_s) / extra_bytes).max(0.0),
    })
}

/// Seconds one ring all-reduce of `values` floats takes among `endpoints` (one thread each,
/// ranks `0..n`): one untimed round, then the median over `rounds` timed rounds of every
/// thread's time.
///
/// # Errors
/// Transport failures, or a panicked thread.
pub fn all_reduce_seconds<T: Transport + Send + 'static>(
    endpoints: Vec<T>,
    values: usize,
    rounds: u32,
) -> Result<f64, TransportError> {
    let group: Vec<u32> = (0..endpoints.len() as u32).collect();
    let handles: Vec<_> = endpoints
        .into_iter()
        .map(|mut ep| {
            let group = group.clone();
            std::thread::spawn(move || -> Result<Vec<f64>, TransportError> {
                let mut data = vec![1.0f32; values];
                let mut times = Vec::with_capacity(rounds as usize);
                for update in 0..=rounds {
                    let t = Instant::now();
                    crate::collective::ring_all_reduce(&mut ep, &group, 0, update, &mut data)?;
                    if update > 0 {
                        times.push(t.elapsed().as_secs_f64());
                    }
                }
                Ok(times)
            })
        })
        .collect();
    let mut times = Vec::new();
    for h in handles {
        let mine = h
            .join()
            .map_err(|_| TransportError::Setup("all-reduce thread panicked".into()))??;
        times.extend(mine);
    }
    Ok(median(&times))
}

/// [`measure`] between the two endpoints of a two-worker mesh.
///
/// # Errors
/// As [`measure`]; a mesh of fewer than two endpoints.
pub fn measure_mesh<T: Transport + Send + 'static>(
    mut endpoints: Vec<T>,
    rounds: u32,
) -> Result<LinkCost, TransportError> {
    let missing = || TransportError::Setup("a link needs a mesh of two endpoints".into());
    let b = endpoints.pop().ok_or_else(missing)?;
    let a = endpoints.pop().ok_or_else(missing)?;
    measure(a, b, rounds)
}

/// Median of the finite values of a sample (mean of the two middle values for even sizes;
/// NaN for none): what every measurement of this project reports.
pub fn median(xs: &[f64]) -> f64 {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
