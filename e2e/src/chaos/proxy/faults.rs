//! What the proxy injects and how often ([`ProxyConfig`]), the kinds of
//! fault ([`Fault`]), and the count of each ([`Counters`], [`FaultCounts`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// What the proxy injects.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Fraction of faultable writes that get one of the write faults.
    pub write_fault_rate: f64,
    /// Fraction of non-watch responses that are held back.
    pub delay_rate: f64,
    /// Longest hold-back of a delayed response.
    pub max_delay: Duration,
    /// A watch stream is cut after a time uniform in this range.
    pub watch_cut_after: (Duration, Duration),
    /// Fraction of watches from a resourceVersion answered `410 Gone` at once.
    pub watch_gone_rate: f64,
    pub seed: u64,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            write_fault_rate: 0.15,
            delay_rate: 0.05,
            max_delay: Duration::from_millis(800),
            watch_cut_after: (Duration::from_secs(2), Duration::from_secs(15)),
            watch_gone_rate: 0.1,
            seed: 1,
        }
    }
}

/// The kinds of injected fault, each counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// 500 InternalError, not forwarded.
    Error500,
    /// 429 TooManyRequests with `Retry-After: 1`, not forwarded.
    Error429,
    /// 409 Conflict, not forwarded.
    Error409,
    /// Forwarded and applied; the client got 504 instead of the answer.
    AppliedThen504,
    /// Forwarded and applied; the connection was dropped without an answer.
    AppliedThenDropped,
    /// The response was held back.
    Delayed,
    /// A watch stream was aborted mid-flight.
    WatchCut,
    /// A watch was answered, or ended, with an ERROR event `410 Gone`.
    WatchGone,
}

pub(super) const WRITE_FAULTS: [Fault; 5] = [
    Fault::Error500,
    Fault::Error429,
    Fault::Error409,
    Fault::AppliedThen504,
    Fault::AppliedThenDropped,
];

/// Counters of what the proxy did.
#[derive(Debug, Default)]
pub struct Counters {
    pub requests: AtomicU64,
    pub writes: AtomicU64,
    pub error_500: AtomicU64,
    pub error_429: AtomicU64,
    pub error_409: AtomicU64,
    pub applied_then_504: AtomicU64,
    pub applied_then_dropped: AtomicU64,
    pub delayed: AtomicU64,
    pub watch_cut: AtomicU64,
    pub watch_gone: AtomicU64,
    pub upstream_errors: AtomicU64,
}

/// A snapshot of [`Counters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub requests: u64,
    pub writes: u64,
    pub error_500: u64,
    pub error_429: u64,
    pub error_409: u64,
    pub applied_then_504: u64,
    pub applied_then_dropped: u64,
    pub delayed: u64,
    pub watch_cut: u64,
    pub watch_gone: u64,
    pub upstream_errors: u64,
}

impl FaultCounts {
    /// Every injected fault (upstream errors are not injected and not counted).
    pub fn total(&self) -> u64 {
        self.error_500
            + self.error_429
            + self.error_409
            + self.applied_then_504
            + self.applied_then_dropped
            + self.delayed
            + self.watch_cut
            + self.watch_gone
    }
}

impl std::fmt::Display for FaultCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "requests={} writes={} err500={} err429={} err409={} applied_504={} applied_dropped={} delayed={} watch_cut={} watch_gone={} upstream_errors={}",
            self.requests,
            self.writes,
            self.error_500,
            self.error_429,
            self.error_409,
            self.applied_then_504,
            self.applied_then_dropped,
            self.delayed,
            self.watch_cut,
            self.watch_gone,
            self.upstream_errors
        )
    }
}

impl Counters {
    pub(super) fn count(&self, fault: Fault) {
        let c = match fault {
            Fault::Error500 => &self.error_500,
            Fault::Error429 => &self.error_429,
            Fault::Error409 => &self.error_409,
            Fault::AppliedThen504 => &self.applied_then_504,
            Fault::AppliedThenDropped => &self.applied_then_dropped,
            Fault::Delayed => &self.delayed,
            Fault::WatchCut => &self.watch_cut,
            Fault::WatchGone => &self.watch_gone,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> FaultCounts {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        FaultCounts {
            requests: l(&self.requests),
            writes: l(&self.writes),
            error_500: l(&self.error_500),
            error_429: l(&self.error_429),
            error_409: l(&self.error_409),
            applied_then_504: l(&self.applied_then_504),
            applied_then_dropped: l(&self.applied_then_dropped),
            delayed: l(&self.delayed),
            watch_cut: l(&self.watch_cut),
            watch_gone: l(&self.watch_gone),
            upstream_errors: l(&self.upstream_errors),
        }
    }
}
