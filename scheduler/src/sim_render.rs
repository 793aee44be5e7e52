//! The simulator's report as text (`pipe simulate`).

use crate::sim::SimReport;
use crate::spec::Resolved;
use crate::units::{bytes, secs};

/// Replica counts as the flag takes them: one value when every stage has it, else the list.
fn replica_list(counts: &[u32]) -> String {
    match counts {
        [first, rest @ ..] if rest.iter().all(|r| r == first) => first.to_string(),
        _ => counts
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(","),
    }
}

impl SimReport {
    /// The report as `pipe simulate` prints it: a headline for the run `res` on `cores`
    /// shared cores (none: one each), and one row per worker.
    pub fn render(&self, res: &Resolved, cores: Option<u32>) -> String {
        let r = self;
        let workers = res.layout.workers();
        let shared = match cores {
            Some(c) if c < workers => {
                format!(" on {c} shared core(s) (compute columns are wall time)")
            }
            _ => String::new(),
        };
        let mut out = format!(
            "{} | {} stages, replicas {}, {} chunk(s) | M = {} per replica, {} microbatches | {} \
             workers{shared}\n",
            res.policy,
            res.layout.positions(),
            replica_list(res.layout.replica_counts()),
            res.layout.chunks(),
            res.microbatches_per_update,
            res.total,
            workers
        );
        out.push_str(&format!(
            "makespan {}  throughput {:.6} microbatches/s  bubble {:.2}%\n",
            secs(r.makespan),
            r.throughput,
            100.0 * r.bubble_fraction
        ));
        out.push_str(&format!(
            "{:<6} {:>9} {:>12} {:>12} {:>12} {:>7} {:>8} {:>11} {:>12}\n",
            "worker",
            "stages",
            "compute",
            "comm",
            "idle",
            "busy",
            "versions",
            "activations",
            "peak memory"
        ));
        for (w, wr) in r.workers.iter().enumerate() {
            let stages: Vec<String> = res
                .layout
                .stages_of(w as u32)
                .map(|s| s.to_string())
                .collect();
            let busy = if r.makespan > 0.0 {
                100.0 * (wr.compute + wr.communication) / r.makespan
            } else {
                0.0
            };
            out.push_str(&format!(
                "w{:<5} {:>9} {:>12} {:>12} {:>12} {:>6.1}% {:>8} {:>11} {:>12}\n",
                w,
                stages.join(","),
                secs(wr.compute),
                secs(wr.communication),
                secs(wr.idle),
                busy,
                wr.peak_versions,
                wr.peak_activations,
                bytes(wr.memory.total)
            ));
        }
        out
    }
}
