//! Crash and pause points for the fault tests: `AGENTRUN_FAILPOINT` holds
//! one or more `<point>:<n>[:stop]`, comma-separated. At the n-th time it
//! passes `<point>` the process aborts (no cleanup, like SIGKILL), or with
//! `:stop` sends itself SIGSTOP (like a paused node; the test sends SIGCONT).
//! Unset in production; reading it costs one atomic load.
//!
//! Compiled in only with the `failpoints` feature, which the e2e crate turns
//! on for the binaries its tests start; without it `hit` does nothing and a
//! set `AGENTRUN_FAILPOINT` is only warned about at startup.
//!
//! Points: `before-create-pod` (a step Pod is about to be created, its proof
//! checked), `after-create-pod` (a step Pod was just created),
//! `after-checkpoint` (a status write that commits a step outcome succeeded,
//! before any finalizer is released), `after-status-write` (any status write),
//! `after-record` (a finished run's record was stored, its status not yet written),
//! `after-proof-read` (a read that proves a run current before a Pod create
//! returned: the fence of a decision that writes no status, or the read again
//! before a create once the proof is older than a second), `after-notify-send` (a notification was sent, its
//! record not yet written).

#[cfg(feature = "failpoints")]
use std::sync::OnceLock;
#[cfg(feature = "failpoints")]
use std::sync::atomic::{AtomicU64, Ordering};

#[cfg(feature = "failpoints")]
struct Failpoint {
    point: String,
    after: u64,
    stop: bool,
    hits: AtomicU64,
}

#[cfg(feature = "failpoints")]
fn configured() -> &'static [Failpoint] {
    static FAILPOINTS: OnceLock<Vec<Failpoint>> = OnceLock::new();
    FAILPOINTS.get_or_init(|| {
        let spec = std::env::var("AGENTRUN_FAILPOINT").unwrap_or_default();
        spec.split(',')
            .filter(|s| !s.trim().is_empty())
            .filter_map(|one| {
                let mut parts = one.trim().split(':');
                let point = parts.next()?.to_owned();
                let after = match parts.next() {
                    Some(n) => n.parse().ok()?,
                    None => 1,
                };
                let stop = parts.next() == Some("stop");
                Some(Failpoint {
                    point,
                    after,
                    stop,
                    hits: AtomicU64::new(0),
                })
            })
            .collect()
    })
}

/// Aborts (or stops) the process if `point` is a configured failpoint and
/// this is its n-th hit.
#[cfg(feature = "failpoints")]
pub(crate) fn hit(point: &str) {
    for fp in configured().iter().filter(|fp| fp.point == point) {
        let n = fp.hits.fetch_add(1, Ordering::SeqCst) + 1;
        if n != fp.after {
            continue;
        }
        if fp.stop {
            eprintln!("failpoint {point}:{n} reached: stopping (SIGSTOP)");
            // The whole process stops, as a paused node would; the test
            // resumes it with SIGCONT.
            let _ = std::process::Command::new("kill")
                .args(["-STOP", &std::process::id().to_string()])
                .status();
        } else {
            eprintln!("failpoint {point}:{n} reached: aborting");
            std::process::abort();
        }
    }
}

/// This build has no failpoints.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn hit(_point: &str) {}

/// Warns when `AGENTRUN_FAILPOINT` is set on a build that cannot honour it.
pub(super) fn warn_if_unsupported() {
    if cfg!(not(feature = "failpoints")) && std::env::var_os("AGENTRUN_FAILPOINT").is_some() {
        tracing::warn!(
            "AGENTRUN_FAILPOINT is set, but this build has no failpoints (feature `failpoints`)"
        );
    }
}
