//! Fault injection: a [`Transport`] that wraps a real one and breaks it on purpose, so that
//! tests can check what a run does when a message is late, reordered, duplicated or lost, when
//! a connection resets, and when a worker panics, fails or stalls. The core has no fault flags;
//! a test wraps each endpoint of a mesh in [`Faulty`] and runs the ordinary launcher.
//!
//! Counting is over the data messages a worker sends (activations, gradients, all-reduce
//! chunks): control records between the chief and the workers are passed through untouched, so
//! that a fault lands inside the schedule, where the executor must cope with it. Faults fire at
//! a given send (the `nth`, from 1) so that a test is deterministic; [`Fault::Delay`] draws its
//! delays from a seeded generator.

use std::time::Duration;

use crate::{Key, Kind, Message, Transport, TransportError, ValueSink, Values};

/// What goes wrong. Serialized as its text (`exit:at=5`, as `--fault` takes it), so that a
/// launcher hands it to a worker process in the run's file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Fault {
    /// Nothing: the wrapper only passes messages through.
    None,
    /// Every data message waits a seeded random time below `max` before it is sent.
    Delay {
        /// Longest delay.
        max: Duration,
        /// Seed of the delays.
        seed: u64,
    },
    /// Data messages are held back and sent newest first, `window` at a time (and whenever the
    /// worker is about to wait in a receive or close, so that holding them never blocks a peer
    /// the worker then waits for): the reordering the protocol allows, since a receiver asks
    /// for messages by key. Control records are not held, so they may overtake held data; a
    /// send that blocks on a full queue while data is held is not covered (queues here hold far
    /// more than a window).
    Reorder {
        /// Messages held before they are released.
        window: usize,
    },
    /// The `nth` data message is sent twice.
    Duplicate {
        /// Which send.
        nth: u64,
    },
    /// The `nth` data message is never sent (and the send reports success).
    Drop {
        /// Which send.
        nth: u64,
    },
    /// At the `nth` data message the connection resets: the endpoint is dropped without the
    /// closing handshake, and every later call fails.
    Reset {
        /// Which send.
        nth: u64,
    },
    /// The worker panics at its `nth` data message.
    Panic {
        /// Which send.
        nth: u64,
    },
    /// The `nth` send fails with an error.
    Fail {
        /// Which send.
        nth: u64,
    },
    /// The worker stops for `pause` at its `nth` data message, then goes on.
    Stall {
        /// Which send.
        nth: u64,
        /// How long.
        pause: Duration,
    },
    /// The worker's whole process ends at its `nth` data message, at once, as `kill -9` would
    /// end it: no closing handshake, no destructors, no exit code of its own
    /// (`std::process::abort`). For worker processes only: a thread would take its launcher
    /// down with it.
    Exit {
        /// Which send.
        nth: u64,
    },
    /// The worker's whole process is frozen (SIGSTOP) for `pause` at its `nth` data message,
    /// then goes on (SIGCONT): its transport's keep-alives stop too, so past the transport's
    /// idle timeout its peers count it lost. For worker processes only.
    Freeze {
        /// Which send.
        nth: u64,
        /// How long.
        pause: Duration,
    },
    /// The network link between this worker and `peer` is cut for `pause` at its `nth` data
    /// message: no datagram passes either way (the transport's own packets included), then
    /// the link is whole again. Shorter than the transport's idle timeout, the connection
    /// rides it out (QUIC sends again what was lost); longer, both ends count the other lost.
    /// Only a networked transport (QUIC) has a link to cut.
    Partition {
        /// Which send.
        nth: u64,
        /// The worker at the link's other end.
        peer: u32,
        /// How long.
        pause: Duration,
    },
}

