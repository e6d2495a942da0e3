//! The operator killed at a failpoint (right after creating a step's Pod,
//! after a checkpoint before the finalizer's release), or down while a
//! step's Pod succeeds: on restart the run finishes with every step executed
//! once, every token counted once and the result the Pod held kept (D5).

use std::time::Duration;

use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{RunPhase, StepPhase};
use agentrun_operator::labels;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde_json::json;

use super::{
    RUN_TIMEOUT, assert_finalizers_released, assert_one_success_per_key, four_steps, step,
};

async fn kill_at(failpoint: &str, test: &str) {
    let mut s = Scenario::start_without_operator(test).await;
    s.start_operator(Some(failpoint));
    s.create_run("refund", four_steps()).await;
    s.wait_operator_crash(RUN_TIMEOUT).await;
    s.start_operator(None);
    let run = s.wait_finished("refund", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    let st = status(&run);
    assert_eq!(st.steps.len(), 4);
    let executions = s.ledger().executions_by_key();
    for c in &st.steps {
        assert_eq!(c.phase, StepPhase::Succeeded, "{}", c.name);
        assert_eq!(
            executions.get(&c.idempotency_key),
            Some(&1),
            "step {} ran once",
            c.name
        );
    }
    assert_eq!(executions.len(), 4, "no other executions: {executions:?}");
    assert_eq!(
        st.tokens_used,
        535 - 20,
        "every reported token counted once"
    );
    assert_one_success_per_key(&s, &run);
    assert_finalizers_released(&s).await;
    s.finish().await;
}

#[tokio::test]
async fn operator_killed_right_after_creating_a_step_pod_resumes_without_duplicates() {
    kill_at("after-create-pod:2", "kill-after-create").await;
}

#[tokio::test]
async fn operator_killed_after_checkpoint_before_finalizer_release_resumes() {
    kill_at("after-checkpoint:2", "kill-after-checkpoint").await;
}

#[tokio::test]
async fn operator_down_while_a_pod_succeeds_records_the_result_on_restart() {
    let mut s = Scenario::start("kill-before-checkpoint").await;
    let spec = json!({"steps": [
        sim_step("slow", "NonIdempotent", json!({"runMs": 3000, "result": {"done": 1}, "tokens": {"input": 7, "output": 3}})),
        sim_step("after", "None", json!({"runMs": 50})),
    ]});
    s.create_run("slow-run", spec).await;
    // Its Pod must exist: the launch is recorded in status before the Pod is created.
    let (_, pod) = s.wait_step_running("slow-run", "slow", RUN_TIMEOUT).await;
    // The Pod succeeds while no operator is there to record it.
    s.kill_operator().await;
    agentrun_e2e::wait_for(
        &s.pods(),
        &pod,
        |p: Option<&Pod>| p.and_then(|p| p.status.as_ref()?.phase.as_deref()) == Some("Succeeded"),
        Duration::from_secs(30),
    )
    .await;
    let held = s.pods().get(&pod).await.unwrap();
    assert!(
        held.finalizers()
            .iter()
            .any(|f| f == labels::RESULT_FINALIZER),
        "the finalizer holds the result"
    );
    s.start_operator(None);
    let run = s.wait_finished("slow-run", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded));
    assert_eq!(step(&run, "slow").result, Some(json!({"done": 1})));
    assert_eq!(status(&run).tokens_used, 10);
    assert_eq!(s.ledger().executions_by_key().len(), 2);
    assert_one_success_per_key(&s, &run);
    s.finish().await;
}
