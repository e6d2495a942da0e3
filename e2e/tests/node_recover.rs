//! Recovering without repeating, on the real node (`e2e/cluster node up`) with the
//! example refund agent and its payments service, which counts what really happened:
//! a refund whose Pod is lost after it acted is settled by its verify probe asking the
//! payments service by key (one refund, nobody woken), and a run that failed because
//! the provider was down is retried from the failed step with `kubectl agentrun retry`
//! (the refund is carried over, never made again); a probe that cannot reach the
//! provider leaves the question to a person. Fails, never skips, without the node.

use std::time::Duration;

use agentrun_e2e::support::node::{Payments, node_scenario, pod_template};
use agentrun_e2e::support::processes::kubectl_agentrun;
use agentrun_e2e::support::scenario::{Scenario, phase, status, step_checkpoint};
use agentrun_operator::api::{ApprovalKind, EffectOutcome, Provenance, RunPhase};
use agentrun_operator::labels;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{DeleteParams, ListParams};
use serde_json::{Value, json};

/// Real containers start in seconds, but the machine is shared with builds.
const RUN_TIMEOUT: Duration = Duration::from_secs(180);

/// The refund agent's four steps; issue-refund is NonIdempotent with the agent's own
/// verify probe (`verify-refund`: GET /refunds?idempotencyKey=…).
fn refund(payments: &Payments) -> Value {
    json!({
        "podTemplate": pod_template(),
        "steps": [
            {"name": "lookup-order", "effect": "None", "timeout": "60s",
             "container": payments.agent(&["lookup-order", "--order-id=4711"])},
            {"name": "draft-refund", "effect": "None", "timeout": "60s",
             "container": payments.agent(&["draft-refund"])},
            {"name": "issue-refund", "effect": "NonIdempotent", "timeout": "120s",
             "retry": {"limit": 1, "backoff": {"initial": "1s", "max": "1s"}},
             "container": payments.agent(&["issue-refund", "--from-context=draft-refund"]),
             "verify": payments.agent(&["verify-refund"])},
            {"name": "notify-customer", "effect": "Idempotent", "timeout": "60s",
             "retry": {"limit": 0},
             "container": payments.agent(&["notify-customer", "--template=refund-issued"])},
        ],
    })
}

/// The step Pods (role `step`, not probes) of `run`, by step name, in creation order.
async fn step_pods(s: &Scenario, run: &str) -> Vec<String> {
    let mut pods: Vec<Pod> = s
        .pods()
        .list(&ListParams::default().labels(&format!("{}={run}", labels::RUN)))
        .await
        .expect("listing step Pods")
        .items
        .into_iter()
        .filter(|p| p.labels().get(labels::ROLE).map(String::as_str) == Some("step"))
        .collect();
    pods.sort_by_key(|p| p.creation_timestamp().map(|t| t.0));
    pods.iter()
        .filter_map(|p| p.labels().get(labels::STEP).cloned())
        .collect()
}

async fn no_approvals(s: &Scenario) -> bool {
    s.approvals()
        .list(&ListParams::default())
        .await
        .expect("listing Approvals")
        .items
        .is_empty()
}

/// Waits until issue-refund's attempt made its refund (pending 30 s, so the attempt is
/// still polling), then deletes its Pod at once, without a termination message: the
/// operator cannot know from the Pod whether it acted. The attempt's key.
async fn lose_issue_refund_after_it_acted(s: &Scenario, payments: &Payments) -> String {
    let (before, pod) = s
        .wait_step_running("refund", "issue-refund", RUN_TIMEOUT)
        .await;
    let key = step_checkpoint(&before, "issue-refund")
        .idempotency_key
        .clone();
    payments.wait_for_refund().await;
    s.pods()
        .delete(&pod, &DeleteParams::default().grace_period(0))
        .await
        .expect("deleting the Pod");
    key
}

