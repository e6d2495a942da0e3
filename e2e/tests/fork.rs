//! Retry and fork from a checkpoint on the real control plane, with the
//! operator, the simulated kubelet and `kubectl agentrun retry`: a run that
//! failed at step 4 of 5 is retried from step 4; steps 1–3 are carried over
//! and never run again (the ledger counts executions per run and step), a
//! gated step asks again, and a step that acted runs again only after a
//! person approves an Approval that says it acts a second time.

use std::time::Duration;

use agentrun_e2e::support::processes::kubectl_agentrun;
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{EffectOutcome, Provenance, RunPhase, StepPhase};
use serde_json::{Value, json};

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

/// How often `step` of `run` started (its own attempts, not probes).
fn executions(s: &Scenario, run: &str, step: &str) -> usize {
    s.ledger().starts(run, step, "step")
}

/// fetch (a read) → charge (NonIdempotent) → reserve (Idempotent) → ship
/// (NonIdempotent, gated; the payments API refuses it in `order`: NotApplied,
/// and succeeds in `order-retry`) → notify.
fn order() -> Value {
    let mut ship = sim_step(
        "ship",
        "NonIdempotent",
        json!({
            "runMs": 50, "exitCode": 1,
            "rawMessage": "{\"result\": {\"error\": \"carrier down\"}, \"effect\": \"NotApplied\"}",
            "runs": {"order-retry": {"runMs": 50, "result": {"shipment": "s-1"}}},
        }),
    );
    ship["approval"] = json!({"question": "Ship the order?"});
    json!({"steps": [
        sim_step("fetch", "None", json!({"runMs": 50, "result": {"order": 7}})),
        sim_step("charge", "NonIdempotent", json!({"runMs": 50, "result": {"charged": 30}})),
        sim_step("reserve", "Idempotent", json!({"runMs": 50})),
        ship,
        sim_step("notify", "Idempotent", json!({"runMs": 50})),
    ]})
}

/// Runs `order` to its failure at `ship`, approving the gate once.
async fn failed_order(s: &Scenario) {
    s.create_run("order", order()).await;
    let gate = s
        .approval_of("order", Some("ship"), Duration::from_secs(60))
        .await;
    s.decide(&gate, "Approved", "ship it").await;
    let run = s.wait_finished("order", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed), "{:#?}", run.status);
}

#[tokio::test]
async fn a_retry_from_the_failed_step_runs_only_it_and_what_follows() {
    let s = Scenario::start("fork-retry").await;
    failed_order(&s).await;

    let (code, plan) = kubectl_agentrun(s.namespace(), &["retry", "order", "--dry-run"]).await;
    assert_eq!(code, 0, "{plan}");
    assert!(
        plan.contains("Kept (carried over): fetch, charge, reserve"),
        "{plan}"
    );
    assert!(plan.contains("Runs again:          ship, notify"), "{plan}");
    assert!(plan.contains("Asks a person:       ship (gate)"), "{plan}");
    assert!(
        s.runs().get_opt("order-retry").await.unwrap().is_none(),
        "a dry run creates nothing"
    );

    let (code, out) =
        kubectl_agentrun(s.namespace(), &["retry", "order", "--name", "order-retry"]).await;
    assert_eq!(code, 0, "{out}");
    // Approvals are never carried over: the gate asks again.
    let gate = s
        .approval_of("order-retry", Some("ship"), Duration::from_secs(60))
        .await;
    assert_eq!(
        executions(&s, "order-retry", "ship"),
        0,
        "nothing acts before the answer"
    );
    s.decide(&gate, "Approved", "ship it now").await;
    let run = s.wait_finished("order-retry", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);

    // The ledger: steps 1–3 ran once, in `order`; 4–5 ran in the retry.
    for step in ["fetch", "charge", "reserve"] {
        assert_eq!(executions(&s, "order", step), 1, "{step} in order");
        assert_eq!(
            executions(&s, "order-retry", step),
            0,
            "{step} was carried over"
        );
    }
    assert_eq!(executions(&s, "order-retry", "ship"), 1);
    assert_eq!(executions(&s, "order-retry", "notify"), 1);

    let st = status(&run);
    let charge = st.steps.iter().find(|c| c.name == "charge").unwrap();
    assert_eq!(
        (charge.effect, charge.provenance, charge.plan_revision),
        (Some(EffectOutcome::Applied), Some(Provenance::Inherited), 0)
    );
    let from = st.forked_from.expect("the lineage");
    assert_eq!(
        (from.run_name.as_str(), from.from_step.as_str()),
        ("order", "ship")
    );
    assert_eq!(from.inherited, ["fetch", "charge", "reserve"]);
    let (_, described) = kubectl_agentrun(s.namespace(), &["describe", "order-retry"]).await;
    assert!(
        described.contains("Forked from: run order (UID ") && described.contains("at step ship"),
        "{described}"
    );
    s.finish().await;
}

