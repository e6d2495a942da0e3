//! The chaos verdict: what the steps really did (the simkubelet ledger), what
//! the runs committed (every status version the driver saw, and the final
//! statuses), judged against the durability contract.
//!
//! ```text
//!   watch AgentRuns ──▶ Observer: first sight of every committed checkpoint and the
//!                                 API server's time of the status write that committed it,
//!                                 any later change or disappearance of it (D3),
//!                                 any change of a terminal phase, any vanished run,
//!                                 the health of the watch itself
//!   ledger + final statuses + Approvals ──▶ verdict()
//! ```
//!
//! Definitions (also in e2e/README.md, "Chaos suite"):
//!
//! - **duplicate**: an execution (a ledger `started` line) that should not have
//!   happened, by any of these rules (one execution counts once):
//!   - *after the commit*: it started after its key's outcome (Succeeded, or
//!     Failed for good) was committed — by the API server's time of the status
//!     write in which the checkpoint first appeared committed (the operator's
//!     `status` entry in `managedFields`, whole seconds: a start ≥ 1 s after it
//!     is after the commit), or after the driver first saw it committed;
//!   - *second success*: it finished `Succeeded` while an earlier-finished
//!     execution of the key had already succeeded;
//!   - *overlap* (D2): it started while another execution of the key was still
//!     live (started, not yet finished);
//!   - *blind re-run* (D6): a NonIdempotent step's execution after one of its
//!     executions was killed mid-run, not preceded by as many `Retry` decisions
//!     on the key's Reconcile approvals as there were killed executions.
//! - **unapproved**: an execution of a step whose `Approve` gate was Rejected,
//!   or expired with `onTimeout: Reject`. It must have none at all.
//! - **lost** (runs): a run that vanished; a run whose committed checkpoint (step or
//!   compensation) changed or disappeared in a later status, or whose terminal phase
//!   changed; a committed `Succeeded` step whose result is not the one the step
//!   reported, or that no execution of its key succeeded (and no person marked it
//!   succeeded); a successful execution whose key is not committed `Succeeded` (a
//!   dropped result, D5).
//! - **stuck** (runs): not in a terminal phase when the settle deadline passed
//!   (the approver answers every Approval, so a run waiting for one is stuck too).
//! - **unobserved** (runs): created, but never seen in a terminal phase by the
//!   driver's watch, so the evidence about it is incomplete.
//! - **watch failures**: an error of the driver's watch that is neither a `410
//!   Gone` (the watcher re-lists) nor inside an injected kube-apiserver restart,
//!   or a watch that did not resume after its last error.
//! - **reconcile_approvals**: Approvals of kind `Reconcile`; an unexpected one is on
//!   a step that is not NonIdempotent or none of whose Pods the driver disrupted.
//!
//! Any duplicate, unapproved, lost, stuck or unobserved run, watch failure or
//! unexpected Reconcile approval fails the verdict.

use std::collections::{BTreeMap, BTreeSet};

use agentrun_operator::api::{
    AgentRun, Approval, ApprovalKind, ApprovalPhase, CheckpointState, Decision, Effect, OnTimeout,
    RunPhase, StepPhase,
};
use agentrun_operator::labels;
use jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use serde_json::{Value, json};

