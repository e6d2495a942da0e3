//! The reconciler's scenarios on the real control plane: the operator and the
//! simulated kubelet run as real processes; each scenario asserts on the
//! side-effect ledger (what the steps really did) and on the run's status.
//!
//! One file per concern, under `scenarios/`:
//!
//! - `reporting.rs`: a run from start to finish, one execution per key, and
//!   what it says about itself (status, Events, `kubectl get` columns,
//!   `/metrics`), also with step Events turned off;
//! - `crashes.rs`: the operator killed at a failpoint, or down while a step's
//!   Pod succeeds, resumes without duplicates or lost results;
//! - `disruption.rs`: an evicted step runs again under its key; a deleted
//!   non-idempotent one asks a person (D6);
//! - `approvals.rs`: gates that hold across restarts and expiry (D10) and
//!   release only the step they asked about (D14);
//! - `freshness.rs`: a stale input re-plans and re-runs under new keys (D8);
//! - `failures.rs`: retries with backoff, compensation in reverse, the token
//!   budget (D9);
//! - `lifecycle.rs`: the TTL (D12) and every deletion mode giving up the
//!   result finalizer (D5);
//! - `leader_election.rs`: a standby that takes over, a restarted leader that
//!   takes its Lease back;
//! - `stalls.rs`: a Pod the API server refuses says so (D13, D16); a run the
//!   operator cannot read is `tests/unreadable.rs`, a binary of its own,
//!   because it replaces the cluster's AgentRun CRD;
//! - `step_pods.rs`: each run's Pods named its own, and the context the step
//!   SDK reads from a step's Pod.
//!
//! What several of them use is here: the step lookups, the ledger's checks
//! (one success per key, executions of a step), the released finalizers, the
//! four-step run, the gated run and its Approval, the Events on a run.

#[path = "scenarios/approvals.rs"]
mod approvals;
#[path = "scenarios/crashes.rs"]
mod crashes;
#[path = "scenarios/disruption.rs"]
mod disruption;
#[path = "scenarios/failures.rs"]
mod failures;
#[path = "scenarios/freshness.rs"]
mod freshness;
#[path = "scenarios/leader_election.rs"]
mod leader_election;
#[path = "scenarios/lifecycle.rs"]
mod lifecycle;
#[path = "scenarios/reporting.rs"]
mod reporting;
#[path = "scenarios/stalls.rs"]
mod stalls;
#[path = "scenarios/step_pods.rs"]
mod step_pods;

use std::time::Duration;

use agentrun_e2e::support::scenario::{Scenario, field_managers, phase, sim_step, status};
use agentrun_operator::api::{AgentRun, RunPhase, StepCheckpoint, StepPhase};
use agentrun_operator::labels;
use kube::ResourceExt;
use serde_json::json;

pub(crate) const RUN_TIMEOUT: Duration = Duration::from_secs(90);

pub(crate) fn step<'a>(run: &'a AgentRun, name: &str) -> &'a StepCheckpoint {
    run.status
        .as_ref()
        .and_then(|s| {
            s.steps
                .iter()
                .rev()
                .find(|c| c.name == name && c.role.is_step())
        })
        .unwrap_or_else(|| panic!("no checkpoint for step {name}"))
}

pub(crate) fn step_opt<'a>(run: &'a AgentRun, name: &str) -> Option<&'a StepCheckpoint> {
    run.status.as_ref().and_then(|s| {
        s.steps
            .iter()
            .rev()
            .find(|c| c.name == name && c.role.is_step())
    })
}

/// Asserts every idempotency key the run committed as succeeded ran exactly
/// once successfully, and that no key ran after its success (no duplicate).
pub(crate) fn assert_one_success_per_key(s: &Scenario, run: &AgentRun) {
    let ledger = s.ledger();
    let successes = ledger.successes_by_key();
    for c in &status(run).steps {
        if c.phase == StepPhase::Succeeded && c.pod.is_some() {
            assert_eq!(
                successes.get(&c.idempotency_key).copied().unwrap_or(0),
                1,
                "step {} (key {}) must have exactly one successful execution; ledger: {:?}",
                c.name,
                c.idempotency_key,
                ledger.entries
            );
        }
    }
    for (key, n) in &successes {
        assert!(
            *n <= 1,
            "key {key} succeeded {n} times: a committed step ran again"
        );
    }
}

