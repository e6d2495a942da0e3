//! Trace and span ids derived from the run's UID (pure): one trace per run,
//! the same ids after any number of operator restarts, so spans emitted by
//! different processes, and by the step Pods, land in one tree.
//!
//! ```text
//!   trace  = sha256("agentrun.dev/trace\0"   uid)[..16]
//!   run    = sha256("agentrun.dev/run\0"     uid)[..8]            root span
//!   attempt= sha256("agentrun.dev/attempt\0" uid role step rev n)[..8]   the Pod's TRACEPARENT parent
//!   call   = sha256("agentrun.dev/call\0"    uid step rev seq n)[..8]  a journaled call of attempt n
//!   approval wait, re-plan: the same, with their own tag
//! ```

use sha2::{Digest, Sha256};

/// The first `N` bytes of the sha256 of `tag` and `parts`, NUL-separated;
/// never all zero (an invalid id in W3C Trace Context).
fn derive<const N: usize>(tag: &str, parts: &[&str]) -> [u8; N] {
    let mut h = Sha256::new();
    h.update(tag.as_bytes());
    for p in parts {
        h.update([0]);
        h.update(p.as_bytes());
    }
    let digest = h.finalize();
    let mut out = [0u8; N];
    out.copy_from_slice(&digest[..N]);
    if out.iter().all(|b| *b == 0) {
        out[N - 1] = 1;
    }
    out
}

/// The run's trace id.
pub fn trace_id(run_uid: &str) -> [u8; 16] {
    derive("agentrun.dev/trace", &[run_uid])
}

/// The run's root span.
pub fn run_span_id(run_uid: &str) -> [u8; 8] {
    derive("agentrun.dev/run", &[run_uid])
}

/// One attempt of one step (or planner, compactor, compensation) at one plan
/// revision; `role` is the Pod role label (`step`, `planner`, `compactor`,
/// `compensate`).
pub fn attempt_span_id(
    run_uid: &str,
    role: &str,
    step: &str,
    plan_revision: i64,
    attempt: i32,
) -> [u8; 8] {
    derive(
        "agentrun.dev/attempt",
        &[
            run_uid,
            role,
            step,
            &plan_revision.to_string(),
            &attempt.to_string(),
        ],
    )
}

/// The journaled call at `seq` of a step's journal at `plan_revision`, as
/// attempt `attempt` made it (D19).
pub fn call_span_id(
    run_uid: &str,
    step: &str,
    plan_revision: i64,
    seq: i64,
    attempt: i32,
) -> [u8; 8] {
    derive(
        "agentrun.dev/call",
        &[
            run_uid,
            step,
            &plan_revision.to_string(),
            &seq.to_string(),
            &attempt.to_string(),
        ],
    )
}

/// A step's wait for an Approval (by the Approval's name, unique per wait).
pub fn approval_span_id(run_uid: &str, approval: &str) -> [u8; 8] {
    derive("agentrun.dev/approval", &[run_uid, approval])
}

/// The re-plan that made `revision`.
pub fn replan_span_id(run_uid: &str, revision: i64) -> [u8; 8] {
    derive("agentrun.dev/replan", &[run_uid, &revision.to_string()])
}

pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// The W3C `traceparent` of an attempt span, sampled: what the step Pod gets
/// as `TRACEPARENT`.
pub fn attempt_traceparent(
    run_uid: &str,
    role: &str,
    step: &str,
    plan_revision: i64,
    attempt: i32,
) -> String {
    format!(
        "00-{}-{}-01",
        hex(&trace_id(run_uid)),
        hex(&attempt_span_id(
            run_uid,
            role,
            step,
            plan_revision,
            attempt
        ))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_fixed_functions_of_the_run_uid() {
        // Literals: a change of derivation orphans every span of runs in flight.
        let uid = "0b3c6f4e-8a51-4a7e-9f43-2f1d6c0de001";
        assert_eq!(hex(&trace_id(uid)).len(), 32);
        assert_eq!(trace_id(uid), trace_id(uid));
        assert_ne!(trace_id(uid), trace_id("another"));
        assert_ne!(
            attempt_span_id(uid, "step", "fetch", 1, 1),
            attempt_span_id(uid, "step", "fetch", 1, 2)
        );
        assert_ne!(
            attempt_span_id(uid, "step", "fetch", 1, 1),
            attempt_span_id(uid, "compensate", "fetch", 1, 1)
        );
        // "a","bc" and "ab","c" must not collide.
        assert_ne!(
            attempt_span_id(uid, "step", "ab", 1, 1),
            attempt_span_id(uid, "stepa", "b", 1, 1)
        );
        let tp = attempt_traceparent(uid, "step", "fetch", 1, 1);
        let parts: Vec<&str> = tp.split('-').collect();
        assert_eq!(parts.len(), 4);
        assert_eq!((parts[0], parts[3]), ("00", "01"));
        assert_eq!(parts[1], hex(&trace_id(uid)));
        assert_eq!(parts[2], hex(&attempt_span_id(uid, "step", "fetch", 1, 1)));
    }

    #[test]
    fn ids_do_not_move_between_releases() {
        assert_eq!(hex(&trace_id("uid-1")), EXPECTED_TRACE);
        assert_eq!(hex(&run_span_id("uid-1")), EXPECTED_RUN);
    }

    // python3: hashlib.sha256(b"agentrun.dev/trace\x00uid-1").hexdigest()[:32]
    const EXPECTED_TRACE: &str = "63b736e5361b16f7721555f3fbb52da3";
    // python3: hashlib.sha256(b"agentrun.dev/run\x00uid-1").hexdigest()[:16]
    const EXPECTED_RUN: &str = "4c2c721a6c3ebdb9";
}
