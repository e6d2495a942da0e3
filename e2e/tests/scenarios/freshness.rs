//! Freshness budgets (D8): an input that went stale while the operator was
//! down re-plans the run, the stale step runs again under a new key, and the
//! step after it, which may already have acted, asks a person first.

use std::time::Duration;

use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{AgentRun, RunPhase, StepCheckpoint, StepPhase};
use serde_json::json;

use super::{RUN_TIMEOUT, asked, executions_of, step, step_opt};

fn checkpoints_of<'a>(run: &'a AgentRun, name: &str) -> Vec<&'a StepCheckpoint> {
    run.status
        .as_ref()
        .map(|s| {
            s.steps
                .iter()
                .filter(|c| c.name == name && c.role.is_step())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn stale_input_after_resume_replans_and_reruns_under_a_new_key() {
    let mut s = Scenario::start_without_operator("freshness").await;
    // Crash right after the first checkpoint, stay down past its freshness budget.
    s.start_operator(Some("after-checkpoint:1"));
    s.create_run("fresh", json!({"steps": [
        {"name": "quote", "effect": "None", "freshFor": "3s",
         "container": {"image": "registry.example/quote:1", "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50, "result": {"price": 10}}).to_string()}]}},
        sim_step("buy", "Idempotent", json!({"runMs": 50})),
    ]}))
    .await;
    s.wait_operator_crash(RUN_TIMEOUT).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    s.start_operator(None);
    // buy's launch at revision 1 was recorded just before the crash and its Pod is
    // not there: it may have been created and acted, so running buy again under the
    // new revision's key (a second effect) waits for a person (D1, D6).
    let waiting = s
        .wait_run("fresh", "buy asks before acting again", RUN_TIMEOUT, |r| {
            step_opt(r, "buy").is_some_and(|c| c.plan_revision == 2 && c.approval.is_some())
        })
        .await;
    let approval = step(&waiting, "buy").approval.clone().unwrap();
    let question = serde_json::to_string(&asked(&s, &approval).await.spec).unwrap();
    assert!(
        question.contains("already acted at plan revision 1"),
        "the question says why: {question}"
    );
    s.decide(&approval, "Approved", "the provider has no such order")
        .await;
    let run = s.wait_finished("fresh", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    let st = status(&run);
    let plan = st.plan.clone().expect("a plan");
    assert_eq!(plan.revision, 2, "re-planned once");
    assert!(
        plan.reason.contains("quote"),
        "the reason names the stale step: {}",
        plan.reason
    );
    let quotes = checkpoints_of(&run, "quote");
    assert_eq!(
        quotes.len(),
        2,
        "the stale checkpoint is kept and the step ran again"
    );
    assert_ne!(
        quotes[0].idempotency_key, quotes[1].idempotency_key,
        "new key for the new revision"
    );
    assert_eq!(quotes[1].plan_revision, 2);
    let buy = step(&run, "buy");
    assert_eq!(buy.plan_revision, 2);
    // Its launch at revision 1 was recorded with the quote's checkpoint, just
    // before the crash; on restart it was superseded (effect Unknown: its Pod was
    // never seen), and the ledger below shows it never ran.
    let buys = checkpoints_of(&run, "buy");
    assert_eq!(
        buys.iter()
            .map(|c| (c.plan_revision, c.phase))
            .collect::<Vec<_>>(),
        [(1, StepPhase::Superseded), (2, StepPhase::Succeeded)]
    );
    // What really ran: the quote once per revision, each under its own key,
    // and buy once, under its revision-2 key.
    let executions = s.ledger().executions_by_key();
    assert_eq!(executions.get(&quotes[0].idempotency_key), Some(&1));
    assert_eq!(executions.get(&quotes[1].idempotency_key), Some(&1));
    assert_eq!(executions.get(&buy.idempotency_key), Some(&1));
    assert_eq!(
        executions.get(&buys[0].idempotency_key),
        None,
        "never on the stale quote"
    );
    assert_eq!(executions_of(&s, "fresh", "quote"), 2);
    assert_eq!(executions_of(&s, "fresh", "buy"), 1);
    s.finish().await;
}
