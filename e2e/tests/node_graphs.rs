//! The graph samples on the real local node (`e2e/cluster node up`), as they are:
//! config/samples/agentrun_expert_review.yaml (fan-out and fan-in),
//! config/samples/agentrun_email_triage.yaml (conditional routing) and
//! config/samples/agentrun_expense.yaml (parallel approvals) and
//! config/samples/agentrun_return.yaml (a signal from outside, then a timer), with the
//! example agent's image on real containers. Every test fails (never skips) when the node is missing.

use std::time::Duration;

use agentrun_e2e::kubectl_ok;
use agentrun_e2e::support::node::{Payments, node_scenario};
use agentrun_e2e::support::scenario::{Scenario, phase, status, step_checkpoint};
use agentrun_operator::api::{RunPhase, StepPhase};
use serde_json::json;

const RUN_TIMEOUT: Duration = Duration::from_secs(240);

async fn apply(s: &Scenario, files: &[&std::path::Path]) {
    for f in files {
        kubectl_ok([
            "apply".as_ref(),
            "-n".as_ref(),
            s.namespace().as_ref(),
            "-f".as_ref(),
            f.as_os_str(),
        ])
        .await;
    }
}

/// The ConfigMap the samples read the payments URL from, pointing at the example
/// payments service this test started.
fn configmap(s: &Scenario, payments: &Payments) -> std::path::PathBuf {
    let file = agentrun_e2e::support::processes::log_dir(s.namespace()).join("configmap.json");
    let cm = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "refund-agent", "namespace": s.namespace()},
        "data": {"PAYMENTS_API_URL": payments.url()},
    });
    std::fs::write(&file, cm.to_string()).expect("writing the ConfigMap");
    file
}

