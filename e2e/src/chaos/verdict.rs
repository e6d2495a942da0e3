//! The chaos verdict: what the steps really did (the simkubelet ledger), what
//! the runs committed (every status version the driver saw, and the final
//! statuses), judged against the durability contract.
//!
//! ```text
//!   watch AgentRuns ──▶ Observer: first sight of every committed checkpoint,
//!                                 any later change or disappearance of it (D3),
//!                                 any change of a terminal phase, any vanished run
//!   ledger + final statuses + Reconcile approvals ──▶ verdict()
//! ```
//!
//! Definitions (also in e2e/README.md, "Chaos suite"):
//!
//! - **duplicate**: one execution (a ledger `started` line) of an idempotency key
//!   that either started after the driver had already seen the key's outcome
//!   (Succeeded, or Failed for good) committed in status, or finished `Succeeded` while an earlier-finished
//!   execution of the same key had already succeeded. The scripted approver answers
//!   `Retry` to a Reconcile approval only when the ledger shows no success and no
//!   running execution for the key, so no legitimate execution is counted.
//! - **lost** (runs): a run that vanished; a run whose committed checkpoint (step or
//!   compensation) changed or disappeared in a later status, or whose terminal phase
//!   changed; a committed `Succeeded` step whose result is not the one the step
//!   reported, or that no execution of its key succeeded (and no person marked it
//!   succeeded); a successful execution whose key is not committed `Succeeded` (a
//!   dropped result, D5).
//! - **stuck** (runs): not in a terminal phase when the settle deadline passed
//!   (the approver answers every Approval, so a run waiting for one is stuck too).
//! - **reconcile_approvals**: Approvals of kind `Reconcile`; an unexpected one is on
//!   a step that is not NonIdempotent or none of whose Pods the driver disrupted.

use std::collections::{BTreeMap, BTreeSet};

use agentrun_operator::api::{
    AgentRun, Approval, ApprovalKind, CheckpointState, Decision, RunPhase, StepPhase,
};
use jiff::Timestamp;
use kube::ResourceExt;
use serde_json::{Value, json};

use super::workload::expected_result;
use crate::ledger::{Ledger, LedgerEvent, Outcome};

/// What the driver saw while the runs went on.
#[derive(Debug, Default)]
pub struct Observer {
    runs: BTreeMap<String, SeenRun>,
    /// Per idempotency key, when its outcome (Succeeded or Failed) was first seen
    /// committed, and that outcome.
    pub committed_at: BTreeMap<String, (Timestamp, StepPhase)>,
    /// Per run, what broke the contract.
    pub violations: Vec<(String, String)>,
    /// Status versions looked at.
    pub versions: u64,
}

#[derive(Debug, Default)]
struct SeenRun {
    resource_version: u64,
    committed: BTreeMap<String, Value>,
    terminal: Option<RunPhase>,
}

impl Observer {
    /// Looks at one version of a run, seen at `now`.
    pub fn observe(&mut self, run: &AgentRun, now: Timestamp) {
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
                .or_insert((now, c.phase));
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
                .or_insert((now, c.phase));
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
        self.violations
            .push((name.to_owned(), "the run was deleted".to_owned()));
    }

    /// Runs seen in a terminal phase.
    pub fn terminal(&self) -> usize {
        self.runs.values().filter(|r| r.terminal.is_some()).count()
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
    pub duplicates: usize,
    pub lost: usize,
    pub stuck: usize,
    pub reconcile_approvals: usize,
    pub reconcile_unexpected: usize,
    /// Outcomes of the runs, by phase.
    pub phases: BTreeMap<String, usize>,
    /// One line per finding.
    pub findings: Vec<String>,
}

impl Verdict {
    pub fn passed(&self) -> bool {
        self.duplicates == 0 && self.lost == 0 && self.stuck == 0
    }
}

struct Execution<'a> {
    uid: &'a str,
    pod: &'a str,
    run: &'a str,
    started_at: Timestamp,
    outcome: Option<Outcome>,
    finished_at: Option<Timestamp>,
}

