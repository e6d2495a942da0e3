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

use std::time::Duration;

use agentrun_e2e::ledger::Ledger;
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step};
use agentrun_operator::api::{CallState, EffectOutcome, RunPhase, StepJournal};
use kube::api::{Api, DeleteParams, ListParams};
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

#[tokio::test]
async fn a_loop_killed_between_its_intent_and_its_call_makes_the_call_once_after_not_applied() {
    let s = Scenario::start("jloop-intent").await;
    s.create_run("refund", loop_run(20_000, 50)).await;
    let (_, pod) = s.wait_step_running("refund", "agent", TIMEOUT).await;
    wait_journal(&s, "call_1's intent", intent_open).await;
    s.pods()
        .delete(&pod, &DeleteParams::default())
        .await
        .unwrap();
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
