//! The figures of one measured batch, whichever controller ran it: what
//! every batch measures the same way ([`Window`]), the operator's own
//! reconcile figures on top, and how a batch prints and reports itself.

use std::collections::BTreeMap;

use agentrun_operator::api::RunPhase;
use serde_json::{Value, json};

use crate::metrics::{Requests, server_latency};
use crate::watch::{Seen, handoffs};

#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub runs: usize,
    pub steps: usize,
    pub repeat: usize,
    pub wall_s: f64,
    pub steps_per_s: f64,
    pub writes_per_step: f64,
    pub writes: BTreeMap<String, f64>,
    /// Mean apiserver latency (ms) per write kind.
    pub server_ms: BTreeMap<String, f64>,
    pub conflicts_409: f64,
    pub handoff_p50_ms: f64,
    pub handoff_p99_ms: f64,
    pub handoff_max_ms: f64,
    pub handoffs: usize,
    /// CPU ms per step: operator, simkubelet, kube-apiserver, etcd.
    pub cpu_ms_per_step: BTreeMap<&'static str, f64>,
    pub rss_idle_kib: u64,
    pub rss_end_kib: u64,
    pub hwm_kib: u64,
    pub reconciles: f64,
    pub reconcile_mean_ms: f64,
    pub status_writes: f64,
    pub failed_runs: usize,
}

/// What every batch measures the same way, whichever controller ran it;
/// the operator's own reconcile figures are left at zero.
pub struct Window<'a> {
    pub runs: usize,
    pub steps: usize,
    pub repeat: usize,
    pub wall_s: f64,
    pub writes: (BTreeMap<String, f64>, f64),
    pub before: &'a Requests,
    pub after: &'a Requests,
    pub seen: &'a Seen,
    pub cpu_ms_per_step: BTreeMap<&'static str, f64>,
    pub rss_idle_kib: u64,
    pub rss_end_kib: u64,
    pub hwm_kib: u64,
}

impl From<Window<'_>> for Batch {
    fn from(w: Window<'_>) -> Batch {
        let total_steps = (w.runs * w.steps) as f64;
        let (writes, conflicts_409) = w.writes;
        let h = handoffs(w.seen, w.steps);
        Batch {
            runs: w.runs,
            steps: w.steps,
            repeat: w.repeat,
            wall_s: w.wall_s,
            steps_per_s: total_steps / w.wall_s,
            writes_per_step: writes.values().sum::<f64>() / total_steps,
            writes,
            server_ms: server_latency(w.before, w.after),
            conflicts_409,
            handoff_p50_ms: percentile(&h, 50.0),
            handoff_p99_ms: percentile(&h, 99.0),
            handoff_max_ms: h.last().copied().unwrap_or(f64::NAN),
            handoffs: h.len(),
            cpu_ms_per_step: w.cpu_ms_per_step,
            rss_idle_kib: w.rss_idle_kib,
            rss_end_kib: w.rss_end_kib,
            hwm_kib: w.hwm_kib,
            reconciles: 0.0,
            reconcile_mean_ms: 0.0,
            status_writes: 0.0,
            failed_runs: w
                .seen
                .finished
                .values()
                .filter(|(_, p)| *p != RunPhase::Succeeded)
                .count(),
        }
    }
}

impl Batch {
    pub fn json(&self) -> Value {
        json!({
            "runs": self.runs,
            "steps": self.steps,
            "repeat": self.repeat,
            "wallSeconds": self.wall_s,
            "writes": self.writes,
            "writesPerStep": self.writes_per_step,
            "conflicts409": self.conflicts_409,
            "handoffP50Ms": self.handoff_p50_ms,
            "handoffP99Ms": self.handoff_p99_ms,
            "cpuMsPerStep": self.cpu_ms_per_step,
            "rssIdleKiB": self.rss_idle_kib,
            "rssPeakKiB": self.hwm_kib,
            "failedRuns": self.failed_runs,
        })
    }

    pub fn line(&self) -> String {
        let writes: Vec<String> = self
            .writes
            .iter()
            .map(|(k, v)| format!("{k}={:.2}", v / (self.runs * self.steps) as f64))
            .collect();
        format!(
            "batch runs={} steps={} repeat={}: {:.1} s, {:.1} steps/s, {:.2} writes/step [{}] (409s {}), \
             hand-off p50 {:.1} ms p99 {:.1} ms max {:.1} ms (n={}), RSS idle {} KiB end {} KiB peak {} KiB, \
             reconciles {} (mean {:.2} ms), status writes {}, failed runs {}; apiserver mean ms [{}]; CPU ms/step [{}]",
            self.runs,
            self.steps,
            self.repeat,
            self.wall_s,
            self.steps_per_s,
            self.writes_per_step,
            writes.join(" "),
            self.conflicts_409,
            self.handoff_p50_ms,
            self.handoff_p99_ms,
            self.handoff_max_ms,
            self.handoffs,
            self.rss_idle_kib,
            self.rss_end_kib,
            self.hwm_kib,
            self.reconciles,
            self.reconcile_mean_ms,
            self.status_writes,
            self.failed_runs,
            self.server_ms
                .iter()
                .map(|(k, v)| format!("{k}={v:.1}"))
                .collect::<Vec<_>>()
                .join(" "),
            self.cpu_ms_per_step
                .iter()
                .map(|(k, v)| format!("{k}={v:.2}"))
                .collect::<Vec<_>>()
                .join(" "),
        )
    }
}

/// Nearest-rank percentile of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}
