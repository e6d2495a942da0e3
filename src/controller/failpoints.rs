//! Crash points for the fault tests: `AGENTRUN_FAILPOINT=<point>:<n>` makes
//! the process abort (no cleanup, like SIGKILL) right after the n-th time it
//! passes `<point>`. Unset in production; reading it costs one atomic load.
//!
//! Compiled in only with the `failpoints` feature, which the e2e crate turns
//! on for the binaries its tests start; without it `hit` does nothing and a
//! set `AGENTRUN_FAILPOINT` is only warned about at startup.
//!
//! Points: `after-create-pod` (a step Pod was just created),
//! `after-checkpoint` (a status write that commits a step outcome succeeded,
//! before any finalizer is released), `after-status-write` (any status write).

#[cfg(feature = "failpoints")]
use std::sync::OnceLock;
#[cfg(feature = "failpoints")]
use std::sync::atomic::{AtomicU64, Ordering};

#[cfg(feature = "failpoints")]
struct Failpoint {
    point: String,
    after: u64,
    hits: AtomicU64,
}

#[cfg(feature = "failpoints")]
fn configured() -> Option<&'static Failpoint> {
    static FAILPOINT: OnceLock<Option<Failpoint>> = OnceLock::new();
    FAILPOINT
        .get_or_init(|| {
            let spec = std::env::var("AGENTRUN_FAILPOINT").ok()?;
            let (point, after) = match spec.split_once(':') {
                Some((p, n)) => (p.to_owned(), n.parse().ok()?),
                None => (spec, 1),
            };
            Some(Failpoint {
                point,
                after,
                hits: AtomicU64::new(0),
            })
        })
        .as_ref()
}

/// Aborts the process if `point` is the configured failpoint and this is its n-th hit.
#[cfg(feature = "failpoints")]
pub(super) fn hit(point: &str) {
    let Some(fp) = configured() else { return };
    if fp.point != point {
        return;
    }
    let n = fp.hits.fetch_add(1, Ordering::SeqCst) + 1;
    if n == fp.after {
        eprintln!("failpoint {point}:{n} reached: aborting");
        std::process::abort();
    }
}

/// This build has no failpoints.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(super) fn hit(_point: &str) {}

/// Warns when `AGENTRUN_FAILPOINT` is set on a build that cannot honour it.
pub(super) fn warn_if_unsupported() {
    if cfg!(not(feature = "failpoints")) && std::env::var_os("AGENTRUN_FAILPOINT").is_some() {
        tracing::warn!(
            "AGENTRUN_FAILPOINT is set, but this build has no failpoints (feature `failpoints`)"
        );
    }
}