/// Computes the verdict from the evidence.
pub fn verdict(e: &Evidence<'_>) -> Verdict {
    let mut v = Verdict {
        runs: e.created.len(),
        ..Verdict::default()
    };
    let mut lost_runs: BTreeSet<String> = BTreeSet::new();

    // Executions per key, paired by Pod UID.
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
            started_at: s.started_at,
            outcome: finished.and_then(|f| f.outcome),
            finished_at: finished.and_then(|f| f.finished_at),
        });
    }
    v.executions = by_key.values().map(Vec::len).sum();

    // Duplicates.
    for (key, execs) in &by_key {
        let first_success = execs
            .iter()
            .filter(|x| x.outcome == Some(Outcome::Succeeded))
            .min_by_key(|x| x.finished_at);
        let committed_at = e.observer.committed_at.get(*key);
        for x in execs {
            let succeeded = x.outcome == Some(Outcome::Succeeded);
            if succeeded {
                v.successful_executions += 1;
            }
            let after_commit = committed_at.is_some_and(|(c, _)| x.started_at > *c);
            let second_success = succeeded && first_success.is_some_and(|f| f.uid != x.uid);
            if after_commit || second_success {
                v.duplicates += 1;
                v.findings.push(format!(
                    "duplicate: run {} key {key} pod {} started {} ({:?}){}{}",
                    x.run,
                    x.pod,
                    x.started_at,
                    x.outcome,
                    if after_commit {
                        format!(
                            ", after its outcome was committed ({})",
                            committed_at
                                .map(|(t, p)| format!("{p:?}, seen {t}"))
                                .unwrap_or_default()
                        )
                    } else {
                        String::new()
                    },
                    if second_success {
                        format!(
                            ", a second success (first: pod {})",
                            first_success.map(|f| f.pod).unwrap_or_default()
                        )
                    } else {
                        String::new()
                    },
                ));
            }
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
    }
    for (run, what) in &e.observer.violations {
        lost_runs.insert(run.clone());
        v.findings.push(format!("lost: run {run}: {what}"));
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
            .is_some_and(|eff| eff == agentrun_operator::api::Effect::NonIdempotent);
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

    fn run(name: &str, rv: u64, steps: Vec<StepCheckpoint>, phase: RunPhase) -> AgentRun {
        let mut r = AgentRun::new(name, Default::default());
        r.metadata.resource_version = Some(rv.to_string());
        r.status = Some(AgentRunStatus {
            phase: Some(phase),
            steps,
            ..Default::default()
        });
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

    fn exec(uid: &str, key: &str, start: i64, outcome: Outcome, end: i64) -> [LedgerEntry; 2] {
        let s = LedgerEntry {
            event: LedgerEvent::Started,
            pod: format!("pod-{uid}"),
            namespace: "ns".into(),
            uid: uid.into(),
            run: Some("r".into()),
            step: Some("a".into()),
            idempotency_key: Some(key.into()),
            attempt: Some(1),
            role: Some("step".into()),
            started_at: Timestamp::from_second(start).unwrap(),
            exit_code: None,
            outcome: None,
            finished_at: None,
        };
        let f = s.finished(0, outcome, Timestamp::from_second(end).unwrap());
        [s, f]
    }

    fn judge(observer: &Observer, finals: &[AgentRun], ledger: Vec<LedgerEntry>) -> Verdict {
        let ledger = Ledger { entries: ledger };
        verdict(&Evidence {
            created: &["r".to_owned()],
            final_runs: finals,
            approvals: &[],
            ledger: &ledger,
            observer,
            disrupted_keys: &BTreeSet::new(),
        })
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
        assert_eq!(v.duplicates, 1, "{v:?}");
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
        let o = Observer::default();
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        let mut ledger = exec("1", "k", 10, Outcome::Succeeded, 11).to_vec();
        ledger.extend(exec("2", "k", 12, Outcome::Succeeded, 13));
        assert_eq!(judge(&o, &[r], ledger).duplicates, 1);
    }

    #[test]
    fn a_killed_attempt_then_a_success_is_not_a_duplicate() {
        let o = Observer::default();
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        let mut ledger = exec("1", "k", 10, Outcome::Killed, 11).to_vec();
        ledger.extend(exec("2", "k", 12, Outcome::Succeeded, 13));
        assert!(judge(&o, &[r], ledger).passed());
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
        let o = Observer::default();
        let v = judge(&o, &[], exec("1", "k", 10, Outcome::Succeeded, 11).to_vec());
        assert_eq!(v.lost, 1);
        assert_eq!(v.findings.len(), 2, "{:?}", v.findings);
    }
}
