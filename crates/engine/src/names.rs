//! Deterministic names and keys: idempotency keys (D1), Pod names per attempt
//! (D2) and Approval names. Everything here is a pure function of the run's
//! identity and the step's coordinates, so a restarted operator derives the
//! same names and create-if-absent finds what the previous one made.

use sha2::{Digest, Sha256};

use agentrun_api::StepRole;

/// What a step Pod does; the `agentrun.dev/role` label value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PodRole {
    Step,
    Planner,
    Compactor,
    Compensate,
    /// A step's verify probe: asks the system the step changed whether an
    /// attempt with the step's key acted.
    Verify,
}

impl PodRole {
    pub fn label(self) -> &'static str {
        match self {
            PodRole::Step => "step",
            PodRole::Planner => "planner",
            PodRole::Compactor => "compactor",
            PodRole::Compensate => "compensate",
            PodRole::Verify => "verify",
        }
    }

    pub fn from_label(s: &str) -> Option<Self> {
        Some(match s {
            "step" => PodRole::Step,
            "planner" => PodRole::Planner,
            "compactor" => PodRole::Compactor,
            "compensate" => PodRole::Compensate,
            "verify" => PodRole::Verify,
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
            PodRole::Verify => 'v',
        }
    }
}

impl PodRole {
    /// The role of a step checkpoint's attempt; `None` for a compensation,
    /// whose checkpoints are kept apart.
    pub fn step_role(self) -> Option<StepRole> {
        match self {
            PodRole::Step => Some(StepRole::Step),
            PodRole::Planner => Some(StepRole::Planner),
            PodRole::Compactor => Some(StepRole::Compactor),
            PodRole::Verify => Some(StepRole::Verify),
            PodRole::Compensate => None,
        }
    }
}

impl From<StepRole> for PodRole {
    fn from(role: StepRole) -> Self {
        match role {
            StepRole::Step => PodRole::Step,
            StepRole::Planner => PodRole::Planner,
            StepRole::Compactor => PodRole::Compactor,
            StepRole::Verify => PodRole::Verify,
        }
    }
}

/// Hex characters kept from the sha256: 128 bits, label-safe.
const KEY_LEN: usize = 32;