/// A fault as text: `none`, `exit@N`, `panic@N`, `fail@N`, `reset@N`, `drop@N`,
/// `duplicate@N`, `stall@N:SECONDS`, `reorder:WINDOW` or `delay:MAX_SECONDS:SEED`.
impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Fault::None => f.write_str("none"),
            Fault::Delay { max, seed } => write!(f, "delay:{}:{seed}", max.as_secs_f64()),
            Fault::Reorder { window } => write!(f, "reorder:{window}"),
            Fault::Duplicate { nth } => write!(f, "duplicate@{nth}"),
            Fault::Drop { nth } => write!(f, "drop@{nth}"),
            Fault::Reset { nth } => write!(f, "reset@{nth}"),
            Fault::Panic { nth } => write!(f, "panic@{nth}"),
            Fault::Fail { nth } => write!(f, "fail@{nth}"),
            Fault::Stall { nth, pause } => write!(f, "stall@{nth}:{}", pause.as_secs_f64()),
            Fault::Exit { nth } => write!(f, "exit@{nth}"),
            Fault::Freeze { nth, pause } => write!(f, "freeze@{nth}:{}", pause.as_secs_f64()),
            Fault::Partition { nth, peer, pause } => {
                write!(f, "partition@{nth}:{peer}:{}", pause.as_secs_f64())
            }
        }
    }
}

/// Seconds as a duration of at most a day.
fn seconds(text: &str) -> Result<Duration, String> {
    let s: f64 = text
        .parse()
        .map_err(|_| format!("'{text}' is not a number of seconds"))?;
    if !(s.is_finite() && (0.0..=86_400.0).contains(&s)) {
        // The text as given: 1e308 printed as a number would be 309 digits.
        return Err(format!("{text} seconds: give 0 to 86400"));
    }
    Ok(Duration::from_secs_f64(s))
}

impl From<Fault> for String {
    fn from(f: Fault) -> String {
        f.to_string()
    }
}

impl TryFrom<String> for Fault {
    type Error = String;
    fn try_from(text: String) -> Result<Fault, String> {
        text.parse()
    }
}

impl std::str::FromStr for Fault {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "unknown fault '{text}' (none, exit@N, panic@N, fail@N, reset@N, drop@N, \
                 duplicate@N, stall@N:SECONDS, freeze@N:SECONDS, partition@N:PEER:SECONDS, \
                 reorder:WINDOW, delay:MAX_SECONDS:SEED)"
            )
        };
        if text == "none" {
            return Ok(Fault::None);
        }
        if let Some((kind, rest)) = text.split_once('@') {
            let (n, pause) = match rest.split_once(':') {
                Some((n, p)) => (n, Some(p)),
                None => (rest, None),
            };
            let nth: u64 = n
                .parse()
                .map_err(|_| {
                    format!("fault '{text}': the send count '{n}' is not a whole number of sends")
                })
                .and_then(|n| match n {
                    0 => Err(format!("fault '{text}': the send count must be at least 1")),
                    n => Ok(n),
                })?;
            return Ok(match (kind, pause) {
                ("exit", None) => Fault::Exit { nth },
                ("panic", None) => Fault::Panic { nth },
                ("fail", None) => Fault::Fail { nth },
                ("reset", None) => Fault::Reset { nth },
                ("drop", None) => Fault::Drop { nth },
                ("duplicate", None) => Fault::Duplicate { nth },
                ("stall", Some(p)) => Fault::Stall {
                    nth,
                    pause: seconds(p)?,
                },
                ("freeze", Some(p)) => Fault::Freeze {
                    nth,
                    pause: seconds(p)?,
                },
                ("partition", Some(rest)) => {
                    let (peer, p) = rest.split_once(':').ok_or_else(bad)?;
                    Fault::Partition {
                        nth,
                        peer: peer
                            .parse()
                            .map_err(|_| format!("fault '{text}': '{peer}' is not a rank"))?,
                        pause: seconds(p)?,
                    }
                }
                _ => return Err(bad()),
            });
        }
        let parts: Vec<&str> = text.split(':').collect();
        match parts.as_slice() {
            ["reorder", w] => w
                .parse()
                .ok()
                .filter(|&w: &usize| (1..=1 << 20).contains(&w))
                .map(|window| Fault::Reorder { window })
                .ok_or_else(|| format!("fault '{text}': the window must be 1 to 1048576")),
            ["delay", max, seed] => Ok(Fault::Delay {
                max: seconds(max)?,
                seed: seed
                    .parse()
                    .map_err(|_| format!("fault '{text}': '{seed}' is not a seed"))?,
            }),
            _ => Err(bad()),
        }
    }
}

