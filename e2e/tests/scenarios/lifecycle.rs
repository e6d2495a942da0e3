//! The end of a run: a finished run is deleted after its TTL with what it
//! owned (D12); a foreground deletion of a running run completes; whatever
//! the deletion mode, no Pod keeps the result finalizer once its run is
//! gone (D5).

use std::time::Duration;

use agentrun_e2e::support::scenario::{Scenario, sim_step};
use kube::ResourceExt;
use kube::api::{DeleteParams, ListParams};
use serde_json::json;

use super::{RUN_TIMEOUT, gated, wait_for_gate};

#[tokio::test]
async fn finished_run_is_deleted_after_its_ttl_with_its_pods_and_approvals() {
    let s = Scenario::start("ttl").await;
    let mut spec = gated(None, "Reject");
    spec["ttlSecondsAfterFinished"] = json!(2);
    s.create_run("short-lived", spec).await;
    let approval = wait_for_gate(&s, "short-lived").await;
    s.decide(&approval, "Approved", "ok").await;
    s.wait_finished("short-lived", RUN_TIMEOUT).await;
    agentrun_e2e::wait_for_deleted(&s.runs(), "short-lived", Duration::from_secs(30)).await;
    // The garbage collector removes what the run owned.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let pods = s.list_pods().await.len();
        let approvals = s
            .approvals()
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len();
        if pods == 0 && approvals == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{pods} pods and {approvals} approvals left after the run was deleted"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    s.finish().await;
}

/// `kubectl delete ar --cascade=foreground` keeps the run until its Pods are
/// gone, while each Pod waits on the result finalizer: the operator must still
/// act on a run that is being deleted, or both wait forever.
#[tokio::test]
async fn foreground_deletion_of_a_running_run_completes() {
    let s = Scenario::start("foreground-delete").await;
    s.create_run(
        "doomed",
        json!({"steps": [sim_step("slow", "Idempotent", json!({"runMs": 60000}))]}),
    )
    .await;
    s.wait_step_running("doomed", "slow", RUN_TIMEOUT).await;
    s.runs()
        .delete("doomed", &DeleteParams::foreground())
        .await
        .expect("foreground deletion accepted");
    agentrun_e2e::wait_for_deleted(&s.runs(), "doomed", Duration::from_secs(30)).await;
    let pods = s.list_pods().await.len();
    assert_eq!(pods, 0, "the run's Pods went with it");
    s.finish().await;
}

/// D5 whatever the deletion mode: once a running run is deleted, in the
/// background or with its Pods orphaned, no Pod keeps `agentrun.dev/result`.
#[tokio::test]
async fn no_pod_keeps_the_result_finalizer_after_its_run_is_gone() {
    let s = Scenario::start("orphan-delete").await;
    let slow = || json!({"steps": [sim_step("slow", "Idempotent", json!({"runMs": 60000}))]});
    for (run, propagation) in [("background", "Background"), ("orphaned", "Orphan")] {
        s.create_run(run, slow()).await;
        s.wait_step_running(run, "slow", RUN_TIMEOUT).await;
        // The launch is recorded before the Pod is created: wait for the Pod.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !s
            .list_pods()
            .await
            .iter()
            .any(|p| p.name_any().starts_with(run))
        {
            assert!(std::time::Instant::now() < deadline, "no Pod for {run}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let params = DeleteParams {
            propagation_policy: Some(match propagation {
                "Orphan" => kube::api::PropagationPolicy::Orphan,
                _ => kube::api::PropagationPolicy::Background,
            }),
            ..DeleteParams::default()
        };
        s.runs()
            .delete(run, &params)
            .await
            .expect("deletion accepted");
        agentrun_e2e::wait_for_deleted(&s.runs(), run, Duration::from_secs(30)).await;
    }
    s.wait_finalizers_released(Duration::from_secs(30)).await;
    // The orphaned run's Pod stays (that is what Orphan asks for), released.
    let left: Vec<String> = s.list_pods().await.iter().map(|p| p.name_any()).collect();
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].starts_with("orphaned-slow-"), "{left:?}");
    s.finish().await;
}
