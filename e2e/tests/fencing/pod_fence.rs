//! The step Pod fence: a Pod create a deposed leader sends after the Lease moved on
//! is refused by the API server.

use std::time::Duration;

use agentrun_e2e::support::policies::{fence_namespace, wait_fenced, wait_refused};
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::RunPhase;
use agentrun_operator::labels;
use kube::ResourceExt;
use kube::api::DeleteParams;
use serde_json::json;

use super::{Pair, RUN, TIMEOUT, wait_holder, wait_stopped};

/// A leader stopped between its proof and its Pod create sends the create
/// after the pause: no client-side check can be later than that. Meanwhile
/// the standby took the Lease, ran the attempt and committed it, and the
/// finished Pod was deleted, so the name is free again. With the chart's step
/// Pod fence the API server refuses the late create, because its creator no
/// longer holds the Lease; without it the step ran a second time.
///
/// ```text
///   A: records attempt 1, proof checked ── SIGSTOP (before-create-pod) ─────── SIGCONT ─▶ create → 403
///   B:                                   takes the Lease, creates attempt 1, commits it
///   driver:                              deletes attempt 1's finished Pod
/// ```
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_create_sent_after_the_lease_moved_on_is_refused_by_the_api_server() {
    // On waking, A's create races its own lease check, which may see the
    // Lease expired and stop the process first: safe, but then nothing was
    // sent for the fence to refuse. Up to six tries for a create that was
    // sent (three were seen to lose the race in a row on a loaded CI
    // machine); every try must be safe.
    for _ in 0..6 {
        if late_create_is_refused_or_never_sent().await {
            return;
        }
    }
    panic!("in six tries operator-a never sent its late create: the fence was not exercised");
}

/// One try: whether operator-a sent its late create (and it was refused).
async fn late_create_is_refused_or_never_sent() -> bool {
    let s = Scenario::start_without_operator("fenced-late-create").await;
    fence_namespace(s.namespace()).await;
    let mut pair = Pair::start_with(&s, Some("before-create-pod:1:stop")).await;
    wait_fenced(s.namespace()).await;
    s.create_run(
        RUN,
        json!({"steps": [sim_step("charge", "NonIdempotent", json!({"runMs": 50}))]}),
    )
    .await;
    let a = pair.ops[0].take().expect("operator-a runs");
    wait_stopped(&a, "before creating the Pod").await;
    // From here on A does not hear of the Lease: it keeps believing it leads.
    pair.proxies[0].stall("/leases", false, Duration::from_secs(300));

    wait_holder(&pair.leases, "operator-b", &[pair.ops[1].as_ref().unwrap()]).await;
    // The fence refuses A's creates once the API server's own view of the
    // Lease shows B; a plane whose view is stale fails here, by name.
    wait_refused(s.namespace(), "operator-a").await;
    let done = s.wait_finished(RUN, TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Succeeded), "{:?}", done.status);
    let cp = status(&done).steps[0].clone();
    let pod = cp.pod.clone().expect("attempt 1's Pod");
    let pods = s.pods();
    agentrun_e2e::wait_for(
        &pods,
        &pod,
        |p: Option<&k8s_openapi::api::core::v1::Pod>| {
            p.is_some_and(|p| !p.finalizers().iter().any(|f| f == labels::RESULT_FINALIZER))
        },
        TIMEOUT,
    )
    .await;
    pods.delete(&pod, &DeleteParams::default())
        .await
        .expect("deleting attempt 1's finished Pod");
    agentrun_e2e::wait_for_deleted(&pods, &pod, TIMEOUT).await;

    // A wakes and sends the create it had checked before its sleep.
    let after = pair.resume(0, a).await;
    assert!(
        !after.contains("created step pod"),
        "operator-a's late create was not refused by the fence:\n{after}"
    );
    let sent = after.contains(labels::NOT_THE_LEADER);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        pods.get_opt(&pod).await.unwrap().is_none(),
        "operator-a created attempt 1's Pod again after it was committed:\n{after}"
    );
    let runs = s.ledger().executions_by_key();
    assert_eq!(
        runs.get(&cp.idempotency_key),
        Some(&1),
        "the committed attempt ran again: {runs:?}\n{after}"
    );
    pair.stop().await;
    s.finish().await;
    sent
}