use super::workload::expected_result;
use crate::ledger::{Ledger, LedgerEvent, Outcome};

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
        for c in &status.steps {
            if c.checkpoint != CheckpointState::Committed {
                continue;
            }
            let id = format!("step {:?}/{}/r{}", c.role, c.name, c.plan_revision);
            current.insert(
                id,
                json!({"phase": c.phase, "key": c.idempotency_key, "attempt": c.attempt,
                       "result": c.result, "finishedAt": c.finished_at, "effect": c.effect}),
            );
            self.committed_at
                .entry(c.idempotency_key.clone())
                .or_insert(commit(c.phase));
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
        for (id, before) in &seen.committed {
            match current.get(id) {
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

/// Everything the verdict is computed from.
pub struct Evidence<'a> {
    /// Names of the runs the driver created.
    pub created: &'a [String],
    /// The runs as listed after the settle phase.
    pub final_runs: &'a [AgentRun],
    pub approvals: &'a [Approval],
    pub ledger: &'a Ledger,
    pub observer: &'a Observer,
    /// Idempotency keys of Pods the driver evicted or deleted.
    pub disrupted_keys: &'a BTreeSet<String>,
}

/// The judgement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub runs: usize,
    pub executions: usize,
    pub successful_executions: usize,
    /// Executions that should not have happened (each counted once), and by rule.
    pub duplicates: usize,
    pub after_commit: usize,
    pub second_success: usize,
    pub overlapping: usize,
    pub blind_reruns: usize,
    /// Executions of steps behind a Rejected or expired gate.
    pub unapproved: usize,
    pub lost: usize,
    pub stuck: usize,
    pub unobserved: usize,
    pub watch_failures: usize,
    pub reconcile_approvals: usize,
    pub reconcile_unexpected: usize,
    /// Outcomes of the runs, by phase.
    pub phases: BTreeMap<String, usize>,
    /// One line per finding.
    pub findings: Vec<String>,
}

impl Verdict {
    pub fn passed(&self) -> bool {
        self.duplicates == 0
            && self.unapproved == 0
            && self.lost == 0
            && self.stuck == 0
            && self.unobserved == 0
            && self.watch_failures == 0
            && self.reconcile_unexpected == 0
    }
}

struct Execution<'a> {
    uid: &'a str,
    pod: &'a str,
    run: &'a str,
    step: &'a str,
    started_at: Timestamp,
    outcome: Option<Outcome>,
    finished_at: Option<Timestamp>,
}

impl Execution<'_> {
    /// Until when it was live. A Pod that vanished is logged when simkubelet
    /// noticed, a little after the fact: allow that much.
    fn live_until(&self) -> Timestamp {
        match (self.finished_at, self.outcome) {
            (Some(f), Some(Outcome::Killed)) => f - SignedDuration::from_millis(50),
            (Some(f), _) => f,
            (None, _) => Timestamp::MAX,
        }
    }
}

