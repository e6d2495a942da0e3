//! A simulated journaled loop (simkubelet's `SIM_STEP.journal`) under the
//! operator, killed at the two points where a NonIdempotent call may or may
//! not have acted, judged by the ledger of calls made (D19):
//!
//! ```text
//!   a1: model-0 ─ Intent(call_1) ─✂─ (call_1 not made)            probe: NotApplied ─▶ a2 makes call_1 once
//!   a1: model-0 ─ Intent(call_1) ─ call_1 made ─✂─ (no answer)    probe: Applied    ─▶ a2 replays, makes nothing again
//! ```
//!
//! The chaos run kills such loops at random points; these two kill at each
//! point on purpose, so the simulation itself is shown to stop where it stands.
//! A third has the API server refuse the settlement (an admission policy):
//! the run says so (D16) and goes on once the policy is gone.

use std::time::Duration;

use agentrun_e2e::ledger::Ledger;
use agentrun_e2e::support::scenario::{Scenario, event_counts, phase, sim_step};
use agentrun_operator::api::{CallState, EffectOutcome, RunPhase, StepJournal};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(90);

/// A run whose journaled NonIdempotent step `agent` asks a model, then calls
/// a tool that waits `act_ms` after its intent and `record_ms` after the call.
fn loop_run(act_ms: u64, record_ms: u64) -> Value {
    let mut agent = sim_step(
        "agent",
        "NonIdempotent",
        json!({"result": {"ok": true}, "journal": {"calls": [
            {"kind": "Model"},
            {"kind": "Tool", "actMs": act_ms, "recordMs": record_ms},
        ]}}),
    );
    agent["journal"] = json!({});
    agent["verify"] = json!({
        "image": "registry.example/agent-step:1",
        "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50, "probe": {"result": {"refund": "rf-1"}}}).to_string()}],
    });
    json!({"steps": [agent]})
}

/// The attempts that made call `id` of step `agent`, in order.
fn made(ledger: &Ledger, id: &str) -> Vec<u32> {
    ledger
        .calls()
        .filter(|(e, c)| e.step.as_deref() == Some("agent") && c.id == id)
        .map(|(e, _)| e.attempt.unwrap_or(0))
        .collect()
}

/// Waits until `check` holds of the step's journal chunks.
async fn wait_journal(s: &Scenario, what: &str, check: impl Fn(&[StepJournal]) -> bool) {
    let api: Api<StepJournal> = Api::namespaced(s.env().client(), s.namespace());
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let chunks = api.list(&ListParams::default()).await.map(|l| l.items);
        if chunks.as_deref().is_ok_and(&check) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for the journal to hold {what}: {chunks:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The chunks' entry at `seq` and the settlement of its attempt-1 intent.
async fn call_at(s: &Scenario, seq: i64) -> (CallState, i32, Option<EffectOutcome>) {
    let api: Api<StepJournal> = Api::namespaced(s.env().client(), s.namespace());
    let chunks = api.list(&ListParams::default()).await.unwrap().items;
    let e = chunks
        .iter()
        .flat_map(|c| c.spec.entries.iter())
        .find(|e| e.seq == seq)
        .expect("the call is recorded");
    let settled = chunks
        .iter()
        .flat_map(|c| c.status.iter().flat_map(|s| s.settlements.iter()))
        .find(|x| x.seq == seq && x.attempt == 1)
        .map(|x| x.outcome);
    (e.state, e.attempt, settled)
}

fn intent_open(chunks: &[StepJournal]) -> bool {
    chunks
        .iter()
        .flat_map(|c| c.spec.entries.iter())
        .any(|e| e.seq == 1 && e.state == CallState::Intent)
}

/// Deletes the loop's Pod once call_1's intent is recorded (its call is
/// `actMs` later, so it is not made).
async fn kill_after_intent(s: &Scenario) {
    let (_, pod) = s.wait_step_running("refund", "agent", TIMEOUT).await;
    wait_journal(s, "call_1's intent", intent_open).await;
    s.pods()
        .delete(&pod, &DeleteParams::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn a_loop_killed_between_its_intent_and_its_call_makes_the_call_once_after_not_applied() {
    let s = Scenario::start("jloop-intent").await;
    s.create_run("refund", loop_run(20_000, 50)).await;
    kill_after_intent(&s).await;
    let run = s.wait_finished("refund", TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded));
    let ledger = s.ledger();
    assert_eq!(made(&ledger, "model-0"), [1], "the model is asked once");
    assert_eq!(
        made(&ledger, "call_1"),
        [2],
        "the tool is called once, by attempt 2"
    );
    assert_eq!(
        call_at(&s, 1).await,
        (CallState::Done, 2, Some(EffectOutcome::NotApplied))
    );
    s.finish().await;
}

#[tokio::test]
async fn a_loop_killed_between_its_call_and_its_answer_is_settled_applied_and_calls_nothing_again()
{
    let s = Scenario::start("jloop-answer").await;
    s.create_run("refund", loop_run(50, 20_000)).await;
    let (_, pod) = s.wait_step_running("refund", "agent", TIMEOUT).await;
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while made(&s.ledger(), "call_1").is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "call_1 was never made"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    s.pods()
        .delete(&pod, &DeleteParams::default())
        .await
        .unwrap();
    let run = s.wait_finished("refund", TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded));
    let ledger = s.ledger();
    assert_eq!(made(&ledger, "model-0"), [1]);
    assert_eq!(
        made(&ledger, "call_1"),
        [1],
        "made once, by the lost attempt"
    );
    // The intent stays, settled Applied by the probe; attempt 2 replayed it.
    assert_eq!(
        call_at(&s, 1).await,
        (CallState::Intent, 1, Some(EffectOutcome::Applied))
    );
    s.finish().await;
}

/// The ConfigMap name the settlement policy refuses too.
const PROBE: &str = "settlement-policy-probe";

/// A policy that refuses every settlement written into the namespace's
/// journal chunks, with `message`.
async fn refuse_settlements(s: &Scenario, message: &str) -> String {
    let name = format!("{}-no-settlements", s.namespace());
    let client = s.env().client();
    let policy: ValidatingAdmissionPolicy = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            // A ConfigMap named PROBE is refused too: how the test knows
            // the policy is in force.
            "matchConstraints": {"resourceRules": [
                {"apiGroups": ["agentrun.dev"], "apiVersions": ["*"],
                 "operations": ["UPDATE"], "resources": ["stepjournals/status"]},
                {"apiGroups": [""], "apiVersions": ["v1"],
                 "operations": ["CREATE"], "resources": ["configmaps"]},
            ]},
            "validations": [{
                "expression": format!("request.resource.resource == 'configmaps' ? object.metadata.name != '{PROBE}' : false"),
                "message": message,
            }],
        },
    }))
    .unwrap();
    let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": s.namespace(),
            }}},
        },
    }))
    .unwrap();
    let pp = PostParams::default();
    Api::<ValidatingAdmissionPolicy>::all(client.clone())
        .create(&pp, &policy)
        .await
        .unwrap();
    Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .create(&pp, &binding)
        .await
        .unwrap();
    let probe: ConfigMap = serde_json::from_value(json!({"metadata": {"name": PROBE}})).unwrap();
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let configmaps: Api<ConfigMap> = Api::namespaced(client, s.namespace());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while configmaps.create(&dry, &probe).await.is_ok() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the policy is not enforced after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    name
}