#[tokio::test]
async fn a_retry_that_would_charge_again_needs_the_flag_and_a_person() {
    let s = Scenario::start("fork-rerun").await;
    failed_order(&s).await;

    // Without the flag the plugin refuses, and says how.
    let (code, out) = kubectl_agentrun(
        s.namespace(),
        &["retry", "order", "--from", "charge", "--dry-run"],
    )
    .await;
    assert_eq!(code, 1, "{out}");
    // reserve (Idempotent) acted too, and would act again under a new key.
    assert!(
        out.contains("charge, reserve acted in run order") && out.contains("--rerun-applied"),
        "{out}"
    );
    let (code, out) = kubectl_agentrun(
        s.namespace(),
        &[
            "retry",
            "order",
            "--from",
            "charge",
            "--name",
            "order-retry",
        ],
    )
    .await;
    assert_eq!(code, 1, "{out}");
    assert!(s.runs().get_opt("order-retry").await.unwrap().is_none());

    // With it, charge waits for a person who is told it charged before.
    let (code, out) = kubectl_agentrun(
        s.namespace(),
        &[
            "retry",
            "order",
            "--from",
            "charge",
            "--rerun-applied",
            "--name",
            "order-retry",
        ],
    )
    .await;
    assert_eq!(code, 0, "{out}");
    let ask = s
        .approval_of("order-retry", Some("charge"), Duration::from_secs(60))
        .await;
    let a = s.approvals().get(&ask).await.unwrap();
    let repeats = a
        .spec
        .context
        .and_then(|c| c.repeats)
        .expect("it says the step acted before");
    assert_eq!(repeats.effect, EffectOutcome::Applied);
    let run = s.runs().get("order-retry").await.unwrap();
    let charge = status(&run)
        .steps
        .into_iter()
        .rfind(|c| c.name == "charge" && c.plan_revision > 0)
        .unwrap();
    assert_eq!(charge.phase, StepPhase::WaitingForApproval);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        executions(&s, "order-retry", "charge"),
        0,
        "nothing charges before the answer"
    );

    s.decide(
        &ask,
        "Approved",
        "charge again: the first charge was refunded",
    )
    .await;
    let again = s
        .approval_of("order-retry", Some("reserve"), Duration::from_secs(60))
        .await;
    s.decide(&again, "Approved", "reserve again").await;
    let gate = s
        .approval_of("order-retry", Some("ship"), Duration::from_secs(60))
        .await;
    s.decide(&gate, "Approved", "ship").await;
    let run = s.wait_finished("order-retry", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    assert_eq!(
        executions(&s, "order", "charge") + executions(&s, "order-retry", "charge"),
        2
    );
    assert_eq!(
        executions(&s, "order-retry", "fetch"),
        0,
        "the read before it was kept"
    );
    s.finish().await;
}

#[tokio::test]
async fn a_fork_whose_source_is_gone_says_so() {
    let s = Scenario::start("fork-gone").await;
    let mut spec = order();
    spec["forkOf"] = json!({"runName": "order", "runUid": "0b7c-gone", "fromStep": "ship"});
    s.create_run("orphan", spec).await;
    let run = s.wait_finished("orphan", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed));
    let c = status(&run)
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Succeeded")
        .unwrap();
    assert_eq!(c.reason, "ForkSourceGone");
    assert!(c.message.contains("no longer exists"), "{}", c.message);
    assert!(s.ledger().entries.is_empty(), "nothing ran");
    s.finish().await;
}