#[tokio::test]
async fn a_lost_refund_pod_is_settled_by_its_verify_probe_with_one_refund_and_nobody_woken() {
    let s = node_scenario("node-verify").await;
    let payments = Payments::start(s.namespace(), 30.0).await;
    s.create_run("refund", refund(&payments)).await;
    let key = lose_issue_refund_after_it_acted(&s, &payments).await;

    let run = s.wait_finished("refund", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    let issue = step_checkpoint(&run, "issue-refund");
    assert_eq!(
        (
            issue.effect,
            issue.provenance,
            issue.idempotency_key.as_str()
        ),
        (
            Some(EffectOutcome::Applied),
            Some(Provenance::Verified),
            key.as_str()
        ),
        "{issue:#?}"
    );
    assert_eq!(
        issue.result.as_ref().map(|r| r["refundId"].clone()),
        Some(json!("re_0001")),
        "the probe's answer is the step's result"
    );
    assert!(no_approvals(&s).await, "nobody was asked");
    // The payments service made one refund; only the lost attempt POSTed with the key
    // (the probe reads by key, a GET the service does not count).
    let ledger = payments.ledger().await;
    assert_eq!(
        ledger["refunds"].as_array().map(Vec::len),
        Some(1),
        "ledger: {ledger}"
    );
    assert_eq!(ledger["requestsByKey"][&key], json!(1), "ledger: {ledger}");
    assert_eq!(
        ledger["notifications"].as_array().map(Vec::len),
        Some(1),
        "the run went on to notify: {ledger}"
    );
    // The probe ran on the node with the step's key; no second attempt of
    // issue-refund was started (the lost one's Pod is gone).
    let probe = s
        .list_pods()
        .await
        .into_iter()
        .find(|p| p.labels().get(labels::ROLE).map(String::as_str) == Some("verify"))
        .expect("the probe's Pod");
    assert_eq!(probe.labels()[labels::IDEMPOTENCY_KEY], key);
    let pods = step_pods(&s, "refund").await;
    assert_eq!(
        pods,
        ["lookup-order", "draft-refund", "notify-customer"],
        "no second issue-refund attempt"
    );
    s.finish().await;
}

#[tokio::test]
async fn a_probe_that_cannot_reach_the_provider_leaves_the_refund_to_a_person() {
    let s = node_scenario("node-verify-down").await;
    let payments = Payments::start(s.namespace(), 30.0).await;
    s.create_run("refund", refund(&payments)).await;
    // The refund is made; then the refunds API goes down (503), and the Pod is lost.
    let (_, _) = s
        .wait_step_running("refund", "issue-refund", RUN_TIMEOUT)
        .await;
    let key = payments.wait_for_refund().await;
    payments.outage(&["/refunds"]).await;
    let run = s.runs().get("refund").await.expect("the run");
    let pod = step_checkpoint(&run, "issue-refund")
        .pod
        .expect("issue-refund's Pod");
    s.pods()
        .delete(&pod, &DeleteParams::default().grace_period(0))
        .await
        .expect("deleting the Pod");

    // The probe's 503 is not an answer: a person is asked, and told why.
    let name = s
        .approval_of("refund", Some("issue-refund"), RUN_TIMEOUT)
        .await;
    let a = s.approvals().get(&name).await.expect("the Approval");
    assert_eq!(a.spec.kind, ApprovalKind::Reconcile);
    let reason = a.spec.context.expect("context").reason;
    assert!(reason.contains("its verify probe failed"), "{reason}");
    let ledger = payments.ledger().await;
    assert_eq!(
        ledger["refunds"].as_array().map(Vec::len),
        Some(1),
        "ledger: {ledger}"
    );
    assert_eq!(
        ledger["requestsByKey"][&key],
        json!(1),
        "nothing ran again: {ledger}"
    );
    payments.outage(&[]).await;
    s.finish().await;
}

#[tokio::test]
async fn a_refund_that_failed_at_notify_is_retried_from_there_and_refunds_once() {
    let s = node_scenario("node-retry").await;
    let payments = Payments::start(s.namespace(), 0.0).await;
    // The customer-notification provider is down: notify-customer fails (503, no
    // retry left) after the refund was made.
    payments.outage(&["/notifications"]).await;
    s.create_run("refund", refund(&payments)).await;
    let failed = s.wait_finished("refund", RUN_TIMEOUT).await;
    assert_eq!(
        phase(&failed),
        Some(RunPhase::Failed),
        "{:#?}",
        failed.status
    );
    let refund_key = step_checkpoint(&failed, "issue-refund")
        .idempotency_key
        .clone();
    assert_eq!(
        payments.ledger().await["refunds"].as_array().map(Vec::len),
        Some(1)
    );

    // What a retry from notify-customer keeps, runs and asks, before it is made.
    let (code, plan) = kubectl_agentrun(
        s.namespace(),
        &["retry", "refund", "--from", "notify-customer", "--dry-run"],
    )
    .await;
    assert_eq!(code, 0, "{plan}");
    for kept in ["lookup-order", "draft-refund", "issue-refund"] {
        assert!(plan.contains(kept), "the dry run names {kept}:\n{plan}");
    }
    assert!(
        step_pods(&s, "refund-retry").await.is_empty(),
        "a dry run creates nothing"
    );

    // The provider is back; the retry runs notify-customer alone.
    payments.outage(&[]).await;
    let (code, out) = kubectl_agentrun(
        s.namespace(),
        &[
            "retry",
            "refund",
            "--from",
            "notify-customer",
            "--name",
            "refund-retry",
        ],
    )
    .await;
    assert_eq!(code, 0, "{out}");
    let retried = s.wait_finished("refund-retry", RUN_TIMEOUT).await;
    assert_eq!(
        phase(&retried),
        Some(RunPhase::Succeeded),
        "{:#?}",
        retried.status
    );
    assert_eq!(step_pods(&s, "refund-retry").await, ["notify-customer"]);
    for kept in ["lookup-order", "draft-refund", "issue-refund"] {
        assert_eq!(
            step_checkpoint(&retried, kept).provenance,
            Some(Provenance::Inherited),
            "{kept} carried over"
        );
    }
    let issue = step_checkpoint(&retried, "issue-refund");
    assert_eq!(
        issue.result.as_ref().map(|r| r["refundId"].clone()),
        Some(json!("re_0001"))
    );
    let from = status(&retried)
        .forked_from
        .expect("the retry records its source");
    assert_eq!(
        (from.run_name.as_str(), from.from_step.as_str()),
        ("refund", "notify-customer")
    );

    // The payments service: one refund, made once, under the source run's key; one
    // notification, from the retry.
    let ledger = payments.ledger().await;
    assert_eq!(
        ledger["refunds"].as_array().map(Vec::len),
        Some(1),
        "ledger: {ledger}"
    );
    assert_eq!(ledger["refunds"][0]["idempotencyKey"], json!(refund_key));
    assert_eq!(
        ledger["requestsByKey"][&refund_key],
        json!(1),
        "ledger: {ledger}"
    );
    assert_eq!(
        ledger["notifications"].as_array().map(Vec::len),
        Some(1),
        "ledger: {ledger}"
    );
    s.finish().await;
}