async fn allow_settlements(s: &Scenario, name: &str) {
    let client = s.env().client();
    let dp = DeleteParams::default();
    Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .delete(name, &dp)
        .await
        .unwrap();
    Api::<ValidatingAdmissionPolicy>::all(client)
        .delete(name, &dp)
        .await
        .unwrap();
}

/// The run's `Stalled` condition: (status, message).
fn stalled(run: &agentrun_operator::api::AgentRun) -> Option<(String, String)> {
    agentrun_e2e::support::scenario::status(run)
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Stalled")
        .map(|c| (c.status, c.message))
}

#[tokio::test]
async fn a_settlement_the_api_server_refuses_stalls_the_run_visibly_until_it_lands() {
    let s = Scenario::start("jloop-refused").await;
    let message = "settlements are frozen in this namespace";
    let policy = refuse_settlements(&s, message).await;
    s.create_run("refund", loop_run(20_000, 50)).await;
    kill_after_intent(&s).await;
    // The probe finds call_1 not made; its settlement is refused: the run
    // says so, with the policy's message, and attempt 2 does not start.
    let run = s
        .wait_run("refund", "stalled on the settlement", TIMEOUT, |r| {
            stalled(r).is_some_and(|(st, m)| st == "True" && m.contains(message))
        })
        .await;
    let (_, m) = stalled(&run).unwrap();
    assert!(
        m.contains("the settlement of call 1 (call_1) as NotApplied"),
        "{m}"
    );
    assert!(
        event_counts(&s, "refund")
            .await
            .get("FailedCreate")
            .is_some_and(|n| *n >= 1),
        "a Warning Event"
    );
    assert!(
        made(&s.ledger(), "call_1").is_empty(),
        "nothing ran past the call"
    );
    // The policy goes: the settlement lands on a retry, the run goes on.
    allow_settlements(&s, &policy).await;
    let run = s.wait_finished("refund", TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded));
    assert_eq!(stalled(&run).map(|(st, _)| st).as_deref(), Some("False"));
    assert_eq!(made(&s.ledger(), "call_1"), [2], "made once, by attempt 2");
    assert_eq!(
        call_at(&s, 1).await,
        (CallState::Done, 2, Some(EffectOutcome::NotApplied))
    );
    s.finish().await;
}
