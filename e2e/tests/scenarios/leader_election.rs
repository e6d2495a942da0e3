//! Leader election: of two operators only the leader acts, and the standby
//! takes over when it dies without running any step twice; a leader
//! restarted with the same identity takes its Lease back at once.

use std::time::Duration;

use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{RunPhase, StepPhase};
use serde_json::json;

use super::RUN_TIMEOUT;

/// The Lease's duration in the same-identity test.
const LEASE_SECONDS: u64 = 30;

#[tokio::test]
async fn two_operators_one_acts_and_the_standby_takes_over_without_duplicates() {
    let s = Scenario::start_without_operator("leader-election").await;
    let mut a_cfg = s.operator_config.clone();
    a_cfg.leader_elect = true;
    a_cfg.identity = "operator-a".into();
    let mut b_cfg = a_cfg.clone();
    b_cfg.identity = "operator-b".into();
    b_cfg.metrics_port = agentrun_e2e::support::processes::free_port();
    b_cfg.health_port = agentrun_e2e::support::processes::free_port();
    let mut a = agentrun_e2e::support::processes::start_operator(&a_cfg);
    // Let A take the lease first.
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> = s.env().api();
    let holder = || agentrun_e2e::support::scenario::lease_holder(&leases);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while holder().await.as_deref() != Some("operator-a") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "operator-a never took the lease\n{}",
            a.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut b = agentrun_e2e::support::processes::start_operator(&b_cfg);

    let slow = json!({"steps": (0..6).map(|i| sim_step(&format!("s{i}"), "NonIdempotent", json!({"runMs": 700}))).collect::<Vec<_>>()});
    s.create_run("ha", slow).await;
    s.wait_run("ha", "past its second step", RUN_TIMEOUT, |r| {
        status(r)
            .steps
            .iter()
            .filter(|c| c.phase == StepPhase::Succeeded)
            .count()
            >= 2
    })
    .await;
    // The standby's log is read only once it shows a line it must have (it
    // waits for the lease): a missing or wrong log never passes for a quiet one.
    let b_log = std::fs::read_to_string(b.log_path()).expect("the standby's log");
    assert!(
        b_log.contains("waiting for the leader lease") && b_log.contains("operator-b"),
        "the standby's log does not show it waiting for the lease:\n{b_log}"
    );
    assert!(
        !b_log.contains("created step pod") && !b_log.contains("acquired the leader lease"),
        "the standby acted:\n{b_log}"
    );
    a.kill().await;

    let run = s.wait_finished("ha", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded));
    assert_eq!(holder().await.as_deref(), Some("operator-b"));
    let executions = s.ledger().executions_by_key();
    assert_eq!(executions.len(), 6);
    assert!(
        executions.values().all(|n| *n == 1),
        "no step ran twice: {executions:?}"
    );
    let pods = s.list_pods().await.len();
    assert_eq!(pods, 6, "no duplicate pods");
    b.kill().await;
    s.finish().await;
}

/// An instance restarted with the same identity (a Pod that restarts in place)
/// takes its Lease back at once instead of waiting for it to expire.
#[tokio::test]
async fn restarted_leader_with_the_same_identity_takes_its_lease_back_at_once() {
    let mut s = Scenario::start_without_operator("lease-same-identity").await;
    let mut cfg = s.operator_config.clone();
    cfg.leader_elect = true;
    cfg.identity = "operator-same".into();
    // A Lease that outlives the restart by far: an operator that waited for
    // it to expire would act 30 s after the kill, one that takes it back at
    // once within seconds, so the bound below has a wide margin on a loaded
    // machine (with the default 6 s it had one second).
    cfg.lease_duration_seconds = LEASE_SECONDS;
    s.operator_config = cfg;
    s.start_operator(None);
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> = s.env().api();
    let renewed = || async {
        leases
            .get_opt("agentrun-operator")
            .await
            .ok()
            .flatten()
            .and_then(|l| l.spec)
            .filter(|spec| spec.holder_identity.as_deref() == Some("operator-same"))
            .and_then(|spec| spec.renew_time.or(spec.acquire_time))
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while renewed().await.is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the operator never took the lease"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // SIGKILL: the Lease is not released and stays valid for its 30 s.
    s.kill_operator().await;
    s.start_operator(None);
    let restarted = tokio::time::Instant::now();
    s.create_run(
        "after-restart",
        json!({"steps": [sim_step("only", "None", json!({"runMs": 10}))]}),
    )
    .await;
    let run = s.wait_finished("after-restart", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded));
    let took = restarted.elapsed();
    assert!(
        took < Duration::from_secs(LEASE_SECONDS / 2),
        "the restarted leader acted after {took:?}: it waited for its own Lease to expire"
    );
    s.finish().await;
}
