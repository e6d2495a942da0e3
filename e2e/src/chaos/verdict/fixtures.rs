//! Hand-built evidence for the rules' tests: runs, checkpoints, ledger lines
//! and Approvals, with fixed times and keys.

use std::collections::BTreeSet;

use agentrun_operator::api::{
    AgentRun, AgentRunStatus, Approval, CheckpointState, Effect, RunPhase, StepCheckpoint,
    StepJournal, StepPhase,
};
use agentrun_operator::labels;
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry, Time};
use serde_json::json;

use super::{Evidence, Observer, Verdict, verdict};
use crate::chaos::workload::expected_result;
use crate::ledger::{Ledger, LedgerEntry, LedgerEvent, Outcome};

pub fn ts(s: &str) -> Timestamp {
    s.parse().unwrap()
}

/// Run `name` with one step `a` (NonIdempotent) at resourceVersion `rv`.
pub fn run(name: &str, rv: u64, steps: Vec<StepCheckpoint>, phase: RunPhase) -> AgentRun {
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

/// The run with step `a` declared `effect`.
pub fn with_effect(mut r: AgentRun, effect: Effect) -> AgentRun {
    r.spec.steps[0].effect = effect;
    r
}

/// The run as the API server returns it after the operator's status write at `written`.
pub fn written_at(mut r: AgentRun, written: &str) -> AgentRun {
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

/// A committed success of `step` under `key`, with the result the workload reports.
pub fn committed(step: &str, key: &str, run: &str) -> StepCheckpoint {
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

/// The `started` line of Pod `pod-<uid>` of run `r` step `a` under `key`.
pub fn started(uid: &str, key: &str, start: &str) -> LedgerEntry {
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
        reported_effect: None,
        acted: None,
        call: None,
    }
}

/// An execution from second `start` to second `end` of the epoch.
pub fn exec(uid: &str, key: &str, start: i64, outcome: Outcome, end: i64) -> [LedgerEntry; 2] {
    exec_at(
        uid,
        key,
        &Timestamp::from_second(start).unwrap().to_string(),
        outcome,
        &Timestamp::from_second(end).unwrap().to_string(),
    )
}

pub fn exec_at(uid: &str, key: &str, start: &str, outcome: Outcome, end: &str) -> [LedgerEntry; 2] {
    let s = started(uid, key, start);
    let f = s.finished(0, outcome, ts(end));
    [s, f]
}

/// The execution's finished line says `effect: NotApplied`.
pub fn not_applied([s, f]: [LedgerEntry; 2]) -> [LedgerEntry; 2] {
    [
        s,
        f.reporting(Some(agentrun_operator::api::EffectOutcome::NotApplied)),
    ]
}

/// The execution's finished line says whether it acted.
pub fn acting([s, f]: [LedgerEntry; 2], acted: bool) -> [LedgerEntry; 2] {
    [s, f.acting(acted)]
}

/// A verify probe of run `r` step `a` under `key`, from `start` to `end`,
/// that exited 0 answering `answer`.
pub fn probe(uid: &str, key: &str, start: &str, answer: &str, end: &str) -> [LedgerEntry; 2] {
    let mut s = started(uid, key, start);
    s.role = Some("verify".into());
    let answer = serde_json::from_value(json!(answer)).unwrap();
    let f = s
        .finished(0, Outcome::Succeeded, ts(end))
        .reporting(Some(answer))
        .acting(false);
    [s, f]
}

/// An Approval about run `r` step `a` key `k` (a NonIdempotent step).
pub fn approval(kind: &str, decision: Option<&str>, phase: &str, on_timeout: &str) -> Approval {
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

/// The approval, about `key` and named `name`.
pub fn about(mut a: Approval, name: &str, key: &str) -> Approval {
    a.metadata.name = Some(name.into());
    a.spec.context.as_mut().unwrap().idempotency_key = Some(key.into());
    a
}

/// The approval, created at `at` (whole seconds, as the API server says).
pub fn created_at(mut a: Approval, at: &str) -> Approval {
    a.metadata.creation_timestamp = Some(Time(ts(at)));
    a
}

/// The approval asks whether to act again after `earlier_key` acted at revision 1.
pub fn repeating(mut a: Approval, earlier_key: &str) -> Approval {
    a.spec.context.as_mut().unwrap().repeats = Some(
        serde_json::from_value(json!({
            "idempotencyKey": earlier_key, "planRevision": 1, "effect": "Applied",
        }))
        .unwrap(),
    );
    a
}

/// The approval's decision was written by `chaos-approver` at `at`.
pub fn decided_at(mut a: Approval, at: &str) -> Approval {
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

/// An approved repeat of step `a` under `k2` (it acted under `k1` at plan
/// revision 1), decided at `at`.
pub fn repeat_approved(at: &str) -> Approval {
    decided_at(
        repeating(
            about(
                approval("Approve", Some("Approved"), "Approved", "Reject"),
                "r-a-r2",
                "k2",
            ),
            "k1",
        ),
        at,
    )
}

/// A Reconcile approval on key `k` answered `Retry` by `chaos-approver` at `at`.
pub fn retry_at(at: &str) -> Approval {
    decided_at(
        approval("Reconcile", Some("Retry"), "Resolved", "Reject"),
        at,
    )
}

/// An observer that saw run `r` finish (so it is not unobserved).
pub fn saw_finish(o: &mut Observer) {
    o.observe(
        &run("r", 1, vec![], RunPhase::Succeeded),
        Timestamp::from_second(1).unwrap(),
    );
}

/// The verdict on run `r`, whose key `k` the driver disrupted.
pub fn judge_with(
    observer: &Observer,
    finals: &[AgentRun],
    approvals: &[Approval],
    ledger: Vec<LedgerEntry>,
) -> Verdict {
    judge_disrupted(observer, finals, approvals, ledger, &["k"])
}

pub fn judge_disrupted(
    observer: &Observer,
    finals: &[AgentRun],
    approvals: &[Approval],
    ledger: Vec<LedgerEntry>,
    disrupted: &[&str],
) -> Verdict {
    judge_journaled(observer, finals, approvals, ledger, disrupted, &[], &[])
}

/// The verdict with the step journals at the end and the calls each
/// journaled step declares.
pub fn judge_journaled(
    observer: &Observer,
    finals: &[AgentRun],
    approvals: &[Approval],
    ledger: Vec<LedgerEntry>,
    disrupted: &[&str],
    journals: &[StepJournal],
    declared: &[(&str, &str, &[&str])],
) -> Verdict {
    let ledger = Ledger { entries: ledger };
    let disrupted: BTreeSet<String> = disrupted.iter().map(|k| (*k).to_owned()).collect();
    let declared = declared
        .iter()
        .map(|(run, step, calls)| {
            (
                ((*run).to_owned(), (*step).to_owned()),
                calls.iter().map(|c| (*c).to_owned()).collect(),
            )
        })
        .collect();
    verdict(&Evidence {
        created: &["r".to_owned()],
        final_runs: finals,
        approvals,
        ledger: &ledger,
        observer,
        disrupted_keys: &disrupted,
        journals,
        declared_calls: &declared,
    })
}

pub fn judge(observer: &Observer, finals: &[AgentRun], ledger: Vec<LedgerEntry>) -> Verdict {
    judge_with(observer, finals, &[], ledger)
}
