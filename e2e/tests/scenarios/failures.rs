//! A run that fails: a step that keeps failing retries with its backoff,
//! then fails the run and the applied steps are compensated in reverse; a
//! run past its token budget starts no new step and says why (D9).

use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{RunPhase, StepPhase};
use serde_json::json;

use super::{RUN_TIMEOUT, executions_of, step, step_opt};

#[tokio::test]
async fn failing_step_retries_with_backoff_then_fails_and_compensates_in_reverse() {
    let s = Scenario::start("retry-compensate").await;
    let compensate = |tag: &str| json!({"image": "registry.example/undo:1", "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50, "result": {"undone": tag}}).to_string()}]});
    s.create_run("saga", json!({"steps": [
        {"name": "reserve", "effect": "Idempotent", "compensate": compensate("reserve"),
         "container": {"image": "registry.example/reserve:1", "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50}).to_string()}]}},
        {"name": "charge", "effect": "Idempotent", "compensate": compensate("charge"),
         "container": {"image": "registry.example/charge:1", "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50}).to_string()}]}},
        {"name": "ship", "effect": "Idempotent", "retry": {"limit": 2, "backoff": {"initial": "1s", "max": "2s"}},
         "container": {"image": "registry.example/ship:1", "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50, "exitCode": 3}).to_string()}]}},
    ]}))
    .await;
    let run = s.wait_finished("saga", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed), "{:?}", run.status);
    let ship = step(&run, "ship");
    assert_eq!(ship.phase, StepPhase::Failed);
    assert_eq!(ship.failures, 3, "first attempt + 2 retries");
    assert_eq!(ship.attempt, 3);
    let ledger = s.ledger();
    let ship_runs: Vec<_> = ledger
        .executions()
        .filter(|e| e.step.as_deref() == Some("ship"))
        .collect();
    assert_eq!(ship_runs.len(), 3);
    // Backoff: 1s then 2s between attempts (the scheduler may add latency, never remove it).
    let gap = |a: usize, b: usize| {
        ship_runs[b]
            .started_at
            .duration_since(ship_runs[a].started_at)
    };
    assert!(
        gap(0, 1) >= jiff::SignedDuration::from_millis(1000),
        "first backoff {:?}",
        gap(0, 1)
    );
    assert!(
        gap(1, 2) >= jiff::SignedDuration::from_millis(2000),
        "second backoff {:?}",
        gap(1, 2)
    );
    // Compensation of the applied steps, in reverse order.
    let comp: Vec<_> = ledger
        .executions()
        .filter(|e| e.role.as_deref() == Some("compensate"))
        .map(|e| e.step.clone().unwrap_or_default())
        .collect();
    assert_eq!(comp, ["charge", "reserve"], "compensated in reverse");
    let st = status(&run);
    let done: Vec<_> = st
        .compensations
        .iter()
        .map(|c| (c.name.as_str(), c.phase))
        .collect();
    assert_eq!(
        done,
        [
            ("charge", StepPhase::Succeeded),
            ("reserve", StepPhase::Succeeded)
        ]
    );
    s.finish().await;
}

#[tokio::test]
async fn token_budget_exceeded_stops_new_steps_with_a_clear_condition() {
    let s = Scenario::start("token-budget").await;
    s.create_run("budget", json!({"budget": {"tokens": 100}, "steps": [
        sim_step("think", "None", json!({"runMs": 50, "tokens": {"input": 60, "output": 20}})),
        sim_step("think-more", "None", json!({"runMs": 50, "tokens": {"input": 30, "output": 20}})),
        sim_step("act", "Idempotent", json!({"runMs": 50})),
    ]}))
    .await;
    let run = s.wait_finished("budget", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed));
    let st = status(&run);
    assert_eq!(st.tokens_used, 130);
    let cond = st
        .conditions
        .iter()
        .find(|c| c.type_ == "BudgetExceeded")
        .expect("a BudgetExceeded condition");
    assert_eq!(cond.status, "True");
    assert!(
        cond.message.contains("130") && cond.message.contains("100"),
        "{}",
        cond.message
    );
    assert!(
        step_opt(&run, "act").is_none_or(|c| c.pod.is_none()),
        "no step starts past the budget"
    );
    assert_eq!(executions_of(&s, "budget", "think"), 1);
    assert_eq!(executions_of(&s, "budget", "think-more"), 1);
    assert_eq!(
        executions_of(&s, "budget", "act"),
        0,
        "nothing ran past the budget"
    );
    s.finish().await;
}
