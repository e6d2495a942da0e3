//! The Observer: what the driver's watch saw of every run while the runs went
//! on — the first sight of every committed checkpoint and the API server's
//! time of the status write that committed it, any later change or
//! disappearance of it (D3), any change of a terminal phase, any vanished
//! run, and the health of the watch itself.
//!
//! ```text
//!   watch AgentRuns ──every version──▶ observe() ──▶ committed_at (per key), violations
//!                   ──errors, end────▶ watch_error() / watch_ended() ──▶ watch_failures
//! ```

use std::collections::BTreeMap;

use agentrun_operator::api::{AgentRun, Approval, CheckpointState, RunPhase, StepPhase, StepRole};
use agentrun_operator::labels;
use jiff::Timestamp;
use kube::ResourceExt;
use serde_json::{Value, json};

/// When an outcome was committed, by two clocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Commit {
    /// When the driver's watch first saw it committed.
    pub seen: Timestamp,
    /// The API server's time (whole seconds) of the operator's status write in
    /// the first version seen with it committed.
    pub written: Option<Timestamp>,
    pub phase: StepPhase,
}

/// What the driver saw while the runs went on.
#[derive(Debug, Default)]
pub struct Observer {
    runs: BTreeMap<String, SeenRun>,
    /// Per idempotency key, when its outcome (Succeeded or Failed) was first seen
    /// committed, and that outcome.
    pub committed_at: BTreeMap<String, Commit>,
    /// Per run, what broke the contract.
    pub violations: Vec<(String, String)>,
    /// Status versions looked at.
    pub versions: u64,
    /// Errors of the watch: all of them, and those that were expected (410 Gone,
    /// or inside a kube-apiserver restart).
    pub watch_errors: u64,
    pub watch_errors_expected: u64,
    /// Errors that break the evidence (one line each).
    pub watch_failures: Vec<String>,
    /// The last watch event was an error: the watch has not resumed since.
    watch_broken: Option<String>,
}

#[derive(Debug, Default)]
struct SeenRun {
    resource_version: u64,
    committed: BTreeMap<String, Value>,
    terminal: Option<RunPhase>,
}

/// The API server's time of the last status write by the operator in this
/// version of the run: its `status` field-manager entry (whole seconds).
pub fn status_write_time(run: &AgentRun) -> Option<Timestamp> {
    run.metadata
        .managed_fields
        .as_ref()?
        .iter()
        .filter(|m| {
            m.manager.as_deref() == Some(labels::FIELD_MANAGER)
                && m.subresource.as_deref() == Some("status")
        })
        .filter_map(|m| m.time.as_ref().map(|t| t.0))
        .max()
}

/// The API server's time of an Approval's decision: the `managedFields` entry
/// of the manager that wrote `spec.decision` (whole seconds), else
/// `status.decidedAt`.
pub fn decision_time(a: &Approval) -> Option<Timestamp> {
    let from_fields = a
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| m.subresource.as_deref().unwrap_or("").is_empty())
        .filter(|m| {
            m.fields_v1
                .as_ref()
                .and_then(|f| f.0.get("f:spec"))
                .is_some_and(|spec| spec.get("f:decision").is_some())
        })
        .filter_map(|m| m.time.as_ref().map(|t| t.0))
        .max();
    from_fields.or_else(|| a.status.as_ref()?.decided_at.as_ref().map(|t| t.0))
}

