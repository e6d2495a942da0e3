//! The contract's second set of holes, each as a user met it, on the real
//! control plane with the operator and the simulated kubelet as processes.
//! Every scenario counts what the steps really did in the simkubelet ledger,
//! per step across plan revisions — a step that acted twice under two keys is
//! a duplicate — and fails on an operator that repeats an effect.

use std::time::Duration;

use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{AgentRun, ApprovalKind, EffectOutcome, RunPhase, StepCheckpoint};
use agentrun_operator::labels;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{EvictParams, ListParams, Patch, PatchParams};
use serde_json::json;

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

/// Executions (ledger `started` lines) of step `step` of run `run`, in any
/// plan revision, under any key.
fn executions(s: &Scenario, run: &str, step: &str) -> Vec<String> {
    s.ledger()
        .entries
        .iter()
        .filter(|e| {
            e.event == agentrun_e2e::ledger::LedgerEvent::Started
                && e.run.as_deref() == Some(run)
                && e.step.as_deref() == Some(step)
                && e.role.as_deref().is_none_or(|r| r == "step")
        })
        .map(|e| e.key().to_owned())
        .collect()
}

fn checkpoint<'a>(run: &'a AgentRun, name: &str, rev: i64) -> &'a StepCheckpoint {
    status_ref(run)
        .steps
        .iter()
        .find(|c| c.name == name && c.plan_revision == rev && c.role.is_step())
        .unwrap_or_else(|| {
            panic!(
                "no checkpoint of {name} at revision {rev}: {:#?}",
                run.status
            )
        })
}

fn status_ref(run: &AgentRun) -> &agentrun_operator::api::AgentRunStatus {
    run.status.as_ref().expect("a status")
}