/// Every step Pod gives up its result finalizer once the run is done (D5),
/// and, having ended, is labelled out of the operator's Pod watch; it is
/// kept, with its logs, until its run is deleted.
pub(crate) async fn assert_finalizers_released(s: &Scenario) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let pods = s.list_pods().await;
        assert!(!pods.is_empty(), "the run's Pods are kept");
        let held: Vec<String> = pods
            .iter()
            .filter(|p| {
                p.finalizers().iter().any(|f| f == labels::RESULT_FINALIZER)
                    || p.labels().get(labels::RELEASED).map(String::as_str) != Some("true")
            })
            .map(|p| p.name_any())
            .collect();
        if held.is_empty() {
            // Every write to a step Pod names its writer: the operator (the
            // create and the release), the kubelet (its status) and, on a
            // plane with the real (tainted) node joined, the scheduler (the
            // Pod's PodScheduled condition: unschedulable there).
            for p in &pods {
                let managers = field_managers(&p.metadata);
                assert!(
                    managers.iter().all(|m| [
                        labels::FIELD_MANAGER,
                        "simkubelet",
                        "kube-scheduler"
                    ]
                    .contains(&m.as_str())),
                    "pod {} was written by {managers:?}",
                    p.name_any()
                );
            }
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "pods still hold the result finalizer or are not labelled {}: {held:?}",
            labels::RELEASED
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub(crate) fn four_steps() -> serde_json::Value {
    json!({"steps": [
        sim_step("lookup-order", "None", json!({"runMs": 50, "result": {"orderId": 4711}, "tokens": {"input": 100, "output": 20}})),
        sim_step("draft-refund", "None", json!({"runMs": 50, "result": {"amount": "23.90"}, "tokens": {"input": 300, "output": 80}})),
        sim_step("issue-refund", "NonIdempotent", json!({"runMs": 50, "result": {"refundId": "r-1"}})),
        sim_step("notify-customer", "Idempotent", json!({"runMs": 50, "result": {"sent": true}, "tokens": {"input": 10, "output": 5}})),
    ]})
}

pub(crate) fn gated(timeout: Option<&str>, on_timeout: &str) -> serde_json::Value {
    let mut approval =
        json!({"required": true, "question": "Issue the refund?", "onTimeout": on_timeout});
    if let Some(t) = timeout {
        approval["timeout"] = json!(t);
    }
    json!({"steps": [
        sim_step("draft", "None", json!({"runMs": 50, "result": {"amount": 5}})),
        {"name": "issue", "effect": "NonIdempotent", "approval": approval,
         "container": {"image": "registry.example/pay:1", "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50}).to_string()}]}},
    ]})
}

pub(crate) async fn wait_for_gate(s: &Scenario, run: &str) -> String {
    let waiting = s
        .wait_run(run, "waiting for approval", RUN_TIMEOUT, |r| {
            phase(r) == Some(RunPhase::WaitingForApproval)
                && step_opt(r, "issue").is_some_and(|c| c.approval.is_some())
        })
        .await;
    let name = step(&waiting, "issue").approval.clone().unwrap();
    asked(s, &name).await;
    name
}

/// The Approval a run named in its status, once it exists: the run names it
/// just before creating it.
pub(crate) async fn asked(s: &Scenario, name: &str) -> agentrun_operator::api::Approval {
    agentrun_e2e::wait_for(
        &s.approvals(),
        name,
        |a: Option<&agentrun_operator::api::Approval>| a.is_some(),
        Duration::from_secs(30),
    )
    .await
    .unwrap_or_else(|| panic!("Approval {name} was named but never created"))
}

pub(crate) use agentrun_e2e::support::scenario::event_counts;

/// The ledger's executions of one step of one run.
pub(crate) fn executions_of(s: &Scenario, run: &str, step: &str) -> usize {
    s.ledger()
        .executions()
        .filter(|e| e.run.as_deref() == Some(run) && e.step.as_deref() == Some(step))
        .count()
}
