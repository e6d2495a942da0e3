//! A leader stopped while its proof read is in flight must not take the old answer
//! as a proof that the run is current.

use std::time::Duration;

use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::RunPhase;
use kube::api::DeleteParams;
use serde_json::json;

use super::{Pair, RUN, TIMEOUT, log_len, log_since, stopped, wait_holder, wait_stopped};

/// A leader stopped while the read that proves the run current is in
/// flight wakes to an answer from before its sleep. Meanwhile the standby
/// took over, ran the attempt and committed it, and the attempt's Pod is
/// gone. The resumed leader must not take that old answer as a proof: the
/// proof is only as fresh as the request it was asked in.
///
/// ```text
///   A: write launch of attempt 1 ── SIGSTOP 1.5 s ── proof read ── SIGSTOP … SIGCONT ─▶ must not create
///   B:                                                  takes the Lease, creates attempt 1, commits it
///   driver:                                             deletes attempt 1's finished Pod
/// ```
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_stopped_during_its_proof_read_creates_no_pod_for_a_closed_attempt() {
    // Now and then A, resumed, creates the Pod without the proof read that
    // the scenario stops it in (it still leads then, so that is right): try
    // again, up to three times, for a run that reaches the proof read.
    for _ in 0..3 {
        if stopped_during_the_proof_read().await {
            return;
        }
    }
    panic!(
        "in three tries operator-a never stopped at its proof read: the scenario was not exercised"
    );
}

/// One try: whether operator-a stopped at its proof read (and then created
/// nothing for the closed attempt).
async fn stopped_during_the_proof_read() -> bool {
    let s = Scenario::start_without_operator("fenced-proof-read").await;
    let mut pair = Pair::start_with(
        &s,
        Some("after-status-write:1:stop,after-proof-read:1:stop"),
    )
    .await;
    s.create_run(
        RUN,
        json!({"steps": [sim_step("charge", "NonIdempotent", json!({}))]}),
    )
    .await;
    // A recorded the launch and stopped before creating the Pod; long enough
    // asleep that it proves the run current again before the create.
    let a = pair.ops[0].take().expect("operator-a runs");
    wait_stopped(&a, "after writing the launch").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // From here on A does not hear of the Lease: it keeps believing it leads.
    pair.proxies[0].stall("/leases", false, Duration::from_secs(300));
    let from = log_len(&a);
    assert!(a.resume(), "SIGCONT operator-a");
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while !stopped(&a) {
        if log_since(&a, from).contains("created step pod") {
            // Created while it still led, before any proof read: not this
            // scenario. The try is still checked: the run goes on as usual
            // and its one step runs once.
            let mut a = a;
            a.kill().await;
            let done = s.wait_finished(RUN, TIMEOUT).await;
            assert_eq!(phase(&done), Some(RunPhase::Succeeded), "{:?}", done.status);
            let key = status(&done).steps[0].idempotency_key.clone();
            let runs = s.ledger().executions_by_key();
            assert_eq!(
                runs.get(&key),
                Some(&1),
                "a try not exercised ran twice: {runs:?}"
            );
            pair.stop().await;
            s.finish().await;
            return false;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the operator never stopped after its proof read\n{}",
            a.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    wait_holder(&pair.leases, "operator-b", &[pair.ops[1].as_ref().unwrap()]).await;
    let done = s.wait_finished(RUN, TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Succeeded), "{:?}", done.status);
    let cp = status(&done).steps[0].clone();
    let pod = cp.pod.clone().expect("attempt 1's Pod");
    let pods = s.pods();
    pods.delete(&pod, &DeleteParams::default())
        .await
        .expect("deleting attempt 1's finished Pod");
    agentrun_e2e::wait_for_deleted(&pods, &pod, TIMEOUT).await;

    // A wakes to the answer of its proof read, from before its sleep.
    let after = pair.resume(0, a).await;
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
    true
}