fn condition(run: &AgentRun, type_: &str) -> Option<(String, String)> {
    status_ref(run)
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

/// quote (a read, true for 3 s) → charge (NonIdempotent, takes 6 s) → ship.
/// When charge is done the quote is stale: the run re-plans, runs the quote
/// again and ships — and charges once. (On the landed main of the time,
/// charge ran 17 times under 17 keys.)
#[tokio::test]
async fn a_replan_runs_the_stale_read_again_and_never_the_charge() {
    let s = Scenario::start("contract-replan").await;
    s.create_run(
        "checkout",
        json!({"steps": [
            with(sim_step("quote", "None", json!({"runMs": 50, "result": {"price": 42}})), json!({"freshFor": "3s"})),
            sim_step("charge", "NonIdempotent", json!({"runMs": 6000, "result": {"charged": 42}})),
            sim_step("ship", "Idempotent", json!({"runMs": 50, "result": {"shipped": true}})),
        ]}),
    )
    .await;
    let run = s.wait_finished("checkout", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    assert_eq!(
        executions(&s, "checkout", "charge").len(),
        1,
        "charged once"
    );
    assert_eq!(
        executions(&s, "checkout", "quote").len(),
        2,
        "the stale quote ran again"
    );
    let plan = status(&run).plan.unwrap();
    assert_eq!(plan.revision, 2);
    assert_eq!(plan.rerun, ["quote", "ship"]);
    let charge = checkpoint(&run, "charge", 1);
    assert_eq!(charge.effect, Some(EffectOutcome::Applied));
    assert!(
        !status_ref(&run)
            .steps
            .iter()
            .any(|c| c.name == "charge" && c.plan_revision == 2),
        "charge keeps its checkpoint of revision 1"
    );
    s.finish().await;
}

/// A NonIdempotent step stopped by its timeout may have acted: attempt 2 is
/// never created without a person's Retry. (It was, with the same key and no
/// question.)
#[tokio::test]
async fn a_timed_out_non_idempotent_step_waits_for_a_person_before_attempt_2() {
    let s = Scenario::start("contract-timeout").await;
    s.create_run(
        "refund",
        json!({"steps": [with(
            sim_step("issue-refund", "NonIdempotent", json!({"attempts": [
                {"runMs": 60000, "result": {"refundId": "r-1"}},
                {"runMs": 50, "result": {"refundId": "r-1"}}
            ]})),
            json!({"timeout": "3s", "retry": {"limit": 1, "backoff": {"initial": "1s", "max": "1s"}}}),
        )]}),
    )
    .await;
    let name = s
        .approval_of("refund", Some("issue-refund"), Duration::from_secs(30))
        .await;
    let a = s.approvals().get(&name).await.unwrap();
    assert_eq!(a.spec.kind, ApprovalKind::Reconcile);
    // However long nobody answers, nothing runs again.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        executions(&s, "refund", "issue-refund").len(),
        1,
        "no blind retry"
    );
    let run = s.runs().get("refund").await.unwrap();
    assert_eq!(phase(&run), Some(RunPhase::WaitingForApproval));
    assert_eq!(
        checkpoint(&run, "issue-refund", 1).effect,
        Some(EffectOutcome::Unknown)
    );
    s.decide(
        &name,
        "Retry",
        "the payments ledger shows no refund for this key",
    )
    .await;
    let run = s.wait_finished("refund", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    let keys = executions(&s, "refund", "issue-refund");
    assert_eq!(keys.len(), 2);
    assert_eq!(
        keys[0], keys[1],
        "the retry a person allowed uses the same key"
    );
    s.finish().await;
}

/// A gated step approved, failed once (saying it did not act), edited during
/// its retry backoff: attempt 2 waits for a new decision about the edited
/// step and then runs exactly it. (It ran the edited container under the old
/// approval.)
#[tokio::test]
async fn a_step_edited_during_its_backoff_is_approved_again_before_it_runs() {
    let s = Scenario::start("contract-edit-backoff").await;
    s.create_run(
        "deploy",
        json!({"steps": [with(
            sim_step("deploy", "Idempotent", json!({"attempts": [
                {"runMs": 50, "exitCode": 1, "rawMessage": "{\"result\": {\"error\": \"busy\"}, \"effect\": \"NotApplied\"}"},
                {"runMs": 50, "result": {"deployed": true}}
            ]})),
            json!({
                "approval": {"required": true, "question": "Deploy?"},
                "retry": {"limit": 1, "backoff": {"initial": "8s", "max": "8s"}}
            }),
        )]}),
    )
    .await;
    let first = s
        .approval_of("deploy", Some("deploy"), Duration::from_secs(30))
        .await;
    s.decide(&first, "Approved", "ship it").await;
    s.wait_run("deploy", "failed once", Duration::from_secs(30), |r| {
        r.status
            .as_ref()
            .and_then(|st| st.steps.first())
            .is_some_and(|c| c.failures == 1)
    })
    .await;
    // During the 8 s backoff the step's arguments change.
    let mut run = s.runs().get("deploy").await.unwrap();
    run.spec.steps[0].container.as_mut().unwrap().args = vec!["--force".into()];
    s.runs()
        .patch(
            "deploy",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"steps": [serde_json::to_value(&run.spec.steps[0]).unwrap()]}}),
            ),
        )
        .await
        .unwrap();
    let second = format!("{first}-2");
    s.wait_run("deploy", "asking again", Duration::from_secs(30), |r| {
        r.status
            .as_ref()
            .and_then(|st| st.steps.first())
            .is_some_and(|c| c.approval.as_deref() == Some(second.as_str()))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        executions(&s, "deploy", "deploy").len(),
        1,
        "nothing runs under the old approval"
    );
    s.decide(&second, "Approved", "the forced deploy is fine")
        .await;
    let run = s.wait_finished("deploy", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    let pods = s.list_pods().await;
    let a2 = pods
        .iter()
        .find(|p| p.labels().get(labels::ATTEMPT).map(String::as_str) == Some("2"))
        .expect("attempt 2");
    assert_eq!(
        a2.spec.as_ref().unwrap().containers[0].args,
        Some(vec!["--force".to_owned()])
    );
    let approved = s.approvals().get(&second).await.unwrap();
    assert_eq!(
        a2.annotations().get(labels::STEP_DIGEST),
        approved.spec.step_digest.as_ref(),
        "the Pod runs the digest the second approval bound"
    );
    s.finish().await;
}

/// A Pod evicted before it starts, again and again, is re-created after a
/// growing backoff, and the run says it is stalled until it gets through.
/// (It was re-created at once every time: 53 Pods in 25 s, nothing said.)
#[tokio::test]
async fn repeated_evictions_back_off_and_the_run_says_it_is_stalled() {
    let s = Scenario::start("contract-evictions").await;
    s.create_run(
        "flaky",
        json!({"steps": [with(
            sim_step("fetch", "Idempotent", json!({"attempts": [
                {"pendingMs": 600000}, {"pendingMs": 600000}, {"pendingMs": 600000},
                {"pendingMs": 600000}, {"runMs": 50, "result": {"ok": true}}
            ]})),
            json!({"retry": {"limit": 0, "backoff": {"initial": "2s", "max": "8s"}}}),
        )]}),
    )
    .await;
    let pods = s.pods();
    let mut evicted = 0;
    let mut created: Vec<i64> = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while evicted < 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "attempt {} never came",
            evicted + 1
        );
        let live: Vec<Pod> = pods
            .list(&ListParams::default().labels(&format!(
                "{}=flaky,{}={}",
                labels::RUN,
                labels::ATTEMPT,
                evicted + 1
            )))
            .await
            .unwrap()
            .items;
        match live.first() {
            Some(p) => {
                created.extend(
                    p.metadata
                        .creation_timestamp
                        .as_ref()
                        .map(|t| t.0.as_second()),
                );
                pods.evict(&p.name_any(), &EvictParams::default())
                    .await
                    .unwrap();
                evicted += 1;
            }
            None => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    // Stalled for the repeated disruptions. Under load an evicted Pod may
    // also outlive its grace period for a moment first, which the run
    // reports as PodNotStopping, also true; this waits for the stall the
    // test is about.
    let run = s
        .wait_run(
            "flaky",
            "stalled for repeated disruptions",
            Duration::from_secs(30),
            |r| condition(r, "Stalled") == Some(("True".into(), "RepeatedlyDisrupted".into())),
        )
        .await;
    let stalled = run
        .status
        .as_ref()
        .and_then(|st| st.conditions.iter().find(|c| c.type_ == "Stalled"))
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(stalled.starts_with("step fetch was disrupted"), "{stalled}");
    let run = s.wait_finished("flaky", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded));
    assert_eq!(
        condition(&run, "Stalled").map(|c| c.0),
        Some("False".into())
    );
    // The attempts came after a growing backoff: creation times spread out.
    let last = status(&run).steps[0].clone();
    assert_eq!(
        (last.attempt, last.disruptions),
        (5, 4),
        "one Pod per attempt, no hot loop"
    );
    let fifth = s.pods().get(last.pod.as_deref().unwrap()).await.unwrap();
    created.extend(
        fifth
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_second()),
    );
    let gaps: Vec<i64> = created.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(
        gaps[1] >= 2 && gaps[2] >= 4 && gaps[3] >= 8,
        "disruptions 2, 3 and 4 back off 2 s, 4 s, 8 s: gaps {gaps:?}"
    );
    s.finish().await;
}

