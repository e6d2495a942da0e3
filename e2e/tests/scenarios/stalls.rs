//! What cannot go on says so (D13, D16): a step Pod the API server refuses
//! fails the step with the server's message. (A run the operator cannot read
//! is in `tests/unreadable.rs`: it replaces the cluster's AgentRun CRD, so it
//! runs in a test binary of its own.)

use agentrun_e2e::kubectl_ok;
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step};
use agentrun_operator::api::RunPhase;
use serde_json::json;

use super::{RUN_TIMEOUT, executions_of, step};

#[tokio::test]
async fn a_step_pod_the_api_server_refuses_fails_the_step_with_its_message() {
    let s = Scenario::start("refused").await;
    let mut spec = json!({"steps": [sim_step("a", "Idempotent", json!({"runMs": 50}))]});
    // The Priority admission plugin refuses a Pod naming a missing class.
    spec["podTemplate"] = json!({"priorityClassName": "no-such-class"});
    s.create_run("refused", spec).await;
    let run = s.wait_finished("refused", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed));
    let a = step(&run, "a");
    let message = a.message.clone().unwrap_or_default();
    assert!(
        message.contains("refused its Pod") && message.contains("no-such-class"),
        "{message}"
    );
    assert_eq!(executions_of(&s, "refused", "a"), 0);
    let events = kubectl_ok(&[
        "get",
        "events",
        "-n",
        s.namespace(),
        "--field-selector",
        "reason=FailedCreate,type=Warning",
        "-o",
        "jsonpath={.items[*].note}{.items[*].message}",
    ])
    .await;
    assert!(
        events.contains("no-such-class"),
        "Warning Event FailedCreate: {events}"
    );
    s.finish().await;
}
