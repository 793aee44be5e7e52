//! Where a plan's workers run: hosts that each take some workers, joined by a network whose
//! link ([`crate::sim::Link`]) is slower and dearer to the processors than the links inside a
//! host (shared memory, or threads of one process).
//!
//! Workers are placed in pipeline order: the first stage's replicas, then the second's, and so
//! on, filling the hosts in the order they are listed ([`Hosts::filled`]); or, where a cluster
//! file already fixes which rank runs on which host, as it does ([`Hosts::of_ranks`]). The
//! placement is chosen with the
//! partition, not after it: the partition search knows, for every stage it considers, which
//! workers it would occupy, so it knows which of its links (the activation in, the activation
//! out, the replicas' ring) cross a host boundary and charges each its own link. Cuts therefore
//! fall where a host boundary costs least: a pipeline boundary carrying a small activation
//! rather than a ring over a stage's gradients, or the other way round when activations are
//! the heavier. For a chain of stages, pipeline order keeps every stage's neighbours as close
//! as its host allows, so the boundary crossings are the fewest a host count permits.

use crate::error::{Result, ScheduleError};
use crate::sim::Link;

/// Largest number of hosts a plan places workers on.
pub const MAX_HOSTS: usize = 4096;

/// The hosts a plan places its workers on, and the link between them.
#[derive(Clone, Debug, PartialEq)]
pub struct Hosts {
    /// Host names.
    pub names: Vec<String>,
    /// The host (an index into `names`) of each worker position in pipeline order: at least
    /// as many as the plan has workers.
    pub of_worker: Vec<u32>,
    /// The network between hosts, with its transport's processor costs.
    pub between: Link,
}

/// The most characters a host name may have (DNS's limit).
pub const MAX_HOST_NAME: usize = 255;

/// Checks one host name as every reader of hosts does (`--hosts`, a cluster file's, a plan
/// file's): 1 to [`MAX_HOST_NAME`] characters, so that a plan `pipe plan` writes is one
/// `pipe train --plan` runs.
///
/// # Errors
/// The message naming the problem.
pub fn check_host_name(name: &str) -> std::result::Result<(), String> {
    if name.is_empty() || name.len() > MAX_HOST_NAME {
        return Err(format!(
            "a host name must have 1 to {MAX_HOST_NAME} characters, got {}",
            name.len()
        ));
    }
    Ok(())
}

impl Hosts {
    /// Hosts that each take a number of workers, filled in turn in pipeline order.
    pub fn filled(hosts: &[(String, u32)], between: Link) -> Self {
        let mut of_worker = Vec::new();
        for (h, (_, slots)) in hosts.iter().enumerate() {
            let h = u32::try_from(h).unwrap_or(u32::MAX);
            of_worker.extend(std::iter::repeat_n(h, *slots as usize));
        }
        Hosts {
            names: hosts.iter().map(|h| h.0.clone()).collect(),
            of_worker,
            between,
        }
    }

    /// Hosts named per worker, in rank order (a cluster file's ranks): workers with one name
    /// share a host, in whatever order the ranks list them.
    pub fn of_ranks(ranks: &[String], between: Link) -> Self {
        let mut names: Vec<String> = Vec::new();
        let of_worker = ranks
            .iter()
            .map(|r| {
                let at = names.iter().position(|n| n == r).unwrap_or_else(|| {
                    names.push(r.clone());
                    names.len() - 1
                });
                u32::try_from(at).unwrap_or(u32::MAX)
            })
            .collect();
        Hosts {
            names,
            of_worker,
            between,
        }
    }

    /// Checks the hosts and the link for a plan of `workers` workers: at least one host, at
    /// most [`MAX_HOSTS`], each named once, a host for every worker, and a valid link.
    ///
    /// # Errors
    /// [`ScheduleError::Plan`] naming the problem.
    pub fn check(&self, workers: u32) -> Result<()> {
        let bad = |m: String| Err(ScheduleError::Plan(m));
        if self.names.is_empty() {
            return bad("a placement needs at least one host".into());
        }
        if self.names.len() > MAX_HOSTS {
            return bad(format!(
                "{} hosts is more than {MAX_HOSTS}",
                self.names.len()
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for name in &self.names {
            check_host_name(name).map_err(ScheduleError::Plan)?;
            if !seen.insert(name.as_str()) {
                return bad(format!("host '{name}' is named twice"));
            }
        }
        if self.of_worker.len() < workers as usize {
            return bad(format!(
                "the hosts take {} workers in all, fewer than the {workers} planned",
                self.of_worker.len()
            ));
        }
        if self
            .of_worker
            .iter()
            .any(|&h| h as usize >= self.names.len())
        {
            return bad("a worker is placed on a host that is not listed".into());
        }
        self.between
            .check("the link between hosts")
            .map_err(|e| ScheduleError::Plan(e.to_string()))
    }

    /// The host of each of the first `workers` worker positions.
    pub fn of_positions(&self, workers: usize) -> Vec<u32> {
        self.of_worker.iter().copied().take(workers).collect()
    }

    /// The name of host `h`.
    pub fn name(&self, h: u32) -> &str {
        self.names.get(h as usize).map_or("?", String::as_str)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn link() -> Link {
        Link {
            bandwidth: 1e9,
            latency: 0.0,
            message_cpu: 0.0,
            byte_cpu: 0.0,
        }
    }

    #[test]
    fn workers_fill_the_hosts_in_order() {
        let h = Hosts::filled(&[("a".into(), 2), ("b".into(), 3)], link());
        assert_eq!(h.of_positions(4), vec![0, 0, 1, 1]);
        assert_eq!(h.of_positions(5), vec![0, 0, 1, 1, 1]);
        h.check(5).unwrap();
        assert!(h.check(6).unwrap_err().to_string().contains("fewer"));
    }

    #[test]
    fn ranks_named_alike_share_a_host() {
        let ranks: Vec<String> = ["x", "y", "x", "y"].map(String::from).to_vec();
        let h = Hosts::of_ranks(&ranks, link());
        assert_eq!(h.of_positions(4), vec![0, 1, 0, 1]);
        assert_eq!((h.name(0), h.name(1)), ("x", "y"));
    }

    #[test]
    fn bad_host_lists_are_refused() {
        let h = |hosts: Vec<(&str, u32)>| {
            let hosts: Vec<(String, u32)> =
                hosts.into_iter().map(|(n, s)| (n.to_string(), s)).collect();
            Hosts::filled(&hosts, link())
        };
        assert!(h(vec![]).check(1).is_err());
        assert!(h(vec![("a", 1), ("a", 1)]).check(2).is_err());
        assert!(h(vec![("a", 0), ("b", 1)]).check(2).is_err());
        let mut slow = h(vec![("a", 1)]);
        slow.between.bandwidth = 0.0;
        assert!(slow.check(1).is_err());
    }
}