/// One entry of a fault schedule: `fault` on worker `rank` in the run's `attempt` (0 for the
/// first run, 1 for the first restart, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledFault {
    /// The worker.
    pub rank: u32,
    /// Which start of the run it applies to.
    pub attempt: u32,
    /// What goes wrong.
    pub fault: Fault,
}

/// The most entries a fault schedule takes.
pub const MAX_SCHEDULED_FAULTS: usize = 1024;

/// Parses a fault schedule: entries `RANK:FAULT` or `RANK:FAULT/ATTEMPT`, separated by
/// commas (`2:exit@400,1:stall@50:3/1`). An entry without an attempt applies to the first
/// start of the run only; a worker has at most one fault per attempt.
///
/// # Errors
/// A message naming the entry that is malformed, or a worker given two faults in one attempt.
pub fn parse_schedule(text: &str) -> Result<FaultSchedule, String> {
    let mut out: Vec<ScheduledFault> = Vec::new();
    for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        if out.len() == MAX_SCHEDULED_FAULTS {
            return Err(format!(
                "more than {MAX_SCHEDULED_FAULTS} faults in one schedule"
            ));
        }
        let (rank, rest) = entry
            .split_once(':')
            .ok_or_else(|| format!("fault entry '{entry}': give RANK:FAULT[/ATTEMPT]"))?;
        let rank: u32 = rank
            .parse()
            .map_err(|_| format!("fault entry '{entry}': '{rank}' is not a rank"))?;
        let (fault, attempt) = match rest.rsplit_once('/') {
            Some((f, a)) => (
                f,
                a.parse()
                    .map_err(|_| format!("fault entry '{entry}': '{a}' is not an attempt"))?,
            ),
            None => (rest, 0),
        };
        let fault: Fault = fault.parse()?;
        if out.iter().any(|f| f.rank == rank && f.attempt == attempt) {
            return Err(format!(
                "fault entry '{entry}': worker {rank} already has a fault in attempt {attempt}"
            ));
        }
        out.push(ScheduledFault {
            rank,
            attempt,
            fault,
        });
    }
    Ok(FaultSchedule(out))
}

impl Fault {
    /// The data message a fault acts at, for the faults that act at one.
    pub fn nth(&self) -> Option<u64> {
        match *self {
            Fault::None | Fault::Delay { .. } | Fault::Reorder { .. } => None,
            Fault::Duplicate { nth }
            | Fault::Drop { nth }
            | Fault::Reset { nth }
            | Fault::Panic { nth }
            | Fault::Fail { nth }
            | Fault::Stall { nth, .. }
            | Fault::Exit { nth }
            | Fault::Freeze { nth, .. }
            | Fault::Partition { nth, .. } => Some(nth),
        }
    }
}

/// A fault schedule as given: listed entries, or drawn from a seed once the run's worker
/// count is known (`random:SEED:COUNT`: COUNT faults, one per start of the run, so a run with
/// `--max-restarts COUNT` meets every one of them and then completes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultPlan {
    /// The entries given.
    Listed(FaultSchedule),
    /// Drawn by [`FaultPlan::schedule`].
    Random {
        /// Seed of the draw.
        seed: u64,
        /// Faults drawn.
        count: u32,
    },
}

/// The most faults a drawn schedule takes (as many as restarts may be allowed).
pub const MAX_RANDOM_FAULTS: u32 = 1000;

/// Parses `--fault-schedule`: `random:SEED:COUNT`, or entries as [`parse_schedule`] reads.
///
/// # Errors
/// A message naming what is malformed.
pub fn parse_plan(text: &str) -> Result<FaultPlan, String> {
    let Some(rest) = text.strip_prefix("random:") else {
        let listed = parse_schedule(text)?;
        // Asked for and empty, it would do nothing: a run is never silently other than asked.
        if listed.0.is_empty() {
            return Err(format!(
                "'{text}' lists no fault: give RANK:FAULT[/ATTEMPT] entries, or random:SEED:COUNT"
            ));
        }
        return Ok(FaultPlan::Listed(listed));
    };
    if rest.contains(',') {
        return Err(format!(
            "'{text}': a drawn schedule (random:SEED:COUNT) stands alone, without listed entries"
        ));
    }
    let (seed, count) = rest
        .split_once(':')
        .ok_or_else(|| format!("'{text}': give random:SEED:COUNT"))?;
    let seed = seed
        .parse()
        .map_err(|_| format!("'{text}': '{seed}' is not a seed"))?;
    let count = count
        .parse()
        .ok()
        .filter(|c| (1..=MAX_RANDOM_FAULTS).contains(c))
        .ok_or_else(|| format!("'{text}': the count must be 1 to {MAX_RANDOM_FAULTS}"))?;
    Ok(FaultPlan::Random { seed, count })
}

