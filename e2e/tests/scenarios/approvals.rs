//! Approval gates: approved, rejected and expired decisions hold across
//! operator restarts, also with the operator down at the deadline (D10); an
//! approval releases only the step it was asked about, and a decision taken
//! after the deadline releases nothing (D14, D10).

use std::time::Duration;

use agentrun_e2e::support::scenario::{Scenario, phase};
use agentrun_operator::api::{RunPhase, StepPhase};
use serde_json::json;

use super::{RUN_TIMEOUT, executions_of, gated, step, step_opt, wait_for_gate};

async fn approval_phase(s: &Scenario, name: &str) -> Option<String> {
    let a = s.approvals().get(name).await.unwrap();
    a.status.map(|st| format!("{:?}", st.phase))
}

#[tokio::test]
async fn approvals_gate_steps_durably_across_restarts_and_expiry() {
    let mut s = Scenario::start("approvals").await;

    // Approved, with an operator restart while waiting.
    s.create_run("approved", gated(None, "Reject")).await;
    let name = wait_for_gate(&s, "approved").await;
    s.kill_operator().await;
    s.decide(&name, "Approved", "looks right").await;
    s.start_operator(None);
    let run = s.wait_finished("approved", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded));
    assert_eq!(step(&run, "issue").phase, StepPhase::Succeeded);
    let approval = s.approvals().get(&name).await.unwrap();
    assert_eq!(
        approval
            .status
            .map(|st| format!("{:?}", st.phase))
            .as_deref(),
        Some("Approved")
    );

    // Rejected: the gated step never runs.
    s.create_run("rejected", gated(None, "Reject")).await;
    let name = wait_for_gate(&s, "rejected").await;
    s.decide(&name, "Rejected", "amount too high").await;
    let run = s.wait_finished("rejected", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed));
    assert!(
        step(&run, "issue").pod.is_none(),
        "a rejected step never gets a pod"
    );

    // Expiry applies onTimeout, also when the operator was down at the deadline.
    s.create_run("expire-reject", gated(Some("3s"), "Reject"))
        .await;
    s.create_run("expire-approve", gated(Some("3s"), "Approve"))
        .await;
    wait_for_gate(&s, "expire-reject").await;
    wait_for_gate(&s, "expire-approve").await;
    s.kill_operator().await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    s.start_operator(None);
    let rejected = s.wait_finished("expire-reject", RUN_TIMEOUT).await;
    assert_eq!(phase(&rejected), Some(RunPhase::Failed));
    assert!(step(&rejected, "issue").pod.is_none());
    let approved = s.wait_finished("expire-approve", RUN_TIMEOUT).await;
    assert_eq!(phase(&approved), Some(RunPhase::Succeeded));
    assert_eq!(step(&approved, "issue").phase, StepPhase::Succeeded);
    // What really ran: a gated step once when released, never otherwise.
    for (run, issue_runs) in [
        ("approved", 1),
        ("rejected", 0),
        ("expire-reject", 0),
        ("expire-approve", 1),
    ] {
        assert_eq!(executions_of(&s, run, "draft"), 1, "{run}: draft");
        assert_eq!(executions_of(&s, run, "issue"), issue_runs, "{run}: issue");
    }
    s.finish().await;
}

#[tokio::test]
async fn an_approval_releases_only_the_step_it_was_asked_about() {
    let mut s = Scenario::start("approval-binding").await;

    // D14: the step is edited while its approval waits; the old approval
    // cannot release the new step.
    s.create_run("edited", gated(None, "Reject")).await;
    let first = wait_for_gate(&s, "edited").await;
    let edit =
        json!([{"op": "add", "path": "/spec/steps/1/container/args", "value": ["--amount=9999"]}]);
    s.runs()
        .patch(
            "edited",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::<()>::Json(serde_json::from_value(edit).unwrap()),
        )
        .await
        .expect("editing the gated step");
    let waiting = s
        .wait_run("edited", "a second approval request", RUN_TIMEOUT, |r| {
            step_opt(r, "issue")
                .and_then(|c| c.approval.as_deref())
                .is_some_and(|a| a != first)
        })
        .await;
    let second = step(&waiting, "issue").approval.clone().unwrap();
    assert_eq!(phase(&waiting), Some(RunPhase::WaitingForApproval));
    agentrun_e2e::wait_for(
        &s.approvals(),
        &first,
        |a: Option<&agentrun_operator::api::Approval>| {
            a.and_then(|a| a.status.as_ref())
                .is_some_and(|st| format!("{:?}", st.phase) == "Superseded")
        },
        Duration::from_secs(30),
    )
    .await;
    // The person approves what they were shown: the API server refuses it.
    let patch = json!({"spec": {"decision": "Approved", "comment": "the amount I was shown"}});
    let refused = s
        .approvals()
        .patch(
            &first,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await;
    let message = match refused {
        Err(kube::Error::Api(status)) => status.message,
        other => panic!("a decision on a superseded approval must be refused: {other:?}"),
    };
    assert!(
        message.contains("Superseded")
            && message.contains(&second)
            && message.contains("can no longer be decided"),
        "{message}"
    );
    assert_eq!(executions_of(&s, "edited", "issue"), 0, "nothing ran");
    s.decide(&second, "Approved", "the new amount").await;
    let run = s.wait_finished("edited", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded));
    assert_eq!(executions_of(&s, "edited", "issue"), 1);
    let pod = s
        .pods()
        .get(step(&run, "issue").pod.as_deref().unwrap())
        .await
        .unwrap();
    assert_eq!(
        pod.spec.unwrap().containers[0]
            .args
            .clone()
            .unwrap_or_default(),
        ["--amount=9999"],
        "what ran is what the second approval was asked about"
    );

    // D10: a decision the API server took after the deadline does not win
    // over onTimeout Reject, even with the operator down at the deadline.
    s.create_run("late", gated(Some("3s"), "Reject")).await;
    let name = wait_for_gate(&s, "late").await;
    s.kill_operator().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    s.decide(&name, "Approved", "sorry, I was away").await;
    s.start_operator(None);
    let run = s.wait_finished("late", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed));
    assert_eq!(
        executions_of(&s, "late", "issue"),
        0,
        "the late approval released nothing"
    );
    assert_eq!(approval_phase(&s, &name).await.as_deref(), Some("Expired"));

    s.finish().await;
}