/// The idempotency key of one logical execution (D1): the same for every
/// attempt of (run UID, step, plan revision), different for every revision.
/// Plan steps hash exactly (uid, step, revision); other roles add their role
/// so a compensation never shares its step's key. A verify probe asks about
/// the step's own attempts, so it carries the step's key.
pub fn idempotency_key(run_uid: &str, role: PodRole, step: &str, plan_revision: i64) -> String {
    let mut h = Sha256::new();
    h.update(run_uid.as_bytes());
    h.update([0]);
    if role != PodRole::Step && role != PodRole::Verify {
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

/// Longest name of a step Pod or an Approval: a DNS label, so it also fits a
/// label value and a hostname.
pub const MAX_CHILD_NAME: usize = 63;
/// Hex characters of the run-and-step tag in child names.
const TAG_LEN: usize = 6;

/// `<run>-<step>-<tag>-<suffix>`, at most 63 characters. The tag hashes the
/// run's UID and the step's name, so two runs never share a child name even
/// when their names join the same way (`hx` + `b-c` and `hx-b` + `c`), nor
/// a run and a newer run of the same name; when the readable part is cut to
/// fit, the tag still tells the steps apart.
fn child_name(run: &str, run_uid: &str, step: &str, suffix: &str) -> String {
    let mut h = Sha256::new();
    h.update(run_uid.as_bytes());
    h.update([0]);
    h.update(step.as_bytes());
    let digest = h.finalize();
    let tag: String = digest
        .iter()
        .take(TAG_LEN / 2)
        .map(|b| format!("{b:02x}"))
        .collect();
    let tail = format!("-{tag}-{suffix}");
    let mut readable = format!("{run}-{step}");
    let room = MAX_CHILD_NAME.saturating_sub(tail.len());
    if readable.len() > room {
        readable.truncate(room);
        // A name segment may not end in '-' or '.' before the tag.
        while readable.ends_with(['-', '.']) {
            readable.pop();
        }
    }
    readable + &tail
}

/// `<run>-<step>-<tag>-r<rev>-<marker><attempt>`: one name per attempt, so
/// attempt N+1 never collides with a still-terminating attempt N.
pub fn pod_name(
    run: &str,
    run_uid: &str,
    role: PodRole,
    step: &str,
    plan_revision: i64,
    attempt: i32,
) -> String {
    let suffix = format!("r{plan_revision}-{}{attempt}", role.marker());
    child_name(run, run_uid, step, &suffix)
}

/// The prefix of the names of a step's journal chunks (D19):
/// `<run>-<step>-<tag>-r<rev>-journal-`, the run and step part cut as the
/// Pod name of the step's longest attempt number would cut it, so the prefix
/// is the same for every attempt and its readable part is a prefix of every
/// attempt's (the journals admission policy checks a writing Pod that way).
pub fn journal_prefix(run: &str, run_uid: &str, step: &str, plan_revision: i64) -> String {
    let longest = pod_name(run, run_uid, PodRole::Step, step, plan_revision, 999_999);
    let stem = longest
        .rsplit_once('-')
        .map_or(longest.as_str(), |(s, _)| s);
    format!("{stem}-journal-")
}

/// The Approval gating a step before it starts: `-approve` for the first
/// request, `-approve-<n>` for the n-th (a step changed after the request).
pub fn approve_name(
    run: &str,
    run_uid: &str,
    step: &str,
    plan_revision: i64,
    request: u32,
) -> String {
    let suffix = nth(format!("r{plan_revision}-approve"), request);
    child_name(run, run_uid, step, &suffix)
}

/// The Signal a wait step waits on: `<run>-<step>-<tag>-r<rev>-signal`.
pub fn signal_name(run: &str, run_uid: &str, step: &str, plan_revision: i64) -> String {
    child_name(run, run_uid, step, &format!("r{plan_revision}-signal"))
}

/// Which request of its step's gate an Approval name is (see `approve_name`).
pub fn approve_request(name: &str) -> u32 {
    match name.rsplit_once("-approve-") {
        Some((_, n)) => n.parse().unwrap_or(1),
        None => 1,
    }
}

/// The Approval asking what an interrupted NonIdempotent attempt did:
/// `-reconcile-a<attempt>` for the first request, `-reconcile-a<attempt>-<n>`
/// for the n-th (the question was superseded while the run still needed it).
pub fn reconcile_name(
    run: &str,
    run_uid: &str,
    step: &str,
    plan_revision: i64,
    attempt: i32,
    request: u32,
) -> String {
    let suffix = nth(format!("r{plan_revision}-reconcile-a{attempt}"), request);
    child_name(run, run_uid, step, &suffix)
}

/// The n-th request of a question: the first keeps the plain name, later
/// ones append `-<n>`.
fn nth(first: String, request: u32) -> String {
    match request {
        0 | 1 => first,
        n => format!("{first}-{n}"),
    }
}

/// Whether an Approval name asks a Reconcile question (see
/// `reconcile_name`), judged by its suffix alone: a run or step name that
/// happens to contain `-reconcile-a` does not count.
pub fn is_reconcile(name: &str) -> bool {
    let Some((head, rest)) = name.rsplit_once("-reconcile-a") else {
        return false;
    };
    let attempt_ok = {
        let mut parts = rest.splitn(2, '-');
        let attempt = parts.next().unwrap_or("");
        let request = parts.next();
        !attempt.is_empty()
            && attempt.bytes().all(|b| b.is_ascii_digit())
            && request.is_none_or(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
    };
    let revision_ok = head
        .rsplit_once("-r")
        .is_some_and(|(_, rev)| !rev.is_empty() && rev.bytes().all(|b| b.is_ascii_digit()));
    attempt_ok && revision_ok
}

/// Which request of its attempt's question a Reconcile Approval name is.
pub fn reconcile_request(name: &str) -> u32 {
    match name
        .rsplit_once("-reconcile-a")
        .map(|(_, rest)| rest.split_once('-'))
    {
        Some(Some((_, n))) => n.parse().unwrap_or(1),
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconcile_names_are_told_apart_by_their_suffix() {
        let cases = [
            (
                "a reconcile request",
                reconcile_name("r", "u", "charge", 2, 3, 1),
                true,
            ),
            (
                "its second request",
                reconcile_name("r", "u", "charge", 2, 3, 2),
                true,
            ),
            ("a gate", approve_name("r", "u", "charge", 1, 1), false),
            (
                "a gate of a step named like one",
                approve_name("r", "u", "reconcile-a1", 1, 1),
                false,
            ),
            (
                "a gate's second request of that step",
                approve_name("r", "u", "x-reconcile-a2", 1, 2),
                false,
            ),
        ];
        for (what, name, want) in cases {
            assert_eq!(is_reconcile(&name), want, "{what}: {name}");
        }
    }

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
        let cases = [
            (PodRole::Step, "fetch", 1, 2, "run-fetch-TAG-r1-a2"),
            (PodRole::Compensate, "fetch", 1, 1, "run-fetch-TAG-r1-c1"),
            (PodRole::Compactor, "fetch", 3, 1, "run-fetch-TAG-r3-s1"),
        ];
        for (role, step, rev, attempt, want) in cases {
            let want = want.replace("TAG", "621418");
            assert_eq!(pod_name("run", "uid-1", role, step, rev, attempt), want);
        }
        assert_eq!(
            pod_name("run", "uid-1", PodRole::Planner, "plan", 1, 1),
            "run-plan-10d31e-r1-p1"
        );
    }

    #[test]
    fn a_repeated_approval_request_gets_the_next_name() {
        let first = approve_name("run", "uid-1", "fetch", 2, 1);
        assert_eq!(first, "run-fetch-621418-r2-approve");
        assert_eq!(approve_request(&first), 1);
        let third = approve_name("run", "uid-1", "fetch", 2, 3);
        assert_eq!(third, "run-fetch-621418-r2-approve-3");
        assert_eq!(approve_request(&third), 3);
    }

    #[test]
    fn runs_whose_names_join_alike_get_different_names() {
        // `hx` + `b-c` and `hx-b` + `c` both read `hx-b-c`.
        let a = pod_name("hx", "uid-a", PodRole::Step, "b-c", 1, 1);
        let b = pod_name("hx-b", "uid-b", PodRole::Step, "c", 1, 1);
        assert_ne!(a, b);
        assert!(
            a.starts_with("hx-b-c-") && b.starts_with("hx-b-c-"),
            "{a} {b}"
        );
        assert_ne!(
            approve_name("hx", "uid-a", "b-c", 1, 1),
            approve_name("hx-b", "uid-b", "c", 1, 1)
        );
        // A newer run of the same name never meets the older run's objects.
        assert_ne!(
            pod_name("hx", "uid-a", PodRole::Step, "c", 1, 1),
            pod_name("hx", "uid-c", PodRole::Step, "c", 1, 1)
        );
    }

    #[test]
    fn longest_names_fit_a_dns_label_and_stay_distinct() {
        let run = "r".repeat(63);
        let s1 = format!("{}1", "s".repeat(47));
        let s2 = format!("{}2", "s".repeat(47));
        let names = [
            pod_name(&run, "uid", PodRole::Step, &s1, 21, 1000),
            pod_name(&run, "uid", PodRole::Step, &s2, 21, 1000),
            approve_name(&run, "uid", &s1, 21, 1000),
            reconcile_name(&run, "uid", &s1, 21, 1000, 99),
        ];
        for n in &names {
            assert!(n.len() <= 63, "{n} has {} characters", n.len());
            assert!(!n.contains(".-") && !n.starts_with('-'), "{n}");
        }
        assert_ne!(names[0], names[1], "cut names keep the step apart");
        // A cut that lands on a dash drops it rather than doubling it.
        let cut = pod_name(
            &format!("{}-xyz", "a".repeat(49)),
            "u",
            PodRole::Step,
            "y",
            1,
            1,
        );
        assert!(cut.len() <= 63 && !cut.contains("--"), "{cut}");
    }
}