#[tokio::test]
async fn expert_review_sample_fans_out_to_two_experts_and_joins_them() {
    let s = node_scenario("node-expert-review").await;
    let sample = agentrun_e2e::repo_root().join("config/samples/agentrun_expert_review.yaml");
    apply(&s, &[&sample]).await;
    let run = s.wait_finished("expert-review", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    let physicist = step_checkpoint(&run, "physicist");
    let chemist = step_checkpoint(&run, "chemist");
    let aggregate = step_checkpoint(&run, "aggregate");
    assert_eq!(physicist.result.as_ref().unwrap()["field"], "physics");
    assert_eq!(chemist.result.as_ref().unwrap()["field"], "chemistry");
    // The experts ran side by side: each started before the other finished.
    let (p0, p1) = (
        physicist.started_at.unwrap().0,
        physicist.finished_at.unwrap().0,
    );
    let (c0, c1) = (
        chemist.started_at.unwrap().0,
        chemist.finished_at.unwrap().0,
    );
    assert!(
        p0 <= c1 && c0 <= p1,
        "physicist {p0}–{p1}, chemist {c0}–{c1}"
    );
    // The aggregator read both answers from its context file.
    let result = aggregate.result.unwrap();
    assert_eq!(result["fields"], json!(["physics", "chemistry"]));
    assert!(
        result["answer"].as_str().unwrap().contains("Rayleigh"),
        "{result}"
    );
    assert!(aggregate.started_at.unwrap().0 >= p1.max(c1));
    assert_eq!(status(&run).progress.as_deref(), Some("4/4"));
    s.finish().await;
}

/// The detector's verdict routes the run: the sample as it is (an invoice)
/// drafts a reply and skips the quarantine; the same run with a spam subject
/// quarantines and skips the reply. The skipped step never runs a container.
#[tokio::test]
async fn email_triage_sample_routes_on_the_detectors_verdict() {
    let s = node_scenario("node-email-triage").await;
    let sample = agentrun_e2e::repo_root().join("config/samples/agentrun_email_triage.yaml");
    let text = std::fs::read_to_string(&sample).expect("reading the sample");
    let spam = agentrun_e2e::support::processes::log_dir(s.namespace()).join("spam.yaml");
    std::fs::write(
        &spam,
        text.replace("name: email-triage\n", "name: email-triage-spam\n")
            .replace(
                "Invoice 4711 for October",
                "You are a WINNER of the lottery",
            ),
    )
    .expect("writing the spam variant");
    apply(&s, &[&sample, &spam]).await;
    for (run, ran, skipped) in [
        ("email-triage", "draft-reply", "quarantine"),
        ("email-triage-spam", "quarantine", "draft-reply"),
    ] {
        let done = s.wait_finished(run, RUN_TIMEOUT).await;
        assert_eq!(
            phase(&done),
            Some(RunPhase::Succeeded),
            "{run}: {:#?}",
            done.status
        );
        let verdict = step_checkpoint(&done, "detect-spam").result.unwrap();
        assert_eq!(verdict["isSpam"], run.ends_with("spam"), "{run}: {verdict}");
        let r = step_checkpoint(&done, ran);
        assert_eq!(r.phase, StepPhase::Succeeded, "{run}");
        let out = r.result.unwrap();
        assert!(
            out.get("reply").or(out.get("quarantined")).is_some(),
            "{run}: {ran} returned {out}"
        );
        let k = step_checkpoint(&done, skipped);
        assert_eq!(
            (k.phase, k.pod.as_deref(), k.attempt),
            (StepPhase::Skipped, None, 0),
            "{run}: {skipped} never ran"
        );
        assert_eq!(status(&done).progress.as_deref(), Some("3/3"), "{run}");
        assert_eq!(status(&done).step_executions, 2, "{run}");
    }
    s.finish().await;
}

#[tokio::test]
async fn expense_sample_asks_two_approvals_at_once_and_pays_out_once() {
    let s = node_scenario("node-expense").await;
    let payments = Payments::start(s.namespace(), 0.0).await;
    let cm = configmap(&s, &payments);
    let sample = agentrun_e2e::repo_root().join("config/samples/agentrun_expense.yaml");
    apply(&s, &[&cm, &sample]).await;
    let manager = s
        .approval_of("expense-ex-77", Some("manager-approval"), RUN_TIMEOUT)
        .await;
    s.decide(&manager, "Approved", "team offsite, fine").await;
    let budget = s
        .approval_of("expense-ex-77", Some("budget-check"), RUN_TIMEOUT)
        .await;
    let compliance = s
        .approval_of("expense-ex-77", Some("compliance-check"), RUN_TIMEOUT)
        .await;
    // Both questions are open at the same time; compliance answers first.
    s.decide(&compliance, "Approved", "within policy").await;
    let run = s
        .wait_run("expense-ex-77", "compliance checked", RUN_TIMEOUT, |r| {
            status(r)
                .steps
                .iter()
                .any(|c| c.name == "compliance-check" && c.phase == StepPhase::Succeeded)
        })
        .await;
    assert_eq!(
        step_checkpoint(&run, "budget-check").phase,
        StepPhase::WaitingForApproval
    );
    assert!(
        payments.ledger().await["payouts"]
            .as_array()
            .unwrap()
            .is_empty(),
        "no payout before both approvals"
    );
    s.decide(&budget, "Approved", "budget ok").await;
    let run = s.wait_finished("expense-ex-77", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    let reimburse = step_checkpoint(&run, "reimburse");
    let ledger = payments.ledger().await;
    let payouts = ledger["payouts"].as_array().unwrap();
    assert_eq!(payouts.len(), 1, "{ledger}");
    assert_eq!(
        payouts[0]["idempotencyKey"],
        json!(reimburse.idempotency_key)
    );
    assert_eq!(payouts[0]["amount"], "120.00 EUR");
    s.finish().await;
}

/// The return sample waits for the warehouse's scan (a Signal), then for its
/// inspection window (a timer), then tells the customer once; the scan is
/// sent twice, as a retrying scanner does, and taken once.
#[tokio::test]
async fn return_sample_waits_for_the_scan_then_the_window_and_notifies_once() {
    let s = node_scenario("node-return").await;
    let payments = Payments::start(s.namespace(), 0.0).await;
    let cm = configmap(&s, &payments);
    let sample = agentrun_e2e::repo_root().join("config/samples/agentrun_return.yaml");
    apply(&s, &[&cm, &sample]).await;
    let waiting = s
        .wait_run("return-4711", "waiting for the scan", RUN_TIMEOUT, |r| {
            status(r)
                .steps
                .iter()
                .any(|c| c.name == "parcel-received" && c.phase == StepPhase::Waiting)
        })
        .await;
    assert_eq!(phase(&waiting), Some(RunPhase::Waiting));
    let signal = step_checkpoint(&waiting, "parcel-received")
        .signal
        .expect("the Signal");
    let scan = json!({"spec": {"id": "scan-0042", "data": {"condition": "damaged", "dock": "B3"}}})
        .to_string();
    for _ in 0..2 {
        kubectl_ok([
            "-n",
            s.namespace(),
            "patch",
            "signal",
            &signal,
            "--type",
            "merge",
            "-p",
            &scan,
        ])
        .await;
    }
    let run = s.wait_finished("return-4711", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    let received = step_checkpoint(&run, "parcel-received");
    assert_eq!(
        received.result,
        Some(json!({"condition": "damaged", "dock": "B3"}))
    );
    let window = step_checkpoint(&run, "inspection-window");
    assert!(
        window.started_at.unwrap().0 >= received.finished_at.unwrap().0,
        "the window starts after the scan"
    );
    let notify = step_checkpoint(&run, "notify-customer");
    assert!(notify.started_at.unwrap().0 >= window.wake_at.unwrap().0);
    let ledger = payments.ledger().await;
    let sent = ledger["notifications"].as_array().unwrap();
    assert_eq!(sent.len(), 1, "{ledger}");
    assert_eq!(sent[0]["template"], "return-received");
    assert_eq!(status(&run).step_executions, 2, "waits are not executions");
    s.finish().await;
}
