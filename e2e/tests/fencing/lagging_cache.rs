//! A new leader whose Pod cache is behind the run reads the one Pod before it calls
//! it lost.

use std::time::Duration;

use agentrun_e2e::chaos::proxy::FaultProxy;
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{RunPhase, StepPhase};
use kube::ResourceExt;
use serde_json::json;

use super::{RUN, TIMEOUT};

/// A new leader's Pod cache can be behind the run it reads: the run's status
/// records a NonIdempotent attempt's Pod as seen (its UID), written by the
/// previous leader after the new one listed the Pods, while the Pod's event
/// has not reached the new cache yet. The Pod is alive; taking the cache's
/// word for its loss would ask a person whether a step that is still running
/// may have acted. The operator reads the one Pod before it calls it lost.
///
/// ```text
///   operator A: creates the Pod, records its UID ── SIGKILL
///   proxy:      Pod lists and watches leave the Pod out for 8 s
///   operator B: run cache has the UID, Pod cache has no Pod → reads the Pod → running
/// ```
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_pod_missing_from_a_lagging_cache_is_read_before_it_is_called_lost() {
    let mut s = Scenario::start_without_operator("lagging-pod-cache").await;
    let p = FaultProxy::quiet().await;
    let kubeconfig =
        agentrun_e2e::support::processes::log_dir(s.namespace()).join("operator-kubeconfig");
    p.write_kubeconfig(&kubeconfig, s.namespace())
        .expect("writing the proxy kubeconfig");
    s.operator_config.kubeconfig = kubeconfig;
    s.start_operator(None);
    s.create_run(
        RUN,
        json!({"steps": [sim_step("charge", "NonIdempotent", json!({"runMs": 12000}))]}),
    )
    .await;
    let (running, pod) = s.wait_step_running(RUN, "charge", TIMEOUT).await;
    // The UID is recorded once the operator has seen the Pod.
    let running = if status(&running).steps[0].pod_uid.is_some() {
        running
    } else {
        s.wait_run(RUN, "recording the Pod's UID", TIMEOUT, |r| {
            status(r).steps[0].pod_uid.is_some()
        })
        .await
    };
    s.kill_operator().await;

    p.hide_pods(&pod, Duration::from_secs(8));
    s.start_operator(None);
    // The new operator lists a Pod cache without the Pod and reconciles the
    // run; give it the hidden window to get it wrong.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let now = s.runs().get(RUN).await.expect("reading the run");
    let cp = &status(&now).steps[0];
    assert_eq!(
        (cp.phase, cp.attempt, cp.approval.as_deref(), cp.effect),
        (StepPhase::Running, 1, None, None),
        "a running Pod the cache did not show was taken for lost: {:?}\n{}",
        now.status,
        s.operator.as_ref().unwrap().log_tail(30)
    );
    assert_eq!(
        cp.pod_uid,
        status(&running).steps[0].pod_uid,
        "the recorded Pod is still the one"
    );

    let run = s.wait_finished(RUN, TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    let approvals = s
        .approvals()
        .list(&Default::default())
        .await
        .expect("listing approvals")
        .items;
    assert!(
        approvals.is_empty(),
        "no person was asked about a step that never stopped: {:?}",
        approvals.iter().map(|a| a.name_any()).collect::<Vec<_>>()
    );
    assert_eq!(s.ledger().executions().count(), 1, "the step ran once");
    s.finish().await;
}
