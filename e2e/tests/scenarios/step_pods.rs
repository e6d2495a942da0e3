//! What a step's Pod is given: a name its run's alone, even where two runs'
//! names joined with their steps' read alike, and the context the Rust step
//! SDK reads from its environment and context file.

use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::RunPhase;
use agentrun_operator::labels;
use kube::ResourceExt;
use serde_json::json;

use super::{RUN_TIMEOUT, executions_of};

#[tokio::test]
async fn runs_whose_names_join_alike_each_get_their_own_pods() {
    let s = Scenario::start("names").await;
    let one = |step: &str| json!({"steps": [sim_step(step, "Idempotent", json!({"runMs": 50}))]});
    // `hx` + `b-c` and `hx-b` + `c` both read `hx-b-c`.
    s.create_run("hx", one("b-c")).await;
    s.create_run("hx-b", one("c")).await;
    for name in ["hx", "hx-b"] {
        let run = s.wait_finished(name, RUN_TIMEOUT).await;
        assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{name}");
    }
    assert_eq!(executions_of(&s, "hx", "b-c"), 1);
    assert_eq!(executions_of(&s, "hx-b", "c"), 1);
    s.finish().await;
}

/// The Rust step SDK reads what the operator really gives a step Pod — its
/// `AGENTRUN_*` environment and the context annotation mounted as the
/// context file — not a hand-written context: the second step sees the
/// first one's result, its own idempotency key, and sends them on.
#[tokio::test]
async fn the_step_sdk_reads_the_context_the_operator_writes() {
    let s = Scenario::start("sdk-context").await;
    s.create_run(
        "sdk",
        json!({"steps": [
            sim_step("lookup", "None", json!({"runMs": 50, "result": {"orderId": "4711", "amount": "12.00 EUR"}})),
            sim_step("refund", "Idempotent", json!({"runMs": 3000})),
        ]}),
    )
    .await;
    let (run, pod_name) = s.wait_step_running("sdk", "refund", RUN_TIMEOUT).await;
    let pod = s.pods().get(&pod_name).await.expect("the refund Pod");
    let container = &pod.spec.as_ref().unwrap().containers[0];
    let mut env: std::collections::HashMap<String, String> = container
        .env
        .iter()
        .flatten()
        .filter_map(|e| Some((e.name.clone(), e.value.clone()?)))
        .collect();
    let context = pod
        .annotations()
        .get(labels::CONTEXT)
        .expect("the context annotation")
        .clone();
    let file = agentrun_e2e::support::processes::log_dir(s.namespace()).join("context.json");
    std::fs::write(&file, &context).expect("writing the context file");
    env.insert(
        agentrun_step::ENV_CONTEXT_FILE.into(),
        file.to_string_lossy().into_owned(),
    );
    let step = agentrun_step::Step::from_env(&env)
        .unwrap_or_else(|e| panic!("the SDK refused the operator's context: {e}\n{context}"));
    assert_eq!(
        step.result_of("lookup").expect("lookup's result"),
        &json!({"orderId": "4711", "amount": "12.00 EUR"})
    );
    let key = status(&run)
        .steps
        .iter()
        .find(|c| c.name == "refund")
        .map(|c| c.idempotency_key.clone())
        .unwrap();
    assert!(
        step.headers()
            .iter()
            .any(|(h, v)| h.eq_ignore_ascii_case("idempotency-key") && *v == key),
        "{:?}",
        step.headers()
    );
    s.wait_finished("sdk", RUN_TIMEOUT).await;
    s.finish().await;
}
