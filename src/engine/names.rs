//! Deterministic names and keys: idempotency keys (D1), Pod names per attempt
//! (D2) and Approval names. Everything here is a pure function of the run's
//! identity and the step's coordinates, so a restarted operator derives the
//! same names and create-if-absent finds what the previous one made.

use sha2::{Digest, Sha256};

use crate::api::StepRole;

/// What a step Pod does; the `agentrun.dev/role` label value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PodRole {
    Step,
    Planner,
    Compactor,
    Compensate,
}

impl PodRole {
    pub fn label(self) -> &'static str {
        match self {
            PodRole::Step => "step",
            PodRole::Planner => "planner",
            PodRole::Compactor => "compactor",
            PodRole::Compensate => "compensate",
        }
    }

    pub fn from_label(s: &str) -> Option<Self> {
        Some(match s {
            "step" => PodRole::Step,
            "planner" => PodRole::Planner,
            "compactor" => PodRole::Compactor,
            "compensate" => PodRole::Compensate,
            _ => return None,
        })
    }

    /// The one-letter attempt marker in the Pod name.
    fn marker(self) -> char {
        match self {
            PodRole::Step => 'a',
            PodRole::Planner => 'p',
            PodRole::Compactor => 's',
            PodRole::Compensate => 'c',
        }
    }
}

impl From<StepRole> for PodRole {
    fn from(role: StepRole) -> Self {
        match role {
            StepRole::Step => PodRole::Step,
            StepRole::Planner => PodRole::Planner,
            StepRole::Compactor => PodRole::Compactor,
        }
    }
}

/// Hex characters kept from the sha256: 128 bits, label-safe.
const KEY_LEN: usize = 32;

/// The idempotency key of one logical execution (D1): the same for every
/// attempt of (run UID, step, plan revision), different for every revision.
/// Plan steps hash exactly (uid, step, revision); other roles add their role
/// so a compensation never shares its step's key.
pub fn idempotency_key(run_uid: &str, role: PodRole, step: &str, plan_revision: i64) -> String {
    let mut h = Sha256::new();
    h.update(run_uid.as_bytes());
    h.update([0]);
    if role != PodRole::Step {
        h.update(role.label().as_bytes());
        h.update([0]);
    }
    h.update(step.as_bytes());
    h.update([0]);
    h.update(plan_revision.to_string().as_bytes());
    let digest = h.finalize();
    let mut hex = String::with_capacity(KEY_LEN);
    for b in digest.iter().take(KEY_LEN / 2) {
        hex.push_str(&format!("{b:02x}"));
    }
    hex
}

/// `<run>-<step>-r<rev>-<marker><attempt>`: one name per attempt, so attempt N+1
/// never collides with a still-terminating attempt N.
pub fn pod_name(run: &str, role: PodRole, step: &str, plan_revision: i64, attempt: i32) -> String {
    format!("{run}-{step}-r{plan_revision}-{}{attempt}", role.marker())
}

/// The Approval gating a step before it starts.
pub fn approve_name(run: &str, step: &str, plan_revision: i64) -> String {
    format!("{run}-{step}-r{plan_revision}-approve")
}

/// The Approval asking what an interrupted NonIdempotent attempt did.
pub fn reconcile_name(run: &str, step: &str, plan_revision: i64, attempt: i32) -> String {
    format!("{run}-{step}-r{plan_revision}-reconcile-a{attempt}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stable_label_safe_and_change_with_revision() {
        let k1 = idempotency_key("uid-1", PodRole::Step, "fetch", 1);
        assert_eq!(k1, idempotency_key("uid-1", PodRole::Step, "fetch", 1));
        assert_eq!(k1.len(), 32);
        assert!(k1.chars().all(|c| c.is_ascii_hexdigit()));
        for other in [
            idempotency_key("uid-1", PodRole::Step, "fetch", 2),
            idempotency_key("uid-2", PodRole::Step, "fetch", 1),
            idempotency_key("uid-1", PodRole::Step, "fetch2", 1),
            idempotency_key("uid-1", PodRole::Compensate, "fetch", 1),
        ] {
            assert_ne!(k1, other);
        }
    }

    #[test]
    fn pod_names_distinguish_roles_and_attempts() {
        assert_eq!(
            pod_name("run", PodRole::Step, "fetch", 1, 2),
            "run-fetch-r1-a2"
        );
        assert_eq!(
            pod_name("run", PodRole::Compensate, "fetch", 1, 1),
            "run-fetch-r1-c1"
        );
        assert_eq!(
            pod_name("run", PodRole::Planner, "plan", 1, 1),
            "run-plan-r1-p1"
        );
        assert_eq!(
            pod_name("run", PodRole::Compactor, "fetch", 3, 1),
            "run-fetch-r3-s1"
        );
    }
}