/// A quote (true for 8 s) finishes while the operator is down for 14 s:
/// when it comes back, buy does not start on it; the quote runs again.
/// (Freshness counted from when the operator looked, so buy ran on it.)
#[tokio::test]
async fn freshness_counts_from_the_containers_finish_not_from_the_operators_look() {
    let mut s = Scenario::start("contract-freshness").await;
    s.create_run(
        "order",
        json!({"steps": [
            with(sim_step("quote", "None", json!({"runMs": 3000, "result": {"price": 10}})), json!({"freshFor": "8s"})),
            sim_step("buy", "NonIdempotent", json!({"runMs": 50, "result": {"bought": true}})),
        ]}),
    )
    .await;
    s.wait_step_running("order", "quote", Duration::from_secs(30))
        .await;
    s.kill_operator().await;
    tokio::time::sleep(Duration::from_secs(17)).await;
    s.start_operator(None);
    let run = s.wait_finished("order", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    let q = checkpoint(&run, "quote", 1);
    let finished = q.finished_at.as_ref().unwrap().0;
    assert_eq!(
        q.fresh_until.as_ref().unwrap().0,
        finished
            .checked_add(jiff::SignedDuration::from_secs(8))
            .unwrap()
    );
    assert_eq!(status(&run).plan.unwrap().revision, 2, "the run re-planned");
    assert_eq!(executions(&s, "order", "quote").len(), 2);
    let buys = s
        .ledger()
        .entries
        .iter()
        .filter(|e| {
            e.step.as_deref() == Some("buy")
                && e.event == agentrun_e2e::ledger::LedgerEvent::Started
        })
        .map(|e| e.pod.clone())
        .collect::<Vec<_>>();
    assert_eq!(buys.len(), 1);
    assert!(
        buys[0].contains("-r2-"),
        "buy ran once, on the fresh quote: {buys:?}"
    );
    s.finish().await;
}

/// A step Pod whose run label someone removed still ends the step: the
/// operator reads it by name and puts its label back. (The step stayed
/// `NotSeen` forever.)
#[tokio::test]
async fn a_step_pod_that_lost_its_run_label_still_ends_its_step() {
    let s = Scenario::start("contract-label").await;
    s.create_run(
        "unlabelled",
        json!({"steps": [sim_step("slow", "Idempotent", json!({"runMs": 6000, "result": {"ok": true}}))]}),
    )
    .await;
    s.wait_step_running("unlabelled", "slow", Duration::from_secs(30))
        .await;
    let run = s.runs().get("unlabelled").await.unwrap();
    let pod = checkpoint(&run, "slow", 1).pod.clone().unwrap();
    s.pods()
        .patch(
            &pod,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {labels::RUN: null}}})),
        )
        .await
        .unwrap();
    let run = s.wait_finished("unlabelled", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    // The finalizer is released after the checkpoint commits (D3): wait for it.
    agentrun_e2e::wait_for(
        &s.pods(),
        &pod,
        |p: Option<&k8s_openapi::api::core::v1::Pod>| {
            p.is_some_and(|p| !p.finalizers().iter().any(|f| f == labels::RESULT_FINALIZER))
        },
        Duration::from_secs(30),
    )
    .await;
    let p = s.pods().get(&pod).await.unwrap();
    assert_eq!(
        p.labels().get(labels::RUN).map(String::as_str),
        Some("unlabelled")
    );
    s.finish().await;
}