impl Observer {
    /// Looks at one version of a run, seen at `now`.
    pub fn observe(&mut self, run: &AgentRun, now: Timestamp) {
        self.watch_broken = None;
        let name = run.name_any();
        let rv: u64 = run
            .resource_version()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let seen = self.runs.entry(name.clone()).or_default();
        if rv != 0 && rv < seen.resource_version {
            return; // an older version delivered late (relist): nothing new
        }
        seen.resource_version = rv;
        self.versions += 1;
        let Some(status) = run.status.as_ref() else {
            return;
        };
        let written = status_write_time(run);
        let commit = |phase| Commit {
            seen: now,
            written,
            phase,
        };
        let mut current: BTreeMap<String, Value> = BTreeMap::new();
        // A journaled step's probe answers one call at a time (D19): each
        // answer is committed into the journal's settlements, and the
        // checkpoint asks about the next call as its next attempt. Its
        // answers are judged per attempt; an answer gives way only to a new
        // question (the same attempt reset to ask, or a later one).
        let journaled = |step: &str| {
            run.spec
                .steps
                .iter()
                .any(|s| s.name == step && s.journal.is_some())
        };
        let mut questions: BTreeMap<String, (i32, bool)> = BTreeMap::new();
        for c in &status.steps {
            if c.checkpoint != CheckpointState::Committed {
                continue;
            }
            let mut id = format!("step {:?}/{}/r{}", c.role, c.name, c.plan_revision);
            if c.role == StepRole::Verify && journaled(&c.name) {
                questions.insert(id.clone(), (c.attempt, c.phase.is_terminal()));
                if !c.phase.is_terminal() {
                    continue;
                }
                id = format!("{id} a{}", c.attempt);
            }
            current.insert(
                id,
                json!({"phase": c.phase, "key": c.idempotency_key, "attempt": c.attempt,
                       "result": c.result, "finishedAt": c.finished_at, "effect": c.effect}),
            );
            // A probe carries its step's key, but its outcome is its answer,
            // not the step's: the step may still retry under the key.
            if c.role != StepRole::Verify {
                self.committed_at
                    .entry(c.idempotency_key.clone())
                    .or_insert(commit(c.phase));
            }
        }
        for c in &status.compensations {
            if !c.phase.is_terminal() {
                continue;
            }
            let id = format!("compensation {}/r{}", c.name, c.plan_revision);
            current.insert(
                id,
                json!({"phase": c.phase, "key": c.idempotency_key, "attempt": c.attempt, "finishedAt": c.finished_at}),
            );
            self.committed_at
                .entry(c.idempotency_key.clone())
                .or_insert(commit(c.phase));
        }
        let asked_again = |id: &str| {
            let Some((question, answered)) = id.rsplit_once(" a") else {
                return false;
            };
            let answered: i32 = answered.parse().unwrap_or(i32::MAX);
            questions.get(question).is_some_and(|&(attempt, terminal)| {
                attempt > answered || (attempt == answered && !terminal)
            })
        };
        for (id, before) in &seen.committed {
            match current.get(id) {
                None if asked_again(id) => {}
                None => self.violations.push((
                    name.clone(),
                    format!("committed checkpoint {id} disappeared at resourceVersion {rv} (was {before})"),
                )),
                Some(now_value) if now_value != before => self.violations.push((
                    name.clone(),
                    format!("committed checkpoint {id} changed at resourceVersion {rv}: {before} -> {now_value}"),
                )),
                Some(_) => {}
            }
        }
        for (id, value) in current {
            seen.committed.entry(id).or_insert(value);
        }
        let phase = status.phase;
        if let Some(t) = seen.terminal
            && phase != Some(t)
        {
            self.violations.push((
                name.clone(),
                format!("terminal phase {t:?} became {phase:?} at resourceVersion {rv}"),
            ));
        }
        if let Some(p) = phase.filter(|p| p.is_terminal()) {
            seen.terminal.get_or_insert(p);
        }
    }

    /// A run was deleted (no TTL is set: nothing should delete one).
    pub fn deleted(&mut self, name: &str) {
        self.watch_broken = None;
        self.violations
            .push((name.to_owned(), "the run was deleted".to_owned()));
    }

    /// The watch delivered an event that is not an object (e.g. the end of a
    /// re-list): it works again.
    pub fn watch_ok(&mut self) {
        self.watch_broken = None;
    }

    /// The watch failed with `error`. `expected`: a `410 Gone` (the watcher
    /// re-lists) or an error while kube-apiserver was being restarted; the
    /// watch must still resume afterwards. Any other error breaks the evidence.
    pub fn watch_error(&mut self, error: &str, expected: bool, at: Timestamp) {
        self.watch_errors += 1;
        if expected {
            self.watch_errors_expected += 1;
        } else {
            self.watch_failures
                .push(format!("watch error at {at}: {error}"));
        }
        self.watch_broken = Some(format!("{error} (at {at})"));
    }

    /// The watch stream ended: versions after this were not looked at.
    pub fn watch_ended(&mut self, at: Timestamp) {
        self.watch_failures
            .push(format!("the watch of runs ended at {at}"));
    }

    /// Call when the watch is stopped on purpose: a watch whose last event was
    /// an error never resumed.
    pub fn watch_stopped(&mut self) {
        if let Some(last) = self.watch_broken.take() {
            self.watch_failures.push(format!(
                "the watch did not resume after its last error: {last}"
            ));
        }
    }

    /// Runs seen in a terminal phase.
    pub fn terminal(&self) -> usize {
        self.runs.values().filter(|r| r.terminal.is_some()).count()
    }