impl FaultPlan {
    /// The schedule for a run of `workers` workers whose stalls are noticed after `stall`:
    /// a listed one as given; a drawn one with fault `i` in start `i` of the run, on a worker,
    /// at a data message (1 to `within`) and of a kind (process exit, panic, failed send,
    /// reset connection, dropped message, or a stall, freeze or cut link to another worker
    /// lasting past `stall`) drawn from the seed.
    pub fn schedule(&self, workers: u32, within: u64, stall: Duration) -> FaultSchedule {
        let (seed, count) = match self {
            FaultPlan::Listed(s) => return s.clone(),
            FaultPlan::Random { seed, count } => (*seed, *count),
        };
        let mut state = seed;
        let mut draw = |n: u64| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) % n.max(1)
        };
        let faults = (0..count)
            .map(|attempt| {
                let rank = draw(u64::from(workers)) as u32;
                let nth = 1 + draw(within);
                // Long enough that a peer waiting on the worker notices it.
                let pause = stall + Duration::from_secs(1);
                let fault = match draw(8) {
                    0 => Fault::Exit { nth },
                    1 => Fault::Panic { nth },
                    2 => Fault::Fail { nth },
                    3 => Fault::Reset { nth },
                    4 => Fault::Drop { nth },
                    5 => Fault::Freeze { nth, pause },
                    6 if workers > 1 => Fault::Partition {
                        nth,
                        peer: (rank + 1 + draw(u64::from(workers - 1)) as u32) % workers,
                        pause,
                    },
                    _ => Fault::Stall { nth, pause },
                };
                ScheduledFault {
                    rank,
                    attempt,
                    fault,
                }
            })
            .collect();
        FaultSchedule(faults)
    }
}

/// Entries as [`parse_schedule`] reads them: `RANK:FAULT/ATTEMPT`, comma-separated.
impl std::fmt::Display for FaultSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let entries: Vec<String> = self
            .0
            .iter()
            .map(|e| format!("{}:{}/{}", e.rank, e.fault, e.attempt))
            .collect();
        f.write_str(&entries.join(","))
    }
}

/// A run's fault schedule ([`parse_schedule`]): which worker fails how, in which start of the
/// run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultSchedule(pub Vec<ScheduledFault>);

impl FaultSchedule {
    /// The fault of worker `rank` in start `attempt` of the run ([`Fault::None`] if none).
    pub fn of(&self, rank: u32, attempt: u32) -> Fault {
        self.0
            .iter()
            .find(|f| f.rank == rank && f.attempt == attempt)
            .map_or(Fault::None, |f| f.fault)
    }

    /// The highest rank the schedule names.
    pub fn max_rank(&self) -> Option<u32> {
        self.0.iter().map(|f| f.rank).max()
    }
}

/// A transport endpoint with a [`Fault`].
#[derive(Debug)]
pub struct Faulty<T> {
    inner: Option<T>,
    rank: u32,
    size: u32,
    fault: Fault,
    sent: u64,
    held: Vec<Message>,
    rng: u64,
}

impl<T: Transport> Faulty<T> {
    /// Wraps `inner` with `fault`.
    pub fn new(inner: T, fault: Fault) -> Self {
        let seed = match fault {
            Fault::Delay { seed, .. } => seed,
            _ => 0,
        };
        let rank = inner.rank();
        Faulty {
            rank,
            size: inner.size(),
            inner: Some(inner),
            fault,
            sent: 0,
            held: Vec::new(),
            // Each worker draws other delays from one seed.
            rng: seed ^ u64::from(rank).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        }
    }

