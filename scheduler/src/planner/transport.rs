//! What a link of each transport costs, as `pipe bench transport` measures it on a machine
//! (the figures pipe caches, `pipe_stages::cache`): the one-way time of a small message, the
//! processor time each end spends per message and per byte, and the rate of large messages.
//! Each figure is the median over measurement rounds, with the least and the most kept, since
//! these costs move between runs on a shared machine.
//!
//! The partitioner charges a stage's processor time for its messages as compute (a worker's
//! core does it between its passes; [`super::PlanOptions::message_cpu`] and `byte_cpu`), and
//! the simulator charges the same per message end.

use serde::{Deserialize, Serialize};

/// A figure measured over rounds: its median, least and most.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// The median over rounds.
    pub median: f64,
    /// The least round.
    pub min: f64,
    /// The most.
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (all zero when there are none; NaNs are left out).
    pub fn of(values: &[f64]) -> Self {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return Spread {
                median: 0.0,
                min: 0.0,
                max: 0.0,
            };
        }
        v.sort_by(f64::total_cmp);
        let mid = v.len() / 2;
        let median = if v.len() % 2 == 1 {
            v[mid]
        } else {
            0.5 * (v[mid - 1] + v[mid])
        };
        Spread {
            median,
            min: v[0],
            max: v[v.len() - 1],
        }
    }

    /// The spread as `median (min-max)`, each times `scale`, the median followed by `unit`.
    pub fn describe(&self, scale: f64, unit: &str) -> String {
        format!(
            "{:.3}{unit} ({:.3}-{:.3})",
            self.median * scale,
            self.min * scale,
            self.max * scale
        )
    }
}

/// One transport's link costs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransportCost {
    /// The transport (`inproc`, `shm`, `quic`).
    pub transport: String,
    /// Rounds measured.
    pub rounds: u32,
    /// One-way seconds of a small message.
    pub latency_s: Spread,
    /// Processor seconds per message at each end.
    pub message_cpu_s: Spread,
    /// Processor seconds per byte at each end, beyond a small message's.
    pub byte_cpu_s: Spread,
    /// Bytes per second of large messages beyond a small one's time (`None` where they cost
    /// no more, as in process).
    pub bandwidth: Option<Spread>,
}

impl TransportCost {
    /// The link these costs describe (medians): its rate (unbounded where large messages
    /// cost no more), one-way time, and processor time per message end and per byte.
    pub fn link(&self) -> crate::sim::Link {
        crate::sim::Link {
            bandwidth: self.bandwidth.map_or(f64::INFINITY, |b| b.median),
            latency: self.latency_s.median,
            message_cpu: self.message_cpu_s.median,
            byte_cpu: self.byte_cpu_s.median,
        }
    }

    /// Checks that every figure is finite, not negative, and within the bounds of any figure
    /// pipe plans with ([`crate::limits::check_figure`]: a time of 11 days; a rate, counted
    /// as bytes, of 1 PiB per second).
    ///
    /// # Errors
    /// A message naming the transport and the figure.
    pub fn check(&self) -> Result<(), String> {
        let mut figures = vec![
            ("latency_s", self.latency_s),
            ("message_cpu_s", self.message_cpu_s),
            ("byte_cpu_s", self.byte_cpu_s),
        ];
        figures.extend(self.bandwidth.map(|b| ("bandwidth", b)));
        for (name, s) in figures {
            for v in [s.median, s.min, s.max] {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(format!(
                        "transport {}: {name} must be a finite number >= 0, got {v}",
                        self.transport
                    ));
                }
                let checked = if name == "bandwidth" {
                    crate::limits::check_bandwidth(name, v)
                } else {
                    crate::limits::check_figure(name, v)
                };
                checked.map_err(|why| format!("transport {}: {why}", self.transport))?;
            }
            // A spread is measured rounds' least and greatest, its median between them.
            if !(s.min <= s.median && s.median <= s.max) {
                return Err(format!(
                    "transport {}: {name}'s median {} is not between its min {} and max {}",
                    self.transport, s.median, s.min, s.max
                ));
            }
        }
        Ok(())
    }
}

/// The costs of every transport measured on one machine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransportCosts {
    /// One per transport.
    pub transports: Vec<TransportCost>,
}

impl TransportCosts {
    /// The costs of `transport`.
    pub fn get(&self, transport: &str) -> Option<&TransportCost> {
        self.transports.iter().find(|t| t.transport == transport)
    }

    /// Checks every transport's figures, and that no transport is given twice (which of two
    /// would be charged could only be guessed).
    ///
    /// # Errors
    /// The first bad figure, or the transport named twice.
    pub fn check(&self) -> Result<(), String> {
        for (i, t) in self.transports.iter().enumerate() {
            if self.transports[..i]
                .iter()
                .any(|u| u.transport == t.transport)
            {
                return Err(format!("transport {} is given twice", t.transport));
            }
            t.check()?;
        }
        Ok(())
    }

    /// A transport cost file's text (JSON, as `pipe bench transport --costs-out` writes),
    /// parsed and checked ([`TransportCosts::check`]).
    ///
    /// # Errors
    /// The parser's message, or the first figure out of bounds.
    pub fn parse(text: &str) -> Result<Self, String> {
        let costs: TransportCosts = serde_json::from_str(text).map_err(|e| e.to_string())?;
        costs.check()?;
        Ok(costs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spread_is_the_median_least_and_most() {
        let s = Spread::of(&[3.0, 1.0, 2.0, f64::NAN, 10.0]);
        assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 10.0));
        assert_eq!(Spread::of(&[4.0]).median, 4.0);
        assert_eq!(Spread::of(&[]).max, 0.0);
    }

    #[test]
    fn a_transport_given_twice_is_refused() {
        let one = |name: &str| TransportCost {
            transport: name.into(),
            rounds: 1,
            latency_s: Spread::of(&[1e-5]),
            message_cpu_s: Spread::of(&[1e-6]),
            byte_cpu_s: Spread::of(&[1e-10]),
            bandwidth: None,
        };
        let text = |names: &[&str]| {
            let transports = names.iter().map(|n| one(n)).collect();
            serde_json::to_string(&TransportCosts { transports }).unwrap_or_default()
        };
        assert!(TransportCosts::parse(&text(&["shm", "quic"])).is_ok());
        let twice = TransportCosts::parse(&text(&["shm", "quic", "shm"]));
        assert_eq!(twice, Err("transport shm is given twice".to_string()));
    }
}
