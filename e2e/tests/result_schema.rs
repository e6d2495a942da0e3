//! Results checked at the boundary, on the real control plane with the
//! operator and the simulated kubelet: a step's `resultSchema` refuses a
//! result before anything after it starts; the attempt retries within its
//! policy, and a NonIdempotent step that applied its effect is compensated,
//! never run again. The ledger says what really ran.

use std::time::Duration;

use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{EffectOutcome, RunPhase, StepPhase};
use k8s_openapi::api::events::v1::Event;
use kube::api::ListParams;
use serde_json::{Value, json};

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

fn order_schema() -> Value {
    json!({
        "type": "object",
        "required": ["orderId", "total"],
        "properties": {
            "orderId": {"type": "string", "pattern": "^o-[0-9]+$"},
            "total": {"type": "number", "minimum": 0}
        }
    })
}

/// How many Pods of `role` for `step` of run `run` the kubelet started.
fn runs_of(s: &Scenario, run: &str, step: &str, role: &str) -> usize {
    s.ledger().starts(run, step, role)
}

/// Waits for the operator's Warning Event `reason` about run `run` and returns its note.
async fn event_note(s: &Scenario, run: &str, reason: &str) -> String {
    let events: kube::Api<Event> = s.env().api();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let found = events
            .list(&ListParams::default())
            .await
            .expect("listing events")
            .items
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(run)
            });
        if let Some(e) = found {
            assert_eq!(e.type_.as_deref(), Some("Warning"));
            return e.note.unwrap_or_default();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {reason} Event about {run}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// extract (returns a malformed order first, a good one on its retry) →
/// act: act starts once, on the good result; the refusal is on the run.
#[tokio::test]
async fn a_result_that_does_not_match_is_retried_and_never_reaches_the_next_step() {
    let s = Scenario::start("result-schema-retry").await;
    let mut extract = sim_step(
        "extract",
        "None",
        json!({"attempts": [
            {"runMs": 50, "result": {"order": "seven", "total": -3}, "tokens": {"input": 11, "output": 0}},
            {"runMs": 50, "result": {"orderId": "o-7", "total": 12.5}},
        ]}),
    );
    extract["resultSchema"] = order_schema();
    extract["retry"] = json!({"limit": 1, "backoff": {"initial": "1s", "max": "1s"}});
    let act = sim_step("act", "None", json!({"runMs": 50, "result": {"ok": true}}));
    s.create_run("order", json!({"steps": [extract, act]}))
        .await;
    let run = s.wait_finished("order", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    let st = status(&run);
    let e = st.steps.iter().find(|c| c.name == "extract").unwrap();
    assert_eq!(
        (e.phase, e.failures, e.attempt),
        (StepPhase::Succeeded, 1, 2)
    );
    assert_eq!(e.result, Some(json!({"orderId": "o-7", "total": 12.5})));
    assert!(st.tokens_used >= 11, "the refused attempt's tokens count");
    assert_eq!(runs_of(&s, "order", "extract", "step"), 2);
    assert_eq!(runs_of(&s, "order", "act", "step"), 1, "act ran once");
    let note = event_note(&s, "order", "ResultInvalid").await;
    assert!(
        note.starts_with("step extract: attempt 1 returned a result that does not match its resultSchema: at /: \"orderId\" is a required property"),
        "{note}"
    );
    assert!(!note.contains("seven"), "values are not quoted: {note}");
    s.finish().await;
}

/// charge (NonIdempotent, applied, but its receipt is malformed) with
/// retries left: it is not charged again; the run fails and refunds it.
#[tokio::test]
async fn a_non_idempotent_step_that_acted_is_compensated_not_repeated() {
    let s = Scenario::start("result-schema-acted").await;
    let mut charge = sim_step(
        "charge",
        "NonIdempotent",
        json!({"runMs": 50, "result": {"receipt": 42}, "effect": "Applied"}),
    );
    charge["resultSchema"] = order_schema();
    charge["retry"] = json!({"limit": 3});
    charge["compensate"] = json!({"image": "registry.example/agent-step:1"});
    let ship = sim_step("ship", "None", json!({"runMs": 50}));
    s.create_run("charge", json!({"steps": [charge, ship]}))
        .await;
    let run = s.wait_finished("charge", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed), "{:#?}", run.status);
    let st = status(&run);
    let c = st.steps.iter().find(|c| c.name == "charge").unwrap();
    assert_eq!(
        (c.phase, c.effect, c.failures),
        (StepPhase::Failed, Some(EffectOutcome::Applied), 1)
    );
    let message = c.message.clone().unwrap_or_default();
    assert!(
        message.ends_with("; not retried: its NonIdempotent effect was applied"),
        "{message}"
    );
    assert_eq!(runs_of(&s, "charge", "charge", "step"), 1, "charged once");
    assert_eq!(runs_of(&s, "charge", "ship", "step"), 0);
    assert_eq!(
        runs_of(&s, "charge", "charge", "compensate"),
        1,
        "the applied charge is refunded"
    );
    assert_eq!(st.compensations.len(), 1, "{:?}", st.compensations);
    assert_eq!(st.compensations[0].phase, StepPhase::Succeeded);
    s.finish().await;
}
