//! Named cases for every rule of the engine, one module per durability
//! guarantee (D1–D16 in the design); the helpers here are shared by all.

use jiff::SignedDuration;
use serde_json::json;

use super::reasons::{ConditionType, Reason};
use super::testing::*;
use super::{Action, Decision, EventType, Refusal, RefusalCause, Tally};
use agentrun_api::labels;
use agentrun_api::{
    AgentRun, ApprovalKind, ApprovalPhase, CheckpointState, Decision as Answer, Duration, Effect,
    EffectOutcome, OnTimeout, PlanSource, RunPhase, StepCheckpoint, StepPhase, StepRole,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

mod d01_d02_launch;
mod d03_d05_commit;
mod d04_graphs;
mod d06_d07_failure_and_disruption;
mod d06_unknown_outcomes;
mod d06_verify;
mod d07_result_schema;
mod d07_saga;
mod d08_freshness;
mod d09_budgets_and_limits;
mod d10_d14_approvals;
mod d10_signals;
mod d10_waits;
mod d11_bounded_status;
mod d12_d13_lifecycle;
mod d12_queued;
mod d14_fork;
mod d16_stalls;
mod d18_history;
mod d19_journal;

/// The idempotency key of step `a` at plan revision 1 of the test run (UID
/// `run-uid`), computed outside the code under test:
/// `python3 -c "import hashlib; print(hashlib.sha256(b'run-uid\\x00a\\x001').hexdigest()[:32])"`.
pub(super) const KEY_A_R1: &str = "4f5e1fac634d7b33a6e863ae81245ce6";

pub(super) fn creates(d: &Decision) -> Vec<String> {
    d.actions
        .iter()
        .filter_map(|a| match a {
            Action::CreatePod(p) => p.metadata.name.clone(),
            _ => None,
        })
        .collect()
}

pub(super) fn releases(d: &Decision) -> Vec<String> {
    d.actions
        .iter()
        .filter_map(|a| match a {
            Action::ReleaseFinalizer { pod } => Some(pod.clone()),
            _ => None,
        })
        .collect()
}

pub(super) fn deletes(d: &Decision) -> Vec<String> {
    d.actions
        .iter()
        .filter_map(|a| match a {
            Action::DeletePod { name, .. } => Some(name.clone()),
            _ => None,
        })
        .collect()
}

pub(super) fn events(d: &Decision) -> Vec<Reason> {
    d.actions
        .iter()
        .filter_map(|a| match a {
            Action::Event { reason, .. } => Some(*reason),
            _ => None,
        })
        .collect()
}

pub(super) fn cp(w: &World, name: &str, rev: i64) -> StepCheckpoint {
    w.status()
        .steps
        .into_iter()
        .find(|c| c.name == name && c.plan_revision == rev && c.role == StepRole::Step)
        .unwrap_or_else(|| panic!("no checkpoint {name}@{rev}"))
}

pub(super) fn condition(w: &World, type_: ConditionType) -> Condition {
    w.status()
        .conditions
        .into_iter()
        .find(|c| c.type_ == type_)
        .unwrap_or_else(|| panic!("no {type_}"))
}

pub(super) fn condition_of(w: &World, type_: ConditionType) -> (String, String) {
    let c = condition(w, type_);
    (c.status, c.reason)
}

/// The run ended in `phase` with `Succeeded=False` for `reason`.
pub(super) fn assert_ended(w: &World, phase: RunPhase, reason: Reason) {
    assert_eq!(w.status().phase, Some(phase));
    assert_eq!(
        condition_of(w, ConditionType::Succeeded),
        ("False".into(), reason.into())
    );
}

/// A message is there and contains `want`.
pub(super) fn assert_says(message: Option<&str>, want: &str) {
    assert!(
        message.is_some_and(|m| m.contains(want)),
        "{message:?} does not say {want:?}"
    );
}

/// The decision re-planned and started nothing: the re-plan is committed
/// before anything runs (D8).
pub(super) fn assert_replanned_first(d: &Decision) {
    assert!(
        creates(d).is_empty(),
        "the re-plan is committed before anything runs"
    );
    assert!(events(d).contains(&Reason::Replanned));
}

/// A one-step run whose step `a` is NonIdempotent and running.
pub(super) fn non_idempotent_a_running() -> World {
    let mut w =
        World::new(AgentRun::test().with_steps([step("a").with_effect(Effect::NonIdempotent)]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w
}

pub(super) fn secs(n: i64) -> Option<SignedDuration> {
    Some(SignedDuration::from_secs(n))
}

pub(super) fn two_steps() -> AgentRun {
    AgentRun::test().with_steps([step("a"), step("b")])
}

/// The context a step Pod receives (its `agentrun.dev/context` annotation).
pub(super) fn context_of(pod: &k8s_openapi::api::core::v1::Pod) -> serde_json::Value {
    let text = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(labels::CONTEXT))
        .expect("a context annotation");
    serde_json::from_str(text).expect("the context is JSON")
}