    fn inner(&mut self) -> Result<&mut T, TransportError> {
        let rank = self.rank;
        self.inner.as_mut().ok_or_else(|| TransportError::Lost {
            peer: rank,
            why: "the connection was reset (injected fault)".into(),
        })
    }

    /// Sends what [`Fault::Reorder`] holds, newest first.
    fn flush(&mut self) -> Result<(), TransportError> {
        while let Some(m) = self.held.pop() {
            self.inner()?.send(m)?;
        }
        Ok(())
    }

    /// The next delay of [`Fault::Delay`] (splitmix64).
    fn next_delay(&mut self, max: Duration) -> Duration {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let nanos = max.as_nanos().max(1) as u64;
        Duration::from_nanos(z % nanos)
    }
}

/// Freezes this whole process for `pause` ([`Fault::Freeze`]): a helper process is started to
/// wake it (SIGCONT) once `pause` has passed, then the process stops itself (SIGSTOP), as a
/// host that hangs or a debugger that halts it would. Through `sh` and `kill`, which every
/// host a worker process runs on has.
///
/// # Errors
/// [`TransportError::Protocol`] when the helper or the stop cannot be started.
fn freeze_process(pause: Duration) -> Result<(), TransportError> {
    let pid = std::process::id();
    let fail = |e: std::io::Error| TransportError::Protocol(format!("injected freeze: {e}"));
    let mut waker = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("sleep {}; kill -CONT {pid}", pause.as_secs_f64()))
        .spawn()
        .map_err(fail)?;
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .map_err(fail)?;
    // Woken: the helper has done its part (or the stop failed and it is waited for).
    let _ = waker.wait();
    if !stopped.success() {
        return Err(TransportError::Protocol(format!(
            "injected freeze: kill -STOP {pid} {stopped}"
        )));
    }
    Ok(())
}

/// A copy of a message (for [`Fault::Duplicate`]).
fn copy_of(m: &Message) -> Result<Message, TransportError> {
    let data = m
        .tensor
        .host()
        .map_err(|e| TransportError::Protocol(format!("{:?}: {e}", m.key)))?
        .to_vec();
    let tensor = pipe_kernels::Tensor::from_vec(m.tensor.shape(), data)
        .map_err(|e| TransportError::Protocol(format!("{:?}: {e}", m.key)))?;
    Ok(Message {
        key: m.key,
        version: m.version,
        tensor,
    })
}

impl<T> Drop for Faulty<T> {
    /// Says so when the fault never fired (the worker sent fewer data messages than the
    /// fault waits for, or stopped first): a drill whose fault did not happen tested nothing,
    /// and its run ends as an undisturbed one would.
    fn drop(&mut self) {
        if let Some(nth) = self.fault.nth().filter(|&nth| self.sent < nth) {
            eprintln!(
                "fault schedule: worker {}'s {} never fired: it sent {} data messages, not {nth}",
                self.rank, self.fault, self.sent
            );
        }
    }
}

impl<T: Transport> Transport for Faulty<T> {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    fn send(&mut self, message: Message) -> Result<(), TransportError> {
        if message.key.kind == Kind::Control {
            return self.inner()?.send(message);
        }
        self.sent += 1;
        let n = self.sent;
        match self.fault {
            Fault::None => self.inner()?.send(message),
            Fault::Delay { max, .. } => {
                std::thread::sleep(self.next_delay(max));
                self.inner()?.send(message)
            }
            Fault::Reorder { window } => {
                self.held.push(message);
                if self.held.len() >= window.max(1) {
                    self.flush()?;
                }
                Ok(())
            }
            Fault::Duplicate { nth } if n == nth => {
                let twin = copy_of(&message)?;
                self.inner()?.send(message)?;
                self.inner()?.send(twin)
            }
            Fault::Drop { nth } if n == nth => Ok(()),
            Fault::Reset { nth } if n == nth => {
                // Dropped without `close`: peers see the connection end mid-run.
                self.inner = None;
                self.inner().map(|_| ())
            }
            Fault::Panic { nth } if n == nth => {
                panic!("injected panic at data message {n} of worker {}", self.rank)
            }
            Fault::Fail { nth } if n == nth => Err(TransportError::unsent(
                message,
                format!("injected failure at data message {n}"),
            )),
            Fault::Stall { nth, pause } if n == nth => {
                std::thread::sleep(pause);
                self.inner()?.send(message)
            }
            Fault::Exit { nth } if n == nth => {
                eprintln!("injected exit at data message {n} (fault schedule)");
                std::process::abort()
            }
            Fault::Freeze { nth, pause } if n == nth => {
                eprintln!("injected freeze for {pause:?} at data message {n} (fault schedule)");
                freeze_process(pause)?;
                self.inner()?.send(message)
            }
            Fault::Partition { nth, peer, pause } if n == nth => {
                eprintln!(
                    "injected partition from worker {peer} for {pause:?} at data message {n} (fault schedule)"
                );
                self.inner()?.cut_link(peer, pause)?;
                self.inner()?.send(message)
            }
            _ => self.inner()?.send(message),
        }
    }

