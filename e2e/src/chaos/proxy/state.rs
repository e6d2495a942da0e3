//! What a running proxy shares between its connections: the switch, the
//! counters, the random source, and the stalls and hidden Pods in force.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::faults::{Counters, ProxyConfig};
use crate::chaos::rng::Rng;

/// Traffic held back until `until`: requests whose path contains
/// `fragment` (unless `watches_only`), and the events of such watches.
pub(super) struct Stall {
    pub(super) fragment: String,
    pub(super) watches_only: bool,
    pub(super) until: tokio::time::Instant,
}

/// Pods whose name contains `fragment` left out of Pod lists and watch
/// events until `until`.
pub(super) struct Hide {
    pub(super) fragment: String,
    pub(super) until: tokio::time::Instant,
}

pub(super) struct State {
    pub(super) upstream: kube::Client,
    pub(super) config: ProxyConfig,
    pub(super) enabled: AtomicBool,
    pub(super) counters: Counters,
    pub(super) rng: Mutex<Rng>,
    pub(super) stalls: Mutex<Vec<Stall>>,
    pub(super) hidden: Mutex<Vec<Hide>>,
}

impl State {
    pub(super) fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    pub(super) fn with_rng<T>(&self, f: impl FnOnce(&mut Rng) -> T) -> T {
        let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut rng)
    }

    /// Until when traffic on `path` is held back: a request (`event: false`)
    /// or an event of a watch (`event: true`).
    fn stalled_until(&self, path: &str, event: bool) -> Option<tokio::time::Instant> {
        let stalls = self.stalls.lock().unwrap_or_else(|p| p.into_inner());
        stalls
            .iter()
            .filter(|s| path.contains(&s.fragment) && (event || !s.watches_only))
            .map(|s| s.until)
            .max()
    }

    /// Whether a Pod of this name is hidden from lists and watches now.
    pub(super) fn hidden(&self, name: &str) -> bool {
        let now = tokio::time::Instant::now();
        let hidden = self.hidden.lock().unwrap_or_else(|p| p.into_inner());
        hidden
            .iter()
            .any(|h| h.until > now && name.contains(&h.fragment))
    }

    pub(super) fn hiding(&self) -> bool {
        let now = tokio::time::Instant::now();
        let hidden = self.hidden.lock().unwrap_or_else(|p| p.into_inner());
        hidden.iter().any(|h| h.until > now)
    }

    /// Stalls may be shortened while traffic waits: look again every 50 ms.
    pub(super) async fn wait_stall(&self, path: &str, event: bool) {
        loop {
            let now = tokio::time::Instant::now();
            match self.stalled_until(path, event) {
                Some(until) if until > now => {
                    tokio::time::sleep((until - now).min(Duration::from_millis(50))).await;
                }
                _ => return,
            }
        }
    }
}
