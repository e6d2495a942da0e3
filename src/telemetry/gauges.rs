//! The gauges computed from the caches at scrape time (pure): what the
//! alerts of the chart's PrometheusRule watch. Keyed by namespace at most.

use std::collections::BTreeMap;

use jiff::Timestamp;

use crate::api::{AgentRun, Approval, ApprovalPhase, RunPhase};
use crate::engine::ConditionType;

/// Every phase, so a phase with no run reads 0 rather than vanishing.
pub const PHASES: [RunPhase; 11] = [
    RunPhase::Pending,
    RunPhase::Queued,
    RunPhase::Planning,
    RunPhase::Running,
    RunPhase::WaitingForApproval,
    RunPhase::Waiting,
    RunPhase::Compensating,
    RunPhase::Succeeded,
    RunPhase::Failed,
    RunPhase::Cancelled,
    RunPhase::AlreadyRan,
];

#[derive(Debug, Default, PartialEq)]
pub struct Gauges {
    pub runs_by_phase: BTreeMap<String, i64>,
    pub approvals_pending: i64,
    /// Seconds until the soonest expiry of a pending Approval, per namespace.
    pub approval_expiry: BTreeMap<String, f64>,
    /// Runs with `Stalled=True`, per namespace (namespaces with none left out).
    pub runs_stalled: BTreeMap<String, i64>,
    /// The longest time an active run has gone without progress, per namespace.
    pub progress_age: BTreeMap<String, f64>,
}

pub fn compute<'a>(
    runs: impl IntoIterator<Item = &'a AgentRun>,
    approvals: impl IntoIterator<Item = &'a Approval>,
    now: Timestamp,
) -> Gauges {
    let mut g = Gauges::default();
    let mut by_phase: BTreeMap<String, i64> =
        PHASES.iter().map(|p| (format!("{p:?}"), 0)).collect();
    for run in runs {
        let ns = run.metadata.namespace.clone().unwrap_or_default();
        let empty = crate::api::AgentRunStatus::default();
        let status = run.status.as_ref().unwrap_or(&empty);
        let phase = status.phase.unwrap_or(RunPhase::Pending);
        *by_phase.entry(format!("{phase:?}")).or_default() += 1;
        let stalled = status
            .conditions
            .iter()
            .any(|c| c.type_ == ConditionType::Stalled.as_str() && c.status == "True");
        if stalled {
            *g.runs_stalled.entry(ns.clone()).or_default() += 1;
        }
        // Waiting for a person, a wait step's time or a place in the queue
        // is not a stall.
        let active = !phase.is_terminal()
            && phase != RunPhase::WaitingForApproval
            && phase != RunPhase::Waiting
            && phase != RunPhase::Queued
            && !run.spec.suspend
            && !run.spec.cancel;
        if !active {
            continue;
        }
        // Progress: the run's start, any step or compensation launched or ended.
        let last = status
            .steps
            .iter()
            .flat_map(|c| [c.started_at.as_ref(), c.finished_at.as_ref()])
            .chain(
                status
                    .compensations
                    .iter()
                    .flat_map(|c| [c.started_at.as_ref(), c.finished_at.as_ref()]),
            )
            .chain([status.started_at.as_ref()])
            .flatten()
            .map(|t| t.0)
            .chain(run.metadata.creation_timestamp.as_ref().map(|t| t.0))
            .max();
        if let Some(last) = last {
            let age = now.duration_since(last).as_secs_f64().max(0.0);
            let e = g.progress_age.entry(ns).or_insert(0.0);
            *e = e.max(age);
        }
    }
    g.runs_by_phase = by_phase;
    for a in approvals {
        let pending =
            a.status.as_ref().map(|s| s.phase).unwrap_or_default() == ApprovalPhase::Pending;
        if !pending {
            continue;
        }
        g.approvals_pending += 1;
        if let Some(expires) = &a.spec.expires_at {
            let ns = a.metadata.namespace.clone().unwrap_or_default();
            let left = expires.0.duration_since(now).as_secs_f64();
            let e = g.approval_expiry.entry(ns).or_insert(f64::INFINITY);
            *e = e.min(left);
        }
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(ns: &str, status: serde_json::Value, suspend: bool) -> AgentRun {
        serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
            "metadata": {"name": "r", "namespace": ns, "creationTimestamp": "2027-01-01T00:00:00Z"},
            "spec": {"steps": [{"name": "a", "container": {"image": "x"}}], "suspend": suspend},
            "status": status,
        }))
        .unwrap()
    }

    fn approval(ns: &str, expires: &str, phase: &str) -> Approval {
        serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "Approval",
            "metadata": {"name": "a", "namespace": ns},
            "spec": {"runName": "r", "runUid": "u", "step": "a", "planRevision": 1,
                     "kind": "Approve", "question": "?", "expiresAt": expires},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn stuck_stalled_and_expiring_are_seen_per_namespace() {
        let runs = [
            // Running, last step launched at 00:10: 50 minutes without progress.
            run(
                "a",
                json!({"phase": "Running", "startedAt": "2027-01-01T00:00:00Z",
                "steps": [{"name": "a", "planRevision": 1, "attempt": 1, "idempotencyKey": "k",
                           "phase": "Running", "startedAt": "2027-01-01T00:10:00Z"}]}),
                false,
            ),
            // Waiting for a person and suspended runs are not stuck.
            run(
                "a",
                json!({"phase": "WaitingForApproval", "startedAt": "2026-12-01T00:00:00Z"}),
                false,
            ),
            run(
                "b",
                json!({"phase": "Running", "startedAt": "2026-12-01T00:00:00Z"}),
                true,
            ),
            run(
                "b",
                json!({"phase": "Running", "startedAt": "2027-01-01T00:59:00Z",
                "conditions": [{"type": "Stalled", "status": "True", "reason": "PodRefused",
                                "message": "m", "lastTransitionTime": "2027-01-01T00:59:00Z"}]}),
                false,
            ),
            run(
                "c",
                json!({"phase": "Succeeded", "startedAt": "2026-01-01T00:00:00Z"}),
                false,
            ),
        ];
        let approvals = [
            approval("a", "2027-01-01T01:05:00Z", "Pending"),
            approval("a", "2027-01-01T01:30:00Z", "Pending"),
            approval("b", "2027-01-01T00:30:00Z", "Approved"),
        ];
        let g = compute(&runs, &approvals, at("2027-01-01T01:00:00Z"));
        assert_eq!(g.runs_by_phase["Running"], 3);
        assert_eq!(g.runs_by_phase["Compensating"], 0);
        assert_eq!(g.approvals_pending, 2);
        assert_eq!(g.approval_expiry, BTreeMap::from([("a".into(), 300.0)]));
        assert_eq!(g.runs_stalled, BTreeMap::from([("b".into(), 1)]));
        assert_eq!(
            g.progress_age,
            BTreeMap::from([("a".into(), 3000.0), ("b".into(), 60.0)])
        );
    }
}