/// Computes the verdict from the evidence.
pub fn verdict(e: &Evidence<'_>) -> Verdict {
    let mut v = Verdict {
        runs: e.created.len(),
        ..Verdict::default()
    };
    let mut lost_runs: BTreeSet<String> = BTreeSet::new();

    // Executions per key, paired by Pod UID, in the order they started.
    let mut by_key: BTreeMap<&str, Vec<Execution<'_>>> = BTreeMap::new();
    for s in e.ledger.executions() {
        let finished = e
            .ledger
            .for_pod(&s.uid)
            .find(|f| f.event == LedgerEvent::Finished);
        by_key.entry(s.key()).or_default().push(Execution {
            uid: &s.uid,
            pod: &s.pod,
            run: s.run.as_deref().unwrap_or(""),
            step: s.step.as_deref().unwrap_or(""),
            started_at: s.started_at,
            outcome: finished.and_then(|f| f.outcome),
            finished_at: finished.and_then(|f| f.finished_at),
        });
    }
    for execs in by_key.values_mut() {
        execs.sort_by_key(|x| x.started_at);
    }
    v.executions = by_key.values().map(Vec::len).sum();

    // The declared effect of every step key, from the final runs.
    let mut effects: BTreeMap<&str, Effect> = BTreeMap::new();
    for run in e.final_runs {
        let Some(status) = run.status.as_ref() else {
            continue;
        };
        for c in status.steps.iter().filter(|c| c.role.is_step()) {
            if let Some(s) = run.spec.steps.iter().find(|s| s.name == c.name) {
                effects.insert(&c.idempotency_key, s.effect);
            }
        }
    }
    // Retry decisions on Reconcile approvals, per key, with their server time.
    let mut retries: BTreeMap<&str, Vec<Option<Timestamp>>> = BTreeMap::new();
    for a in e.approvals {
        if a.spec.kind == ApprovalKind::Reconcile
            && a.spec.decision == Some(Decision::Retry)
            && let Some(key) = a
                .spec
                .context
                .as_ref()
                .and_then(|c| c.idempotency_key.as_deref())
        {
            retries.entry(key).or_default().push(decision_time(a));
        }
    }

    // Duplicates.
    for (key, execs) in &by_key {
        let first_success = execs
            .iter()
            .filter(|x| x.outcome == Some(Outcome::Succeeded))
            .min_by_key(|x| x.finished_at);
        let commit = e.observer.committed_at.get(*key);
        let non_idempotent = effects.get(key) == Some(&Effect::NonIdempotent);
        for (i, x) in execs.iter().enumerate() {
            let succeeded = x.outcome == Some(Outcome::Succeeded);
            if succeeded {
                v.successful_executions += 1;
            }
            let mut why: Vec<String> = Vec::new();
            if let Some(c) = commit {
                let after_written = c
                    .written
                    .is_some_and(|w| x.started_at >= w + SignedDuration::from_secs(1));
                let after_seen = x.started_at > c.seen;
                if after_written || after_seen {
                    v.after_commit += 1;
                    why.push(format!(
                        "after its outcome was committed ({:?}, written {}, seen {})",
                        c.phase,
                        c.written
                            .map(|w| w.to_string())
                            .unwrap_or_else(|| "?".into()),
                        c.seen
                    ));
                }
            }
            if succeeded && first_success.is_some_and(|f| f.uid != x.uid) {
                v.second_success += 1;
                why.push(format!(
                    "a second success (first: pod {})",
                    first_success.map(|f| f.pod).unwrap_or_default()
                ));
            }
            if let Some(live) = execs[..i].iter().find(|y| y.live_until() > x.started_at) {
                v.overlapping += 1;
                why.push(format!(
                    "while pod {} of the same key was live (started {}, {})",
                    live.pod,
                    live.started_at,
                    live.finished_at
                        .map(|f| format!("finished {f}"))
                        .unwrap_or_else(|| "never finished".into())
                ));
            }
            if non_idempotent {
                let killed = execs[..i]
                    .iter()
                    .filter(|y| y.outcome == Some(Outcome::Killed))
                    .count();
                let retried = retries.get(key).map_or(0, |ts| {
                    ts.iter()
                        .filter(|t| t.is_none_or(|t| t <= x.started_at))
                        .count()
                });
                if retried < killed {
                    v.blind_reruns += 1;
                    why.push(format!(
                        "a NonIdempotent step re-run after {killed} killed execution(s) with {retried} Retry decision(s) before it"
                    ));
                }
            }
            if !why.is_empty() {
                v.duplicates += 1;
                v.findings.push(format!(
                    "duplicate: run {} key {key} pod {} started {} ({:?}): {}",
                    x.run,
                    x.pod,
                    x.started_at,
                    x.outcome,
                    why.join("; ")
                ));
            }
        }
    }

    // Steps behind a gate that said no.
    for a in e.approvals {
        if a.spec.kind != ApprovalKind::Approve {
            continue;
        }
        let phase = a.status.as_ref().map(|s| s.phase);
        let rejected = phase == Some(ApprovalPhase::Rejected)
            || (a.spec.decision == Some(Decision::Rejected)
                && phase != Some(ApprovalPhase::Superseded));
        let expired =
            phase == Some(ApprovalPhase::Expired) && a.spec.on_timeout == OnTimeout::Reject;
        if !(rejected || expired) {
            continue;
        }
        let key = a
            .spec
            .context
            .as_ref()
            .and_then(|c| c.idempotency_key.as_deref());
        let behind: Vec<&Execution<'_>> = by_key
            .iter()
            .flat_map(|(k, xs)| xs.iter().map(move |x| (*k, x)))
            .filter(|(k, x)| match key {
                Some(key) => *k == key,
                None => x.run == a.spec.run_name && x.step == a.spec.step,
            })
            .map(|(_, x)| x)
            .collect();
        for x in behind {
            v.unapproved += 1;
            v.findings.push(format!(
                "unapproved: run {} step {} pod {} started {} although approval {} was {}",
                x.run,
                x.step,
                x.pod,
                x.started_at,
                a.name_any(),
                if rejected {
                    "Rejected"
                } else {
                    "Expired (onTimeout: Reject)"
                }
            ));
        }
    }

    // Lost: vanished runs and observed checkpoint violations.
    let finals: BTreeMap<String, &AgentRun> =
        e.final_runs.iter().map(|r| (r.name_any(), r)).collect();
    for name in e.created {
        if !finals.contains_key(name) {
            lost_runs.insert(name.clone());
            v.findings.push(format!("lost: run {name} vanished"));
        }
        if !e.observer.seen_terminal(name) {
            v.unobserved += 1;
            v.findings.push(format!(
                "unobserved: run {name} was never seen in a terminal phase by the driver's watch"
            ));
        }
    }
    for (run, what) in &e.observer.violations {
        lost_runs.insert(run.clone());
        v.findings.push(format!("lost: run {run}: {what}"));
    }
    v.watch_failures = e.observer.watch_failures.len();
    for f in &e.observer.watch_failures {
        v.findings.push(format!("watch: {f}"));
    }

    let marked_succeeded: BTreeSet<&str> = e
        .approvals
        .iter()
        .filter(|a| {
            a.spec.kind == ApprovalKind::Reconcile
                && a.spec.decision == Some(Decision::MarkSucceeded)
        })
        .filter_map(|a| a.spec.context.as_ref()?.idempotency_key.as_deref())
        .collect();
    let successes = e.ledger.successes_by_key();

    // Final checkpoints: committed successes must be real, real successes must be committed.
    let mut committed_success: BTreeSet<&str> = BTreeSet::new();
    for run in e.final_runs {
        let name = run.name_any();
        let phase = run.status.as_ref().and_then(|s| s.phase);
        *v.phases
            .entry(
                phase
                    .map(|p| format!("{p:?}"))
                    .unwrap_or_else(|| "None".into()),
            )
            .or_default() += 1;
        if !phase.is_some_and(RunPhase::is_terminal) && e.created.contains(&name) {
            v.stuck += 1;
            let current = run.status.as_ref().and_then(|s| s.current_step.clone());
            v.findings.push(format!(
                "stuck: run {name} is {phase:?} at step {current:?}"
            ));
        }
        let Some(status) = run.status.as_ref() else {
            continue;
        };
        for c in &status.steps {
            if c.phase != StepPhase::Succeeded || c.checkpoint != CheckpointState::Committed {
                continue;
            }
            committed_success.insert(&c.idempotency_key);
            if marked_succeeded.contains(c.idempotency_key.as_str()) {
                continue; // a person said it acted
            }
            if c.role.is_step() && c.pod.is_some() {
                if successes.get(&c.idempotency_key).copied().unwrap_or(0) == 0 {
                    lost_runs.insert(name.clone());
                    v.findings.push(format!(
                        "lost: run {name} step {} committed Succeeded but no execution of key {} succeeded",
                        c.name, c.idempotency_key
                    ));
                }
                if !c.result_truncated && c.result != Some(expected_result(&name, &c.name)) {
                    lost_runs.insert(name.clone());
                    v.findings.push(format!(
                        "lost: run {name} step {} committed result {:?}, the step reported {}",
                        c.name,
                        c.result,
                        expected_result(&name, &c.name)
                    ));
                }
            }
        }
        for c in &status.compensations {
            if c.phase == StepPhase::Succeeded {
                committed_success.insert(&c.idempotency_key);
            }
        }
    }
    for (key, execs) in &by_key {
        let Some(x) = execs.iter().find(|x| x.outcome == Some(Outcome::Succeeded)) else {
            continue;
        };
        if !committed_success.contains(key) {
            lost_runs.insert(x.run.to_owned());
            v.findings.push(format!(
                "lost: run {} key {key}: pod {} succeeded but the key is not committed Succeeded (dropped result)",
                x.run, x.pod
            ));
        }
    }
    v.lost = lost_runs.len();

    // Reconcile approvals.
    for a in e.approvals {
        if a.spec.kind != ApprovalKind::Reconcile {
            continue;
        }
        v.reconcile_approvals += 1;
        let ctx = a.spec.context.as_ref();
        let non_idempotent = ctx
            .and_then(|c| c.effect)
            .is_some_and(|eff| eff == Effect::NonIdempotent);
        let disrupted = ctx
            .and_then(|c| c.idempotency_key.as_deref())
            .is_some_and(|k| e.disrupted_keys.contains(k));
        if !(non_idempotent && disrupted) {
            v.reconcile_unexpected += 1;
            v.findings.push(format!(
                "unexpected Reconcile approval {} (run {}, step {}, effect {:?}, disrupted by the driver: {disrupted})",
                a.name_any(),
                a.spec.run_name,
                a.spec.step,
                ctx.and_then(|c| c.effect)
            ));
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::LedgerEntry;
    use agentrun_operator::api::{AgentRunStatus, StepCheckpoint};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry, Time};

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn run(name: &str, rv: u64, steps: Vec<StepCheckpoint>, phase: RunPhase) -> AgentRun {
        let mut r: AgentRun = serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1",
            "kind": "AgentRun",
            "metadata": {"name": name},
            "spec": {"steps": [
                {"name": "a", "effect": "NonIdempotent", "container": {"image": "x"}},
            ]},
        }))
        .unwrap();
        r.metadata.resource_version = Some(rv.to_string());
        r.status = Some(AgentRunStatus {
            phase: Some(phase),
            steps,
            ..Default::default()
        });
        r
    }

    /// The run as the API server returns it after the operator's status write at `written`.
    fn written_at(mut r: AgentRun, written: &str) -> AgentRun {
        r.metadata.managed_fields = Some(vec![
            ManagedFieldsEntry {
                manager: Some("kubectl-create".into()),
                operation: Some("Update".into()),
                time: Some(Time(ts("2026-01-01T10:00:00Z"))),
                ..Default::default()
            },
            ManagedFieldsEntry {
                manager: Some(labels::FIELD_MANAGER.into()),
                operation: Some("Apply".into()),
                subresource: Some("status".into()),
                time: Some(Time(ts(written))),
                ..Default::default()
            },
        ]);
        r
    }

    fn committed(step: &str, key: &str, run: &str) -> StepCheckpoint {
        StepCheckpoint {
            name: step.into(),
            plan_revision: 1,
            attempt: 1,
            idempotency_key: key.into(),
            pod: Some(format!("{run}-{step}")),
            phase: StepPhase::Succeeded,
            checkpoint: CheckpointState::Committed,
            result: Some(expected_result(run, step)),
            ..Default::default()
        }
    }

    fn started(uid: &str, key: &str, start: &str) -> LedgerEntry {
        LedgerEntry {
            event: LedgerEvent::Started,
            pod: format!("pod-{uid}"),
            namespace: "ns".into(),
            uid: uid.into(),
            run: Some("r".into()),
            step: Some("a".into()),
            idempotency_key: Some(key.into()),
            attempt: Some(1),
            role: Some("step".into()),
            started_at: ts(start),
            exit_code: None,
            outcome: None,
            finished_at: None,
        }
    }

    fn exec(uid: &str, key: &str, start: i64, outcome: Outcome, end: i64) -> [LedgerEntry; 2] {
        exec_at(
            uid,
            key,
            &Timestamp::from_second(start).unwrap().to_string(),
            outcome,
            &Timestamp::from_second(end).unwrap().to_string(),
        )
    }

    fn exec_at(uid: &str, key: &str, start: &str, outcome: Outcome, end: &str) -> [LedgerEntry; 2] {
        let s = started(uid, key, start);
        let f = s.finished(0, outcome, ts(end));
        [s, f]
    }

    fn approval(kind: &str, decision: Option<&str>, phase: &str, on_timeout: &str) -> Approval {
        let mut spec = json!({
            "runName": "r", "runUid": "u", "step": "a", "planRevision": 1,
            "kind": kind, "onTimeout": on_timeout,
            "context": {"idempotencyKey": "k", "effect": "NonIdempotent"},
        });
        if let Some(d) = decision {
            spec["decision"] = json!(d);
        }
        serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1",
            "kind": "Approval",
            "metadata": {"name": format!("r-a-{kind}").to_lowercase()},
            "spec": spec,
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    /// A Reconcile approval on key `k` answered `Retry` by `chaos-approver` at `at`.
    fn retry_at(at: &str) -> Approval {
        let mut a = approval("Reconcile", Some("Retry"), "Resolved", "Reject");
        a.metadata.managed_fields = Some(vec![
            ManagedFieldsEntry {
                manager: Some(labels::FIELD_MANAGER.into()),
                operation: Some("Update".into()),
                time: Some(Time(ts("2026-01-01T10:00:01Z"))),
                fields_v1: Some(FieldsV1(json!({"f:spec": {"f:runName": {}}}))),
                ..Default::default()
            },
            ManagedFieldsEntry {
                manager: Some("chaos-approver".into()),
                operation: Some("Update".into()),
                time: Some(Time(ts(at))),
                fields_v1: Some(FieldsV1(
                    json!({"f:spec": {"f:decision": {}, "f:comment": {}}}),
                )),
                ..Default::default()
            },
        ]);
        a
    }

    /// An observer that saw run `r` finish (so it is not unobserved).
    fn saw_finish(o: &mut Observer) {
        o.observe(
            &run("r", 1, vec![], RunPhase::Succeeded),
            Timestamp::from_second(1).unwrap(),
        );
    }

    fn judge_with(
        observer: &Observer,
        finals: &[AgentRun],
        approvals: &[Approval],
        ledger: Vec<LedgerEntry>,
    ) -> Verdict {
        let ledger = Ledger { entries: ledger };
        verdict(&Evidence {
            created: &["r".to_owned()],
            final_runs: finals,
            approvals,
            ledger: &ledger,
            observer,
            disrupted_keys: &BTreeSet::from(["k".to_owned()]),
        })
    }

    fn judge(observer: &Observer, finals: &[AgentRun], ledger: Vec<LedgerEntry>) -> Verdict {
        judge_with(observer, finals, &[], ledger)
    }

    #[test]
    fn clean_run_passes() {
        let mut o = Observer::default();
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        o.observe(&r, Timestamp::from_second(20).unwrap());
        let v = judge(
            &o,
            &[r],
            exec("1", "k", 10, Outcome::Succeeded, 11).to_vec(),
        );
        assert!(v.passed(), "{v:?}");
        assert_eq!((v.executions, v.successful_executions), (1, 1));
    }

    #[test]
    fn an_execution_after_the_commit_is_a_duplicate() {
        let mut o = Observer::default();
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        o.observe(&r, Timestamp::from_second(20).unwrap());
        let mut ledger = exec("1", "k", 10, Outcome::Succeeded, 11).to_vec();
        ledger.extend(exec("2", "k", 30, Outcome::Killed, 31));
        let v = judge(&o, &[r], ledger);
        assert_eq!((v.duplicates, v.after_commit), (1, 1), "{v:?}");
    }

    #[test]
    fn an_execution_a_second_after_the_status_write_is_a_duplicate_though_the_driver_saw_it_later()
    {
        // The driver's watch saw the commit only at 10:00:40; the API server
        // wrote it during 10:00:20.
        let mut o = Observer::default();
        let r = written_at(
            run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded),
            "2026-01-01T10:00:20Z",
        );
        o.observe(&r, ts("2026-01-01T10:00:40Z"));
        assert_eq!(
            o.committed_at["k"].written,
            Some(ts("2026-01-01T10:00:20Z"))
        );
        let mut ledger = exec_at(
            "1",
            "k",
            "2026-01-01T10:00:10Z",
            Outcome::Succeeded,
            "2026-01-01T10:00:19.5Z",
        )
        .to_vec();
        // In the second of the write: it may have started before the commit.
        ledger.extend(exec_at(
            "2",
            "k",
            "2026-01-01T10:00:20.900Z",
            Outcome::Killed,
            "2026-01-01T10:00:20.950Z",
        ));
        // A full second after it: after the commit.
        ledger.extend(exec_at(
            "3",
            "k",
            "2026-01-01T10:00:21Z",
            Outcome::Killed,
            "2026-01-01T10:00:22Z",
        ));
        let v = judge(&o, &[r], ledger);
        assert_eq!((v.duplicates, v.after_commit), (1, 1), "{v:?}");
        assert!(
            v.findings[0].contains("pod pod-3")
                && v.findings[0].contains("written 2026-01-01T10:00:20Z"),
            "{:?}",
            v.findings
        );
    }

    #[test]
    fn an_execution_after_a_committed_failure_is_a_duplicate() {
        let mut o = Observer::default();
        let mut failed = committed("a", "k", "r");
        failed.phase = StepPhase::Failed;
        failed.result = None;
        let r = run("r", 5, vec![failed], RunPhase::Failed);
        o.observe(&r, Timestamp::from_second(20).unwrap());
        let mut ledger = exec("1", "k", 10, Outcome::Failed, 11).to_vec();
        ledger.extend(exec("2", "k", 30, Outcome::Failed, 31));
        assert_eq!(judge(&o, &[r], ledger).duplicates, 1);
    }

    #[test]
    fn a_second_success_is_a_duplicate_even_before_the_commit_was_seen() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        let mut ledger = exec("1", "k", 10, Outcome::Succeeded, 11).to_vec();
        ledger.extend(exec("2", "k", 12, Outcome::Succeeded, 13));
        let v = judge(&o, &[r], ledger);
        assert_eq!((v.duplicates, v.second_success), (1, 1), "{v:?}");
    }

    #[test]
    fn two_live_executions_of_one_key_are_a_duplicate() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        // Pod 1 fails at 10:00:15, but pod 2 started at 10:00:12.
        let mut ledger = exec_at(
            "1",
            "k",
            "2026-01-01T10:00:10Z",
            Outcome::Failed,
            "2026-01-01T10:00:15Z",
        )
        .to_vec();
        ledger.extend(exec_at(
            "2",
            "k",
            "2026-01-01T10:00:12Z",
            Outcome::Succeeded,
            "2026-01-01T10:00:13Z",
        ));
        // Pod 3 started while nothing else was live, but never finished; pod 4 started under it.
        ledger.push(started("3", "k2", "2026-01-01T10:00:20Z"));
        ledger.extend(exec_at(
            "4",
            "k2",
            "2026-01-01T10:00:30Z",
            Outcome::Failed,
            "2026-01-01T10:00:31Z",
        ));
        let v = judge(&o, &[r], ledger);
        assert_eq!((v.duplicates, v.overlapping), (2, 2), "{v:?}");
        assert!(
            v.findings[0].contains("pod pod-2") && v.findings[0].contains("while pod pod-1"),
            "{:?}",
            v.findings
        );
    }

    #[test]
    fn a_retry_after_the_previous_execution_ended_is_not_an_overlap() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        let mut ledger = exec_at(
            "1",
            "k",
            "2026-01-01T10:00:10Z",
            Outcome::Failed,
            "2026-01-01T10:00:11.000Z",
        )
        .to_vec();
        ledger.extend(exec_at(
            "2",
            "k",
            "2026-01-01T10:00:11.001Z",
            Outcome::Succeeded,
            "2026-01-01T10:00:12Z",
        ));
        let v = judge(&o, &[r], ledger);
        assert!(v.passed(), "{v:?}");
    }

    #[test]
    fn a_killed_attempt_then_a_success_is_not_a_duplicate_for_an_idempotent_step() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let mut r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        r.spec.steps[0].effect = Effect::Idempotent;
        let mut ledger = exec("1", "k", 10, Outcome::Killed, 11).to_vec();
        ledger.extend(exec("2", "k", 12, Outcome::Succeeded, 13));
        assert!(judge(&o, &[r], ledger).passed());
    }

    #[test]
    fn a_non_idempotent_step_re_run_after_a_kill_needs_a_retry_decision_before_it() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        let mut ledger = exec_at(
            "1",
            "k",
            "2026-01-01T10:00:10Z",
            Outcome::Killed,
            "2026-01-01T10:00:11Z",
        )
        .to_vec();
        ledger.extend(exec_at(
            "2",
            "k",
            "2026-01-01T10:00:20Z",
            Outcome::Succeeded,
            "2026-01-01T10:00:21Z",
        ));
        let finals = [r];
        // No Reconcile approval at all.
        let v = judge_with(&o, &finals, &[], ledger.clone());
        assert_eq!((v.duplicates, v.blind_reruns), (1, 1), "{v:?}");
        assert!(
            v.findings[0].contains("pod pod-2")
                && v.findings[0].contains("after 1 killed execution(s) with 0 Retry"),
            "{:?}",
            v.findings
        );
        // Retry decided at 10:00:25, after the re-run started.
        let v = judge_with(
            &o,
            &finals,
            &[retry_at("2026-01-01T10:00:25Z")],
            ledger.clone(),
        );
        assert_eq!(v.blind_reruns, 1, "{v:?}");
        // Retry decided at 10:00:15: the re-run was asked for.
        let v = judge_with(&o, &finals, &[retry_at("2026-01-01T10:00:15Z")], ledger);
        assert!(v.passed(), "{v:?}");
    }

    #[test]
    fn a_step_behind_a_rejected_or_expired_gate_has_no_execution() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let r = run("r", 5, vec![], RunPhase::Failed);
        let ledger = exec("1", "k", 10, Outcome::Succeeded, 11).to_vec();
        let finals = [r];
        let rejected = approval("Approve", Some("Rejected"), "Rejected", "Reject");
        let v = judge_with(&o, &finals, &[rejected], ledger.clone());
        assert_eq!(v.unapproved, 1, "{v:?}");
        assert!(!v.passed());
        assert!(
            v.findings.iter().any(|f| f
                == "unapproved: run r step a pod pod-1 started 1970-01-01T00:00:10Z although approval r-a-approve was Rejected"),
            "{:?}",
            v.findings
        );
        let expired = approval("Approve", None, "Expired", "Reject");
        assert_eq!(
            judge_with(&o, &finals, &[expired], ledger.clone()).unapproved,
            1
        );
        // Expiry that means consent, or an approval, releases the step.
        let consent = approval("Approve", None, "Expired", "Approve");
        assert_eq!(
            judge_with(&o, &finals, &[consent], ledger.clone()).unapproved,
            0
        );
        let approved = approval("Approve", Some("Approved"), "Approved", "Reject");
        assert_eq!(judge_with(&o, &finals, &[approved], ledger).unapproved, 0);
    }

    #[test]
    fn a_run_never_seen_finishing_fails_the_verdict() {
        let o = Observer::default();
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        let v = judge(
            &o,
            &[r],
            exec("1", "k", 10, Outcome::Succeeded, 11).to_vec(),
        );
        assert_eq!(v.unobserved, 1, "{v:?}");
        assert!(!v.passed());
    }

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
    fn an_unexpected_reconcile_approval_fails_the_verdict() {
        let mut o = Observer::default();
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        o.observe(&r, Timestamp::from_second(20).unwrap());
        let ledger = Ledger {
            entries: exec("1", "k", 10, Outcome::Succeeded, 11).to_vec(),
        };
        let mut reconcile = approval("Reconcile", Some("MarkSucceeded"), "Resolved", "Reject");
        reconcile.spec.context.as_mut().unwrap().effect = Some(Effect::Idempotent);
        let v = verdict(&Evidence {
            created: &["r".to_owned()],
            final_runs: &[r],
            approvals: &[reconcile],
            ledger: &ledger,
            observer: &o,
            disrupted_keys: &BTreeSet::new(),
        });
        assert_eq!((v.reconcile_approvals, v.reconcile_unexpected), (1, 1));
        assert!(!v.passed(), "{v:?}");
    }

    #[test]
    fn a_changed_checkpoint_or_terminal_phase_loses_the_run() {
        let mut o = Observer::default();
        let t = Timestamp::from_second(20).unwrap();
        o.observe(
            &run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded),
            t,
        );
        let mut changed = committed("a", "k", "r");
        changed.attempt = 2;
        let r = run("r", 6, vec![changed], RunPhase::Running);
        o.observe(&r, t);
        assert_eq!(o.violations.len(), 2, "{:?}", o.violations);
        let v = judge(
            &o,
            &[r],
            exec("1", "k", 10, Outcome::Succeeded, 11).to_vec(),
        );
        assert_eq!((v.lost, v.stuck), (1, 1), "{v:?}");
    }

    #[test]
    fn a_dropped_success_and_a_vanished_run_are_lost() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let v = judge(&o, &[], exec("1", "k", 10, Outcome::Succeeded, 11).to_vec());
        assert_eq!(v.lost, 1);
        assert_eq!(v.findings.len(), 2, "{:?}", v.findings);
    }
}