/// A decision whose time the API server's managedFields no longer tell (a
/// client cleared them), seen only after the deadline, counts as late: the
/// run fails as expired, and the step never runs. (It counted as in time.)
#[tokio::test]
async fn a_decision_of_unknown_time_seen_after_the_deadline_is_late() {
    let mut s = Scenario::start("contract-managed-fields").await;
    s.create_run(
        "gated",
        json!({"steps": [with(
            sim_step("act", "NonIdempotent", json!({"runMs": 50})),
            json!({"approval": {"required": true, "timeout": "6s", "onTimeout": "Reject"}}),
        )]}),
    )
    .await;
    let name = s
        .approval_of("gated", Some("act"), Duration::from_secs(30))
        .await;
    s.kill_operator().await;
    s.decide(&name, "Approved", "fine").await;
    s.approvals()
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"managedFields": [{}]}})),
        )
        .await
        .unwrap();
    let cleared = s.approvals().get(&name).await.unwrap();
    assert!(
        cleared
            .metadata
            .managed_fields
            .as_ref()
            .is_none_or(|m| m.is_empty()),
        "the API server dropped the record of when it was decided"
    );
    tokio::time::sleep(Duration::from_secs(8)).await;
    s.start_operator(None);
    let run = s.wait_finished("gated", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed), "{:#?}", run.status);
    assert_eq!(
        condition(&run, "Succeeded"),
        Some(("False".into(), "ApprovalExpired".into()))
    );
    assert!(
        executions(&s, "gated", "act").is_empty(),
        "the step never ran"
    );
    s.finish().await;
}

/// A step spec with `extra`'s fields added.
fn with(mut step: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    if let (Some(s), serde_json::Value::Object(e)) = (step.as_object_mut(), extra) {
        s.extend(e);
    }
    step
}