    /// Whether the run was seen in a terminal phase.
    pub fn seen_terminal(&self, run: &str) -> bool {
        self.runs.get(run).is_some_and(|r| r.terminal.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::*;
    use crate::ledger::Outcome;

    #[test]
    fn watch_errors_fail_the_verdict_unless_expected_and_resumed() {
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        let ledger = exec("1", "k", 10, Outcome::Succeeded, 11).to_vec();
        let at = Timestamp::from_second(30).unwrap();

        // A 410 Gone, then the watcher re-lists: fine.
        let mut o = Observer::default();
        o.watch_error("410 Gone", true, at);
        o.observe(&r, at);
        o.watch_stopped();
        let v = judge(&o, std::slice::from_ref(&r), ledger.clone());
        assert!(v.passed(), "{v:?}");
        assert_eq!((o.watch_errors, o.watch_errors_expected), (1, 1));

        // A 410 Gone after which nothing came: the watch never resumed.
        let mut o = Observer::default();
        o.observe(&r, at);
        o.watch_error("410 Gone", true, at);
        o.watch_stopped();
        let v = judge(&o, std::slice::from_ref(&r), ledger.clone());
        assert_eq!(v.watch_failures, 1, "{v:?}");

        // Any other error fails, resumed or not; so does an ended stream.
        let mut o = Observer::default();
        o.watch_error("connection reset", false, at);
        o.observe(&r, at);
        o.watch_ended(at);
        o.watch_stopped();
        let v = judge(&o, std::slice::from_ref(&r), ledger);
        assert_eq!(v.watch_failures, 2, "{v:?}");
        assert!(!v.passed());
    }

    #[test]
    fn a_deleted_run_and_an_older_version_delivered_late() {
        let mut o = Observer::default();
        let t = Timestamp::from_second(20).unwrap();
        o.observe(
            &run("r", 6, vec![committed("a", "k", "r")], RunPhase::Succeeded),
            t,
        );
        // A relist delivers resourceVersion 5 after 6: nothing new, no violation.
        o.observe(&run("r", 5, vec![], RunPhase::Running), t);
        assert!(o.violations.is_empty(), "{:?}", o.violations);
        assert!(o.seen_terminal("r"));
        assert_eq!(o.terminal(), 1);
        o.deleted("r");
        assert_eq!(
            o.violations,
            [("r".to_owned(), "the run was deleted".to_owned())]
        );
    }

    #[test]
    fn a_journaled_steps_probe_may_ask_about_the_next_call_but_never_rewrite_an_answer() {
        let probe = |attempt: i32, phase: StepPhase, effect: &str| {
            let mut v = committed("a", "k", "r");
            v.role = StepRole::Verify;
            v.attempt = attempt;
            v.phase = phase;
            v.result = None;
            v.effect = serde_json::from_value(json!(effect)).unwrap();
            v
        };
        let journaled = |rv: u64, probe| {
            let mut r = run("r", rv, vec![probe], RunPhase::Running);
            r.spec.steps[0].journal = Some(Default::default());
            r
        };
        let t = Timestamp::from_second(20).unwrap();
        let mut o = Observer::default();
        o.observe(
            &journaled(5, probe(1, StepPhase::Succeeded, "NotApplied")),
            t,
        );
        // The next call's question: attempt 1 reset, then attempt 2 answers.
        o.observe(&journaled(6, probe(1, StepPhase::Pending, "NotApplied")), t);
        o.observe(&journaled(7, probe(2, StepPhase::Succeeded, "Applied")), t);
        assert!(o.violations.is_empty(), "{:?}", o.violations);
        // Attempt 2's answer rewritten in place is a changed checkpoint.
        o.observe(
            &journaled(8, probe(2, StepPhase::Succeeded, "NotApplied")),
            t,
        );
        assert_eq!(o.violations.len(), 1, "{:?}", o.violations);
        assert!(
            o.violations[0]
                .1
                .starts_with("committed checkpoint step Verify/a/r1 a2 changed"),
            "{:?}",
            o.violations
        );
        // A step that does not journal keeps one probe answer per revision.
        let mut o = Observer::default();
        let mut plain = run(
            "r",
            5,
            vec![probe(1, StepPhase::Succeeded, "NotApplied")],
            RunPhase::Running,
        );
        o.observe(&plain, t);
        plain = run(
            "r",
            6,
            vec![probe(2, StepPhase::Succeeded, "Applied")],
            RunPhase::Running,
        );
        o.observe(&plain, t);
        assert_eq!(o.violations.len(), 1, "{:?}", o.violations);
    }

    #[test]
    fn the_decision_time_is_the_api_servers() {
        let a = retry_at("2026-01-01T10:00:15Z");
        assert_eq!(decision_time(&a), Some(ts("2026-01-01T10:00:15Z")));
        let mut a = approval("Reconcile", Some("Retry"), "Resolved", "Reject");
        assert_eq!(decision_time(&a), None);
        a.status.as_mut().unwrap().decided_at = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(ts("2026-01-01T10:00:16Z")),
        );
        assert_eq!(decision_time(&a), Some(ts("2026-01-01T10:00:16Z")));
    }
}
