//! An API server that stops answering some requests (a half-open
//! connection, a stuck etcd range, an overloaded aggregation layer): the
//! Kubernetes client has no read timeout, so without a bound of its own a
//! reconcile waiting on such a request would hold one of the operator's
//! reconcile slots forever, and sixteen of them would stop every run.
//!
//! ```text
//!   operator ──▶ FaultProxy ──▶ kube-apiserver
//!                  └─ every request about runs stuck-00 … stuck-15 held back for 5 min
//!   run `free` must still finish
//! ```

use std::time::Duration;

use agentrun_e2e::chaos::proxy::FaultProxy;
use agentrun_e2e::support::processes::{log_dir, start_operator};
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step};
use agentrun_operator::api::RunPhase;
use serde_json::json;

/// More runs than the operator has reconcile slots (16).
const STUCK: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_whose_requests_hang_do_not_stop_the_others() {
    let mut s = Scenario::start_without_operator("hung-requests").await;
    let p = FaultProxy::quiet().await;
    // Every request naming a stuck run (its reads and status writes) waits
    // five minutes before it is forwarded; list and watch requests of the
    // collection are not held back.
    p.stall("/agentruns/stuck-", false, Duration::from_secs(300));
    let kubeconfig = log_dir(s.namespace()).join("operator-kubeconfig");
    p.write_kubeconfig(&kubeconfig, s.namespace())
        .expect("writing the proxy kubeconfig");
    s.operator_config.kubeconfig = kubeconfig;
    s.operator_config
        .extra_env
        .push(("AGENTRUN_RECONCILE_TIMEOUT_SECONDS".into(), "3".into()));

    let step = || json!({"steps": [sim_step("only", "None", json!({"runMs": 50}))]});
    for i in 0..STUCK {
        s.create_run(&format!("stuck-{i:02}"), step()).await;
    }
    s.operator = Some(start_operator(&s.operator_config));
    // Let every stuck run take a slot and block on its first status write.
    tokio::time::sleep(Duration::from_secs(2)).await;
    s.create_run("free", step()).await;
    let run = s.wait_finished("free", Duration::from_secs(60)).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);

    // The stuck runs said nothing (their writes never arrived), and the
    // operator says why it gave up on them.
    let log = std::fs::read_to_string(s.operator.as_ref().unwrap().log_path()).unwrap();
    assert!(
        log.contains("did not finish within 3s"),
        "the operator does not say it abandoned the hung reconciles:\n{}",
        s.operator.as_ref().unwrap().log_tail(40)
    );
    p.end_stalls_in(Duration::ZERO);
    s.finish().await;
}