    fn recv(&mut self, key: &Key) -> Result<Message, TransportError> {
        self.flush()?;
        self.inner()?.recv(key)
    }

    fn copies_payloads(&self) -> bool {
        self.inner.as_ref().is_some_and(Transport::copies_payloads)
    }

    // What the endpoint is, as its run sees it, passes through: a drill's run must take the
    // paths an undisturbed run takes (before, a wrapped in-process endpoint said it copied
    // tensors, so a fault schedule turned on the takeover's logs: 1.5x the wall time of the
    // same run without one, and a takeover no run without a schedule made).
    fn carries_device_tensors(&self) -> bool {
        self.inner
            .as_ref()
            .is_some_and(Transport::carries_device_tensors)
    }

    fn lends_device_buffers(&self, peer: u32) -> bool {
        self.inner
            .as_ref()
            .is_some_and(|t| t.lends_device_buffers(peer))
    }

    fn interrupter(&self) -> Option<crate::Interrupter> {
        self.inner.as_ref().and_then(Transport::interrupter)
    }

    fn link_buffer_bytes(&self) -> Option<u64> {
        self.inner.as_ref().and_then(Transport::link_buffer_bytes)
    }

    fn send_values(&mut self, values: Values<'_>) -> Result<(), TransportError> {
        // Counted as a data message either way; only a message a fault acts on is built.
        let next = self.sent + 1;
        let untouched = match self.fault {
            Fault::None => true,
            // Every message is delayed or held.
            Fault::Delay { .. } | Fault::Reorder { .. } => false,
            other => other.nth().is_none_or(|nth| nth != next),
        };
        if untouched && values.key.kind != Kind::Control && self.held.is_empty() {
            self.sent = next;
            return self.inner()?.send_values(values);
        }
        self.send(Message::of_values(values)?)
    }

    fn recv_with(&mut self, key: &Key, take: &mut ValueSink<'_>) -> Result<usize, TransportError> {
        self.flush()?;
        self.inner()?.recv_with(key, take)
    }

    fn try_recv_with(
        &mut self,
        key: &Key,
        take: &mut ValueSink<'_>,
    ) -> Result<Option<usize>, TransportError> {
        // As try_recv: a poll never waits, so what is held stays held.
        self.inner()?.try_recv_with(key, take)
    }

    fn wait_for(
        &mut self,
        key: &Key,
        notice: &dyn Fn(&Key) -> bool,
    ) -> Result<bool, TransportError> {
        // It waits as a receive does: what is held goes out first.
        self.flush()?;
        self.inner()?.wait_for(key, notice)
    }

    fn try_recv(&mut self, key: &Key) -> Result<Option<Message>, TransportError> {
        // A poll never waits, so what is held cannot block anyone here: keep holding it.
        self.inner()?.try_recv(key)
    }

    fn buffered(&self) -> usize {
        self.inner.as_ref().map_or(0, Transport::buffered)
    }

    fn abort(&mut self) {
        self.held.clear();
        if let Some(t) = self.inner.as_mut() {
            t.abort();
        }
    }

    fn close(&mut self) -> Result<(), TransportError> {
        self.flush()?;
        self.inner()?.close()
    }

    fn cut_link(&mut self, peer: u32, pause: Duration) -> Result<(), TransportError> {
        self.inner()?.cut_link(peer, pause)
    }

    /// The faults are this endpoint's: a regrouped mesh carries none.
    fn regroup_address(&mut self) -> Option<Result<String, TransportError>> {
        self.inner.as_mut()?.regroup_address()
    }

    fn regroup(
        &mut self,
        lost: u32,
        host: Option<u32>,
    ) -> Result<crate::Regrouped, TransportError> {
        self.inner()?.regroup(lost, host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fault_reads_back_as_it_prints() {
        let faults = [
            Fault::None,
            Fault::Delay {
                max: Duration::from_millis(4),
                seed: 7,
            },
            Fault::Reorder { window: 3 },
            Fault::Duplicate { nth: 2 },
            Fault::Drop { nth: 3 },
            Fault::Reset { nth: 4 },
            Fault::Panic { nth: 5 },
            Fault::Fail { nth: 6 },
            Fault::Stall {
                nth: 7,
                pause: Duration::from_millis(1500),
            },
            Fault::Exit { nth: 8 },
            Fault::Freeze {
                nth: 9,
                pause: Duration::from_millis(250),
            },
            Fault::Partition {
                nth: 10,
                peer: 3,
                pause: Duration::from_secs(7),
            },
        ];
        for f in faults {
            assert_eq!(f.to_string().parse::<Fault>(), Ok(f), "{f}");
        }
    }

    #[test]
    fn a_schedule_names_each_workers_fault_per_attempt() {
        let s = parse_schedule("2:exit@400, 1:stall@50:3/1,2:panic@9/1").unwrap();
        assert_eq!(s.of(2, 0), Fault::Exit { nth: 400 });
        assert_eq!(
            s.of(1, 1),
            Fault::Stall {
                nth: 50,
                pause: Duration::from_secs(3)
            }
        );
        assert_eq!(s.of(2, 1), Fault::Panic { nth: 9 });
        assert_eq!(s.of(1, 0), Fault::None);
        assert_eq!(s.max_rank(), Some(2));
        assert_eq!(parse_schedule(&s.to_string()), Ok(s.clone()));
        for (bad, why) in [
            ("x:exit@1", "not a rank"),
            ("1:exit@1/x", "not an attempt"),
            ("1", "RANK:FAULT"),
            ("1:stall@2", "unknown fault"),
            ("1:stall@2:1e9", "give 0 to 86400"),
            ("1:stall@2:1e308", "1e308 seconds: give 0 to 86400"),
            ("1:reorder:0", "window"),
        ] {
            let err = parse_schedule(bad).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn a_drawn_schedule_is_seeded_one_fault_per_start_on_the_runs_workers() {
        let plan = parse_plan("random:7:12").unwrap();
        let stall = Duration::from_secs(2);
        let s = plan.schedule(8, 40, stall);
        assert_eq!(s, plan.schedule(8, 40, stall));
        assert_ne!(s, parse_plan("random:8:12").unwrap().schedule(8, 40, stall));
        assert_eq!(s.0.len(), 12);
        for (i, f) in s.0.iter().enumerate() {
            assert_eq!(f.attempt, i as u32);
            assert!(f.rank < 8);
            if let Fault::Partition { peer, .. } = f.fault {
                assert!(peer < 8 && peer != f.rank, "{s}");
            }
        }
        let kinds: std::collections::HashSet<_> =
            s.0.iter()
                .map(|f| std::mem::discriminant(&f.fault))
                .collect();
        assert!(kinds.len() >= 4, "{s}");
        assert_eq!(parse_plan(&s.to_string()), Ok(FaultPlan::Listed(s)));
        for bad in [
            "random:x:3",
            "random:1:0",
            "random:1",
            "random:1:1001",
            "random:1:5,1:exit@3",
        ] {
            assert!(parse_plan(bad).is_err(), "{bad}");
        }
        for empty in ["", ",", " , "] {
            let err = parse_plan(empty).unwrap_err();
            assert!(err.contains("lists no fault"), "{empty:?}: {err}");
        }
        let mixed = parse_plan("random:1:5,1:exit@3").unwrap_err();
        assert!(mixed.contains("stands alone"), "{mixed}");
    }
}
